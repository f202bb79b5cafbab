// --verify: the same training steps re-run unsharded in this one process --
// same seed, initial weights, global batches, AdamW and clipping -- as the
// reference the sharded run's losses are compared with.
//
// Each step takes the global batch as one micro-batch per data-parallel rank
// (the slice that rank trained on), sums their fp32 gradients pairwise in
// rank order, divides by the rank count, and clips with fsdp::clip_grad_norm_
// (norm accumulated in double, as for the shards): the same global-batch
// step, computed as the ranks compute it. On 2 ranks (and HSDP 2x2) the
// losses then agree bitwise, fp32 and bf16 alike (measured over 40 steps).
// A whole-batch backward, or LibTorch's fp32 norm, differs in the last bits,
// and at the default lr the loss spikes of the first ~20 steps amplify such
// bits past 1e-2 -- which would hide what --verify is for: whether sharding
// changed anything. MPI's grouping of more than 2 ranks' sums on a 1-D mesh
// is not emulated (fp32 drifts after ~15 steps there; bf16 gradients sum
// exactly). bf16 emulates FSDP's mixed precision: an fp32 master copy
// steps, a bf16 copy computes, gradients are cast to fp32 before the sum.
#pragma once

#include "config.h"
#include "corpus.h"
#include "progress.h"

#include <functional>
#include <vector>

namespace fsdp_train {

// Runs steps 1..cfg.steps; calls on_step after each.
std::vector<LossRow> run_reference(const TrainConfig& cfg, const Corpus& corpus,
                                   const std::function<void(const LossRow&)>& on_step);

struct Comparison {
  double max_abs_diff = 0;
  int64_t worst_step = 0;
  int64_t compared = 0;
};
Comparison compare_losses(const std::vector<LossRow>& sharded, const std::vector<LossRow>& single);

}  // namespace fsdp_train
