// L0 [ours]: every collective x dtype x op against a naive reference built
// from MPI point-to-point messages (common/collectives_util.h): all_gather,
// reduce_scatter, all_reduce, broadcast, all_to_all_single (equal and
// uneven splits), send/recv on a ring, barrier. Part of the test_collectives
// executable (np 2, 4; gpu2, gpu4; and test_collectives_{ring,pairwise,shm}_np2/4
// under each CPU algorithm).
//
// Groups: the world (mesh {n}); at 4 ranks also both dims of a {2,2}
// ("replicate", "shard") mesh and every dim of a 3-D {2,1,2} mesh, whose
// middle dim is a one-rank group.
#include "collectives_util.h"

// The reference's private communicator, for the whole executable.
BOOST_TEST_GLOBAL_FIXTURE(ReferenceComm);

BOOST_AUTO_TEST_CASE(test_all_gather_into_tensor) {  // [ours]
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    for (at::ScalarType dt : kDtypes) {
      for (int64_t numel : kSizes) {
        for (bool async_op : {false, true}) {
          BOOST_TEST_CONTEXT(context(tg, dt, sized(numel), async_op)) {
            const at::Tensor input = make_input(dt, numel, g.rank(), 0).to(spmd::device());
            const std::vector<at::Tensor> all = exchange(g, input);
            at::Tensor output = filled({g.size() * numel}, dt);
            finish(counted("all_gather", g, payload(input),
                           [&] { return g.all_gather_into_tensor(output, input, async_op); }),
                   async_op);
            CHECK_MATCH(output, dt, exact(at::cat(all)));
            CHECK_MATCH(input, dt, exact(all[static_cast<size_t>(g.rank())]));
          }
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(test_reduce_scatter_tensor) {  // [ours]
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    for (at::ScalarType dt : kDtypes) {
      for (ReduceOp op : ops_for(dt)) {
        for (int64_t numel : kSizes) {
          for (bool async_op : {false, true}) {
            BOOST_TEST_CONTEXT(context(tg, dt, op_sized(op, numel), async_op)) {
              const at::Tensor input =
                  make_input(dt, g.size() * numel, g.rank(), 1).to(spmd::device());
              const std::vector<at::Tensor> all = exchange(g, input);
              at::Tensor output = filled({numel}, dt);
              finish(counted("reduce_scatter", g, payload(input),
                             [&] {
                               return g.reduce_scatter_tensor(output, input, op, async_op);
                             }),
                     async_op);
              const Expected full = reference_reduce(all, op, dt);
              const int64_t begin = g.rank() * numel;
              CHECK_MATCH(output, dt,
                          (Expected{full.value.narrow(0, begin, numel),
                                    full.tol.narrow(0, begin, numel)}));
            }
          }
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(test_all_reduce) {  // [ours]
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    for (at::ScalarType dt : kDtypes) {
      for (ReduceOp op : ops_for(dt)) {
        for (int64_t numel : kSizes) {
          for (bool async_op : {false, true}) {
            BOOST_TEST_CONTEXT(context(tg, dt, op_sized(op, numel), async_op)) {
              at::Tensor tensor = make_input(dt, numel, g.rank(), 2).to(spmd::device());
              const std::vector<at::Tensor> all = exchange(g, tensor);
              finish(counted("all_reduce", g, payload(tensor),
                             [&] { return g.all_reduce(tensor, op, async_op); }),
                     async_op);
              CHECK_MATCH(tensor, dt, reference_reduce(all, op, dt));
            }
          }
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(test_broadcast_from_every_root) {  // [ours]
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    for (at::ScalarType dt : kDtypes) {
      for (int64_t numel : kSizes) {
        for (int root = 0; root < g.size(); ++root) {
          for (bool async_op : {false, true}) {
            BOOST_TEST_CONTEXT(context(tg, dt, sized(numel) + ", root " + std::to_string(root),
                                       async_op)) {
              at::Tensor tensor = make_input(dt, numel, g.rank(), 3 + root).to(spmd::device());
              const std::vector<at::Tensor> all = exchange(g, tensor);
              finish(counted("broadcast", g, payload(tensor),
                             [&] { return g.broadcast(tensor, root, async_op); }),
                     async_op);
              CHECK_MATCH(tensor, dt, exact(all[static_cast<size_t>(root)]));
            }
          }
        }
      }
    }
  }
}

namespace {

constexpr int64_t kRowWidth = 5;

// all_to_all_single on `g` where member i sends rows[i][j] rows to member j,
// checked against the members' inputs.
void check_all_to_all(const TestGroup& tg, at::ScalarType dt, bool async_op,
                      const std::vector<std::vector<int64_t>>& rows, bool pass_splits) {
  ProcessGroup& g = *tg.group;
  const auto me = static_cast<size_t>(g.rank());
  const size_t n = rows.size();
  std::vector<int64_t> in_splits, out_splits;
  int64_t in_rows = 0, out_rows = 0;
  for (size_t j = 0; j < n; ++j) {
    in_splits.push_back(rows[me][j]);
    out_splits.push_back(rows[j][me]);
    in_rows += rows[me][j];
    out_rows += rows[j][me];
  }
  const at::Tensor input =
      make_input(dt, in_rows * kRowWidth, g.rank(), 4).reshape({in_rows, kRowWidth}).to(
          spmd::device());
  const std::vector<at::Tensor> all = exchange(g, input);
  at::Tensor output = filled({out_rows, kRowWidth}, dt);
  const std::vector<int64_t> no_splits;
  finish(counted("all_to_all", g, payload(input),
                 [&] {
                   return g.all_to_all_single(output, input, pass_splits ? out_splits : no_splits,
                                              pass_splits ? in_splits : no_splits, async_op);
                 }),
         async_op);
  // Block j of the output is the block that member j addressed to this rank.
  std::vector<at::Tensor> blocks;
  for (size_t j = 0; j < n; ++j) {
    int64_t offset = 0;
    for (size_t k = 0; k < me; ++k) offset += rows[j][k];
    blocks.push_back(all[j].reshape({-1, kRowWidth}).narrow(0, offset, rows[j][me]));
  }
  CHECK_MATCH(output, dt, exact(at::cat(blocks)));
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_all_to_all_single_equal_split) {  // [ours]
  for (const TestGroup& tg : test_groups()) {
    const auto n = static_cast<size_t>(tg.group->size());
    const std::vector<std::vector<int64_t>> rows(n, std::vector<int64_t>(n, 3));
    for (at::ScalarType dt : kDtypes) {
      for (bool async_op : {false, true}) {
        BOOST_TEST_CONTEXT(context(tg, dt, "3 rows to each rank, no split sizes", async_op)) {
          check_all_to_all(tg, dt, async_op, rows, false);
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(test_all_to_all_single_uneven_split) {  // [ours]
  for (const TestGroup& tg : test_groups()) {
    const auto n = static_cast<size_t>(tg.group->size());
    // 0, 1 or 2 rows from i to j: zero-row blocks in both directions, and
    // ranks that send and receive different totals.
    std::vector<std::vector<int64_t>> uneven(n, std::vector<int64_t>(n));
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = 0; j < n; ++j) uneven[i][j] = static_cast<int64_t>((i + 2 * j + 1) % 3);
    }
    const std::vector<std::vector<int64_t>> empty(n, std::vector<int64_t>(n, 0));
    for (at::ScalarType dt : kDtypes) {
      for (bool async_op : {false, true}) {
        BOOST_TEST_CONTEXT(context(tg, dt, "(i + 2j + 1) % 3 rows from i to j", async_op)) {
          check_all_to_all(tg, dt, async_op, uneven, true);
        }
        BOOST_TEST_CONTEXT(context(tg, dt, "zero rows everywhere", async_op)) {
          check_all_to_all(tg, dt, async_op, empty, true);
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(test_send_recv_ring) {  // [ours]
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    if (g.size() < 2) continue;  // a one-rank group has no peer to talk to
    const int next = (g.rank() + 1) % g.size();
    const int prev = (g.rank() + g.size() - 1) % g.size();
    for (at::ScalarType dt : kDtypes) {
      for (int64_t numel : {int64_t{7}, int64_t{4099}}) {
        for (int tag : {0, 32767}) {
          for (bool async_op : {false, true}) {
            BOOST_TEST_CONTEXT(context(tg, dt, sized(numel) + ", tag " + std::to_string(tag),
                                       async_op)) {
              const at::Tensor sent = make_input(dt, numel, g.rank(), 5).to(spmd::device());
              const std::vector<at::Tensor> all = exchange(g, sent);
              at::Tensor received = filled({numel}, dt);
              auto do_send = [&] {
                return counted("send", g, payload(sent),
                               [&] { return g.send(sent, next, tag, async_op); });
              };
              auto do_recv = [&] {
                return counted("recv", g, payload(received),
                               [&] { return g.recv(received, prev, tag, async_op); });
              };
              // A group runs its operations one at a time in issue order, so
              // a rank whose receive comes first cannot send until it is
              // matched: even ranks send first, odd ranks receive first.
              WorkPtr first, second;
              if (g.rank() % 2 == 0) {
                first = do_send();
                second = do_recv();
              } else {
                first = do_recv();
                second = do_send();
              }
              finish(first, async_op);
              finish(second, async_op);
              CHECK_MATCH(received, dt, exact(all[static_cast<size_t>(prev)]));
              CHECK_MATCH(sent, dt, exact(all[static_cast<size_t>(g.rank())]));
            }
          }
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(test_barrier) {  // [ours]
  using Clock = std::chrono::steady_clock;
  constexpr auto kDelay = std::chrono::milliseconds(400);
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    BOOST_TEST_CONTEXT("group " << tg.label << " (group rank " << g.rank() << ")") {
      // Line every rank up on the reference communicator, then hold group
      // rank 0 back: no member may leave the barrier before it entered. Half
      // the delay is margin for ranks that leave the line-up late.
      MPI_Barrier(g_ref_comm);
      const auto start = Clock::now();
      if (g.rank() == 0) std::this_thread::sleep_for(kDelay);
      counted("barrier", g, 0, [&] {
        g.barrier();
        return WorkPtr();
      });
      const auto waited = Clock::now() - start;
      if (g.rank() != 0) {
        BOOST_CHECK_MESSAGE(waited >= kDelay / 2,
                            "left the barrier after "
                                << std::chrono::duration<double>(waited).count()
                                << " s although group rank 0 entered it after "
                                << std::chrono::duration<double>(kDelay).count() << " s");
      }
    }
  }
}
