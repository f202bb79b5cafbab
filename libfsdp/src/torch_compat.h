// The one place where libfsdp adapts to LibTorch versions (Debian's 1.13 on
// CPU machines, 2.x on GPU clusters). Everything version-dependent goes here.
#pragma once

#include <torch/csrc/api/include/torch/version.h>

#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>

#include <string>

namespace fsdp::compat {

constexpr int kTorchMajor = TORCH_VERSION_MAJOR;
constexpr int kTorchMinor = TORCH_VERSION_MINOR;

inline std::string torch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

inline std::string dtype_name(c10::ScalarType t) { return c10::toString(t); }

inline void set_intra_op_threads(int n) { at::set_num_threads(n); }

}  // namespace fsdp::compat
