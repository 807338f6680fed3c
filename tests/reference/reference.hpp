#pragma once
// Naive double-precision references of every formula in docs/design.md, written plainly,
// position by position, for the tests to check the library against. Nothing here is
// fast or clever on purpose: each function is the definition.

#include <memattn/types.hpp>  // first: it includes Eigen (see memattn/detail/eigen_core.hpp)

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <vector>

namespace memattn::reference {

using Index = Eigen::Index;
using MatrixD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using RowD = Eigen::Matrix<double, 1, Eigen::Dynamic>;

template <class D>
MatrixD to_double(const Eigen::MatrixBase<D>& m) {
    return m.template cast<double>();
}

// ---------------------------------------------------------------- causal softmax

/// Key j is visible to the query at position p: causal, and either among the first
/// `sinks` tokens or within the last `window` positions (window 0: no limit).
inline bool visible(Index j, Index p, Index window, Index sinks) {
    return j <= p && (j < sinks || window == 0 || j > p - window);
}

struct SoftmaxResult {
    MatrixD out;              ///< Nq x dv
    std::vector<double> lse;  ///< log Σ_j exp(scale q·k_j) per query (−∞ if nothing visible)
};

/// o_i = Σ_{j ∈ J_i} softmax_j(scale q_i·k_j) v_j with p_i = Nk − Nq + i (docs/design.md).
/// scale 0 means 1/sqrt(d).
inline SoftmaxResult softmax_attention(const MatrixD& Q, const MatrixD& K, const MatrixD& V, double scale = 0,
                                       Index window = 0, Index sinks = 0) {
    const Index nq = Q.rows(), nk = K.rows(), d = K.cols();
    if (scale == 0)
        scale = 1.0 / std::sqrt(static_cast<double>(std::max<Index>(d, 1)));
    SoftmaxResult r{MatrixD::Zero(nq, V.cols()), std::vector<double>(static_cast<std::size_t>(nq))};
    for (Index i = 0; i < nq; ++i) {
        const Index p = nk - nq + i;
        double m = -std::numeric_limits<double>::infinity();
        std::vector<double> s(static_cast<std::size_t>(nk));
        for (Index j = 0; j < nk; ++j) {
            double dot = 0;
            for (Index c = 0; c < d; ++c)
                dot += Q(i, c) * K(j, c);
            s[static_cast<std::size_t>(j)] = scale * dot;
            if (visible(j, p, window, sinks))
                m = std::max(m, s[static_cast<std::size_t>(j)]);
        }
        double sum = 0;
        for (Index j = 0; j < nk; ++j) {
            if (!visible(j, p, window, sinks))
                continue;
            const double w = std::exp(s[static_cast<std::size_t>(j)] - m);
            sum += w;
            r.out.row(i) += w * V.row(j);
        }
        if (sum > 0)
            r.out.row(i) /= sum;
        r.lse[static_cast<std::size_t>(i)] = sum > 0 ? m + std::log(sum) : -std::numeric_limits<double>::infinity();
    }
    return r;
}

/// The options of SoftmaxOptions beyond the window, for the reference below.
struct Logits {
    double scale = 0;
    Index window = 0, sink_tokens = 0;
    double softcap = 0;               ///< s ← c·tanh(s/c)
    bool causal = true;
    std::optional<double> slope = {};   ///< ALiBi: s ← s − slope·|p − j|
    std::optional<double> sink = {};    ///< σ joins the denominator with no value
    std::optional<Index> offset = {};   ///< query i at position offset + i (default Nk − Nq)
    const MatrixD* bias = nullptr;      ///< Nq × Nk added after ALiBi; −∞ masks the key
};

/// The dense mask a tree of new tokens stands for: the last n = parents.size() of nk
/// keys are the new tokens; new token i sees every earlier key and its ancestors.
inline MatrixD tree_bias(const std::vector<Index>& parents, Index nk) {
    const Index n = static_cast<Index>(parents.size()), past = nk - n;
    MatrixD bias = MatrixD::Zero(n, nk);
    for (Index i = 0; i < n; ++i)
        for (Index j = 0; j < n; ++j) {
            bool ancestor = false;
            for (Index a = i; a >= 0; a = parents[static_cast<std::size_t>(a)])
                ancestor = ancestor || a == j;
            if (!ancestor)
                bias(i, past + j) = -std::numeric_limits<double>::infinity();
        }
    return bias;
}

/// The materialised scores of docs/design.md §4.1 with every option: s_ij = scale·q·k,
/// softcap, ALiBi, the visibility rule (causal or both ways), then the softmax with the
/// sink logit in the denominator. lse includes the sink.
inline SoftmaxResult softmax_attention(const MatrixD& Q, const MatrixD& K, const MatrixD& V, const Logits& o) {
    const Index nq = Q.rows(), nk = K.rows(), d = K.cols();
    const double scale = o.scale != 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(std::max<Index>(d, 1)));
    const Index offset = o.offset.value_or(nk - nq);
    SoftmaxResult r{MatrixD::Zero(nq, V.cols()), std::vector<double>(static_cast<std::size_t>(nq))};
    for (Index i = 0; i < nq; ++i) {
        const Index p = offset + i;
        std::vector<double> s;
        std::vector<Index> keys;
        for (Index j = 0; j < nk; ++j) {
            const Index distance = p >= j ? p - j : j - p;
            const bool seen = (!o.causal || j <= p) && (j < o.sink_tokens || o.window == 0 || distance < o.window);
            if (!seen)
                continue;
            double x = scale * Q.row(i).dot(K.row(j));
            if (o.softcap > 0)
                x = o.softcap * std::tanh(x / o.softcap);
            if (o.slope)
                x -= *o.slope * static_cast<double>(distance);
            if (o.bias != nullptr) {
                if ((*o.bias)(i, j) == -std::numeric_limits<double>::infinity())
                    continue;
                x += (*o.bias)(i, j);
            }
            s.push_back(x);
            keys.push_back(j);
        }
        double m = o.sink ? *o.sink : -std::numeric_limits<double>::infinity();
        for (const double x : s)
            m = std::max(m, x);
        double sum = o.sink ? std::exp(*o.sink - m) : 0;
        for (std::size_t t = 0; t < s.size(); ++t) {
            const double w = std::exp(s[t] - m);
            sum += w;
            r.out.row(i) += w * V.row(keys[t]);
        }
        if (sum > 0)
            r.out.row(i) /= sum;
        r.lse[static_cast<std::size_t>(i)] = sum > 0 ? m + std::log(sum) : -std::numeric_limits<double>::infinity();
    }
    return r;
}

/// Speculative decoding's verify step as what it stands for: new token i (of the last
/// n = parents.size() keys) decoded at the end of its own path, the earlier keys then its
/// ancestors root first and itself at positions past, past + 1, ..., past + depth_i, with
/// the logit options of `o` (its offset and bias unused). One row of output per new token.
inline MatrixD tree_path_attention(const MatrixD& Q, const MatrixD& K, const MatrixD& V,
                                   const std::vector<Index>& parents, Logits o) {
    const Index n = static_cast<Index>(parents.size()), past = K.rows() - n;
    o.offset = {};
    o.bias = nullptr;
    MatrixD out(n, V.cols());
    for (Index i = 0; i < n; ++i) {
        std::vector<Index> path;
        for (Index a = i; a >= 0; a = parents[static_cast<std::size_t>(a)])
            path.insert(path.begin(), a);
        const Index rows = past + static_cast<Index>(path.size());
        MatrixD Kp(rows, K.cols()), Vp(rows, V.cols());
        Kp.topRows(past) = K.topRows(past);
        Vp.topRows(past) = V.topRows(past);
        for (std::size_t k = 0; k < path.size(); ++k) {
            Kp.row(past + static_cast<Index>(k)) = K.row(past + path[k]);
            Vp.row(past + static_cast<Index>(k)) = V.row(past + path[k]);
        }
        out.row(i) = softmax_attention(Q.row(i), Kp, Vp, o).out;
    }
    return out;
}

// ---------------------------------------------------------------- linear attention

struct LinearResult {
    MatrixD out;  ///< N x dv
    MatrixD mu;   ///< d' x dv, final state
    RowD nu;      ///< 1 x d', final state
};

/// Linear attention on features (Qf = φ(Q), Kf = φ(K)), in the "pairs" form written
/// out position by position, with the initial state (mu0, nu0) (zero when empty):
///   μ_i = γ^{i+1} μ0 + Σ_{j≤i} γ^{i−j} k'_jᵀ v_j,   ν_i = γ^{i+1} ν0 + Σ_{j≤i} γ^{i−j} k'_j
///   o_i = q'_i μ_i / (q'_i · ν_i + eps)  (normalize)   or   q'_i μ_i.
inline LinearResult linear_attention(const MatrixD& Qf, const MatrixD& Kf, const MatrixD& V, double decay = 1,
                                     double eps = 1e-6, bool normalize = true, const MatrixD& mu0 = MatrixD(),
                                     const RowD& nu0 = RowD()) {
    const Index n = Qf.rows(), f = Kf.cols(), dv = V.cols();
    const MatrixD m0 = mu0.size() ? mu0 : MatrixD::Zero(f, dv);
    const RowD n0 = nu0.size() ? nu0 : RowD::Zero(f);
    LinearResult r{MatrixD::Zero(n, dv), m0, n0};
    for (Index i = 0; i < n; ++i) {
        RowD num = std::pow(decay, static_cast<double>(i + 1)) * (Qf.row(i) * m0);
        double den = std::pow(decay, static_cast<double>(i + 1)) * Qf.row(i).dot(n0);
        for (Index j = 0; j <= i; ++j) {
            const double w = std::pow(decay, static_cast<double>(i - j)) * Qf.row(i).dot(Kf.row(j));
            num += w * V.row(j);
            den += w;
        }
        r.out.row(i) = normalize ? RowD(num / (den + eps)) : num;
    }
    r.mu = std::pow(decay, static_cast<double>(n)) * m0;
    r.nu = std::pow(decay, static_cast<double>(n)) * n0;
    for (Index j = 0; j < n; ++j) {
        const double g = std::pow(decay, static_cast<double>(n - 1 - j));
        r.mu += g * Kf.row(j).transpose() * V.row(j);
        r.nu += g * Kf.row(j);
    }
    return r;
}

// ---------------------------------------------------------------- moving averages

/// Row i: the mean of rows max(0, i−window+1)..i of X (window 0: rows 0..i).
inline MatrixD moving_average(const MatrixD& X, Index window) {
    MatrixD r(X.rows(), X.cols());
    for (Index i = 0; i < X.rows(); ++i) {
        const Index first = window == 0 ? 0 : std::max<Index>(0, i - window + 1);
        RowD sum = RowD::Zero(X.cols());
        for (Index j = first; j <= i; ++j)
            sum += X.row(j);
        r.row(i) = sum / static_cast<double>(i - first + 1);
    }
    return r;
}

/// Row i: s_i = alpha·x_i + (1 − alpha)·s_{i−1}, s_0 = x_0.
inline MatrixD exponential_average(const MatrixD& X, double alpha) {
    MatrixD r(X.rows(), X.cols());
    for (Index i = 0; i < X.rows(); ++i)
        r.row(i) = i == 0 ? RowD(X.row(0)) : RowD(alpha * X.row(i) + (1 - alpha) * r.row(i - 1));
    return r;
}

// ---------------------------------------------------------------- hybrid cache

/// A compressor in the reference: the rows of one slot (oldest first, 1..rate of them)
/// to one row.
using Pool = std::function<RowD(const MatrixD& rows)>;

inline RowD mean_pool(const MatrixD& rows) { return rows.colwise().mean(); }
/// The element-wise maximum; a NaN anywhere in a column makes that column NaN.
inline RowD max_pool(const MatrixD& rows) {
    RowD r = rows.row(0);
    for (Index p = 1; p < rows.rows(); ++p)
        for (Index c = 0; c < rows.cols(); ++c)
            r(c) = std::isnan(r(c)) || std::isnan(rows(p, c)) ? std::numeric_limits<double>::quiet_NaN()
                                                              : std::max(r(c), rows(p, c));
    return r;
}
/// Σ_p w_p · row_p over the positions present in the slot.
inline Pool weighted_pool(std::vector<double> weights) {
    return [weights = std::move(weights)](const MatrixD& rows) {
        RowD r = RowD::Zero(rows.cols());
        for (Index p = 0; p < rows.rows(); ++p)
            r += weights[static_cast<std::size_t>(p)] * rows.row(p);
        return r;
    };
}

/// Decoding with a hybrid memory, row i of the result being the output after token i:
/// after t tokens the local window holds tokens [E, t), E = max(0, t − window); the
/// evicted tokens [0, E) form slots of `rate` consecutive tokens (the last one may be
/// open), of which the newest `slots` are kept, each pooled into one (key, value);
/// the output is one softmax over the kept slots and the local tokens.
inline MatrixD hybrid(const MatrixD& Q, const MatrixD& K, const MatrixD& V, Index window, Index rate, Index slots,
                      double scale, const Pool& pool) {
    const Index n = K.rows();
    if (scale == 0)
        scale = 1.0 / std::sqrt(static_cast<double>(std::max<Index>(K.cols(), 1)));
    MatrixD out(n, V.cols());
    for (Index t = 1; t <= n; ++t) {
        const Index evicted = std::max<Index>(0, t - window);
        const Index total_slots = (evicted + rate - 1) / rate;
        const Index first_slot = std::max<Index>(0, total_slots - slots);
        std::vector<RowD> keys, values;
        for (Index s = first_slot; s < total_slots; ++s) {
            const Index b = s * rate, e = std::min((s + 1) * rate, evicted);
            keys.push_back(pool(K.middleRows(b, e - b)));
            values.push_back(pool(V.middleRows(b, e - b)));
        }
        for (Index j = evicted; j < t; ++j) {
            keys.push_back(K.row(j));
            values.push_back(V.row(j));
        }
        double m = -std::numeric_limits<double>::infinity();
        std::vector<double> s(keys.size());
        for (std::size_t j = 0; j < keys.size(); ++j) {
            s[j] = scale * Q.row(t - 1).dot(keys[j]);
            m = std::max(m, s[j]);
        }
        RowD o = RowD::Zero(V.cols());
        double sum = 0;
        for (std::size_t j = 0; j < keys.size(); ++j) {
            const double w = std::exp(s[j] - m);
            sum += w;
            o += w * values[j];
        }
        out.row(t - 1) = o / sum;
    }
    return out;
}

// ---------------------------------------------------------------- latent attention

/// Multi-head latent attention unabsorbed (DeepSeek-V2 §2.1): head h's keys
/// [C W_UK_hᵀ | KR] and values C W_UV_hᵀ expanded, its queries [q_nope | q_rope] of the
/// n tokens (head h of token t in row t·H + h), token t at position Nk − n + t under the
/// causal rule (logits.causal; else every row seen); W_UK is (H·d_nope) × r and W_UV
/// (H·d_v) × r, head after head. Returns (n·H) × d_v, rows as the queries'.
inline MatrixD mla_unabsorbed(Index heads, const MatrixD& q_nope, const MatrixD& q_rope, const MatrixD& C,
                              const MatrixD& KR, const MatrixD& W_UK, const MatrixD& W_UV, const Logits& logits) {
    const Index n = q_nope.rows() / heads, nope = q_nope.cols(), dr = q_rope.cols(), dv = W_UV.rows() / heads;
    MatrixD out(n * heads, dv);
    for (Index h = 0; h < heads; ++h) {
        MatrixD K(C.rows(), nope + dr), Q(n, nope + dr);
        K.leftCols(nope) = C * W_UK.middleRows(h * nope, nope).transpose();
        K.rightCols(dr) = KR;
        for (Index t = 0; t < n; ++t)
            Q.row(t) << q_nope.row(t * heads + h), q_rope.row(t * heads + h);
        const MatrixD V = C * W_UV.middleRows(h * dv, dv).transpose();
        const MatrixD O = softmax_attention(Q, K, V, logits).out;
        for (Index t = 0; t < n; ++t)
            out.row(t * heads + h) = O.row(t);
    }
    return out;
}

}  // namespace memattn::reference
