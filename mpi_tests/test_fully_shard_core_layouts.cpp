// The FSDP core on per-parameter layouts [ours]: layouts on meshes of 1, 2
// and 3 dims (DTensor parameters sharded by TP included) round-trip bitwise,
// the grad norm over FSDP and TP dims, typed layout errors, and gradients
// partial over tp all-reduced there before FSDP reduces them. Part of the
// test_fully_shard_core executable (np 2, 4; gpu2, gpu4; label core).
#include "fully_shard_core_util.h"
#include "tensor_diff.h"

namespace {

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
BOOST_AUTO_TEST_CASE(test_layout_round_trip) {  // [ours]
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
BOOST_AUTO_TEST_CASE(test_grad_norm_over_fsdp_and_tp_dims) {  // [ours]
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
BOOST_AUTO_TEST_CASE(test_layout_errors_are_typed) {  // [ours]
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

// A parameter replicated over tp whose gradient is a partial sum there (a
// sequence-parallel norm weight: each tp rank sees part of the sequence) is
// all-reduced over tp, in reduce_dtype, before FSDP's reduce-scatter; a
// tp-replicated parameter with identical gradients and a TP-sharded one get
// no tp communication. Gradients equal a single-process autograd run of the
// global objective (mean over dp rows of replicated + every tp part).
BOOST_AUTO_TEST_CASE(test_partial_tp_gradients_reduced_over_tp,  // [ours]
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
        report.check(name + " grad vs single process",
                     testkit::max_abs_diff(host(g), want.at(name)), tol);
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
