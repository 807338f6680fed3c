# memattn::compiled against header-only (cmake/compiled.cmake): the two builds of
# tests/compiled/check.cpp agree with the reference and with each other bit for bit, and
# the declarations of memattn/compiled.hpp take effect: in the compiled build's object
# the declared members are undefined (U, the library defines them) where the
# header-only object defines them itself (W or T).
#   cmake -DCOMPILED=<exe> -DHEADER_ONLY=<exe> -DCOMPILED_OBJECTS=<obj> -DHEADER_ONLY_OBJECTS=<obj>
#         -DNM=<nm> -P check.cmake
foreach(mode COMPILED HEADER_ONLY)
  execute_process(COMMAND "${${mode}}" RESULT_VARIABLE status OUTPUT_VARIABLE out_${mode} ERROR_VARIABLE err)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "${${mode}} failed (${status}):\n${out_${mode}}${err}")
  endif()
  # The first line names the build; everything after it must be the same.
  string(REGEX REPLACE "^# [^\n]*\n" "" body_${mode} "${out_${mode}}")
endforeach()
if(NOT out_COMPILED MATCHES "^# built with memattn::compiled")
  message(FATAL_ERROR "${COMPILED} was not built with MEMATTN_COMPILED:\n${out_COMPILED}")
endif()
if(NOT body_COMPILED STREQUAL body_HEADER_ONLY)
  message(FATAL_ERROR "memattn::compiled and header-only outputs differ\n"
                      "compiled:\n${out_COMPILED}\nheader-only:\n${out_HEADER_ONLY}")
endif()

# Symbols of one object file, demangled: "<kind> <name>" lines.
function(object_symbols object result)
  execute_process(COMMAND "${NM}" -C "${object}" RESULT_VARIABLE status OUTPUT_VARIABLE symbols ERROR_VARIABLE err)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "${NM} -C ${object} failed: ${err}")
  endif()
  set(${result} "${symbols}" PARENT_SCOPE)
endfunction()
object_symbols("${COMPILED_OBJECTS}" compiled_symbols)
object_symbols("${HEADER_ONLY_OBJECTS}" header_only_symbols)

# Each: a regular expression for a demangled name. Members taken by address in check.cpp,
# a save/load and an lse kernel on matrices (function templates), and one of the library's
# functions over views (declared in compiled.hpp only, so only the compiled build names it).
set(declared
  "memattn::KVCache<float, float>::attend\\(Eigen::Ref"
  "memattn::MultiHead<memattn::KVCache<float, float> >::attend\\(Eigen::Ref"
  "void memattn::save<memattn::MultiHead<memattn::SlidingWindowCache<float, float> > >\\("
  "void memattn::causal_softmax_attention<Eigen::Matrix<float, -1, -1, 1, -1, -1>, [^\n]*Eigen::Matrix<float, 1, -1, 1, 1, -1>&>\\(")
foreach(name IN LISTS declared)
  if(NOT compiled_symbols MATCHES "\n *U ${name}")
    message(FATAL_ERROR "memattn::compiled: '${name}' is not undefined in ${COMPILED_OBJECTS}:\n${compiled_symbols}")
  endif()
  if(compiled_symbols MATCHES "\n[0-9a-f]+ [WTt] ${name}")
    message(FATAL_ERROR "memattn::compiled: '${name}' is defined in ${COMPILED_OBJECTS} despite its declaration")
  endif()
  if(NOT header_only_symbols MATCHES "\n[0-9a-f]+ [WTt] ${name}")
    message(FATAL_ERROR "header-only: '${name}' is not defined in ${HEADER_ONLY_OBJECTS} (the check above "
                        "proves nothing unless the header-only build defines it):\n${header_only_symbols}")
  endif()
endforeach()
set(entry "memattn::detail::compiled::decode\\(memattn::KVCache<float, float>&")
if(NOT compiled_symbols MATCHES "\n *U ${entry}")
  message(FATAL_ERROR "memattn::compiled: decode on a KVCache<float> does not call the library")
endif()
if(header_only_symbols MATCHES "memattn::detail::compiled::")
  message(FATAL_ERROR "header-only: the object refers to memattn::compiled")
endif()
list(LENGTH declared count)
message(STATUS "memattn::compiled: outputs identical to header-only; ${count} declared specialisations undefined "
               "in the compiled build's object and defined in the header-only one")
