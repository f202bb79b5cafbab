// fsdp-reference: runs the Level-3 reference cases single-process in fp32
// (one thread, so the numbers do not depend on the machine's core count) and
// writes data/reference/<device>/<case>.h5; or checks that a regeneration
// matches committed references bitwise.
#include "reference/case.h"
#include "reference/store.h"

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <H5Cpp.h>
#include <dlfcn.h>
#include <torch/version.h>

#include <chrono>
#include <cstdio>
#include <iostream>

namespace {

void single_thread() {
  at::set_num_threads(1);
  using SetThreads = void (*)(int);
  if (auto fn = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) fn(1);
}

// Largest |a - b| over two records' common contents; counts what differs.
struct Diff {
  double worst = 0;
  int64_t datasets = 0;
  int64_t differing = 0;
  std::vector<std::string> first;  // the first few differing dataset names
  void add(const std::string& what, double d) {
    ++datasets;
    if (!(d == 0)) {
      ++differing;
      if (first.size() < 5) first.push_back(what);
    }
    if (!(d <= worst)) worst = d;
  }
};

Diff compare(const ref::RunRecord& a, const ref::RunRecord& b) {
  Diff diff;
  if (a.steps.size() != b.steps.size()) {
    diff.add("steps", 1.0 / 0.0);
    return diff;
  }
  for (size_t k = 0; k < a.steps.size(); ++k) {
    const auto& x = a.steps[k];
    const auto& y = b.steps[k];
    const std::string s = "step" + std::to_string(k) + "/";
    diff.add(s + "loss", std::abs(x.loss - y.loss));
    diff.add(s + "grad_norm", std::abs(x.grad_norm - y.grad_norm));
    for (const auto& [n, v] : x.norms) {
      diff.add(s + "norms/" + n, y.norms.count(n) ? std::abs(v - y.norms.at(n)) : 1.0 / 0.0);
    }
    diff.add(s + "chunk_losses(count)", x.chunk_losses.size() == y.chunk_losses.size() ? 0 : 1.0 / 0.0);
    for (size_t i = 0; i < x.chunk_losses.size() && i < y.chunk_losses.size(); ++i) {
      diff.add(s + "chunk_losses", std::abs(x.chunk_losses[i] - y.chunk_losses[i]));
    }
    diff.add(s + "unchunked_loss", x.unchunked_loss.has_value() != y.unchunked_loss.has_value()
                                       ? 1.0 / 0.0
                                       : std::abs(x.unchunked_loss.value_or(0) -
                                                  y.unchunked_loss.value_or(0)));
    diff.add(s + "routing_margin", x.routing_margin == y.routing_margin
                                       ? 0
                                       : std::abs(x.routing_margin - y.routing_margin));
    diff.add(s + "routing(names)", x.routing.size() == y.routing.size() ? 0 : 1.0 / 0.0);
    for (const auto& [n, t] : x.routing) {
      auto it = y.routing.find(n);
      diff.add(s + "routing/" + n, it != y.routing.end() && t.equal(it->second) ? 0 : 1.0 / 0.0);
    }
    for (const auto* kind : {"grad", "param"}) {
      const auto& xm = std::string(kind) == "grad" ? x.grads : x.params;
      const auto& ym = std::string(kind) == "grad" ? y.grads : y.params;
      diff.add(s + kind + "(names)", xm.size() == ym.size() ? 0 : 1.0 / 0.0);
      for (const auto& [n, t] : xm) {
        auto it = ym.find(n);
        const bool same_shape = it != ym.end() && it->second.sizes() == t.sizes();
        diff.add(s + kind + "/" + n,
                 same_shape ? (t - it->second).abs().max().item<double>() : 1.0 / 0.0);
      }
    }
  }
  return diff;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Single-card fp32 reference runs of the test plan's Level-3 cases, cached in HDF5"};
  std::vector<std::string> cases;
  std::string out_dir = ref::default_reference_dir();
  std::string device = "cpu";
  std::string verify_dir;
  bool list = false;
  app.add_option("--case", cases, "Case(s) to run (default: all)")
      ->check(CLI::IsMember(ref::case_names()));
  app.add_option("--out", out_dir, "Reference directory; files go to <out>/<device>/<case>.h5")
      ->capture_default_str();
  app.add_option("--device", device, "Device subdirectory (the runs use the CPU)")
      ->check(CLI::IsMember({"cpu"}))
      ->capture_default_str();
  app.add_option("--verify-against", verify_dir,
                 "After generating, compare every dataset with <dir>/<device>/<case>.h5: bitwise "
                 "when that file was made with the same LibTorch and BLAS kernels");
  app.add_flag("--list", list, "List the cases and the plan ids they serve");
  CLI11_PARSE(app, argc, argv);

  if (list) {
    for (const auto& name : ref::case_names()) {
      auto c = ref::make_case(name);
      std::cout << name << "  (";
      for (size_t i = 0; i < c->plan_ids().size(); ++i) std::cout << (i ? ", " : "") << c->plan_ids()[i];
      std::cout << ")  config hash " << ref::config_hash(*c) << "\n";
    }
    return 0;
  }
  if (cases.empty()) cases = ref::case_names();
  single_thread();
  H5::Exception::dontPrint();

  int failures = 0;
  try {
  for (size_t i = 0; i < cases.size(); ++i) {
    auto c = ref::make_case(cases[i]);
    const std::string path = ref::reference_path(out_dir, device, c->name());
    std::cout << "[" << i + 1 << "/" << cases.size() << "] " << c->name() << ": " << c->steps()
              << " steps, global batch " << c->global_batch() << " ..." << std::flush;
    const auto t0 = std::chrono::steady_clock::now();
    ref::RunRecord record = ref::run(*c, ref::RunSpec{});
    ref::write_reference(path, *c, record);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf(" %.1f s, loss", secs);
    for (const auto& s : record.steps) std::printf(" %.6f", s.loss);
    std::printf(" -> %s\n", path.c_str());

    if (!verify_dir.empty()) {
      const std::string committed_path = ref::reference_path(verify_dir, device, c->name());
      ref::StoredReference committed;
      try {
        committed = ref::read_reference(committed_path, *c);
      } catch (const ref::StaleReference& e) {
        std::cout << "  FAIL: " << e.what() << "\n";
        ++failures;
        continue;
      }
      const ref::StoredReference fresh = ref::read_reference_unchecked(path);
      const Diff d = compare(committed.record, fresh.record);
      const bool comparable = committed.blas_core == fresh.blas_core &&
                              committed.libtorch_version == fresh.libtorch_version;
      if (comparable) {
        std::cout << "  " << (d.differing == 0 ? "bitwise identical" : "DIFFERS") << " to "
                  << committed_path << " (" << d.datasets << " datasets, " << d.differing
                  << " differ, worst " << d.worst << ")\n";
        if (d.differing != 0) ++failures;
      } else {
        // Different kernels round differently: bitwise equality is not owed.
        const double tol = 1e-5;
        std::cout << "  not bitwise comparable: " << committed_path << " was made with LibTorch "
                  << committed.libtorch_version << " / BLAS core '" << committed.blas_core
                  << "', this run with " << fresh.libtorch_version << " / '" << fresh.blas_core
                  << "'; worst difference " << d.worst << " (tol " << tol << ")\n";
        if (!(d.worst <= tol)) ++failures;
      }
      for (const auto& name : d.first) std::cout << "    differs: " << name << "\n";
    }
  }
  } catch (const std::exception& e) {
    std::cerr << "\nfsdp-reference: " << e.what() << "\n";
    return 2;
  }
  return failures == 0 ? 0 : 1;
}
