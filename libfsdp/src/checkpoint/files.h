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
// The step of a "step-<digits>" name, or -1.
int64_t step_of(const std::string& name);

void make_dir(const std::string& path);     // with parents; existing is fine
void remove_tree(const std::string& path);  // missing is fine
// fsync of a file or directory.
void sync_path(const std::string& path);
int64_t file_size(const std::string& path);  // -1 when missing
bool exists(const std::string& path);
void write_text(const std::string& path, const std::string& text, bool sync);

// Renames tmp -> final (a final that exists is replaced only once tmp is in
// place under it), then fsyncs root.
void publish(const std::string& tmp, const std::string& final_dir, const std::string& root);
// Removes complete checkpoints beyond the newest `keep`, oldest first (the
// index first, so a half-removed one never looks complete), and leftover
// step-*.tmp directories of crashed saves.
void prune(const std::string& root, int keep);

}  // namespace fsdp::dcp::detail
