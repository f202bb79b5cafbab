// Bytes live on the suite's device and their peak: a counting wrapper around
// LibTorch's CPU allocator (TrackingAllocator) and DeviceMemory, which reads
// it on CPU and the CUDA caching allocator's statistics on a GPU. One
// definition for every suite (test_fully_shard_with_ac's L2-04 peak-memory
// check uses it).
#pragma once

#include "spmd.h"

#include <fsdp/allocator_compat.h>

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/csrc/api/include/torch/version.h>
#ifdef FSDP_WITH_NCCL  // a CUDA LibTorch
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <boost/test/unit_test.hpp>

#include <atomic>
#include <cstdint>
#include <cstring>

namespace spmd {
// ---------------------------------------------------------------------------
// Peak host memory: a wrapper around LibTorch's CPU allocator that counts the
// bytes live and their peak. Installed with c10::SetAllocator (what
// at::empty on the CPU asks for) and removed again by the test; it must
// outlive every tensor it allocated, so it is never destroyed.

class TrackingAllocator final : public c10::Allocator {
 public:
  // Some kernels take scratch memory through raw_allocate(), which requires
  // the DataPtr's context to be its data pointer and a raw deleter: so the
  // byte count lives in a header in front of the data, one alignment unit
  // long so that the data keeps c10's alignment.
  c10::DataPtr allocate(size_t n) FSDP_ALLOCATE_CONST override {
    auto* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    *reinterpret_cast<size_t*>(base) = n;
    add(static_cast<int64_t>(n));
    void* data = base + kHeader;
    return c10::DataPtr(data, data, &TrackingAllocator::release, c10::Device(c10::kCPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &TrackingAllocator::release; }
#if FSDP_ALLOCATOR_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
#endif

  void install() {
    inner_ = c10::GetAllocator(c10::DeviceType::CPU);
    c10::SetAllocator(c10::DeviceType::CPU, this);
  }
  void uninstall() { c10::SetAllocator(c10::DeviceType::CPU, inner_); }
  bool installed() const { return c10::GetAllocator(c10::DeviceType::CPU) == this; }
  int64_t live() const { return live_.load(); }
  // Starts a new peak window at the current live bytes.
  void reset_peak() { peak_.store(live_.load()); }
  int64_t peak() const { return peak_.load(); }

  static TrackingAllocator& get() {
    static auto* instance = new TrackingAllocator();  // never freed: see above
    return *instance;
  }

 private:
  static constexpr size_t kHeader = c10::gAlignment;
  static_assert(kHeader >= sizeof(size_t), "the header holds the byte count");
  static void release(void* data) {
    if (data == nullptr) return;
    char* base = static_cast<char*>(data) - kHeader;
    get().add(-static_cast<int64_t>(*reinterpret_cast<size_t*>(base)));
    c10::free_cpu(base);
  }
  void add(int64_t n) const {
    const int64_t now = live_.fetch_add(n) + n;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }
  c10::Allocator* inner_ = nullptr;
  mutable std::atomic<int64_t> live_{0}, peak_{0};
};

// Bytes live on the suite's device and their peak since reset_peak(): the
// tracker above on CPU (installed for the scope's life, also on failure),
// CUDA's caching allocator's own statistics on a GPU (allocated bytes, all
// pools: what a training step holds, not the cache it keeps).
class DeviceMemory {
 public:
  DeviceMemory() : device_(spmd::device()) {
    if (device_.is_cpu()) {
      TrackingAllocator::get().install();
      BOOST_TEST_REQUIRE(TrackingAllocator::get().installed());
    } else {
      BOOST_TEST_REQUIRE(device_.is_cuda(), "no peak statistics for " << device_.str());
#ifndef FSDP_WITH_NCCL
      BOOST_FAIL("CUDA peak statistics need a CUDA LibTorch (built with the NCCL backend)");
#endif
    }
  }
  ~DeviceMemory() {
    if (device_.is_cpu()) TrackingAllocator::get().uninstall();
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  void reset_peak() {
    if (device_.is_cpu()) return TrackingAllocator::get().reset_peak();
#ifdef FSDP_WITH_NCCL
    c10::cuda::CUDACachingAllocator::resetPeakStats(device_.index());
#endif
  }
  int64_t live() const { return stat(/*peak=*/false); }
  int64_t peak() const { return stat(/*peak=*/true); }
  const char* what() const { return device_.is_cpu() ? "host" : "CUDA allocated"; }

 private:
  int64_t stat(bool peak) const {
    if (device_.is_cpu()) {
      return peak ? TrackingAllocator::get().peak() : TrackingAllocator::get().live();
    }
#ifdef FSDP_WITH_NCCL
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index());
    // Entry 0 is StatType::AGGREGATE (all pools) in every 2.x; the enum
    // itself moved from c10::cuda::CUDACachingAllocator to c10.
    const auto& bytes = stats.allocated_bytes[0];
    return peak ? bytes.peak : bytes.current;
#else
    return 0;
#endif
  }
  c10::Device device_;
};

}  // namespace spmd
