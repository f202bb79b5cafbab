// Level-3 helpers: run a reference case under the FSDP, HSDP and DDP
// layouts (reference/'s runner), load its cached single-card reference
// (data/reference/cpu/<case>.h5, failing on a stale or missing one; the
// gpu entries compare their CUDA runs with these CPU ones too), and
// compare records metric by metric into an l1::Report (worst error over
// ranks printed as "[L3-xx] <what>: worst <err> (tol <tol>)").
//
// Baselines are the single-card reference and an independent DDP run --
// never another FSDP run (plan rule 1); FSDP-vs-FSDP appears only in the
// bitwise determinism check (rule 5: same process, same rank count).
#pragma once

#include "l1_util.h"
#include "spmd.h"
#include "raw_mpi.h"

#include <reference/case.h>
#include <reference/store.h>

#include <boost/test/unit_test.hpp>

#include <chrono>
#include <cmath>
#include <iostream>
#include <map>
#include <string>
#include <vector>

namespace l3 {

inline void say(const std::string& text) {
  BOOST_TEST_MESSAGE(text);
  if (spmd::rank() == 0) std::cout << text << std::endl;
}

// The committed reference of `c`; a stale or missing one fails the case with
// the regeneration command (never regenerated on the fly).
inline ref::RunRecord load_reference(const ref::Case& c) {
  const std::string path = ref::reference_path(ref::default_reference_dir(), "cpu", c.name());
  try {
    return ref::read_reference(path, c).record;
  } catch (const ref::StaleReference& e) {
    BOOST_FAIL(e.what());
  }
  return {};
}

inline std::string mesh_text(const ref::RunSpec& spec) {
  if (spec.layout == ref::Layout::DDP) return "DDP";
  if (spec.ep.size > 1) {
    return "EP (replicate " + std::to_string(spec.mesh_shape.at(0)) + ", efsdp " +
           std::to_string(spec.mesh_shape.at(1)) + ", ep " + std::to_string(spec.ep.size) + ")";
  }
  std::string text =
      spec.mesh_shape.size() == 1
          ? "FSDP 1-D (" + std::to_string(spec.mesh_shape[0]) + ")"
          : "HSDP (" + std::to_string(spec.mesh_shape[0]) + "x" +
                std::to_string(spec.mesh_shape[1]) + ")";
  if (spec.reshard_after_forward.ranks() || spec.reshard_after_forward.is_within_node()) {
    text += " + reshard_after_forward " + fsdp::to_string(spec.reshard_after_forward);
  }
  if (spec.tp.size > 1) {
    text += " + TP " + std::to_string(spec.tp.size);
    if (spec.tp.sequence_parallel) text += " + SP";
    if (spec.tp.loss_parallel) text += " + loss parallel";
  }
  return text;
}

// Runs on the suite's device (spmd::device(): the gpu entries train the
// networks on CUDA and compare with the same CPU references).
inline ref::RunSpec fsdp(std::vector<int64_t> shape) {
  ref::RunSpec s;
  s.device = spmd::device();
  s.layout = ref::Layout::FSDP;
  s.mesh_shape = std::move(shape);
  return s;
}

// The FSDP 1-D cases' two meshes at this world size: 1-D over every rank,
// and HSDP replicate 2 x shard N/2 -- at 2 ranks 2x1, where the shard dim
// has one rank and nothing is sharded, hence the np 4 entries' 2x2.
inline std::pair<ref::RunSpec, ref::RunSpec> one_d_and_two_d() {
  const int64_t n = spmd::world_size();
  return {fsdp({n}), fsdp({2, n / 2})};
}

// Shards: the mesh's shard dim has more than one rank.
inline bool shards(const ref::RunSpec& spec) { return spec.mesh_shape.back() > 1; }

// dp2ep: dense weights on (replicate, efsdp x ep), experts on ep and
// (replicate, efsdp).
inline ref::RunSpec fsdp_ep(int64_t replicate, int64_t efsdp, int64_t ep) {
  ref::RunSpec s = fsdp({replicate, efsdp});
  s.ep.size = ep;
  return s;
}

inline ref::RunSpec ddp() {
  ref::RunSpec s;
  s.device = spmd::device();
  s.layout = ref::Layout::DDP;
  return s;
}

inline ref::RunRecord timed_run(const ref::Case& c, const ref::RunSpec& spec) {
  const auto t0 = std::chrono::steady_clock::now();
  ref::RunRecord r = ref::run(c, spec);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  say("  " + c.name() + " under " + mesh_text(spec) + ": " + std::to_string(r.steps.size()) +
      " steps in " + std::to_string(s).substr(0, 5) + " s");
  return r;
}

// Which parts of a record a comparison covers.
struct Metrics {
  bool loss = true;
  bool grad_norm = true;
  bool sub_norms = true;
  bool chunks = true;
  bool grads = true;
  bool params = true;
  // > 0: AdamW's eps. Post-step parameters are then compared only where
  // every step so far had a reference gradient of at least 100 eps. Below
  // that, AdamW's update g / (|g| + eps) amplifies a gradient difference by
  // up to lr / eps: an ulp-level reordering of a gradient that is itself
  // ~eps (TP changes GEMM shapes) moves the parameter by ~1e-5 although the
  // gradient agrees to 1e-9. Those elements' gradients are still compared
  // (grads), and the excluded count is part of the metric's name.
  double adam_eps = 0;
  // Sub-norms the plan gives their own tolerance (name -> tol; others: tol).
  std::map<std::string, double> norm_tol;
};

// Elements of `name` whose reference gradient stayed >= 100 * eps through
// step k (all of them when eps is 0).
inline at::Tensor well_conditioned(const ref::RunRecord& want, size_t k, const std::string& name,
                                   double eps) {
  at::Tensor mask;
  for (size_t j = 0; j <= k; ++j) {
    const at::Tensor g = want.steps[j].grads.at(name);
    const at::Tensor ok = g.abs() >= 100 * eps;
    mask = mask.defined() ? mask.logical_and(ok) : ok;
  }
  return mask;
}

inline double tensor_diff(const std::map<std::string, at::Tensor>& g,
                          const std::map<std::string, at::Tensor>& w, const std::string& name) {
  auto a = g.find(name);
  auto b = w.find(name);
  if (a == g.end() || b == w.end()) return l1::kInf;
  return testkit::max_abs_diff_or_inf(a->second, b->second);
}

// Every metric of every step of `got` against `want` at `tol`, labelled
// "<label>: step k <metric>".
inline void compare(l1::Report& report, const std::string& label, const ref::RunRecord& got,
                    const ref::RunRecord& want, double tol, const Metrics& m = {}) {
  BOOST_REQUIRE_EQUAL(got.steps.size(), want.steps.size());
  // One step would compare the gradients of the initial weights only; the
  // second checks what the sharded optimizer step made of them.
  BOOST_REQUIRE_MESSAGE(got.steps.size() >= 2, label << ": " << got.steps.size()
                                                     << " step(s); L3 compares at least 2");
  auto names = [](const std::map<std::string, at::Tensor>& tensors) {
    std::string out;
    for (const auto& entry : tensors) out += (out.empty() ? "" : ", ") + entry.first;
    return "[" + out + "]";
  };
  for (size_t k = 0; k < got.steps.size(); ++k) {
    const auto& g = got.steps[k];
    const auto& w = want.steps[k];
    const std::string at = label + ": step " + std::to_string(k) + " ";
    // The loops below walk the reference's tensors: a reference recorded
    // with fewer (or none) would check less than the case asks for.
    BOOST_TEST(names(g.grads) == names(w.grads),
               at << "recorded gradients " << names(g.grads) << " vs the reference's "
                  << names(w.grads));
    BOOST_TEST(names(g.params) == names(w.params),
               at << "recorded parameters " << names(g.params) << " vs the reference's "
                  << names(w.params));
    // Routing first: a token sent to another expert changes its output by
    // O(1), so the numbers below mean nothing unless every token agrees.
    for (const auto& [layer, ids] : w.routing) {
      auto it = g.routing.find(layer);
      const double differ =
          it == g.routing.end() || it->second.sizes() != ids.sizes()
              ? l1::kInf
              : static_cast<double>((it->second != ids).any(1).sum().item<int64_t>());
      report.check(at + layer + " tokens routed differently (of " + std::to_string(ids.size(0)) + ")",
                   differ, 0.0);
    }
    if (m.loss) report.check(at + "loss", std::abs(g.loss - w.loss), tol);
    if (m.grad_norm) report.check(at + "global grad norm", std::abs(g.grad_norm - w.grad_norm), tol);
    if (m.sub_norms) {
      for (const auto& [name, v] : w.norms) {
        auto it = g.norms.find(name);
        auto own = m.norm_tol.find(name);
        report.check(at + name + " grad norm", it == g.norms.end() ? l1::kInf : std::abs(it->second - v),
                     own == m.norm_tol.end() ? tol : own->second);
      }
    }
    if (m.chunks && !w.chunk_losses.empty()) {
      double worst = g.chunk_losses.size() == w.chunk_losses.size() ? 0 : l1::kInf;
      for (size_t i = 0; i < g.chunk_losses.size() && i < w.chunk_losses.size(); ++i) {
        worst = std::max(worst, std::abs(g.chunk_losses[i] - w.chunk_losses[i]));
      }
      report.check(at + "per-chunk losses (" + std::to_string(w.chunk_losses.size()) + ")", worst, tol);
    }
    if (m.chunks && w.unchunked_loss) {
      report.check(at + "unchunked loss",
                   g.unchunked_loss ? std::abs(*g.unchunked_loss - *w.unchunked_loss) : l1::kInf,
                   tol);
    }
    if (m.grads) {
      for (const auto& [name, t] : w.grads) {
        report.check(at + "grad " + name, tensor_diff(g.grads, w.grads, name), tol);
      }
    }
    if (m.params) {
      for (const auto& [name, t] : w.params) {
        if (m.adam_eps <= 0 || !w.grads.count(name)) {
          report.check(at + "param " + name + " after AdamW", tensor_diff(g.params, w.params, name),
                       tol);
          continue;
        }
        const at::Tensor keep = well_conditioned(want, k, name, m.adam_eps);
        const int64_t skipped = keep.numel() - keep.sum().item<int64_t>();
        auto it = g.params.find(name);
        const double err = it == g.params.end()
                               ? l1::kInf
                               : testkit::max_abs_diff_or_inf(it->second.masked_select(keep),
                                                              t.masked_select(keep));
        report.check(at + "param " + name + " after AdamW (" + std::to_string(skipped) + " of " +
                         std::to_string(keep.numel()) + " elements with |grad| < 100 eps left to "
                         "the grad check)",
                     err, tol);
      }
    }
  }
}

// How a run placed the parameters whose names start with `prefix`:
// replicated (managed by a unit, every placement Replicate(), local shape =
// full shape) or sharded (a Shard placement and fewer local elements than
// full). Recorded as the number of parameters placed otherwise (0 expected;
// +inf when no parameter has the prefix). Each misplaced one is named.
inline void check_placement(l1::Report& report, const std::string& label,
                            const ref::RunRecord& run, const std::string& prefix,
                            bool replicated) {
  auto numel = [](const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  };
  int matched = 0, wrong = 0;
  for (const auto& [name, p] : run.placements) {
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    ++matched;
    const bool has_shard = p.placements.find("Shard(") != std::string::npos;
    const bool ok = replicated ? !p.placements.empty() && !has_shard && p.local_shape == p.full_shape
                               : has_shard && numel(p.local_shape) < numel(p.full_shape);
    BOOST_TEST(ok, label << ": " << name << " placements [" << p.placements << "], local "
                         << at::IntArrayRef(p.local_shape) << " of " << at::IntArrayRef(p.full_shape)
                         << "; expected " << (replicated ? "replicated" : "sharded"));
    if (!ok) ++wrong;
  }
  BOOST_TEST(matched > 0, label << ": no parameter named " << prefix << "*");
  report.check(label + ": " + prefix + "* " +
                   (replicated ? "not sharded (Replicate(), full local shape)"
                               : "sharded (Shard, a part of the rows locally)") +
                   ": parameters placed otherwise",
               matched > 0 ? wrong : l1::kInf, 0.0);
}

// Bitwise equality of two runs (rule 5): every scalar and tensor identical.
inline void check_bitwise(l1::Report& report, const std::string& label, const ref::RunRecord& a,
                          const ref::RunRecord& b) {
  double worst = a.steps.size() == b.steps.size() ? 0 : l1::kInf;
  for (size_t k = 0; k < a.steps.size() && k < b.steps.size(); ++k) {
    const auto& x = a.steps[k];
    const auto& y = b.steps[k];
    auto upd = [&](double d) { if (!(d <= worst)) worst = d; };
    upd(std::abs(x.loss - y.loss));
    upd(std::abs(x.grad_norm - y.grad_norm));
    for (const auto& [n, v] : x.norms) upd(y.norms.count(n) ? std::abs(v - y.norms.at(n)) : l1::kInf);
    upd(x.chunk_losses == y.chunk_losses ? 0 : l1::kInf);
    upd(x.unchunked_loss == y.unchunked_loss ? 0 : l1::kInf);
    upd(x.routing_margin == y.routing_margin ? 0 : l1::kInf);
    for (auto m : {&ref::StepRecord::grads, &ref::StepRecord::params, &ref::StepRecord::routing}) {
      for (const auto& [n, t] : x.*m) {
        auto it = (y.*m).find(n);
        upd(it == (y.*m).end() || !at::equal(t, it->second) ? l1::kInf : 0);
      }
    }
  }
  report.check(label + ": rerun in the same process bitwise identical", worst, 0.0);
}

// The same collectives in the same order on every communicator (the plan's
// "no all-to-all / all-gather conflict"): per group role, each step's ops of
// every rank against rank 0's; the first difference is named. Only the order
// within one communicator must agree: each group runs its collectives on its
// own thread, and the interleaving across groups may differ between ranks
// (HSDP issues a replicate all-reduce once its reduce-scatter has finished).
inline void check_same_collectives(l1::Report& report, const std::string& label,
                                   const ref::RunRecord& r) {
  for (size_t k = 0; k < r.steps.size(); ++k) {
    std::map<std::string, std::vector<std::string>> by_role;
    for (const auto& c : r.steps[k].collectives) {
      const size_t sep = c.find('@');
      by_role[c.substr(sep + 1)].push_back(c.substr(0, sep));
    }
    std::vector<std::string> mine;  // "<role> #<i> <op>", role by role
    std::string counts;
    for (const auto& [role, ops] : by_role) counts += " " + role + " " + std::to_string(ops.size());
    say("  " + label + ": step " + std::to_string(k) + " collectives on rank 0 by group:" + counts);
    for (const auto& [role, ops] : by_role) {
      for (size_t i = 0; i < ops.size(); ++i) mine.push_back(role + " #" + std::to_string(i) + " " + ops[i]);
    }
    std::string text;
    for (const auto& c : mine) text += c + "\n";
    at::Tensor size = at::full({1}, static_cast<int64_t>(text.size()), at::kLong);
    raw_mpi::broadcast(size, 0);
    // int32: raw_mpi takes no byte tensors.
    at::Tensor chars = at::zeros({size.item<int64_t>()}, at::kInt);
    if (spmd::rank() == 0) {
      for (size_t i = 0; i < text.size(); ++i) chars.data_ptr<int32_t>()[i] = text[i];
    }
    raw_mpi::broadcast(chars, 0);
    std::vector<std::string> first;
    std::string line;
    for (int64_t i = 0; i < chars.numel(); ++i) {
      const char ch = static_cast<char>(chars.data_ptr<int32_t>()[i]);
      if (ch == '\n') {
        first.push_back(line);
        line.clear();
      } else {
        line += ch;
      }
    }
    size_t n = 0;
    while (n < mine.size() && n < first.size() && mine[n] == first[n]) ++n;
    const bool same = n == mine.size() && n == first.size();
    BOOST_TEST(same, label << ": step " << k << " rank " << spmd::rank() << " has "
                           << (n < mine.size() ? mine[n] : "(none)") << " where rank 0 has "
                           << (n < first.size() ? first[n] : "(none)"));
    report.check(label + ": step " + std::to_string(k) + " collectives per communicator (" +
                     std::to_string(first.size()) + " on rank 0) identical on every rank",
                 same ? 0.0 : 1.0, 0.0);
  }
}

}  // namespace l3

namespace l3 {

// One case under every layout the plan asks for.
struct Runs {
  std::string main_label, other_label;
  ref::RunRecord single;     // cached single-card reference
  ref::RunRecord main;       // the plan's mesh
  ref::RunRecord again;      // the same, rerun in this process
  ref::RunRecord other;      // the other mesh shape (1-D <-> 2-D)
  ref::RunRecord ddp;        // independent data-parallel baseline
};

inline Runs run_layouts(const ref::Case& c, const ref::RunSpec& main, const ref::RunSpec& other) {
  Runs r;
  r.main_label = mesh_text(main);
  r.other_label = mesh_text(other);
  r.single = load_reference(c);
  r.main = timed_run(c, main);
  r.again = timed_run(c, main);
  r.other = timed_run(c, other);
  r.ddp = timed_run(c, ddp());
  return r;
}

// check_placement for each (prefix, replicated) on both runs of `runs`
// whose mesh shards (the 2x1 form at 2 ranks shards nothing).
inline void check_placements(l1::Report& report, const Runs& runs, const ref::RunSpec& main,
                             const ref::RunSpec& other,
                             const std::vector<std::pair<std::string, bool>>& expected) {
  for (const auto* run : {&runs.main, &runs.other}) {
    const bool is_main = run == &runs.main;
    if (!shards(is_main ? main : other)) continue;
    for (const auto& [prefix, replicated] : expected) {
      check_placement(report, is_main ? runs.main_label : runs.other_label, *run, prefix,
                      replicated);
    }
  }
}

// Both meshes against the single-card reference and against DDP, the DDP
// baseline itself against the reference, and the rerun bitwise.
inline void check_against_baselines(l1::Report& report, const Runs& r, double tol,
                                    const Metrics& m = {}) {
  compare(report, r.main_label + " vs single card", r.main, r.single, tol, m);
  compare(report, r.main_label + " vs DDP", r.main, r.ddp, tol, m);
  compare(report, r.other_label + " vs single card", r.other, r.single, tol, m);
  compare(report, r.other_label + " vs DDP", r.other, r.ddp, tol, m);
  compare(report, "DDP baseline vs single card", r.ddp, r.single, tol, m);
  check_bitwise(report, r.main_label, r.main, r.again);
}

}  // namespace l3
