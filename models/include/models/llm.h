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

}  // namespace models
