#!/usr/bin/env bash
# Installs pip's LibTorch 2.x (the CUDA wheel) into a virtual environment and
# prints its CMake prefix (for -DCMAKE_PREFIX_PATH) on the last line:
#
#   ci/pip-torch.sh [--python] <venv-dir> # FSDP_PIP_TORCH=2.15.0 by default
#
# --python also installs what `import torch` needs (torch's pure-Python
# requirements: typing-extensions, sympy, ...; and numpy), for the PyTorch FSDP2 / DDP
# benchmark peer (tools/fsdp-bench/peers/); a C++ build does not need it.
#
# The wheel's full dependency set (cuDNN, cuBLAS, Triton, ...) is several GB; a
# C++ build needs only the libraries libtorch_cuda.so links that the CUDA
# toolkit on this machine lacks (cuFile, cuSPARSELt, NVSHMEM) and NCCL. They are
# installed at the versions torch's own metadata pins. Where the toolkit is
# missing too (ldd still finds a library missing), the full set is installed.
set -euo pipefail
with_python=0
if [ "${1:-}" = "--python" ]; then
  with_python=1
  shift
fi
if [ $# -ne 1 ]; then
  echo "usage: $0 [--python] <venv-dir>" >&2
  exit 2
fi
venv="$1"
version="${FSDP_PIP_TORCH:-2.15.0}"
python="${PYTHON:-python3}"

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
py="$venv/bin/python"
if ! "$py" -m pip show torch 2>/dev/null | grep -qx "Version: $version"; then
  "$py" -m pip install -q --disable-pip-version-check --no-deps "torch==$version"
fi

# Importing torch needs its Python dependencies; the metadata does not.
read -r -a pins < <("$py" - <<'PY'
from importlib.metadata import requires
wanted = ("nvidia-nccl", "nvidia-cusparselt", "nvidia-nvshmem")
pins = []
for r in requires("torch") or []:
    spec = r.split(";")[0].strip()
    name = spec.split("=")[0].split("[")[0].split("<")[0].split(">")[0].strip()
    if name.startswith(wanted):
        pins.append(spec.replace(" ", ""))
    elif name == "cuda-toolkit":
        # cuda-toolkit[cublas,...]==X: only cuFile is missing from the toolkit.
        pins.append("cuda-toolkit[cufile]==" + spec.split("==")[1].strip())
print(" ".join(pins))
PY
)
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ ! -e "$site/nvidia/nccl/lib/libnccl.so.2" ] || [ ! -e "$site/nvidia/nvshmem" ]; then
  "$py" -m pip install -q --disable-pip-version-check "${pins[@]}"
fi

missing="$(ldd "$site/torch/lib/libtorch_cuda.so" | awk '/not found/ {print $1}' | sort -u)"
if [ -n "$missing" ]; then
  echo "pip-torch: libtorch_cuda.so needs $(echo $missing): installing torch's full dependency set" >&2
  "$py" -m pip install -q --disable-pip-version-check "torch==$version"
  missing="$(ldd "$site/torch/lib/libtorch_cuda.so" | awk '/not found/ {print $1}' | sort -u)"
  if [ -n "$missing" ]; then
    echo "pip-torch: still missing for libtorch_cuda.so: $(echo $missing)" >&2
    exit 1
  fi
fi
if [ "$with_python" -eq 1 ]; then
  read -r -a python_deps < <("$py" - <<'PY'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement  # pip always has it
deps = []
for r in requires("torch") or []:
    req = Requirement(r)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.startswith(("nvidia-", "cuda-", "triton")):
        continue  # the GPU runtime: not needed to import torch on a CPU
    deps.append(str(req).replace(" ", ""))
# Not declared by torch, but torch.distributed's object collectives
# (broadcast_object_list) need it.
deps.append("numpy")
print(" ".join(deps))
PY
  )
  "$py" -m pip install -q --disable-pip-version-check "${python_deps[@]}"
  "$py" -c 'import torch.distributed.fsdp' || exit 1
fi
echo "pip-torch: torch $version in $venv (NCCL: $site/nvidia/nccl)" >&2
echo "$site/torch/share/cmake"
