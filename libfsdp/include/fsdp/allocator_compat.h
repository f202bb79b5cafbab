// For code that implements c10::Allocator (a wrapper that counts or places
// host memory): the one check of the LibTorch version that this interface
// needs, shared by libfsdp's shared-memory arena, fsdp-bench and the tests.
//
// LibTorch 2.3 made Allocator::allocate non-const and added the pure virtual
// copy_data; 1.13 (Debian) has the const allocate and no copy_data. Write
//
//   at::DataPtr allocate(size_t n) FSDP_ALLOCATE_CONST override;
//   #if FSDP_ALLOCATOR_HAS_COPY_DATA
//   void copy_data(void* dest, const void* src, std::size_t n) const override;
//   #endif
#pragma once

#include <torch/csrc/api/include/torch/version.h>

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define FSDP_ALLOCATE_CONST
#define FSDP_ALLOCATOR_HAS_COPY_DATA 1
#else
#define FSDP_ALLOCATE_CONST const
#define FSDP_ALLOCATOR_HAS_COPY_DATA 0
#endif
