// One fsdp-train run as its phases see it: what set-up (main.cpp) built --
// the flags, the corpus, the device, the world's collectives, the sharded
// model and its optimizer -- handed to the step loop (step_loop.h) and the
// final verify and report (final_report.h).
#pragma once

#include "config.h"
#include "corpus.h"
#include "model.h"
#include "world_comm.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <fsdp/fully_shard.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include <chrono>
#include <cstdint>
#include <vector>

namespace fsdp_train {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Views of set-up's objects (main.cpp's train() owns them).
struct TrainingRun {
  const TrainConfig& cfg;
  const Corpus& corpus;
  // numerics_json: what a checkpoint must have been written with.
  const nlohmann::json& numerics;
  c10::Device device;
  const WorldComm& comm;
  ShardedDecoder& sharded;
  // The root unit and the optimizer's parameters, as set-up took them
  // before a resume loaded the checkpoint.
  fsdp::FSDPModule& root;
  const std::vector<at::Tensor>& params;
  torch::optim::AdamW& opt;
  int64_t dp_rank = 0;   // this rank's data-parallel coordinate
  int64_t n_params = 0;  // of the whole (unsharded) model
  bool lead = false;     // rank 0: prints, logs, plots
  // With --load and --verify: the loaded weights, whole (on rank 0), which
  // the single-process reference starts from instead of the seeded init.
  const std::vector<std::pair<std::string, at::Tensor>>* initial_weights = nullptr;
};

}  // namespace fsdp_train
