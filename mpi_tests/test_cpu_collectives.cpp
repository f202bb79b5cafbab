// L0: libfsdp's own CPU collective algorithms (ring, pairwise, shm; fsdp/comm.h
// CpuCollectives) against references computed from every rank's input.
//
// The inputs are exchanged with a raw MPI_Allgather on a private duplicate
// of MPI_COMM_WORLD, never through libfsdp. Each result is checked three
// ways:
//   - against the sum (or max) in double: within the accumulation type's
//     rounding bound, and for 16-bit types at 2 ranks exactly rounded;
//   - bitwise against the documented reduction order, computed here with
//     plain ATen ops: pairwise and shm sum ranks 0, 1, ..., N-1 in order, ring
//     sums block b from rank b+1 round to rank b, both in float32 for
//     16-bit types, AVG dividing there, with one final rounding;
//   - rerun bitwise identical, and for all-reduce the same bits on every
//     rank.
// Sizes: tiny (fewer elements than ranks for all-reduce), uneven, and past
// the pairwise chunk (256 KiB per peer); groups: the world, and at 4 ranks
// both dims of a 2x2 mesh. Runs at np 2, 3 (no power-of-two assumption)
// and 4. Shared-memory barriers count epochs in 32 bits from just below the
// wrap, so every shm case here runs across it.
#include "cpu_collectives_util.h"
#include "spmd.h"

#include <fsdp/comm.h>
#include <fsdp/errors.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>

#include <mpi.h>

#include <chrono>
#include <cstdlib>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

namespace {

using cpu_coll::acc_of, cpu_coll::error_ratio, cpu_coll::fold, cpu_coll::g_ref_comm,
    cpu_coll::gather_world, cpu_coll::group_rows, cpu_coll::input, cpu_coll::kAllTypes,
    cpu_coll::kBlocks, cpu_coll::KeepSettings, cpu_coll::ReferenceComm, cpu_coll::use;
using fsdp::CpuAlgorithm;
using fsdp::ProcessGroupPtr;
using fsdp::ReduceOp;

BOOST_TEST_GLOBAL_FIXTURE(ReferenceComm);

// The documented order of block `b` of n for the algorithm.
std::vector<int64_t> order_of(CpuAlgorithm a, int64_t b, int64_t n) {
  std::vector<int64_t> order;
  for (int64_t k = 0; k < n; ++k) order.push_back(a == CpuAlgorithm::Ring ? (b + 1 + k) % n : k);
  return order;
}

// libfsdp's own algorithms. Shm reduces in pairwise's order (same bits).
const std::vector<CpuAlgorithm> kOwnAlgorithms{CpuAlgorithm::Ring, CpuAlgorithm::Pairwise,
                                               CpuAlgorithm::Shm};
const std::vector<c10::ScalarType> kFloatTypes{at::kFloat, at::kDouble, at::kBFloat16, at::kHalf};

std::vector<ProcessGroupPtr> groups() {
  const int n = spmd::world_size();
  std::vector<ProcessGroupPtr> out{fsdp::world_group()};
  if (n == 4) {
    auto mesh = fsdp::init_device_mesh(c10::kCPU, {2, 2}, {"a", "b"});
    out.push_back(mesh.get_group("a"));
    out.push_back(mesh.get_group("b"));
  }
  return out;
}

std::string what(CpuAlgorithm a, const char* op, c10::ScalarType t, int64_t block,
                 const ProcessGroupPtr& g, ReduceOp r) {
  return std::string(op) + " " + fsdp::to_string(a) + " " + c10::toString(t) + " block " +
         std::to_string(block) + " on " + g->name() + " op " + fsdp::to_string(r);
}

void check_reduce_scatter(CpuAlgorithm a, const ProcessGroupPtr& g, c10::ScalarType t,
                          int64_t block, ReduceOp op) {
  const int n = g->size();
  const at::Tensor in = input(t, block * n, static_cast<int>(block));
  at::Tensor out = at::full({block}, 99, in.options());
  use(a);
  g->reduce_scatter_tensor(out, in, op);
  const std::string label = what(a, "reduce_scatter", t, block, g, op);
  const at::Tensor rows = group_rows(gather_world(in), g).view({n, n, block});
  const at::Tensor mine = rows.select(1, g->rank());  // [n, block]: every rank's share of my block
  BOOST_TEST(error_ratio(out, mine, op) <= 1.0, label);
  const at::Tensor want = fold(mine, order_of(a, g->rank(), n), op);
  BOOST_TEST(at::equal(out, want), label << ": not the documented reduction order");
  if (n == 2 && acc_of(t) != t && op == ReduceOp::SUM) {
    BOOST_TEST(at::equal(out, mine.to(at::kDouble).sum(0).to(t)), label << ": not exactly rounded");
  }
  at::Tensor again = at::empty_like(out);
  g->reduce_scatter_tensor(again, in, op);
  BOOST_TEST(at::equal(out, again), label << ": rerun differs");
}

// in_place: the input is this rank's block of the output (as fully_shard
// gathers), which the algorithm must neither copy over nor skip sending.
void check_all_gather(CpuAlgorithm a, const ProcessGroupPtr& g, c10::ScalarType t, int64_t block,
                      bool in_place) {
  const int n = g->size();
  const at::Tensor in = input(t, block, static_cast<int>(block));
  at::Tensor out = at::full({block * n}, 99, in.options());
  use(a);
  if (in_place) {
    const at::Tensor mine = out.narrow(0, g->rank() * block, block);
    mine.copy_(in);
    g->all_gather_into_tensor(out, mine);
  } else {
    g->all_gather_into_tensor(out, in);
  }
  const at::Tensor want = group_rows(gather_world(in), g).reshape({-1});
  BOOST_TEST(at::equal(out, want), what(a, "all_gather", t, block, g, ReduceOp::SUM)
                                       << (in_place ? " in place" : ""));
}

void check_all_reduce(CpuAlgorithm a, const ProcessGroupPtr& g, c10::ScalarType t, int64_t numel,
                      ReduceOp op) {
  const int n = g->size();
  const at::Tensor in = input(t, numel, static_cast<int>(numel) + 3);
  at::Tensor got = in.clone();
  use(a);
  g->all_reduce(got, op);
  const std::string label = what(a, "all_reduce", t, numel, g, op);
  const at::Tensor rows = group_rows(gather_world(in), g);
  BOOST_TEST(error_ratio(got, rows, op) <= 1.0, label);
  // Blocks of numel / n, the first numel % n one longer, each reduced in its
  // algorithm's order.
  std::vector<at::Tensor> parts;
  int64_t at = 0;
  for (int b = 0; b < n; ++b) {
    const int64_t c = numel / n + (b < numel % n ? 1 : 0);
    parts.push_back(fold(rows.narrow(1, at, c), order_of(a, b, n), op));
    at += c;
  }
  BOOST_TEST(at::equal(got, at::cat(parts)), label << ": not the documented reduction order");
  // The same bits on every rank of the group.
  const at::Tensor everyone = group_rows(gather_world(got), g);
  BOOST_TEST(at::equal(everyone, got.unsqueeze(0).expand_as(everyone)), label << ": ranks differ");
}

}  // namespace

BOOST_AUTO_TEST_CASE(reduce_scatter_every_algorithm_dtype_op_and_size) {  // [ours]
  KeepSettings keep;
  for (auto a : kOwnAlgorithms) {
    for (const auto& g : groups()) {
      for (auto t : kAllTypes) {
        for (int64_t block : kBlocks) {
          for (auto op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX}) {
            if (op == ReduceOp::AVG && !at::isFloatingType(t)) continue;  // AVG needs floats
            check_reduce_scatter(a, g, t, block, op);
          }
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(all_gather_every_algorithm_dtype_and_size) {  // [ours]
  KeepSettings keep;
  for (auto a : kOwnAlgorithms) {
    for (const auto& g : groups()) {
      for (auto t : kAllTypes) {
        for (int64_t block : kBlocks) check_all_gather(a, g, t, block, /*in_place=*/false);
      }
    }
  }
}

// Open MPI's path included (it is given MPI_IN_PLACE, since MPI forbids a
// send buffer inside the receive buffer; Open MPI happens to tolerate this
// exact overlap, so the case checks results, not the flag).
BOOST_AUTO_TEST_CASE(all_gather_in_place_every_algorithm) {  // [ours]
  KeepSettings keep;
  for (auto a : {CpuAlgorithm::Mpi, CpuAlgorithm::Ring, CpuAlgorithm::Pairwise, CpuAlgorithm::Shm}) {
    for (const auto& g : groups()) {
      for (auto t : {at::kFloat, at::kBFloat16, at::kLong}) {
        for (int64_t block : kBlocks) check_all_gather(a, g, t, block, /*in_place=*/true);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(all_gather_input_overlapping_output_elsewhere_is_refused) {  // [ours]
  const ProcessGroupPtr g = fsdp::world_group();
  const int n = g->size();
  at::Tensor out = at::zeros({4 * n}, at::kFloat);
  // Another rank's block, and one straddling two (runs at np >= 2).
  const at::Tensor other = out.narrow(0, 4 * ((g->rank() + 1) % n), 4);
  const at::Tensor straddling = out.narrow(0, 4 * g->rank() + (g->rank() + 1 < n ? 1 : -1), 4);
  for (const at::Tensor& bad : {other, straddling}) {
    try {
      g->all_gather_into_tensor(out, bad);
      BOOST_ERROR("an overlapping input was accepted");
    } catch (const fsdp::ArgumentError& e) {
      BOOST_TEST(std::string(e.what()).find("'input' overlaps 'output'") != std::string::npos,
                 e.what());
    }
  }
}

BOOST_AUTO_TEST_CASE(all_reduce_every_algorithm_dtype_op_and_uneven_size) {  // [ours]
  KeepSettings keep;
  const int64_t n = spmd::world_size();
  // Fewer elements than ranks (empty blocks), uneven, and past the chunk.
  for (auto a : kOwnAlgorithms) {
    for (const auto& g : groups()) {
      for (auto t : kAllTypes) {
        for (int64_t numel : {int64_t{1}, n + 1, 1000 * n + 1, 140001 * n + n - 1}) {
          for (auto op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX}) {
            if (op == ReduceOp::AVG && !at::isFloatingType(t)) continue;
            check_all_reduce(a, g, t, numel, op);
          }
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(max_propagates_nan) {  // [ours]
  KeepSettings keep;
  for (auto a : kOwnAlgorithms) {
    for (auto t : kFloatTypes) {
      at::Tensor x = at::zeros({8}, at::TensorOptions(t));
      if (spmd::rank() == spmd::world_size() - 1) x[3] = std::numeric_limits<double>::quiet_NaN();
      use(a);
      fsdp::world_group()->all_reduce(x, ReduceOp::MAX);
      BOOST_TEST(at::isnan(x[3]).item<bool>(), fsdp::to_string(a) << " " << c10::toString(t));
      BOOST_TEST(x.narrow(0, 0, 3).eq(0).all().item<bool>());
    }
  }
}

BOOST_AUTO_TEST_CASE(async_collectives_in_flight_together) {  // [ours]
  // Several queued on the comm thread at once, waited in reverse: each
  // keeps its own buffers and its own algorithm (chosen at issue).
  KeepSettings keep;
  const auto g = fsdp::world_group();
  const int n = g->size();
  std::vector<at::Tensor> ins, outs;
  std::vector<fsdp::WorkPtr> works;
  for (int k = 0; k < 6; ++k) {
    use(kOwnAlgorithms[static_cast<size_t>(k) % kOwnAlgorithms.size()]);
    ins.push_back(input(at::kFloat, 70001 * n, k));
    outs.push_back(at::empty({70001}, at::kFloat));
    works.push_back(g->reduce_scatter_tensor(outs.back(), ins.back(), ReduceOp::SUM, true));
  }
  for (int k = 5; k >= 0; --k) works[static_cast<size_t>(k)]->wait();
  for (int k = 0; k < 6; ++k) {
    const at::Tensor rows = gather_world(ins[static_cast<size_t>(k)]).view({n, n, 70001});
    BOOST_TEST(error_ratio(outs[static_cast<size_t>(k)], rows.select(1, g->rank()), ReduceOp::SUM) <= 1.0,
               "async #" << k);
  }
}

BOOST_AUTO_TEST_CASE(auto_switches_at_each_threshold_and_mpi_stays_available) {  // [ours]
  // Auto runs Open MPI's below a collective's pairwise threshold, pairwise
  // from it, and -- on a group with a shared-memory arena -- shm inside the
  // collective's shm band or whenever every rank's operand is in shared
  // memory. At 3+ ranks the bits tell Open MPI's from ours: pairwise and
  // shm sum 16-bit values in float32 and round once, Open MPI's op rounds
  // every partial sum (at 2 ranks both round once). Shm with a plain input
  // stages it, which the arena's peak shows.
  KeepSettings keep;
  const auto g = fsdp::world_group();
  const int n = g->size();
  const int64_t block = 5000;
  const int64_t bytes = block * 2;
  const at::Tensor in = input(at::kBFloat16, block * n, 1);
  const at::Tensor rows = gather_world(in).view({n, n, block}).select(1, g->rank());
  const at::Tensor pairwise = fold(rows, order_of(CpuAlgorithm::Pairwise, 0, n), ReduceOp::SUM);
  auto reduce_scatter_with = [&](const fsdp::CpuCollectives& s, const at::Tensor& from) {
    fsdp::set_cpu_collectives(s);
    at::Tensor out = at::empty({block}, in.options());
    fsdp::reset_shared_memory_peak();
    const int64_t before = fsdp::shared_memory_stats().in_use;
    g->reduce_scatter_tensor(out, from, ReduceOp::SUM);
    const bool staged = fsdp::shared_memory_stats().peak_in_use > before;
    return std::pair(out, staged);
  };
  // bfloat16 reduce-scatter: its pairwise threshold is half_reduce_min_bytes.
  auto settings = [](int64_t pairwise_from, int64_t shm_from, int64_t shm_below) {
    fsdp::CpuCollectives s{CpuAlgorithm::Auto, pairwise_from, pairwise_from, pairwise_from,
                           pairwise_from};
    s.all_gather_shm_min_bytes = s.reduce_scatter_shm_min_bytes = s.all_reduce_shm_min_bytes =
        shm_from;
    s.all_gather_shm_max_bytes = s.reduce_scatter_shm_max_bytes = s.all_reduce_shm_max_bytes =
        shm_below;
    return s;
  };
  const fsdp::CpuCollectives above = settings(bytes, 0, 0);      // no shm band
  const fsdp::CpuCollectives below = settings(bytes + 1, 0, 0);  // no shm band
  const fsdp::CpuCollectives in_band = settings(bytes + 1, bytes, bytes + 1);
  BOOST_TEST(error_ratio(pairwise, rows, ReduceOp::SUM) <= 1.0);
  const auto [at_threshold, staged_pairwise] = reduce_scatter_with(above, in);
  BOOST_TEST(at::equal(at_threshold, pairwise), "auto at its threshold: pairwise");
  BOOST_TEST(!staged_pairwise, "pairwise used shared memory");
  const auto [mpi, staged_mpi] = reduce_scatter_with({CpuAlgorithm::Mpi, 0, 0, 0, 0}, in);
  const auto [auto_below, staged_below] = reduce_scatter_with(below, in);
  BOOST_TEST(at::equal(auto_below, mpi), "auto below its threshold: Open MPI's");
  BOOST_TEST((!staged_mpi && !staged_below), "Open MPI's path used shared memory");
  if (n >= 3) {
    BOOST_TEST(!at::equal(mpi, pairwise), "the inputs must tell the two apart at 3+ ranks");
  }
  const auto [shm, staged_shm] = reduce_scatter_with(in_band, in);
  BOOST_TEST(at::equal(shm, pairwise), "auto inside its shm band: shm (pairwise's bits)");
  BOOST_TEST(staged_shm, "auto inside its shm band did not stage its input: not shm");
  // An input from empty_for_collectives on every rank: shm below every
  // threshold, reading it where it is.
  at::Tensor shared = g->empty_for_collectives({block * n}, in.options());
  shared.copy_(in);
  const auto [from_shared, staged_shared] = reduce_scatter_with(below, shared);
  BOOST_TEST(!staged_shared, "a shared-memory input was staged");
  if (n >= 3) {
    BOOST_TEST(at::equal(from_shared, pairwise), "shared-memory input below the thresholds: shm");
  } else {
    BOOST_TEST(at::equal(from_shared, mpi));
    BOOST_TEST_MESSAGE("at 2 ranks Open MPI's bits equal shm's: the np 3 and 4 entries tell "
                       "that a shared-memory input ran shm");
  }
  // All-gathers move bits: auto on either side agrees with Open MPI's.
  at::Tensor a = at::empty({block * n}, in.options()), b = at::empty_like(a);
  fsdp::set_cpu_collectives(below);
  g->all_gather_into_tensor(a, in.narrow(0, 0, block));
  fsdp::set_cpu_collectives({CpuAlgorithm::Mpi, 0, 0, 0, 0});
  g->all_gather_into_tensor(b, in.narrow(0, 0, block));
  BOOST_TEST(at::equal(a, b));
}

// fully_shard's reduce-scatter inputs come from empty_for_collectives: shm
// must read them where they are. The arena's peak in-use bytes tell: a
// staged input raises it by the peers' blocks, an input read in place by
// nothing. The plain-memory case checks that the statistic does see staging.
BOOST_AUTO_TEST_CASE(shm_reads_shared_memory_inputs_in_place) {  // [ours]
  KeepSettings keep;
  use(CpuAlgorithm::Shm);
  const int64_t block = 70001;
  for (const auto& g : groups()) {
    const int n = g->size();
    const std::string where = " on " + g->name();
    BOOST_REQUIRE_MESSAGE(fsdp::shared_memory_stats().committed > 0,
                          "no shared-memory arena on one node" << where);
    const at::Tensor values = input(at::kFloat, block * n, 5);
    const at::Tensor rows = group_rows(gather_world(values), g).view({n, n, block});
    const at::Tensor want = fold(rows.select(1, g->rank()), order_of(CpuAlgorithm::Shm, 0, n),
                                 ReduceOp::SUM);
    const int64_t staged = static_cast<int64_t>(values.nbytes());

    at::Tensor shared = g->empty_for_collectives({block * n}, values.options());
    shared.copy_(values);
    at::Tensor out = at::empty({block}, values.options());
    fsdp::reset_shared_memory_peak();
    const int64_t before = fsdp::shared_memory_stats().in_use;
    BOOST_TEST(before >= staged, "the input is not in shared memory" << where);
    g->reduce_scatter_tensor(out, shared, ReduceOp::SUM);
    BOOST_TEST(fsdp::shared_memory_stats().peak_in_use == before,
               "reduce-scatter staged a shared-memory input" << where);
    BOOST_TEST(at::equal(out, want), "reduce-scatter in place" << where);

    fsdp::reset_shared_memory_peak();
    g->reduce_scatter_tensor(out, values, ReduceOp::SUM);
    BOOST_TEST(fsdp::shared_memory_stats().peak_in_use >= before + staged * (n - 1) / n,
               "a plain input was not staged, or the statistic misses it" << where);
    BOOST_TEST(at::equal(out, want), "reduce-scatter staged" << where);

    // All-gather in place into shared memory: nothing staged either.
    at::Tensor gathered = g->empty_for_collectives({block * n}, values.options());
    const at::Tensor mine = gathered.narrow(0, g->rank() * block, block);
    mine.copy_(values.narrow(0, 0, block));
    fsdp::reset_shared_memory_peak();
    const int64_t held = fsdp::shared_memory_stats().in_use;
    g->all_gather_into_tensor(gathered, mine);
    BOOST_TEST(fsdp::shared_memory_stats().peak_in_use == held,
               "all-gather staged a shared-memory input" << where);
    const at::Tensor blocks = group_rows(gather_world(values.narrow(0, 0, block).contiguous()), g);
    BOOST_TEST(at::equal(gathered, blocks.reshape({-1})), "all-gather in place" << where);
  }
}

// A rank that waits long in a shared-memory barrier (its peer still
// computing) must give its core back: after a short spin and ~1 ms of
// yielding it sleeps until the peer's arrival wakes it. The last rank comes
// 300 ms late; the others' CPU time over the call (every thread of the
// process) stays far below that, and the result is still right. Waiting by
// yielding alone burns the whole 300 ms on an idle core.
BOOST_AUTO_TEST_CASE(shm_waiters_sleep_while_a_peer_is_late) {  // [ours]
  KeepSettings keep;
  use(CpuAlgorithm::Shm);
  const auto g = fsdp::world_group();
  const int n = g->size();
  const bool late = g->rank() == n - 1;
  const int64_t block = 4096;
  const at::Tensor values = input(at::kFloat, block, 13);
  at::Tensor out = g->empty_for_collectives({block * n}, values.options());
  const at::Tensor mine = out.narrow(0, g->rank() * block, block);
  mine.copy_(values);
  const at::Tensor want = gather_world(values).reshape({-1});
  MPI_Barrier(g_ref_comm);
  if (late) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto wall0 = std::chrono::steady_clock::now();
  timespec cpu0{}, cpu1{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu0);
  g->all_gather_into_tensor(out, mine);
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu1);
  const double wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - wall0).count();
  const double cpu_ms = (cpu1.tv_sec - cpu0.tv_sec) * 1e3 + (cpu1.tv_nsec - cpu0.tv_nsec) / 1e6;
  BOOST_TEST(at::equal(out, want));
  if (!late) {
    BOOST_TEST_REQUIRE(wall_ms >= 200.0, "this rank did not wait for the late one: " << wall_ms
                                                                                      << " ms");
    BOOST_TEST(cpu_ms < 100.0, "waited " << wall_ms << " ms using " << cpu_ms << " ms of CPU");
  }
}

// Run by the entry test_cpu_collectives_shm_full_np3, whose FSDP_SHM_BYTES
// caps every arena at 1 MiB: rank 0 fills its arena, so it cannot stage
// while its peers can. Every rank must then fall back to pairwise together
// (a rank running shm alone would wait for ever), with pairwise's bits.
BOOST_AUTO_TEST_CASE(shm_falls_back_together_when_one_rank_has_no_room,  // [ours]
                     *boost::unit_test::precondition([](boost::unit_test::test_unit_id) {
                       const char* cap = std::getenv("FSDP_SHM_BYTES");
                       const bool capped = cap != nullptr && std::string(cap) == "1048576";
                       boost::test_tools::assertion_result ok(capped);
                       ok.message() << "needs FSDP_SHM_BYTES=1048576, which the entry "
                                       "test_cpu_collectives_shm_full_np3 sets";
                       return ok;
                     })) {
  KeepSettings keep;
  const auto g = fsdp::world_group();
  const int n = g->size();
  // Every arena reserves 2 MiB (1 MiB and its control page, in 2 MiB steps).
  at::Tensor hog;
  if (g->rank() == 0) {
    hog = g->empty_for_collectives({(1 << 20) + (1 << 19)}, at::kByte);
    hog.fill_(1);
    BOOST_TEST(fsdp::shared_memory_stats().in_use >= hog.numel(), "the hog is not shared");
    // Past the cap, empty_for_collectives hands out plain memory instead.
    const int64_t in_use = fsdp::shared_memory_stats().in_use;
    at::Tensor plain = g->empty_for_collectives({1 << 20}, at::kByte);
    plain.fill_(2);
    BOOST_TEST(fsdp::shared_memory_stats().in_use == in_use, "past the cap: still shared?");
    BOOST_TEST(plain.sum().item<int64_t>() == 2 << 20);
  }
  const int64_t block = 100000;  // 1.2 MB to stage at np 3: rank 0 has no room
  const at::Tensor in = input(at::kFloat, block * n, 9);
  const at::Tensor rows = gather_world(in).view({n, n, block}).select(1, g->rank());
  const at::Tensor want = fold(rows, order_of(CpuAlgorithm::Pairwise, 0, n), ReduceOp::SUM);
  at::Tensor shm = at::empty({block}, at::kFloat), pairwise = at::empty_like(shm);
  use(CpuAlgorithm::Shm);
  const int64_t in_use = fsdp::shared_memory_stats().in_use;
  g->reduce_scatter_tensor(shm, in, ReduceOp::SUM);
  BOOST_TEST(at::equal(shm, want), "shm falling back");
  BOOST_TEST(fsdp::shared_memory_stats().in_use == in_use, "a staging block was not freed");
  use(CpuAlgorithm::Pairwise);
  g->reduce_scatter_tensor(pairwise, in, ReduceOp::SUM);
  BOOST_TEST(at::equal(shm, pairwise));
  // A small one still fits everywhere and runs through shared memory.
  use(CpuAlgorithm::Shm);
  at::Tensor small = at::empty({1000}, at::kFloat);
  g->reduce_scatter_tensor(small, in.narrow(0, 0, 1000 * n), ReduceOp::SUM);
  const at::Tensor small_rows =
      gather_world(in.narrow(0, 0, 1000 * n).contiguous()).view({n, n, 1000}).select(1, g->rank());
  BOOST_TEST(at::equal(small, fold(small_rows, order_of(CpuAlgorithm::Shm, 0, n), ReduceOp::SUM)));
}

BOOST_AUTO_TEST_CASE(bad_settings_are_refused) {  // [ours]
  KeepSettings keep;
  try {
    fsdp::parse_cpu_algorithm("fastest", "FSDP_MPI_ALGO");
    BOOST_FAIL("an unknown algorithm name was accepted");
  } catch (const fsdp::ArgumentError& e) {
    BOOST_TEST(e.argument() == "FSDP_MPI_ALGO");
    BOOST_TEST(std::string(e.what()).find("auto, mpi, ring, pairwise, shm") != std::string::npos,
               e.what());
  }
  for (const char* name : {"auto", "mpi", "ring", "pairwise", "shm"}) {
    BOOST_TEST(fsdp::to_string(fsdp::parse_cpu_algorithm(name, "x")) == name);
  }
  using C = fsdp::CpuCollectives;
  const std::pair<const char*, int64_t C::*> fields[] = {
      {"all_gather_min_bytes", &C::all_gather_min_bytes},
      {"reduce_scatter_min_bytes", &C::reduce_scatter_min_bytes},
      {"all_reduce_min_bytes", &C::all_reduce_min_bytes},
      {"half_reduce_min_bytes", &C::half_reduce_min_bytes},
      {"all_gather_shm_min_bytes", &C::all_gather_shm_min_bytes},
      {"all_gather_shm_max_bytes", &C::all_gather_shm_max_bytes},
      {"reduce_scatter_shm_min_bytes", &C::reduce_scatter_shm_min_bytes},
      {"reduce_scatter_shm_max_bytes", &C::reduce_scatter_shm_max_bytes},
      {"all_reduce_shm_min_bytes", &C::all_reduce_shm_min_bytes},
      {"all_reduce_shm_max_bytes", &C::all_reduce_shm_max_bytes}};
  for (const auto& [name, field] : fields) {
    C bad;
    bad.*field = -1;
    try {
      fsdp::set_cpu_collectives(bad);
      BOOST_FAIL("a negative " << name << " was accepted");
    } catch (const fsdp::ArgumentError& e) {
      BOOST_TEST(e.argument() == name);
    }
  }
  // A refused setting leaves the current one in place.
  BOOST_TEST(fsdp::cpu_collectives().reduce_scatter_min_bytes == keep.saved.reduce_scatter_min_bytes);
}
