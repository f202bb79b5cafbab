// The README's pipeline-parallel example: a small language model cut into 2
// stages (embedding + 2 blocks | 2 blocks + output head), each sharded by
// FSDP over its data-parallel ranks, trained with the 1F1B schedule over 4
// microbatches.
// Run: mpiexec -n 4 ./train_pp (pp = 2 stages, dp = world / 2).
#include <fsdp/fsdp.h>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <iostream>
#include <string>
#include <vector>

constexpr int64_t kVocab = 64, kHidden = 32, kSeq = 8, kBatch = 8;

struct BlockImpl : torch::nn::Module {
  BlockImpl() { fc = register_module("fc", torch::nn::Linear(kHidden, kHidden)); }
  torch::Tensor forward(torch::Tensor x) { return x + torch::gelu(fc(x)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Block);

// One stage: token ids -> activations on the first, activations -> logits on
// the last. A stage takes one tensor and returns one.
struct StageImpl : torch::nn::Module {
  StageImpl(bool first, bool last) {
    if (first) embed = register_module("embed", torch::nn::Embedding(kVocab, kHidden));
    for (int i = 0; i < 2; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), Block()));
    }
    if (last) head = register_module("head", torch::nn::Linear(kHidden, kVocab));
  }
  torch::Tensor forward(torch::Tensor x) {
    if (embed) x = embed(x);
    for (auto& block : blocks) x = block(x);
    return head ? head(x) : x;
  }
  torch::nn::Embedding embed{nullptr};
  std::vector<fsdp::Sharded<Block>> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Stage);

int main(int argc, char** argv) {
  fsdp::Runtime rt(&argc, &argv);
  const int64_t pp_size = 2, dp_size = rt.world_size() / pp_size;
  // pp outermost: the ranks of one stage are adjacent.
  const auto mesh = fsdp::init_device_mesh("cpu", {pp_size, dp_size}, {"pp", "dp"});
  const int stage_index = mesh.get_local_rank("pp");
  torch::manual_seed(stage_index);  // a stage's replicas start equal
  Stage stage(stage_index == 0, stage_index == pp_size - 1);  // embed + blocks | blocks + head

  fsdp::FullyShardOptions options;
  options.mesh = mesh["dp"];
  for (auto& block : stage->blocks) fsdp::fully_shard(block, options);
  fsdp::fully_shard(stage, options);  // one FSDP root per stage

  // The loss convention: `sum` returns a microbatch's summed token losses,
  // `count` its tokens; the schedule divides by the step's count over every
  // microbatch and replica, so gradients are the global mean's.
  fsdp::pp::LossSpec loss;
  loss.sum = [](const torch::Tensor& logits, const torch::Tensor& targets) {
    namespace F = torch::nn::functional;
    return F::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape({-1}),
                            F::CrossEntropyFuncOptions().reduction(torch::kSum));
  };
  loss.count = [](const torch::Tensor& targets) { return targets.numel(); };
  fsdp::pp::ScheduleOptions schedule_options;
  schedule_options.dp_mesh = mesh["dp"];
  fsdp::pp::PipelineStage pp_stage(stage, stage_index, pp_size, mesh["pp"]);
  fsdp::pp::Schedule schedule({pp_stage}, fsdp::pp::ScheduleKind::OneFOneB,
                              /*n_microbatches=*/4, loss, schedule_options);

  torch::optim::AdamW opt(stage->parameters(), torch::optim::AdamWOptions(1e-2));
  // Data differs across dp and is the same on the stages of one pipeline:
  // the first stage reads the inputs, the last the targets.
  torch::manual_seed(1 + mesh.get_local_rank("dp"));
  const auto tokens = torch::randint(0, kVocab, {kBatch, kSeq + 1});
  const auto inputs = tokens.narrow(1, 0, kSeq), targets = tokens.narrow(1, 1, kSeq);
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    const fsdp::pp::StepResult result = schedule.step(inputs, targets);  // forward + backward
    opt.step();
    // The step's mean loss (summed over the microbatches and the replicas)
    // on every rank, and the idle share of the slowest rank's step.
    const double mean = fsdp::pp::broadcast_loss(result, mesh["pp"], pp_size, mesh["dp"]);
    const double bubble = fsdp::pp::bubble_fraction(result, mesh);
    if (rt.world_rank() == 0) {
      std::cout << "step " << step << " loss " << mean << " bubble " << bubble << "\n";
    }
  }
  return 0;
}
