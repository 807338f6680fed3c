// The version: MEMATTN_VERSION_STRING and memattn::version_string spell the three numbers
// of version.hpp (which CMake's project version and the CHANGELOG are checked against).
#include "support.hpp"

#include <memattn/version.hpp>

#include <string>
#include <string_view>

static_assert(std::string_view(MEMATTN_VERSION_STRING) == memattn::version_string);
static_assert(sizeof(memattn::version_string) == std::string_view(MEMATTN_VERSION_STRING).size() + 1);

TEST_CASE("version_string is MAJOR.MINOR.PATCH of the version numbers", "[version]") {
    const std::string expected = std::to_string(memattn::version_major) + "." +
                                 std::to_string(memattn::version_minor) + "." +
                                 std::to_string(memattn::version_patch);
    CHECK(std::string(MEMATTN_VERSION_STRING) == expected);
    CHECK(std::string(memattn::version_string) == expected);
    CHECK(memattn::version_major == MEMATTN_VERSION_MAJOR);
    CHECK(memattn::version_minor == MEMATTN_VERSION_MINOR);
    CHECK(memattn::version_patch == MEMATTN_VERSION_PATCH);
}
