// Mixed precision (MixedPrecisionPolicy), the plan's L1-10..13 and its
// existing (fp16, fp32, True, False) row. Part of the test_fully_shard_precision
// executable (np 2, gpu2; the fp16 forms also in test_fully_shard_precision_fp16_gpu1).
//
// Cases:
//   test_mp_fp16_param_fp32_reduce         existing row (fp16, fp32, True, False)
//   test_mp_bf16_param_fp32_reduce         L1-10
//   test_mp_bf16_all_bf16                  L1-11
//   test_mp_cast_forward_inputs_false      L1-12
//   test_mp_apply_grad_on_fp32_main_grad   L1-13
// On CPU LibTorch 1.13 has no fp16 GEMM: the fp16 rows run in bf16 there
// (prec::plan_fp16 says so in the output and the precision report) and in
// fp16 under the gpu labels.
//
// Baselines are single-card runs of an unsharded copy of the same model
// (same seed) -- never another FSDP run (plan rule 1).
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

using prec::device_batch, prec::local_part, prec::Managed, prec::report;
using testkit::max_abs_diff;

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

// 16-bit compute as a GPU runs it, emulated in fp32 on the CPU for PMlp
// (where LibTorch 1.13 has no fp16 GEMM): parameters and inputs rounded to
// `low`, every op accumulating in fp32 and rounding its output to `low` once
// (cuBLAS GEMMs with fp32 accumulation, elementwise kernels computing in
// registers), forward and backward by hand; the MSE in fp32 as toy::mse
// promotes it. Returns the fp32 gradients of the mean loss over (x, y).
std::map<std::string, at::Tensor> emulate_low_compute(int64_t seed, c10::ScalarType low,
                                                      const at::Tensor& x, const at::Tensor& y) {
  prec::PMlp m(seed, false);
  auto p = prec::named_params(*m);
  auto r = [low](const at::Tensor& t) { return t.detach().to(at::kCPU, at::kFloat).to(low).to(at::kFloat); };
  const at::Tensor w1 = r(p.at("fc1.weight")), b1 = r(p.at("fc1.bias"));
  const at::Tensor w2 = r(p.at("fc2.weight")), b2 = r(p.at("fc2.bias"));
  const at::Tensor w3 = r(p.at("fc3.weight")), b3 = r(p.at("fc3.bias"));
  const at::Tensor x0 = r(x);
  const at::Tensor h1 = r(at::tanh(r(at::addmm(b1, x0, w1.t()))));
  const at::Tensor h2 = r(at::tanh(r(at::addmm(b2, h1, w2.t()))));
  const at::Tensor out = r(at::addmm(b3, h2, w3.t()));
  const at::Tensor yt = y.detach().to(at::kCPU, at::kFloat);
  const at::Tensor g3 = r((out - yt) * (2.0 / static_cast<double>(out.numel())));
  std::map<std::string, at::Tensor> g;
  g["fc3.weight"] = r(g3.t().mm(h2));
  g["fc3.bias"] = r(g3.sum(0));
  const at::Tensor d2 = r(r(g3.mm(w3)) * (1 - h2 * h2));
  g["fc2.weight"] = r(d2.t().mm(h1));
  g["fc2.bias"] = r(d2.sum(0));
  const at::Tensor d1 = r(r(d2.mm(w2)) * (1 - h1 * h1));
  g["fc1.weight"] = r(d1.t().mm(x0));
  g["fc1.bias"] = r(d1.sum(0));
  return g;
}

// L1-13's FSDP gradient, emulated: per pass each rank's slice in `low`
// compute, its fp32 gradient averaged over the ranks in fp32, the passes
// accumulated in fp32 (the fp32 main grad). Its max gap to the gradients of
// the fp32 single card's parameters (`fp32`, by name).
double emulated_main_grad_gap(int64_t seed, c10::ScalarType low,
                              const std::vector<toy::Batch>& batches,
                              const std::map<std::string, at::Tensor>& fp32) {
  const int ws = spmd::world_size();
  std::map<std::string, at::Tensor> total;
  for (const auto& b : batches) {
    for (int r = 0; r < ws; ++r) {
      const toy::Batch mine = toy::slice(b, r, ws);
      for (auto& [name, g] : emulate_low_compute(seed, low, mine.x, mine.y)) {
        const at::Tensor share = g / static_cast<double>(ws);
        total[name] = total.count(name) ? total[name] + share : share;
      }
    }
  }
  double gap = 0;
  for (const auto& [name, g] : total) {
    gap = std::max(gap, max_abs_diff(g, fp32.at(name).grad().detach().to(at::kCPU, at::kFloat)));
  }
  return gap;
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
    worst_elem = std::max(worst_elem, max_abs_diff(full, ref_g));
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
    const double e = max_abs_diff(m.param.grad(), local_part(emu.grads.at(m.name), m.dt));
    BOOST_TEST(e < tol_emul, "[" << c.id << "] " << m.name << " grad vs micro-batch emulation: "
                                 << e);
    emu_grad_err = std::max(emu_grad_err, e);
  }
  report(c.id, "local loss vs single-card micro-batch emulation", prec::max_over_ranks(emu_loss_err),
         tol_emul);
  report(c.id, "grad vs single-card micro-batch emulation", prec::max_over_ranks(emu_grad_err),
         tol_emul);
}

}  // namespace

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

namespace {

using MpModel = prec::ShardedModel<prec::PMlp>;

// L1-13: param.grad() is the fp32 main grad, and main_grads() returns it.
void check_main_grads_are_param_grads(const MpModel& s, const std::vector<prec::Managed>& ms) {
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
      BOOST_TEST(max_abs_diff(it->second, g) == 0.0,
                 m.name << ": main_grads() differs from param.grad()");
    }
  }
}

// L1-13's matching single-card reference: micro-batch emulation of both
// passes (total), and of the first alone (first), accumulated in fp32.
struct EmulatedPasses {
  std::map<std::string, at::Tensor> total, first;
};

EmulatedPasses emulate_passes(int64_t seed, const MpConfig& c,
                              const std::vector<toy::Batch>& batches) {
  EmulatedPasses out;
  for (size_t pass = 0; pass < batches.size(); ++pass) {
    const Emulation e = emulate(seed, c, batches[pass]);
    for (const auto& [name, g] : e.grads) {
      const at::Tensor g32 = g.to(at::kFloat);
      if (pass == 0) out.first[name] = g32;
      out.total[name] = out.total.count(name) ? out.total[name] + g32 : g32;
    }
  }
  return out;
}

// L1-13 on the CPU, where bf16 stands in for fp16: the gaps to the fp32
// single card (ref32's gradients) are expected failures, and the fp16
// form's gap is estimated by emulation.
void record_cpu_stand_in_gaps(const MpConfig& c, c10::ScalarType low, int64_t seed,
                              const std::vector<toy::Batch>& batches, prec::PMlp ref32,
                              double fp32_gap, double fp32_norm_gap, double tol) {
  const int rank = spmd::rank();
  const std::string why = std::string(dt_name(low)) +
                          " compute on CPU (the fp16 stand-in): its ulp at these gradients is "
                          "~1e-3, so 1e-5 against fp32 is out of reach; the fp16 form under "
                          "the gpu labels asserts it";
  prec::expected_failure(c.id, "2-pass main grad vs fp32 single card", fp32_gap, tol, why);
  prec::expected_failure(c.id, "2-pass grad norm vs fp32 single card", fp32_norm_gap, tol, why);

  // What the fp16 form (gpu labels) will see, estimated here: the same
  // training emulated with fp16 rounding. The emulator is first held to
  // the bf16 gap just measured (the same emulation with bf16 rounding must
  // land within 4x of it), then its fp16 figure is recorded: an expected
  // failure when above the plan's 1e-5, which the gpu entries keep
  // asserting (docs/test-plan.md, "L1-13's fp16 form").
  const double emu_bf16 =
      emulated_main_grad_gap(seed, at::kBFloat16, batches, prec::named_params(*ref32));
  const double emu_fp16 =
      emulated_main_grad_gap(seed, at::kHalf, batches, prec::named_params(*ref32));
  const double ratio = emu_bf16 / fp32_gap;
  BOOST_TEST((ratio >= 0.25 && ratio <= 4.0),
             "the 16-bit emulator's bf16 gap " << emu_bf16 << " is not within 4x of the measured "
                                               << fp32_gap
                                               << ": its fp16 estimate is not credible");
  if (rank == 0) {
    std::cout << "[" << c.id << "] 16-bit emulator: bf16 gap " << emu_bf16 << " (measured "
              << fp32_gap << "), fp16 gap " << emu_fp16 << std::endl;
  }
  const std::string what = "fp16 form, estimated on CPU (fp16-rounding emulation): 2-pass main "
                           "grad vs fp32 single card";
  if (emu_fp16 <= tol) {
    prec::report(c.id, what, emu_fp16, tol);
  } else {
    prec::expected_failure(c.id, what, emu_fp16, tol,
                           "fp16 compute rounds each op to an 11-bit significand; at these "
                           "gradients that alone exceeds 1e-5: the plan's 1e-5 is not reachable "
                           "with fp16 parameters, and the gpu entries, which assert it, are "
                           "expected to miss it by about this much");
  }
}

// L1-13: the fp32 main grad is what keeps the gradient fp32 when the
// reduction is 16-bit: reduce_dtype = low with and without the flag.
void check_low_reduce_dtype(int64_t seed, c10::ScalarType low,
                            const std::vector<toy::Batch>& batches) {
  const int ws = spmd::world_size(), rank = spmd::rank();
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

}  // namespace

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

  const auto ms = s.managed();
  check_main_grads_are_param_grads(s, ms);

  const EmulatedPasses emu = emulate_passes(seed, c, batches);
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
    const double e1 =
        after_first.count(m.name)
            ? max_abs_diff(after_first[m.name], local_part(emu.first.at(m.name), m.dt))
            : std::numeric_limits<double>::infinity();
    BOOST_TEST(e1 < tol, m.name << " pass-1 main grad vs emulation: " << e1);
    first_err = std::max(first_err, e1);
    const double e = max_abs_diff(g, local_part(emu.total.at(m.name), m.dt));
    BOOST_TEST(e < tol, m.name << " accumulated main grad vs emulation: " << e);
    total_err = std::max(total_err, e);
    fp32_err = std::max(fp32_err, max_abs_diff(g, local_part(r32.at(m.name).grad(), m.dt)));
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
    record_cpu_stand_in_gaps(c, low, seed, batches, ref32, fp32_gap, fp32_norm_gap, tol);
  }

  check_low_reduce_dtype(seed, low, batches);
}
