// Memory you can see: what each fully_shard unit holds now, a tracking (and
// budgeting) wrapper of LibTorch's CPU allocator, and an estimate of a
// sharded model's memory per rank before it is built. See docs/memory.md.
//
//   fsdp::MemoryReport r = fsdp::memory_report(*model, &optimizer);
//   std::cout << fsdp::to_string(r);          // a table, one row per unit
//
// Bytes are counted per storage, once: views of one buffer (a fused
// all-gather output, a parameter and its shard) are not counted twice.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace torch {
namespace nn {
class Module;
}  // namespace nn
namespace optim {
class Optimizer;
}  // namespace optim
}  // namespace torch

namespace fsdp {

// What one unit holds on this rank, in bytes.
struct UnitMemory {
  std::string unit;                 // the unit's label ("layers.0"; "(root)" for the root)
  int64_t shard_bytes = 0;          // its parameters' local shards (padded rows included)
  int64_t unsharded_bytes = 0;      // gathered (full) parameters held now, all-gather buffers
  int64_t grad_bytes = 0;           // sharded gradients + fp32 main gradients
  int64_t reduce_buffer_bytes = 0;  // full-size gradients (this pass, unsynchronised
                                    // accumulation), reduce-scatter / all-reduce buffers held
  int64_t optimizer_bytes = 0;      // optimizer state of its parameters (memory_report's optimizer)
  int64_t total() const {
    return shard_bytes + unsharded_bytes + grad_bytes + reduce_buffer_bytes + optimizer_bytes;
  }
};

// CUDA's caching allocator on this rank's device (only when the units'
// tensors are CUDA and libfsdp was built with CUDA support).
struct CudaMemoryStats {
  bool available = false;
  int device = -1;
  int64_t allocated_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t peak_allocated_bytes = 0;
};

struct MemoryReport {
  std::vector<UnitMemory> units;  // in the order of the root's named_modules()
  UnitMemory totals;              // unit "total": the sum of the rows
  // The tracking allocator's (install_memory_tracking) live and peak bytes
  // of this process: everything LibTorch allocated on the CPU, not only
  // FSDP's; none when it is not installed.
  std::optional<int64_t> tracked_live_bytes;
  std::optional<int64_t> peak_allocated_bytes;
  CudaMemoryStats cuda;
};

// Every unit in `root` (root included if sharded): walks root.named_modules()
// and reports each unit once. With an optimizer, the state of each parameter
// it holds (AdamW's exp_avg, exp_avg_sq, ...; SGD's momentum buffer; Adam,
// Adagrad, RMSprop too) is attributed to the unit that manages the
// parameter; state of parameters no unit manages goes to a row
// "(not sharded)". Reads only: never communicates, never allocates tensors.
MemoryReport memory_report(const torch::nn::Module& root,
                           const torch::optim::Optimizer* optimizer = nullptr);

// A table for people: one row per unit and the totals, in MiB, then the
// tracked and CUDA figures where present.
std::string to_string(const MemoryReport& report);

// ---- The tracking allocator ------------------------------------------------
// LibTorch's CPU allocator wrapped to count live bytes and their peak for the
// process (libfsdp's shared-memory collective buffers included: they are
// all-gather outputs and reduce-scatter inputs, which LibTorch never sees),
// with an optional budget. Install it before the tensors you want counted
// are made (tensors allocated before are freed by their own allocator and
// never counted). Once installed it stays for the process. Replaces any
// shared-memory observer (fsdp::set_shared_memory_observer).
void install_memory_tracking();
bool memory_tracking_installed();
int64_t tracked_live_bytes();
int64_t tracked_peak_bytes();
// Starts a new peak window at the current live bytes.
void reset_tracked_peak();
// A per-process budget (0 = none): an allocation that would take the live
// bytes counted by LibTorch's CPU allocator above it fails as a real
// out-of-memory does, with c10::Error "DefaultCPUAllocator: not enough
// memory: ..." (what LibTorch throws when malloc fails). Shared-memory
// buffers are counted but never refused: set FSDP_SHM_BYTES=0 to have
// fully_shard's collective buffers come from LibTorch's allocator too.
// Needs install_memory_tracking() (else StateError).
void set_memory_budget(int64_t bytes);

// ---- The estimator ---------------------------------------------------------
// One fully_shard unit as the estimator sees it. Formula: docs/memory.md#estimator.
struct UnitSpec {
  std::string name;
  // Shapes of the parameters this unit manages (the full tensors).
  std::vector<std::vector<int64_t>> param_shapes;
  // Bytes this unit's forward saves for backward on one rank (activations:
  // the estimator cannot know a model's forward, see
  // models::decoder_activation_bytes for models::Decoder).
  int64_t activation_bytes = 0;
  // The most bytes of gradient temporaries its backward holds at once on top
  // of the saved activations (gradients of its activations, in flight between
  // autograd nodes); models::decoder_activation_bytes states it too.
  int64_t backward_workspace_bytes = 0;
  // The root keeps its parameters after forward (FSDP2 does not reshard the
  // root: its backward starts at once); other units reshard by default.
  bool reshard_after_forward = true;
};

enum class EstimateOptimizer { none, sgd, sgd_momentum, adamw };

struct EstimateLayout {
  int64_t shard_size = 1;                 // ranks each parameter is split over
  c10::ScalarType param_dtype = c10::kFloat;   // the parameters' own dtype (the shards)
  std::optional<c10::ScalarType> mp_param_dtype;   // MixedPrecisionPolicy::param_dtype
  std::optional<c10::ScalarType> mp_reduce_dtype;  // MixedPrecisionPolicy::reduce_dtype
  EstimateOptimizer optimizer = EstimateOptimizer::adamw;
  bool fp32_main_grad = false;   // apply_grad_on_fp32_main_grad
  int64_t prefetch = 1;          // units gathered ahead (implicit prefetch: 1)
  int64_t extra_bytes = 0;       // what else lives at the peak (inputs, logits, loss: the caller's)
};

struct MemoryEstimate {
  int64_t shard_bytes = 0;       // parameter shards
  int64_t grad_bytes = 0;        // sharded gradients (+ fp32 main gradients)
  int64_t optimizer_bytes = 0;   // optimizer state
  int64_t persistent_bytes = 0;  // the three above: what lives between steps
  int64_t forward_peak_bytes = 0;   // transient at the forward peak (above persistent)
  int64_t backward_peak_bytes = 0;  // transient at the backward peak (above persistent)
  int64_t peak_bytes = 0;        // persistent + the larger transient
  std::string peak_phase;        // "forward" or "backward"
};

// Per rank. Errors: shard_size < 1, a negative shape or activation size ->
// ArgumentError naming the argument.
MemoryEstimate estimate_memory(const std::vector<UnitSpec>& units, const EstimateLayout& layout);

}  // namespace fsdp
