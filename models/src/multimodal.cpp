#include "models/multimodal.h"

namespace models {

MultimodalConfig::MultimodalConfig() {
  vision.hidden = 128;
  vision.blocks = 4;
  vision.mlp = 512;
  vision.classes = 0;
  vision.taps = {1, 3};
  decoder.hidden = 256;
  decoder.layers = 2;
  decoder.seq = 64;
}

MultimodalImpl::MultimodalImpl(const MultimodalConfig& cfg) : config(cfg) {
  vision = register_module("vision", ViT(cfg.vision));
  projector = register_module(
      "projector", GeluMlp(cfg.vision.hidden, cfg.projector_hidden, cfg.decoder.hidden));
  decoder = register_module("decoder", Decoder(cfg.decoder));
}

at::Tensor MultimodalImpl::forward(const at::Tensor& images, const at::Tensor& tokens) {
  return decoder(tokens, projector(vision(images)));
}

}  // namespace models
