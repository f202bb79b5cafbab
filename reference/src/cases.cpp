// The Level-3 cases: model, data, sharding plan and what each records.
#include "reference/case.h"

#include <models/init.h>
#include <models/llm.h>
#include <models/moe_llm.h>
#include <models/multimodal.h>
#include <models/tp_llm.h>
#include <models/vit.h>

#include <fsdp/moe.h>
#include <fsdp/tensor_parallel.h>

#include <ATen/ATen.h>

#include <functional>
#include <stdexcept>

namespace ref {

namespace {

// Bumped whenever a model's or a case's numerics change without its config
// changing (it is part of every config, so the cached references go stale).
constexpr int kRevision = 2;

nlohmann::json common_config(int64_t seed, int64_t batch) {
  return {{"revision", kRevision}, {"seed", seed}, {"steps", 2}, {"global_batch", batch},
          {"optimizer", {{"name", "AdamW"}, {"lr", 1e-3}, {"betas", {0.9, 0.999}},
                         {"eps", 1e-8}, {"weight_decay", 0.0}}},
          {"dtype", "float32"}};
}

nlohmann::json decoder_json(const models::DecoderConfig& d) {
  return {{"vocab", d.vocab}, {"hidden", d.hidden}, {"heads", d.heads}, {"layers", d.layers},
          {"ffn", d.ffn_dim()}, {"seq", d.seq}, {"tie_output", d.tie_output}};
}

nlohmann::json vit_json(const models::ViTConfig& v) {
  return {{"image", v.image}, {"patch", v.patch}, {"channels", v.channels}, {"hidden", v.hidden},
          {"heads", v.heads}, {"blocks", v.blocks}, {"mlp", v.mlp}, {"classes", v.classes},
          {"taps", v.taps}};
}

// Data of step `step` is drawn from seed * 1000 + step (+ a stream offset).
uint64_t data_seed(int64_t seed, int64_t step, int64_t stream) {
  return static_cast<uint64_t>(seed * 1000 + step * 10 + stream);
}

template <typename Impl>
std::shared_ptr<Impl> as(const std::shared_ptr<torch::nn::Module>& m) {
  auto p = std::dynamic_pointer_cast<Impl>(m);
  if (!p) throw std::logic_error("reference case: model has an unexpected type");
  return p;
}

std::vector<at::Tensor> params_of(const torch::nn::Module& m) { return m.parameters(); }

// This rank's slice of a global batch, on the model's device (the data is
// always drawn on the CPU, so every device sees the same batch).
at::Tensor slice_for(const std::shared_ptr<torch::nn::Module>& model, const at::Tensor& global,
                     int64_t rank, int64_t world) {
  const auto params = model->parameters();
  const c10::Device device = params.empty() ? c10::Device(c10::kCPU) : params.front().device();
  return models::rank_slice(global, rank, world).to(device);
}

// Shards each layer of a decoder (plain or TP form), then the decoder itself.
template <typename Decoder>
void shard_decoder(Decoder& d, const std::string& prefix, const fsdp::FullyShardOptions& o,
                   std::vector<Unit>& units) {
  for (size_t i = 0; i < d.layers.size(); ++i) {
    auto& layer = d.layers[i].holder();
    units.push_back({prefix + "layer" + std::to_string(i) + ".",
                     fsdp::fully_shard(layer, fsdp::options_for(*layer.ptr(), o))});
  }
}

void shard_vit_blocks(models::ViTImpl& v, const std::string& prefix,
                      const fsdp::FullyShardOptions& o, std::vector<Unit>& units) {
  for (size_t i = 0; i < v.blocks.size(); ++i) {
    units.push_back({prefix + "block" + std::to_string(i) + ".",
                     fsdp::fully_shard(v.blocks[i].holder(), o)});
  }
}

// ---- L3-01 / L3-02: decoder with a weight-tied output layer ----------------
class LlmDecoderCase : public Case {
 public:
  std::string name() const override { return "llm_decoder"; }
  std::vector<std::string> plan_ids() const override { return {"L3-01", "L3-02"}; }
  nlohmann::json config() const override {
    auto c = common_config(1234, 8);
    c["model"] = decoder_json(cfg_);
    return c;
  }
  std::shared_ptr<torch::nn::Module> build() const override {
    auto m = std::make_shared<models::DecoderImpl>(cfg_);
    models::init_weights(*m, 1234);
    return m;
  }
  std::shared_ptr<torch::nn::Module> build_tp(const fsdp::DeviceMesh& tp,
                                              const TPSpec& spec) const override {
    auto full = as<models::DecoderImpl>(build());
    auto m = std::make_shared<models::TPDecoderImpl>(
        cfg_, tp, models::TPOptions{spec.sequence_parallel, spec.loss_parallel});
    m->load_full(*full);
    return m;
  }
  std::vector<Unit> shard(const std::shared_ptr<torch::nn::Module>& model,
                          const fsdp::FullyShardOptions& o) const override {
    std::vector<Unit> units;
    if (auto t = std::dynamic_pointer_cast<models::TPDecoderImpl>(model)) {
      shard_decoder(*t, "", o, units);
    } else {
      shard_decoder(*as<models::DecoderImpl>(model), "", o, units);
    }
    // embedding + tied output + norm
    units.push_back({"", fsdp::fully_shard(model, fsdp::options_for(*model, o))});
    return units;
  }
  LocalLoss forward(const std::shared_ptr<torch::nn::Module>& model, int64_t step, int64_t rank,
                    int64_t world, Layout /*layout*/) const override {
    auto tokens = models::random_tokens(data_seed(1234, step, 0), global_batch(), cfg_.seq + 1,
                                        cfg_.vocab);
    tokens = slice_for(model, tokens, rank, world);
    const at::Tensor inputs = tokens.narrow(1, 0, cfg_.seq);
    const at::Tensor targets = tokens.narrow(1, 1, cfg_.seq);
    if (auto t = std::dynamic_pointer_cast<models::TPDecoderImpl>(model)) {
      fsdp::Sharded<models::TPDecoder> net(t);
      return {t->loss(net(inputs), targets)};
    }
    fsdp::Sharded<models::Decoder> net(as<models::DecoderImpl>(model));
    return {models::lm_loss(net(inputs), targets)};
  }
  std::vector<std::string> recorded() const override {
    return {"layer0.attn.qkv.weight", "layer3.ffn.w2.weight"};
  }

 private:
  models::DecoderConfig cfg_{};
};

// ---- L3-05: 2-layer decoder, vocab 32768, CE in chunks of 512 tokens -------
class ChunkedCeCase : public Case {
 public:
  ChunkedCeCase() {
    cfg_.vocab = 32768;
    cfg_.layers = 2;
    cfg_.tie_output = false;
  }
  std::string name() const override { return "chunked_ce"; }
  std::vector<std::string> plan_ids() const override { return {"L3-05"}; }
  nlohmann::json config() const override {
    // 16 x 128 tokens: 2 chunks of 512 per rank at np 2, 1 at np 4, 4 on the
    // single card. At 32 x 128 (2 per rank at np 4) the 8 chunks' losses sum
    // to the unchunked loss only within 1.55e-6 in fp32 on the single card
    // itself, beyond the plan's 1e-6 (docs/test-plan.md, L3-05).
    auto c = common_config(2345, 16);
    c["model"] = decoder_json(cfg_);
    c["chunk_tokens"] = kChunk;
    return c;
  }
  std::shared_ptr<torch::nn::Module> build() const override {
    auto m = std::make_shared<models::DecoderImpl>(cfg_);
    models::init_weights(*m, 2345);
    return m;
  }
  std::vector<Unit> shard(const std::shared_ptr<torch::nn::Module>& model,
                          const fsdp::FullyShardOptions& o) const override {
    std::vector<Unit> units;
    shard_decoder(*as<models::DecoderImpl>(model), "", o, units);
    units.push_back({"", fsdp::fully_shard(model, o)});
    return units;
  }
  LocalLoss forward(const std::shared_ptr<torch::nn::Module>& model, int64_t step, int64_t rank,
                    int64_t world, Layout layout) const override {
    auto tokens = models::random_tokens(data_seed(2345, step, 0), global_batch(), cfg_.seq + 1,
                                        cfg_.vocab);
    tokens = slice_for(model, tokens, rank, world);
    fsdp::Sharded<models::Decoder> net(as<models::DecoderImpl>(model));
    models::ChunkedLoss loss;
    loss.chunk_tokens = kChunk;
    loss.recompute = layout == Layout::FSDP;
    loss.unchunked = true;
    auto out = net(tokens.narrow(1, 0, cfg_.seq), tokens.narrow(1, 1, cfg_.seq), loss);
    return {out[0], out[1], out[2]};
  }
  std::vector<std::string> recorded() const override { return {"layer0.attn.qkv.weight"}; }
  std::map<std::string, std::vector<std::string>> sub_norms() const override {
    return {{"output", {"output.weight"}}};
  }

 private:
  static constexpr int64_t kChunk = 512;
  models::DecoderConfig cfg_{};
};

// ---- L3-04: ViT, patch embedding and head replicated (not sharded) ---------
class VitCase : public Case {
 public:
  std::string name() const override { return "vit"; }
  std::vector<std::string> plan_ids() const override { return {"L3-04"}; }
  nlohmann::json config() const override {
    auto c = common_config(3456, 4);
    // AdamW's first update is lr * g / (|g| + eps), whose slope at g = 0 is
    // lr / eps. The 196,608-element patch embedding has tens of step-0
    // gradients below 1e-6; at the default eps 1e-8 the ~1e-9 that splitting
    // the batch over ranks moves them by (any DDP, not FSDP's doing) moved
    // those weights by 1.8e-4 and the step-1 grad norm by 1.4e-5 on LibTorch
    // 2.15. At 1e-6 the slope is 100x smaller and every update with
    // |g| >> 1e-6 is unchanged.
    c["optimizer"]["eps"] = 1e-6;
    c["model"] = vit_json(cfg_);
    return c;
  }
  std::shared_ptr<torch::nn::Module> build() const override {
    auto m = std::make_shared<models::ViTImpl>(cfg_);
    models::init_weights(*m, 3456);
    return m;
  }
  std::vector<Unit> shard(const std::shared_ptr<torch::nn::Module>& model,
                          const fsdp::FullyShardOptions& o) const override {
    std::vector<Unit> units;
    auto v = as<models::ViTImpl>(model);
    shard_vit_blocks(*v, "", o, units);
    auto root = o;
    for (auto& p : params_of(*v->patch_embed)) root.replicate_params.push_back(p);
    for (auto& p : params_of(*v->head)) root.replicate_params.push_back(p);
    units.push_back({"", fsdp::fully_shard(model, root)});
    return units;
  }
  LocalLoss forward(const std::shared_ptr<torch::nn::Module>& model, int64_t step, int64_t rank,
                    int64_t world, Layout /*layout*/) const override {
    auto images = models::random_images(data_seed(3456, step, 0), global_batch(), cfg_.channels,
                                        cfg_.image);
    auto labels = models::random_tokens(data_seed(3456, step, 1), global_batch(), 1, cfg_.classes)
                      .view({-1});
    fsdp::Sharded<models::ViT> net(as<models::ViTImpl>(model));
    auto logits = net(slice_for(model, images, rank, world));
    return {at::cross_entropy_loss(logits, slice_for(model, labels, rank, world))};
  }
  std::vector<std::string> recorded() const override {
    return {"patch_embed.weight", "block5.mlp.fc2.weight"};
  }

 private:
  models::ViTConfig cfg_{};
};

// ---- L3-06: ViT -> projection MLP (replicated) -> decoder, deep stack ------
class MultimodalCase : public Case {
 public:
  std::string name() const override { return "multimodal"; }
  std::vector<std::string> plan_ids() const override { return {"L3-06"}; }
  nlohmann::json config() const override {
    auto c = common_config(4567, 4);
    c["model"] = {{"vision", vit_json(cfg_.vision)}, {"decoder", decoder_json(cfg_.decoder)},
                  {"projector_hidden", cfg_.projector_hidden}};
    return c;
  }
  std::shared_ptr<torch::nn::Module> build() const override {
    auto m = std::make_shared<models::MultimodalImpl>(cfg_);
    models::init_weights(*m, 4567);
    return m;
  }
  std::vector<Unit> shard(const std::shared_ptr<torch::nn::Module>& model,
                          const fsdp::FullyShardOptions& o) const override {
    std::vector<Unit> units;
    auto mm = as<models::MultimodalImpl>(model);
    // The two sub-models are sharded independently, each with its own root.
    shard_vit_blocks(*mm->vision.holder(), "vision.", o, units);
    units.push_back({"vision.", fsdp::fully_shard(mm->vision, o)});
    shard_decoder(*mm->decoder.holder(), "decoder.", o, units);
    units.push_back({"decoder.", fsdp::fully_shard(mm->decoder, o)});
    // The projection MLP is not sharded: replicated, gradients all-reduced.
    auto root = o;
    root.replicate_params = params_of(*mm->projector);
    units.push_back({"", fsdp::fully_shard(model, root)});
    return units;
  }
  LocalLoss forward(const std::shared_ptr<torch::nn::Module>& model, int64_t step, int64_t rank,
                    int64_t world, Layout /*layout*/) const override {
    const auto& d = cfg_.decoder;
    auto images = models::random_images(data_seed(4567, step, 0), global_batch(),
                                        cfg_.vision.channels, cfg_.vision.image);
    auto tokens =
        models::random_tokens(data_seed(4567, step, 1), global_batch(), d.seq + 1, d.vocab);
    tokens = slice_for(model, tokens, rank, world);
    fsdp::Sharded<models::Multimodal> net(as<models::MultimodalImpl>(model));
    auto logits = net(slice_for(model, images, rank, world), tokens.narrow(1, 0, d.seq));
    return {models::lm_loss(logits, tokens.narrow(1, 1, d.seq))};
  }
  std::vector<std::string> recorded() const override {
    return {"projector.fc1.weight", "projector.fc2.weight"};
  }
  std::map<std::string, std::vector<std::string>> sub_norms() const override {
    return {{"vision", {"vision."}}, {"decoder", {"decoder."}}, {"projector", {"projector."}}};
  }

 private:
  models::MultimodalConfig cfg_{};
};

// ---- L3-03: decoder with MoE FFNs in its odd layers, experts over ep -------
// Single and DDP train the plain form (no fsdp::moe code); the EP form is
// fsdp::moe::MoE over the ep mesh, loaded from the plain one. No aux loss
// (the plan's parity setting: PARALLELISM.md 6.6.6).
class MoELlmCase : public Case {
 public:
  std::string name() const override { return "moe_llm"; }
  std::vector<std::string> plan_ids() const override { return {"L3-03"}; }
  nlohmann::json config() const override {
    auto c = common_config(kSeed, 8);
    c["model"] = {{"vocab", cfg_.vocab},   {"hidden", cfg_.hidden},
                  {"heads", cfg_.heads},   {"layers", cfg_.layers},
                  {"ffn", cfg_.ffn_dim()}, {"experts", cfg_.experts},
                  {"top_k", cfg_.top_k},   {"expert_ffn", cfg_.expert_dim()},
                  {"seq", cfg_.seq},       {"moe_layers", "odd"},
                  {"tie_output", true},    {"aux_loss_coef", 0.0}};
    return c;
  }
  std::shared_ptr<torch::nn::Module> build() const override {
    auto m = std::make_shared<models::MoEDecoderImpl>(cfg_);
    models::init_weights(*m, kSeed);
    return m;
  }
  std::shared_ptr<torch::nn::Module> build_ep(const fsdp::DeviceMesh& ep) const override {
    auto full = as<models::MoEDecoderImpl>(build());
    auto m = std::make_shared<models::MoEDecoderImpl>(cfg_, models::MoEForm::Library, ep);
    m->load_full(*full);
    return m;
  }
  std::vector<Unit> shard(const std::shared_ptr<torch::nn::Module>& model,
                          const fsdp::FullyShardOptions& o) const override {
    return shard_layers(model, o, nullptr, 0);
  }
  std::vector<Unit> shard_ep(const std::shared_ptr<torch::nn::Module>& model,
                             const fsdp::FullyShardOptions& o, const fsdp::DeviceMesh& expert_mesh,
                             double data_parallel_size) const override {
    return shard_layers(model, o, &expert_mesh, data_parallel_size);
  }
  LocalLoss forward(const std::shared_ptr<torch::nn::Module>& model, int64_t step, int64_t rank,
                    int64_t world, Layout /*layout*/) const override {
    auto tokens = models::random_tokens(data_seed(kSeed, step, 0), global_batch(), cfg_.seq + 1,
                                        cfg_.vocab);
    tokens = slice_for(model, tokens, rank, world);
    fsdp::Sharded<models::MoEDecoder> net(as<models::MoEDecoderImpl>(model));
    return {models::lm_loss(net(tokens.narrow(1, 0, cfg_.seq)), tokens.narrow(1, 1, cfg_.seq))};
  }
  // A dense, an expert and a router weight (attn.proj rather than the larger
  // qkv keeps data/ under its 30 MB budget next to the experts' [4, 512, 256]).
  std::vector<std::string> recorded() const override {
    return {"layer0.attn.proj.weight", "layer1.moe.experts.w1", "layer3.moe.router.gate.weight"};
  }
  // "dense": every parameter but the experts (the plan's dense grad norm).
  std::map<std::string, std::vector<std::string>> sub_norms() const override {
    std::vector<std::string> dense = {"embed.", "norm."};
    for (int64_t i = 0; i < cfg_.layers; ++i) {
      const std::string l = "layer" + std::to_string(i) + ".";
      if (!cfg_.is_moe(i)) {
        dense.push_back(l);
        continue;
      }
      for (const char* part : {"attn_norm.", "attn.", "ffn_norm.", "moe.router."}) {
        dense.push_back(l + part);
      }
    }
    return {{"dense", dense}};
  }
  // "layer<i>.expert<e>": the 2-norm over w1, w2 and w3 of expert e.
  std::map<std::string, double> model_norms(const torch::nn::Module& model) const override {
    const auto& d = dynamic_cast<const models::MoEDecoderImpl&>(model);
    std::map<std::string, double> out;
    const auto layers = moe_layer_names();
    for (size_t j = 0; j < d.moe_layers.size(); ++j) {
      const auto& block = *d.moe_layers[j].holder();
      const at::Tensor per_expert = block.moe ? fsdp::moe::expert_grad_norms(*block.moe->experts)
                                              : plain_expert_norms(*block.plain->experts);
      for (int64_t e = 0; e < per_expert.numel(); ++e) {
        out[layers[j] + ".expert" + std::to_string(e)] = per_expert[e].item<double>();
      }
    }
    return out;
  }
  std::optional<Routing> routing(const torch::nn::Module& model) const override {
    const auto& d = dynamic_cast<const models::MoEDecoderImpl&>(model);
    Routing r;
    const auto ids = d.last_ids();
    const auto layers = moe_layer_names();
    for (size_t j = 0; j < ids.size(); ++j) r.ids[layers[j]] = ids[j];
    r.margin = d.last_margin();
    return r;
  }

 private:
  // The margin on this data: see reference/README.md.
  static constexpr int64_t kSeed = 5678;

  std::vector<std::string> moe_layer_names() const {
    std::vector<std::string> out;
    for (int64_t i = 0; i < cfg_.layers; ++i) {
      if (cfg_.is_moe(i)) out.push_back("layer" + std::to_string(i));
    }
    return out;
  }

  // From the full gradients alone (the baselines' experts are not sharded).
  static at::Tensor plain_expert_norms(const models::PlainExpertsImpl& experts) {
    at::Tensor sq = at::zeros({experts.w1.size(0)}, experts.w1.options().dtype(at::kDouble));
    for (const at::Tensor* w : {&experts.w1, &experts.w2, &experts.w3}) {
      if (w->grad().defined()) {
        sq += w->grad().to(at::kDouble).pow(2).reshape({w->size(0), -1}).sum(1);
      }
    }
    return sq.sqrt();
  }

  // Layers (dense or MoE blocks), then the root (embedding, tied output,
  // final norm); with an expert mesh the MoE blocks get their experts on it.
  std::vector<Unit> shard_layers(const std::shared_ptr<torch::nn::Module>& model,
                                 const fsdp::FullyShardOptions& o,
                                 const fsdp::DeviceMesh* expert_mesh, double dp_size) const {
    auto d = as<models::MoEDecoderImpl>(model);
    std::vector<Unit> units;
    for (int64_t i = 0; i < cfg_.layers; ++i) {
      const std::string prefix = "layer" + std::to_string(i) + ".";
      const size_t j = static_cast<size_t>(i / 2);
      if (!cfg_.is_moe(i)) {
        units.push_back({prefix, fsdp::fully_shard(d->dense_layers[j], o)});
        continue;
      }
      const auto& block = d->moe_layers[j];
      units.push_back(
          {prefix, fsdp::fully_shard(block, expert_mesh ? fsdp::moe::expert_options(
                                                              *block.ptr(), o, *expert_mesh, dp_size)
                                                        : o)});
    }
    units.push_back({"", fsdp::fully_shard(model, o)});
    return units;
  }

  models::MoEDecoderConfig cfg_{};
};

const std::vector<std::pair<std::string, std::function<std::unique_ptr<Case>()>>>& registry() {
  static const std::vector<std::pair<std::string, std::function<std::unique_ptr<Case>()>>> r = {
      {"llm_decoder", [] { return std::make_unique<LlmDecoderCase>(); }},
      {"chunked_ce", [] { return std::make_unique<ChunkedCeCase>(); }},
      {"vit", [] { return std::make_unique<VitCase>(); }},
      {"multimodal", [] { return std::make_unique<MultimodalCase>(); }},
      {"moe_llm", [] { return std::make_unique<MoELlmCase>(); }},
  };
  return r;
}

}  // namespace

std::shared_ptr<torch::nn::Module> Case::build_tp(const fsdp::DeviceMesh&, const TPSpec&) const {
  throw std::logic_error("reference case " + name() + " has no tensor-parallel form");
}

std::shared_ptr<torch::nn::Module> Case::build_ep(const fsdp::DeviceMesh&) const {
  throw std::logic_error("reference case " + name() + " has no expert-parallel form");
}

std::vector<Unit> Case::shard_ep(const std::shared_ptr<torch::nn::Module>&,
                                 const fsdp::FullyShardOptions&, const fsdp::DeviceMesh&,
                                 double) const {
  throw std::logic_error("reference case " + name() + " has no expert-parallel form");
}

int64_t Case::steps() const { return config().at("steps").get<int64_t>(); }
double Case::lr() const { return config().at("optimizer").at("lr").get<double>(); }
int64_t Case::global_batch() const { return config().at("global_batch").get<int64_t>(); }

std::vector<std::string> case_names() {
  std::vector<std::string> names;
  for (const auto& [name, make] : registry()) names.push_back(name);
  return names;
}

std::unique_ptr<Case> make_case(const std::string& name) {
  std::string known;
  for (const auto& [n, make] : registry()) {
    if (n == name) return make();
    known += (known.empty() ? "" : ", ") + n;
  }
  throw std::invalid_argument("unknown reference case '" + name + "' (known: " + known + ")");
}

nlohmann::json stored_config(const Case& c) {
  nlohmann::json j = c.config();
  j["recorded"] = c.recorded();
  j["sub_norms"] = c.sub_norms();
  return j;
}

std::string config_hash(const Case& c) {
  // FNV-1a 64 over the canonical (sorted-key) JSON text.
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : stored_config(c).dump()) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  static const char* hex = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, h >>= 4) out[static_cast<size_t>(i)] = hex[h & 0xf];
  return out;
}

}  // namespace ref
