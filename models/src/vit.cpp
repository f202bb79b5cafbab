#include "models/vit.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <string>

namespace models {

int64_t ViTConfig::tokens() const { return (image / patch) * (image / patch) + 1; }

ViTImpl::ViTImpl(const ViTConfig& cfg) : config(cfg) {
  TORCH_CHECK(cfg.image % cfg.patch == 0, "ViT: image ", cfg.image, " not a multiple of patch ",
              cfg.patch);
  TORCH_CHECK(cfg.classes > 0 || !cfg.taps.empty(), "ViT: without a head, give taps");
  patch_embed = register_module(
      "patch_embed",
      torch::nn::Conv2d(torch::nn::Conv2dOptions(cfg.channels, cfg.hidden, cfg.patch).stride(cfg.patch)));
  cls_token = register_parameter("cls_token", at::zeros({1, 1, cfg.hidden}));
  pos_embed = register_parameter("pos_embed", at::zeros({1, cfg.tokens(), cfg.hidden}));
  for (int64_t i = 0; i < cfg.blocks; ++i) {
    blocks.push_back(register_module("block" + std::to_string(i),
                                     EncoderBlock(cfg.hidden, cfg.heads, cfg.mlp)));
  }
  norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({cfg.hidden})));
  if (cfg.classes > 0) head = register_module("head", torch::nn::Linear(cfg.hidden, cfg.classes));
}

at::Tensor ViTImpl::forward(const at::Tensor& images) {
  auto x = patch_embed(images).flatten(2).transpose(1, 2);  // [batch, patches, hidden]
  x = at::cat({cls_token.expand({x.size(0), 1, config.hidden}), x}, 1) + pos_embed;
  std::vector<at::Tensor> tapped;
  for (size_t i = 0; i < blocks.size(); ++i) {
    x = blocks[i](x);
    const bool last = i + 1 == blocks.size();
    if (!head && std::count(config.taps.begin(), config.taps.end(), static_cast<int64_t>(i)) &&
        !last) {
      tapped.push_back(x);
    }
  }
  x = norm(x);
  if (head) return head(x.select(1, 0));
  tapped.push_back(x);
  return at::stack(tapped);
}

}  // namespace models
