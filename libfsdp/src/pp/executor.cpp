// The schedule executor: runs this rank's slots -- each slot's transfers as
// one batch (headers first where shapes are exchanged), then its compute
// actions -- and the helpers that read a step's losses and bubble.
#include "fsdp/comm_diagnostics.h"
#include "fsdp/errors.h"
#include "pp/stage.h"
#include "base/shape_str.h"

#include <ATen/ATen.h>
#include <mpi.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

namespace fsdp::pp {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// A header: ndim, dtype, then up to kMaxDims sizes.
constexpr int64_t kMaxDims = 8;
constexpr int64_t kHeaderLength = 2 + kMaxDims;

enum Direction { kActivation = 0, kGradient = 1, kHeader = 2 };

}  // namespace

struct Schedule::Impl {
  struct Microbatch {
    at::Tensor input;         // what the stage's forward took (a leaf for received ones)
    at::Tensor output;        // the forward's output (the scaled loss on the last stage)
    at::Tensor output_grad;   // received from the next stage
    at::Tensor input_grad;    // to send to the previous stage
  };
  struct Local {
    std::shared_ptr<PipelineStage::State> stage;
    std::vector<Microbatch> mbs;
    // Shapes of the activations this stage received (and, as sender, sent)
    // per microbatch, agreed by headers (ShapeMode::ExchangeOnce).
    std::map<int, std::pair<std::vector<int64_t>, c10::ScalarType>> received_shapes, sent_shapes;
    std::vector<at::Tensor> last_output_grads;
  };

  ScheduleKind kind;
  int n = 1;
  LossSpec loss;
  ScheduleOptions options;
  int pp = 1, v = 1, num_stages = 1, pp_rank = 0;
  ProcessGroupPtr pp_group;
  ProcessGroupPtr dp_group;  // over dp_mesh's ranks: the global count's sum
  std::vector<Slot> slots;
  std::map<int, Local> locals;  // by global stage
  int64_t steps = 0;
  // Per step.
  std::vector<at::Tensor> inputs, targets;
  int64_t global_count = 0;
  double busy = 0;
  std::vector<at::Tensor> losses;

  Local& local(int stage) { return locals.at(stage); }

  // Independent of the microbatch count, so that ranks that disagree on it
  // cannot pair a message with the wrong receive (they time out instead).
  static int tag(int stage, Direction d, int mb) {
    return (mb % 1024) * 32 + (stage % 10) * 3 + d;
  }

  std::string label(const Action& a, bool header) const {
    const bool fwd = a.type == ActionType::SendForward || a.type == ActionType::RecvForward;
    const bool send = a.type == ActionType::SendForward || a.type == ActionType::SendBackward;
    int from = a.stage, to = a.stage;
    if (a.type == ActionType::SendForward) to = a.stage + 1;
    if (a.type == ActionType::RecvForward) from = a.stage - 1;
    if (a.type == ActionType::SendBackward) to = a.stage - 1;
    if (a.type == ActionType::RecvBackward) from = a.stage + 1;
    const int peer = stage_rank(send ? to : from, pp);
    return "pp stage " + std::to_string(from) + " -> " + std::to_string(to) + " " +
           (fwd ? "activation" : "gradient") + (header ? " header" : "") + " of microbatch " +
           std::to_string(a.microbatch) + " (" + (send ? "send to" : "recv from") + " pp rank " +
           std::to_string(peer) + ")";
  }

  // Waits for a slot's transfers; a transfer pending past the timeout is a
  // peer that runs another schedule (or died): report and abort the job.
  void wait_all(const std::vector<WorkPtr>& works, const std::vector<std::string>& labels,
                size_t slot) const {
    const auto start = Clock::now();
    std::chrono::microseconds nap(8);
    for (;;) {
      bool done = true;
      for (const auto& w : works) done = done && w->is_completed();
      if (done) break;
      if (seconds_since(start) > options.p2p_timeout_s) {
        std::ostringstream os;
        int world = 0;
        MPI_Comm_rank(MPI_COMM_WORLD, &world);
        os << "[fsdp pp] rank " << world << " (pp rank " << pp_rank << "): slot " << slot << " of "
           << slots.size() << ": transfers not complete after " << options.p2p_timeout_s
           << " s:";
        for (size_t i = 0; i < works.size(); ++i) {
          if (!works[i]->is_completed()) os << "\n  waiting for " << labels[i];
        }
        os << "\n  pending collectives: " << describe_pending_collectives()
           << "\n  (does every rank run the same schedule and microbatch count?) aborting the job";
        std::cerr << os.str() << std::endl;
        MPI_Abort(MPI_COMM_WORLD, 3);
      }
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(200));
    }
    for (const auto& w : works) w->wait();  // rethrows a transport error
  }

  bool exchange_headers() const {
    return options.shapes == ShapeMode::ExchangeEveryStep ||
           (options.shapes == ShapeMode::ExchangeOnce && steps == 0);
  }

  at::Tensor outgoing(const Action& a) {
    Microbatch& mb = local(a.stage).mbs[a.microbatch];
    at::Tensor t = a.type == ActionType::SendForward ? mb.output : mb.input_grad;
    return t.detach().contiguous();
  }

  void run_comm(const Slot& slot, size_t index) {
    if (slot.comm.empty()) return;
    const bool headers = exchange_headers();
    // Headers of the activations crossing in this slot, as their own batch:
    // the payload's receive buffer needs its shape.
    std::vector<P2POp> ops;
    std::vector<std::string> labels;
    std::vector<std::pair<Action, at::Tensor>> header_recvs;
    for (const Action& a : slot.comm) {
      if (a.type == ActionType::SendForward) {
        at::Tensor out = local(a.stage).mbs[a.microbatch].output;
        check_sent_shape(a, out);
        if (!headers) continue;
        if (out.dim() > kMaxDims) {
          throw ShapeError("forward", "pp: stage " + std::to_string(a.stage) + " output has " +
                                          std::to_string(out.dim()) + " dims; at most " +
                                          std::to_string(kMaxDims) + " cross a stage boundary");
        }
        at::Tensor h = at::zeros({kHeaderLength}, at::kLong);
        auto acc = h.accessor<int64_t, 1>();
        acc[0] = out.dim();
        acc[1] = static_cast<int64_t>(out.scalar_type());
        for (int64_t d = 0; d < out.dim(); ++d) acc[2 + d] = out.size(d);
        ops.push_back({P2POp::Kind::Send, h, stage_rank(a.stage + 1, pp),
                       tag(a.stage, kHeader, a.microbatch), label(a, true)});
        labels.push_back(ops.back().label);
      } else if (a.type == ActionType::RecvForward && headers) {
        at::Tensor h = at::empty({kHeaderLength}, at::kLong);
        ops.push_back({P2POp::Kind::Recv, h, stage_rank(a.stage - 1, pp),
                       tag(a.stage - 1, kHeader, a.microbatch), label(a, true)});
        labels.push_back(ops.back().label);
        header_recvs.emplace_back(a, h);
      }
    }
    if (!ops.empty()) wait_all(pp_group->batch_isend_irecv(ops), labels, index);
    for (const auto& [a, h] : header_recvs) {
      auto acc = h.accessor<int64_t, 1>();
      std::vector<int64_t> shape;
      for (int64_t d = 0; d < acc[0]; ++d) shape.push_back(acc[2 + d]);
      local(a.stage).received_shapes[a.microbatch] = {shape, static_cast<c10::ScalarType>(acc[1])};
    }
    ops.clear();
    labels.clear();
    // "cuda" without an index: the current device, as for the stage's compute.
    const c10::Device device(device_type());
    for (const Action& a : slot.comm) {
      Local& l = local(a.stage);
      Microbatch& mb = l.mbs[a.microbatch];
      auto add = [&](P2POp::Kind kind, at::Tensor t, int peer_stage, int tag_stage, Direction d) {
        ops.push_back({kind, std::move(t), stage_rank(peer_stage, pp), tag(tag_stage, d, a.microbatch),
                       label(a, false)});
        labels.push_back(ops.back().label);
      };
      switch (a.type) {
        case ActionType::SendForward:
          add(P2POp::Kind::Send, outgoing(a), a.stage + 1, a.stage, kActivation);
          break;
        case ActionType::SendBackward:
          add(P2POp::Kind::Send, outgoing(a), a.stage - 1, a.stage, kGradient);
          break;
        case ActionType::RecvForward: {
          std::vector<int64_t> shape;
          c10::ScalarType dtype = c10::kFloat;
          if (options.shapes == ShapeMode::Given) {
            if (!l.stage->options.input_shape) {
              throw ShapeError("input_shape", "pp: stage " + std::to_string(a.stage) +
                                                  " has no StageOptions::input_shape, which "
                                                  "ShapeMode::Given needs");
            }
            shape = *l.stage->options.input_shape;
            dtype = l.stage->options.input_dtype;
          } else {
            std::tie(shape, dtype) = l.received_shapes.at(a.microbatch);
          }
          mb.input = at::empty(shape, at::TensorOptions().dtype(dtype).device(device));
          add(P2POp::Kind::Recv, mb.input, a.stage - 1, a.stage - 1, kActivation);
          break;
        }
        case ActionType::RecvBackward:
          mb.output_grad = at::empty_like(mb.output, at::MemoryFormat::Contiguous);
          add(P2POp::Kind::Recv, mb.output_grad, a.stage + 1, a.stage + 1, kGradient);
          break;
        default:
          throw StateError("pp: " + to_string(a) + " in a slot's transfers (internal error)");
      }
    }
    wait_all(pp_group->batch_isend_irecv(ops), labels, index);
    // The output stays for its backward; a sent input gradient is done with.
    for (const Action& a : slot.comm) {
      Microbatch& mb = local(a.stage).mbs[a.microbatch];
      if (a.type == ActionType::SendBackward) mb.input_grad = at::Tensor();
      if (a.type == ActionType::RecvBackward) {
        local(a.stage).last_output_grads[a.microbatch] = mb.output_grad;
      }
    }
  }

  c10::DeviceType device_type() const {
    return locals.begin()->second.stage->pp_mesh.device_type();
  }

  // ExchangeOnce agrees shapes on the first step; a later change would make
  // the peer receive garbage sizes.
  void check_sent_shape(const Action& a, const at::Tensor& out) {
    if (options.shapes != ShapeMode::ExchangeOnce) return;
    auto& sent = local(a.stage).sent_shapes;
    const std::vector<int64_t> shape(out.sizes().begin(), out.sizes().end());
    auto it = sent.find(a.microbatch);
    if (it == sent.end()) {
      sent[a.microbatch] = {shape, out.scalar_type()};
      return;
    }
    if (it->second.first != shape || it->second.second != out.scalar_type()) {
      throw ShapeError("shapes", "pp: stage " + std::to_string(a.stage) + " output of microbatch " +
                                     std::to_string(a.microbatch) + " is " + shape_str(out.sizes()) +
                                     " " + c10::toString(out.scalar_type()) +
                                     " but the first step agreed " + shape_str(it->second.first) +
                                     " " + c10::toString(it->second.second) +
                                     "; use ShapeMode::ExchangeEveryStep for shapes that change");
    }
  }

  void run_compute(const Slot& slot) {
    for (const Action& a : slot.compute) {
      Local& l = local(a.stage);
      PipelineStage::State& st = *l.stage;
      const bool last = a.stage == num_stages - 1;
      switch (a.type) {
        case ActionType::Unshard: st.unshard_async(); break;
        case ActionType::ReduceGrad: st.reduce_gradients(); break;
        case ActionType::Forward: {
          const auto t0 = Clock::now();
          Microbatch& mb = l.mbs[a.microbatch];
          if (a.stage == 0) {
            mb.input = inputs[a.microbatch];
          } else {
            mb.input.requires_grad_(true);
          }
          at::Tensor out = st.forward(mb.input);
          if (!out.defined()) {
            throw ArgumentError("forward", "pp: stage " + std::to_string(a.stage) +
                                               "'s forward returned an undefined tensor");
          }
          if (last) {
            at::Tensor sum = loss.sum(out, targets[a.microbatch]);
            if (!sum.defined() || sum.numel() != 1) {
              throw ArgumentError("loss", "pp: LossSpec::sum must return a one-element tensor");
            }
            out = sum.reshape({}) / static_cast<double>(global_count);
            losses[a.microbatch] = out.detach();
          }
          mb.output = out;
          busy += seconds_since(t0);
          break;
        }
        case ActionType::Backward: {
          const auto t0 = Clock::now();
          Microbatch& mb = l.mbs[a.microbatch];
          if (mb.output.requires_grad()) {
            if (last) {
              torch::autograd::backward({mb.output});
            } else {
              torch::autograd::backward({mb.output}, {mb.output_grad});
            }
          }
          if (a.stage > 0) {
            at::Tensor g = mb.input.grad();
            mb.input_grad = g.defined() ? g : at::zeros_like(mb.input);
          }
          mb.output = at::Tensor();
          mb.output_grad = at::Tensor();
          mb.input = at::Tensor();
          busy += seconds_since(t0);
          break;
        }
        default:
          throw StateError("pp: " + to_string(a) + " among a slot's compute actions (internal error)");
      }
    }
  }
};

Schedule::Schedule(std::vector<PipelineStage> stages, ScheduleKind kind, int n_microbatches,
                   LossSpec loss, ScheduleOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  if (stages.empty()) throw ArgumentError("stages", "Schedule: 'stages' is empty");
  if (n_microbatches < 1) {
    throw ArgumentError("n_microbatches", "Schedule: 'n_microbatches' = " +
                                              std::to_string(n_microbatches) + "; accepted: >= 1");
  }
  if (!(options.p2p_timeout_s > 0)) {
    throw ArgumentError("p2p_timeout_s", "Schedule: 'p2p_timeout_s' must be > 0");
  }
  const auto& first = *stages.front().state();
  for (size_t i = 0; i < stages.size(); ++i) {
    const auto& st = *stages[i].state();
    if (st.pp_mesh != first.pp_mesh || st.num_stages != first.num_stages) {
      throw ArgumentError("stages", "Schedule: 'stages'[" + std::to_string(i) +
                                        "] has another pp mesh or stage count than 'stages'[0]");
    }
    if (s.locals.count(st.index)) {
      throw ArgumentError("stages", "Schedule: stage " + std::to_string(st.index) +
                                        " is in 'stages' twice");
    }
    s.locals[st.index].stage = stages[i].state();
  }
  s.kind = kind;
  s.n = n_microbatches;
  s.options = std::move(options);
  s.pp = static_cast<int>(first.pp_mesh.size());
  s.pp_rank = first.pp_mesh.get_local_rank(0);
  s.pp_group = first.pp_mesh.get_group(0);
  s.num_stages = first.num_stages;
  s.v = s.num_stages / s.pp;
  if (static_cast<int>(stages.size()) != s.v) {
    throw ArgumentError("stages", "Schedule: this rank holds " + std::to_string(s.v) +
                                      " of the " + std::to_string(s.num_stages) +
                                      " stages (num_stages / pp size) but 'stages' has " +
                                      std::to_string(stages.size()));
  }
  if (s.locals.count(s.num_stages - 1) && !loss.sum) {
    throw ArgumentError("loss", "Schedule: the last stage runs here but 'loss'.sum is empty");
  }
  if (!loss.count) {
    loss.count = [](const at::Tensor& target) { return target.dim() > 0 ? target.size(0) : 1; };
  }
  s.loss = std::move(loss);
  s.slots = build_schedule(kind, s.pp, s.v, s.n)[static_cast<size_t>(s.pp_rank)];
  if (s.options.dp_mesh) {
    // flatten() is collective over the world: here, where every rank is,
    // not in step(), where only the last stage's ranks sum the count.
    const DeviceMesh& dp = *s.options.dp_mesh;
    s.dp_group = dp.ndim() == 1 ? dp.get_group(0) : dp.flatten().get_group(0);
  }
}

Schedule::~Schedule() = default;

StepResult Schedule::step(const at::Tensor& input, const at::Tensor& target) {
  Impl& s = *impl_;
  const auto start = Clock::now();
  auto split = [&](const at::Tensor& t, const char* name) {
    if (!t.defined() || t.dim() == 0 || t.size(0) % s.n != 0) {
      throw ShapeError(name, std::string("Schedule::step: '") + name + "' " +
                                 (t.defined() ? "has " + shape_str(t.sizes()) : "is undefined") +
                                 "; accepted: a tensor whose dim 0 divides into " +
                                 std::to_string(s.n) + " microbatches");
    }
    const int64_t rows = t.size(0) / s.n;
    std::vector<at::Tensor> parts;
    for (int m = 0; m < s.n; ++m) parts.push_back(t.narrow(0, m * rows, rows));
    return parts;
  };
  const bool has_first = s.locals.count(0) > 0;
  const bool has_last = s.locals.count(s.num_stages - 1) > 0;
  s.inputs = has_first ? split(input, "input") : std::vector<at::Tensor>{};
  s.targets = has_last ? split(target, "target") : std::vector<at::Tensor>{};
  s.global_count = 0;
  if (has_last) {
    int64_t count = 0;
    for (const auto& t : s.targets) count += s.loss.count(t);
    at::Tensor c = at::full({1}, count, at::kLong);
    if (s.dp_group && s.dp_group->size() > 1) s.dp_group->all_reduce(c);
    s.global_count = c.item<int64_t>();
    if (s.global_count <= 0) {
      throw ArgumentError("target", "Schedule::step: LossSpec::count summed to " +
                                        std::to_string(s.global_count) +
                                        " over the step; the loss needs a positive count");
    }
  }
  s.losses.assign(has_last ? s.n : 0, at::Tensor());
  s.busy = 0;
  for (auto& [index, l] : s.locals) {
    l.mbs.assign(static_cast<size_t>(s.n), Impl::Microbatch{});
    l.last_output_grads.assign(static_cast<size_t>(s.n), at::Tensor());
    l.stage->begin_microbatches();
  }
  for (size_t t = 0; t < s.slots.size(); ++t) {
    s.run_comm(s.slots[t], t);
    s.run_compute(s.slots[t]);
  }
  ++s.steps;
  StepResult r;
  r.losses = s.losses;
  r.global_count = s.global_count;
  r.busy_seconds = s.busy;
  r.step_seconds = seconds_since(start);
  s.inputs.clear();
  s.targets.clear();
  return r;
}

const std::vector<Slot>& Schedule::slots() const { return impl_->slots; }
ScheduleKind Schedule::kind() const { return impl_->kind; }
int Schedule::n_microbatches() const { return impl_->n; }

at::Tensor Schedule::received_output_grad(int stage, int microbatch) const {
  auto it = impl_->locals.find(stage);
  if (it == impl_->locals.end()) {
    throw ArgumentError("stage", "received_output_grad: stage " + std::to_string(stage) +
                                     " does not run on this rank");
  }
  if (microbatch < 0 || microbatch >= impl_->n) {
    throw ArgumentError("microbatch", "received_output_grad: 'microbatch' = " +
                                          std::to_string(microbatch) + "; accepted: 0.." +
                                          std::to_string(impl_->n - 1));
  }
  const auto& grads = it->second.last_output_grads;
  return static_cast<size_t>(microbatch) < grads.size() ? grads[microbatch] : at::Tensor();
}

double broadcast_loss(const StepResult& result, const DeviceMesh& pp_mesh, int num_stages,
                      const std::optional<DeviceMesh>& dp_mesh) {
  const int root = stage_rank(num_stages - 1, static_cast<int>(pp_mesh.size()));
  double sum = 0;
  for (const auto& l : result.losses) sum += l.item<double>();
  at::Tensor t = at::full({1}, sum, at::kDouble);
  if (pp_mesh.size() > 1) pp_mesh.get_group(0)->broadcast(t, root);
  if (dp_mesh && dp_mesh->size() > 1) {
    for (int d = 0; d < dp_mesh->ndim(); ++d) dp_mesh->get_group(d)->all_reduce(t);
  }
  return t.item<double>();
}

double bubble_fraction(const StepResult& result, const DeviceMesh& mesh) {
  // The slowest rank's (step, busy), reduced dim by dim over the mesh's own
  // groups: flatten() would split a communicator on every call. The
  // lexicographic max is the same on every rank whatever the order.
  std::pair<double, double> slowest{result.step_seconds, result.busy_seconds};
  for (int d = 0; d < mesh.ndim(); ++d) {
    const ProcessGroupPtr group = mesh.get_group(d);
    if (group->size() == 1) continue;
    at::Tensor mine = at::tensor({slowest.first, slowest.second}, at::kDouble);
    at::Tensor all = at::empty({group->size() * 2}, at::kDouble);
    group->all_gather_into_tensor(all, mine);
    auto acc = all.accessor<double, 1>();
    for (int r = 0; r < group->size(); ++r) {
      slowest = std::max(slowest, std::make_pair(acc[2 * r], acc[2 * r + 1]));
    }
  }
  const auto [step, busy] = slowest;
  return step > 0 ? std::max(0.0, step - busy) / step : 0.0;
}

}  // namespace fsdp::pp
