#include "config.h"

#include <fsdp/float8.h>
#include <fmt/format.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>

#ifndef FSDP_TRAIN_CORPUS
#error "FSDP_TRAIN_CORPUS must name the source tree's data/corpus/corpus.txt"
#endif

namespace fsdp_train {

namespace {

// A flag error found while parsing, before any file is read: a
// CLI::ParseError with fsdp-train's flag-error exit status 2, printed by the
// failure message add_flags installs as the one line a ConfigError gives.
struct FlagError : CLI::ParseError {
  explicit FlagError(std::string msg) : CLI::ParseError(std::move(msg), 2) {}
};

// Bounds that keep the products of the flags (tokens per step, the
// attention's seq x seq, loop counters) far from int64 overflow; a demo job
// stays well inside them.
constexpr int64_t kMaxSteps = 1000000000;           // 1e9 optimizer steps
constexpr int64_t kMaxTokensPerStep = int64_t{1} << 31;  // --batch x (--seq + 1)
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxExperts = 1024;

int64_t parse_dim(const std::string& text, const std::string& spec) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || v < 1) {
    throw ConfigError(fmt::format(
        "--mesh '{}': expected N (1-D FSDP) or RxS (HSDP: replicate x shard), positive integers",
        spec));
  }
  return v;
}

// --schedule, --stages-per-rank and --microbatches against --pp, --layers and
// the per-pipeline batch (the checks fsdp::pp::build_schedule would make,
// named by the flags).
void resolve_pipeline(TrainConfig& cfg) {
  if (cfg.schedule.empty()) cfg.schedule = "1f1b";
  const bool interleaved = cfg.schedule == "interleaved";
  if (cfg.stages_per_rank == 0) cfg.stages_per_rank = interleaved ? 2 : 1;
  // Each stage holds at least one layer: bounded by --layers before
  // --pp x --stages-per-rank is formed.
  if (cfg.stages_per_rank < 1 || cfg.stages_per_rank > cfg.layers) {
    throw ConfigError(fmt::format("--stages-per-rank {}: must be in [1, --layers {}]",
                                  cfg.stages_per_rank, cfg.layers));
  }
  if (cfg.stages_per_rank > 1 && !interleaved) {
    throw ConfigError(fmt::format(
        "--stages-per-rank {}: only --schedule interleaved runs several stages per rank "
        "(--schedule {} runs one)",
        cfg.stages_per_rank, cfg.schedule));
  }
  const int64_t stages = cfg.num_stages();
  if (cfg.layers < stages || cfg.layers % stages != 0) {
    throw ConfigError(fmt::format(
        "--layers {}: the decoder's {} layers do not split evenly into {} pipeline stages "
        "(--pp {} x --stages-per-rank {}); use a number of layers divisible by {}",
        cfg.layers, cfg.layers, stages, cfg.pp, cfg.stages_per_rank, stages));
  }
  const int64_t local = cfg.local_batch();
  if (cfg.microbatches == 0) cfg.microbatches = local;
  const std::string per_pipeline =
      fmt::format("per-pipeline batch {} = --batch {} / {} data-parallel rank{}", local,
                  cfg.batch, cfg.dp_size, cfg.dp_size == 1 ? "" : "s");
  if (cfg.microbatches < 1 || local % cfg.microbatches != 0) {
    throw ConfigError(fmt::format("--microbatches {}: must divide the {}", cfg.microbatches,
                                  per_pipeline));
  }
  if (cfg.schedule != "gpipe" && cfg.microbatches < cfg.pp) {
    throw ConfigError(fmt::format(
        "--microbatches {}: --schedule {} needs at least --pp {} microbatches ({})",
        cfg.microbatches, cfg.schedule, cfg.pp, per_pipeline));
  }
  if (interleaved && cfg.microbatches % cfg.pp != 0) {
    throw ConfigError(fmt::format(
        "--microbatches {}: --schedule interleaved needs a multiple of --pp {} ({})",
        cfg.microbatches, cfg.pp, per_pipeline));
  }
}

// --experts, --top-k and --ep against each other, the world and the other
// parallelisms (the checks fsdp::moe's constructors would make, named by the
// flags).
void resolve_moe(TrainConfig& cfg, int world_size) {
  if (!cfg.moe) {
    const char* flag = cfg.experts != 0 ? "--experts"
                       : cfg.top_k != 0 ? "--top-k"
                       : cfg.ep != 0    ? "--ep"
                                        : nullptr;
    if (flag != nullptr) throw ConfigError(fmt::format("{}: needs --moe", flag));
    cfg.ep = 1;
    return;
  }
  if (cfg.tp > 1 || cfg.pp > 1) {
    throw ConfigError(fmt::format(
        "--moe: the mixture of experts does not combine with {} {} in fsdp-train; its layout "
        "is data parallel over every rank, the experts split over --ep",
        cfg.tp > 1 ? "--tp" : "--pp", cfg.tp > 1 ? cfg.tp : cfg.pp));
  }
  if (cfg.mesh.find('x') != std::string::npos) {
    throw ConfigError(fmt::format(
        "--mesh {}: --moe shards the dense weights over every rank (1-D) and the experts over "
        "(efsdp, ep); HSDP is not offered with --moe",
        cfg.mesh));
  }
  if (cfg.experts == 0) cfg.experts = 4;
  if (cfg.top_k == 0) cfg.top_k = 2;
  if (cfg.ep == 0) cfg.ep = 1;
  if (cfg.experts < 1 || cfg.experts > kMaxExperts) {
    throw ConfigError(fmt::format("--experts {}: must be in [1, {}]", cfg.experts, kMaxExperts));
  }
  if (cfg.top_k < 1 || cfg.top_k > cfg.experts) {
    throw ConfigError(fmt::format("--top-k {}: must be in [1, --experts {}]", cfg.top_k,
                                  cfg.experts));
  }
  if (cfg.ep < 1) throw ConfigError(fmt::format("--ep {}: must be >= 1", cfg.ep));
  if (world_size % cfg.ep != 0) {
    throw ConfigError(fmt::format(
        "--ep {}: the job has {} ranks (mpiexec -n {}), which do not divide by the ep size",
        cfg.ep, world_size, world_size));
  }
  if (cfg.experts % cfg.ep != 0) {
    throw ConfigError(fmt::format(
        "--ep {}: --experts {} do not split evenly over {} ep ranks; use a divisor of the "
        "expert count",
        cfg.ep, cfg.experts, cfg.ep));
  }
  if (cfg.layers < 2) {
    throw ConfigError(fmt::format(
        "--layers {}: the MoE decoder's odd layers are its MoE layers; use at least 2",
        cfg.layers));
  }
}

// --model large's dims; --init and --load against the model's structure.
void resolve_model_and_init(TrainConfig& cfg) {
  if (cfg.model == "large") {
    cfg.hidden = 1024;
    cfg.heads = 16;
    if (!cfg.layers_given) cfg.layers = 16;
  }
  const bool structured = cfg.tp > 1 || cfg.pp > 1 || cfg.moe;
  // The flag that gives the model its structure (with `structured`).
  const char* structure_flag = cfg.tp > 1 ? "--tp" : cfg.pp > 1 ? "--pp" : "--moe";
  if (cfg.init == "deferred" && structured) {
    throw ConfigError(fmt::format(
        "--init deferred: {} builds its model from a whole one (use --init full or auto)",
        structure_flag));
  }
  if (cfg.init == "auto") cfg.init = structured ? "full" : "deferred";
  if (!cfg.load.empty()) {
    if (structured) {
      throw ConfigError(fmt::format(
          "--load {}: loads into the FSDP/HSDP decoder only, not with {}", cfg.load,
          structure_flag));
    }
    if (cfg.resume) {
      throw ConfigError(fmt::format(
          "--load {}: --resume continues from the run's own checkpoint; use one of them",
          cfg.load));
    }
    std::error_code ec;
    if (!std::filesystem::exists(cfg.load, ec)) {
      throw ConfigError(fmt::format("--load {}: no such file or directory", cfg.load));
    }
  }
}

// --reshard-after-forward: true, false, node or a rank count; no hpZ with --pp.
void check_reshard_after_forward(const TrainConfig& cfg) {
  const std::string& v = cfg.reshard_after_forward;
  const bool count = !v.empty() && v.size() < 9 &&
                     v.find_first_not_of("0123456789") == std::string::npos && std::stoi(v) > 0;
  if (v != "true" && v != "false" && v != "node" && !count) {
    throw ConfigError(fmt::format(
        "--reshard-after-forward {}: accepted: true, false, node, or a rank count >= 1", v));
  }
  if (cfg.pp > 1 && (count || v == "node")) {
    throw ConfigError(fmt::format(
        "--reshard-after-forward {}: hpZ does not combine with --pp (each stage keeps its "
        "layers gathered across microbatches, or re-gathers them: true | false)",
        v));
  }
}

// --tp and --pp against each other and the world size; the pipeline-only
// flags without --pp.
void resolve_tp_and_pp(TrainConfig& cfg, int world_size) {
  if (cfg.tp < 1) throw ConfigError(fmt::format("--tp {}: must be >= 1", cfg.tp));
  if (cfg.tp == 1 && (cfg.sequence_parallel || cfg.loss_parallel)) {
    throw ConfigError(fmt::format("{}: needs tensor parallelism (--tp 2 or more)",
                                  cfg.sequence_parallel ? "--sequence-parallel"
                                                        : "--loss-parallel"));
  }
  if (world_size % cfg.tp != 0) {
    throw ConfigError(fmt::format(
        "--tp {}: the job has {} ranks (mpiexec -n {}), which do not divide by the tp size",
        cfg.tp, world_size, world_size));
  }
  if (cfg.pp < 1) throw ConfigError(fmt::format("--pp {}: must be >= 1", cfg.pp));
  if (cfg.pp == 1) {
    const char* flag = !cfg.schedule.empty()      ? "--schedule"
                       : cfg.microbatches != 0    ? "--microbatches"
                       : cfg.stages_per_rank != 0 ? "--stages-per-rank"
                                                  : nullptr;
    if (flag != nullptr) {
      throw ConfigError(
          fmt::format("{}: needs pipeline parallelism (--pp 2 or more)", flag));
    }
    cfg.stages_per_rank = 1;
  } else {
    if (cfg.tp > 1) {
      throw ConfigError(fmt::format(
          "--pp {}: pipeline parallelism does not combine with --tp {} in fsdp-train; use one "
          "of them (with data parallelism over the other ranks)",
          cfg.pp, cfg.tp));
    }
    if (world_size % cfg.pp != 0) {
      throw ConfigError(fmt::format(
          "--pp {}: the job has {} ranks (mpiexec -n {}), which do not divide by the pp size",
          cfg.pp, world_size, world_size));
    }
  }
}

// --mesh into mesh_shape, its product times tp x pp equal to the world size;
// the data-parallel size.
void resolve_mesh(TrainConfig& cfg, int world_size) {
  const int64_t model_parallel = cfg.tp * cfg.pp;
  if (cfg.mesh.empty()) {
    cfg.mesh_shape = {world_size / model_parallel};
  } else {
    const auto x = cfg.mesh.find('x');
    if (x == std::string::npos) {
      cfg.mesh_shape = {parse_dim(cfg.mesh, cfg.mesh)};
    } else {
      cfg.mesh_shape = {parse_dim(cfg.mesh.substr(0, x), cfg.mesh),
                        parse_dim(cfg.mesh.substr(x + 1), cfg.mesh)};
    }
  }
  // A dim above the world size cannot be part of a product equal to it (and
  // could overflow the product).
  // Two dims below 2^31 multiply without overflow; a larger one is reported
  // as "more than" the world size.
  int64_t product = 1;
  bool beyond = false;
  for (auto d : cfg.mesh_shape) {
    if (d > std::numeric_limits<int32_t>::max()) beyond = true;
    product = beyond ? int64_t{world_size} + 1 : product * d;
  }
  if (beyond || product * model_parallel != world_size) {
    const std::string with = cfg.tp > 1   ? fmt::format(" with --tp {}", cfg.tp)
                             : cfg.pp > 1 ? fmt::format(" with --pp {}", cfg.pp)
                                          : "";
    throw ConfigError(fmt::format(
        "--mesh {}: the mesh has {} ranks{} but the job has {} (mpiexec -n {}); the product of "
        "the mesh dims{} must equal the world size",
        cfg.mesh,
        beyond ? fmt::format("more than {}", world_size)
               : std::to_string(product * model_parallel),
        with, world_size, world_size,
        cfg.tp > 1 ? " times --tp" : cfg.pp > 1 ? " times --pp" : ""));
  }
  // FSDP and HSDP alike: every data-parallel coordinate takes its own slice
  // of the global batch, shared by the tp ranks there (by the stages of its
  // pipeline with --pp).
  cfg.dp_size = world_size / model_parallel;
}

// --steps, --seq and --batch against their bounds, the corpus and the
// data-parallel size.
void check_steps_and_batch(const TrainConfig& cfg, int64_t data_bytes) {
  if (cfg.steps < 1 || cfg.steps > kMaxSteps) {
    throw ConfigError(fmt::format("--steps {}: must be in [1, {}]", cfg.steps, kMaxSteps));
  }
  if (cfg.seq < 1) throw ConfigError(fmt::format("--seq {}: must be >= 1", cfg.seq));
  // Before --seq + 1 is formed (--seq 2^63 - 1 overflowed it).
  if (cfg.seq >= data_bytes) {
    throw ConfigError(fmt::format("--data {}: {} bytes, fewer than --seq + 1 (--seq {}); "
                                  "accepted: --seq below the corpus size",
                                  cfg.data, data_bytes, cfg.seq));
  }
  if (cfg.batch < 1 || cfg.batch % cfg.dp_size != 0) {
    throw ConfigError(fmt::format(
        "--batch {}: the global batch must be a positive multiple of the data-parallel size {}",
        cfg.batch, cfg.dp_size));
  }
  // --batch x (--seq + 1) tokens are drawn per step: 2^62 sequences
  // overflowed the product and ended in a LibTorch stack trace.
  if (cfg.batch > kMaxTokensPerStep / (cfg.seq + 1)) {
    throw ConfigError(fmt::format(
        "--batch {}: --batch x (--seq + 1) = {} x {} tokens per step exceeds {}; accepted: "
        "--batch <= {} at --seq {}",
        cfg.batch, cfg.batch, cfg.seq + 1, kMaxTokensPerStep,
        kMaxTokensPerStep / (cfg.seq + 1), cfg.seq));
  }
}

// The optimizer, checkpoint, logging and verification flags; --log-every's
// default.
void resolve_training_flags(TrainConfig& cfg) {
  if (!(cfg.adam_eps > 0) || !std::isfinite(cfg.adam_eps)) {
    throw ConfigError(fmt::format("--adam-eps {}: must be > 0", cfg.adam_eps));
  }
  if (!(cfg.lr > 0) || !std::isfinite(cfg.lr)) {
    throw ConfigError(fmt::format("--lr {}: must be > 0", cfg.lr));
  }
  if (!(cfg.clip >= 0) || !std::isfinite(cfg.clip)) {
    throw ConfigError(fmt::format("--clip {}: must be >= 0 (0: no clipping)", cfg.clip));
  }
  if (cfg.checkpoint_every < 0) {
    throw ConfigError(fmt::format("--checkpoint-every {}: must be >= 0", cfg.checkpoint_every));
  }
  if (cfg.log_every < 0) throw ConfigError(fmt::format("--log-every {}: must be >= 0", cfg.log_every));
  if (cfg.log_every == 0) cfg.log_every = cfg.steps > 200 ? cfg.steps / 100 : 1;
  // NaN passed the old `< 0` test (and meant the default); inf let every
  // comparison pass.
  if (!(cfg.verify_tol >= 0) || !std::isfinite(cfg.verify_tol)) {
    throw ConfigError(fmt::format("--verify-tol {}: must be a finite number > 0", cfg.verify_tol));
  }
  if (cfg.out.empty()) throw ConfigError("--out: empty path");
  if (cfg.fp8() && !fsdp::float8_supported()) {
    throw ConfigError(fmt::format("--mp fp8: this LibTorch ({}) has no float8 dtypes; use a "
                                  "LibTorch 2.1 or later (ci/pip-torch.sh), or --mp bf16",
                                  TORCH_VERSION));
  }
  if (cfg.fp8() && cfg.verify) {
    throw ConfigError("--mp fp8 --verify: the single-card reference computes in bf16 and the "
                      "float8 gather rounds the weights further by design; compare loss curves "
                      "(docs/float8.md) instead");
  }
}

// --mesh, --tp, --pp and --moe with their options: how the ranks split the
// model and the data.
void add_parallel_flags(CLI::App& app, TrainConfig& cfg) {
  app.add_option("--mesh", cfg.mesh,
                 "the data-parallel mesh: N (1-D FSDP) or RxS (HSDP: R replicas x S shards); "
                 "the product times --tp times --pp must be the world size [default: 1-D, "
                 "world / (tp pp)]");
  app.add_option("--tp", cfg.tp,
                 "tensor-parallel size: the mesh is (--mesh..., tp), each tp group of adjacent "
                 "ranks splitting heads, SwiGLU and vocab (Megatron layout) and training on one "
                 "data-parallel slice")
      ->capture_default_str();
  app.add_flag("--sequence-parallel", cfg.sequence_parallel,
               "with --tp: split the activations between blocks on the sequence dim over tp "
               "(--seq must divide by tp)");
  app.add_flag("--loss-parallel", cfg.loss_parallel,
               "with --tp: cross-entropy on the vocab-split logits, never gathering them");
  app.add_option("--pp", cfg.pp,
                 "pipeline-parallel size: the mesh is (pp, --mesh...), pp outermost; the decoder's "
                 "layers are cut into pp x --stages-per-rank stages (embedding on the first, "
                 "final norm and output on the last), each stage sharded over its data-parallel "
                 "ranks, which all read the same rows")
      ->capture_default_str();
  app.add_option("--schedule", cfg.schedule,
                 "with --pp: gpipe (all forwards, then all backwards), 1f1b, or interleaved "
                 "(interleaved 1F1B, several stages per rank) [default: 1f1b]")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved"}));
  app.add_option("--microbatches", cfg.microbatches,
                 "with --pp: microbatches per step, dividing the per-pipeline batch (--batch / "
                 "data-parallel ranks); 1f1b and interleaved need at least --pp, interleaved a "
                 "multiple of it [default: one per sequence]");
  app.add_option("--stages-per-rank", cfg.stages_per_rank,
                 "with --pp: pipeline stages on each rank (looped: rank r holds stages r, r + pp, "
                 "...); more than 1 needs --schedule interleaved [default: 1, 2 for interleaved]");
  app.add_flag("--moe", cfg.moe,
               "train the mixture-of-experts decoder (models::MoEDecoder: odd layers route each "
               "byte to --top-k of --experts SwiGLU experts): dense weights sharded over every "
               "rank, the experts split over --ep and sharded over the world / ep ranks that "
               "own the same ones");
  app.add_option("--experts", cfg.experts,
                 "with --moe: experts per MoE layer, divisible by --ep [default: 4]");
  app.add_option("--top-k", cfg.top_k,
                 "with --moe: experts each token is routed to, in [1, --experts] [default: 2]");
  app.add_option("--ep", cfg.ep,
                 "with --moe: expert-parallel size, dividing the world and --experts; ep rank r "
                 "owns experts [r E/ep, (r+1) E/ep) [default: 1, every rank every expert]");
}

// The model, its initialisation or weights, device, precision, resharding and
// activation checkpointing.
void add_model_flags(CLI::App& app, TrainConfig& cfg) {
  app.add_option("--model", cfg.model,
                 "plan: the plan's byte decoder (hidden 256, 4 heads, 4 layers: 3.3M "
                 "parameters); large: hidden 1024, 16 heads, 16 layers (202M parameters, 808 MB "
                 "in fp32)")
      ->check(CLI::IsMember({"plan", "large"}))
      ->capture_default_str();
  app.add_option("--layers", cfg.layers,
                 "decoder layers (with --pp they must divide by the number of stages; with "
                 "--moe at least 2) [default: 4, or --model's]")
      ->each([&cfg](const std::string&) { cfg.layers_given = true; });
  app.add_option("--init", cfg.init,
                 "deferred: build the model on the meta device, shard it, then allocate and "
                 "initialise only this rank's shards (peak: the shards, not the model); full: "
                 "build and initialise the whole model on every rank, then shard it (--tp, --pp "
                 "and --moe need it); auto: deferred where it applies")
      ->check(CLI::IsMember({"auto", "deferred", "full"}))
      ->capture_default_str();
  app.add_option("--load", cfg.load,
                 "start from pretrained weights: a .safetensors or full-tensor .h5 file "
                 "(fsdp-checkpoint export writes both) or a distributed checkpoint; each rank "
                 "reads only its shards' rows");
  app.add_option("--load-prefix", cfg.load_prefix,
                 "with --load: the file names parameter P as <prefix>P (fsdp-train's checkpoints "
                 "and their exports: model/; '' for a file of bare names)")
      ->capture_default_str();
  app.add_option("--device", cfg.device,
                 "where parameters, activations and batches live: auto (cuda:<local rank> when "
                 "LibTorch sees a GPU, else cpu), cpu, or cuda (an error without a GPU)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--mp", cfg.mp,
                 "fp32; bf16 (bf16 parameters/compute, fp32 gradient reduction); or fp8 (as bf16, "
                 "matrix weights all-gathered in float8 e4m3 with per-row scales: "
                 "fsdp::float8_all_gather; needs LibTorch >= 2.1)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp8"}))
      ->capture_default_str();
  app.add_option("--reshard-after-forward", cfg.reshard_after_forward,
                 "free the gathered parameters after forward (true|false), or keep them sharded "
                 "over N consecutive ranks (an integer: hpZ, backward gathers among them) or "
                 "over each node's ranks (node); default: every "
                 "unit but the root, whose parameters backward needs at once (FSDP2's "
                 "default); with --pp the default is false: each stage's layers stay gathered "
                 "across the step's microbatches (one all-gather per layer per step), true "
                 "re-gathers them for each microbatch")
      ->each([&cfg](const std::string&) { cfg.reshard_after_forward_given = true; })
      ->default_str("all but the root");
  app.add_option("--ac", cfg.ac, "activation checkpointing of the decoder layers: none|all|every-2")
      ->check(CLI::IsMember({"none", "all", "every-2"}))
      ->capture_default_str();
}

// Steps, batches, the optimizer, the seed and the data; --out.
void add_training_flags(CLI::App& app, TrainConfig& cfg) {
  app.add_option("--steps", cfg.steps, "optimizer steps (in all, counting resumed ones)")
      ->capture_default_str();
  app.add_option("--batch", cfg.batch,
                 "global batch in sequences (divisible by the data-parallel size)")
      ->capture_default_str();
  app.add_option("--seq", cfg.seq, "sequence length in bytes")->capture_default_str();
  app.add_option("--lr", cfg.lr, "AdamW learning rate (weight decay 0)")->capture_default_str();
  app.add_option("--adam-eps", cfg.adam_eps,
                 "AdamW eps. --verify compares parameters elementwise: where a gradient stays "
                 "within a few eps of zero, AdamW's update lr * g / (|g| + eps) turns rounding "
                 "differences into differences of ~lr, so a larger eps makes short --tp / --pp "
                 "comparisons well-conditioned")
      ->capture_default_str();
  // CLI11 reads "-1" into the unsigned seed as 2^64 - 1: refused on the text.
  app.add_option("--seed", cfg.seed, "initial weights and batches, in [0, 2^64 - 1]")
      ->each([](const std::string& text) {
        const auto first = text.find_first_not_of(" \t");
        if (first != std::string::npos && text[first] == '-') {
          throw FlagError(fmt::format("--seed {}: must be an integer in [0, {}]", text,
                                      std::numeric_limits<uint64_t>::max()));
        }
      })
      ->capture_default_str();
  app.add_option("--clip", cfg.clip, "max global gradient norm (0: measure only)")
      ->capture_default_str();
  app.add_option("--out", cfg.out, "output directory")->capture_default_str();
  // Checked here, before the corpus is read: a directory opened as a file
  // ended in the stream's exception (and MPI_Abort).
  app.add_option("--data", cfg.data, "training text, read as bytes (a regular file)")
      ->each([](const std::string& path) {
        std::error_code ec;
        const auto status = std::filesystem::status(path, ec);
        if (ec || !std::filesystem::exists(status)) {
          throw FlagError(fmt::format("--data {}: no such file; accepted: a readable regular "
                                      "file", path));
        }
        if (!std::filesystem::is_regular_file(status)) {
          throw FlagError(fmt::format("--data {}: is {}, not a regular file; accepted: a "
                                      "readable regular file",
                                      path,
                                      std::filesystem::is_directory(status) ? "a directory"
                                                                            : "a special file"));
        }
      })
      ->capture_default_str();
}

// Checkpoints, --resume, --verify and what is printed.
void add_checkpoint_and_report_flags(CLI::App& app, TrainConfig& cfg) {
  app.add_option("--checkpoint-every", cfg.checkpoint_every,
                 "also checkpoint every N steps [default: at the end only]");
  app.add_option("--async-save", cfg.async_save,
                 "write checkpoints in the background (fsdp::dcp::AsyncSaver: the step goes on "
                 "once this rank's pieces are copied to host memory; the end of training waits "
                 "for the last one) or, false, within the step (fsdp::dcp::save)")
      ->capture_default_str();
  app.add_flag("--resume", cfg.resume,
               "continue from the newest complete checkpoint under <out>/checkpoint/, in any "
               "world size and layout (--mesh, --tp, --pp, --ep may change; the model, "
               "optimizer, precision, batch and data may not)");
  app.add_flag("--verify", cfg.verify,
               "re-run the same steps unsharded in one process on rank 0 (the plain decoder "
               "with --tp) and compare the losses and the final parameters");
  app.add_option("--verify-tol", cfg.verify_tol,
                 "max |loss difference| and |parameter difference| for --verify [default: 1e-4 "
                 "fp32, 1e-3 bf16]");
  app.add_flag("--comm-report", cfg.comm_report,
               "at the end, print every process group's communication (nodes spanned, "
               "shared-memory arena, algorithms run, bytes this rank sent to other nodes) on "
               "rank 0 and on the first rank of every other node (fsdp::describe_groups)");
  app.add_option("--log-every", cfg.log_every,
                 "progress line every N steps [default: 1, or steps/100 above 200 steps]");
}

}  // namespace

std::string TrainConfig::mesh_string() const {
  const std::string dims = mesh_shape.size() == 2
                               ? fmt::format("[{}x{}]", mesh_shape[0], mesh_shape[1])
                               : fmt::format("[{}]", mesh_shape.empty() ? 0 : mesh_shape[0]);
  if (pipelined()) {
    return fmt::format("pp {} x {} (PP + {}: {}{}, {} microbatches of {})", pp, dims,
                       hsdp() ? "HSDP" : "FSDP", schedule,
                       stages_per_rank > 1 ? fmt::format(", {} stages per rank", stages_per_rank)
                                           : "",
                       microbatches, local_batch() / microbatches);
  }
  if (moe) {
    return fmt::format("{} (FSDP; experts: efsdp {} x ep {}, {} experts, top-{})", dims, efsdp(),
                       ep, experts, top_k);
  }
  if (tp == 1) {
    return dims + (hsdp() ? " (replicate x shard, HSDP)" : " (FSDP)");
  }
  return fmt::format("{} x tp {} ({} + TP{}{})", dims, tp, hsdp() ? "HSDP" : "FSDP",
                     sequence_parallel ? ", sequence parallel" : "",
                     loss_parallel ? ", loss parallel" : "");
}

double TrainConfig::tolerance() const {
  if (verify_tol > 0) return verify_tol;
  return bf16() ? 1e-3 : 1e-4;
}

void add_flags(CLI::App& app, TrainConfig& cfg) {
  cfg.data = FSDP_TRAIN_CORPUS;
  // FlagErrors print as ConfigErrors do; CLI11's own errors keep its format.
  app.failure_message([](const CLI::App* a, const CLI::Error& e) -> std::string {
    if (dynamic_cast<const FlagError*>(&e) != nullptr) {
      return std::string("fsdp-train: error: ") + e.what() + "\n";
    }
    return CLI::FailureMessage::simple(a, e);
  });
  // In --help's order.
  add_parallel_flags(app, cfg);
  add_model_flags(app, cfg);
  add_training_flags(app, cfg);
  add_checkpoint_and_report_flags(app, cfg);
}

fsdp::ReshardAfterForward reshard_after_forward_option(const TrainConfig& cfg) {
  const std::string& v = cfg.reshard_after_forward;
  if (v == "true" || v == "false") return v == "true";
  if (v == "node") return fsdp::ReshardAfterForward::within_node();
  return std::stoi(v);
}

void resolve(TrainConfig& cfg, int world_size, int64_t data_bytes) {
  resolve_model_and_init(cfg);
  check_reshard_after_forward(cfg);
  resolve_tp_and_pp(cfg, world_size);
  if (cfg.layers < 1 || cfg.layers > kMaxLayers) {
    throw ConfigError(fmt::format("--layers {}: must be in [1, {}]", cfg.layers, kMaxLayers));
  }
  resolve_moe(cfg, world_size);
  resolve_mesh(cfg, world_size);
  check_steps_and_batch(cfg, data_bytes);
  if (cfg.pipelined()) resolve_pipeline(cfg);
  resolve_training_flags(cfg);
}

nlohmann::json numerics_json(const TrainConfig& cfg, int64_t data_bytes, uint64_t data_hash) {
  // Keyed by the flag that sets each entry, so a refusal names it; "model"
  // and "optimizer" hold what no flag changes.
  return {
      {"model", {{"vocab", cfg.vocab}, {"hidden", cfg.hidden}, {"heads", cfg.heads},
                 {"tie_output", true}}},
      {"optimizer", {{"name", "AdamW"}, {"weight_decay", 0.0}}},
      {"--layers", cfg.layers},
      {"--moe", cfg.moe},
      {"--experts", cfg.experts},
      {"--top-k", cfg.top_k},
      {"--mp", cfg.mp},
      {"--batch", cfg.batch},
      {"--seq", cfg.seq},
      {"--seed", cfg.seed},
      {"--lr", cfg.lr},
      {"--adam-eps", cfg.adam_eps},
      {"--clip", cfg.clip},
      {"--data", {{"bytes", data_bytes}, {"fnv1a64", fmt::format("{:016x}", data_hash)}}},
  };
}

nlohmann::json layout_json(const TrainConfig& cfg, int world_size) {
  return {{"world", world_size},
          {"mesh", cfg.mesh_shape},
          {"tp", cfg.tp},
          {"sequence_parallel", cfg.sequence_parallel},
          {"loss_parallel", cfg.loss_parallel},
          {"pp", cfg.pp},
          {"schedule", cfg.schedule},
          {"stages_per_rank", cfg.stages_per_rank},
          {"microbatches", cfg.microbatches},
          {"ep", cfg.ep},
          {"reshard_after_forward", cfg.reshard_after_forward_given
                                        ? nlohmann::json(cfg.reshard_after_forward)
                                        : nlohmann::json("default")},  // a string
          {"ac", cfg.ac}};
}

std::string layout_string(const nlohmann::json& layout) {
  std::string mesh;
  const auto& dims = layout.at("mesh");
  for (size_t i = 0; i < dims.size(); ++i) {
    mesh += (i ? "x" : "") + std::to_string(dims.at(i).get<int64_t>());
  }
  std::string s = "mesh " + mesh;
  if (layout.at("tp").get<int64_t>() > 1) s += fmt::format(", tp {}", layout.at("tp").get<int64_t>());
  if (layout.at("pp").get<int64_t>() > 1) {
    s += fmt::format(", pp {} ({})", layout.at("pp").get<int64_t>(),
                     layout.at("schedule").get<std::string>());
  }
  if (layout.at("ep").get<int64_t>() > 1) s += fmt::format(", ep {}", layout.at("ep").get<int64_t>());
  return s;
}

void check_same_numerics(const nlohmann::json& saved, const nlohmann::json& current,
                         const std::string& where) {
  std::vector<std::string> keys;
  for (const auto* side : {&current, &saved}) {
    for (auto it = side->begin(); it != side->end(); ++it) {
      if (std::find(keys.begin(), keys.end(), it.key()) == keys.end()) keys.push_back(it.key());
    }
  }
  auto text = [](const nlohmann::json& j, const std::string& key) {
    const auto found = j.find(key);
    return found == j.end() ? std::string("(missing)") : found->dump();
  };
  for (const auto& key : keys) {
    if (current.contains(key) && saved.contains(key) && saved.at(key) == current.at(key)) continue;
    const bool flag = key.rfind("--", 0) == 0;
    throw ConfigError(fmt::format(
        "--resume: {}{}: the checkpoint {} was saved with {}, this run has {}; a resume may "
        "change the world size, --mesh, --tp, --sequence-parallel, --loss-parallel, --pp, "
        "--schedule, --stages-per-rank, --microbatches, --ep, --device, "
        "--reshard-after-forward and --ac, but not the model, the optimizer, the precision, "
        "the batch or the data (start afresh without --resume, or with another --out)",
        flag ? "" : "the ", flag ? key : key + " (fixed by fsdp-train)", where,
        text(saved, key), text(current, key)));
  }
}

}  // namespace fsdp_train
