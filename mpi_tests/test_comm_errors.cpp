// L0: bad input to the collectives and to the device mesh.
//
// Every case checks the exception's exact type, that argument() names the
// offending argument, and that what() names it the way the library's
// messages do, in quotes ('output'). Every rank passes the same bad input,
// so every rank throws before any communication. Afterwards the groups must
// still work: a rejected call issues (and counts) nothing. The last cases
// are failures at run time: a timed-out Work::wait and an MPI error.
#include "spmd.h"

#include <fsdp/comm.h>
#include <fsdp/errors.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>

#include <boost/core/demangle.hpp>

#include <chrono>
#include <climits>
#include <functional>
#include <string>
#include <thread>
#include <typeinfo>
#include <vector>

namespace {

using fsdp::ProcessGroup;
using fsdp::ProcessGroupPtr;
using fsdp::ReduceOp;

// Calls `call` and checks that it throws exactly E for `argument`.
template <typename E>
void expect_error(const std::string& call_name, const std::string& argument,
                  const std::function<void()>& call) {
  const std::string expected = boost::core::demangle(typeid(E).name());
  BOOST_TEST_CONTEXT(call_name << " (expecting " << expected << " for '" << argument << "')") {
    try {
      call();
      BOOST_ERROR("no exception");
    } catch (const fsdp::ArgumentError& e) {
      BOOST_CHECK_MESSAGE(typeid(e) == typeid(E),
                          "threw " << boost::core::demangle(typeid(e).name()) << ": " << e.what());
      BOOST_CHECK_MESSAGE(e.argument() == argument, "argument() is '" << e.argument() << "'");
      BOOST_CHECK_MESSAGE(std::string(e.what()).find("'" + argument + "'") != std::string::npos,
                          "what() does not name '" << argument << "': " << e.what());
    } catch (const std::exception& e) {
      BOOST_ERROR("threw " << boost::core::demangle(typeid(e).name()) << ": " << e.what());
    }
  }
}

at::TensorOptions opts(at::ScalarType dt = at::kFloat) {
  return at::TensorOptions(dt).device(spmd::device());
}

// The world group, and at 4 ranks both groups of a (replicate, shard) mesh,
// where group ranks differ from world ranks.
std::vector<ProcessGroupPtr> test_groups() {
  const c10::DeviceType type = spmd::device().type();
  const int n = spmd::world_size();
  std::vector<ProcessGroupPtr> out{fsdp::init_device_mesh(type, {n}).get_group(0)};
  if (n == 4) {
    const auto mesh = fsdp::init_device_mesh(type, {2, 2}, {"replicate", "shard"});
    out.push_back(mesh.get_group("replicate"));
    out.push_back(mesh.get_group("shard"));
  }
  return out;
}

// A valid all_reduce and all_gather give the right answers: the errors left
// neither a half-issued collective nor a stuck queue behind.
void check_still_works(ProcessGroup& g) {
  const int n = g.size();
  at::Tensor t = at::full({5}, g.rank() + 1, opts());
  g.all_reduce(t, ReduceOp::SUM);
  BOOST_CHECK_MESSAGE(at::all(t.cpu() == n * (n + 1) / 2).item<bool>(),
                      "all_reduce after the errors gave " << t.cpu());
  at::Tensor mine = at::full({2}, g.rank(), opts(at::kLong));
  at::Tensor all = at::empty({2 * n}, opts(at::kLong));
  g.all_gather_into_tensor(all, mine, /*async_op=*/true)->wait();
  const at::Tensor want = at::arange(n, at::kLong).repeat_interleave(2);
  BOOST_CHECK_MESSAGE(at::equal(all.cpu(), want), "all_gather after the errors gave " << all.cpu());
}

// A non-contiguous tensor of `numel` elements.
at::Tensor transposed(int64_t numel) { return at::zeros({2, numel / 2}, opts()).t(); }

}  // namespace

BOOST_AUTO_TEST_CASE(test_non_contiguous_tensor_is_layout_error) {  // [ours]
  for (const ProcessGroupPtr& group : test_groups()) {
    ProcessGroup& g = *group;
    BOOST_TEST_CONTEXT("group " << g.name()) {
      const int n = g.size();
      // 12 elements divide evenly over 2 or 4 ranks, so only the layout is wrong.
      const at::Tensor bad = transposed(12);
      BOOST_TEST_REQUIRE(!bad.is_contiguous());
      at::Tensor twelve = at::zeros({12}, opts());
      at::Tensor gathered = at::zeros({12 * n}, opts());
      using fsdp::LayoutError;
      expect_error<LayoutError>("all_gather_into_tensor(input transposed)", "input",
                                [&] { g.all_gather_into_tensor(gathered, bad); });
      expect_error<LayoutError>("all_gather_into_tensor(output transposed)", "output",
                                [&] { g.all_gather_into_tensor(transposed(12 * n), twelve); });
      expect_error<LayoutError>("all_gather_into_tensor(output every other element)", "output",
                                [&] {
                                  g.all_gather_into_tensor(
                                      at::zeros({24 * n}, opts()).slice(0, 0, 24 * n, 2), twelve);
                                });
      expect_error<LayoutError>("reduce_scatter_tensor(input transposed)", "input", [&] {
        g.reduce_scatter_tensor(at::zeros({12 / n}, opts()), bad);
      });
      expect_error<LayoutError>("all_reduce(transposed)", "tensor", [&] { g.all_reduce(bad); });
      expect_error<LayoutError>("all_reduce(transposed, async)", "tensor",
                                [&] { g.all_reduce(bad, ReduceOp::SUM, true); });
      expect_error<LayoutError>("broadcast(transposed)", "tensor", [&] { g.broadcast(bad, 0); });
      expect_error<LayoutError>("all_to_all_single(input transposed)", "input", [&] {
        g.all_to_all_single(at::zeros({3 * n, 2}, opts()), at::zeros({2, 3 * n}, opts()).t());
      });
      expect_error<LayoutError>("send(transposed)", "tensor",
                                [&] { g.send(bad, (g.rank() + 1) % n); });
      expect_error<LayoutError>("recv(transposed)", "tensor",
                                [&] { g.recv(bad, (g.rank() + 1) % n); });
      check_still_works(g);
    }
  }
}

BOOST_AUTO_TEST_CASE(test_wrong_output_numel_is_shape_error) {  // [ours]
  for (const ProcessGroupPtr& group : test_groups()) {
    ProcessGroup& g = *group;
    BOOST_TEST_CONTEXT("group " << g.name()) {
      const int n = g.size();
      using fsdp::ShapeError;
      const at::Tensor input = at::zeros({7}, opts());
      for (int64_t numel : {int64_t{7} * n - 1, int64_t{7} * n + 1, int64_t{7}}) {
        expect_error<ShapeError>("all_gather_into_tensor(output numel " + std::to_string(numel) +
                                     ", input numel 7)",
                                 "output", [&] {
                                   at::Tensor out = at::zeros({numel}, opts());
                                   g.all_gather_into_tensor(out, input);
                                 });
      }
      const at::Tensor big = at::zeros({7 * n}, opts());
      for (int64_t numel : {int64_t{6}, int64_t{8}, int64_t{7} * n}) {
        expect_error<ShapeError>("reduce_scatter_tensor(output numel " + std::to_string(numel) +
                                     ", input numel 7 * group size)",
                                 "output", [&] {
                                   at::Tensor out = at::zeros({numel}, opts());
                                   g.reduce_scatter_tensor(out, big);
                                 });
      }
      expect_error<ShapeError>("reduce_scatter_tensor(input numel not divisible)", "output", [&] {
        at::Tensor out = at::zeros({7}, opts());
        g.reduce_scatter_tensor(out, at::zeros({7 * n + 1}, opts()), ReduceOp::SUM, true);
      });
      expect_error<ShapeError>("all_to_all_single(output rows of 3, input rows of 2)", "output",
                               [&] {
                                 at::Tensor out = at::zeros({n, 3}, opts());
                                 g.all_to_all_single(out, at::zeros({n, 2}, opts()));
                               });
      expect_error<ShapeError>("all_to_all_single(0-d input)", "input", [&] {
        at::Tensor out = at::zeros({n}, opts());
        g.all_to_all_single(out, at::zeros({}, opts()));
      });
      expect_error<ShapeError>("all_to_all_single(0-d output)", "output", [&] {
        g.all_to_all_single(at::zeros({}, opts()), at::zeros({n}, opts()));
      });
      check_still_works(g);
    }
  }
}

BOOST_AUTO_TEST_CASE(test_output_dtype_mismatch_is_dtype_error) {  // [ours]
  for (const ProcessGroupPtr& group : test_groups()) {
    ProcessGroup& g = *group;
    BOOST_TEST_CONTEXT("group " << g.name()) {
      const int n = g.size();
      using fsdp::DTypeError;
      expect_error<DTypeError>("all_gather_into_tensor(float64 output, float32 input)", "output",
                               [&] {
                                 at::Tensor out = at::zeros({4 * n}, opts(at::kDouble));
                                 g.all_gather_into_tensor(out, at::zeros({4}, opts()));
                               });
      expect_error<DTypeError>("reduce_scatter_tensor(bfloat16 output, float32 input)", "output",
                               [&] {
                                 at::Tensor out = at::zeros({4}, opts(at::kBFloat16));
                                 g.reduce_scatter_tensor(out, at::zeros({4 * n}, opts()));
                               });
      expect_error<DTypeError>("all_to_all_single(int32 output, int64 input)", "output", [&] {
        at::Tensor out = at::zeros({n}, opts(at::kInt));
        g.all_to_all_single(out, at::zeros({n}, opts(at::kLong)));
      });
      check_still_works(g);
    }
  }
}

BOOST_AUTO_TEST_CASE(test_unsupported_dtype_is_dtype_error) {  // [ours]
  for (const ProcessGroupPtr& group : test_groups()) {
    ProcessGroup& g = *group;
    const int n = g.size();
    const int peer = (g.rank() + 1) % n;
    for (at::ScalarType dt : {at::kBool, at::kChar, at::kShort, at::kComplexFloat}) {
      BOOST_TEST_CONTEXT("group " << g.name() << ", dtype " << dt) {
        using fsdp::DTypeError;
        expect_error<DTypeError>("all_reduce", "tensor",
                                 [&] { g.all_reduce(at::zeros({4}, opts(dt))); });
        expect_error<DTypeError>("broadcast", "tensor",
                                 [&] { g.broadcast(at::zeros({4}, opts(dt)), 0); });
        expect_error<DTypeError>("all_gather_into_tensor(both)", "input", [&] {
          g.all_gather_into_tensor(at::zeros({4 * n}, opts(dt)), at::zeros({4}, opts(dt)));
        });
        expect_error<DTypeError>("all_gather_into_tensor(output only)", "output", [&] {
          g.all_gather_into_tensor(at::zeros({4 * n}, opts(dt)), at::zeros({4}, opts()));
        });
        expect_error<DTypeError>("reduce_scatter_tensor", "input", [&] {
          g.reduce_scatter_tensor(at::zeros({4}, opts(dt)), at::zeros({4 * n}, opts(dt)));
        });
        expect_error<DTypeError>("all_to_all_single", "input", [&] {
          g.all_to_all_single(at::zeros({n}, opts(dt)), at::zeros({n}, opts(dt)));
        });
        expect_error<DTypeError>("send", "tensor",
                                 [&] { g.send(at::zeros({4}, opts(dt)), peer, 0, true); });
        expect_error<DTypeError>("recv", "tensor",
                                 [&] { g.recv(at::zeros({4}, opts(dt)), peer, 0, true); });
      }
    }
    check_still_works(g);
  }
}

BOOST_AUTO_TEST_CASE(test_uint8_moves_but_does_not_reduce) {  // [ours]
  // uint8 carries bytes of any kind (a float8 all-gather's payload): the
  // collectives that move data take it bit for bit; reductions refuse it.
  for (const ProcessGroupPtr& group : test_groups()) {
    ProcessGroup& g = *group;
    const int n = g.size();
    const int r = g.rank();
    BOOST_TEST_CONTEXT("group " << g.name()) {
      using fsdp::DTypeError;
      // 0..255 across the ranks' blocks, so every bit pattern travels.
      const int64_t block = 256 / n + 1;
      at::Tensor all = at::empty({block * n}, opts(at::kByte));
      at::Tensor mine = all.narrow(0, r * block, block);
      for (int64_t i = 0; i < block; ++i) mine[i] = static_cast<int64_t>((r * block + i) % 256);
      g.all_gather_into_tensor(all, mine);
      for (int64_t i = 0; i < block * n; ++i) {
        BOOST_TEST(all[i].item<int64_t>() == i % 256);
      }
      at::Tensor b = at::full({7}, r == 0 ? 251 : 3, opts(at::kByte));
      g.broadcast(b, 0);
      BOOST_TEST(b.eq(251).all().item<bool>());
      at::Tensor a2a_in = at::full({n}, r + 200, opts(at::kByte));
      at::Tensor a2a_out = at::empty({n}, opts(at::kByte));
      g.all_to_all_single(a2a_out, a2a_in);
      for (int k = 0; k < n; ++k) BOOST_TEST(a2a_out[k].item<int64_t>() == k + 200);
      expect_error<DTypeError>("all_reduce(uint8)", "tensor",
                               [&] { g.all_reduce(at::zeros({4}, opts(at::kByte))); });
      expect_error<DTypeError>("reduce_scatter_tensor(uint8)", "input", [&] {
        g.reduce_scatter_tensor(at::zeros({4}, opts(at::kByte)),
                                at::zeros({4 * n}, opts(at::kByte)));
      });
      expect_error<DTypeError>("all_gather_into_tensor(uint8 output, float input)", "output", [&] {
        g.all_gather_into_tensor(at::zeros({4 * n}, opts(at::kByte)), at::zeros({4}, opts()));
      });
    }
    check_still_works(g);
  }
}

BOOST_AUTO_TEST_CASE(test_avg_on_integer_is_dtype_error) {  // [ours]
  for (const ProcessGroupPtr& group : test_groups()) {
    ProcessGroup& g = *group;
    const int n = g.size();
    for (at::ScalarType dt : {at::kInt, at::kLong}) {
      BOOST_TEST_CONTEXT("group " << g.name() << ", dtype " << dt) {
        using fsdp::DTypeError;
        expect_error<DTypeError>("all_reduce(avg)", "tensor",
                                 [&] { g.all_reduce(at::ones({4}, opts(dt)), ReduceOp::AVG); });
        expect_error<DTypeError>("reduce_scatter_tensor(avg)", "input", [&] {
          g.reduce_scatter_tensor(at::zeros({4}, opts(dt)), at::ones({4 * n}, opts(dt)),
                                  ReduceOp::AVG, true);
        });
      }
    }
    check_still_works(g);
  }
}

BOOST_AUTO_TEST_CASE(test_broadcast_root_out_of_range) {  // [ours]
  for (const ProcessGroupPtr& group : test_groups()) {
    ProcessGroup& g = *group;
    // Group ranks, not world ranks: at 4 ranks, 2 is out of range for a pair.
    for (int root : {-1, g.size(), g.size() + 5, INT_MIN}) {
      BOOST_TEST_CONTEXT("group " << g.name() << ", root " << root) {
        expect_error<fsdp::ArgumentError>("broadcast", "root", [&] {
          g.broadcast(at::zeros({4}, opts()), root);
        });
      }
    }
    check_still_works(g);
  }
}

BOOST_AUTO_TEST_CASE(test_send_recv_bad_peer_or_tag) {  // [ours]
  for (const ProcessGroupPtr& group : test_groups()) {
    ProcessGroup& g = *group;
    const int peer = (g.rank() + 1) % g.size();
    for (int bad : {g.rank(), -1, g.size(), INT_MAX}) {
      BOOST_TEST_CONTEXT("group " << g.name() << ", peer " << bad) {
        using fsdp::ArgumentError;
        expect_error<ArgumentError>("send", "dst", [&] { g.send(at::zeros({4}, opts()), bad); });
        expect_error<ArgumentError>("recv", "src", [&] { g.recv(at::zeros({4}, opts()), bad); });
      }
    }
    for (int tag : {-1, INT_MIN}) {
      BOOST_TEST_CONTEXT("group " << g.name() << ", tag " << tag) {
        using fsdp::ArgumentError;
        expect_error<ArgumentError>("send", "tag",
                                    [&] { g.send(at::zeros({4}, opts()), peer, tag); });
        expect_error<ArgumentError>("recv", "tag",
                                    [&] { g.recv(at::zeros({4}, opts()), peer, tag, true); });
      }
    }
    check_still_works(g);
  }
}

BOOST_AUTO_TEST_CASE(test_all_to_all_bad_split_sizes) {  // [ours]
  for (const ProcessGroupPtr& group : test_groups()) {
    ProcessGroup& g = *group;
    BOOST_TEST_CONTEXT("group " << g.name()) {
      const int n = g.size();
      const std::vector<int64_t> ones(static_cast<size_t>(n), 1);
      std::vector<int64_t> too_many = ones, too_few = ones, negative = ones, too_large = ones;
      too_many.push_back(0);
      too_few.pop_back();
      // Still sums to n rows: only the sign is wrong.
      negative[0] = -1;
      negative[1] = 3;
      too_large[0] = 2;
      const at::Tensor input = at::zeros({n, 3}, opts());
      at::Tensor output = at::zeros({n, 3}, opts());
      using fsdp::ShapeError;
      auto a2a = [&](const std::vector<int64_t>& out_splits,
                     const std::vector<int64_t>& in_splits) {
        return [&g, &output, &input, out_splits, in_splits] {
          g.all_to_all_single(output, input, out_splits, in_splits);
        };
      };
      expect_error<ShapeError>("input_split_sizes with group size + 1 entries",
                               "input_split_sizes", a2a(ones, too_many));
      expect_error<ShapeError>("input_split_sizes with group size - 1 entries",
                               "input_split_sizes", a2a(ones, too_few));
      expect_error<ShapeError>("output_split_sizes with group size + 1 entries",
                               "output_split_sizes", a2a(too_many, ones));
      expect_error<ShapeError>("input_split_sizes with a negative entry", "input_split_sizes",
                               a2a(ones, negative));
      expect_error<ShapeError>("output_split_sizes with a negative entry", "output_split_sizes",
                               a2a(negative, ones));
      expect_error<ShapeError>("input_split_sizes summing to rows + 1", "input_split_sizes",
                               a2a(ones, too_large));
      expect_error<ShapeError>("output_split_sizes summing to rows + 1", "output_split_sizes",
                               a2a(too_large, {}));
      expect_error<ShapeError>("equal split of an input whose rows do not divide",
                               "input_split_sizes", [&] {
                                 g.all_to_all_single(output, at::zeros({n + 1, 3}, opts()));
                               });
      expect_error<ShapeError>("equal split of an output whose rows do not divide",
                               "output_split_sizes", [&] {
                                 at::Tensor out = at::zeros({n + 1, 3}, opts());
                                 g.all_to_all_single(out, input, {}, {}, true);
                               });
      check_still_works(g);
    }
  }
}

BOOST_AUTO_TEST_CASE(test_undefined_tensor_is_argument_error) {  // [ours]
  for (const ProcessGroupPtr& group : test_groups()) {
    ProcessGroup& g = *group;
    BOOST_TEST_CONTEXT("group " << g.name()) {
      const int n = g.size();
      const int peer = (g.rank() + 1) % n;
      const at::Tensor undefined;
      const at::Tensor four = at::zeros({4}, opts());
      at::Tensor gathered = at::zeros({4 * n}, opts());
      using fsdp::ArgumentError;
      expect_error<ArgumentError>("all_reduce", "tensor", [&] { g.all_reduce(undefined); });
      expect_error<ArgumentError>("broadcast", "tensor", [&] { g.broadcast(undefined, 0); });
      expect_error<ArgumentError>("all_gather_into_tensor(input)", "input",
                                  [&] { g.all_gather_into_tensor(gathered, undefined); });
      expect_error<ArgumentError>("all_gather_into_tensor(output)", "output",
                                  [&] { g.all_gather_into_tensor(undefined, four); });
      expect_error<ArgumentError>("reduce_scatter_tensor(input)", "input",
                                  [&] { g.reduce_scatter_tensor(four, undefined); });
      expect_error<ArgumentError>("reduce_scatter_tensor(output)", "output",
                                  [&] { g.reduce_scatter_tensor(undefined, gathered); });
      expect_error<ArgumentError>("all_to_all_single(input)", "input",
                                  [&] { g.all_to_all_single(gathered, undefined); });
      expect_error<ArgumentError>("send", "tensor", [&] { g.send(undefined, peer); });
      expect_error<ArgumentError>("recv", "tensor", [&] { g.recv(undefined, peer); });
      check_still_works(g);
    }
  }
}

BOOST_AUTO_TEST_CASE(test_rejected_calls_issue_nothing) {  // [ours]
  const std::vector<ProcessGroupPtr> groups = test_groups();
  fsdp::reset_collective_counters();
  for (const ProcessGroupPtr& group : groups) {
    ProcessGroup& g = *group;
    const int n = g.size();
    // Async calls too: validation must reject them before anything is queued.
    for (bool async_op : {false, true}) {
      BOOST_TEST_CONTEXT("group " << g.name() << (async_op ? ", async" : ", sync")) {
        using fsdp::ArgumentError;
        using fsdp::DTypeError;
        using fsdp::ShapeError;
        expect_error<ShapeError>("all_gather_into_tensor", "output", [&] {
          g.all_gather_into_tensor(at::zeros({3}, opts()), at::zeros({4}, opts()), async_op);
        });
        expect_error<DTypeError>("reduce_scatter_tensor", "input", [&] {
          g.reduce_scatter_tensor(at::zeros({2}, opts(at::kInt)),
                                  at::zeros({2 * n}, opts(at::kInt)), ReduceOp::AVG, async_op);
        });
        expect_error<DTypeError>("all_reduce", "tensor", [&] {
          g.all_reduce(at::zeros({4}, opts(at::kBool)), ReduceOp::SUM, async_op);
        });
        expect_error<ArgumentError>("broadcast", "root",
                                    [&] { g.broadcast(at::zeros({4}, opts()), n, async_op); });
        expect_error<ShapeError>("all_to_all_single", "input_split_sizes", [&] {
          g.all_to_all_single(at::zeros({n}, opts()), at::zeros({n}, opts()), {},
                              std::vector<int64_t>(static_cast<size_t>(n), 2), async_op);
        });
        expect_error<ArgumentError>("send", "dst",
                                    [&] { g.send(at::zeros({4}, opts()), g.rank(), 0, async_op); });
        expect_error<ArgumentError>("recv", "tag", [&] {
          g.recv(at::zeros({4}, opts()), (g.rank() + 1) % n, -1, async_op);
        });
      }
    }
  }
  const fsdp::CollectiveCounters c = fsdp::collective_counters();
  BOOST_CHECK_MESSAGE(c.count.empty() && c.sequence.empty(),
                      "rejected calls were counted: " << c.sequence.size() << " records, first "
                                                      << (c.sequence.empty() ? std::string("-")
                                                                             : c.sequence[0].op));
  for (const ProcessGroupPtr& group : groups) {
    BOOST_TEST_CONTEXT("group " << group->name()) { check_still_works(*group); }
  }
}

// ---- device mesh ------------------------------------------------------------
// init_device_mesh validates before it communicates, so bad arguments throw on
// every rank without a collective.

BOOST_AUTO_TEST_CASE(test_init_device_mesh_bad_shape) {  // [ours]
  const int64_t n = spmd::world_size();
  const c10::DeviceType type = spmd::device().type();
  const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"product world size + 1", {n + 1}},
      {"product 2 * world size", {n, 2}},
      {"empty", {}},
      {"a 0 dim", {0}},
      {"a 0 dim after a valid one", {n, 0}},
      {"a negative dim", {-1}},
      {"two negative dims whose product is the world size", {-n, -1}},
  };
  for (const auto& [label, shape] : shapes) {
    expect_error<fsdp::MeshError>("init_device_mesh(shape " + label + ")", "shape",
                                  [&] { fsdp::init_device_mesh(type, shape); });
    expect_error<fsdp::MeshError>("init_device_mesh(\"cpu\", shape " + label + ")", "shape",
                                  [&] { fsdp::init_device_mesh("cpu", shape); });
  }
}

BOOST_AUTO_TEST_CASE(test_init_device_mesh_bad_dim_names) {  // [ours]
  const int64_t n = spmd::world_size();
  const c10::DeviceType type = spmd::device().type();
  const std::vector<std::pair<std::string, std::vector<std::string>>> names = {
      {"one name for two dims", {"dp"}},
      {"three names for two dims", {"dp", "tp", "pp"}},
      {"a duplicate", {"dp", "dp"}},
      {"an empty name", {"dp", ""}},
  };
  for (const auto& [label, dim_names] : names) {
    expect_error<fsdp::MeshError>("init_device_mesh({n, 1}, " + label + ")", "dim_names",
                                  [&] { fsdp::init_device_mesh(type, {n, 1}, dim_names); });
  }
}

BOOST_AUTO_TEST_CASE(test_init_device_mesh_bad_device_type) {  // [ours]
  const int64_t n = spmd::world_size();
  for (const std::string device : {"tpu", "", "CPU "}) {
    expect_error<fsdp::MeshError>("init_device_mesh(\"" + device + "\")", "device_type",
                                  [&] { fsdp::init_device_mesh(device, {n}); });
  }
  expect_error<fsdp::MeshError>("init_device_mesh(c10::kXLA)", "device_type",
                                [&] { fsdp::init_device_mesh(c10::kXLA, {n}); });
}

BOOST_AUTO_TEST_CASE(test_mesh_unknown_dim_name) {  // [ours]
  const int64_t n = spmd::world_size();
  const auto mesh = fsdp::init_device_mesh(spmd::device().type(), {n, 1}, {"dp", "tp"});
  using fsdp::MeshError;
  expect_error<MeshError>("get_group(\"pp\")", "dim_name", [&] { mesh.get_group("pp"); });
  expect_error<MeshError>("size(\"pp\")", "dim_name", [&] { mesh.size("pp"); });
  expect_error<MeshError>("get_local_rank(\"pp\")", "dim_name",
                          [&] { mesh.get_local_rank("pp"); });
  expect_error<MeshError>("operator[](\"pp\")", "dim_name", [&] { mesh["pp"]; });
  expect_error<MeshError>("operator[]({\"dp\", \"pp\"})", "dim_name",
                          [&] { mesh[std::vector<std::string>{"dp", "pp"}]; });
  // Names are case-sensitive, as in PyTorch.
  expect_error<MeshError>("get_group(\"DP\")", "dim_name", [&] { mesh.get_group("DP"); });
}

BOOST_AUTO_TEST_CASE(test_mesh_slice_bad_dim_names) {  // [ours]
  const int64_t n = spmd::world_size();
  const auto mesh = fsdp::init_device_mesh(spmd::device().type(), {n, 1}, {"dp", "tp"});
  using fsdp::MeshError;
  expect_error<MeshError>("operator[]({\"tp\", \"dp\"}) (out of mesh order)", "dim_names",
                          [&] { mesh[std::vector<std::string>{"tp", "dp"}]; });
  expect_error<MeshError>("operator[]({\"dp\", \"dp\"}) (duplicate)", "dim_names",
                          [&] { mesh[std::vector<std::string>{"dp", "dp"}]; });
  expect_error<MeshError>("operator[]({}) (no names)", "dim_names",
                          [&] { mesh[std::vector<std::string>{}]; });
}

BOOST_AUTO_TEST_CASE(test_reduce_op_outside_enum_is_argument_error) {  // [ours]
  for (const ProcessGroupPtr& group : test_groups()) {
    ProcessGroup& g = *group;
    const int n = g.size();
    const auto bogus = static_cast<ReduceOp>(7);
    BOOST_TEST_CONTEXT("group " << g.name()) {
      expect_error<fsdp::ArgumentError>("all_reduce(ReduceOp 7)", "op",
                                        [&] { g.all_reduce(at::ones({4}, opts()), bogus); });
      expect_error<fsdp::ArgumentError>("reduce_scatter_tensor(ReduceOp 7)", "op", [&] {
        g.reduce_scatter_tensor(at::zeros({4}, opts()), at::ones({4 * n}, opts()), bogus);
      });
    }
    check_still_works(g);
  }
}

// Work::wait(timeout): a rank that is late makes the others' bounded wait
// throw TimeoutError naming the collective; the collective is still in
// flight and completes, with the right value, once the late rank joins.
BOOST_AUTO_TEST_CASE(test_wait_with_timeout) {  // [ours]
  ProcessGroup& g = *test_groups().front();
  at::Tensor t = at::full({4}, static_cast<float>(g.rank() + 1), opts());
  if (g.rank() == g.size() - 1) std::this_thread::sleep_for(std::chrono::milliseconds(800));
  fsdp::WorkPtr work = g.all_reduce(t, ReduceOp::SUM, /*async_op=*/true);
  if (g.rank() != g.size() - 1) {
    try {
      work->wait(std::chrono::milliseconds(50));
      BOOST_ERROR("wait(50 ms) returned although the last rank joins after 800 ms");
    } catch (const fsdp::TimeoutError& e) {
      const std::string msg = e.what();
      BOOST_TEST(msg.find("all_reduce on " + g.name()) != std::string::npos, msg);
      BOOST_TEST(msg.find("not complete after 0.05 s") != std::string::npos, msg);
    }
  }
  work->wait(std::chrono::seconds(30));
  const float want = static_cast<float>(g.size() * (g.size() + 1) / 2);
  BOOST_TEST(at::equal(t.cpu(), at::full({4}, want)), "all_reduce after the timed-out wait: " << t);
  expect_error<fsdp::ArgumentError>("wait(-1 s)", "timeout",
                                    [&] { work->wait(std::chrono::seconds(-1)); });
}

// MPI failures reach the caller as CommError with MPI's own words (the
// communicators return errors instead of aborting the job): a receive into
// a buffer smaller than the message is MPI_ERR_TRUNCATE.
BOOST_AUTO_TEST_CASE(test_mpi_failure_is_comm_error,  // [ours]
                     *spmd::needs_device(c10::kCPU, "MPI's truncation error (the MPI backend)")) {
  ProcessGroup& g = *test_groups().front();
  if (g.rank() == 0) {
    g.send(at::ones({8}, opts()), 1, /*tag=*/5);
  } else if (g.rank() == 1) {
    at::Tensor small = at::zeros({4}, opts());
    try {
      g.recv(small, 0, /*tag=*/5);
      BOOST_ERROR("a receive of 8 floats into 4 returned");
    } catch (const fsdp::CommError& e) {
      const std::string msg = e.what();
      BOOST_TEST(msg.find("recv on " + g.name()) != std::string::npos, msg);
      BOOST_TEST(msg.find("truncat") != std::string::npos, msg);
    }
  }
  check_still_works(g);
}
