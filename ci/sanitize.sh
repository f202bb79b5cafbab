#!/usr/bin/env bash
# The sanitize label: libfsdp and every suite below L3 built with
# AddressSanitizer + UndefinedBehaviorSanitizer (cmake/Sanitizers.cmake) into
# ${BUILD_DIR:-build-sanitize}, then `ctest -L sanitize`. Extra arguments go to
# ctest. Not part of .ci/run: the instrumented build and run take longer than
# CI allows on 2 cores (README, "Sanitizers").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build-sanitize}"

"$root/ci/install-deps.sh"
# -O1 keeps the instrumented suites fast enough and their stacks exact.
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
      -DFSDP_SANITIZE=ON -DFSDP_BUILD_TOOLS=OFF -DFSDP_WARNINGS_AS_ERRORS=ON
cmake --build "$build" -j "$(nproc)" --target fsdp_suites_sanitize
cd "$build"
ctest -L sanitize --output-on-failure --no-tests=error "$@"
