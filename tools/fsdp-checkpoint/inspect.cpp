// inspect and verify.
#include "common.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <optional>

namespace fsdp_checkpoint {

namespace {

using nlohmann::json;
using nlohmann::ordered_json;

// A value as JSON: the number or string (non-finite doubles as "nan", "inf", "-inf").
ordered_json value_json(const fsdp::dcp::Value& v) {
  if (const auto* i = std::get_if<int64_t>(&v)) return *i;
  if (const auto* d = std::get_if<double>(&v)) {
    if (std::isfinite(*d)) return *d;
    return std::isnan(*d) ? "nan" : (*d > 0 ? "inf" : "-inf");
  }
  if (const auto* s = std::get_if<std::string>(&v)) return *s;
  return "<tensor>";
}

const char* value_type(const fsdp::dcp::Value& v) {
  if (std::holds_alternative<int64_t>(v)) return "int64";
  if (std::holds_alternative<double>(v)) return "double";
  if (std::holds_alternative<std::string>(v)) return "string";
  return "tensor";
}

std::string value_text(const fsdp::dcp::Value& v) {
  if (const auto* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  if (const auto* d = std::get_if<double>(&v)) return fmt::format("{}", *d);
  if (const auto* s = std::get_if<std::string>(&v)) return json(*s).dump();  // quoted, escaped
  return "<tensor>";
}

// A value as index.json stores it ({"int64": 1}, {"float64_bits": ..., "value": 0.5},
// {"string": "x"}) as the plain number or string.
ordered_json plain_value(const json& v) {
  if (v.contains("int64")) return v.at("int64");
  if (v.contains("float64_bits")) return v.contains("value") ? v.at("value") : v.at("float64_bits");
  if (v.contains("string")) return v.at("string");
  return v;
}

ordered_json plain_rank_values(const json& index) {
  ordered_json out = ordered_json::object();
  const json all = index.value("rank_values", json::object());  // (a named copy: items()
                                                                // refers to it)
  for (const auto& [name, per_rank] : all.items()) {
    ordered_json arr = ordered_json::array();
    for (const auto& v : per_rank) arr.push_back(plain_value(v));
    out[name] = arr;
  }
  return out;
}

// One optimizer group's options as "lr=0.01 betas=[0.9,0.999] ...".
std::string group_text(const json& g) {
  std::string out;
  for (const auto& [k, v] : g.items()) {
    if (!out.empty()) out += ' ';
    out += k + "=" + v.dump();
  }
  return out;
}

}  // namespace

int run_inspect(const std::string& dir, bool as_json) {
  const fsdp::dcp::Reader reader = open_reader(dir, "<dir>");
  // The fields Reader does not expose (version, created, libfsdp, files,
  // rank values) come from the index it verified.
  const json index = json::parse(reader.index_text());
  int64_t total_bytes = 0, total_pieces = 0;
  for (const auto& t : reader.tensors()) {
    total_bytes += tensor_bytes(t);
    total_pieces += static_cast<int64_t>(t.chunks.size());
  }

  if (as_json) {
    ordered_json out;
    out["path"] = reader.path();
    out["step"] = reader.step();
    out["world_size"] = reader.world_size();
    out["format"] = index.value("format", "");
    out["format_version"] = index.value("version", 0);
    out["libfsdp"] = index.value("libfsdp", "");
    out["created"] = index.value("created", "");
    ordered_json files = ordered_json::object();
    for (const auto& [f, v] : index.at("files").items()) files[f] = v.at("bytes");
    out["files"] = files;
    ordered_json optimizers = ordered_json::object();
    for (const auto& [prefix, text] : reader.optimizers()) {
      optimizers[prefix] = ordered_json::parse(text);
    }
    out["optimizers"] = optimizers;
    ordered_json values = ordered_json::object();
    for (const auto& [name, v] : reader.values()) values[name] = value_json(v);
    out["values"] = values;
    out["rank_values"] = plain_rank_values(index);  // name -> [rank 0's, rank 1's, ...]
    ordered_json tensors = ordered_json::array();
    for (const auto& t : reader.tensors()) {
      tensors.push_back({{"name", t.name},
                         {"kind", t.kind},
                         {"dtype", dtype_str(t.dtype)},
                         {"shape", t.shape},
                         {"pieces", t.chunks.size()},
                         {"bytes", tensor_bytes(t)}});
    }
    out["tensors"] = tensors;
    out["totals"] = {{"tensors", reader.tensors().size()},
                     {"pieces", total_pieces},
                     {"bytes", total_bytes}};
    std::cout << out.dump(2) << "\n";
    return kExitOk;
  }

  fmt::print("checkpoint  {}\n", reader.path());
  fmt::print("step        {}\n", reader.step());
  fmt::print("world size  {} (ranks that saved it)\n", reader.world_size());
  fmt::print("format      {} version {} (libfsdp {})\n", index.value("format", "?"),
             index.value("version", 0), index.value("libfsdp", "?"));
  fmt::print("created     {}\n", index.value("created", "?"));
  int64_t file_bytes = 0;
  for (const auto& [f, v] : index.at("files").items()) file_bytes += v.at("bytes").get<int64_t>();
  fmt::print("files       {} rank files, {} bytes ({})\n", index.at("files").size(), file_bytes,
             human_bytes(file_bytes));

  fmt::print("\noptimizers{}\n", reader.optimizers().empty() ? "  (none)" : "");
  for (const auto& [prefix, text] : reader.optimizers()) {
    const json o = json::parse(text);
    fmt::print("  {}: {} over '{}'\n", prefix, o.value("type", "?"), o.value("module", "?"));
    size_t g = 0;
    const json groups = o.value("param_groups", json::array());
    for (const auto& group : groups) {
      fmt::print("    group {}: {}\n", g++, group_text(group));
    }
  }

  fmt::print("\nvalues{}\n", reader.values().empty() ? "  (none)" : "");
  size_t width = 0;
  for (const auto& [name, v] : reader.values()) width = std::max(width, name.size());
  for (const auto& [name, v] : reader.values()) {
    fmt::print("  {:<{}}  {:<6}  {}\n", name, width, value_type(v), value_text(v));
  }
  const ordered_json rank_values = plain_rank_values(index);
  if (!rank_values.empty()) {
    fmt::print("rank-local values (rank 0, 1, ...)\n");
    for (const auto& [name, per_rank] : rank_values.items()) {
      fmt::print("  {}  {}\n", name, per_rank.dump());
    }
  }

  fmt::print("\ntensors\n");
  size_t wn = 4, wk = 4, wd = 5, ws = 5;
  for (const auto& t : reader.tensors()) {
    wn = std::max(wn, t.name.size());
    wk = std::max(wk, t.kind.size());
    wd = std::max(wd, dtype_str(t.dtype).size());
    ws = std::max(ws, shape_str(t.shape).size());
  }
  fmt::print("  {:<{}}  {:<{}}  {:<{}}  {:<{}}  {:>6}  {:>12}\n", "name", wn, "kind", wk, "dtype",
             wd, "shape", ws, "pieces", "bytes");
  for (const auto& t : reader.tensors()) {
    fmt::print("  {:<{}}  {:<{}}  {:<{}}  {:<{}}  {:>6}  {:>12}\n", t.name, wn, t.kind, wk,
               dtype_str(t.dtype), wd, shape_str(t.shape), ws, t.chunks.size(), tensor_bytes(t));
  }
  fmt::print("total: {} tensors, {} pieces, {} bytes ({})\n", reader.tensors().size(),
             total_pieces, total_bytes, human_bytes(total_bytes));
  return kExitOk;
}

int run_verify(const std::string& dir) {
  std::optional<fsdp::dcp::Reader> reader;
  try {
    reader.emplace(dir);
  } catch (const fsdp::dcp::CheckpointError& e) {
    // An index that fails its checksum is damage verify reports; no
    // checkpoint at all (or another format) is a usage error.
    if (e.kind() != fsdp::dcp::CheckpointError::Kind::Corrupt) {
      throw UsageError(fmt::format("<dir>: {}: {}", fsdp::dcp::to_string(e.kind()), e.what()));
    }
    fmt::print("{}\n", e.what());
    fmt::print("FAILED {}: the index does not verify\n", dir);
    return kExitFailed;
  }
  const auto problems = reader->verify();
  if (problems.empty()) {
    int64_t bytes = 0;
    for (const auto& t : reader->tensors()) bytes += tensor_bytes(t);
    fmt::print("OK {}: {} tensors, {} bytes verified\n", reader->path(), reader->tensors().size(),
               bytes);
    return kExitOk;
  }
  for (const auto& p : problems) fmt::print("{}\n", p);
  fmt::print("FAILED {}: {} problem{}\n", reader->path(), problems.size(),
             problems.size() == 1 ? "" : "s");
  return kExitFailed;
}

}  // namespace fsdp_checkpoint
