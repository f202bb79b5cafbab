// fsdp-train's checkpoints, through the library's distributed checkpoints
// (fsdp/distributed_checkpoint.h, docs/distributed_checkpoint.md):
// <out>/checkpoint/ is the fsdp::dcp root, holding step-<12 digits>/
// directories (the last two complete ones are kept).
//
// What a checkpoint holds (fsdp::dcp::State):
//   model/<name>             every parameter, by the GLOBAL model's name
//                            ("layer3.attn.qkv.weight", "embed.weight"),
//                            whatever the layout (FSDP, HSDP, --tp, --pp,
//                            --ep); see checkpoint_module
//   optim/<name>/<field>     AdamW's step, exp_avg, exp_avg_sq per parameter
//   step                     int64: the steps trained
//   numerics                 string: numerics_json (config.h), what a resume
//                            must match
//   layout                   string: layout_json (config.h), what it may change
// No data cursor or RNG state: batch s is drawn from (--seed, s) alone and
// training draws no random numbers.
//
// Crash tests use the test hook FSDP_DCP_CRASH_AT=<phase>[@<step>]
// (test_hooks.h; phases written, index, renamed, pruned).
#pragma once

#include "training_run.h"

#include <fsdp/distributed_checkpoint.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace fsdp_train {

// <out>/checkpoint: the fsdp::dcp root.
std::string checkpoint_root(const std::string& out);

// The module the checkpoint names parameters by: the sharded model itself,
// whose names are the plain decoder's in every layout (models::TPDecoder and
// the MoE decoder's library form keep them; the pipeline's stages keep
// "layer<i>" with i the global layer index). One exception: with --pp the
// last stage's copy of the tied embedding, "output.weight" there, is named
// "embed.weight" (its value and AdamW state are the embedding's, bitwise;
// pipelined_decoder.h), so that a checkpoint of any layout holds the tied
// weight once, under the plain decoder's name. Built afresh for each save
// and load (a view: it registers the model's own parameter tensors).
std::shared_ptr<torch::nn::Module> checkpoint_module(const ShardedDecoder& d);

// The run's State at `step` (module, AdamW, values).
fsdp::dcp::State make_state(const TrainingRun& run, int64_t step);

// Saves every --checkpoint-every steps and at the end (--async-save: in the
// background). Collective: every rank calls save() and finish() alike.
class Checkpointer {
 public:
  explicit Checkpointer(const TrainingRun& run);
  void save(int64_t step);
  // Waits for the save in flight (rethrowing its error) and says so.
  void finish();

 private:
  const TrainingRun& run_;
  std::unique_ptr<fsdp::dcp::AsyncSaver> async_;
  int64_t pending_step_ = -1;
};

struct Resumed {
  int64_t start = 0;  // the checkpoint's step (0 without --resume)
  std::string from;   // its directory
  // Rank 0's lines for people: "fsdp-train: resumed from ...", and the
  // fallback note (empty when none).
  std::string line, fallback;
};

// --resume: loads the newest complete checkpoint under <out>/checkpoint/
// into the model and the optimizer, in this run's layout (resharding what
// differs). A checkpoint saved with other numerics is a ConfigError naming
// the flag (checked before loading when the newest checkpoint's index
// reads, and again on the one loaded); damage falls back to an older one
// (the library's fallback); anything else unusable is an
// fsdp::dcp::CheckpointError. Collective.
Resumed resume(const TrainingRun& run);

}  // namespace fsdp_train
