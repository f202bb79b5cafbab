#include "sharding/host_copy_fence.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <thread>

namespace fsdp::detail {

void HostCopyFence::record(const c10::Device& device, at::Tensor device_side) {
  const c10::impl::VirtualGuardImpl guard(device.type());
  c10::Event event(device.type());
  event.record(guard.getStream(device));
  events_.push_back(std::move(event));
  kept_.push_back(std::move(device_side));
}

void HostCopyFence::wait() {
  // c10::Event has no host-side synchronize before LibTorch 2.x; query()
  // polls the same completion flag (CUDA's own event sync spins too).
  for (const auto& event : events_) {
    while (!event.query()) std::this_thread::yield();
  }
  events_.clear();
  kept_.clear();
}

}  // namespace fsdp::detail
