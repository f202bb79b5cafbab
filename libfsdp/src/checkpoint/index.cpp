// index.json written and read (index.h).
#include "checkpoint/index.h"

#include "checkpoint/h5io.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace fsdp::dcp::detail {

using nlohmann::json;
using Kind = CheckpointError::Kind;

uint64_t fnv1a64(const void* data, size_t n, uint64_t h) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ULL;
  }
  return h;
}

namespace {

std::string hex64(uint64_t v) {
  char buf[19];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// "fnv1a64:<hex>" of the canonical text (no indentation, sorted keys)
// without the "checksum" field.
std::string checksum_of(json j) {
  j.erase("checksum");
  const std::string text = j.dump();
  return "fnv1a64:" + hex64(fnv1a64(text.data(), text.size())).substr(2);
}

}  // namespace

json value_json(const Value& v) {
  if (const auto* i = std::get_if<int64_t>(&v)) return {{"int64", *i}};
  if (const auto* d = std::get_if<double>(&v)) {
    uint64_t bits = 0;
    std::memcpy(&bits, d, sizeof bits);
    // The bits make it exact (NaN and infinities included); "value" is for people.
    json j = {{"float64_bits", hex64(bits)}};
    if (std::isfinite(*d)) j["value"] = *d;
    return j;
  }
  if (const auto* s = std::get_if<std::string>(&v)) return {{"string", *s}};
  return {{"tensor", true}};
}

Value value_from_json(const json& j, const std::string& name, const std::string& file) {
  if (j.contains("int64")) return j.at("int64").get<int64_t>();
  if (j.contains("float64_bits")) {
    const uint64_t bits = std::stoull(j.at("float64_bits").get<std::string>(), nullptr, 16);
    double d = 0;
    std::memcpy(&d, &bits, sizeof d);
    return d;
  }
  if (j.contains("string")) return j.at("string").get<std::string>();
  throw CheckpointError(Kind::Format, name, file, file + ": value '" + name + "' has no known type");
}

std::string index_text(const Index& index) {
  json j;
  j["format"] = kFormatName;
  j["version"] = index.version;
  j["step"] = index.step;
  j["world_size"] = index.world_size;
  j["created"] = index.created;
  j["libfsdp"] = index.libfsdp_version;
  json tensors = json::object();
  for (const auto& [name, t] : index.tensors) {
    json chunks = json::array();
    for (const auto& c : t.chunks) {
      chunks.push_back({{"file", c.file}, {"dataset", c.dataset}, {"offsets", c.offsets},
                        {"sizes", c.sizes}});
    }
    tensors[name] = {{"kind", t.kind}, {"dtype", dtype_name(t.dtype, name)},
                     {"shape", t.shape}, {"chunks", chunks}};
  }
  j["tensors"] = tensors;
  json values = json::object();
  for (const auto& [name, v] : index.values) values[name] = value_json(v);
  j["values"] = values;
  json rank_values = json::object();
  for (const auto& [name, per_rank] : index.rank_values) {
    json arr = json::array();
    for (const auto& v : per_rank) arr.push_back(v ? value_json(*v) : json(nullptr));
    rank_values[name] = arr;
  }
  j["rank_values"] = rank_values;
  j["optimizers"] = json::object();
  for (const auto& [prefix, o] : index.optimizers) j["optimizers"][prefix] = o;
  j["files"] = json::object();
  for (const auto& [file, bytes] : index.files) j["files"][file] = {{"bytes", bytes}};
  j["checksum"] = checksum_of(j);
  return j.dump(1);
}

Index parse_index(const std::string& text, const std::string& shown_as) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw CheckpointError(Kind::Corrupt, "", shown_as,
                          shown_as + " is not valid JSON (" + std::string(e.what()) + ")");
  }
  try {
    // The checksum first: a damaged "format" or "version" is damage (which
    // falls back), not another format.
    if (!j.is_object() || !j.contains("checksum")) {
      throw CheckpointError(Kind::Format, "", shown_as,
                            shown_as + " is not the index of a libfsdp distributed checkpoint");
    }
    if (j.value("checksum", "") != checksum_of(j)) {
      throw CheckpointError(Kind::Corrupt, "", shown_as,
                            shown_as + ": checksum mismatch (the index was modified or damaged)");
    }
    if (j.value("format", "") != kFormatName) {
      throw CheckpointError(Kind::Format, "", shown_as,
                            shown_as + " is not the index of a libfsdp distributed checkpoint");
    }
    Index index;
    index.version = j.at("version").get<int>();
    if (index.version > kFormatVersion || index.version < 1) {
      throw CheckpointError(Kind::Format, "", shown_as,
                            shown_as + " has format version " + std::to_string(index.version) +
                                "; this libfsdp reads versions 1 to " +
                                std::to_string(kFormatVersion));
    }
    index.step = j.at("step").get<int64_t>();
    index.world_size = j.at("world_size").get<int>();
    index.created = j.value("created", "");
    index.libfsdp_version = j.value("libfsdp", "");
    for (const auto& [name, t] : j.at("tensors").items()) {
      IndexTensor it;
      it.name = name;
      it.kind = t.at("kind").get<std::string>();
      it.dtype = dtype_of(t.at("dtype").get<std::string>(), name, shown_as);
      it.shape = t.at("shape").get<std::vector<int64_t>>();
      for (const auto& c : t.at("chunks")) {
        Reader::Chunk chunk;
        chunk.file = c.at("file").get<std::string>();
        chunk.dataset = c.at("dataset").get<std::string>();
        chunk.offsets = c.at("offsets").get<std::vector<int64_t>>();
        chunk.sizes = c.at("sizes").get<std::vector<int64_t>>();
        if (chunk.offsets.size() != it.shape.size() || chunk.sizes.size() != it.shape.size()) {
          throw CheckpointError(Kind::Corrupt, name, shown_as,
                                shown_as + ": a chunk of '" + name + "' has the wrong rank");
        }
        it.chunks.push_back(std::move(chunk));
      }
      index.tensors.emplace(name, std::move(it));
    }
    for (const auto& [name, v] : j.at("values").items()) {
      index.values.emplace(name, value_from_json(v, name, shown_as));
    }
    for (const auto& [name, arr] : j.at("rank_values").items()) {
      std::vector<std::optional<Value>> per_rank;
      for (const auto& v : arr) {
        per_rank.push_back(v.is_null() ? std::nullopt
                                       : std::optional<Value>(value_from_json(v, name, shown_as)));
      }
      index.rank_values.emplace(name, std::move(per_rank));
    }
    for (const auto& [prefix, o] : j.at("optimizers").items()) index.optimizers[prefix] = o;
    for (const auto& [file, f] : j.at("files").items()) {
      index.files[file] = f.at("bytes").get<int64_t>();
    }
    return index;
  } catch (const json::exception& e) {
    throw CheckpointError(Kind::Corrupt, "", shown_as,
                          shown_as + " lacks a field or has one of the wrong type (" +
                              std::string(e.what()) + ")");
  }
}

Index read_index(const std::string& dir) {
  const std::string path = dir + "/" + kIndexFile;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw CheckpointError(Kind::NotFound, "", path, path + " does not exist or cannot be read");
  }
  std::ostringstream text;
  text << in.rdbuf();
  return parse_index(text.str(), path);
}

}  // namespace fsdp::dcp::detail
