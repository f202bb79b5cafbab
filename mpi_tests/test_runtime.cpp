// L0: the Runtime's view of the job (all ranks of a CTest run share one node).
#include "spmd.h"

#include <fsdp/errors.h>
#include <fsdp/runtime.h>

#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include <mpi.h>

BOOST_AUTO_TEST_CASE(runtime_topology) {
  fsdp::Runtime& rt = spmd::runtime();
  int rank = -1, size = -1, thread_level = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Query_thread(&thread_level);
  BOOST_TEST(rt.world_rank() == rank);
  BOOST_TEST(rt.world_size() == size);
  BOOST_TEST(thread_level == MPI_THREAD_MULTIPLE);
  // One node: the shared-memory split sees every rank.
  BOOST_TEST(rt.local_size() == size);
  BOOST_TEST(rt.local_rank() == rank);
  BOOST_TEST(rt.owns_mpi());
  BOOST_TEST(&fsdp::Runtime::get() == &rt);
  BOOST_TEST(fsdp::Runtime::alive());
}

BOOST_AUTO_TEST_CASE(runtime_threads_and_device) {
  fsdp::Runtime& rt = spmd::runtime();
  // The harness asks for one thread per rank (ranks share the cores).
  BOOST_TEST(rt.num_threads() == 1);
  BOOST_TEST(at::get_num_threads() == 1);
  BOOST_TEST((rt.device().is_cpu() || rt.device().is_cuda()));
  if (rt.device().is_cuda()) BOOST_TEST(rt.device().index() == rt.local_rank());
}

BOOST_AUTO_TEST_CASE(runtime_reports_blas) {
  const std::string blas = spmd::runtime().blas_library();
  BOOST_TEST_MESSAGE("BLAS: " << blas);
  BOOST_TEST(blas == fsdp::loaded_blas_library());
  BOOST_TEST(blas != "unknown");
  // ci/install-deps.sh installs OpenBLAS for Debian's LibTorch (pip's links
  // MKL in); the reference BLAS would make every GEMM-heavy suite ~14x slower,
  // so catch a regression here.
  const bool mkl = at::hasMKL();
  BOOST_TEST((blas.find("openblas") != std::string::npos || mkl), "loaded BLAS is " << blas);
  BOOST_TEST((blas.rfind("MKL in ", 0) == 0) == mkl, "BLAS " << blas << ", at::hasMKL() " << mkl);
}

BOOST_AUTO_TEST_CASE(second_runtime_is_rejected) {
  int argc = 0;
  char** argv = nullptr;
  BOOST_CHECK_EXCEPTION(fsdp::Runtime(&argc, &argv), fsdp::StateError,
                        [](const fsdp::StateError& e) {
                          return std::string(e.what()).find("already alive") != std::string::npos;
                        });
}
