#!/usr/bin/env bash
# Determinism: the same fsdp-train configuration run RUNS times (default 3)
# with the same seed and rank count must give bitwise-identical losses and
# gradient norms (loss.csv columns step,loss,grad_norm: shortest round-trip
# text, so equal text is equal bits).
#
#   tools/fsdp-train/tests/determinism-check.sh <fsdp-train> <work dir> [extra fsdp-train flags]
#
# Env: MPIEXEC (default mpiexec), MPIEXEC_FLAGS (e.g. --oversubscribe), NP
# (default 2), RUNS (default 3). CTest runs it as fsdp_train_determinism_np2
# (1-D FSDP) and fsdp_train_determinism_np4 (HSDP --mesh 2x2).
set -euo pipefail
train="${1:?usage: $0 <fsdp-train> <work dir> [flags]}"
work="${2:?usage: $0 <fsdp-train> <work dir> [flags]}"
shift 2
# mpiexec, mpiexec_flags, np.
source "$(dirname "${BASH_SOURCE[0]}")/check-lib.sh"
runs="${RUNS:-3}"
fresh_dir "$work"

for i in $(seq 1 "$runs"); do
  echo "== run $i of $runs: np $np $*"
  "$mpiexec" -n "$np" "${mpiexec_flags[@]}" "$train" --steps 4 --seq 64 --batch 4 --seed 11 \
    --out "$work/run$i" "$@" > "$work/run$i.log" 2>&1 || { cat "$work/run$i.log"; exit 1; }
  cut -d, -f1-3 "$work/run$i/loss.csv" > "$work/run$i.txt"
done
rows=$(($(wc -l < "$work/run1.txt") - 1))
[ "$rows" -eq 4 ] || { echo "FAIL: run 1 logged $rows steps, expected 4"; exit 1; }
fail=0
for i in $(seq 2 "$runs"); do
  if ! cmp -s "$work/run1.txt" "$work/run$i.txt"; then
    echo "FAIL: run $i differs from run 1:"; diff "$work/run1.txt" "$work/run$i.txt" || true
    fail=1
  fi
done
[ "$fail" -eq 0 ] || exit 1
cat "$work/run1.txt"
echo "PASS: $runs runs, $rows steps each, bitwise-identical losses and grad norms"
