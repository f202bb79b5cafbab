// L0: async collectives make progress while the caller computes.
//
// Two proofs. (1) Wall time: a large async all_reduce overlapped with a
// compute loop finishes in less than the collective alone plus the compute
// alone. (2) Independent progress: rank 0 issues an async all_reduce and then
// computes without touching MPI; rank 1's blocking all_reduce must complete
// long before rank 0's compute ends -- only a communication thread inside MPI
// can make that happen.
//
// The collectives and the compute run on the suite's device (spmd::device()):
// on the cpu entries over MPI on the host, on the gpu entry over NCCL on the
// GPU, where (2) shows NCCL's kernels finishing while rank 0's host only
// drives its own compute. A CUDA call returns before the GPU has run it, so
// every time is read after settle() (a device synchronize; nothing on the
// CPU). The ranks' bookkeeping (max_over_ranks, the result exchange) stays
// on CPU tensors, over MPI.
#include "raw_mpi.h"
#include "spmd.h"

#include <fsdp/comm.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <chrono>
#include <iostream>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;

// float32 on the suite's device.
at::TensorOptions on_device() { return at::TensorOptions(at::kFloat).device(spmd::device()); }

// Waits until the suite's device has run everything queued on it (CUDA
// collectives and kernels return to the host before they ran); no-op on CPU.
void settle() {
  if (spmd::device().is_cuda()) torch::cuda::synchronize(spmd::device().index());
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Deterministic work on the suite's device that never calls MPI or the
// library (on CUDA each round's item() waits for that round's kernels).
double compute_for(int rounds) {
  auto a = at::ones({256, 256}, on_device());
  double acc = 0;
  for (int i = 0; i < rounds; ++i) {
    a = at::tanh(at::mm(a, a) * 1e-3);
    acc += a[0][0].item<float>();
  }
  return acc;
}

// Seconds of the slowest rank (both ranks must agree on the verdict). Ranks
// with nothing to do wait here by sleeping in short steps rather than
// spinning inside MPI, so they leave the cores to rank 0's compute.
double max_over_ranks(double t) {
  auto group = fsdp::world_group();
  auto token = at::zeros({1}, at::kInt);
  if (group->rank() == 0) {
    for (int r = 1; r < group->size(); ++r) group->send(token, r, 99);
  } else {
    auto work = group->recv(token, 0, 99, /*async_op=*/true);
    while (!work->is_completed()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return raw_mpi::max_over_ranks(t);
}

}  // namespace

// Rank 0 overlaps a 128 MiB all_reduce with compute. The other ranks stand
// in for peers on other nodes: they sleep through a quarter of rank 0's compute
// and then join the collective, so their CPU time does not compete with rank
// 0's on this 2-core machine (an in-memory collective is itself CPU work; if
// every local rank computed too, no schedule could beat the sum). With real
// progress the transfer runs during rank 0's compute, and rank 0 finishes in
// about max(compute, quarter + collective) instead of compute + collective. The
// suite runs unbound (--bind-to none): bound to one core, rank 0's comm
// thread, spinning inside MPI while it waits for the peers, would take that
// core from the compute.
// Labelled "perf": on a shared 2-core VM its timing margin (~15-20%) is
// within the noise often enough to fail now and then, so CI's `cpu` run
// skips it; `ctest -L perf` runs it (see mpi_tests/CMakeLists.txt).
BOOST_AUTO_TEST_CASE(async_all_reduce_overlaps_compute, *boost::unit_test::label("perf")) {  // [ours]
  auto group = fsdp::world_group();
  auto big = at::ones({32 * 1024 * 1024}, on_device());  // 128 MiB
  const bool computes = spmd::rank() == 0;

  // Calibrate rank 0's compute loop to about three times the collective, so
  // the transfer (slowed while it shares the cores with the compute) fits
  // inside the compute even though the peers join late.
  compute_for(2);  // warm-up
  auto t0 = Clock::now();
  compute_for(10);
  const double per_round = max_over_ranks(seconds_since(t0)) / 10;
  group->all_reduce(big);
  settle();
  group->barrier();
  t0 = Clock::now();
  group->all_reduce(big);
  settle();
  const int rounds =
      std::max(4, static_cast<int>(3 * max_over_ranks(seconds_since(t0)) / per_round));

  // Each timing is the best over the attempts, all sides alike: the VM is
  // shared and noisy, and we compare what each schedule can achieve. Stop
  // early once three attempts showed it; give up after eight.
  double comm_alone = 1e30, compute_alone = 1e30, overlapped = 1e30;
  for (int attempt = 0; attempt < 8; ++attempt) {
    if (attempt >= 3 && overlapped < comm_alone + compute_alone) break;
    group->barrier();
    t0 = Clock::now();
    group->all_reduce(big);
    settle();
    comm_alone = std::min(comm_alone, max_over_ranks(seconds_since(t0)));

    group->barrier();
    t0 = Clock::now();
    if (computes) compute_for(rounds);
    settle();
    compute_alone = std::min(compute_alone, max_over_ranks(seconds_since(t0)));

    big.fill_(1.0f);
    settle();
    group->barrier();
    t0 = Clock::now();
    if (computes) {
      auto work = group->all_reduce(big, fsdp::ReduceOp::SUM, /*async_op=*/true);
      compute_for(rounds);
      work->wait();
    } else {
      std::this_thread::sleep_for(std::chrono::duration<double>(compute_alone / 4));
      group->all_reduce(big);
    }
    settle();
    overlapped = std::min(overlapped, max_over_ranks(seconds_since(t0)));
    BOOST_TEST(big[12345].item<float>() == static_cast<float>(spmd::world_size()));
  }

  if (spmd::rank() == 0) {
    std::cout << "overlap: all_reduce 128 MiB alone " << comm_alone << " s, rank 0 compute alone "
              << compute_alone << " s, sum " << comm_alone + compute_alone
              << " s, overlapped (peers join a quarter in) " << overlapped << " s" << std::endl;
  }
  BOOST_TEST(overlapped < comm_alone + compute_alone);
}

BOOST_AUTO_TEST_CASE(async_collective_progresses_without_caller) {  // [ours]
  auto group = fsdp::world_group();
  auto buf = at::ones({1024}, on_device());
  group->barrier();
  double peer_wait = 0, compute_time = 0;
  if (spmd::rank() == 0) {
    auto t0 = Clock::now();
    auto work = group->all_reduce(buf, fsdp::ReduceOp::SUM, /*async_op=*/true);
    // Busy long enough that a rank-1 wait tied to our next MPI call would show.
    while (seconds_since(t0) < 2.0) compute_for(1);
    compute_time = seconds_since(t0);
    BOOST_TEST(work->is_completed());
    work->wait();
  } else {
    auto t0 = Clock::now();
    group->all_reduce(buf);
    settle();  // on CUDA: until the result is in `buf`, not just queued
    peer_wait = seconds_since(t0);
  }
  auto times = at::tensor({peer_wait, compute_time}, at::kDouble);
  group->all_reduce(times, fsdp::ReduceOp::MAX);
  const double peer = times[0].item<double>(), compute = times[1].item<double>();
  if (spmd::rank() == 0) {
    std::cout << "progress: rank 0 computed " << compute << " s without calling MPI; the other "
              << "ranks' blocking all_reduce took at most " << peer << " s" << std::endl;
  }
  BOOST_TEST(peer < 0.5 * compute);
  BOOST_TEST(buf[0].item<float>() == static_cast<float>(spmd::world_size()));
}
