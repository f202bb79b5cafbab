// fsdp-train --pp: the decoder cut into pipeline stages by layers
// (models::DecoderStage: the embedding on stage 0, the final norm and the
// output layer on the last), run by an fsdp::pp::Schedule on a (pp, dp...)
// mesh with pp outermost: world rank = pp rank x dp size + dp rank, so the
// ranks of one stage are adjacent and the stages of one pipeline are the
// ranks dp size apart. Each stage shards its layers, then itself (the stage
// root: embedding / final norm + output), over its data-parallel ranks.
// Rank r holds stages r, r + pp, ... (looped placement; more than one with
// --schedule interleaved).
//
// Loss: fsdp::pp's convention, LossSpec::sum = the sum of the microbatch's
// next-byte cross-entropies, LossSpec::count = its targets (every byte
// counts; -100 would be ignored), divided once by the step's global count:
// the gradients are the global mean's, and the step's loss broadcast_loss
// with the data-parallel mesh (summed over the replicas), the same number
// fsdp-train reports without --pp.
//
// Tied output: the decoder keeps its tied embedding/output weight. The last
// stage holds a copy of the embedding as "output.weight" (initialised equal);
// after the schedule's step the first and the last stage's ranks of each
// data-parallel coordinate exchange the two gradients and both add them
// (models::sum_tied_gradients), so both take the same AdamW step and stay
// bitwise equal (--verify checks it). The gradient norm counts the pair once.
//
// Gradient clipping: each stage's norm over its data-parallel ranks
// (fsdp::total_grad_norm), squared and summed over pp: one norm over the
// whole model, as without --pp.
#pragma once

#include "config.h"
#include "model.h"

#include <fsdp/mesh.h>
#include <fsdp/pipeline.h>
#include <models/decoder_stages.h>

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_train {

struct Pipeline {
  fsdp::DeviceMesh mesh;     // the world: (pp, [replicate,] shard)
  fsdp::DeviceMesh pp_mesh;  // this rank's pipeline
  fsdp::DeviceMesh dp_mesh;  // this rank's stage replicas ([replicate,] shard)
  std::vector<models::DecoderStage> stages;  // this rank's, in stage order
  std::vector<fsdp::FSDPModule> stage_roots;
  std::unique_ptr<fsdp::pp::Schedule> schedule;
  bool has_first = false, has_last = false;  // holds stage 0 / the last stage
  // The tied pair's member on this rank (embed.weight on the first stage's,
  // output.weight on the last's) and the other's pp rank; undefined / -1
  // elsewhere.
  at::Tensor tied;
  int tied_peer = -1;
  // What the gradient norm counts: every local parameter but the last
  // stage's tied copy.
  std::vector<at::Tensor> norm_params;
  std::vector<at::Tensor> params;  // every local parameter
};

// The (pp, [replicate,] shard) mesh (collective over the world).
fsdp::DeviceMesh pipeline_mesh(const TrainConfig& cfg, c10::DeviceType device);

// This rank's stages of `net` (every rank builds the same full decoder from
// the seed and keeps its stages' modules), sharded and scheduled; --ac marks
// their layers as without --pp.
ShardedDecoder shard_pipeline(const models::Decoder& net, const TrainConfig& cfg,
                              const fsdp::DeviceMesh& mesh);

struct PipelineStepResult {
  double loss = 0;       // the step's mean loss over the global batch (every rank)
  double grad_norm = 0;  // before clipping (every rank)
  double bubble = 0;     // fsdp::pp::bubble_fraction over the world mesh
};

// One step's forward and backward of this rank's data-parallel slice
// `tokens` [b, seq + 1] (zero_grad, Schedule::step, the tied gradients,
// clipping over the whole model); the optimizer step is the caller's.
// Collective over the world.
PipelineStepResult pipeline_step(ShardedDecoder& d, const at::Tensor& tokens,
                                 const TrainConfig& cfg);

// --verify: every stage's global parameters by full name on world rank 0
// (each pipeline's first data-parallel rank sends its stages'), empty
// elsewhere. Collective over the world.
std::vector<std::pair<std::string, at::Tensor>> gather_full_state(const ShardedDecoder& d);

}  // namespace fsdp_train
