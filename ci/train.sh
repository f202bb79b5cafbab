#!/usr/bin/env bash
# The main job: installs dependencies if missing, builds fsdp-train into the
# same build directory as ci/test.sh (${BUILD_DIR:-build}: incremental either
# way), and trains the byte-level decoder LM on 2 ranks. Arguments go to
# fsdp-train (see `ci/train.sh --help`), e.g.
#
#   ci/train.sh                                # 100 steps, outputs in fsdp-train-out/
#   ci/train.sh --mp bf16 --ac all --verify
#   ci/train.sh --steps 200 --resume
#
# Env: NP (ranks, default 2; HSDP --mesh 2x2 needs NP=4), BUILD_DIR.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
np="${NP:-2}"

"$root/ci/install-deps.sh"
if [ ! -f "$build/CMakeCache.txt" ]; then
  # Configured as ci/build.sh does; only the training job is built here.
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFSDP_WARNINGS_AS_ERRORS=ON \
    -DFSDP_MINIMAL_DEBUG_INFO=ON
fi
cmake --build "$build" -j "$(nproc)" --target fsdp-train

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
extra=()
[ "$np" -le "$(nproc)" ] || extra+=(--oversubscribe)

out="fsdp-train-out"
prev=""
for a in "$@"; do
  case "$a" in
    --out=*) out="${a#--out=}" ;;
  esac
  [ "$prev" = "--out" ] && out="$a"
  prev="$a"
done

start=$(date +%s)
status=0
mpiexec -n "$np" "${extra[@]}" "$build/tools/fsdp-train/fsdp-train" "$@" || status=$?
echo "ci/train.sh: fsdp-train exited with $status after $(($(date +%s) - start))s on $np ranks;" \
     "outputs in $(cd "$out" 2>/dev/null && pwd || echo "$out")/ (loss.png, loss.csv, checkpoint/)"
exit "$status"
