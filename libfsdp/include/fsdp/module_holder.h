// What fsdp::Sharded<M> and fsdp::ActivationCheckpointed<M> share: they stand in for
// the module holder M they wrap (torch::nn::Linear, TORCH_MODULE(Block), or
// another wrapper), exposing its module the way M does.
#pragma once

#include <torch/nn/module.h>

#include <memory>
#include <utility>

namespace fsdp::detail {

template <typename M>
class HolderWrapper {
 public:
  auto* operator->() { return holder_.operator->(); }
  const auto* operator->() const { return holder_.operator->(); }
  auto ptr() const { return holder_.ptr(); }
  M& holder() { return holder_; }
  const M& holder() const { return holder_; }
  bool is_empty() const { return holder_.is_empty(); }
  operator std::shared_ptr<torch::nn::Module>() const { return holder_.ptr(); }  // NOLINT

 protected:
  explicit HolderWrapper(M holder) : holder_(std::move(holder)) {}
  M holder_;
};

}  // namespace fsdp::detail
