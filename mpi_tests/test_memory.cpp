// Memory observability (fsdp/memory.h, docs/memory.md): what memory_report and
// FSDPModule::memory() say a unit holds at each point of a step, against
// sizes worked out here from the layer shapes and the ceil-div layout; the
// tracking allocator and its budget; estimate_memory's formula against a
// hand computation; its argument errors.
//
// Cases:
//   test_unit_memory_through_a_step   shard / unsharded / grad / optimizer bytes
//   test_report_table_and_tracking    to_string rows, tracked live and peak bytes
//   test_budget_fails_like_an_oom     set_memory_budget: c10's "not enough memory"
//   test_estimate_hand_computed       estimate_memory on two units, by hand
//   test_estimate_argument_errors     shard_size, prefetch, negative sizes
#include "spmd.h"

#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/memory.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <functional>
#include <string>

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One rank's padded shard of an fp32 tensor [rows, cols] split on dim 0 over
// ws ranks, in bytes: ceil(rows / ws) rows (docs/architecture.md, ceil-div).
int64_t shard_bytes(int64_t rows, int64_t cols, int64_t ws) { return ceil_div(rows, ws) * cols * 4; }

struct Net {
  torch::nn::Sequential seq{torch::nn::Linear(64, 48), torch::nn::ReLU(), torch::nn::Linear(48, 16)};
};

}  // namespace

BOOST_AUTO_TEST_CASE(test_unit_memory_through_a_step) {
  const int64_t ws = spmd::world_size();
  Net net;
  auto inner = net.seq->ptr(0);
  fsdp::FSDPModule first = fsdp::fully_shard(inner);
  auto model = fsdp::fully_shard(net.seq);
  fsdp::FSDPModule root = *fsdp::fsdp_module_of(*net.seq);

  // Linear(64, 48): weight [48, 64], bias [48]; Linear(48, 16): [16, 48], [16].
  const int64_t first_shard = shard_bytes(48, 64, ws) + shard_bytes(48, 1, ws);
  const int64_t root_shard = shard_bytes(16, 48, ws) + shard_bytes(16, 1, ws);
  const int64_t first_full = ceil_div(48, ws) * ws * (64 + 1) * 4;  // padded rows, gathered

  fsdp::UnitMemory m = first.memory();
  BOOST_TEST(m.shard_bytes == first_shard);
  BOOST_TEST(m.unsharded_bytes == 0);
  BOOST_TEST(m.grad_bytes == 0);
  BOOST_TEST(m.reduce_buffer_bytes == 0);
  BOOST_TEST(root.memory().shard_bytes == root_shard);

  // Explicitly unsharded: the gathered parameters are held (one rank: the
  // full tensor is the shard itself, nothing more).
  first.unshard();
  BOOST_TEST(first.memory().unsharded_bytes == (ws == 1 ? 0 : first_full));
  first.reshard();
  BOOST_TEST(first.memory().unsharded_bytes == 0);

  torch::optim::AdamW opt(net.seq->parameters(), torch::optim::AdamWOptions(1e-3));
  model(at::ones({4, 64})).sum().backward();
  // After backward: every unit resharded, the sharded gradients in place
  // (fp32, the shard's size), no reduction buffer left.
  m = first.memory();
  BOOST_TEST(m.unsharded_bytes == 0);
  BOOST_TEST(m.grad_bytes == first_shard);
  BOOST_TEST(m.reduce_buffer_bytes == 0);
  opt.step();
  const fsdp::MemoryReport r = fsdp::memory_report(*net.seq, &opt);
  BOOST_TEST_REQUIRE(r.units.size() == 2u);
  // In named_modules() order: the root first, then "0".
  BOOST_TEST(r.units[0].shard_bytes == root_shard);
  BOOST_TEST(r.units[1].unit == "0");
  // AdamW: exp_avg and exp_avg_sq, each like the parameter. Its state is made
  // from the parameter as the module holds it, the owned rows (not padded).
  const int64_t owned_first = [&] {
    const int64_t chunk = ceil_div(48, ws);
    const int64_t rows = std::max<int64_t>(0, std::min<int64_t>(chunk, 48 - spmd::rank() * chunk));
    return rows * (64 + 1) * 4;
  }();
  BOOST_TEST(r.units[1].optimizer_bytes == 2 * owned_first);
  BOOST_TEST(r.units[1].grad_bytes == first_shard);
  BOOST_TEST(r.totals.shard_bytes == first_shard + root_shard);
  BOOST_TEST(r.totals.total() == r.units[0].total() + r.units[1].total());
}

BOOST_AUTO_TEST_CASE(test_report_table_and_tracking) {
  fsdp::install_memory_tracking();
  BOOST_TEST(fsdp::memory_tracking_installed());
  const int64_t before = fsdp::tracked_live_bytes();
  Net net;  // made after the install: counted
  auto inner = net.seq->ptr(0);
  fsdp::fully_shard(inner);
  auto model = fsdp::fully_shard(net.seq);
  fsdp::reset_tracked_peak();
  {
    at::Tensor big = at::empty({1 << 20});  // 4 MiB, freed at once
    (void)big;
  }
  BOOST_TEST(fsdp::tracked_peak_bytes() - fsdp::tracked_live_bytes() >= (4 << 20));
  BOOST_TEST(fsdp::tracked_live_bytes() > before);
  const fsdp::MemoryReport r = fsdp::memory_report(*net.seq);
  BOOST_TEST_REQUIRE(r.tracked_live_bytes.has_value());
  BOOST_TEST(*r.peak_allocated_bytes >= *r.tracked_live_bytes);
  const std::string table = fsdp::to_string(r);
  BOOST_TEST(table.find("\n0 ") != std::string::npos, table);
  BOOST_TEST(table.find("\ntotal ") != std::string::npos, table);
  BOOST_TEST(table.find("tracked CPU allocator: live ") != std::string::npos, table);
  BOOST_TEST(!r.cuda.available);  // CPU tensors
}

BOOST_AUTO_TEST_CASE(test_budget_fails_like_an_oom) {
  fsdp::install_memory_tracking();
  fsdp::set_memory_budget(fsdp::tracked_live_bytes() + (1 << 20));
  bool thrown = false;
  try {
    at::Tensor t = at::empty({1 << 20});  // 4 MiB over a 1 MiB margin
  } catch (const c10::Error& e) {
    thrown = true;
    BOOST_TEST(std::string(e.what()).find("DefaultCPUAllocator: not enough memory") !=
               std::string::npos);
  }
  fsdp::set_memory_budget(0);
  BOOST_TEST(thrown);
  BOOST_CHECK_NO_THROW(at::empty({1 << 20}));
  try {
    fsdp::set_memory_budget(-1);
    BOOST_TEST(false, "no error for a negative budget");
  } catch (const fsdp::ArgumentError& e) {
    BOOST_TEST(e.argument() == "bytes");
  }
}

// Two units at 4 ranks, fp32, AdamW, prefetch 1, worked out by hand
// (docs/memory.md#estimator):
//   root [8], kept unsharded, activations 1000: chunk 2 -> shard 8 B,
//     gathered 2*4*4 = 32, full grad 32, reduce (4+1)*(2+1)*4 = 60, grad 8, AdamW 16
//   layer [10, 3], activations 500, backward workspace 50: chunk 3 -> block 9:
//     shard 36, gathered 144, full grad 120, reduce 5*10*4 = 200, grad 36, AdamW 72
//   persistent 8+36 + 8+36 + 16+72 = 176
//   forward: max(1000+32+144, 1500+32+144, end 1500+32+extra 100) = 1676
//   backward: layer: 1000 + max(500+50, 120+200) + 32 + 144 = 1726;
//             root: 0 + max(1000, 32+60) + 200 in flight + 32 = 1232 -> 1726
//   peak 176 + 1726 = 1902, in backward
BOOST_AUTO_TEST_CASE(test_estimate_hand_computed) {
  fsdp::UnitSpec root;
  root.name = "root";
  root.param_shapes = {{8}};
  root.activation_bytes = 1000;
  root.reshard_after_forward = false;
  fsdp::UnitSpec layer;
  layer.name = "layer";
  layer.param_shapes = {{10, 3}};
  layer.activation_bytes = 500;
  layer.backward_workspace_bytes = 50;
  fsdp::EstimateLayout l;
  l.shard_size = 4;
  l.extra_bytes = 100;
  const fsdp::MemoryEstimate e = fsdp::estimate_memory({root, layer}, l);
  BOOST_TEST(e.shard_bytes == 44);
  BOOST_TEST(e.grad_bytes == 44);
  BOOST_TEST(e.optimizer_bytes == 88);
  BOOST_TEST(e.persistent_bytes == 176);
  BOOST_TEST(e.forward_peak_bytes == 1676);
  BOOST_TEST(e.backward_peak_bytes == 1726);
  BOOST_TEST(e.peak_bytes == 1902);
  BOOST_TEST(e.peak_phase == "backward");
  // bf16 compute, fp32 reduce, SGD with momentum, one rank: the gathered
  // copy is a bf16 cast (30*2 = 60 B for the layer), grads stay fp32.
  l.shard_size = 1;
  l.mp_param_dtype = at::kBFloat16;
  l.mp_reduce_dtype = at::kFloat;
  l.optimizer = fsdp::EstimateOptimizer::sgd_momentum;
  const fsdp::MemoryEstimate b = fsdp::estimate_memory({layer}, l);
  BOOST_TEST(b.shard_bytes == 120);
  BOOST_TEST(b.grad_bytes == 120);
  BOOST_TEST(b.optimizer_bytes == 120);
  // forward: 500 + 60 (gathered) vs end 500 + 100; backward: max(500+50,
  // full grads 30*2 + 30*4 = 180, no reduce buffers at one rank) + 60 = 610.
  BOOST_TEST(b.forward_peak_bytes == 600);
  BOOST_TEST(b.backward_peak_bytes == 610);
  BOOST_TEST(b.peak_phase == "backward");
}

BOOST_AUTO_TEST_CASE(test_estimate_argument_errors) {
  fsdp::UnitSpec u;
  u.name = "u";
  u.param_shapes = {{4, 4}};
  fsdp::EstimateLayout l;
  auto argument_of = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const fsdp::ArgumentError& e) {
      return e.argument();
    }
    return "(no error)";
  };
  l.shard_size = 0;
  BOOST_TEST(argument_of([&] { fsdp::estimate_memory({u}, l); }) == "layout");
  l.shard_size = 2;
  l.prefetch = -1;
  BOOST_TEST(argument_of([&] { fsdp::estimate_memory({u}, l); }) == "layout");
  l.prefetch = 1;
  u.activation_bytes = -5;
  BOOST_TEST(argument_of([&] { fsdp::estimate_memory({u}, l); }) == "units");
  u.activation_bytes = 0;
  u.backward_workspace_bytes = -1;
  BOOST_TEST(argument_of([&] { fsdp::estimate_memory({u}, l); }) == "units");
  u.backward_workspace_bytes = 0;
  u.param_shapes = {{-1, 3}};
  BOOST_TEST(argument_of([&] { fsdp::estimate_memory({u}, l); }) == "units");
}
