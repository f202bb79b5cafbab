// The README's example: shard a model block by block, then the root,
// checkpoint the blocks' activations, clip the global gradient norm, and
// train with a stock LibTorch optimizer. Run: mpiexec -n 2 ./train_mlp
#include <fsdp/fsdp.h>

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/activation.h>
#include <torch/optim/adamw.h>

#include <iostream>

// A user-written block: its parent holds it as
// fsdp::ActivationCheckpointed<fsdp::Sharded<Block>> (checkpointed when marked, routed
// through its FSDP unit when sharded; either holder just forwards otherwise).
struct BlockImpl : torch::nn::Module {
  BlockImpl() : fc(register_module("fc", torch::nn::Linear(64, 64))) {}
  torch::Tensor forward(torch::Tensor x) { return x + torch::relu(fc(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    for (int i = 0; i < 2; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block()));
    // Children of a Sequential need nothing special.
    head = register_module("head", torch::nn::Sequential(torch::nn::Linear(64, 32),
                                                          torch::nn::ReLU(),
                                                          torch::nn::Linear(32, 1)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : blocks) x = b(x);  // checkpoint + FSDP unit, by the holder
    return head->forward(x);
  }
  std::vector<fsdp::ActivationCheckpointed<fsdp::Sharded<Block>>> blocks;
  torch::nn::Sequential head{nullptr};
};
TORCH_MODULE(Net);

int main(int argc, char** argv) {
  fsdp::Runtime rt(&argc, &argv);
  torch::manual_seed(0);  // identical initial weights on every rank
  Net net;

  fsdp::FullyShardOptions options;  // 1-D mesh over all ranks
  for (auto& b : net->blocks) fsdp::fully_shard(b, options);
  fsdp::fully_shard(net->head[0], options);  // a Sequential child
  fsdp::Sharded<Net> model = fsdp::fully_shard(net, options);  // the root, last
  // Recompute every block's activations in backward instead of keeping them.
  fsdp::apply_activation_checkpointing(
      net.ptr(), fsdp::activation_checkpoint_every_nth(1, [](const torch::nn::Module& m) {
        return dynamic_cast<const BlockImpl*>(&m) != nullptr;
      }));

  // The optimizer steps the local shards directly.
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::manual_seed(1 + rt.world_rank());  // each rank its own data
  const auto x = torch::randn({16, 64});
  const auto y = x.sum(1, /*keepdim=*/true).tanh();
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    auto loss = (model(x) - y).pow(2).mean();
    loss.backward();
    const double norm = fsdp::clip_grad_norm_(net->parameters(), /*max_norm=*/1.0);
    {
      fsdp::trace::Span span("optimizer step", "optim");  // on the FSDP_TRACE timeline
      opt.step();
    }
    if (rt.world_rank() == 0) {
      std::cout << "step " << step << " loss " << loss.item<float>() << " grad norm " << norm
                << "\n";
    }
  }
  return 0;
}
