#pragma once
// Causal linear attention, in three forms that agree to rounding.
//
//   Q, K: N×d   V, O: N×dv   q'_i = φ(q_i), k'_j = φ(k_j): 1×d'   γ = decay ∈ (0, 1]
//   state  μ: d'×dv,  ν: 1×d'
//     μ_i = γ μ_{i−1} + k'_iᵀ v_i,    ν_i = γ ν_{i−1} + k'_i
//     o_i = q'_i μ_i / (q'_i·ν_i + eps)     (normalize)     or     o_i = q'_i μ_i
//
// Katharopoulos et al. 2020, "Transformers are RNNs" (the recurrence); the decay and the
// chunked form follow RetNet (Sun et al. 2023) and Lightning Attention-2 (Qin et al. 2024).
//
// - quadratic_linear_attention: "pairs", o_i = Σ_{j≤i} γ^{i−j} (q'_i·k'_j) v_j (+ state),
//   O(N²) by tiles; the definition, for checking and for short sequences.
// - recurrent_linear_attention: "summary", μ/ν token by token; O(N·d'·dv).
// - chunked_linear_attention: pairs inside each chunk of C tokens, the state across
//   chunks, then the chunk is folded into the state with one GEMM. Same O(N·d'·dv) as
//   the recurrence plus O(N·C·(d'+dv)), but as matrix products instead of rank-1 updates.
//
// φ is applied one chunk of rows at a time into O(C·d') scratch (never O(N·d')), by the
// one routine all three forms share. Every form allocates its scratch once per call.
//
// Chunk size: LinearOptions::chunk_size = 16 by default (the first design draft said 64), chosen
// by bench/linear_attention_bench.cpp (BM_ChunkSize): float, elu+1, normalised,
// N = 65536, one thread of an AMD EPYC Zen 3 core with AVX2 + FMA (FMA peak 94–97
// GFLOP/s), the per-chunk products through the register-blocked tile product:
//
//   chunk          8     16     24     32     48     64    128
//   d = dv = 64  1422   1704   1713   1629   1614   1480   1233   thousand tokens/s
//   d = dv = 128  533    701    633    585    606    528    428
//
// Per token the chunked form does 4·d'·dv FLOPs of state products whatever the chunk,
// plus 2·C·(d'+dv) for the pairs inside the chunk: at C = 64 that second term equals
// the first (d = 64), at C = 16 it is a fifth. At C = 16 the form runs at 0.37 (d = 64)
// and 0.47–0.54 (d = 128) of the FMA peak counting both terms, and faster than one
// Eigen GEMM doing the same FLOPs (1.7–2.0M against 1.9M tokens/s at d = 64, 0.60–0.70M
// against 0.51M at d = 128); 0.1's Eigen products ran 1.16M and 0.42M on the same core.
// Below 16 the per-chunk overhead wins.
//
// With AVX-512 (Intel Xeon, family 6 model 207, FMA peak 175 GFLOP/s on one core,
// BM_ChunkSize, medians of 3, before the register transpose of k'ᵀ and the prefetch):
//
//   chunk          8     16     24     32     48     64    128
//   d = dv = 64  1730   2884   1801   2573   2452   2340   1843   thousand tokens/s
//   d = dv = 128  608    915    723    922    907    879    725
//
// 16 stays the default. Counting 4·d'·dv + 2·C·(d'+dv) FLOPs per token, the form then
// ran at 0.36 (d = 64) and 0.44 (d = 128) of the peak at N = 65536, where Q, K, V and O
// (32–128 MiB) come from beyond the cache, against 0.47 at N = 4096.
//
// Since then the next chunk's rows are prefetched a few lines per strip of the chunk's
// products (PrefetchQueue: one burst per chunk stalled on the line-fill buffers about as
// long as the misses it replaced), GEMM 1 computes only the packets on and below the
// diagonal and GEMM 2 only the terms s ≤ t of A (LowerColumns, LowerTerms), and the fold
// uses FoldBlocking. Same machine, N = 65536, medians of 5, interleaved (FMA peak 177):
//
//   d = dv = 64   3.62M tokens/s, 74 GFLOP/s: 0.42 of the peak, 0.79× one Eigen GEMM
//   d = dv = 128  1.36M tokens/s, 101 GFLOP/s: 0.57 of the peak, 0.99× one Eigen GEMM
//
//   BM_ChunkSize  8      16     24     32     48     64     128
//   d = dv = 64   2060   4004   2477   3583   3398   3141   2540   thousand tokens/s
//   d = dv = 128  751    1263   1002   1207   1165   1132   966
//
// (C = 24 is not a whole number of 16-float packets.) What is left at d = 64: φ (elu+1,
// an exp per feature) and the copies of V_c and k'.

#include "memattn/detail/assert.hpp"
#include "memattn/detail/float_spans.hpp"
#include "memattn/detail/tile_product.hpp"
#include "memattn/execution/executor.hpp"
#include "memattn/feature_maps.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace memattn {

/// Options of linear attention: the kernels and LinearAttentionMemory (the gated kernels
/// take GatedOptions).
struct LinearOptions {
    Index chunk_size = 16;  ///< tokens per chunk (chunked form), per φ application (recurrent form)
    double eps = 1e-6;      ///< added to the normaliser q'·ν
    double decay = 1;       ///< γ ∈ (0, 1]: the state is multiplied by γ before each token
    bool normalize = true;  ///< divide by q'·ν + eps
    /// Chunked form: cut the sequence every span_tokens tokens (rounded up to whole
    /// chunks) and run the spans on the executor's threads (detail::linear_spans); 0:
    /// one span. The outputs depend on it and on the length, never on the threads.
    Index span_tokens = 0;
};

/// The running state of linear attention. Empty (both of size 0) means zero; a
/// kernel given a state starts from it and leaves the final state in it, so a long
/// sequence can be processed in pieces, saved and resumed.
template <class T>
struct LinearState {
    Matrix<T> mu;  ///< d'×dv: Σ_j γ^{i−j} k'_jᵀ v_j
    Vector<T> nu;  ///< 1×d':  Σ_j γ^{i−j} k'_j
};

namespace detail {

template <class T>
using ColumnVector = Eigen::Matrix<T, Eigen::Dynamic, 1>;

/// Validates every argument before anything is written; returns d'.
template <class T, class Phi>
Index check_linear_arguments(const char* function, const Phi& phi, Shape q, Shape k, Shape v, Shape o,
                             const LinearOptions& options, const LinearState<T>* state) {
    require(options.chunk_size > 0, function, "options.chunk_size", "is ", options.chunk_size, ", expected > 0");
    require(options.eps >= 0 && finite_in<T>(options.eps), function, "options.eps", "is ", options.eps,
            ", expected a number >= 0 finite as ", scalar_name<T>);
    require(options.decay > 0 && options.decay <= 1 && static_cast<T>(options.decay) > 0, function, "options.decay",
            "is ", options.decay, ", expected a value in (0, 1] that is not 0 as ", scalar_name<T>);
    require(options.span_tokens >= 0 && options.span_tokens <= max_length, function, "options.span_tokens", "is ",
            options.span_tokens, ", expected 0 (one span) .. 2^62");
    require(k.rows == q.rows && k.cols == q.cols, function, "K", "has shape ", k, ", expected the shape of Q (", q,
            ")");
    require(v.rows == q.rows, function, "V", "has shape ", v, ", expected ", q.rows, " rows as Q (", q, ")");
    require(o.rows == q.rows && o.cols == v.cols, function, "O", "has shape ", o, ", expected ", q.rows, 'x', v.cols,
            " (Q is ", q, ", V is ", v, ")");
    const auto features = static_cast<Index>(phi.output_dim(q.cols));
    require(features > 0, function, "phi", "has output_dim(", q.cols, ") = ", features, ", expected > 0");
    if (state != nullptr && (state->mu.size() != 0 || state->nu.size() != 0)) {
        require(state->mu.rows() == features && state->mu.cols() == v.cols, function, "state->mu", "has shape ",
                shape(state->mu), ", expected ", features, 'x', v.cols, " (feature dim phi.output_dim(", q.cols,
                ") x value dim)");
        require(state->nu.cols() == features, function, "state->nu", "has shape ", shape(state->nu),
                ", expected 1x", features, " (feature dim phi.output_dim(", q.cols, "))");
    }
    return features;
}

/// Where the cut of a sequence into spans is not the caller's to make (a layer spreads
/// its heads, MPI its ranks, a memory prefills its own state as one span), a non-zero
/// options.span_tokens is refused rather than ignored.
inline void require_one_span(const char* function, Index span_tokens, const char* why) {
    require(span_tokens == 0, function, "options.span_tokens", "is ", span_tokens, ", expected 0: ", why);
}

/// The in/out state is an output too: O must not share memory with it (the final state
/// would be written over outputs, or outputs over the state being read).
template <class T, class Out>
void require_state_disjoint(const char* function, const MatrixRef<Out>& o, const LinearState<T>* state) {
    if (state == nullptr)
        return;
    require_disjoint(function, "O", o, "state->mu", state->mu);
    require_disjoint(function, "O", o, "state->nu", state->nu);
}

/// An input of a recurrent call and its name, for the aliasing rule (require_apart).
template <class View>
struct Named {
    const char* name;
    const View& view;
};
template <class View>
Named(const char*, const View&) -> Named<View>;

/// The aliasing rule of a call with an in/out state (docs/design.md §3): O shares no
/// element with an input or with the state, and no input shares one with the state,
/// which the call writes while it still reads them (a Q viewing state->mu would be read
/// after a chunk had changed it). Inputs may overlap each other.
template <class T, class Out, class... Views>
void require_apart(const char* function, const MatrixRef<Out>& o, const LinearState<T>* state,
                   const Named<Views>&... inputs) {
    (require_disjoint(function, "O", o, inputs.name, inputs.view), ...);
    if (state == nullptr)
        return;
    require_state_disjoint(function, o, state);
    ((require_disjoint(function, "state->mu", state->mu, inputs.name, inputs.view),
      require_disjoint(function, "state->nu", state->nu, inputs.name, inputs.view)),
     ...);
}

/// The one feature-map application of every form: Y = φ(X) for a chunk of rows.
template <class T, class Phi, class X, class Y>
void apply_features(const Phi& phi, const X& x, Y& y) {
    MEMATTN_DASSERT(x.rows() == y.rows());
    phi(ConstMatrixRef<T>(x), MatrixRef<T>(y));
}

/// Values of γ^e computed in double, then cast; anything below T's smallest normal
/// becomes 0, so no denormal slows the products. Every exponent used is ≥ 0, so a γ
/// near 0 or a long chunk gives 0 where the true weight is negligible, never 0·∞.
template <class T>
T decay_power(double decay, Index exponent) {
    const double p = decay == 1 ? 1.0 : std::pow(decay, static_cast<double>(exponent));
    return p < static_cast<double>(std::numeric_limits<T>::min()) ? T(0) : static_cast<T>(p);
}

/// γ^k for k = 0..n.
template <class T>
ColumnVector<T> decay_powers(double decay, Index n) {
    ColumnVector<T> p(n + 1);
    for (Index k = 0; k <= n; ++k)
        p(k) = decay_power<T>(decay, k);
    return p;
}

/// The causal decay mask of a c×c tile whose first query is `offset` ≥ 0 positions
/// after its first key, laid out so that each row is one contiguous segment:
///   mask(m) = γ^(offset + c − 1 − m) if that exponent is ≥ 0, else 0 (m < 2c − 1),
///   S(i, j) *= mask(c − 1 − i + j) = γ^(offset + i − j) · [offset + i ≥ j].
template <class T>
void decay_mask(double decay, Index offset, Index c, Vector<T>& mask) {
    mask.resize(2 * c - 1);  // no-op after the first call
    for (Index m = 0; m < 2 * c - 1; ++m) {
        const Index exponent = offset + c - 1 - m;
        mask(m) = exponent >= 0 ? decay_power<T>(decay, exponent) : T(0);
    }
}

template <class T, class Tile>
void apply_mask(Tile& s, const Vector<T>& mask, Index c) {
    for (Index i = 0; i < s.rows(); ++i)
        s.row(i).array() *= mask.segment(c - 1 - i, s.cols()).array();
}

/// The pairs of one chunk (square, n ≤ c rows): A_ij γ^{i−j} on and below the diagonal
/// (the decay skipped when there is none), 0 above it: set, not multiplied, so that the
/// entries above, which GEMM 1's band does not compute, never hold what was there before.
template <class T, class Tile>
void apply_causal_mask(Tile& a, const Vector<T>& mask, Index c, bool decays) {
    const Index n = a.rows();
    for (Index i = 0; i < n; ++i) {
        if (decays)
            a.row(i).head(i + 1).array() *= mask.segment(c - 1 - i, i + 1).array();
        a.row(i).tail(n - 1 - i).setZero();
    }
}

/// Starts `ahead` over on rows [first, first + rows) of K, Q and V (read) and O (written):
/// a chunked form's next chunk, asked for a few lines per strip of the current one's
/// products. Nothing when rows ≤ 0 (the last chunk).
/// Σ_r q_tr k_sr e^{b_tr − b_sr} for one pair s ≤ t of a chunk with channel gates (gated
/// linear attention's A_ts, KDA's L_ts and A_ts; every exponent ≤ 0): packets across the
/// channels, the exponential of detail/packet.hpp.
template <class T>
T channel_pair(const T* q, const T* k, const T* bt, const T* bs, Index d) {
    using namespace Eigen::internal;
    using P = Packet<T>;
    constexpr Index lanes = packet_lanes<T>;
    const ExpNonpositiveOp<T> exp;
    P acc = pset1<P>(T(0));
    Index r = 0;
    for (; r + lanes <= d; r += lanes)
        acc = pmadd(pmul(ploadu<P>(q + r), ploadu<P>(k + r)), exp.packetOp(psub(ploadu<P>(bt + r), ploadu<P>(bs + r))),
                    acc);
    T sum = predux(acc);
    for (; r < d; ++r)
        sum += q[r] * k[r] * exp(bt[r] - bs[r]);
    return sum;
}

/// Two pair terms of a chunk sharing their exponentials: Σ_r x1_r y1_r e^{bt_r − bs_r} into
/// `first` and Σ_r x2_r y2_r e^{bt_r − bs_r} into `second` (every exponent ≤ 0; KDA's L_ts
/// and A_ts, RWKV-7's M_ab and M_ak, P_qb and P_qk).
template <class T>
void channel_pairs(const T* x1, const T* y1, const T* x2, const T* y2, const T* bt, const T* bs, Index d, T& first,
                   T& second) {
    using namespace Eigen::internal;
    using P = Packet<T>;
    constexpr Index lanes = packet_lanes<T>;
    const ExpNonpositiveOp<T> exp;
    P f = pset1<P>(T(0)), g = f;
    Index r = 0;
    for (; r + lanes <= d; r += lanes) {
        const P e = exp.packetOp(psub(ploadu<P>(bt + r), ploadu<P>(bs + r)));
        f = pmadd(pmul(ploadu<P>(x1 + r), ploadu<P>(y1 + r)), e, f);
        g = pmadd(pmul(ploadu<P>(x2 + r), ploadu<P>(y2 + r)), e, g);
    }
    first = predux(f);
    second = predux(g);
    for (; r < d; ++r) {
        const T e = exp(bt[r] - bs[r]);
        first += x1[r] * y1[r] * e;
        second += x2[r] * y2[r] * e;
    }
}

/// The tokens of the chunk of at most `c` from row t0 of the log-gates G: up to the next
/// row after t0 that holds a −∞ (a reset: the gated kernels start a chunk at each one,
/// so no e^{b_t − b_s} meets −∞ − (−∞)).
template <class T>
Index chunk_before_reset(const ConstMatrixRef<T>& G, Index t0, Index c) {
    constexpr T minus_infinity = -std::numeric_limits<T>::infinity();
    for (Index t = t0 + 1; t < t0 + c; ++t)
        for (Index j = 0; j < G.cols(); ++j)
            if (G(t, j) == minus_infinity)
                return t - t0;
    return c;
}

template <class T>
void queue_next_chunk(PrefetchQueue& ahead, Index first, Index rows, const ConstMatrixRef<T>& Q,
                      const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V, const MatrixRef<T>& O) {
    ahead.clear();
    if (rows <= 0)
        return;
    ahead.add(K.data() + first * K.outerStride(), rows, K.outerStride(), K.cols());
    ahead.add(Q.data() + first * Q.outerStride(), rows, Q.outerStride(), Q.cols());
    ahead.add(V.data() + first * V.outerStride(), rows, V.outerStride(), V.cols());
    ahead.add<T, true>(O.data() + first * O.outerStride(), rows, O.outerStride(), O.cols());
}

/// Folds n tokens (features kf: n×d', values v: n×dv) into a state (μ, ν) with one GEMM:
///   μ ← γⁿ μ + Σ_j γ^{n−1−j} k'_jᵀ v_j,     ν ← γⁿ ν + Σ_j γ^{n−1−j} k'_j.
/// `powers` holds γ^k for k = 0..≥n; kf is scaled in place when γ < 1.
template <class T, class KF, class VB, class MU, class NU>
void fold_views(KF& kf, const VB& v, const ColumnVector<T>& powers, bool decays, MU& mu, NU& nu,
                PrefetchQueue* ahead = nullptr) {
    const Index n = kf.rows();
    if (decays) {
        kf.array().colwise() *= powers.head(n).reverse().array();  // row j × γ^{n−1−j}
        mu *= powers(n);
        nu *= powers(n);
    }
    // μ += k'ᵀ V: A(r, j) = k'(j, r) is read with strides (1, row stride of k').
    MEMATTN_DASSERT(mu.rows() == kf.cols() && mu.cols() == v.cols() && v.rows() == n);
    tile_product_add<T, FoldBlocking>(mu.rows(), mu.cols(), n, kf.data(), 1, kf.outerStride(), v.data(),
                                      v.outerStride(), mu.data(), mu.outerStride(), ahead);
    nu += kf.colwise().sum();
}

template <class T, class KF, class VB>
void fold_chunk(KF& kf, const VB& v, const ColumnVector<T>& powers, bool decays, LinearState<T>& s) {
    fold_views(kf, v, powers, decays, s.mu, s.nu);
}

/// o ← o / (den + eps), row by row.
template <class T, class OB>
void normalize_rows(OB& o, ColumnVector<T>& den, Index n, T eps) {
    auto inv = den.head(n).array();
    inv = T(1) / (inv + eps);
    o.array().colwise() *= inv;
}

/// The value columns of a chunked recurrent form split over an executor's threads. In
/// the delta rule and KDA every column of the state S (d × dv) evolves under the same
/// per-token keys, β and gates, independently of the other columns; so do the columns
/// of V, U (the delta corrections) and O. Each thread runs the whole sequence on its
/// columns, recomputing the chunks' pairs and triangles (the work that depends on Q and
/// K only), with no synchronisation until the end. Every element of every product is the
/// same sum in the same order whatever the columns around it (detail/tile_product.hpp)
/// and the elementwise steps act column by column, so the outputs and the state are
/// bitwise those of one thread, for any thread count. Parts are whole multiples of 64
/// columns: narrower ones lose the tile product's register blocking (4 packets of 16
/// floats), and the recomputed pairs then cost more than the split saves (measured:
/// docs/performance.md); the split is used from `min_rows` rows on, with more than one
/// thread.
struct ValueColumns {
    static constexpr Index granule = 64;     ///< columns per unit of the split
    static constexpr Index min_rows = 1024;  ///< shorter sequences stay on the calling thread

    /// Parts for dv columns and n rows on `executor` (1: no split).
    static Index parts(Index n, Index dv, ExecutorRef executor) {
        if (n < min_rows)
            return 1;
        return std::max<Index>(1, std::min<Index>(executor.concurrency(), dv / granule));
    }
    /// Part p's first column of dv split into `parts` (whole granules, the last takes the rest).
    static Index first(Index p, Index parts, Index dv) {
        return p == parts ? dv : (dv / granule) * p / parts * granule;
    }
};

/// run(V_cols, O_cols, S_cols) for each part of the value columns (ValueColumns) on the
/// executor: V_cols and O_cols the part's columns of V and O, S_cols a copy of the part's
/// columns of S, gathered into S once every part has run (an executor that throws leaves
/// S as it was). One part: run(V, O, S) here.
template <class T, class Run>
void by_value_columns(const ConstMatrixRef<T>& V, MatrixRef<T> O, Matrix<T>& S, ExecutorRef executor, Run&& run) {
    const Index dv = V.cols(), parts = ValueColumns::parts(V.rows(), dv, executor);
    if (parts <= 1) {
        run(V, O, S);
        return;
    }
    Matrix<T> next(S.rows(), S.cols());
    run_ranges(executor, parts, [&](Index first, Index last) {
        for (Index p = first; p < last; ++p) {
            const Index c0 = ValueColumns::first(p, parts, dv), w = ValueColumns::first(p + 1, parts, dv) - c0;
            Matrix<T> part = S.middleCols(c0, w);
            run(ConstMatrixRef<T>(V.middleCols(c0, w)), MatrixRef<T>(O.middleCols(c0, w)), part);
            next.middleCols(c0, w) = part;
        }
    });
    S.swap(next);
}

/// The cut of one sequence into spans for the span-parallel chunked forms (linear_spans,
/// gated_spans): spans of `span_tokens` rounded up to whole chunks (none: one span), and
/// the later spans' rows in blocks of 256 for their correction. A function of the length
/// and the options only, never of the threads.
class SpanPlan {
public:
    static constexpr Index block_rows = 256;  ///< rows of a correction block
    /// One block of rows of a later span.
    struct Block {
        Index span;   ///< its span
        Index first;  ///< its first row
        Index rows;   ///< its rows
    };

    SpanPlan(Index n, Index span_tokens, Index chunk)
        : n_(n),
          span_(std::max<Index>(1, span_tokens / chunk + (span_tokens % chunk != 0)) * chunk),
          spans_(span_tokens == 0 || n == 0 ? 1 : n / span_ + (n % span_ != 0)),
          first_block_(static_cast<std::size_t>(spans_) + 1, 0) {
        for (Index j = 1; j < spans_; ++j) {
            first_block_[static_cast<std::size_t>(j)] = static_cast<Index>(blocks_.size());
            for (Index r = first(j); r < first(j) + rows(j); r += block_rows)
                blocks_.push_back({j, r, std::min(block_rows, first(j) + rows(j) - r)});
        }
        first_block_[static_cast<std::size_t>(spans_)] = static_cast<Index>(blocks_.size());
    }
    [[nodiscard]] Index spans() const noexcept { return spans_; }                 ///< the number of spans
    [[nodiscard]] Index first(Index j) const noexcept { return j * span_; }       ///< span j's first row
    [[nodiscard]] Index rows(Index j) const noexcept { return std::min(span_, n_ - j * span_); }  ///< its rows
    [[nodiscard]] Index block_count() const noexcept { return static_cast<Index>(blocks_.size()); }
    [[nodiscard]] const Block& block(Index i) const noexcept { return blocks_[static_cast<std::size_t>(i)]; }
    /// Span j's first block (j ≥ 1); blocks [first_block(j), first_block(j + 1)) are its.
    [[nodiscard]] Index first_block(Index j) const noexcept { return first_block_[static_cast<std::size_t>(j)]; }

private:
    Index n_, span_, spans_;
    std::vector<Block> blocks_;
    std::vector<Index> first_block_;
};

/// The three steps of a span-parallel chunked form over `plan` (linear_spans,
/// gated_spans), each family giving its own parts:
///   1. every span at once: run_span(j, state) runs span j from `state`, which is the
///      given one for j = 0 and a zero rows × cols state (mu; nu of rows) for the others,
///      and leaves it the span's final state;
///   2. in order, the state before each span: carry(j, next, end) makes `next`, holding
///      the state before span j, the state after it (end: span j's final state from
///      zero); the last one is the call's final state, in `s`;
///   3. the later spans' rows at once: correct(first, last, before) for blocks
///      [first, last) of the plan, before[j] the state before span j.
/// The cut and every step's arithmetic depend on the plan, never on the threads.
template <class T, class RunSpan, class Carry, class Correct>
void by_spans(const SpanPlan& plan, LinearState<T>& s, Index rows, Index cols, ExecutorRef executor,
              RunSpan&& run_span, Carry&& carry, Correct&& correct) {
    const Index spans = plan.spans();
    std::vector<LinearState<T>> ends(static_cast<std::size_t>(spans));
    run_ranges(executor, spans, [&](Index first, Index last) {
        for (Index j = first; j < last; ++j) {
            LinearState<T>& e = ends[static_cast<std::size_t>(j)];
            if (j == 0) {
                e = s;
            } else {
                e.mu.setZero(rows, cols);
                e.nu.setZero(rows);
            }
            run_span(j, e);
        }
    });
    std::vector<LinearState<T>> before(static_cast<std::size_t>(spans));
    before[1] = ends[0];
    LinearState<T> final_state;  // s changes once every step has run: an executor that throws leaves it
    for (Index j = 1; j < spans; ++j) {
        LinearState<T>& next = j + 1 < spans ? before[static_cast<std::size_t>(j + 1)] : final_state;
        next = before[static_cast<std::size_t>(j)];
        carry(j, next, ends[static_cast<std::size_t>(j)]);
    }
    run_ranges(executor, plan.block_count(),
               [&](Index first, Index last) { correct(first, last, std::as_const(before)); });
    s.mu.swap(final_state.mu);
    s.nu.swap(final_state.nu);
}

// ------------------------------------------------------------------------- chunked

/// One chunk of n ≤ C tokens is three GEMMs and a GEMV over a scratch laid out so that
/// the state and the chunk sit side by side (allocated once per call):
///
///   left  (C × (d'+C)):  [ q'  |  A ]       q' = φ(Q_c) (scaled by γ^{i+1}),  A = masked pairs
///   right ((d'+C) × dv): [ μ   ;  V_c ]     μ lives here for the whole call, V_c is copied in
///   total (1 × (d'+C)):  [ ν   ,  1…1 ]     ν lives here too
///   keys  (C × d'):      k' = φ(K_c), and keys_t (d' × C) its transpose for GEMM 1
///
///   A_ij = γ^{i−j} q'_i·k'_j (j ≤ i, else 0)                       GEMM 1: q' k'ᵀ, then the mask
///   O_c  = [γ^{i+1} q' | A] [μ ; V_c] = γ^{i+1} q'μ + A V_c          GEMM 2, one call for both terms
///   den  = [γ^{i+1} q' | A] [ν ; 1]  = γ^{i+1} q'·ν + Σ_j A_ij       GEMV
///   μ ← γⁿ μ + (diag(γ^{n−1−j}) k')ᵀ V_c,  ν ← γⁿ ν + Σ_j γ^{n−1−j} k'_j   GEMM 3 (fold_views)
///
/// Putting q' before A keeps a short last chunk contiguous: its operands are the top-left
/// n × (d'+n) of `left` and the top d'+n rows of `right`.
///
/// A group of g query heads over one KV head (grouped-query attention) shares the keys,
/// the values and so the state: Q is n × g·d and O n × g·dv, member m in columns
/// [m·d, (m+1)·d) and [m·dv, (m+1)·dv). Per chunk k' and V_c are loaded once, the two
/// GEMMs run per member on the shared [μ ; V_c], and the state is folded once. Each
/// member's arithmetic is exactly that of a single-head call (g = 1) with its queries.
///
/// The scratch holds C = min(chunk_size, tokens) rows. A caller that cuts one sequence
/// into several calls (the layer's staging) passes the whole sequence's `tokens` as
/// `sequence_tokens`, so every call lays out its scratch alike: Eigen's small products
/// round differently at different alignments, and the pieces then give the bits of the
/// whole.
///
/// `raw_den`: a later span of linear_spans (one member), whose rows are left as q'μ of
/// the state gathered inside the span, with q'·ν into raw_den[t] when normalising, for
/// linear_spans to add the carried state to.
template <class T, class Phi>
void chunked_form(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V, MatrixRef<T> O,
                  const Phi& phi, const LinearOptions& options, Index features, LinearState<T>& s,
                  Index sequence_tokens = -1, T* raw_den = nullptr) {
    const Index tokens = Q.rows();
    const Index c = std::min(options.chunk_size, std::max<Index>(sequence_tokens >= 0 ? sequence_tokens : tokens, 1));
    const Index f = features, d = K.cols(), dv = V.cols(), members = Q.cols() / d;
    MEMATTN_DASSERT(Q.cols() == members * d && O.cols() == members * dv);
    Matrix<T> left(c, f + c), right(f + c, dv), keys(c, f), keys_t(f, c);
    Vector<T> total(f + c);
    ColumnVector<T> den(c);
    const ColumnVector<T> powers = decay_powers<T>(options.decay, c);
    Vector<T> mask;
    decay_mask<T>(options.decay, 0, c, mask);
    const bool decays = options.decay != 1;
    const auto eps = static_cast<T>(options.eps);
    // About ⌈lines / strips⌉ lines a strip: GEMMs 1 and 2 per member, GEMM 3 once.
    const Index rows = DefaultBlocking::rows, strips = members * 2 * ((c + rows - 1) / rows) + (f + rows - 1) / rows;
    PrefetchQueue ahead(c * (Q.cols() + d + dv + O.cols()) * static_cast<Index>(sizeof(T)) / 64 / strips + 1);

    right.topRows(f) = s.mu;
    total.head(f) = s.nu;
    total.tail(c).setOnes();

    for (Index start = 0; start < tokens; start += c) {
        const Index n = std::min(c, tokens - start);
        auto q = left.topLeftCorner(n, f);
        auto a = left.block(0, f, n, n);
        auto k = keys.topRows(n);
        auto mu = right.topRows(f);
        auto v = right.middleRows(f, n);
        auto nu = total.head(f);
        queue_next_chunk(ahead, start + c, std::min(c, tokens - start - c), Q, K, V, O);
        apply_features<T>(phi, K.middleRows(start, n), k);
        transpose(k.data(), n, f, k.outerStride(), keys_t.data(), c);  // k'ᵀ, the right operand of GEMM 1
        v = V.middleRows(start, n);
        for (Index m = 0; m < members; ++m) {
            auto o = O.block(start, m * dv, n, dv);
            apply_features<T>(phi, Q.block(start, m * d, n, d), q);
            tile_product<T>(n, n, f, q.data(), left.outerStride(), 1, keys_t.data(), c, a.data(), left.outerStride(),
                            nullptr, LowerColumns{0}, &ahead);  // GEMM 1: q' k'ᵀ, on and below the diagonal
            apply_causal_mask(a, mask, c, decays);
            if (decays)
                q.array().colwise() *= powers.segment(1, n).array();  // γ^{i+1} q'_i
            const auto operands = left.topLeftCorner(n, f + n);
            // GEMM 2: γ^{i+1} q'μ + A V_c, register-blocked (Eigen's GEMM loses on these
            // C-row products).
            tile_product<T>(n, dv, f + n, operands.data(), operands.outerStride(), 1, right.data(),
                            right.outerStride(), o.data(), o.outerStride(), nullptr, LowerTerms{f}, &ahead);
            if (options.normalize && raw_den != nullptr) {
                Eigen::Map<ColumnVector<T>> raw(raw_den + start, n);
                raw.noalias() = operands * total.head(f + n).transpose();
            } else if (options.normalize) {
                den.head(n).noalias() = operands * total.head(f + n).transpose();  // γ^{i+1} q'·ν + Σ_j A_ij
                normalize_rows(o, den, n, eps);
            }
        }
        fold_views(k, v, powers, decays, mu, nu, &ahead);  // GEMM 3
    }
    s.mu = right.topRows(f);
    s.nu = total.head(f);
}

/// The chunked form by spans (LinearOptions::span_tokens) on the executor's threads: the
/// state after a span of m tokens is γ^m μ_start + B (B what its pairs leave from zero),
/// and each output row is linear in μ_start and ν_start. So (1) every span runs at once,
/// the first from the given state, the later ones from zero and raw (no normaliser, q'·ν
/// kept); (2) in order, the state before each span; (3) blocks of the later spans' rows
/// at once add γ^{t+1} q'_t μ_start (and γ^{t+1} q'_t·ν_start, t counted from the span's
/// start), then normalise. The arithmetic depends on the length and the option, never
/// on the threads: the outputs and the final state are bitwise the same on any executor.
/// An initial state that is not finite runs as one span.
template <class T, class Phi>
void linear_spans(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V, MatrixRef<T> O,
                  const Phi& phi, const LinearOptions& options, Index features, LinearState<T>& s,
                  ExecutorRef executor) {
    const SpanPlan plan(Q.rows(), options.span_tokens, options.chunk_size);
    if (plan.spans() <= 1 || !s.mu.allFinite() || !s.nu.allFinite()) {
        chunked_form(Q, K, V, O, phi, options, features, s);
        return;
    }
    const Index dv = V.cols();
    ColumnVector<T> den(options.normalize ? Q.rows() : 0);
    const ColumnVector<T> powers = decay_powers<T>(options.decay, SpanPlan::block_rows);
    const bool decays = options.decay != 1;
    by_spans<T>(
        plan, s, features, dv, executor,
        [&](Index j, LinearState<T>& e) {  // 1. a span; the later ones raw
            const Index r0 = plan.first(j), m = plan.rows(j);
            chunked_form<T>(Q.middleRows(r0, m), K.middleRows(r0, m), V.middleRows(r0, m), O.middleRows(r0, m), phi,
                            options, features, e, -1, j > 0 && options.normalize ? den.data() + r0 : nullptr);
        },
        [&](Index j, LinearState<T>& next, const LinearState<T>& end) {  // 2. γ^m S + B
            const T g = decay_power<T>(options.decay, plan.rows(j));
            if (g != T(1)) {
                next.mu *= g;
                next.nu *= g;
            }
            next.mu += end.mu;
            next.nu += end.nu;
        },
        [&](Index first, Index last, const std::vector<LinearState<T>>& before) {  // 3. the carried part
            Matrix<T> qf(SpanPlan::block_rows, features);
            for (Index i = first; i < last; ++i) {
                const SpanPlan::Block& block = plan.block(i);
                const LinearState<T>& in = before[static_cast<std::size_t>(block.span)];
                auto q = qf.topRows(block.rows);
                apply_features<T>(phi, Q.middleRows(block.first, block.rows), q);
                if (decays) {  // γ^{t+1}, t from the span's start: γ^{offset+1} γ^{row in block}
                    const T base = decay_power<T>(options.decay, block.first - plan.first(block.span) + 1);
                    for (Index t = 0; t < block.rows; ++t)
                        q.row(t) *= base * powers(t);
                }
                auto o = O.middleRows(block.first, block.rows);
                tile_product_add<T>(block.rows, dv, features, q.data(), q.outerStride(), 1, in.mu.data(),
                                    in.mu.outerStride(), o.data(), o.outerStride());
                if (options.normalize) {
                    auto dn = den.segment(block.first, block.rows);
                    dn.noalias() += q * in.nu.transpose();
                    o.array().colwise() /= dn.array() + static_cast<T>(options.eps);
                }
            }
        });
}

// ------------------------------------------------------------------------- recurrent

/// Scratch (allocated once): qf, kf (C×d') the features of one chunk of tokens.
template <class T, class Phi>
void recurrent_form(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                    MatrixRef<T> O, const Phi& phi, const LinearOptions& options, Index features, LinearState<T>& s) {
    const Index tokens = Q.rows();
    const Index c = std::min(options.chunk_size, std::max<Index>(tokens, 1));
    Matrix<T> qf(c, features), kf(c, features);
    const bool decays = options.decay != 1;
    const auto gamma = static_cast<T>(options.decay);
    const auto eps = static_cast<T>(options.eps);

    for (Index start = 0; start < tokens; start += c) {
        const Index n = std::min(c, tokens - start);
        auto q = qf.topRows(n);
        auto k = kf.topRows(n);
        apply_features<T>(phi, Q.middleRows(start, n), q);
        apply_features<T>(phi, K.middleRows(start, n), k);
        for (Index t = 0; t < n; ++t) {
            if (decays) {
                s.mu *= gamma;
                s.nu *= gamma;
            }
            s.mu.noalias() += k.row(t).transpose() * V.row(start + t);  // μ = γμ + k'ᵀv
            s.nu += k.row(t);                                           // ν = γν + k'
            auto o = O.row(start + t);
            o.noalias() = q.row(t) * s.mu;  // q'μ
            if (options.normalize)
                o *= T(1) / (q.row(t).dot(s.nu) + eps);  // / (q'·ν + eps)
        }
    }
}

// ------------------------------------------------------------------------- quadratic

/// Tiles of C = max(chunk_size, 64) queries × C keys: every pair is computed anyway, so
/// the small chunks that suit the chunked form would only make the GEMMs less efficient.
/// Scratch (allocated once): qf, kf (C×d') the features of a query tile and a key
/// tile; scores (C×C) their masked products; den (C); mask (2C−1); start (C) the factors
/// γ^{p+1} of the initial state for the query tile.
template <class T, class Phi>
void quadratic_form(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                    MatrixRef<T> O, const Phi& phi, const LinearOptions& options, Index features, LinearState<T>& s,
                    bool has_initial, bool wants_state) {
    const Index tokens = Q.rows();
    const Index c = std::min(std::max<Index>(options.chunk_size, 64), std::max<Index>(tokens, 1));
    Matrix<T> qf(c, features), kf(c, features), scores(c, c);
    ColumnVector<T> den(c), start(c);
    Vector<T> mask;
    const bool decays = options.decay != 1;
    const auto eps = static_cast<T>(options.eps);

    for (Index i0 = 0; i0 < tokens; i0 += c) {
        const Index n = std::min(c, tokens - i0);
        auto q = qf.topRows(n);
        auto o = O.middleRows(i0, n);
        apply_features<T>(phi, Q.middleRows(i0, n), q);
        // The initial state: o_p = γ^{p+1} q'_p μ0, den_p = γ^{p+1} q'_p·ν0.
        if (has_initial) {
            for (Index i = 0; i < n; ++i)
                start(i) = decay_power<T>(options.decay, i0 + i + 1);
            o.noalias() = q * s.mu;
            den.head(n).noalias() = q * s.nu.transpose();
            o.array().colwise() *= start.head(n).array();
            den.head(n).array() *= start.head(n).array();
        } else {
            o.setZero();
            den.head(n).setZero();
        }
        // Every pair: o_p += Σ_{j≤p} γ^{p−j} (q'_p·k'_j) v_j, tile by tile.
        for (Index j0 = 0; j0 <= i0; j0 += c) {
            const Index m = std::min(c, tokens - j0);
            auto k = kf.topRows(m);
            auto p = scores.topLeftCorner(n, m);
            apply_features<T>(phi, K.middleRows(j0, m), k);
            p.noalias() = q * k.transpose();
            if (decays || j0 == i0) {
                decay_mask<T>(options.decay, i0 - j0, c, mask);
                apply_mask(p, mask, c);
            }
            o.noalias() += p * V.middleRows(j0, m);
            den.head(n) += p.rowwise().sum();
        }
        if (options.normalize)
            normalize_rows(o, den, n, eps);
    }
    if (!wants_state)
        return;
    // The final state, from the same chunked fold as the chunked form.
    const ColumnVector<T> powers = decay_powers<T>(options.decay, c);
    for (Index j0 = 0; j0 < tokens; j0 += c) {
        const Index m = std::min(c, tokens - j0);
        auto k = kf.topRows(m);
        apply_features<T>(phi, K.middleRows(j0, m), k);
        fold_chunk(k, V.middleRows(j0, m), powers, decays, s);
    }
}

enum class LinearForm { quadratic, recurrent, chunked };

/// Q, K and V of bfloat16 or float16 (O of that type or float, the state float) run the
/// same form in float, span by span (detail/float_spans.hpp).
template <LinearForm form, class DQ, class DK, class DV, class DO, class Phi>
void linear_attention(const char* function, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                      const Eigen::MatrixBase<DV>& V, DO&& O, const Phi& phi, const LinearOptions& options,
                      LinearState<arithmetic_t<typename DQ::Scalar>>* state, ExecutorRef executor = {}) {
    using E = typename DQ::Scalar;
    using T = arithmetic_t<E>;
    using Out = typename std::remove_cvref_t<DO>::Scalar;
    static_assert(Scalar<E> || LowPrecision<E>,
                  "memattn linear attention works on float, double, Eigen::bfloat16 or Eigen::half matrices.");
    static_assert(same_scalar<DQ, DK, DV>, "memattn linear attention: Q, K and V must share one scalar type.");
    static_assert(std::is_same_v<Out, E> || std::is_same_v<Out, T>,
                  "memattn linear attention: O must have the scalar type of Q (of bfloat16 or half: or float).");
    static_assert(FeatureMap<Phi, T>,
                  "memattn linear attention: phi must be a feature map for this scalar: a copyable type with "
                  "`Index output_dim(Index d) const` and `void operator()(ConstMatrixRef<T> X, MatrixRef<T> Y) "
                  "const` (see memattn/feature_maps.hpp).");
    const ConstMatrixRef<E> q = sequence(Q), k = sequence(K), v = sequence(V);
    MatrixRef<Out> o = output(std::forward<DO>(O));
    const Index features = check_linear_arguments<T>(function, phi, shape(q), shape(k), shape(v), shape(o), options,
                                                     state);
    require_apart(function, o, state, Named{"Q", q}, Named{"K", k}, Named{"V", v});
    LinearState<T> local;
    LinearState<T>& s = state != nullptr ? *state : local;
    const bool has_initial = s.mu.size() != 0 || s.nu.size() != 0;
    if (!has_initial) {
        s.mu.setZero(features, V.cols());
        s.nu.setZero(features);
    }
    const auto run = [&](const ConstMatrixRef<T>& qs, const ConstMatrixRef<T>& ks, const ConstMatrixRef<T>& vs,
                         MatrixRef<T> os, bool initial, bool wants_state) {
        if constexpr (form == LinearForm::chunked && !LowPrecision<E>)
            linear_spans(qs, ks, vs, os, phi, options, features, s, executor);
        else if constexpr (form == LinearForm::chunked)
            chunked_form(qs, ks, vs, os, phi, options, features, s);
        else if constexpr (form == LinearForm::recurrent)
            recurrent_form(qs, ks, vs, os, phi, options, features, s);
        else
            quadratic_form(qs, ks, vs, os, phi, options, features, s, initial, wants_state);
    };
    if constexpr (LowPrecision<E>) {
        // Each span continues from the state the one before left (the quadratic form: its
        // pairs within the span, the past through the state).
        FloatSpans spans;
        const Index n = q.rows();
        spans.each(n, options.chunk_size, o, [&](Index r0, Index m, MatrixRef<T> os) {
            run(spans.rows(0, q, r0, m), spans.rows(1, k, r0, m), spans.rows(2, v, r0, m), os, has_initial || r0 > 0,
                state != nullptr || r0 + m < n);
        });
    } else {
        run(q, k, v, o, has_initial, state != nullptr);
    }
}

}  // namespace detail

/// "Pairs": o_i = (Σ_{j≤i} γ^{i−j} (q'_i·k'_j) v_j + γ^{i+1} q'_i μ0) / (… + eps), by tiles
/// of options.chunk_size; O(N²·(d'+dv)). `state`: initial state in (empty = zero),
/// final state out.
template <class DQ, class DK, class DV, detail::EigenMatrix DO, class Phi = EluPlusOne>
void quadratic_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                const Eigen::MatrixBase<DV>& V, DO&& O, const Phi& phi = {},
                                const LinearOptions& options = {},
                                LinearState<arithmetic_t<typename DQ::Scalar>>* state = nullptr) {
    detail::linear_attention<detail::LinearForm::quadratic>("quadratic_linear_attention", Q, K, V, std::forward<DO>(O), phi, options,
                                                            state);
}

/// "Summary": μ and ν updated token by token (the recurrence at the top of this file).
template <class DQ, class DK, class DV, detail::EigenMatrix DO, class Phi = EluPlusOne>
void recurrent_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                const Eigen::MatrixBase<DV>& V, DO&& O, const Phi& phi = {},
                                const LinearOptions& options = {},
                                LinearState<arithmetic_t<typename DQ::Scalar>>* state = nullptr) {
    detail::linear_attention<detail::LinearForm::recurrent>("recurrent_linear_attention", Q, K, V, std::forward<DO>(O), phi, options,
                                                            state);
}

/// Chunks of options.chunk_size tokens: pairs inside the chunk, the carried state across
/// chunks, one GEMM to fold the chunk into the state. The fastest form for long inputs.
/// With options.span_tokens, one long sequence runs by spans on `executor`'s threads
/// (float and double inputs; 16-bit inputs run as one span), its outputs the same for
/// any executor (detail::linear_spans).
///
///   Matrix<float> O(N, dv);
///   LinearState<float> state;                       // empty: start from zero
///   chunked_linear_attention(Q, K, V, O, EluPlusOne{}, {.decay = 0.99}, &state);
template <class DQ, class DK, class DV, detail::EigenMatrix DO, class Phi = EluPlusOne>
void chunked_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                              const Eigen::MatrixBase<DV>& V, DO&& O, const Phi& phi = {},
                              const LinearOptions& options = {},
                              LinearState<arithmetic_t<typename DQ::Scalar>>* state = nullptr,
                              ExecutorRef executor = {}) {
    detail::linear_attention<detail::LinearForm::chunked>("chunked_linear_attention", Q, K, V, std::forward<DO>(O), phi, options,
                                                          state, executor);
}

}  // namespace memattn
