// Tensor parallelism (Megatron-style) as explicit module types and the
// autograd pairs they are built from. C++ modules have no forward hooks, so
// nothing here rewrites a plain torch::nn::Linear: a model opts in by using
// these layers.
//
// Every function and layer takes `tp`, a 1-D DeviceMesh (MeshError naming
// "tp" otherwise), and is collective over it: every member makes the same
// call with tensors of the same shape. A tp mesh of size 1 communicates
// nothing and each layer computes exactly what the plain layer computes.
//
// Nodes: a `tp` whose group spans nodes (Runtime::num_nodes) is a MeshError
// naming "tp" (the message names the dim): TP's per-layer collectives belong
// inside a node (fsdp::init_node_mesh lays tp out there). Set
// FSDP_TP_ACROSS_NODES=1 on every rank to allow it anyway; it is read at
// each check (layer construction and every autograd pair's call).
//
// Layouts are even: a dim split over tp must divide by tp.size() (ShapeError
// naming the argument and the size), as torchtitan's seq_len_divisor.
//
// Composition with fully_shard: every layer is an fsdp::ParallelModule that
// lists its parameters as DistributedParams (the local tensor, its placement
// on `tp`, and where the gradient is a partial sum over tp).
// fsdp::dtensor_params(module) collects them for a module about to be
// sharded (fsdp::options_for(module, options) appends them to the options).
// FSDP then shards the TP-local tensors, all-reduces the partial gradients
// over tp before its own reduction, and sharded_parameters(), state dicts
// and clip_grad see the global tensors.
#pragma once

#include "fsdp/dtensor.h"
#include "fsdp/mesh.h"
#include "fsdp/options.h"
#include "fsdp/parallel_module.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/Reduction.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <vector>

namespace fsdp::tp {

// ---- autograd pairs ------------------------------------------------------
// Forward and backward collectives, by Megatron's names:
//   copy_to_tp         identity        | all-reduce          ("f")
//   reduce_from_tp     all-reduce      | identity            ("g")
//   gather_from_tp     all-gather(dim) | split(dim)
//   split_to_tp        split(dim)      | all-gather(dim)
//   sp_all_gather      all-gather(dim) | reduce-scatter(dim) (sequence parallel)
//   sp_reduce_scatter  reduce-scatter  | all-gather(dim)     (sequence parallel)
// "split" keeps this rank's contiguous 1/tp of `dim` (no communication).
// Sums run in the tensor's dtype. dim may be negative.
at::Tensor copy_to_tp(const at::Tensor& x, const DeviceMesh& tp);
at::Tensor reduce_from_tp(const at::Tensor& x, const DeviceMesh& tp);
at::Tensor gather_from_tp(const at::Tensor& x, int64_t dim, const DeviceMesh& tp);
at::Tensor split_to_tp(const at::Tensor& x, int64_t dim, const DeviceMesh& tp);
at::Tensor sp_all_gather(const at::Tensor& x, int64_t dim, const DeviceMesh& tp);
at::Tensor sp_reduce_scatter(const at::Tensor& x, int64_t dim, const DeviceMesh& tp);

// n / tp.size(); ShapeError naming `arg` (e.g. "heads", "num_embeddings")
// when n does not divide.
int64_t local_size(const char* arg, int64_t n, const DeviceMesh& tp);

// A parameter replicated over tp; with partial_grad its gradient is a
// partial sum over tp (a norm weight in a sequence-parallel region, a bias
// added after a reduce-scatter).
DistributedParam replicated_param(const at::Tensor& param, const DeviceMesh& tp,
                                  bool partial_grad);

// ---- layers --------------------------------------------------------------
// Parameters are initialised as the plain layer initialises the full tensor
// (torch::nn::Linear / Embedding, from the global generator, identically on
// every rank), then sliced: the same seed gives the same global model for
// every tp size. load_full() overwrites them from full tensors.

struct ColumnParallelOptions {
  bool bias = true;
  // Input: replicated over tp (false), or sharded on sequence_dim (true:
  // all-gathered in forward, reduce-scattered in backward).
  bool sequence_parallel = false;
  int64_t sequence_dim = 1;
  // Output: this rank's out_features / tp columns (false), or all-gathered.
  bool gather_output = false;
  // The weight's rows are `fused_pieces` equal blocks (3 for a fused
  // [q; k; v]), each split over tp on its own: the local weight is the
  // concatenation of every block's slice (placement StridedShard(0,
  // fused_pieces)), so q, k and v shard by heads, not by rows.
  int64_t fused_pieces = 1;
};

// y = x W^T + b with W [out, in] split by rows (Shard(0) on tp): local
// weight [out / tp, in], local bias [out / tp]. out_features must divide by
// fused_pieces * tp (ShapeError naming "out_features").
struct ColumnParallelLinearImpl : torch::nn::Module, ParallelModule {
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features, DeviceMesh tp,
                           ColumnParallelOptions options = {});
  at::Tensor forward(const at::Tensor& x);
  // Copies this rank's slice of full tensors of the plain layer's shapes
  // (ShapeError naming "weight" / "bias" otherwise).
  void load_full(const at::Tensor& weight, const at::Tensor& bias = {});
  std::vector<DistributedParam> distributed_params() const override;

  int64_t in_features, out_features;
  DeviceMesh tp;
  ColumnParallelOptions options;
  at::Tensor weight, bias;  // bias undefined without options.bias
};
TORCH_MODULE(ColumnParallelLinear);

struct RowParallelOptions {
  bool bias = true;
  // Input: sharded on its last dim as a column-parallel layer leaves it
  // (true), or replicated and split here (false).
  bool input_is_parallel = true;
  // Output: all-reduced over tp (false), or reduce-scattered on
  // sequence_dim (true; the bias's gradient is then a partial sum over tp).
  bool sequence_parallel = false;
  int64_t sequence_dim = 1;
};

// y = x W^T + b with W [out, in] split by columns (Shard(1) on tp): local
// weight [out, in / tp]; the bias [out] is replicated and added once, after
// the reduction. in_features must divide by tp (ShapeError naming
// "in_features").
struct RowParallelLinearImpl : torch::nn::Module, ParallelModule {
  RowParallelLinearImpl(int64_t in_features, int64_t out_features, DeviceMesh tp,
                        RowParallelOptions options = {});
  at::Tensor forward(const at::Tensor& x);
  void load_full(const at::Tensor& weight, const at::Tensor& bias = {});
  std::vector<DistributedParam> distributed_params() const override;

  int64_t in_features, out_features;
  DeviceMesh tp;
  RowParallelOptions options;
  at::Tensor weight, bias;
};
TORCH_MODULE(RowParallelLinear);

struct VocabParallelOptions {
  // Output: all-reduced over tp (false) or reduce-scattered on
  // sequence_dim (true).
  bool sequence_parallel = false;
  int64_t sequence_dim = 1;
};

// Embedding whose table [V, D] is split by rows (Shard(0) on tp): rank r
// holds ids [r V/tp, (r+1) V/tp). Ids outside the local range give zero
// rows, and the reduction over tp assembles every row. num_embeddings must
// divide by tp (ShapeError naming "num_embeddings"); ids must lie in
// [0, V) (ArgumentError naming "ids").
struct VocabParallelEmbeddingImpl : torch::nn::Module, ParallelModule {
  VocabParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim, DeviceMesh tp,
                             VocabParallelOptions options = {});
  at::Tensor forward(const at::Tensor& ids);
  void load_full(const at::Tensor& weight);
  std::vector<DistributedParam> distributed_params() const override;
  // First global id this rank holds.
  int64_t vocab_start() const;

  int64_t num_embeddings, embedding_dim;
  DeviceMesh tp;
  VocabParallelOptions options;
  at::Tensor weight;  // [V / tp, D]
};
TORCH_MODULE(VocabParallelEmbedding);

// Cross-entropy of logits split over tp on their last (class) dim, without
// gathering them: local_logits [..., V / tp] (rank r holds classes
// [r V/tp, (r+1) V/tp)), target [...] int64 with the same value on every tp
// rank. The row max, the sum of exponentials and the target logit are
// reduced over tp in fp32 (whatever the logits' dtype); the backward,
// (softmax - onehot) * grad, needs no communication. Mean divides by the
// number of targets != ignore_index (the global count on this tp group; NaN
// when there are none, as at::cross_entropy). Returns the same value on
// every tp rank, in the logits' dtype. Reduction: Mean, Sum or None (per
// target, ignored ones 0). ShapeError naming "target" if its shape is not
// the logits' without the last dim.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& target,
                                        const DeviceMesh& tp, int64_t ignore_index = -100,
                                        at::Reduction::Reduction reduction = at::Reduction::Mean);

}  // namespace fsdp::tp
