#pragma once
// Online softmax: a partial softmax-weighted sum over a subset of keys, for one query.
//
//   max = max_j s_j,   sum = Σ_j exp(s_j − max),   acc = Σ_j exp(s_j − max) · v_j
//   o   = acc / sum,   log-sum-exp = max + log(sum)
//
// Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; Dao et al.
// 2022, "FlashAttention". Partial states over disjoint key sets merge exactly, which
// is what lets the tiled kernel, KVCache and the windowed caches share one mechanism.
// The state keeps (max, sum) only; the accumulator `acc` is owned by the caller (often
// the output row itself), so attending allocates nothing.

#include "memattn/detail/assert.hpp"
#include "memattn/detail/packet.hpp"
#include "memattn/detail/tile_product.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <type_traits>

namespace memattn {

/// The online softmax state (max, sum) of one query over the keys seen so far; the
/// accumulator `acc` is the caller's.
template <class T>
struct SoftmaxState {
    static constexpr T minus_inf = -std::numeric_limits<T>::infinity();  ///< −∞: a masked logit, the empty max

    T max = minus_inf;  ///< running maximum logit m
    T sum = T(0);       ///< running Σ exp(s_j − m)

    /// True while no key has been seen (acc must then be zero). A NaN sum (a NaN logit
    /// or value was seen) is not empty: it poisons the output instead of hiding as zero.
    [[nodiscard]] bool empty() const noexcept { return sum == T(0); }

    /// Folds logits s[0, n) into the state. On return s[j] holds the weight
    /// p_j = exp(s_j − m_new); the result is the factor α = exp(m_old − m_new) by which
    /// the caller scales its accumulator before adding Σ_j p_j v_j:
    ///   m_new = max(m_old, max_j s_j),  sum = α·sum + Σ_j p_j,  acc = α·acc + Σ_j p_j v_j.
    /// A logit of −∞ is a masked key (weight 0). If every logit seen so far is −∞ the
    /// state stays empty and α = 1, so nothing becomes NaN. `round(weights)`, given, maps
    /// the weights (an Eigen array of n) in place before they are summed, so the sum is of
    /// the weights the caller multiplies by (FpMath::bf16 rounds them to bfloat16).
    template <class Round = std::identity>
    T absorb(T* s, Index n, Round round = {}) {
        Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>> a(s, n);
        // A NaN logit makes the maximum NaN, so it poisons the state even when every
        // other logit is −∞ (std::max and plain maxCoeff may drop it).
        const T block_max = detail::max_or_nan(s, n);
        const T new_max = std::isnan(block_max) ? block_max : std::max(max, block_max);
        if (new_max == minus_inf) {
            std::fill_n(s, n, T(0));
            if constexpr (!std::is_same_v<Round, std::identity>)
                round(a);  // the caller's copy of the weights too
            return T(1);
        }
        detail::exp_shifted(s, n, new_max);  // −∞ → 0, no floor, NaN stays
        if constexpr (!std::is_same_v<Round, std::identity>)
            round(a);
        const T alpha = std::exp(max - new_max);  // exp(−∞) = 0 on the first block
        sum = alpha * sum + detail::sum_of(s, n);
        max = new_max;
        return alpha;
    }

    /// Merges `other` (with its accumulator) into this state and `acc`:
    ///   m = max(m_a, m_b),  acc = e^{m_a−m}·acc_a + e^{m_b−m}·acc_b,  sum likewise.
    template <class Acc, class OtherAcc>
    void merge(const SoftmaxState& other, Acc&& acc, const OtherAcc& other_acc) {
        if (other.empty())
            return;
        if (empty()) {
            *this = other;
            acc = other_acc;
            return;
        }
        const T new_max = std::max(max, other.max);
        const T a = std::exp(max - new_max);
        const T b = std::exp(other.max - new_max);
        acc = a * acc + b * other_acc;
        sum = a * sum + b * other.sum;
        max = new_max;
    }

    /// Adds a key of logit `sigma` and value zero (a learned sink logit, as gpt-oss's):
    /// the denominator gains e^σ, acc is rescaled to the new maximum. σ = −∞ adds nothing.
    template <class Acc>
    void add_sink(T sigma, Acc&& acc) {
        if (sigma == minus_inf)
            return;
        if (empty()) {  // acc is zero: the output stays zero, the log-sum-exp becomes σ
            max = sigma;
            sum = T(1);
            return;
        }
        const T new_max = std::isnan(max) ? max : std::max(max, sigma);
        const T a = std::exp(max - new_max);
        acc *= a;
        sum = a * sum + std::exp(sigma - new_max);
        max = new_max;
    }

    /// acc ← acc / sum, the softmax-weighted mean; zero when no key was visible.
    template <class Acc>
    void finish(Acc&& acc) const {
        if (empty())
            acc.setZero();
        else
            acc *= T(1) / sum;
    }

    /// log Σ_j exp(s_j); −∞ for an empty state.
    [[nodiscard]] T log_sum_exp() const { return empty() ? minus_inf : max + std::log(sum); }
};

/// The same online softmax for a block of queries at once, one lane per query, stored
/// as arrays (max, sum) so a whole tile is updated with SIMD packets across queries.
/// It works in base 2: the logits it is given are s·log2(e) (the tiled kernel folds the
/// factor into its query scale), and p = 2^(s₂ − m₂) = exp(s − m), which saves a multiply
/// per weight. Lane i is exactly the SoftmaxState `state(i)` (max converted back to
/// natural units), so finishing a row, its log-sum-exp and merging with other partial
/// states go through the one scalar mechanism above.
/// Used by the tiled kernel (kernels/causal_softmax.hpp), which allocates its lanes once,
/// and by the grouped attend below, whose lanes (at most MaxLanes) live on the stack.
template <class T, int MaxLanes = Eigen::Dynamic>
class SoftmaxBlockState {
public:
    /// `lanes` queries, every lane empty (at most MaxLanes when it is fixed).
    explicit SoftmaxBlockState(Index lanes) : lanes_(3, lanes) { reset(); }

    /// The number of queries (lanes).
    [[nodiscard]] Index lanes() const noexcept { return lanes_.cols(); }

    /// Every lane empty: max = −∞, sum = 0.
    void reset() {
        lanes_.row(max_row).setConstant(SoftmaxState<T>::minus_inf);
        lanes_.row(sum_row).setZero();
    }

    /// Folds a key-major tile of base-2 logits into lanes [0, n): s[j·ld + i] is
    /// log2(e)·s_ji for key j and query i, j < keys. On return it holds the weight
    /// p = 2^(s₂ − m₂) = exp(s − m_new) (exactly 0 for a masked logit of −∞), and alpha() the
    /// factor α = exp(m_old − m_new) by which the caller scales lane i of its accumulator
    /// before adding Σ_j p_ji v_j:
    ///   m_new = max(m_old, max_j s_j),  sum = α·sum + Σ_j p_j,  acc = α·acc + Σ_j p_j v_j.
    /// A lane that has seen only −∞ stays empty with α = 0 (its accumulator is zero). A NaN
    /// logit, whatever its payload, makes its weight and so its lane's sum NaN.
    /// `round` maps each weight (a packet or a scalar) before it is stored and summed: the
    /// weights a caller multiplies in a narrower type (bfloat16) then sum to the
    /// denominator exactly as they are used, so the output stays a convex combination.
    template <class Round = std::identity>
    void absorb(T* s, Index keys, Index ld, Index n, Round round = {}) {
        absorb_tile<false>(s, keys, ld, n, T(1), round);
    }

    /// absorb() of the logits f·s (f > 0) where the tile holds s: the same m, sum, α and
    /// weights, bit for bit, as absorb() after the tile was multiplied by f (each f·s
    /// rounded as that product), without that pass over the tile. The maximum of the
    /// rounded f·s_j is f times the maximum of the s_j, rounded (rounding is monotone and
    /// f·x increasing), and a −∞ or NaN of s stays one.
    template <class Round = std::identity>
    void absorb_scaled(T* s, Index keys, Index ld, Index n, T factor, Round round = {}) {
        MEMATTN_DASSERT(factor > T(0));
        absorb_tile<true>(s, keys, ld, n, factor, round);
    }

    /// α per lane from the last absorb.
    [[nodiscard]] const T* alpha() const noexcept { return &lanes_(alpha_row, 0); }

    /// The lanes' running state as three rows of lanes() values (lane_rows()).
    struct LaneRows {
        T* max;    ///< the running maximum of each lane's logits, base 2
        T* sum;    ///< the running sum of each lane's weights
        T* alpha;  ///< each lane's α from the last absorb
    };

    /// The lanes' running state, for an absorb written elsewhere with the same arithmetic
    /// (detail/bf16_weights.hpp: absorb_packed, which compiles by target where this
    /// header's packets are narrower).
    [[nodiscard]] LaneRows lane_rows() noexcept {
        return {&lanes_(max_row, 0), &lanes_(sum_row, 0), &lanes_(alpha_row, 0)};
    }

    /// Lane i as a scalar state (natural logarithms: max = m₂ · ln 2).
    [[nodiscard]] SoftmaxState<T> state(Index i) const {
        return {lanes_(max_row, i) * T(0.693147180559945309417232121458), lanes_(sum_row, i)};
    }

private:
    static constexpr Index max_row = 0, sum_row = 1, alpha_row = 2;

    template <bool Scaled, class Round>
    void absorb_tile(T* s, Index keys, Index ld, Index n, T factor, const Round& round) {
        MEMATTN_DASSERT(n <= lanes() && ld >= n);
        constexpr Index width = detail::packet_lanes<T>;
        Index i = 0;
        for (; i + width <= n; i += width)
            absorb_lanes<detail::Packet<T>, Scaled>(s + i, keys, ld, i, factor, round);
        for (; i < n; ++i)
            absorb_lanes<T, Scaled>(s + i, keys, ld, i, factor, round);
    }

    /// absorb() for the lanes of one packet P starting at lane `first` (Scaled: of the
    /// logits factor·s).
    template <class P, bool Scaled, class Round>
    void absorb_lanes(T* s, Index keys, Index ld, Index first, T factor, const Round& round) {
        using namespace Eigen::internal;
        const P minus_inf = pset1<P>(SoftmaxState<T>::minus_inf);
        const P f = pset1<P>(factor);
        T* max = &lanes_(max_row, first);
        T* sum = &lanes_(sum_row, first);
        const P m_old = ploadu<P>(max);
        // m₂ = max(m_old, max_j s_j), in four chains: one chain waits a max's latency per
        // key (a tenth of a bfloat16 call in AMX tiles). The same maximum in any order:
        // pmax keeps its first argument when either is NaN, so a NaN logit is dropped
        // and a NaN m_old kept in every chain; only the sign of a zero maximum may differ,
        // and a shift by +0 or −0 gives the same weights, α and sums.
        // Scaled: the chains start from −∞ on the tile's s, then f times their maximum
        // joins m_old (pmax(m_old, ·): a NaN m_old kept as before).
        const P start = Scaled ? minus_inf : m_old;
        P m0 = start, m1 = start, m2 = start, m3 = start;
        Index j = 0;
        for (; j + 4 <= keys; j += 4) {
            m0 = pmax(m0, ploadu<P>(s + j * ld));
            m1 = pmax(m1, ploadu<P>(s + (j + 1) * ld));
            m2 = pmax(m2, ploadu<P>(s + (j + 2) * ld));
            m3 = pmax(m3, ploadu<P>(s + (j + 3) * ld));
        }
        for (; j < keys; ++j)
            m0 = pmax(m0, ploadu<P>(s + j * ld));
        const P m_tile = pmax(pmax(m0, m1), pmax(m2, m3));
        const P m_new = Scaled ? pmax(m_old, pmul(f, m_tile)) : m_tile;
        // Subtract 0 instead of −∞ in lanes that saw nothing, so no −∞ − (−∞) = NaN.
        const P shift = pselect(pcmp_eq(m_new, minus_inf), pset1<P>(T(0)), m_new);
        // α = 2^(m_old − m_new); exactly 0 on a lane's first keys (m_old = −∞).
        const P alpha = detail::exp2_nonpositive(psub(m_old, shift));
        P block_sum = pset1<P>(T(0));
        for (Index j = 0; j < keys; ++j) {
            // p = 2^(s₂ − m₂): exactly 0 for a masked logit (−∞) or one too small to matter,
            // NaN for a NaN logit (pmax above may have dropped it from the maximum).
            P logit = ploadu<P>(s + j * ld);
            if constexpr (Scaled)
                logit = pmul(f, logit);
            const P weight = round(detail::exp2_nonpositive(psub(logit, shift)));
            pstoreu(s + j * ld, weight);
            block_sum = padd(block_sum, weight);
        }
        pstoreu(max, m_new);
        pstoreu(sum, pmadd(alpha, ploadu<P>(sum), block_sum));  // sum = α·sum + Σ_j p_j
        pstoreu(&lanes_(alpha_row, first), alpha);
    }

    Eigen::Array<T, 3, Eigen::Dynamic, Eigen::RowMajor, 3, MaxLanes> lanes_;  // rows: max, sum, α
};

namespace detail {

/// 1/sqrt(d) when `scale` is 0 (the convention of docs/design.md), else `scale`.
template <class T>
T resolve_scale(T scale, Index d) {
    return scale == T(0) ? T(1) / std::sqrt(static_cast<T>(std::max<Index>(d, 1))) : scale;
}

/// Merges a block's normalised outputs (of keys the running ones did not see) and log-sum-exps into the running ones, row by
/// row: o = (e^{l−m} o + e^{l_b−m} o_b) / (e^{l−m} + e^{l_b−m}), l = m + log(…), m = max.
template <class T, class O, class OB>
void merge_rows(O& out, T* lse, const OB& block, const T* block_lse) {
    for (Index i = 0; i < out.rows(); ++i) {
        const T lb = block_lse[i];
        if (lb == -std::numeric_limits<T>::infinity())
            continue;  // the block held no key this query sees
        if (lse[i] == -std::numeric_limits<T>::infinity()) {
            out.row(i) = block.row(i);
            lse[i] = lb;
            continue;
        }
        const T m = std::max(lse[i], lb);
        const T a = std::exp(lse[i] - m), b = std::exp(lb - m);
        const T sum = a + b;
        out.row(i) = (a / sum) * out.row(i) + (b / sum) * block.row(i);
        lse[i] = m + std::log(sum);
    }
}

}  // namespace detail
}  // namespace memattn
