// The training text as byte tokens, and the deterministic global batches
// drawn from it: batch `step` depends only on (seed, step), so every rank --
// and the single-process --verify run -- sees the same global batch, and a
// resumed run sees the batches the uninterrupted one would have.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace fsdp_train {

class Corpus {
 public:
  // Reads the whole file (ConfigError if it cannot be read).
  static Corpus load(const std::string& path);

  int64_t size() const { return bytes_.numel(); }
  // FNV-1a 64 of the bytes (recorded in checkpoints).
  uint64_t hash() const { return hash_; }

  // [batch, seq + 1] int64 byte ids: row b is the text at a start offset drawn
  // uniformly by a generator seeded with seed * 1000003 + step.
  at::Tensor global_batch(uint64_t seed, int64_t step, int64_t batch, int64_t seq) const;

 private:
  at::Tensor bytes_;  // [size] int64
  uint64_t hash_ = 0;
};

// Rows [rank * n / parts, (rank + 1) * n / parts) of a global batch of n rows.
at::Tensor local_slice(const at::Tensor& global, int64_t rank, int64_t parts);

}  // namespace fsdp_train
