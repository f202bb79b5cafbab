// The file-system side of checkpoints: names, durable writes, the publish
// rename and pruning. Paths are plain strings; errors are
// CheckpointError(Io) with the path and errno's text.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::dcp::detail {

// <root>/step-<step, 12 digits>
std::string step_dir(const std::string& root, int64_t step);
// "rank-<rank, at least 5 digits>.h5": the one name a rank file has.
std::string rank_file(int rank);
// Whether `name` is rank_file(r) for some 0 <= r < world_size.
bool is_rank_file(const std::string& name, int world_size);
// The step of a "step-<digits>" name, or -1.
int64_t step_of(const std::string& name);

void make_dir(const std::string& path);     // with parents; existing is fine
void remove_tree(const std::string& path);  // missing is fine
// fsync of a file or directory.
void sync_path(const std::string& path);
int64_t file_size(const std::string& path);  // -1 when missing
bool exists(const std::string& path);

// Checkpoint files are untrusted input (docs/distributed_checkpoint.md#loading-checkpoints-you-did-not-write).
// The path of `name` in checkpoint directory `dir`, checked without opening
// it: `name` is a plain file name, and the file (a symlink resolved) is a
// regular file inside `dir`. CheckpointError(Incomplete) when it does not
// exist, (Corrupt) naming `name` otherwise; messages call it `what`
// ("rank file").
std::string contained_file(const std::string& dir, const std::string& name,
                           const std::string& what = "rank file");
// contained_file, then its size against the `bytes` the index gives:
// CheckpointError(Corrupt) "<shown>: rank file <name> has N bytes; M were
// written" when they differ.
void check_rank_file(const std::string& dir, const std::string& name, int64_t bytes,
                     const std::string& shown);
// The step-<digits> directories under `root`, newest first, each with
// whether it holds an index.json (a complete checkpoint) or not (an
// incomplete or damaged one).
struct StepDir {
  int64_t step;
  std::string path;
  bool has_index;
};
std::vector<StepDir> list_step_dirs(const std::string& root);
// The whole of a regular file of at most `max_bytes`, read without blocking
// on a FIFO or device: CheckpointError(NotFound) when missing, (Corrupt)
// when not a regular file or larger, (Io) when unreadable.
std::string read_bounded(const std::string& path, int64_t max_bytes);
void write_text(const std::string& path, const std::string& text, bool sync);

// Renames tmp -> final (a final that exists is replaced only once tmp is in
// place under it), then fsyncs root.
void publish(const std::string& tmp, const std::string& final_dir, const std::string& root);
// Removes complete checkpoints beyond the newest `keep`, oldest first (the
// index first, so a half-removed one never looks complete), and leftover
// step-*.tmp directories of crashed saves.
void prune(const std::string& root, int keep);

}  // namespace fsdp::dcp::detail
