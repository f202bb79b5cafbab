// fsdp-train's step loop (step_loop.h): per step the corpus batch of this
// rank, forward, backward, gradient clipping and the optimizer step (or the
// pipeline schedule's step), the loss averaged over the world, progress and
// loss.csv on rank 0, and the checkpoint saves with the run's flags.
#include "step_loop.h"

#include "pipelined_decoder.h"
#include "train_checkpoint.h"

#include <fsdp/clip_grad.h>

#include <fmt/format.h>

#include <algorithm>
#include <csignal>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace fsdp_train {
namespace {

// The tp ranks of a data-parallel coordinate hold the same value, so the
// mean over the world is the mean over the data-parallel ranks.
double global_mean(const WorldComm& comm, double local) { return comm.sum(local) / comm.size(); }

// FSDP_TRAIN_STALL_AT (test_hooks.h): the last rank stops itself here.
void stall_point(const HookSpec& spec, const char* point, int64_t step, const WorldComm& comm) {
  if (comm.rank() != comm.size() - 1 || !spec.matches(point, step)) return;
  std::cerr << fmt::format("fsdp-train: FSDP_TRAIN_STALL_AT: SIGSTOP of rank {} at \"{}\" of step {}",
                           comm.rank(), point, step)
            << std::endl;
  std::raise(SIGSTOP);
}

// --moe: per MoE layer, max / mean over the experts of the (token, k) pairs
// routed to each in the last step's global batch (1 = perfectly balanced,
// E / k = all to k experts). Collective over the world: every rank sees
// different data.
std::vector<double> expert_load(const WorldComm& comm, const std::vector<at::Tensor>& counts) {
  std::vector<double> out;
  for (const at::Tensor& c : counts) {
    const at::Tensor local = c.to(at::kCPU, at::kLong).contiguous();
    const int64_t* p = local.data_ptr<int64_t>();
    const std::vector<int64_t> global = comm.sum(std::vector<int64_t>(p, p + local.numel()));
    int64_t total = 0, most = 0;
    for (const int64_t n : global) {
      total += n;
      most = std::max(most, n);
    }
    const double mean = global.empty() ? 0.0 : static_cast<double>(total) / global.size();
    out.push_back(mean > 0 ? static_cast<double>(most) / mean : 0.0);
  }
  return out;
}

// The checkpoint save at `step` (collective).
void save(const TrainingRun& r, int64_t step, Checkpointer& checkpointer, const HookSpec& stall) {
  stall_point(stall, "save", step, r.comm);
  checkpointer.save(step);
}

// One step's numbers: the loss averaged over the world, the gradient norm
// and, with --pp, the schedule's bubble fraction.
struct StepOutcome {
  double mean_loss = 0, norm = 0;
  std::optional<double> bubble;
};

// Forward, backward, clipping and the optimizer step on this rank's
// `tokens` (with --pp: the pipeline schedule's step, then the optimizer's).
StepOutcome step_once(const TrainingRun& r, const at::Tensor& tokens, int64_t step,
                      const HookSpec& stall) {
  const TrainConfig& cfg = r.cfg;
  StepOutcome out;
  if (cfg.pipelined()) {
    // Every pp rank of a pipeline reads the same rows: the first stage's
    // take the inputs, the last stage's the targets.
    const PipelineStepResult p = pipeline_step(r.sharded, tokens, cfg);
    r.opt.step();
    out.mean_loss = p.loss;
    out.norm = p.grad_norm;
    out.bubble = p.bubble;
  } else {
    r.root.zero_grad();
    at::Tensor loss = r.sharded.loss(tokens);
    loss.backward();
    out.norm = cfg.clip > 0 ? fsdp::clip_grad_norm_(r.params, cfg.clip)
                            : fsdp::total_grad_norm(r.params);
    r.opt.step();
    stall_point(stall, "optimizer", step, r.comm);
    out.mean_loss = global_mean(r.comm, loss.item<double>());
  }
  return out;
}

// Rank 0's closing line of the loop.
void print_summary(const TrainConfig& cfg, const Progress& progress, int64_t start,
                   double train_seconds, double bubble_sum) {
  const int64_t tokens_per_step = cfg.batch * cfg.seq;
  if (progress.steps_done() > 0) {
    std::cout << fmt::format("trained {} steps in {} ({:.2f} s/step, {:.0f} tok/s over the run{})",
                             progress.steps_done(), format_duration(train_seconds),
                             progress.mean_step_seconds(),
                             progress.steps_done() * tokens_per_step / progress.total_seconds(),
                             cfg.pipelined()
                                 ? fmt::format(", pipeline bubble {:.3f} on average",
                                               bubble_sum / progress.steps_done())
                                 : "")
              << std::endl;
  } else {
    std::cout << fmt::format("fsdp-train: the checkpoint is already at step {} of --steps {}: "
                             "nothing to train",
                             start, cfg.steps)
              << std::endl;
  }
}

}  // namespace

int64_t train_steps(const TrainingRun& run, int64_t start, LossLog* log, const HookSpec& stall,
                    std::chrono::milliseconds min_step, Checkpointer& checkpointer, fsdp::GracefulStop& stop) {
  const TrainConfig& cfg = run.cfg;
  const int64_t tokens_per_step = cfg.batch * cfg.seq;
  Progress progress(cfg.steps, start, tokens_per_step, cfg.log_every);
  double bubble_sum = 0;  // --pp: the steps' bubble fractions
  const auto run_start = Clock::now();
  for (int64_t step = start + 1; step <= cfg.steps; ++step) {
    const auto t0 = Clock::now();
    const at::Tensor tokens = local_slice(run.corpus.global_batch(cfg.seed, step, cfg.batch,
                                                                  cfg.seq),
                                          run.dp_rank, cfg.dp_size)
                                  .to(run.device);
    const StepOutcome s = step_once(run, tokens, step, stall);
    if (s.bubble) bubble_sum += *s.bubble;
    const double tok_s = progress.record(seconds_since(t0));
    const bool print = progress.should_log(step);
    const MemoryPeak mem = print ? gather_peak_rss(run.comm) : MemoryPeak{};
    const std::vector<double> load = print && cfg.moe
                                         ? expert_load(run.comm, run.sharded.expert_counts())
                                         : std::vector<double>{};
    if (run.lead) {
      log->add({step, s.mean_loss, s.norm, tok_s});
      if (print) std::cout << progress.line(step, s.mean_loss, mem, s.bubble, load) << std::endl;
    }
    const bool saved =
        step == cfg.steps || (cfg.checkpoint_every > 0 && step % cfg.checkpoint_every == 0);
    if (saved) save(run, step, checkpointer, stall);
    if (min_step.count() > 0) std::this_thread::sleep_until(t0 + min_step);  // test hook
    // Every rank agrees here, between steps: none is inside a collective.
    if (step < cfg.steps && stop.should_stop()) {
      if (!saved) save(run, step, checkpointer, stall);
      if (run.lead) print_summary(cfg, progress, start, seconds_since(run_start), bubble_sum);
      return step;
    }
  }
  const double train_seconds = seconds_since(run_start);
  if (run.lead) print_summary(cfg, progress, start, train_seconds, bubble_sum);
  return 0;
}

}  // namespace fsdp_train
