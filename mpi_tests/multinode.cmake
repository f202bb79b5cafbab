# Multi-node runs on the simulated cluster (ci/cluster/fsdp-cluster,
# docs/multinode.md): 2 nodes x 2 ranks, each node in its own network
# namespace with a shaped link, one orted per node, TCP between nodes and
# shared memory only inside one. Label multinode (and cpu: CI runs them).
#
#   fsdp_add_multinode_test(NAME <name> COMMAND <program> [args...]
#                           [NODES <n>] [RANKS_PER_NODE <r>] [NET lo|netns]
#                           [RATE <tc rate>] [TIMEOUT <s>] [LABELS <extra...>]
#                           [ENV <VAR=value...>] [SCRIPT])
#
# SCRIPT: COMMAND is a script that calls the launcher itself (it gets
# FSDP_CLUSTER=<launcher> and FSDP_CLUSTER_ARGS in its environment) instead
# of being launched under it.
set(FSDP_CLUSTER "${PROJECT_SOURCE_DIR}/ci/cluster/fsdp-cluster")
set(FSDP_MULTINODE_REPORT_DIR "${CMAKE_BINARY_DIR}/reports/multinode")
file(MAKE_DIRECTORY "${FSDP_MULTINODE_REPORT_DIR}")

function(fsdp_add_multinode_test)
  cmake_parse_arguments(T "SCRIPT" "NAME;NODES;RANKS_PER_NODE;NET;RATE;TIMEOUT"
                        "COMMAND;LABELS;ENV" ${ARGN})
  foreach(_d NODES:2 RANKS_PER_NODE:2 NET:netns RATE:10gbit TIMEOUT:300)
    string(REPLACE ":" ";" _kv "${_d}")
    list(GET _kv 0 _k)
    list(GET _kv 1 _v)
    if(NOT DEFINED T_${_k})
      set(T_${_k} ${_v})
    endif()
  endforeach()
  math(EXPR _np "${T_NODES} * ${T_RANKS_PER_NODE}")
  # The launcher ends the job 15 s before CTest would, so its cleanup runs.
  math(EXPR _job_timeout "${T_TIMEOUT} - 15")
  set(_args --nodes ${T_NODES} --ranks-per-node ${T_RANKS_PER_NODE} --net ${T_NET})
  if(T_NET STREQUAL "netns" AND T_RATE)
    list(APPEND _args --rate ${T_RATE})
  endif()
  if(T_SCRIPT)
    set(_cmd ${T_COMMAND})
  else()
    set(_cmd ${FSDP_CLUSTER} ${_args} --timeout ${_job_timeout} -- ${T_COMMAND})
  endif()
  add_test(NAME ${T_NAME} COMMAND ${_cmd})
  string(REPLACE ";" " " _args_text "${_args}")
  set_tests_properties(${T_NAME} PROPERTIES
    LABELS "cpu;multinode;nodes${T_NODES};${T_LABELS}" TIMEOUT ${T_TIMEOUT} PROCESSORS ${_np}
    # One namespace bridge at a time keeps the runs' links from sharing a subnet.
    RESOURCE_LOCK fsdp_cluster
    ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;FSDP_NUM_THREADS=1;FSDP_JUNIT_DIR=${FSDP_JUNIT_DIR};FSDP_REPORT_DIR=${FSDP_MULTINODE_REPORT_DIR};FSDP_TEST_DEVICE=cpu;FSDP_CLUSTER=${FSDP_CLUSTER};FSDP_CLUSTER_ARGS=${_args_text};${T_ENV}")
endfunction()

# ---- the plan's L3 decoder cases across two nodes ---------------------------
# L3-01 (FSDP over 4 ranks and HSDP 2x2: shard groups {0,1} and {2,3} inside
# the nodes, replicate groups across), hpZ within each node (the L3-01
# checks of reshard_after_forward = 2 and within_node()) and L3-03 (MoE, ep 2
# inside a node),
# against the cached single-card references, at the plan's tolerances.
fsdp_add_multinode_test(NAME multinode_llm_hsdp_fsdp_ep
  COMMAND $<TARGET_FILE:test_fully_shard_with_llm> --run_test=test_llm_decoder_hsdp_vs_ddp,test_llm_decoder_hpz_vs_ddp,test_moe_llm_ep_fsdp_vs_ddp
  LABELS "L3;ep" TIMEOUT 300
  ENV "FSDP_TEST_TIMEOUT=240;OPENBLAS_CORETYPE=${FSDP_REFERENCE_BLAS_CORE};ATEN_CPU_CAPABILITY=${FSDP_REFERENCE_ATEN_CAPABILITY}")
# TP inside a node (tp groups {0,1}, {2,3}), FSDP across the nodes (TP-01).
fsdp_add_multinode_test(NAME multinode_llm_tp_in_node
  COMMAND $<TARGET_FILE:test_fully_shard_with_tp>
  LABELS "L3;tp" TIMEOUT 300
  ENV "FSDP_TEST_TIMEOUT=240;OPENBLAS_CORETYPE=${FSDP_REFERENCE_BLAS_CORE};ATEN_CPU_CAPABILITY=${FSDP_REFERENCE_ATEN_CAPABILITY}")

# The fsdp-train entries need the tools (FSDP_BUILD_TOOLS).
if(FSDP_BUILD_TOOLS)
  # ---- fsdp-train --verify across two nodes -----------------------------------
  # Each layout's 6 steps against the same steps unsharded in one process.
  # TP: AdamW eps 1e-6, as fsdp_train_tp_np2 (tools/fsdp-train/CMakeLists.txt
  # says why: eps 1e-8 turns TP's other rounding into ~lr/30 where a gradient
  # stays near zero).
  set(_mn_train $<TARGET_FILE:fsdp-train> --steps 6 --seq 64 --batch 8 --verify)
  foreach(_layout "fsdp:" "hsdp:--mesh;2x2" "hpz:--reshard-after-forward;node" "tp:--tp;2;--sequence-parallel;--adam-eps;1e-6" "pp:--pp;2" "moe:--moe;--experts;4;--ep;2")
    string(FIND "${_layout}" ":" _colon)
    string(SUBSTRING "${_layout}" 0 ${_colon} _id)
    math(EXPR _from "${_colon} + 1")
    string(SUBSTRING "${_layout}" ${_from} -1 _flags)
    fsdp_add_multinode_test(NAME multinode_train_${_id}
      COMMAND ${_mn_train} ${_flags} --out ${CMAKE_CURRENT_BINARY_DIR}/multinode-train-${_id}
      LABELS "train" TIMEOUT 240)
    set_tests_properties(multinode_train_${_id} PROPERTIES
      FAIL_REGULAR_EXPRESSION "verify: max .*: FAIL")
  endforeach()

  # ---- a node lost mid-run, the run continued on the survivor ------------------
  # tools/fsdp-train/tests/node-loss-check.sh: node 1 killed after the step-3
  # checkpoint; the job ends within 30 s naming the node; --resume on the
  # surviving node (FSDP over 2, through fsdp::dcp) continues the run.
  fsdp_add_multinode_test(NAME multinode_train_node_loss SCRIPT
    COMMAND bash ${PROJECT_SOURCE_DIR}/tools/fsdp-train/tests/node-loss-check.sh
            $<TARGET_FILE:fsdp-train> ${CMAKE_CURRENT_BINARY_DIR}/multinode-node-loss
    LABELS "train;faults;dcp" TIMEOUT 400)
endif()

# ---- the watchdog and the desync check across nodes -------------------------
# fault_probe (L0's user program) with its 2 ranks on 2 nodes: the stalled
# rank's peer is reported and the job aborted by the watchdog; with
# FSDP_DEBUG=detail a collective mismatch is the same CommError on both
# nodes. The expectations are those of fault_stall_np2 and
# fault_mismatch_detail_np2 (CMakeLists.txt).
set(_mn_fault_cluster ${FSDP_CLUSTER} --nodes 2 --ranks-per-node 1 --net netns --rate 10gbit
    --timeout 50 --)
add_test(NAME multinode_fault_stall
         COMMAND ${CMAKE_COMMAND}
                 "-DCMD=${_mn_fault_cluster};$<TARGET_FILE:fault_probe>;stall"
                 -DEXPECT=nonzero -DMAX_SECONDS=20 "-DREGEX=${_stuck}" "-DREGEX_ALSO=${_abort}"
                 -P ${PROJECT_SOURCE_DIR}/cmake/RunAndCheck.cmake)
add_test(NAME multinode_fault_mismatch_detail
         COMMAND ${CMAKE_COMMAND}
                 "-DCMD=${_mn_fault_cluster};$<TARGET_FILE:fault_probe>;mismatch"
                 -DEXPECT=3 -DMAX_SECONDS=20
                 "-DREGEX=fault_probe: rank 0 caught CommError: FSDP_DEBUG=detail: the ranks of ranks\\[0,1\\] issued different collectives"
                 "-DREGEX_ALSO=fault_probe: rank 1 caught CommError: FSDP_DEBUG=detail"
                 -P ${PROJECT_SOURCE_DIR}/cmake/RunAndCheck.cmake)
set_tests_properties(multinode_fault_stall multinode_fault_mismatch_detail PROPERTIES
  LABELS "cpu;multinode;nodes2;faults" TIMEOUT 60 PROCESSORS 2 RESOURCE_LOCK fsdp_cluster
  ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
set_property(TEST multinode_fault_stall APPEND PROPERTY ENVIRONMENT FSDP_TIMEOUT=3)
set_property(TEST multinode_fault_mismatch_detail APPEND PROPERTY ENVIRONMENT
             FSDP_TIMEOUT=30 FSDP_DEBUG=detail)

# ---- hpZ's within_node() on real nodes ---------------------------------------
# test_fully_shard_module_hpz.cpp: within_node() must pick each node's pair
# (found with MPI_Comm_split_type by the test itself); the other hpZ cases
# run as they do on one node.
fsdp_add_multinode_test(NAME multinode_fully_shard_hpz
  COMMAND $<TARGET_FILE:test_fully_shard_module> --run_test=test_reshard_after_forward_*
  LABELS "L1" TIMEOUT 120)

# ---- node topology and cross-node bytes (test_node_topology) ----------------
# num_nodes() == 2, node_of against the nodes' hostnames, groups inside a node
# with arenas and 0 cross-node bytes, the world group's exact pairwise bytes,
# HSDP 2x2 whose shard groups stay inside the nodes.
fsdp_add_multinode_test(NAME multinode_node_topology
  COMMAND $<TARGET_FILE:test_node_topology>
  LABELS "L0" TIMEOUT 180
  ENV "FSDP_EXPECT_NODES=2;FSDP_TEST_TIMEOUT=120")
# The same with mpirun --map-by node: ranks 0, 2 on one node and 1, 3 on the
# other, so node_of is not rank / 2, the world group's ring always crosses,
# and init_node_mesh refuses the layout.
fsdp_add_multinode_test(NAME multinode_node_topology_map_by_node
  COMMAND --map-by node $<TARGET_FILE:test_node_topology>
  LABELS "L0" TIMEOUT 180
  ENV "FSDP_EXPECT_NODES=2;FSDP_TEST_TIMEOUT=120")
if(FSDP_BUILD_TOOLS)
  # fsdp-train --comm-report on HSDP 2x2: node 1's first rank (2) reports, and
  # its shard group {2,3} has an arena and sent nothing across nodes.
  # RunAndCheck: the exit status and the line both (a PASS_REGULAR_EXPRESSION
  # alone would ignore the status).
  add_test(NAME multinode_train_comm_report
           COMMAND ${CMAKE_COMMAND}
                   "-DCMD=${FSDP_CLUSTER};--net;netns;--rate;10gbit;--timeout;200;--;$<TARGET_FILE:fsdp-train>;--steps;2;--seq;64;--batch;8;--mesh;2x2;--comm-report;--out;${CMAKE_CURRENT_BINARY_DIR}/multinode-train-comm-report"
                   -DEXPECT=zero
                   "-DREGEX=\\[node 1 rank 2\\]   ranks\\[2,3\\]: 1 node, shm arena[^\n]*; cross-node 0 B"
                   -P ${PROJECT_SOURCE_DIR}/cmake/RunAndCheck.cmake)
  set_tests_properties(multinode_train_comm_report PROPERTIES
    LABELS "cpu;multinode;nodes2;train" TIMEOUT 240 PROCESSORS 4 RESOURCE_LOCK fsdp_cluster
    ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;FSDP_NUM_THREADS=1")
endif()
# ---- two_level CPU collectives across nodes ----------------------------------
# test_two_level_collectives on 2 nodes x 2 ranks (node-major, and
# round-robin so that the group's rank order is not node-major), without
# shared memory (the node step over MPI: the same bits), on 3 nodes x 2 and
# on 2 nodes x 4 (sub-mesh groups spanning both nodes with 2 ranks on each).
set(_mn_two_level ENV "FSDP_TEST_EXPECT_TWO_LEVEL=1")
fsdp_add_multinode_test(NAME multinode_two_level_2x2
  COMMAND $<TARGET_FILE:test_two_level_collectives> LABELS "L0" TIMEOUT 400 ${_mn_two_level})
fsdp_add_multinode_test(NAME multinode_two_level_2x2_round_robin
  COMMAND --map-by node $<TARGET_FILE:test_two_level_collectives> LABELS "L0" TIMEOUT 400
  ${_mn_two_level})
fsdp_add_multinode_test(NAME multinode_two_level_2x2_no_shm
  COMMAND $<TARGET_FILE:test_two_level_collectives> LABELS "L0" TIMEOUT 400
  ENV "FSDP_TEST_EXPECT_TWO_LEVEL=1;FSDP_SHM_BYTES=0")
# 6 and 8 ranks on this machine's 2 cores: minutes per case, hence the
# per-case watchdog (FSDP_TEST_TIMEOUT, 60 s by default) raised.
fsdp_add_multinode_test(NAME multinode_two_level_3x2 NODES 3
  COMMAND $<TARGET_FILE:test_two_level_collectives> LABELS "L0" TIMEOUT 600
  ENV "FSDP_TEST_EXPECT_TWO_LEVEL=1;FSDP_TEST_TIMEOUT=400")
fsdp_add_multinode_test(NAME multinode_two_level_2x4 RANKS_PER_NODE 4
  COMMAND $<TARGET_FILE:test_two_level_collectives> LABELS "L0" TIMEOUT 900
  ENV "FSDP_TEST_EXPECT_TWO_LEVEL=1;FSDP_TEST_TIMEOUT=600")
# The L0 collective suite (counters, groups, dtypes, errors) with two_level
# forced for every size on 2 nodes x 2 (sub-mesh groups inside one node or
# with one rank per node run pairwise).
fsdp_add_multinode_test(NAME multinode_collectives_two_level
  COMMAND $<TARGET_FILE:test_collectives> LABELS "L0" TIMEOUT 300 ENV "FSDP_MPI_ALGO=two_level")
