#!/usr/bin/env bash
# The LibTorch 2.x leg of CI: pip's CUDA LibTorch (ci/pip-torch.sh, in a virtual
# environment under the build tree), the NCCL backend built and linked against
# it, and the L0, L1 and L2 suites run on CPU tensors (the CUDA wheel runs
# without a GPU). Every L0-L2 executable is the one its gpu2/gpu4 entry runs,
# so linking them is the CUDA link check. Then fsdp-bench against the PyTorch
# FSDP2/DDP benchmark peer on the same torch (fsdp_bench_peer_parity_np2).
#
#   ci/test-torch2.sh                 # build in ${TORCH2_BUILD_DIR:-build-torch2}
#
# Env: FSDP_PIP_TORCH (torch version, default in ci/pip-torch.sh),
# FSDP_WITH_NCCL (ON; AUTO or OFF for a machine without the CUDA toolkit),
# TORCH2_LEVELS (test-plan levels, default "L0 L1 L2 dcp": distributed checkpoints key
# optimizer state differently on 2.x). Extra arguments go to ctest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${TORCH2_BUILD_DIR:-$root/build-torch2}"
read -r -a levels <<< "${TORCH2_LEVELS:-L0 L1 L2 dcp}"
label_regex="^($(IFS='|'; echo "${levels[*]}"))\$"
start=$SECONDS

"$root/ci/install-deps.sh"
prefix="$("$root/ci/pip-torch.sh" --python "$build/venv" | tail -n 1)"
site="$(dirname "$(dirname "$(dirname "$prefix")")")"
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
export NCCL_HOME="$site/nvidia/nccl"
echo "ci/test-torch2.sh: LibTorch from $prefix ($((SECONDS - start)) s)"

# -O2 without -g: the Debian leg's optimisation (GCC 12's -O3 raises a false
# -Wstringop-overflow in std::string), and -g would make the precompiled header 0.7 GB.
cmake -S "$root" -B "$build/build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" \
  -DFSDP_WARNINGS_AS_ERRORS=ON -DFSDP_WITH_NCCL="${FSDP_WITH_NCCL:-ON}" \
  -DFSDP_PEER_PYTHON="$build/venv/bin/python"

cd "$build/build"
# One aggregate target per level (mpi_tests/CMakeLists.txt): its suites build in parallel.
# train_mlp: the example its L1 entry runs (examples come with the tools).
cmake --build . -j "$(nproc)" --target "${levels[@]/#/fsdp_suites_}" train_mlp fsdp-bench
echo "ci/test-torch2.sh: built the ${levels[*]} suites, train_mlp and fsdp-bench ($((SECONDS - start)) s)"
gpu=$(ctest -N -L "$label_regex" -L 'gpu[124]' | sed -n 's/^Total Tests: //p')
echo "ci/test-torch2.sh: ${gpu:-0} gpu1/gpu2/gpu4 entries link against NCCL (not run: no GPU here)"

status=0
# The dcp label's fsdp-train and fsdp-checkpoint entries need programs this
# leg does not build (the Debian leg runs them); the library's dcp suites run.
# multinode_* (the suites on a simulated cluster of network namespaces) check
# placement and the network, which do not depend on the LibTorch version:
# the Debian leg runs them, and leaving them out here saves ~90 s of the ~320.
ctest -L "$label_regex" -L cpu -E '^(fsdp_train|fsdp_checkpoint|multinode)_' --output-on-failure \
  --no-tests=error --output-log ctest-torch2.log "$@" || status=$?
# libfsdp beside PyTorch's own FSDP2 and DDP on this LibTorch (the benchmark peer).
ctest -R '^fsdp_bench_peer_parity_np2$' --output-on-failure --no-tests=error || status=$?
echo "ci/test-torch2.sh: LibTorch $("$build/venv/bin/python" -m pip show torch | sed -n 's/^Version: //p') leg done in $((SECONDS - start)) s (exit $status)"
exit "$status"
