# consumer_project: installs this build into a temporary prefix, then builds
# and runs examples/consumer against it with find_package(libfsdp) -- the
# path a user takes (ci/consumer-check.sh).
fsdp_launch_env(_consumer_launch_env 2)
set(_fsdp_consumer_env
  "OMPI_ALLOW_RUN_AS_ROOT=1" "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1" "FSDP_NUM_THREADS=1"
  "CMAKE=${CMAKE_COMMAND}" ${_consumer_launch_env}
  "CXX=${CMAKE_CXX_COMPILER}")
if(CCACHE_PROGRAM)
  list(APPEND _fsdp_consumer_env "CCACHE=${CCACHE_PROGRAM}")
endif()
add_test(NAME consumer_project
         COMMAND "${PROJECT_SOURCE_DIR}/ci/consumer-check.sh"
                 "${PROJECT_BINARY_DIR}" "${PROJECT_SOURCE_DIR}")
set_tests_properties(consumer_project PROPERTIES
  LABELS "cpu;packaging" TIMEOUT 600 PROCESSORS 2 RUN_SERIAL ON
  ENVIRONMENT "${_fsdp_consumer_env}")
