// Timeline tracing: Chrome Trace Event Format files, one per rank, viewable in
// https://ui.perfetto.dev or chrome://tracing.
//
// FSDP_TRACE=<dir> (read once, when fsdp::Runtime starts) turns it on: every
// rank records spans -- forward and backward per unit, "all-gather issue" /
// "all-gather wait", "reshard", "reduce-scatter" / "reduce-scatter wait",
// "all-reduce" (HSDP), each collective as run on its communication thread,
// and your own Spans -- in memory, and writes them all to
// <dir>/fsdp-trace-rank<R>.json at flush() and again when the Runtime ends
// (or the process exits). The directory is created if missing; one that
// cannot be written gets a one-line warning on stderr, never an error.
//
//   {
//     fsdp::trace::Span span("optimizer step", "optim");
//     optimizer.step();
//   }
//
// Disabled, a Span costs one relaxed atomic load and a branch.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdp::trace {

namespace detail {
extern std::atomic<bool> g_enabled;
// A span by hand: begin returns its token (0 = none); end closes it and any
// span begun after it on this thread (no-op for another thread's token).
uint64_t begin(std::string name, const char* category);
void end(uint64_t token);
void add_arg(uint64_t token, const char* key, int64_t value);
void add_arg(uint64_t token, const char* key, std::string value);
// libfsdp's own hooks. start/stop: Runtime start (reads FSDP_TRACE) and end
// (flushes). swap_unit: the FSDP unit (-1: none) the spans begun on this
// thread are attributed to; returns the previous one. The next collective
// issued on this thread reports `bytes` on its communication-thread span.
void start(int rank, int world_size);
void stop();
int64_t swap_unit(int64_t unit);
int64_t current_unit();
void set_unit_label(int64_t unit, std::string label);
// The label set for `unit`, or "" (unknown or -1).
std::string unit_label(int64_t unit);
// A counter event ("ph":"C") named `name` now, one series per value:
// Perfetto and chrome://tracing draw it as a stacked area over time (the
// per-unit memory counters of fsdp/memory.h).
void counter(std::string name, const char* category,
             const std::vector<std::pair<std::string, int64_t>>& values);
void hint_collective_bytes(int64_t bytes);
int64_t take_collective_bytes();
int64_t now_ns();
}  // namespace detail

// Whether this process records spans (FSDP_TRACE was set at Runtime start
// and its directory is usable).
inline bool enabled() noexcept { return detail::g_enabled.load(std::memory_order_relaxed); }

// Records [construction, destruction) on the calling thread as one complete
// event. Spans on a thread nest (destroy them in reverse order, as scopes
// do). A null name records nothing. Not copyable or movable.
class Span {
 public:
  explicit Span(const char* name, const char* category = "user") {
    if (name != nullptr && enabled()) token_ = detail::begin(name, category);
  }
  explicit Span(const std::string& name, const char* category = "user") {
    if (enabled()) token_ = detail::begin(name, category);
  }
  ~Span() {
    if (token_ != 0) detail::end(token_);
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

  // Whether this span is being recorded.
  bool active() const noexcept { return token_ != 0; }
  // Adds an argument (integer or string) shown with the event; no-op when
  // inactive.
  template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
  Span& arg(const char* key, T value) {
    if (token_ != 0) detail::add_arg(token_, key, static_cast<int64_t>(value));
    return *this;
  }
  Span& arg(const char* key, const std::string& value) {
    if (token_ != 0) detail::add_arg(token_, key, value);
    return *this;
  }
  Span& arg(const char* key, const char* value) {
    if (token_ != 0) detail::add_arg(token_, key, std::string(value));
    return *this;
  }

 private:
  uint64_t token_ = 0;
};

// Names the calling thread in the trace (libfsdp names "main" -- the thread
// that started the Runtime -- and "comm <group>" threads itself).
void set_thread_name(std::string name);

// Writes every span recorded so far to file_path() (replacing the file; a
// no-op when nothing changed or tracing never started). Thread-safe.
void flush();

// <dir>/fsdp-trace-rank<R>.json, or empty when tracing never started.
std::string file_path();

}  // namespace fsdp::trace
