// fsdp-precision-report's input: the precision records of one test run, as
// the SPMD suites write them (spmd::record_precision, one
// <executable>_np<N>.jsonl per run under $FSDP_REPORT_DIR).
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace report {

struct Record {
  std::string case_id, metric, kind, configuration, note, test_case, executable, device, run;
  std::string plan_id;  // "L1-03" / "TP-01" when case_id starts with a plan id, else ""
  double tolerance = 0, observed = 0;
  bool pass = false;
  int np = 0;
  std::string source;  // file name
  size_t order = 0;    // position in the input, for a stable order
};

struct Input {
  std::string run;                 // the current run id (DIR/run-id)
  std::vector<Record> records;     // of the current run
  std::vector<Record> skipped;     // test cases a precondition skipped (current run)
  std::vector<Record> stale;       // records of another run, or of none
  std::vector<std::pair<std::string, size_t>> sources;  // file, records
  std::vector<std::string> malformed;                   // "file:line: why"
};

// Step 1: every *.jsonl record under `dir` (in file-name order) and the
// current run id from dir/run-id. A record whose run id is not the current
// one (or when there is none) is stale; a line that is not JSON, or not a
// precision or skip record, is malformed. The current run's records are
// sorted plan ids first (L1-.. < L2-.. < L3-..), then other ids
// alphabetically. Throws std::runtime_error when a file cannot be read.
Input read_raw(const std::filesystem::path& dir);

}  // namespace report
