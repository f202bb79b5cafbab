// The CUDA runtime facts the Runtime needs (built with the NCCL backend).
#include "runtime/cuda_device.h"

#include "fsdp/errors.h"

#include <cuda_runtime_api.h>

namespace fsdp::detail {

std::string cuda_pci_bus_id(int index) {
  char id[64] = {};
  const cudaError_t rc = cudaDeviceGetPCIBusId(id, static_cast<int>(sizeof id), index);
  if (rc != cudaSuccess) {
    throw StateError("cudaDeviceGetPCIBusId(cuda:" + std::to_string(index) +
                     ") failed: " + cudaGetErrorString(rc));
  }
  return id;
}

}  // namespace fsdp::detail
