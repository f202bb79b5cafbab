#!/usr/bin/env bash
# The test command: installs dependencies, builds, and runs the CPU suites
# (`ctest -L cpu`). This is what .ci/run calls.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
export BUILD_DIR="$build"

start=$SECONDS
"$root/ci/install-deps.sh"
# GPU variants are registered (not run) so their listing is checked below.
"$root/ci/build.sh" -DFSDP_REGISTER_GPU_TESTS=ON
echo "ci/test.sh: dependencies and build: $((SECONDS - start)) s"

cd "$build"
# Every gpu label a GPU node runs must list entries; gpu_registration_listing
# (in `ctest -L cpu`) checks what they run.
for label in gpu1 gpu2 gpu4; do
  count=$(ctest -N -L "^${label}\$" | sed -n 's/^Total Tests: //p')
  if [ "${count:-0}" -eq 0 ]; then
    echo "ci/test.sh: no ${label} tests registered (ctest -N -L ${label})" >&2
    exit 1
  fi
  echo "ci/test.sh: ${count} ${label} test(s) registered (not run: no GPU here)"
done

status=0
tests=$SECONDS
ctest -L cpu --output-on-failure --no-tests=error --output-log "$build/ctest-cpu.log" "$@" || status=$?
echo "ci/test.sh: ctest -L cpu: $((SECONDS - tests)) s"
# precision_matrix_report (in -L cpu) is the precision gate: it fails the run when a
# matrix case did not run, lacks its loss or grad-norm metric, or fails.
if [ -f "$build/reports/precision-matrix.md" ]; then
  echo "ci/test.sh: precision matrix: $build/reports/precision-matrix.md (and .json):" \
    "$(grep -m1 '^\*\*Gate:' "$build/reports/precision-matrix.md" || echo 'no verdict')"
fi
exit "$status"
