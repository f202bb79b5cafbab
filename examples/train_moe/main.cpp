// The README's mixture-of-experts example: a small language model whose
// feed-forward is an MoE layer (4 SwiGLU experts, each token routed to 2),
// trained data parallel on every rank. The experts are split over an ep dim
// (ep rank r owns experts 2r and 2r + 1) and sharded by FSDP over efsdp, the
// ranks that own the same experts; the dense weights are sharded by FSDP
// over all ranks.
// Run: mpiexec -n 4 ./train_moe (efsdp = world / 2, ep = 2).
#include <fsdp/fsdp.h>

#include <torch/nn/functional/loss.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/embedding.h>
#include <torch/optim/adamw.h>

#include <iostream>

constexpr int64_t kVocab = 64, kHidden = 32, kSeq = 8, kExperts = 4, kTopK = 2;

struct LmImpl : torch::nn::Module {
  LmImpl(const fsdp::DeviceMesh& ep, const fsdp::moe::RouterOptions& router) {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kHidden));
    torch::nn::init::normal_(embed->weight, 0, 0.02);  // GPT-style: N(0, 1) would start at loss ~30
    moe = register_module("moe", fsdp::moe::MoE(kHidden, /*ffn=*/2 * kHidden, kExperts, kTopK,
                                                ep, router));
  }
  // Logits through the tied embedding.
  torch::Tensor forward(torch::Tensor ids) {
    const auto h = embed(ids);
    return torch::linear(h + moe(h), embed->weight);
  }
  torch::nn::Embedding embed{nullptr};
  fsdp::Sharded<fsdp::moe::MoE> moe{nullptr};
};
TORCH_MODULE(Lm);

int main(int argc, char** argv) {
  fsdp::Runtime rt(&argc, &argv);
  const int64_t world = rt.world_size(), ep_size = 2;
  // One mesh, two views: (efsdp, ep) for the experts, and the same ranks
  // flattened into one data-parallel dim for the dense weights.
  const auto sparse = fsdp::init_device_mesh("cpu", {world / ep_size, ep_size}, {"efsdp", "ep"});
  const auto dense = sparse.flatten("dp");

  // The load-balancing loss counts the tokens of every rank (they all see
  // different data), so its value is the global batch's.
  fsdp::moe::RouterOptions router;
  router.aux_loss_coef = 0.01;
  router.aux_stats_mesh = dense;
  torch::manual_seed(0);  // every rank builds the same full weights, then keeps its experts
  Lm lm(sparse["ep"], router);

  fsdp::FullyShardOptions options;
  options.mesh = dense;
  // The MoE layer is one unit with two parameter groups: router on dp,
  // experts on efsdp. Their gradients already sum every ep rank's tokens,
  // so they are divided by the whole data-parallel size, not efsdp's.
  fsdp::fully_shard(lm->moe.holder(), fsdp::moe::expert_options(*lm->moe.ptr(), options,
                                                                sparse["efsdp"], world));
  fsdp::Sharded<Lm> model = fsdp::fully_shard(lm, options);

  torch::optim::AdamW opt(lm->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::manual_seed(1 + rt.world_rank());  // different data on every rank
  const auto tokens = torch::randint(0, kVocab, {4, kSeq + 1});
  const auto inputs = tokens.narrow(1, 0, kSeq), targets = tokens.narrow(1, 1, kSeq);
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    namespace F = torch::nn::functional;
    const auto ce = F::cross_entropy(model(inputs).reshape({-1, kVocab}), targets.reshape({-1}));
    const auto loss = ce + lm->moe->aux_loss();
    loss.backward();
    const double norm = fsdp::clip_grad_norm_(lm->parameters(), /*max_norm=*/1.0);
    opt.step();
    // Tokens per expert over the global batch: max / mean = 1 is balanced.
    auto counts = lm->moe->last_counts().to(torch::kFloat64);
    dense.get_group("dp")->all_reduce(counts);
    const double balance = (counts.max() / counts.mean()).item<double>();
    if (rt.world_rank() == 0) {
      std::cout << "step " << step << " loss " << ce.item<float>() << " aux "
                << lm->moe->aux_loss().item<float>() << " grad norm " << norm
                << " load max/mean " << balance << "\n";
    }
  }
  return 0;
}
