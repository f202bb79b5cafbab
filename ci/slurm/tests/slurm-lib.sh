# Shared by ci/slurm/tests/*-check.sh (sourced, not run): the simulated
# Slurm cluster (ci/slurm/cluster) and the helpers of
# tools/fsdp-train/tests/check-lib.sh (fresh_dir, secs_since, expect, newest,
# same_run, compare_resumed_losses, finish).
#
# The caller sets `train` (the fsdp-train binary), `work` (a work
# directory) and optionally `slurm_shares` (an array of more directories the
# jobs use). Every node has its own /tmp: under /tmp, both must be in a
# directory the cluster shares (ci/slurm/cluster up --share; the CTest
# fixture shares the checkout and the build tree). Env:
#   FSDP_SLURM_STATE   the cluster's state directory (default
#                      /var/lib/fsdp-slurm-sim). A cluster already up there
#                      (the CTest fixture slurm_cluster_up) is reused and left
#                      up; otherwise the script brings one up (2 nodes x 2
#                      CPUs, sharing this checkout, the work dir's parent and
#                      the binary's directory) and takes it down when it ends.
#   FSDP_SLURM_CLUSTER the launcher (default ci/slurm/cluster of this checkout)

slurm_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cluster="${FSDP_SLURM_CLUSTER:-$slurm_here/../cluster}"
slurm_state="${FSDP_SLURM_STATE:-/var/lib/fsdp-slurm-sim}"
source "$slurm_here/../../../tools/fsdp-train/tests/check-lib.sh"

for c in srun sbatch scancel squeue scontrol sinfo; do
  command -v "$c" >/dev/null || { echo "FAIL: Slurm is missing: '$c' not found (Debian: apt-get install slurm-wlm munge)"; exit 1; }
done
[ -x "$train" ] || { echo "FAIL: fsdp-train '$train' is not an executable"; exit 1; }
work="$(realpath -m "$work")"
train="$(realpath "$train")"
src_dir="$(cd "$slurm_here/../../.." && pwd -P)"
case "$(dirname "$work")" in
  /tmp) echo "FAIL: work dir $work: not directly in /tmp (each node has a /tmp of its own; its parent is shared with them)"; exit 1 ;;
esac

# seen_by_nodes <path>: whether the nodes see <path> as we do: outside
# /tmp, or inside a directory the cluster shares (<state>/shares).
seen_by_nodes() {
  local d
  case "$1/" in /tmp/*) ;; *) return 0 ;; esac
  while IFS= read -r d; do
    case "$1/" in "$d"/*) return 0 ;; esac
  done < <(cat "$slurm_state/shares" 2>/dev/null)
  return 1
}

own_cluster=0
if [ -f "$slurm_state/env" ] && (source "$slurm_state/env" && scontrol ping 2>/dev/null | grep -q 'is UP'); then
  echo "== reusing the cluster under $slurm_state"
else
  echo "== bringing up a cluster under $slurm_state"
  t_up=$SECONDS
  share_args=()
  for p in "$src_dir" "$(dirname "$work")" "$(dirname "$train")" ${slurm_shares[@]+"${slurm_shares[@]}"}; do
    share_args+=(--share "$p")
  done
  if ! "$cluster" up --state "$slurm_state" "${share_args[@]}" >/dev/null; then
    echo "FAIL: ci/slurm/cluster up failed"
    exit 1
  fi
  echo "    (up in $((SECONDS - t_up)) s)"
  own_cluster=1
fi
# On every exit: cancel the jobs this script submitted (slurm_jobs) and take
# down a cluster it brought up.
slurm_jobs=()
slurm_cleanup() {
  local j
  for j in "${slurm_jobs[@]}"; do scancel "$j" 2>/dev/null || true; done
  if [ "$own_cluster" = 1 ]; then "$cluster" down --state "$slurm_state" >/dev/null 2>&1 || true; fi
}
trap slurm_cleanup EXIT
for p in "$src_dir" "$work" "$train" ${slurm_shares[@]+"${slurm_shares[@]}"}; do
  p="$(realpath -m "$p")"
  seen_by_nodes "$p" || { echo "FAIL: $p is under /tmp but the cluster under $slurm_state does not share it (ci/slurm/cluster up --share)"; exit 1; }
done
source "$slurm_state/env"
export FSDP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
read -r -a slurm_nodes <<<"$FSDP_SLURM_NODES"

# srun_job <log> <limit s> [srun options] -- <program> [args]: srun, at most
# <limit> seconds (timeout ends srun; srun ends the step), output to <log>
# (non-step lines also to ours); sets $rc and $secs.
srun_job() {
  local log="$1" limit="$2" t0
  shift 2
  local opts=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do opts+=("$1"); shift; done
  shift
  t0=$(date +%s%N)
  set +e
  timeout -k 10 "$limit" srun --mpi=pmix "${opts[@]}" "$@" >"$log" 2>&1
  rc=$?
  set -e
  secs=$(secs_since "$t0")
  grep -vE '^([0-9]+: )?(verify )?step +[0-9]+/' "$log" | sed 's/^/    | /' || true
  echo "    (srun exit status $rc, ${secs}s)"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "FAIL: srun did not end within $limit s"
    fail=1
  fi
}

# job_state <job id>: Slurm's JobState (PENDING, RUNNING, CANCELLED, ...)
job_state() {
  { scontrol show job "$1" 2>/dev/null || true; } | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'
}
