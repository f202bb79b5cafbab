// Deprecated (0.2.0; removed in 0.3.0): activation checkpointing is now
// declared in fsdp/activation_checkpoint.h, with every name prefixed so that
// "checkpoint" alone can mean saved training state. This header forwards to it
// and keeps the 0.1.0 names as deprecated aliases; the compiler names the
// replacement at each use.
#pragma once

#include "fsdp/activation_checkpoint.h"

#include <utility>

namespace fsdp {

using CheckpointMode [[deprecated("use fsdp::ActivationCheckpointMode")]] = ActivationCheckpointMode;
using CheckpointEvent [[deprecated("use fsdp::ActivationCheckpointEvent")]] = ActivationCheckpointEvent;
using CheckpointOptions [[deprecated("use fsdp::ActivationCheckpointOptions")]] =
    ActivationCheckpointOptions;
using CheckpointFunction [[deprecated("use fsdp::ActivationCheckpointFunction")]] =
    ActivationCheckpointFunction;
using CheckpointPolicy [[deprecated("use fsdp::ActivationCheckpointPolicy")]] =
    ActivationCheckpointPolicy;
template <typename M>
using Checkpointed [[deprecated("use fsdp::ActivationCheckpointed")]] = ActivationCheckpointed<M>;

// The four overloads spelled out: a forwarding template could not take the
// braced input lists ({x, skip}) that calls to the old name pass.
[[deprecated("use fsdp::activation_checkpoint")]] inline at::Tensor checkpoint(
    const ActivationCheckpointFunction& fn, const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& params, const ActivationCheckpointOptions& options = {}) {
  return activation_checkpoint(fn, inputs, params, options);
}
[[deprecated("use fsdp::activation_checkpoint")]] inline at::Tensor checkpoint(
    const ActivationCheckpointFunction& fn, const std::vector<at::Tensor>& inputs,
    const ActivationCheckpointOptions& options = {}) {
  return activation_checkpoint(fn, inputs, options);
}
[[deprecated("use fsdp::activation_checkpoint")]] inline at::Tensor checkpoint(
    const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input,
    const std::vector<at::Tensor>& params, const ActivationCheckpointOptions& options = {}) {
  return activation_checkpoint(fn, input, params, options);
}
[[deprecated("use fsdp::activation_checkpoint")]] inline at::Tensor checkpoint(
    const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input,
    const ActivationCheckpointOptions& options = {}) {
  return activation_checkpoint(fn, input, options);
}
[[deprecated("use fsdp::activation_checkpoint_module")]] inline void checkpoint_module(
    const std::shared_ptr<torch::nn::Module>& module, ActivationCheckpointOptions options = {}) {
  activation_checkpoint_module(module, std::move(options));
}
[[deprecated("use fsdp::remove_activation_checkpoint")]] inline void uncheckpoint_module(
    const torch::nn::Module& module) {
  remove_activation_checkpoint(module);
}
[[deprecated("use fsdp::activation_checkpoint_options_of")]] inline std::optional<
    ActivationCheckpointOptions>
checkpoint_options_of(const torch::nn::Module& module) {
  return activation_checkpoint_options_of(module);
}
[[deprecated("use fsdp::activation_checkpoint_every_nth")]] inline ActivationCheckpointPolicy
checkpoint_every_nth(int64_t n, std::function<bool(const torch::nn::Module&)> filter,
                     ActivationCheckpointOptions options = {}) {
  return activation_checkpoint_every_nth(n, std::move(filter), std::move(options));
}
[[deprecated("use fsdp::activation_checkpoint_names")]] inline ActivationCheckpointPolicy
checkpoint_names(std::vector<std::string> names, ActivationCheckpointOptions options = {}) {
  return activation_checkpoint_names(std::move(names), std::move(options));
}

}  // namespace fsdp
