// Work: the handle of an issued collective or point-to-point
// (fsdp/process_group.h).
#pragma once

#include <chrono>
#include <memory>
#include <string>

namespace fsdp {

// Handle of an issued collective.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the collective finished; rethrows its error (CommError, ...).
  // For CUDA tensors it makes the caller's current stream wait for the
  // collective rather than blocking the host. Idempotent.
  virtual void wait() = 0;
  // True once the collective finished (successfully or not); never blocks.
  virtual bool is_completed() = 0;
  // wait(), but gives up after `timeout`: throws TimeoutError naming the op,
  // group and sequence number if the collective has not finished by then (it
  // stays in flight: wait again, or end the job). ArgumentError if timeout is
  // negative or not finite.
  void wait(std::chrono::duration<double> timeout);
  // "all_reduce on ranks[0,1] #7 (mpi)": what this handle waits for.
  virtual std::string describe() const = 0;
};
using WorkPtr = std::shared_ptr<Work>;

}  // namespace fsdp
