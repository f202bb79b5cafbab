// Distributed checkpoint smoke [ours]: FSDP 1-D save, load into plain and
// HSDP/1-D layouts in the same job, bitwise against full_state_dict.
#include "spmd.h"
#include "toy_models.h"

#include <fsdp/distributed_checkpoint.h>
#include <fsdp/mesh.h>
#include <torch/optim/adamw.h>

#include <filesystem>

namespace {

std::string scratch(const std::string& name) {
  std::string dir = "/tmp/dcp-smoke-" + name;
  if (spmd::rank() == 0) std::filesystem::remove_all(dir);
  MPI_Barrier(MPI_COMM_WORLD);
  return dir;
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_dcp_roundtrip_into_plain) {
  const std::string dir = scratch("plain");
  auto mesh = fsdp::init_device_mesh(spmd::device().type(), {spmd::world_size()});
  toy::Mlp net(7);
  fsdp::FullyShardOptions o;
  o.mesh = mesh;
  fsdp::fully_shard(net->fc1.ptr(), o);
  fsdp::fully_shard(net->fc2.ptr(), o);
  auto root = fsdp::fully_shard(net.ptr(), o);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  auto b = toy::global_batch(3, 8);
  auto mine = toy::slice(b, spmd::rank(), spmd::world_size());
  fsdp::Sharded<toy::Mlp> sharded(net);
  auto loss = toy::mse(sharded(mine.x), mine.y);
  loss.backward();
  opt.step();
  std::vector<std::pair<std::string, at::Tensor>> full;
  for (auto& [n, t] : root.full_state_dict()) full.emplace_back(n, t);

  fsdp::dcp::State st;
  st.add_module("model", net.ptr()).add_optimizer("optim", opt, "model").set("step", int64_t{1});
  fsdp::dcp::SaveOptions so;
  so.step = 1;
  auto rep = fsdp::dcp::save(dir, st, so);
  BOOST_TEST(rep.total_bytes > 0);

  toy::Mlp plain(99);  // other values, no sharding
  torch::optim::AdamW opt2(plain->parameters(), torch::optim::AdamWOptions(1e-2));
  fsdp::dcp::State st2;
  st2.add_module("model", plain.ptr()).add_optimizer("optim", opt2, "model").set("step", int64_t{0});
  auto lr = fsdp::dcp::load(dir, st2);
  BOOST_TEST(st2.get_int("step") == 1);
  BOOST_TEST(lr.step == 1);
  auto params = plain->named_parameters();
  for (auto& [n, t] : full) {
    BOOST_TEST_CONTEXT(n) { BOOST_TEST(at::equal(params[n], t)); }
  }
  BOOST_TEST(opt2.state().size() == plain->parameters().size());
  fsdp::dcp::Reader reader(dir);
  BOOST_TEST(reader.verify().empty());
}
