// Shared pieces of the test_fully_shard_lifecycle feature files
// (test_fully_shard_lifecycle_{exceptions,unused_params,independent_roots}.cpp):
// lifecycle semantics of fully_shard that a training loop relies on, checked
// through the public API against plain single-card LibTorch.
//
// The single-card baselines use the same module classes instantiated without
// any fsdp type (ChainImpl<false>), run on the CPU on the whole global batch,
// with the loss the mean over the ranks' micro-batch losses. Tolerances: 1e-5
// (fp32) unless a check says bitwise.
#pragma once

#include "l1_util.h"
#include "raw_mpi.h"
#include "report.h"
#include "spmd.h"
#include "toy_models.h"

#include <fsdp/comm.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/adamw.h>

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr double kTol = 1e-5;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kGlobalRows = 16;  // the global batch, whatever the rank count
const char* const kInjected = "injected lifecycle failure";
const char* const kFsdp1d = "FSDP 1-D, fp32";
const char* const kHsdp2d = "HSDP 2-D, fp32";

// ---------------------------------------------------------------- reporting

// Constructed with the variant's configuration: Report(id, layout.configuration).
using testkit::Report;

inline void worsen(double& worst, double e) {
  if (std::isnan(worst)) return;
  if (std::isnan(e) || e > worst) worst = e;
}

// ---------------------------------------------------------------- layout

// Rows [offset, offset + length) of dim 0 that shard `index` of `parts` owns
// under the ceil-div layout (../shared/DESIGN.md section 5), computed here rather than
// by the library.
inline std::pair<int64_t, int64_t> owned_rows(int64_t rows, int64_t parts, int64_t index) {
  const int64_t chunk = (rows + parts - 1) / parts;
  const int64_t begin = std::min(index * chunk, rows);
  const int64_t end = std::min((index + 1) * chunk, rows);
  return {begin, end - begin};
}

inline at::Tensor my_rows(const at::Tensor& full, int64_t parts, int64_t index) {
  const auto [offset, length] = owned_rows(full.size(0), parts, index);
  return full.detach().to(at::kCPU).narrow(0, offset, length);
}

inline std::vector<int64_t> shard_shape(c10::IntArrayRef full, int64_t parts, int64_t index) {
  std::vector<int64_t> s = full.vec();
  s[0] = owned_rows(full[0], parts, index).second;
  return s;
}

// How data-parallel ranks and shards are laid out for one run.
struct Layout {
  std::optional<fsdp::DeviceMesh> mesh;  // nullopt: fully_shard's default 1-D world mesh
  int64_t shard_parts = 1;
  int64_t shard_index = 0;
  std::string configuration;
  std::string label;
};

inline Layout layout_1d() {
  return {std::nullopt, spmd::world_size(), spmd::rank(), kFsdp1d,
          "1-D x" + std::to_string(spmd::world_size())};
}

inline Layout layout_hsdp() {
  auto mesh = fsdp::init_device_mesh(spmd::device().type(), {2, 2}, {"replicate", "shard"});
  return {mesh, mesh.size("shard"), mesh.get_local_rank("shard"), kHsdp2d, "HSDP (2,2)"};
}

// ---------------------------------------------------------------- models

struct InjectedError : std::runtime_error {
  explicit InjectedError(const std::string& where)
      : std::runtime_error(std::string(kInjected) + " (" + where + ")") {}
};

// Identity in forward; its backward throws when armed.
struct ThrowInBackward : public torch::autograd::Function<ThrowInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            bool armed) {
    ctx->saved_data["armed"] = armed;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (ctx->saved_data["armed"].toBool()) throw InjectedError("backward");
    return {grads[0], at::Tensor()};
  }
};

// A residual block of `subs` Linear(h, h) sub-layers (l0, l1, ...), with an
// optional Linear "spare" that forward never uses and optional branch_a /
// branch_b of which forward uses one.
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t hidden, int64_t subs, bool spare, bool branches) {
    for (int64_t k = 0; k < subs; ++k) {
      sub.push_back(register_module("l" + std::to_string(k), torch::nn::Linear(hidden, hidden)));
    }
    if (spare) this->spare = register_module("spare", torch::nn::Linear(hidden, hidden));
    if (branches) {
      branch_a = register_module("branch_a", torch::nn::Linear(hidden, hidden));
      branch_b = register_module("branch_b", torch::nn::Linear(hidden, hidden));
    }
  }
  at::Tensor forward(at::Tensor x) {
    if (throw_in_forward) throw InjectedError("block forward");
    for (size_t k = 0; k < sub.size(); ++k) {
      if (k < skip.size() && skip[k]) continue;
      x = x + at::tanh(sub[k](x));
    }
    if (!branch_a.is_empty()) x = x + at::tanh(use_branch_b ? branch_b(x) : branch_a(x));
    return x;
  }
  std::vector<torch::nn::Linear> sub;
  torch::nn::Linear spare{nullptr}, branch_a{nullptr}, branch_b{nullptr};
  // Per-call behaviour, set by the test.
  bool throw_in_forward = false;
  std::vector<bool> skip;  // sub-layers this call leaves out
  bool use_branch_b = false;
};
TORCH_MODULE(Block);

struct ChainOptions {
  int64_t seed = 1;
  int64_t in = 6, hidden = 10, out = 3;
  int64_t blocks = 3;
  int64_t subs = 1;
  bool inp = true;   // Linear(in, hidden) + tanh before the blocks (owned by the root)
  bool head = true;  // Linear(hidden, out) after the blocks (owned by the root)
  int64_t spare_block = -1;
  int64_t branch_block = -1;
};

// inp -> blocks -> head. kSharded selects the block holder: fsdp::Sharded<Block>
// (a unit per block) or plain Block for the single-card reference, which
// involves no fsdp type at all.
template <bool kSharded>
struct ChainImpl : torch::nn::Module {
  using BlockHolder = std::conditional_t<kSharded, fsdp::Sharded<Block>, Block>;
  explicit ChainImpl(const ChainOptions& o) {
    at::manual_seed(o.seed);
    if (o.inp) inp = register_module("inp", torch::nn::Linear(o.in, o.hidden));
    for (int64_t b = 0; b < o.blocks; ++b) {
      blocks.push_back(register_module(
          "block" + std::to_string(b), Block(o.hidden, o.subs, b == o.spare_block, b == o.branch_block)));
    }
    if (o.head) head = register_module("head", torch::nn::Linear(o.hidden, o.out));
  }
  at::Tensor forward(at::Tensor x) {
    if (!inp.is_empty()) x = at::tanh(inp(x));
    for (size_t b = 0; b < blocks.size(); ++b) {
      at::Tensor y = blocks[b](x);
      if (static_cast<int64_t>(b) == discard_block) continue;  // computed, not used
      x = y;
      if (b == 0) x = ThrowInBackward::apply(x, throw_after_block0);
    }
    if (!head.is_empty()) x = head(x);
    return x;
  }
  torch::nn::Linear inp{nullptr}, head{nullptr};
  std::vector<BlockHolder> blocks;
  int64_t discard_block = -1;       // a block whose output forward drops
  bool throw_after_block0 = false;  // arms the ThrowInBackward after block 0
};

template <bool kSharded>
class Chain : public torch::nn::ModuleHolder<ChainImpl<kSharded>> {
 public:
  using torch::nn::ModuleHolder<ChainImpl<kSharded>>::ModuleHolder;
};

using RefChain = Chain<false>;

// A chain sharded bottom-up: each block, then the root (inp, head).
struct ShardedChain {
  Chain<true> chain;
  fsdp::Sharded<Chain<true>> net{nullptr};
  std::vector<fsdp::FSDPModule> blocks;
  fsdp::FSDPModule root;

  ShardedChain(const ChainOptions& o, const fsdp::FullyShardOptions& f) : chain(o) {
    chain->to(spmd::device());
    for (auto& b : chain->blocks) blocks.push_back(fsdp::fully_shard(b, f));
    net = fsdp::fully_shard(chain, f);
    root = *fsdp::fsdp_module_of(*chain.ptr());
  }
  at::Tensor operator()(const at::Tensor& x) { return net(x.to(spmd::device())); }
  ChainImpl<true>& operator*() { return *chain; }
  ChainImpl<true>* operator->() { return chain.get(); }
};

inline fsdp::FullyShardOptions shard_options(const Layout& l, bool reshard_after_forward = true,
                                      bool comm_fusion = false) {
  fsdp::FullyShardOptions f;
  f.mesh = l.mesh;
  f.reshard_after_forward = reshard_after_forward;
  f.comm_fusion = comm_fusion;
  return f;
}

inline torch::optim::AdamW adamw(const std::vector<at::Tensor>& params, double weight_decay = 1e-2) {
  return torch::optim::AdamW(params, torch::optim::AdamWOptions(1e-2).weight_decay(weight_decay));
}

using toy::Batch;
using toy::mse;
using toy::slice;

// The global batch (kGlobalRows rows, whatever the rank count).
inline Batch global_batch(int64_t seed, int64_t in, int64_t out) {
  return toy::global_batch(seed, kGlobalRows, in, out);
}
// Single-card step of the reference: the loss is the mean over the ranks'
// micro-batch losses, `configure(r)` sets rank r's per-call behaviour before
// its micro-batch runs. Returns each micro-batch's loss.
template <typename Configure>
inline std::vector<double> ref_backward(RefChain& ref, const Batch& global, Configure&& configure) {
  const int ws = spmd::world_size();
  at::Tensor total;
  std::vector<double> losses;
  for (int r = 0; r < ws; ++r) {
    configure(r);
    const Batch mine = slice(global, r, ws);
    at::Tensor loss = mse(ref(mine.x), mine.y);
    losses.push_back(loss.item<double>());
    total = total.defined() ? total + loss : loss;
  }
  (total / ws).backward();
  return losses;
}

inline std::vector<double> ref_backward(RefChain& ref, const Batch& global) {
  return ref_backward(ref, global, [](int) {});
}

// ---------------------------------------------------------------- comparisons

// Worst |grad - my rows of the reference grad| over the parameters of
// `model`; a gradient defined on one side only counts +inf and is described
// in *why ("grad defined (all zeros)", ...).
inline double grad_err(torch::nn::Module& model, torch::nn::Module& ref, int64_t parts, int64_t index,
                std::string* why) {
  double worst = 0;
  auto ref_params = ref.named_parameters();
  for (const auto& item : model.named_parameters()) {
    const at::Tensor* r = ref_params.find(item.key());
    if (r == nullptr) {
      *why += item.key() + ": not in the reference; ";
      worsen(worst, kInf);
      continue;
    }
    const at::Tensor g = item.value().grad();
    const at::Tensor rg = r->grad();
    if (!g.defined() && !rg.defined()) continue;
    if (g.defined() != rg.defined()) {
      if (g.defined()) {
        const bool zeros = g.numel() == 0 || g.detach().abs().max().item<double>() == 0.0;
        *why += item.key() + ": grad defined" + (zeros ? " (all zeros)" : " (nonzero)") +
                ", single card has none; ";
      } else {
        *why += item.key() + ": grad undefined, single card has one; ";
      }
      worsen(worst, kInf);
      continue;
    }
    const at::Tensor expect = my_rows(rg, parts, index);
    if (g.sizes() != expect.sizes()) {
      *why += item.key() + ": grad shape " + toy::shape_str(g.sizes()) + ", expected " +
              toy::shape_str(expect.sizes()) + "; ";
      worsen(worst, kInf);
      continue;
    }
    const double e = testkit::max_abs_diff_or_inf(g, expect);
    if (e > kTol && why->size() < 2000) {
      std::ostringstream os;
      os << item.key() << ": grad differs by " << e << "; ";
      *why += os.str();
    }
    worsen(worst, e);
  }
  return worst;
}

// Worst |param - my rows of the reference param|.
inline double data_err(torch::nn::Module& model, torch::nn::Module& ref, int64_t parts, int64_t index,
                std::string* why) {
  double worst = 0;
  auto ref_params = ref.named_parameters();
  for (const auto& item : model.named_parameters()) {
    const at::Tensor* r = ref_params.find(item.key());
    if (r == nullptr) {
      *why += item.key() + ": not in the reference; ";
      worsen(worst, kInf);
      continue;
    }
    const at::Tensor expect = my_rows(*r, parts, index);
    if (item.value().sizes() != expect.sizes()) {
      *why += item.key() + ": shape " + toy::shape_str(item.value().sizes()) + ", expected shard " +
              toy::shape_str(expect.sizes()) + "; ";
      worsen(worst, kInf);
      continue;
    }
    const double e = testkit::max_abs_diff_or_inf(item.value(), expect);
    if (e > kTol && why->size() < 2000) {
      std::ostringstream os;
      os << item.key() << ": differs by " << e << "; ";
      *why += os.str();
    }
    worsen(worst, e);
  }
  return worst;
}

// Whether every parameter of `model` has the local shard shape of its
// reference counterpart (names the others in *why).
inline bool all_sharded(torch::nn::Module& model, torch::nn::Module& ref, int64_t parts, int64_t index,
                 std::string* why) {
  bool ok = true;
  auto ref_params = ref.named_parameters();
  for (const auto& item : model.named_parameters()) {
    const at::Tensor* r = ref_params.find(item.key());
    if (r == nullptr) continue;
    const auto expect = shard_shape(r->sizes(), parts, index);
    if (item.value().sizes().vec() != expect) {
      ok = false;
      *why += item.key() + " " + toy::shape_str(item.value().sizes()) + " (local shard " +
              toy::shape_str(expect) + ", full " + toy::shape_str(r->sizes()) + "); ";
    }
  }
  return ok;
}

inline std::string prefixed(const std::string& prefix, const std::string& why) {
  return why.empty() ? "" : prefix + ": " + why;
}

// Records loss / grad / param errors of one model against its reference.
struct Tracker {
  double loss = 0, grad = 0, data = 0;
  std::string grad_why, data_why;
  void losses(double mine, double ref) { worsen(loss, std::abs(mine - ref)); }
  void grads(torch::nn::Module& m, torch::nn::Module& ref, const Layout& l, const std::string& what) {
    std::string w;
    worsen(grad, grad_err(m, ref, l.shard_parts, l.shard_index, &w));
    grad_why += prefixed(what, w);
  }
  void params(torch::nn::Module& m, torch::nn::Module& ref, const Layout& l, const std::string& what) {
    std::string w;
    worsen(data, data_err(m, ref, l.shard_parts, l.shard_index, &w));
    data_why += prefixed(what, w);
  }
  void publish_into(Report& r, const std::string& prefix, const std::string& suffix = "") {
    r.check(prefix + "loss vs single card" + suffix, loss, kTol);
    r.check(prefix + "sharded grads vs single card" + suffix, grad, kTol, grad_why);
    r.check(prefix + "params vs single card" + suffix, data, kTol, data_why);
  }
};

// The single card's side of one tracked step, after the sharded model's
// backward: the reference's backward on the global batch, losses and
// gradients compared, both optimizers stepped, parameters compared.
inline void track_step(Tracker& t, ShardedChain& s, RefChain& ref, torch::optim::Optimizer& opt,
                       torch::optim::Optimizer& ref_opt, const Batch& global, const at::Tensor& loss,
                       const Layout& layout, int step) {
  ref_opt.zero_grad();
  const auto ref_losses = ref_backward(ref, global);
  t.losses(loss.item<double>(), ref_losses[spmd::rank()]);
  t.grads(*s, *ref, layout, "step " + std::to_string(step));
  opt.step();
  ref_opt.step();
  t.params(*s, *ref, layout, "step " + std::to_string(step));
}

}  // namespace
