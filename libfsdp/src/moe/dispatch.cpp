// Token dispatch and combine over ep: a fixed-size count exchange, then the
// differentiable variable-split all-to-all, and the permutation between the
// senders' rank-major order and the experts' expert-major order.
#include "fsdp/moe.h"

#include "fsdp/errors.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>

#include <string>
#include <utility>

namespace fsdp::moe {
namespace {

// ctx->saved_data holds IValues only: a capsule carries the group.
struct AllToAllState : torch::CustomClassHolder {
  AllToAllState(ProcessGroupPtr g, std::vector<int64_t> o, std::vector<int64_t> i)
      : group(std::move(g)), out_splits(std::move(o)), in_splits(std::move(i)) {}
  ProcessGroupPtr group;
  std::vector<int64_t> out_splits, in_splits;
};

int64_t total(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

at::Tensor exchange(const at::Tensor& x, const std::vector<int64_t>& out_splits,
                    const std::vector<int64_t>& in_splits, const ProcessGroupPtr& group) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = total(out_splits);
  at::Tensor out = at::empty(shape, x.options());
  group->all_to_all_single(out, x.contiguous(), out_splits, in_splits);
  return out;
}

struct AllToAll : torch::autograd::Function<AllToAll> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const c10::intrusive_ptr<AllToAllState>& state) {
    ctx->saved_data["state"] = at::IValue::make_capsule(state);
    return exchange(x, state->out_splits, state->in_splits, state->group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto state =
        c10::static_intrusive_pointer_cast<AllToAllState>(ctx->saved_data["state"].toCapsule());
    // Swapped: what came from rank j goes back to rank j.
    return {exchange(grads[0], state->in_splits, state->out_splits, state->group), at::Tensor()};
  }
};

void check_ep(const char* fn, const DeviceMesh& ep) {
  if (ep.ndim() != 1) {
    throw MeshError("ep", std::string(fn) + ": 'ep' must be a 1-D mesh; got " + ep.to_string());
  }
}

at::Tensor index_tensor(const std::vector<int64_t>& v, const at::Device& device) {
  return at::tensor(v, at::TensorOptions().dtype(at::kLong)).to(device);
}

}  // namespace

at::Tensor all_to_all(const at::Tensor& x, const std::vector<int64_t>& out_splits,
                      const std::vector<int64_t>& in_splits, const DeviceMesh& ep) {
  check_ep("all_to_all", ep);
  return AllToAll::apply(x, c10::make_intrusive<AllToAllState>(ep.get_group(0), out_splits,
                                                               in_splits));
}

TokenDispatcher::TokenDispatcher(int64_t num_experts, std::optional<DeviceMesh> ep)
    : num_experts_(num_experts), ep_(std::move(ep)) {
  if (ep_) check_ep("TokenDispatcher", *ep_);
  if (num_experts_ < 1 || num_experts_ % ep_size() != 0) {
    throw ArgumentError("num_experts", "TokenDispatcher: 'num_experts' = " +
                                           std::to_string(num_experts_) +
                                           "; accepted: >= 1 and divisible by the ep size " +
                                           std::to_string(ep_size()));
  }
}

int64_t TokenDispatcher::ep_size() const { return ep_ ? ep_->size() : 1; }
int64_t TokenDispatcher::ep_rank() const { return ep_ ? ep_->get_rank() : 0; }

std::pair<at::Tensor, DispatchPlan> TokenDispatcher::dispatch(const at::Tensor& x,
                                                              const at::Tensor& ids) const {
  if (x.dim() != 2) {
    throw ShapeError("x", "TokenDispatcher::dispatch: 'x' has shape " +
                              std::string(c10::str(x.sizes())) + "; expected [tokens, dim]");
  }
  if (ids.dim() != 2 || ids.size(0) != x.size(0) || ids.scalar_type() != at::kLong) {
    throw ShapeError("ids", "TokenDispatcher::dispatch: 'ids' must be int64 [" +
                                std::to_string(x.size(0)) + ", top_k]; got " +
                                std::string(c10::toString(ids.scalar_type())) + " " +
                                std::string(c10::str(ids.sizes())));
  }
  const auto [lo, hi] = ids.numel() > 0 ? at::aminmax(ids) : std::tuple<at::Tensor, at::Tensor>{};
  if (ids.numel() > 0 && (lo.item<int64_t>() < 0 || hi.item<int64_t>() >= num_experts_)) {
    throw ArgumentError("ids", "TokenDispatcher::dispatch: 'ids' holds an expert id outside [0, " +
                                   std::to_string(num_experts_) + ")");
  }
  DispatchPlan plan;
  plan.tokens = x.size(0);
  plan.top_k = ids.size(1);
  const at::Tensor flat = ids.reshape({-1});
  plan.sort_idx = std::get<1>(at::sort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  plan.token_idx = at::div(plan.sort_idx, plan.top_k, "floor");
  at::Tensor rows = x.index_select(0, plan.token_idx);
  const at::Tensor counts = at::bincount(flat, {}, num_experts_).cpu();

  const int64_t ep = ep_size(), el = local_experts();
  if (ep == 1) {
    plan.in_splits = plan.out_splits = {rows.size(0)};
    plan.received = counts.view({1, el});
    plan.local_counts.assign(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + el);
    return {rows, std::move(plan)};
  }
  // Fixed size, whatever the routing: el counts to every ep rank.
  const at::Tensor sent = counts.view({ep, el}).to(x.device()).contiguous();
  at::Tensor recv = at::empty_like(sent);
  ep_->get_group(0)->all_to_all_single(recv, sent);
  plan.received = recv.cpu();
  const auto s = counts.view({ep, el}).sum(1);
  const auto r = plan.received.sum(1);
  plan.in_splits.assign(s.data_ptr<int64_t>(), s.data_ptr<int64_t>() + ep);
  plan.out_splits.assign(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + ep);
  at::Tensor got = all_to_all(rows, plan.out_splits, plan.in_splits, *ep_);

  // Received rows are rank-major (all of rank 0's, expert by expert, then
  // rank 1's, ...); the experts want expert-major blocks.
  const auto m = plan.received.accessor<int64_t, 2>();
  std::vector<int64_t> start(static_cast<size_t>(ep * el));
  int64_t offset = 0;
  for (int64_t i = 0; i < ep; ++i) {
    for (int64_t j = 0; j < el; ++j) {
      start[static_cast<size_t>(i * el + j)] = offset;
      offset += m[i][j];
    }
  }
  std::vector<int64_t> perm;
  perm.reserve(static_cast<size_t>(offset));
  plan.local_counts.assign(static_cast<size_t>(el), 0);
  for (int64_t j = 0; j < el; ++j) {
    for (int64_t i = 0; i < ep; ++i) {
      const int64_t b = start[static_cast<size_t>(i * el + j)];
      for (int64_t k = 0; k < m[i][j]; ++k) perm.push_back(b + k);
      plan.local_counts[static_cast<size_t>(j)] += m[i][j];
    }
  }
  // The inverse is built here, on the host, so combine needs no copy back.
  std::vector<int64_t> inverse(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inverse[static_cast<size_t>(perm[i])] = static_cast<int64_t>(i);
  plan.permute_idx = index_tensor(perm, x.device());
  plan.unpermute_idx = index_tensor(inverse, x.device());
  return {got.index_select(0, plan.permute_idx), std::move(plan)};
}

at::Tensor TokenDispatcher::combine(const at::Tensor& y, const at::Tensor& weights,
                                    const DispatchPlan& plan) const {
  const int64_t n = plan.tokens * plan.top_k;
  if (weights.dim() != 2 || weights.size(0) != plan.tokens || weights.size(1) != plan.top_k) {
    throw ShapeError("weights", "TokenDispatcher::combine: 'weights' must be [" +
                                    std::to_string(plan.tokens) + ", " +
                                    std::to_string(plan.top_k) + "]; got " +
                                    std::string(c10::str(weights.sizes())));
  }
  at::Tensor sorted = y;
  if (ep_size() > 1) {
    // Undo the expert-major permutation, then send each row back.
    sorted = all_to_all(y.index_select(0, plan.unpermute_idx), plan.in_splits, plan.out_splits,
                        *ep_);
  }
  if (sorted.dim() != 2 || sorted.size(0) != n) {
    throw ShapeError("y", "TokenDispatcher::combine: 'y' does not hold the rows dispatch() "
                          "returned (" + std::string(c10::str(y.sizes())) + ")");
  }
  const at::Tensor w = weights.to(at::kFloat).reshape({-1}).index_select(0, plan.sort_idx);
  const at::Tensor contrib = sorted.to(at::kFloat) * w.unsqueeze(1);
  // index_add walks the sorted rows in order: each token's k terms are
  // summed in increasing expert id (deterministic on the CPU).
  at::Tensor out = at::zeros({plan.tokens, sorted.size(1)}, contrib.options());
  return out.index_add(0, plan.token_idx, contrib).to(y.scalar_type());
}

}  // namespace fsdp::moe
