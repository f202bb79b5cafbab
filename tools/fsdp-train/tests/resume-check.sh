#!/usr/bin/env bash
# Checks that fsdp-train's checkpoints resume exactly: N steps straight (dir A)
# and N/2 steps + `--resume --steps N` (dir B) must give bitwise-identical
# losses and gradient norms in loss.csv and identical final checkpoints
# (index.json, and h5diff of every rank file: parameter pieces, AdamW state).
# Same world size and layout, so the arithmetic is the same: bitwise.
# (tools/fsdp-train/tests/reshard-check.sh resumes into other layouts.)
#
#   tools/fsdp-train/tests/resume-check.sh <fsdp-train> <work dir> [extra fsdp-train flags]
#
# Env: MPIEXEC (default mpiexec), MPIEXEC_FLAGS (extra mpiexec flags, e.g.
# --oversubscribe), NP (default 2), STEPS (default 6, even).
# CTest runs it as fsdp_train_resume_np2 (and the tp / pp variants).
set -euo pipefail
train="${1:?usage: $0 <fsdp-train> <work dir> [flags]}"
work="${2:?usage: $0 <fsdp-train> <work dir> [flags]}"
shift 2
# mpiexec, mpiexec_flags, np, fail, same_run, finish (and the h5diff check).
source "$(dirname "${BASH_SOURCE[0]}")/check-lib.sh"
steps="${STEPS:-6}"
half=$((steps / 2))
common=(--seq 64 --batch 4 --seed 7 "$@")

fresh_dir "$work"
a="$work/straight" b="$work/resumed"

# Not the library's run(): these jobs may take longer than its 60 s limit
# (the tp, pp and moe variants on 4 oversubscribed ranks).
run() { "$mpiexec" -n "$np" "${mpiexec_flags[@]}" "$train" "${common[@]}" "$@"; }

echo "== A: $steps steps straight"
run --steps "$steps" --out "$a"
echo "== B: $half steps, then --resume to $steps"
run --steps "$half" --out "$b"
run --steps "$steps" --out "$b" --resume | tee "$work/resume.log"
grep -q "^fsdp-train: resumed from $b/checkpoint/step-0*$half at step $half, .*resharded 0 of" \
  "$work/resume.log" || { echo "FAIL: no 'resumed from ... at step $half ... resharded 0 of' line"; fail=1; }

# step,loss,grad_norm and every rank file, bitwise (same_run).
same_run "$a" "$b" "$work"
rows=$(($(wc -l < "$work/a.txt") - 1))
if [ "$rows" -ne "$steps" ]; then
  echo "FAIL: $a/loss.csv has $rows rows, expected $steps"
  fail=1
fi
finish "train-resume-check ($steps steps straight == $half + resume to $steps, bitwise)"
