// The decoder of llm.h in tensor-parallel form (Megatron layout, fsdp::tp
// layers): the same math, the same parameter names and, gathered over tp,
// the same full shapes, so the single-card references apply unchanged.
//   attention  fused qkv column-parallel split by heads, proj row-parallel
//   SwiGLU     w1, w3 column-parallel, w2 row-parallel
//   embedding  vocab-parallel; the tied output multiplies by the local
//              vocab rows, giving logits split over tp on the vocab dim
//   norms      replicated over tp
// With sequence_parallel, the activations between blocks (and the norms'
// inputs) are split over tp on the sequence dim: the blocks all-gather their
// input and reduce-scatter their output, and the norm weights' gradients are
// partial over tp. With loss_parallel, loss() never gathers the logits.
#pragma once

#include "models/layers.h"
#include "models/llm.h"

#include <fsdp/activation_checkpoint.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>
#include <fsdp/tensor_parallel.h>

#include <cstdint>
#include <vector>

namespace models {

struct TPOptions {
  bool sequence_parallel = false;
  bool loss_parallel = false;
};

// RMSNorm replicated over tp; under SP its input is split on the sequence
// dim, so its weight's gradient is a partial sum over tp.
struct TPRMSNormImpl : RMSNormImpl, fsdp::ParallelModule {
  TPRMSNormImpl(int64_t dim, fsdp::DeviceMesh tp, bool sequence_parallel);
  std::vector<fsdp::DistributedParam> distributed_params() const override;
  fsdp::DeviceMesh tp;
  bool sequence_parallel;
};
TORCH_MODULE(TPRMSNorm);

struct TPAttentionImpl : torch::nn::Module {
  // heads must divide by tp (ShapeError naming "heads").
  TPAttentionImpl(int64_t hidden, int64_t heads, const fsdp::DeviceMesh& tp, TPOptions options);
  // x: [batch, seq, hidden], or [batch, seq / tp, hidden] under SP.
  at::Tensor forward(const at::Tensor& x);
  fsdp::tp::ColumnParallelLinear qkv{nullptr};
  fsdp::tp::RowParallelLinear proj{nullptr};
  int64_t local_heads;
};
TORCH_MODULE(TPAttention);

struct TPSwiGLUImpl : torch::nn::Module {
  // ffn must divide by tp (ShapeError naming "out_features").
  TPSwiGLUImpl(int64_t hidden, int64_t ffn, const fsdp::DeviceMesh& tp, TPOptions options);
  at::Tensor forward(const at::Tensor& x);
  fsdp::tp::ColumnParallelLinear w1{nullptr}, w3{nullptr};
  fsdp::tp::RowParallelLinear w2{nullptr};
};
TORCH_MODULE(TPSwiGLU);

struct TPDecoderLayerImpl : torch::nn::Module {
  TPDecoderLayerImpl(int64_t hidden, int64_t heads, int64_t ffn, const fsdp::DeviceMesh& tp,
                     TPOptions options);
  at::Tensor forward(const at::Tensor& x);
  TPRMSNorm attn_norm{nullptr}, ffn_norm{nullptr};
  TPAttention attn{nullptr};
  TPSwiGLU ffn{nullptr};
};
TORCH_MODULE(TPDecoderLayer);

// Tied output only (config.tie_output must be true: ArgumentError naming
// "config" otherwise); vocab and ffn_dim() must divide by tp, seq too under
// SP.
struct TPDecoderImpl : torch::nn::Module {
  TPDecoderImpl(const DecoderConfig& config, fsdp::DeviceMesh tp, TPOptions options);
  // Copies every parameter's slice from the plain decoder (same names).
  void load_full(const DecoderImpl& full);
  // tokens [batch, seq] -> this rank's vocab slice of the logits,
  // [batch, seq, vocab / tp].
  at::Tensor forward(const at::Tensor& tokens);
  // Mean next-token cross-entropy (lm_loss) of forward(tokens): through
  // vocab_parallel_cross_entropy with loss_parallel, else on the gathered
  // logits. The same value on every tp rank.
  at::Tensor loss(const at::Tensor& local_logits, const at::Tensor& targets) const;

  DecoderConfig config;
  fsdp::DeviceMesh tp;
  TPOptions options;
  fsdp::tp::VocabParallelEmbedding embed{nullptr};
  std::vector<fsdp::ActivationCheckpointed<fsdp::Sharded<TPDecoderLayer>>> layers;
  TPRMSNorm norm{nullptr};
};
TORCH_MODULE(TPDecoder);

}  // namespace models
