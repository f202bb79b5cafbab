// reshard_after_forward as a rank count (FSDP2's int, ZeRO++'s hpZ) and
// ReshardAfterForward::within_node(): after forward the parameters stay
// sharded over a smaller group of consecutive shard ranks, and backward
// all-gathers within it. Part of the test_fully_shard_module executable
// (np 1, 2, 4; gpu1, gpu2, gpu4) and of the multinode entries (2 nodes x 2:
// within_node() is then each node's pair).
//
// Cases ([ours]; the plan validates the bool forms in L1-01, these follow it):
//   test_reshard_after_forward_hpz          np 4: 2 ranks, fused and not
//   test_reshard_after_forward_within_node  np >= 2: the node's ranks
//   test_reshard_after_forward_int_forms    np >= 2: 1 == false, size == true,
//                                           refused counts, offload
//
// Baseline: the same model unsharded on one card (l1::ref_backward), as in
// L1-01; a rank's sharded gradient must equal its rows of the single-card
// gradient within kGradTol. hpZ only moves data (its all-gathers carry the
// same bits), so it must also be bitwise equal to reshard_after_forward=true.
#include "fully_shard_module_util.h"
#include "tensor_diff.h"

#include <mpi.h>

#include <map>

namespace {

// "ranks[a,b,...]" of the world ranks in [first, first + n).
std::string ranks_name(int first, int n) {
  std::string s = "ranks[";
  for (int r = first; r < first + n; ++r) s += (r > first ? "," : "") + std::to_string(r);
  return s + "]";
}

// The world ranks on this node, ascending, from MPI itself (not the library).
std::vector<int> node_world_ranks() {
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  int n = 0;
  MPI_Comm_size(node, &n);
  std::vector<int> ranks(static_cast<size_t>(n));
  const int me = spmd::rank();
  MPI_Allgather(&me, 1, MPI_INT, ranks.data(), 1, MPI_INT, node);
  MPI_Comm_free(&node);
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

struct StepCounts {
  int64_t world_gathers = 0;   // on the world (the shard group)
  int64_t other_gathers = 0;   // on any other group
  std::map<std::string, int64_t> by_group;
};

// One forward + backward on batch `bseed`; checks the state after forward
// (`full_after_fwd`: "" = every parameter full, "-" = all sharded) and the
// gradients against the single card. Returns the step's all-gathers.
StepCounts step(l1::Report& rep, l1::ShardedMlp& m, int64_t seed, int64_t bseed,
                const std::string& label, const std::string& full_after_fwd) {
  const auto global = toy::global_batch(bseed, kRows);
  m.root.zero_grad();
  fsdp::reset_collective_counters();
  at::Tensor loss = m.loss(mine(global));
  const std::string mis = numel_mismatch(m, "", full_after_fwd == "");
  BOOST_TEST(mis.empty(), label << ": after forward: " << mis);
  loss.backward();
  const auto c = fsdp::collective_counters();
  StepCounts out;
  const std::string world = ranks_name(0, spmd::world_size());
  for (const auto& [key, n] : c.count) {
    if (key.first != "all_gather") continue;
    out.by_group[key.second] += n;
    (key.second == world ? out.world_gathers : out.other_gathers) += n;
  }
  rep.check(label + ": grads vs single card", grad_err(m, ref_grads(seed, {global})), kGradTol);
  return out;
}

// Every sharded gradient of `a` bitwise equal to `b`'s (max |difference|).
double grads_gap(l1::ShardedMlp& a, l1::ShardedMlp& b) {
  double worst = 0;
  auto pa = a.model->named_parameters();
  auto pb = b.model->named_parameters();
  for (const auto& item : pa) {
    const at::Tensor ga = item.value().grad();
    const at::Tensor gb = pb[item.key()].grad();
    if (!ga.defined() || !gb.defined()) return l1::kInf;
    worst = std::max(worst, testkit::max_abs_diff_or_inf(ga, gb));
  }
  return worst;
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_reshard_after_forward_hpz,
                     *spmd::needs_world_size(4, "hpZ over 2 of 4 shard ranks")) {  // [ours]
  l1::Report rep("hpZ");
  const int64_t seed = 21;
  const std::string pf = ranks_name(spmd::rank() / 2 * 2, 2);
  for (bool fused : {false, true}) {
    const std::string tag = fused ? "fused " : "";
    fsdp::FullyShardOptions opts;
    opts.comm_fusion = fused;
    opts.reshard_after_forward = 2;
    l1::ShardedMlp m(seed, opts);
    fsdp::FullyShardOptions flat_opts;
    flat_opts.comm_fusion = fused;
    flat_opts.reshard_after_forward = true;
    l1::ShardedMlp flat(seed, flat_opts);
    // Fused: one all-gather per unit (3 units); else one per parameter.
    const int64_t per_pass = fused ? 3 : kMlpParams;
    for (int64_t s = 0; s < 2; ++s) {
      const std::string label = tag + "raf=2 step " + std::to_string(s);
      const StepCounts c = step(rep, m, seed, 201 + s, label, "-");
      // Forward gathers over the shard group (the world); backward only
      // over this rank's post-forward pair.
      BOOST_TEST(c.world_gathers == per_pass,
                 label << ": all-gathers on the world " << c.world_gathers << ", expected "
                       << per_pass);
      BOOST_TEST(c.by_group.count(pf) == 1u, label << ": no all-gather on " << pf);
      if (c.by_group.count(pf)) {
        BOOST_TEST(c.by_group.at(pf) == per_pass,
                   label << ": all-gathers on " << pf << " " << c.by_group.at(pf) << ", expected "
                         << per_pass);
      }
      BOOST_TEST(c.other_gathers == per_pass,
                 label << ": all-gathers off the world " << c.other_gathers);
      step(rep, flat, seed, 201 + s, tag + "raf=true step " + std::to_string(s), "-");
      rep.check(label + ": grads vs reshard_after_forward=true (bitwise)", grads_gap(m, flat), 0.0);
    }
    // Back to true at run time: the pair is no longer used.
    m.root.set_reshard_after_forward(true);
    const StepCounts c = step(rep, m, seed, 210, tag + "raf=true after raf=2", "-");
    BOOST_TEST(c.other_gathers == 0, tag << "raf=true after raf=2: all-gathers off the world "
                                         << c.other_gathers);
    BOOST_TEST(c.world_gathers == 2 * per_pass);
    // A forward without grad mode keeps nothing: the next step's forward
    // gathers over the world again and its backward over the pair.
    m.root.set_reshard_after_forward(2);
    {
      at::NoGradGuard no_grad;
      m.loss(mine(toy::global_batch(211, kRows)));
      const std::string mis = numel_mismatch(m, "", false);
      BOOST_TEST(mis.empty(), tag << "raf=2 forward without grad: " << mis);
    }
    const StepCounts after = step(rep, m, seed, 212, tag + "raf=2 after a no-grad forward", "-");
    BOOST_TEST(after.world_gathers == per_pass);
    BOOST_TEST(after.other_gathers == per_pass);
  }
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_reshard_after_forward_within_node, *multi_rank()) {  // [ours]
  l1::Report rep("hpZ within node");
  const int64_t seed = 23;
  const std::vector<int> node = node_world_ranks();
  const int ws = spmd::world_size();
  fsdp::FullyShardOptions opts = per_param_options();
  opts.reshard_after_forward = fsdp::ReshardAfterForward::within_node();
  l1::ShardedMlp m(seed, opts);
  const StepCounts c = step(rep, m, seed, 301, "within_node", "-");
  if (static_cast<int>(node.size()) == ws) {
    // One node holds the whole shard group: within_node() is true.
    BOOST_TEST(c.world_gathers == 2 * kMlpParams);
    BOOST_TEST(c.other_gathers == 0);
  } else {
    const std::string pf = ranks_name(node.front(), static_cast<int>(node.size()));
    BOOST_TEST_MESSAGE("within_node: post-forward group " << pf);
    BOOST_TEST(c.world_gathers == kMlpParams);
    BOOST_TEST(c.by_group.count(pf) == 1u, "within_node: no all-gather on " << pf);
    if (c.by_group.count(pf)) BOOST_TEST(c.by_group.at(pf) == kMlpParams);
  }
  rep.publish();
}

BOOST_AUTO_TEST_CASE(test_reshard_after_forward_int_forms, *multi_rank()) {  // [ours]
  l1::Report rep("hpZ forms");
  const int64_t seed = 25;
  const int ws = spmd::world_size();
  l1::ShardedMlp m(seed, per_param_options());
  // 1 == false: full after forward, one gather per parameter.
  m.root.set_reshard_after_forward(1);
  StepCounts c = step(rep, m, seed, 401, "raf=1", "");
  BOOST_TEST(c.world_gathers == kMlpParams);
  BOOST_TEST(c.other_gathers == 0);
  // The shard group's size == true.
  m.root.set_reshard_after_forward(ws);
  c = step(rep, m, seed, 402, "raf=world size", "-");
  BOOST_TEST(c.world_gathers == 2 * kMlpParams);
  BOOST_TEST(c.other_gathers == 0);
  // Counts that do not divide the shard group, and non-positive ones.
  for (int bad : {0, -2, ws + 1, ws == 4 ? 3 : ws + 2}) {
    const std::string msg = l1::expect_error<fsdp::ArgumentError>(
        [&] { m.root.set_reshard_after_forward(bad); }, "reshard_after_forward",
        "set_reshard_after_forward(" + std::to_string(bad) + ")");
    BOOST_TEST(msg.find("'reshard_after_forward' = " + std::to_string(bad)) != std::string::npos,
               msg);
  }
  // The refused setter changed nothing: still the world size's behaviour.
  c = step(rep, m, seed, 403, "after refused counts", "-");
  BOOST_TEST(c.world_gathers == 2 * kMlpParams);
  // fully_shard refuses before touching the module, which a valid call then shards.
  {
    toy::Mlp fresh(seed);
    fresh->to(spmd::device());
    fsdp::FullyShardOptions bad;
    bad.reshard_after_forward = ws + 1;
    l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(fresh->fc1, bad); },
                                          "reshard_after_forward", "fully_shard(raf=ws+1)");
    BOOST_TEST(fresh->fc1->weight.numel() == l1::full_numel("fc1.weight"));
    fsdp::FullyShardOptions offload;
    offload.reshard_after_forward = ws;
    offload.offload_policy = fsdp::CPUOffloadPolicy{};
    l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(fresh->fc1, offload); },
                                          "reshard_after_forward", "fully_shard(raf=ws, offload)");
    BOOST_CHECK_NO_THROW(fsdp::fully_shard(fresh->fc1, fsdp::FullyShardOptions{}));
  }
  BOOST_TEST(fsdp::to_string(fsdp::ReshardAfterForward(2)) == "2 ranks (hpZ)");
  BOOST_TEST(fsdp::to_string(fsdp::ReshardAfterForward::within_node()) == "within node (hpZ)");
  BOOST_TEST(fsdp::to_string(fsdp::ReshardAfterForward()) == "unset");
  BOOST_TEST(fsdp::to_string(fsdp::ReshardAfterForward(false)) == "false");
  rep.publish();
}
