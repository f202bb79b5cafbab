// Tensor parallelism (fsdp/tensor_parallel.h) [ours]: tp size 1 equals the
// plain torch::nn layers exactly, initialisation slices the plain layer,
// typed errors, and the DistributedParams the layers list for fully_shard.
// Part of the test_tensor_parallel executable (np 1, 2, 4; gpu1, gpu2, gpu4; label tp).
#include "tensor_parallel_util.h"

namespace {

// ---- tp size 1 and initialisation ------------------------------------------------

// Bitwise: the same seed gives the plain layer's parameters, outputs and
// gradients.
BOOST_AUTO_TEST_CASE(tp_size_one_equals_plain_layers) {  // [ours]
  l1::Report rep("TP-size-1");
  const fsdp::DeviceMesh one = tp_one();
  const at::Tensor X = randn({2, 3, 6}, 11);
  const at::Tensor G = randn({2, 3, 4}, 12);

  auto compare_linear = [&](const std::string& name, torch::nn::Module& layer,
                            const std::function<at::Tensor(const at::Tensor&)>& fwd) {
    at::manual_seed(21);
    torch::nn::Linear plain(6, 4);
    plain->to(dev());
    const at::Tensor xp = leaf(X), xl = leaf(X);
    (plain(xp) * on_dev(G)).sum().backward();
    const at::Tensor y = fwd(xl);
    (y * on_dev(G)).sum().backward();
    auto params = layer.named_parameters();
    rep.check(name + " weight", max_abs_diff_or_inf(params["weight"], plain->weight), 0);
    rep.check(name + " bias", max_abs_diff_or_inf(params["bias"], plain->bias), 0);
    rep.check(name + " output", max_abs_diff_or_inf(y, plain(xp)), 0);
    rep.check(name + " input grad", max_abs_diff_or_inf(xl.grad(), xp.grad()), 0);
    rep.check(name + " weight grad",
              max_abs_diff_or_inf(params["weight"].grad(), plain->weight.grad()), 0);
    rep.check(name + " bias grad", max_abs_diff_or_inf(params["bias"].grad(), plain->bias.grad()),
              0);
  };
  at::manual_seed(21);
  tp::ColumnParallelLinear col(6, 4, one);
  col->to(dev());
  compare_linear("column", *col, [&](const at::Tensor& x) { return col(x); });
  at::manual_seed(21);
  tp::RowParallelLinear row(6, 4, one);
  row->to(dev());
  compare_linear("row", *row, [&](const at::Tensor& x) { return row(x); });

  at::manual_seed(22);
  torch::nn::Embedding plain(10, 4);
  plain->to(dev());
  at::manual_seed(22);
  tp::VocabParallelEmbedding emb(10, 4, one);
  emb->to(dev());
  const at::Tensor ids = on_dev(randint(10, {2, 3}, 13));
  (plain(ids) * on_dev(G)).sum().backward();
  const at::Tensor y = emb(ids);
  (y * on_dev(G)).sum().backward();
  rep.check("embedding weight", max_abs_diff_or_inf(emb->weight, plain->weight), 0);
  rep.check("embedding output", max_abs_diff_or_inf(y, plain(ids)), 0);
  rep.check("embedding weight grad", max_abs_diff_or_inf(emb->weight.grad(), plain->weight.grad()),
            0);
  rep.publish();
}

// At every tp size, the same seed gives this rank's slice of the plain layer.
BOOST_AUTO_TEST_CASE(initialisation_slices_the_plain_layer) {  // [ours]
  for (const TpMesh& m : tp_meshes()) {
    l1::Report rep("TP-init " + m.label);
    const int64_t k = m.size();
    const int64_t r = m.rank();
    at::manual_seed(31);
    torch::nn::Linear plain(6, 6 * k);
    at::manual_seed(31);
    tp::ColumnParallelLinear col(6, 6 * k, m.mesh);
    rep.check("column weight", max_abs_diff_or_inf(col->weight, piece(plain->weight, 0, k, r)), 0);
    rep.check("column bias", max_abs_diff_or_inf(col->bias, piece(plain->bias, 0, k, r)), 0);
    at::manual_seed(31);
    tp::ColumnParallelOptions fused;
    fused.fused_pieces = 3;
    tp::ColumnParallelLinear qkv(6, 6 * k, m.mesh, fused);
    rep.check("fused column weight",
              max_abs_diff_or_inf(qkv->weight, block_pieces(plain->weight, 0, 3, k, r)), 0);
    rep.check("fused column bias",
              max_abs_diff_or_inf(qkv->bias, block_pieces(plain->bias, 0, 3, k, r)), 0);

    at::manual_seed(32);
    torch::nn::Linear plain_row(4 * k, 5);
    at::manual_seed(32);
    tp::RowParallelLinear row(4 * k, 5, m.mesh);
    rep.check("row weight", max_abs_diff_or_inf(row->weight, piece(plain_row->weight, 1, k, r)), 0);
    rep.check("row bias", max_abs_diff_or_inf(row->bias, plain_row->bias), 0);

    at::manual_seed(33);
    torch::nn::Embedding plain_emb(3 * k, 4);
    at::manual_seed(33);
    tp::VocabParallelEmbedding emb(3 * k, 4, m.mesh);
    rep.check("embedding weight",
              max_abs_diff_or_inf(emb->weight, piece(plain_emb->weight, 0, k, r)), 0);
    rep.publish();
  }
}

// ---- typed errors ----------------------------------------------------------------

BOOST_AUTO_TEST_CASE(typed_errors) {  // [ours]
  using l1::expect_error;
  const fsdp::DeviceMesh two_d = fsdp::init_device_mesh(dev().type(), {world(), 1}, {"a", "b"});
  const at::Tensor x = on_dev(randn({2, 4}, 41));
  expect_error<fsdp::MeshError>([&] { tp::ColumnParallelLinear(4, 4, two_d); }, "tp",
                                "ColumnParallelLinear on a 2-D mesh");
  expect_error<fsdp::MeshError>([&] { tp::RowParallelLinear(4, 4, two_d); }, "tp",
                                "RowParallelLinear on a 2-D mesh");
  expect_error<fsdp::MeshError>([&] { tp::VocabParallelEmbedding(4, 4, two_d); }, "tp",
                                "VocabParallelEmbedding on a 2-D mesh");
  expect_error<fsdp::MeshError>([&] { tp::copy_to_tp(x, two_d); }, "tp", "copy_to_tp 2-D");
  expect_error<fsdp::MeshError>([&] { tp::sp_all_gather(x, 0, two_d); }, "tp",
                                "sp_all_gather 2-D");
  expect_error<fsdp::MeshError>(
      [&] { tp::vocab_parallel_cross_entropy(x, on_dev(at::zeros({2}, at::kLong)), two_d); },
      "tp", "vocab_parallel_cross_entropy 2-D");

  for (const TpMesh& m : tp_meshes()) {
    const int64_t k = m.size();
    const fsdp::DeviceMesh& t = m.mesh;
    tp::ColumnParallelOptions fused;
    fused.fused_pieces = 3;
    expect_error<fsdp::ShapeError>([&] { tp::ColumnParallelLinear(4, 4 * k, t, fused); },
                                   "out_features", "out_features not a multiple of 3 * tp");
    tp::ColumnParallelLinear col(4, 2 * k, t);
    expect_error<fsdp::ShapeError>([&] { col->load_full(at::zeros({2 * k, 5})); }, "weight",
                                   "column load_full weight of the wrong shape");
    expect_error<fsdp::ShapeError>(
        [&] { col->load_full(at::zeros({2 * k, 4}), at::zeros({2 * k + 1})); }, "bias",
        "column load_full bias of the wrong shape");
    expect_error<fsdp::ShapeError>([&] { col->load_full(at::zeros({2 * k, 4})); }, "bias",
                                   "column load_full without the bias");
    tp::RowParallelLinear row(2 * k, 3, t);
    expect_error<fsdp::ShapeError>([&] { row->load_full(at::zeros({3, 2 * k + 1})); }, "weight",
                                   "row load_full weight of the wrong shape");
    tp::VocabParallelEmbedding emb(2 * k, 3, t);
    expect_error<fsdp::ShapeError>([&] { emb->load_full(at::zeros({2 * k, 4})); }, "weight",
                                   "embedding load_full of the wrong shape");
    emb->to(dev());
    expect_error<fsdp::ArgumentError>(
        [&] { emb(on_dev(at::full({2, 2}, 2 * k, at::kLong))); }, "ids", "ids == V");
    expect_error<fsdp::ArgumentError>(
        [&] { emb(on_dev(at::full({2, 2}, -1, at::kLong))); }, "ids", "ids == -1");
    const at::Tensor logits = on_dev(randn({2, 3, 2}, 42));
    expect_error<fsdp::ShapeError>(
        [&] { tp::vocab_parallel_cross_entropy(logits, on_dev(at::zeros({2}, at::kLong)), t); },
        "target", "target of the wrong shape");
    expect_error<fsdp::ArgumentError>(
        [&] {
          tp::vocab_parallel_cross_entropy(logits, on_dev(at::full({2, 3}, 2 * k, at::kLong)), t);
        },
        "target", "target class out of range");
    if (k == 1) continue;  // every size divides by 1
    expect_error<fsdp::ShapeError>([&] { tp::ColumnParallelLinear(4, 2 * k + 1, t); },
                                   "out_features", "uneven out_features");
    expect_error<fsdp::ShapeError>([&] { tp::RowParallelLinear(2 * k + 1, 4, t); },
                                   "in_features", "uneven in_features");
    expect_error<fsdp::ShapeError>([&] { tp::VocabParallelEmbedding(2 * k + 1, 4, t); },
                                   "num_embeddings", "uneven num_embeddings");
    expect_error<fsdp::ShapeError>([&] { tp::local_size("heads", 2 * k + 1, t); }, "heads",
                                   "local_size of uneven heads");
    BOOST_TEST(tp::local_size("heads", 2 * k, t) == 2);
    const at::Tensor odd = on_dev(randn({2, 2 * k + 1, 4}, 43));
    expect_error<fsdp::ShapeError>([&] { tp::split_to_tp(odd, 1, t); }, "x",
                                   "split_to_tp of an uneven dim");
    expect_error<fsdp::ShapeError>([&] { tp::sp_reduce_scatter(odd, 1, t); }, "x",
                                   "sp_reduce_scatter of an uneven dim");
    tp::RowParallelOptions rsp;
    rsp.sequence_parallel = true;
    tp::RowParallelLinear row_sp(4 * k, 3, t, rsp);
    row_sp->to(dev());
    expect_error<fsdp::ShapeError>(
        [&] { row_sp(on_dev(randn({2, 2 * k + 1, 4}, 44))); }, "x",
        "sequence-parallel row layer on an uneven sequence");
    tp::VocabParallelOptions esp;
    esp.sequence_parallel = true;
    tp::VocabParallelEmbedding emb_sp(2 * k, 3, t, esp);
    emb_sp->to(dev());
    expect_error<fsdp::ShapeError>(
        [&] { emb_sp(on_dev(at::zeros({2, 2 * k + 1}, at::kLong))); }, "ids",
        "sequence-parallel embedding on an uneven sequence");
  }
}

// ---- DistributedParams -------------------------------------------------------------

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t k, const fsdp::DeviceMesh& mesh, bool sp) {
    tp::VocabParallelOptions e;
    e.sequence_parallel = sp;
    tp::ColumnParallelOptions c;
    c.sequence_parallel = sp;
    tp::RowParallelOptions r;
    r.sequence_parallel = sp;
    emb = register_module("emb", tp::VocabParallelEmbedding(3 * k, 4, mesh, e));
    col = register_module("col", tp::ColumnParallelLinear(4, 2 * k, mesh, c));
    row = register_module("row", tp::RowParallelLinear(2 * k, 4, mesh, r));
  }
  at::Tensor forward(const at::Tensor& ids) { return row(at::tanh(col(emb(ids)))); }
  tp::VocabParallelEmbedding emb{nullptr};
  tp::ColumnParallelLinear col{nullptr};
  tp::RowParallelLinear row{nullptr};
};
TORCH_MODULE(Block);

BOOST_AUTO_TEST_CASE(distributed_params_of_the_layers) {  // [ours]
  const Placement R = Placement::Replicate();
  for (const TpMesh& m : tp_meshes()) {
    const int64_t k = m.size();
    for (const bool sp : {false, true}) {
      l1::Report rep("TP-dtensor-params " + m.label + " sp " + std::to_string(sp));
      Block block(k, m.mesh, sp);
      const uint64_t seed = 1100 + 1000 * static_cast<uint64_t>(m.row);
      const at::Tensor E = randn({3 * k, 4}, seed);
      const at::Tensor W1 = randn({2 * k, 4}, seed + 1), b1 = randn({2 * k}, seed + 2);
      const at::Tensor W2 = randn({4, 2 * k}, seed + 3), b2 = randn({4}, seed + 4);
      block->emb->load_full(E);
      block->col->load_full(W1, b1);
      block->row->load_full(W2, b2);
      block->to(dev());

      const std::vector<fsdp::DistributedParam> got = fsdp::dtensor_params(*block);
      struct Want {
        at::Tensor param, full;
        Placement placement;
        std::vector<Placement> grad;
        std::string name;
      };
      const std::vector<Want> want{
          {block->emb->weight, E, Placement::Shard(0), {}, "emb.weight"},
          {block->col->weight, W1, Placement::Shard(0), {}, "col.weight"},
          {block->col->bias, b1, Placement::Shard(0), {}, "col.bias"},
          {block->row->weight, W2, Placement::Shard(1), {}, "row.weight"},
          {block->row->bias, b2, R,
           sp ? std::vector<Placement>{Placement::Partial()} : std::vector<Placement>{},
           "row.bias"}};
      BOOST_TEST_REQUIRE(got.size() == want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        const fsdp::DistributedParam& d = got[i];
        BOOST_TEST(d.param.to_local().is_same(want[i].param), want[i].name << ": not the param");
        BOOST_TEST_REQUIRE(d.param.placements().size() == 1u);
        BOOST_TEST((d.param.placements()[0] == want[i].placement),
                   want[i].name << ": " << d.param.placements()[0].to_string());
        BOOST_TEST((d.grad_placements == want[i].grad), want[i].name << ": grad placements");
        BOOST_TEST((d.param.shape() == want[i].full.sizes().vec()), want[i].name << ": shape");
        rep.check(want[i].name + " full_tensor",
                  max_abs_diff_or_inf(d.param.full_tensor(), want[i].full), 0);
      }
      rep.publish();
    }
  }
}

// A fused [q; k; v] layer reports StridedShard(0, 3): its local rows are this
// rank's heads of every block, and the DTensor rebuilds the plain order.
BOOST_AUTO_TEST_CASE(distributed_params_of_a_fused_layer) {  // [ours]
  for (const TpMesh& m : tp_meshes()) {
    l1::Report rep("TP-dtensor-params fused " + m.label);
    const int64_t k = m.size();
    const uint64_t seed = 1300 + 1000 * static_cast<uint64_t>(m.row);
    const at::Tensor W = randn({6 * k, 4}, seed), b = randn({6 * k}, seed + 1);
    tp::ColumnParallelOptions o;
    o.fused_pieces = 3;
    tp::ColumnParallelLinear qkv(4, 6 * k, m.mesh, o);
    qkv->load_full(W, b);
    qkv->to(dev());
    const std::vector<fsdp::DistributedParam> got = fsdp::dtensor_params(*qkv);
    BOOST_TEST_REQUIRE(got.size() == 2u);
    const at::Tensor full[] = {W, b};
    const at::Tensor params[] = {qkv->weight, qkv->bias};
    const std::string names[] = {"weight", "bias"};
    for (size_t i = 0; i < 2; ++i) {
      const fsdp::DistributedParam& d = got[i];
      BOOST_TEST(d.param.to_local().is_same(params[i]), names[i] << ": not the param");
      BOOST_TEST_REQUIRE(d.param.placements().size() == 1u);
      BOOST_TEST((d.param.placements()[0] == Placement::StridedShard(0, 3)),
                 names[i] << ": " << d.param.placements()[0].to_string());
      BOOST_TEST(d.grad_placements.empty());
      rep.check(names[i] + " full_tensor", max_abs_diff_or_inf(d.param.full_tensor(), full[i]), 0);
    }
    rep.publish();
  }
}

// A unit that already manages a layer's parameters takes them out of the list,
// and the rest is what fully_shard of the parent accepts.
BOOST_AUTO_TEST_CASE(dtensor_params_skip_managed_layers) {  // [ours]
  const fsdp::DeviceMesh mesh = fsdp::init_device_mesh(dev().type(), {1, world()}, {"dp", "tp"});
  Block block(world(), mesh["tp"], /*sp=*/false);
  block->to(dev());
  fsdp::FullyShardOptions opts;
  opts.mesh = mesh["dp"];
  opts.dtensor_params = fsdp::dtensor_params(*block->col);
  fsdp::fully_shard(block->col, opts);
  const std::vector<fsdp::DistributedParam> rest = fsdp::dtensor_params(*block);
  BOOST_TEST_REQUIRE(rest.size() == 3u);
  BOOST_TEST(rest[0].param.to_local().is_same(block->emb->weight));
  BOOST_TEST(rest[1].param.to_local().is_same(block->row->weight));
  BOOST_TEST(rest[2].param.to_local().is_same(block->row->bias));
  opts.dtensor_params = rest;
  BOOST_CHECK_NO_THROW(fsdp::fully_shard(block, opts));
}

}  // namespace
