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

/// exp(x) for x ≤ 0 or −∞: the only arguments the online softmax takes (a logit minus
/// the running maximum). For float packets, t = x·log2(e) = n + f with n = round(t),
/// |f| ≤ 1/2, so exp(x) = 2^n · e^u, u = f·ln 2, |u| ≤ 0.347; e^u is its Taylor
/// polynomial of degree 6 (truncation error |u|^7/7! < 1.2e-7, about one ulp) and 2^n
/// is written into the exponent bits. t is clamped at −126 (exp ≈ 1.2e-38, negligible
/// beside the maximum's weight 1; −∞ lands there too and the caller masks it), which
/// keeps 2^n a normal number. Rounding uses the 1.5·2^23 trick: adding it leaves
/// n + 127 in the low mantissa bits, already the biased exponent of 2^n.
/// About 15 packet operations, against some 30 for Eigen's full-range pexp (clamps and
/// a general ldexp); measured 1.7× faster per tile here. Doubles and lone lanes use
/// Eigen's pexp.
template <class P>
P exp_nonpositive(const P& x) {
    using namespace Eigen::internal;
    using T = typename unpacket_traits<P>::type;
    if constexpr (std::is_same_v<T, float> && !std::is_same_v<P, float>) {
        using IntPacket = typename unpacket_traits<P>::integer_packet;
        const P round_bias = pset1<P>(12582912.0f + 127.0f);                           // 1.5·2^23 + 127
        const P t = pmax(pmul(x, pset1<P>(1.44269504088896341f)), pset1<P>(-126.0f));  // x·log2(e)
        const P biased = padd(t, round_bias);  // mantissa bits: round(t) + 127
        const P n = psub(biased, round_bias);  // round(t), exactly
        const P u = pmul(psub(t, n), pset1<P>(0.693147180559945309f));  // (t − n)·ln 2
        P e = pset1<P>(1.0f / 720.0f);                                   // Σ_k u^k / k!, k ≤ 6 (Horner)
        e = pmadd(e, u, pset1<P>(1.0f / 120.0f));
        e = pmadd(e, u, pset1<P>(1.0f / 24.0f));
        e = pmadd(e, u, pset1<P>(1.0f / 6.0f));
        e = pmadd(e, u, pset1<P>(0.5f));
        e = pmadd(e, u, pset1<P>(1.0f));
        e = pmadd(e, u, pset1<P>(1.0f));
        const P two_to_n = preinterpret<P>(plogical_shift_left<23>(preinterpret<IntPacket>(biased)));
        return pmul(e, two_to_n);
    } else {
        return pexp(x);
    }
}

}  // namespace memattn::detail
