#!/usr/bin/env bash
# fsdp-checkpoint against a real 2-rank checkpoint (dcp-make-checkpoint:
# steps 1 and 2, and an independent baseline of step 1):
#   inspect (text and --json) shows the tensors, verify says OK, a flipped
#   byte in a rank file makes verify exit 1 naming the tensor and the file,
#   export to .h5 equals the baseline (h5diff) and to .safetensors has the
#   right header and the baseline's exact bytes, diff of a checkpoint with
#   itself exits 0, with the next step's 1, and 0 again with --atol 1; bad
#   arguments exit 2. The tool itself runs without mpiexec.
#
#   tools/fsdp-checkpoint/tests/cli-check.sh <fsdp-checkpoint> <dcp-make-checkpoint> <dcp-flip-byte> <work dir>
#
# Env: MPIEXEC (default mpiexec), MPIEXEC_FLAGS. CTest runs it as
# fsdp_checkpoint_cli_np2.
set -uo pipefail
tool="${1:?usage: $0 <fsdp-checkpoint> <dcp-make-checkpoint> <dcp-flip-byte> <work dir>}"
make_ckpt="${2:?}" flip="${3:?}" work="${4:?}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mpiexec="${MPIEXEC:-mpiexec}"
read -r -a mpiexec_flags <<<"${MPIEXEC_FLAGS:-}"
fail=0
for t in h5diff h5ls h5dump python3; do
  command -v "$t" >/dev/null || { echo "FAIL: $t not found"; exit 1; }
done

# check <what> <expected status> <extended regex or ''> -- <command...>: runs
# the command (output shown indented and kept in $work/last.log), checks its
# exit status and that a line of its output matches.
check() {
  local what="$1" want="$2" regex="$3" rc
  shift 4
  echo "== $what: $*"
  timeout -k 5 120 "$@" >"$work/last.log" 2>&1
  rc=$?
  sed 's/^/    | /' "$work/last.log"
  if [ "$rc" -ne "$want" ]; then
    echo "FAIL: $what: exit status $rc, expected $want"
    fail=1
  elif [ -n "$regex" ] && ! grep -Eq -- "$regex" "$work/last.log"; then
    echo "FAIL: $what: no line of the output matches: $regex"
    fail=1
  else
    echo "ok: $what: exit status $rc${regex:+; output has: $(grep -E -m1 -- "$regex" "$work/last.log")}"
  fi
}

rm -rf "$work"
mkdir -p "$work"
root="$work/ckpt" base="$work/baseline"
s1="$root/step-000000000001" s2="$root/step-000000000002"

check "make the checkpoint (mpiexec -n 2, AdamW steps 1 and 2)" 0 "baseline of step 1: 20 tensors" -- \
  "$mpiexec" -n 2 "${mpiexec_flags[@]}" "$make_ckpt" "$root" "$base"
[ -f "$s1/index.json" ] && [ -f "$s2/index.json" ] || { echo "FAIL: no checkpoints under $root"; exit 1; }

# ---- inspect
check "inspect step 1" 0 "^step +1$" -- "$tool" inspect "$s1"
for row in 'model/fc1\.weight +param +float32 +\[7, 5\] +2 +140' \
           'model/fc2\.weight +param +float32 +\[3, 7\] +2 +84' \
           'model/scale +buffer +float32 +\[3\] +1 +12' \
           'optim/fc1\.weight/exp_avg_sq +optim +float32 +\[7, 5\] +2 +140' \
           'optim/fc2\.bias/step +optim +int64 +\[\] +1 +8' \
           'probe_bf16 +tensor +bfloat16 +\[2, 3\] +1 +12' \
           '__rank1/rng +rank_local +int64 +\[2\] +1 +16' \
           '^world size +2 ' 'optim: AdamW over .model.' 'lr=0.01' \
           'note +string +"fsdp-checkpoint test"' '^  cursor +\[1,11\]$' \
           '^total: 20 tensors, 32 pieces, 880 bytes'; do
  if grep -Eq -- "$row" "$work/last.log"; then echo "ok: inspect shows: $row"
  else echo "FAIL: inspect: no line matches: $row"; fail=1; fi
done
check "inspect the root (its newest checkpoint, step 2)" 0 "^checkpoint +.*step-000000000002$" -- \
  "$tool" inspect "$root"
check "inspect --json" 0 '"world_size": 2' -- "$tool" inspect "$s1" --json
cp "$work/last.log" "$work/inspect.json"
check "inspect --json parses, with the same tensors" 0 "^json ok" -- python3 -c '
import json, sys
j = json.load(open(sys.argv[1]))
t = {x["name"]: x for x in j["tensors"]}
assert j["step"] == 1 and j["format_version"] == 1, j
assert len(t) == 20 and j["totals"] == {"tensors": 20, "pieces": 32, "bytes": 880}, j["totals"]
assert t["model/fc1.weight"] == {"name": "model/fc1.weight", "kind": "param", "dtype": "float32",
                                 "shape": [7, 5], "pieces": 2, "bytes": 140}, t["model/fc1.weight"]
assert j["values"] == {"lr": 0.01, "note": "fsdp-checkpoint test", "step": 1}, j["values"]
assert j["rank_values"] == {"cursor": [1, 11]}, j["rank_values"]
assert j["optimizers"]["optim"]["type"] == "AdamW"
print("json ok:", len(t), "tensors")' "$work/inspect.json"

# ---- verify
check "verify step 1" 0 "^OK .*step-000000000001: 20 tensors, 880 bytes verified$" -- "$tool" verify "$s1"
check "verify a directory that is not a checkpoint" 2 "fsdp-checkpoint: error: <dir>: not-found: " -- \
  "$tool" verify "$work"
damaged="$work/damaged/step-000000000001"
mkdir -p "$work/damaged"
cp -r "$s1" "$damaged"
# The piece of model/fc1.weight that rank 1 wrote (its dataset from the index).
dataset=$(python3 -c '
import json, sys
for c in json.load(open(sys.argv[1]))["tensors"]["model/fc1.weight"]["chunks"]:
    if c["file"] == "rank-00001.h5": print(c["dataset"])' "$damaged/index.json")
check "flip a byte of $dataset in rank-00001.h5" 0 "^flipped the byte" -- "$flip" "$damaged/rank-00001.h5" "$dataset"
check "verify the damaged copy" 1 "^model/fc1\.weight .*rank-00001\.h5.*checksum" -- "$tool" verify "$damaged"
if grep -Eq "^FAILED .*: 1 problem$" "$work/last.log"; then echo "ok: exactly one problem reported"
else echo "FAIL: verify should report exactly one problem"; fail=1; fi
check "export of the damaged copy" 3 "fsdp-checkpoint: error: .*damaged/step-000000000001: corrupt: .*model/fc1\.weight.*rank-00001\.h5" -- \
  "$tool" export "$damaged" --to "$work/damaged.h5"
[ -e "$work/damaged.h5" ] || [ -e "$work/damaged.h5.partial" ] &&
  { echo "FAIL: a failed export left a file behind"; fail=1; }
check "diff with the damaged copy" 3 "fsdp-checkpoint: error: .*damaged/step-000000000001: corrupt: " -- "$tool" diff "$s1" "$damaged"
cp -r "$s1" "$work/damaged/step-000000000007"
sed -i 's/"step": 1,/"step": 7,/' "$work/damaged/step-000000000007/index.json"
check "verify a checkpoint whose index was edited" 1 "checksum mismatch" -- \
  "$tool" verify "$work/damaged/step-000000000007"

# ---- export to HDF5: h5diff against the baseline (exact values)
check "export step 1 to .h5" 0 "^exported 18 tensors \(848 bytes\)" -- "$tool" export "$s1" --to "$work/step1.h5"
for obj in /model /optim /probe_bf16; do
  check "h5diff $obj against the baseline" 0 "" -- h5diff "$work/step1.h5" "$base/baseline.h5" "$obj" "$obj"
done
if h5ls -r "$work/step1.h5" | grep -q __rank; then echo "FAIL: rank-local tensors exported without --include-rank-local"; fail=1
else echo "ok: no rank-local tensors in step1.h5"; fi
check "step1.h5: root attribute step" 0 "\(0\): 1$" -- h5dump -a /step "$work/step1.h5"
check "step1.h5: probe_bf16 exported as float32, optim/fc1.bias/step a scalar" 0 "" -- bash -c \
  "h5ls -v '$work/step1.h5/probe_bf16' | grep -q 'Type: *native float' &&
   h5ls '$work/step1.h5/optim/fc1.bias/step' | grep -q 'Dataset {SCALAR}'"
check "export --include-rank-local to .h5" 0 "^exported 20 tensors" -- \
  "$tool" export "$s1" --to "$work/all.h5" --include-rank-local
for obj in /__rank0 /__rank1; do
  check "h5diff $obj against the baseline" 0 "" -- h5diff "$work/all.h5" "$base/baseline.h5" "$obj" "$obj"
done

# ---- export to safetensors: header and exact bytes
check "export step 1 to .safetensors" 0 "^exported 18 tensors" -- \
  "$tool" export "$s1" --to "$work/step1.safetensors"
check "step1.safetensors against the baseline" 0 "^safetensors OK" -- \
  python3 "$here/check-safetensors.py" "$work/step1.safetensors" "$base" 1
check "export --include-rank-local to .safetensors" 0 "^exported 20 tensors" -- \
  "$tool" export "$root" --to "$work/all.safetensors" --include-rank-local
# (the root: its newest checkpoint is step 2, not the baseline's step)
check "export --only model/fc1 --only probe_bf16" 0 "^exported 3 tensors" -- \
  "$tool" export "$s1" --to "$work/fc1.safetensors" --only model/fc1 --only probe_bf16
check "fc1.safetensors holds just those" 0 "^names ok" -- python3 -c '
import json, struct, sys
d = open(sys.argv[1], "rb").read()
h = json.loads(d[8:8 + struct.unpack("<Q", d[:8])[0]])
names = sorted(k for k in h if k != "__metadata__")
assert names == ["model/fc1.bias", "model/fc1.weight", "probe_bf16"], names
print("names ok:", names)' "$work/fc1.safetensors"

# ---- diff
check "diff step 1 with itself" 0 "^SAME: tensors: 20 identical" -- "$tool" diff "$s1" "$s1"
check "diff step 1 with step 2" 1 "^DIFFERENT: tensors: 1 identical, 0 within tolerance, 19 beyond" -- "$tool" diff "$s1" "$s2"
for row in '^differs: model/fc1\.weight float32 \[7, 5\]: max \|a - b\| ' \
           '^differs: optim/fc1\.weight/step int64 \[\]: max \|a - b\| 1, 1 of 1 elements differ' \
           '^differs: value step: A 1, B 2$'; do
  if grep -Eq -- "$row" "$work/last.log"; then echo "ok: diff shows: $row"
  else echo "FAIL: diff: no line matches: $row"; fail=1; fi
done
check "diff step 1 with step 2 --atol 1" 0 "^SAME: tensors: 1 identical, 19 within tolerance" -- \
  "$tool" diff "$s1" "$s2" --atol 1
check "diff --rtol -1" 2 "--rtol" -- "$tool" diff "$s1" "$s2" --rtol -1

# ---- bad arguments
check "export --to an unknown format" 2 "^fsdp-checkpoint: error: --to .*out\.txt: unknown format" -- \
  "$tool" export "$s1" --to "$work/out.txt"
check "export --only a prefix nothing is under" 2 "^fsdp-checkpoint: error: --only nosuch: " -- \
  "$tool" export "$s1" --to "$work/x.h5" --only nosuch
check "export --to a directory that does not exist" 2 "^fsdp-checkpoint: error: --to .*nodir/x\.h5: " -- \
  "$tool" export "$s1" --to "$work/nodir/x.h5"
check "inspect without a directory" 2 "dir is required" -- "$tool" inspect
check "--help documents the exit statuses" 0 "^Exit status:" -- "$tool" --help

if [ "$fail" -ne 0 ]; then
  echo "fsdp-checkpoint cli-check: FAILED"
  exit 1
fi
echo "fsdp-checkpoint cli-check: all checks passed"
