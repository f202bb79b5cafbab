// Step 4a of fsdp-precision-report: the markdown report (render.h).
#include "format.h"
#include "plan.h"
#include "render.h"

#include <algorithm>
#include <sstream>

namespace report {

namespace {

std::string margin_text(const Agg& a) {
  if (a.nonfinite) return "n/a";
  return fmt_margin(a.margin);
}

// The header, then the gate's verdict (above the first section).
void write_header(std::ostream& md, const Report& rp) {
  const Input& in = rp.in;
  const Classified& c = rp.classified;
  md << "# Precision self-consistency matrix\n\n"
     << "Rendered by fsdp-precision-report from " << in.records.size() << " records of run `"
     << in.run << "` in " << in.sources.size() << " files under `" << rp.raw_dir
     << "`: " << c.precision.size() << " precision, " << c.separation.size() << " separation, "
     << c.exact.size() << " exact, " << c.expected.size() << " expected-failure records; "
     << c.failing << " failing; " << in.skipped.size() << " skipped test cases; "
     << in.stale.size() << " stale records rejected.\n\n";
  // CUDA records are compared with CPU references at fp32 tolerances: the
  // harness turns TF32 off for them (mpi_tests/common/spmd.cpp).
  const bool cuda = std::any_of(c.devices.begin(), c.devices.end(), [](const std::string& d) {
    return d.rfind("cuda", 0) == 0;
  });
  md << "Devices: ";
  for (auto it = c.devices.begin(); it != c.devices.end(); ++it) {
    md << (it == c.devices.begin() ? "" : ", ") << (it->empty() ? "unknown" : *it);
  }
  md << (cuda ? ". CUDA entries ran with TF32 off (cuBLAS matmuls and cuDNN convolutions), "
                "so their fp32 results meet the CPU references' tolerances by arithmetic, not "
                "by TF32 luck.\n\n"
              : ". (CUDA entries run with TF32 off for cuBLAS matmuls and cuDNN "
                "convolutions.)\n\n");
  const auto& gate = rp.verdict.gate;
  md << "**Gate: " << (gate.empty() ? "PASS" : "FAIL") << "**";
  if (!gate.empty()) {
    md << "\n\n";
    for (const auto& g : gate) md << "- " << cell(g) << "\n";
  }
  md << "\n\n";
}

void write_matrix(std::ostream& md, const Report& rp) {
  md << "## Matrix (test plan)\n\n"
     << "| configuration | loss tol | grad norm tol | plan cases | cases observed | records | "
        "worst observed | tightest margin | status | not run | missing metrics |\n"
     << "|---|---|---|---|---|---|---|---|---|---|---|\n";
  const auto& rows = plan_rows();
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& pr = rows[i];
    const Agg& a = rp.classified.row_agg[i];
    const RowVerdict& v = rp.verdict.rows[i];
    md << "| " << pr.configuration << " | " << fmt_tol(pr.loss_tol) << " | "
       << fmt_tol(pr.grad_norm_tol) << " | " << cell(join(pr.cases, ", ")) << " | "
       << (v.observed.empty() ? "-" : cell(join(v.observed, ", "))) << " | " << a.records
       << " | " << (a.records ? fmt_obs(a.worst_value()) : "-") << " | "
       << (a.records ? margin_text(a) : "-") << " | " << v.status << " | "
       << (v.missing.empty() ? "-" : cell(join(v.missing, ", "))) << " | "
       << (v.incomplete.empty() ? "-" : cell(join(v.incomplete, "; "))) << " |\n";
  }
  md << "\nOnly precision records of the current run count here (tolerance > 0; pass = "
        "observed <= tolerance), and only from the plan case's own suite; observed is the max "
        "abs error over ranks, worst over the row's records. "
        "A record belongs to the row of its plan id (a variant such as \"L2-01 HSDP (2,1)\" "
        "counts for L2-01). "
        "Margin = tolerance / observed (the record's own tolerance), the smallest over the row; "
        "\"exact\" when every observed error is 0, \"n/a\" when one is not finite. "
        "\"not run\" lists the plan cases with no record in this run (with the harness's reason "
        "when a precondition skipped them): not built, not registered, not run, skipped or "
        "reporting nothing. \"missing metrics\": a plan case needs at least one loss metric (a "
        "metric named with \"loss\") and one grad-norm metric (named with \"grad norm\"), each "
        "against its single-card or DDP baseline. "
        "Status \"pass\" only when every plan case ran with both metrics, no record failed and "
        "no tolerance is looser than the plan's for its check; anything else fails the "
        "report.\n\n";
}

// Records outside the matrix, by case and configuration.
void write_other_cases(std::ostream& md, const Report& rp) {
  md << "## Other cases\n\n"
     << "Precision records of cases outside the matrix (not in the plan's table), and records "
        "of suites that are not a plan case's own (e.g. test_fully_shard_lifecycle): never "
        "counted in the matrix.\n\n"
     << "| case | configuration | suite | records | tolerance | worst observed | tightest "
        "margin | status |\n|---|---|---|---|---|---|---|---|\n";
  const auto others = other_cases(rp.classified);
  for (const auto& [k, a] : others) {
    const std::string tol = a->tol_min == a->tol_max
                                ? fmt_tol(a->tol_min)
                                : fmt_tol(a->tol_min) + " .. " + fmt_tol(a->tol_max);
    const std::vector<std::string> exes(a->executables.begin(), a->executables.end());
    md << "| " << cell(k.first) << " | " << (k.second.empty() ? "-" : cell(k.second)) << " | "
       << cell(join(exes, ", ")) << " | " << a->records << " | " << tol << " | "
       << fmt_obs(a->worst_value()) << " | " << margin_text(*a) << " | " << a->status()
       << " |\n";
  }
  if (others.empty()) md << "| - | - | - | 0 | - | - | - | - |\n";
  md << "\n";
}

// Looser than the plan (rule 2: no silent loosening), record by record.
void write_looser(std::ostream& md, const Report& rp) {
  md << "## Tolerances looser than the plan\n\n"
     << "Plan records (from the plan case's suite) whose tolerance exceeds the plan's for that "
        "check: a check-specific tolerance of the plan (e.g. L1-02's replicas equal at 1e-6, "
        "L3-03's dense grad norm at 1e-5, L3-05's chunk sum at 1e-6), else the case's, and for "
        "a matrix case never above its row's loss or grad-norm tolerance (plan rule 2: no "
        "silent loosening). Any entry fails the report.\n\n"
     << "| case | metric | tol | plan tol | observed | np |\n|---|---|---|---|---|---|\n";
  for (const auto& [r, want] : rp.classified.looser) {
    md << "| " << cell(r->case_id) << " | " << cell(r->metric) << " | " << fmt_tol(r->tolerance)
       << " | " << fmt_tol(want) << " | " << fmt_obs(r->observed) << " | " << r->np << " |\n";
  }
  if (rp.classified.looser.empty()) md << "| - | - | - | - | - | - |\n";
  md << "\n";
}

// Per-record detail of the precision records.
void write_detail(std::ostream& md, const Report& rp) {
  md << "## Per-case detail\n\n"
     << "| case | metric | tol | observed | margin | pass | np | device | note |\n"
     << "|---|---|---|---|---|---|---|---|---|\n";
  for (const Record* r : rp.classified.precision) {
    md << "| " << cell(r->case_id) << " | " << cell(r->metric) << " | " << fmt_tol(r->tolerance)
       << " | " << fmt_obs(r->observed) << " | " << fmt_margin(margin_of(r->tolerance, r->observed))
       << " | " << (r->pass ? "pass" : "**FAIL**") << " | " << r->np << " | " << cell(r->device)
       << " | " << (r->note.empty() ? "" : cell(r->note)) << " |\n";
  }
  md << "\n";
}

void write_separation(std::ostream& md, const Report& rp) {
  md << "## Separation checks\n\n"
     << "Checks that two things DIFFER (e.g. unsynchronised replicas): observed is the smallest "
        "gap over ranks and must exceed the threshold; margin = observed / threshold, so > 1x "
        "passes. Not part of the matrix.\n\n"
     << "| case | metric | must exceed | observed | margin | pass | np | device |\n"
     << "|---|---|---|---|---|---|---|---|\n";
  for (const Record* r : rp.classified.separation) {
    md << "| " << cell(r->case_id) << " | " << cell(r->metric) << " | " << fmt_tol(r->tolerance)
       << " | " << fmt_obs(r->observed) << " | "
       << fmt_margin(separation_margin(r->tolerance, r->observed)) << " | "
       << (r->pass ? "pass" : "**FAIL**") << " | " << r->np << " | " << cell(r->device) << " |\n";
  }
  if (rp.classified.separation.empty()) md << "| - | - | - | - | - | - | - | - |\n";
  md << "\n";
}

void write_exact(std::ostream& md, const Report& rp) {
  md << "## Exact checks\n\n"
     << "Checks with tolerance 0 (bitwise equality required). Not part of the matrix.\n\n"
     << "| case | metric | observed | pass | np | device |\n|---|---|---|---|---|---|\n";
  for (const Record* r : rp.classified.exact) {
    md << "| " << cell(r->case_id) << " | " << cell(r->metric) << " | " << fmt_obs(r->observed)
       << " | " << (r->pass ? "pass" : "**FAIL**") << " | " << r->np << " | " << cell(r->device)
       << " |\n";
  }
  if (rp.classified.exact.empty()) md << "| - | - | - | - | - | - |\n";
  md << "\n";
}

void write_expected(std::ostream& md, const Report& rp) {
  md << "## Expected failures\n\n"
     << "Plan checks that miss their tolerance by construction on this configuration (e.g. a "
        "CPU stand-in computing in bf16 where the plan compares against fp32). Never counted "
        "as passes; not part of the matrix. An unexpected pass (observed within tolerance) "
        "means the reason no longer holds: make it a precision check.\n\n"
     << "| case | metric | tol | observed | status | reason | np | device |\n"
     << "|---|---|---|---|---|---|---|---|\n";
  for (const Record* r : rp.classified.expected) {
    md << "| " << cell(r->case_id) << " | " << cell(r->metric) << " | " << fmt_tol(r->tolerance)
       << " | " << fmt_obs(r->observed) << " | "
       << (r->pass ? "expected failure" : "**unexpected pass**") << " | " << cell(r->note)
       << " | " << r->np << " | " << cell(r->device) << " |\n";
  }
  if (rp.classified.expected.empty()) md << "| - | - | - | - | - | - | - | - |\n";
  md << "\n";
}

// CPU stand-ins, skipped test cases, stale records and the sources.
void write_closing(std::ostream& md, const Report& rp) {
  const Input& in = rp.in;
  md << "## CPU stand-ins\n\n"
     << "Substitutions and limits noted by the cases (record notes).\n\n";
  for (const auto& [k, devices] : rp.classified.stand_ins) {
    const std::vector<std::string> devs(devices.begin(), devices.end());
    md << "- " << k.first << " (" << join(devs, ", ") << "): " << k.second << "\n";
  }
  if (rp.classified.stand_ins.empty()) md << "- none\n";
  md << "\n## Skipped test cases\n\n"
     << "Test cases a precondition skipped in this run (world size, device): a skip is never a "
        "pass; a plan case all of whose entries skipped it is \"not run\" above.\n\n";
  for (const auto& sk : in.skipped) {
    md << "- " << sk.executable << " np " << sk.np << " (" << sk.device << "): " << sk.test_case
       << ": " << sk.note << "\n";
  }
  if (in.skipped.empty()) md << "- none\n";
  md << "\n## Stale records (rejected)\n\n"
     << "Records whose run id is not the current run's (`" << in.run
     << "`, from run-id in the raw dir): left by an earlier run, or written without the "
        "precision_report_reset fixture. Never rendered above; any fails the report.\n\n";
  for (const auto& [file, e] : rp.classified.stale_files) {
    md << "- " << file << ": " << e.first << " records of run " << e.second << "\n";
  }
  if (rp.classified.stale_files.empty()) md << "- none\n";
  md << "\n## Sources\n\n";
  for (const auto& [file, n] : in.sources) md << "- " << file << ": " << n << " records\n";
  if (!in.malformed.empty()) {
    md << "\nSkipped malformed lines:\n\n";
    for (const auto& m : in.malformed) md << "- " << cell(m) << "\n";
  }
}

}  // namespace

std::string render_markdown(const Report& rp) {
  std::ostringstream md;
  write_header(md, rp);
  write_matrix(md, rp);
  write_other_cases(md, rp);
  write_looser(md, rp);
  write_detail(md, rp);
  write_separation(md, rp);
  write_exact(md, rp);
  write_expected(md, rp);
  write_closing(md, rp);
  return md.str();
}

}  // namespace report
