#include "runtime/device_binding.h"

#include "fsdp/errors.h"

#include <map>

namespace fsdp::detail {

DeviceRequest parse_device_request(const std::string& text, const std::string& argument) {
  if (text == "auto") return DeviceRequest::Auto;
  if (text == "cpu") return DeviceRequest::Cpu;
  if (text == "cuda") return DeviceRequest::Cuda;
  throw ArgumentError(argument, argument + " = '" + text + "'; accepted: auto, cpu, cuda");
}

c10::Device choose_device(DeviceRequest request, int local_rank, int device_count) {
  if (request == DeviceRequest::Cpu || (request == DeviceRequest::Auto && device_count <= 0)) {
    return c10::Device(c10::kCPU);
  }
  if (device_count <= 0) {
    throw StateError(
        "device cuda was asked for (FSDP_DEVICE / RuntimeOptions::device) but LibTorch sees no "
        "CUDA device on this node (a CPU-only LibTorch, no GPU, or CUDA_VISIBLE_DEVICES empty)");
  }
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank % device_count));
}

std::string shared_gpu_error(const std::vector<std::string>& ids, int device_count) {
  std::map<std::string, int> first_user;
  for (size_t r = 0; r < ids.size(); ++r) {
    const auto [it, fresh] = first_user.emplace(ids[r], static_cast<int>(r));
    if (fresh) continue;
    return "local ranks " + std::to_string(it->second) + " and " + std::to_string(r) +
           " would share GPU " + ids[r] + " (" + std::to_string(ids.size()) +
           " ranks on this node, " + std::to_string(device_count) +
           " visible CUDA device(s) each); NCCL needs one GPU per rank: start at most as many "
           "ranks per node as GPUs (srun --gpus-per-task=1, or mpirun -n <GPUs per node> per "
           "node), or set FSDP_DEVICE=cpu to keep tensors on the CPU (MPI collectives)";
  }
  return "";
}

}  // namespace fsdp::detail
