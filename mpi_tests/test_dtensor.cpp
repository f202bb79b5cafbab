// L0: DTensor (lite) -- ceil-div layout, distribute/from_local round trips,
// redistribution between every placement pair, and argument errors, on a 1-D
// mesh and (for even world sizes >= 4) a (replicate, shard) 2-D mesh.
// Expected values are built here from at::arange and a hand-written ceil-div
// split, never from the library under test.
#include "spmd.h"

#include <fsdp/comm.h>
#include <fsdp/dtensor.h>
#include <fsdp/errors.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace {

using fsdp::Placement;
using fsdp::ReduceOp;
using Placements = std::vector<Placement>;
using Shape = std::vector<int64_t>;

int world() { return spmd::world_size(); }

struct Mesh {
  fsdp::DeviceMesh mesh;
  Shape shape;
};

// The 1-D mesh, and the (replicate, shard) mesh when the world splits in two.
std::vector<Mesh> meshes() {
  std::vector<Mesh> out;
  out.push_back({fsdp::init_device_mesh(c10::kCPU, {world()}), {world()}});
  if (world() >= 4 && world() % 2 == 0) {
    const Shape shape{2, world() / 2};
    out.push_back({fsdp::init_device_mesh(c10::kCPU, shape, {"replicate", "shard"}), shape});
  }
  return out;
}

// This rank's coordinate under mesh.h's row-major layout.
Shape coordinate(const Shape& mesh_shape) {
  Shape c(mesh_shape.size());
  int64_t r = spmd::rank();
  for (size_t i = mesh_shape.size(); i-- > 0;) {
    c[i] = r % mesh_shape[i];
    r /= mesh_shape[i];
  }
  return c;
}

// Rows [min(i*c, n), min((i+1)*c, n)) with c = ceil(n / parts).
at::Tensor owned(const at::Tensor& t, int64_t dim, int64_t parts, int64_t index) {
  const int64_t n = t.size(dim);
  const int64_t c = (n + parts - 1) / parts;
  const int64_t begin = std::min(index * c, n);
  const int64_t end = std::min((index + 1) * c, n);
  return t.narrow(dim, begin, end - begin);
}

// This rank's piece of `full` under Shard/Replicate placements.
at::Tensor expected_local(const at::Tensor& full, const Shape& mesh_shape,
                          const Placements& placements) {
  const Shape c = coordinate(mesh_shape);
  at::Tensor t = full;
  for (size_t i = 0; i < placements.size(); ++i) {
    if (placements[i].is_shard()) t = owned(t, placements[i].dim(), mesh_shape[i], c[i]);
  }
  return t;
}

at::Tensor arange(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return at::arange(n, at::kFloat).reshape(shape);
}

// A distinct, exactly representable partial value per contributor index.
at::Tensor contribution(const Shape& shape, int64_t index) {
  return arange(shape) * static_cast<double>(index + 1) + static_cast<double>(index);
}

std::string str(const Placements& placements) {
  std::string s;
  for (const Placement& p : placements) s += p.to_string() + " ";
  return s;
}

std::string str(const Shape& shape) {
  std::ostringstream os;
  os << c10::IntArrayRef(shape);
  return os.str();
}

// Shard/Replicate placements worth covering on a mesh of `ndim` dims.
std::vector<Placements> layouts(int ndim) {
  const Placement r = Placement::Replicate();
  const Placement s0 = Placement::Shard(0);
  const Placement s1 = Placement::Shard(1);
  if (ndim == 1) return {{s0}, {s1}, {r}};
  return {{r, s0}, {r, s1}, {s0, r}, {s0, s1}, {s1, s0}, {s0, s0}, {s1, s1}, {r, r}};
}

const std::vector<Shape> kShapes{{7, 15}, {3, 5}};

// Runs `f`, which must throw E whose argument() and what() name `argument`.
template <class E>
void check_throws(const std::function<void()>& f, const std::string& argument) {
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

int64_t collectives_issued() {
  const auto counters = fsdp::collective_counters();
  return static_cast<int64_t>(counters.sequence.size());
}

}  // namespace

BOOST_AUTO_TEST_CASE(placement_basics) {
  BOOST_TEST(Placement::Shard(1).to_string() == "Shard(1)");
  BOOST_TEST(Placement::Replicate().to_string() == "Replicate()");
  BOOST_TEST(Placement::Partial().to_string() == "Partial(sum)");
  BOOST_TEST(Placement::Partial(ReduceOp::AVG).to_string() == "Partial(avg)");
  BOOST_TEST(Placement::Shard().is_shard(0));
  BOOST_TEST(!Placement::Shard(1).is_shard(0));
  BOOST_TEST((Placement::Shard(1) == Placement::Shard(1)));
  BOOST_TEST((Placement::Shard(0) != Placement::Shard(1)));
  BOOST_TEST((Placement::Partial(ReduceOp::SUM) != Placement::Partial(ReduceOp::AVG)));
  BOOST_TEST((Placement::Replicate() != Placement::Partial()));
  BOOST_TEST((Placement::Partial().reduce_op() == ReduceOp::SUM));
  check_throws<fsdp::ArgumentError>([] { Placement::Partial(ReduceOp::MAX); }, "op");

  const fsdp::DTensor none;
  BOOST_TEST(!none.defined());
  BOOST_TEST(none.numel() == 0);
  BOOST_CHECK_THROW(none.full_tensor(), fsdp::StateError);
}

BOOST_AUTO_TEST_CASE(shard_extent_and_chunk) {
  struct Row {
    int64_t n, parts, chunk;
    std::vector<std::pair<int64_t, int64_t>> extents;  // (offset, length) per index
  };
  const std::vector<Row> table{
      {7, 4, 2, {{0, 2}, {2, 2}, {4, 2}, {6, 1}}},
      {3, 4, 1, {{0, 1}, {1, 1}, {2, 1}, {3, 0}}},
      {5, 4, 2, {{0, 2}, {2, 2}, {4, 1}, {5, 0}}},
      {15, 4, 4, {{0, 4}, {4, 4}, {8, 4}, {12, 3}}},
      {8, 2, 4, {{0, 4}, {4, 4}}},
      {3, 2, 2, {{0, 2}, {2, 1}}},
      {1, 3, 1, {{0, 1}, {1, 0}, {1, 0}}},
      {0, 3, 0, {{0, 0}, {0, 0}, {0, 0}}},
      {9, 1, 9, {{0, 9}}},
  };
  for (const Row& row : table) {
    BOOST_TEST_CONTEXT("n=" << row.n << " parts=" << row.parts) {
      BOOST_TEST(fsdp::shard_chunk(row.n, row.parts) == row.chunk);
      for (int64_t i = 0; i < row.parts; ++i) {
        const fsdp::ShardExtent e = fsdp::shard_extent(row.n, row.parts, i);
        BOOST_TEST(e.offset == row.extents[static_cast<size_t>(i)].first);
        BOOST_TEST(e.length == row.extents[static_cast<size_t>(i)].second);
      }
    }
  }
  check_throws<fsdp::ArgumentError>([] { fsdp::shard_chunk(4, 0); }, "parts");
  check_throws<fsdp::ArgumentError>([] { fsdp::shard_chunk(-1, 2); }, "n");
  check_throws<fsdp::ArgumentError>([] { fsdp::shard_extent(4, 2, 2); }, "index");
  check_throws<fsdp::ArgumentError>([] { fsdp::shard_extent(4, 2, -1); }, "index");
}

BOOST_AUTO_TEST_CASE(distribute_tensor_round_trip) {
  for (const Mesh& m : meshes()) {
    for (const Placements& p : layouts(m.mesh.ndim())) {
      for (const Shape& shape : kShapes) {
        BOOST_TEST_CONTEXT("mesh " << str(m.shape) << " " << str(p) << "shape " << str(shape)) {
          const at::Tensor full = arange(shape);
          const fsdp::DTensor dt = fsdp::distribute_tensor(full, m.mesh, p);
          BOOST_TEST(dt.shape() == shape);
          BOOST_TEST(dt.numel() == full.numel());
          BOOST_TEST((dt.placements() == p));
          BOOST_TEST(at::equal(dt.to_local(), expected_local(full, m.shape, p)));
          BOOST_TEST(dt.to_local().is_contiguous());
          BOOST_TEST(!dt.to_local().is_alias_of(full));
          BOOST_TEST(at::equal(dt.full_tensor(), full));
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(from_local_round_trip) {
  for (const Mesh& m : meshes()) {
    for (const Placements& p : layouts(m.mesh.ndim())) {
      for (const Shape& shape : kShapes) {
        BOOST_TEST_CONTEXT("mesh " << str(m.shape) << " " << str(p) << "shape " << str(shape)) {
          const at::Tensor full = arange(shape);
          const at::Tensor local = expected_local(full, m.shape, p).clone();
          const fsdp::DTensor inferred = fsdp::DTensor::from_local(local, m.mesh, p);
          BOOST_TEST(inferred.shape() == shape);
          BOOST_TEST(at::equal(inferred.full_tensor(), full));
          const fsdp::DTensor given = fsdp::DTensor::from_local(local, m.mesh, p, shape);
          BOOST_TEST(given.shape() == shape);
          BOOST_TEST(given.to_local().is_same(local));
          BOOST_TEST(at::equal(given.full_tensor(), full));
        }
      }
    }
  }
}

// world-1 rows (3 on 4 ranks): chunk 1, so the last rank owns no rows; the
// columns of (3, 5) on 4 ranks split 2, 2, 1, 0.
BOOST_AUTO_TEST_CASE(trailing_rank_owns_nothing) {
  const fsdp::DeviceMesh mesh = fsdp::init_device_mesh(c10::kCPU, {world()});
  const bool last = spmd::rank() == world() - 1;
  const at::Tensor full = arange({world() - 1, 5});
  const fsdp::DTensor rows = fsdp::distribute_tensor(full, mesh, {Placement::Shard(0)});
  BOOST_TEST(rows.to_local().size(0) == (last ? 0 : 1));
  BOOST_TEST(rows.to_local().size(1) == 5);
  BOOST_TEST(at::equal(rows.full_tensor(), full));
  const fsdp::DTensor again =
      fsdp::DTensor::from_local(rows.to_local(), mesh, {Placement::Shard(0)});
  BOOST_TEST(again.shape() == Shape({world() - 1, 5}));
  BOOST_TEST(at::equal(again.full_tensor(), full));

  if (world() == 4) {
    const at::Tensor small = arange({3, 5});
    const fsdp::DTensor cols = fsdp::distribute_tensor(small, mesh, {Placement::Shard(1)});
    const int64_t want[] = {2, 2, 1, 0};
    BOOST_TEST(cols.to_local().size(1) == want[spmd::rank()]);
    BOOST_TEST(cols.to_local().size(0) == 3);
    BOOST_TEST(at::equal(cols.full_tensor(), small));
  }
}

BOOST_AUTO_TEST_CASE(partial_to_replicate_and_shard) {
  const fsdp::DeviceMesh mesh = fsdp::init_device_mesh(c10::kCPU, {world()});
  const int64_t one_if_comm = world() > 1 ? 1 : 0;
  for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG}) {
    for (const Shape& shape : kShapes) {
      at::Tensor want = at::zeros(shape, at::kFloat);
      for (int r = 0; r < world(); ++r) want += contribution(shape, r);
      if (op == ReduceOp::AVG) want /= world();
      for (const Placement& target :
           {Placement::Replicate(), Placement::Shard(0), Placement::Shard(1)}) {
        BOOST_TEST_CONTEXT(fsdp::to_string(op) << " -> " << target.to_string() << " shape "
                                               << str(shape)) {
          const at::Tensor mine = contribution(shape, spmd::rank());
          const fsdp::DTensor partial =
              fsdp::DTensor::from_local(mine.clone(), mesh, {Placement::Partial(op)});
          BOOST_TEST(partial.shape() == shape);

          fsdp::reset_collective_counters();
          const fsdp::DTensor out = partial.redistribute({target});
          const auto counters = fsdp::collective_counters();
          if (target.is_shard()) {
            BOOST_TEST(counters.total("reduce_scatter") == one_if_comm);
            BOOST_TEST(counters.total("all_reduce") == 0);
          } else {
            BOOST_TEST(counters.total("all_reduce") == one_if_comm);
          }
          BOOST_TEST(counters.total("all_gather") == 0);

          BOOST_TEST(at::equal(out.to_local(), expected_local(want, {world()}, {target})));
          BOOST_TEST(at::equal(out.full_tensor(), want));
          BOOST_TEST(at::equal(partial.full_tensor(), want));
          BOOST_TEST(at::equal(partial.to_local(), mine));  // the source keeps its value
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(partial_on_2d_mesh) {
  if (world() < 4 || world() % 2 != 0) SPMD_SKIP("needs an even world size >= 4");
  const Shape mesh_shape{2, world() / 2};
  const fsdp::DeviceMesh mesh =
      fsdp::init_device_mesh(c10::kCPU, mesh_shape, {"replicate", "shard"});
  const Shape c = coordinate(mesh_shape);
  for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG}) {
    for (const Shape& shape : kShapes) {
      BOOST_TEST_CONTEXT(fsdp::to_string(op) << " shape " << str(shape)) {
        // Partial over "replicate": replica a contributes contribution(a).
        const at::Tensor want =
            op == ReduceOp::SUM ? contribution(shape, 0) + contribution(shape, 1)
                                : (contribution(shape, 0) + contribution(shape, 1)) / 2;
        const at::Tensor piece = contribution(shape, c[0]);

        const Placements sharded{Placement::Partial(op), Placement::Shard(0)};
        const fsdp::DTensor a =
            fsdp::DTensor::from_local(owned(piece, 0, mesh_shape[1], c[1]).clone(), mesh, sharded);
        BOOST_TEST(a.shape() == shape);
        BOOST_TEST(at::equal(a.full_tensor(), want));
        for (const Placements& target : layouts(2)) {
          BOOST_TEST_CONTEXT("-> " << str(target)) {
            const fsdp::DTensor out = a.redistribute(target);
            BOOST_TEST(at::equal(out.to_local(), expected_local(want, mesh_shape, target)));
          }
        }

        const Placements replicated{Placement::Partial(op), Placement::Replicate()};
        const fsdp::DTensor b = fsdp::DTensor::from_local(piece.clone(), mesh, replicated);
        const Placements both{Placement::Shard(0), Placement::Shard(1)};
        BOOST_TEST(at::equal(b.redistribute(both).to_local(),
                             expected_local(want, mesh_shape, both)));
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(replicate_to_shard_without_communication) {
  for (const Mesh& m : meshes()) {
    for (const Placements& p : layouts(m.mesh.ndim())) {
      for (const Shape& shape : kShapes) {
        BOOST_TEST_CONTEXT("mesh " << str(m.shape) << " -> " << str(p) << "shape "
                                   << str(shape)) {
          const at::Tensor full = arange(shape);
          const fsdp::DTensor rep = fsdp::DTensor::from_local(
              full, m.mesh, Placements(m.shape.size(), Placement::Replicate()), shape);
          fsdp::reset_collective_counters();
          const fsdp::DTensor out = rep.redistribute(p);
          BOOST_TEST(collectives_issued() == 0);
          BOOST_TEST(at::equal(out.to_local(), expected_local(full, m.shape, p)));
        }
      }
    }
  }
}

// Every ordered pair of Shard/Replicate layouts, including Shard(0) <->
// Shard(1) and the nested [Shard(d), Shard(d)] on the 2-D mesh.
BOOST_AUTO_TEST_CASE(redistribute_between_layouts) {
  for (const Mesh& m : meshes()) {
    for (const Placements& from : layouts(m.mesh.ndim())) {
      for (const Placements& to : layouts(m.mesh.ndim())) {
        for (const Shape& shape : kShapes) {
          BOOST_TEST_CONTEXT("mesh " << str(m.shape) << " " << str(from) << "-> " << str(to)
                                     << "shape " << str(shape)) {
            const at::Tensor full = arange(shape);
            const fsdp::DTensor src = fsdp::DTensor::from_local(
                expected_local(full, m.shape, from).clone(), m.mesh, from, shape);
            const fsdp::DTensor dst = src.redistribute(to);
            BOOST_TEST((dst.placements() == to));
            BOOST_TEST(dst.shape() == shape);
            BOOST_TEST(at::equal(dst.to_local(), expected_local(full, m.shape, to)));
            BOOST_TEST(at::equal(src.to_local(), expected_local(full, m.shape, from)));
          }
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(replicate_partial_round_trip) {
  const fsdp::DeviceMesh mesh = fsdp::init_device_mesh(c10::kCPU, {world()});
  for (const Shape& shape : kShapes) {
    BOOST_TEST_CONTEXT("shape " << str(shape)) {
      const at::Tensor full = arange(shape);
      const fsdp::DTensor rep = fsdp::distribute_tensor(full, mesh, {Placement::Replicate()});

      const fsdp::DTensor sum = rep.redistribute({Placement::Partial(ReduceOp::SUM)});
      BOOST_TEST(at::equal(sum.to_local(), spmd::rank() == 0 ? full : at::zeros_like(full)));
      BOOST_TEST(at::equal(sum.redistribute({Placement::Replicate()}).to_local(), full));

      const fsdp::DTensor avg = rep.redistribute({Placement::Partial(ReduceOp::AVG)});
      BOOST_TEST(at::equal(avg.to_local(), full));
      BOOST_TEST(at::equal(avg.redistribute({Placement::Replicate()}).to_local(), full));

      // distribute_tensor documents the same split for Partial.
      const fsdp::DTensor direct =
          fsdp::distribute_tensor(full, mesh, {Placement::Partial(ReduceOp::SUM)});
      BOOST_TEST(at::equal(direct.to_local(), sum.to_local()));
      BOOST_TEST(at::equal(
          fsdp::distribute_tensor(full, mesh, {Placement::Partial(ReduceOp::AVG)}).to_local(),
          full));

      // Shard -> Partial and Partial(sum) <-> Partial(avg) keep the global value.
      for (int64_t d : {0, 1}) {
        const fsdp::DTensor shard = fsdp::distribute_tensor(full, mesh, {Placement::Shard(d)});
        for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG}) {
          const fsdp::DTensor p = shard.redistribute({Placement::Partial(op)});
          BOOST_TEST(at::equal(p.full_tensor(), full));
          const ReduceOp other = op == ReduceOp::SUM ? ReduceOp::AVG : ReduceOp::SUM;
          BOOST_TEST(at::equal(p.redistribute({Placement::Partial(other)}).full_tensor(), full));
        }
      }
    }
  }
  if (world() >= 4 && world() % 2 == 0) {
    const Shape mesh_shape{2, world() / 2};
    const fsdp::DeviceMesh mesh2 =
        fsdp::init_device_mesh(c10::kCPU, mesh_shape, {"replicate", "shard"});
    const at::Tensor full = arange({7, 15});
    const fsdp::DTensor s = fsdp::distribute_tensor(
        full, mesh2, {Placement::Shard(0), Placement::Shard(1)});
    const fsdp::DTensor p =
        s.redistribute({Placement::Partial(ReduceOp::SUM), Placement::Partial(ReduceOp::AVG)});
    BOOST_TEST(at::equal(p.full_tensor(), full));
    BOOST_TEST(at::equal(p.redistribute({Placement::Replicate(), Placement::Shard(0)}).to_local(),
                         expected_local(full, mesh_shape,
                                        {Placement::Replicate(), Placement::Shard(0)})));
  }
}

BOOST_AUTO_TEST_CASE(from_local_infers_uneven_shape) {
  const fsdp::DeviceMesh mesh = fsdp::init_device_mesh(c10::kCPU, {world()});
  const int64_t n = 2 * world() - 1;  // chunk 2: the last rank holds 1 row
  const at::Tensor full = arange({n, 3});
  const fsdp::DTensor rows = fsdp::DTensor::from_local(owned(full, 0, world(), spmd::rank()),
                                                       mesh, {Placement::Shard(0)});
  BOOST_TEST(rows.shape() == Shape({n, 3}));
  BOOST_TEST(at::equal(rows.full_tensor(), full));

  const at::Tensor wide = arange({3, n});
  const fsdp::DTensor cols = fsdp::DTensor::from_local(owned(wide, 1, world(), spmd::rank()),
                                                       mesh, {Placement::Shard(-1)});
  BOOST_TEST((cols.placements()[0] == Placement::Shard(1)));
  BOOST_TEST(cols.shape() == Shape({3, n}));
  BOOST_TEST(at::equal(cols.full_tensor(), wide));
}

BOOST_AUTO_TEST_CASE(from_local_rejects_misfit_on_every_rank) {
  const fsdp::DeviceMesh mesh = fsdp::init_device_mesh(c10::kCPU, {world()});
  const bool last = spmd::rank() == world() - 1;
  // Misfits between ranks need two of them; a lone rank's piece always fits.
  if (world() > 1) {
    // 1, ..., 1, 3 rows: no ceil-div layout of w + 2 rows looks like that.
    check_throws<fsdp::ShapeError>(
        [&] {
          fsdp::DTensor::from_local(at::zeros({last ? 3 : 1, 4}), mesh, {Placement::Shard(0)});
        },
        "local");
    // Unsharded dims must agree.
    check_throws<fsdp::ShapeError>(
        [&] {
          fsdp::DTensor::from_local(at::zeros({2, spmd::rank() == 0 ? 5 : 6}), mesh,
                                    {Placement::Shard(0)});
        },
        "local");
    // Replicas must agree.
    check_throws<fsdp::ShapeError>(
        [&] {
          fsdp::DTensor::from_local(at::zeros({4, last ? 4 : 5}), mesh, {Placement::Replicate()});
        },
        "local");
  }
  // An explicit shape the pieces do not fit, and a shape of the wrong rank.
  check_throws<fsdp::ShapeError>(
      [&] {
        fsdp::DTensor::from_local(at::zeros({1, 4}), mesh, {Placement::Shard(0)}, Shape{100, 4});
      },
      "local");
  check_throws<fsdp::ShapeError>(
      [&] { fsdp::DTensor::from_local(at::zeros({1, 4}), mesh, {Placement::Shard(0)}, Shape{4}); },
      "shape");

  if (world() >= 4 && world() % 2 == 0) {
    const fsdp::DeviceMesh mesh2 =
        fsdp::init_device_mesh(c10::kCPU, {2, world() / 2}, {"replicate", "shard"});
    // Only the last rank's group sees the misfit; the others must still throw.
    check_throws<fsdp::ShapeError>(
        [&] {
          fsdp::DTensor::from_local(at::zeros({last ? 3 : 2, 4}), mesh2,
                                    {Placement::Replicate(), Placement::Shard(0)});
        },
        "local");
    check_throws<fsdp::ShapeError>(
        [&] {
          fsdp::DTensor::from_local(at::zeros({2, last ? 3 : 4}), mesh2,
                                    {Placement::Shard(0), Placement::Replicate()});
        },
        "local");
  }

  // Every rank left from_local at the same point: a following collective
  // lines up and a valid from_local still works.
  const fsdp::DTensor ok = fsdp::DTensor::from_local(at::ones({2, 4}), mesh, {Placement::Shard(0)});
  BOOST_TEST(ok.shape() == Shape({2 * world(), 4}));
  at::Tensor t = at::ones({1}, at::kFloat);
  mesh.get_group(0)->all_reduce(t);
  BOOST_TEST(t.item<float>() == static_cast<float>(world()));
}

BOOST_AUTO_TEST_CASE(placement_argument_errors) {
  const fsdp::DeviceMesh mesh = fsdp::init_device_mesh(c10::kCPU, {world()});
  const at::Tensor local = at::zeros({2, 3});
  check_throws<fsdp::ArgumentError>(
      [&] {
        fsdp::DTensor::from_local(local, mesh, {Placement::Shard(0), Placement::Replicate()});
      },
      "placements");
  check_throws<fsdp::ArgumentError>([&] { fsdp::DTensor::from_local(local, mesh, {}); },
                                    "placements");
  check_throws<fsdp::ArgumentError>(
      [&] { fsdp::DTensor::from_local(local, mesh, {Placement::Shard(2)}); }, "placements");
  check_throws<fsdp::ArgumentError>(
      [&] { fsdp::DTensor::from_local(local, mesh, {Placement::Shard(-3)}); }, "placements");
  check_throws<fsdp::ArgumentError>(
      [&] { fsdp::distribute_tensor(local, mesh, {Placement::Shard(2)}); }, "placements");
  check_throws<fsdp::ArgumentError>(
      [&] { fsdp::distribute_tensor(local, mesh, {Placement::Shard(0), Placement::Shard(1)}); },
      "placements");

  const fsdp::DTensor dt = fsdp::distribute_tensor(local, mesh, {Placement::Replicate()});
  check_throws<fsdp::ArgumentError>(
      [&] { dt.redistribute({Placement::Shard(0), Placement::Shard(1)}); }, "placements");
  check_throws<fsdp::ArgumentError>([&] { dt.redistribute({Placement::Shard(5)}); },
                                    "placements");
  check_throws<fsdp::ArgumentError>([&] { fsdp::DTensor::from_local(at::Tensor(), mesh,
                                                                    {Placement::Replicate()}); },
                                    "local");
}

BOOST_AUTO_TEST_CASE(undefined_dtensor_is_rejected) {
  const fsdp::DTensor empty;
  BOOST_TEST(!empty.defined());
  BOOST_TEST(empty.numel() == 0);
  BOOST_CHECK_THROW(empty.device_mesh(), fsdp::StateError);
  BOOST_CHECK_THROW(empty.full_tensor(), fsdp::StateError);
  BOOST_CHECK_THROW(empty.redistribute({fsdp::Placement::Replicate()}), fsdp::StateError);
}
