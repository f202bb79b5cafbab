#!/bin/bash
# rank-env.sh VAR VALUE0 VALUE1 PROGRAM [ARGS...]: run PROGRAM with VAR=VALUE0
# on rank 0 and VAR=VALUE1 on every other rank (cmake/Launcher.cmake's
# fsdp_launch_two_envs under srun, which has no MPMD command line of
# mpiexec's kind). The rank is the launcher's: SLURM_PROCID under srun,
# OMPI_COMM_WORLD_RANK under mpiexec.
set -eu
[ $# -ge 4 ] || { echo "usage: rank-env.sh VAR VALUE0 VALUE1 PROGRAM [ARGS...]" >&2; exit 2; }
var=$1 v0=$2 v1=$3
shift 3
rank=${OMPI_COMM_WORLD_RANK:-${SLURM_PROCID:-}}
[ -n "$rank" ] || { echo "rank-env.sh: neither OMPI_COMM_WORLD_RANK nor SLURM_PROCID is set" >&2; exit 2; }
if [ "$rank" = 0 ]; then export "$var=$v0"; else export "$var=$v1"; fi
exec "$@"
