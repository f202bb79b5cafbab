// Multimodal deep stack: a ViT without head yields multi-level visual
// features, a 2-layer projection MLP maps them to the decoder's width, and a
// decoder consumes them DeepStack-style (the last level as a visual prefix,
// earlier levels added to the visual positions of the first decoder layers).
// The two sub-models are FSDP-ready holders, sharded independently.
#pragma once

#include "models/llm.h"
#include "models/vit.h"

namespace models {

struct MultimodalConfig {
  ViTConfig vision;
  DecoderConfig decoder;
  int64_t projector_hidden = 256;
  MultimodalConfig();
};

struct MultimodalImpl : torch::nn::Module {
  explicit MultimodalImpl(const MultimodalConfig& config);
  // images [batch, 3, H, W], tokens [batch, seq] -> text logits [batch, seq, vocab].
  at::Tensor forward(const at::Tensor& images, const at::Tensor& tokens);

  MultimodalConfig config;
  fsdp::Sharded<ViT> vision{nullptr};
  GeluMlp projector{nullptr};
  fsdp::Sharded<Decoder> decoder{nullptr};
};
TORCH_MODULE(Multimodal);

}  // namespace models
