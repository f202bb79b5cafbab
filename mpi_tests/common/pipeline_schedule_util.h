// Shared pieces of the test_pipeline_schedule feature files
// (test_pipeline_schedule_{build,checks}.cpp): pipeline schedules as data
// (fsdp/pipeline.h, namespace fsdp::pp): pure functions, no communication;
// runs at np 1. Notation, the reference simulator and the hand-derived
// tables.
//
// What a schedule must be (the rules build_schedule follows):
//  - stage s runs on pp rank s % pp; rank r holds stages r, r + pp, ...;
//  - each rank runs its F/B actions in its compute order (GPipe, 1F1B,
//    interleaved 1F1B: compute_order below, written from the formulas);
//  - slots come from a lockstep simulation with one global tick per slot:
//    slot t = a comm phase (every value produced in tick t-1 that crosses
//    ranks: SEND on the producer, RECV on the consumer, both in slot t)
//    then a compute phase (at most one F/B per rank: the next one of its
//    order if its inputs are there; a value produced on the same rank is
//    there from the next tick without comm). Slot 0 starts with one
//    UNSHARD per local stage (ascending); a stage's REDUCE_GRAD follows its
//    last B in the same slot; every rank has the same number of slots.
//
// Expected slots come from two places that never call the library:
// literal tables derived by hand for small cases, and reference_schedule,
// an independent implementation of the simulation in this file, which is
// itself checked against the hand tables before it is trusted for the
// sweep over (kind, pp, v, n). Comm lists are compared as multisets (the
// order within one slot's comm list is not part of the contract); compute
#pragma once

#include "l1_util.h"
#include "spmd.h"

#include <fsdp/errors.h>
#include <fsdp/pipeline.h>

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cctype>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

namespace pp = fsdp::pp;
using pp::Action;
using pp::ActionType;
using pp::ScheduleKind;
using pp::Slot;
using Schedule = std::vector<std::vector<Slot>>;

inline const char* kind_name(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::GPipe: return "GPipe";
    case ScheduleKind::OneFOneB: return "1F1B";
    case ScheduleKind::Interleaved1F1B: return "Interleaved1F1B";
  }
  return "?";
}

// ---- actions written by hand ----------------------------------------------

// The test's own spelling of an action (PyTorch's notation), so that slot
// comparisons do not depend on the library's to_string.
inline std::string spell(const Action& a) {
  std::string t;
  switch (a.type) {
    case ActionType::Forward: t = "F"; break;
    case ActionType::Backward: t = "B"; break;
    case ActionType::SendForward: t = "SEND_F"; break;
    case ActionType::RecvForward: t = "RECV_F"; break;
    case ActionType::SendBackward: t = "SEND_B"; break;
    case ActionType::RecvBackward: t = "RECV_B"; break;
    case ActionType::Unshard: t = "UNSHARD"; break;
    case ActionType::ReduceGrad: t = "REDUCE_GRAD"; break;
  }
  std::string s = std::to_string(a.stage) + t;
  if (a.type != ActionType::Unshard && a.type != ActionType::ReduceGrad) {
    s += std::to_string(a.microbatch);
  }
  return s;
}

// "12SEND_F3" -> {SendForward, 12, 3}; "0UNSHARD" -> {Unshard, 0, -1}.
inline Action parse_action(const std::string& token) {
  size_t i = 0;
  while (i < token.size() && std::isdigit(static_cast<unsigned char>(token[i]))) ++i;
  size_t j = token.size();
  while (j > i && std::isdigit(static_cast<unsigned char>(token[j - 1]))) --j;
  if (i == 0) throw std::invalid_argument("no stage in '" + token + "'");
  const int stage = std::stoi(token.substr(0, i));
  const std::string type = token.substr(i, j - i);
  const int mb = j < token.size() ? std::stoi(token.substr(j)) : -1;
  static const std::map<std::string, ActionType> types = {
      {"F", ActionType::Forward},           {"B", ActionType::Backward},
      {"SEND_F", ActionType::SendForward},  {"RECV_F", ActionType::RecvForward},
      {"SEND_B", ActionType::SendBackward}, {"RECV_B", ActionType::RecvBackward},
      {"UNSHARD", ActionType::Unshard},     {"REDUCE_GRAD", ActionType::ReduceGrad}};
  const auto it = types.find(type);
  if (it == types.end()) throw std::invalid_argument("bad action type in '" + token + "'");
  const bool needs_mb = it->second != ActionType::Unshard && it->second != ActionType::ReduceGrad;
  if (needs_mb != (mb >= 0)) throw std::invalid_argument("bad microbatch in '" + token + "'");
  return Action{it->second, stage, mb};
}

inline std::vector<Action> parse_actions(const std::string& text) {
  std::istringstream in(text);
  std::vector<Action> out;
  for (std::string tok; in >> tok;) out.push_back(parse_action(tok));
  return out;
}

// One slot as "comm actions | compute actions", e.g. "0SEND_F1 2RECV_F0 | 2F0".
inline Slot parse_slot(const std::string& text) {
  const size_t bar = text.find('|');
  if (bar == std::string::npos || text.find('|', bar + 1) != std::string::npos) {
    throw std::invalid_argument("slot '" + text + "' needs exactly one '|'");
  }
  return Slot{parse_actions(text.substr(0, bar)), parse_actions(text.substr(bar + 1))};
}

// table[r][t] is rank r's slot t.
inline Schedule parse_table(const std::vector<std::vector<std::string>>& table) {
  Schedule s;
  for (const auto& rank : table) {
    s.emplace_back();
    for (const auto& slot : rank) s.back().push_back(parse_slot(slot));
  }
  return s;
}

inline std::string spell(const std::vector<Action>& v) {
  std::string s;
  for (const Action& a : v) s += (s.empty() ? "" : " ") + spell(a);
  return s;
}

inline std::string spell(const Slot& slot) { return spell(slot.comm) + " | " + spell(slot.compute); }

inline std::string spell(const std::vector<Slot>& slots) {
  std::ostringstream os;
  for (size_t t = 0; t < slots.size(); ++t) os << "\n    t" << t << ": " << spell(slots[t]);
  return os.str();
}

inline bool action_less(const Action& a, const Action& b) {
  return std::make_tuple(static_cast<int>(a.type), a.stage, a.microbatch) <
         std::make_tuple(static_cast<int>(b.type), b.stage, b.microbatch);
}

inline std::vector<Action> sorted(std::vector<Action> v) {
  std::sort(v.begin(), v.end(), action_less);
  return v;
}

// "" when `got` equals `want` slot by slot (comm lists as multisets,
// compute lists in order); else the first difference and both ranks' lists.
inline std::string schedule_difference(const Schedule& got, const Schedule& want) {
  std::ostringstream os;
  if (got.size() != want.size()) {
    os << got.size() << " ranks, expected " << want.size();
    return os.str();
  }
  for (size_t r = 0; r < want.size(); ++r) {
    std::string why;
    if (got[r].size() != want[r].size()) {
      why = std::to_string(got[r].size()) + " slots, expected " + std::to_string(want[r].size());
    }
    for (size_t t = 0; why.empty() && t < want[r].size(); ++t) {
      if (sorted(got[r][t].comm) != sorted(want[r][t].comm)) {
        why = "slot " + std::to_string(t) + " comm is {" + spell(got[r][t].comm) +
              "}, expected {" + spell(want[r][t].comm) + "} (any order)";
      } else if (got[r][t].compute != want[r][t].compute) {
        why = "slot " + std::to_string(t) + " compute is [" + spell(got[r][t].compute) +
              "], expected [" + spell(want[r][t].compute) + "]";
      }
    }
    if (!why.empty()) {
      os << "rank " << r << ": " << why << "\n  got:" << spell(got[r]) << "\n  expected:"
         << spell(want[r]);
      return os.str();
    }
  }
  return "";
}

// ---- the rules, implemented independently of the library ------------------

inline Action F(int s, int m) { return Action{ActionType::Forward, s, m}; }
inline Action B(int s, int m) { return Action{ActionType::Backward, s, m}; }

inline bool is_fb(const Action& a) {
  return a.type == ActionType::Forward || a.type == ActionType::Backward;
}

// Rank r's F/B actions in the order it runs them.
inline std::vector<Action> compute_order(ScheduleKind kind, int pp_size, int v, int n, int r) {
  std::vector<Action> out;
  switch (kind) {
    case ScheduleKind::GPipe:
      for (int m = 0; m < n; ++m) out.push_back(F(r, m));
      for (int m = 0; m < n; ++m) out.push_back(B(r, m));
      break;
    case ScheduleKind::OneFOneB: {
      const int w = std::min(pp_size - 1 - r, n);
      for (int m = 0; m < w; ++m) out.push_back(F(r, m));
      for (int i = 0; i < n - w; ++i) {
        out.push_back(F(r, w + i));
        out.push_back(B(r, i));
      }
      for (int m = n - w; m < n; ++m) out.push_back(B(r, m));
      break;
    }
    case ScheduleKind::Interleaved1F1B: {
      const int total = n * v, round = pp_size * v;
      auto mb = [&](int k) { return (k / round) * pp_size + k % pp_size; };
      auto fwd = [&](int k) { return F(r + ((k % round) / pp_size) * pp_size, mb(k)); };
      auto bwd = [&](int k) { return B(r + (v - 1 - (k % round) / pp_size) * pp_size, mb(k)); };
      const int warmup = std::min((pp_size - r - 1) * 2 + (v - 1) * pp_size, total);
      for (int k = 0; k < warmup; ++k) out.push_back(fwd(k));
      for (int i = 0; i < total - warmup; ++i) {
        out.push_back(fwd(warmup + i));
        out.push_back(bwd(i));
      }
      for (int k = total - warmup; k < total; ++k) out.push_back(bwd(k));
      break;
    }
  }
  return out;
}

// The lockstep simulation of the rules, written here from scratch.
inline Schedule reference_schedule(ScheduleKind kind, int pp_size, int v, int n) {
  const int S = pp_size * v;
  auto rank_of = [pp_size](int stage) { return stage % pp_size; };
  std::vector<std::vector<Action>> order;
  for (int r = 0; r < pp_size; ++r) order.push_back(compute_order(kind, pp_size, v, n, r));
  std::vector<size_t> next(static_cast<size_t>(pp_size), 0);
  std::set<std::pair<int, int>> input_there, grad_there, forward_done;  // (stage, mb)
  std::vector<int> backwards(static_cast<size_t>(S), 0);
  struct Produced {
    bool forward;  // activation for stage + 1, else gradient for stage - 1
    int stage, mb;
  };
  std::vector<Produced> last_tick;
  Schedule out(static_cast<size_t>(pp_size));
  for (int t = 0;; ++t) {
    bool done = last_tick.empty();
    for (int r = 0; r < pp_size; ++r) done = done && next[r] == order[r].size();
    if (done) break;
    if (t > 100000) throw std::runtime_error("reference simulation does not terminate");
    for (auto& slots : out) slots.emplace_back();
    for (const Produced& p : last_tick) {
      const int to = p.forward ? p.stage + 1 : p.stage - 1;
      (p.forward ? input_there : grad_there).insert({to, p.mb});
      if (rank_of(to) == rank_of(p.stage)) continue;
      out[rank_of(p.stage)][t].comm.push_back(
          Action{p.forward ? ActionType::SendForward : ActionType::SendBackward, p.stage, p.mb});
      out[rank_of(to)][t].comm.push_back(
          Action{p.forward ? ActionType::RecvForward : ActionType::RecvBackward, to, p.mb});
    }
    last_tick.clear();
    for (int r = 0; r < pp_size; ++r) {
      std::vector<Action>& compute = out[r][t].compute;
      if (t == 0) {
        for (int s = r; s < S; s += pp_size) compute.push_back(Action{ActionType::Unshard, s, -1});
      }
      if (next[r] == order[r].size()) continue;
      const Action a = order[r][next[r]];
      const std::pair<int, int> key{a.stage, a.microbatch};
      const bool forward = a.type == ActionType::Forward;
      const bool ready = forward ? (a.stage == 0 || input_there.count(key) > 0)
                                 : (forward_done.count(key) > 0 &&
                                    (a.stage == S - 1 || grad_there.count(key) > 0));
      if (!ready) continue;
      compute.push_back(a);
      ++next[r];
      if (forward) {
        forward_done.insert(key);
        if (a.stage < S - 1) last_tick.push_back({true, a.stage, a.microbatch});
      } else {
        if (a.stage > 0) last_tick.push_back({false, a.stage, a.microbatch});
        if (++backwards[a.stage] == n) compute.push_back(Action{ActionType::ReduceGrad, a.stage, -1});
      }
    }
  }
  return out;
}

// ---- hand-derived schedules -----------------------------------------------

// GPipe, pp 2, 1 stage per rank, 2 microbatches.
const std::vector<std::vector<std::string>> kGPipe2x2 = {
    {
        " | 0UNSHARD 0F0",
        "0SEND_F0 | 0F1",
        "0SEND_F1 | ",
        " | ",
        "0RECV_B0 | 0B0",
        "0RECV_B1 | 0B1 0REDUCE_GRAD",
    },
    {
        " | 1UNSHARD",
        "1RECV_F0 | 1F0",
        "1RECV_F1 | 1F1",
        " | 1B0",
        "1SEND_B0 | 1B1 1REDUCE_GRAD",
        "1SEND_B1 | ",
    },
};

// 1F1B, pp 2, 4 microbatches. Orders: rank 0 (warm-up 1) F0 F1 B0 F2 B1 F3
// B2 B3; rank 1 (warm-up 0) F0 B0 F1 B1 F2 B2 F3 B3.
const std::vector<std::vector<std::string>> k1F1B2x4 = {
    {
        " | 0UNSHARD 0F0",
        "0SEND_F0 | 0F1",
        "0SEND_F1 | ",  // B0 waits for stage 1's gradient
        "0RECV_B0 | 0B0",
        " | 0F2",
        "0SEND_F2 0RECV_B1 | 0B1",
        " | 0F3",
        "0SEND_F3 0RECV_B2 | 0B2",
        " | ",  // B3 waits
        "0RECV_B3 | 0B3 0REDUCE_GRAD",
    },
    {
        " | 1UNSHARD",
        "1RECV_F0 | 1F0",
        "1RECV_F1 | 1B0",
        "1SEND_B0 | 1F1",
        " | 1B1",
        "1RECV_F2 1SEND_B1 | 1F2",
        " | 1B2",
        "1RECV_F3 1SEND_B2 | 1F3",
        " | 1B3 1REDUCE_GRAD",
        "1SEND_B3 | ",
    },
};

// Interleaved 1F1B, pp 2, 2 stages per rank (rank 0: stages 0, 2; rank 1:
// 1, 3), 2 microbatches. Orders: rank 0 (warm-up min(2 + 2, 4) = 4) F(0,0)
// F(0,1) F(2,0) F(2,1) B(2,0) B(2,1) B(0,0) B(0,1); rank 1 (warm-up 2)
// F(1,0) F(1,1) F(3,0) B(3,0) F(3,1) B(3,1) B(1,0) B(1,1). Every stage
// boundary crosses ranks.
const std::vector<std::vector<std::string>> kInterleaved2x2x2 = {
    {
        " | 0UNSHARD 2UNSHARD 0F0",
        "0SEND_F0 | 0F1",
        "0SEND_F1 2RECV_F0 | 2F0",
        "2SEND_F0 2RECV_F1 | 2F1",
        "2SEND_F1 | ",  // B(2,0) waits for stage 3
        "2RECV_B0 | 2B0",
        "2SEND_B0 | ",  // B(2,1) waits for stage 3
        "2RECV_B1 | 2B1 2REDUCE_GRAD",
        "2SEND_B1 0RECV_B0 | 0B0",
        "0RECV_B1 | 0B1 0REDUCE_GRAD",
    },
    {
        " | 1UNSHARD 3UNSHARD",
        "1RECV_F0 | 1F0",
        "1RECV_F1 1SEND_F0 | 1F1",
        "3RECV_F0 1SEND_F1 | 3F0",
        "3RECV_F1 | 3B0",
        "3SEND_B0 | 3F1",
        "1RECV_B0 | 3B1 3REDUCE_GRAD",
        "3SEND_B1 | 1B0",
        "1RECV_B1 1SEND_B0 | 1B1 1REDUCE_GRAD",
        "1SEND_B1 | ",
    },
};

// Interleaved on one rank, 2 stages, 1 microbatch: the stage boundary is
// local, so no comm at all; F(1,0) runs the tick after F(0,0).
const std::vector<std::vector<std::string>> kInterleaved1x2x1 = {
    {
        " | 0UNSHARD 1UNSHARD 0F0",
        " | 1F0",
        " | 1B0 1REDUCE_GRAD",
        " | 0B0 0REDUCE_GRAD",
    },
};

// Whether `msg` names one of `words`.
inline bool names_any(const std::string& msg, const std::vector<std::string>& words) {
  for (const auto& w : words) {
    if (msg.find(w) != std::string::npos) return true;
  }
  return false;
}

// Slots without an F or B.
inline int idle_slots(const std::vector<Slot>& slots) {
  int idle = 0;
  for (const Slot& s : slots) {
    idle += std::none_of(s.compute.begin(), s.compute.end(), is_fb) ? 1 : 0;
  }
  return idle;
}

}  // namespace
