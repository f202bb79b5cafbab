#!/usr/bin/env bash
# Checks that fsdp-train's checkpoints resume exactly: N steps straight (dir A)
# and N/2 steps + `--resume --steps N` (dir B) must give bitwise-identical
# losses and gradient norms in loss.csv and identical final checkpoint shards
# (h5diff: parameter shards, AdamW state, attributes).
#
#   ci/train-resume-check.sh <fsdp-train> <work dir> [extra fsdp-train flags]
#
# Env: MPIEXEC (default mpiexec), MPIEXEC_FLAGS (extra mpiexec flags, e.g.
# --oversubscribe), NP (default 2), STEPS (default 6, even).
# CTest runs it as fsdp_train_resume_np2 (and the tp / pp variants).
set -euo pipefail
train="${1:?usage: $0 <fsdp-train> <work dir> [flags]}"
work="${2:?usage: $0 <fsdp-train> <work dir> [flags]}"
shift 2
mpiexec="${MPIEXEC:-mpiexec}"
read -r -a mpiexec_flags <<<"${MPIEXEC_FLAGS:-}"
np="${NP:-2}"
steps="${STEPS:-6}"
half=$((steps / 2))
common=(--seq 64 --batch 4 --seed 7 "$@")

command -v h5diff >/dev/null || { echo "FAIL: h5diff not found (Debian package hdf5-tools)"; exit 1; }
rm -rf "$work"
mkdir -p "$work"
a="$work/straight" b="$work/resumed"

run() { "$mpiexec" -n "$np" "${mpiexec_flags[@]}" "$train" "${common[@]}" "$@"; }

echo "== A: $steps steps straight"
run --steps "$steps" --out "$a"
echo "== B: $half steps, then --resume to $steps"
run --steps "$half" --out "$b"
run --steps "$steps" --out "$b" --resume

fail=0
# step,loss,grad_norm (shortest round-trip text: equal text = equal bits).
cut -d, -f1-3 "$a/loss.csv" > "$work/a.txt"
cut -d, -f1-3 "$b/loss.csv" > "$work/b.txt"
rows=$(($(wc -l < "$work/a.txt") - 1))
if [ "$rows" -ne "$steps" ]; then
  echo "FAIL: $a/loss.csv has $rows rows, expected $steps"
  fail=1
fi
if diff -u "$work/a.txt" "$work/b.txt"; then
  echo "ok: loss.csv step,loss,grad_norm identical over $rows steps"
else
  echo "FAIL: losses differ between the straight and the resumed run (diff above)"
  fail=1
fi
for ((r = 0; r < np; ++r)); do
  fa="$a/checkpoint/rank$r.h5" fb="$b/checkpoint/rank$r.h5"
  if [ ! -f "$fa" ] || [ ! -f "$fb" ]; then
    echo "FAIL: missing $fa or $fb"
    fail=1
  elif h5diff -c "$fa" "$fb" >"$work/h5diff-rank$r.txt" 2>&1; then
    echo "ok: rank$r.h5 identical (parameter shards and AdamW state)"
  else
    echo "FAIL: rank$r.h5 differs:"
    head -n 40 "$work/h5diff-rank$r.txt"
    fail=1
  fi
done
if [ "$fail" -ne 0 ]; then
  echo "train-resume-check: FAILED"
  exit 1
fi
echo "train-resume-check: PASSED ($steps steps straight == $half + resume to $steps, bitwise)"
