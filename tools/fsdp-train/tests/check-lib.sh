# The set-up and checks every shell check of fsdp-train shares (sourced, not
# run): tools/fsdp-train/tests/*-check.sh and, through slurm-lib.sh,
# ci/slurm/tests/*-check.sh. Env: MPIEXEC (default mpiexec), MPIEXEC_FLAGS,
# NP (default 2); the caller sets `train` (the fsdp-train binary) and
# `common` (an array of flags every run gets).

mpiexec="${MPIEXEC:-mpiexec}"
read -r -a mpiexec_flags <<<"${MPIEXEC_FLAGS:-}"
np="${NP:-2}"
fail=0

command -v h5diff >/dev/null || { echo "FAIL: h5diff not found (Debian package hdf5-tools)"; exit 1; }
command -v python3 >/dev/null || { echo "FAIL: python3 not found"; exit 1; }

# secs_since <t0 from date +%s%N>: "S.T" seconds
secs_since() {
  local ms=$((($(date +%s%N) - $1) / 1000000))
  echo "$((ms / 1000)).$((ms % 1000 / 100))"
}

# fresh_dir <dir>: <dir> empty (removed with whatever a former run left).
fresh_dir() {
  rm -rf "$1"
  mkdir -p "$1"
}

# run <log> [flags...]: one fsdp-train job, at most 60 s (a hang is a
# failure, not a stuck CI job); output to <log> and to ours; sets $rc and
# $secs.
# A job that needs the whole 60 s is a failure (timeout's status alone
# cannot tell a hang from the crash hook's SIGKILL).
run() {
  local log="$1" t0 ms
  shift
  t0=$(date +%s%N)
  set +e
  timeout -k 5 60 "$mpiexec" -n "$np" "${mpiexec_flags[@]}" "$train" "${common[@]}" "$@" >"$log" 2>&1
  rc=$?
  set -e
  ms=$((($(date +%s%N) - t0) / 1000000))
  secs="$((ms / 1000)).$((ms % 1000 / 100))"
  sed 's/^/    | /' "$log"
  echo "    (exit status $rc, ${secs}s)"
  if [ "$ms" -ge 60000 ]; then
    echo "FAIL: the job did not end within 60 s (a rank waiting for another?)"
    fail=1
  fi
}

# expect <what> <zero|nonzero|N> <extended regex> <log>: the last run's exit
# status and one line of its output.
expect() {
  local what="$1" want="$2" regex="$3" log="$4" ok=1
  case "$want" in
    zero) [ "$rc" -eq 0 ] || ok=0 ;;
    nonzero) [ "$rc" -ne 0 ] || ok=0 ;;
    *) [ "$rc" -eq "$want" ] || ok=0 ;;
  esac
  if [ "$ok" -eq 0 ]; then
    echo "FAIL: $what: exit status $rc, expected $want"
    fail=1
  fi
  if grep -Eq -- "$regex" "$log"; then
    echo "ok: $what: exit status $rc; output has: $(grep -E -m1 -- "$regex" "$log")"
  else
    echo "FAIL: $what: no line of the output matches: $regex"
    fail=1
  fi
}

# newest <out>: the newest complete checkpoint under <out>/checkpoint/ (a
# step-<12 digits> directory holding index.json; docs/distributed_checkpoint.md).
newest() {
  local d last=""
  for d in "$1"/checkpoint/step-[0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9]; do
    [ -f "$d/index.json" ] && last="$d"
  done
  echo "$last"
}

# same_run <a> <b> <work>: loss.csv step,loss,grad_norm (shortest round-trip
# text: equal text = equal bits) and the newest checkpoint of each -- the
# same step, index.json but its creation time and checksum, and every
# rank-<R>.h5 (h5diff: every piece of the parameters and the AdamW state)
# identical.
same_run() {
  local a="$1" b="$2" work="$3" ca cb fa fb name
  cut -d, -f1-3 "$a/loss.csv" >"$work/a.txt"
  cut -d, -f1-3 "$b/loss.csv" >"$work/b.txt"
  if diff -u "$work/a.txt" "$work/b.txt"; then
    echo "ok: loss.csv step,loss,grad_norm identical ($(($(wc -l <"$work/a.txt") - 1)) steps)"
  else
    echo "FAIL: loss.csv differs between $a and $b (diff above)"
    fail=1
  fi
  ca=$(newest "$a") cb=$(newest "$b")
  if [ -z "$ca" ] || [ -z "$cb" ] || [ "$(basename "$ca")" != "$(basename "$cb")" ]; then
    echo "FAIL: newest checkpoints differ or are missing: '$ca' and '$cb'"
    fail=1
    return
  fi
  # index.json without its timestamp and checksum, keys sorted (python3's json:
  # the standard library only).
  local strip='import json,sys; d=json.load(open(sys.argv[1])); d.pop("created",None); d.pop("checksum",None); print(json.dumps(d,sort_keys=True,indent=1))'
  python3 -c "$strip" "$ca/index.json" >"$work/index-a.json"
  python3 -c "$strip" "$cb/index.json" >"$work/index-b.json"
  if diff -q "$work/index-a.json" "$work/index-b.json" >/dev/null; then
    echo "ok: $(basename "$ca")/index.json identical (but its creation time)"
  else
    echo "FAIL: $(basename "$ca")/index.json differs:"
    diff "$work/index-a.json" "$work/index-b.json" | head -n 20
    fail=1
  fi
  for fa in "$ca"/rank-*.h5; do
    name=$(basename "$fa") fb="$cb/$(basename "$fa")"
    if [ ! -f "$fb" ]; then
      echo "FAIL: missing $fb"
      fail=1
    elif h5diff -c "$fa" "$fb" >"$work/h5diff-$name.txt" 2>&1; then
      echo "ok: $(basename "$ca")/$name identical"
    else
      echo "FAIL: $(basename "$ca")/$name differs:"
      head -n 20 "$work/h5diff-$name.txt"
      fail=1
    fi
  done
}

# compare_resumed_losses <what> <resumed loss.csv> <reference loss.csv> <from> <to> <tol>:
# steps from+1..to of the resumed run against the reference run, each within
# <tol> relative (a resumed run in another layout reorders fp32 reductions:
# reshard-check.sh says why 1e-4); prints the observed maxima, sets fail=1 on
# a step over <tol> or missing.
compare_resumed_losses() {
  local what="$1" resumed="$2" ref="$3" from="$4" to="$5" tol="$6" verdict
  verdict=$(awk -F, -v n="$from" -v total="$to" -v tol="$tol" '
    FNR == 1 { next }
    NR == FNR { r[$1] = $2; next }
    $1 > n && $1 <= total {
      if (!($1 in r)) { missing = missing " " $1; next }
      d = r[$1] - $2; if (d < 0) d = -d
      rel = d / ($2 < 0 ? -$2 : $2)
      if (d > maxd) maxd = d
      if (rel > maxr) maxr = rel
      count++
    }
    END {
      ok = (missing == "" && count == total - n && maxr <= tol)
      printf "%s max |loss diff| %.3g, max relative %.3g over %d resumed steps (tolerance %g relative)%s\n", ok ? "ok" : "FAIL", maxd, maxr, count, tol, missing == "" ? "" : ", missing steps" missing
    }' "$resumed" "$ref")
  echo "${verdict%% *}: $what: ${verdict#* }"
  [ "${verdict%% *}" = ok ] || fail=1
}

# finish <name>: ends the script, status 1 if anything failed.
finish() {
  if [ "$fail" -ne 0 ]; then
    echo "$1: FAILED"
    exit 1
  fi
  echo "$1: PASSED"
  exit 0
}
