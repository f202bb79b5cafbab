#include "models/init.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <stdexcept>
#include <string>

namespace models {

namespace {
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace

void init_weights(torch::nn::Module& module, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  torch::NoGradGuard no_grad;
  for (auto& item : module.named_parameters(/*recurse=*/true)) {
    at::Tensor p = item.value();
    if (ends_with(item.key(), "bias")) {
      p.zero_();
    } else if (p.dim() == 1) {
      p.fill_(1.0);
    } else {
      // Drawn on the CPU with the case's generator, whatever the device.
      p.copy_(at::normal(0.0, 0.02, p.sizes(), gen, at::TensorOptions().dtype(p.scalar_type())));
    }
  }
}

fsdp::InitFn seeded_init_rule(uint64_t seed) {
  return [seed](const fsdp::TensorPiece& t) {
    if (ends_with(t.name, "bias")) {
      t.local.zero_();
    } else if (t.global_shape.size() == 1) {
      t.local.fill_(1.0);
    } else {
      fsdp::seeded_normal_(t, seed, 0.0, 0.02);
    }
  };
}

void init_weights_seeded(torch::nn::Module& module, uint64_t seed) {
  const fsdp::InitFn rule = seeded_init_rule(seed);
  torch::NoGradGuard no_grad;
  for (auto& item : module.named_parameters(/*recurse=*/true)) {
    rule(fsdp::piece_of(item.key(), item.value()));
  }
}

at::Tensor random_tokens(uint64_t seed, int64_t batch, int64_t seq, int64_t vocab) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randint(0, vocab, {batch, seq}, gen, at::TensorOptions().dtype(at::kLong));
}

at::Tensor random_images(uint64_t seed, int64_t batch, int64_t channels, int64_t size) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randn({batch, channels, size, size}, gen);
}

at::Tensor rank_slice(const at::Tensor& global, int64_t rank, int64_t world) {
  const int64_t n = global.size(0);
  if (world <= 0 || rank < 0 || rank >= world || n % world != 0) {
    throw std::invalid_argument("rank_slice: dim 0 of size " + std::to_string(n) +
                                " cannot be split evenly into " + std::to_string(world) +
                                " slices (rank " + std::to_string(rank) + ")");
  }
  return global.narrow(0, rank * (n / world), n / world).contiguous();
}

}  // namespace models
