// fsdp-train: trains a byte-level decoder LM (models::Decoder: vocab 256,
// hidden 256, 4 heads, 4 layers, tied output) on the embedded corpus with
// fully_shard per decoder layer and at the root, on every rank of the job,
// optionally tensor-parallel (models::TPDecoder) on a (dp..., tp) mesh,
// pipeline-parallel (models::DecoderStage, fsdp::pp) on a (pp, dp...) mesh,
// or a mixture of experts (models::MoEDecoder, fsdp::moe) with its experts
// on an (efsdp, ep) mesh:
//
//   mpiexec -n 2 fsdp-train [--mesh 2 | --mesh 2x2] [--tp 2 [--sequence-parallel]
//                           [--loss-parallel]] [--mp fp32|bf16] [--ac none|all|every-2]
//                           [--steps 100] [--batch 8] [--seq 128] [--resume] [--verify] ...
//   mpiexec -n 4 fsdp-train --pp 2 [--schedule gpipe|1f1b|interleaved] [--microbatches 4]
//                           [--stages-per-rank 2] [--layers 4] ...
//   mpiexec -n 4 fsdp-train --moe [--experts 4] [--top-k 2] [--ep 2] ...
//
// Rank 0 prints one progress line per step (progress.h), writes
// <out>/loss.csv and <out>/loss.png, and every rank writes its pieces of the
// distributed checkpoints under <out>/checkpoint/ (train_checkpoint.h,
// fsdp::dcp); --resume loads one into any layout. --verify re-runs
// the steps unsharded on rank 0 and compares the losses and the final
// parameters (verify.h).//
// This file: the flags, set-up (output folder, mesh, sharded model,
// optimizer, --resume) and the run's phases in order; the step loop is
// step_loop.h, --verify and the outputs final_report.h.
#include "config.h"
#include "corpus.h"
#include "final_report.h"
#include "job_info.h"
#include "model.h"
#include "pipelined_decoder.h"
#include "progress.h"
#include "step_loop.h"
#include "test_hooks.h"
#include "train_checkpoint.h"
#include "training_run.h"
#include "world_comm.h"

#include <fsdp/graceful_stop.h>
#include <fsdp/mesh.h>
#include <fsdp/runtime.h>
#include <fsdp/weights_file.h>

#include <ATen/Parallel.h>
#include <torch/version.h>

#include <fmt/format.h>
#include <mpi.h>

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace fsdp_train {
namespace {

namespace fs = std::filesystem;

// --device: auto follows the runtime (cuda:<local rank> when LibTorch sees a
// GPU, else cpu).
c10::Device train_device(const fsdp::Runtime& rt, const TrainConfig& cfg) {
  if (cfg.device == "cpu") return c10::Device(c10::kCPU);
  if (cfg.device == "cuda" && !rt.device().is_cuda()) {
    throw ConfigError(fmt::format("--device cuda: LibTorch {} sees no CUDA device here (a CPU "
                                  "build, or no GPU visible); accepted: auto, cpu, cuda",
                                  TORCH_VERSION));
  }
  return rt.device();
}

// Rank 0 creates --out; every rank then checks that it exists.
void prepare_out_dir(const TrainConfig& cfg, bool lead) {
  if (lead) {
    std::error_code ec;
    fs::create_directories(cfg.out, ec);
    if (ec) std::cerr << "fsdp-train: cannot create " << cfg.out << ": " << ec.message() << "\n";
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (!fs::is_directory(cfg.out)) throw ConfigError("--out " + cfg.out + ": cannot create it");
  // Checkpoints go to <out>/checkpoint/: found unwritable at the first save
  // (or at a stop signal) the steps since the start would be lost, so every
  // rank writes and removes a file there before the first step.
  const std::string dir = cfg.out + "/checkpoint";
  std::string why;
  {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec || !fs::is_directory(dir)) {
      why = ec ? ec.message() : "not a directory";
    } else {
      const std::string probe = fmt::format("{}/.write-probe-{}", dir, getpid());
      std::FILE* f = std::fopen(probe.c_str(), "w");
      if (f == nullptr || std::fputs("probe", f) < 0 || std::fclose(f) != 0) {
        why = std::strerror(errno);
      }
      std::remove(probe.c_str());
    }
  }
  int bad = why.empty() ? 0 : 1, any_bad = 0;
  MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any_bad != 0) {
    throw ConfigError(fmt::format("--out {}: cannot write checkpoints to {} ({}); nothing was "
                                  "changed",
                                  cfg.out, dir, why.empty() ? "on another rank" : why));
  }
}

// The job's mesh (collective over the world).
fsdp::DeviceMesh make_mesh(const TrainConfig& cfg, const c10::Device& device) {
  // tp innermost: the ranks of one tp group are adjacent, and data-parallel
  // coordinate world_rank / tp. pp outermost: data-parallel coordinate
  // world_rank % dp size (pipelined_decoder.h).
  std::vector<int64_t> shape = cfg.mesh_shape;
  std::vector<std::string> dims = {"shard"};
  if (cfg.hsdp()) dims.insert(dims.begin(), "replicate");
  if (cfg.tp > 1) {
    shape.push_back(cfg.tp);
    dims.push_back("tp");
  }
  // --moe: ep innermost, so ep rank = world rank % ep and the ranks that
  // own the same experts (efsdp) are ep apart.
  if (cfg.moe) {
    shape = {cfg.efsdp(), cfg.ep};
    dims = {"efsdp", "ep"};
  }
  return cfg.pipelined() ? pipeline_mesh(cfg, device.type())
                         : fsdp::init_device_mesh(device.type(), shape, dims);
}

// The job's model on `device`, sharded on `mesh` (pipelined, MoE or plain,
// as the flags say); `n_params`: the unsharded model's parameter count.
ShardedDecoder build_sharded(const TrainConfig& cfg, const c10::Device& device,
                             const fsdp::DeviceMesh& mesh, int64_t& n_params) {
  if (cfg.moe) {
    models::MoEDecoder plain = build_moe_decoder(cfg);
    plain->to(device);
    n_params = parameter_count(*plain);
    return shard_moe_decoder(plain, cfg, mesh);
  }
  if (cfg.deferred()) return build_deferred_decoder(cfg, mesh, device, n_params);
  models::Decoder plain = build_decoder(cfg);
  plain->to(device);
  n_params = parameter_count(*plain);
  return cfg.pipelined() ? shard_pipeline(plain, cfg, mesh) : shard_decoder(plain, cfg, mesh);
}

// --load: the file's weights into the shards (each rank reads its rows).
// With --verify, returns them whole on rank 0 (the gather is collective; the
// other ranks drop their copy at once: only rank 0 runs the reference) for
// the single-process reference to start from.
std::vector<std::pair<std::string, at::Tensor>> load_pretrained(const TrainConfig& cfg,
                                                                ShardedDecoder& sharded,
                                                                bool lead) {
  fsdp::LoadWeightsOptions options;
  options.prefix = cfg.load_prefix;
  const fsdp::LoadWeightsReport r = fsdp::load_weights(cfg.load, *sharded.net, options);
  if (lead) {
    std::cout << fmt::format(
                     "fsdp-train: loaded {} tensors from {} ({}; rank 0 read {:.1f} MiB in "
                     "{:.2f} s{})",
                     r.tensors_loaded, cfg.load, r.format, r.bytes_read / 1048576.0, r.seconds,
                     r.unexpected.empty()
                         ? std::string()
                         : fmt::format("; {} tensors of the file unused", r.unexpected.size()))
              << std::endl;
  }
  if (!cfg.verify) return {};
  std::vector<std::pair<std::string, at::Tensor>> whole = full_state(sharded);
  if (!lead) return {};
  for (auto& [name, t] : whole) t = t.to(at::kCPU);
  return whole;
}

// Rank 0's opening lines: the configuration (and the pipeline's layout,
// and where a resume started).
void print_banner(const TrainingRun& run, const fsdp::Runtime& rt, const Resumed& resumed) {
  const TrainConfig& cfg = run.cfg;
  const int world = rt.world_size();
  const c10::Device& device = run.device;
  const int64_t n_params = run.n_params;
  const Corpus& corpus = run.corpus;
  const int64_t tokens_per_step = cfg.batch * cfg.seq;
  const std::string reshard =
      cfg.reshard_after_forward_given
          ? fsdp::to_string(reshard_after_forward_option(cfg))
      : cfg.pipelined() ? std::string("false (the pipeline's default: gathered across microbatches)")
                        : std::string("every unit but the root (the default)");
  const std::string experts =
      cfg.moe ? fmt::format(" (odd ones MoE: {} SwiGLU experts of ffn {}, top-{})", cfg.experts,
                            moe_decoder_config(cfg).expert_dim(), cfg.top_k)
              : std::string();
  std::cout << fmt::format(
                   "fsdp-train: {} ranks, mesh {}, device {}, mp {}, reshard-after-forward {}, ac {} | "
                   "model {:.2f}M params (byte {}decoder: vocab {}, hidden {}, heads {}, layers "
                   "{}{}, ffn {}, tied output; init {}{}) | batch {} x seq {} = {} tokens/step ({} per "
                   "{}) | "
                   "data {} ({} bytes) | {} steps, AdamW lr {} wd 0, clip {}, seed {} | {} "
                   "thread(s)/rank, LibTorch {}, BLAS {}{}",
                   world, cfg.mesh_string(), device.str(), cfg.mp, reshard, cfg.ac, n_params / 1e6,
                   cfg.moe ? "MoE " : "", cfg.vocab, cfg.hidden, cfg.heads, cfg.layers, experts,
                   decoder_config(cfg).ffn_dim(), cfg.init,
                   cfg.load.empty() ? std::string() : fmt::format(", weights from {}", cfg.load),
                   cfg.batch, cfg.seq, tokens_per_step,
                   cfg.local_batch(),
                   cfg.pipelined() ? "pipeline" : "rank", cfg.data, corpus.size(), cfg.steps,
                   cfg.lr, cfg.clip, cfg.seed, at::get_num_threads(), TORCH_VERSION,
                   rt.blas_library(), banner_suffix(job_info_from_env()))
            << std::endl;
  if (cfg.pipelined()) {
    const int64_t per = cfg.layers / cfg.num_stages();
    std::cout << fmt::format(
                     "fsdp-train: pipeline: {} stages of {} layer{} (stage 0 + the embedding, "
                     "stage {} + final norm and output), pp rank r holds stage{} r{}; the last "
                     "stage's output.weight is a copy of the tied embedding, their gradients "
                     "summed each step",
                     cfg.num_stages(), per, per == 1 ? "" : "s", cfg.num_stages() - 1,
                     cfg.stages_per_rank > 1 ? "s" : "",
                     cfg.stages_per_rank > 1 ? fmt::format(", r + {}, ...", cfg.pp) : "")
              << std::endl;
  }
  if (cfg.resume) {
    std::cout << resumed.line << std::endl;
    if (!resumed.fallback.empty()) std::cout << resumed.fallback << std::endl;
  }
}

// Rank 0's loss.csv, keeping a resumed run's rows up to its start.
std::unique_ptr<LossLog> open_loss_log(const TrainConfig& cfg, int64_t start) {
  auto log = std::make_unique<LossLog>(cfg.out + "/loss.csv", start);
  if (cfg.resume && log->kept() < start) {
    std::cout << fmt::format(
                     "fsdp-train: note: {} had {} of the {} steps before the checkpoint; the "
                     "CSV and the plot miss the others",
                     log->path(), log->kept(), start)
              << std::endl;
  }
  return log;
}

int train(fsdp::Runtime& rt, TrainConfig& cfg) {
  const int rank = rt.world_rank(), world = rt.world_size();
  const bool lead = rank == 0;
  // First: a SIGTERM / SIGUSR1 during set-up is kept for the first step
  // boundary instead of killing the rank (docs/graceful_stop.md).
  fsdp::GracefulStop stop;
  const Corpus corpus = Corpus::load(cfg.data);
  resolve(cfg, world, corpus.size());
  const nlohmann::json numerics = numerics_json(cfg, corpus.size(), corpus.hash());
  prepare_out_dir(cfg, lead);

  const c10::Device device = train_device(rt, cfg);
  const fsdp::DeviceMesh mesh = make_mesh(cfg, device);
  const WorldComm world_comm(world);
  const HookSpec stall = read_hook("FSDP_TRAIN_STALL_AT", {"optimizer", "save"});
  install_save_crash("FSDP_DCP_CRASH_AT");
  const std::chrono::milliseconds min_step = read_min_step("FSDP_TRAIN_MIN_STEP_MS");
  const int64_t dp_rank = (rank % (cfg.dp_size * cfg.tp)) / cfg.tp;
  int64_t n_params = 0;
  ShardedDecoder sharded = build_sharded(cfg, device, mesh, n_params);
  fsdp::FSDPModule root = sharded.units.back().second;
  std::vector<std::pair<std::string, at::Tensor>> loaded;
  if (!cfg.load.empty()) loaded = load_pretrained(cfg, sharded, lead);
  auto opt = make_optimizer(*sharded.net, cfg);
  const std::vector<at::Tensor> params = sharded.net->parameters();
  TrainingRun run{cfg,  corpus, numerics, device,  world_comm, sharded,
                  root, params, opt,      dp_rank, n_params,   lead};
  if (!loaded.empty()) run.initial_weights = &loaded;

  Resumed resumed;
  if (cfg.resume) resumed = resume(run);
  if (lead) {
    print_banner(run, rt, resumed);
    append_run_record(cfg.out, job_info_from_env(),
                      {{"world_size", world},
                       {"mesh", cfg.mesh_string()},
                       {"steps", cfg.steps},
                       {"resumed_from_step", resumed.start},
                       {"resumed_from", resumed.from}});
  }
  std::unique_ptr<LossLog> log;
  if (lead) log = open_loss_log(cfg, resumed.start);

  Checkpointer checkpointer(run);
  const int64_t stopped_at = train_steps(run, resumed.start, log.get(), stall, min_step, checkpointer, stop);
  if (stopped_at > 0) {
    // A graceful stop (docs/graceful_stop.md): the step's checkpoint is
    // complete on disk before the job exits, well inside Slurm's KillWait.
    const auto t0 = std::chrono::steady_clock::now();
    checkpointer.finish();
    if (lead) {
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const int sig = stop.agreed_signal();
      std::cout << fmt::format("fsdp-train: stopped by {} at step {} of {}: checkpoint {}/checkpoint/"
                               "step-{:012d} complete ({:.2f} s after the agreement); continue "
                               "with --resume (exit status {})",
                               sig > 0 ? fmt::format("signal {} ({})", sig, strsignal(sig))
                                       : std::string("request"),
                               stopped_at, cfg.steps, cfg.out, stopped_at, s,
                               fsdp::kStoppedExitCode)
                << std::endl;
    }
    return fsdp::kStoppedExitCode;
  }
  checkpointer.finish();

  std::vector<Curve> curves{{cfg.out + "/loss.csv",
                             fmt::format("fsdp-train: {} ranks, mesh {}, {}", world,
                                         cfg.mesh_string(), cfg.mp)}};
  // Before --verify, whose parameter gathers are not training's traffic.
  if (cfg.comm_report) print_comm_report(rt);
  const int status = cfg.verify ? verify_run(run, log.get(), curves) : 0;
  if (lead) print_outputs(run, curves);
  return status;
}

int run(int argc, char** argv) {
  fsdp::RuntimeOptions options;
  options.log_banner = false;  // the configuration line says what matters
  fsdp::Runtime rt(&argc, &argv, options);
  CLI::App app{
      "fsdp-train: trains a byte-level decoder LM with fully_shard (per layer + root) on every "
      "rank of the job, optionally tensor-parallel (--tp), pipeline-parallel (--pp) or a "
      "mixture of experts (--moe, experts split over --ep); run under mpiexec"};
  TrainConfig cfg;
  add_flags(app, cfg);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Every rank parses the same argv and fails alike; one message is enough.
    return rt.world_rank() == 0 ? app.exit(e) : e.get_exit_code();
  }
  try {
    return train(rt, cfg);
  } catch (const ConfigError& e) {
    // Raised alike on every rank (or agreed on): one message, a clean exit.
    if (rt.world_rank() == 0) std::cerr << "fsdp-train: error: " << e.what() << std::endl;
    return 2;
  } catch (const fsdp::dcp::CheckpointError& e) {
    // Raised alike on every rank (the library agrees on it): a checkpoint
    // that cannot be used, named with its kind.
    if (rt.world_rank() == 0) {
      std::cerr << "fsdp-train: error: " << (cfg.resume ? "--resume" : "checkpoint") << ": "
                << fsdp::dcp::to_string(e.kind()) << ": " << e.what() << std::endl;
    }
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "fsdp-train: rank " << rt.world_rank() << ": " << e.what() << std::endl;
    // The other ranks may be blocked in a collective this rank will never join.
    if (rt.world_size() > 1) MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
}

}  // namespace
}  // namespace fsdp_train

int main(int argc, char** argv) {
  try {
    return fsdp_train::run(argc, argv);
  } catch (const std::exception& e) {  // the Runtime could not start
    std::cerr << "fsdp-train: " << e.what() << std::endl;
    return 1;
  }
}
