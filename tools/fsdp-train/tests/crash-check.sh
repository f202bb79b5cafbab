#!/usr/bin/env bash
# Crash safety of fsdp-train's checkpoints (fsdp::dcp's publish sequence,
# docs/distributed_checkpoint.md): rank 0 is SIGKILLed by the library's
# test hook FSDP_DCP_CRASH_AT right after one phase of a save, TWICE IN A ROW:
#
#   1. --steps 5 --checkpoint-every 1, killed after <phase> of the save at step 3
#   2. --resume, killed after <phase> of its first save
#   3. --resume to step 5
#
# Each resume must load a complete checkpoint: the one being saved when the
# kill came after `renamed` or `pruned` (it is published), the one before
# after `written` or `index` (the new one is still step-<S>.tmp/). The end
# must be bitwise the uninterrupted run's (loss.csv step,loss,grad_norm, and
# the step-5 checkpoint's index.json and rank files).
#
#   tools/fsdp-train/tests/crash-check.sh <fsdp-train> <work dir> reference
#   tools/fsdp-train/tests/crash-check.sh <fsdp-train> <work dir> <phase> [extra fsdp-train flags]
#
# `reference` writes the uninterrupted run into <work dir>/straight (the
# CTest fixture fsdp_train_crash_reference); a phase's run makes it if missing.
# Phases: written index renamed pruned.
# Env: as tools/fsdp-train/tests/check-lib.sh says (MPIEXEC, MPIEXEC_FLAGS, NP).
# CTest runs it as fsdp_train_crash_<phase>_np2 (labels cpu;train;np2;faults).
set -euo pipefail
train="${1:?usage: $0 <fsdp-train> <work dir> reference|<phase> [flags]}"
work="${2:?usage: $0 <fsdp-train> <work dir> reference|<phase> [flags]}"
phase="${3:?usage: $0 <fsdp-train> <work dir> reference|<phase> [flags]}"
shift 3
common=(--seq 64 --batch 4 --seed 7 --steps 5 --checkpoint-every 1 "$@")
# shellcheck source=tools/fsdp-train/tests/check-lib.sh
source "$(dirname "$0")/check-lib.sh"
unset FSDP_DCP_CRASH_AT
mkdir -p "$work"
straight="$work/straight"

if [ "$phase" = reference ] || [ -z "$(newest "$straight")" ]; then
  echo "== the uninterrupted run: 5 steps, a checkpoint after each"
  rm -rf "$straight"
  run "$work/straight.log" --out "$straight"
  expect "uninterrupted run" zero "^checkpoint: step 5 -> " "$work/straight.log"
  [ "$phase" = reference ] && finish "train-crash-check reference"
fi

# The step each resume must start from.
case "$phase" in
  written | index) first=2 second=2 ;;   # step 3 (then 3 again) never published
  renamed | pruned) first=3 second=4 ;;  # step 3, then step 4, published
  *) echo "unknown phase $phase (accepted: written index renamed pruned)"; exit 2 ;;
esac

dir="$work/$phase"
rm -rf "$dir"
mkdir -p "$dir"
out="$dir/out"
echo "== 1: killed after \"$phase\" of the save at step 3"
FSDP_DCP_CRASH_AT="$phase@3" run "$dir/1.log" --out "$out"
expect "crash 1" nonzero "FSDP_DCP_CRASH_AT=$phase@3: rank 0 kills itself after '$phase' of the save of step 3" \
  "$dir/1.log"
ls -1 "$out/checkpoint" | sed 's/^/    left: /'
echo "== 2: --resume, killed again after \"$phase\" of its first save"
FSDP_DCP_CRASH_AT="$phase" run "$dir/2.log" --out "$out" --resume
expect "resume after crash 1" nonzero \
  "^fsdp-train: resumed from $out/checkpoint/step-0{11}$first at step $first, saved by $np ranks" "$dir/2.log"
expect "crash 2" nonzero "FSDP_DCP_CRASH_AT=$phase: rank 0 kills itself after '$phase' of the save of step $((first + 1))" \
  "$dir/2.log"
ls -1 "$out/checkpoint" | sed 's/^/    left: /'
echo "== 3: --resume to the end"
run "$dir/3.log" --out "$out" --resume
expect "resume after crash 2" zero \
  "^fsdp-train: resumed from $out/checkpoint/step-0{11}$second at step $second, saved by $np ranks" "$dir/3.log"
expect "final save" zero "^checkpoint: step 5 -> " "$dir/3.log"
same_run "$straight" "$out" "$dir"
finish "train-crash-check $phase"
