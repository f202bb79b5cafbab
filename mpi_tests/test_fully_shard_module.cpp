// Level-1 interface cases of the test plan for fully_shard and the FSDPModule
// controls (plan target _test_fully_shard_module.py): L1-01..05, L1-09, the
// plan's "existing" rows for this file, and the argument/state errors.
//
// Baseline everywhere: the same model unsharded on one card (same seed), run
// on the whole global batch; a rank's sharded gradient must equal its rows of
// the single-card gradient. Each case prints its worst error over all ranks as
// "[<id>] <what>: worst <err> (tol <tol>)".
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
boost::unit_test::precondition multi_rank() {
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

using ModulePtr = std::shared_ptr<torch::nn::Module>;

toy::Batch mine(const toy::Batch& global) {
  return toy::slice(global, spmd::rank(), spmd::world_size());
}

// Single-card gradient of one global batch on a fresh copy of the toy MLP.
std::shared_ptr<toy::MlpImpl> ref_grads(int64_t seed, const std::vector<toy::Batch>& batches) {
  toy::Mlp ref(seed);
  for (const auto& b : batches) l1::ref_backward(ref, b);
  return ref.ptr();
}

double grad_err(l1::ShardedMlp& m, const std::shared_ptr<toy::MlpImpl>& ref, double scale = 1.0,
                const std::string& only = "") {
  return l1::grad_err(m.module(), *ref, spmd::world_size(), spmd::rank(), scale, only);
}

std::string numel_mismatch(l1::ShardedMlp& m, const std::string& prefix, bool full) {
  std::string mis;
  l1::numel_state(m.module(), prefix, full, spmd::world_size(), spmd::rank(), &mis);
  return mis;
}

// ---- a chain of single-parameter blocks whose compute is visible in the
// collective sequence (for the prefetch-order cases) -----------------------

// A marker in the collective sequence: a broadcast over the world of id + 1
// floats, so its byte count (4 * (id + 1)) names the point.
void marker(int64_t id) {
  at::Tensor t = at::zeros({id + 1});
  fsdp::world_group()->broadcast(t, 0);
}
int64_t marker_bytes(int64_t id) { return 4 * (id + 1); }
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
int64_t block_gather_bytes(int i) {
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

toy::Batch chain_batch(int64_t seed) { return toy::global_batch(seed, kRows, 8, 3); }

double chain_grad_err(ShardedChain& c, int64_t seed, const toy::Batch& global) {
  Chain ref(seed);
  at::Tensor loss = toy::mse(ref(global.x), global.y);
  loss.backward();
  return l1::grad_err(*c.model, *ref, spmd::world_size(), spmd::rank());
}

}  // namespace

// ============================================================================
// L1-01: set_reshard_after_forward / set_reshard_after_backward at run time.
// ============================================================================
BOOST_AUTO_TEST_CASE(test_dynamic_reshard_control, *multi_rank()) {  // L1-01
  const int ws = spmd::world_size();
  l1::Report rep("L1-01");
  const int64_t seed = 11;
  l1::ShardedMlp m(seed, {});

  // One training step on batch `bseed`: returns the all-gathers it issued,
  // checks numel after forward/backward and the grads vs single card.
  auto step = [&](int64_t bseed, const std::string& label, const std::string& full_after_fwd,
                  bool full_after_bwd) {
    const auto global = toy::global_batch(bseed, kRows);
    m.root.zero_grad();
    fsdp::reset_collective_counters();
    at::Tensor loss = m.loss(mine(global));
    // After forward: the named prefix is full ("" = all, "-" = none), the rest sharded.
    for (const std::string& prefix : {std::string("fc1"), std::string("fc2"), std::string("fc3")}) {
      const bool full = full_after_fwd == "" || full_after_fwd.find(prefix) != std::string::npos;
      const std::string mis = numel_mismatch(m, prefix, full);
      BOOST_TEST(mis.empty(), label << ": after forward: " << mis);
    }
    loss.backward();
    const int64_t gathers = fsdp::collective_counters().total("all_gather");
    const std::string mis = numel_mismatch(m, "", full_after_bwd);
    BOOST_TEST(mis.empty(), label << ": after backward: " << mis);
    if (full_after_bwd) {
      // The sharded grads are installed on the shards: reshard to read them.
      BOOST_CHECK_NO_THROW(m.root.reshard());
      BOOST_CHECK_NO_THROW(m.fc1.reshard());
      BOOST_CHECK_NO_THROW(m.fc2.reshard());
      const std::string mis2 = numel_mismatch(m, "", false);
      BOOST_TEST(mis2.empty(), label << ": after reshard(): " << mis2);
    }
    rep.check(label + ": grads vs single card", grad_err(m, ref_grads(seed, {global})),
              kGradTol);
    return gathers;
  };

  // Toggling never throws (recurse and not, on every unit, repeatedly).
  for (bool v : {false, true, false, true}) {
    BOOST_CHECK_NO_THROW(m.root.set_reshard_after_forward(v));
    BOOST_CHECK_NO_THROW(m.root.set_reshard_after_backward(v));
    BOOST_CHECK_NO_THROW(m.root.set_reshard_after_forward(v, /*recurse=*/false));
    BOOST_CHECK_NO_THROW(m.fc1.set_reshard_after_backward(v, /*recurse=*/false));
  }

  // reshard_after_forward=false: parameters stay full after forward, one
  // all-gather per parameter per step.
  m.root.set_reshard_after_forward(false);
  int64_t ag = step(101, "raf=false", "", false);
  BOOST_TEST(ag == kMlpParams, "raf=false: all-gathers per step " << ag << ", expected "
                                                                   << kMlpParams);
  // Toggled back to true: shards after forward, re-gathered for backward.
  m.root.set_reshard_after_forward(true);
  ag = step(102, "raf=true", "-", false);
  BOOST_TEST(ag == 2 * kMlpParams, "raf=true: all-gathers per step " << ag << ", expected "
                                                                      << 2 * kMlpParams);
  // recurse=false on the root: only the root's own parameters (fc3) stay full.
  m.root.set_reshard_after_forward(false, /*recurse=*/false);
  ag = step(103, "root-only raf=false", "fc3", false);
  BOOST_TEST(ag == 2 * 4 + 2, "root-only raf=false: all-gathers per step " << ag
                                                                           << ", expected 10");
  // Unset (the default, FSDP2's None): every unit but the root reshards, so
  // fc3 stays full from forward to backward -- and resharded after it.
  BOOST_TEST(!fsdp::FullyShardOptions{}.reshard_after_forward.is_set());
  m.root.set_reshard_after_forward(fsdp::ReshardAfterForward());
  ag = step(104, "raf unset", "fc3", false);
  BOOST_TEST(ag == kMlpGathersPerStep, "raf unset: all-gathers per step "
                                           << ag << ", expected " << kMlpGathersPerStep);
  {
    // Without grad mode no backward follows: the root reshards as well.
    at::NoGradGuard no_grad;
    m.loss(mine(toy::global_batch(105, kRows)));
    const std::string mis = numel_mismatch(m, "", false);
    BOOST_TEST(mis.empty(), "raf unset, forward without grad: " << mis);
  }
  m.root.set_reshard_after_forward(true);

  // reshard_after_backward=false: parameters stay full after backward.
  m.root.set_reshard_after_backward(false);
  ag = step(104, "rab=false", "-", true);
  BOOST_TEST(ag == 2 * kMlpParams, "rab=false: all-gathers per step " << ag);
  // Toggled back to true: shards after backward.
  m.root.set_reshard_after_backward(true);
  ag = step(105, "rab=true", "-", false);
  BOOST_TEST(ag == 2 * kMlpParams, "rab=true: all-gathers per step " << ag);

  // Toggled between forward and backward of one step.
  {
    const auto global = toy::global_batch(106, kRows);
    m.root.zero_grad();
    at::Tensor loss = m.loss(mine(global));
    BOOST_CHECK_NO_THROW(m.root.set_reshard_after_backward(false));
    loss.backward();
    const std::string mis = numel_mismatch(m, "", true);
    BOOST_TEST(mis.empty(), "rab=false set mid-step: after backward: " << mis);
    m.root.set_reshard_after_backward(true);
    m.root.reshard();
    m.fc1.reshard();
    m.fc2.reshard();
    rep.check("rab=false set mid-step: grads vs single card",
              grad_err(m, ref_grads(seed, {global})), kGradTol);
  }

  // The same with comm_fusion: one all-gather per unit per pass, so
  // 2 per unit per step with raf=true and 1 with raf=false.
  {
    fsdp::FullyShardOptions o;
    o.comm_fusion = true;
    l1::ShardedMlp f(seed, o);
    for (bool raf : {true, false, true}) {
      f.root.set_reshard_after_forward(raf);
      const auto global = toy::global_batch(raf ? 107 : 108, kRows);
      f.root.zero_grad();
      fsdp::reset_collective_counters();
      at::Tensor loss = f.loss(mine(global));
      const std::string mis = numel_mismatch(f, "", !raf);
      BOOST_TEST(mis.empty(), "fused raf=" << raf << ": after forward: " << mis);
      loss.backward();
      const int64_t gathers = fsdp::collective_counters().total("all_gather");
      const int64_t expect = raf ? 2 * 3 : 3;
      BOOST_TEST(gathers == expect, "fused raf=" << raf << ": all-gathers per step " << gathers
                                                 << ", expected " << expect << " (3 units)");
      rep.check(std::string("fused raf=") + (raf ? "true" : "false") + ": grads vs single card",
                grad_err(f, ref_grads(seed, {global})), kGradTol);
    }
  }
  BOOST_TEST_MESSAGE("world size " << ws);
  rep.publish();
}

// ============================================================================
// L1-02: set_requires_all_reduce on a 2x2 HSDP mesh.
// ============================================================================
namespace {

struct Hsdp {
  fsdp::DeviceMesh mesh;
  int shard_index, replica_index;
  std::string replicate_group, shard_group;
};

Hsdp make_hsdp() {
  auto mesh = fsdp::init_device_mesh(spmd::device().type(), {2, 2}, {"replicate", "shard"});
  return {mesh, mesh.get_local_rank("shard"), mesh.get_local_rank("replicate"),
          mesh.get_group("replicate")->name(), mesh.get_group("shard")->name()};
}

// Per parameter (names starting with `only`): max |grad on replica 0 - grad
// on replica 1| of this rank's shard (an all-gather over the replicate
// group). Returns {min over params, max over params}.
std::pair<double, double> replica_gap(l1::ShardedMlp& m, const Hsdp& h, const std::string& only) {
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
    const double gap = l1::diff(out.narrow(0, 0, g.numel()), out.narrow(0, g.numel(), g.numel()));
    const double gap_or_nan = std::isnan(gap) ? l1::kInf : gap;
    lo = std::min(lo, std::isnan(gap) ? -1.0 : gap_or_nan);
    hi = std::max(hi, gap_or_nan);
  }
  return {lo, hi};
}

double hsdp_grad_err(l1::ShardedMlp& m, const Hsdp& h, const std::shared_ptr<toy::MlpImpl>& ref,
                     const std::string& only = "") {
  return l1::grad_err(m.module(), *ref, 2, h.shard_index, 1.0, only);
}

// This rank's batch: rank r (replica r/2) takes rows [2r, 2r+2) of 8.
toy::Batch hsdp_mine(const toy::Batch& global) { return toy::slice(global, spmd::rank(), 4); }
// A replica's share of the global batch: the rows of its two ranks.
toy::Batch replica_rows(const toy::Batch& global, int replica) {
  return toy::slice(global, replica, 2);
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_set_requires_all_reduce,  // L1-02
                     *spmd::needs_world_size(4, "a 2x2 (replicate, shard) mesh")) {
  l1::Report rep("L1-02");
  const Hsdp h = make_hsdp();
  fsdp::FullyShardOptions o;
  o.mesh = h.mesh;
  const int64_t seed = 21;
  l1::ShardedMlp m(seed, o);

  // Off (recurse): each replica keeps its own shard-group mean -- the
  // single-card grad of its half of the batch -- and replicas differ.
  {
    const auto global = toy::global_batch(201, kRows);
    m.root.set_requires_all_reduce(false);
    fsdp::reset_collective_counters();
    m.step(hsdp_mine(global));
    const auto c = fsdp::collective_counters();
    BOOST_TEST(c.total("all_reduce", h.replicate_group) == 0,
               "off: all-reduces on the replicate group: " << c.total("all_reduce", h.replicate_group));
    BOOST_TEST(c.total("reduce_scatter", h.shard_group) == kMlpParams,
               "off: reduce-scatters on the shard group: " << c.total("reduce_scatter", h.shard_group));
    rep.check("off: grads vs single card on the replica's half",
              hsdp_grad_err(m, h, ref_grads(seed, {replica_rows(global, h.replica_index)})),
              kGradTol);
    const auto gap = replica_gap(m, h, "");
    rep.check_differs("off: replica grads differ (every parameter)", gap.first, kReplicaTol);
  }
  m.root.zero_grad();
  BOOST_TEST(l1::all_grads_undefined(m.module()));

  // On: the all-reduce over the replicate dim makes replicas equal and equal
  // to the single-card grad of the whole batch.
  {
    const auto global = toy::global_batch(202, kRows);
    m.root.set_requires_all_reduce(true);
    fsdp::reset_collective_counters();
    m.step(hsdp_mine(global));
    const auto c = fsdp::collective_counters();
    BOOST_TEST(c.total("all_reduce", h.replicate_group) == kMlpParams,
               "on: all-reduces on the replicate group: " << c.total("all_reduce", h.replicate_group)
                                                          << ", expected " << kMlpParams);
    rep.check("on (after an off step + zero_grad): replicas equal", replica_gap(m, h, "").second,
              kReplicaTol);
    rep.check("on (after an off step + zero_grad): grads vs single card",
              hsdp_grad_err(m, h, ref_grads(seed, {global})), kGradTol);
  }
  m.root.zero_grad();

  // recurse=false on the root: only the root's own parameters (fc3) skip the
  // all-reduce; the nested units (fc1, fc2) keep all-reducing.
  {
    const auto global = toy::global_batch(203, kRows);
    m.root.set_requires_all_reduce(false, /*recurse=*/false);
    fsdp::reset_collective_counters();
    m.step(hsdp_mine(global));
    const auto c = fsdp::collective_counters();
    BOOST_TEST(c.total("all_reduce", h.replicate_group) == 4,
               "root-only off: all-reduces on the replicate group: "
                   << c.total("all_reduce", h.replicate_group) << ", expected 4 (fc1, fc2)");
    const auto full_ref = ref_grads(seed, {global});
    const auto half_ref = ref_grads(seed, {replica_rows(global, h.replica_index)});
    rep.check("root-only off: nested fc1 grads vs single card", hsdp_grad_err(m, h, full_ref, "fc1"),
              kGradTol);
    rep.check("root-only off: nested fc2 grads vs single card", hsdp_grad_err(m, h, full_ref, "fc2"),
              kGradTol);
    rep.check("root-only off: nested fc1 replicas equal", replica_gap(m, h, "fc1").second,
              kReplicaTol);
    rep.check("root-only off: nested fc2 replicas equal", replica_gap(m, h, "fc2").second,
              kReplicaTol);
    rep.check("root-only off: root fc3 grads vs single card on the replica's half",
              hsdp_grad_err(m, h, half_ref, "fc3"), kGradTol);
    rep.check_differs("root-only off: root fc3 replicas differ", replica_gap(m, h, "fc3").first,
                      kReplicaTol);
  }

  // Skipped all-reduces accumulate until re-enabled: off on batch A, then on
  // on batch B without zero_grad -> the single-card grad of A plus that of B.
  {
    l1::ShardedMlp a(seed, o);
    const auto ga = toy::global_batch(204, kRows), gb = toy::global_batch(205, kRows);
    a.root.set_requires_all_reduce(false);
    a.step(hsdp_mine(ga));
    a.root.set_requires_all_reduce(true);
    a.step(hsdp_mine(gb));
    rep.check("off then on, accumulated: replicas equal", replica_gap(a, h, "").second,
              kReplicaTol);
    rep.check("off then on, accumulated: grads vs single card (A + B)",
              hsdp_grad_err(a, h, ref_grads(seed, {ga, gb})), kGradTol);
  }
  rep.publish();
}

// ============================================================================
// L1-03: set_reduce_op_type("sum" / "avg"), switched mid-training under Adam.
// ============================================================================
namespace {
torch::optim::AdamParamState* adam_state(torch::optim::Adam& opt, const at::Tensor& p) {
  auto it = opt.state().find(fsdp::optimizer_state_key(opt, p));
  if (it == opt.state().end()) return nullptr;
  return static_cast<torch::optim::AdamParamState*>(it->second.get());
}
}  // namespace

BOOST_AUTO_TEST_CASE(test_set_reduce_op_type, *multi_rank()) {  // L1-03
  const int ws = spmd::world_size(), rank = spmd::rank();
  l1::Report rep("L1-03");
  const int64_t seed = 31;
  const double lr = 1e-2;
  l1::ShardedMlp m(seed, {});
  toy::Mlp ref(seed);
  torch::optim::Adam opt(m.model->parameters(), torch::optim::AdamOptions(lr));
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(lr));

  // The single-card run applies the gradient each mode produces: the mean
  // over ranks ("avg") is the global-batch gradient, the sum is ws times it.
  const std::vector<std::string> modes = {"sum", "sum", "avg", "avg", "sum", "avg"};
  double grad_worst_sum = 0, grad_worst_avg = 0, param_worst = 0, state_worst = 0;
  for (size_t k = 0; k < modes.size(); ++k) {
    const bool sum = modes[k] == "sum";
    if (k == 4) {
      // An invalid op is rejected and leaves the current mode ("avg") alone;
      // this step then switches to "sum" explicitly below.
      l1::expect_error<fsdp::ArgumentError>([&] { m.root.set_reduce_op_type("max"); },
                                            "reduce_op", "set_reduce_op_type(\"max\")");
    }
    m.root.set_reduce_op_type(modes[k]);
    const auto global = toy::global_batch(300 + static_cast<int64_t>(k), kRows);

    opt.zero_grad();
    m.step(mine(global));
    ref_opt.zero_grad();
    l1::ref_backward(ref, global);
    const double scale = sum ? ws : 1.0;
    const double ge = l1::grad_err(m.module(), *ref, ws, rank, scale);
    (sum ? grad_worst_sum : grad_worst_avg) = std::max(sum ? grad_worst_sum : grad_worst_avg, ge);
    BOOST_TEST(ge <= kGradTol, "step " << k << " (" << modes[k] << "): grad error " << ge);

    {
      at::NoGradGuard ng;
      for (auto& p : ref->parameters()) p.mutable_grad().mul_(scale);
    }
    opt.step();
    ref_opt.step();
    const double pe = l1::data_err(m.module(), *ref, ws, rank);
    param_worst = std::max(param_worst, pe);
    BOOST_TEST(pe <= kGradTol, "step " << k << " (" << modes[k] << "): param error " << pe);

    // Adam's moments of each shard are the rows of the single-card moments.
    auto ref_params = ref->named_parameters();
    for (const auto& item : m.model->named_parameters()) {
      auto* s = adam_state(opt, item.value());
      auto* rs = adam_state(ref_opt, *ref_params.find(item.key()));
      if (s == nullptr || rs == nullptr) {
        BOOST_ERROR("step " << k << ": no Adam state for " << item.key());
        state_worst = l1::kInf;
        continue;
      }
      BOOST_TEST(s->step() == rs->step());
      const double e = std::max(l1::diff(s->exp_avg(), l1::my_rows(rs->exp_avg(), ws, rank)),
                                l1::diff(s->exp_avg_sq(), l1::my_rows(rs->exp_avg_sq(), ws, rank)));
      state_worst = std::max(state_worst, e);
      BOOST_TEST(e <= kGradTol, "step " << k << ": Adam state of " << item.key() << " error " << e);
    }
  }
  rep.check("\"sum\": grad vs ref_grad * world_size", grad_worst_sum, kGradTol);
  rep.check("\"avg\": grad vs ref_grad", grad_worst_avg, kGradTol);
  rep.check("params after Adam steps across mode switches vs single card", param_worst, kGradTol);
  rep.check("Adam exp_avg / exp_avg_sq vs single card", state_worst, kGradTol);
  rep.publish();
}

// ============================================================================
// L1-04: zero_grad after accumulated steps.
// ============================================================================
BOOST_AUTO_TEST_CASE(test_zero_grad, *multi_rank()) {  // L1-04
  l1::Report rep("L1-04");
  const int64_t seed = 41;
  const int n_steps = 3;

  for (bool synced : {true, false}) {
    const std::string tag = synced ? "synced accumulation" : "no-sync accumulation";
    l1::ShardedMlp m(seed, {});
    std::vector<toy::Batch> batches;
    if (!synced) m.root.set_requires_gradient_sync(false);
    for (int k = 0; k < n_steps; ++k) {
      batches.push_back(toy::global_batch(400 + k, kRows));
      m.step(mine(batches.back()));
    }
    if (synced) {
      rep.check(tag + ": accumulated grads vs single card (sum of " + std::to_string(n_steps) +
                    " steps)",
                grad_err(m, ref_grads(seed, batches)), kGradTol);
    }
    std::vector<at::Tensor> snapshot;
    for (const auto& p : m.model->parameters()) snapshot.push_back(p.detach().clone());

    // zero_grad on a nested unit touches only that unit.
    if (synced) {
      m.fc1.zero_grad();
      BOOST_TEST(!m.model->fc1->weight.grad().defined());
      BOOST_TEST(!m.model->fc1->bias.grad().defined());
      BOOST_TEST(m.model->fc2->weight.grad().defined(), "fc1.zero_grad() dropped fc2's grad");
      BOOST_TEST(m.model->fc3->weight.grad().defined(), "fc1.zero_grad() dropped fc3's grad");
    }
    m.root.zero_grad();
    BOOST_TEST(l1::all_grads_undefined(m.module()), tag << ": a grad survived zero_grad()");
    const auto params = m.model->parameters();
    double data_change = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      data_change = std::max(data_change, l1::diff(params[i], snapshot[i]));
    }
    BOOST_TEST(data_change == 0.0, tag << ": zero_grad() changed parameter data by " << data_change);

    // The next synchronised backward produces one step's fresh gradient.
    m.root.set_requires_gradient_sync(true);
    const auto next = toy::global_batch(409, kRows);
    m.step(mine(next));
    rep.check(tag + ": grads after zero_grad + one step vs single card of that step",
              grad_err(m, ref_grads(seed, {next})), kGradTol);
  }
  rep.publish();
}

// ============================================================================
// L1-05: reshard() / unshard() lifecycle.
// ============================================================================
BOOST_AUTO_TEST_CASE(test_manual_reshard_unshard_lifecycle, *multi_rank()) {  // L1-05
  const int ws = spmd::world_size(), rank = spmd::rank();
  l1::Report rep("L1-05");
  const int64_t seed = 51;
  l1::ShardedMlp m(seed, {});
  toy::Mlp ref(seed);  // full single-card weights

  auto full_err = [&](const std::string& prefix) {
    double worst = 0;
    auto ref_params = ref->named_parameters();
    for (const auto& item : m.model->named_parameters()) {
      if (item.key().rfind(prefix, 0) != 0) continue;
      worst = std::max(worst, l1::diff(item.value(), *ref_params.find(item.key())));
    }
    return worst;
  };
  auto expect_numel = [&](const std::string& prefix, bool full, const std::string& when) {
    const std::string mis = numel_mismatch(m, prefix, full);
    BOOST_TEST(mis.empty(), when << ": " << mis);
  };

  expect_numel("", false, "after fully_shard");
  // reshard() on sharded units: idempotent, no collectives.
  fsdp::reset_collective_counters();
  BOOST_CHECK_NO_THROW(m.root.reshard());
  BOOST_CHECK_NO_THROW(m.root.reshard());
  BOOST_CHECK_NO_THROW(m.fc1.reshard());
  BOOST_TEST(fsdp::collective_counters().sequence.empty(), "reshard() of a sharded unit communicated");
  expect_numel("", false, "after repeated reshard()");

  // unshard() twice: the root's own parameters (fc3) become full, once.
  fsdp::reset_collective_counters();
  BOOST_CHECK_NO_THROW(m.root.unshard());
  BOOST_CHECK_NO_THROW(m.root.unshard());
  const int64_t ag = fsdp::collective_counters().total("all_gather");
  BOOST_TEST(ag == 2, "two unshard() calls issued " << ag << " all-gathers, expected 2 (fc3)");
  expect_numel("fc3", true, "root after unshard() x2");
  expect_numel("fc1", false, "fc1 after root.unshard()");
  rep.check("root unshard(): fc3 data vs full single-card weights", full_err("fc3"), 0.0);

  // Sync unshard of a nested unit, then reshard everything, twice.
  BOOST_CHECK_NO_THROW(m.fc1.unshard());
  expect_numel("fc1", true, "fc1 after unshard()");
  rep.check("fc1 unshard(): data vs full single-card weights", full_err("fc1"), 0.0);
  for (int i = 0; i < 2; ++i) {
    BOOST_CHECK_NO_THROW(m.root.reshard());
    BOOST_CHECK_NO_THROW(m.fc1.reshard());
  }
  expect_numel("", false, "after reshard() x2");
  rep.check("after reshard(): shards vs single-card rows",
            l1::data_err(m.module(), *ref, ws, rank), 0.0);

  // unshard(async_op=true): read only after handle.wait(); wait is idempotent.
  fsdp::UnshardHandle h2 = m.fc2.unshard(/*async_op=*/true);
  fsdp::UnshardHandle h3 = m.root.unshard(/*async_op=*/true);
  BOOST_CHECK_NO_THROW(h2.wait());
  BOOST_CHECK_NO_THROW(h3.wait());
  BOOST_CHECK_NO_THROW(h2.wait());
  expect_numel("fc2", true, "fc2 after unshard(async) + wait()");
  expect_numel("fc3", true, "fc3 after unshard(async) + wait()");
  rep.check("unshard(async) + wait(): fc2 data vs full single-card weights", full_err("fc2"), 0.0);
  rep.check("unshard(async) + wait(): fc3 data vs full single-card weights", full_err("fc3"), 0.0);
  BOOST_CHECK_NO_THROW(m.fc1.unshard(/*async_op=*/true).wait());
  expect_numel("fc1", true, "fc1 after unshard(async).wait()");

  // An async unshard then reshard() without waiting: no throw, back to shards.
  m.fc1.reshard();
  (void)m.fc1.unshard(/*async_op=*/true);
  BOOST_CHECK_NO_THROW(m.fc1.reshard());
  expect_numel("fc1", false, "fc1 after unshard(async) + reshard()");

  // Training from a manually unsharded state: grads still match single card,
  // and the step leaves everything sharded.
  const auto global = toy::global_batch(501, kRows);
  m.step(mine(global));
  expect_numel("", false, "after a step from manually unsharded units");
  rep.check("grads after the lifecycle vs single card", grad_err(m, ref_grads(seed, {global})),
            kGradTol);
  m.root.reshard();
  m.fc2.reshard();
  expect_numel("", false, "after final reshard()");
  rep.check("shards after the lifecycle vs single-card rows",
            l1::data_err(m.module(), *ref, ws, rank), 0.0);
  rep.publish();
}

// ============================================================================
// L1-09: fully_shard over a list of modules.
// ============================================================================
BOOST_AUTO_TEST_CASE(test_fully_shard_list_input, *multi_rank()) {  // L1-09
  const int ws = spmd::world_size();
  l1::Report rep("L1-09");
  const int64_t seed = 91;
  toy::Mlp model(seed);
  model->to(spmd::device());
  const std::vector<ModulePtr> pair = {model->fc1.ptr(), model->fc2.ptr()};
  std::vector<fsdp::FSDPModule> list = fsdp::fully_shard(pair);
  fsdp::FSDPModule root = fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(model.ptr()));
  fsdp::Sharded<toy::Mlp> net(model);

  BOOST_TEST_REQUIRE(list.size() == 2u);
  // Both elements expose the FSDPModule interface.
  for (size_t i = 0; i < 2; ++i) {
    BOOST_TEST(list[i].module().get() == pair[i].get(),
               "list[" << i << "].module() is not the module it was applied to");
    BOOST_TEST(!list[i].is_root());
    BOOST_TEST(list[i].mesh().size() == ws);
    BOOST_TEST(list[i].sharded_parameters().size() == 4u);
  }
  BOOST_TEST(root.is_root());

  auto run = [&](int64_t bseed, bool full_after_fwd, const std::string& label) {
    const auto global = toy::global_batch(bseed, kRows);
    root.zero_grad();
    const auto b = mine(global);
    const auto dev = spmd::device();
    fsdp::reset_collective_counters();
    at::Tensor loss = toy::mse(net(b.x.to(dev)), b.y.to(dev));
    for (const char* prefix : {"fc1", "fc2"}) {
      std::string mis;
      l1::numel_state(*model, prefix, full_after_fwd, ws, spmd::rank(), &mis);
      BOOST_TEST(mis.empty(), label << ": after forward: " << mis);
    }
    loss.backward();
    BOOST_TEST(l1::all_grads_finite(*model), label << ": a grad is missing or not finite");
    rep.check(label + ": grads vs single card",
              l1::grad_err(*model, *ref_grads(seed, {global}), ws, spmd::rank()), kGradTol);
    return fsdp::collective_counters().total("all_gather");
  };

  const int64_t ag_default = run(901, false, "defaults");
  // L1-09's "independent control, no interference", with one unit shared by
  // the list's modules (FSDP2's and hyper-parallel's semantics): a control
  // set through either element acts on the shared unit -- both modules --
  // the same way, a later call through the other element takes over, and
  // training stays equal to the single card's whichever element was used.
  list[0].set_reshard_after_forward(false);
  const int64_t ag_kept_via_0 = run(902, true, "raf=false via list[0]");
  list[1].set_reshard_after_forward(true);
  const int64_t ag_resharded_via_1 = run(903, false, "raf=true via list[1]");
  list[1].set_reshard_after_forward(false);
  const int64_t ag_kept_via_1 = run(906, true, "raf=false via list[1]");
  list[0].set_reshard_after_forward(true);
  BOOST_TEST(ag_kept_via_0 == ag_kept_via_1,
             "raf=false via list[0]: " << ag_kept_via_0 << " all-gathers, via list[1]: "
                                       << ag_kept_via_1);
  BOOST_TEST(ag_resharded_via_1 == ag_default);
  // Keeping the shared unit's parameters after forward saves its re-gather
  // in backward: fewer all-gathers than resharding.
  BOOST_TEST(ag_kept_via_0 < ag_default, "raf=false did not save an all-gather: "
                                             << ag_kept_via_0 << " vs " << ag_default);
  list[0].set_reduce_op_type("sum");
  list[1].set_reduce_op_type("avg");
  run(904, false, "\"sum\" via list[0] then \"avg\" via list[1]");
  // unshard through one element, reshard through the other.
  list[1].unshard();
  {
    std::string mis;
    BOOST_TEST(l1::numel_state(*model, "fc1", true, ws, spmd::rank(), &mis), mis);
    BOOST_TEST(l1::numel_state(*model, "fc2", true, ws, spmd::rank(), &mis), mis);
  }
  list[0].reshard();
  {
    std::string mis;
    BOOST_TEST(l1::numel_state(*model, "", false, ws, spmd::rank(), &mis), mis);
  }
  list[1].zero_grad();
  BOOST_TEST(!model->fc1->weight.grad().defined());
  BOOST_TEST(!model->fc2->weight.grad().defined());
  BOOST_TEST(model->fc3->weight.grad().defined(), "list[1].zero_grad() dropped the root's grads");

  // One unit over both modules: with comm_fusion, one all-gather per pass.
  {
    toy::Mlp fused(seed);
    fused->to(spmd::device());
    fsdp::FullyShardOptions o;
    o.comm_fusion = true;
    auto flist = fsdp::fully_shard(std::vector<ModulePtr>{fused->fc1.ptr(), fused->fc2.ptr()}, o);
    fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(fused.ptr()), o);
    fsdp::Sharded<toy::Mlp> fnet(fused);
    const auto global = toy::global_batch(905, kRows);
    const auto b = mine(global);
    fsdp::reset_collective_counters();
    toy::mse(fnet(b.x.to(spmd::device())), b.y.to(spmd::device())).backward();
    const int64_t ag = fsdp::collective_counters().total("all_gather");
    // The list unit gathers in forward and again in backward; the root
    // keeps its parameters from forward to backward (the default).
    BOOST_TEST(ag == 3, "fused list unit + root: all-gathers per step "
                            << ag << ", expected 3 (the list unit twice, the root once)");
    rep.check("fused list: grads vs single card",
              l1::grad_err(*fused, *ref_grads(seed, {global}), ws, spmd::rank()), kGradTol);
  }
  rep.publish();
}

// ============================================================================
// Existing rows of the plan for this file.
// ============================================================================
BOOST_AUTO_TEST_CASE(test_fully_shard_none_mesh, *multi_rank()) {  // existing: mesh=None
  const int ws = spmd::world_size();
  l1::Report rep("none_mesh");
  l1::ShardedMlp m(61, {});
  for (auto* u : {&m.fc1, &m.fc2, &m.root}) {
    BOOST_TEST(u->mesh().ndim() == 1);
    BOOST_TEST(u->mesh().size() == ws);
    std::vector<int> all(ws);
    for (int r = 0; r < ws; ++r) all[r] = r;
    BOOST_TEST(u->mesh().world_ranks() == all);
  }
  const std::string group = m.root.mesh().get_group(0)->name();
  const auto global = toy::global_batch(601, kRows);
  fsdp::reset_collective_counters();
  m.step(mine(global));
  const auto c = fsdp::collective_counters();
  BOOST_TEST(c.total("all_gather", group) == kMlpGathersPerStep);
  BOOST_TEST(c.total("reduce_scatter", group) == kMlpParams);
  BOOST_TEST(c.total("all_gather") == c.total("all_gather", group));
  rep.check("grads vs single card", grad_err(m, ref_grads(61, {global})), kGradTol);
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_fully_shard_explicit_1d_mesh, *multi_rank()) {  // existing: mesh=DeviceMesh
  const int ws = spmd::world_size();
  l1::Report rep("explicit_1d_mesh");
  auto mesh = fsdp::init_device_mesh(spmd::device().type(), {ws}, {"dp"});
  fsdp::FullyShardOptions o;
  o.mesh = mesh;
  l1::ShardedMlp m(62, o);
  BOOST_TEST(m.root.mesh().dim_names() == std::vector<std::string>{"dp"});
  BOOST_TEST(m.fc1.mesh().dim_names() == std::vector<std::string>{"dp"});
  const std::string group = mesh.get_group("dp")->name();
  const auto global = toy::global_batch(602, kRows);
  fsdp::reset_collective_counters();
  m.step(mine(global));
  const auto c = fsdp::collective_counters();
  BOOST_TEST(c.total("all_gather", group) == kMlpGathersPerStep);
  BOOST_TEST(c.total("reduce_scatter", group) == kMlpParams);
  BOOST_TEST(c.total("all_reduce") == 0);
  for (const auto& [name, dt] : m.root.sharded_parameters()) {
    BOOST_TEST(dt.placements().size() == 1u, name);
    BOOST_TEST(dt.placements().at(0).to_string() == "Shard(0)", name);
  }
  rep.check("grads vs single card", grad_err(m, ref_grads(62, {global})), kGradTol);
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_fully_shard_2d_mesh,  // existing: HSDP 2-D mesh
                     *spmd::needs_world_size(4, "a 2x2 (replicate, shard) mesh")) {
  l1::Report rep("2d_mesh");
  const Hsdp h = make_hsdp();
  fsdp::FullyShardOptions o;
  o.mesh = h.mesh;
  l1::ShardedMlp m(63, o);
  const auto global = toy::global_batch(603, kRows);
  fsdp::reset_collective_counters();
  m.step(hsdp_mine(global));
  const auto c = fsdp::collective_counters();
  BOOST_TEST(c.total("all_gather", h.shard_group) == kMlpGathersPerStep);
  BOOST_TEST(c.total("all_gather") == kMlpGathersPerStep);
  BOOST_TEST(c.total("reduce_scatter", h.shard_group) == kMlpParams);
  BOOST_TEST(c.total("all_reduce", h.replicate_group) == kMlpParams);
  for (const auto& [name, dt] : m.root.sharded_parameters()) {
    BOOST_TEST(dt.placements().size() == 2u, name);
    BOOST_TEST(dt.placements().at(0).to_string() == "Replicate()", name);
    BOOST_TEST(dt.placements().at(1).to_string() == "Shard(0)", name);
  }
  rep.check("grads vs single card", hsdp_grad_err(m, h, ref_grads(63, {global})), kGradTol);
  rep.check("replicas equal", replica_gap(m, h, "").second, kReplicaTol);
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_reshard_after_forward_static, *multi_rank()) {  // existing: raf=True/False
  l1::Report rep("reshard_after_forward_static");
  for (bool raf : {true, false}) {
    const std::string tag = std::string("raf=") + (raf ? "true" : "false");
    fsdp::FullyShardOptions o;
    o.reshard_after_forward = raf;
    l1::ShardedMlp m(64, o);
    for (int64_t k = 0; k < 2; ++k) {
      const auto global = toy::global_batch(640 + k, kRows);
      m.root.zero_grad();
      fsdp::reset_collective_counters();
      at::Tensor loss = m.loss(mine(global));
      const std::string mis = numel_mismatch(m, "", !raf);
      BOOST_TEST(mis.empty(), tag << ": after forward: " << mis);
      loss.backward();
      const int64_t ag = fsdp::collective_counters().total("all_gather");
      const int64_t expect = raf ? 2 * kMlpParams : kMlpParams;
      BOOST_TEST(ag == expect, tag << ": all-gathers per step " << ag << ", expected " << expect);
      const std::string mis2 = numel_mismatch(m, "", false);
      BOOST_TEST(mis2.empty(), tag << ": after backward: " << mis2);
      rep.check(tag + ": grads vs single card", grad_err(m, ref_grads(64, {global})), kGradTol);
    }
  }
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_set_requires_gradient_sync, *multi_rank()) {  // existing
  l1::Report rep("requires_gradient_sync");
  const int64_t seed = 65;
  l1::ShardedMlp m(seed, {});
  const auto g1 = toy::global_batch(651, kRows), g2 = toy::global_batch(652, kRows);

  m.root.set_requires_gradient_sync(false);
  fsdp::reset_collective_counters();
  m.step(mine(g1));
  auto c = fsdp::collective_counters();
  BOOST_TEST(c.total("reduce_scatter") == 0, "unsynced backward reduce-scattered "
                                                 << c.total("reduce_scatter") << " times");
  BOOST_TEST(c.total("all_reduce") == 0);
  std::string mis = numel_mismatch(m, "", false);
  BOOST_TEST(mis.empty(), "after an unsynced backward: " << mis);
  // Unsynced: each rank holds the full gradient of its own slice.
  {
    const auto local_ref = ref_grads(seed, {mine(g1)});
    auto ref_params = local_ref->named_parameters();
    double worst = 0;
    size_t seen = 0;
    for (auto& [unit, prefix] : {std::pair<fsdp::FSDPModule*, std::string>{&m.fc1, "fc1."},
                                 {&m.fc2, "fc2."}, {&m.root, ""}}) {
      for (const auto& [name, g] : unit->unsynced_grads()) {
        const at::Tensor* r = ref_params.find(prefix + name);
        worst = std::max(worst, r == nullptr ? l1::kInf : l1::diff(g, r->grad()));
        ++seen;
      }
    }
    BOOST_TEST(seen == static_cast<size_t>(kMlpParams));
    rep.check("unsynced_grads() vs single card on this rank's slice", worst, kGradTol);
  }

  // The synchronised backward reduces each rank's accumulated sum: with
  // "avg" the mean over ranks of (g1_r + g2_r) = single-card g1 + g2.
  m.root.set_requires_gradient_sync(true);
  fsdp::reset_collective_counters();
  m.step(mine(g2));
  c = fsdp::collective_counters();
  BOOST_TEST(c.total("reduce_scatter") == kMlpParams);
  rep.check("synced after an unsynced micro-step: grads vs single card (g1 + g2)",
            grad_err(m, ref_grads(seed, {g1, g2})), kGradTol);

  // recurse=false on a nested unit: only fc1 skips its reduction.
  m.root.zero_grad();
  m.fc1.set_requires_gradient_sync(false, /*recurse=*/false);
  const auto g3 = toy::global_batch(653, kRows);
  fsdp::reset_collective_counters();
  m.step(mine(g3));
  c = fsdp::collective_counters();
  BOOST_TEST(c.total("reduce_scatter") == kMlpParams - 2);
  BOOST_TEST(!m.model->fc1->weight.grad().defined());
  rep.check("fc1 unsynced (recurse=false): fc2/fc3 grads vs single card",
            std::max(grad_err(m, ref_grads(seed, {g3}), 1.0, "fc2"),
                     grad_err(m, ref_grads(seed, {g3}), 1.0, "fc3")),
            kGradTol);
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_forward_prefetch_order, *multi_rank()) {  // existing
  l1::Report rep("forward_prefetch");
  const int64_t seed = 66;
  const auto global = chain_batch(661);
  const auto b = mine(global);
  // "first step": no previous forward to learn the order from, so nothing
  // is prefetched; "explicit": b0 -> b1 -> b2; "implicit": the default from
  // the second step on (the unit that ran next in the previous step);
  // "disabled": explicit empty lists, second step.
  for (const std::string tag : {"first step", "explicit", "implicit", "disabled"}) {
    ShardedChain c(seed);
    if (tag == "explicit") {
      c.u[0].set_modules_to_forward_prefetch({c.u[1]});
      c.u[1].set_modules_to_forward_prefetch({c.u[2]});
    }
    if (tag == "implicit" || tag == "disabled") {
      if (tag == "disabled") {
        for (auto& u : c.u) u.set_modules_to_forward_prefetch({});
        c.root.set_modules_to_forward_prefetch({});
      }
      // A first step (forward and backward) teaches the forward order; its
      // gradients are dropped so the checked step is the same as the others.
      c.loss(b).backward();
      c.root.zero_grad();
    }
    const bool prefetch = tag == "explicit" || tag == "implicit";
    fsdp::reset_collective_counters();
    at::Tensor loss = c.loss(b);
    const auto fwd = fsdp::collective_counters();
    for (int i = 0; i < 2; ++i) {
      const int64_t next_ag = l1::find_record(fwd, "all_gather", block_gather_bytes(i + 1));
      const int64_t done = l1::find_record(fwd, "broadcast", marker_bytes(i));
      BOOST_TEST(next_ag >= 0);
      BOOST_TEST(done >= 0);
      if (prefetch) {
        BOOST_TEST(next_ag < done, tag << ": b" << i + 1 << "'s all-gather (#" << next_ag
                                       << ") not issued before b" << i << "'s forward compute "
                                       << "finished (#" << done << "): " << l1::describe_sequence(fwd));
      } else {
        BOOST_TEST(next_ag > done, tag << ": b" << i + 1 << "'s all-gather (#" << next_ag
                                       << ") issued before b" << i << "'s forward finished (#"
                                       << done << "): " << l1::describe_sequence(fwd));
      }
    }
    BOOST_TEST(fwd.total("all_gather") == 5, tag << ": forward all-gathers "
                                                 << fwd.total("all_gather") << ", expected 5");
    loss.backward();
    rep.check(tag + ": grads vs single card", chain_grad_err(c, seed, global), kGradTol);
  }
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_backward_prefetch_order, *multi_rank()) {  // existing
  l1::Report rep("backward_prefetch");
  const int64_t seed = 67;
  const auto global = chain_batch(671);
  const auto b = mine(global);
  // "none": explicit empty lists; "explicit": b2 -> b1 -> b0; "implicit":
  // implicit_backward_prefetch=true (reverse forward order); "default":
  // implicit on CUDA, none on the CPU.
  const bool default_prefetches = spmd::device().is_cuda();
  for (const std::string mode : {"none", "explicit", "implicit", "default"}) {
    fsdp::FullyShardOptions options;
    if (mode == "implicit") options.implicit_backward_prefetch = true;
    ShardedChain c(seed, options);
    const bool prefetches = mode == "default" ? default_prefetches : mode != "none";
    if (mode == "none") {
      for (auto& u : c.u) u.set_modules_to_backward_prefetch({});
      c.root.set_modules_to_backward_prefetch({});
    } else if (mode == "explicit") {
      c.u[2].set_modules_to_backward_prefetch({c.u[1]});
      c.u[1].set_modules_to_backward_prefetch({c.u[0]});
    }
    at::Tensor loss = c.loss(b);
    fsdp::reset_collective_counters();
    loss.backward();
    const auto bwd = fsdp::collective_counters();
    for (int i = 2; i >= 1; --i) {
      const int64_t prev_ag = l1::find_record(bwd, "all_gather", block_gather_bytes(i - 1));
      const int64_t done = l1::find_record(bwd, "broadcast", marker_bytes(kBackwardMarker + i));
      BOOST_TEST(prev_ag >= 0);
      BOOST_TEST(done >= 0);
      if (!prefetches) {
        BOOST_TEST(prev_ag > done, mode << ": b" << i - 1 << "'s all-gather (#" << prev_ag
                                        << ") issued before b" << i << "'s backward finished (#"
                                        << done << "): " << l1::describe_sequence(bwd));
      } else {
        BOOST_TEST(prev_ag < done, mode << ": b" << i - 1 << "'s all-gather (#" << prev_ag
                                        << ") not issued before b" << i << "'s backward compute "
                                        << "finished (#" << done << "): " << l1::describe_sequence(bwd));
      }
    }
    // The three blocks re-gather; the root keeps its parameters from
    // forward (reshard_after_forward unset, the default).
    BOOST_TEST(bwd.total("all_gather") == 3, mode << ": backward all-gathers "
                                                  << bwd.total("all_gather") << ", expected 3");
    rep.check(mode + ": grads vs single card", chain_grad_err(c, seed, global), kGradTol);
  }
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_set_is_last_backward, *multi_rank()) {  // existing
  l1::Report rep("is_last_backward");
  const int64_t seed = 68;
  // The checks read the sharded gradients between a forward and its
  // backward, so the root must reshard after forward too.
  fsdp::FullyShardOptions o;
  o.reshard_after_forward = true;
  l1::ShardedMlp m(seed, o);
  const auto g1 = toy::global_batch(681, kRows), g2 = toy::global_batch(682, kRows),
             g3 = toy::global_batch(683, kRows);

  // finish_pending_reductions() lands them.
  m.root.set_is_last_backward(false);
  m.step(mine(g1));
  BOOST_TEST_MESSAGE("is_last_backward=false: fc1.weight grad defined right after backward: "
                     << m.model->fc1->weight.grad().defined());
  BOOST_CHECK_NO_THROW(m.root.finish_pending_reductions());
  BOOST_CHECK_NO_THROW(m.root.finish_pending_reductions());
  rep.check("finish_pending_reductions(): grads vs single card",
            grad_err(m, ref_grads(seed, {g1})), kGradTol);

  // The next forward lands them.
  m.root.zero_grad();
  m.step(mine(g2));
  at::Tensor loss = m.loss(mine(g3));
  rep.check("next forward: grads vs single card", grad_err(m, ref_grads(seed, {g2})), kGradTol);
  m.root.set_is_last_backward(true);
  loss.backward();
  rep.check("then a last backward: grads vs single card (g2 + g3)",
            grad_err(m, ref_grads(seed, {g2, g3})), kGradTol);
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_world_size_one_no_collectives,  // existing
                     *spmd::needs_world_size(1, "run the executable with mpiexec -n 1")) {
  l1::Report rep("world_size_one");
  l1::ShardedMlp m(69, {});
  const auto global = toy::global_batch(691, kRows);
  fsdp::reset_collective_counters();
  m.step(global);
  BOOST_TEST(fsdp::collective_counters().sequence.empty(),
             "world size 1 issued " << fsdp::collective_counters().sequence.size()
                                    << " collectives");
  rep.check("grads vs single card", grad_err(m, ref_grads(69, {global})), kGradTol);
  rep.publish();
}

// ============================================================================
// Argument and state errors: typed exceptions naming the argument.
// ============================================================================
BOOST_AUTO_TEST_CASE(test_fully_shard_twice_raises) {
  l1::Report rep("errors");
  const int64_t seed = 81;
  l1::ShardedMlp m(seed, {});
  l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(m.model->fc1); }, "module",
                                        "fully_shard(fc1) twice");
  l1::expect_error<fsdp::ArgumentError>(
      [&] { fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(m.model.ptr())); },
      "module", "fully_shard(root) twice");
  // The model still trains correctly.
  const auto global = toy::global_batch(811, kRows);
  m.step(mine(global));
  rep.check("grads after the rejected calls vs single card",
            grad_err(m, ref_grads(seed, {global})), kGradTol);
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_fully_shard_module_without_params_raises) {
  torch::nn::ReLU relu;
  l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(relu); }, "module",
                                        "fully_shard(ReLU)");
}

BOOST_AUTO_TEST_CASE(test_fully_shard_mesh_ndim_gt_2_raises,
                     *spmd::needs_even_world_size("a (2, N/2) mesh")) {
  const int ws = spmd::world_size();
  l1::Report rep("errors");
  auto mesh3 = fsdp::init_device_mesh(spmd::device().type(), {2, 1, ws / 2}, {"a", "b", "c"});
  toy::Mlp model(82);
  model->to(spmd::device());
  fsdp::FullyShardOptions o;
  o.mesh = mesh3;
  l1::expect_error<fsdp::MeshError>(
      [&] { fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(model.ptr()), o); },
      "mesh", "fully_shard with a 3-D mesh");
  toy::Mlp ref(82);
  rep.check("module untouched by the rejected call", l1::data_err(*model, *ref, 1, 0), 0.0);
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_shard_placement_fn_invalid_raises) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  l1::Report rep("errors");
  auto fn_for = [](std::string target, fsdp::Placement p) -> fsdp::ShardPlacementFn {
    return [target, p](const std::string& name, const at::Tensor&) -> std::optional<fsdp::Placement> {
      if (name == target) return p;
      return std::nullopt;
    };
  };
  auto make = [] {
    at::manual_seed(83);
    torch::nn::Linear lin(15, 7);
    lin->to(spmd::device());
    return lin;
  };
  bool all_untouched = true;
  auto untouched = [&](torch::nn::Linear& lin, const std::string& label) {
    at::manual_seed(83);
    torch::nn::Linear ref(15, 7);
    const double e = std::max(l1::diff(lin->weight, ref->weight), l1::diff(lin->bias, ref->bias));
    all_untouched = rep.check(label + ": module untouched by the rejected call", e, 0.0) &&
                    all_untouched;
  };

  {  // Shard(d) out of range for the weight (2-D) and for the bias (1-D).
    for (int64_t d : {2, -3}) {
      auto lin = make();
      fsdp::FullyShardOptions o;
      o.shard_placement_fn = fn_for("weight", fsdp::Placement::Shard(d));
      l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(lin, o); },
                                            "shard_placement_fn",
                                            "Shard(" + std::to_string(d) + ") on weight");
      untouched(lin, "Shard(" + std::to_string(d) + ") on weight");
    }
    // The bad placement on the second parameter: the first must not have
    // been sharded by the failed call.
    auto lin = make();
    fsdp::FullyShardOptions o;
    o.shard_placement_fn = fn_for("bias", fsdp::Placement::Shard(1));
    l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(lin, o); },
                                          "shard_placement_fn", "Shard(1) on the 1-D bias");
    untouched(lin, "Shard(1) on the 1-D bias");
  }
  if (15 % ws != 0) {  // Shard(1) on a dim not divisible by the shard group (15 columns).
    auto lin = make();
    fsdp::FullyShardOptions o;
    o.shard_placement_fn = fn_for("weight", fsdp::Placement::Shard(1));
    l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(lin, o); },
                                          "shard_placement_fn", "uneven Shard(1) on weight");
    untouched(lin, "uneven Shard(1) on weight");
  }
  {  // A Partial placement is not a parameter placement.
    auto lin = make();
    fsdp::FullyShardOptions o;
    o.shard_placement_fn = fn_for("bias", fsdp::Placement::Partial());
    l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(lin, o); },
                                          "shard_placement_fn", "Partial() on bias");
    untouched(lin, "Partial() on bias");

    // After the rejected calls, a valid fully_shard of the same module works
    // (not attempted when a rejected call already altered a module: its
    // shards would be taken for full parameters).
    if (l1::world_max(all_untouched ? 0.0 : 1.0) != 0.0) {
      BOOST_ERROR("a rejected fully_shard altered the module; not re-sharding it");
      rep.publish();
      return;
    }
    fsdp::Sharded<torch::nn::Linear> net = fsdp::fully_shard(lin);
    const auto global = toy::global_batch(831, kRows, 15, 7);
    const auto b = mine(global);
    toy::mse(net(b.x.to(spmd::device())), b.y.to(spmd::device())).backward();
    at::manual_seed(83);
    torch::nn::Linear ref(15, 7);
    toy::mse(ref(global.x), global.y).backward();
    rep.check("fully_shard after the rejected calls: grads vs single card",
              l1::grad_err(*lin, *ref, ws, rank), kGradTol);
  }
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_comm_fusion_mixed_dtypes_raises) {
  // comm_fusion needs one compute dtype per unit: a float32 layer followed by
  // a float64 layer is rejected, and the module is left as it was.
  l1::Report rep("errors");
  auto make = [] {
    at::manual_seed(87);
    torch::nn::Sequential seq(torch::nn::Linear(15, 7), torch::nn::Linear(7, 3));
    seq[1]->to(at::kDouble);
    seq->to(spmd::device());
    return seq;
  };
  auto seq = make();
  fsdp::FullyShardOptions o;
  o.comm_fusion = true;
  l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(seq, o); }, "comm_fusion",
                                        "comm_fusion over float32 + float64 parameters");
  auto ref = make();
  rep.check("module untouched by the rejected call", l1::data_err(*seq, *ref, 1, 0), 0.0);
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_ignored_and_replicated_param_raises) {
  torch::nn::Linear lin(15, 7);
  fsdp::FullyShardOptions o;
  o.ignored_params = {lin->weight};
  o.replicate_params = {lin->weight};
  l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(lin, o); }, "replicate_params",
                                        "weight both ignored and replicated");
  BOOST_TEST(lin->weight.numel() == 7 * 15);
}

BOOST_AUTO_TEST_CASE(test_set_reduce_op_type_invalid_raises) {
  l1::ShardedMlp m(84, {});
  for (const std::string op : {"max", "mean", "SUM", ""}) {
    l1::expect_error<fsdp::ArgumentError>([&] { m.root.set_reduce_op_type(op); }, "reduce_op",
                                          "set_reduce_op_type(\"" + op + "\")");
  }
}

BOOST_AUTO_TEST_CASE(test_set_gradient_scaling_factor) {
  l1::Report rep("scaling_factor");
  const int64_t seed = 85;
  l1::ShardedMlp m(seed, {});
  for (double f : {std::numeric_limits<double>::quiet_NaN(),
                   std::numeric_limits<double>::infinity(), 0.0, -1.0}) {
    l1::expect_error<fsdp::ArgumentError>([&] { m.root.set_gradient_scaling_factor(f); }, "factor",
                                          "set_gradient_scaling_factor(" + std::to_string(f) + ")");
  }
  // Valid factors multiply the reduced gradient; nullopt clears.
  const auto g1 = toy::global_batch(851, kRows), g2 = toy::global_batch(852, kRows);
  m.root.set_gradient_scaling_factor(2.5);
  m.step(mine(g1));
  rep.check("factor 2.5: grads vs 2.5 * single card", grad_err(m, ref_grads(seed, {g1}), 2.5),
            kGradTol);
  m.root.zero_grad();
  m.root.set_gradient_scaling_factor(std::nullopt);
  m.step(mine(g2));
  rep.check("factor cleared: grads vs single card", grad_err(m, ref_grads(seed, {g2})), kGradTol);
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_prefetch_list_invalid_module_raises) {
  l1::ShardedMlp m(86, {});
  l1::expect_error<fsdp::ArgumentError>(
      [&] { m.root.set_modules_to_forward_prefetch({fsdp::FSDPModule()}); }, "modules",
      "set_modules_to_forward_prefetch({FSDPModule()})");
  l1::expect_error<fsdp::ArgumentError>(
      [&] { m.root.set_modules_to_backward_prefetch({m.fc1, fsdp::FSDPModule()}); }, "modules",
      "set_modules_to_backward_prefetch({fc1, FSDPModule()})");
}

BOOST_AUTO_TEST_CASE(test_default_fsdp_module_raises_state_error) {
  fsdp::FSDPModule none;
  const std::string who = "FSDPModule";
  auto state_error = [&](const std::string& label, const std::function<void()>& fn) {
    l1::expect_error<fsdp::StateError>(fn, who, label);
  };
  state_error("module()", [&] { (void)none.module(); });
  state_error("set_requires_gradient_sync", [&] { none.set_requires_gradient_sync(false); });
  state_error("set_requires_all_reduce", [&] { none.set_requires_all_reduce(false); });
  state_error("set_reshard_after_forward", [&] { none.set_reshard_after_forward(false); });
  state_error("set_reshard_after_backward", [&] { none.set_reshard_after_backward(false); });
  state_error("set_reduce_op_type", [&] { none.set_reduce_op_type("sum"); });
  state_error("set_gradient_scaling_factor", [&] { none.set_gradient_scaling_factor(2.0); });
  state_error("set_is_last_backward", [&] { none.set_is_last_backward(false); });
  state_error("set_modules_to_forward_prefetch", [&] { none.set_modules_to_forward_prefetch({}); });
  state_error("set_modules_to_backward_prefetch",
              [&] { none.set_modules_to_backward_prefetch({}); });
  state_error("unshard", [&] { (void)none.unshard(); });
  state_error("reshard", [&] { none.reshard(); });
  state_error("zero_grad", [&] { none.zero_grad(); });
  state_error("finish_pending_reductions", [&] { none.finish_pending_reductions(); });
  state_error("sharded_parameters", [&] { (void)none.sharded_parameters(); });
  state_error("main_grads", [&] { (void)none.main_grads(); });
  state_error("state_dict", [&] { (void)none.state_dict(); });
  state_error("full_state_dict", [&] { (void)none.full_state_dict(); });
  state_error("load_state_dict",
              [&] { none.load_state_dict(std::vector<std::pair<std::string, at::Tensor>>{}); });
  state_error("mesh", [&] { (void)none.mesh(); });
  state_error("is_root", [&] { (void)none.is_root(); });
  // A handle whose module is gone behaves the same.
  fsdp::FSDPModule stale;
  {
    torch::nn::Linear lin(15, 7);
    stale = fsdp::fully_shard(lin.ptr());
  }
  state_error("reshard() after the module was destroyed", [&] { stale.reshard(); });
  state_error("is_root() after the module was destroyed", [&] { (void)stale.is_root(); });
}
