#!/usr/bin/env bash
# Configures and builds libfsdp into ${BUILD_DIR:-build}. Extra arguments go to cmake.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
# -g1 (FSDP_MINIMAL_DEBUG_INFO): backtraces keep their lines, the build is faster
# (docs/testing.md#ci-time).
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFSDP_WARNINGS_AS_ERRORS=ON \
  -DFSDP_MINIMAL_DEBUG_INFO=ON "$@"
cmake --build "$build" -j "$(nproc)"
