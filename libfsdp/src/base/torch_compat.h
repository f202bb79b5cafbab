// The one place where libfsdp adapts to LibTorch versions (Debian's 1.13 on
// CPU machines, 2.x on GPU clusters). Everything version-dependent goes here.
#pragma once

#include <torch/csrc/api/include/torch/version.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <string>

namespace fsdp::compat {

constexpr int kTorchMajor = TORCH_VERSION_MAJOR;
constexpr int kTorchMinor = TORCH_VERSION_MINOR;

inline std::string torch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

inline std::string dtype_name(c10::ScalarType t) { return c10::toString(t); }

// float8_e4m3fn appeared in LibTorch 2.1 (fsdp/float8.h).
#if (TORCH_VERSION_MAJOR > 2) || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
constexpr bool kHasFloat8 = true;
inline c10::ScalarType float8_e4m3_dtype() { return c10::ScalarType::Float8_e4m3fn; }
#else
constexpr bool kHasFloat8 = false;
inline c10::ScalarType float8_e4m3_dtype() { return c10::ScalarType::Undefined; }
#endif

inline void set_intra_op_threads(int n) { at::set_num_threads(n); }

// Variable::set_data refuses data of another tensor type (meta -> CPU or
// CUDA), because an existing gradient accumulator would no longer match.
// Deferred initialisation must keep each parameter's TensorImpl -- C++
// modules hold their parameters as members (Linear::weight), so a new
// Variable would not reach them -- and its meta parameters have never been
// through backward: rebinding the impl to the new data is then exactly what
// set_data does after its check (both LibTorch 1.13 and 2.x).
inline void rebind_meta_variable(const at::Tensor& var, const at::Tensor& data) {
  TORCH_CHECK(var.is_meta(), "rebind_meta_variable: the variable is not on the meta device");
  TORCH_CHECK(!var.grad_fn() && !var.grad().defined(),
              "rebind_meta_variable: the variable has autograd history");
  var.unsafeGetTensorImpl()->shallow_copy_from(data.getIntrusivePtr());
}

}  // namespace fsdp::compat

#ifdef FSDP_WITH_NCCL
// ---- CUDA streams and the caching allocator (NCCL backend only) ----
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>

namespace fsdp::compat {

// A stream for communication kernels. Pool streams live as long as the
// process, which matters: the caching allocator records an event on every
// stream passed to record_stream() when that memory is freed, possibly after
// the backend that used the stream is gone, so such a stream must never be
// destroyed. High priority lets collectives start ahead of queued compute.
// 2.x adds getStreamFromPool(int priority, ...) beside this overload; passing a
// bool selects the overload that 1.13 also has.
inline c10::cuda::CUDAStream comm_stream(c10::DeviceIndex device) {
  return c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device);
}

// Keeps the caching allocator from handing `t`'s memory to another tensor
// until the work queued on `stream` so far has finished. 1.13 declares a free
// function; 2.x forwards the same call to its pluggable allocator object.
inline void record_stream(const at::Tensor& t, c10::cuda::CUDAStream stream) {
  c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
}

}  // namespace fsdp::compat
#endif  // FSDP_WITH_NCCL

// ---- storage free / regrow (fully_shard's unsharded buffers) ----
// Autograd may hold views of an unsharded parameter across reshard (e.g. the
// weight.t() that addmm saves), so the buffer must keep its StorageImpl:
// free it by resizing to 0 bytes and regrow it in place before re-gathering.
// CUDA memory goes back to the caching allocator (memory_allocated falls; the
// block stays reserved for the next gather), after the work queued on the
// streams recorded for it (record_stream) is done.
#include <ATen/native/Resize.h>
#ifdef FSDP_WITH_NCCL
#include <ATen/native/cuda/Resize.h>
#endif

namespace fsdp::compat {

inline void resize_storage_bytes(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() == nbytes) return;
  if (t.is_cpu()) {
    at::native::resize_bytes_cpu(impl, nbytes);
#ifdef FSDP_WITH_NCCL
  } else if (t.is_cuda()) {
    // Same declaration in 1.13 and 2.x (ATen/native/cuda/Resize.h).
    at::native::resize_bytes_cuda(impl, nbytes);
#endif
  }
}

// Frees a buffer's memory, keeping its StorageImpl.
inline void release_storage(const at::Tensor& t) { resize_storage_bytes(t, 0); }

// Regrows a buffer released by release_storage to `nbytes`, in place.
inline void restore_storage(const at::Tensor& t, size_t nbytes) { resize_storage_bytes(t, nbytes); }

}  // namespace fsdp::compat

// ---- RNG state and autograd metadata (activation checkpointing) ----
#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/function.h>

#include <mutex>
#include <memory>
#include <type_traits>
#include <utility>

namespace fsdp::compat {

// Autograd nodes are owned by std::shared_ptr up to some 2.x release and by
// c10::intrusive_ptr after it (Node then derives from intrusive_ptr_target).
// Deciding by the type, not a version number, keeps this right for releases
// between the two we build against.
inline constexpr bool kIntrusiveNodes =
    std::is_base_of_v<c10::intrusive_ptr_target, torch::autograd::Node>;

template <class T>
using NodeRef = std::conditional_t<kIntrusiveNodes, c10::intrusive_ptr<T>, std::shared_ptr<T>>;

// The owning pointer type Edge and grad_accumulator() hand out.
using NodePtr = NodeRef<torch::autograd::Node>;

template <class T, class... Args>
NodeRef<T> make_node(Args&&... args) {
  if constexpr (kIntrusiveNodes) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  } else {
    return std::make_shared<T>(std::forward<Args>(args)...);
  }
}

// The default generator's state on `device` (CPU, or one CUDA device). Both
// 1.13 and 2.x reach the CUDA generator through the context's hooks, so this
// compiles without CUDA headers.
inline at::Tensor rng_state(c10::Device device) {
  at::Generator gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

inline void set_rng_state(c10::Device device, const at::Tensor& state) {
  at::Generator gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// Whether a gradient of `sizes` and `dtype` passes `node`'s first input
// unchanged (AccumulateGrad validates incoming gradients against it).
// InputMetadata's shape accessors differ between versions; is_same_shape
// with a meta tensor does not.
inline bool node_accepts(const torch::autograd::Node& node, c10::IntArrayRef sizes,
                         c10::ScalarType dtype) {
  const auto& meta = node.input_metadata(0);
  if (meta.dtype() != c10::scalarTypeToTypeMeta(dtype)) return false;
  return meta.is_same_shape(at::empty(sizes, at::TensorOptions().device(at::kMeta).dtype(dtype)));
}

}  // namespace fsdp::compat
