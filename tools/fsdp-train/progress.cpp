#include "progress.h"

#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>

namespace fsdp_train {

namespace {

constexpr const char* kHeader = "step,loss,grad_norm,tokens_per_s";

std::string csv_row(const LossRow& r) {
  return fmt::format("{},{},{},{:.0f}\n", r.step, r.loss, r.grad_norm, r.tokens_per_s);
}

}  // namespace

LossLog::LossLog(std::string path, int64_t keep_until) : path_(std::move(path)) {
  if (keep_until > 0) {
    for (const auto& r : read(path_)) {
      if (r.step <= keep_until) rows_.push_back(r);
    }
    kept_ = static_cast<int64_t>(rows_.size());
  }
  out_.open(path_, std::ios::trunc);
  if (!out_) throw std::runtime_error("cannot write " + path_);
  out_ << kHeader << "\n";
  for (const auto& r : rows_) out_ << csv_row(r);
  out_.flush();
}

void LossLog::add(const LossRow& row) {
  rows_.push_back(row);
  out_ << csv_row(row);
  out_.flush();
}

void LossLog::write_all(const std::string& path, const std::vector<LossRow>& rows) {
  std::ofstream out(path, std::ios::trunc);
  out << kHeader << "\n";
  for (const auto& r : rows) out << csv_row(r);
  if (!out) throw std::runtime_error("cannot write " + path);
}

std::vector<LossRow> LossLog::read(const std::string& path) {
  std::vector<LossRow> rows;
  std::ifstream in(path);
  std::string line;
  if (!std::getline(in, line)) return rows;  // missing or empty: nothing to keep
  while (std::getline(in, line)) {
    LossRow r;
    char c1 = 0, c2 = 0, c3 = 0;
    std::istringstream s(line);
    if (s >> r.step >> c1 >> r.loss >> c2 >> r.grad_norm >> c3 >> r.tokens_per_s && c1 == ',' &&
        c2 == ',' && c3 == ',') {
      rows.push_back(r);
    }
  }
  return rows;
}

MemoryPeak gather_peak_rss(const WorldComm& comm) {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  const std::vector<int64_t> all = comm.all_gather(static_cast<int64_t>(usage.ru_maxrss));  // KiB
  MemoryPeak m;
  m.max_mib = static_cast<double>(*std::max_element(all.begin(), all.end())) / 1024.0;
  m.min_mib = static_cast<double>(*std::min_element(all.begin(), all.end())) / 1024.0;
  return m;
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<int64_t>(std::llround(seconds));
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02d}s", s / 60, s % 60);
  return fmt::format("{}h{:02d}m", s / 3600, (s % 3600) / 60);
}

Progress::Progress(int64_t total_steps, int64_t first_step, int64_t tokens_per_step,
                   int64_t log_every)
    : total_steps_(total_steps),
      first_step_(first_step),
      tokens_per_step_(tokens_per_step),
      log_every_(std::max<int64_t>(1, log_every)) {}

double Progress::record(double seconds) {
  ++done_;
  total_ += seconds;
  last_ = seconds;
  return seconds > 0 ? static_cast<double>(tokens_per_step_) / seconds : 0.0;
}

bool Progress::should_log(int64_t step) const {
  return step % log_every_ == 0 || step == total_steps_ || step == first_step_ + 1;
}

double Progress::mean_step_seconds() const { return done_ > 0 ? total_ / done_ : 0.0; }

std::string Progress::line(int64_t step, double loss, const MemoryPeak& mem,
                           std::optional<double> bubble, const std::vector<double>& load) const {
  const double tok_s = last_ > 0 ? static_cast<double>(tokens_per_step_) / last_ : 0.0;
  const double eta = mean_step_seconds() * static_cast<double>(total_steps_ - step);
  const int width = static_cast<int>(std::to_string(total_steps_).size());
  std::string balance;
  for (const double l : load) balance += fmt::format(" {:.2f}", l);
  return fmt::format("step {:>{}}/{}  loss {:.4f}  tok/s {:.0f}  {}mem/rank peak {:.0f} MiB (max) "
                     "{:.0f} MiB (min)  {}ETA {}",
                     step, width, total_steps_, loss, tok_s,
                     bubble ? fmt::format("bubble {:.3f}  ", *bubble) : std::string(),
                     mem.max_mib, mem.min_mib,
                     balance.empty() ? std::string() : "load max/mean" + balance + "  ",
                     format_duration(eta));
}

}  // namespace fsdp_train
