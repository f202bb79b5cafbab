// TaskWork and CommThread: how async collectives make progress.
//
// MPI's blocking collectives progress only inside an MPI call, so an async
// collective needs a thread sitting in that call while the caller computes.
// Each process group owns one such thread; tasks run strictly in issue order,
// which keeps the cross-rank collective order equal to the program order.
#include "comm/comm_thread.h"

#include "fsdp/trace.h"
#include "comm/counters.h"
#include "comm/pending_registry.h"
#include "comm/work.h"

#include <cstdlib>

namespace fsdp::detail {
namespace {

// Span names follow the ProcessGroup methods.
std::string span_name(const std::string& op) {
  if (op == "all_gather") return "all_gather_into_tensor";
  if (op == "reduce_scatter") return "reduce_scatter_tensor";
  if (op == "all_to_all") return "all_to_all_single";
  return op;
}

// Runs `fn` inside a span on whichever thread executes it (the comm thread,
// or the caller for an inline synchronous call): op, group, bytes (when the
// issuer said), the issuer's FSDP unit and the time spent queued.
std::function<void()> traced(std::function<void()> fn, const WorkInfo& d) {
  const int64_t bytes = trace::detail::take_collective_bytes();
  const int64_t unit = trace::detail::current_unit();
  const int64_t submitted = trace::detail::now_ns();
  return [fn = std::move(fn), d, bytes, unit, submitted] {
    // By token rather than trace::Span, so the backend can add what ran
    // (count_cross_node: algorithm, cross_node_bytes) to this very span.
    struct Open {
      uint64_t token;
      explicit Open(uint64_t t) : token(t) { set_current_comm_span(t); }
      ~Open() {
        set_current_comm_span(0);
        if (token != 0) trace::detail::end(token);
      }
    } span(trace::enabled() ? trace::detail::begin(span_name(d.op), "comm") : 0);
    if (span.token != 0) {
      using trace::detail::add_arg;
      if (!d.group.empty()) add_arg(span.token, "group", d.group);
      add_arg(span.token, "seq", static_cast<int64_t>(d.seq));
      if (bytes >= 0) add_arg(span.token, "bytes", bytes);
      if (unit >= 0) add_arg(span.token, "unit", unit);
      add_arg(span.token, "queued_us", (trace::detail::now_ns() - submitted) / 1000);
    }
    fn();
  };
}

}  // namespace

TaskWork::TaskWork(std::function<void()> fn, WorkInfo info)
    : fn_(std::move(fn)), info_(std::move(info)) {
  register_pending(this);
}

TaskWork::~TaskWork() { unregister_pending(this); }

void TaskWork::run() noexcept {
  try {
    fn_();
  } catch (...) {
    error_ = std::current_exception();
  }
  fn_ = nullptr;  // drop tensor references as soon as the transfer is done
  unregister_pending(this);
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
  }
  cv_.notify_all();
}

void TaskWork::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

bool TaskWork::is_completed() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

CommThread::CommThread() : thread_([this] { loop(); }) {}

CommThread::~CommThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

WorkPtr CommThread::submit(std::function<void()> fn, WorkInfo info, bool async_op) {
  if (trace::enabled()) fn = traced(std::move(fn), info);
  auto work = std::make_shared<TaskWork>(std::move(fn), std::move(info));
  std::unique_lock<std::mutex> lock(mu_);
  if (!async_op && queue_.empty() && !busy_) {
    // Nothing ahead of us: run on the caller's thread, skipping the hand-off.
    busy_ = true;
    lock.unlock();
    work->run();
    lock.lock();
    busy_ = false;
    // Wake the comm thread only if work was queued meanwhile: a needless
    // wake-up costs a context switch that steals the core from a rank
    // spinning inside MPI.
    const bool queued = !queue_.empty();
    lock.unlock();
    if (queued) cv_.notify_all();
    work->wait();  // rethrows the task's error
    return work;
  }
  queue_.push_back(work);
  lock.unlock();
  cv_.notify_all();
  if (!async_op) work->wait();
  return work;
}

void CommThread::loop() {
  bool named = false;  // in the trace, after the group its first task names
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return (!queue_.empty() && !busy_) || (stop_ && queue_.empty()); });
    if (queue_.empty()) return;  // stop requested and drained
    auto work = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    if (!named && trace::enabled()) {
      named = true;
      const std::string& group = work->info().group;
      trace::set_thread_name("comm " + (group.empty() ? std::string("?") : group));
    }
    work->run();
    lock.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

}  // namespace fsdp::detail
