// L0: the SPMD harness itself. The two disabled cases misbehave on purpose;
// CTest runs each alone (test_harness_aggregation, test_harness_watchdog) and
// checks the exit status and the harness's report (cmake/RunAndCheck.cmake).
// A case whose precondition fails must be reported as skipped, with its
// reason, never as a pass (test_harness_skip).
#include "spmd.h"

#include <fsdp/comm.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>

#include <chrono>
#include <thread>

namespace utf = boost::unit_test;

BOOST_AUTO_TEST_CASE(every_rank_runs_every_case) {  // [ours]
  // Each rank contributes 1: the sum proves all of them are in this case.
  auto t = at::ones({1}, at::kInt);
  fsdp::world_group()->all_reduce(t);
  BOOST_TEST(t.item<int>() == spmd::world_size());
  BOOST_TEST(spmd::current_case() == "every_rank_runs_every_case");
}

// Fails on rank 1 only; the harness must fail it on every rank and name rank 1.
BOOST_AUTO_TEST_CASE(fails_on_rank_1, *utf::disabled()) {  // [ours]
  if (spmd::rank() == 1) BOOST_ERROR("deliberate failure on rank 1");
}

// Rank 1 waits in an all_reduce that rank 0 never joins; the watchdog must
// name the case, the rank and the stuck collective, then abort the job.
BOOST_AUTO_TEST_CASE(hangs_on_rank_0, *utf::disabled()) {  // [ours]
  if (spmd::rank() == 0) {
    std::this_thread::sleep_for(std::chrono::seconds(30));
  } else {
    auto t = at::ones({1}, at::kFloat);
    fsdp::world_group()->all_reduce(t);
  }
}

// Never runs below 64 ranks: it would fail. test_harness_skip runs it alone
// and requires the skip in the summary and the reason on stdout.
BOOST_AUTO_TEST_CASE(skipped_below_64_ranks,  // [ours]
                     *spmd::needs_world_size_at_least(64, "the harness's skip check")) {
  BOOST_ERROR("ran although its precondition failed");
}
