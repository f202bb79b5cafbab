// L0: DeviceMesh layouts (4,), (2,2), (1,4), (2,1,2) at np 4 -- coordinates,
// per-dim groups, sub-meshes and flatten, each group proven by a real
// all_reduce over exactly the expected members; unflatten views against
// init_device_mesh of the same shape, concatenate of slices, and the views'
// argument errors. Every mesh is built for the suite's device type and every
// group is proven with a tensor on the suite's device (spmd::device(): cuda
// on the gpu entry, so the all_reduces run over NCCL there; see mesh_of()).
#include "spmd.h"

#include <fsdp/errors.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>

#include <functional>
#include <string>
#include <vector>

namespace {

// The suite's device type, its name ("cpu" or "cuda": what the string
// overload of init_device_mesh takes and DeviceMesh::to_string prints), and
// a mesh of that type.
c10::DeviceType device_type() { return spmd::device().type(); }

std::string device_name() { return c10::DeviceTypeName(device_type(), /*lower_case=*/true); }

fsdp::DeviceMesh mesh_of(const std::vector<int64_t>& shape,
                         const std::vector<std::string>& names = {}) {
  return fsdp::init_device_mesh(device_type(), shape, names);
}

// Sum of (world rank + 1) over `members`, computed by an all_reduce on the
// group: equals the hand-computed value only if the group holds exactly them.
void expect_group_members(const fsdp::ProcessGroupPtr& group, const std::vector<int>& members) {
  BOOST_TEST(group->world_ranks() == members, boost::test_tools::per_element());
  BOOST_TEST(group->size() == static_cast<int>(members.size()));
  int expected = 0;
  for (int r : members) expected += r + 1;
  auto t = at::full({1}, spmd::rank() + 1, at::TensorOptions(at::kLong).device(spmd::device()));
  group->all_reduce(t);
  BOOST_TEST(t.item<int64_t>() == expected);
}

void require_world(int n) {
  BOOST_TEST_REQUIRE(spmd::world_size() == n, "this case is written for " << n << " ranks");
}

// `view` has the layout, coordinates and (cached, hence identical) groups
// of `ref`; each of view's groups is also proven by a real all_reduce over
// the members that mesh.h's row-major rule gives (computed here by hand
// from `ref_members`, one member list per dim).
void expect_same_mesh(const fsdp::DeviceMesh& view, const fsdp::DeviceMesh& ref,
                      const std::vector<std::vector<int>>& ref_members) {
  BOOST_TEST((view == ref));
  BOOST_TEST(view.ndim() == ref.ndim());
  BOOST_TEST(view.shape() == ref.shape(), boost::test_tools::per_element());
  BOOST_TEST(view.dim_names() == ref.dim_names(), boost::test_tools::per_element());
  BOOST_TEST(view.world_ranks() == ref.world_ranks(), boost::test_tools::per_element());
  BOOST_TEST(view.get_coordinate() == ref.get_coordinate(), boost::test_tools::per_element());
  BOOST_TEST(view.get_rank() == ref.get_rank());
  BOOST_TEST_REQUIRE(static_cast<int>(ref_members.size()) == view.ndim());
  for (int d = 0; d < view.ndim(); ++d) {
    BOOST_TEST_CONTEXT("dim " << d) {
      BOOST_TEST(view.get_group(d).get() == ref.get_group(d).get());
      expect_group_members(view.get_group(d), ref_members[static_cast<size_t>(d)]);
    }
  }
}

// Runs `f`, which must throw MeshError whose argument() and what() name
// `argument`.
void check_mesh_error(const std::function<void()>& f, const std::string& argument) {
  bool thrown = false;
  try {
    f();
  } catch (const fsdp::MeshError& e) {
    thrown = true;
    BOOST_TEST(e.argument() == argument);
    BOOST_CHECK_MESSAGE(std::string(e.what()).find("'" + argument + "'") != std::string::npos,
                        "message does not name '" << argument << "': " << e.what());
  }
  BOOST_CHECK_MESSAGE(thrown, "no MeshError naming '" << argument << "' was thrown");
}

}  // namespace

BOOST_AUTO_TEST_CASE(mesh_1d_4) {  // [ours]
  require_world(4);
  const int r = spmd::rank();
  auto mesh = mesh_of({4}, {"shard"});
  BOOST_TEST(mesh.ndim() == 1);
  BOOST_TEST(mesh.size() == 4);
  BOOST_TEST(mesh.size(0) == 4);
  BOOST_TEST(mesh.size("shard") == 4);
  BOOST_TEST(mesh.get_coordinate() == std::vector<int64_t>{r}, boost::test_tools::per_element());
  BOOST_TEST(mesh.get_local_rank("shard") == r);
  BOOST_TEST(mesh.get_rank() == r);
  BOOST_TEST(mesh.device_type() == device_type());
  expect_group_members(mesh.get_group("shard"), {0, 1, 2, 3});
  // The 1-D mesh's group is the world group (same members, cached once).
  BOOST_TEST(mesh.get_group(0).get() == fsdp::world_group().get());
  BOOST_TEST(mesh.get_group(0)->name() == "ranks[0,1,2,3]");
}

BOOST_AUTO_TEST_CASE(mesh_2d_2x2) {  // [ours]
  require_world(4);
  const int r = spmd::rank();
  auto mesh = fsdp::init_device_mesh(device_name(), {2, 2}, {"replicate", "shard"});
  const int64_t row = r / 2, col = r % 2;
  BOOST_TEST(mesh.get_coordinate() == (std::vector<int64_t>{row, col}),
             boost::test_tools::per_element());
  BOOST_TEST(mesh.get_local_rank("replicate") == row);
  BOOST_TEST(mesh.get_local_rank(1) == col);
  BOOST_TEST(mesh.shape() == (std::vector<int64_t>{2, 2}), boost::test_tools::per_element());
  // Row-major: shard groups are rows {0,1},{2,3}; replicate groups columns {0,2},{1,3}.
  const std::vector<int> shard_members = {static_cast<int>(2 * row), static_cast<int>(2 * row + 1)};
  const std::vector<int> rep_members = {static_cast<int>(col), static_cast<int>(col + 2)};
  expect_group_members(mesh.get_group("shard"), shard_members);
  expect_group_members(mesh.get_group("replicate"), rep_members);
  BOOST_TEST(mesh.get_group("shard")->rank() == col);
  BOOST_TEST(mesh.get_group("replicate")->rank() == row);

  auto shard = mesh["shard"];
  BOOST_TEST(shard.ndim() == 1);
  BOOST_TEST(shard.size() == 2);
  BOOST_TEST(shard.world_ranks() == shard_members, boost::test_tools::per_element());
  BOOST_TEST(shard.get_coordinate() == std::vector<int64_t>{col}, boost::test_tools::per_element());
  BOOST_TEST(shard.get_group(0).get() == mesh.get_group("shard").get());

  auto rep = mesh["replicate"];
  BOOST_TEST(rep.world_ranks() == rep_members, boost::test_tools::per_element());
  BOOST_TEST(rep.get_rank() == row);

  auto both = mesh[{"replicate", "shard"}];
  BOOST_TEST(both.ndim() == 2);
  BOOST_TEST(both.world_ranks() == (std::vector<int>{0, 1, 2, 3}), boost::test_tools::per_element());

  auto flat = mesh.flatten();
  BOOST_TEST(flat.ndim() == 1);
  BOOST_TEST(flat.dim_names() == std::vector<std::string>{"replicate_shard"},
             boost::test_tools::per_element());
  BOOST_TEST(flat.get_rank() == r);
  expect_group_members(flat.get_group(0), {0, 1, 2, 3});
  // Flattening the same ranks again reuses the cached communicator.
  BOOST_TEST(mesh.flatten("dp").get_group(0).get() == flat.get_group(0).get());
}

BOOST_AUTO_TEST_CASE(mesh_2d_1x4) {  // [ours]
  require_world(4);
  const int r = spmd::rank();
  auto mesh = mesh_of({1, 4}, {"replicate", "shard"});
  BOOST_TEST(mesh.get_coordinate() == (std::vector<int64_t>{0, r}), boost::test_tools::per_element());
  expect_group_members(mesh.get_group("replicate"), {r});
  expect_group_members(mesh.get_group("shard"), {0, 1, 2, 3});
  BOOST_TEST(mesh.size("replicate") == 1);
  BOOST_TEST(mesh["replicate"].world_ranks() == std::vector<int>{r}, boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(mesh_3d_2x1x2) {  // [ours]
  require_world(4);
  const int r = spmd::rank();
  auto mesh = mesh_of({2, 1, 2}, {"pp", "tp", "dp"});
  const int64_t a = r / 2, c = r % 2;
  BOOST_TEST(mesh.get_coordinate() == (std::vector<int64_t>{a, 0, c}),
             boost::test_tools::per_element());
  BOOST_TEST(mesh.ndim() == 3);
  expect_group_members(mesh.get_group("pp"), {static_cast<int>(c), static_cast<int>(c + 2)});
  expect_group_members(mesh.get_group("tp"), {r});
  expect_group_members(mesh.get_group("dp"), {static_cast<int>(2 * a), static_cast<int>(2 * a + 1)});

  auto pp_dp = mesh[{"pp", "dp"}];
  BOOST_TEST(pp_dp.shape() == (std::vector<int64_t>{2, 2}), boost::test_tools::per_element());
  BOOST_TEST(pp_dp.world_ranks() == (std::vector<int>{0, 1, 2, 3}),
             boost::test_tools::per_element());
  BOOST_TEST(pp_dp.get_coordinate() == (std::vector<int64_t>{a, c}), boost::test_tools::per_element());

  auto tp_dp = mesh[{"tp", "dp"}];
  const std::vector<int> tp_dp_members = {static_cast<int>(2 * a), static_cast<int>(2 * a + 1)};
  BOOST_TEST(tp_dp.world_ranks() == tp_dp_members, boost::test_tools::per_element());
  auto flat = tp_dp.flatten();
  BOOST_TEST(flat.dim_names() == std::vector<std::string>{"tp_dp"}, boost::test_tools::per_element());
  expect_group_members(flat.get_group(0), tp_dp_members);
  BOOST_TEST(flat.get_rank() == c);

  // Every rank ends with the same view of every mesh dim's size.
  BOOST_TEST(mesh.size("pp") == 2);
  BOOST_TEST(mesh.size("tp") == 1);
  BOOST_TEST(mesh.size("dp") == 2);
  BOOST_TEST(mesh.to_string() ==
             "DeviceMesh(" + device_name() + ", shape=(2, 1, 2), names=(pp, tp, dp))");
}

BOOST_AUTO_TEST_CASE(mesh_default_names_and_cache) {  // [ours]
  require_world(4);
  auto a = mesh_of({2, 2});
  BOOST_TEST(a.dim_names() == (std::vector<std::string>{"dim0", "dim1"}),
             boost::test_tools::per_element());
  // A second mesh with the same layout reuses the cached communicators.
  auto b = mesh_of({2, 2}, {"x", "y"});
  BOOST_TEST(a.get_group(0).get() == b.get_group("x").get());
  BOOST_TEST(a.get_group(1).get() == b.get_group("y").get());
}

// unflatten of the world mesh: every shape init_device_mesh accepts at np 4,
// compared with init_device_mesh of that shape. Members by hand, row-major.
BOOST_AUTO_TEST_CASE(mesh_unflatten_world_matches_init) {  // [ours]
  require_world(4);
  const int r = spmd::rank();
  const auto world = mesh_of({4}, {"world"});
  const std::vector<int> all = {0, 1, 2, 3};
  const int a = r / 2, b = r % 2;

  // (2, 2): rank r = (r / 2, r % 2).
  const auto u22 = world.unflatten(0, {2, 2}, {"dp", "tp"});
  BOOST_TEST(u22.get_coordinate() == (std::vector<int64_t>{a, b}),
             boost::test_tools::per_element());
  expect_same_mesh(u22, mesh_of({2, 2}, {"dp", "tp"}),
                   {{b, b + 2}, {2 * a, 2 * a + 1}});
  // The other dims of the source keep their groups: here the "tp" slice of
  // the view is the same group a (2, 2) init mesh has.
  BOOST_TEST(u22["tp"].world_ranks() == (std::vector<int>{2 * a, 2 * a + 1}),
             boost::test_tools::per_element());

  // (2, 1, 2) by name.
  const auto u212 = world.unflatten("world", {2, 1, 2}, {"pp", "tp", "dp"});
  BOOST_TEST(u212.get_coordinate() == (std::vector<int64_t>{a, 0, b}),
             boost::test_tools::per_element());
  expect_same_mesh(u212, mesh_of({2, 1, 2}, {"pp", "tp", "dp"}),
                   {{b, b + 2}, {r}, {2 * a, 2 * a + 1}});

  // (1, 4) and (4, 1): a size-1 dim's group is {r}, the other is the world.
  expect_same_mesh(world.unflatten(0, {1, 4}, {"x", "y"}),
                   mesh_of({1, 4}, {"x", "y"}), {{r}, all});
  expect_same_mesh(world.unflatten(0, {4, 1}, {"x", "y"}),
                   mesh_of({4, 1}, {"x", "y"}), {all, {r}});

  // One size: a rename over the same group, no new communicator.
  const auto renamed = world.unflatten(0, {4}, {"dp"});
  expect_same_mesh(renamed, mesh_of({4}, {"dp"}), {all});
  BOOST_TEST(renamed.get_group(0).get() == world.get_group(0).get());
  BOOST_TEST(renamed.dim_names() == std::vector<std::string>{"dp"},
             boost::test_tools::per_element());
  // The world mesh itself is unchanged.
  BOOST_TEST(world.shape() == std::vector<int64_t>{4}, boost::test_tools::per_element());
  BOOST_TEST(world.dim_names() == std::vector<std::string>{"world"},
             boost::test_tools::per_element());
}

// unflatten of one dim of a 2-D and a 3-D mesh, and of a slice.
BOOST_AUTO_TEST_CASE(mesh_unflatten_inner_dim_and_slice) {  // [ours]
  require_world(4);
  const int r = spmd::rank();
  const int a = r / 2, b = r % 2;
  const auto m = mesh_of({2, 2}, {"rep", "shard"});

  // (2, 2) -> (1, 2, 2): the new leading dim of size 1.
  expect_same_mesh(m.unflatten(0, {1, 2}, {"pp", "dp"}),
                   mesh_of({1, 2, 2}, {"pp", "dp", "shard"}),
                   {{r}, {b, b + 2}, {2 * a, 2 * a + 1}});
  // (2, 2) -> (2, 2, 1) by name; the replaced dim's own name may be reused.
  expect_same_mesh(m.unflatten("shard", {2, 1}, {"shard", "tp"}),
                   mesh_of({2, 2, 1}, {"rep", "shard", "tp"}),
                   {{b, b + 2}, {2 * a, 2 * a + 1}, {r}});

  // (2, 1, 2) with the middle dim split into (1, 1) -> (2, 1, 1, 2).
  const auto m3 = mesh_of({2, 1, 2}, {"pp", "tp", "dp"});
  expect_same_mesh(m3.unflatten("tp", {1, 1}, {"etp", "cp"}),
                   mesh_of({2, 1, 1, 2}, {"pp", "etp", "cp", "dp"}),
                   {{b, b + 2}, {r}, {r}, {2 * a, 2 * a + 1}});

  // A slice over ranks {2a, 2a+1} unflattened to (2, 1): each rank calls it
  // on its own slice, and the slices partition the world.
  const auto row = m["shard"];
  const auto v = row.unflatten(0, {2, 1}, {"p", "q"});
  BOOST_TEST(v.shape() == (std::vector<int64_t>{2, 1}), boost::test_tools::per_element());
  BOOST_TEST(v.world_ranks() == (std::vector<int>{2 * a, 2 * a + 1}),
             boost::test_tools::per_element());
  BOOST_TEST(v.get_coordinate() == (std::vector<int64_t>{b, 0}), boost::test_tools::per_element());
  BOOST_TEST(v.get_rank() == b);
  expect_group_members(v.get_group("p"), {2 * a, 2 * a + 1});
  expect_group_members(v.get_group("q"), {r});
  BOOST_TEST(v.get_group("p").get() == m.get_group("shard").get());
}

// torchtitan-style views of one world mesh at np 4 (../shared/PARALLELISM.md 6.1):
// dense (dp_replicate, fsdp, tp) = (1, 2, 2), sparse (efsdp, ep) = (1, 4)
// with efsdp = fsdp * tp / ep, and the loss view flatten(dp_replicate, fsdp).
BOOST_AUTO_TEST_CASE(mesh_unflatten_dense_and_sparse_views) {  // [ours]
  require_world(4);
  const int r = spmd::rank();
  const int a = r / 2, b = r % 2;
  const auto world = mesh_of({4}, {"world"});
  const auto dense = world.unflatten(0, {1, 2, 2}, {"dp_replicate", "fsdp", "tp"});
  const auto sparse = world.unflatten(0, {1, 4}, {"efsdp", "ep"});
  expect_group_members(dense.get_group("fsdp"), {b, b + 2});
  expect_group_members(dense.get_group("tp"), {2 * a, 2 * a + 1});
  expect_group_members(sparse.get_group("ep"), {0, 1, 2, 3});
  expect_group_members(sparse.get_group("efsdp"), {r});
  // Equal member lists built from two views share one communicator.
  BOOST_TEST(sparse.get_group("ep").get() == world.get_group(0).get());
  const auto fsdp_tp = dense[{"fsdp", "tp"}].flatten("dp");
  BOOST_TEST(fsdp_tp.get_group(0).get() == world.get_group(0).get());
  const auto loss = dense[{"dp_replicate", "fsdp"}].flatten();
  BOOST_TEST(loss.dim_names() == std::vector<std::string>{"dp_replicate_fsdp"},
             boost::test_tools::per_element());
  BOOST_TEST(loss.get_group(0).get() == dense.get_group("fsdp").get());
  // The views are roots of their own: their slices concatenate within a view.
  BOOST_TEST((fsdp::DeviceMesh::concatenate({dense["fsdp"], dense["tp"]}) ==
              dense[{"fsdp", "tp"}]));
  check_mesh_error([&] { fsdp::DeviceMesh::concatenate({dense["fsdp"], sparse["ep"]}); },
                   "meshes");
  check_mesh_error([&] { fsdp::DeviceMesh::concatenate({world, dense["tp"]}); }, "meshes");
}

// concatenate of slices gives back the source mesh or its slice; the dims
// come in the given order. Run on rank 0 alone first: were it collective,
// the other ranks would not join and the watchdog would fire.
BOOST_AUTO_TEST_CASE(mesh_concatenate_slices) {  // [ours]
  require_world(4);
  const int r = spmd::rank();
  const int a = r / 2, c = r % 2;
  const auto m = mesh_of({2, 1, 2}, {"pp", "tp", "dp"});
  using fsdp::DeviceMesh;
  if (r == 0) {
    BOOST_TEST((DeviceMesh::concatenate({m["pp"], m["dp"]}) == m[{"pp", "dp"}]));
    BOOST_TEST((DeviceMesh::concatenate({m["dp"], m["pp"]}).shape() ==
                std::vector<int64_t>{2, 2}));
  }
  fsdp::reset_collective_counters();
  const auto pp_dp = DeviceMesh::concatenate({m["pp"], m["dp"]});
  BOOST_TEST(fsdp::collective_counters().sequence.empty());
  BOOST_TEST((pp_dp == m[{"pp", "dp"}]));
  BOOST_TEST(pp_dp.world_ranks() == (std::vector<int>{0, 1, 2, 3}),
             boost::test_tools::per_element());
  BOOST_TEST(pp_dp.get_coordinate() == (std::vector<int64_t>{a, c}),
             boost::test_tools::per_element());
  BOOST_TEST(pp_dp.get_group("pp").get() == m.get_group("pp").get());
  BOOST_TEST(pp_dp.get_group("dp").get() == m.get_group("dp").get());
  expect_group_members(pp_dp.get_group("pp"), {c, c + 2});
  expect_group_members(pp_dp.get_group("dp"), {2 * a, 2 * a + 1});

  BOOST_TEST((DeviceMesh::concatenate({m["pp"], m["tp"], m["dp"]}) == m));
  BOOST_TEST((DeviceMesh::concatenate({m[{"pp", "tp"}], m["dp"]}) == m));
  BOOST_TEST((DeviceMesh::concatenate({m}) == m));
  BOOST_TEST((DeviceMesh::concatenate({m["tp"]}) == m["tp"]));
  // A slice of a slice remembers the root, not the intermediate slice.
  BOOST_TEST((DeviceMesh::concatenate({m["pp"], m[{"tp", "dp"}]["dp"]}) == m[{"pp", "dp"}]));
  // A slice of the result is again a slice of m.
  BOOST_TEST((DeviceMesh::concatenate({pp_dp["pp"], m["tp"]}) == m[{"pp", "tp"}]));

  // The given order: (dp, pp) is the transposed view, row-major over its own
  // dims: (dp, pp) = (0,0) -> 0, (0,1) -> 2, (1,0) -> 1, (1,1) -> 3.
  const auto dp_pp = DeviceMesh::concatenate({m["dp"], m["pp"]});
  BOOST_TEST(dp_pp.dim_names() == (std::vector<std::string>{"dp", "pp"}),
             boost::test_tools::per_element());
  BOOST_TEST(dp_pp.world_ranks() == (std::vector<int>{0, 2, 1, 3}),
             boost::test_tools::per_element());
  BOOST_TEST(dp_pp.get_coordinate() == (std::vector<int64_t>{c, a}),
             boost::test_tools::per_element());
  BOOST_TEST(dp_pp.get_rank() == 2 * c + a);
  BOOST_TEST(dp_pp.get_group("dp").get() == m.get_group("dp").get());
  BOOST_TEST((dp_pp != pp_dp));

  // Roots are compared by value: an equal mesh built again counts as the same.
  const auto again = mesh_of({2, 1, 2}, {"pp", "tp", "dp"});
  BOOST_TEST((again == m));
  BOOST_TEST((DeviceMesh::concatenate({m["pp"], again["dp"]}) == m[{"pp", "dp"}]));
  BOOST_TEST((mesh_of({2, 1, 2}, {"a", "b", "c"}) != m));
  BOOST_TEST((m["pp"] != m["dp"]));
}

BOOST_AUTO_TEST_CASE(mesh_view_argument_errors) {  // [ours]
  require_world(4);
  const auto m = mesh_of({2, 2}, {"rep", "shard"});
  using fsdp::DeviceMesh;
  // unflatten: every check runs before any collective, so all ranks throw.
  check_mesh_error([&] { m.unflatten(2, {2}, {"x"}); }, "dim");
  check_mesh_error([&] { m.unflatten(-1, {2}, {"x"}); }, "dim");
  check_mesh_error([&] { m.unflatten("nope", {2}, {"x"}); }, "dim");
  check_mesh_error([&] { m.unflatten(0, {}, {}); }, "sizes");
  check_mesh_error([&] { m.unflatten(0, {2, 2}, {"x", "y"}); }, "sizes");   // product 4 != 2
  check_mesh_error([&] { m.unflatten(0, {1}, {"x"}); }, "sizes");           // product 1 != 2
  check_mesh_error([&] { m.unflatten(0, {2, 0}, {"x", "y"}); }, "sizes");
  check_mesh_error([&] { m.unflatten(0, {-1, -2}, {"x", "y"}); }, "sizes");  // product 2, < 1
  check_mesh_error([&] { m.unflatten(0, {2, 1}, {"x"}); }, "names");
  check_mesh_error([&] { m.unflatten(0, {2, 1}, {"x", "y", "z"}); }, "names");
  check_mesh_error([&] { m.unflatten(0, {2, 1}, {"x", ""}); }, "names");
  check_mesh_error([&] { m.unflatten(0, {2, 1}, {"x", "x"}); }, "names");
  check_mesh_error([&] { m.unflatten(0, {2, 1}, {"x", "shard"}); }, "names");  // kept dim's name
  // concatenate.
  check_mesh_error([] { DeviceMesh::concatenate({}); }, "meshes");
  check_mesh_error([&] { DeviceMesh::concatenate({m["rep"], m["rep"]}); }, "meshes");
  check_mesh_error([&] { DeviceMesh::concatenate({m, m["shard"]}); }, "meshes");
  check_mesh_error([&] { DeviceMesh::concatenate({m["rep"], m.flatten()}); }, "meshes");
  const auto view = m.unflatten(1, {2, 1}, {"s", "t"});
  check_mesh_error([&] { DeviceMesh::concatenate({m["rep"], view["s"]}); }, "meshes");
  const auto other = mesh_of({2, 2}, {"x", "y"});
  check_mesh_error([&] { DeviceMesh::concatenate({m["rep"], other["y"]}); }, "meshes");
  // A failed call leaves the world usable: the next collective lines up.
  expect_group_members(m.get_group("shard"), {2 * (spmd::rank() / 2), 2 * (spmd::rank() / 2) + 1});
}
