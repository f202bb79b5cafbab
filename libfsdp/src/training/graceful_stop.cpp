// GracefulStop: signals recorded by a handler, agreed on by an all-reduce.
#include "fsdp/graceful_stop.h"

#include "comm/watchdog.h"
#include "fsdp/errors.h"
#include "fsdp/mesh.h"

#include <ATen/ATen.h>

#include <signal.h>

#include <atomic>
#include <cmath>
#include <string>

namespace fsdp {
namespace {

// What the handler may touch: lock-free atomics only.
std::atomic<int> g_signal{0};
std::atomic<bool> g_requested{false};
std::atomic<bool> g_alive{false};

void on_signal(int sig) {
  int none = 0;
  g_signal.compare_exchange_strong(none, sig);
  g_requested.store(true);
  detail::note_stop_signal(sig);
}

}  // namespace

GracefulStop::GracefulStop(GracefulStopOptions options) : signals_(std::move(options.signals)) {
  if (!std::isfinite(options.stuck_seconds) || options.stuck_seconds < 0) {
    throw ArgumentError("stuck_seconds", "GracefulStop: 'stuck_seconds' = " +
                                             std::to_string(options.stuck_seconds) +
                                             "; accepted: a finite number of seconds >= 0 (0: off)");
  }
  if (signals_.empty()) {
    throw ArgumentError("signals", "GracefulStop: 'signals' is empty; accepted: one or more "
                                   "signal numbers (default SIGTERM and SIGUSR1)");
  }
  for (int s : signals_) {
    if (s <= 0 || s >= NSIG || s == SIGKILL || s == SIGSTOP) {
      throw ArgumentError("signals", "GracefulStop: 'signals' holds " + std::to_string(s) +
                                         "; accepted: a signal that can be caught (not "
                                         "SIGKILL or SIGSTOP), 1.." +
                                         std::to_string(NSIG - 1));
    }
  }
  bool expected = false;
  if (!g_alive.compare_exchange_strong(expected, true)) {
    throw StateError("GracefulStop: another GracefulStop is alive in this process; keep one "
                     "for the whole training loop");
  }
  g_signal.store(0);
  g_requested.store(false);
  detail::clear_stop_signal();
  detail::set_stop_watch(options.stuck_seconds);
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  // SA_RESTART: an interrupted read or poll (MPI's progress, file I/O)
  // resumes instead of failing with EINTR.
  action.sa_flags = SA_RESTART;
  previous_.resize(signals_.size());
  for (size_t i = 0; i < signals_.size(); ++i) {
    sigaction(signals_[i], &action, &previous_[i]);
  }
}

GracefulStop::~GracefulStop() {
  for (size_t i = 0; i < signals_.size(); ++i) sigaction(signals_[i], &previous_[i], nullptr);
  detail::set_stop_watch(0);
  detail::clear_stop_signal();
  g_alive.store(false);
}

bool GracefulStop::requested() const noexcept { return g_requested.load(); }

int GracefulStop::signal() const noexcept { return g_signal.load(); }

void GracefulStop::request() noexcept { g_requested.store(true); }

bool GracefulStop::should_stop(const ProcessGroupPtr& group) {
  if (agreed_) return true;
  const ProcessGroupPtr& g = group ? group : world_group();
  // [requested, signal]: MAX over the ranks says whether any rank wants to
  // stop, and which signal to name.
  at::Tensor flags = at::tensor({requested() ? int64_t{1} : int64_t{0}, int64_t{signal()}},
                                at::TensorOptions(at::kLong));
  g->all_reduce(flags, ReduceOp::MAX);
  if (flags[0].item<int64_t>() == 0) return false;
  agreed_ = true;
  agreed_signal_ = static_cast<int>(flags[1].item<int64_t>());
  return true;
}

}  // namespace fsdp
