#!/usr/bin/env bash
# fsdp-train --resume and damaged or foreign checkpoints (fsdp::dcp,
# docs/distributed_checkpoint.md): each case ends either in a fallback to the
# older checkpoint, printed ("fsdp-train: fallback: skipped <newest>: <why>")
# and then trained on to the same bits as the run that was never damaged, or
# in one typed error message with exit status 2 and no training -- on every
# rank, never a hang (each job at most 60 s), never training on bad data.
# Where a case gives one, `fsdp-checkpoint verify` of the damaged checkpoint
# must fail too (exit 1, within 30 s, naming the problem): it runs every
# check a load runs.
#
#   tools/fsdp-train/tests/ckpt-verify-check.sh <fsdp-train> <train-ckpt-tamper> <fsdp-checkpoint> <work dir> setup
#   tools/fsdp-train/tests/ckpt-verify-check.sh <fsdp-train> <train-ckpt-tamper> <fsdp-checkpoint> <work dir> <case>
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
#   untrusted input (docs/distributed_checkpoint.md#loading-checkpoints-you-did-not-write),
#   each with a consistent, re-signed index where the index is edited:
#     falls back: path-relative (rank 1's chunks and "files" entry name
#     ../step-...02/rank-00001.h5), path-absolute (they name an absolute
#     path outside, a FIFO there: opening it would hang the job), unlisted
#     (chunks name rank-00007.h5, a copy not in "files"), symlink-out
#     (rank-00001.h5 a link to the real file moved outside), fifo (a FIFO in
#     its place), dev-zero (a character device in its place), huge-shape (a
#     shape of 2^80 elements), negative-offset, overlap (two chunks at the
#     same offsets), nan (a NaN written through HDF5: checksums right),
#     no-index (index.json deleted: noted, not skipped silently)
#     dtype-wider (float64 in the index over float32 data: more bytes than
#     the rank file holds)
#     refused, exit 2: dtype (int32 in the index over float32 data: the
#     state's float32 refuses it; verify finds the stored type differs)
# The damage goes into rank 1's file where a rank file is damaged: rank 0
# prints the agreed verdict.
# Env: as tools/fsdp-train/tests/check-lib.sh says (MPIEXEC, MPIEXEC_FLAGS, NP).
set -euo pipefail
usage="usage: $0 <fsdp-train> <train-ckpt-tamper> <fsdp-checkpoint> <work dir> setup|<case>"
train="${1:?$usage}"
tamper="${2:?$usage}"
inspector="${3:?$usage}"
work="${4:?$usage}"
case_name="${5:?$usage}"
common=(--seq 64 --batch 4 --seed 7 --steps 4 --checkpoint-every 2)
# shellcheck source=tools/fsdp-train/tests/check-lib.sh
source "$(dirname "$0")/check-lib.sh"
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
verify_regex=""  # when set: fsdp-checkpoint verify of step 4 must exit 1 with a line matching it
idx="$ck/$s4/index.json"
embed='/tensors/model~1embed.weight'
outside="$dir/outside"
mkdir -p "$outside"
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
  shape)  # re-signed: another global shape, its chunks cut to match (else the index is corrupt)
    "$tamper" index "$ck/$s4/index.json" set /tensors/model~1norm.weight/shape '[255]'
    "$tamper" index "$ck/$s4/index.json" set /tensors/model~1norm.weight/chunks/1/sizes '[127]'
    expect_fallback=0
    regex=$(error "shape-mismatch: .*'model/norm.weight' has global shape \\[255\\] in the checkpoint and \\[256\\] in the state") ;;
  flags)  # other numerics are the user's mistake, not damage: no fallback
    flags=(--lr 0.001)
    expect_fallback=0
    regex=$(error "--lr: the checkpoint $ck/$s4 was saved with 0.003, this run has 0.001;") ;;
  path-relative)  # step 2's real file, by a path that leaves the directory
    "$tamper" index "$idx" rename-file rank-00001.h5 ../$s2/rank-00001.h5
    why="\"files\" lists '\\.\\./$s2/rank-00001\\.h5', which is not a rank file of this checkpoint"
    regex=$(fallback ".*$why")
    verify_regex="$why" ;;
  path-absolute)  # a FIFO outside: a loader that opened it would never return
    mkfifo "$outside/rank-00001.h5"
    "$tamper" index "$idx" rename-file rank-00001.h5 "$outside/rank-00001.h5"
    why="\"files\" lists '$outside/rank-00001\\.h5', which is not a rank file of this checkpoint"
    regex=$(fallback ".*$why")
    verify_regex="$why" ;;
  unlisted)  # a well-formed name the index does not list
    cp "$ck/$s4/rank-00001.h5" "$ck/$s4/rank-00007.h5"
    "$tamper" index "$idx" rename-chunks rank-00001.h5 rank-00007.h5
    why="chunk [0-9]+ names file 'rank-00007\\.h5', which is not one of the rank files the index lists"
    regex=$(fallback ".*'model/[^']+' $why")
    verify_regex="$why" ;;
  symlink-out)  # the right bytes, but outside the checkpoint
    mv "$ck/$s4/rank-00001.h5" "$outside/"
    ln -s "$outside/rank-00001.h5" "$ck/$s4/rank-00001.h5"
    why="rank file 'rank-00001\\.h5' is a symbolic link to [^ ]*/rank-00001\\.h5, outside the checkpoint directory"
    regex=$(fallback "(rank [0-9]+: )?$ck/$s4: $why")
    verify_regex="$why" ;;
  fifo)
    rm "$ck/$s4/rank-00001.h5"
    mkfifo "$ck/$s4/rank-00001.h5"
    why="rank file 'rank-00001\\.h5' is a FIFO, not a regular file"
    regex=$(fallback "(rank [0-9]+: )?$ck/$s4: $why")
    verify_regex="$why" ;;
  dev-zero)  # /dev/zero's device in its place: reading it would never end
    rm "$ck/$s4/rank-00001.h5"
    if mknod "$ck/$s4/rank-00001.h5" c 1 5 2>"$dir/mknod.err"; then
      why="rank file 'rank-00001\\.h5' is a character device, not a regular file"
    else  # not root, or a nodev file system: a link to it, which also leaves the directory
      echo "note: mknod failed ($(cat "$dir/mknod.err")); using a symbolic link to /dev/zero"
      ln -s /dev/zero "$ck/$s4/rank-00001.h5"
      why="rank file 'rank-00001\\.h5' is a symbolic link to /dev/zero, outside the checkpoint directory"
    fi
    regex=$(fallback "(rank [0-9]+: )?$ck/$s4: $why")
    verify_regex="$why" ;;
  huge-shape)  # 2^80 elements: refused before anything is allocated
    "$tamper" index "$idx" set "$embed/shape" '[1099511627776, 1099511627776]'
    why="'model/embed\\.weight' claims shape \\[1099511627776, 1099511627776\\] of Float, more bytes than its rank files hold"
    regex=$(fallback ".*$why")
    verify_regex="$why" ;;
  negative-offset)
    "$tamper" index "$idx" set "$embed/chunks/0/offsets/0" '-1'
    why="'model/embed\\.weight' chunk 0 \\[-1:[0-9]+, 0:[0-9]+\\] is not inside its global shape"
    regex=$(fallback ".*$why")
    verify_regex="$why" ;;
  overlap)  # chunk 1 moved onto chunk 0
    "$tamper" index "$idx" set "$embed/chunks/1/offsets" '[0, 0]'
    why="the chunks \\[0:[0-9]+, 0:[0-9]+\\] and \\[0:[0-9]+, 0:[0-9]+\\] of 'model/embed\\.weight' overlap"
    regex=$(fallback ".*$why")
    verify_regex="$why" ;;
  nan)  # right checksums, wrong numbers
    "$tamper" nan "$ck/$s4/rank-00001.h5" "/model/$param"
    regex=$(fallback "(rank [0-9]+: )?'model/$param' holds 1 non-finite value")
    verify_regex="^model/embed\\.weight .*: corrupt: 1 non-finite value\\(s\\) .*\\[a load falls back" ;;
  no-index)  # an incomplete copy: skipped, and said so
    rm "$ck/$s4/index.json"
    regex=$(fallback "no index\\.json \\(incomplete or damaged\\)") ;;
  dtype)  # int32 in the index over float32 data (the same bytes): the state's dtype refuses it
    "$tamper" index "$idx" set "$embed/dtype" '"int32"'
    expect_fallback=0
    regex=$(error "dtype-mismatch: .*'model/embed\\.weight' is int32 in the checkpoint and float32 in the state")
    verify_regex="^model/embed\\.weight .*: corrupt: .*stores another element type .* than the index's int32" ;;
  dtype-wider)  # float64 over float32 data: more bytes than the rank file holds
    "$tamper" index "$idx" set "$embed/dtype" '"float64"'
    why="the chunks in 'rank-0000[01]\\.h5' \\(up to '[^']+'\\) hold more bytes of data than \"files\" gives it"
    regex=$(fallback ".*$why")
    verify_regex="$why" ;;
  *) echo "$usage (unknown case $case_name)"; exit 2 ;;
esac

if [ -n "$verify_regex" ]; then
  echo "== fsdp-checkpoint verify of the damaged checkpoint ($case_name)"
  set +e
  timeout -k 5 30 "$inspector" verify "$ck/$s4" >"$dir/verify.log" 2>&1
  vrc=$?
  set -e
  sed 's/^/    | /' "$dir/verify.log"
  if [ "$vrc" -ne 1 ]; then
    echo "FAIL: $case_name: verify exit status $vrc, expected 1 (124: it hung)"
    fail=1
  elif ! grep -Eq -- "$verify_regex" "$dir/verify.log" || ! grep -q "^FAILED " "$dir/verify.log"; then
    echo "FAIL: $case_name: verify's output has no FAILED line or no line matching: $verify_regex"
    fail=1
  else
    echo "ok: $case_name: verify exit 1: $(grep -E -m1 -- "$verify_regex" "$dir/verify.log")"
  fi
fi

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
