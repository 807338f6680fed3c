# Builds and runs tests/consumer/project against memattn as a user would get it:
#   find_package      after `cmake --install` into a temporary prefix, and the same
#                     program compiled with the flags of `pkg-config --cflags memattn`;
#   add_subdirectory  of the source tree;
#   fetchcontent      FetchContent_Declare(URL) of an archive of the source tree;
#   package           the .deb that `cpack -G DEB` makes, unpacked with `dpkg-deb -x`
#                     into a scratch root (no root install), used through find_package
#                     and through pkg-config.
# Fails on any step that fails.
set(work "${WORK_DIR}/${MODE}")
file(REMOVE_RECURSE "${work}")
file(MAKE_DIRECTORY "${work}")

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
endfunction()

# The consumer project through CMake, with extra configure arguments.
function(consume_with_cmake name)
  run(${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/consumer/project" -B "${work}/${name}" -G "${GENERATOR}"
      -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Release ${ARGN})
  run(${CMAKE_COMMAND} --build "${work}/${name}")
  run("${work}/${name}/consumer")
endfunction()

# The consumer's one source compiled by hand with pkg-config's flags for memattn, found
# in `pc_dir` (Eigen's eigen3.pc comes from the system's pkg-config path).
function(consume_with_pkg_config pc_dir)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env "PKG_CONFIG_PATH=${pc_dir}" pkg-config --cflags memattn
                  RESULT_VARIABLE rc OUTPUT_VARIABLE cflags ERROR_VARIABLE err OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "pkg-config --cflags memattn failed (${rc}): ${err}")
  endif()
  separate_arguments(cflags UNIX_COMMAND "${cflags}")
  run(${CXX_COMPILER} -std=c++20 -O1 -Wall -Wextra -Werror ${cflags} "${SOURCE_DIR}/tests/consumer/project/main.cpp"
      -o "${work}/pkg_config_consumer")
  run("${work}/pkg_config_consumer")
endfunction()

if(MODE STREQUAL "find_package")
  run(${CMAKE_COMMAND} --install "${BINARY_DIR}" --prefix "${work}/prefix")
  consume_with_cmake(build -DMODE=find_package -DCMAKE_PREFIX_PATH=${work}/prefix)
  consume_with_pkg_config("${work}/prefix/share/pkgconfig")
elseif(MODE STREQUAL "add_subdirectory")
  consume_with_cmake(build -DMODE=add_subdirectory -DMEMATTN_SOURCE_DIR=${SOURCE_DIR})
elseif(MODE STREQUAL "fetchcontent")
  # What a release archive holds: the build files, the headers, the license and docs.
  execute_process(COMMAND ${CMAKE_COMMAND} -E tar czf "${work}/memattn.tar.gz" --
                          CMakeLists.txt cmake include LICENSE README.md CHANGELOG.md
                  WORKING_DIRECTORY "${SOURCE_DIR}" RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "could not archive ${SOURCE_DIR}")
  endif()
  consume_with_cmake(build -DMODE=fetchcontent -DMEMATTN_ARCHIVE=${work}/memattn.tar.gz)
elseif(MODE STREQUAL "package")
  # A packager's build: the install rules alone (cpack builds `all` before packaging).
  run(${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${work}/packaging" -G "${GENERATOR}" -DMEMATTN_BUILD_TESTS=OFF
      -DMEMATTN_BUILD_EXAMPLES=OFF -DMEMATTN_BUILD_BENCHMARKS=OFF)
  run(${CPACK_COMMAND} -G DEB --config "${work}/packaging/CPackConfig.cmake" -B "${work}/packages")
  file(GLOB debs "${work}/packages/*.deb")
  list(LENGTH debs count)
  if(NOT count EQUAL 1)
    message(FATAL_ERROR "expected one .deb in ${work}/packages, found: ${debs}")
  endif()
  run(dpkg-deb -x ${debs} "${work}/root")
  consume_with_cmake(build -DMODE=find_package -DCMAKE_PREFIX_PATH=${work}/root/usr)
  consume_with_pkg_config("${work}/root/usr/share/pkgconfig")
else()
  message(FATAL_ERROR "unknown MODE '${MODE}'")
endif()
message(STATUS "consumer (${MODE}) built and passed")
