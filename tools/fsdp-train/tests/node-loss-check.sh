#!/usr/bin/env bash
# A node lost mid-run, and the run continued on the node that survived.
#
#   tools/fsdp-train/tests/node-loss-check.sh <fsdp-train> <work dir>
#
# S: HSDP 2x2 on the simulated cluster (2 nodes x 2 ranks, ci/cluster/
#    fsdp-cluster), a checkpoint every 3 steps; node 1 is killed (SIGKILL of
#    its orted and its ranks: a power loss) as soon as the step-3 checkpoint
#    is committed. The job must end within LIMIT seconds of the kill (default
#    30) with a non-zero status and a message naming the lost node.
# R: `fsdp-train --resume` on the surviving node alone (1 node x 2 ranks,
#    FSDP over 2: fewer ranks and another layout, through fsdp::dcp's
#    resharding) from S's newest committed checkpoint to step 12.
# T: the same 12 steps straight on 1 node x 2 ranks.
# R's resumed losses must match T's within TOL relative (default 1e-4: the
# change of layout reorders fp32 reductions; reshard-check.sh says why 1e-4
# and prints the observed difference, as this does).
#
# Env: FSDP_CLUSTER (the launcher), FSDP_CLUSTER_ARGS (its node options for S,
# e.g. "--nodes 2 --ranks-per-node 2 --net netns --rate 10gbit"), LIMIT, TOL.
set -euo pipefail
usage="usage: $0 <fsdp-train> <work dir>"
train="${1:?$usage}"
work="${2:?$usage}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cluster="${FSDP_CLUSTER:-$here/../../../ci/cluster/fsdp-cluster}"
read -r -a cluster_args <<<"${FSDP_CLUSTER_ARGS:---nodes 2 --ranks-per-node 2}"
limit="${LIMIT:-30}"
tol="${TOL:-1e-4}"
total=12
common=(--seq 64 --batch 8 --seed 7)
source "$here/check-lib.sh"
fresh_dir "$work"

first_ckpt="$work/S/checkpoint/$(printf 'step-%012d' 3)"
echo "== S: HSDP 2x2 on 2 nodes, node 1 killed once $first_ckpt is committed"
start=$SECONDS
set +e
"$cluster" "${cluster_args[@]}" --kill-node 1 --kill-when "$first_ckpt" --timeout 240 -- \
  "$train" "${common[@]}" --mesh 2x2 --steps 400 --checkpoint-every 3 --out "$work/S" \
  >"$work/S.log" 2>&1 &
job=$!
while [[ ! -e "$first_ckpt" ]] && kill -0 "$job" 2>/dev/null; do sleep 0.1; done
killed_at=$SECONDS
wait "$job"
rc=$?
set -e
ended_after=$((SECONDS - killed_at))
killed_host=$(sed -n 's/^fsdp-cluster: killing node 1 (\([^)]*\)).*/\1/p' "$work/S.log")
if [[ -z "$killed_host" ]]; then
  sed 's/^/    | /' "$work/S.log" | grep -v '^    | step' | tail -40
  echo "FAIL: the launcher did not kill node 1 (did S reach step 3? exit $rc)"
  exit 1
fi
echo "   node 1 ($killed_host) killed $((killed_at - start)) s into S; S ended $ended_after s later, exit $rc"
if [[ "$rc" -eq 0 ]]; then
  echo "FAIL: S exited 0 after losing a node"
  fail=1
fi
if (( ended_after > limit )); then
  echo "FAIL: S took $ended_after s to end after the node loss (limit $limit s)"
  fail=1
else
  echo "ok: S ended within $limit s of the node loss"
fi
if grep -q "on node $killed_host" "$work/S.log"; then
  echo "ok: the job's error names the lost node: $(grep -m1 "on node $killed_host" "$work/S.log" | sed 's/^ *//')"
else
  sed 's/^/    | /' "$work/S.log" | grep -v '^    | step' | tail -30
  echo "FAIL: no message naming the lost node $killed_host"
  fail=1
fi

# job <log> [fsdp-train flags]: one run on the surviving node (1 node x 2).
job() {
  local log="$1"
  shift
  if ! "$cluster" --nodes 1 --ranks-per-node 2 --net lo --timeout 180 -- \
    "$train" "${common[@]}" "$@" >"$log" 2>&1; then
    sed 's/^/    | /' "$log" | tail -40
    echo "FAIL: fsdp-train $* on the surviving node (exit status above)"
    exit 1
  fi
}
echo "== R: resume on the surviving node (FSDP over 2) to step $total"
mkdir -p "$work/R"
cp -r "$work/S/checkpoint" "$work/R/"
cp "$work/S/loss.csv" "$work/R/loss.csv"
job "$work/R.log" --steps "$total" --out "$work/R" --resume
resume_line=$(grep -m1 -E "^fsdp-train: resumed from " "$work/R.log" || true)
from=$(sed -n 's/^fsdp-train: resumed from .* at step \([0-9]*\), saved by 4 ranks.*now 2 ranks.*/\1/p' <<<"$resume_line")
if [[ -z "$from" ]]; then
  sed 's/^/    | /' "$work/R.log" | tail -20
  echo "FAIL: no 'fsdp-train: resumed from ... at step K, saved by 4 ranks ..., now 2 ranks' line"
  exit 1
fi
echo "ok: $resume_line"
echo "== T: 1 node x 2 ranks, $total steps straight"
job "$work/T.log" --steps "$total" --out "$work/T"

compare_resumed_losses "resumed (R) vs straight (T)" "$work/R/loss.csv" "$work/T/loss.csv" "$from" "$total" "$tol"
echo "   step  resumed (R)         straight (T)"
join -t, "$work/R/loss.csv" "$work/T/loss.csv" |
  awk -F, -v n="$from" '$1 ~ /^[0-9]+$/ && $1 > n { printf "   %4d  %-18s  %s\n", $1, $2, $5 }'
finish node-loss-check
