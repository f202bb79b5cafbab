// Transformer building blocks shared by the reference models: RMSNorm,
// multi-head attention (causal or not), SwiGLU and GELU MLPs, the decoder
// layer (pre-norm RMSNorm -> causal MHA -> RMSNorm -> SwiGLU, residuals) and
// the ViT encoder block (pre-LN LayerNorm -> MHA -> LayerNorm -> GELU MLP).
// Inputs are [batch, tokens, hidden]; nothing here knows about FSDP.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

namespace models {

struct RMSNormImpl : torch::nn::Module {
  explicit RMSNormImpl(int64_t dim, double eps = 1e-6);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

// Scaled dot-product attention over `heads` heads of hidden/heads each.
struct AttentionImpl : torch::nn::Module {
  AttentionImpl(int64_t hidden, int64_t heads, bool causal, bool bias);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
  int64_t heads;
  bool causal;
};
TORCH_MODULE(Attention);

// w2(silu(w1 x) * w3 x), no biases.
struct SwiGLUImpl : torch::nn::Module {
  SwiGLUImpl(int64_t hidden, int64_t ffn);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear w1{nullptr}, w3{nullptr}, w2{nullptr};
};
TORCH_MODULE(SwiGLU);

// fc2(gelu(fc1 x)), with biases.
struct GeluMlpImpl : torch::nn::Module {
  GeluMlpImpl(int64_t in, int64_t hidden, int64_t out);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(GeluMlp);

struct DecoderLayerImpl : torch::nn::Module {
  DecoderLayerImpl(int64_t hidden, int64_t heads, int64_t ffn);
  at::Tensor forward(const at::Tensor& x);
  RMSNorm attn_norm{nullptr}, ffn_norm{nullptr};
  Attention attn{nullptr};
  SwiGLU ffn{nullptr};
};
TORCH_MODULE(DecoderLayer);

struct EncoderBlockImpl : torch::nn::Module {
  EncoderBlockImpl(int64_t hidden, int64_t heads, int64_t mlp);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  Attention attn{nullptr};
  GeluMlp mlp{nullptr};
};
TORCH_MODULE(EncoderBlock);

}  // namespace models
