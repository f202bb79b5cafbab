// Loading: choose the checkpoint, check it against the state, read this
// rank's byte ranges into host buffers, agree, install -- and on damage fall
// back to the next older checkpoint (distributed_checkpoint.h).
#include "fsdp/distributed_checkpoint.h"

#include "base/shape_str.h"
#include "checkpoint/exchange.h"
#include "checkpoint/files.h"
#include "checkpoint/h5io.h"
#include "checkpoint/index.h"
#include "checkpoint/items.h"
#include "checkpoint/layout.h"
#include "comm/group_registry.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <sstream>

namespace fsdp::dcp {
namespace detail {
namespace {

using Kind = CheckpointError::Kind;
using Clock = std::chrono::steady_clock;

// The optimizers recorded against the state's (before their fields are
// looked for: another type has other fields).
void check_optimizers(const State& state, const Index& index, const std::string& shown) {
  for (const auto& o : state.optimizers()) {
    auto it = index.optimizers.find(o.prefix);
    const std::string type = optimizer_type(*o.optimizer);
    if (it == index.optimizers.end()) {
      throw CheckpointError(Kind::MissingTensor, o.prefix, shown,
                            shown + " has no optimizer '" + o.prefix + "' (it has " +
                                std::to_string(index.optimizers.size()) + " optimizer(s))");
    }
    const std::string saved = it->second.value("type", "");
    if (saved != type) {
      throw CheckpointError(Kind::OptimizerMismatch, o.prefix, shown,
                            shown + ": optimizer '" + o.prefix + "' was saved as " + saved +
                                "; the state's is " + type);
    }
  }
}

// The checkpoint's tensors against the state's: every failure here is a
// mismatch (no fallback), named with both sides.
void check_against(const State& state, const Index& index, const std::vector<Item>& items,
                   const std::string& shown) {
  size_t module_items = 0, found = 0;
  std::string first_missing;
  for (const auto& it : items) {
    if (it.kind != "param" && it.kind != "buffer") continue;
    ++module_items;
    if (index.tensors.count(it.name)) {
      ++found;
    } else if (first_missing.empty()) {
      first_missing = it.name;
    }
  }
  if (module_items > 0 && found == 0) {
    throw CheckpointError(Kind::OtherModel, first_missing, shown,
                          shown + " is a checkpoint of another model: it has none of the " +
                              std::to_string(module_items) + " tensors of this rank's modules (e.g. '" +
                              first_missing + "')");
  }
  for (const auto& it : items) {
    auto t = index.tensors.find(it.name);
    if (t == index.tensors.end()) {
      throw CheckpointError(Kind::MissingTensor, it.name, shown,
                            shown + " has no tensor '" + it.name + "'");
    }
    if (t->second.dtype != it.dtype) {
      throw CheckpointError(Kind::DtypeMismatch, it.name, shown,
                            shown + ": '" + it.name + "' is " +
                                dtype_name(t->second.dtype, it.name) + " in the checkpoint and " +
                                dtype_name(it.dtype, it.name) + " in the state");
    }
    if (t->second.shape != it.shape) {
      throw CheckpointError(Kind::ShapeMismatch, it.name, shown,
                            shown + ": '" + it.name + "' has global shape " +
                                shape_str(t->second.shape) + " in the checkpoint and " +
                                shape_str(it.shape) + " in the state");
    }
  }
  for (const auto& [name, e] : state.entries()) {
    if (e.rank_local) continue;
    const bool tensor = std::holds_alternative<at::Tensor>(e.value);
    if (tensor ? index.tensors.count(name) == 0 : index.values.count(name) == 0) {
      throw CheckpointError(Kind::MissingTensor, name, shown,
                            shown + " has no value '" + name + "'");
    }
  }
}

// Every rank file the index lists: inside the checkpoint, regular, of the
// size written.
void check_files(const Index& index, const std::string& dir, const std::string& shown) {
  for (const auto& [file, bytes] : index.files) check_rank_file(dir, file, bytes, shown);
}

struct Loaded {
  std::vector<Item> items;
  std::vector<at::Tensor> staging;
  Index index;
  LoadReport report;
};

// Reads this rank's boxes of every item into host buffers.
void read_items(Loaded& l, const std::string& dir, bool check_finite) {
  std::map<std::string, Handle> files;
  auto file = [&](const std::string& name) -> hid_t {
    auto it = files.find(name);
    // check_files vetted every listed file, and check_index keeps chunks to listed ones.
    if (it == files.end()) it = files.emplace(name, open_file(dir + "/" + name, name)).first;
    return it->second.get();
  };
  for (const auto& item : l.items) {
    const IndexTensor& t = l.index.tensors.at(item.name);
    at::Tensor staging = at::empty(item.local.sizes(), at::TensorOptions().dtype(item.dtype));
    bool resharded = false;
    for (const auto& lb : item.boxes) {
      int64_t covered = 0;
      for (const auto& c : t.chunks) {
        const Box stored{c.offsets, c.sizes};
        const Box part = intersect(lb.global, stored);
        if (empty(part) && !part.sizes.empty()) continue;
        if (!(part == lb.global) || !(stored == lb.global)) resharded = true;
        at::Tensor dst = region(staging, lb, part);
        // Straight into the host buffer where the part is one block of it.
        at::Tensor buf = dst.is_contiguous()
                             ? dst
                             : at::empty(part.sizes, at::TensorOptions().dtype(item.dtype));
        read_piece(file(c.file), c.dataset, stored, part, buf, item.name, c.file);
        if (!buf.is_same(dst)) dst.copy_(buf);
        covered += part.numel();
        l.report.bytes_read += part.numel() * static_cast<int64_t>(buf.element_size());
      }
      if (covered != lb.global.numel()) {
        throw CheckpointError(Kind::Incomplete, item.name, "",
                              "the checkpoint's pieces of '" + item.name + "' cover " +
                                  std::to_string(covered) + " of the " +
                                  std::to_string(lb.global.numel()) + " elements of " +
                                  box_str(lb.global) + " this rank needs");
      }
    }
    if (check_finite && (item.kind == "param" || item.kind == "optim") &&
        at::isFloatingType(item.dtype) && staging.numel() > 0 &&
        !at::isfinite(staging).all().item<bool>()) {
      const int64_t bad = staging.numel() - at::isfinite(staging).sum().item<int64_t>();
      throw CheckpointError(Kind::Corrupt, item.name, t.chunks.empty() ? "" : t.chunks[0].file,
                            "'" + item.name + "' holds " + std::to_string(bad) +
                                " non-finite value(s) in the part this rank loads (NaN or "
                                "infinity in a parameter or optimizer state)");
    }
    if (resharded) {
      std::ostringstream line;
      line << item.name << " " << shape_str(item.shape) << ": saved as " << t.chunks.size()
           << " piece(s), read as " << item.boxes.size() << " piece(s) (" << item.layout << ")";
      l.report.resharded.push_back(line.str());
    }
    l.staging.push_back(staging);
  }
}

void install(State& state, Loaded& l, int rank) {
  clear_optimizer_state(state);
  for (size_t i = 0; i < l.items.size(); ++i) {
    if (l.items[i].install) l.items[i].install(l.staging[i]);
  }
  auto& entries = state.mutable_entries();
  for (const auto& [name, v] : l.index.values) entries[name] = State::Entry{v, false};
  const bool same_world = l.index.world_size == world_group()->size();
  for (const auto& [name, per_rank] : l.index.rank_values) {
    if (!same_world) {
      l.report.rank_local_dropped.push_back(name);
    } else if (rank < static_cast<int>(per_rank.size()) && per_rank[static_cast<size_t>(rank)]) {
      entries[name] = State::Entry{*per_rank[static_cast<size_t>(rank)], true};
    }
  }
  if (!same_world) {
    for (const auto& [name, t] : l.index.tensors) {
      if (t.kind == "rank_local" && name.rfind("__rank0/", 0) == 0) {
        l.report.rank_local_dropped.push_back(name.substr(8));
      }
    }
  }
}

LoadReport load_one(const std::string& dir, State& state, const ProcessGroupPtr& group,
                    const LoadOptions& options) {
  const auto start = Clock::now();
  const int rank = group->rank();
  Loaded l;
  std::exception_ptr error;
  try {
    l.index = read_index(dir);
    check_files(l.index, dir, dir);
    const bool same_world = l.index.world_size == group->size();
    check_optimizers(state, l.index, dir);
    l.items = items_for_load(state, l.index, dir, rank, same_world);
    check_against(state, l.index, l.items, dir);
    read_items(l, dir, options.check_finite);
  } catch (...) {
    error = std::current_exception();
  }
  agree(group, error);  // nothing is installed unless every rank read all it needs
  install(state, l, rank);
  l.report.path = dir;
  l.report.step = l.index.step;
  l.report.saved_world_size = l.index.world_size;
  l.report.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return l.report;
}

bool is_damage(CheckpointError::Kind k) {
  return k == Kind::Corrupt || k == Kind::Incomplete || k == Kind::NotFound;
}

}  // namespace
}  // namespace detail

LoadReport load(const std::string& dir, State& state, const LoadOptions& options) {
  using namespace detail;
  const ProcessGroupPtr group =
      fsdp::detail::side_group_for(world_group(), fsdp::detail::SideGroup::Checkpoint);
  // Rank 0 decides the candidates, so every rank tries the same ones: "+"
  // a checkpoint, "-" a step directory without index.json (noted, skipped).
  std::string listed;
  if (group->rank() == 0) {
    if (exists(dir + "/" + kIndexFile)) {
      listed = "+" + dir + "\n";
    } else {
      for (const auto& s : list_step_dirs(dir)) {
        if (!options.step || s.step == *options.step) {
          listed += (s.has_index ? "+" : "-") + s.path + "\n";
        }
      }
    }
  }
  listed = broadcast_text(group, listed, 0);
  std::vector<std::string> candidates;
  std::istringstream lines(listed);
  for (std::string line; std::getline(lines, line);) candidates.push_back(line);
  std::string notes;
  const auto note = [&](const std::string& line) { notes += (notes.empty() ? "" : "; ") + line; };
  const auto loadable_after = [&](size_t i) {
    return std::any_of(candidates.begin() + static_cast<std::ptrdiff_t>(i) + 1, candidates.end(),
                       [](const std::string& c) { return c[0] == '+'; });
  };
  for (size_t i = 0; i < candidates.size(); ++i) {
    const std::string path = candidates[i].substr(1);
    if (candidates[i][0] == '-') {
      note("skipped " + path + ": no index.json (incomplete or damaged)");
      continue;
    }
    try {
      LoadReport r = load_one(path, state, group, options);
      r.fallback_note = notes;
      return r;
    } catch (const CheckpointError& e) {
      if (!options.fallback || !is_damage(e.kind())) throw;
      if (!loadable_after(i)) {
        if (notes.empty()) throw;
        // No checkpoint loaded: say why the newer ones were skipped too.
        throw CheckpointError(e.kind(), e.tensor(), e.file(),
                              std::string(e.what()) + " (and newer ones were skipped: " + notes +
                                  ")");
      }
      note("skipped " + path + ": " + e.what());
    }
  }
  throw CheckpointError(CheckpointError::Kind::NotFound, "", dir,
                        "no complete checkpoint" +
                            (options.step ? " of step " + std::to_string(*options.step) : "") +
                            " under " + dir + (notes.empty() ? "" : " (" + notes + ")"));
}

}  // namespace fsdp::dcp
