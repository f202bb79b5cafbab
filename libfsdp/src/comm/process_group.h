// Internal: the ProcessGroup implementation, its transport backends and the
// communication thread that gives async collectives their progress.
#pragma once

#include "fsdp/comm.h"

#include <mpi.h>

#include <c10/core/Device.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fsdp::detail {

class CollectiveCheck;

// What one issued collective or point-to-point is: the fields counters,
// traces and watchdogs read (never parsed back out of a text).
struct WorkInfo {
  std::string op;       // "all_gather", "reduce_scatter", "all_reduce", "send", ...
  std::string group;    // the group's name, "ranks[0,1]"
  uint64_t seq = 0;     // issue number on this group and backend, from 1
  int64_t bytes = 0;    // payload bytes (the input's; the tensor's for in-place ops)
  std::string backend;  // "mpi" or "nccl"
  std::string label;    // the caller's words for it (P2POp::label), may be empty
  int64_t unit = -1;    // the FSDP unit whose hook issued it (trace ids), -1: none
  // "all_gather on ranks[0,1] #12 (mpi)", "send on ranks[0,1] #3 (mpi) [pp ...]"
  std::string describe() const {
    return op + " on " + group + " #" + std::to_string(seq) + " (" + backend + ")" +
           (label.empty() ? "" : " [" + label + "]");
  }
};

// An issued collective as the pending-collective registry sees it (see
// register_pending).
class PendingWork {
 public:
  virtual ~PendingWork() = default;
  virtual const WorkInfo& info() const = 0;
  // Work that completes unseen by the host (on a device stream, or an MPI
  // request nobody has tested yet) stays registered for its handle's
  // lifetime; the registry lists it only while this is false. Called with the
  // registry's lock held: must not block or unregister.
  virtual bool finished() const { return false; }
};

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

// Element counts per peer for all_to_all.
struct SplitCounts {
  std::vector<int64_t> send_counts, send_displs, recv_counts, recv_displs;
};

// One transport (MPI or NCCL) for one group. Arguments arrive validated.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual WorkPtr all_gather(at::Tensor out, at::Tensor in, bool async_op) = 0;
  virtual WorkPtr reduce_scatter(at::Tensor out, at::Tensor in, ReduceOp op, bool async_op) = 0;
  virtual WorkPtr all_reduce(at::Tensor t, ReduceOp op, bool async_op) = 0;
  virtual WorkPtr broadcast(at::Tensor t, int root, bool async_op) = 0;
  virtual WorkPtr all_to_all(at::Tensor out, at::Tensor in, SplitCounts counts, bool async_op) = 0;
  virtual WorkPtr send(at::Tensor t, int dst, int tag, bool async_op) = 0;
  virtual WorkPtr recv(at::Tensor t, int src, int tag, bool async_op) = 0;
  // ops arrive validated and ordered (receives first, then sends, each by
  // peer); returns their Works in that order.
  virtual std::vector<WorkPtr> batch_p2p(const std::vector<P2POp>& ops) = 0;
  virtual void barrier() = 0;
  // See ProcessGroup::empty_for_collectives; plain at::empty by default.
  virtual at::Tensor empty_for_collectives(at::IntArrayRef sizes,
                                           const at::TensorOptions& options);
};

// MPI transport for CPU tensors over `comm` (owned: freed on destruction).
// poll: collectives wait by testing a nonblocking request with short sleeps
// rather than inside a blocking call (which spins on a core).
// check: FSDP_DEBUG=detail's, else null (not owned).
std::unique_ptr<Backend> make_mpi_backend(MPI_Comm comm, std::string group_name, bool poll,
                                          CollectiveCheck* check);
// NCCL transport for CUDA tensors on `device`, bootstrapped over `bootstrap`
// (not owned). eager: the group's communicator is created now, which is
// collective over the group (ProcessGroupImpl's constructor, itself
// collective, passes true when the Runtime's device is CUDA: c10d's eager
// init); else by the first collective. A pair's communicator (send/recv in a
// group of more than 2) comes with that pair's first send/recv.
// Defined only when built with FSDP_WITH_NCCL.
std::unique_ptr<Backend> make_nccl_backend(MPI_Comm bootstrap, c10::Device device,
                                           std::string group_name, CollectiveCheck* check,
                                           bool eager);

class ProcessGroupImpl final : public ProcessGroup {
 public:
  // poll: see make_mpi_backend.
  ProcessGroupImpl(MPI_Comm comm, std::vector<int> world_ranks, std::string name,
                   bool poll = false);
  ~ProcessGroupImpl() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::vector<int>& world_ranks() const override { return world_ranks_; }
  const std::string& name() const override { return name_; }

  WorkPtr all_gather_into_tensor(at::Tensor output, const at::Tensor& input,
                                 bool async_op) override;
  WorkPtr reduce_scatter_tensor(at::Tensor output, const at::Tensor& input, ReduceOp op,
                                bool async_op) override;
  WorkPtr all_reduce(at::Tensor tensor, ReduceOp op, bool async_op) override;
  WorkPtr broadcast(at::Tensor tensor, int root, bool async_op) override;
  WorkPtr all_to_all_single(at::Tensor output, const at::Tensor& input,
                            const std::vector<int64_t>& output_split_sizes,
                            const std::vector<int64_t>& input_split_sizes,
                            bool async_op) override;
  WorkPtr send(const at::Tensor& tensor, int dst, int tag, bool async_op) override;
  WorkPtr recv(at::Tensor tensor, int src, int tag, bool async_op) override;
  std::vector<WorkPtr> batch_isend_irecv(std::vector<P2POp> ops) override;
  void barrier() override;
  at::Tensor empty_for_collectives(at::IntArrayRef sizes,
                                   const at::TensorOptions& options) override;

  // Frees the backends and the communicator; later calls throw StateError.
  void shutdown();
  // A new communicator over the same ranks (collective over the group).
  MPI_Comm duplicate_communicator();

 private:
  Backend& backend_for(const at::Tensor& t, const char* argument);
  int rank_ = 0;
  int size_ = 1;
  std::vector<int> world_ranks_;
  std::string name_;
  MPI_Comm bootstrap_ = MPI_COMM_NULL;  // owned; used by the NCCL bootstrap
  std::mutex backends_mu_;
  // FSDP_DEBUG=detail: one check per backend (each orders its collectives
  // on its own), created with the group so no later call communicates.
  std::unique_ptr<CollectiveCheck> mpi_check_;
  std::unique_ptr<CollectiveCheck> nccl_check_;
  std::unique_ptr<Backend> mpi_;
  std::unique_ptr<Backend> nccl_;
  bool closed_ = false;
};

// ---- pending-collective registry (diagnostics, watchdog) ----
void register_pending(const PendingWork* w);
void unregister_pending(const PendingWork* w);
struct PendingEntry {
  WorkInfo info;
  double seconds = 0;  // since it was issued
};
// The unfinished ones, longest in flight first.
std::vector<PendingEntry> pending_snapshot();
// "all_gather on ranks[0,1] #12 (mpi), 4096 B, issued by FSDP unit 3 'layers.0', 3.2 s in flight"
std::string describe_pending(const PendingEntry& e);

// ---- watchdog and desync checks (watchdog.cpp, collective_check.cpp) ----
struct CommSettings {
  double timeout_seconds = 600;    // 0: no watchdog
  bool check_collectives = false;  // FSDP_DEBUG=detail
  // The Runtime's device: groups built while it is CUDA create their NCCL
  // communicator at once (make_nccl_backend, eager).
  c10::Device device{c10::kCPU};
  // More ranks on this node than it has online CPUs: shared-memory waits
  // yield the core at once instead of spinning first.
  bool node_oversubscribed = false;
};
// Set by the Runtime before any group exists; read by groups and the watchdog.
void configure_comm(const CommSettings& settings);
const CommSettings& comm_settings();
// A thread that aborts the job (MPI_Abort, exit status 124) when a pending
// collective outlives timeout_seconds, after printing it on this rank.
void start_watchdog(int world_rank, int world_size);
void stop_watchdog();

// A transport whose failures surface asynchronously (NCCL: a dead peer or
// network leaves kernels spinning and the host blocked, with the error only
// in ncclCommGetAsyncError). The watchdog polls every registered source each
// period; an error is printed and aborts the job as a timeout does, and on
// either the watchdog first aborts every source's communicators so that no
// kernel keeps spinning. Both calls must be thread-safe and must not block.
class AsyncErrorSource {
 public:
  virtual ~AsyncErrorSource() = default;
  // Empty when healthy, else what failed ("NCCL communicator of ranks[0,1]: ...").
  virtual std::string async_error() = 0;
  virtual void abort() noexcept = 0;
};
void register_async_error_source(const std::shared_ptr<AsyncErrorSource>& source);
void unregister_async_error_source(const AsyncErrorSource* source);

// FSDP_DEBUG=detail: before each collective every rank of the group gathers
// every rank's fingerprint of it over a communicator of its own and throws
// CommError naming the first rank whose call differs from rank 0's. One per
// backend of a group, called in that backend's issue order (MPI: on its comm
// thread; NCCL: at issue), so the exchanges pair up as the collectives would.
class CollectiveCheck {
 public:
  // Takes ownership of comm; world_ranks: the group's, for messages.
  CollectiveCheck(MPI_Comm comm, std::vector<int> world_ranks);
  ~CollectiveCheck();
  // op: WorkInfo::op; count: elements per rank (-1: may differ by rank, as
  // all_to_all's); extra: the root or the ReduceOp (-1: none).
  void verify(const WorkInfo& info, int dtype, int64_t count, int64_t extra);

 private:
  MPI_Comm comm_;
  std::vector<int> world_ranks_;
  int rank_ = 0;
  int64_t issued_ = 0;  // collectives verified so far
};

// An all-gather in place: input is output's block for `rank` (the one
// overlap all_gather_into_tensor accepts; backends then skip that block's copy).
bool is_own_gather_block(const at::Tensor& output, const at::Tensor& input, int rank);

// ---- counters ----
void count_collective(const std::string& op, const std::string& group, int64_t bytes);

// ---- MPI helpers (mpi_types.cpp) ----
// Throws CommError with the MPI error string if rc != MPI_SUCCESS.
void check_mpi(int rc, const char* what);
// MPI datatype for a tensor dtype; DTypeError naming `argument` if unsupported.
MPI_Datatype mpi_datatype(c10::ScalarType t, const char* argument);
// MPI op for a reduction on a dtype (AVG maps to SUM; the caller divides).
MPI_Op mpi_op(ReduceOp op, c10::ScalarType t);
// Creates/frees the custom 16-bit datatypes and ops (Runtime start/end).
void init_mpi_types();
void free_mpi_types();

// ---- group registry (group_registry.cpp) ----
// The library's private duplicate of MPI_COMM_WORLD.
MPI_Comm library_world();
// Collective over the world: every rank passes the member list of its own
// group; together the lists partition the world. Cached by member list; the
// group's name is its member list, e.g. "ranks[0,2]".
ProcessGroupPtr group_for(const std::vector<int>& members);
// A group created before (the world group exists from Runtime start); never
// communicates. StateError if absent.
ProcessGroupPtr find_group(const std::vector<int>& members);
// fully_shard's reductions run on a second group over the same ranks, with
// its own communicator and comm thread: reduce-scatters and all-reduces are
// then ordered among themselves (reverse forward order, the same on every
// rank) independently of the all-gathers, whose order follows the forward
// and the pre-backward hooks -- however the gradients of a rank arrive. It
// also lets a reduction run while the next all-gather does. Same name as
// `group` (counters and traces report them together). Cached; the first call
// is collective over the group's members.
ProcessGroupPtr reduction_group_for(const ProcessGroupPtr& group);
void init_group_registry();
void shutdown_group_registry();

}  // namespace fsdp::detail
