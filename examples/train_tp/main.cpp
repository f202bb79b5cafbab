// The README's tensor-parallel example: a small language model whose
// embedding, MLP and loss are split over a tp dim (Megatron layout, with
// sequence parallelism), sharded by FSDP over the data-parallel dim.
// Run: mpiexec -n 2 ./train_tp (dp = world / 2, tp = 2).
#include <fsdp/fsdp.h>

#include <torch/optim/adamw.h>

#include <iostream>

constexpr int64_t kVocab = 64, kHidden = 32, kSeq = 8;

// Column- then row-parallel: the hidden activation stays split over tp.
// Under sequence parallelism its input and output are split on the sequence
// dim: the column layer all-gathers it, the row layer reduce-scatters.
struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(const fsdp::DeviceMesh& tp) {
    fsdp::tp::ColumnParallelOptions in;
    in.sequence_parallel = true;
    fsdp::tp::RowParallelOptions out;
    out.sequence_parallel = true;
    up = register_module("up", fsdp::tp::ColumnParallelLinear(kHidden, 4 * kHidden, tp, in));
    down = register_module("down", fsdp::tp::RowParallelLinear(4 * kHidden, kHidden, tp, out));
  }
  torch::Tensor forward(torch::Tensor x) { return x + down(torch::gelu(up(x))); }
  fsdp::tp::ColumnParallelLinear up{nullptr};
  fsdp::tp::RowParallelLinear down{nullptr};
};
TORCH_MODULE(Mlp);

struct LmImpl : torch::nn::Module {
  explicit LmImpl(const fsdp::DeviceMesh& tp) : tp(tp) {
    fsdp::tp::VocabParallelOptions sp;
    sp.sequence_parallel = true;  // the embedding's output is split on the sequence
    embed = register_module("embed",
                            fsdp::tp::VocabParallelEmbedding(kVocab, kHidden, tp, sp));
    mlp = register_module("mlp", Mlp(tp));
  }
  // This rank's vocab slice of the logits (tied output, column-parallel).
  torch::Tensor forward(torch::Tensor ids) {
    auto h = fsdp::tp::sp_all_gather(mlp(embed(ids)), /*dim=*/1, tp);
    return torch::linear(h, embed->weight);
  }
  fsdp::DeviceMesh tp;
  fsdp::tp::VocabParallelEmbedding embed{nullptr};
  fsdp::Sharded<Mlp> mlp{nullptr};
};
TORCH_MODULE(Lm);

int main(int argc, char** argv) {
  fsdp::Runtime rt(&argc, &argv);
  const int64_t tp_size = 2, dp_size = rt.world_size() / tp_size;
  const auto mesh = fsdp::init_device_mesh("cpu", {dp_size, tp_size}, {"dp", "tp"});
  torch::manual_seed(0);  // every rank builds the same full weights, then keeps its slice
  Lm lm(mesh["tp"]);
  lm->embed->load_full(torch::randn({kVocab, kHidden}) * 0.02);  // a GPT-style init, sliced

  fsdp::FullyShardOptions options;
  options.mesh = mesh;
  options.shard_dim = "dp";  // FSDP's dim; "tp" is carried through
  // Bottom-up, each with the TP layout of its parameters (dtensor_params).
  fsdp::fully_shard(lm->mlp.holder(), fsdp::options_for(*lm->mlp.ptr(), options));
  fsdp::Sharded<Lm> model = fsdp::fully_shard(lm, fsdp::options_for(*lm, options));

  torch::optim::AdamW opt(lm->parameters(), torch::optim::AdamWOptions(1e-2));
  // Data differs across dp and is the same on the ranks of one tp group.
  torch::manual_seed(1 + mesh.get_local_rank("dp"));
  const auto tokens = torch::randint(0, kVocab, {4, kSeq + 1});
  const auto inputs = tokens.narrow(1, 0, kSeq), targets = tokens.narrow(1, 1, kSeq);
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    // The logits are never gathered: the loss reduces max, sum-exp and the
    // target logit over tp.
    auto loss = fsdp::tp::vocab_parallel_cross_entropy(model(inputs), targets, mesh["tp"]);
    loss.backward();
    const double norm = fsdp::clip_grad_norm_(lm->parameters(), /*max_norm=*/1.0);
    opt.step();
    if (rt.world_rank() == 0) {
      std::cout << "step " << step << " loss " << loss.item<float>() << " grad norm " << norm
                << "\n";
    }
  }
  return 0;
}
