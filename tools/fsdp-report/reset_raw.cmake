# precision_report_reset: the CTest fixture (FIXTURES_SETUP precision_records)
# that every entry writing precision records, and precision_matrix_report,
# require. Clears the raw record dir and writes a fresh run id to DIR/run-id,
# which the SPMD harness stamps on every record and fsdp-precision-report
# compares: records of an earlier run never render as current.
#   cmake -DDIR=<raw dir> -P reset_raw.cmake
if(NOT DEFINED DIR)
  message(FATAL_ERROR "reset_raw.cmake: -DDIR=... is required")
endif()
file(MAKE_DIRECTORY "${DIR}")
file(GLOB _old "${DIR}/*.jsonl")
if(_old)
  file(REMOVE ${_old})
endif()
list(LENGTH _old _n)
string(TIMESTAMP _now "%Y%m%dT%H%M%SZ" UTC)
string(RANDOM LENGTH 12 ALPHABET "0123456789abcdef" _salt)
file(WRITE "${DIR}/run-id" "${_now}-${_salt}\n")
message("precision records: cleared ${_n} files in ${DIR}; run id ${_now}-${_salt}")
