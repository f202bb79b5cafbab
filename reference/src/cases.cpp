// The Level-3 cases: model, data, sharding plan and what each records.
#include "reference/case.h"

#include <models/init.h>
#include <models/llm.h>
#include <models/multimodal.h>
#include <models/tp_llm.h>
#include <models/vit.h>

#include <fsdp/tensor_parallel.h>

#include <ATen/ATen.h>

#include <functional>
#include <stdexcept>

namespace ref {

namespace {

// Bumped whenever a model's or a case's numerics change without its config
// changing (it is part of every config, so the cached references go stale).
constexpr int kRevision = 1;

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
                    int64_t world) const override {
    auto tokens = models::random_tokens(data_seed(1234, step, 0), global_batch(), cfg_.seq + 1,
                                        cfg_.vocab);
    tokens = models::rank_slice(tokens, rank, world);
    const at::Tensor inputs = tokens.narrow(1, 0, cfg_.seq);
    const at::Tensor targets = tokens.narrow(1, 1, cfg_.seq);
    if (auto t = std::dynamic_pointer_cast<models::TPDecoderImpl>(model)) {
      fsdp::Sharded<models::TPDecoder> net(t);
      return {t->loss(net(inputs), targets), {}};
    }
    fsdp::Sharded<models::Decoder> net(as<models::DecoderImpl>(model));
    return {models::lm_loss(net(inputs), targets), {}};
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
    auto c = common_config(2345, 8);
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
                    int64_t world) const override {
    auto tokens = models::random_tokens(data_seed(2345, step, 0), global_batch(), cfg_.seq + 1,
                                        cfg_.vocab);
    tokens = models::rank_slice(tokens, rank, world);
    fsdp::Sharded<models::Decoder> net(as<models::DecoderImpl>(model));
    auto out = net(tokens.narrow(1, 0, cfg_.seq), tokens.narrow(1, 1, cfg_.seq), kChunk);
    return {out[0], out[1]};
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
                    int64_t world) const override {
    auto images = models::random_images(data_seed(3456, step, 0), global_batch(), cfg_.channels,
                                        cfg_.image);
    auto labels = models::random_tokens(data_seed(3456, step, 1), global_batch(), 1, cfg_.classes)
                      .view({-1});
    fsdp::Sharded<models::ViT> net(as<models::ViTImpl>(model));
    auto logits = net(models::rank_slice(images, rank, world));
    return {at::cross_entropy_loss(logits, models::rank_slice(labels, rank, world)), {}};
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
                    int64_t world) const override {
    const auto& d = cfg_.decoder;
    auto images = models::random_images(data_seed(4567, step, 0), global_batch(),
                                        cfg_.vision.channels, cfg_.vision.image);
    auto tokens =
        models::random_tokens(data_seed(4567, step, 1), global_batch(), d.seq + 1, d.vocab);
    tokens = models::rank_slice(tokens, rank, world);
    fsdp::Sharded<models::Multimodal> net(as<models::MultimodalImpl>(model));
    auto logits = net(models::rank_slice(images, rank, world), tokens.narrow(1, 0, d.seq));
    return {models::lm_loss(logits, tokens.narrow(1, 1, d.seq)), {}};
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

const std::vector<std::pair<std::string, std::function<std::unique_ptr<Case>()>>>& registry() {
  static const std::vector<std::pair<std::string, std::function<std::unique_ptr<Case>()>>> r = {
      {"llm_decoder", [] { return std::make_unique<LlmDecoderCase>(); }},
      {"chunked_ce", [] { return std::make_unique<ChunkedCeCase>(); }},
      {"vit", [] { return std::make_unique<VitCase>(); }},
      {"multimodal", [] { return std::make_unique<MultimodalCase>(); }},
  };
  return r;
}

}  // namespace

std::shared_ptr<torch::nn::Module> Case::build_tp(const fsdp::DeviceMesh&, const TPSpec&) const {
  throw std::logic_error("reference case " + name() + " has no tensor-parallel form");
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

std::string config_hash(const Case& c) {
  // FNV-1a 64 over the canonical (sorted-key) JSON text.
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : c.config().dump()) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  static const char* hex = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, h >>= 4) out[static_cast<size_t>(i)] = hex[h & 0xf];
  return out;
}

}  // namespace ref
