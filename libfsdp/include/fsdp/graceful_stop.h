// Graceful stop: a signal on any rank (Slurm's SIGTERM on scancel,
// preemption and the time limit; `sbatch --signal=B:USR1@60` ahead of it)
// becomes a stop that every rank agrees on at the next step boundary, so no
// rank is left inside a collective and the job can save a checkpoint before
// Slurm's SIGKILL (KillWait, 30 s by default). docs/graceful_stop.md.
//
//   fsdp::GracefulStop stop;                       // SIGTERM and SIGUSR1
//   for (int64_t step = start; step < steps; ++step) {
//     train_step(step);
//     if (stop.should_stop()) {                    // collective: every rank
//       save_checkpoint(step);
//       return fsdp::kStoppedExitCode;             // exit(75): requeue me
//     }
//   }
#pragma once

#include "fsdp/comm.h"

#include <csignal>
#include <vector>

namespace fsdp {

// Exit status of a job that stopped on request after saving its state
// (sysexits' EX_TEMPFAIL: "try again later"). ci/slurm/train.sbatch requeues
// on it.
constexpr int kStoppedExitCode = 75;

struct GracefulStopOptions {
  // Signals that request the stop. Their previous handlers are restored when
  // the GracefulStop is destroyed.
  std::vector<int> signals{SIGTERM, SIGUSR1};
  // After a signal, a collective of this rank still in flight this many
  // seconds later (and in flight that long) means a peer exited or is stuck
  // and will never reach the stop: the watchdog then ends the job at once,
  // naming the signal and the collective (exit status 124), instead of
  // this rank waiting for the launcher's SIGKILL (Slurm: KillWait, 30 s by
  // default, after its SIGTERM) or FSDP_TIMEOUT. Keep it below KillWait and
  // above the longest collective of a stop (the checkpoint save's); 0 turns
  // it off. ArgumentError naming "stuck_seconds" unless finite and >= 0.
  double stuck_seconds = 25;
};

// One per process at a time. The handler only records the signal (an atomic
// store: async-signal-safe); nothing else happens until should_stop().
class GracefulStop {
 public:
  // Installs the handlers. ArgumentError naming "signals" for an empty list,
  // a number that is not a signal, or SIGKILL / SIGSTOP (which cannot be
  // caught); StateError if another GracefulStop is alive in this process.
  explicit GracefulStop(GracefulStopOptions options = {});
  ~GracefulStop();
  GracefulStop(const GracefulStop&) = delete;
  GracefulStop& operator=(const GracefulStop&) = delete;

  // A stop was requested on this rank (a signal, or request()). Reads only.
  bool requested() const noexcept;
  // The first signal received on this rank; 0 if none (or only request()).
  int signal() const noexcept;
  // Requests the stop from code (e.g. a time budget of its own).
  void request() noexcept;
  // Collective over `group` (null: the world): true on every rank when any
  // rank's stop was requested -- one small all-reduce. Every rank of the
  // group calls it at the same point (a step boundary); once true it stays
  // true. Watched by the watchdog like any collective.
  bool should_stop(const ProcessGroupPtr& group = nullptr);
  // After should_stop() returned true: the signal some rank received (the
  // largest number among the ranks; 0 when only request() was used), for
  // the message "stopped by SIGTERM".
  int agreed_signal() const noexcept { return agreed_signal_; }

 private:
  std::vector<int> signals_;
  std::vector<struct sigaction> previous_;
  bool agreed_ = false;
  int agreed_signal_ = 0;
};

}  // namespace fsdp
