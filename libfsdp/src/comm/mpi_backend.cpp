// MPI transport for CPU tensors: collectives executed on the group's
// CommThread (see comm_thread.cpp), so async_op calls overlap compute. The
// all-gather, reduce-scatter and all-reduce run Open MPI's collective or one
// of libfsdp's algorithms over point-to-point (cpu_collectives.h), chosen at
// issue by cpu::choose.
#include "comm/mpi_backend.h"

#include "fsdp/errors.h"
#include "fsdp/trace.h"
#include "comm/collective_check.h"
#include "comm/comm_thread.h"
#include "comm/counters.h"
#include "comm/cpu_collectives.h"
#include "comm/cpu_reduce.h"
#include "comm/mpi_types.h"
#include "comm/pending_registry.h"
#include "comm/topology.h"
#include "comm/work.h"

#include <algorithm>
#include <climits>
#include <mutex>
#include <string>

namespace fsdp::detail {
namespace {

int to_int(int64_t n, const char* what) {
  if (n > INT_MAX) {
    throw ShapeError(what, std::string("'") + what + "' has " + std::to_string(n) +
                               " elements; the MPI backend accepts at most " +
                               std::to_string(INT_MAX) + " per call");
  }
  return static_cast<int>(n);
}

std::vector<int> to_ints(const std::vector<int64_t>& v, const char* what) {
  std::vector<int> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = to_int(v[i], what);
  return out;
}

// Waits for a nonblocking collective without keeping a core busy.
void wait_polling(MPI_Request& r, const char* what) { cpu::wait_requests(&r, 1, true, what); }

// A started MPI point-to-point request; keeps its tensor alive until done.
class RequestWork final : public Work, public PendingWork {
 public:
  RequestWork(MPI_Request request, at::Tensor tensor, WorkInfo info)
      : request_(request), tensor_(std::move(tensor)), info_(std::move(info)),
        description_(info_.describe()) {
    register_pending(this);
  }
  ~RequestWork() override {
    // A handle dropped before completion still owns an in-flight transfer.
    if (!done_) MPI_Wait(&request_, MPI_STATUS_IGNORE);
    unregister_pending(this);
  }
  void wait() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) rc_ = MPI_Wait(&request_, MPI_STATUS_IGNORE);
    complete();
    check_mpi(rc_, description_.c_str());
  }
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_ || test_locked()) complete();
    return done_;
  }
  // The watchdog's view: a transfer done but not yet waited for is not
  // stuck. Skips the test while another thread holds the request.
  bool finished() const override {
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    if (!done_ && test_locked()) {
      done_ = true;  // unregistered by complete() or the destructor, not here
    }
    return done_;
  }
  const WorkInfo& info() const override { return info_; }
  std::string describe() const override { return description_; }

 private:
  // One MPI_Test; true when the request finished (its error, if any, is
  // kept for wait() to throw).
  bool test_locked() const {
    int flag = 0;
    const int rc = MPI_Test(&request_, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) rc_ = rc;
    return rc != MPI_SUCCESS || flag != 0;
  }
  void complete() {
    done_ = true;
    tensor_ = at::Tensor();
    unregister_pending(this);
  }
  mutable std::mutex mu_;
  mutable MPI_Request request_;
  at::Tensor tensor_;
  WorkInfo info_;
  std::string description_;  // for MPI error messages
  mutable bool done_ = false;
  mutable int rc_ = MPI_SUCCESS;
};

class MpiBackend final : public Backend {
 public:
  MpiBackend(MPI_Comm comm, std::string group_name, bool poll, CollectiveCheck* check)
      : comm_(comm), group_name_(std::move(group_name)), poll_(poll), check_(check) {
    check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    check_mpi(MPI_Comm_rank(comm_, &peers_.rank), "MPI_Comm_rank");
    check_mpi(MPI_Comm_dup(comm_, &peers_.comm), "MPI_Comm_dup");
    peers_.size = size_;
    peers_.poll = poll_;
    // Collective, as this constructor is (group creation). Without an arena
    // (ranks on several nodes, no usable /dev/shm) shm runs as pairwise.
    std::string why;
    arena_ = cpu::SharedArena::create(comm_, &why);
    peers_.arena = arena_.get();
    cross_.nodes = nodes_of_comm(comm_);
    cross_.rank = peers_.rank;
    // Collective too: the node and rail communicators of a group spanning
    // nodes evenly (null elsewhere, where two_level runs as pairwise).
    two_level_ = cpu::TwoLevel::create(comm_, poll_);
    peers_.two_level = two_level_.get();
  }
  ~MpiBackend() override {
    thread_.reset();  // drain and join before the communicators go
    two_level_.reset();
    arena_.reset();
    MPI_Comm_free(&peers_.comm);
    MPI_Comm_free(&comm_);
  }

  WorkPtr all_gather(at::Tensor out, at::Tensor in, bool async_op) override {
    const MPI_Datatype dt = mpi_datatype(in.scalar_type(), "input");
    const int count = to_int(in.numel(), "input");
    const cpu::Choice choice = cpu::choose(cpu::Collective::AllGather, in.scalar_type(),
                                           static_cast<int64_t>(in.nbytes()), size_,
                                           arena_ != nullptr, two_level_ != nullptr);
    return submit("all_gather", in, count, -1, async_op, [this, out, in, dt, count, choice] {
      begin_reported_cross_node_bytes();
      if (choice.shared != choice.plain && cpu::all_gather_if_shared(peers_, out, in)) {
        account("all_gather", choice.shared, 0);
        return;
      }
      const CpuAlgorithm algorithm = choice.plain;
      const int64_t es = static_cast<int64_t>(in.element_size());
      const int64_t model =
          runs_two_level(algorithm)
              ? cpu::two_level_cross_node_bytes(*two_level_, cpu::Collective::AllGather,
                                                in.scalar_type(), in.numel())
          : algorithm == CpuAlgorithm::Ring ? cross_.ring_all_gather(in.numel(), es)
          : algorithm == CpuAlgorithm::Shm  ? 0
                                            : cross_.pairwise_all_gather(in.numel(), es);
      if (algorithm != CpuAlgorithm::Mpi) {
        cpu::all_gather(peers_, algorithm, out, in);
        account("all_gather", algorithm, model);  // after: the algorithm may report its bytes
        return;
      }
      account("all_gather", algorithm, model);
      // MPI forbids a send buffer inside the receive buffer: in place is
      // MPI_IN_PLACE (ProcessGroupImpl let only this rank's block through).
      const void* send = is_own_gather_block(out, in, peers_.rank) ? MPI_IN_PLACE : in.data_ptr();
      if (!poll_) {
        check_mpi(MPI_Allgather(send, count, dt, out.data_ptr(), count, dt, comm_),
                  "MPI_Allgather");
        return;
      }
      MPI_Request r = MPI_REQUEST_NULL;
      check_mpi(MPI_Iallgather(send, count, dt, out.data_ptr(), count, dt, comm_, &r),
                "MPI_Iallgather");
      wait_polling(r, "MPI_Iallgather");
    });
  }

  WorkPtr reduce_scatter(at::Tensor out, at::Tensor in, ReduceOp op, bool async_op) override {
    const MPI_Datatype dt = mpi_datatype(in.scalar_type(), "input");
    const MPI_Op mop = mpi_op(op, in.scalar_type());
    const int count = to_int(out.numel(), "output");
    const cpu::Choice choice = cpu::choose(cpu::Collective::ReduceScatter, in.scalar_type(),
                                           static_cast<int64_t>(out.nbytes()), size_,
                                           arena_ != nullptr, two_level_ != nullptr);
    return submit("reduce_scatter", in, count, static_cast<int64_t>(op), async_op,
                  [this, out, in, dt, mop, count, op, choice] {
      begin_reported_cross_node_bytes();
      if (choice.shared != choice.plain && cpu::reduce_scatter_if_shared(peers_, out, in, op)) {
        account("reduce_scatter", choice.shared, 0);
        return;  // AVG divided inside
      }
      const CpuAlgorithm algorithm = choice.plain;
      const int64_t es = static_cast<int64_t>(in.element_size());
      const int64_t model =
          runs_two_level(algorithm)
              ? cpu::two_level_cross_node_bytes(*two_level_, cpu::Collective::ReduceScatter,
                                                in.scalar_type(), out.numel())
          : algorithm == CpuAlgorithm::Ring
              ? cross_.ring_reduce_scatter(out.numel(), acc_size(in.scalar_type()))
          : algorithm == CpuAlgorithm::Shm ? 0
                                           : cross_.pairwise_reduce_scatter(out.numel(), es);
      if (algorithm != CpuAlgorithm::Mpi) {
        cpu::reduce_scatter(peers_, algorithm, out, in, op);  // AVG divides inside
        account("reduce_scatter", algorithm, model);
        return;
      }
      account("reduce_scatter", algorithm, model);
      if (poll_) {
        MPI_Request r = MPI_REQUEST_NULL;
        check_mpi(MPI_Ireduce_scatter_block(in.data_ptr(), out.data_ptr(), count, dt, mop, comm_,
                                            &r),
                  "MPI_Ireduce_scatter_block");
        wait_polling(r, "MPI_Ireduce_scatter_block");
      } else {
        check_mpi(MPI_Reduce_scatter_block(in.data_ptr(), out.data_ptr(), count, dt, mop, comm_),
                  "MPI_Reduce_scatter_block");
      }
      if (op == ReduceOp::AVG) out.div_(size_);
    });
  }

  WorkPtr all_reduce(at::Tensor t, ReduceOp op, bool async_op) override {
    const MPI_Datatype dt = mpi_datatype(t.scalar_type(), "tensor");
    const MPI_Op mop = mpi_op(op, t.scalar_type());
    const int count = to_int(t.numel(), "tensor");
    // Never the shared choice: all-reduce stages its operand wherever it lives.
    const CpuAlgorithm algorithm =
        cpu::choose(cpu::Collective::AllReduce, t.scalar_type(),
                    static_cast<int64_t>(t.nbytes()) / size_, size_, arena_ != nullptr,
                    two_level_ != nullptr)
            .plain;
    return submit("all_reduce", t, count, static_cast<int64_t>(op), async_op,
                  [this, t, dt, mop, count, op, algorithm] {
      begin_reported_cross_node_bytes();
      const int64_t es = static_cast<int64_t>(t.element_size());
      const int64_t model =
          runs_two_level(algorithm)
              ? cpu::two_level_cross_node_bytes(*two_level_, cpu::Collective::AllReduce,
                                                t.scalar_type(), t.numel())
          : algorithm == CpuAlgorithm::Ring
              ? cross_.ring_all_reduce(t.numel(), es, acc_size(t.scalar_type()))
          : algorithm == CpuAlgorithm::Shm ? 0
                                           : cross_.pairwise_all_reduce(t.numel(), es);
      if (algorithm != CpuAlgorithm::Mpi) {
        cpu::all_reduce(peers_, algorithm, t, op);  // AVG divides inside
        account("all_reduce", algorithm, model);
        return;
      }
      account("all_reduce", algorithm, model);
      if (poll_) {
        MPI_Request r = MPI_REQUEST_NULL;
        check_mpi(MPI_Iallreduce(MPI_IN_PLACE, t.data_ptr(), count, dt, mop, comm_, &r),
                  "MPI_Iallreduce");
        wait_polling(r, "MPI_Iallreduce");
      } else {
        check_mpi(MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), count, dt, mop, comm_),
                  "MPI_Allreduce");
      }
      if (op == ReduceOp::AVG) t.div_(size_);
    });
  }

  WorkPtr broadcast(at::Tensor t, int root, bool async_op) override {
    const MPI_Datatype dt = mpi_datatype(t.scalar_type(), "tensor");
    const int count = to_int(t.numel(), "tensor");
    return submit("broadcast", t, count, root, async_op, [this, t, dt, count, root] {
      // Open MPI's tree is not visible: modelled as a flat broadcast, the
      // root sending to every remote rank (an upper bound: a tree that
      // forwards inside a node crosses less).
      std::vector<int64_t> to(static_cast<size_t>(size_), 0);
      if (peers_.rank == root) to.assign(to.size(), static_cast<int64_t>(t.nbytes()));
      count_cross_node("broadcast", group_name_, "mpi", cross_.to_peers(to), true);
      check_mpi(MPI_Bcast(t.data_ptr(), count, dt, root, comm_), "MPI_Bcast");
    });
  }

  WorkPtr all_to_all(at::Tensor out, at::Tensor in, SplitCounts c, bool async_op) override {
    const MPI_Datatype dt = mpi_datatype(in.scalar_type(), "input");
    auto sc = std::make_shared<std::vector<int>>(to_ints(c.send_counts, "input_split_sizes"));
    auto sd = std::make_shared<std::vector<int>>(to_ints(c.send_displs, "input"));
    auto rc = std::make_shared<std::vector<int>>(to_ints(c.recv_counts, "output_split_sizes"));
    auto rd = std::make_shared<std::vector<int>>(to_ints(c.recv_displs, "output"));
    // Split sizes may differ by rank: the check compares op and dtype only.
    return submit("all_to_all", in, -1, -1, async_op, [this, out, in, dt, sc, sd, rc, rd] {
      std::vector<int64_t> to(sc->size());
      const auto es = static_cast<int64_t>(in.element_size());
      for (size_t r = 0; r < to.size(); ++r) to[r] = (*sc)[r] * es;
      count_cross_node("all_to_all", group_name_, "p2p", cross_.to_peers(to), false);
      check_mpi(MPI_Alltoallv(in.data_ptr(), sc->data(), sd->data(), dt, out.data_ptr(),
                              rc->data(), rd->data(), dt, comm_),
                "MPI_Alltoallv");
    });
  }

  // Point-to-point starts at once (MPI_Isend/MPI_Irecv) instead of queueing
  // behind the comm thread: queued blocking sends would deadlock a pairwise
  // exchange where both sides send first. MPI matches collectives and
  // point-to-point messages separately, so skipping the queue is safe.
  WorkPtr send(at::Tensor t, int dst, int tag, bool async_op) override {
    const MPI_Datatype dt = mpi_datatype(t.scalar_type(), "tensor");
    const int count = to_int(t.numel(), "tensor");
    MPI_Request request = MPI_REQUEST_NULL;
    check_mpi(MPI_Isend(t.data_ptr(), count, dt, dst, tag, comm_, &request), "MPI_Isend");
    count_p2p(true, t, dst);
    return finish_p2p("send", request, t, async_op);
  }

  WorkPtr recv(at::Tensor t, int src, int tag, bool async_op) override {
    const MPI_Datatype dt = mpi_datatype(t.scalar_type(), "tensor");
    const int count = to_int(t.numel(), "tensor");
    MPI_Request request = MPI_REQUEST_NULL;
    check_mpi(MPI_Irecv(t.data_ptr(), count, dt, src, tag, comm_, &request), "MPI_Irecv");
    count_p2p(false, t, src);
    return finish_p2p("recv", request, t, async_op);
  }

  std::vector<WorkPtr> batch_p2p(const std::vector<P2POp>& ops) override {
    std::vector<WorkPtr> works;
    works.reserve(ops.size());
    for (const P2POp& op : ops) {
      const at::Tensor& t = op.tensor;
      const MPI_Datatype dt = mpi_datatype(t.scalar_type(), "tensor");
      const int count = to_int(t.numel(), "tensor");
      MPI_Request request = MPI_REQUEST_NULL;
      const bool send = op.kind == P2POp::Kind::Send;
      if (send) {
        check_mpi(MPI_Isend(t.data_ptr(), count, dt, op.peer, op.tag, comm_, &request),
                  "MPI_Isend");
      } else {
        check_mpi(MPI_Irecv(t.data_ptr(), count, dt, op.peer, op.tag, comm_, &request),
                  "MPI_Irecv");
      }
      count_p2p(send, t, op.peer);
      WorkInfo info = describe(send ? "send" : "recv", t);
      info.label = op.label;
      works.push_back(std::make_shared<RequestWork>(request, t, std::move(info)));
    }
    return works;
  }

  at::Tensor empty_for_collectives(at::IntArrayRef sizes,
                                   const at::TensorOptions& options) override {
    return cpu::empty_in_arena(arena_, sizes, options);
  }

  void barrier() override {
    submit("barrier", at::Tensor(), 0, -1, false, [this] {
      count_cross_node("barrier", group_name_, "mpi", 0, false);
      check_mpi(MPI_Barrier(comm_), "MPI_Barrier");
    });
  }

  bool has_shared_memory() const override { return arena_ != nullptr; }
  int64_t shared_memory_committed() const override {
    return arena_ != nullptr ? arena_->committed_bytes() : 0;
  }

 private:
  // Records what ran (count_cross_node): the cross-node bytes the algorithm
  // reported itself (report_cross_node_bytes: one that knows its schedule,
  // e.g. a two-level one), else `model` -- exact for ring, pairwise and shm
  // (which run as posted here), the pairwise equivalent for Open MPI's
  // (marked modelled: its schedule is not visible) and for an algorithm
  // that reported nothing.
  void account(const char* op, CpuAlgorithm algorithm, int64_t model) {
    const int64_t reported = take_reported_cross_node_bytes();
    // two_level without its communicators runs as pairwise, and is modelled so.
    const bool known = algorithm == CpuAlgorithm::Ring || algorithm == CpuAlgorithm::Pairwise ||
                       algorithm == CpuAlgorithm::Shm || algorithm == CpuAlgorithm::TwoLevel;
    count_cross_node(op, group_name_, to_string(algorithm), reported >= 0 ? reported : model,
                     reported < 0 && !known);
  }
  // two_level with its node and rail communicators (else it runs pairwise).
  bool runs_two_level(CpuAlgorithm a) const {
    return a == CpuAlgorithm::TwoLevel && two_level_ != nullptr;
  }
  // Ring reductions pass partial sums in the accumulation type.
  static int64_t acc_size(c10::ScalarType t) {
    return static_cast<int64_t>(c10::elementSize(cpu::acc_type(t)));
  }
  void count_p2p(bool send, const at::Tensor& t, int peer) {
    const int64_t bytes = send && cross_.remote(peer) ? static_cast<int64_t>(t.nbytes()) : 0;
    count_cross_node(send ? "send" : "recv", group_name_, "p2p", bytes, false);
  }

  WorkPtr finish_p2p(const char* op, MPI_Request request, at::Tensor t, bool async_op) {
    WorkInfo info = describe(op, t);
    auto work = std::make_shared<RequestWork>(request, std::move(t), std::move(info));
    if (!async_op) work->wait();
    return work;
  }

  WorkInfo describe(const char* op, const at::Tensor& payload) {
    WorkInfo info;
    info.op = op;
    info.group = group_name_;
    info.seq = ++sequence_;
    info.bytes = payload.defined() ? static_cast<int64_t>(payload.nbytes()) : 0;
    info.backend = "mpi";
    info.unit = trace::detail::current_unit();
    return info;
  }

  // count, extra: what FSDP_DEBUG=detail compares (CollectiveCheck::verify).
  WorkPtr submit(const char* op, const at::Tensor& payload, int64_t count, int64_t extra,
                 bool async_op, std::function<void()> fn) {
    WorkInfo info = describe(op, payload);
    if (check_ != nullptr) {
      const int dtype = payload.defined() ? static_cast<int>(payload.scalar_type()) : -1;
      fn = [check = check_, info, dtype, count, extra, fn = std::move(fn)] {
        check->verify(info, dtype, count, extra);
        fn();
      };
    }
    return thread_->submit(std::move(fn), std::move(info), async_op);
  }

  MPI_Comm comm_;
  std::string group_name_;
  // Collectives wait by polling (wait_polling) instead of inside a blocking
  // MPI call, which spins.
  bool poll_;
  CollectiveCheck* check_;  // FSDP_DEBUG=detail, else null; owned by the group
  int size_ = 1;
  cpu::Peers peers_;  // libfsdp's own algorithms: a duplicate of comm_
  std::shared_ptr<cpu::SharedArena> arena_;  // peers_.arena; null: none
  CrossNodeModel cross_;  // the node of each group rank (count_cross_node)
  std::unique_ptr<cpu::TwoLevel> two_level_;  // peers_.two_level; null: none
  uint64_t sequence_ = 0;
  std::unique_ptr<CommThread> thread_ = std::make_unique<CommThread>();
};

}  // namespace

std::unique_ptr<Backend> make_mpi_backend(MPI_Comm comm, std::string group_name, bool poll,
                                          CollectiveCheck* check) {
  return std::make_unique<MpiBackend>(comm, std::move(group_name), poll, check);
}

}  // namespace fsdp::detail
