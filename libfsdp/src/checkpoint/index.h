// index.json: what a checkpoint holds and where (docs/distributed_checkpoint.md
// has the format). Written last by rank 0, read first by every loader; its
// own FNV-1a 64 checksum covers everything else in it.
#pragma once

#include "fsdp/distributed_checkpoint.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::dcp::detail {

inline constexpr const char* kFormatName = "libfsdp-distributed-checkpoint";
inline constexpr const char* kIndexFile = "index.json";
inline constexpr const char* kGlobalFile = "global.h5";

struct IndexTensor {
  std::string name, kind;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  std::vector<Reader::Chunk> chunks;
};

struct Index {
  int version = kFormatVersion;
  int64_t step = 0;
  int world_size = 0;
  std::string created;  // UTC, ISO 8601
  std::string libfsdp_version;
  std::map<std::string, IndexTensor> tensors;
  std::map<std::string, Value> values;                    // global non-tensor values
  // Rank-local ones, by rank; nullopt (JSON null) where a rank set none.
  std::map<std::string, std::vector<std::optional<Value>>> rank_values;
  std::map<std::string, nlohmann::json> optimizers;       // prefix -> type, module, groups
  std::map<std::string, int64_t> files;                   // rank file -> bytes
};

// FNV-1a 64 over bytes, continuing from `h`.
uint64_t fnv1a64(const void* data, size_t n, uint64_t h = 0xcbf29ce484222325ULL);

// The largest index.json read (bounds the read; a model of ~1e6 tensor pieces).
inline constexpr int64_t kMaxIndexBytes = int64_t{1} << 30;

std::string index_text(const Index& index);  // with its checksum
// Verifies format, version and checksum, then check_index; CheckpointError
// (Format, Corrupt) naming `shown_as` otherwise.
Index parse_index(const std::string& text, const std::string& shown_as);
// What an index must hold before anything it names is opened or sized
// (index_check.cpp): rank files by their own names, chunks inside their
// tensors and tiling them, sizes within the rank files' bytes.
// CheckpointError(Corrupt) naming the entry otherwise.
void check_index(const Index& index, const std::string& shown_as);
// The text of <dir>/index.json, a regular file inside dir of at most
// kMaxIndexBytes (NotFound if absent, Corrupt otherwise).
std::string read_index_text(const std::string& dir);
// read_index_text, parsed.
Index read_index(const std::string& dir);

nlohmann::json value_json(const Value& v);
Value value_from_json(const nlohmann::json& j, const std::string& name, const std::string& file);

}  // namespace fsdp::dcp::detail
