#include "models/tp_llm.h"

#include <fsdp/errors.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <limits>
#include <string>

namespace models {

namespace {
constexpr int64_t kSeqDim = 1;

fsdp::tp::ColumnParallelOptions column(TPOptions o, int64_t pieces = 1) {
  fsdp::tp::ColumnParallelOptions c;
  c.bias = false;
  c.sequence_parallel = o.sequence_parallel;
  c.sequence_dim = kSeqDim;
  c.fused_pieces = pieces;
  return c;
}

fsdp::tp::RowParallelOptions row(TPOptions o) {
  fsdp::tp::RowParallelOptions r;
  r.bias = false;
  r.sequence_parallel = o.sequence_parallel;
  r.sequence_dim = kSeqDim;
  return r;
}
}  // namespace

TPRMSNormImpl::TPRMSNormImpl(int64_t dim, fsdp::DeviceMesh tp_mesh, bool sp)
    : RMSNormImpl(dim), tp(std::move(tp_mesh)), sequence_parallel(sp) {}

std::vector<fsdp::DistributedParam> TPRMSNormImpl::distributed_params() const {
  return {fsdp::tp::replicated_param(weight, tp, sequence_parallel)};
}

TPAttentionImpl::TPAttentionImpl(int64_t hidden, int64_t heads, const fsdp::DeviceMesh& tp,
                                 TPOptions options)
    : local_heads(fsdp::tp::local_size("heads", heads, tp)) {
  qkv = register_module(
      "qkv", fsdp::tp::ColumnParallelLinear(hidden, 3 * hidden, tp, column(options, 3)));
  proj = register_module("proj", fsdp::tp::RowParallelLinear(hidden, hidden, tp, row(options)));
}

// AttentionImpl::forward on this rank's heads.
at::Tensor TPAttentionImpl::forward(const at::Tensor& x) {
  auto qkv_out = qkv(x);  // [batch, seq, 3 * local hidden], q, k, v by heads
  const int64_t b = qkv_out.size(0), s = qkv_out.size(1);
  const int64_t hd = qkv_out.size(2) / (3 * local_heads);
  auto parts = qkv_out.view({b, s, 3, local_heads, hd}).permute({2, 0, 3, 1, 4});
  auto q = parts[0], k = parts[1], v = parts[2];
  auto scores = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  auto future = at::ones({s, s}, x.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  auto out = at::matmul(at::softmax(scores, -1), v).transpose(1, 2).reshape({b, s, -1});
  return proj(out);
}

TPSwiGLUImpl::TPSwiGLUImpl(int64_t hidden, int64_t ffn, const fsdp::DeviceMesh& tp,
                           TPOptions options) {
  w1 = register_module("w1", fsdp::tp::ColumnParallelLinear(hidden, ffn, tp, column(options)));
  w3 = register_module("w3", fsdp::tp::ColumnParallelLinear(hidden, ffn, tp, column(options)));
  w2 = register_module("w2", fsdp::tp::RowParallelLinear(ffn, hidden, tp, row(options)));
}

// w1 and w3 each gather an SP input: two all-gathers where one would do,
// the price of keeping the layers independent (the step counts show it).
at::Tensor TPSwiGLUImpl::forward(const at::Tensor& x) { return w2(at::silu(w1(x)) * w3(x)); }

TPDecoderLayerImpl::TPDecoderLayerImpl(int64_t hidden, int64_t heads, int64_t ffn_dim,
                                       const fsdp::DeviceMesh& tp, TPOptions o) {
  attn_norm = register_module("attn_norm", TPRMSNorm(hidden, tp, o.sequence_parallel));
  attn = register_module("attn", TPAttention(hidden, heads, tp, o));
  ffn_norm = register_module("ffn_norm", TPRMSNorm(hidden, tp, o.sequence_parallel));
  ffn = register_module("ffn", TPSwiGLU(hidden, ffn_dim, tp, o));
}

at::Tensor TPDecoderLayerImpl::forward(const at::Tensor& x) {
  auto h = x + attn(attn_norm(x));
  return h + ffn(ffn_norm(h));
}

TPDecoderImpl::TPDecoderImpl(const DecoderConfig& cfg, fsdp::DeviceMesh tp_mesh, TPOptions o)
    : config(cfg), tp(std::move(tp_mesh)), options(o) {
  if (!cfg.tie_output) {
    throw fsdp::ArgumentError("config", "TPDecoder: 'config' has tie_output = false; the "
                                        "tensor-parallel form has the tied output only");
  }
  if (o.sequence_parallel) fsdp::tp::local_size("seq", cfg.seq, tp);
  fsdp::tp::VocabParallelOptions vo;
  vo.sequence_parallel = o.sequence_parallel;
  vo.sequence_dim = kSeqDim;
  embed = register_module("embed", fsdp::tp::VocabParallelEmbedding(cfg.vocab, cfg.hidden, tp, vo));
  for (int64_t i = 0; i < cfg.layers; ++i) {
    layers.push_back(register_module(
        "layer" + std::to_string(i), TPDecoderLayer(cfg.hidden, cfg.heads, cfg.ffn_dim(), tp, o)));
  }
  norm = register_module("norm", TPRMSNorm(cfg.hidden, tp, o.sequence_parallel));
}

void TPDecoderImpl::load_full(const DecoderImpl& full) {
  const auto src = full.named_parameters();
  torch::NoGradGuard no_grad;
  embed->load_full(src["embed.weight"]);
  norm->weight.copy_(src["norm.weight"]);
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::string p = "layer" + std::to_string(i) + ".";
    auto& l = *layers[i].holder().holder();
    l.attn_norm->weight.copy_(src[p + "attn_norm.weight"]);
    l.ffn_norm->weight.copy_(src[p + "ffn_norm.weight"]);
    l.attn->qkv->load_full(src[p + "attn.qkv.weight"]);
    l.attn->proj->load_full(src[p + "attn.proj.weight"]);
    l.ffn->w1->load_full(src[p + "ffn.w1.weight"]);
    l.ffn->w3->load_full(src[p + "ffn.w3.weight"]);
    l.ffn->w2->load_full(src[p + "ffn.w2.weight"]);
  }
}

at::Tensor TPDecoderImpl::forward(const at::Tensor& tokens) {
  at::Tensor h = embed(tokens);
  for (auto& layer : layers) h = layer(h);
  h = norm(h);
  // The tied output is column-parallel over the local vocab rows.
  h = options.sequence_parallel ? fsdp::tp::sp_all_gather(h, kSeqDim, tp)
                                : fsdp::tp::copy_to_tp(h, tp);
  return at::linear(h, embed->weight);
}

at::Tensor TPDecoderImpl::loss(const at::Tensor& local_logits, const at::Tensor& targets) const {
  if (options.loss_parallel) {
    return fsdp::tp::vocab_parallel_cross_entropy(local_logits, targets, tp);
  }
  return lm_loss(fsdp::tp::gather_from_tp(local_logits, -1, tp), targets);
}

}  // namespace models
