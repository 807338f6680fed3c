#pragma once
// Every memattn header includes this one first, so a translation unit compiled for an
// older standard stops here, with one line, before the first concept.
#if (defined(_MSVC_LANG) ? _MSVC_LANG : __cplusplus) < 202002L
#error "memattn needs C++20: compile with -std=c++20 (linking CMake's memattn::memattn adds it)"
#endif

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

// Eigen 3.4 itself warns where it is not a system header, i.e. included by a plain -I as
// pkg-config's eigen3.pc gives it (CMake's Eigen3::Eigen makes it -isystem): with any AVX
// target, its bfloat16 packet code (arch/AVX/PacketMath.h F32ToBf16, arch/AVX512/
// PacketMath.h ploaddup and ploadquad) declares an unused `r`, so -Wall reports
// -Wunused-variable; with F16C (x86-64-v3 and up), clang's -Wpedantic reports the
// compound literal of its _cvtss_sh macro in Eigen's Half.h as -Wc99-extensions. These
// are reported while Eigen is parsed, so a push / ignored / pop around the one #include
// covers Eigen's lines and nothing else: memattn's headers, read after the pop, and the
// user's code keep every warning (tests/CMakeLists.txt checks it). Like the pragma above,
// it takes effect when memattn is the first to include Eigen.
#if defined(__GNUC__)  // GCC and clang
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-variable"
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wc99-extensions"
#endif
#endif

#include <Eigen/Core>

#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
