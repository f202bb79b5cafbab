// The rules an index must meet before any file it names is opened or any
// buffer it sizes is allocated (index.h: check_index). The checksum only
// tells accidents; these hold against an index anyone edited and re-signed
// (docs/distributed_checkpoint.md#loading-checkpoints-you-did-not-write).
#include "checkpoint/files.h"
#include "checkpoint/index.h"
#include "checkpoint/layout.h"

#include "base/shape_str.h"

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <numeric>

namespace fsdp::dcp::detail {
namespace {

using Kind = CheckpointError::Kind;

// The largest world an index may claim: bounds the per-rank arrays.
constexpr int kMaxWorld = 1 << 24;

[[noreturn]] void corrupt(const std::string& tensor, const std::string& file,
                          const std::string& shown_as, const std::string& why) {
  throw CheckpointError(Kind::Corrupt, tensor, file, shown_as + ": " + why);
}

// a * b, or nullopt past int64.
std::optional<int64_t> times(int64_t a, int64_t b) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// The bytes of `sizes` elements of `esize` bytes, or nullopt past int64.
std::optional<int64_t> bytes_of(const std::vector<int64_t>& sizes, int64_t esize) {
  std::optional<int64_t> n = esize;
  for (int64_t s : sizes) {
    if (n) n = times(*n, s);
  }
  return n;
}

// The bytes the rank files hold in all (each >= 0), or nullopt past int64.
std::optional<int64_t> check_files(const Index& index, const std::string& shown_as) {
  int64_t total = 0;
  for (const auto& [file, bytes] : index.files) {
    if (!is_rank_file(file, index.world_size)) {
      corrupt("", file, shown_as,
              "\"files\" lists '" + file + "', which is not a rank file of this checkpoint (rank-" +
                  "<5 or more digits>.h5 of a rank below its world size " +
                  std::to_string(index.world_size) + ")");
    }
    if (bytes < 0) corrupt("", file, shown_as, "\"files\" gives '" + file + "' a negative size");
    if (__builtin_add_overflow(total, bytes, &total)) return std::nullopt;
  }
  return total;
}

// One chunk's entry: a listed rank file, a box inside the tensor.
void check_chunk(const IndexTensor& t, size_t i, const Index& index, const std::string& shown_as) {
  const Reader::Chunk& c = t.chunks[i];
  const std::string entry = "'" + t.name + "' chunk " + std::to_string(i);
  if (index.files.count(c.file) == 0) {
    corrupt(t.name, c.file, shown_as,
            entry + " names file '" + c.file +
                "', which is not one of the rank files the index lists in \"files\" (a plain "
                "name rank-<rank>.h5 inside the checkpoint directory)");
  }
  if (c.dataset.empty() || c.dataset[0] != '/') {
    corrupt(t.name, c.file, shown_as, entry + " has no dataset path (\"" + c.dataset + "\")");
  }
  for (size_t d = 0; d < t.shape.size(); ++d) {
    if (c.offsets[d] < 0 || c.sizes[d] < 0 || c.offsets[d] > t.shape[d] ||
        c.sizes[d] > t.shape[d] - c.offsets[d]) {
      corrupt(t.name, c.file, shown_as,
              entry + " " + box_str(Box{c.offsets, c.sizes}) + " is not inside its global shape " +
                  shape_str(t.shape));
    }
  }
}

// The chunks' bytes against what "files" says each rank file holds.
void count_bytes(const IndexTensor& t, int64_t esize, const Index& index,
                 std::map<std::string, int64_t>& bytes_in, const std::string& shown_as) {
  for (const auto& c : t.chunks) {
    int64_t& in = bytes_in[c.file];
    // Inside a shape whose bytes fit int64, a chunk's do too.
    if (__builtin_add_overflow(in, *bytes_of(c.sizes, esize), &in) || in > index.files.at(c.file)) {
      corrupt(t.name, c.file, shown_as,
              "the chunks in '" + c.file + "' (up to '" + t.name + "') hold more bytes of data "
              "than \"files\" gives it (" + std::to_string(index.files.at(c.file)) + ")");
    }
  }
}

// The chunks tile the tensor: disjoint, and as many elements as it has.
void check_tiling(const IndexTensor& t, int64_t numel, const std::string& shown_as) {
  std::vector<Box> boxes;
  int64_t covered = 0;
  for (const auto& c : t.chunks) {
    boxes.push_back(Box{c.offsets, c.sizes});
    covered += boxes.back().numel();  // each <= numel, at most chunks x numel: fits
  }
  if (t.shape.empty()) {
    if (t.chunks.size() != 1) {
      corrupt(t.name, "", shown_as, "0-d tensor '" + t.name + "' has " +
                                        std::to_string(t.chunks.size()) + " chunks; it has one");
    }
    return;
  }
  // A sweep along dim 0: a box can only overlap boxes whose rows it meets.
  std::vector<size_t> order(boxes.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return boxes[a].offsets[0] < boxes[b].offsets[0]; });
  std::vector<size_t> open;
  for (size_t i : order) {
    if (boxes[i].numel() == 0) continue;
    const int64_t row = boxes[i].offsets[0];
    open.erase(std::remove_if(open.begin(), open.end(),
                              [&](size_t j) {
                                return boxes[j].offsets[0] + boxes[j].sizes[0] <= row;
                              }),
               open.end());
    for (size_t j : open) {
      if (!empty(intersect(boxes[i], boxes[j]))) {
        corrupt(t.name, t.chunks[i].file, shown_as,
                "the chunks " + box_str(boxes[j]) + " and " + box_str(boxes[i]) + " of '" +
                    t.name + "' overlap");
      }
    }
    open.push_back(i);
  }
  if (covered != numel) {
    corrupt(t.name, "", shown_as,
            "the chunks of '" + t.name + "' hold " + std::to_string(covered) + " of its " +
                std::to_string(numel) + " elements (" + shape_str(t.shape) + ")");
  }
}

void check_tensor(const IndexTensor& t, const Index& index, int64_t file_bytes,
                  std::map<std::string, int64_t>& bytes_in, const std::string& shown_as) {
  static const char* kKinds[] = {"param", "buffer", "optim", "tensor", "rank_local"};
  if (std::find(std::begin(kKinds), std::end(kKinds), t.kind) == std::end(kKinds)) {
    corrupt(t.name, "", shown_as, "'" + t.name + "' has kind '" + t.kind + "', none of param, "
                                  "buffer, optim, tensor, rank_local");
  }
  for (int64_t s : t.shape) {
    if (s < 0) corrupt(t.name, "", shown_as, "'" + t.name + "' has shape " + shape_str(t.shape));
  }
  const int64_t esize = static_cast<int64_t>(c10::elementSize(t.dtype));
  const std::optional<int64_t> bytes = bytes_of(t.shape, esize);
  // Every element is stored (no compression): a tensor larger than the rank
  // files cannot be in them, and must not size an allocation.
  if (!bytes || *bytes > file_bytes) {
    corrupt(t.name, "", shown_as,
            "'" + t.name + "' claims shape " + shape_str(t.shape) + " of " +
                std::string(c10::toString(t.dtype)) + ", more bytes than its rank files hold (" +
                std::to_string(file_bytes) + ")");
  }
  for (size_t i = 0; i < t.chunks.size(); ++i) check_chunk(t, i, index, shown_as);
  check_tiling(t, *bytes / esize, shown_as);
  count_bytes(t, esize, index, bytes_in, shown_as);
}

}  // namespace

void check_index(const Index& index, const std::string& shown_as) {
  if (index.world_size < 1 || index.world_size > kMaxWorld) {
    corrupt("", "", shown_as, "world_size " + std::to_string(index.world_size) +
                                  " is not between 1 and " + std::to_string(kMaxWorld));
  }
  if (index.step < 0) corrupt("", "", shown_as, "step " + std::to_string(index.step) + " < 0");
  const std::optional<int64_t> file_bytes = check_files(index, shown_as);
  if (!file_bytes) corrupt("", "", shown_as, "\"files\" gives sizes beyond 2^63 bytes");
  std::map<std::string, int64_t> bytes_in;  // by rank file, what the chunks say it holds
  for (const auto& [name, t] : index.tensors) check_tensor(t, index, *file_bytes, bytes_in, shown_as);
  for (const auto& [name, per_rank] : index.rank_values) {
    if (per_rank.size() > static_cast<size_t>(index.world_size)) {
      corrupt(name, "", shown_as, "rank value '" + name + "' has " +
                                      std::to_string(per_rank.size()) + " entries for " +
                                      std::to_string(index.world_size) + " ranks");
    }
  }
}

}  // namespace fsdp::dcp::detail
