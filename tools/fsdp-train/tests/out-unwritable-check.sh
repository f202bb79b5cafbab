#!/usr/bin/env bash
# An --out whose checkpoint/ cannot be written (here a regular file of that
# name: root ignores permission bits) is refused before the first step:
# exit status 2, one line naming --out and the path, no step trained, and
# what was there left as it was.
#
#   tools/fsdp-train/tests/out-unwritable-check.sh <fsdp-train> <work dir>
set -euo pipefail
train="${1:?usage: $0 <fsdp-train> <work dir>}"
work="${2:?usage: $0 <fsdp-train> <work dir>}"
source "$(dirname "${BASH_SOURCE[0]}")/check-lib.sh"
common=(--seq 64 --batch 4 --steps 2)
rm -rf "$work"
mkdir -p "$work/out"
echo "a file where checkpoint/ would go" >"$work/out/checkpoint"
before=$(sha256sum "$work/out/checkpoint")
run "$work/run.log" --out "$work/out"
expect "unwritable checkpoint directory" 2 \
  "^fsdp-train: error: --out $work/out: cannot write checkpoints to $work/out/checkpoint \(" \
  "$work/run.log"
if grep -q "^step " "$work/run.log"; then echo "FAIL: a step ran"; fail=1; else echo "ok: no step ran"; fi
[ "$(sha256sum "$work/out/checkpoint")" = "$before" ] && echo "ok: the file is unchanged" \
  || { echo "FAIL: $work/out/checkpoint changed"; fail=1; }
[ ! -e "$work/out/loss.csv" ] && echo "ok: no loss.csv" || { echo "FAIL: loss.csv written"; fail=1; }
finish "train-out-unwritable-check"
