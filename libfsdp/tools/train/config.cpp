#include "config.h"

#include <fmt/format.h>

#include <cmath>

#ifndef FSDP_TRAIN_CORPUS
#error "FSDP_TRAIN_CORPUS must name the source tree's data/corpus/corpus.txt"
#endif

namespace fsdp_train {

namespace {

int64_t parse_dim(const std::string& text, const std::string& spec) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || v < 1) {
    throw ConfigError(fmt::format(
        "--mesh '{}': expected N (1-D FSDP) or RxS (HSDP: replicate x shard), positive integers",
        spec));
  }
  return v;
}

}  // namespace

std::string TrainConfig::mesh_string() const {
  if (mesh_shape.size() == 2) {
    return fmt::format("[{}x{}] (replicate x shard, HSDP)", mesh_shape[0], mesh_shape[1]);
  }
  return fmt::format("[{}] (FSDP)", mesh_shape.empty() ? 0 : mesh_shape[0]);
}

double TrainConfig::tolerance() const {
  if (verify_tol > 0) return verify_tol;
  return bf16() ? 1e-3 : 1e-4;
}

void add_flags(CLI::App& app, TrainConfig& cfg) {
  cfg.data = FSDP_TRAIN_CORPUS;
  app.add_option("--mesh", cfg.mesh,
                 "N (1-D FSDP) or RxS (HSDP: R replicas x S shards); the product must be the "
                 "world size [default: 1-D over the world]");
  app.add_option("--mp", cfg.mp, "fp32, or bf16 (bf16 parameters/compute, fp32 gradient reduction)")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  app.add_option("--reshard-after-forward", cfg.reshard_after_forward,
                 "free the gathered parameters after forward (true|false)")
      ->capture_default_str();
  app.add_option("--ac", cfg.ac, "activation checkpointing of the decoder layers: none|all|every-2")
      ->check(CLI::IsMember({"none", "all", "every-2"}))
      ->capture_default_str();
  app.add_option("--steps", cfg.steps, "optimizer steps (in all, counting resumed ones)")
      ->capture_default_str();
  app.add_option("--batch", cfg.batch,
                 "global batch in sequences (divisible by the data-parallel size)")
      ->capture_default_str();
  app.add_option("--seq", cfg.seq, "sequence length in bytes")->capture_default_str();
  app.add_option("--lr", cfg.lr, "AdamW learning rate (weight decay 0)")->capture_default_str();
  app.add_option("--seed", cfg.seed, "initial weights and batches")->capture_default_str();
  app.add_option("--clip", cfg.clip, "max global gradient norm (0: measure only)")
      ->capture_default_str();
  app.add_option("--out", cfg.out, "output directory")->capture_default_str();
  app.add_option("--data", cfg.data, "training text, read as bytes")->capture_default_str();
  app.add_option("--checkpoint-every", cfg.checkpoint_every,
                 "also checkpoint every N steps [default: at the end only]");
  app.add_flag("--resume", cfg.resume, "continue from <out>/checkpoint");
  app.add_flag("--verify", cfg.verify,
               "re-run the same steps unsharded in one process on rank 0 and compare the losses");
  app.add_option("--verify-tol", cfg.verify_tol,
                 "max |loss difference| for --verify [default: 1e-4 fp32, 1e-3 bf16]");
  app.add_option("--log-every", cfg.log_every,
                 "progress line every N steps [default: 1, or steps/100 above 200 steps]");
}

void resolve(TrainConfig& cfg, int world_size, int64_t data_bytes) {
  if (cfg.mesh.empty()) {
    cfg.mesh_shape = {world_size};
  } else {
    const auto x = cfg.mesh.find('x');
    if (x == std::string::npos) {
      cfg.mesh_shape = {parse_dim(cfg.mesh, cfg.mesh)};
    } else {
      cfg.mesh_shape = {parse_dim(cfg.mesh.substr(0, x), cfg.mesh),
                        parse_dim(cfg.mesh.substr(x + 1), cfg.mesh)};
    }
  }
  int64_t product = 1;
  for (auto d : cfg.mesh_shape) product *= d;
  if (product != world_size) {
    throw ConfigError(fmt::format(
        "--mesh {}: the mesh has {} ranks but the job has {} (mpiexec -n {}); the product of "
        "the mesh dims must equal the world size",
        cfg.mesh, product, world_size, world_size));
  }
  // FSDP and HSDP alike: every rank takes its own slice of the global batch.
  cfg.dp_size = world_size;
  if (cfg.steps < 1) throw ConfigError(fmt::format("--steps {}: must be >= 1", cfg.steps));
  if (cfg.seq < 1) throw ConfigError(fmt::format("--seq {}: must be >= 1", cfg.seq));
  if (cfg.batch < 1 || cfg.batch % cfg.dp_size != 0) {
    throw ConfigError(fmt::format(
        "--batch {}: the global batch must be a positive multiple of the data-parallel size {}",
        cfg.batch, cfg.dp_size));
  }
  if (!(cfg.lr > 0) || !std::isfinite(cfg.lr)) {
    throw ConfigError(fmt::format("--lr {}: must be > 0", cfg.lr));
  }
  if (!(cfg.clip >= 0) || !std::isfinite(cfg.clip)) {
    throw ConfigError(fmt::format("--clip {}: must be >= 0 (0: no clipping)", cfg.clip));
  }
  if (cfg.checkpoint_every < 0) {
    throw ConfigError(fmt::format("--checkpoint-every {}: must be >= 0", cfg.checkpoint_every));
  }
  if (cfg.log_every < 0) throw ConfigError(fmt::format("--log-every {}: must be >= 0", cfg.log_every));
  if (cfg.log_every == 0) cfg.log_every = cfg.steps > 200 ? cfg.steps / 100 : 1;
  if (cfg.verify_tol < 0) throw ConfigError("--verify-tol: must be > 0");
  if (cfg.out.empty()) throw ConfigError("--out: empty path");
  if (data_bytes < cfg.seq + 1) {
    throw ConfigError(fmt::format("--data {}: {} bytes, fewer than --seq + 1 = {}", cfg.data,
                                  data_bytes, cfg.seq + 1));
  }
}

nlohmann::json numerics_json(const TrainConfig& cfg, int world_size, int64_t data_bytes,
                             uint64_t data_hash) {
  return {
      {"world", world_size},
      {"mesh", cfg.mesh_shape},
      {"mp", cfg.mp},
      {"model",
       {{"vocab", cfg.vocab}, {"hidden", cfg.hidden}, {"heads", cfg.heads}, {"layers", cfg.layers},
        {"tie_output", true}}},
      {"batch", cfg.batch},
      {"seq", cfg.seq},
      {"seed", cfg.seed},
      {"optimizer", {{"name", "AdamW"}, {"lr", cfg.lr}, {"weight_decay", 0.0}}},
      {"clip", cfg.clip},
      {"data", {{"bytes", data_bytes}, {"fnv1a64", fmt::format("{:016x}", data_hash)}}},
  };
}

void check_same_numerics(const nlohmann::json& saved, const nlohmann::json& current,
                         const std::string& where) {
  // The world size and the mesh first: they explain most mismatches.
  std::vector<std::string> keys = {"world", "mesh"};
  for (auto it = current.begin(); it != current.end(); ++it) {
    if (it.key() != "world" && it.key() != "mesh") keys.push_back(it.key());
  }
  for (const auto& key : keys) {
    if (!current.contains(key)) continue;
    const auto found = saved.find(key);
    const std::string have = found == saved.end() ? "(missing)" : found->dump();
    if (found == saved.end() || *found != current.at(key)) {
      throw ConfigError(fmt::format(
          "--resume: {} was written with {} = {}, but this run has {} = {}; resume with the "
          "same world size, --mesh, --mp, --batch, --seq, --seed, --lr, --clip and --data (or "
          "start afresh without --resume / with another --out)",
          where, key, have, key, current.at(key).dump()));
    }
  }
}

}  // namespace fsdp_train
