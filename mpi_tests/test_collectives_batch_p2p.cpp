// L0 [ours]: batch_isend_irecv: rings whose ranks all list sends first (4 MiB,
// past the eager limit), send + receive with one peer, Works in the order of
// the ops, labels in describe_pending_collectives(), typed errors naming
// ops[i] that issue and count nothing. Part of the test_collectives
// executable (np 2, 4; gpu2, gpu4; and under each CPU algorithm).
#include "collectives_util.h"

// ---- batch_isend_irecv -------------------------------------------------------

namespace {

using fsdp::P2POp;

P2POp p2p(P2POp::Kind kind, at::Tensor t, int peer, int tag, std::string label = "") {
  P2POp op;
  op.kind = kind;
  op.tensor = std::move(t);
  op.peer = peer;
  op.tag = tag;
  op.label = std::move(label);
  return op;
}

// Issues `ops` on `g` and checks the counters: one "send" per Send op and
// one "recv" per Recv op on g, with their payload bytes, nothing else.
std::vector<WorkPtr> counted_batch(ProcessGroup& g, const std::vector<P2POp>& ops) {
  int64_t sends = 0, recvs = 0, send_bytes = 0, recv_bytes = 0;
  for (const P2POp& op : ops) {
    const bool send = op.kind == P2POp::Kind::Send;
    (send ? sends : recvs) += 1;
    (send ? send_bytes : recv_bytes) += payload(op.tensor);
  }
  const fsdp::CollectiveCounters before = fsdp::collective_counters();
  std::vector<WorkPtr> works = g.batch_isend_irecv(ops);
  const fsdp::CollectiveCounters after = fsdp::collective_counters();
  const std::string& n = g.name();
  BOOST_CHECK_EQUAL(count_of(after, "send", n) - count_of(before, "send", n), sends);
  BOOST_CHECK_EQUAL(count_of(after, "recv", n) - count_of(before, "recv", n), recvs);
  BOOST_CHECK_EQUAL(bytes_of(after, "send", n) - bytes_of(before, "send", n), send_bytes);
  BOOST_CHECK_EQUAL(bytes_of(after, "recv", n) - bytes_of(before, "recv", n), recv_bytes);
  BOOST_CHECK_EQUAL(all_counts(after) - all_counts(before), sends + recvs);
  BOOST_CHECK_EQUAL(works.size(), ops.size());
  return works;
}

constexpr int64_t kBigNumel = int64_t{1} << 20;  // 4 MiB of float32: past any eager limit

}  // namespace

// Every rank lists its sends before its receives -- blocking sends in that
// order deadlock past the eager limit -- on a ring in both directions (to
// the next rank, float32, tag 1; to the previous one, bfloat16, tag 2;
// at 2 ranks both peers are the same rank). The batch completes, each
// receive holds its sender's data and the sent tensors are untouched.
BOOST_AUTO_TEST_CASE(test_batch_isend_irecv_ring_sends_listed_first) {  // [ours]
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    if (g.size() < 2) continue;
    const int next = (g.rank() + 1) % g.size();
    const int prev = (g.rank() + g.size() - 1) % g.size();
    BOOST_TEST_CONTEXT("group " << tg.label << " (group rank " << g.rank() << ")") {
      const at::Tensor to_next = make_input(at::kFloat, kBigNumel, g.rank(), 9).to(spmd::device());
      const at::Tensor to_prev =
          make_input(at::kBFloat16, kBigNumel / 2 + 3, g.rank(), 10).to(spmd::device());
      const std::vector<at::Tensor> all_next = exchange(g, to_next);
      const std::vector<at::Tensor> all_prev = exchange(g, to_prev);
      at::Tensor from_prev = filled({kBigNumel}, at::kFloat);
      at::Tensor from_next = filled({kBigNumel / 2 + 3}, at::kBFloat16);
      const std::vector<WorkPtr> works = counted_batch(
          g, {p2p(P2POp::Kind::Send, to_next, next, 1), p2p(P2POp::Kind::Send, to_prev, prev, 2),
              p2p(P2POp::Kind::Recv, from_prev, prev, 1),
              p2p(P2POp::Kind::Recv, from_next, next, 2)});
      for (const WorkPtr& w : works) finish(w, true);
      CHECK_MATCH(from_prev, at::kFloat, exact(all_next[static_cast<size_t>(prev)]));
      CHECK_MATCH(from_next, at::kBFloat16, exact(all_prev[static_cast<size_t>(next)]));
      CHECK_MATCH(to_next, at::kFloat, exact(all_next[static_cast<size_t>(g.rank())]));
      CHECK_MATCH(to_prev, at::kBFloat16, exact(all_prev[static_cast<size_t>(g.rank())]));
    }
  }
}

// 1F1B's fused exchange: a send and a receive with the same peer in one
// batch, listed send-first on even ranks and receive-first on odd ones,
// three times in a row (three microbatches).
BOOST_AUTO_TEST_CASE(test_batch_isend_irecv_send_and_recv_with_one_peer) {  // [ours]
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    if (g.size() % 2 != 0) continue;  // pairs (0,1), (2,3)
    const int peer = g.rank() ^ 1;
    for (int mb = 0; mb < 3; ++mb) {
      BOOST_TEST_CONTEXT("group " << tg.label << " (group rank " << g.rank() << "), round " << mb) {
        const at::Tensor out = make_input(at::kFloat, kBigNumel, g.rank(), 20 + mb).to(spmd::device());
        const std::vector<at::Tensor> all = exchange(g, out);
        at::Tensor in = filled({kBigNumel}, at::kFloat);
        const P2POp send = p2p(P2POp::Kind::Send, out, peer, mb);
        const P2POp recv = p2p(P2POp::Kind::Recv, in, peer, mb);
        const bool send_first = g.rank() % 2 == 0;
        const std::vector<WorkPtr> works =
            counted_batch(g, send_first ? std::vector<P2POp>{send, recv} : std::vector<P2POp>{recv, send});
        for (const WorkPtr& w : works) finish(w, true);
        CHECK_MATCH(in, at::kFloat, exact(all[static_cast<size_t>(peer)]));
        CHECK_MATCH(out, at::kFloat, exact(all[static_cast<size_t>(g.rank())]));
      }
    }
  }
}

// The Works come back in the order of the ops, not the order they are
// posted in (receives first): rank 0 lists [send to 1, receive from 1];
// rank 1 receives, says so, and sends only when told. Until then rank 0's
// works[0] (its send) completes and works[1] (its receive) cannot.
BOOST_AUTO_TEST_CASE(test_batch_isend_irecv_works_in_the_order_given,  // [ours]
                     *spmd::needs_device(c10::kCPU, "NCCL completes a batch together: its ops "
                                                    "share one Work")) {
  constexpr int kSignalTag = 13;
  auto g = fsdp::init_device_mesh(spmd::device().type(), {spmd::world_size()}).get_group(0);
  const int me = g->rank();
  const at::Tensor big = make_input(at::kFloat, kBigNumel, 0, 30);
  const at::Tensor small = make_input(at::kFloat, 17, 1, 31);
  if (me == 0) {
    at::Tensor in = filled({17}, at::kFloat);
    const std::vector<WorkPtr> works = counted_batch(
        *g, {p2p(P2POp::Kind::Send, big, 1, 3), p2p(P2POp::Kind::Recv, in, 1, 4)});
    BOOST_TEST_REQUIRE(works.size() == 2u);
    MPI_Recv(nullptr, 0, MPI_BYTE, g->world_ranks()[1], kSignalTag, g_ref_comm,
             MPI_STATUS_IGNORE);  // rank 1 has received `big`
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!works[0]->is_completed() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    BOOST_TEST(works[0]->is_completed(), "works[0] (the send) did not complete");
    BOOST_TEST(!works[1]->is_completed(), "works[1] (the receive) completed before its send");
    MPI_Send(nullptr, 0, MPI_BYTE, g->world_ranks()[1], kSignalTag, g_ref_comm);  // go
    for (const WorkPtr& w : works) finish(w, true);
    CHECK_MATCH(in, at::kFloat, exact(small));
  } else if (me == 1) {
    at::Tensor in = filled({kBigNumel}, at::kFloat);
    for (const WorkPtr& w : counted_batch(*g, {p2p(P2POp::Kind::Recv, in, 0, 3)})) finish(w, true);
    CHECK_MATCH(in, at::kFloat, exact(big));
    MPI_Send(nullptr, 0, MPI_BYTE, g->world_ranks()[0], kSignalTag, g_ref_comm);
    MPI_Recv(nullptr, 0, MPI_BYTE, g->world_ranks()[0], kSignalTag, g_ref_comm,
             MPI_STATUS_IGNORE);
    for (const WorkPtr& w : counted_batch(*g, {p2p(P2POp::Kind::Send, small, 0, 4)})) {
      finish(w, true);
    }
  }
}

// While a labelled receive waits for a sender that has not posted yet,
// describe_pending_collectives() shows its label; once it completed, not.
BOOST_AUTO_TEST_CASE(test_batch_isend_irecv_label_while_pending) {  // [ours]
  const std::string label = "pp stage 1 -> 0 gradient of microbatch 3 (label test)";
  auto g = fsdp::init_device_mesh(spmd::device().type(), {spmd::world_size()}).get_group(0);
  const at::Tensor data = make_input(at::kFloat, 33, 1, 32).to(spmd::device());
  at::Tensor in = filled({33}, at::kFloat);
  // A first exchange between ranks 0 and 1 sets up whatever the pair needs
  // (NCCL: its communicator), so the receive below only waits for data.
  if (g->rank() < 2) {
    at::Tensor warm_in = filled({2}, at::kFloat);
    const at::Tensor warm_out = at::ones({2}, warm_in.options());
    const int other = 1 - g->rank();
    for (const WorkPtr& w : counted_batch(*g, {p2p(P2POp::Kind::Send, warm_out, other, 6),
                                               p2p(P2POp::Kind::Recv, warm_in, other, 6)})) {
      finish(w, true);
    }
  }
  std::vector<WorkPtr> works;
  if (g->rank() == 0) {
    works = counted_batch(*g, {p2p(P2POp::Kind::Recv, in, 1, 5, label)});
    const std::string pending = fsdp::describe_pending_collectives();
    BOOST_TEST(pending.find(label) != std::string::npos, "pending: " << pending);
    BOOST_TEST(pending.find("recv") != std::string::npos, "pending: " << pending);
  }
  MPI_Barrier(g_ref_comm);  // rank 1 sends only now
  if (g->rank() == 1) {
    works = counted_batch(*g, {p2p(P2POp::Kind::Send, data, 0, 5, "the sender's label")});
  }
  for (const WorkPtr& w : works) finish(w, true);
  if (g->rank() == 0) {
    CHECK_MATCH(in, at::kFloat, exact(data));
    const std::string pending = fsdp::describe_pending_collectives();
    BOOST_TEST(pending.find(label) == std::string::npos, "still pending: " << pending);
  }
}

namespace {

// `call` throws exactly E naming `argument` (argument() and, quoted, what()).
template <typename E>
void expect_batch_error(const std::string& label, const std::string& argument,
                        const std::function<void()>& call) {
  BOOST_TEST_CONTEXT(label) {
    try {
      call();
      BOOST_ERROR("no exception");
    } catch (const fsdp::ArgumentError& e) {
      BOOST_CHECK_MESSAGE(typeid(e) == typeid(E), "threw another ArgumentError type: " << e.what());
      BOOST_CHECK_MESSAGE(e.argument() == argument,
                          "argument() is '" << e.argument() << "', expected '" << argument << "'");
      BOOST_CHECK_MESSAGE(std::string(e.what()).find("'" + argument + "'") != std::string::npos,
                          "what() does not name '" << argument << "': " << e.what());
    } catch (const std::exception& e) {
      BOOST_ERROR("threw a non-ArgumentError: " << e.what());
    }
  }
}

// Batches that are invalid in one op (the last): a bad peer, an undefined
// tensor, a non-contiguous tensor, a bad tag -- after valid ones.
std::vector<std::pair<std::string, std::vector<P2POp>>> rejected_batches(const ProcessGroup& g) {
  using K = P2POp::Kind;
  const int peer = (g.rank() + 1) % g.size();
  const at::Tensor t = at::ones({6}, at::TensorOptions(at::kFloat).device(spmd::device()));
  const at::Tensor nc = at::ones({4, 6}, t.options()).t();
  return {
      {"bad peer in ops[1]", {p2p(K::Send, t, peer, 0), p2p(K::Recv, t.clone(), g.size() + 3, 0)}},
      {"undefined tensor in ops[1]", {p2p(K::Send, t, peer, 0), p2p(K::Recv, at::Tensor(), peer, 0)}},
      {"non-contiguous in ops[2]",
       {p2p(K::Recv, t.clone(), peer, 0), p2p(K::Send, t, peer, 0), p2p(K::Recv, nc, peer, 1)}},
      {"tag 32768 in ops[1]", {p2p(K::Send, t, peer, 0), p2p(K::Send, t, peer, 32768)}},
  };
}

// The group still exchanges correctly (nothing half-issued is left behind).
void check_batch_still_works(ProcessGroup& g) {
  using K = P2POp::Kind;
  const int next = (g.rank() + 1) % g.size();
  const int prev = (g.rank() + g.size() - 1) % g.size();
  const at::Tensor out = make_input(at::kFloat, 7, g.rank(), 40).to(spmd::device());
  const std::vector<at::Tensor> all = exchange(g, out);
  at::Tensor in = filled({7}, at::kFloat);
  for (const WorkPtr& w : counted_batch(g, {p2p(K::Send, out, next, 0), p2p(K::Recv, in, prev, 0)})) {
    finish(w, true);
  }
  CHECK_MATCH(in, at::kFloat, exact(all[static_cast<size_t>(prev)]));
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_batch_isend_irecv_errors) {  // [ours]
  using K = P2POp::Kind;
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    if (g.size() < 2) continue;  // ops[0] below needs a valid peer
    const int peer = (g.rank() + 1) % g.size();
    const at::Tensor t = at::ones({6}, at::TensorOptions(at::kFloat).device(spmd::device()));
    const at::Tensor nc = at::ones({4, 6}, t.options()).t();  // not contiguous
    BOOST_TEST_CONTEXT("group " << tg.label) {
      const fsdp::CollectiveCounters before = fsdp::collective_counters();
      BOOST_TEST(g.batch_isend_irecv({}).empty());
      BOOST_TEST(all_counts(fsdp::collective_counters()) == all_counts(before));

      expect_batch_error<fsdp::ArgumentError>("peer == size", "ops[0].peer", [&] {
        g.batch_isend_irecv({p2p(K::Send, t, g.size(), 0)});
      });
      expect_batch_error<fsdp::ArgumentError>("peer -1", "ops[0].peer", [&] {
        g.batch_isend_irecv({p2p(K::Recv, t.clone(), -1, 0)});
      });
      expect_batch_error<fsdp::ArgumentError>("peer out of range in ops[1]", "ops[1].peer", [&] {
        g.batch_isend_irecv({p2p(K::Send, t, peer, 0), p2p(K::Recv, t.clone(), g.size() + 3, 0)});
      });
      expect_batch_error<fsdp::ArgumentError>("undefined tensor", "ops[0].tensor", [&] {
        g.batch_isend_irecv({p2p(K::Recv, at::Tensor(), peer, 0)});
      });
      expect_batch_error<fsdp::ArgumentError>("undefined tensor in ops[1]", "ops[1].tensor", [&] {
        g.batch_isend_irecv({p2p(K::Send, t, peer, 0), p2p(K::Recv, at::Tensor(), peer, 0)});
      });
      expect_batch_error<fsdp::LayoutError>("non-contiguous", "ops[0].tensor", [&] {
        g.batch_isend_irecv({p2p(K::Send, nc, peer, 0)});
      });
      expect_batch_error<fsdp::LayoutError>("non-contiguous in ops[2]", "ops[2].tensor", [&] {
        g.batch_isend_irecv({p2p(K::Recv, t.clone(), peer, 0), p2p(K::Send, t, peer, 0),
                             p2p(K::Recv, nc, peer, 1)});
      });
      check_batch_still_works(g);
    }
  }
}

// "Errors as for send/recv, naming ops[i]" (comm.h): a bad tag too.
BOOST_AUTO_TEST_CASE(test_batch_isend_irecv_bad_tag_names_the_op) {  // [ours]
  using K = P2POp::Kind;
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    if (g.size() < 2) continue;
    const int peer = (g.rank() + 1) % g.size();
    const at::Tensor t = at::ones({6}, at::TensorOptions(at::kFloat).device(spmd::device()));
    BOOST_TEST_CONTEXT("group " << tg.label) {
      for (const int tag : {32768, -1}) {
        try {
          g.batch_isend_irecv({p2p(K::Send, t, peer, 0), p2p(K::Send, t, peer, tag)});
          BOOST_ERROR("tag " << tag << ": no exception");
        } catch (const fsdp::ArgumentError& e) {
          const std::string msg = e.what();
          BOOST_TEST(msg.find("ops[1]") != std::string::npos, "does not name ops[1]: " << msg);
          BOOST_TEST(msg.find(std::to_string(tag)) != std::string::npos,
                     "does not quote the tag: " << msg);
        }
      }
      check_batch_still_works(g);
    }
  }
}

// A rejected batch issues and counts nothing -- also when the bad op comes
// after valid ones (the counters count collectives as they are issued).
BOOST_AUTO_TEST_CASE(test_batch_isend_irecv_rejected_batch_counts_nothing) {  // [ours]
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    if (g.size() < 2) continue;
    for (const auto& batch : rejected_batches(g)) {
      const std::string& label = batch.first;
      const std::vector<P2POp>& ops = batch.second;
      BOOST_TEST_CONTEXT("group " << tg.label << ", " << label) {
        const fsdp::CollectiveCounters before = fsdp::collective_counters();
        BOOST_CHECK_THROW(g.batch_isend_irecv(ops), fsdp::ArgumentError);
        const fsdp::CollectiveCounters after = fsdp::collective_counters();
        BOOST_TEST(all_counts(after) == all_counts(before),
                   "the rejected batch was counted: " << all_counts(after) - all_counts(before)
                                                      << " ops");
        BOOST_TEST(after.sequence.size() == before.sequence.size());
      }
    }
    check_batch_still_works(g);
  }
}
