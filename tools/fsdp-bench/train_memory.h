// fsdp-bench train's memory accounting: LibTorch's CPU allocator wrapped to
// count live bytes and their peak per configuration (an "account", as many
// as the run has configurations).
#pragma once

#include "fsdp/allocator_compat.h"
#include "fsdp/comm.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>

namespace fsdp_bench::train {

// LibTorch's CPU allocator wrapped to count live bytes and their peak per
// account. The account of an allocation is the one current when it was made
// (a process-wide setting, so allocations on libfsdp's communication threads
// count for the configuration whose step issued them); a free goes back to
// the allocation's account, wherever it happens. Installed before any model
// is built and never removed or destroyed: it must outlive every tensor it
// allocated.

class CountingAllocator final : public c10::Allocator {
 public:
  // One configuration's live bytes and their peak. Made by new_account(),
  // as many as a run needs, at stable addresses (a std::deque, never shrunk):
  // an allocation's header points at its account.
  struct Account {
    std::atomic<int64_t> live{0};
    std::atomic<int64_t> peak{0};
  };

  // Some kernels take scratch memory through raw_allocate(), which requires
  // the DataPtr's context to be its data pointer and a raw deleter: so the
  // size and account live in a header in front of the data, one alignment
  // unit long so that the data keeps c10's alignment.
  c10::DataPtr allocate(size_t n) FSDP_ALLOCATE_CONST override {
    auto* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    Header h{n, current_.load(std::memory_order_relaxed)};
    std::memcpy(base, &h, sizeof h);
    add(*h.account, static_cast<int64_t>(n));
    void* data = base + kHeader;
    return c10::DataPtr(data, data, &CountingAllocator::release, c10::Device(c10::kCPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }
#if FSDP_ALLOCATOR_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
#endif

  static CountingAllocator& get() {
    static auto* instance = new CountingAllocator();  // never freed: see above
    return *instance;
  }
  // Priority above LibTorch's default CPU allocator (registered at 0).
  // Also counts libfsdp's shared-memory arenas (fully_shard's all-gather
  // outputs and reduce-scatter inputs), which LibTorch's allocator never
  // sees, in the current account: they are made and freed within a step.
  void install() {
    c10::SetCPUAllocator(this, /*priority=*/1);
    fsdp::set_shared_memory_observer(
        [](int64_t delta) { add(*get().current_.load(std::memory_order_relaxed), delta); });
  }
  bool installed() const { return c10::GetCPUAllocator() == this; }

  // A new account, starting at zero; it lives as long as the allocator.
  Account& new_account() {
    const std::lock_guard<std::mutex> lock(accounts_mutex_);
    return accounts_.emplace_back();
  }

  // Makes `account` current until the returned guard is destroyed.
  class Scope {
   public:
    explicit Scope(Account& account) : previous_(get().current_.exchange(&account)) {}
    ~Scope() { get().current_.store(previous_); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Account* previous_;
  };

  static int64_t live(const Account& account) { return account.live.load(); }
  static int64_t peak(const Account& account) { return account.peak.load(); }
  // Starts a new peak window at the account's current live bytes.
  static void reset_peak(Account& account) { account.peak.store(account.live.load()); }

 private:
  struct Header {
    size_t bytes;
    Account* account;
  };
  static constexpr size_t kHeader = c10::gAlignment;
  static_assert(kHeader >= sizeof(Header), "the header holds size and account");

  static void release(void* data) {
    if (data == nullptr) return;
    char* base = static_cast<char*>(data) - kHeader;
    Header h{};
    std::memcpy(&h, base, sizeof h);
    add(*h.account, -static_cast<int64_t>(h.bytes));
    c10::free_cpu(base);
  }
  static void add(Account& account, int64_t n) {
    const int64_t now = account.live.fetch_add(n) + n;
    int64_t peak = account.peak.load();
    while (now > peak && !account.peak.compare_exchange_weak(peak, now)) {
    }
  }

  Account none_;  // what is allocated outside any Scope
  std::atomic<Account*> current_{&none_};
  std::mutex accounts_mutex_;
  std::deque<Account> accounts_;
};

}  // namespace fsdp_bench::train
