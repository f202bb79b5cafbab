// Shared pieces of the test_fully_shard_with_ep feature file
// (test_fully_shard_with_ep.cpp): expert parallelism (fsdp::moe) composed
// with FSDP on 4 ranks = (efsdp=2, ep=2) against a single card.
//
// Model (the hyper-parallel configuration, PARALLELISM.md 3.5 / 6.7):
// Linear(16 -> 64) -> 2 x [x + MoE(RMSNorm(x))] -> Linear(64 -> 8), MoE =
// 4 SwiGLU experts of ffn 128, top-2 softmax routing, no aux loss.
//  - single card: the MoE is models::PlainMoE (plain LibTorch, a mask per
//    expert, written without fsdp::moe) on the whole global batch;
//  - sharded: the MoE is fsdp::moe::MoE over the ep mesh, values copied from
//    the single-card model (experts: GroupedExperts::load_full). Meshes: the
//    sparse view (efsdp, ep) of the world and its flatten "dp" (all 4 ranks)
//    for the dense weights; each block is one unit
//    fully_shard(block, expert_options(block, dense, sparse["efsdp"], 4)),
//    then the root. Rank r owns experts [2 (r % 2), 2 (r % 2) + 2).
// Data layout dp2ep (PARALLELISM.md 6.1 (a)): a global batch of 8 sequences
// of 16 tokens; rank r feeds sequences [2r, 2r + 2). Loss: the mean over
// tokens of the squared error summed over outputs; FSDP averages over the 4
// ranks, which gives the global mean's gradient (equal token counts).
#pragma once

#include "l1_util.h"
#include "precision_util.h"
#include "spmd.h"

#include <fsdp/clip_grad.h>
#include <fsdp/comm.h>
#include <fsdp/dtensor.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>
#include <fsdp/moe.h>

#include <models/layers.h>
#include <models/moe_llm.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr double kTol = 1e-4;        // plan: EP + FSDP, fp32
constexpr double kMinMargin = 1e-5;  // routing margin below which a run may route differently
constexpr int64_t kIn = 16, kDim = 64, kFfn = 128, kExperts = 4, kTopK = 2, kOut = 8;
constexpr int64_t kBlocks = 2, kBatch = 8, kSeq = 16;
constexpr int64_t kDp = 4;  // the data-parallel world: every rank sees different data
constexpr int64_t kModelSeed = 10, kDataSeed = 1000;
constexpr double kLr = 1e-2;

// ---------------------------------------------------------------------------
// The model

enum class Form { Plain, Library };

// x + MoE(RMSNorm(x)); the MoE is registered as "moe" in both forms, so the
// two models have the same parameter names.
struct BlockImpl : torch::nn::Module {
  BlockImpl(Form form, std::optional<fsdp::DeviceMesh> ep) {
    norm = register_module("norm", models::RMSNorm(kDim));
    if (form == Form::Plain) {
      plain = register_module("moe", models::PlainMoE(kDim, kFfn, kExperts, kTopK));
    } else {
      moe = register_module("moe", fsdp::moe::MoE(kDim, kFfn, kExperts, kTopK, std::move(ep)));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor n = norm(x);
    return x + (plain ? plain(n) : moe(n));
  }
  // The last forward's routing: chosen experts [T, K], pairs per expert [E].
  at::Tensor last_ids() const { return plain ? plain->last_ids : moe->last_ids(); }
  at::Tensor last_counts() const { return plain ? plain->last_counts : moe->last_counts(); }
  double last_margin() const { return plain ? plain->last_margin : moe->last_margin(); }

  models::RMSNorm norm{nullptr};
  models::PlainMoE plain{nullptr};
  fsdp::moe::MoE moe{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl(Form form, const std::optional<fsdp::DeviceMesh>& ep) {
    in = register_module("in", torch::nn::Linear(kIn, kDim));
    for (int64_t j = 0; j < kBlocks; ++j) {
      blocks.push_back(register_module("block" + std::to_string(j), Block(form, ep)));
    }
    head = register_module("head", torch::nn::Linear(kDim, kOut));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = in(x);
    for (auto& b : blocks) h = b(h);
    return head(h);
  }
  torch::nn::Linear in{nullptr}, head{nullptr};
  std::vector<fsdp::Sharded<Block>> blocks;
};
TORCH_MODULE(Net);

// Experts of (block, expert) that the crafted gates of test_ep_zero_tokens starve.
const std::vector<std::pair<int64_t, int64_t>> kIdle = {{0, 0}, {0, 1}, {1, 1}};

// The single-card model, the same on every rank. PlainExperts starts at
// randn * 0.02, whose expert gradients (~1e-5) would sit at the tolerance
// and hide a wrong scale; the Linear scale (+-1/sqrt(fan_in)) keeps them
// around 1e-3. `starve`: test_ep_zero_tokens's crafted values
// (see test_fully_shard_with_ep.cpp).
inline Net plain_net(bool starve) {
  at::manual_seed(kModelSeed);
  Net net(Form::Plain, std::nullopt);
  at::NoGradGuard no_grad;
  for (auto& b : net->blocks) {
    auto& e = b->plain->experts;
    const double bd = 1.0 / std::sqrt(static_cast<double>(kDim));
    const double bf = 1.0 / std::sqrt(static_cast<double>(kFfn));
    e->w1.uniform_(-bd, bd);
    e->w3.uniform_(-bd, bd);
    e->w2.uniform_(-bf, bf);
  }
  if (starve) {
    // Positive inputs, weights and biases: the residual stream, and so every
    // RMSNorm output (weight 1), is positive; a gate row of -1 then scores
    // about -sum(n) (~ -50) against O(1) for the others.
    net->in->weight.abs_();
    net->in->bias.abs_();
    for (const auto& [block, expert] : kIdle) {
      net->blocks[static_cast<size_t>(block)]->plain->router->gate->weight[expert].fill_(-1.0);
    }
  }
  return net;
}

// The library form with `plain`'s values: dense weights by name, experts
// this rank's slice of the full tensors.
inline Net library_net(const Net& plain, const std::optional<fsdp::DeviceMesh>& ep) {
  Net net(Form::Library, ep);
  at::NoGradGuard no_grad;
  const auto src = plain->named_parameters();
  for (auto& item : net->named_parameters()) {
    if (item.key().find(".moe.experts.") != std::string::npos) continue;
    const at::Tensor* from = src.find(item.key());
    BOOST_REQUIRE_MESSAGE(from != nullptr, item.key() << " not in the single-card model");
    item.value().copy_(*from);
  }
  for (size_t j = 0; j < net->blocks.size(); ++j) {
    const auto& e = plain->blocks[j]->plain->experts;
    net->blocks[j]->moe->experts->load_full(e->w1, e->w2, e->w3);
  }
  return net;
}

// ---------------------------------------------------------------------------
// Data

struct Batch {
  at::Tensor x, y;
};

inline Batch step_batch(int step, bool positive) {
  at::manual_seed(kDataSeed + step);
  at::Tensor x = at::randn({kBatch, kSeq, kIn});
  if (positive) x = x.abs();
  const at::Tensor y = at::randn({kBatch, kSeq, kOut});
  return {x.to(spmd::device()), y.to(spmd::device())};
}

inline Batch rank_slice(const Batch& b, int64_t rank) {
  const int64_t per = kBatch / kDp;
  return {b.x.narrow(0, rank * per, per), b.y.narrow(0, rank * per, per)};
}

inline at::Tensor loss_of(const at::Tensor& out, const at::Tensor& y) {
  return (out - y).pow(2).sum(-1).mean();
}

// ---------------------------------------------------------------------------
// Runs

using Named = std::map<std::string, at::Tensor>;

inline at::Tensor host_clone(const at::Tensor& t) { return l1::host(t).clone(); }

struct StepRecord {
  double loss = 0;                 // the global mean loss
  std::vector<at::Tensor> ids;     // per block: chosen experts of this rank's tokens
  std::vector<at::Tensor> counts;  // per block: (token, k) pairs per expert, this rank's tokens
  double margin = 0;               // min over blocks (and ranks)
  Named grads;                     // full gradients
  int64_t missing_grads = 0;       // managed parameters without a gradient (sharded runs)
  std::vector<at::Tensor> expert_norms;  // per block: [E] double
  double grad_norm = 0;
  std::vector<std::string> sequence;  // sharded runs: "op@role" in issue order
};

struct Run {
  std::vector<StepRecord> steps;
  Named params;  // full, after the steps
};

// Per-expert norms of full [E, ...] gradients w1, w2, w3.
inline at::Tensor expert_norms_of(const at::Tensor& g1, const at::Tensor& g2, const at::Tensor& g3) {
  at::Tensor sq = at::zeros({kExperts}, at::kDouble);
  for (const at::Tensor* g : {&g1, &g2, &g3}) {
    sq += g->to(at::kDouble).pow(2).reshape({kExperts, -1}).sum(1);
  }
  return sq.sqrt();
}

inline Run run_single_card(int steps, bool starve) {
  Net net = plain_net(starve);
  net->to(spmd::device());
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(kLr));
  Run r;
  for (int step = 0; step < steps; ++step) {
    const Batch b = step_batch(step, starve);
    const at::Tensor loss = loss_of(net(b.x), b.y);
    loss.backward();
    StepRecord rec;
    rec.loss = loss.item<double>();
    rec.margin = l1::kInf;
    for (auto& blk : net->blocks) {
      rec.ids.push_back(host_clone(blk->last_ids()));
      rec.counts.push_back(host_clone(blk->last_counts()));
      rec.margin = std::min(rec.margin, blk->last_margin());
    }
    double sq = 0;
    for (const auto& item : net->named_parameters()) {
      rec.grads[item.key()] = host_clone(item.value().grad());
      sq += prec::sq_norm(item.value().grad());
    }
    rec.grad_norm = std::sqrt(sq);
    for (int64_t j = 0; j < kBlocks; ++j) {
      const std::string p = "block" + std::to_string(j) + ".moe.experts.";
      rec.expert_norms.push_back(
          expert_norms_of(rec.grads.at(p + "w1"), rec.grads.at(p + "w2"), rec.grads.at(p + "w3")));
    }
    r.steps.push_back(std::move(rec));
    opt.step();
    opt.zero_grad();
  }
  for (const auto& item : net->named_parameters()) r.params[item.key()] = host_clone(item.value());
  return r;
}

// The sharded layout: EP = ep (1: no ep mesh, experts FSDP-sharded with the
// dense weights over all ranks), experts' divide factor `expert_divide`.
struct Layout {
  int64_t ep = 2;
  double expert_divide = kDp;
  std::string text() const {
    std::ostringstream os;
    os << "EP=" << ep << " efsdp=" << kDp / ep;
    if (ep > 1) os << " divide factor " << expert_divide;
    return os.str();
  }
};

// The meshes of a layout and the role of each of this rank's groups.
struct Meshes {
  fsdp::DeviceMesh dense;
  std::optional<fsdp::DeviceMesh> sparse;  // (efsdp, ep); none at EP=1
  std::map<std::string, std::string> roles;
};

inline Meshes make_meshes(int64_t ep) {
  const auto dev = spmd::device().type();
  if (ep == 1) {
    auto dense = fsdp::init_device_mesh(dev, {kDp}, {"dp"});
    return {dense, std::nullopt, {{dense.get_group(0)->name(), "dense"}}};
  }
  auto sparse = fsdp::init_device_mesh(dev, {kDp / ep, ep}, {"efsdp", "ep"});
  auto dense = sparse.flatten("dp");
  return {dense,
          sparse,
          {{dense.get_group(0)->name(), "dense"},
           {sparse.get_group("efsdp")->name(), "efsdp"},
           {sparse.get_group("ep")->name(), "ep"}}};
}

inline std::vector<std::string> role_sequence(const fsdp::CollectiveCounters& c,
                                       const std::map<std::string, std::string>& roles) {
  std::vector<std::string> out;
  for (const auto& rec : c.sequence) {
    auto it = roles.find(rec.group);
    out.push_back(rec.op + "@" + (it == roles.end() ? "unknown group " + rec.group : it->second));
  }
  return out;
}

inline Run run_sharded(const Layout& l, int steps, bool starve) {
  const Meshes m = make_meshes(l.ep);
  const std::optional<fsdp::DeviceMesh> ep =
      m.sparse ? std::optional<fsdp::DeviceMesh>((*m.sparse)["ep"]) : std::nullopt;
  Net net = library_net(plain_net(starve), ep);
  net->to(spmd::device());
  fsdp::FullyShardOptions dense;
  dense.mesh = m.dense;
  dense.comm_fusion = false;  // the tests count reduce-scatters per parameter
  std::vector<prec::Unit> units;
  for (size_t j = 0; j < net->blocks.size(); ++j) {
    auto& b = net->blocks[j];
    const fsdp::FullyShardOptions o =
        m.sparse ? fsdp::moe::expert_options(*b.ptr(), dense, (*m.sparse)["efsdp"], l.expert_divide)
                 : dense;
    units.push_back({"block" + std::to_string(j) + ".", fsdp::fully_shard(b, o)});
  }
  fsdp::FSDPModule root =
      fsdp::fully_shard(std::static_pointer_cast<torch::nn::Module>(net.ptr()), dense);
  units.push_back({"", root});
  fsdp::Sharded<Net> model(net);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(kLr));

  Run r;
  for (int step = 0; step < steps; ++step) {
    // World rank r = dense rank r (the flatten of a row-major view).
    const Batch mine = rank_slice(step_batch(step, starve), spmd::rank());
    fsdp::reset_collective_counters();
    const at::Tensor loss = loss_of(model(mine.x), mine.y);
    loss.backward();
    StepRecord rec;
    rec.sequence = role_sequence(fsdp::collective_counters(), m.roles);

    rec.loss = prec::mean_over_ranks(loss.item<double>());
    double margin = l1::kInf;
    for (auto& blk : net->blocks) {
      rec.ids.push_back(host_clone(blk->last_ids()));
      rec.counts.push_back(host_clone(blk->last_counts()));
      margin = std::min(margin, blk->last_margin());
    }
    rec.margin = -l1::world_max(-margin);
    for (const auto& p : prec::managed(units)) {
      if (!p.param.grad().defined()) ++rec.missing_grads;
      rec.grads[p.name] = host_clone(prec::full_of(prec::grad_or_zeros(p), p.dt));
    }
    for (auto& blk : net->blocks) {
      rec.expert_norms.push_back(fsdp::moe::expert_grad_norms(*blk->moe->experts));
    }
    rec.grad_norm = fsdp::total_grad_norm({root}, {});
    r.steps.push_back(std::move(rec));
    opt.step();
    root.zero_grad();
  }
  for (const auto& p : prec::managed(units)) {
    r.params[p.name] = host_clone(prec::full_of(p.param, p.dt));
  }
  return r;
}


}  // namespace
