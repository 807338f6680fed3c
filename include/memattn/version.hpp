#pragma once
// The one place the version is defined; CMakeLists.txt parses these lines.
#define MEMATTN_VERSION_MAJOR 0
#define MEMATTN_VERSION_MINOR 1
#define MEMATTN_VERSION_PATCH 0

namespace memattn {
inline constexpr int version_major = MEMATTN_VERSION_MAJOR;  ///< major version
inline constexpr int version_minor = MEMATTN_VERSION_MINOR;  ///< minor version
inline constexpr int version_patch = MEMATTN_VERSION_PATCH;  ///< patch version
}  // namespace memattn
