// fsdp-train's step loop: the training steps from a start step to --steps,
// each one's progress line and loss.csv row, and the checkpoint saves
// (every --checkpoint-every steps and at the end).
#pragma once

#include "progress.h"
#include "test_hooks.h"
#include "train_checkpoint.h"
#include "training_run.h"

#include <fsdp/graceful_stop.h>

#include <cstdint>

namespace fsdp_train {

// Steps start + 1 .. cfg.steps on every rank, then rank 0's closing line
// ("trained N steps in ..." or, with nothing to train, why). `log`: rank 0's
// loss.csv (null elsewhere). `stall`: FSDP_TRAIN_STALL_AT, read at set-up.
// `checkpointer` saves every --checkpoint-every steps and at the last step
// (the caller waits for it with finish()).
// `stop`: polled after every step (collective); when any rank received its
// signal, the step just finished is saved (unless it already was) and the
// loop returns that step. Returns 0 when every step ran.
int64_t train_steps(const TrainingRun& run, int64_t start, LossLog* log, const HookSpec& stall,
                    std::chrono::milliseconds min_step,
                    Checkpointer& checkpointer, fsdp::GracefulStop& stop);

}  // namespace fsdp_train
