// fsdp-bench train: one training step of the test plan's LLM decoder under
// single-process, a plain DDP baseline, three FSDP configurations, FSDP
// composed with tensor parallelism and FSDP inside pipeline stages (fsdp::pp),
// in one run, on the same model, seed and global batch -- and, for scale, the
// mixture-of-experts decoder with expert parallelism (fsdp::moe) on the same
// batch.
//
// Every configuration builds a fresh models::Decoder from the same seed (the
// TP configurations copy their slices of it into a models::TPDecoder, the
// pipeline configurations keep their stages of it, models::DecoderStage;
// the expert-parallel one builds models::MoEDecoder from the same seed) and
// trains it with AdamW (zero_grad, forward, backward, step per iteration).
// The configurations run interleaved step by step (the harness's
// time_interleaved), so load drift hits them alike. Memory is measured by a
// counting wrapper around LibTorch's CPU allocator that attributes every
// allocation to the configuration whose step (or construction) was running.
//
// This file: the flags and the run's steps (plan, header, meshes and
// trainers, data, timed loop, measurements, report). The pieces:
// train_configs (the configurations and the checks), train_trainer (one
// configuration's model and step), train_memory.h (the counting allocator),
// train_report (columns, rows, summary).
#include "harness.h"
#include "train_configs.h"
#include "train_memory.h"
#include "train_report.h"
#include "train_trainer.h"

#include "fsdp/comm.h"
#include "fsdp/mesh.h"
#include "fsdp/pipeline.h"

#include <models/init.h>
#include <models/llm.h>

#include <ATen/core/Tensor.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <map>
#include <string>
#include <vector>

namespace fsdp_bench {
namespace train {
namespace {

// The meshes of the parallel configurations that run (each collective over
// the world), in creation order.
struct Meshes {
  std::optional<fsdp::DeviceMesh> shard, tp, hsdp, pp, pp_world, ep;

  // The mesh a Trainer of `s` takes (see Trainer).
  const std::optional<fsdp::DeviceMesh>& for_config(const ConfigSpec& s) const {
    switch (s.kind) {
      case Kind::FsdpTp: return tp;
      case Kind::FsdpPp: return pp;
      case Kind::FsdpEp: return ep;
      case Kind::Hsdp: return hsdp;
      default: return shard;
    }
  }
};

Meshes make_meshes(const Plan& plan, const Options& o, int world) {
  const std::vector<ConfigSpec>& specs = plan.specs;
  const int tp = plan.tp, pp = plan.pp, ep = plan.ep;
  Meshes m;
  if (std::any_of(specs.begin(), specs.end(),
                  [](const ConfigSpec& s) { return s.kind == Kind::Fsdp; })) {
    m.shard = fsdp::init_device_mesh(o.resolved_device.type(), {world}, {"shard"});
  }
  if (plan.any_tp) m.tp = fsdp::init_device_mesh("cpu", {world / tp, tp}, {"shard", "tp"});
  if (plan.any_hsdp) {
    m.hsdp = fsdp::init_device_mesh(o.resolved_device.type(), {world / 2, 2},
                                    {"replicate", "shard"});
  }
  if (plan.any_pp) {
    m.pp = fsdp::init_device_mesh("cpu", {pp, plan.pp_dp}, {"pp", "dp"});
    m.pp_world = m.pp->flatten("world");  // bubble_fraction's group
  }
  if (plan.any_ep) m.ep = fsdp::init_device_mesh("cpu", {world / ep, ep}, {"efsdp", "ep"});
  return m;
}

// One Trainer per config, each on a memory account of its own.
std::vector<std::unique_ptr<Trainer>> make_trainers(const Plan& plan, const Options& o,
                                                    const Meshes& meshes, MPI_Comm comm) {
  std::vector<std::unique_ptr<Trainer>> trainers;
  for (size_t i = 0; i < plan.specs.size(); ++i) {
    trainers.push_back(std::make_unique<Trainer>(
        plan.specs[i], CountingAllocator::get().new_account(), plan.cfg, o,
        meshes.for_config(plan.specs[i]), comm));
  }
  return trainers;
}

struct Batch {
  at::Tensor inputs, targets;
};

// The data: one global batch per round (one more for counting
// collectives), the same for every configuration, as each one's share on
// this rank. [config][round]
std::vector<std::vector<Batch>> make_batches(const Plan& plan, const Options& o,
                                             const std::vector<std::unique_ptr<Trainer>>& trainers) {
  const models::DecoderConfig& cfg = plan.cfg;
  const size_t n = trainers.size();
  const int rounds = o.timing.warmup + o.timing.iters;
  std::vector<std::vector<Batch>> data(n);
  for (int r = 0; r < rounds + 1; ++r) {
    at::Tensor tokens =
        models::random_tokens(o.seed * 1000 + static_cast<uint64_t>(r), o.batch, cfg.seq + 1,
                              cfg.vocab);
    const at::Tensor inputs = tokens.narrow(1, 0, cfg.seq);
    const at::Tensor targets = tokens.narrow(1, 1, cfg.seq);
    for (size_t i = 0; i < n; ++i) {
      data[i].push_back({trainers[i]->share(inputs), trainers[i]->share(targets)});
    }
  }
  return data;
}

// What the timed loop leaves per config: step times, and the held and peak
// allocator bytes of this rank (max over the timed steps).
struct Timed {
  std::vector<Stats> stats;
  std::vector<int64_t> step_peak, held;
};

// The timed loop: every config's steps interleaved round by round (the
// harness's time_interleaved), warm-up rounds first.
Timed time_steps(const std::vector<std::unique_ptr<Trainer>>& trainers,
                 const std::vector<std::vector<Batch>>& data, const Options& o, MPI_Comm comm) {
  CountingAllocator& alloc = CountingAllocator::get();
  const size_t n = trainers.size();
  // Each variant counts its own calls: time_interleaved calls every variant
  // once per round, warm-up rounds first.
  std::vector<int> calls(n, 0);
  Timed out;
  out.step_peak.assign(n, 0);
  out.held.assign(n, 0);
  std::vector<std::function<void()>> variants;
  for (size_t i = 0; i < n; ++i) {
    variants.push_back([&, i] {
      Trainer& t = *trainers[i];
      const Batch& b = data[i][static_cast<size_t>(calls[i])];
      const bool timed = calls[i]++ >= o.timing.warmup;
      if (timed) alloc.reset_peak(t.account());
      t.step(b.inputs, b.targets, timed);
      if (timed) {
        out.step_peak[i] = std::max(out.step_peak[i], alloc.peak(t.account()));
        out.held[i] = alloc.live(t.account());
      }
    });
  }
  out.stats = time_interleaved(comm, variants, o.timing);
  return out;
}

// Losses (mean over the ranks) and bytes (max over the ranks) after the
// timed steps.
void measure_losses_and_memory(const std::vector<std::unique_ptr<Trainer>>& trainers,
                               const Timed& timed, int world, MPI_Comm comm, Results& r) {
  const size_t n = trainers.size();
  r.losses.assign(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    const Trainer& t = *trainers[i];
    // Data-parallel losses are of this rank's slice of the batch, so
    // the mean over ranks is the global batch's loss (single: the same on
    // every rank).
    r.losses[i] = t.last_loss() / world;
    const Trainer::Persistent p = t.persistent();
    r.mem.insert(r.mem.end(), {p.total(), p.params, p.grads, p.optimizer, timed.held[i],
                               timed.step_peak[i]});
  }
  r.losses = sum_over_ranks(comm, r.losses);
  r.mem = max_over_ranks(comm, r.mem);
}

// Pipelined: the median bubble over the timed steps (collective, -1
// elsewhere). Per config and phase: median over timed steps of the slowest
// rank's time.
void measure_bubbles_and_phases(const std::vector<std::unique_ptr<Trainer>>& trainers,
                                const Meshes& meshes, MPI_Comm comm, Results& r) {
  const size_t n = trainers.size();
  r.bubble.assign(n, -1.0);
  for (size_t i = 0; i < n; ++i) {
    std::vector<double> fractions;
    for (const auto& step : trainers[i]->pipeline_steps()) {
      fractions.push_back(fsdp::pp::bubble_fraction(step, *meshes.pp_world));
    }
    if (!fractions.empty()) r.bubble[i] = summarize(fractions).median_us;
  }
  r.phase_ms.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const std::vector<double> us = max_over_ranks(comm, trainers[i]->phase_us());
    for (size_t ph = 0; ph < Trainer::kPhases; ++ph) {
      std::vector<double> column;
      for (size_t k = ph; k < us.size(); k += Trainer::kPhases) column.push_back(us[k]);
      r.phase_ms[i][ph] = summarize(column).median_us / 1e3;
    }
  }
}

// Every rank's `mine` (group name -> bytes) summed by name on rank 0 of
// `comm` (empty elsewhere): a rank only knows the groups it is in.
std::map<std::string, int64_t> sum_by_name(const std::map<std::string, int64_t>& mine,
                                           MPI_Comm comm) {
  std::string text;
  for (const auto& [name, bytes] : mine) text += name + "\t" + std::to_string(bytes) + "\n";
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  const int len = static_cast<int>(text.size());
  std::vector<int> lens(static_cast<size_t>(size)), displs(static_cast<size_t>(size));
  MPI_Gather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, comm);
  int total = 0;
  for (int r = 0; r < size; ++r) {
    displs[static_cast<size_t>(r)] = total;
    total += lens[static_cast<size_t>(r)];
  }
  std::string all(static_cast<size_t>(rank == 0 ? total : 0), '\0');
  MPI_Gatherv(text.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, 0,
              comm);
  std::map<std::string, int64_t> out;
  size_t at = 0;
  while (at < all.size()) {
    const size_t tab = all.find('\t', at), end = all.find('\n', tab);
    out[all.substr(at, tab - at)] += std::stoll(all.substr(tab + 1, end - tab - 1));
    at = end + 1;
  }
  return out;
}

// One more (untimed) step per config to count its collectives: AG, RS, AR
// off the tp group, the same on it, bytes; and the all-to-alls (the
// expert-parallel config's dispatch and combine).
void count_collectives(const std::vector<std::unique_ptr<Trainer>>& trainers,
                       const std::vector<std::vector<Batch>>& data, MPI_Comm comm, Results& r) {
  const size_t n = trainers.size();
  r.comm_counts.resize(n);
  r.all_to_alls.assign(n, 0);
  r.cross_node.assign(n, {});
  for (size_t i = 0; i < n; ++i) {
    MPI_Barrier(comm);
    fsdp::reset_collective_counters();
    const Batch& b = data[i].back();
    trainers[i]->step(b.inputs, b.targets);
    const fsdp::CollectiveCounters c = fsdp::collective_counters();
    r.all_to_alls[i] = c.total("all_to_all");
    int64_t bytes = 0;
    for (const auto& entry : c.bytes) bytes += entry.second;
    if (trainers[i]->spec().kind == Kind::Ddp) bytes = trainers[i]->persistent().grads;
    const std::string& tpg = trainers[i]->tp_group();
    // total(op, "") would be every group's.
    auto on_tp = [&](const char* op) { return tpg.empty() ? 0 : c.total(op, tpg); };
    const int64_t ag = on_tp("all_gather"), rs = on_tp("reduce_scatter"),
                  ar = on_tp("all_reduce");
    r.comm_counts[i] = {c.total("all_gather") - ag, c.total("reduce_scatter") - rs,
                        c.total("all_reduce") - ar, ag, rs, ar, bytes};
    std::map<std::string, int64_t> cross;
    for (const auto& [key, sent] : c.cross_node_bytes) cross[key.second] += sent;
    r.cross_node[i] = sum_by_name(cross, comm);
  }
}

int run(Options o, const fsdp::Runtime& rt) {
  CountingAllocator::get().install();
  const int world = rt.world_size();
  const std::optional<Plan> plan = plan_run(o, rt);
  if (!plan) return 1;

  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  Report report("train", columns(), o.json_path, rt.world_rank() == 0);
  describe_run(report, *plan, o, rt);

  const Meshes meshes = make_meshes(*plan, o, world);
  std::vector<std::unique_ptr<Trainer>> trainers = make_trainers(*plan, o, meshes, comm);
  const std::vector<std::vector<Batch>> data = make_batches(*plan, o, trainers);
  const Timed timed = time_steps(trainers, data, o, comm);

  // After timing: losses, persistent bytes, then one more step per config
  // to count its collectives.
  Results results;
  results.stats = timed.stats;
  measure_losses_and_memory(trainers, timed, world, comm, results);
  measure_bubbles_and_phases(trainers, meshes, comm, results);
  count_collectives(trainers, data, comm, results);
  results.num_nodes = rt.num_nodes();

  report_results(report, *plan, trainers, results, world);
  report.finish();

  trainers.clear();
  MPI_Comm_free(&comm);
  return 0;
}

// --seq, --layers, --hidden, --heads, --vocab (DecoderConfig's defaults)
// and --seed.
void add_model_options(CLI::App* sub, Options& o) {
  const models::DecoderConfig defaults;
  sub->add_option("--seq", o.seq, "Sequence length")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->default_str(std::to_string(defaults.seq));
  sub->add_option("--layers", o.layers, "Decoder layers")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}))
      ->default_str(std::to_string(defaults.layers));
  sub->add_option("--hidden", o.hidden, "Hidden size (a multiple of --heads)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->default_str(std::to_string(defaults.hidden));
  sub->add_option("--heads", o.heads, "Attention heads")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}))
      ->default_str(std::to_string(defaults.heads));
  sub->add_option("--vocab", o.vocab, "Vocabulary size")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
      ->default_str(std::to_string(defaults.vocab));
  // CLI11 would read "-1" into the unsigned seed as 2^64 - 1.
  sub->add_option("--seed", o.seed, "Model and data seed, in [0, 2^64 - 1]")
      ->check(CLI::Validator(
          [](const std::string& text) {
            const auto first = text.find_first_not_of(" \t");
            return first != std::string::npos && text[first] == '-'
                       ? "must be an integer in [0, 2^64 - 1], not " + text
                       : std::string();
          },
          "UINT64"))
      ->capture_default_str();
}

// --forward-prefetch, --configs and the parallel configs' sizes.
void add_parallel_options(CLI::App* sub, Options& o) {
  sub->add_flag("--forward-prefetch", o.forward_prefetch,
                "FSDP configs: each unit's forward prefetches the next unit's all-gather "
                "(set_modules_to_forward_prefetch); default: the library's implicit prefetch of "
                "the unit that ran next in the previous step");
  std::vector<std::string> names;
  for (const ConfigSpec& s : all_configs()) names.push_back(s.key);
  sub->add_option("--configs", o.configs, "Configurations to run, comma-separated")
      ->delimiter(',')
      ->check(CLI::IsMember(names))
      ->default_str(fmt::format("{}", fmt::join(names, ",")));
  sub->add_option("--tp", o.tp,
                  "Tensor-parallel size of the fsdp-tp configs (a divisor of the ranks); mesh "
                  "(shard = ranks / tp, tp)")
      ->check(CLI::Range(1, 4096))
      ->default_str("2 if the world size is even, else those configs are skipped");
  sub->add_option("--pp", o.pp,
                  "Pipeline stages of the fsdp-pp configs (a divisor of the ranks; the "
                  "interleaved one runs 2 per rank); mesh (pp, dp = ranks / pp)")
      ->check(CLI::Range(1, 4096))
      ->default_str("2 if the world size is even, else those configs are skipped");
  sub->add_option("--microbatches", o.microbatches,
                  "Microbatches per step of the fsdp-pp configs (dividing the per-pipeline "
                  "batch, --batch / dp)")
      ->check(CLI::Range(1, 1 << 20))
      ->default_str("one per sequence of the per-pipeline batch");
  sub->add_option("--ep", o.ep,
                  "Expert-parallel size of the fsdp-ep-moe config (dividing the ranks and its 4 "
                  "experts); mesh (efsdp = ranks / ep, ep)")
      ->check(CLI::Range(1, 4096))
      ->default_str("2 if the world size is even, else that config is skipped");
}

}  // namespace
}  // namespace train

void add_train_command(CLI::App& app, Command& chosen) {
  auto o = std::make_shared<train::Options>();
  CLI::App* sub = app.add_subcommand(
      "train",
      "Training step time and memory per rank of the LLM decoder: single-process, DDP "
      "(one MPI_Allreduce) and FSDP variants on the same model and global batch. Run under "
      "mpiexec; rank 0 prints.");
  sub->add_option("--batch", o->batch, "Global batch in sequences (a multiple of the ranks)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  sub->add_option("-n,--steps", o->timing.iters, "Timed steps per configuration")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  sub->add_option("-w,--warmup", o->timing.warmup, "Untimed steps first")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  train::add_model_options(sub, *o);
  train::add_parallel_options(sub, *o);
  sub->add_option("--device", o->device,
                  "Where the models and batches live: cpu, or cuda (cuda:<local rank>; the "
                  "single and fsdp* configs only)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  sub->add_option("--param-dtype", o->param_dtype,
                  train::data_parallel_fsdp_keys() +
                      ": all-gather and compute dtype (MixedPrecisionPolicy param_dtype; "
                      "gradients reduced in float32); the other configs stay float32")
      ->check(CLI::IsMember({"float32", "bfloat16"}))
      ->capture_default_str();
  add_json_option(sub, o->json_path);
  sub->callback(
      [o, &chosen] { chosen = [o](const fsdp::Runtime& rt) { return train::run(*o, rt); }; });
}

}  // namespace fsdp_bench
