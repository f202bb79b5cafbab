// Step 4 of fsdp-precision-report: the report as markdown and as JSON, the
// same content in the same deterministic order:
//  - a header (counts, devices) and the gate's verdict with its reasons;
//  - the plan's matrix: one row per configuration with its plan tolerances,
//    the plan cases observed and those with no record ("not run", with the
//    reason when the harness recorded a skip), plan cases lacking a loss or a
//    grad-norm metric, the worst observed error, the tightest margin
//    (tolerance / observed) and a status;
//  - every other case (ids not in the matrix, and records of suites that are
//    not the plan case's suite), one row each;
//  - records whose tolerance is looser than the plan's tolerance for that
//    check (the case's own tolerance or a check-specific one, else the row's);
//  - per-record detail of the precision records;
//  - separation checks (observed must EXCEED the threshold) and exact checks;
//  - expected failures: plan checks that miss their tolerance by construction
//    on this configuration, with the gap and the reason (never a pass);
//  - test cases skipped by a precondition; CPU stand-ins (record notes);
//  - records rejected as not from the current run; the files read.
#pragma once

#include "classify.h"
#include "gate.h"
#include "records.h"

#include <nlohmann/json.hpp>

#include <string>

namespace report {

// What the report shows: the run's records, where they were read, how they
// sort and the verdicts.
struct Report {
  const Input& in;
  const std::string& raw_dir;
  const Classified& classified;
  const Verdict& verdict;
};

std::string render_markdown(const Report& r);
nlohmann::ordered_json render_json(const Report& r);

}  // namespace report
