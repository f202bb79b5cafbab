// The shm CPU collectives: every rank reads its peers' operands in place in
// the group's shared-memory arena (shared_arena.h). See cpu_collectives.h
// for their order of adds. The rule: docs/architecture.md#reduction-order.
#include "comm/cpu_algorithms.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace fsdp::detail::cpu {
namespace {

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

}  // namespace

std::vector<int64_t> exchange_offsets(const Peers& p, int64_t mine) {
  std::vector<int64_t> all = p.arena->barrier(mine, p.poll);
  if (std::any_of(all.begin(), all.end(), [](int64_t o) { return o < 0; })) return {};
  return all;
}

// Only the peers' blocks are staged: this rank reads its own block where it
// is.
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

}  // namespace fsdp::detail::cpu
