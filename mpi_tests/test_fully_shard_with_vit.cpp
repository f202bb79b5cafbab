// Vision and multimodal models under fully_shard (the plan's
// _test_fully_shard_with_vit.py), Level 3, fp32, np 2:
//   L3-04 test_vit_fsdp_vs_ddp             6-block ViT; patch embedding and head
//                                          replicated (not sharded)
//   L3-06 test_multimodal_deepstack_fsdp   4-block ViT -> projection MLP (replicated)
//                                          -> 2-layer decoder; sub-models sharded
//                                          independently
// Each: 2 AdamW steps against the cached single-card reference and an
// independent DDP run at 1e-5, FSDP 1-D and HSDP 2x1, rerun bitwise identical.
#include "l3_util.h"
#include "spmd.h"

#include <fsdp/comm.h>

namespace {
constexpr double kTol = 1e-5;  // plan: FSDP 1-D, fp32

// max |t - rank 0's t| over all ranks: 0 when bitwise identical everywhere.
double spread_over_ranks(const at::Tensor& t) {
  at::Tensor root = t.clone();
  fsdp::world_group()->broadcast(root, 0);
  return l1::world_max(l1::diff(t, root));
}
}  // namespace

BOOST_AUTO_TEST_CASE(test_vit_fsdp_vs_ddp,  // L3-04
                     *spmd::needs_world_size(2, "L3-04 runs on FSDP 1-D at 2 ranks")) {
  auto c = ref::make_case("vit");
  l1::Report report("L3-04");
  auto runs = l3::run_layouts(*c, l3::fsdp({2}), l3::fsdp({2, 1}));
  l3::check_against_baselines(report, runs, kTol);
  // The replicated patch embedding: every rank holds the same full gradient,
  // bit for bit, and it equals the DDP baseline's.
  const std::string patch = "patch_embed.weight";
  for (size_t k = 0; k < runs.main.steps.size(); ++k) {
    const at::Tensor g = runs.main.steps[k].grads.at(patch);
    const std::string at = "FSDP 1-D: step " + std::to_string(k) + " " + patch + " grad ";
    report.check(at + "identical on all ranks (bitwise)", spread_over_ranks(g), 0.0);
    report.check(at + "equals DDP's (bitwise)", l1::diff(g, runs.ddp.steps[k].grads.at(patch)), 0.0);
  }
  report.publish();
}

BOOST_AUTO_TEST_CASE(test_multimodal_deepstack_fsdp,  // L3-06
                     *spmd::needs_world_size(2, "L3-06 runs on FSDP 1-D at 2 ranks")) {
  auto c = ref::make_case("multimodal");
  l1::Report report("L3-06");
  auto runs = l3::run_layouts(*c, l3::fsdp({2}), l3::fsdp({2, 1}));
  l3::check_against_baselines(report, runs, kTol);
  // The gradient crosses the sub-model boundaries: the projection MLP (fed
  // by the ViT, feeding the decoder) and the ViT itself get gradient.
  for (size_t k = 0; k < runs.main.steps.size(); ++k) {
    const auto& s = runs.main.steps[k];
    const std::string at = "FSDP 1-D: step " + std::to_string(k) + " ";
    report.check_differs(at + "projector grad norm", s.norms.at("projector"), 0.0);
    report.check_differs(at + "vision grad norm", s.norms.at("vision"), 0.0);
  }
  report.publish();
}
