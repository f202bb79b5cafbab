// ProcessGroupImpl: argument validation, counting, and dispatch to the
// backend that matches the tensors' device.
#include "comm/process_group.h"

#include "fsdp/errors.h"
#include "comm/backend.h"
#include "comm/collective_check.h"
#include "comm/comm_settings.h"
#include "comm/counters.h"
#include "comm/mpi_backend.h"
#include "comm/mpi_types.h"
#include "comm/nccl_backend.h"
#include "comm/topology.h"
#include "base/shape_str.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <numeric>
#include <sstream>
#include <thread>

namespace fsdp {

void Work::wait(std::chrono::duration<double> timeout) {
  if (!(timeout.count() >= 0) || timeout.count() > 1e9) {
    std::ostringstream os;
    os << "Work::wait: 'timeout' = " << timeout.count() << " s; accepted: 0 .. 1e9 seconds";
    throw ArgumentError("timeout", os.str());
  }
  // Polls is_completed() (which never blocks, on every backend) with naps
  // that double from 50 us to 10 ms, then lets wait() rethrow or order the
  // caller's stream.
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout);
  std::chrono::microseconds nap(50);
  while (!is_completed()) {
    const auto now = Clock::now();
    if (now >= deadline) {
      std::ostringstream os;
      os << describe() << ": not complete after " << timeout.count()
         << " s (Work::wait timeout); it is still in flight";
      throw TimeoutError(os.str());
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(nap, deadline - now));
    nap = std::min(nap * 2, std::chrono::microseconds(10000));
  }
  wait();
}

int ProcessGroup::num_nodes() const { return detail::count_nodes(world_ranks()); }

std::string to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM: return "sum";
    case ReduceOp::AVG: return "avg";
    case ReduceOp::MAX: return "max";
  }
  return "unknown";
}

namespace detail {
namespace {

void require_defined(const char* fn, const at::Tensor& t, const char* arg) {
  if (!t.defined()) {
    throw ArgumentError(arg, std::string(fn) + ": '" + arg + "' is an undefined tensor");
  }
}

void require_dtype(const char* fn, const at::Tensor& t, const char* arg) {
  switch (t.scalar_type()) {
    case c10::kFloat: case c10::kDouble: case c10::kBFloat16:
    case c10::kHalf: case c10::kInt: case c10::kLong: case c10::kByte:
      return;
    default:
      throw DTypeError(arg, std::string(fn) + ": '" + arg + "' has dtype " +
                                c10::toString(t.scalar_type()) +
                                "; accepted: float32, float64, bfloat16, float16, int32, int64, "
                                "uint8 (uint8: not for reductions)");
  }
}

void require_contiguous(const char* fn, const at::Tensor& t, const char* arg) {
  if (!t.is_contiguous()) {
    throw LayoutError(arg, std::string(fn) + ": '" + arg + "' (shape " + shape_str(t.sizes()) +
                               ") is not contiguous; call .contiguous() first");
  }
}

void check_one(const char* fn, const at::Tensor& t, const char* arg) {
  require_defined(fn, t, arg);
  require_dtype(fn, t, arg);
  require_contiguous(fn, t, arg);
}

void check_pair(const char* fn, const at::Tensor& out, const at::Tensor& in) {
  check_one(fn, in, "input");
  check_one(fn, out, "output");
  if (out.scalar_type() != in.scalar_type()) {
    throw DTypeError("output", std::string(fn) + ": 'output' has dtype " +
                                   c10::toString(out.scalar_type()) + " but 'input' has " +
                                   c10::toString(in.scalar_type()) + "; they must match");
  }
  if (out.device() != in.device()) {
    throw LayoutError("output", std::string(fn) + ": 'output' is on " + out.device().str() +
                                    " but 'input' is on " + in.device().str() +
                                    "; they must be on the same device");
  }
}

}  // namespace

bool is_own_gather_block(const at::Tensor& output, const at::Tensor& input, int rank) {
  return static_cast<const char*>(input.data_ptr()) ==
         static_cast<const char*>(output.data_ptr()) + static_cast<int64_t>(input.nbytes()) * rank;
}

namespace {

// An all-gather's input may be the output's block for this rank (the
// collective then copies nothing of its own); any other overlap would read
// what it writes.
void check_gather_overlap(const char* fn, const at::Tensor& out, const at::Tensor& in,
                          int rank) {
  const auto* o = static_cast<const char*>(out.data_ptr());
  const auto* i = static_cast<const char*>(in.data_ptr());
  if (i >= o + out.nbytes() || o >= i + in.nbytes()) return;
  if (is_own_gather_block(out, in, rank)) return;
  throw ArgumentError("input", std::string(fn) + ": 'input' overlaps 'output' but is not its "
                                   "block for this rank (elements [rank * input.numel(), "
                                   "(rank + 1) * input.numel())); accepted: that block (in "
                                   "place) or memory of its own");
}

void check_reduce_op(const char* fn, ReduceOp op, const at::Tensor& t, const char* arg) {
  if (op != ReduceOp::SUM && op != ReduceOp::AVG && op != ReduceOp::MAX) {
    throw ArgumentError("op", std::string(fn) + ": 'op' = " +
                                  std::to_string(static_cast<int>(op)) +
                                  " is not a ReduceOp; accepted: SUM, AVG, MAX");
  }
  if (t.scalar_type() == c10::kByte) {
    throw DTypeError(arg, std::string(fn) + ": '" + arg + "' has dtype uint8, which only moves "
                              "(all-gather, broadcast, all-to-all, send/recv); reductions accept "
                              "float32, float64, bfloat16, float16, int32, int64");
  }
  if (op == ReduceOp::AVG && !at::isFloatingType(t.scalar_type())) {
    throw DTypeError(arg, std::string(fn) + ": op avg needs a floating dtype but '" + arg +
                              "' has " + c10::toString(t.scalar_type()));
  }
}

void check_peer(const char* fn, int peer, int size, int self, const char* arg) {
  if (peer < 0 || peer >= size || peer == self) {
    throw ArgumentError(arg, std::string(fn) + ": '" + arg + "' = " + std::to_string(peer) +
                                 "; accepted: a group rank in [0, " + std::to_string(size) +
                                 ") other than this rank (" + std::to_string(self) + ")");
  }
}

void check_tag(const char* fn, int tag, const std::string& arg = "tag") {
  if (tag < 0 || tag > 32767) {
    throw ArgumentError(arg, std::string(fn) + ": '" + arg + "' = " + std::to_string(tag) +
                                 "; accepted: 0..32767");
  }
}

int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// Row counts (empty = equal split of `rows`) -> element counts and displacements.
void split_to_counts(const char* arg, const std::vector<int64_t>& split, int64_t rows,
                     int64_t row_numel, int size, std::vector<int64_t>& counts,
                     std::vector<int64_t>& displs) {
  std::vector<int64_t> s = split;
  if (s.empty()) {
    if (rows % size != 0) {
      throw ShapeError(arg, std::string("all_to_all_single: dim 0 (") + std::to_string(rows) +
                                ") is not divisible by the group size " + std::to_string(size) +
                                "; pass '" + arg + "' for an uneven split");
    }
    s.assign(static_cast<size_t>(size), rows / size);
  }
  if (static_cast<int>(s.size()) != size) {
    throw ShapeError(arg, std::string("all_to_all_single: '") + arg + "' has " +
                              std::to_string(s.size()) + " entries; expected the group size " +
                              std::to_string(size));
  }
  int64_t total = 0;
  for (int64_t v : s) {
    if (v < 0) {
      throw ShapeError(arg, std::string("all_to_all_single: '") + arg +
                                "' has a negative entry " + std::to_string(v));
    }
    total += v;
  }
  if (total != rows) {
    throw ShapeError(arg, std::string("all_to_all_single: '") + arg + "' sums to " +
                              std::to_string(total) + " rows but the tensor has " +
                              std::to_string(rows));
  }
  counts.resize(s.size());
  displs.resize(s.size());
  int64_t offset = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    counts[i] = s[i] * row_numel;
    displs[i] = offset;
    offset += counts[i];
  }
}

}  // namespace

ProcessGroupImpl::ProcessGroupImpl(MPI_Comm comm, std::vector<int> world_ranks, std::string name,
                                   bool poll)
    : world_ranks_(std::move(world_ranks)), name_(std::move(name)) {
  check_mpi(MPI_Comm_rank(comm, &rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm, &size_), "MPI_Comm_size");
  // A second communicator over the same ranks for bootstrapping other
  // transports, so their set-up never interleaves with queued MPI collectives.
  check_mpi(MPI_Comm_dup(comm, &bootstrap_), "MPI_Comm_dup");
  // MPI failures must reach the caller as CommError (check_mpi), not abort
  // the job from inside MPI; communicators duplicated from these inherit it.
  check_mpi(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check_mpi(MPI_Comm_set_errhandler(bootstrap_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  if (comm_settings().check_collectives) {
    for (auto* check : {&mpi_check_, &nccl_check_}) {
      MPI_Comm dup = MPI_COMM_NULL;
      check_mpi(MPI_Comm_dup(bootstrap_, &dup), "MPI_Comm_dup");
      *check = std::make_unique<CollectiveCheck>(dup, world_ranks_);
    }
  }
  mpi_ = make_mpi_backend(comm, name_, poll, mpi_check_.get());
#ifdef FSDP_WITH_NCCL
  // Created here, where every member is (group creation is collective), in
  // the same order on every rank; lazily, inside the first collective, ranks
  // that reach it at different times would deadlock in ncclCommInitRank.
  const c10::Device device = comm_settings().device;
  if (device.is_cuda()) {
    nccl_ = make_nccl_backend(bootstrap_, device, name_, nccl_check_.get(), /*eager=*/true);
  }
#endif
}

ProcessGroupImpl::~ProcessGroupImpl() { shutdown(); }

MPI_Comm ProcessGroupImpl::duplicate_communicator() {
  std::lock_guard<std::mutex> lock(backends_mu_);
  if (closed_) {
    throw StateError("process group " + name_ + " was shut down (the fsdp::Runtime ended)");
  }
  MPI_Comm comm = MPI_COMM_NULL;
  check_mpi(MPI_Comm_dup(bootstrap_, &comm), "MPI_Comm_dup");
  return comm;
}

MPI_Comm ProcessGroupImpl::split_communicator(int color, int key) {
  std::lock_guard<std::mutex> lock(backends_mu_);
  if (closed_) {
    throw StateError("process group " + name_ + " was shut down (the fsdp::Runtime ended)");
  }
  MPI_Comm comm = MPI_COMM_NULL;
  if (color < 0) {
    check_mpi(MPI_Comm_split_type(bootstrap_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &comm),
              "MPI_Comm_split_type");
  } else {
    check_mpi(MPI_Comm_split(bootstrap_, color, key, &comm), "MPI_Comm_split");
  }
  return comm;
}

void ProcessGroupImpl::shutdown() {
  std::lock_guard<std::mutex> lock(backends_mu_);
  if (closed_) return;
  closed_ = true;
  nccl_.reset();
  mpi_.reset();
  nccl_check_.reset();
  mpi_check_.reset();
  if (bootstrap_ != MPI_COMM_NULL) MPI_Comm_free(&bootstrap_);
}

Backend& ProcessGroupImpl::backend_for(const at::Tensor& t, const char* argument) {
  std::lock_guard<std::mutex> lock(backends_mu_);
  if (closed_) {
    throw StateError("process group " + name_ + " was shut down (the fsdp::Runtime ended)");
  }
  if (t.device().is_cpu()) return *mpi_;
  if (t.device().is_cuda()) {
#ifdef FSDP_WITH_NCCL
    // Only for CUDA tensors under a CPU Runtime device (FSDP_DEVICE=cpu):
    // every member must then reach this first collective.
    if (!nccl_) {
      nccl_ = make_nccl_backend(bootstrap_, t.device(), name_, nccl_check_.get(), /*eager=*/false);
    }
    return *nccl_;
#else
    throw LayoutError(argument, std::string("'") + argument + "' is a CUDA tensor but libfsdp " +
                                    "was built without NCCL (configure with -DFSDP_WITH_NCCL=ON "
                                    "against a CUDA LibTorch)");
#endif
  }
  throw LayoutError(argument, std::string("'") + argument + "' is on device " + t.device().str() +
                                  "; accepted: cpu (MPI) or cuda (NCCL)");
}

WorkPtr ProcessGroupImpl::all_gather_into_tensor(at::Tensor output, const at::Tensor& input,
                                                 bool async_op) {
  const char* fn = "all_gather_into_tensor";
  check_pair(fn, output, input);
  if (output.numel() != input.numel() * size_) {
    throw ShapeError("output", std::string(fn) + ": 'output' has " +
                                   std::to_string(output.numel()) +
                                   " elements; expected input.numel() * group size = " +
                                   std::to_string(input.numel() * size_));
  }
  check_gather_overlap(fn, output, input, rank_);
  Backend& b = backend_for(input, "input");
  count_collective("all_gather", name_, bytes_of(input));
  return b.all_gather(output, input, async_op);
}

WorkPtr ProcessGroupImpl::reduce_scatter_tensor(at::Tensor output, const at::Tensor& input,
                                                ReduceOp op, bool async_op) {
  const char* fn = "reduce_scatter_tensor";
  check_pair(fn, output, input);
  check_reduce_op(fn, op, input, "input");
  if (input.numel() != output.numel() * size_) {
    throw ShapeError("output", std::string(fn) + ": 'output' has " +
                                   std::to_string(output.numel()) +
                                   " elements; expected input.numel() / group size = " +
                                   std::to_string(input.numel()) + " / " + std::to_string(size_));
  }
  Backend& b = backend_for(input, "input");
  count_collective("reduce_scatter", name_, bytes_of(input));
  return b.reduce_scatter(output, input, op, async_op);
}

WorkPtr ProcessGroupImpl::all_reduce(at::Tensor tensor, ReduceOp op, bool async_op) {
  const char* fn = "all_reduce";
  check_one(fn, tensor, "tensor");
  check_reduce_op(fn, op, tensor, "tensor");
  Backend& b = backend_for(tensor, "tensor");
  count_collective("all_reduce", name_, bytes_of(tensor));
  return b.all_reduce(tensor, op, async_op);
}

WorkPtr ProcessGroupImpl::broadcast(at::Tensor tensor, int root, bool async_op) {
  const char* fn = "broadcast";
  check_one(fn, tensor, "tensor");
  if (root < 0 || root >= size_) {
    throw ArgumentError("root", std::string(fn) + ": 'root' = " + std::to_string(root) +
                                    "; accepted: a group rank in [0, " + std::to_string(size_) +
                                    ")");
  }
  Backend& b = backend_for(tensor, "tensor");
  count_collective("broadcast", name_, bytes_of(tensor));
  return b.broadcast(tensor, root, async_op);
}

WorkPtr ProcessGroupImpl::all_to_all_single(at::Tensor output, const at::Tensor& input,
                                            const std::vector<int64_t>& output_split_sizes,
                                            const std::vector<int64_t>& input_split_sizes,
                                            bool async_op) {
  const char* fn = "all_to_all_single";
  check_pair(fn, output, input);
  if (input.dim() == 0 || output.dim() == 0) {
    const char* arg = input.dim() == 0 ? "input" : "output";
    throw ShapeError(arg, std::string(fn) + ": '" + arg +
                              "' is 0-d; accepted: a tensor with at least one dimension");
  }
  const int64_t row_numel = input.size(0) > 0 ? input.numel() / input.size(0)
                                              : c10::multiply_integers(input.sizes().slice(1));
  const int64_t out_row_numel = c10::multiply_integers(output.sizes().slice(1));
  if (row_numel != out_row_numel) {
    throw ShapeError("output", std::string(fn) + ": 'output' rows have " +
                                   std::to_string(out_row_numel) + " elements but 'input' rows " +
                                   std::to_string(row_numel));
  }
  SplitCounts counts;
  split_to_counts("input_split_sizes", input_split_sizes, input.size(0), row_numel, size_,
                  counts.send_counts, counts.send_displs);
  split_to_counts("output_split_sizes", output_split_sizes, output.size(0), row_numel, size_,
                  counts.recv_counts, counts.recv_displs);
  Backend& b = backend_for(input, "input");
  count_collective("all_to_all", name_, bytes_of(input));
  return b.all_to_all(output, input, std::move(counts), async_op);
}

WorkPtr ProcessGroupImpl::send(const at::Tensor& tensor, int dst, int tag, bool async_op) {
  check_one("send", tensor, "tensor");
  check_peer("send", dst, size_, rank_, "dst");
  check_tag("send", tag);
  Backend& b = backend_for(tensor, "tensor");
  count_collective("send", name_, bytes_of(tensor));
  return b.send(tensor, dst, tag, async_op);
}

WorkPtr ProcessGroupImpl::recv(at::Tensor tensor, int src, int tag, bool async_op) {
  check_one("recv", tensor, "tensor");
  check_peer("recv", src, size_, rank_, "src");
  check_tag("recv", tag);
  Backend& b = backend_for(tensor, "tensor");
  count_collective("recv", name_, bytes_of(tensor));
  return b.recv(tensor, src, tag, async_op);
}

std::vector<WorkPtr> ProcessGroupImpl::batch_isend_irecv(std::vector<P2POp> ops) {
  const char* fn = "batch_isend_irecv";
  if (ops.empty()) return {};
  Backend* b = nullptr;
  for (size_t i = 0; i < ops.size(); ++i) {
    const std::string arg = "ops[" + std::to_string(i) + "]";
    check_one(fn, ops[i].tensor, (arg + ".tensor").c_str());
    check_peer(fn, ops[i].peer, size_, rank_, (arg + ".peer").c_str());
    check_tag(fn, ops[i].tag, arg + ".tag");
    Backend& own = backend_for(ops[i].tensor, (arg + ".tensor").c_str());
    if (b != nullptr && b != &own) {
      throw LayoutError(arg + ".tensor", std::string(fn) + ": '" + arg +
                                             ".tensor' is on " + ops[i].tensor.device().str() +
                                             " but ops[0].tensor on " +
                                             ops[0].tensor.device().str() +
                                             "; one batch uses one backend");
    }
    b = &own;
  }
  // Counted once the whole batch is accepted: a rejected call counts nothing.
  for (const P2POp& op : ops) {
    count_collective(op.kind == P2POp::Kind::Send ? "send" : "recv", name_, bytes_of(op.tensor));
  }
  // Receives first, then sends, each by peer (stable: a peer's ops keep the
  // caller's order, which is how NCCL and MPI match them).
  std::vector<size_t> order(ops.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&ops](size_t a, size_t c) {
    const bool ra = ops[a].kind == P2POp::Kind::Recv, rc = ops[c].kind == P2POp::Kind::Recv;
    if (ra != rc) return ra;
    return ops[a].peer < ops[c].peer;
  });
  std::vector<P2POp> sorted;
  sorted.reserve(ops.size());
  for (size_t i : order) sorted.push_back(ops[i]);
  std::vector<WorkPtr> issued = b->batch_p2p(sorted);
  std::vector<WorkPtr> out(ops.size());
  for (size_t k = 0; k < order.size(); ++k) out[order[k]] = issued[k];
  return out;
}

at::Tensor Backend::empty_for_collectives(at::IntArrayRef sizes,
                                          const at::TensorOptions& options) {
  return at::empty(sizes, options);
}

at::Tensor ProcessGroupImpl::empty_for_collectives(at::IntArrayRef sizes,
                                                   const at::TensorOptions& options) {
  Backend* b = nullptr;
  {
    std::lock_guard<std::mutex> lock(backends_mu_);
    if (!closed_ && options.device().is_cpu()) b = mpi_.get();
  }
  return b != nullptr ? b->empty_for_collectives(sizes, options) : at::empty(sizes, options);
}

bool ProcessGroupImpl::has_shared_memory() const {
  std::lock_guard<std::mutex> lock(backends_mu_);
  return !closed_ && mpi_ != nullptr && mpi_->has_shared_memory();
}

int64_t ProcessGroupImpl::shared_memory_committed() const {
  std::lock_guard<std::mutex> lock(backends_mu_);
  return !closed_ && mpi_ != nullptr ? mpi_->shared_memory_committed() : 0;
}

void ProcessGroupImpl::barrier() {
  Backend* b = nullptr;
  {
    std::lock_guard<std::mutex> lock(backends_mu_);
    if (closed_) {
      throw StateError("process group " + name_ + " was shut down (the fsdp::Runtime ended)");
    }
    b = mpi_.get();
  }
  count_collective("barrier", name_, 0);
  b->barrier();
}

}  // namespace detail
}  // namespace fsdp
