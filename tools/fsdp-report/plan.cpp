// The test plan's cases and matrix (plan.h).
#include "plan.h"

#include <algorithm>
#include <regex>

namespace report {

const std::vector<PlanCase>& plan_cases() {
  static const std::vector<PlanCase> cases = {
      {"L1-02", "test_fully_shard_module", {"test_set_requires_all_reduce"}, 1e-5,
       {{"replicas equal", 1e-6}}},  // "on: grads equal atol=1e-6"
      {"L1-03", "test_fully_shard_module", {"test_set_reduce_op_type"}, 1e-5, {}},
      {"L1-07", "test_hsdp_param", {"test_custom_shard_placement_fn"}, 1e-5, {}},
      // The plan's L1-08 checks are fusion vs no fusion at 1e-6; its runs'
      // comparisons with the single card (ours) have no plan tolerance.
      {"L1-08", "test_fully_shard_precision", {"test_comm_fusion_numerical_correctness"}, 0,
       {{"loss_fusion - loss_nofusion|fusion vs no-fusion", 1e-6}}},
      {"L1-10", "test_fully_shard_precision", {"test_mp_bf16_param_fp32_reduce"}, 1e-3, {}},
      {"L1-11", "test_fully_shard_precision", {"test_mp_bf16_all_bf16"}, 1e-3, {}},
      {"L1-13", "test_fully_shard_precision", {"test_mp_apply_grad_on_fp32_main_grad"}, 1e-5, {}},
      {"L2-01", "test_fully_shard_precision", {"test_gradient_accumulation"}, 1e-5, {}},
      {"L2-02", "test_fully_shard_precision", {"test_frozen_params_mixed_training"}, 1e-5, {}},
      {"L2-03", "test_fully_shard_with_ac", {"test_reentrant_ac_fsdp"}, 1e-5, {}},
      {"L2-04", "test_fully_shard_with_ac", {"test_nonreentrant_ac_fsdp"}, 1e-5, {}},
      {"L2-05", "test_fully_shard_with_ac", {"test_selective_ac_fsdp"}, 1e-5, {}},
      {"L2-06", "test_fully_shard_with_ac", {"test_ac_activation_swap_fsdp"}, 1e-5, {}},
      {"L2-07", "test_fully_shard_precision", {"test_grad_clip_with_dtensor_grads"}, 1e-5, {}},
      {"L2-09", "test_fully_shard_with_pp", {"test_pp_fsdp_coupling"}, 1e-5, {}},
      {"L2-10", "test_fully_shard_with_ep", {"test_ep_fsdp_coupling"}, 1e-4, {}},
      {"L3-01", "test_fully_shard_with_llm", {"test_llm_decoder_hsdp_vs_ddp"}, 1e-5, {}},
      {"L3-02", "test_fully_shard_with_llm", {"test_llm_decoder_fsdp_1d_vs_ddp"}, 1e-5, {}},
      {"L3-03", "test_fully_shard_with_llm", {"test_moe_llm_ep_fsdp_vs_ddp"}, 1e-4,
       {{"dense grad norm", 1e-5}}},  // "dense layers' grad norm atol=1e-5"
      {"L3-04", "test_fully_shard_with_vit", {"test_vit_fsdp_vs_ddp"}, 1e-5, {}},
      {"L3-05", "test_fully_shard_with_llm", {"test_chunked_ce_fsdp_vs_ddp"}, 1e-5,
       {{R"(sum\(per-chunk losses\))", 1e-6}}},  // "sum(per_chunk_losses) == total_loss atol=1e-6"
      {"L3-06", "test_fully_shard_with_vit", {"test_multimodal_deepstack_fsdp"}, 1e-5, {}},
      {"TP-01", "test_fully_shard_with_tp",
       {"test_tp_fsdp_dp2_tp2", "test_hsdp_tp_replicate2_shard1_tp2", "test_tp_fsdp_dp1_tp2"},
       1e-5, {}},
  };
  return cases;
}

const PlanCase* plan_case(const std::string& id) {
  for (const auto& c : plan_cases()) {
    if (c.id == id) return &c;
  }
  return nullptr;
}

bool is_plan_record(const Record& r) {
  const PlanCase* c = plan_case(r.plan_id);
  return c != nullptr && c->suite == r.executable;
}

double plan_tol(const Record& r) {
  const PlanCase* c = plan_case(r.plan_id);
  if (c == nullptr) return 0;
  for (const auto& k : c->checks) {
    if (std::regex_search(r.metric, std::regex(k.metric, std::regex::icase))) return k.tol;
  }
  return c->tol;
}

bool is_loss_metric(const std::string& metric) {
  static const std::regex re(R"(\bloss(es)?\b)", std::regex::icase);
  return std::regex_search(metric, re);
}
bool is_grad_norm_metric(const std::string& metric) {
  static const std::regex re(R"(\bgrad(ient)? norms?\b)", std::regex::icase);
  return std::regex_search(metric, re);
}

// The test plan's "Precision self-consistency matrix" (../shared/TEST-PLAN.md).
const std::vector<Row>& plan_rows() {
  static const std::vector<Row> rows = {
      {"FSDP 1-D, fp32", 1e-5, 1e-5, {"L1-03", "L2-01", "L3-02", "L3-04", "L3-05"}},
      {"FSDP 1-D, bf16", 1e-3, 1e-3, {"L1-10", "L1-11"}},
      {"HSDP 2-D, fp32", 1e-5, 1e-5, {"L1-02", "L3-01"}},
      {"TP + FSDP, fp32", 1e-5, 1e-5, {"TP-01"}},
      {"EP + FSDP, fp32", 1e-4, 1e-4, {"L2-10", "L3-03"}},
      {"AC + FSDP, fp32", 1e-5, 1e-5, {"L2-03", "L2-04", "L2-05"}},
      {"AC + swap + FSDP, fp32", 1e-5, 1e-5, {"L2-06"}},
      {"PP + FSDP, fp32", 1e-5, 1e-5, {"L2-09"}},
  };
  return rows;
}

int row_of(const Record& r) {
  if (!is_plan_record(r)) return -1;
  const auto& rows = plan_rows();
  for (size_t i = 0; i < rows.size(); ++i) {
    for (const auto& c : rows[i].cases) {
      if (c == r.plan_id) return static_cast<int>(i);
    }
  }
  return -1;
}

double required_tol(const Record& r, const Row& row) {
  double t = plan_tol(r);
  double row_tol = std::max(row.loss_tol, row.grad_norm_tol);
  if (is_loss_metric(r.metric)) row_tol = std::min(row_tol, row.loss_tol);
  if (is_grad_norm_metric(r.metric)) row_tol = std::min(row_tol, row.grad_norm_tol);
  return t > 0 ? std::min(t, row_tol) : row_tol;
}

}  // namespace report
