#pragma once
// The one place memattn includes Eigen/Core, after a workaround for a false warning of
// GCC 12 on AVX-512 targets (GCC bug 105593, fixed in GCC 13): the AVX-512 intrinsics
// make their "undefined" pass-through operands with `__m512 __Y = __Y;`, and once
// Eigen's packet code is inlined into optimised code, -Wmaybe-uninitialized and
// -Wuninitialized point at those lines of avx512fintrin.h (hundreds of them for one
// program that includes memattn and builds with -Wall -march=x86-64-v4).
//
// GCC decides whether to report a warning from inlined code by the diagnostic pragmas in
// force at the innermost location it can, which for these is the intrinsics header's own
// line. So the pragma below covers exactly the lines of <immintrin.h> and nothing else:
// not memattn's code, not Eigen's, not the user's. A real uninitialised read in the
// user's code, or in memattn's, is still reported (tests/CMakeLists.txt checks both).
// It takes effect when memattn is the first to include <immintrin.h>, i.e. included
// before Eigen or the intrinsics themselves; otherwise the header has been read already
// and GCC 12 reports the false warning for any Eigen code, the user's included.

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13 && defined(__AVX512F__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

#include <Eigen/Core>
