#pragma once
// The one place the version is defined; CMakeLists.txt parses these lines.

/// The major version: an incompatible change of the API raises it (from 1.0).
#define MEMATTN_VERSION_MAJOR 0
/// The minor version.
#define MEMATTN_VERSION_MINOR 1
/// The patch version.
#define MEMATTN_VERSION_PATCH 0

/// \cond
#define MEMATTN_DETAIL_STRINGIFY_(x) #x
#define MEMATTN_DETAIL_STRINGIFY(x) MEMATTN_DETAIL_STRINGIFY_(x)
/// \endcond
/// The version as a string literal, "MAJOR.MINOR.PATCH" ("0.1.0"), made from the three
/// numbers above.
#define MEMATTN_VERSION_STRING                          \
    MEMATTN_DETAIL_STRINGIFY(MEMATTN_VERSION_MAJOR) "." \
    MEMATTN_DETAIL_STRINGIFY(MEMATTN_VERSION_MINOR) "." \
    MEMATTN_DETAIL_STRINGIFY(MEMATTN_VERSION_PATCH)

namespace memattn {
inline constexpr int version_major = MEMATTN_VERSION_MAJOR;  ///< major version
inline constexpr int version_minor = MEMATTN_VERSION_MINOR;  ///< minor version
inline constexpr int version_patch = MEMATTN_VERSION_PATCH;  ///< patch version
/// The version, "MAJOR.MINOR.PATCH" (MEMATTN_VERSION_STRING), null-terminated.
inline constexpr const char version_string[] = MEMATTN_VERSION_STRING;
}  // namespace memattn
