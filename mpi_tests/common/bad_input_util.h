// Shared pieces of the test_bad_input feature files
// (test_bad_input_{fully_shard,parallel}.cpp).
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
#pragma once

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

namespace bad_input {

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
inline Case expect(Outcome outcome, std::string name, std::string argument, std::function<void()> call) {
  return Case{std::move(name), outcome, std::type_index(typeid(E)),
              boost::core::demangle(typeid(E).name()), std::move(argument), std::move(call)};
}

// what() quotes the argument: 'arg', or a path that starts with it
// ('mp_policy.param_dtype', 'dtensor_params[0]').
inline bool names_in_quotes(const std::string& what, const std::string& argument) {
  for (const char* end : {"'", ".", "["}) {
    if (what.find("'" + argument + end) != std::string::npos) return true;
  }
  return false;
}

// The checker: exact type, argument(), and the argument quoted in what().
inline void run_cases(const std::vector<Case>& cases) {
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

inline at::TensorOptions opts(at::ScalarType dt = at::kFloat) {
  return at::TensorOptions(dt).device(spmd::device());
}

inline c10::DeviceType dev_type() { return spmd::device().type(); }
inline int64_t world() { return spmd::world_size(); }

inline fsdp::DeviceMesh world_mesh() { return fsdp::init_device_mesh(dev_type(), {world()}, {"shard"}); }

// Options on the suite's device (the default mesh follows the Runtime's).
inline fsdp::FullyShardOptions base_options() {
  fsdp::FullyShardOptions o;
  o.mesh = world_mesh();
  return o;
}

inline torch::nn::Linear linear(int64_t in = 8, int64_t out = 4) {
  torch::nn::Linear lin(in, out);
  lin->to(spmd::device());
  return lin;
}

inline std::shared_ptr<torch::nn::Module> as_module(const torch::nn::Linear& lin) {
  return std::static_pointer_cast<torch::nn::Module>(lin.ptr());
}

// fully_shard(Linear(8, 4)) after `edit` changed the options.
inline std::function<void()> shard_linear(std::function<void(fsdp::FullyShardOptions&,
                                                      torch::nn::Linear&)> edit) {
  return [edit] {
    auto lin = linear();
    auto o = base_options();
    edit(o, lin);
    fsdp::fully_shard(as_module(lin), o);
  };
}

inline fsdp::ShardPlacementFn placement_fn(std::optional<fsdp::ShardPlacementResult> result) {
  return [result](const std::string&, const at::Tensor&) { return result; };
}
// The tables, one per area (test_bad_input_fully_shard.cpp: fully_shard
// options, FSDPModule methods, clip_grad; test_bad_input_parallel.cpp: the
// others), and all of them by area for test_case_table_is_complete.
std::vector<Case> fully_shard_option_cases();
std::vector<Case> fsdp_module_cases();
std::vector<Case> mesh_cases();
std::vector<Case> dtensor_cases();
std::vector<Case> clip_grad_cases();
std::vector<Case> tp_cases();
std::vector<Case> pipeline_cases();
std::vector<Case> moe_cases();
std::vector<Case> checkpoint_cases();
std::map<std::string, std::vector<Case> (*)()> all_tables();

}  // namespace bad_input
