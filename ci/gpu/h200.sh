#!/usr/bin/env bash
# The prepared single-H200 run (libfsdp issue 18). Runs THERE, on the device
# machine, from the repository root, with build-gpu-bundle/ (ci/gpu/bundle.sh,
# made on Debian 12) carried next to the working tree:
#
#   ci/gpu/h200.sh             # checks, configures, builds, runs; everything under $OUT
#   ci/gpu/h200.sh --dry-run   # prints every command and its environment, runs nothing
#
# Steps (each under `timeout`, wall time and PASS/FAIL/SKIP printed; a step
# that would start past the budget is skipped), about 8 minutes in all:
#   probe      what is present: nvidia-smi, python3 torch (+ version, CUDA), nvcc,
#              cmake, g++, the bundle (glibc / libstdc++ it needs), its mpiexec
#   configure  -DCMAKE_PREFIX_PATH=<torch>;<bundle>/usr -DFSDP_WITH_NCCL=ON,
#              MPI / HDF5 / Boost / CLI11 / fmt / nlohmann-json from the bundle
#   build      -j$(nproc), only the targets it runs
#   gpu1       ctest -L gpu1: the suites that run at world size 1, on CUDA tensors
#              with NCCL (FSDP_TEST_DEVICE=cuda), and the fp16 forms of L1-12 /
#              L1-13 (test_fully_shard_precision_fp16_gpu1); JUnit per suite
#   train      mpiexec -n 1 fsdp-train --device cuda --mp bf16 (tokens/s)
#   bench      mpiexec -n 1 fsdp-bench train --device cuda --configs
#              single,fsdp,fsdp-no-reshard: the world-1 FSDP step against the
#              plain LibTorch step on the same model (target <= 1.03x)
# Writes $OUT/summary.txt (the table), $OUT/logs/<step>.log, $OUT/junit/*.xml,
# $OUT/ctest-gpu1.xml, $OUT/reports/ (precision records), $OUT/env.txt.
#
# Knobs: OUT (default build-gpu/out), BUILD_DIR (build-gpu), BUNDLE_DIR
# (build-gpu-bundle), TORCH_PREFIX (torch's CMake prefix; default asks python3),
# NCCL_HOME (default: pip's nvidia-nccl inside torch's site-packages),
# H200_BUDGET_S (480), H200_BUILD_S (the build step's limit, 300), JOBS (nproc),
# TRAIN_STEPS (20), H200_TARGETS / H200_CTEST_REGEX (a rerun of a few suites).
set -uo pipefail

dry=0
for a in "$@"; do
  case "$a" in
    --dry-run|-n) dry=1 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "h200.sh: unknown argument '$a' (accepted: --dry-run)" >&2; exit 2 ;;
  esac
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root" || exit 2
out="${OUT:-$root/build-gpu/out}"
build="${BUILD_DIR:-$root/build-gpu}"
bundle="${BUNDLE_DIR:-$root/build-gpu-bundle}"
bprefix="$bundle/usr"
arch_dir="lib/x86_64-linux-gnu"
budget="${H200_BUDGET_S:-480}"
jobs="${JOBS:-$(nproc 2>/dev/null || echo 4)}"
train_steps="${TRAIN_STEPS:-20}"
tps=""
t_start=$SECONDS

if [ "$dry" = 0 ]; then
  mkdir -p "$out/logs" "$out/junit" "$out/reports"
  : > "$out/summary.txt.rows"
fi

say() { echo "h200: $*"; }
# One line per probe: "h200: <what>: <found / MISSING ...>".
present() { printf 'h200: %-10s %s\n' "$1:" "$2"; }

rows=()
record() {  # step status seconds note
  rows+=("$(printf '%-10s %-5s %6ss  %s' "$1" "$2" "$3" "$4")")
  [ "$dry" = 1 ] || printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$out/summary.txt.rows"
}

# run_step NAME TIMEOUT_S NOTE cmd...: the command under `timeout`, output to
# $OUT/logs/NAME.log (and the last lines on stdout), PASS on exit 0.
run_step() {
  local name="$1" limit="$2" note="$3"
  shift 3
  if [ "$dry" = 1 ]; then
    printf '[dry-run] step %s (timeout %ss): %s\n' "$name" "$limit" "$*"
    record "$name" DRY 0 "$note"
    return 0
  fi
  local left=$((budget - (SECONDS - t_start)))
  if [ "$left" -lt 20 ]; then
    say "$name: SKIP (budget: ${left}s of ${budget}s left)"
    record "$name" SKIP 0 "budget spent"
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit="$left"
  say "$name: start (timeout ${limit}s): $*"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" > "$out/logs/$name.log" 2>&1
  rc=$?
  local dt=$((SECONDS - t0)) status=PASS
  [ "$rc" -eq 0 ] || status=FAIL
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && note="timeout after ${limit}s; $note"
  tail -n 25 "$out/logs/$name.log" | sed "s/^/  [$name] /"
  say "$name: $status (rc $rc) in ${dt}s"
  record "$name" "$status" "$dt" "$note (log: logs/$name.log)"
  return "$rc"
}

# ---------------------------------------------------------------- probe
say "repository $root; out $out; build $build; bundle $bundle; budget ${budget}s; jobs $jobs"
if [ "$dry" = 1 ]; then
  say "dry run: nothing below is executed; the probes would run:"
  printf '[dry-run] probe: %s\n' "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader" \
    "python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.utils.cmake_prefix_path)'" \
    "nvcc --version" "cmake --version" "g++ --version" "cat $bundle/MANIFEST" \
    "ldd --version (glibc >= MANIFEST glibc_min)" "$bprefix/bin/mpiexec --version"
  torch_prefix="${TORCH_PREFIX:-<python3 -c 'import torch;print(torch.utils.cmake_prefix_path)'>}"
  nccl_home="${NCCL_HOME:-<torch site-packages>/nvidia/nccl}"
  cmake_bin="cmake"
  cuda_bin="$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")"
else
  ok_probe=1
  if command -v nvidia-smi >/dev/null; then
    present nvidia-smi "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2 | tr '\n' ' ')"
    nvidia-smi > "$out/nvidia-smi.txt" 2>&1
  else
    present nvidia-smi "MISSING"
  fi
  torch_line="$(python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count(), torch.utils.cmake_prefix_path)' 2>&1 | tail -1)"
  if [ -n "${TORCH_PREFIX:-}" ]; then
    torch_prefix="$TORCH_PREFIX"
    present torch "TORCH_PREFIX=$torch_prefix (python3 says: $torch_line)"
  elif read -r tv tcuda tavail tcount torch_prefix <<<"$torch_line" && [ -d "${torch_prefix:-/nonexistent}" ]; then
    present torch "$tv, CUDA $tcuda, cuda available $tavail, $tcount device(s); CMake prefix $torch_prefix"
    [ "$tavail" = True ] || say "warning: torch sees no CUDA device"
  else
    present torch "MISSING (python3: $torch_line)"; ok_probe=0; torch_prefix=""
  fi
  if command -v nvcc >/dev/null; then
    cuda_bin="$(dirname "$(command -v nvcc)")"
    present nvcc "$(nvcc --version | grep -o 'release [0-9.]*' | head -1) at $(command -v nvcc)"
  elif [ -x /usr/local/cuda/bin/nvcc ]; then
    cuda_bin=/usr/local/cuda/bin
    present nvcc "$(/usr/local/cuda/bin/nvcc --version | grep -o 'release [0-9.]*' | head -1) at /usr/local/cuda/bin/nvcc (not on PATH)"
  else
    cuda_bin=""; present nvcc "MISSING (set CUDAToolkit_ROOT)"; ok_probe=0
  fi
  cmake_bin=""
  for c in cmake "$bprefix/bin/cmake"; do
    v="$("$c" --version 2>/dev/null | head -1 | grep -oE '[0-9]+\.[0-9]+(\.[0-9]+)?')" || continue
    if [ "$(printf '%s\n' 3.22 "$v" | sort -V | head -1)" = 3.22 ]; then cmake_bin="$(command -v "$c")"; break; fi
    say "cmake $v at $c is older than 3.22"
  done
  if [ -n "$cmake_bin" ]; then present cmake "$("$cmake_bin" --version | head -1) at $cmake_bin"; else present cmake "MISSING (>= 3.22; BUNDLE_CMAKE=1 ci/gpu/bundle.sh bundles one)"; ok_probe=0; fi
  if command -v g++ >/dev/null; then present g++ "$(g++ --version | head -1)"; else present g++ "MISSING"; ok_probe=0; fi
  if [ -f "$bundle/MANIFEST" ]; then
    glibc_min="$(sed -n 's/^glibc_min=//p' "$bundle/MANIFEST")"
    glibcxx_min="$(sed -n 's/^glibcxx_min=//p' "$bundle/MANIFEST")"
    glibc_have="$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')"
    present bundle "$bundle ($(du -sh "$bundle" | cut -f1); needs glibc $glibc_min, GLIBCXX_$glibcxx_min)"
    if [ "$(printf '%s\n' "$glibc_min" "$glibc_have" | sort -V | head -1)" != "$glibc_min" ]; then
      present glibc "$glibc_have: TOO OLD for the bundle (Debian 12 needs $glibc_min)"; ok_probe=0
    else
      present glibc "$glibc_have (>= $glibc_min)"
    fi
    libstdcxx="$(g++ -print-file-name=libstdc++.so.6 2>/dev/null)"
    if [ -n "$libstdcxx" ] && grep -aq "GLIBCXX_$glibcxx_min" "$(readlink -f "$libstdcxx")" 2>/dev/null; then
      present libstdc++ "$(readlink -f "$libstdcxx") has GLIBCXX_$glibcxx_min"
    else
      present libstdc++ "$libstdcxx: GLIBCXX_$glibcxx_min NOT FOUND (Boost.Test/HDF5 C++ may not load)"
    fi
  else
    present bundle "MISSING: $bundle/MANIFEST (run ci/gpu/bundle.sh on Debian 12 and carry build-gpu-bundle)"; ok_probe=0
  fi
  if [ -z "${NCCL_HOME:-}" ] && [ -n "$torch_prefix" ]; then
    site="$(cd "$torch_prefix/../../.." 2>/dev/null && pwd)"   # <site>/torch/share/cmake
    ncclso="$(find "$site/nvidia" -name 'libnccl.so*' 2>/dev/null | head -1)"
    [ -n "$ncclso" ] && NCCL_HOME="$(dirname "$(dirname "$ncclso")")"
  fi
  nccl_home="${NCCL_HOME:-}"
  if [ -n "$nccl_home" ] && [ -f "$nccl_home/include/nccl.h" ]; then
    present nccl "$(grep -E '^#define NCCL_(MAJOR|MINOR|PATCH) ' "$nccl_home/include/nccl.h" | awk '{print $3}' | paste -sd.) at $nccl_home"
  else
    present nccl "MISSING (no nccl.h under '${nccl_home}'; set NCCL_HOME)"; ok_probe=0
  fi
fi

# ---------------------------------------------------------------- environment
# The bundle's Open MPI, relocated; one node, shared memory and TCP only
# (bundle.sh drops the UCX/OFI/PSM components). HDF5's curl/crypto stubs are
# found through libhdf5's RUNPATH, not LD_LIBRARY_PATH.
env_vars=(
  "OPAL_PREFIX=$bprefix"
  "PATH=$bprefix/bin${cuda_bin:+:$cuda_bin}:$PATH"
  "LD_LIBRARY_PATH=$bprefix/$arch_dir:$bprefix/$arch_dir/openmpi/lib:$bprefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  "NCCL_HOME=$nccl_home"
  "OMPI_ALLOW_RUN_AS_ROOT=1" "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
  "OMPI_MCA_plm_rsh_agent=false"
  "OMPI_MCA_pml=ob1" "OMPI_MCA_btl=self,vader,tcp"
  "OMPI_MCA_btl_vader_single_copy_mechanism=none"
  "TORCH_CUDA_ARCH_LIST=9.0"
  "FSDP_TEST_TIMEOUT=120"
)
say "environment:"
for v in "${env_vars[@]}"; do
  echo "  export $v"
  [ "$dry" = 1 ] || export "${v?}"
done
[ "$dry" = 1 ] || printf '%s\n' "${env_vars[@]}" > "$out/env.txt"

targets=(test_dtensor test_fully_shard_runtime test_fully_shard_module test_tensor_parallel
         test_moe test_pipeline_schedule test_reference_store test_fully_shard_precision fsdp-train fsdp-bench)
# A rerun of a few suites: H200_TARGETS="test_moe test_reference_store" builds
# only those and H200_CTEST_REGEX limits the gpu1 step; train and bench run
# only when their tools are among the targets.
if [ -n "${H200_TARGETS:-}" ]; then read -r -a targets <<< "$H200_TARGETS"; fi
ctest_filter=()
[ -n "${H200_CTEST_REGEX:-}" ] && ctest_filter=(-R "$H200_CTEST_REGEX")
has_target() { [[ " ${targets[*]} " == *" $1 "* ]]; }
cmake_args=(
  -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release
  "-DCMAKE_PREFIX_PATH=$torch_prefix;$bprefix"
  -DFSDP_WITH_NCCL=ON
  -DFSDP_BUILD_TOOLS=ON
  "-DMPI_CXX_COMPILER=$bprefix/bin/mpicxx.openmpi"
  "-DMPI_C_COMPILER=$bprefix/bin/mpicc.openmpi"
  "-DMPIEXEC_EXECUTABLE=$bprefix/bin/mpiexec"
  "-DHDF5_ROOT=$bprefix/$arch_dir/hdf5/serial"
  -DHDF5_NO_FIND_PACKAGE_CONFIG_FILE=ON
  "-DBoost_DIR=$bprefix/$arch_dir/cmake/Boost-1.74.0"
  -DBoost_NO_SYSTEM_PATHS=ON
  "-DCLI11_DIR=$bprefix/share/cmake/CLI11"
  "-Dnlohmann_json_DIR=$bprefix/share/cmake/nlohmann_json"
  "-Dfmt_DIR=$bprefix/$arch_dir/cmake/fmt"
  ${cuda_bin:+"-DCUDAToolkit_ROOT=$(dirname "$cuda_bin")"}
)
# torch's own NCCL (pip ships only libnccl.so.2; a libnccl.so next to the CUDA
# toolkit would otherwise win the search and mismatch torch's).
if [ -n "$nccl_home" ]; then
  cmake_args+=("-DNCCL_INCLUDE_DIR=$nccl_home/include" "-DNCCL_LIBRARY=$nccl_home/lib/libnccl.so.2")
fi

if [ "$dry" = 0 ] && [ "$ok_probe" = 0 ]; then
  say "probe: something required is MISSING (above); trying anyway"
fi
: "${cmake_bin:=cmake}"

# ---------------------------------------------------------------- configure / build
configured=1
run_step configure 150 "CMake against the bundle" "$cmake_bin" "${cmake_args[@]}" || configured=0
if [ "$dry" = 0 ] && [ "$configured" = 1 ]; then
  grep -E '^-- libfsdp:|MPI|HDF5|Boost|NCCL' "$out/logs/configure.log" | sed 's/^/  [paths] /' | head -20
  cp "$build/CMakeCache.txt" "$out/CMakeCache.txt" 2>/dev/null
fi
built=1
if [ "$configured" = 1 ]; then
  run_step build "${H200_BUILD_S:-300}" "${#targets[@]} targets, -j$jobs" "$cmake_bin" --build "$build" -j "$jobs" --target "${targets[@]}" || built=0
else
  record build SKIP 0 "configure failed"; built=0
fi

# ---------------------------------------------------------------- tests at world size 1 on CUDA
ctest_bin="$(dirname "$(command -v "$cmake_bin" 2>/dev/null || echo cmake)")/ctest"
[ -x "$ctest_bin" ] || ctest_bin=ctest
if [ "$built" = 1 ]; then
  [ "$dry" = 1 ] || rm -f "$build"/junit/*.xml
  run_step gpu1 200 "ctest -L gpu1 (np 1, FSDP_TEST_DEVICE=cuda, NCCL)" \
    "$ctest_bin" --test-dir "$build" -L gpu1 "${ctest_filter[@]}" --output-on-failure --no-tests=error \
    --timeout 150 --output-junit "$out/ctest-gpu1.xml"
  if [ "$dry" = 0 ]; then
    cp "$build"/junit/*.xml "$out/junit/" 2>/dev/null
    cp -r "$build/reports/raw" "$out/reports/" 2>/dev/null
    grep -E '^ *[0-9]+/[0-9]+ Test|tests passed|tests failed' "$out/logs/gpu1.log" | sed 's/^/  [gpu1] /'
  fi
else
  record gpu1 SKIP 0 "build failed"
fi

# ---------------------------------------------------------------- fsdp-train --mp bf16
if [ "$built" = 1 ] && ! has_target fsdp-train; then
  record train SKIP 0 "not among H200_TARGETS"
elif [ "$built" = 1 ]; then
  run_step train 90 "fsdp-train --device cuda --mp bf16 at np 1" \
    "$bprefix/bin/mpiexec" -n 1 --bind-to none "$build/tools/fsdp-train/fsdp-train" \
    --device cuda --mp bf16 --steps "$train_steps" --log-every 5 --out "$out/train"
  if [ "$dry" = 0 ]; then
    tps="$(grep -oE '[0-9]+ tok/s over the run' "$out/logs/train.log" | tail -1)"
    say "train: ${tps:-no tok/s line}"
  fi
else
  record train SKIP 0 "build failed"
fi

# ---------------------------------------------------------------- world-1 FSDP vs plain step
bench_rows=""
if [ "$built" = 1 ] && ! has_target fsdp-bench; then
  record bench SKIP 0 "not among H200_TARGETS"
elif [ "$built" = 1 ]; then
  run_step bench 90 "fsdp-bench train --device cuda at np 1: fsdp vs single (target <= 1.03x)" \
    "$bprefix/bin/mpiexec" -n 1 --bind-to none "$build/tools/fsdp-bench/fsdp-bench" train \
    --device cuda --configs single,fsdp,fsdp-no-reshard --warmup 3 --steps 10 \
    --json "$out/bench-train.json"
  if [ "$dry" = 0 ]; then
    bench_rows="$(grep -E '^(# +config| +(single|fsdp|fsdp-no-reshard) )' "$out/logs/bench.log")"
    printf '%s\n' "$bench_rows" | sed 's/^/  [bench] /'
  fi
else
  record bench SKIP 0 "build failed"
fi

# ---------------------------------------------------------------- summary
total=$((SECONDS - t_start))
summary_file="$out/summary.txt"
if [ "$dry" = 1 ]; then summary_file="$(mktemp)"; fi
{
  echo "libfsdp H200 run, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(hostname 2>/dev/null), total ${total}s of ${budget}s"
  printf '%-10s %-5s %7s  %s\n' step status wall note
  if [ "$dry" = 1 ]; then printf '%s\n' "${rows[@]}"; else
    while IFS=$'\t' read -r s st t n; do printf '%-10s %-5s %6ss  %s\n' "$s" "$st" "$t" "$n"; done < "$out/summary.txt.rows"
  fi
} > "$summary_file"
if [ "$dry" = 0 ]; then
  rm -f "$out/summary.txt.rows"
  echo "fsdp-train --device cuda --mp bf16 (np 1): ${tps:-no tok/s line}" >> "$out/summary.txt"
  [ -n "$bench_rows" ] && printf 'fsdp-bench train (np 1, cuda):\n%s\n' "$bench_rows" >> "$out/summary.txt"
  grep -hE 'tests passed|tests failed' "$out/logs/gpu1.log" 2>/dev/null | sed 's/^/gpu1: /' >> "$out/summary.txt"
  echo; cat "$out/summary.txt"
  grep -qE '^(configure|build|gpu1|train|bench) +FAIL' "$out/summary.txt" && exit 1
else
  cat "$summary_file"; rm -f "$summary_file"
fi
exit 0
