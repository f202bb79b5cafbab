// fsdp::estimate_memory: a sharded model's bytes per rank from its units'
// parameter shapes, the layout and the caller's activation sizes. The
// formula, term by term, is docs/memory.md#estimator; each term below names
// the buffer of fully_shard (sharding/param.cpp, param_group.cpp,
// gradient_reduction.cpp) it stands for.
#include "fsdp/memory.h"

#include "fsdp/errors.h"

#include <algorithm>
#include <string>

namespace fsdp {
namespace {

int64_t esize(c10::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); }

// One unit's sizes per rank, in bytes.
struct UnitBytes {
  int64_t shard = 0;      // padded shards, original dtype (ShardedParam::padded_)
  int64_t gathered = 0;   // all-gather outputs, param dtype (unsharded_buf_); 0 when the shard is the full tensor
  int64_t full_grad = 0;  // autograd's full gradients (param dtype), + their reduce-dtype copy
  int64_t reduce = 0;     // reduce-scatter input (a row per rank) and output, with the presence flags
  int64_t grad = 0;       // sharded gradients (reduce dtype; fp32 main grads instead if set)
  int64_t optimizer = 0;
  int64_t activations = 0;
  int64_t workspace = 0;  // backward's gradient temporaries (the caller's)
  bool keeps_unsharded = false;  // reshard_after_forward = false
};

UnitBytes unit_bytes(const UnitSpec& u, const EstimateLayout& l) {
  const int64_t ws = l.shard_size;
  const c10::ScalarType orig = l.param_dtype;
  const c10::ScalarType param = l.mp_param_dtype.value_or(orig);
  const c10::ScalarType reduce = l.mp_reduce_dtype.value_or(param);
  UnitBytes b;
  b.activations = u.activation_bytes;
  b.workspace = u.backward_workspace_bytes;
  b.keeps_unsharded = !u.reshard_after_forward;
  int64_t block_total = 0, full_total = 0, flags = 0;
  for (const auto& shape : u.param_shapes) {
    int64_t rows = 1, rest = 1;
    for (size_t d = 0; d < shape.size(); ++d) {
      if (shape[d] < 0) {
        throw ShapeError("units", "estimate_memory: unit '" + u.name + "' has a parameter shape "
                                      "with a negative size; accepted: sizes >= 0");
      }
      (d == 0 ? rows : rest) *= shape[d];
    }
    const int64_t chunk = (rows + ws - 1) / ws;  // ceil-div over the shard dim (dim 0)
    block_total += chunk * rest;
    full_total += rows * rest;
    flags += 1;
  }
  b.shard = block_total * esize(orig);
  // One rank and no cast: the full tensor is the shard itself.
  b.gathered = (ws == 1 && param == orig) ? 0 : block_total * ws * esize(param);
  b.full_grad = full_total * esize(param) + (reduce != param ? full_total * esize(reduce) : 0);
  b.reduce = ws == 1 ? 0 : (ws + 1) * (block_total + flags) * esize(reduce);
  b.grad = block_total * (l.fp32_main_grad ? 4 : esize(reduce));
  switch (l.optimizer) {
    case EstimateOptimizer::none:
    case EstimateOptimizer::sgd:
      break;
    case EstimateOptimizer::sgd_momentum:
      b.optimizer = block_total * esize(orig);
      break;
    case EstimateOptimizer::adamw:
      b.optimizer = 2 * block_total * esize(orig);  // exp_avg, exp_avg_sq like the shard
      break;
  }
  return b;
}

}  // namespace

MemoryEstimate estimate_memory(const std::vector<UnitSpec>& units, const EstimateLayout& layout) {
  if (layout.shard_size < 1) {
    throw ArgumentError("layout", "estimate_memory: layout.shard_size = " +
                                      std::to_string(layout.shard_size) + "; accepted: >= 1");
  }
  if (layout.prefetch < 0) {
    throw ArgumentError("layout", "estimate_memory: layout.prefetch = " +
                                      std::to_string(layout.prefetch) + "; accepted: >= 0");
  }
  std::vector<UnitBytes> b;
  for (const auto& u : units) {
    if (u.activation_bytes < 0 || u.backward_workspace_bytes < 0) {
      throw ArgumentError("units", "estimate_memory: unit '" + u.name +
                                       "' has activation_bytes = " +
                                       std::to_string(u.activation_bytes) +
                                       ", backward_workspace_bytes = " +
                                       std::to_string(u.backward_workspace_bytes) +
                                       "; accepted: both >= 0");
    }
    b.push_back(unit_bytes(u, layout));
  }
  MemoryEstimate e;
  for (const auto& x : b) {
    e.shard_bytes += x.shard;
    e.grad_bytes += x.grad;
    e.optimizer_bytes += x.optimizer;
  }
  e.persistent_bytes = e.shard_bytes + e.grad_bytes + e.optimizer_bytes;
  const auto n = static_cast<int64_t>(b.size());
  auto gathered_window = [&](int64_t i, int64_t dir) {
    // Unit i and the `prefetch` units gathered ahead of it in this direction
    // (units kept unsharded are counted apart, as `kept`).
    int64_t sum = 0;
    for (int64_t k = 0; k <= layout.prefetch; ++k) {
      const int64_t j = i + dir * k;
      if (j < 0 || j >= n) break;
      if (!b[static_cast<size_t>(j)].keeps_unsharded) sum += b[static_cast<size_t>(j)].gathered;
    }
    return sum;
  };
  // Forward, unit by unit in order: the activations saved so far, the units
  // kept unsharded that have run, unit i and its prefetch; at the end all
  // activations, the kept units and the caller's extra (logits, loss).
  int64_t acts = 0, kept = 0, fwd = 0;
  for (int64_t i = 0; i < n; ++i) {
    const auto& x = b[static_cast<size_t>(i)];
    acts += x.activations;
    if (x.keeps_unsharded) kept += x.gathered;
    fwd = std::max(fwd, acts + kept + gathered_window(i, +1));
  }
  fwd = std::max(fwd, acts + kept + layout.extra_bytes);
  // Backward, in reverse: the activations of the units before i; unit i's
  // own activations with its backward's gradient temporaries, or (once they
  // are freed) its full gradients and reduction buffers; the next unit's
  // reduction still in flight; unit i and its prefetch; the kept units.
  // (Its start -- all activations and the loss's gradient -- is the
  // forward's end above.)
  int64_t bwd = 0, below = acts;
  for (int64_t i = n - 1; i >= 0; --i) {
    const auto& x = b[static_cast<size_t>(i)];
    below -= x.activations;
    const int64_t in_flight = i + 1 < n ? b[static_cast<size_t>(i + 1)].reduce : 0;
    const int64_t own = std::max(x.activations + x.workspace, x.full_grad + x.reduce);
    bwd = std::max(bwd, below + own + in_flight + kept + gathered_window(i, -1));
  }
  e.forward_peak_bytes = fwd;
  e.backward_peak_bytes = bwd;
  e.peak_phase = fwd >= bwd ? "forward" : "backward";
  e.peak_bytes = e.persistent_bytes + std::max(fwd, bwd);
  return e;
}

}  // namespace fsdp
