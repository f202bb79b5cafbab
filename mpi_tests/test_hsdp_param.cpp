// Parameter placement cases of the test plan's _test_hsdp_param.py, Level 1:
// shard_placement_fn (L1-07) and HSDP meshes, each against the single-card
// reference (an unsharded copy of the same model, same seed, whole global
// batch). Runs at np 2 and np 4 (CPU) and gpu2 / gpu4.
#include "precision_util.h"
#include "spmd.h"
#include "toy_models.h"

#include <fsdp/comm.h>
#include <fsdp/dtensor.h>
#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

namespace {

using prec::local_part;
using prec::report;
using testkit::max_abs_diff;

// a: Linear(8, 6), weight [6, 8]: dim 1 (8) divides 2 and 4 -> Shard(1).
// b: Linear(6, 4), weight [4, 6]: Replicate() through shard_placement_fn.
struct DimNetImpl : torch::nn::Module {
  explicit DimNetImpl(int64_t seed) {
    at::manual_seed(seed);
    a = register_module("a", torch::nn::Linear(8, 6));
    b = register_module("b", torch::nn::Linear(6, 4));
  }
  at::Tensor forward(at::Tensor x) { return b(at::tanh(a(x))); }
  fsdp::Sharded<torch::nn::Linear> a{nullptr};
  torch::nn::Linear b{nullptr};
};
TORCH_MODULE(DimNet);

std::string placements_str(const std::vector<fsdp::Placement>& ps) {
  std::string s = "[";
  for (size_t i = 0; i < ps.size(); ++i) s += (i ? ", " : "") + ps[i].to_string();
  return s + "]";
}

// fp32 parity of a 2-D-mesh (HSDP) toy model against the single card.
void hsdp_vs_single_card(const std::vector<int64_t>& shape, const std::string& id) {
  fsdp::FullyShardOptions opts;
  opts.mesh = fsdp::init_device_mesh(spmd::device().type(), shape, {"replicate", "shard"});
  opts.comm_fusion = false;  // the counts below are per parameter (unset fuses on CUDA)
  auto s = prec::shard_model(toy::Mlp(4), opts, opts);
  const int64_t rep = shape[0], shard = shape[1];
  int64_t n = 0;
  for (const auto& m : s.managed()) {
    ++n;
    const std::vector<fsdp::Placement> want = {fsdp::Placement::Replicate(),
                                               fsdp::Placement::Shard(0)};
    BOOST_TEST((m.dt.placements() == want),
               "[" << id << "] " << m.name << " placements " << placements_str(m.dt.placements()));
    const auto e = fsdp::shard_extent(m.dt.shape()[0], shard, opts.mesh->get_local_rank(1));
    BOOST_TEST(m.param.size(0) == e.length, "[" << id << "] " << m.name << " rows "
                                                << m.param.size(0) << ", expected " << e.length);
  }
  prec::ParityOptions po;
  po.id = id;
  const auto r = prec::fp32_parity(s, 4, po);
  for (size_t i = 0; i < r.steps.size(); ++i) {
    const auto& st = r.steps[i];
    // Per parameter: reduce-scatter over the shard dim (when it has >1
    // rank), then all-reduce over the replicate dim (when it has >1 rank).
    BOOST_TEST(st.bwd.total("reduce_scatter") == (shard > 1 ? n : 0),
               "[" << id << "] step " << i << " reduce_scatters " << st.bwd.total("reduce_scatter"));
    BOOST_TEST(st.bwd.total("all_reduce") == (rep > 1 ? n : 0),
               "[" << id << "] step " << i << " all_reduces " << st.bwd.total("all_reduce"));
  }
}

}  // namespace

// L1-07
BOOST_AUTO_TEST_CASE(test_custom_shard_placement_fn) {  // L1-07
  const int ws = spmd::world_size(), rank = spmd::rank();
  const std::string id = "L1-07";
  const double tol = 1e-5;
  const c10::Device dev = spmd::device();

  DimNet ref(17);
  ref->to(dev);
  DimNet model(17);
  model->to(dev);
  const at::Tensor a_full = model->a->weight.detach().clone();

  fsdp::FullyShardOptions a_opts;
  a_opts.shard_placement_fn = [](const std::string& name,
                                 const at::Tensor&) -> std::optional<fsdp::Placement> {
    if (name == "weight") return fsdp::Placement::Shard(1);
    return std::nullopt;  // bias: default Shard(0)
  };
  fsdp::FullyShardOptions root_opts;
  root_opts.shard_placement_fn = [](const std::string& name,
                                    const at::Tensor&) -> std::optional<fsdp::Placement> {
    if (name == "b.weight") return fsdp::Placement::Replicate();
    return std::nullopt;
  };
  fsdp::FSDPModule a_unit = fsdp::fully_shard(model->a, a_opts);
  fsdp::FSDPModule root = fsdp::fully_shard(
      std::static_pointer_cast<torch::nn::Module>(model.ptr()), root_opts);
  fsdp::Sharded<DimNet> net(model);
  const std::vector<prec::Unit> units = {{"a.", a_unit}, {"", root}};

  // Shapes: dim-1 shard and Replicate.
  BOOST_TEST(model->a->weight.size(0) == 6);
  BOOST_TEST(model->a->weight.size(1) == 8 / ws,
             "a.weight shape " << model->a->weight.sizes() << ", expected [6, " << 8 / ws << "]");
  BOOST_TEST(max_abs_diff(model->a->weight, a_full.narrow(1, rank * (8 / ws), 8 / ws)) == 0.0,
             "a.weight shard holds the wrong columns");
  BOOST_TEST((model->b->weight.sizes() == c10::IntArrayRef({4, 6})),
             "b.weight shape " << model->b->weight.sizes() << ", expected the full [4, 6]");
  BOOST_TEST(model->a->bias.size(0) == fsdp::shard_extent(6, ws, rank).length);

  // DTensor placements and global shapes.
  const std::map<std::string, fsdp::Placement> want = {
      {"a.weight", fsdp::Placement::Shard(1)},
      {"a.bias", fsdp::Placement::Shard(0)},
      {"b.weight", fsdp::Placement::Replicate()},
      {"b.bias", fsdp::Placement::Shard(0)}};
  const auto ms = prec::managed(units);
  BOOST_TEST(ms.size() == want.size());
  for (const auto& m : ms) {
    auto it = want.find(m.name);
    BOOST_TEST((it != want.end()), "unexpected managed parameter " << m.name);
    if (it == want.end()) continue;
    BOOST_TEST((m.dt.placements() == std::vector<fsdp::Placement>{it->second}),
               m.name << " placements " << placements_str(m.dt.placements()) << ", expected ["
                      << it->second.to_string() << "]");
    const at::Tensor full = prec::param_named(*ref, m.name);
    BOOST_TEST((m.dt.shape() == full.sizes().vec()), m.name << " DTensor global shape");
    BOOST_TEST((m.dt.to_local().sizes() == m.param.sizes()), m.name << " DTensor local shape");
  }
  // The gathered a.weight is the original full weight.
  for (const auto& m : ms) {
    if (m.name != "a.weight") continue;
    BOOST_TEST(max_abs_diff(prec::full_of(m.param.detach(), m.dt), a_full) == 0.0);
  }

  // Loss, gradients and two SGD steps against the single card.
  double loss_err = 0, grad_err = 0, param_err = 0;
  const double lr = 0.1;
  for (int step = 0; step < 2; ++step) {
    toy::Batch batch = toy::global_batch(60 + step, 8, /*in=*/8, /*out=*/4);
    batch.x = batch.x.to(dev);
    batch.y = batch.y.to(dev);
    const toy::Batch mine = toy::slice(batch, rank, ws);
    at::Tensor loss = toy::mse(net(mine.x), mine.y);
    loss.backward();
    at::Tensor ref_loss = toy::mse(ref(batch.x), batch.y);
    ref_loss.backward();
    const double le = std::abs(prec::mean_over_ranks(loss.item<double>()) - ref_loss.item<double>());
    BOOST_TEST(le < tol, "step " << step << " loss vs single card: " << le);
    loss_err = std::max(loss_err, le);
    for (const auto& m : ms) {
      const at::Tensor g = m.param.grad();
      BOOST_TEST(g.defined(), m.name << " has no gradient");
      if (!g.defined()) continue;
      BOOST_TEST((g.sizes() == m.param.sizes()), m.name << " grad shape " << g.sizes());
      const double e = max_abs_diff(g, local_part(prec::param_named(*ref, m.name).grad(), m.dt));
      BOOST_TEST(e < tol, "step " << step << " " << m.name << " grad vs single card: " << e);
      grad_err = std::max(grad_err, e);
    }
    {
      at::NoGradGuard no_grad;
      for (auto& p : model->parameters()) {
        if (p.grad().defined()) p.sub_(p.grad() * lr);
      }
      for (auto& p : ref->parameters()) p.sub_(p.grad() * lr);
    }
    root.zero_grad();
    for (auto& p : ref->parameters()) p.mutable_grad() = at::Tensor();
  }
  for (const auto& m : ms) {
    const double e = max_abs_diff(m.param, local_part(prec::param_named(*ref, m.name), m.dt));
    BOOST_TEST(e < tol, m.name << " after 2 SGD steps vs single card: " << e);
    param_err = std::max(param_err, e);
  }
  report(id, "loss vs single card", prec::max_over_ranks(loss_err), tol);
  report(id, "grad vs single card", prec::max_over_ranks(grad_err), tol);
  report(id, "params after SGD vs single card", prec::max_over_ranks(param_err), tol);
}

// [ours] Validation of shard_placement_fn: an uneven Shard(d != 0) and an
// out-of-range dim are ArgumentErrors naming "shard_placement_fn", and a
// rejected fully_shard leaves the module as it was (so that it can be
// sharded again with valid options).
BOOST_AUTO_TEST_CASE(test_shard_placement_fn_validation) {  // [ours]
  const int ws = spmd::world_size();
  DimNet model(18);
  model->to(spmd::device());
  std::map<std::string, at::Tensor> before;
  for (auto& [name, p] : prec::named_params(*model)) before[name] = p.detach().clone();

  // Shard(1) of a weight whose dim 1 (2 * ws + 1) never divides the world
  // size; the module's first layer comes before it and is valid.
  struct UnevenImpl : torch::nn::Module {
    explicit UnevenImpl(int64_t in) {
      first = register_module("first", torch::nn::Linear(4, 4));
      second = register_module("second", torch::nn::Linear(in, 4));
    }
    torch::nn::Linear first{nullptr}, second{nullptr};
  };
  auto uneven = std::make_shared<UnevenImpl>(2 * ws + 1);
  uneven->to(spmd::device());
  const at::Tensor first_w = uneven->first->weight.detach().clone();
  fsdp::FullyShardOptions bad;
  bad.shard_placement_fn = [](const std::string& name,
                              const at::Tensor&) -> std::optional<fsdp::Placement> {
    if (name == "second.weight") return fsdp::Placement::Shard(1);
    return std::nullopt;
  };
  bool threw = false;
  try {
    fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(uneven), bad);
  } catch (const fsdp::ArgumentError& e) {
    threw = true;
    BOOST_TEST(e.argument() == "shard_placement_fn");
    BOOST_TEST_MESSAGE("uneven Shard(1): " << e.what());
  }
  BOOST_TEST(threw, "Shard(1) of a dim " << 2 * ws + 1 << " over " << ws << " ranks was accepted");
  // Nothing was sharded by the rejected call.
  BOOST_TEST((uneven->first->weight.sizes() == first_w.sizes()),
             "a rejected fully_shard left first.weight sharded: " << uneven->first->weight.sizes());
  BOOST_TEST(!fsdp::fsdp_module_of(*uneven).has_value());

  fsdp::FullyShardOptions out_of_range;
  out_of_range.shard_placement_fn = [](const std::string&,
                                       const at::Tensor& p) -> std::optional<fsdp::Placement> {
    return fsdp::Placement::Shard(p.dim());
  };
  threw = false;
  try {
    fsdp::fully_shard(model->a, out_of_range);
  } catch (const fsdp::ArgumentError& e) {
    threw = true;
    BOOST_TEST(e.argument() == "shard_placement_fn");
  }
  BOOST_TEST(threw, "Shard(dim()) was accepted");
  for (auto& [name, p] : prec::named_params(*model)) {
    BOOST_TEST((p.sizes() == before.at(name).sizes()),
               "a rejected fully_shard changed " << name << " to " << p.sizes());
  }
}

// HSDP on a (2, 2) mesh: replicate=2, shard=2 (np 4 only).
BOOST_AUTO_TEST_CASE(test_hsdp_2x2_mesh_vs_single_card,  // existing: mesh=DeviceMesh (HSDP 2-D)
                     *spmd::needs_world_size(4, "a (2, 2) mesh")) {
  hsdp_vs_single_card({2, 2}, "HSDP (2,2)");
}

// A 2-D mesh with a trivial replicate dim: (1, ws) -- (1, 2) at np 2.
BOOST_AUTO_TEST_CASE(test_hsdp_1xN_mesh_vs_single_card) {  // existing: mesh=DeviceMesh (HSDP 2-D, trivial replicate dim)
  const int64_t ws = spmd::world_size();
  hsdp_vs_single_card({1, ws}, "HSDP (1," + std::to_string(ws) + ")");
}
