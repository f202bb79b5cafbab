// index.json written and read (index.h).
#include "checkpoint/index.h"

#include "checkpoint/files.h"
#include "checkpoint/h5io.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>

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

// An integer of the index: JSON floats (2^80 is one) and values past int64
// are damage, never converted.
int64_t whole(const json& v, const std::string& what, const std::string& shown_as) {
  if (!v.is_number_integer() ||
      (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))) {
    throw CheckpointError(Kind::Corrupt, "", shown_as,
                          shown_as + ": " + what + " is " + v.dump() + ", not an int64");
  }
  return v.get<int64_t>();
}

std::vector<int64_t> wholes(const json& v, const std::string& what, const std::string& shown_as) {
  if (!v.is_array()) {
    throw CheckpointError(Kind::Corrupt, "", shown_as, shown_as + ": " + what + " is not a list");
  }
  std::vector<int64_t> out;
  for (const auto& x : v) out.push_back(whole(x, what, shown_as));
  return out;
}

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
  if (!j.is_object()) {
    throw CheckpointError(Kind::Corrupt, name, file, file + ": value '" + name + "' is not an object");
  }
  if (j.contains("int64")) return whole(j.at("int64"), "value '" + name + "'", file);
  if (j.contains("float64_bits")) {
    const std::string text = j.at("float64_bits").get<std::string>();
    uint64_t bits = 0;
    char* end = nullptr;
    errno = 0;
    bits = std::strtoull(text.c_str(), &end, 16);
    if (text.size() != 18 || text.compare(0, 2, "0x") != 0 || *end != '\0' || errno != 0) {
      throw CheckpointError(Kind::Corrupt, name, file,
                            file + ": value '" + name + "' has float64_bits '" + text +
                                "', not 0x and 16 hex digits");
    }
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

namespace {

json parse_json(const std::string& text, const std::string& shown_as) {
  try {
    // The format nests 5 deep; far deeper would only exhaust the stack of
    // the recursive dump the checksum takes.
    return json::parse(text, [&](int depth, json::parse_event_t, json&) {
      if (depth > 32) {
        throw CheckpointError(Kind::Corrupt, "", shown_as,
                              shown_as + " nests JSON more than 32 deep; an index nests 5");
      }
      return true;
    });
  } catch (const json::exception& e) {
    throw CheckpointError(Kind::Corrupt, "", shown_as,
                          shown_as + " is not valid JSON (" + std::string(e.what()) + ")");
  }
}

// Format, checksum and version of a parsed index.
void check_header(const json& j, const std::string& shown_as) {
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
  const int64_t version = whole(j.at("version"), "version", shown_as);
  if (version > kFormatVersion || version < 1) {
    throw CheckpointError(Kind::Format, "", shown_as,
                          shown_as + " has format version " + std::to_string(version) +
                              "; this libfsdp reads versions 1 to " +
                              std::to_string(kFormatVersion));
  }
}

IndexTensor parse_tensor(const std::string& name, const json& t, const std::string& shown_as) {
  IndexTensor it;
  it.name = name;
  it.kind = t.at("kind").get<std::string>();
  it.dtype = dtype_of(t.at("dtype").get<std::string>(), name, shown_as);
  it.shape = wholes(t.at("shape"), "the shape of '" + name + "'", shown_as);
  for (const auto& c : t.at("chunks")) {
    Reader::Chunk chunk;
    chunk.file = c.at("file").get<std::string>();
    chunk.dataset = c.at("dataset").get<std::string>();
    chunk.offsets = wholes(c.at("offsets"), "a chunk offset of '" + name + "'", shown_as);
    chunk.sizes = wholes(c.at("sizes"), "a chunk size of '" + name + "'", shown_as);
    if (chunk.offsets.size() != it.shape.size() || chunk.sizes.size() != it.shape.size()) {
      throw CheckpointError(Kind::Corrupt, name, shown_as,
                            shown_as + ": a chunk of '" + name + "' has the wrong rank");
    }
    it.chunks.push_back(std::move(chunk));
  }
  return it;
}

}  // namespace

Index parse_index(const std::string& text, const std::string& shown_as) {
  const json j = parse_json(text, shown_as);
  try {
    check_header(j, shown_as);
    Index index;
    index.version = static_cast<int>(whole(j.at("version"), "version", shown_as));
    index.step = whole(j.at("step"), "step", shown_as);
    const int64_t world = whole(j.at("world_size"), "world_size", shown_as);
    index.world_size = static_cast<int>(std::clamp<int64_t>(world, -1, INT32_MAX));
    index.created = j.value("created", "");
    index.libfsdp_version = j.value("libfsdp", "");
    for (const auto& [name, t] : j.at("tensors").items()) {
      index.tensors.emplace(name, parse_tensor(name, t, shown_as));
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
      index.files[file] = whole(f.at("bytes"), "the bytes of '" + file + "'", shown_as);
    }
    check_index(index, shown_as);
    return index;
  } catch (const json::exception& e) {
    throw CheckpointError(Kind::Corrupt, "", shown_as,
                          shown_as + " lacks a field or has one of the wrong type (" +
                              std::string(e.what()) + ")");
  }
}

std::string read_index_text(const std::string& dir) {
  const std::string path = dir + "/" + kIndexFile;
  try {
    contained_file(dir, kIndexFile, "index");
  } catch (const CheckpointError& e) {
    if (e.kind() != Kind::Incomplete) throw;
    throw CheckpointError(Kind::NotFound, "", path, path + " does not exist or cannot be read");
  }
  return read_bounded(path, kMaxIndexBytes);
}

Index read_index(const std::string& dir) {
  return parse_index(read_index_text(dir), dir + "/" + kIndexFile);
}

}  // namespace fsdp::dcp::detail
