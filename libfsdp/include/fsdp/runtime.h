// Runtime: MPI bootstrap, rank topology, device choice and thread pinning.
//
// Create exactly one Runtime at the top of main(); it initialises MPI with
// MPI_THREAD_MULTIPLE (each process group runs its collectives on its own
// communication thread while the caller computes), and finalises MPI when it
// is destroyed, after every communicator libfsdp created has been freed.
//
//   int main(int argc, char** argv) {
//     fsdp::Runtime rt(&argc, &argv);
//     auto mesh = fsdp::init_device_mesh(rt.device().type(), {rt.world_size()});
//     ...
//   }
#pragma once

#include "fsdp/comm.h"

#include <c10/core/Device.h>

#include <mpi.h>

#include <optional>
#include <string>
#include <vector>

namespace fsdp {

struct RuntimeOptions {
  // Intra-op (LibTorch) and BLAS threads per rank. 0 = $FSDP_NUM_THREADS if
  // set, else (cores available to this process) / (ranks on this node), >= 1.
  int num_threads = 0;
  // Log the start-up banner (BLAS library, threads, device) on world rank 0.
  bool log_banner = true;
  // The collective watchdog: a collective or point-to-point issued through
  // libfsdp that has not completed after this many seconds is printed on
  // every rank where it is pending (op, group, sequence number, bytes, the
  // FSDP unit or pipeline transfer that issued it, how long) and the job is
  // aborted with MPI_Abort, exit status 124, about 3 s later. 0 switches it
  // off. Unset: $FSDP_TIMEOUT (seconds, or "off"), else 600.
  std::optional<double> timeout_seconds;
  // Desync detection: before each collective the ranks of its group compare
  // op, dtype, element count, root or reduce op and position, and a mismatch
  // throws CommError naming both ranks' calls instead of hanging. Costs one
  // small extra all-gather per collective. Unset: on when $FSDP_DEBUG is
  // "detail" (off for "off" or empty).
  std::optional<bool> check_collectives;
  // CPU collective algorithms (fsdp/comm.h, CpuCollectives). Unset:
  // $FSDP_MPI_ALGO (auto, mpi, ring, pairwise, shm, two_level; default auto) and
  // $FSDP_MPI_ALGO_MIN_BYTES (bytes: every *_min_bytes threshold of auto;
  // default: CpuCollectives' measured per-collective values).
  // Must be the same on every rank (refused with ArgumentError otherwise).
  std::optional<CpuCollectives> cpu_collectives;
  // The device this rank computes on: kCPU, or kCUDA (cuda:<local rank %
  // visible devices>, made the current CUDA device). Unset: $FSDP_DEVICE
  // ("auto", "cpu", "cuda"), else auto: CUDA when LibTorch sees a GPU.
  // With the NCCL backend, two ranks of a node on one GPU are refused at
  // start-up (StateError on every rank: NCCL cannot run them); run one rank
  // per GPU, or kCPU for CPU tensors over MPI.
  std::optional<c10::DeviceType> device;
};

class Runtime {
 public:
  // Initialises MPI (unless already initialised by the caller, in which case
  // the provided thread level is checked). Throws StateError if a Runtime is
  // already alive or MPI cannot provide MPI_THREAD_MULTIPLE; ArgumentError
  // naming the option or variable for a bad timeout, FSDP_TIMEOUT,
  // FSDP_DEBUG, FSDP_NUM_THREADS, FSDP_MPI_ALGO or FSDP_DEVICE; StateError
  // for a device that cannot be bound (RuntimeOptions::device).
  Runtime(int* argc, char*** argv, RuntimeOptions options = {});
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // The live runtime; throws StateError if none.
  static Runtime& get();
  static bool alive();

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  // Rank and rank count on this node (shared-memory split of MPI_COMM_WORLD,
  // so it is right under mpirun and srun alike).
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  // Node topology, computed once at start-up (the same shared-memory split,
  // then an all-gather): nodes are numbered 0 .. num_nodes()-1 by their
  // lowest world rank, so node 0 holds world rank 0. Under a plain mpiexec
  // on one machine there is one node. A group's node count:
  // ProcessGroup::num_nodes(); the bytes sent across nodes:
  // CollectiveCounters::cross_node_bytes (fsdp/comm.h).
  int num_nodes() const { return num_nodes_; }
  // This rank's node.
  int node_index() const { return node_of(world_rank_); }
  // The node of `world_rank`; ArgumentError naming 'world_rank' unless it is
  // in [0, world_size()).
  int node_of(int world_rank) const;
  // node_of for every world rank, indexed by world rank.
  const std::vector<int>& node_map() const { return node_of_; }
  // See RuntimeOptions::device: cuda:<local rank % visible devices> (the
  // current CUDA device of this process) or cpu.
  c10::Device device() const { return device_; }
  int num_threads() const { return num_threads_; }
  // The watchdog's timeout in seconds (0: off), as resolved from the options
  // and the environment.
  double timeout_seconds() const { return timeout_seconds_; }
  // Path of the shared object that provides sgemm_ (the BLAS LibTorch uses).
  const std::string& blas_library() const { return blas_library_; }
  // Whether MPI was initialised by this Runtime (and will be finalised by it).
  bool owns_mpi() const { return owns_mpi_; }

 private:
  void bind_device(const RuntimeOptions& options, MPI_Comm node);
  void compute_topology(MPI_Comm node);
  bool owns_mpi_ = false;
  int world_rank_ = 0;
  int world_size_ = 1;
  int local_rank_ = 0;
  int local_size_ = 1;
  int num_nodes_ = 1;
  std::vector<int> node_of_;
  int num_threads_ = 1;
  double timeout_seconds_ = 600;
  bool check_collectives_ = false;
  CpuCollectives cpu_collectives_;
  c10::Device device_{c10::kCPU};
  std::string blas_library_;
};

// Shared object path that provides the BLAS routine sgemm_, or "unknown".
std::string loaded_blas_library();

}  // namespace fsdp
