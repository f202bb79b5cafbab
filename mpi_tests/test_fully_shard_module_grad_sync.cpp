// Gradient synchronisation controls of FSDPModule (plan target
// _test_fully_shard_module.py): set_requires_all_reduce on a 2x2 HSDP mesh
// (L1-02), set_reduce_op_type (L1-03), zero_grad (L1-04), and the plan's
// existing rows set_requires_gradient_sync and set_is_last_backward, with
// set_gradient_scaling_factor [ours]. Part of the test_fully_shard_module
// executable (np 1, 2, 4; gpu1, gpu2, gpu4).
//
// Cases:
//   test_set_requires_all_reduce      L1-02 (np 4: the 2x2 HSDP mesh)
//   test_set_reduce_op_type           L1-03
//   test_zero_grad                    L1-04
//   test_set_requires_gradient_sync   existing: set_requires_gradient_sync
//   test_set_is_last_backward         existing: set_is_last_backward
//   test_set_gradient_scaling_factor  [ours]
//
// Baseline everywhere: the same model unsharded on one card (same seed), run
// on the whole global batch; a rank's sharded gradient must equal its rows of
// the single-card gradient. L1-02 and L1-03 (precision-matrix cases) also
// record the loss and the global grad norm against the single card, summed
// over ranks with raw MPI (common/baseline_metrics.h).
#include "baseline_metrics.h"
#include "fully_shard_module_util.h"
#include "tensor_diff.h"

namespace {
// Forward + backward of a sharded MLP on this rank's rows; the local loss.
double step_loss(l1::ShardedMlp& m, const toy::Batch& b) {
  at::Tensor loss = m.loss(b);
  loss.backward();
  return loss.item<double>();
}
// The single-card loss of `b` on a reference model (its parameters as they are).
double ref_loss(toy::MlpImpl& ref, const toy::Batch& b) {
  at::NoGradGuard no_grad;
  return toy::mse(ref.forward(b.x), b.y).item<double>();
}
}  // namespace

// ============================================================================
// L1-02: set_requires_all_reduce on a 2x2 HSDP mesh.
// ============================================================================
BOOST_AUTO_TEST_CASE(test_set_requires_all_reduce,  // L1-02
                     *spmd::needs_world_size(4, "a 2x2 (replicate, shard) mesh")) {
  l1::Report rep("L1-02");
  const Hsdp h = make_hsdp();
  fsdp::FullyShardOptions o = per_param_options();
  o.mesh = h.mesh;
  const int64_t seed = 21;
  l1::ShardedMlp m(seed, o);
  // The loss and grad norm metrics (plan rule 3) sum over raw MPI groups: a
  // replica's shard group (its 2 ranks) and the world.
  const metrics::SubComm shard_comm(h.replica_index, h.shard_index);

  // Off (recurse): each replica keeps its own shard-group mean -- the
  // single-card grad of its half of the batch -- and replicas differ.
  {
    const auto global = toy::global_batch(201, kRows);
    m.root.set_requires_all_reduce(false);
    fsdp::reset_collective_counters();
    const double loss = step_loss(m, hsdp_mine(global));
    const auto c = fsdp::collective_counters();
    BOOST_TEST(c.total("all_reduce", h.replicate_group) == 0,
               "off: all-reduces on the replicate group: " << c.total("all_reduce", h.replicate_group));
    BOOST_TEST(c.total("reduce_scatter", h.shard_group) == kMlpParams,
               "off: reduce-scatters on the shard group: " << c.total("reduce_scatter", h.shard_group));
    const auto half = replica_rows(global, h.replica_index);
    const auto half_ref = ref_grads(seed, {half});
    rep.check("off: grads vs single card on the replica's half", hsdp_grad_err(m, h, half_ref),
              kGradTol);
    // The replica's loss (the mean of its ranks' losses: equal rows) and
    // grad norm (over its shard group) are the single card's on its half.
    rep.check("off: replica loss vs single card on the replica's half",
              std::abs(shard_comm.sum(loss) / 2 - ref_loss(*half_ref, half)), kGradTol);
    rep.check("off: replica grad norm vs single card on the replica's half",
              std::abs(metrics::sharded_grad_norm(m.module(), shard_comm.get()) -
                       metrics::grad_norm(*half_ref)),
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
    const double loss = step_loss(m, hsdp_mine(global));
    const auto c = fsdp::collective_counters();
    BOOST_TEST(c.total("all_reduce", h.replicate_group) == kMlpParams,
               "on: all-reduces on the replicate group: " << c.total("all_reduce", h.replicate_group)
                                                          << ", expected " << kMlpParams);
    rep.check("on (after an off step + zero_grad): replicas equal", replica_gap(m, h, "").second,
              kReplicaTol);
    const auto full_ref = ref_grads(seed, {global});
    rep.check("on (after an off step + zero_grad): grads vs single card",
              hsdp_grad_err(m, h, full_ref), kGradTol);
    // The global loss (the mean over the 4 ranks: equal rows) and each
    // replica's grad norm (over its shard group) are the single card's.
    rep.check("on: global loss vs single card",
              std::abs(metrics::world_sum(loss) / spmd::world_size() - ref_loss(*full_ref, global)),
              kGradTol);
    rep.check("on: global grad norm (each replica) vs single card",
              std::abs(metrics::sharded_grad_norm(m.module(), shard_comm.get()) -
                       metrics::grad_norm(*full_ref)),
              kGradTol);
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
  double loss_worst = 0, norm_worst = 0;  // plan rule 3's metrics, every step
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
    const double loss = step_loss(m, mine(global));
    ref_opt.zero_grad();
    const double want_loss = l1::ref_backward(ref, global);
    const double scale = sum ? ws : 1.0;
    const double ge = l1::grad_err(m.module(), *ref, ws, rank, scale);
    // The global loss (the mean of the ranks' losses: equal rows) and the
    // global grad norm of the shards (raw MPI sums over the world) against
    // the single card's; "sum" scales the gradient, not the loss.
    const double le = std::abs(metrics::world_sum(loss) / ws - want_loss);
    const double ne = std::abs(metrics::sharded_grad_norm(m.module(), MPI_COMM_WORLD) -
                               scale * metrics::grad_norm(*ref));
    BOOST_TEST(le <= kGradTol, "step " << k << " (" << modes[k] << "): loss error " << le);
    BOOST_TEST(ne <= kGradTol, "step " << k << " (" << modes[k] << "): grad norm error " << ne);
    if (!(le <= loss_worst)) loss_worst = le;
    if (!(ne <= norm_worst)) norm_worst = ne;
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
      const double e = std::max(
          testkit::max_abs_diff_or_inf(s->exp_avg(), l1::my_rows(rs->exp_avg(), ws, rank)),
          testkit::max_abs_diff_or_inf(s->exp_avg_sq(), l1::my_rows(rs->exp_avg_sq(), ws, rank)));
      state_worst = std::max(state_worst, e);
      BOOST_TEST(e <= kGradTol, "step " << k << ": Adam state of " << item.key() << " error " << e);
    }
  }
  rep.check("\"sum\": grad vs ref_grad * world_size", grad_worst_sum, kGradTol);
  rep.check("\"avg\": grad vs ref_grad", grad_worst_avg, kGradTol);
  rep.check("global loss vs single card (6 Adam steps across mode switches)", loss_worst, kGradTol);
  rep.check("global grad norm vs single card (x world_size under \"sum\"; 6 steps)", norm_worst,
            kGradTol);
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
      data_change = std::max(data_change, testkit::max_abs_diff_or_inf(params[i], snapshot[i]));
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

BOOST_AUTO_TEST_CASE(test_set_requires_gradient_sync, *multi_rank()) {  // existing
  l1::Report rep("requires_gradient_sync");
  const int64_t seed = 65;
  l1::ShardedMlp m(seed, per_param_options());
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
        worst =
            std::max(worst, r == nullptr ? l1::kInf : testkit::max_abs_diff_or_inf(g, r->grad()));
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

BOOST_AUTO_TEST_CASE(test_set_gradient_scaling_factor) {  // [ours]
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
