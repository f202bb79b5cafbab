// fsdp-bench train's options, the table of configurations it can run, and
// the run plan: which of them fit this world and flags (validated alike on
// every rank before anything is built).
#pragma once

#include "harness.h"

#include "fsdp/pipeline.h"
#include "fsdp/options.h"

#include <models/llm.h>
#include <models/tp_llm.h>

#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fsdp_bench::train {

// The flags of fsdp-bench train (add_train_command).
struct Options {
  int batch = 8;  // global batch, sequences
  int64_t seq = 0, layers = 0, hidden = 0, vocab = 0, heads = 0;  // 0 = DecoderConfig default
  TimingOptions timing{2, 10};
  uint64_t seed = 1234;
  double lr = 1e-3;
  bool forward_prefetch = false;
  int tp = 0;  // 0: 2 when the world size is even, else the TP configs are skipped
  int pp = 0;  // likewise for the pipeline configs
  int microbatches = 0;  // 0: one per sequence of the per-pipeline batch
  int ep = 0;  // likewise for the expert-parallel config
  std::vector<std::string> configs;
  std::string json_path;
  std::string device = "cpu";  // cpu | cuda (single and fsdp* configs only)
  c10::Device resolved_device{c10::kCPU};
  // The data-parallel FSDP configs (data_parallel_fsdp_keys()):
  // MixedPrecisionPolicy param_dtype (reduce_dtype float32); the others stay float32.
  std::string param_dtype = "float32";
};

enum class Kind { Single, Ddp, Fsdp, Hsdp, FsdpTp, FsdpPp, FsdpEp };

// The expert-parallel config's MoE layers (models::MoEDecoder's defaults).
constexpr int64_t kExperts = 4, kTopK = 2;

struct ConfigSpec {
  std::string key;
  Kind kind;
  fsdp::ReshardAfterForward reshard_after_forward;
  bool comm_fusion;
  std::string legend;
  models::TPOptions tp{};  // FsdpTp only
  // FsdpPp only.
  fsdp::pp::ScheduleKind schedule = fsdp::pp::ScheduleKind::OneFOneB;
  int stages_per_rank = 1;
  // false: no forward prefetch at all (set_modules_to_forward_prefetch({})
  // on every unit), to measure the implicit one.
  bool forward_prefetch = true;
  // Default: the library's (implicit on CUDA, none on the CPU); Implicit:
  // implicit_backward_prefetch=true; None: set_modules_to_backward_prefetch({}).
  enum class Backward { Default, Implicit, None } backward_prefetch = Backward::Default;
  // Matrix weights all-gathered in float8 (fsdp::float8_all_gather).
  bool float8_all_gather = false;
  // Runs only when --configs names it (not part of the default set).
  bool opt_in = false;
};

// Every configuration fsdp-bench train knows, in run and table order.
const std::vector<ConfigSpec>& all_configs();

// The configs --param-dtype applies to and --device cuda runs beside single.
std::string data_parallel_fsdp_keys();

// What run() runs: the model, the configurations that fit, and the mesh
// sizes of the parallel ones. `*_skipped`: why the configs of that kind were
// dropped ("" when none were).
struct Plan {
  models::DecoderConfig cfg;
  std::vector<ConfigSpec> specs;
  int tp = 2, pp = 2, ep = 2;
  // The pipelines' data-parallel size, batch and microbatches.
  int pp_dp = 1, pp_local_batch = 0, microbatches = 0;
  bool any_tp = false, any_pp = false, any_ep = false, any_hsdp = false;
  std::string tp_skipped, pp_skipped, ep_skipped, hsdp_skipped;
};

// Validates the flags against the world and resolves --device into
// o.resolved_device. On a problem rank 0 prints one line
// ("fsdp-bench train: ...") and every rank gets nullopt alike. Collective
// over MPI_COMM_WORLD (--json's check).
std::optional<Plan> plan_run(Options& o, const fsdp::Runtime& rt);

}  // namespace fsdp_bench::train
