#include "harness.h"

#include <torch/version.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <stdexcept>

namespace fsdp_bench {
namespace {

constexpr int64_t kKi = 1024;

const std::vector<std::pair<char, int64_t>>& size_suffixes() {
  static const std::vector<std::pair<char, int64_t>> suffixes{
      {'T', kKi * kKi * kKi * kKi}, {'G', kKi * kKi * kKi}, {'M', kKi * kKi}, {'K', kKi}};
  return suffixes;
}

double median(std::vector<double> v) {
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid), v.end());
  if (v.size() % 2 == 1) return v[mid];
  const double upper = v[mid];
  return (*std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid)) + upper) / 2;
}

std::string cell_text(const Cell& cell, int precision) {
  if (const auto* i = std::get_if<int64_t>(&cell)) return std::to_string(*i);
  if (const auto* d = std::get_if<double>(&cell)) return fmt::format("{:.{}f}", *d, precision);
  return std::get<std::string>(cell);
}

nlohmann::json cell_json(const Cell& cell) {
  return std::visit([](const auto& v) { return nlohmann::json(v); }, cell);
}

}  // namespace

int64_t parse_size(const std::string& text) {
  const auto bad = [&text](const std::string& why) {
    return std::invalid_argument("size '" + text + "' " + why +
                                 "; accepted: bytes with an optional K, M, G or T suffix "
                                 "(binary multiples), e.g. 4096, 1K, 256M");
  };
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  if (digits == 0) throw bad("does not start with a number");
  if (digits > 18) throw bad("is too large");
  const int64_t number = std::stoll(text.substr(0, digits));

  std::string suffix = text.substr(digits);
  std::transform(suffix.begin(), suffix.end(), suffix.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  int64_t multiple = 1;
  if (!suffix.empty()) {
    const auto it = std::find_if(size_suffixes().begin(), size_suffixes().end(),
                                 [&](const auto& s) { return s.first == suffix[0]; });
    if (it != size_suffixes().end()) {
      multiple = it->second;
      suffix.erase(0, 1);
    }
  }
  if (suffix == "IB" && multiple > 1) suffix = "B";
  if (!suffix.empty() && suffix != "B") throw bad("has an unknown unit");
  if (number > std::numeric_limits<int64_t>::max() / multiple) throw bad("is too large");
  return number * multiple;
}

std::string format_size(int64_t bytes) {
  for (const auto& [letter, multiple] : size_suffixes()) {
    if (bytes > 0 && bytes % multiple == 0) return fmt::format("{}{}", bytes / multiple, letter);
  }
  return std::to_string(bytes);
}

CLI::Validator size_argument() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        try {
          value = std::to_string(parse_size(value));
          return {};
        } catch (const std::invalid_argument& e) {
          return e.what();
        }
      },
      "SIZE");
}

std::vector<Stats> time_interleaved(MPI_Comm comm,
                                    const std::vector<std::function<void()>>& variants,
                                    const TimingOptions& timing) {
  using Clock = std::chrono::steady_clock;
  const size_t n = variants.size();
  const auto iters = static_cast<size_t>(timing.iters);
  std::vector<double> us(n * iters);  // [variant][iteration]
  for (int round = 0; round < timing.warmup + timing.iters; ++round) {
    for (size_t k = 0; k < n; ++k) {
      // Odd rounds run the variants in reverse, so no variant always goes
      // first after the previous round (caches, a just-woken peer).
      const size_t v = round % 2 == 0 ? k : n - 1 - k;
      // Every rank enters the call together, so the time is the call's own
      // and not a wait for a late peer.
      MPI_Barrier(comm);
      const auto start = Clock::now();
      variants[v]();
      const auto stop = Clock::now();
      if (round >= timing.warmup) {
        us[v * iters + static_cast<size_t>(round - timing.warmup)] =
            std::chrono::duration<double, std::micro>(stop - start).count();
      }
    }
  }
  // One reduction after the loop rather than one per call keeps extra
  // traffic out of the timed region.
  MPI_Allreduce(MPI_IN_PLACE, us.data(), static_cast<int>(us.size()), MPI_DOUBLE, MPI_MAX, comm);

  std::vector<Stats> stats(n);
  for (size_t v = 0; v < n; ++v) {
    const auto first = us.begin() + static_cast<std::ptrdiff_t>(v * iters);
    stats[v] = summarize(std::vector<double>(first, first + static_cast<std::ptrdiff_t>(iters)));
  }
  return stats;
}

Stats summarize(const std::vector<double>& us) {
  if (us.empty()) throw std::invalid_argument("summarize: no samples");
  Stats s;
  s.median_us = median(us);
  s.min_us = *std::min_element(us.begin(), us.end());
  s.max_us = *std::max_element(us.begin(), us.end());
  return s;
}

std::vector<int64_t> max_over_ranks(MPI_Comm comm, std::vector<int64_t> values) {
  MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_INT64_T,
                MPI_MAX, comm);
  return values;
}

std::vector<double> max_over_ranks(MPI_Comm comm, std::vector<double> values) {
  MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_DOUBLE, MPI_MAX,
                comm);
  return values;
}

std::vector<double> sum_over_ranks(MPI_Comm comm, std::vector<double> values) {
  MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_DOUBLE, MPI_SUM,
                comm);
  return values;
}

Report::Report(std::string benchmark, std::vector<Column> columns, std::string json_path,
               bool active)
    : benchmark_(std::move(benchmark)),
      columns_(std::move(columns)),
      json_path_(std::move(json_path)),
      active_(active) {
  doc_ = {{"benchmark", benchmark_},
          {"meta", nlohmann::json::object()},
          {"columns", nlohmann::json::array()},
          {"rows", nlohmann::json::array()},
          {"summary", nlohmann::json::object()}};
  for (const Column& c : columns_) {
    doc_["columns"].push_back({{"key", c.key}, {"title", c.title}, {"unit", c.unit}});
  }
}

void Report::meta(const std::string& key, nlohmann::json value, const std::string& line) {
  doc_["meta"][key] = std::move(value);
  if (!line.empty()) note(line);
}

void Report::note(const std::string& line) {
  if (table()) std::cout << "# " << line << '\n' << std::flush;
}

void Report::summary(const std::string& key, nlohmann::json value, const std::string& line) {
  doc_["summary"][key] = std::move(value);
  if (!line.empty()) note(line);
}

void Report::print_headings() {
  // Three heading lines, all starting with '#' so that plotting tools
  // (gnuplot, awk) read only the rows, as with nccl-tests.
  std::string groups = "#";
  std::string titles = "#";
  std::string units = "#";
  for (size_t i = 0; i < columns_.size();) {
    const Column& c = columns_[i];
    if (c.width == 0) {
      ++i;
      continue;
    }
    size_t span = 0;
    size_t j = i;
    for (; j < columns_.size() && columns_[j].group == c.group; ++j) {
      if (columns_[j].width > 0) span += static_cast<size_t>(columns_[j].width) + 1;
    }
    groups += fmt::format(" {:^{}}", c.group, span - 1);
    for (size_t k = i; k < j; ++k) {
      if (columns_[k].width == 0) continue;
      titles += fmt::format(" {:>{}}", columns_[k].title, columns_[k].width);
      units += fmt::format(" {:>{}}", columns_[k].unit, columns_[k].width);
    }
    i = j;
  }
  groups.erase(groups.find_last_not_of(' ') + 1);
  std::cout << groups << '\n' << titles << '\n' << units << '\n';
  headings_printed_ = true;
}

void Report::row(const std::vector<Cell>& cells) {
  if (cells.size() != columns_.size()) {
    throw std::logic_error(fmt::format("Report::row: {} cells for {} columns", cells.size(),
                                       columns_.size()));
  }
  nlohmann::json obj = nlohmann::json::object();
  std::string line = " ";
  for (size_t i = 0; i < cells.size(); ++i) {
    obj[columns_[i].key] = cell_json(cells[i]);
    if (columns_[i].width > 0) {
      line += fmt::format(" {:>{}}", cell_text(cells[i], columns_[i].precision), columns_[i].width);
    }
  }
  doc_["rows"].push_back(std::move(obj));
  if (!table()) return;
  if (!headings_printed_) print_headings();
  std::cout << line << '\n' << std::flush;
}

void add_json_option(CLI::App* sub, std::string& path) {
  sub->add_option("--json", path,
                  "Write JSON: '--json' alone prints it to stdout instead of the table; "
                  "'--json FILE' keeps the table and writes FILE")
      ->expected(0, 1)
      ->default_str("-");
}

std::string json_path_problem(const std::string& path, MPI_Comm comm) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  std::string problem;
  if (rank == 0 && !path.empty() && path != "-") {
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path file(path);
    const fs::path dir = file.has_parent_path() ? file.parent_path() : fs::path(".");
    if (fs::is_directory(file, ec)) {
      problem = "it is a directory";
    } else if (!fs::is_directory(dir, ec)) {
      problem = "the directory " + dir.string() + " does not exist";
    } else if (::access(dir.c_str(), W_OK) != 0) {
      problem = "the directory " + dir.string() + " is not writable (" + std::strerror(errno) + ")";
    }
    if (!problem.empty()) problem = fmt::format("--json {}: {}", path, problem);
  }
  int size = static_cast<int>(problem.size());
  MPI_Bcast(&size, 1, MPI_INT, 0, comm);
  problem.resize(static_cast<size_t>(size));
  MPI_Bcast(problem.data(), size, MPI_CHAR, 0, comm);
  return problem;
}

void Report::finish() {
  if (!active_ || json_path_.empty()) return;
  if (json_path_ == "-") {
    std::cout << doc_.dump(2) << '\n' << std::flush;
    return;
  }
  std::ofstream out(json_path_);
  out << doc_.dump(2) << '\n';
  if (!out) throw std::runtime_error("cannot write the JSON report to '" + json_path_ + "'");
  std::cout << "# JSON written to " << json_path_ << '\n';
}

void add_runtime_meta(Report& report, const fsdp::Runtime& rt) {
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(version, &length);
  std::string mpi(version, static_cast<size_t>(length));
  // Open MPI appends package, ident and build date after the first comma.
  mpi = mpi.substr(0, mpi.find_first_of(",\n"));

  // Fixed-size records so one MPI_Gather collects every rank's host and pid.
  struct Where {
    char host[MPI_MAX_PROCESSOR_NAME];
    long pid;
  };
  Where mine{};
  int host_length = 0;
  MPI_Get_processor_name(mine.host, &host_length);
  mine.pid = static_cast<long>(getpid());
  std::vector<Where> all(static_cast<size_t>(rt.world_rank() == 0 ? rt.world_size() : 0));
  MPI_Gather(&mine, sizeof(Where), MPI_BYTE, all.data(), sizeof(Where), MPI_BYTE, 0,
             MPI_COMM_WORLD);

  report.meta("world_size", rt.world_size(),
              fmt::format("world size {}, {} rank(s) per node, 1 caller thread and {} "
                          "intra-op/BLAS thread(s) per rank, device {}",
                          rt.world_size(), rt.local_size(), rt.num_threads(), rt.device().str()));
  report.meta("ranks_per_node", rt.local_size());
  report.meta("threads_per_rank", rt.num_threads());
  report.meta("device", rt.device().str());
  report.meta("libtorch", TORCH_VERSION,
              fmt::format("LibTorch {}, BLAS {}", TORCH_VERSION, rt.blas_library()));
  report.meta("blas", rt.blas_library());
  report.meta("mpi_library", mpi, mpi);
  // Settings that change how the run behaves without showing in argv (not
  // the launcher's own bookkeeping, which mpiexec sets on every run).
  const auto shown = [](const std::string& entry) {
    static const char* const skipped[] = {"OMPI_MCA_orte_", "OMPI_MCA_ess", "OMPI_MCA_pmix",
                                          "OMPI_MCA_shmem_RUNTIME", "OMPI_MCA_initial_wdir"};
    if (entry.rfind("FSDP_", 0) == 0) return true;
    if (entry.rfind("OMPI_MCA_", 0) != 0) return false;
    return std::none_of(std::begin(skipped), std::end(skipped),
                        [&](const char* p) { return entry.rfind(p, 0) == 0; });
  };
  nlohmann::json env = nlohmann::json::object();
  std::string env_text;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string entry(*e);
    if (!shown(entry)) continue;
    const size_t eq = entry.find('=');
    if (eq == std::string::npos) continue;
    env[entry.substr(0, eq)] = entry.substr(eq + 1);
    env_text += " " + entry;
  }
  report.meta("environment", env,
              "environment (OMPI_MCA_*, FSDP_*):" + (env_text.empty() ? " none" : env_text));
  nlohmann::json ranks = nlohmann::json::array();
  for (size_t r = 0; r < all.size(); ++r) {
    ranks.push_back({{"rank", r}, {"host", all[r].host}, {"pid", all[r].pid}});
  }
  report.meta("ranks", ranks);
  for (size_t r = 0; r < all.size(); ++r) {
    report.note(fmt::format(" Rank {:3} Pid {:7} on {}", r, all[r].pid, all[r].host));
  }
}

}  // namespace fsdp_bench
