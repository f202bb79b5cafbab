// Activation checkpointing: the segment node, module marks and policies.
#include "fsdp/activation_checkpoint.h"

#include "fsdp/errors.h"
#include "base/torch_compat.h"
#include "sharding/query.h"

#include <ATen/ATen.h>
#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <mutex>
#include <unordered_set>

namespace fsdp {
namespace {

using torch::autograd::variable_list;

std::string index_str(size_t i) { return "[" + std::to_string(i) + "]"; }

// One saved input: the tensor kept until backward, where it goes back to, and
// the version it had when it still aliases the caller's tensor (a recompute
// from a tensor modified in place since would silently differ).
struct SavedInput {
  at::Tensor kept;
  c10::Device device{c10::kCPU};
  bool requires_grad = false;
  std::optional<int64_t> version;
};

SavedInput save_input(const at::Tensor& x, const ActivationCheckpointOptions& options) {
  SavedInput s;
  s.device = x.device();
  s.requires_grad = x.requires_grad();
  const at::Tensor plain = x.detach();
  if (options.swap_inputs_to_host && !x.is_cpu()) {
    const bool pin = options.pin_memory && at::hasCUDA();
    s.kept = at::empty(plain.sizes(), plain.options().device(c10::kCPU).pinned_memory(pin));
    // Asynchronous only into pinned memory; the copy is queued on the
    // current stream, ahead of anything that could reuse the device buffer.
    s.kept.copy_(plain, /*non_blocking=*/pin);
  } else {
    s.kept = plain;
    s.version = x._version();
  }
  return s;
}

at::Tensor restore_input(const SavedInput& s, size_t index) {
  if (s.version && s.kept._version() != *s.version) {
    throw StateError("checkpoint: 'inputs'" + index_str(index) +
                     " was modified in place after the checkpointed forward (version " +
                     std::to_string(*s.version) + " -> " + std::to_string(s.kept._version()) +
                     "); the recompute would see other values. Pass a copy, or modify a clone");
  }
  at::Tensor x = s.kept.device() == s.device
                     ? s.kept
                     : s.kept.to(s.device, /*non_blocking=*/s.kept.is_pinned());
  x = x.detach();
  if (s.requires_grad) x.set_requires_grad(true);
  return x;
}

// Sets the saved RNG states for the recompute and puts the current ones back
// afterwards, also when the recompute throws.
class RngFork {
 public:
  explicit RngFork(const std::vector<std::pair<c10::Device, at::Tensor>>& states) {
    for (const auto& [device, state] : states) {
      previous_.emplace_back(device, compat::rng_state(device));
      compat::set_rng_state(device, state);
    }
  }
  ~RngFork() {
    for (const auto& [device, state] : previous_) compat::set_rng_state(device, state);
  }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  std::vector<std::pair<c10::Device, at::Tensor>> previous_;
};

std::vector<std::pair<c10::Device, at::Tensor>> capture_rng(const std::vector<at::Tensor>& inputs) {
  std::vector<std::pair<c10::Device, at::Tensor>> out;
  out.emplace_back(c10::Device(c10::kCPU), compat::rng_state(c10::Device(c10::kCPU)));
  for (const auto& x : inputs) {
    if (!x.is_cuda()) continue;
    const bool seen = std::any_of(out.begin(), out.end(),
                                  [&](const auto& e) { return e.first == x.device(); });
    if (!seen) out.emplace_back(x.device(), compat::rng_state(x.device()));
  }
  return out;
}

const c10::TensorImpl* impl_of(const at::Tensor& t) { return t.unsafeGetTensorImpl(); }

// The nodes a recompute creates: those made on the recompute's thread from
// its first sequence number on. Sequence numbers count per thread, and the
// recompute runs wherever autograd runs the checkpoint's node (the caller's
// thread on CPU, a device thread on CUDA), so a number alone would take a
// forward node made on another thread for a new one.
struct RecomputeMark {
  uint64_t thread = at::RecordFunction::currentThreadId();
  uint64_t first_sequence_nr = at::sequence_number::peek();
  bool made(const torch::autograd::Node& node) const {
    return node.thread_id() == thread && node.sequence_nr() >= first_sequence_nr;
  }
};

// What a recompute must not reach, found by walking its graph from the output:
// nodes it did not create (fn read a non-leaf tensor requiring grad that is
// not one of its inputs: its gradient would be lost, or in reentrant mode
// flow twice), leaves outside inputs/params (non-reentrant only: their
// gradient has no way out).
void check_recomputed_graph(const at::Tensor& out, const RecomputeMark& mark,
                            const std::unordered_set<const c10::TensorImpl*>* declared) {
  std::vector<torch::autograd::Node*> stack;
  std::unordered_set<torch::autograd::Node*> seen;
  auto root = torch::autograd::impl::gradient_edge(out).function;
  if (root) stack.push_back(root.get());
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    if (auto* leaf = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      if (declared && leaf->variable.requires_grad() &&
          declared->count(impl_of(leaf->variable)) == 0) {
        throw StateError(
            "checkpoint: fn reads a tensor of shape " + std::string(c10::str(leaf->variable.sizes())) +
            " that requires grad but is neither in 'inputs' nor in 'params'; a non-reentrant "
            "checkpoint returns gradients only to those. Pass it in 'params' (or use "
            "ActivationCheckpointMode::Reentrant)");
      }
      continue;
    }
    if (!mark.made(*node)) {
      throw StateError("checkpoint: fn reads a tensor that requires grad and was computed outside "
                       "it (reached " + node->name() + "); pass such tensors in 'inputs'");
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.function) stack.push_back(edge.function.get());
    }
  }
}

// Stands for the checkpointed segment in the outer graph. Next edges: the
// inputs that require grad, then (non-reentrant) the params that do.
class ActivationCheckpointNode final : public torch::autograd::Node {
 public:
  ActivationCheckpointNode(ActivationCheckpointFunction fn, ActivationCheckpointOptions options, std::vector<SavedInput> saved,
                 std::vector<at::Tensor> grad_params,
                 std::vector<std::pair<c10::Device, at::Tensor>> rng)
      : fn_(std::move(fn)),
        options_(std::move(options)),
        saved_(std::move(saved)),
        grad_params_(std::move(grad_params)),
        rng_(std::move(rng)) {}

  std::string name() const override { return "fsdp::ActivationCheckpointBackward"; }

  void release_variables() override {
    released_ = true;
    fn_ = nullptr;
    saved_.clear();
    grad_params_.clear();
    rng_.clear();
  }

  variable_list apply(variable_list&& grads) override {
    if (released_) {
      throw StateError("checkpoint: backward through a checkpointed segment a second time; its "
                       "saved inputs were freed (use retain_graph=true on the first backward)");
    }
    variable_list none(num_outputs());
    if (grads.empty() || !grads[0].defined()) return none;

    std::vector<at::Tensor> inputs;
    inputs.reserve(saved_.size());
    for (size_t i = 0; i < saved_.size(); ++i) inputs.push_back(restore_input(saved_[i], i));
    if (options_.observer) options_.observer({ActivationCheckpointEvent::Kind::Recompute, inputs});

    at::Tensor out;
    const RecomputeMark mark;
    {
      std::optional<RngFork> fork;
      if (options_.preserve_rng_state) fork.emplace(rng_);
      c10::AutoGradMode grad_mode(true);
      detail::RecomputeGuard recompute;
      out = fn_(inputs);
    }
    if (!out.defined()) throw StateError("checkpoint: fn returned an undefined tensor in recompute");

    std::vector<at::Tensor> targets;
    for (const auto& x : inputs) {
      if (x.requires_grad()) targets.push_back(x);
    }
    const bool reentrant = options_.mode == ActivationCheckpointMode::Reentrant;
    if (!reentrant) targets.insert(targets.end(), grad_params_.begin(), grad_params_.end());
    std::unordered_set<const c10::TensorImpl*> declared;
    for (const auto& t : targets) declared.insert(impl_of(t));
    check_recomputed_graph(out, mark, reentrant ? nullptr : &declared);
    if (!out.requires_grad()) return none;

    const at::Tensor& grad_out = grads[0];
    if (!reentrant) {
      return torch::autograd::grad({out}, targets, {grad_out}, /*retain_graph=*/false,
                                   /*create_graph=*/false, /*allow_unused=*/true);
    }
    torch::autograd::backward({out}, {grad_out});
    variable_list result;
    for (const auto& x : targets) result.push_back(x.grad());
    return result;
  }

 private:
  ActivationCheckpointFunction fn_;
  ActivationCheckpointOptions options_;
  std::vector<SavedInput> saved_;
  std::vector<at::Tensor> grad_params_;
  std::vector<std::pair<c10::Device, at::Tensor>> rng_;
  bool released_ = false;
};

at::Tensor run_plain(const ActivationCheckpointFunction& fn, const std::vector<at::Tensor>& inputs) {
  at::Tensor out = fn(inputs);
  if (!out.defined()) throw StateError("checkpoint: fn returned an undefined tensor");
  return out;
}

// ---- module marks ----

struct Mark {
  std::weak_ptr<torch::nn::Module> module;
  const torch::nn::Module* ptr;
  ActivationCheckpointOptions options;
};

struct Marks {
  std::mutex mu;
  std::vector<Mark> list;
};

Marks& marks() {
  static Marks m;
  return m;
}

void prune(std::vector<Mark>& list) {
  list.erase(std::remove_if(list.begin(), list.end(),
                            [](const Mark& m) { return m.module.expired(); }),
             list.end());
}

}  // namespace

at::Tensor activation_checkpoint(const ActivationCheckpointFunction& fn, const std::vector<at::Tensor>& inputs,
                      const std::vector<at::Tensor>& params, const ActivationCheckpointOptions& options) {
  if (!fn) throw ArgumentError("fn", "checkpoint: 'fn' is empty; accepted: a callable");
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) {
      throw ArgumentError("inputs", "checkpoint: 'inputs'" + index_str(i) +
                                        " is undefined; accepted: defined tensors");
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].defined()) {
      throw ArgumentError("params", "checkpoint: 'params'" + index_str(i) +
                                        " is undefined; accepted: defined tensors");
    }
  }
  const bool reentrant = options.mode == ActivationCheckpointMode::Reentrant;
  std::vector<at::Tensor> grad_inputs, grad_params;
  for (const auto& x : inputs) {
    if (x.requires_grad()) grad_inputs.push_back(x);
  }
  std::unordered_set<const c10::TensorImpl*> listed;
  for (const auto& p : params) {
    if (p.requires_grad() && listed.insert(impl_of(p)).second) grad_params.push_back(p);
  }
  if (!c10::GradMode::is_enabled() || (grad_inputs.empty() && grad_params.empty())) {
    return run_plain(fn, inputs);
  }

  // fully_shard units whose parameters would not present AccumulateGrad
  // nodes of their compute form are unsharded before the edges are taken.
  std::vector<detail::UnitRef> unsharded_here;
  if (!reentrant) unsharded_here = detail::unshard_for_grad_edges(grad_params);
  torch::autograd::edge_list edges;
  for (const auto& x : grad_inputs) edges.push_back(torch::autograd::impl::gradient_edge(x));
  if (!reentrant) {
    for (const auto& p : grad_params) edges.push_back(torch::autograd::impl::gradient_edge(p));
  }

  auto rng = options.preserve_rng_state ? capture_rng(inputs)
                                        : std::vector<std::pair<c10::Device, at::Tensor>>{};
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = run_plain(fn, inputs);
  }
  // A unit the segment did not run stays as its forward would leave it.
  detail::reshard_as_after_forward(unsharded_here);

  std::vector<SavedInput> saved;
  saved.reserve(inputs.size());
  for (const auto& x : inputs) saved.push_back(save_input(x, options));
  if (options.observer) {
    std::vector<at::Tensor> kept;
    for (const auto& s : saved) kept.push_back(s.kept);
    options.observer({ActivationCheckpointEvent::Kind::Saved, kept});
  }
  if (!at::isFloatingType(out.scalar_type()) && !at::isComplexType(out.scalar_type())) {
    return out;  // not differentiable: nothing to recompute for
  }
  auto node = compat::make_node<ActivationCheckpointNode>(
      fn, options, std::move(saved), reentrant ? std::vector<at::Tensor>{} : grad_params,
      std::move(rng));
  node->set_next_edges(std::move(edges));
  // A fresh Variable: fn may have returned one of its inputs (or a parameter)
  // itself, whose own history must stay as it is.
  at::Tensor result = out.detach();
  torch::autograd::set_history(result, node);
  return result;
}

at::Tensor activation_checkpoint(const ActivationCheckpointFunction& fn, const std::vector<at::Tensor>& inputs,
                      const ActivationCheckpointOptions& options) {
  return activation_checkpoint(fn, inputs, std::vector<at::Tensor>{}, options);
}

at::Tensor activation_checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn,
                      const at::Tensor& input, const std::vector<at::Tensor>& params,
                      const ActivationCheckpointOptions& options) {
  if (!fn) throw ArgumentError("fn", "checkpoint: 'fn' is empty; accepted: a callable");
  if (!input.defined()) {
    throw ArgumentError("input", "checkpoint: 'input' is undefined; accepted: a defined tensor");
  }
  return activation_checkpoint([fn](const std::vector<at::Tensor>& in) { return fn(in[0]); },
                    std::vector<at::Tensor>{input}, params, options);
}

at::Tensor activation_checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn,
                      const at::Tensor& input, const ActivationCheckpointOptions& options) {
  return activation_checkpoint(fn, input, std::vector<at::Tensor>{}, options);
}

void activation_checkpoint_module(const std::shared_ptr<torch::nn::Module>& module,
                       ActivationCheckpointOptions options) {
  if (!module) throw ArgumentError("module", "activation_checkpoint_module: 'module' is null");
  Marks& m = marks();
  std::lock_guard<std::mutex> lock(m.mu);
  prune(m.list);
  for (auto& mark : m.list) {
    if (mark.ptr == module.get()) {
      mark.options = std::move(options);
      return;
    }
  }
  m.list.push_back({module, module.get(), std::move(options)});
}

void remove_activation_checkpoint(const torch::nn::Module& module) {
  Marks& m = marks();
  std::lock_guard<std::mutex> lock(m.mu);
  m.list.erase(std::remove_if(m.list.begin(), m.list.end(),
                              [&](const Mark& mark) { return mark.ptr == &module; }),
               m.list.end());
}

std::optional<ActivationCheckpointOptions> activation_checkpoint_options_of(const torch::nn::Module& module) {
  return detail::activation_checkpoint_options_for(module);
}

int64_t apply_activation_checkpointing(const std::shared_ptr<torch::nn::Module>& root,
                                       const ActivationCheckpointPolicy& policy) {
  if (!root) throw ArgumentError("root", "apply_activation_checkpointing: 'root' is null");
  if (!policy) {
    throw ArgumentError("policy", "apply_activation_checkpointing: 'policy' is empty; accepted: "
                                  "a callable returning options or nullopt");
  }
  int64_t marked = 0;
  for (const auto& item : root->named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    if (auto options = policy(item.key(), *item.value())) {
      activation_checkpoint_module(item.value(), std::move(*options));
      ++marked;
    }
  }
  return marked;
}

ActivationCheckpointPolicy activation_checkpoint_every_nth(int64_t n,
                                      std::function<bool(const torch::nn::Module&)> filter,
                                      ActivationCheckpointOptions options) {
  if (n < 1) {
    throw ArgumentError("n", "activation_checkpoint_every_nth: 'n' = " + std::to_string(n) +
                                 "; accepted: n >= 1");
  }
  if (!filter) {
    throw ArgumentError("filter", "activation_checkpoint_every_nth: 'filter' is empty; accepted: a "
                                  "predicate selecting the layers to count (e.g. by type)");
  }
  // apply_activation_checkpointing visits the root first: a new count starts there.
  auto count = std::make_shared<int64_t>(0);
  return [n, options = std::move(options), filter = std::move(filter), count](
             const std::string& name,
             const torch::nn::Module& module) -> std::optional<ActivationCheckpointOptions> {
    if (name.empty()) *count = 0;
    if (!filter(module)) return std::nullopt;
    return (*count)++ % n == 0 ? std::optional<ActivationCheckpointOptions>(options) : std::nullopt;
  };
}

ActivationCheckpointPolicy activation_checkpoint_names(std::vector<std::string> names, ActivationCheckpointOptions options) {
  return [names = std::move(names), options = std::move(options)](
             const std::string& name,
             const torch::nn::Module&) -> std::optional<ActivationCheckpointOptions> {
    if (std::find(names.begin(), names.end(), name) == names.end()) return std::nullopt;
    return options;
  };
}

namespace detail {

std::optional<ActivationCheckpointOptions> activation_checkpoint_options_for(const torch::nn::Module& module) {
  Marks& m = marks();
  std::lock_guard<std::mutex> lock(m.mu);
  for (const auto& mark : m.list) {
    if (mark.ptr == &module && !mark.module.expired()) return mark.options;
  }
  return std::nullopt;
}

std::vector<at::Tensor> module_params(const torch::nn::Module& module) {
  return module.parameters(/*recurse=*/true);
}

}  // namespace detail
}  // namespace fsdp
