// Mixture-of-experts decoder (the plan's L3-03 model): decoder layers that
// alternate a dense SwiGLU FFN (even layers) and an MoE FFN (odd layers:
// top-k routed SwiGLU experts), with a weight-tied output layer.
//
// Two forms of the MoE FFN, with the same parameter names
// (moe.router.gate.weight [E, D], moe.experts.w1 / w3 [E, F, D], w2 [E, D, F]):
//  - Plain: the single-card reference, plain LibTorch written independently
//    of fsdp::moe (a mask per expert, no dispatch): what baselines run.
//  - Library: fsdp::moe::MoE, its experts split over an optional ep mesh
//    (the rank's experts only); load_full() copies a plain model's values.
// Both route identically by rule: fp32 softmax scores, the k largest with
// ties to the lower expert id, each token's k expert outputs weighted in
// fp32 and summed in increasing expert id.
#pragma once

#include "models/layers.h"

#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>
#include <fsdp/moe.h>

#include <torch/nn/modules/embedding.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace models {

struct DecoderConfig;  // models/llm.h

struct MoEDecoderConfig {
  int64_t vocab = 1024;
  int64_t hidden = 256;
  int64_t heads = 4;
  int64_t layers = 4;       // odd layers are MoE layers
  int64_t ffn = 0;          // dense SwiGLU; 0: as DecoderConfig (2/3 * 4 * hidden, to 64)
  int64_t experts = 4;
  int64_t top_k = 2;
  int64_t expert_ffn = 0;   // 0: 2 * hidden
  int64_t seq = 64;

  bool is_moe(int64_t layer) const { return layer % 2 == 1; }
  int64_t ffn_dim() const;
  int64_t expert_dim() const { return expert_ffn > 0 ? expert_ffn : 2 * hidden; }
};

// The MoE decoder of a dense decoder's dimensions: `d`'s vocab, hidden,
// heads, layers and seq, with `experts` experts of which each token is routed
// to `top_k`. The FFN sizes keep MoEDecoderConfig's defaults (d.ffn is not
// carried over) and the output layer is always tied (d.tie_output is not
// read). No checks: MoEDecoder's constructor makes them.
MoEDecoderConfig moe_decoder_config(const DecoderConfig& d, int64_t experts, int64_t top_k);

enum class MoEForm { Plain, Library };

// The plain single-card MoE FFN's pieces (named as fsdp::moe::MoE's).
struct PlainRouterImpl : torch::nn::Module {
  PlainRouterImpl(int64_t hidden, int64_t experts);
  torch::nn::Linear gate{nullptr};
};
TORCH_MODULE(PlainRouter);

struct PlainExpertsImpl : torch::nn::Module {
  PlainExpertsImpl(int64_t hidden, int64_t ffn, int64_t experts);
  at::Tensor w1, w2, w3;  // [E, F, D], [E, D, F], [E, F, D]
};
TORCH_MODULE(PlainExperts);

struct PlainMoEImpl : torch::nn::Module {
  PlainMoEImpl(int64_t hidden, int64_t ffn, int64_t experts, int64_t top_k);
  at::Tensor forward(const at::Tensor& x);  // [..., D]
  PlainRouter router{nullptr};
  PlainExperts experts{nullptr};
  int64_t top_k;
  // Of the last forward: chosen experts [T, K], counts per expert [E],
  // routing margin (k-th minus (k+1)-th score, min over tokens).
  at::Tensor last_ids, last_counts;
  double last_margin = 0;
};
TORCH_MODULE(PlainMoE);

// Pre-norm decoder layer whose FFN is an MoE: RMSNorm -> causal MHA ->
// RMSNorm -> MoE, residuals. Exactly one of plain / moe is set (registered
// as "moe").
struct MoEBlockImpl : torch::nn::Module {
  MoEBlockImpl(const MoEDecoderConfig& config, MoEForm form, std::optional<fsdp::DeviceMesh> ep);
  at::Tensor forward(const at::Tensor& x);
  // Routing of the last forward (either form).
  at::Tensor last_ids() const;
  at::Tensor last_counts() const;
  double last_margin() const;

  RMSNorm attn_norm{nullptr}, ffn_norm{nullptr};
  Attention attn{nullptr};
  PlainMoE plain{nullptr};
  fsdp::moe::MoE moe{nullptr};
};
TORCH_MODULE(MoEBlock);

struct MoEDecoderImpl : torch::nn::Module {
  // ep: the experts' mesh of the Library form (none: every expert local).
  explicit MoEDecoderImpl(const MoEDecoderConfig& config, MoEForm form = MoEForm::Plain,
                          std::optional<fsdp::DeviceMesh> ep = std::nullopt);
  // tokens [batch, seq] -> logits [batch, seq, vocab].
  at::Tensor forward(const at::Tensor& tokens);
  // Copies every value of `full` (a Plain model of the same config): dense
  // parameters whole, experts this rank's slice.
  void load_full(const MoEDecoderImpl& full);

  // Per MoE layer, in layer order: the last forward's routing.
  std::vector<at::Tensor> last_ids() const;
  std::vector<at::Tensor> last_counts() const;
  double last_margin() const;  // min over MoE layers

  MoEDecoderConfig config;
  MoEForm form;
  torch::nn::Embedding embed{nullptr};
  // Layer i is dense_layers[i / 2] for even i, moe_layers[i / 2] for odd i;
  // registered as "layer<i>".
  std::vector<fsdp::Sharded<DecoderLayer>> dense_layers;
  std::vector<fsdp::Sharded<MoEBlock>> moe_layers;
  RMSNorm norm{nullptr};
};
TORCH_MODULE(MoEDecoder);

}  // namespace models
