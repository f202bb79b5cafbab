#include "verify.h"

#include "model.h"

#include <fsdp/clip_grad.h>

#include <torch/csrc/autograd/grad_mode.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>

namespace fsdp_train {

namespace {

// Net: models::Decoder or (--moe) models::MoEDecoder, plain; `config` builds
// the bf16 compute copy.
template <typename Net, typename Config>
Reference run_steps(Net master, const Config& config, const TrainConfig& cfg,
                    const Corpus& corpus, const std::function<void(const LossRow&)>& on_step) {
  auto opt = make_optimizer(*master, cfg);
  const auto params = master->parameters();
  // fp32: the master computes; bf16: a bf16 copy computes, the master steps.
  Net compute = master;
  if (cfg.bf16()) {
    compute = Net(config);
    compute->to(at::kBFloat16);
  }
  const auto compute_params = compute->parameters();
  const int64_t tokens_per_step = cfg.batch * cfg.seq;

  Reference ref;
  auto& rows = ref.rows;
  for (int64_t step = 1; step <= cfg.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    const at::Tensor tokens = corpus.global_batch(cfg.seed, step, cfg.batch, cfg.seq);
    for (auto& p : params) p.mutable_grad() = at::Tensor();
    if (cfg.bf16()) {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) compute_params[i].copy_(params[i]);
    }
    // One micro-batch per data-parallel rank; their fp32 gradients are summed
    // pairwise in rank order ((g0 + g1) + (g2 + g3) ...: a reduction over 2
    // ranks, and HSDP's shard-then-replicate reduction over 2x2) and divided
    // by the rank count.
    double loss = 0;
    std::vector<std::vector<at::Tensor>> grads;  // [rank][param]
    for (int64_t r = 0; r < cfg.dp_size; ++r) {
      const at::Tensor local = local_slice(tokens, r, cfg.dp_size);
      for (auto& p : compute_params) p.mutable_grad() = at::Tensor();
      at::Tensor l = lm_loss_of(compute->forward(local.narrow(1, 0, cfg.seq)), local);
      l.backward();
      loss += l.item<double>();
      grads.emplace_back();
      for (auto& p : compute_params) grads.back().push_back(p.grad().to(at::kFloat).clone());
    }
    while (grads.size() > 1) {
      std::vector<std::vector<at::Tensor>> next;
      for (size_t r = 0; r + 1 < grads.size(); r += 2) {
        for (size_t i = 0; i < params.size(); ++i) grads[r][i].add_(grads[r + 1][i]);
        next.push_back(std::move(grads[r]));
      }
      if (grads.size() % 2 == 1) next.push_back(std::move(grads.back()));
      grads = std::move(next);
    }
    loss /= static_cast<double>(cfg.dp_size);
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = grads[0][i].div_(static_cast<double>(cfg.dp_size));
    }
    // fsdp's clipping on plain tensors: no communication, the norm accumulated
    // in double as for the shards (LibTorch's fp32 norm differs by ~1e-6
    // relative, enough to start the drift described in verify.h).
    const double norm = cfg.clip > 0 ? fsdp::clip_grad_norm_(params, cfg.clip)
                                     : fsdp::total_grad_norm(params);
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor g = params[i].grad().abs();
      if (ref.min_abs_grad.size() == i) {
        ref.min_abs_grad.push_back(g);
      } else {
        ref.min_abs_grad[i] = at::minimum(ref.min_abs_grad[i], g);
      }
    }
    opt.step();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rows.push_back({step, loss, norm, seconds > 0 ? tokens_per_step / seconds : 0.0});
    if (on_step) on_step(rows.back());
  }
  for (const auto& item : master->named_parameters()) {
    ref.params.emplace_back(item.key(), item.value().detach());
  }
  ref.adam_eps = static_cast<const torch::optim::AdamWOptions&>(opt.defaults()).eps();
  return ref;
}

}  // namespace

Reference run_reference(const TrainConfig& cfg, const Corpus& corpus,
                        const std::function<void(const LossRow&)>& on_step,
                        const std::vector<std::pair<std::string, at::Tensor>>* initial) {
  if (cfg.moe) {
    return run_steps(build_moe_decoder(cfg), moe_decoder_config(cfg), cfg, corpus, on_step);
  }
  models::Decoder net = build_decoder(cfg);
  if (initial != nullptr) {
    torch::NoGradGuard no_grad;
    auto named = net->named_parameters();
    for (const auto& [name, value] : *initial) named[name].copy_(value);
  }
  return run_steps(net, decoder_config(cfg), cfg, corpus, on_step);
}

Comparison compare_losses(const std::vector<LossRow>& sharded, const std::vector<LossRow>& single) {
  std::map<int64_t, double> ref;
  for (const auto& r : single) ref[r.step] = r.loss;
  Comparison c;
  for (const auto& r : sharded) {
    auto it = ref.find(r.step);
    if (it == ref.end()) continue;
    ++c.compared;
    const double d = std::abs(r.loss - it->second);
    if (!(d <= c.max_abs_diff)) {  // NaN counts as worst
      c.max_abs_diff = std::isnan(d) ? std::numeric_limits<double>::infinity() : d;
      c.worst_step = r.step;
    }
  }
  return c;
}

ParamComparison compare_params(const std::vector<std::pair<std::string, at::Tensor>>& sharded,
                               const Reference& single) {
  std::map<std::string, size_t> ref;
  for (size_t i = 0; i < single.params.size(); ++i) ref[single.params[i].first] = i;
  ParamComparison c;
  auto worse = [&c](double d, const std::string& name) {
    if (!(d <= c.max_abs_diff)) {  // NaN counts as worst
      c.max_abs_diff = std::isnan(d) ? std::numeric_limits<double>::infinity() : d;
      c.worst = name;
    }
  };
  for (const auto& [name, t] : sharded) {
    auto it = ref.find(name);
    const at::Tensor want = it == ref.end() ? at::Tensor() : single.params[it->second].second;
    if (!want.defined() || want.sizes() != t.sizes()) {
      worse(std::numeric_limits<double>::infinity(), name);
      continue;
    }
    ++c.compared;
    // The reference ran on the CPU; the sharded run may be on a GPU.
    const at::Tensor diff = (t.to(at::kCPU, at::kDouble) - want.to(at::kDouble)).abs();
    worse(diff.max().item<double>(), name);
    const at::Tensor keep = single.min_abs_grad[it->second] >= 100 * single.adam_eps;
    c.elements += diff.numel();
    c.near_zero_grad += diff.numel() - keep.sum().item<int64_t>();
    const at::Tensor kept = diff.masked_select(keep);
    if (kept.numel() > 0) {
      c.well_conditioned_max_abs_diff =
          std::max(c.well_conditioned_max_abs_diff, kept.max().item<double>());
    }
    ref.erase(it);
  }
  for (const auto& [name, i] : ref) worse(std::numeric_limits<double>::infinity(), name);
  return c;
}

}  // namespace fsdp_train
