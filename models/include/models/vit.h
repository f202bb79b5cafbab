// Vision Transformer: a patch embedding (Conv2d, stride = patch), a CLS
// token, learned position embeddings, pre-LN encoder blocks (each an
// FSDP-ready fsdp::ActivationCheckpointed<fsdp::Sharded<EncoderBlock>>), a final
// LayerNorm and, when classes > 0, a classifier head on the CLS token.
#pragma once

#include "models/layers.h"

#include <fsdp/activation_checkpoint.h>
#include <fsdp/fully_shard.h>

#include <torch/nn/modules/conv.h>

#include <cstdint>
#include <vector>

namespace models {

struct ViTConfig {
  int64_t image = 224;
  int64_t patch = 16;
  int64_t channels = 3;
  int64_t hidden = 256;
  int64_t heads = 4;
  int64_t blocks = 6;
  int64_t mlp = 1024;
  int64_t classes = 10;       // 0: no head, forward returns features
  std::vector<int64_t> taps;  // blocks whose outputs are returned without a head

  int64_t tokens() const;  // patches + CLS
};

struct ViTImpl : torch::nn::Module {
  explicit ViTImpl(const ViTConfig& config);

  // images [batch, channels, image, image] -> logits [batch, classes]; with
  // classes == 0: the outputs of the tap blocks stacked as
  // [taps, batch, tokens, hidden] (the last tap after the final LayerNorm).
  at::Tensor forward(const at::Tensor& images);

  ViTConfig config;
  torch::nn::Conv2d patch_embed{nullptr};
  at::Tensor cls_token, pos_embed;
  std::vector<fsdp::ActivationCheckpointed<fsdp::Sharded<EncoderBlock>>> blocks;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(ViT);

}  // namespace models
