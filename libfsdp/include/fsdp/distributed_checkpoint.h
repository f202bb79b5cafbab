// Distributed checkpoints: every rank saves its pieces of the model, the
// optimizer and your own values into one checkpoint, and any other number
// of ranks, in any other layout, loads it back.
//
//   fsdp::dcp::State state;
//   state.add_module("model", model)                  // parameters + buffers
//        .add_optimizer("optim", optimizer, "model")  // keyed by parameter name
//        .set("step", step);                          // your values
//   fsdp::dcp::SaveOptions options;
//   options.step = step;
//   fsdp::dcp::save("ckpt", state, options);          // ckpt/step-<step>/
//   ...                                               // another job, any layout:
//   fsdp::dcp::LoadReport r = fsdp::dcp::load("ckpt", state);
//   int64_t step = state.get_int("step");
//
// What is saved (docs/distributed_checkpoint.md has the file format):
//  - every parameter and buffer of each added module, by its name under the
//    prefix: FSDP shards (1-D, HSDP, 2-D with TP, per pipeline stage, EP
//    experts), TP/EP DTensor parameters no unit manages, and plain tensors
//    (ignored parameters, buffers, unsharded modules). A plain tensor is
//    taken to be the same on every rank that holds it, as fully_shard
//    takes ignored parameters to be; one of those ranks writes it.
//  - each added optimizer's per-parameter state (AdamW/Adam: exp_avg,
//    exp_avg_sq, max_exp_avg_sq, step; SGD: momentum_buffer; Adagrad: sum,
//    step; RMSprop: square_avg, momentum_buffer, grad_avg, step), laid out
//    like its parameter, so it reshards with it; and its type and options.
//  - the values you set: int64, double, string or tensor, the same on every
//    rank (set) or this rank's own (set_rank_local).
// Each piece of each tensor is written once, however many ranks hold it
// (HSDP replicas, TP-replicated norms, plain tensors), by a holder chosen to
// balance the bytes each rank writes.
//
// Loading reads, on each rank, only the byte ranges of the pieces its own
// layout needs, verifies them (HDF5 Fletcher-32 per storage block of 4 MiB,
// metadata checksums, file sizes, the index's checksum), agrees on one
// verdict with every rank, and only then installs them -- a damaged or
// incomplete checkpoint never reaches the model. Damage falls back to the
// next older complete checkpoint (LoadOptions::fallback) and the report says
// so; a checkpoint that does not fit the state (missing tensor, other shape
// or dtype, other optimizer, another model) is an error, never a partial
// load.
//
// All of save, load and AsyncSaver::save are collective over the world:
// every rank calls them in the same order with states that name the same
// tensors (each rank holding its own pieces). Checkpoints live on a file
// system every rank sees at the same path. Errors are raised alike on every
// rank (same type, same message) unless noted.
#pragma once

#include "fsdp/dtensor.h"
#include "fsdp/errors.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace fsdp::dcp {

// The format this library writes and reads (index.json "version").
inline constexpr int kFormatVersion = 1;

// A checkpoint that cannot be used for this state. kind() says why;
// tensor() and file() name what, where it applies ("" otherwise).
class CheckpointError : public Error {
 public:
  enum class Kind {
    NotFound,           // no checkpoint at the path (or none complete under it)
    Corrupt,            // a checksum, size or structure does not verify
    Incomplete,         // a file, chunk or part of a tensor is missing
    MissingTensor,      // the state names a tensor the checkpoint lacks
    ShapeMismatch,      // global shapes differ (both named in the message)
    DtypeMismatch,      // dtypes differ
    OptimizerMismatch,  // another optimizer type, or state for other parameters
    OtherModel,         // none of the state's tensors is in the checkpoint
    Format,             // another format or a newer version
    Io,                 // the file system refused (message has errno's text)
  };
  CheckpointError(Kind kind, std::string tensor, std::string file, const std::string& what)
      : Error(what), kind_(kind), tensor_(std::move(tensor)), file_(std::move(file)) {}
  Kind kind() const noexcept { return kind_; }
  const std::string& tensor() const noexcept { return tensor_; }
  const std::string& file() const noexcept { return file_; }

 private:
  Kind kind_;
  std::string tensor_, file_;
};
// "not-found", "corrupt", ... (what fsdp-checkpoint prints).
std::string to_string(CheckpointError::Kind kind);

// A value you store: an integer, a double (bitwise), a string, or a tensor
// (CPU or CUDA; loaded onto the CPU unless the state holds one to load into).
using Value = std::variant<int64_t, double, std::string, at::Tensor>;

// What a checkpoint holds, by name. Names are '/'-separated paths of
// [A-Za-z0-9_.-] components (module and optimizer entries get
// "<prefix>/<parameter name>"); ArgumentError naming "name" or "prefix"
// otherwise, or when a name is taken twice.
class State {
 public:
  // Every parameter and buffer of `module` (its whole tree) as
  // "<prefix>/<name>". Load writes into them in place.
  State& add_module(const std::string& prefix, std::shared_ptr<torch::nn::Module> module);
  // The per-parameter state of `optimizer` as
  // "<prefix>/<parameter name>/<state name>"; its parameters must be
  // parameters of the module added as `module_prefix` (ArgumentError naming
  // "optimizer" otherwise, or "module_prefix" for an unknown prefix). Only
  // AdamW, Adam, SGD, Adagrad and RMSprop are supported (ArgumentError
  // naming "optimizer"). Load replaces its per-parameter state.
  State& add_optimizer(const std::string& prefix, torch::optim::Optimizer& optimizer,
                       const std::string& module_prefix);
  // A sharded tensor of your own; load writes into its local tensor.
  State& add_dtensor(const std::string& name, const DTensor& tensor);
  // A value the same on every rank; written once. Load sets it from the
  // checkpoint.
  State& set(const std::string& name, Value value);
  // This rank's own value (RNG state, data cursor). Load sets it only when
  // the checkpoint was saved by as many ranks (LoadReport::rank_local_dropped
  // lists it otherwise).
  State& set_rank_local(const std::string& name, Value value);

  bool has(const std::string& name) const;
  // ArgumentError naming "name" if absent or of another type.
  const Value& get(const std::string& name) const;
  int64_t get_int(const std::string& name) const;
  double get_double(const std::string& name) const;
  const std::string& get_string(const std::string& name) const;
  const at::Tensor& get_tensor(const std::string& name) const;

  struct Module {
    std::string prefix;
    std::shared_ptr<torch::nn::Module> module;
  };
  struct Optimizer {
    std::string prefix;
    torch::optim::Optimizer* optimizer;
    std::string module_prefix;
  };
  struct Entry {
    Value value;
    bool rank_local = false;
  };
  const std::vector<Module>& modules() const { return modules_; }
  const std::vector<Optimizer>& optimizers() const { return optimizers_; }
  const std::vector<std::pair<std::string, DTensor>>& dtensors() const { return dtensors_; }
  const std::map<std::string, Entry>& entries() const { return entries_; }
  std::map<std::string, Entry>& mutable_entries() { return entries_; }

 private:
  void claim(const std::string& name, const char* argument);
  std::vector<Module> modules_;
  std::vector<Optimizer> optimizers_;
  std::vector<std::pair<std::string, DTensor>> dtensors_;
  std::map<std::string, Entry> entries_;
  std::vector<std::string> claimed_;
};

struct SaveOptions {
  // Names the checkpoint <dir>/step-<step, 12 digits>; >= 0. Saving a step
  // that exists replaces it (after the new one is complete).
  int64_t step = 0;
  // Complete checkpoints kept under <dir>, newest first, once this one is
  // published; >= 1 (ArgumentError naming "keep_last").
  int keep_last = 2;
  // Writes and fsyncs through the page cache (false) or straight to the
  // device after each file (true: an fdatasync per file, the default).
  bool fsync = true;
};

// What a save wrote (the same on every rank but `bytes_written`).
struct SaveReport {
  std::string path;           // <dir>/step-<step>
  int64_t step = 0;
  int64_t bytes_written = 0;  // by this rank (its rank file)
  int64_t total_bytes = 0;    // tensor bytes in the checkpoint, each piece once
  double snapshot_seconds = 0;  // copying this rank's pieces to host memory
  double write_seconds = 0;     // writing, syncing and publishing
  int64_t peak_snapshot_bytes = 0;  // host memory the snapshot held on this rank
};

// Saves `state` as <dir>/step-<step>: written to <dir>/step-<step>.tmp,
// synced, renamed into place; older checkpoints beyond keep_last are then
// removed, oldest first. Ranks may hold different tensors (pipeline
// stages); every tensor's pieces together must tile it. ArgumentError
// naming "state" for a Partial DTensor, a tensor whose dtype or global
// shape differs between ranks, pieces that overlap or leave gaps, or set()
// values that differ between ranks; StateError for a unit holding full
// parameters (reshard() first); CheckpointError(Io) when a write fails (on
// every rank; nothing is published).
SaveReport save(const std::string& dir, const State& state, const SaveOptions& options = {});

// Saves in the background: save() copies this rank's pieces to host memory
// (pinned for CUDA tensors) and returns; a thread writes and publishes them
// while training goes on. At most one save is in flight: save() first waits
// for the previous one. An error of a background save is raised by the next
// save(), wait() or the destructor's log line (never lost, never raised
// twice). Collective: every rank constructs it, calls save() and wait() in
// the same order. The background thread communicates on its own process
// group, so training's collectives may run meanwhile. The saver keeps its
// host buffers (this rank's pieces, pinned for CUDA) between saves, so a
// later save copies into them instead of allocating.
class AsyncSaver {
 public:
  AsyncSaver(std::string dir, SaveOptions defaults = {});
  ~AsyncSaver();  // waits; an error left unread is logged to stderr
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  // Snapshot of `state` at `step`, written in the background. Returns after
  // the snapshot (its cost: SaveReport::snapshot_seconds of the finished
  // save).
  void save(const State& state, int64_t step);
  // Blocks until the save in flight is published; rethrows its error.
  // Returns its report (nullopt when none was in flight).
  std::optional<SaveReport> wait();
  bool in_flight() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

namespace testing {
// For fault-injection tests: called on rank 0 right after each phase of a
// save's publish sequence (docs/distributed_checkpoint.md#publish-sequence)
// with its name -- "written" (the rank files), "index", "renamed", "pruned"
// -- and the step saved; from AsyncSaver's thread for background saves. A
// test kills the process there to leave what a crash at that point leaves
// (fsdp-train installs one for FSDP_DCP_CRASH_AT). Default: none (an empty
// function). Set it before the first save, not while one is in flight.
using PublishObserver = std::function<void(const char* phase, int64_t step)>;
void set_publish_observer(PublishObserver observer);
}  // namespace testing

struct LoadOptions {
  // A specific step; nullopt: the newest complete checkpoint under dir.
  std::optional<int64_t> step;
  // When the chosen checkpoint does not verify, try the next older complete
  // one (never for a mismatch with the state: those are errors).
  bool fallback = true;
  // Parameters and optimizer state must be finite: a NaN or infinity there
  // is damage (CheckpointError(Corrupt) naming the tensor, so a fallback)
  // rather than something to train on. Buffers and values are not checked
  // (a mask of -inf is legitimate).
  bool check_finite = true;
};

struct LoadReport {
  std::string path;  // the checkpoint loaded
  int64_t step = 0;
  int saved_world_size = 0;
  // Non-empty when newer checkpoints were skipped: what was wrong with each.
  std::string fallback_note;
  // One line per tensor whose saved pieces differ from this layout's, e.g.
  // "model/fc1.weight [64, 32]: 4 pieces [16, 32] -> this rank reads rows
  // 0-31 (Shard(0) on 2 ranks)"; empty when nothing was resharded.
  std::vector<std::string> resharded;
  std::vector<std::string> rank_local_dropped;
  int64_t bytes_read = 0;  // by this rank
  double seconds = 0;
};

// Loads into `state` (see the top of this file). `dir` is a checkpoint root
// (the newest complete step-* under it, or LoadOptions::step) or one
// checkpoint directory. CheckpointError as described above, naming the
// tensor and the file.
LoadReport load(const std::string& dir, State& state, const LoadOptions& options = {});

// The complete checkpoints under a root, newest first (empty if none).
// Never communicates.
std::vector<std::string> list_checkpoints(const std::string& dir);

// Reading one checkpoint in one process, no MPI needed (fsdp-checkpoint).
class Reader {
 public:
  struct Chunk {
    std::string file;  // relative to the checkpoint directory
    std::string dataset;
    std::vector<int64_t> offsets, sizes;
  };
  struct TensorInfo {
    std::string name;
    std::string kind;  // "param", "buffer", "optim", "tensor", "rank_local"
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    std::vector<Chunk> chunks;
  };
  // `dir`: a checkpoint, or a root (its newest complete checkpoint).
  // CheckpointError (NotFound, Format, Corrupt) if the index does not verify.
  explicit Reader(const std::string& dir);
  const std::string& path() const { return path_; }
  int64_t step() const { return step_; }
  int world_size() const { return world_size_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo& tensor(const std::string& name) const;  // ArgumentError naming "name"
  // The non-tensor values (global ones only).
  const std::map<std::string, Value>& values() const { return values_; }
  // The optimizers: prefix -> JSON text {"type", "module", "param_groups"}.
  const std::map<std::string, std::string>& optimizers() const { return optimizers_; }
  // The index.json text.
  const std::string& index_text() const { return index_text_; }
  // The whole tensor, or the box [offsets, offsets + sizes).
  at::Tensor read(const std::string& name) const;
  at::Tensor read(const std::string& name, const std::vector<int64_t>& offsets,
                  const std::vector<int64_t>& sizes) const;
  // Reads every chunk of every file and checks it (checksums, sizes,
  // coverage). Returns the problems found, one line each (empty: intact).
  std::vector<std::string> verify() const;

 private:
  std::string path_, index_text_;
  int64_t step_ = 0;
  int world_size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, Value> values_;
  std::map<std::string, std::string> optimizers_;
};

}  // namespace fsdp::dcp
