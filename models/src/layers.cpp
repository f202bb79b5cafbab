#include "models/layers.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

namespace models {

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps(eps) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps) * weight;
}

AttentionImpl::AttentionImpl(int64_t hidden, int64_t heads, bool causal, bool bias)
    : heads(heads), causal(causal) {
  TORCH_CHECK(hidden % heads == 0, "Attention: hidden ", hidden, " not divisible by heads ", heads);
  qkv = register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(hidden, 3 * hidden).bias(bias)));
  proj = register_module("proj", torch::nn::Linear(torch::nn::LinearOptions(hidden, hidden).bias(bias)));
}

at::Tensor AttentionImpl::forward(const at::Tensor& x) {
  const int64_t b = x.size(0), s = x.size(1), h = x.size(2), hd = h / heads;
  // [3, batch, heads, tokens, head_dim]
  auto qkv_out = qkv(x).view({b, s, 3, heads, hd}).permute({2, 0, 3, 1, 4});
  auto q = qkv_out[0], k = qkv_out[1], v = qkv_out[2];
  auto scores = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  if (causal) {
    auto future = at::ones({s, s}, x.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  }
  auto out = at::matmul(at::softmax(scores, -1), v).transpose(1, 2).reshape({b, s, h});
  return proj(out);
}

SwiGLUImpl::SwiGLUImpl(int64_t hidden, int64_t ffn) {
  w1 = register_module("w1", torch::nn::Linear(torch::nn::LinearOptions(hidden, ffn).bias(false)));
  w3 = register_module("w3", torch::nn::Linear(torch::nn::LinearOptions(hidden, ffn).bias(false)));
  w2 = register_module("w2", torch::nn::Linear(torch::nn::LinearOptions(ffn, hidden).bias(false)));
}

at::Tensor SwiGLUImpl::forward(const at::Tensor& x) { return w2(at::silu(w1(x)) * w3(x)); }

GeluMlpImpl::GeluMlpImpl(int64_t in, int64_t hidden, int64_t out) {
  fc1 = register_module("fc1", torch::nn::Linear(in, hidden));
  fc2 = register_module("fc2", torch::nn::Linear(hidden, out));
}

at::Tensor GeluMlpImpl::forward(const at::Tensor& x) { return fc2(at::gelu(fc1(x))); }

DecoderLayerImpl::DecoderLayerImpl(int64_t hidden, int64_t heads, int64_t ffn_dim) {
  attn_norm = register_module("attn_norm", RMSNorm(hidden));
  attn = register_module("attn", Attention(hidden, heads, /*causal=*/true, /*bias=*/false));
  ffn_norm = register_module("ffn_norm", RMSNorm(hidden));
  ffn = register_module("ffn", SwiGLU(hidden, ffn_dim));
}

at::Tensor DecoderLayerImpl::forward(const at::Tensor& x) {
  auto h = x + attn(attn_norm(x));
  return h + ffn(ffn_norm(h));
}

EncoderBlockImpl::EncoderBlockImpl(int64_t hidden, int64_t heads, int64_t mlp_dim) {
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})));
  attn = register_module("attn", Attention(hidden, heads, /*causal=*/false, /*bias=*/true));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})));
  mlp = register_module("mlp", GeluMlp(hidden, mlp_dim, hidden));
}

at::Tensor EncoderBlockImpl::forward(const at::Tensor& x) {
  auto h = x + attn(ln1(x));
  return h + mlp(ln2(h));
}

}  // namespace models
