// fsdp-bench train's report: the table's columns, the header (model, meshes,
// legends), one row per configuration and the closing summary against the
// project's step-time and memory targets.
#pragma once

#include "harness.h"
#include "train_configs.h"
#include "train_trainer.h"

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fsdp_bench::train {

// What the timed steps and the measurements after them found, per
// configuration (index i of the plan's specs and the trainers), every
// number already reduced over the ranks.
struct Results {
  std::vector<Stats> stats;   // step times, slowest rank per step
  std::vector<double> losses;  // mean over the ranks: the global batch's loss
  // Per config, 6 values (max over ranks): persistent, params, grads,
  // optimizer, held, peak bytes.
  std::vector<int64_t> mem;
  std::vector<double> bubble;  // pipelined: median bubble fraction; -1 elsewhere
  // Median over timed steps of the slowest rank's time, ms.
  std::vector<std::array<double, Trainer::kPhases>> phase_ms;
  // AG, RS, AR off the tp group, the same on it, bytes (one untimed step).
  std::vector<std::array<int64_t, 7>> comm_counts;
  std::vector<int64_t> all_to_alls;  // the expert-parallel config's dispatch and combine
  // Per config, group name -> bytes sent to ranks on other nodes in one
  // (untimed) step, summed over every rank of the group
  // (fsdp::CollectiveCounters::cross_node_bytes); filled on rank 0 only.
  std::vector<std::map<std::string, int64_t>> cross_node;
  int num_nodes = 1;  // fsdp::Runtime::num_nodes()
};

std::vector<Column> columns();

// The header: the model and run, the runtime (add_runtime_meta: collective
// over MPI_COMM_WORLD), the meshes, the legend of each config and of the
// columns.
void describe_run(Report& report, const Plan& plan, const Options& o, const fsdp::Runtime& rt);

// The rows, then the summary facts (loss spread, the step-time and memory
// targets, the pipelines' and the expert-parallel config's ratios to DDP).
void report_results(Report& report, const Plan& plan,
                    const std::vector<std::unique_ptr<Trainer>>& trainers, const Results& r,
                    int world);

}  // namespace fsdp_bench::train
