// Lifecycle semantics of fully_shard that a training loop relies on, checked
// through the public API against plain single-card LibTorch:
//
//  LC-1   an exception thrown in forward, early in backward or late in
//         backward, caught by the user (optimizer.zero_grad(), continue),
//         leaves nothing behind: the remaining steps equal a run in which the
//         failed step never happened (1-D at np 2 and np 4, HSDP (2,2) at np 4;
//         reshard_after_forward true/false; comm_fusion);
//  LC-2i  a parameter that takes no part in the loss keeps no gradient, and
//         AdamW with weight decay leaves it bit-identical;
//  LC-2ii a parameter with a gradient on some ranks only gets the mean over
//         ranks with zeros from the others;
//  LC-2iii a unit whose output is not used in the loss is resharded after
//         backward and keeps no gradients;
//  LC-3   ranks that leave different parameters without gradients still
//         issue the same collectives in the same order (no hang, right values);
//  LC-4   two independent sharded models trained interleaved, or through one
//         backward of loss_a + loss_b;
//  LC-5   two roots on one rank as pipeline stages: one backward through
//         both, and the PP pattern (stage 1's backward from a detached input,
//         then stage 0's from that input's gradient);
//  LC-6   a unit prefetched by another's forward that then does not run
//         computes, when it next runs, with the shards as the optimizer
//         left them (its unused all-gather is dropped, not reused).
//
// The single-card baselines use the same module classes instantiated without
// any fsdp type (ChainImpl<false>), run on the CPU on the whole global batch,
// with the loss the mean over the ranks' micro-batch losses. Tolerances: 1e-5
// (fp32) unless a check says bitwise. Several cases fail against a core that
// does not yet provide these semantics: that is what they are for.
#include "spmd.h"

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

// Worst errors of one case variant: check() asserts on this rank; publish()
// (collective over the world) prints the maximum over ranks from rank 0 and
// records it with its configuration (spmd::record_precision): tol > 0 ->
// kind "precision", tol == 0 -> "exact".
class Report {
 public:
  Report(std::string id, std::string configuration)
      : id_(std::move(id)), configuration_(std::move(configuration)) {}
  void check(const std::string& what, double err, double tol, const std::string& detail = "") {
    const bool ok = err <= tol;  // false for NaN
    const std::string shown = detail.size() > 900 ? detail.substr(0, 900) + " ..." : detail;
    BOOST_TEST(ok, id_ << " [" << configuration_ << "] rank " << spmd::rank() << ": " << what
                       << ": error " << err << " exceeds tol " << tol
                       << (shown.empty() ? "" : " -- ") << shown);
    entries_.push_back({what, err, tol});
  }
  void publish() {
    for (const auto& e : entries_) {
      at::Tensor t = at::full({1}, e.err, at::kDouble);
      fsdp::world_group()->all_reduce(t, fsdp::ReduceOp::MAX);
      const double worst = t.item<double>();
      if (spmd::rank() == 0) {
        std::cout << "[" << id_ << "] " << configuration_ << ": " << e.what << ": worst "
                  << std::scientific << std::setprecision(3) << worst << " (tol " << e.tol
                  << ")" << std::defaultfloat << std::endl;
      }
      spmd::PrecisionRecord r;
      r.case_id = id_;
      r.metric = e.what;
      r.tolerance = e.tol;
      r.observed = worst;
      r.pass = worst <= e.tol;
      r.kind = e.tol > 0 ? "precision" : "exact";
      r.configuration = configuration_;
      spmd::record_precision(r);
    }
    entries_.clear();
  }

 private:
  struct Entry {
    std::string what;
    double err, tol;
  };
  std::string id_, configuration_;
  std::vector<Entry> entries_;
};

void worsen(double& worst, double e) {
  if (std::isnan(worst)) return;
  if (std::isnan(e) || e > worst) worst = e;
}

// ---------------------------------------------------------------- layout

// Rows [offset, offset + length) of dim 0 that shard `index` of `parts` owns
// under the ceil-div layout (../shared/DESIGN.md section 5), computed here rather than
// by the library.
std::pair<int64_t, int64_t> owned_rows(int64_t rows, int64_t parts, int64_t index) {
  const int64_t chunk = (rows + parts - 1) / parts;
  const int64_t begin = std::min(index * chunk, rows);
  const int64_t end = std::min((index + 1) * chunk, rows);
  return {begin, end - begin};
}

at::Tensor my_rows(const at::Tensor& full, int64_t parts, int64_t index) {
  const auto [offset, length] = owned_rows(full.size(0), parts, index);
  return full.detach().to(at::kCPU).narrow(0, offset, length);
}

std::vector<int64_t> shard_shape(c10::IntArrayRef full, int64_t parts, int64_t index) {
  std::vector<int64_t> s = full.vec();
  s[0] = owned_rows(full[0], parts, index).second;
  return s;
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined() || a.sizes() != b.sizes()) return kInf;
  if (a.numel() == 0) return 0.0;
  return (a.detach().to(at::kCPU, at::kDouble) - b.detach().to(at::kCPU, at::kDouble))
      .abs()
      .max()
      .item<double>();
}

std::string shape_str(c10::IntArrayRef s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

// How data-parallel ranks and shards are laid out for one run.
struct Layout {
  std::optional<fsdp::DeviceMesh> mesh;  // nullopt: fully_shard's default 1-D world mesh
  int64_t shard_parts = 1;
  int64_t shard_index = 0;
  std::string configuration;
  std::string label;
};

Layout layout_1d() {
  return {std::nullopt, spmd::world_size(), spmd::rank(), kFsdp1d,
          "1-D x" + std::to_string(spmd::world_size())};
}

Layout layout_hsdp() {
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

fsdp::FullyShardOptions shard_options(const Layout& l, bool reshard_after_forward = true,
                                      bool comm_fusion = false) {
  fsdp::FullyShardOptions f;
  f.mesh = l.mesh;
  f.reshard_after_forward = reshard_after_forward;
  f.comm_fusion = comm_fusion;
  return f;
}

torch::optim::AdamW adamw(const std::vector<at::Tensor>& params, double weight_decay = 1e-2) {
  return torch::optim::AdamW(params, torch::optim::AdamWOptions(1e-2).weight_decay(weight_decay));
}

struct Batch {
  at::Tensor x, y;
};

Batch global_batch(int64_t seed, int64_t in, int64_t out) {
  at::manual_seed(seed);
  return {at::randn({kGlobalRows, in}), at::randn({kGlobalRows, out})};
}

Batch slice(const Batch& b, int64_t index, int64_t parts) {
  const int64_t per = b.x.size(0) / parts;
  return {b.x.narrow(0, index * per, per), b.y.narrow(0, index * per, per)};
}

at::Tensor mse(const at::Tensor& out, const at::Tensor& y) {
  return (out - y.to(out.device())).pow(2).mean();
}

// Single-card step of the reference: the loss is the mean over the ranks'
// micro-batch losses, `configure(r)` sets rank r's per-call behaviour before
// its micro-batch runs. Returns each micro-batch's loss.
template <typename Configure>
std::vector<double> ref_backward(RefChain& ref, const Batch& global, Configure&& configure) {
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

std::vector<double> ref_backward(RefChain& ref, const Batch& global) {
  return ref_backward(ref, global, [](int) {});
}

// ---------------------------------------------------------------- comparisons

// Worst |grad - my rows of the reference grad| over the parameters of
// `model`; a gradient defined on one side only counts +inf and is described
// in *why ("grad defined (all zeros)", ...).
double grad_err(torch::nn::Module& model, torch::nn::Module& ref, int64_t parts, int64_t index,
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
      *why += item.key() + ": grad shape " + shape_str(g.sizes()) + ", expected " +
              shape_str(expect.sizes()) + "; ";
      worsen(worst, kInf);
      continue;
    }
    const double e = max_abs_diff(g, expect);
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
double data_err(torch::nn::Module& model, torch::nn::Module& ref, int64_t parts, int64_t index,
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
      *why += item.key() + ": shape " + shape_str(item.value().sizes()) + ", expected shard " +
              shape_str(expect.sizes()) + "; ";
      worsen(worst, kInf);
      continue;
    }
    const double e = max_abs_diff(item.value(), expect);
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
bool all_sharded(torch::nn::Module& model, torch::nn::Module& ref, int64_t parts, int64_t index,
                 std::string* why) {
  bool ok = true;
  auto ref_params = ref.named_parameters();
  for (const auto& item : model.named_parameters()) {
    const at::Tensor* r = ref_params.find(item.key());
    if (r == nullptr) continue;
    const auto expect = shard_shape(r->sizes(), parts, index);
    if (item.value().sizes().vec() != expect) {
      ok = false;
      *why += item.key() + " " + shape_str(item.value().sizes()) + " (local shard " +
              shape_str(expect) + ", full " + shape_str(r->sizes()) + "); ";
    }
  }
  return ok;
}

std::string prefixed(const std::string& prefix, const std::string& why) {
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

// ================================================================ LC-1
// Exceptions leave nothing behind.

enum class Failure { kForward, kEarlyBackward, kLateBackward };

const char* failure_name(Failure f) {
  switch (f) {
    case Failure::kForward: return "in forward";
    case Failure::kEarlyBackward: return "early in backward";
    case Failure::kLateBackward: return "late in backward";
  }
  return "?";
}

const char* failure_id(Failure f) {
  switch (f) {
    case Failure::kForward: return "LC-1a";
    case Failure::kEarlyBackward: return "LC-1b";
    case Failure::kLateBackward: return "LC-1c";
  }
  return "LC-1?";
}

std::vector<Layout> exception_layouts() {
  std::vector<Layout> out;
  out.push_back(layout_1d());
  if (spmd::world_size() == 4) out.push_back(layout_hsdp());
  return out;
}

// Steps 1..3 with AdamW; step 2 throws (on every rank, at the same point);
// the user catches it, calls optimizer.zero_grad() and goes on with step 3.
// Reference: AdamW on the batches of steps 1 and 3 only.
void run_exception_case(Failure failure, bool reshard_after_forward, bool comm_fusion) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  std::ostringstream id;
  id << failure_id(failure) << " exception " << failure_name(failure)
     << " reshard_after_forward=" << (reshard_after_forward ? "true" : "false")
     << " comm_fusion=" << (comm_fusion ? "true" : "false");
  for (const Layout& layout : exception_layouts()) {
    BOOST_TEST_MESSAGE(id.str() << " on " << layout.label);
    Report report(id.str(), layout.configuration);
    ChainOptions o;
    o.seed = 11;
    ShardedChain s(o, shard_options(layout, reshard_after_forward, comm_fusion));
    RefChain ref(o);
    auto opt = adamw(s->parameters());
    auto ref_opt = adamw(ref->parameters());

    Tracker t;
    bool threw = false;
    for (int step = 1; step <= 3; ++step) {
      const Batch global = global_batch(100 + step, o.in, o.out);
      const Batch mine = slice(global, rank, ws);
      const bool fail = step == 2;
      opt.zero_grad();
      if (fail && failure == Failure::kForward) s->blocks[1]->throw_in_forward = true;
      if (fail && failure == Failure::kLateBackward) s->throw_after_block0 = true;
      at::Tensor loss;
      try {
        at::Tensor out = s(mine.x);
        if (failure == Failure::kEarlyBackward) out = ThrowInBackward::apply(out, fail);
        loss = mse(out, mine.y);
        loss.backward();
      } catch (const std::exception& e) {
        s->blocks[1]->throw_in_forward = false;
        s->throw_after_block0 = false;
        const std::string msg = e.what();
        if (!fail || msg.find(kInjected) == std::string::npos) {
          BOOST_ERROR(id.str() << " on " << layout.label << ": step " << step
                               << " threw unexpectedly: " << msg);
          throw;
        }
        threw = true;
        opt.zero_grad();  // what the user does after catching it
        continue;
      }
      s->blocks[1]->throw_in_forward = false;
      s->throw_after_block0 = false;
      if (fail) {
        BOOST_ERROR(id.str() << " on " << layout.label << ": the armed step 2 did not throw");
        continue;
      }
      ref_opt.zero_grad();
      const auto ref_losses = ref_backward(ref, global);
      t.losses(loss.item<double>(), ref_losses[rank]);
      t.grads(*s, *ref, layout, "step " + std::to_string(step));
      opt.step();
      ref_opt.step();
      t.params(*s, *ref, layout, "step " + std::to_string(step));
    }
    BOOST_TEST(threw, id.str() << " on " << layout.label << ": step 2 never threw");
    std::string shard_why;
    BOOST_TEST(all_sharded(*s, *ref, layout.shard_parts, layout.shard_index, &shard_why),
               id.str() << " on " << layout.label << " rank " << rank
                        << ": after the remaining steps, not local shards: " << shard_why);
    t.publish_into(report, "", " without the failed step");
    report.publish();
  }
}

}  // namespace

BOOST_AUTO_TEST_SUITE(exceptions_leave_nothing_behind,
                      *spmd::needs_world_size_at_least(2, "collectives between ranks"))

BOOST_AUTO_TEST_CASE(exception_in_forward_reshard_after_forward) {
  run_exception_case(Failure::kForward, true, false);
}
BOOST_AUTO_TEST_CASE(exception_in_forward_no_reshard_after_forward) {
  run_exception_case(Failure::kForward, false, false);
}
BOOST_AUTO_TEST_CASE(exception_in_forward_comm_fusion) {
  run_exception_case(Failure::kForward, true, true);
}
BOOST_AUTO_TEST_CASE(exception_early_in_backward_reshard_after_forward) {
  run_exception_case(Failure::kEarlyBackward, true, false);
}
BOOST_AUTO_TEST_CASE(exception_early_in_backward_no_reshard_after_forward) {
  run_exception_case(Failure::kEarlyBackward, false, false);
}
BOOST_AUTO_TEST_CASE(exception_early_in_backward_comm_fusion) {
  run_exception_case(Failure::kEarlyBackward, true, true);
}
BOOST_AUTO_TEST_CASE(exception_late_in_backward_reshard_after_forward) {
  run_exception_case(Failure::kLateBackward, true, false);
}
BOOST_AUTO_TEST_CASE(exception_late_in_backward_no_reshard_after_forward) {
  run_exception_case(Failure::kLateBackward, false, false);
}
BOOST_AUTO_TEST_CASE(exception_late_in_backward_comm_fusion) {
  run_exception_case(Failure::kLateBackward, true, true);
}

BOOST_AUTO_TEST_SUITE_END()

// ================================================================ LC-2
// Parameters without a gradient keep none.

BOOST_AUTO_TEST_SUITE(params_without_grad_keep_none)

// (i) block1.spare is registered but never used: on every rank it gets no
// gradient; AdamW (weight_decay > 0) skips it, so it stays bit-identical.
BOOST_AUTO_TEST_CASE(unused_param_has_no_grad_and_is_not_decayed,
                     *spmd::needs_world_size_at_least(2, "collectives between ranks")) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const Layout layout = layout_1d();
  Report report("LC-2i unused parameter keeps no grad", layout.configuration);
  ChainOptions o;
  o.seed = 21;
  o.spare_block = 1;
  ShardedChain s(o, shard_options(layout));
  RefChain ref(o);
  auto opt = adamw(s->parameters(), 0.1);
  auto ref_opt = adamw(ref->parameters(), 0.1);
  const at::Tensor w0 = s->blocks[1]->spare->weight.detach().to(at::kCPU).clone();
  const at::Tensor b0 = s->blocks[1]->spare->bias.detach().to(at::kCPU).clone();

  Tracker t;
  double spare_change = 0;
  for (int step = 1; step <= 3; ++step) {
    const Batch global = global_batch(200 + step, o.in, o.out);
    const Batch mine = slice(global, rank, ws);
    opt.zero_grad();
    at::Tensor loss = mse(s(mine.x), mine.y);
    loss.backward();
    ref_opt.zero_grad();
    const auto ref_losses = ref_backward(ref, global);
    t.losses(loss.item<double>(), ref_losses[rank]);
    const std::vector<std::pair<std::string, at::Tensor>> spare_params = {
        {"weight", s->blocks[1]->spare->weight}, {"bias", s->blocks[1]->spare->bias}};
    for (const auto& [name, param] : spare_params) {
      const at::Tensor g = param.grad();
      std::string state = "undefined";
      if (g.defined()) {
        state = g.numel() == 0 || g.abs().max().item<double>() == 0.0 ? "defined (all zeros)"
                                                                      : "defined (nonzero)";
      }
      BOOST_TEST(!g.defined(), "LC-2i rank " << rank << " step " << step << ": block1.spare."
                                             << name << ".grad() is " << state
                                             << ", expected undefined");
    }
    t.grads(*s, *ref, layout, "step " + std::to_string(step));
    opt.step();
    ref_opt.step();
    worsen(spare_change, max_abs_diff(s->blocks[1]->spare->weight, w0));
    worsen(spare_change, max_abs_diff(s->blocks[1]->spare->bias, b0));
    t.params(*s, *ref, layout, "step " + std::to_string(step));
  }
  report.check("unused param change over 3 AdamW steps (bitwise)", spare_change, 0.0);
  t.publish_into(report, "", " (undefined where single card has none)");
  report.publish();
}

// (ii) block1 has branch_a / branch_b: even ranks use a, odd ranks b. Each
// branch's sharded gradient is the mean over ranks with zeros from the
// ranks that did not use it; every rank holds its shard of it.
BOOST_AUTO_TEST_CASE(param_with_grad_on_some_ranks_gets_mean_with_zeros,
                     *spmd::needs_world_size_at_least(2, "one per branch")) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const Layout layout = layout_1d();
  Report report("LC-2ii rank-dependent branch", layout.configuration);
  ChainOptions o;
  o.seed = 22;
  o.branch_block = 1;
  ShardedChain s(o, shard_options(layout));
  RefChain ref(o);
  auto opt = adamw(s->parameters());
  auto ref_opt = adamw(ref->parameters());
  Tracker t;
  for (int step = 1; step <= 2; ++step) {
    const Batch global = global_batch(300 + step, o.in, o.out);
    const Batch mine = slice(global, rank, ws);
    opt.zero_grad();
    s->blocks[1]->use_branch_b = rank % 2 == 1;
    at::Tensor loss = mse(s(mine.x), mine.y);
    loss.backward();
    ref_opt.zero_grad();
    const auto ref_losses =
        ref_backward(ref, global, [&](int r) { ref->blocks[1]->use_branch_b = r % 2 == 1; });
    t.losses(loss.item<double>(), ref_losses[rank]);
    const std::vector<std::pair<std::string, torch::nn::Linear>> branches = {
        {"branch_a", s->blocks[1]->branch_a}, {"branch_b", s->blocks[1]->branch_b}};
    for (const auto& [branch, lin] : branches) {
      for (const auto& item : lin->named_parameters()) {
        BOOST_TEST(item.value().grad().defined(),
                   "LC-2ii rank " << rank << " step " << step << ": block1." << branch << "."
                                  << item.key() << ".grad() undefined (used on "
                                  << (branch == "branch_a" ? "even" : "odd") << " ranks)");
      }
    }
    t.grads(*s, *ref, layout, "step " + std::to_string(step));
    opt.step();
    ref_opt.step();
    t.params(*s, *ref, layout, "step " + std::to_string(step));
  }
  t.publish_into(report, "", " (missing ranks contribute zeros)");
  report.publish();
}

// (iii) block1's output is computed and dropped: after backward every unit is
// resharded (each parameter has its local shard shape) and block1's
// parameters have no gradients.
BOOST_AUTO_TEST_CASE(unit_with_unused_output_is_resharded_without_grads,
                     *spmd::needs_world_size_at_least(2, "collectives between ranks")) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const Layout layout = layout_1d();
  for (const bool raf : {true, false}) {
    const std::string id = std::string("LC-2iii unit output unused reshard_after_forward=") +
                           (raf ? "true" : "false");
    Report report(id, layout.configuration);
    ChainOptions o;
    o.seed = 23;
    ShardedChain s(o, shard_options(layout, raf));
    RefChain ref(o);
    s->discard_block = 1;
    ref->discard_block = 1;
    auto opt = adamw(s->parameters());
    auto ref_opt = adamw(ref->parameters());
    Tracker t;
    for (int step = 1; step <= 2; ++step) {
      const Batch global = global_batch(400 + step, o.in, o.out);
      const Batch mine = slice(global, rank, ws);
      opt.zero_grad();
      at::Tensor loss = mse(s(mine.x), mine.y);
      loss.backward();
      std::string shard_why;
      BOOST_TEST(all_sharded(*s, *ref, layout.shard_parts, layout.shard_index, &shard_why),
                 id << " rank " << rank << " step " << step
                    << ": after backward, not resharded: " << shard_why);
      for (const auto& p : s->blocks[1]->named_parameters()) {
        BOOST_TEST(!p.value().grad().defined(),
                   id << " rank " << rank << " step " << step << ": block1." << p.key()
                      << ".grad() is defined, expected undefined (its output is not used)");
      }
      ref_opt.zero_grad();
      const auto ref_losses = ref_backward(ref, global);
      t.losses(loss.item<double>(), ref_losses[rank]);
      t.grads(*s, *ref, layout, "step " + std::to_string(step));
      opt.step();
      ref_opt.step();
      t.params(*s, *ref, layout, "step " + std::to_string(step));
    }
    t.publish_into(report, "", " (undefined where single card has none)");
    report.publish();
  }
}

BOOST_AUTO_TEST_SUITE_END()

// ================================================================ LC-4, LC-5

BOOST_AUTO_TEST_SUITE(independent_roots)

// LC-4: two independent sharded models A and B (different sizes) in one
// process, each with its own AdamW; (interleaved) forward A, forward B,
// backward A, backward B; (joint) one backward of loss_a + loss_b.
BOOST_AUTO_TEST_CASE(two_models_trained_interleaved,
                     *spmd::needs_world_size_at_least(2, "collectives between ranks")) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const Layout layout = layout_1d();
  for (const bool joint : {false, true}) {
    const std::string id = std::string("LC-4 two models ") +
                           (joint ? "one backward of loss_a + loss_b"
                                  : "interleaved fwd A, fwd B, bwd A, bwd B");
    Report report(id, layout.configuration);
    ChainOptions oa, ob;
    oa.seed = 41;
    ob.seed = 42;
    ob.in = 5;
    ob.hidden = 12;
    ob.out = 4;
    ob.blocks = 2;
    ShardedChain a(oa, shard_options(layout));
    ShardedChain b(ob, shard_options(layout));
    RefChain ref_a(oa), ref_b(ob);
    auto opt_a = adamw(a->parameters()), opt_b = adamw(b->parameters());
    auto ref_opt_a = adamw(ref_a->parameters()), ref_opt_b = adamw(ref_b->parameters());
    Tracker ta, tb;
    for (int step = 1; step <= 3; ++step) {
      const std::string what = "step " + std::to_string(step);
      const Batch ga = global_batch(500 + step, oa.in, oa.out);
      const Batch gb = global_batch(550 + step, ob.in, ob.out);
      const Batch ma = slice(ga, rank, ws), mb = slice(gb, rank, ws);
      opt_a.zero_grad();
      opt_b.zero_grad();
      at::Tensor la = mse(a(ma.x), ma.y);
      at::Tensor lb = mse(b(mb.x), mb.y);
      if (joint) {
        (la + lb).backward();
      } else {
        la.backward();
        lb.backward();
      }
      ref_opt_a.zero_grad();
      ref_opt_b.zero_grad();
      const auto ra = ref_backward(ref_a, ga);
      const auto rb = ref_backward(ref_b, gb);
      ta.losses(la.item<double>(), ra[rank]);
      tb.losses(lb.item<double>(), rb[rank]);
      ta.grads(*a, *ref_a, layout, what);
      tb.grads(*b, *ref_b, layout, what);
      opt_a.step();
      opt_b.step();
      ref_opt_a.step();
      ref_opt_b.step();
      ta.params(*a, *ref_a, layout, what);
      tb.params(*b, *ref_b, layout, what);
    }
    ta.publish_into(report, "model A ");
    tb.publish_into(report, "model B ");
    report.publish();
  }
}

// LC-5: two pipeline stages whose roots live on this rank, each sharded on its
// own (blocks, then the stage root); y = stage1(stage0(x)). (joint) one
// backward through both; (pp) stage 1's backward from a detached stage-0
// output that requires grad, then stage 0's backward from that input's grad.
BOOST_AUTO_TEST_CASE(two_pipeline_stage_roots_on_one_rank,
                     *spmd::needs_world_size_at_least(2, "collectives between ranks")) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const Layout layout = layout_1d();
  for (const bool pp : {false, true}) {
    const std::string id = std::string("LC-5 two stage roots ") +
                           (pp ? "pp backward (stage 1, then stage 0 from the input grad)"
                               : "one backward through both");
    Report report(id, layout.configuration);
    ChainOptions o0, o1;
    o0.seed = 51;
    o0.blocks = 2;
    o0.head = false;
    o1.seed = 52;
    o1.blocks = 2;
    o1.inp = false;
    ShardedChain s0(o0, shard_options(layout));
    ShardedChain s1(o1, shard_options(layout));
    BOOST_TEST(s0.root.is_root());
    BOOST_TEST(s1.root.is_root());
    RefChain r0(o0), r1(o1);
    auto opt0 = adamw(s0->parameters()), opt1 = adamw(s1->parameters());
    auto ref_opt0 = adamw(r0->parameters()), ref_opt1 = adamw(r1->parameters());
    Tracker t0, t1;
    double boundary_err = 0;
    for (int step = 1; step <= 2; ++step) {
      const std::string what = "step " + std::to_string(step);
      const Batch global = global_batch(600 + step, o0.in, o1.out);
      const Batch mine = slice(global, rank, ws);
      opt0.zero_grad();
      opt1.zero_grad();
      at::Tensor loss;
      if (pp) {
        at::Tensor x0 = s0(mine.x);
        at::Tensor in1 = x0.detach().requires_grad_(true);
        loss = mse(s1(in1), mine.y);
        loss.backward();
        BOOST_TEST_REQUIRE(in1.grad().defined(), id << ": the stage-1 input got no gradient");
        const at::Tensor boundary = in1.grad().detach().clone();
        torch::autograd::backward({x0}, {boundary});
        // Reference: d(mean over ranks of loss_r)/d(x0) restricted to this
        // rank's rows is 1/ws of the micro-batch gradient (ws: a power of 2).
        ref_opt0.zero_grad();
        ref_opt1.zero_grad();
        at::Tensor rx0 = r0(global.x);
        rx0.retain_grad();
        at::Tensor total;
        for (int r = 0; r < ws; ++r) {
          const Batch sl = slice(global, r, ws);
          const int64_t per = global.x.size(0) / ws;
          at::Tensor l = mse(r1(rx0.narrow(0, r * per, per)), sl.y);
          if (r == rank) t1.losses(loss.item<double>(), l.item<double>());
          total = total.defined() ? total + l : l;
        }
        (total / ws).backward();
        const int64_t per = global.x.size(0) / ws;
        worsen(boundary_err,
               max_abs_diff(boundary, rx0.grad().narrow(0, rank * per, per) * static_cast<double>(ws)));
      } else {
        loss = mse(s1(s0(mine.x)), mine.y);
        loss.backward();
        ref_opt0.zero_grad();
        ref_opt1.zero_grad();
        at::Tensor total;
        for (int r = 0; r < ws; ++r) {
          const Batch sl = slice(global, r, ws);
          at::Tensor l = mse(r1(r0(sl.x)), sl.y);
          if (r == rank) t1.losses(loss.item<double>(), l.item<double>());
          total = total.defined() ? total + l : l;
        }
        (total / ws).backward();
      }
      t0.grads(*s0, *r0, layout, what);
      t1.grads(*s1, *r1, layout, what);
      opt0.step();
      opt1.step();
      ref_opt0.step();
      ref_opt1.step();
      t0.params(*s0, *r0, layout, what);
      t1.params(*s1, *r1, layout, what);
    }
    if (pp) report.check("stage-boundary grad vs single card", boundary_err, kTol);
    t1.publish_into(report, "composed loss / stage 1 ");  // the loss is the composed model's
    report.check("stage 0 sharded grads vs single card", t0.grad, kTol, t0.grad_why);
    report.check("stage 0 params vs single card", t0.data, kTol, t0.data_why);
    report.publish();
  }
}

BOOST_AUTO_TEST_SUITE_END()

// ================================================================ LC-3
// Last in the file: against a core that issues collectives in readiness
// order, it can hang, and the harness's watchdog then aborts the whole job.

BOOST_AUTO_TEST_SUITE(same_collectives_whatever_the_data)

// Each block has 3 sub-layers; rank r leaves out sub-layer r % 3 of block b
// where (r + b) % 3 == 0, so which units see every gradient, and hence when
// each unit's post-backward is ready, differs per rank. Every sub-layer is
// used on some rank (so every parameter gets a gradient on every rank).
BOOST_AUTO_TEST_CASE(rank_dependent_unused_params_same_collectives,
                     *spmd::needs_world_size_at_least(2, "collectives between ranks")) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const Layout layout = layout_1d();
  Report report("LC-3 rank-dependent unused sub-layers", layout.configuration);
  ChainOptions o;
  o.seed = 31;
  o.subs = 3;
  const auto skips = [&](int r, int64_t b) {
    std::vector<bool> skip(3, false);
    if ((r + b) % 3 == 0) skip[static_cast<size_t>(r % 3)] = true;
    return skip;
  };
  ShardedChain s(o, shard_options(layout));
  RefChain ref(o);
  for (int64_t b = 0; b < o.blocks; ++b) s->blocks[b]->skip = skips(rank, b);
  auto opt = adamw(s->parameters());
  auto ref_opt = adamw(ref->parameters());
  Tracker t;
  for (int step = 1; step <= 3; ++step) {
    const std::string what = "step " + std::to_string(step);
    const Batch global = global_batch(700 + step, o.in, o.out);
    const Batch mine = slice(global, rank, ws);
    opt.zero_grad();
    at::Tensor loss = mse(s(mine.x), mine.y);
    loss.backward();
    ref_opt.zero_grad();
    const auto ref_losses = ref_backward(ref, global, [&](int r) {
      for (int64_t b = 0; b < o.blocks; ++b) ref->blocks[b]->skip = skips(r, b);
    });
    worsen(t.loss, std::abs(loss.item<double>() - ref_losses[rank]));
    t.grads(*s, *ref, layout, what);
    opt.step();
    ref_opt.step();
    t.params(*s, *ref, layout, what);
  }
  t.publish_into(report, "");
  report.publish();
}

BOOST_AUTO_TEST_SUITE_END()

// ------------------------------------------- LC-6: unused prefetched gathers

namespace {

struct BranchImpl : torch::nn::Module {
  BranchImpl() {
    at::manual_seed(11);
    a = register_module("a", torch::nn::Linear(6, 6));
    b = register_module("b", torch::nn::Linear(6, 6));
  }
  at::Tensor forward(at::Tensor x) {
    at::Tensor h = at::tanh(a(x));
    return use_b ? b(h) : h;
  }
  fsdp::Sharded<torch::nn::Linear> a{nullptr}, b{nullptr};
  bool use_b = true;
};
TORCH_MODULE(Branch);

}  // namespace

// LC-6: a's forward prefetches b, whose forward does not run (a branch not
// taken). The optimizer then updates b's shards in place; the next forward
// that runs b must compute with the updated values, not with the all-gather
// issued before the update. With and without a backward in between (the
// root's post-backward and its next pre-forward both drop such gathers).
BOOST_AUTO_TEST_CASE(prefetched_unit_that_did_not_run_regathers_updated_shards) {
  const auto dev = spmd::device();
  for (const bool with_backward : {true, false}) {
    BOOST_TEST_CONTEXT((with_backward ? "forward + backward" : "forward only")) {
      Branch model;
      model->to(dev);
      const at::Tensor wa = model->a->weight.detach().clone(), ba = model->a->bias.detach().clone();
      const at::Tensor wb = model->b->weight.detach().clone(), bb = model->b->bias.detach().clone();
      fsdp::FSDPModule ua = fsdp::fully_shard(model->a);
      fsdp::FSDPModule ub = fsdp::fully_shard(model->b);
      fsdp::Sharded<Branch> root = fsdp::fully_shard(model);
      ua.set_modules_to_forward_prefetch({ub});
      at::manual_seed(5);
      const at::Tensor x = at::randn({3, 6}, at::TensorOptions().device(dev));
      model->use_b = false;
      const at::Tensor h = root(x);
      if (with_backward) h.sum().backward();
      // An optimizer step on b's shards, in place (b took no part: a plain
      // update stands for one).
      {
        at::NoGradGuard no_grad;
        for (auto& p : model->b->parameters()) p.add_(1.0);
      }
      model->use_b = true;
      const at::Tensor out = root(x);
      const at::Tensor want = at::linear(at::tanh(at::linear(x, wa, ba)), wb + 1.0, bb + 1.0);
      const double err = (out.detach() - want).abs().max().item<double>();
      BOOST_TEST(err <= kTol, "b computed with stale shards: max error " << err);
    }
  }
}
