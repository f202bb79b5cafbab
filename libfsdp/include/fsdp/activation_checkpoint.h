// Activation checkpointing: trade compute for memory by keeping only a
// segment's inputs in forward and recomputing the segment in backward.
//
// LibTorch C++ has no torch.utils.checkpoint and (in 1.13) no default
// saved-tensor hooks, so both modes are built on an autograd node of our own
// that stands for the whole segment in the outer graph:
//
//  - ActivationCheckpointMode::NonReentrant (default): the node's edges lead to the
//    segment's inputs *and* to the parameters it reads. Its backward
//    recomputes the segment and takes torch::autograd::grad of the recomputed
//    outputs with respect to both; the parameter gradients leave the node
//    like any other gradient, so they reach each parameter's AccumulateGrad
//    node in the outer backward (and fully_shard's post-accumulate-grad hooks
//    fire there). No nested backward() runs, nothing is accumulated inside the
//    recompute.
//  - ActivationCheckpointMode::Reentrant: the node's edges lead to the inputs only. Its
//    backward recomputes the segment and runs a nested
//    torch::autograd::backward over it, which accumulates the parameter
//    gradients directly (the classic torch.utils.checkpoint(use_reentrant=True)).
//
// Both run the segment's forward under no-grad (so no activation inside it is
// saved) and its recompute with grad enabled, with the forward's RNG state.
//
// Function form:
//
//   at::Tensor y = fsdp::activation_checkpoint(
//       [&](const std::vector<at::Tensor>& in) { return mlp(in[0]) + in[1]; },
//       {x, skip}, mlp->parameters());
//
// Module form -- the idiom, mirroring fsdp::Sharded<M>: a parent declares the
// child as fsdp::ActivationCheckpointed<M>, and the child is checkpointed when it was
// marked with activation_checkpoint_module() or chosen by apply_activation_checkpointing()
// (unmarked, the holder simply forwards). With fully_shard, put the checkpoint
// *outside* the unit, so that the recompute re-enters the unit's forward (which
// re-gathers its parameters when they were resharded after forward):
//
//   struct NetImpl : torch::nn::Module {
//     NetImpl() { for (int i = 0; i < 4; ++i) blocks.push_back(register_module(
//                   "block" + std::to_string(i), std::make_shared<BlockImpl>())); ... }
//     torch::Tensor forward(torch::Tensor x) {
//       for (auto& b : blocks) x = b(x);   // checkpointed + sharded, by the holder
//       return head(x);
//     }
//     std::vector<fsdp::ActivationCheckpointed<fsdp::Sharded<Block>>> blocks;
//     torch::nn::Linear head{nullptr};
//   };
//
//   for (auto& b : net->blocks) fsdp::fully_shard(b);
//   auto model = fsdp::fully_shard(net);                      // root last
//   fsdp::apply_activation_checkpointing(net.ptr(),           // selective, per layer
//       [](const std::string& name, const torch::nn::Module&) {
//         return name == "block0" || name == "block2"
//                    ? std::optional<fsdp::ActivationCheckpointOptions>(fsdp::ActivationCheckpointOptions{})
//                    : std::nullopt;
//       });
//
// Under fully_shard, a recompute re-gathers resharded units but runs no root
// logic, prefetch or pre-backward hook, and reshards only after the unit's
// backward.
//
// Not supported: double backward through a checkpoint (create_graph=true),
// autocast state replay, children of torch::nn::Sequential (declare a
// ActivationCheckpointed<M> member instead), tensors that require grad reaching the
// segment other than through `inputs`/`params` (an error names them).
#pragma once

#include "fsdp/errors.h"
#include "fsdp/module_holder.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <array>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdp {

enum class ActivationCheckpointMode {
  NonReentrant,  // recompute + autograd::grad; parameter grads through the outer graph
  Reentrant,     // recompute + nested autograd::backward
};

// What a checkpoint reports to ActivationCheckpointOptions::observer.
struct ActivationCheckpointEvent {
  enum class Kind {
    Saved,      // forward: `tensors` are the saved inputs, as kept until backward
    Recompute,  // backward: `tensors` are the inputs the recompute passes to fn
  };
  Kind kind;
  // Handles to the tensors themselves (keeping them prolongs their life).
  std::vector<at::Tensor> tensors;
};

struct ActivationCheckpointOptions {
  ActivationCheckpointMode mode = ActivationCheckpointMode::NonReentrant;
  // Run the recompute with the RNG state the forward started with (the CPU
  // generator, and the CUDA generators of the inputs' devices), so dropout
  // and other random ops draw the same numbers. false: fn must then be
  // deterministic, or the gradients will not match the forward.
  bool preserve_rng_state = true;
  // Activation swap: keep the saved inputs in host memory between forward and
  // backward (pinned when CUDA is present, copied asynchronously) and move them
  // back to their original device for the recompute. Inputs already on the
  // CPU are kept as they are.
  bool swap_inputs_to_host = false;
  bool pin_memory = true;
  // Diagnostics: called at save time and at each recompute.
  std::function<void(const ActivationCheckpointEvent&)> observer;
};

// The segment: maps the inputs (in order) to one output tensor.
using ActivationCheckpointFunction = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

// Runs fn(inputs) without saving its activations and recomputes it in
// backward. `params`: the tensors fn reads other than its inputs that need
// gradients -- in non-reentrant mode gradients reach *only* inputs and params
// (a backward that finds fn reading another tensor requiring grad throws
// StateError naming "params"); in reentrant mode the nested backward
// accumulates into whatever fn reads, and `params` only decides whether the
// output requires grad when no input does. When grad mode is off, or nothing
// requires grad, this is just fn(inputs).
// Errors: empty fn -> ArgumentError("fn"); an undefined input ->
// ArgumentError("inputs"); an undefined param -> ArgumentError("params");
// fn returning an undefined tensor -> StateError. In backward: an input
// modified in place after forward -> StateError naming "inputs".
at::Tensor activation_checkpoint(const ActivationCheckpointFunction& fn, const std::vector<at::Tensor>& inputs,
                      const std::vector<at::Tensor>& params, const ActivationCheckpointOptions& options = {});
at::Tensor activation_checkpoint(const ActivationCheckpointFunction& fn, const std::vector<at::Tensor>& inputs,
                      const ActivationCheckpointOptions& options = {});
// One input.
at::Tensor activation_checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn,
                      const at::Tensor& input, const std::vector<at::Tensor>& params,
                      const ActivationCheckpointOptions& options = {});
at::Tensor activation_checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn,
                      const at::Tensor& input, const ActivationCheckpointOptions& options = {});

// ---- module marking (what ActivationCheckpointed<M> consults) ------------------------

// Marks `module`: an ActivationCheckpointed<M> holding it runs its forward under
// activation_checkpoint() with `options`, passing every parameter of the module (and of
// its submodules) as `params`. Re-marking replaces the options.
// Errors: null module -> ArgumentError("module").
void activation_checkpoint_module(const std::shared_ptr<torch::nn::Module>& module,
                       ActivationCheckpointOptions options = {});
// Removes the mark (no-op when unmarked).
void remove_activation_checkpoint(const torch::nn::Module& module);
// The options `module` is marked with, if any.
std::optional<ActivationCheckpointOptions> activation_checkpoint_options_of(const torch::nn::Module& module);

// Selective checkpointing, per layer: returns the options to checkpoint the
// module with, or nullopt to leave it alone. `name` is the module's path
// below the root ("" for the root, "blocks.0", ...).
using ActivationCheckpointPolicy = std::function<std::optional<ActivationCheckpointOptions>(
    const std::string& name, const torch::nn::Module& module)>;

// Calls `policy` on `root` and every module below it and marks the chosen
// ones (a module the policy rejects keeps any earlier mark). Only modules that
// their parent declares as ActivationCheckpointed<M> are affected at run time. Returns
// how many were marked. Errors: null root -> ArgumentError("root"); empty
// policy -> ArgumentError("policy").
int64_t apply_activation_checkpointing(const std::shared_ptr<torch::nn::Module>& root,
                                       const ActivationCheckpointPolicy& policy);

// Ready-made policies.
// Every `n`-th (the 1st, (n+1)-th, ...) of the modules for which `filter`
// holds, in named_modules() order (e.g. filter = "is a Block": every other
// block for n = 2). Errors: n < 1 -> ArgumentError("n"); empty filter ->
// ArgumentError("filter").
ActivationCheckpointPolicy activation_checkpoint_every_nth(int64_t n,
                                      std::function<bool(const torch::nn::Module&)> filter,
                                      ActivationCheckpointOptions options = {});
// Exactly the modules with these names.
ActivationCheckpointPolicy activation_checkpoint_names(std::vector<std::string> names, ActivationCheckpointOptions options = {});

namespace detail {

// The options `module` is marked with (fast path for ActivationCheckpointed<M>).
std::optional<ActivationCheckpointOptions> activation_checkpoint_options_for(const torch::nn::Module& module);

template <typename T>
constexpr bool is_tensor_arg_v = std::is_same_v<std::decay_t<T>, at::Tensor>;

// For each argument position, its index among the tensor arguments (or
// npos for a non-tensor argument).
template <typename... Args>
constexpr std::array<size_t, sizeof...(Args)> tensor_slots() {
  std::array<size_t, sizeof...(Args)> out{};
  size_t tensors = 0, i = 0;
  ((out[i++] = is_tensor_arg_v<Args> ? tensors++ : static_cast<size_t>(-1)), ...);
  return out;
}

template <size_t I, typename Tuple>
decltype(auto) pick_arg(Tuple& kept, const std::vector<at::Tensor>& inputs, size_t slot) {
  using T = std::tuple_element_t<I, Tuple>;
  if constexpr (std::is_same_v<T, at::Tensor>) {
    return at::Tensor(inputs[slot]);
  } else {
    return static_cast<const T&>(std::get<I>(kept));
  }
}

template <typename Holder, typename Tuple, size_t... I>
at::Tensor call_with_inputs(Holder& holder, Tuple& kept, const std::vector<at::Tensor>& inputs,
                            const std::array<size_t, sizeof...(I)>& slots,
                            std::index_sequence<I...>) {
  return holder(pick_arg<I>(kept, inputs, slots[I])...);
}

// Non-tensor arguments are kept by value; tensor positions hold nothing (the
// tensors travel as checkpoint inputs, so the holder never pins them).
template <typename T>
std::decay_t<T> keep_arg(T&& value) {
  if constexpr (is_tensor_arg_v<T>) {
    return at::Tensor();
  } else {
    return std::forward<T>(value);
  }
}

std::vector<at::Tensor> module_params(const torch::nn::Module& module);

}  // namespace detail

// Module holder that routes forward through activation_checkpoint() when its module is
// marked (activation_checkpoint_module / apply_activation_checkpointing), and forwards
// plainly otherwise. M is a LibTorch module holder (torch::nn::Linear,
// TORCH_MODULE(Block)) or fsdp::Sharded<...> of one. Tensor arguments become
// the checkpoint's inputs; other arguments are copied into the recompute.
// The forward must return one at::Tensor.
template <typename M>
class ActivationCheckpointed : public detail::HolderWrapper<M> {
 public:
  ActivationCheckpointed() : detail::HolderWrapper<M>(nullptr) {}
  ActivationCheckpointed(std::nullptr_t) : detail::HolderWrapper<M>(nullptr) {}  // NOLINT: mirrors ModuleHolder
  // From M itself or from anything M is built from (register_module's
  // shared_ptr<Impl>, the plain holder for ActivationCheckpointed<Sharded<X>>).
  template <typename T, typename = std::enable_if_t<
                            !std::is_same_v<std::decay_t<T>, ActivationCheckpointed> &&
                            !std::is_same_v<std::decay_t<T>, std::nullptr_t> &&
                            std::is_constructible_v<M, T&&>>>
  ActivationCheckpointed(T&& from) : detail::HolderWrapper<M>(M(std::forward<T>(from))) {}  // NOLINT: implicit like M

  template <typename... Args>
  at::Tensor forward(Args&&... args) {
    static_assert(
        ((!std::is_same_v<std::decay_t<Args>, std::vector<at::Tensor>> &&
          !std::is_same_v<std::decay_t<Args>, std::optional<at::Tensor>>) && ...),
        "fsdp::ActivationCheckpointed<M>: pass tensors as separate at::Tensor arguments (containers of "
        "tensors would be kept alive and get no gradient through the checkpoint)");
    if (this->holder_.is_empty()) {
      throw StateError("fsdp::ActivationCheckpointed<M>: forward on an empty holder; assign the module "
                       "(e.g. from register_module) first");
    }
    auto options = detail::activation_checkpoint_options_for(*this->holder_.ptr());
    if (!options) return this->holder_(std::forward<Args>(args)...);
    std::vector<at::Tensor> inputs;
    (
        [&](auto&& a) {
          if constexpr (detail::is_tensor_arg_v<decltype(a)>) inputs.push_back(a);
        }(args),
        ...);
    constexpr auto slots = detail::tensor_slots<Args...>();
    auto kept = std::make_tuple(detail::keep_arg(std::forward<Args>(args))...);
    M holder = this->holder_;
    ActivationCheckpointFunction fn = [holder, kept, slots](const std::vector<at::Tensor>& in) mutable {
      return detail::call_with_inputs(holder, kept, in, slots,
                                      std::index_sequence_for<Args...>{});
    };
    return activation_checkpoint(fn, inputs, detail::module_params(*this->holder_.ptr()), *options);
  }
  template <typename... Args>
  at::Tensor operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }
};

}  // namespace fsdp
