// Internal: trace attribution of a unit's work -- the scope that names the
// unit for the spans and collectives a thread issues (the watchdog reads it,
// so it is on with tracing off too), and the forward/backward spans that
// begin and end in different hooks.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {
struct UnitState;
namespace detail {

// Attributes what this thread does in its scope to `unit`: the spans begun
// (the collectives' issue/wait spans) and the collectives issued, which the
// watchdog names when one is stuck -- so it is on with tracing off too.
class TraceUnit {
 public:
  explicit TraceUnit(UnitState& unit);
  ~TraceUnit();
  TraceUnit(const TraceUnit&) = delete;
  TraceUnit& operator=(const TraceUnit&) = delete;

 private:
  int64_t prev_ = -1;
};

// Forward and backward spans begin and end in different calls: (unit id,
// span token) of the open ones, per thread.
using OpenSpans = std::vector<std::pair<int64_t, uint64_t>>;
extern thread_local OpenSpans open_forward;
extern thread_local OpenSpans open_backward;

// Ends `unit_id`'s span in `open` and every span begun after it.
void trace_close(OpenSpans& open, int64_t unit_id);
// Begins "<what> <label>" for `unit` (ending one a failed pass left open).
void trace_open(OpenSpans& open, UnitState& unit, const std::string& what);
bool has_open(const OpenSpans& open, int64_t unit_id);

}  // namespace detail
}  // namespace fsdp
