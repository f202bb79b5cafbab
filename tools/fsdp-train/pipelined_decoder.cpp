#include "pipelined_decoder.h"

#include <fsdp/activation_checkpoint.h>
#include <fsdp/clip_grad.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>

namespace fsdp_train {

fsdp::DeviceMesh pipeline_mesh(const TrainConfig& cfg, c10::DeviceType device) {
  std::vector<int64_t> shape = {cfg.pp};
  shape.insert(shape.end(), cfg.mesh_shape.begin(), cfg.mesh_shape.end());
  std::vector<std::string> dims = {"pp"};
  if (cfg.hsdp()) dims.push_back("replicate");
  dims.push_back("shard");
  return fsdp::init_device_mesh(device, shape, dims);
}

ShardedDecoder shard_pipeline(const models::Decoder& net, const TrainConfig& cfg,
                              const fsdp::DeviceMesh& mesh) {
  auto p = std::make_shared<Pipeline>(Pipeline{mesh, mesh["pp"],
                                               cfg.hsdp() ? mesh[{"replicate", "shard"}]
                                                          : mesh["shard"],
                                               {}, {}, {}, false, false, {}, -1, {}, {}});
  const int pp_rank = mesh.get_local_rank("pp");
  const int pp = static_cast<int>(cfg.pp);
  const int num_stages = static_cast<int>(cfg.num_stages());
  const fsdp::FullyShardOptions options = shard_options(cfg, p->dp_mesh);
  fsdp::pp::StageOptions stage_options;
  // Without an explicit --reshard-after-forward, the pipeline's default: the
  // units stay gathered across the microbatches of a step.
  stage_options.keep_reshard_after_forward =
      cfg.reshard_after_forward_given && cfg.reshard_after_forward == "true";

  ShardedDecoder d;
  auto local = std::make_shared<torch::nn::Module>("PipelineRank");
  std::vector<fsdp::pp::PipelineStage> stages;
  std::vector<std::string> ac_names;
  for (int64_t v = 0; v < cfg.stages_per_rank; ++v) {
    const int stage = pp_rank + static_cast<int>(v) * pp;
    models::DecoderStage s(*net, stage, num_stages);
    for (const auto& child : s->named_children()) local->register_module(child.key(), child.value());
    for (size_t i = 0; i < s->layers.size(); ++i) {
      const int64_t layer = s->first_layer + static_cast<int64_t>(i);
      d.units.emplace_back(fmt::format("layer{}.", layer),
                           fsdp::fully_shard(s->layers[i].holder(), options));
      if (cfg.ac == "all" || (cfg.ac == "every-2" && layer % 2 == 0)) {
        ac_names.push_back(fmt::format("layer{}", layer));
      }
    }
    fsdp::fully_shard(s, options);
    const fsdp::FSDPModule root = *fsdp::fsdp_module_of(*s);
    d.units.emplace_back("", root);
    p->stage_roots.push_back(root);
    p->has_first = p->has_first || s->is_first;
    p->has_last = p->has_last || s->is_last;
    stages.emplace_back(s, stage, num_stages, p->pp_mesh, stage_options);
    p->stages.push_back(s);
  }
  if (!ac_names.empty()) {
    fsdp::apply_activation_checkpointing(local, fsdp::activation_checkpoint_names(ac_names));
  }

  const auto named = local->named_parameters();
  for (const auto& item : named) {
    p->params.push_back(item.value());
    if (p->has_last && p->stages.back()->tied_copy && item.key() == "output.weight") continue;
    p->norm_params.push_back(item.value());
  }
  // The tied pair: stage 0 on pp rank 0, the last stage on pp rank pp - 1.
  if (p->has_first && !p->has_last) {
    p->tied = named["embed.weight"];
    p->tied_peer = pp - 1;
  } else if (p->has_last && p->stages.back()->tied_copy) {
    p->tied = named["output.weight"];
    p->tied_peer = 0;
  }

  fsdp::pp::LossSpec loss;
  loss.sum = models::lm_loss_sum;
  loss.count = models::lm_loss_count;
  fsdp::pp::ScheduleOptions schedule_options;
  schedule_options.dp_mesh = p->dp_mesh;
  p->schedule = std::make_unique<fsdp::pp::Schedule>(
      std::move(stages), fsdp::pp::parse_schedule_kind(cfg.schedule),
      static_cast<int>(cfg.microbatches), loss, schedule_options);
  d.net = local;
  d.pipeline = p;
  return d;
}

PipelineStepResult pipeline_step(ShardedDecoder& d, const at::Tensor& tokens,
                                 const TrainConfig& cfg) {
  Pipeline& p = *d.pipeline;
  for (auto& root : p.stage_roots) root.zero_grad();
  const fsdp::pp::StepResult step =
      p.schedule->step(p.has_first ? inputs_of(tokens) : at::Tensor(),
                       p.has_last ? targets_of(tokens) : at::Tensor());
  const fsdp::ProcessGroupPtr pp_group = p.pp_mesh.get_group("pp");
  if (p.tied.defined()) models::sum_tied_gradients(p.tied, pp_group, p.tied_peer);

  // One norm over the whole model: the stages' squared norms (each over its
  // data-parallel ranks) summed over the pipeline.
  const double stage_norm = fsdp::total_grad_norm(p.norm_params);
  at::Tensor sq = at::full({1}, stage_norm * stage_norm, at::TensorOptions().dtype(at::kDouble));
  pp_group->all_reduce(sq, fsdp::ReduceOp::SUM);
  PipelineStepResult r;
  r.grad_norm = std::sqrt(sq.item<double>());
  if (cfg.clip > 0) {
    // fsdp::clip_grad_norm_'s rule (torch's): scale whenever the coefficient
    // is below 1.
    const double coef = cfg.clip / (r.grad_norm + 1e-6);
    if (!(coef >= 1.0)) {
      torch::NoGradGuard no_grad;
      for (auto& param : p.params) {
        if (param.grad().defined()) param.mutable_grad().mul_(coef);
      }
    }
  }

  // The microbatch losses, each already divided by the global count, summed
  // over the replica's microbatches and then over the replicas: the global
  // mean, on every rank.
  r.loss = fsdp::pp::broadcast_loss(step, p.pp_mesh, static_cast<int>(cfg.num_stages()),
                                    p.dp_mesh);
  r.bubble = fsdp::pp::bubble_fraction(step, p.mesh);
  return r;
}

std::vector<std::pair<std::string, at::Tensor>> gather_full_state(const ShardedDecoder& d) {
  // Every rank takes part in its units' full_state_dict (over dp).
  std::vector<std::pair<std::string, at::Tensor>> mine = full_state(d);
  const Pipeline& p = *d.pipeline;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const auto coord = p.dp_mesh.get_coordinate();
  const bool dp_first = std::all_of(coord.begin(), coord.end(), [](int64_t c) { return c == 0; });
  const std::vector<int> pipeline_ranks = p.pp_mesh.world_ranks();
  constexpr int kTag = 7;
  if (rank != 0) {
    if (!dp_first) return {};
    int64_t n = static_cast<int64_t>(mine.size());
    MPI_Send(&n, 1, MPI_INT64_T, 0, kTag, MPI_COMM_WORLD);
    for (const auto& [name, t] : mine) {
      const at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();
      std::vector<int64_t> head = {static_cast<int64_t>(name.size()), c.dim()};
      head.insert(head.end(), c.sizes().begin(), c.sizes().end());
      int64_t head_len = static_cast<int64_t>(head.size());
      MPI_Send(&head_len, 1, MPI_INT64_T, 0, kTag, MPI_COMM_WORLD);
      MPI_Send(head.data(), static_cast<int>(head.size()), MPI_INT64_T, 0, kTag, MPI_COMM_WORLD);
      MPI_Send(name.data(), static_cast<int>(name.size()), MPI_CHAR, 0, kTag, MPI_COMM_WORLD);
      MPI_Send(c.data_ptr<float>(), static_cast<int>(c.numel()), MPI_FLOAT, 0, kTag,
               MPI_COMM_WORLD);
    }
    return {};
  }
  for (auto& [name, t] : mine) t = t.detach().to(at::kCPU, at::kFloat);
  // Rank 0 is pp rank 0 of the first pipeline; the others of that pipeline
  // hold the remaining stages.
  for (size_t i = 1; i < pipeline_ranks.size(); ++i) {
    const int src = pipeline_ranks[i];
    int64_t n = 0;
    MPI_Recv(&n, 1, MPI_INT64_T, src, kTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    for (int64_t k = 0; k < n; ++k) {
      int64_t head_len = 0;
      MPI_Recv(&head_len, 1, MPI_INT64_T, src, kTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      std::vector<int64_t> head(static_cast<size_t>(head_len));
      MPI_Recv(head.data(), static_cast<int>(head_len), MPI_INT64_T, src, kTag, MPI_COMM_WORLD,
               MPI_STATUS_IGNORE);
      std::string name(static_cast<size_t>(head[0]), '\0');
      MPI_Recv(name.data(), static_cast<int>(head[0]), MPI_CHAR, src, kTag, MPI_COMM_WORLD,
               MPI_STATUS_IGNORE);
      const std::vector<int64_t> sizes(head.begin() + 2, head.end());
      at::Tensor t = at::empty(sizes, at::kFloat);
      MPI_Recv(t.data_ptr<float>(), static_cast<int>(t.numel()), MPI_FLOAT, src, kTag,
               MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      mine.emplace_back(std::move(name), std::move(t));
    }
  }
  return mine;
}

}  // namespace fsdp_train
