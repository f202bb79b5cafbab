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

#include <functional>
#include <map>
#include <string>
#include <vector>

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

// Pieces of device_binding_follows_slurm, one function per srun layout.
namespace {
namespace slurm_binding {

using fsdp::detail::DeviceRequest;
using fsdp::detail::explain_device_choice;
using fsdp::detail::read_slurm_gpu_facts;
using Env = std::map<std::string, std::string>;
const c10::Device cpu(c10::kCPU);

c10::Device cuda(int i) { return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)); }

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// What srun puts in every task's environment for a 1-node, 4-task step.
Env slurm_task(int local_id) {
  return Env{{"SLURM_JOB_ID", "4242"},         {"SLURM_STEP_ID", "0"},
             {"SLURM_LOCALID", std::to_string(local_id)}, {"SLURM_NTASKS_PER_NODE", "4"},
             {"SLURM_TASKS_PER_NODE", "4"}};
}

// A BOOST_CHECK_EXCEPTION predicate: the StateError names every part.
std::function<bool(const fsdp::StateError&)> state_error_with(std::vector<std::string> parts) {
  return [parts](const fsdp::StateError& e) {
    const std::string what = e.what();
    bool all = true;
    for (const auto& part : parts) {
      if (what.find(part) == std::string::npos) {
        BOOST_TEST_MESSAGE("missing '" << part << "' in: " << what);
        all = false;
      }
    }
    return all;
  };
}

// (1) srun --ntasks-per-node=4 --gpus-per-task=1: each task sees its own
// GPU as the only one, so every rank is cuda:0.
void check_per_task_binding() {
  for (int r = 0; r < 4; ++r) {
    Env env = slurm_task(r);
    env["CUDA_VISIBLE_DEVICES"] = std::to_string(r);
    env["SLURM_GPUS_PER_TASK"] = "1";
    env["SLURM_GPUS_ON_NODE"] = "4";
    env["SLURM_STEP_GPUS"] = "0,1,2,3";
    const auto facts = read_slurm_gpu_facts(env);
    BOOST_TEST(facts.under_slurm);
    BOOST_TEST(facts.visible_count == 1);
    BOOST_TEST(facts.local_id == r);
    BOOST_TEST(facts.gpus_per_task == 1);
    BOOST_TEST(facts.malformed.empty());
    for (const auto request : {DeviceRequest::Auto, DeviceRequest::Cuda}) {
      const auto choice = explain_device_choice(request, r, 4, 1, facts);
      BOOST_TEST(choice.device == cuda(0));
      const std::string expected = "cuda:0 (Slurm per-task binding: CUDA_VISIBLE_DEVICES=" +
                                   std::to_string(r) + ", 1 GPU per task";
      BOOST_TEST(choice.description.rfind(expected, 0) == 0, choice.description);
      BOOST_TEST(!has(choice.description, "SLURM_LOCALID"), choice.description);
    }
  }
  // Per-task binding read from SLURM_GPUS_ON_NODE alone (--gpu-bind set by
  // the site): 1 of 4 visible, still per-task, and no error for 4 ranks.
  {
    Env env = slurm_task(3);
    env["CUDA_VISIBLE_DEVICES"] = "3";
    env["SLURM_GPUS_ON_NODE"] = "4";
    const auto choice = explain_device_choice(DeviceRequest::Cuda, 3, 4, 1,
                                              read_slurm_gpu_facts(env));
    BOOST_TEST(choice.device == cuda(0));
    BOOST_TEST(has(choice.description, "per-task binding"), choice.description);
    BOOST_TEST(has(choice.description, "of the node's 4"), choice.description);
  }
}

// (2) --gpus-per-node=4 --ntasks-per-node=4: every task sees the node's
// 4 GPUs, rank r takes cuda:r.
void check_node_gpus_shared() {
  for (int r = 0; r < 4; ++r) {
    Env env = slurm_task(r);
    env["CUDA_VISIBLE_DEVICES"] = "0,1,2,3";
    env["SLURM_GPUS_ON_NODE"] = "4";
    env["SLURM_STEP_GPUS"] = "0,1,2,3";
    const auto facts = read_slurm_gpu_facts(env);
    BOOST_TEST(facts.visible_count == 4);
    const auto choice = explain_device_choice(DeviceRequest::Auto, r, 4, 4, facts);
    BOOST_TEST(choice.device == cuda(r));
    const std::string expected = "cuda:" + std::to_string(r) +
                                 " (node's 4 GPUs shared by 4 local ranks, local rank " +
                                 std::to_string(r) + ", CUDA_VISIBLE_DEVICES=0,1,2,3)";
    BOOST_TEST(choice.description == expected);
  }
  // The same with GPU UUIDs instead of indices.
  {
    Env env = slurm_task(1);
    env["CUDA_VISIBLE_DEVICES"] = "GPU-8f6a1c2e-aaaa-bbbb-cccc-0123456789ab,"
                                  "GPU-11111111-2222-3333-4444-555555555555";
    const auto facts = read_slurm_gpu_facts(env);
    BOOST_TEST(facts.visible_count == 2);
    BOOST_TEST(facts.malformed.empty());
    BOOST_TEST(explain_device_choice(DeviceRequest::Cuda, 1, 2, 2, facts).device == cuda(1));
  }
}

// (3) --ntasks-per-node=4 --gpus-per-task=2: each task its own 2 GPUs,
// rank r takes the task's GPU r % 2; 4 ranks > 2 GPUs is no error here.
void check_gpus_per_task() {
  for (int r = 0; r < 4; ++r) {
    Env env = slurm_task(r);
    env["CUDA_VISIBLE_DEVICES"] = std::to_string(2 * r) + "," + std::to_string(2 * r + 1);
    env["SLURM_GPUS_PER_TASK"] = "2";
    env["SLURM_GPUS_ON_NODE"] = "8";
    const auto facts = read_slurm_gpu_facts(env);
    const auto choice = explain_device_choice(DeviceRequest::Cuda, r, 4, 2, facts);
    BOOST_TEST(choice.device == cuda(r % 2));
    BOOST_TEST(choice.device == fsdp::detail::choose_device(DeviceRequest::Cuda, r, 2));
    BOOST_TEST(has(choice.description, "Slurm per-task binding: CUDA_VISIBLE_DEVICES=" +
                                           env["CUDA_VISIBLE_DEVICES"] + ", 2 GPUs per task"),
               choice.description);
    BOOST_TEST(has(choice.description, "local rank " + std::to_string(r) + " % 2") == (r >= 2),
               choice.description);
  }
  // "[type:]<n>" as --gpus-per-task=a100:2 gives it.
  {
    Env env = slurm_task(0);
    env["SLURM_GPUS_PER_TASK"] = "a100:2";
    BOOST_TEST(read_slurm_gpu_facts(env).gpus_per_task == 2);
  }
}

// (4) Slurm gave the task no GPU: unset, empty or NoDevFiles, LibTorch
// sees 0. Auto falls back to the CPU; cuda is refused with the fix.
void check_no_gpu_given() {
  for (const char* visible : {"<unset>", "", "NoDevFiles"}) {
    Env env = slurm_task(0);
    if (std::string(visible) != "<unset>") env["CUDA_VISIBLE_DEVICES"] = visible;
    const auto facts = read_slurm_gpu_facts(env);
    BOOST_TEST(facts.visible_count == (std::string(visible) == "<unset>" ? -1 : 0));
    const auto choice = explain_device_choice(DeviceRequest::Auto, 0, 4, 0, facts);
    BOOST_TEST(choice.device == cpu);
    BOOST_TEST(choice.description.rfind("cpu (Slurm gave this task no GPU", 0) == 0,
               choice.description);
    BOOST_TEST(explain_device_choice(DeviceRequest::Cpu, 0, 4, 0, facts).device == cpu);
    BOOST_CHECK_EXCEPTION(
        explain_device_choice(DeviceRequest::Cuda, 0, 4, 0, facts), fsdp::StateError,
        state_error_with({"Slurm gave this task no GPU", "srun --gpus-per-task=1",
                          "--gres=gpu:<n>"}));
  }
  // A list Slurm gave but LibTorch cannot use (CPU-only build): no
  // "no GPU" claim, the message points at LibTorch / the driver.
  {
    Env env = slurm_task(0);
    env["CUDA_VISIBLE_DEVICES"] = "0";
    const auto facts = read_slurm_gpu_facts(env);
    BOOST_CHECK_EXCEPTION(explain_device_choice(DeviceRequest::Cuda, 0, 1, 0, facts),
                          fsdp::StateError,
                          state_error_with({"LibTorch sees no CUDA device", "CPU-only"}));
    BOOST_TEST(explain_device_choice(DeviceRequest::Auto, 0, 1, 0, facts).description ==
               "cpu (no CUDA device visible to LibTorch, CUDA_VISIBLE_DEVICES=0)");
  }
}

// (5) --gpus-per-node=2 --ntasks-per-node=4: 4 ranks on one node-wide
// list of 2 GPUs would share them: refused on every rank, for auto too.
void check_gpus_shared_too_widely() {
  for (int r = 0; r < 4; ++r) {
    Env env = slurm_task(r);
    env["CUDA_VISIBLE_DEVICES"] = "0,1";
    env["SLURM_GPUS_ON_NODE"] = "2";
    env["SLURM_STEP_GPUS"] = "0,1";
    const auto facts = read_slurm_gpu_facts(env);
    for (const auto request : {DeviceRequest::Auto, DeviceRequest::Cuda}) {
      BOOST_CHECK_EXCEPTION(
          explain_device_choice(request, r, 4, 2, facts), fsdp::StateError,
          state_error_with({"4 ranks on this node but each sees the same 2 GPUs",
                            "CUDA_VISIBLE_DEVICES=0,1", "--gpus-per-task=1",
                            "at most 2 tasks per node", "--ntasks-per-node, now 4"}));
    }
    BOOST_TEST(explain_device_choice(DeviceRequest::Cpu, r, 4, 2, facts).device == cpu);
    // As many ranks as GPUs is fine.
    BOOST_TEST(explain_device_choice(DeviceRequest::Cuda, r % 2, 2, 2, facts).device ==
               cuda(r % 2));
  }
}

// (6) Not under Slurm: the same devices as choose_device, never a Slurm
// error (4 ranks on 2 GPUs is left to the PCI-id check).
void check_not_under_slurm() {
  {
    const auto none = read_slurm_gpu_facts(Env{});
    BOOST_TEST(!none.under_slurm);
    BOOST_TEST(!none.visible_set);
    for (const auto request : {DeviceRequest::Auto, DeviceRequest::Cpu, DeviceRequest::Cuda}) {
      for (const int count : {0, 1, 2, 4}) {
        for (int r = 0; r < 4; ++r) {
          if (request == DeviceRequest::Cuda && count == 0) continue;
          const auto choice = explain_device_choice(request, r, 4, count, none);
          BOOST_TEST(choice.device == fsdp::detail::choose_device(request, r, count));
          BOOST_TEST(choice.description.rfind(choice.device.str() + " (", 0) == 0,
                     choice.description);
          BOOST_TEST(!has(choice.description, "Slurm"), choice.description);
        }
      }
    }
    BOOST_TEST(explain_device_choice(DeviceRequest::Auto, 2, 4, 4, none).description ==
               "cuda:2 (node's 4 GPUs shared by 4 local ranks, local rank 2)");
    BOOST_TEST(explain_device_choice(DeviceRequest::Auto, 0, 1, 0, none).description ==
               "cpu (no CUDA device visible)");
    BOOST_CHECK_EXCEPTION(explain_device_choice(DeviceRequest::Cuda, 0, 1, 0, none),
                          fsdp::StateError, state_error_with({"sees no CUDA device"}));
    // A user's CUDA_VISIBLE_DEVICES without Slurm is described, not judged.
    const auto user = read_slurm_gpu_facts(Env{{"CUDA_VISIBLE_DEVICES", "1"}});
    BOOST_TEST(!user.under_slurm);
    BOOST_TEST(explain_device_choice(DeviceRequest::Cuda, 3, 4, 1, user).description ==
               "cuda:0 (1 visible GPU, 4 local ranks (one GPU each only if every rank sees a "
               "different one), CUDA_VISIBLE_DEVICES=1)");
  }
}

// (7) SLURM_LOCALID differs from the MPI local rank (e.g. an MPI launcher
// inside the allocation): MPI's rank decides, the description says so.
void check_localid_differs() {
  {
    Env env = slurm_task(3);
    env["CUDA_VISIBLE_DEVICES"] = "0,1,2,3";
    const auto choice = explain_device_choice(DeviceRequest::Cuda, 1, 4, 4,
                                              read_slurm_gpu_facts(env));
    BOOST_TEST(choice.device == cuda(1));
    BOOST_TEST(has(choice.description,
                   "SLURM_LOCALID=3 differs from MPI local rank 1 (the MPI node split is used)"),
               choice.description);
  }
}

// (8) Malformed values never throw: a Slurm number that does not parse is
// unknown and named in the description; CUDA_VISIBLE_DEVICES is read as
// CUDA reads it (the entries before the first invalid one), so ",," hides
// every GPU.
void check_malformed_values() {
  {
    Env env = slurm_task(0);
    env["SLURM_LOCALID"] = "abc";
    env["SLURM_GPUS_PER_TASK"] = "-1";
    env["SLURM_GPUS_ON_NODE"] = "99999999999999";
    env["CUDA_VISIBLE_DEVICES"] = "0,1,2,3";
    const auto facts = read_slurm_gpu_facts(env);
    BOOST_TEST(facts.local_id == -1);
    BOOST_TEST(facts.gpus_per_task == -1);
    BOOST_TEST(facts.gpus_on_node == -1);
    BOOST_TEST(facts.malformed.size() == 3u);
    const auto choice = explain_device_choice(DeviceRequest::Auto, 2, 4, 4, facts);
    BOOST_TEST(choice.device == cuda(2));
    BOOST_TEST(has(choice.description, "ignored malformed SLURM_LOCALID='abc'"),
               choice.description);
    BOOST_TEST(has(choice.description, "ignored malformed SLURM_GPUS_PER_TASK='-1'"),
               choice.description);
    BOOST_TEST(!has(choice.description, "differs from MPI local rank"), choice.description);
  }
  {
    Env env = slurm_task(0);
    env["CUDA_VISIBLE_DEVICES"] = ",,";
    const auto facts = read_slurm_gpu_facts(env);
    BOOST_TEST(facts.visible_count == 0);
    BOOST_TEST(facts.no_gpu_given());
    const auto choice = explain_device_choice(DeviceRequest::Auto, 0, 1, 0, facts);
    BOOST_TEST(choice.device == cpu);
    BOOST_TEST(has(choice.description, "ignored malformed CUDA_VISIBLE_DEVICES=',,'"),
               choice.description);
    BOOST_CHECK_EXCEPTION(explain_device_choice(DeviceRequest::Cuda, 0, 1, 0, facts),
                          fsdp::StateError,
                          state_error_with({"Slurm gave this task no GPU",
                                            "CUDA_VISIBLE_DEVICES=,,", "--gpus-per-task=1"}));
    // CUDA stops at the first invalid entry: "0,2,-1,1" shows 2 GPUs.
    BOOST_TEST(read_slurm_gpu_facts(Env{{"CUDA_VISIBLE_DEVICES", "0,2,-1,1"}}).visible_count ==
               2);
    BOOST_TEST(read_slurm_gpu_facts(Env{{"CUDA_VISIBLE_DEVICES", " 0, 1 "}}).visible_count == 2);
  }
}

}  // namespace slurm_binding
}  // namespace

// The device choice under Slurm, on environments exactly as srun sets them
// (no GPU needed): per-task binding, shared node GPUs, no GPU, and the
// mistakes refused with the srun option that fixes them.
BOOST_AUTO_TEST_CASE(device_binding_follows_slurm) {  // [ours]
  slurm_binding::check_per_task_binding();
  slurm_binding::check_node_gpus_shared();
  slurm_binding::check_gpus_per_task();
  slurm_binding::check_no_gpu_given();
  slurm_binding::check_gpus_shared_too_widely();
  slurm_binding::check_not_under_slurm();
  slurm_binding::check_localid_differs();
  slurm_binding::check_malformed_values();
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
