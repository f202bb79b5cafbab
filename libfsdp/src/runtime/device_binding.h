// Which device a rank computes on, and the one-rank-per-GPU rule of NCCL.
//
// Pure functions of the node's facts (local rank, visible devices, the GPU
// each local rank picked) so the rules are testable without a GPU; the
// Runtime gathers the facts and applies them at start-up.
#pragma once

#include <c10/core/Device.h>

#include <string>
#include <vector>

namespace fsdp::detail {

enum class DeviceRequest { Auto, Cpu, Cuda };

// "auto", "cpu" or "cuda"; anything else is an ArgumentError naming
// `argument` (the variable or option it came from).
DeviceRequest parse_device_request(const std::string& text, const std::string& argument);

// Cpu -> cpu. Auto -> cpu without visible CUDA devices, else like Cuda.
// Cuda -> cuda:<local_rank % device_count>: with one visible GPU per rank
// (per-task binding, CUDA_VISIBLE_DEVICES set per rank) that is cuda:0.
// Cuda without a visible device is a StateError.
c10::Device choose_device(DeviceRequest request, int local_rank, int device_count);

// ids[r]: the physical GPU (PCI bus id) local rank r chose. NCCL refuses two
// ranks of a communicator on one GPU ("duplicate GPU"), so a shared GPU is
// an error at start-up rather than at the first collective: the message
// names the local ranks, the device count and what to do. Empty if every
// rank has a GPU of its own.
std::string shared_gpu_error(const std::vector<std::string>& ids, int device_count);

}  // namespace fsdp::detail
