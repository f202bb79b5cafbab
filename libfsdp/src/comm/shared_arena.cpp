#include "comm/shared_arena.h"

#include "comm/comm_settings.h"
#include "comm/mpi_types.h"
#include "fsdp/allocator_compat.h"
#include "fsdp/errors.h"
#include "fsdp/process_group.h"
#include "fsdp/shared_memory.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/version.h>

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FSDP_CPU_RELAX() _mm_pause()
#else
#define FSDP_CPU_RELAX() ((void)0)
#endif

namespace fsdp::detail::cpu {

// At the start of every segment; the rest of its first page is unused so
// that allocations never share a cache line with the counters. The epoch
// is also the futex word its waiters sleep on; sleepers counts them, so an
// arriving rank makes the wake-up call only when someone sleeps.
struct SharedArena::Control {
  alignas(64) std::atomic<uint32_t> epoch;
  std::atomic<uint32_t> sleepers;
  alignas(64) std::atomic<int64_t> slot[2];
};
static_assert(std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<int64_t>::is_always_lock_free &&
                  sizeof(std::atomic<uint32_t>) == sizeof(uint32_t),
              "shared-memory counters must be lock-free (address-free) atomics, and the "
              "epoch a plain 32-bit futex word");

namespace {

constexpr int64_t kControlBytes = 4096;
constexpr int64_t kAlign = 64;
// Segments grow in steps of this (a huge page), so growth is rare.
constexpr int64_t kGrowStep = 2 << 20;
constexpr int kNameLen = 64;

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Address space each segment reserves: FSDP_SHM_BYTES, else the node's
// memory (a segment can never hold more), at least 1 GiB; 0: no arena.
int64_t reserve_bytes() {
  const int64_t setting = shm_bytes_setting();
  if (setting == 0) return 0;
  if (setting > 0) return round_up(std::max<int64_t>(setting + kControlBytes, kGrowStep), kGrowStep);
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  const int64_t ram = pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
  return round_up(std::max<int64_t>(ram, int64_t{1} << 30), kGrowStep);
}

// The live arenas, for shared_memory_stats(), and the bytes in use over all
// of them (one peak for the process, not a sum of per-arena peaks).
std::mutex g_live_mu;
std::set<SharedArena*> g_live;
std::atomic<int64_t> g_in_use{0};
std::atomic<int64_t> g_peak_in_use{0};

std::atomic<void (*)(int64_t)> g_observer{nullptr};

void count_in_use(int64_t delta) {
  if (auto* observe = g_observer.load(std::memory_order_relaxed)) observe(delta);
  const int64_t now = g_in_use.fetch_add(delta) + delta;
  int64_t peak = g_peak_in_use.load();
  while (now > peak && !g_peak_in_use.compare_exchange_weak(peak, now)) {
  }
}

bool all_true(bool mine, MPI_Comm comm) {
  int v = mine ? 1 : 0, all = 0;
  check_mpi(MPI_Allreduce(&v, &all, 1, MPI_INT, MPI_MIN, comm), "MPI_Allreduce");
  return all == 1;
}

// Epochs wrap at 2^32; a peer is never more than one epoch away, so
// serial-number order is exact.
bool reached(uint32_t seen, uint32_t e) { return static_cast<int32_t>(seen - e) >= 0; }
// Every arena starts just below the wrap, so every job (and every shm test)
// crosses it within its first collectives.
constexpr uint32_t kFirstEpoch = 0xFFFFFFF0u;

uint32_t* futex_word(std::atomic<uint32_t>& a) { return reinterpret_cast<uint32_t*>(&a); }

// How long a waiter spins before it yields: on a node with more ranks than
// cores the peer it waits for may need this very core, so not at all (at np
// 4 on 2 cores a 1 MiB all-gather took 3.5x the copy limit spinning 256,
// 2.5x not spinning; fsdp-bench collectives).
int spins_before_yield() { return comm_settings().node_oversubscribed ? 0 : 256; }

// How long a waiter then yields before it sleeps until the peer's arrival
// wakes it: long enough for the barriers of collectives, whose peers arrive
// within tens of microseconds; a longer wait (a peer still computing) gives
// its core to the compute threads.
constexpr std::chrono::microseconds kYieldFor{1000};

std::string errno_text(const char* call) { return std::string(call) + ": " + std::strerror(errno); }

}  // namespace

int64_t shm_bytes_setting() {
  const char* env = std::getenv("FSDP_SHM_BYTES");
  if (env == nullptr || *env == '\0') return -1;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(env, &end, 10);
  if (errno != 0 || *end != '\0' || v < 0) {
    throw ArgumentError("FSDP_SHM_BYTES", std::string("FSDP_SHM_BYTES = '") + env +
                                              "'; accepted: a byte count >= 0 (0: no "
                                              "shared-memory arenas)");
  }
  return v;
}

std::shared_ptr<SharedArena> SharedArena::create(MPI_Comm comm, std::string* why) {
  int rank = 0, size = 1;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  if (size == 1) {
    *why = "one rank";
    return nullptr;
  }
  const int64_t reserve = reserve_bytes();
  if (!all_true(reserve > 0, comm)) {
    *why = "FSDP_SHM_BYTES=0";
    return nullptr;
  }
  MPI_Comm node = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type");
  int node_size = 0;
  check_mpi(MPI_Comm_size(node, &node_size), "MPI_Comm_size");
  MPI_Comm_free(&node);
  if (!all_true(node_size == size, comm)) {
    *why = "the group spans more than one node";
    return nullptr;
  }

  std::shared_ptr<SharedArena> a(new SharedArena());
  a->rank_ = rank;
  a->reserve_ = reserve;
  a->spins_ = spins_before_yield();
  a->epoch_ = kFirstEpoch;
  a->bases_.assign(static_cast<size_t>(size), nullptr);
  a->payloads_.assign(static_cast<size_t>(size), 0);
  // pid + a per-process counter, and a random tag for PID namespaces that
  // share one /dev/shm (containers). A clash fails shm_open (O_EXCL): then
  // this group has no arena, on every rank.
  static std::atomic<int> counter{0};
  static const unsigned tag = std::random_device{}();
  char name[kNameLen] = {};
  std::snprintf(name, sizeof name, "/fsdp-%d-%d-%08x", static_cast<int>(getpid()), counter++, tag);
  std::string error;
  a->fd_ = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (a->fd_ < 0) {
    error = errno_text("shm_open");
  } else {
    void* p = mmap(nullptr, static_cast<size_t>(a->reserve_), PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_NORESERVE, a->fd_, 0);
    if (p == MAP_FAILED) {
      error = errno_text("mmap");
    } else {
      a->bases_[static_cast<size_t>(rank)] = static_cast<char*>(p);
      std::lock_guard<std::mutex> lock(a->mu_);
      if (!a->grow_locked(kGrowStep)) error = errno_text("fallocate");
    }
  }
  if (error.empty()) {
    Control* c = new (a->base(rank)) Control();
    c->epoch.store(kFirstEpoch, std::memory_order_relaxed);
    c->sleepers.store(0, std::memory_order_relaxed);
    c->slot[0].store(0, std::memory_order_relaxed);
    c->slot[1].store(0, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(a->mu_);
    a->free_.clear();
    a->free_[kControlBytes] = a->committed_ - kControlBytes;
  }
  bool ok = all_true(error.empty(), comm);
  if (ok) {
    std::vector<char> names(static_cast<size_t>(size) * kNameLen);
    check_mpi(MPI_Allgather(name, kNameLen, MPI_CHAR, names.data(), kNameLen, MPI_CHAR, comm),
              "MPI_Allgather");
    for (int r = 0; r < size && error.empty(); ++r) {
      if (r == rank) continue;
      const int fd = shm_open(&names[static_cast<size_t>(r) * kNameLen], O_RDWR, 0);
      if (fd < 0) {
        error = errno_text("shm_open (a peer's segment)");
        break;
      }
      void* p = mmap(nullptr, static_cast<size_t>(a->reserve_), PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_NORESERVE, fd, 0);
      close(fd);
      if (p == MAP_FAILED) {
        error = errno_text("mmap (a peer's segment)");
        break;
      }
      a->bases_[static_cast<size_t>(r)] = static_cast<char*>(p);
    }
    // Every peer has mapped it (or failed to): the name is no longer needed.
    ok = all_true(error.empty(), comm);
  }
  if (a->fd_ >= 0) shm_unlink(name);
  if (!ok) {
    *why = error.empty() ? "a peer could not set up its shared-memory segment" : error;
    return nullptr;  // the destructor unmaps what was mapped
  }
  std::lock_guard<std::mutex> lock(g_live_mu);
  g_live.insert(a.get());
  return a;
}

SharedArena::~SharedArena() {
  {
    std::lock_guard<std::mutex> lock(g_live_mu);
    g_live.erase(this);
  }
  for (char* b : bases_) {
    if (b != nullptr) munmap(b, static_cast<size_t>(reserve_));
  }
  if (fd_ >= 0) close(fd_);
}

SharedArena::Control* SharedArena::control(int r) const {
  return reinterpret_cast<Control*>(base(r));
}

bool SharedArena::grow_locked(int64_t to) {
  to = std::min(round_up(to, kGrowStep), reserve_);
  if (to <= committed_) return false;
  // fallocate, not ftruncate: the pages are taken now, so a full /dev/shm
  // fails here instead of raising SIGBUS in a later write.
  if (posix_fallocate(fd_, committed_, to - committed_) != 0) return false;
  const int64_t old = committed_;
  committed_ = to;
  auto last = free_.empty() ? free_.end() : std::prev(free_.end());
  if (last != free_.end() && last->first + last->second == old) {
    last->second += to - old;
  } else {
    free_[old] = to - old;
  }
  return true;
}

int64_t SharedArena::allocate(int64_t bytes) {
  bytes = round_up(std::max<int64_t>(bytes, 1), kAlign);
  std::lock_guard<std::mutex> lock(mu_);
  auto fit = std::find_if(free_.begin(), free_.end(),
                          [bytes](const auto& f) { return f.second >= bytes; });
  if (fit == free_.end()) {
    const auto last = free_.empty() ? free_.end() : std::prev(free_.end());
    const int64_t tail = last != free_.end() && last->first + last->second == committed_
                             ? last->second
                             : 0;
    if (!grow_locked(committed_ + bytes - tail)) return -1;
    fit = std::prev(free_.end());
  }
  const int64_t offset = fit->first;
  const int64_t left = fit->second - bytes;
  free_.erase(fit);
  if (left > 0) free_[offset + bytes] = left;
  used_[offset] = bytes;
  count_in_use(bytes);
  return offset;
}

void SharedArena::free(int64_t offset) {
  std::lock_guard<std::mutex> lock(mu_);
  auto u = used_.find(offset);
  if (u == used_.end()) return;
  int64_t start = offset, bytes = u->second;
  used_.erase(u);
  count_in_use(-bytes);
  auto next = free_.lower_bound(start);
  if (next != free_.end() && next->first == start + bytes) {
    bytes += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      bytes += prev->second;
      free_.erase(prev);
    }
  }
  free_[start] = bytes;
}

int64_t SharedArena::offset_of(const void* p, int64_t bytes) const {
  const char* c = static_cast<const char*>(p);
  const char* b = base(rank_);
  std::lock_guard<std::mutex> lock(mu_);
  if (c < b + kControlBytes || c + bytes > b + committed_) return -1;
  return c - b;
}

void SharedArena::wait_for(Control* c, uint32_t e, bool poll) const {
  // A short spin covers peers that arrive together, a while of yielding a
  // peer that shares this core and is about to arrive; then this rank sleeps
  // and the peer's arrival wakes it. Polling groups (a second comm thread,
  // beside the compute threads) sleep after the spin.
  for (int spins = 0; spins < spins_; ++spins) {
    if (reached(c->epoch.load(std::memory_order_acquire), e)) return;
    FSDP_CPU_RELAX();
  }
  if (!poll) {
    const auto yield_until = std::chrono::steady_clock::now() + kYieldFor;
    while (std::chrono::steady_clock::now() < yield_until) {
      if (reached(c->epoch.load(std::memory_order_acquire), e)) return;
      sched_yield();
    }
  }
  c->sleepers.fetch_add(1, std::memory_order_seq_cst);
  const timespec patience{0, 100 * 1000 * 1000};
  uint32_t seen = 0;
  while (!reached(seen = c->epoch.load(std::memory_order_seq_cst), e)) {
    syscall(SYS_futex, futex_word(c->epoch), FUTEX_WAIT, seen, &patience, nullptr, 0);
  }
  c->sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

const std::vector<int64_t>& SharedArena::barrier(int64_t payload, bool poll) {
  const uint32_t e = ++epoch_;
  Control* mine = control(rank_);
  mine->slot[e & 1].store(payload, std::memory_order_relaxed);
  // seq_cst store, then load: with the waiters' increment-then-load (wait_for),
  // either the waiter sees this epoch or this rank sees the waiter.
  mine->epoch.store(e, std::memory_order_seq_cst);
  if (mine->sleepers.load(std::memory_order_seq_cst) != 0) {
    syscall(SYS_futex, futex_word(mine->epoch), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  }
  payloads_[static_cast<size_t>(rank_)] = payload;
  for (int r = 0; r < size(); ++r) {
    if (r == rank_) continue;
    Control* c = control(r);
    if (!reached(c->epoch.load(std::memory_order_acquire), e)) wait_for(c, e, poll);
    payloads_[static_cast<size_t>(r)] = c->slot[e & 1].load(std::memory_order_relaxed);
  }
  return payloads_;
}

int64_t SharedArena::committed_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return committed_;
}

namespace {

// A block of an arena; the DataPtr's context, so the mapping outlives it.
struct ArenaBlockRef {
  std::shared_ptr<SharedArena> arena;
  int64_t offset;
};

void free_block(void* ctx) {
  auto* block = static_cast<ArenaBlockRef*>(ctx);
  block->arena->free(block->offset);
  delete block;
}

// The storages of empty_for_collectives' tensors allocate through this, so
// that fully_shard's free-and-regrow of an unsharded buffer (a storage
// resize) lands in the arena again. It holds the arena weakly and falls back
// to the CPU allocator once the group is gone or its arena is full. Never
// destroyed: storages keep a raw pointer to their allocator.
class ArenaAllocator final : public c10::Allocator {
 public:
  explicit ArenaAllocator(std::weak_ptr<SharedArena> arena) : arena_(std::move(arena)) {}
  c10::DataPtr allocate(size_t n) FSDP_ALLOCATE_CONST override {
    if (std::shared_ptr<SharedArena> a = arena_.lock()) {
      const int64_t offset = a->allocate(static_cast<int64_t>(n));
      if (offset >= 0) {
        void* data = a->base(a->rank()) + offset;
        return c10::DataPtr(data, new ArenaBlockRef{std::move(a), offset}, &free_block,
                            c10::Device(c10::kCPU));
      }
    }
    return c10::GetCPUAllocator()->allocate(n);
  }
#if FSDP_ALLOCATOR_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
#endif

 private:
  std::weak_ptr<SharedArena> arena_;
};

}  // namespace

at::Tensor empty_in_arena(const std::shared_ptr<SharedArena>& arena, at::IntArrayRef sizes,
                          const at::TensorOptions& options) {
  if (arena == nullptr || options.pinned_memory() || !options.device().is_cpu() ||
      options.layout() != c10::kStrided) {
    return at::empty(sizes, options);
  }
  std::call_once(arena->allocator_once_, [&] {
    arena->allocator_ = new ArenaAllocator(arena);  // never freed: see ArenaAllocator
  });
  return at::detail::empty_generic(sizes, arena->allocator_,
                                   c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   c10::typeMetaToScalarType(options.dtype()),
                                   options.memory_format_opt());
}

}  // namespace fsdp::detail::cpu

namespace fsdp {

at::Tensor ProcessGroup::empty_for_collectives(at::IntArrayRef sizes,
                                               const at::TensorOptions& options) {
  return at::empty(sizes, options);
}

SharedMemoryStats shared_memory_stats() {
  SharedMemoryStats s;
  {
    std::lock_guard<std::mutex> lock(detail::cpu::g_live_mu);
    for (const auto* a : detail::cpu::g_live) s.committed += a->committed_bytes();
  }
  s.in_use = detail::cpu::g_in_use.load();
  s.peak_in_use = detail::cpu::g_peak_in_use.load();
  return s;
}

void set_shared_memory_observer(void (*observer)(int64_t delta_bytes)) {
  detail::cpu::g_observer.store(observer);
}

void reset_shared_memory_peak() {
  detail::cpu::g_peak_in_use.store(detail::cpu::g_in_use.load());
}

}  // namespace fsdp
