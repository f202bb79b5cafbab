// Node topology (Runtime::num_nodes / node_of), per-group node counts and
// shared-memory arenas, and the cross-node byte counters
// (CollectiveCounters::cross_node_bytes), checked against expectations built
// here from every rank's gethostname() -- never from libfsdp's own map.
//
// Runs under a plain mpiexec (one node: every expectation is "nothing crosses
// a node") and on the simulated cluster (mpi_tests/multinode.cmake: 2 nodes x
// 2 ranks, each node its own UTS namespace, so hostnames differ per node).
// $FSDP_EXPECT_NODES, when set, is the node count the entry launched.
#include "spmd.h"

#include <fsdp/comm.h>
#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>
#include <fsdp/runtime.h>
#include <fsdp/tensor_parallel.h>
#include <fsdp/trace.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace {

using fsdp::CpuAlgorithm;

// Every world rank's hostname, by world rank (a raw MPI_Allgather).
std::vector<std::string> hostnames() {
  char mine[256] = {};
  gethostname(mine, sizeof mine - 1);
  const int n = spmd::world_size();
  std::vector<char> all(static_cast<size_t>(n) * sizeof mine);
  MPI_Allgather(mine, sizeof mine, MPI_CHAR, all.data(), sizeof mine, MPI_CHAR, MPI_COMM_WORLD);
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r) out.emplace_back(&all[static_cast<size_t>(r) * sizeof mine]);
  return out;
}

// The expected node of every world rank: hosts numbered by their lowest rank.
std::vector<int> expected_nodes() {
  const auto hosts = hostnames();
  std::map<std::string, int> index;
  std::vector<int> out;
  for (const auto& h : hosts) {
    auto it = index.find(h);
    if (it == index.end()) it = index.emplace(h, static_cast<int>(index.size())).first;
    out.push_back(it->second);
  }
  return out;
}

int distinct(const std::vector<int>& v) {
  return static_cast<int>(std::set<int>(v.begin(), v.end()).size());
}

// Restores the start-up algorithm after each case.
struct KeepSettings {
  fsdp::CpuCollectives saved = fsdp::cpu_collectives();
  ~KeepSettings() { fsdp::set_cpu_collectives(saved); }
};

void use(CpuAlgorithm a) {
  fsdp::CpuCollectives s;
  s.algorithm = a;
  fsdp::set_cpu_collectives(s);
}

// Members of `g` on another node than this rank, by group rank (from hostnames).
std::vector<bool> remote_members(const fsdp::ProcessGroupPtr& g, const std::vector<int>& node) {
  std::vector<bool> out;
  const int me = node[static_cast<size_t>(spmd::rank())];
  for (int w : g->world_ranks()) out.push_back(node[static_cast<size_t>(w)] != me);
  return out;
}

// A mesh whose last dim is one node's ranks ("local") and whose first spans
// the nodes ("node"): needs the same rank count on every node, consecutive.
bool nodes_are_consecutive_blocks(const std::vector<int>& node) {
  const int n = static_cast<int>(node.size()), nodes = distinct(node);
  if (n % nodes != 0) return false;
  for (int r = 0; r < n; ++r) {
    if (node[static_cast<size_t>(r)] != r / (n / nodes)) return false;
  }
  return true;
}

}  // namespace

BOOST_AUTO_TEST_CASE(topology_matches_hostnames) {
  const auto want = expected_nodes();
  const fsdp::Runtime& rt = spmd::runtime();
  BOOST_TEST(rt.num_nodes() == distinct(want));
  if (const char* e = std::getenv("FSDP_EXPECT_NODES"); e != nullptr && *e != '\0') {
    BOOST_TEST(rt.num_nodes() == std::atoi(e),
               "num_nodes " << rt.num_nodes() << ", launched on " << e);
  }
  for (int r = 0; r < spmd::world_size(); ++r) {
    BOOST_TEST(rt.node_of(r) == want[static_cast<size_t>(r)], "node_of(" << r << ")");
  }
  BOOST_TEST(rt.node_index() == want[static_cast<size_t>(spmd::rank())]);
  BOOST_TEST(static_cast<int>(rt.node_map().size()) == spmd::world_size());
  for (int bad : {-1, spmd::world_size()}) {
    try {
      (void)rt.node_of(bad);
      BOOST_ERROR("node_of(" << bad << ") did not throw");
    } catch (const fsdp::ArgumentError& e) {
      BOOST_TEST(e.argument() == "world_rank");
    }
  }
  // The world group spans every node; a group's count is its members'.
  BOOST_TEST(fsdp::world_group()->num_nodes() == distinct(want));
}

BOOST_AUTO_TEST_CASE(group_inside_a_node_has_an_arena_and_sends_nothing_across) {
  KeepSettings keep;
  const auto node = expected_nodes();
  if (!nodes_are_consecutive_blocks(node)) {
    BOOST_TEST_MESSAGE("ranks of a node are not consecutive: case not applicable");
    return;
  }
  const int64_t per_node = spmd::world_size() / distinct(node);
  auto mesh = fsdp::init_device_mesh(c10::kCPU, {distinct(node), per_node}, {"node", "local"});
  auto local = mesh.get_group("local");
  BOOST_TEST(local->num_nodes() == 1);
  const char* shm = std::getenv("FSDP_SHM_BYTES");
  const bool arenas_on = shm == nullptr || std::string(shm) != "0";
  BOOST_TEST(local->has_shared_memory() == (arenas_on && local->size() > 1));
  for (CpuAlgorithm a : {CpuAlgorithm::Shm, CpuAlgorithm::Pairwise, CpuAlgorithm::Ring}) {
    use(a);
    fsdp::reset_collective_counters();
    at::Tensor in = at::full({1000}, spmd::rank() + 1.0f);
    at::Tensor out = at::empty({1000 * local->size()});
    local->all_gather_into_tensor(out, in)->wait();
    at::Tensor rs = at::empty({1000 / local->size()});
    local->reduce_scatter_tensor(rs, in.narrow(0, 0, 1000 / local->size() * local->size()))->wait();
    local->all_reduce(in)->wait();
    const auto c = fsdp::collective_counters();
    BOOST_TEST(c.total_cross_node_bytes("", local->name()) == 0, fsdp::to_string(a));
    if (local->size() > 1) {
      // What ran: shm asked for runs shm where there is an arena.
      const std::string ran =
          a == CpuAlgorithm::Shm && !local->has_shared_memory() ? "pairwise" : fsdp::to_string(a);
      BOOST_TEST(c.runs(ran, "all_gather", local->name()) == 1, fsdp::to_string(a));
      BOOST_TEST(c.runs(ran, "reduce_scatter", local->name()) == 1, fsdp::to_string(a));
    }
  }
}

BOOST_AUTO_TEST_CASE(group_across_nodes_has_no_arena_and_counts_exact_pairwise_bytes) {
  KeepSettings keep;
  const auto node = expected_nodes();
  auto world = fsdp::world_group();
  const int n = world->size(), me = world->rank();
  const auto remote = remote_members(world, node);
  const int64_t n_remote = std::count(remote.begin(), remote.end(), true);
  BOOST_TEST(world->num_nodes() == distinct(node));
  if (distinct(node) > 1) BOOST_TEST(!world->has_shared_memory());

  const int64_t block = 777;  // float32 elements per rank: odd, not a power of two
  const int64_t es = 4;
  use(CpuAlgorithm::Pairwise);
  fsdp::reset_collective_counters();
  at::Tensor in = at::full({block}, 1.0f);
  at::Tensor out = at::empty({block * n});
  world->all_gather_into_tensor(out, in)->wait();
  at::Tensor big = at::ones({block * n});
  at::Tensor rs = at::empty({block});
  world->reduce_scatter_tensor(rs, big)->wait();
  auto c = fsdp::collective_counters();
  BOOST_TEST(c.total_cross_node_bytes("all_gather", world->name()) == block * es * n_remote);
  BOOST_TEST(c.total_cross_node_bytes("reduce_scatter", world->name()) == block * es * n_remote);
  BOOST_TEST(c.runs("pairwise", "all_gather", world->name()) == 1);
  BOOST_TEST(c.modelled_cross_node_bytes.empty());

  // All-reduce (pairwise): blocks numel / n, the first numel % n one
  // longer; peer j gets its block, then every peer this rank's.
  const int64_t numel = block * n + 3;
  at::Tensor t = at::ones({numel});
  fsdp::reset_collective_counters();
  world->all_reduce(t)->wait();
  int64_t want = 0;
  auto count_of = [&](int j) { return numel / n + (j < numel % n ? 1 : 0); };
  for (int j = 0; j < n; ++j) {
    if (remote[static_cast<size_t>(j)]) want += (count_of(j) + count_of(me)) * es;
  }
  c = fsdp::collective_counters();
  BOOST_TEST(c.total_cross_node_bytes("all_reduce", world->name()) == want);
  BOOST_TEST(at::equal(t, at::full({numel}, static_cast<float>(n))));

  // Ring: n - 1 blocks to the right neighbour when it is on another node.
  use(CpuAlgorithm::Ring);
  fsdp::reset_collective_counters();
  world->all_gather_into_tensor(out, in)->wait();
  c = fsdp::collective_counters();
  const bool right_remote = remote[static_cast<size_t>((me + 1) % n)];
  BOOST_TEST(c.total_cross_node_bytes("all_gather", world->name()) ==
             (right_remote ? (n - 1) * block * es : 0));

  // shm asked for on a group that spans nodes never runs shm.
  use(CpuAlgorithm::Shm);
  fsdp::reset_collective_counters();
  world->all_gather_into_tensor(out, in)->wait();
  world->reduce_scatter_tensor(rs, big)->wait();
  c = fsdp::collective_counters();
  if (distinct(node) > 1) {
    BOOST_TEST(c.runs("shm", "", world->name()) == 0);
    BOOST_TEST(c.runs("pairwise", "", world->name()) == 2);
    BOOST_TEST(c.total_cross_node_bytes("", world->name()) == 2 * block * es * n_remote);
  }

  // Open MPI's own: the pairwise equivalent, marked modelled.
  use(CpuAlgorithm::Mpi);
  fsdp::reset_collective_counters();
  world->all_gather_into_tensor(out, in)->wait();
  c = fsdp::collective_counters();
  BOOST_TEST(c.runs("mpi", "all_gather", world->name()) == 1);
  BOOST_TEST(c.total_cross_node_bytes("all_gather", world->name()) == block * es * n_remote);
  const auto key = std::make_pair(std::string("all_gather"), world->name());
  BOOST_TEST(c.modelled_cross_node_bytes[key] == block * es * n_remote);

  // The summary carries the same numbers.
  bool found = false;
  for (const auto& s : fsdp::group_summaries()) {
    if (s.name != world->name()) continue;
    found = true;
    BOOST_TEST(s.num_nodes == distinct(node));
    BOOST_TEST(s.cross_node_bytes == block * es * n_remote);
    BOOST_TEST(s.has_shared_memory == world->has_shared_memory());
  }
  BOOST_TEST(found);
  BOOST_TEST(fsdp::describe_groups().find(world->name() + ":") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(hsdp_2x2_shards_inside_nodes_without_cross_node_bytes,
                     *spmd::needs_world_size(4, "a 2x2 HSDP mesh")) {
  const auto node = expected_nodes();
  if (!nodes_are_consecutive_blocks(node)) {
    BOOST_TEST_MESSAGE("ranks of a node are not consecutive: case not applicable");
    return;
  }
  auto mesh = fsdp::init_device_mesh(c10::kCPU, {2, 2}, {"replicate", "shard"});
  const auto shard = mesh.get_group("shard"), replicate = mesh.get_group("replicate");
  torch::nn::Linear lin(torch::nn::LinearOptions(64, 32));
  fsdp::FullyShardOptions o;
  o.mesh = mesh;
  fsdp::Sharded<torch::nn::Linear> unit = fsdp::fully_shard(lin, o);
  fsdp::reset_collective_counters();
  for (int step = 0; step < 2; ++step) unit(at::randn({4, 64})).sum().backward();
  const auto c = fsdp::collective_counters();
  BOOST_TEST(c.total("all_gather", shard->name()) > 0);
  BOOST_TEST(c.total("reduce_scatter", shard->name()) > 0);
  // The shard group sits inside one node whenever the nodes hold 2 ranks each.
  if (distinct(node) == 2) {
    BOOST_TEST(shard->num_nodes() == 1);
    BOOST_TEST(c.total_cross_node_bytes("", shard->name()) == 0);
    // The replicate group's all-reduce is what crosses.
    BOOST_TEST(replicate->num_nodes() == 2);
    BOOST_TEST(!replicate->has_shared_memory());
    BOOST_TEST(c.total_cross_node_bytes("all_reduce", replicate->name()) > 0);
  } else {
    BOOST_TEST(c.total_cross_node_bytes() == 0);
  }
}

// init_node_mesh: within-node dims stay on one host, across-node dims step
// between hosts; layouts that cannot be laid out so are refused.
BOOST_AUTO_TEST_CASE(node_mesh_keeps_inner_dims_inside_a_node) {
  const auto node = expected_nodes();
  const auto hosts = hostnames();
  const int world = spmd::world_size(), nodes = distinct(node);
  auto expect_mesh_error = [](const std::string& argument, const std::string& dim, auto&& build) {
    try {
      build();
      BOOST_ERROR("no MeshError naming '" << argument << "' (dim '" << dim << "')");
    } catch (const fsdp::MeshError& e) {
      BOOST_TEST(e.argument() == argument, e.what());
      BOOST_TEST(std::string(e.what()).find("'" + dim + "'") != std::string::npos, e.what());
    }
  };
  if (!nodes_are_consecutive_blocks(node)) {
    // e.g. mpirun --map-by node: a node's ranks are not consecutive.
    expect_mesh_error("within_node", "shard", [] {
      fsdp::init_node_mesh(c10::kCPU, {{"shard", -1}}, {{"replicate", -1}});
    });
    return;
  }
  const int64_t per_node = world / nodes;
  // Every member of `g` on this rank's host.
  auto on_my_host = [&](const fsdp::ProcessGroupPtr& g) {
    for (int w : g->world_ranks()) {
      if (hosts[static_cast<size_t>(w)] != hosts[static_cast<size_t>(spmd::rank())]) return false;
    }
    return true;
  };
  auto hsdp = fsdp::init_node_mesh(c10::kCPU, {{"shard", -1}}, {{"replicate", -1}});
  BOOST_TEST((hsdp.shape() == std::vector<int64_t>{nodes, per_node}));
  BOOST_TEST((hsdp.dim_names() == std::vector<std::string>{"replicate", "shard"}));
  BOOST_TEST(on_my_host(hsdp.get_group("shard")));
  BOOST_TEST(hsdp.get_group("shard")->num_nodes() == 1);
  BOOST_TEST(hsdp.get_group("replicate")->num_nodes() == nodes);
  if (per_node % 2 == 0) {
    auto dp_tp = fsdp::init_node_mesh(c10::kCPU, {{"tp", 2}}, {{"dp", -1}});
    BOOST_TEST((dp_tp.shape() == std::vector<int64_t>{world / 2, 2}));
    BOOST_TEST(on_my_host(dp_tp.get_group("tp")));
  }
  // A within-node dim larger than a node, named in the error.
  expect_mesh_error("within_node", "tp", [&] {
    fsdp::init_node_mesh(c10::kCPU, {{"tp", per_node + 1}}, {{"dp", -1}});
  });
  expect_mesh_error("within_node", "b", [] {
    fsdp::init_node_mesh(c10::kCPU, {{"a", -1}, {"b", -1}}, {});
  });
  expect_mesh_error("within_node", "tp", [] {
    fsdp::init_node_mesh(c10::kCPU, {{"tp", 0}}, {{"dp", -1}});
  });
  // Across-node sizes that do not cover the world.
  expect_mesh_error("across_nodes", "replicate", [&] {
    fsdp::init_node_mesh(c10::kCPU, {{"shard", -1}}, {{"replicate", nodes + 1}});
  });
}

// A tp dim whose group spans nodes is refused unless FSDP_TP_ACROSS_NODES=1.
BOOST_AUTO_TEST_CASE(tp_across_nodes_is_refused_unless_asked) {
  const auto node = expected_nodes();
  auto tp = fsdp::init_device_mesh(c10::kCPU, {spmd::world_size()}, {"tp"});
  const bool spans = distinct(node) > 1;
  at::Tensor x = at::ones({2, 4});
  unsetenv("FSDP_TP_ACROSS_NODES");
  if (spans) {
    try {
      (void)fsdp::tp::copy_to_tp(x, tp);
      BOOST_ERROR("copy_to_tp on a tp group across nodes did not throw");
    } catch (const fsdp::MeshError& e) {
      BOOST_TEST(e.argument() == "tp");
      BOOST_TEST(std::string(e.what()).find("'tp'") != std::string::npos, e.what());
    }
  }
  setenv("FSDP_TP_ACROSS_NODES", "1", 1);
  at::Tensor y = fsdp::tp::copy_to_tp(x, tp);  // forward: identity, no communication
  BOOST_TEST(at::equal(y, x));
  unsetenv("FSDP_TP_ACROSS_NODES");
  if (!spans) BOOST_TEST(at::equal(fsdp::tp::copy_to_tp(x, tp), x));
}

// With FSDP_TRACE set (the np2 entry sets it), a collective's span on its
// communication thread names the algorithm that ran and its cross-node bytes.
BOOST_AUTO_TEST_CASE(trace_spans_carry_algorithm_and_cross_node_bytes,
                     *spmd::skip_unless([] { return fsdp::trace::enabled(); },
                                        "FSDP_TRACE is not set")) {
  KeepSettings keep;
  use(CpuAlgorithm::Pairwise);
  auto world = fsdp::world_group();
  at::Tensor in = at::full({64}, 1.0f);
  at::Tensor out = at::empty({64 * world->size()});
  world->all_gather_into_tensor(out, in, /*async_op=*/true)->wait();
  fsdp::trace::flush();
  std::ifstream f(fsdp::trace::file_path());
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  BOOST_TEST(text.find("\"algorithm\":\"pairwise\"") != std::string::npos);
  BOOST_TEST(text.find("\"cross_node_bytes\":") != std::string::npos);
}
