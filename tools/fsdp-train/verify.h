// --verify: the same training steps re-run unsharded in this one process --
// same seed, initial weights, global batches, AdamW and clipping -- as the
// reference the sharded run's losses, and its parameters after the last
// step, are compared with (the same tolerance for both).
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
// Tensor parallelism is not emulated: its split GEMMs and partial sums over
// tp round differently from the plain decoder's. Measured at --tp 2, batch 4
// x seq 64: the losses agree to ~2e-7 for ~25 steps, the parameters after 6
// steps to ~1e-4 at the few dozen elements whose gradient came within ~10
// AdamW eps of zero and to ~1e-5 elsewhere; then the loss spikes amplify
// the differences as above (past 1e-4 at step 30, ~0.2 by step 76; with
// the default batch 8 x seq 128 on --mesh 2 --tp 2, past 1e-4 at step 17). With
// bf16 compute the losses still agree to ~6e-4 after 6 steps, but the
// parameters differ by ~2e-2 (bf16-level gradient differences flip AdamW's
// normalised updates). So --verify with --tp checks short fp32 runs.
// Pipeline parallelism (--pp) is not emulated either: the schedule divides
// each microbatch's summed cross-entropy by the global token count, and the
// tied embedding/output gradients are summed across stages after the
// data-parallel reduction, where the reference averages per rank and sums
// the tied pair inside each backward. Measured at --pp 2 on 4 ranks, batch 8
// x seq 64 (1F1B, GPipe and interleaved alike): the losses agree to ~2e-7 for
// ~10 steps and ~2e-6 for ~15, the parameters after 6 steps to ~3e-5; past
// 1e-4 at step 19. With bf16 compute the parameters differ by ~1e-2 after 3
// steps. So --verify with --pp checks short fp32 runs too.
// With --moe the reference is the plain MoE decoder (models::PlainMoE: a
// mask per expert, no dispatch), each rank's micro-batch routed alone as the
// sharded run routes it; the expert GEMMs see other row counts and the
// expert gradients sum in another order. Measured at -n 4 --ep 2, batch 4 x
// seq 64: the losses agree to 2.4e-7 and the parameters to 1.8e-5 after 6
// steps (with --ac all too, after 3). A routing near-tie flipped by such
// rounding would change a token's experts outright; longer runs drift as
// the other modes do.
#pragma once

#include "config.h"
#include "corpus.h"
#include "progress.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_train {

struct Reference {
  std::vector<LossRow> rows;
  // The fp32 parameters after the last step, in named_parameters() order.
  std::vector<std::pair<std::string, at::Tensor>> params;
  // Per parameter, each element's smallest |gradient| AdamW saw over the
  // steps, and AdamW's eps: where a gradient came within ~100 eps of zero,
  // AdamW's m / (sqrt(v) + eps) turns ulp-level gradient differences (TP's
  // other GEMM shapes) into parameter differences of up to ~lr.
  std::vector<at::Tensor> min_abs_grad;
  double adam_eps = 0;
};

// Runs steps 1..cfg.steps; calls on_step after each. With --tp the
// reference is still the plain decoder: TP changes how the step is
// computed, not what it computes.
// `initial`: start from these weights (by name) instead of the job's init.
Reference run_reference(const TrainConfig& cfg, const Corpus& corpus,
                        const std::function<void(const LossRow&)>& on_step,
                        const std::vector<std::pair<std::string, at::Tensor>>* initial = nullptr);

struct Comparison {
  double max_abs_diff = 0;
  int64_t worst_step = 0;
  int64_t compared = 0;
};
Comparison compare_losses(const std::vector<LossRow>& sharded, const std::vector<LossRow>& single);

struct ParamComparison {
  double max_abs_diff = 0;
  std::string worst;  // the parameter's name
  int64_t compared = 0;
  // The same over the elements whose |gradient| stayed >= 100 x AdamW eps,
  // and how many of how many elements did not.
  double well_conditioned_max_abs_diff = 0;
  int64_t near_zero_grad = 0;
  int64_t elements = 0;
};
// Max |difference| over every element of the parameters both name (a
// parameter missing on one side, or of another shape, counts as infinite).
ParamComparison compare_params(const std::vector<std::pair<std::string, at::Tensor>>& sharded,
                               const Reference& single);

}  // namespace fsdp_train
