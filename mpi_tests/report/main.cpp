// fsdp-precision-report: renders the test plan's precision self-consistency
// matrix from the JSON-lines records the SPMD suites write
// (spmd::record_precision, one <executable>_np<N>.jsonl per run under
// $FSDP_REPORT_DIR), and gates on it.
//
//   fsdp-precision-report --raw-dir DIR --out-md FILE --out-json FILE
//
// Output (markdown and the same content as JSON), in a deterministic order:
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
  std::string case_id, metric, kind, configuration, note, test_case, executable, device, run;
  std::string plan_id;  // "L1-03" / "TP-01" when case_id starts with a plan id, else ""
  double tolerance = 0, observed = 0;
  bool pass = false;
  int np = 0;
  std::string source;  // file name
  size_t order = 0;    // position in the input, for a stable order
};

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

const std::vector<PlanCase>& plan_cases() {
  static const std::vector<PlanCase> cases = {
      {"L1-02", "test_fully_shard_module", {"test_set_requires_all_reduce"}, 1e-5,
       {{"replicas equal", 1e-6}}},  // "on: grads equal atol=1e-6"
      {"L1-03", "test_fully_shard_module", {"test_set_reduce_op_type"}, 1e-5, {}},
      {"L1-07", "test_hsdp_param", {"test_custom_shard_placement_fn"}, 1e-5, {}},
      // The plan's L1-08 checks are fusion vs no fusion at 1e-6; its runs'
      // comparisons with the single card (ours) have no plan tolerance.
      {"L1-08", "test_fully_shard_precision", {"test_comm_fusion_numerical_correctness"}, 0,
       {{"loss_fusion - loss_nofusion|fusion vs no-fusion", 1e-6}}},
      {"L1-10", "test_fully_shard_precision", {"test_mp_bf16_param_fp32_reduce"}, 1e-3, {}},
      {"L1-11", "test_fully_shard_precision", {"test_mp_bf16_all_bf16"}, 1e-3, {}},
      {"L1-13", "test_fully_shard_precision", {"test_mp_apply_grad_on_fp32_main_grad"}, 1e-5, {}},
      {"L2-01", "test_fully_shard_precision", {"test_gradient_accumulation"}, 1e-5, {}},
      {"L2-02", "test_fully_shard_precision", {"test_frozen_params_mixed_training"}, 1e-5, {}},
      {"L2-03", "test_fully_shard_with_ac", {"test_reentrant_ac_fsdp"}, 1e-5, {}},
      {"L2-04", "test_fully_shard_with_ac", {"test_nonreentrant_ac_fsdp"}, 1e-5, {}},
      {"L2-05", "test_fully_shard_with_ac", {"test_selective_ac_fsdp"}, 1e-5, {}},
      {"L2-06", "test_fully_shard_with_ac", {"test_ac_activation_swap_fsdp"}, 1e-5, {}},
      {"L2-07", "test_fully_shard_precision", {"test_grad_clip_with_dtensor_grads"}, 1e-5, {}},
      {"L2-09", "test_fully_shard_with_pp", {"test_pp_fsdp_coupling"}, 1e-5, {}},
      {"L2-10", "test_fully_shard_with_ep", {"test_ep_fsdp_coupling"}, 1e-4, {}},
      {"L3-01", "test_fully_shard_with_llm", {"test_llm_decoder_hsdp_vs_ddp"}, 1e-5, {}},
      {"L3-02", "test_fully_shard_with_llm", {"test_llm_decoder_fsdp_1d_vs_ddp"}, 1e-5, {}},
      {"L3-03", "test_fully_shard_with_llm", {"test_moe_llm_ep_fsdp_vs_ddp"}, 1e-4,
       {{"dense grad norm", 1e-5}}},  // "dense layers' grad norm atol=1e-5"
      {"L3-04", "test_fully_shard_with_vit", {"test_vit_fsdp_vs_ddp"}, 1e-5, {}},
      {"L3-05", "test_fully_shard_with_llm", {"test_chunked_ce_fsdp_vs_ddp"}, 1e-5,
       {{R"(sum\(per-chunk losses\))", 1e-6}}},  // "sum(per_chunk_losses) == total_loss atol=1e-6"
      {"L3-06", "test_fully_shard_with_vit", {"test_multimodal_deepstack_fsdp"}, 1e-5, {}},
      {"TP-01", "test_fully_shard_with_tp",
       {"test_tp_fsdp_dp2_tp2", "test_hsdp_tp_replicate2_shard1_tp2", "test_tp_fsdp_dp1_tp2"},
       1e-5, {}},
  };
  return cases;
}

const PlanCase* plan_case(const std::string& id) {
  for (const auto& c : plan_cases()) {
    if (c.id == id) return &c;
  }
  return nullptr;
}

// Whether a record is a record of its plan case: a plan id, from the case's suite.
bool is_plan_record(const Record& r) {
  const PlanCase* c = plan_case(r.plan_id);
  return c != nullptr && c->suite == r.executable;
}

// The plan's tolerance for this record's check, or 0 when the plan sets none.
double plan_tol(const Record& r) {
  const PlanCase* c = plan_case(r.plan_id);
  if (c == nullptr) return 0;
  for (const auto& k : c->checks) {
    if (std::regex_search(r.metric, std::regex(k.metric, std::regex::icase))) return k.tol;
  }
  return c->tol;
}

// A loss metric names a loss ("loss", "step 1 loss", "per-chunk losses"); a
// grad-norm metric a gradient norm ("global grad norm", "dense grad norm").
bool is_loss_metric(const std::string& metric) {
  static const std::regex re(R"(\bloss(es)?\b)", std::regex::icase);
  return std::regex_search(metric, re);
}
bool is_grad_norm_metric(const std::string& metric) {
  static const std::regex re(R"(\bgrad(ient)? norms?\b)", std::regex::icase);
  return std::regex_search(metric, re);
}

struct Row {
  std::string configuration;
  double loss_tol, grad_norm_tol;
  std::vector<std::string> cases;
};

// The test plan's "Precision self-consistency matrix" (../shared/TEST-PLAN.md).
const std::vector<Row>& plan_rows() {
  static const std::vector<Row> rows = {
      {"FSDP 1-D, fp32", 1e-5, 1e-5, {"L1-03", "L2-01", "L3-02", "L3-04", "L3-05"}},
      {"FSDP 1-D, bf16", 1e-3, 1e-3, {"L1-10", "L1-11"}},
      {"HSDP 2-D, fp32", 1e-5, 1e-5, {"L1-02", "L3-01"}},
      {"TP + FSDP, fp32", 1e-5, 1e-5, {"TP-01"}},
      {"EP + FSDP, fp32", 1e-4, 1e-4, {"L2-10", "L3-03"}},
      {"AC + FSDP, fp32", 1e-5, 1e-5, {"L2-03", "L2-04", "L2-05"}},
      {"AC + swap + FSDP, fp32", 1e-5, 1e-5, {"L2-06"}},
      {"PP + FSDP, fp32", 1e-5, 1e-5, {"L2-09"}},
  };
  return rows;
}

// Index of the matrix row a record belongs to, or -1 (other cases): the row
// of its plan id, when it comes from the plan case's suite. A record's
// "configuration" never places it in a row.
int row_of(const Record& r) {
  if (!is_plan_record(r)) return -1;
  const auto& rows = plan_rows();
  for (size_t i = 0; i < rows.size(); ++i) {
    for (const auto& c : rows[i].cases) {
      if (c == r.plan_id) return static_cast<int>(i);
    }
  }
  return -1;
}

// The tolerance a matrix record is held to: the plan's for its check, and
// never above its row's tolerance for the metric it is (loss, grad norm) or
// the row's larger one.
double required_tol(const Record& r, const Row& row) {
  double t = plan_tol(r);
  double row_tol = std::max(row.loss_tol, row.grad_norm_tol);
  if (is_loss_metric(r.metric)) row_tol = std::min(row_tol, row.loss_tol);
  if (is_grad_norm_metric(r.metric)) row_tol = std::min(row_tol, row.grad_norm_tol);
  return t > 0 ? std::min(t, row_tol) : row_tol;
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
  std::string run;                 // the current run id (DIR/run-id)
  std::vector<Record> records;     // of the current run
  std::vector<Record> skipped;     // test cases a precondition skipped (current run)
  std::vector<Record> stale;       // records of another run, or of none
  std::vector<std::pair<std::string, size_t>> sources;  // file, records
  std::vector<std::string> malformed;                   // "file:line: why"
};

Input read_raw(const fs::path& dir) {
  Input in;
  {
    std::ifstream is(dir / "run-id");
    std::getline(is, in.run);
  }
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.is_regular_file() && e.path().extension() == ".jsonl") files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  // The plan's ids (L1-03) and ours for cases the plan asks us to write (TP-01).
  static const std::regex plan_id(R"(^((?:L[0-9]+|TP)-[0-9]+)(\s|$))");
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
      const bool skip = j.is_object() && string_field(j, "kind") == "skipped";
      if (!j.is_object() || (skip ? !j.contains("test_case")
                                  : !j.contains("case_id") || !j.contains("observed"))) {
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
      r.run = string_field(j, "run");
      r.source = f.filename().string();
      r.order = in.records.size() + in.skipped.size() + in.stale.size();
      ++n;
      if (in.run.empty() || r.run != in.run) {
        in.stale.push_back(std::move(r));
      } else if (skip) {
        in.skipped.push_back(std::move(r));
      } else {
        in.records.push_back(std::move(r));
      }
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
  std::set<std::string> executables;
  std::map<std::string, std::pair<bool, bool>> metrics;  // case -> (has loss, has grad norm)
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
    executables.insert(r.executable);
    auto& has = metrics[case_key];
    has.first = has.first || is_loss_metric(r.metric);
    has.second = has.second || is_grad_norm_metric(r.metric);
    tol_min = std::min(tol_min, r.tolerance);
    tol_max = std::max(tol_max, r.tolerance);
  }
  double worst_value() const { return nonfinite ? kInf : worst; }
  std::string status() const {
    if (records == 0) return "not run";
    if (failed > 0) return "FAIL (" + std::to_string(failed) + " of " + std::to_string(records) + ")";
    return "pass";
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
  std::vector<std::string> gate;  // why the gate does not hold; empty: it holds
};

ordered_json record_json(const Record& r) {
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
                      {"device", r.device},
                      {"run", r.run},
                      {"file", r.source}};
}

// render's state: the run's records sorted by kind and by matrix row, then
// the markdown, the JSON and the gate's reasons written section by section,
// in the report's order.
struct Renderer {
  Renderer(const Input& input, const std::string& dir);

  // Records by kind; precision records by matrix row (else by case and
  // configuration, in `other`); those looser than the plan.
  void sort_records();
  void write_header();
  std::string skip_reason(const std::string& id) const;
  void write_matrix();
  void write_other_cases();
  void write_looser();
  void write_detail();
  void write_separation();
  void write_exact();
  void write_expected();
  void write_stand_ins();
  void write_skipped();
  void write_stale();
  void write_sources();
  // The verdict at the top of the markdown; the result.
  Rendered finish();

  const Input& in;
  const std::string& raw_dir;
  const std::vector<Row>& rows;
  std::vector<Agg> row_agg;
  std::vector<size_t> row_looser;
  std::map<std::pair<std::string, std::string>, Agg> other;  // (case, configuration)
  std::vector<const Record*> precision, separation, exact, expected;
  std::vector<std::pair<const Record*, double>> looser;  // record, plan tolerance
  std::map<std::pair<std::string, std::string>, std::set<std::string>> stand_ins;  // (case, note) -> devices
  size_t failing = 0;
  std::vector<std::string> gate;
  std::ostringstream md;
  ordered_json js;
};

Renderer::Renderer(const Input& input, const std::string& dir)
    : in(input),
      raw_dir(dir),
      rows(plan_rows()),
      row_agg(rows.size()),
      row_looser(rows.size(), 0) {}

void Renderer::sort_records() {
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
      const auto i = static_cast<size_t>(row);
      row_agg[i].add(r, case_key(r));
      const double want = required_tol(r, rows[i]);
      if (r.tolerance > want) {
        looser.emplace_back(&r, want);
        ++row_looser[i];
      }
    } else {
      // A plan case's records from its own suite keep the plan's tolerance
      // outside the matrix too.
      if (is_plan_record(r) && plan_tol(r) > 0 && r.tolerance > plan_tol(r)) {
        looser.emplace_back(&r, plan_tol(r));
      }
      other[{is_plan_record(r) || r.plan_id.empty() ? case_key(r) : r.case_id, r.configuration}]
          .add(r, case_key(r));
    }
  }
  for (const auto& r : in.records) failing += r.pass ? 0 : 1;
}

void Renderer::write_header() {
  md << "# Precision self-consistency matrix\n\n"
     << "Rendered by fsdp-precision-report from " << in.records.size() << " records of run `"
     << in.run << "` in " << in.sources.size() << " files under `" << raw_dir
     << "`: " << precision.size() << " precision, " << separation.size() << " separation, "
     << exact.size() << " exact, " << expected.size() << " expected-failure records; "
     << failing << " failing; " << in.skipped.size() << " skipped test cases; "
     << in.stale.size() << " stale records rejected.\n\n";
  // CUDA records are compared with CPU references at fp32 tolerances: the
  // harness turns TF32 off for them (mpi_tests/common/spmd.cpp).
  std::set<std::string> devices;
  for (const auto& r : in.records) devices.insert(r.device);
  const bool cuda = std::any_of(devices.begin(), devices.end(), [](const std::string& d) {
    return d.rfind("cuda", 0) == 0;
  });
  md << "Devices: ";
  for (auto it = devices.begin(); it != devices.end(); ++it) {
    md << (it == devices.begin() ? "" : ", ") << (it->empty() ? "unknown" : *it);
  }
  md << (cuda ? ". CUDA entries ran with TF32 off (cuBLAS matmuls and cuDNN convolutions), "
                "so their fp32 results meet the CPU references' tolerances by arithmetic, not "
                "by TF32 luck.\n\n"
              : ". (CUDA entries run with TF32 off for cuBLAS matmuls and cuDNN "
                "convolutions.)\n\n");
  js["raw_dir"] = raw_dir;
  js["devices"] = devices;
  js["tf32"] = "off for CUDA entries (cuBLAS and cuDNN)";
  js["run"] = in.run;
  js["summary"] = {{"records", in.records.size()},    {"files", in.sources.size()},
                   {"precision", precision.size()},  {"separation", separation.size()},
                   {"exact", exact.size()},          {"expected_failure", expected.size()},
                   {"failing", failing},             {"skipped", in.skipped.size()},
                   {"stale", in.stale.size()}};
}

// Why a plan case did not run: the skips of its test cases in its suite.
std::string Renderer::skip_reason(const std::string& id) const {
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

void Renderer::write_matrix() {
  md << "## Matrix (test plan)\n\n"
     << "| configuration | loss tol | grad norm tol | plan cases | cases observed | records | "
        "worst observed | tightest margin | status | not run | missing metrics |\n"
     << "|---|---|---|---|---|---|---|---|---|---|---|\n";
  js["matrix"] = ordered_json::array();
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& pr = rows[i];
    const Agg& a = row_agg[i];
    std::vector<std::string> observed, missing, missing_json, incomplete;
    for (const auto& c : pr.cases) {
      if (a.cases.count(c)) {
        observed.push_back(c);
        const auto& has = a.metrics.at(c);
        std::vector<std::string> lacks;
        if (!has.first) lacks.push_back("loss");
        if (!has.second) lacks.push_back("grad norm");
        if (!lacks.empty()) incomplete.push_back(c + ": no " + join(lacks, ", no "));
      } else {
        missing.push_back(c + skip_reason(c));
        missing_json.push_back(c);
      }
    }
    std::string status = a.status();
    if (a.records > 0 && a.failed == 0) {
      if (!missing.empty()) {
        status = "not run (" + std::to_string(missing.size()) + " of " +
                 std::to_string(pr.cases.size()) + " cases)";
      } else if (!incomplete.empty()) {
        status = "incomplete";
      } else if (row_looser[i] > 0) {
        status = "looser than plan (" + std::to_string(row_looser[i]) + ")";
      }
    }
    if (status != "pass") gate.push_back("matrix row \"" + pr.configuration + "\": " + status);
    md << "| " << pr.configuration << " | " << fmt_tol(pr.loss_tol) << " | "
       << fmt_tol(pr.grad_norm_tol) << " | " << cell(join(pr.cases, ", ")) << " | "
       << (observed.empty() ? "-" : cell(join(observed, ", "))) << " | " << a.records << " | "
       << (a.records ? fmt_obs(a.worst_value()) : "-") << " | "
       << (a.records ? margin_text(a) : "-") << " | " << status << " | "
       << (missing.empty() ? "-" : cell(join(missing, ", "))) << " | "
       << (incomplete.empty() ? "-" : cell(join(incomplete, "; "))) << " |\n";
    js["matrix"].push_back({{"configuration", pr.configuration},
                            {"loss_tol", pr.loss_tol},
                            {"grad_norm_tol", pr.grad_norm_tol},
                            {"plan_cases", pr.cases},
                            {"cases_observed", observed},
                            {"not_run", missing_json},
                            {"missing_metrics", incomplete},
                            {"records", a.records},
                            {"failed", a.failed},
                            {"looser_than_plan", row_looser[i]},
                            {"worst_observed", a.records ? json_number(a.worst_value()) : nullptr},
                            {"tightest_margin", a.records ? margin_json(a) : nullptr},
                            {"status", status}});
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
void Renderer::write_other_cases() {
  md << "## Other cases\n\n"
     << "Precision records of cases outside the matrix (not in the plan's table), and records "
        "of suites that are not a plan case's own (e.g. test_fully_shard_lifecycle): never "
        "counted in the matrix.\n\n"
     << "| case | configuration | suite | records | tolerance | worst observed | tightest "
        "margin | status |\n|---|---|---|---|---|---|---|---|\n";
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
    const std::vector<std::string> exes(a->executables.begin(), a->executables.end());
    md << "| " << cell(k.first) << " | " << (k.second.empty() ? "-" : cell(k.second)) << " | "
       << cell(join(exes, ", ")) << " | " << a->records << " | " << tol << " | "
       << fmt_obs(a->worst_value()) << " | " << margin_text(*a) << " | " << a->status()
       << " |\n";
    js["other_cases"].push_back({{"case", k.first},
                                 {"configuration", k.second},
                                 {"suites", exes},
                                 {"records", a->records},
                                 {"failed", a->failed},
                                 {"tol_min", a->tol_min},
                                 {"tol_max", a->tol_max},
                                 {"worst_observed", json_number(a->worst_value())},
                                 {"tightest_margin", margin_json(*a)},
                                 {"status", a->status()}});
  }
  if (others.empty()) md << "| - | - | - | 0 | - | - | - | - |\n";
  md << "\n";
}

// Looser than the plan (rule 2: no silent loosening), record by record.
void Renderer::write_looser() {
  js["looser_than_plan"] = ordered_json::array();
  md << "## Tolerances looser than the plan\n\n"
     << "Plan records (from the plan case's suite) whose tolerance exceeds the plan's for that "
        "check: a check-specific tolerance of the plan (e.g. L1-02's replicas equal at 1e-6, "
        "L3-03's dense grad norm at 1e-5, L3-05's chunk sum at 1e-6), else the case's, and for "
        "a matrix case never above its row's loss or grad-norm tolerance (plan rule 2: no "
        "silent loosening). Any entry fails the report.\n\n"
     << "| case | metric | tol | plan tol | observed | np |\n|---|---|---|---|---|---|\n";
  for (const auto& [r, want] : looser) {
    md << "| " << cell(r->case_id) << " | " << cell(r->metric) << " | " << fmt_tol(r->tolerance)
       << " | " << fmt_tol(want) << " | " << fmt_obs(r->observed) << " | " << r->np << " |\n";
    auto j = record_json(*r);
    j["plan_tolerance"] = want;
    js["looser_than_plan"].push_back(j);
    gate.push_back("looser than the plan: " + r->case_id + " \"" + r->metric + "\" at " +
                   fmt_tol(r->tolerance) + " (plan " + fmt_tol(want) + ")");
  }
  if (looser.empty()) md << "| - | - | - | - | - | - |\n";
  md << "\n";
}

// (b) per-record detail.
void Renderer::write_detail() {
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
}

void Renderer::write_separation() {
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
}

void Renderer::write_exact() {
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
}

void Renderer::write_expected() {
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
}

// (c) CPU stand-ins.
void Renderer::write_stand_ins() {
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
}

void Renderer::write_skipped() {
  md << "## Skipped test cases\n\n"
     << "Test cases a precondition skipped in this run (world size, device): a skip is never a "
        "pass; a plan case all of whose entries skipped it is \"not run\" above.\n\n";
  js["skipped"] = ordered_json::array();
  for (const auto& sk : in.skipped) {
    md << "- " << sk.executable << " np " << sk.np << " (" << sk.device << "): " << sk.test_case
       << ": " << sk.note << "\n";
    js["skipped"].push_back({{"test_case", sk.test_case},
                             {"executable", sk.executable},
                             {"np", sk.np},
                             {"device", sk.device},
                             {"reason", sk.note}});
  }
  if (in.skipped.empty()) md << "- none\n";
  md << "\n";
}

void Renderer::write_stale() {
  md << "## Stale records (rejected)\n\n"
     << "Records whose run id is not the current run's (`" << in.run
     << "`, from run-id in the raw dir): left by an earlier run, or written without the "
        "precision_report_reset fixture. Never rendered above; any fails the report.\n\n";
  js["stale"] = ordered_json::array();
  std::map<std::string, std::pair<size_t, std::string>> stale_files;  // file -> (n, run)
  for (const auto& r : in.stale) {
    auto& e = stale_files[r.source];
    ++e.first;
    e.second = r.run.empty() ? "(none)" : r.run;
  }
  for (const auto& [file, e] : stale_files) {
    md << "- " << file << ": " << e.first << " records of run " << e.second << "\n";
    js["stale"].push_back({{"file", file}, {"records", e.first}, {"run", e.second}});
    gate.push_back("stale records: " + file + " (" + std::to_string(e.first) + " records of run " +
                   e.second + ", current " + in.run + ")");
  }
  if (stale_files.empty()) md << "- none\n";
  md << "\n";
}

// The sources, the malformed lines, and the failing records' count in the gate.
void Renderer::write_sources() {
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
    gate.push_back(std::to_string(in.malformed.size()) + " malformed lines");
  }
  if (failing > 0) gate.push_back(std::to_string(failing) + " failing records");
}

Rendered Renderer::finish() {
  std::ostringstream head;
  head << "**Gate: " << (gate.empty() ? "PASS" : "FAIL") << "**";
  if (!gate.empty()) {
    head << "\n\n";
    for (const auto& g : gate) head << "- " << cell(g) << "\n";
  }
  head << "\n\n";
  std::string text = md.str();
  const auto first_section = text.find("## ");
  text.insert(first_section, head.str());
  js["gate"] = {{"pass", gate.empty()}, {"reasons", gate}};
  return {text, js, failing, gate};
}

Rendered render(const Input& in, const std::string& raw_dir) {
  Renderer r(in, raw_dir);
  r.sort_records();
  r.write_header();
  r.write_matrix();
  r.write_other_cases();
  r.write_looser();
  r.write_detail();
  r.write_separation();
  r.write_exact();
  r.write_expected();
  r.write_stand_ins();
  r.write_skipped();
  r.write_stale();
  r.write_sources();
  return r.finish();
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
    const Rendered r = render(in, raw_dir);
    write_file(out_md, r.md);
    write_file(out_json, r.json.dump(2) + "\n");
    std::cout << "precision matrix: " << out_md << "\n"
              << "precision matrix (json): " << out_json << "\n"
              << in.records.size() << " records from " << in.sources.size() << " files, "
              << r.failing << " failing, " << in.stale.size() << " stale\n";
    if (!r.gate.empty()) {
      std::cerr << "fsdp-precision-report: the precision gate FAILS:\n";
      for (const auto& g : r.gate) std::cerr << "  " << g << "\n";
      return 3;
    }
    std::cout << "precision gate: pass\n";
  } catch (const std::exception& e) {
    std::cerr << "fsdp-precision-report: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
