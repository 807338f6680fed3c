# Builds and runs tests/consumer/project against memattn, either through
# find_package after `cmake --install` into a temporary prefix, or through
# add_subdirectory of the source tree. Fails on any step that fails.
set(work "${WORK_DIR}/${MODE}")
file(REMOVE_RECURSE "${work}")
file(MAKE_DIRECTORY "${work}")

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
endfunction()

if(MODE STREQUAL "find_package")
  run(${CMAKE_COMMAND} --install "${BINARY_DIR}" --prefix "${work}/prefix")
  set(configure_args -DCMAKE_PREFIX_PATH=${work}/prefix)
else()
  set(configure_args -DMEMATTN_SOURCE_DIR=${SOURCE_DIR})
endif()
run(${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/consumer/project" -B "${work}/build" -G "${GENERATOR}"
    -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Release -DMODE=${MODE} ${configure_args})
run(${CMAKE_COMMAND} --build "${work}/build")
run("${work}/build/consumer")
message(STATUS "consumer (${MODE}) built and passed")
