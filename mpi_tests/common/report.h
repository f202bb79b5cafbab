// The one precision report of the suites: a case's worst errors, asserted on
// each rank, then reduced over the world, printed by rank 0 and recorded for
// the precision matrix (spmd::record_precision).
#pragma once

#include "raw_mpi.h"
#include "spmd.h"

#include <boost/test/unit_test.hpp>

#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace testkit {

// Worst errors of one case (or one variant of it): check() asserts on this
// rank, publish() prints the maximum over all ranks from rank 0 as
//   [<id>] <what>: worst <err> (tol <tol>)                  without a configuration
//   [<id>] <configuration>: <what>: worst <err> (tol <tol>)  with one
// and records it (spmd::record_precision, with the configuration when there
// is one): kind "precision" when tol > 0, "exact" when tol == 0; pass =
// worst <= tol. check_differs() entries are recorded as kind "separation",
// metric "<what> (must exceed)", observed = the smallest gap over ranks,
// pass = gap > min_gap.
// publish() is collective: every rank must have made the same checks.
class Report {
 public:
  explicit Report(std::string id) : id_(std::move(id)) {}
  // `configuration`: the precision matrix's row ("FSDP 1-D, fp32"); it also
  // names the rank in a failed check's message.
  Report(std::string id, std::string configuration)
      : id_(std::move(id)), configuration_(std::move(configuration)), configured_(true) {}

  // `detail` (shown cut to 900 characters) explains a failure.
  bool check(const std::string& what, double err, double tol, const std::string& detail = "") {
    const bool ok = err <= tol;  // false for NaN
    if (configured_) {
      const std::string shown = detail.size() > 900 ? detail.substr(0, 900) + " ..." : detail;
      BOOST_TEST(ok, id_ << " [" << configuration_ << "] rank " << spmd::rank() << ": " << what
                         << ": error " << err << " exceeds tol " << tol
                         << (shown.empty() ? "" : " -- ") << shown);
    } else {
      BOOST_TEST(ok, id_ << " " << what << ": error " << err << " exceeds tol " << tol
                         << (detail.empty() ? "" : " -- ") << detail);
    }
    entries_.push_back({what, err, tol});
    return ok;
  }
  // Asserts that two things differ by more than `min_gap` (e.g. unsynchronised replicas).
  bool check_differs(const std::string& what, double gap, double min_gap) {
    const bool ok = gap > min_gap;
    BOOST_TEST(ok, id_ << " " << what << ": difference " << gap << " not above " << min_gap);
    differs_.push_back({what, gap, min_gap});
    return ok;
  }
  void publish() {
    for (const auto& e : entries_) {
      const double worst = raw_mpi::max_over_ranks(e.err);
      std::ostringstream os;
      os << "[" << id_ << "] " << (configured_ ? configuration_ + ": " : "") << e.what
         << ": worst " << std::scientific << std::setprecision(3) << worst << " (tol " << e.tol
         << ")";
      if (spmd::rank() == 0) std::cout << os.str() << std::endl;
      record(e.what, e.tol, worst, worst <= e.tol, e.tol > 0 ? "precision" : "exact");
    }
    for (const auto& e : differs_) {
      const double least = -raw_mpi::max_over_ranks(-e.err);
      std::ostringstream os;
      os << "[" << id_ << "] " << (configured_ ? configuration_ + ": " : "") << e.what
         << ": smallest difference " << std::scientific << std::setprecision(3) << least
         << " (must exceed " << e.tol << ")";
      if (spmd::rank() == 0) std::cout << os.str() << std::endl;
      record(e.what + " (must exceed)", e.tol, least, least > e.tol, "separation");
    }
    entries_.clear();
    differs_.clear();
  }

 private:
  struct Entry {
    std::string what;
    double err;
    double tol;
  };
  // `pass` is false for NaN (the comparisons above).
  void record(const std::string& metric, double tol, double observed, bool pass,
              const char* kind) const {
    spmd::PrecisionRecord r;
    r.case_id = id_;
    r.metric = metric;
    r.tolerance = tol;
    r.observed = observed;
    r.pass = pass;
    r.kind = kind;
    r.configuration = configuration_;
    spmd::record_precision(r);
  }
  std::string id_;
  std::string configuration_;
  bool configured_ = false;
  std::vector<Entry> entries_;
  std::vector<Entry> differs_;
};

}  // namespace testkit
