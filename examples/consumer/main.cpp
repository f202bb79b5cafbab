// Trains a 2-layer MLP with fully_shard through the installed libfsdp
// package. Run: mpiexec -n 2 ./consumer. Exits 0 when the loss is finite and
// decreased over 3 SGD steps.
#include <fsdp/fully_shard.h>
#include <fsdp/runtime.h>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <cmath>
#include <iostream>

int main(int argc, char** argv) {
  fsdp::Runtime rt(&argc, &argv);
  torch::manual_seed(0);  // same weights and data on every rank
  torch::nn::Sequential mlp(torch::nn::Linear(8, 16), torch::nn::ReLU(),
                            torch::nn::Linear(16, 1));
  fsdp::fully_shard(mlp[0]);  // each Linear ...
  fsdp::fully_shard(mlp[2]);
  auto model = fsdp::fully_shard(mlp);  // ... then the root

  torch::optim::SGD opt(mlp->parameters(), torch::optim::SGDOptions(0.05));
  const auto x = torch::randn({32, 8});
  const auto y = x.sum(1, /*keepdim=*/true).sin();
  float first = 0, last = 0;
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    auto loss = (model(x) - y).pow(2).mean();
    loss.backward();
    opt.step();
    last = loss.item<float>();
    if (step == 0) first = last;
    if (rt.world_rank() == 0) std::cout << "step " << step << " loss " << last << "\n";
  }
  const bool ok = std::isfinite(last) && last < first;
  if (rt.world_rank() == 0) std::cout << (ok ? "consumer: OK" : "consumer: FAILED") << "\n";
  return ok ? 0 : 1;
}
