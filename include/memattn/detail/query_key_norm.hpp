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
// squares run left to right in one fixed order, so that a memory's decode step and a
// kernel's chunk compute the same factor, bit for bit.

#include "memattn/types.hpp"

#include <cmath>
#include <optional>

namespace memattn::detail {

/// The scale of q: the given one, or 1/√d.
inline double resolved_scale(const std::optional<double>& scale, Index d) {
    return scale ? *scale : 1.0 / std::sqrt(static_cast<double>(d));
}

/// 1 / √(Σ x_i² + eps), the sum left to right; 0 when the sum is 0 (a zero row stays zero).
template <class T>
T l2norm_factor(const T* x, Index n, T eps) {
    T sum = 0;
    for (Index i = 0; i < n; ++i)
        sum += x[i] * x[i];
    sum += eps;
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
