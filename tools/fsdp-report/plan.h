// The test plan's precision cases and its "Precision self-consistency matrix"
// (../shared/TEST-PLAN.md), and the tolerance each record is held to.
#pragma once

#include "records.h"

#include <string>
#include <vector>

namespace report {

// A check of a plan case with a tolerance of its own, tighter than the
// case's: records whose metric matches `metric` (a regex) are held to `tol`.
struct CheckTol {
  std::string metric;
  double tol;
};

// One case of the test plan with a tolerance (../shared/TEST-PLAN.md): the
// suite that implements it (records from any other executable are not plan
// records), its test cases (a skip of one of them is the case's "not run"
// reason), the plan's tolerance for its checks (0: none but the
// check-specific ones) and check-specific ones.
struct PlanCase {
  std::string id, suite;
  std::vector<std::string> test_cases;
  double tol;
  std::vector<CheckTol> checks;
};

// One row of the plan's matrix: its configuration, its tolerances for a loss
// and a grad-norm metric, and the plan cases that feed it.
struct Row {
  std::string configuration;
  double loss_tol, grad_norm_tol;
  std::vector<std::string> cases;
};

const std::vector<PlanCase>& plan_cases();
// The plan case `id` ("L1-03"), or nullptr.
const PlanCase* plan_case(const std::string& id);
// Whether a record is a record of its plan case: a plan id, from the case's suite.
bool is_plan_record(const Record& r);
// The plan's tolerance for this record's check, or 0 when the plan sets none.
double plan_tol(const Record& r);

// A loss metric names a loss ("loss", "step 1 loss", "per-chunk losses"); a
// grad-norm metric a gradient norm ("global grad norm", "dense grad norm").
bool is_loss_metric(const std::string& metric);
bool is_grad_norm_metric(const std::string& metric);

// The matrix's rows, in the report's order.
const std::vector<Row>& plan_rows();
// Index of the matrix row a record belongs to, or -1 (other cases): the row
// of its plan id, when it comes from the plan case's suite. A record's
// "configuration" never places it in a row.
int row_of(const Record& r);
// The tolerance a matrix record is held to: the plan's for its check, and
// never above its row's tolerance for the metric it is (loss, grad norm) or
// the row's larger one.
double required_tol(const Record& r, const Row& row);

}  // namespace report
