// L2-09 (test_pp_fsdp_coupling): pipeline parallelism (fsdp::pp) composed
// with FSDP on a (pp=2, dp=2) mesh of 4 ranks, the precision matrix's
// "PP + FSDP, fp32" row, against a 4-rank DDP written in the test
// (common/with_pp_util.h describes model, data and baseline). Part of the test_fully_shard_with_pp
// executable (np 4, gpu4; labels L2, pp).
//
// Cases:
//   test_pp_fsdp_coupling            L2-09: GPipe, 1F1B, interleaved; 2 and 4 microbatches
//   test_pp_dynamic_sequence_length  L2-09 dynamic-seq [ours]: seq 5, 9, 3 over three steps
//
// Per configuration, two steps, each followed by torch::optim::AdamW (lr
// 1e-2, on the stage shards / on the full parameters), at 1e-5:
//   1. loss: broadcast_loss on every rank is the dp replica's share of the
//      step's mean loss (its microbatches / 16), compared with the DDP
//      ranks' losses on the same rows; summed over dp, the global mean;
//   1b. the global grad norm: the square root of the sum over the 4 ranks
//      (raw MPI) of their gradient shards' sums of squares, vs the norm of
//      the DDP gradient (the precision matrix's second metric, plan rule 3);
//   2. every parameter's gradient: each rank's local shard vs the same
//      rows of the DDP gradient (each full-model parameter is checked on
//      both dp ranks of the stage holding it);
//   3. the stage-boundary activation gradient received_output_grad(s, mb)
//      of every non-last local stage vs the gradient of the same activation
//      in a plain forward of the same rows with the same 1/16 scaling and no
//      1/dp factor (PARALLELISM.md 6.6.3);
//   4. the parameters after the two AdamW steps;
//   5. a rerun (fresh modules, same seed) bitwise identical;
//   6. exactly one all-gather and one reduce-scatter per FSDP unit with
//      parameters per step on the dp group (per parameter without
//      comm_fusion), and none elsewhere.
#include "baseline_metrics.h"
#include "tensor_diff.h"
#include "with_pp_util.h"

namespace {

// ---------------------------------------------------------------------------
// Comparisons

// Worst error over `got` vs the rows of `want` this rank holds (by
// `layout`), asserting each entry. Returns the worst.
double check_shards(const Named& got, const Named& want,
                    const std::map<std::string, fsdp::DTensor>& layout, const std::string& what,
                    int64_t* checked = nullptr) {
  double worst = 0;
  for (const auto& [name, dt] : layout) {
    auto g = got.find(name);
    auto w = want.find(name);
    BOOST_TEST((w != want.end()), what << ": " << name << " not in the reference");
    if (g == got.end() || w == want.end()) {
      worst = l1::kInf;
      continue;
    }
    BOOST_TEST(g->second.defined(), what << ": " << name << " undefined");
    const double e = testkit::max_abs_diff_or_inf(g->second, prec::local_part(w->second, dt));
    BOOST_TEST(e <= kTol, what << ": " << name << " error " << e);
    if (!(e <= worst)) worst = e;
    if (checked) ++*checked;
  }
  return worst;
}

// 0 when a and b hold the same names with bitwise equal tensors, else the
// largest difference (+inf for a missing entry or a shape / definedness
// mismatch, or for unequal bits with no numeric difference).
double bitwise_err(const Named& a, const Named& b, const std::string& what) {
  double worst = a.size() == b.size() ? 0.0 : l1::kInf;
  BOOST_TEST(a.size() == b.size(), what << ": " << a.size() << " vs " << b.size() << " entries");
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end()) {
      BOOST_ERROR(what << ": " << name << " missing in the second run");
      worst = l1::kInf;
      continue;
    }
    const at::Tensor& u = it->second;
    if (!t.defined() && !u.defined()) continue;
    double e = 0;
    if (t.defined() != u.defined() || t.sizes() != u.sizes()) {
      e = l1::kInf;
    } else if (!at::equal(t, u)) {
      e = testkit::max_abs_diff_or_inf(t, u);
      if (!(e > 0)) e = l1::kInf;
    }
    BOOST_TEST(e == 0, what << ": " << name << " differs between the two runs by " << e);
    worst = std::max(worst, e);
  }
  return worst;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// 1. losses.
void check_losses(const Config& c, const PPRun& run, const DdpRun& ddp, int dp_rank, bool last,
                  l1::Report& report, const std::string& n_steps) {
  double loss_err = 0;
  for (int step = 0; step < c.steps(); ++step) {
    const auto& per = ddp.rank_loss[static_cast<size_t>(step)];
    const double replica_ref = per[static_cast<size_t>(2 * dp_rank)] +
                               per[static_cast<size_t>(2 * dp_rank + 1)];
    const double e_rep = std::abs(run.replica_loss[static_cast<size_t>(step)] - replica_ref);
    const double e_glob = std::abs(run.global_loss[static_cast<size_t>(step)] -
                                   ddp.global_loss[static_cast<size_t>(step)]);
    BOOST_TEST(e_rep <= kTol, "step " << step << " dp replica " << dp_rank << " loss "
                                      << run.replica_loss[static_cast<size_t>(step)]
                                      << " vs DDP " << replica_ref);
    BOOST_TEST(e_glob <= kTol, "step " << step << " global loss "
                                       << run.global_loss[static_cast<size_t>(step)]
                                       << " vs DDP " << ddp.global_loss[static_cast<size_t>(step)]);
    loss_err = std::max({loss_err, e_rep, e_glob});
    if (std::isnan(e_rep) || std::isnan(e_glob)) loss_err = l1::kInf;
    // StepResult: n microbatch losses on the last stage (summing to the
    // replica's share), none elsewhere; the global count on every rank.
    const auto& mbl = run.mb_losses[static_cast<size_t>(step)];
    if (last) {
      BOOST_TEST(mbl.size() == static_cast<size_t>(c.n_mb));
      double sum = 0;
      for (double l : mbl) sum += l;
      BOOST_TEST(std::abs(sum - run.replica_loss[static_cast<size_t>(step)]) <= 1e-6,
                 "step " << step << " sum of StepResult::losses " << sum
                         << " vs broadcast_loss " << run.replica_loss[static_cast<size_t>(step)]);
    } else {
      BOOST_TEST(mbl.empty(), "step " << step << ": " << mbl.size()
                                      << " losses on a rank without the last stage");
    }
    // The divisor lives where the loss is: on the last stage's ranks.
    BOOST_TEST(run.global_count[static_cast<size_t>(step)] == (last ? c.global_count(step) : 0),
               "step " << step << " global_count");
  }
  report.check("loss vs DDP (dp replica share and global mean, " + n_steps + ")", loss_err,
               kTol);
}

// 1b. the global grad norm.
void check_grad_norm(const Config& c, const PPRun& run, const DdpRun& ddp, l1::Report& report,
                     const std::string& n_steps) {
  double norm_err = 0;
  for (int step = 0; step < c.steps(); ++step) {
    double mine = 0, want = 0;
    for (const auto& [name, g] : run.grads[static_cast<size_t>(step)]) mine += metrics::sq_sum(g);
    for (const auto& [name, g] : ddp.grads[static_cast<size_t>(step)]) want += metrics::sq_sum(g);
    const double got = std::sqrt(metrics::world_sum(mine));
    const double e = std::abs(got - std::sqrt(want));
    BOOST_TEST(e <= kTol, "step " << step << " global grad norm " << got << " vs DDP "
                                  << std::sqrt(want));
    if (!(e <= norm_err)) norm_err = e;
  }
  report.check("global grad norm vs DDP (" + n_steps + ")", norm_err, kTol);
}

// 2. gradients, every parameter (each on the two dp ranks of its stage).
void check_grads(const Config& c, const PPRun& run, const DdpRun& ddp, l1::Report& report,
                 const std::string& n_steps) {
  double grad_err = 0;
  int64_t checked = 0;
  for (int step = 0; step < c.steps(); ++step) {
    const double e = check_shards(run.grads[static_cast<size_t>(step)],
                                  ddp.grads[static_cast<size_t>(step)], run.layout,
                                  "step " + std::to_string(step) + " grad", &checked);
    if (!(e <= grad_err)) grad_err = e;
  }
  report.check("grad vs DDP (every parameter, shard rows, " + n_steps + ")", grad_err, kTol);
  const double total_checked = raw_mpi::sum_over_ranks(static_cast<double>(checked));
  const double n_params = static_cast<double>(ddp.params.size());
  BOOST_TEST(total_checked == kDp * n_params * c.steps(),
             "gradients checked: " << total_checked << ", expected " << kDp * n_params
                                   << " per step");
}

// 3. stage-boundary activation gradients.
void check_boundary_grads(const Config& c, const PPRun& run, const DdpRun& ddp,
                          l1::Report& report, const std::string& n_steps) {
  const int S = c.num_stages();
  double bd_err = 0;
  int64_t bd_checked = 0;
  for (int step = 0; step < c.steps(); ++step) {
    const Named& got = run.boundary[static_cast<size_t>(step)];
    const Named& want = ddp.boundary[static_cast<size_t>(step)];
    BOOST_TEST(got.size() == run.local_stages.size() * static_cast<size_t>(c.n_mb));
    for (int s : run.local_stages) {
      for (int mb = 0; mb < c.n_mb; ++mb) {
        const std::string key = boundary_key(s, mb);
        auto g = got.find(key);
        if (g == got.end()) {
          BOOST_ERROR("step " << step << " " << key << " not recorded");
          bd_err = l1::kInf;
          continue;
        }
        if (s == S - 1) {
          BOOST_TEST(!g->second.defined(), "step " << step << " " << key
                                                   << ": the last stage received an output "
                                                      "gradient");
          continue;
        }
        const at::Tensor& ref = want.at(key);
        BOOST_TEST(g->second.defined(), "step " << step << " " << key
                                                << ": no received gradient");
        const double e = testkit::max_abs_diff_or_inf(g->second, ref);
        BOOST_TEST(e <= kTol, "step " << step << " " << key << " boundary grad error " << e);
        if (!(e <= bd_err)) bd_err = e;
        ++bd_checked;
        // Not trivially small: a zero gradient would fail.
        BOOST_TEST(ref.abs().max().item<double>() > 1e-3, key);
      }
    }
  }
  report.check("stage-boundary grad vs reference h.grad (" + n_steps + ")", bd_err, kTol);
  const double bd_total = raw_mpi::sum_over_ranks(static_cast<double>(bd_checked));
  BOOST_TEST(bd_total == kDp * (S - 1) * c.n_mb * c.steps(), "boundary gradients checked");
}

// 6. one all-gather and one reduce-scatter per unit (per parameter
// without fusion) per step, all on the dp group.
// Returns the collectives expected per step on the dp group.
int64_t check_collective_counts(const Config& c, const PPRun& run) {
  const int64_t want = c.comm_fusion ? run.units_with_params : run.managed_params;
  for (int step = 0; step < c.steps(); ++step) {
    const auto& cnt = run.counts[static_cast<size_t>(step)];
    auto count_of = [&](const std::string& op, const std::string& group) {
      auto it = cnt.find({op, group});
      return it == cnt.end() ? int64_t{0} : it->second;
    };
    int64_t ag_all = 0, rs_all = 0;
    for (const auto& [key, n] : cnt) {
      if (key.first == "all_gather") ag_all += n;
      if (key.first == "reduce_scatter") rs_all += n;
    }
    BOOST_TEST(count_of("all_gather", run.dp_group) == want,
               "step " << step << " all-gathers on " << run.dp_group << ": "
                       << count_of("all_gather", run.dp_group) << ", expected " << want);
    BOOST_TEST(count_of("reduce_scatter", run.dp_group) == want,
               "step " << step << " reduce-scatters on " << run.dp_group << ": "
                       << count_of("reduce_scatter", run.dp_group) << ", expected " << want);
    BOOST_TEST(ag_all == want, "step " << step << " all-gathers on every group: " << ag_all);
    BOOST_TEST(rs_all == want, "step " << step << " reduce-scatters on every group: " << rs_all);
  }
  return want;
}

// 5. rerun bitwise.
void check_rerun_bitwise(const Config& c, const PPRun& run, l1::Report& report) {
  const PPRun again = run_pp(c);
  double rerun = 0;
  for (int step = 0; step < c.steps(); ++step) {
    const auto i = static_cast<size_t>(step);
    const bool same_loss = run.replica_loss[i] == again.replica_loss[i] &&
                           run.mb_losses[i] == again.mb_losses[i];
    BOOST_TEST(same_loss, "step " << step << " losses differ between the two runs");
    if (!same_loss) {
      const double e = std::abs(run.replica_loss[i] - again.replica_loss[i]);
      rerun = std::max(rerun, e > 0 ? e : l1::kInf);
    }
    rerun = std::max(rerun, bitwise_err(run.grads[i], again.grads[i],
                                        "step " + std::to_string(step) + " grads"));
    rerun = std::max(rerun, bitwise_err(run.boundary[i], again.boundary[i],
                                        "step " + std::to_string(step) + " boundary grads"));
  }
  rerun = std::max(rerun, bitwise_err(run.params, again.params, "params"));
  report.check("rerun bitwise (losses, grads, boundary grads, params)", rerun, 0);
}

void check_config(const Config& c) {
  BOOST_TEST_CONTEXT(c.id) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto mesh = pp_dp_mesh();
    const int dp_rank = mesh.get_local_rank("dp"), pp_rank = mesh.get_local_rank("pp");
    const int S = c.num_stages();
    const bool last = pp::stage_rank(S - 1, kPp) == pp_rank;

    const PPRun run = run_pp(c);
    const DdpRun ddp = run_ddp(c, run.local_stages, dp_rank);
    BOOST_TEST(ddp.min_abs_grad >= kGradMargin,
               "conditioning: the DDP gradient element " << ddp.min_abs_grad << " ("
                   << ddp.min_abs_where << ") is within " << kGradMargin
                   << " of zero, where AdamW amplifies rounding by up to lr/eps; choose other "
                      "data (kModelSeed)");
    l1::Report report(c.id);
    const std::string n_steps = std::to_string(c.steps()) + " steps";

    check_losses(c, run, ddp, dp_rank, last, report, n_steps);
    check_grad_norm(c, run, ddp, report, n_steps);
    check_grads(c, run, ddp, report, n_steps);
    check_boundary_grads(c, run, ddp, report, n_steps);

    // 4. parameters after the AdamW steps.
    const double param_err = check_shards(run.params, ddp.params, run.layout, "param");
    report.check("params after " + std::to_string(c.steps()) + " AdamW steps vs DDP", param_err,
                 kTol);

    const int64_t want = check_collective_counts(c, run);
    check_rerun_bitwise(c, run, report);

    report.publish();
    const double secs = prec::max_over_ranks(seconds_since(t0));
    std::ostringstream os;
    os << "[" << c.id << "] " << run.units_with_params << " units with parameters on rank "
       << spmd::rank() << ", " << want << " all-gathers + reduce-scatters per step; "
       << "case time " << secs << " s (two PP runs and the DDP reference)";
    prec::note(os.str());
  }
}

Config config(pp::ScheduleKind kind, int n_mb) {
  Config c;
  c.kind = kind;
  c.n_mb = n_mb;
  c.comm_fusion = n_mb == 4;
  c.id = "L2-09 " + pp::to_string(kind) + " mb" + std::to_string(n_mb);
  return c;
}

}  // namespace

// ---------------------------------------------------------------------------
// L2-09: every schedule, microbatches 2 (per-parameter collectives) and 4
// (comm_fusion: one per unit).

BOOST_AUTO_TEST_CASE(test_pp_fsdp_coupling, *spmd::needs_world_size(4, "pp=2, dp=2")) {  // L2-09
  for (const auto kind : {pp::ScheduleKind::GPipe, pp::ScheduleKind::OneFOneB,
                          pp::ScheduleKind::Interleaved1F1B}) {
    for (int n : {2, 4}) {
      BOOST_TEST_CONTEXT(pp::to_string(kind) << ", " << n << " microbatches") {
        check_config(config(kind, n));
      }
    }
  }
}

// Dynamic sequence length: [rows, seq, 16] inputs, seq 5, 9, 3 over three
// steps (AdamW between them), shapes exchanged with every transfer; the
// loss counts tokens. Same checks against the DDP reference.
BOOST_AUTO_TEST_CASE(test_pp_dynamic_sequence_length, *spmd::needs_world_size(4, "pp=2, dp=2")) {  // [ours] L2-09's set-up with dynamic sequence lengths
  for (int n : {2, 4}) {
    Config c = config(pp::ScheduleKind::OneFOneB, n);
    c.shapes = pp::ShapeMode::ExchangeEveryStep;
    c.seqs = {5, 9, 3};
    c.id = "L2-09 dynamic-seq 1f1b mb" + std::to_string(n);
    check_config(c);
  }
}
