// L0: DeviceMesh layouts (4,), (2,2), (1,4), (2,1,2) at np 4 -- coordinates,
// per-dim groups, sub-meshes and flatten, each group proven by a real
// all_reduce over exactly the expected members.
#include "spmd.h"

#include <fsdp/errors.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>

#include <vector>

namespace {

// Sum of (world rank + 1) over `members`, computed by an all_reduce on the
// group: equals the hand-computed value only if the group holds exactly them.
void expect_group_members(const fsdp::ProcessGroupPtr& group, const std::vector<int>& members) {
  BOOST_TEST(group->world_ranks() == members, boost::test_tools::per_element());
  BOOST_TEST(group->size() == static_cast<int>(members.size()));
  int expected = 0;
  for (int r : members) expected += r + 1;
  auto t = at::full({1}, spmd::rank() + 1, at::kLong);
  group->all_reduce(t);
  BOOST_TEST(t.item<int64_t>() == expected);
}

void require_world(int n) {
  BOOST_TEST_REQUIRE(spmd::world_size() == n, "this case is written for " << n << " ranks");
}

}  // namespace

BOOST_AUTO_TEST_CASE(mesh_1d_4) {
  require_world(4);
  const int r = spmd::rank();
  auto mesh = fsdp::init_device_mesh(c10::kCPU, {4}, {"shard"});
  BOOST_TEST(mesh.ndim() == 1);
  BOOST_TEST(mesh.size() == 4);
  BOOST_TEST(mesh.size(0) == 4);
  BOOST_TEST(mesh.size("shard") == 4);
  BOOST_TEST(mesh.get_coordinate() == std::vector<int64_t>{r}, boost::test_tools::per_element());
  BOOST_TEST(mesh.get_local_rank("shard") == r);
  BOOST_TEST(mesh.get_rank() == r);
  BOOST_TEST(mesh.device_type() == c10::kCPU);
  expect_group_members(mesh.get_group("shard"), {0, 1, 2, 3});
  // The 1-D mesh's group is the world group (same members, cached once).
  BOOST_TEST(mesh.get_group(0).get() == fsdp::world_group().get());
  BOOST_TEST(mesh.get_group(0)->name() == "ranks[0,1,2,3]");
}

BOOST_AUTO_TEST_CASE(mesh_2d_2x2) {
  require_world(4);
  const int r = spmd::rank();
  auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
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

BOOST_AUTO_TEST_CASE(mesh_2d_1x4) {
  require_world(4);
  const int r = spmd::rank();
  auto mesh = fsdp::init_device_mesh(c10::kCPU, {1, 4}, {"replicate", "shard"});
  BOOST_TEST(mesh.get_coordinate() == (std::vector<int64_t>{0, r}), boost::test_tools::per_element());
  expect_group_members(mesh.get_group("replicate"), {r});
  expect_group_members(mesh.get_group("shard"), {0, 1, 2, 3});
  BOOST_TEST(mesh.size("replicate") == 1);
  BOOST_TEST(mesh["replicate"].world_ranks() == std::vector<int>{r}, boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(mesh_3d_2x1x2) {
  require_world(4);
  const int r = spmd::rank();
  auto mesh = fsdp::init_device_mesh(c10::kCPU, {2, 1, 2}, {"pp", "tp", "dp"});
  const int64_t a = r / 2, c = r % 2;
  BOOST_TEST(mesh.get_coordinate() == (std::vector<int64_t>{a, 0, c}),
             boost::test_tools::per_element());
  BOOST_TEST(mesh.ndim() == 3);
  expect_group_members(mesh.get_group("pp"), {static_cast<int>(c), static_cast<int>(c + 2)});
  expect_group_members(mesh.get_group("tp"), {r});
  expect_group_members(mesh.get_group("dp"), {static_cast<int>(2 * a), static_cast<int>(2 * a + 1)});

  auto pp_dp = mesh[{"pp", "dp"}];
  BOOST_TEST(pp_dp.shape() == (std::vector<int64_t>{2, 2}), boost::test_tools::per_element());
  BOOST_TEST(pp_dp.world_ranks() == (std::vector<int>{0, 1, 2, 3}), boost::test_tools::per_element());
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
  BOOST_TEST(mesh.to_string() == "DeviceMesh(cpu, shape=(2, 1, 2), names=(pp, tp, dp))");
}

BOOST_AUTO_TEST_CASE(mesh_default_names_and_cache) {
  require_world(4);
  auto a = fsdp::init_device_mesh(c10::kCPU, {2, 2});
  BOOST_TEST(a.dim_names() == (std::vector<std::string>{"dim0", "dim1"}),
             boost::test_tools::per_element());
  // A second mesh with the same layout reuses the cached communicators.
  auto b = fsdp::init_device_mesh(c10::kCPU, {2, 2}, {"x", "y"});
  BOOST_TEST(a.get_group(0).get() == b.get_group("x").get());
  BOOST_TEST(a.get_group(1).get() == b.get_group("y").get());
}
