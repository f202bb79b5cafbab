// The job's model: the byte-level models::Decoder -- or with --tp its
// tensor-parallel form models::TPDecoder, which has the same parameter names
// and, gathered, the same values; with --moe models::MoEDecoder's library
// form on the (efsdp, ep) mesh, loaded from its plain form -- sharded per
// decoder layer and then at the root (embedding, tied output and final
// norm), with optional
// activation checkpointing of the layers, and the training step shared by
// the sharded run and the single-process --verify run.
#pragma once

#include "config.h"

#include <fsdp/fully_shard.h>
#include <models/llm.h>
#include <models/moe_llm.h>

#include <ATen/core/Tensor.h>
#include <torch/optim/adamw.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_train {

models::DecoderConfig decoder_config(const TrainConfig& cfg);

// A fresh decoder with the job's initial weights
// (models::init_weights_seeded(seed), the rule --init deferred applies on the
// shards): identical on every rank, in every layout and in the --verify run.
models::Decoder build_decoder(const TrainConfig& cfg);

// With --moe: the plain single-card MoE decoder (models::MoEForm::Plain)
// with the job's initial weights, likewise identical everywhere.
models::MoEDecoderConfig moe_decoder_config(const TrainConfig& cfg);
models::MoEDecoder build_moe_decoder(const TrainConfig& cfg);

int64_t parameter_count(const torch::nn::Module& net);

struct Pipeline;  // pipelined_decoder.h

struct ShardedDecoder {
  // models::Decoder, or models::TPDecoder with --tp: the optimizer's
  // parameters, named as in the plain decoder. With --pp: a module holding
  // this rank's stages' pieces under the plain decoder's names (plus the
  // last stage's tied "output.weight", see pipelined_decoder.h).
  std::shared_ptr<torch::nn::Module> net;
  // Mean next-byte cross-entropy of `tokens` [b, seq + 1], forward routed
  // through the root unit (the same value on every tp rank). Unset with --pp
  // (pipeline_step runs the step).
  std::function<at::Tensor(const at::Tensor& tokens)> loss;
  // Each unit with the prefix of its parameter names in net->named_parameters().
  std::vector<std::pair<std::string, fsdp::FSDPModule>> units;
  // With --pp: the stages and their schedule.
  std::shared_ptr<Pipeline> pipeline;
  // With --moe: per MoE layer, the (token, k) pairs this rank routed to each
  // expert in the last forward ([experts] int64).
  std::function<std::vector<at::Tensor>()> expert_counts;
};

// FSDP's options on `mesh` (its dims "shard", and "replicate" for HSDP;
// others carried through) for the job's precision and resharding.
fsdp::FullyShardOptions shard_options(const TrainConfig& cfg, const fsdp::DeviceMesh& mesh);

// tokens [b, seq + 1] -> the inputs [b, seq] and the next-byte targets [b, seq].
at::Tensor inputs_of(const at::Tensor& tokens);
at::Tensor targets_of(const at::Tensor& tokens);

// fully_shard on each layer, then the root, on `mesh` (dims "shard", with
// "replicate" for HSDP and "tp" with --tp); --ac marks layers. With --tp,
// `net` is the source of the TP form's initial weights. The model's dims not
// dividing by --tp (or --seq with --sequence-parallel) -> ConfigError naming
// the flag.
ShardedDecoder shard_decoder(const models::Decoder& net, const TrainConfig& cfg,
                             const fsdp::DeviceMesh& mesh);

// --init deferred: the decoder built on the meta device, sharded as
// shard_decoder does, then materialised on `device` -- only this rank's
// shards are ever allocated -- and initialised by models::seeded_init_rule
// (left zero with --load). `n_params`: the unsharded parameter count.
ShardedDecoder build_deferred_decoder(const TrainConfig& cfg, const fsdp::DeviceMesh& mesh,
                                      const c10::Device& device, int64_t& n_params);

// With --moe, on `mesh` (efsdp, ep): the library form of `plain` (its
// experts split over ep), each dense layer and the root sharded over the
// flattened mesh, each MoE layer with fsdp::moe::expert_options (experts
// on efsdp, gradients divided by the whole data-parallel size); --ac marks
// both kinds of layer.
ShardedDecoder shard_moe_decoder(const models::MoEDecoder& plain, const TrainConfig& cfg,
                                 const fsdp::DeviceMesh& mesh);

// The global parameters by full name, in named_parameters() order
// (FSDPModule::full_state_dict; collective over the mesh).
std::vector<std::pair<std::string, at::Tensor>> full_state(const ShardedDecoder& d);
torch::optim::AdamW make_optimizer(const torch::nn::Module& net, const TrainConfig& cfg);

// Mean next-byte cross-entropy of `tokens` [b, seq + 1] (logits in fp32).
at::Tensor lm_loss_of(const at::Tensor& logits, const at::Tensor& tokens);

}  // namespace fsdp_train
