// Checkpoint directories on the file system (files.h).
#include "checkpoint/files.h"

#include "fsdp/distributed_checkpoint.h"

#include "checkpoint/index.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace fsdp::dcp::detail {

namespace fs = std::filesystem;
using Kind = CheckpointError::Kind;

namespace {
[[noreturn]] void io_error(const std::string& what, const std::string& path, int err) {
  throw CheckpointError(Kind::Io, "", path, what + " " + path + ": " + std::strerror(err));
}
}  // namespace

std::string step_dir(const std::string& root, int64_t step) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "step-%012lld", static_cast<long long>(step));
  return root + "/" + buf;
}

int64_t step_of(const std::string& name) {
  if (name.size() != 17 || name.rfind("step-", 0) != 0) return -1;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
  }
  return std::stoll(name.substr(5));
}

void make_dir(const std::string& path) {
  std::error_code ec;
  fs::create_directories(path, ec);
  if (ec) io_error("cannot create directory", path, ec.value());
}

void remove_tree(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) io_error("cannot remove", path, ec.value());
}

void sync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) io_error("cannot open", path, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) io_error("cannot fsync", path, err);
}

int64_t file_size(const std::string& path) {
  std::error_code ec;
  const auto n = fs::file_size(path, ec);
  return ec ? -1 : static_cast<int64_t>(n);
}

bool exists(const std::string& path) {
  std::error_code ec;
  return fs::exists(path, ec);
}

void write_text(const std::string& path, const std::string& text, bool sync) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) io_error("cannot write", path, errno);
  }
  if (sync) sync_path(path);
}

void publish(const std::string& tmp, const std::string& final_dir, const std::string& root) {
  const std::string replaced = final_dir + ".replaced";
  const bool had = exists(final_dir);
  if (had) {
    remove_tree(replaced);
    if (std::rename(final_dir.c_str(), replaced.c_str()) != 0) {
      io_error("cannot rename", final_dir, errno);
    }
  }
  if (std::rename(tmp.c_str(), final_dir.c_str()) != 0) io_error("cannot rename", tmp, errno);
  sync_path(root);
  if (had) remove_tree(replaced);
}

void prune(const std::string& root, int keep) {
  const auto complete = list_checkpoints(root);
  for (size_t i = static_cast<size_t>(keep); i < complete.size(); ++i) {
    // The index first: from then on the directory is not a checkpoint.
    std::error_code ec;
    fs::remove(complete[i] + "/" + kIndexFile, ec);
    sync_path(complete[i]);
    remove_tree(complete[i]);
  }
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0 &&
        step_of(name.substr(0, name.size() - 4)) >= 0) {
      remove_tree(e.path().string());
    }
  }
}

}  // namespace fsdp::dcp::detail

namespace fsdp::dcp {

std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const int64_t step = detail::step_of(e.path().filename().string());
    if (step >= 0 && detail::exists(e.path().string() + "/" + detail::kIndexFile)) {
      found.emplace_back(step, e.path().string());
    }
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

}  // namespace fsdp::dcp
