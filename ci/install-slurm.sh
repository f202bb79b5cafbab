#!/usr/bin/env bash
# What the slurm tests need beyond ci/install-deps.sh: Debian's Slurm
# (slurmctld, slurmd, srun with the PMIx plugin) and munge. CI (.ci/run)
# installs them; `ctest -L slurm` then runs real jobs on a simulated cluster
# (ci/slurm/cluster, docs/slurm.md).
set -euo pipefail
sudo=""
[ "$(id -u)" -eq 0 ] || sudo=sudo
packages=(slurm-wlm munge)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi
echo "ci/install-slurm.sh: slurm-wlm $(dpkg-query -W -f='${Version}' slurm-wlm), munge $(dpkg-query -W -f='${Version}' munge)"
