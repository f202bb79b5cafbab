// fsdp-bench memory: fsdp::estimate_memory against what a models::Decoder
// trained with fully_shard (each layer, then the root) and AdamW really
// takes, counted by libfsdp's tracking allocator (fsdp/memory.h).
//
//   mpiexec -n 4 fsdp-bench memory [--preset small,large] [--dtype fp32,bf16] [--check 0.10]
//
// Persistent: live bytes after the last optimizer step (shards, gradients,
// AdamW state); peak: the largest live bytes during the steps; both over the
// live bytes before the model was built, the maximum over ranks. --check T
// exits 1 unless every ratio estimate / measured lies within 1 +- T.
#include "harness.h"

#include "fsdp/fully_shard.h"
#include "fsdp/memory.h"
#include "fsdp/mesh.h"

#include "models/llm.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <iostream>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace fsdp_bench {
namespace {

struct Preset {
  std::string name;
  models::DecoderConfig config;
  int64_t batch;  // per rank
};

Preset preset(const std::string& name) {
  Preset p;
  p.name = name;
  p.config.vocab = 256;
  p.config.seq = 128;
  if (name == "small") {  // fsdp-train's default decoder
    p.config.hidden = 256;
    p.config.heads = 4;
    p.config.layers = 4;
    p.batch = 8;
  } else {  // "large": ~200M parameters
    p.config.hidden = 1024;
    p.config.heads = 16;
    p.config.layers = 16;
    p.batch = 4;
  }
  return p;
}

struct Options {
  std::vector<std::string> presets{"small"};
  std::vector<std::string> dtypes{"fp32", "bf16"};
  int steps = 2;
  double check = 0;  // 0: report only
  bool report = false;  // print fsdp::memory_report after the steps (rank 0)
};

std::vector<int64_t> shape_of(const at::Tensor& t) { return t.sizes().vec(); }

struct Row {
  fsdp::MemoryEstimate estimate;
  int64_t persistent = 0;
  int64_t peak = 0;
  int64_t params = 0;
};

Row run_one(const Preset& p, bool bf16, int steps, bool report, const fsdp::Runtime& rt) {
  {
    // The units of an earlier configuration's model hold their shards and
    // gradients until the next fully_shard call prunes dead units
    // (sharding/registry.cpp): make that happen before the baseline, or it
    // would count memory freed during this configuration.
    torch::nn::Linear prune(1, 1);
    fsdp::fully_shard(prune.ptr());
  }
  const int64_t base = fsdp::tracked_live_bytes();
  Row row;
  {
    models::Decoder net(p.config);
    // The estimator's view, read before sharding replaces the parameters.
    std::vector<fsdp::UnitSpec> units;
    const auto acts = models::decoder_activation_bytes(p.config, p.batch, p.config.seq,
                                                      bf16 ? at::kBFloat16 : at::kFloat, false);
    fsdp::UnitSpec root;
    root.name = "root";
    root.reshard_after_forward = false;  // FSDP2's default for the root
    root.activation_bytes = acts.root;
    std::set<const void*> in_layers;
    for (auto& layer : net->layers) {
      fsdp::UnitSpec u;
      u.name = "layer";
      for (const auto& t : layer.holder()->parameters()) {
        u.param_shapes.push_back(shape_of(t));
        in_layers.insert(t.unsafeGetTensorImpl());
      }
      u.activation_bytes = acts.layer;
      u.backward_workspace_bytes = acts.layer_backward;
      units.push_back(u);
    }
    for (const auto& t : net->parameters()) {
      row.params += t.numel();
      if (!in_layers.count(t.unsafeGetTensorImpl())) root.param_shapes.push_back(shape_of(t));
    }
    units.insert(units.begin(), root);  // forward order: the root's forward opens first
    fsdp::EstimateLayout layout;
    layout.shard_size = rt.world_size();
    if (bf16) {
      layout.mp_param_dtype = at::kBFloat16;
      layout.mp_reduce_dtype = at::kFloat;
    }
    layout.optimizer = fsdp::EstimateOptimizer::adamw;
    layout.extra_bytes = acts.loss;
    row.estimate = fsdp::estimate_memory(units, layout);

    fsdp::FullyShardOptions options;
    if (bf16) {
      options.mp_policy.param_dtype = at::kBFloat16;
      options.mp_policy.reduce_dtype = at::kFloat;
    }
    for (auto& layer : net->layers) fsdp::fully_shard(layer.holder(), options);
    fsdp::Sharded<models::Decoder> model = fsdp::fully_shard(net, options);
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
    fsdp::reset_tracked_peak();
    for (int s = 0; s < steps; ++s) {
      // Gradients are kept between steps (no zero_grad): what the estimate
      // assumes (docs/memory.md#estimator); their values do not matter here.
      at::Tensor tokens = at::randint(p.config.vocab, {p.batch, p.config.seq + 1}, at::kLong);
      at::Tensor loss = models::lm_loss(model(tokens.narrow(1, 0, p.config.seq)),
                                        tokens.narrow(1, 1, p.config.seq));
      loss.backward();
      opt.step();
    }
    row.persistent = fsdp::tracked_live_bytes() - base;
    row.peak = fsdp::tracked_peak_bytes() - base;
    if (report && rt.world_rank() == 0) {
      std::cout << fsdp::to_string(fsdp::memory_report(*net, &opt)) << std::flush;
    }
  }
  const auto worst = max_over_ranks(MPI_COMM_WORLD, std::vector<int64_t>{row.persistent, row.peak});
  row.persistent = worst[0];
  row.peak = worst[1];
  return row;
}

double mib(int64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); }

int run(const Options& o, const fsdp::Runtime& rt) {
  fsdp::install_memory_tracking();
  const bool print = rt.world_rank() == 0;
  if (print) {
    fmt::print("# fsdp-bench memory: estimate_memory vs the tracking allocator, per rank (max over "
               "ranks), AdamW, {} steps, MiB\n",
               o.steps);
    fmt::print("{:>7} {:>3} {:>5} {:>8} | {:>10} {:>10} {:>6} | {:>10} {:>10} {:>6} {:>8}\n",
               "config", "np", "dtype", "params", "est.pers", "meas.pers", "ratio", "est.peak",
               "meas.peak", "ratio", "peak in");
  }
  bool ok = true;
  for (const auto& name : o.presets) {
    const Preset p = preset(name);
    for (const auto& dtype : o.dtypes) {
      const Row r = run_one(p, dtype == "bf16", o.steps, o.report, rt);
      const double pers_ratio = static_cast<double>(r.estimate.persistent_bytes) /
                                static_cast<double>(std::max<int64_t>(r.persistent, 1));
      const double peak_ratio = static_cast<double>(r.estimate.peak_bytes) /
                                static_cast<double>(std::max<int64_t>(r.peak, 1));
      if (o.check > 0 &&
          (std::abs(pers_ratio - 1) > o.check || std::abs(peak_ratio - 1) > o.check)) {
        ok = false;
      }
      if (print) {
        fmt::print("{:>7} {:>3} {:>5} {:>7.1f}M | {:>10.1f} {:>10.1f} {:>6.3f} | {:>10.1f} {:>10.1f} "
                   "{:>6.3f} {:>8}\n",
                   p.name, rt.world_size(), dtype == "bf16" ? "bf16" : "fp32",
                   static_cast<double>(r.params) / 1e6, mib(r.estimate.persistent_bytes),
                   mib(r.persistent), pers_ratio, mib(r.estimate.peak_bytes), mib(r.peak),
                   peak_ratio, r.estimate.peak_phase);
        std::fflush(stdout);
      }
    }
  }
  if (!ok && print) {
    std::cerr << "fsdp-bench memory: an estimate is off by more than " << o.check * 100
              << "% (--check)" << std::endl;
  }
  return ok ? 0 : 1;
}

}  // namespace

void add_memory_command(CLI::App& app, Command& chosen) {
  auto o = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand(
      "memory",
      "fsdp::estimate_memory against the measured bytes of a models::Decoder trained with "
      "fully_shard and AdamW (tracking allocator). Run under mpiexec.");
  sub->add_option("--preset", o->presets,
                  "small: vocab 256, hidden 256, 4 heads, 4 layers, seq 128, batch 8 per rank; "
                  "large: hidden 1024, 16 heads, 16 layers, batch 4 (~200M parameters)")
      ->delimiter(',')
      ->check(CLI::IsMember({"small", "large"}))
      ->capture_default_str();
  sub->add_option("--dtype", o->dtypes, "fp32, or bf16 parameters with fp32 reduction")
      ->delimiter(',')
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  sub->add_option("--steps", o->steps, "AdamW steps")->check(CLI::Range(1, 100))->capture_default_str();
  sub->add_option("--check", o->check,
                  "Exit 1 unless every estimate is within this fraction of the measurement")
      ->check(CLI::Range(0.0, 1.0));
  sub->add_flag("--report", o->report, "Print fsdp::memory_report after the steps (rank 0)");
  sub->callback([o, &chosen] { chosen = [o](const fsdp::Runtime& rt) { return run(*o, rt); }; });
}

}  // namespace fsdp_bench
