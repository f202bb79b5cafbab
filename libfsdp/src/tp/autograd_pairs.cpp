// Megatron's conjugate collectives as redistributions of local tensors on
// the 1-D tp mesh: each pair is one redistribute_local, whose forward and
// backward placements give exactly the table in tensor_parallel.h.
#include "fsdp/tensor_parallel.h"

#include "fsdp/errors.h"
#include "tp/check.h"

#include <string>

namespace fsdp::tp {
namespace {

const Placement kR = Placement::Replicate();
const Placement kP = Placement::Partial();

// The global shape when `d` of `x` is this rank's 1/tp piece.
std::vector<int64_t> gathered(const at::Tensor& x, int64_t d, const DeviceMesh& tp) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape[static_cast<size_t>(d)] *= tp.size();
  return shape;
}

// Splitting needs even pieces: the local tensors carry no padding.
void check_even(const char* fn, const at::Tensor& x, int64_t d, const DeviceMesh& tp) {
  if (x.size(d) % tp.size() != 0) {
    throw ShapeError("x", std::string(fn) + ": 'x' has " + std::to_string(x.size(d)) +
                              " entries along dim " + std::to_string(d) +
                              ", which does not divide by the tp size " +
                              std::to_string(tp.size()));
  }
}

}  // namespace

at::Tensor copy_to_tp(const at::Tensor& x, const DeviceMesh& tp) {
  detail::check_tp("copy_to_tp", tp);
  return redistribute_local(x, tp, {kR}, {kR}, x.sizes().vec(), std::vector<Placement>{kP});
}

at::Tensor reduce_from_tp(const at::Tensor& x, const DeviceMesh& tp) {
  detail::check_tp("reduce_from_tp", tp);
  return redistribute_local(x, tp, {kP}, {kR}, x.sizes().vec());
}

at::Tensor gather_from_tp(const at::Tensor& x, int64_t dim, const DeviceMesh& tp) {
  detail::check_tp("gather_from_tp", tp);
  const int64_t d = detail::wrap_dim("gather_from_tp", x, dim);
  return redistribute_local(x, tp, {Placement::Shard(d)}, {kR}, gathered(x, d, tp));
}

at::Tensor split_to_tp(const at::Tensor& x, int64_t dim, const DeviceMesh& tp) {
  detail::check_tp("split_to_tp", tp);
  const int64_t d = detail::wrap_dim("split_to_tp", x, dim);
  check_even("split_to_tp", x, d, tp);
  return redistribute_local(x, tp, {kR}, {Placement::Shard(d)}, x.sizes().vec());
}

at::Tensor sp_all_gather(const at::Tensor& x, int64_t dim, const DeviceMesh& tp) {
  detail::check_tp("sp_all_gather", tp);
  const int64_t d = detail::wrap_dim("sp_all_gather", x, dim);
  return redistribute_local(x, tp, {Placement::Shard(d)}, {kR}, gathered(x, d, tp),
                            std::vector<Placement>{kP});
}

at::Tensor sp_reduce_scatter(const at::Tensor& x, int64_t dim, const DeviceMesh& tp) {
  detail::check_tp("sp_reduce_scatter", tp);
  const int64_t d = detail::wrap_dim("sp_reduce_scatter", x, dim);
  check_even("sp_reduce_scatter", x, d, tp);
  return redistribute_local(x, tp, {kP}, {Placement::Shard(d)}, x.sizes().vec());
}

}  // namespace fsdp::tp
