// fsdp-bench collectives: bandwidth of libfsdp's ProcessGroup collectives
// against the raw MPI calls they wrap, nccl-tests style.
//
// Both sides run on the same buffers in the same process, interleaved call by
// call, so the ratio measures only what the library adds on top of MPI
// (validation, counters, the Work handle, the comm-thread check).
#include "harness.h"

#include "fsdp/comm.h"
#include "fsdp/mesh.h"

#include <ATen/ops/zeros.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <stdexcept>

namespace fsdp_bench {
namespace {

constexpr int64_t kMiB = 1024 * 1024;
// The MPI backend takes int element counts; 2 GiB keeps every dtype below
// that per call.
constexpr int64_t kMaxBytes = 2048 * kMiB;
// The project's goal for the wrapper: at least this share of raw MPI's bus
// bandwidth from 1 MiB up, where per-call overhead should be negligible.
constexpr double kTargetRatio = 0.95;

struct Options {
  int64_t min_bytes = 1024;
  int64_t max_bytes = 256 * kMiB;
  int step_factor = 2;
  TimingOptions timing;
  std::vector<std::string> ops{"all_gather", "reduce_scatter", "all_reduce"};
  std::string dtype = "float32";
  std::string json_path;
};

struct Collective {
  const char* mpi_call;
  const char* library_call;
  bool reduces;
  // nccl-tests: busbw = algbw * factor(n) is the per-link traffic of an
  // optimal ring, comparable across collectives and world sizes.
  double (*bus_factor)(int n);
};

const std::map<std::string, Collective>& collectives() {
  static const std::map<std::string, Collective> table{
      {"all_gather", {"MPI_Allgather", "all_gather_into_tensor", false,
                      [](int n) { return static_cast<double>(n - 1) / n; }}},
      {"reduce_scatter", {"MPI_Reduce_scatter_block", "reduce_scatter_tensor", true,
                          [](int n) { return static_cast<double>(n - 1) / n; }}},
      {"all_reduce", {"MPI_Allreduce", "all_reduce", true,
                      [](int n) { return 2.0 * (n - 1) / n; }}},
  };
  return table;
}

const std::map<std::string, c10::ScalarType>& dtypes() {
  static const std::map<std::string, c10::ScalarType> table{
      {"float32", c10::kFloat}, {"float64", c10::kDouble}, {"bfloat16", c10::kBFloat16},
      {"float16", c10::kHalf},  {"int32", c10::kInt},      {"int64", c10::kLong},
  };
  return table;
}

void check_mpi(int rc, const char* call) {
  if (rc != MPI_SUCCESS) throw std::runtime_error(fmt::format("{} returned {}", call, rc));
}

// Widen to float32 and round once, as the library's 16-bit sum does, so
// both sides do the same arithmetic.
template <typename T>
void sum16(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = T(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

// The MPI datatype and sum op for the raw calls. MPI has no 16-bit floats,
// and the library keeps its own 16-bit op private, so the raw side brings
// its own.
class RawTypes {
 public:
  explicit RawTypes(c10::ScalarType t) {
    switch (t) {
      case c10::kFloat: datatype_ = MPI_FLOAT; break;
      case c10::kDouble: datatype_ = MPI_DOUBLE; break;
      case c10::kInt: datatype_ = MPI_INT32_T; break;
      case c10::kLong: datatype_ = MPI_INT64_T; break;
      case c10::kBFloat16:
      case c10::kHalf:
        datatype_ = MPI_UINT16_T;
        check_mpi(MPI_Op_create(t == c10::kBFloat16 ? sum16<c10::BFloat16> : sum16<c10::Half>, 1,
                                &own_op_),
                  "MPI_Op_create");
        sum_ = own_op_;
        break;
      default: throw std::logic_error("RawTypes: dtype outside dtypes()");
    }
  }
  ~RawTypes() {
    if (own_op_ != MPI_OP_NULL) MPI_Op_free(&own_op_);
  }
  RawTypes(const RawTypes&) = delete;
  RawTypes& operator=(const RawTypes&) = delete;

  MPI_Datatype datatype() const { return datatype_; }
  MPI_Op sum() const { return sum_; }

 private:
  MPI_Datatype datatype_ = MPI_DATATYPE_NULL;
  MPI_Op sum_ = MPI_SUM;
  MPI_Op own_op_ = MPI_OP_NULL;
};

// One collective at one size: its buffers, held by both closures, and the
// two ways to run it.
struct Case {
  int64_t bytes = 0;
  int64_t count = 0;
  std::function<void()> ours, raw;
};

// `requested` bytes rounded down so that every rank gets whole elements;
// count 0 means the size is too small for this world.
Case make_case(const std::string& op, int64_t requested, c10::ScalarType dtype,
               const RawTypes& raw, MPI_Comm comm) {
  const fsdp::ProcessGroupPtr pg = fsdp::world_group();
  const int n = pg->size();
  const auto elem = static_cast<int64_t>(c10::elementSize(dtype));
  const auto opts = c10::TensorOptions().dtype(dtype);
  Case c;
  c.count = requested / elem;
  // Zeros: sums of zeros stay zero, so repeated in-place reductions never
  // reach inf or denormals, whose arithmetic would time differently.
  if (op == "all_reduce") {
    at::Tensor t = at::zeros({c.count}, opts);
    const int count = static_cast<int>(c.count);
    c.ours = [pg, t] { pg->all_reduce(t, fsdp::ReduceOp::SUM); };
    c.raw = [t, count, &raw, comm] {
      check_mpi(MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), count, raw.datatype(), raw.sum(), comm),
                "MPI_Allreduce");
    };
  } else {
    c.count -= c.count % n;
    const int64_t block = c.count / n;
    const bool gather = op == "all_gather";
    at::Tensor whole = at::zeros({c.count}, opts);
    at::Tensor part = at::zeros({block}, opts);
    const int count = static_cast<int>(block);
    if (gather) {
      c.ours = [pg, whole, part] { pg->all_gather_into_tensor(whole, part); };
      c.raw = [whole, part, count, &raw, comm] {
        check_mpi(MPI_Allgather(part.data_ptr(), count, raw.datatype(), whole.data_ptr(), count,
                                raw.datatype(), comm),
                  "MPI_Allgather");
      };
    } else {
      c.ours = [pg, whole, part] { pg->reduce_scatter_tensor(part, whole, fsdp::ReduceOp::SUM); };
      c.raw = [whole, part, count, &raw, comm] {
        check_mpi(MPI_Reduce_scatter_block(whole.data_ptr(), part.data_ptr(), count,
                                           raw.datatype(), raw.sum(), comm),
                  "MPI_Reduce_scatter_block");
      };
    }
  }
  c.bytes = c.count * elem;
  return c;
}

std::vector<Column> columns() {
  const std::string ours = "libfsdp ProcessGroup";
  const std::string raw = "raw MPI";
  return {
      {"size_bytes", "size", "(B)", 12, -1, ""},
      {"count", "count", "(elements)", 12, -1, ""},
      {"dtype", "type", "", 8, -1, ""},
      {"collective", "collective", "", 14, -1, ""},
      {"redop", "redop", "", 5, -1, ""},
      {"ours_algorithm", "algorithm", "", 9, -1, ours},
      {"ours_time_us", "time", "(us)", 10, 1, ours},
      {"ours_algbw_gbps", "algbw", "(GB/s)", 7, 2, ours},
      {"ours_busbw_gbps", "busbw", "(GB/s)", 7, 2, ours},
      {"ours_min_us", "min", "(us)", 0, 1, ours},
      {"ours_max_us", "max", "(us)", 0, 1, ours},
      {"raw_algorithm", "algorithm", "", 24, -1, raw},
      {"raw_time_us", "time", "(us)", 10, 1, raw},
      {"raw_algbw_gbps", "algbw", "(GB/s)", 7, 2, raw},
      {"raw_busbw_gbps", "busbw", "(GB/s)", 7, 2, raw},
      {"raw_min_us", "min", "(us)", 0, 1, raw},
      {"raw_max_us", "max", "(us)", 0, 1, raw},
      {"ratio", "ratio", "ours/raw", 8, 3, ""},
  };
}

std::vector<int64_t> sizes(const Options& o) {
  std::vector<int64_t> out;
  for (int64_t s = o.min_bytes; s <= o.max_bytes; s *= o.step_factor) {
    out.push_back(s);
    if (s > o.max_bytes / o.step_factor) break;
  }
  return out;
}

double mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return sum / static_cast<double>(v.size());
}

int run(const Options& o, const fsdp::Runtime& rt) {
  const std::string problem = json_path_problem(o.json_path, MPI_COMM_WORLD);
  if (!problem.empty()) {
    if (rt.world_rank() == 0) std::cerr << "fsdp-bench collectives: " << problem << '\n';
    return 1;
  }
  const c10::ScalarType dtype = dtypes().at(o.dtype);
  const int n = rt.world_size();
  // A communicator of our own, so the raw calls and the harness's barriers
  // share nothing with the library's communicators but the ranks.
  MPI_Comm comm = MPI_COMM_NULL;
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
  const RawTypes raw(dtype);

  Report report("collectives", columns(), o.json_path, rt.world_rank() == 0);
  report.note(fmt::format("fsdp-bench collectives: sizes {}..{} x{}, {} iterations after {} "
                          "warm-up, dtype {}, reduce op sum",
                          format_size(o.min_bytes), format_size(o.max_bytes), o.step_factor,
                          o.timing.iters, o.timing.warmup, o.dtype));
  report.meta("min_bytes", o.min_bytes);
  report.meta("max_bytes", o.max_bytes);
  report.meta("step_factor", o.step_factor);
  report.meta("iters", o.timing.iters);
  report.meta("warmup", o.timing.warmup);
  report.meta("dtype", o.dtype);
  add_runtime_meta(report, rt);
  report.note("time: median over iterations of the slowest rank's time, each call after a "
              "barrier; ours and raw alternate on the same buffers");
  report.note("algbw = size / time; busbw = algbw * (n-1)/n (all_gather, reduce_scatter) or "
              "2(n-1)/n (all_reduce); ratio = ours busbw / raw busbw");
  for (const std::string& op : o.ops) {
    const Collective& c = collectives().at(op);
    report.note(fmt::format("{:>14}: ours = {} via libfsdp ProcessGroup::{} on world_group() "
                            "(sync, inline on the caller's thread: 'pg-inline'); raw = {} on "
                            "MPI_Comm_dup(MPI_COMM_WORLD)",
                            op, c.mpi_call, c.library_call, c.mpi_call));
  }

  std::map<std::string, std::vector<double>> large;  // op -> ratios from 1 MiB up
  for (const std::string& op : o.ops) {
    const Collective& c = collectives().at(op);
    for (const int64_t requested : sizes(o)) {
      const Case k = make_case(op, requested, dtype, raw, comm);
      if (k.count == 0) continue;
      const std::vector<Stats> s = time_interleaved(comm, {k.ours, k.raw}, o.timing);
      const double gb = static_cast<double>(k.bytes) / 1e9;
      const double ours_algbw = gb / (s[0].median_us * 1e-6);
      const double raw_algbw = gb / (s[1].median_us * 1e-6);
      // Equal to the busbw ratio, and defined when n = 1 makes busbw 0.
      const double ratio = s[1].median_us / s[0].median_us;
      if (k.bytes >= kMiB) large[op].push_back(ratio);
      report.row({k.bytes, k.count, o.dtype, op, std::string(c.reduces ? "sum" : "none"),
                  std::string("pg-inline"), s[0].median_us, ours_algbw,
                  ours_algbw * c.bus_factor(n), s[0].min_us, s[0].max_us,
                  std::string(c.mpi_call), s[1].median_us, raw_algbw, raw_algbw * c.bus_factor(n),
                  s[1].min_us, s[1].max_us, ratio});
    }
  }

  std::vector<double> all;
  nlohmann::json per_op = nlohmann::json::object();
  std::string per_op_text;
  for (const auto& [op, ratios] : large) {
    all.insert(all.end(), ratios.begin(), ratios.end());
    per_op[op] = mean(ratios);
    per_op_text += fmt::format("{}{} {:.3f}", per_op_text.empty() ? "" : ", ", op, mean(ratios));
  }
  if (all.empty()) {
    report.summary("mean_ratio_from_1MiB", nullptr,
                   "no size >= 1 MiB measured: no verdict on the target");
  } else {
    const double m = mean(all);
    const auto below =
        std::count_if(all.begin(), all.end(), [](double r) { return r < kTargetRatio; });
    report.summary("mean_ratio_from_1MiB", m,
                   fmt::format("mean busbw ratio ours/raw for sizes >= 1 MiB: {:.3f} ({})", m,
                               per_op_text));
    report.summary("mean_ratio_from_1MiB_per_op", per_op);
    report.summary("rows_below_target", below);
    report.summary("target_met", m >= kTargetRatio,
                   fmt::format("target >= {:.2f}x raw MPI busbw from 1 MiB up: {} ({} of {} "
                               "rows below)",
                               kTargetRatio, m >= kTargetRatio ? "MET" : "NOT MET", below,
                               all.size()));
  }
  report.finish();
  MPI_Comm_free(&comm);
  return 0;
}

}  // namespace

void add_collectives_command(CLI::App& app, Command& chosen) {
  auto o = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand(
      "collectives",
      "Bus bandwidth of libfsdp's collectives against the raw MPI calls, nccl-tests style. "
      "Run under mpiexec; rank 0 prints.");
  sub->add_option("-b,--min-bytes", o->min_bytes, "Smallest size (bytes; K, M, G suffixes)")
      ->transform(size_argument())
      ->check(CLI::Range(int64_t{1}, kMaxBytes))
      ->default_str("1K");
  sub->add_option("-e,--max-bytes", o->max_bytes, "Largest size (bytes; K, M, G suffixes)")
      ->transform(size_argument())
      ->check(CLI::Range(int64_t{1}, kMaxBytes))
      ->default_str("256M");
  sub->add_option("-f,--step-factor", o->step_factor, "Multiply the size by this each step")
      ->check(CLI::Range(2, 1024))
      ->capture_default_str();
  sub->add_option("-n,--iters", o->timing.iters, "Timed iterations per size and side")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  sub->add_option("-w,--warmup", o->timing.warmup, "Untimed iterations first")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  std::vector<std::string> op_names;
  for (const auto& entry : collectives()) op_names.push_back(entry.first);
  sub->add_option("--ops", o->ops, "Collectives to run, comma-separated")
      ->delimiter(',')
      ->check(CLI::IsMember(op_names))
      ->default_str("all_gather,reduce_scatter,all_reduce");
  std::vector<std::string> dtype_names;
  for (const auto& entry : dtypes()) dtype_names.push_back(entry.first);
  sub->add_option("-d,--dtype", o->dtype, "Element type")
      ->check(CLI::IsMember(dtype_names))
      ->capture_default_str();
  sub->add_option("--json", o->json_path,
                  "Write JSON: '--json' alone prints it to stdout instead of the table; "
                  "'--json FILE' keeps the table and writes FILE")
      ->expected(0, 1)
      ->default_str("-");
  sub->callback([o, &chosen] {
    if (o->min_bytes > o->max_bytes) {
      throw CLI::ValidationError(
          "--min-bytes", fmt::format("{} is larger than --max-bytes {}", format_size(o->min_bytes),
                                     format_size(o->max_bytes)));
    }
    chosen = [o](const fsdp::Runtime& rt) { return run(*o, rt); };
  });
}

}  // namespace fsdp_bench
