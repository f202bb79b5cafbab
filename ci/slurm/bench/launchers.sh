#!/usr/bin/env bash
# Step time under srun against mpirun on the same simulated Slurm nodes
# (ci/slurm/cluster must be up): inside one allocation (-N 2, 2 tasks per
# node), `fsdp-bench train` runs alternately as
#   srun --mpi=pmix -n 4 fsdp-bench train ...         (Open MPI started by Slurm's PMIx)
#   mpirun -n 4 --bind-to none fsdp-bench train ...   (Open MPI's own launcher in the allocation)
# ROUNDS times each, and the table gives, per config, the median over the
# rounds of fsdp-bench's median step time and the ratio srun / mpirun.
#
#   ci/slurm/bench/launchers.sh <fsdp-bench> [rounds] [fsdp-bench train args...]
#
# Env: FSDP_SLURM_STATE (default /var/lib/fsdp-slurm-sim), the cluster's
# state directory; TASKS_PER_NODE (default 2; 1 leaves a core per rank on a
# 2-core machine). Example (the numbers in docs/slurm.md):
#   FSDP_SLURM_STATE=build/slurm-sim ci/slurm/bench/launchers.sh \
#     build/tools/fsdp-bench/fsdp-bench 5 --configs fsdp,hsdp --steps 20
set -euo pipefail
bench="$(realpath "${1:?usage: $0 <fsdp-bench> [rounds] [fsdp-bench train args...]}")"
rounds="${2:-5}"
shift 2 || shift $#
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--configs fsdp,hsdp --steps 20 --warmup 3)
state="${FSDP_SLURM_STATE:-/var/lib/fsdp-slurm-sim}"
# shellcheck disable=SC1091
source "$state/env"
export FSDP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out="$(mktemp -d "$PWD/.launchers-bench.XXXX")"
trap 'rm -rf "$out"' EXIT
# The rounds run inside one allocation, so both launchers get the same nodes.
ppn="${TASKS_PER_NODE:-2}"
np=$((2 * ppn))
salloc -N 2 --ntasks-per-node "$ppn" --quiet bash -c '
  set -e
  run_srun() { srun --mpi=pmix -n "$4" "$2" train "${@:5}" --json "$3/srun-$r.json" >/dev/null; }
  run_mpirun() { mpirun -n "$4" --bind-to none "$2" train "${@:5}" --json "$3/mpirun-$r.json" >/dev/null; }
  for r in $(seq 1 "$1"); do
    # Odd rounds srun first, even rounds mpirun first: neither always
    # follows the other'"'"'s teardown.
    if [ $((r % 2)) = 1 ]; then run_srun "$@"; run_mpirun "$@"; else run_mpirun "$@"; run_srun "$@"; fi
    echo "  round $r of $1 done" >&2
  done' _ "$rounds" "$bench" "$out" "$np" "${args[@]}"
python3 - "$out" "$rounds" "$ppn" <<'PY'
import json, statistics, sys
out, rounds, ppn = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ms = {}
for launcher in ("srun", "mpirun"):
    for r in range(1, rounds + 1):
        for row in json.load(open(f"{out}/{launcher}-{r}.json"))["rows"]:
            ms.setdefault(row["config"], {}).setdefault(launcher, []).append(row["step_ms"])
print(f"# step time, median over {rounds} alternating rounds of fsdp-bench's median (ms), 2 nodes x {ppn} rank(s)")
print(f"{'config':>12} {'srun':>9} {'mpirun':>9} {'srun/mpirun':>12}")
for config, by in ms.items():
    s, m = statistics.median(by["srun"]), statistics.median(by["mpirun"])
    print(f"{config:>12} {s:9.1f} {m:9.1f} {s / m:12.3f}")
print("# per round (srun / mpirun, ms): " + "; ".join(
    f"{c}: " + " ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(by["srun"], by["mpirun"]))
    for c, by in ms.items()))
PY
