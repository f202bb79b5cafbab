// What fully_shard needs to know about a TP model: the DistributedParams its
// layers list, and the helpers layers use to build them.
#include "fsdp/tensor_parallel.h"

#include "fsdp/errors.h"
#include "sharding/query.h"
#include "tp/check.h"

#include <string>
#include <unordered_set>

namespace fsdp::tp {
namespace {

void collect(const torch::nn::Module& m, std::unordered_set<const c10::TensorImpl*>& seen,
             std::vector<DistributedParam>& out) {
  const auto* pm = dynamic_cast<const ParallelModule*>(&m);
  if (pm == nullptr) return;
  // A unit swaps its parameters' data for FSDP shards, which no longer fit
  // the tp layout distributed_params() describes: skip such modules before
  // asking them.
  for (const at::Tensor& p : m.parameters(/*recurse=*/false)) {
    if (fsdp::detail::is_managed(p)) return;
  }
  for (DistributedParam& dp : pm->distributed_params()) {
    const at::Tensor& local = dp.param.to_local();
    // Tied parameters are listed once.
    if (!seen.insert(local.unsafeGetTensorImpl()).second) continue;
    out.push_back(std::move(dp));
  }
}

}  // namespace

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

std::vector<DistributedParam> dtensor_params(const torch::nn::Module& module) {
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<DistributedParam> out;
  // modules(include_self=true) needs the module to be owned by a shared_ptr.
  collect(module, seen, out);
  for (const auto& child : module.modules(/*include_self=*/false)) collect(*child, seen, out);
  return out;
}

FullyShardOptions options_for(const torch::nn::Module& module, FullyShardOptions base) {
  for (auto& p : dtensor_params(module)) base.dtensor_params.push_back(std::move(p));
  return base;
}

}  // namespace fsdp::tp
