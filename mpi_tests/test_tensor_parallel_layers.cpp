// Tensor parallelism (fsdp/tensor_parallel.h) [ours]: the six autograd pairs
// (value, gradient and the exact collectives each way), redistribute_local,
// the column-, row- and vocab-parallel layers, a Column -> Row MLP and the
// vocab-parallel cross-entropy, each forward and backward against a
// full-tensor computation written here in plain ATen (double), at fp32 with
// tolerance 1e-5. Part of the test_tensor_parallel executable (np 1, 2, 4; gpu1, gpu2, gpu4; label
// tp).
//
// Meshes: a 1-D tp mesh over the world and, at np 4, the "tp" slice of a
// (dp=2, tp=2) mesh whose dp rows use different data (so a row that saw the
// other's collectives would fail its reference).
#include "tensor_parallel_util.h"

namespace {

// ---- the autograd pairs ------------------------------------------------------

BOOST_AUTO_TEST_CASE(autograd_pairs) {  // [ours]
  for (const TpMesh& m : tp_meshes()) {
    const int64_t k = m.size();
    const int64_t r = m.rank();
    const bool comm = k > 1;
    for (const int64_t dim : {int64_t{1}, int64_t{-1}}) {
      l1::Report rep("TP-pairs " + m.label + " dim " + std::to_string(dim));
      Shape full{2, 3, 5};
      full[static_cast<size_t>(dim < 0 ? dim + 3 : dim)] = 2 * k;
      const uint64_t seed = 100 + 1000 * static_cast<uint64_t>(m.row);
      const at::Tensor X = randn(full, seed);
      const at::Tensor G = randn(full, seed + 1);
      // Per-rank values (partial sums, per-rank gradients) and their sum.
      auto per_rank = [&](uint64_t base, int64_t j) {
        return randn(full, seed + base + static_cast<uint64_t>(j));
      };
      auto sum_over_ranks = [&](uint64_t base) {
        at::Tensor s = at::zeros(full, at::kDouble);
        for (int64_t j = 0; j < k; ++j) s += per_rank(base, j).to(at::kDouble);
        return s;
      };
      const at::Tensor P = per_rank(20, r);
      const at::Tensor Gr = per_rank(40, r);
      auto slice = [&](const at::Tensor& t) { return piece(t, dim, k, r); };
      auto check = [&](const std::string& name, const Run& run, const at::Tensor& y,
                       const at::Tensor& gx, const Ops& fwd, const Ops& bwd) {
        rep.check(name + " forward", max_abs_diff_or_inf(run.y, y), kTol);
        rep.check(name + " backward", max_abs_diff_or_inf(run.x_grad, gx), kTol);
        check_ops(m.label + " " + name + " forward", run.fwd, comm ? fwd : Ops{});
        check_ops(m.label + " " + name + " backward", run.bwd, comm ? bwd : Ops{});
      };
      const Ops none{};
      const Ops ag{1, 0, 0, 1}, rs{0, 1, 0, 1}, ar{0, 0, 1, 1};

      check("copy_to_tp",
            run_counted([&](const at::Tensor& x) { return tp::copy_to_tp(x, m.mesh); }, leaf(X),
                        Gr),
            X, sum_over_ranks(40), none, ar);
      check("reduce_from_tp",
            run_counted([&](const at::Tensor& x) { return tp::reduce_from_tp(x, m.mesh); },
                        leaf(P), G),
            sum_over_ranks(20), G, ar, none);
      check("gather_from_tp",
            run_counted(
                [&](const at::Tensor& x) { return tp::gather_from_tp(x, dim, m.mesh); },
                leaf(slice(X)), G),
            X, slice(G), ag, none);
      check("split_to_tp",
            run_counted([&](const at::Tensor& x) { return tp::split_to_tp(x, dim, m.mesh); },
                        leaf(X), slice(G)),
            slice(X), G, none, ag);
      check("sp_all_gather",
            run_counted([&](const at::Tensor& x) { return tp::sp_all_gather(x, dim, m.mesh); },
                        leaf(slice(X)), Gr),
            X, slice(sum_over_ranks(40)), ag, rs);
      check("sp_reduce_scatter",
            run_counted(
                [&](const at::Tensor& x) { return tp::sp_reduce_scatter(x, dim, m.mesh); },
                leaf(P), slice(G)),
            slice(sum_over_ranks(20)), G, rs, ag);
      rep.publish();
    }
  }
}

BOOST_AUTO_TEST_CASE(redistribute_local_grad_placements) {  // [ours]
  const Placement R = Placement::Replicate();
  const Placement P = Placement::Partial();
  for (const TpMesh& m : tp_meshes()) {
    l1::Report rep("TP-redistribute " + m.label);
    const int64_t k = m.size();
    const int64_t r = m.rank();
    const uint64_t seed = 300 + 1000 * static_cast<uint64_t>(m.row);
    const Shape full{2 * k, 3};
    const at::Tensor X = randn(full, seed);
    at::Tensor G_sum = at::zeros(full, at::kDouble);
    for (int64_t j = 0; j < k; ++j) G_sum += randn(full, seed + 10 + j).to(at::kDouble);
    const at::Tensor Gr = randn(full, seed + 10 + static_cast<uint64_t>(r));

    // Shard(0) -> Replicate, gradient Partial: backward reduce-scatters.
    Run a = run_counted(
        [&](const at::Tensor& x) {
          return fsdp::redistribute_local(x, m.mesh, {Placement::Shard(0)}, {R}, full,
                                          std::vector<Placement>{P});
        },
        leaf(piece(X, 0, k, r)), Gr);
    rep.check("Shard(0)->Replicate, grad Partial: forward", max_abs_diff_or_inf(a.y, X), kTol);
    rep.check("Shard(0)->Replicate, grad Partial: backward",
              max_abs_diff_or_inf(a.x_grad, piece(G_sum, 0, k, r)), kTol);
    check_ops(m.label + " Shard->Replicate backward", a.bwd, k > 1 ? Ops{0, 1, 0, 1} : Ops{});

    // Partial -> Replicate, gradient Partial: an all-reduce each way.
    const at::Tensor Pr = randn(full, seed + 20 + static_cast<uint64_t>(r));
    at::Tensor P_sum = at::zeros(full, at::kDouble);
    for (int64_t j = 0; j < k; ++j) P_sum += randn(full, seed + 20 + j).to(at::kDouble);
    Run b = run_counted(
        [&](const at::Tensor& x) {
          return fsdp::redistribute_local(x, m.mesh, {P}, {R}, full, std::vector<Placement>{P});
        },
        leaf(Pr), Gr);
    rep.check("Partial->Replicate, grad Partial: forward", max_abs_diff_or_inf(b.y, P_sum), kTol);
    rep.check("Partial->Replicate, grad Partial: backward", max_abs_diff_or_inf(b.x_grad, G_sum),
              kTol);
    check_ops(m.label + " Partial->Replicate forward", b.fwd, k > 1 ? Ops{0, 0, 1, 1} : Ops{});
    check_ops(m.label + " Partial->Replicate backward", b.bwd, k > 1 ? Ops{0, 0, 1, 1} : Ops{});
    rep.publish();
  }
  if (world() == 4) {
    // Two mesh dims at once: [Shard(0), Shard(1)] -> replicated, with a
    // gradient that is partial over dim 0 only (it depends on that coordinate).
    l1::Report rep("TP-redistribute (2,2)");
    const fsdp::DeviceMesh m = fsdp::init_device_mesh(dev().type(), {2, 2}, {"a", "b"});
    const int64_t i = m.get_local_rank(0);
    const int64_t j = m.get_local_rank(1);
    const Shape full{4, 6};
    const at::Tensor X = randn(full, 400);
    const at::Tensor Gi = randn(full, 410 + static_cast<uint64_t>(i));
    const at::Tensor G_sum = randn(full, 410).to(at::kDouble) + randn(full, 411).to(at::kDouble);
    Run c = run_counted(
        [&](const at::Tensor& x) {
          return fsdp::redistribute_local(x, m, {Placement::Shard(0), Placement::Shard(1)},
                                          {Placement::Replicate(), Placement::Replicate()},
                                          full, std::vector<Placement>{P, R});
        },
        leaf(piece(piece(X, 0, 2, i), 1, 2, j)), Gi);
    rep.check("[Shard(0),Shard(1)]->[R,R], grad [Partial,R]: forward", max_abs_diff_or_inf(c.y, X),
              kTol);
    rep.check("[Shard(0),Shard(1)]->[R,R], grad [Partial,R]: backward",
              max_abs_diff_or_inf(c.x_grad, piece(piece(G_sum, 0, 2, i), 1, 2, j)), kTol);
    rep.publish();
  }
  const fsdp::DeviceMesh m1 = fsdp::init_device_mesh(dev().type(), {world()}, {"tp"});
  const at::Tensor x = leaf(randn({2, 3}, 7));
  l1::expect_error<fsdp::ArgumentError>(
      [&] {
        fsdp::redistribute_local(x, m1, {Placement::Replicate()}, {Placement::Replicate()},
                                 {2, 3}, std::vector<Placement>{});
      },
      "grad_placements", "redistribute_local with no grad_placements");
}

// ---- layers ---------------------------------------------------------------------

// Reference linear layer in double: y = x W^T + b and the gradients of
// sum(y * G).
struct LinearRef {
  at::Tensor y, dx, dw, db;
};

LinearRef linear_ref(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                     const at::Tensor& g) {
  at::Tensor xd = ref_leaf(x), wd = ref_leaf(w);
  at::Tensor bd = b.defined() ? ref_leaf(b) : at::Tensor();
  at::Tensor y = at::matmul(xd, wd.t());
  if (bd.defined()) y = y + bd;
  (y * g.to(at::kDouble)).sum().backward();
  return {y.detach(), xd.grad(), wd.grad(), bd.defined() ? bd.grad() : at::Tensor()};
}

BOOST_AUTO_TEST_CASE(column_parallel_linear) {  // [ours]
  for (const TpMesh& m : tp_meshes()) {
    const int64_t k = m.size();
    const int64_t r = m.rank();
    const int64_t in = 6, B = 2, S = 2 * k;
    for (const int64_t pieces : {int64_t{1}, int64_t{3}}) {
      for (const bool gather : {false, true}) {
        for (const bool sp : {false, true}) {
          for (const bool bias : {true, false}) {
            if (pieces > 1 && (sp || !bias)) continue;  // fused: slicing is the point
            const int64_t out = pieces * 2 * k;
            const std::string label = m.label + " gather " + std::to_string(gather) + " sp " +
                                      std::to_string(sp) + " bias " + std::to_string(bias) +
                                      " pieces " + std::to_string(pieces);
            l1::Report rep("TP-column " + label);
            const uint64_t seed = 500 + 1000 * static_cast<uint64_t>(m.row);
            const at::Tensor X = randn({B, S, in}, seed);
            const at::Tensor W = randn({out, in}, seed + 1, 0.5);
            const at::Tensor b = bias ? randn({out}, seed + 2) : at::Tensor();
            const at::Tensor G = randn({B, S, out}, seed + 3);
            const LinearRef ref = linear_ref(X, W, b, G);

            tp::ColumnParallelOptions o;
            o.bias = bias;
            o.gather_output = gather;
            o.sequence_parallel = sp;
            o.fused_pieces = pieces;
            tp::ColumnParallelLinear layer(in, out, m.mesh, o);
            layer->load_full(W, b);
            layer->to(dev());
            auto cols = [&](const at::Tensor& t, int64_t dim) {
              return block_pieces(t, dim, pieces, k, r);
            };
            const at::Tensor x = leaf(sp ? piece(X, 1, k, r) : X);
            const at::Tensor y = layer(x);
            (y * on_dev(gather ? G : cols(G, -1))).sum().backward();
            rep.check("output", max_abs_diff_or_inf(y, gather ? ref.y : cols(ref.y, -1)), kTol);
            rep.check("input grad",
                      max_abs_diff_or_inf(x.grad(), sp ? piece(ref.dx, 1, k, r) : ref.dx), kTol);
            rep.check("weight grad", max_abs_diff_or_inf(layer->weight.grad(), cols(ref.dw, 0)),
                      kTol);
            if (bias)
              rep.check("bias grad", max_abs_diff_or_inf(layer->bias.grad(), cols(ref.db, 0)),
                        kTol);
            BOOST_TEST(layer->named_parameters().contains("bias") == bias);
            rep.publish();
          }
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(row_parallel_linear) {  // [ours]
  for (const TpMesh& m : tp_meshes()) {
    const int64_t k = m.size();
    const int64_t r = m.rank();
    const int64_t in = 4 * k, out = 5, B = 2, S = 2 * k;
    for (const bool parallel_in : {true, false}) {
      for (const bool sp : {false, true}) {
        for (const bool bias : {true, false}) {
          if (!bias && !parallel_in) continue;
          const std::string label = m.label + " input_is_parallel " +
                                    std::to_string(parallel_in) + " sp " + std::to_string(sp) +
                                    " bias " + std::to_string(bias);
          l1::Report rep("TP-row " + label);
          const uint64_t seed = 600 + 1000 * static_cast<uint64_t>(m.row);
          const at::Tensor X = randn({B, S, in}, seed);
          const at::Tensor W = randn({out, in}, seed + 1, 0.5);
          const at::Tensor b = bias ? randn({out}, seed + 2) : at::Tensor();
          const at::Tensor G = randn({B, S, out}, seed + 3);
          const LinearRef ref = linear_ref(X, W, b, G);

          tp::RowParallelOptions o;
          o.bias = bias;
          o.input_is_parallel = parallel_in;
          o.sequence_parallel = sp;
          tp::RowParallelLinear layer(in, out, m.mesh, o);
          layer->load_full(W, b);
          layer->to(dev());
          auto seq = [&](const at::Tensor& t) { return sp ? piece(t, 1, k, r) : t; };
          const at::Tensor x = leaf(parallel_in ? piece(X, -1, k, r) : X);
          const at::Tensor y = layer(x);
          (y * on_dev(seq(G))).sum().backward();
          rep.check("output", max_abs_diff_or_inf(y, seq(ref.y)), kTol);
          rep.check("input grad",
                    max_abs_diff_or_inf(x.grad(), parallel_in ? piece(ref.dx, -1, k, r) : ref.dx),
                    kTol);
          rep.check("weight grad",
                    max_abs_diff_or_inf(layer->weight.grad(), piece(ref.dw, 1, k, r)), kTol);
          if (bias) {
            // Under SP each rank's bias gradient sums its own sequence slice.
            const at::Tensor db = seq(G).to(at::kDouble).sum(at::IntArrayRef{0, 1});
            rep.check("bias grad", max_abs_diff_or_inf(layer->bias.grad(), db), kTol);
          }
          rep.publish();
        }
      }
    }
  }
}

// Column (in -> hidden) -> tanh -> Row (hidden -> out), against the full MLP.
struct TpMlpImpl : torch::nn::Module {
  TpMlpImpl(int64_t in, int64_t hidden, int64_t out, const fsdp::DeviceMesh& mesh, bool sp) {
    tp::ColumnParallelOptions c;
    c.sequence_parallel = sp;
    tp::RowParallelOptions r;
    r.sequence_parallel = sp;
    fc1 = register_module("fc1", tp::ColumnParallelLinear(in, hidden, mesh, c));
    fc2 = register_module("fc2", tp::RowParallelLinear(hidden, out, mesh, r));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(at::tanh(fc1(x))); }
  tp::ColumnParallelLinear fc1{nullptr};
  tp::RowParallelLinear fc2{nullptr};
};
TORCH_MODULE(TpMlp);

BOOST_AUTO_TEST_CASE(column_row_mlp) {  // [ours]
  for (const TpMesh& m : tp_meshes()) {
    const int64_t k = m.size();
    const int64_t r = m.rank();
    const int64_t in = 6, hidden = 4 * k, out = 5, B = 2, S = 2 * k;
    for (const bool sp : {false, true}) {
      l1::Report rep("TP-mlp " + m.label + " sp " + std::to_string(sp));
      const uint64_t seed = 700 + 1000 * static_cast<uint64_t>(m.row);
      const at::Tensor X = randn({B, S, in}, seed);
      const at::Tensor W1 = randn({hidden, in}, seed + 1, 0.5), b1 = randn({hidden}, seed + 2);
      const at::Tensor W2 = randn({out, hidden}, seed + 3, 0.5), b2 = randn({out}, seed + 4);
      const at::Tensor G = randn({B, S, out}, seed + 5);
      at::Tensor xd = ref_leaf(X), w1 = ref_leaf(W1), c1 = ref_leaf(b1), w2 = ref_leaf(W2),
                 c2 = ref_leaf(b2);
      const at::Tensor yd = at::matmul(at::tanh(at::matmul(xd, w1.t()) + c1), w2.t()) + c2;
      (yd * G.to(at::kDouble)).sum().backward();

      TpMlp net(in, hidden, out, m.mesh, sp);
      net->fc1->load_full(W1, b1);
      net->fc2->load_full(W2, b2);
      net->to(dev());
      auto seq = [&](const at::Tensor& t) { return sp ? piece(t, 1, k, r) : t; };
      const at::Tensor x = leaf(seq(X));
      const at::Tensor y = net(x);
      (y * on_dev(seq(G))).sum().backward();
      rep.check("output", max_abs_diff_or_inf(y, seq(yd.detach())), kTol);
      rep.check("input grad", max_abs_diff_or_inf(x.grad(), seq(xd.grad())), kTol);
      rep.check("fc1.weight grad",
                max_abs_diff_or_inf(net->fc1->weight.grad(), piece(w1.grad(), 0, k, r)), kTol);
      rep.check("fc1.bias grad",
                max_abs_diff_or_inf(net->fc1->bias.grad(), piece(c1.grad(), 0, k, r)), kTol);
      rep.check("fc2.weight grad",
                max_abs_diff_or_inf(net->fc2->weight.grad(), piece(w2.grad(), 1, k, r)), kTol);
      const at::Tensor db2 = seq(G).to(at::kDouble).sum(at::IntArrayRef{0, 1});
      rep.check("fc2.bias grad", max_abs_diff_or_inf(net->fc2->bias.grad(), db2), kTol);
      rep.publish();
    }
  }
}

BOOST_AUTO_TEST_CASE(vocab_parallel_embedding) {  // [ours]
  for (const TpMesh& m : tp_meshes()) {
    const int64_t k = m.size();
    const int64_t r = m.rank();
    const int64_t V = 5 * k, D = 3, B = 2, S = 2 * k;
    for (const bool sp : {false, true}) {
      l1::Report rep("TP-embedding " + m.label + " sp " + std::to_string(sp));
      const uint64_t seed = 800 + 1000 * static_cast<uint64_t>(m.row);
      const at::Tensor ids = randint(V, {B, S}, seed);
      const at::Tensor W = randn({V, D}, seed + 1);
      const at::Tensor G = randn({B, S, D}, seed + 2);
      const at::Tensor ref = W.to(at::kDouble).index_select(0, ids.reshape(-1)).reshape({B, S, D});
      const at::Tensor dw = at::zeros({V, D}, at::kDouble)
                                .index_add_(0, ids.reshape(-1), G.to(at::kDouble).reshape({-1, D}));

      tp::VocabParallelOptions o;
      o.sequence_parallel = sp;
      tp::VocabParallelEmbedding emb(V, D, m.mesh, o);
      emb->load_full(W);
      emb->to(dev());
      BOOST_TEST(emb->vocab_start() == r * V / k);
      auto seq = [&](const at::Tensor& t) { return sp ? piece(t, 1, k, r) : t; };
      const at::Tensor y = emb(on_dev(ids));
      (y * on_dev(seq(G))).sum().backward();
      rep.check("output", max_abs_diff_or_inf(y, seq(ref)), kTol);
      rep.check("weight grad", max_abs_diff_or_inf(emb->weight.grad(), piece(dw, 0, k, r)), kTol);
      rep.publish();
    }
  }
}

BOOST_AUTO_TEST_CASE(vocab_parallel_cross_entropy) {  // [ours]
  for (const TpMesh& m : tp_meshes()) {
    const int64_t k = m.size();
    const int64_t r = m.rank();
    const int64_t B = 2, S = 3, V = 4 * k;
    const uint64_t seed = 900 + 1000 * static_cast<uint64_t>(m.row);
    const at::Tensor logits = randn({B, S, V}, seed, 3.0);
    struct Variant {
      at::Reduction::Reduction reduction;
      int64_t ignore_index;
      std::string name;
    };
    const std::vector<Variant> variants{{at::Reduction::Mean, -100, "mean"},
                                        {at::Reduction::Sum, -100, "sum"},
                                        {at::Reduction::None, -100, "none"},
                                        {at::Reduction::Mean, 1, "mean, ignore_index 1"}};
    for (const Variant& v : variants) {
      l1::Report rep("TP-cross-entropy " + m.label + " " + v.name);
      at::Tensor target = randint(V, {B, S}, seed + 1);
      target.select(0, 0).select(0, 1).fill_(v.ignore_index);
      target.select(0, 1).select(0, 2).fill_(v.ignore_index);
      const at::Tensor grad = v.reduction == at::Reduction::None ? randn({B, S}, seed + 2)
                                                                 : at::full({}, 0.75);
      at::Tensor ld = ref_leaf(logits);
      at::Tensor ref = at::cross_entropy_loss(ld.reshape({-1, V}), target.reshape(-1), {},
                                              v.reduction, v.ignore_index);
      if (v.reduction == at::Reduction::None) ref = ref.reshape({B, S});
      ref.backward(grad.to(at::kDouble));

      const at::Tensor local = leaf(piece(logits, -1, k, r));
      const at::Tensor loss =
          tp::vocab_parallel_cross_entropy(local, on_dev(target), m.mesh, v.ignore_index,
                                           v.reduction);
      loss.backward(on_dev(grad));
      rep.check("loss", max_abs_diff_or_inf(loss, ref.detach()), kTol);
      rep.check("logits grad", max_abs_diff_or_inf(local.grad(), piece(ld.grad(), -1, k, r)), kTol);
      BOOST_TEST((loss.scalar_type() == at::kFloat));
      rep.publish();
    }

    // The loss comes back in the logits' dtype (the math runs in fp32).
    l1::Report rep("TP-cross-entropy " + m.label + " bf16");
    const at::Tensor target = randint(V, {B, S}, seed + 1);
    const at::Tensor ref =
        at::cross_entropy_loss(logits.to(at::kBFloat16).to(at::kDouble).reshape({-1, V}),
                               target.reshape(-1), {}, at::Reduction::Mean, -100);
    const at::Tensor local = leaf(piece(logits, -1, k, r).to(at::kBFloat16));
    const at::Tensor loss = tp::vocab_parallel_cross_entropy(local, on_dev(target), m.mesh);
    loss.backward();
    BOOST_TEST((loss.scalar_type() == at::kBFloat16));
    BOOST_TEST((local.grad().scalar_type() == at::kBFloat16));
    rep.check("bf16 loss (bf16 rounding of the result)", max_abs_diff_or_inf(loss, ref), 2e-2);
    rep.publish();

    // No target counts: Mean is NaN (as at::cross_entropy) and nothing flows back.
    const at::Tensor none = at::full({B, S}, -100, at::kLong);
    const at::Tensor local2 = leaf(piece(logits, -1, k, r));
    const at::Tensor nan = tp::vocab_parallel_cross_entropy(local2, on_dev(none), m.mesh);
    nan.backward();
    BOOST_TEST(std::isnan(nan.item<double>()));
    BOOST_TEST(local2.grad().abs().max().item<double>() == 0.0);
  }
}

}  // namespace
