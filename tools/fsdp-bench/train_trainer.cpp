// fsdp-bench train's Trainer (train_trainer.h): builds each configuration's
// model on the same seed, shards it as the configuration says, and runs and
// times its training steps.
#include "train_trainer.h"

#include "train_memory.h"

#include "fsdp/comm.h"
#include "fsdp/float8.h"
#include "fsdp/fully_shard.h"
#include "fsdp/moe.h"
#include "fsdp/tensor_parallel.h"

#include <models/decoder_stages.h>
#include <models/init.h>
#include <models/moe_llm.h>
#include <models/tp_llm.h>

#include <ATen/ops/zeros.h>
#include <torch/cuda.h>

#include <fmt/format.h>

#include <chrono>
#include <climits>
#include <stdexcept>
#include <utility>

namespace fsdp_bench::train {
namespace {

int64_t nbytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

// fully_shard each layer of a decoder (plain or TP form), then the root
// (embedding + tied output + final norm). A TP module's parameters must be
// handed over as DTensors right before its own fully_shard, bottom-up; the
// plain decoder has none.
// forward_prefetch: explicit (each unit prefetches the next), implicit (the
// library's default: the next unit of the previous step's order) or none.
enum class ForwardPrefetch { Explicit, Implicit, None };

template <typename DecoderHolder>
fsdp::Sharded<DecoderHolder> shard_decoder(DecoderHolder decoder,
                                           const fsdp::FullyShardOptions& fo,
                                           ForwardPrefetch forward_prefetch,
                                           ConfigSpec::Backward backward_prefetch) {
  std::vector<fsdp::FSDPModule> units;
  for (auto& layer : decoder->layers) {
    units.push_back(
        fsdp::fully_shard(layer.holder(), fsdp::options_for(*layer.holder().ptr(), fo)));
  }
  fsdp::Sharded<DecoderHolder> net =
      fsdp::fully_shard(decoder, fsdp::options_for(*decoder, fo));
  units.insert(units.begin(), *fsdp::fsdp_module_of(*decoder));
  if (forward_prefetch == ForwardPrefetch::Explicit) {
    // Each unit's forward issues the next one's all-gather; the root's
    // issues the first layer's.
    for (size_t i = 0; i + 1 < units.size(); ++i) {
      units[i].set_modules_to_forward_prefetch({units[i + 1]});
    }
  } else if (forward_prefetch == ForwardPrefetch::None) {
    for (auto& u : units) u.set_modules_to_forward_prefetch({});
  }
  if (backward_prefetch == ConfigSpec::Backward::None) {
    for (auto& u : units) u.set_modules_to_backward_prefetch({});
  }
  return net;
}

ForwardPrefetch prefetch_mode(const ConfigSpec& spec, const Options& o) {
  if (!spec.forward_prefetch) return ForwardPrefetch::None;
  return o.forward_prefetch ? ForwardPrefetch::Explicit : ForwardPrefetch::Implicit;
}

// The configuration's fully_shard options on `mesh`'s shard dim (the
// pipeline and expert-parallel builders move them to their own dims).
fsdp::FullyShardOptions shard_options(const ConfigSpec& spec, const Options& o,
                                      const std::optional<fsdp::DeviceMesh>& mesh) {
  fsdp::FullyShardOptions fo;
  fo.mesh = mesh;
  fo.shard_dim = "shard";
  fo.reshard_after_forward = spec.reshard_after_forward;
  // true forces it; otherwise the library's default for the device
  // (unfused on the CPU, fused on CUDA: FullyShardOptions::comm_fusion).
  if (spec.comm_fusion) fo.comm_fusion = true;
  if (spec.backward_prefetch == ConfigSpec::Backward::Implicit) {
    fo.implicit_backward_prefetch = true;
  }
  if (spec.kind == Kind::Hsdp) fo.replicate_dim = "replicate";
  const bool data_parallel_fsdp = spec.kind == Kind::Fsdp || spec.kind == Kind::Hsdp;
  if (data_parallel_fsdp && o.param_dtype == "bfloat16") {
    // FSDP2's usual CPU/GPU mixed precision: bf16 all-gathers and compute,
    // fp32 gradient reduction and optimizer state.
    fo.mp_policy.param_dtype = at::kBFloat16;
    fo.mp_policy.reduce_dtype = at::kFloat;
  }
  // DTypeError naming float8_all_gather on a LibTorch without float8.
  if (spec.float8_all_gather) fo.all_gather_extension_fn = fsdp::float8_all_gather();
  return fo;
}

}  // namespace

Trainer::Trainer(const ConfigSpec& spec, CountingAllocator::Account& account,
                 const models::DecoderConfig& cfg, const Options& o,
                 const std::optional<fsdp::DeviceMesh>& mesh, MPI_Comm comm)
    : spec_(spec), account_(account), comm_(comm), device_(o.resolved_device) {
  MPI_Comm_size(comm, &world_);
  if (spec.kind != Kind::Single) {
    MPI_Comm_rank(comm, &data_rank_);
    data_size_ = world_;
  }
  const CountingAllocator::Scope scope(account_);
  models::Decoder decoder(cfg);
  models::init_weights(*decoder, o.seed);
  decoder->to(device_);
  const fsdp::FullyShardOptions fo = shard_options(spec, o, mesh);
  if (spec.kind == Kind::FsdpPp) {
    build_pipeline(decoder, fo, o, *mesh);
  } else if (spec.kind == Kind::FsdpEp) {
    build_moe(cfg, fo, o, *mesh);
  } else if (spec.kind == Kind::FsdpTp) {
    build_tp(decoder, cfg, fo, o, *mesh);
  } else {
    build_data_parallel(decoder, fo, o);
  }
  optimizer_ = std::make_unique<torch::optim::AdamW>(model_->parameters(),
                                                     torch::optim::AdamWOptions(o.lr));
  if (spec.kind == Kind::Ddp) {
    int64_t total = 0;
    for (const auto& p : model_->parameters()) total += p.numel();
    if (total > INT_MAX) throw std::invalid_argument("DDP bucket above INT_MAX elements");
    bucket_ = at::zeros({total}, model_->parameters().front().options());
  }
}

void Trainer::build_tp(const models::Decoder& decoder, const models::DecoderConfig& cfg,
                       const fsdp::FullyShardOptions& fo, const Options& o,
                       const fsdp::DeviceMesh& mesh) {
  tp_group_ = mesh.get_group("tp")->name();
  data_rank_ = mesh.get_local_rank("shard");
  data_size_ = static_cast<int>(mesh.size("shard"));
  models::TPDecoder tp(cfg, mesh["tp"], spec_.tp);
  tp->load_full(*decoder);
  auto net = shard_decoder(tp, fo, prefetch_mode(spec_, o), spec_.backward_prefetch);
  loss_ = [net, tp](const at::Tensor& inputs, const at::Tensor& targets) mutable {
    return tp->loss(net(inputs), targets);
  };
  model_ = tp.ptr();
}

void Trainer::build_data_parallel(models::Decoder decoder, const fsdp::FullyShardOptions& fo,
                                  const Options& o) {
  const bool data_parallel_fsdp = spec_.kind == Kind::Fsdp || spec_.kind == Kind::Hsdp;
  // Not sharded (single, ddp): Sharded simply forwards.
  fsdp::Sharded<models::Decoder> net =
      data_parallel_fsdp
          ? shard_decoder(decoder, fo, prefetch_mode(spec_, o), spec_.backward_prefetch)
          : fsdp::Sharded<models::Decoder>(decoder);
  loss_ = [net](const at::Tensor& inputs, const at::Tensor& targets) mutable {
    return models::lm_loss(net(inputs), targets);
  };
  model_ = decoder.ptr();
}

at::Tensor Trainer::share(const at::Tensor& global) const {
  return models::rank_slice(global, data_rank_, data_size_).to(device_);
}

void Trainer::step(const at::Tensor& inputs, const at::Tensor& targets, bool record) {
  using Clock = std::chrono::steady_clock;
  const CountingAllocator::Scope scope(account_);
  // On a GPU the phases end when their kernels do, not when they are queued.
  const auto now = [this] {
    if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
    return Clock::now();
  };
  const auto t0 = now();
  optimizer_->zero_grad();
  at::Tensor loss;
  std::optional<fsdp::pp::StepResult> pipelined;
  if (spec_.kind == Kind::FsdpPp) {
    // Forward and backward of every microbatch; the first stage's ranks
    // take the inputs, the last stage's the targets.
    pipelined = schedule_->step(has_first_ ? inputs : at::Tensor(),
                                has_last_ ? targets : at::Tensor());
  } else {
    loss = loss_(inputs, targets);
  }
  const auto t1 = now();
  if (!pipelined) loss.backward();
  const auto t2 = now();
  if (spec_.kind == Kind::Ddp) all_reduce_gradients();
  if (tied_.defined()) models::sum_tied_gradients(tied_, pp_group_, tied_peer_);
  const auto t3 = now();
  optimizer_->step();
  const auto t4 = now();
  if (pipelined) {
    last_step_ = *pipelined;
    if (record) pipeline_steps_.push_back(*pipelined);
  } else {
    last_loss_ = loss.detach();
  }
  if (record) {
    for (const auto& [a, b] : {std::pair{t0, t1}, {t1, t2}, {t2, t3}, {t3, t4}}) {
      phase_us_.push_back(std::chrono::duration<double, std::micro>(b - a).count());
    }
  }
}

double Trainer::last_loss() const {
  if (spec_.kind == Kind::FsdpPp) {
    return fsdp::pp::broadcast_loss(last_step_, *pp_mesh_, num_stages_, dp_mesh_);
  }
  return last_loss_.defined() ? last_loss_.item<double>() : 0.0;
}

Trainer::Persistent Trainer::persistent() const {
  Persistent out;
  for (const auto& p : model_->parameters()) {
    out.params += nbytes(p);
    out.grads += nbytes(p.grad());
  }
  for (const auto& entry : optimizer_->state()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*entry.second);
    out.optimizer += nbytes(s.exp_avg()) + nbytes(s.exp_avg_sq()) + nbytes(s.max_exp_avg_sq());
  }
  return out;
}

void Trainer::all_reduce_gradients() {
  const auto params = model_->parameters();
  int64_t offset = 0;
  for (const auto& p : params) {
    at::Tensor slot = bucket_.narrow(0, offset, p.numel());
    if (p.grad().defined()) {
      slot.copy_(p.grad().reshape({-1}));
    } else {
      slot.zero_();
    }
    offset += p.numel();
  }
  const int rc = MPI_Allreduce(MPI_IN_PLACE, bucket_.data_ptr<float>(),
                               static_cast<int>(bucket_.numel()), MPI_FLOAT, MPI_SUM, comm_);
  if (rc != MPI_SUCCESS) throw std::runtime_error(fmt::format("MPI_Allreduce returned {}", rc));
  bucket_.div_(world_);
  offset = 0;
  for (auto p : params) {
    if (p.grad().defined()) {
      p.mutable_grad().view({-1}).copy_(bucket_.narrow(0, offset, p.numel()));
    }
    offset += p.numel();
  }
}

void Trainer::build_pipeline(const models::Decoder& decoder, fsdp::FullyShardOptions fo,
                             const Options& o, const fsdp::DeviceMesh& mesh) {
  pp_mesh_ = mesh["pp"];
  dp_mesh_ = mesh["dp"];
  pp_group_ = mesh.get_group("pp");
  data_rank_ = mesh.get_local_rank("dp");
  data_size_ = static_cast<int>(mesh.size("dp"));
  const int pp = static_cast<int>(mesh.size("pp"));
  const int pp_rank = mesh.get_local_rank("pp");
  num_stages_ = pp * spec_.stages_per_rank;
  fo.mesh = mesh["dp"];
  fo.shard_dim = "dp";
  auto local = std::make_shared<torch::nn::Module>("PipelineRank");
  std::vector<fsdp::pp::PipelineStage> stages;
  bool tied_copy = false;
  for (int v = 0; v < spec_.stages_per_rank; ++v) {
    const int stage = pp_rank + v * pp;
    models::DecoderStage s(*decoder, stage, num_stages_);
    for (const auto& child : s->named_children()) {
      local->register_module(child.key(), child.value());
    }
    for (auto& layer : s->layers) fsdp::fully_shard(layer.holder(), fo);
    fsdp::fully_shard(s, fo);
    has_first_ = has_first_ || s->is_first;
    has_last_ = has_last_ || s->is_last;
    tied_copy = tied_copy || s->tied_copy;
    stages.emplace_back(s, stage, num_stages_, *pp_mesh_);
  }
  const auto named = local->named_parameters();
  if (has_first_ && !has_last_ && decoder->config.tie_output) {
    tied_ = named["embed.weight"];
    tied_peer_ = pp - 1;
  } else if (tied_copy) {
    tied_ = named["output.weight"];
    tied_peer_ = 0;
  }
  fsdp::pp::LossSpec loss;
  loss.sum = models::lm_loss_sum;
  loss.count = models::lm_loss_count;
  fsdp::pp::ScheduleOptions options;
  options.dp_mesh = mesh["dp"];
  const int local_batch = o.batch / data_size_;
  schedule_ = std::make_unique<fsdp::pp::Schedule>(
      std::move(stages), spec_.schedule, o.microbatches > 0 ? o.microbatches : local_batch,
      loss, options);
  model_ = local;
}

void Trainer::build_moe(const models::DecoderConfig& cfg, fsdp::FullyShardOptions fo,
                        const Options& o, const fsdp::DeviceMesh& mesh) {
  const models::MoEDecoderConfig mc = models::moe_decoder_config(cfg, kExperts, kTopK);
  models::MoEDecoder plain(mc);
  models::init_weights(*plain, o.seed);
  models::MoEDecoder net(mc, models::MoEForm::Library, mesh["ep"]);
  net->load_full(*plain);
  fo.mesh = mesh.flatten("shard");
  for (auto& layer : net->dense_layers) fsdp::fully_shard(layer.holder(), fo);
  for (auto& layer : net->moe_layers) {
    fsdp::fully_shard(layer.holder(),
                      fsdp::moe::expert_options(*layer.holder().ptr(), fo, mesh["efsdp"],
                                                static_cast<double>(world_)));
  }
  fsdp::Sharded<models::MoEDecoder> root = fsdp::fully_shard(net, fo);
  loss_ = [root](const at::Tensor& inputs, const at::Tensor& targets) mutable {
    return models::lm_loss(root(inputs), targets);
  };
  model_ = net.ptr();
}

}  // namespace fsdp_bench::train
