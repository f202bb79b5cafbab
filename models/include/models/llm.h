// Decoder-only language model: token embedding, N decoder layers (each an
// FSDP-ready fsdp::ActivationCheckpointed<fsdp::Sharded<DecoderLayer>>: unsharded and
// un-checkpointed it simply forwards), final RMSNorm, and an output layer
// that is either weight-tied to the embedding (the tied pair then lives in
// the model's own, root, unit) or a separate Linear.
#pragma once

#include "models/layers.h"

#include <fsdp/activation_checkpoint.h>
#include <fsdp/fully_shard.h>

#include <torch/nn/modules/embedding.h>

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace models {

struct DecoderConfig {
  int64_t vocab = 1024;
  int64_t hidden = 256;
  int64_t heads = 4;
  int64_t layers = 4;
  int64_t ffn = 0;  // 0: SwiGLU's 2/3 * 4 * hidden, rounded up to a multiple of 64
  int64_t seq = 128;
  bool tie_output = true;

  int64_t ffn_dim() const;
};

// How the chunked cross-entropy splits the output layer's work.
struct ChunkedLoss {
  int64_t chunk_tokens = 512;  // > 0; the last chunk may be shorter
  // true: each chunk's logits are recomputed in backward (fsdp::checkpoint),
  // never all held at once. false: a plain loop that keeps every chunk's
  // logits for backward -- what a baseline runs, since baselines must not
  // use libfsdp code (test plan rule 1).
  bool recompute = true;
  // Also compute the CE of the whole logits in one piece, to check the
  // chunking against; this holds all the logits at once.
  bool unchunked = false;
};

struct DecoderImpl : torch::nn::Module {
  explicit DecoderImpl(const DecoderConfig& config);

  // tokens [batch, seq] (int64) -> logits [batch, seq, vocab].
  at::Tensor forward(const at::Tensor& tokens);
  // Multimodal prefix: visual [levels, batch, n_visual, hidden]. The last
  // level is prepended to the token embeddings; level i < levels-1 is added
  // to the visual positions after decoder layer i (DeepStack). Returns the
  // logits of the text positions only, [batch, seq, vocab].
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& visual);
  // Chunked cross-entropy (see ChunkedLoss): returns {total, per-chunk
  // losses [n_chunks]} and, with `unchunked`, a third tensor: the same mean
  // CE computed over the whole logits in one piece (no gradient). Each
  // chunk's loss is its summed CE divided by the number of tokens, so the
  // chunks sum to `total` (the mean CE).
  std::vector<at::Tensor> forward(const at::Tensor& tokens, const at::Tensor& targets,
                                  const ChunkedLoss& loss);

  at::Tensor output_weight() const;

  DecoderConfig config;
  torch::nn::Embedding embed{nullptr};
  std::vector<fsdp::ActivationCheckpointed<fsdp::Sharded<DecoderLayer>>> layers;
  RMSNorm norm{nullptr};
  torch::nn::Linear output{nullptr};  // null when tied

 private:
  at::Tensor trunk(at::Tensor h, const std::optional<at::Tensor>& visual);
};
TORCH_MODULE(Decoder);

// Mean next-token cross-entropy of logits [batch, seq, vocab] against
// targets [batch, seq].
at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& targets);

// Bytes a models::Decoder forward leaves saved for backward on one rank,
// stated from its forward (layers.cpp, llm.cpp) tensor by tensor, for
// fsdp::estimate_memory. T = batch * seq tokens, H hidden, F ffn_dim(), h
// heads, e the compute dtype's size:
//   layer: 10 T H e  (RMSNorm x*rsqrt and *weight, twice: 4; the contiguous
//                     copies matmul makes of q, k^T, v: 3; attention output
//                     reshaped: 1; the residual h and the layer output: 2)
//        + 4 T F e   (w1 out, silu out, w3 out, their product)
//        + batch h seq^2 e (softmax probabilities) + seq^2 (causal mask, bool)
//        + 2 T e     (the two rsqrt factors)
//   with activation checkpointing only the layer's output, T H e, is kept;
//   the layer's full set is rebuilt, one layer at a time, in backward
//   (layer_recompute).
//   root: the embedding output T H e + the final RMSNorm 2 T H e + T e.
//   loss: lm_loss over the full logits: logits, log-softmax and, at the start
//   of backward, its gradient: 3 T vocab e.
//   layer_backward: a layer's backward begins with its SwiGLU, where the
//   gradients of the four [T, F] tensors (the product, silu's and w3's
//   outputs, w1's output) and of the layer's output and residual are alive
//   before the saved tensors they replace are released: 4 T F e + 2 T H e
//   (checked against the tracking allocator by fsdp-bench memory).
struct DecoderActivationBytes {
  int64_t layer = 0;
  int64_t layer_recompute = 0;  // transient, in backward, with activation checkpointing
  int64_t layer_backward = 0;   // a layer's backward workspace (UnitSpec::backward_workspace_bytes)
  int64_t root = 0;
  int64_t loss = 0;
};
DecoderActivationBytes decoder_activation_bytes(const DecoderConfig& config, int64_t batch_per_rank,
                                                int64_t seq, c10::ScalarType dtype,
                                                bool activation_checkpointing);

}  // namespace models
