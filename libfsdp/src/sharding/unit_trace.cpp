// Trace attribution of a unit's work (fsdp/trace.h): the unit scope of a
// thread, and the forward/backward spans open on it.
#include "sharding/unit_trace.h"

#include "fsdp/trace.h"
#include "sharding/state.h"

#include <algorithm>
#include <cstddef>

namespace fsdp::detail {

TraceUnit::TraceUnit(UnitState& unit) {
  unit.register_label();
  prev_ = trace::detail::swap_unit(unit.id);
}

TraceUnit::~TraceUnit() { trace::detail::swap_unit(prev_); }

thread_local OpenSpans open_forward;
thread_local OpenSpans open_backward;

void trace_close(OpenSpans& open, int64_t unit_id) {
  for (size_t i = open.size(); i-- > 0;) {
    if (open[i].first != unit_id) continue;
    trace::detail::end(open[i].second);  // also ends the spans begun after it
    open.erase(open.begin() + static_cast<std::ptrdiff_t>(i), open.end());
    return;
  }
}

void trace_open(OpenSpans& open, UnitState& unit, const std::string& what) {
  trace_close(open, unit.id);  // left open by a pass that threw
  const uint64_t token = trace::detail::begin(what + " " + unit.label(), "fsdp");
  trace::detail::add_arg(token, "unit", unit.id);
  open.emplace_back(unit.id, token);
}

bool has_open(const OpenSpans& open, int64_t unit_id) {
  return std::any_of(open.begin(), open.end(),
                     [&](const std::pair<int64_t, uint64_t>& o) { return o.first == unit_id; });
}

}  // namespace fsdp::detail
