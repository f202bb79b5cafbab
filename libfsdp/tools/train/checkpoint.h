// Sharded HDF5 checkpoints in <out>/checkpoint/:
//
//   rank<R>.h5   this rank's parameter shards (/params/<name>, fp32, local
//                shape), its AdamW state (/optim/<name>/{exp_avg, exp_avg_sq,
//                step}), and attributes step, rank, world, numerics (JSON)
//   meta.json    written by rank 0 once every rank file is complete
//
// Atomic: every rank writes into <out>/checkpoint.tmp-<step>/; after a
// barrier rank 0 writes meta.json there, renames checkpoint/ to
// checkpoint.old/, the new directory to checkpoint/, and removes the old one.
// A crash leaves either the previous checkpoint or the new one (or, between
// the two renames, checkpoint.old/, which --resume falls back to).
//
// All functions here are collective over MPI_COMM_WORLD; a failure on any
// rank fails on every rank (ConfigError) instead of leaving the others
// waiting.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_train {

std::string checkpoint_dir(const std::string& out);

// `shards`: this rank's parameter shards by name, in the optimizer's
// parameter order (so opt.param_groups()[0].params()[i] is shards[i]'s
// parameter). `run` is recorded in meta.json for people (flags, time).
void save_checkpoint(const std::string& out, int64_t step, const nlohmann::json& numerics,
                     const nlohmann::json& run,
                     const std::vector<std::pair<std::string, at::Tensor>>& shards,
                     torch::optim::AdamW& opt, int rank, int world);

struct AdamState {
  int64_t step = 0;
  at::Tensor exp_avg, exp_avg_sq;
};

struct LoadedCheckpoint {
  std::string dir;
  int64_t step = 0;
  std::vector<std::pair<std::string, at::Tensor>> shards;
  std::vector<std::pair<std::string, AdamState>> optim;  // by parameter name
};

// Reads <out>/checkpoint (meta.json and this rank's file) after checking that
// it was written by a job with the same numerics (ConfigError naming the
// first difference otherwise).
LoadedCheckpoint read_checkpoint(const std::string& out, const nlohmann::json& numerics, int rank,
                                 int world);

// Installs the loaded AdamW state: `names[i]` names opt's i-th parameter.
void load_optimizer_state(const LoadedCheckpoint& ckpt, const std::vector<std::string>& names,
                          torch::optim::AdamW& opt);

}  // namespace fsdp_train
