#pragma once
// Eigen's SIMD packet of a scalar, for the hand-blocked loops of the kernels, and the
// one packet function the online softmax needs that Eigen's pexp makes slow. The same
// loops instantiated with the scalar itself as the "packet" handle leftover lanes,
// since Eigen's generic packet functions (pset1, pmadd, pexp, ...) accept scalars.

#include "memattn/types.hpp"

#include <Eigen/Core>

#include <type_traits>

namespace memattn::detail {

template <class T>
using Packet = typename Eigen::internal::packet_traits<T>::type;

/// Lanes in one SIMD packet of T (1 when Eigen does not vectorise T).
template <class T>
inline constexpr Index packet_lanes = Eigen::internal::unpacket_traits<Packet<T>>::size;

/// 2^x for x ≤ 0 or −∞: the only arguments the online softmax takes (a base-2 logit
/// minus the running maximum; see SoftmaxBlockState). For float packets, x = n + f with
/// n = round(x), |f| ≤ 1/2; 2^f is a degree-5 polynomial (the Chebyshev interpolant on
/// [−1/2, 1/2] with its constant set to 1 so that 2^0 = 1 exactly: relative error
/// 2.1e-7, under two ulps) and n is added into its exponent bits. x is clamped at −125 (2^x ≈ 2.4e-38, negligible beside the maximum's weight 1;
/// −∞ lands there too and the caller masks it), which keeps the result normal.
/// Rounding uses the 1.5·2^23 trick: after adding it, the low mantissa bits hold n.
/// A NaN argument gives NaN (for NaNs made by arithmetic, whose low payload bits are 0:
/// the exponent addition then leaves the polynomial's NaN as it is).
/// Why not Eigen's pexp: on Zen 1 one 256-bit multiply or FMA issues per cycle, and this
/// needs 5 of them per packet against about 10 for pexp (an extra scaling by log2 e, a
/// degree-6 polynomial, a general ldexp). Doubles and lone lanes use pexp(x·ln 2).
template <class P>
P exp2_nonpositive(const P& x) {
    using namespace Eigen::internal;
    using T = typename unpacket_traits<P>::type;
    if constexpr (std::is_same_v<T, float> && !std::is_same_v<P, float>) {
        using IntPacket = typename unpacket_traits<P>::integer_packet;
        const P round_bias = pset1<P>(12582912.0f);  // 1.5·2^23
        const P t = pmax(x, pset1<P>(-125.0f));
        const P biased = padd(t, round_bias);        // low mantissa bits: n = round(t)
        const P f = psub(t, psub(biased, round_bias));
        P e = pset1<P>(1.3390863364719507e-3f);      // 2^f ≈ Σ_k c_k f^k (Horner)
        e = pmadd(e, f, pset1<P>(9.676031918343615e-3f));
        e = pmadd(e, f, pset1<P>(5.550357114219621e-2f));
        e = pmadd(e, f, pset1<P>(2.4022107485307692e-1f));
        e = pmadd(e, f, pset1<P>(6.931471880262274e-1f));
        e = pmadd(e, f, pset1<P>(1.0f));                    // c_0 = 1: 2^0 is exact
        // 2^t = 2^f · 2^n: add n to the exponent field (shifting out the bias's bits).
        const IntPacket n_exponent = plogical_shift_left<23>(preinterpret<IntPacket>(biased));
        return preinterpret<P>(padd(preinterpret<IntPacket>(e), n_exponent));
    } else {
        return pexp(pmul(x, pset1<P>(T(0.693147180559945309417232121458))));
    }
}

}  // namespace memattn::detail
