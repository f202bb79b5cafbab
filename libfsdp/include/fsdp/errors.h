// Typed errors thrown by libfsdp.
//
// Every public function validates its arguments and throws one of these; the
// message names the argument, what it got and what is accepted. Catch
// fsdp::Error to catch them all.
// The rule: docs/architecture.md#typed-errors.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace fsdp {

// Base of every libfsdp exception.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A named argument has a value outside what the function accepts.
class ArgumentError : public Error {
 public:
  ArgumentError(std::string argument, const std::string& what)
      : Error(what), argument_(std::move(argument)) {}
  // The offending argument's name, e.g. "output" or "shape".
  const std::string& argument() const noexcept { return argument_; }

 private:
  std::string argument_;
};

// A tensor argument has the wrong dtype (or two tensors disagree).
class DTypeError : public ArgumentError {
 public:
  using ArgumentError::ArgumentError;
};

// A tensor argument has the wrong shape or element count.
class ShapeError : public ArgumentError {
 public:
  using ArgumentError::ArgumentError;
};

// A tensor argument has an unsupported memory layout (non-contiguous) or device.
class LayoutError : public ArgumentError {
 public:
  using ArgumentError::ArgumentError;
};

// A device-mesh argument is malformed: bad shape, unknown or duplicate names.
class MeshError : public ArgumentError {
 public:
  using ArgumentError::ArgumentError;
};

// The call is not valid in the current state (e.g. no Runtime alive).
class StateError : public Error {
 public:
  using Error::Error;
};

// The communication library (MPI or NCCL) reported a failure, or the ranks
// of a group issued different collectives (FSDP_DEBUG=detail).
class CommError : public Error {
 public:
  using Error::Error;
};

// Work::wait(timeout) ran out of time; the collective is still in flight.
class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};

// An allocation that libfsdp makes for a collective (all-gather output,
// reduce-scatter / all-reduce buffers, the unsharded parameters) failed:
// LibTorch's out-of-memory (c10::OutOfMemoryError on CUDA, "not enough
// memory" / "can't allocate memory" from the CPU allocator, std::bad_alloc)
// re-thrown naming the unit and the operation. The other ranks are then
// waiting in (or about to enter) that collective, so the job cannot go on:
// the rank that throws announces the error to every rank, whose watchdog
// prints it and ends the job (docs/memory.md#out-of-memory).
class OutOfMemoryError : public Error {
 public:
  OutOfMemoryError(std::string unit, std::string op, int64_t bytes_requested, int64_t bytes_held,
                   const std::string& what)
      : Error(what),
        unit_(std::move(unit)),
        op_(std::move(op)),
        bytes_requested_(bytes_requested),
        bytes_held_(bytes_held) {}
  // The FSDP unit whose buffers were being allocated ("" outside any unit).
  const std::string& unit() const noexcept { return unit_; }
  // "all-gather", "unshard", "reduce-scatter", "all-reduce".
  const std::string& op() const noexcept { return op_; }
  // Bytes of the buffers that operation allocates on this rank.
  int64_t bytes_requested() const noexcept { return bytes_requested_; }
  // Bytes this rank's units held then (fsdp::memory_report's totals).
  int64_t bytes_held() const noexcept { return bytes_held_; }

 private:
  std::string unit_;
  std::string op_;
  int64_t bytes_requested_;
  int64_t bytes_held_;
};

}  // namespace fsdp
