// L0 [ours]: StridedShard ("FSDP inside a TP shard of the same dim") with
// Shard(0), Shard(1) and Replicate on every 1-, 2- and 3-D mesh of the world
// size: placement basics, ownership, layout round trips, redistribution,
// FSDP's collectives, argument errors and fused pieces. Expected values are
// built here, never from the library under test. Part of the test_dtensor executable (np 1, 2, 4;
// gpu1, gpu2, gpu4).
#include "dtensor_util.h"
#include "tensor_diff.h"

// ---- StridedShard -------------------------------------------------------

namespace {

// A layout and, written by hand from the StridedShard rule (a strided mesh
// dim splits inside the pieces of the dims to its right that split the same
// tensor dim), the order in which its splits are applied: (mesh dim, tensor
// dim), outermost first. expected_pieces() follows these steps with the
// hand-written ceil-div rows (toy::ceil_div_rows); the library's own order is never consulted.
struct Layout {
  Placements placements;
  std::vector<std::pair<int, int64_t>> steps;
};

at::Tensor expected_piece(const at::Tensor& full, const Shape& mesh_shape, const Layout& l) {
  const Shape c = coordinate(mesh_shape);
  at::Tensor t = full;
  for (const auto& [mesh_dim, tensor_dim] : l.steps) {
    const size_t i = static_cast<size_t>(mesh_dim);
    t = toy::ceil_div_rows(t, tensor_dim, mesh_shape[i], c[i]);
  }
  return t;
}

Placement SS(int64_t dim, int64_t sf) { return Placement::StridedShard(dim, sf); }

std::vector<Layout> strided_layouts(const Shape& s) {
  const Placement r = Placement::Replicate();
  const Placement s0 = Placement::Shard(0);
  const Placement s1 = Placement::Shard(1);
  if (s.size() == 1) {
    return {{{s0}, {{0, 0}}}, {{s1}, {{0, 1}}}, {{r}, {}}, {{SS(0, 1)}, {{0, 0}}}};
  }
  if (s.size() == 2) {
    return {
        {{r, s0}, {{1, 0}}},
        {{s1, r}, {{0, 1}}},
        {{s0, s1}, {{0, 0}, {1, 1}}},
        {{s0, s0}, {{0, 0}, {1, 0}}},
        {{r, r}, {}},
        {{SS(0, s[1]), s0}, {{1, 0}, {0, 0}}},  // FSDP over a colwise TP weight
        {{SS(1, s[1]), s1}, {{1, 1}, {0, 1}}},
        {{SS(0, 1), s1}, {{0, 0}, {1, 1}}},     // nothing inside: a plain split
        {{s0, SS(0, 1)}, {{0, 0}, {1, 0}}},
    };
  }
  return {
      {{r, r, s0}, {{2, 0}}},
      {{s0, s1, r}, {{0, 0}, {1, 1}}},
      {{s0, s0, s0}, {{0, 0}, {1, 0}, {2, 0}}},
      {{s1, r, s0}, {{0, 1}, {2, 0}}},
      {{SS(0, s[2]), r, s0}, {{2, 0}, {0, 0}}},
      {{r, SS(0, s[2]), s0}, {{2, 0}, {1, 0}}},  // HSDP over TP
      {{SS(0, s[1] * s[2]), s0, s0}, {{1, 0}, {2, 0}, {0, 0}}},
      {{s0, SS(0, s[2]), s0}, {{0, 0}, {2, 0}, {1, 0}}},
      {{SS(0, s[1] * s[2]), SS(0, s[2]), s0}, {{2, 0}, {1, 0}, {0, 0}}},
      {{SS(0, s[2]), s1, s0}, {{2, 0}, {0, 0}, {1, 1}}},
      {{SS(0, s[1]), s0, s1}, {{1, 0}, {0, 0}, {2, 1}}},
  };
}

// Every mesh of 1, 2 and 3 dims whose shape multiplies to the world size.
std::vector<Mesh> all_meshes() {
  std::vector<Shape> shapes{{world()}};
  for (int64_t x = 1; x <= world(); ++x) {
    if (world() % x != 0) continue;
    shapes.push_back({x, world() / x});
    for (int64_t y = 1; y <= world() / x; ++y) {
      if ((world() / x) % y == 0) shapes.push_back({x, y, world() / x / y});
    }
  }
  std::vector<Mesh> out;
  for (const Shape& shape : shapes) {
    out.push_back({mesh_of(shape), shape});
  }
  return out;
}

// Uneven (7 rows over 2 and 4 ranks), fewer rows than ranks (3 over 4),
// even, and empty.
const std::vector<Shape> kStridedShapes{{7, 6}, {3, 5}, {8, 3}, {0, 2}};

// Values that differ in their low mantissa bits, so a bitwise comparison
// catches any rounding or misplaced row.
at::Tensor values(const Shape& shape) { return arange(shape) * 1.0009765625 + 0.3; }

// The bytes are compared on the host (CPU tensors are not copied).
bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  if (a.numel() == 0) return true;
  const at::Tensor x = a.contiguous().cpu(), y = b.contiguous().cpu();
  return std::memcmp(x.data_ptr(), y.data_ptr(), static_cast<size_t>(x.nbytes())) == 0;
}

}  // namespace

BOOST_AUTO_TEST_CASE(strided_shard_placement_basics) {  // [ours]
  const Placement p = Placement::StridedShard(0, 2);
  BOOST_TEST(p.to_string() == "StridedShard(0, sf=2)");
  BOOST_TEST(Placement::StridedShard(1, 4).to_string() == "StridedShard(1, sf=4)");
  BOOST_TEST(p.is_strided_shard());
  BOOST_TEST(!p.is_shard());  // not a plain Shard: fully_shard's chunking must not take it
  BOOST_TEST(!p.is_shard(0));
  BOOST_TEST(!p.is_replicate());
  BOOST_TEST(!p.is_partial());
  BOOST_TEST((p.kind() == Placement::Kind::StridedShard));
  BOOST_TEST(p.dim() == 0);
  BOOST_TEST(p.split_factor() == 2);
  BOOST_TEST(Placement::Shard(0).split_factor() == 1);
  BOOST_TEST(!Placement::Shard(0).is_strided_shard());
  BOOST_TEST((p == Placement::StridedShard(0, 2)));
  BOOST_TEST((p != Placement::StridedShard(0, 1)));
  BOOST_TEST((p != Placement::StridedShard(1, 2)));
  BOOST_TEST((p != Placement::Shard(0)));
  BOOST_TEST((Placement::Shard(0) != Placement::StridedShard(0, 1)));
  check_throws<fsdp::ArgumentError>([] { Placement::StridedShard(0, 0); }, "split_factor");
  check_throws<fsdp::ArgumentError>([] { Placement::StridedShard(0, -2); }, "split_factor");
}

// The exact ownership of PyTorch's "[0,1|4,5],[2,3|6,7]" at np 4 on (dp, tp)
// = (2, 2) with [StridedShard(0, sf=2), Shard(0)], and its uneven cousins.
// Row ranges per world rank r = (dp = r / 2, tp = r % 2), worked out by hand:
// tp piece j = ceil-div of n over 2, then dp part i = ceil-div of that piece.
BOOST_AUTO_TEST_CASE(strided_shard_ownership_np4,  // [ours]
                     *spmd::needs_world_size(4, "the hand-written ownership tables are for 4 ranks")) {
  const fsdp::DeviceMesh mesh = mesh_of({2, 2}, {"dp", "tp"});
  const Placements strided{SS(0, 2), Placement::Shard(0)};
  struct Row {
    int64_t n;
    std::pair<int64_t, int64_t> rows[4];  // [begin, end) per world rank
  };
  const std::vector<Row> table{
      {8, {{0, 2}, {4, 6}, {2, 4}, {6, 8}}},  // dp 0 holds [0,1|4,5], dp 1 [2,3|6,7]
      {7, {{0, 2}, {4, 6}, {2, 4}, {6, 7}}},  // tp pieces 4 + 3 rows
      {6, {{0, 2}, {3, 5}, {2, 3}, {5, 6}}},  // tp pieces 3 + 3
      {3, {{0, 1}, {2, 3}, {1, 2}, {3, 3}}},  // tp pieces 2 + 1: rank 3 owns nothing
  };
  const int r = spmd::rank();
  for (const Row& row : table) {
    BOOST_TEST_CONTEXT("n=" << row.n) {
      const at::Tensor full = values({row.n, 3});
      const auto [begin, end] = row.rows[r];
      const at::Tensor want = full.narrow(0, begin, end - begin);
      const fsdp::DTensor dt = fsdp::distribute_tensor(full, mesh, strided);
      BOOST_TEST(bitwise_equal(dt.to_local(), want));
      BOOST_TEST(bitwise_equal(dt.full_tensor(), full));
      // "FSDP inside the TP shard": the dp part of this rank's TP-local rows.
      const at::Tensor tp_local =
          fsdp::distribute_tensor(full, mesh, {Placement::Replicate(), Placement::Shard(0)})
              .to_local();
      BOOST_TEST(bitwise_equal(dt.to_local(), toy::ceil_div_rows(tp_local, 0, 2, r / 2)));
      // Inferred shape from these pieces alone.
      const fsdp::DTensor inferred = fsdp::DTensor::from_local(want.clone(), mesh, strided);
      BOOST_TEST(inferred.shape() == Shape({row.n, 3}));
      BOOST_TEST(bitwise_equal(inferred.full_tensor(), full));
    }
  }
  // The plain nested layout differs: [Shard(0), Shard(0)] gives rank 1 rows
  // 2-3, the strided one rows 4-5.
  const at::Tensor full = values({8, 3});
  const fsdp::DTensor plain =
      fsdp::distribute_tensor(full, mesh, {Placement::Shard(0), Placement::Shard(0)});
  const int64_t plain_begin[] = {0, 2, 4, 6};
  BOOST_TEST(bitwise_equal(plain.to_local(), full.narrow(0, plain_begin[r], 2)));

  // Local sizes 2, 2, 1, 1 (by world rank) fit 6 rows strided (table above)
  // but no plain nested layout: inference follows the strided nesting.
  const int64_t sizes[] = {2, 2, 1, 1};
  const at::Tensor mine = at::zeros({sizes[r], 3}, on_device());
  const fsdp::DTensor six = fsdp::DTensor::from_local(mine, mesh, strided);
  BOOST_TEST(six.shape() == Shape({6, 3}));
  check_throws<fsdp::ShapeError>(
      [&] {
        fsdp::DTensor::from_local(mine, mesh, {Placement::Shard(0), Placement::Shard(0)});
      },
      "local");

  // Column version: [StridedShard(1, 2), Shard(1)] on a (2, 8) tensor.
  const at::Tensor wide = values({2, 8});
  const fsdp::DTensor cols = fsdp::distribute_tensor(wide, mesh, {SS(1, 2), Placement::Shard(1)});
  const int64_t strided_begin[] = {0, 4, 2, 6};
  BOOST_TEST(bitwise_equal(cols.to_local(), wide.narrow(1, strided_begin[r], 2)));
  BOOST_TEST(bitwise_equal(cols.full_tensor(), wide));
}

// distribute_tensor -> full_tensor, from_local (given and inferred shape)
// and Replicate <-> layout on every 1-, 2- and 3-D mesh of this world size.
BOOST_AUTO_TEST_CASE(strided_layout_round_trips) {  // [ours]
  for (const Mesh& m : all_meshes()) {
    const Placements replicated(m.shape.size(), Placement::Replicate());
    for (const Layout& l : strided_layouts(m.shape)) {
      for (const Shape& shape : kStridedShapes) {
        BOOST_TEST_CONTEXT("mesh " << str(m.shape) << " " << str(l.placements) << "shape "
                                   << str(shape)) {
          const at::Tensor full = values(shape);
          const at::Tensor want = expected_piece(full, m.shape, l);

          const fsdp::DTensor dt = fsdp::distribute_tensor(full, m.mesh, l.placements);
          BOOST_TEST((dt.placements() == l.placements));
          BOOST_TEST(dt.shape() == shape);
          BOOST_TEST(bitwise_equal(dt.to_local(), want));
          BOOST_TEST(!dt.to_local().is_alias_of(full));
          BOOST_TEST(bitwise_equal(dt.full_tensor(), full));

          const at::Tensor local = want.clone();
          const fsdp::DTensor given = fsdp::DTensor::from_local(local, m.mesh, l.placements, shape);
          BOOST_TEST(given.to_local().is_same(local));
          BOOST_TEST(bitwise_equal(given.full_tensor(), full));
          const fsdp::DTensor inferred = fsdp::DTensor::from_local(local, m.mesh, l.placements);
          BOOST_TEST(inferred.shape() == shape);
          BOOST_TEST(bitwise_equal(inferred.full_tensor(), full));

          const fsdp::DTensor rep = fsdp::DTensor::from_local(full, m.mesh, replicated, shape);
          fsdp::reset_collective_counters();
          const fsdp::DTensor split = rep.redistribute(l.placements);
          BOOST_TEST(collectives_issued() == 0);  // Replicate -> split is local
          BOOST_TEST(bitwise_equal(split.to_local(), want));
          const fsdp::DTensor back = given.redistribute(replicated);
          BOOST_TEST(bitwise_equal(back.to_local(), full));
          BOOST_TEST((back.placements() == replicated));
        }
      }
    }
  }
}

// Every ordered pair of layouts on the 2-D meshes and on the 3-D meshes
// with at least two dims > 1 (or the only 3-D meshes there are).
BOOST_AUTO_TEST_CASE(strided_redistribute_between_layouts) {  // [ours]
  for (const Mesh& m : all_meshes()) {
    if (m.shape.size() == 1) continue;
    const int64_t big =
        std::count_if(m.shape.begin(), m.shape.end(), [](int64_t x) { return x > 1; });
    if (m.shape.size() == 3 && world() >= 4 && big < 2) continue;
    const std::vector<Layout> ls = strided_layouts(m.shape);
    for (const Layout& from : ls) {
      for (const Layout& to : ls) {
        for (const Shape& shape : {Shape{7, 6}, Shape{3, 5}}) {
          BOOST_TEST_CONTEXT("mesh " << str(m.shape) << " " << str(from.placements) << "-> "
                                     << str(to.placements) << "shape " << str(shape)) {
            const at::Tensor full = values(shape);
            const fsdp::DTensor src = fsdp::DTensor::from_local(
                expected_piece(full, m.shape, from).clone(), m.mesh, from.placements, shape);
            const fsdp::DTensor dst = src.redistribute(to.placements);
            BOOST_TEST((dst.placements() == to.placements));
            BOOST_TEST(dst.shape() == shape);
            BOOST_TEST(bitwise_equal(dst.to_local(), expected_piece(full, m.shape, to)));
            BOOST_TEST(bitwise_equal(src.to_local(), expected_piece(full, m.shape, from)));
          }
        }
      }
    }
  }
}

// FSDP's two moves on (dp, tp) = (2, w/2): the strided shard all-gathers
// over dp alone back to the TP layout, and a dp-Partial TP-sharded gradient
// reduce-scatters over dp alone into the strided shard.
BOOST_AUTO_TEST_CASE(strided_shard_fsdp_collectives, *even_world_of_4_or_more("(2, w/2)")) {  // [ours]
  const Shape mesh_shape{2, world() / 2};
  const fsdp::DeviceMesh mesh = mesh_of(mesh_shape, {"dp", "tp"});
  const Shape c = coordinate(mesh_shape);
  const Layout strided{{SS(0, mesh_shape[1]), Placement::Shard(0)}, {{1, 0}, {0, 0}}};
  const Layout tp_only{{Placement::Replicate(), Placement::Shard(0)}, {{1, 0}}};
  for (const Shape& shape : {Shape{7, 6}, Shape{3, 5}, Shape{8, 3}}) {
    BOOST_TEST_CONTEXT("shape " << str(shape)) {
      const at::Tensor full = values(shape);
      const fsdp::DTensor sharded = fsdp::DTensor::from_local(
          expected_piece(full, mesh_shape, strided).clone(), mesh, strided.placements, shape);
      fsdp::reset_collective_counters();
      const fsdp::DTensor gathered = sharded.redistribute(tp_only.placements);
      auto counters = fsdp::collective_counters();
      BOOST_TEST(counters.sequence.size() == 1u);
      BOOST_TEST(counters.total("all_gather", mesh.get_group("dp")->name()) == 1);
      BOOST_TEST(bitwise_equal(gathered.to_local(), expected_piece(full, mesh_shape, tp_only)));

      for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG}) {
        BOOST_TEST_CONTEXT(fsdp::to_string(op)) {
          // dp replica a contributes contribution(a); exact in fp32.
          const at::Tensor want = op == ReduceOp::SUM
                                      ? contribution(shape, 0) + contribution(shape, 1)
                                      : (contribution(shape, 0) + contribution(shape, 1)) / 2;
          const at::Tensor mine =
              toy::ceil_div_rows(contribution(shape, c[0]), 0, mesh_shape[1], c[1]);
          const fsdp::DTensor grad = fsdp::DTensor::from_local(
              mine.clone(), mesh, {Placement::Partial(op), Placement::Shard(0)}, shape);
          fsdp::reset_collective_counters();
          const fsdp::DTensor reduced = grad.redistribute(strided.placements);
          counters = fsdp::collective_counters();
          BOOST_TEST(counters.sequence.size() == 1u);
          BOOST_TEST(counters.total("reduce_scatter", mesh.get_group("dp")->name()) == 1);
          BOOST_TEST(bitwise_equal(reduced.to_local(), expected_piece(want, mesh_shape, strided)));
          BOOST_TEST(bitwise_equal(reduced.full_tensor(), want));
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(strided_shard_argument_errors) {  // [ours]
  const fsdp::DeviceMesh mesh1 = mesh_of({world()});
  const at::Tensor t = at::zeros({4, 4}, on_device());
  // On a 1-D mesh nothing is to the right: sf counts fused pieces, which
  // must cut the dim evenly (4 rows do not make 3 pieces).
  check_throws<fsdp::ShapeError>(
      [&] { fsdp::distribute_tensor(t, mesh1, {SS(0, 3)}); }, "placements");
  check_throws<fsdp::ShapeError>(
      [&] { fsdp::DTensor::from_local(t, mesh1, {SS(0, 3)}, Shape{4, 4}); }, "placements");
  if (world() > 1) {
    // 4 rows per rank are not the fused share of 4 rows in all.
    check_throws<fsdp::ShapeError>(
        [&] { fsdp::DTensor::from_local(t, mesh1, {SS(0, 2)}, Shape{4, 4}); }, "local");
  }
  check_throws<fsdp::ArgumentError>(
      [&] { fsdp::distribute_tensor(t, mesh1, {SS(2, 1)}); }, "placements");
  check_throws<fsdp::ArgumentError>(
      [&] { fsdp::distribute_tensor(t, mesh1, {SS(-3, 1)}); }, "placements");
  const fsdp::DTensor rep = fsdp::distribute_tensor(t, mesh1, {Placement::Replicate()});
  check_throws<fsdp::ShapeError>([&] { rep.redistribute({SS(0, 3)}); }, "placements");
  // A negative dim is normalised like Shard's.
  const fsdp::DTensor neg = fsdp::distribute_tensor(t, mesh1, {SS(-1, 1)});
  BOOST_TEST((neg.placements()[0] == SS(1, 1)));

  if (world() >= 4 && world() % 2 == 0) {
    const fsdp::DeviceMesh mesh2 = mesh_of({2, world() / 2});
    const int64_t tp = world() / 2;
    // sf must be the size of the dims to the right that shard the same dim.
    check_throws<fsdp::ArgumentError>(
        [&] { fsdp::distribute_tensor(t, mesh2, {SS(0, tp + 1), Placement::Shard(0)}); },
        "placements");
    // The dim to the right shards dim 1, not 0: nothing is inside, so sf
    // counts fused pieces of dim 0 (3 do not cut 4 rows).
    check_throws<fsdp::ShapeError>(
        [&] { fsdp::distribute_tensor(t, mesh2, {SS(0, 3), Placement::Shard(1)}); },
        "placements");
    check_throws<fsdp::ShapeError>(
        [&] { fsdp::distribute_tensor(t, mesh2, {SS(0, 3), Placement::Replicate()}); },
        "placements");
    // Shard(-2) on the right is tensor dim 0 once normalised.
    const fsdp::DTensor ok =
        fsdp::distribute_tensor(t, mesh2, {SS(0, tp), Placement::Shard(-2)});
    BOOST_TEST((ok.placements()[1] == Placement::Shard(0)));
    // fully_shard's chunking takes only plain Shard: it sees no Shard here.
    BOOST_TEST(!ok.placements()[0].is_shard());
  }
  // Every rank left at the same point: a following collective lines up.
  at::Tensor one = at::ones({1}, on_device());
  mesh1.get_group(0)->all_reduce(one);
  BOOST_TEST(one.item<float>() == static_cast<float>(world()));
}

namespace {

// This rank's rows of a fused StridedShard(0, pieces) over `parts` ranks:
// the dim cut into `pieces` equal blocks, each split ceil-div, written by
// hand.
at::Tensor fused_rows(const at::Tensor& full, int64_t pieces, int64_t parts, int64_t index) {
  const int64_t m = full.size(0) / pieces;
  std::vector<at::Tensor> blocks;
  for (int64_t p = 0; p < pieces; ++p) {
    blocks.push_back(toy::ceil_div_rows(full.narrow(0, p * m, m), 0, parts, index));
  }
  return at::cat(blocks, 0);
}

}  // namespace

// A fused [q; k; v] weight sharded by heads: StridedShard(0, 3) with no dim
// to its right splitting dim 0 cuts the rows into 3 equal blocks and splits
// each; FSDP over it on (dp, tp) splits the TP-local rows further
// (StridedShard(0, tp) on dp).
BOOST_AUTO_TEST_CASE(strided_shard_fused_pieces) {  // [ours]
  const int64_t w = world();
  const fsdp::DeviceMesh line = mesh_of({w}, {"tp"});
  const Placements fused{Placement::StridedShard(0, 3)};
  for (const Shape& shape : {Shape{12, 2}, Shape{9, 3}, Shape{3, 4}, Shape{0, 2}}) {
    BOOST_TEST_CONTEXT("shape " << str(shape)) {
      const at::Tensor full = values(shape);
      const at::Tensor want = fused_rows(full, 3, w, spmd::rank());
      const fsdp::DTensor dt = fsdp::distribute_tensor(full, line, fused);
      BOOST_TEST(bitwise_equal(dt.to_local(), want));
      BOOST_TEST(bitwise_equal(dt.full_tensor(), full));
      const fsdp::DTensor inferred = fsdp::DTensor::from_local(want.clone(), line, fused);
      BOOST_TEST(inferred.shape() == shape);
      BOOST_TEST(bitwise_equal(inferred.full_tensor(), full));
      // Shard(0) <-> fused, and Partial -> fused is one reduce-scatter.
      const fsdp::DTensor rows = fsdp::distribute_tensor(full, line, {Placement::Shard(0)});
      BOOST_TEST(bitwise_equal(rows.redistribute(fused).to_local(), want));
      BOOST_TEST(bitwise_equal(dt.redistribute({Placement::Shard(0)}).to_local(),
                               rows.to_local()));
      const at::Tensor mine = full * static_cast<double>(spmd::rank() + 1);
      const fsdp::DTensor partial =
          fsdp::DTensor::from_local(mine, line, {Placement::Partial()}, shape);
      fsdp::reset_collective_counters();
      const at::Tensor reduced = partial.redistribute(fused).to_local();
      if (w > 1) BOOST_TEST(collectives_issued() == 1);
      const at::Tensor sum = full * static_cast<double>(w * (w + 1) / 2);
      BOOST_TEST(testkit::max_abs_diff(reduced, fused_rows(sum, 3, w, spmd::rank())) < 1e-4);
    }
  }
  check_throws<fsdp::ShapeError>(
      [&] { fsdp::distribute_tensor(values({10, 2}), line, fused); }, "placements");
  check_throws<fsdp::ShapeError>(
      [&] { fsdp::DTensor::from_local(at::zeros({2, 2}, on_device()), line, fused, Shape{10, 2}); },
      "placements");
  if (w < 4 || w % 2 != 0) return;
  const Shape mesh_shape{2, w / 2};
  const fsdp::DeviceMesh mesh = mesh_of(mesh_shape, {"dp", "tp"});
  const Shape c = coordinate(mesh_shape);
  const Placements fsdp_tp{Placement::StridedShard(0, mesh_shape[1]),
                           Placement::StridedShard(0, 3)};
  for (const Shape& shape : {Shape{24, 2}, Shape{18, 3}, Shape{6, 1}}) {
    BOOST_TEST_CONTEXT("(dp, tp) shape " << str(shape)) {
      const at::Tensor full = values(shape);
      const at::Tensor tp_local = fused_rows(full, 3, mesh_shape[1], c[1]);
      const at::Tensor want = toy::ceil_div_rows(tp_local, 0, 2, c[0]);
      const fsdp::DTensor dt = fsdp::distribute_tensor(full, mesh, fsdp_tp);
      BOOST_TEST(bitwise_equal(dt.to_local(), want));
      BOOST_TEST(bitwise_equal(dt.full_tensor(), full));
      const fsdp::DTensor inferred = fsdp::DTensor::from_local(want.clone(), mesh, fsdp_tp);
      BOOST_TEST(inferred.shape() == shape);
      // FSDP's all-gather over dp alone gives back the TP-local rows.
      const fsdp::DTensor tp_only =
          dt.redistribute({Placement::Replicate(), Placement::StridedShard(0, 3)});
      BOOST_TEST(bitwise_equal(tp_only.to_local(), tp_local));
    }
  }
}
