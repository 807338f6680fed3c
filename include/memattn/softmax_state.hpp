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
#include <limits>

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
    /// state stays empty and α = 1, so nothing becomes NaN.
    T absorb(T* s, Index n) {
        Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>> a(s, n);
        // PropagateNaN: a NaN logit makes the maximum NaN, so it poisons the state even
        // when every other logit is −∞ (std::max and plain maxCoeff may drop it).
        const T block_max = n > 0 ? a.template maxCoeff<Eigen::PropagateNaN>() : minus_inf;
        const T new_max = std::isnan(block_max) ? block_max : std::max(max, block_max);
        if (new_max == minus_inf) {
            a.setZero();
            return T(1);
        }
        a = (a - new_max).unaryExpr(detail::ExpNonpositiveOp<T>{});  // −∞ → 0, no floor, NaN stays
        const T alpha = std::exp(max - new_max);  // exp(−∞) = 0 on the first block
        sum = alpha * sum + a.sum();
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
    void absorb(T* s, Index keys, Index ld, Index n) {
        MEMATTN_DASSERT(n <= lanes() && ld >= n);
        constexpr Index width = detail::packet_lanes<T>;
        Index i = 0;
        for (; i + width <= n; i += width)
            absorb_lanes<detail::Packet<T>>(s + i, keys, ld, i);
        for (; i < n; ++i)
            absorb_lanes<T>(s + i, keys, ld, i);
    }

    /// α per lane from the last absorb.
    [[nodiscard]] const T* alpha() const noexcept { return &lanes_(alpha_row, 0); }

    /// Lane i as a scalar state (natural logarithms: max = m₂ · ln 2).
    [[nodiscard]] SoftmaxState<T> state(Index i) const {
        return {lanes_(max_row, i) * T(0.693147180559945309417232121458), lanes_(sum_row, i)};
    }

private:
    static constexpr Index max_row = 0, sum_row = 1, alpha_row = 2;

    /// absorb() for the lanes of one packet P starting at lane `first`.
    template <class P>
    void absorb_lanes(T* s, Index keys, Index ld, Index first) {
        using namespace Eigen::internal;
        const P minus_inf = pset1<P>(SoftmaxState<T>::minus_inf);
        T* max = &lanes_(max_row, first);
        T* sum = &lanes_(sum_row, first);
        const P m_old = ploadu<P>(max);
        P m_new = m_old;
        for (Index j = 0; j < keys; ++j)
            m_new = pmax(m_new, ploadu<P>(s + j * ld));  // m₂ = max(m_old, max_j s_j)
        // Subtract 0 instead of −∞ in lanes that saw nothing, so no −∞ − (−∞) = NaN.
        const P shift = pselect(pcmp_eq(m_new, minus_inf), pset1<P>(T(0)), m_new);
        // α = 2^(m_old − m_new); exactly 0 on a lane's first keys (m_old = −∞).
        const P alpha = detail::exp2_nonpositive(psub(m_old, shift));
        P block_sum = pset1<P>(T(0));
        for (Index j = 0; j < keys; ++j) {
            // p = 2^(s₂ − m₂): exactly 0 for a masked logit (−∞) or one too small to matter,
            // NaN for a NaN logit (pmax above may have dropped it from the maximum).
            const P weight = detail::exp2_nonpositive(psub(ploadu<P>(s + j * ld), shift));
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

/// Keys per block of the single-query attend while its run of K and V stays in cache:
/// their logits live on the stack (256 floats = 1 KiB).
inline constexpr Index attend_block = 256;

/// Bytes of K and V from which a single-query attend takes the streaming path. Below,
/// Eigen's GEMVs (8 key rows side by side) are faster; above, the run comes from DRAM,
/// and reading it in address order is what keeps the prefetchers ahead. Measured with
/// bench/memory_bench.cpp (BM_KVCacheAttend against BM_StreamingRead, AMD EPYC Zen 3,
/// AVX2, float, d = dv): at 4 MiB the GEMV blocks read 39–49 GB/s against 35–38 for the
/// streaming path; at 32 and 64 MiB (65536 pairs, d = 64 and 128) the streaming path,
/// with its prefetch, reads 0.75–0.87 of a plain read of the same bytes (0.84–0.96 when
/// the two run alone, interleaved), the GEMV blocks 0.58–0.75.
inline constexpr std::size_t streaming_bytes = std::size_t(16) << 20;

/// Rows of `cols` scalars the streaming path asks for ahead of the row it reads: 4 KiB
/// ahead (measured at 65536 pairs, of a plain read: 4 KiB 0.84–0.96, 2 KiB 0.78–0.85,
/// 8 KiB 0.78–0.91, 16 KiB 0.76–0.87, none 0.63–0.8).
template <class T>
constexpr Index rows_ahead(Index cols) {
    return std::max<Index>(1, Index(4096) / (std::max<Index>(cols, 1) * Index(sizeof(T))));
}

/// q·k over d scalars, read in address order: four packet accumulators, then the tail.
template <class T>
inline T dot_in_order(const T* q, const T* k, Index d) {
    using namespace Eigen::internal;
    using P = Packet<T>;
    constexpr Index lanes = packet_lanes<T>;
    P a0 = pset1<P>(T(0)), a1 = a0, a2 = a0, a3 = a0;
    Index c = 0;
    for (; c + 4 * lanes <= d; c += 4 * lanes) {
        a0 = pmadd(ploadu<P>(q + c), ploadu<P>(k + c), a0);
        a1 = pmadd(ploadu<P>(q + c + lanes), ploadu<P>(k + c + lanes), a1);
        a2 = pmadd(ploadu<P>(q + c + 2 * lanes), ploadu<P>(k + c + 2 * lanes), a2);
        a3 = pmadd(ploadu<P>(q + c + 3 * lanes), ploadu<P>(k + c + 3 * lanes), a3);
    }
    for (; c + lanes <= d; c += lanes)
        a0 = pmadd(ploadu<P>(q + c), ploadu<P>(k + c), a0);
    T dot = predux(padd(padd(a0, a1), padd(a2, a3)));
    for (; c < d; ++c)
        dot += q[c] * k[c];
    return dot;
}

/// acc (dv) = α·acc + Σ_j p_j v_j over n rows v_j = v + j·v_stride, one row after the
/// other in address order (acc stays in L1), rows_ahead rows asked for ahead.
template <class T>
inline void add_values_in_order(const T* p, const T* v, Index v_stride, Index n, Index dv, T alpha, T* acc) {
    using namespace Eigen::internal;
    using P = Packet<T>;
    constexpr Index lanes = packet_lanes<T>;
    const Index packed = dv / lanes * lanes;
    for (Index c = 0; c < packed; c += lanes)
        pstoreu(acc + c, pmul(pset1<P>(alpha), ploadu<P>(acc + c)));
    for (Index c = packed; c < dv; ++c)
        acc[c] *= alpha;
    const Index ahead = rows_ahead<T>(dv);
    for (Index j = 0; j < n; ++j) {
        if (j + ahead < n)
            prefetch_rows(v + (j + ahead) * v_stride, 1, 0, dv);
        const P weight = pset1<P>(p[j]);
        const T* row = v + j * v_stride;
        for (Index c = 0; c < packed; c += lanes)
            pstoreu(acc + c, pmadd(weight, ploadu<P>(row + c), ploadu<P>(acc + c)));
        for (Index c = packed; c < dv; ++c)
            acc[c] += p[j] * row[c];
    }
}

/// One query against contiguous keys K (n×d) and values V (n×dv): folds
/// s_j = scale · q·k_j into `state` and `acc` (1×dv) block by block, each block's K rows
/// then its V rows, by Eigen's GEMVs while the run fits in cache and in address order
/// once it does not (streaming_bytes).
template <class T, class Q, class KBlock, class VBlock, class Acc>
void attend_contiguous(const Q& q, const KBlock& K, const VBlock& V, T scale, SoftmaxState<T>& state, Acc&& acc) {
    MEMATTN_DASSERT(K.rows() == V.rows() && K.cols() == q.cols() && V.cols() == acc.cols());
    alignas(64) T buffer[attend_block];
    const Index d = K.cols(), dv = V.cols();
    const auto bytes = static_cast<std::size_t>(K.rows() * (d + dv)) * sizeof(T);
    if (bytes < streaming_bytes) {
        for (Index j0 = 0; j0 < K.rows(); j0 += attend_block) {
            const Index n = std::min(attend_block, K.rows() - j0);
            Eigen::Map<Vector<T>> s(buffer, n);
            s.noalias() = scale * (q * K.middleRows(j0, n).transpose());
            const T alpha = state.absorb(buffer, n);
            if (alpha != T(1))
                acc *= alpha;
            acc.noalias() += s * V.middleRows(j0, n);
        }
        return;
    }
    MEMATTN_DASSERT(q.innerStride() == 1 && acc.innerStride() == 1);
    for (Index j0 = 0; j0 < K.rows(); j0 += attend_block) {
        const Index n = std::min(attend_block, K.rows() - j0);
        const T* keys = K.data() + j0 * K.outerStride();
        const Index ahead = rows_ahead<T>(d);
        for (Index j = 0; j < n; ++j) {
            if (j + ahead < n)
                prefetch_rows(keys + (j + ahead) * K.outerStride(), 1, 0, d);
            buffer[j] = scale * dot_in_order(q.data(), keys + j * K.outerStride(), d);
        }
        const T alpha = state.absorb(buffer, n);
        add_values_in_order(buffer, V.data() + j0 * V.outerStride(), V.outerStride(), n, dv, alpha, acc.data());
    }
}

/// Grouped attend: at most `group_rows` queries and `group_keys` keys per step.
inline constexpr Index group_rows = 16;
inline constexpr Index group_keys = 128;

/// g ≤ group_rows queries against runs of keys and values, each read once for the whole
/// group (what grouped-query attention saves), per block of ≤ 128 keys, with all scratch
/// on the stack. The logits take one of two routes, by measurement (bench/multi_head_bench.cpp,
/// BM_Decode, and g queries against 4096 keys at d = 128):
/// - g ≥ a packet's lanes and d ≤ max_depth, the tiled kernel's: Sᵀ = K_b · (log2(e)·scale·Q_g)ᵀ
///   (keys × lanes, register-blocked) and the online softmax in base 2 across the lanes
///   (SoftmaxBlockState); at g = 16 twice as fast as the other route;
/// - fewer queries: S = scale · Q_g K_bᵀ as dot products vectorised along the head dim and
///   one SoftmaxState per query, since a key-major product would fill only g of a
///   packet's lanes (g = 4: 1.6× faster than the tiled route with AVX2).
/// Then acc = α ⊙ acc + P · V_b, one register-blocked product with α fused into its load.
/// One query goes through attend_contiguous, which is exactly `attend`.
template <class T>
class GroupAttention {
public:
    static constexpr Index max_depth = 256;

    template <class QB>
    GroupAttention(const QB& queries, T scale)
        : queries_(queries), scale_(scale), g_(queries.rows()), lanes_(round_up(g_, packet_lanes<T>)),
          tiled_(g_ >= packet_lanes<T> && queries.cols() <= max_depth), block_(tiled_ ? lanes_ : 1) {
        MEMATTN_DASSERT(g_ <= group_rows && lanes_ <= group_rows);
        if (!tiled_)
            return;
        const Index d = queries.cols();
        const T factor = scale * T(1.44269504088896340735992468100);  // base-2 logits
        for (Index k = 0; k < d; ++k) {
            for (Index r = 0; r < g_; ++r)
                qt_[k * lanes_ + r] = factor * queries(r, k);
            for (Index r = g_; r < lanes_; ++r)
                qt_[k * lanes_ + r] = T(0);
        }
    }

    /// Folds keys K (n×d) and values V (n×dv), contiguous rows of any stride, into the
    /// states and the rows of `acc` (g×dv, zero before the first fold).
    template <class KBlock, class VBlock, class Acc>
    void fold(const KBlock& K, const VBlock& V, Acc&& acc) {
        MEMATTN_DASSERT(K.rows() == V.rows() && K.cols() == queries_.cols() && V.cols() == acc.cols() &&
                        acc.rows() == g_);
        if (g_ == 1) {
            attend_contiguous(queries_.row(0), K, V, scale_, states_[0], acc.row(0));
            return;
        }
        const Index d = K.cols(), dv = V.cols();
        for (Index j0 = 0; j0 < K.rows(); j0 += group_keys) {
            const Index n = std::min(group_keys, K.rows() - j0);
            const T* alpha = alpha_;
            if (tiled_) {  // Sᵀ, keys × lanes, then P read from it with strides (1, lanes)
                tile_product<T>(n, lanes_, d, K.data() + j0 * K.outerStride(), K.outerStride(), 1, qt_, lanes_, s_,
                                lanes_, nullptr);
                block_.absorb(s_, n, lanes_, lanes_);
                alpha = block_.alpha();
            } else {  // S, g × keys, then P read from it with strides (group_keys, 1)
                Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>> s(s_, g_, n, Eigen::OuterStride<>(group_keys));
                s.noalias() = (scale_ * queries_).lazyProduct(K.middleRows(j0, n).transpose());
                for (Index r = 0; r < g_; ++r)
                    alpha_[r] = states_[r].absorb(s_ + r * group_keys, n);
            }
            tile_product<T>(g_, dv, n, s_, tiled_ ? 1 : group_keys, tiled_ ? lanes_ : 1,
                            V.data() + j0 * V.outerStride(), V.outerStride(), acc.data(), acc.outerStride(), alpha);
        }
    }

    /// Query r's state (natural logarithms), to finish or merge its accumulator row.
    [[nodiscard]] SoftmaxState<T> state(Index r) const { return tiled_ ? block_.state(r) : states_[r]; }

private:
    static constexpr Index round_up(Index n, Index m) { return (n + m - 1) / m * m; }

    ConstMatrixRef<T> queries_;
    T scale_;
    Index g_, lanes_;
    bool tiled_;
    SoftmaxBlockState<T, static_cast<int>(group_rows)> block_;  // tiled route
    SoftmaxState<T> states_[group_rows];                        // the other routes
    T alpha_[group_rows];
    alignas(64) T qt_[max_depth * group_rows];  // log2(e)·scale·Q_gᵀ, tiled route
    alignas(64) T s_[group_rows * group_keys];  // logits, then weights
};

/// out (g×dv) = softmax attention of each row of `queries` (g×d) over the pairs a memory
/// reads, given as `for_each_run(f)` calling f(keys, values) for each contiguous run in
/// order; rows with no visible pair get zero. Allocates nothing.
template <class T, class ForEachRun>
void attend_group_runs(const ConstMatrixRef<T>& queries, MatrixRef<T>& out, T scale, const ForEachRun& for_each_run) {
    for (Index r0 = 0; r0 < queries.rows(); r0 += group_rows) {
        const Index g = std::min(group_rows, queries.rows() - r0);
        auto acc = out.middleRows(r0, g);
        acc.setZero();
        GroupAttention<T> group(queries.middleRows(r0, g), scale);
        for_each_run([&](const auto& keys, const auto& values) { group.fold(keys, values, acc); });
        for (Index r = 0; r < g; ++r)
            group.state(r).finish(acc.row(r));
    }
}

/// 1/sqrt(d) when `scale` is 0 (the convention of docs/design.md), else `scale`.
template <class T>
T resolve_scale(T scale, Index d) {
    return scale == T(0) ? T(1) / std::sqrt(static_cast<T>(std::max<Index>(d, 1))) : scale;
}

}  // namespace detail
}  // namespace memattn
