// ProcessGroup + Work: collectives over a group of ranks, c10d-style.
//
// A ProcessGroup is a set of world ranks with its own MPI communicator. Each
// collective picks its backend from the tensors' device: MPI for CPU tensors,
// NCCL for CUDA tensors (when built with FSDP_WITH_NCCL). Collectives run on
// the group's communication thread in issue order, so an async_op call returns
// at once and the transfer progresses while the caller computes. Every rank of
// the group must issue the same collectives in the same order.
//
// Groups are created by DeviceMesh (see mesh.h); user code obtains them with
// DeviceMesh::get_group().
//
// Errors: non-contiguous tensors -> LayoutError; dtype mismatch or an
// unsupported dtype -> DTypeError; wrong sizes -> ShapeError; bad root/peer
// rank or op -> ArgumentError; an MPI/NCCL failure -> CommError with MPI's or
// NCCL's error string (rethrown by Work::wait()); ranks of a group issuing
// different collectives -> CommError naming both calls when FSDP_DEBUG=detail
// (otherwise they hang until the watchdog aborts the job: fsdp/runtime.h).
// Supported dtypes: float32, float64, bfloat16, float16, int32, int64; and
// uint8 for the collectives that only move data (all-gather, broadcast,
// all-to-all, point-to-point: bytes of any kind, e.g. float8 viewed as
// uint8); a reduction of uint8 is a DTypeError.
//
// CPU tensors: all-gather, reduce-scatter and all-reduce run Open MPI's
// collectives or libfsdp's own algorithms over MPI point-to-point, chosen per
// call by CpuCollectives below. bfloat16/float16 sums and maxima accumulate
// in float32: libfsdp's algorithms round once at the end (so any rank count
// is exactly summed in float32, then rounded); Open MPI's go through custom
// ops that round every partial result (exactly rounded at 2 ranks only).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace fsdp {

enum class ReduceOp { SUM, AVG, MAX };
std::string to_string(ReduceOp op);

// How the MPI backend runs all_gather_into_tensor, reduce_scatter_tensor and
// all_reduce of CPU tensors (docs/cpu_collectives.md).
enum class CpuAlgorithm {
  Auto,      // by size and memory (CpuCollectives), docs/cpu_collectives.md
  Mpi,       // Open MPI's collectives
  Ring,      // a ring over point-to-point: N-1 steps with the two neighbours
  Pairwise,  // a direct exchange with every peer; reductions in rank order
  Shm,       // through shared memory on one node (Pairwise where the group spans nodes)
  TwoLevel,  // across nodes: Pairwise between nodes, shared memory inside each
             // (Pairwise where the group is on one node or its nodes hold
             // different rank counts)
};
std::string to_string(CpuAlgorithm a);
// "auto", "mpi", "ring", "pairwise", "shm", "two_level"; ArgumentError naming `argument` and the
// accepted names otherwise.
CpuAlgorithm parse_cpu_algorithm(const std::string& text, const std::string& argument);

struct CpuCollectives {
  CpuAlgorithm algorithm = CpuAlgorithm::Auto;
  // Auto only: per collective, the block size in bytes (what one rank
  // exchanges with each peer: all-gather input, reduce-scatter output,
  // all-reduce tensor / ranks) from which pairwise runs. The defaults are
  // the crossovers measured with fsdp-bench collectives on 2 cores at np 2
  // and 4 (docs/cpu_collectives.md).
  int64_t all_gather_min_bytes = 1 << 20;
  int64_t reduce_scatter_min_bytes = 512 << 10;
  int64_t all_reduce_min_bytes = 8 << 20;
  // bfloat16/float16 reduce-scatter and all-reduce: Open MPI reduces them
  // with libfsdp's scalar user op, so pairwise wins from small blocks on.
  int64_t half_reduce_min_bytes = 32 << 10;
  // Auto on a group with a shared-memory arena (its ranks on one node): shm
  // for a block in [*_shm_min_bytes, *_shm_max_bytes) -- the rules above
  // outside it -- and at every size when every rank's operand (all-gather
  // output, reduce-scatter input) comes from empty_for_collectives, where
  // shm copies nothing in. Measured on 2 cores at np 2 and 4 (docs/benchmarks.md).
  int64_t all_gather_shm_min_bytes = 4 << 10;
  int64_t all_gather_shm_max_bytes = 4 << 20;
  int64_t reduce_scatter_shm_min_bytes = 4 << 10;
  int64_t reduce_scatter_shm_max_bytes = 2 << 20;
  int64_t all_reduce_shm_min_bytes = 4 << 10;
  int64_t all_reduce_shm_max_bytes = 512 << 10;
  // Auto on a group whose ranks span several nodes with the same number
  // (2 or more) on each: two_level from this block size on, the rules above
  // below it. fsdp-bench collectives on the simulated 2x2 cluster: from a
  // 32 KiB block two_level was on par with Open MPI's or faster at 10 Gbit/s
  // and up to 2x faster than either flat algorithm at 1 Gbit/s
  // (docs/benchmarks.md#two-level-collectives-across-nodes).
  int64_t two_level_min_bytes = 32 << 10;
};
// Process-wide; read when a collective is issued (queued ones keep their
// choice). Every rank must set the same value at the same point between
// collectives: the ranks of a group must run the same algorithm. The Runtime
// sets it at start-up from RuntimeOptions::cpu_collectives, else
// $FSDP_MPI_ALGO and $FSDP_MPI_ALGO_MIN_BYTES (every *_min_bytes).
// ArgumentError naming the field for a negative threshold.
void set_cpu_collectives(const CpuCollectives& settings);
CpuCollectives cpu_collectives();
// "auto (shm: all-gather 512K..4M, ...; pairwise from ...; Open MPI's
// below)", or the fixed algorithm's name: what banners and benchmarks print.
std::string to_string(const CpuCollectives& settings);

// Handle of an issued collective.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the collective finished; rethrows its error (CommError, ...).
  // For CUDA tensors it makes the caller's current stream wait for the
  // collective rather than blocking the host. Idempotent.
  virtual void wait() = 0;
  // True once the collective finished (successfully or not); never blocks.
  virtual bool is_completed() = 0;
  // wait(), but gives up after `timeout`: throws TimeoutError naming the op,
  // group and sequence number if the collective has not finished by then (it
  // stays in flight: wait again, or end the job). ArgumentError if timeout is
  // negative or not finite.
  void wait(std::chrono::duration<double> timeout);
  // "all_reduce on ranks[0,1] #7 (mpi)": what this handle waits for.
  virtual std::string describe() const = 0;
};
using WorkPtr = std::shared_ptr<Work>;

// One operation of a batch_isend_irecv.
struct P2POp {
  enum class Kind { Send, Recv };
  Kind kind = Kind::Send;
  at::Tensor tensor;  // contiguous; a Recv writes into it
  int peer = 0;       // group rank
  int tag = 0;        // 0..32767 (ignored by NCCL, which matches in issue order)
  // What the transfer is, e.g. "pp stage 0 -> 1 activation of microbatch 3":
  // describe_pending_collectives() shows it while the op is pending.
  std::string label;
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;

  // This process's rank in the group, and the group size.
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // World ranks of the members, in group-rank order.
  virtual const std::vector<int>& world_ranks() const = 0;
  // The member world ranks as a name, e.g. "ranks[0,2]"; counters use it.
  virtual const std::string& name() const = 0;

  // output (numel = input.numel() * size(), same dtype) <- concatenation of
  // every rank's input in rank order. In place: input may be output's block
  // for this rank (output.narrow(0, rank() * input.numel(), input.numel())),
  // which saves the copy of it; any other overlap is an ArgumentError.
  virtual WorkPtr all_gather_into_tensor(at::Tensor output, const at::Tensor& input,
                                         bool async_op = false) = 0;
  // output (numel = input.numel() / size()) <- rank's block of the reduction
  // of every rank's input. op: SUM, AVG or MAX.
  virtual WorkPtr reduce_scatter_tensor(at::Tensor output, const at::Tensor& input,
                                        ReduceOp op = ReduceOp::SUM, bool async_op = false) = 0;
  // In-place reduction. op: SUM, AVG or MAX.
  virtual WorkPtr all_reduce(at::Tensor tensor, ReduceOp op = ReduceOp::SUM,
                             bool async_op = false) = 0;
  // In-place: every rank receives root's tensor. root is a group rank.
  virtual WorkPtr broadcast(at::Tensor tensor, int root, bool async_op = false) = 0;
  // Splits input along dim 0 by input_split_sizes (rows; empty = equal
  // split), sends block j to rank j, and writes the blocks received into
  // output by output_split_sizes (rows; empty = equal split).
  virtual WorkPtr all_to_all_single(at::Tensor output, const at::Tensor& input,
                                    const std::vector<int64_t>& output_split_sizes = {},
                                    const std::vector<int64_t>& input_split_sizes = {},
                                    bool async_op = false) = 0;
  // Point-to-point with another group rank; tag in 0..32767 (the smallest
  // tag bound MPI guarantees; NCCL ignores tags and matches in issue order).
  // Unlike collectives these are not queued behind the group's other work:
  // they start at once. On CPU tensors (MPI) an async send and recv may be
  // in flight together in either order. On CUDA tensors (NCCL) each is its
  // own kernel on the group's stream, which runs them one after the other:
  // two ranks that both send first deadlock. Exchange with
  // batch_isend_irecv, which is safe on both.
  virtual WorkPtr send(const at::Tensor& tensor, int dst, int tag = 0, bool async_op = false) = 0;
  virtual WorkPtr recv(at::Tensor tensor, int src, int tag = 0, bool async_op = false) = 0;
  // Starts every op of `ops` together and returns one Work per op, in the
  // order given: receives are posted before sends, each ordered by peer, and
  // NCCL runs the batch inside one ncclGroupStart/End -- so two peers that
  // exchange in one batch cannot deadlock, whatever order each lists its ops
  // in. Wait on the Works (receives before reusing their tensors; sends
  // before overwriting theirs). Errors as for send/recv, naming "ops[i]".
  virtual std::vector<WorkPtr> batch_isend_irecv(std::vector<P2POp> ops) = 0;
  // Returns once every rank of the group has entered the barrier.
  virtual void barrier() = 0;

  // An uninitialised tensor whose memory this group's CPU collectives read
  // in place: on a group whose ranks share one node, in the group's
  // shared-memory arena, which the shm algorithm hands to peers without
  // copying it first (fully_shard allocates its reduce-scatter inputs and
  // all-gather outputs here). Otherwise -- CUDA tensors, ranks on several
  // nodes, an arena that cannot grow (FSDP_SHM_BYTES, a full /dev/shm) --
  // plain at::empty. Freed with the tensor, on any thread.
  virtual at::Tensor empty_for_collectives(at::IntArrayRef sizes,
                                           const at::TensorOptions& options);

  // How many nodes the members sit on (Runtime::node_of of each world rank;
  // 1 without a live Runtime). Never communicates.
  virtual int num_nodes() const;
  // Whether the group's CPU collectives have a shared-memory arena (ranks on
  // one node, more than one rank, /dev/shm usable and FSDP_SHM_BYTES not 0):
  // only then can they run `shm`. False for any group that spans nodes.
  virtual bool has_shared_memory() const { return false; }
  // Bytes backing this rank's segment of that arena now (0 without one).
  virtual int64_t shared_memory_committed() const { return 0; }
};
using ProcessGroupPtr = std::shared_ptr<ProcessGroup>;

// The shared memory of this process's collective arenas (every group's), in
// bytes. committed: backing the arenas now (freed blocks stay for reuse until
// the group ends); in_use: in live tensors and in-flight collectives;
// peak_in_use: the most in use at once since the last reset.
struct SharedMemoryStats {
  int64_t committed = 0;
  int64_t in_use = 0;
  int64_t peak_in_use = 0;
};
SharedMemoryStats shared_memory_stats();
void reset_shared_memory_peak();
// Called with +bytes on every arena allocation and -bytes on every free, on
// the thread that makes it, for memory accounting that counts LibTorch's
// allocator too (fsdp-bench train). Null (the default): none.
void set_shared_memory_observer(void (*observer)(int64_t delta_bytes));

// ---- Per-process collective counters --------------------------------------
// Each collective issued through a ProcessGroup is counted at issue time, by
// op name ("all_gather", "reduce_scatter", "all_reduce", "broadcast",
// "all_to_all", "send", "recv", "barrier") and group name. Tests read them to
// prove how many collectives a step issued.
struct CollectiveRecord {
  std::string op;
  std::string group;
  int64_t bytes = 0;  // payload bytes of this rank's input
};

struct CollectiveCounters {
  // (op, group) -> count
  std::map<std::pair<std::string, std::string>, int64_t> count;
  // (op, group) -> payload bytes
  std::map<std::pair<std::string, std::string>, int64_t> bytes;
  // Issue order since the last reset (capped at 100000 records).
  std::vector<CollectiveRecord> sequence;

  // Where the bytes went, counted when a collective runs (on its comm
  // thread for CPU tensors, at issue for NCCL), before its Work completes.
  // (op, group, algorithm) -> runs. algorithm: what actually ran for CPU
  // tensors ("mpi", "ring", "pairwise", "shm"; a shm run that fell back to
  // pairwise for a full arena still counts as "shm"), "nccl" for CUDA
  // tensors; "p2p" for send/recv/all_to_all, "mpi" for broadcast/barrier.
  std::map<std::tuple<std::string, std::string, std::string>, int64_t> algorithm_count;
  // (op, group) -> bytes THIS rank sent to ranks on other nodes
  // (Runtime::node_of). Exact for libfsdp's own algorithms (pairwise: its
  // block to each remote peer; ring: a block per step to its right neighbour
  // when that one is remote; shm: 0, it runs inside one node) and for
  // point-to-point and all_to_all. Modelled where libfsdp cannot see the
  // schedule: Open MPI's collectives as the pairwise exchange, broadcast as
  // the root sending to every remote rank, NCCL as a ring in group-rank order.
  std::map<std::pair<std::string, std::string>, int64_t> cross_node_bytes;
  // (op, group) -> the part of cross_node_bytes that is modelled.
  std::map<std::pair<std::string, std::string>, int64_t> modelled_cross_node_bytes;

  // Total of one op over all groups (or one group if group is non-empty).
  int64_t total(const std::string& op, const std::string& group = "") const;
  // Cross-node bytes of one op ("" = every op) over all groups (or one group).
  int64_t total_cross_node_bytes(const std::string& op = "", const std::string& group = "") const;
  // Runs of `algorithm` for one op ("" = every op) on one group ("" = every group).
  int64_t runs(const std::string& algorithm, const std::string& op = "",
               const std::string& group = "") const;
};

CollectiveCounters collective_counters();
void reset_collective_counters();

// ---- Per-group communication summary --------------------------------------
// One entry per process group libfsdp has created on this rank (a group and
// its side communicators -- fully_shard's reduction group, a checkpoint's --
// share the name and are merged), with what the counters saw since their
// last reset.
struct GroupSummary {
  std::string name;              // "ranks[0,1]"
  std::vector<int> world_ranks;  // members, in group-rank order
  int num_nodes = 1;             // nodes the members sit on
  int communicators = 1;         // this group's communicators (group + side groups)
  bool has_shared_memory = false;       // any of them has a shared-memory arena
  int64_t shared_memory_committed = 0;  // bytes of this rank's segments now
  // (op, algorithm) -> runs, from CollectiveCounters::algorithm_count.
  std::map<std::pair<std::string, std::string>, int64_t> algorithms;
  int64_t cross_node_bytes = 0;           // this rank, every op
  int64_t modelled_cross_node_bytes = 0;  // the modelled part of it
};
// Sorted by name. Empty without a live Runtime. Never communicates.
std::vector<GroupSummary> group_summaries();
// group_summaries() as text, one line per group:
//   "ranks[0,1]: 1 node, shm arena 4.0 MiB; all_gather shm x12, reduce_scatter
//    pairwise x3; cross-node 0 B"
// (cross-node bytes marked "(modelled N B)" where part is modelled).
std::string describe_groups();

// One line per collective issued on this process that has not completed yet
// ("all_gather on ranks[0,1] #12 (mpi), 4096 B, issued by FSDP unit 'layers.0',
// 3.2 s in flight"), or "none". The library's watchdog (fsdp/runtime.h) and
// the test harness's print it when they abort a stuck job.
std::string describe_pending_collectives();

}  // namespace fsdp
