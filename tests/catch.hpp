#pragma once
// Catch2 2.13 (Debian 12) and Catch2 3.x both build the tests; this picks the include
// and names the one matcher whose spelling differs between them.
#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
namespace memattn::test {
inline auto HasSubstring(const std::string& text) { return Catch::Matchers::ContainsSubstring(text); }
}  // namespace memattn::test
#else
#include <catch2/catch.hpp>
namespace memattn::test {
inline auto HasSubstring(const std::string& text) { return Catch::Matchers::Contains(text); }
}  // namespace memattn::test
#endif
