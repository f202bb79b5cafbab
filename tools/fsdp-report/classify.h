// Step 2 of fsdp-precision-report: the current run's records sorted by kind,
// the precision ones aggregated by matrix row (or, outside the matrix, by
// case and configuration), those looser than the plan, and what the header
// and the closing sections summarise.
#pragma once

#include "format.h"
#include "records.h"

#include <cstddef>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace report {

// Precision records aggregated (a matrix row, or one case and configuration).
struct Agg {
  size_t records = 0, failed = 0;
  double worst = 0;          // max observed (NaN counts as worst)
  double margin = kInf;      // min tol / observed
  bool nonfinite = false;
  std::set<std::string> cases;  // plan ids (or ids) observed
  std::set<std::string> configurations;
  std::set<std::string> executables;
  std::map<std::string, std::pair<bool, bool>> metrics;  // case -> (has loss, has grad norm)
  double tol_min = kInf, tol_max = 0;

  void add(const Record& r, const std::string& case_key);
  double worst_value() const { return nonfinite ? kInf : worst; }
  // "not run", "FAIL (<failed> of <records>)" or "pass".
  std::string status() const;
};

// A record's case: its plan id, else its case id.
std::string case_key(const Record& r);

struct Classified {
  std::vector<Agg> row_agg;        // one per plan row (plan_rows())
  std::vector<size_t> row_looser;  // per row: records looser than the plan
  std::map<std::pair<std::string, std::string>, Agg> other;  // (case, configuration)
  // By kind: precision (tolerance > 0), separation, exact (the rest),
  // expected-failure; in the input's order.
  std::vector<const Record*> precision, separation, exact, expected;
  std::vector<std::pair<const Record*, double>> looser;  // record, plan tolerance
  // (case, note) -> devices
  std::map<std::pair<std::string, std::string>, std::set<std::string>> stand_ins;
  std::set<std::string> devices;
  std::map<std::string, std::pair<size_t, std::string>> stale_files;  // file -> (records, run)
  size_t failing = 0;
};

// Sorts `in`'s records; the result points into `in`, which must outlive it.
Classified classify(const Input& in);

// The cases outside the matrix ((case, configuration) and their records),
// plan ids (L1-12) first, then by case and configuration.
using OtherCase = std::pair<std::pair<std::string, std::string>, const Agg*>;
std::vector<OtherCase> other_cases(const Classified& c);

}  // namespace report
