#!/usr/bin/env bash
# Prints the N slowest entries (default 20) of the last `ctest` run in a build
# tree and their share of its total, from CTest's own Testing/Temporary/LastTest.log:
#
#   ci/slowest.sh <build dir> [N]
#
# .ci/run prints it after each leg, so a run's log says where its time went.
set -euo pipefail
build="${1:?usage: $0 <build dir> [N]}"
n="${2:-20}"
log="$build/Testing/Temporary/LastTest.log"
if [ ! -f "$log" ]; then
  echo "ci/slowest.sh: no $log (no ctest run in $build)"
  exit 0
fi
# LastTest.log has "N/M Testing: <name>" before an entry's output and
# "Test time = S sec" after it.
awk -v n="$n" '
  /^[0-9]+\/[0-9]+ Testing: / { name = $3 }
  /^Test time = / { t[name] = $4; total += $4; count++ }
  END {
    printf "ci/slowest.sh: %d entries, %.0f s of test time; the %d slowest:\n", count, total, n
    for (k in t) printf "%10.1f s  %s\n", t[k], k | "sort -rn | head -n " n
  }' "$log"
