#include "model.h"

#include <fsdp/checkpoint.h>
#include <models/init.h>
#include <models/layers.h>

#include <fmt/format.h>

#include <map>

namespace fsdp_train {

models::DecoderConfig decoder_config(const TrainConfig& cfg) {
  models::DecoderConfig d;
  d.vocab = cfg.vocab;
  d.hidden = cfg.hidden;
  d.heads = cfg.heads;
  d.layers = cfg.layers;
  d.seq = cfg.seq;
  d.tie_output = true;
  return d;
}

models::Decoder build_decoder(const TrainConfig& cfg) {
  models::Decoder net(decoder_config(cfg));
  models::init_weights(*net, cfg.seed);
  return net;
}

int64_t parameter_count(const models::Decoder& net) {
  int64_t n = 0;
  for (const auto& p : net->parameters()) n += p.numel();
  return n;
}

ShardedDecoder shard_decoder(models::Decoder net, const TrainConfig& cfg,
                             const fsdp::DeviceMesh& mesh) {
  fsdp::FullyShardOptions options;
  options.mesh = mesh;
  options.reshard_after_forward = cfg.reshard_after_forward;
  if (cfg.bf16()) {
    options.mp_policy.param_dtype = at::kBFloat16;
    options.mp_policy.reduce_dtype = at::kFloat;
  }
  ShardedDecoder d{net, nullptr, {}};
  for (size_t i = 0; i < net->layers.size(); ++i) {
    d.units.emplace_back(fmt::format("layer{}.", i),
                         fsdp::fully_shard(net->layers[i].holder(), options));
  }
  // The root unit: embedding (tied with the output layer) and the final norm.
  d.model = fsdp::fully_shard(net, options);
  d.units.emplace_back("", *fsdp::fsdp_module_of(*net));
  if (cfg.ac != "none") {
    const int64_t every = cfg.ac == "all" ? 1 : 2;
    fsdp::apply_activation_checkpointing(
        net.ptr(), fsdp::checkpoint_every_nth(every, [](const torch::nn::Module& m) {
          return dynamic_cast<const models::DecoderLayerImpl*>(&m) != nullptr;
        }));
  }
  return d;
}

std::vector<std::pair<std::string, at::Tensor>> local_state(const ShardedDecoder& d) {
  std::map<std::string, at::Tensor> by_name;
  for (const auto& [prefix, unit] : d.units) {
    for (const auto& [name, dt] : unit.state_dict()) by_name[prefix + name] = dt.to_local();
  }
  // In named_parameters() order (the optimizer's order).
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : d.net->named_parameters()) {
    auto it = by_name.find(item.key());
    if (it == by_name.end()) {
      throw std::logic_error("fsdp-train: parameter " + item.key() + " belongs to no unit");
    }
    out.emplace_back(item.key(), it->second);
  }
  return out;
}

void load_local_state(ShardedDecoder& d,
                      const std::vector<std::pair<std::string, at::Tensor>>& state) {
  std::map<std::string, at::Tensor> by_name(state.begin(), state.end());
  for (auto& [prefix, unit] : d.units) {
    std::vector<std::pair<std::string, at::Tensor>> mine;
    for (const auto& [name, dt] : unit.state_dict()) {
      auto it = by_name.find(prefix + name);
      if (it == by_name.end()) {
        throw ConfigError("--resume: the checkpoint has no shard of parameter " + prefix + name);
      }
      if (it->second.sizes() != dt.to_local().sizes()) {
        throw ConfigError(fmt::format(
            "--resume: the checkpoint's shard of {} has shape [{}], this rank's is [{}]",
            prefix + name, fmt::join(it->second.sizes(), ", "),
            fmt::join(dt.to_local().sizes(), ", ")));
      }
      mine.emplace_back(name, it->second);
    }
    unit.load_state_dict(mine);
  }
}

torch::optim::AdamW make_optimizer(const models::Decoder& net, const TrainConfig& cfg) {
  return torch::optim::AdamW(net->parameters(),
                             torch::optim::AdamWOptions(cfg.lr).weight_decay(0.0));
}

at::Tensor lm_loss_of(const at::Tensor& logits, const at::Tensor& tokens) {
  const int64_t seq = tokens.size(1) - 1;
  return models::lm_loss(logits.to(at::kFloat), tokens.narrow(1, 1, seq));
}

}  // namespace fsdp_train
