// Mixture of experts and expert parallelism (fsdp/moe.h), unit by unit,
// against computations written here and against models::PlainMoE (the
// single-card MoE written without fsdp::moe), at np 1, 2 and 4 with ep =
// the world:
//   - TopKRouter vs the fp32 softmax (or sigmoid) of x W^T and a top-k
//     selection written here; exact ties (duplicate gate rows on one-hot
//     tokens) go to the lower id; route_norm, route_scale, counts, margin
//     (and routing_margin on hand-made scores with a known answer);
//   - the Switch aux loss from statistics summed over the world: value and
//     rank-averaged gate gradient vs the formula on the whole global batch;
//   - all_to_all with uneven splits and zeros: values and backward exact;
//   - MoE (router + TokenDispatcher + GroupedExperts) vs PlainMoE on the
//     global batch, each rank its slice: routing equality and margin first,
//     then output, input, gate and expert gradients; at np 4 also on the ep
//     slice of an (efsdp=2, ep=2) mesh whose two ep groups see different
//     batches (a group that exchanged with the other would fail);
//   - zero tokens: an expert nobody routes to, a rank that sends to no peer
//     (crafted ids), a rank with no tokens at all;
//   - expert_grad_norms vs norms of the plain gradients; bitwise reruns;
//     typed errors.
// Tolerance 1e-6 throughout, on max |a - b| / max(1, max |reference|):
// every comparison is the same fp32 computation up to GEMM shapes (the
// router's M is the local token count, the gate gradient sums the global
// batch rank by rank) or an fp32 result against a double one on O(1)
// values; integers, ids and exchanged rows are compared exactly.
#include "l1_util.h"
#include "spmd.h"

#include <fsdp/comm.h>
#include <fsdp/errors.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>
#include <fsdp/moe.h>

#include <models/moe_llm.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/linear.h>

#include <boost/core/demangle.hpp>
#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <string>
#include <typeinfo>
#include <vector>

namespace {

namespace moe = fsdp::moe;
using Shape = std::vector<int64_t>;

constexpr double kTol = 1e-6;
// Smallest routing margin under which a parity comparison is not trusted:
// ulp-level logit differences must not flip a choice (PARALLELISM.md 6.6.5).
constexpr double kMinMargin = 1e-5;
constexpr double kInf = std::numeric_limits<double>::infinity();

int64_t world() { return spmd::world_size(); }
int64_t rank() { return spmd::rank(); }
c10::Device dev() { return spmd::device(); }

fsdp::DeviceMesh world_mesh(const std::string& name) {
  return fsdp::init_device_mesh(dev().type(), {world()}, {name});
}

// Identical on every rank that passes the same seed.
at::Tensor randn(const Shape& shape, uint64_t seed, double scale = 1.0) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randn(shape, gen, at::kFloat) * scale;
}

void assign(const at::Tensor& param, const at::Tensor& value) {
  at::NoGradGuard no_grad;
  param.copy_(value);
}

at::Tensor leaf(const at::Tensor& t) { return t.to(dev()).clone().requires_grad_(true); }

// max |a - b| / max(1, max |b|): fp32 sums taken in another order (the gate
// gradient is summed rank by rank, then over ranks) differ by a few ulps of
// their magnitude, so above 1 the error is relative to it.
double diff(const at::Tensor& a, const at::Tensor& b) {
  const double d = l1::diff(a, b);
  if (!(d > 0) || std::isinf(d)) return d;
  return d / std::max(1.0, l1::host(b).abs().max().item<double>());
}

// The k largest scores of each row, ties to the lower id: a selection
// (strictly greater replaces), independent of the library's stable sort.
at::Tensor topk_ids(const at::Tensor& scores, int64_t k) {
  const at::Tensor s = scores.detach().to(at::kDouble).cpu().contiguous();
  const int64_t T = s.size(0), E = s.size(1);
  const auto a = s.accessor<double, 2>();
  at::Tensor ids = at::empty({T, k}, at::kLong);
  auto out = ids.accessor<int64_t, 2>();
  for (int64_t t = 0; t < T; ++t) {
    std::vector<bool> taken(static_cast<size_t>(E), false);
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        if (!taken[static_cast<size_t>(e)] && (best < 0 || a[t][e] > a[t][best])) best = e;
      }
      taken[static_cast<size_t>(best)] = true;
      out[t][j] = best;
    }
  }
  return ids;
}

// min over tokens of (k-th chosen score - largest unchosen score).
double margin_of(const at::Tensor& scores, const at::Tensor& ids) {
  const int64_t T = scores.size(0), E = scores.size(1), k = ids.size(1);
  if (k == E || T == 0) return kInf;
  const at::Tensor s = scores.detach().to(at::kDouble).cpu();
  const at::Tensor chosen = at::zeros_like(s, at::kBool).scatter_(1, ids.cpu(), true);
  const at::Tensor kth = s.gather(1, ids.cpu().narrow(1, k - 1, 1)).squeeze(1);
  const at::Tensor best_left = s.masked_fill(chosen, -kInf).amax(1);
  return (kth - best_left).min().item<double>();
}

// Number of entries where two integer tensors differ (numel if shapes differ).
double mismatches(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined() || a.sizes() != b.sizes()) return kInf;
  return a.cpu().ne(b.cpu()).sum().item<double>();
}

// Runs fn, which must throw exactly E (not a subclass) naming `argument`.
template <typename E, typename Fn>
void expect_exact(Fn&& fn, const std::string& argument, const std::string& label) {
  l1::expect_error<E>(
      [&] {
        try {
          fn();
        } catch (const E& e) {
          BOOST_TEST((typeid(e) == typeid(E)),
                     label << ": threw " << boost::core::demangle(typeid(e).name()) << ", expected "
                           << boost::core::demangle(typeid(E).name()));
          throw;
        }
      },
      argument, label);
}

// ---- router -----------------------------------------------------------------

struct RouterCase {
  std::string label;
  int64_t top_k;
  moe::RouterOptions options;
};

BOOST_AUTO_TEST_CASE(router_matches_reference) {
  const int64_t D = 8, E = 6, T = 40;
  const at::Tensor x = randn({T, D}, 11);
  const at::Tensor W = randn({E, D}, 12);
  moe::RouterOptions norm, scale, sigmoid, sigmoid_all;
  norm.route_norm = true;
  scale.route_scale = 2.5;
  sigmoid.score_func = moe::ScoreFunc::Sigmoid;
  sigmoid_all = sigmoid;
  sigmoid_all.route_norm = true;
  sigmoid_all.route_scale = 0.75;
  const std::vector<RouterCase> cases = {
      {"softmax k=1", 1, {}},
      {"softmax k=2", 2, {}},
      {"softmax k=E", E, {}},
      {"softmax route_norm k=3", 3, norm},
      {"softmax route_scale 2.5 k=2", 2, scale},
      {"sigmoid k=2", 2, sigmoid},
      {"sigmoid route_norm route_scale 0.75 k=3", 3, sigmoid_all}};
  l1::Report rep("EP-router");
  for (const RouterCase& c : cases) {
    moe::TopKRouter router(D, E, c.top_k, c.options);
    assign(router->gate->weight, W);
    router->to(dev());
    const moe::RouterOutput out = router(x.to(dev()));

    // The same fp32 computation as the library's, up to the GEMM call.
    const at::Tensor logits = at::matmul(x, W.t());
    const bool soft = c.options.score_func == moe::ScoreFunc::Softmax;
    const at::Tensor scores = soft ? at::softmax(logits, -1) : at::sigmoid(logits);
    const at::Tensor ids = topk_ids(scores, c.top_k);
    const double margin = margin_of(scores, ids);
    BOOST_REQUIRE_MESSAGE(margin > kMinMargin, c.label << ": reference margin " << margin);
    at::Tensor weights = scores.gather(1, ids);
    if (c.options.route_norm) weights = weights / (weights.sum(-1, true) + 1e-20);
    weights = weights * c.options.route_scale;
    const at::Tensor counts = at::bincount(ids.reshape({-1}), {}, E);

    BOOST_TEST((out.scores.scalar_type() == at::kFloat && out.weights.scalar_type() == at::kFloat),
               c.label << ": scores and weights must be fp32");
    rep.check(c.label + " scores", diff(out.scores, scores), kTol);
    rep.check(c.label + " ids (mismatches)", mismatches(out.ids, ids), 0);
    rep.check(c.label + " weights", diff(out.weights, weights), kTol);
    rep.check(c.label + " counts (mismatches)", mismatches(out.counts, counts), 0);
    if (c.top_k == E) {
      BOOST_TEST(out.margin == kInf, c.label << ": margin " << out.margin << ", expected +inf");
    } else {
      rep.check(c.label + " margin", std::abs(out.margin - margin), kTol);
    }
  }
  rep.publish();
}

// One-hot tokens make the logits the gate's columns exactly, so gate rows 1
// and 3, equal, give experts 1 and 3 bitwise equal scores on every token.
BOOST_AUTO_TEST_CASE(router_ties_go_to_the_lower_id) {
  const at::Tensor W =
      at::tensor({1., 0., 2., 3., 3., 3., 1., 0., 0., 1., 3., 2., 3., 3., 1., 0.}, at::kFloat)
          .view({4, 4});
  // Token t's logits W[:, t]: (1,3,0,3) (0,3,1,3) (2,1,3,1) (3,0,2,0).
  const at::Tensor x = at::eye(4, at::kFloat);
  struct Want {
    int64_t k;
    std::vector<int64_t> ids;
    double margin;
  };
  const double e = std::exp(1.0);
  const double z0 = e + 2 * std::pow(e, 3) + 1;      // tokens 0 and 1
  const double z2 = e * e + 2 * e + std::pow(e, 3);  // token 2
  const double z3 = std::pow(e, 3) + 2 + e * e;      // token 3
  const double k2_margin =
      std::min({(std::pow(e, 3) - e) / z0, (e * e - e) / z2, (e * e - 1) / z3});
  const std::vector<Want> wants = {
      {1, {1, 1, 2, 0}, 0.0},  // tokens 0 and 1: 1 and 3 tie at the top
      {2, {1, 3, 1, 3, 2, 0, 0, 2}, k2_margin},
      {3, {1, 3, 0, 1, 3, 2, 2, 0, 1, 0, 2, 1}, 0.0}};  // tokens 2 and 3: tie at the cut
  l1::Report rep("EP-router ties");
  for (const Want& w : wants) {
    const std::string label = "k=" + std::to_string(w.k);
    moe::TopKRouter router(4, 4, w.k);
    assign(router->gate->weight, W);
    router->to(dev());
    const moe::RouterOutput out = router(x.to(dev()));
    const at::Tensor s = out.scores.cpu();
    BOOST_REQUIRE_MESSAGE(s.select(1, 1).equal(s.select(1, 3)),
                          "experts 1 and 3 must tie bitwise on every token");
    rep.check(label + " ids (mismatches)", mismatches(out.ids, at::tensor(w.ids).view({4, w.k})),
              0);
    rep.check(label + " margin", std::abs(out.margin - w.margin), kTol);
  }
  // Exact binary fractions: the answers are exact.
  const at::Tensor scores =
      at::tensor({0.5, 0.25, 0.125, 0.125, 0.0625, 0.5, 0.4375, 0.0}, at::kFloat).view({2, 4});
  rep.check("routing_margin k=1", std::abs(moe::routing_margin(scores, 1) - 0.0625), 0);
  rep.check("routing_margin k=2", std::abs(moe::routing_margin(scores, 2) - 0.125), 0);
  rep.check("routing_margin k=3 (tie)", std::abs(moe::routing_margin(scores, 3)), 0);
  BOOST_TEST(moe::routing_margin(scores, 4) == kInf);
  BOOST_TEST(moe::routing_margin(scores.narrow(0, 0, 0), 2) == kInf);
  rep.publish();
}

// ---- aux loss -----------------------------------------------------------------

// Every rank routes its slice of a global batch; the statistics are summed
// over the world, so the value is the global Switch loss on every rank and
// the rank-averaged gate gradient is the global loss's gradient.
BOOST_AUTO_TEST_CASE(aux_loss_is_the_global_switch_loss) {
  const int64_t D = 8, E = 4, K = 2, T = 24;
  const double coef = 0.25;
  const at::Tensor x = randn({T, D}, 21);
  const at::Tensor W = randn({E, D}, 22);
  const int64_t per = T / world();

  moe::RouterOptions options;
  options.aux_loss_coef = coef;
  options.aux_stats_mesh = world_mesh("dp");
  moe::TopKRouter router(D, E, K, options);
  assign(router->gate->weight, W);
  router->to(dev());
  const moe::RouterOutput out = router(x.narrow(0, rank() * per, per).to(dev()));
  BOOST_REQUIRE(out.aux_loss.defined());
  out.aux_loss.backward();
  at::Tensor gate_grad = router->gate->weight.grad().clone();
  fsdp::world_group()->all_reduce(gate_grad, fsdp::ReduceOp::SUM);
  gate_grad /= static_cast<double>(world());

  // coef * E * sum_e f_e P_e on the whole batch, in double.
  const at::Tensor Wd = W.to(at::kDouble).requires_grad_(true);
  const at::Tensor scores = at::softmax(at::matmul(x.to(at::kDouble), Wd.t()), -1);
  const at::Tensor ids = topk_ids(scores, K);
  const double margin = margin_of(scores, ids);
  BOOST_REQUIRE_MESSAGE(margin > kMinMargin, "global routing margin " << margin);
  const at::Tensor f = at::bincount(ids.reshape({-1}), {}, E).to(at::kDouble) / (T * K);
  const at::Tensor P = scores.mean(0);
  const at::Tensor want = (f * P).sum() * (coef * E);
  want.backward();

  l1::Report rep("EP-aux");
  rep.check("aux loss value (every rank) vs the global formula",
            std::abs(out.aux_loss.item<double>() - want.item<double>()), kTol);
  rep.check("gate gradient averaged over ranks vs the global formula's", diff(gate_grad, Wd.grad()),
            kTol);
  rep.publish();
}

// ---- all_to_all -----------------------------------------------------------------

using Splits = std::vector<std::vector<int64_t>>;  // [sender][receiver] rows

// Uneven, with zeros: the last rank receives nothing, rank w-2 (w > 2)
// sends nothing at all, rank 0 sends nothing to rank 1 (w > 2).
Splits uneven_splits(int64_t w) {
  Splits s(static_cast<size_t>(w), std::vector<int64_t>(static_cast<size_t>(w)));
  for (int64_t i = 0; i < w; ++i) {
    for (int64_t j = 0; j < w; ++j) {
      const bool zero = (w > 1 && j == w - 1) || (w > 2 && (i == w - 2 || (i == 0 && j == 1)));
      s[static_cast<size_t>(i)][static_cast<size_t>(j)] = zero ? 0 : 1 + (i + 2 * j) % 3;
    }
  }
  return s;
}

// n rows that rank i sends rank j, each entry coding (i, j, row, column);
// `grad` picks the upstream-gradient code instead of the value code.
at::Tensor coded(int64_t i, int64_t j, int64_t n, bool grad) {
  at::Tensor t = at::empty({n, 3}, at::kFloat);
  auto a = t.accessor<float, 2>();
  for (int64_t k = 0; k < n; ++k) {
    for (int64_t c = 0; c < 3; ++c) {
      a[k][c] = grad ? static_cast<float>(0.5 + i + 4 * j + 0.25 * k + 0.125 * c)
                     : static_cast<float>(1000 * i + 100 * j + 10 * k + c);
    }
  }
  return t;
}

BOOST_AUTO_TEST_CASE(all_to_all_uneven_splits) {
  const fsdp::DeviceMesh ep = world_mesh("ep");
  const int64_t w = world(), r = rank();
  const std::vector<std::pair<std::string, Splits>> patterns = {
      {"uneven", uneven_splits(w)},
      {"nothing sent",
       Splits(static_cast<size_t>(w), std::vector<int64_t>(static_cast<size_t>(w)))}};
  l1::Report rep("EP-a2a");
  for (const auto& [label, S] : patterns) {
    std::vector<int64_t> in_splits, out_splits;
    std::vector<at::Tensor> mine, want, upstream, want_grad;
    for (int64_t j = 0; j < w; ++j) {
      const int64_t sent = S[static_cast<size_t>(r)][static_cast<size_t>(j)];
      const int64_t got = S[static_cast<size_t>(j)][static_cast<size_t>(r)];
      in_splits.push_back(sent);
      out_splits.push_back(got);
      mine.push_back(coded(r, j, sent, false));
      want_grad.push_back(coded(r, j, sent, true));
      want.push_back(coded(j, r, got, false));
      upstream.push_back(coded(j, r, got, true));
    }
    const at::Tensor x = leaf(at::cat(mine));
    const at::Tensor out = moe::all_to_all(x, out_splits, in_splits, ep);
    (out * at::cat(upstream).to(dev())).sum().backward();
    rep.check(label + " forward", diff(out, at::cat(want)), 0);
    rep.check(label + " backward", diff(x.grad(), at::cat(want_grad)), 0);
  }
  rep.publish();
}

// ---- the MoE layer against PlainMoE ----------------------------------------------

// A plain MoE with fixed values and the library MoE over `ep` holding the
// same values (gate copied, this rank's experts by load_full).
struct MoEPair {
  int64_t D, F, E, K;
  fsdp::DeviceMesh ep;
  models::PlainMoE plain;
  moe::MoE lib;

  MoEPair(int64_t d, int64_t f, int64_t e, int64_t k, uint64_t seed, fsdp::DeviceMesh ep_mesh,
          moe::RouterOptions options = {})
      : D(d),
        F(f),
        E(e),
        K(k),
        ep(std::move(ep_mesh)),
        plain(d, f, e, k),
        lib(d, f, e, k, ep, std::move(options)) {
    assign(plain->router->gate->weight, randn({E, D}, seed));
    assign(plain->experts->w1, randn({E, F, D}, seed + 1, 1 / std::sqrt(D)));
    assign(plain->experts->w2, randn({E, D, F}, seed + 2, 1 / std::sqrt(F)));
    assign(plain->experts->w3, randn({E, F, D}, seed + 3, 1 / std::sqrt(D)));
    assign(lib->router->gate->weight, plain->router->gate->weight);
    lib->experts->load_full(plain->experts->w1, plain->experts->w2, plain->experts->w3);
    lib->to(dev());
  }
  std::vector<at::Tensor> lib_experts() const {
    return {lib->experts->w1, lib->experts->w2, lib->experts->w3};
  }
  // The plain experts' tensors, cut to this rank's experts.
  std::vector<at::Tensor> plain_local(const std::vector<at::Tensor>& full) const {
    std::vector<at::Tensor> out;
    for (const auto& t : full) {
      out.push_back(t.narrow(0, lib->experts->first_expert, lib->experts->local_experts));
    }
    return out;
  }
};

// A global batch (inputs and the upstream gradient g of loss = sum(out * g))
// and this rank's rows of it; ep rank r holds tokens[r] rows.
struct Batch {
  at::Tensor x, g;
  int64_t offset = 0, count = 0;
  Batch(int64_t D, const std::vector<int64_t>& tokens, uint64_t seed, const fsdp::DeviceMesh& ep) {
    const int64_t r = ep.get_rank();
    int64_t total = 0;
    for (int64_t j = 0; j < ep.size(); ++j) {
      if (j == r) offset = total;
      total += tokens[static_cast<size_t>(j)];
    }
    count = tokens[static_cast<size_t>(r)];
    x = randn({total, D}, seed);
    g = randn({total, D}, seed + 1);
  }
  at::Tensor mine(const at::Tensor& t) const { return t.narrow(0, offset, count); }
};

std::vector<int64_t> equal_tokens(int64_t total, int64_t ranks) {
  return std::vector<int64_t>(static_cast<size_t>(ranks), total / ranks);
}

struct Run {
  at::Tensor out, x_grad;
};

Run run_plain(models::PlainMoE& plain, const Batch& b) {
  const at::Tensor x = b.x.clone().requires_grad_(true);
  Run r;
  r.out = plain(x);
  (r.out * b.g).sum().backward();
  r.x_grad = x.grad();
  return r;
}

Run run_lib(moe::MoE& lib, const Batch& b) {
  const at::Tensor x = leaf(b.mine(b.x));
  Run r;
  r.out = lib(x);
  at::Tensor loss = (r.out * b.mine(b.g).to(dev())).sum();
  if (lib->aux_loss().defined()) loss = loss + lib->aux_loss();
  loss.backward();
  r.x_grad = x.grad();
  return r;
}

// Routing first (equality with the plain model's routing of the same
// tokens, and the margin on the fixed data), then the numbers.
void compare_with_plain(l1::Report& rep, const std::string& label, const MoEPair& p, const Batch& b,
                        const Run& lib, const Run& plain) {
  const double wrong = mismatches(p.lib->last_ids(), b.mine(p.plain->last_ids));
  rep.check(label + " routing ids vs plain (mismatches)", wrong, 0);
  rep.check_differs(label + " routing margin of the global batch", p.plain->last_margin,
                    kMinMargin);
  if (l1::world_max(wrong) > 0 || !(p.plain->last_margin > kMinMargin)) {
    BOOST_ERROR(label << ": routing differs from the plain model's; numbers not compared");
    return;
  }
  rep.check(label + " output", diff(lib.out, b.mine(plain.out)), kTol);
  rep.check(label + " input gradient", diff(lib.x_grad, b.mine(plain.x_grad)), kTol);
  at::Tensor gate = p.lib->router->gate->weight.grad();
  gate = gate.defined() ? gate.clone() : at::full({p.E, p.D}, kInf, at::kFloat).to(dev());
  p.ep.get_group(0)->all_reduce(gate, fsdp::ReduceOp::SUM);
  rep.check(label + " gate gradient summed over ep",
            diff(gate, p.plain->router->gate->weight.grad()), kTol);
  const auto mine = p.lib_experts();
  const auto want = p.plain_local(
      {p.plain->experts->w1.grad(), p.plain->experts->w2.grad(), p.plain->experts->w3.grad()});
  const char* names[] = {"w1", "w2", "w3"};
  for (size_t i = 0; i < 3; ++i) {
    rep.check(label + " local experts' " + names[i] + " gradient", diff(mine[i].grad(), want[i]),
              kTol);
  }
}

BOOST_AUTO_TEST_CASE(moe_matches_plain_moe) {
  struct Layout {
    fsdp::DeviceMesh ep;
    int64_t row;  // seeds the data: rows of a 2-D mesh see different batches
    std::string label;
  };
  std::vector<Layout> layouts = {{world_mesh("ep"), 0, "ep=" + std::to_string(world())}};
  if (world() == 4) {
    const fsdp::DeviceMesh m = fsdp::init_device_mesh(dev().type(), {2, 2}, {"efsdp", "ep"});
    layouts.push_back({m["ep"], m.get_local_rank("efsdp"), "(efsdp=2,ep=2)[ep]"});
  }
  l1::Report rep("EP-moe");
  for (const Layout& l : layouts) {
    const auto seed = static_cast<uint64_t>(31 + 100 * l.row);
    MoEPair p(16, 12, 8, 2, seed, l.ep);
    const Batch b(p.D, equal_tokens(32, l.ep.size()), seed + 10, l.ep);
    const Run plain = run_plain(p.plain, b);
    const Run lib = run_lib(p.lib, b);
    compare_with_plain(rep, l.label, p, b, lib, plain);
  }
  rep.publish();
}

// Rank 0 holds no tokens; its experts still get the other ranks' tokens,
// and with one rank nobody has any.
BOOST_AUTO_TEST_CASE(rank_without_tokens) {
  MoEPair p(16, 12, 8, 2, 51, world_mesh("ep"));
  std::vector<int64_t> tokens(static_cast<size_t>(world()), 8);
  tokens[0] = 0;
  const Batch b(p.D, tokens, 61, p.ep);
  const Run plain = run_plain(p.plain, b);
  const Run lib = run_lib(p.lib, b);
  l1::Report rep("EP-zero");
  BOOST_TEST((lib.out.sizes() == at::IntArrayRef({b.count, p.D})),
             "output shape " << lib.out.sizes());
  for (const at::Tensor& w : p.lib_experts()) {
    BOOST_TEST(w.grad().defined(), "rank without tokens: an expert has no gradient");
  }
  compare_with_plain(rep, "rank 0 with T=0", p, b, lib, plain);
  rep.publish();
}

// ---- crafted routing: zero tokens ------------------------------------------------

// fp32 SwiGLU experts on the whole batch, written here: each expert on its
// rows in token order, each token's terms weighted in fp32 and summed in
// increasing expert id.
at::Tensor reference_moe(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                         const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& w3) {
  at::Tensor out = at::zeros_like(x);
  for (int64_t e = 0; e < w1.size(0); ++e) {
    const at::Tensor chose = ids == e;
    const at::Tensor rows = chose.any(1).nonzero().reshape({-1});
    const at::Tensor xe = x.index_select(0, rows);
    const at::Tensor y =
        at::matmul(at::silu(at::matmul(xe, w1[e].t())) * at::matmul(xe, w3[e].t()), w2[e].t());
    const at::Tensor w = (weights * chose).sum(1).index_select(0, rows);
    out = out.index_add(0, rows, y * w.unsqueeze(1));
  }
  return out;
}

// Two distinct experts per token: never expert 1 (idle); the last rank's
// tokens only its own experts, so it sends to no peer.
at::Tensor crafted_ids(int64_t r, int64_t T, int64_t E) {
  const int64_t w = world(), local = E / w;
  std::vector<int64_t> pool;
  for (int64_t e = r == w - 1 ? (w - 1) * local : 0; e < E; ++e) {
    if (e != 1) pool.push_back(e);
  }
  const auto n = static_cast<int64_t>(pool.size());
  at::Tensor ids = at::empty({T, 2}, at::kLong);
  auto id = ids.accessor<int64_t, 2>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t a = (3 * t + 5 * r) % n;
    id[t][0] = pool[static_cast<size_t>(a)];
    id[t][1] = pool[static_cast<size_t>((a + 1 + t % (n - 1)) % n)];
  }
  return ids;
}

BOOST_AUTO_TEST_CASE(idle_expert_and_silent_rank) {
  const int64_t D = 16, F = 12, E = 8, T = 6, idle = 1;
  const fsdp::DeviceMesh ep = world_mesh("ep");
  moe::TokenDispatcher dispatcher(E, ep);
  moe::GroupedExperts experts(D, F, E, ep);
  const at::Tensor w1 = randn({E, F, D}, 71, 0.25), w2 = randn({E, D, F}, 72, 0.3),
                   w3 = randn({E, F, D}, 73, 0.25);
  experts->load_full(w1, w2, w3);
  experts->to(dev());
  std::vector<at::Tensor> all_ids;
  for (int64_t j = 0; j < world(); ++j) all_ids.push_back(crafted_ids(j, T, E));
  const at::Tensor ids = at::cat(all_ids);
  const Batch b(D, equal_tokens(T * world(), world()), 81, ep);
  const at::Tensor weights = randn({T * world(), 2}, 83).abs();

  const at::Tensor x = leaf(b.mine(b.x));
  const at::Tensor w = leaf(b.mine(weights));
  auto [rows, plan] = dispatcher.dispatch(x, b.mine(ids).to(dev()));
  const at::Tensor out = dispatcher.combine(experts(rows, plan.local_counts), w, plan);
  (out * b.mine(b.g).to(dev())).sum().backward();

  const at::Tensor rx = b.x.clone().requires_grad_(true), rw = weights.clone().requires_grad_(true);
  std::vector<at::Tensor> full = {w1.clone().requires_grad_(true), w2.clone().requires_grad_(true),
                                  w3.clone().requires_grad_(true)};
  const at::Tensor want = reference_moe(rx, ids, rw, full[0], full[1], full[2]);
  (want * b.g).sum().backward();

  l1::Report rep("EP-zero");
  // The construction: nobody routes to `idle`; the last rank sends to no peer.
  const int64_t first = experts->first_expert, local = experts->local_experts;
  const bool owner = idle >= first && idle < first + local;
  // (Every rank makes every check, publish() being collective: the value
  // is 0 where the rank is not the one concerned.)
  rep.check("rows the idle expert received",
            owner ? static_cast<double>(plan.local_counts[idle - first]) : 0, 0);
  int64_t to_peers = 0;
  for (int64_t j = 0; j + 1 < world() && rank() == world() - 1; ++j) {
    to_peers += plan.in_splits[static_cast<size_t>(j)];
  }
  rep.check("rows the last rank sent to peers", static_cast<double>(to_peers), 0);
  // Dispatch: this rank's experts' rows, expert-major, tokens in global order.
  std::vector<at::Tensor> expect_rows;
  for (int64_t e = first; e < first + local; ++e) {
    expect_rows.push_back(b.x.index_select(0, (ids == e).nonzero().select(1, 0)));
  }
  rep.check("dispatched rows", diff(rows, at::cat(expect_rows)), 0);
  rep.check("output", diff(out, b.mine(want)), kTol);
  rep.check("input gradient", diff(x.grad(), b.mine(rx.grad())), kTol);
  rep.check("routing weights' gradient", diff(w.grad(), b.mine(rw.grad())), kTol);
  const std::vector<at::Tensor> mine = {experts->w1, experts->w2, experts->w3};
  for (size_t i = 0; i < 3; ++i) {
    const at::Tensor g = mine[i].grad();
    BOOST_TEST(g.defined(), "expert tensor " << i << " has no gradient on rank " << rank());
    rep.check("local experts' w" + std::to_string(i + 1) + " gradient",
              diff(g, full[i].grad().narrow(0, first, local)), kTol);
    const double idle_grad = !owner        ? 0
                             : g.defined() ? g[idle - first].abs().max().item<double>()
                                           : kInf;
    rep.check("idle expert's w" + std::to_string(i + 1) + " gradient (must be 0)", idle_grad, 0);
  }
  rep.publish();
}

// ---- per-expert gradient norms, determinism ----------------------------------

BOOST_AUTO_TEST_CASE(expert_grad_norms_match_plain) {
  MoEPair p(16, 12, 8, 2, 31, world_mesh("ep"));
  const Batch b(p.D, equal_tokens(32, world()), 41, p.ep);
  run_plain(p.plain, b);
  run_lib(p.lib, b);
  const at::Tensor norms = moe::expert_grad_norms(*p.lib->experts);
  at::Tensor squares = at::zeros({p.E}, at::kDouble);
  for (const at::Tensor* w :
       {&p.plain->experts->w1, &p.plain->experts->w2, &p.plain->experts->w3}) {
    squares += w->grad().to(at::kDouble).pow(2).reshape({p.E, -1}).sum(1);
  }
  l1::Report rep("EP-norms");
  BOOST_TEST(mismatches(p.lib->last_ids(), b.mine(p.plain->last_ids)) == 0);
  rep.check("per-expert gradient norms vs plain", diff(norms, squares.sqrt()), kTol);
  rep.publish();
}

BOOST_AUTO_TEST_CASE(rerun_is_bitwise_identical) {
  moe::RouterOptions options;
  options.aux_loss_coef = 0.1;
  options.aux_stats_mesh = world_mesh("dp");
  MoEPair p(16, 12, 8, 2, 91, world_mesh("ep"), options);
  const Batch b(p.D, equal_tokens(32, world()), 92, p.ep);
  auto snapshot = [&](const Run& r) {
    std::vector<at::Tensor> s = {r.out.detach().clone(), r.x_grad.clone(),
                                 p.lib->last_ids().clone(), p.lib->aux_loss().detach().clone()};
    for (const auto& param : p.lib->parameters()) s.push_back(param.grad().clone());
    l1::clear_grads(*p.lib);
    return s;
  };
  const auto first = snapshot(run_lib(p.lib, b));
  const auto second = snapshot(run_lib(p.lib, b));
  l1::Report rep("EP-determinism");
  double worst = first.size() == second.size() ? 0 : kInf;
  for (size_t i = 0; i < first.size() && i < second.size(); ++i) {
    worst = std::max(worst, diff(first[i].to(at::kDouble), second[i].to(at::kDouble)));
  }
  rep.check("rerun: output, gradients, ids, aux loss", worst, 0);
  rep.publish();
}

// ---- typed errors ----------------------------------------------------------------

BOOST_AUTO_TEST_CASE(argument_errors) {
  using fsdp::ArgumentError;
  using fsdp::MeshError;
  using fsdp::ShapeError;
  auto router_with = [](moe::RouterOptions o) { return [o] { moe::TopKRouter(4, 4, 2, o); }; };
  moe::RouterOptions o;
  expect_exact<ArgumentError>([] { moe::TopKRouter(0, 4, 2); }, "dim", "TopKRouter dim 0");
  expect_exact<ArgumentError>([] { moe::TopKRouter(4, 0, 1); }, "num_experts",
                              "TopKRouter num_experts 0");
  expect_exact<ArgumentError>([] { moe::TopKRouter(4, 4, 0); }, "top_k", "TopKRouter top_k 0");
  expect_exact<ArgumentError>([] { moe::TopKRouter(4, 4, 5); }, "top_k", "TopKRouter top_k > E");
  for (double bad : {0.0, -1.0, std::nan(""), kInf}) {
    o = {};
    o.route_scale = bad;
    expect_exact<ArgumentError>(router_with(o), "options", "route_scale " + std::to_string(bad));
  }
  for (double bad : {-0.5, std::nan(""), kInf}) {
    o = {};
    o.aux_loss_coef = bad;
    expect_exact<ArgumentError>(router_with(o), "options", "aux_loss_coef " + std::to_string(bad));
  }
  moe::TopKRouter router(4, 4, 2);
  expect_exact<ShapeError>([&] { router(at::zeros({3, 5})); }, "x", "TopKRouter x [3, 5]");
  expect_exact<ArgumentError>(
      [] {
        moe::routing_margin(at::zeros({2, 4}), 5);
      },
      "top_k", "routing_margin top_k > E");

  const fsdp::DeviceMesh ep = world_mesh("ep");
  const int64_t E = 2 * world();
  // At np 1 every count divides: 0 experts stands in.
  expect_exact<ArgumentError>([&] { moe::TokenDispatcher(world() > 1 ? world() + 1 : 0, ep); },
                              "num_experts",
                              world() > 1 ? "TokenDispatcher num_experts not divisible by ep"
                                          : "TokenDispatcher num_experts 0");
  const moe::TokenDispatcher dispatcher(E, ep);
  const at::Tensor x = at::zeros({3, 4});
  for (int64_t bad : {int64_t{-1}, E}) {
    expect_exact<ArgumentError>(
        [&] {
          dispatcher.dispatch(x, at::tensor(std::vector<int64_t>{0, 1, 0, 1, bad, 0}).view({3, 2}));
        },
        "ids", "dispatch id " + std::to_string(bad));
  }
  expect_exact<ShapeError>(
      [&] {
        dispatcher.dispatch(x, at::zeros({3, 2}, at::kInt));
      },
      "ids", "dispatch int32 ids");

  moe::GroupedExperts experts(4, 6, E, ep);
  const std::vector<int64_t> counts(static_cast<size_t>(experts->local_experts), 1);
  expect_exact<ShapeError>(
      [&] {
        experts(at::zeros({experts->local_experts + 1, 4}), counts);
      },
      "counts", "GroupedExperts counts not summing to rows");
  expect_exact<ShapeError>(
      [&] {
        experts(at::zeros({experts->local_experts + 1, 4}),
                std::vector<int64_t>(counts.size() + 1, 1));
      },
      "counts", "GroupedExperts one count too many");
  expect_exact<ShapeError>(
      [&] {
        experts->load_full(at::zeros({E, 6, 5}), at::zeros({E, 4, 6}), at::zeros({E, 6, 4}));
      },
      "w1", "load_full w1 of another shape");

  const fsdp::DeviceMesh efsdp = fsdp::init_device_mesh(dev().type(), {world()}, {"efsdp"});
  torch::nn::Linear dense(4, 4);
  expect_exact<ArgumentError>([&] { moe::expert_options(*dense, {}, efsdp, 1.0); }, "module",
                              "expert_options on a module without experts");
  moe::MoE layer(4, 6, E, 2, ep);
  for (double bad : {0.0, -2.0, std::nan(""), kInf}) {
    expect_exact<ArgumentError>([&] { moe::expert_options(*layer, {}, efsdp, bad); },
                                "data_parallel_size",
                                "expert_options data_parallel_size " + std::to_string(bad));
  }
  const fsdp::DeviceMesh flat2d = fsdp::init_device_mesh(dev().type(), {world(), 1}, {"a", "b"});
  const std::vector<int64_t> none(static_cast<size_t>(world()), 0);
  expect_exact<MeshError>(
      [&] {
        moe::all_to_all(at::zeros({0, 4}), none, none, flat2d);
      },
      "ep", "all_to_all on a 2-D mesh");
}

}  // namespace
