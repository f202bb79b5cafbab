// Shared pieces of the test_moe feature files (test_moe_{router,layer}.cpp):
// mixture of experts and expert parallelism (fsdp/moe.h), unit by unit,
// against computations written here and against models::PlainMoE (the
// single-card MoE written without fsdp::moe).
//
// Tolerance 1e-6 throughout, on max |a - b| / max(1, max |reference|):
// every comparison is the same fp32 computation up to GEMM shapes (the
// router's M is the local token count, the gate gradient sums the global
// batch rank by rank) or an fp32 result against a double one on O(1)
// values; integers, ids and exchanged rows are compared exactly.
#pragma once

#include "l1_util.h"
#include "spmd.h"
#include "tensor_diff.h"

#include <fsdp/comm.h>
#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>
#include <fsdp/moe.h>

#include <models/moe_llm.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/linear.h>

#include <boost/core/demangle.hpp>
#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <string>
#include <typeinfo>
#include <vector>

namespace {

namespace moe = fsdp::moe;
using Shape = std::vector<int64_t>;

constexpr double kTol = 1e-6;
// Smallest routing margin under which a parity comparison is not trusted:
// ulp-level logit differences must not flip a choice (PARALLELISM.md 6.6.5).
constexpr double kMinMargin = 1e-5;
constexpr double kInf = std::numeric_limits<double>::infinity();

inline int64_t world() { return spmd::world_size(); }
inline int64_t rank() { return spmd::rank(); }
inline c10::Device dev() { return spmd::device(); }

inline fsdp::DeviceMesh world_mesh(const std::string& name) {
  return fsdp::init_device_mesh(dev().type(), {world()}, {name});
}

// Identical on every rank that passes the same seed.
inline at::Tensor randn(const Shape& shape, uint64_t seed, double scale = 1.0) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randn(shape, gen, at::kFloat) * scale;
}

inline void assign(const at::Tensor& param, const at::Tensor& value) {
  at::NoGradGuard no_grad;
  param.copy_(value);
}

inline at::Tensor leaf(const at::Tensor& t) { return t.to(dev()).clone().requires_grad_(true); }

using testkit::max_abs_diff_or_inf_scaled_by_b;

// The k largest scores of each row, ties to the lower id: a selection
// (strictly greater replaces), independent of the library's stable sort.
inline at::Tensor topk_ids(const at::Tensor& scores, int64_t k) {
  const at::Tensor s = scores.detach().to(at::kDouble).cpu().contiguous();
  const int64_t T = s.size(0), E = s.size(1);
  const auto a = s.accessor<double, 2>();
  at::Tensor ids = at::empty({T, k}, at::kLong);
  auto out = ids.accessor<int64_t, 2>();
  for (int64_t t = 0; t < T; ++t) {
    std::vector<bool> taken(static_cast<size_t>(E), false);
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        if (!taken[static_cast<size_t>(e)] && (best < 0 || a[t][e] > a[t][best])) best = e;
      }
      taken[static_cast<size_t>(best)] = true;
      out[t][j] = best;
    }
  }
  return ids;
}

// min over tokens of (k-th chosen score - largest unchosen score).
inline double margin_of(const at::Tensor& scores, const at::Tensor& ids) {
  const int64_t T = scores.size(0), E = scores.size(1), k = ids.size(1);
  if (k == E || T == 0) return kInf;
  const at::Tensor s = scores.detach().to(at::kDouble).cpu();
  const at::Tensor chosen = at::zeros_like(s, at::kBool).scatter_(1, ids.cpu(), true);
  const at::Tensor kth = s.gather(1, ids.cpu().narrow(1, k - 1, 1)).squeeze(1);
  const at::Tensor best_left = s.masked_fill(chosen, -kInf).amax(1);
  return (kth - best_left).min().item<double>();
}

// Number of entries where two integer tensors differ (numel if shapes differ).
inline double mismatches(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined() || a.sizes() != b.sizes()) return kInf;
  return a.cpu().ne(b.cpu()).sum().item<double>();
}

// Runs fn, which must throw exactly E (not a subclass) naming `argument`.
template <typename E, typename Fn>
inline void expect_exact(Fn&& fn, const std::string& argument, const std::string& label) {
  l1::expect_error<E>(
      [&] {
        try {
          fn();
        } catch (const E& e) {
          BOOST_TEST((typeid(e) == typeid(E)),
                     label << ": threw " << boost::core::demangle(typeid(e).name()) << ", expected "
                           << boost::core::demangle(typeid(E).name()));
          throw;
        }
      },
      argument, label);
}

}  // namespace
