// Step 4b of fsdp-precision-report: the JSON report, the markdown's content
// in the same order (render.h).
#include "format.h"
#include "plan.h"
#include "render.h"

#include <cmath>

namespace report {

using nlohmann::ordered_json;

namespace {

ordered_json margin_json(const Agg& a) {
  if (a.nonfinite) return nullptr;
  return json_margin(a.margin);
}

ordered_json record_json(const Record& r) {
  return ordered_json{{"case_id", r.case_id},
                      {"metric", r.metric},
                      {"kind", r.kind},
                      {"tolerance", r.tolerance},
                      {"observed", json_number(r.observed)},
                      {"margin", r.kind == "separation"
                                     ? json_margin(separation_margin(r.tolerance, r.observed))
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

ordered_json records_json(const std::vector<const Record*>& records) {
  ordered_json out = ordered_json::array();
  for (const Record* r : records) out.push_back(record_json(*r));
  return out;
}

void add_header(ordered_json& js, const Report& rp) {
  const Input& in = rp.in;
  const Classified& c = rp.classified;
  js["raw_dir"] = rp.raw_dir;
  js["devices"] = c.devices;
  js["tf32"] = "off for CUDA entries (cuBLAS and cuDNN)";
  js["run"] = in.run;
  js["summary"] = {{"records", in.records.size()},      {"files", in.sources.size()},
                   {"precision", c.precision.size()},   {"separation", c.separation.size()},
                   {"exact", c.exact.size()},           {"expected_failure", c.expected.size()},
                   {"failing", c.failing},              {"skipped", in.skipped.size()},
                   {"stale", in.stale.size()}};
}

ordered_json matrix_json(const Report& rp) {
  ordered_json out = ordered_json::array();
  const auto& rows = plan_rows();
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& pr = rows[i];
    const Agg& a = rp.classified.row_agg[i];
    const RowVerdict& v = rp.verdict.rows[i];
    out.push_back({{"configuration", pr.configuration},
                   {"loss_tol", pr.loss_tol},
                   {"grad_norm_tol", pr.grad_norm_tol},
                   {"plan_cases", pr.cases},
                   {"cases_observed", v.observed},
                   {"not_run", v.missing_ids},
                   {"missing_metrics", v.incomplete},
                   {"records", a.records},
                   {"failed", a.failed},
                   {"looser_than_plan", rp.classified.row_looser[i]},
                   {"worst_observed", a.records ? json_number(a.worst_value()) : nullptr},
                   {"tightest_margin", a.records ? margin_json(a) : nullptr},
                   {"status", v.status}});
  }
  return out;
}

ordered_json other_cases_json(const Classified& c) {
  ordered_json out = ordered_json::array();
  for (const auto& [k, a] : other_cases(c)) {
    const std::vector<std::string> exes(a->executables.begin(), a->executables.end());
    out.push_back({{"case", k.first},
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
  return out;
}

ordered_json looser_json(const Classified& c) {
  ordered_json out = ordered_json::array();
  for (const auto& [r, want] : c.looser) {
    auto j = record_json(*r);
    j["plan_tolerance"] = want;
    out.push_back(j);
  }
  return out;
}

// CPU stand-ins, skipped test cases, stale records, the sources and the
// malformed lines.
void add_closing(ordered_json& js, const Report& rp) {
  const Input& in = rp.in;
  js["stand_ins"] = ordered_json::array();
  for (const auto& [k, devices] : rp.classified.stand_ins) {
    const std::vector<std::string> devs(devices.begin(), devices.end());
    js["stand_ins"].push_back({{"case", k.first}, {"note", k.second}, {"devices", devs}});
  }
  js["skipped"] = ordered_json::array();
  for (const auto& sk : in.skipped) {
    js["skipped"].push_back({{"test_case", sk.test_case},
                             {"executable", sk.executable},
                             {"np", sk.np},
                             {"device", sk.device},
                             {"reason", sk.note}});
  }
  js["stale"] = ordered_json::array();
  for (const auto& [file, e] : rp.classified.stale_files) {
    js["stale"].push_back({{"file", file}, {"records", e.first}, {"run", e.second}});
  }
  js["sources"] = ordered_json::array();
  for (const auto& [file, n] : in.sources) {
    js["sources"].push_back({{"file", file}, {"records", n}});
  }
  js["malformed"] = in.malformed;
}

}  // namespace

ordered_json render_json(const Report& rp) {
  const Classified& c = rp.classified;
  ordered_json js;
  add_header(js, rp);
  js["matrix"] = matrix_json(rp);
  js["other_cases"] = other_cases_json(c);
  js["looser_than_plan"] = looser_json(c);
  js["records"] = records_json(c.precision);
  js["separation"] = records_json(c.separation);
  js["exact"] = records_json(c.exact);
  js["expected_failures"] = records_json(c.expected);
  add_closing(js, rp);
  js["gate"] = {{"pass", rp.verdict.gate.empty()}, {"reasons", rp.verdict.gate}};
  return js;
}

}  // namespace report
