// Internal: sharded units inside torch::nn::Sequential. A Sequential calls
// its entries' forward directly, past Sharded<M>'s hooks, so fully_shard
// replaces each sharded entry with a stand-in that runs the unit's forward
// hooks around it.
#pragma once

#include <torch/nn/module.h>

namespace fsdp::detail {

// Re-routes entries of torch::nn::Sequential containers inside `module`
// whose modules are sharded units through those units.
void intercept_sequential_children(torch::nn::Module& module);

}  // namespace fsdp::detail
