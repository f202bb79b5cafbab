// L0: the Runtime's view of the job (all ranks of a CTest run share one node).
#include "spmd.h"

#include <fsdp/errors.h>
#include <fsdp/runtime.h>

#include "runtime/device_binding.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/cuda.h>

#include <mpi.h>

BOOST_AUTO_TEST_CASE(runtime_topology) {  // [ours]
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

BOOST_AUTO_TEST_CASE(runtime_threads_and_device) {  // [ours]
  fsdp::Runtime& rt = spmd::runtime();
  // The harness asks for one thread per rank (ranks share the cores).
  BOOST_TEST(rt.num_threads() == 1);
  BOOST_TEST(at::get_num_threads() == 1);
  BOOST_TEST((rt.device().is_cpu() || rt.device().is_cuda()));
  if (rt.device().is_cuda()) {
    // With one visible GPU per rank (per-task binding) that is cuda:0.
    const auto visible = static_cast<int>(torch::cuda::device_count());
    BOOST_TEST(rt.device().index() == rt.local_rank() % visible);
    BOOST_TEST(c10::impl::VirtualGuardImpl(c10::kCUDA).getDevice() == rt.device(),
               "the Runtime's device is the current CUDA device");
  }
}

// The device rules, on the node facts a GPU machine would give (no GPU
// needed): choice by local rank, per-task binding, a shared GPU refused.
BOOST_AUTO_TEST_CASE(device_binding_rules) {  // [ours]
  using fsdp::detail::DeviceRequest;
  using fsdp::detail::choose_device;
  const c10::Device cpu(c10::kCPU);
  BOOST_TEST(choose_device(DeviceRequest::Auto, 3, 0) == cpu);
  BOOST_TEST(choose_device(DeviceRequest::Cpu, 3, 4) == cpu);
  BOOST_TEST(choose_device(DeviceRequest::Auto, 3, 4) == c10::Device(c10::kCUDA, 3));
  BOOST_TEST(choose_device(DeviceRequest::Cuda, 5, 4) == c10::Device(c10::kCUDA, 1));
  // Per-task binding: every rank sees its own GPU as the only one.
  BOOST_TEST(choose_device(DeviceRequest::Auto, 2, 1) == c10::Device(c10::kCUDA, 0));
  BOOST_CHECK_EXCEPTION(choose_device(DeviceRequest::Cuda, 0, 0), fsdp::StateError,
                        [](const fsdp::StateError& e) {
                          return std::string(e.what()).find("sees no CUDA device") !=
                                 std::string::npos;
                        });
  BOOST_TEST((fsdp::detail::parse_device_request("cuda", "FSDP_DEVICE") == DeviceRequest::Cuda));
  BOOST_TEST((fsdp::detail::parse_device_request("cpu", "FSDP_DEVICE") == DeviceRequest::Cpu));
  BOOST_CHECK_EXCEPTION(fsdp::detail::parse_device_request("gpu", "FSDP_DEVICE"),
                        fsdp::ArgumentError, [](const fsdp::ArgumentError& e) {
                          return e.argument() == "FSDP_DEVICE" &&
                                 std::string(e.what()).find("accepted: auto, cpu, cuda") !=
                                     std::string::npos;
                        });

  using fsdp::detail::shared_gpu_error;
  BOOST_TEST(shared_gpu_error({"0000:01:00.0", "0000:02:00.0"}, 2).empty());
  BOOST_TEST(shared_gpu_error({"0000:01:00.0", "0000:02:00.0", "0000:03:00.0"}, 1).empty(),
             "per-task binding: one visible GPU each, all different");
  // 4 ranks, 2 GPUs: local ranks 0 and 2 land on cuda:0.
  const std::string shared =
      shared_gpu_error({"0000:01:00.0", "0000:02:00.0", "0000:01:00.0", "0000:02:00.0"}, 2);
  BOOST_TEST(shared.find("local ranks 0 and 2 would share GPU 0000:01:00.0") != std::string::npos,
             shared);
  BOOST_TEST(shared.find("4 ranks on this node, 2 visible CUDA device(s)") != std::string::npos,
             shared);
  BOOST_TEST(shared.find("FSDP_DEVICE=cpu") != std::string::npos, shared);
}

BOOST_AUTO_TEST_CASE(runtime_reports_blas) {  // [ours]
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

BOOST_AUTO_TEST_CASE(second_runtime_is_rejected) {  // [ours]
  int argc = 0;
  char** argv = nullptr;
  BOOST_CHECK_EXCEPTION(fsdp::Runtime(&argc, &argv), fsdp::StateError,
                        [](const fsdp::StateError& e) {
                          return std::string(e.what()).find("already alive") != std::string::npos;
                        });
}
