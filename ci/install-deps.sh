#!/usr/bin/env bash
# Installs libfsdp's build and test dependencies from Debian 12's packages.
# Idempotent: does nothing when everything is already installed.
set -euo pipefail

packages=(
  build-essential cmake ccache
  libtorch-dev            # LibTorch 1.13 (CPU) with TorchConfig.cmake
  libopenblas0-pthread    # without it LibTorch's GEMMs use the reference BLAS (~14x slower)
  libopenmpi-dev openmpi-bin
  libboost-test-dev
  libhdf5-dev hdf5-tools
  libcli11-dev libfmt-dev nlohmann-json3-dev
  gnuplot-nox             # loss.png of fsdp-train (optional at run time)
  python3                 # checkpoint test scripts read index.json / safetensors headers; cmake/check_sizes.py (stdlib only)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "install-deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
