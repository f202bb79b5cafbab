#!/usr/bin/env bash
# Checks losing a node under Slurm on the simulated cluster
# (ci/slurm/cluster): `srun -N 2 -n 4 fsdp-train --mesh 2x2 --checkpoint-every
# 2` runs; once the step-4 checkpoint is complete, node 2 is killed like a
# power loss (`ci/slurm/cluster kill-node 2`: its link goes down, then its
# slurmd, slurmstepds and tasks are SIGKILLed). Checks: srun ends within
# LIMIT s (default 90: slurmctld marks the node DOWN after SlurmdTimeout =
# 10 s, the job ends with NODE_FAIL, the surviving ranks are killed after
# KillWait), with a non-zero status and a line naming the lost node; then
# `srun -N 1 -n 2 -w <surviving node> fsdp-train --resume` reshards the newest
# complete checkpoint (4 ranks, HSDP 2x2) onto 2 ranks (FSDP) and finishes,
# exit 0. The node is brought back (`ci/slurm/cluster start-node 2`) at the
# end, pass or fail, so a shared cluster stays whole.
#
#   ci/slurm/tests/node-loss-check.sh <fsdp-train> <work dir>
#
# Env: FSDP_SLURM_STATE (ci/slurm/tests/slurm-lib.sh), LIMIT (default 90).
set -euo pipefail
train="${1:?usage: $0 <fsdp-train> <work dir>}"
work="${2:?usage: $0 <fsdp-train> <work dir>}"
source "$(dirname "${BASH_SOURCE[0]}")/slurm-lib.sh"
limit="${LIMIT:-90}"
common=(--seq 64 --batch 4 --seed 7)
fresh_dir "$work"
survivor="${slurm_nodes[0]}" victim="${slurm_nodes[1]}"
restore() {
  "$cluster" start-node 2 --state "$slurm_state" >"$work/start-node.log" 2>&1 ||
    { echo "FAIL: could not bring $victim back:"; sed 's/^/    | /' "$work/start-node.log"; }
}
trap 'restore; slurm_cleanup' EXIT

S="$work/S"
first_ckpt="$S/checkpoint/$(printf 'step-%012d' 4)/index.json"
echo "== S: srun -N 2 -n 4 fsdp-train --mesh 2x2 --steps 400 --checkpoint-every 2; kill $victim once $first_ckpt exists"
set +e
timeout -k 10 300 srun --mpi=pmix -N 2 -n 4 -J fsdp-node-loss "$train" "${common[@]}" --mesh 2x2 \
  --steps 400 --checkpoint-every 2 --out "$S" >"$work/S.log" 2>&1 &
job=$!
set -e
t_end=$((SECONDS + 180))
while [ ! -e "$first_ckpt" ]; do
  if ! kill -0 "$job" 2>/dev/null || [ "$SECONDS" -ge "$t_end" ]; then
    sed 's/^/    | /' "$work/S.log" | grep -v '^    | step' | tail -30
    echo "FAIL: S ended or stalled before the step-4 checkpoint"
    exit 1
  fi
  sleep 0.1
done
t0=$(date +%s%N)
"$cluster" kill-node 2 --state "$slurm_state"
set +e
wait "$job"
rc=$?
set -e
ended=$(secs_since "$t0")
grep -vE '^step +[0-9]+/' "$work/S.log" | sed 's/^/    | /' | tail -30
echo "    (srun exit status $rc, ${ended}s after the node loss)"
if [ "$rc" -eq 0 ]; then
  echo "FAIL: S exited 0 after losing a node"
  fail=1
fi
# (srun's own status is 137 here: the surviving tasks were SIGKILLed.)
if [ "${ended%.*}" -ge "$limit" ]; then
  echo "FAIL: S took ${ended}s to end after the node loss (limit $limit s)"
  fail=1
else
  echo "ok: S ended ${ended}s after the node loss (limit $limit s)"
fi
if grep -qE "(Node failure on|NODE_FAIL|node ).*$victim|$victim.*(fail|lost|down|Killed)" "$work/S.log"; then
  echo "ok: the job's output names the lost node: $(grep -m1 -E "(Node failure on|NODE_FAIL|node ).*$victim|$victim.*(fail|lost|down|Killed)" "$work/S.log")"
else
  echo "FAIL: no line of S's output names the lost node $victim"
  fail=1
fi
echo "    slurmctld: $(sinfo -h -N -n "$victim" -o '%N %T %E' 2>/dev/null || true)"

ckpt=$(newest "$S")
[ -n "$ckpt" ] || { echo "FAIL: no complete checkpoint under $S"; exit 1; }
from=$((10#${ckpt##*step-}))
total=$((from + 4))
echo "== R: srun -N 1 -n 2 -w $survivor fsdp-train --resume --steps $total (from $(basename "$ckpt"), 4 ranks -> 2)"
srun_job "$work/R.log" 240 -N 1 -n 2 -w "$survivor" -- "$train" "${common[@]}" --steps "$total" --out "$S" --resume
expect "resume on the surviving node" zero \
  "^fsdp-train: resumed from $S/checkpoint/step-0*$from at step $from, saved by 4 ranks.*now 2 ranks" "$work/R.log"
expect "resumed run finished" zero "^trained $((total - from)) steps" "$work/R.log"
finish "slurm-node-loss-check (node lost mid-job: the job ends naming it; --resume on the survivor, 4 -> 2 ranks)"
