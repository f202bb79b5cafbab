// Pipeline schedules as data: each rank's order of forwards and backwards
// (GPipe, 1F1B, interleaved 1F1B), turned into lockstep slots by simulating
// the pipeline one tick at a time, and the checker that proves a schedule's
// transfers pair up.
#include "fsdp/errors.h"
#include "fsdp/pipeline.h"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

namespace fsdp::pp {
namespace {

const char* type_name(ActionType t) {
  switch (t) {
    case ActionType::Forward: return "F";
    case ActionType::Backward: return "B";
    case ActionType::SendForward: return "SEND_F";
    case ActionType::RecvForward: return "RECV_F";
    case ActionType::SendBackward: return "SEND_B";
    case ActionType::RecvBackward: return "RECV_B";
    case ActionType::Unshard: return "UNSHARD";
    case ActionType::ReduceGrad: return "REDUCE_GRAD";
  }
  return "?";
}

void require_positive(int value, const char* name) {
  if (value < 1) {
    throw ArgumentError(name, std::string("build_schedule: '") + name + "' = " +
                                  std::to_string(value) + "; accepted: >= 1");
  }
}

// One rank's forwards and backwards in the order the schedule runs them.
std::vector<Action> compute_order(ScheduleKind kind, int pp, int v, int n, int r) {
  std::vector<Action> order;
  auto f = [&](int stage, int mb) { order.push_back({ActionType::Forward, stage, mb}); };
  auto b = [&](int stage, int mb) { order.push_back({ActionType::Backward, stage, mb}); };
  switch (kind) {
    case ScheduleKind::GPipe:
      for (int m = 0; m < n; ++m) f(r, m);
      for (int m = 0; m < n; ++m) b(r, m);
      break;
    case ScheduleKind::OneFOneB: {
      // Warm-up fills the pipeline below this stage; then each backward
      // frees the activations of one microbatch before the next forward.
      const int warmup = std::min(pp - 1 - r, n);
      for (int m = 0; m < warmup; ++m) f(r, m);
      for (int i = 0; i < n - warmup; ++i) {
        f(r, warmup + i);
        b(r, i);
      }
      for (int m = n - warmup; m < n; ++m) b(r, m);
      break;
    }
    case ScheduleKind::Interleaved1F1B: {
      // Megatron's order (arXiv 2104.04473): groups of pp microbatches go
      // through the local chunks depth first.
      const int total = n * v;
      auto mb_of = [&](int k) { return (k / (pp * v)) * pp + k % pp; };
      auto fwd = [&](int k) { f(r + ((k % (pp * v)) / pp) * pp, mb_of(k)); };
      auto bwd = [&](int k) { b(r + (v - 1 - (k % (pp * v)) / pp) * pp, mb_of(k)); };
      const int warmup = std::min((pp - r - 1) * 2 + (v - 1) * pp, total);
      for (int k = 0; k < warmup; ++k) fwd(k);
      for (int i = 0; i < total - warmup; ++i) {
        fwd(warmup + i);
        bwd(i);
      }
      for (int k = total - warmup; k < total; ++k) bwd(k);
      break;
    }
  }
  return order;
}

using Key = std::pair<int, int>;  // (stage, microbatch)

}  // namespace

std::string to_string(const Action& a) {
  std::string s = std::to_string(a.stage) + type_name(a.type);
  if (a.microbatch >= 0) s += std::to_string(a.microbatch);
  return s;
}

std::string to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::GPipe: return "gpipe";
    case ScheduleKind::OneFOneB: return "1f1b";
    case ScheduleKind::Interleaved1F1B: return "interleaved";
  }
  return "?";
}

ScheduleKind parse_schedule_kind(const std::string& name) {
  for (auto k : {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved1F1B}) {
    if (name == to_string(k)) return k;
  }
  throw ArgumentError("schedule", "parse_schedule_kind: 'schedule' = '" + name +
                                      "' is unknown; accepted: gpipe, 1f1b, interleaved");
}

int stage_rank(int stage, int pp_size) { return stage % pp_size; }

std::vector<std::vector<Slot>> build_schedule(ScheduleKind kind, int pp, int v, int n) {
  require_positive(pp, "pp_size");
  require_positive(v, "stages_per_rank");
  require_positive(n, "n_microbatches");
  if (kind != ScheduleKind::Interleaved1F1B && v != 1) {
    throw ArgumentError("stages_per_rank", "build_schedule: " + to_string(kind) +
                                               " runs one stage per rank; 'stages_per_rank' = " +
                                               std::to_string(v) +
                                               " needs the interleaved schedule");
  }
  if (kind != ScheduleKind::GPipe && n < pp) {
    throw ArgumentError("n_microbatches", "build_schedule: " + to_string(kind) + " needs at least "
                                              "as many microbatches as pipeline ranks; "
                                              "'n_microbatches' = " + std::to_string(n) +
                                              " < pp_size = " + std::to_string(pp));
  }
  if (kind == ScheduleKind::Interleaved1F1B && n % pp != 0) {
    throw ArgumentError("n_microbatches", "build_schedule: interleaved needs 'n_microbatches' (" +
                                              std::to_string(n) + ") to be a multiple of "
                                              "pp_size (" + std::to_string(pp) + ")");
  }
  const int stages = pp * v;
  std::vector<std::vector<Action>> orders;
  for (int r = 0; r < pp; ++r) orders.push_back(compute_order(kind, pp, v, n, r));

  // have_input[s][m]: stage s's input activation for m is on its rank;
  // have_grad[s][m]: the gradient of stage s's output for m is.
  std::vector<std::vector<bool>> have_input(stages, std::vector<bool>(n, false));
  std::vector<std::vector<bool>> have_grad(stages, std::vector<bool>(n, false));
  std::vector<std::vector<bool>> forward_done(stages, std::vector<bool>(n, false));
  std::vector<int> backwards_left(stages, n);
  std::vector<size_t> next(pp, 0);
  std::vector<std::vector<Slot>> slots(pp);
  // Values produced in the previous tick that cross ranks: (is_grad, stage of
  // the producer, microbatch).
  std::vector<std::tuple<bool, int, int>> produced;

  for (int tick = 0;; ++tick) {
    bool work_left = !produced.empty();
    for (int r = 0; r < pp; ++r) work_left = work_left || next[r] < orders[r].size();
    if (!work_left) break;
    if (tick > 4 * (stages * n + stages) + 8) {
      throw StateError("build_schedule: " + to_string(kind) + " made no progress (internal error)");
    }
    for (auto& s : slots) s.emplace_back();
    // Transfers of the last tick's outputs, on both sides in this slot.
    for (const auto& [is_grad, s, m] : produced) {
      const int to_stage = is_grad ? s - 1 : s + 1;
      const int from = stage_rank(s, pp), to = stage_rank(to_stage, pp);
      if (is_grad) {
        slots[from].back().comm.push_back({ActionType::SendBackward, s, m});
        slots[to].back().comm.push_back({ActionType::RecvBackward, to_stage, m});
        have_grad[to_stage][m] = true;
      } else {
        slots[from].back().comm.push_back({ActionType::SendForward, s, m});
        slots[to].back().comm.push_back({ActionType::RecvForward, to_stage, m});
        have_input[to_stage][m] = true;
      }
    }
    produced.clear();
    std::vector<std::tuple<bool, int, int>> local;  // same-rank values, usable next tick
    for (int r = 0; r < pp; ++r) {
      Slot& slot = slots[r].back();
      if (tick == 0) {
        for (int s = r; s < stages; s += pp) slot.compute.push_back({ActionType::Unshard, s, -1});
      }
      if (next[r] >= orders[r].size()) continue;
      const Action a = orders[r][next[r]];
      const int s = a.stage, m = a.microbatch;
      const bool ready = a.type == ActionType::Forward
                             ? (s == 0 || have_input[s][m])
                             : (forward_done[s][m] && (s == stages - 1 || have_grad[s][m]));
      if (!ready) continue;
      slot.compute.push_back(a);
      ++next[r];
      if (a.type == ActionType::Forward) {
        forward_done[s][m] = true;
        if (s + 1 < stages) {
          (stage_rank(s + 1, pp) == r ? local : produced).emplace_back(false, s, m);
        }
      } else {
        if (--backwards_left[s] == 0) slot.compute.push_back({ActionType::ReduceGrad, s, -1});
        if (s > 0) (stage_rank(s - 1, pp) == r ? local : produced).emplace_back(true, s, m);
      }
    }
    for (const auto& [is_grad, s, m] : local) {
      if (is_grad) {
        have_grad[s - 1][m] = true;
      } else {
        have_input[s + 1][m] = true;
      }
    }
  }
  return slots;
}

namespace {

// check_schedule's walk through the slots, one step per method; each returns
// the first violation it finds ("" for none).
class ScheduleChecker {
 public:
  ScheduleChecker(const std::vector<std::vector<Slot>>& schedule, int pp, int stages, int n)
      : schedule_(schedule), pp_(pp), stages_(stages), n_(n) {}

  std::string run() {
    std::string err = check_shape();
    const size_t length = schedule_.empty() ? 0 : schedule_[0].size();
    for (size_t t = 0; err.empty() && t < length; ++t) {
      err = check_transfers(t);
      if (err.empty()) err = check_compute(t);
    }
    return err.empty() ? check_complete() : err;
  }

 private:
  // (from rank, to rank, is_grad, sender stage, mb)
  using Transfer = std::tuple<int, int, bool, int, int>;

  bool in_range(const Action& a) const {
    return a.stage >= 0 && a.stage < stages_ &&
           (a.type == ActionType::Unshard || a.type == ActionType::ReduceGrad ||
            (a.microbatch >= 0 && a.microbatch < n_));
  }
  bool its_stage(int r, const Action& a) const {
    return in_range(a) && stage_rank(a.stage, pp_) == r;
  }
  static std::string not_its_stage(size_t t, int r, const Action& a) {
    std::ostringstream err;
    err << "slot " << t << ": rank " << r << " runs " << to_string(a)
        << ", which is not one of its stages (or out of range)";
    return err.str();
  }

  // One list of slots per rank, all of the same length.
  std::string check_shape() const {
    std::ostringstream err;
    if (static_cast<int>(schedule_.size()) != pp_) {
      err << "the schedule has " << schedule_.size() << " ranks, expected " << pp_;
      return err.str();
    }
    const size_t length = schedule_.empty() ? 0 : schedule_[0].size();
    for (int r = 0; r < pp_; ++r) {
      if (schedule_[r].size() != length) {
        err << "rank " << r << " has " << schedule_[r].size() << " slots, rank 0 " << length;
        return err.str();
      }
    }
    return "";
  }

  // Slot t's transfers: each send matched by a receive in the same slot and
  // the other way round; what arrives is then at its consumer's rank.
  std::string check_transfers(size_t t) {
    std::map<Transfer, int> sends, recvs;
    std::string err = collect_transfers(t, sends, recvs);
    if (err.empty()) err = match(t, sends, recvs, /*sends_first=*/true);
    if (err.empty()) err = match(t, recvs, sends, /*sends_first=*/false);
    if (!err.empty()) return err;
    for (const auto& [tr, count] : recvs) {
      const auto& [from, to, is_grad, s, m] = tr;
      (void)from;
      (void)to;
      (void)count;
      (is_grad ? have_grad_ : have_input_).insert({is_grad ? s - 1 : s + 1, m});
    }
    return "";
  }

  std::string collect_transfers(size_t t, std::map<Transfer, int>& sends,
                                std::map<Transfer, int>& recvs) const {
    for (int r = 0; r < pp_; ++r) {
      for (const Action& a : schedule_[r][t].comm) {
        if (!its_stage(r, a)) return not_its_stage(t, r, a);
        switch (a.type) {
          case ActionType::SendForward:
            if (a.stage + 1 >= stages_) break;
            ++sends[{r, stage_rank(a.stage + 1, pp_), false, a.stage, a.microbatch}];
            continue;
          case ActionType::SendBackward:
            if (a.stage == 0) break;
            ++sends[{r, stage_rank(a.stage - 1, pp_), true, a.stage, a.microbatch}];
            continue;
          case ActionType::RecvForward:
            if (a.stage == 0) break;
            ++recvs[{stage_rank(a.stage - 1, pp_), r, false, a.stage - 1, a.microbatch}];
            continue;
          case ActionType::RecvBackward:
            if (a.stage + 1 >= stages_) break;
            ++recvs[{stage_rank(a.stage + 1, pp_), r, true, a.stage + 1, a.microbatch}];
            continue;
          default: break;
        }
        std::ostringstream err;
        err << "slot " << t << ": rank " << r << " has " << to_string(a)
            << " in its transfers, which is not a transfer to an existing stage";
        return err.str();
      }
    }
    return "";
  }

  // Every transfer of `these` (the sends, or the receives) has as many of
  // its kind in `those` (the receives, or the sends).
  static std::string match(size_t t, const std::map<Transfer, int>& these,
                           const std::map<Transfer, int>& those, bool sends_first) {
    for (const auto& [tr, count] : these) {
      auto it = those.find(tr);
      if (it != those.end() && it->second == count) continue;
      const auto& [from, to, is_grad, s, m] = tr;
      std::ostringstream err;
      if (sends_first) {
        err << "slot " << t << ": rank " << from << "'s "
            << to_string({is_grad ? ActionType::SendBackward : ActionType::SendForward, s, m})
            << " has no matching receive on rank " << to << " in the same slot";
      } else {
        const int own = is_grad ? s - 1 : s + 1;
        err << "slot " << t << ": rank " << to << "'s "
            << to_string({is_grad ? ActionType::RecvBackward : ActionType::RecvForward, own, m})
            << " has no matching send on rank " << from << " in the same slot";
      }
      return err.str();
    }
    return "";
  }

  // Slot t's compute actions, in order, against what has run and arrived.
  std::string check_compute(size_t t) {
    for (int r = 0; r < pp_; ++r) {
      for (const Action& a : schedule_[r][t].compute) {
        if (!its_stage(r, a)) return not_its_stage(t, r, a);
        std::string err;
        switch (a.type) {
          case ActionType::Forward: err = forward(t, r, a); break;
          case ActionType::Backward: err = backward(t, r, a); break;
          case ActionType::ReduceGrad: err = reduce_grad(t, a); break;
          case ActionType::Unshard: break;
          default: {
            std::ostringstream os;
            os << "slot " << t << ": rank " << r << " has " << to_string(a)
               << " among its compute actions";
            err = os.str();
          }
        }
        if (!err.empty()) return err;
      }
    }
    return "";
  }

  // "slot <t>: <a> runs <when>"
  static std::string runs(size_t t, const Action& a, const char* when) {
    std::ostringstream err;
    err << "slot " << t << ": " << to_string(a) << " runs " << when;
    return err.str();
  }

  std::string forward(size_t t, int r, const Action& a) {
    const Key k{a.stage, a.microbatch};
    if (forwards_.count(k)) return runs(t, a, "twice");
    if (a.stage > 0 && !have_input_.count(k)) return runs(t, a, "before its input arrived");
    forwards_.insert(k);
    // A consumer on the same rank has it at once.
    if (a.stage + 1 < stages_ && stage_rank(a.stage + 1, pp_) == r) {
      have_input_.insert({a.stage + 1, a.microbatch});
    }
    return "";
  }

  std::string backward(size_t t, int r, const Action& a) {
    const Key k{a.stage, a.microbatch};
    if (backwards_.count(k)) return runs(t, a, "twice");
    if (!forwards_.count(k)) return runs(t, a, "before its forward");
    if (a.stage + 1 < stages_ && !have_grad_.count(k)) {
      return runs(t, a, "before its output's gradient arrived");
    }
    backwards_.insert(k);
    if (a.stage > 0 && stage_rank(a.stage - 1, pp_) == r) {
      have_grad_.insert({a.stage - 1, a.microbatch});
    }
    return "";
  }

  std::string reduce_grad(size_t t, const Action& a) {
    int done = 0;
    for (int m = 0; m < n_; ++m) done += backwards_.count({a.stage, m}) ? 1 : 0;
    if (done != n_ || reduced_.count(a.stage)) {
      return runs(t, a, reduced_.count(a.stage) ? "twice" : "before the stage's last backward");
    }
    reduced_.insert(a.stage);
    return "";
  }

  // After the last slot: every stage ran each microbatch's forward and
  // backward, and reduced its gradients.
  std::string check_complete() const {
    std::ostringstream err;
    for (int s = 0; s < stages_; ++s) {
      for (int m = 0; m < n_; ++m) {
        if (!forwards_.count({s, m}) || !backwards_.count({s, m})) {
          err << "stage " << s << " microbatch " << m << " lacks its "
              << (!forwards_.count({s, m}) ? "forward" : "backward");
          return err.str();
        }
      }
      if (!reduced_.count(s)) {
        err << "stage " << s << " has no " << to_string({ActionType::ReduceGrad, s, -1});
        return err.str();
      }
    }
    return "";
  }

  const std::vector<std::vector<Slot>>& schedule_;
  const int pp_, stages_, n_;
  std::set<Key> forwards_, backwards_;
  std::set<Key> have_input_, have_grad_;  // arrived at the consumer's rank
  std::set<int> reduced_;
};

}  // namespace

std::string check_schedule(const std::vector<std::vector<Slot>>& schedule, int pp, int stages,
                           int n) {
  return ScheduleChecker(schedule, pp, stages, n).run();
}

}  // namespace fsdp::pp
