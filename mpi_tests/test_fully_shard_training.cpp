// Training features around fully_shard (the plan's Level 2 cases of its
// precision file): gradient accumulation (L2-01), frozen parameters (L2-02),
// dynamic sequence length (L2-08). Part of the test_fully_shard_precision
// executable (np 2, gpu2).
//
// Cases:
//   test_gradient_accumulation         L2-01
//   test_frozen_params_mixed_training  L2-02
//   test_dynamic_sequence_length       L2-08
//
// Baselines are single-card runs of an unsharded copy of the same model
// (same seed) -- never another FSDP run (plan rule 1).
//    reference" of L1-13.
#include "baseline_metrics.h"
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

using prec::device_batch, prec::kInf, prec::local_part, prec::norm_of, prec::Managed, prec::report,
    prec::sgd;
using testkit::max_abs_diff;

}  // namespace

// ===========================================================================
// Level 2: training features around fully_shard

namespace {

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
  opts.comm_fusion = false;  // the counts below are per parameter (unset fuses on CUDA)
  if (hsdp) {
    opts.mesh = fsdp::init_device_mesh(spmd::device().type(), {ws, 1}, {"replicate", "shard"});
  }
  auto s = prec::shard_model(toy::Mlp(seed), opts, opts);
  const int64_t n_params = prec::managed_count(s.units());
  toy::Mlp ref(seed);
  ref->to(spmd::device());

  double merged_err = 0, middle_err = 0, min_spread = kInf, replica_spread = 0;
  // Plan rule 3's metrics per cycle: the accumulated loss and the merged
  // grad norm against the large-batch single card. The sums over ranks are
  // raw MPI over the shard group (1-D: the world; HSDP (ws,1): each rank
  // alone, holding the whole gradient).
  double loss_err = 0, norm_err = 0;
  const metrics::SubComm shard_comm(hsdp ? rank : 0, rank);
  for (int cycle = 0; cycle < 2; ++cycle) {
    double local_loss = 0;  // this rank's micro-losses (each already / N), summed
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
      local_loss += loss.item<double>();
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
      // untouched. HSDP: the replica's own reduction, installed in
      // param.grad() (what libfsdp does); were it kept aside until the
      // all-reduce instead (PyTorch FSDP2), it would be in unsynced_grads().
      // Either way it is checked: none at all fails below.
      const auto unsynced = unsynced_of(s.units());
      for (const auto& m : s.managed()) {
        at::Tensor g;
        if (hsdp) {
          g = m.param.grad();
          if (!g.defined() && unsynced.count(m.name)) g = unsynced.at(m.name);
        } else {
          BOOST_TEST(!m.param.grad().defined(), where << " " << m.name
                                                      << ".grad() set by an unsynced backward");
          g = unsynced.count(m.name) ? unsynced.at(m.name) : at::Tensor();
        }
        BOOST_TEST(g.defined(), where << " " << m.name << ": no accumulated gradient");
        const at::Tensor want = own_acc.at(m.name);
        const at::Tensor got = g.defined() ? g : at::zeros_like(want);
        const double e = max_abs_diff(got, want);
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
    const at::Tensor big_loss = toy::mse(ref(big_x), big_y);
    const auto want = prec::grads_of(*ref, big_loss);
    {
      // The large batch's loss is the mean over ranks of their accumulated
      // micro-losses (equal rows everywhere); its grad norm that of the
      // merged gradient's shards.
      const double le = std::abs(metrics::world_sum(local_loss) / ws - big_loss.item<double>());
      double want_sq = 0;
      for (const auto& [name, g] : want) want_sq += metrics::sq_sum(g);
      const double ne = std::abs(metrics::sharded_grad_norm(*s.model, shard_comm.get()) -
                                 std::sqrt(want_sq));
      BOOST_TEST(le < tol, "[" << id << "] cycle " << cycle
                               << " accumulated loss vs large-batch single card: " << le);
      BOOST_TEST(ne < tol, "[" << id << "] cycle " << cycle
                               << " merged grad norm vs large-batch single card: " << ne);
      if (!(le <= loss_err)) loss_err = le;
      if (!(ne <= norm_err)) norm_err = ne;
    }
    for (const auto& [name, g] : unsynced_of(s.units())) {
      BOOST_TEST(!g.defined(), "[" << id << "] " << name << ": unsynced gradient left after the "
                                                          "synchronised backward");
    }
    for (const auto& m : s.managed()) {
      const at::Tensor g = m.param.grad();
      BOOST_TEST(g.defined(), "[" << id << "] " << m.name << " has no merged gradient");
      const at::Tensor got = g.defined() ? g : at::zeros_like(m.param);
      const double e = max_abs_diff(got, local_part(want.at(m.name), m.dt));
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
  report(id, "accumulated loss (N micro-steps) vs large-batch single card",
         prec::max_over_ranks(loss_err), tol);
  report(id, "merged global grad norm vs large-batch single card", prec::max_over_ranks(norm_err),
         tol);
  report(id, "merged grad vs large-batch single card", prec::max_over_ranks(merged_err), tol);
  report(id, "middle-step accumulated grad vs single card on own micro-batches",
         prec::max_over_ranks(middle_err), tol);
  const double spread = -prec::max_over_ranks(-min_spread);
  BOOST_TEST(std::isfinite(spread), "[" << id << "] no middle-step gradient was checked");
  report(id, "middle-step grad spread across ranks (must be large)", spread, 0);
  if (hsdp) report(id, "merged grad spread across replicas (must be 0)", replica_spread, 0);
}

}  // namespace

// L2-01
BOOST_AUTO_TEST_CASE(test_gradient_accumulation) {  // L2-01
  check_grad_accumulation("L2-01 1-D", /*hsdp=*/false);
  check_grad_accumulation("L2-01 HSDP (" + std::to_string(spmd::world_size()) + ",1)",
                          /*hsdp=*/true);
}

// ===========================================================================
// L2-02: fc1 (a whole unit) and fc3.bias (one parameter of the root unit)
// frozen; fc2 and fc3.weight train. Frozen before fully_shard, and frozen
// after it (a fine-tuning script freezing an already sharded model).

BOOST_AUTO_TEST_CASE(test_frozen_params_mixed_training) {  // L2-02
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
    fsdp::FullyShardOptions per_param;  // the counts below are per parameter
    per_param.comm_fusion = false;
    auto s = prec::shard_model(model, per_param, per_param);
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
        const double e = max_abs_diff(g, local_part(want.at(m.name), m.dt));
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
        BOOST_TEST(max_abs_diff(m.param, initial.at(m.name)) == 0.0,
                   "[" << id << "] frozen " << m.name << " changed at step " << step);
      }
    }
    // The trainable parameters did move (so the frozen check is not vacuous).
    double param_err = 0;
    const auto ref_params = prec::named_params(*ref);
    for (const auto& m : s.managed()) {
      const double e = max_abs_diff(m.param, local_part(ref_params.at(m.name), m.dt));
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
      const double e = max_abs_diff(g, local_part(want.at(m.name), m.dt));
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
