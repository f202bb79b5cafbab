#!/usr/bin/env bash
# Prints the N slowest entries (default 20) of a ctest run and their share of
# its total, from the log ctest wrote with --output-log (its console lines
# "K/M Test #I: <name> ....   Passed   2.90 sec"):
#
#   ci/slowest.sh <ctest output log> [N]
#
# The CI legs pass --output-log <build>/ctest-<leg>.log and .ci/run prints
# this after each leg. (Not Testing/Temporary/LastTest.log: any `ctest -N`
# an entry runs in the same build tree overwrites it.)
set -euo pipefail
log="${1:?usage: $0 <ctest output log> [N]}"
n="${2:-20}"
if [ ! -f "$log" ]; then
  echo "ci/slowest.sh: no $log (the leg ran no ctest)"
  exit 0
fi
awk -v n="$n" '
  / Test +#[0-9]+: / && / sec$/ {
    for (i = 1; i <= NF; i++) if ($i ~ /^#[0-9]+:$/) { name = $(i + 1); break }
    t[name] = $(NF - 1); total += $(NF - 1); count++
  }
  END {
    printf "ci/slowest.sh: %d entries, %.0f s of test time; the %d slowest:\n", count, total, n
    for (k in t) printf "%10.1f s  %s\n", t[k], k | "sort -rn | head -n " n
  }' "$log"
