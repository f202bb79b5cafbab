#!/usr/bin/env bash
# Runs what users submit, ci/slurm/gpu4.sbatch, on the simulated Slurm
# cluster through its CPU switch: sbatch on 2 nodes x 2 tasks; the batch
# script (on the first node) configures a build with srun as the CTest
# launcher (cmake/Launcher.cmake), builds the suites it runs and runs
# `ctest -L cpu -L <labels>`, every entry's ranks started by srun. Passes when
# the job exits 0, its log says the tests launch with srun, ran on a
# simulated node, and CTest passed every one of at least MIN_TESTS entries.
#
#   ci/slurm/tests/sbatch-ctest-check.sh <source dir> <build dir> <work dir>
#
# Env: FSDP_SLURM_STATE (ci/slurm/tests/slurm-lib.sh); SBATCH_CTEST_LABELS
# (default L0|example) and SBATCH_CTEST_REGEX (default: a sample of them
# that covers each kind once -- collectives at 2 and 4 ranks, communication
# errors, the runtime and mesh, the test harness, the fault entries whose
# rank dies, stalls, stops or disagrees, an example and fsdp-train's short
# run; the Debian leg runs all of L0 under mpiexec, so this check is about
# the launch path, not the suites), SBATCH_CTEST_TARGETS (the build targets
# they need), MIN_TESTS (default 16), FSDP_CMAKE_ARGS (default ci/build.sh's
# -DFSDP_WARNINGS_AS_ERRORS=ON -DFSDP_MINIMAL_DEBUG_INFO=ON: the same compile flags as the main build let
# ccache serve the objects).
set -euo pipefail
src="${1:?usage: $0 <source dir> <build dir> <work dir>}"
build="${2:?usage: $0 <source dir> <build dir> <work dir>}"
work="${3:?usage: $0 <source dir> <build dir> <work dir>}"
labels="${SBATCH_CTEST_LABELS:-L0|example}"
regex="${SBATCH_CTEST_REGEX-^(test_collectives_np[24]|test_comm_errors_np2|test_runtime_np[24]|test_device_mesh_np4|test_harness_np2|fault_(kill|segv|stall|sigstop|mismatch|oom_one_rank)_np2|fault_oom_one_rank_np4|example_train_mlp_np2|fsdp_train_np2)\$}"
targets="${SBATCH_CTEST_TARGETS:-test_collectives test_comm_errors test_runtime test_device_mesh test_harness fault_probe memory_probe train_mlp fsdp-train}"
min_tests="${MIN_TESTS:-16}"
# ci/build.sh's flags: the same compile commands, so ccache has the objects.
export FSDP_CMAKE_ARGS="${FSDP_CMAKE_ARGS:--DFSDP_WARNINGS_AS_ERRORS=ON -DFSDP_MINIMAL_DEBUG_INFO=ON}"
train=/bin/true  # slurm-lib.sh checks a program; this check runs none of its own
slurm_shares=("$build")  # the batch script's build tree: the nodes must see it
source "$(dirname "${BASH_SOURCE[0]}")/slurm-lib.sh"
fresh_dir "$work"
log="$work/job.log"

echo "== sbatch -N 2 --ntasks-per-node 2 --gpus-per-node 0 ci/slurm/gpu4.sbatch --cpu -L '$labels' -R '$regex' (build $build)"
t0=$(date +%s%N)
set +e
(cd "$src" && FSDP_SRC="$src" BUILD_DIR="$build" FSDP_BUILD_TARGETS="$targets" \
   timeout -k 10 1500 sbatch --wait --parsable -N 2 --ntasks-per-node 2 --cpus-per-task 1 \
     --gpus-per-node 0 --time 30 -o "$log" ci/slurm/gpu4.sbatch --cpu -L "$labels" -R "$regex") >"$work/sbatch.out" 2>&1
rc=$?
set -e
job=$(head -n 1 "$work/sbatch.out" | tr -dc '0-9')
[ -n "$job" ] && slurm_jobs+=("$job")
echo "    (job ${job:-?}: sbatch --wait exit status $rc after $(secs_since "$t0") s)"
grep -E '^gpu4.sbatch:|^-- libfsdp: tests launch|tests passed|tests failed|^Total Test time|\*\*\*(Failed|Timeout|Exception)' "$log" \
  | sed 's/^/    | /' || true

expect "the job (sbatch --wait)" zero "^-- libfsdp: tests launch ranks with srun \(" "$log"
expect "the batch script ran on a simulated node" zero \
  "^gpu4.sbatch: job [0-9]+ on ${slurm_nodes[0]} \(cpu\): .* nodes ${slurm_nodes[0]%[0-9]*}\[1-2\], 4 tasks" "$log"
expect "every entry passed" zero "^100% tests passed, 0 tests failed out of [0-9]+" "$log"
n=$(sed -n 's/^100% tests passed, 0 tests failed out of \([0-9]*\).*/\1/p' "$log")
if [ -n "$n" ] && [ "$n" -ge "$min_tests" ]; then
  echo "ok: $n entries ran under srun (at least $min_tests)"
else
  echo "FAIL: ${n:-no} entries passed; expected at least $min_tests"
  fail=1
fi
# The entries' ranks were srun's tasks (CTest's LastTest.log has every
# entry's command line and output): no command runs mpiexec, and the fault
# entry whose rank dies is reported by srun, naming the node.
last="$build/Testing/Temporary/LastTest.log"
if [ -f "$last" ]; then
  n_srun=$(grep -cE '^Command: .*srun("? "|;)--ntasks' "$last" || true)
  n_mpiexec=$(grep -c '^Command: .*mpiexec' "$last" || true)
  if [ "$n_srun" -ge "$min_tests" ] && [ "$n_mpiexec" -eq 0 ]; then
    echo "ok: $n_srun command lines start srun, none mpiexec ($last)"
  else
    echo "FAIL: $n_srun command lines start srun, $n_mpiexec mpiexec ($last)"; fail=1
  fi
  if grep -Eq "srun: error: ${slurm_nodes[0]%[0-9]*}[0-9]+: task 1: Killed" "$last"; then
    echo "ok: fault_kill_np2's dead rank reported by srun: $(grep -Em1 'srun: error: .*task 1: Killed' "$last")"
  else
    echo "FAIL: no 'srun: error: <node>: task 1: Killed' in $last (fault_kill_np2)"; fail=1
  fi
else
  echo "FAIL: no $last"; fail=1
fi
[ "$rc" -eq 0 ] || { echo "FAIL: sbatch --wait exit status $rc"; fail=1; }
finish "slurm-sbatch-ctest-check (gpu4.sbatch --cpu: ctest -L cpu -L '$labels' -R '$regex' under srun)"
