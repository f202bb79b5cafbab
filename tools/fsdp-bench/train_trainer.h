// fsdp-bench train's Trainer: one configuration's model (plain, DDP, FSDP,
// HSDP, FSDP x TP, FSDP in pipeline stages or the MoE decoder with expert
// parallelism), its AdamW optimizer and its timed training step.
#pragma once

#include "train_configs.h"
#include "train_memory.h"

#include "fsdp/fully_shard.h"
#include "fsdp/mesh.h"
#include "fsdp/pipeline.h"

#include <models/llm.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp_bench::train {

// One configuration's model, optimizer and step. `mesh`: (shard) for Fsdp,
// (shard, tp) for FsdpTp, (pp, dp) for FsdpPp, (efsdp, ep) for FsdpEp,
// unused otherwise. Built and stepped with `account` (CountingAllocator)
// current.
class Trainer {
 public:
  Trainer(const ConfigSpec& spec, CountingAllocator::Account& account,
          const models::DecoderConfig& cfg,
          const Options& o, const std::optional<fsdp::DeviceMesh>& mesh, MPI_Comm comm);

  const ConfigSpec& spec() const { return spec_; }
  CountingAllocator::Account& account() const { return account_; }
  // Name of the tp process group; empty without TP.
  const std::string& tp_group() const { return tp_group_; }
  // This rank's share of a global batch: the whole of it for single, the
  // slice of its data-parallel coordinate otherwise.
  at::Tensor share(const at::Tensor& global) const;

  // One training step on `inputs` -> `targets` (this rank's share). With
  // `record`, appends its phase times to phase_us() (and, pipelined, the
  // schedule's step and busy times to pipeline_steps()).
  void step(const at::Tensor& inputs, const at::Tensor& targets, bool record = false);
  // Phases: zero_grad + forward + loss (FSDP: with its all-gather waits;
  // pipelined: the whole schedule step, backward included), backward (FSDP:
  // with its reduce-scatters), DDP's all-reduce or the pipeline's tied
  // gradient exchange, AdamW step.
  static constexpr size_t kPhases = 4;
  // [recorded step][phase], microseconds on this rank.
  const std::vector<double>& phase_us() const { return phase_us_; }
  // Pipelined: the schedule's results of the recorded steps.
  const std::vector<fsdp::pp::StepResult>& pipeline_steps() const { return pipeline_steps_; }

  // This rank's loss of the last step, such that the mean over the world's
  // ranks is the global batch's loss. Pipelined: the global mean itself
  // (broadcast_loss over pp and dp: collective over the world).
  double last_loss() const;

  // Bytes held between steps: parameters (local shards under FSDP),
  // gradients and AdamW state, as sums of tensor sizes.
  struct Persistent {
    int64_t params = 0, grads = 0, optimizer = 0;
    int64_t total() const { return params + grads + optimizer; }
  };
  Persistent persistent() const;

 private:
  // The whole DDP synchronisation: flatten, one MPI_Allreduce, mean, unflatten.
  void all_reduce_gradients();
  // The FSDP, HSDP and TP configs' models and the unsharded ones (single, ddp).
  void build_tp(const models::Decoder& decoder, const models::DecoderConfig& cfg,
                const fsdp::FullyShardOptions& fo, const Options& o,
                const fsdp::DeviceMesh& mesh);
  void build_data_parallel(models::Decoder decoder, const fsdp::FullyShardOptions& fo,
                           const Options& o);
  // This rank's stages of `decoder` (rank r: stages r, r + pp, ...), each
  // sharded layer by layer then as a whole over dp, and their schedule.
  void build_pipeline(const models::Decoder& decoder, fsdp::FullyShardOptions fo,
                      const Options& o, const fsdp::DeviceMesh& mesh);
  // models::MoEDecoder of the same dims and seed, its library form on
  // mesh's ep; dense units over the flattened mesh, MoE layers with the
  // experts on efsdp.
  void build_moe(const models::DecoderConfig& cfg, fsdp::FullyShardOptions fo, const Options& o,
                 const fsdp::DeviceMesh& mesh);

  ConfigSpec spec_;
  CountingAllocator::Account& account_;
  MPI_Comm comm_;
  c10::Device device_;
  int world_ = 1;
  int data_rank_ = 0, data_size_ = 1;
  std::string tp_group_;
  // FsdpPp only.
  std::optional<fsdp::DeviceMesh> pp_mesh_, dp_mesh_;
  fsdp::ProcessGroupPtr pp_group_;
  int num_stages_ = 1;
  bool has_first_ = false, has_last_ = false;
  at::Tensor tied_;  // this rank's member of the tied pair, if any
  int tied_peer_ = -1;
  std::unique_ptr<fsdp::pp::Schedule> schedule_;
  fsdp::pp::StepResult last_step_;
  std::vector<fsdp::pp::StepResult> pipeline_steps_;
  std::shared_ptr<torch::nn::Module> model_;
  // Forward and mean cross-entropy of this rank's share.
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  at::Tensor bucket_;  // DDP only
  at::Tensor last_loss_;
  std::vector<double> phase_us_;
};

}  // namespace fsdp_bench::train
