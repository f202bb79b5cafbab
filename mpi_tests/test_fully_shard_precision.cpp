// fully_shard precision and option cases of the test plan's
// _test_fully_shard_precision.py, Level 1: ignored_params (L1-06),
// comm_fusion (L1-08 and the ON/OFF rows), the mixed precision matrix
// (L1-10..13 and the existing fp16/fp32 row), replicate_params 1-D/2-D and
// CPU offload; and Level 2: gradient accumulation (L2-01), frozen
// parameters (L2-02), global gradient clipping (L2-07), dynamic sequence
// length (L2-08). Runs at np 2 (CPU) and gpu2.
//
// Baselines are single-card runs of an unsharded copy of the same model
// (same seed) -- never another FSDP run (plan rule 1). L1-08 additionally
// compares fusion against no-fusion, as the plan's case itself demands, and
// each of them against the single card.
//
// Mixed precision references. FSDP with param_dtype = low computes each
// rank's forward/backward in `low` on its half of the batch, casts the local
// gradients to reduce_dtype and averages them over the ranks. Two
// single-card references follow from that:
//  - "single-card low-precision reference" (the plan's baseline): the
//    unsharded copy cast to `low`, run on the whole global batch, gradients
//    cast to fp32. It differs from FSDP only by where the batch sum is
//    rounded to `low` (once over the whole batch vs once per half), i.e. by
//    about one `low` ulp of each gradient: the plan's 1e-3 (loss, grad norm)
//    is for this comparison.
//  - "single-card micro-batch emulation" [ours]: the same `low` copy run on
//    one card over the ranks' slices one after the other, each slice's
//    gradients cast to reduce_dtype and averaged in reduce_dtype (the sum
//    rounded once for a 16-bit reduce dtype, as the 2-rank reduction does).
//    This is what FSDP computes, operation for operation, so it is held to
//    the fp32 tolerance 1e-5; it is the check that tells a reduction in
//    fp32 from one in bf16, and the "matching low-precision single-card
//    reference" of L1-13.
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

using prec::diff;
using prec::local_part;
using prec::Managed;
using prec::report;

const char* dt_name(c10::ScalarType t) { return c10::toString(t); }

// ---------------------------------------------------------------------------
// Mixed precision machinery

struct MpConfig {
  std::string id;
  fsdp::MixedPrecisionPolicy mp;
  bool probes_cast = false;  // the probes cast their input to the weight dtype themselves
};

// Options for the nested units and the root: the same policy, except that
// output_dtype is given to the root only. A nested unit casting its output
// to fp32 would hand fp32 activations to fc3, whose weight the root unit
// has gathered in param_dtype (a dtype mismatch in PyTorch FSDP2 as well).
std::pair<fsdp::FullyShardOptions, fsdp::FullyShardOptions> mp_options(
    const fsdp::MixedPrecisionPolicy& mp) {
  fsdp::FullyShardOptions nested, root;
  root.mp_policy = mp;
  nested.mp_policy = mp;
  nested.mp_policy.output_dtype.reset();
  return {nested, root};
}

// The single-card copy in the compute dtype run on (x, y), the way the FSDP
// root runs it: input cast to param_dtype when cast_forward_inputs, output
// cast to output_dtype, MSE against the fp32 target (fp32 loss).
struct RefRun {
  double loss = 0;
  at::Tensor out;
  std::map<std::string, at::Tensor> grads;  // as computed (compute dtype)
};

RefRun run_low_ref(int64_t seed, const MpConfig& c, const at::Tensor& x, const at::Tensor& y) {
  const c10::ScalarType low = *c.mp.param_dtype;
  prec::PMlp ref(seed, c.probes_cast);
  ref->to(spmd::device());
  ref->to(low);
  at::Tensor in = c.mp.cast_forward_inputs ? x.to(low) : x;
  at::Tensor out = ref(in);
  if (c.mp.output_dtype) out = out.to(*c.mp.output_dtype);
  at::Tensor loss = toy::mse(out, y);
  loss.backward();
  RefRun r;
  r.loss = loss.item<double>();
  r.out = out.detach();
  for (auto& [name, p] : prec::named_params(*ref)) r.grads[name] = p.grad().detach().clone();
  return r;
}

// Average over ranks as the library's 2-rank reduction does it: each pair
// of operands added in fp32 and rounded once to the reduce dtype, then
// scaled by 1/ws in the reduce dtype.
at::Tensor emulate_reduce(const std::vector<at::Tensor>& per_rank, c10::ScalarType reduce) {
  at::Tensor acc = per_rank.front().to(reduce).to(at::kFloat);
  for (size_t i = 1; i < per_rank.size(); ++i) {
    acc = (acc + per_rank[i].to(reduce).to(at::kFloat)).to(reduce).to(at::kFloat);
  }
  return acc.to(reduce) * (1.0 / static_cast<double>(per_rank.size()));
}

// Single-card micro-batch emulation of one FSDP pass over `batch`: per-rank
// losses and the averaged gradients (in reduce dtype).
struct Emulation {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> grads;
};

Emulation emulate(int64_t seed, const MpConfig& c, const toy::Batch& batch) {
  const int ws = spmd::world_size();
  const c10::ScalarType low = *c.mp.param_dtype;
  const c10::ScalarType reduce = c.mp.reduce_dtype.value_or(low);
  std::map<std::string, std::vector<at::Tensor>> parts;
  Emulation e;
  for (int r = 0; r < ws; ++r) {
    const toy::Batch b = toy::slice(batch, r, ws);
    RefRun run = run_low_ref(seed, c, b.x, b.y);
    e.losses.push_back(run.loss);
    for (auto& [name, g] : run.grads) parts[name].push_back(g);
  }
  for (auto& [name, gs] : parts) e.grads[name] = emulate_reduce(gs, reduce);
  return e;
}

toy::Batch device_batch(int64_t seed, int64_t rows) {
  toy::Batch b = toy::global_batch(seed, rows);
  return {b.x.to(spmd::device()), b.y.to(spmd::device())};
}

// L1-10, L1-11 and the fp16/fp32 row: one forward/backward on the toy model
// under `c`; checks compute dtype (probe), shard storage dtype, output and
// gradient dtypes, loss and global grad norm against the single-card
// low-precision reference (1e-3), and every gradient against the micro-batch
// emulation (1e-5).
void check_mp_case(const MpConfig& c) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const int64_t seed = 11;
  const c10::ScalarType low = *c.mp.param_dtype;
  const c10::ScalarType reduce = c.mp.reduce_dtype.value_or(low);
  const c10::ScalarType out_dtype = c.mp.output_dtype.value_or(low);
  const double tol_low = 1e-3, tol_emul = 1e-5;

  auto [nested, root_opts] = mp_options(c.mp);
  auto s = prec::shard_model(prec::PMlp(seed, c.probes_cast), nested, root_opts);
  const toy::Batch batch = device_batch(21, 8);
  const toy::Batch mine = toy::slice(batch, rank, ws);

  at::Tensor out = s.net(mine.x);
  // Compute dtype: what the layers saw while the units were unsharded.
  BOOST_TEST(s.model->fc1->seen_weight == low, "fc1 computed with "
                                                   << dt_name(s.model->fc1->seen_weight));
  BOOST_TEST(s.model->fc2->seen_weight == low, "fc2 computed with "
                                                   << dt_name(s.model->fc2->seen_weight));
  BOOST_TEST(s.model->fc3->seen_weight == low, "fc3 computed with "
                                                   << dt_name(s.model->fc3->seen_weight));
  if (c.mp.cast_forward_inputs) {
    BOOST_TEST(s.model->seen_input == low, "root input " << dt_name(s.model->seen_input));
  }
  BOOST_TEST(out.scalar_type() == out_dtype, "output dtype " << dt_name(out.scalar_type())
                                                            << ", expected "
                                                            << dt_name(out_dtype));
  at::Tensor loss = toy::mse(out, mine.y);
  loss.backward();

  // Shards stay fp32; the sharded gradient has the reduce dtype.
  const auto ms = s.managed();
  for (const auto& m : ms) {
    BOOST_TEST(m.param.scalar_type() == at::kFloat, m.name << " shard dtype "
                                                           << dt_name(m.param.scalar_type()));
    BOOST_TEST(m.dt.to_local().scalar_type() == at::kFloat,
               m.name << " DTensor local dtype " << dt_name(m.dt.to_local().scalar_type()));
    const at::Tensor g = m.param.grad();
    BOOST_TEST(g.defined(), m.name << " has no gradient");
    if (g.defined()) {
      BOOST_TEST(g.scalar_type() == reduce, m.name << " grad dtype " << dt_name(g.scalar_type())
                                                   << ", expected " << dt_name(reduce));
      BOOST_TEST((g.sizes() == m.param.sizes()), m.name << " grad shape " << g.sizes());
    }
  }

  // Plan baseline: single card, low precision, whole global batch.
  const RefRun ref = run_low_ref(seed, c, batch.x, batch.y);
  const double global_loss = prec::mean_over_ranks(loss.item<double>());
  double fsdp_sq = 0, ref_sq = 0, worst_elem = 0;
  for (const auto& m : ms) {
    const at::Tensor full = prec::full_of(prec::grad_or_zeros(m), m.dt);  // collective
    const at::Tensor ref_g = ref.grads.at(m.name).to(at::kFloat);
    fsdp_sq += prec::sq_norm(full);
    ref_sq += prec::sq_norm(ref_g);
    worst_elem = std::max(worst_elem, diff(full, ref_g));
  }
  const double loss_err = std::abs(global_loss - ref.loss);
  const double norm_err = std::abs(std::sqrt(fsdp_sq) - std::sqrt(ref_sq));
  BOOST_TEST(loss_err < tol_low, "[" << c.id << "] loss " << global_loss << " vs single-card "
                                     << dt_name(low) << " " << ref.loss);
  BOOST_TEST(norm_err < tol_low, "[" << c.id << "] grad norm " << std::sqrt(fsdp_sq)
                                     << " vs single-card " << dt_name(low) << " "
                                     << std::sqrt(ref_sq));
  report(c.id, std::string("loss vs single-card ") + dt_name(low), prec::max_over_ranks(loss_err),
         tol_low);
  report(c.id, std::string("grad norm vs single-card ") + dt_name(low),
         prec::max_over_ranks(norm_err), tol_low);
  report(c.id, std::string("elementwise grad vs single-card ") + dt_name(low) + " (info)",
         prec::max_over_ranks(worst_elem), 0);

  // [ours] Operation-for-operation emulation on one card.
  const Emulation emu = emulate(seed, c, batch);
  const double emu_loss_err = std::abs(loss.item<double>() - emu.losses[static_cast<size_t>(rank)]);
  BOOST_TEST(emu_loss_err < tol_emul, "[" << c.id << "] local loss vs micro-batch emulation: "
                                          << emu_loss_err);
  double emu_grad_err = 0;
  for (const auto& m : ms) {
    if (!m.param.grad().defined()) continue;
    const double e = diff(m.param.grad(), local_part(emu.grads.at(m.name), m.dt));
    BOOST_TEST(e < tol_emul, "[" << c.id << "] " << m.name << " grad vs micro-batch emulation: "
                                 << e);
    emu_grad_err = std::max(emu_grad_err, e);
  }
  report(c.id, "local loss vs single-card micro-batch emulation", prec::max_over_ranks(emu_loss_err),
         tol_emul);
  report(c.id, "grad vs single-card micro-batch emulation", prec::max_over_ranks(emu_grad_err),
         tol_emul);
}

// Bytes / counts of one op over every group.
int64_t bytes_of(const fsdp::CollectiveCounters& c, const std::string& op) {
  int64_t n = 0;
  for (const auto& [key, b] : c.bytes) {
    if (key.first == op) n += b;
  }
  return n;
}

}  // namespace

// ===========================================================================
// L1-06
BOOST_AUTO_TEST_CASE(test_ignored_params) {
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
  BOOST_TEST(diff(model->fc1->weight, full_w1) == 0.0, "fc1.weight value changed");
  BOOST_TEST(diff(model->fc3->bias, full_b3) == 0.0, "fc3.bias value changed");

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
    const double e = diff(p.grad(), rl.at(name).grad());
    BOOST_TEST(e < tol, name << " grad vs single card on this rank's batch: " << e);
    ign_err = std::max(ign_err, e);
    // The local-batch gradient must differ from the synchronised one, or the
    // check above could not tell them apart.
    sep = std::min(sep, diff(rl.at(name).grad(), rg.at(name).grad()));
  }
  BOOST_TEST(sep > 1e-3, "local and global reference grads too close to discriminate: " << sep);
  // Not synchronised: the ranks' ignored gradients differ.
  {
    at::Tensor g = model->fc1->weight.grad().defined()
                       ? model->fc1->weight.grad().detach().contiguous()
                       : at::zeros_like(model->fc1->weight);
    at::Tensor all = at::empty({ws * g.numel()}, g.options());
    fsdp::world_group()->all_gather_into_tensor(all, g.view({-1}));
    const double across = diff(all.narrow(0, 0, g.numel()), all.narrow(0, g.numel(), g.numel()));
    BOOST_TEST(across > 1e-3, "fc1.weight grads equal across ranks (synchronised?): " << across);
    report(id, "ignored grad difference rank 0 vs rank 1 (must be large)",
           prec::max_over_ranks(across), 0);
  }

  double man_err = 0;
  for (const auto& m : s.managed()) {
    const at::Tensor g = m.param.grad();
    BOOST_TEST(g.defined(), m.name << " has no gradient");
    if (!g.defined()) continue;
    const double e = diff(g, local_part(rg.at(m.name).grad(), m.dt));
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
  fsdp::FullyShardOptions only_fc2;
  only_fc2.ignored_params = {m2->fc2->weight};
  prec::ShardedModel<toy::Mlp> s2;
  s2.model = m2;
  s2.fc1 = fsdp::fully_shard(m2->fc1);
  s2.fc2 = fsdp::fully_shard(m2->fc2, only_fc2);
  s2.root = fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(m2.ptr()));
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
      const double e = diff(g, it->second);
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

BOOST_AUTO_TEST_CASE(test_comm_fusion_on_vs_single_card) {
  FusionRun r = fusion_run(true, "fusion ON");
  check_fusion_counters(r, true, "fusion ON");
}

BOOST_AUTO_TEST_CASE(test_comm_fusion_off_vs_single_card) {
  FusionRun r = fusion_run(false, "fusion OFF");
  check_fusion_counters(r, false, "fusion OFF");
}

// ===========================================================================
// Mixed precision

BOOST_AUTO_TEST_CASE(test_mp_fp16_param_fp32_reduce) {  // existing row (fp16, fp32, True, False)
  MpConfig c;
  c.id = "mp fp16/fp32";
  c.mp.param_dtype = prec::plan_fp16(c.id);
  c.mp.reduce_dtype = at::kFloat;
  check_mp_case(c);
}

BOOST_AUTO_TEST_CASE(test_mp_bf16_param_fp32_reduce) {  // L1-10
  MpConfig c;
  c.id = "L1-10";
  c.mp.param_dtype = at::kBFloat16;
  c.mp.reduce_dtype = at::kFloat;
  c.mp.output_dtype = at::kFloat;
  check_mp_case(c);
}

BOOST_AUTO_TEST_CASE(test_mp_bf16_all_bf16) {  // L1-11
  MpConfig c;
  c.id = "L1-11";
  c.mp.param_dtype = at::kBFloat16;
  c.mp.reduce_dtype = at::kBFloat16;
  c.mp.output_dtype = at::kBFloat16;
  check_mp_case(c);
}

BOOST_AUTO_TEST_CASE(test_mp_cast_forward_inputs_false) {  // L1-12
  const int ws = spmd::world_size(), rank = spmd::rank();
  MpConfig c;
  c.id = "L1-12";
  const c10::ScalarType low = prec::plan_fp16(c.id);
  c.mp.param_dtype = low;
  c.mp.reduce_dtype = at::kFloat;
  c.mp.cast_forward_inputs = false;
  c.probes_cast = true;  // the model casts for itself
  const toy::Batch batch = device_batch(41, 8);
  const toy::Batch mine = toy::slice(batch, rank, ws);

  auto [nested, root_opts] = mp_options(c.mp);
  auto s = prec::shard_model(prec::PMlp(12, /*cast_input=*/true), nested, root_opts);
  at::Tensor out, loss;
  BOOST_CHECK_NO_THROW({
    out = s.net(mine.x);
    loss = toy::mse(out, mine.y);
    loss.backward();
  });
  BOOST_TEST(s.model->seen_input == at::kFloat,
             "root forward saw input " << dt_name(s.model->seen_input) << " (expected Float)");
  BOOST_TEST(s.model->fc1->seen_input == at::kFloat,
             "fc1 forward saw input " << dt_name(s.model->fc1->seen_input) << " (expected Float)");
  BOOST_TEST(s.model->fc1->seen_weight == low);
  BOOST_TEST(loss.defined());
  if (loss.defined()) {
    const double l = loss.item<double>();
    BOOST_TEST(std::isfinite(l), "loss " << l);
    const RefRun ref = run_low_ref(12, c, batch.x, batch.y);
    const double err = std::abs(prec::mean_over_ranks(l) - ref.loss);
    BOOST_TEST(err < 1e-3, "loss vs single-card " << dt_name(low) << ": " << err);
    report(c.id, std::string("loss vs single-card ") + dt_name(low), prec::max_over_ranks(err),
           1e-3);
  }
  for (const auto& m : s.managed()) {
    const at::Tensor g = m.param.grad();
    BOOST_TEST(g.defined(), m.name << " has no gradient");
    if (!g.defined()) continue;
    BOOST_TEST(g.scalar_type() == at::kFloat, m.name << " grad " << dt_name(g.scalar_type()));
    BOOST_TEST(at::isfinite(g).all().item<bool>(), m.name << " grad not finite");
  }

  // Control: with cast_forward_inputs the same probes see param_dtype, so
  // the probes do detect a cast.
  MpConfig on = c;
  on.mp.cast_forward_inputs = true;
  auto [n2, r2] = mp_options(on.mp);
  auto s2 = prec::shard_model(prec::PMlp(12, /*cast_input=*/true), n2, r2);
  toy::mse(s2.net(mine.x), mine.y).backward();
  BOOST_TEST(s2.model->seen_input == low, "control: root saw " << dt_name(s2.model->seen_input));
  BOOST_TEST(s2.model->fc1->seen_input == low,
             "control: fc1 saw " << dt_name(s2.model->fc1->seen_input));
}

BOOST_AUTO_TEST_CASE(test_mp_apply_grad_on_fp32_main_grad) {  // L1-13
  const int ws = spmd::world_size(), rank = spmd::rank();
  const int64_t seed = 13;
  MpConfig c;
  c.id = "L1-13";
  const c10::ScalarType low = prec::plan_fp16(c.id);
  c.mp.param_dtype = low;
  c.mp.reduce_dtype = at::kFloat;
  c.mp.apply_grad_on_fp32_main_grad = true;
  const double tol = 1e-5;

  auto [nested, root_opts] = mp_options(c.mp);
  auto s = prec::shard_model(prec::PMlp(seed, false), nested, root_opts);
  const std::vector<toy::Batch> batches = {device_batch(51, 8), device_batch(52, 8)};

  std::map<std::string, at::Tensor> after_first;
  for (size_t pass = 0; pass < batches.size(); ++pass) {
    const toy::Batch mine = toy::slice(batches[pass], rank, ws);
    toy::mse(s.net(mine.x), mine.y).backward();  // no zero_grad: accumulate
    if (pass != 0) continue;
    for (const auto& m : s.managed()) {
      BOOST_TEST(m.param.grad().defined(), m.name << " has no gradient after the first pass");
      if (m.param.grad().defined()) after_first[m.name] = m.param.grad().detach().clone();
    }
  }
  BOOST_TEST(s.model->fc1->seen_weight == low);

  // param.grad() is the fp32 main grad, and main_grads() returns it.
  const auto ms = s.managed();
  std::map<std::string, at::Tensor> mains;
  for (const auto& u : s.units()) {
    for (auto& [name, t] : u.fsdp.main_grads()) mains[u.prefix + name] = t;
  }
  BOOST_TEST(mains.size() == ms.size(), "main_grads() entries " << mains.size());
  for (const auto& m : ms) {
    const at::Tensor g = m.param.grad();
    BOOST_TEST(g.defined(), m.name << " has no gradient");
    if (!g.defined()) continue;
    BOOST_TEST(g.scalar_type() == at::kFloat, m.name << " grad " << dt_name(g.scalar_type()));
    auto it = mains.find(m.name);
    BOOST_TEST((it != mains.end() && it->second.defined()), m.name << ": no main grad");
    if (it == mains.end() || !it->second.defined()) continue;
    BOOST_TEST(it->second.scalar_type() == at::kFloat);
    BOOST_TEST((it->second.sizes() == g.sizes()));
    if (it->second.sizes() == g.sizes()) {
      BOOST_TEST(diff(it->second, g) == 0.0, m.name << ": main_grads() differs from param.grad()");
    }
  }

  // Matching single-card reference: micro-batch emulation of both passes,
  // accumulated in fp32.
  std::map<std::string, at::Tensor> emu_total, emu_first;
  for (size_t pass = 0; pass < batches.size(); ++pass) {
    const Emulation e = emulate(seed, c, batches[pass]);
    for (const auto& [name, g] : e.grads) {
      const at::Tensor g32 = g.to(at::kFloat);
      if (pass == 0) emu_first[name] = g32;
      emu_total[name] = emu_total.count(name) ? emu_total[name] + g32 : g32;
    }
  }
  // fp32 single card: both global batches, gradients accumulated by autograd.
  prec::PMlp ref32(seed, false);
  ref32->to(spmd::device());
  for (const auto& b : batches) toy::mse(ref32(b.x), b.y).backward();
  auto r32 = prec::named_params(*ref32);

  double first_err = 0, total_err = 0, fp32_err = 0, fp32_norm_err = 0, sq = 0, sq32 = 0;
  for (const auto& m : ms) {
    const at::Tensor g = prec::grad_or_zeros(m);
    // A parameter without a first-pass gradient already failed above; its
    // gap is infinite here so the recorded worst case cannot hide it.
    const double e1 = after_first.count(m.name)
                          ? diff(after_first[m.name], local_part(emu_first.at(m.name), m.dt))
                          : std::numeric_limits<double>::infinity();
    BOOST_TEST(e1 < tol, m.name << " pass-1 main grad vs emulation: " << e1);
    first_err = std::max(first_err, e1);
    const double e = diff(g, local_part(emu_total.at(m.name), m.dt));
    BOOST_TEST(e < tol, m.name << " accumulated main grad vs emulation: " << e);
    total_err = std::max(total_err, e);
    fp32_err = std::max(fp32_err, diff(g, local_part(r32.at(m.name).grad(), m.dt)));
    const at::Tensor full = prec::full_of(g, m.dt);  // collective
    sq += prec::sq_norm(full);
    sq32 += prec::sq_norm(r32.at(m.name).grad());
  }
  fp32_norm_err = std::abs(std::sqrt(sq) - std::sqrt(sq32));
  report(c.id, "pass-1 main grad vs single-card micro-batch emulation",
         prec::max_over_ranks(first_err), tol);
  report(c.id, "2-pass main grad vs single-card micro-batch emulation",
         prec::max_over_ranks(total_err), tol);
  // The plan's "atol 1e-5 vs fp32 single card". The fp16 form (CUDA) is held
  // to it. The CPU stand-in computes in bf16, whose ulp at these gradients
  // is ~1e-3: there the check misses by construction and is recorded as an
  // expected failure with its gap, never as a pass.
  const double fp32_gap = prec::max_over_ranks(fp32_err);
  const double fp32_norm_gap = prec::max_over_ranks(fp32_norm_err);
  if (low == at::kHalf) {
    report(c.id, "2-pass main grad vs fp32 single card", fp32_gap, tol);
    BOOST_TEST(fp32_gap <= tol, "2-pass main grad vs fp32 single card: " << fp32_gap);
    report(c.id, "2-pass grad norm vs fp32 single card", fp32_norm_gap, tol);
    BOOST_TEST(fp32_norm_gap <= tol, "2-pass grad norm vs fp32 single card: " << fp32_norm_gap);
  } else {
    const std::string why = std::string(dt_name(low)) +
                            " compute on CPU (the fp16 stand-in): its ulp at these gradients is "
                            "~1e-3, so 1e-5 against fp32 is out of reach; the fp16 form under "
                            "the gpu labels asserts it";
    prec::expected_failure(c.id, "2-pass main grad vs fp32 single card", fp32_gap, tol, why);
    prec::expected_failure(c.id, "2-pass grad norm vs fp32 single card", fp32_norm_gap, tol, why);
  }

  // The fp32 main grad is what keeps the gradient fp32 when the reduction is
  // 16-bit: reduce_dtype = low with and without the flag.
  for (bool flag : {true, false}) {
    fsdp::MixedPrecisionPolicy mp;
    mp.param_dtype = low;
    mp.reduce_dtype = low;
    mp.apply_grad_on_fp32_main_grad = flag;
    auto [n2, r2] = mp_options(mp);
    auto s2 = prec::shard_model(prec::PMlp(seed, false), n2, r2);
    for (const auto& b : batches) {
      const toy::Batch mine = toy::slice(b, rank, ws);
      toy::mse(s2.net(mine.x), mine.y).backward();
    }
    const c10::ScalarType want = flag ? at::kFloat : low;
    for (const auto& m : s2.managed()) {
      const at::Tensor g = m.param.grad();
      BOOST_TEST(g.defined(), m.name << " has no gradient");
      if (!g.defined()) continue;
      BOOST_TEST(g.scalar_type() == want, "reduce " << dt_name(low) << ", fp32 main grad " << flag
                                                    << ": " << m.name << " grad "
                                                    << dt_name(g.scalar_type()));
    }
  }
}

// ===========================================================================
// replicate_params

namespace {

void check_replicate(const fsdp::FullyShardOptions& base, const std::string& id) {
  toy::Mlp model(8);
  fsdp::FullyShardOptions opts = base;
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
    at::Tensor all = at::empty({spmd::world_size() * v.numel()}, v.options());
    fsdp::world_group()->all_gather_into_tensor(all, v.view({-1}));
    double spread = 0;
    for (int k = 1; k < spmd::world_size(); ++k) {
      spread = std::max(spread, diff(all.narrow(0, 0, v.numel()),
                                     all.narrow(0, k * v.numel(), v.numel())));
    }
    BOOST_TEST(spread == 0.0, "[" << id << "] " << m.name << " differs across ranks: " << spread);
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_replicate_params_precision_1d) {
  check_replicate({}, "replicate 1-D");
}

// "2-D" is (replicate=N, shard=1) -- the HSDP all-reduce path alone --,
// (replicate=1, shard=N), and at np 4 the real HSDP mesh (2, 2), where a
// replicated parameter's gradient is all-reduced over both dims
// (test_fully_shard_precision_replicate_np4 runs this case alone).
BOOST_AUTO_TEST_CASE(test_replicate_params_precision_2d) {
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

BOOST_AUTO_TEST_CASE(test_cpu_offload_pin_memory) {
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

// ===========================================================================
// Level 2: training features around fully_shard

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Gradients accumulated unsynchronised, by root-relative name.
std::map<std::string, at::Tensor> unsynced_of(const std::vector<prec::Unit>& units) {
  std::map<std::string, at::Tensor> out;
  for (const auto& u : units) {
    for (auto& [name, g] : u.fsdp.unsynced_grads()) out[u.prefix + name] = g;
  }
  return out;
}

void add_into(std::map<std::string, at::Tensor>& acc, const std::map<std::string, at::Tensor>& g) {
  for (const auto& [name, t] : g) acc[name] = acc.count(name) ? acc[name] + t : t.clone();
}

void sgd(torch::nn::Module& m, double lr) {
  at::NoGradGuard no_grad;
  for (auto& p : m.parameters()) {
    if (p.grad().defined()) p.sub_(p.grad() * lr);
  }
}

// L2-01 in one mesh form. Two accumulation cycles of N micro-steps with an
// SGD update between them; the micro-loss is divided by N, so that the merged
// gradient is the gradient of one large batch (the N global micro-batches
// together) on a single card.
//  - "1-D": set_requires_gradient_sync(false) on the first N-1 micro-steps.
//  - "HSDP (ws,1)": replicate = ws, shard = 1, gradient sync on but
//    set_requires_all_reduce(false) on the first N-1 micro-steps: each
//    replica reduces over its (one-rank) shard group only and keeps its own
//    gradient; the last micro-step all-reduces over the replicate dim. This
//    is the 2-rank form in which the all-reduce toggle has an effect: in a
//    (1,ws) mesh the replicate dim has one rank and nothing to skip.
void check_grad_accumulation(const std::string& id, bool hsdp) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const double tol = 1e-5, lr = 0.1;
  const int n_micro = 3;
  const int64_t seed = 21;
  fsdp::FullyShardOptions opts;
  if (hsdp) {
    opts.mesh = fsdp::init_device_mesh(spmd::device().type(), {ws, 1}, {"replicate", "shard"});
  }
  auto s = prec::shard_model(toy::Mlp(seed), opts, opts);
  const int64_t n_params = prec::managed_count(s.units());
  toy::Mlp ref(seed);
  ref->to(spmd::device());

  double merged_err = 0, middle_err = 0, min_spread = kInf, replica_spread = 0;
  for (int cycle = 0; cycle < 2; ++cycle) {
    std::vector<toy::Batch> batches;
    std::map<std::string, at::Tensor> own_acc;  // single card: this rank's slices so far
    for (int k = 0; k < n_micro; ++k) {
      const bool last = k == n_micro - 1;
      if (hsdp) {
        s.root.set_requires_all_reduce(last);
      } else {
        s.root.set_requires_gradient_sync(last);
      }
      batches.push_back(device_batch(200 + 10 * cycle + k, 8));
      const toy::Batch mine = toy::slice(batches.back(), rank, ws);
      fsdp::reset_collective_counters();
      at::Tensor loss = toy::mse(s.net(mine.x), mine.y) / n_micro;
      loss.backward();
      const auto c = fsdp::collective_counters();
      add_into(own_acc, prec::grads_of(*ref, toy::mse(ref(mine.x), mine.y) / n_micro));
      const std::string where = "[" + id + "] cycle " + std::to_string(cycle) + " micro-step " +
                                std::to_string(k);
      if (last) {
        // 1-D: one reduce-scatter per parameter. HSDP (ws,1): a one-rank
        // shard group scatters nothing; the replicate all-reduce runs now.
        BOOST_TEST(c.total("reduce_scatter") == (hsdp ? 0 : n_params),
                   where << " reduce_scatters " << c.total("reduce_scatter"));
        if (hsdp) {
          BOOST_TEST(c.total("all_reduce") > 0, where << ": no all-reduce on the last step");
        } else {
          BOOST_TEST(c.total("all_reduce") == 0, where << " all_reduces " << c.total("all_reduce"));
        }
        continue;
      }
      BOOST_TEST(c.total("reduce_scatter") == 0,
                 where << " reduce_scatters " << c.total("reduce_scatter"));
      BOOST_TEST(c.total("all_reduce") == 0, where << " all_reduces " << c.total("all_reduce"));
      // Not synchronised: each rank holds the sum of its own micro-batch
      // gradients. 1-D: the library's unsynced full gradients, param.grad()
      // untouched. HSDP: the replica's own reduction, either installed in
      // param.grad() (this library today) or kept aside until the all-reduce
      // (PyTorch FSDP2), in which case param.grad() stays undefined and
      // only the counters and the merged result below can be checked.
      const auto unsynced = unsynced_of(s.units());
      for (const auto& m : s.managed()) {
        at::Tensor g;
        if (hsdp) {
          g = m.param.grad();
          if (!g.defined()) continue;
        } else {
          BOOST_TEST(!m.param.grad().defined(), where << " " << m.name
                                                      << ".grad() set by an unsynced backward");
          g = unsynced.count(m.name) ? unsynced.at(m.name) : at::Tensor();
        }
        BOOST_TEST(g.defined(), where << " " << m.name << ": no accumulated gradient");
        const at::Tensor want = own_acc.at(m.name);
        const at::Tensor got = g.defined() ? g : at::zeros_like(want);
        const double e = diff(got, want);
        BOOST_TEST(e < tol, where << " " << m.name << " accumulated grad vs single card on this "
                                        "rank's micro-batches: " << e);
        middle_err = std::max(middle_err, e);
        const double spread = prec::spread_across_ranks(got);  // collective
        BOOST_TEST(spread > 1e-3, where << " " << m.name << " equal across ranks ("
                                        << spread << "): synchronised?");
        min_spread = std::min(min_spread, spread);
      }
    }
    // The large batch on a single card.
    const at::Tensor big_x = at::cat({batches[0].x, batches[1].x, batches[2].x});
    const at::Tensor big_y = at::cat({batches[0].y, batches[1].y, batches[2].y});
    const auto want = prec::grads_of(*ref, toy::mse(ref(big_x), big_y));
    for (const auto& [name, g] : unsynced_of(s.units())) {
      BOOST_TEST(!g.defined(), "[" << id << "] " << name << ": unsynced gradient left after the "
                                                          "synchronised backward");
    }
    for (const auto& m : s.managed()) {
      const at::Tensor g = m.param.grad();
      BOOST_TEST(g.defined(), "[" << id << "] " << m.name << " has no merged gradient");
      const at::Tensor got = g.defined() ? g : at::zeros_like(m.param);
      const double e = diff(got, local_part(want.at(m.name), m.dt));
      BOOST_TEST(e < tol, "[" << id << "] cycle " << cycle << " " << m.name
                              << " merged grad vs large-batch single card: " << e);
      merged_err = std::max(merged_err, e);
      if (hsdp) {
        // Replicas must hold the same gradient, or their parameters drift apart.
        const double spread = prec::spread_across_ranks(got);
        BOOST_TEST(spread == 0.0, "[" << id << "] cycle " << cycle << " " << m.name
                                      << " differs across HSDP replicas after the all-reduce: "
                                      << spread);
        replica_spread = std::max(replica_spread, spread);
      }
    }
    sgd(*s.model, lr);
    {
      at::NoGradGuard no_grad;
      for (auto& [name, p] : prec::named_params(*ref)) p.sub_(want.at(name) * lr);
    }
    s.root.zero_grad();
  }
  report(id, "merged grad vs large-batch single card", prec::max_over_ranks(merged_err), tol);
  report(id, "middle-step accumulated grad vs single card on own micro-batches",
         prec::max_over_ranks(middle_err), tol);
  const double spread = -prec::max_over_ranks(-min_spread);
  if (std::isfinite(spread)) {
    report(id, "middle-step grad spread across ranks (must be large)", spread, 0);
  } else {
    prec::note("[" + id + "] middle-step grads kept aside by the library (param.grad() undefined)");
  }
  if (hsdp) report(id, "merged grad spread across replicas (must be 0)", replica_spread, 0);
}

}  // namespace

// L2-01
BOOST_AUTO_TEST_CASE(test_gradient_accumulation) {
  check_grad_accumulation("L2-01 1-D", /*hsdp=*/false);
  check_grad_accumulation("L2-01 HSDP (" + std::to_string(spmd::world_size()) + ",1)",
                          /*hsdp=*/true);
}

// ===========================================================================
// L2-02: fc1 (a whole unit) and fc3.bias (one parameter of the root unit)
// frozen; fc2 and fc3.weight train. Frozen before fully_shard, and frozen
// after it (a fine-tuning script freezing an already sharded model).

BOOST_AUTO_TEST_CASE(test_frozen_params_mixed_training) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const double tol = 1e-5, lr = 0.1;
  const int64_t seed = 23;
  const std::set<std::string> frozen = {"fc1.weight", "fc1.bias", "fc3.bias"};
  auto freeze = [&](torch::nn::Module& m) {
    for (const auto& name : frozen) prec::param_named(m, name).requires_grad_(false);
  };
  for (bool after : {false, true}) {
    const std::string id = std::string("L2-02 frozen ") + (after ? "after" : "before") +
                           " fully_shard";
    toy::Mlp model(seed);
    if (!after) freeze(*model);
    auto s = prec::shard_model(model, {}, {});
    if (after) freeze(*s.model);
    toy::Mlp ref(seed);
    ref->to(spmd::device());
    freeze(*ref);

    std::map<std::string, at::Tensor> initial;
    int64_t trainable = 0;
    for (const auto& m : s.managed()) {
      BOOST_TEST(m.param.requires_grad() == (frozen.count(m.name) == 0),
                 "[" << id << "] " << m.name << " requires_grad " << m.param.requires_grad());
      if (frozen.count(m.name)) initial[m.name] = m.param.detach().clone();
      trainable += frozen.count(m.name) ? 0 : 1;
    }
    BOOST_TEST(initial.size() == frozen.size());

    double loss_err = 0, grad_err = 0;
    for (int step = 0; step < 2; ++step) {
      const toy::Batch batch = device_batch(230 + step, 8);
      const toy::Batch mine = toy::slice(batch, rank, ws);
      at::Tensor loss = toy::mse(s.net(mine.x), mine.y);
      fsdp::reset_collective_counters();
      loss.backward();
      const auto c = fsdp::collective_counters();
      // One reduce-scatter per trainable parameter: none for the frozen ones.
      BOOST_TEST(c.total("reduce_scatter") == trainable,
                 "[" << id << "] step " << step << " reduce_scatters "
                     << c.total("reduce_scatter") << ", trainable params " << trainable);
      BOOST_TEST(c.total("all_reduce") == 0);

      at::Tensor ref_loss = toy::mse(ref(batch.x), batch.y);
      const auto want = prec::grads_of(*ref, ref_loss);
      const double le = std::abs(prec::mean_over_ranks(loss.item<double>()) -
                                 ref_loss.item<double>());
      BOOST_TEST(le < tol, "[" << id << "] step " << step << " loss vs single card: " << le);
      loss_err = std::max(loss_err, le);
      for (const auto& m : s.managed()) {
        const at::Tensor g = m.param.grad();
        if (frozen.count(m.name)) {
          BOOST_TEST(!g.defined(), "[" << id << "] frozen " << m.name << " has a gradient");
          continue;
        }
        BOOST_TEST(g.defined(), "[" << id << "] " << m.name << " has no gradient");
        if (!g.defined()) continue;
        const double e = diff(g, local_part(want.at(m.name), m.dt));
        BOOST_TEST(e < tol, "[" << id << "] step " << step << " " << m.name
                                << " grad vs single card: " << e);
        grad_err = std::max(grad_err, e);
      }
      sgd(*s.model, lr);
      {
        at::NoGradGuard no_grad;
        for (auto& [name, p] : prec::named_params(*ref)) {
          if (want.count(name)) p.sub_(want.at(name) * lr);
        }
      }
      s.root.zero_grad();
      for (const auto& m : s.managed()) {
        if (!frozen.count(m.name)) continue;
        BOOST_TEST(diff(m.param, initial.at(m.name)) == 0.0,
                   "[" << id << "] frozen " << m.name << " changed at step " << step);
      }
    }
    // The trainable parameters did move (so the frozen check is not vacuous).
    double param_err = 0;
    const auto ref_params = prec::named_params(*ref);
    for (const auto& m : s.managed()) {
      const double e = diff(m.param, local_part(ref_params.at(m.name), m.dt));
      BOOST_TEST(e < tol, "[" << id << "] " << m.name << " after 2 SGD steps vs single card: "
                              << e);
      param_err = std::max(param_err, e);
    }
    report(id, "loss vs single card", prec::max_over_ranks(loss_err), tol);
    report(id, "trainable grad vs single card", prec::max_over_ranks(grad_err), tol);
    report(id, "params after SGD vs single card", prec::max_over_ranks(param_err), tol);
  }
}

// ===========================================================================
// L2-07: global gradient clipping over sharded (fc1.weight, fc2, fc3.weight),
// replicated (fc1.bias, replicate_params) and ignored (fc3.bias) parameters,
// in the 1-D mesh and both 2-rank 2-D meshes, for p = 2, inf and 3.

namespace {

std::string p_name(double p) { return std::isinf(p) ? "inf" : std::to_string(static_cast<int>(p)); }

// (sum |t|^p over the tensors)^(1/p), or max |t|, in double.
double norm_of(const std::vector<at::Tensor>& ts, double p) {
  double acc = 0;
  for (const auto& t : ts) {
    if (t.numel() == 0) continue;
    const at::Tensor a = t.detach().to(at::kDouble).abs();
    acc = std::isinf(p) ? std::max(acc, a.max().item<double>()) : acc + a.pow(p).sum().item<double>();
  }
  return std::isinf(p) ? acc : std::pow(acc, 1.0 / p);
}

void check_clip(const std::string& form, std::optional<fsdp::DeviceMesh> mesh) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const double tol = 1e-5;
  const int64_t seed = 27;
  toy::Mlp model(seed);
  fsdp::FullyShardOptions opts;
  opts.mesh = mesh;
  opts.replicate_params = {model->fc1->bias};
  opts.ignored_params = {model->fc3->bias};
  auto s = prec::shard_model(model, opts, opts);
  const fsdp::DeviceMesh& m_mesh = s.root.mesh();
  const int64_t shard_size = m_mesh.size(m_mesh.ndim() - 1);
  const at::Tensor ignored = s.model->fc3->bias;

  const toy::Batch batch = device_batch(270, 8);
  const toy::Batch mine = toy::slice(batch, rank, ws);
  toy::Mlp ref(seed);
  ref->to(spmd::device());
  const auto ref_grads = prec::grads_of(*ref, toy::mse(ref(batch.x), batch.y));
  std::vector<at::Tensor> ref_list;
  for (const auto& [name, g] : ref_grads) ref_list.push_back(g);

  for (double p : {2.0, kInf, 3.0}) {
    const std::string id = "L2-07 " + form + " p=" + p_name(p);
    s.root.zero_grad();
    ignored.mutable_grad() = at::Tensor();
    toy::mse(s.net(mine.x), mine.y).backward();
    if (p == 2.0) {
      // Plain (ignored) gradients count as each rank's own: before any
      // synchronisation the norm is the global managed part plus this
      // rank's own fc3.bias gradient (the single card on this rank's rows).
      const at::Tensor own = prec::grads_of(*ref, toy::mse(ref(mine.x), mine.y)).at("fc3.bias");
      const double managed_sq = std::pow(norm_of(ref_list, 2.0), 2) -
                                std::pow(norm_of({ref_grads.at("fc3.bias")}, 2.0), 2);
      const double want = std::sqrt(managed_sq + std::pow(norm_of({own}, 2.0), 2));
      const double got = fsdp::total_grad_norm({s.root}, {}, 2.0);
      BOOST_TEST(std::abs(got - want) < tol, "[" << form << "] norm with unsynchronised ignored "
                                                    "grads " << got << ", expected (own) "
                                                 << want);
      BOOST_TEST(prec::spread_across_ranks(own) > 1e-3, "[" << form << "] the ranks' own fc3.bias "
                                                              "grads do not differ");
    }
    // The ignored parameter's gradient is this rank's own; synchronise it
    // the way a user of ignored_params does (DDP-style mean), so that every
    // parameter's gradient is the single card's.
    {
      at::Tensor g = ignored.grad().detach().cpu().contiguous();
      fsdp::world_group()->all_reduce(g, fsdp::ReduceOp::AVG);
      ignored.mutable_grad().copy_(g);
    }
    const auto ms = s.managed();
    std::vector<at::Tensor> local_pieces = {ignored.grad()};  // what this rank holds
    for (const auto& m : ms) {
      BOOST_TEST((m.param.grad().sizes() == m.param.sizes()),
                 "[" << id << "] " << m.name << " grad holds more than the owned rows");
      local_pieces.push_back(m.param.grad());
    }

    const double ref_norm = norm_of(ref_list, p);
    const double max_norm = 0.5 * ref_norm;
    // What a per-shard clip would use: this rank's pieces alone.
    const double per_shard = norm_of(local_pieces, p);
    // Both entry points see the same parameters.
    const double by_params = fsdp::total_grad_norm(s.model->parameters(), p);
    fsdp::reset_collective_counters();
    const double returned = fsdp::clip_grad_norm_({s.root}, {}, max_norm, p);
    const auto c = fsdp::collective_counters();
    // One scalar all-reduce over the shard group; none when it has one rank
    // (in particular none over the replicate dim).
    BOOST_TEST(c.total("all_reduce") == (shard_size > 1 ? 1 : 0),
               "[" << id << "] all_reduces " << c.total("all_reduce"));
    BOOST_TEST(c.total("all_gather") + c.total("reduce_scatter") == 0);

    const double norm_err = std::max(std::abs(returned - ref_norm), std::abs(by_params - ref_norm));
    BOOST_TEST(norm_err < tol, "[" << id << "] total norm " << returned << " (by parameters "
                                   << by_params << ") vs single card " << ref_norm);
    if (p == 2.0) {
      if (shard_size > 1) {
        // Clipping each rank's pieces by their own norm would have given
        // other gradients than the single card's clipping.
        const double shard_coef = std::min(1.0, max_norm / (per_shard + 1e-6));
        double apart = 0;
        for (const auto& t : local_pieces) {
          apart = std::max(apart, t.detach().abs().max().item<double>() *
                                      std::abs(shard_coef - max_norm / (ref_norm + 1e-6)));
        }
        BOOST_TEST(apart > 10 * tol, "[" << id << "] per-shard clipping (norm " << per_shard
                                         << ") would differ from global clipping (norm "
                                         << ref_norm << ") by only " << apart);
      }
      // Counting the replicated fc1.bias once per rank would move the norm
      // by more than the tolerance, so the comparison below can see it.
      const double rep = norm_of({ref_grads.at("fc1.bias")}, 2.0);
      const double per_rank = std::sqrt(ref_norm * ref_norm + (ws - 1) * rep * rep);
      BOOST_TEST(per_rank - ref_norm > 10 * tol,
                 "[" << id << "] fc1.bias too small to tell once from per-rank counting");
    }

    const double coef = max_norm / (ref_norm + 1e-6);
    double grad_err = 0;
    for (const auto& m : ms) {
      const double e = diff(m.param.grad(), local_part(ref_grads.at(m.name) * coef, m.dt));
      BOOST_TEST(e < tol, "[" << id << "] " << m.name << " clipped grad vs single card: " << e);
      grad_err = std::max(grad_err, e);
    }
    {
      const double e = diff(ignored.grad(), ref_grads.at("fc3.bias") * coef);
      BOOST_TEST(e < tol, "[" << id << "] fc3.bias (ignored) clipped grad vs single card: " << e);
      grad_err = std::max(grad_err, e);
    }
    // After clipping, measured independently: the full gradients gathered.
    std::vector<at::Tensor> full = {ignored.grad()};
    for (const auto& m : ms) full.push_back(prec::full_of(m.param.grad(), m.dt));  // collective
    const double after = norm_of(full, p);
    BOOST_TEST(after <= max_norm + 1e-6, "[" << id << "] norm after clipping " << after
                                             << " > max_norm " << max_norm);
    const double after_lib = fsdp::total_grad_norm({s.root}, {}, p);
    BOOST_TEST(std::abs(after_lib - after) < tol);

    // Below the threshold nothing is scaled.
    std::vector<at::Tensor> before;
    for (const auto& t : local_pieces) before.push_back(t.clone());
    const double again = fsdp::clip_grad_norm_({s.root}, {}, 2 * max_norm, p);
    BOOST_TEST(std::abs(again - after) < tol);
    double moved = 0;
    for (size_t i = 0; i < before.size(); ++i) moved = std::max(moved, diff(before[i], local_pieces[i]));
    BOOST_TEST(moved == 0.0, "[" << id << "] clipping below max_norm changed a gradient by "
                                 << moved);

    report(id, "total norm vs single card", prec::max_over_ranks(norm_err), tol);
    report(id, "clipped grad vs single-card clipping", prec::max_over_ranks(grad_err), tol);
    report(id, "norm after clipping - max_norm (must be <= 1e-6)",
           prec::max_over_ranks(after - max_norm), 0);
    report(id, "per-shard norm (info: rank 0's) " + std::to_string(per_shard) + " vs global " +
                   std::to_string(ref_norm),
           prec::max_over_ranks(std::abs(per_shard - ref_norm)), 0);
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_grad_clip_with_dtensor_grads) {  // L2-07
  const int ws = spmd::world_size();
  check_clip("1-D", std::nullopt);
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{ws, 1},
                                            std::vector<int64_t>{1, ws}}) {
    check_clip("2-D (" + std::to_string(shape[0]) + "," + std::to_string(shape[1]) + ")",
               fsdp::init_device_mesh(spmd::device().type(), shape, {"replicate", "shard"}));
  }

  // Arguments are checked on every rank before any communication.
  auto s = prec::shard_model(toy::Mlp(29), {}, {});
  const toy::Batch mine = toy::slice(device_batch(290, 8), spmd::rank(), ws);
  toy::mse(s.net(mine.x), mine.y).backward();
  fsdp::reset_collective_counters();
  auto expect_arg = [&](const std::string& arg, const std::function<void()>& call,
                        const std::string& what) {
    try {
      call();
      BOOST_ERROR(what << ": no error");
    } catch (const fsdp::ArgumentError& e) {
      BOOST_TEST(e.argument() == arg, what << ": names '" << e.argument() << "': " << e.what());
    }
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (double bad : {0.0, -1.0, nan}) {
    expect_arg("max_norm", [&] { fsdp::clip_grad_norm_({s.root}, {}, bad); },
               "max_norm " + std::to_string(bad));
  }
  for (double bad : {0.0, -2.0, nan, -kInf}) {
    expect_arg("norm_type", [&] { fsdp::clip_grad_norm_({s.root}, {}, 1.0, bad); },
               "norm_type " + std::to_string(bad));
    expect_arg("norm_type", [&] { fsdp::total_grad_norm(s.model->parameters(), bad); },
               "total_grad_norm norm_type " + std::to_string(bad));
  }
  expect_arg("modules", [&] { fsdp::clip_grad_norm_({fsdp::FSDPModule()}, {}, 1.0); },
             "default FSDPModule");
  expect_arg("parameters", [&] { fsdp::clip_grad_norm_({at::Tensor()}, 1.0); },
             "undefined parameter");
  expect_arg("extra_params", [&] { fsdp::clip_grad_norm_({s.root}, {at::Tensor()}, 1.0); },
             "undefined extra parameter");
  const auto c = fsdp::collective_counters();
  BOOST_TEST(c.total("all_reduce") == 0, "a rejected call communicated");

  // Reductions left in flight by set_is_last_backward(false) are finished
  // before the norm is taken.
  toy::Mlp ref(29);
  ref->to(spmd::device());
  const toy::Batch whole = device_batch(290, 8);
  std::vector<at::Tensor> ref_list;
  for (const auto& [name, t] : prec::grads_of(*ref, toy::mse(ref(whole.x), whole.y))) {
    ref_list.push_back(t);
  }
  const double ref_norm = norm_of(ref_list, 2.0);
  s.root.zero_grad();
  s.root.set_is_last_backward(false);
  toy::mse(s.net(mine.x), mine.y).backward();
  const double in_flight = fsdp::total_grad_norm({s.root}, {});
  BOOST_TEST(std::abs(in_flight - ref_norm) < 1e-5,
             "norm with reductions in flight " << in_flight << " vs single card " << ref_norm);
  s.root.set_is_last_backward(true);

  // Units left unsharded by set_reshard_after_backward(false) hold their
  // sharded gradients aside: refused on every rank until resharded.
  s.root.zero_grad();
  s.root.set_reshard_after_backward(false);
  toy::mse(s.net(mine.x), mine.y).backward();
  BOOST_CHECK_THROW(fsdp::clip_grad_norm_({s.root}, {}, 1.0), fsdp::StateError);
  for (auto* u : {&s.fc1, &s.fc2, &s.root}) u->reshard();
  const double resharded = fsdp::total_grad_norm({s.root}, {});
  BOOST_TEST(std::abs(resharded - ref_norm) < 1e-5,
             "norm after reshard() " << resharded << " vs single card " << ref_norm);
  s.root.set_reshard_after_backward(true);

  // error_if_nonfinite: a NaN gradient is refused on every rank, before
  // anything is scaled.
  at::Tensor g = s.model->fc3->weight.grad();
  BOOST_TEST(g.defined());
  if (g.defined()) {
    g.view({-1})[0] = nan;
    const at::Tensor before = s.model->fc2->weight.grad().clone();
    expect_arg("parameters", [&] { fsdp::clip_grad_norm_({s.root}, {}, 1e-3, 2.0, true); },
               "NaN gradient with error_if_nonfinite");
    BOOST_TEST(diff(s.model->fc2->weight.grad(), before) == 0.0, "refused call scaled grads");
  }
}

// ===========================================================================
// L2-08: a model whose input has a sequence dim ([batch, seq, hidden]),
// with token mixing over the sequence, trained 5 steps with a different
// seq_len each step. Beyond the plan (finite loss and grad norm, shapes
// unchanged, no hang), each step is compared with the single card.

namespace {

struct SeqNetImpl : torch::nn::Module {
  explicit SeqNetImpl(int64_t seed) {
    at::manual_seed(seed);
    fc1 = register_module("fc1", torch::nn::Linear(6, 10));
    fc2 = register_module("fc2", torch::nn::Linear(10, 10));
    fc3 = register_module("fc3", torch::nn::Linear(10, 3));
  }
  at::Tensor forward(at::Tensor x) {  // [batch, seq, 6] -> [batch, seq, 3]
    at::Tensor h = at::tanh(fc1(x));
    // Attention-like mixing: the only place where seq_len enters the maths.
    const at::Tensor a = at::softmax(at::matmul(h, h.transpose(1, 2)) / std::sqrt(10.0), -1);
    h = at::tanh(fc2(at::matmul(a, h)));
    return fc3(h);
  }
  fsdp::Sharded<torch::nn::Linear> fc1{nullptr}, fc2{nullptr};
  torch::nn::Linear fc3{nullptr};
};
TORCH_MODULE(SeqNet);

}  // namespace

BOOST_AUTO_TEST_CASE(test_dynamic_sequence_length) {  // L2-08
  const int ws = spmd::world_size(), rank = spmd::rank();
  const std::string id = "L2-08";
  const double tol = 1e-5, lr = 0.1;
  const int64_t seed = 31, per_rank = 2;
  auto s = prec::shard_model(SeqNet(seed), {}, {});
  SeqNet ref(seed);
  ref->to(spmd::device());
  auto shapes = [&] {
    std::map<std::string, std::pair<std::vector<int64_t>, std::vector<int64_t>>> out;
    for (const auto& m : s.managed()) {
      out[m.name] = {m.param.sizes().vec(), m.dt.shape()};
    }
    return out;
  };
  const auto initial_shapes = shapes();
  BOOST_TEST(initial_shapes.size() == 6u);

  double loss_err = 0, grad_err = 0, norm_err = 0;
  const std::vector<int64_t> seq_lens = {5, 17, 3, 11, 8};
  for (size_t step = 0; step < seq_lens.size(); ++step) {
    const int64_t seq = seq_lens[step];
    const auto t0 = std::chrono::steady_clock::now();
    at::manual_seed(280 + static_cast<int64_t>(step));
    const at::Tensor x = at::randn({per_rank * ws, seq, 6}).to(spmd::device());
    const at::Tensor y = at::randn({per_rank * ws, seq, 3}).to(spmd::device());
    const at::Tensor mx = x.narrow(0, rank * per_rank, per_rank);
    const at::Tensor my = y.narrow(0, rank * per_rank, per_rank);
    const std::string where = "[" + id + "] step " + std::to_string(step) + " seq_len " +
                              std::to_string(seq);

    at::Tensor loss = toy::mse(s.net(mx), my);
    loss.backward();
    const double l = loss.item<double>();
    const double norm = fsdp::total_grad_norm({s.root}, {});
    BOOST_TEST(std::isfinite(l), where << " loss " << l);
    BOOST_TEST(std::isfinite(norm), where << " grad norm " << norm);

    at::Tensor ref_loss = toy::mse(ref(x), y);
    const auto want = prec::grads_of(*ref, ref_loss);
    std::vector<at::Tensor> want_list;
    for (const auto& [name, g] : want) want_list.push_back(g);
    const double le = std::abs(prec::mean_over_ranks(l) - ref_loss.item<double>());
    const double ne = std::abs(norm - norm_of(want_list, 2.0));
    BOOST_TEST(le < tol, where << " loss vs single card: " << le);
    BOOST_TEST(ne < tol, where << " grad norm vs single card: " << ne);
    loss_err = std::max(loss_err, le);
    norm_err = std::max(norm_err, ne);
    for (const auto& m : s.managed()) {
      const at::Tensor g = m.param.grad();
      BOOST_TEST(g.defined(), where << " " << m.name << " has no gradient");
      if (!g.defined()) continue;
      const double e = diff(g, local_part(want.at(m.name), m.dt));
      BOOST_TEST(e < tol, where << " " << m.name << " grad vs single card: " << e);
      grad_err = std::max(grad_err, e);
    }
    sgd(*s.model, lr);
    {
      at::NoGradGuard no_grad;
      for (auto& [name, p] : prec::named_params(*ref)) p.sub_(want.at(name) * lr);
    }
    s.root.zero_grad();
    BOOST_TEST((shapes() == initial_shapes), where << ": parameter shapes changed");
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // The plan's "no hang" as its own bound, not the harness watchdog's (an
    // environment variable can raise that one).
    BOOST_TEST(secs < 60.0, where << ": the step took " << secs << " s (plan: no hang, < 60 s)");
    prec::note(where + ": loss " + std::to_string(prec::mean_over_ranks(l)) + ", grad norm " +
               std::to_string(norm) + ", " + std::to_string(secs) + " s");
  }
  report(id, "loss vs single card", prec::max_over_ranks(loss_err), tol);
  report(id, "grad norm vs single card", prec::max_over_ranks(norm_err), tol);
  report(id, "grad vs single card", prec::max_over_ranks(grad_err), tol);
}
