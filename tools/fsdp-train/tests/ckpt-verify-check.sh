#!/usr/bin/env bash
# fsdp-train --resume and damaged or foreign checkpoints (fsdp::dcp,
# docs/distributed_checkpoint.md): each case ends either in a fallback to the
# older checkpoint, printed ("fsdp-train: fallback: skipped <newest>: <why>")
# and then trained on to the same bits as the run that was never damaged, or
# in one typed error message with exit status 2 and no training -- on every
# rank, never a hang (each job at most 60 s), never training on bad data.
#
#   tools/fsdp-train/tests/ckpt-verify-check.sh <fsdp-train> <train-ckpt-tamper> <work dir> setup
#   tools/fsdp-train/tests/ckpt-verify-check.sh <fsdp-train> <train-ckpt-tamper> <work dir> <case>
#
# `setup` trains 4 steps with a checkpoint every 2 into <work dir>/pristine
# (checkpoint/step-...02 and step-...04; the CTest fixture
# fsdp_train_ckpt_pristine); each case copies it, damages it, and resumes to
# step 4.
#   damage, falls back to step 2: flip (a flipped byte in a data block of
#     rank-00001.h5: its Fletcher-32 checksum), truncated (rank-00001.h5 cut
#     short), rank-missing (rank-00001.h5 deleted), index-edited (index.json
#     edited by hand: its checksum), index-corrupt (index.json cut in half:
#     not JSON)
#   refused, exit 2: all-damaged (both checkpoints damaged), other-model (a
#     checkpoint of a 2-layer model, newer than the others: --layers named),
#     other-names (index.json re-signed with every tensor renamed: none of
#     the model's), missing-tensor (index.json re-signed without one
#     parameter), shape (index.json re-signed with another global shape),
#     flags (--lr changed: named)
# The damage goes into rank 1's file where a rank file is damaged: rank 0
# prints the agreed verdict.
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
unset FSDP_DCP_CRASH_AT
pristine="$work/pristine"
param=embed.weight  # a parameter every rank holds a non-empty shard of
s2=step-000000000002 s4=step-000000000004

if [ "$case_name" = setup ] || [ ! -f "$pristine/checkpoint/$s2/index.json" ]; then
  rm -rf "$pristine"
  mkdir -p "$work"
  run "$work/pristine.log" --out "$pristine"
  expect "pristine run" zero "^checkpoint: step 4 -> " "$work/pristine.log"
  [ -f "$pristine/checkpoint/$s2/index.json" ] || { echo "FAIL: no $s2 kept"; fail=1; }
  [ "$case_name" = setup ] && finish "train-ckpt-verify-check setup"
fi

dir="$work/$case_name"
rm -rf "$dir"
mkdir -p "$dir"
out="$dir/out"
cp -r "$pristine" "$out"
ck="$out/checkpoint"

# The lines of a fallback from step 4 to step 2 ($1: why step 4 was skipped).
fallback() { echo "^fsdp-train: fallback: skipped $ck/$s4: $1"; }
resumed2="^fsdp-train: resumed from $ck/$s2 at step 2, saved by $np ranks"
error() { echo "^fsdp-train: error: --resume: $1"; }
expect_fallback=1
flags=()
case "$case_name" in
  flip)
    "$tamper" flip "$ck/$s4/rank-00001.h5" "/model/$param"
    regex=$(fallback "rank 1: corrupt piece of 'model/$param' \\[[0-9:, ]+\\] in rank-00001.h5: .*failed its checksum") ;;
  truncated)
    truncate -s -1000 "$ck/$s4/rank-00001.h5"
    regex=$(fallback "(rank [0-9]+: )?$ck/$s4: rank file rank-00001.h5 has [0-9]+ bytes; [0-9]+ were written \\(truncated\\)") ;;
  rank-missing)
    rm "$ck/$s4/rank-00001.h5"
    regex=$(fallback "(rank [0-9]+: )?$ck/$s4: rank file rank-00001.h5 is missing") ;;
  index-edited)  # by hand: its own checksum tells
    sed -i 's/"step": 4/"step": 3/' "$ck/$s4/index.json"
    grep -q '"step": 3' "$ck/$s4/index.json" || { echo "FAIL: the edit did not apply"; exit 1; }
    regex=$(fallback ".*checksum mismatch") ;;
  index-corrupt)
    truncate -s $(($(stat -c %s "$ck/$s4/index.json") / 2)) "$ck/$s4/index.json"
    regex=$(fallback ".*is not valid JSON") ;;
  all-damaged)  # nothing verifies: refused, no training
    "$tamper" flip "$ck/$s4/rank-00001.h5" "/model/$param"
    rm "$ck/$s2/rank-00001.h5"
    expect_fallback=0
    regex=$(error "incomplete: .*$s2: rank file rank-00001.h5 is missing") ;;
  other-model)  # a 2-layer model's checkpoint in the place of step 4: refused naming --layers
    run "$dir/other.log" --out "$dir/other" --layers 2
    expect "the 2-layer run" zero "^checkpoint: step 4 -> " "$dir/other.log"
    rm -rf "${ck:?}/$s4"
    cp -r "$dir/other/checkpoint/$s4" "$ck/"
    expect_fallback=0
    regex=$(error "--layers: the checkpoint $ck/$s4 was saved with 2, this run has 4;") ;;
  other-names)  # re-signed: the library's own check (no tensor of this model)
    "$tamper" index "$ck/$s4/index.json" rename-prefix model/ other/
    expect_fallback=0
    regex=$(error "other-model: .*$s4 is a checkpoint of another model") ;;
  missing-tensor)  # re-signed: one parameter (and the model's others) present
    "$tamper" index "$ck/$s4/index.json" delete /tensors/model~1layer1.ffn.w2.weight
    expect_fallback=0
    regex=$(error "missing-tensor: .*$s4 has no tensor 'model/layer1.ffn.w2.weight'") ;;
  shape)  # re-signed: another global shape
    "$tamper" index "$ck/$s4/index.json" set /tensors/model~1norm.weight/shape '[255]'
    expect_fallback=0
    regex=$(error "shape-mismatch: .*'model/norm.weight' has global shape \\[255\\] in the checkpoint and \\[256\\] in the state") ;;
  flags)  # other numerics are the user's mistake, not damage: no fallback
    flags=(--lr 0.001)
    expect_fallback=0
    regex=$(error "--lr: the checkpoint $ck/$s4 was saved with 0.003, this run has 0.001;") ;;
  *) echo "$usage (unknown case $case_name)"; exit 2 ;;
esac

echo "== resume from the damaged checkpoint ($case_name)"
run "$dir/resume.log" --out "$out" --resume "${flags[@]}"
if [ "$expect_fallback" -eq 1 ]; then
  expect "$case_name" zero "$regex" "$dir/resume.log"
  expect "$case_name: resumed from step 2" zero "$resumed2" "$dir/resume.log"
  expect "$case_name: trained on" zero "^checkpoint: step 4 -> " "$dir/resume.log"
  same_run "$pristine" "$out" "$dir"
else
  expect "$case_name" 2 "$regex" "$dir/resume.log"
  if grep -q "^step \|^checkpoint: step" "$dir/resume.log"; then
    echo "FAIL: $case_name: trained or saved after the refusal"
    fail=1
  fi
fi
lines=$(grep -c "^fsdp-train: \(error\|fallback\)" "$dir/resume.log" || true)
if [ "$lines" -ne 1 ]; then
  echo "FAIL: $case_name: $lines lines of refusal/fallback messages, expected one"
  fail=1
fi
finish "train-ckpt-verify-check $case_name"
