#!/usr/bin/env bash
# Checks ci/slurm/train.sbatch against a real time limit on the simulated
# Slurm cluster (ci/slurm/cluster): the job is submitted as users submit it
# (2 nodes x 2 tasks, `--requeue`), with a 1-minute limit and
# `--signal=B:USR1@10` (the script's own 60 s lead does not fit in 1 minute),
# for more steps than one minute can train: a one-layer model paced to
# 100 ms a step (fsdp-train's FSDP_TRAIN_MIN_STEP_MS test hook; the numbers do
# not change), 600 steps. Slurm checks time limits every 30 s and sends the
# signal at the first check within 30 s of the lead, so it arrives 10-40 s
# before the limit, 20-50 s into each start; train.sbatch forwards SIGUSR1 to the step,
# fsdp-train stops every rank at the next step, checkpoints and exits 75, the
# script requeues the job, and the requeued job (same id, same output
# directory, SLURM_RESTART_COUNT 1, 2, ...) resumes from the newest complete
# checkpoint -- as often as it takes -- until it finishes. Checks: the job
# ends COMPLETED with exit code 0 after at least one requeue; each stop saved
# the step it names; each restart resumed from the step the previous run
# stopped at (no step lost, none trained twice); runs.jsonl has one line per
# start with the restart counts; and loss.csv and the final checkpoint are
# bitwise those of an uninterrupted run (srun, same nodes, same flags).
#
# (The cluster's cred_expire=10 and bf_interval=5: a requeued job starts
# 10-15 s after the requeue, not Slurm's default 2-2.5 minutes.)
#
#   ci/slurm/tests/time-limit-check.sh <fsdp-train> <work dir>
#
# Env: FSDP_SLURM_STATE (ci/slurm/tests/slurm-lib.sh), STEPS (default 600),
# MIN_STEP_MS (default 100).
set -euo pipefail
train="${1:?usage: $0 <fsdp-train> <work dir>}"
work="${2:?usage: $0 <fsdp-train> <work dir>}"
source "$(dirname "${BASH_SOURCE[0]}")/slurm-lib.sh"
src="$(cd "$slurm_here/../../.." && pwd)"
steps="${STEPS:-600}"
min_step_ms="${MIN_STEP_MS:-100}"
common=(--layers 1 --seq 32 --batch 4 --seed 5 --log-every 100)
fresh_dir "$work"
b="$work/job" a="$work/straight"

echo "== B: sbatch -N 2 --ntasks-per-node 2 --time 1 --signal B:USR1@10 ci/slurm/train.sbatch --steps $steps (${min_step_ms} ms/step)"
jobid=$(cd "$work" && FSDP_SRC="$src" FSDP_TRAIN="$train" FSDP_OUT="$b" FSDP_TRAIN_MIN_STEP_MS="$min_step_ms" \
  sbatch --parsable -N 2 --ntasks-per-node 2 --time 1 --signal B:USR1@10 -J fsdp-time-limit \
    -o "$work/job.out" "$src/ci/slurm/train.sbatch" "${common[@]}" --steps "$steps")
slurm_jobs+=("$jobid")
echo "    job $jobid"
t0=$(date +%s%N)
t_end=$((SECONDS + 480))
st=""
while [ "$SECONDS" -lt "$t_end" ]; do
  st=$(job_state "$jobid")
  case "$st" in PENDING|RUNNING|COMPLETING|REQUEUED|CONFIGURING|SUSPENDED|'') sleep 1 ;; *) break ;; esac
done
info=$(scontrol show job "$jobid" 2>/dev/null || true)
restarts=$(sed -n 's/.*Restarts=\([0-9]*\).*/\1/p' <<<"$info")
exitcode=$(sed -n 's/.* ExitCode=\([0-9:]*\).*/\1/p' <<<"$info")
grep -vE '^([0-9]+: )?step +[0-9]+/' "$work/job.out" | sed 's/^/    | /' || true
echo "    (job $jobid: $st, Restarts=$restarts, ExitCode=$exitcode, $(secs_since "$t0") s after sbatch)"
if [ "$st" != COMPLETED ] || [ "$exitcode" != "0:0" ]; then
  echo "FAIL: job $jobid ended $st with ExitCode $exitcode (expected COMPLETED, 0:0) within 480 s"
  fail=1
fi
if [ -n "$restarts" ] && [ "$restarts" -ge 1 ]; then
  echo "ok: the job was requeued $restarts time(s)"
else
  echo "FAIL: the job was never requeued (Restarts=$restarts): the time limit did not interrupt it"
  fail=1
fi

# Each start's stop (step S) and the next start's resume (from S): the runs
# chain without a gap or an overlap.
mapfile -t stops < <(sed -nE 's/^fsdp-train: stopped by signal 10 \(User defined signal 1\) at step ([0-9]+) of [0-9]+: checkpoint .* complete.*/\1/p' "$work/job.out")
mapfile -t resumes < <(sed -nE "s|^fsdp-train: resumed from $b/checkpoint/step-0*([0-9]+) at step [0-9]+.*|\1|p" "$work/job.out")
requeues=$(grep -c "^train.sbatch: stopped ahead of the time limit with a checkpoint; requeueing job $jobid" "$work/job.out" || true)
echo "    stops at steps: ${stops[*]:-none}; resumes from: ${resumes[*]:-none}; requeues: $requeues"
if [ "${#stops[@]}" -ge 1 ] && [ "${#stops[@]}" = "${#resumes[@]}" ] && [ "$requeues" = "${#stops[@]}" ] &&
   [ "$requeues" = "${restarts:-x}" ]; then
  ok=1
  for i in "${!stops[@]}"; do [ "${stops[$i]}" = "${resumes[$i]}" ] || ok=0; done
  if [ "$ok" = 1 ]; then
    echo "ok: every stop (SIGUSR1 at the time-limit lead) checkpointed its step, was requeued, and the next start resumed from that step"
  else
    echo "FAIL: stops ${stops[*]} and resumes ${resumes[*]} do not chain"; fail=1
  fi
else
  echo "FAIL: expected as many stops, requeues, resumes and restarts (${#stops[@]}, $requeues, ${#resumes[@]}, $restarts), at least one"
  fail=1
fi
# (The stops' checkpoints may be pruned since -- the retention keeps the
# newest -- but each resume line above says it loaded and verified one.)
final="$b/checkpoint/$(printf 'step-%012d' "$steps")/index.json"
rows=$(($(wc -l <"$b/loss.csv" 2>/dev/null || echo 1) - 1))
if [ -f "$final" ] && [ "$rows" = "$steps" ]; then
  echo "ok: the last start finished: $final complete, loss.csv has $rows steps"
else
  echo "FAIL: the job did not finish: $final missing or loss.csv has $rows steps (expected $steps)"
  fail=1
fi
runs=$(wc -l <"$b/runs.jsonl" 2>/dev/null || echo 0)
if [ "$runs" = "$((${restarts:-0} + 1))" ] &&
   python3 - "$b/runs.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
restarts = [int(r.get("slurm", {}).get("restart_count", -1)) for r in rows]
sys.exit(0 if restarts == list(range(len(rows))) else 1)
PY
then
  echo "ok: runs.jsonl has $runs starts, restart counts 0..$((runs - 1))"
else
  echo "FAIL: runs.jsonl has $runs lines (expected $((${restarts:-0} + 1)) with restart counts 0, 1, ...)"
  sed 's/^/    | /' "$b/runs.jsonl" 2>/dev/null || true
  fail=1
fi

echo "== A: srun -N 2 -n 4 fsdp-train --steps $steps straight"
srun_job "$work/straight.log" 300 -N 2 -n 4 -- "$train" "${common[@]}" --steps "$steps" --out "$a"
rc_a=$rc
rc=$rc_a
expect "uninterrupted run" zero "^trained $steps steps" "$work/straight.log"
same_run "$a" "$b" "$work"
finish "slurm-time-limit-check (train.sbatch: time limit -> SIGUSR1 -> checkpoint -> requeue -> resume, x$restarts; == straight, bitwise)"
