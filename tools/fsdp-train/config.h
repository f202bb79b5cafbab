// fsdp-train's run configuration: the command-line flags, their checks, and
// the part of them that a checkpoint must agree with on --resume.
#pragma once

#include <fsdp/options.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdp_train {

// A mistake in the flags or in what they point at, found alike on every rank
// (so the job ends with one message and no MPI_Abort).
struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct TrainConfig {
  // Model (fixed by the job; recorded in checkpoints). --model sets hidden,
  // heads and (unless --layers is given) layers.
  std::string model = "plan";  // plan (3.3M parameters) | large (~202M)
  int64_t vocab = 256;
  int64_t hidden = 256;
  int64_t heads = 4;
  int64_t layers = 4;
  bool layers_given = false;
  // auto | deferred | full. deferred: built on the meta device, sharded, then
  // only the shards allocated and initialised (fsdp/deferred_init.h); full:
  // built and initialised whole on every rank, then sharded (what --tp, --pp
  // and --moe need). auto: deferred where it applies. Resolved by resolve().
  std::string init = "auto";
  std::string load;  // --load: pretrained weights (fsdp::load_weights)
  std::string load_prefix = "model/";  // --load-prefix: the file's names = prefix + parameter name

  std::string mesh;  // data-parallel part: "" = the world / (tp pp); "N" or "RxS"
  int64_t tp = 1;    // tensor-parallel size: the mesh is (mesh..., tp)
  bool sequence_parallel = false;
  bool loss_parallel = false;
  // Pipeline parallelism: the mesh is (pp, mesh...), pp outermost.
  int64_t pp = 1;
  std::string schedule;         // "" = 1f1b (with --pp)
  int64_t microbatches = 0;     // 0 = one per sequence of the per-pipeline batch
  int64_t stages_per_rank = 0;  // 0 = 1, or 2 for interleaved
  // Mixture of experts: models::MoEDecoder (odd layers MoE) on an
  // (efsdp = world / ep, ep) mesh. 0 = the default with --moe (4, 2, 1);
  // without --moe a non-zero value is a flag error.
  bool moe = false;
  int64_t experts = 0;
  int64_t top_k = 0;
  int64_t ep = 0;
  std::string device = "auto";  // auto | cpu | cuda
  std::string mp = "fp32";
  // true | false | <ranks> (hpZ) | node (hpZ within each node): --reshard-after-forward.
  std::string reshard_after_forward = "true";
  bool reshard_after_forward_given = false;  // --reshard-after-forward on the command line
  std::string ac = "none";
  int64_t steps = 100;
  int64_t batch = 8;
  int64_t seq = 128;
  double lr = 3e-3;
  double adam_eps = 1e-8;  // AdamW's eps (--adam-eps)
  uint64_t seed = 0;
  double clip = 1.0;
  std::string out = "fsdp-train-out";
  std::string data;
  int64_t checkpoint_every = 0;  // 0 = at the end only
  bool async_save = true;        // fsdp::dcp::AsyncSaver (false: fsdp::dcp::save)
  bool resume = false;
  bool verify = false;
  double verify_tol = 0.0;  // 0 = default for the precision
  bool comm_report = false;  // --comm-report: per-group communication summary at the end
  int64_t log_every = 0;    // 0 = automatic

  // Resolved by resolve().
  std::vector<int64_t> mesh_shape;  // the data-parallel dims, without tp or pp
  int64_t dp_size = 1;  // data-parallel ranks (= world size / (tp pp))

  // bf16 compute: --mp bf16, and --mp fp8 (float8 all-gather, bf16 compute).
  bool bf16() const { return mp == "bf16" || mp == "fp8"; }
  bool fp8() const { return mp == "fp8"; }
  bool deferred() const { return init == "deferred"; }
  bool hsdp() const { return mesh_shape.size() == 2; }
  bool pipelined() const { return pp > 1; }
  int64_t num_stages() const { return pp * stages_per_rank; }
  int64_t efsdp() const { return dp_size / ep; }
  // Sequences per data-parallel rank (with --pp: a pipeline's batch).
  int64_t local_batch() const { return batch / dp_size; }
  // "[2] (FSDP)", "[2x2] (replicate x shard, HSDP)", "[2] x tp 2 (FSDP + TP, ...)",
  // "pp 2 x [2] (PP + FSDP, 1f1b, 4 microbatches)",
  // "[4] (FSDP; experts: efsdp 2 x ep 2, 4 experts, top-2)"
  std::string mesh_string() const;
  double tolerance() const;
};

// Registers every flag on `app`, writing into `cfg`.
void add_flags(CLI::App& app, TrainConfig& cfg);

// Parses the mesh, checks every flag against the world size and the corpus
// size; ConfigError naming the flag otherwise. Whether the model's dims
// divide by --tp is the TP layers' check (see shard_decoder). With --pp:
// resolves --schedule, --stages-per-rank and --microbatches, and checks that
// the layers split into the stages and the microbatches into the batch.
// With --moe: resolves --experts, --top-k and --ep and checks them against
// each other and the world size (and that --tp, --pp and HSDP are off).
void resolve(TrainConfig& cfg, int world_size, int64_t data_bytes);

// What a checkpoint records and --resume requires to match: everything that
// changes the model or the optimisation (model dims, --layers, --moe,
// --experts, --top-k, --mp, --batch (global), --seq, --seed, --lr,
// --adam-eps, --clip, --data), keyed by the flag that sets it.
// --reshard-after-forward as fully_shard takes it (resolve() checked it).
fsdp::ReshardAfterForward reshard_after_forward_option(const TrainConfig& cfg);

nlohmann::json numerics_json(const TrainConfig& cfg, int64_t data_bytes, uint64_t data_hash);

// What a checkpoint records of its layout and --resume may change: the
// world size, --mesh, --tp (with --sequence-parallel / --loss-parallel),
// --pp (--schedule, --stages-per-rank, --microbatches), --ep,
// --reshard-after-forward and --ac. These change how the numbers are
// computed (the reduction order), not what they are.
nlohmann::json layout_json(const TrainConfig& cfg, int world_size);
// "mesh 2x2", "mesh 2, tp 2", "mesh 2, pp 2 (1f1b)", "mesh 4, ep 2".
std::string layout_string(const nlohmann::json& layout);

// Throws ConfigError naming the first flag where `saved` and `current`
// differ, with both values ("--lr: the checkpoint <where> was saved with
// 0.003, this run has 0.001; ...").
void check_same_numerics(const nlohmann::json& saved, const nlohmann::json& current,
                         const std::string& where);

}  // namespace fsdp_train
