#!/usr/bin/env bash
# fsdp-train --load: pretrained weights into a deferred-initialised model.
# A trains 4 steps and checkpoints; fsdp-checkpoint exports its model to a
# .safetensors and an .h5 file. Then, at the same world size and layout, three
# one-step jobs --load the safetensors file, the .h5 file and A's checkpoint
# directory: their step-1 losses (a forward on the loaded weights, before any
# update) must be bitwise equal, and below a randomly initialised model's
# (ln 256 = 5.55). Finally HSDP 2x2 on 4 ranks --load's the safetensors file
# with --verify: the sharded run and the single-process run from the same
# loaded weights agree (fsdp-train's --verify tolerance).
#
#   tools/fsdp-train/tests/load-check.sh <fsdp-train> <fsdp-checkpoint> <work dir>
#
# Env: MPIEXEC (default mpiexec), MPIEXEC_FLAGS (for the 4-rank job, e.g.
# --oversubscribe). CTest runs it as fsdp_train_load_np4.
set -euo pipefail
train="${1:?usage: $0 <fsdp-train> <fsdp-checkpoint> <work dir>}"
tool="${2:?usage: $0 <fsdp-train> <fsdp-checkpoint> <work dir>}"
work="${3:?usage: $0 <fsdp-train> <fsdp-checkpoint> <work dir>}"
source "$(dirname "${BASH_SOURCE[0]}")/check-lib.sh"
common=(--seq 64 --batch 4 --seed 3)
fresh_dir "$work"

echo "== A: 4 steps, checkpoint"
run "$work/a.log" --steps 4 --out "$work/a"
expect "A" zero "^trained 4 steps" "$work/a.log"
ckpt="$work/a/checkpoint"
"$tool" export "$ckpt" --to "$work/model.safetensors" --only model/
"$tool" export "$ckpt" --to "$work/model.h5" --only model/

step1_loss() { awk -F, 'NR == 2 { print $2 }' "$1/loss.csv"; }
declare -A loss
for src in safetensors h5 dcp; do
  case "$src" in
    safetensors) path="$work/model.safetensors" ;;
    h5) path="$work/model.h5" ;;
    dcp) path="$ckpt" ;;
  esac
  echo "== --load $path ($src)"
  run "$work/$src.log" --steps 1 --load "$path" --out "$work/$src"
  expect "--load $src" zero "^fsdp-train: loaded 30 tensors from .* \\($([ "$src" = h5 ] && echo hdf5 || echo "$src");" "$work/$src.log"
  loss[$src]="$(step1_loss "$work/$src")"
  echo "    step-1 loss ${loss[$src]}"
done
if [ "${loss[safetensors]}" != "${loss[h5]}" ] || [ "${loss[safetensors]}" != "${loss[dcp]}" ]; then
  echo "FAIL: the step-1 losses differ by source: safetensors ${loss[safetensors]}, h5 ${loss[h5]}, dcp ${loss[dcp]}"
  fail=1
fi
if ! awk -v l="${loss[safetensors]}" 'BEGIN { exit !(l < 5.0) }'; then
  echo "FAIL: step-1 loss ${loss[safetensors]} is not below 5.0: the weights look untrained"
  fail=1
fi

echo "== HSDP 2x2 on 4 ranks: --load + --verify"
np=4
run "$work/hsdp.log" --steps 3 --mesh 2x2 --load "$work/model.safetensors" --verify --out "$work/hsdp"
expect "HSDP --load --verify" zero "^verify: max \\|parameter difference\\| .*: PASS" "$work/hsdp.log"

[ "$fail" = 0 ] && echo "PASS: --load from safetensors, HDF5 and a checkpoint gives the same model; HSDP --verify passes"
exit "$fail"
