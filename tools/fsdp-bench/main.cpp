// fsdp-bench: benchmark programs for libfsdp, run SPMD under mpiexec.
//
//   mpiexec -n 2 fsdp-bench collectives [--min-bytes 1K --max-bytes 256M ...]
//   mpiexec -n 2 fsdp-bench train [--batch 8 --steps 10 --json FILE ...]
//   mpiexec -n 2 fsdp-bench checkpoint [--dir D --params 64M ...]
//   mpiexec -n 2 fsdp-bench memory [--preset small,large --dtype fp32,bf16 --check 0.1]
#include "harness.h"

#include <iostream>

namespace {

int run(int argc, char** argv) {
  // MPI first: mpiexec may pass its own arguments, and rank 0 alone must
  // print help and parse errors.
  fsdp::Runtime rt(&argc, &argv);
  CLI::App app{"fsdp-bench: benchmarks for libfsdp; run every subcommand under mpiexec"};
  app.require_subcommand(1);
  fsdp_bench::Command chosen;
  fsdp_bench::add_collectives_command(app, chosen);
  fsdp_bench::add_train_command(app, chosen);
  fsdp_bench::add_checkpoint_command(app, chosen);
  fsdp_bench::add_memory_command(app, chosen);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Every rank parses the same argv and so fails alike; one message is enough.
    return rt.world_rank() == 0 ? app.exit(e) : e.get_exit_code();
  }
  try {
    return chosen(rt);
  } catch (const std::exception& e) {
    std::cerr << "fsdp-bench: rank " << rt.world_rank() << ": " << e.what() << std::endl;
    // The other ranks may be blocked in a collective this rank will never join.
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // the Runtime could not start
    std::cerr << "fsdp-bench: " << e.what() << std::endl;
    return 1;
  }
}
