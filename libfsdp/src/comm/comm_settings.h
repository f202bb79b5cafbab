// CommSettings: what the Runtime tells the comm layer before any group
// exists (kept in watchdog.cpp, its first reader).
#pragma once

#include <c10/core/Device.h>

namespace fsdp::detail {

struct CommSettings {
  double timeout_seconds = 600;    // 0: no watchdog
  bool check_collectives = false;  // FSDP_DEBUG=detail
  // The Runtime's device: groups built while it is CUDA create their NCCL
  // communicator at once (make_nccl_backend, eager).
  c10::Device device{c10::kCPU};
  // More ranks on this node than it has online CPUs: shared-memory waits
  // yield the core at once instead of spinning first.
  bool node_oversubscribed = false;
};
// Set by the Runtime before any group exists; read by groups and the watchdog.
void configure_comm(const CommSettings& settings);
const CommSettings& comm_settings();

}  // namespace fsdp::detail
