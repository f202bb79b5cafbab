// fully_shard's entry point and FSDPModule's errors (plan target
// _test_fully_shard_module.py): a list of modules (L1-09), the plan's
// existing mesh rows (mesh=None, a 1-D DeviceMesh, the HSDP 2-D mesh), world
// size 1, and the typed argument / state errors [ours]. Part of the
// test_fully_shard_module executable (np 1, 2, 4; gpu1, gpu2, gpu4).
//
// Cases:
//   test_fully_shard_list_input                    L1-09 (a list: one shared unit)
//   test_fully_shard_separate_calls_independent    L1-09 (separate calls: independent)
//   test_fully_shard_none_mesh                     existing: mesh=None
//   test_fully_shard_explicit_1d_mesh              existing: mesh=DeviceMesh
//   test_fully_shard_2d_mesh                       existing: HSDP 2-D mesh
//   test_world_size_one_no_collectives             existing
//   test_*_raises, test_default_fsdp_module_raises_state_error   [ours]
//
// Baseline everywhere: the same model unsharded on one card (same seed), run
// on the whole global batch.
#include "fully_shard_module_util.h"
#include "tensor_diff.h"

// ============================================================================
// L1-09: fully_shard over a list of modules.
// ============================================================================
BOOST_AUTO_TEST_CASE(test_fully_shard_list_input, *multi_rank()) {  // L1-09
  const int ws = spmd::world_size();
  l1::Report rep("L1-09");
  const int64_t seed = 91;
  toy::Mlp model(seed);
  model->to(spmd::device());
  const std::vector<ModulePtr> pair = {model->fc1.ptr(), model->fc2.ptr()};
  std::vector<fsdp::FSDPModule> list = fsdp::fully_shard(pair);
  fsdp::FSDPModule root = fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(model.ptr()));
  fsdp::Sharded<toy::Mlp> net(model);

  BOOST_TEST_REQUIRE(list.size() == 2u);
  // Both elements expose the FSDPModule interface.
  for (size_t i = 0; i < 2; ++i) {
    BOOST_TEST(list[i].module().get() == pair[i].get(),
               "list[" << i << "].module() is not the module it was applied to");
    BOOST_TEST(!list[i].is_root());
    BOOST_TEST(list[i].mesh().size() == ws);
    BOOST_TEST(list[i].sharded_parameters().size() == 4u);
  }
  BOOST_TEST(root.is_root());

  auto run = [&](int64_t bseed, bool full_after_fwd, const std::string& label) {
    const auto global = toy::global_batch(bseed, kRows);
    root.zero_grad();
    const auto b = mine(global);
    const auto dev = spmd::device();
    fsdp::reset_collective_counters();
    at::Tensor loss = toy::mse(net(b.x.to(dev)), b.y.to(dev));
    for (const char* prefix : {"fc1", "fc2"}) {
      std::string mis;
      l1::numel_state(*model, prefix, full_after_fwd, ws, spmd::rank(), &mis);
      BOOST_TEST(mis.empty(), label << ": after forward: " << mis);
    }
    loss.backward();
    BOOST_TEST(l1::all_grads_finite(*model), label << ": a grad is missing or not finite");
    rep.check(label + ": grads vs single card",
              l1::grad_err(*model, *ref_grads(seed, {global}), ws, spmd::rank()), kGradTol);
    return fsdp::collective_counters().total("all_gather");
  };

  const int64_t ag_default = run(901, false, "defaults");
  // L1-09's "independent control, no interference", with one unit shared by
  // the list's modules (FSDP2's and hyper-parallel's semantics): a control
  // set through either element acts on the shared unit -- both modules --
  // the same way, a later call through the other element takes over, and
  // training stays equal to the single card's whichever element was used.
  list[0].set_reshard_after_forward(false);
  const int64_t ag_kept_via_0 = run(902, true, "raf=false via list[0]");
  list[1].set_reshard_after_forward(true);
  const int64_t ag_resharded_via_1 = run(903, false, "raf=true via list[1]");
  list[1].set_reshard_after_forward(false);
  const int64_t ag_kept_via_1 = run(906, true, "raf=false via list[1]");
  list[0].set_reshard_after_forward(true);
  BOOST_TEST(ag_kept_via_0 == ag_kept_via_1,
             "raf=false via list[0]: " << ag_kept_via_0 << " all-gathers, via list[1]: "
                                       << ag_kept_via_1);
  BOOST_TEST(ag_resharded_via_1 == ag_default);
  // Keeping the shared unit's parameters after forward saves its re-gather
  // in backward: fewer all-gathers than resharding.
  BOOST_TEST(ag_kept_via_0 < ag_default, "raf=false did not save an all-gather: "
                                             << ag_kept_via_0 << " vs " << ag_default);
  list[0].set_reduce_op_type("sum");
  list[1].set_reduce_op_type("avg");
  run(904, false, "\"sum\" via list[0] then \"avg\" via list[1]");
  // unshard through one element, reshard through the other.
  list[1].unshard();
  {
    std::string mis;
    BOOST_TEST(l1::numel_state(*model, "fc1", true, ws, spmd::rank(), &mis), mis);
    BOOST_TEST(l1::numel_state(*model, "fc2", true, ws, spmd::rank(), &mis), mis);
  }
  list[0].reshard();
  {
    std::string mis;
    BOOST_TEST(l1::numel_state(*model, "", false, ws, spmd::rank(), &mis), mis);
  }
  list[1].zero_grad();
  BOOST_TEST(!model->fc1->weight.grad().defined());
  BOOST_TEST(!model->fc2->weight.grad().defined());
  BOOST_TEST(model->fc3->weight.grad().defined(), "list[1].zero_grad() dropped the root's grads");

  // One unit over both modules: with comm_fusion, one all-gather per pass.
  {
    toy::Mlp fused(seed);
    fused->to(spmd::device());
    fsdp::FullyShardOptions o;
    o.comm_fusion = true;
    auto flist = fsdp::fully_shard(std::vector<ModulePtr>{fused->fc1.ptr(), fused->fc2.ptr()}, o);
    fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(fused.ptr()), o);
    fsdp::Sharded<toy::Mlp> fnet(fused);
    const auto global = toy::global_batch(905, kRows);
    const auto b = mine(global);
    fsdp::reset_collective_counters();
    toy::mse(fnet(b.x.to(spmd::device())), b.y.to(spmd::device())).backward();
    const int64_t ag = fsdp::collective_counters().total("all_gather");
    // The list unit gathers in forward and again in backward; the root
    // keeps its parameters from forward to backward (the default).
    BOOST_TEST(ag == 3, "fused list unit + root: all-gathers per step "
                            << ag << ", expected 3 (the list unit twice, the root once)");
    rep.check("fused list: grads vs single card",
              l1::grad_err(*fused, *ref_grads(seed, {global}), ws, spmd::rank()), kGradTol);
  }
  rep.publish();
}

// L1-09 as the plan states it: two modules sharded by separate calls are two
// units, and a control set on one leaves the other's collectives alone
// (reshard after forward, gradient sync). A list passed to one call is one
// unit shared by its modules (above; docs/test-plan.md#l1-09).
BOOST_AUTO_TEST_CASE(test_fully_shard_separate_calls_independent, *multi_rank()) {  // L1-09
  const int ws = spmd::world_size();
  l1::Report rep("L1-09 separate calls");
  const int64_t seed = 92;
  toy::Mlp model(seed);
  model->to(spmd::device());
  fsdp::FSDPModule u1 = fsdp::fully_shard(model->fc1.ptr(), per_param_options());
  fsdp::FSDPModule u2 = fsdp::fully_shard(model->fc2.ptr(), per_param_options());
  fsdp::FSDPModule root = fsdp::fully_shard(
      std::static_pointer_cast<torch::nn::Module>(model.ptr()), per_param_options());
  fsdp::Sharded<toy::Mlp> net(model);
  struct Counts {
    int64_t all_gathers, reduce_scatters;
  };
  // A unit here holds a weight and a bias: one collective each (comm_fusion off).
  constexpr int64_t kPerUnit = 2;
  // One step; after forward fc1 / fc2 must hold full (true) or sharded
  // (false) parameters; gradients of the synchronised units vs the single card.
  auto step = [&](int64_t bseed, bool fc1_full, bool fc2_full, const std::string& label,
                  const std::string& synced) {
    const auto global = toy::global_batch(bseed, kRows);
    root.zero_grad();
    const auto b = mine(global);
    const auto dev = spmd::device();
    fsdp::reset_collective_counters();
    at::Tensor loss = toy::mse(net(b.x.to(dev)), b.y.to(dev));
    std::string mis;
    BOOST_TEST(l1::numel_state(*model, "fc1", fc1_full, ws, spmd::rank(), &mis),
               label << ": fc1 after forward: " << mis);
    mis.clear();
    BOOST_TEST(l1::numel_state(*model, "fc2", fc2_full, ws, spmd::rank(), &mis),
               label << ": fc2 after forward: " << mis);
    loss.backward();
    rep.check(label + ": " + synced + " grads vs single card",
              l1::grad_err(*model, *ref_grads(seed, {global}), ws, spmd::rank(), 1.0, synced),
              kGradTol);
    const auto& c = fsdp::collective_counters();
    return Counts{c.total("all_gather"), c.total("reduce_scatter")};
  };
  const Counts base = step(921, false, false, "defaults", "fc");
  // fc1 keeps its parameters after forward: its backward all-gather goes,
  // fc2 still reshards and gathers again.
  u1.set_reshard_after_forward(false);
  const Counts kept1 = step(922, true, false, "fc1 raf=false", "fc");
  BOOST_TEST(kept1.all_gathers == base.all_gathers - kPerUnit,
             "fc1 raf=false: " << kept1.all_gathers << " all-gathers, expected "
                               << base.all_gathers - kPerUnit << " (fc2 unaffected)");
  u2.set_reshard_after_forward(false);
  const Counts kept12 = step(923, true, true, "fc1 and fc2 raf=false", "fc");
  BOOST_TEST(kept12.all_gathers == base.all_gathers - 2 * kPerUnit);
  u1.set_reshard_after_forward(true);
  const Counts kept2 = step(924, false, true, "fc2 raf=false only", "fc");
  BOOST_TEST(kept2.all_gathers == base.all_gathers - kPerUnit);
  u2.set_reshard_after_forward(true);
  // fc1 stops synchronising gradients: its reduce-scatter goes, it keeps a
  // local full gradient; fc2's and the root's are reduced as before.
  u1.set_requires_gradient_sync(false);
  const Counts nosync1 = step(925, false, false, "fc1 no gradient sync", "fc2");
  BOOST_TEST(nosync1.reduce_scatters == base.reduce_scatters - kPerUnit,
             "fc1 without sync: " << nosync1.reduce_scatters << " reduce-scatters, expected "
                                  << base.reduce_scatters - kPerUnit
                                  << " (fc2 and root unaffected)");
  // unsynced_grads(): one entry per parameter, undefined where none is kept.
  auto kept = [](const fsdp::FSDPModule& u) {
    int n = 0;
    for (const auto& [name, g] : u.unsynced_grads()) n += g.defined() ? 1 : 0;
    return n;
  };
  BOOST_TEST(kept(u1) == kPerUnit, "fc1 keeps " << kept(u1) << " unsynchronised gradients");
  BOOST_TEST(kept(u2) == 0, "fc2 kept " << kept(u2) << " unsynchronised gradients");
  rep.check("fc1 no gradient sync: root (fc3) grads vs single card",
            l1::grad_err(*model, *ref_grads(seed, {toy::global_batch(925, kRows)}), ws,
                         spmd::rank(), 1.0, "fc3"),
            kGradTol);
  u1.set_requires_gradient_sync(true);
  const Counts again = step(926, false, false, "fc1 synchronised again", "fc");
  BOOST_TEST(again.reduce_scatters == base.reduce_scatters);
  BOOST_TEST(again.all_gathers == base.all_gathers);
  rep.publish();
}

// ============================================================================
// Existing rows of the plan for this file.
// ============================================================================
BOOST_AUTO_TEST_CASE(test_fully_shard_none_mesh, *multi_rank()) {  // existing: mesh=None
  const int ws = spmd::world_size();
  l1::Report rep("none_mesh");
  l1::ShardedMlp m(61, per_param_options());
  for (auto* u : {&m.fc1, &m.fc2, &m.root}) {
    BOOST_TEST(u->mesh().ndim() == 1);
    BOOST_TEST(u->mesh().size() == ws);
    std::vector<int> all(ws);
    for (int r = 0; r < ws; ++r) all[r] = r;
    BOOST_TEST(u->mesh().world_ranks() == all);
  }
  const std::string group = m.root.mesh().get_group(0)->name();
  const auto global = toy::global_batch(601, kRows);
  fsdp::reset_collective_counters();
  m.step(mine(global));
  const auto c = fsdp::collective_counters();
  BOOST_TEST(c.total("all_gather", group) == kMlpGathersPerStep);
  BOOST_TEST(c.total("reduce_scatter", group) == kMlpParams);
  BOOST_TEST(c.total("all_gather") == c.total("all_gather", group));
  rep.check("grads vs single card", grad_err(m, ref_grads(61, {global})), kGradTol);
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_fully_shard_explicit_1d_mesh, *multi_rank()) {  // existing: mesh=DeviceMesh
  const int ws = spmd::world_size();
  l1::Report rep("explicit_1d_mesh");
  auto mesh = fsdp::init_device_mesh(spmd::device().type(), {ws}, {"dp"});
  fsdp::FullyShardOptions o = per_param_options();
  o.mesh = mesh;
  l1::ShardedMlp m(62, o);
  BOOST_TEST(m.root.mesh().dim_names() == std::vector<std::string>{"dp"});
  BOOST_TEST(m.fc1.mesh().dim_names() == std::vector<std::string>{"dp"});
  const std::string group = mesh.get_group("dp")->name();
  const auto global = toy::global_batch(602, kRows);
  fsdp::reset_collective_counters();
  m.step(mine(global));
  const auto c = fsdp::collective_counters();
  BOOST_TEST(c.total("all_gather", group) == kMlpGathersPerStep);
  BOOST_TEST(c.total("reduce_scatter", group) == kMlpParams);
  BOOST_TEST(c.total("all_reduce") == 0);
  for (const auto& [name, dt] : m.root.sharded_parameters()) {
    BOOST_TEST(dt.placements().size() == 1u, name);
    BOOST_TEST(dt.placements().at(0).to_string() == "Shard(0)", name);
  }
  rep.check("grads vs single card", grad_err(m, ref_grads(62, {global})), kGradTol);
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_fully_shard_2d_mesh,  // existing: HSDP 2-D mesh
                     *spmd::needs_world_size(4, "a 2x2 (replicate, shard) mesh")) {
  l1::Report rep("2d_mesh");
  const Hsdp h = make_hsdp();
  fsdp::FullyShardOptions o = per_param_options();
  o.mesh = h.mesh;
  l1::ShardedMlp m(63, o);
  const auto global = toy::global_batch(603, kRows);
  fsdp::reset_collective_counters();
  m.step(hsdp_mine(global));
  const auto c = fsdp::collective_counters();
  BOOST_TEST(c.total("all_gather", h.shard_group) == kMlpGathersPerStep);
  BOOST_TEST(c.total("all_gather") == kMlpGathersPerStep);
  BOOST_TEST(c.total("reduce_scatter", h.shard_group) == kMlpParams);
  BOOST_TEST(c.total("all_reduce", h.replicate_group) == kMlpParams);
  for (const auto& [name, dt] : m.root.sharded_parameters()) {
    BOOST_TEST(dt.placements().size() == 2u, name);
    BOOST_TEST(dt.placements().at(0).to_string() == "Replicate()", name);
    BOOST_TEST(dt.placements().at(1).to_string() == "Shard(0)", name);
  }
  rep.check("grads vs single card", hsdp_grad_err(m, h, ref_grads(63, {global})), kGradTol);
  rep.check("replicas equal", replica_gap(m, h, "").second, kReplicaTol);
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_world_size_one_no_collectives,  // existing
                     *spmd::needs_world_size(1, "run the executable with mpiexec -n 1")) {
  l1::Report rep("world_size_one");
  l1::ShardedMlp m(69, {});
  const auto global = toy::global_batch(691, kRows);
  fsdp::reset_collective_counters();
  m.step(global);
  BOOST_TEST(fsdp::collective_counters().sequence.empty(),
             "world size 1 issued " << fsdp::collective_counters().sequence.size()
                                    << " collectives");
  rep.check("grads vs single card", grad_err(m, ref_grads(69, {global})), kGradTol);
  rep.publish();
}

// ============================================================================
// Argument and state errors: typed exceptions naming the argument.
// ============================================================================
BOOST_AUTO_TEST_CASE(test_fully_shard_twice_raises) {  // [ours]
  l1::Report rep("errors");
  const int64_t seed = 81;
  l1::ShardedMlp m(seed, {});
  l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(m.model->fc1); }, "module",
                                        "fully_shard(fc1) twice");
  l1::expect_error<fsdp::ArgumentError>(
      [&] { fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(m.model.ptr())); },
      "module", "fully_shard(root) twice");
  // The model still trains correctly.
  const auto global = toy::global_batch(811, kRows);
  m.step(mine(global));
  rep.check("grads after the rejected calls vs single card",
            grad_err(m, ref_grads(seed, {global})), kGradTol);
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_fully_shard_module_without_params_raises) {  // [ours]
  torch::nn::ReLU relu;
  l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(relu); }, "module",
                                        "fully_shard(ReLU)");
}

BOOST_AUTO_TEST_CASE(test_fully_shard_mesh_ndim_gt_2_raises,  // [ours]
                     *spmd::needs_even_world_size("a (2, N/2) mesh")) {
  const int ws = spmd::world_size();
  l1::Report rep("errors");
  auto mesh3 = fsdp::init_device_mesh(spmd::device().type(), {2, 1, ws / 2}, {"a", "b", "c"});
  toy::Mlp model(82);
  model->to(spmd::device());
  fsdp::FullyShardOptions o;
  o.mesh = mesh3;
  l1::expect_error<fsdp::MeshError>(
      [&] { fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(model.ptr()), o); },
      "mesh", "fully_shard with a 3-D mesh");
  toy::Mlp ref(82);
  rep.check("module untouched by the rejected call", l1::data_err(*model, *ref, 1, 0), 0.0);
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_shard_placement_fn_invalid_raises) {  // [ours]
  const int ws = spmd::world_size(), rank = spmd::rank();
  l1::Report rep("errors");
  auto fn_for = [](std::string target, fsdp::Placement p) -> fsdp::ShardPlacementFn {
    return [target, p](const std::string& name, const at::Tensor&) -> std::optional<fsdp::Placement> {
      if (name == target) return p;
      return std::nullopt;
    };
  };
  auto make = [] {
    at::manual_seed(83);
    torch::nn::Linear lin(15, 7);
    lin->to(spmd::device());
    return lin;
  };
  bool all_untouched = true;
  auto untouched = [&](torch::nn::Linear& lin, const std::string& label) {
    at::manual_seed(83);
    torch::nn::Linear ref(15, 7);
    const double e = std::max(testkit::max_abs_diff_or_inf(lin->weight, ref->weight),
                              testkit::max_abs_diff_or_inf(lin->bias, ref->bias));
    all_untouched = rep.check(label + ": module untouched by the rejected call", e, 0.0) &&
                    all_untouched;
  };

  {  // Shard(d) out of range for the weight (2-D) and for the bias (1-D).
    for (int64_t d : {2, -3}) {
      auto lin = make();
      fsdp::FullyShardOptions o;
      o.shard_placement_fn = fn_for("weight", fsdp::Placement::Shard(d));
      l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(lin, o); },
                                            "shard_placement_fn",
                                            "Shard(" + std::to_string(d) + ") on weight");
      untouched(lin, "Shard(" + std::to_string(d) + ") on weight");
    }
    // The bad placement on the second parameter: the first must not have
    // been sharded by the failed call.
    auto lin = make();
    fsdp::FullyShardOptions o;
    o.shard_placement_fn = fn_for("bias", fsdp::Placement::Shard(1));
    l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(lin, o); },
                                          "shard_placement_fn", "Shard(1) on the 1-D bias");
    untouched(lin, "Shard(1) on the 1-D bias");
  }
  if (15 % ws != 0) {  // Shard(1) on a dim not divisible by the shard group (15 columns).
    auto lin = make();
    fsdp::FullyShardOptions o;
    o.shard_placement_fn = fn_for("weight", fsdp::Placement::Shard(1));
    l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(lin, o); },
                                          "shard_placement_fn", "uneven Shard(1) on weight");
    untouched(lin, "uneven Shard(1) on weight");
  }
  {  // A Partial placement is not a parameter placement.
    auto lin = make();
    fsdp::FullyShardOptions o;
    o.shard_placement_fn = fn_for("bias", fsdp::Placement::Partial());
    l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(lin, o); },
                                          "shard_placement_fn", "Partial() on bias");
    untouched(lin, "Partial() on bias");

    // After the rejected calls, a valid fully_shard of the same module works
    // (not attempted when a rejected call already altered a module: its
    // shards would be taken for full parameters).
    if (l1::world_max(all_untouched ? 0.0 : 1.0) != 0.0) {
      BOOST_ERROR("a rejected fully_shard altered the module; not re-sharding it");
      rep.publish();
      return;
    }
    fsdp::Sharded<torch::nn::Linear> net = fsdp::fully_shard(lin);
    const auto global = toy::global_batch(831, kRows, 15, 7);
    const auto b = mine(global);
    toy::mse(net(b.x.to(spmd::device())), b.y.to(spmd::device())).backward();
    at::manual_seed(83);
    torch::nn::Linear ref(15, 7);
    toy::mse(ref(global.x), global.y).backward();
    rep.check("fully_shard after the rejected calls: grads vs single card",
              l1::grad_err(*lin, *ref, ws, rank), kGradTol);
  }
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_comm_fusion_mixed_dtypes_raises) {  // [ours]
  // comm_fusion needs one compute dtype per unit: a float32 layer followed by
  // a float64 layer is rejected, and the module is left as it was.
  l1::Report rep("errors");
  auto make = [] {
    at::manual_seed(87);
    torch::nn::Sequential seq(torch::nn::Linear(15, 7), torch::nn::Linear(7, 3));
    seq[1]->to(at::kDouble);
    seq->to(spmd::device());
    return seq;
  };
  auto seq = make();
  fsdp::FullyShardOptions o;
  o.comm_fusion = true;
  l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(seq, o); }, "comm_fusion",
                                        "comm_fusion over float32 + float64 parameters");
  auto ref = make();
  rep.check("module untouched by the rejected call", l1::data_err(*seq, *ref, 1, 0), 0.0);
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_ignored_and_replicated_param_raises) {  // [ours]
  torch::nn::Linear lin(15, 7);
  fsdp::FullyShardOptions o;
  o.ignored_params = {lin->weight};
  o.replicate_params = {lin->weight};
  l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(lin, o); }, "replicate_params",
                                        "weight both ignored and replicated");
  BOOST_TEST(lin->weight.numel() == 7 * 15);
}

BOOST_AUTO_TEST_CASE(test_set_reduce_op_type_invalid_raises) {  // [ours]
  l1::ShardedMlp m(84, {});
  for (const std::string op : {"max", "mean", "SUM", ""}) {
    l1::expect_error<fsdp::ArgumentError>([&] { m.root.set_reduce_op_type(op); }, "reduce_op",
                                          "set_reduce_op_type(\"" + op + "\")");
  }
}

BOOST_AUTO_TEST_CASE(test_prefetch_list_invalid_module_raises) {  // [ours]
  l1::ShardedMlp m(86, {});
  l1::expect_error<fsdp::ArgumentError>(
      [&] { m.root.set_modules_to_forward_prefetch({fsdp::FSDPModule()}); }, "modules",
      "set_modules_to_forward_prefetch({FSDPModule()})");
  l1::expect_error<fsdp::ArgumentError>(
      [&] { m.root.set_modules_to_backward_prefetch({m.fc1, fsdp::FSDPModule()}); }, "modules",
      "set_modules_to_backward_prefetch({fc1, FSDPModule()})");
}

BOOST_AUTO_TEST_CASE(test_default_fsdp_module_raises_state_error) {  // [ours]
  fsdp::FSDPModule none;
  const std::string who = "FSDPModule";
  auto state_error = [&](const std::string& label, const std::function<void()>& fn) {
    l1::expect_error<fsdp::StateError>(fn, who, label);
  };
  state_error("module()", [&] { (void)none.module(); });
  state_error("set_requires_gradient_sync", [&] { none.set_requires_gradient_sync(false); });
  state_error("set_requires_all_reduce", [&] { none.set_requires_all_reduce(false); });
  state_error("set_reshard_after_forward", [&] { none.set_reshard_after_forward(false); });
  state_error("set_reshard_after_backward", [&] { none.set_reshard_after_backward(false); });
  state_error("set_reduce_op_type", [&] { none.set_reduce_op_type("sum"); });
  state_error("set_gradient_scaling_factor", [&] { none.set_gradient_scaling_factor(2.0); });
  state_error("set_is_last_backward", [&] { none.set_is_last_backward(false); });
  state_error("set_modules_to_forward_prefetch", [&] { none.set_modules_to_forward_prefetch({}); });
  state_error("set_modules_to_backward_prefetch",
              [&] { none.set_modules_to_backward_prefetch({}); });
  state_error("unshard", [&] { (void)none.unshard(); });
  state_error("reshard", [&] { none.reshard(); });
  state_error("zero_grad", [&] { none.zero_grad(); });
  state_error("finish_pending_reductions", [&] { none.finish_pending_reductions(); });
  state_error("sharded_parameters", [&] { (void)none.sharded_parameters(); });
  state_error("main_grads", [&] { (void)none.main_grads(); });
  state_error("state_dict", [&] { (void)none.state_dict(); });
  state_error("full_state_dict", [&] { (void)none.full_state_dict(); });
  state_error("load_state_dict",
              [&] { none.load_state_dict(std::vector<std::pair<std::string, at::Tensor>>{}); });
  state_error("mesh", [&] { (void)none.mesh(); });
  state_error("is_root", [&] { (void)none.is_root(); });
  // A handle whose module is gone behaves the same.
  fsdp::FSDPModule stale;
  {
    torch::nn::Linear lin(15, 7);
    stale = fsdp::fully_shard(lin.ptr());
  }
  state_error("reshard() after the module was destroyed", [&] { stale.reshard(); });
  state_error("is_root() after the module was destroyed", [&] { (void)stale.is_root(); });
}
