// TaskWork and CommThread: how async collectives make progress.
//
// MPI's blocking collectives progress only inside an MPI call, so an async
// collective needs a thread sitting in that call while the caller computes.
// Each process group owns one such thread; tasks run strictly in issue order,
// which keeps the cross-rank collective order equal to the program order.
#include "process_group.h"

namespace fsdp::detail {

TaskWork::TaskWork(std::function<void()> fn, std::string description)
    : fn_(std::move(fn)), description_(std::move(description)) {
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

WorkPtr CommThread::submit(std::function<void()> fn, std::string description, bool async_op) {
  auto work = std::make_shared<TaskWork>(std::move(fn), std::move(description));
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
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return (!queue_.empty() && !busy_) || (stop_ && queue_.empty()); });
    if (queue_.empty()) return;  // stop requested and drained
    auto work = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    work->run();
    lock.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

}  // namespace fsdp::detail
