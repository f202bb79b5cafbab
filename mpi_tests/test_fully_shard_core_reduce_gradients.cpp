// FSDPModule::reduce_gradients [ours]: after unsynchronised microbatches it
// reduces once per unit like a single card, is harmless with nothing
// accumulated and a StateError during backward; an fp16 gradient mean does
// not overflow. Part of the test_fully_shard_core executable (np 2, 4;
// gpu2, gpu4; label core).
#include "fully_shard_core_util.h"

// ---- FSDPModule::reduce_gradients -----------------------------------------

namespace {

// Microbatch j of this rank's slice of `global` (k microbatches per rank).
toy::Batch microbatch(const toy::Batch& mine, int64_t k, int64_t j) {
  const int64_t per = mine.x.size(0) / k;
  return {mine.x.narrow(0, j * per, per), mine.y.narrow(0, j * per, per)};
}

struct ReduceMesh {
  std::string label;
  fsdp::DeviceMesh mesh;
  int64_t parts, index;             // the shard dim: size, this rank's place
  std::string shard_group, replicate_group;  // "" when 1-D
};

std::vector<ReduceMesh> reduce_meshes() {
  const int ws = spmd::world_size();
  const auto dev = spmd::device().type();
  std::vector<ReduceMesh> out;
  const auto flat = fsdp::init_device_mesh(dev, {ws}, {"shard"});
  out.push_back({"1-D", flat, ws, spmd::rank(), flat.get_group("shard")->name(), ""});
  if (ws == 4) {
    const auto hsdp = fsdp::init_device_mesh(dev, {2, 2}, {"replicate", "shard"});
    out.push_back({"HSDP 2x2", hsdp, 2, hsdp.get_local_rank("shard"),
                   hsdp.get_group("shard")->name(), hsdp.get_group("replicate")->name()});
  }
  return out;
}

}  // namespace

// A pipeline stage's step: k microbatches forward + backward with no
// gradient sync, no reshard after backward and not the last backward, then
// one reduce_gradients(): the sharded gradients equal a single card's on
// the whole global batch (loss = the microbatch losses summed, averaged
// over the data-parallel replicas as FSDP does), with exactly one
// reduce-scatter per unit (comm_fusion) or per parameter (unfused), an
// all-reduce per reduce-scatter over HSDP's replicate dim, no all-gather,
// and the parameters resharded afterwards. A second round adds to the
// gradients the first left (param.grad() accumulates).
// float16 gradient means that fit while their sum over the ranks does not:
// FSDP must divide before the reduction (by the smallest power of two >=
// sqrt(world), and by the rest after), not sum and then divide. Rank r's
// gradient is scale * c(r) in every element; the plain fp16 sum of them
// overflows (checked first, so the case is known to be in that regime).
BOOST_AUTO_TEST_CASE(test_fp16_gradient_mean_does_not_overflow) {  // [ours]
  const int ws = spmd::world_size(), rank = spmd::rank();
  const auto dev = spmd::device();
  constexpr double kHalfMax = 65504;
  double pre = 1;
  while (ws / pre > pre) pre *= 2;
  const double scale = 0.8 * kHalfMax * pre / ws;
  auto c = [ws](int r) { return 1.0 + 0.125 * r / ws; };
  double want = 0;
  for (int r = 0; r < ws; ++r) want += scale * c(r) / ws;
  const auto half = at::TensorOptions().dtype(at::kHalf).device(dev);

  at::Tensor plain_sum = at::full({4}, scale * c(rank), half);
  fsdp::world_group()->all_reduce(plain_sum, fsdp::ReduceOp::SUM);
  BOOST_TEST_REQUIRE(std::isinf(host(plain_sum).to(at::kFloat)[0].item<float>()),
                     "the plain float16 sum should overflow at this scale");

  std::vector<std::pair<std::string, fsdp::DeviceMesh>> meshes = {
      {"FSDP 1-D", fsdp::init_device_mesh(dev.type(), {ws}, {"shard"})}};
  if (ws == 4) {
    meshes.emplace_back("HSDP 2x2",
                        fsdp::init_device_mesh(dev.type(), {2, 2}, {"replicate", "shard"}));
  }
  l1::Report report("core fp16 reduction");
  for (const auto& [label, mesh] : meshes) {
    torch::nn::Linear lin(torch::nn::LinearOptions(4, 4).bias(false));
    lin->to(dev);
    fsdp::FullyShardOptions o;
    o.mesh = mesh;
    o.mp_policy.reduce_dtype = at::kHalf;
    fsdp::Sharded<torch::nn::Linear> unit = fsdp::fully_shard(lin, o);
    // d(sum(W x))/dW[i][j] = x[j].
    unit(at::full({1, 4}, scale * c(rank), at::TensorOptions().device(dev))).sum().backward();
    const at::Tensor g = host(lin->weight.grad()).to(at::kDouble);
    BOOST_TEST_REQUIRE(g.numel() > 0);
    BOOST_TEST(at::isfinite(g).all().item<bool>(), label << ": the fp16 mean overflowed");
    // Roundings to float16, each at most 2^-11 relative: the cast of the
    // local gradient, up to ws - 1 partial sums (Open MPI's order rounds
    // each), the post-divide; the pre-divide is exact.
    report.check(label + " fp16 mean grad, relative to the exact mean",
                 (g - want).abs().max().item<double>() / want, (ws + 1) / 2048.0);
  }
  report.publish();
}

BOOST_AUTO_TEST_CASE(test_reduce_gradients_after_unsynced_microbatches) {  // [ours]
  const int ws = spmd::world_size();
  const int64_t k = 3, rows_per_mb = 2;
  for (const ReduceMesh& rm : reduce_meshes()) {
    for (const bool fused : {true, false}) {
      BOOST_TEST_CONTEXT("mesh " << rm.label << ", comm_fusion " << fused) {
        fsdp::FullyShardOptions opts;
        opts.mesh = rm.mesh;
        opts.comm_fusion = fused;
        l1::ShardedMlp m(91, opts);
        toy::Mlp ref(91);
        ref->to(spmd::device());
        m.root.set_requires_gradient_sync(false);
        m.root.set_reshard_after_backward(false);
        m.root.set_is_last_backward(false);
        l1::Report report(std::string("core reduce_gradients ") + rm.label +
                          (fused ? " fused" : ""));
        for (int round = 0; round < 2; ++round) {
          const auto batch = toy::global_batch(300 + round, ws * k * rows_per_mb);
          const auto mine = toy::slice(batch, spmd::rank(), ws);
          for (int64_t j = 0; j < k; ++j) m.step(microbatch(mine, k, j));
          // Kept unsharded by reshard_after_backward(false) until reduced.
          std::string why;
          BOOST_TEST(l1::numel_state(m.module(), "", /*want_full=*/true, rm.parts, rm.index, &why),
                     "before reduce_gradients: " << why);

          fsdp::reset_collective_counters();
          m.root.reduce_gradients();
          const auto c = fsdp::collective_counters();
          // Units fc1, fc2, root (fc3): 3 groups of 2 parameters each.
          const int64_t rs = fused ? 3 : 6;
          BOOST_TEST(c.total("reduce_scatter") == rs);
          BOOST_TEST(c.total("reduce_scatter", rm.shard_group) == rs);
          BOOST_TEST(c.total("all_reduce") == (rm.replicate_group.empty() ? 0 : rs));
          if (!rm.replicate_group.empty()) {
            BOOST_TEST(c.total("all_reduce", rm.replicate_group) == rs);
          }
          BOOST_TEST(c.total("all_gather") == 0);
          BOOST_TEST(l1::numel_state(m.module(), "", /*want_full=*/false, rm.parts, rm.index, &why),
                     "after reduce_gradients: " << why);

          // Every replica's microbatch losses, summed, over the replica count
          // (FSDP's default "avg" over the data-parallel ranks).
          at::Tensor loss = at::zeros({}, at::TensorOptions().device(spmd::device()));
          for (int r = 0; r < ws; ++r) {
            const auto theirs = toy::slice(batch, r, ws);
            for (int64_t j = 0; j < k; ++j) {
              const auto b = microbatch(theirs, k, j);
              loss = loss + toy::mse(ref(b.x.to(spmd::device())), b.y.to(spmd::device()));
            }
          }
          (loss / static_cast<double>(ws)).backward();
          report.check("round " + std::to_string(round) + " sharded grads vs single card",
                       l1::grad_err(*m.model, *ref, rm.parts, rm.index), 1e-6);
        }
        report.publish();
      }
    }
  }
}

// With nothing accumulated, reduce_gradients leaves the gradients undefined
// and the parameters sharded, and the next synchronised step is a single
// card's.
BOOST_AUTO_TEST_CASE(test_reduce_gradients_with_nothing_accumulated) {  // [ours]
  const int ws = spmd::world_size(), rank = spmd::rank();
  l1::ShardedMlp m(92, {});
  toy::Mlp ref(92);
  ref->to(spmd::device());
  m.root.reduce_gradients();
  BOOST_TEST(l1::all_grads_undefined(m.module()));
  std::string why;
  BOOST_TEST(l1::numel_state(m.module(), "", /*want_full=*/false, ws, rank, &why), why);
  // Also after a forward without backward (units back to Idle).
  (void)m.loss(toy::slice(toy::global_batch(93, 4 * ws), rank, ws));
  m.root.reduce_gradients();
  BOOST_TEST(l1::all_grads_undefined(m.module()));
  BOOST_TEST(l1::numel_state(m.module(), "", /*want_full=*/false, ws, rank, &why), why);

  const auto batch = toy::global_batch(94, 4 * ws);
  m.step(toy::slice(batch, rank, ws));
  l1::ref_backward(ref, batch);
  l1::Report report("core reduce_gradients nothing accumulated");
  report.check("next step grads vs single card", l1::grad_err(*m.model, *ref, ws, rank), 1e-6);
  report.publish();
}

namespace {

// Identity; in backward it calls reduce_gradients on `g_reduce_target`
// (when set) and records what happened.
fsdp::FSDPModule* g_reduce_target = nullptr;
std::string g_reduce_error;

struct ReduceInBackward : public torch::autograd::Function<ReduceInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) {
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    if (g_reduce_target == nullptr) return {grads[0]};
    try {
      g_reduce_target->reduce_gradients();
      g_reduce_error = "no exception";
    } catch (const fsdp::StateError& e) {
      g_reduce_error = std::string("StateError: ") + e.what();
    } catch (const std::exception& e) {
      g_reduce_error = std::string("other: ") + e.what();
    }
    return {grads[0]};
  }
};

// Units a and b with the probe between them: in backward it runs after b's
// gradients and before a's, while the root's backward is under way.
struct ReduceProbeImpl : torch::nn::Module {
  explicit ReduceProbeImpl(int64_t seed) {
    at::manual_seed(seed);
    a = register_module("a", torch::nn::Linear(15, 7));
    b = register_module("b", torch::nn::Linear(7, 5));
  }
  at::Tensor forward(at::Tensor x) { return b(ReduceInBackward::apply(at::tanh(a(x)))); }
  fsdp::Sharded<torch::nn::Linear> a{nullptr}, b{nullptr};
};
TORCH_MODULE(ReduceProbe);

}  // namespace

// reduce_gradients while a backward runs is a StateError naming the call
// (caught inside the backward here, which then completes normally: the
// step's gradients equal a single card's, so the rejected call did nothing).
BOOST_AUTO_TEST_CASE(test_reduce_gradients_during_backward_is_a_state_error) {  // [ours]
  const int ws = spmd::world_size(), rank = spmd::rank();
  const auto dev = spmd::device();
  ReduceProbe ref(95);
  ReduceProbe model(95);
  ref->to(dev);
  model->to(dev);
  fsdp::fully_shard(model->a);
  fsdp::fully_shard(model->b);
  fsdp::FSDPModule root = fsdp::fully_shard(model.ptr());
  fsdp::Sharded<ReduceProbe> net(model);
  const auto batch = toy::global_batch(96, 4 * ws);
  const auto mine = toy::slice(batch, rank, ws);
  g_reduce_target = &root;
  g_reduce_error.clear();
  toy::mse(net(mine.x.to(dev)), mine.y.to(dev)).backward();
  g_reduce_target = nullptr;
  BOOST_TEST(g_reduce_error.rfind("StateError: ", 0) == 0, g_reduce_error);
  BOOST_TEST(g_reduce_error.find("reduce_gradients") != std::string::npos, g_reduce_error);
  toy::mse(ref(batch.x.to(dev)), batch.y.to(dev)).backward();
  l1::Report report("core reduce_gradients during backward");
  report.check("the step's grads vs single card", l1::grad_err(*model, *ref, ws, rank), 1e-6);
  report.publish();
}
