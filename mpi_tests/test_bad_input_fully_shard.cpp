// L0 [ours]: every bad input to the public API gets a typed error (issue 14):
// fully_shard options, FSDPModule methods and clip_grad (the other areas are
// in test_bad_input_parallel.cpp), the inf-norm's NaN propagation, and the
// completeness check of every area's table. Part of the test_bad_input executable (np 2, gpu2).
//
// The checker and the count of cases by outcome: common/bad_input_util.h.
#include "bad_input_util.h"

namespace bad_input {

// ---------------------------------------------------------------------------
// fully_shard and FullyShardOptions

std::vector<Case> fully_shard_option_cases() {
  using O = fsdp::FullyShardOptions;
  using L = torch::nn::Linear;
  const Outcome T = Outcome::Typed, F = Outcome::Fixed;
  return {
      // A plain tensor in ignored_params was silently dropped: the user
      // believes something is ignored that FSDP never saw.
      expect<ArgumentError>(F, "ignored_params holds a plain tensor, not a parameter",
                            "ignored_params", shard_linear([](O& o, L&) {
                              o.ignored_params = {at::zeros({3}, opts())};
                            })),
      // weight.detach() shares storage but is another tensor: the weight
      // itself was sharded although the user asked to ignore it.
      expect<ArgumentError>(F, "ignored_params holds weight.detach(), not the weight",
                            "ignored_params",
                            shard_linear([](O& o, L& l) { o.ignored_params = {l->weight.detach()}; })),
      expect<ArgumentError>(F, "ignored_params holds an undefined tensor", "ignored_params",
                            shard_linear([](O& o, L&) { o.ignored_params = {at::Tensor()}; })),
      // A parameter another unit already shards cannot be ignored here.
      expect<ArgumentError>(F, "ignored_params holds a parameter sharded by a nested unit",
                            "ignored_params",
                            [] {
                              torch::nn::Sequential seq(torch::nn::Linear(8, 4),
                                                        torch::nn::Linear(4, 2));
                              seq->to(spmd::device());
                              auto o = base_options();
                              fsdp::fully_shard(seq->ptr(0), o);
                              o.ignored_params = {seq->ptr(0)->named_parameters()["weight"]};
                              fsdp::fully_shard(seq.ptr(), o);
                            }),
      expect<ArgumentError>(F, "replicate_params holds a plain tensor", "replicate_params",
                            shard_linear([](O& o, L&) {
                              o.replicate_params = {at::ones({4}, opts())};
                            })),
      // bias.clone() is an autograd result (non-leaf): never a parameter.
      expect<ArgumentError>(F, "replicate_params holds bias.clone()", "replicate_params",
                            shard_linear([](O& o, L& l) { o.replicate_params = {l->bias.clone()}; })),
      expect<ArgumentError>(F, "replicate_params holds a slice of the weight", "replicate_params",
                            shard_linear([](O& o, L& l) {
                              o.replicate_params = {l->weight.slice(0, 0, 2)};
                            })),
      expect<ArgumentError>(F, "replicate_params holds a parameter sharded by a nested unit",
                            "replicate_params",
                            [] {
                              torch::nn::Sequential seq(torch::nn::Linear(8, 4),
                                                        torch::nn::Linear(4, 2));
                              seq->to(spmd::device());
                              auto o = base_options();
                              fsdp::fully_shard(seq->ptr(1), o);
                              o.replicate_params = {seq->ptr(1)->named_parameters()["weight"]};
                              fsdp::fully_shard(seq.ptr(), o);
                            }),
      expect<ArgumentError>(T, "mp_policy.param_dtype int64", "mp_policy",
                            shard_linear([](O& o, L&) { o.mp_policy.param_dtype = at::kLong; })),
      expect<ArgumentError>(T, "mp_policy.reduce_dtype int32", "mp_policy",
                            shard_linear([](O& o, L&) { o.mp_policy.reduce_dtype = at::kInt; })),
      expect<ArgumentError>(T, "mp_policy.output_dtype bool", "mp_policy",
                            shard_linear([](O& o, L&) { o.mp_policy.output_dtype = at::kBool; })),
      expect<MeshError>(T, "shard_dim not a dim of the mesh", "shard_dim",
                        shard_linear([](O& o, L&) { o.shard_dim = "tp"; })),
      expect<MeshError>(T, "replicate_dim not a dim of the mesh", "replicate_dim",
                        shard_linear([](O& o, L&) { o.replicate_dim = "dp"; })),
      expect<MeshError>(T, "shard_dim and replicate_dim name the same dim", "replicate_dim",
                        shard_linear([](O& o, L&) {
                          o.mesh = fsdp::init_device_mesh(dev_type(), {1, world()}, {"r", "s"});
                          o.shard_dim = "s";
                          o.replicate_dim = "s";
                        })),
      expect<MeshError>(T, "3-D mesh without shard_dim", "mesh", shard_linear([](O& o, L&) {
                          o.mesh = fsdp::init_device_mesh(dev_type(), {1, 1, world()},
                                                          {"x", "y", "z"});
                        })),
      expect<ArgumentError>(T, "shard_placement_fn returns Shard(2) for a 2-D weight",
                            "shard_placement_fn", shard_linear([](O& o, L&) {
                              o.shard_placement_fn = placement_fn(Placement::Shard(2));
                            })),
      expect<ArgumentError>(T, "shard_placement_fn returns Shard(-3) for a 2-D weight",
                            "shard_placement_fn", shard_linear([](O& o, L&) {
                              o.shard_placement_fn = placement_fn(Placement::Shard(-3));
                            })),
      expect<ArgumentError>(T, "shard_placement_fn returns Partial()", "shard_placement_fn",
                            shard_linear([](O& o, L&) {
                              o.shard_placement_fn = placement_fn(Placement::Partial());
                            })),
      expect<ArgumentError>(T, "shard_placement_fn returns StridedShard(0, 2)",
                            "shard_placement_fn", shard_linear([](O& o, L&) {
                              o.shard_placement_fn = placement_fn(Placement::StridedShard(0, 2));
                            })),
      // Linear(7, 4): the weight's dim 1 (7) does not divide over 2 ranks.
      expect<ShapeError>(T, "shard_placement_fn returns Shard(1) on an odd dim 1",
                         "shard_placement_fn", [] {
                           auto lin = linear(7, 4);
                           auto o = base_options();
                           o.shard_placement_fn = [](const std::string& n, const at::Tensor&)
                               -> std::optional<fsdp::ShardPlacementResult> {
                             if (n == "weight") return fsdp::ShardPlacementResult(Placement::Shard(1));
                             return std::nullopt;
                           };
                           fsdp::fully_shard(as_module(lin), o);
                         }),
      expect<ArgumentError>(T, "shard_placement_fn returns gradient_divide_factor 0",
                            "shard_placement_fn", shard_linear([](O& o, L&) {
                              o.shard_placement_fn = placement_fn(
                                  fsdp::ShardPlacementResult(Placement::Shard(0), world_mesh(), 0.0));
                            })),
      expect<ArgumentError>(T, "shard_placement_fn returns gradient_divide_factor NaN",
                            "shard_placement_fn", shard_linear([](O& o, L&) {
                              o.shard_placement_fn = placement_fn(
                                  fsdp::ShardPlacementResult(Placement::Shard(0), world_mesh(), kNaN));
                            })),
      expect<ArgumentError>(T, "dtensor_params holds an undefined DTensor", "dtensor_params",
                            shard_linear([](O& o, L&) { o.dtensor_params = {DTensor()}; })),
      expect<ArgumentError>(T, "dtensor_params over a tensor that is not a parameter",
                            "dtensor_params", shard_linear([](O& o, L&) {
                              const auto tp = fsdp::init_device_mesh(dev_type(), {world(), 1},
                                                                     {"shard", "tp"})["tp"];
                              o.dtensor_params = {DTensor::from_local(
                                  at::zeros({4}, opts()), tp, {Placement::Replicate()},
                                  std::vector<int64_t>{4})};
                            })),
      expect<ArgumentError>(T, "module is null", "module",
                            [] { fsdp::fully_shard(std::shared_ptr<torch::nn::Module>(), base_options()); }),
      expect<ArgumentError>(T, "module list is empty", "module", [] {
        fsdp::fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{}, base_options());
      }),
      expect<ArgumentError>(T, "module list holds one module twice", "module", [] {
        auto lin = linear();
        fsdp::fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{as_module(lin),
                                                                           as_module(lin)},
                          base_options());
      }),
  };
}

// ---------------------------------------------------------------------------
// FSDPModule methods

// A unit lives as long as its module: both are kept.
struct ShardedLinear {
  torch::nn::Linear lin;
  fsdp::FSDPModule unit;
};

ShardedLinear sharded_linear() {
  auto lin = linear();
  auto unit = fsdp::fully_shard(as_module(lin), base_options());
  return {lin, unit};
}

std::vector<Case> fsdp_module_cases() {
  const Outcome T = Outcome::Typed, F = Outcome::Fixed;
  using NamedDT = std::vector<std::pair<std::string, DTensor>>;
  using NamedT = std::vector<std::pair<std::string, at::Tensor>>;
  return {
      expect<ArgumentError>(T, "fully_shard of a module already sharded", "module", [] {
        auto lin = linear();
        fsdp::fully_shard(as_module(lin), base_options());
        fsdp::fully_shard(as_module(lin), base_options());
      }),
      expect<ArgumentError>(T, "set_reduce_op_type(\"average\")", "reduce_op",
                            [] { sharded_linear().unit.set_reduce_op_type("average"); }),
      expect<ArgumentError>(T, "set_gradient_divide_factor(0)", "factor",
                            [] { sharded_linear().unit.set_gradient_divide_factor(0.0); }),
      expect<ArgumentError>(T, "set_gradient_divide_factor(-inf)", "factor",
                            [] { sharded_linear().unit.set_gradient_divide_factor(-kInf); }),
      expect<ArgumentError>(T, "load_state_dict(DTensor) with an unknown name", "state", [] {
        auto s = sharded_linear();
        NamedDT sd = s.unit.state_dict();
        sd.front().first = "no_such.weight";
        s.unit.load_state_dict(sd);
      }),
      expect<ShapeError>(T, "load_state_dict(DTensor) of another global shape", "state", [] {
        auto s = sharded_linear();
        const auto mesh = world_mesh();
        s.unit.load_state_dict(NamedDT{
            {"weight", fsdp::distribute_tensor(at::zeros({6, 8}, opts()), mesh,
                                               {Placement::Shard(0)})}});
      }),
      // The entry's placements equal the unit's, so its local tensor (the
      // whole weight on a one-rank mesh) was copied into the shard.
      expect<MeshError>(F, "load_state_dict(DTensor) on another mesh", "state", [] {
        auto s = sharded_linear();
        const auto own = fsdp::init_device_mesh(dev_type(), {world(), 1}, {"a", "b"})["b"];
        s.unit.load_state_dict(NamedDT{
            {"bias", DTensor::from_local(at::zeros({4}, opts()), own, {Placement::Shard(0)},
                                         std::vector<int64_t>{4})}});
      }),
      expect<ShapeError>(T, "load_state_dict(tensor) neither local nor global shape", "state",
                         [] {
                           auto s = sharded_linear();
                           s.unit.load_state_dict(NamedT{{"weight", at::zeros({3, 8}, opts())}});
                         }),
  };
}

// ---------------------------------------------------------------------------
// clip_grad

// A sharded Linear with gradients, every one equal to `value`.
ShardedLinear unit_with_grads(double value) {
  auto s = sharded_linear();
  for (auto& p : s.lin->parameters()) p.mutable_grad() = at::full_like(p, value);
  return s;
}

// clip_grad_norm_ over the unit of a sharded Linear whose gradients are all `value`.
double clip_unit(double value, double max_norm, double norm_type = 2.0,
                 bool error_if_nonfinite = false) {
  auto s = unit_with_grads(value);
  return fsdp::clip_grad_norm_({s.unit}, {}, max_norm, norm_type, error_if_nonfinite);
}

std::vector<Case> clip_grad_cases() {
  const Outcome T = Outcome::Typed, F = Outcome::Fixed;
  return {
      expect<ArgumentError>(T, "clip_grad_norm_ max_norm 0", "max_norm",
                            [] { clip_unit(1, 0.0); }),
      expect<ArgumentError>(T, "clip_grad_norm_ max_norm NaN", "max_norm",
                            [] { clip_unit(1, kNaN); }),
      expect<ArgumentError>(T, "clip_grad_norm_ norm_type -inf", "norm_type",
                            [] { clip_unit(1, 1.0, -kInf); }),
      expect<ArgumentError>(T, "total_grad_norm norm_type 0", "norm_type",
                            [] {
                              auto s = unit_with_grads(1);
                              fsdp::total_grad_norm({s.unit}, {}, 0.0);
                            }),
      expect<ArgumentError>(T, "clip_grad_norm_ of an undefined parameter", "parameters",
                            [] { fsdp::clip_grad_norm_(std::vector<at::Tensor>{at::Tensor()}, 1.0); }),
      expect<ArgumentError>(T, "total_grad_norm of a default FSDPModule", "modules",
                            [] { fsdp::total_grad_norm({fsdp::FSDPModule()}, {}); }),
      // Typed, but what() did not quote 'parameters'.
      expect<ArgumentError>(F, "error_if_nonfinite with infinite gradients", "parameters", [] {
        clip_unit(kInf, 1.0, 2.0, true);
      }),
      // The inf-norm took max(0, NaN) = 0: NaN gradients passed as finite.
      expect<ArgumentError>(F, "error_if_nonfinite, inf-norm, NaN gradients", "parameters", [] {
        clip_unit(kNaN, 1.0, kInf, true);
      }),
  };
}

std::map<std::string, std::vector<Case> (*)()> all_tables() {
  return {{"fully_shard options", fully_shard_option_cases},
          {"FSDPModule methods", fsdp_module_cases},
          {"DeviceMesh", mesh_cases},
          {"DTensor / placements", dtensor_cases},
          {"clip_grad", clip_grad_cases},
          {"tensor parallel", tp_cases},
          {"pipeline", pipeline_cases},
          {"moe", moe_cases},
          {"activation checkpointing", checkpoint_cases}};
}

}  // namespace bad_input

using namespace bad_input;

BOOST_AUTO_TEST_CASE(test_fully_shard_options_bad_input) { run_cases(fully_shard_option_cases()); }  // [ours]
BOOST_AUTO_TEST_CASE(test_fsdp_module_bad_input) { run_cases(fsdp_module_cases()); }  // [ours]
BOOST_AUTO_TEST_CASE(test_clip_grad_bad_input) { run_cases(clip_grad_cases()); }  // [ours]

// The inf-norm of gradients holding NaN is NaN, as torch's, on every rank
// (std::max(x, NaN) and MPI's MAX dropped it: this case got 1, the max of
// the other entries): here only rank 0 holds the NaN, in its shard.
BOOST_AUTO_TEST_CASE(test_inf_norm_propagates_nan) {  // [ours]
  auto lin = linear();
  auto unit = fsdp::fully_shard(as_module(lin), base_options());
  for (auto& p : lin->parameters()) p.mutable_grad() = at::ones_like(p);
  if (spmd::rank() == 0) lin->weight.mutable_grad().view(-1)[0] = kNaN;
  const double total = fsdp::total_grad_norm({unit}, {}, kInf);
  BOOST_TEST(std::isnan(total), "total_grad_norm(inf) = " << total);
  const double clipped = fsdp::clip_grad_norm_({unit}, {}, 0.5, kInf);
  BOOST_TEST(std::isnan(clipped), "clip_grad_norm_(inf) = " << clipped);
  // Without NaN the inf-norm is still the largest |g| over every rank.
  for (auto& p : lin->parameters()) p.mutable_grad() = at::full_like(p, spmd::rank() + 1.0);
  BOOST_TEST(fsdp::total_grad_norm({unit}, {}, kInf) == static_cast<double>(world()));
}

// The header's table is the tables' truth: at least 60 distinct inputs, no
// name twice, and the per-outcome counts the comment states.
BOOST_AUTO_TEST_CASE(test_case_table_is_complete) {  // [ours]
  std::set<std::string> names;
  int typed = 0, fixed = 0;
  for (const auto& [area, table] : all_tables()) {
    int t = 0, f = 0;
    for (const Case& c : table()) {
      BOOST_TEST(names.insert(c.name).second, "case named twice: " << c.name);
      (c.outcome == Outcome::Typed ? t : f) += 1;
    }
    BOOST_TEST_MESSAGE(area << ": " << t << " typed already, " << f << " fixed now");
    typed += t;
    fixed += f;
  }
  BOOST_TEST(typed + fixed >= 60);
  BOOST_TEST(typed == 86);
  BOOST_TEST(fixed == 17);
}
