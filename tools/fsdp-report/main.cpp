// fsdp-precision-report: renders the test plan's precision self-consistency
// matrix from the JSON-lines records the SPMD suites write
// (spmd::record_precision, one <executable>_np<N>.jsonl per run under
// $FSDP_REPORT_DIR), and gates on it.
//
//   fsdp-precision-report --raw-dir DIR --out-md FILE --out-json FILE
//
// Steps: load the records of the current run (records.h, load.cpp), sort
// them by kind and matrix row (classify.h), check the gate (gate.h), render
// the markdown and the JSON (render.h: what the report shows).
//
// Only the current run counts: the CTest fixture precision_report_reset
// clears DIR and writes DIR/run-id; every record carries the run id it read
// there, and a record with another (or none) is stale: rejected.
// A record counts for a matrix case only when it comes from the plan case's
// own suite (test_fully_shard_lifecycle's "FSDP 1-D, fp32" records do not).
//
// Exit status: 0 when the gate holds: every matrix row "pass" (every plan
// case run, each with a loss and a grad-norm metric, nothing failing, no
// tolerance looser than the plan), no failing record of any kind, no stale
// record, no malformed line. 3 when it does not (the reasons on stderr);
// 1 when the raw dir is missing, holds no record or no run id; 2 on I/O errors.

#include "classify.h"
#include "gate.h"
#include "records.h"
#include "render.h"

#include <CLI/CLI.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>

namespace fs = std::filesystem;

namespace {

void write_file(const std::string& path, const std::string& text) {
  const fs::path p(path);
  if (p.has_parent_path()) fs::create_directories(p.parent_path());
  std::ofstream out(p, std::ios::trunc);
  out << text;
  out.close();
  if (!out) throw std::runtime_error("cannot write " + path);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Renders the precision self-consistency matrix from SPMD precision records"};
  std::string raw_dir, out_md, out_json;
  app.add_option("--raw-dir", raw_dir, "directory of <executable>_np<N>.jsonl records")->required();
  app.add_option("--out-md", out_md, "markdown output")->required();
  app.add_option("--out-json", out_json, "JSON output")->required();
  CLI11_PARSE(app, argc, argv);

  try {
    if (!fs::is_directory(raw_dir)) {
      std::cerr << "fsdp-precision-report: raw dir " << raw_dir
                << " does not exist: run the MPI tests first (ctest -L cpu), which write "
                   "their records there through FSDP_REPORT_DIR\n";
      return 1;
    }
    const report::Input in = report::read_raw(raw_dir);
    for (const auto& m : in.malformed) std::cerr << "fsdp-precision-report: skipped " << m << "\n";
    if (in.run.empty()) {
      std::cerr << "fsdp-precision-report: no run id in " << raw_dir
                << "/run-id: the CTest fixture precision_report_reset clears the raw dir and "
                   "writes it before the MPI tests run (ctest -L cpu); records without the "
                   "current run id are stale\n";
      return 1;
    }
    if (in.records.empty() && in.stale.empty()) {
      std::cerr << "fsdp-precision-report: no precision records in " << raw_dir << " ("
                << in.sources.size()
                << " .jsonl files): run the MPI tests first (ctest -L cpu), which write their "
                   "records there through FSDP_REPORT_DIR\n";
      return 1;
    }
    const report::Classified classified = report::classify(in);
    const report::Verdict verdict = report::check_gate(in, classified);
    const report::Report r{in, raw_dir, classified, verdict};
    write_file(out_md, report::render_markdown(r));
    write_file(out_json, report::render_json(r).dump(2) + "\n");
    std::cout << "precision matrix: " << out_md << "\n"
              << "precision matrix (json): " << out_json << "\n"
              << in.records.size() << " records from " << in.sources.size() << " files, "
              << classified.failing << " failing, " << in.stale.size() << " stale\n";
    if (!verdict.gate.empty()) {
      std::cerr << "fsdp-precision-report: the precision gate FAILS:\n";
      for (const auto& g : verdict.gate) std::cerr << "  " << g << "\n";
      return 3;
    }
    std::cout << "precision gate: pass\n";
  } catch (const std::exception& e) {
    std::cerr << "fsdp-precision-report: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
