# Builds and runs tests/consumer/project against memattn as a user would get it:
#   find_package      after `cmake --install` into a temporary prefix: with OpenMP, with
#                     OpenMP and MPI disabled (CMAKE_DISABLE_FIND_PACKAGE_*), and the same
#                     program compiled with the flags of `pkg-config memattn` and of
#                     `pkg-config memattn-openmp`. A consumer that does not ask for the
#                     component mpi gets no memattn::mpi and leaves MPI unsearched (no MPI
#                     variable in its cache); one that asks for it (COMPONENTS mpi) gets
#                     memattn::mpi and runs an MPI program on one rank, or, where there is
#                     no MPI, fails saying so;
#   add_subdirectory  of the source tree;
#   fetchcontent      the release files made as docs/release.md says (`cpack` and
#                     `cpack --config CPackSourceConfig.cmake` in a fresh build tree),
#                     then the README's FetchContent_Declare(URL file://... URL_HASH
#                     DOWNLOAD_EXTRACT_TIMESTAMP) of that source archive; and, when the
#                     source tree is a git work tree, FetchContent_Declare(GIT_REPOSITORY
#                     <the source tree> GIT_TAG <its HEAD commit>);
#   package           the .deb that `cpack -G DEB` makes, unpacked with `dpkg-deb -x`
#                     into a scratch root (no root install), used through find_package
#                     without OpenMP and through pkg-config (--define-prefix).
# The program prints "OpenMP on (<n> threads)" or "OpenMP off"; it runs with
# OMP_NUM_THREADS=2, and each build must say what its way in promises. OPENMP is
# whether this compiler has an OpenMP, INSTALLED_OPENMP the MEMATTN_OPENMP of the build
# tree installed from (BINARY_DIR; the trees configured here have the default, ON).
# Every configure of the consumer must pass without a CMake warning from a CMake file
# (CMP0135's included). Fails on any step that fails. The consumer is a Release build
# (NDEBUG) compiled without optimisation (-O0): what it checks is the way in, and each
# of its dozen compiles of memattn.hpp takes 7.7 s so against 13.4 s at -O3 (Zen 2); the
# headers' warnings at -O3 are the warnings units' (tests/CMakeLists.txt).
cmake_minimum_required(VERSION 3.21)
set(installed_openmp OFF)
if(OPENMP AND INSTALLED_OPENMP)
  set(installed_openmp ON)
endif()
set(work "${WORK_DIR}/${MODE}")
file(REMOVE_RECURSE "${work}")
file(MAKE_DIRECTORY "${work}")

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
endfunction()

# Runs a consumer program; `openmp` ON: it must report OpenMP with two threads, OFF: none.
function(run_consumer program openmp)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env OMP_NUM_THREADS=2 "${program}"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${program}\n${out}\n${err}")
  endif()
  if(openmp)
    set(expect "OpenMP on \\(2 threads\\)")
  else()
    set(expect "OpenMP off")
  endif()
  if(NOT out MATCHES "${expect}\n")
    message(FATAL_ERROR "${program} printed\n${out}\nexpected a line '${expect}'")
  endif()
  message(STATUS "${program}: ${out}")
endfunction()

# Configures the consumer project in ${work}/<name> with extra arguments; fails if the
# configure fails or CMake warns from a CMake file ("CMake Warning (dev) at ...", such as
# FetchContent's CMP0135 warning without DOWNLOAD_EXTRACT_TIMESTAMP).
function(configure_consumer name)
  execute_process(COMMAND ${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/consumer/project" -B "${work}/${name}"
                          -G "${GENERATOR}" -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Release
                          -DCMAKE_CXX_FLAGS_RELEASE=-DNDEBUG ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "configuring the consumer ${name} failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  if("${out}${err}" MATCHES "CMP0135|CMake (Deprecation )?Warning( \\(dev\\))? at ")
    message(FATAL_ERROR "configuring the consumer ${name} (${ARGN}) warned:\n${err}")
  endif()
endfunction()

# Configuring the consumer project with these arguments must fail, saying `expect` (a
# regular expression); `what` names the case in the message.
function(configure_consumer_fails name what expect)
  execute_process(COMMAND ${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/consumer/project" -B "${work}/${name}"
                          -G "${GENERATOR}" -DCMAKE_CXX_COMPILER=${CXX_COMPILER} ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT err MATCHES "${expect}")
    message(FATAL_ERROR "${what} did not fail saying '${expect}' (${rc}):\n${out}\n${err}")
  endif()
endfunction()

# The consumer project through CMake, with extra configure arguments.
function(consume_with_cmake name openmp)
  configure_consumer(${name} ${ARGN})
  run(${CMAKE_COMMAND} --build "${work}/${name}")
  run_consumer("${work}/${name}/consumer" ${openmp})
endfunction()

# `pkg-config <args>` with PKG_CONFIG_PATH=pc_dir (Eigen's eigen3.pc comes from the
# system's path), its output in `var`. Every path it prints must be normalised.
function(pkg_config var pc_dir)
  string(REPLACE ";" " " args "${ARGN}")
  execute_process(COMMAND ${CMAKE_COMMAND} -E env "PKG_CONFIG_PATH=${pc_dir}" pkg-config ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "pkg-config ${args} failed (${rc}): ${err}")
  endif()
  if(out MATCHES "/\\.\\.?(/|$| )")
    message(FATAL_ERROR "pkg-config ${args} printed a path with '.' or '..' in it: ${out}")
  endif()
  message(STATUS "pkg-config ${args}: ${out}")
  set(${var} "${out}" PARENT_SCOPE)
endfunction()

# The consumer's one source compiled by hand with the flags of `pkg-config <args>`.
function(compile_with_pkg_config name pc_dir openmp)
  pkg_config(flags "${pc_dir}" ${ARGN})
  separate_arguments(flags UNIX_COMMAND "${flags}")
  run(${CXX_COMPILER} -std=c++20 -O0 -Wall -Wextra -Werror "${SOURCE_DIR}/tests/consumer/project/main.cpp" ${flags}
      -o "${work}/${name}")
  run_consumer("${work}/${name}" ${openmp})
endfunction()

# memattn through pkg-config, its files in `pc_dir`, expected to give `-I<include_dir>`.
# `define_prefix`: the tree was unpacked away from its prefix (--define-prefix). memattn.pc
# builds serially; memattn-openmp.pc, when `openmp` (it is installed and this compiler
# has OpenMP), with the threads.
function(consume_with_pkg_config pc_dir include_dir define_prefix openmp)
  set(relocate "")
  if(define_prefix)
    set(relocate --define-prefix)
  endif()
  pkg_config(cflags "${pc_dir}" --cflags memattn)  # as installed, not relocated
  if(define_prefix)
    pkg_config(cflags "${pc_dir}" ${relocate} --cflags memattn)
  endif()
  separate_arguments(cflags UNIX_COMMAND "${cflags}")
  if(NOT "-I${include_dir}" IN_LIST cflags)
    message(FATAL_ERROR "pkg-config --cflags memattn gave ${cflags}, expected -I${include_dir} among them")
  endif()
  compile_with_pkg_config(pkg_config_consumer "${pc_dir}" OFF ${relocate} --cflags memattn)
  if(openmp)
    compile_with_pkg_config(pkg_config_openmp_consumer "${pc_dir}" ON ${relocate} --cflags --libs memattn-openmp)
  endif()
endfunction()

# Configures the project for packaging alone: the install rules, no tests (cpack builds
# `all` before packaging).
function(configure_packaging)
  run(${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${work}/packaging" -G "${GENERATOR}" -DMEMATTN_BUILD_TESTS=OFF
      -DMEMATTN_BUILD_EXAMPLES=OFF -DMEMATTN_BUILD_BENCHMARKS=OFF)
endfunction()

if(MODE STREQUAL "find_package")
  run(${CMAKE_COMMAND} --install "${BINARY_DIR}" --prefix "${work}/prefix")
  consume_with_cmake(build ${installed_openmp} -DMODE=find_package -DCMAKE_PREFIX_PATH=${work}/prefix)
  # Not asked for, MPI is not looked for: FindMPI would leave MPI_* and MPIEXEC_* in the cache.
  file(STRINGS "${work}/build/CMakeCache.txt" mpi_cache REGEX "^MPI")
  if(mpi_cache)
    message(FATAL_ERROR "find_package(memattn) looked for MPI, which the consumer did not ask for:\n${mpi_cache}")
  endif()
  # A machine without OpenMP or MPI finds the package and builds serially...
  consume_with_cmake(build_serial OFF -DMODE=find_package -DCMAKE_PREFIX_PATH=${work}/prefix
                     -DCMAKE_DISABLE_FIND_PACKAGE_OpenMP=ON -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON)
  # ...and with mpi an optional component, without memattn::mpi (the project checks)...
  configure_consumer(build_optional_mpi -DMODE=find_package -DCMAKE_PREFIX_PATH=${work}/prefix
                     -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DMEMATTN_OPTIONAL_COMPONENTS=mpi)
  # ...unless it asks for the threads.
  configure_consumer_fails(build_require "find_package(memattn COMPONENTS OpenMP) without OpenMP"
                           "component OpenMP was asked for" -DMODE=find_package -DCMAKE_PREFIX_PATH=${work}/prefix
                           -DCMAKE_DISABLE_FIND_PACKAGE_OpenMP=ON -DMEMATTN_COMPONENTS=OpenMP)
  configure_consumer_fails(build_unknown "find_package(memattn COMPONENTS MPI), a component memattn has not"
                           "no component MPI" -DMODE=find_package -DCMAKE_PREFIX_PATH=${work}/prefix
                           -DMEMATTN_COMPONENTS=MPI)
  # The component mpi: memattn::mpi where memattn was installed with it and this machine
  # has an MPI for C++, an error otherwise.
  if(EXISTS "${work}/prefix/share/cmake/memattn/memattnMpiTargets.cmake")
    configure_consumer(build_mpi -DMODE=find_package -DCMAKE_PREFIX_PATH=${work}/prefix -DMEMATTN_COMPONENTS=mpi)
    run(${CMAKE_COMMAND} --build "${work}/build_mpi" --target consumer_mpi)
    # One rank, started without mpirun (MPI's singleton start).
    execute_process(COMMAND ${CMAKE_COMMAND} -E env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
                            "${work}/build_mpi/consumer_mpi"
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    if(NOT rc EQUAL 0 OR NOT out MATCHES "memattn::mpi consumer: ok \\(1 ranks\\)")
      message(FATAL_ERROR "${work}/build_mpi/consumer_mpi failed (${rc}):\n${out}\n${err}")
    endif()
    message(STATUS "${work}/build_mpi/consumer_mpi: ${out}")
    configure_consumer_fails(build_mpi_missing "find_package(memattn COMPONENTS mpi) without MPI"
                             "component mpi was asked for, but CMake finds no MPI" -DMODE=find_package
                             -DCMAKE_PREFIX_PATH=${work}/prefix -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON
                             -DMEMATTN_COMPONENTS=mpi)
  else()
    configure_consumer_fails(build_mpi_missing "find_package(memattn COMPONENTS mpi) of a memattn installed without it"
                             "component mpi was asked for, but memattn was installed without"
                             -DMODE=find_package -DCMAKE_PREFIX_PATH=${work}/prefix -DMEMATTN_COMPONENTS=mpi)
  endif()
  consume_with_pkg_config("${work}/prefix/share/pkgconfig" "${work}/prefix/include" OFF ${installed_openmp})
elseif(MODE STREQUAL "add_subdirectory")
  consume_with_cmake(build "${OPENMP}" -DMODE=add_subdirectory -DMEMATTN_SOURCE_DIR=${SOURCE_DIR})
elseif(MODE STREQUAL "fetchcontent")
  # The release files, and nothing else under the source archive's name.
  configure_packaging()
  run(${CPACK_COMMAND} --config "${work}/packaging/CPackSourceConfig.cmake" -B "${work}/release")
  run(${CPACK_COMMAND} --config "${work}/packaging/CPackConfig.cmake" -B "${work}/release")
  file(GLOB made RELATIVE "${work}/release" "${work}/release/*")
  list(REMOVE_ITEM made _CPack_Packages)
  list(SORT made)
  set(expected "memattn-${VERSION}.tar.gz" "memattn_${VERSION}_all.deb")
  if(NOT made STREQUAL expected)
    message(FATAL_ERROR "the release files are '${made}', expected '${expected}'")
  endif()
  set(archive "${work}/release/memattn-${VERSION}.tar.gz")
  execute_process(COMMAND ${CMAKE_COMMAND} -E tar tzf "${archive}" RESULT_VARIABLE rc OUTPUT_VARIABLE listing)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "could not list ${archive}")
  endif()
  foreach(file CMakeLists.txt cmake/memattnConfig.cmake.in include/memattn/memattn.hpp LICENSE CHANGELOG.md
               tests/consumer/run.cmake)
    if(NOT listing MATCHES "(^|\n)memattn-${VERSION}/${file}\n")
      message(FATAL_ERROR "${archive} has no memattn-${VERSION}/${file}:\n${listing}")
    endif()
  endforeach()
  if(listing MATCHES "(^|\n)(memattn-${VERSION}/(build|out|\\.git)(/|\n)[^\n]*)")
    message(FATAL_ERROR "${archive} holds ${CMAKE_MATCH_2}")
  endif()
  if(listing MATCHES "(^|\n)([^\n]*/(CMakeCache\\.txt|CPackConfig\\.cmake))\n")
    message(FATAL_ERROR "${archive} holds a build tree's ${CMAKE_MATCH_2}")
  endif()
  file(SHA256 "${archive}" sha256)
  consume_with_cmake(build "${OPENMP}" -DMODE=fetchcontent "-DMEMATTN_ARCHIVE=file://${archive}"
                     -DMEMATTN_ARCHIVE_SHA256=${sha256})
  # A commit of the repository (offline: the source tree's own repository, at HEAD), when
  # the source tree is a git work tree's top (not an unpacked archive).
  find_program(git_command git)
  set(commit "")
  if(git_command)
    execute_process(COMMAND "${git_command}" -C "${SOURCE_DIR}" rev-parse --show-toplevel HEAD
                    RESULT_VARIABLE rc OUTPUT_VARIABLE lines ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(rc EQUAL 0)
      string(REPLACE "\n" ";" lines "${lines}")
      list(GET lines 0 top)
      list(GET lines 1 head)
      file(REAL_PATH "${top}" top)
      file(REAL_PATH "${SOURCE_DIR}" source)
      if(top STREQUAL source AND head MATCHES "^[0-9a-f]+$")
        set(commit "${head}")
      endif()
    endif()
  endif()
  if(commit)
    consume_with_cmake(build_git "${OPENMP}" -DMODE=fetchcontent_git "-DMEMATTN_GIT_REPOSITORY=${SOURCE_DIR}"
                       -DMEMATTN_GIT_TAG=${commit})
  else()
    message(STATUS "${SOURCE_DIR} is not a git work tree's top: FetchContent of a commit not tested")
  endif()
elseif(MODE STREQUAL "package")
  configure_packaging()
  run(${CPACK_COMMAND} -G DEB --config "${work}/packaging/CPackConfig.cmake" -B "${work}/packages")
  file(GLOB debs "${work}/packages/*.deb")
  list(LENGTH debs count)
  if(NOT count EQUAL 1)
    message(FATAL_ERROR "expected one .deb in ${work}/packages, found: ${debs}")
  endif()
  run(dpkg-deb -x ${debs} "${work}/root")
  # The .deb only suggests an OpenMP: without one, find_package(memattn) still works.
  consume_with_cmake(build OFF -DMODE=find_package -DCMAKE_PREFIX_PATH=${work}/root/usr
                     -DCMAKE_DISABLE_FIND_PACKAGE_OpenMP=ON)
  consume_with_pkg_config("${work}/root/usr/share/pkgconfig" "${work}/root/usr/include" ON "${OPENMP}")
else()
  message(FATAL_ERROR "unknown MODE '${MODE}'")
endif()
message(STATUS "consumer (${MODE}) built and passed")
