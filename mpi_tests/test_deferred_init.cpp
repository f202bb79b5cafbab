// Deferred initialisation (fsdp/deferred_init.h): models built on the meta
// device, sharded, then materialised and initialised on the shards.
//
// Cases:
//   test_meta_init_makes_meta_modules        MetaInit: modules, factories, scoping
//   test_seeded_rule_restated                 the seeded rule against the test's own
//                                             statement of it (no libfsdp code)
//   test_deferred_shards_equal_single_process every rank's shards == the rows of a
//                                             whole model initialised by the same rule
//   test_deferred_train_vs_single_process     2 steps from a deferred init vs one
//                                             process (1e-5), FSDP and (np 4) HSDP
//   test_deferred_errors                      forward before materialize, wrong device
//   test_deferred_setup_peak                  set-up peak per rank <= shards + one unit,
//                                             model >= 3x that budget at np 4
//
// Baselines are one-process runs of the unsharded model (plan rule 1); the
// cross-rank checks go through raw MPI (raw_mpi.h).
#include "device_memory.h"
#include "raw_mpi.h"
#include "spmd.h"

#include <fsdp/deferred_init.h>
#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>
#include <models/init.h>
#include <models/llm.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/sgd.h>

#include <boost/test/unit_test.hpp>

#include <map>
#include <string>
#include <vector>

namespace {

// The decoder's rule on pieces (biases 0, 1-D weights 1, the rest the
// seeded N(0, 0.02)): what fsdp-train --init deferred uses.
fsdp::InitFn decoder_rule(uint64_t seed) { return models::seeded_init_rule(seed); }

models::DecoderConfig small_decoder() {
  models::DecoderConfig c;
  c.vocab = 96;
  c.hidden = 48;
  c.heads = 4;
  c.layers = 3;
  c.ffn = 80;
  c.seq = 16;
  return c;
}

// A plain decoder in this process, initialised by the rule on whole tensors.
models::Decoder reference_decoder(const models::DecoderConfig& cfg, uint64_t seed) {
  models::Decoder net(cfg);
  models::init_weights_seeded(*net, seed);
  return net;
}

struct DeferredDecoder {
  models::Decoder net{nullptr};
  fsdp::Sharded<models::Decoder> root;
  std::vector<fsdp::FSDPModule> units;
};

// Built under MetaInit, sharded (layers, then root), not yet materialised.
DeferredDecoder deferred_decoder(const models::DecoderConfig& cfg,
                                 const fsdp::FullyShardOptions& options) {
  DeferredDecoder d;
  {
    fsdp::MetaInit meta;
    d.net = models::Decoder(cfg);
  }
  for (auto& layer : d.net->layers) d.units.push_back(fsdp::fully_shard(layer.holder(), options));
  d.root = fsdp::fully_shard(d.net, options);
  return d;
}

fsdp::FullyShardOptions options_for_layout(const std::string& layout) {
  fsdp::FullyShardOptions o;
  const int ws = spmd::world_size();
  if (layout == "hsdp") {
    o.mesh = fsdp::init_device_mesh(spmd::device().type(), {2, ws / 2}, {"replicate", "shard"});
  } else {
    o.mesh = fsdp::init_device_mesh(spmd::device().type(), {ws}, {"shard"});
  }
  return o;
}

std::vector<std::string> layouts() {
  std::vector<std::string> out{"fsdp"};
  if (spmd::world_size() == 4) out.push_back("hsdp");
  return out;
}

// The largest |a - b| over every parameter's full tensor (sharded: gathered
// by fully_shard's full_state_dict) against the reference, max over ranks.
double max_param_gap(const DeferredDecoder& d, const models::Decoder& ref) {
  std::map<std::string, at::Tensor> full;
  for (size_t i = 0; i < d.units.size(); ++i) {
    for (const auto& [name, t] : d.units[i].full_state_dict()) {
      full["layer" + std::to_string(i) + "." + name] = t;
    }
  }
  for (const auto& [name, t] : fsdp::fsdp_module_of(*d.net)->full_state_dict()) full[name] = t;
  double worst = 0;
  for (const auto& item : ref->named_parameters()) {
    BOOST_TEST_REQUIRE(full.count(item.key()) == 1, "no full tensor for " << item.key());
    const at::Tensor a = full.at(item.key()).cpu().to(at::kDouble);
    const at::Tensor b = item.value().detach().cpu().to(at::kDouble);
    BOOST_TEST_REQUIRE(a.sizes() == b.sizes(), item.key());
    worst = std::max(worst, (a - b).abs().max().item<double>());
  }
  return raw_mpi::max_over_ranks(worst);
}

// --- the test's own statement of the seeded rule (deferred_init.h) ---
uint64_t splitmix_final(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
uint64_t fnv1a(const std::string& s) {
  uint64_t h = 14695981039346656037ULL;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return h;
}
at::Tensor restated_row(uint64_t seed, const std::string& name, int64_t row, int64_t n) {
  const uint64_t s = splitmix_final(splitmix_final(seed + fnv1a(name)) + static_cast<uint64_t>(row));
  at::Generator gen = at::detail::createCPUGenerator(s);
  return at::normal(0.0, 0.02, {n}, gen);
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_meta_init_makes_meta_modules) {
  torch::nn::Linear linear{nullptr};
  torch::nn::Embedding embedding{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Conv2d conv{nullptr};
  at::Tensor outside = at::ones({2});
  at::Tensor computed, made, nested_made;
  {
    fsdp::MetaInit meta;
    // 40000 x 40000 fp32 would be 6.4 GB: it must not be allocated.
    linear = torch::nn::Linear(40000, 40000);
    embedding = torch::nn::Embedding(1000, 64);
    norm = torch::nn::LayerNorm(torch::nn::LayerNormOptions({64}));
    conv = torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3));
    made = at::randn({5}, at::TensorOptions().device(at::kCPU));
    {
      fsdp::MetaInit nested;
      nested_made = at::zeros({3});
    }
    computed = outside * 2;  // an op on an existing tensor runs where it is
  }
  for (const auto& m : std::vector<std::shared_ptr<torch::nn::Module>>{
           linear.ptr(), embedding.ptr(), norm.ptr(), conv.ptr()}) {
    for (const auto& p : m->named_parameters()) {
      BOOST_TEST(p.value().is_meta(), p.key() << " is on " << p.value().device());
      BOOST_TEST(p.value().requires_grad(), p.key());
    }
  }
  BOOST_TEST((linear->weight.sizes() == at::IntArrayRef{40000, 40000}));
  BOOST_TEST(made.is_meta());
  BOOST_TEST(nested_made.is_meta());  // the outer guard is still active after the inner one
  BOOST_TEST(computed.device().is_cpu());
  BOOST_TEST(computed.sum().item<double>() == 4.0);
  BOOST_TEST(at::zeros({2}).device().is_cpu(), "MetaInit ended: factories are back on the CPU");
}

BOOST_AUTO_TEST_CASE(test_seeded_rule_restated) {
  // Rows of a 2-D tensor and blocks of a 1-D one, drawn by the test's own
  // statement of the rule, equal what seeded_normal_ writes into a whole tensor.
  const uint64_t seed = 1234;
  at::Tensor w = at::empty({7, 5});
  fsdp::seeded_normal_(fsdp::piece_of("blk.w", w), seed, 0.0, 0.02);
  for (int64_t r = 0; r < 7; ++r) {
    BOOST_TEST(at::equal(w[r], restated_row(seed, "blk.w", r, 5)), "row " << r);
  }
  at::Tensor v = at::empty({2500});
  fsdp::seeded_normal_(fsdp::piece_of("v", v), seed, 0.0, 0.02);
  BOOST_TEST(at::equal(v.narrow(0, 0, 1024), restated_row(seed, "v", 0, 1024)));
  BOOST_TEST(at::equal(v.narrow(0, 2048, 452), restated_row(seed, "v", 2, 452)));
  BOOST_TEST(fsdp::seeded_row_seed(seed, "v", 2) ==
             splitmix_final(splitmix_final(seed + fnv1a("v")) + 2));
  // Different names and seeds give different values.
  at::Tensor other = at::empty({7, 5});
  fsdp::seeded_normal_(fsdp::piece_of("blk.u", other), seed, 0.0, 0.02);
  BOOST_TEST(!at::equal(w, other));
}

BOOST_AUTO_TEST_CASE(test_deferred_shards_equal_single_process) {
  const models::DecoderConfig cfg = small_decoder();
  const uint64_t seed = 7;
  const models::Decoder ref = reference_decoder(cfg, seed);
  for (const std::string& layout : layouts()) {
    BOOST_TEST_CONTEXT("layout " << layout) {
      DeferredDecoder d = deferred_decoder(cfg, options_for_layout(layout));
      for (const auto& p : d.net->parameters()) BOOST_TEST_REQUIRE(p.is_meta());
      fsdp::materialize(*d.net, spmd::device(), decoder_rule(seed));
      for (const auto& item : d.net->named_parameters()) {
        BOOST_TEST(!item.value().is_meta(), item.key());
        BOOST_TEST(item.value().device() == spmd::device(), item.key());
      }
      // Each rank's local shard: the rows fully_shard's layout gives it.
      for (size_t i = 0; i < d.units.size(); ++i) {
        for (const auto& [name, dt] : d.units[i].sharded_parameters()) {
          const std::string full_name = "layer" + std::to_string(i) + "." + name;
          at::Tensor expect = ref->named_parameters()[full_name].detach();
          for (const fsdp::LocalPiece& b : fsdp::local_pieces(dt)) {
            at::Tensor mine = dt.to_local().cpu(), want = expect;
            for (size_t k = 0; k < b.sizes.size(); ++k) {
              const auto dim = static_cast<int64_t>(k);
              mine = mine.narrow(dim, b.local_offsets[k], b.sizes[k]);
              want = want.narrow(dim, b.offsets[k], b.sizes[k]);
            }
            BOOST_TEST(at::equal(mine, want), full_name);
          }
        }
      }
      BOOST_TEST(max_param_gap(d, ref) == 0.0, "full tensors equal the single-process init bitwise");
    }
  }
}

BOOST_AUTO_TEST_CASE(test_deferred_train_vs_single_process) {
  const models::DecoderConfig cfg = small_decoder();
  const uint64_t seed = 11;
  const int ws = spmd::world_size(), rank = spmd::rank();
  const int64_t per_rank = 2, steps = 2;
  for (const std::string& layout : layouts()) {
    BOOST_TEST_CONTEXT("layout " << layout) {
      models::Decoder ref = reference_decoder(cfg, seed);
      torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.5));
      DeferredDecoder d = deferred_decoder(cfg, options_for_layout(layout));
      // The optimizer may be built on the meta parameters: materialize keeps
      // each parameter object and gives it storage.
      torch::optim::SGD opt(d.net->parameters(), torch::optim::SGDOptions(0.5));
      fsdp::materialize(*d.net, spmd::device(), decoder_rule(seed));
      double worst_loss = 0;
      for (int64_t s = 0; s < steps; ++s) {
        at::Generator gen = at::detail::createCPUGenerator(100 + static_cast<uint64_t>(s));
        const at::Tensor tokens = at::randint(0, cfg.vocab, {per_rank * ws, cfg.seq + 1}, gen,
                                              at::TensorOptions().dtype(at::kLong));
        const at::Tensor in = tokens.narrow(1, 0, cfg.seq), tgt = tokens.narrow(1, 1, cfg.seq);
        // Reference: the whole batch, one process.
        ref_opt.zero_grad();
        const at::Tensor ref_loss = models::lm_loss(ref->forward(in), tgt);
        ref_loss.backward();
        ref_opt.step();
        // Sharded: this rank's slice; the mean over ranks is the batch mean.
        opt.zero_grad();
        const at::Tensor mine = in.narrow(0, rank * per_rank, per_rank).to(spmd::device());
        const at::Tensor mine_t = tgt.narrow(0, rank * per_rank, per_rank).to(spmd::device());
        const at::Tensor loss = models::lm_loss(d.root(mine), mine_t);
        loss.backward();
        opt.step();
        const double global = raw_mpi::mean_over_ranks(loss.item<double>());
        worst_loss = std::max(worst_loss, std::abs(global - ref_loss.item<double>()));
      }
      worst_loss = raw_mpi::max_over_ranks(worst_loss);
      const double gap = max_param_gap(d, ref);
      BOOST_TEST_MESSAGE(layout << ": loss gap " << worst_loss << ", parameter gap " << gap);
      BOOST_TEST(worst_loss <= 1e-5);
      BOOST_TEST(gap <= 1e-5);
    }
  }
}

BOOST_AUTO_TEST_CASE(test_deferred_errors) {
  const models::DecoderConfig cfg = small_decoder();
  DeferredDecoder d = deferred_decoder(cfg, options_for_layout("fsdp"));
  const at::Tensor tokens = at::zeros({1, cfg.seq}, at::TensorOptions().dtype(at::kLong))
                                .to(spmd::device());
  try {
    d.root(tokens);
    BOOST_FAIL("a forward before materialize must throw");
  } catch (const fsdp::StateError& e) {
    const std::string what = e.what();
    BOOST_TEST(what.find("meta device") != std::string::npos, what);
    BOOST_TEST(what.find("materialize") != std::string::npos, what);
  }
  // Every unit is still deferred and usable after the refused forward.
  const c10::Device other = spmd::device().is_cpu() ? c10::Device(c10::kMeta) : c10::Device(c10::kCPU);
  try {
    fsdp::materialize(*d.net, other);
    BOOST_FAIL("materialize on another device type must throw");
  } catch (const fsdp::ArgumentError& e) {
    BOOST_TEST(e.argument() == "device");
  }
  for (const auto& p : d.net->parameters()) BOOST_TEST(p.is_meta(), "nothing allocated");
  fsdp::materialize(*d.net, spmd::device(), decoder_rule(3));
  const at::Tensor out = d.root(tokens);
  BOOST_TEST(out.device() == spmd::device());
  BOOST_TEST(bool(at::isfinite(out).all().item<bool>()));
}

BOOST_AUTO_TEST_CASE(test_deferred_model_over_budget) {
  // A decoder of 24 layers, ~74 MiB in fp32. Set-up (build on meta, shard,
  // materialise) keeps at most the shards plus one unit's full size live --
  // the set-up budget, which the model exceeds 3x at 4 ranks; two SGD steps
  // then stay under the training budget (80% of the model at 4 ranks) and
  // match one process's run from the same seed.
  models::DecoderConfig cfg;
  cfg.vocab = 256;
  cfg.hidden = 256;
  cfg.heads = 4;
  cfg.layers = 24;
  cfg.ffn = 704;
  cfg.seq = 32;
  const int ws = spmd::world_size(), rank = spmd::rank();
  if (!spmd::device().is_cpu()) {
    BOOST_TEST_MESSAGE("skipped on " << spmd::device()
                                     << ": the budgets are measured with the host allocator tracker");
    return;
  }
  int64_t model_bytes = 0, unit_bytes = 0;
  {
    fsdp::MetaInit meta;  // shapes only
    for (const auto& p : models::Decoder(cfg)->parameters()) model_bytes += p.numel() * 4;
    for (const auto& p : models::DecoderLayer(cfg.hidden, cfg.heads, cfg.ffn_dim())->parameters()) {
      unit_bytes += p.numel() * 4;
    }
  }
  const int64_t shards = (model_bytes + ws - 1) / ws;
  const int64_t setup_budget = shards + unit_bytes + (1 << 20);
  const uint64_t seed = 5;
  auto batch = [&](int64_t s) {
    at::Generator gen = at::detail::createCPUGenerator(200 + static_cast<uint64_t>(s));
    return at::randint(0, cfg.vocab, {ws, cfg.seq + 1}, gen, at::TensorOptions().dtype(at::kLong));
  };
  // The one-process reference runs first, before the tracker: not counted.
  models::Decoder ref = reference_decoder(cfg, seed);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.5));
  std::vector<double> ref_losses;
  for (int64_t s = 0; s < 2; ++s) {
    const at::Tensor tokens = batch(s);
    ref_opt.zero_grad();
    const at::Tensor loss = models::lm_loss(ref->forward(tokens.narrow(1, 0, cfg.seq)),
                                             tokens.narrow(1, 1, cfg.seq));
    loss.backward();
    ref_opt.step();
    ref_losses.push_back(loss.item<double>());
  }

  spmd::DeviceMemory memory;
  const int64_t before = memory.live();
  memory.reset_peak();
  DeferredDecoder d = deferred_decoder(cfg, options_for_layout("fsdp"));
  const double meta_peak = raw_mpi::max_over_ranks(static_cast<double>(memory.peak() - before));
  BOOST_TEST(meta_peak < (1 << 20), "nothing of the model is allocated on meta");
  torch::optim::SGD opt(d.net->parameters(), torch::optim::SGDOptions(0.5));
  fsdp::materialize(*d.net, spmd::device(), decoder_rule(seed));
  const double setup_peak = raw_mpi::max_over_ranks(static_cast<double>(memory.peak() - before));

  memory.reset_peak();
  double worst_loss = 0;
  for (int64_t s = 0; s < 2; ++s) {
    const at::Tensor tokens = batch(s);
    const at::Tensor in = tokens.narrow(1, 0, cfg.seq), tgt = tokens.narrow(1, 1, cfg.seq);
    opt.zero_grad();
    const at::Tensor loss = models::lm_loss(d.root(in.narrow(0, rank, 1)), tgt.narrow(0, rank, 1));
    loss.backward();
    opt.step();
    const double global = raw_mpi::mean_over_ranks(loss.item<double>());
    worst_loss = std::max(worst_loss, std::abs(global - ref_losses[static_cast<size_t>(s)]));
  }
  const double train_peak = raw_mpi::max_over_ranks(static_cast<double>(memory.peak() - before));
  const double gap = max_param_gap(d, ref);
  worst_loss = raw_mpi::max_over_ranks(worst_loss);
  const double mib = 1048576.0;
  BOOST_TEST_MESSAGE("model " << model_bytes / mib << " MiB; per rank: set-up peak "
                              << setup_peak / mib << " MiB (budget " << setup_budget / mib
                              << "), training peak " << train_peak / mib
                              << " MiB; loss gap " << worst_loss << ", parameter gap " << gap);
  BOOST_TEST(setup_peak <= static_cast<double>(setup_budget));
  if (ws == 4) {
    BOOST_TEST(model_bytes >= 3 * setup_budget, "the model is 3x the set-up budget");
    // Training holds a quarter of the parameters and of the gradients per
    // rank plus one layer's gathers and reductions: the whole run stays
    // under 80% of the model's size (measured: 57 MiB of 74).
    const double train_budget = 0.8 * static_cast<double>(model_bytes);
    BOOST_TEST(train_peak <= train_budget, "training peak " << train_peak / mib << " MiB, budget "
                                                            << train_budget / mib << " MiB");
  }
  BOOST_TEST(worst_loss <= 1e-5);
  BOOST_TEST(gap <= 1e-5);
}
