// Resharding controls of FSDPModule (plan target _test_fully_shard_module.py):
// dynamic set_reshard_after_forward / set_reshard_after_backward (L1-01),
// manual reshard() / unshard() (L1-05), and the plan's existing rows for
// static reshard_after_forward and forward / backward prefetch. Part of the
// test_fully_shard_module executable (np 1, 2, 4; gpu1, gpu2, gpu4).
//
// Cases:
//   test_dynamic_reshard_control            L1-01
//   test_manual_reshard_unshard_lifecycle   L1-05
//   test_reshard_after_forward_static       existing: reshard_after_forward=True/False
//   test_forward_prefetch_order             existing: set_modules_to_forward_prefetch
//   test_backward_prefetch_order            existing: set_modules_to_backward_prefetch
//
// Baseline everywhere: the same model unsharded on one card (same seed), run
// on the whole global batch; a rank's sharded gradient must equal its rows of
// the single-card gradient. Each case prints its worst error over all ranks as
// "[<id>] <what>: worst <err> (tol <tol>)".
#include "fully_shard_module_util.h"
#include "tensor_diff.h"

#include <chrono>
#include <thread>

// ============================================================================
// L1-01: set_reshard_after_forward / set_reshard_after_backward at run time.
// ============================================================================
BOOST_AUTO_TEST_CASE(test_dynamic_reshard_control, *multi_rank()) {  // L1-01
  const int ws = spmd::world_size();
  l1::Report rep("L1-01");
  const int64_t seed = 11;
  l1::ShardedMlp m(seed, per_param_options());

  // One training step on batch `bseed`: returns the all-gathers it issued,
  // checks numel after forward/backward and the grads vs single card.
  auto step = [&](int64_t bseed, const std::string& label, const std::string& full_after_fwd,
                  bool full_after_bwd) {
    const auto global = toy::global_batch(bseed, kRows);
    m.root.zero_grad();
    fsdp::reset_collective_counters();
    at::Tensor loss = m.loss(mine(global));
    // After forward: the named prefix is full ("" = all, "-" = none), the rest sharded.
    for (const std::string& prefix : {std::string("fc1"), std::string("fc2"), std::string("fc3")}) {
      const bool full = full_after_fwd == "" || full_after_fwd.find(prefix) != std::string::npos;
      const std::string mis = numel_mismatch(m, prefix, full);
      BOOST_TEST(mis.empty(), label << ": after forward: " << mis);
    }
    loss.backward();
    const int64_t gathers = fsdp::collective_counters().total("all_gather");
    const std::string mis = numel_mismatch(m, "", full_after_bwd);
    BOOST_TEST(mis.empty(), label << ": after backward: " << mis);
    if (full_after_bwd) {
      // The sharded grads are installed on the shards: reshard to read them.
      BOOST_CHECK_NO_THROW(m.root.reshard());
      BOOST_CHECK_NO_THROW(m.fc1.reshard());
      BOOST_CHECK_NO_THROW(m.fc2.reshard());
      const std::string mis2 = numel_mismatch(m, "", false);
      BOOST_TEST(mis2.empty(), label << ": after reshard(): " << mis2);
    }
    rep.check(label + ": grads vs single card", grad_err(m, ref_grads(seed, {global})),
              kGradTol);
    return gathers;
  };

  // Toggling never throws (recurse and not, on every unit, repeatedly).
  for (bool v : {false, true, false, true}) {
    BOOST_CHECK_NO_THROW(m.root.set_reshard_after_forward(v));
    BOOST_CHECK_NO_THROW(m.root.set_reshard_after_backward(v));
    BOOST_CHECK_NO_THROW(m.root.set_reshard_after_forward(v, /*recurse=*/false));
    BOOST_CHECK_NO_THROW(m.fc1.set_reshard_after_backward(v, /*recurse=*/false));
  }

  // reshard_after_forward=false: parameters stay full after forward, one
  // all-gather per parameter per step.
  m.root.set_reshard_after_forward(false);
  int64_t ag = step(101, "raf=false", "", false);
  BOOST_TEST(ag == kMlpParams, "raf=false: all-gathers per step " << ag << ", expected "
                                                                   << kMlpParams);
  // Toggled back to true: shards after forward, re-gathered for backward.
  m.root.set_reshard_after_forward(true);
  ag = step(102, "raf=true", "-", false);
  BOOST_TEST(ag == 2 * kMlpParams, "raf=true: all-gathers per step " << ag << ", expected "
                                                                      << 2 * kMlpParams);
  // recurse=false on the root: only the root's own parameters (fc3) stay full.
  m.root.set_reshard_after_forward(false, /*recurse=*/false);
  ag = step(103, "root-only raf=false", "fc3", false);
  BOOST_TEST(ag == 2 * 4 + 2, "root-only raf=false: all-gathers per step " << ag
                                                                           << ", expected 10");
  // Unset (the default, FSDP2's None): every unit but the root reshards, so
  // fc3 stays full from forward to backward -- and resharded after it.
  BOOST_TEST(!fsdp::FullyShardOptions{}.reshard_after_forward.is_set());
  m.root.set_reshard_after_forward(fsdp::ReshardAfterForward());
  ag = step(104, "raf unset", "fc3", false);
  BOOST_TEST(ag == kMlpGathersPerStep, "raf unset: all-gathers per step "
                                           << ag << ", expected " << kMlpGathersPerStep);
  {
    // Without grad mode no backward follows: the root reshards as well.
    at::NoGradGuard no_grad;
    m.loss(mine(toy::global_batch(105, kRows)));
    const std::string mis = numel_mismatch(m, "", false);
    BOOST_TEST(mis.empty(), "raf unset, forward without grad: " << mis);
  }
  m.root.set_reshard_after_forward(true);

  // reshard_after_backward=false: parameters stay full after backward.
  m.root.set_reshard_after_backward(false);
  ag = step(104, "rab=false", "-", true);
  BOOST_TEST(ag == 2 * kMlpParams, "rab=false: all-gathers per step " << ag);
  // Toggled back to true: shards after backward.
  m.root.set_reshard_after_backward(true);
  ag = step(105, "rab=true", "-", false);
  BOOST_TEST(ag == 2 * kMlpParams, "rab=true: all-gathers per step " << ag);

  // Toggled between forward and backward of one step.
  {
    const auto global = toy::global_batch(106, kRows);
    m.root.zero_grad();
    at::Tensor loss = m.loss(mine(global));
    BOOST_CHECK_NO_THROW(m.root.set_reshard_after_backward(false));
    loss.backward();
    const std::string mis = numel_mismatch(m, "", true);
    BOOST_TEST(mis.empty(), "rab=false set mid-step: after backward: " << mis);
    m.root.set_reshard_after_backward(true);
    m.root.reshard();
    m.fc1.reshard();
    m.fc2.reshard();
    rep.check("rab=false set mid-step: grads vs single card",
              grad_err(m, ref_grads(seed, {global})), kGradTol);
  }

  // The same with comm_fusion: one all-gather per unit per pass, so
  // 2 per unit per step with raf=true and 1 with raf=false.
  {
    fsdp::FullyShardOptions o;
    o.comm_fusion = true;
    l1::ShardedMlp f(seed, o);
    for (bool raf : {true, false, true}) {
      f.root.set_reshard_after_forward(raf);
      const auto global = toy::global_batch(raf ? 107 : 108, kRows);
      f.root.zero_grad();
      fsdp::reset_collective_counters();
      at::Tensor loss = f.loss(mine(global));
      const std::string mis = numel_mismatch(f, "", !raf);
      BOOST_TEST(mis.empty(), "fused raf=" << raf << ": after forward: " << mis);
      loss.backward();
      const int64_t gathers = fsdp::collective_counters().total("all_gather");
      const int64_t expect = raf ? 2 * 3 : 3;
      BOOST_TEST(gathers == expect, "fused raf=" << raf << ": all-gathers per step " << gathers
                                                 << ", expected " << expect << " (3 units)");
      rep.check(std::string("fused raf=") + (raf ? "true" : "false") + ": grads vs single card",
                grad_err(f, ref_grads(seed, {global})), kGradTol);
    }
  }
  BOOST_TEST_MESSAGE("world size " << ws);
  rep.publish();
}

// ============================================================================
// L1-05: reshard() / unshard() lifecycle.
// ============================================================================
BOOST_AUTO_TEST_CASE(test_manual_reshard_unshard_lifecycle, *multi_rank()) {  // L1-05
  const int ws = spmd::world_size(), rank = spmd::rank();
  l1::Report rep("L1-05");
  const int64_t seed = 51;
  l1::ShardedMlp m(seed, per_param_options());
  toy::Mlp ref(seed);  // full single-card weights

  auto full_err = [&](const std::string& prefix) {
    double worst = 0;
    auto ref_params = ref->named_parameters();
    for (const auto& item : m.model->named_parameters()) {
      if (item.key().rfind(prefix, 0) != 0) continue;
      worst =
          std::max(worst, testkit::max_abs_diff_or_inf(item.value(), *ref_params.find(item.key())));
    }
    return worst;
  };
  auto expect_numel = [&](const std::string& prefix, bool full, const std::string& when) {
    const std::string mis = numel_mismatch(m, prefix, full);
    BOOST_TEST(mis.empty(), when << ": " << mis);
  };

  expect_numel("", false, "after fully_shard");
  // reshard() on sharded units: idempotent, no collectives.
  fsdp::reset_collective_counters();
  BOOST_CHECK_NO_THROW(m.root.reshard());
  BOOST_CHECK_NO_THROW(m.root.reshard());
  BOOST_CHECK_NO_THROW(m.fc1.reshard());
  BOOST_TEST(fsdp::collective_counters().sequence.empty(), "reshard() of a sharded unit communicated");
  expect_numel("", false, "after repeated reshard()");

  // unshard() twice: the root's own parameters (fc3) become full, once.
  fsdp::reset_collective_counters();
  BOOST_CHECK_NO_THROW(m.root.unshard());
  BOOST_CHECK_NO_THROW(m.root.unshard());
  const int64_t ag = fsdp::collective_counters().total("all_gather");
  BOOST_TEST(ag == 2, "two unshard() calls issued " << ag << " all-gathers, expected 2 (fc3)");
  expect_numel("fc3", true, "root after unshard() x2");
  expect_numel("fc1", false, "fc1 after root.unshard()");
  rep.check("root unshard(): fc3 data vs full single-card weights", full_err("fc3"), 0.0);

  // Sync unshard of a nested unit, then reshard everything, twice.
  BOOST_CHECK_NO_THROW(m.fc1.unshard());
  expect_numel("fc1", true, "fc1 after unshard()");
  rep.check("fc1 unshard(): data vs full single-card weights", full_err("fc1"), 0.0);
  for (int i = 0; i < 2; ++i) {
    BOOST_CHECK_NO_THROW(m.root.reshard());
    BOOST_CHECK_NO_THROW(m.fc1.reshard());
  }
  expect_numel("", false, "after reshard() x2");
  rep.check("after reshard(): shards vs single-card rows",
            l1::data_err(m.module(), *ref, ws, rank), 0.0);

  // unshard(async_op=true): read only after handle.wait(); wait is idempotent.
  fsdp::UnshardHandle h2 = m.fc2.unshard(/*async_op=*/true);
  fsdp::UnshardHandle h3 = m.root.unshard(/*async_op=*/true);
  BOOST_CHECK_NO_THROW(h2.wait());
  BOOST_CHECK_NO_THROW(h3.wait());
  BOOST_CHECK_NO_THROW(h2.wait());
  expect_numel("fc2", true, "fc2 after unshard(async) + wait()");
  expect_numel("fc3", true, "fc3 after unshard(async) + wait()");
  rep.check("unshard(async) + wait(): fc2 data vs full single-card weights", full_err("fc2"), 0.0);
  rep.check("unshard(async) + wait(): fc3 data vs full single-card weights", full_err("fc3"), 0.0);
  BOOST_CHECK_NO_THROW(m.fc1.unshard(/*async_op=*/true).wait());
  expect_numel("fc1", true, "fc1 after unshard(async).wait()");

  // Asynchronous for real: with the other ranks 600 ms late, rank 0's
  // unshard(async_op=true) returns at once (its all-gather cannot have
  // completed) and its wait() blocks until they have joined. A synchronous
  // unshard would spend the 600 ms in the call.
  m.fc1.reshard();
  {
    raw_mpi::barrier();
    const auto t0 = std::chrono::steady_clock::now();
    auto since = [&t0] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    if (rank != 0) std::this_thread::sleep_for(std::chrono::milliseconds(600));
    fsdp::UnshardHandle h = m.fc1.unshard(/*async_op=*/true);
    const double returned = since();
    h.wait();
    const double done = since();
    if (rank == 0) {
      BOOST_TEST(returned < 0.3, "unshard(async_op=true) took " << returned
                                     << " s to return while the other ranks were 0.6 s late");
      BOOST_TEST(done > 0.4, "wait() returned after " << done
                                 << " s, before the late ranks could have joined the all-gather");
    }
    expect_numel("fc1", true, "fc1 after a late unshard(async) + wait()");
    rep.check("late unshard(async) + wait(): fc1 data vs full single-card weights", full_err("fc1"),
              0.0);
  }

  // An async unshard then reshard() without waiting: no throw, back to shards.
  m.fc1.reshard();
  (void)m.fc1.unshard(/*async_op=*/true);
  BOOST_CHECK_NO_THROW(m.fc1.reshard());
  expect_numel("fc1", false, "fc1 after unshard(async) + reshard()");

  // Training from a manually unsharded state: grads still match single card,
  // and the step leaves everything sharded.
  const auto global = toy::global_batch(501, kRows);
  m.step(mine(global));
  expect_numel("", false, "after a step from manually unsharded units");
  rep.check("grads after the lifecycle vs single card", grad_err(m, ref_grads(seed, {global})),
            kGradTol);
  m.root.reshard();
  m.fc2.reshard();
  expect_numel("", false, "after final reshard()");
  rep.check("shards after the lifecycle vs single-card rows",
            l1::data_err(m.module(), *ref, ws, rank), 0.0);
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_reshard_after_forward_static, *multi_rank()) {  // existing: raf=True/False
  l1::Report rep("reshard_after_forward_static");
  for (bool raf : {true, false}) {
    const std::string tag = std::string("raf=") + (raf ? "true" : "false");
    fsdp::FullyShardOptions o = per_param_options();
    o.reshard_after_forward = raf;
    l1::ShardedMlp m(64, o);
    for (int64_t k = 0; k < 2; ++k) {
      const auto global = toy::global_batch(640 + k, kRows);
      m.root.zero_grad();
      fsdp::reset_collective_counters();
      at::Tensor loss = m.loss(mine(global));
      const std::string mis = numel_mismatch(m, "", !raf);
      BOOST_TEST(mis.empty(), tag << ": after forward: " << mis);
      loss.backward();
      const int64_t ag = fsdp::collective_counters().total("all_gather");
      const int64_t expect = raf ? 2 * kMlpParams : kMlpParams;
      BOOST_TEST(ag == expect, tag << ": all-gathers per step " << ag << ", expected " << expect);
      const std::string mis2 = numel_mismatch(m, "", false);
      BOOST_TEST(mis2.empty(), tag << ": after backward: " << mis2);
      rep.check(tag + ": grads vs single card", grad_err(m, ref_grads(64, {global})), kGradTol);
    }
  }
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_forward_prefetch_order, *multi_rank()) {  // existing
  l1::Report rep("forward_prefetch");
  const int64_t seed = 66;
  const auto global = chain_batch(661);
  const auto b = mine(global);
  // "first step": no previous forward to learn the order from, so nothing
  // is prefetched; "explicit": b0 -> b1 -> b2; "implicit": the default from
  // the second step on (the unit that ran next in the previous step);
  // "disabled": explicit empty lists, second step.
  for (const std::string tag : {"first step", "explicit", "implicit", "disabled"}) {
    ShardedChain c(seed, per_param_options());
    if (tag == "explicit") {
      c.u[0].set_modules_to_forward_prefetch({c.u[1]});
      c.u[1].set_modules_to_forward_prefetch({c.u[2]});
    }
    if (tag == "implicit" || tag == "disabled") {
      if (tag == "disabled") {
        for (auto& u : c.u) u.set_modules_to_forward_prefetch({});
        c.root.set_modules_to_forward_prefetch({});
      }
      // A first step (forward and backward) teaches the forward order; its
      // gradients are dropped so the checked step is the same as the others.
      c.loss(b).backward();
      c.root.zero_grad();
    }
    const bool prefetch = tag == "explicit" || tag == "implicit";
    fsdp::reset_collective_counters();
    at::Tensor loss = c.loss(b);
    const auto fwd = fsdp::collective_counters();
    for (int i = 0; i < 2; ++i) {
      const int64_t next_ag = l1::find_record(fwd, "all_gather", block_gather_bytes(i + 1));
      const int64_t done = l1::find_record(fwd, "broadcast", marker_bytes(i));
      BOOST_TEST(next_ag >= 0);
      BOOST_TEST(done >= 0);
      if (prefetch) {
        BOOST_TEST(next_ag < done, tag << ": b" << i + 1 << "'s all-gather (#" << next_ag
                                       << ") not issued before b" << i << "'s forward compute "
                                       << "finished (#" << done << "): " << l1::describe_sequence(fwd));
      } else {
        BOOST_TEST(next_ag > done, tag << ": b" << i + 1 << "'s all-gather (#" << next_ag
                                       << ") issued before b" << i << "'s forward finished (#"
                                       << done << "): " << l1::describe_sequence(fwd));
      }
    }
    BOOST_TEST(fwd.total("all_gather") == 5, tag << ": forward all-gathers "
                                                 << fwd.total("all_gather") << ", expected 5");
    loss.backward();
    rep.check(tag + ": grads vs single card", chain_grad_err(c, seed, global), kGradTol);
  }
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_backward_prefetch_order, *multi_rank()) {  // existing
  l1::Report rep("backward_prefetch");
  const int64_t seed = 67;
  const auto global = chain_batch(671);
  const auto b = mine(global);
  // "none": explicit empty lists; "explicit": b2 -> b1 -> b0; "implicit":
  // implicit_backward_prefetch=true (reverse forward order); "default":
  // implicit on CUDA, none on the CPU.
  const bool default_prefetches = spmd::device().is_cuda();
  for (const std::string mode : {"none", "explicit", "implicit", "default"}) {
    fsdp::FullyShardOptions options = per_param_options();
    if (mode == "implicit") options.implicit_backward_prefetch = true;
    ShardedChain c(seed, options);
    const bool prefetches = mode == "default" ? default_prefetches : mode != "none";
    if (mode == "none") {
      for (auto& u : c.u) u.set_modules_to_backward_prefetch({});
      c.root.set_modules_to_backward_prefetch({});
    } else if (mode == "explicit") {
      c.u[2].set_modules_to_backward_prefetch({c.u[1]});
      c.u[1].set_modules_to_backward_prefetch({c.u[0]});
    }
    at::Tensor loss = c.loss(b);
    fsdp::reset_collective_counters();
    loss.backward();
    const auto bwd = fsdp::collective_counters();
    for (int i = 2; i >= 1; --i) {
      const int64_t prev_ag = l1::find_record(bwd, "all_gather", block_gather_bytes(i - 1));
      const int64_t done = l1::find_record(bwd, "broadcast", marker_bytes(kBackwardMarker + i));
      BOOST_TEST(prev_ag >= 0);
      BOOST_TEST(done >= 0);
      if (!prefetches) {
        BOOST_TEST(prev_ag > done, mode << ": b" << i - 1 << "'s all-gather (#" << prev_ag
                                        << ") issued before b" << i << "'s backward finished (#"
                                        << done << "): " << l1::describe_sequence(bwd));
      } else {
        BOOST_TEST(prev_ag < done, mode << ": b" << i - 1 << "'s all-gather (#" << prev_ag
                                        << ") not issued before b" << i << "'s backward compute "
                                        << "finished (#" << done << "): " << l1::describe_sequence(bwd));
      }
    }
    // The three blocks re-gather; the root keeps its parameters from
    // forward (reshard_after_forward unset, the default).
    BOOST_TEST(bwd.total("all_gather") == 3, mode << ": backward all-gathers "
                                                  << bwd.total("all_gather") << ", expected 3");
    rep.check(mode + ": grads vs single card", chain_grad_err(c, seed, global), kGradTol);
  }
  rep.publish();
}
