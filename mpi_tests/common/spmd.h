// SPMD test harness for Boost.Test suites run under mpiexec/srun.
//
// Link a test executable against fsdp_spmd (which provides main()) and write
// ordinary BOOST_AUTO_TEST_CASEs; every rank runs every case. The harness:
//  - starts an fsdp::Runtime before the first case and ends it after the last;
//  - after each case, aggregates the result over MPI: a case that failed on
//    any rank fails on every rank, and rank 0's log names the failing ranks
//    and their messages;
//  - logs on rank 0 only; other ranks print their log only when they fail;
//  - arms a per-case watchdog (60 s, or $FSDP_TEST_TIMEOUT seconds) that
//    prints the case, the rank and the pending collectives, then MPI_Aborts;
//  - writes a JUnit report from rank 0 to $FSDP_JUNIT_DIR/<executable>_np<N>.xml
//    when FSDP_JUNIT_DIR is set;
//  - records every precision comparison (record_precision) from rank 0 as one
//    JSON object per line in $FSDP_REPORT_DIR/<executable>_np<N>.jsonl when
//    FSDP_REPORT_DIR is set (truncated at start-up; fsdp-precision-report
//    renders the test plan's precision matrix from these files). Every
//    record carries the run id read from $FSDP_REPORT_DIR/run-id (written by
//    the CTest fixture precision_report_reset), and a case skipped by a
//    precondition writes a "skipped" record (test case and reason), so the
//    report can reject records of an earlier run and show a skipped plan
//    case as not run.
#pragma once

#include <fsdp/runtime.h>

#include <boost/test/unit_test.hpp>

#include <c10/core/Device.h>

#include <functional>
#include <string>

namespace spmd {

fsdp::Runtime& runtime();
int rank();
int world_size();
// Device the suite runs on: the Runtime's, which $FSDP_TEST_DEVICE ("cpu"
// or "cuda", set by every CTest entry) chooses (RuntimeOptions::device).
c10::Device device();
// Name of the running test case.
std::string current_case();

// One comparison a case made against its reference (see record_precision).
struct PrecisionRecord {
  std::string case_id;  // plan id, optionally followed by a variant: "L1-03", "L2-06 reentrant"
  // What was compared: "loss vs single card". The report reads the metric's
  // name: a name with the word "loss" ("loss", "step 1 loss", "per-chunk
  // losses") is a loss metric, one with "grad norm" a grad-norm metric; every
  // case of the plan's precision matrix must record at least one of each.
  std::string metric;
  double tolerance = 0;
  // Worst error, already reduced over every rank (max; for kind
  // "separation" the smallest gap, i.e. the min over ranks).
  double observed = 0;
  bool pass = false;
  // "precision": observed <= tolerance, tolerance > 0 (a row of the plan's
  //              precision matrix);
  // "exact":     observed <= 0 (bitwise equality required);
  // "separation": observed must exceed tolerance (e.g. unsynchronised replicas differ).
  // "expected-failure": a plan check that misses its tolerance by construction
  //              on this configuration; pass = observed > tolerance (the
  //              expectation held), note = the reason. Never counted as a pass.
  std::string kind = "precision";
  // Matrix row, e.g. "FSDP 1-D, fp32"; empty: the renderer maps the plan id.
  std::string configuration;
  // Free text, e.g. "bf16 stands in for fp16 on CPU". Notes registered with
  // add_case_note for this case id are appended.
  std::string note;
};

// Records one comparison. Not collective: call it on every rank (or any) with
// the value already reduced over the world; only rank 0 writes. No-op when
// $FSDP_REPORT_DIR is unset. Adds the test case, executable, np and device.
void record_precision(const PrecisionRecord& record);

// Attaches `note` to every later record of the running test case whose case
// id is `case_id` or starts with `case_id` followed by a space (cleared at the
// end of the test case). Not collective.
void add_case_note(const std::string& case_id, const std::string& note);

// Boost.Test precondition: unless `holds()` is true the case is skipped on
// every rank -- reported as skipped (the results summary, JUnit <skipped/>
// with the reason), never as a pass -- and rank 0 prints
// "SKIPPED <case>: <reason>". `holds` must answer the same on every rank
// (world size, device). Use as a decorator:
//   BOOST_AUTO_TEST_CASE(test_x, *spmd::needs_world_size(4, "a 2x2 mesh")) {...}
boost::unit_test::precondition skip_unless(std::function<bool()> holds, std::string reason);
boost::unit_test::precondition needs_world_size(int n, const std::string& reason);
boost::unit_test::precondition needs_world_size_at_least(int n, const std::string& reason);
boost::unit_test::precondition needs_even_world_size(const std::string& reason);
boost::unit_test::precondition needs_device(c10::DeviceType type, const std::string& reason);

}  // namespace spmd
