// [ours] Exceptions leave nothing behind: an exception thrown in forward,
// early in backward or late in backward, caught by the user
// (optimizer.zero_grad(), continue), leaves nothing behind: the remaining
// steps equal a run in which the failed step never happened (1-D at np 2 and
// np 4, HSDP (2,2) at np 4; reshard_after_forward true/false; comm_fusion).
// Part of the test_fully_shard_lifecycle executable (np 2, 4; gpu2, gpu4; label core).
//
// Suite exceptions_leave_nothing_behind (all cases [ours]).
#include "lifecycle_util.h"

namespace {

// Exceptions leave nothing behind.

enum class Failure { kForward, kEarlyBackward, kLateBackward };

const char* failure_name(Failure f) {
  switch (f) {
    case Failure::kForward: return "in forward";
    case Failure::kEarlyBackward: return "early in backward";
    case Failure::kLateBackward: return "late in backward";
  }
  return "?";
}

std::vector<Layout> exception_layouts() {
  std::vector<Layout> out;
  out.push_back(layout_1d());
  if (spmd::world_size() == 4) out.push_back(layout_hsdp());
  return out;
}

// Steps 1..3 with AdamW; step 2 throws (on every rank, at the same point);
// the user catches it, calls optimizer.zero_grad() and goes on with step 3.
// Reference: AdamW on the batches of steps 1 and 3 only.
void run_exception_case(Failure failure, bool reshard_after_forward, bool comm_fusion) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  std::ostringstream id;
  id << "exception " << failure_name(failure)
     << " reshard_after_forward=" << (reshard_after_forward ? "true" : "false")
     << " comm_fusion=" << (comm_fusion ? "true" : "false");
  for (const Layout& layout : exception_layouts()) {
    BOOST_TEST_MESSAGE(id.str() << " on " << layout.label);
    Report report(id.str(), layout.configuration);
    ChainOptions o;
    o.seed = 11;
    ShardedChain s(o, shard_options(layout, reshard_after_forward, comm_fusion));
    RefChain ref(o);
    auto opt = adamw(s->parameters());
    auto ref_opt = adamw(ref->parameters());

    Tracker t;
    bool threw = false;
    for (int step = 1; step <= 3; ++step) {
      const Batch global = global_batch(100 + step, o.in, o.out);
      const Batch mine = slice(global, rank, ws);
      const bool fail = step == 2;
      opt.zero_grad();
      if (fail && failure == Failure::kForward) s->blocks[1]->throw_in_forward = true;
      if (fail && failure == Failure::kLateBackward) s->throw_after_block0 = true;
      at::Tensor loss;
      try {
        at::Tensor out = s(mine.x);
        if (failure == Failure::kEarlyBackward) out = ThrowInBackward::apply(out, fail);
        loss = mse(out, mine.y);
        loss.backward();
      } catch (const std::exception& e) {
        s->blocks[1]->throw_in_forward = false;
        s->throw_after_block0 = false;
        const std::string msg = e.what();
        if (!fail || msg.find(kInjected) == std::string::npos) {
          BOOST_ERROR(id.str() << " on " << layout.label << ": step " << step
                               << " threw unexpectedly: " << msg);
          throw;
        }
        threw = true;
        opt.zero_grad();  // what the user does after catching it
        continue;
      }
      s->blocks[1]->throw_in_forward = false;
      s->throw_after_block0 = false;
      if (fail) {
        BOOST_ERROR(id.str() << " on " << layout.label << ": the armed step 2 did not throw");
        continue;
      }
      track_step(t, s, ref, opt, ref_opt, global, loss, layout, step);
    }
    BOOST_TEST(threw, id.str() << " on " << layout.label << ": step 2 never threw");
    std::string shard_why;
    BOOST_TEST(all_sharded(*s, *ref, layout.shard_parts, layout.shard_index, &shard_why),
               id.str() << " on " << layout.label << " rank " << rank
                        << ": after the remaining steps, not local shards: " << shard_why);
    t.publish_into(report, "", " without the failed step");
    report.publish();
  }
}

}  // namespace

BOOST_AUTO_TEST_SUITE(exceptions_leave_nothing_behind,
                      *spmd::needs_world_size_at_least(2, "collectives between ranks"))

BOOST_AUTO_TEST_CASE(exception_in_forward_reshard_after_forward) {  // [ours]
  run_exception_case(Failure::kForward, true, false);
}
BOOST_AUTO_TEST_CASE(exception_in_forward_no_reshard_after_forward) {  // [ours]
  run_exception_case(Failure::kForward, false, false);
}
BOOST_AUTO_TEST_CASE(exception_in_forward_comm_fusion) {  // [ours]
  run_exception_case(Failure::kForward, true, true);
}
BOOST_AUTO_TEST_CASE(exception_early_in_backward_reshard_after_forward) {  // [ours]
  run_exception_case(Failure::kEarlyBackward, true, false);
}
BOOST_AUTO_TEST_CASE(exception_early_in_backward_no_reshard_after_forward) {  // [ours]
  run_exception_case(Failure::kEarlyBackward, false, false);
}
BOOST_AUTO_TEST_CASE(exception_early_in_backward_comm_fusion) {  // [ours]
  run_exception_case(Failure::kEarlyBackward, true, true);
}
BOOST_AUTO_TEST_CASE(exception_late_in_backward_reshard_after_forward) {  // [ours]
  run_exception_case(Failure::kLateBackward, true, false);
}
BOOST_AUTO_TEST_CASE(exception_late_in_backward_no_reshard_after_forward) {  // [ours]
  run_exception_case(Failure::kLateBackward, false, false);
}
BOOST_AUTO_TEST_CASE(exception_late_in_backward_comm_fusion) {  // [ours]
  run_exception_case(Failure::kLateBackward, true, true);
}

BOOST_AUTO_TEST_SUITE_END()
