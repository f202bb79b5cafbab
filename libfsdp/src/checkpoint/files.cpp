// Checkpoint directories on the file system (files.h).
#include "checkpoint/files.h"

#include "fsdp/distributed_checkpoint.h"

#include "checkpoint/index.h"

#include <fcntl.h>
#include <sys/stat.h>
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

std::string rank_file(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d.h5", rank);
  return buf;
}

bool is_rank_file(const std::string& name, int world_size) {
  const std::string head = "rank-", tail = ".h5";
  if (name.size() < head.size() + 5 + tail.size() || name.size() > head.size() + 10 + tail.size() ||
      name.compare(0, head.size(), head) != 0 ||
      name.compare(name.size() - tail.size(), tail.size(), tail) != 0) {
    return false;
  }
  const std::string digits = name.substr(head.size(), name.size() - head.size() - tail.size());
  if (digits.find_first_not_of("0123456789") != std::string::npos) return false;
  const long long rank = std::stoll(digits);
  // Only the spelling rank_file gives: "rank-1.h5" or "rank-000001.h5" is no rank file.
  return rank < world_size && rank_file(static_cast<int>(rank)) == name;
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

std::string contained_file(const std::string& dir, const std::string& name, const std::string& what) {
  const auto corrupt = [&](const std::string& why) {
    throw CheckpointError(Kind::Corrupt, "", name, dir + ": " + what + " '" + name + "' " + why);
  };
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
      name.find('\0') != std::string::npos) {
    corrupt("is not a plain file name inside the checkpoint directory");
  }
  const std::string path = dir + "/" + name;
  std::error_code ec;
  const fs::file_status link = fs::symlink_status(path, ec);
  if (ec || !fs::exists(link)) {
    throw CheckpointError(Kind::Incomplete, "", name, dir + ": " + what + " " + name + " is missing");
  }
  if (fs::is_symlink(link)) {
    // A link may point within the checkpoint (a copy made with cp -s), never out of it.
    const fs::path target = fs::weakly_canonical(path, ec);
    const fs::path home = fs::canonical(dir, ec);
    if (ec || target.parent_path() != home) {
      corrupt("is a symbolic link to " + (ec ? std::string("an unresolvable path") : target.string()) +
              ", outside the checkpoint directory");
    }
  }
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) {
    throw CheckpointError(Kind::Incomplete, "", name, dir + ": " + what + " " + name + " is missing");
  }
  if (!fs::is_regular_file(st)) {
    const char* what = fs::is_directory(st)         ? "a directory"
                       : fs::is_fifo(st)            ? "a FIFO"
                       : fs::is_character_file(st)  ? "a character device"
                       : fs::is_block_file(st)      ? "a block device"
                       : fs::is_socket(st)          ? "a socket"
                                                    : "not a regular file";
    corrupt(std::string("is ") + what + ", not a regular file");
  }
  return path;
}

void check_rank_file(const std::string& dir, const std::string& name, int64_t bytes,
                     const std::string& shown) {
  const int64_t size = file_size(contained_file(dir, name));
  if (size != bytes) {
    throw CheckpointError(Kind::Corrupt, "", name,
                          shown + ": rank file " + name + " has " + std::to_string(size) +
                              " bytes; " + std::to_string(bytes) + " were written" +
                              (size < bytes ? " (truncated)" : ""));
  }
}

std::string read_bounded(const std::string& path, int64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) {
      throw CheckpointError(Kind::NotFound, "", path, path + " does not exist");
    }
    io_error("cannot open", path, err);
  }
  struct stat st {};
  std::string text;
  const auto fail = [&](Kind kind, const std::string& why) {
    ::close(fd);
    throw CheckpointError(kind, "", path, path + " " + why);
  };
  if (::fstat(fd, &st) != 0) fail(Kind::Io, std::string("cannot be examined: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) fail(Kind::Corrupt, "is not a regular file");
  if (st.st_size > max_bytes) {
    fail(Kind::Corrupt, "has " + std::to_string(st.st_size) + " bytes; at most " +
                            std::to_string(max_bytes) + " are accepted");
  }
  text.resize(static_cast<size_t>(st.st_size));
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(Kind::Io, std::string("cannot be read: ") + std::strerror(errno));
    if (n == 0) break;  // shrank while read: what is there is what the parse sees
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  text.resize(got);
  return text;
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

std::vector<StepDir> list_step_dirs(const std::string& root) {
  std::vector<StepDir> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const int64_t step = step_of(e.path().filename().string());
    std::error_code dir_ec;
    if (step >= 0 && e.is_directory(dir_ec)) {
      const std::string path = e.path().string();
      found.push_back({step, path, exists(path + "/" + kIndexFile)});
    }
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.step > b.step; });
  return found;
}

}  // namespace fsdp::dcp::detail

namespace fsdp::dcp {

std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::string> out;
  for (auto& s : detail::list_step_dirs(dir)) {
    if (s.has_index) out.push_back(std::move(s.path));
  }
  return out;
}

}  // namespace fsdp::dcp
