// Tensor parallelism (fsdp/tensor_parallel.h): the six autograd pairs (value,
// gradient and the exact collectives each way), redistribute_local, the
// column-, row- and vocab-parallel layers, a Column -> Row MLP and the
// vocab-parallel cross-entropy, each forward and backward against a full-tensor
// computation written here in plain ATen (double), at fp32 with tolerance 1e-5.
// Also: tp size 1 equals the plain torch::nn layers exactly, typed errors, and
// the DistributedParams the layers list for fully_shard.
//
// Meshes: a 1-D tp mesh over the world and, at np 4, the "tp" slice of a
// (dp=2, tp=2) mesh whose dp rows use different data (so a row that saw the
// other's collectives would fail its reference).
#include "l1_util.h"
#include "spmd.h"

#include <fsdp/comm.h>
#include <fsdp/dtensor.h>
#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>
#include <fsdp/tensor_parallel.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

namespace {

namespace tp = fsdp::tp;
using fsdp::Placement;
using Shape = std::vector<int64_t>;

constexpr double kTol = 1e-5;

int64_t world() { return spmd::world_size(); }
c10::Device dev() { return spmd::device(); }

struct TpMesh {
  fsdp::DeviceMesh mesh;
  int64_t row;  // dp row: seeds data, so rows differ
  std::string label;
  int64_t size() const { return mesh.size(); }
  int64_t rank() const { return mesh.get_local_rank(0); }
};

std::vector<TpMesh> tp_meshes() {
  std::vector<TpMesh> out;
  out.push_back({fsdp::init_device_mesh(dev().type(), {world()}, {"tp"}), 0,
                 "tp=" + std::to_string(world())});
  if (world() == 4) {
    const fsdp::DeviceMesh m = fsdp::init_device_mesh(dev().type(), {2, 2}, {"dp", "tp"});
    out.push_back({m["tp"], m.get_local_rank("dp"), "(dp=2,tp=2)[tp]"});
  }
  return out;
}

// A tp mesh of size 1 at every world size.
fsdp::DeviceMesh tp_one() {
  return fsdp::init_device_mesh(dev().type(), {world(), 1}, {"dp", "tp"})["tp"];
}

// Identical on every rank that passes the same seed.
at::Tensor randn(const Shape& shape, uint64_t seed, double scale = 1.0) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randn(shape, gen, at::kFloat) * scale;
}

at::Tensor randint(int64_t high, const Shape& shape, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randint(high, shape, gen, at::kLong);
}

// A fresh leaf on the test device.
at::Tensor leaf(const at::Tensor& t) { return t.to(dev()).clone().requires_grad_(true); }
at::Tensor on_dev(const at::Tensor& t) { return t.to(dev()); }
// A double leaf for the reference.
at::Tensor ref_leaf(const at::Tensor& t) {
  return t.to(at::kDouble).clone().requires_grad_(true);
}

// Part `index` of `parts` equal contiguous pieces of `dim`.
at::Tensor piece(const at::Tensor& t, int64_t dim, int64_t parts, int64_t index) {
  const int64_t n = t.size(dim) / parts;
  return t.narrow(dim, index * n, n);
}

// `dim` cut into `blocks` equal blocks, each cut into `parts`: piece `index`
// of every block, concatenated (a fused [q; k; v] sharded by heads).
at::Tensor block_pieces(const at::Tensor& t, int64_t dim, int64_t blocks, int64_t parts,
                        int64_t index) {
  std::vector<at::Tensor> out;
  for (int64_t b = 0; b < blocks; ++b) {
    out.push_back(piece(piece(t, dim, blocks, b), dim, parts, index));
  }
  return at::cat(out, dim);
}

double diff(const at::Tensor& a, const at::Tensor& b) { return l1::diff(a, b); }

// ---- collective counts -----------------------------------------------------

struct Ops {
  int64_t all_gather = 0, reduce_scatter = 0, all_reduce = 0, total = 0;
};

Ops ops_now() {
  const fsdp::CollectiveCounters c = fsdp::collective_counters();
  Ops o;
  o.all_gather = c.total("all_gather");
  o.reduce_scatter = c.total("reduce_scatter");
  o.all_reduce = c.total("all_reduce");
  for (const auto& [key, n] : c.count) o.total += n;
  return o;
}

Ops minus(const Ops& a, const Ops& b) {
  return {a.all_gather - b.all_gather, a.reduce_scatter - b.reduce_scatter,
          a.all_reduce - b.all_reduce, a.total - b.total};
}

void check_ops(const std::string& what, const Ops& got, const Ops& want) {
  BOOST_TEST(got.all_gather == want.all_gather, what << ": all_gather " << got.all_gather
                                                     << ", expected " << want.all_gather);
  BOOST_TEST(got.reduce_scatter == want.reduce_scatter,
             what << ": reduce_scatter " << got.reduce_scatter << ", expected "
                  << want.reduce_scatter);
  BOOST_TEST(got.all_reduce == want.all_reduce, what << ": all_reduce " << got.all_reduce
                                                     << ", expected " << want.all_reduce);
  const int64_t want_total = want.all_gather + want.reduce_scatter + want.all_reduce;
  BOOST_TEST(got.total == want_total,
             what << ": " << got.total << " collectives in all, expected " << want_total);
}

// Runs f(x) forward and y.backward(grad), counting the collectives of each.
struct Run {
  at::Tensor y, x_grad;
  Ops fwd, bwd;
};

Run run_counted(const std::function<at::Tensor(const at::Tensor&)>& f, const at::Tensor& x,
                const at::Tensor& grad) {
  fsdp::reset_collective_counters();
  Run r;
  r.y = f(x);
  r.fwd = ops_now();
  r.y.backward(on_dev(grad));
  r.bwd = minus(ops_now(), r.fwd);
  r.x_grad = x.grad();
  return r;
}

// ---- the autograd pairs ------------------------------------------------------

BOOST_AUTO_TEST_CASE(autograd_pairs) {
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
        rep.check(name + " forward", diff(run.y, y), kTol);
        rep.check(name + " backward", diff(run.x_grad, gx), kTol);
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

BOOST_AUTO_TEST_CASE(redistribute_local_grad_placements) {
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
    rep.check("Shard(0)->Replicate, grad Partial: forward", diff(a.y, X), kTol);
    rep.check("Shard(0)->Replicate, grad Partial: backward", diff(a.x_grad, piece(G_sum, 0, k, r)),
              kTol);
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
    rep.check("Partial->Replicate, grad Partial: forward", diff(b.y, P_sum), kTol);
    rep.check("Partial->Replicate, grad Partial: backward", diff(b.x_grad, G_sum), kTol);
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
    rep.check("[Shard(0),Shard(1)]->[R,R], grad [Partial,R]: forward", diff(c.y, X), kTol);
    rep.check("[Shard(0),Shard(1)]->[R,R], grad [Partial,R]: backward",
              diff(c.x_grad, piece(piece(G_sum, 0, 2, i), 1, 2, j)), kTol);
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

BOOST_AUTO_TEST_CASE(column_parallel_linear) {
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
            rep.check("output", diff(y, gather ? ref.y : cols(ref.y, -1)), kTol);
            rep.check("input grad", diff(x.grad(), sp ? piece(ref.dx, 1, k, r) : ref.dx), kTol);
            rep.check("weight grad", diff(layer->weight.grad(), cols(ref.dw, 0)), kTol);
            if (bias) rep.check("bias grad", diff(layer->bias.grad(), cols(ref.db, 0)), kTol);
            BOOST_TEST(layer->named_parameters().contains("bias") == bias);
            rep.publish();
          }
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(row_parallel_linear) {
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
          rep.check("output", diff(y, seq(ref.y)), kTol);
          rep.check("input grad", diff(x.grad(), parallel_in ? piece(ref.dx, -1, k, r) : ref.dx),
                    kTol);
          rep.check("weight grad", diff(layer->weight.grad(), piece(ref.dw, 1, k, r)), kTol);
          if (bias) {
            // Under SP each rank's bias gradient sums its own sequence slice.
            const at::Tensor db = seq(G).to(at::kDouble).sum(at::IntArrayRef{0, 1});
            rep.check("bias grad", diff(layer->bias.grad(), db), kTol);
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

BOOST_AUTO_TEST_CASE(column_row_mlp) {
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
      rep.check("output", diff(y, seq(yd.detach())), kTol);
      rep.check("input grad", diff(x.grad(), seq(xd.grad())), kTol);
      rep.check("fc1.weight grad", diff(net->fc1->weight.grad(), piece(w1.grad(), 0, k, r)),
                kTol);
      rep.check("fc1.bias grad", diff(net->fc1->bias.grad(), piece(c1.grad(), 0, k, r)), kTol);
      rep.check("fc2.weight grad", diff(net->fc2->weight.grad(), piece(w2.grad(), 1, k, r)),
                kTol);
      const at::Tensor db2 = seq(G).to(at::kDouble).sum(at::IntArrayRef{0, 1});
      rep.check("fc2.bias grad", diff(net->fc2->bias.grad(), db2), kTol);
      rep.publish();
    }
  }
}

BOOST_AUTO_TEST_CASE(vocab_parallel_embedding) {
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
      rep.check("output", diff(y, seq(ref)), kTol);
      rep.check("weight grad", diff(emb->weight.grad(), piece(dw, 0, k, r)), kTol);
      rep.publish();
    }
  }
}

BOOST_AUTO_TEST_CASE(vocab_parallel_cross_entropy) {
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
      rep.check("loss", diff(loss, ref.detach()), kTol);
      rep.check("logits grad", diff(local.grad(), piece(ld.grad(), -1, k, r)), kTol);
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
    rep.check("bf16 loss (bf16 rounding of the result)", diff(loss, ref), 2e-2);
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

// ---- tp size 1 and initialisation ------------------------------------------------

// Bitwise: the same seed gives the plain layer's parameters, outputs and
// gradients.
BOOST_AUTO_TEST_CASE(tp_size_one_equals_plain_layers) {
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
    rep.check(name + " weight", diff(params["weight"], plain->weight), 0);
    rep.check(name + " bias", diff(params["bias"], plain->bias), 0);
    rep.check(name + " output", diff(y, plain(xp)), 0);
    rep.check(name + " input grad", diff(xl.grad(), xp.grad()), 0);
    rep.check(name + " weight grad", diff(params["weight"].grad(), plain->weight.grad()), 0);
    rep.check(name + " bias grad", diff(params["bias"].grad(), plain->bias.grad()), 0);
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
  rep.check("embedding weight", diff(emb->weight, plain->weight), 0);
  rep.check("embedding output", diff(y, plain(ids)), 0);
  rep.check("embedding weight grad", diff(emb->weight.grad(), plain->weight.grad()), 0);
  rep.publish();
}

// At every tp size, the same seed gives this rank's slice of the plain layer.
BOOST_AUTO_TEST_CASE(initialisation_slices_the_plain_layer) {
  for (const TpMesh& m : tp_meshes()) {
    l1::Report rep("TP-init " + m.label);
    const int64_t k = m.size();
    const int64_t r = m.rank();
    at::manual_seed(31);
    torch::nn::Linear plain(6, 6 * k);
    at::manual_seed(31);
    tp::ColumnParallelLinear col(6, 6 * k, m.mesh);
    rep.check("column weight", diff(col->weight, piece(plain->weight, 0, k, r)), 0);
    rep.check("column bias", diff(col->bias, piece(plain->bias, 0, k, r)), 0);
    at::manual_seed(31);
    tp::ColumnParallelOptions fused;
    fused.fused_pieces = 3;
    tp::ColumnParallelLinear qkv(6, 6 * k, m.mesh, fused);
    rep.check("fused column weight", diff(qkv->weight, block_pieces(plain->weight, 0, 3, k, r)),
              0);
    rep.check("fused column bias", diff(qkv->bias, block_pieces(plain->bias, 0, 3, k, r)), 0);

    at::manual_seed(32);
    torch::nn::Linear plain_row(4 * k, 5);
    at::manual_seed(32);
    tp::RowParallelLinear row(4 * k, 5, m.mesh);
    rep.check("row weight", diff(row->weight, piece(plain_row->weight, 1, k, r)), 0);
    rep.check("row bias", diff(row->bias, plain_row->bias), 0);

    at::manual_seed(33);
    torch::nn::Embedding plain_emb(3 * k, 4);
    at::manual_seed(33);
    tp::VocabParallelEmbedding emb(3 * k, 4, m.mesh);
    rep.check("embedding weight", diff(emb->weight, piece(plain_emb->weight, 0, k, r)), 0);
    rep.publish();
  }
}

// ---- typed errors ----------------------------------------------------------------

BOOST_AUTO_TEST_CASE(typed_errors) {
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

BOOST_AUTO_TEST_CASE(distributed_params_of_the_layers) {
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
        rep.check(want[i].name + " full_tensor", diff(d.param.full_tensor(), want[i].full), 0);
      }
      rep.publish();
    }
  }
}

// A fused [q; k; v] layer reports StridedShard(0, 3): its local rows are this
// rank's heads of every block, and the DTensor rebuilds the plain order.
BOOST_AUTO_TEST_CASE(distributed_params_of_a_fused_layer) {
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
      rep.check(names[i] + " full_tensor", diff(d.param.full_tensor(), full[i]), 0);
    }
    rep.publish();
  }
}

// A unit that already manages a layer's parameters takes them out of the list,
// and the rest is what fully_shard of the parent accepts.
BOOST_AUTO_TEST_CASE(dtensor_params_skip_managed_layers) {
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
