// fsdp-train's test hooks: environment variables the fault tests set to
// make one rank misbehave at a named point of a step (docs/fsdp-train.md).
//   FSDP_DCP_CRASH_AT=<phase>[@<step>]  rank 0 SIGKILLs itself right after
//       that phase of a checkpoint save's publish sequence (written, index,
//       renamed, pruned: docs/distributed_checkpoint.md#publish-sequence),
//       through the library's fsdp::dcp::testing::set_publish_observer
//       (tools/fsdp-train/tests/crash-check.sh)
//
//   FSDP_TRAIN_STALL_AT=<point>[@<step>]  the last rank SIGSTOPs itself
//       (points: "optimizer", after the optimizer step and before the
//       loss is averaged, not reached with --pp, whose loss comes from the
//       pipeline schedule; "save", before the checkpoint save (fsdp::dcp)
//       and its first collective; tools/fsdp-train/tests/stall-check.sh)
//
//   FSDP_TRAIN_MIN_STEP_MS=<ms>  every step takes at least <ms> milliseconds
//       of wall time (each rank sleeps out the rest before the stop check):
//       paces a run for tests against wall-clock events, such as Slurm's
//       time limit (ci/slurm/tests/time-limit-check.sh); the numbers do not
//       change
//
// Every rank reads the same environment, so a bad value is a ConfigError
// naming the variable and the accepted form on every rank.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace fsdp_train {

struct HookSpec {
  std::string point;  // "" = unset
  int64_t step = -1;  // -1 = the first time the point is reached

  bool matches(const char* at_point, int64_t at_step) const {
    return point == at_point && (step < 0 || step == at_step);
  }
};

// Reads `variable`; `points` are the names it accepts.
HookSpec read_hook(const char* variable, const std::vector<std::string>& points);

// Reads FSDP_DCP_CRASH_AT and, when set, installs the publish observer that
// kills rank 0 there.
void install_save_crash(const char* variable);

// Reads `variable` as a whole number of milliseconds in [0, 600000] (0 when
// unset).
std::chrono::milliseconds read_min_step(const char* variable);

}  // namespace fsdp_train
