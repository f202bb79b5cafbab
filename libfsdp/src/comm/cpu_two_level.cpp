// The two_level CPU collectives, for a group whose ranks span nodes: a rail
// over MPI between nodes, the node's arena inside (cpu_collectives.h); and
// the group's layout over nodes they run on (TwoLevel).
// The rule: docs/architecture.md#reduction-order.
#include "comm/cpu_algorithms.h"

#include "comm/mpi_types.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::detail::cpu {
namespace {

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

}  // namespace

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

}  // namespace fsdp::detail::cpu
