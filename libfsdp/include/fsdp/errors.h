// Typed errors thrown by libfsdp.
//
// Every public function validates its arguments and throws one of these; the
// message names the argument, what it got and what is accepted. Catch
// fsdp::Error to catch them all.
// The rule: docs/architecture.md#typed-errors.
#pragma once

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

}  // namespace fsdp
