// A user program that runs out of memory on purpose, for the out-of-memory
// tests registered beside it (mpi_tests/CMakeLists.txt, label `faults`):
// a per-process budget of the tracking allocator (fsdp::set_memory_budget)
// makes fully_shard's first all-gather output allocation fail, on the last
// rank only or on every rank. libfsdp must throw fsdp::OutOfMemoryError there
// (unit, op, bytes), and the job must end -- every other rank told why by its
// watchdog -- instead of hanging in the all-gather.
//
//   memory_probe oom-one   the last rank's budget is exhausted
//   memory_probe oom-all   every rank's budget is exhausted
//
// Exit status: 0 if the step completed (a failed test); otherwise the job is
// ended by MPI_Abort (libfsdp's watchdog, or the Runtime's destructor on the
// failing rank), status 124. The catching rank prints
// "memory_probe: rank R caught OutOfMemoryError: unit '...', op ..., requested N B, held M B: <what>".
#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/memory.h>
#include <fsdp/runtime.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <iostream>
#include <string>

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "oom-one" && mode != "oom-all") {
    std::cerr << "usage: memory_probe oom-one|oom-all\n";
    return 2;
  }
  fsdp::install_memory_tracking();
  fsdp::RuntimeOptions options;
  options.num_threads = 1;
  fsdp::Runtime rt(&argc, &argv, options);
  const int n = rt.world_size();
  torch::nn::Sequential net(torch::nn::Linear(64, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64));
  auto model = fsdp::fully_shard(net);
  const at::Tensor x = at::ones({4, 64});
  const bool starved = mode == "oom-all" || rt.world_rank() == n - 1;
  // 1 KiB above what is live now: the first all-gather output (a 64x64
  // fp32 weight, 16 KiB) cannot be allocated. FSDP_SHM_BYTES=0 (set by the
  // test) keeps the collective buffers in LibTorch's allocator.
  if (starved) fsdp::set_memory_budget(fsdp::tracked_live_bytes() + 1024);
  try {
    model(x).sum().backward();
  } catch (const fsdp::OutOfMemoryError& e) {
    const std::string line = "memory_probe: rank " + std::to_string(rt.world_rank()) +
                             " caught OutOfMemoryError: unit '" + e.unit() + "', op " + e.op() +
                             ", requested " + std::to_string(e.bytes_requested()) + " B, held " +
                             std::to_string(e.bytes_held()) + " B: " + e.what() + "\n";
    std::cerr << line << std::flush;
    fsdp::set_memory_budget(0);
    return 3;  // the Runtime's destructor ends the job (the others cannot finish)
  }
  std::cerr << "memory_probe: rank " << rt.world_rank() << ": the step completed\n";
  return 0;
}
