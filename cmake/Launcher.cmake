# How every CTest entry starts its ranks: with Open MPI's mpiexec (the
# default, FindMPI's MPIEXEC_EXECUTABLE) or with Slurm's srun
# (-DMPIEXEC_EXECUTABLE=$(command -v srun), inside an allocation: salloc, or
# ci/slurm/ctest.sbatch). docs/testing.md#launchers says what each entry
# gets; this file is the one place that knows the two launchers' flags.
#
#   FSDP_LAUNCHER                 "mpiexec" or "srun" (from MPIEXEC_EXECUTABLE's name)
#   fsdp_launch(<out> <np> [<mpiexec flags>...])
#       the command prefix that starts <np> ranks; append the program.
#       mpiexec: MPIEXEC -n <np> [--oversubscribe when <np> exceeds this
#                machine's cores] <flags> MPIEXEC_PREFLAGS
#       srun:    srun --ntasks <np> --nodes 1 --overcommit
#                [--export=ALL,VAR=VALUE,...] MPIEXEC_PREFLAGS -- Open MPI's
#                flags are not srun's: each `-x VAR=VALUE` becomes part of
#                --export, the others (--bind-to none, ...) are left out;
#                --overcommit lets more tasks than allocated CPUs share them,
#                as --oversubscribe does. --nodes 1: these entries are one-node
#                runs, as under mpiexec on one machine (their shared-memory,
#                topology and TP-inside-a-node checks say so); what runs
#                across nodes is in mpi_tests/multinode.cmake and label slurm.
#   fsdp_launch_env(<out> <np> [<mpiexec flags>...])
#       "MPIEXEC=<launcher>;MPIEXEC_FLAGS=<what follows -n <np>>" for the
#       test scripts, which run `$MPIEXEC -n <np> $MPIEXEC_FLAGS <program>`
#       (-n is both launchers' rank count).
#   fsdp_launch_two_envs(<out> <var> <value of rank 0> <value of rank 1> <program...>)
#       2 ranks whose environments differ in <var> (the settings-mismatch
#       tests): mpiexec's MPMD form; under srun, cmake/rank-env.sh picks the
#       value by rank.
#
# Under srun MPIEXEC_PREFLAGS defaults to --mpi=pmix --kill-on-bad-exit=1:
# Open MPI started directly by srun needs PMIx, and a rank that dies must end
# the step (mpiexec does that by itself).

get_filename_component(_fsdp_launcher_name "${MPIEXEC_EXECUTABLE}" NAME)
if(_fsdp_launcher_name STREQUAL "srun")
  set(FSDP_LAUNCHER srun)
  if(NOT MPIEXEC_PREFLAGS)
    set(MPIEXEC_PREFLAGS --mpi=pmix --kill-on-bad-exit=1)
  endif()
else()
  set(FSDP_LAUNCHER mpiexec)
endif()
cmake_host_system_information(RESULT FSDP_HOST_CORES QUERY NUMBER_OF_LOGICAL_CORES)
message(STATUS "libfsdp: tests launch ranks with ${FSDP_LAUNCHER} (${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} <n> ${MPIEXEC_PREFLAGS})")

# _fsdp_launch_flags(<out> <np> [flags...]): what follows "-n <np>".
function(_fsdp_launch_flags out np)
  set(_flags "")
  if(FSDP_LAUNCHER STREQUAL "srun")
    list(APPEND _flags --nodes 1 --overcommit)
    set(_exports "")
    set(_take_env OFF)
    foreach(_f IN LISTS ARGN)
      if(_take_env)
        list(APPEND _exports "${_f}")
        set(_take_env OFF)
      elseif(_f STREQUAL "-x")
        set(_take_env ON)
      endif()
    endforeach()
    if(_exports)
      string(REPLACE ";" "," _exports "${_exports}")
      list(APPEND _flags "--export=ALL,${_exports}")
    endif()
  else()
    if(np GREATER FSDP_HOST_CORES)
      list(APPEND _flags --oversubscribe)
    endif()
    list(APPEND _flags ${ARGN})
  endif()
  list(APPEND _flags ${MPIEXEC_PREFLAGS})
  set(${out} "${_flags}" PARENT_SCOPE)
endfunction()

function(fsdp_launch out np)
  _fsdp_launch_flags(_flags ${np} ${ARGN})
  set(${out} ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} ${_flags} PARENT_SCOPE)
endfunction()

function(fsdp_launch_env out np)
  _fsdp_launch_flags(_flags ${np} ${ARGN})
  string(REPLACE ";" " " _flags "${_flags}")
  set(${out} "MPIEXEC=${MPIEXEC_EXECUTABLE};MPIEXEC_FLAGS=${_flags}" PARENT_SCOPE)
endfunction()

function(fsdp_launch_two_envs out var value0 value1)
  if(FSDP_LAUNCHER STREQUAL "srun")
    fsdp_launch(_cmd 2)
    set(${out} ${_cmd} ${PROJECT_SOURCE_DIR}/cmake/rank-env.sh ${var} ${value0} ${value1} ${ARGN}
        PARENT_SCOPE)
  else()
    set(${out} ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 1 -x ${var}=${value0} ${ARGN} :
        ${MPIEXEC_NUMPROC_FLAG} 1 -x ${var}=${value1} ${ARGN} PARENT_SCOPE)
  endif()
endfunction()
