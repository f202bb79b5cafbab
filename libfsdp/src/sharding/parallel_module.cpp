// What fully_shard needs to know about modules another parallelism already
// distributes: the DistributedParams they list.
#include "fsdp/parallel_module.h"

#include "sharding/registry.h"

#include <unordered_set>

namespace fsdp {
namespace {

void collect(const torch::nn::Module& m, std::unordered_set<const c10::TensorImpl*>& seen,
             std::vector<DistributedParam>& out) {
  const auto* pm = dynamic_cast<const ParallelModule*>(&m);
  if (pm == nullptr) return;
  // A unit swaps its parameters' data for FSDP shards, which no longer fit
  // the layout distributed_params() describes: skip such modules before
  // asking them.
  for (const at::Tensor& p : m.parameters(/*recurse=*/false)) {
    if (detail::is_managed(p)) return;
  }
  for (DistributedParam& dp : pm->distributed_params()) {
    const at::Tensor& local = dp.param.to_local();
    if (!seen.insert(local.unsafeGetTensorImpl()).second) continue;
    out.push_back(std::move(dp));
  }
}

}  // namespace

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

}  // namespace fsdp
