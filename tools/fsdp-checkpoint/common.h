// fsdp-checkpoint's shared pieces: exit statuses, the errors that map to
// them, formatting of shapes, dtypes and sizes, and reading a tensor in
// row blocks so no command holds more than one block of one tensor (two for
// diff) in memory.
#pragma once

#include <fsdp/distributed_checkpoint.h>

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdp_checkpoint {

// Exit statuses (documented in --help).
constexpr int kExitOk = 0;        // done; intact; no difference beyond tolerance
constexpr int kExitFailed = 1;    // verify found problems; diff found differences
constexpr int kExitUsage = 2;     // bad arguments, not a checkpoint, output not writable
constexpr int kExitDamaged = 3;   // export/diff: a piece failed to read (run verify)

// An error printed as "fsdp-checkpoint: error: <what>" with exit status 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A piece that failed to read (CheckpointError while reading data):
// printed as "fsdp-checkpoint: error: <checkpoint>: <kind>: <what>", exit 3.
struct DamagedError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Reader::read of the box [offsets, offsets + sizes) of `name` (the whole
// tensor when both are empty); a CheckpointError becomes DamagedError
// naming the checkpoint.
at::Tensor read_box(const fsdp::dcp::Reader& reader, const std::string& name,
                    const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes);

// "[7, 5]" ("[]" for 0-d): LibTorch's spelling of sizes(), which libfsdp's
// messages use too. Takes a Reader's std::vector shape or a tensor's sizes().
std::string shape_str(c10::IntArrayRef shape);
// "float32", "bfloat16", ... (the index's names).
std::string dtype_str(at::ScalarType t);
int64_t numel(const std::vector<int64_t>& shape);
// Bytes of the whole tensor.
int64_t tensor_bytes(const fsdp::dcp::Reader::TensorInfo& t);
// "1.5 MiB" style (exact bytes below 1 KiB).
std::string human_bytes(int64_t bytes);

// Opens the checkpoint `dir` (a checkpoint or a root); a CheckpointError is
// rethrown as UsageError naming `argument` and the kind.
fsdp::dcp::Reader open_reader(const std::string& dir, const std::string& argument);

// Reads `t` in blocks of whole rows along dim 0 of at most about
// `max_bytes` (at least one row; a 0-d tensor is one block) and calls
// `fn(block, row_offset)` for each, in order.
void for_each_block(const fsdp::dcp::Reader& reader, const fsdp::dcp::Reader::TensorInfo& t,
                    int64_t max_bytes, const std::function<void(const at::Tensor&, int64_t)>& fn);

// Block size for the reads above (64 MiB).
constexpr int64_t kBlockBytes = int64_t{64} << 20;

int run_inspect(const std::string& dir, bool json);
int run_verify(const std::string& dir);

struct ExportArgs {
  std::string dir, to;
  std::vector<std::string> only;
  bool include_rank_local = false;
};
int run_export(const ExportArgs& args);

struct DiffArgs {
  std::string a, b;
  double atol = 0, rtol = 0;
};
int run_diff(const DiffArgs& args);

}  // namespace fsdp_checkpoint
