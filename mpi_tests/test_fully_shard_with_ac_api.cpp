// [ours] The activation checkpoint API around fully_shard: the recompute
// replays the forward's RNG, argument plumbing and typed errors; checkpointing
// under mixed precision; the deprecated 0.1.0 names (fsdp/checkpoint.h) still
// forward to the renamed API. Part of the test_fully_shard_with_ac executable
// (np 2, gpu2).
//
// Cases (all [ours]):
//   test_checkpoint_api_contract
//   test_ac_mixed_precision_fsdp
//   test_deprecated_checkpoint_names_forward
#include "with_ac_util.h"

// ---------------------------------------------------------------------------
// [ours] The checkpoint API itself: the recompute replays the forward's RNG
// (dropout), non-tensor arguments reach the recompute, and misuse fails with
// typed errors naming the argument.
namespace {

struct ScaledImpl : torch::nn::Module {
  ScaledImpl() {
    at::manual_seed(7);
    fc = register_module("fc", torch::nn::Linear(6, 6));
  }
  at::Tensor forward(at::Tensor x, double scale, at::Tensor y) {
    return at::dropout(at::tanh(fc(x)) * scale + y, 0.5, /*train=*/true);
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Scaled);

struct HolderImpl : torch::nn::Module {
  HolderImpl() { inner = register_module("inner", Scaled()); }
  at::Tensor forward(at::Tensor x, at::Tensor y) { return inner(x, 1.5, y); }
  fsdp::ActivationCheckpointed<Scaled> inner{nullptr};
};
TORCH_MODULE(Holder);

template <typename E>
bool names(const E& e, const std::string& argument) {
  return e.argument() == argument;
}

bool mentions(const std::exception& e, const std::string& text) {
  return std::string(e.what()).find(text) != std::string::npos;
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_checkpoint_api_contract) {  // [ours]
  // On a gpu entry everything below runs on CUDA: the replay restores the
  // CUDA generator, and backward runs on autograd's device thread.
  const c10::Device dev = spmd::device();
  const auto on_dev = at::TensorOptions().device(dev);
  // Gradients through a dropout model: plain vs checkpointed, same seed.
  auto grads_of = [&](std::optional<fsdp::ActivationCheckpointOptions> options) {
    Holder h;
    h->to(dev);
    if (options) fsdp::activation_checkpoint_module(h->inner, *options);
    at::manual_seed(3);
    const at::Tensor x = at::randn({5, 6}, on_dev).requires_grad_(true);
    const at::Tensor y = at::randn({5, 6}, on_dev);
    at::manual_seed(99);
    h(x, y).pow(2).sum().backward();
    return std::vector<at::Tensor>{h->inner->fc->weight.grad(), x.grad()};
  };
  const auto plain = grads_of(std::nullopt);
  for (auto mode : {fsdp::ActivationCheckpointMode::NonReentrant, fsdp::ActivationCheckpointMode::Reentrant}) {
    fsdp::ActivationCheckpointOptions options;
    options.mode = mode;
    const auto ck = grads_of(options);
    BOOST_TEST(max_abs_diff(ck[0], plain[0]) == 0.0);
    BOOST_TEST(max_abs_diff(ck[1], plain[1]) == 0.0);
    // Without the replay the recompute draws another dropout mask.
    options.preserve_rng_state = false;
    const auto unreplayed = grads_of(options);
    BOOST_TEST(max_abs_diff(unreplayed[0], plain[0]) > 1e-3);
  }

  torch::nn::Linear lin(3, 3);
  lin->to(dev);
  const at::Tensor x = at::randn({2, 3}, on_dev).requires_grad_(true);
  auto lin_fn = [&](const std::vector<at::Tensor>& in) { return lin(in[0]); };
  // Grad mode off: a plain call, no graph.
  {
    at::NoGradGuard no_grad;
    BOOST_TEST(!fsdp::activation_checkpoint(lin_fn, {x}, lin->parameters()).requires_grad());
  }
  BOOST_CHECK_EXCEPTION(fsdp::activation_checkpoint(fsdp::ActivationCheckpointFunction(), {x}), fsdp::ArgumentError,
                        [](const fsdp::ArgumentError& e) { return names(e, "fn"); });
  BOOST_CHECK_EXCEPTION(fsdp::activation_checkpoint(lin_fn, {x, at::Tensor()}), fsdp::ArgumentError,
                        [](const fsdp::ArgumentError& e) {
                          return names(e, "inputs") && mentions(e, "'inputs'[1]");
                        });
  BOOST_CHECK_EXCEPTION(fsdp::activation_checkpoint(lin_fn, {x}, {at::Tensor()}), fsdp::ArgumentError,
                        [](const fsdp::ArgumentError& e) { return names(e, "params"); });
  // Non-reentrant, a parameter read but not passed: its gradient has no way
  // out, which backward reports instead of dropping it.
  BOOST_CHECK_EXCEPTION(fsdp::activation_checkpoint(lin_fn, {x}).sum().backward(), fsdp::StateError,
                        [](const fsdp::StateError& e) { return mentions(e, "'params'"); });
  // A tensor requiring grad computed outside fn and captured by it.
  const at::Tensor outside = x * 2;
  BOOST_CHECK_EXCEPTION(
      fsdp::activation_checkpoint([&](const std::vector<at::Tensor>& in) { return in[0] * outside; }, {x})
          .sum()
          .backward(),
      fsdp::StateError, [](const fsdp::StateError& e) { return mentions(e, "'inputs'"); });
  // The same misuse, and a correct use, with backward on a thread other than
  // the forward's, as on CUDA where autograd's device thread runs the
  // recompute: sequence numbers count per thread, and the check must tell
  // the recompute's nodes from the forward's all the same.
  {
    auto backward_on_another_thread = [](const at::Tensor& loss) {
      std::string error;
      std::thread([&] {
        try {
          loss.backward();
        } catch (const fsdp::StateError& e) {
          error = e.what();
        }
      }).join();
      return error;
    };
    // Reentrant: no leaf check that would catch it another way; the
    // gradient would reach x twice.
    fsdp::ActivationCheckpointOptions reentrant;
    reentrant.mode = fsdp::ActivationCheckpointMode::Reentrant;
    for (const auto& options : {fsdp::ActivationCheckpointOptions{}, reentrant}) {
      const std::string captured = backward_on_another_thread(
          fsdp::activation_checkpoint([&](const std::vector<at::Tensor>& in) { return in[0] * outside; },
                           {x}, {}, options)
              .sum());
      BOOST_TEST(captured.find("was computed outside it") != std::string::npos,
                 "captured outside tensor, backward on another thread: '" << captured << "'");
    }
    lin->zero_grad();
    lin(x.detach()).sum().backward();
    const at::Tensor expected = lin->weight.grad().clone();
    lin->zero_grad();
    const std::string correct = backward_on_another_thread(
        fsdp::activation_checkpoint(lin_fn, {x.detach()}, lin->parameters()).sum());
    BOOST_TEST(correct.empty(), "correct use, backward on another thread: '" << correct << "'");
    BOOST_TEST(max_abs_diff(lin->weight.grad(), expected) == 0.0);
  }
  // An input modified in place between forward and backward.
  {
    at::Tensor moving = at::randn({2, 3}, on_dev);
    const at::Tensor out = fsdp::activation_checkpoint(lin_fn, {moving}, lin->parameters());
    BOOST_TEST(out.requires_grad());
    moving.add_(1);
    BOOST_CHECK_EXCEPTION(out.sum().backward(), fsdp::StateError,
                          [](const fsdp::StateError& e) { return mentions(e, "'inputs'[0]"); });
  }
  // The single-tensor form and the declared parameters: same gradients as plain.
  {
    lin->zero_grad();
    lin(x).sum().backward();
    const at::Tensor expected = lin->weight.grad().clone();
    lin->zero_grad();
    fsdp::activation_checkpoint([&](const at::Tensor& t) { return lin(t); }, x.detach(), lin->parameters())
        .sum()
        .backward();
    BOOST_TEST(max_abs_diff(lin->weight.grad(), expected) == 0.0);
  }
  const auto any_module = [](const torch::nn::Module&) { return true; };
  BOOST_CHECK_EXCEPTION(fsdp::activation_checkpoint_every_nth(0, any_module), fsdp::ArgumentError,
                        [](const fsdp::ArgumentError& e) { return names(e, "n"); });
  BOOST_CHECK_EXCEPTION(fsdp::activation_checkpoint_every_nth(1, nullptr), fsdp::ArgumentError,
                        [](const fsdp::ArgumentError& e) { return names(e, "filter"); });
  BOOST_CHECK_EXCEPTION(
      fsdp::apply_activation_checkpointing(nullptr, fsdp::activation_checkpoint_names({"a"})),
      fsdp::ArgumentError, [](const fsdp::ArgumentError& e) { return names(e, "root"); });
  BOOST_CHECK_EXCEPTION(fsdp::activation_checkpoint_module(nullptr), fsdp::ArgumentError,
                        [](const fsdp::ArgumentError& e) { return names(e, "module"); });
  // Marks come and go.
  Holder h;
  fsdp::activation_checkpoint_module(h->inner);
  BOOST_TEST(fsdp::activation_checkpoint_options_of(*h->inner.ptr()).has_value());
  fsdp::remove_activation_checkpoint(*h->inner.ptr());
  BOOST_TEST(!fsdp::activation_checkpoint_options_of(*h->inner.ptr()).has_value());
}

// ---------------------------------------------------------------------------
// [ours] Checkpointing is transparent under mixed precision (bf16 compute,
// fp32 reduction): the parameter edges of a non-reentrant checkpoint must lead
// to the AccumulateGrad node of the bf16 compute form, which fully_shard drops
// at every reshard (DESIGN section 3, trap 3), so the checkpoint re-creates it
// by unsharding first. This is an invariance check (the same sharded run with
// and without checkpointing must agree bitwise: the recompute repeats the same
// operations), not a precision baseline -- the bf16 precision rows belong to
// the precision suite's single-card references.
BOOST_AUTO_TEST_CASE(test_ac_mixed_precision_fsdp) {  // [ours]
  const NetConfig c;
  fsdp::FullyShardOptions opts;
  opts.mp_policy.param_dtype = at::kBFloat16;
  opts.mp_policy.reduce_dtype = at::kFloat;
  struct Run {
    std::vector<double> losses;
    std::vector<std::map<std::string, at::Tensor>> grads;
  };
  auto run = [&](std::optional<fsdp::ActivationCheckpointMode> mode) {
    auto s = make_fsdp(61, c, opts);
    if (mode) {
      fsdp::ActivationCheckpointOptions options;
      options.mode = *mode;
      mark_all_blocks(s.net, options);
    }
    torch::optim::SGD opt(s.net->parameters(), torch::optim::SGDOptions(0.1));
    Run r;
    for (int step = 0; step < 2; ++step) {
      const auto batch = prec::to_device(toy::global_batch(600 + step, 16, c.in, c.out));
      const auto mine = toy::slice(batch, spmd::rank(), spmd::world_size());
      opt.zero_grad();
      r.losses.push_back(backward(toy::mse(s.model(mine.x), mine.y)));
      r.grads.emplace_back();
      for (const auto& item : s.net->named_parameters()) {
        r.grads.back()[item.key()] = item.value().grad().defined()
                                         ? item.value().grad().detach().cpu().clone()
                                         : at::Tensor();
      }
      opt.step();
    }
    for (size_t i = 0; i < c.hidden.size(); ++i) {
      BOOST_TEST(block(s.net, i).bwd_calls == (mode ? 2 : 0));
    }
    return r;
  };
  const Run plain = run(std::nullopt);
  for (auto mode : {fsdp::ActivationCheckpointMode::NonReentrant, fsdp::ActivationCheckpointMode::Reentrant}) {
    const std::string tag = mode == fsdp::ActivationCheckpointMode::Reentrant ? "reentrant" : "non-reentrant";
    const Run ac = run(mode);
    double worst = 0;
    int64_t undefined = 0;
    for (size_t step = 0; step < plain.grads.size(); ++step) {
      worst = std::max(worst, std::abs(ac.losses[step] - plain.losses[step]));
      for (const auto& [name, g] : plain.grads[step]) {
        const at::Tensor& mine = ac.grads[step].at(name);
        if (!g.defined() || !mine.defined()) {
          ++undefined;
          continue;
        }
        worst = std::max(worst, max_abs_diff(mine, g));
      }
    }
    worst = prec::max_over_ranks(worst);
    report("ours bf16 " + tag, "loss and grads, AC vs the same run without AC", worst, 0);
    BOOST_TEST(undefined == 0);
    BOOST_TEST(worst == 0.0);
  }
}

// The 0.1.0 names (fsdp/checkpoint.h, deprecated for one release) still
// compile and reach the renamed API: same output and gradient as
// activation_checkpoint, and a module marked through the old name reads back
// through the new one.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
BOOST_AUTO_TEST_CASE(test_deprecated_checkpoint_names_forward) {  // [ours]
  const auto on_dev = at::TensorOptions().device(spmd::device());
  torch::nn::Linear lin(3, 3);
  lin->to(spmd::device());
  const at::Tensor x = at::randn({2, 3}, on_dev);
  auto lin_fn = [&](const std::vector<at::Tensor>& in) { return lin(in[0]); };
  const at::Tensor old_out = fsdp::checkpoint(lin_fn, {x}, lin->parameters());
  old_out.sum().backward();
  const at::Tensor old_grad = lin->weight.grad().clone();
  lin->weight.mutable_grad().zero_();
  const at::Tensor new_out = fsdp::activation_checkpoint(lin_fn, {x}, lin->parameters());
  new_out.sum().backward();
  BOOST_TEST(at::equal(old_out, new_out));
  BOOST_TEST(at::equal(old_grad, lin->weight.grad()));

  fsdp::CheckpointOptions options;
  options.mode = fsdp::CheckpointMode::Reentrant;
  fsdp::checkpoint_module(lin.ptr(), options);
  const auto marked = fsdp::activation_checkpoint_options_of(*lin);
  BOOST_TEST_REQUIRE(marked.has_value());
  BOOST_TEST((marked->mode == fsdp::ActivationCheckpointMode::Reentrant));
  fsdp::uncheckpoint_module(*lin);
  BOOST_TEST(!fsdp::checkpoint_options_of(*lin).has_value());
}
#pragma GCC diagnostic pop
