#include "resume_files.h"

#include "test_hooks.h"

#include <reference/h5_util.h>

#include <ATen/ops/empty.h>
#include <fsdp/optim_state.h>
#include <H5Cpp.h>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (fmt >= 11 keeps it here)

#include <fcntl.h>
#include <ftw.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <set>

namespace fsdp_train {

namespace fs = std::filesystem;

namespace {

// Format 2 added the checksums; format 1 checkpoints are refused (with a
// message saying so) since nothing in them can be verified.
constexpr const char* kFormat = "fsdp-train checkpoint 2";
constexpr const char* kFormat1 = "fsdp-train checkpoint 1";
constexpr const char* kSumAttr = "fnv1a64";

// What is wrong with one candidate checkpoint, as seen by this rank: one
// line naming the file ("rank1.h5: /params/x: checksum mismatch ...").
struct Fault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The ranks' verdict on one step: 0 ok, 1 damaged (or failed), 2 written
// with other numerics. Every rank passes its own; every rank gets the worst
// code and the message of the lowest rank that has it.
struct Outcome {
  int code = 0;
  std::string message;
};

Outcome agree(const WorldComm& comm, const Outcome& mine) {
  const auto worst = static_cast<int>(comm.max(mine.code));
  if (worst == 0) return {};
  // The lowest rank with the worst code: the maximum of the negated ranks.
  const int from = static_cast<int>(-comm.max(mine.code == worst ? -comm.rank() : -comm.size()));
  return {worst, comm.broadcast(mine.message, from)};
}

// Save steps: a failure on any rank is a CheckpointError on every rank.
void agree_or_throw(const WorldComm& comm, const std::string& local_error,
                    const std::string& what) {
  const Outcome o = agree(comm, {local_error.empty() ? 0 : 1, local_error});
  if (o.code != 0) throw CheckpointError(what + ": " + o.message);
}

std::string rank_name(int rank) { return "rank" + std::to_string(rank) + ".h5"; }

std::string h5_message(const H5::Exception& e) {
  return e.getFuncName() + ": " + e.getDetailMsg();
}

// ---- the test-only crash hook ---------------------------------------------

const std::vector<std::string>& crash_points() {
  static const std::vector<std::string> points = {"written", "synced",      "meta",
                                                  "cleanup", "renamed-old", "renamed-new"};
  return points;
}

HookSpec crash_spec() { return read_hook("FSDP_TRAIN_CRASH_AT", crash_points()); }

// Rank 0 dies here, as kill -9 would kill it, when the hook names this point.
void crash_point(const HookSpec& spec, const char* point, int64_t step, int rank) {
  if (rank != 0 || !spec.matches(point, step)) return;
  std::cerr << fmt::format("fsdp-train: FSDP_TRAIN_CRASH_AT: SIGKILL of rank 0 after \"{}\" of "
                           "the save at step {}",
                           point, step)
            << std::endl;
  std::raise(SIGKILL);
}

// ---- durable files and directories ----------------------------------------

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), O_RDONLY | (directory ? O_DIRECTORY : 0));
  if (fd < 0) throw std::runtime_error("cannot open " + path + " to fsync: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw std::runtime_error("fsync " + path + ": " + std::strerror(err));
}

void write_durable(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size() &&
                  std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  const int err = errno;
  std::fclose(f);
  if (!ok) throw std::runtime_error("cannot write " + path + ": " + std::strerror(err));
}

// Removes a checkpoint directory so that no moment shows it complete and
// damaged: meta.json goes first (and that is made durable), then the rest.
// The tree goes through nftw, not std::filesystem::remove_all: pip's
// LibTorch 2.11 exports its own remove_all, which binds before libstdc++'s
// and crashed on its call to recursive_directory_iterator::__erase (a null
// PLT target) on the H200 machine.
void remove_checkpoint_dir(const std::string& dir, const std::function<void()>& midway) {
  if (fs::exists(dir + "/meta.json")) {
    fs::remove(dir + "/meta.json");
    fsync_path(dir, true);
  }
  if (midway) midway();
  ::nftw(
      dir.c_str(), [](const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); },
      16, FTW_DEPTH | FTW_PHYS);
}

// ---- HDF5 ------------------------------------------------------------------
// The shared helpers (reference/h5_util.h), strict: a missing or mistyped
// attribute is an h5util::AttributeError, which read_verified reports as a
// Fault of the file. Strings are stored exactly (digests cover them).

using h5util::EmptyString;

void write_string_attr(H5::H5Object& obj, const std::string& name, const std::string& value) {
  h5util::write_string_attr(obj, name, value, EmptyString::Nul);
}

std::string read_string_attr(const H5::H5Object& obj, const std::string& name) {
  return h5util::read_string_attr(obj, name, EmptyString::Nul);
}

// The manifest a rank file's digest is taken over: one line per dataset
// (path, type, shape, checksum of its bytes) and per root attribute, in
// path order, so writer and reader build it alike.
class Manifest {
 public:
  void add(const std::string& path, const std::string& type, const std::vector<int64_t>& dims,
           uint64_t sum) {
    lines_[path] = fmt::format("{} {} [{}] {:016x}\n", path, type, fmt::join(dims, ","), sum);
  }
  void attr(const std::string& name, const std::string& value) {
    lines_["@" + name] = "@" + name + " " + value + "\n";
  }
  std::string digest() const {
    uint64_t h = fnv1a64(nullptr, 0);
    for (const auto& [path, line] : lines_) h = fnv1a64(line.data(), line.size(), h);
    return fmt::format("fnv1a64:{:016x}", h);
  }

 private:
  std::map<std::string, std::string> lines_;
};

// Exact bytes of an fp32 tensor (any shape, zero rows included) and their
// checksum.
void write_tensor(H5::Group& g, const std::string& group_path, const std::string& name,
                  const at::Tensor& t, Manifest& manifest) {
  if (t.scalar_type() != at::kFloat) {
    throw std::runtime_error("checkpoint: " + name + " is not float32");
  }
  at::Tensor c = t.detach().to(at::kCPU).contiguous();
  H5::DataSet ds = h5util::write_dataset(g, name, H5::PredType::IEEE_F32LE,
                                         {c.sizes().begin(), c.sizes().end()},
                                         c.data_ptr<float>(), H5::PredType::NATIVE_FLOAT);
  const uint64_t sum = fnv1a64(c.data_ptr(), c.numel() * sizeof(float));
  h5util::set_uint64_attr(ds, kSumAttr, sum);
  manifest.add(group_path + "/" + name, "float32", c.sizes().vec(), sum);
}

void write_int(H5::Group& g, const std::string& group_path, const std::string& name, int64_t v,
               Manifest& manifest) {
  H5::DataSet ds =
      h5util::write_dataset(g, name, H5::PredType::STD_I64LE, {}, &v, H5::PredType::NATIVE_INT64);
  const uint64_t sum = fnv1a64(&v, sizeof v);
  h5util::set_uint64_attr(ds, kSumAttr, sum);
  manifest.add(group_path + "/" + name, "int64", {}, sum);
}

// Reads a dataset after checking its type and shape, and its bytes against
// the checksum stored beside them.
// `nonnegative`: also refuse values below 0 (exp_avg_sq, whose square root
// AdamW takes).
at::Tensor read_checked(const H5::Group& g, const std::string& path, const std::string& name,
                        const std::vector<int64_t>& shape, bool integer, Manifest& manifest,
                        bool nonnegative = false) {
  if (!g.nameExists(name)) throw Fault(path + " is missing");
  if (g.childObjType(name) != H5O_TYPE_DATASET) throw Fault(path + " is not a dataset");
  H5::DataSet ds = g.openDataSet(name);
  const std::string want_type = integer ? "int64" : "float32";
  const std::string type = h5util::type_name(ds);
  if (type != want_type) throw Fault(fmt::format("{} has type {}, expected {}", path, type, want_type));
  const std::vector<int64_t> dims = h5util::dims_of(ds);
  if (dims != shape) {
    throw Fault(fmt::format("{} has shape [{}], this rank's {} is [{}]", path, fmt::join(dims, ", "),
                            integer ? "step counter" : "shard", fmt::join(shape, ", ")));
  }
  at::Tensor t = at::empty(shape, integer ? at::kLong : at::kFloat);
  if (t.numel() > 0) {
    ds.read(t.data_ptr(), integer ? H5::PredType::NATIVE_INT64 : H5::PredType::NATIVE_FLOAT);
  }
  if (!ds.attrExists(kSumAttr)) throw Fault(path + " has no checksum (attribute fnv1a64)");
  const uint64_t stored = h5util::read_uint64_attr(ds, kSumAttr);
  const uint64_t sum = fnv1a64(t.data_ptr(), t.numel() * t.element_size());
  if (sum != stored) {
    throw Fault(fmt::format("{} checksum mismatch: stored {:016x}, computed {:016x}", path, stored,
                            sum));
  }
  manifest.add(path, want_type, shape, sum);
  if (!integer) {
    const float* p = t.data_ptr<float>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (!std::isfinite(p[i])) {
        throw Fault(fmt::format("{} holds {} (element {})", path, std::isnan(p[i]) ? "NaN" : "Inf",
                                i));
      }
      if (nonnegative && p[i] < 0) throw Fault(fmt::format("{} holds {} (element {}), expected >= 0", path, p[i], i));
    }
  }
  return t;
}

void write_rank_file(const std::string& path, int64_t step, const nlohmann::json& numerics,
                     const std::vector<std::pair<std::string, at::Tensor>>& shards,
                     torch::optim::AdamW& opt, int rank, int world, Manifest& manifest) {
  const auto& params = opt.param_groups().at(0).params();
  if (params.size() != shards.size()) {
    throw std::logic_error("checkpoint: optimizer and state dict disagree on the parameters");
  }
  H5::H5File file(path, H5F_ACC_TRUNC);
  H5::Group pg = file.createGroup("/params");
  H5::Group og = file.createGroup("/optim");
  nlohmann::json stepped = nlohmann::json::array();
  auto& state = opt.state();
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto& [name, shard] = shards[i];
    write_tensor(pg, "/params", name, shard, manifest);
    auto it = state.find(fsdp::optimizer_state_key(opt, params[i]));
    if (it == state.end()) continue;  // never stepped
    auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
    H5::Group g = og.createGroup(name);
    const std::string gp = "/optim/" + name;
    write_int(g, gp, "step", s.step(), manifest);
    write_tensor(g, gp, "exp_avg", s.exp_avg(), manifest);
    write_tensor(g, gp, "exp_avg_sq", s.exp_avg_sq(), manifest);
    stepped.push_back(name);
  }
  H5::Group root = file.openGroup("/");
  const std::map<std::string, std::string> text = {{"format", kFormat},
                                                    {"numerics", numerics.dump()},
                                                    {"optim", stepped.dump()}};
  for (const auto& [name, value] : text) {
    write_string_attr(root, name, value);
    manifest.attr(name, value);
  }
  const std::map<std::string, int64_t> ints = {{"step", step}, {"rank", rank}, {"world", world}};
  for (const auto& [name, value] : ints) {
    h5util::write_int_attr(root, name, value);
    manifest.attr(name, std::to_string(value));
  }
}

// ---- verification ------------------------------------------------------------

struct Meta {
  int64_t step = 0;
  int64_t world = 0;
  nlohmann::json numerics;
  std::vector<std::string> digests;  // by rank
};

const char* kind_name(nlohmann::json::value_t t) {
  switch (t) {
    case nlohmann::json::value_t::null: return "null";
    case nlohmann::json::value_t::object: return "an object";
    case nlohmann::json::value_t::array: return "an array";
    case nlohmann::json::value_t::string: return "a string";
    case nlohmann::json::value_t::boolean: return "a boolean";
    case nlohmann::json::value_t::number_float: return "a fraction";
    default: return "an integer";
  }
}

// `what`: "integer", "string", "object", "array".
const nlohmann::json& require(const nlohmann::json& j, const std::string& where,
                              const std::string& key, const std::string& what) {
  const auto it = j.find(key);
  if (it == j.end()) throw Fault(fmt::format("{}\"{}\" is missing", where, key));
  const bool ok = what == "integer"  ? it->is_number_integer()
                  : what == "string" ? it->is_string()
                  : what == "object" ? it->is_object()
                                     : it->is_array();
  if (!ok) {
    std::string shown = it->dump();
    if (shown.size() > 40) shown = shown.substr(0, 37) + "...";
    throw Fault(fmt::format("{}\"{}\" is {} ({}), expected {} {}", where, key, kind_name(it->type()),
                            shown, what == "integer" ? "an" : "a", what));
  }
  return *it;
}

// meta.json: structure first (what the checks below read), then its own
// checksum, then the numerics against this run's.
Meta read_meta(const std::string& dir, const std::string& label, const nlohmann::json& numerics) {
  if (!fs::is_directory(dir)) throw Fault("does not exist");
  std::ifstream f(dir + "/meta.json");
  if (!f) throw Fault("meta.json is missing");
  nlohmann::json meta;
  try {
    f >> meta;
  } catch (const nlohmann::json::parse_error& e) {
    throw Fault(fmt::format("meta.json is not valid JSON (at byte {})", e.byte));
  }
  if (!meta.is_object()) throw Fault("meta.json is not a JSON object");
  const std::string format = require(meta, "meta.json: ", "format", "string").get<std::string>();
  if (format == kFormat1) {
    throw Fault(fmt::format("meta.json is {} (written before checksums); this fsdp-train resumes "
                            "only \"{}\"",
                            format, kFormat));
  }
  if (format != kFormat) throw Fault("meta.json is not an fsdp-train checkpoint (" + format + ")");
  Meta m;
  m.step = require(meta, "meta.json: ", "step", "integer").get<int64_t>();
  m.world = require(meta, "meta.json: ", "world", "integer").get<int64_t>();
  m.numerics = require(meta, "meta.json: ", "numerics", "object");
  const auto& files = require(meta, "meta.json: ", "files", "array");
  const std::string stored = require(meta, "meta.json: ", "checksum", "string").get<std::string>();
  if (static_cast<int64_t>(files.size()) != m.world) {
    throw Fault(fmt::format("meta.json lists {} rank files for world {}", files.size(), m.world));
  }
  for (size_t r = 0; r < files.size(); ++r) {
    const std::string where = fmt::format("meta.json: files[{}]: ", r);
    if (!files[r].is_object()) throw Fault(where + "is not an object");
    if (require(files[r], where, "name", "string").get<std::string>() != rank_name(int(r))) {
      throw Fault(where + "\"name\" is not " + rank_name(int(r)));
    }
    m.digests.push_back(require(files[r], where, "digest", "string").get<std::string>());
  }
  const std::string sum = meta_checksum(meta);
  if (sum != stored) {
    throw Fault(fmt::format("meta.json checksum mismatch: stored {}, computed {}; edited or "
                            "damaged after it was written",
                            stored, sum));
  }
  // Not damage: this run's flags differ (a ConfigError, no fallback).
  check_same_numerics(m.numerics, numerics, "the checkpoint in " + label);
  return m;
}

LoadedCheckpoint read_verified(const std::string& dir, const std::string& label,
                               const nlohmann::json& numerics,
                               const std::vector<std::pair<std::string, at::Tensor>>& expected,
                               int rank, int world) {
  const Meta meta = read_meta(dir, label, numerics);
  LoadedCheckpoint ckpt;
  ckpt.dir = dir;
  ckpt.step = meta.step;
  const std::string name = rank_name(rank);
  const std::string path = dir + "/" + name;
  if (!fs::exists(path)) throw Fault(name + " is missing");
  try {
    Manifest manifest;
    H5::H5File file(path, H5F_ACC_RDONLY);
    H5::Group root = file.openGroup("/");
    const std::string format = read_string_attr(root, "format");
    if (format != kFormat) throw Fault("is not a \"" + std::string(kFormat) + "\" file (" + format + ")");
    manifest.attr("format", format);
    const int64_t step = h5util::read_int_attr(root, "step"),
                  file_rank = h5util::read_int_attr(root, "rank"),
                  file_world = h5util::read_int_attr(root, "world");
    if (step != meta.step) {
      throw Fault(fmt::format("holds step {}, meta.json says step {}", step, meta.step));
    }
    if (file_rank != rank || file_world != world) {
      throw Fault(fmt::format("holds rank {} of {}, expected rank {} of {}", file_rank, file_world,
                              rank, world));
    }
    for (const auto& [attr, value] : std::map<std::string, int64_t>{
             {"step", step}, {"rank", file_rank}, {"world", file_world}}) {
      manifest.attr(attr, std::to_string(value));
    }
    const std::string numerics_text = read_string_attr(root, "numerics");
    manifest.attr("numerics", numerics_text);
    if (nlohmann::json::parse(numerics_text, nullptr, false) != meta.numerics) {
      throw Fault("attribute numerics differs from meta.json's");
    }
    const std::string optim_text = read_string_attr(root, "optim");
    manifest.attr("optim", optim_text);
    const nlohmann::json stepped = nlohmann::json::parse(optim_text, nullptr, false);
    if (!stepped.is_array()) throw Fault("attribute optim is not a JSON list");

    std::map<std::string, std::vector<int64_t>> shapes;
    for (const auto& [pname, t] : expected) shapes[pname] = t.sizes().vec();
    for (const char* g : {"/params", "/optim"}) {
      if (!root.nameExists(g + 1) || root.childObjType(g + 1) != H5O_TYPE_GROUP) {
        throw Fault(std::string(g) + " is missing");
      }
    }
    H5::Group pg = file.openGroup("/params");
    for (const auto& pname : h5util::child_names(pg)) {
      if (shapes.count(pname) == 0) throw Fault("/params/" + pname + " is not a parameter here");
    }
    for (const auto& [pname, shape] : shapes) {
      ckpt.shards.emplace_back(pname,
                               read_checked(pg, "/params/" + pname, pname, shape, false, manifest));
    }
    H5::Group og = file.openGroup("/optim");
    std::set<std::string> listed;
    for (const auto& s : stepped) {
      if (!s.is_string() || shapes.count(s.get<std::string>()) == 0) {
        throw Fault("attribute optim lists " + s.dump() + ", not a parameter here");
      }
      listed.insert(s.get<std::string>());
    }
    for (const auto& gname : h5util::child_names(og)) {
      if (listed.count(gname) == 0) throw Fault("/optim/" + gname + " is not listed in attribute optim");
    }
    for (const auto& pname : listed) {
      const std::string gp = "/optim/" + pname;
      if (!og.nameExists(pname) || og.childObjType(pname) != H5O_TYPE_GROUP) {
        throw Fault(gp + " is missing (attribute optim lists AdamW state for it)");
      }
      H5::Group g = og.openGroup(pname);
      AdamState s;
      s.step = *read_checked(g, gp + "/step", "step", {}, true, manifest).data_ptr<int64_t>();
      if (s.step < 1 || s.step > meta.step) {
        throw Fault(fmt::format("{}/step is {}, expected 1..{}", gp, s.step, meta.step));
      }
      s.exp_avg = read_checked(g, gp + "/exp_avg", "exp_avg", shapes[pname], false, manifest);
      s.exp_avg_sq = read_checked(g, gp + "/exp_avg_sq", "exp_avg_sq", shapes[pname], false,
                                  manifest, /*nonnegative=*/true);
      ckpt.optim.emplace_back(pname, std::move(s));
    }
    // Catches what the checks above cannot see (a dataset added or removed
    // and its listing edited to match, a root attribute changed).
    const std::string digest = manifest.digest();
    if (digest != meta.digests.at(static_cast<size_t>(rank))) {
      throw Fault(fmt::format("digest {} differs from meta.json's {}", digest,
                              meta.digests.at(static_cast<size_t>(rank))));
    }
  } catch (const Fault& e) {
    throw Fault(name + ": " + e.what());
  } catch (const h5util::AttributeError& e) {
    throw Fault(name + ": " + e.what());
  } catch (const H5::Exception& e) {
    throw Fault(name + " cannot be read as HDF5 (" + h5_message(e) + ")");
  }
  return ckpt;
}

// The directories --resume considers, in order: checkpoint/, then every
// complete checkpoint.tmp-<step>/ newest first (a save that crashed after
// its meta.json), then checkpoint.old/. Rank 0 lists them for everyone.
std::vector<std::string> candidates(const WorldComm& comm, const std::string& out) {
  const int rank = comm.rank();
  nlohmann::json list = nlohmann::json::array({"checkpoint"});
  if (rank == 0) {
    std::vector<std::pair<int64_t, std::string>> tmps;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(out, ec)) {
      const std::string n = entry.path().filename().string();
      const std::string prefix = "checkpoint.tmp-";
      if (n.rfind(prefix, 0) != 0 || !fs::exists(entry.path() / "meta.json")) continue;
      try {
        tmps.emplace_back(std::stoll(n.substr(prefix.size())), n);
      } catch (const std::exception&) {
      }
    }
    std::sort(tmps.rbegin(), tmps.rend());
    for (const auto& [step, n] : tmps) list.push_back(n);
    if (fs::exists(out + "/checkpoint.old/meta.json")) list.push_back("checkpoint.old");
  }
  const std::string text = comm.broadcast(rank == 0 ? list.dump() : std::string(), 0);
  return nlohmann::json::parse(text).get<std::vector<std::string>>();
}

}  // namespace

std::string checkpoint_dir(const std::string& out) { return out + "/checkpoint"; }

void save_checkpoint(const std::string& out, int64_t step, const nlohmann::json& numerics,
                     const nlohmann::json& run,
                     const std::vector<std::pair<std::string, at::Tensor>>& shards,
                     torch::optim::AdamW& opt, const WorldComm& comm) {
  H5::Exception::dontPrint();
  const int rank = comm.rank(), world = comm.size();
  const HookSpec crash = crash_spec();
  const std::string final_dir = checkpoint_dir(out);
  const std::string tmp_name = "checkpoint.tmp-" + std::to_string(step);
  const std::string tmp = out + "/" + tmp_name;
  const std::string old = out + "/checkpoint.old";
  std::string error;
  if (rank == 0) {
    try {
      // A leftover of a crashed save of this step (never the checkpoint
      // this run resumed from: that one is older).
      remove_checkpoint_dir(tmp, nullptr);
      fs::create_directories(tmp);
    } catch (const std::exception& e) {
      error = "cannot create " + tmp + ": " + e.what();
    }
  }
  agree_or_throw(comm, error, "checkpoint: cannot write step " + std::to_string(step));
  Manifest manifest;
  const std::string path = tmp + "/" + rank_name(rank);
  try {
    write_rank_file(path, step, numerics, shards, opt, rank, world, manifest);
    crash_point(crash, "written", step, rank);
    fsync_path(path, false);
    if (rank == 0) fsync_path(tmp, true);
    crash_point(crash, "synced", step, rank);
  } catch (const H5::Exception& e) {
    error = "writing " + path + ": " + h5_message(e);
  } catch (const std::exception& e) {
    error = "writing " + path + ": " + e.what();
  }
  agree_or_throw(comm, error, "checkpoint: cannot write step " + std::to_string(step));

  // Every rank's digest goes into meta.json.
  const std::string digest = manifest.digest();
  const std::vector<std::string> digests = comm.all_gather(digest);
  if (rank == 0) {
    try {
      nlohmann::json meta = {{"format", kFormat}, {"step", step},         {"world", world},
                             {"numerics", numerics}, {"run", run}};
      for (int r = 0; r < world; ++r) {
        meta["files"].push_back(
            {{"name", rank_name(r)},
             {"digest", digests.at(static_cast<size_t>(r))}});
      }
      for (const auto& [name, shard] : shards) meta["parameters"].push_back(name);
      meta["checksum"] = meta_checksum(meta);
      write_durable(tmp + "/meta.json", meta.dump(2) + "\n");
      fsync_path(tmp, true);
      crash_point(crash, "meta", step, rank);
      // tmp is complete from here: the older ones may go.
      remove_checkpoint_dir(old, [&] { crash_point(crash, "cleanup", step, rank); });
      fsync_path(out, true);
      if (fs::exists(final_dir)) fs::rename(final_dir, old);
      fsync_path(out, true);
      crash_point(crash, "renamed-old", step, rank);
      fs::rename(tmp, final_dir);
      fsync_path(out, true);
      crash_point(crash, "renamed-new", step, rank);
      // Complete or not, every other tmp dir is older than checkpoint/ now.
      std::vector<std::string> stale;
      for (const auto& entry : fs::directory_iterator(out)) {
        if (entry.path().filename().string().rfind("checkpoint.tmp-", 0) == 0) {
          stale.push_back(entry.path().string());
        }
      }
      for (const auto& dir : stale) remove_checkpoint_dir(dir, nullptr);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  agree_or_throw(comm, error, "checkpoint: cannot publish step " + std::to_string(step));
}

LoadedCheckpoint resume_checkpoint(const std::string& out, const nlohmann::json& numerics,
                                   const std::vector<std::pair<std::string, at::Tensor>>& expected,
                                   const WorldComm& comm) {
  H5::Exception::dontPrint();
  const int rank = comm.rank(), world = comm.size();
  std::vector<std::string> faults;  // "checkpoint/ is damaged (...)"
  for (const std::string& name : candidates(comm, out)) {
    Outcome mine;
    LoadedCheckpoint ckpt;
    try {
      ckpt = read_verified(out + "/" + name, out + "/" + name, numerics, expected, rank, world);
    } catch (const Fault& e) {
      mine = {1, e.what()};
    } catch (const ConfigError& e) {
      mine = {2, e.what()};
    } catch (const std::exception& e) {
      mine = {1, e.what()};
    }
    const Outcome all = agree(comm, mine);
    if (all.code == 2) throw ConfigError(all.message);
    if (all.code == 0) {
      if (!faults.empty()) {
        ckpt.fallback_note = fmt::format("fsdp-train: {}; resuming from {}/ at step {}",
                                         fmt::join(faults, ", "), name, ckpt.step);
      }
      return ckpt;
    }
    faults.push_back(all.message == "does not exist"
                         ? name + "/ does not exist (a save was interrupted)"
                         : name + "/ is damaged (" + all.message + ")");
  }
  if (faults.size() == 1 && faults[0].find("does not exist") != std::string::npos) {
    throw CheckpointError("--resume: no checkpoint in " + out +
                          " (checkpoint/ does not exist); train without --resume first");
  }
  throw CheckpointError(fmt::format("--resume: no checkpoint in {} verifies: {}", out,
                                    fmt::join(faults, ", ")));
}

void load_optimizer_state(const LoadedCheckpoint& ckpt, const std::vector<std::string>& names,
                          torch::optim::AdamW& opt) {
  const auto& params = opt.param_groups().at(0).params();
  if (params.size() != names.size()) {
    throw std::logic_error("load_optimizer_state: names and parameters disagree");
  }
  std::map<std::string, const AdamState*> by_name;
  for (const auto& [name, s] : ckpt.optim) by_name[name] = &s;
  // resume_checkpoint checked every shape against this rank's shards.
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = by_name.find(names[i]);
    if (it == by_name.end()) continue;  // not stepped yet when saved
    const AdamState& s = *it->second;
    auto state = std::make_unique<torch::optim::AdamWParamState>();
    state->step(s.step);
    state->exp_avg(s.exp_avg.to(params[i].device(), /*non_blocking=*/false, /*copy=*/true));
    state->exp_avg_sq(s.exp_avg_sq.to(params[i].device(), /*non_blocking=*/false, /*copy=*/true));
    opt.state()[fsdp::optimizer_state_key(opt, params[i])] = std::move(state);
  }
}

}  // namespace fsdp_train
