// Shared pieces of the test_dtensor feature files
// (test_dtensor_{redistribute,strided_shard}.cpp): meshes of the world size
// on the suite's device, expected values from at::arange, placement and
// shape printing, typed-error checks and the collective count.
#pragma once
#include "spmd.h"
#include "toy_models.h"

#include <fsdp/comm.h>
#include <fsdp/dtensor.h>
#include <fsdp/errors.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace {

using fsdp::Placement;
using fsdp::ReduceOp;
using Placements = std::vector<Placement>;
using Shape = std::vector<int64_t>;

inline int world() { return spmd::world_size(); }

// The suite's device: float32 on it, and a mesh of its type.
inline at::TensorOptions on_device() { return at::TensorOptions(at::kFloat).device(spmd::device()); }

inline fsdp::DeviceMesh mesh_of(const Shape& shape, const std::vector<std::string>& names = {}) {
  return fsdp::init_device_mesh(spmd::device().type(), shape, names);
}

inline boost::unit_test::precondition even_world_of_4_or_more(const std::string& reason) {
  return spmd::skip_unless([] { return world() >= 4 && world() % 2 == 0; },
                           "needs an even world size >= 4: " + reason);
}

struct Mesh {
  fsdp::DeviceMesh mesh;
  Shape shape;
};

// The 1-D mesh, and the (replicate, shard) mesh when the world splits in two.
inline std::vector<Mesh> meshes() {
  std::vector<Mesh> out;
  out.push_back({mesh_of({world()}), {world()}});
  if (world() >= 4 && world() % 2 == 0) {
    const Shape shape{2, world() / 2};
    out.push_back({mesh_of(shape, {"replicate", "shard"}), shape});
  }
  return out;
}

// This rank's coordinate under mesh.h's row-major layout.
inline Shape coordinate(const Shape& mesh_shape) {
  Shape c(mesh_shape.size());
  int64_t r = spmd::rank();
  for (size_t i = mesh_shape.size(); i-- > 0;) {
    c[i] = r % mesh_shape[i];
    r /= mesh_shape[i];
  }
  return c;
}

// This rank's piece of `full` under Shard/Replicate placements.
inline at::Tensor expected_local(const at::Tensor& full, const Shape& mesh_shape,
                          const Placements& placements) {
  const Shape c = coordinate(mesh_shape);
  at::Tensor t = full;
  for (size_t i = 0; i < placements.size(); ++i) {
    if (placements[i].is_shard())
      t = toy::ceil_div_rows(t, placements[i].dim(), mesh_shape[i], c[i]);
  }
  return t;
}

inline at::Tensor arange(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return at::arange(n, on_device()).reshape(shape);
}

// A distinct, exactly representable partial value per contributor index.
inline at::Tensor contribution(const Shape& shape, int64_t index) {
  return arange(shape) * static_cast<double>(index + 1) + static_cast<double>(index);
}

inline std::string str(const Placements& placements) {
  std::string s;
  for (const Placement& p : placements) s += p.to_string() + " ";
  return s;
}

inline std::string str(const Shape& shape) {
  std::ostringstream os;
  os << c10::IntArrayRef(shape);
  return os.str();
}

// Shard/Replicate placements worth covering on a mesh of `ndim` dims.
inline std::vector<Placements> layouts(int ndim) {
  const Placement r = Placement::Replicate();
  const Placement s0 = Placement::Shard(0);
  const Placement s1 = Placement::Shard(1);
  if (ndim == 1) return {{s0}, {s1}, {r}};
  return {{r, s0}, {r, s1}, {s0, r}, {s0, s1}, {s1, s0}, {s0, s0}, {s1, s1}, {r, r}};
}

const std::vector<Shape> kShapes{{7, 15}, {3, 5}};

// Runs `f`, which must throw E whose argument() and what() name `argument`.
template <class E>
inline void check_throws(const std::function<void()>& f, const std::string& argument) {
  bool thrown = false;
  try {
    f();
  } catch (const E& e) {
    thrown = true;
    BOOST_TEST(e.argument() == argument);
    BOOST_CHECK_MESSAGE(std::string(e.what()).find("'" + argument + "'") != std::string::npos,
                        "message does not name '" << argument << "': " << e.what());
  }
  BOOST_CHECK_MESSAGE(thrown, "no exception naming '" << argument << "' was thrown");
}

inline int64_t collectives_issued() {
  const auto counters = fsdp::collective_counters();
  return static_cast<int64_t>(counters.sequence.size());
}

}  // namespace
