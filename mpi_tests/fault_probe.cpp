// A user program that goes wrong on purpose, for the fault tests registered
// beside it (mpi_tests/CMakeLists.txt, label `faults`): each mode makes the
// last rank misbehave before an all-reduce the other ranks wait in, and the
// test checks how, and how fast, the job ends. Nothing here is the Boost.Test
// harness: the library's own watchdog and checks must end the job.
//
//   fault_probe stall      the last rank sleeps for an hour
//   fault_probe sigstop    the last rank stops itself (SIGSTOP)
//   fault_probe mismatch   the last rank issues an all-gather instead
//   fault_probe kill       the last rank dies of SIGKILL
//   fault_probe segv       the last rank dies of SIGSEGV
//   fault_probe unit       the last rank sleeps instead of running a
//                          fully_shard model's forward (the watchdog names
//                          the FSDP unit whose all-gather is stuck)
//   fault_probe hpz        the last rank sleeps while the others switch a
//                          sharded model to hpZ (set_reshard_after_forward(
//                          within_node()), which splits communicators)
//   fault_probe stop_stuck every rank has a fsdp::GracefulStop (stuck_seconds
//                          2); rank 0 receives SIGTERM, the last rank
//                          sleeps: the watchdog must end the job ~2 s after
//                          the signal, not at FSDP_TIMEOUT
//
// Exit status: 0 if the collective completed (a failed test), 3 if the
// library threw (printed as "fault_probe: rank R caught <type>: <what>").
#include <fsdp/comm.h>
#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/graceful_stop.h>
#include <fsdp/mesh.h>
#include <fsdp/runtime.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <chrono>
#include <csignal>
#include <iostream>
#include <string>
#include <thread>

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "stall" && mode != "sigstop" && mode != "mismatch" && mode != "kill" &&
      mode != "segv" && mode != "unit" && mode != "hpz" && mode != "stop_stuck") {
    std::cerr << "usage: fault_probe stall|sigstop|mismatch|kill|segv|unit|hpz|stop_stuck\n";
    return 2;
  }
  fsdp::RuntimeOptions options;
  options.num_threads = 1;
  fsdp::Runtime rt(&argc, &argv, options);
  const int n = rt.world_size();
  auto group = fsdp::init_device_mesh(c10::kCPU, {n}).get_group(0);
  // One collective that works first, so the fault hits a running job.
  at::Tensor t = at::ones({1024});
  group->all_reduce(t);
  const bool faulty = rt.world_rank() == n - 1;
  if (mode == "stop_stuck") {
    fsdp::GracefulStopOptions stop_options;
    stop_options.stuck_seconds = 2;
    fsdp::GracefulStop stop(stop_options);
    if (faulty) std::this_thread::sleep_for(std::chrono::hours(1));
    if (rt.world_rank() == 0) std::raise(SIGTERM);  // recorded, not fatal
    group->all_reduce(t);
    std::cerr << "fault_probe: rank " << rt.world_rank() << ": the collective completed\n";
    return 0;
  }
  if (mode == "unit") {
    torch::nn::Sequential net(torch::nn::Linear(64, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 64));
    auto model = fsdp::fully_shard(net);
    if (faulty) std::this_thread::sleep_for(std::chrono::hours(1));
    model(at::ones({4, 64})).sum().backward();
    std::cerr << "fault_probe: rank " << rt.world_rank() << ": the step completed\n";
    return 0;
  }
  if (mode == "hpz") {
    torch::nn::Sequential net(torch::nn::Linear(64, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 64));
    fsdp::FSDPModule unit = fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(net.ptr()));
    if (faulty) std::this_thread::sleep_for(std::chrono::hours(1));
    unit.set_reshard_after_forward(fsdp::ReshardAfterForward::within_node());
    std::cerr << "fault_probe: rank " << rt.world_rank() << ": switched to hpZ\n";
    return 0;
  }
  try {
    if (faulty && mode == "stall") std::this_thread::sleep_for(std::chrono::hours(1));
    if (faulty && mode == "sigstop") std::raise(SIGSTOP);
    if (faulty && mode == "kill") std::raise(SIGKILL);
    if (faulty && mode == "segv") std::raise(SIGSEGV);
    if (faulty && mode == "mismatch") {
      at::Tensor out = at::empty({1024 * n});
      group->all_gather_into_tensor(out, t);
    } else {
      group->all_reduce(t);
    }
  } catch (const fsdp::Error& e) {
    // One write per line: the ranks share the terminal.
    const std::string line = "fault_probe: rank " + std::to_string(rt.world_rank()) + " caught " +
                             (dynamic_cast<const fsdp::CommError*>(&e) ? "CommError" : "fsdp::Error") +
                             ": " + e.what() + "\n";
    std::cerr << line << std::flush;
    return 3;
  }
  std::cerr << "fault_probe: rank " << rt.world_rank() << ": the collective completed\n";
  return 0;
}
