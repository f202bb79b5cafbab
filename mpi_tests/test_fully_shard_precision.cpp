// fully_shard precision and option cases of the test plan's
// _test_fully_shard_precision.py, Level 1: ignored_params (L1-06),
// comm_fusion (L1-08 and the ON/OFF rows), the mixed precision matrix
// (L1-10..13 and the existing fp16/fp32 row), replicate_params 1-D/2-D and
// CPU offload. Runs at np 2 (CPU) and gpu2.
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

#include <fsdp/comm.h>
#include <fsdp/dtensor.h>
#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>

#include <cmath>
#include <map>
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
  const auto ms = prec::managed(s.units());
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

  // Plain tensors: full, untouched storage, not among the managed parameters.
  BOOST_TEST(model->fc1->weight.numel() == full_w1.numel());
  BOOST_TEST((model->fc1->weight.sizes() == full_w1.sizes()));
  BOOST_TEST(model->fc3->bias.numel() == full_b3.numel());
  BOOST_TEST(model->fc1->weight.data_ptr() == w1_ptr, "fc1.weight storage was replaced");
  std::set<std::string> names;
  int64_t managed_with_grad = 0;
  for (const auto& m : prec::managed(s.units())) {
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
  for (const auto& m : prec::managed(s.units())) {
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
  std::set<std::string> names2;
  for (const auto& m : prec::managed(s2.units())) names2.insert(m.name);
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
  int64_t units = 3, params = 6;
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
  for (size_t i = 0; i < r.parity.steps.size(); ++i) {
    const auto& st = r.parity.steps[i];
    // Every unit reshards after forward: one gather in forward, one in
    // backward, one reduce-scatter in backward.
    BOOST_TEST(st.fwd.total("all_gather") == want,
               "[" << id << "] step " << i << " forward all_gathers " << st.fwd.total("all_gather"));
    BOOST_TEST(st.bwd.total("all_gather") == want,
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
  for (const auto& m : prec::managed(s.units())) {
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
    for (const auto& m : prec::managed(s.units())) {
      if (pass == 0 && m.param.grad().defined()) {
        after_first[m.name] = m.param.grad().detach().clone();
      }
    }
  }
  BOOST_TEST(s.model->fc1->seen_weight == low);

  // param.grad() is the fp32 main grad, and main_grads() returns it.
  const auto ms = prec::managed(s.units());
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
    if (after_first.count(m.name)) {
      const double e = diff(after_first[m.name], local_part(emu_first.at(m.name), m.dt));
      BOOST_TEST(e < tol, m.name << " pass-1 main grad vs emulation: " << e);
      first_err = std::max(first_err, e);
    }
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
  // The plan asks for 1e-5 against an fp32 single card; with compute in a
  // 16-bit dtype that is out of reach (one bf16 ulp of these gradients is
  // ~1e-3), so it is reported, not asserted -- see the header comment.
  report(c.id, std::string("2-pass main grad vs fp32 single card (plan: 1e-5; not asserted, ") +
                   dt_name(low) + " compute)",
         prec::max_over_ranks(fp32_err), 0);
  report(c.id, "2-pass grad norm vs fp32 single card (info)", prec::max_over_ranks(fp32_norm_err),
         0);

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
    for (const auto& m : prec::managed(s2.units())) {
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
  for (const auto& m : prec::managed(s.units())) {
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
  for (const auto& m : prec::managed(s.units())) {
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

// This suite runs at np 2, so "2-D" is both 2-rank 2-D meshes:
// (replicate=2, shard=1) -- HSDP all-reduce path -- and (replicate=1, shard=2).
BOOST_AUTO_TEST_CASE(test_replicate_params_precision_2d) {
  const int ws = spmd::world_size();
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{ws, 1},
                                            std::vector<int64_t>{1, ws}}) {
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
    prec::note("[offload] CPU-only: CPUOffloadPolicy{pin_memory=true} is accepted and behaves "
               "like no offload (shards already on the CPU)");
  }
  fsdp::FullyShardOptions opts;
  opts.offload_policy = fsdp::CPUOffloadPolicy{true};
  auto s = prec::shard_model(toy::Mlp(9), opts, opts);
  auto check_on_cpu = [&](const std::string& when) {
    for (const auto& m : prec::managed(s.units())) {
      BOOST_TEST(m.dt.to_local().is_cpu(), m.name << " shard not on CPU " << when);
      BOOST_TEST(m.param.is_cpu(), m.name << " parameter not on CPU " << when);
      if (m.param.grad().defined()) {
        BOOST_TEST(m.param.grad().is_cpu(), m.name << " grad not on CPU " << when);
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
