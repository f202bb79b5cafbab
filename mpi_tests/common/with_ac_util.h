// Shared pieces of the test_fully_shard_with_ac feature files
// (test_fully_shard_with_ac_{parity,api}.cpp): a stack of transformer MLP
// blocks that count their forward calls and record the devices they run on,
// its sharded form and single-card reference, the per-step comparison
// (loss, global and per-layer grad norms, first / last / all gradients) and
// its report.
#pragma once
#include "precision_util.h"
#include "spmd.h"
#include "toy_models.h"

#include <fsdp/activation_checkpoint.h>
#include <fsdp/checkpoint.h>  // the deprecated 0.1.0 names, tested last
#include <fsdp/clip_grad.h>
#include <fsdp/comm.h>
#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/api/include/torch/version.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/sgd.h>
#ifdef FSDP_WITH_NCCL  // a CUDA LibTorch
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <thread>

namespace {

using prec::report;
using testkit::max_abs_diff;

constexpr double kTol = 1e-5;  // plan: AC + FSDP fp32, loss / grad norm / grads

// Set by the tests around backward(), read by the probes.
bool g_in_backward = false;

// x + W2 gelu(W1 LN(x)): a transformer MLP sub-block. Counts its forward
// calls in forward and in backward (recompute), and records the devices its
// input and weights are on when it runs inside backward.
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t h) {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc1 = register_module("fc1", torch::nn::Linear(d, h));
    fc2 = register_module("fc2", torch::nn::Linear(h, d));
  }
  at::Tensor forward(at::Tensor x) {
    if (g_in_backward) {
      ++bwd_calls;
      bwd_devices.push_back(x.device());
      bwd_devices.push_back(fc1->weight.device());
    } else {
      ++fwd_calls;
    }
    return x + fc2(at::gelu(fc1(ln(x))));
  }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  int64_t fwd_calls = 0, bwd_calls = 0;
  std::vector<c10::Device> bwd_devices;
};
TORCH_MODULE(Block);

struct NetConfig {
  int64_t in = 16, d = 32, out = 8;
  std::vector<int64_t> hidden = {64, 64, 64, 64};
};

// inp -> blocks -> head: six layers. The blocks are declared checkpointed and
// sharded: whether each is checkpointed is decided by its mark, whether it is
// sharded by fully_shard -- the forward never calls either by hand.
struct NetImpl : torch::nn::Module {
  NetImpl(int64_t seed, const NetConfig& c) {
    at::manual_seed(seed);
    inp = register_module("inp", torch::nn::Linear(c.in, c.d));
    for (size_t i = 0; i < c.hidden.size(); ++i) {
      blocks.push_back(register_module("block" + std::to_string(i),
                                       std::make_shared<BlockImpl>(c.d, c.hidden[i])));
    }
    head = register_module("head", torch::nn::Linear(c.d, c.out));
  }
  at::Tensor forward(at::Tensor x) {
    x = inp(x);
    for (auto& b : blocks) x = b(x);
    return head(x);
  }
  torch::nn::Linear inp{nullptr}, head{nullptr};
  std::vector<fsdp::ActivationCheckpointed<fsdp::Sharded<Block>>> blocks;
};
TORCH_MODULE(Net);

inline BlockImpl& block(Net& net, size_t i) { return *net->blocks[i].ptr(); }

// The sharded model: every block a unit, the root (inp, head) last.
struct FsdpNet {
  Net net{nullptr};
  std::vector<fsdp::FSDPModule> blocks;
  fsdp::FSDPModule root;
  fsdp::Sharded<Net> model;
};

inline FsdpNet make_fsdp(int64_t seed, const NetConfig& c, const fsdp::FullyShardOptions& opts = {}) {
  FsdpNet s;
  s.net = Net(seed, c);
  s.net->to(spmd::device());
  for (auto& b : s.net->blocks) s.blocks.push_back(fsdp::fully_shard(b, opts));
  s.root = fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(s.net.ptr()), opts);
  s.model = fsdp::Sharded<Net>(s.net);
  return s;
}

inline Net make_ref(int64_t seed, const NetConfig& c) {
  Net ref(seed, c);
  ref->to(spmd::device());
  return ref;
}


// Worst errors of one comparison, each already the max over ranks.
struct Worst {
  double loss = 0, global_norm = 0, layer_norm = 0, first = 0, last = 0, all = 0;
  void merge(const Worst& o) {
    loss = std::max(loss, o.loss);
    global_norm = std::max(global_norm, o.global_norm);
    layer_norm = std::max(layer_norm, o.layer_norm);
    first = std::max(first, o.first);
    last = std::max(last, o.last);
    all = std::max(all, o.all);
  }
};

inline std::string layer_of(const std::string& name) { return name.substr(0, name.find('.')); }

// Compares the sharded model's gradients (after its backward) with the
// single card's: loss, the global gradient norm (fsdp::total_grad_norm, what
// clipping sees), every layer's gradient norm (global over the shards),
// the first (inp) and last (head) layers' gradients and every gradient
// elementwise on this rank's rows. Collective: same order on every rank.
inline Worst compare(Net& mine, Net& ref, double local_loss, double ref_loss) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  Worst w;
  std::map<std::string, at::Tensor> ref_params;
  for (const auto& item : ref->named_parameters()) ref_params[item.key()] = item.value();
  std::map<std::string, double> sq, ref_sq;
  bool all_defined = true;
  for (const auto& item : mine->named_parameters()) {
    const at::Tensor& p = item.value();
    const at::Tensor ref_grad = ref_params.at(item.key()).grad();
    const at::Tensor g = p.grad().defined() ? p.grad() : at::zeros_like(p);
    all_defined = all_defined && p.grad().defined() && ref_grad.defined();
    const double d = max_abs_diff(g, toy::shard_rows(ref_grad, ws, rank));
    const std::string layer = layer_of(item.key());
    sq[layer] += prec::sq_norm(g);
    ref_sq[layer] += prec::sq_norm(ref_grad);
    w.all = std::max(w.all, d);
    if (layer == "inp") w.first = std::max(w.first, d);
    if (layer == "head") w.last = std::max(w.last, d);
  }
  BOOST_TEST(all_defined);
  double ref_total = 0;
  for (const auto& [layer, s] : ref_sq) ref_total += s;
  w.global_norm = std::abs(fsdp::total_grad_norm(mine->parameters()) - std::sqrt(ref_total));
  for (const auto& [layer, s] : sq) {
    const double norm = std::sqrt(raw_mpi::sum_over_ranks(s));
    w.layer_norm = std::max(w.layer_norm, std::abs(norm - std::sqrt(ref_sq[layer])));
  }
  w.loss = std::abs(prec::mean_over_ranks(local_loss) - ref_loss);
  w.loss = prec::max_over_ranks(w.loss);
  w.global_norm = prec::max_over_ranks(w.global_norm);
  w.layer_norm = prec::max_over_ranks(w.layer_norm);
  w.first = prec::max_over_ranks(w.first);
  w.last = prec::max_over_ranks(w.last);
  w.all = prec::max_over_ranks(w.all);
  return w;
}

inline void check_and_report(const std::string& id, const Worst& w) {
  report(id, "loss vs single card", w.loss, kTol);
  report(id, "global grad norm vs single card", w.global_norm, kTol);
  report(id, "per-layer grad norm vs single card", w.layer_norm, kTol);
  report(id, "first layer (inp) grads vs single card", w.first, kTol);
  report(id, "last layer (head) grads vs single card", w.last, kTol);
  report(id, "every grad vs single card", w.all, kTol);
  BOOST_TEST(w.loss <= kTol);
  BOOST_TEST(w.global_norm <= kTol);
  BOOST_TEST(w.layer_norm <= kTol);
  BOOST_TEST(w.first <= kTol);
  BOOST_TEST(w.last <= kTol);
  BOOST_TEST(w.all <= kTol);
}

inline double backward(const at::Tensor& loss) {
  g_in_backward = true;
  loss.backward();
  g_in_backward = false;
  return loss.item<double>();
}

// `steps` SGD steps of the sharded model (this rank's slice) and of the
// single card (the global batch), comparing each step's gradients. `between`
// runs after each sharded backward, before the comparison.
inline Worst run_parity(FsdpNet& s, Net& ref, int64_t rows, int steps, int64_t data_seed,
                 const std::function<void(int)>& between = {}) {
  const NetConfig c;
  torch::optim::SGD opt(s.net->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  Worst worst;
  for (int step = 0; step < steps; ++step) {
    const auto batch = prec::to_device(toy::global_batch(data_seed + step, rows, c.in, c.out));
    const auto mine = toy::slice(batch, spmd::rank(), spmd::world_size());
    opt.zero_grad();
    ref_opt.zero_grad();
    const double loss = backward(toy::mse(s.model(mine.x), mine.y));
    if (between) between(step);
    const double ref_loss = backward(toy::mse(ref(batch.x), batch.y));
    worst.merge(compare(s.net, ref, loss, ref_loss));
    opt.step();
    ref_opt.step();
  }
  return worst;
}

inline void mark_all_blocks(Net& net, fsdp::ActivationCheckpointOptions options) {
  for (auto& b : net->blocks) fsdp::activation_checkpoint_module(b, options);
}

}  // namespace
