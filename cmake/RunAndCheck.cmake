# cmake -DCMD=<command;args...> -DEXPECT=zero|nonzero|<status> -DREGEX=<regex>
#       -P RunAndCheck.cmake
#
# Runs CMD and fails unless both its exit status is as EXPECT says (0, not 0,
# or exactly <status>) and its output (stdout and stderr together) matches
# REGEX. A CTest PASS_REGULAR_EXPRESSION alone would ignore the exit status.
if(NOT DEFINED CMD OR NOT DEFINED EXPECT OR NOT DEFINED REGEX)
  message(FATAL_ERROR
          "RunAndCheck.cmake needs -DCMD, -DEXPECT (zero|nonzero|<status>) and -DREGEX")
endif()
execute_process(COMMAND ${CMD} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
message("${out}")
if(EXPECT STREQUAL "zero" AND NOT rc STREQUAL "0")
  message(FATAL_ERROR "exit status ${rc}, expected 0")
elseif(EXPECT STREQUAL "nonzero" AND rc STREQUAL "0")
  message(FATAL_ERROR "exit status 0, expected a failure")
elseif(EXPECT MATCHES "^[0-9]+$" AND NOT rc STREQUAL EXPECT)
  message(FATAL_ERROR "exit status ${rc}, expected ${EXPECT}")
endif()
if(NOT out MATCHES "${REGEX}")
  message(FATAL_ERROR "output does not match: ${REGEX}")
endif()
