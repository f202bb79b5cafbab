// A unit's lifecycle [ours]: the transition table edge by edge, illegal
// transitions raise and the next step recovers, a failed pass keeps the
// earlier accumulation, and reshard returns device memory. Part of the
// test_fully_shard_core executable (np 2, 4; gpu2, gpu4; label core).
#include "fully_shard_core_util.h"

// The transition table of a unit's lifecycle, edge by edge.
BOOST_AUTO_TEST_CASE(test_lifecycle_transitions) {  // [ours]
  using L = fsdp::detail::Lifecycle;
  const std::vector<L> all = {L::Idle, L::Forward, L::PreBackward, L::PostBackward};
  const std::set<std::pair<L, L>> legal = {
      {L::Idle, L::Forward},         {L::PreBackward, L::Forward},  {L::Idle, L::PreBackward},
      {L::PreBackward, L::PreBackward}, {L::PreBackward, L::PostBackward},
      {L::Forward, L::Idle},         {L::PostBackward, L::Idle},    {L::Idle, L::Idle}};
  for (L from : all) {
    for (L to : all) {
      fsdp::detail::UnitLifecycle lc;
      // Walk to `from` through legal edges.
      if (from == L::Forward) lc.transition(L::Forward, "u", "test");
      if (from == L::PreBackward) lc.transition(L::PreBackward, "u", "test");
      if (from == L::PostBackward) {
        lc.transition(L::PreBackward, "u", "test");
        lc.transition(L::PostBackward, "u", "test");
      }
      const bool ok = legal.count({from, to}) > 0;
      if (ok) {
        BOOST_CHECK_NO_THROW(lc.transition(to, "u", "test"));
      } else {
        try {
          lc.transition(to, "block #3", "test");
          BOOST_ERROR(fsdp::detail::to_string(from) << " -> " << fsdp::detail::to_string(to)
                                                    << " did not throw");
        } catch (const fsdp::StateError& e) {
          const std::string msg = e.what();
          const std::string edge = std::string(fsdp::detail::to_string(from)) + " -> " +
                                   fsdp::detail::to_string(to);
          BOOST_TEST(msg.find("block #3") != std::string::npos, msg);
          BOOST_TEST(msg.find(edge) != std::string::npos, msg);
        }
      }
    }
  }
  // Forward returns to where it came from.
  fsdp::detail::UnitLifecycle lc;
  lc.transition(L::PreBackward, "u", "test");
  lc.enter_forward("u");
  lc.leave_forward("u");
  BOOST_TEST((lc.state() == L::PreBackward));
  BOOST_CHECK_THROW(lc.leave_forward("u"), fsdp::StateError);
}

namespace {

// Identity; in backward it runs a forward of `target` (by then a unit that
// has reduced in this backward): an illegal PostBackward -> Forward.
struct ReenterForward : public torch::autograd::Function<ReenterForward> {
  static at::Tensor forward(torch::autograd::AutogradContext* c, const at::Tensor& x,
                            int64_t which) {
    c->saved_data["which"] = which;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* c,
                                                 torch::autograd::variable_list grads);
};

struct TwoUnitsImpl : torch::nn::Module {
  explicit TwoUnitsImpl(int64_t seed) {
    at::manual_seed(seed);
    a = register_module("a", torch::nn::Linear(15, 7));
    b = register_module("b", torch::nn::Linear(7, 5));
  }
  at::Tensor forward(at::Tensor x) {
    at::Tensor h = at::tanh(a(x));
    if (probe) h = ReenterForward::apply(h, 0);
    return b(h);
  }
  fsdp::Sharded<torch::nn::Linear> a{nullptr}, b{nullptr};
  bool probe = false;
};
TORCH_MODULE(TwoUnits);

TwoUnitsImpl* probe_target = nullptr;

// a, b, then the root; `model` becomes the probe's target.
fsdp::FSDPModule shard_two_units(TwoUnits& model, TwoUnits& ref) {
  ref->to(spmd::device());
  model->to(spmd::device());
  fsdp::fully_shard(model->a);
  fsdp::fully_shard(model->b);
  probe_target = model.get();
  return fsdp::fully_shard(model.ptr());
}

torch::autograd::variable_list ReenterForward::backward(torch::autograd::AutogradContext*,
                                                        torch::autograd::variable_list grads) {
  // b's gradients are all in (it is downstream of the probe): b has reduced.
  (void)probe_target->b(at::zeros({1, 7}, grads[0].options()));
  return {grads[0], at::Tensor()};
}

}  // namespace

// A forward of a unit that already reduced in this backward is a StateError
// naming the unit and both states; the user catches it and the next step
// equals a single-card step from the same parameters.
BOOST_AUTO_TEST_CASE(test_illegal_transition_raises_and_next_step_recovers) {  // [ours]
  const int ws = spmd::world_size(), rank = spmd::rank();
  TwoUnits ref(3);
  TwoUnits model(3);
  shard_two_units(model, ref);
  fsdp::Sharded<TwoUnits> root(model);
  const auto batch = toy::global_batch(70, 8);
  const auto mine = toy::slice(batch, rank, ws);
  const at::Tensor x = mine.x.to(spmd::device());
  const at::Tensor y = mine.y.to(spmd::device());
  std::string msg;
  bool typed = false;
  model->probe = true;
  try {
    toy::mse(root(x), y).backward();
  } catch (const fsdp::StateError& e) {
    msg = e.what();
    typed = true;
  } catch (const std::exception& e) {
    msg = e.what();
  }
  model->probe = false;
  BOOST_TEST(typed, "not a StateError: '" << msg << "'");
  BOOST_TEST(msg.find("illegal transition PostBackward -> Forward") != std::string::npos,
             "message: '" << msg << "'");
  BOOST_TEST(msg.find("unit b #") != std::string::npos, "names the unit: " << msg);
  // The failed step installed nothing; the next one equals a single-card step.
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  toy::mse(root(x), y).backward();
  toy::mse(ref(batch.x.to(spmd::device())), batch.y.to(spmd::device())).backward();
  l1::Report report("core illegal transition");
  report.check("next step grads vs single card", l1::grad_err(*model, *ref, ws, rank), 1e-5);
  report.publish();
  probe_target = nullptr;
}

// A failed pass after an unsynchronised one: the earlier accumulation is
// kept, the failed pass's gradient (and the reduction it had issued) is not.
BOOST_AUTO_TEST_CASE(test_failed_pass_keeps_earlier_accumulation) {  // [ours]
  const int ws = spmd::world_size(), rank = spmd::rank();
  TwoUnits ref(4);
  TwoUnits model(4);
  fsdp::FSDPModule root_unit = shard_two_units(model, ref);
  fsdp::Sharded<TwoUnits> root(model);
  auto loss_of = [&](TwoUnits& m, bool sharded, int64_t seed) {
    const auto batch = toy::global_batch(seed, 8, 15, 5);
    const auto b = sharded ? toy::slice(batch, rank, ws) : batch;
    const at::Tensor x = b.x.to(spmd::device()), y = b.y.to(spmd::device());
    return toy::mse(sharded ? root(x) : m(x), y);
  };
  root_unit.set_requires_gradient_sync(false);
  loss_of(model, true, 81).backward();  // accumulated locally
  root_unit.set_requires_gradient_sync(true);
  model->probe = true;  // b has reduced when the probe throws
  bool threw = false;
  try {
    loss_of(model, true, 82).backward();
  } catch (const fsdp::StateError&) {
    threw = true;
  }
  model->probe = false;
  BOOST_TEST(threw, "the failing pass did not throw");
  loss_of(model, true, 83).backward();  // synchronised: reduces 81 + 83
  loss_of(ref, false, 81).backward();
  loss_of(ref, false, 83).backward();
  l1::Report report("core failed pass after no-sync accumulation");
  report.check("grads vs single card of the two good passes", l1::grad_err(*model, *ref, ws, rank),
               1e-5);
  report.publish();
  probe_target = nullptr;
}

// Reshard returns the unsharded parameters' device memory (CUDA: the
// caching allocator's allocated bytes fall back to the level before the
// gather). The CPU form is test_fully_shard_with_ac's tracking allocator.
BOOST_AUTO_TEST_CASE(test_reshard_frees_device_memory,  // [ours]
                     *spmd::needs_device(c10::kCUDA, "the CUDA caching allocator's bytes (the CPU "
                                                     "form is in test_fully_shard_with_ac)")) {
#ifdef FSDP_WITH_NCCL
  const auto dev = spmd::device();
  auto allocated = [&dev] {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(dev.index()).allocated_bytes[0].current;
  };
  torch::nn::Linear big(torch::nn::LinearOptions(1024, 1024).bias(false));
  big->to(dev);
  auto unit = fsdp::fully_shard(big.ptr());
  const int64_t sharded = allocated();
  unit.unshard();
  const int64_t full = allocated();
  unit.reshard();
  const int64_t after = allocated();
  BOOST_TEST(full - sharded >= int64_t{1024} * 1024 * 4, "unshard allocated " << full - sharded);
  BOOST_TEST(after == sharded, "after reshard " << after << " B, sharded " << sharded << " B");
#else
  BOOST_ERROR("a CUDA device without the NCCL backend built");
#endif
}
