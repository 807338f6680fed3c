#pragma once
// The query and key conventions of the gated, delta-rule, KDA and RWKV-7 forms
// (flash-linear-attention's): q is multiplied by a scale (1/√d unless given), and with
// qk_l2norm q and k are first divided by √(Σx² + ε) (FLA's `use_qk_l2norm_in_kernel`,
// ε = 1e-6).
//
// Every output row of these forms is linear in its query row (o_t = q_t S_t, and the
// chunked forms' (Q ⊙ e^b) S_0 + A V with A's row t linear in q_t), so the kernels and
// the memories never copy Q: they compute with q as given and multiply the output row
// by the query's factor f_t = scale / √(Σq_t² + ε) (scale without qk_l2norm). Keys enter
// the state, so they are normalised before use (a chunk's worth at a time). The sums of
// squares run in one fixed order, so that a memory's decode step and a
// kernel's chunk compute the same factor, bit for bit (sum_of_squares: a fixed order of
// sixteen partial sums, not a chain left to right).

#include "memattn/detail/packet.hpp"
#include "memattn/types.hpp"

#include <cmath>
#include <optional>

namespace memattn::detail {

/// The scale of q: the given one, or 1/√d.
inline double resolved_scale(const std::optional<double>& scale, Index d) {
    return scale ? *scale : 1.0 / std::sqrt(static_cast<double>(d));
}

/// Σ x_i² in one fixed order whatever the packet width: sixteen partial sums, x_i² into
/// sum i mod 16 (a packet's multiply-add where a packet holds a whole part of the
/// sixteen, the rest one by one), then the sixteen added pairwise (sum j and j + 8, then
/// j + 4, j + 2, j + 1). Left to right, the sum was one chain of n dependent additions:
/// 500 cycles at n = 128, twice a head in each decode step of the recurrent memories
/// (8% of a delta-rule step over states in cache).
template <class T>
T sum_of_squares(const T* x, Index n) {
    using namespace Eigen::internal;
    constexpr Index ways = 16;
    using P = Packet<T>;
    constexpr Index lanes = packet_lanes<T>;
    constexpr Index packets = ways % lanes == 0 ? ways / lanes : 0;
    T part[ways] = {};
    Index i = 0;
    if constexpr (packets > 0) {
        P acc[packets];
        for (Index p = 0; p < packets; ++p)
            acc[p] = pset1<P>(T(0));
        for (; i + ways <= n; i += ways)
            for (Index p = 0; p < packets; ++p) {
                const P v = ploadu<P>(x + i + p * lanes);
                acc[p] = pmadd(v, v, acc[p]);
            }
        for (Index p = 0; p < packets; ++p)
            pstoreu(part + p * lanes, acc[p]);
    }
    for (; i < n; ++i)
        part[i % ways] += x[i] * x[i];
    for (Index half = ways / 2; half > 0; half /= 2)
        for (Index j = 0; j < half; ++j)
            part[j] += part[j + half];
    return part[0];
}

/// 1 / √(Σ x_i² + eps), the sum in sum_of_squares's order; 0 when the sum is 0 (a zero
/// row stays zero).
template <class T>
T l2norm_factor(const T* x, Index n, T eps) {
    const T sum = sum_of_squares(x, n) + eps;
    return sum > T(0) ? T(1) / std::sqrt(sum) : T(0);
}

/// The factor every output row is multiplied by for its query: scale, or scale / √(Σq² + ε).
template <class T>
struct QueryFactor {
    T scale = 1;          ///< the resolved scale
    bool l2norm = false;  ///< qk_l2norm
    T eps = 0;            ///< its ε

    /// f for the query row q (n wide, contiguous).
    T operator()(const T* q, Index n) const { return l2norm ? scale * l2norm_factor(q, n, eps) : scale; }
    /// Whether some query's factor can differ from 1.
    [[nodiscard]] bool active() const { return l2norm || scale != T(1); }
};

/// Each row of `rows` (contiguous rows) divided by √(Σx² + eps).
template <class T, class Rows>
void l2_normalise_rows(Rows&& rows, T eps) {
    for (Index t = 0; t < rows.rows(); ++t)
        rows.row(t) *= l2norm_factor<T>(rows.row(t).data(), rows.cols(), eps);
}

/// Rows of `o` multiplied by the factors of the matching rows of `q` (none when every
/// factor is 1).
template <class T, class QRows, class ORows>
void scale_by_queries(const QueryFactor<T>& f, const QRows& q, ORows&& o) {
    if (!f.active())
        return;
    for (Index t = 0; t < o.rows(); ++t)
        o.row(t) *= f(q.row(t).data(), q.cols());
}

/// Checks a scale, and the ε of qk_l2norm, for a call in T.
template <class T>
void check_query_key_options(const char* function, const std::optional<double>& scale, double l2norm_eps) {
    if (scale)
        require(finite_in<T>(*scale), function, "options.scale", "is ", *scale, ", expected a number finite as ",
                scalar_name<T>, " (unset: 1/sqrt(d))");
    require(l2norm_eps >= 0 && finite_in<T>(l2norm_eps), function, "options.l2norm_eps", "is ", l2norm_eps,
            ", expected a number >= 0 finite as ", scalar_name<T>);
}

}  // namespace memattn::detail
