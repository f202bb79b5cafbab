// Step 2 of fsdp-precision-report: the records sorted and aggregated (classify.h).
#include "classify.h"

#include "plan.h"

#include <algorithm>
#include <cmath>
#include <regex>
#include <tuple>

namespace report {

void Agg::add(const Record& r, const std::string& case_key) {
  ++records;
  if (!r.pass) ++failed;
  if (!std::isfinite(r.observed)) nonfinite = true;
  if (std::isfinite(r.observed) && r.observed > worst) worst = r.observed;
  const double m = margin_of(r.tolerance, r.observed);
  if (std::isnan(m) || m < margin) margin = std::isnan(m) ? 0 : m;
  cases.insert(case_key);
  if (!r.configuration.empty()) configurations.insert(r.configuration);
  executables.insert(r.executable);
  auto& has = metrics[case_key];
  has.first = has.first || is_loss_metric(r.metric);
  has.second = has.second || is_grad_norm_metric(r.metric);
  tol_min = std::min(tol_min, r.tolerance);
  tol_max = std::max(tol_max, r.tolerance);
}

std::string Agg::status() const {
  if (records == 0) return "not run";
  if (failed > 0) return "FAIL (" + std::to_string(failed) + " of " + std::to_string(records) + ")";
  return "pass";
}

std::string case_key(const Record& r) { return r.plan_id.empty() ? r.case_id : r.plan_id; }

namespace {

// A precision record into its matrix row, or into `other`; noted when looser
// than the plan.
void add_precision(const Record& r, Classified& c) {
  const auto& rows = plan_rows();
  c.precision.push_back(&r);
  const int row = row_of(r);
  if (row >= 0) {
    const auto i = static_cast<size_t>(row);
    c.row_agg[i].add(r, case_key(r));
    const double want = required_tol(r, rows[i]);
    if (r.tolerance > want) {
      c.looser.emplace_back(&r, want);
      ++c.row_looser[i];
    }
  } else {
    // A plan case's records from its own suite keep the plan's tolerance
    // outside the matrix too.
    if (is_plan_record(r) && plan_tol(r) > 0 && r.tolerance > plan_tol(r)) {
      c.looser.emplace_back(&r, plan_tol(r));
    }
    c.other[{is_plan_record(r) || r.plan_id.empty() ? case_key(r) : r.case_id, r.configuration}]
        .add(r, case_key(r));
  }
}

}  // namespace

Classified classify(const Input& in) {
  Classified c;
  c.row_agg.resize(plan_rows().size());
  c.row_looser.assign(plan_rows().size(), 0);
  for (const auto& r : in.records) {
    if (!r.note.empty()) c.stand_ins[{case_key(r), r.note}].insert(r.device);
    if (r.kind == "separation") {
      c.separation.push_back(&r);
    } else if (r.kind == "expected-failure") {
      c.expected.push_back(&r);
    } else if (r.kind != "precision" || !(r.tolerance > 0)) {
      c.exact.push_back(&r);
    } else {
      add_precision(r, c);
    }
  }
  for (const auto& r : in.records) {
    c.failing += r.pass ? 0 : 1;
    c.devices.insert(r.device);
  }
  for (const auto& r : in.stale) {
    auto& e = c.stale_files[r.source];
    ++e.first;
    e.second = r.run.empty() ? "(none)" : r.run;
  }
  return c;
}

std::vector<OtherCase> other_cases(const Classified& c) {
  std::vector<OtherCase> others;
  for (const auto& [k, a] : c.other) others.emplace_back(k, &a);
  std::stable_sort(others.begin(), others.end(), [](const auto& x, const auto& y) {
    const bool xp = std::regex_search(x.first.first, std::regex("^L[0-9]+-[0-9]+$"));
    const bool yp = std::regex_search(y.first.first, std::regex("^L[0-9]+-[0-9]+$"));
    return std::make_tuple(!xp, x.first) < std::make_tuple(!yp, y.first);
  });
  return others;
}

}  // namespace report
