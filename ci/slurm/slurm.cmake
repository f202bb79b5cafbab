# Real Slurm jobs on a simulated cluster on this one machine (included by
# tools/fsdp-train/CMakeLists.txt, where the fsdp-train target is)
# (ci/slurm/cluster: munged and slurmctld on the host, one slurmd per node,
# each node in its own network, UTS and mount namespaces on a private bridge;
# root needed). Label slurm (and nodes2), not cpu: .ci/run runs them after
# the cpu and LibTorch 2.x legs (ci/install-slurm.sh installs Slurm first),
# since the cluster's bridge and daemons must not share the machine with
# the other suites' jobs.
#
# The fixture slurm_cluster_up brings the cluster up under
# ${CMAKE_BINARY_DIR}/slurm-sim and slurm_cluster_down takes it down; every
# test (ci/slurm/tests/*-check.sh <fsdp-train> <work dir>) runs its jobs
# through it (a test run alone brings up and takes down a cluster of its own).
# A build tree under /tmp (a checkout there) cannot hold the state: every
# node has a /tmp of its own. Its state is then /var/lib/fsdp-slurm/<hash of
# the build dir>, and the nodes see the checkout and the build trees at their
# own paths (cluster up --share: bind-mounted into each node's /tmp).
# Where srun is not found at configure time the entries are still registered
# and fail, saying Slurm is missing: never skipped silently.
set(FSDP_SLURM_CLUSTER "${PROJECT_SOURCE_DIR}/ci/slurm/cluster")
set(FSDP_SLURM_TESTS "${PROJECT_SOURCE_DIR}/ci/slurm/tests")
get_filename_component(_build_real "${CMAKE_BINARY_DIR}" REALPATH)
if(_build_real MATCHES "^/tmp/")
  string(MD5 _build_hash "${_build_real}")
  string(SUBSTRING "${_build_hash}" 0 12 _build_hash)
  set(FSDP_SLURM_STATE "/var/lib/fsdp-slurm/${_build_hash}")
else()
  set(FSDP_SLURM_STATE "${CMAKE_BINARY_DIR}/slurm-sim")
endif()
# A miss is not cached: installing Slurm and re-running cmake finds it.
foreach(_p FSDP_SRUN FSDP_SLURMCTLD FSDP_SLURMD FSDP_MUNGED)
  if(NOT ${_p})
    unset(${_p} CACHE)
  endif()
endforeach()
find_program(FSDP_SRUN srun)
find_program(FSDP_SLURMCTLD slurmctld PATHS /usr/sbin /usr/local/sbin)
find_program(FSDP_SLURMD slurmd PATHS /usr/sbin /usr/local/sbin)
find_program(FSDP_MUNGED munged PATHS /usr/sbin /usr/local/sbin)

set(_slurm_missing "")
foreach(_p FSDP_SRUN FSDP_SLURMCTLD FSDP_SLURMD FSDP_MUNGED)
  if(NOT ${_p})
    string(REPLACE "FSDP_" "" _n "${_p}")
    string(TOLOWER "${_n}" _n)
    list(APPEND _slurm_missing ${_n})
  endif()
endforeach()
if(_slurm_missing)
  string(REPLACE ";" ", " _slurm_missing "${_slurm_missing}")
  message(STATUS "libfsdp: Slurm is missing (${_slurm_missing} not found): the slurm tests are registered to fail (Debian: apt-get install slurm-wlm munge)")
endif()

# fsdp_add_slurm_test(NAME <name> COMMAND <program> [args...] TIMEOUT <s> [FIXTURE_SETUP|FIXTURE_CLEANUP])
function(fsdp_add_slurm_test)
  cmake_parse_arguments(T "FIXTURE_SETUP;FIXTURE_CLEANUP" "NAME;TIMEOUT" "COMMAND" ${ARGN})
  if(_slurm_missing)
    set(T_COMMAND sh -c "echo 'FAIL: Slurm is missing: ${_slurm_missing} not found at configure time (Debian: apt-get install slurm-wlm munge, then re-run cmake)' && exit 1")
  endif()
  add_test(NAME ${T_NAME} COMMAND ${T_COMMAND})
  set_tests_properties(${T_NAME} PROPERTIES
    LABELS "slurm;nodes2" TIMEOUT ${T_TIMEOUT} RUN_SERIAL TRUE
    ENVIRONMENT "FSDP_TRAIN=$<TARGET_FILE:fsdp-train>;FSDP_BUILD_DIR=${CMAKE_BINARY_DIR};FSDP_SLURM_STATE=${FSDP_SLURM_STATE};FSDP_SLURM_CLUSTER=${FSDP_SLURM_CLUSTER};FSDP_NUM_THREADS=1;OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
  if(T_FIXTURE_SETUP)
    set_tests_properties(${T_NAME} PROPERTIES FIXTURES_SETUP slurm_cluster)
  elseif(T_FIXTURE_CLEANUP)
    set_tests_properties(${T_NAME} PROPERTIES FIXTURES_CLEANUP slurm_cluster)
  elseif(NOT _slurm_missing)  # (missing: every entry fails on its own, with the message)
    set_tests_properties(${T_NAME} PROPERTIES FIXTURES_REQUIRED slurm_cluster)
  endif()
endfunction()

# The nodes see these at their own paths even under /tmp: the scripts, the
# binaries and the tests' work dirs, and slurm_sbatch_ctest's build tree.
fsdp_add_slurm_test(NAME slurm_cluster_up FIXTURE_SETUP TIMEOUT 120
  COMMAND ${FSDP_SLURM_CLUSTER} up --nodes 2 --cpus 2 --rate 10gbit --state ${FSDP_SLURM_STATE}
          --share ${PROJECT_SOURCE_DIR} --share ${CMAKE_BINARY_DIR}
          --share ${CMAKE_BINARY_DIR}-slurm-ctest)
fsdp_add_slurm_test(NAME slurm_cluster_down FIXTURE_CLEANUP TIMEOUT 60
  COMMAND ${FSDP_SLURM_CLUSTER} down --state ${FSDP_SLURM_STATE})

# What users submit: ci/slurm/gpu4.sbatch --cpu configures a build of its own
# with srun as the CTest launcher, builds the suites it runs and runs
# ctest -L cpu -L 'L0|example' -R <a sample covering each kind> inside a
# 2-node allocation. Its build tree is
# a sibling of this one, at the same depth below the source: with ccache's
# base_dir (.ci/run sets CCACHE_BASEDIR) the compile commands are then the
# same and ccache serves this build's objects.
fsdp_add_slurm_test(NAME slurm_sbatch_ctest TIMEOUT 1200
  COMMAND ${FSDP_SLURM_TESTS}/sbatch-ctest-check.sh ${PROJECT_SOURCE_DIR}
          ${CMAKE_BINARY_DIR}-slurm-ctest ${CMAKE_CURRENT_BINARY_DIR}/slurm-sbatch-ctest)

# name:timeout. srun_train: 2 x (6 steps + verify); scancel: a stopped job,
# its resume and the straight run; time_limit: train.sbatch with a 1-minute
# limit, requeued 1-4 times (each start 20-50 s, 10-15 s between), then the
# straight run; node_loss: up to 90 s for the job to end after the loss, the
# resume and bringing the node back; bad_input: 2 jobs that fail at start-up.
foreach(_t "srun_train:300" "scancel:420" "time_limit:600" "node_loss:420" "bad_input:180")
  string(REPLACE ":" ";" _kv "${_t}")
  list(GET _kv 0 _id)
  list(GET _kv 1 _timeout)
  string(REPLACE "_" "-" _script "${_id}")
  fsdp_add_slurm_test(NAME slurm_${_id} TIMEOUT ${_timeout}
    COMMAND ${FSDP_SLURM_TESTS}/${_script}-check.sh $<TARGET_FILE:fsdp-train>
            ${CMAKE_CURRENT_BINARY_DIR}/slurm-${_script})
endforeach()
