# The release check of docs/release.md: the version in include/memattn/version.hpp,
# CMake's PROJECT_VERSION and the newest version heading of CHANGELOG.md
# ("## [X.Y.Z] - YYYY-MM-DD", below "## [Unreleased]") are the same, the headings go
# from newest to oldest, and a vX.Y.Z tag on the checked-out commit names that version.
#   cmake -DSOURCE_DIR=<tree> -DPROJECT_VERSION=<x.y.z> -P release_versions.cmake
# VERSION_HEADER and CHANGELOG name other files to check (default: the tree's).
cmake_minimum_required(VERSION 3.21)
if(NOT DEFINED VERSION_HEADER)
  set(VERSION_HEADER "${SOURCE_DIR}/include/memattn/version.hpp")
endif()
if(NOT DEFINED CHANGELOG)
  set(CHANGELOG "${SOURCE_DIR}/CHANGELOG.md")
endif()

# version.hpp: one definition of each part.
file(STRINGS "${VERSION_HEADER}" lines REGEX "^#define MEMATTN_VERSION_")
set(header_version "")
foreach(part MAJOR MINOR PATCH)
  set(found "")
  foreach(line IN LISTS lines)
    if(line MATCHES "^#define MEMATTN_VERSION_${part} +([0-9]+) *$")
      list(APPEND found "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  list(LENGTH found count)
  if(NOT count EQUAL 1)
    message(FATAL_ERROR "${VERSION_HEADER}: expected one '#define MEMATTN_VERSION_${part} <n>', found ${count}")
  endif()
  list(APPEND header_version "${found}")
endforeach()
list(JOIN header_version "." header_version)

# CHANGELOG.md: every second-level heading is [Unreleased] or a dated version.
file(STRINGS "${CHANGELOG}" headings REGEX "^## ")
set(changelog_version "")
set(previous "")
foreach(heading IN LISTS headings)
  if(heading STREQUAL "## [Unreleased]")
    if(previous OR changelog_version)
      message(FATAL_ERROR "${CHANGELOG}: '## [Unreleased]' below a version")
    endif()
  elseif(heading MATCHES "^## \\[([0-9]+\\.[0-9]+\\.[0-9]+)\\] - [0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]$")
    set(version "${CMAKE_MATCH_1}")
    if(NOT changelog_version)
      set(changelog_version "${version}")
    elseif(NOT previous VERSION_GREATER version)
      message(FATAL_ERROR "${CHANGELOG}: ${version} is listed below ${previous}; the newest version comes first")
    endif()
    set(previous "${version}")
  else()
    message(FATAL_ERROR "${CHANGELOG}: heading '${heading}' is neither '## [Unreleased]' nor '## [X.Y.Z] - YYYY-MM-DD'")
  endif()
endforeach()
if(NOT changelog_version)
  message(FATAL_ERROR "${CHANGELOG}: no '## [X.Y.Z] - YYYY-MM-DD' heading")
endif()

if(NOT header_version STREQUAL PROJECT_VERSION OR NOT header_version STREQUAL changelog_version)
  message(FATAL_ERROR "the versions disagree: ${VERSION_HEADER} says ${header_version}, CMake's PROJECT_VERSION "
                      "${PROJECT_VERSION}, ${CHANGELOG}'s newest heading ${changelog_version}")
endif()

# A release tag on the checked-out commit, in a git checkout.
find_package(Git QUIET)
if(GIT_FOUND AND EXISTS "${SOURCE_DIR}/.git")
  execute_process(COMMAND "${GIT_EXECUTABLE}" -C "${SOURCE_DIR}" tag --points-at HEAD --list "v[0-9]*"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE tags OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(rc EQUAL 0 AND tags)
    string(REPLACE "\n" ";" tags "${tags}")
    foreach(tag IN LISTS tags)
      if(NOT tag STREQUAL "v${header_version}")
        message(FATAL_ERROR "HEAD is tagged ${tag}, but the version is ${header_version}")
      endif()
    endforeach()
  endif()
endif()
message(STATUS "version ${header_version}: version.hpp, CMake and CHANGELOG.md agree")
