// Mixture of experts (fsdp/moe.h) [ours], the routing units, at np 1, 2 and
// 4 with ep = the world:
//   - TopKRouter vs the fp32 softmax (or sigmoid) of x W^T and a top-k
//     selection written here; exact ties (duplicate gate rows on one-hot
//     tokens) go to the lower id; route_norm, route_scale, counts, margin
//     (and routing_margin on hand-made scores with a known answer);
//   - the Switch aux loss from statistics summed over the world: value and
//     rank-averaged gate gradient vs the formula on the whole global batch;
//   - all_to_all with uneven splits and zeros: values and backward exact.
// Part of the test_moe executable (np 1, 2, 4; gpu1, gpu2, gpu4; label ep).
//
// Tolerances: see common/moe_util.h.
#include "raw_mpi.h"
#include "moe_util.h"

namespace {

// ---- router -----------------------------------------------------------------

struct RouterCase {
  std::string label;
  int64_t top_k;
  moe::RouterOptions options;
};

BOOST_AUTO_TEST_CASE(router_matches_reference) {  // [ours]
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
    rep.check(c.label + " scores", max_abs_diff_or_inf_scaled_by_b(out.scores, scores), kTol);
    rep.check(c.label + " ids (mismatches)", mismatches(out.ids, ids), 0);
    rep.check(c.label + " weights", max_abs_diff_or_inf_scaled_by_b(out.weights, weights), kTol);
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
BOOST_AUTO_TEST_CASE(router_ties_go_to_the_lower_id) {  // [ours]
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
BOOST_AUTO_TEST_CASE(aux_loss_is_the_global_switch_loss) {  // [ours]
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
  raw_mpi::all_reduce(gate_grad, MPI_SUM);
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
  rep.check("gate gradient averaged over ranks vs the global formula's",
            max_abs_diff_or_inf_scaled_by_b(gate_grad, Wd.grad()), kTol);
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

BOOST_AUTO_TEST_CASE(all_to_all_uneven_splits) {  // [ours]
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
    rep.check(label + " forward", max_abs_diff_or_inf_scaled_by_b(out, at::cat(want)), 0);
    rep.check(label + " backward", max_abs_diff_or_inf_scaled_by_b(x.grad(), at::cat(want_grad)),
              0);
  }
  rep.publish();
}

}  // namespace
