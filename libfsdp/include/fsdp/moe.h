// Mixture of experts and expert parallelism (namespace fsdp::moe): a top-k
// router, token dispatch over an ep group with a differentiable
// variable-split all-to-all, grouped SwiGLU experts, and what fully_shard
// needs to shard the experts on their own mesh.
//
// Data layout (torchtitan's dp2ep): every rank sees different data; dense
// weights are sharded by FSDP over the whole data-parallel domain
// (fsdp x ep, e.g. a flattened view of the world); experts are split over
// ep (rank r of ep owns experts [r E/ep, (r+1) E/ep)) and sharded by FSDP
// over efsdp, the data-parallel ranks that own the same experts. Expert
// gradients therefore already sum the tokens of every ep rank before FSDP
// reduces them: they must be averaged by the whole data-parallel size, not
// the efsdp size (expert_options does that).
//
// Collectives: every MoE forward issues the same ones on every rank of ep,
// in the same order, whatever the routing -- a fixed-size count exchange
// and two variable-split all-to-alls (and one all-reduce over the aux
// statistics mesh when the auxiliary loss is on); backward two all-to-alls.
// A rank with no tokens for an expert still runs it on zero rows, so every
// rank holds a gradient for every local expert and joins every reduction.
// Nothing is ever conditional on local token counts.
//
// Numerics: the gate and the scores run in fp32; the top-k breaks ties
// towards the lower expert id (a stable sort; LibTorch's topk does not
// promise an order); the combine multiplies by the scores in fp32 and sums
// each token's k contributions in increasing expert id. Dropless: every
// routed token is computed (no capacity factor).
#pragma once

#include "fsdp/mesh.h"
#include "fsdp/options.h"
#include "fsdp/parallel_module.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace fsdp::moe {

// ---- router ---------------------------------------------------------------
enum class ScoreFunc { Softmax, Sigmoid };

struct RouterOptions {
  ScoreFunc score_func = ScoreFunc::Softmax;
  // Divide the k chosen scores of a token by their sum (+1e-20).
  bool route_norm = false;
  // Multiplies the gate weights (after route_norm). Finite and > 0.
  double route_scale = 1.0;
  // Switch Transformer load-balancing loss coef * E * sum_e f_e P_e, with f_e
  // the fraction of routed (token, k) pairs that chose e and P_e the mean
  // score of e over tokens. 0: none (RouterOutput::aux_loss undefined).
  double aux_loss_coef = 0.0;
  // The data-parallel domain whose tokens the statistics f and P cover
  // (every rank that sees different data): summed over it with one
  // all-reduce, so the value equals the single-card aux loss of the global
  // batch. None: this rank's tokens alone.
  std::optional<DeviceMesh> aux_stats_mesh;
};

struct RouterOutput {
  at::Tensor weights;  // [T, K] fp32 gate weights of the chosen experts (differentiable)
  at::Tensor ids;      // [T, K] int64 chosen experts, by descending score; ties: lower id
  at::Tensor scores;   // [T, E] fp32 scores of every expert
  at::Tensor counts;   // [E] int64 (token, k) pairs this rank routed to each expert
  // min over tokens of (k-th - (k+1)-th score): distance from a tie (+inf
  // when K == E or there are no tokens).
  double margin = 0;
  // 0-dim fp32. Its value is the global aux loss (same on every rank of
  // aux_stats_mesh); its gradient is this rank's share, so that averaging
  // gradients over that mesh (FSDP's "avg") gives the global loss's
  // gradient. Undefined when aux_loss_coef is 0.
  at::Tensor aux_loss;
};

// Gate Linear(dim -> num_experts, no bias) computed in fp32. Errors:
// num_experts < 1, top_k outside [1, num_experts], dim < 1 -> ArgumentError
// naming it; route_scale not finite or <= 0, aux_loss_coef < 0 or NaN ->
// ArgumentError naming "options".
struct TopKRouterImpl : torch::nn::Module {
  TopKRouterImpl(int64_t dim, int64_t num_experts, int64_t top_k, RouterOptions options = {});
  // x [T, dim] -> routing. ShapeError naming "x" for another shape.
  RouterOutput forward(const at::Tensor& x);

  int64_t dim, num_experts, top_k;
  RouterOptions options;
  torch::nn::Linear gate{nullptr};  // weight [num_experts, dim]
};
TORCH_MODULE(TopKRouter);

// RouterOutput::margin of any scores [T, E]: tests assert it on the fixed
// data before comparing runs whose GEMM shapes differ (ArgumentError naming
// "top_k" unless 1 <= top_k <= E of a 2-D `scores`).
double routing_margin(const at::Tensor& scores, int64_t top_k);

// ---- dispatch and combine -------------------------------------------------
// Variable-split all-to-all over the 1-D mesh `ep` that autograd
// differentiates: rows [sum(in_splits), ...] of x are sent in_splits[j] to
// rank j; the result has sum(out_splits) rows, out_splits[j] from rank j.
// Its backward is the same exchange with the splits swapped. Collective over
// ep (forward and backward). Errors as ProcessGroup::all_to_all_single.
at::Tensor all_to_all(const at::Tensor& x, const std::vector<int64_t>& out_splits,
                      const std::vector<int64_t>& in_splits, const DeviceMesh& ep);

// How one forward's tokens travelled, for combine() (and tests).
struct DispatchPlan {
  int64_t tokens = 0;           // T
  int64_t top_k = 0;            // K
  at::Tensor sort_idx;          // [T K] flat (token, k) positions, stably sorted by expert
  at::Tensor token_idx;         // [T K] token of each sorted row (sort_idx / K)
  std::vector<int64_t> in_splits, out_splits;  // rows to / from each ep rank
  at::Tensor received;          // [ep, E_local] int64: rows from rank r for local expert j
  at::Tensor permute_idx;       // received rows (rank-major) in expert-major order
  at::Tensor unpermute_idx;     // its inverse: expert-major rows back to rank-major
  std::vector<int64_t> local_counts;  // rows per local expert (expert-major blocks)
};

// Routes tokens to the ranks that own their experts (ep: none or size 1 =
// every expert is local and nothing is communicated). num_experts must
// divide by ep's size (ArgumentError naming "num_experts").
class TokenDispatcher {
 public:
  TokenDispatcher(int64_t num_experts, std::optional<DeviceMesh> ep);
  // x [T, D], ids [T, K] -> the rows of this rank's experts, expert-major
  // (local_counts[j] rows for local expert j), and the plan.
  std::pair<at::Tensor, DispatchPlan> dispatch(const at::Tensor& x, const at::Tensor& ids) const;
  // The experts' output rows (as dispatch returned them) back to their
  // tokens: [T, D] = sum_k weights[t, k] * y(t, k), multiplied in fp32,
  // summed in increasing expert id, returned in y's dtype.
  at::Tensor combine(const at::Tensor& y, const at::Tensor& weights,
                     const DispatchPlan& plan) const;

  int64_t num_experts() const { return num_experts_; }
  int64_t ep_size() const;
  int64_t ep_rank() const;
  int64_t local_experts() const { return num_experts_ / ep_size(); }
  const std::optional<DeviceMesh>& ep() const { return ep_; }

 private:
  int64_t num_experts_;
  std::optional<DeviceMesh> ep_;
};

// ---- experts --------------------------------------------------------------
// This rank's experts, each SwiGLU: y = (silu(x w1^T) * (x w3^T)) w2^T, with
// w1, w3 [E_local, ffn, dim] and w2 [E_local, dim, ffn]; E_local =
// num_experts / ep. Initialised as E Linear layers would be (uniform
// +-1/sqrt(fan_in)) over the full [E, ...] tensors from the global
// generator, identically on every rank, then sliced: the same seed gives
// the same global experts for every ep size. Every local expert runs, also
// on zero rows. Computes in the weights' dtype (no hidden downcast).
struct GroupedExpertsImpl : torch::nn::Module, ParallelModule {
  GroupedExpertsImpl(int64_t dim, int64_t ffn, int64_t num_experts,
                     std::optional<DeviceMesh> ep = std::nullopt);
  // x [rows, dim], expert-major with counts[j] rows for local expert j
  // (ShapeError naming "counts" when they do not sum to rows or their
  // number is not E_local).
  at::Tensor forward(const at::Tensor& x, const std::vector<int64_t>& counts);
  // Copies this rank's experts out of full [E, ...] tensors.
  void load_full(const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& w3);
  // w1, w2, w3 as Shard(0) on ep (none when there is no ep mesh).
  std::vector<DistributedParam> distributed_params() const override;

  int64_t dim, ffn, num_experts, local_experts, first_expert;
  std::optional<DeviceMesh> ep;
  at::Tensor w1, w2, w3;
};
TORCH_MODULE(GroupedExperts);

// Per-expert gradient norms (2-norm over w1, w2 and w3 of each expert),
// [num_experts] double on the CPU, the same on every rank. Each expert's
// squares are summed over the shards that hold it (FSDP's shard group and
// ep), counted once; replicas (HSDP's replicate dim) are not added. Works
// sharded or not; call it after the synchronised backward. Collective over
// the groups involved (every rank calls it in the same order). Experts
// without a gradient count 0.
at::Tensor expert_grad_norms(const GroupedExpertsImpl& experts);

// ---- the layer ------------------------------------------------------------
// Router -> dispatch -> grouped experts -> combine, on [..., dim] inputs
// (flattened to tokens). The routing state lives in the module (one per
// layer), so layers never share it.
struct MoEImpl : torch::nn::Module {
  MoEImpl(int64_t dim, int64_t ffn, int64_t num_experts, int64_t top_k,
          std::optional<DeviceMesh> ep = std::nullopt, RouterOptions router_options = {});
  at::Tensor forward(const at::Tensor& x);

  // Of the last forward: the chosen experts [T, K] int64, routed (token, k)
  // pairs per global expert on this rank [E] int64, the routing margin, and
  // the aux loss (undefined without aux_loss_coef; add it to the loss).
  const at::Tensor& last_ids() const { return last_ids_; }
  const at::Tensor& last_counts() const { return last_counts_; }
  double last_margin() const { return last_margin_; }
  const at::Tensor& aux_loss() const { return aux_loss_; }

  TopKRouter router{nullptr};
  GroupedExperts experts{nullptr};
  TokenDispatcher dispatcher;

 private:
  at::Tensor last_ids_, last_counts_, aux_loss_;
  double last_margin_ = 0;
};
TORCH_MODULE(MoE);

// ---- fully_shard ----------------------------------------------------------
// The options to fully_shard a module that holds GroupedExperts (an MoE
// block) with: `base` (its dense mesh, e.g. fsdp x ep flattened) plus the
// experts' ep layout (dtensor_params) and a shard_placement_fn that puts
// every expert parameter on `expert_mesh` -- efsdp (1-D) or (replicate,
// efsdp) -- as Shard(0), or Shard(1) when a rank owns fewer experts than
// efsdp has ranks, with gradient divide factor `data_parallel_size` (the
// whole data-parallel world: replicate x efsdp x ep). The block becomes one
// unit with two parameter groups, each with its own all-gather and
// reduce-scatter. base.shard_placement_fn still decides the dense
// parameters. ArgumentError naming "data_parallel_size" (not finite, <= 0)
// or "module" (no GroupedExperts with an ep mesh inside).
FullyShardOptions expert_options(const torch::nn::Module& module, FullyShardOptions base,
                                 const DeviceMesh& expert_mesh, double data_parallel_size);

}  // namespace fsdp::moe
