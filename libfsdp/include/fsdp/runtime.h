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

#include <c10/core/Device.h>

#include <mpi.h>

#include <string>

namespace fsdp {

struct RuntimeOptions {
  // Intra-op (LibTorch) and BLAS threads per rank. 0 = $FSDP_NUM_THREADS if
  // set, else (cores available to this process) / (ranks on this node), >= 1.
  int num_threads = 0;
  // Log the start-up banner (BLAS library, threads, device) on world rank 0.
  bool log_banner = true;
};

class Runtime {
 public:
  // Initialises MPI (unless already initialised by the caller, in which case
  // the provided thread level is checked). Throws StateError if a Runtime is
  // already alive or MPI cannot provide MPI_THREAD_MULTIPLE.
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
  // cuda:<local rank> when LibTorch has CUDA devices, else cpu.
  c10::Device device() const { return device_; }
  int num_threads() const { return num_threads_; }
  // Path of the shared object that provides sgemm_ (the BLAS LibTorch uses).
  const std::string& blas_library() const { return blas_library_; }
  // Whether MPI was initialised by this Runtime (and will be finalised by it).
  bool owns_mpi() const { return owns_mpi_; }

 private:
  bool owns_mpi_ = false;
  int world_rank_ = 0;
  int world_size_ = 1;
  int local_rank_ = 0;
  int local_size_ = 1;
  int num_threads_ = 1;
  c10::Device device_{c10::kCPU};
  std::string blas_library_;
};

// Shared object path that provides the BLAS routine sgemm_, or "unknown".
std::string loaded_blas_library();

}  // namespace fsdp
