// [ours] Parameters and units that take no part in a step:
//  - params_without_grad_keep_none: a parameter that takes no part in the
//    loss keeps no gradient, and AdamW with weight decay leaves it
//    bit-identical; a parameter with a gradient on some ranks only gets the
//    mean over ranks with zeros from the others; a unit whose output is not
//    used in the loss is resharded after backward and keeps no gradients;
//  - same_collectives_whatever_the_data: ranks that leave different
//    parameters without gradients still issue the same collectives in the
//    same order (no hang, right values);
//  - prefetched_unit_that_did_not_run_regathers_updated_shards: a unit
//    prefetched by another's forward that then does not run computes, when it
//    next runs, with the shards as the optimizer left them (its unused
//    all-gather is dropped, not reused).
// Part of the test_fully_shard_lifecycle executable (np 2, 4; gpu2, gpu4; label core).
#include "lifecycle_util.h"
#include "tensor_diff.h"

// ================================================================ params_without_grad_keep_none
// Parameters without a gradient keep none.

BOOST_AUTO_TEST_SUITE(params_without_grad_keep_none)

// (i) block1.spare is registered but never used: on every rank it gets no
// gradient; AdamW (weight_decay > 0) skips it, so it stays bit-identical.
BOOST_AUTO_TEST_CASE(unused_param_has_no_grad_and_is_not_decayed,  // [ours]
                     *spmd::needs_world_size_at_least(2, "collectives between ranks")) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const Layout layout = layout_1d();
  Report report("unused parameter keeps no grad", layout.configuration);
  ChainOptions o;
  o.seed = 21;
  o.spare_block = 1;
  ShardedChain s(o, shard_options(layout));
  RefChain ref(o);
  auto opt = adamw(s->parameters(), 0.1);
  auto ref_opt = adamw(ref->parameters(), 0.1);
  const at::Tensor w0 = s->blocks[1]->spare->weight.detach().to(at::kCPU).clone();
  const at::Tensor b0 = s->blocks[1]->spare->bias.detach().to(at::kCPU).clone();

  Tracker t;
  double spare_change = 0;
  for (int step = 1; step <= 3; ++step) {
    const Batch global = global_batch(200 + step, o.in, o.out);
    const Batch mine = slice(global, rank, ws);
    opt.zero_grad();
    at::Tensor loss = mse(s(mine.x), mine.y);
    loss.backward();
    ref_opt.zero_grad();
    const auto ref_losses = ref_backward(ref, global);
    t.losses(loss.item<double>(), ref_losses[rank]);
    const std::vector<std::pair<std::string, at::Tensor>> spare_params = {
        {"weight", s->blocks[1]->spare->weight}, {"bias", s->blocks[1]->spare->bias}};
    for (const auto& [name, param] : spare_params) {
      const at::Tensor g = param.grad();
      std::string state = "undefined";
      if (g.defined()) {
        state = g.numel() == 0 || g.abs().max().item<double>() == 0.0 ? "defined (all zeros)"
                                                                      : "defined (nonzero)";
      }
      BOOST_TEST(!g.defined(), "unused parameter: rank " << rank << " step " << step << ": block1.spare."
                                             << name << ".grad() is " << state
                                             << ", expected undefined");
    }
    t.grads(*s, *ref, layout, "step " + std::to_string(step));
    opt.step();
    ref_opt.step();
    worsen(spare_change, testkit::max_abs_diff_or_inf(s->blocks[1]->spare->weight, w0));
    worsen(spare_change, testkit::max_abs_diff_or_inf(s->blocks[1]->spare->bias, b0));
    t.params(*s, *ref, layout, "step " + std::to_string(step));
  }
  report.check("unused param change over 3 AdamW steps (bitwise)", spare_change, 0.0);
  t.publish_into(report, "", " (undefined where single card has none)");
  report.publish();
}

// (ii) block1 has branch_a / branch_b: even ranks use a, odd ranks b. Each
// branch's sharded gradient is the mean over ranks with zeros from the
// ranks that did not use it; every rank holds its shard of it.
BOOST_AUTO_TEST_CASE(param_with_grad_on_some_ranks_gets_mean_with_zeros,  // [ours]
                     *spmd::needs_world_size_at_least(2, "one per branch")) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const Layout layout = layout_1d();
  Report report("rank-dependent branch", layout.configuration);
  ChainOptions o;
  o.seed = 22;
  o.branch_block = 1;
  ShardedChain s(o, shard_options(layout));
  RefChain ref(o);
  auto opt = adamw(s->parameters());
  auto ref_opt = adamw(ref->parameters());
  Tracker t;
  for (int step = 1; step <= 2; ++step) {
    const Batch global = global_batch(300 + step, o.in, o.out);
    const Batch mine = slice(global, rank, ws);
    opt.zero_grad();
    s->blocks[1]->use_branch_b = rank % 2 == 1;
    at::Tensor loss = mse(s(mine.x), mine.y);
    loss.backward();
    ref_opt.zero_grad();
    const auto ref_losses =
        ref_backward(ref, global, [&](int r) { ref->blocks[1]->use_branch_b = r % 2 == 1; });
    t.losses(loss.item<double>(), ref_losses[rank]);
    const std::vector<std::pair<std::string, torch::nn::Linear>> branches = {
        {"branch_a", s->blocks[1]->branch_a}, {"branch_b", s->blocks[1]->branch_b}};
    for (const auto& [branch, lin] : branches) {
      for (const auto& item : lin->named_parameters()) {
        BOOST_TEST(item.value().grad().defined(),
                   "rank-dependent branch: rank " << rank << " step " << step << ": block1." << branch << "."
                                  << item.key() << ".grad() undefined (used on "
                                  << (branch == "branch_a" ? "even" : "odd") << " ranks)");
      }
    }
    t.grads(*s, *ref, layout, "step " + std::to_string(step));
    opt.step();
    ref_opt.step();
    t.params(*s, *ref, layout, "step " + std::to_string(step));
  }
  t.publish_into(report, "", " (missing ranks contribute zeros)");
  report.publish();
}

// (iii) block1's output is computed and dropped: after backward every unit is
// resharded (each parameter has its local shard shape) and block1's
// parameters have no gradients.
BOOST_AUTO_TEST_CASE(unit_with_unused_output_is_resharded_without_grads,  // [ours]
                     *spmd::needs_world_size_at_least(2, "collectives between ranks")) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const Layout layout = layout_1d();
  for (const bool raf : {true, false}) {
    const std::string id = std::string("unit output unused reshard_after_forward=") +
                           (raf ? "true" : "false");
    Report report(id, layout.configuration);
    ChainOptions o;
    o.seed = 23;
    ShardedChain s(o, shard_options(layout, raf));
    RefChain ref(o);
    s->discard_block = 1;
    ref->discard_block = 1;
    auto opt = adamw(s->parameters());
    auto ref_opt = adamw(ref->parameters());
    Tracker t;
    for (int step = 1; step <= 2; ++step) {
      const Batch global = global_batch(400 + step, o.in, o.out);
      const Batch mine = slice(global, rank, ws);
      opt.zero_grad();
      at::Tensor loss = mse(s(mine.x), mine.y);
      loss.backward();
      std::string shard_why;
      BOOST_TEST(all_sharded(*s, *ref, layout.shard_parts, layout.shard_index, &shard_why),
                 id << " rank " << rank << " step " << step
                    << ": after backward, not resharded: " << shard_why);
      for (const auto& p : s->blocks[1]->named_parameters()) {
        BOOST_TEST(!p.value().grad().defined(),
                   id << " rank " << rank << " step " << step << ": block1." << p.key()
                      << ".grad() is defined, expected undefined (its output is not used)");
      }
      track_step(t, s, ref, opt, ref_opt, global, loss, layout, step);
    }
    t.publish_into(report, "", " (undefined where single card has none)");
    report.publish();
  }
}

BOOST_AUTO_TEST_SUITE_END()

// ================================================================ same_collectives_whatever_the_data
// Last in the file: against a core that issues collectives in readiness
// order, it can hang, and the harness's watchdog then aborts the whole job.

BOOST_AUTO_TEST_SUITE(same_collectives_whatever_the_data)

// Each block has 3 sub-layers; rank r leaves out sub-layer r % 3 of block b
// where (r + b) % 3 == 0, so which units see every gradient, and hence when
// each unit's post-backward is ready, differs per rank. Every sub-layer is
// used on some rank (so every parameter gets a gradient on every rank).
BOOST_AUTO_TEST_CASE(rank_dependent_unused_params_same_collectives,  // [ours]
                     *spmd::needs_world_size_at_least(2, "collectives between ranks")) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const Layout layout = layout_1d();
  Report report("rank-dependent unused sub-layers", layout.configuration);
  ChainOptions o;
  o.seed = 31;
  o.subs = 3;
  const auto skips = [&](int r, int64_t b) {
    std::vector<bool> skip(3, false);
    if ((r + b) % 3 == 0) skip[static_cast<size_t>(r % 3)] = true;
    return skip;
  };
  ShardedChain s(o, shard_options(layout));
  RefChain ref(o);
  for (int64_t b = 0; b < o.blocks; ++b) s->blocks[b]->skip = skips(rank, b);
  auto opt = adamw(s->parameters());
  auto ref_opt = adamw(ref->parameters());
  Tracker t;
  for (int step = 1; step <= 3; ++step) {
    const std::string what = "step " + std::to_string(step);
    const Batch global = global_batch(700 + step, o.in, o.out);
    const Batch mine = slice(global, rank, ws);
    opt.zero_grad();
    at::Tensor loss = mse(s(mine.x), mine.y);
    loss.backward();
    ref_opt.zero_grad();
    const auto ref_losses = ref_backward(ref, global, [&](int r) {
      for (int64_t b = 0; b < o.blocks; ++b) ref->blocks[b]->skip = skips(r, b);
    });
    worsen(t.loss, std::abs(loss.item<double>() - ref_losses[rank]));
    t.grads(*s, *ref, layout, what);
    opt.step();
    ref_opt.step();
    t.params(*s, *ref, layout, what);
  }
  t.publish_into(report, "");
  report.publish();
}

BOOST_AUTO_TEST_SUITE_END()

// ------------------------------------------- unused prefetched gathers

namespace {

struct BranchImpl : torch::nn::Module {
  BranchImpl() {
    at::manual_seed(11);
    a = register_module("a", torch::nn::Linear(6, 6));
    b = register_module("b", torch::nn::Linear(6, 6));
  }
  at::Tensor forward(at::Tensor x) {
    at::Tensor h = at::tanh(a(x));
    return use_b ? b(h) : h;
  }
  fsdp::Sharded<torch::nn::Linear> a{nullptr}, b{nullptr};
  bool use_b = true;
};
TORCH_MODULE(Branch);

}  // namespace

// a's forward prefetches b, whose forward does not run (a branch not
// taken). The optimizer then updates b's shards in place; the next forward
// that runs b must compute with the updated values, not with the all-gather
// issued before the update. With and without a backward in between (the
// root's post-backward and its next pre-forward both drop such gathers).
BOOST_AUTO_TEST_CASE(prefetched_unit_that_did_not_run_regathers_updated_shards) {  // [ours]
  const auto dev = spmd::device();
  for (const bool with_backward : {true, false}) {
    BOOST_TEST_CONTEXT((with_backward ? "forward + backward" : "forward only")) {
      Branch model;
      model->to(dev);
      const at::Tensor wa = model->a->weight.detach().clone(), ba = model->a->bias.detach().clone();
      const at::Tensor wb = model->b->weight.detach().clone(), bb = model->b->bias.detach().clone();
      fsdp::FSDPModule ua = fsdp::fully_shard(model->a);
      fsdp::FSDPModule ub = fsdp::fully_shard(model->b);
      fsdp::Sharded<Branch> root = fsdp::fully_shard(model);
      ua.set_modules_to_forward_prefetch({ub});
      at::manual_seed(5);
      const at::Tensor x = at::randn({3, 6}, at::TensorOptions().device(dev));
      model->use_b = false;
      const at::Tensor h = root(x);
      if (with_backward) h.sum().backward();
      // An optimizer step on b's shards, in place (b took no part: a plain
      // update stands for one).
      {
        at::NoGradGuard no_grad;
        for (auto& p : model->b->parameters()) p.add_(1.0);
      }
      model->use_b = true;
      const at::Tensor out = root(x);
      const at::Tensor want = at::linear(at::tanh(at::linear(x, wa, ba)), wb + 1.0, bb + 1.0);
      const double err = (out.detach() - want).abs().max().item<double>();
      BOOST_TEST(err <= kTol, "b computed with stale shards: max error " << err);
    }
  }
}
