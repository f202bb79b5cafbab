# Shared by tools/fsdp-train/tests/crash-check.sh, tools/fsdp-train/tests/ckpt-verify-check.sh,
# tools/fsdp-train/tests/resume-check.sh and tools/fsdp-train/tests/determinism-check.sh (sourced, not run). Env: MPIEXEC (default mpiexec), MPIEXEC_FLAGS, NP
# (default 2); the caller sets `train` (the fsdp-train binary) and `common`
# (an array of flags every run gets).

mpiexec="${MPIEXEC:-mpiexec}"
read -r -a mpiexec_flags <<<"${MPIEXEC_FLAGS:-}"
np="${NP:-2}"
fail=0

command -v h5diff >/dev/null || { echo "FAIL: h5diff not found (Debian package hdf5-tools)"; exit 1; }
command -v python3 >/dev/null || { echo "FAIL: python3 not found"; exit 1; }

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

# finish <name>: ends the script, status 1 if anything failed.
finish() {
  if [ "$fail" -ne 0 ]; then
    echo "$1: FAILED"
    exit 1
  fi
  echo "$1: PASSED"
  exit 0
}
