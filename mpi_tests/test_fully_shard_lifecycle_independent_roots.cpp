// [ours] Independent roots: two independent sharded models trained
// interleaved, or through one backward of loss_a + loss_b; two roots on one
// rank as pipeline stages: one backward through both, and the PP pattern
// (stage 1's backward from a detached input, then stage 0's from that
// input's gradient). Part of the test_fully_shard_lifecycle executable (np 2, 4; gpu2, gpu4; label
// core).
//
// Suite independent_roots (all cases [ours]).
#include "lifecycle_util.h"
#include "tensor_diff.h"

// ================================================================ independent_roots

BOOST_AUTO_TEST_SUITE(independent_roots)

// two_models_trained_interleaved: two independent sharded models A and B (different sizes) in one
// process, each with its own AdamW; (interleaved) forward A, forward B,
// backward A, backward B; (joint) one backward of loss_a + loss_b.
BOOST_AUTO_TEST_CASE(two_models_trained_interleaved,  // [ours]
                     *spmd::needs_world_size_at_least(2, "collectives between ranks")) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const Layout layout = layout_1d();
  for (const bool joint : {false, true}) {
    const std::string id = std::string("two models ") +
                           (joint ? "one backward of loss_a + loss_b"
                                  : "interleaved fwd A, fwd B, bwd A, bwd B");
    Report report(id, layout.configuration);
    ChainOptions oa, ob;
    oa.seed = 41;
    ob.seed = 42;
    ob.in = 5;
    ob.hidden = 12;
    ob.out = 4;
    ob.blocks = 2;
    ShardedChain a(oa, shard_options(layout));
    ShardedChain b(ob, shard_options(layout));
    RefChain ref_a(oa), ref_b(ob);
    auto opt_a = adamw(a->parameters()), opt_b = adamw(b->parameters());
    auto ref_opt_a = adamw(ref_a->parameters()), ref_opt_b = adamw(ref_b->parameters());
    Tracker ta, tb;
    for (int step = 1; step <= 3; ++step) {
      const std::string what = "step " + std::to_string(step);
      const Batch ga = global_batch(500 + step, oa.in, oa.out);
      const Batch gb = global_batch(550 + step, ob.in, ob.out);
      const Batch ma = slice(ga, rank, ws), mb = slice(gb, rank, ws);
      opt_a.zero_grad();
      opt_b.zero_grad();
      at::Tensor la = mse(a(ma.x), ma.y);
      at::Tensor lb = mse(b(mb.x), mb.y);
      if (joint) {
        (la + lb).backward();
      } else {
        la.backward();
        lb.backward();
      }
      ref_opt_a.zero_grad();
      ref_opt_b.zero_grad();
      const auto ra = ref_backward(ref_a, ga);
      const auto rb = ref_backward(ref_b, gb);
      ta.losses(la.item<double>(), ra[rank]);
      tb.losses(lb.item<double>(), rb[rank]);
      ta.grads(*a, *ref_a, layout, what);
      tb.grads(*b, *ref_b, layout, what);
      opt_a.step();
      opt_b.step();
      ref_opt_a.step();
      ref_opt_b.step();
      ta.params(*a, *ref_a, layout, what);
      tb.params(*b, *ref_b, layout, what);
    }
    ta.publish_into(report, "model A ");
    tb.publish_into(report, "model B ");
    report.publish();
  }
}

// two_pipeline_stage_roots_on_one_rank: two pipeline stages whose roots live on this rank, each sharded on its
// own (blocks, then the stage root); y = stage1(stage0(x)). (joint) one
// backward through both; (pp) stage 1's backward from a detached stage-0
// output that requires grad, then stage 0's backward from that input's grad.
BOOST_AUTO_TEST_CASE(two_pipeline_stage_roots_on_one_rank,  // [ours]
                     *spmd::needs_world_size_at_least(2, "collectives between ranks")) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const Layout layout = layout_1d();
  for (const bool pp : {false, true}) {
    const std::string id = std::string("two stage roots ") +
                           (pp ? "pp backward (stage 1, then stage 0 from the input grad)"
                               : "one backward through both");
    Report report(id, layout.configuration);
    ChainOptions o0, o1;
    o0.seed = 51;
    o0.blocks = 2;
    o0.head = false;
    o1.seed = 52;
    o1.blocks = 2;
    o1.inp = false;
    ShardedChain s0(o0, shard_options(layout));
    ShardedChain s1(o1, shard_options(layout));
    BOOST_TEST(s0.root.is_root());
    BOOST_TEST(s1.root.is_root());
    RefChain r0(o0), r1(o1);
    auto opt0 = adamw(s0->parameters()), opt1 = adamw(s1->parameters());
    auto ref_opt0 = adamw(r0->parameters()), ref_opt1 = adamw(r1->parameters());
    Tracker t0, t1;
    double boundary_err = 0;
    for (int step = 1; step <= 2; ++step) {
      const std::string what = "step " + std::to_string(step);
      const Batch global = global_batch(600 + step, o0.in, o1.out);
      const Batch mine = slice(global, rank, ws);
      opt0.zero_grad();
      opt1.zero_grad();
      at::Tensor loss;
      if (pp) {
        at::Tensor x0 = s0(mine.x);
        at::Tensor in1 = x0.detach().requires_grad_(true);
        loss = mse(s1(in1), mine.y);
        loss.backward();
        BOOST_TEST_REQUIRE(in1.grad().defined(), id << ": the stage-1 input got no gradient");
        const at::Tensor boundary = in1.grad().detach().clone();
        torch::autograd::backward({x0}, {boundary});
        // Reference: d(mean over ranks of loss_r)/d(x0) restricted to this
        // rank's rows is 1/ws of the micro-batch gradient (ws: a power of 2).
        ref_opt0.zero_grad();
        ref_opt1.zero_grad();
        at::Tensor rx0 = r0(global.x);
        rx0.retain_grad();
        at::Tensor total;
        for (int r = 0; r < ws; ++r) {
          const Batch sl = slice(global, r, ws);
          const int64_t per = global.x.size(0) / ws;
          at::Tensor l = mse(r1(rx0.narrow(0, r * per, per)), sl.y);
          if (r == rank) t1.losses(loss.item<double>(), l.item<double>());
          total = total.defined() ? total + l : l;
        }
        (total / ws).backward();
        const int64_t per = global.x.size(0) / ws;
        worsen(boundary_err,
               testkit::max_abs_diff_or_inf(
                   boundary, rx0.grad().narrow(0, rank * per, per) * static_cast<double>(ws)));
      } else {
        loss = mse(s1(s0(mine.x)), mine.y);
        loss.backward();
        ref_opt0.zero_grad();
        ref_opt1.zero_grad();
        at::Tensor total;
        for (int r = 0; r < ws; ++r) {
          const Batch sl = slice(global, r, ws);
          at::Tensor l = mse(r1(r0(sl.x)), sl.y);
          if (r == rank) t1.losses(loss.item<double>(), l.item<double>());
          total = total.defined() ? total + l : l;
        }
        (total / ws).backward();
      }
      t0.grads(*s0, *r0, layout, what);
      t1.grads(*s1, *r1, layout, what);
      opt0.step();
      opt1.step();
      ref_opt0.step();
      ref_opt1.step();
      t0.params(*s0, *r0, layout, what);
      t1.params(*s1, *r1, layout, what);
    }
    if (pp) report.check("stage-boundary grad vs single card", boundary_err, kTol);
    t1.publish_into(report, "composed loss / stage 1 ");  // the loss is the composed model's
    report.check("stage 0 sharded grads vs single card", t0.grad, kTol, t0.grad_why);
    report.check("stage 0 params vs single card", t0.data, kTol, t0.data_why);
    report.publish();
  }
}

BOOST_AUTO_TEST_SUITE_END()
