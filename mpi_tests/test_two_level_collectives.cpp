// L0/multinode: the two_level CPU algorithm (fsdp::CpuAlgorithm::TwoLevel,
// docs/cpu_collectives.md#two-level-across-nodes) against references
// computed here from every rank's input.
//
// The node layout is learnt here on its own: MPI_Comm_split_type(SHARED) on
// a private duplicate of MPI_COMM_WORLD, every rank's node named by the
// lowest world rank on it. The inputs are exchanged with a raw MPI_Allgather
// on that duplicate, never through libfsdp. For a group that spans M >= 2
// nodes with the same n >= 2 ranks on each, the expected reduction of block
// r is the documented order, computed with plain ATen ops: on each node (in
// the order of the node's lowest group rank) the node's ranks in group-rank
// order, in the accumulation type (float32 for 16-bit types), then the node
// partials in node order, AVG dividing there, one final rounding. Results
// must equal it bitwise; they must also be within the flat algorithms'
// bound of the exact sum (so within twice that bound of pairwise), equal
// to pairwise bitwise for integers and MAX, and the same on a rerun and on
// every rank (all-reduce). All-gathers equal pairwise's bitwise.
//
// Without shared memory (FSDP_SHM_BYTES=0: the entry
// multinode_two_level_no_shm) the node step runs over MPI in the same
// order: the same expected bits.
// Everywhere else (one node, one rank per node) two_level must run the
// flat algorithm: pairwise's bits. Runs at np 4 on one node (mpiexec) and
// on the simulated cluster (mpi_tests/multinode.cmake): 2 nodes x 2 ranks
// node-major and round-robin (--map-by node: the group's rank order is
// not node-major), 3 nodes x 2 and 2 nodes x 4 (sub-mesh groups that span
// both nodes with 2 ranks on each).
#include "cpu_collectives_util.h"
#include "spmd.h"

#include <fsdp/comm.h>
#include <fsdp/errors.h>
#include <fsdp/mesh.h>

#include "comm/cpu_collectives.h"  // two_level_cross_node_bytes

#include <ATen/ATen.h>

#include <mpi.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace {

using cpu_coll::acc_of, cpu_coll::combine, cpu_coll::error_ratio, cpu_coll::flat_fold,
    cpu_coll::g_ref_comm, cpu_coll::gather_world, cpu_coll::group_rows, cpu_coll::input,
    cpu_coll::kAllTypes, cpu_coll::kBlocks, cpu_coll::KeepSettings, cpu_coll::use;
using fsdp::CpuAlgorithm;
using fsdp::ProcessGroupPtr;
using fsdp::ReduceOp;

std::vector<int> g_node_of;  // world rank -> lowest world rank on its node

// The reference communicator, and the node layout learnt on it.
struct ReferenceCommAndNodes : cpu_coll::ReferenceComm {
  ReferenceCommAndNodes() {
    MPI_Comm node = MPI_COMM_NULL;
    MPI_Comm_split_type(g_ref_comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int lowest = spmd::rank();
    MPI_Allreduce(MPI_IN_PLACE, &lowest, 1, MPI_INT, MPI_MIN, node);
    MPI_Comm_free(&node);
    g_node_of.resize(static_cast<size_t>(spmd::world_size()));
    MPI_Allgather(&lowest, 1, MPI_INT, g_node_of.data(), 1, MPI_INT, g_ref_comm);
  }
};
BOOST_TEST_GLOBAL_FIXTURE(ReferenceCommAndNodes);

// The group's nodes, each its group ranks in increasing order, the nodes in
// the order of their lowest group rank. Empty when two_level has no layout
// for the group (one node, or nodes with different or single rank counts).
std::vector<std::vector<int64_t>> nodes_of(const ProcessGroupPtr& g) {
  std::map<int, std::vector<int64_t>> by_node;  // node name -> group ranks
  std::vector<int> first_seen;
  for (int r = 0; r < g->size(); ++r) {
    const int node = g_node_of[static_cast<size_t>(g->world_ranks()[static_cast<size_t>(r)])];
    if (by_node.find(node) == by_node.end()) first_seen.push_back(node);
    by_node[node].push_back(r);
  }
  std::vector<std::vector<int64_t>> out;
  for (int node : first_seen) out.push_back(by_node[node]);
  if (out.size() < 2 || out[0].size() < 2) return {};
  for (const auto& ranks : out) {
    if (ranks.size() != out[0].size()) return {};
  }
  return out;
}

// rows [N, m] -> the documented two-level order (see the top of the file).
at::Tensor two_level_fold(const at::Tensor& rows, const std::vector<std::vector<int64_t>>& nodes,
                          ReduceOp op) {
  const auto at_t = acc_of(rows.scalar_type());
  at::Tensor total;
  for (const auto& ranks : nodes) {
    at::Tensor partial = rows[ranks[0]].to(at_t);
    for (size_t k = 1; k < ranks.size(); ++k) partial = combine(partial, rows[ranks[k]].to(at_t), op);
    total = total.defined() ? combine(total, partial, op) : partial;
  }
  if (op == ReduceOp::AVG) total = total / static_cast<double>(rows.size(0));
  return total.to(rows.scalar_type());
}

// The largest block only where two_level has a layout: elsewhere it runs
// pairwise, which test_cpu_collectives covers at every size, and 8 ranks
// on 2 cores would spend minutes on it.
std::vector<int64_t> blocks_for(const ProcessGroupPtr& g) {
  if (!nodes_of(g).empty()) return kBlocks;
  return {kBlocks.begin(), kBlocks.end() - 1};
}

// The world and every mesh group the world size allows: at 4 both dims of
// 2x2 (on 2x2 nodes: one rank per node, or one node); at 6 both dims of
// 3x2; at 8 the dims of 2x2x2 and two flattened 2-D sub-meshes (on 2 nodes
// x 4: groups of 4 ranks spanning both nodes with 2 on each).
std::vector<ProcessGroupPtr> groups() {
  const int n = spmd::world_size();
  std::vector<ProcessGroupPtr> out{fsdp::world_group()};
  if (n == 4) {
    auto mesh = fsdp::init_device_mesh(c10::kCPU, {2, 2}, {"a", "b"});
    out.push_back(mesh.get_group("a"));
    out.push_back(mesh.get_group("b"));
  } else if (n == 6) {
    auto mesh = fsdp::init_device_mesh(c10::kCPU, {3, 2}, {"a", "b"});
    out.push_back(mesh.get_group("a"));
    out.push_back(mesh.get_group("b"));
  } else if (n == 8) {
    auto mesh = fsdp::init_device_mesh(c10::kCPU, {2, 2, 2}, {"x", "y", "z"});
    out.push_back(mesh.get_group("x"));
    out.push_back(mesh.get_group("z"));
    out.push_back(mesh[{"x", "y"}].flatten().get_group(0));
    out.push_back(mesh[{"x", "z"}].flatten().get_group(0));
  }
  return out;
}

std::string what(const char* op, c10::ScalarType t, int64_t block, const ProcessGroupPtr& g,
                 ReduceOp r) {
  return std::string(op) + " " + c10::toString(t) + " block " + std::to_string(block) + " on " +
         g->name() + " op " + fsdp::to_string(r);
}

void check_reduce_scatter(const ProcessGroupPtr& g, c10::ScalarType t, int64_t block, ReduceOp op) {
  const int n = g->size();
  const auto nodes = nodes_of(g);
  const at::Tensor in = input(t, block * n, static_cast<int>(block));
  at::Tensor out = at::full({block}, 99, in.options());
  at::Tensor flat = at::full({block}, 99, in.options());
  use(CpuAlgorithm::TwoLevel);
  g->reduce_scatter_tensor(out, in, op);
  use(CpuAlgorithm::Pairwise);
  g->reduce_scatter_tensor(flat, in, op);
  const std::string label = what("reduce_scatter", t, block, g, op);
  const at::Tensor mine = group_rows(gather_world(in), g).view({n, n, block}).select(1, g->rank());
  const at::Tensor want = nodes.empty() ? flat_fold(mine, op) : two_level_fold(mine, nodes, op);
  BOOST_TEST(at::equal(out, want), label << ": not the documented order");
  BOOST_TEST(error_ratio(out, mine, op) <= 1.0, label << ": outside the flat bound");
  BOOST_TEST(at::equal(flat, flat_fold(mine, op)), label << ": pairwise reference");
  if (nodes.empty() || !at::isFloatingType(t) || op == ReduceOp::MAX) {
    BOOST_TEST(at::equal(out, flat), label << ": differs from pairwise");
  }
  at::Tensor again = at::empty_like(out);
  use(CpuAlgorithm::TwoLevel);
  g->reduce_scatter_tensor(again, in, op);
  BOOST_TEST(at::equal(out, again), label << ": rerun differs");
}

void check_all_gather(const ProcessGroupPtr& g, c10::ScalarType t, int64_t block, bool in_place) {
  const int n = g->size();
  const at::Tensor in = input(t, block, static_cast<int>(block));
  at::Tensor out = at::full({block * n}, 99, in.options());
  use(CpuAlgorithm::TwoLevel);
  if (in_place) {
    const at::Tensor mine = out.narrow(0, g->rank() * block, block);
    mine.copy_(in);
    g->all_gather_into_tensor(out, mine);
  } else {
    g->all_gather_into_tensor(out, in);
  }
  at::Tensor flat = at::full({block * n}, 99, in.options());
  use(CpuAlgorithm::Pairwise);
  g->all_gather_into_tensor(flat, in);
  const std::string label =
      what("all_gather", t, block, g, ReduceOp::SUM) + (in_place ? " in place" : "");
  BOOST_TEST(at::equal(out, group_rows(gather_world(in), g).reshape({-1})), label);
  BOOST_TEST(at::equal(out, flat), label << ": differs from pairwise");
}

void check_all_reduce(const ProcessGroupPtr& g, c10::ScalarType t, int64_t numel, ReduceOp op) {
  const int n = g->size();
  const auto nodes = nodes_of(g);
  const at::Tensor in = input(t, numel, static_cast<int>(numel) + 3);
  at::Tensor got = in.clone();
  use(CpuAlgorithm::TwoLevel);
  g->all_reduce(got, op);
  const std::string label = what("all_reduce", t, numel, g, op);
  const at::Tensor rows = group_rows(gather_world(in), g);
  BOOST_TEST(error_ratio(got, rows, op) <= 1.0, label << ": outside the flat bound");
  // Blocks of numel / n, the first numel % n one longer, each in the order.
  std::vector<at::Tensor> parts;
  int64_t at = 0;
  for (int b = 0; b < n; ++b) {
    const int64_t c = numel / n + (b < numel % n ? 1 : 0);
    const at::Tensor cols = rows.narrow(1, at, c);
    parts.push_back(nodes.empty() ? flat_fold(cols, op) : two_level_fold(cols, nodes, op));
    at += c;
  }
  BOOST_TEST(at::equal(got, at::cat(parts)), label << ": not the documented order");
  const at::Tensor everyone = group_rows(gather_world(got), g);
  BOOST_TEST(at::equal(everyone, got.unsqueeze(0).expand_as(everyone)), label << ": ranks differ");
}

}  // namespace

BOOST_AUTO_TEST_CASE(layout_seen_by_this_run) {  // [ours]
  // What the cases below exercise: say it, so a log of a one-node run is
  // not mistaken for a cross-node one.
  for (const auto& g : groups()) {
    const auto nodes = nodes_of(g);
    std::string text;
    for (const auto& ranks : nodes) {
      text += "[";
      for (int64_t r : ranks) text += std::to_string(r) + " ";
      text += "]";
    }
    BOOST_TEST_MESSAGE(g->name() << " (" << g->size() << " ranks): "
                                 << (nodes.empty() ? "flat (no two-level layout)"
                                                   : "nodes " + text));
  }
  if (std::getenv("FSDP_TEST_EXPECT_TWO_LEVEL") != nullptr) {
    BOOST_TEST(!nodes_of(fsdp::world_group()).empty(),
               "the multinode entry expects the world to span nodes evenly");
  } else {
    BOOST_TEST(nodes_of(fsdp::world_group()).empty(),
               "the one-node entry expects the world on one node");
  }
}

BOOST_AUTO_TEST_CASE(reduce_scatter_every_dtype_op_size_and_group) {  // [ours]
  KeepSettings keep;
  for (const auto& g : groups()) {
    for (auto t : kAllTypes) {
      for (int64_t block : blocks_for(g)) {
        for (auto op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX}) {
          if (op == ReduceOp::AVG && !at::isFloatingType(t)) continue;
          check_reduce_scatter(g, t, block, op);
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(all_gather_every_dtype_size_and_group) {  // [ours]
  KeepSettings keep;
  for (const auto& g : groups()) {
    for (auto t : kAllTypes) {
      for (int64_t block : blocks_for(g)) {
        check_all_gather(g, t, block, /*in_place=*/false);
        check_all_gather(g, t, block, /*in_place=*/true);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(all_reduce_every_dtype_op_and_uneven_size) {  // [ours]
  KeepSettings keep;
  for (const auto& g : groups()) {
    const int64_t n = g->size();
    for (auto t : kAllTypes) {
      std::vector<int64_t> sizes{1, n + 1, 1000 * n + 1};
      if (!nodes_of(g).empty()) sizes.push_back(140001 * n + n - 1);
      for (int64_t numel : sizes) {
        for (auto op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX}) {
          if (op == ReduceOp::AVG && !at::isFloatingType(t)) continue;
          check_all_reduce(g, t, numel, op);
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(max_propagates_nan) {  // [ours]
  KeepSettings keep;
  use(CpuAlgorithm::TwoLevel);
  for (const auto& g : groups()) {
    for (auto t : {at::kFloat, at::kBFloat16}) {
      at::Tensor x = at::zeros({8 * g->size()}, at::TensorOptions(t));
      if (g->rank() == g->size() - 1) x[3] = std::numeric_limits<double>::quiet_NaN();
      g->all_reduce(x, ReduceOp::MAX);
      BOOST_TEST(at::isnan(x[3]).item<bool>(), g->name() << " " << c10::toString(t));
      BOOST_TEST(x.narrow(0, 0, 3).eq(0).all().item<bool>());
    }
  }
}

// Auto picks two_level from two_level_min_bytes on a group that spans nodes
// evenly, and never on a group inside one node or with one rank per node.
// float32 sums of 4+ ranks tell the two orders apart (checked on the
// references first); with every other threshold 0, auto's only other choice
// there is pairwise.
BOOST_AUTO_TEST_CASE(auto_picks_two_level_across_nodes_only) {  // [ours]
  KeepSettings keep;
  const int64_t block = 5000;
  const int64_t bytes = block * 4;
  auto settings = [](int64_t two_level_from) {
    fsdp::CpuCollectives s{CpuAlgorithm::Auto, 0, 0, 0, 0};
    s.all_gather_shm_min_bytes = s.all_gather_shm_max_bytes = 0;
    s.reduce_scatter_shm_min_bytes = s.reduce_scatter_shm_max_bytes = 0;
    s.all_reduce_shm_min_bytes = s.all_reduce_shm_max_bytes = 0;
    s.two_level_min_bytes = two_level_from;
    return s;
  };
  for (const auto& g : groups()) {
    const int n = g->size();
    const auto nodes = nodes_of(g);
    const at::Tensor in = input(at::kFloat, block * n, 21);
    const at::Tensor mine =
        group_rows(gather_world(in), g).view({n, n, block}).select(1, g->rank());
    const at::Tensor flat = flat_fold(mine, ReduceOp::SUM);
    auto run = [&](int64_t from) {
      fsdp::set_cpu_collectives(settings(from));
      at::Tensor out = at::empty({block}, in.options());
      g->reduce_scatter_tensor(out, in, ReduceOp::SUM);
      return out;
    };
    const std::string where = " on " + g->name();
    BOOST_TEST(at::equal(run(bytes + 1), flat), "auto below two_level_min_bytes: pairwise" << where);
    if (nodes.empty()) {
      BOOST_TEST(at::equal(run(0), flat), "auto where two_level has no layout: pairwise" << where);
      continue;
    }
    const at::Tensor two = two_level_fold(mine, nodes, ReduceOp::SUM);
    // Every rank must agree on whether the inputs tell the orders apart.
    int differ = at::equal(two, flat) ? 0 : 1;
    MPI_Allreduce(MPI_IN_PLACE, &differ, 1, MPI_INT, MPI_MIN, g_ref_comm);
    BOOST_TEST_REQUIRE(differ == 1, "the inputs must tell the two orders apart" << where);
    BOOST_TEST(at::equal(run(bytes), two), "auto at two_level_min_bytes: two_level" << where);
  }
}

BOOST_AUTO_TEST_CASE(two_level_names_and_threshold) {  // [ours]
  BOOST_TEST(fsdp::to_string(fsdp::parse_cpu_algorithm("two_level", "x")) == "two_level");
  try {
    fsdp::parse_cpu_algorithm("twolevel", "FSDP_MPI_ALGO");
    BOOST_FAIL("an unknown algorithm name was accepted");
  } catch (const fsdp::ArgumentError& e) {
    BOOST_TEST(e.argument() == "FSDP_MPI_ALGO");
    BOOST_TEST(std::string(e.what()).find("shm, two_level") != std::string::npos, e.what());
  }
  KeepSettings keep;
  fsdp::CpuCollectives bad;
  bad.two_level_min_bytes = -1;
  try {
    fsdp::set_cpu_collectives(bad);
    BOOST_FAIL("a negative two_level_min_bytes was accepted");
  } catch (const fsdp::ArgumentError& e) {
    BOOST_TEST(e.argument() == "two_level_min_bytes");
  }
  BOOST_TEST(fsdp::to_string(fsdp::CpuCollectives{}).find("two_level from 32K") !=
             std::string::npos);
}

// What cross-node byte counters are to be fed: per rank, the rail messages
// only. Hand-computed for 3 nodes x 2 ranks, rank order not node-major.
BOOST_AUTO_TEST_CASE(cross_node_bytes_are_the_rail_messages) {  // [ours]
  namespace cpu = fsdp::detail::cpu;
  cpu::TwoLevel tl;
  tl.nodes = 3;
  tl.per_node = 2;
  tl.rank_of = {0, 3, 1, 4, 2, 5};  // node 0: ranks 0, 3; node 1: 1, 4; node 2: 2, 5
  tl.node = 1;
  tl.local = 1;  // group rank 4
  // All-gather of 10 float32 per rank: 2 other nodes x 40 bytes.
  BOOST_TEST(cpu::two_level_cross_node_bytes(tl, cpu::Collective::AllGather, at::kFloat, 10) == 80);
  // Reduce-scatter to 10 bfloat16 per rank: float32 partials, 2 x 10 x 4.
  BOOST_TEST(cpu::two_level_cross_node_bytes(tl, cpu::Collective::ReduceScatter, at::kBFloat16,
                                             10) == 80);
  BOOST_TEST(cpu::two_level_cross_node_bytes(tl, cpu::Collective::ReduceScatter, at::kDouble, 10) ==
             160);
  // All-reduce of 62 int32: blocks 11 11 10 10 10 10 (ranks 0..5). Rank 4's
  // rail holds ranks 3 (node 0), 4 (node 1), 5 (node 2): partials of blocks
  // 3 and 5 out (10 + 10 elements), then block 4 to 2 nodes (2 x 10).
  BOOST_TEST(cpu::two_level_cross_node_bytes(tl, cpu::Collective::AllReduce, at::kInt, 62) ==
             (20 + 20) * 4);
  tl.local = 0;  // group rank 1: rail ranks 0, 1, 2 with blocks of 11, 11, 10
  BOOST_TEST(cpu::two_level_cross_node_bytes(tl, cpu::Collective::AllReduce, at::kInt, 62) ==
             (11 + 10 + 2 * 11) * 4);
}
