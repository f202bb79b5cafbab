#include "job_info.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <ctime>
#include <fstream>

namespace fsdp_train {
namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

std::string utc_now() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace

JobInfo job_info_from_env() {
  JobInfo j;
  j.job_id = env("SLURM_JOB_ID");
  j.slurm = !j.job_id.empty();
  j.step_id = env("SLURM_STEP_ID");
  j.node_list = env("SLURM_JOB_NODELIST");
  if (j.node_list.empty()) j.node_list = env("SLURM_NODELIST");
  const std::string restarts = env("SLURM_RESTART_COUNT");
  if (!restarts.empty()) j.restart_count = std::atoi(restarts.c_str());
  return j;
}

std::string banner_suffix(const JobInfo& job) {
  if (!job.slurm) return "";
  return fmt::format(" | slurm job {}{}, nodes {}, restart {}", job.job_id,
                     job.step_id.empty() ? std::string() : " step " + job.step_id,
                     job.node_list.empty() ? std::string("?") : job.node_list,
                     job.restart_count);
}

void append_run_record(const std::string& out, const JobInfo& job, const nlohmann::json& run) {
  nlohmann::json line = run;
  line["started"] = utc_now();
  if (job.slurm) {
    line["slurm"] = {{"job_id", job.job_id},
                     {"step_id", job.step_id},
                     {"node_list", job.node_list},
                     {"restart_count", job.restart_count}};
  }
  std::ofstream f(out + "/runs.jsonl", std::ios::app);
  f << line.dump() << '\n';
}

}  // namespace fsdp_train
