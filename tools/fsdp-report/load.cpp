// Step 1 of fsdp-precision-report: the records of the current run (records.h).
#include "records.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <regex>
#include <stdexcept>
#include <tuple>

namespace fs = std::filesystem;

namespace report {

namespace {

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

// The record a well-formed line holds (its source and order left to the caller).
Record parse_record(const nlohmann::json& j) {
  // The plan's ids (L1-03) and ours for cases the plan asks us to write (TP-01).
  static const std::regex plan_id(R"(^((?:L[0-9]+|TP)-[0-9]+)(\s|$))");
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
  return r;
}

// Reads one .jsonl file into `in`.
void read_file(const fs::path& f, Input& in) {
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
      in.malformed.push_back(f.filename().string() + ":" + std::to_string(lineno) + ": " +
                             e.what());
      continue;
    }
    const bool skip = j.is_object() && string_field(j, "kind") == "skipped";
    if (!j.is_object() || (skip ? !j.contains("test_case")
                                : !j.contains("case_id") || !j.contains("observed"))) {
      in.malformed.push_back(f.filename().string() + ":" + std::to_string(lineno) +
                             ": not a precision record");
      continue;
    }
    Record r = parse_record(j);
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

}  // namespace

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
  for (const auto& f : files) read_file(f, in);
  // Plan ids first (L1-.. < L2-.. < L3-..), then other ids alphabetically.
  std::stable_sort(in.records.begin(), in.records.end(), [](const Record& a, const Record& b) {
    return std::make_tuple(a.plan_id.empty(), a.case_id, a.metric, a.executable, a.np, a.device,
                           a.order) < std::make_tuple(b.plan_id.empty(), b.case_id, b.metric,
                                                      b.executable, b.np, b.device, b.order);
  });
  return in;
}

}  // namespace report
