// The harness every fsdp-bench subcommand shares: size arguments, the timing
// loop, and rank-0 output as an nccl-tests-style table or as JSON.
//
// A subcommand lives in its own file and provides one add_<name>_command();
// main.cpp registers them all, creates the fsdp::Runtime and runs the one the
// user chose.
#pragma once

#include "fsdp/runtime.h"

#include <CLI/CLI.hpp>
#include <mpi.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <variant>
#include <vector>

namespace fsdp_bench {

// ---- subcommands ----------------------------------------------------------
// Runs the parsed subcommand on every rank; returns the process exit code.
using Command = std::function<int(const fsdp::Runtime&)>;

// Registers `collectives` on `app`; sets `chosen` when the user picks it.
void add_collectives_command(CLI::App& app, Command& chosen);
// Registers `train` (fsdp-bench/train_step.cpp) likewise.
void add_train_command(CLI::App& app, Command& chosen);
// Registers `checkpoint` (fsdp-bench/checkpoint.cpp) likewise.
void add_checkpoint_command(CLI::App& app, Command& chosen);
// Registers `memory` (fsdp-bench/memory.cpp) likewise.
void add_memory_command(CLI::App& app, Command& chosen);

// ---- sizes ----------------------------------------------------------------
// "4096", "1K", "256M", "2G" (binary multiples, case-insensitive, optional
// trailing "B" or "iB") -> bytes. Throws std::invalid_argument naming `text`.
int64_t parse_size(const std::string& text);
// Bytes as the shortest exact binary multiple: 1048576 -> "1M", 1536 -> "1536".
std::string format_size(int64_t bytes);
// CLI11 transform that accepts parse_size's syntax and hands the option its
// byte count, so a bad size is reported by CLI11 like any other bad value.
CLI::Validator size_argument();

// ---- output ---------------------------------------------------------------
// Why `--json PATH` could not be written ("" when it can, or when PATH is
// empty or "-"), decided on rank 0 of `comm` -- the rank that writes it --
// and the same on every rank, so a subcommand can refuse it before it runs.
// Collective over `comm`.
std::string json_path_problem(const std::string& path, MPI_Comm comm);

// `--json [FILE]` on a subcommand, the same for every benchmark: alone, JSON on
// stdout instead of the table ("-"); with FILE, the table and FILE.
void add_json_option(CLI::App* sub, std::string& path);

// ---- timing ---------------------------------------------------------------
struct TimingOptions {
  int warmup = 5;
  int iters = 20;
};

// Summary of one variant's per-iteration times, each of which is already the
// maximum over ranks (a collective is as slow as its slowest rank).
struct Stats {
  double median_us = 0;
  double min_us = 0;
  double max_us = 0;
};

// Median, min and max of `us` (not empty).
Stats summarize(const std::vector<double>& us);

// Runs `variants` interleaved: each of warmup + iters rounds runs every
// variant once (in order, reversed in odd rounds), each call preceded by a
// barrier on `comm`, so slow drift (load from other processes, frequency
// changes) and position effects hit all variants alike. Returns one Stats
// per variant over the timed rounds. Collective over `comm`; every rank must
// pass the same number of variants.
std::vector<Stats> time_interleaved(MPI_Comm comm,
                                    const std::vector<std::function<void()>>& variants,
                                    const TimingOptions& timing);

// Element-wise maximum / sum over the ranks of `comm`, in one reduction.
// Collective; every rank passes the same number of values.
std::vector<int64_t> max_over_ranks(MPI_Comm comm, std::vector<int64_t> values);
std::vector<double> max_over_ranks(MPI_Comm comm, std::vector<double> values);
std::vector<double> sum_over_ranks(MPI_Comm comm, std::vector<double> values);

// ---- output ---------------------------------------------------------------
using Cell = std::variant<int64_t, double, std::string>;

struct Column {
  std::string key;     // JSON field name
  std::string title;   // table heading
  std::string unit;    // second heading line, e.g. "(us)"; may be empty
  int width = 10;      // 0 = JSON only (details too wide for the table)
  int precision = -1;  // decimals for doubles
  std::string group;   // printed over consecutive columns that share it
};

// Rank 0 writes; other ranks hold an inactive Report so that every rank can
// run the same code. Table mode streams each row as soon as it is measured
// (long runs show progress); JSON mode collects everything and writes one
// document in finish().
class Report {
 public:
  // json_path: "" = table on stdout; "-" = JSON on stdout instead of the
  // table; a file name = table on stdout and JSON into that file.
  Report(std::string benchmark, std::vector<Column> columns, std::string json_path, bool active);

  // A header fact: json["meta"][key] = value, and "# <line>" in the table
  // unless `line` is empty.
  void meta(const std::string& key, nlohmann::json value, const std::string& line = "");
  // "# <line>" in the table only: legends and other prose.
  void note(const std::string& line);
  // One cell per column, in column order.
  void row(const std::vector<Cell>& cells);
  // A closing fact, printed after the rows; `line` as in meta().
  void summary(const std::string& key, nlohmann::json value, const std::string& line = "");
  // Writes the JSON document, if any. Throws std::runtime_error if the file
  // cannot be written.
  void finish();

 private:
  void print_headings();
  bool table() const { return active_ && json_path_ != "-"; }

  std::string benchmark_;
  std::vector<Column> columns_;
  std::string json_path_;
  bool active_;
  bool headings_printed_ = false;
  nlohmann::json doc_;
};

// Header facts every benchmark starts with: world size, ranks per node,
// threads per rank, LibTorch's BLAS, the MPI library and the hosts.
// Collective over MPI_COMM_WORLD (gathers host names).
void add_runtime_meta(Report& report, const fsdp::Runtime& rt);

}  // namespace fsdp_bench
