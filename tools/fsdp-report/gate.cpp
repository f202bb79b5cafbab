// Step 3 of fsdp-precision-report: the matrix rows' verdicts and the gate (gate.h).
#include "gate.h"

#include "format.h"
#include "plan.h"

#include <algorithm>
#include <set>

namespace report {

namespace {

// Why a plan case did not run: the skips of its test cases in its suite.
std::string skip_reason(const Input& in, const std::string& id) {
  const PlanCase* c = plan_case(id);
  std::set<std::string> reasons;
  if (c != nullptr) {
    for (const auto& sk : in.skipped) {
      if (sk.executable == c->suite &&
          std::find(c->test_cases.begin(), c->test_cases.end(), sk.test_case) !=
              c->test_cases.end()) {
        reasons.insert("np " + std::to_string(sk.np) + ": " + sk.note);
      }
    }
  }
  return reasons.empty() ? std::string()
                         : " (skipped: " + join({reasons.begin(), reasons.end()}, "; ") + ")";
}

RowVerdict check_row(const Input& in, const Row& row, const Agg& a, size_t looser) {
  RowVerdict v;
  for (const auto& c : row.cases) {
    if (a.cases.count(c)) {
      v.observed.push_back(c);
      const auto& has = a.metrics.at(c);
      std::vector<std::string> lacks;
      if (!has.first) lacks.push_back("loss");
      if (!has.second) lacks.push_back("grad norm");
      if (!lacks.empty()) v.incomplete.push_back(c + ": no " + join(lacks, ", no "));
    } else {
      v.missing.push_back(c + skip_reason(in, c));
      v.missing_ids.push_back(c);
    }
  }
  v.status = a.status();
  if (a.records > 0 && a.failed == 0) {
    if (!v.missing.empty()) {
      v.status = "not run (" + std::to_string(v.missing.size()) + " of " +
                 std::to_string(row.cases.size()) + " cases)";
    } else if (!v.incomplete.empty()) {
      v.status = "incomplete";
    } else if (looser > 0) {
      v.status = "looser than plan (" + std::to_string(looser) + ")";
    }
  }
  return v;
}

}  // namespace

Verdict check_gate(const Input& in, const Classified& c) {
  Verdict v;
  const auto& rows = plan_rows();
  for (size_t i = 0; i < rows.size(); ++i) {
    v.rows.push_back(check_row(in, rows[i], c.row_agg[i], c.row_looser[i]));
    const std::string& status = v.rows.back().status;
    if (status != "pass") {
      v.gate.push_back("matrix row \"" + rows[i].configuration + "\": " + status);
    }
  }
  for (const auto& [r, want] : c.looser) {
    v.gate.push_back("looser than the plan: " + r->case_id + " \"" + r->metric + "\" at " +
                     fmt_tol(r->tolerance) + " (plan " + fmt_tol(want) + ")");
  }
  for (const auto& [file, e] : c.stale_files) {
    v.gate.push_back("stale records: " + file + " (" + std::to_string(e.first) +
                     " records of run " + e.second + ", current " + in.run + ")");
  }
  if (!in.malformed.empty()) {
    v.gate.push_back(std::to_string(in.malformed.size()) + " malformed lines");
  }
  if (c.failing > 0) v.gate.push_back(std::to_string(c.failing) + " failing records");
  return v;
}

}  // namespace report
