// ProcessGroup: collectives over a group of ranks, c10d-style.
//
// A ProcessGroup is a set of world ranks with its own MPI communicator. Each
// collective picks its backend from the tensors' device: MPI for CPU tensors,
// NCCL for CUDA tensors (when built with FSDP_WITH_NCCL). Collectives run on
// the group's communication thread in issue order, so an async_op call returns
// at once and the transfer progresses while the caller computes. Every rank of
// the group must issue the same collectives in the same order.
//
// Groups are created by DeviceMesh (see fsdp/mesh.h); user code obtains them with
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
// CPU tensors: the algorithm and the rounding of 16-bit reductions are
// fsdp/cpu_collectives.h's.
#pragma once

#include "fsdp/reduce_op.h"
#include "fsdp/work.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

// One operation of a batch_isend_irecv.
struct P2POp {
  enum class Kind { Send, Recv };
  Kind kind = Kind::Send;
  at::Tensor tensor;  // contiguous; a Recv writes into it
  int peer = 0;       // group rank
  int tag = 0;        // 0..32767 (ignored by NCCL, which matches in issue order)
  // What the transfer is, e.g. "pp stage 0 -> 1 activation of microbatch 3":
  // describe_pending_collectives() (fsdp/comm_diagnostics.h) shows it while
  // the op is pending.
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

}  // namespace fsdp
