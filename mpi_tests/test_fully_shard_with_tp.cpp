// Tensor parallelism composed with FSDP on the plan's LLM decoder (the
// precision matrix's "TP + FSDP, fp32" row, case id TP-01): the decoder of
// L3-01/L3-02 in its TP form (fused qkv by heads, SwiGLU, vocab-parallel
// tied embedding/output; models/tp_llm.h), FSDP over the data-parallel dims:
//   np 4  (dp=2, tp=2), plain TP, + sequence parallel, + loss parallel
//   np 4  HSDP + TP (replicate=2, shard=1, tp=2), sequence parallel
//   np 2  (dp=1, tp=2), plain TP and sequence + loss parallel
// Each: 2 AdamW steps against the cached single-card reference of L3-01
// (data/reference/cpu/llm_decoder.h5, the same model, data and optimizer)
// and an independent DDP run over every rank: loss and global grad norm at
// 1e-5 and, on their own, the recorded gradients and post-step parameters
// elementwise at 1e-5; a rerun bitwise identical. Then the exact collectives
// of one step on the tp and dp groups, and full / sharded state dicts that
// rebuild the plain model's global tensors.
#include "l3_util.h"
#include "spmd.h"

#include <fsdp/comm.h>
#include <fsdp/errors.h>
#include <fsdp/mesh.h>

#include <models/init.h>
#include <models/llm.h>
#include <models/tp_llm.h>

#include <iostream>
#include <map>
#include <memory>
#include <string>

namespace {

constexpr double kTol = 1e-5;  // plan: TP + FSDP, fp32

ref::RunSpec tp_spec(std::vector<int64_t> mesh, bool sp, bool lp) {
  ref::RunSpec s = l3::fsdp(std::move(mesh));
  s.tp.size = 2;
  s.tp.sequence_parallel = sp;
  s.tp.loss_parallel = lp;
  return s;
}

// The TP layouts of one rank count against the reference and DDP, and the
// first of them is rerun bitwise.
void check_tp_layouts(const std::string& id, const std::vector<ref::RunSpec>& specs) {
  auto c = ref::make_case("llm_decoder");
  const ref::RunRecord single = l3::load_reference(*c);
  BOOST_REQUIRE_GE(single.steps.size(), 2u);  // plan rule 4
  for (const auto& name : c->recorded()) BOOST_REQUIRE(single.steps[0].grads.count(name) == 1);
  const ref::RunRecord ddp = l3::timed_run(*c, l3::ddp());
  l3::Metrics m;
  m.adam_eps = c->config().at("optimizer").at("eps").get<double>();
  l1::Report report(id);
  l3::compare(report, "DDP baseline vs single card", ddp, single, kTol, m);
  for (size_t i = 0; i < specs.size(); ++i) {
    const ref::RunRecord run = l3::timed_run(*c, specs[i]);
    const std::string label = l3::mesh_text(specs[i]);
    l3::compare(report, label + " vs single card", run, single, kTol, m);
    l3::compare(report, label + " vs DDP", run, ddp, kTol, m);
    if (i == 0) l3::check_bitwise(report, label, run, l3::timed_run(*c, specs[i]));
  }
  report.publish();
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_tp_fsdp_dp2_tp2,  // TP-01
                     *spmd::needs_world_size(4, "dp=2, tp=2; it runs in "
                                                "test_fully_shard_with_tp_np4")) {
  check_tp_layouts("TP-01 (dp=2, tp=2)", {tp_spec({2}, false, false), tp_spec({2}, true, false),
                                          tp_spec({2}, true, true)});
}

BOOST_AUTO_TEST_CASE(test_hsdp_tp_replicate2_shard1_tp2,  // TP-01
                     *spmd::needs_world_size(4, "replicate=2, shard=1, tp=2; it runs in "
                                                "test_fully_shard_with_tp_np4")) {
  check_tp_layouts("TP-01 HSDP (2x1, tp=2)", {tp_spec({2, 1}, true, false)});
}

BOOST_AUTO_TEST_CASE(test_tp_fsdp_dp1_tp2,  // TP-01
                     *spmd::needs_world_size(2, "dp=1, tp=2; it runs in "
                                                "test_fully_shard_with_tp_np2")) {
  check_tp_layouts("TP-01 (dp=1, tp=2)", {tp_spec({1}, false, false), tp_spec({1}, true, true)});
}

namespace {

// The TP decoder sharded on (dp, tp) = (w/2, 2) with the options the runner
// uses.
struct ShardedTP {
  std::unique_ptr<ref::Case> c = ref::make_case("llm_decoder");
  int64_t dp = spmd::world_size() / 2;
  fsdp::DeviceMesh mesh = fsdp::init_device_mesh(spmd::device().type(), {dp, 2}, {"shard", "tp"});
  std::shared_ptr<torch::nn::Module> model;
  std::vector<ref::Unit> units;

  ShardedTP(bool sp, bool lp) {
    fsdp::FullyShardOptions o;
    o.mesh = mesh;
    o.shard_dim = "shard";
    o.comm_fusion = false;  // test_tp_fsdp_collective_counts counts per parameter
    ref::TPSpec spec;
    spec.size = 2;
    spec.sequence_parallel = sp;
    spec.loss_parallel = lp;
    model = c->build_tp(mesh["tp"], spec);
    model->to(spmd::device());  // as the runner does
    units = c->shard(model, o);
  }
};

// (op, group) -> count of one forward + backward.
std::map<std::pair<std::string, std::string>, int64_t> step_counts(bool sp, bool lp,
                                                                   std::string* tp_group,
                                                                   std::string* dp_group) {
  ShardedTP t(sp, lp);
  fsdp::reset_collective_counters();
  t.c->forward(t.model, 0, t.mesh.get_local_rank("shard"), t.dp, ref::Layout::FSDP).loss.backward();
  *tp_group = t.mesh.get_group("tp")->name();
  *dp_group = t.mesh.get_group("shard")->name();
  return fsdp::collective_counters().count;
}

}  // namespace

// Exact collectives of one forward + backward, derived from the model (L
// layers of 7 parameters: 2 norms, qkv, proj, w1, w3, w2; the root holds the
// tied embedding and the final norm):
//  dp  one all-gather per parameter in forward and again in backward
//      (reshard_after_forward) -- but the root's 2, which stay gathered for
//      backward (the default) -- and one reduce-scatter per parameter;
//  tp  without SP: forward all-reduces after the embedding and each proj /
//      w2 (1 + 2L), backward all-reduces the inputs of qkv, w1, w3 and the
//      tied output (3L + 1); the logits gather once unless loss parallel;
//      with SP: the embedding, proj and w2 reduce-scatter (1 + 2L) and the
//      inputs of qkv, w1, w3 and the output all-gather (3L + 1), each the
//      other way round in backward, and the 2L + 1 norm weights' partial
//      gradients are all-reduced; loss parallel adds 2 all-reduces (the row
//      max, then the sum of exponentials and target logit together).
BOOST_AUTO_TEST_CASE(test_tp_fsdp_collective_counts, *spmd::needs_even_world_size("tp = 2")) {  // [ours]
  const int64_t L = 4, root_params = 2, params = 7 * L + root_params;
  for (bool sp : {false, true}) {
    for (bool lp : {false, true}) {
      BOOST_TEST_CONTEXT("sequence_parallel " << sp << ", loss_parallel " << lp) {
        std::string tpg, dpg;
        const auto counts = step_counts(sp, lp, &tpg, &dpg);
        std::map<std::pair<std::string, std::string>, int64_t> want;
        if (spmd::world_size() > 2) {
          want[{"all_gather", dpg}] = 2 * params - root_params;
          want[{"reduce_scatter", dpg}] = params;
        }
        const int64_t lp_all_reduces = lp ? 2 : 0;
        const int64_t logits_gather = lp ? 0 : 1;
        if (!sp) {
          want[{"all_reduce", tpg}] = (1 + 2 * L) + (3 * L + 1) + lp_all_reduces;
          if (logits_gather) want[{"all_gather", tpg}] = logits_gather;
        } else {
          want[{"reduce_scatter", tpg}] = (1 + 2 * L) + (3 * L + 1);
          want[{"all_gather", tpg}] = (3 * L + 1) + (1 + 2 * L) + logits_gather;
          want[{"all_reduce", tpg}] = (2 * L + 1) + lp_all_reduces;
        }
        BOOST_TEST(counts == want);
        for (const auto& [k, v] : counts) {
          BOOST_TEST_MESSAGE(k.first << " on " << k.second << ": " << v);
        }
      }
    }
  }
}

namespace {

using Named = std::map<std::string, at::Tensor>;

// Every unit's full state dict under the model's parameter names.
Named full_state(const std::vector<ref::Unit>& units) {
  Named out;
  for (const auto& u : units) {
    for (auto& [name, t] : u.module.full_state_dict()) out[u.prefix + name] = t;
  }
  return out;
}

// Names and values equal bitwise; the count of compared entries.
int64_t check_same(const Named& got, const Named& want) {
  BOOST_TEST(got.size() == want.size());
  int64_t same = 0;
  for (const auto& [name, t] : want) {
    auto it = got.find(name);
    const bool ok = it != got.end() && it->second.sizes() == t.sizes() &&
                    at::equal(it->second.cpu(), t.cpu());  // full state may be on the device
    BOOST_TEST(ok, "state dict entry " << name);
    same += ok ? 1 : 0;
  }
  return same;
}

}  // namespace

// State dicts rebuild global tensors from TP + FSDP shards: the full state
// dict of the TP model is the plain model's (names, shapes, values); loading
// another plain model's full tensors and then the saved sharded DTensors
// round-trips bitwise.
BOOST_AUTO_TEST_CASE(test_tp_fsdp_state_dicts, *spmd::needs_even_world_size("tp = 2")) {  // [ours]
  ShardedTP t(/*sp=*/true, /*lp=*/false);
  auto& units = t.units;
  const auto plain = t.c->build();
  Named plain_values;
  for (const auto& item : plain->named_parameters()) plain_values[item.key()] = item.value();
  BOOST_REQUIRE_EQUAL(plain_values.size(), 30u);  // 7 per layer x 4, embedding, final norm

  BOOST_TEST(check_same(full_state(units), plain_values) ==
             static_cast<int64_t>(plain_values.size()));

  std::vector<std::vector<std::pair<std::string, fsdp::DTensor>>> saved;
  for (const auto& u : units) {
    auto sd = u.module.state_dict();
    for (auto& [name, dt] : sd) {
      dt = fsdp::DTensor::from_local(dt.to_local().clone(), dt.device_mesh(), dt.placements(),
                                     dt.shape());
    }
    saved.push_back(std::move(sd));
  }
  auto other = std::make_shared<models::DecoderImpl>(models::DecoderConfig{});
  models::init_weights(*other, 99);
  Named other_values;
  for (const auto& item : other->named_parameters()) other_values[item.key()] = item.value();
  for (auto& u : units) {
    std::vector<std::pair<std::string, at::Tensor>> full;
    for (const auto& [name, dt] : u.module.state_dict()) {
      full.emplace_back(name, other_values.at(u.prefix + name));
    }
    u.module.load_state_dict(full);
  }
  BOOST_TEST(check_same(full_state(units), other_values) ==
             static_cast<int64_t>(other_values.size()));
  for (size_t i = 0; i < units.size(); ++i) units[i].module.load_state_dict(saved[i]);
  BOOST_TEST(check_same(full_state(units), plain_values) ==
             static_cast<int64_t>(plain_values.size()));
}

// Shapes that do not split over tp are typed errors naming the argument.
BOOST_AUTO_TEST_CASE(test_tp_decoder_shape_errors, *spmd::needs_even_world_size("tp = 2")) {  // [ours]
  const auto mesh =
      fsdp::init_device_mesh(spmd::device().type(), {spmd::world_size() / 2, 2}, {"shard", "tp"});
  auto attempt = [&](models::DecoderConfig cfg, bool sp, const std::string& argument) {
    bool thrown = false;
    try {
      models::TPDecoder(cfg, mesh["tp"], models::TPOptions{sp, false});
    } catch (const fsdp::ShapeError& e) {
      thrown = true;
      BOOST_TEST(e.argument() == argument, e.what());
    }
    BOOST_TEST(thrown, "no ShapeError naming " << argument);
  };
  models::DecoderConfig cfg;
  cfg.heads = 3;
  cfg.hidden = 96;
  attempt(cfg, false, "heads");
  cfg = {};
  cfg.vocab = 1023;
  attempt(cfg, false, "num_embeddings");
  cfg = {};
  cfg.seq = 127;
  attempt(cfg, true, "seq");
  cfg = {};
  cfg.ffn = 66 * 3 + 1;  // 199 columns
  attempt(cfg, false, "out_features");
}
