#pragma once
// Code compiled for an instruction set the build's -march does not have, run only where
// the CPU has it: a portable build (-march=x86-64-v3, x86-64-v4 or plain x86-64) still
// multiplies bfloat16 by vdpbf16ps on AMD Zen 4/5 and in AMX tiles on Intel Xeons.
//
//   MEMATTN_AVX512_BEGIN … MEMATTN_AVX512_END            AVX-512 F, BW, DQ, VL
//   MEMATTN_AVX512_BF16_BEGIN … MEMATTN_AVX512_BF16_END  the same and AVX512-BF16
//
// put GCC's `#pragma GCC target` (Clang's `#pragma clang attribute` of the same target) on
// every function defined between them, templates and lambdas included, where the build
// does not target that set already; where it does, they are empty. The code between them
// is called only where it may run: behind `if (avx512_runs())` / `if (avx512_bf16_runs())`,
// which are constant true where the build targets the set and read cpu_features() (once)
// elsewhere. What such code must not do, because a function defined outside the region
// has the build's target: pass or return a 512-bit vector through one (std::bit_cast of a
// vector, a lambda returning one: each is a function of its own). GCC 12 reports its
// intrinsics headers' self-initialised "undefined" vectors (`_mm512_cvtepu16_epi32`'s,
// `_mm512_slli_epi32`'s) as uninitialised once they are inlined into a target region, so
// GCC's regions turn -Wuninitialized and -Wmaybe-uninitialized off between them; the
// native builds, which compile the same code with both on, keep them checked.
//
//   MEMATTN_BF16_DOT       the build targets AVX512-BF16 (and F, BW, DQ, VL): the bfloat16
//                          products are compiled in place and always run
//   MEMATTN_BF16_DISPATCH  it does not, and the regions above are compiled by target
//                          (GCC or Clang on x86-64): the products run where the CPU has
//                          AVX512-BF16 (cpu_features().avx512_bf16_usable())
//
// Defining MEMATTN_NO_DISPATCH before including memattn keeps a build to its -march: no
// region is compiled past it, and bfloat16 takes the converted float products there.

#include "memattn/cpu_features.hpp"
#include "memattn/detail/eigen_core.hpp"  // first: it reads <immintrin.h> under GCC 12's pragmas

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define MEMATTN_AVX512_NATIVE 1
#endif

#if defined(__AVX512BF16__) && defined(MEMATTN_AVX512_NATIVE)
#define MEMATTN_BF16_DOT 1
#elif defined(MEMATTN_X86_CPUID) && !defined(MEMATTN_NO_DISPATCH)
#define MEMATTN_BF16_DISPATCH 1
#endif

#if defined(MEMATTN_BF16_DISPATCH) && defined(__clang__)
// clang-format off
#define MEMATTN_AVX512_BF16_BEGIN _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512dq,avx512vl,avx512bf16\"))), apply_to = function)")
// clang-format on
#define MEMATTN_AVX512_BF16_END _Pragma("clang attribute pop")
#elif defined(MEMATTN_BF16_DISPATCH)
#define MEMATTN_AVX512_BF16_BEGIN                                                                        \
    _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512dq,avx512vl,avx512bf16\")") \
        _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")              \
            _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define MEMATTN_AVX512_BF16_END _Pragma("GCC diagnostic pop") _Pragma("GCC pop_options")
#else
#define MEMATTN_AVX512_BF16_BEGIN
#define MEMATTN_AVX512_BF16_END
#endif

#if !defined(MEMATTN_AVX512_NATIVE) && defined(MEMATTN_BF16_DISPATCH) && defined(__clang__)
#define MEMATTN_AVX512_BEGIN \
    _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512dq,avx512vl\"))), apply_to = function)")
#define MEMATTN_AVX512_END _Pragma("clang attribute pop")
#define MEMATTN_AVX512_CODE 1
#elif !defined(MEMATTN_AVX512_NATIVE) && defined(MEMATTN_BF16_DISPATCH)
#define MEMATTN_AVX512_BEGIN                                                                  \
    _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512dq,avx512vl\")") \
        _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")   \
            _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define MEMATTN_AVX512_END _Pragma("GCC diagnostic pop") _Pragma("GCC pop_options")
#define MEMATTN_AVX512_CODE 1
#else
#define MEMATTN_AVX512_BEGIN
#define MEMATTN_AVX512_END
#if defined(MEMATTN_AVX512_NATIVE)
#define MEMATTN_AVX512_CODE 1
#endif
#endif

#if defined(MEMATTN_BF16_DOT) || defined(MEMATTN_BF16_DISPATCH)
#define MEMATTN_AVX512_BF16_CODE 1
#endif

#if defined(MEMATTN_AVX512_CODE) || defined(MEMATTN_AVX512_BF16_CODE)
#include <immintrin.h>
#endif

namespace memattn::detail {

/// The code of MEMATTN_AVX512_BEGIN/END regions is compiled (in place or by target).
#if defined(MEMATTN_AVX512_CODE)
inline constexpr bool avx512_code = true;
#else
inline constexpr bool avx512_code = false;
#endif

/// The code of MEMATTN_AVX512_BF16_BEGIN/END regions is compiled (in place or by target).
#if defined(MEMATTN_AVX512_BF16_CODE)
inline constexpr bool avx512_bf16_code = true;
#else
inline constexpr bool avx512_bf16_code = false;
#endif

/// The AVX-512 regions may run here: compiled, and the build targets AVX-512 or the CPU
/// and OS run it.
[[nodiscard]] inline bool avx512_runs() noexcept {
#if defined(MEMATTN_AVX512_NATIVE)
    return true;
#elif defined(MEMATTN_AVX512_CODE)
    return cpu_features().avx512_usable();
#else
    return false;
#endif
}

/// The AVX512-BF16 regions may run here (see avx512_runs).
[[nodiscard]] inline bool avx512_bf16_runs() noexcept {
#if defined(MEMATTN_BF16_DOT)
    return true;
#elif defined(MEMATTN_BF16_DISPATCH)
    return cpu_features().avx512_bf16_usable();
#else
    return false;
#endif
}

}  // namespace memattn::detail
