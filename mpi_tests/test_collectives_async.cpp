// L0 [ours]: Work handles and the bookkeeping around collectives: async ops
// in flight complete in issue order, a Work is not complete until every
// rank joined, groups set up their transport when built (first collectives
// on new groups in opposite orders), the collective counters, and a send/recv
// exchange in which both ranks send first. Part of the test_collectives
// executable (np 2, 4; gpu2, gpu4; and under each CPU algorithm).
#include "collectives_util.h"

BOOST_AUTO_TEST_CASE(test_async_ops_in_flight_complete_in_issue_order) {  // [ours]
  constexpr int64_t kNumel = 4099;
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    const int root = g.size() - 1;
    for (at::ScalarType dt : kDtypes) {
      BOOST_TEST_CONTEXT(context(tg, dt, "five ops in flight", true)) {
        const at::Tensor a = make_input(dt, kNumel, g.rank(), 6).to(spmd::device());
        const at::Tensor b = make_input(dt, kNumel, g.rank(), 7).to(spmd::device());
        const at::Tensor c = make_input(dt, g.size() * kNumel, g.rank(), 8).to(spmd::device());
        const std::vector<at::Tensor> all_a = exchange(g, a);
        const std::vector<at::Tensor> all_b = exchange(g, b);
        const std::vector<at::Tensor> all_c = exchange(g, c);

        // The first two touch the same tensor, so only issue order gives
        // n * a[root]; the reverse would give root's sum of a.
        at::Tensor chained = a.clone();
        at::Tensor gathered = filled({g.size() * kNumel}, dt);
        at::Tensor maxed = b.clone();
        at::Tensor scattered = filled({kNumel}, dt);
        std::vector<WorkPtr> works;
        works.push_back(counted("broadcast", g, payload(chained),
                                [&] { return g.broadcast(chained, root, true); }));
        works.push_back(counted("all_reduce", g, payload(chained),
                                [&] { return g.all_reduce(chained, ReduceOp::SUM, true); }));
        works.push_back(counted("all_gather", g, payload(b), [&] {
          return g.all_gather_into_tensor(gathered, b, true);
        }));
        works.push_back(counted("all_reduce", g, payload(maxed),
                                [&] { return g.all_reduce(maxed, ReduceOp::MAX, true); }));
        works.push_back(counted("reduce_scatter", g, payload(c), [&] {
          return g.reduce_scatter_tensor(scattered, c, ReduceOp::SUM, true);
        }));

        // Poll newest first: once an op is seen complete, every op issued
        // before it must already be complete (on CUDA is_completed() polls
        // the GPU, so the loop ends once the device has run them all).
        bool ordered = true;
        for (bool last_done = false; !last_done;) {
          last_done = works.back()->is_completed();
          bool later_done = false;
          for (auto it = works.rbegin(); it != works.rend(); ++it) {
            const bool done = (*it)->is_completed();
            if (later_done && !done) ordered = false;
            later_done = later_done || done;
          }
          std::this_thread::yield();
        }
        BOOST_CHECK_MESSAGE(ordered, "an op completed before one issued earlier");
        for (const WorkPtr& w : works) finish(w, true);

        const std::vector<at::Tensor> copies(static_cast<size_t>(g.size()),
                                             all_a[static_cast<size_t>(root)]);
        CHECK_MATCH(chained, dt, reference_reduce(copies, ReduceOp::SUM, dt));
        CHECK_MATCH(gathered, dt, exact(at::cat(all_b)));
        CHECK_MATCH(maxed, dt, reference_reduce(all_b, ReduceOp::MAX, dt));
        const Expected full = reference_reduce(all_c, ReduceOp::SUM, dt);
        const int64_t begin = g.rank() * kNumel;
        CHECK_MATCH(scattered, dt,
                    (Expected{full.value.narrow(0, begin, kNumel),
                              full.tol.narrow(0, begin, kNumel)}));
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(test_async_work_is_not_completed_until_every_rank_joins) {  // [ours]
  constexpr int kGoTag = 12;
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    if (g.size() < 2) continue;  // a one-rank group waits for nobody
    BOOST_TEST_CONTEXT("group " << tg.label << " (group rank " << g.rank() << ")") {
      const int n = g.size();
      const std::vector<int>& members = g.world_ranks();
      at::Tensor t =
          at::full({4099}, g.rank() + 1, at::TensorOptions(at::kFloat).device(spmd::device()));
      auto issue = [&] {
        return counted("all_reduce", g, payload(t),
                       [&] { return g.all_reduce(t, ReduceOp::SUM, true); });
      };
      // Group rank 0 joins only after every other member has looked at its
      // Work, so none of those can be complete when looked at (on CUDA too:
      // a member's NCCL kernel cannot finish before rank 0 launched its own).
      WorkPtr work;
      if (g.rank() == 0) {
        for (int p = 1; p < n; ++p) {
          MPI_Recv(nullptr, 0, MPI_BYTE, members[static_cast<size_t>(p)], kGoTag, g_ref_comm,
                   MPI_STATUS_IGNORE);
        }
        work = issue();
      } else {
        work = issue();
        BOOST_CHECK_MESSAGE(!work->is_completed(),
                            "is_completed() is true before group rank 0 joined");
        MPI_Send(nullptr, 0, MPI_BYTE, members[0], kGoTag, g_ref_comm);
      }
      finish(work, true);
      CHECK_MATCH(t, at::kFloat, exact(at::full({4099}, n * (n + 1) / 2, at::kDouble)));
    }
  }
}

// A group's transport is set up when the group is built (collective, in
// the same order on every rank), never inside its first collective (c10d's
// eager init). Set up lazily, ranks that issue their first collectives on two
// new groups in opposite orders wait for each other forever, each blocked in
// the set-up of a different group. CPU tensors check the MPI backend's
// communicators; a gpu entry (CUDA tensors) checks NCCL's ncclCommInitRank.
BOOST_AUTO_TEST_CASE(test_first_collectives_of_new_groups_in_opposite_orders) {  // [ours]
  const int n = spmd::world_size();
  const int me = spmd::rank();
  std::vector<int> members(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) members[static_cast<size_t>(r)] = r;
  auto make_group = [&](const std::string& name) {
    MPI_Comm comm = MPI_COMM_NULL;
    BOOST_REQUIRE(MPI_Comm_dup(MPI_COMM_WORLD, &comm) == MPI_SUCCESS);
    return std::make_shared<fsdp::detail::ProcessGroupImpl>(comm, members, name);
  };
  auto a = make_group("new group A");
  auto b = make_group("new group B");
  const auto options = at::TensorOptions(at::kFloat).device(spmd::device());
  at::Tensor ta = at::full({4099}, me + 1, options);
  at::Tensor tb = at::full({4099}, 10 * (me + 1), options);
  // Even ranks start with A, odd ones with B; both are issued before either
  // is waited for, as prefetching issues them.
  WorkPtr wa, wb;
  if (me % 2 == 0) {
    wa = a->all_reduce(ta, ReduceOp::SUM, /*async_op=*/true);
    wb = b->all_reduce(tb, ReduceOp::SUM, /*async_op=*/true);
  } else {
    wb = b->all_reduce(tb, ReduceOp::SUM, /*async_op=*/true);
    wa = a->all_reduce(ta, ReduceOp::SUM, /*async_op=*/true);
  }
  finish(wa, true);
  finish(wb, true);
  const double sum = n * (n + 1) / 2.0;
  CHECK_MATCH(ta, at::kFloat, exact(at::full({4099}, sum, at::kDouble)));
  CHECK_MATCH(tb, at::kFloat, exact(at::full({4099}, 10 * sum, at::kDouble)));
  a->shutdown();
  b->shutdown();
}

BOOST_AUTO_TEST_CASE(test_collective_counters_count_each_call_and_reset) {  // [ours]
  const std::vector<TestGroup> groups = test_groups();
  const c10::TensorOptions options = at::TensorOptions(at::kFloat).device(spmd::device());
  auto check_empty = [](const char* when) {
    const fsdp::CollectiveCounters c = fsdp::collective_counters();
    BOOST_CHECK_MESSAGE(c.count.empty() && c.bytes.empty() && c.sequence.empty(),
                        "counters not empty " << when << ": " << all_counts(c) << " calls, "
                                              << c.sequence.size() << " records");
  };

  fsdp::reset_collective_counters();
  check_empty("after reset");

  // One call of each kind per group, remembered in issue order.
  std::vector<std::pair<std::string, std::string>> issued;
  std::vector<int64_t> issued_bytes;
  for (const TestGroup& tg : groups) {
    ProcessGroup& g = *tg.group;
    BOOST_TEST_CONTEXT("group " << tg.label) {
      const int n = g.size();
      auto note = [&](const std::string& op, int64_t bytes) {
        issued.emplace_back(op, g.name());
        issued_bytes.push_back(bytes);
      };
      at::Tensor x = at::ones({6}, options);
      at::Tensor big = at::ones({6 * n}, options);
      at::Tensor small = at::ones({6}, options);
      counted("all_gather", g, 24, [&] { return g.all_gather_into_tensor(big, x); });
      note("all_gather", 24);
      counted("reduce_scatter", g, 24 * n,
              [&] { return g.reduce_scatter_tensor(small, big, ReduceOp::AVG); });
      note("reduce_scatter", 24 * n);
      counted("all_reduce", g, 24, [&] { return g.all_reduce(x, ReduceOp::MAX, true); })->wait();
      note("all_reduce", 24);
      counted("broadcast", g, 24, [&] { return g.broadcast(x, 0); });
      note("broadcast", 24);
      at::Tensor rows = at::ones({n, 2}, options);
      at::Tensor rows_out = at::empty({n, 2}, options);
      counted("all_to_all", g, 8 * n, [&] { return g.all_to_all_single(rows_out, rows); });
      note("all_to_all", 8 * n);
      if (n > 1) {
        // Pairs (0,1), (2,3): the group sizes here are 2 or 4.
        const int peer = g.rank() ^ 1;
        if (g.rank() % 2 == 0) {
          counted("send", g, 24, [&] { return g.send(x, peer); });
          counted("recv", g, 24, [&] { return g.recv(x, peer); });
          note("send", 24);
          note("recv", 24);
        } else {
          counted("recv", g, 24, [&] { return g.recv(x, peer); });
          counted("send", g, 24, [&] { return g.send(x, peer); });
          note("recv", 24);
          note("send", 24);
        }
      }
      counted("barrier", g, 0, [&] {
        g.barrier();
        return WorkPtr();
      });
      note("barrier", 0);
    }
  }

  const fsdp::CollectiveCounters c = fsdp::collective_counters();
  std::map<std::pair<std::string, std::string>, int64_t> expected_count;
  for (const auto& key : issued) ++expected_count[key];
  BOOST_CHECK(c.count == expected_count);
  BOOST_CHECK_EQUAL(c.sequence.size(), issued.size());
  for (size_t i = 0; i < std::min(c.sequence.size(), issued.size()); ++i) {
    const fsdp::CollectiveRecord& r = c.sequence[i];
    BOOST_CHECK_MESSAGE(r.op == issued[i].first && r.group == issued[i].second &&
                            r.bytes == issued_bytes[i],
                        "record " << i << " is (" << r.op << ", " << r.group << ", " << r.bytes
                                  << "), issued (" << issued[i].first << ", "
                                  << issued[i].second << ", " << issued_bytes[i] << ")");
  }
  const std::string world = groups.front().group->name();
  BOOST_CHECK_EQUAL(c.total("barrier"), static_cast<int64_t>(groups.size()));
  const int64_t world_barriers = expected_count[{"barrier", world}];
  BOOST_CHECK_EQUAL(c.total("barrier", world), world_barriers);

  fsdp::reset_collective_counters();
  check_empty("after the second reset");
  ProcessGroup& g = *groups.front().group;
  at::Tensor x = at::ones({3}, options);
  counted("all_reduce", g, 12, [&] { return g.all_reduce(x); });
  BOOST_CHECK_EQUAL(fsdp::collective_counters().count.size(), 1u);
  BOOST_CHECK_EQUAL(count_of(fsdp::collective_counters(), "all_reduce", g.name()), 1);
}

// Both ranks of each pair send first: a queued blocking send would deadlock
// past MPI's eager limit, so point-to-point must start at once. An MPI
// property, so CPU tensors on every entry (with NCCL, whose sends and
// receives are queued in order on one stream, such an exchange needs
// batch_isend_irecv); wait() on MPI Works blocks until they are complete.
BOOST_AUTO_TEST_CASE(test_send_recv_exchange_both_send_first,  // [ours]
                     *spmd::needs_even_world_size("to pair the ranks up")) {
  auto group = fsdp::world_group();
  const int me = group->rank();
  const int peer = me ^ 1;
  const int64_t n = 1 << 20;  // 4 MiB of float32, far past the eager limit
  auto out = at::full({n}, static_cast<float>(me + 1), at::kFloat);
  auto in = at::zeros({n}, at::kFloat);
  auto send = group->send(out, peer, 7, /*async_op=*/true);
  auto recv = group->recv(in, peer, 7, /*async_op=*/true);
  send->wait();
  recv->wait();
  BOOST_TEST(send->is_completed());
  BOOST_TEST(recv->is_completed());
  BOOST_TEST(at::equal(in, at::full({n}, static_cast<float>(peer + 1), at::kFloat)));
}
