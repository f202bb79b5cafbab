// Shared pieces of the test_fully_shard_module feature files
// (test_fully_shard_module_{reshard,grad_sync,api}.cpp): the toy MLP's
// batches and single-card reference gradients, a chain of single-parameter
// blocks whose compute shows in the collective sequence (prefetch order),
// and the 2x2 HSDP mesh of L1-02.
#pragma once
#include "l1_util.h"
#include "spmd.h"
#include "toy_models.h"

#include <fsdp/comm.h>
#include <fsdp/dtensor.h>
#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>
#include <fsdp/optim_state.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

// Cases that count collectives or compare shards need a sharded world.
inline boost::unit_test::precondition multi_rank() {
  return spmd::needs_world_size_at_least(2, "collectives and shards");
}

namespace {

constexpr double kGradTol = 1e-5;     // fp32 grads / params vs single card
constexpr double kReplicaTol = 1e-6;  // L1-02: replicas equal after all-reduce
constexpr int64_t kRows = 8;          // global batch rows (divisible by 2 and 4)
constexpr int64_t kMlpParams = 6;     // fc1, fc2, fc3: weight + bias each
// All-gathers of one step with the default reshard_after_forward: fc1's and
// fc2's units gather in forward and again in backward, the root (fc3's two
// parameters) once.
constexpr int64_t kMlpGathersPerStep = 2 * kMlpParams - 2;
// Options with comm_fusion off: one collective per parameter on the CPU and
// on CUDA alike (left unset, units computing on CUDA fuse), for the cases
// whose counts are per parameter (kMlpParams, kMlpGathersPerStep, ...).
inline fsdp::FullyShardOptions per_param_options() {
  fsdp::FullyShardOptions o;
  o.comm_fusion = false;
  return o;
}

using ModulePtr = std::shared_ptr<torch::nn::Module>;

inline toy::Batch mine(const toy::Batch& global) {
  return toy::slice(global, spmd::rank(), spmd::world_size());
}

// Single-card gradient of one global batch on a fresh copy of the toy MLP.
inline std::shared_ptr<toy::MlpImpl> ref_grads(int64_t seed, const std::vector<toy::Batch>& batches) {
  toy::Mlp ref(seed);
  for (const auto& b : batches) l1::ref_backward(ref, b);
  return ref.ptr();
}

inline double grad_err(l1::ShardedMlp& m, const std::shared_ptr<toy::MlpImpl>& ref, double scale = 1.0,
                const std::string& only = "") {
  return l1::grad_err(m.module(), *ref, spmd::world_size(), spmd::rank(), scale, only);
}

inline std::string numel_mismatch(l1::ShardedMlp& m, const std::string& prefix, bool full) {
  std::string mis;
  l1::numel_state(m.module(), prefix, full, spmd::world_size(), spmd::rank(), &mis);
  return mis;
}

// ---- a chain of single-parameter blocks whose compute is visible in the
// collective sequence (for the prefetch-order cases) -----------------------

// A marker in the collective sequence: a broadcast over the world of id + 1
// floats, so its byte count (4 * (id + 1)) names the point.
inline void marker(int64_t id) {
  at::Tensor t = at::zeros({id + 1});
  fsdp::world_group()->broadcast(t, 0);
}
inline int64_t marker_bytes(int64_t id) { return 4 * (id + 1); }
constexpr int64_t kBackwardMarker = 100;  // backward markers: 100 + block id

// Identity; its backward issues the backward marker of a block, i.e. once
// the block's backward compute (the gradient of its input) is done.
struct MarkBackward : public torch::autograd::Function<MarkBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            int64_t id) {
    ctx->saved_data["id"] = id;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    marker(kBackwardMarker + ctx->saved_data["id"].toInt());
    return {grads[0], at::Tensor()};
  }
};

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t in, int64_t out, int64_t block_id) : id(block_id) {
    lin = register_module("lin", torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)));
  }
  at::Tensor forward(at::Tensor x) {
    if (markers && x.requires_grad()) x = MarkBackward::apply(x, id);
    at::Tensor y = lin(x);
    if (markers) marker(id);  // this block's forward compute is done
    return y;
  }
  torch::nn::Linear lin{nullptr};
  int64_t id;
  bool markers = false;
};
TORCH_MODULE(Block);

// b0 (12x8), b1 (10x12), b2 (6x10): distinct all-gather sizes at 2 and 4
// ranks, so each unit's all-gather is recognisable by its byte count.
struct ChainImpl : torch::nn::Module {
  explicit ChainImpl(int64_t seed) {
    at::manual_seed(seed);
    b0 = register_module("b0", Block(8, 12, 0));
    b1 = register_module("b1", Block(12, 10, 1));
    b2 = register_module("b2", Block(10, 6, 2));
    head = register_module("head", torch::nn::Linear(6, 3));
  }
  at::Tensor forward(at::Tensor x) {
    x = at::tanh(b0(x));
    x = at::tanh(b1(x));
    x = at::tanh(b2(x));
    return head(x);
  }
  void set_markers(bool on) { b0->markers = b1->markers = b2->markers = on; }
  fsdp::Sharded<Block> b0, b1, b2;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Chain);

constexpr int64_t kChainIn[3] = {8, 12, 10};
constexpr int64_t kChainOut[3] = {12, 10, 6};

// Bytes of block i's all-gather input on this rank (fp32, padded shard).
inline int64_t block_gather_bytes(int i) {
  return fsdp::shard_chunk(kChainOut[i], spmd::world_size()) * kChainIn[i] * 4;
}

struct ShardedChain {
  Chain model;
  fsdp::FSDPModule u[3];
  fsdp::FSDPModule root;
  fsdp::Sharded<Chain> net;
  explicit ShardedChain(int64_t seed, const fsdp::FullyShardOptions& options = {})
      : model(seed) {
    model->to(spmd::device());
    model->set_markers(true);
    u[0] = fsdp::fully_shard(model->b0, options);
    u[1] = fsdp::fully_shard(model->b1, options);
    u[2] = fsdp::fully_shard(model->b2, options);
    root = fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(model.ptr()), options);
    net = fsdp::Sharded<Chain>(model);
  }
  at::Tensor loss(const toy::Batch& b) {
    const auto dev = spmd::device();
    return toy::mse(net(b.x.to(dev)), b.y.to(dev));
  }
};

inline toy::Batch chain_batch(int64_t seed) { return toy::global_batch(seed, kRows, 8, 3); }

inline double chain_grad_err(ShardedChain& c, int64_t seed, const toy::Batch& global) {
  Chain ref(seed);
  at::Tensor loss = toy::mse(ref(global.x), global.y);
  loss.backward();
  return l1::grad_err(*c.model, *ref, spmd::world_size(), spmd::rank());
}

}  // namespace

namespace {

struct Hsdp {
  fsdp::DeviceMesh mesh;
  int shard_index, replica_index;
  std::string replicate_group, shard_group;
};

inline Hsdp make_hsdp() {
  auto mesh = fsdp::init_device_mesh(spmd::device().type(), {2, 2}, {"replicate", "shard"});
  return {mesh, mesh.get_local_rank("shard"), mesh.get_local_rank("replicate"),
          mesh.get_group("replicate")->name(), mesh.get_group("shard")->name()};
}

// Per parameter (names starting with `only`): max |grad on replica 0 - grad
// on replica 1| of this rank's shard (an all-gather over the replicate
// group). Returns {min over params, max over params}.
inline std::pair<double, double> replica_gap(l1::ShardedMlp& m, const Hsdp& h, const std::string& only) {
  auto group = h.mesh.get_group("replicate");
  double lo = l1::kInf, hi = 0;
  for (const auto& item : m.model->named_parameters()) {
    if (item.key().rfind(only, 0) != 0) continue;
    const at::Tensor& p = item.value();
    at::Tensor g = p.grad().defined()
                       ? p.grad().detach().contiguous().view({-1})
                       : at::full({p.numel()}, std::numeric_limits<double>::quiet_NaN(),
                                  p.options());
    at::Tensor out = at::empty({2 * g.numel()}, g.options());
    group->all_gather_into_tensor(out, g);
    const double gap = testkit::max_abs_diff_or_inf(out.narrow(0, 0, g.numel()),
                                                    out.narrow(0, g.numel(), g.numel()));
    const double gap_or_nan = std::isnan(gap) ? l1::kInf : gap;
    lo = std::min(lo, std::isnan(gap) ? -1.0 : gap_or_nan);
    hi = std::max(hi, gap_or_nan);
  }
  return {lo, hi};
}

inline double hsdp_grad_err(l1::ShardedMlp& m, const Hsdp& h, const std::shared_ptr<toy::MlpImpl>& ref,
                     const std::string& only = "") {
  return l1::grad_err(m.module(), *ref, 2, h.shard_index, 1.0, only);
}

// This rank's batch: rank r (replica r/2) takes rows [2r, 2r+2) of 8.
inline toy::Batch hsdp_mine(const toy::Batch& global) { return toy::slice(global, spmd::rank(), 4); }
// A replica's share of the global batch: the rows of its two ranks.
inline toy::Batch replica_rows(const toy::Batch& global, int replica) {
  return toy::slice(global, replica, 2);
}

}  // namespace
