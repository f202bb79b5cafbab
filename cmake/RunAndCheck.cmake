# cmake -DCMD=<command;args...> -DEXPECT=zero|nonzero|<status> -DREGEX=<regex>
#       [-DREGEX_ALSO=<regex>] [-DMAX_SECONDS=<s>] -P RunAndCheck.cmake
#
# Runs CMD and fails unless its exit status is as EXPECT says (0, not 0, or
# exactly <status>), its output (stdout and stderr together) matches REGEX
# (and REGEX_ALSO, when given), and, with MAX_SECONDS, it ended within that
# many seconds (whole seconds, so allow one more). A CTest
# PASS_REGULAR_EXPRESSION alone would ignore the exit status.
if(NOT DEFINED CMD OR NOT DEFINED EXPECT OR NOT DEFINED REGEX)
  message(FATAL_ERROR
          "RunAndCheck.cmake needs -DCMD, -DEXPECT (zero|nonzero|<status>) and -DREGEX")
endif()
string(TIMESTAMP started "%s" UTC)
execute_process(COMMAND ${CMD} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
string(TIMESTAMP ended "%s" UTC)
math(EXPR elapsed "${ended} - ${started}")
message("${out}")
message("exit status ${rc} after ${elapsed} s")
if(DEFINED MAX_SECONDS AND elapsed GREATER MAX_SECONDS)
  message(FATAL_ERROR "took ${elapsed} s, more than ${MAX_SECONDS} s")
endif()
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
if(DEFINED REGEX_ALSO AND NOT out MATCHES "${REGEX_ALSO}")
  message(FATAL_ERROR "output does not match: ${REGEX_ALSO}")
endif()
