# precision_report_render_check: renders the samples under testdata/ with
# fsdp-precision-report and checks the rows it must produce and its exit
# status (the gate); also checks that a missing or empty raw dir, or one with
# no run id, is an error.
#   cmake -DRENDERER=<exe> -DTESTDATA=<dir> -DWORK=<dir> -P check_render.cmake
#
# testdata/sample: a mixed run (a failing row, rows not run, rows lacking a
# metric, other cases, expected failures). testdata/gate: pass.jsonl, a run
# whose matrix passes (every plan case with a loss and a grad-norm metric),
# and files that each break it one way: the gate scenarios below copy
# pass.jsonl (less the lines matching DROP) and the ADD files into a raw dir.
foreach(v RENDERER TESTDATA WORK)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "check_render.cmake: -D${v}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}/empty")

set(failures "")

# Renders raw dir DIR into ${WORK}/out/NAME.{md,json}; sets md, js, rc, out, err.
macro(render name dir)
  execute_process(COMMAND "${RENDERER}" --raw-dir "${dir}" --out-md "${WORK}/out/${name}.md"
                          --out-json "${WORK}/out/${name}.json"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(md "")
  set(js "{}")
  if(EXISTS "${WORK}/out/${name}.md")
    file(READ "${WORK}/out/${name}.md" md)
    file(READ "${WORK}/out/${name}.json" js)
  endif()
  set(_scenario "${name}")
endmacro()
macro(expect line)
  string(FIND "${md}" "${line}" _pos)
  if(_pos EQUAL -1)
    string(APPEND failures "\n  ${_scenario}: missing: ${line}")
  endif()
endmacro()
macro(expect_not line)
  string(FIND "${md}" "${line}" _pos)
  if(NOT _pos EQUAL -1)
    string(APPEND failures "\n  ${_scenario}: present: ${line}")
  endif()
endmacro()
macro(expect_rc want)
  if(NOT rc EQUAL ${want})
    string(APPEND failures "\n  ${_scenario}: exit status ${rc}, expected ${want}; stderr: ${err}")
  endif()
endmacro()
macro(expect_err regex)
  if(NOT err MATCHES "${regex}")
    string(APPEND failures "\n  ${_scenario}: stderr does not match '${regex}': ${err}")
  endif()
endmacro()

# ---- the mixed sample -------------------------------------------------------
render(sample "${TESTDATA}/sample")
message("${out}${err}")
if(NOT out MATCHES "precision matrix: ${WORK}/out/sample.md")
  string(APPEND failures "\n  sample: the renderer did not print the path of the matrix")
endif()
expect_rc(3)
expect_err("the precision gate FAILS")
# Matrix: a row with untested plan cases and a case without a loss or grad-norm
# metric, a failing row, a row lacking a grad-norm metric, TP-01 fed by its
# own case id (the "ours tp" record naming the row's configuration is not
# placed in it), rows with no record.
expect("| FSDP 1-D, fp32 | 1e-5 | 1e-5 | L1-03, L2-01, L3-02, L3-04, L3-05 | L1-03 | 1 | 2.500e-7 | 40x | not run (4 of 5 cases) | L2-01, L3-02, L3-04, L3-05 | L1-03: no loss, no grad norm |")
expect("| FSDP 1-D, bf16 | 1e-3 | 1e-3 | L1-10, L1-11 | L1-10 | 1 | 2.000e-3 | 0.5x | FAIL (1 of 1) | L1-11 | L1-10: no grad norm |")
expect("| AC + swap + FSDP, fp32 | 1e-5 | 1e-5 | L2-06 | L2-06 | 1 | 0 | exact | incomplete | - | L2-06: no grad norm |")
expect("| TP + FSDP, fp32 | 1e-5 | 1e-5 | TP-01 | TP-01 | 1 | 1.000e-6 | 10x | incomplete | - | TP-01: no grad norm |")
expect("| HSDP 2-D, fp32 | 1e-5 | 1e-5 | L1-02, L3-01 | - | 0 | - | - | not run | L1-02, L3-01 | - |")
expect("| PP + FSDP, fp32 | 1e-5 | 1e-5 | L2-09 | - | 0 | - | - | not run | L2-09 | - |")
# Other cases (plan ids first), detail, separation, stand-ins.
expect("| L1-12 | - | test_fully_shard_precision | 1 | 1e-3 | 1.000e-4 | 10x | pass |\n| offload | - | test_fully_shard_precision | 1 | 1e-5 | inf | n/a | FAIL (1 of 1) |\n| ours tp | TP + FSDP, fp32 | test_tp | 1 | 1e-5 | 3.000e-6 | 3.33x | pass |")
expect("| L1-10 | loss vs single-card bf16 | 1e-3 | 2.000e-3 | 0.5x | **FAIL** | 2 | cpu |  |")
expect("| L2-06 reentrant | loss vs single card | 1e-5 | 0 | exact | pass | 2 | cpu | compute device is the CPU: host and device coincide |")
expect("| L1-02 | off: replica grads differ (every parameter) (must exceed) | 1e-6 | 5.000e-2 | 5e4x | pass | 4 | cpu |")
expect("- L1-12 (cpu): bf16 stands in for fp16 on CPU")
expect("| L1-13 | 2-pass main grad vs fp32 single card | 1e-5 | 2.000e-3 | expected failure | bf16 compute on CPU | 2 | cpu |")
expect("9 records of run `sample-run` in 1 files")
expect("1 expected-failure records; 2 failing; 0 skipped test cases; 0 stale records rejected.")
expect("**Gate: FAIL**")
string(JSON status ERROR_VARIABLE jerr GET "${js}" matrix 1 status)
if(NOT status STREQUAL "FAIL (1 of 1)")
  string(APPEND failures "\n  sample: json matrix[1].status is '${status}' ${jerr}")
endif()
string(JSON margin ERROR_VARIABLE jerr GET "${js}" matrix 6 tightest_margin)
if(NOT margin STREQUAL "exact")
  string(APPEND failures "\n  sample: json matrix[6].tightest_margin is '${margin}' ${jerr}")
endif()
set(sample_md "${md}")

# ---- the gate ---------------------------------------------------------------
# Copies gate/pass.jsonl (less lines matching DROP) and gate/run-id into
# ${WORK}/raw/NAME with the ADD files of gate/, then renders it.
function(gate_dir name)
  cmake_parse_arguments(G "" "DROP" "ADD" ${ARGN})
  set(dir "${WORK}/raw/${name}")
  file(MAKE_DIRECTORY "${dir}")
  file(COPY "${TESTDATA}/gate/run-id" DESTINATION "${dir}")
  file(STRINGS "${TESTDATA}/gate/pass.jsonl" lines)
  set(kept "")
  set(dropped 0)
  foreach(l IN LISTS lines)
    if(G_DROP AND l MATCHES "${G_DROP}")
      math(EXPR dropped "${dropped} + 1")
    else()
      string(APPEND kept "${l}\n")
    endif()
  endforeach()
  if(G_DROP AND dropped EQUAL 0)
    message(FATAL_ERROR "gate scenario ${name}: DROP '${G_DROP}' matches no line of pass.jsonl")
  endif()
  file(WRITE "${dir}/pass.jsonl" "${kept}")
  foreach(f IN LISTS G_ADD)
    file(COPY "${TESTDATA}/gate/${f}" DESTINATION "${dir}")
  endforeach()
endfunction()

# A complete passing run: exit 0, every row "pass".
gate_dir(pass)
render(pass "${WORK}/raw/pass")
expect_rc(0)
expect("**Gate: PASS**")
expect("| FSDP 1-D, fp32 | 1e-5 | 1e-5 | L1-03, L2-01, L3-02, L3-04, L3-05 | L1-03, L2-01, L3-02, L3-04, L3-05 | 10 |")
expect("| PP + FSDP, fp32 | 1e-5 | 1e-5 | L2-09 | L2-09 | 2 | 2.500e-6 | 4x | pass | - | - |")
expect_not("| not run (")
expect("Devices: cpu. (CUDA entries run with TF32 off for cuBLAS matmuls and cuDNN convolutions.)")
if(NOT out MATCHES "precision gate: pass")
  string(APPEND failures "\n  pass: stdout does not say the gate passed: ${out}")
endif()

# A CUDA record: the header says the CUDA entries ran with TF32 off.
gate_dir(cuda ADD cuda_gpu2.jsonl)
render(cuda "${WORK}/raw/cuda")
expect_rc(0)
expect("Devices: cpu, cuda:0. CUDA entries ran with TF32 off (cuBLAS matmuls and cuDNN convolutions)")

# A plan case without a grad-norm metric: the row is incomplete, exit 3.
gate_dir(missing-grad-norm DROP "\"case_id\":\"L2-09[^\"]*\".*grad norm")
render(missing-grad-norm "${WORK}/raw/missing-grad-norm")
expect_rc(3)
expect("| PP + FSDP, fp32 | 1e-5 | 1e-5 | L2-09 | L2-09 | 1 | 2.500e-6 | 4x | incomplete | - | L2-09: no grad norm |")
expect_err("matrix row .PP [+] FSDP, fp32.: incomplete")

# A record of an earlier run (and one with no run id) left in the raw dir:
# rejected, never rendered (the stale FAIL of L1-03 does not reach its row,
# the stale L3-06 is not among the other cases), exit 3.
gate_dir(stale ADD stale_np2.jsonl)
render(stale "${WORK}/raw/stale")
expect_rc(3)
expect("- stale_np2.jsonl: 2 records of run (none)")
expect("| FSDP 1-D, fp32 | 1e-5 | 1e-5 | L1-03, L2-01, L3-02, L3-04, L3-05 | L1-03, L2-01, L3-02, L3-04, L3-05 | 10 | 2.500e-6 | 4x | pass | - | - |")
expect_not("| L3-06 |")
expect("0 failing; 0 skipped test cases; 2 stale records rejected.")
expect_err("stale records: stale_np2.jsonl")

# A failing record: its row FAILs, exit 3.
gate_dir(fail ADD fail.jsonl)
render(fail "${WORK}/raw/fail")
expect_rc(3)
expect("| AC + FSDP, fp32 | 1e-5 | 1e-5 | L2-03, L2-04, L2-05 | L2-03, L2-04, L2-05 | 7 | 2.000e-5 | 0.5x | FAIL (1 of 7) | - | - |")
expect_err("1 failing records")

# Records of test_fully_shard_lifecycle (not a plan suite), one naming the
# row's configuration, one with a plan id: not mapped into the FSDP 1-D row,
# where L1-03 is not run; listed under other cases; exit 3.
gate_dir(lifecycle DROP "\"case_id\":\"L1-03\"" ADD lifecycle.jsonl)
render(lifecycle "${WORK}/raw/lifecycle")
expect_rc(3)
expect("| FSDP 1-D, fp32 | 1e-5 | 1e-5 | L1-03, L2-01, L3-02, L3-04, L3-05 | L2-01, L3-02, L3-04, L3-05 | 8 | 2.500e-6 | 4x | not run (1 of 5 cases) | L1-03 | - |")
expect("| L1-03 lookalike | - | test_fully_shard_lifecycle | 2 |")
expect("| exception in forward reshard_after_forward=true comm_fusion=true | FSDP 1-D, fp32 | test_fully_shard_lifecycle | 2 |")

# A plan case skipped by its precondition: "not run" with the reason, never a pass.
gate_dir(skipped DROP "\"case_id\":\"L1-02\"" ADD skipped.jsonl)
render(skipped "${WORK}/raw/skipped")
expect_rc(3)
expect("| HSDP 2-D, fp32 | 1e-5 | 1e-5 | L1-02, L3-01 | L3-01 | 2 | 2.500e-6 | 4x | not run (1 of 2 cases) | L1-02 (skipped: np 2: needs 4 ranks: a 2x2 (replicate, shard) mesh) | - |")
expect("- test_fully_shard_module np 2 (cpu): test_set_requires_all_reduce: needs 4 ranks: a 2x2 (replicate, shard) mesh")

# A check-specific tolerance looser than the plan's (L1-02's replicas equal at
# 1e-5, plan 1e-6), within the row's 1e-5: caught per record, exit 3.
gate_dir(looser DROP "replicas equal" ADD looser.jsonl)
render(looser "${WORK}/raw/looser")
expect_rc(3)
expect("| HSDP 2-D, fp32 | 1e-5 | 1e-5 | L1-02, L3-01 | L1-02, L3-01 | 5 | 2.500e-6 | 4x | looser than plan (1) | - | - |")
expect("| L1-02 | on: replicas equal | 1e-5 | 1e-6 | 0 | 4 |")

# ---- errors -------------------------------------------------------------------
# A missing or empty raw dir, or one without a run id, is an error with a clear message.
file(MAKE_DIRECTORY "${WORK}/no-run-id")
file(COPY "${TESTDATA}/gate/pass.jsonl" DESTINATION "${WORK}/no-run-id")
foreach(dir "${WORK}/empty" "${WORK}/missing" "${WORK}/no-run-id")
  execute_process(COMMAND "${RENDERER}" --raw-dir "${dir}" --out-md "${WORK}/x.md"
                          --out-json "${WORK}/x.json"
                  RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_QUIET)
  if(NOT rc EQUAL 1 OR NOT err MATCHES "run the MPI tests first|precision_report_reset")
    string(APPEND failures "\n  raw dir ${dir}: rc ${rc}, stderr '${err}'")
  endif()
endforeach()

if(failures)
  message("---- rendered markdown (sample) ----\n${sample_md}")
  message(FATAL_ERROR "precision report render check failed:${failures}")
endif()
message("precision report render check: ok")
