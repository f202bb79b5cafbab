// The FSDP core on per-parameter layouts: layouts on meshes of 1, 2 and 3
// dims (DTensor parameters sharded by TP included) round-trip bitwise;
// several parameter groups in one unit train like a single card with the
// exact collectives per group; unit lifecycles reject illegal transitions
// and the step after one recovers; reshard returns device memory; gradients
// partial over tp are all-reduced there before FSDP reduces them;
// reduce_gradients after unsynchronised microbatches reduces once per
// unit like a single card, and is harmless with nothing accumulated and a
// StateError during backward.
#include "l1_util.h"
#include "spmd.h"
#include "toy_models.h"

#include "sharding/lifecycle.h"

#include <fsdp/clip_grad.h>
#include <fsdp/comm.h>
#include <fsdp/dtensor.h>
#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#ifdef FSDP_WITH_NCCL
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <cmath>
#include <map>
#include <string>
#include <vector>

namespace {

at::Tensor host(const at::Tensor& t) { return t.detach().to(at::kCPU); }

bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.sizes() == b.sizes() &&
         a.scalar_type() == b.scalar_type() && at::equal(host(a), host(b));
}

// A module with parameters of awkward shapes, and (for TP) two parameters
// that are pieces of global tensors sharded over the tp dim.
struct LayoutsImpl : torch::nn::Module {
  LayoutsImpl(const std::map<std::string, at::Tensor>& init) {
    for (const auto& [name, t] : init) params[name] = register_parameter(name, t.clone());
  }
  std::map<std::string, at::Tensor> params;
};
TORCH_MODULE(Layouts);

struct MeshCase {
  std::string label;
  std::vector<int64_t> shape;
  std::vector<std::string> names;
  std::string shard = "shard";  // FSDP's shard dim (FullyShardOptions::shard_dim)
};

}  // namespace

// Shard -> all-gather -> full tensor equals the original bitwise, on meshes of
// 1, 2 and 3 dims, for Shard(0) (uneven: 7 rows; fewer rows than ranks: 3),
// Shard(1), Replicate, and TP DTensor parameters (colwise Shard(0): FSDP inside
// the TP shard of the same dim, a strided shard; rowwise Shard(1)).
BOOST_AUTO_TEST_CASE(test_layout_round_trip) {
  const int ws = spmd::world_size();
  const int64_t tp = ws >= 4 ? 2 : 1;
  const std::vector<MeshCase> meshes = {
      {"1-D", {ws}, {"shard"}},
      {"2-D HSDP", {ws >= 4 ? 2 : 1, ws >= 4 ? ws / 2 : ws}, {"replicate", "shard"}},
      {"3-D (replicate, shard, tp)", {1, ws / tp, tp}, {"replicate", "shard", "tp"}},
      // pp is carried through like tp (parameters are replicated on it).
      {"3-D (pp, dp, tp), shard_dim dp", {1, ws / tp, tp}, {"pp", "dp", "tp"}, "dp"},
      // Experts sharded by EP on the last dim, FSDP over efsdp inside them.
      {"3-D (replicate, efsdp, ep), shard_dim efsdp", {1, ws / tp, tp},
       {"replicate", "efsdp", "ep"}, "efsdp"},
  };
  at::manual_seed(11);
  const std::map<std::string, at::Tensor> plain = {
      {"a_7rows", at::randn({7, 4})},   {"b_3rows", at::randn({3, 5})},
      {"c_dim1", at::randn({3, 4})},    {"d_bias", at::randn({5})},
      {"e_replicated", at::randn({2, 3})}};
  const at::Tensor col_global = at::randn({8, 4});  // colwise: Shard(0) on tp
  const at::Tensor row_global = at::randn({4, 8});  // rowwise: Shard(1) on tp
  for (const auto& mc : meshes) {
    BOOST_TEST_CONTEXT("mesh " << mc.label) {
      const auto mesh = fsdp::init_device_mesh(spmd::device().type(), mc.shape, mc.names);
      const bool with_tp = mc.names.size() == 3;
      std::map<std::string, at::Tensor> init = plain;
      int64_t tp_rank = 0;
      if (with_tp) {
        tp_rank = mesh.get_local_rank(mc.names[2]);
        init["f_colwise"] = toy::ceil_div_rows(col_global, 0, tp, tp_rank);
        init["g_rowwise"] = toy::ceil_div_rows(row_global, 1, tp, tp_rank);
      }
      for (auto& [name, t] : init) t = t.to(spmd::device());
      Layouts m(init);
      fsdp::FullyShardOptions o;
      o.mesh = mesh;
      if (mc.shard != "shard") o.shard_dim = mc.shard;
      o.replicate_params = {m->params.at("e_replicated")};
      o.shard_placement_fn = [](const std::string& name,
                                const at::Tensor&) -> std::optional<fsdp::ShardPlacementResult> {
        if (name == "c_dim1") return fsdp::ShardPlacementResult(fsdp::Placement::Shard(1));
        return std::nullopt;
      };
      if (with_tp) {
        const auto tp_mesh = mesh[mc.names[2]];
        o.dtensor_params = {
            fsdp::DTensor::from_local(m->params.at("f_colwise"), tp_mesh,
                                      {fsdp::Placement::Shard(0)}, col_global.sizes().vec()),
            fsdp::DTensor::from_local(m->params.at("g_rowwise"), tp_mesh,
                                      {fsdp::Placement::Shard(1)}, row_global.sizes().vec())};
      }
      fsdp::FSDPModule unit = fsdp::fully_shard(m.ptr(), o);

      const int64_t shards = mesh.size(mc.shard);
      const int64_t s = mesh.get_local_rank(mc.shard);
      std::map<std::string, at::Tensor> global = plain;
      if (with_tp) {
        global["f_colwise"] = col_global;
        global["g_rowwise"] = row_global;
      }
      // What this rank must own, computed here from the layout rules.
      std::map<std::string, at::Tensor> want = {
          {"a_7rows", toy::ceil_div_rows(plain.at("a_7rows"), 0, shards, s)},
          {"b_3rows", toy::ceil_div_rows(plain.at("b_3rows"), 0, shards, s)},
          {"c_dim1", toy::ceil_div_rows(plain.at("c_dim1"), 1, shards, s)},
          {"d_bias", toy::ceil_div_rows(plain.at("d_bias"), 0, shards, s)},
          {"e_replicated", plain.at("e_replicated")}};
      if (with_tp) {
        // TP first, then FSDP inside the TP piece (both along dim 0).
        want["f_colwise"] =
            toy::ceil_div_rows(toy::ceil_div_rows(col_global, 0, tp, tp_rank), 0, shards, s);
        want["g_rowwise"] =
            toy::ceil_div_rows(toy::ceil_div_rows(row_global, 1, tp, tp_rank), 0, shards, s);
      }
      for (const auto& [name, t] : want) {
        BOOST_TEST(bitwise_equal(m->params.at(name), t), name << ": local shard differs");
      }
      // The DTensor view and the full tensor.
      std::map<std::string, fsdp::DTensor> dts;
      for (auto& [name, dt] : unit.sharded_parameters()) dts.emplace(name, dt);
      BOOST_TEST(dts.size() == global.size());
      for (const auto& [name, full] : unit.full_state_dict()) {
        BOOST_TEST(bitwise_equal(full, global.at(name)), name << ": full tensor differs");
      }
      if (with_tp) {
        const auto& col = dts.at("f_colwise").placements();
        BOOST_TEST(col.size() == 3u);
        BOOST_TEST(col[0].is_replicate());
        if (tp > 1) {
          BOOST_TEST(
              (col[1].is_strided_shard() && col[1].dim() == 0 && col[1].split_factor() == tp),
              "colwise FSDP placement is " << col[1].to_string());
        } else {
          BOOST_TEST((col[1].is_shard(0) && !col[1].is_strided_shard()), col[1].to_string());
        }
        BOOST_TEST(col[2].is_shard(0));
        const auto& row = dts.at("g_rowwise").placements();
        BOOST_TEST((row[1].is_shard(0) && !row[1].is_strided_shard()), row[1].to_string());
        BOOST_TEST(row[2].is_shard(1));
        BOOST_TEST(dts.at("a_7rows").placements()[2].is_replicate());
      }
    }
  }
}

// The global gradient norm counts every element of every global gradient
// once: shards are summed over FSDP's shard dim and the TP dim, replicas
// (HSDP replicate dim, TP-replicated parameters, Replicate placements) once.
BOOST_AUTO_TEST_CASE(test_grad_norm_over_fsdp_and_tp_dims) {
  const int ws = spmd::world_size();
  std::vector<MeshCase> meshes = {{"(replicate, shard, tp) = (1, N/2, 2)", {1, ws / 2, 2},
                                   {"replicate", "shard", "tp"}}};
  if (ws == 4) meshes.push_back({"(2, 1, 2)", {2, 1, 2}, {"replicate", "shard", "tp"}});
  at::manual_seed(21);
  const std::map<std::string, at::Tensor> plain = {{"a_7rows", at::randn({7, 4})},
                                                   {"e_replicated", at::randn({2, 3})}};
  const at::Tensor col_global = at::randn({8, 4});
  const at::Tensor row_global = at::randn({4, 8});
  for (const auto& mc : meshes) {
    BOOST_TEST_CONTEXT("mesh " << mc.label) {
      const auto mesh = fsdp::init_device_mesh(spmd::device().type(), mc.shape, mc.names);
      const int64_t tp = mesh.size("tp"), j = mesh.get_local_rank("tp");
      std::map<std::string, at::Tensor> init = plain;
      init["f_colwise"] = toy::ceil_div_rows(col_global, 0, tp, j);
      init["g_rowwise"] = toy::ceil_div_rows(row_global, 1, tp, j);
      for (auto& [name, t] : init) t = t.to(spmd::device());
      Layouts m(init);
      fsdp::FullyShardOptions o;
      o.mesh = mesh;
      o.replicate_params = {m->params.at("e_replicated")};
      o.dtensor_params = {
          fsdp::DTensor::from_local(m->params.at("f_colwise"), mesh["tp"],
                                    {fsdp::Placement::Shard(0)}, col_global.sizes().vec()),
          fsdp::DTensor::from_local(m->params.at("g_rowwise"), mesh["tp"],
                                    {fsdp::Placement::Shard(1)}, row_global.sizes().vec())};
      fsdp::FSDPModule unit = fsdp::fully_shard(m.ptr(), o);
      // Global gradients (the same on every rank); each rank gets its piece.
      at::manual_seed(22);
      double sum_sq = 0, max_abs = 0;
      for (auto& [name, dt] : unit.sharded_parameters()) {
        const at::Tensor g = at::randn(dt.shape(), at::kDouble).to(at::kFloat);
        sum_sq += g.to(at::kDouble).pow(2).sum().item<double>();
        max_abs = std::max(max_abs, g.abs().max().item<double>());
        const at::Tensor local =
            fsdp::distribute_tensor(g.to(spmd::device()), dt.device_mesh(), dt.placements())
                .to_local();
        m->params.at(name).mutable_grad() = local.clone();
      }
      const double norm2 = fsdp::total_grad_norm({unit}, {}, 2.0);
      const double norm_inf = fsdp::total_grad_norm({unit}, {}, l1::kInf);
      l1::Report report("core grad norm " + mc.label);
      report.check("2-norm vs the global gradients' (relative)",
                   std::abs(norm2 - std::sqrt(sum_sq)) / std::sqrt(sum_sq), 1e-6);
      report.check("inf-norm vs the global gradients'", std::abs(norm_inf - max_abs), 0.0);
      report.publish();
    }
  }
}

// Bad layouts get a typed error naming the argument, before any parameter
// is touched (the module can be sharded correctly afterwards).
BOOST_AUTO_TEST_CASE(test_layout_errors_are_typed) {
  const int ws = spmd::world_size();
  const auto dev = spmd::device().type();
  const auto plain3 = fsdp::init_device_mesh(dev, {1, ws, 1}, {"a", "b", "c"});
  const auto named = fsdp::init_device_mesh(dev, {1, ws, 1}, {"replicate", "shard", "tp"});
  const auto flat = fsdp::init_device_mesh(dev, {ws}, {"shard"});
  const auto other = fsdp::init_device_mesh(dev, {ws}, {"x"});
  auto module = [] {
    at::manual_seed(3);
    return Layouts(std::map<std::string, at::Tensor>{{"w", at::randn({4, 2})}});
  };
  auto attempt = [](Layouts& m, const fsdp::FullyShardOptions& o) {
    fsdp::fully_shard(m.ptr(), o);
  };
  Layouts m = module();
  const std::vector<int64_t> shape42 = {4, 2};
  const at::Tensor w0 = m->params.at("w").detach().clone();
  {
    fsdp::FullyShardOptions o;
    o.mesh = plain3;
    l1::expect_error<fsdp::MeshError>([&] { attempt(m, o); }, "mesh", "3-D mesh, no FSDP dims");
    o.shard_dim = "nope";
    l1::expect_error<fsdp::MeshError>([&] { attempt(m, o); }, "shard_dim", "unknown shard_dim");
    o.shard_dim = "b";
    o.replicate_dim = "b";
    l1::expect_error<fsdp::MeshError>([&] { attempt(m, o); }, "replicate_dim",
                                      "replicate_dim == shard_dim");
  }
  {
    fsdp::FullyShardOptions o;
    o.mesh = named;
    o.dtensor_params = {fsdp::DTensor()};
    l1::expect_error<fsdp::ArgumentError>([&] { attempt(m, o); }, "dtensor_params",
                                          "undefined DTensor");
    const at::Tensor stranger = at::zeros({4, 2}, m->params.at("w").options());
    o.dtensor_params = {fsdp::DTensor::from_local(stranger, named["tp"],
                                                  {fsdp::Placement::Replicate()}, shape42)};
    l1::expect_error<fsdp::ArgumentError>([&] { attempt(m, o); }, "dtensor_params",
                                          "DTensor of a tensor that is not a parameter");
    o.dtensor_params = {fsdp::DTensor::from_local(m->params.at("w"), named["shard"],
                                                  {fsdp::Placement::Replicate()}, shape42)};
    l1::expect_error<fsdp::MeshError>([&] { attempt(m, o); }, "dtensor_params",
                                      "DTensor on FSDP's own dim");
    o.dtensor_params = {fsdp::DTensor::from_local(m->params.at("w"), named["tp"],
                                                  {fsdp::Placement::Partial()}, shape42)};
    l1::expect_error<fsdp::ArgumentError>([&] { attempt(m, o); }, "dtensor_params",
                                          "Partial DTensor parameter");
    o.dtensor_params = {fsdp::DTensor::from_local(m->params.at("w"), other,
                                                  {fsdp::Placement::Replicate()}, shape42)};
    l1::expect_error<fsdp::MeshError>([&] { attempt(m, o); }, "dtensor_params",
                                      "DTensor on an unrelated mesh, carried dims");
    o.mesh = flat;
    l1::expect_error<fsdp::MeshError>([&] { attempt(m, o); }, "dtensor_params",
                                      "DTensor on a mesh that cannot be joined");
  }
  {
    fsdp::FullyShardOptions o;
    o.mesh = flat;
    o.shard_placement_fn = [flat](const std::string&,
                                  const at::Tensor&) -> std::optional<fsdp::ShardPlacementResult> {
      return fsdp::ShardPlacementResult(fsdp::Placement::Shard(0), flat, 0.0);
    };
    l1::expect_error<fsdp::ArgumentError>([&] { attempt(m, o); }, "shard_placement_fn",
                                          "gradient_divide_factor 0");
    o.shard_placement_fn = [](const std::string&,
                              const at::Tensor&) -> std::optional<fsdp::ShardPlacementResult> {
      return fsdp::ShardPlacementResult(fsdp::Placement::StridedShard(0, 1));
    };
    l1::expect_error<fsdp::ArgumentError>([&] { attempt(m, o); }, "shard_placement_fn",
                                          "StridedShard from shard_placement_fn");
  }
  BOOST_TEST(bitwise_equal(m->params.at("w"), w0), "a rejected call changed the parameter");
  fsdp::FSDPModule unit = fsdp::fully_shard(m.ptr());
  l1::expect_error<fsdp::ArgumentError>([&] { unit.set_gradient_divide_factor(-1.0); }, "factor",
                                        "set_gradient_divide_factor(-1)");
  BOOST_TEST(bitwise_equal(unit.full_state_dict().front().second, w0));
}

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
    const double e = l1::diff(got, want);
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

BOOST_AUTO_TEST_CASE(test_several_param_groups_in_one_unit,
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
BOOST_AUTO_TEST_CASE(test_gradient_divide_factor_per_group,
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
    (expert ? expert_err : dense_err) =
        std::max(expert ? expert_err : dense_err, l1::diff(item.value().grad(), want));
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
BOOST_AUTO_TEST_CASE(test_expert_mesh_without_the_units_shard_dim,
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

// The transition table of a unit's lifecycle, edge by edge.
BOOST_AUTO_TEST_CASE(test_lifecycle_transitions) {
  using L = fsdp::detail::Lifecycle;
  const std::vector<L> all = {L::Idle, L::Forward, L::PreBackward, L::PostBackward};
  const std::set<std::pair<L, L>> legal = {
      {L::Idle, L::Forward},         {L::PreBackward, L::Forward},  {L::Idle, L::PreBackward},
      {L::PreBackward, L::PreBackward}, {L::PreBackward, L::PostBackward},
      {L::Forward, L::Idle},         {L::PostBackward, L::Idle},    {L::Idle, L::Idle}};
  for (L from : all) {
    for (L to : all) {
      fsdp::detail::UnitLifecycle lc;
      // Walk to `from` through legal edges.
      if (from == L::Forward) lc.transition(L::Forward, "u", "test");
      if (from == L::PreBackward) lc.transition(L::PreBackward, "u", "test");
      if (from == L::PostBackward) {
        lc.transition(L::PreBackward, "u", "test");
        lc.transition(L::PostBackward, "u", "test");
      }
      const bool ok = legal.count({from, to}) > 0;
      if (ok) {
        BOOST_CHECK_NO_THROW(lc.transition(to, "u", "test"));
      } else {
        try {
          lc.transition(to, "block #3", "test");
          BOOST_ERROR(fsdp::detail::to_string(from) << " -> " << fsdp::detail::to_string(to)
                                                    << " did not throw");
        } catch (const fsdp::StateError& e) {
          const std::string msg = e.what();
          const std::string edge = std::string(fsdp::detail::to_string(from)) + " -> " +
                                   fsdp::detail::to_string(to);
          BOOST_TEST(msg.find("block #3") != std::string::npos, msg);
          BOOST_TEST(msg.find(edge) != std::string::npos, msg);
        }
      }
    }
  }
  // Forward returns to where it came from.
  fsdp::detail::UnitLifecycle lc;
  lc.transition(L::PreBackward, "u", "test");
  lc.enter_forward("u");
  lc.leave_forward("u");
  BOOST_TEST((lc.state() == L::PreBackward));
  BOOST_CHECK_THROW(lc.leave_forward("u"), fsdp::StateError);
}

namespace {

// Identity; in backward it runs a forward of `target` (by then a unit that
// has reduced in this backward): an illegal PostBackward -> Forward.
struct ReenterForward : public torch::autograd::Function<ReenterForward> {
  static at::Tensor forward(torch::autograd::AutogradContext* c, const at::Tensor& x,
                            int64_t which) {
    c->saved_data["which"] = which;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* c,
                                                 torch::autograd::variable_list grads);
};

struct TwoUnitsImpl : torch::nn::Module {
  explicit TwoUnitsImpl(int64_t seed) {
    at::manual_seed(seed);
    a = register_module("a", torch::nn::Linear(15, 7));
    b = register_module("b", torch::nn::Linear(7, 5));
  }
  at::Tensor forward(at::Tensor x) {
    at::Tensor h = at::tanh(a(x));
    if (probe) h = ReenterForward::apply(h, 0);
    return b(h);
  }
  fsdp::Sharded<torch::nn::Linear> a{nullptr}, b{nullptr};
  bool probe = false;
};
TORCH_MODULE(TwoUnits);

TwoUnitsImpl* probe_target = nullptr;

// a, b, then the root; `model` becomes the probe's target.
fsdp::FSDPModule shard_two_units(TwoUnits& model, TwoUnits& ref) {
  ref->to(spmd::device());
  model->to(spmd::device());
  fsdp::fully_shard(model->a);
  fsdp::fully_shard(model->b);
  probe_target = model.get();
  return fsdp::fully_shard(model.ptr());
}

torch::autograd::variable_list ReenterForward::backward(torch::autograd::AutogradContext*,
                                                        torch::autograd::variable_list grads) {
  // b's gradients are all in (it is downstream of the probe): b has reduced.
  (void)probe_target->b(at::zeros({1, 7}, grads[0].options()));
  return {grads[0], at::Tensor()};
}

}  // namespace

// A forward of a unit that already reduced in this backward is a StateError
// naming the unit and both states; the user catches it and the next step
// equals a single-card step from the same parameters.
BOOST_AUTO_TEST_CASE(test_illegal_transition_raises_and_next_step_recovers) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  TwoUnits ref(3);
  TwoUnits model(3);
  shard_two_units(model, ref);
  fsdp::Sharded<TwoUnits> root(model);
  const auto batch = toy::global_batch(70, 8);
  const auto mine = toy::slice(batch, rank, ws);
  const at::Tensor x = mine.x.to(spmd::device());
  const at::Tensor y = mine.y.to(spmd::device());
  std::string msg;
  bool typed = false;
  model->probe = true;
  try {
    toy::mse(root(x), y).backward();
  } catch (const fsdp::StateError& e) {
    msg = e.what();
    typed = true;
  } catch (const std::exception& e) {
    msg = e.what();
  }
  model->probe = false;
  BOOST_TEST(typed, "not a StateError: '" << msg << "'");
  BOOST_TEST(msg.find("illegal transition PostBackward -> Forward") != std::string::npos,
             "message: '" << msg << "'");
  BOOST_TEST(msg.find("unit b #") != std::string::npos, "names the unit: " << msg);
  // The failed step installed nothing; the next one equals a single-card step.
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  toy::mse(root(x), y).backward();
  toy::mse(ref(batch.x.to(spmd::device())), batch.y.to(spmd::device())).backward();
  l1::Report report("core illegal transition");
  report.check("next step grads vs single card", l1::grad_err(*model, *ref, ws, rank), 1e-5);
  report.publish();
  probe_target = nullptr;
}

// A failed pass after an unsynchronised one: the earlier accumulation is
// kept, the failed pass's gradient (and the reduction it had issued) is not.
BOOST_AUTO_TEST_CASE(test_failed_pass_keeps_earlier_accumulation) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  TwoUnits ref(4);
  TwoUnits model(4);
  fsdp::FSDPModule root_unit = shard_two_units(model, ref);
  fsdp::Sharded<TwoUnits> root(model);
  auto loss_of = [&](TwoUnits& m, bool sharded, int64_t seed) {
    const auto batch = toy::global_batch(seed, 8, 15, 5);
    const auto b = sharded ? toy::slice(batch, rank, ws) : batch;
    const at::Tensor x = b.x.to(spmd::device()), y = b.y.to(spmd::device());
    return toy::mse(sharded ? root(x) : m(x), y);
  };
  root_unit.set_requires_gradient_sync(false);
  loss_of(model, true, 81).backward();  // accumulated locally
  root_unit.set_requires_gradient_sync(true);
  model->probe = true;  // b has reduced when the probe throws
  bool threw = false;
  try {
    loss_of(model, true, 82).backward();
  } catch (const fsdp::StateError&) {
    threw = true;
  }
  model->probe = false;
  BOOST_TEST(threw, "the failing pass did not throw");
  loss_of(model, true, 83).backward();  // synchronised: reduces 81 + 83
  loss_of(ref, false, 81).backward();
  loss_of(ref, false, 83).backward();
  l1::Report report("core failed pass after no-sync accumulation");
  report.check("grads vs single card of the two good passes", l1::grad_err(*model, *ref, ws, rank),
               1e-5);
  report.publish();
  probe_target = nullptr;
}

// Reshard returns the unsharded parameters' device memory (CUDA: the
// caching allocator's allocated bytes fall back to the level before the
// gather). The CPU form is test_fully_shard_with_ac's tracking allocator.
BOOST_AUTO_TEST_CASE(test_reshard_frees_device_memory,
                     *spmd::needs_device(c10::kCUDA, "the CUDA caching allocator's bytes (the CPU "
                                                     "form is in test_fully_shard_with_ac)")) {
#ifdef FSDP_WITH_NCCL
  const auto dev = spmd::device();
  auto allocated = [&dev] {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(dev.index()).allocated_bytes[0].current;
  };
  torch::nn::Linear big(torch::nn::LinearOptions(1024, 1024).bias(false));
  big->to(dev);
  auto unit = fsdp::fully_shard(big.ptr());
  const int64_t sharded = allocated();
  unit.unshard();
  const int64_t full = allocated();
  unit.reshard();
  const int64_t after = allocated();
  BOOST_TEST(full - sharded >= int64_t{1024} * 1024 * 4, "unshard allocated " << full - sharded);
  BOOST_TEST(after == sharded, "after reshard " << after << " B, sharded " << sharded << " B");
#else
  BOOST_ERROR("a CUDA device without the NCCL backend built");
#endif
}

// A parameter replicated over tp whose gradient is a partial sum there (a
// sequence-parallel norm weight: each tp rank sees part of the sequence) is
// all-reduced over tp, in reduce_dtype, before FSDP's reduce-scatter; a
// tp-replicated parameter with identical gradients and a TP-sharded one get
// no tp communication. Gradients equal a single-process autograd run of the
// global objective (mean over dp rows of replicated + every tp part).
BOOST_AUTO_TEST_CASE(test_partial_tp_gradients_reduced_over_tp,
                     *spmd::needs_even_world_size("tp = 2")) {
  const int ws = spmd::world_size();
  const int64_t dp = ws / 2, tp = 2, D = 6, S = 4;  // S rows per tp rank
  const auto mesh = fsdp::init_device_mesh(spmd::device().type(), {dp, tp}, {"shard", "tp"});
  const int64_t d = mesh.get_local_rank("shard"), j = mesh.get_local_rank("tp");
  at::manual_seed(31);
  const at::Tensor w0 = at::randn({D}), v0 = at::randn({3}), u0 = at::randn({2 * tp});
  const at::Tensor x = at::randn({dp, tp * S, D}), c = at::randn({dp, 3}),
                   z = at::randn({dp, 2 * tp});
  // This rank's objective: the tp-replicated part plus its share of the rows.
  auto objective = [&](const at::Tensor& w, const at::Tensor& v, const at::Tensor& u_local,
                       int64_t row, int64_t part) {
    const at::Tensor xs = x[row].narrow(0, part * S, S).to(w.device());
    return (xs * w).pow(2).sum() * 0.5 + (v * c[row].to(v.device())).sum().pow(2) +
           (u_local * z[row].narrow(0, part * 2, 2).to(u_local.device())).sum();
  };
  // Reference: every (row, part) on this process, mean over rows.
  at::Tensor rw = w0.clone().requires_grad_(), rv = v0.clone().requires_grad_(),
             ru = u0.clone().requires_grad_();
  at::Tensor total = at::zeros({});
  for (int64_t row = 0; row < dp; ++row) {
    total = total + (rv * c[row]).sum().pow(2);
    for (int64_t part = 0; part < tp; ++part) {
      const at::Tensor xs = x[row].narrow(0, part * S, S);
      total = total + (xs * rw).pow(2).sum() * 0.5 +
              (ru.narrow(0, part * 2, 2) * z[row].narrow(0, part * 2, 2)).sum();
    }
  }
  (total / static_cast<double>(dp)).backward();

  for (const bool bf16 : {false, true}) {
    BOOST_TEST_CONTEXT((bf16 ? "param_dtype bf16, reduce_dtype fp32" : "fp32")) {
      const auto dev = spmd::device();
      Layouts m(std::map<std::string, at::Tensor>{
          {"norm_w", w0.to(dev)}, {"rep_v", v0.to(dev)}, {"tp_u", u0.narrow(0, j * 2, 2).to(dev)}});
      fsdp::FullyShardOptions o;
      o.mesh = mesh;
      if (bf16) {
        o.mp_policy.param_dtype = at::kBFloat16;
        o.mp_policy.reduce_dtype = at::kFloat;
      }
      const auto tp_mesh = mesh["tp"];
      o.dtensor_params = {
          fsdp::DistributedParam(fsdp::DTensor::from_local(m->params.at("norm_w"), tp_mesh,
                                                           {fsdp::Placement::Replicate()}, std::vector<int64_t>{D}),
                                 {fsdp::Placement::Partial()}),
          fsdp::DTensor::from_local(m->params.at("rep_v"), tp_mesh,
                                    {fsdp::Placement::Replicate()}, std::vector<int64_t>{3}),
          fsdp::DTensor::from_local(m->params.at("tp_u"), tp_mesh, {fsdp::Placement::Shard(0)},
                                    std::vector<int64_t>{2 * tp})};
      fsdp::FSDPModule unit = fsdp::fully_shard(m.ptr(), o);
      unit.unshard();
      fsdp::reset_collective_counters();
      objective(m->params.at("norm_w"), m->params.at("rep_v"), m->params.at("tp_u"), d, j)
          .backward();
      unit.reshard();
      const auto counts = fsdp::collective_counters();
      const std::string tp_group = mesh.get_group("tp")->name();
      BOOST_TEST(counts.count.at({"all_reduce", tp_group}) == 1);  // norm_w only
      BOOST_TEST(counts.total("all_reduce", tp_group) == 1);
      // In reduce_dtype (fp32) whatever the compute dtype: D floats.
      BOOST_TEST(counts.bytes.at({"all_reduce", tp_group}) == D * 4);
      l1::Report report(std::string("core partial tp grads ") + (bf16 ? "bf16" : "fp32"));
      const double tol = bf16 ? 5e-2 : 1e-5;
      const std::map<std::string, at::Tensor> want = {
          {"norm_w", rw.grad()}, {"rep_v", rv.grad()}, {"tp_u", ru.grad()}};
      for (auto& [name, dt] : unit.sharded_parameters()) {
        const at::Tensor g = fsdp::DTensor::from_local(m->params.at(name).grad(),
                                                       dt.device_mesh(), dt.placements(),
                                                       dt.shape())
                                 .full_tensor();
        report.check(name + " grad vs single process", toy::max_abs_diff(host(g), want.at(name)),
                     tol);
      }
      report.publish();
    }
  }
  // Gradient placements that are not the parameter's, nor Partial where it
  // is Replicate, and a wrong count, are typed errors.
  const auto tp_mesh = mesh["tp"];
  Layouts bad(std::map<std::string, at::Tensor>{{"tp_u", u0.narrow(0, j * 2, 2)}});
  const fsdp::DTensor u = fsdp::DTensor::from_local(
      bad->params.at("tp_u"), tp_mesh, {fsdp::Placement::Shard(0)}, std::vector<int64_t>{2 * tp});
  fsdp::FullyShardOptions o;
  o.mesh = mesh;
  o.dtensor_params = {fsdp::DistributedParam(u, {fsdp::Placement::Partial()})};
  l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(bad.ptr(), o); },
                                        "dtensor_params", "Partial gradient of a Shard param");
  o.dtensor_params = {
      fsdp::DistributedParam(u, {fsdp::Placement::Shard(0), fsdp::Placement::Shard(0)})};
  l1::expect_error<fsdp::ArgumentError>([&] { fsdp::fully_shard(bad.ptr(), o); },
                                        "dtensor_params", "two grad placements on a 1-D mesh");
}

// ---- FSDPModule::reduce_gradients -----------------------------------------

namespace {

// Microbatch j of this rank's slice of `global` (k microbatches per rank).
toy::Batch microbatch(const toy::Batch& mine, int64_t k, int64_t j) {
  const int64_t per = mine.x.size(0) / k;
  return {mine.x.narrow(0, j * per, per), mine.y.narrow(0, j * per, per)};
}

struct ReduceMesh {
  std::string label;
  fsdp::DeviceMesh mesh;
  int64_t parts, index;             // the shard dim: size, this rank's place
  std::string shard_group, replicate_group;  // "" when 1-D
};

std::vector<ReduceMesh> reduce_meshes() {
  const int ws = spmd::world_size();
  const auto dev = spmd::device().type();
  std::vector<ReduceMesh> out;
  const auto flat = fsdp::init_device_mesh(dev, {ws}, {"shard"});
  out.push_back({"1-D", flat, ws, spmd::rank(), flat.get_group("shard")->name(), ""});
  if (ws == 4) {
    const auto hsdp = fsdp::init_device_mesh(dev, {2, 2}, {"replicate", "shard"});
    out.push_back({"HSDP 2x2", hsdp, 2, hsdp.get_local_rank("shard"),
                   hsdp.get_group("shard")->name(), hsdp.get_group("replicate")->name()});
  }
  return out;
}

}  // namespace

// A pipeline stage's step: k microbatches forward + backward with no
// gradient sync, no reshard after backward and not the last backward, then
// one reduce_gradients(): the sharded gradients equal a single card's on
// the whole global batch (loss = the microbatch losses summed, averaged
// over the data-parallel replicas as FSDP does), with exactly one
// reduce-scatter per unit (comm_fusion) or per parameter (unfused), an
// all-reduce per reduce-scatter over HSDP's replicate dim, no all-gather,
// and the parameters resharded afterwards. A second round adds to the
// gradients the first left (param.grad() accumulates).
// float16 gradient means that fit while their sum over the ranks does not:
// FSDP must divide before the reduction (by the smallest power of two >=
// sqrt(world), and by the rest after), not sum and then divide. Rank r's
// gradient is scale * c(r) in every element; the plain fp16 sum of them
// overflows (checked first, so the case is known to be in that regime).
BOOST_AUTO_TEST_CASE(test_fp16_gradient_mean_does_not_overflow) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const auto dev = spmd::device();
  constexpr double kHalfMax = 65504;
  double pre = 1;
  while (ws / pre > pre) pre *= 2;
  const double scale = 0.8 * kHalfMax * pre / ws;
  auto c = [ws](int r) { return 1.0 + 0.125 * r / ws; };
  double want = 0;
  for (int r = 0; r < ws; ++r) want += scale * c(r) / ws;
  const auto half = at::TensorOptions().dtype(at::kHalf).device(dev);

  at::Tensor plain_sum = at::full({4}, scale * c(rank), half);
  fsdp::world_group()->all_reduce(plain_sum, fsdp::ReduceOp::SUM);
  BOOST_TEST_REQUIRE(std::isinf(host(plain_sum).to(at::kFloat)[0].item<float>()),
                     "the plain float16 sum should overflow at this scale");

  std::vector<std::pair<std::string, fsdp::DeviceMesh>> meshes = {
      {"FSDP 1-D", fsdp::init_device_mesh(dev.type(), {ws}, {"shard"})}};
  if (ws == 4) {
    meshes.emplace_back("HSDP 2x2",
                        fsdp::init_device_mesh(dev.type(), {2, 2}, {"replicate", "shard"}));
  }
  l1::Report report("core fp16 reduction");
  for (const auto& [label, mesh] : meshes) {
    torch::nn::Linear lin(torch::nn::LinearOptions(4, 4).bias(false));
    lin->to(dev);
    fsdp::FullyShardOptions o;
    o.mesh = mesh;
    o.mp_policy.reduce_dtype = at::kHalf;
    fsdp::Sharded<torch::nn::Linear> unit = fsdp::fully_shard(lin, o);
    // d(sum(W x))/dW[i][j] = x[j].
    unit(at::full({1, 4}, scale * c(rank), at::TensorOptions().device(dev))).sum().backward();
    const at::Tensor g = host(lin->weight.grad()).to(at::kDouble);
    BOOST_TEST_REQUIRE(g.numel() > 0);
    BOOST_TEST(at::isfinite(g).all().item<bool>(), label << ": the fp16 mean overflowed");
    // Roundings to float16, each at most 2^-11 relative: the cast of the
    // local gradient, up to ws - 1 partial sums (Open MPI's order rounds
    // each), the post-divide; the pre-divide is exact.
    report.check(label + " fp16 mean grad, relative to the exact mean",
                 (g - want).abs().max().item<double>() / want, (ws + 1) / 2048.0);
  }
  report.publish();
}

BOOST_AUTO_TEST_CASE(test_reduce_gradients_after_unsynced_microbatches) {
  const int ws = spmd::world_size();
  const int64_t k = 3, rows_per_mb = 2;
  for (const ReduceMesh& rm : reduce_meshes()) {
    for (const bool fused : {true, false}) {
      BOOST_TEST_CONTEXT("mesh " << rm.label << ", comm_fusion " << fused) {
        fsdp::FullyShardOptions opts;
        opts.mesh = rm.mesh;
        opts.comm_fusion = fused;
        l1::ShardedMlp m(91, opts);
        toy::Mlp ref(91);
        ref->to(spmd::device());
        m.root.set_requires_gradient_sync(false);
        m.root.set_reshard_after_backward(false);
        m.root.set_is_last_backward(false);
        l1::Report report(std::string("core reduce_gradients ") + rm.label +
                          (fused ? " fused" : ""));
        for (int round = 0; round < 2; ++round) {
          const auto batch = toy::global_batch(300 + round, ws * k * rows_per_mb);
          const auto mine = toy::slice(batch, spmd::rank(), ws);
          for (int64_t j = 0; j < k; ++j) m.step(microbatch(mine, k, j));
          // Kept unsharded by reshard_after_backward(false) until reduced.
          std::string why;
          BOOST_TEST(l1::numel_state(m.module(), "", /*want_full=*/true, rm.parts, rm.index, &why),
                     "before reduce_gradients: " << why);

          fsdp::reset_collective_counters();
          m.root.reduce_gradients();
          const auto c = fsdp::collective_counters();
          // Units fc1, fc2, root (fc3): 3 groups of 2 parameters each.
          const int64_t rs = fused ? 3 : 6;
          BOOST_TEST(c.total("reduce_scatter") == rs);
          BOOST_TEST(c.total("reduce_scatter", rm.shard_group) == rs);
          BOOST_TEST(c.total("all_reduce") == (rm.replicate_group.empty() ? 0 : rs));
          if (!rm.replicate_group.empty()) {
            BOOST_TEST(c.total("all_reduce", rm.replicate_group) == rs);
          }
          BOOST_TEST(c.total("all_gather") == 0);
          BOOST_TEST(l1::numel_state(m.module(), "", /*want_full=*/false, rm.parts, rm.index, &why),
                     "after reduce_gradients: " << why);

          // Every replica's microbatch losses, summed, over the replica count
          // (FSDP's default "avg" over the data-parallel ranks).
          at::Tensor loss = at::zeros({}, at::TensorOptions().device(spmd::device()));
          for (int r = 0; r < ws; ++r) {
            const auto theirs = toy::slice(batch, r, ws);
            for (int64_t j = 0; j < k; ++j) {
              const auto b = microbatch(theirs, k, j);
              loss = loss + toy::mse(ref(b.x.to(spmd::device())), b.y.to(spmd::device()));
            }
          }
          (loss / static_cast<double>(ws)).backward();
          report.check("round " + std::to_string(round) + " sharded grads vs single card",
                       l1::grad_err(*m.model, *ref, rm.parts, rm.index), 1e-6);
        }
        report.publish();
      }
    }
  }
}

// With nothing accumulated, reduce_gradients leaves the gradients undefined
// and the parameters sharded, and the next synchronised step is a single
// card's.
BOOST_AUTO_TEST_CASE(test_reduce_gradients_with_nothing_accumulated) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  l1::ShardedMlp m(92, {});
  toy::Mlp ref(92);
  ref->to(spmd::device());
  m.root.reduce_gradients();
  BOOST_TEST(l1::all_grads_undefined(m.module()));
  std::string why;
  BOOST_TEST(l1::numel_state(m.module(), "", /*want_full=*/false, ws, rank, &why), why);
  // Also after a forward without backward (units back to Idle).
  (void)m.loss(toy::slice(toy::global_batch(93, 4 * ws), rank, ws));
  m.root.reduce_gradients();
  BOOST_TEST(l1::all_grads_undefined(m.module()));
  BOOST_TEST(l1::numel_state(m.module(), "", /*want_full=*/false, ws, rank, &why), why);

  const auto batch = toy::global_batch(94, 4 * ws);
  m.step(toy::slice(batch, rank, ws));
  l1::ref_backward(ref, batch);
  l1::Report report("core reduce_gradients nothing accumulated");
  report.check("next step grads vs single card", l1::grad_err(*m.model, *ref, ws, rank), 1e-6);
  report.publish();
}

namespace {

// Identity; in backward it calls reduce_gradients on `g_reduce_target`
// (when set) and records what happened.
fsdp::FSDPModule* g_reduce_target = nullptr;
std::string g_reduce_error;

struct ReduceInBackward : public torch::autograd::Function<ReduceInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) {
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    if (g_reduce_target == nullptr) return {grads[0]};
    try {
      g_reduce_target->reduce_gradients();
      g_reduce_error = "no exception";
    } catch (const fsdp::StateError& e) {
      g_reduce_error = std::string("StateError: ") + e.what();
    } catch (const std::exception& e) {
      g_reduce_error = std::string("other: ") + e.what();
    }
    return {grads[0]};
  }
};

// Units a and b with the probe between them: in backward it runs after b's
// gradients and before a's, while the root's backward is under way.
struct ReduceProbeImpl : torch::nn::Module {
  explicit ReduceProbeImpl(int64_t seed) {
    at::manual_seed(seed);
    a = register_module("a", torch::nn::Linear(15, 7));
    b = register_module("b", torch::nn::Linear(7, 5));
  }
  at::Tensor forward(at::Tensor x) { return b(ReduceInBackward::apply(at::tanh(a(x)))); }
  fsdp::Sharded<torch::nn::Linear> a{nullptr}, b{nullptr};
};
TORCH_MODULE(ReduceProbe);

}  // namespace

// reduce_gradients while a backward runs is a StateError naming the call
// (caught inside the backward here, which then completes normally: the
// step's gradients equal a single card's, so the rejected call did nothing).
BOOST_AUTO_TEST_CASE(test_reduce_gradients_during_backward_is_a_state_error) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  const auto dev = spmd::device();
  ReduceProbe ref(95);
  ReduceProbe model(95);
  ref->to(dev);
  model->to(dev);
  fsdp::fully_shard(model->a);
  fsdp::fully_shard(model->b);
  fsdp::FSDPModule root = fsdp::fully_shard(model.ptr());
  fsdp::Sharded<ReduceProbe> net(model);
  const auto batch = toy::global_batch(96, 4 * ws);
  const auto mine = toy::slice(batch, rank, ws);
  g_reduce_target = &root;
  g_reduce_error.clear();
  toy::mse(net(mine.x.to(dev)), mine.y.to(dev)).backward();
  g_reduce_target = nullptr;
  BOOST_TEST(g_reduce_error.rfind("StateError: ", 0) == 0, g_reduce_error);
  BOOST_TEST(g_reduce_error.find("reduce_gradients") != std::string::npos, g_reduce_error);
  toy::mse(ref(batch.x.to(dev)), batch.y.to(dev)).backward();
  l1::Report report("core reduce_gradients during backward");
  report.check("the step's grads vs single card", l1::grad_err(*model, *ref, ws, rank), 1e-6);
  report.publish();
}
