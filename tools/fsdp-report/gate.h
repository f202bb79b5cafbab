// Step 3 of fsdp-precision-report: the verdict of each matrix row and the
// gate. The gate holds when every matrix row is "pass" (every plan case run,
// each with a loss and a grad-norm metric, nothing failing, no tolerance
// looser than the plan), no tolerance anywhere is looser than the plan's, and
// there is no stale record, no malformed line and no failing record of any
// kind.
#pragma once

#include "classify.h"
#include "records.h"

#include <string>
#include <vector>

namespace report {

struct RowVerdict {
  std::vector<std::string> observed;     // plan cases with records
  std::vector<std::string> missing;      // plan cases without, with the skips' reasons
  std::vector<std::string> missing_ids;  // the same, ids only
  std::vector<std::string> incomplete;   // "L1-03: no loss, no grad norm"
  // "pass", "FAIL (1 of 2)", "not run", "not run (4 of 5 cases)",
  // "incomplete" or "looser than plan (<n>)".
  std::string status;
};

struct Verdict {
  std::vector<RowVerdict> rows;   // one per plan row (plan_rows())
  std::vector<std::string> gate;  // why the gate does not hold; empty: it holds
};

Verdict check_gate(const Input& in, const Classified& c);

}  // namespace report
