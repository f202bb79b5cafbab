// Collective counters and the pending-collective registry.
#include "comm/counters.h"

#include "fsdp/collective_counters.h"
#include "fsdp/comm_diagnostics.h"
#include "fsdp/trace.h"
#include "comm/pending_registry.h"
#include "comm/work.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

namespace fsdp {
namespace {

constexpr size_t kMaxSequence = 100000;

std::mutex& counters_mu() {
  static std::mutex mu;
  return mu;
}
CollectiveCounters& counters() {
  static CollectiveCounters c;
  return c;
}

using Clock = std::chrono::steady_clock;
std::mutex& pending_mu() {
  static std::mutex mu;
  return mu;
}
std::unordered_map<const detail::PendingWork*, Clock::time_point>& pending() {
  static std::unordered_map<const detail::PendingWork*, Clock::time_point> p;
  return p;
}

}  // namespace

int64_t CollectiveCounters::total_cross_node_bytes(const std::string& op,
                                                   const std::string& group) const {
  int64_t n = 0;
  for (const auto& [key, value] : cross_node_bytes) {
    if ((op.empty() || key.first == op) && (group.empty() || key.second == group)) n += value;
  }
  return n;
}

int64_t CollectiveCounters::runs(const std::string& algorithm, const std::string& op,
                                 const std::string& group) const {
  int64_t n = 0;
  for (const auto& [key, value] : algorithm_count) {
    const auto& [o, g, a] = key;
    if (a == algorithm && (op.empty() || o == op) && (group.empty() || g == group)) n += value;
  }
  return n;
}

int64_t CollectiveCounters::total(const std::string& op, const std::string& group) const {
  int64_t n = 0;
  for (const auto& [key, value] : count) {
    if (key.first == op && (group.empty() || key.second == group)) n += value;
  }
  return n;
}

CollectiveCounters collective_counters() {
  std::lock_guard<std::mutex> lock(counters_mu());
  return counters();
}

void reset_collective_counters() {
  std::lock_guard<std::mutex> lock(counters_mu());
  counters() = CollectiveCounters{};
}

std::string describe_pending_collectives() {
  const auto entries = detail::pending_snapshot();
  if (entries.empty()) return "none";
  std::string out;
  for (const auto& e : entries) out += (out.empty() ? "" : "; ") + detail::describe_pending(e);
  return out;
}

namespace detail {

void count_collective(const std::string& op, const std::string& group, int64_t bytes) {
  std::lock_guard<std::mutex> lock(counters_mu());
  auto& c = counters();
  c.count[{op, group}] += 1;
  c.bytes[{op, group}] += bytes;
  if (c.sequence.size() < kMaxSequence) c.sequence.push_back({op, group, bytes});
}

namespace {
// The cross-node bytes an algorithm reported on this thread since
// begin_reported_cross_node_bytes (-1: none), and the comm span it runs in.
thread_local int64_t tl_reported = -1;
thread_local uint64_t tl_comm_span = 0;
}  // namespace

void count_cross_node(const std::string& op, const std::string& group,
                      const std::string& algorithm, int64_t cross_node_bytes, bool modelled) {
  {
    std::lock_guard<std::mutex> lock(counters_mu());
    auto& c = counters();
    c.algorithm_count[{op, group, algorithm}] += 1;
    c.cross_node_bytes[{op, group}] += cross_node_bytes;
    if (modelled) c.modelled_cross_node_bytes[{op, group}] += cross_node_bytes;
  }
  if (tl_comm_span != 0) {
    trace::detail::add_arg(tl_comm_span, "algorithm", algorithm);
    trace::detail::add_arg(tl_comm_span, "cross_node_bytes", cross_node_bytes);
    if (modelled) trace::detail::add_arg(tl_comm_span, "cross_node_modelled", int64_t{1});
  }
}

void report_cross_node_bytes(int64_t bytes) {
  tl_reported = std::max<int64_t>(tl_reported, 0) + bytes;
}

void begin_reported_cross_node_bytes() { tl_reported = -1; }

int64_t take_reported_cross_node_bytes() {
  const int64_t r = tl_reported;
  tl_reported = -1;
  return r;
}

void set_current_comm_span(uint64_t token) { tl_comm_span = token; }

std::vector<PendingEntry> pending_snapshot() {
  std::vector<PendingEntry> out;
  {
    std::lock_guard<std::mutex> lock(pending_mu());
    const auto now = Clock::now();
    for (const auto& [work, since] : pending()) {
      if (work->finished()) continue;
      out.push_back({work->info(), std::chrono::duration<double>(now - since).count()});
    }
  }
  std::sort(out.begin(), out.end(),
            [](const PendingEntry& a, const PendingEntry& b) { return a.seconds > b.seconds; });
  return out;
}

std::string describe_pending(const PendingEntry& e) {
  std::ostringstream os;
  os << e.info.describe() << ", " << e.info.bytes << " B";
  if (e.info.unit >= 0) {
    const std::string label = trace::detail::unit_label(e.info.unit);
    os << ", issued by FSDP unit " << e.info.unit;
    if (!label.empty()) os << " '" << label << "'";
  }
  os << ", " << e.seconds << " s in flight";
  return os.str();
}

void register_pending(const PendingWork* w) {
  std::lock_guard<std::mutex> lock(pending_mu());
  pending().emplace(w, Clock::now());
}

void unregister_pending(const PendingWork* w) {
  std::lock_guard<std::mutex> lock(pending_mu());
  pending().erase(w);
}

}  // namespace detail
}  // namespace fsdp
