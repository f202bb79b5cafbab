# Precompiled LibTorch headers.
#
# LibTorch's <ATen/ATen.h> declares every operator and the C++ API pulls it
# in. Measured on a 2-core machine: one libfsdp translation unit took 106 s
# against 2.15 and 31 s with these headers precompiled; against Debian's 1.13
# libfsdp itself built in 290 s instead of 550 s (RelWithDebInfo, cold), the
# whole project in 22 minutes.
#
# GCC uses a precompiled header only in a compile with the same -fPIC/-fPIE
# and -g settings, so position-independent targets (libfsdp itself) build
# their own and every other target reuses one (fsdp_pch). With -g each header
# is about 0.55 GB (1.13).
option(FSDP_PRECOMPILE_HEADERS "Precompile the LibTorch headers" ON)

set(FSDP_PCH_HEADERS
  <ATen/ATen.h>
  <torch/csrc/autograd/custom_function.h>
  <torch/nn/module.h>
  <torch/nn/modules/linear.h>)

if(FSDP_PRECOMPILE_HEADERS)
  # ccache caches a compile that uses a precompiled header only when told the
  # header's macros and timestamps may be ignored.
  if(CCACHE_PROGRAM)
    set(CMAKE_CXX_COMPILER_LAUNCHER
        ${CMAKE_COMMAND} -E env CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
        ${CCACHE_PROGRAM})
  endif()
  file(WRITE "${CMAKE_BINARY_DIR}/fsdp_pch.cpp" "// the translation unit of fsdp_pch\n")
  add_library(fsdp_pch OBJECT "${CMAKE_BINARY_DIR}/fsdp_pch.cpp")
  target_link_libraries(fsdp_pch PRIVATE ${TORCH_LIBRARIES})
  target_precompile_headers(fsdp_pch PRIVATE ${FSDP_PCH_HEADERS})
endif()

# Gives `target` the precompiled LibTorch headers when FSDP_PRECOMPILE_HEADERS
# is on. `target` must use LibTorch (link fsdp or torch).
function(fsdp_precompile_headers target)
  if(NOT FSDP_PRECOMPILE_HEADERS)
    return()
  endif()
  get_target_property(_pic ${target} POSITION_INDEPENDENT_CODE)
  if(_pic)
    target_precompile_headers(${target} PRIVATE ${FSDP_PCH_HEADERS})
  else()
    target_precompile_headers(${target} REUSE_FROM fsdp_pch)
  endif()
endfunction()
