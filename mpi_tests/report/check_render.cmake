# precision_report_render_check: renders testdata/sample.jsonl with
# fsdp-precision-report and checks the rows it must produce; also checks that
# a missing or empty raw dir is an error.
#   cmake -DRENDERER=<exe> -DTESTDATA=<dir> -DWORK=<dir> -P check_render.cmake
foreach(v RENDERER TESTDATA WORK)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "check_render.cmake: -D${v}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}/empty")

execute_process(COMMAND "${RENDERER}" --raw-dir "${TESTDATA}" --out-md "${WORK}/out/m.md"
                        --out-json "${WORK}/out/m.json"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "renderer failed on the sample (rc ${rc})")
endif()
if(NOT out MATCHES "precision matrix: ${WORK}/out/m.md")
  message(FATAL_ERROR "renderer did not print the path of the matrix")
endif()
file(READ "${WORK}/out/m.md" md)

set(failures "")
macro(expect line)
  string(FIND "${md}" "${line}" _pos)
  if(_pos EQUAL -1)
    string(APPEND failures "\n  missing: ${line}")
  endif()
endmacro()
# Matrix: a passing row with untested plan cases, a failing row, an exact row,
# a row fed through an explicit configuration and by our own case id (TP-01), a row
# with no record.
expect("| FSDP 1-D, fp32 | 1e-5 | 1e-5 | L1-03, L2-01, L3-02, L3-04, L3-05 | L1-03 | 1 | 2.500e-7 | 40x | pass (partial) | L2-01, L3-02, L3-04, L3-05 |")
expect("| FSDP 1-D, bf16 | 1e-3 | 1e-3 | L1-10, L1-11 | L1-10 | 1 | 2.000e-3 | 0.5x | FAIL (1 of 1) | L1-11 |")
expect("| AC + swap + FSDP, fp32 | 1e-5 | 1e-5 | L2-06 | L2-06 | 1 | 0 | exact | pass | - |")
expect("| TP + FSDP, fp32 | 1e-5 | 1e-5 | TP-01 | TP-01, ours tp | 2 | 3.000e-6 | 3.33x | pass | - |")
expect("| HSDP 2-D, fp32 | 1e-5 | 1e-5 | L1-02, L3-01 | - | 0 | - | - | not run | L1-02, L3-01 |")
expect("| PP + FSDP, fp32 | 1e-5 | 1e-5 | L2-09 | - | 0 | - | - | not run | L2-09 |")
# Other cases (plan ids first), detail, separation, stand-ins.
expect("| L1-12 | - | 1 | 1e-3 | 1.000e-4 | 10x | pass |\n| offload | - | 1 | 1e-5 | inf | n/a | FAIL (1 of 1) |")
expect("| L1-10 | loss vs single-card bf16 | 1e-3 | 2.000e-3 | 0.5x | **FAIL** | 2 | cpu |  |")
expect("| L2-06 reentrant | loss vs single card | 1e-5 | 0 | exact | pass | 2 | cpu | compute device is the CPU: host and device coincide |")
expect("| L1-02 | off: replica grads differ (every parameter) (must exceed) | 1e-6 | 5.000e-2 | 5e4x | pass | 4 | cpu |")
expect("- L1-12 (cpu): bf16 stands in for fp16 on CPU")
expect("| L1-13 | 2-pass main grad vs fp32 single card | 1e-5 | 2.000e-3 | expected failure | bf16 compute on CPU | 2 | cpu |")
expect("9 records in 1 files")
expect("1 expected-failure records; 2 failing.")

file(READ "${WORK}/out/m.json" js)
string(JSON status ERROR_VARIABLE jerr GET "${js}" matrix 1 status)
if(NOT status STREQUAL "FAIL (1 of 1)")
  string(APPEND failures "\n  json matrix[1].status is '${status}' ${jerr}")
endif()
string(JSON margin ERROR_VARIABLE jerr GET "${js}" matrix 6 tightest_margin)
if(NOT margin STREQUAL "exact")
  string(APPEND failures "\n  json matrix[6].tightest_margin is '${margin}' ${jerr}")
endif()

# A missing or empty raw dir is an error with a clear message.
foreach(dir "${WORK}/empty" "${WORK}/missing")
  execute_process(COMMAND "${RENDERER}" --raw-dir "${dir}" --out-md "${WORK}/x.md"
                          --out-json "${WORK}/x.json"
                  RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_QUIET)
  if(rc EQUAL 0 OR NOT err MATCHES "run the MPI tests first")
    string(APPEND failures "\n  raw dir ${dir}: rc ${rc}, stderr '${err}'")
  endif()
endforeach()

if(failures)
  message("---- rendered markdown ----\n${md}")
  message(FATAL_ERROR "precision report render check failed:${failures}")
endif()
message("precision report render check: ok")
