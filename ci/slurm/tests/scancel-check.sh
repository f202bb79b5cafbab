#!/usr/bin/env bash
# Checks fsdp-train's graceful stop under Slurm's own scancel
# (docs/graceful_stop.md) on the simulated cluster (ci/slurm/cluster): a
# batch job (2 nodes x 2 tasks) runs `srun --mpi=pmix fsdp-train --steps
# 200`; once 3 steps are logged, `scancel <job>`. Checks: within 30 s of the
# scancel (KillWait, when SIGKILL follows) the checkpoint of the step the job
# says it stopped at ("fsdp-train: stopped by signal ...") is complete
# (index.json), the ranks exited 75, and `srun --resume --steps N` (N a few
# steps beyond) ends with loss.csv (step, loss, grad_norm) and the final
# checkpoint (every rank file: h5diff -c; index.json but "created" and
# "checksum") identical to an uninterrupted N-step run.
#
# Which signal reaches the ranks: plain `scancel <job>` (what a user, the
# time limit and preemption do). Without --batch/--full, scancel has every
# step's slurmstepd send SIGCONT + SIGTERM to its tasks -- the ranks get
# SIGTERM straight from Slurm, not through srun -- and the batch step (the
# shell and srun) gets it too; SIGKILL follows after KillWait (30 s). srun
# answers its SIGTERM with "forcing job termination", which does not cut
# the ranks' stop short here (the test would fail if it did). `scancel
# --signal=TERM <job>` (signal only, the job is not cancelled) would reach
# the same ranks and let the batch script go on (requeue on exit 75); not
# what this test exercises.
#
#   ci/slurm/tests/scancel-check.sh <fsdp-train> <work dir>
#
# Env: FSDP_SLURM_STATE (ci/slurm/tests/slurm-lib.sh), EXTRA_STEPS (default 4).
set -euo pipefail
train="${1:?usage: $0 <fsdp-train> <work dir>}"
work="${2:?usage: $0 <fsdp-train> <work dir>}"
source "$(dirname "${BASH_SOURCE[0]}")/slurm-lib.sh"
extra="${EXTRA_STEPS:-4}"
common=(--seq 64 --batch 4 --seed 7)
fresh_dir "$work"
b="$work/stopped" a="$work/straight"

echo "== B: sbatch -N 2 -n 4: srun fsdp-train --steps 200 --out $b; scancel once 3 steps are logged"
cat >"$work/job.sh" <<JOB
#!/usr/bin/env bash
echo "batch script on \$(hostname), job \$SLURM_JOB_ID"
srun --mpi=pmix $(printf '%q ' "$train" "${common[@]}") --steps 200 --out $(printf '%q' "$b")
echo "batch script: srun exit status \$?"
JOB
jobid=$(sbatch --parsable -N 2 -n 4 -J fsdp-scancel -o "$work/job.out" "$work/job.sh")
slurm_jobs+=("$jobid")
echo "    job $jobid"
t_end=$((SECONDS + 180))
until [ -f "$b/loss.csv" ] && [ "$(wc -l <"$b/loss.csv")" -ge 4 ]; do
  st=$(job_state "$jobid")
  if [ "$SECONDS" -ge "$t_end" ] || { [ -n "$st" ] && [ "$st" != PENDING ] && [ "$st" != RUNNING ]; }; then
    echo "FAIL: job $jobid ($st) ended or stalled before 3 steps were logged"
    sed 's/^/    | /' "$work/job.out" 2>/dev/null || true
    scancel "$jobid" 2>/dev/null || true
    exit 1
  fi
  sleep 0.05
done
at_step=$(($(wc -l <"$b/loss.csv") - 1))
t0=$(date +%s%N)
scancel "$jobid"
echo "    scancel $jobid at step $at_step"
# Until the stop line (printed once the checkpoint is complete) or 30 s.
stop_secs="" ckpt_secs=""
while [ "$((($(date +%s%N) - t0) / 1000000))" -lt 30000 ]; do
  if [ -z "$ckpt_secs" ]; then
    c=$(newest "$b")
    if [ -n "$c" ] && [ "$((10#${c##*step-}))" -ge "$at_step" ]; then ckpt_secs=$(secs_since "$t0"); fi
  fi
  if grep -q '^fsdp-train: stopped by signal' "$work/job.out" 2>/dev/null; then
    stop_secs=$(secs_since "$t0")
    [ -n "$ckpt_secs" ] || ckpt_secs=$stop_secs
    break
  fi
  sleep 0.1
done
t_end=$((SECONDS + 60))
while [ "$SECONDS" -lt "$t_end" ]; do
  case "$(job_state "$jobid")" in PENDING|RUNNING|COMPLETING|SUSPENDED|CONFIGURING|'') sleep 0.2 ;; *) break ;; esac
done
end_secs=$(secs_since "$t0")
grep -vE '^step +[0-9]+/' "$work/job.out" | sed 's/^/    | /'
echo "    (job $jobid $(job_state "$jobid") $end_secs s after scancel; checkpoint complete after ${ckpt_secs:-?} s, stop line after ${stop_secs:-?} s)"
if [ -z "$stop_secs" ]; then
  echo "FAIL: no 'fsdp-train: stopped by signal' line within 30 s of scancel"
  fail=1
fi
rc=75
expect "scancel'd job: the ranks' stop line" 75 \
  '^fsdp-train: stopped by signal 15 \(Terminated\) at step [0-9]+ of 200: checkpoint .* complete' "$work/job.out"
if grep -qE '^srun: error: .*Exited with exit code 75' "$work/job.out" &&
   ! grep -E '^srun: error: .*(exit code [^7]|exit code 7[^5]|Killed|Terminated)' "$work/job.out" | grep -q .; then
  echo "ok: every task exited 75: $(grep -E '^srun: error: .*exit code 75' "$work/job.out" | tr '\n' ' ')"
else
  echo "FAIL: not every task exited 75 (see srun's lines above)"
  fail=1
fi
stopped=$(sed -nE 's/^fsdp-train: stopped by .* at step ([0-9]+) of .*/\1/p' "$work/job.out" | head -n1)
ckpt=$(newest "$b")
if [ -z "$stopped" ] || [ "$(basename "$ckpt")" != "$(printf 'step-%012d' "$stopped")" ]; then
  echo "FAIL: the newest complete checkpoint is '$ckpt', expected step ${stopped:-?}'s"
  fail=1
  finish "slurm-scancel-check"
fi
echo "ok: $ckpt is complete (index.json) at the step the job stopped ($stopped; scancel at $at_step), ${ckpt_secs}s after scancel"
rows=$(($(wc -l <"$b/loss.csv") - 1))
[ "$rows" = "$stopped" ] || { echo "FAIL: loss.csv has $rows rows, stopped at $stopped"; fail=1; }

total=$((stopped + extra))
echo "== B: srun -N 2 -n 4 fsdp-train --resume --steps $total"
srun_job "$work/resume.log" 240 -N 2 -n 4 -- "$train" "${common[@]}" --steps "$total" --out "$b" --resume
expect "resumed run" zero "^fsdp-train: resumed from $b/checkpoint/step-0*$stopped at step $stopped" "$work/resume.log"
echo "== A: srun -N 2 -n 4 fsdp-train --steps $total straight"
srun_job "$work/straight.log" 240 -N 2 -n 4 -- "$train" "${common[@]}" --steps "$total" --out "$a"
expect "uninterrupted run" zero "^trained $total steps" "$work/straight.log"
same_run "$a" "$b" "$work"
finish "slurm-scancel-check (scancel of a 2-node batch job: exit 75, checkpoint, srun --resume == straight, bitwise)"
