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

template <typename... Args>
[[deprecated("use fsdp::activation_checkpoint")]] at::Tensor checkpoint(Args&&... args) {
  return activation_checkpoint(std::forward<Args>(args)...);
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
template <typename... Args>
[[deprecated("use fsdp::activation_checkpoint_every_nth")]] ActivationCheckpointPolicy
checkpoint_every_nth(Args&&... args) {
  return activation_checkpoint_every_nth(std::forward<Args>(args)...);
}
template <typename... Args>
[[deprecated("use fsdp::activation_checkpoint_names")]] ActivationCheckpointPolicy
checkpoint_names(Args&&... args) {
  return activation_checkpoint_names(std::forward<Args>(args)...);
}

}  // namespace fsdp
