#include "spmd.h"
#include "toy_models.h"

#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>

BOOST_AUTO_TEST_CASE(smoke_grads_match_single_card) {
  const int ws = spmd::world_size(), rank = spmd::rank();
  toy::Mlp ref(1);
  toy::Mlp model(1);
  fsdp::fully_shard(model->fc1);
  fsdp::fully_shard(model->fc2);
  auto root = fsdp::fully_shard(model);
  auto batch = toy::global_batch(7, 8);
  auto mine = toy::slice(batch, rank, ws);
  fsdp::reset_collective_counters();
  auto loss = toy::mse(root(mine.x), mine.y);
  loss.backward();
  auto c = fsdp::collective_counters();
  BOOST_TEST_MESSAGE("all_gather " << c.total("all_gather") << " reduce_scatter " << c.total("reduce_scatter"));
  auto ref_loss = toy::mse(ref(batch.x), batch.y);
  ref_loss.backward();
  auto w = model->fc1->weight;
  BOOST_TEST(w.sizes()[0] == fsdp::shard_extent(7, ws, rank).length);
  BOOST_TEST(w.grad().defined());
  BOOST_TEST(toy::max_abs_diff(w.grad(), toy::shard_rows(ref->fc1->weight.grad(), ws, rank)) < 1e-6);
  BOOST_TEST(toy::max_abs_diff(model->fc2->weight.grad(), toy::shard_rows(ref->fc2->weight.grad(), ws, rank)) < 1e-6);
  BOOST_TEST(toy::max_abs_diff(model->fc3->weight.grad(), toy::shard_rows(ref->fc3->weight.grad(), ws, rank)) < 1e-6);
}
