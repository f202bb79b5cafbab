// L0: every bad input to the public API gets a typed error (issue 14).
//
// One table of cases per area, one checker: each case passes one bad input
// and the checker asserts the exception's exact type, its argument() and
// that what() names the argument in quotes ('ignored_params'), as
// test_comm_errors.cpp does for the collectives (whose cases are not
// repeated here). Every rank passes the same bad input, so every rank
// throws alike. The fsdp-train flag cases are CTest entries
// (fsdp_train_flag_*_error in tools/fsdp-train/CMakeLists.txt).
//
// Cases by outcome (test_case_table_is_complete checks the totals):
//
//   area                     typed already   fixed now   total
//   fully_shard options                 19           8      27
//   FSDPModule methods                   7           1       8
//   DeviceMesh                          14           2      16
//   DTensor / placements                12           0      12
//   clip_grad                            6           2       8
//   tensor parallel                      8           0       8
//   pipeline                             9           1      10
//   moe                                  6           3       9
//   activation checkpointing             5           0       5
//   ---------------------------------------------------------
//   all                                 86          17     103
//
// plus test_inf_norm_propagates_nan (fixed now: the inf-norm dropped NaN
// gradients and returned the max of the rest, 0 when all were NaN), not a
// throwing case. "fixed now" cases failed before the library fix of their
// change; the two CUDA-less init_device_mesh cases are skipped where CUDA
// is present.
#include "spmd.h"

#include <fsdp/activation_checkpoint.h>
#include <fsdp/clip_grad.h>
#include <fsdp/dtensor.h>
#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>
#include <fsdp/moe.h>
#include <fsdp/pipeline.h>
#include <fsdp/tensor_parallel.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <boost/core/demangle.hpp>

#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <typeindex>
#include <typeinfo>
#include <vector>

namespace {

using fsdp::ArgumentError;
using fsdp::DTensor;
using fsdp::MeshError;
using fsdp::Placement;
using fsdp::ShapeError;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// "typed": the library already threw the right error; "fixed": it did not
// (silent, wrong values, or an untyped error) until this change.
enum class Outcome { Typed, Fixed };

struct Case {
  std::string name;  // the bad input, in words
  Outcome outcome;
  std::type_index type;
  std::string type_name;
  std::string argument;
  std::function<void()> call;
  bool needs_no_cuda = false;  // only meaningful on a machine without CUDA
};

template <typename E>
Case expect(Outcome outcome, std::string name, std::string argument, std::function<void()> call) {
  return Case{std::move(name), outcome, std::type_index(typeid(E)),
              boost::core::demangle(typeid(E).name()), std::move(argument), std::move(call)};
}

// what() quotes the argument: 'arg', or a path that starts with it
// ('mp_policy.param_dtype', 'dtensor_params[0]').
bool names_in_quotes(const std::string& what, const std::string& argument) {
  for (const char* end : {"'", ".", "["}) {
    if (what.find("'" + argument + end) != std::string::npos) return true;
  }
  return false;
}

// The checker: exact type, argument(), and the argument quoted in what().
void run_cases(const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    if (c.needs_no_cuda && at::hasCUDA()) {
      BOOST_TEST_MESSAGE("skipped (CUDA present): " << c.name);
      continue;
    }
    BOOST_TEST_CONTEXT(c.name << " (expecting " << c.type_name << " for '" << c.argument
                              << "')") {
      try {
        c.call();
        BOOST_ERROR("no exception");
      } catch (const ArgumentError& e) {
        BOOST_CHECK_MESSAGE(std::type_index(typeid(e)) == c.type,
                            "threw " << boost::core::demangle(typeid(e).name()) << ": "
                                     << e.what());
        BOOST_CHECK_MESSAGE(e.argument() == c.argument, "argument() is '" << e.argument() << "'");
        BOOST_CHECK_MESSAGE(names_in_quotes(e.what(), c.argument),
                            "what() does not name '" << c.argument << "': " << e.what());
      } catch (const std::exception& e) {
        BOOST_ERROR("threw " << boost::core::demangle(typeid(e).name()) << ": " << e.what());
      }
    }
  }
}

at::TensorOptions opts(at::ScalarType dt = at::kFloat) {
  return at::TensorOptions(dt).device(spmd::device());
}

c10::DeviceType dev_type() { return spmd::device().type(); }
int64_t world() { return spmd::world_size(); }

fsdp::DeviceMesh world_mesh() { return fsdp::init_device_mesh(dev_type(), {world()}, {"shard"}); }

// Options on the suite's device (the default mesh follows the Runtime's).
fsdp::FullyShardOptions base_options() {
  fsdp::FullyShardOptions o;
  o.mesh = world_mesh();
  return o;
}

torch::nn::Linear linear(int64_t in = 8, int64_t out = 4) {
  torch::nn::Linear lin(in, out);
  lin->to(spmd::device());
  return lin;
}

std::shared_ptr<torch::nn::Module> as_module(const torch::nn::Linear& lin) {
  return std::static_pointer_cast<torch::nn::Module>(lin.ptr());
}

// fully_shard(Linear(8, 4)) after `edit` changed the options.
std::function<void()> shard_linear(std::function<void(fsdp::FullyShardOptions&,
                                                      torch::nn::Linear&)> edit) {
  return [edit] {
    auto lin = linear();
    auto o = base_options();
    edit(o, lin);
    fsdp::fully_shard(as_module(lin), o);
  };
}

fsdp::ShardPlacementFn placement_fn(std::optional<fsdp::ShardPlacementResult> result) {
  return [result](const std::string&, const at::Tensor&) { return result; };
}

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
// DeviceMesh (shape, dim names, device strings and slicing by name are in
// test_comm_errors.cpp)

std::vector<Case> mesh_cases() {
  const Outcome T = Outcome::Typed, F = Outcome::Fixed;
  auto two_d = [] { return fsdp::init_device_mesh(dev_type(), {world(), 1}, {"dp", "tp"}); };
  std::vector<Case> cases = {
      expect<MeshError>(F, "init_device_mesh(kCUDA) without CUDA", "device_type",
                        [] { fsdp::init_device_mesh(c10::kCUDA, {world()}); }),
      expect<MeshError>(F, "init_device_mesh(\"cuda\") without CUDA", "device_type",
                        [] { fsdp::init_device_mesh("cuda", {world()}); }),
      expect<MeshError>(T, "unflatten(dim 2) of a 2-D mesh", "dim",
                        [two_d] { two_d().unflatten(2, {1}, {"x"}); }),
      expect<MeshError>(T, "unflatten(\"pp\") unknown dim", "dim",
                        [two_d] { two_d().unflatten("pp", {1}, {"x"}); }),
      expect<MeshError>(T, "unflatten with no sizes", "sizes",
                        [two_d] { two_d().unflatten(0, {}, {}); }),
      expect<MeshError>(T, "unflatten with a size 0", "sizes",
                        [two_d] { two_d().unflatten(0, {0, world()}, {"x", "y"}); }),
      expect<MeshError>(T, "unflatten sizes whose product is not the dim's", "sizes",
                        [two_d] { two_d().unflatten(0, {world(), 2}, {"x", "y"}); }),
      expect<MeshError>(T, "unflatten with fewer names than sizes", "names",
                        [two_d] { two_d().unflatten(0, {1, world()}, {"x"}); }),
      expect<MeshError>(T, "unflatten with an empty name", "names",
                        [two_d] { two_d().unflatten(0, {1, world()}, {"x", ""}); }),
      expect<MeshError>(T, "unflatten with a name another dim has", "names",
                        [two_d] { two_d().unflatten(0, {1, world()}, {"x", "tp"}); }),
      expect<MeshError>(T, "concatenate({})", "meshes", [] { fsdp::DeviceMesh::concatenate({}); }),
      expect<MeshError>(T, "concatenate slices of two roots", "meshes", [two_d] {
        const auto a = two_d();
        const auto b = fsdp::init_device_mesh(dev_type(), {world(), 1}, {"x", "y"});
        fsdp::DeviceMesh::concatenate({a["dp"], b["y"]});
      }),
      expect<MeshError>(T, "concatenate a dim twice", "meshes", [two_d] {
        const auto a = two_d();
        fsdp::DeviceMesh::concatenate({a["dp"], a["dp"]});
      }),
      expect<MeshError>(T, "dim_index(\"pp\")", "dim_name", [two_d] { two_d().dim_index("pp"); }),
      expect<MeshError>(T, "get_group(2) of a 2-D mesh", "dim", [two_d] { two_d().get_group(2); }),
      expect<MeshError>(T, "size(-1)", "dim", [two_d] { two_d().size(-1); }),
  };
  cases[0].needs_no_cuda = cases[1].needs_no_cuda = true;
  return cases;
}

// ---------------------------------------------------------------------------
// DTensor and placements

std::vector<Case> dtensor_cases() {
  const Outcome T = Outcome::Typed;
  auto local = [] { return at::zeros({2, 4}, opts()); };
  return {
      expect<ArgumentError>(T, "Placement::Partial(MAX)", "op",
                            [] { Placement::Partial(fsdp::ReduceOp::MAX); }),
      expect<ArgumentError>(T, "Placement::StridedShard(0, 0)", "split_factor",
                            [] { Placement::StridedShard(0, 0); }),
      expect<ArgumentError>(T, "from_local with two placements on a 1-D mesh", "placements",
                            [local] {
                              DTensor::from_local(local(), world_mesh(),
                                                  {Placement::Shard(0), Placement::Replicate()},
                                                  std::vector<int64_t>{2 * world(), 4});
                            }),
      expect<ArgumentError>(T, "from_local Shard(2) of a 2-D tensor", "placements", [local] {
        DTensor::from_local(local(), world_mesh(), {Placement::Shard(2)},
                            std::vector<int64_t>{2, 4 * world()});
      }),
      // Nothing inside: 3 counts fused pieces, and 2w rows do not cut into 3.
      expect<ShapeError>(T, "from_local StridedShard(0, 3) of 2w rows", "placements", [local] {
                              DTensor::from_local(local(), world_mesh(),
                                                  {Placement::StridedShard(0, 3)},
                                                  std::vector<int64_t>{2 * world(), 4});
                            }),
      expect<ArgumentError>(T, "from_local of an undefined tensor", "local", [] {
        DTensor::from_local(at::Tensor(), world_mesh(), {Placement::Replicate()});
      }),
      expect<ShapeError>(T, "from_local with a 1-D shape for a 2-D local", "shape", [local] {
        DTensor::from_local(local(), world_mesh(), {Placement::Shard(0)},
                            std::vector<int64_t>{2 * world()});
      }),
      expect<ShapeError>(T, "from_local whose local rows do not fit the given shape", "local",
                         [local] {
                           DTensor::from_local(local(), world_mesh(), {Placement::Shard(0)},
                                               std::vector<int64_t>{7 * world(), 4});
                         }),
      expect<ArgumentError>(T, "redistribute to two placements on a 1-D mesh", "placements",
                            [local] {
                              DTensor::from_local(local(), world_mesh(), {Placement::Shard(0)},
                                                  std::vector<int64_t>{2 * world(), 4})
                                  .redistribute({Placement::Replicate(), Placement::Replicate()});
                            }),
      expect<ArgumentError>(T, "distribute_tensor of an undefined tensor", "full", [] {
        fsdp::distribute_tensor(at::Tensor(), world_mesh(), {Placement::Replicate()});
      }),
      expect<ArgumentError>(T, "distribute_tensor with no placements", "placements", [local] {
        fsdp::distribute_tensor(local(), world_mesh(), {});
      }),
      expect<ArgumentError>(T, "redistribute_local with two grad placements", "grad_placements",
                            [local] {
                              fsdp::redistribute_local(
                                  local(), world_mesh(), {Placement::Replicate()},
                                  {Placement::Replicate()}, {2, 4},
                                  std::vector<Placement>{Placement::Replicate(),
                                                         Placement::Replicate()});
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

// ---------------------------------------------------------------------------
// tensor parallel

fsdp::DeviceMesh tp_mesh() { return world_mesh(); }

std::vector<Case> tp_cases() {
  const Outcome T = Outcome::Typed;
  namespace tp = fsdp::tp;
  return {
      expect<ShapeError>(T, "ColumnParallelLinear out_features 2w+1", "out_features",
                         [] { tp::ColumnParallelLinear(8, 2 * world() + 1, tp_mesh()); }),
      expect<ShapeError>(T, "ColumnParallelLinear fused_pieces 3 over out_features 4w",
                         "out_features", [] {
                           tp::ColumnParallelOptions o;
                           o.fused_pieces = 3;
                           tp::ColumnParallelLinear(8, 4 * world(), tp_mesh(), o);
                         }),
      expect<ShapeError>(T, "RowParallelLinear in_features 2w+1", "in_features",
                         [] { tp::RowParallelLinear(2 * world() + 1, 8, tp_mesh()); }),
      expect<ShapeError>(T, "VocabParallelEmbedding num_embeddings 2w+1", "num_embeddings",
                         [] { tp::VocabParallelEmbedding(2 * world() + 1, 4, tp_mesh()); }),
      expect<MeshError>(T, "ColumnParallelLinear on a 2-D mesh", "tp", [] {
        tp::ColumnParallelLinear(8, 8, fsdp::init_device_mesh(dev_type(), {world(), 1}));
      }),
      expect<ShapeError>(T, "local_size(\"heads\", 2w+1)", "heads",
                         [] { tp::local_size("heads", 2 * world() + 1, tp_mesh()); }),
      expect<ShapeError>(T, "ColumnParallelLinear::load_full with a transposed weight", "weight",
                         [] {
                           tp::ColumnParallelLinear l(8, 2 * world(), tp_mesh());
                           l->to(spmd::device());
                           l->load_full(at::zeros({8, 2 * world()}, opts()),
                                        at::zeros({2 * world()}, opts()));
                         }),
      expect<ArgumentError>(T, "VocabParallelEmbedding ids >= num_embeddings", "ids", [] {
        tp::VocabParallelEmbedding e(2 * world(), 4, tp_mesh());
        e->to(spmd::device());
        e(at::full({3}, 2 * world(), opts(at::kLong)));
      }),
  };
}

// ---------------------------------------------------------------------------
// pipeline

std::vector<Case> pipeline_cases() {
  const Outcome T = Outcome::Typed, F = Outcome::Fixed;
  namespace pp = fsdp::pp;
  auto stage = [](std::shared_ptr<torch::nn::Module> m, int index, int n, fsdp::DeviceMesh mesh) {
    pp::PipelineStage(std::move(m), [](const at::Tensor& x) { return x; }, index, n,
                      std::move(mesh));
  };
  auto module = [] { return std::make_shared<torch::nn::Module>(); };
  return {
      expect<ArgumentError>(T, "build_schedule with pp_size 0", "pp_size",
                            [] { pp::build_schedule(pp::ScheduleKind::OneFOneB, 0, 1, 4); }),
      expect<ArgumentError>(T, "build_schedule GPipe with 2 stages per rank", "stages_per_rank",
                            [] { pp::build_schedule(pp::ScheduleKind::GPipe, 2, 2, 4); }),
      expect<ArgumentError>(T, "build_schedule 1F1B with fewer microbatches than ranks",
                            "n_microbatches",
                            [] { pp::build_schedule(pp::ScheduleKind::OneFOneB, 2, 1, 1); }),
      expect<ArgumentError>(T, "build_schedule interleaved with 3 microbatches on 2 ranks",
                            "n_microbatches", [] {
                              pp::build_schedule(pp::ScheduleKind::Interleaved1F1B, 2, 2, 3);
                            }),
      expect<ArgumentError>(T, "PipelineStage with a null module", "module",
                            [stage] { stage(nullptr, 0, static_cast<int>(world()), world_mesh()); }),
      expect<ArgumentError>(T, "PipelineStage with stage_index = num_stages", "stage_index",
                            [stage, module] {
                              stage(module(), static_cast<int>(world()),
                                    static_cast<int>(world()), world_mesh());
                            }),
      expect<ArgumentError>(T, "PipelineStage with num_stages 0", "num_stages",
                            [stage, module] { stage(module(), 0, 0, world_mesh()); }),
      expect<ArgumentError>(T, "PipelineStage on a 2-D mesh", "pp_mesh", [stage, module] {
        stage(module(), 0, static_cast<int>(world()),
              fsdp::init_device_mesh(dev_type(), {world(), 1}));
      }),
      expect<ArgumentError>(T, "Schedule with no stages", "stages", [] {
        pp::Schedule(std::vector<pp::PipelineStage>{}, pp::ScheduleKind::GPipe, 2, pp::LossSpec{});
      }),
      // The message did not quote 'schedule'.
      expect<ArgumentError>(F, "parse_schedule_kind(\"zigzag\")", "schedule",
                            [] { pp::parse_schedule_kind("zigzag"); }),
  };
}

// ---------------------------------------------------------------------------
// mixture of experts

std::vector<Case> moe_cases() {
  const Outcome T = Outcome::Typed, F = Outcome::Fixed;
  namespace moe = fsdp::moe;
  return {
      expect<ArgumentError>(T, "TopKRouter with 0 experts", "num_experts",
                            [] { moe::TopKRouter(8, 0, 1); }),
      expect<ArgumentError>(T, "TopKRouter top_k 5 of 4 experts", "top_k",
                            [] { moe::TopKRouter(8, 4, 5); }),
      expect<ArgumentError>(T, "TopKRouter dim 0", "dim", [] { moe::TopKRouter(0, 4, 1); }),
      expect<ArgumentError>(T, "TopKRouter route_scale 0", "options", [] {
        moe::RouterOptions o;
        o.route_scale = 0;
        moe::TopKRouter(8, 4, 1, o);
      }),
      expect<ArgumentError>(T, "TokenDispatcher 2w+1 experts over ep of w ranks", "num_experts",
                            [] { moe::TokenDispatcher(2 * world() + 1, world_mesh()); }),
      expect<ArgumentError>(T, "expert_options data_parallel_size 0", "data_parallel_size", [] {
        moe::GroupedExperts e(4, 8, 2 * world(), world_mesh());
        moe::expert_options(*e, base_options(), world_mesh(), 0.0);
      }),
      // These two named their argument without quoting it (and the margin
      // blamed 'top_k' for a bad 'scores' shape).
      expect<ArgumentError>(F, "routing_margin top_k 0", "top_k",
                            [] { moe::routing_margin(at::rand({3, 4}), 0); }),
      expect<ShapeError>(F, "routing_margin of 1-D scores", "scores",
                         [] { moe::routing_margin(at::rand({4}), 1); }),
      expect<ShapeError>(F, "GroupedExperts::forward counts not summing to the rows", "counts", [] {
        moe::GroupedExperts e(4, 8, 2);
        e->forward(at::zeros({3, 4}), {1, 1});
      }),
  };
}

// ---------------------------------------------------------------------------
// activation checkpointing

std::vector<Case> checkpoint_cases() {
  const Outcome T = Outcome::Typed;
  return {
      expect<ArgumentError>(T, "checkpoint with an empty fn", "fn", [] {
        fsdp::activation_checkpoint(fsdp::ActivationCheckpointFunction(), std::vector<at::Tensor>{at::zeros({2}, opts())},
                         std::vector<at::Tensor>{});
      }),
      expect<ArgumentError>(T, "checkpoint with an undefined input", "inputs", [] {
        fsdp::activation_checkpoint(
            fsdp::ActivationCheckpointFunction([](const std::vector<at::Tensor>& in) { return in[0]; }),
            std::vector<at::Tensor>{at::Tensor()}, std::vector<at::Tensor>{});
      }),
      expect<ArgumentError>(T, "activation_checkpoint_module(nullptr)", "module",
                            [] { fsdp::activation_checkpoint_module(nullptr); }),
      expect<ArgumentError>(T, "apply_activation_checkpointing with a null root", "root", [] {
        fsdp::apply_activation_checkpointing(
            nullptr, [](const std::string&, const torch::nn::Module&) {
              return std::optional<fsdp::ActivationCheckpointOptions>();
            });
      }),
      expect<ArgumentError>(T, "activation_checkpoint_every_nth(0)", "n", [] {
        fsdp::activation_checkpoint_every_nth(0, [](const torch::nn::Module&) { return true; });
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

}  // namespace

BOOST_AUTO_TEST_CASE(test_fully_shard_options_bad_input) { run_cases(fully_shard_option_cases()); }
BOOST_AUTO_TEST_CASE(test_fsdp_module_bad_input) { run_cases(fsdp_module_cases()); }
BOOST_AUTO_TEST_CASE(test_device_mesh_bad_input) { run_cases(mesh_cases()); }
BOOST_AUTO_TEST_CASE(test_dtensor_bad_input) { run_cases(dtensor_cases()); }
BOOST_AUTO_TEST_CASE(test_clip_grad_bad_input) { run_cases(clip_grad_cases()); }
BOOST_AUTO_TEST_CASE(test_tensor_parallel_bad_input) { run_cases(tp_cases()); }
BOOST_AUTO_TEST_CASE(test_pipeline_bad_input) { run_cases(pipeline_cases()); }
BOOST_AUTO_TEST_CASE(test_moe_bad_input) { run_cases(moe_cases()); }
BOOST_AUTO_TEST_CASE(test_activation_checkpointing_bad_input) { run_cases(checkpoint_cases()); }

// The inf-norm of gradients holding NaN is NaN, as torch's, on every rank
// (std::max(x, NaN) and MPI's MAX dropped it: this case got 1, the max of
// the other entries): here only rank 0 holds the NaN, in its shard.
BOOST_AUTO_TEST_CASE(test_inf_norm_propagates_nan) {
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
BOOST_AUTO_TEST_CASE(test_case_table_is_complete) {
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
