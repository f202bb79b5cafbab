// fsdp-bench train's configurations (the table behind --configs) and the
// checks that decide which of them run: flags against the world size, the
// device, the meshes' divisibility and the pipelines' microbatches.
#include "train_configs.h"

#include <torch/version.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <iostream>

namespace fsdp_bench::train {

const std::vector<ConfigSpec>& all_configs() {
  static const std::vector<ConfigSpec> table{
      {"single", Kind::Single, false, false,
       "full model, whole global batch, no communication; EVERY rank runs it at once (each on "
       "its share of the cores, as the parallel configs do), the step time is the slowest "
       "rank's"},
      {"ddp", Kind::Ddp, false, false,
       "full replica per rank, batch/N each; after backward all gradients are copied into one "
       "flat bucket, summed by ONE MPI_Allreduce and divided by N; no libfsdp code; does NOT "
       "overlap communication with backward"},
      {"fsdp", Kind::Fsdp, {}, false,
       "fully_shard each decoder layer then the root, reshard_after_forward unset (the "
       "default, FSDP2's: every unit but the root reshards after forward)"},
      {"fsdp-reshard-all", Kind::Fsdp, true, false,
       "as fsdp, reshard_after_forward=true (the root too: one more all-gather per step)"},
      {"fsdp-no-reshard", Kind::Fsdp, false, false, "as fsdp, reshard_after_forward=false"},
      {"fsdp-hpz", Kind::Fsdp, fsdp::ReshardAfterForward::within_node(), false,
       "as fsdp-reshard-all with reshard_after_forward=within_node() (hpZ: between forward and "
       "backward each rank keeps 1/(ranks on its node) of every layer, and backward "
       "all-gathers within the node; on one node it is fsdp-reshard-all)"},
      {"fsdp-no-prefetch", Kind::Fsdp, {}, false,
       "as fsdp without forward prefetch (set_modules_to_forward_prefetch({}) on every unit: "
       "each unit's all-gather is issued at its own pre-forward)",
       {}, fsdp::pp::ScheduleKind::OneFOneB, 1, false},
      {"fsdp-no-bwd-prefetch", Kind::Fsdp, {}, false,
       "as fsdp without backward prefetch (set_modules_to_backward_prefetch({}) on every "
       "unit: each unit's backward all-gather is issued at its own pre-backward; on the CPU "
       "the default already is)",
       {}, fsdp::pp::ScheduleKind::OneFOneB, 1, true, ConfigSpec::Backward::None},
      {"fsdp-bwd-prefetch", Kind::Fsdp, {}, false,
       "as fsdp with implicit_backward_prefetch=true (each unit's pre-backward issues the "
       "all-gather of the unit before it, FSDP2's default; the library's on CUDA only)",
       {}, fsdp::pp::ScheduleKind::OneFOneB, 1, true, ConfigSpec::Backward::Implicit},
      {"fsdp-fused", Kind::Fsdp, {}, true, "as fsdp, comm_fusion=true"},
      {"fsdp-fp8", Kind::Fsdp, {}, false,
       "as fsdp, the decoder's matrix weights all-gathered in float8 e4m3 with per-row scales "
       "(fsdp::float8_all_gather; computing in --param-dtype); LibTorch >= 2.1; only when "
       "--configs names it",
       {}, fsdp::pp::ScheduleKind::OneFOneB, 1, true, ConfigSpec::Backward::Default,
       /*float8_all_gather=*/true, /*opt_in=*/true},
      {"hsdp", Kind::Hsdp, {}, false,
       "as fsdp on a (replicate = ranks / 2, shard = 2) mesh: sharded over pairs of ranks, "
       "gradients all-reduced across the pairs"},
      {"fsdp-tp", Kind::FsdpTp, true, false,
       "models::TPDecoder (Megatron column/row-parallel layers, vocab-parallel tied "
       "embedding; the same initial weights, sliced) over tp on a (shard, tp) mesh, then as "
       "fsdp over shard; the tp ranks of one shard coordinate take the same batch slice",
       {/*sequence_parallel=*/false, /*loss_parallel=*/false}},
      {"fsdp-tp-sp", Kind::FsdpTp, true, false,
       "as fsdp-tp, sequence parallel (activations between blocks split over tp on seq) and "
       "loss parallel (cross-entropy on the vocab slices; the logits are never gathered)",
       {/*sequence_parallel=*/true, /*loss_parallel=*/true}},
      {"fsdp-pp-gpipe", Kind::FsdpPp, true, false,
       "models::DecoderStage: the decoder cut by layers into pp stages on a (pp, dp) mesh "
       "(embedding on the first, final norm + a copy of the tied output on the last, the tied "
       "pair's gradients exchanged after backward), each stage's layers then the stage "
       "fully_shard over dp (gathered across microbatches); fsdp::pp GPipe over the "
       "microbatches; the pp ranks of one dp coordinate take the same batch slice",
       {}, fsdp::pp::ScheduleKind::GPipe, 1},
      {"fsdp-pp-1f1b", Kind::FsdpPp, true, false, "as fsdp-pp-gpipe, schedule 1F1B", {},
       fsdp::pp::ScheduleKind::OneFOneB, 1},
      {"fsdp-pp-interleaved", Kind::FsdpPp, true, false,
       "as fsdp-pp-gpipe, interleaved 1F1B with 2 stages per rank (looped: rank r holds stages "
       "r and r + pp)",
       {}, fsdp::pp::ScheduleKind::Interleaved1F1B, 2},
      {"fsdp-ep-moe", Kind::FsdpEp, true, false,
       "ANOTHER MODEL: models::MoEDecoder (the same dims, odd layers MoE: 4 SwiGLU experts of "
       "ffn 2 x hidden, top-2, fp32 softmax router) from the same seed, experts split over ep "
       "on an (efsdp, ep) mesh; every rank takes its own batch slice; dense layers and the root "
       "fully_shard over all ranks, each MoE layer with fsdp::moe::expert_options (experts on "
       "efsdp, divide factor = ranks); its loss and persistent ratio are not the dense "
       "decoder's"},
  };
  return table;
}

// The configs --param-dtype applies to and --device cuda runs beside single.
std::string data_parallel_fsdp_keys() {
  std::vector<std::string> keys;
  for (const ConfigSpec& s : all_configs()) {
    if (s.kind == Kind::Fsdp || s.kind == Kind::Hsdp) keys.push_back(s.key);
  }
  return fmt::format("{}", fmt::join(keys, ", "));
}

namespace {

models::DecoderConfig decoder_config(const Options& o) {
  models::DecoderConfig cfg;
  if (o.seq > 0) cfg.seq = o.seq;
  if (o.layers > 0) cfg.layers = o.layers;
  if (o.hidden > 0) cfg.hidden = o.hidden;
  if (o.vocab > 0) cfg.vocab = o.vocab;
  if (o.heads > 0) cfg.heads = o.heads;
  return cfg;
}

// --configs, in table order (all of them when not given).
std::vector<ConfigSpec> selected_configs(const Options& o) {
  std::vector<ConfigSpec> specs;
  for (const ConfigSpec& s : all_configs()) {
    if ((o.configs.empty() && !s.opt_in) ||
        std::find(o.configs.begin(), o.configs.end(), s.key) != o.configs.end()) {
      specs.push_back(s);
    }
  }
  return specs;
}

// --device cuda: keeps the configs that run on a GPU and sets
// o.resolved_device; the problem ("" if none) when LibTorch sees no GPU or
// CPU-only configs were named.
std::string restrict_to_device(std::vector<ConfigSpec>& specs, Options& o,
                               const fsdp::Runtime& rt) {
  if (o.device != "cuda") return "";
  // DDP's MPI_Allreduce and the TP, pipeline and expert-parallel configs
  // build CPU meshes; on a GPU the run compares single with the fsdp ones.
  auto cpu_only = [](const ConfigSpec& s) {
    return s.kind != Kind::Single && s.kind != Kind::Fsdp && s.kind != Kind::Hsdp;
  };
  std::vector<std::string> named;
  for (const ConfigSpec& s : specs) {
    if (cpu_only(s) && !o.configs.empty()) named.push_back(s.key);
  }
  std::string bad;
  if (!rt.device().is_cuda()) {
    bad = fmt::format("--device cuda: LibTorch {} sees no CUDA device here (a CPU build, or no "
                      "GPU visible); accepted: cpu, cuda",
                      TORCH_VERSION);
  } else if (!named.empty()) {
    bad = fmt::format("--configs {}: CPU only; with --device cuda: single, {}",
                      fmt::join(named, ","), data_parallel_fsdp_keys());
  }
  if (!bad.empty()) return bad;
  specs.erase(std::remove_if(specs.begin(), specs.end(), cpu_only), specs.end());
  o.resolved_device = rt.device();
  return "";
}

// Drops the configs of `kind` when `fits` is false, and says why in
// `skipped` ("" when nothing was dropped); returns whether any config of
// `kind` is left.
bool drop_unless(std::vector<ConfigSpec>& specs, Kind kind, bool fits, const std::string& why,
                 std::string& skipped) {
  auto of_kind = [kind](const ConfigSpec& s) { return s.kind == kind; };
  if (!fits) {
    for (const ConfigSpec& s : specs) {
      if (of_kind(s)) skipped += (skipped.empty() ? "" : ", ") + s.key;
    }
    if (!skipped.empty()) skipped += " skipped: " + why;
    specs.erase(std::remove_if(specs.begin(), specs.end(), of_kind), specs.end());
  }
  return std::any_of(specs.begin(), specs.end(), of_kind);
}

// The mesh sizes (--tp, --pp, --ep or their default 2) and the configs
// whose default does not fit the world size dropped.
void fit_parallel_configs(Plan& p, const Options& o, int world) {
  const auto default_needs_even = [world](const char* flag) {
    return fmt::format("the default {} 2 needs an even world size, not {}", flag, world);
  };
  p.tp = o.tp > 0 ? o.tp : 2;
  p.any_tp = drop_unless(p.specs, Kind::FsdpTp, o.tp > 0 || world % p.tp == 0,
                         default_needs_even("--tp"), p.tp_skipped);
  p.pp = o.pp > 0 ? o.pp : 2;
  p.any_pp = drop_unless(p.specs, Kind::FsdpPp, o.pp > 0 || world % p.pp == 0,
                         default_needs_even("--pp"), p.pp_skipped);
  p.ep = o.ep > 0 ? o.ep : 2;
  p.any_ep = drop_unless(p.specs, Kind::FsdpEp, o.ep > 0 || world % p.ep == 0,
                         default_needs_even("--ep"), p.ep_skipped);
  // HSDP needs at least two replicas of a 2-rank shard group.
  p.any_hsdp = drop_unless(
      p.specs, Kind::Hsdp, world % 2 == 0 && world >= 4,
      fmt::format("a (replicate, shard = 2) mesh needs an even world size of 4 or more, not {}",
                  world),
      p.hsdp_skipped);
  p.pp_dp = world % p.pp == 0 ? world / p.pp : 1;
  p.pp_local_batch = o.batch / p.pp_dp;
  p.microbatches = o.microbatches > 0 ? o.microbatches : p.pp_local_batch;
}

// Why the flags do not combine with this world ("" when they do): the
// first problem found.
std::string combination_problem(const Plan& p, const Options& o, int world) {
  const models::DecoderConfig& cfg = p.cfg;
  const bool any_parallel = std::any_of(p.specs.begin(), p.specs.end(),
                                        [](const ConfigSpec& s) { return s.kind != Kind::Single; });
  std::string bad;
  if (any_parallel && o.batch % world != 0) {
    bad = fmt::format("--batch {} is not a multiple of the world size {}", o.batch, world);
  } else if (p.any_tp && world % p.tp != 0) {
    bad = fmt::format("--tp {} does not divide the world size {}", p.tp, world);
  } else if (cfg.hidden % cfg.heads != 0) {
    bad = fmt::format("--hidden {} is not a multiple of --heads {}", cfg.hidden, cfg.heads);
  } else if (p.any_ep && (world % p.ep != 0 || kExperts % p.ep != 0)) {
    bad = fmt::format("--ep {} does not divide both the world size {} and the {} experts", p.ep,
                      world, kExperts);
  } else if (p.any_pp && world % p.pp != 0) {
    bad = fmt::format("--pp {} does not divide the world size {}", p.pp, world);
  } else if (p.any_pp && p.pp_local_batch % p.microbatches != 0) {
    bad = fmt::format("--microbatches {} does not divide the per-pipeline batch {} (--batch {} / "
                      "{} data-parallel ranks)",
                      p.microbatches, p.pp_local_batch, o.batch, p.pp_dp);
  }
  for (const ConfigSpec& s : p.specs) {
    if (!bad.empty() || s.kind != Kind::FsdpPp) continue;
    const int stages = p.pp * s.stages_per_rank;
    if (cfg.layers % stages != 0) {
      bad = fmt::format("{}: --layers {} do not split into {} pipeline stages ({} per rank)",
                        s.key, cfg.layers, stages, s.stages_per_rank);
    } else if (s.schedule != fsdp::pp::ScheduleKind::GPipe && p.microbatches < p.pp) {
      bad = fmt::format("{}: --microbatches {} is below --pp {}", s.key, p.microbatches, p.pp);
    } else if (s.schedule == fsdp::pp::ScheduleKind::Interleaved1F1B &&
               p.microbatches % p.pp != 0) {
      bad = fmt::format("{}: --microbatches {} is not a multiple of --pp {}", s.key,
                        p.microbatches, p.pp);
    }
  }
  return bad;
}

}  // namespace

std::optional<Plan> plan_run(Options& o, const fsdp::Runtime& rt) {
  const int world = rt.world_size();
  const bool lead = rt.world_rank() == 0;
  Plan p;
  p.cfg = decoder_config(o);
  p.specs = selected_configs(o);
  if (const std::string bad = restrict_to_device(p.specs, o, rt); !bad.empty()) {
    if (lead) std::cerr << "fsdp-bench train: " << bad << '\n';
    return std::nullopt;
  }
  fit_parallel_configs(p, o, world);
  std::string bad = combination_problem(p, o, world);
  const std::string json_problem = json_path_problem(o.json_path, MPI_COMM_WORLD);
  if (bad.empty()) bad = json_problem;
  if (!bad.empty()) {
    // Every rank sees the same numbers and returns alike.
    if (lead) std::cerr << "fsdp-bench train: " << bad << '\n';
    return std::nullopt;
  }
  return p;
}

}  // namespace fsdp_bench::train
