// Where this run comes from: the Slurm job it belongs to (job id, step id,
// node list, restart count, from the SLURM_* environment srun and sbatch
// set), for the first log line and <out>/runs.jsonl. docs/graceful_stop.md.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace fsdp_train {

struct JobInfo {
  bool slurm = false;      // SLURM_JOB_ID is set
  std::string job_id;      // SLURM_JOB_ID
  std::string step_id;     // SLURM_STEP_ID ("" outside a step: sbatch + mpirun)
  std::string node_list;   // SLURM_JOB_NODELIST (or SLURM_NODELIST)
  int restart_count = 0;   // SLURM_RESTART_COUNT (0 when unset: the first start)
};

// Read from this process's environment (every rank of a job sees the same).
JobInfo job_info_from_env();

// " | slurm job 42 step 0, nodes n[1-2], restart 1", or "" outside Slurm.
std::string banner_suffix(const JobInfo& job);

// Rank 0: appends one line to <out>/runs.jsonl -- this start's time, world
// size, mesh, the step it resumed from and the Slurm fields -- so a
// directory that a requeued job reused says which job wrote what.
void append_run_record(const std::string& out, const JobInfo& job, const nlohmann::json& run);

}  // namespace fsdp_train
