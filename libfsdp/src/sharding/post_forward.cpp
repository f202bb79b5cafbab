// hpZ: ReshardAfterForward's integer forms. After forward a unit keeps its
// parameters sharded over P consecutive ranks of each shard group (one
// node's, typically), so the backward all-gather stays among them
// (ParamGroup::reshard_after_forward keeps the pieces, issue_unshard gathers
// them). Consecutive, because ranks of one node are consecutive under
// mpirun's and srun's default block mapping, and a mesh's shard dim is its
// innermost.
#include "sharding/post_forward.h"

#include "comm/group_registry.h"
#include "fsdp/errors.h"

#include <ATen/ops/tensor.h>

#include <string>

namespace fsdp {

std::string to_string(ReshardAfterForward r) {
  if (r.is_within_node()) return "within node (hpZ)";
  if (r.ranks()) return std::to_string(*r.ranks()) + " ranks (hpZ)";
  if (!r.value()) return "unset";
  return *r.value() ? "true" : "false";
}

}  // namespace fsdp

namespace fsdp::detail {
namespace {

std::string prefix(const std::string& fn) { return fn + ": 'reshard_after_forward' = "; }

// The shard group's ranks on this node, when they form one aligned block of
// the same size on every node; else 0. Collective over the group.
int node_block(const ProcessGroupPtr& group) {
  const std::vector<int> mine = members_on_this_node(group);
  const int n = static_cast<int>(mine.size());
  bool ok = mine.front() % n == 0 && mine.back() - mine.front() + 1 == n;
  // Every member must reach the same verdict: the largest and smallest
  // block and any misfit, in one MAX all-reduce.
  at::Tensor v = at::tensor({static_cast<int64_t>(n), static_cast<int64_t>(-n),
                             static_cast<int64_t>(ok ? 0 : 1)},
                            at::kLong);
  group->all_reduce(v, ReduceOp::MAX)->wait();
  const auto* r = v.data_ptr<int64_t>();
  if (r[2] != 0 || r[0] != -r[1]) return 0;
  return n;
}

}  // namespace

std::vector<int> resolve_post_forward_ranks(const std::vector<ProcessGroupPtr>& shard_groups,
                                            ReshardAfterForward v, bool offloads,
                                            const std::string& fn) {
  std::vector<int> out(shard_groups.size(), 0);
  if (!v.ranks() && !v.is_within_node()) return out;
  const std::string given = v.is_within_node() ? "within_node()" : std::to_string(*v.ranks());
  if (offloads) {
    throw ArgumentError("reshard_after_forward",
                        prefix(fn) + given +
                            " with an offload_policy: the kept pieces would live on the "
                            "device the offload frees; accepted with offload: true, false or unset");
  }
  for (size_t g = 0; g < shard_groups.size(); ++g) {
    const int ws = shard_groups[g]->size();
    int p = 0;
    if (v.is_within_node()) {
      p = node_block(shard_groups[g]);
      if (p == 0) {
        throw ArgumentError("reshard_after_forward",
                            prefix(fn) + given + ": the ranks of shard group " +
                                shard_groups[g]->name() +
                                " are not consecutive blocks of the same size on every node; "
                                "accepted: a mesh whose shard dim holds each node's ranks "
                                "consecutively (docs/multinode.md), or an explicit count");
      }
    } else {
      p = *v.ranks();
      if (p < 1 || p > ws || ws % p != 0) {
        throw ArgumentError("reshard_after_forward",
                            prefix(fn) + given + " for shard group " + shard_groups[g]->name() +
                                " of " + std::to_string(ws) +
                                " ranks; accepted: true, false, or a count that divides the "
                                "shard group's size (1 = false, " +
                                std::to_string(ws) + " = true)");
      }
    }
    out[g] = p == ws ? 0 : p;
  }
  return out;
}

std::vector<PostForwardTarget> post_forward_targets(
    const std::vector<ProcessGroupPtr>& shard_groups, const std::vector<int>& ranks) {
  std::vector<PostForwardTarget> targets(shard_groups.size());
  for (size_t g = 0; g < shard_groups.size(); ++g) {
    const int p = ranks[g];
    if (p == 1) {
      targets[g].keep_full = true;
    } else if (p > 1) {
      targets[g].group = subgroup_for(shard_groups[g], p);
    }
  }
  return targets;
}

}  // namespace fsdp::detail
