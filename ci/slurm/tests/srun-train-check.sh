#!/usr/bin/env bash
# Checks fsdp-train under srun on the simulated Slurm cluster
# (ci/slurm/cluster): `srun -N 2 -n 4 --mpi=pmix fsdp-train --verify` with
# FSDP over 4 ranks (--mesh 4) and HSDP (--mesh 2x2) exits 0 with the verify
# lines saying PASS, and the 4 ranks ran on 2 distinct nodes (each task
# prints its host name before it starts fsdp-train; Slurm's own first log
# line names the job's nodes).
#
#   ci/slurm/tests/srun-train-check.sh <fsdp-train> <work dir>
#
# Env: FSDP_SLURM_STATE (ci/slurm/tests/slurm-lib.sh).
set -euo pipefail
train="${1:?usage: $0 <fsdp-train> <work dir>}"
work="${2:?usage: $0 <fsdp-train> <work dir>}"
source "$(dirname "${BASH_SOURCE[0]}")/slurm-lib.sh"
fresh_dir "$work"

for mesh in 4 2x2; do
  echo "== srun -N 2 -n 4 --mpi=pmix fsdp-train --mesh $mesh --verify --steps 6 --seq 64 --batch 4"
  log="$work/mesh-$mesh.log"
  srun_job "$log" 240 -N 2 -n 4 -- \
    bash -c 'echo "task $SLURM_PROCID of $SLURM_NTASKS on host $(hostname) (node $SLURMD_NODENAME)"; exec "$0" "$@"' \
    "$train" --mesh "$mesh" --verify --steps 6 --seq 64 --batch 4 --out "$work/out-$mesh"
  expect "mesh $mesh: verify of the losses" zero '^verify: max \|loss difference\| .*: PASS' "$log"
  expect "mesh $mesh: verify of the parameters" zero '^verify: max \|parameter difference\| .*: PASS' "$log"
  if grep -q ': FAIL' "$log"; then echo "FAIL: mesh $mesh: a verify line says FAIL"; fail=1; fi
  hosts=$(sed -n 's/^task [0-9]* of 4 on host \([^ ]*\) .*/\1/p' "$log" | sort -u | tr '\n' ' ')
  ntasks=$(grep -c '^task [0-9]* of 4 on host ' "$log" || true)
  if [ "$ntasks" -eq 4 ] && [ "$(wc -w <<<"$hosts")" -eq 2 ]; then
    echo "ok: mesh $mesh: 4 tasks on 2 distinct nodes: $hosts"
  else
    echo "FAIL: mesh $mesh: expected 4 tasks on 2 distinct nodes, got $ntasks task line(s) on: $hosts"
    fail=1
  fi
  expect "mesh $mesh: the job's nodes in fsdp-train's first line" zero \
    "^fsdp-train: 4 ranks, mesh .* \| slurm job [0-9]+ step [0-9]+, nodes ${slurm_nodes[0]%[0-9]*}\[1-2\]" "$log"
done
finish "slurm-srun-train-check (srun -N 2 -n 4, meshes 4 and 2x2: verify PASS on 2 nodes)"
