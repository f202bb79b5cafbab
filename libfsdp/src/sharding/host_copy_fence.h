// Non-blocking copies between pinned host memory and a CUDA device that the
// host must not overtake: CPU offload's shard uploads (the all-gather input,
// read from the pinned shard the optimizer later updates in place) and its
// gradient downloads (into pinned gradients the optimizer reads).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include <vector>

namespace fsdp::detail {

class HostCopyFence {
 public:
  // After a non-blocking copy on `device`'s current stream: records an event
  // there, and keeps `device_side` (the copy's device tensor) alive until
  // wait() -- the caching allocator could otherwise hand its memory to
  // another stream while the copy still reads it (FSDP2 holds references
  // the same way instead of record_stream).
  void record(const c10::Device& device, at::Tensor device_side);
  // Blocks the host until every recorded copy has run; releases the kept
  // tensors. Cheap when nothing is recorded (always on CPU-only runs).
  void wait();
  bool pending() const { return !events_.empty(); }

 private:
  std::vector<c10::Event> events_;
  std::vector<at::Tensor> kept_;
};

}  // namespace fsdp::detail
