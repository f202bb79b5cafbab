// The collective watchdog and the transports whose errors it polls
// (watchdog.cpp).
#pragma once

#include <memory>
#include <string>

namespace fsdp::detail {

// A thread that aborts the job (MPI_Abort, exit status 124) when a pending
// collective outlives timeout_seconds, after printing it on this rank.
void start_watchdog(int world_rank, int world_size);
void stop_watchdog();

// A failure on this rank that leaves the others waiting in a collective it
// will never issue (fsdp::OutOfMemoryError before an all-gather): `text` is
// sent to every other rank (once per process; later calls are no-ops), whose
// watchdog prints it within one poll period and ends the job as on a
// timeout, instead of waiting out FSDP_TIMEOUT. Never blocks. With the
// watchdog off (FSDP_TIMEOUT=off) nobody listens: the others hang as before.
void announce_fatal_error(const std::string& text);
bool fatal_error_announced();
// Runtime's destructor after an announced error: MPI_Finalize would wait for
// ranks that are stuck, so this rank ends the job instead (MPI_Abort, 124).
[[noreturn]] void abort_after_fatal_error(int world_rank);

// A transport whose failures surface asynchronously (NCCL: a dead peer or
// network leaves kernels spinning and the host blocked, with the error only
// in ncclCommGetAsyncError). The watchdog polls every registered source each
// period; an error is printed and aborts the job as a timeout does, and on
// either the watchdog first aborts every source's communicators so that no
// kernel keeps spinning. Both calls must be thread-safe and must not block.
class AsyncErrorSource {
 public:
  virtual ~AsyncErrorSource() = default;
  // Empty when healthy, else what failed ("NCCL communicator of ranks[0,1]: ...").
  virtual std::string async_error() = 0;
  virtual void abort() noexcept = 0;
};
void register_async_error_source(const std::shared_ptr<AsyncErrorSource>& source);
void unregister_async_error_source(const AsyncErrorSource* source);

// fsdp::GracefulStop's watch: once a stop signal has arrived, a collective
// in flight for longer than `stuck_seconds`, that long after the signal too,
// ends the job as a timeout does, naming the signal. A stop is agreed at a
// step boundary, so a rank still waiting then is waiting for a peer that
// exited or is stuck: without this it would ignore the signal until the
// launcher's SIGKILL (Slurm: KillWait after the SIGTERM) or FSDP_TIMEOUT.
// 0 turns the watch off (and with FSDP_TIMEOUT=off there is no watchdog).
void set_stop_watch(double stuck_seconds);
// Async-signal-safe (lock-free atomics and clock_gettime only): a stop
// signal arrived now; the first one since clear_stop_signal() counts.
void note_stop_signal(int signal) noexcept;
void clear_stop_signal() noexcept;

}  // namespace fsdp::detail
