// Live progress on rank 0 and the loss log:
//
//   step 12/100  loss 3.2145  tok/s 5234  mem/rank peak 412 MiB (max) 398 MiB (min)  ETA 1m12s
//
// tok/s counts the global batch's tokens over the step's wall time; the
// memory is every rank's peak resident set (getrusage ru_maxrss), gathered to
// rank 0; the ETA is the mean step time of this process times the steps left.
// With --pp the line also shows the step's pipeline bubble after tok/s
// ("bubble 0.333": fsdp::pp::bubble_fraction, the idle share of the slowest
// rank's schedule step). With --moe it shows the expert load balance after
// the memory ("load max/mean 1.21 1.08": per MoE layer, the largest number
// of (token, k) pairs routed to one expert over the global batch, divided by
// the mean over the experts; 1 = balanced).
#pragma once

#include "world_comm.h"

#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace fsdp_train {

struct LossRow {
  int64_t step = 0;
  double loss = 0, grad_norm = 0, tokens_per_s = 0;
};

// <dir>/<name>: "step,loss,grad_norm,tokens_per_s", one row per step, the
// floating values in shortest round-trip form (equal text = equal bits).
class LossLog {
 public:
  // Opens `path` for writing; with keep_until > 0, first keeps the rows of
  // an existing file up to that step (a resumed run's earlier steps).
  LossLog(std::string path, int64_t keep_until);
  void add(const LossRow& row);  // written and flushed at once
  const std::vector<LossRow>& rows() const { return rows_; }
  const std::string& path() const { return path_; }
  // Rows kept from the existing file (for the resume note).
  int64_t kept() const { return kept_; }

  static void write_all(const std::string& path, const std::vector<LossRow>& rows);
  static std::vector<LossRow> read(const std::string& path);

 private:
  std::string path_;
  std::ofstream out_;
  std::vector<LossRow> rows_;
  int64_t kept_ = 0;
};

// Peak resident set over the ranks in MiB: {max, min} on every rank
// (collective over the world).
struct MemoryPeak {
  double max_mib = 0, min_mib = 0;
};
MemoryPeak gather_peak_rss(const WorldComm& comm);

// "1m12s", "45s", "2h03m".
std::string format_duration(double seconds);

class Progress {
 public:
  Progress(int64_t total_steps, int64_t first_step, int64_t tokens_per_step, int64_t log_every);
  // Records a finished step; returns the tok/s of that step.
  double record(double seconds);
  // Whether `step` gets a progress line.
  bool should_log(int64_t step) const;
  std::string line(int64_t step, double loss, const MemoryPeak& mem,
                   std::optional<double> bubble = std::nullopt,
                   const std::vector<double>& load = {}) const;
  double mean_step_seconds() const;
  double total_seconds() const { return total_; }
  int64_t steps_done() const { return done_; }

 private:
  int64_t total_steps_, first_step_, tokens_per_step_, log_every_;
  int64_t done_ = 0;
  double total_ = 0, last_ = 0;
};

}  // namespace fsdp_train
