// Vocab-parallel embedding: the full table is initialised as
// torch::nn::Embedding does, then this rank keeps its rows.
#include "fsdp/tensor_parallel.h"

#include "fsdp/errors.h"
#include "tp/check.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <sstream>
#include <string>
#include <utility>

namespace fsdp::tp {

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t num_embeddings_,
                                                       int64_t embedding_dim_, DeviceMesh tp_,
                                                       VocabParallelOptions options_)
    : num_embeddings(num_embeddings_),
      embedding_dim(embedding_dim_),
      tp(std::move(tp_)),
      options(options_) {
  detail::check_tp("VocabParallelEmbedding", tp);
  if (num_embeddings % tp.size() != 0) {
    throw ShapeError("num_embeddings", "VocabParallelEmbedding: 'num_embeddings' = " +
                                           std::to_string(num_embeddings) +
                                           " does not divide by the tp size " +
                                           std::to_string(tp.size()));
  }
  const int64_t rows = num_embeddings / tp.size();
  at::Tensor full = at::empty({num_embeddings, embedding_dim});
  torch::nn::init::normal_(full);
  weight = register_parameter(
      "weight", full.narrow(0, vocab_start(), rows).clone(at::MemoryFormat::Contiguous));
}

int64_t VocabParallelEmbeddingImpl::vocab_start() const {
  return tp.get_local_rank(0) * (num_embeddings / tp.size());
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  const char* fn = "VocabParallelEmbedding::forward";
  if (ids.scalar_type() != at::kLong && ids.scalar_type() != at::kInt) {
    throw DTypeError("ids", std::string(fn) + ": 'ids' has dtype " +
                                c10::toString(ids.scalar_type()) + "; accepted: int64, int32");
  }
  // Every tp rank holds the same ids, so every rank reaches the same verdict
  // and none is left waiting in the reduction.
  if (ids.numel() > 0 && ((ids < 0) | (ids >= num_embeddings)).any().item<bool>()) {
    std::ostringstream os;
    os << fn << ": 'ids' holds values in [" << ids.min().item<int64_t>() << ", "
       << ids.max().item<int64_t>() << "]; accepted: 0 <= id < num_embeddings = "
       << num_embeddings;
    throw ArgumentError("ids", os.str());
  }
  const int64_t start = vocab_start();
  const at::Tensor local = ids - start;
  const at::Tensor other = (local < 0) | (local >= weight.size(0));
  at::Tensor rows = at::embedding(weight, local.masked_fill(other, 0));
  rows = rows.masked_fill(other.unsqueeze(-1), 0);
  if (!options.sequence_parallel) return reduce_from_tp(rows, tp);
  const int64_t d = detail::wrap_dim(fn, rows, options.sequence_dim);
  if (rows.size(d) % tp.size() != 0) {
    throw ShapeError("ids", std::string(fn) + ": 'ids' gives " + std::to_string(rows.size(d)) +
                                " positions along the sequence dim " + std::to_string(d) +
                                ", which does not divide by the tp size " +
                                std::to_string(tp.size()));
  }
  return sp_reduce_scatter(rows, d, tp);
}

void VocabParallelEmbeddingImpl::load_full(const at::Tensor& w) {
  if (!w.defined() || w.dim() != 2 || w.size(0) != num_embeddings ||
      w.size(1) != embedding_dim) {
    std::ostringstream os;
    os << "VocabParallelEmbedding::load_full: 'weight' has shape ";
    if (w.defined()) {
      os << w.sizes();
    } else {
      os << "(undefined)";
    }
    os << "; expected the full [" << num_embeddings << ", " << embedding_dim << "]";
    throw ShapeError("weight", os.str());
  }
  at::NoGradGuard no_grad;
  weight.copy_(w.narrow(0, vocab_start(), weight.size(0)));
}

std::vector<DistributedParam> VocabParallelEmbeddingImpl::distributed_params() const {
  std::vector<DistributedParam> out;
  out.emplace_back(DTensor::from_local(weight, tp, {Placement::Shard(0)},
                                       std::vector<int64_t>{num_embeddings, embedding_dim}));
  return out;
}

}  // namespace fsdp::tp
