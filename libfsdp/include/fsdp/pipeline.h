// Pipeline parallelism (namespace fsdp::pp): a model cut into stages that run
// on different ranks, microbatches streamed through them by a schedule.
//
//   auto mesh = fsdp::init_device_mesh(c10::kCPU, {2, 2}, {"pp", "dp"});
//   auto stage_module = build_my_half(mesh.get_local_rank("pp"));
//   for (auto& block : stage_module->blocks) fsdp::fully_shard(block, dp_opts);
//   fsdp::fully_shard(stage_module, dp_opts);     // one FSDP root per stage
//   fsdp::pp::PipelineStage stage(stage_module, mesh.get_local_rank("pp"), 2, mesh["pp"]);
//   fsdp::pp::Schedule schedule({stage}, fsdp::pp::ScheduleKind::OneFOneB,
//                               /*n_microbatches=*/4, loss, {.dp_mesh = mesh["dp"]});
//   auto result = schedule.step(x, y);           // forward + backward of one batch
//   optimizer.step();
//
// A schedule is data: per rank, a list of slots (see Slot); the executor
// runs them in order. In slot t every rank first posts the slot's sends and
// receives together (ProcessGroup::batch_isend_irecv) and waits for them,
// then runs the slot's compute actions. Slots are built so that every send
// meets its receive in the same slot on the peer, which makes the exchange
// deadlock-free by construction (check_schedule proves it for a schedule).
//
// FSDP inside stages: a stage module that is an FSDP unit (or holds units)
// runs each microbatch's backward without gradient sync, without reshard
// after backward and as not-the-last backward; its REDUCE_GRAD action, after
// the stage's last backward, reduces the accumulated gradients of every unit
// in the stage (FSDPModule::reduce_gradients) and reshards. Stage units keep
// their parameters gathered across microbatches: PipelineStage sets
// reshard_after_forward=false on them (torchtitan's choice: one all-gather
// per unit per step, not one per microbatch), unless StageOptions says not.
//
// Loss convention (one, scaled exactly once): LossSpec::sum returns the SUM of
// a microbatch's per-token (per-sample) losses; the schedule divides it by the
// step's global count -- LossSpec::count over every microbatch of every
// data-parallel replica (all-reduced over ScheduleOptions::dp_mesh) -- before
// backward. Gradients are therefore already the global mean: stage FSDP units
// reduce with divide factor 1 (PipelineStage sets it), and nothing divides by
// the number of microbatches. StepResult::losses holds the scaled microbatch
// losses: their sum over microbatches and data-parallel replicas is the
// step's mean loss (broadcast_loss with the dp mesh returns it).
//
// Errors: bad arguments -> ArgumentError naming them; an activation whose
// shape differs from the one agreed (ShapeMode) -> ShapeError; a transfer that does
// not complete within ScheduleOptions::p2p_timeout_s prints which rank,
// slot, stage, microbatch and direction it waited for, and the pending
// collectives, to stderr and aborts the job (MPI_Abort): a peer that
// skipped it would otherwise hang every rank.
#pragma once

#include "fsdp/fully_shard.h"
#include "fsdp/mesh.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::pp {

// ---- schedules as data ----------------------------------------------------

enum class ActionType {
  Forward,       // F: run the stage on microbatch `microbatch`
  Backward,      // B: backward of that microbatch (input and weight gradients)
  SendForward,   // SEND_F: the stage's output activation -> stage + 1
  RecvForward,   // RECV_F: the stage's input activation <- stage - 1
  SendBackward,  // SEND_B: the gradient of the stage's input -> stage - 1
  RecvBackward,  // RECV_B: the gradient of the stage's output <- stage + 1
  Unshard,       // UNSHARD: start the stage's FSDP all-gathers (async)
  ReduceGrad,    // REDUCE_GRAD: reduce the stage's accumulated gradients, reshard
};

struct Action {
  ActionType type = ActionType::Forward;
  int stage = 0;       // global stage index
  int microbatch = -1; // -1 for Unshard / ReduceGrad
  bool operator==(const Action& o) const {
    return type == o.type && stage == o.stage && microbatch == o.microbatch;
  }
  bool operator!=(const Action& o) const { return !(*this == o); }
};
// PyTorch's notation: "0F1" (stage 0, forward, microbatch 1), "1SEND_B0",
// "0RECV_F2", "0UNSHARD", "1REDUCE_GRAD".
std::string to_string(const Action& a);

// One time step of one rank: its transfers (posted together, waited
// together), then its compute actions in order.
struct Slot {
  std::vector<Action> comm;     // SendForward/RecvForward/SendBackward/RecvBackward
  std::vector<Action> compute;  // Unshard, Forward, Backward, ReduceGrad
};

enum class ScheduleKind {
  GPipe,            // all forwards, then all backwards
  OneFOneB,         // 1F1B: warm-up forwards, then one forward one backward
  Interleaved1F1B,  // several stages per rank (looped placement), depth first
};
std::string to_string(ScheduleKind kind);
// "gpipe", "1f1b", "interleaved" (also the to_string forms); ArgumentError
// naming "schedule" otherwise.
ScheduleKind parse_schedule_kind(const std::string& name);

// Where global stage s runs: rank s % pp_size (looped placement); with v
// stages per rank, rank r holds stages r, r + pp, ..., r + (v-1) pp.
int stage_rank(int stage, int pp_size);

// Every rank's slots for one step: result[r] is pp rank r's list; all lists
// have the same length. num_stages = pp_size * stages_per_rank; GPipe and
// 1F1B need stages_per_rank == 1, Interleaved1F1B >= 1 and n_microbatches a
// multiple of pp_size. Errors: ArgumentError naming "pp_size",
// "stages_per_rank" or "n_microbatches" (< 1, or, for 1F1B and interleaved,
// fewer microbatches than pp ranks).
std::vector<std::vector<Slot>> build_schedule(ScheduleKind kind, int pp_size, int stages_per_rank,
                                              int n_microbatches);

// Checks a schedule: every SEND has its matching RECV (same stage pair,
// microbatch, direction) in the same slot on the peer rank and vice versa,
// every F/B of every stage and microbatch runs exactly once on the stage's
// rank after its inputs arrived, and each stage's REDUCE_GRAD follows its
// last B. Returns the first violation ("" when none).
std::string check_schedule(const std::vector<std::vector<Slot>>& schedule, int pp_size,
                           int num_stages, int n_microbatches);

// ---- stages and the executor ---------------------------------------------

struct StageOptions {
  // Shape and dtype of one microbatch's input activation, used only with
  // ShapeMode::Given (required then for every stage but the first).
  std::optional<std::vector<int64_t>> input_shape;
  c10::ScalarType input_dtype = c10::kFloat;
  // FSDP units inside the stage keep parameters gathered between
  // microbatches (false: set_reshard_after_forward(false)). true leaves each
  // unit's own setting: one all-gather per microbatch, less memory.
  bool keep_reshard_after_forward = false;
};

// One stage: a slice of the model that takes one tensor and returns one.
class PipelineStage {
 public:
  // stage_index in [0, num_stages); pp_mesh: 1-D, its size divides
  // num_stages and stage_index runs on this rank (stage_rank(stage_index,
  // size) == pp rank). ArgumentError naming "module", "forward",
  // "stage_index", "num_stages" or "pp_mesh".
  using ForwardFn = std::function<at::Tensor(const at::Tensor&)>;
  // forward(input) -> output runs the stage (through Sharded<M> for an FSDP
  // unit); `module` owns its parameters.
  PipelineStage(std::shared_ptr<torch::nn::Module> module, ForwardFn forward, int stage_index,
                int num_stages, DeviceMesh pp_mesh, StageOptions options = {});
  // A module holder M (TORCH_MODULE(Block), torch::nn::Sequential, ...): its
  // forward(at::Tensor) runs through its FSDP unit when it is sharded.
  template <typename M, typename = decltype(std::declval<M&>().ptr())>
  PipelineStage(M holder, int stage_index, int num_stages, DeviceMesh pp_mesh,
                StageOptions options = {})
      : PipelineStage(holder.ptr(),
                      [h = Sharded<M>(holder)](const at::Tensor& x) mutable { return h(x); },
                      stage_index, num_stages, std::move(pp_mesh), std::move(options)) {}

  int stage_index() const;
  int num_stages() const;
  bool is_first() const;
  bool is_last() const;
  const std::shared_ptr<torch::nn::Module>& module() const;
  const DeviceMesh& pp_mesh() const;

  struct State;
  const std::shared_ptr<State>& state() const { return state_; }

 private:
  std::shared_ptr<State> state_;
};

// The loss of the last stage (see the convention above).
struct LossSpec {
  // Sum of the microbatch's per-token (per-sample) losses: a 0-d tensor.
  std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)> sum;
  // How many tokens (samples) a microbatch's target counts; default: its
  // size along dim 0 (samples).
  std::function<int64_t(const at::Tensor& target)> count;
};

// How a stage learns the shape and dtype of the activation it receives.
enum class ShapeMode {
  ExchangeOnce,       // a small header per microbatch on the first step only
  ExchangeEveryStep,  // a header with every transfer: shapes may change between
                      // steps (dynamic sequence lengths)
  Given,              // StageOptions::input_shape / input_dtype; no header
};

struct ScheduleOptions {
  // The same on every rank.
  ShapeMode shapes = ShapeMode::ExchangeOnce;
  // The data-parallel replicas the global count is summed over (the last
  // stage's dp group); none: no data parallelism. With more than one dim
  // (HSDP's (replicate, shard)) the Schedule constructor flattens it, which
  // is collective over the world: construct Schedules on every rank.
  std::optional<DeviceMesh> dp_mesh;
  // A transfer pending longer than this aborts the job (see above).
  double p2p_timeout_s = 300.0;
};

struct StepResult {
  // Last stage's microbatch losses (scaled by 1 / global_count), on the
  // ranks of the last stage; empty elsewhere (see broadcast_loss).
  std::vector<at::Tensor> losses;
  // The divisor used, on the last stage's ranks (0 elsewhere).
  int64_t global_count = 0;
  // This rank's step wall time and the part spent in compute actions (s).
  double step_seconds = 0;
  double busy_seconds = 0;
};

class Schedule {
 public:
  // stages: the stages this rank runs (one for GPipe/1F1B, v for
  // interleaved), all on one pp mesh, in any order. ArgumentError naming
  // "stages", "n_microbatches" or "loss".
  Schedule(std::vector<PipelineStage> stages, ScheduleKind kind, int n_microbatches,
           LossSpec loss, ScheduleOptions options = {});
  ~Schedule();

  // One step: input (first stage's ranks; undefined elsewhere) and target
  // (last stage's ranks) are split on dim 0 into n_microbatches equal parts
  // (ShapeError naming "input"/"target" if dim 0 does not divide). Runs
  // every forward and backward; gradients are reduced and resharded on
  // return, ready for the optimizer.
  StepResult step(const at::Tensor& input, const at::Tensor& target);

  // This rank's slots (from build_schedule).
  const std::vector<Slot>& slots() const;
  ScheduleKind kind() const;
  int n_microbatches() const;
  // The gradient of local stage `stage`'s output activation for microbatch
  // `microbatch` as received from stage + 1 in the last step (for tests of
  // the stage boundary); undefined for the last stage. ArgumentError naming
  // "stage" / "microbatch" if not a local stage / out of range.
  at::Tensor received_output_grad(int stage, int microbatch) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The sum of the last stage's losses of a step on every rank of pp_mesh (a
// broadcast from the last stage's pp rank): this data-parallel replica's
// share of the mean loss; with dp_mesh (the schedule's) also summed over the
// replicas: the step's mean loss. Collective over pp_mesh (and dp_mesh).
double broadcast_loss(const StepResult& result, const DeviceMesh& pp_mesh, int num_stages,
                      const std::optional<DeviceMesh>& dp_mesh = std::nullopt);

// Bubble fraction of a step: (step time - busy time) / step time on the
// slowest rank of `mesh` (the rank with the longest step). Busy is the time
// in forward and backward actions only: waits for transfers, UNSHARD and
// REDUCE_GRAD (the gradient reduction) count as bubble. Collective over
// mesh's ranks.
double bubble_fraction(const StepResult& result, const DeviceMesh& mesh);

}  // namespace fsdp::pp
