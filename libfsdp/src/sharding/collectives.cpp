// The collective work of one parameter group: custom collectives and their
// buffers, the extensions' byte all-gather, the gradient reduction.
// The rule: docs/architecture.md#collective-order.
#include "sharding/collectives.h"

#include "fsdp/errors.h"
#include "fsdp/trace.h"
#include "sharding/memory_guard.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <sstream>

namespace fsdp::detail {
namespace {

std::string shape_of(at::IntArrayRef sizes) {
  std::ostringstream o;
  o << sizes;
  return o.str();
}

// A custom collective's allocate, held to what was asked for.
at::Tensor checked_allocation(const Allocate& allocate, int64_t numel,
                              const at::TensorOptions& options, const std::string& who) {
  at::Tensor t = allocate(numel, options);
  if (!t.defined() || t.numel() != numel) {
    throw ShapeError("allocate", who + ": 'allocate' returned " +
                                     (t.defined() ? "a tensor of shape " + shape_of(t.sizes())
                                                  : std::string("an undefined tensor")) +
                                     " for " + std::to_string(numel) + " elements; accepted: " +
                                     std::to_string(numel) + " elements");
  }
  const c10::ScalarType want = options.dtype().toScalarType();
  if (t.scalar_type() != want) {
    throw DTypeError("allocate", who + ": 'allocate' returned dtype " +
                                     c10::toString(t.scalar_type()) + " for a request of " +
                                     c10::toString(want) + "; accepted: the requested dtype");
  }
  if (t.device() != options.device() || !t.is_contiguous()) {
    throw LayoutError("allocate", who + ": 'allocate' returned a " +
                                      (t.is_contiguous() ? "" : "non-contiguous ") +
                                      "tensor on " + t.device().str() + " for a request on " +
                                      options.device().str() +
                                      "; accepted: a contiguous tensor on the requested device");
  }
  return t;
}

// `allocate` (when set) checked, viewed as `shape`; else the group's own buffer.
at::Tensor route_buffer(const Allocate* allocate, const std::string& who,
                        const ProcessGroupPtr& group, at::IntArrayRef shape,
                        const at::TensorOptions& options) {
  if (allocate == nullptr || !*allocate) return group->empty_for_collectives(shape, options);
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  return checked_allocation(*allocate, numel, options, who).view(shape);
}

int64_t align8(int64_t n) { return (n + 7) / 8 * 8; }

// A tensor's bytes as a flat uint8 tensor (a view where it is contiguous).
at::Tensor as_bytes(const at::Tensor& t) {
  return t.contiguous().view({-1}).view(at::kByte);
}

std::string extension_of(const ShardedParam& p, const CollectiveRoute& route) {
  return "all-gather extension of '" + p.name() + "' (unit " + route.owner() + ")";
}

}  // namespace

void hint_bytes(const at::Tensor& t) {
  if (trace::enabled() && t.is_cpu()) {
    trace::detail::hint_collective_bytes(static_cast<int64_t>(t.nbytes()));
  }
}

int64_t gathered_bytes(const std::vector<ShardedParam>& params, int64_t ws) {
  int64_t n = 0;
  for (const auto& p : params) {
    if (!p.is_sharded_placement()) continue;
    n += p.padded_block_numel() * ws * static_cast<int64_t>(c10::elementSize(p.compute_dtype()));
  }
  return n;
}

// ---- CollectiveRoute ----

WorkPtr CollectiveRoute::all_gather(const ProcessGroupPtr& group, at::Tensor out,
                                    const at::Tensor& in) const {
  if (custom_all_gather) return custom_all_gather->all_gather(std::move(out), in, *group);
  return group->all_gather_into_tensor(std::move(out), in, /*async_op=*/true);
}

WorkPtr CollectiveRoute::reduce_scatter(const ProcessGroupPtr& group, at::Tensor out,
                                        const at::Tensor& in) const {
  if (custom_reduce_scatter) {
    return custom_reduce_scatter->reduce_scatter(std::move(out), in, ReduceOp::SUM, *group);
  }
  return group->reduce_scatter_tensor(std::move(out), in, ReduceOp::SUM, /*async_op=*/true);
}

at::Tensor CollectiveRoute::all_gather_buffer(const ProcessGroupPtr& group, at::IntArrayRef shape,
                                              const at::TensorOptions& options) const {
  return route_buffer(custom_all_gather ? &custom_all_gather->allocate : nullptr,
                      "custom all-gather of unit " + owner(), group, shape, options);
}

at::Tensor CollectiveRoute::reduce_scatter_buffer(const ProcessGroupPtr& group,
                                                  at::IntArrayRef shape,
                                                  const at::TensorOptions& options) const {
  return route_buffer(custom_reduce_scatter ? &custom_reduce_scatter->allocate : nullptr,
                      "custom reduce-scatter of unit " + owner(), group, shape, options);
}

Allocate CollectiveRoute::all_gather_allocate() const {
  if (!custom_all_gather || !custom_all_gather->allocate) return {};
  return [this](int64_t n, const at::TensorOptions& o) {
    return checked_allocation(custom_all_gather->allocate, n, o,
                              "custom all-gather of unit " + owner());
  };
}

// ---- ExtensionGather ----

std::vector<std::vector<at::Tensor>> ExtensionGather::run_pre_all_gathers(
    std::vector<ShardedParam>& params, const CollectiveRoute& route) {
  std::vector<std::vector<at::Tensor>> all(params.size());
  int64_t offset = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    if (p.extension() == nullptr) continue;
    const std::string who = extension_of(p, route);
    std::vector<at::Tensor> outs = p.extension()->pre_all_gather(p.shard_2d());
    if (outs.empty()) {
      throw ArgumentError("pre_all_gather", who + ": 'pre_all_gather' returned no tensors; "
                                                  "accepted: one or more tensors to gather");
    }
    auto& spec = outputs_[i];
    if (recorded_ && spec.size() != outs.size()) {
      throw ShapeError("pre_all_gather", who + ": 'pre_all_gather' returned " +
                                             std::to_string(outs.size()) +
                                             " tensors; its first call returned " +
                                             std::to_string(spec.size()));
    }
    for (size_t k = 0; k < outs.size(); ++k) {
      const at::Tensor& t = outs[k];
      const std::string which = "output " + std::to_string(k);
      if (!t.defined()) {
        throw ArgumentError("pre_all_gather",
                            who + ": 'pre_all_gather' " + which + " is an undefined tensor");
      }
      if (t.device() != p.compute_device()) {
        throw LayoutError("pre_all_gather", who + ": 'pre_all_gather' " + which + " is on " +
                                                t.device().str() + "; accepted: the compute "
                                                "device " + p.compute_device().str());
      }
      if (!recorded_) {
        offset = align8(offset);
        const auto nbytes = static_cast<int64_t>(t.nbytes());
        spec.push_back({t.sizes().vec(), t.scalar_type(), offset, nbytes});
        offset += nbytes;
        continue;
      }
      if (t.scalar_type() != spec[k].dtype) {
        throw DTypeError("pre_all_gather", who + ": 'pre_all_gather' " + which + " has dtype " +
                                               c10::toString(t.scalar_type()) +
                                               "; its first call returned " +
                                               c10::toString(spec[k].dtype) +
                                               " (every call, on every rank, must match)");
      }
      if (t.sizes().vec() != spec[k].shape) {
        throw ShapeError("pre_all_gather", who + ": 'pre_all_gather' " + which + " has shape " +
                                               shape_of(t.sizes()) + "; its first call returned " +
                                               shape_of(spec[k].shape) +
                                               " (every call, on every rank, must match)");
      }
    }
    all[i] = std::move(outs);
  }
  if (!recorded_) {
    block_bytes_ = align8(offset);
    recorded_ = true;
  }
  return all;
}

void ExtensionGather::run_post_all_gather(ShardedParam& p, const std::vector<at::Tensor>& gathered,
                                          int64_t ws, const CollectiveRoute& route) {
  const std::string who = extension_of(p, route);
  at::Tensor full = p.extension()->post_all_gather(gathered, p.compute_dtype());
  const int64_t rows = p.full_rows();
  const int64_t cols = p.full_cols();
  if (!full.defined() || full.numel() != rows * cols) {
    throw ShapeError("post_all_gather",
                     who + ": 'post_all_gather' returned " +
                         (full.defined() ? "shape " + shape_of(full.sizes())
                                         : std::string("an undefined tensor")) +
                         "; accepted: [" + std::to_string(rows) + ", " + std::to_string(cols) +
                         "] (" + std::to_string(ws) + " ranks x " +
                         std::to_string(rows / std::max<int64_t>(ws, 1)) + " rows)");
  }
  if (full.scalar_type() != p.compute_dtype()) {
    throw DTypeError("post_all_gather", who + ": 'post_all_gather' returned dtype " +
                                            c10::toString(full.scalar_type()) +
                                            "; accepted: the compute dtype " +
                                            c10::toString(p.compute_dtype()));
  }
  if (full.device() != p.compute_device()) {
    throw LayoutError("post_all_gather", who + ": 'post_all_gather' returned a tensor on " +
                                             full.device().str() + "; accepted: " +
                                             p.compute_device().str());
  }
  const int64_t bytes =
      rows * cols * static_cast<int64_t>(c10::elementSize(p.compute_dtype()));
  oom_guard("unshard", bytes, [&] { p.install_full(full); });
}

void ExtensionGather::issue(std::vector<ShardedParam>& params, const ProcessGroupPtr& group,
                            const CollectiveRoute& route, std::vector<WorkPtr>& works) {
  const int64_t ws = group->size();
  const int64_t me = group->rank();
  std::vector<std::vector<at::Tensor>> outs = run_pre_all_gathers(params, route);
  c10::Device device = c10::kCPU;
  for (const auto& p : params) {
    if (p.extension() != nullptr) device = p.compute_device();
  }
  const auto options = at::TensorOptions(at::kByte).device(device);
  gather_out_ = oom_guard("all-gather", ws * block_bytes_, [&] {
    return route.all_gather_buffer(group, {ws * block_bytes_}, options);
  });
  const at::Tensor mine = gather_out_.narrow(0, me * block_bytes_, block_bytes_);
  for (size_t i = 0; i < params.size(); ++i) {
    for (size_t k = 0; k < outs[i].size(); ++k) {
      const Output& spec = outputs_[i][k];
      mine.narrow(0, spec.offset, spec.nbytes).copy_(as_bytes(outs[i][k]));
    }
  }
  hint_bytes(gather_out_);
  if (auto w = route.all_gather(group, gather_out_, mine)) works.push_back(w);
  issued_ = true;
}

void ExtensionGather::finish(std::vector<ShardedParam>& params, int64_t ws,
                             const CollectiveRoute& route) {
  const at::Tensor rows = gather_out_.view({ws, block_bytes_});
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].extension() == nullptr) continue;
    std::vector<at::Tensor> gathered;
    for (const Output& spec : outputs_[i]) {
      const at::Tensor bytes = rows.narrow(1, spec.offset, spec.nbytes).contiguous();
      std::vector<int64_t> shape = spec.shape;
      if (shape.empty()) {
        shape = {ws};
      } else {
        shape[0] *= ws;
      }
      gathered.push_back(bytes.view({-1}).view(spec.dtype).view(shape));
    }
    run_post_all_gather(params[i], gathered, ws, route);
  }
  drop();
}

void ExtensionGather::unshard_locally(std::vector<ShardedParam>& params,
                                      const CollectiveRoute& route) {
  std::vector<std::vector<at::Tensor>> outs = run_pre_all_gathers(params, route);
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].extension() == nullptr) continue;
    std::vector<at::Tensor> gathered;
    for (const at::Tensor& t : outs[i]) {
      gathered.push_back(t.dim() == 0 ? t.reshape({1}) : t.contiguous());
    }
    run_post_all_gather(params[i], gathered, 1, route);
  }
}

void ExtensionGather::drop() {
  gather_out_ = at::Tensor();
  issued_ = false;
}

}  // namespace fsdp::detail
