#pragma once
// Eigen's SIMD packet of a scalar, for the hand-blocked loops of the kernels, and the
// one packet function the online softmax needs that Eigen's pexp makes slow. The same
// loops instantiated with the scalar itself as the "packet" handle leftover lanes,
// since Eigen's generic packet functions (pset1, pmadd, pexp, ...) accept scalars.

#include "memattn/detail/isa_regions.hpp"
#include "memattn/types.hpp"

#if defined(__SSE2__) || defined(_M_X64) || defined(__AVX__)
#include <immintrin.h>
#endif

#include <cmath>
#include <concepts>
#include <limits>
#include <type_traits>

namespace memattn::detail {

/// The tag of the calls that leave the stores they streamed past the cache unfenced: the
/// caller fences once after many (stream_fence).
struct Unfenced {};
/// Unfenced{}.
inline constexpr Unfenced unfenced{};

/// Orders the stores this thread streamed past the cache (non-temporal stores) before
/// whatever it stores next, so another thread that sees those sees them: once after a
/// batch of streamed data, not after each piece (each fence waits for the writes to
/// reach memory).
inline void stream_fence() noexcept {
#if defined(__SSE2__) || defined(_M_X64) || defined(__AVX__)
    _mm_sfence();
#endif
}
/// stream_fence when it goes out of scope, also when the scope throws.
struct StreamFence {
    StreamFence() = default;
    StreamFence(const StreamFence&) = delete;
    StreamFence& operator=(const StreamFence&) = delete;
    ~StreamFence() { stream_fence(); }
};

template <class T>
using Packet = typename Eigen::internal::packet_traits<T>::type;

/// Lanes in one SIMD packet of T (1 when Eigen does not vectorise T).
template <class T>
inline constexpr Index packet_lanes = Eigen::internal::unpacket_traits<Packet<T>>::size;

/// The smallest exponent e for which exp2_nonpositive gives 2^e rather than 0: 2^e is
/// still a normal number of T with room for the polynomial's rounding.
template <class T>
inline constexpr T exp2_lowest = std::is_same_v<T, float> ? T(-125) : T(-1021);

/// e · 2^n for the packet e of doubles and n held in the low mantissa bits of `biased`
/// (see exp2_nonpositive): n·2^52 added to e's bits, wrapping as two's complement.
#if defined(EIGEN_VECTORIZE_SSE2)
inline Eigen::internal::Packet2d add_exponent(const Eigen::internal::Packet2d& e,
                                              const Eigen::internal::Packet2d& biased) {
    return _mm_castsi128_pd(_mm_add_epi64(_mm_castpd_si128(e), _mm_slli_epi64(_mm_castpd_si128(biased), 52)));
}
#endif
#if defined(EIGEN_VECTORIZE_AVX2)
inline Eigen::internal::Packet4d add_exponent(const Eigen::internal::Packet4d& e,
                                              const Eigen::internal::Packet4d& biased) {
    return _mm256_castsi256_pd(
        _mm256_add_epi64(_mm256_castpd_si256(e), _mm256_slli_epi64(_mm256_castpd_si256(biased), 52)));
}
#endif
#if defined(EIGEN_VECTORIZE_AVX512)
inline Eigen::internal::Packet8d add_exponent(const Eigen::internal::Packet8d& e,
                                              const Eigen::internal::Packet8d& biased) {
    return _mm512_castsi512_pd(
        _mm512_add_epi64(_mm512_castpd_si512(e), _mm512_slli_epi64(_mm512_castpd_si512(biased), 52)));
}
#endif

template <class P>
concept HasAddExponent = requires(const P& p) {
    { add_exponent(p, p) } -> std::same_as<P>;
};

/// The float polynomial of exp2_nonpositive: 2^f ≈ Σ_k c_k f^k on [−1/2, 1/2], highest
/// degree first (c_0 = 1: 2^0 is exact).
inline constexpr float exp2_coefficients[6] = {1.3390863364719507e-3f, 9.676031918343615e-3f,
                                               5.550357114219621e-2f,  2.4022107485307692e-1f,
                                               6.931471880262274e-1f,  1.0f};

/// 2^f of exp2_nonpositive in float: its polynomial, by Horner's rule.
template <class P>
P exp2_fraction(const P& f) {
    using namespace Eigen::internal;
    P e = pset1<P>(exp2_coefficients[0]);
    e = pmadd(e, f, pset1<P>(exp2_coefficients[1]));
    e = pmadd(e, f, pset1<P>(exp2_coefficients[2]));
    e = pmadd(e, f, pset1<P>(exp2_coefficients[3]));
    e = pmadd(e, f, pset1<P>(exp2_coefficients[4]));
    return pmadd(e, f, pset1<P>(exp2_coefficients[5]));
}

#if defined(MEMATTN_AVX512_CODE) || defined(MEMATTN_AVX512_BF16_CODE)
MEMATTN_AVX512_BEGIN

/// a·b of 16 floats as the build's packets round it, for code compiled by target: where
/// they have no FMA the build's own code cannot fuse the product with the add after it,
/// and this region's (which has FMA) must not either, whatever -ffp-contract says (an
/// empty asm the compiler cannot see through holds it; it emits nothing). These three
/// are always inlined: Clang does not inline a function of this region into one of the
/// AVX512-BF16 region, whose target differs, by itself, and a call per key would pass
/// its vectors through memory.
[[gnu::always_inline]] inline __m512 build_mul(__m512 a, __m512 b) noexcept {
    __m512 p = _mm512_mul_ps(a, b);
#if !defined(EIGEN_VECTORIZE_FMA)
    __asm__("" : "+v"(p));
#endif
    return p;
}

/// a·b + c of 16 floats as the build's Eigen packets compute pmadd: fused where they
/// fuse, else build_mul and an add, so never fused where they are not.
[[gnu::always_inline]] inline __m512 build_madd(__m512 a, __m512 b, __m512 c) noexcept {
#if defined(EIGEN_VECTORIZE_FMA)
    return _mm512_fmadd_ps(a, b, c);
#else
    return _mm512_add_ps(build_mul(a, b), c);
#endif
}

/// exp2_nonpositive of 16 floats in AVX-512, the bits of the exponent addition below in
/// fewer instructions (10 against 17; the online softmax's exp pass is most of a bfloat16
/// AMX call's vector work): the same n and f, the same polynomial (its multiply-adds as
/// the build's pmadd), then e·2^n by vscalefps, exact since every result from x ≥
/// exp2_lowest is a normal number, under the mask of the lanes x ≥ exp2_lowest or NaN
/// (the others 0), so x needs no clamp; NaN lanes every bit set, as there. Compiled by
/// target where the build lacks AVX-512 (detail/isa_regions.hpp): the packed softmax of
/// the bfloat16 products (detail/bf16_weights.hpp) runs it there, a native AVX-512 build
/// for every Packet16f.
[[gnu::always_inline]] inline __m512 exp2_nonpositive_avx512(__m512 x) noexcept {
    const __m512 round_bias = _mm512_set1_ps(12582912.0f);  // 1.5·2^23
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(x, round_bias), round_bias);  // round(x)
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 e = _mm512_set1_ps(exp2_coefficients[0]);
    e = build_madd(e, f, _mm512_set1_ps(exp2_coefficients[1]));
    e = build_madd(e, f, _mm512_set1_ps(exp2_coefficients[2]));
    e = build_madd(e, f, _mm512_set1_ps(exp2_coefficients[3]));
    e = build_madd(e, f, _mm512_set1_ps(exp2_coefficients[4]));
    e = build_madd(e, f, _mm512_set1_ps(exp2_coefficients[5]));
    const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(exp2_lowest<float>), _CMP_NLT_UQ);
    const __m512 power = _mm512_maskz_scalef_ps(kept, e, n);
    return _mm512_mask_mov_ps(power, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                              _mm512_castsi512_ps(_mm512_set1_epi32(-1)));
}

MEMATTN_AVX512_END
#endif

/// 2^x for x ≤ 0 or −∞: the only arguments the online softmax takes (a base-2 logit
/// minus the running maximum; see SoftmaxBlockState).
///   x < exp2_lowest (2^x ≤ 2.4e-38 in float, beside the maximum's weight 1): exactly 0,
///     so a logit of −∞ is a weight of exactly 0 and no weight has a floor;
///   x NaN, whatever its payload: NaN, so a NaN logit poisons its query.
/// x = n + f with n = round(x), |f| ≤ 1/2; 2^f is a polynomial and n is added into its
/// exponent bits, from x clamped at exp2_lowest so that the sum stays a normal number.
///   float: degree 5, the Chebyshev interpolant on [−1/2, 1/2] with its constant set to 1
///     so that 2^0 = 1 exactly (relative error 2.1e-7; with the rounding of the Horner
///     steps at most 3.1 ulps, measured over the whole range in the tests);
///   double: degree 11, the same construction (relative error 2e-17 before rounding; at
///     most 0.84 ulps with FMA, 1.13 without).
/// Every integer x gives 2^x exactly.
/// Rounding uses the 1.5·2^p trick (p the mantissa width): after adding it, the low
/// mantissa bits hold n (for a NaN they hold its payload, which the exponent addition
/// could turn into a finite number: hence the explicit NaN lanes at the end).
/// Why not Eigen's pexp: on Zen 1 one 256-bit multiply or FMA issues per cycle, and the
/// float path needs 5 of them per packet against about 10 for pexp (an extra scaling by
/// log2 e, a degree-6 polynomial, a general ldexp); Eigen's double pexp is a rational
/// function with a division, which took a quarter of the double kernel's time. Adding n
/// to a double's exponent needs 64-bit integer lanes, which Eigen 3.4 has no packet for:
/// add_exponent above uses the intrinsics of SSE2, AVX2 and AVX-512, and any other double
/// packet (AVX without AVX2, other architectures) takes Eigen's pldexp, with the same
/// values. Lone lanes use std::exp2.
template <class P>
P exp2_nonpositive(const P& x) {
    using namespace Eigen::internal;
    using T = typename unpacket_traits<P>::type;
    const T lowest = exp2_lowest<T>;
    if constexpr (std::is_same_v<P, T>) {
        return x < lowest ? T(0) : std::exp2(x);  // a NaN compares false and stays NaN
    } else {
        P power;
        if constexpr (std::is_same_v<T, float>) {
#if defined(EIGEN_VECTORIZE_AVX512) && defined(MEMATTN_AVX512_NATIVE)
            if constexpr (unpacket_traits<P>::size == 16)  // Packet16f
                return exp2_nonpositive_avx512(x);
#endif
            using IntPacket = typename unpacket_traits<P>::integer_packet;
            const P round_bias = pset1<P>(12582912.0f);  // 1.5·2^23
            const P t = pmax(x, pset1<P>(lowest));
            const P biased = padd(t, round_bias);        // low mantissa bits: n = round(t)
            const P f = psub(t, psub(biased, round_bias));
            const P e = exp2_fraction(f);
            // 2^t = 2^f · 2^n: add n to the exponent field (shifting out the bias's bits).
            const IntPacket n_exponent = plogical_shift_left<23>(preinterpret<IntPacket>(biased));
            power = preinterpret<P>(padd(preinterpret<IntPacket>(e), n_exponent));
        } else if constexpr (std::is_same_v<T, double>) {
            const P round_bias = pset1<P>(6755399441055744.0);  // 1.5·2^52
            const P t = pmax(x, pset1<P>(lowest));
            const P biased = padd(t, round_bias);               // low mantissa bits: n = round(t)
            const P f = psub(t, psub(biased, round_bias));
            P e = pset1<P>(4.4558179083360645e-10);             // 2^f ≈ Σ_k c_k f^k (Horner)
            e = pmadd(e, f, pset1<P>(7.074194297288521e-09));
            e = pmadd(e, f, pset1<P>(1.0178057087733941e-07));
            e = pmadd(e, f, pset1<P>(1.3215432535912375e-06));
            e = pmadd(e, f, pset1<P>(1.5252733841556773e-05));
            e = pmadd(e, f, pset1<P>(1.5403530463724353e-04));
            e = pmadd(e, f, pset1<P>(1.333355814640647e-03));
            e = pmadd(e, f, pset1<P>(9.618129107587256e-03));
            e = pmadd(e, f, pset1<P>(5.5504108664821625e-02));
            e = pmadd(e, f, pset1<P>(2.4022650695910158e-01));
            e = pmadd(e, f, pset1<P>(6.931471805599453e-01));
            e = pmadd(e, f, pset1<P>(1.0));                     // c_0 = 1: 2^0 is exact
            if constexpr (HasAddExponent<P>)
                power = add_exponent(e, biased);
            else
                power = pldexp(e, psub(biased, round_bias));  // Eigen's general ldexp: slower, same values
        } else {
            power = pexp(pmul(x, pset1<P>(T(0.693147180559945309417232121458))));
        }
        // 0 below 2^lowest, and every bit set (a NaN) where x is NaN.
        return por(pandnot(power, pcmp_lt(x, pset1<P>(lowest))), pcmp_lt_or_nan(x, x));
    }
}

/// e^x for x ≤ 0 as an Eigen functor with a packet path: exp2_nonpositive(x·log2 e), so
/// a −∞ is exactly 0, nothing has a floor (Eigen's exp clamps its argument at about −88
/// in float and gives ~3e-39 for −∞) and a NaN of any payload stays NaN.
template <class T>
struct ExpNonpositiveOp {
    static constexpr T log2e = T(1.44269504088896340735992468100);
    T operator()(const T& x) const { return exp2_nonpositive(x * log2e); }
    template <class P>
    P packetOp(const P& x) const {
        return exp2_nonpositive(Eigen::internal::pmul(x, Eigen::internal::pset1<P>(log2e)));
    }
};

/// s[j] ← e^(s[j] − m) over [0, n) (ExpNonpositiveOp): whole packets from s[0], then lone
/// lanes, so a weight's bits depend on its index and value, not on where s lies. (Not
/// Eigen's assignment: its packets start at an aligned address, and where n is known GCC
/// 12 warns at -O3 that its aligned stores may pass the end of a short buffer,
/// -Warray-bounds, in a user's -Werror build.)
template <class T>
void exp_shifted(T* s, Index n, T m) {
    using namespace Eigen::internal;
    using P = Packet<T>;
    constexpr Index lanes = packet_lanes<T>;
    const ExpNonpositiveOp<T> op;
    // The packets' end computed first: from `j + lanes <= n`, GCC 12 at -O2 could not
    // bound the lone lanes' loop and warned of an iteration past the end
    // (-Waggressive-loop-optimizations) for a buffer of known size.
    const Index whole = lanes > 1 ? n - n % lanes : 0;
    if constexpr (lanes > 1) {
        const P shift = pset1<P>(m);
        for (Index j = 0; j < whole; j += lanes)
            pstoreu(s + j, op.packetOp(psub(ploadu<P>(s + j), shift)));
    }
    for (Index j = whole; j < n; ++j)
        s[j] = op(s[j] - m);
}

/// Σ_j x[j] over [0, n): one packet of partial sums from x[0], then lone lanes (as
/// exp_shifted, bits independent of where x lies).
template <class T>
T sum_of(const T* x, Index n) {
    using namespace Eigen::internal;
    using P = Packet<T>;
    constexpr Index lanes = packet_lanes<T>;
    T total = T(0);
    const Index whole = lanes > 1 ? n - n % lanes : 0;  // as in exp_shifted
    if constexpr (lanes > 1) {
        if (whole > 0) {
            P sums = ploadu<P>(x);
            for (Index j = lanes; j < whole; j += lanes)
                sums = padd(sums, ploadu<P>(x + j));
            total = predux(sums);
        }
    }
    for (Index j = whole; j < n; ++j)
        total += x[j];
    return total;
}

/// max_j x[j] over [0, n), NaN when any x[j] is NaN and −∞ when n = 0: Eigen's
/// maxCoeff<PropagateNaN>, in one pass of packets and one horizontal step. (Eigen 3.4
/// reduces a PropagateNaN packet lane by lane through memory; at a block of 128 logits
/// that was 5% of a grouped decode step.)
template <class T>
T max_or_nan(const T* x, Index n) noexcept {
    using P = Packet<T>;
    constexpr Index lanes = packet_lanes<T>;
    T m = -std::numeric_limits<T>::infinity();
    Index j = 0;
    if constexpr (lanes > 1) {
        using namespace Eigen::internal;
        if (n >= lanes) {
            // The maximum and the lanes seen numbers (x = x) as two independent chains:
            // pmax<PropagateNaN> makes one chain of four dependent steps per packet.
            P mp = ploadu<P>(x), numbers = pcmp_eq(mp, mp);
            for (j = lanes; j + lanes <= n; j += lanes) {
                const P v = ploadu<P>(x + j);
                mp = pmax(mp, v);
                numbers = pand(numbers, pcmp_eq(v, v));
            }
            if (predux_any(pandnot(ptrue(numbers), numbers)))  // a NaN lane
                return std::numeric_limits<T>::quiet_NaN();
            m = predux_max(mp);
        }
    }
    for (; j < n; ++j) {
        if (std::isnan(x[j]))
            return x[j];
        m = x[j] > m ? x[j] : m;
    }
    return m;
}

// A SIMD type as the argument of a class template or concept drops its alignment
// attributes, which g++ and clang warn about (Eigen silences the same warning in its own
// headers); here only the packet's size and operations matter.
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif

/// Eigen transposes a block of `lanes` packets of P in registers (SSE, AVX and AVX-512
/// have it for float and double).
template <class P>
concept HasBlockTranspose = requires(Eigen::internal::PacketBlock<P, Eigen::internal::unpacket_traits<P>::size> b) {
    Eigen::internal::ptranspose(b);
};

/// dst(c, r) = src(r, c) for a rows × cols block (row strides src_stride, dst_stride):
/// squares of lanes × lanes transposed in registers, the edges one scalar at a time.
/// A copy, so every value keeps its bits. Eigen's assignment of a row-major transpose
/// moves one scalar at a time.
template <class T>
void transpose(const T* src, Index rows, Index cols, Index src_stride, T* dst, Index dst_stride) {
    using P = Packet<T>;
    constexpr Index lanes = packet_lanes<T>;
    Index r0 = 0;
    if constexpr (lanes > 1 && HasBlockTranspose<P>) {
        using namespace Eigen::internal;
        for (; r0 + lanes <= rows; r0 += lanes) {
            Index c0 = 0;
            for (; c0 + lanes <= cols; c0 += lanes) {
                PacketBlock<P, static_cast<int>(lanes)> block;
                for (Index i = 0; i < lanes; ++i)
                    block.packet[i] = ploadu<P>(src + (r0 + i) * src_stride + c0);
                ptranspose(block);
                for (Index i = 0; i < lanes; ++i)
                    pstoreu(dst + (c0 + i) * dst_stride + r0, block.packet[i]);
            }
            for (Index r = r0; r < r0 + lanes; ++r)
                for (Index c = c0; c < cols; ++c)
                    dst[c * dst_stride + r] = src[r * src_stride + c];
        }
    }
    for (Index r = r0; r < rows; ++r)
        for (Index c = 0; c < cols; ++c)
            dst[c * dst_stride + r] = src[r * src_stride + c];
}

#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

}  // namespace memattn::detail

// An Eigen specialisation for a detail type: not in the API reference.
/// \cond
template <class T>
struct Eigen::internal::functor_traits<memattn::detail::ExpNonpositiveOp<T>> {
    enum { Cost = 12 * NumTraits<T>::MulCost, PacketAccess = packet_traits<T>::Vectorizable };
};
/// \endcond
