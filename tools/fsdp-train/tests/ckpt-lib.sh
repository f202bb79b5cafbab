# Shared by tools/fsdp-train/tests/crash-check.sh, tools/fsdp-train/tests/ckpt-verify-check.sh,
# tools/fsdp-train/tests/resume-check.sh and tools/fsdp-train/tests/determinism-check.sh (sourced, not run). Env: MPIEXEC (default mpiexec), MPIEXEC_FLAGS, NP
# (default 2); the caller sets `train` (the fsdp-train binary) and `common`
# (an array of flags every run gets).

mpiexec="${MPIEXEC:-mpiexec}"
read -r -a mpiexec_flags <<<"${MPIEXEC_FLAGS:-}"
np="${NP:-2}"
fail=0

command -v h5diff >/dev/null || { echo "FAIL: h5diff not found (Debian package hdf5-tools)"; exit 1; }

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

# same_run <a> <b> <work>: loss.csv step,loss,grad_norm (shortest round-trip
# text: equal text = equal bits) and every checkpoint/rank<R>.h5 (h5diff:
# shards, AdamW state, attributes) identical.
same_run() {
  local a="$1" b="$2" work="$3" r fa fb
  cut -d, -f1-3 "$a/loss.csv" >"$work/a.txt"
  cut -d, -f1-3 "$b/loss.csv" >"$work/b.txt"
  if diff -u "$work/a.txt" "$work/b.txt"; then
    echo "ok: loss.csv step,loss,grad_norm identical ($(($(wc -l <"$work/a.txt") - 1)) steps)"
  else
    echo "FAIL: loss.csv differs between $a and $b (diff above)"
    fail=1
  fi
  for ((r = 0; r < np; ++r)); do
    fa="$a/checkpoint/rank$r.h5" fb="$b/checkpoint/rank$r.h5"
    if [ ! -f "$fa" ] || [ ! -f "$fb" ]; then
      echo "FAIL: missing $fa or $fb"
      fail=1
    elif h5diff -c "$fa" "$fb" >"$work/h5diff-rank$r.txt" 2>&1; then
      echo "ok: checkpoint/rank$r.h5 identical"
    else
      echo "FAIL: checkpoint/rank$r.h5 differs:"
      head -n 20 "$work/h5diff-rank$r.txt"
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
