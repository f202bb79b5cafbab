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

}  // namespace fsdp::detail
