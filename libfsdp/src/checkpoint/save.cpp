// Saving: plan (who writes which piece), snapshot (this rank's pieces to
// host memory), write and publish (docs/distributed_checkpoint.md, "Publish
// sequence"). save() runs all three; AsyncSaver runs the last on a thread.
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

#include <chrono>
#include <ctime>
#include <iostream>
#include <map>
#include <mutex>
#include <thread>

namespace fsdp::dcp {
namespace detail {
namespace {

using nlohmann::json;
using Kind = CheckpointError::Kind;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

ProcessGroupPtr checkpoint_group() {
  return fsdp::detail::side_group_for(world_group(), fsdp::detail::SideGroup::Checkpoint);
}

// testing::set_publish_observer's observer; called on rank 0 only.
testing::PublishObserver& publish_observer() {
  static testing::PublishObserver observer;
  return observer;
}

void published(const char* phase, int64_t step, int rank) {
  if (rank == 0 && publish_observer()) publish_observer()(phase, step);
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string dataset_of(const std::string& tensor, const Box& box) {
  std::string d = "/" + tensor + "/";
  if (box.offsets.empty()) return d + "scalar";
  for (size_t i = 0; i < box.offsets.size(); ++i) {
    d += (i ? "_" : "") + std::to_string(box.offsets[i]);
  }
  return d;
}

json box_json(const Box& b) { return json::array({b.offsets, b.sizes}); }

// Per tensor: its description and which ranks hold which box.
struct Planned {
  std::string kind, dtype;
  std::vector<int64_t> shape;
  int first_rank = -1;
  std::map<Box, std::vector<int>> holders;
};

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

}  // namespace

// A save between its snapshot and its publication.
struct Snapshot {
  std::string root, final_dir, tmp_dir, file_name;
  int64_t step = 0;
  int rank = 0;
  SaveOptions options;
  ProcessGroupPtr group;
  struct Piece {
    std::string tensor, dataset;
    at::Tensor data;  // contiguous host copy
  };
  std::vector<Piece> pieces;
  // Host buffers of a finished save, by dataset: the next snapshot copies
  // into them where the piece is the same (no allocation -- pinned memory
  // is slow to allocate -- and no page faults in the stall).
  std::map<std::string, at::Tensor> spare;
  Index index;      // rank 0: everything but the file sizes
  GlobalView view;  // rank 0
  SaveReport report;
};

namespace {

void check_save_args(const std::string& dir, const SaveOptions& options) {
  if (options.step < 0) {
    throw ArgumentError("options", "distributed checkpoint: SaveOptions::step is " +
                                       std::to_string(options.step) + "; accepted: >= 0");
  }
  if (options.keep_last < 1) {
    throw ArgumentError("keep_last", "distributed checkpoint: SaveOptions::keep_last is " +
                                         std::to_string(options.keep_last) + "; accepted: >= 1");
  }
  if (dir.empty()) throw ArgumentError("dir", "distributed checkpoint: dir is empty");
}

// What this rank holds (its items), described for every rank: tensors with
// their boxes, values, rank-local values, optimizers.
json describe(const State& state, const std::vector<Item>& items) {
  json mine;
  json tensors = json::array();
  for (const auto& it : items) {
    json boxes = json::array();
    for (const auto& b : it.boxes) boxes.push_back(box_json(b.global));
    tensors.push_back({{"n", it.name}, {"k", it.kind}, {"d", dtype_name(it.dtype, it.name)},
                       {"s", it.shape}, {"b", boxes}});
  }
  mine["tensors"] = tensors;
  json values = json::object(), rank_values = json::object();
  for (const auto& [name, e] : state.entries()) {
    if (std::holds_alternative<at::Tensor>(e.value)) continue;
    (e.rank_local ? rank_values : values)[name] = value_json(e.value);
  }
  mine["values"] = values;
  mine["rank_values"] = rank_values;
  json optimizers = json::object();
  for (const auto& o : state.optimizers()) {
    optimizers[o.prefix] = {{"type", optimizer_type(*o.optimizer)},
                            {"module", o.module_prefix},
                            {"param_groups", optimizer_groups(*o.optimizer)}};
  }
  mine["optimizers"] = optimizers;
  return mine;
}

// Every rank's descriptions merged: the same on every rank.
struct Plan {
  std::map<std::string, Planned> tensors;
  json values, rank_values = json::object(), optimizers = json::object();
};

// One rank's tensors into the plan; ArgumentError when a tensor's dtype or
// shape differs from the first rank that holds it.
void add_tensors(Plan& plan, const json& described, int r) {
  for (const auto& t : described.at("tensors")) {
    const std::string name = t.at("n");
    Planned& p = plan.tensors[name];
    const auto shape = t.at("s").get<std::vector<int64_t>>();
    if (p.first_rank < 0) {
      p.kind = t.at("k");
      p.dtype = t.at("d");
      p.shape = shape;
      p.first_rank = r;
    } else if (p.dtype != t.at("d") || p.shape != shape) {
      throw ArgumentError("state", "distributed checkpoint: '" + name + "' is " + p.dtype + " " +
                                       shape_str(p.shape) + " on rank " +
                                       std::to_string(p.first_rank) + " but " +
                                       t.at("d").get<std::string>() + " " + shape_str(shape) +
                                       " on rank " + std::to_string(r));
    }
    for (const auto& b : t.at("b")) {
      Box box{b.at(0).get<std::vector<int64_t>>(), b.at(1).get<std::vector<int64_t>>()};
      p.holders[box].push_back(r);
    }
  }
}

// The pieces of a tensor must tile it: pairwise disjoint, covering it.
void check_tiling(const Plan& plan) {
  for (const auto& [name, p] : plan.tensors) {
    std::vector<Box> boxes;
    int64_t covered = 0;
    for (const auto& [box, ranks] : p.holders) {
      for (const Box& other : boxes) {
        if (!empty(intersect(box, other))) {
          throw ArgumentError("state", "distributed checkpoint: '" + name + "' has pieces " +
                                           box_str(other) + " and " + box_str(box) +
                                           " that overlap without being equal (ranks " +
                                           std::to_string(ranks.front()) +
                                           ", ...): the layouts differ between ranks");
        }
      }
      boxes.push_back(box);
      covered += box.numel();
    }
    if (covered != numel_of(p.shape)) {
      throw ArgumentError("state", "distributed checkpoint: the ranks' pieces of '" + name +
                                       "' " + shape_str(p.shape) + " cover " +
                                       std::to_string(covered) + " of its " +
                                       std::to_string(numel_of(p.shape)) + " elements");
    }
  }
}

Plan merge(const std::vector<std::string>& described) {
  Plan plan;
  for (int r = 0; r < static_cast<int>(described.size()); ++r) {
    const json d = json::parse(described[static_cast<size_t>(r)]);
    add_tensors(plan, d, r);
    if (r == 0) {
      plan.values = d.at("values");
      plan.optimizers = d.at("optimizers");
    } else if (d.at("values") != plan.values) {
      throw ArgumentError("state", "distributed checkpoint: the values set with set() differ "
                                   "between rank 0 (" + plan.values.dump() + ") and rank " +
                                       std::to_string(r) + " (" + d.at("values").dump() +
                                       "); set() values must be the same on every rank "
                                       "(set_rank_local() is per rank)");
    }
    for (const auto& [name, v] : d.at("rank_values").items()) {
      json& per_rank = plan.rank_values[name];
      if (per_rank.is_null()) per_rank = json::array();
      while (static_cast<int>(per_rank.size()) < r) per_rank.push_back(nullptr);
      per_rank.push_back(v);
    }
  }
  check_tiling(plan);
  return plan;
}

// This rank's copy of a piece it writes, into a buffer of `reuse` where one
// fits (same dataset, shape, dtype and pinning).
at::Tensor host_copy(const at::Tensor& src, at::ScalarType dtype, const std::string& dataset,
                     const std::map<std::string, at::Tensor>& reuse) {
  at::Tensor host;
  auto old = reuse.find(dataset);
  if (old != reuse.end() && old->second.sizes() == src.sizes() &&
      old->second.scalar_type() == dtype && old->second.is_pinned() == src.is_cuda()) {
    host = old->second;
  } else {
    auto opts = at::TensorOptions().dtype(dtype);
    if (src.is_cuda()) opts = opts.pinned_memory(true);
    host = at::empty(src.sizes(), opts);
  }
  host.copy_(src);  // blocking: the writer thread reads it next
  return host;
}

// Writers: each piece by the holder with the fewest bytes so far. Fills the
// index's tensors (and rank 0's view) and copies the pieces this rank
// writes; returns the checkpoint's tensor bytes.
int64_t assign_writers(Snapshot& s, const Plan& plan, const std::vector<Item>& items,
                       const std::map<std::string, at::Tensor>& reuse) {
  std::vector<int64_t> assigned(static_cast<size_t>(s.group->size()), 0);
  std::map<std::string, const Item*> by_name;
  for (const auto& it : items) by_name[it.name] = &it;
  int64_t total = 0;
  for (const auto& [name, p] : plan.tensors) {
    IndexTensor t{name, p.kind, dtype_of(p.dtype, name, ""), p.shape, {}};
    GlobalView::Tensor v{name, t.dtype, p.shape, {}};
    const int64_t elem = static_cast<int64_t>(c10::elementSize(t.dtype));
    for (const auto& [box, ranks] : p.holders) {
      int writer = ranks.front();
      for (int r : ranks) {
        if (assigned[static_cast<size_t>(r)] < assigned[static_cast<size_t>(writer)]) writer = r;
      }
      assigned[static_cast<size_t>(writer)] += box.numel() * elem;
      total += box.numel() * elem;
      const std::string file = rank_file(writer);
      const std::string dataset = dataset_of(name, box);
      t.chunks.push_back({file, dataset, box.offsets, box.sizes});
      v.pieces.push_back({file, dataset, box});
      if (writer != s.rank) continue;
      const Item& item = *by_name.at(name);
      for (const auto& lb : item.boxes) {
        if (!(lb.global == box)) continue;
        at::Tensor host = host_copy(region(item.local, lb), item.dtype, dataset, reuse);
        s.pieces.push_back({name, dataset, host});
        s.report.peak_snapshot_bytes += host.numel() * elem;
      }
    }
    s.index.tensors.emplace(name, std::move(t));
    if (s.rank == 0) s.view.tensors.push_back(std::move(v));
  }
  return total;
}

// The plan's values, rank-local values and optimizers into the index.
void add_values(Index& index, const Plan& plan) {
  for (const auto& [name, v] : plan.values.items()) {
    index.values.emplace(name, value_from_json(v, name, ""));
  }
  for (const auto& [name, arr] : plan.rank_values.items()) {
    std::vector<std::optional<Value>> per_rank;
    for (const auto& v : arr) {
      per_rank.push_back(v.is_null() ? std::nullopt
                                     : std::optional<Value>(value_from_json(v, name, "")));
    }
    index.rank_values.emplace(name, std::move(per_rank));
  }
  for (const auto& [prefix, o] : plan.optimizers.items()) index.optimizers[prefix] = o;
}

}  // namespace

// `reuse`: buffers of an earlier snapshot (Snapshot::spare), taken over
// where a piece has the same dataset, shape and dtype. Every step that can
// fail on one rank is agreed on before the next collective.
Snapshot take_snapshot(const std::string& dir, const State& state, const SaveOptions& options,
                       std::map<std::string, at::Tensor> reuse = {}) {
  check_save_args(dir, options);
  const auto start = Clock::now();
  Snapshot s;
  s.group = checkpoint_group();
  s.rank = s.group->rank();
  s.root = dir;
  s.step = options.step;
  s.options = options;
  s.final_dir = step_dir(dir, options.step);
  s.tmp_dir = s.final_dir + ".tmp";
  s.file_name = rank_file(s.rank);

  std::vector<Item> items;
  json mine;
  std::exception_ptr error;
  try {
    items = items_for_save(state);
    mine = describe(state, items);
  } catch (...) {
    error = std::current_exception();
  }
  agree(s.group, error);
  const auto all = all_gather_text(s.group, mine.dump());

  Plan plan;
  try {
    plan = merge(all);  // every rank builds the same plan from the same descriptions
  } catch (...) {
    error = std::current_exception();
  }
  agree(s.group, error);

  s.index.step = options.step;
  s.index.world_size = s.group->size();
  s.index.created = utc_now();
  s.index.libfsdp_version = FSDP_VERSION_STRING;
  int64_t total = 0;
  error = nullptr;
  try {
    total = assign_writers(s, plan, items, reuse);
    add_values(s.index, plan);
    if (s.rank == 0) {
      remove_tree(s.tmp_dir);
      make_dir(s.root);
      make_dir(s.tmp_dir);
    }
  } catch (...) {
    error = std::current_exception();
  }
  agree(s.group, error);  // also: the directory exists before anyone writes
  s.report.path = s.final_dir;
  s.report.step = options.step;
  s.report.total_bytes = total;
  s.report.snapshot_seconds = seconds_since(start);
  return s;
}

SaveReport write_snapshot(Snapshot& s) {
  const auto start = Clock::now();
  std::exception_ptr error;
  int64_t bytes = 0;
  try {
    if (!s.pieces.empty()) {
      const std::string path = s.tmp_dir + "/" + s.file_name;
      {
        Handle f = create_file(path);
        for (const auto& p : s.pieces) write_piece(f.get(), p.dataset, p.data, p.tensor, path);
      }
      if (s.options.fsync) sync_path(path);
      bytes = file_size(path);
    }
  } catch (...) {
    error = std::current_exception();
  }
  published("written", s.step, s.rank);
  agree(s.group, error);
  for (auto& p : s.pieces) s.spare[p.dataset] = std::move(p.data);
  s.pieces.clear();
  const auto sizes = all_gather_text(s.group, std::to_string(bytes));
  error = nullptr;
  if (s.rank == 0) {
    try {
      for (size_t r = 0; r < sizes.size(); ++r) {
        const int64_t b = std::stoll(sizes[r]);
        if (b > 0) s.index.files[rank_file(static_cast<int>(r))] = b;
      }
      write_global_view(s.tmp_dir + "/" + kGlobalFile, s.view, s.step);
      write_text(s.tmp_dir + "/" + kIndexFile, index_text(s.index), s.options.fsync);
      if (s.options.fsync) {
        sync_path(s.tmp_dir + "/" + kGlobalFile);
        sync_path(s.tmp_dir);
      }
      published("index", s.step, s.rank);
      publish(s.tmp_dir, s.final_dir, s.root);
      published("renamed", s.step, s.rank);
      prune(s.root, s.options.keep_last);
      published("pruned", s.step, s.rank);
    } catch (...) {
      error = std::current_exception();
    }
  }
  agree(s.group, error);
  s.report.bytes_written = bytes;
  s.report.write_seconds = seconds_since(start);
  return s.report;
}

}  // namespace detail

namespace testing {
void set_publish_observer(PublishObserver observer) {
  detail::publish_observer() = std::move(observer);
}
}  // namespace testing

SaveReport save(const std::string& dir, const State& state, const SaveOptions& options) {
  detail::Snapshot s = detail::take_snapshot(dir, state, options);
  return detail::write_snapshot(s);
}

struct AsyncSaver::Impl {
  std::string dir;
  SaveOptions defaults;
  std::thread worker;
  std::mutex mu;
  bool running = false;
  std::optional<SaveReport> report;
  std::exception_ptr error;
  std::shared_ptr<detail::Snapshot> last;  // its spare buffers serve the next save

  std::optional<SaveReport> join() {
    if (worker.joinable()) worker.join();
    std::lock_guard<std::mutex> lock(mu);
    running = false;
    if (error) {
      auto e = error;
      error = nullptr;
      report.reset();
      std::rethrow_exception(e);
    }
    auto r = report;
    report.reset();
    return r;
  }
};

AsyncSaver::AsyncSaver(std::string dir, SaveOptions defaults) : impl_(std::make_unique<Impl>()) {
  if (dir.empty()) throw ArgumentError("dir", "distributed checkpoint: AsyncSaver dir is empty");
  if (defaults.keep_last < 1) {
    throw ArgumentError("keep_last", "distributed checkpoint: SaveOptions::keep_last is " +
                                         std::to_string(defaults.keep_last) + "; accepted: >= 1");
  }
  impl_->dir = std::move(dir);
  impl_->defaults = defaults;
}

AsyncSaver::~AsyncSaver() {
  try {
    impl_->join();
  } catch (const std::exception& e) {
    std::cerr << "libfsdp: an asynchronous checkpoint save failed and nobody asked: " << e.what()
              << "\n";
  }
}

void AsyncSaver::save(const State& state, int64_t step) {
  impl_->join();  // at most one in flight; raises the previous one's error
  SaveOptions options = impl_->defaults;
  options.step = step;
  std::map<std::string, at::Tensor> spare;
  if (impl_->last) spare = std::move(impl_->last->spare);
  impl_->last.reset();
  auto snapshot = std::make_shared<detail::Snapshot>(
      detail::take_snapshot(impl_->dir, state, options, std::move(spare)));
  impl_->last = snapshot;
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->running = true;
  Impl* impl = impl_.get();
  impl_->worker = std::thread([impl, snapshot] {
    std::optional<SaveReport> report;
    std::exception_ptr error;
    try {
      report = detail::write_snapshot(*snapshot);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(impl->mu);
    impl->report = report;
    impl->error = error;
  });
}

std::optional<SaveReport> AsyncSaver::wait() { return impl_->join(); }

bool AsyncSaver::in_flight() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->running && !impl_->report && !impl_->error;
}

}  // namespace fsdp::dcp
