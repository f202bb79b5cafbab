// Sharded HDF5 checkpoints in <out>/checkpoint/:
//
//   rank<R>.h5   this rank's parameter shards (/params/<name>, fp32, local
//                shape), its AdamW state (/optim/<name>/{exp_avg, exp_avg_sq,
//                step}), and attributes step, rank, world, numerics (JSON),
//                optim (JSON list of the parameters that have AdamW state).
//                Every dataset carries an attribute fnv1a64: FNV-1a 64 over
//                its raw little-endian bytes.
//   meta.json    written by rank 0 once every rank file is complete: step,
//                world, numerics, per rank file a digest (FNV-1a 64 over the
//                file's manifest: every dataset's path, type, shape and
//                checksum, and the root attributes), and "checksum": FNV-1a 64
//                over its own canonical content (nlohmann dump(), no
//                indentation, sorted keys) without that field.
//
// Publish sequence (save_checkpoint), each step named for the test-only
// crash hook FSDP_TRAIN_CRASH_AT (below):
//
//   every rank writes checkpoint.tmp-<step>/rank<R>.h5           "written"
//   every rank fsyncs its file (rank 0 the directory too)        "synced"
//   rank 0 writes meta.json, fsyncs it and the directory         "meta"
//     -> from here checkpoint.tmp-<step>/ is a complete checkpoint
//   rank 0 removes checkpoint.old/ (meta.json first, so a half-
//     removed directory is never mistaken for a complete one)    "cleanup"
//   rank 0 renames checkpoint/ -> checkpoint.old/, fsyncs <out>  "renamed-old"
//   rank 0 renames the tmp dir -> checkpoint/, fsyncs <out>      "renamed-new"
//   rank 0 removes stale checkpoint.tmp-*/ of earlier crashes
//
// Nothing complete is removed before the new checkpoint is complete, so at
// every moment one complete checkpoint is on disk, and after a normal save
// two: checkpoint/ and the previous one in checkpoint.old/.
//
// --resume (resume_checkpoint) verifies checkpoint/ on every rank (see
// verify order in checkpoint.cpp) and the ranks agree; if it is missing or
// damaged it falls back to the newest complete checkpoint.tmp-<step>/, then
// to checkpoint.old/, and says so. A checkpoint written with other numerics
// (flags) is a ConfigError, not damage: no fallback.
//
// FSDP_TRAIN_CRASH_AT=<step name>[@<training step>] (for tests only): rank 0
// SIGKILLs itself right after that step of the publish sequence (of the
// first save that reaches it, or of the save at that training step), so
// tests can crash a save at each step (tools/fsdp-train/tests/crash-check.sh).
//
// All functions here are collective over the world (`comm`, watched like
// every libfsdp collective); a failure on any rank fails on every rank with
// the same message instead of leaving the others waiting.
#pragma once

#include "config.h"
#include "world_comm.h"

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_train {

// A checkpoint that cannot be trusted (damaged, incomplete, inconsistent):
// the message names the file and what is wrong, on one line. Raised alike on
// every rank. A ConfigError, so the job ends with status 2 and one message.
struct CheckpointError : ConfigError {
  using ConfigError::ConfigError;
};

// FNV-1a 64 over raw bytes, continuing from `h`.
inline uint64_t fnv1a64(const void* data, size_t n, uint64_t h = 0xcbf29ce484222325ULL) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ULL;
  }
  return h;
}

// "fnv1a64:<16 hex digits>" of meta.json's canonical content without its
// "checksum" field (what save_checkpoint stores there).
inline std::string meta_checksum(const nlohmann::json& meta) {
  nlohmann::json canonical = meta;
  canonical.erase("checksum");
  const std::string text = canonical.dump();
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx",
                static_cast<unsigned long long>(fnv1a64(text.data(), text.size())));
  return std::string("fnv1a64:") + hex;
}

std::string checkpoint_dir(const std::string& out);

// `shards`: this rank's parameter shards by name, in the optimizer's
// parameter order (so opt.param_groups()[0].params()[i] is shards[i]'s
// parameter). `run` is recorded in meta.json for people (flags, time).
void save_checkpoint(const std::string& out, int64_t step, const nlohmann::json& numerics,
                     const nlohmann::json& run,
                     const std::vector<std::pair<std::string, at::Tensor>>& shards,
                     torch::optim::AdamW& opt, const WorldComm& comm);

struct AdamState {
  int64_t step = 0;
  at::Tensor exp_avg, exp_avg_sq;
};

struct LoadedCheckpoint {
  std::string dir;
  int64_t step = 0;
  std::vector<std::pair<std::string, at::Tensor>> shards;
  std::vector<std::pair<std::string, AdamState>> optim;  // by parameter name
  // Non-empty when checkpoint/ was missing or damaged and `dir` is a
  // fallback: one line for people, the same on every rank.
  std::string fallback_note;
};

// Finds, verifies and reads the checkpoint to resume from (see above).
// `expected`: this rank's parameter shards by name (their shapes are what
// the checkpoint must hold). CheckpointError if no candidate verifies,
// ConfigError if the checkpoint was written with other numerics.
LoadedCheckpoint resume_checkpoint(const std::string& out, const nlohmann::json& numerics,
                                   const std::vector<std::pair<std::string, at::Tensor>>& expected,
                                   const WorldComm& comm);

// Installs the loaded AdamW state: `names[i]` names opt's i-th parameter.
void load_optimizer_state(const LoadedCheckpoint& ckpt, const std::vector<std::string>& names,
                          torch::optim::AdamW& opt);

}  // namespace fsdp_train
