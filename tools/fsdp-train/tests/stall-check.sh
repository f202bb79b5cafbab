#!/usr/bin/env bash
# A training job with a stopped rank must end by itself: starts fsdp-train on
# NP ranks, waits until it has logged two steps, stops one rank with SIGSTOP
# (as a debugger, a swapped-out node or a hung driver would), and checks that
# the library's watchdog ends the job within FSDP_TIMEOUT + 10 s, with a
# non-zero exit status and a report naming the stuck collective.
#
# With FSDP_TRAIN_STALL_AT=<point>@<step> set (fsdp-train's test hook), the
# last rank stops itself at that point instead, so the peers wait in a chosen
# place (the driver's loss average, a checkpoint agreement) rather than
# wherever the signal happens to land.
#
#   tools/fsdp-train/tests/stall-check.sh <fsdp-train> <work dir> [extra fsdp-train flags]
#
# Env: MPIEXEC (default mpiexec), MPIEXEC_FLAGS, NP (default 2), FSDP_TIMEOUT (default 5),
# FSDP_TRAIN_STALL_AT (unset). CTest runs it as fsdp_train_stall_np2 and
# fsdp_train_stall_{optimizer,save}_np2.
set -uo pipefail
train="${1:?usage: $0 <fsdp-train> <work dir> [flags]}"
work="${2:?usage: $0 <fsdp-train> <work dir> [flags]}"
shift 2
source "$(dirname "${BASH_SOURCE[0]}")/check-lib.sh"
export FSDP_TIMEOUT="${FSDP_TIMEOUT:-5}"
fresh_dir "$work"
log="$work/job.log"

"$mpiexec" -n "$np" "${mpiexec_flags[@]}" "$train" --steps 100000 --seq 64 --batch 4 --log-every 1 \
  --out "$work/out" "$@" > "$log" 2>&1 &
job=$!
fail() { echo "FAIL: $*"; cat "$log"; kill -9 "$job" 2>/dev/null; pkill -9 -P "$job" 2>/dev/null; exit 1; }

# The ranks: fsdp-train processes writing to this run's --out (children of
# mpiexec, or of slurmstepd under srun).
ranks() {
  local p
  for p in $(pgrep -f -- "--out $work/out" || true); do
    [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$(basename "$train" | cut -c1-15)" ] && echo "$p"
  done
}
if [ -n "${FSDP_TRAIN_STALL_AT:-}" ]; then
  victim=""
  for _ in $(seq 1 600); do  # up to 60 s for start-up and the hook's step
    for pid in $(ranks); do
      [[ "$(ps -o stat= -p "$pid" 2>/dev/null)" == T* ]] && victim=$pid
    done
    [ -n "$victim" ] && break
    kill -0 "$job" 2>/dev/null || fail "the job ended before a rank stopped itself"
    sleep 0.1
  done
  [ -n "$victim" ] || fail "no rank stopped itself within 60 s (FSDP_TRAIN_STALL_AT=$FSDP_TRAIN_STALL_AT)"
  echo "== rank process $victim stopped itself (FSDP_TRAIN_STALL_AT=$FSDP_TRAIN_STALL_AT); FSDP_TIMEOUT=$FSDP_TIMEOUT"
else
  for _ in $(seq 1 600); do  # up to 60 s for start-up and two steps
    [ -f "$work/out/loss.csv" ] && [ "$(wc -l < "$work/out/loss.csv")" -ge 3 ] && break
    kill -0 "$job" 2>/dev/null || fail "the job ended before training started"
    sleep 0.1
  done
  [ "$(wc -l < "$work/out/loss.csv" 2>/dev/null || echo 0)" -ge 3 ] || fail "no two steps within 60 s"
  victim=$(ranks | tail -n 1)
  [ -n "$victim" ] || fail "no rank process of the job found (--out $work/out)"
  echo "== stopping rank process $victim (SIGSTOP); FSDP_TIMEOUT=$FSDP_TIMEOUT"
  kill -STOP "$victim"
fi
stopped=$SECONDS
limit=$((FSDP_TIMEOUT + 10))
while kill -0 "$job" 2>/dev/null; do
  if [ $((SECONDS - stopped)) -gt $((limit + 30)) ]; then
    kill -CONT "$victim"
    fail "the job still runs $((SECONDS - stopped)) s after the stop"
  fi
  sleep 0.2
done
wait "$job"
rc=$?
elapsed=$((SECONDS - stopped))
cat "$log"
echo "== the job ended $elapsed s after the stop, exit status $rc"
# mpirun's SIGKILL reaches the stopped process as the job ends; allow it a
# few seconds to be reaped (a zombie counts as gone).
for _ in $(seq 1 50); do
  state=$(ps -o stat= -p "$victim" 2>/dev/null || true)
  [ -z "$state" ] || [[ "$state" == Z* ]] && break
  sleep 0.2
done
state=$(ps -o stat= -p "$victim" 2>/dev/null || true)
if [ -n "$state" ] && [[ "$state" != Z* ]]; then
  kill -9 "$victim"
  fail "the stopped rank (state $state) outlived the job by 10 s"
fi
[ "$rc" -ne 0 ] || fail "exit status 0"
[ "$elapsed" -le "$limit" ] || fail "took $elapsed s, more than FSDP_TIMEOUT + 10 = $limit s"
grep -Eq '\[libfsdp watchdog\] rank [0-9]+ of [0-9]+: [a-z_]+ on ranks\[[0-9,]+\] #[0-9]+ \((mpi|nccl)\), [0-9]+ B.*not complete after [0-9.]+ s \(FSDP_TIMEOUT\)' "$log" \
  || fail "no watchdog report naming the collective"
grep -q 'aborting the job (MPI_Abort, exit status 124)' "$log" || fail "no abort line"
echo "PASS: stopped rank -> watchdog abort in $elapsed s (limit $limit s)"
