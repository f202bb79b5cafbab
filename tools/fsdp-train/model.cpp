#include "model.h"

#include <fsdp/activation_checkpoint.h>
#include <fsdp/errors.h>
#include <fsdp/float8.h>
#include <fsdp/moe.h>
#include <fsdp/tensor_parallel.h>
#include <models/init.h>
#include <models/layers.h>
#include <models/tp_llm.h>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (fmt >= 11 keeps it here)

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
  // The rule deferred initialisation applies on the shards: every layout and
  // --init starts from the same weights for one --seed.
  models::init_weights_seeded(*net, cfg.seed);
  return net;
}

ShardedDecoder build_deferred_decoder(const TrainConfig& cfg, const fsdp::DeviceMesh& mesh,
                                      const c10::Device& device, int64_t& n_params) {
  models::Decoder net{nullptr};
  {
    fsdp::MetaInit meta;
    net = models::Decoder(decoder_config(cfg));
  }
  n_params = parameter_count(*net);
  ShardedDecoder d = shard_decoder(net, cfg, mesh);
  // With --load the storage is left zero for load_weights to fill.
  fsdp::materialize(*d.net, device,
                    cfg.load.empty() ? models::seeded_init_rule(cfg.seed) : fsdp::InitFn{});
  return d;
}

models::MoEDecoderConfig moe_decoder_config(const TrainConfig& cfg) {
  return models::moe_decoder_config(decoder_config(cfg), cfg.experts, cfg.top_k);
}

models::MoEDecoder build_moe_decoder(const TrainConfig& cfg) {
  models::MoEDecoder net(moe_decoder_config(cfg));
  models::init_weights_seeded(*net, cfg.seed);
  return net;
}

int64_t parameter_count(const torch::nn::Module& net) {
  int64_t n = 0;
  for (const auto& p : net.parameters()) n += p.numel();
  return n;
}

fsdp::FullyShardOptions shard_options(const TrainConfig& cfg, const fsdp::DeviceMesh& mesh) {
  fsdp::FullyShardOptions options;
  options.mesh = mesh;
  // Named, since a (shard, tp) mesh would otherwise read as (replicate, shard).
  options.shard_dim = "shard";
  if (cfg.hsdp()) options.replicate_dim = "replicate";
  // Unset unless given: FSDP2's default, every unit but the root.
  if (cfg.reshard_after_forward_given) options.reshard_after_forward = reshard_after_forward_option(cfg);
  if (cfg.bf16()) {
    options.mp_policy.param_dtype = at::kBFloat16;
    options.mp_policy.reduce_dtype = at::kFloat;
  }
  // Matrix weights gather in float8, then compute in bf16 (docs/float8.md).
  if (cfg.fp8()) options.all_gather_extension_fn = fsdp::float8_all_gather();
  return options;
}

at::Tensor inputs_of(const at::Tensor& tokens) { return tokens.narrow(1, 0, tokens.size(1) - 1); }
at::Tensor targets_of(const at::Tensor& tokens) { return tokens.narrow(1, 1, tokens.size(1) - 1); }

namespace {

// The device of `net`'s parameters (--device put the plain model there).
c10::Device device_of(const torch::nn::Module& net) {
  const auto params = net.parameters();
  return params.empty() ? c10::Device(c10::kCPU) : params.front().device();
}

// Bottom-up: each layer, then the root unit (embedding, tied output, final
// norm). Decoder: models::Decoder or models::TPDecoder.
template <typename Decoder>
fsdp::Sharded<Decoder> shard_units(Decoder net, const fsdp::FullyShardOptions& options,
                                   std::vector<std::pair<std::string, fsdp::FSDPModule>>& units) {
  for (size_t i = 0; i < net->layers.size(); ++i) {
    const auto& layer = net->layers[i].holder();
    units.emplace_back(fmt::format("layer{}.", i),
                       fsdp::fully_shard(layer, fsdp::options_for(*layer.ptr(), options)));
  }
  fsdp::Sharded<Decoder> root = fsdp::fully_shard(net, fsdp::options_for(*net, options));
  units.emplace_back("", *fsdp::fsdp_module_of(*net));
  return root;
}

models::TPDecoder build_tp_decoder(const models::Decoder& net, const TrainConfig& cfg,
                                   const fsdp::DeviceMesh& tp) {
  try {
    models::TPDecoder tp_net(decoder_config(cfg), tp,
                             models::TPOptions{cfg.sequence_parallel, cfg.loss_parallel});
    tp_net->load_full(*net);
    tp_net->to(device_of(*net));
    return tp_net;
  } catch (const fsdp::ShapeError& e) {
    if (e.argument() == "seq") {
      throw ConfigError(fmt::format(
          "--seq {}: with --sequence-parallel the sequence length must divide by --tp {} ({})",
          cfg.seq, cfg.tp, e.what()));
    }
    throw ConfigError(fmt::format(
        "--tp {}: the byte decoder (vocab {}, heads {}, ffn {}) does not split by it: {}", cfg.tp,
        cfg.vocab, cfg.heads, decoder_config(cfg).ffn_dim(), e.what()));
  }
}

void apply_ac(ShardedDecoder& d, const TrainConfig& cfg) {
  if (cfg.ac == "none") return;
  const int64_t every = cfg.ac == "all" ? 1 : 2;
  fsdp::apply_activation_checkpointing(
      d.net, fsdp::activation_checkpoint_every_nth(every, [](const torch::nn::Module& m) {
        return dynamic_cast<const models::DecoderLayerImpl*>(&m) != nullptr ||
               dynamic_cast<const models::TPDecoderLayerImpl*>(&m) != nullptr ||
               dynamic_cast<const models::MoEBlockImpl*>(&m) != nullptr;
      }));
}

}  // namespace

ShardedDecoder shard_decoder(const models::Decoder& net, const TrainConfig& cfg,
                             const fsdp::DeviceMesh& mesh) {
  const fsdp::FullyShardOptions options = shard_options(cfg, mesh);
  ShardedDecoder d;
  if (cfg.tp == 1) {
    d.net = net.ptr();
    d.loss = [root = shard_units(net, options, d.units)](const at::Tensor& tokens) mutable {
      return lm_loss_of(root(inputs_of(tokens)), tokens);
    };
  } else {
    const models::TPDecoder tp_net = build_tp_decoder(net, cfg, mesh["tp"]);
    d.net = tp_net.ptr();
    d.loss = [tp_net, root = shard_units(tp_net, options, d.units)](
                 const at::Tensor& tokens) mutable {
      return tp_net->loss(root(inputs_of(tokens)).to(at::kFloat), targets_of(tokens));
    };
  }
  apply_ac(d, cfg);
  return d;
}

ShardedDecoder shard_moe_decoder(const models::MoEDecoder& plain, const TrainConfig& cfg,
                                 const fsdp::DeviceMesh& mesh) {
  // Every rank sees different data: the dense weights are sharded over all
  // of them, and the experts' gradients, already summed over ep by the
  // all-to-all's backward, are divided by all of them too (moe.h).
  const fsdp::FullyShardOptions dense = shard_options(cfg, mesh.flatten("shard"));
  models::MoEDecoder net(moe_decoder_config(cfg), models::MoEForm::Library, mesh["ep"]);
  net->load_full(*plain);
  net->to(device_of(*plain));
  ShardedDecoder d;
  d.net = net.ptr();
  for (int64_t i = 0; i < cfg.layers; ++i) {
    const auto j = static_cast<size_t>(i / 2);
    const std::string prefix = fmt::format("layer{}.", i);
    if (net->config.is_moe(i)) {
      const auto& layer = net->moe_layers[j];
      d.units.emplace_back(prefix, fsdp::fully_shard(layer, fsdp::moe::expert_options(
                                                                *layer.ptr(), dense, mesh["efsdp"],
                                                                static_cast<double>(cfg.dp_size))));
    } else {
      d.units.emplace_back(prefix, fsdp::fully_shard(net->dense_layers[j], dense));
    }
  }
  // The root holds the embedding (tied output) and the final norm only.
  fsdp::Sharded<models::MoEDecoder> root = fsdp::fully_shard(net, dense);
  d.units.emplace_back("", *fsdp::fsdp_module_of(*net));
  d.loss = [root](const at::Tensor& tokens) mutable {
    return lm_loss_of(root(inputs_of(tokens)), tokens);
  };
  d.expert_counts = [net] { return net->last_counts(); };
  apply_ac(d, cfg);
  return d;
}

std::vector<std::pair<std::string, at::Tensor>> full_state(const ShardedDecoder& d) {
  std::map<std::string, at::Tensor> by_name;
  for (const auto& [prefix, unit] : d.units) {
    for (const auto& [name, t] : unit.full_state_dict()) by_name[prefix + name] = t;
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : d.net->named_parameters()) {
    out.emplace_back(item.key(), by_name.at(item.key()));
  }
  return out;
}

torch::optim::AdamW make_optimizer(const torch::nn::Module& net, const TrainConfig& cfg) {
  return torch::optim::AdamW(net.parameters(),
                             torch::optim::AdamWOptions(cfg.lr).weight_decay(0.0).eps(cfg.adam_eps));
}

at::Tensor lm_loss_of(const at::Tensor& logits, const at::Tensor& tokens) {
  const int64_t seq = tokens.size(1) - 1;
  return models::lm_loss(logits.to(at::kFloat), tokens.narrow(1, 1, seq));
}

}  // namespace fsdp_train
