// libfsdp's CPU collective algorithms over MPI point-to-point and the
// shared-memory arena (cpu_collectives.h); which one runs is decided in
// cpu_algorithm_choice.cpp.
// The rule: docs/architecture.md#reduction-order.
#include "comm/cpu_collectives.h"

#include "comm/cpu_reduce.h"
#include "comm/mpi_types.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace fsdp::detail::cpu {
namespace {

// One tag: the communicator is the algorithms' own, its collectives run one
// at a time (the backend's comm thread), and MPI does not reorder messages
// between a pair on one tag.
constexpr int kTag = 17;
// Per-peer chunk of the pairwise reduce-scatter: small enough that what was
// received is still in L2 when it is added (measured: docs/benchmarks.md).
constexpr int64_t kChunkBytes = 256 * 1024;

// Elements per rank and where they start.
struct Blocks {
  std::vector<int64_t> count, displ;
  int64_t max_count() const { return *std::max_element(count.begin(), count.end()); }
};

Blocks even_blocks(int64_t block, int n) {
  Blocks b;
  for (int i = 0; i < n; ++i) {
    b.count.push_back(block);
    b.displ.push_back(block * i);
  }
  return b;
}

Blocks split_blocks(int64_t numel, int n) {
  Blocks b;
  int64_t at = 0;
  for (int i = 0; i < n; ++i) {
    const int64_t c = numel / n + (i < numel % n ? 1 : 0);
    b.count.push_back(c);
    b.displ.push_back(at);
    at += c;
  }
  return b;
}

int mod(int a, int n) { return ((a % n) + n) % n; }

Combine combine_of(ReduceOp op) { return op == ReduceOp::MAX ? Combine::Max : Combine::Sum; }

// AVG divides in the accumulation type, before the one rounding.
double divisor_of(ReduceOp op, int n) { return op == ReduceOp::AVG ? n : 1; }

// The requests of one exchange round; the buffers belong to the caller.
class Round {
 public:
  explicit Round(const Peers& p) : p_(p) {}
  void send(const void* buf, int64_t n, MPI_Datatype dt, int peer) {
    if (n == 0) return;
    reqs_.push_back(MPI_REQUEST_NULL);
    check_mpi(MPI_Isend(buf, static_cast<int>(n), dt, peer, kTag, p_.comm, &reqs_.back()),
              "MPI_Isend");
  }
  void recv(void* buf, int64_t n, MPI_Datatype dt, int peer) {
    if (n == 0) return;
    reqs_.push_back(MPI_REQUEST_NULL);
    check_mpi(MPI_Irecv(buf, static_cast<int>(n), dt, peer, kTag, p_.comm, &reqs_.back()),
              "MPI_Irecv");
  }
  void wait(const char* what) {
    wait_requests(reqs_.data(), static_cast<int>(reqs_.size()), p_.poll, what);
    reqs_.clear();
  }

 private:
  const Peers& p_;
  std::vector<MPI_Request> reqs_;
};

char* bytes(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

// This rank's block of an all-gather's output, holding `mine` (copied
// unless it is already there, as in all-reduce).
char* place_own_block(const Peers& p, int64_t es, char* out, const char* mine, const Blocks& b) {
  char* own = out + b.displ[p.rank] * es;
  if (own != mine) std::memcpy(own, mine, static_cast<size_t>(b.count[p.rank] * es));
  return own;
}

void pairwise_gather(const Peers& p, c10::ScalarType t, char* out, const char* mine,
                     const Blocks& b) {
  const MPI_Datatype dt = mpi_datatype(t, "input");
  const auto es = static_cast<int64_t>(c10::elementSize(t));
  char* own = place_own_block(p, es, out, mine, b);
  Round round(p);
  for (int s = 1; s < p.size; ++s) {
    const int from = mod(p.rank - s, p.size);
    round.recv(out + b.displ[from] * es, b.count[from], dt, from);
  }
  for (int s = 1; s < p.size; ++s) {
    round.send(own, b.count[p.rank], dt, mod(p.rank + s, p.size));
  }
  round.wait("all_gather (pairwise)");
}

void ring_gather(const Peers& p, c10::ScalarType t, char* out, const char* mine,
                 const Blocks& b) {
  const MPI_Datatype dt = mpi_datatype(t, "input");
  const auto es = static_cast<int64_t>(c10::elementSize(t));
  place_own_block(p, es, out, mine, b);
  const int right = mod(p.rank + 1, p.size), left = mod(p.rank - 1, p.size);
  Round round(p);
  for (int s = 0; s + 1 < p.size; ++s) {
    const int send_b = mod(p.rank - s, p.size), recv_b = mod(p.rank - s - 1, p.size);
    round.recv(out + b.displ[recv_b] * es, b.count[recv_b], dt, left);
    round.send(out + b.displ[send_b] * es, b.count[send_b], dt, right);
    round.wait("all_gather (ring)");
  }
}

// out (b.count[rank] elements) <- rank's block of the reduction of every
// rank's `in`. out may alias rank's block of `in` (all-reduce).
void pairwise_reduce(const Peers& p, c10::ScalarType t, ReduceOp op, char* out, const char* in,
                     const Blocks& b) {
  const MPI_Datatype dt = mpi_datatype(t, "input");
  const auto es = static_cast<int64_t>(c10::elementSize(t));
  const int n = p.size;
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / es);
  auto chunks_of = [&](int r) { return (b.count[r] + chunk - 1) / chunk; };
  int64_t rounds = 0;
  for (int r = 0; r < n; ++r) rounds = std::max(rounds, chunks_of(r));
  // One slot per rank: this rank's own chunk is copied into its slot when
  // out aliases the input (all-reduce), before anything is received into out.
  const char* own_in = in + b.displ[p.rank] * es;
  const bool aliased = out == own_in;
  // One peer's chunk is received straight into out: the fold may write over
  // its first two operands, so that peer is the first rank of {0, 1} that is
  // not this one. At np 2 no staging is left, which made the 1 MiB
  // reduce-scatter 2.3x faster and the 2 MiB one 1.15x (fsdp-bench
  // collectives, float32).
  const int direct = p.rank == 0 ? 1 : 0;
  at::Tensor stage = at::empty({n * std::min(chunk, b.max_count())}, at::TensorOptions(t));
  at::Tensor scratch = acc_type(t) == t ? at::Tensor()
                                        : at::empty({std::min(chunk, b.max_count())},
                                                    at::TensorOptions(at::kFloat));
  const int64_t slot = std::min(chunk, b.max_count()) * es;
  std::vector<const void*> xs(static_cast<size_t>(n));
  Round round(p);
  for (int64_t k = 0; k < rounds; ++k) {
    const int64_t start = k * chunk;
    const int64_t len = std::clamp<int64_t>(b.count[p.rank] - start, 0, chunk);
    if (len > 0 && aliased) {
      std::memcpy(bytes(stage) + p.rank * slot, own_in + start * es, static_cast<size_t>(len * es));
    }
    for (int s = 1; s < n; ++s) {
      const int from = mod(p.rank - s, n);
      round.recv(from == direct ? out + start * es : bytes(stage) + from * slot, len, dt, from);
    }
    for (int s = 1; s < n; ++s) {
      const int to = mod(p.rank + s, n);
      const int64_t their = std::clamp<int64_t>(b.count[to] - start, 0, chunk);
      round.send(in + (b.displ[to] + start) * es, their, dt, to);
    }
    round.wait("reduce_scatter (pairwise)");
    if (len == 0) continue;
    for (int r = 0; r < n; ++r) {
      xs[static_cast<size_t>(r)] = r == direct                ? out + start * es
                                   : r == p.rank && !aliased ? own_in + start * es
                                                             : bytes(stage) + r * slot;
    }
    fold(t, combine_of(op), out + start * es, xs.data(), n, len, divisor_of(op, n),
         scratch.defined() ? scratch.data_ptr<float>() : nullptr);
  }
}

void ring_reduce(const Peers& p, c10::ScalarType t, ReduceOp op, char* out, const char* in,
                 const Blocks& b) {
  const c10::ScalarType at_t = acc_type(t);
  const MPI_Datatype acc_dt = mpi_datatype(at_t, "input");
  const auto es = static_cast<int64_t>(c10::elementSize(t));
  const auto aes = static_cast<int64_t>(c10::elementSize(at_t));
  const int n = p.size;
  const int right = mod(p.rank + 1, n), left = mod(p.rank - 1, n);
  at::Tensor bufs = at::empty({2, std::max<int64_t>(1, b.max_count())}, at::TensorOptions(at_t));
  char* send_buf = bytes(bufs);
  char* recv_buf = send_buf + bufs.size(1) * aes;
  const int first = mod(p.rank - 1, n);
  const char* sending = in + b.displ[first] * es;
  if (at_t != t) {
    widen(t, send_buf, sending, b.count[first]);
    sending = send_buf;
  }
  Round round(p);
  for (int s = 0; s + 1 < n; ++s) {
    const int send_b = mod(p.rank - s - 1, n), recv_b = mod(p.rank - s - 2, n);
    round.recv(recv_buf, b.count[recv_b], acc_dt, left);
    round.send(sending, b.count[send_b], acc_dt, right);
    round.wait("reduce_scatter (ring)");
    accumulate(t, combine_of(op), recv_buf, in + b.displ[recv_b] * es, b.count[recv_b]);
    std::swap(send_buf, recv_buf);
    sending = send_buf;
  }
  // The last block received is this rank's: (rank - (n - 2) - 2) mod n.
  narrow(t, out, sending, b.count[p.rank], divisor_of(op, n));
}

// ---- shm: through the group's shared-memory arena ----------------------------

// Elements of one fold pass: the partial sums stay in cache while every
// rank's input streams through.
constexpr int64_t kFoldChunk = 16 * 1024;

// A block of this rank's segment, freed when it goes out of scope (after the
// collective's last barrier: no peer reads it any more).
class ArenaBlock {
 public:
  explicit ArenaBlock(SharedArena* arena) : arena_(arena) {}
  ~ArenaBlock() {
    if (offset_ >= 0) arena_->free(offset_);
  }
  ArenaBlock(const ArenaBlock&) = delete;
  ArenaBlock& operator=(const ArenaBlock&) = delete;
  int64_t allocate(int64_t bytes) { return offset_ = arena_->allocate(bytes); }
  int64_t offset() const { return offset_; }

 private:
  SharedArena* arena_;
  int64_t offset_ = -1;
};

// Where this rank's operand (`bytes` at `data`) is in its segment: where it
// already lives, else a copy in `stage`, followed by `extra` bytes of room;
// -1 when the segment cannot grow that far.
int64_t place_in_arena(const Peers& p, const char* data, int64_t bytes, int64_t extra,
                       ArenaBlock& stage) {
  if (extra == 0) {
    const int64_t at = p.arena->offset_of(data, bytes);
    if (at >= 0) return at;
  }
  const int64_t at = stage.allocate(bytes + extra);
  if (at >= 0) std::memcpy(p.arena->base(p.rank) + at, data, static_cast<size_t>(bytes));
  return at;
}

// Every rank's operand offset after a barrier; empty on every rank when some
// rank could not place its operand (all of them then fall back together).
std::vector<int64_t> exchange_offsets(const Peers& p, int64_t mine) {
  std::vector<int64_t> all = p.arena->barrier(mine, p.poll);
  if (std::any_of(all.begin(), all.end(), [](int64_t o) { return o < 0; })) return {};
  return all;
}

// out[0, count) = fold of xs[r][0, count) over r = 0..N-1, pass by pass.
void shm_fold(const Peers& p, c10::ScalarType t, ReduceOp op, char* out,
              const std::vector<const char*>& xs, int64_t count) {
  const auto es = static_cast<int64_t>(c10::elementSize(t));
  at::Tensor scratch = acc_type(t) == t ? at::Tensor()
                                        : at::empty({std::min(kFoldChunk, count)},
                                                    at::TensorOptions(at::kFloat));
  std::vector<const void*> at(xs.size());
  for (int64_t start = 0; start < count; start += kFoldChunk) {
    const int64_t len = std::min(kFoldChunk, count - start);
    for (size_t r = 0; r < xs.size(); ++r) at[r] = xs[r] + start * es;
    fold(t, combine_of(op), out + start * es, at.data(), p.size, len, divisor_of(op, p.size),
         scratch.defined() ? scratch.data_ptr<float>() : nullptr);
  }
}

// False (on every rank, after one barrier, having done nothing) when some
// rank's input is neither in its arena nor staged there: `stage` off, or
// its segment could not hold it. Only the peers' blocks are staged: this
// rank reads its own block where it is.
bool shm_reduce(const Peers& p, c10::ScalarType t, ReduceOp op, char* out, const char* in,
                const Blocks& b, bool may_stage) {
  const auto es = static_cast<int64_t>(c10::elementSize(t));
  const int64_t bytes = (b.displ.back() + b.count.back()) * es;
  const int64_t own_at = b.displ[p.rank] * es, own_bytes = b.count[p.rank] * es;
  ArenaBlock stage(p.arena);
  int64_t mine = p.arena->offset_of(in, bytes);
  if (mine < 0 && may_stage && stage.allocate(bytes) >= 0) {
    mine = stage.offset();
    char* s = p.arena->base(p.rank) + mine;
    std::memcpy(s, in, static_cast<size_t>(own_at));
    std::memcpy(s + own_at + own_bytes, in + own_at + own_bytes,
                static_cast<size_t>(bytes - own_at - own_bytes));
  }
  const std::vector<int64_t> at = exchange_offsets(p, mine);
  if (at.empty()) return false;
  // The fold may write over only its first two operands: an output that is
  // this rank's input block reads a copy of it.
  at::Tensor own_copy;
  const char* own = in + own_at;
  if (out == own) {
    own_copy = at::empty({own_bytes}, at::TensorOptions(at::kByte));
    std::memcpy(own_copy.data_ptr(), own, static_cast<size_t>(own_bytes));
    own = static_cast<const char*>(own_copy.data_ptr());
  }
  std::vector<const char*> xs(static_cast<size_t>(p.size));
  for (int r = 0; r < p.size; ++r) {
    xs[static_cast<size_t>(r)] =
        r == p.rank ? own : p.arena->base(r) + at[static_cast<size_t>(r)] + own_at;
  }
  shm_fold(p, t, op, out, xs, b.count[p.rank]);
  p.arena->barrier(0, p.poll);  // no peer reads this rank's input any more
  return true;
}

bool shm_gather(const Peers& p, c10::ScalarType t, char* out, const char* mine,
                const Blocks& b, bool may_stage) {
  const auto es = static_cast<int64_t>(c10::elementSize(t));
  const int64_t bytes = b.count[p.rank] * es;
  ArenaBlock stage(p.arena);
  const std::vector<int64_t> at = exchange_offsets(
      p, may_stage ? place_in_arena(p, mine, bytes, 0, stage) : p.arena->offset_of(mine, bytes));
  if (at.empty()) return false;
  place_own_block(p, es, out, mine, b);
  for (int s = 1; s < p.size; ++s) {
    const int r = mod(p.rank + s, p.size);
    std::memcpy(out + b.displ[r] * es, p.arena->base(r) + at[static_cast<size_t>(r)],
                static_cast<size_t>(b.count[r] * es));
  }
  p.arena->barrier(0, p.poll);
  return true;
}

// The tensor is read by peers and overwritten here, so it is always staged,
// with room after it for this rank's reduced block, which peers copy out.
bool shm_all_reduce(const Peers& p, c10::ScalarType t, ReduceOp op, char* data,
                    const Blocks& b) {
  const auto es = static_cast<int64_t>(c10::elementSize(t));
  const int64_t bytes = (b.displ.back() + b.count.back()) * es;
  ArenaBlock stage(p.arena);
  const std::vector<int64_t> at =
      exchange_offsets(p, place_in_arena(p, data, bytes, b.max_count() * es, stage));
  if (at.empty()) return false;
  auto reduced = [&](int r) { return p.arena->base(r) + at[static_cast<size_t>(r)] + bytes; };
  std::vector<const char*> xs(static_cast<size_t>(p.size));
  for (int r = 0; r < p.size; ++r) {
    xs[static_cast<size_t>(r)] = p.arena->base(r) + at[static_cast<size_t>(r)] +
                                 b.displ[p.rank] * es;
  }
  shm_fold(p, t, op, reduced(p.rank), xs, b.count[p.rank]);
  p.arena->barrier(0, p.poll);  // every rank's block is reduced
  for (int s = 0; s < p.size; ++s) {
    const int r = mod(p.rank + s, p.size);
    std::memcpy(data + b.displ[r] * es, reduced(r), static_cast<size_t>(b.count[r] * es));
  }
  p.arena->barrier(0, p.poll);
  return true;
}

// ---- two_level: rail over MPI between nodes, the node's arena inside -------

int64_t total(const Blocks& b) { return b.count.empty() ? 0 : b.displ.back() + b.count.back(); }

// Blocks of the rail of local index j, in node order: node m holds the
// group's block rank_of(m, j). Every rank of that rail computes the same.
Blocks rail_blocks(const TwoLevel& tl, const Blocks& b, int j) {
  Blocks r;
  int64_t at = 0;
  for (int m = 0; m < tl.nodes; ++m) {
    const int owner = tl.rank_of[static_cast<size_t>(m * tl.per_node + j)];
    const int64_t c = b.count[static_cast<size_t>(owner)];
    r.count.push_back(c);
    r.displ.push_back(at);
    at += c;
  }
  return r;
}

// A node-arena block of `bytes` (one byte at least: allocations of 0 are
// not distinguished from failure) or -1: none, or no arena.
int64_t allocate_on_node(const Peers& node, ArenaBlock& block, int64_t bytes) {
  return node.arena == nullptr ? -1 : block.allocate(std::max<int64_t>(bytes, 1));
}

void two_level_gather(const Peers& p, c10::ScalarType t, char* out, const char* mine,
                      const Blocks& b) {
  const TwoLevel& tl = *p.two_level;
  const Peers& node = tl.node_peers;
  const auto es = static_cast<int64_t>(c10::elementSize(t));
  const int n = tl.per_node;
  // (1) The rail gathers this local index's block of every node: the bundle,
  // received straight into the node arena when there is room, so the node's
  // ranks read it where the rail put it.
  const Blocks mine_rail = rail_blocks(tl, b, tl.local);
  const int64_t bundle_bytes = total(mine_rail) * es;
  ArenaBlock stage(node.arena);
  const int64_t off = allocate_on_node(node, stage, bundle_bytes);
  at::Tensor plain;
  char* bundle = nullptr;
  if (off >= 0) {
    bundle = node.arena->base(node.rank) + off;
  } else {
    plain = at::empty({std::max<int64_t>(bundle_bytes, 1)}, at::TensorOptions(at::kByte));
    bundle = bytes(plain);
  }
  pairwise_gather(tl.rail, t, bundle, mine, mine_rail);
  // (2) Every node rank's bundle: in place in its arena block, or (some rank
  // of the node without room, or no arena) gathered over MPI.
  std::vector<const char*> bundles(static_cast<size_t>(n), nullptr);
  bool shm = false;
  if (node.arena != nullptr) {
    const std::vector<int64_t> at = exchange_offsets(node, off);
    shm = !at.empty();
    for (int j = 0; shm && j < n; ++j) {
      bundles[static_cast<size_t>(j)] = node.arena->base(j) + at[static_cast<size_t>(j)];
    }
  }
  at::Tensor all;
  if (!shm) {
    Blocks nb;
    int64_t elems = 0;
    for (int j = 0; j < n; ++j) {
      nb.count.push_back(total(rail_blocks(tl, b, j)));
      nb.displ.push_back(elems);
      elems += nb.count.back();
    }
    all = at::empty({std::max<int64_t>(elems * es, 1)}, at::TensorOptions(at::kByte));
    pairwise_gather(node, t, bytes(all), bundle, nb);
    for (int j = 0; j < n; ++j) bundles[static_cast<size_t>(j)] = bytes(all) + nb.displ[j] * es;
  }
  // (3) Each bundle's blocks to their group ranks' places in the output.
  for (int s = 0; s < n; ++s) {
    const int j = mod(tl.local + s, n);
    const Blocks rb = rail_blocks(tl, b, j);
    for (int m = 0; m < tl.nodes; ++m) {
      const int r = tl.rank_of[static_cast<size_t>(m * n + j)];
      std::memcpy(out + b.displ[r] * es, bundles[static_cast<size_t>(j)] + rb.displ[m] * es,
                  static_cast<size_t>(rb.count[m] * es));
    }
  }
  if (shm) node.arena->barrier(0, node.poll);  // no node rank reads this bundle any more
}

// out (b.count[rank] elements) <- the reduction of rank's block of every
// rank's `in`; out may alias rank's block of `in` (all-reduce).
void two_level_reduce(const Peers& p, c10::ScalarType t, ReduceOp op, char* out, const char* in,
                      const Blocks& b) {
  const TwoLevel& tl = *p.two_level;
  const Peers& node = tl.node_peers;
  const c10::ScalarType at_t = acc_type(t);
  const auto es = static_cast<int64_t>(c10::elementSize(t));
  const auto aes = static_cast<int64_t>(c10::elementSize(at_t));
  const int n = tl.per_node, j = tl.local;
  const int64_t in_bytes = total(b) * es;
  // The blocks this local index sums for every node, in the rail's layout.
  const Blocks rb = rail_blocks(tl, b, j);
  // (1) Every node rank's input: in place in its arena (staged there when it
  // lives elsewhere), or, without room on some node rank, the blocks this
  // rank sums received over MPI into `recv` (rail layout, one row per rank).
  std::vector<const char*> ins(static_cast<size_t>(n), nullptr);
  ArenaBlock stage(node.arena);
  bool shm = false;
  if (node.arena != nullptr) {
    int64_t mine = node.arena->offset_of(in, in_bytes);
    if (mine < 0 && allocate_on_node(node, stage, in_bytes) >= 0) {
      mine = stage.offset();
      std::memcpy(node.arena->base(node.rank) + mine, in, static_cast<size_t>(in_bytes));
    }
    const std::vector<int64_t> at = exchange_offsets(node, mine);
    shm = !at.empty();
    for (int k = 0; shm && k < n; ++k) {
      ins[static_cast<size_t>(k)] =
          k == j ? in : node.arena->base(k) + at[static_cast<size_t>(k)];
    }
  }
  at::Tensor recv;
  const int64_t row = total(rb) * es;
  if (!shm) {
    const MPI_Datatype dt = mpi_datatype(t, "input");
    recv = at::empty({std::max<int64_t>(row * n, 1)}, at::TensorOptions(at::kByte));
    Round round(node);
    // Per peer, one message per node's block, posted in node order on both
    // sides (MPI keeps a pair's messages on one tag in order).
    for (int s = 1; s < n; ++s) {
      const int from = mod(j - s, n);
      for (int m = 0; m < tl.nodes; ++m) {
        round.recv(bytes(recv) + from * row + rb.displ[m] * es, rb.count[m], dt, from);
      }
    }
    for (int s = 1; s < n; ++s) {
      const int to = mod(j + s, n);
      for (int m = 0; m < tl.nodes; ++m) {
        const int r = tl.rank_of[static_cast<size_t>(m * n + to)];
        round.send(in + b.displ[r] * es, b.count[r], dt, to);
      }
    }
    round.wait("reduce_scatter (two_level, node step)");
  }
  // Rank k's copy of node m's block for this local index.
  auto block_of = [&](int k, int m) -> const char* {
    if (shm || k == j) {
      const int r = tl.rank_of[static_cast<size_t>(m * n + j)];
      return (k == j ? in : ins[static_cast<size_t>(k)]) + b.displ[r] * es;
    }
    return bytes(recv) + k * row + rb.displ[m] * es;
  };
  // The node partials, over this node's ranks 0..n-1 in order, in the
  // accumulation type, a cache-sized chunk at a time.
  at::Tensor partial = at::empty({std::max<int64_t>(total(rb), 1)}, at::TensorOptions(at_t));
  const Combine c = combine_of(op);
  for (int m = 0; m < tl.nodes; ++m) {
    char* acc = bytes(partial) + rb.displ[m] * aes;
    for (int64_t start = 0; start < rb.count[m]; start += kFoldChunk) {
      const int64_t len = std::min(kFoldChunk, rb.count[m] - start);
      widen(t, acc + start * aes, block_of(0, m) + start * es, len);
      for (int k = 1; k < n; ++k) {
        accumulate(t, c, acc + start * aes, block_of(k, m) + start * es, len);
      }
    }
  }
  if (shm) node.arena->barrier(0, node.poll);  // no node rank reads this rank's input any more
  // (2) The rail reduce-scatters the partials: node partials in node order,
  // in the accumulation type (pairwise's fold over the rail's ranks), then
  // rounded once, AVG dividing by the group's size there.
  const ReduceOp rail_op = op == ReduceOp::MAX ? ReduceOp::MAX : ReduceOp::SUM;
  const double divisor = divisor_of(op, p.size);
  const int64_t count = b.count[p.rank];
  if (at_t == t && divisor == 1) {
    pairwise_reduce(tl.rail, at_t, rail_op, out, bytes(partial), rb);
    return;
  }
  at::Tensor reduced = at::empty({std::max<int64_t>(count, 1)}, at::TensorOptions(at_t));
  pairwise_reduce(tl.rail, at_t, rail_op, bytes(reduced), bytes(partial), rb);
  narrow(t, out, bytes(reduced), count, divisor);
}

void reduce(const Peers& p, CpuAlgorithm algorithm, c10::ScalarType t, ReduceOp op, char* out,
            const char* in, const Blocks& b) {
  if (algorithm == CpuAlgorithm::Ring) {
    ring_reduce(p, t, op, out, in, b);
  } else if (algorithm == CpuAlgorithm::TwoLevel && p.two_level != nullptr) {
    two_level_reduce(p, t, op, out, in, b);
  } else if (algorithm != CpuAlgorithm::Shm || !shm_reduce(p, t, op, out, in, b, true)) {
    pairwise_reduce(p, t, op, out, in, b);
  }
}

void gather(const Peers& p, CpuAlgorithm algorithm, c10::ScalarType t, char* out,
            const char* mine, const Blocks& b) {
  if (algorithm == CpuAlgorithm::Ring) {
    ring_gather(p, t, out, mine, b);
  } else if (algorithm == CpuAlgorithm::TwoLevel && p.two_level != nullptr) {
    two_level_gather(p, t, out, mine, b);
  } else if (algorithm != CpuAlgorithm::Shm || !shm_gather(p, t, out, mine, b, true)) {
    pairwise_gather(p, t, out, mine, b);
  }
}

}  // namespace

std::unique_ptr<TwoLevel> TwoLevel::create(MPI_Comm comm, bool poll) {
  int rank = 0, size = 1;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  if (size < 4) return nullptr;  // 2 nodes x 2 ranks at least
  // Key 0 everywhere: MPI then orders the node's ranks by group rank.
  MPI_Comm node = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type");
  int local = 0, per_node = 1;
  check_mpi(MPI_Comm_rank(node, &local), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(node, &per_node), "MPI_Comm_size");
  // A node is named by its lowest group rank (its local rank 0's); every
  // rank learns every rank's (node name, local index), so all decide alike.
  int leader = rank;
  check_mpi(MPI_Bcast(&leader, 1, MPI_INT, 0, node), "MPI_Bcast");
  std::vector<int> info(static_cast<size_t>(2 * size));
  const int mine[2] = {leader, local};
  check_mpi(MPI_Allgather(mine, 2, MPI_INT, info.data(), 2, MPI_INT, comm), "MPI_Allgather");
  std::vector<int> leaders;  // increasing: a node's index is its place here
  std::vector<int> ranks_on(static_cast<size_t>(size), 0);
  for (int r = 0; r < size; ++r) {
    const int l = info[static_cast<size_t>(2 * r)];
    if (l == r) leaders.push_back(r);
    ++ranks_on[static_cast<size_t>(l)];
  }
  const int nodes = static_cast<int>(leaders.size());
  const int n = ranks_on[static_cast<size_t>(leaders.front())];
  bool uniform = nodes >= 2 && n >= 2;
  for (int l : leaders) uniform = uniform && ranks_on[static_cast<size_t>(l)] == n;
  if (!uniform) {
    MPI_Comm_free(&node);
    return nullptr;
  }
  std::unique_ptr<TwoLevel> tl(new TwoLevel());
  tl->nodes = nodes;
  tl->per_node = n;
  tl->local = local;
  tl->rank_of.assign(static_cast<size_t>(size), -1);
  for (int r = 0; r < size; ++r) {
    const int m = static_cast<int>(std::lower_bound(leaders.begin(), leaders.end(),
                                                    info[static_cast<size_t>(2 * r)]) -
                                   leaders.begin());
    tl->rank_of[static_cast<size_t>(m * n + info[static_cast<size_t>(2 * r + 1)])] = r;
    if (r == rank) tl->node = m;
  }
  MPI_Comm rail = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(comm, local, tl->node, &rail), "MPI_Comm_split");
  std::string why;  // no arena: the node step runs over MPI, same order
  tl->node_arena = SharedArena::create(node, &why);
  tl->node_peers = Peers{node, local, n, poll, tl->node_arena.get(), nullptr};
  tl->rail = Peers{rail, tl->node, nodes, poll, nullptr, nullptr};
  return tl;
}

TwoLevel::~TwoLevel() {
  node_arena.reset();  // before its communicator
  if (node_peers.comm != MPI_COMM_NULL) MPI_Comm_free(&node_peers.comm);
  if (rail.comm != MPI_COMM_NULL) MPI_Comm_free(&rail.comm);
}

int64_t two_level_cross_node_bytes(const TwoLevel& tl, Collective op, c10::ScalarType dtype,
                                   int64_t numel) {
  const int size = tl.nodes * tl.per_node;
  const int rank = tl.rank_of[static_cast<size_t>(tl.node * tl.per_node + tl.local)];
  const auto es = static_cast<int64_t>(c10::elementSize(dtype));
  const auto aes = static_cast<int64_t>(c10::elementSize(acc_type(dtype)));
  const Blocks b =
      op == Collective::AllReduce ? split_blocks(numel, size) : even_blocks(numel, size);
  const Blocks rb = rail_blocks(tl, b, tl.local);
  // All-gather: this rank's block to every other node. Reduce-scatter: this
  // node's partial of each other node's block, in the accumulation type.
  const int64_t gather = (tl.nodes - 1) * b.count[static_cast<size_t>(rank)] * es;
  const int64_t reduce = (total(rb) - rb.count[static_cast<size_t>(tl.node)]) * aes;
  switch (op) {
    case Collective::AllGather: return gather;
    case Collective::ReduceScatter: return reduce;
    case Collective::AllReduce: return reduce + gather;
  }
  return 0;
}

void wait_requests(MPI_Request* requests, int n, bool poll, const char* what) {
  if (n == 0) return;
  if (!poll) {
    check_mpi(MPI_Waitall(n, requests, MPI_STATUSES_IGNORE), what);
    return;
  }
  int done = 0;
  for (int spins = 0; spins < 64; ++spins) {
    check_mpi(MPI_Testall(n, requests, &done, MPI_STATUSES_IGNORE), what);
    if (done) return;
  }
  std::chrono::microseconds nap(8);
  for (;;) {
    std::this_thread::sleep_for(nap);
    check_mpi(MPI_Testall(n, requests, &done, MPI_STATUSES_IGNORE), what);
    if (done) return;
    nap = std::min(nap * 2, std::chrono::microseconds(128));
  }
}

void all_gather(const Peers& p, CpuAlgorithm algorithm, const at::Tensor& out,
                const at::Tensor& in) {
  gather(p, algorithm, in.scalar_type(), bytes(out), static_cast<const char*>(in.data_ptr()),
         even_blocks(in.numel(), p.size));
}

void reduce_scatter(const Peers& p, CpuAlgorithm algorithm, const at::Tensor& out,
                    const at::Tensor& in, ReduceOp op) {
  reduce(p, algorithm, in.scalar_type(), op, bytes(out), static_cast<const char*>(in.data_ptr()),
         even_blocks(out.numel(), p.size));
}

bool all_gather_if_shared(const Peers& p, const at::Tensor& out, const at::Tensor& in) {
  return shm_gather(p, in.scalar_type(), bytes(out), static_cast<const char*>(in.data_ptr()),
                    even_blocks(in.numel(), p.size), /*may_stage=*/false);
}

bool reduce_scatter_if_shared(const Peers& p, const at::Tensor& out, const at::Tensor& in,
                              ReduceOp op) {
  return shm_reduce(p, in.scalar_type(), op, bytes(out), static_cast<const char*>(in.data_ptr()),
                    even_blocks(out.numel(), p.size), /*may_stage=*/false);
}

void all_reduce(const Peers& p, CpuAlgorithm algorithm, const at::Tensor& t, ReduceOp op) {
  const Blocks b = split_blocks(t.numel(), p.size);
  const auto es = static_cast<int64_t>(c10::elementSize(t.scalar_type()));
  if (algorithm == CpuAlgorithm::Shm) {
    if (shm_all_reduce(p, t.scalar_type(), op, bytes(t), b)) return;
    algorithm = CpuAlgorithm::Pairwise;
  }
  char* own = bytes(t) + b.displ[p.rank] * es;
  reduce(p, algorithm, t.scalar_type(), op, own, bytes(t), b);
  gather(p, algorithm, t.scalar_type(), bytes(t), own, b);
}

}  // namespace fsdp::detail::cpu
