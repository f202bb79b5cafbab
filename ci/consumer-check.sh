#!/usr/bin/env bash
# Proves the installed package works for a user's project:
#   ci/consumer-check.sh <build-dir> <source-dir>
# installs <build-dir> into a temporary prefix, configures and builds
# <source-dir>/examples/consumer with find_package(libfsdp) against it, and runs
# it with `mpiexec -n 2`. CTest runs it as consumer_project (labels cpu, packaging).
# Env: CMAKE, MPIEXEC (and MPIEXEC_FLAGS), CXX, CCACHE (default: from PATH).
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 <build-dir> <source-dir>" >&2
  exit 2
fi
build="$(cd "$1" && pwd)"
src="$(cd "$2" && pwd)"
cmake="${CMAKE:-cmake}"
mpiexec="${MPIEXEC:-mpiexec}"
read -r -a mpiexec_flags <<<"${MPIEXEC_FLAGS:-}"
ccache="${CCACHE:-$(command -v ccache || true)}"

tmp="$(mktemp -d "${TMPDIR:-/tmp}/libfsdp-consumer.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
prefix="$tmp/prefix"

echo "consumer-check: installing $build into $prefix"
"$cmake" --install "$build" --prefix "$prefix" >"$tmp/install.log" || {
  cat "$tmp/install.log"; exit 1; }

# The installed package must not point back into the build or source tree.
if grep -rlF --include='*.cmake' -e "$build" -e "$src" "$prefix"; then
  echo "consumer-check: the installed CMake files above name $build or $src" >&2
  exit 1
fi

# LibTorch is found the way the main build found it: its CMAKE_PREFIX_PATH
# (e.g. a pip torch's) goes after the libfsdp prefix.
prefix_path="$prefix"
main_prefix_path="$(sed -n 's/^CMAKE_PREFIX_PATH:[A-Z]*=//p' "$build/CMakeCache.txt")"
[ -z "$main_prefix_path" ] || prefix_path="$prefix_path;$main_prefix_path"
# Likewise the NCCL the main build linked (the package's libfsdp::nccl).
main_nccl="$(sed -n 's/^NCCL_LIBRARY:[A-Z]*=//p' "$build/CMakeCache.txt")"

args=(-S "$src/examples/consumer" -B "$tmp/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo
      "-DCMAKE_PREFIX_PATH=$prefix_path")
case "$main_nccl" in ""|*NOTFOUND) ;; *) args+=("-DNCCL_LIBRARY=$main_nccl") ;; esac
[ -z "${CXX:-}" ] || args+=("-DCMAKE_CXX_COMPILER=$CXX")
if [ -n "$ccache" ]; then
  args+=("-DCMAKE_CXX_COMPILER_LAUNCHER=$ccache")
  # Hit the cache across runs although each run has a new temporary directory.
  export CCACHE_BASEDIR="$tmp" CCACHE_NOHASHDIR=1
fi
echo "consumer-check: configuring examples/consumer"
"$cmake" "${args[@]}"
"$cmake" --build "$tmp/build" -j "$(nproc)"

echo "consumer-check: running mpiexec -n 2 consumer"
"$mpiexec" -n 2 "${mpiexec_flags[@]}" "$tmp/build/consumer"
echo "consumer-check: OK"
