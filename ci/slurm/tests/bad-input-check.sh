#!/usr/bin/env bash
# Checks that fsdp-train refuses bad input under srun on the simulated Slurm
# cluster (ci/slurm/cluster) before any step, on every rank of both nodes:
#  (a) `srun -N 2 -n 4 fsdp-train --mesh 2x3`: exit status 2, a line naming
#      --mesh, no `step 1/` line;
#  (b) an --out whose checkpoint/ cannot be written: the tests run as root,
#      for whom chmod 0555 stops nothing, so --out holds a regular FILE named
#      `checkpoint` (no directory can be created there). Expected: exit status
#      2, a line starting `fsdp-train: error: --out` naming the checkpoint
#      path, no `step 1/` line, and the pre-existing file unchanged (sha256).
#
#   ci/slurm/tests/bad-input-check.sh <fsdp-train> <work dir>
#
# Env: FSDP_SLURM_STATE (ci/slurm/tests/slurm-lib.sh).
set -euo pipefail
train="${1:?usage: $0 <fsdp-train> <work dir>}"
work="${2:?usage: $0 <fsdp-train> <work dir>}"
source "$(dirname "${BASH_SOURCE[0]}")/slurm-lib.sh"
common=(--steps 3 --seq 64 --batch 4)
fresh_dir "$work"

no_step() {  # <what> <log>
  if grep -qE '^([0-9]+: )?step +1/' "$2"; then
    echo "FAIL: $1: a step ran before the error"
    fail=1
  else
    echo "ok: $1: no step ran"
  fi
}
every_task_2() {  # <what> <log>: srun's per-task lines say exit code 2 and nothing else
  if grep -qE '^srun: error: .*Exited with exit code 2$' "$2" &&
     ! grep -E '^srun: error: .*(Exited with exit code [013-9]|exit code 2[0-9]|Killed|Terminated)' "$2" | grep -q .; then
    echo "ok: $1: the tasks exited 2: $(grep -E '^srun: error: .*exit code' "$2" | tr '\n' ' ')"
  else
    echo "FAIL: $1: not every task exited 2"
    fail=1
  fi
}

echo "== (a) srun -N 2 -n 4 fsdp-train --mesh 2x3"
srun_job "$work/mesh.log" 120 -N 2 -n 4 -- "$train" "${common[@]}" --mesh 2x3 --out "$work/mesh-out"
expect "--mesh 2x3 on 4 ranks" 2 '^fsdp-train: error: --mesh 2x3: the mesh has 6 ranks but the job has 4' "$work/mesh.log"
no_step "--mesh 2x3" "$work/mesh.log"
every_task_2 "--mesh 2x3" "$work/mesh.log"

echo "== (b) --out DIR holding a regular file DIR/checkpoint"
out="$work/out-file"
mkdir -p "$out"
printf 'not a directory: fsdp-train must leave this file alone\n' >"$out/checkpoint"
before=$(sha256sum <"$out/checkpoint")
ls_before=$(ls -lA --time-style=full-iso "$out")
srun_job "$work/out.log" 120 -N 2 -n 4 -- "$train" "${common[@]}" --out "$out"
expect "--out with a file named checkpoint" 2 "^fsdp-train: error: --out .*$out/checkpoint" "$work/out.log"
no_step "--out with a file named checkpoint" "$work/out.log"
every_task_2 "--out with a file named checkpoint" "$work/out.log"
if [ "$(sha256sum <"$out/checkpoint")" = "$before" ]; then
  echo "ok: $out/checkpoint unchanged (sha256)"
else
  echo "FAIL: $out/checkpoint was changed"
  fail=1
fi
if [ "$(ls -lA --time-style=full-iso "$out")" = "$ls_before" ]; then
  echo "ok: nothing else appeared in or changed under $out"
else
  echo "FAIL: $out changed:"
  diff <(echo "$ls_before") <(ls -lA --time-style=full-iso "$out") | sed 's/^/    /'
  fail=1
fi
finish "slurm-bad-input-check (srun -N 2 -n 4: --mesh 2x3 and an unwritable --out refused before step 1, exit 2)"
