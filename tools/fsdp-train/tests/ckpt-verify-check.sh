#!/usr/bin/env bash
# fsdp-train --resume refuses a damaged or inconsistent checkpoint on every
# rank with one message (exit status 2 when nothing verifies, never a hang),
# and falls back to checkpoint.old/ when that one verifies; the fallback
# then trains on to the same bits as the run that was never damaged.
#
#   tools/fsdp-train/tests/ckpt-verify-check.sh <fsdp-train> <train-ckpt-tamper> <work dir> setup
#   tools/fsdp-train/tests/ckpt-verify-check.sh <fsdp-train> <train-ckpt-tamper> <work dir> <case>
#
# `setup` trains 4 steps with a checkpoint every 2 into <work dir>/pristine
# (checkpoint/ at step 4, checkpoint.old/ at step 2; the CTest fixture
# fsdp_train_ckpt_pristine); each case copies it, damages it, and resumes to
# step 4. Cases: flip nan optim-deleted param-deleted shape step-lie
# meta-edited meta-missing-key meta-string all-damaged flags.
# The damage goes into rank1.h5 (or meta.json): rank 0 must still print
# rank 1's reason, which shows the ranks agreed on it.
# Env: as tools/fsdp-train/tests/ckpt-lib.sh says (MPIEXEC, MPIEXEC_FLAGS, NP).
set -euo pipefail
usage="usage: $0 <fsdp-train> <train-ckpt-tamper> <work dir> setup|<case>"
train="${1:?$usage}"
tamper="${2:?$usage}"
work="${3:?$usage}"
case_name="${4:?$usage}"
common=(--seq 64 --batch 4 --seed 7 --steps 4 --checkpoint-every 2)
# shellcheck source=tools/fsdp-train/tests/ckpt-lib.sh
source "$(dirname "$0")/ckpt-lib.sh"
unset FSDP_TRAIN_CRASH_AT
pristine="$work/pristine"
param=embed.weight  # a parameter every rank holds a non-empty shard of

if [ "$case_name" = setup ] || [ ! -f "$pristine/checkpoint.old/meta.json" ]; then
  rm -rf "$pristine"
  mkdir -p "$work"
  run "$work/pristine.log" --out "$pristine"
  expect "pristine run" zero "^checkpoint: step 4 -> " "$work/pristine.log"
  [ -f "$pristine/checkpoint.old/meta.json" ] || { echo "FAIL: no checkpoint.old/ kept"; fail=1; }
  [ "$case_name" = setup ] && finish "train-ckpt-verify-check setup"
fi

dir="$work/$case_name"
rm -rf "$dir"
mkdir -p "$dir"
out="$dir/out"
cp -r "$pristine" "$out"
ck="$out/checkpoint"

# flip_byte <rank.h5> <dataset>: XOR 0x01 into byte 100 of the dataset's
# contiguous storage (the low mantissa byte of element 25: still a finite
# float, so only the checksum can tell), below HDF5, as bit rot would.
flip_byte() {
  local file="$1" dataset="$2" offset byte
  offset=$(h5dump -p -H -d "$dataset" "$file" | awk '$1 == "OFFSET" { print $2; exit }')
  [ -n "$offset" ] || { echo "FAIL: no OFFSET for $dataset in h5dump -p -H $file"; exit 1; }
  offset=$((offset + 100))
  byte=$(dd if="$file" bs=1 skip="$offset" count=1 status=none | od -An -tu1 | tr -d ' ')
  printf "\\$(printf '%03o' $((byte ^ 1)))" | dd of="$file" bs=1 seek="$offset" conv=notrunc status=none
  echo "    flipped bit 0 of byte $offset of $file ($dataset): $byte -> $((byte ^ 1))"
}

# The message when checkpoint/ is refused and checkpoint.old/ (step 2) is used.
fallback() { echo "^fsdp-train: checkpoint/ is damaged \\($1\\); resuming from checkpoint.old/ at step 2$"; }
expect_fallback=1
flags=()
case "$case_name" in
  flip)
    flip_byte "$ck/rank1.h5" "/params/$param"
    regex=$(fallback "rank1.h5: /params/$param checksum mismatch: stored [0-9a-f]{16}, computed [0-9a-f]{16}") ;;
  nan)
    "$tamper" nan "$ck/rank1.h5" "/params/$param"
    regex=$(fallback "rank1.h5: /params/$param holds NaN \\(element 0\\)") ;;
  optim-deleted)
    "$tamper" delete "$ck/rank1.h5" "/optim/$param"
    regex=$(fallback "rank1.h5: /optim/$param is missing \\(attribute optim lists AdamW state for it\\)") ;;
  param-deleted)
    "$tamper" delete "$ck/rank1.h5" "/params/$param"
    regex=$(fallback "rank1.h5: /params/$param is missing") ;;
  shape)
    "$tamper" reshape "$ck/rank1.h5" "/params/$param"
    regex=$(fallback "rank1.h5: /params/$param has shape \\[([0-9]+), 256\\], this rank's shard is \\[[0-9]+, 256\\]") ;;
  step-lie)  # re-signed: only the rank files' step attribute can tell
    "$tamper" meta "$ck/meta.json" step 3
    regex=$(fallback "rank0.h5: holds step 4, meta.json says step 3") ;;
  meta-edited)  # by hand: its own checksum tells
    sed -i 's/"step": 4,/"step": 3,/' "$ck/meta.json"
    regex=$(fallback "meta.json checksum mismatch: stored fnv1a64:[0-9a-f]{16}, computed fnv1a64:[0-9a-f]{16}; edited or damaged after it was written") ;;
  meta-missing-key)
    "$tamper" meta "$ck/meta.json" world --delete
    regex=$(fallback 'meta.json: "world" is missing') ;;
  meta-string)
    sed -i 's/"step": 4,/"step": "4",/' "$ck/meta.json"
    regex=$(fallback 'meta.json: "step" is a string \("4"\), expected an integer') ;;
  all-damaged)  # nothing verifies: refused, no training
    flip_byte "$ck/rank1.h5" "/params/$param"
    "$tamper" nan "$out/checkpoint.old/rank1.h5" "/optim/$param/exp_avg"
    expect_fallback=0
    regex="^fsdp-train: error: --resume: no checkpoint in $out verifies: checkpoint/ is damaged \\(rank1.h5: /params/$param checksum mismatch: [^)]*\\), checkpoint.old/ is damaged \\(rank1.h5: /optim/$param/exp_avg holds NaN \\(element 0\\)\\)$" ;;
  flags)  # other numerics are the user's mistake, not damage: no fallback
    flags=(--lr 0.001)
    expect_fallback=0
    regex="^fsdp-train: error: --resume: the checkpoint in $ck was written with optimizer = .*\"lr\":0.003.*, but this run has optimizer = .*\"lr\":0.001.*;" ;;
  *) echo "$usage (unknown case $case_name)"; exit 2 ;;
esac

echo "== resume from the damaged checkpoint ($case_name)"
run "$dir/resume.log" --out "$out" --resume "${flags[@]}"
if [ "$expect_fallback" -eq 1 ]; then
  expect "$case_name" zero "$regex" "$dir/resume.log"
  expect "$case_name: trained on" zero "^checkpoint: step 4 -> " "$dir/resume.log"
  same_run "$pristine" "$out" "$dir"
else
  expect "$case_name" 2 "$regex" "$dir/resume.log"
  if grep -q "^checkpoint: step" "$dir/resume.log"; then
    echo "FAIL: $case_name: trained and saved after the refusal"
    fail=1
  fi
fi
lines=$(grep -c "fsdp-train: \(error\|checkpoint/\)" "$dir/resume.log" || true)
if [ "$lines" -ne 1 ]; then
  echo "FAIL: $case_name: $lines lines of refusal/fallback messages, expected one"
  fail=1
fi
finish "train-ckpt-verify-check $case_name"
