// Helpers for the Level-1 interface suites: sharding the toy MLP, comparing
// sharded gradients/parameters with a single-card reference, recording the
// worst error per plan case over all ranks, and checking typed errors.
#pragma once

#include "spmd.h"
#include "raw_mpi.h"
#include "report.h"
#include "tensor_diff.h"
#include "toy_models.h"

#include <fsdp/comm.h>
#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace l1 {

constexpr double kInf = std::numeric_limits<double>::infinity();

inline at::Tensor host(const at::Tensor& t) { return t.detach().to(at::kCPU); }

// Max of a value over every world rank (collective over the world, raw MPI).
inline double world_max(double v) { return raw_mpi::max_over_ranks(v); }

// The suites' one report type (report.h), under the name the L1 helpers use.
using testkit::Report;

// The part of a full tensor this rank holds under Shard(0) over `parts`
// ranks (index = its rank in the shard group).
inline at::Tensor my_rows(const at::Tensor& full, int64_t parts, int64_t index) {
  return toy::shard_rows(host(full), parts, index);
}

// Max over the parameters of `model` of |grad - scale * my rows of ref's grad|.
// A missing sharded gradient gives +inf. `only` restricts to names starting with it.
inline double grad_err(torch::nn::Module& model, torch::nn::Module& ref, int64_t parts,
                       int64_t index, double scale = 1.0, const std::string& only = "") {
  double worst = 0;
  auto ref_params = ref.named_parameters();
  for (const auto& item : model.named_parameters()) {
    if (!only.empty() && item.key().rfind(only, 0) != 0) continue;
    const at::Tensor* r = ref_params.find(item.key());
    if (r == nullptr || !r->grad().defined()) return kInf;
    const at::Tensor g = item.value().grad();
    const at::Tensor expect = my_rows(r->grad(), parts, index) * scale;
    const double e = testkit::max_abs_diff_or_inf(g, expect);
    if (!(e <= worst)) worst = e;  // keeps NaN/inf
  }
  return worst;
}

// Max over the parameters of `model` of |data - my rows of ref's data|.
inline double data_err(torch::nn::Module& model, torch::nn::Module& ref, int64_t parts,
                       int64_t index) {
  double worst = 0;
  auto ref_params = ref.named_parameters();
  for (const auto& item : model.named_parameters()) {
    const at::Tensor* r = ref_params.find(item.key());
    if (r == nullptr) return kInf;
    const double e = testkit::max_abs_diff_or_inf(item.value(), my_rows(*r, parts, index));
    if (!(e <= worst)) worst = e;
  }
  return worst;
}

// Whether every parameter's gradient is undefined.
inline bool all_grads_undefined(torch::nn::Module& model) {
  for (const auto& p : model.parameters()) {
    if (p.grad().defined()) return false;
  }
  return true;
}

// Whether every parameter's gradient is defined and finite.
inline bool all_grads_finite(torch::nn::Module& model) {
  for (const auto& p : model.parameters()) {
    if (!p.grad().defined() || !at::isfinite(p.grad()).all().item<bool>()) return false;
  }
  return true;
}

// Clears a reference model's gradients (set to undefined).
inline void clear_grads(torch::nn::Module& m) {
  for (auto& p : m.parameters()) p.mutable_grad() = at::Tensor();
}

// Single-card step: gradients of mse(model(x), y) over the whole batch,
// accumulated into whatever the parameters already hold.
inline double ref_backward(toy::Mlp& ref, const toy::Batch& b) {
  at::Tensor loss = toy::mse(ref(b.x), b.y);
  loss.backward();
  return loss.item<double>();
}

// The toy MLP sharded bottom-up: fc1, fc2, then the root (which manages fc3).
struct ShardedMlp {
  toy::Mlp model;
  fsdp::FSDPModule fc1, fc2, root;
  fsdp::Sharded<toy::Mlp> net;

  ShardedMlp(int64_t seed, const fsdp::FullyShardOptions& opts) : model(seed) {
    model->to(spmd::device());
    fc1 = fsdp::fully_shard(model->fc1, opts);
    fc2 = fsdp::fully_shard(model->fc2, opts);
    root = fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(model.ptr()), opts);
    net = fsdp::Sharded<toy::Mlp>(model);
  }
  at::Tensor loss(const toy::Batch& b) {
    const auto dev = spmd::device();
    return toy::mse(net(b.x.to(dev)), b.y.to(dev));
  }
  // forward + backward on this rank's batch.
  void step(const toy::Batch& b) { loss(b).backward(); }
  torch::nn::Module& module() { return *model; }
};

// Full numel of each toy MLP parameter, by name.
inline int64_t full_numel(const std::string& name) {
  if (name == "fc1.weight") return 7 * 15;
  if (name == "fc1.bias") return 7;
  if (name == "fc2.weight") return 3 * 7;
  if (name == "fc2.bias") return 3;
  if (name == "fc3.weight") return 5 * 3;
  if (name == "fc3.bias") return 5;
  return -1;
}

// Numel of this rank's Shard(0) piece of a toy MLP parameter.
inline int64_t shard_numel(const std::string& name, int64_t parts, int64_t index) {
  const int64_t rows = name.rfind("fc1", 0) == 0 ? 7 : name.rfind("fc2", 0) == 0 ? 3 : 5;
  const int64_t cols = full_numel(name) / rows;
  return fsdp::shard_extent(rows, parts, index).length * cols;
}

// Number of toy-MLP parameters (names starting with `prefix`) whose numel is
// the full (want_full) or the shard numel. Prints mismatches to the log.
inline bool numel_state(torch::nn::Module& model, const std::string& prefix, bool want_full,
                        int64_t parts, int64_t index, std::string* mismatch = nullptr) {
  bool ok = true;
  for (const auto& item : model.named_parameters()) {
    if (item.key().rfind(prefix, 0) != 0) continue;
    const int64_t expect =
        want_full ? full_numel(item.key()) : shard_numel(item.key(), parts, index);
    if (item.value().numel() != expect) {
      ok = false;
      if (mismatch) {
        *mismatch += item.key() + " numel " + std::to_string(item.value().numel()) +
                     " expected " + std::to_string(expect) + "; ";
      }
    }
  }
  return ok;
}

// Runs fn, which must throw E; checks that what() names `argument` (and, for
// ArgumentError subclasses, that argument() equals it). Returns what().
template <typename E, typename Fn>
std::string expect_error(Fn&& fn, const std::string& argument, const std::string& label) {
  try {
    fn();
  } catch (const E& e) {
    const std::string msg = e.what();
    BOOST_TEST(msg.find(argument) != std::string::npos,
               label << ": message does not name '" << argument << "': " << msg);
    if constexpr (std::is_base_of_v<fsdp::ArgumentError, E>) {
      BOOST_TEST(e.argument() == argument,
                 label << ": argument() is '" << e.argument() << "', expected '" << argument << "'");
    }
    BOOST_TEST_MESSAGE(label << " -> " << msg);
    return msg;
  } catch (const std::exception& e) {
    BOOST_ERROR(label << ": threw the wrong type: " << e.what());
    return e.what();
  }
  BOOST_ERROR(label << ": did not throw");
  return "";
}

// Position of the first record at or after `from` with this op (and bytes,
// when >= 0); -1 if none.
inline int64_t find_record(const fsdp::CollectiveCounters& c, const std::string& op, int64_t bytes,
                           int64_t from = 0) {
  for (size_t i = static_cast<size_t>(from); i < c.sequence.size(); ++i) {
    const auto& r = c.sequence[i];
    if (r.op == op && (bytes < 0 || r.bytes == bytes)) return static_cast<int64_t>(i);
  }
  return -1;
}

inline std::string describe_sequence(const fsdp::CollectiveCounters& c) {
  std::ostringstream os;
  for (size_t i = 0; i < c.sequence.size(); ++i) {
    os << (i ? ", " : "") << c.sequence[i].op << "(" << c.sequence[i].bytes << "B)";
  }
  return os.str();
}

}  // namespace l1
