// Reaching a parameter's entry in torch::optim::Optimizer::state() on every
// LibTorch libfsdp builds against.
#pragma once

#include <ATen/core/Tensor.h>

#include <sstream>
#include <string>
#include <type_traits>

namespace fsdp {

// The key under which `opt.state()` holds `param`'s state (AdamW's exp_avg,
// ...): LibTorch keys it by the parameter's TensorImpl, as the address printed
// to a string up to some 2.x release and as the address itself after it.
// Checkpoint code that reads or restores optimizer state goes through this.
// Works for any torch::optim optimizer; `param` must be one of its params.
template <class Optimizer>
auto optimizer_state_key(Optimizer& opt, const at::Tensor& param) ->
    typename std::remove_reference_t<decltype(opt.state())>::key_type {
  using Key = typename std::remove_reference_t<decltype(opt.state())>::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;  // what c10::guts::to_string(void*) printed
    key << static_cast<void*>(param.unsafeGetTensorImpl());
    return key.str();
  } else {
    return param.unsafeGetTensorImpl();
  }
}

}  // namespace fsdp
