// fsdp::GracefulStop (fsdp/graceful_stop.h) [ours]: a signal or request on
// ONE rank becomes a stop every rank agrees on; typed errors; handlers
// restored. fsdp-train's end-to-end check (a real SIGTERM / SIGUSR1 to one
// rank of a training job, checkpoint, resume bitwise) is
// fsdp_train_stop_sig{term,usr1}_np2 (tools/fsdp-train/tests/stop-check.sh).
#include "l1_util.h"
#include "spmd.h"

#include <fsdp/errors.h>
#include <fsdp/graceful_stop.h>
#include <fsdp/mesh.h>

#include <csignal>

namespace {
// The handler's effect on this process, read without the collective.
bool handler_is(int sig, void (*fn)(int)) {
  struct sigaction now {};
  sigaction(sig, nullptr, &now);
  return now.sa_handler == fn;
}
}  // namespace

BOOST_AUTO_TEST_CASE(test_one_rank_signal_stops_every_rank) {
  const int last = spmd::world_size() - 1;
  {
    fsdp::GracefulStop stop;
    BOOST_TEST(!stop.requested());
    BOOST_TEST(!stop.should_stop());  // nobody asked: every rank goes on
    if (spmd::rank() == last) std::raise(SIGUSR1);
    BOOST_TEST(stop.requested() == (spmd::rank() == last));
    BOOST_TEST(stop.signal() == (spmd::rank() == last ? SIGUSR1 : 0));
    BOOST_TEST(stop.should_stop());  // every rank, also those without the signal
    BOOST_TEST(stop.agreed_signal() == SIGUSR1);
    BOOST_TEST(stop.should_stop());  // stays agreed
  }
  // The previous (default) handlers are back.
  BOOST_TEST(handler_is(SIGUSR1, SIG_DFL));
  BOOST_TEST(handler_is(SIGTERM, SIG_DFL));
  {
    // request() from code on rank 0, a group of its own: no signal to name.
    fsdp::GracefulStop stop(fsdp::GracefulStopOptions{{SIGUSR2}});
    if (spmd::rank() == 0) stop.request();
    BOOST_TEST(stop.should_stop(fsdp::world_group()));
    BOOST_TEST(stop.agreed_signal() == 0);
  }
}

BOOST_AUTO_TEST_CASE(test_bad_input) {
  l1::expect_error<fsdp::ArgumentError>(
      [] { fsdp::GracefulStop s(fsdp::GracefulStopOptions{{}}); }, "signals", "no signals");
  l1::expect_error<fsdp::ArgumentError>(
      [] { fsdp::GracefulStop s(fsdp::GracefulStopOptions{{SIGKILL}}); }, "signals", "SIGKILL");
  l1::expect_error<fsdp::ArgumentError>(
      [] { fsdp::GracefulStop s(fsdp::GracefulStopOptions{{0}}); }, "signals", "signal 0");
  l1::expect_error<fsdp::ArgumentError>(
      [] { fsdp::GracefulStop s(fsdp::GracefulStopOptions{{SIGTERM}, -1}); }, "stuck_seconds",
      "negative stuck_seconds");
  l1::expect_error<fsdp::ArgumentError>(
      [] { fsdp::GracefulStop s(fsdp::GracefulStopOptions{{SIGTERM}, std::nan("")}); },
      "stuck_seconds", "NaN stuck_seconds");
  fsdp::GracefulStop first;
  l1::expect_error<fsdp::StateError>([] { fsdp::GracefulStop second; }, "another GracefulStop",
                                     "two alive");
}
