// TaskWork and CommThread: the thread that gives async collectives their
// progress, and the Work it returns (comm_thread.cpp).
#pragma once

#include "fsdp/work.h"
#include "comm/work.h"

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace fsdp::detail {

// A unit of communication executed on a CommThread; also the Work handle
// returned for it. It registers itself as pending until it completes, so a
// watchdog can name it.
class TaskWork : public Work, public PendingWork {
 public:
  TaskWork(std::function<void()> fn, WorkInfo info);
  ~TaskWork() override;
  void wait() override;
  bool is_completed() override;

  void run() noexcept;  // executes fn, records the error, signals waiters
  const WorkInfo& info() const override { return info_; }
  std::string describe() const override { return info_.describe(); }

 private:
  std::function<void()> fn_;
  WorkInfo info_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

// Executes tasks one at a time in issue order. Synchronous calls run inline on
// the caller's thread when nothing is queued (no hand-off latency); async
// calls are queued and run by the thread while the caller computes.
class CommThread {
 public:
  CommThread();
  ~CommThread();  // drains the queue, then joins
  WorkPtr submit(std::function<void()> fn, WorkInfo info, bool async_op);

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<TaskWork>> queue_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace fsdp::detail
