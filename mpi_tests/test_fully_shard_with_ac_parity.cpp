// Activation checkpointing composed with fully_shard (the plan's
// _test_fully_shard_with_ac.py), Level 2, against the single card. Part of
// the test_fully_shard_with_ac executable (np 2, gpu2).
//
// Cases:
//   test_reentrant_ac_fsdp            L2-03  reentrant checkpoint of every block
//   test_nonreentrant_ac_fsdp         L2-04  non-reentrant, plus peak memory below no-AC
//   test_selective_ac_fsdp            L2-05  every other block; forward counts 2x / 1x
//   test_ac_activation_swap_fsdp      L2-06  saved inputs on the host, recompute on device
//   test_ac_recompute_regathers_fsdp  [ours] the recompute re-gathers a resharded
//                                     unit and runs no prefetch / pre-backward
//                                     logic: all-gathers per unit counted
//
// Baseline: an unsharded copy of the same model (same seed) on the whole
// global batch, without checkpointing, on one rank's process -- never another
// FSDP run (plan rule 1). Tolerances are the plan's (AC + FSDP fp32: 1e-5).
#include "device_memory.h"
#include "with_ac_util.h"

namespace {

using spmd::DeviceMemory;

}  // namespace

// ---------------------------------------------------------------------------
// L2-03: reentrant checkpoint of every block (forward under no-grad, nested
// backward over the recompute) vs the single card without checkpointing.
BOOST_AUTO_TEST_CASE(test_reentrant_ac_fsdp) {  // L2-03
  const NetConfig c;
  auto s = make_fsdp(11, c);
  auto ref = make_ref(11, c);
  fsdp::ActivationCheckpointOptions options;
  options.mode = fsdp::ActivationCheckpointMode::Reentrant;
  mark_all_blocks(s.net, options);
  const Worst w = run_parity(s, ref, 16, 2, 100, [&](int) {
    for (size_t i = 0; i < c.hidden.size(); ++i) {
      // One recompute per block per backward: the checkpoint was really used.
      BOOST_TEST(block(s.net, i).bwd_calls == 1);
      block(s.net, i).bwd_calls = 0;
    }
  });
  check_and_report("L2-03", w);
}

// ---------------------------------------------------------------------------
// L2-04: non-reentrant checkpoint (recompute + autograd::grad, parameter
// gradients leave through the outer graph) vs the single card, and its peak
// memory on the suite's device (host allocator on CPU, CUDA caching
// allocator on a GPU) during a step vs the same sharded model without
// checkpointing.
BOOST_AUTO_TEST_CASE(test_nonreentrant_ac_fsdp) {  // L2-04
  DeviceMemory memory;
  // Activations dominate: with 256 rows per rank each d=32 -> 256 -> 32 block
  // saves ~0.6 MB of activations; its parameters are ~66 KB.
  NetConfig c;
  c.hidden = {256, 256, 256, 256};
  const int64_t rows = 256 * spmd::world_size();
  auto base = make_fsdp(21, c);
  auto s = make_fsdp(21, c);
  auto ref = make_ref(21, c);
  mark_all_blocks(s.net, fsdp::ActivationCheckpointOptions{});  // NonReentrant is the default

  // Peak of one forward + backward above what was live when it started.
  auto measure = [&](FsdpNet& m, const toy::Batch& mine) {
    memory.reset_peak();
    const int64_t start = memory.live();
    const double loss = backward(toy::mse(m.model(mine.x), mine.y));
    return std::make_pair(loss, memory.peak() - start);
  };
  torch::optim::SGD opt(s.net->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD base_opt(base.net->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  Worst worst;
  for (int step = 0; step < 2; ++step) {
    const auto batch = prec::to_device(toy::global_batch(200 + step, rows, c.in, c.out));
    const auto mine = toy::slice(batch, spmd::rank(), spmd::world_size());
    opt.zero_grad();
    base_opt.zero_grad();
    ref_opt.zero_grad();
    const auto [base_loss, base_peak] = measure(base, mine);
    const auto [loss, ac_peak] = measure(s, mine);
    (void)base_loss;
    const double ref_loss = backward(toy::mse(ref(batch.x), batch.y));
    worst.merge(compare(s.net, ref, loss, ref_loss));
    opt.step();
    base_opt.step();
    ref_opt.step();
    const double base_max = prec::max_over_ranks(static_cast<double>(base_peak));
    const double ac_max = prec::max_over_ranks(static_cast<double>(ac_peak));
    std::ostringstream os;
    os << "[L2-04] step " << step << " peak " << memory.what()
       << " memory above step start (max over ranks): no-AC " << static_cast<int64_t>(base_max)
       << " B, non-reentrant AC " << static_cast<int64_t>(ac_max) << " B (" << std::fixed
       << std::setprecision(1) << 100.0 * ac_max / base_max << "% of no-AC)";
    prec::note(os.str());
    BOOST_TEST(ac_peak > 0);
    BOOST_TEST(ac_peak < base_peak);
  }
  check_and_report("L2-04", worst);
  for (size_t i = 0; i < c.hidden.size(); ++i) {
    BOOST_TEST(block(s.net, i).bwd_calls == 2);     // one recompute per step
    BOOST_TEST(block(base.net, i).bwd_calls == 0);  // the baseline really is without AC
  }
}

// ---------------------------------------------------------------------------
// L2-05: selective checkpointing, per layer: a policy checkpoints every other
// block; a counting probe in each block's forward shows the checkpointed ones
// run twice per step (forward + recompute in backward), the others once.
BOOST_AUTO_TEST_CASE(test_selective_ac_fsdp) {  // L2-05
  const NetConfig c;
  auto s = make_fsdp(31, c);
  auto ref = make_ref(31, c);
  const int64_t marked = fsdp::apply_activation_checkpointing(
      s.net.ptr(), fsdp::activation_checkpoint_every_nth(2,
                                              [](const torch::nn::Module& m) {
                                                return dynamic_cast<const BlockImpl*>(&m) !=
                                                       nullptr;
                                              }));
  BOOST_TEST(marked == 2);
  const std::set<size_t> checkpointed = {0, 2};
  for (size_t i = 0; i < c.hidden.size(); ++i) {
    BOOST_TEST(fsdp::activation_checkpoint_options_of(block(s.net, i)).has_value() ==
               (checkpointed.count(i) == 1));
  }
  int64_t wrong_counts = 0;
  const Worst w = run_parity(s, ref, 16, 2, 300, [&](int step) {
    for (size_t i = 0; i < c.hidden.size(); ++i) {
      auto& b = block(s.net, i);
      const int64_t expected_bwd = checkpointed.count(i) ? 1 : 0;
      const int64_t per_step = b.fwd_calls + b.bwd_calls;
      const int64_t expected = checkpointed.count(i) ? 2 : 1;
      if (per_step != expected || b.fwd_calls != 1 || b.bwd_calls != expected_bwd) {
        ++wrong_counts;
        BOOST_TEST_MESSAGE("step " << step << " block" << i << ": forward " << b.fwd_calls
                                   << ", in backward " << b.bwd_calls);
      }
      b.fwd_calls = b.bwd_calls = 0;
    }
  });
  BOOST_TEST(wrong_counts == 0);
  prec::note("[L2-05] forward calls per step: checkpointed blocks 0, 2: 2 (1 in backward); "
             "blocks 1, 3: 1 -- " + std::string(wrong_counts == 0 ? "as expected" : "WRONG"));
  check_and_report("L2-05", w);
}

// ---------------------------------------------------------------------------
// L2-06: activation swap: the saved inputs are kept in host memory between
// forward and backward and moved back to the compute device for the
// recompute; no device mismatch, gradients as the single card's.
BOOST_AUTO_TEST_CASE(test_ac_activation_swap_fsdp) {  // L2-06
  const NetConfig c;
  const c10::Device device = spmd::device();
  if (device.is_cpu()) {
    prec::note("[L2-06] compute device is the CPU: host and device coincide, so this run checks "
               "placement and parity; the host->device move itself runs under gpu2");
  }
  for (auto mode : {fsdp::ActivationCheckpointMode::NonReentrant, fsdp::ActivationCheckpointMode::Reentrant}) {
    const std::string tag = mode == fsdp::ActivationCheckpointMode::Reentrant ? "reentrant" : "non-reentrant";
    auto s = make_fsdp(41, c);
    auto ref = make_ref(41, c);
    int64_t saved_events = 0, recompute_events = 0, saved_off_host = 0, saved_unpinned = 0,
            recompute_off_device = 0;
    fsdp::ActivationCheckpointOptions options;
    options.mode = mode;
    options.swap_inputs_to_host = true;
    options.observer = [&](const fsdp::ActivationCheckpointEvent& e) {
      for (const auto& t : e.tensors) {
        if (e.kind == fsdp::ActivationCheckpointEvent::Kind::Saved) {
          saved_off_host += t.is_cpu() ? 0 : 1;
          saved_unpinned += device.is_cuda() && !t.is_pinned() ? 1 : 0;
        } else {
          recompute_off_device += t.device() == device ? 0 : 1;
        }
      }
      (e.kind == fsdp::ActivationCheckpointEvent::Kind::Saved ? saved_events : recompute_events) += 1;
    };
    mark_all_blocks(s.net, options);
    int64_t probe_off_device = 0;
    const Worst w = run_parity(s, ref, 16, 2, 400, [&](int) {
      for (size_t i = 0; i < c.hidden.size(); ++i) {
        auto& b = block(s.net, i);
        BOOST_TEST(b.bwd_calls == 1);
        for (const auto& d : b.bwd_devices) probe_off_device += d == device ? 0 : 1;
        b.bwd_calls = 0;
        b.bwd_devices.clear();
      }
    });
    const int64_t n = static_cast<int64_t>(c.hidden.size()) * 2;  // blocks x steps
    BOOST_TEST(saved_events == n);
    BOOST_TEST(recompute_events == n);
    BOOST_TEST(saved_off_host == 0);
    BOOST_TEST(saved_unpinned == 0);
    BOOST_TEST(recompute_off_device == 0);
    BOOST_TEST(probe_off_device == 0);
    prec::note("[L2-06] " + tag + ": " + std::to_string(saved_events) + " saves on the host, " +
               std::to_string(recompute_events) + " recomputes on " + device.str() +
               "; tensors off place: " +
               std::to_string(saved_off_host + saved_unpinned + recompute_off_device +
                              probe_off_device));
    check_and_report("L2-06 " + tag, w);
  }
}

// ---------------------------------------------------------------------------
// [ours] The FSDP side of the composition (DESIGN section 5): with
// reshard_after_forward the blocks are sharded between forward and backward,
// so each recompute must re-gather its unit -- once, and without the
// pre-forward's prefetch (each block forward-prefetches the next, which would
// gather an already-finished unit again) or pre-backward logic. Counted per
// unit (comm_fusion: one all-gather per unit per pass, told apart by its
// size): forward 1, backward 1 for every unit, with and without
// checkpointing, and the gradients match the single card.
BOOST_AUTO_TEST_CASE(test_ac_recompute_regathers_fsdp) {  // [ours]
  const int ws = spmd::world_size(), rank = spmd::rank();
  NetConfig c;
  c.hidden = {16, 24, 32, 40};  // distinct unit sizes
  fsdp::FullyShardOptions opts;
  opts.reshard_after_forward = true;
  opts.comm_fusion = true;
  const std::vector<std::pair<std::string, std::optional<fsdp::ActivationCheckpointMode>>> modes = {
      {"no AC", std::nullopt},
      {"reentrant", fsdp::ActivationCheckpointMode::Reentrant},
      {"non-reentrant", fsdp::ActivationCheckpointMode::NonReentrant}};
  for (const auto& [tag, mode] : modes) {
    auto s = make_fsdp(51, c, opts);
    auto ref = make_ref(51, c);
    for (size_t i = 0; i + 1 < s.blocks.size(); ++i) {
      s.blocks[i].set_modules_to_forward_prefetch({s.blocks[i + 1]});
    }
    if (mode) {
      fsdp::ActivationCheckpointOptions options;
      options.mode = *mode;
      mark_all_blocks(s.net, options);
    }
    // Fused all-gather input bytes of each unit: its padded blocks, fp32.
    std::vector<fsdp::FSDPModule> units = s.blocks;
    units.push_back(s.root);
    std::map<int64_t, size_t> unit_of_bytes;
    for (size_t u = 0; u < units.size(); ++u) {
      int64_t numel = 0;
      for (const auto& [name, dt] : units[u].sharded_parameters()) {
        const auto& shape = dt.shape();
        int64_t rest = 1;
        for (size_t k = 1; k < shape.size(); ++k) rest *= shape[k];
        numel += (shape[0] + ws - 1) / ws * rest;
      }
      unit_of_bytes[numel * 4] = u;
    }
    BOOST_TEST_REQUIRE(unit_of_bytes.size() == units.size());
    // All-gathers per unit in sequence records [from, to), and their order.
    auto per_unit = [&](const fsdp::CollectiveCounters& cc, size_t from, size_t to) {
      std::vector<int64_t> n(units.size(), 0);
      std::vector<size_t> order;
      for (size_t k = from; k < to; ++k) {
        if (cc.sequence[k].op != "all_gather") continue;
        auto it = unit_of_bytes.find(cc.sequence[k].bytes);
        BOOST_TEST_REQUIRE((it != unit_of_bytes.end()), "all-gather of unknown size");
        ++n[it->second];
        order.push_back(it->second);
      }
      return std::make_pair(n, order);
    };

    const auto batch = prec::to_device(toy::global_batch(500, 16, c.in, c.out));
    const auto mine = toy::slice(batch, rank, ws);
    fsdp::reset_collective_counters();
    const at::Tensor loss = toy::mse(s.model(mine.x), mine.y);
    const size_t after_forward = fsdp::collective_counters().sequence.size();
    // Resharded between forward and backward: the recompute has to gather.
    for (size_t i = 0; i < s.blocks.size(); ++i) {
      BOOST_TEST(block(s.net, i).fc1->weight.size(0) ==
                 fsdp::shard_extent(c.hidden[i], ws, rank).length);
    }
    const double local_loss = backward(loss);
    const auto cc = fsdp::collective_counters();
    const auto [fwd, fwd_order] = per_unit(cc, 0, after_forward);
    const auto [bwd, bwd_order] = per_unit(cc, after_forward, cc.sequence.size());
    (void)fwd_order;
    std::ostringstream os;
    os << "[ours] " << tag << ": all-gathers per unit (block0..3, root) forward [";
    for (auto v : fwd) os << " " << v;
    os << " ], backward [";
    for (auto v : bwd) os << " " << v;
    os << " ]";
    prec::note(os.str());
    for (size_t u = 0; u < units.size(); ++u) {
      BOOST_TEST(fwd[u] == 1, tag << ": unit " << u << " gathered " << fwd[u] << "x in forward");
      BOOST_TEST(bwd[u] == 1, tag << ": unit " << u << " gathered " << bwd[u]
                                  << "x in backward");
    }
    if (mode) {
      // The recomputes gather the blocks in reverse order, after the root.
      const std::vector<size_t> expected_order = {4, 3, 2, 1, 0};
      BOOST_TEST((bwd_order == expected_order), tag << ": backward gather order");
      for (size_t i = 0; i < s.blocks.size(); ++i) BOOST_TEST(block(s.net, i).bwd_calls == 1);
    }
    const double ref_loss = backward(toy::mse(ref(batch.x), batch.y));
    const Worst w = compare(s.net, ref, local_loss, ref_loss);
    report("ours " + tag, "every grad vs single card", w.all, kTol);
    BOOST_TEST(w.loss <= kTol);
    BOOST_TEST(w.global_norm <= kTol);
  BOOST_TEST(w.layer_norm <= kTol);
    BOOST_TEST(w.all <= kTol);
  }
}
