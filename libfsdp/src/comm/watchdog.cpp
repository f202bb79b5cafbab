// The collective watchdog: no job hangs silently.
//
// A rank that stops (a crash the launcher did not see, SIGSTOP, a deadlock
// in user code) or ranks that issue different collectives leave every other
// rank waiting inside MPI or NCCL forever. A thread per process looks at the
// pending-collective registry; once the oldest entry has been in flight for
// longer than the timeout it prints what is stuck on this rank and aborts
// the whole job, as NCCL's watchdog and c10d's timeout do. It also polls the
// transports whose errors arrive asynchronously (NCCL) and aborts on one.
// The rule: docs/architecture.md#watchdog.
#include "comm/watchdog.h"

#include "comm/comm_settings.h"
#include "comm/pending_registry.h"

#include <mpi.h>

#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fsdp::detail {
namespace {

constexpr int kExitStatus = 124;  // as timeout(1)

CommSettings g_settings;

// Fatal errors of one rank reach the others on a communicator of their own
// (a dup of the world, made where every rank starts the watchdog), so that
// no user or library message can match them.
constexpr int kFatalTag = 7041;
constexpr int kFatalMaxChars = 2048;
MPI_Comm g_fatal_comm = MPI_COMM_NULL;
std::mutex g_fatal_mu;
std::string* g_fatal_text = nullptr;  // never freed: pending sends read it

struct Watchdog {
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::thread thread;
};
Watchdog* g_watchdog = nullptr;

// The graceful stop's watch (set_stop_watch): written by a signal handler,
// so lock-free atomics; the time is CLOCK_MONOTONIC in ns (0: no signal).
std::atomic<double> g_stop_stuck_seconds{0};
std::atomic<int64_t> g_stop_signalled_ns{0};
std::atomic<int> g_stop_signal{0};

int64_t monotonic_ns() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// Seconds since the stop signal, if one arrived and the watch is on.
double seconds_since_stop_signal() {
  const int64_t at = g_stop_signalled_ns.load();
  if (at == 0 || g_stop_stuck_seconds.load() <= 0) return -1;
  return static_cast<double>(monotonic_ns() - at) / 1e9;
}

struct AsyncErrorSources {
  std::mutex mu;
  std::vector<std::weak_ptr<AsyncErrorSource>> list;
};
AsyncErrorSources& async_error_sources() {
  static AsyncErrorSources s;
  return s;
}

std::vector<std::shared_ptr<AsyncErrorSource>> live_sources() {
  auto& s = async_error_sources();
  std::lock_guard<std::mutex> lock(s.mu);
  std::vector<std::shared_ptr<AsyncErrorSource>> out;
  for (auto& w : s.list) {
    if (auto p = w.lock()) out.push_back(std::move(p));
  }
  return out;
}

// Before the job goes: no NCCL kernel of this process keeps spinning on a
// peer that will never answer, and the GPU is released promptly.
void abort_async_sources() noexcept {
  for (auto& source : live_sources()) source->abort();
}

[[noreturn]] void abort_job() {
  // The other ranks stuck in the same collective time out within a poll
  // period of this one: give them a moment to print theirs first.
  std::this_thread::sleep_for(std::chrono::seconds(2));
  MPI_Abort(MPI_COMM_WORLD, kExitStatus);
  std::_Exit(kExitStatus);  // MPI_Abort does not return; in case it does
}

// Prints `headline` and what this rank still has pending, then ends the job.
[[noreturn]] void print_pending_and_abort(const std::string& headline, int rank) {
  std::ostringstream os;
  os << headline;
  for (const PendingEntry& e : pending_snapshot()) {
    os << "\n[libfsdp watchdog] rank " << rank << ": pending: " << describe_pending(e);
  }
  os << "\n[libfsdp watchdog] rank " << rank << ": aborting the job (MPI_Abort, exit status "
     << kExitStatus << ")\n";
  const std::string text = os.str();
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
  abort_async_sources();
  abort_job();
}

[[noreturn]] void report_async_error_and_abort(const std::string& error, int rank, int size) {
  std::ostringstream os;
  os << "[libfsdp watchdog] rank " << rank << " of " << size << ": " << error
     << " (asynchronous transport error: a peer failed or the network is down)";
  print_pending_and_abort(os.str(), rank);
}

// Prints `headline` (about pending.front()), the rest of `pending`, and ends
// the job.
[[noreturn]] void report_pending_and_abort(const std::string& headline,
                                           const std::vector<PendingEntry>& pending, int rank) {
  std::ostringstream os;
  os << headline;
  for (size_t i = 1; i < pending.size(); ++i) {
    os << "\n[libfsdp watchdog] rank " << rank << ": also pending: "
       << describe_pending(pending[i]);
  }
  os << "\n[libfsdp watchdog] rank " << rank << ": aborting the job (MPI_Abort, exit status "
     << kExitStatus << ")\n";
  const std::string text = os.str();
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
  abort_async_sources();
  abort_job();
}

[[noreturn]] void report_and_abort(const std::vector<PendingEntry>& pending, int rank, int size,
                                   double timeout) {
  std::ostringstream os;
  os << "[libfsdp watchdog] rank " << rank << " of " << size << ": "
     << describe_pending(pending.front()) << ": not complete after " << timeout
     << " s (FSDP_TIMEOUT); the other ranks of that group did not issue it, or issued another "
        "collective, or stopped";
  report_pending_and_abort(os.str(), pending, rank);
}

[[noreturn]] void report_stuck_after_stop_and_abort(const std::vector<PendingEntry>& pending,
                                                    int rank, int size, double since_signal) {
  const int sig = g_stop_signal.load();
  const char* name = sig > 0 ? strsignal(sig) : nullptr;
  std::ostringstream os;
  os << "[libfsdp watchdog] rank " << rank << " of " << size << ": stop requested by signal "
     << sig << " (" << (name != nullptr ? name : "?") << ") " << since_signal
     << " s ago, but " << describe_pending(pending.front())
     << ": cannot finish: a peer exited or is stuck and will not reach the stop (GracefulStop's "
        "stuck_seconds "
     << g_stop_stuck_seconds.load() << " s)";
  report_pending_and_abort(os.str(), pending, rank);
}

// Another rank announced a fatal error (announce_fatal_error): its text, or
// empty. Called by the watchdog thread only.
std::string poll_fatal_error(int* from) {
  if (g_fatal_comm == MPI_COMM_NULL) return {};
  int flag = 0;
  MPI_Status status;
  MPI_Iprobe(MPI_ANY_SOURCE, kFatalTag, g_fatal_comm, &flag, &status);
  if (flag == 0) return {};
  int count = 0;
  MPI_Get_count(&status, MPI_CHAR, &count);
  std::string text(static_cast<size_t>(std::max(count, 0)), '\0');
  MPI_Recv(text.data(), count, MPI_CHAR, status.MPI_SOURCE, kFatalTag, g_fatal_comm,
           MPI_STATUS_IGNORE);
  *from = status.MPI_SOURCE;
  return text.empty() ? std::string("(no message)") : text;
}

[[noreturn]] void report_fatal_error_and_abort(const std::string& error, int from, int rank,
                                               int size) {
  std::ostringstream os;
  os << "[libfsdp watchdog] rank " << rank << " of " << size << ": rank " << from
     << " failed: " << error;
  print_pending_and_abort(os.str(), rank);
}

}  // namespace

void announce_fatal_error(const std::string& text) {
  std::lock_guard<std::mutex> lock(g_fatal_mu);
  if (g_fatal_text != nullptr) return;
  g_fatal_text = new std::string(text.substr(0, kFatalMaxChars));
  if (g_fatal_comm == MPI_COMM_NULL) return;
  int rank = 0, size = 0;
  MPI_Comm_rank(g_fatal_comm, &rank);
  MPI_Comm_size(g_fatal_comm, &size);
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    // Non-blocking, never waited for: the peers receive it whenever their
    // watchdog polls (or never, if the job ends first); the text outlives it.
    MPI_Request request = MPI_REQUEST_NULL;
    MPI_Isend(g_fatal_text->data(), static_cast<int>(g_fatal_text->size()), MPI_CHAR, r,
              kFatalTag, g_fatal_comm, &request);
    MPI_Request_free(&request);
  }
}

bool fatal_error_announced() {
  std::lock_guard<std::mutex> lock(g_fatal_mu);
  return g_fatal_text != nullptr;
}

void abort_after_fatal_error(int world_rank) {
  std::string text;
  {
    std::lock_guard<std::mutex> lock(g_fatal_mu);
    if (g_fatal_text != nullptr) text = *g_fatal_text;
  }
  std::ostringstream os;
  os << "[libfsdp] rank " << world_rank << ": the Runtime ends after " << text
     << "\n[libfsdp] rank " << world_rank
     << ": the other ranks cannot finish: aborting the job (MPI_Abort, exit status "
     << kExitStatus << ")\n";
  const std::string out = os.str();
  std::fwrite(out.data(), 1, out.size(), stderr);
  std::fflush(stderr);
  abort_async_sources();
  abort_job();
}

void register_async_error_source(const std::shared_ptr<AsyncErrorSource>& source) {
  auto& s = async_error_sources();
  std::lock_guard<std::mutex> lock(s.mu);
  s.list.erase(std::remove_if(s.list.begin(), s.list.end(),
                              [](const std::weak_ptr<AsyncErrorSource>& w) { return w.expired(); }),
               s.list.end());
  s.list.push_back(source);
}

void unregister_async_error_source(const AsyncErrorSource* source) {
  auto& s = async_error_sources();
  std::lock_guard<std::mutex> lock(s.mu);
  s.list.erase(std::remove_if(s.list.begin(), s.list.end(),
                              [source](const std::weak_ptr<AsyncErrorSource>& w) {
                                auto p = w.lock();
                                return !p || p.get() == source;
                              }),
               s.list.end());
}

void configure_comm(const CommSettings& settings) { g_settings = settings; }

const CommSettings& comm_settings() { return g_settings; }

void start_watchdog(int world_rank, int world_size) {
  // Every rank gets here (the Runtime's constructor), whatever its timeout
  // (FSDP_TIMEOUT is not compared across ranks), so the dup is collective as
  // it must be. Kept for the process: a later Runtime reuses it.
  if (g_fatal_comm == MPI_COMM_NULL) MPI_Comm_dup(MPI_COMM_WORLD, &g_fatal_comm);
  if (g_watchdog != nullptr || g_settings.timeout_seconds <= 0) return;
  const double timeout = g_settings.timeout_seconds;
  // A tenth of the timeout, between 50 ms and 1 s: aborts within about
  // timeout + 1 s + the 2 s grace, and costs nothing measurable.
  const auto period = std::chrono::duration<double>(std::min(1.0, std::max(0.05, timeout / 10)));
  g_watchdog = new Watchdog;
  g_watchdog->thread = std::thread([w = g_watchdog, timeout, period, world_rank, world_size] {
    std::unique_lock<std::mutex> lock(w->mu);
    while (!w->cv.wait_for(lock, period, [w] { return w->stop; })) {
      const std::vector<PendingEntry> pending = pending_snapshot();
      if (!pending.empty() && pending.front().seconds > timeout) {
        report_and_abort(pending, world_rank, world_size, timeout);
      }
      if (const double since = seconds_since_stop_signal(); since >= 0 && !pending.empty()) {
        const double stuck = g_stop_stuck_seconds.load();
        if (since > stuck && pending.front().seconds > stuck) {
          report_stuck_after_stop_and_abort(pending, world_rank, world_size, since);
        }
      }
      for (auto& source : live_sources()) {
        const std::string error = source->async_error();
        if (!error.empty()) report_async_error_and_abort(error, world_rank, world_size);
      }
      int from = -1;
      const std::string fatal = poll_fatal_error(&from);
      if (!fatal.empty()) report_fatal_error_and_abort(fatal, from, world_rank, world_size);
    }
  });
}

void set_stop_watch(double stuck_seconds) { g_stop_stuck_seconds.store(stuck_seconds); }

void note_stop_signal(int signal) noexcept {
  int64_t none = 0;
  if (g_stop_signalled_ns.compare_exchange_strong(none, monotonic_ns())) g_stop_signal.store(signal);
}

void clear_stop_signal() noexcept {
  g_stop_signalled_ns.store(0);
  g_stop_signal.store(0);
}

void stop_watchdog() {
  if (g_watchdog == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(g_watchdog->mu);
    g_watchdog->stop = true;
  }
  g_watchdog->cv.notify_all();
  g_watchdog->thread.join();
  delete g_watchdog;
  g_watchdog = nullptr;
}

}  // namespace fsdp::detail
