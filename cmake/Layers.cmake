# libfsdp's layers as CMake object libraries (docs/architecture.md#layers).
#
# A layer's sources are compiled against ${FSDP_LAYER_ROOT}/<layer>/, a tree
# of symbolic links made at configure time that holds src/<folder> for the
# layer itself and every layer below it, and fsdp/<header> for the public
# headers of those layers. Nothing else of libfsdp is on its include path, so
# `#include "sharding/state.h"` in src/tensor/ (or "fsdp/fully_shard.h") is a
# "No such file or directory" error, not a silent upward edge.
set(FSDP_LAYER_ROOT "${CMAKE_CURRENT_BINARY_DIR}/layers")

# Every public header but the umbrella fsdp.h is listed in exactly one
# FSDP_LAYER_<layer>_HEADERS, so a new header cannot bypass the rule.
function(fsdp_check_layer_headers)
  set(_dir "${CMAKE_CURRENT_SOURCE_DIR}/include/fsdp")
  file(GLOB _all RELATIVE "${_dir}" "${_dir}/*.h")
  list(REMOVE_ITEM _all fsdp.h)
  set(_seen "")
  foreach(_layer IN LISTS FSDP_LAYERS)
    foreach(_h IN LISTS FSDP_LAYER_${_layer}_HEADERS)
      if(_h IN_LIST _seen)
        message(FATAL_ERROR "libfsdp layers: fsdp/${_h} is listed in two layers")
      endif()
      if(NOT _h IN_LIST _all)
        message(FATAL_ERROR "libfsdp layers: FSDP_LAYER_${_layer}_HEADERS names fsdp/${_h}, "
                            "which is not in ${_dir}")
      endif()
      list(APPEND _seen ${_h})
    endforeach()
  endforeach()
  foreach(_h IN LISTS _all)
    if(NOT _h IN_LIST _seen)
      message(FATAL_ERROR "libfsdp layers: include/fsdp/${_h} belongs to no layer: add it to "
                          "one FSDP_LAYER_<layer>_HEADERS in libfsdp/CMakeLists.txt")
    endif()
  endforeach()
endfunction()

# fsdp_add_layer(<layer> BELOW <lower layers...>): the object library
# fsdp_<layer> of FSDP_LAYER_<layer>_SOURCES, seeing <layer> and BELOW only.
function(fsdp_add_layer layer)
  cmake_parse_arguments(L "" "" "BELOW" ${ARGN})
  set(_root "${FSDP_LAYER_ROOT}/${layer}")
  file(REMOVE_RECURSE "${_root}")
  file(MAKE_DIRECTORY "${_root}/fsdp")
  foreach(_seen IN LISTS L_BELOW layer)
    file(CREATE_LINK "${CMAKE_CURRENT_SOURCE_DIR}/src/${_seen}" "${_root}/${_seen}" SYMBOLIC)
    foreach(_h IN LISTS FSDP_LAYER_${_seen}_HEADERS)
      file(CREATE_LINK "${CMAKE_CURRENT_SOURCE_DIR}/include/fsdp/${_h}" "${_root}/fsdp/${_h}"
           SYMBOLIC)
    endforeach()
  endforeach()

  set(_target fsdp_${layer})
  add_library(${_target} OBJECT ${FSDP_LAYER_${layer}_SOURCES})
  target_include_directories(${_target} PRIVATE "${_root}")
  # Usage requirements only (include directories, flags): objects link nothing.
  target_link_libraries(${_target} PRIVATE ${TORCH_LIBRARIES} MPI::MPI_CXX)
  target_compile_features(${_target} PRIVATE cxx_std_17)
  target_compile_options(${_target} PRIVATE ${FSDP_WARNING_FLAGS})
  set_target_properties(${_target} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  # The same definitions in every layer: GCC refuses the shared precompiled
  # header (-Winvalid-pch) when one defined at its creation is missing.
  target_compile_definitions(${_target} PRIVATE FSDP_VERSION_STRING="${PROJECT_VERSION}")
  if(FSDP_NCCL_ENABLED)
    target_compile_definitions(${_target} PRIVATE FSDP_WITH_NCCL)
    target_include_directories(${_target} SYSTEM PRIVATE ${NCCL_INCLUDE_DIR})
    target_link_libraries(${_target} PRIVATE ${FSDP_C10_CUDA} CUDA::cudart)
  endif()
  if(layer STREQUAL "base")
    # Header-only, used by trace.cpp alone: not part of the installed interface.
    target_link_libraries(${_target} PRIVATE nlohmann_json::nlohmann_json)
  endif()
  # One position-independent precompiled header for all layers, built by the
  # lowest (PrecompiledHeaders.cmake: GCC needs matching -fPIC and -g).
  if(FSDP_PRECOMPILE_HEADERS)
    if(layer STREQUAL "base")
      target_precompile_headers(${_target} PRIVATE ${FSDP_PCH_HEADERS})
    else()
      target_precompile_headers(${_target} REUSE_FROM fsdp_base)
    endif()
  endif()
endfunction()
