// CpuCollectives: which algorithm the MPI backend runs for the collectives
// of CPU tensors, set process-wide (docs/cpu_collectives.md).
//
// CPU tensors: all-gather, reduce-scatter and all-reduce run Open MPI's
// collectives or libfsdp's own algorithms over MPI point-to-point, chosen per
// call by CpuCollectives below. bfloat16/float16 sums and maxima accumulate
// in float32: libfsdp's algorithms round once at the end (so any rank count
// is exactly summed in float32, then rounded); Open MPI's go through custom
// ops that round every partial result (exactly rounded at 2 ranks only).
#pragma once

#include <cstdint>
#include <string>

namespace fsdp {

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

}  // namespace fsdp
