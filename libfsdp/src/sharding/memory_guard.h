// Internal: turning LibTorch's out-of-memory errors, raised while fully_shard
// allocates a collective's buffers, into fsdp::OutOfMemoryError (naming the
// unit, the operation and the bytes), announced to every rank so that none
// waits for a collective this rank will never issue (docs/memory.md#out-of-memory).
#pragma once

#include "fsdp/errors.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <new>
#include <string>
#include <utility>

namespace fsdp {
struct UnitState;
}  // namespace fsdp

namespace fsdp::detail {

// With tracing on, a counter event "memory <unit>" of the unit's bytes now
// (shard, unsharded, grad, reduce_buffer; fsdp/memory.h's categories), at
// the points where they change: unshard, reshard, reduction prepared and
// finished. Off, one relaxed load.
void trace_unit_memory(UnitState& unit);

// Whether `e` is LibTorch's out-of-memory: c10::OutOfMemoryError (CUDA), or
// the CPU allocator's "not enough memory" / "can't allocate memory".
bool is_out_of_memory(const c10::Error& e);

// Throws OutOfMemoryError for the unit this thread works for (the trace's
// unit scope), after announcing it to the other ranks.
[[noreturn]] void raise_out_of_memory(const char* op, int64_t bytes_requested,
                                      const std::string& cause);

// Runs `fn`; an out-of-memory inside it becomes raise_out_of_memory(op, bytes).
template <class Fn>
decltype(auto) oom_guard(const char* op, int64_t bytes_requested, Fn&& fn) {
  try {
    return std::forward<Fn>(fn)();
  } catch (const OutOfMemoryError&) {
    throw;  // already named (a nested guard)
  } catch (const c10::Error& e) {
    if (!is_out_of_memory(e)) throw;
    raise_out_of_memory(op, bytes_requested, e.what_without_backtrace());
  } catch (const std::bad_alloc& e) {
    raise_out_of_memory(op, bytes_requested, e.what());
  }
}

}  // namespace fsdp::detail
