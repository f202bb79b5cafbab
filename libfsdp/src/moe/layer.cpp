// The MoE layer, the fully_shard options for its experts, and per-expert
// gradient norms over whatever layout the experts ended up in.
#include "fsdp/moe.h"

#include "fsdp/errors.h"
#include "sharding/query.h"

#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <sstream>
#include <string>
#include <unordered_set>

namespace fsdp::moe {

MoEImpl::MoEImpl(int64_t dim, int64_t ffn, int64_t num_experts, int64_t top_k,
                 std::optional<DeviceMesh> ep, RouterOptions router_options)
    : dispatcher(num_experts, ep) {
  router = register_module("router", TopKRouter(dim, num_experts, top_k, std::move(router_options)));
  experts = register_module("experts", GroupedExperts(dim, ffn, num_experts, std::move(ep)));
}

at::Tensor MoEImpl::forward(const at::Tensor& x) {
  const auto shape = x.sizes().vec();
  const at::Tensor tokens = x.reshape({-1, shape.back()});
  RouterOutput r = router(tokens);
  last_ids_ = r.ids;
  last_counts_ = r.counts;
  last_margin_ = r.margin;
  aux_loss_ = r.aux_loss;
  auto [rows, plan] = dispatcher.dispatch(tokens, r.ids);
  const at::Tensor y = experts(rows, plan.local_counts);
  return dispatcher.combine(y, r.weights, plan).view(shape);
}

namespace {

std::vector<const GroupedExpertsImpl*> experts_in(const torch::nn::Module& module) {
  std::vector<const GroupedExpertsImpl*> out;
  if (const auto* e = dynamic_cast<const GroupedExpertsImpl*>(&module)) out.push_back(e);
  for (const auto& child : module.modules(/*include_self=*/false)) {
    if (const auto* e = dynamic_cast<const GroupedExpertsImpl*>(child.get())) out.push_back(e);
  }
  return out;
}

}  // namespace

FullyShardOptions expert_options(const torch::nn::Module& module, FullyShardOptions base,
                                 const DeviceMesh& expert_mesh, double data_parallel_size) {
  if (!std::isfinite(data_parallel_size) || data_parallel_size <= 0) {
    std::ostringstream os;
    os << data_parallel_size;
    throw ArgumentError("data_parallel_size",
                        "expert_options: 'data_parallel_size' = " + os.str() +
                            "; accepted: the number of data-parallel ranks (> 0)");
  }
  if (expert_mesh.ndim() < 1 || expert_mesh.ndim() > 2) {
    throw MeshError("expert_mesh", "expert_options: 'expert_mesh' must be efsdp (1-D) or "
                                   "(replicate, efsdp); got " + expert_mesh.to_string());
  }
  const auto experts = experts_in(module);
  if (experts.empty()) {
    throw ArgumentError("module", "expert_options: 'module' holds no fsdp::moe::GroupedExperts");
  }
  const int64_t efsdp = expert_mesh.size(expert_mesh.ndim() - 1);
  std::unordered_set<const c10::TensorImpl*> expert_params;
  bool few = false;  // a rank owns fewer experts than efsdp has ranks
  for (const auto* e : experts) {
    for (const at::Tensor* p : {&e->w1, &e->w2, &e->w3}) expert_params.insert(p->unsafeGetTensorImpl());
    if (e->local_experts < efsdp) few = true;
  }
  // Shard(1) keeps every rank's share non-empty when dim 0 would leave some
  // ranks without an expert (torchtitan's rule).
  const Placement placement = few ? Placement::Shard(1) : Placement::Shard(0);
  base = options_for(module, std::move(base));
  ShardPlacementFn dense = base.shard_placement_fn;
  base.shard_placement_fn = [expert_params, placement, expert_mesh, data_parallel_size, dense](
                                const std::string& name,
                                const at::Tensor& param) -> std::optional<ShardPlacementResult> {
    if (expert_params.count(param.unsafeGetTensorImpl())) {
      return ShardPlacementResult(placement, expert_mesh, data_parallel_size);
    }
    return dense ? dense(name, param) : std::nullopt;
  };
  return base;
}

at::Tensor expert_grad_norms(const GroupedExpertsImpl& experts) {
  const int64_t E = experts.num_experts;
  const auto managed = detail::managed_grads();
  struct Bucket {
    std::vector<ProcessGroupPtr> groups;
    at::Tensor squares;  // [E] double
  };
  std::map<std::string, Bucket> buckets;  // same order on every rank
  for (const at::Tensor* p : {&experts.w1, &experts.w2, &experts.w3}) {
    std::optional<DeviceMesh> mesh = experts.ep;
    std::vector<Placement> placements;
    std::vector<ProcessGroupPtr> groups;
    if (auto it = managed.find(p->unsafeGetTensorImpl()); it != managed.end()) {
      mesh = it->second.mesh;
      placements = it->second.placements;
      groups = it->second.split_groups;
    } else if (mesh) {
      placements = {Placement::Shard(0)};
      if (mesh->size() > 1) groups.push_back(mesh->get_group(0));
    }
    // Which experts the local rows are: the placements that split dim 0,
    // applied to the expert ids (no communication).
    at::Tensor ids = at::arange(E, at::kDouble);
    if (mesh) {
      std::vector<Placement> rows;
      for (const Placement& q : placements) {
        const bool splits_rows = q.is_shard(0) || (q.is_strided_shard() && q.dim() == 0);
        rows.push_back(splits_rows ? q : Placement::Replicate());
      }
      ids = distribute_tensor(ids, *mesh, rows).to_local();
    }
    std::string key;
    for (const auto& g : groups) key += g->name() + ";";
    auto [pos, added] = buckets.emplace(key, Bucket{groups, {}});
    if (added) pos->second.squares = at::zeros({E}, at::kDouble);
    const at::Tensor g = p->grad();
    if (!g.defined() || g.numel() == 0) continue;
    const at::Tensor per_row = g.detach().to(at::kDouble).pow(2).reshape({g.size(0), -1}).sum(1).cpu();
    pos->second.squares.index_add_(0, ids.to(at::kLong), per_row);
  }
  at::Tensor total = at::zeros({E}, at::kDouble);
  for (auto& [key, b] : buckets) {
    for (const auto& group : b.groups) group->all_reduce(b.squares, ReduceOp::SUM);
    total += b.squares;
  }
  return total.sqrt();
}

}  // namespace fsdp::moe
