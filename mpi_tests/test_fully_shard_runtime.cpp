// L1: runtime properties of fully_shard that the plan's rows assume --
// gradients equal the single-card ones, steady-state steps reuse the
// unsharded buffers, and one rank issues no collectives at all.
//
// Everything runs on the suite's device (spmd::device(): cuda on the gpu
// entries). Models -- the sharded ones and their single-card references
// alike -- and data are made on the CPU from their seeds, as on the cpu
// entries, and moved there (on_device), so both sides compute with the same
// kernels and only the sharding differs.
//
// No case here offloads (CPUOffloadPolicy): offloaded shards, pinned on
// CUDA, are checked in test_fully_shard_precision.
#include "spmd.h"
#include "tensor_diff.h"
#include "toy_models.h"

#include <fsdp/dtensor.h>
#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/sgd.h>

namespace {

// A module (holder or shared_ptr), a tensor or a batch moved to the suite's
// device.
template <typename M>
M on_device(M module) {
  module->to(spmd::device());
  return module;
}

at::Tensor on_device(const at::Tensor& t) { return t.to(spmd::device()); }

toy::Batch on_device(const toy::Batch& b) { return {on_device(b.x), on_device(b.y)}; }

struct Sharded {
  toy::Mlp model = on_device(toy::Mlp(1));
  fsdp::Sharded<toy::Mlp> root{nullptr};
  Sharded() {
    fsdp::fully_shard(model->fc1);
    fsdp::fully_shard(model->fc2);
    root = fsdp::fully_shard(model);
  }
};

}  // namespace

BOOST_AUTO_TEST_CASE(grads_match_single_card) {  // [ours]
  const int ws = spmd::world_size(), rank = spmd::rank();
  toy::Mlp ref = on_device(toy::Mlp(1));
  Sharded s;
  const auto batch = on_device(toy::global_batch(7, 8));
  const auto mine = toy::slice(batch, rank, ws);
  toy::mse(s.root(mine.x), mine.y).backward();
  toy::mse(ref(batch.x), batch.y).backward();
  const std::vector<std::pair<at::Tensor, at::Tensor>> pairs = {
      {s.model->fc1->weight, ref->fc1->weight}, {s.model->fc1->bias, ref->fc1->bias},
      {s.model->fc2->weight, ref->fc2->weight}, {s.model->fc3->weight, ref->fc3->weight}};
  for (const auto& [mine_p, ref_p] : pairs) {
    BOOST_TEST(mine_p.size(0) == fsdp::shard_extent(ref_p.size(0), ws, rank).length);
    BOOST_TEST_REQUIRE(mine_p.grad().defined());
    BOOST_TEST(testkit::max_abs_diff(mine_p.grad(), toy::shard_rows(ref_p.grad(), ws, rank)) <
               1e-6);
  }
}

BOOST_AUTO_TEST_CASE(steady_state_reuses_unsharded_buffers) {  // [ours]
  Sharded s;
  const auto batch =
      toy::slice(on_device(toy::global_batch(3, 8)), spmd::rank(), spmd::world_size());
  torch::optim::SGD opt(s.model->parameters(), torch::optim::SGDOptions(0.1));
  auto fsdp_fc1 = *fsdp::fsdp_module_of(*s.model->fc1.ptr());
  std::vector<const void*> storages;
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    toy::mse(s.root(batch.x), batch.y).backward();
    opt.step();
    // Unshard by hand to look at the buffer the module computes with.
    fsdp_fc1.unshard();
    storages.push_back(s.model->fc1->weight.storage().unsafeGetStorageImpl());
    fsdp_fc1.reshard();
  }
  // The same StorageImpl every step: freed and regrown in place, never replaced.
  BOOST_TEST(storages[0] == storages[1]);
  BOOST_TEST(storages[1] == storages[2]);
}

BOOST_AUTO_TEST_CASE(world_size_one_issues_no_collectives,  // [ours]
                     *spmd::needs_world_size(1, "runs only on one rank (registered at np 1)")) {
  toy::Mlp ref = on_device(toy::Mlp(1));
  Sharded s;
  const auto batch = on_device(toy::global_batch(7, 8));
  fsdp::reset_collective_counters();
  toy::mse(s.root(batch.x), batch.y).backward();
  BOOST_TEST(fsdp::collective_counters().sequence.empty());
  toy::mse(ref(batch.x), batch.y).backward();
  BOOST_TEST(testkit::max_abs_diff(s.model->fc1->weight.grad(), ref->fc1->weight.grad()) == 0.0);
}

// One rank holds each parameter whole, in its own dtype: the module computes
// on the shard itself (unshard copies nothing, reshard frees nothing) and
// autograd's gradients are installed as they are. The results stay bitwise
// those of plain LibTorch, through accumulation without sync, a divide
// factor and the optimizer's zero_grad (which detaches gradients in place).
BOOST_AUTO_TEST_CASE(world_size_one_computes_on_the_shard_itself,  // [ours]
                     *spmd::needs_world_size(1, "runs only on one rank (registered at np 1)")) {
  toy::Mlp ref = on_device(toy::Mlp(1));
  Sharded s;
  auto root = *fsdp::fsdp_module_of(*s.model);
  auto fc1 = *fsdp::fsdp_module_of(*s.model->fc1.ptr());
  const void* shard = s.model->fc1->weight.storage().unsafeGetStorageImpl();
  const void* shard_data = s.model->fc1->weight.data_ptr();
  fc1.unshard();
  BOOST_TEST(s.model->fc1->weight.storage().unsafeGetStorageImpl() == shard);
  BOOST_TEST(s.model->fc1->weight.data_ptr() == shard_data);
  fc1.reshard();
  BOOST_TEST(s.model->fc1->weight.data_ptr() == shard_data);

  const auto opts = torch::optim::SGDOptions(0.1).momentum(0.9);
  torch::optim::SGD opt(s.model->parameters(), opts), ref_opt(ref->parameters(), opts);
  auto compare = [&](const std::string& when) {
    const auto mine = s.model->parameters(), theirs = ref->parameters();
    BOOST_TEST_REQUIRE(mine.size() == theirs.size());
    for (size_t i = 0; i < mine.size(); ++i) {
      BOOST_TEST_CONTEXT(when << ", parameter " << i) {
        BOOST_TEST(testkit::max_abs_diff(mine[i], theirs[i]) == 0.0);
        BOOST_TEST_REQUIRE(mine[i].grad().defined() == theirs[i].grad().defined());
        if (mine[i].grad().defined()) {
          BOOST_TEST(testkit::max_abs_diff(mine[i].grad(), theirs[i].grad()) == 0.0);
        }
      }
    }
  };
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    ref_opt.zero_grad();
    const auto a = on_device(toy::global_batch(20 + step, 8));
    if (step == 1) {  // two micro-batches, the first without sync
      const auto b = on_device(toy::global_batch(40 + step, 8));
      root.set_requires_gradient_sync(false);
      toy::mse(s.root(b.x), b.y).backward();
      root.set_requires_gradient_sync(true);
      toy::mse(ref(b.x), b.y).backward();
    }
    // A power of two: dividing by it is exact, as the reference's scaling.
    const double divide = step == 2 ? 4.0 : 1.0;
    root.set_gradient_divide_factor(step == 2 ? std::optional<double>(divide) : std::nullopt);
    toy::mse(s.root(a.x), a.y).backward();
    (toy::mse(ref(a.x), a.y) / divide).backward();
    compare("step " + std::to_string(step) + " gradients");
    opt.step();
    ref_opt.step();
    compare("step " + std::to_string(step) + " after the optimizer");
  }
}

namespace {

// Embedding tied to the output layer, as in a language model.
struct TiedLmImpl : torch::nn::Module {
  TiedLmImpl() {
    at::manual_seed(5);
    embed = register_parameter("embed", at::randn({9, 4}) * 0.1);
    mid = register_module("mid", torch::nn::Linear(4, 4));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor h = at::tanh(mid(embed.index_select(0, tokens)));
    return at::matmul(h, embed.t());  // logits over the 9 "tokens"
  }
  at::Tensor embed;
  fsdp::Sharded<torch::nn::Linear> mid{nullptr};
};
TORCH_MODULE(TiedLm);

}  // namespace

BOOST_AUTO_TEST_CASE(tied_weights_live_in_one_unit) {  // [ours]
  const int ws = spmd::world_size(), rank = spmd::rank();
  TiedLm ref = on_device(TiedLm()), model = on_device(TiedLm());
  fsdp::fully_shard(model->mid);
  auto root = fsdp::fully_shard(model);
  const auto tokens = on_device(at::arange(8, at::kLong) % 9);
  const auto targets = on_device((at::arange(8, at::kLong) * 5 + 1) % 9);
  const int64_t per = 8 / ws;
  const auto my_tokens = tokens.narrow(0, rank * per, per);
  const auto my_targets = targets.narrow(0, rank * per, per);
  at::nll_loss(at::log_softmax(root(my_tokens), 1), my_targets).backward();
  at::nll_loss(at::log_softmax(ref(tokens), 1), targets).backward();
  // The tied weight gets both uses' gradient, sharded once.
  BOOST_TEST(testkit::max_abs_diff(model->embed.grad(),
                                   toy::shard_rows(ref->embed.grad(), ws, rank)) < 1e-6);
}

BOOST_AUTO_TEST_CASE(weights_tied_across_units_are_rejected) {  // [ours]
  // The root shares mid's weight: it would read it while mid's unit has it
  // resharded.
  struct CrossTied : torch::nn::Module {
    CrossTied() {
      mid = register_module("mid", torch::nn::Linear(4, 4));
      proj = register_parameter("proj", mid->weight);
    }
    fsdp::Sharded<torch::nn::Linear> mid{nullptr};
    at::Tensor proj;
  };
  auto model = on_device(std::make_shared<CrossTied>());
  fsdp::fully_shard(model->mid);
  BOOST_CHECK_EXCEPTION(fsdp::fully_shard(model), fsdp::ArgumentError,
                        [](const fsdp::ArgumentError& e) {
                          return e.argument() == "module" &&
                                 std::string(e.what()).find("tied") != std::string::npos;
                        });
}

BOOST_AUTO_TEST_CASE(root_without_own_parameters) {  // [ours]
  // Every parameter lives in a nested unit: the root still runs the root
  // logic and the step matches single card.
  const int ws = spmd::world_size(), rank = spmd::rank();
  at::manual_seed(11);
  torch::nn::Sequential ref(torch::nn::Linear(6, 4), torch::nn::Tanh(), torch::nn::Linear(4, 2));
  at::manual_seed(11);
  torch::nn::Sequential model(torch::nn::Linear(6, 4), torch::nn::Tanh(), torch::nn::Linear(4, 2));
  on_device(ref);
  on_device(model);
  fsdp::fully_shard(model[0]);
  fsdp::fully_shard(model[2]);
  auto root = fsdp::fully_shard(model.ptr());
  BOOST_TEST(root.is_root());
  at::manual_seed(12);
  const auto x = on_device(at::randn({4 * ws, 6}));
  const auto mine = x.narrow(0, rank * 4, 4);
  model->forward(mine).pow(2).mean().backward();
  ref->forward(x).pow(2).mean().backward();
  // After sharding, the Sequential's entries route through the units; its
  // registered children are still the user's modules.
  auto* fc0 = model->children()[0]->as<torch::nn::Linear>();
  auto* ref0 = ref[0]->as<torch::nn::Linear>();
  BOOST_TEST_REQUIRE(fc0 != nullptr);
  BOOST_TEST(testkit::max_abs_diff(fc0->weight.grad(),
                                   toy::shard_rows(ref0->weight.grad(), ws, rank)) < 1e-6);
}

BOOST_AUTO_TEST_CASE(state_dict_round_trips) {  // [ours]
  const int ws = spmd::world_size(), rank = spmd::rank();
  toy::Mlp ref = on_device(toy::Mlp(1));
  Sharded s;
  auto unit = *fsdp::fsdp_module_of(*s.model->fc1.ptr());
  const at::Tensor full_w = ref->fc1->weight.detach();

  // Sharded form: DTensors with the full shape and this rank's rows.
  auto sd = unit.state_dict();
  BOOST_TEST_REQUIRE(sd.size() == 2u);
  BOOST_TEST(sd[0].first == "weight");
  BOOST_TEST(sd[0].second.shape() == full_w.sizes().vec(), boost::test_tools::per_element());
  BOOST_TEST(at::equal(sd[0].second.to_local(), toy::shard_rows(full_w, ws, rank)));
  // Full form: the single-card values on every rank.
  auto full = unit.full_state_dict();
  BOOST_TEST(at::equal(full[0].second, full_w));

  // Load a global-shape tensor, a local-shape tensor and a DTensor in turn.
  const at::Tensor target = at::arange(full_w.numel(), full_w.options()).view(full_w.sizes());
  unit.load_state_dict(std::vector<std::pair<std::string, at::Tensor>>{{"weight", target}});
  BOOST_TEST(at::equal(s.model->fc1->weight.detach(), toy::shard_rows(target, ws, rank)));
  const at::Tensor local = toy::shard_rows(target, ws, rank) * 2;
  unit.load_state_dict(std::vector<std::pair<std::string, at::Tensor>>{{"weight", local}});
  BOOST_TEST(at::equal(s.model->fc1->weight.detach(), local));
  const auto dt = fsdp::distribute_tensor(target, unit.mesh(), {fsdp::Placement::Shard(0)});
  unit.load_state_dict(std::vector<std::pair<std::string, fsdp::DTensor>>{{"weight", dt}});
  BOOST_TEST(at::equal(s.model->fc1->weight.detach(), toy::shard_rows(target, ws, rank)));
  // The next forward gathers what was loaded.
  unit.unshard();
  BOOST_TEST(at::equal(s.model->fc1->weight.detach(), target));
  unit.reshard();

  // Bad entries: unknown name, wrong shape.
  BOOST_CHECK_EXCEPTION(
      unit.load_state_dict(std::vector<std::pair<std::string, at::Tensor>>{{"nope", target}}),
      fsdp::ArgumentError, [](const fsdp::ArgumentError& e) { return e.argument() == "state"; });
  BOOST_CHECK_EXCEPTION(
      unit.load_state_dict(
          std::vector<std::pair<std::string, at::Tensor>>{
              {"weight", at::zeros({2, 2}, full_w.options())}}),
      fsdp::ShapeError, [](const fsdp::ShapeError& e) { return e.argument() == "state"; });
}
