// Global gradient clipping over DTensor gradients, the plan's L2-07. Part of
// the test_fully_shard_precision executable (np 2, gpu2).
//
// Cases:
//   test_grad_clip_with_dtensor_grads   L2-07 (and the argument checks of
//                                       clip_grad_norm_ after it)
//
// Baselines are single-card runs of an unsharded copy of the same model
// (same seed) -- never another FSDP run (plan rule 1).
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

using prec::device_batch, prec::kInf, prec::local_part, prec::norm_of, prec::Managed, prec::report;
using testkit::max_abs_diff;

}  // namespace

// ===========================================================================
// L2-07: global gradient clipping over sharded (fc1.weight, fc2, fc3.weight),
// replicated (fc1.bias, replicate_params) and ignored (fc3.bias) parameters,
// in the 1-D mesh and both 2-rank 2-D meshes, for p = 2, inf and 3.

namespace {

std::string p_name(double p) { return std::isinf(p) ? "inf" : std::to_string(static_cast<int>(p)); }

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
      const double e = max_abs_diff(m.param.grad(), local_part(ref_grads.at(m.name) * coef, m.dt));
      BOOST_TEST(e < tol, "[" << id << "] " << m.name << " clipped grad vs single card: " << e);
      grad_err = std::max(grad_err, e);
    }
    {
      const double e = max_abs_diff(ignored.grad(), ref_grads.at("fc3.bias") * coef);
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
    for (size_t i = 0; i < before.size(); ++i)
      moved = std::max(moved, max_abs_diff(before[i], local_pieces[i]));
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
    BOOST_TEST(max_abs_diff(s.model->fc2->weight.grad(), before) == 0.0,
               "refused call scaled grads");
  }
}
