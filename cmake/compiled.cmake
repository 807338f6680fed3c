# memattn::compiled: a static library of the common float instantiations
# (include/memattn/compiled.hpp, src/compiled.cpp). Linking it instead of
# memattn::memattn defines MEMATTN_COMPILED, so memattn.hpp declares those
# instantiations extern and the user's translation units compile less; the headers
# stay header-only without it.
#
# The target is EXCLUDE_FROM_ALL: it is built only when something links it (or it is
# asked for by name), so a header-only build or install never compiles it. It is not
# installed: its code is compiled for one ISA, and it must be the ISA (-march) and the
# definitions of the program that links it (Eigen's packet code differs per ISA, and
# two definitions of one specialisation in one program break the ODR). Build it in the
# consumer's tree (add_subdirectory or FetchContent), where it takes the same
# CMAKE_CXX_FLAGS; MEMATTN_COMPILED_OPTIONS adds options (such as -march=native) to the
# library and, through its interface, to everything that links it.
option(MEMATTN_BUILD_COMPILED "Provide memattn::compiled (memattn/compiled.hpp), built when linked" ON)
set(MEMATTN_COMPILED_OPTIONS "" CACHE STRING
    "Compile options of memattn::compiled and of its users (e.g. -march=native), on top of CMAKE_CXX_FLAGS")

if(NOT MEMATTN_BUILD_COMPILED)
  return()
endif()

add_library(memattn_compiled STATIC EXCLUDE_FROM_ALL "${CMAKE_CURRENT_LIST_DIR}/../src/compiled.cpp")
add_library(memattn::compiled ALIAS memattn_compiled)
set_target_properties(memattn_compiled PROPERTIES EXPORT_NAME compiled POSITION_INDEPENDENT_CODE ON)
target_link_libraries(memattn_compiled PUBLIC memattn)
target_compile_definitions(memattn_compiled PUBLIC MEMATTN_COMPILED)
if(MEMATTN_COMPILED_OPTIONS)
  target_compile_options(memattn_compiled PUBLIC ${MEMATTN_COMPILED_OPTIONS})
endif()
# Warnings are errors in memattn's own build only: in a consumer's tree this library is
# compiled by the consumer's compiler, whose new warnings must not break its build.
if(PROJECT_IS_TOP_LEVEL)
  include("${CMAKE_CURRENT_LIST_DIR}/memattnWarnings.cmake")
  memattn_strict_warnings(memattn_compiled)
endif()

# Tests: one program built against the library and header-only, whose outputs must be
# the same bits and match a reference, and a look at its object files: the declared
# instantiations are undefined (U) in the compiled build and defined in the other.
if(MEMATTN_BUILD_TESTS AND MEMATTN_TEST_PACKAGING)
  set(memattn_compiled_test_dir "${PROJECT_SOURCE_DIR}/tests/compiled")
  foreach(mode compiled header_only)
    set(library memattn::memattn)
    if(mode STREQUAL "compiled")
      set(library memattn::compiled)
    endif()
    add_library(memattn_${mode}_check_object OBJECT "${memattn_compiled_test_dir}/check.cpp")
    target_link_libraries(memattn_${mode}_check_object PRIVATE ${library})
    target_include_directories(memattn_${mode}_check_object PRIVATE "${PROJECT_SOURCE_DIR}/tests")
    memattn_strict_warnings(memattn_${mode}_check_object)
    add_executable(memattn_${mode}_check $<TARGET_OBJECTS:memattn_${mode}_check_object>)
    target_link_libraries(memattn_${mode}_check PRIVATE ${library})
  endforeach()
  add_test(NAME compiled_library
           COMMAND ${CMAKE_COMMAND}
                   -DCOMPILED=$<TARGET_FILE:memattn_compiled_check>
                   -DHEADER_ONLY=$<TARGET_FILE:memattn_header_only_check>
                   "-DCOMPILED_OBJECTS=$<TARGET_OBJECTS:memattn_compiled_check_object>"
                   "-DHEADER_ONLY_OBJECTS=$<TARGET_OBJECTS:memattn_header_only_check_object>"
                   -DNM=${CMAKE_NM}
                   -P "${memattn_compiled_test_dir}/check.cmake")
  set_tests_properties(compiled_library PROPERTIES LABELS consumer)
endif()
