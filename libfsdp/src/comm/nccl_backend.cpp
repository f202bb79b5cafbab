// NCCL transport for CUDA tensors, stream-ordered like c10d's ProcessGroupNCCL.
//
// Each op runs on the backend's communication stream after the work already
// queued on the caller's current stream, and its Work makes a later current
// stream wait for it, so the host is never blocked and collectives overlap
// compute. Unlike the MPI backend there is no communication thread: NCCL
// enqueues kernels, so issuing from the caller's thread is already async.
//
// The group's communicator is created with the backend when the Runtime's
// device is CUDA (eager: group creation is collective), else by its first
// collective. A send/recv between two members of a larger group uses a
// communicator of just that pair, as c10d does: only the two of them issue
// the op, so it cannot wait for the rest of the group.
//
// Failures are asynchronous: a dead peer leaves the kernels spinning and only
// ncclCommGetAsyncError tells. The communicators' CommHealth is polled at
// every issue, by Work::is_completed()/wait(), and by the library watchdog,
// which aborts them (ncclCommAbort) before it aborts the job.
//
// Memory: every tensor an op uses is record_stream'ed on the communication
// stream, so the caching allocator does not reuse it before the op is done
// even if the caller frees it first. That can raise peak memory (a block
// freed on the compute stream waits for the comm stream's event) where
// FSDP2 instead holds references until the Work is waited; the Works here
// hold references too, so record_stream only matters for tensors freed
// while their Work is still alive. To be measured on a GPU.
// NCCL has no message tags: sends and recvs between a pair match in issue
// order, and `tag` (validated by ProcessGroupImpl) is ignored.
#include "comm/nccl_backend.h"

#include "fsdp/errors.h"
#include "fsdp/trace.h"
#include "comm/collective_check.h"
#include "comm/counters.h"
#include "comm/mpi_types.h"
#include "comm/pending_registry.h"
#include "comm/topology.h"
#include "comm/watchdog.h"
#include "comm/work.h"
#include "base/torch_compat.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

// ncclAvg and ncclBfloat16 appeared in NCCL 2.10.
#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < NCCL_VERSION(2, 10, 0)
#error "libfsdp's NCCL backend needs NCCL >= 2.10"
#endif

namespace fsdp::detail {
namespace {

// Tag of the unique-id message that bootstraps a pair communicator.
constexpr int kPairIdTag = 7;

[[noreturn]] void throw_nccl(ncclResult_t rc, const std::string& what) {
  std::string msg = "NCCL " + what + " failed: " + ncclGetErrorString(rc);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
  // The generic string above says "unhandled system error"; this says which.
  const char* detail = ncclGetLastError(nullptr);
  if (detail != nullptr && *detail != '\0') msg += std::string(" (") + detail + ")";
#endif
  throw CommError(msg);
}

void check_nccl(ncclResult_t rc, const std::string& what) {
  if (rc != ncclSuccess) throw_nccl(rc, what);
}

void check_cuda(cudaError_t rc, const char* call, const std::string& what) {
  if (rc != cudaSuccess) {
    throw CommError(std::string("CUDA ") + call + " in " + what + " failed: " +
                    cudaGetErrorString(rc));
  }
}

ncclDataType_t nccl_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return ncclFloat32;
    case c10::kDouble: return ncclFloat64;
    case c10::kBFloat16: return ncclBfloat16;
    case c10::kHalf: return ncclFloat16;
    case c10::kInt: return ncclInt32;
    case c10::kLong: return ncclInt64;
    case c10::kByte: return ncclUint8;
    default:
      throw DTypeError("tensor", std::string("the NCCL backend does not support dtype ") +
                                     c10::toString(t));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM: return ncclSum;
    case ReduceOp::AVG: return ncclAvg;
    case ReduceOp::MAX: return ncclMax;
  }
  throw ArgumentError("op", "unknown ReduceOp " + std::to_string(static_cast<int>(op)));
}

size_t count_of(const at::Tensor& t) { return static_cast<size_t>(t.numel()); }

char* bytes_at(const at::Tensor& t, int64_t element_offset) {
  return static_cast<char*>(t.data_ptr()) + element_offset * t.element_size();
}

// Travels from the rank that created the unique id to the others, with its
// result, so that a failed ncclGetUniqueId fails every rank instead of
// leaving the others waiting in ncclCommInitRank.
struct UniqueIdMessage {
  ncclResult_t rc = ncclSuccess;
  ncclUniqueId id{};
};

// The communicators of one backend, shared with its Works (which may
// outlive it) and polled by the watchdog.
class CommHealth final : public AsyncErrorSource {
 public:
  void add(ncclComm_t comm, std::string what) {
    std::lock_guard<std::mutex> lock(mu_);
    comms_.emplace_back(comm, std::move(what));
  }

  std::string async_error() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) return "";
    for (const auto& [comm, what] : comms_) {
      ncclResult_t async = ncclSuccess;
      const ncclResult_t rc = ncclCommGetAsyncError(comm, &async);
      if (rc != ncclSuccess) return "ncclCommGetAsyncError on the " + what + " failed: " +
                                    ncclGetErrorString(rc);
      if (async != ncclSuccess) {
        return "NCCL " + what + " has an asynchronous error: " + ncclGetErrorString(async);
      }
    }
    return "";
  }

  void abort() noexcept override {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) return;
    aborted_ = true;
    for (const auto& entry : comms_) ncclCommAbort(entry.first);
  }

  // The backend is going: a communicator with an asynchronous error is
  // aborted (a graceful destroy would wait for peers that may never answer).
  void release() noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_) {
      for (const auto& entry : comms_) {
        ncclResult_t async = ncclSuccess;
        if (ncclCommGetAsyncError(entry.first, &async) != ncclSuccess || async != ncclSuccess) {
          ncclCommAbort(entry.first);
        } else {
          ncclCommDestroy(entry.first);
        }
      }
    }
    aborted_ = true;  // nothing left to poll
    comms_.clear();
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<ncclComm_t, std::string>> comms_;
  bool aborted_ = false;
};

class NcclWork final : public Work, public PendingWork {
 public:
  NcclWork(c10::DeviceIndex device, std::vector<at::Tensor> tensors, WorkInfo info,
           std::shared_ptr<CommHealth> health)
      : device_(device), tensors_(std::move(tensors)), info_(std::move(info)),
        description_(info_.describe()), health_(std::move(health)) {
    check_cuda(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreate",
               description_);
    register_pending(this);
  }

  ~NcclWork() override {
    unregister_pending(this);
    // Safe while the event is still pending: CUDA releases it once reached.
    cudaEventDestroy(done_);
  }

  cudaEvent_t event() const { return done_; }

  // Orders the caller's current stream after the op; the host does not
  // block (synchronise the stream for host-side completion).
  void wait() override {
    if (query() == cudaErrorNotReady) note_async_error();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_.empty()) throw CommError(error_);
    }
    check_cuda(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(device_).stream(), done_, 0),
               "cudaStreamWaitEvent", description_ + " (Work::wait)");
  }

  // True once the op's kernels finished on the device, or once its
  // communicator reports an asynchronous error (wait() then throws it).
  bool is_completed() override {
    const cudaError_t rc = query();
    if (rc == cudaErrorNotReady) return note_async_error();
    if (rc != cudaSuccess) {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.empty()) {
        error_ = "CUDA error in " + description_ + ": " + cudaGetErrorString(rc);
      }
    }
    return true;
  }

  bool finished() const override { return query() != cudaErrorNotReady; }
  const WorkInfo& info() const override { return info_; }
  std::string describe() const override { return description_; }

 private:
  bool note_async_error() {
    const std::string error = health_->async_error();
    if (error.empty()) return false;
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.empty()) error_ = description_ + ": " + error;
    return true;
  }

  cudaError_t query() const {
    const cudaError_t rc = cudaEventQuery(done_);
    // "Not ready" would otherwise linger as this thread's last CUDA error and
    // fail the next unrelated cudaGetLastError() check (c10 does the same).
    if (rc == cudaErrorNotReady) (void)cudaGetLastError();
    return rc;
  }

  c10::DeviceIndex device_;
  // Held so the buffers outlive the transfer even if the caller drops them;
  // record_stream covers a caller that frees them while this Work lives on.
  std::vector<at::Tensor> tensors_;
  WorkInfo info_;
  std::string description_;  // for error messages
  cudaEvent_t done_ = nullptr;
  std::shared_ptr<CommHealth> health_;
  std::mutex mu_;
  std::string error_;
};

class NcclBackend final : public Backend {
 public:
  NcclBackend(MPI_Comm bootstrap, c10::Device device, std::string group_name,
              CollectiveCheck* check, bool eager)
      : bootstrap_(bootstrap), device_(device), group_name_(std::move(group_name)), check_(check),
        stream_(compat::comm_stream(device.index())),
        health_(std::make_shared<CommHealth>()) {
    check_mpi(MPI_Comm_rank(bootstrap_, &rank_), "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(bootstrap_, &size_), "MPI_Comm_size");
    c10::cuda::CUDAGuard guard(device_.index());
    check_cuda(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate",
               "NCCL backend set-up on " + group_name_);
    register_async_error_source(health_);
    cross_.nodes = nodes_of_comm(bootstrap_);
    cross_.rank = rank_;
    if (eager) group_comm();
  }

  ~NcclBackend() override {
    unregister_async_error_source(health_.get());
    health_->release();
    cudaEventDestroy(ready_);
  }

  WorkPtr all_gather(at::Tensor out, at::Tensor in, bool async_op) override {
    require_device(in, "input");
    auto work = issue("all_gather", {out, in}, async_op, [&](cudaStream_t s) {
      return ncclAllGather(in.data_ptr(), out.data_ptr(), count_of(in),
                           nccl_dtype(in.scalar_type()), group_comm(), s);
    }, "", Checked{in.numel(), -1});
    // NCCL's schedule (its rings follow the hardware) is not visible here:
    // modelled as a ring in group-rank order, counted at issue.
    count_cross_node("all_gather", group_name_, "nccl",
                     cross_.ring_all_gather(in.numel(), static_cast<int64_t>(in.element_size())),
                     true);
    return work;
  }

  WorkPtr reduce_scatter(at::Tensor out, at::Tensor in, ReduceOp op, bool async_op) override {
    require_device(in, "input");
    auto work = issue("reduce_scatter", {out, in}, async_op, [&](cudaStream_t s) {
      return ncclReduceScatter(in.data_ptr(), out.data_ptr(), count_of(out),
                               nccl_dtype(in.scalar_type()), nccl_op(op), group_comm(), s);
    }, "", Checked{out.numel(), static_cast<int64_t>(op)});
    const auto es = static_cast<int64_t>(in.element_size());  // NCCL reduces in the dtype
    count_cross_node("reduce_scatter", group_name_, "nccl",
                     cross_.ring_reduce_scatter(out.numel(), es), true);
    return work;
  }

  WorkPtr all_reduce(at::Tensor t, ReduceOp op, bool async_op) override {
    require_device(t, "tensor");
    auto work = issue("all_reduce", {t}, async_op, [&](cudaStream_t s) {
      return ncclAllReduce(t.data_ptr(), t.data_ptr(), count_of(t), nccl_dtype(t.scalar_type()),
                           nccl_op(op), group_comm(), s);
    }, "", Checked{t.numel(), static_cast<int64_t>(op)});
    const auto es = static_cast<int64_t>(t.element_size());
    count_cross_node("all_reduce", group_name_, "nccl", cross_.ring_all_reduce(t.numel(), es, es),
                     true);
    return work;
  }

  WorkPtr broadcast(at::Tensor t, int root, bool async_op) override {
    require_device(t, "tensor");
    return issue("broadcast", {t}, async_op, [&](cudaStream_t s) {
      return ncclBroadcast(t.data_ptr(), t.data_ptr(), count_of(t), nccl_dtype(t.scalar_type()),
                           root, group_comm(), s);
    }, "", Checked{t.numel(), root});
  }

  WorkPtr all_to_all(at::Tensor out, at::Tensor in, SplitCounts c, bool async_op) override {
    require_device(in, "input");
    return issue("all_to_all", {out, in}, async_op, [&](cudaStream_t s) {
      const ncclDataType_t dt = nccl_dtype(in.scalar_type());
      ncclComm_t comm = group_comm();
      ncclResult_t rc = ncclGroupStart();
      if (rc != ncclSuccess) return rc;
      // Zero-sized blocks are skipped on both sides alike: a rank's send
      // count to a peer is that peer's receive count from it.
      for (int r = 0; r < size_ && rc == ncclSuccess; ++r) {
        if (c.send_counts[r] > 0) {
          rc = ncclSend(bytes_at(in, c.send_displs[r]), static_cast<size_t>(c.send_counts[r]),
                        dt, r, comm, s);
        }
        if (rc == ncclSuccess && c.recv_counts[r] > 0) {
          rc = ncclRecv(bytes_at(out, c.recv_displs[r]), static_cast<size_t>(c.recv_counts[r]),
                        dt, r, comm, s);
        }
      }
      // Always close the group, even after a failed call inside it.
      const ncclResult_t end = ncclGroupEnd();
      return rc != ncclSuccess ? rc : end;
    }, "", Checked{-1, -1});  // split sizes may differ by rank
  }

  WorkPtr send(at::Tensor t, int dst, int /*tag*/, bool async_op) override {
    require_device(t, "tensor");
    return issue("send", {t}, async_op, [&](cudaStream_t s) {
      const auto [comm, peer] = peer_comm(dst);
      return ncclSend(t.data_ptr(), count_of(t), nccl_dtype(t.scalar_type()), peer, comm, s);
    });
  }

  WorkPtr recv(at::Tensor t, int src, int /*tag*/, bool async_op) override {
    require_device(t, "tensor");
    return issue("recv", {t}, async_op, [&](cudaStream_t s) {
      const auto [comm, peer] = peer_comm(src);
      return ncclRecv(t.data_ptr(), count_of(t), nccl_dtype(t.scalar_type()), peer, comm, s);
    });
  }

  // One work for the whole group launch, shared by every op: NCCL completes
  // a group's ops together.
  std::vector<WorkPtr> batch_p2p(const std::vector<P2POp>& ops) override {
    std::vector<at::Tensor> tensors;
    std::string label;
    for (const P2POp& op : ops) {
      require_device(op.tensor, "tensor");
      tensors.push_back(op.tensor);
      if (!op.label.empty()) label += (label.empty() ? "" : "; ") + op.label;
    }
    WorkPtr work = issue("batch_p2p", tensors, /*async_op=*/true, [&](cudaStream_t s) {
      // Pair communicators bootstrap over MPI: never inside an NCCL group.
      std::vector<std::pair<ncclComm_t, int>> peers;
      for (const P2POp& op : ops) peers.push_back(peer_comm(op.peer));
      ncclResult_t rc = ncclGroupStart();
      for (size_t i = 0; rc == ncclSuccess && i < ops.size(); ++i) {
        const at::Tensor& t = ops[i].tensor;
        const auto [comm, peer] = peers[i];
        rc = ops[i].kind == P2POp::Kind::Send
                 ? ncclSend(t.data_ptr(), count_of(t), nccl_dtype(t.scalar_type()), peer, comm, s)
                 : ncclRecv(t.data_ptr(), count_of(t), nccl_dtype(t.scalar_type()), peer, comm, s);
      }
      const ncclResult_t end = ncclGroupEnd();
      return rc != ncclSuccess ? rc : end;
    }, label);
    return std::vector<WorkPtr>(ops.size(), work);
  }

  void barrier() override {
    // Only the arrival matters, not the token's value.
    at::Tensor token = at::empty({1}, at::TensorOptions().dtype(at::kInt).device(device_));
    all_reduce(token, ReduceOp::SUM, /*async_op=*/false);
    check_cuda(cudaStreamSynchronize(stream_.stream()), "cudaStreamSynchronize",
               "barrier on " + group_name_);
  }

 private:
  // What FSDP_DEBUG=detail compares of a collective (CollectiveCheck::verify);
  // point-to-point is not checked (only its two ranks take part).
  struct Checked {
    int64_t count = 0;
    int64_t extra = -1;
  };

  // Runs `launch` (which issues the NCCL calls on the stream it is given and
  // returns their result) ordered after the caller's current stream.
  template <typename Launch>
  WorkPtr issue(const char* op, std::vector<at::Tensor> tensors, bool async_op,
                Launch&& launch, std::string label = "",
                std::optional<Checked> checked = std::nullopt) {
    std::lock_guard<std::mutex> lock(mu_);  // one NCCL call at a time per communicator
    WorkInfo info;
    info.op = op;
    info.group = group_name_;
    info.seq = ++sequence_;
    info.bytes = tensors.empty() ? 0 : static_cast<int64_t>(tensors.back().nbytes());  // the input
    info.backend = "nccl";
    info.label = std::move(label);
    info.unit = trace::detail::current_unit();
    const std::string what = info.describe();
    if (check_ != nullptr && checked) {
      check_->verify(info, static_cast<int>(tensors.back().scalar_type()), checked->count,
                     checked->extra);
    }
    c10::cuda::CUDAGuard guard(device_.index());
    check_async_errors(what);
    const cudaStream_t caller = c10::cuda::getCurrentCUDAStream(device_.index()).stream();
    check_cuda(cudaEventRecord(ready_, caller), "cudaEventRecord", what);
    check_cuda(cudaStreamWaitEvent(stream_.stream(), ready_, 0), "cudaStreamWaitEvent", what);
    // Created before the launch so that nothing is enqueued if it fails.
    auto work = std::make_shared<NcclWork>(device_.index(), tensors, std::move(info), health_);
    check_nccl(launch(stream_.stream()), what);
    for (const at::Tensor& t : tensors) compat::record_stream(t, stream_);
    check_cuda(cudaEventRecord(work->event(), stream_.stream()), "cudaEventRecord", what);
    if (!async_op) work->wait();
    return work;
  }

  void require_device(const at::Tensor& t, const char* argument) const {
    if (t.device() != device_) {
      throw LayoutError(argument, std::string("'") + argument + "' is on " + t.device().str() +
                                      " but the NCCL communicator of " + group_name_ +
                                      " is on " + device_.str() +
                                      "; a rank uses one CUDA device per group");
    }
  }

  ncclComm_t group_comm() {
    if (comm_ == nullptr) {
      UniqueIdMessage msg;
      if (rank_ == 0) msg.rc = ncclGetUniqueId(&msg.id);
      check_mpi(MPI_Bcast(&msg, static_cast<int>(sizeof msg), MPI_BYTE, 0, bootstrap_),
                "MPI_Bcast (NCCL unique id)");
      const std::string what = "communicator of " + group_name_;
      comm_ = init_comm(msg, size_, rank_, what);
      health_->add(comm_, what);
    }
    return comm_;
  }

  // The communicator and the peer's rank in it for a send/recv with `peer`.
  std::pair<ncclComm_t, int> peer_comm(int peer) {
    if (size_ == 2) return {group_comm(), peer};
    auto it = pair_comms_.find(peer);
    const bool low = rank_ < peer;
    if (it == pair_comms_.end()) {
      UniqueIdMessage msg;
      const int bytes = static_cast<int>(sizeof msg);
      if (low) {
        msg.rc = ncclGetUniqueId(&msg.id);
        check_mpi(MPI_Send(&msg, bytes, MPI_BYTE, peer, kPairIdTag, bootstrap_),
                  "MPI_Send (NCCL unique id)");
      } else {
        check_mpi(MPI_Recv(&msg, bytes, MPI_BYTE, peer, kPairIdTag, bootstrap_, MPI_STATUS_IGNORE),
                  "MPI_Recv (NCCL unique id)");
      }
      const std::string what = "communicator of group ranks " + std::to_string(rank_) + " and " +
                               std::to_string(peer) + " of " + group_name_;
      it = pair_comms_.emplace(peer, init_comm(msg, 2, low ? 0 : 1, what)).first;
      health_->add(it->second, what);
    }
    return {it->second, low ? 1 : 0};
  }

  ncclComm_t init_comm(const UniqueIdMessage& msg, int nranks, int rank, const std::string& what) {
    check_nccl(msg.rc, "ncclGetUniqueId for the " + what);
    c10::cuda::CUDAGuard guard(device_.index());
    ncclComm_t comm = nullptr;
    check_nccl(ncclCommInitRank(&comm, nranks, msg.id, rank),
               "ncclCommInitRank for the " + what + " on " + device_.str());
    return comm;
  }

  // A failed peer or network leaves its communicator unusable and the ops on
  // it spinning; this surfaces that at the next issue instead of queueing more.
  void check_async_errors(const std::string& what) {
    const std::string error = health_->async_error();
    if (!error.empty()) throw CommError(error + " (seen before " + what + ")");
  }

  MPI_Comm bootstrap_;
  c10::Device device_;
  std::string group_name_;
  CollectiveCheck* check_;  // FSDP_DEBUG=detail, else null; owned by the group
  c10::cuda::CUDAStream stream_;
  int rank_ = 0;
  int size_ = 1;
  std::mutex mu_;
  uint64_t sequence_ = 0;
  cudaEvent_t ready_ = nullptr;  // reusable: a stream wait captures the event when issued
  ncclComm_t comm_ = nullptr;
  std::map<int, ncclComm_t> pair_comms_;  // by peer group rank; only for groups of > 2
  std::shared_ptr<CommHealth> health_;    // owns comm_ and pair_comms_' lifetimes
  CrossNodeModel cross_;  // the node of each group rank (count_cross_node)
};

}  // namespace

std::unique_ptr<Backend> make_nccl_backend(MPI_Comm bootstrap, c10::Device device,
                                           std::string group_name, CollectiveCheck* check,
                                           bool eager) {
  return std::make_unique<NcclBackend>(bootstrap, device, std::move(group_name), check, eager);
}

}  // namespace fsdp::detail
