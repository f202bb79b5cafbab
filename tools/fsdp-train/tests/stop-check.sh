#!/usr/bin/env bash
# Checks fsdp-train's graceful stop (docs/graceful_stop.md): SIGTERM to ONE
# rank mid-run (what Slurm's scancel, preemption and time limit send) makes
# every rank stop at the next step boundary; the job exits 75
# (fsdp::kStoppedExitCode) within 30 s of the signal with a complete
# checkpoint of the last step it trained, and `--resume` finishes with
# loss.csv and the final checkpoint bitwise those of an uninterrupted run
# (no step lost, none trained twice). SIG (default TERM) picks the signal.
# B runs as a Slurm job would see itself (SLURM_JOB_ID, ... in the
# environment; restart 0, then 1 for the resume, as after a requeue): the
# first log line and <out>/runs.jsonl must record them. Under srun (MPIEXEC
# is srun: cmake/Launcher.cmake) the job is a real one: its own id and node
# list are expected, and only the restart count is set here.
#
#   tools/fsdp-train/tests/stop-check.sh <fsdp-train> <work dir> [extra fsdp-train flags]
#
# Env: MPIEXEC, MPIEXEC_FLAGS, NP (default 2), STEPS (default 40), SIG.
set -euo pipefail
train="${1:?usage: $0 <fsdp-train> <work dir> [flags]}"
work="${2:?usage: $0 <fsdp-train> <work dir> [flags]}"
shift 2
source "$(dirname "${BASH_SOURCE[0]}")/check-lib.sh"
steps="${STEPS:-40}"
sig="${SIG:-TERM}"
common=(--seq 64 --batch 4 --seed 7 "$@")

fresh_dir "$work"
a="$work/straight" b="$work/stopped"

echo "== A: $steps steps straight"
run "$work/a.log" --steps "$steps" --out "$a"
expect "uninterrupted run" zero "^trained $steps steps" "$work/a.log"

echo "== B: the same, SIG$sig to the last rank once 3 steps are logged"
if [ "$(basename "$mpiexec")" = srun ]; then
  job_id="${SLURM_JOB_ID:?srun outside an allocation}" node_list="${SLURM_JOB_NODELIST:?}"
  export SLURM_RESTART_COUNT=0
else
  job_id=4242 node_list='sim[1-2]'
  export SLURM_JOB_ID=$job_id SLURM_STEP_ID=0 SLURM_JOB_NODELIST=$node_list SLURM_RESTART_COUNT=0
fi
set +e
timeout -k 5 120 "$mpiexec" -n "$np" "${mpiexec_flags[@]}" "$train" "${common[@]}" \
  --steps "$steps" --out "$b" >"$work/b.log" 2>&1 &
job=$!
set -e
t_end=$((SECONDS + 60))
until [ -f "$b/loss.csv" ] && [ "$(wc -l <"$b/loss.csv")" -ge 4 ]; do
  if ! kill -0 "$job" 2>/dev/null || [ "$SECONDS" -ge "$t_end" ]; then
    echo "FAIL: job B ended or stalled before 3 steps were logged"
    sed 's/^/    | /' "$work/b.log"
    exit 1
  fi
  sleep 0.05
done
# The ranks: mpiexec's children running fsdp-train (not mpiexec itself).
victim=""
for p in $(pgrep -f -- "--out $b" || true); do
  [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "fsdp-train" ] && victim="$p"
done
[ -n "$victim" ] || { echo "FAIL: no fsdp-train rank of job B found"; exit 1; }
t0=$(date +%s%N)
kill "-$sig" "$victim"
echo "    SIG$sig sent to rank pid $victim at step $(($(wc -l <"$b/loss.csv") - 1))"
set +e
wait "$job"
rc=$?
set -e
ms=$((($(date +%s%N) - t0) / 1000000))
sed 's/^/    | /' "$work/b.log"
echo "    (exit status $rc, $((ms / 1000)).$((ms % 1000 / 100))s after the signal)"
expect "stopped run" 75 \
  "^fsdp-train: stopped by signal [0-9]+ \([^)]+\) at step [0-9]+ of $steps: checkpoint .* complete" \
  "$work/b.log"
if [ "$ms" -gt 30000 ]; then
  echo "FAIL: the job took ${ms} ms to stop after the signal (Slurm's KillWait is 30 s)"
  fail=1
fi
stopped=$(sed -nE "s/^fsdp-train: stopped by .* at step ([0-9]+) of .*/\1/p" "$work/b.log")
ckpt=$(newest "$b")
if [ -z "$stopped" ] || [ "$(basename "$ckpt")" != "$(printf 'step-%012d' "$stopped")" ]; then
  echo "FAIL: the newest complete checkpoint is '$ckpt', expected step $stopped's"
  fail=1
else
  echo "ok: $ckpt is complete (index.json written) at the step the job stopped"
fi
rows=$(($(wc -l <"$b/loss.csv") - 1))
[ "$rows" = "$stopped" ] || { echo "FAIL: loss.csv has $rows rows, stopped at $stopped"; fail=1; }

echo "== B: --resume to $steps (restart 1)"
SLURM_RESTART_COUNT=1 run "$work/resume.log" --steps "$steps" --out "$b" --resume
unset SLURM_RESTART_COUNT
[ "$(basename "$mpiexec")" = srun ] || unset SLURM_JOB_ID SLURM_STEP_ID SLURM_JOB_NODELIST
node_re=$(sed 's/[].[]/\\&/g' <<<"$node_list")
expect "resumed run's first line" zero \
  "^fsdp-train: .* \| slurm job $job_id step [0-9]+, nodes $node_re, restart 1$" "$work/resume.log"
# One line per start: restart 0 from scratch, restart 1 from the stopped step.
if python3 - "$b/runs.jsonl" "$stopped" "$job_id" "$node_list" <<'PY'
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
want = [(0, 0), (1, int(sys.argv[2]))]
got = [(r["slurm"]["restart_count"], r["resumed_from_step"]) for r in runs]
ok = got == want and all(r["slurm"]["job_id"] == sys.argv[3] and r["slurm"]["node_list"] == sys.argv[4]
                         for r in runs)
print(("ok" if ok else "FAIL") + f": runs.jsonl (restart, resumed from step): {got}, expected {want}")
sys.exit(0 if ok else 1)
PY
then :; else fail=1; fi
expect "resumed run" zero "^fsdp-train: resumed from $b/checkpoint/step-0*$stopped at step $stopped" \
  "$work/resume.log"
same_run "$a" "$b" "$work"
finish "train-stop-check (SIG$sig to one rank: exit 75, checkpoint, resume == straight, bitwise)"
