# The include graph of libfsdp against its layer order (CTest libfsdp_layering).
#
#   cmake -DLIB=<libfsdp dir> -DLAYERS=<a,b,...> -DPEERS=<x,y> -DHEADERS=<h=layer,...>
#         [-DDOC=docs/architecture.md] -P CheckLayers.cmake
#
# Every `#include "<folder>/..."` in LIB/src/<layer>/ and every include of a
# public header fsdp/<h> (from src/ or from another public header) must reach
# the same layer or one below it; the peers (PEERS) do not see each other.
# The build already refuses such an include (cmake/Layers.cmake); this names
# every violation at once, covers public headers no translation unit of the
# lower layer happens to include, and checks that DOC states the same order
# on its line starting with "layers: ".
cmake_minimum_required(VERSION 3.22)
foreach(_v LIB LAYERS HEADERS)
  if(NOT DEFINED ${_v})
    message(FATAL_ERROR "CheckLayers.cmake: -D${_v}=... is required")
  endif()
endforeach()

# Commas, not semicolons: CTest would split a semicolon list into arguments.
foreach(_v LAYERS PEERS HEADERS)
  string(REPLACE "," ";" ${_v} "${${_v}}")
endforeach()

# rank of each layer; peers share one rank and must not include each other
set(_rank 0)
foreach(_l IN LISTS LAYERS)
  set(_rank_${_l} ${_rank})
  if(NOT _l IN_LIST PEERS)
    math(EXPR _rank "${_rank} + 1")
  endif()
endforeach()
foreach(_pair IN LISTS HEADERS)
  string(REPLACE "=" ";" _pair "${_pair}")
  list(GET _pair 0 _h)
  list(GET _pair 1 _l)
  set(_layer_of_${_h} ${_l})
endforeach()

set(_violations "")
set(_edges 0)
# allowed(from, to): same layer, or `to` strictly below `from`
macro(_check from to where what)
  math(EXPR _edges "${_edges} + 1")
  if(NOT "${from}" STREQUAL "${to}")
    if(NOT DEFINED _rank_${to} OR NOT _rank_${to} LESS _rank_${from})
      list(APPEND _violations "${where}: ${from} includes ${what} (layer ${to})")
    endif()
  endif()
endmacro()

macro(_scan file from)
  file(STRINGS "${file}" _lines REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<]")
  file(RELATIVE_PATH _rel "${LIB}" "${file}")
  foreach(_line IN LISTS _lines)
    if(_line MATCHES "#[ \t]*include[ \t]*[\"<]fsdp/([A-Za-z0-9_]+\\.h)[\">]")
      set(_h "${CMAKE_MATCH_1}")
      if(_h STREQUAL "fsdp.h")
        list(APPEND _violations "${_rel}: includes the umbrella fsdp/fsdp.h")
      elseif(NOT DEFINED _layer_of_${_h})
        list(APPEND _violations "${_rel}: fsdp/${_h} belongs to no layer")
      else()
        _check(${from} ${_layer_of_${_h}} "${_rel}" "fsdp/${_h}")
      endif()
    elseif(_line MATCHES "#[ \t]*include[ \t]*\"([A-Za-z0-9_]+)/")
      _check(${from} ${CMAKE_MATCH_1} "${_rel}" "\"${CMAKE_MATCH_1}/...\"")
    endif()
  endforeach()
endmacro()

file(GLOB _folders RELATIVE "${LIB}/src" "${LIB}/src/*")
foreach(_folder IN LISTS _folders)
  if(NOT _folder IN_LIST LAYERS)
    list(APPEND _violations "src/${_folder}/: a folder that is no layer")
    continue()
  endif()
  file(GLOB _files "${LIB}/src/${_folder}/*.h" "${LIB}/src/${_folder}/*.cpp")
  foreach(_f IN LISTS _files)
    _scan("${_f}" ${_folder})
  endforeach()
endforeach()
file(GLOB _public "${LIB}/include/fsdp/*.h")
foreach(_f IN LISTS _public)
  get_filename_component(_h "${_f}" NAME)
  if(_h STREQUAL "fsdp.h")
    continue()
  endif()
  if(NOT DEFINED _layer_of_${_h})
    list(APPEND _violations "include/fsdp/${_h}: belongs to no layer")
    continue()
  endif()
  _scan("${_f}" ${_layer_of_${_h}})
endforeach()

if(DOC)
  string(REPLACE ";" " -> " _expected "${LAYERS}")
  list(JOIN PEERS " -> " _peer_chain)
  list(JOIN PEERS " | " _peer_alt)
  string(REPLACE "${_peer_chain}" "${_peer_alt}" _expected "${_expected}")
  file(STRINGS "${DOC}" _doc_lines REGEX "^layers: ")
  if(NOT _doc_lines)
    list(APPEND _violations "${DOC}: no line 'layers: ${_expected}'")
  elseif(NOT _doc_lines STREQUAL "layers: ${_expected}")
    list(APPEND _violations "${DOC}: states '${_doc_lines}', the build uses 'layers: ${_expected}'")
  endif()
endif()

list(LENGTH _violations _n)
if(_n GREATER 0)
  list(JOIN _violations "\n  " _text)
  message(FATAL_ERROR "libfsdp layering: ${_n} violation(s) in ${_edges} includes:\n  ${_text}")
endif()
message(STATUS "libfsdp layering: ${_edges} includes of libfsdp headers, none upward")
