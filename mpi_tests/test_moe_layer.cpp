// Mixture of experts and expert parallelism (fsdp/moe.h) [ours], the layer,
// at np 1, 2 and 4 with ep = the world:
//   - MoE (router + TokenDispatcher + GroupedExperts) vs models::PlainMoE on
//     the global batch, each rank its slice: routing equality and margin
//     first, then output, input, gate and expert gradients; at np 4 also on
//     the ep slice of an (efsdp=2, ep=2) mesh whose two ep groups see
//     different batches (a group that exchanged with the other would fail);
//   - zero tokens: an expert nobody routes to, a rank that sends to no peer
//     (crafted ids), a rank with no tokens at all;
//   - expert_grad_norms vs norms of the plain gradients; bitwise reruns;
//     typed errors.
// Part of the test_moe executable (np 1, 2, 4; gpu1, gpu2, gpu4; label ep).
//
// Tolerances: see common/moe_util.h.
#include "moe_util.h"

namespace {

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
  rep.check(label + " output", max_abs_diff_or_inf_scaled_by_b(lib.out, b.mine(plain.out)), kTol);
  rep.check(label + " input gradient",
            max_abs_diff_or_inf_scaled_by_b(lib.x_grad, b.mine(plain.x_grad)), kTol);
  at::Tensor gate = p.lib->router->gate->weight.grad();
  gate = gate.defined() ? gate.clone() : at::full({p.E, p.D}, kInf, at::kFloat).to(dev());
  p.ep.get_group(0)->all_reduce(gate, fsdp::ReduceOp::SUM);
  rep.check(label + " gate gradient summed over ep",
            max_abs_diff_or_inf_scaled_by_b(gate, p.plain->router->gate->weight.grad()), kTol);
  const auto mine = p.lib_experts();
  const auto want = p.plain_local(
      {p.plain->experts->w1.grad(), p.plain->experts->w2.grad(), p.plain->experts->w3.grad()});
  const char* names[] = {"w1", "w2", "w3"};
  for (size_t i = 0; i < 3; ++i) {
    rep.check(label + " local experts' " + names[i] + " gradient",
              max_abs_diff_or_inf_scaled_by_b(mine[i].grad(), want[i]), kTol);
  }
}

BOOST_AUTO_TEST_CASE(moe_matches_plain_moe) {  // [ours]
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
BOOST_AUTO_TEST_CASE(rank_without_tokens) {  // [ours]
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

BOOST_AUTO_TEST_CASE(idle_expert_and_silent_rank) {  // [ours]
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
  rep.check("dispatched rows", max_abs_diff_or_inf_scaled_by_b(rows, at::cat(expect_rows)), 0);
  rep.check("output", max_abs_diff_or_inf_scaled_by_b(out, b.mine(want)), kTol);
  rep.check("input gradient", max_abs_diff_or_inf_scaled_by_b(x.grad(), b.mine(rx.grad())), kTol);
  rep.check("routing weights' gradient",
            max_abs_diff_or_inf_scaled_by_b(w.grad(), b.mine(rw.grad())), kTol);
  const std::vector<at::Tensor> mine = {experts->w1, experts->w2, experts->w3};
  for (size_t i = 0; i < 3; ++i) {
    const at::Tensor g = mine[i].grad();
    BOOST_TEST(g.defined(), "expert tensor " << i << " has no gradient on rank " << rank());
    rep.check("local experts' w" + std::to_string(i + 1) + " gradient",
              max_abs_diff_or_inf_scaled_by_b(g, full[i].grad().narrow(0, first, local)), kTol);
    const double idle_grad = !owner        ? 0
                             : g.defined() ? g[idle - first].abs().max().item<double>()
                                           : kInf;
    rep.check("idle expert's w" + std::to_string(i + 1) + " gradient (must be 0)", idle_grad, 0);
  }
  rep.publish();
}

// ---- per-expert gradient norms, determinism ----------------------------------

BOOST_AUTO_TEST_CASE(expert_grad_norms_match_plain) {  // [ours]
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
  rep.check("per-expert gradient norms vs plain",
            max_abs_diff_or_inf_scaled_by_b(norms, squares.sqrt()), kTol);
  rep.publish();
}

BOOST_AUTO_TEST_CASE(rerun_is_bitwise_identical) {  // [ours]
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
    worst = std::max(worst, max_abs_diff_or_inf_scaled_by_b(first[i].to(at::kDouble),
                                                            second[i].to(at::kDouble)));
  }
  rep.check("rerun: output, gradients, ids, aux loss", worst, 0);
  rep.publish();
}

// ---- typed errors ----------------------------------------------------------------

BOOST_AUTO_TEST_CASE(argument_errors) {  // [ours]
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
