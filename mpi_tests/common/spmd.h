// SPMD test harness for Boost.Test suites run under mpiexec/srun.
//
// Link a test executable against fsdp_spmd (which provides main()) and write
// ordinary BOOST_AUTO_TEST_CASEs; every rank runs every case. The harness:
//  - starts an fsdp::Runtime before the first case and ends it after the last;
//  - after each case, aggregates the result over MPI: a case that failed on
//    any rank fails on every rank, and rank 0's log names the failing ranks
//    and their messages;
//  - logs on rank 0 only; other ranks print their log only when they fail;
//  - arms a per-case watchdog (60 s, or $FSDP_TEST_TIMEOUT seconds) that
//    prints the case, the rank and the pending collectives, then MPI_Aborts;
//  - writes a JUnit report from rank 0 to $FSDP_JUNIT_DIR/<executable>_np<N>.xml
//    when FSDP_JUNIT_DIR is set.
#pragma once

#include <fsdp/runtime.h>

#include <boost/test/unit_test.hpp>

#include <c10/core/Device.h>

#include <string>

namespace spmd {

fsdp::Runtime& runtime();
int rank();
int world_size();
// Device the suite runs on: the Runtime's device unless $FSDP_TEST_DEVICE
// ("cpu" or "cuda") says otherwise.
c10::Device device();
// Name of the running test case.
std::string current_case();

}  // namespace spmd

// Skips the current case on every rank with a printed reason. Use only at the
// top of a case, under a condition that is the same on every rank.
#define SPMD_SKIP(reason)                                                           \
  do {                                                                              \
    BOOST_TEST_MESSAGE("SKIPPED " << spmd::current_case() << ": " << (reason));     \
    if (spmd::rank() == 0) std::cout << "SKIPPED " << spmd::current_case() << ": " \
                                     << (reason) << std::endl;                      \
    return;                                                                         \
  } while (0)
