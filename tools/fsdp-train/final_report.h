// fsdp-train's end of a run: --verify (the same steps re-run unsharded on
// rank 0 and compared, losses and final parameters), then rank 0's plot and
// the list of the run's outputs.
#pragma once

#include "plot.h"
#include "progress.h"
#include "training_run.h"

#include <fsdp/runtime.h>

#include <vector>

namespace fsdp_train {

// The exit status of a run whose --verify failed.
constexpr int kVerifyFailed = 3;

// --verify: collective (every rank gathers its parameters, rank 0 re-runs
// the steps in one process while the others wait idly). Returns
// kVerifyFailed on rank 0 when a check failed, else 0 (always 0 on the
// other ranks). `log`: rank 0's loss.csv; rank 0 adds the reference's
// curve to `curves`.
int verify_run(const TrainingRun& run, const LossLog* log, std::vector<Curve>& curves);

// --comm-report: fsdp::describe_groups() on rank 0 and on the first (lowest)
// rank of every other node, each line prefixed with "[node N rank R]" (the
// counters are per rank: one rank per node shows what that node sent).
// Never communicates.
void print_comm_report(const fsdp::Runtime& rt);

// Rank 0: loss.png from `curves`, then the outputs' paths.
void print_outputs(const TrainingRun& run, const std::vector<Curve>& curves);

}  // namespace fsdp_train
