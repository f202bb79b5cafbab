// fully_shard() arguments of the plan's precision file: ignored_params
// (L1-06), comm_fusion (L1-08 and the fusion ON/OFF rows), replicate_params
// 1-D/2-D and offload_policy (pin_memory). Part of the
// test_fully_shard_precision executable (np 2, gpu2;
// test_fully_shard_precision_replicate_np4 runs the replicate cases on the
// 2x2 HSDP mesh).
//
// Cases:
//   test_ignored_params                     L1-06
//   test_comm_fusion_numerical_correctness  L1-08
//   test_comm_fusion_on_vs_single_card      existing row: comm_fusion ON
//   test_comm_fusion_off_vs_single_card     existing row: comm_fusion OFF
//   test_replicate_params_precision_1d      existing row: replicate_params 1-D
//   test_replicate_params_precision_2d      existing row: replicate_params 2-D
//   test_cpu_offload_pin_memory             existing row: offload_policy pin_memory=True
//
// Baselines are single-card runs of an unsharded copy of the same model
// (same seed) -- never another FSDP run (plan rule 1). L1-08 additionally
// compares fusion against no-fusion, as the plan's case itself demands, and
// each of them against the single card.
//    reference" of L1-13.
#include "raw_mpi.h"
#include "precision_util.h"
#include "spmd.h"
#include "toy_models.h"

#include <fsdp/clip_grad.h>
#include <fsdp/comm.h>
#include <fsdp/dtensor.h>
#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace {

using prec::bytes_of, prec::device_batch, prec::local_part, prec::Managed, prec::report;
using testkit::max_abs_diff;

}  // namespace

// ===========================================================================
// L1-06
BOOST_AUTO_TEST_CASE(test_ignored_params) {  // L1-06
  const int ws = spmd::world_size(), rank = spmd::rank();
  const std::string id = "L1-06";
  const double tol = 1e-5;

  // (a) fc1.weight (in a nested unit) and fc3.bias (root) ignored; the list
  // is passed to every fully_shard call.
  toy::Mlp model(5);
  model->to(spmd::device());
  const at::Tensor full_w1 = model->fc1->weight.detach().clone();
  const at::Tensor full_b3 = model->fc3->bias.detach().clone();
  const void* w1_ptr = model->fc1->weight.data_ptr();
  fsdp::FullyShardOptions opts;
  opts.comm_fusion = false;  // the counts below are per parameter (unset fuses on CUDA)
  opts.ignored_params = {model->fc1->weight, model->fc3->bias};
  prec::ShardedModel<toy::Mlp> s;
  s.model = model;
  s.fc1 = fsdp::fully_shard(model->fc1, opts);
  s.fc2 = fsdp::fully_shard(model->fc2, opts);
  s.root = fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(model.ptr()), opts);
  s.net = fsdp::Sharded<toy::Mlp>(model);
  s.expected_managed = model->parameters().size() - 2;

  // Plain tensors: full, untouched storage, not among the managed parameters.
  BOOST_TEST(model->fc1->weight.numel() == full_w1.numel());
  BOOST_TEST((model->fc1->weight.sizes() == full_w1.sizes()));
  BOOST_TEST(model->fc3->bias.numel() == full_b3.numel());
  BOOST_TEST(model->fc1->weight.data_ptr() == w1_ptr, "fc1.weight storage was replaced");
  std::set<std::string> names;
  int64_t managed_with_grad = 0;
  for (const auto& m : s.managed()) {
    names.insert(m.name);
    managed_with_grad += m.param.requires_grad() ? 1 : 0;
  }
  BOOST_TEST(names.count("fc1.weight") == 0u, "fc1.weight is managed");
  BOOST_TEST(names.count("fc3.bias") == 0u, "fc3.bias is managed");
  BOOST_TEST(names.size() == 4u, "managed: " << names.size() << " (expected 6 - 2 ignored)");

  const toy::Batch batch = device_batch(31, 8);
  const toy::Batch mine = toy::slice(batch, rank, ws);
  fsdp::reset_collective_counters();
  at::Tensor loss = toy::mse(s.net(mine.x), mine.y);
  const auto fwd = fsdp::collective_counters();
  fsdp::reset_collective_counters();
  loss.backward();
  const auto bwd = fsdp::collective_counters();
  BOOST_TEST(bwd.total("reduce_scatter") == managed_with_grad,
             "reduce_scatter per backward " << bwd.total("reduce_scatter"));
  BOOST_TEST(bwd.total("all_reduce") == 0);
  BOOST_TEST(fwd.total("all_gather") == managed_with_grad,
             "all_gather per forward " << fwd.total("all_gather"));
  BOOST_TEST(model->fc1->weight.data_ptr() == w1_ptr, "fc1.weight storage was replaced");
  BOOST_TEST(max_abs_diff(model->fc1->weight, full_w1) == 0.0, "fc1.weight value changed");
  BOOST_TEST(max_abs_diff(model->fc3->bias, full_b3) == 0.0, "fc3.bias value changed");

  // Single card on this rank's own batch (for the ignored params) and on the
  // global batch (for the managed ones).
  toy::Mlp ref_local(5), ref_global(5);
  ref_local->to(spmd::device());
  ref_global->to(spmd::device());
  toy::mse(ref_local(mine.x), mine.y).backward();
  toy::mse(ref_global(batch.x), batch.y).backward();
  auto rl = prec::named_params(*ref_local), rg = prec::named_params(*ref_global);

  double ign_err = 0, sep = 1e30;
  for (const char* name : {"fc1.weight", "fc3.bias"}) {
    const at::Tensor p = prec::param_named(*model, name);
    BOOST_TEST(p.grad().defined(), name << " has no gradient");
    if (!p.grad().defined()) continue;
    BOOST_TEST((p.grad().sizes() == rl.at(name).sizes()), name << " grad shape "
                                                               << p.grad().sizes());
    const double e = max_abs_diff(p.grad(), rl.at(name).grad());
    BOOST_TEST(e < tol, name << " grad vs single card on this rank's batch: " << e);
    ign_err = std::max(ign_err, e);
    // The local-batch gradient must differ from the synchronised one, or the
    // check above could not tell them apart.
    sep = std::min(sep, max_abs_diff(rl.at(name).grad(), rg.at(name).grad()));
  }
  BOOST_TEST(sep > 1e-3, "local and global reference grads too close to discriminate: " << sep);
  // Not synchronised: the ranks' ignored gradients differ.
  {
    at::Tensor g = model->fc1->weight.grad().defined()
                       ? model->fc1->weight.grad().detach().contiguous()
                       : at::zeros_like(model->fc1->weight);
    const at::Tensor all = raw_mpi::all_gather(g);
    const double across =
        max_abs_diff(all.narrow(0, 0, g.numel()), all.narrow(0, g.numel(), g.numel()));
    BOOST_TEST(across > 1e-3, "fc1.weight grads equal across ranks (synchronised?): " << across);
    report(id, "ignored grad difference rank 0 vs rank 1 (must be large)",
           prec::max_over_ranks(across), 0);
  }

  double man_err = 0;
  for (const auto& m : s.managed()) {
    const at::Tensor g = m.param.grad();
    BOOST_TEST(g.defined(), m.name << " has no gradient");
    if (!g.defined()) continue;
    const double e = max_abs_diff(g, local_part(rg.at(m.name).grad(), m.dt));
    BOOST_TEST(e < tol, m.name << " grad vs single card: " << e);
    man_err = std::max(man_err, e);
  }
  report(id, "ignored grad vs single card on own batch", prec::max_over_ranks(ign_err), tol);
  report(id, "managed grad vs single card", prec::max_over_ranks(man_err), tol);

  // (b) A parameter ignored by a nested unit stays plain when the root is
  // sharded afterwards without listing it (FSDP2 skips the subtrees of
  // nested fully_shard modules).
  toy::Mlp m2(6);
  m2->to(spmd::device());
  const int64_t w2_numel = m2->fc2->weight.numel();
  fsdp::FullyShardOptions per_param;  // the count below is per parameter
  per_param.comm_fusion = false;
  fsdp::FullyShardOptions only_fc2 = per_param;
  only_fc2.ignored_params = {m2->fc2->weight};
  prec::ShardedModel<toy::Mlp> s2;
  s2.model = m2;
  s2.fc1 = fsdp::fully_shard(m2->fc1, per_param);
  s2.fc2 = fsdp::fully_shard(m2->fc2, only_fc2);
  s2.root = fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(m2.ptr()), per_param);
  s2.net = fsdp::Sharded<toy::Mlp>(m2);
  s2.expected_managed = m2->parameters().size() - 1;
  std::set<std::string> names2;
  for (const auto& m : s2.managed()) names2.insert(m.name);
  BOOST_TEST(names2.count("fc2.weight") == 0u,
             "fc2.weight, ignored by the fc2 unit, is managed by the root unit");
  BOOST_TEST(m2->fc2->weight.numel() == w2_numel,
             "fc2.weight numel " << m2->fc2->weight.numel() << ", full " << w2_numel);
  fsdp::reset_collective_counters();
  toy::mse(s2.net(mine.x), mine.y).backward();
  const auto c2 = fsdp::collective_counters();
  // 6 parameters, 1 ignored: 5 reduce-scatters.
  BOOST_TEST(c2.total("reduce_scatter") == 5, "reduce_scatter " << c2.total("reduce_scatter")
                                                                 << " (5 managed params)");
}

// ===========================================================================
// L1-08 and the fusion ON/OFF rows

namespace {

struct FusionRun {
  prec::ParityResult parity;
  int64_t units = 3, params = 6, root_params = 2;
};

FusionRun fusion_run(bool fusion, const std::string& id) {
  fsdp::FullyShardOptions opts;
  opts.comm_fusion = fusion;
  auto s = prec::shard_model(toy::Mlp(3), opts, opts);
  prec::ParityOptions po;
  po.id = id;
  FusionRun r;
  r.parity = prec::fp32_parity(s, 3, po);
  return r;
}

void check_fusion_counters(const FusionRun& r, bool fusion, const std::string& id) {
  const int64_t want = fusion ? r.units : r.params;
  // The root (fc3: weight and bias) keeps its parameters from forward to
  // backward (reshard_after_forward unset, the default).
  const int64_t want_bwd = want - (fusion ? 1 : r.root_params);
  for (size_t i = 0; i < r.parity.steps.size(); ++i) {
    const auto& st = r.parity.steps[i];
    // Every other unit reshards after forward: one gather in forward, one
    // in backward; every unit one reduce-scatter in backward.
    BOOST_TEST(st.fwd.total("all_gather") == want,
               "[" << id << "] step " << i << " forward all_gathers " << st.fwd.total("all_gather"));
    BOOST_TEST(st.bwd.total("all_gather") == want_bwd,
               "[" << id << "] step " << i << " backward all_gathers "
                   << st.bwd.total("all_gather"));
    BOOST_TEST(st.bwd.total("reduce_scatter") == want,
               "[" << id << "] step " << i << " reduce_scatters "
                   << st.bwd.total("reduce_scatter"));
    BOOST_TEST(st.fwd.total("reduce_scatter") == 0);
    BOOST_TEST(st.bwd.total("all_reduce") == 0);
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_comm_fusion_numerical_correctness) {  // L1-08
  const std::string id = "L1-08";
  FusionRun on = fusion_run(true, id + " fusion");
  FusionRun off = fusion_run(false, id + " no-fusion");
  check_fusion_counters(on, true, id);
  check_fusion_counters(off, false, id);
  double loss_err = 0, grad_err = 0;
  for (size_t i = 0; i < on.parity.steps.size(); ++i) {
    const auto& a = on.parity.steps[i];
    const auto& b = off.parity.steps[i];
    const double le = std::max(std::abs(a.global_loss - b.global_loss),
                               std::abs(a.local_loss - b.local_loss));
    BOOST_TEST(le < 1e-6, "step " << i << " |loss_fusion - loss_nofusion| = " << le);
    loss_err = std::max(loss_err, le);
    BOOST_TEST(a.grads.size() == b.grads.size());
    for (const auto& [name, g] : a.grads) {
      auto it = b.grads.find(name);
      BOOST_TEST((it != b.grads.end()), name << " missing in the no-fusion run");
      if (it == b.grads.end()) continue;
      const double e = max_abs_diff(g, it->second);
      BOOST_TEST(e < 1e-6, "step " << i << " " << name << " grad fusion vs no-fusion: " << e);
      grad_err = std::max(grad_err, e);
    }
    // Same payload, fused or not.
    BOOST_TEST(bytes_of(a.fwd, "all_gather") == bytes_of(b.fwd, "all_gather"));
    BOOST_TEST(bytes_of(a.bwd, "reduce_scatter") == bytes_of(b.bwd, "reduce_scatter"));
  }
  report(id, "|loss_fusion - loss_nofusion|", prec::max_over_ranks(loss_err), 1e-6);
  report(id, "grad fusion vs no-fusion", prec::max_over_ranks(grad_err), 1e-6);
}

BOOST_AUTO_TEST_CASE(test_comm_fusion_on_vs_single_card) {  // existing row: comm_fusion ON
  FusionRun r = fusion_run(true, "fusion ON");
  check_fusion_counters(r, true, "fusion ON");
}

BOOST_AUTO_TEST_CASE(test_comm_fusion_off_vs_single_card) {  // existing row: comm_fusion OFF
  FusionRun r = fusion_run(false, "fusion OFF");
  check_fusion_counters(r, false, "fusion OFF");
}
// ===========================================================================
// replicate_params

namespace {

void check_replicate(const fsdp::FullyShardOptions& base, const std::string& id) {
  toy::Mlp model(8);
  fsdp::FullyShardOptions opts = base;
  opts.comm_fusion = false;  // the counts below are per parameter (unset fuses on CUDA)
  opts.replicate_params = {model->fc1->bias, model->fc3->weight};
  auto s = prec::shard_model(model, opts, opts);
  const std::set<std::string> replicated = {"fc1.bias", "fc3.weight"};
  const fsdp::DeviceMesh& mesh = s.root.mesh();
  std::vector<fsdp::Placement> want_rep(static_cast<size_t>(mesh.ndim()),
                                        fsdp::Placement::Replicate());
  std::vector<fsdp::Placement> want_shard = want_rep;
  want_shard.back() = fsdp::Placement::Shard(0);
  const int64_t shard_size = mesh.size(mesh.ndim() - 1);
  const int64_t rep_size = mesh.ndim() == 2 ? mesh.size(0) : 1;

  int64_t n_rep = 0, n_shard = 0;
  for (const auto& m : s.managed()) {
    const bool rep = replicated.count(m.name) > 0;
    (rep ? n_rep : n_shard) += 1;
    BOOST_TEST((m.dt.placements() == (rep ? want_rep : want_shard)),
               "[" << id << "] " << m.name << " placement " << m.dt.placements()[0].to_string());
    if (rep) {
      BOOST_TEST(m.param.numel() == m.dt.numel(),
                 "[" << id << "] " << m.name << " numel " << m.param.numel() << " vs full "
                     << m.dt.numel());
    }
  }
  BOOST_TEST(n_rep == 2);

  prec::ParityOptions po;
  po.id = id;
  auto r = prec::fp32_parity(s, 8, po);
  for (size_t i = 0; i < r.steps.size(); ++i) {
    const auto& st = r.steps[i];
    // Sharded: reduce-scatter over the shard dim (only when it has >1 rank);
    // replicated: all-reduce over the shard dim; HSDP: everything then
    // all-reduced over the replicate dim.
    const int64_t want_rs = shard_size > 1 ? n_shard : 0;
    const int64_t want_ar = (shard_size > 1 ? n_rep : 0) + (rep_size > 1 ? n_rep + n_shard : 0);
    BOOST_TEST(st.bwd.total("reduce_scatter") == want_rs,
               "[" << id << "] reduce_scatters " << st.bwd.total("reduce_scatter"));
    BOOST_TEST(st.bwd.total("all_reduce") == want_ar,
               "[" << id << "] all_reduces " << st.bwd.total("all_reduce"));
  }
  // Replicated parameters stay identical on every rank through the steps.
  for (const auto& m : s.managed()) {
    if (!replicated.count(m.name)) continue;
    at::Tensor v = m.param.detach().contiguous().cpu();
    const at::Tensor all = raw_mpi::all_gather(v);
    double spread = 0;
    for (int k = 1; k < spmd::world_size(); ++k) {
      spread = std::max(spread, max_abs_diff(all.narrow(0, 0, v.numel()),
                                             all.narrow(0, k * v.numel(), v.numel())));
    }
    BOOST_TEST(spread == 0.0, "[" << id << "] " << m.name << " differs across ranks: " << spread);
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_replicate_params_precision_1d) {  // existing row: replicate_params 1-D
  check_replicate({}, "replicate 1-D");
}

// "2-D" is (replicate=N, shard=1) -- the HSDP all-reduce path alone --,
// (replicate=1, shard=N), and at np 4 the real HSDP mesh (2, 2), where a
// replicated parameter's gradient is all-reduced over both dims
// (test_fully_shard_precision_replicate_np4 runs this case alone).
BOOST_AUTO_TEST_CASE(test_replicate_params_precision_2d) {  // existing row: replicate_params 2-D
  const int ws = spmd::world_size();
  std::vector<std::vector<int64_t>> shapes = {{ws, 1}, {1, ws}};
  if (ws == 4) shapes.push_back({2, 2});
  for (const std::vector<int64_t>& shape : shapes) {
    fsdp::FullyShardOptions opts;
    opts.mesh = fsdp::init_device_mesh(spmd::device().type(), shape, {"replicate", "shard"});
    check_replicate(opts, "replicate 2-D (" + std::to_string(shape[0]) + "," +
                              std::to_string(shape[1]) + ")");
  }
}

// ===========================================================================
// CPU offload

BOOST_AUTO_TEST_CASE(test_cpu_offload_pin_memory) {  // existing row: offload_policy pin_memory=True
  const bool cuda = spmd::device().is_cuda();
  if (!cuda) {
    prec::note("[offload] trivially true on a CPU run: the shards already live in CPU memory, so "
               "this checks only that CPUOffloadPolicy{pin_memory=true} is accepted and trains "
               "like the single card; the host/device moves and pinning run under the gpu labels");
  }
  fsdp::FullyShardOptions opts;
  opts.offload_policy = fsdp::CPUOffloadPolicy{true};
  auto s = prec::shard_model(toy::Mlp(9), opts, opts);
  auto check_on_cpu = [&](const std::string& when) {
    for (const auto& m : s.managed()) {
      BOOST_TEST(m.dt.to_local().is_cpu(), m.name << " shard not on CPU " << when);
      BOOST_TEST(m.param.is_cpu(), m.name << " parameter not on CPU " << when);
      if (m.param.grad().defined()) {
        BOOST_TEST(m.param.grad().is_cpu(), m.name << " grad not on CPU " << when);
        // Downloaded into pinned memory without blocking (param.cpp).
        if (cuda) BOOST_TEST(m.param.grad().is_pinned(), m.name << " grad not pinned " << when);
      }
      if (cuda) BOOST_TEST(m.dt.to_local().is_pinned(), m.name << " shard not pinned " << when);
    }
  };
  check_on_cpu("after fully_shard");
  prec::ParityOptions po;
  po.id = "offload";
  prec::fp32_parity(s, 9, po, [&](int step) { check_on_cpu("after backward " + std::to_string(step)); });
  check_on_cpu("after the steps");
}
