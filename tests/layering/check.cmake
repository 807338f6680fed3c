# The layering of include/memattn (docs/design.md, "Layering"): every header belongs to
# one floor, and includes only headers of its own floor or below, so every include runs
# downhill. A header on no floor fails the check too: a new header must be given one.
#   cmake -DINCLUDE_DIR=<repo>/include -P tests/layering/check.cmake
cmake_minimum_required(VERSION 3.21)

# Floors from the ground up: regular expressions on the path below include/.
set(floors
  "^memattn/(types|version|cpu_features)\\.hpp$|^memattn/detail/"                     # 0 ground
  "^memattn/(softmax_state|feature_maps)\\.hpp$|^memattn/execution/|^memattn/positional/|^memattn/persistence/stream\\.hpp$"  # 1
  "^memattn/storage/"                                                                  # 2 storage
  "^memattn/kernels/"                                                                  # 3 kernels
  "^memattn/memory/"                                                                   # 4 memories and their helpers
  "^memattn/layer/|^memattn/serving/|^memattn/persistence/snapshot\\.hpp$"            # 5 layer, serving, snapshots
  "^memattn/distributed/|^memattn/(memattn|compiled)\\.hpp$")                          # 6 MPI, umbrella

function(floor_of path out)
  set(level 0)
  foreach(pattern IN LISTS floors)
    if(path MATCHES "${pattern}")
      set(${out} ${level} PARENT_SCOPE)
      return()
    endif()
    math(EXPR level "${level} + 1")
  endforeach()
  set(${out} -1 PARENT_SCOPE)
endfunction()

file(GLOB_RECURSE headers RELATIVE "${INCLUDE_DIR}" "${INCLUDE_DIR}/memattn/*.hpp")
list(SORT headers)
set(problems "")
set(count 0)
foreach(header IN LISTS headers)
  floor_of("${header}" mine)
  if(mine LESS 0)
    string(APPEND problems "  ${header}: on no floor (add it to tests/layering/check.cmake and docs/design.md)\n")
    continue()
  endif()
  file(STRINGS "${INCLUDE_DIR}/${header}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<]memattn/")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*[\"<]([^\">]+)[\">].*" "\\1" included "${line}")
    floor_of("${included}" theirs)
    math(EXPR count "${count} + 1")
    if(theirs LESS 0)
      string(APPEND problems "  ${header} includes ${included}, which is on no floor\n")
    elseif(theirs GREATER mine)
      string(APPEND problems "  ${header} (floor ${mine}) includes ${included} (floor ${theirs}): uphill\n")
    endif()
  endforeach()
endforeach()
list(LENGTH headers files)
if(problems)
  message(FATAL_ERROR "memattn layering: includes that do not run downhill:\n${problems}")
endif()
message(STATUS "memattn layering: ${files} headers, ${count} includes, all downhill")
