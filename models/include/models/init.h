// Deterministic initialisation and synthetic data from a seed: every rank
// builds the same model and the same global batch, then takes its slice.
#pragma once

#include <fsdp/deferred_init.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>

namespace models {

// Re-initialises every parameter in named_parameters() order from `seed`:
// biases 0, 1-D weights (norm scales) 1, everything else N(0, 0.02).
void init_weights(torch::nn::Module& module, uint64_t seed);

// The same classification (biases 0, 1-D weights 1, the rest N(0, 0.02))
// with fsdp's seeded rule (fsdp/deferred_init.h): values depend on (seed,
// parameter name, global row) only, so a model initialised on its shards by
// fsdp::materialize(module, device, seeded_init_rule(seed)) holds the same
// global tensors on every world size and layout.
fsdp::InitFn seeded_init_rule(uint64_t seed);
// seeded_init_rule applied to every parameter of an unsharded module, whole:
// the one-process reference of a deferred-initialised model.
void init_weights_seeded(torch::nn::Module& module, uint64_t seed);

// Uniform token ids in [0, vocab), shape [batch, seq] (int64).
at::Tensor random_tokens(uint64_t seed, int64_t batch, int64_t seq, int64_t vocab);
// N(0, 1) images [batch, channels, size, size].
at::Tensor random_images(uint64_t seed, int64_t batch, int64_t channels, int64_t size);

// Rows [rank * n / world, (rank + 1) * n / world) of dim 0; n must divide
// evenly (std::invalid_argument otherwise).
at::Tensor rank_slice(const at::Tensor& global, int64_t rank, int64_t world);

}  // namespace models
