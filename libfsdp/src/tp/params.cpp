// The helpers tensor-parallel layers build their DistributedParams with.
#include "fsdp/tensor_parallel.h"

#include "fsdp/errors.h"
#include "tp/check.h"

#include <string>

namespace fsdp::tp {

int64_t local_size(const char* arg, int64_t n, const DeviceMesh& tp) {
  detail::check_tp("local_size", tp);
  if (n % tp.size() != 0) {
    throw ShapeError(arg, "local_size: '" + std::string(arg) + "' = " + std::to_string(n) +
                              " does not divide by the tp size " + std::to_string(tp.size()));
  }
  return n / tp.size();
}

DistributedParam replicated_param(const at::Tensor& param, const DeviceMesh& tp,
                                  bool partial_grad) {
  detail::check_tp("replicated_param", tp);
  DTensor d = DTensor::from_local(param, tp, {Placement::Replicate()}, param.sizes().vec());
  if (!partial_grad) return DistributedParam(std::move(d));
  return DistributedParam(std::move(d), {Placement::Partial()});
}

}  // namespace fsdp::tp
