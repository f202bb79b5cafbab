#include "models/moe_llm.h"

#include "models/llm.h"

#include <ATen/ATen.h>

#include <limits>
#include <stdexcept>
#include <string>

namespace models {

MoEDecoderConfig moe_decoder_config(const DecoderConfig& d, int64_t experts, int64_t top_k) {
  MoEDecoderConfig m;
  m.vocab = d.vocab;
  m.hidden = d.hidden;
  m.heads = d.heads;
  m.layers = d.layers;
  m.seq = d.seq;
  m.experts = experts;
  m.top_k = top_k;
  return m;
}

int64_t MoEDecoderConfig::ffn_dim() const {
  if (ffn > 0) return ffn;
  const int64_t raw = 2 * 4 * hidden / 3;
  return (raw + 63) / 64 * 64;
}

PlainRouterImpl::PlainRouterImpl(int64_t hidden, int64_t experts) {
  gate = register_module("gate", torch::nn::Linear(torch::nn::LinearOptions(hidden, experts).bias(false)));
}

PlainExpertsImpl::PlainExpertsImpl(int64_t hidden, int64_t ffn, int64_t experts) {
  w1 = register_parameter("w1", at::randn({experts, ffn, hidden}) * 0.02);
  w2 = register_parameter("w2", at::randn({experts, hidden, ffn}) * 0.02);
  w3 = register_parameter("w3", at::randn({experts, ffn, hidden}) * 0.02);
}

PlainMoEImpl::PlainMoEImpl(int64_t hidden, int64_t ffn, int64_t experts, int64_t k) : top_k(k) {
  router = register_module("router", PlainRouter(hidden, experts));
  this->experts = register_module("experts", PlainExperts(hidden, ffn, experts));
}

at::Tensor PlainMoEImpl::forward(const at::Tensor& x) {
  const auto shape = x.sizes().vec();
  const at::Tensor t = x.reshape({-1, shape.back()});
  const int64_t E = experts->w1.size(0);
  const at::Tensor scores =
      at::softmax(at::linear(t.to(at::kFloat), router->gate->weight.to(at::kFloat)), -1);
  const auto sorted = at::sort(scores.detach(), /*stable=*/true, /*dim=*/1, /*descending=*/true);
  const at::Tensor values = std::get<0>(sorted);
  last_ids = std::get<1>(sorted).narrow(1, 0, top_k).contiguous();
  last_margin = top_k < E && t.size(0) > 0
                    ? (values.select(1, top_k - 1) - values.select(1, top_k)).min().item<double>()
                    : std::numeric_limits<double>::infinity();
  last_counts = at::bincount(last_ids.reshape({-1}), {}, E);
  const at::Tensor weights = scores.gather(1, last_ids);
  at::Tensor out = at::zeros({t.size(0), t.size(1)}, t.options().dtype(at::kFloat));
  // Expert by expert: each token's terms are added in increasing expert id.
  for (int64_t e = 0; e < E; ++e) {
    const at::Tensor chose = last_ids == e;  // [T, K], at most one true per row
    const at::Tensor rows = chose.any(1).nonzero().reshape({-1});
    const at::Tensor w = (weights * chose).sum(1).index_select(0, rows);
    const at::Tensor xe = t.index_select(0, rows);
    const at::Tensor h = at::silu(at::matmul(xe, experts->w1[e].t())) *
                         at::matmul(xe, experts->w3[e].t());
    const at::Tensor y = at::matmul(h, experts->w2[e].t());
    out = out.index_add(0, rows, y.to(at::kFloat) * w.unsqueeze(1));
  }
  return out.to(x.scalar_type()).view(shape);
}

MoEBlockImpl::MoEBlockImpl(const MoEDecoderConfig& c, MoEForm form,
                           std::optional<fsdp::DeviceMesh> ep) {
  attn_norm = register_module("attn_norm", RMSNorm(c.hidden));
  attn = register_module("attn", Attention(c.hidden, c.heads, /*causal=*/true, /*bias=*/false));
  ffn_norm = register_module("ffn_norm", RMSNorm(c.hidden));
  if (form == MoEForm::Plain) {
    if (ep) throw std::invalid_argument("MoEBlock: the plain form has no ep mesh");
    plain = register_module("moe", PlainMoE(c.hidden, c.expert_dim(), c.experts, c.top_k));
  } else {
    moe = register_module("moe", fsdp::moe::MoE(c.hidden, c.expert_dim(), c.experts, c.top_k,
                                                std::move(ep)));
  }
}

at::Tensor MoEBlockImpl::forward(const at::Tensor& x) {
  const at::Tensor h = x + attn(attn_norm(x));
  const at::Tensor n = ffn_norm(h);
  return h + (plain ? plain(n) : moe(n));
}

at::Tensor MoEBlockImpl::last_ids() const { return plain ? plain->last_ids : moe->last_ids(); }
at::Tensor MoEBlockImpl::last_counts() const { return plain ? plain->last_counts : moe->last_counts(); }
double MoEBlockImpl::last_margin() const { return plain ? plain->last_margin : moe->last_margin(); }

MoEDecoderImpl::MoEDecoderImpl(const MoEDecoderConfig& c, MoEForm f,
                               std::optional<fsdp::DeviceMesh> ep)
    : config(c), form(f) {
  embed = register_module("embed", torch::nn::Embedding(c.vocab, c.hidden));
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string name = "layer" + std::to_string(i);
    if (c.is_moe(i)) {
      moe_layers.push_back(register_module(name, MoEBlock(c, f, ep)));
    } else {
      dense_layers.push_back(register_module(name, DecoderLayer(c.hidden, c.heads, c.ffn_dim())));
    }
  }
  norm = register_module("norm", RMSNorm(c.hidden));
}

at::Tensor MoEDecoderImpl::forward(const at::Tensor& tokens) {
  at::Tensor h = embed(tokens);
  for (int64_t i = 0; i < config.layers; ++i) {
    const size_t j = static_cast<size_t>(i / 2);
    h = config.is_moe(i) ? moe_layers[j](h) : dense_layers[j](h);
  }
  return at::linear(norm(h), embed->weight);
}

void MoEDecoderImpl::load_full(const MoEDecoderImpl& full) {
  if (full.form != MoEForm::Plain) throw std::invalid_argument("MoEDecoder::load_full: expects the plain form");
  at::NoGradGuard no_grad;
  const auto src = full.named_parameters();
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    if (name.find(".moe.experts.") != std::string::npos) continue;
    const at::Tensor* from = src.find(name);
    if (from == nullptr) throw std::invalid_argument("MoEDecoder::load_full: no parameter " + name);
    item.value().copy_(*from);
  }
  for (size_t j = 0; j < moe_layers.size(); ++j) {
    const auto& e = full.moe_layers[j]->plain->experts;
    if (moe_layers[j]->moe) moe_layers[j]->moe->experts->load_full(e->w1, e->w2, e->w3);
  }
}

std::vector<at::Tensor> MoEDecoderImpl::last_ids() const {
  std::vector<at::Tensor> out;
  for (const auto& l : moe_layers) out.push_back(l->last_ids());
  return out;
}

std::vector<at::Tensor> MoEDecoderImpl::last_counts() const {
  std::vector<at::Tensor> out;
  for (const auto& l : moe_layers) out.push_back(l->last_counts());
  return out;
}

double MoEDecoderImpl::last_margin() const {
  double m = std::numeric_limits<double>::infinity();
  for (const auto& l : moe_layers) m = std::min(m, l->last_margin());
  return m;
}

}  // namespace models
