#pragma once
// Catch2 2.13 (Debian 12) and Catch2 3.x both build the tests; this picks the include.
#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#else
#include <catch2/catch.hpp>
#endif
