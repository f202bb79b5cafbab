#!/usr/bin/env bash
# libfsdp against PyTorch's own FSDP2 and DDP in one command: installs pip's
# torch with Python (ci/pip-torch.sh --python), builds fsdp-bench against that
# same LibTorch, and runs compare.py with the arguments given, e.g.
#
#   tools/fsdp-bench/peers/vs-pytorch.sh --np 2,4 --dtypes float32,bfloat16
#
# Env: TORCH2_BUILD_DIR (default build-torch2: venv/ and bench/ under it),
# FSDP_PIP_TORCH (the torch version, ci/pip-torch.sh's default otherwise).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
build="${TORCH2_BUILD_DIR:-$root/build-torch2}"

"$root/ci/install-deps.sh" >&2
prefix="$("$root/ci/pip-torch.sh" --python "$build/venv" | tail -n 1)"
site="$(dirname "$(dirname "$(dirname "$prefix")")")"
# libtorch_cuda.so links the wheel's NCCL: without it the linker would take
# an older system NCCL and fail on symbols it lacks.
export NCCL_HOME="$site/nvidia/nccl"
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
cmake -S "$root" -B "$build/bench" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" -DFSDP_WITH_NCCL=AUTO >&2
cmake --build "$build/bench" -j "$(nproc)" --target fsdp-bench >&2

exec "$build/venv/bin/python" "$root/tools/fsdp-bench/peers/compare.py" \
  --fsdp-bench "$build/bench/tools/fsdp-bench/fsdp-bench" --mpiexec-args "--bind-to none" "$@"
