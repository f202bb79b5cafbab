// L0 [ours]: DTensor (lite) -- ceil-div layout, distribute/from_local round
// trips, redistribution between every placement pair, and argument errors,
// on a 1-D mesh and (for even world sizes >= 4) a (replicate, shard) 2-D
// mesh. Expected values are built here from at::arange and a hand-written
// ceil-div split, never from the library under test. Part of the test_dtensor executable (np 1, 2,
// 4; gpu1, gpu2, gpu4).
//
// Every tensor lives on the suite's device and every mesh is built for it
// (spmd::device(): cuda on the gpu entries, where the redistributions run
// over NCCL; cpu on the cpu entries, over MPI), through on_device() and
// mesh_of() (common/dtensor_util.h).
#include "dtensor_util.h"

BOOST_AUTO_TEST_CASE(placement_basics) {  // [ours]
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

BOOST_AUTO_TEST_CASE(shard_extent_and_chunk) {  // [ours]
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

BOOST_AUTO_TEST_CASE(distribute_tensor_round_trip) {  // [ours]
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

BOOST_AUTO_TEST_CASE(from_local_round_trip) {  // [ours]
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
BOOST_AUTO_TEST_CASE(trailing_rank_owns_nothing) {  // [ours]
  const fsdp::DeviceMesh mesh = mesh_of({world()});
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

BOOST_AUTO_TEST_CASE(partial_to_replicate_and_shard) {  // [ours]
  const fsdp::DeviceMesh mesh = mesh_of({world()});
  const int64_t one_if_comm = world() > 1 ? 1 : 0;
  for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG}) {
    for (const Shape& shape : kShapes) {
      at::Tensor want = at::zeros(shape, on_device());
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

BOOST_AUTO_TEST_CASE(partial_on_2d_mesh, *even_world_of_4_or_more("a (2, w/2) mesh")) {  // [ours]
  const Shape mesh_shape{2, world() / 2};
  const fsdp::DeviceMesh mesh = mesh_of(mesh_shape, {"replicate", "shard"});
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
        const fsdp::DTensor a = fsdp::DTensor::from_local(
            toy::ceil_div_rows(piece, 0, mesh_shape[1], c[1]).clone(), mesh, sharded);
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

BOOST_AUTO_TEST_CASE(replicate_to_shard_without_communication) {  // [ours]
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
BOOST_AUTO_TEST_CASE(redistribute_between_layouts) {  // [ours]
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

BOOST_AUTO_TEST_CASE(replicate_partial_round_trip) {  // [ours]
  const fsdp::DeviceMesh mesh = mesh_of({world()});
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
    const fsdp::DeviceMesh mesh2 = mesh_of(mesh_shape, {"replicate", "shard"});
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

BOOST_AUTO_TEST_CASE(from_local_infers_uneven_shape) {  // [ours]
  const fsdp::DeviceMesh mesh = mesh_of({world()});
  const int64_t n = 2 * world() - 1;  // chunk 2: the last rank holds 1 row
  const at::Tensor full = arange({n, 3});
  const fsdp::DTensor rows = fsdp::DTensor::from_local(
      toy::ceil_div_rows(full, 0, world(), spmd::rank()), mesh, {Placement::Shard(0)});
  BOOST_TEST(rows.shape() == Shape({n, 3}));
  BOOST_TEST(at::equal(rows.full_tensor(), full));

  const at::Tensor wide = arange({3, n});
  const fsdp::DTensor cols = fsdp::DTensor::from_local(
      toy::ceil_div_rows(wide, 1, world(), spmd::rank()), mesh, {Placement::Shard(-1)});
  BOOST_TEST((cols.placements()[0] == Placement::Shard(1)));
  BOOST_TEST(cols.shape() == Shape({3, n}));
  BOOST_TEST(at::equal(cols.full_tensor(), wide));
}

BOOST_AUTO_TEST_CASE(from_local_rejects_misfit_on_every_rank) {  // [ours]
  const fsdp::DeviceMesh mesh = mesh_of({world()});
  const bool last = spmd::rank() == world() - 1;
  // Misfits between ranks need two of them; a lone rank's piece always fits.
  if (world() > 1) {
    // 1, ..., 1, 3 rows: no ceil-div layout of w + 2 rows looks like that.
    check_throws<fsdp::ShapeError>(
        [&] {
          fsdp::DTensor::from_local(at::zeros({last ? 3 : 1, 4}, on_device()), mesh,
                                    {Placement::Shard(0)});
        },
        "local");
    // Unsharded dims must agree.
    check_throws<fsdp::ShapeError>(
        [&] {
          fsdp::DTensor::from_local(at::zeros({2, spmd::rank() == 0 ? 5 : 6}, on_device()), mesh,
                                    {Placement::Shard(0)});
        },
        "local");
    // Replicas must agree.
    check_throws<fsdp::ShapeError>(
        [&] {
          fsdp::DTensor::from_local(at::zeros({4, last ? 4 : 5}, on_device()), mesh,
                                    {Placement::Replicate()});
        },
        "local");
  }
  // An explicit shape the pieces do not fit, and a shape of the wrong rank.
  check_throws<fsdp::ShapeError>(
      [&] {
        fsdp::DTensor::from_local(at::zeros({1, 4}, on_device()), mesh, {Placement::Shard(0)},
                                  Shape{100, 4});
      },
      "local");
  check_throws<fsdp::ShapeError>(
      [&] {
        fsdp::DTensor::from_local(at::zeros({1, 4}, on_device()), mesh, {Placement::Shard(0)},
                                  Shape{4});
      },
      "shape");

  if (world() >= 4 && world() % 2 == 0) {
    const fsdp::DeviceMesh mesh2 = mesh_of({2, world() / 2}, {"replicate", "shard"});
    // Only the last rank's group sees the misfit; the others must still throw.
    check_throws<fsdp::ShapeError>(
        [&] {
          fsdp::DTensor::from_local(at::zeros({last ? 3 : 2, 4}, on_device()), mesh2,
                                    {Placement::Replicate(), Placement::Shard(0)});
        },
        "local");
    check_throws<fsdp::ShapeError>(
        [&] {
          fsdp::DTensor::from_local(at::zeros({2, last ? 3 : 4}, on_device()), mesh2,
                                    {Placement::Shard(0), Placement::Replicate()});
        },
        "local");
  }

  // Every rank left from_local at the same point: a following collective
  // lines up and a valid from_local still works.
  const fsdp::DTensor ok =
      fsdp::DTensor::from_local(at::ones({2, 4}, on_device()), mesh, {Placement::Shard(0)});
  BOOST_TEST(ok.shape() == Shape({2 * world(), 4}));
  at::Tensor t = at::ones({1}, on_device());
  mesh.get_group(0)->all_reduce(t);
  BOOST_TEST(t.item<float>() == static_cast<float>(world()));
}

BOOST_AUTO_TEST_CASE(placement_argument_errors) {  // [ours]
  const fsdp::DeviceMesh mesh = mesh_of({world()});
  const at::Tensor local = at::zeros({2, 3}, on_device());
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

BOOST_AUTO_TEST_CASE(undefined_dtensor_is_rejected) {  // [ours]
  const fsdp::DTensor empty;
  BOOST_TEST(!empty.defined());
  BOOST_TEST(empty.numel() == 0);
  BOOST_CHECK_THROW(empty.device_mesh(), fsdp::StateError);
  BOOST_CHECK_THROW(empty.full_tensor(), fsdp::StateError);
  BOOST_CHECK_THROW(empty.redistribute({fsdp::Placement::Replicate()}), fsdp::StateError);
}
