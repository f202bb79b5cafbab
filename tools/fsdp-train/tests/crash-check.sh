#!/usr/bin/env bash
# Crash safety of fsdp-train's checkpoint publish sequence: rank 0 is
# SIGKILLed (test hook FSDP_TRAIN_CRASH_AT, tools/fsdp-train/resume_files.h)
# right after one step of it, TWICE IN A ROW:
#
#   1. --steps 5 --checkpoint-every 1, killed after <point> of the save at step 3
#   2. --resume, killed after <point> of its first save
#   3. --resume to step 5
#
# Each resume must find a complete, verified checkpoint, and the end must be
# bitwise the uninterrupted run's (loss.csv step,loss,grad_norm and every
# checkpoint/rank<R>.h5).
#
#   tools/fsdp-train/tests/crash-check.sh <fsdp-train> <work dir> reference
#   tools/fsdp-train/tests/crash-check.sh <fsdp-train> <work dir> <point> [extra fsdp-train flags]
#
# `reference` writes the uninterrupted run into <work dir>/straight (the
# CTest fixture fsdp_train_crash_reference); a point's run makes it if missing.
# Points: written synced meta cleanup renamed-old renamed-new.
# Env: as tools/fsdp-train/tests/ckpt-lib.sh says (MPIEXEC, MPIEXEC_FLAGS, NP).
# CTest runs it as fsdp_train_crash_<point>_np2 (labels cpu;train;np2;faults).
set -euo pipefail
train="${1:?usage: $0 <fsdp-train> <work dir> reference|<point> [flags]}"
work="${2:?usage: $0 <fsdp-train> <work dir> reference|<point> [flags]}"
point="${3:?usage: $0 <fsdp-train> <work dir> reference|<point> [flags]}"
shift 3
common=(--seq 64 --batch 4 --seed 7 --steps 5 --checkpoint-every 1 "$@")
# shellcheck source=tools/fsdp-train/tests/ckpt-lib.sh
source "$(dirname "$0")/ckpt-lib.sh"
unset FSDP_TRAIN_CRASH_AT
mkdir -p "$work"
straight="$work/straight"

if [ "$point" = reference ] || [ ! -f "$straight/checkpoint/meta.json" ]; then
  echo "== the uninterrupted run: 5 steps, a checkpoint after each"
  rm -rf "$straight"
  run "$work/straight.log" --out "$straight"
  expect "uninterrupted run" zero "^checkpoint: step 5 -> " "$work/straight.log"
  [ "$point" = reference ] && finish "train-crash-check reference"
fi

dir="$work/$point"
rm -rf "$dir"
mkdir -p "$dir"
out="$dir/out"
echo "== 1: killed after \"$point\" of the save at step 3"
FSDP_TRAIN_CRASH_AT="$point@3" run "$dir/1.log" --out "$out"
expect "crash 1" nonzero "FSDP_TRAIN_CRASH_AT: SIGKILL of rank 0 after \"$point\" of the save at step 3" \
  "$dir/1.log"
ls -1 "$out" | sed 's/^/    left: /'
echo "== 2: --resume, killed again after \"$point\" of its first save"
FSDP_TRAIN_CRASH_AT="$point" run "$dir/2.log" --out "$out" --resume
expect "resume after crash 1" nonzero "^fsdp-train: resumed from .* at step [23]$" "$dir/2.log"
expect "crash 2" nonzero "FSDP_TRAIN_CRASH_AT: SIGKILL of rank 0 after \"$point\" of the save at step [34]" \
  "$dir/2.log"
ls -1 "$out" | sed 's/^/    left: /'
echo "== 3: --resume to the end"
run "$dir/3.log" --out "$out" --resume
expect "resume after crash 2" zero "^fsdp-train: resumed from .* at step [234]$" "$dir/3.log"
expect "final save" zero "^checkpoint: step 5 -> " "$dir/3.log"
same_run "$straight" "$out" "$dir"
finish "train-crash-check $point"
