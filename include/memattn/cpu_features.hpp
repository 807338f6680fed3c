#pragma once
// What this CPU and its operating system let memattn's kernels use, found at run time:
//
//   const memattn::CpuFeatures& cpu = memattn::cpu_features();
//   std::printf("%s\n", memattn::describe(cpu).c_str());   // "avx2 fma f16c ... amx-bf16 (granted)"
//   if (cpu.amx_usable()) ...                               // the tile instructions will run here
//
// On x86-64 the CPU's features come from CPUID (leaves 1 and 7) and whether the operating
// system saves the wider registers from XGETBV (XCR0); MEMATTN_AMX=0 in the environment
// (read once, with the rest) turns the tiles off. Elsewhere every feature is false.
//
// On Linux a process must ask for the AMX tile state (XTILEDATA, 8 KiB a thread) before
// its first tile instruction: request_amx() asks, once per process, with
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), and only where amx_usable(). The
// kernels call it the first time they would run tiles, not before: once granted, Linux
// refuses a sigaltstack() smaller than the larger signal frame the tiles need (a host
// program with small alternate signal stacks keeps them by setting MEMATTN_AMX=0). A
// refused request leaves the tiles off, and the kernels take the next path, silently
// correct.
//
// The first call finds them (thread-safe, once); later calls return the same object.
// compiled_paths() says what this translation unit was compiled to use: a path runs
// where it was compiled and the CPU has it. bf16_products() says which arithmetic the
// bfloat16 softmax kernel takes here: a portable build (-march=x86-64-v3, say) compiles
// vdpbf16ps and the AMX tiles by target and takes them where the CPU has them.

#include <cstdlib>
#include <string>
#include <string_view>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define MEMATTN_X86_CPUID 1
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace memattn {

/// The instruction-set features of this CPU that memattn's paths use, and whether the
/// operating system lets them run (see the top of the file). All false off x86-64.
struct CpuFeatures {
    bool avx2 = false;         ///< AVX2 (x86-64-v3, with fma and f16c)
    bool fma = false;          ///< FMA3
    bool f16c = false;         ///< half-precision conversions
    bool avx512f = false;      ///< AVX-512 Foundation (x86-64-v4: with bw, dq, vl)
    bool avx512bw = false;     ///< AVX-512 byte and word
    bool avx512dq = false;     ///< AVX-512 doubleword and quadword
    bool avx512vl = false;     ///< AVX-512 on 128- and 256-bit registers
    bool avx512_bf16 = false;  ///< vdpbf16ps and the bfloat16 conversions (Zen 4/5, Cooper Lake, Sapphire Rapids on)
    bool avx512_fp16 = false;  ///< AVX512-FP16 (Sapphire Rapids on)
    bool avx512_vnni = false;  ///< vpdpbusd on 512-bit registers
    bool avx_vnni = false;     ///< vpdpbusd on 256-bit registers, VEX-encoded
    bool amx_tile = false;     ///< AMX tiles (the CPU's; os_amx: the OS's)
    bool amx_bf16 = false;     ///< tdpbf16ps
    bool amx_int8 = false;     ///< tdpbssd and its signed/unsigned variants
    bool os_avx = false;       ///< the OS saves the ymm registers (XCR0 bits 1, 2)
    bool os_avx512 = false;    ///< the OS saves the zmm and mask registers (XCR0 bits 5, 6, 7)
    bool os_amx = false;       ///< the OS saves the tile state (XCR0 bits 17, 18)
    bool amx_allowed = true;   ///< not turned off by the environment: MEMATTN_AMX=0

    /// AVX2 and FMA will run: the x86-64-v3 paths.
    [[nodiscard]] bool avx2_usable() const noexcept { return avx2 && fma && os_avx; }
    /// AVX-512 F, BW, DQ and VL will run: the x86-64-v4 paths.
    [[nodiscard]] bool avx512_usable() const noexcept {
        return avx512f && avx512bw && avx512dq && avx512vl && os_avx512;
    }
    /// vdpbf16ps will run.
    [[nodiscard]] bool avx512_bf16_usable() const noexcept { return avx512_usable() && avx512_bf16; }
    /// tdpbf16ps can run: the CPU has AMX-BF16 and AVX-512, the OS saves the tiles, and
    /// MEMATTN_AMX is not 0 (on Linux, once request_amx() is granted).
    [[nodiscard]] bool amx_usable() const noexcept {
        return amx_tile && amx_bf16 && os_amx && amx_allowed && avx512_usable();
    }
};

namespace detail {

#if defined(MEMATTN_X86_CPUID)
/// XCR0, the state components the OS saves (0 when it has not enabled XSAVE).
inline unsigned long long xcr0(bool osxsave) noexcept {
    if (!osxsave)
        return 0;
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (static_cast<unsigned long long>(hi) << 32) | lo;
}

/// Asks Linux for the AMX tile data state for this process (once is enough: it holds
/// for every thread, present and future). Whether it was granted.
inline bool request_amx_state() noexcept {
#if defined(__linux__) && defined(SYS_arch_prctl)
    constexpr long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;
    return syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0;
#else
    return false;
#endif
}
#endif

/// CPUID, XGETBV and, where the CPU and OS have AMX, the tile state's request.
inline CpuFeatures find_cpu_features() noexcept {
    CpuFeatures f;
#if defined(MEMATTN_X86_CPUID)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(0, &a, &b, &c, &d) == 0)
        return f;
    const unsigned top = a;
    __get_cpuid(1, &a, &b, &c, &d);
    f.fma = (c >> 12) & 1;
    f.f16c = (c >> 29) & 1;
    const bool osxsave = (c >> 27) & 1;
    const unsigned long long x = xcr0(osxsave);
    f.os_avx = (x & 0x6) == 0x6;
    f.os_avx512 = f.os_avx && (x & 0xe0) == 0xe0;
    f.os_amx = (x & 0x60000) == 0x60000;
    if (top >= 7) {
        __get_cpuid_count(7, 0, &a, &b, &c, &d);
        const unsigned subleaves = a;
        f.avx2 = (b >> 5) & 1;
        f.avx512f = (b >> 16) & 1;
        f.avx512dq = (b >> 17) & 1;
        f.avx512bw = (b >> 30) & 1;
        f.avx512vl = (b >> 31) & 1;
        f.avx512_vnni = (c >> 11) & 1;
        f.amx_bf16 = (d >> 22) & 1;
        f.avx512_fp16 = (d >> 23) & 1;
        f.amx_tile = (d >> 24) & 1;
        f.amx_int8 = (d >> 25) & 1;
        if (subleaves >= 1) {
            __get_cpuid_count(7, 1, &a, &b, &c, &d);
            f.avx_vnni = (a >> 4) & 1;
            f.avx512_bf16 = (a >> 5) & 1;
        }
    }
    const char* amx = std::getenv("MEMATTN_AMX");
    f.amx_allowed = amx == nullptr || std::string_view(amx) != "0";
#endif
    return f;
}

}  // namespace detail

/// This CPU's features and what the OS lets run, found once (thread-safe) on the first
/// call. No system call but CPUID and XGETBV.
[[nodiscard]] inline const CpuFeatures& cpu_features() noexcept {
    static const CpuFeatures features = detail::find_cpu_features();
    return features;
}

/// Whether this process may run tile instructions: where cpu_features().amx_usable(), asks
/// Linux for the tile state the first time (thread-safe; once per process, for every
/// thread), and says whether it was granted; false elsewhere, without asking. See the top
/// of the file for what the grant changes.
[[nodiscard]] inline bool request_amx() noexcept {
#if defined(MEMATTN_X86_CPUID)
    static const bool granted = cpu_features().amx_usable() && detail::request_amx_state();
    return granted;
#else
    return false;
#endif
}

/// What memattn was compiled to use in this translation unit (the -march or target
/// options it was built with): the bfloat16 products' paths, the widest packets.
struct CompiledPaths {
    bool avx2 = false;         ///< AVX2 and FMA packets (x86-64-v3)
    bool avx512 = false;       ///< AVX-512 packets (x86-64-v4)
    bool avx512_bf16 = false;  ///< vdpbf16ps for bfloat16 products, everywhere (the build targets AVX512-BF16)
    /// vdpbf16ps and AMX for the bfloat16 softmax kernel compiled by target in a build
    /// that does not target AVX512-BF16 (GCC or Clang on x86-64, MEMATTN_NO_DISPATCH not
    /// defined), taken where the CPU runs them (detail/isa_regions.hpp)
    bool avx512_bf16_by_target = false;
};

/// The paths this translation unit was compiled with (see CompiledPaths).
[[nodiscard]] constexpr CompiledPaths compiled_paths() noexcept {
    CompiledPaths p;
#if defined(__AVX2__) && defined(__FMA__)
    p.avx2 = true;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
    p.avx512 = true;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
    p.avx512_bf16 = true;
#elif defined(MEMATTN_X86_CPUID) && !defined(MEMATTN_NO_DISPATCH)
    p.avx512_bf16_by_target = true;
#endif
    return p;
}

/// The arithmetic of the bfloat16 softmax kernel (causal_softmax_attention and the
/// multi-head layer on bfloat16, the pool's FpMath::bf16 prompts).
enum class Bf16Products {
    converted_float,  ///< each tile converted to float, the float products (exact inputs)
    vdpbf16ps,        ///< AVX512-BF16's pair products, the weights rounded to bfloat16
    amx_tiles,        ///< the same arithmetic in AMX tiles (an odd head dimension: vdpbf16ps)
};

/// Which Bf16Products this translation unit takes on this CPU: vdpbf16ps where it was
/// compiled (compiled_paths(): in place or by target) and the CPU runs it, AMX tiles where
/// besides the CPU has AMX-BF16 and Linux grants the tile state (request_amx(), asked here
/// as the kernel asks on its first call), else converted_float.
[[nodiscard]] inline Bf16Products bf16_products() noexcept {
    const CompiledPaths p = compiled_paths();
    if (!p.avx512_bf16 && !(p.avx512_bf16_by_target && cpu_features().avx512_bf16_usable()))
        return Bf16Products::converted_float;
    return request_amx() ? Bf16Products::amx_tiles : Bf16Products::vdpbf16ps;
}

/// The features present, by their Linux /proc/cpuinfo names, then the registers the OS
/// saves: e.g. "avx2 fma f16c avx512f avx512bw avx512dq avx512vl avx512_bf16 amx_tile
/// amx_bf16 (os: avx avx512 amx)".
[[nodiscard]] inline std::string describe(const CpuFeatures& f) {
    const auto add = [](std::string& to, bool on, const char* name) {
        if (!on)
            return;
        if (!to.empty())  // appended in place: GCC 12 at -O3 reports a false -Wrestrict for a temporary's +
            to.push_back(' ');
        to.append(name);
    };
    std::string s, os;
    add(s, f.avx2, "avx2");
    add(s, f.fma, "fma");
    add(s, f.f16c, "f16c");
    add(s, f.avx512f, "avx512f");
    add(s, f.avx512bw, "avx512bw");
    add(s, f.avx512dq, "avx512dq");
    add(s, f.avx512vl, "avx512vl");
    add(s, f.avx512_bf16, "avx512_bf16");
    add(s, f.avx512_fp16, "avx512_fp16");
    add(s, f.avx512_vnni, "avx512_vnni");
    add(s, f.avx_vnni, "avx_vnni");
    add(s, f.amx_tile, "amx_tile");
    add(s, f.amx_bf16, "amx_bf16");
    add(s, f.amx_int8, "amx_int8");
    add(os, f.os_avx, "avx");
    add(os, f.os_avx512, "avx512");
    add(os, f.os_amx, "amx");
    return s + (s.empty() ? "" : " ") + "(os: " + (os.empty() ? "none" : os) +
           (f.amx_tile && !f.amx_allowed ? "; MEMATTN_AMX=0)" : ")");
}

}  // namespace memattn
