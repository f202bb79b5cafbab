// Shared pieces of the test_tensor_parallel feature files
// (test_tensor_parallel_{layers,api}.cpp): the tp meshes of the world size,
// seeded inputs, reference leaves and pieces, and counting the collectives
// of a forward and a backward.
#pragma once
#include "l1_util.h"
#include "spmd.h"
#include "tensor_diff.h"

#include <fsdp/comm.h>
#include <fsdp/dtensor.h>
#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>
#include <fsdp/tensor_parallel.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

namespace {

namespace tp = fsdp::tp;
using fsdp::Placement;
using Shape = std::vector<int64_t>;

constexpr double kTol = 1e-5;

inline int64_t world() { return spmd::world_size(); }
inline c10::Device dev() { return spmd::device(); }

struct TpMesh {
  fsdp::DeviceMesh mesh;
  int64_t row;  // dp row: seeds data, so rows differ
  std::string label;
  int64_t size() const { return mesh.size(); }
  int64_t rank() const { return mesh.get_local_rank(0); }
};

inline std::vector<TpMesh> tp_meshes() {
  std::vector<TpMesh> out;
  out.push_back({fsdp::init_device_mesh(dev().type(), {world()}, {"tp"}), 0,
                 "tp=" + std::to_string(world())});
  if (world() == 4) {
    const fsdp::DeviceMesh m = fsdp::init_device_mesh(dev().type(), {2, 2}, {"dp", "tp"});
    out.push_back({m["tp"], m.get_local_rank("dp"), "(dp=2,tp=2)[tp]"});
  }
  return out;
}

// A tp mesh of size 1 at every world size.
inline fsdp::DeviceMesh tp_one() {
  return fsdp::init_device_mesh(dev().type(), {world(), 1}, {"dp", "tp"})["tp"];
}

// Identical on every rank that passes the same seed.
inline at::Tensor randn(const Shape& shape, uint64_t seed, double scale = 1.0) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randn(shape, gen, at::kFloat) * scale;
}

inline at::Tensor randint(int64_t high, const Shape& shape, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randint(high, shape, gen, at::kLong);
}

// A fresh leaf on the test device.
inline at::Tensor leaf(const at::Tensor& t) { return t.to(dev()).clone().requires_grad_(true); }
inline at::Tensor on_dev(const at::Tensor& t) { return t.to(dev()); }
// A double leaf for the reference.
inline at::Tensor ref_leaf(const at::Tensor& t) {
  return t.to(at::kDouble).clone().requires_grad_(true);
}

// Part `index` of `parts` equal contiguous pieces of `dim`.
inline at::Tensor piece(const at::Tensor& t, int64_t dim, int64_t parts, int64_t index) {
  const int64_t n = t.size(dim) / parts;
  return t.narrow(dim, index * n, n);
}

// `dim` cut into `blocks` equal blocks, each cut into `parts`: piece `index`
// of every block, concatenated (a fused [q; k; v] sharded by heads).
inline at::Tensor block_pieces(const at::Tensor& t, int64_t dim, int64_t blocks, int64_t parts,
                        int64_t index) {
  std::vector<at::Tensor> out;
  for (int64_t b = 0; b < blocks; ++b) {
    out.push_back(piece(piece(t, dim, blocks, b), dim, parts, index));
  }
  return at::cat(out, dim);
}

using testkit::max_abs_diff_or_inf;

// ---- collective counts -----------------------------------------------------

struct Ops {
  int64_t all_gather = 0, reduce_scatter = 0, all_reduce = 0, total = 0;
};

inline Ops ops_now() {
  const fsdp::CollectiveCounters c = fsdp::collective_counters();
  Ops o;
  o.all_gather = c.total("all_gather");
  o.reduce_scatter = c.total("reduce_scatter");
  o.all_reduce = c.total("all_reduce");
  for (const auto& [key, n] : c.count) o.total += n;
  return o;
}

inline Ops minus(const Ops& a, const Ops& b) {
  return {a.all_gather - b.all_gather, a.reduce_scatter - b.reduce_scatter,
          a.all_reduce - b.all_reduce, a.total - b.total};
}

inline void check_ops(const std::string& what, const Ops& got, const Ops& want) {
  BOOST_TEST(got.all_gather == want.all_gather, what << ": all_gather " << got.all_gather
                                                     << ", expected " << want.all_gather);
  BOOST_TEST(got.reduce_scatter == want.reduce_scatter,
             what << ": reduce_scatter " << got.reduce_scatter << ", expected "
                  << want.reduce_scatter);
  BOOST_TEST(got.all_reduce == want.all_reduce, what << ": all_reduce " << got.all_reduce
                                                     << ", expected " << want.all_reduce);
  const int64_t want_total = want.all_gather + want.reduce_scatter + want.all_reduce;
  BOOST_TEST(got.total == want_total,
             what << ": " << got.total << " collectives in all, expected " << want_total);
}

// Runs f(x) forward and y.backward(grad), counting the collectives of each.
struct Run {
  at::Tensor y, x_grad;
  Ops fwd, bwd;
};

inline Run run_counted(const std::function<at::Tensor(const at::Tensor&)>& f, const at::Tensor& x,
                const at::Tensor& grad) {
  fsdp::reset_collective_counters();
  Run r;
  r.y = f(x);
  r.fwd = ops_now();
  r.y.backward(on_dev(grad));
  r.bwd = minus(ops_now(), r.fwd);
  r.x_grad = x.grad();
  return r;
}

}  // namespace
