// fsdp-bench train's report (train_report.h): the header facts and legends,
// a row per configuration with its ratios to DDP, single and single/N, and
// the summary against the step-time and memory targets.
#include "train_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <string>

namespace fsdp_bench::train {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;
// Targets of the project: FSDP (the default reshard_after_forward) within 5% of
// DDP's step time at 2 ranks, and its persistent memory per rank within 2%
// of an ideal 1/N split of the single-process state.
constexpr double kStepTarget = 1.05;
constexpr int kStepTargetWorld = 2;
constexpr double kMemoryTarget = 1.02;

// num / den, or "-" where the reference did not run (den 0).
Cell ratio_or_dash(double num, double den) {
  if (den <= 0) return std::string("-");
  return num / den;
}

// The model, batch, optimizer and numerics of the run.
void describe_model(Report& report, const Plan& plan, const Options& o) {
  const models::DecoderConfig& cfg = plan.cfg;
  report.note(fmt::format(
      "fsdp-bench train: models::Decoder vocab {} hidden {} heads {} layers {} ffn {} seq {} "
      "(tied output), {}; global batch {} x {} tokens; AdamW lr {}; {} timed steps after "
      "{} warm-up; seed {}",
      cfg.vocab, cfg.hidden, cfg.heads, cfg.layers, cfg.ffn_dim(), cfg.seq,
      o.param_dtype == "float32" ? std::string("float32")
                                 : "fsdp*/hsdp " + o.param_dtype +
                                       " parameters with float32 reduction, the rest float32",
      o.batch, cfg.seq,
      o.lr, o.timing.iters, o.timing.warmup, o.seed));
  report.meta("model", {{"vocab", cfg.vocab}, {"hidden", cfg.hidden}, {"heads", cfg.heads},
                        {"layers", cfg.layers}, {"ffn", cfg.ffn_dim()}, {"seq", cfg.seq},
                        {"tie_output", cfg.tie_output}});
  report.meta("global_batch", o.batch);
  report.meta("steps", o.timing.iters);
  report.meta("warmup", o.timing.warmup);
  report.meta("seed", o.seed);
  report.meta("lr", o.lr);
  report.meta("param_dtype", o.param_dtype,
              o.param_dtype == "float32"
                  ? ""
                  : "fsdp*, hsdp (not tp/pp/ep): MixedPrecisionPolicy param_dtype " +
                        o.param_dtype + ", reduce_dtype float32; every other config float32");
  report.meta("forward_prefetch", o.forward_prefetch ? "explicit" : "implicit",
              o.forward_prefetch ? "FSDP configs: explicit forward prefetch of the next unit"
                                 : "");
}

// The device and each parallel kind's mesh (or why its configs were skipped).
void describe_meshes(Report& report, const Plan& plan, const Options& o, int world) {
  const int tp = plan.tp, pp = plan.pp, ep = plan.ep, pp_dp = plan.pp_dp;
  const int microbatches = plan.microbatches, pp_local_batch = plan.pp_local_batch;
  const bool any_tp = plan.any_tp, any_pp = plan.any_pp, any_ep = plan.any_ep;
  const bool any_hsdp = plan.any_hsdp;
  report.meta("tensor_device", o.resolved_device.str(),
              fmt::format("models and batches on {} (--device)", o.resolved_device.str()));
  report.meta("tp", any_tp ? nlohmann::json(tp) : nlohmann::json(nullptr),
              any_tp ? fmt::format("fsdp-tp*: mesh (shard={}, tp={})", world / tp, tp)
                     : plan.tp_skipped);
  report.meta("pp",
              any_pp ? nlohmann::json({{"size", pp}, {"dp", pp_dp}, {"microbatches", microbatches}})
                     : nlohmann::json(nullptr),
              any_pp ? fmt::format("fsdp-pp*: mesh (pp={}, dp={}), {} microbatches of {} "
                                   "sequence(s) per pipeline",
                                   pp, pp_dp, microbatches, pp_local_batch / microbatches)
                     : plan.pp_skipped);
  report.meta("ep", any_ep ? nlohmann::json({{"size", ep}, {"efsdp", world / ep},
                                              {"experts", kExperts}, {"top_k", kTopK}})
                            : nlohmann::json(nullptr),
              any_ep ? fmt::format("fsdp-ep-moe: mesh (efsdp={}, ep={}), {} experts per MoE layer, "
                                   "top-{}",
                                   world / ep, ep, kExperts, kTopK)
                     : plan.ep_skipped);
  report.meta("hsdp", any_hsdp ? nlohmann::json({{"replicate", world / 2}, {"shard", 2}})
                               : nlohmann::json(nullptr),
              any_hsdp ? fmt::format("hsdp: mesh (replicate={}, shard=2)", world / 2)
                       : plan.hsdp_skipped);
}

// The legend of every config and of the columns.
void explain_columns(Report& report, const Plan& plan, const Options& o) {
  for (const ConfigSpec& s : plan.specs) report.note(fmt::format("{:>19}: {}", s.key, s.legend));
  report.note("step: zero_grad + forward + loss + backward (+ DDP all-reduce) + AdamW step; "
              "each step after a barrier; time = slowest rank; configs interleaved step by "
              "step");
  report.note("persistent = parameters as held between steps (local shards under FSDP) + "
              "gradients + AdamW state, sums of tensor sizes, max over ranks");
  report.note("held / peak = LibTorch CPU-allocator bytes owned by the config between steps / "
              "at the highest point of a step, libfsdp's shared-memory arenas included "
              "(fsdp::set_shared_memory_observer) (max over timed steps and ranks; BLAS and MPI "
              "scratch not counted)");
  if (o.resolved_device.is_cuda()) {
    report.note(fmt::format("--device cuda: models, batches and meshes on {}; held / peak count "
                            "host memory only; each phase ends with a device synchronize",
                            o.resolved_device.str()));
  }
  report.note("phases (median over steps of the slowest rank): fwd = zero_grad + forward + "
              "loss (FSDP: with its all-gather waits; TP: with its tp collectives), bwd = "
              "backward (FSDP: with its reduce-scatters), sync = DDP's all-reduce, optim = "
              "AdamW step");
  report.note("AG/RS/AR = libfsdp all-gathers / reduce-scatters / all-reduces per step (one "
              "extra untimed step) on every group but tp: FSDP's, over shard (a size-1 dim "
              "issues none); DDP's single MPI_Allreduce is outside libfsdp");
  if (plan.any_tp) {
    report.note("tp AG/RS/AR = the same on the tp group: TP's activation collectives and "
                "FSDP's all-reduce of gradients partial over tp (the SP norm weights)");
  }
  if (plan.any_pp) {
    report.note("fsdp-pp*: fwd = the whole schedule step (every microbatch's forward and "
                "backward, the p2p transfers, FSDP's collectives), bwd = 0, sync = the tied "
                "embedding/output gradient exchange; bubble = fsdp::pp::bubble_fraction (idle "
                "share of the slowest rank's schedule step), median over the timed steps");
  }
}

// The reference configurations the ratios divide by.
struct Baselines {
  std::optional<size_t> single, ddp, fsdp;
  // 0 where the reference configuration did not run.
  double single_ms = 0, ddp_ms = 0;
  // DDP's replica holds exactly single's parameters, gradients and AdamW
  // state, so either gives the full model's persistent bytes.
  std::optional<size_t> full;
  double ideal_share = 0;
  int world = 1;

  // HSDP shards over its shard dim (2) only: its ideal is single / 2.
  double ideal_for(const ConfigSpec& s) const {
    return s.kind == Kind::Hsdp ? ideal_share * world / 2 : ideal_share;
  }
};

Baselines baselines(const Plan& plan, const Results& r, int world) {
  const auto find = [&](const std::string& key) -> std::optional<size_t> {
    for (size_t i = 0; i < plan.specs.size(); ++i) {
      if (plan.specs[i].key == key) return i;
    }
    return std::nullopt;
  };
  Baselines b;
  b.world = world;
  b.single = find("single");
  b.ddp = find("ddp");
  b.fsdp = find("fsdp");
  b.single_ms = b.single ? r.stats[*b.single].median_us / 1e3 : 0.0;
  b.ddp_ms = b.ddp ? r.stats[*b.ddp].median_us / 1e3 : 0.0;
  b.full = b.single ? b.single : b.ddp;
  b.ideal_share = b.full ? static_cast<double>(r.mem[*b.full * 6]) / world : 0.0;
  return b;
}

void report_rows(Report& report, const Plan& plan,
                 const std::vector<std::unique_ptr<Trainer>>& trainers, const Results& r,
                 const Baselines& b) {
  const std::vector<ConfigSpec>& specs = plan.specs;
  for (size_t i = 0; i < specs.size(); ++i) {
    const int64_t* m = &r.mem[i * 6];
    const double ms = r.stats[i].median_us / 1e3;
    const auto& cc = r.comm_counts[i];
    const std::string colls = trainers[i]->spec().kind == Kind::Ddp
                                  ? std::string("0/0/0+1")
                                  : fmt::format("{}/{}/{}", cc[0], cc[1], cc[2]);
    const std::string tp_colls = trainers[i]->tp_group().empty()
                                     ? std::string("-")
                                     : fmt::format("{}/{}/{}", cc[3], cc[4], cc[5]);
    report.row({specs[i].key, ms, r.stats[i].min_us / 1e3, r.stats[i].max_us / 1e3,
                ratio_or_dash(ms, b.ddp_ms), ratio_or_dash(ms, b.single_ms),
                static_cast<double>(m[0]) / kMiB,
                specs[i].kind == Kind::FsdpEp
                    ? Cell(std::string("-"))
                    : ratio_or_dash(static_cast<double>(m[0]), b.ideal_for(specs[i])),
                static_cast<double>(m[4]) / kMiB, static_cast<double>(m[5]) / kMiB,
                r.phase_ms[i][0], r.phase_ms[i][1], r.phase_ms[i][2], r.phase_ms[i][3], colls,
                tp_colls, r.bubble[i] >= 0 ? Cell(r.bubble[i]) : Cell(std::string("-")), m[0],
                m[1], m[2], m[3], m[4], m[5], cc[6], r.losses[i]});
  }
  if (b.ddp) {
    report.note(fmt::format("{:>19}: '+1' = its one raw MPI_Allreduce of {:.2f} MiB per step",
                            "ddp", static_cast<double>(r.mem[*b.ddp * 6 + 2]) / kMiB));
  }
}

// Same data and seed: every configuration of the dense decoder should
// reach the same loss (the MoE decoder is another model).
void summarize_loss_spread(Report& report, const Plan& plan, const Results& r) {
  double loss_lo = 0, loss_hi = 0;
  bool first_loss = true;
  for (size_t i = 0; i < plan.specs.size(); ++i) {
    if (plan.specs[i].kind == Kind::FsdpEp) continue;
    loss_lo = first_loss ? r.losses[i] : std::min(loss_lo, r.losses[i]);
    loss_hi = first_loss ? r.losses[i] : std::max(loss_hi, r.losses[i]);
    first_loss = false;
  }
  report.summary("final_loss_spread", loss_hi - loss_lo,
                 fmt::format("loss after the last timed step: {:.6f} .. {:.6f} across configs "
                             "(same seed and data: they should agree)",
                             loss_lo, loss_hi));
}

void summarize_step_target(Report& report, const Results& r, const Baselines& b, int world) {
  if (b.fsdp && b.ddp) {
    const double ratio = r.stats[*b.fsdp].median_us / r.stats[*b.ddp].median_us;
    const bool applies = world == kStepTargetWorld;
    report.summary("step_ratio_fsdp_vs_ddp", ratio);
    report.summary("step_target_met", applies ? nlohmann::json(ratio <= kStepTarget) : nullptr,
                   fmt::format("target FSDP (default reshard_after_forward) step <= {:.2f}x DDP at "
                               "np {}: {:.3f}x -> {}",
                               kStepTarget, kStepTargetWorld, ratio,
                               !applies ? "n/a at this world size"
                                        : (ratio <= kStepTarget ? "MET" : "NOT MET")));
  } else {
    report.summary("step_target_met", nullptr,
                   "target FSDP step <= 1.05x DDP: not evaluated (needs configs fsdp and ddp)");
  }
}

void summarize_pipelines(Report& report, const Plan& plan, const Results& r, const Baselines& b) {
  const std::vector<ConfigSpec>& specs = plan.specs;
  nlohmann::json ratio = nlohmann::json::object(), bubbles = nlohmann::json::object();
  std::string text;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].kind != Kind::FsdpPp) continue;
    const double ms = r.stats[i].median_us / 1e3;
    ratio[specs[i].key] = b.ddp ? nlohmann::json(ms / b.ddp_ms) : nlohmann::json(nullptr);
    bubbles[specs[i].key] = r.bubble[i];
    text += fmt::format("{}{} {:.1f} ms{}, bubble {:.3f}", text.empty() ? "" : "; ",
                        specs[i].key, ms,
                        b.ddp ? fmt::format(" ({:.3f}x DDP)", ms / b.ddp_ms) : std::string(),
                        r.bubble[i]);
  }
  report.summary("step_ratio_pp_vs_ddp", ratio);
  report.summary("pipeline_bubble", bubbles,
                 fmt::format("pipelines (pp={}, dp={}, {} microbatches): {}", plan.pp, plan.pp_dp,
                             plan.microbatches, text));
}

void summarize_experts(Report& report, const Plan& plan, const Results& r, const Baselines& b) {
  const std::vector<ConfigSpec>& specs = plan.specs;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].kind != Kind::FsdpEp) continue;
    const double ms = r.stats[i].median_us / 1e3;
    report.summary("step_ratio_ep_vs_ddp",
                   b.ddp ? nlohmann::json(ms / b.ddp_ms) : nlohmann::json(nullptr),
                   fmt::format("{} {:.1f} ms{}, loss {:.6f} (the MoE decoder; {} all-to-alls "
                               "per step)",
                               specs[i].key, ms,
                               b.ddp ? fmt::format(" ({:.3f}x DDP of the dense decoder)",
                                                   ms / b.ddp_ms)
                                     : std::string(),
                               r.losses[i], r.all_to_alls[i]));
  }
}

void summarize_memory_target(Report& report, const Plan& plan, const Results& r,
                             const Baselines& b) {
  const std::vector<ConfigSpec>& specs = plan.specs;
  if (b.full) {
    nlohmann::json per = nlohmann::json::object();
    std::string text;
    bool fsdp_met = true;
    for (size_t i = 0; i < specs.size(); ++i) {
      const Kind k = specs[i].kind;
      if (k != Kind::Fsdp && k != Kind::Hsdp && k != Kind::FsdpTp) continue;
      const double ratio = static_cast<double>(r.mem[i * 6]) / b.ideal_for(specs[i]);
      per[specs[i].key] = ratio;
      fsdp_met = fsdp_met && ratio <= kMemoryTarget;
      text += fmt::format("{}{} {:.4f}x", text.empty() ? "" : ", ", specs[i].key, ratio);
    }
    report.summary("persistent_vs_single_over_n", per);
    report.summary("memory_target_met", text.empty() ? nullptr : nlohmann::json(fsdp_met),
                   text.empty() ? "target FSDP persistent <= single/N + 2%: no FSDP config run"
                                : fmt::format("target FSDP persistent bytes/rank <= single/N + "
                                              "{:.0f}% (hsdp: single/2, its shard size): {} -> {}",
                                              (kMemoryTarget - 1) * 100, text,
                                              fsdp_met ? "MET" : "NOT MET"));
  } else {
    report.summary("memory_target_met", nullptr,
                   "target FSDP persistent <= single/N + 2%: not evaluated (needs config "
                   "single or ddp)");
  }
}

}  // namespace

std::vector<Column> columns() {
  const std::string step = "step time";
  const std::string mem = "memory per rank";
  return {
      {"config", "config", "", 19, -1, ""},
      {"step_ms", "median", "(ms)", 9, 1, step},
      {"step_min_ms", "min", "(ms)", 9, 1, step},
      {"step_max_ms", "max", "(ms)", 0, 1, step},
      {"vs_ddp", "vs DDP", "(x)", 7, 3, step},
      {"vs_single", "vs single", "(x)", 9, 3, step},
      {"persistent_mib", "persistent", "(MiB)", 10, 2, mem},
      {"vs_single_over_n", "vs single/N", "(x)", 11, 3, mem},
      {"held_mib", "held", "(MiB)", 8, 2, mem},
      {"peak_mib", "peak", "(MiB)", 8, 2, mem},
      {"forward_ms", "fwd", "(ms)", 7, 1, "phases (median)"},
      {"backward_ms", "bwd", "(ms)", 7, 1, "phases (median)"},
      {"sync_ms", "sync", "(ms)", 7, 1, "phases (median)"},
      {"optimizer_ms", "optim", "(ms)", 7, 1, "phases (median)"},
      {"collectives_per_step", "AG/RS/AR", "per step", 9, -1, ""},
      {"tp_collectives_per_step", "tp AG/RS/AR", "per step", 11, -1, ""},
      {"bubble", "bubble", "(frac)", 7, 3, ""},
      {"persistent_bytes", "", "", 0, -1, mem},
      {"params_bytes", "", "", 0, -1, mem},
      {"grads_bytes", "", "", 0, -1, mem},
      {"optimizer_bytes", "", "", 0, -1, mem},
      {"held_bytes", "", "", 0, -1, mem},
      {"peak_bytes", "", "", 0, -1, mem},
      {"comm_bytes_per_step", "", "", 0, -1, ""},
      {"final_loss", "", "", 0, -1, ""},
  };
}

// Inter-node bytes per step per group (every rank's sends to other nodes,
// summed): what the layout costs on the slow links. DDP's raw MPI_Allreduce
// is not a libfsdp collective and is not counted.
void summarize_cross_node(Report& report, const Plan& plan, const Results& r) {
  nlohmann::json by_config = nlohmann::json::object();
  std::string text;
  for (size_t i = 0; i < plan.specs.size() && i < r.cross_node.size(); ++i) {
    nlohmann::json groups = nlohmann::json::object();
    std::string parts;
    for (const auto& [name, bytes] : r.cross_node[i]) {
      groups[name] = bytes;
      if (bytes > 0) {
        parts += fmt::format("{}{} {:.2f} MiB", parts.empty() ? "" : ", ", name,
                             static_cast<double>(bytes) / kMiB);
      }
    }
    by_config[plan.specs[i].key] = groups;
    text += fmt::format("{}{}: {}", text.empty() ? "" : "; ", plan.specs[i].key,
                        parts.empty() ? std::string("0") : parts);
  }
  report.summary("cross_node_bytes_per_step", by_config,
                 fmt::format("inter-node bytes per step by group ({} node(s), all ranks' sends "
                             "to other nodes; DDP's raw all-reduce not counted): {}",
                             r.num_nodes, text));
}

void describe_run(Report& report, const Plan& plan, const Options& o, const fsdp::Runtime& rt) {
  describe_model(report, plan, o);
  add_runtime_meta(report, rt);
  describe_meshes(report, plan, o, rt.world_size());
  explain_columns(report, plan, o);
}

void report_results(Report& report, const Plan& plan,
                    const std::vector<std::unique_ptr<Trainer>>& trainers, const Results& r,
                    int world) {
  const Baselines b = baselines(plan, r, world);
  report_rows(report, plan, trainers, r, b);
  summarize_loss_spread(report, plan, r);
  summarize_step_target(report, r, b, world);
  if (plan.any_pp) summarize_pipelines(report, plan, r, b);
  if (plan.any_ep) summarize_experts(report, plan, r, b);
  summarize_memory_target(report, plan, r, b);
  summarize_cross_node(report, plan, r);
}

}  // namespace fsdp_bench::train
