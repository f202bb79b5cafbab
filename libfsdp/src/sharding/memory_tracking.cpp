// The tracking allocator of fsdp/memory.h: LibTorch's CPU allocator wrapped
// to count live bytes and their peak, with an optional budget that fails an
// allocation the way LibTorch's own allocator fails when malloc does.
#include "fsdp/memory.h"

#include "fsdp/allocator_compat.h"
#include "fsdp/shared_memory.h"
#include "fsdp/errors.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace fsdp {
namespace {

class TrackingAllocator final : public c10::Allocator {
 public:
  // Kernels that take scratch memory through raw_allocate() need the
  // DataPtr's context to be its data pointer with a raw deleter, so the size
  // lives in a header in front of the data, one alignment unit long so that
  // the data keeps c10's alignment.
  c10::DataPtr allocate(size_t n) FSDP_ALLOCATE_CONST override {
    const int64_t budget = budget_.load(std::memory_order_relaxed);
    if (budget > 0 && counted_.load(std::memory_order_relaxed) + static_cast<int64_t>(n) > budget) {
      // The message LibTorch's allocator gives when malloc fails, so that
      // callers see exactly what a real out-of-memory looks like.
      TORCH_CHECK(false, "DefaultCPUAllocator: not enough memory: you tried to allocate ", n,
                  " bytes (libfsdp memory budget ", budget, " B, ",
                  counted_.load(std::memory_order_relaxed), " B live)");
    }
    auto* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    std::memcpy(base, &n, sizeof n);
    counted_.fetch_add(static_cast<int64_t>(n));
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

  static TrackingAllocator& get() {
    static auto* instance = new TrackingAllocator();  // never freed: outlives its tensors
    return *instance;
  }

  // Live bytes (LibTorch's allocations + shared-memory buffers) and peak.
  void add(int64_t delta) const {
    const int64_t now = live_.fetch_add(delta) + delta;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }

  mutable std::atomic<int64_t> live_{0};
  mutable std::atomic<int64_t> peak_{0};
  mutable std::atomic<int64_t> counted_{0};  // LibTorch's allocations only (the budget's)
  std::atomic<int64_t> budget_{0};
  std::atomic<bool> installed_{false};

 private:
  static constexpr size_t kHeader = c10::gAlignment;
  static_assert(kHeader >= sizeof(size_t), "the header holds the size");

  static void release(void* data) {
    if (data == nullptr) return;
    char* base = static_cast<char*>(data) - kHeader;
    size_t n = 0;
    std::memcpy(&n, base, sizeof n);
    get().counted_.fetch_sub(static_cast<int64_t>(n));
    get().add(-static_cast<int64_t>(n));
    c10::free_cpu(base);
  }
};

std::mutex g_install_mu;

}  // namespace

void install_memory_tracking() {
  std::lock_guard<std::mutex> lock(g_install_mu);
  auto& a = TrackingAllocator::get();
  if (a.installed_.load()) return;
  // Above LibTorch's default (0) and fsdp-bench train's counting allocator (1).
  c10::SetCPUAllocator(&a, /*priority=*/2);
  set_shared_memory_observer([](int64_t delta) { TrackingAllocator::get().add(delta); });
  a.installed_.store(true);
}

bool memory_tracking_installed() { return TrackingAllocator::get().installed_.load(); }
int64_t tracked_live_bytes() { return TrackingAllocator::get().live_.load(); }
int64_t tracked_peak_bytes() { return TrackingAllocator::get().peak_.load(); }
void reset_tracked_peak() {
  auto& a = TrackingAllocator::get();
  a.peak_.store(a.live_.load());
}

void set_memory_budget(int64_t bytes) {
  if (!memory_tracking_installed()) {
    throw StateError("set_memory_budget: the tracking allocator is not installed; call "
                     "fsdp::install_memory_tracking() first");
  }
  if (bytes < 0) {
    throw ArgumentError("bytes", "set_memory_budget: bytes = " + std::to_string(bytes) +
                                     "; accepted: 0 (no budget) or a positive byte count");
  }
  TrackingAllocator::get().budget_.store(bytes);
}

namespace detail {
std::optional<int64_t> tracked_live_if_installed() {
  if (!memory_tracking_installed()) return std::nullopt;
  return tracked_live_bytes();
}
std::optional<int64_t> tracked_peak_if_installed() {
  if (!memory_tracking_installed()) return std::nullopt;
  return tracked_peak_bytes();
}
}  // namespace detail

}  // namespace fsdp
