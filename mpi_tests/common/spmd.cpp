// main() and per-case machinery of the SPMD test harness (see spmd.h).
#include "spmd.h"

#include <fsdp/comm.h>

#include <ATen/Context.h>

#include <boost/test/results_collector.hpp>
#include <boost/test/tree/traverse.hpp>
#include <boost/test/tree/visitor.hpp>
#include <boost/test/unit_test_log.hpp>

#include <nlohmann/json.hpp>

#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

namespace utf = boost::unit_test;

namespace spmd {
namespace {

std::unique_ptr<fsdp::Runtime> g_runtime;
std::ostringstream g_rank_log;  // log of ranks > 0, shown only on failure
MPI_Comm g_harness_comm = MPI_COMM_NULL;
// Precision records: rank 0's JSON-lines file (empty: not recording) and the
// notes of the running case, by case id.
std::string g_report_path;
std::string g_report_run;  // $FSDP_REPORT_DIR/run-id, stamped on every record
std::string g_executable;
std::vector<std::pair<std::string, std::string>> g_case_notes;

double case_timeout_seconds() {
  const char* env = std::getenv("FSDP_TEST_TIMEOUT");
  if (env != nullptr && *env != '\0') {
    const double t = std::atof(env);
    if (t > 0) return t;
  }
  return 60.0;
}

// Aborts the whole MPI job when a case runs past its deadline.
class Watchdog {
 public:
  Watchdog() : thread_([this] { loop(); }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void arm(const std::string& case_name, double seconds) {
    std::lock_guard<std::mutex> lock(mu_);
    case_ = case_name;
    seconds_ = seconds;
    deadline_ = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
    armed_ = true;
    cv_.notify_all();
  }
  void disarm() {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = false;
    cv_.notify_all();
  }

 private:
  using Clock = std::chrono::steady_clock;
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (!armed_) {
        cv_.wait(lock);
        continue;
      }
      if (cv_.wait_until(lock, deadline_) == std::cv_status::timeout && armed_ &&
          Clock::now() >= deadline_) {
        // One write() per report: stuck ranks fire together, and chained
        // stream output from several processes interleaves mid-line.
        std::ostringstream msg;
        msg << "[watchdog] rank " << rank() << ": test case '" << case_ << "' exceeded "
            << seconds_ << " s (FSDP_TEST_TIMEOUT); pending collectives: "
            << fsdp::describe_pending_collectives() << "; aborting the MPI job\n";
        const std::string text = msg.str();
        [[maybe_unused]] const ssize_t written = ::write(STDERR_FILENO, text.data(), text.size());
        // Give the other stuck ranks a moment to report too before the job dies.
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        MPI_Abort(MPI_COMM_WORLD, 124);
      }
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false;
  bool stop_ = false;
  std::string case_;
  double seconds_ = 0;
  Clock::time_point deadline_;
  std::thread thread_;
};

std::unique_ptr<Watchdog> g_watchdog;

std::string current_name() { return utf::framework::current_test_case().p_name; }

bool failed_here() {
  const utf::test_results& r = utf::results_collector.results(utf::framework::current_test_case_id());
  return r.p_assertions_failed > 0 || r.aborted();
}

std::vector<char> gather_all(const std::string& text, std::vector<int>& lengths) {
  const int n = static_cast<int>(text.size());
  lengths.assign(static_cast<size_t>(world_size()), 0);
  MPI_Allgather(&n, 1, MPI_INT, lengths.data(), 1, MPI_INT, g_harness_comm);
  std::vector<int> displs(lengths.size(), 0);
  int total = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    displs[i] = total;
    total += lengths[i];
  }
  std::vector<char> all(static_cast<size_t>(std::max(total, 1)));
  MPI_Allgatherv(text.data(), n, MPI_CHAR, all.data(), lengths.data(), displs.data(), MPI_CHAR,
                 g_harness_comm);
  return all;
}

// Per-case fixture attached to every test case.
class CaseFixture : public utf::test_unit_fixture {
 public:
  void setup() override {
    g_rank_log.str("");
    g_case_notes.clear();
    g_watchdog->arm(current_name(), case_timeout_seconds());
  }
  void teardown() override {
    const bool failed = failed_here();
    std::string summary;
    if (failed) {
      summary = rank() == 0 ? std::string("see the log above") : g_rank_log.str();
      if (summary.size() > 4000) summary = summary.substr(0, 4000) + "...";
      if (rank() != 0) {
        const std::string text = "[rank " + std::to_string(rank()) + "] test case '" +
                                 current_name() + "' failed:\n" + g_rank_log.str();
        [[maybe_unused]] const ssize_t written = ::write(STDERR_FILENO, text.data(), text.size());
      }
    }
    std::vector<int> lengths;
    const std::string mine = failed ? "F" + summary : std::string();
    std::vector<char> all = gather_all(mine, lengths);
    g_watchdog->disarm();
    std::ostringstream others;
    int offset = 0;
    for (int r = 0; r < world_size(); ++r) {
      const int len = lengths[static_cast<size_t>(r)];
      if (len > 0 && r != rank()) {
        others << "\n  rank " << r << ": " << std::string(all.data() + offset + 1, len - 1);
      }
      offset += len;
    }
    if (!others.str().empty()) {
      BOOST_ERROR("case " << current_name() << " failed on other rank(s):" << others.str());
    }
  }
};

class AttachFixtures : public utf::test_tree_visitor {
 public:
  void visit(utf::test_case const& tc) override {
    const_cast<utf::test_case&>(tc).p_fixtures.value.push_back(
        utf::test_unit_fixture_ptr(new CaseFixture()));
  }
};

std::string g_suite_name;

bool init_suite() {
  utf::framework::master_test_suite().p_name.value = g_suite_name;
  AttachFixtures attach;
  utf::traverse_test_tree(utf::framework::master_test_suite(), attach, /*ignore_status=*/true);
  if (rank() != 0) {
    utf::unit_test_log.set_stream(g_rank_log);
    utf::unit_test_log.set_threshold_level(utf::log_all_errors);
  }
  return true;
}

std::string basename_of(const char* path) {
  std::string p(path);
  const auto slash = p.find_last_of('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

// "<exe>_np<N>" plus "_<device>" off the CPU: the stem of this run's
// precision-record and JUnit files, so a cpu and a gpu run of one executable
// at one np never overwrite each other's.
std::string run_stem(const std::string& exe, const c10::Device& dev) {
  std::string stem = exe + "_np" + std::to_string(world_size());
  if (!dev.is_cpu()) stem += "_" + c10::DeviceTypeName(dev.type(), /*lower_case=*/true);
  // Entries that rerun a suite under a forced CPU algorithm keep files apart.
  const char* algo = std::getenv("FSDP_MPI_ALGO");
  if (algo != nullptr && *algo != '\0') stem += std::string("_") + algo;
  return stem;
}

// Rank 0: chooses and truncates $FSDP_REPORT_DIR/<run_stem>.jsonl. Leaves
// g_report_path empty when the variable is unset or the file cannot be written.
void open_precision_report(const std::string& exe, const c10::Device& dev) {
  const char* dir = std::getenv("FSDP_REPORT_DIR");
  if (dir == nullptr || *dir == '\0' || rank() != 0) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string path = std::string(dir) + "/" + run_stem(exe, dev) + ".jsonl";
  std::ofstream out(path, std::ios::trunc);
  if (!out) {
    std::cerr << "[spmd] cannot write precision records to " << path
              << " (FSDP_REPORT_DIR); not recording" << std::endl;
    return;
  }
  g_report_path = path;
  // The run this process belongs to: precision_report_reset (a CTest fixture
  // every entry requires) clears the directory and writes a fresh id; the
  // report renders only records carrying the current one. No file: records
  // get no run id, and the report rejects them as not from a fresh run.
  std::ifstream run(std::string(dir) + "/run-id");
  std::getline(run, g_report_run);
  if (g_report_run.empty()) {
    std::cerr << "[spmd] no run id in " << dir << "/run-id (written by the CTest fixture "
              << "precision_report_reset); fsdp-precision-report will reject these records"
              << std::endl;
  }
}

// Appends one JSON line to this run's record file (rank 0).
void append_record(nlohmann::json j) {
  j["executable"] = g_executable;
  j["np"] = world_size();
  j["device"] = device().str();
  j["run"] = g_report_run;
  std::ofstream out(g_report_path, std::ios::app);
  out << j.dump(-1, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace)
      << '\n';
  if (!out) std::cerr << "[spmd] failed to append a record to " << g_report_path << std::endl;
}

bool note_applies(const std::string& note_id, const std::string& case_id) {
  return case_id == note_id ||
         (case_id.size() > note_id.size() && case_id.compare(0, note_id.size(), note_id) == 0 &&
          case_id[note_id.size()] == ' ');
}

}  // namespace

fsdp::Runtime& runtime() { return *g_runtime; }
int rank() { return g_runtime->world_rank(); }
int world_size() { return g_runtime->world_size(); }
std::string current_case() { return current_name(); }

boost::unit_test::precondition skip_unless(std::function<bool()> holds, std::string reason) {
  return boost::unit_test::precondition(
      [holds = std::move(holds), reason = std::move(reason)](boost::unit_test::test_unit_id id) {
        boost::test_tools::assertion_result result(holds());
        if (!result) {
          result.message() << reason;
          if (rank() == 0) {
            const auto& unit = boost::unit_test::framework::get(id, boost::unit_test::TUT_ANY);
            std::cout << "SKIPPED " << unit.p_name.get() << ": " << reason << std::endl;
            // The report shows a skipped plan case as "not run" with this reason.
            if (!g_report_path.empty()) {
              nlohmann::json j;
              j["kind"] = "skipped";
              j["test_case"] = unit.p_name.get();
              j["note"] = reason;
              append_record(std::move(j));
            }
          }
        }
        return result;
      });
}

boost::unit_test::precondition needs_world_size(int n, const std::string& reason) {
  return skip_unless([n] { return world_size() == n; },
                     "needs " + std::to_string(n) + (n == 1 ? " rank: " : " ranks: ") + reason);
}

boost::unit_test::precondition needs_world_size_at_least(int n, const std::string& reason) {
  return skip_unless([n] { return world_size() >= n; },
                     "needs at least " + std::to_string(n) + " ranks: " + reason);
}

boost::unit_test::precondition needs_even_world_size(const std::string& reason) {
  return skip_unless([] { return world_size() % 2 == 0; }, "needs an even world size: " + reason);
}

boost::unit_test::precondition needs_device(c10::DeviceType type, const std::string& reason) {
  return skip_unless([type] { return device().type() == type; },
                     "needs " + c10::DeviceTypeName(type, /*lower_case=*/true) +
                         " tensors: " + reason);
}

void add_case_note(const std::string& case_id, const std::string& note) {
  for (const auto& [id, text] : g_case_notes) {
    if (id == case_id && text == note) return;
  }
  g_case_notes.emplace_back(case_id, note);
}

void record_precision(const PrecisionRecord& r) {
  if (g_report_path.empty() || rank() != 0) return;
  std::string note = r.note;
  for (const auto& [id, text] : g_case_notes) {
    if (note_applies(id, r.case_id) && note.find(text) == std::string::npos) {
      note += (note.empty() ? "" : "; ") + text;
    }
  }
  std::string test_case;
  try {
    test_case = current_name();
  } catch (...) {
    // recorded outside a test case
  }
  nlohmann::json j;
  j["case_id"] = r.case_id;
  j["metric"] = r.metric;
  j["kind"] = r.kind;
  j["tolerance"] = r.tolerance;
  // JSON has no NaN/inf: those are written as strings ("nan", "inf").
  if (std::isfinite(r.observed)) {
    j["observed"] = r.observed;
  } else {
    j["observed"] = std::isnan(r.observed) ? "nan" : (r.observed > 0 ? "inf" : "-inf");
  }
  j["pass"] = r.pass;
  j["configuration"] = r.configuration;
  j["note"] = note;
  j["test_case"] = test_case;
  append_record(std::move(j));
}

c10::Device device() { return g_runtime->device(); }

}  // namespace spmd

int main(int argc, char** argv) {
  // Single-threaded LibTorch per rank unless told otherwise: test ranks share cores.
  fsdp::RuntimeOptions options;
  if (std::getenv("FSDP_NUM_THREADS") == nullptr) options.num_threads = 1;
  // The entry's device is the Runtime's: a cpu entry on a GPU node binds no
  // GPU (and is not refused for ranks sharing one), a gpu entry binds
  // cuda:<local rank % visible devices> or fails at start-up saying why.
  if (const char* dev = std::getenv("FSDP_TEST_DEVICE"); dev != nullptr && *dev != '\0') {
    const std::string d(dev);
    if (d == "cpu") {
      options.device = c10::kCPU;
    } else if (d == "cuda") {
      options.device = c10::kCUDA;
    } else {
      std::cerr << "[spmd] FSDP_TEST_DEVICE='" << d << "': accepted: cpu, cuda" << std::endl;
      return 2;
    }
  }
  try {
    spmd::g_runtime = std::make_unique<fsdp::Runtime>(&argc, &argv, options);
  } catch (const std::exception& e) {
    // Every rank reaches the same verdict (a GPU entry on a machine without
    // one, two ranks on one GPU): a message and a failed run, not an abort.
    std::cerr << "[spmd] cannot start the Runtime: " << e.what() << std::endl;
    return 2;
  }
  MPI_Comm_dup(MPI_COMM_WORLD, &spmd::g_harness_comm);
  // The gpu entries compare CUDA runs with CPU references at the plan's fp32
  // tolerances (1e-5): TF32 (10-bit mantissa) in cuBLAS matmuls or cuDNN
  // convolutions (on by default for cuDNN) would miss them by design.
  if (spmd::device().is_cuda()) {
    at::globalContext().setAllowTF32CuBLAS(false);
    at::globalContext().setAllowTF32CuDNN(false);
    if (spmd::rank() == 0) {
      std::cout << "[spmd] CUDA: TF32 off for matmuls (cuBLAS) and convolutions (cuDNN)"
                << std::endl;
    }
  }
  spmd::g_watchdog = std::make_unique<spmd::Watchdog>();

  const std::string exe = spmd::basename_of(argv[0]);
  spmd::g_suite_name = exe;
  spmd::g_executable = exe;
  spmd::open_precision_report(exe, spmd::device());
  std::vector<std::string> args(argv, argv + argc);
  if (spmd::rank() == 0) {
    const char* junit_dir = std::getenv("FSDP_JUNIT_DIR");
    std::string logger = "--logger=HRF,test_suite,stdout";
    if (junit_dir != nullptr && *junit_dir != '\0') {
      logger += ":JUNIT,warning," + std::string(junit_dir) + "/" +
                spmd::run_stem(exe, spmd::device()) + ".xml";
    }
    args.push_back(logger);
    args.push_back("--color_output=no");
  } else {
    args.push_back("--report_level=no");
  }
  std::vector<char*> cargs;
  for (auto& a : args) cargs.push_back(a.data());
  const int rc = utf::unit_test_main(&spmd::init_suite, static_cast<int>(cargs.size()), cargs.data());

  spmd::g_watchdog.reset();
  MPI_Comm_free(&spmd::g_harness_comm);
  spmd::g_runtime.reset();
  return rc;
}
