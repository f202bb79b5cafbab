// fsdp-precision-report: renders the test plan's precision self-consistency
// matrix from the JSON-lines records the SPMD suites write
// (spmd::record_precision, one <executable>_np<N>.jsonl per run under
// $FSDP_REPORT_DIR).
//
//   fsdp-precision-report --raw-dir DIR --out-md FILE --out-json FILE
//
// Output (markdown and the same content as JSON), in a deterministic order:
//  - the plan's matrix: one row per configuration with its plan tolerances,
//    the plan cases observed and those with no record ("not run"), the worst
//    observed error, the tightest margin (tolerance / observed) and a status;
//  - every other case (ids not in the matrix), one row each;
//  - records whose tolerance is looser than their matrix row's plan tolerance;
//  - per-record detail of the precision records;
//  - separation checks (observed must EXCEED the threshold) and exact checks;
//  - expected failures: plan checks that miss their tolerance by construction
//    on this configuration, with the gap and the reason (never a pass);
//  - CPU stand-ins (record notes) and the files read.
// Exits 1 when the raw dir is missing or holds no record; 2 on I/O errors.
// Failing records do not change the exit status (their own tests fail).

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace fs = std::filesystem;
using nlohmann::ordered_json;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Record {
  std::string case_id, metric, kind, configuration, note, test_case, executable, device;
  std::string plan_id;  // "L1-03" / "TP-01" when case_id starts with a plan id, else ""
  double tolerance = 0, observed = 0;
  bool pass = false;
  int np = 0;
  std::string source;  // file name
  size_t order = 0;    // position in the input, for a stable order
};

struct Row {
  std::string configuration;
  double loss_tol, grad_norm_tol;
  std::vector<std::string> cases;
  std::string unwritten;  // plan text for a case that does not exist yet
};

// The test plan's "Precision self-consistency matrix" (../shared/TEST-PLAN.md).
const std::vector<Row>& plan_rows() {
  static const std::vector<Row> rows = {
      {"FSDP 1-D, fp32", 1e-5, 1e-5, {"L1-03", "L2-01", "L3-02", "L3-04", "L3-05"}, ""},
      {"FSDP 1-D, bf16", 1e-3, 1e-3, {"L1-10", "L1-11"}, ""},
      {"HSDP 2-D, fp32", 1e-5, 1e-5, {"L1-02", "L3-01"}, ""},
      {"TP + FSDP, fp32", 1e-5, 1e-5, {"TP-01"}, ""},
      {"EP + FSDP, fp32", 1e-4, 1e-4, {"L2-10", "L3-03"}, ""},
      {"AC + FSDP, fp32", 1e-5, 1e-5, {"L2-03", "L2-04", "L2-05"}, ""},
      {"AC + swap + FSDP, fp32", 1e-5, 1e-5, {"L2-06"}, ""},
      {"PP + FSDP, fp32", 1e-5, 1e-5, {"L2-09"}, ""},
  };
  return rows;
}

// "FSDP 1-D, fp32" and "fsdp 1-d fp32" name the same row.
std::string normalize(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == ' ' || c == ',' || c == '_') continue;
    out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  return out;
}

// Index of the matrix row a record belongs to, or -1 (other cases).
int row_of(const Record& r) {
  const auto& rows = plan_rows();
  if (!r.configuration.empty()) {
    for (size_t i = 0; i < rows.size(); ++i) {
      if (normalize(rows[i].configuration) == normalize(r.configuration)) return static_cast<int>(i);
    }
    return -1;
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    for (const auto& c : rows[i].cases) {
      if (c == r.plan_id) return static_cast<int>(i);
    }
  }
  return -1;
}

// ---- formatting -----------------------------------------------------------

// printf with the exponent shortened: 1.000e-05 -> 1.000e-5, 1e+05 -> 1e5.
std::string fmt(const char* spec, double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, spec, v);
  std::string s = buf;
  const auto e = s.find('e');
  if (e == std::string::npos) return s;
  std::string mant = s.substr(0, e), exp = s.substr(e + 1);
  std::string sign;
  if (!exp.empty() && (exp[0] == '+' || exp[0] == '-')) {
    if (exp[0] == '-') sign = "-";
    exp = exp.substr(1);
  }
  while (exp.size() > 1 && exp[0] == '0') exp = exp.substr(1);
  return mant + "e" + sign + exp;
}
// Tolerances in the plan's style: 1e-5, 2.5e-3.
std::string fmt_tol(double v) {
  if (v == 0 || !std::isfinite(v)) return fmt("%g", v);
  std::string s = fmt("%.2e", v);
  const auto e = s.find('e');
  std::string mant = s.substr(0, e);
  while (mant.find('.') != std::string::npos && (mant.back() == '0' || mant.back() == '.')) {
    mant.pop_back();
  }
  return mant + s.substr(e);
}
std::string fmt_obs(double v) { return v == 0 ? "0" : fmt("%.3e", v); }

// tolerance / observed; +inf when observed is 0 ("exact"); NaN when observed is not finite.
double margin_of(double tol, double observed) {
  if (!std::isfinite(observed)) return std::numeric_limits<double>::quiet_NaN();
  if (observed <= 0) return kInf;
  return tol / observed;
}
std::string fmt_margin(double m) {
  if (std::isnan(m)) return "n/a";
  if (std::isinf(m)) return "exact";
  return fmt("%.3g", m) + "x";
}
ordered_json json_number(double v) {
  if (std::isfinite(v)) return v;
  if (std::isnan(v)) return "nan";
  return v > 0 ? "inf" : "-inf";
}
ordered_json json_margin(double m) {
  if (std::isinf(m)) return "exact";
  if (std::isnan(m)) return nullptr;
  return m;
}

// Markdown table cell: no pipes or newlines.
std::string cell(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '|') {
      out += "\\|";
    } else if (c == '\n' || c == '\r') {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out;
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

// ---- reading ---------------------------------------------------------------

double number_field(const nlohmann::json& j, const char* key) {
  if (!j.contains(key)) return std::numeric_limits<double>::quiet_NaN();
  const auto& v = j.at(key);
  if (v.is_number()) return v.get<double>();
  if (v.is_string()) return std::strtod(v.get<std::string>().c_str(), nullptr);  // "inf", "nan"
  return std::numeric_limits<double>::quiet_NaN();  // null: not finite
}
std::string string_field(const nlohmann::json& j, const char* key) {
  return j.contains(key) && j.at(key).is_string() ? j.at(key).get<std::string>() : std::string();
}

struct Input {
  std::vector<Record> records;
  std::vector<std::pair<std::string, size_t>> sources;  // file, records
  std::vector<std::string> malformed;                   // "file:line: why"
};

Input read_raw(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.is_regular_file() && e.path().extension() == ".jsonl") files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  // The plan's ids (L1-03) and ours for cases the plan asks us to write (TP-01).
  static const std::regex plan_id(R"(^((?:L[0-9]+|TP)-[0-9]+)(\s|$))");
  Input in;
  for (const auto& f : files) {
    std::ifstream is(f);
    if (!is) throw std::runtime_error("cannot read " + f.string());
    std::string line;
    size_t n = 0, lineno = 0;
    while (std::getline(is, line)) {
      ++lineno;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const std::exception& e) {
        in.malformed.push_back(f.filename().string() + ":" + std::to_string(lineno) + ": " + e.what());
        continue;
      }
      if (!j.is_object() || !j.contains("case_id") || !j.contains("observed")) {
        in.malformed.push_back(f.filename().string() + ":" + std::to_string(lineno) +
                               ": not a precision record");
        continue;
      }
      Record r;
      r.case_id = string_field(j, "case_id");
      r.metric = string_field(j, "metric");
      r.tolerance = number_field(j, "tolerance");
      r.observed = number_field(j, "observed");
      r.kind = string_field(j, "kind");
      if (r.kind.empty()) r.kind = r.tolerance > 0 ? "precision" : "exact";
      r.pass = j.contains("pass") && j.at("pass").is_boolean() && j.at("pass").get<bool>();
      r.configuration = string_field(j, "configuration");
      r.note = string_field(j, "note");
      r.test_case = string_field(j, "test_case");
      r.executable = string_field(j, "executable");
      r.device = string_field(j, "device");
      r.np = j.contains("np") && j.at("np").is_number_integer() ? j.at("np").get<int>() : 0;
      std::smatch m;
      if (std::regex_search(r.case_id, m, plan_id)) r.plan_id = m[1];
      r.source = f.filename().string();
      r.order = in.records.size();
      in.records.push_back(std::move(r));
      ++n;
    }
    in.sources.emplace_back(f.filename().string(), n);
  }
  // Plan ids first (L1-.. < L2-.. < L3-..), then other ids alphabetically.
  std::stable_sort(in.records.begin(), in.records.end(), [](const Record& a, const Record& b) {
    return std::make_tuple(a.plan_id.empty(), a.case_id, a.metric, a.executable, a.np, a.device,
                           a.order) < std::make_tuple(b.plan_id.empty(), b.case_id, b.metric,
                                                      b.executable, b.np, b.device, b.order);
  });
  return in;
}

// ---- aggregation -----------------------------------------------------------

struct Agg {
  size_t records = 0, failed = 0;
  double worst = 0;          // max observed (NaN counts as worst)
  double margin = kInf;      // min tol / observed
  bool nonfinite = false;
  std::set<std::string> cases;  // plan ids (or ids) observed
  std::set<std::string> configurations;
  double tol_min = kInf, tol_max = 0;
  void add(const Record& r, const std::string& case_key) {
    ++records;
    if (!r.pass) ++failed;
    if (!std::isfinite(r.observed)) nonfinite = true;
    if (std::isfinite(r.observed) && r.observed > worst) worst = r.observed;
    const double m = margin_of(r.tolerance, r.observed);
    if (std::isnan(m) || m < margin) margin = std::isnan(m) ? 0 : m;
    cases.insert(case_key);
    if (!r.configuration.empty()) configurations.insert(r.configuration);
    tol_min = std::min(tol_min, r.tolerance);
    tol_max = std::max(tol_max, r.tolerance);
  }
  double worst_value() const { return nonfinite ? kInf : worst; }
  std::string status(bool complete) const {
    if (records == 0) return "not run";
    if (failed > 0) return "FAIL (" + std::to_string(failed) + " of " + std::to_string(records) + ")";
    return complete ? "pass" : "pass (partial)";
  }
};

std::string margin_text(const Agg& a) {
  if (a.nonfinite) return "n/a";
  return fmt_margin(a.margin);
}
ordered_json margin_json(const Agg& a) {
  if (a.nonfinite) return nullptr;
  return json_margin(a.margin);
}

std::string case_key(const Record& r) { return r.plan_id.empty() ? r.case_id : r.plan_id; }

// ---- rendering ----------------------------------------------------------------

struct Rendered {
  std::string md;
  ordered_json json;
  size_t failing = 0;
};

Rendered render(const Input& in, const std::string& raw_dir) {
  const auto& rows = plan_rows();
  std::vector<Agg> row_agg(rows.size());
  std::map<std::pair<std::string, std::string>, Agg> other;  // (case, configuration)
  std::vector<const Record*> precision, separation, exact, expected, looser;
  std::map<std::pair<std::string, std::string>, std::set<std::string>> stand_ins;  // (case, note) -> devices
  for (const auto& r : in.records) {
    if (!r.note.empty()) stand_ins[{case_key(r), r.note}].insert(r.device);
    if (r.kind == "separation") {
      separation.push_back(&r);
      continue;
    }
    if (r.kind == "expected-failure") {
      expected.push_back(&r);
      continue;
    }
    if (r.kind != "precision" || !(r.tolerance > 0)) {
      exact.push_back(&r);
      continue;
    }
    precision.push_back(&r);
    const int row = row_of(r);
    if (row >= 0) {
      row_agg[static_cast<size_t>(row)].add(r, case_key(r));
      const Row& pr = rows[static_cast<size_t>(row)];
      if (r.tolerance > std::max(pr.loss_tol, pr.grad_norm_tol)) looser.push_back(&r);
    } else {
      other[{case_key(r), r.configuration}].add(r, case_key(r));
    }
  }

  size_t failing = 0;
  for (const auto& r : in.records) failing += r.pass ? 0 : 1;

  std::ostringstream md;
  ordered_json js;
  md << "# Precision self-consistency matrix\n\n"
     << "Rendered by fsdp-precision-report from " << in.records.size() << " records in "
     << in.sources.size() << " files under `" << raw_dir << "`: " << precision.size()
     << " precision, " << separation.size() << " separation, " << exact.size() << " exact, "
     << expected.size() << " expected-failure records; " << failing << " failing.\n\n";
  js["raw_dir"] = raw_dir;
  js["summary"] = {{"records", in.records.size()},    {"files", in.sources.size()},
                   {"precision", precision.size()},  {"separation", separation.size()},
                   {"exact", exact.size()},          {"expected_failure", expected.size()},
                   {"failing", failing}};

  // (a) the plan's matrix.
  md << "## Matrix (test plan)\n\n"
     << "| configuration | loss tol | grad norm tol | plan cases | cases observed | records | "
        "worst observed | tightest margin | status | not run |\n"
     << "|---|---|---|---|---|---|---|---|---|---|\n";
  js["matrix"] = ordered_json::array();
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& pr = rows[i];
    const Agg& a = row_agg[i];
    std::vector<std::string> plan_cases = pr.cases, observed, missing;
    if (plan_cases.empty()) plan_cases.push_back(pr.unwritten);
    for (const auto& c : pr.cases) (a.cases.count(c) ? observed : missing).push_back(c);
    for (const auto& c : a.cases) {
      if (std::find(pr.cases.begin(), pr.cases.end(), c) == pr.cases.end()) observed.push_back(c);
    }
    if (pr.cases.empty() && a.records == 0) missing.push_back(pr.unwritten);
    const bool complete = missing.empty();
    md << "| " << pr.configuration << " | " << fmt_tol(pr.loss_tol) << " | "
       << fmt_tol(pr.grad_norm_tol) << " | " << cell(join(plan_cases, ", ")) << " | "
       << (observed.empty() ? "-" : cell(join(observed, ", "))) << " | " << a.records << " | "
       << (a.records ? fmt_obs(a.worst_value()) : "-") << " | "
       << (a.records ? margin_text(a) : "-") << " | " << a.status(complete) << " | "
       << (missing.empty() ? "-" : cell(join(missing, ", "))) << " |\n";
    js["matrix"].push_back({{"configuration", pr.configuration},
                            {"loss_tol", pr.loss_tol},
                            {"grad_norm_tol", pr.grad_norm_tol},
                            {"plan_cases", plan_cases},
                            {"cases_observed", observed},
                            {"not_run", missing},
                            {"records", a.records},
                            {"failed", a.failed},
                            {"worst_observed", a.records ? json_number(a.worst_value()) : nullptr},
                            {"tightest_margin", a.records ? margin_json(a) : nullptr},
                            {"status", a.status(complete)}});
  }
  md << "\nOnly precision records count here (tolerance > 0; pass = observed <= tolerance); "
        "observed is the max abs error over ranks, worst over the row's records. "
        "A record belongs to the row of its plan id (a variant such as \"L2-01 HSDP (2,1)\" "
        "counts for L2-01) unless it names its configuration. "
        "Margin = tolerance / observed (the record's own tolerance), the smallest over the row; "
        "\"exact\" when every observed error is 0, \"n/a\" when one is not finite. "
        "\"not run\" lists the plan cases with no record in the raw files: not built, not "
        "registered, not run in this build, or reporting nothing. "
        "Status: \"pass (partial)\" when some plan cases are not run.\n\n";

  // Other cases.
  md << "## Other cases\n\n"
     << "Precision records of cases outside the matrix (not in the plan's table).\n\n"
     << "| case | configuration | records | tolerance | worst observed | tightest margin | "
        "status |\n|---|---|---|---|---|---|---|\n";
  js["other_cases"] = ordered_json::array();
  std::vector<std::pair<std::pair<std::string, std::string>, const Agg*>> others;
  for (const auto& [k, a] : other) others.emplace_back(k, &a);
  std::stable_sort(others.begin(), others.end(), [](const auto& x, const auto& y) {
    const bool xp = std::regex_search(x.first.first, std::regex("^L[0-9]+-[0-9]+$"));
    const bool yp = std::regex_search(y.first.first, std::regex("^L[0-9]+-[0-9]+$"));
    return std::make_tuple(!xp, x.first) < std::make_tuple(!yp, y.first);
  });
  for (const auto& [k, a] : others) {
    const std::string tol = a->tol_min == a->tol_max
                                ? fmt_tol(a->tol_min)
                                : fmt_tol(a->tol_min) + " .. " + fmt_tol(a->tol_max);
    md << "| " << cell(k.first) << " | " << (k.second.empty() ? "-" : cell(k.second)) << " | "
       << a->records << " | " << tol << " | " << fmt_obs(a->worst_value()) << " | "
       << margin_text(*a) << " | " << a->status(true) << " |\n";
    js["other_cases"].push_back({{"case", k.first},
                                 {"configuration", k.second},
                                 {"records", a->records},
                                 {"failed", a->failed},
                                 {"tol_min", a->tol_min},
                                 {"tol_max", a->tol_max},
                                 {"worst_observed", json_number(a->worst_value())},
                                 {"tightest_margin", margin_json(*a)},
                                 {"status", a->status(true)}});
  }
  if (others.empty()) md << "| - | - | 0 | - | - | - | - |\n";
  md << "\n";

  auto record_json = [](const Record& r) {
    return ordered_json{{"case_id", r.case_id},
                        {"metric", r.metric},
                        {"kind", r.kind},
                        {"tolerance", r.tolerance},
                        {"observed", json_number(r.observed)},
                        {"margin", r.kind == "separation"
                                       ? json_margin(r.tolerance > 0 && std::isfinite(r.observed)
                                                         ? r.observed / r.tolerance
                                                         : std::numeric_limits<double>::quiet_NaN())
                                       : json_margin(margin_of(r.tolerance, r.observed))},
                        {"pass", r.pass},
                        {"configuration", r.configuration},
                        {"note", r.note},
                        {"test_case", r.test_case},
                        {"executable", r.executable},
                        {"np", r.np},
                        {"device", r.device}};
  };

  // Looser than the plan (rule 2: no silent loosening).
  js["looser_than_plan"] = ordered_json::array();
  if (!looser.empty()) {
    md << "## Tolerances looser than the plan\n\n"
       << "Matrix records whose tolerance exceeds their row's plan tolerance (plan rule 2: no "
          "silent loosening).\n\n| case | metric | tol | plan tol | observed |\n|---|---|---|---|---|\n";
    for (const Record* r : looser) {
      const Row& pr = rows[static_cast<size_t>(row_of(*r))];
      md << "| " << cell(r->case_id) << " | " << cell(r->metric) << " | " << fmt_tol(r->tolerance)
         << " | " << fmt_tol(std::max(pr.loss_tol, pr.grad_norm_tol)) << " | "
         << fmt_obs(r->observed) << " |\n";
      js["looser_than_plan"].push_back(record_json(*r));
    }
    md << "\n";
  }

  // (b) per-record detail.
  md << "## Per-case detail\n\n"
     << "| case | metric | tol | observed | margin | pass | np | device | note |\n"
     << "|---|---|---|---|---|---|---|---|---|\n";
  js["records"] = ordered_json::array();
  for (const Record* r : precision) {
    md << "| " << cell(r->case_id) << " | " << cell(r->metric) << " | " << fmt_tol(r->tolerance)
       << " | " << fmt_obs(r->observed) << " | " << fmt_margin(margin_of(r->tolerance, r->observed))
       << " | " << (r->pass ? "pass" : "**FAIL**") << " | " << r->np << " | " << cell(r->device)
       << " | " << (r->note.empty() ? "" : cell(r->note)) << " |\n";
    js["records"].push_back(record_json(*r));
  }
  md << "\n";

  md << "## Separation checks\n\n"
     << "Checks that two things DIFFER (e.g. unsynchronised replicas): observed is the smallest "
        "gap over ranks and must exceed the threshold; margin = observed / threshold, so > 1x "
        "passes. Not part of the matrix.\n\n"
     << "| case | metric | must exceed | observed | margin | pass | np | device |\n"
     << "|---|---|---|---|---|---|---|---|\n";
  js["separation"] = ordered_json::array();
  for (const Record* r : separation) {
    const double m = r->tolerance > 0 && std::isfinite(r->observed)
                         ? r->observed / r->tolerance
                         : std::numeric_limits<double>::quiet_NaN();
    md << "| " << cell(r->case_id) << " | " << cell(r->metric) << " | " << fmt_tol(r->tolerance)
       << " | " << fmt_obs(r->observed) << " | " << fmt_margin(m) << " | "
       << (r->pass ? "pass" : "**FAIL**") << " | " << r->np << " | " << cell(r->device) << " |\n";
    js["separation"].push_back(record_json(*r));
  }
  if (separation.empty()) md << "| - | - | - | - | - | - | - | - |\n";
  md << "\n";

  md << "## Exact checks\n\n"
     << "Checks with tolerance 0 (bitwise equality required). Not part of the matrix.\n\n"
     << "| case | metric | observed | pass | np | device |\n|---|---|---|---|---|---|\n";
  js["exact"] = ordered_json::array();
  for (const Record* r : exact) {
    md << "| " << cell(r->case_id) << " | " << cell(r->metric) << " | " << fmt_obs(r->observed)
       << " | " << (r->pass ? "pass" : "**FAIL**") << " | " << r->np << " | " << cell(r->device)
       << " |\n";
    js["exact"].push_back(record_json(*r));
  }
  if (exact.empty()) md << "| - | - | - | - | - | - |\n";
  md << "\n";

  md << "## Expected failures\n\n"
     << "Plan checks that miss their tolerance by construction on this configuration (e.g. a "
        "CPU stand-in computing in bf16 where the plan compares against fp32). Never counted "
        "as passes; not part of the matrix. An unexpected pass (observed within tolerance) "
        "means the reason no longer holds: make it a precision check.\n\n"
     << "| case | metric | tol | observed | status | reason | np | device |\n"
     << "|---|---|---|---|---|---|---|---|\n";
  js["expected_failures"] = ordered_json::array();
  for (const Record* r : expected) {
    md << "| " << cell(r->case_id) << " | " << cell(r->metric) << " | " << fmt_tol(r->tolerance)
       << " | " << fmt_obs(r->observed) << " | "
       << (r->pass ? "expected failure" : "**unexpected pass**") << " | " << cell(r->note)
       << " | " << r->np << " | " << cell(r->device) << " |\n";
    js["expected_failures"].push_back(record_json(*r));
  }
  if (expected.empty()) md << "| - | - | - | - | - | - | - | - |\n";
  md << "\n";

  // (c) CPU stand-ins.
  md << "## CPU stand-ins\n\n"
     << "Substitutions and limits noted by the cases (record notes).\n\n";
  js["stand_ins"] = ordered_json::array();
  for (const auto& [k, devices] : stand_ins) {
    const std::vector<std::string> devs(devices.begin(), devices.end());
    md << "- " << k.first << " (" << join(devs, ", ") << "): " << k.second << "\n";
    js["stand_ins"].push_back({{"case", k.first}, {"note", k.second}, {"devices", devs}});
  }
  if (stand_ins.empty()) md << "- none\n";
  md << "\n";

  md << "## Sources\n\n";
  js["sources"] = ordered_json::array();
  for (const auto& [file, n] : in.sources) {
    md << "- " << file << ": " << n << " records\n";
    js["sources"].push_back({{"file", file}, {"records", n}});
  }
  js["malformed"] = in.malformed;
  if (!in.malformed.empty()) {
    md << "\nSkipped malformed lines:\n\n";
    for (const auto& m : in.malformed) md << "- " << cell(m) << "\n";
  }
  return {md.str(), js, failing};
}

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
    const Input in = read_raw(raw_dir);
    for (const auto& m : in.malformed) std::cerr << "fsdp-precision-report: skipped " << m << "\n";
    if (in.records.empty()) {
      std::cerr << "fsdp-precision-report: no precision records in " << raw_dir << " ("
                << in.sources.size()
                << " .jsonl files): run the MPI tests first (ctest -L cpu), which write their "
                   "records there through FSDP_REPORT_DIR\n";
      return 1;
    }
    const Rendered r = render(in, raw_dir);
    write_file(out_md, r.md);
    write_file(out_json, r.json.dump(2) + "\n");
    std::cout << "precision matrix: " << out_md << "\n"
              << "precision matrix (json): " << out_json << "\n"
              << in.records.size() << " records from " << in.sources.size() << " files, "
              << r.failing << " failing\n";
  } catch (const std::exception& e) {
    std::cerr << "fsdp-precision-report: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
