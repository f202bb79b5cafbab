// Several parameter groups in one FSDP unit [ours]: they train like a single
// card with the exact collectives per group, each group's gradient divide
// factor, and an expert mesh without the unit's shard dim. Part of the
// test_fully_shard_core executable (np 2, 4; gpu2, gpu4; label core).
#include "fully_shard_core_util.h"
#include "tensor_diff.h"

namespace {

// One block with dense weights (sharded on the whole world) and "expert"
// weights (sharded on a 2-rank sub-mesh, replicated over the other dim).
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    dense = register_module("dense", torch::nn::Linear(6, 8));
    expert_up = register_module("expert_up", torch::nn::Linear(8, 8));
    expert_down = register_module("expert_down", torch::nn::Linear(8, 6));
  }
  at::Tensor forward(at::Tensor x) {
    x = at::tanh(dense(x));
    return expert_down(at::tanh(expert_up(x)));
  }
  torch::nn::Linear dense{nullptr}, expert_up{nullptr}, expert_down{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  explicit NetImpl(int64_t seed) {
    at::manual_seed(seed);
    block = register_module("block", Block());
    head = register_module("head", torch::nn::Linear(6, 3));
  }
  at::Tensor forward(at::Tensor x) { return head(block(x)); }
  fsdp::Sharded<Block> block{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

double worst_shard_err(torch::nn::Module& model, torch::nn::Module& ref,
                       const std::map<std::string, std::pair<int64_t, int64_t>>& split,
                       bool grads, double ref_scale = 1.0) {
  double worst = 0;
  auto ref_params = ref.named_parameters();
  for (const auto& item : model.named_parameters()) {
    const at::Tensor& r = ref_params[item.key()];
    const auto [parts, index] = split.at(item.key());
    const at::Tensor want =
        toy::ceil_div_rows(host(grads ? r.grad() : r), 0, parts, index) * ref_scale;
    const at::Tensor got = grads ? item.value().grad() : item.value();
    const double e = testkit::max_abs_diff_or_inf(got, want);
    if (!(e <= worst)) worst = e;
  }
  return worst;
}

// Which shard of each parameter a rank holds: (parts, index) of dim 0 --
// experts over efsdp's 2 ranks, the rest over all 4.
std::map<std::string, std::pair<int64_t, int64_t>> expert_split(torch::nn::Module& net,
                                                                const fsdp::DeviceMesh& sparse,
                                                                int rank) {
  std::map<std::string, std::pair<int64_t, int64_t>> split;
  for (const auto& item : net.named_parameters()) {
    const bool expert = item.key().find("expert") != std::string::npos;
    split[item.key()] = expert ? std::make_pair<int64_t, int64_t>(2, sparse.get_local_rank("efsdp"))
                               : std::make_pair<int64_t, int64_t>(4, rank);
  }
  return split;
}

// The block's expert weights on `sparse` (HSDP over (ep, efsdp), optionally
// with their own divide factor), its dense weights and the root (kept
// unsharded between forward and backward) on `world`.
// `shard_dim` names FSDP's dim of `world` (it need not exist in `sparse`).
fsdp::Sharded<Net> shard_expert_net(Net& net, const fsdp::DeviceMesh& world,
                                    const fsdp::DeviceMesh& sparse, bool fused,
                                    std::optional<double> expert_divide_factor,
                                    std::optional<std::string> shard_dim = std::nullopt,
                                    std::optional<std::string> replicate_dim = std::nullopt) {
  fsdp::FullyShardOptions block_opts;
  block_opts.mesh = world;
  block_opts.shard_dim = shard_dim;
  block_opts.replicate_dim = replicate_dim;
  block_opts.comm_fusion = fused;
  block_opts.shard_placement_fn =
      [sparse, expert_divide_factor](
          const std::string& name, const at::Tensor&) -> std::optional<fsdp::ShardPlacementResult> {
    if (name.rfind("expert", 0) != 0) return std::nullopt;
    return fsdp::ShardPlacementResult(fsdp::Placement::Shard(0), sparse, expert_divide_factor);
  };
  fsdp::fully_shard(net->block, block_opts);
  fsdp::FullyShardOptions root_opts;
  root_opts.mesh = world;
  root_opts.shard_dim = shard_dim;
  root_opts.replicate_dim = replicate_dim;
  root_opts.comm_fusion = fused;
  root_opts.reshard_after_forward = false;
  return fsdp::fully_shard(net, root_opts);
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_several_param_groups_in_one_unit,  // [ours]
                     *spmd::needs_world_size(4, "dense on the 4-rank mesh, experts on 2-rank "
                                                "sub-meshes")) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const auto dev = spmd::device().type();
  const auto world = fsdp::init_device_mesh(dev, {4}, {"dp"});
  // The same ranks as (ep, efsdp): experts are sharded over efsdp (2 ranks)
  // and replicated over ep, so their gradients are reduce-scattered on the
  // sub-mesh, then all-reduced over ep (HSDP on the sparse view).
  const auto sparse = fsdp::init_device_mesh(dev, {2, 2}, {"ep", "efsdp"});
  const std::string world_g = world.get_group("dp")->name();
  const std::string efsdp_g = sparse.get_group("efsdp")->name();
  const std::string ep_g = sparse.get_group("ep")->name();
  const double tol = 1e-5;
  for (const bool fused : {false, true}) {
    BOOST_TEST_CONTEXT("comm_fusion " << fused) {
      Net ref(5);
      Net net(5);
      ref->to(spmd::device());
      net->to(spmd::device());
      auto model = shard_expert_net(net, world, sparse, fused, std::nullopt);

      const auto split = expert_split(*net, sparse, rank);
      torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
      torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
      l1::Report report(std::string("core several groups") + (fused ? " fused" : ""));
      for (int step = 0; step < 2; ++step) {
        const auto batch = toy::global_batch(40 + step, 8, 6, 3);
        const auto mine = toy::slice(batch, rank, ws);
        fsdp::reset_collective_counters();
        toy::mse(model(mine.x.to(spmd::device())), mine.y.to(spmd::device())).backward();
        const auto c = fsdp::collective_counters();
        auto count = [&c](const char* op, const std::string& g) {
          auto it = c.count.find({op, g});
          return it == c.count.end() ? int64_t{0} : it->second;
        };
        // Per step: block (resharded after forward: gathered in forward and
        // backward) dense 2 params, experts 4 params; root (kept) 2 params.
        const int64_t ag_world = fused ? 2 + 1 : 2 * 2 + 2;
        const int64_t ag_expert = fused ? 2 : 2 * 4;
        const int64_t rs_world = fused ? 1 + 1 : 2 + 2;
        const int64_t rs_expert = fused ? 1 : 4;
        BOOST_TEST(count("all_gather", world_g) == ag_world);
        BOOST_TEST(count("all_gather", efsdp_g) == ag_expert);
        BOOST_TEST(count("reduce_scatter", world_g) == rs_world);
        BOOST_TEST(count("reduce_scatter", efsdp_g) == rs_expert);
        BOOST_TEST(count("all_reduce", ep_g) == rs_expert);
        BOOST_TEST(count("all_reduce", world_g) == 0);

        ref_opt.zero_grad();
        toy::mse(ref(batch.x.to(spmd::device())), batch.y.to(spmd::device())).backward();
        report.check("step " + std::to_string(step) + " grads vs single card",
                     worst_shard_err(*net, *ref, split, true), tol);
        opt.step();
        ref_opt.step();
        opt.zero_grad();
        report.check("step " + std::to_string(step) + " params vs single card",
                     worst_shard_err(*net, *ref, split, false), tol);
      }
      report.publish();
    }
  }
}

// gradient_divide_factor: the expert group divides by 8 instead of its
// mesh's 4 ranks, so its gradients are half the single-card mean. The unit's
// mesh names its shard dim, which the experts' mesh does not have.
BOOST_AUTO_TEST_CASE(test_gradient_divide_factor_per_group,  // [ours]
                     *spmd::needs_world_size(4, "2-rank expert sub-meshes")) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const auto dev = spmd::device().type();
  const auto world = fsdp::init_device_mesh(dev, {1, 4}, {"replicate", "shard"});
  const auto sparse = fsdp::init_device_mesh(dev, {2, 2}, {"ep", "efsdp"});
  Net ref(6);
  Net net(6);
  ref->to(spmd::device());
  net->to(spmd::device());
  auto model = shard_expert_net(net, world, sparse, /*fused=*/false, 8.0, "shard");
  const auto batch = toy::global_batch(60, 8, 6, 3);
  const auto mine = toy::slice(batch, rank, ws);
  toy::mse(model(mine.x.to(spmd::device())), mine.y.to(spmd::device())).backward();
  toy::mse(ref(batch.x.to(spmd::device())), batch.y.to(spmd::device())).backward();
  double dense_err = 0, expert_err = 0;
  auto ref_params = ref->named_parameters();
  for (const auto& item : net->named_parameters()) {
    const bool expert = item.key().find("expert") != std::string::npos;
    const at::Tensor want =
        expert ? toy::ceil_div_rows(host(ref_params[item.key()].grad()), 0, 2,
                                    sparse.get_local_rank("efsdp")) *
                     0.5
               : toy::ceil_div_rows(host(ref_params[item.key()].grad()), 0, 4, rank);
    (expert ? expert_err : dense_err) = std::max(
        expert ? expert_err : dense_err, testkit::max_abs_diff_or_inf(item.value().grad(), want));
  }
  l1::Report report("core divide factor");
  report.check("dense grads (factor 4) vs single card", dense_err, 1e-5);
  report.check("expert grads (factor 8) vs half the single card", expert_err, 1e-5);
  report.publish();
}

// The unit names both of FSDP's dims ("dense" and "replicate"); the experts'
// (replicate, efsdp) mesh has the replicate name but not the shard dim's,
// so its dims are positional (replicate, shard) -- no MeshError asking for
// a shard dim that mesh cannot have.
BOOST_AUTO_TEST_CASE(test_expert_mesh_without_the_units_shard_dim,  // [ours]
                     *spmd::needs_world_size(4, "2-rank expert sub-meshes")) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const auto dev = spmd::device().type();
  const auto world = fsdp::init_device_mesh(dev, {1, 4}, {"replicate", "dense"});
  const auto sparse = fsdp::init_device_mesh(dev, {2, 2}, {"replicate", "efsdp"});
  Net ref(7);
  Net net(7);
  ref->to(spmd::device());
  net->to(spmd::device());
  auto model = shard_expert_net(net, world, sparse, /*fused=*/false, std::nullopt, "dense",
                                "replicate");
  const auto split = expert_split(*net, sparse, rank);
  const auto batch = toy::global_batch(70, 8, 6, 3);
  const auto mine = toy::slice(batch, rank, ws);
  toy::mse(model(mine.x.to(spmd::device())), mine.y.to(spmd::device())).backward();
  toy::mse(ref(batch.x.to(spmd::device())), batch.y.to(spmd::device())).backward();
  l1::Report report("core expert mesh without the unit's shard dim");
  report.check("grads vs single card", worst_shard_err(*net, *ref, split, true), 1e-5);
  report.publish();
}
