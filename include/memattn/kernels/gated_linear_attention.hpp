#pragma once
// Gated linear attention: the state decays by a gate that depends on the token, a
// scalar per token (Mamba-2, input-dependent RetNet-style decay) or one per key channel
// (GLA, Yang et al. 2024). State S (d×dv) and normaliser z (1×d), row vectors:
//
//   scalar gate:   S_i = g_i S_{i−1} + k_iᵀ v_i,          z_i = g_i z_{i−1} + k_i
//   channel gate:  S_i = diag(a_i) S_{i−1} + k_iᵀ v_i,    z_i = a_i ⊙ z_{i−1} + k_i
//   o_i = q̂_i S_i, or q̂_i S_i / (q̂_i·z_i + eps) with options.normalize,
//   q̂_i = scale · q_i (scale 1/√d unless given), k_i used as given,
//
// or with options.qk_l2norm, q_i and k_i first divided by √(Σx² + l2norm_eps): the
// conventions of flash-linear-attention's GLA and of Mamba-2, which never normalise by
// q·z (detail/query_key_norm.hpp; the factor of q̂ multiplies the output row).
//
// The gates arrive as log-gates, N×1 (scalar) or N×d (channel), each ≤ 0, so that long
// products never underflow to a wrong value. A log-gate of −∞ (a gate of 0) resets: the
// state (or, per channel, its row of S and its entry of z) becomes exactly 0 before the
// token's pair is added, whatever it held (no 0·∞ NaN); the chunked form starts a chunk
// at every token that holds one. LinearState{mu = S, nu = z} carries the state in and
// out as for linear attention.
//
// Chunked form, chunk of C tokens from state (S_0, z_0), b_t = Σ_{s≤t} log a_s inside
// the chunk (per channel; a scalar gate is the same in every channel):
//   o_t   = (q_t ⊙ e^{b_t}) S_0 + Σ_{s≤t} A_ts v_s,  A_ts = Σ_r q_tr k_sr e^{b_tr − b_sr}
//   S_C   = diag(e^{b_C}) S_0 + Σ_s diag(e^{b_C − b_s}) k_sᵀ v_s
// Every exponent is ≤ 0 (b only falls), so nothing overflows however small the gates:
// the pairs term never splits e^{b_t − b_s} into e^{b_t}·e^{−b_s}. With a scalar gate A
// is (Q Kᵀ) ⊙ e^{b_t − b_s}, one product; with channel gates A is computed pair by pair
// (C²·d exponentials per chunk, packets across the channels). The exponentials are
// detail::ExpNonpositiveOp's (every argument ≤ 0), row by row so that Eigen vectorises
// them.
//
// The products of a chunk (Q Kᵀ for a scalar gate, (Q ⊙ e^b) S_0, A V, the fold with the
// decay as its row scale) go through the register-blocked tile product, with the next
// chunk's rows prefetched a few lines per strip (detail::PrefetchQueue).
//
// One sequence on several threads (GatedOptions::span_tokens; detail::gated_spans): the
// state after a span is affine in the state before it, S_end = diag(e^{Λ}) S_start + B,
// and every output row is linear in it. The spans run at once from zero, their starting
// states follow in order, and each later span's rows add (Q ⊙ e^{b}) S_start; bitwise the
// same for any thread count (docs/design.md §4.2b).
//
// Measured (bench/linear_attention_bench.cpp, N = 65536, d = dv = 128, float, one thread
// of an Intel Xeon with AVX-512, medians of 5, interleaved), chunked against recurrent:
//   scalar gate:   4.9× (1.33M against 274k tokens/s); 3.0× with Eigen's products
//   channel gates: 3.3× (885k against 267k); 2.65× with Eigen's products, 1.81× while
//                  the channel exponentials went one scalar exp at a time.

#include "memattn/detail/query_key_norm.hpp"
#include "memattn/execution/executor.hpp"
#include "memattn/kernels/linear_attention.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace memattn {

/// Options of the gated linear-attention kernels and GatedLinearAttentionMemory
/// (flash-linear-attention's conventions by default: q scaled by 1/√d, no normaliser).
struct GatedOptions {
    Index chunk_size = 16;        ///< tokens per chunk (chunked form)
    std::optional<double> scale = std::nullopt;  ///< q's scale (FLA's `scale`); unset: 1/√d
    bool normalize = false;       ///< divide by q̂·z + eps (linear attention's normaliser; GLA, Mamba-2 and FLA do not)
    double eps = 1e-6;            ///< added to q̂·z when normalize
    bool qk_l2norm = false;       ///< divide q and k by √(Σx² + l2norm_eps) first (FLA's `use_qk_l2norm_in_kernel`)
    double l2norm_eps = 1e-6;     ///< ε of qk_l2norm
    /// Chunked form: cut the sequence every span_tokens tokens (rounded up to whole
    /// chunks) and run the spans on the executor's threads (see the top of the file); 0:
    /// one span. The outputs depend on it and on the length, never on the threads.
    Index span_tokens = 0;
};

namespace detail {

/// The query factor of a gated call in T over d-wide queries.
template <class T>
QueryFactor<T> query_factor(const GatedOptions& options, Index d) {
    return {static_cast<T>(resolved_scale(options.scale, d)), options.qk_l2norm, static_cast<T>(options.l2norm_eps)};
}

/// Every check of the gated kernels, before anything is written; returns the gate width.
/// T: the scalar the call computes in; E the inputs', G the log-gates' (E or T).
template <class T, class E, class G>
Index check_gated_arguments(const char* function, const ConstMatrixRef<E>& q, const ConstMatrixRef<E>& k,
                            const ConstMatrixRef<E>& v, const ConstMatrixRef<G>& g, Shape o,
                            const GatedOptions& options, const LinearState<T>* state) {
    require(options.chunk_size > 0, function, "options.chunk_size", "is ", options.chunk_size, ", expected > 0");
    require(options.eps >= 0 && finite_in<T>(options.eps), function, "options.eps", "is ", options.eps,
            ", expected a number >= 0 finite as ", scalar_name<T>);
    require(options.span_tokens >= 0 && options.span_tokens <= max_length, function, "options.span_tokens", "is ",
            options.span_tokens, ", expected 0 (one span) .. 2^62");
    check_query_key_options<T>(function, options.scale, options.l2norm_eps);
    require(k.rows() == q.rows() && k.cols() == q.cols(), function, "K", "has shape ", shape(k),
            ", expected the shape of Q (", shape(q), ")");
    require(v.rows() == q.rows(), function, "V", "has shape ", shape(v), ", expected ", q.rows(), " rows as Q (",
            shape(q), ")");
    require(o.rows == q.rows() && o.cols == v.cols(), function, "O", "has shape ", o, ", expected ", q.rows(), 'x',
            v.cols(), " (Q is ", shape(q), ", V is ", shape(v), ")");
    require(g.rows() == q.rows() && (g.cols() == 1 || g.cols() == q.cols()), function, "log_gates", "has shape ",
            shape(g), ", expected ", q.rows(), "x1 (a gate per token) or ", q.rows(), 'x', q.cols(),
            " (a gate per key channel)");
    const auto gates = g.template cast<T>();
    // One vectorised reduction (NaN propagates to the maximum, and fails the test), then,
    // only if it fails, the element by element search for the message.
    const bool all_good = g.size() == 0 || gates.template maxCoeff<Eigen::PropagateNaN>() <= T(0);
    for (Index i = 0; !all_good && i < g.rows(); ++i)
        for (Index c = 0; c < g.cols(); ++c) {
            const T x = static_cast<T>(g(i, c));
            require(x <= 0, function, "log_gates", "has ", x, " at (", i, ", ", c,
                    "), expected a log-gate <= 0 (a gate in [0, 1]; -inf resets the state)");
        }
    if (state != nullptr && (state->mu.size() != 0 || state->nu.size() != 0)) {
        require(state->mu.rows() == q.cols() && state->mu.cols() == v.cols(), function, "state->mu", "has shape ",
                shape(state->mu), ", expected ", q.cols(), 'x', v.cols(), " (key dim x value dim)");
        require(state->nu.cols() == q.cols(), function, "state->nu", "has shape ", shape(state->nu), ", expected 1x",
                q.cols());
    }
    return g.cols();
}

/// The rows of S and the entries of z whose log-gate in `gates` (one per channel) is −∞
/// become exactly 0 (a reset; their product with 0 would be NaN for an infinite value).
template <class T, class Gates>
void reset_channels(const Gates& gates, LinearState<T>& s) {
    for (Index r = 0; r < gates.size(); ++r)
        if (gates(r) == -std::numeric_limits<T>::infinity()) {
            s.mu.row(r).setZero();
            s.nu(r) = T(0);
        }
}

template <class T>
void gated_recurrent(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                     const ConstMatrixRef<T>& G, MatrixRef<T> O, const GatedOptions& options, LinearState<T>& s) {
    const Index d = Q.cols();
    const QueryFactor<T> factor = query_factor<T>(options, d);
    Vector<T> a(d), k(d);
    for (Index i = 0; i < Q.rows(); ++i) {
        if (G.cols() == 1) {
            const T g = std::exp(G(i, 0));
            if (G(i, 0) == -std::numeric_limits<T>::infinity()) {
                s.mu.setZero();
                s.nu.setZero();
            } else if (g != T(1)) {
                s.mu *= g;
                s.nu *= g;
            }
        } else {
            a = G.row(i).array().exp();
            s.mu.array().colwise() *= a.transpose().array();
            s.nu.array() *= a.array();
            reset_channels(G.row(i), s);
        }
        k = K.row(i);
        if (options.qk_l2norm)
            k *= l2norm_factor<T>(k.data(), d, factor.eps);
        s.mu.noalias() += k.transpose() * V.row(i);
        s.nu += k;
        O.row(i).noalias() = Q.row(i) * s.mu;
        const T f = factor(Q.row(i).data(), d);
        if (options.normalize)
            O.row(i) *= f / (f * Q.row(i).dot(s.nu) + static_cast<T>(options.eps));
        else if (factor.active())
            O.row(i) *= f;
    }
}

/// The chunked form. `raw`: a later span of gated_spans, whose rows are left as q S (the
/// state gathered inside the span, no query factor) with q·z into raw_den[t] when
/// normalising, for gated_spans to add the carried state to and finish.
template <class T>
void gated_chunked(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                   const ConstMatrixRef<T>& G, MatrixRef<T> O, const GatedOptions& options, LinearState<T>& s,
                   bool raw = false, T* raw_den = nullptr) {
    const Index n = Q.rows(), d = Q.cols(), dv = V.cols();
    const Index c_max = std::min<Index>(options.chunk_size, std::max<Index>(n, 1));
    const bool channel = G.cols() > 1;
    const QueryFactor<T> factor = query_factor<T>(options, d);
    Matrix<T> b(c_max, G.cols()), A(c_max, c_max), qg(c_max, d), kg(c_max, d), kt(channel ? 0 : d, c_max),
        keys(options.qk_l2norm ? c_max : 0, d);
    ColumnVector<T> den(c_max);
    Vector<T> last(d);
    // About ⌈lines / strips⌉ lines a strip: Q Kᵀ, the two products of O, the fold.
    const Index rows = DefaultBlocking::rows, strips = 3 * ((c_max + rows - 1) / rows) + (d + rows - 1) / rows;
    PrefetchQueue ahead(c_max * (2 * d + 2 * dv + G.cols()) * static_cast<Index>(sizeof(T)) / 64 / strips + 1);
    for (Index t0 = 0, c = 0; t0 < n; t0 += c) {
        c = chunk_before_reset(G, t0, std::min(c_max, n - t0));  // a reset starts the next chunk
        queue_next_chunk(ahead, t0 + c, std::min(c_max, n - t0 - c), Q, K, V, O);
        const auto q = Q.middleRows(t0, c), v = V.middleRows(t0, c);
        if (options.qk_l2norm) {  // the chunk's keys, normalised
            keys.topRows(c) = K.middleRows(t0, c);
            l2_normalise_rows(keys.topRows(c), factor.eps);
        }
        const ConstMatrixRef<T> k =
            options.qk_l2norm ? ConstMatrixRef<T>(keys.topRows(c)) : ConstMatrixRef<T>(K.middleRows(t0, c));
        auto o = O.middleRows(t0, c);
        auto bc = b.topRows(c);
        bc.row(0) = G.row(t0);
        if (channel) {  // a reset at the chunk's first token: its rows of the state become 0, its gate 1
            reset_channels(G.row(t0), s);
        } else if (G(t0, 0) == -std::numeric_limits<T>::infinity()) {
            s.mu.setZero();
            s.nu.setZero();
        }
        for (Index j = 0; j < bc.cols(); ++j)
            if (bc(0, j) == -std::numeric_limits<T>::infinity())
                bc(0, j) = T(0);
        for (Index t = 1; t < c; ++t)
            bc.row(t) = bc.row(t - 1) + G.row(t0 + t);
        auto a = A.topLeftCorner(c, c);
        auto qc = qg.topRows(c);
        auto kc = kg.topRows(c);
        const ExpNonpositiveOp<T> exp;
        if (!channel) {
            // A = (Q Kᵀ) ⊙ e^{b_t − b_s} on and below the diagonal, 0 above.
            transpose(k.data(), c, d, k.outerStride(), kt.data(), c_max);
            tile_product<T>(c, c, d, q.data(), Q.outerStride(), 1, kt.data(), c_max, a.data(), a.outerStride(),
                            nullptr, LowerColumns{0}, &ahead);
            for (Index t = 0; t < c; ++t) {
                for (Index s2 = 0; s2 <= t; ++s2)
                    a(t, s2) *= exp(bc(t, 0) - bc(s2, 0));
                a.row(t).tail(c - 1 - t).setZero();
            }
            qc = q.array().colwise() * bc.col(0).array().unaryExpr(exp);
            kc = k.array().colwise() * (bc(c - 1, 0) - bc.col(0).array()).unaryExpr(exp);
            last.setConstant(exp(bc(c - 1, 0)));
        } else {
            for (Index t = 0; t < c; ++t) {
                for (Index s2 = 0; s2 <= t; ++s2)
                    a(t, s2) = channel_pair(q.row(t).data(), k.row(s2).data(), &bc(t, 0), &bc(s2, 0), d);
                a.row(t).tail(c - 1 - t).setZero();
            }
            // Row by row, so that Eigen vectorises the exponentials (a replicated row
            // would make it fall back to one scalar exp2 at a time).
            for (Index t = 0; t < c; ++t) {
                qc.row(t) = q.row(t).array() * bc.row(t).array().unaryExpr(exp);
                kc.row(t) = k.row(t).array() * (bc.row(c - 1) - bc.row(t)).array().unaryExpr(exp);
            }
            last = bc.row(c - 1).array().unaryExpr(exp);
        }
        // O = (Q ⊙ e^b) S_0 + A V (A lower-triangular: row t adds the terms s ≤ t), through
        // the register-blocked tile product (Eigen's GEMM packs its operands first, which
        // costs more than it saves on these C-row products).
        tile_product<T>(c, dv, d, qc.data(), qc.outerStride(), 1, s.mu.data(), s.mu.outerStride(), o.data(),
                        o.outerStride(), nullptr, {}, &ahead);
        tile_product<T, DefaultBlocking, true>(c, dv, c, a.data(), a.outerStride(), 1, v.data(), V.outerStride(),
                                               o.data(), o.outerStride(), nullptr, LowerTerms{0}, &ahead);
        if (raw) {
            if (options.normalize) {
                Eigen::Map<ColumnVector<T>> raw_rows(raw_den + t0, c);
                raw_rows = a.rowwise().sum();
                raw_rows.noalias() += qc * s.nu.transpose();
            }
        } else if (options.normalize) {
            den.head(c) = a.rowwise().sum();
            den.head(c).noalias() += qc * s.nu.transpose();
            for (Index t = 0; t < c; ++t) {
                const T f = factor(q.row(t).data(), d);
                o.row(t) *= f / (f * den(t) + static_cast<T>(options.eps));
            }
        } else {
            scale_by_queries(factor, q, o);
        }
        // S ← diag(e^{b_C}) S + (K ⊙ e^{b_C − b})ᵀ V, the decay as the product's row scale
        // (Kᵀ read in place: A(r, s) = kc(s, r)); z likewise with V = 1.
        tile_product<T, FoldBlocking>(d, dv, c, kc.data(), 1, kc.outerStride(), v.data(), V.outerStride(),
                                      s.mu.data(), s.mu.outerStride(), last.data(), {}, &ahead);
        s.nu = s.nu.cwiseProduct(last) + kc.colwise().sum();
    }
}

/// S ← diag(e^{Λ}) S + B (z likewise): a state carried over a span whose log-gates sum to
/// Λ (1 or d wide) and whose pairs alone, from a zero state, leave B. A Λ of −∞ zeroes its
/// rows (no 0·∞).
template <class T>
void carry_over(LinearState<T>& s, const Vector<T>& log_decay, const LinearState<T>& b) {
    const Index d = s.mu.rows();
    for (Index r = 0; r < d; ++r) {
        const T x = log_decay(log_decay.size() == 1 ? 0 : r);
        if (x == -std::numeric_limits<T>::infinity()) {
            s.mu.row(r).setZero();
            s.nu(r) = T(0);
        } else if (x != T(0)) {
            const T g = std::exp(x);
            s.mu.row(r) *= g;
            s.nu(r) *= g;
        }
    }
    s.mu += b.mu;
    s.nu += b.nu;
}

/// Rows of a span left raw by gated_chunked (q S of the span's own state, q·z in `den`)
/// finished with the state `in` the span started from: o_t += (q_t ⊙ e^{b_t}) S_in and
/// den_t += (q_t ⊙ e^{b_t})·z_in, b_t the span's log-gates summed through row t (`b` holds
/// the sum before the first row, and the sum through the last on return), then the query
/// factor and the normaliser. `scratch` holds SpanPlan::block_rows × d; rows go in blocks
/// of that many, one product each.
template <class T>
void gated_carried_rows(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& G, MatrixRef<T> O, T* den,
                        const LinearState<T>& in, const GatedOptions& options, Vector<T>& b, Matrix<T>& scratch) {
    const Index d = Q.cols(), dv = O.cols(), gc = G.cols();
    const QueryFactor<T> factor = query_factor<T>(options, d);
    const ExpNonpositiveOp<T> exp;
    for (Index r0 = 0; r0 < Q.rows(); r0 += scratch.rows()) {
        const Index rows = std::min(scratch.rows(), Q.rows() - r0);
        const auto q = Q.middleRows(r0, rows);
        auto o = O.middleRows(r0, rows);
        auto qc = scratch.topRows(rows);
        for (Index t = 0; t < rows; ++t) {
            b += G.row(r0 + t);
            if (gc == 1)
                qc.row(t) = q.row(t) * exp(b(0));
            else
                qc.row(t) = q.row(t).array() * b.array().unaryExpr(exp);
        }
        tile_product_add<T>(rows, dv, d, qc.data(), qc.outerStride(), 1, in.mu.data(), in.mu.outerStride(), o.data(),
                            o.outerStride());
        if (options.normalize) {
            Eigen::Map<ColumnVector<T>> dn(den + r0, rows);
            dn.noalias() += qc * in.nu.transpose();
            for (Index t = 0; t < rows; ++t) {
                const T f = factor(q.row(t).data(), d);
                o.row(t) *= f / (f * dn(t) + static_cast<T>(options.eps));
            }
        } else {
            scale_by_queries(factor, q, o);
        }
    }
}

/// The chunked form by spans of options.span_tokens tokens (whole chunks), on the
/// executor's threads, in three steps:
///   1. every span runs the chunked form at once: the first from the given state, each
///      later one from zero and raw (its rows q S_in-span, no query factor, q·z kept), and
///      sums its log-gates (Λ) and their running sum at each block of rows;
///   2. in order, the state before each span: S_{j+1} = diag(e^{Λ_j}) S_j + B_j, B_j the
///      span's final state from zero (carry_over);
///   3. blocks of rows of the later spans at once: o_t += (q_t ⊙ e^{b_t}) S_j with b_t the
///      log-gates summed from the span's start through t (q·z likewise), then the query
///      factor and the normaliser.
/// Every step's arithmetic depends on the length and the span, not on the threads: the
/// outputs and the final state are bitwise the same for any executor. Work beyond one
/// span's: step 3's product, c·d·dv per row of the later spans (about a quarter more).
/// An initial state that is not finite runs as one span (a reset must forget it, and
/// step 3 would multiply it by 0).
template <class T>
void gated_spans(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                 const ConstMatrixRef<T>& G, MatrixRef<T> O, const GatedOptions& options, LinearState<T>& s,
                 ExecutorRef executor) {
    const SpanPlan plan(Q.rows(), options.span_tokens, options.chunk_size);
    if (plan.spans() <= 1 || !s.mu.allFinite() || !s.nu.allFinite()) {
        gated_chunked(Q, K, V, G, O, options, s);
        return;
    }
    const Index d = Q.cols(), dv = V.cols(), gc = G.cols();
    Matrix<T> starts(plan.block_count(), gc), totals(plan.spans(), gc);  // log-gates summed to blocks, spans
    ColumnVector<T> den(options.normalize ? Q.rows() : 0);
    by_spans<T>(
        plan, s, d, dv, executor,
        [&](Index j, LinearState<T>& e) {  // 1. a span, the later ones raw; its log-gates summed
            const Index r0 = plan.first(j), m = plan.rows(j);
            gated_chunked<T>(Q.middleRows(r0, m), K.middleRows(r0, m), V.middleRows(r0, m), G.middleRows(r0, m),
                             O.middleRows(r0, m), options, e, j > 0, options.normalize ? den.data() + r0 : nullptr);
            Vector<T> sum = Vector<T>::Zero(gc);
            Index b = j > 0 ? plan.first_block(j) : 0;
            for (Index t = 0; t < m; ++t) {
                if (j > 0 && b < plan.first_block(j + 1) && plan.block(b).first == r0 + t)
                    starts.row(b++) = sum;
                sum += G.row(r0 + t);
            }
            totals.row(j) = sum;
        },
        [&](Index j, LinearState<T>& next, const LinearState<T>& end) {  // 2. diag(e^{Λ}) S + B
            Vector<T> total = totals.row(j);
            carry_over(next, total, end);
        },
        [&](Index first, Index last, const std::vector<LinearState<T>>& before) {  // 3. the carried part
            Matrix<T> scratch(SpanPlan::block_rows, d);
            Vector<T> b(gc);
            for (Index i = first; i < last; ++i) {
                const SpanPlan::Block& block = plan.block(i);
                b = starts.row(i);
                gated_carried_rows<T>(Q.middleRows(block.first, block.rows), G.middleRows(block.first, block.rows),
                                      O.middleRows(block.first, block.rows),
                                      options.normalize ? den.data() + block.first : nullptr,
                                      before[static_cast<std::size_t>(block.span)], options, b, scratch);
            }
        });
}

enum class GatedForm { recurrent, chunked };

/// Q, K and V of bfloat16 or float16 (log_gates of that type or float, O of that type
/// or float, the state float) run the same form in float, span by span
/// (detail/float_spans.hpp).
template <GatedForm form, class DQ, class DK, class DV, class DG, class DO>
void gated_linear_attention(const char* function, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                            const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& log_gates, DO&& O,
                            const GatedOptions& options, LinearState<arithmetic_t<typename DQ::Scalar>>* state,
                            ExecutorRef executor = {}) {
    using E = typename DQ::Scalar;
    using T = arithmetic_t<E>;
    using G = typename DG::Scalar;
    using Out = typename std::remove_cvref_t<DO>::Scalar;
    static_assert(Scalar<E> || LowPrecision<E>,
                  "memattn gated linear attention works on float, double, Eigen::bfloat16 or Eigen::half matrices.");
    static_assert(same_scalar<DQ, DK, DV>, "memattn gated linear attention: Q, K and V must share one scalar type.");
    static_assert(std::is_same_v<G, E> || std::is_same_v<G, T>,
                  "memattn gated linear attention: log_gates must have the scalar type of Q (of bfloat16 or half: "
                  "or float).");
    static_assert(std::is_same_v<Out, E> || std::is_same_v<Out, T>,
                  "memattn gated linear attention: O must have the scalar type of Q (of bfloat16 or half: or float).");
    const ConstMatrixRef<E> q = sequence(Q), k = sequence(K), v = sequence(V);
    const ConstMatrixRef<G> g = sequence(log_gates);
    MatrixRef<Out> o = output(std::forward<DO>(O));
    check_gated_arguments<T>(function, q, k, v, g, shape(o), options, state);
    require_apart(function, o, state, Named{"Q", q}, Named{"K", k}, Named{"V", v}, Named{"log_gates", g});
    LinearState<T> local;
    LinearState<T>& s = state != nullptr ? *state : local;
    if (s.mu.size() == 0 && s.nu.size() == 0) {
        s.mu.setZero(q.cols(), v.cols());
        s.nu.setZero(q.cols());
    }
    const auto run = [&](const ConstMatrixRef<T>& qs, const ConstMatrixRef<T>& ks, const ConstMatrixRef<T>& vs,
                         const ConstMatrixRef<T>& gs, MatrixRef<T> os) {
        if constexpr (form == GatedForm::chunked && !LowPrecision<E>)
            gated_spans(qs, ks, vs, gs, os, options, s, executor);
        else if constexpr (form == GatedForm::chunked)
            gated_chunked(qs, ks, vs, gs, os, options, s);
        else
            gated_recurrent(qs, ks, vs, gs, os, options, s);
    };
    if constexpr (LowPrecision<E>) {
        FloatSpans spans;
        spans.each(q.rows(), options.chunk_size, o, [&](Index r0, Index m, MatrixRef<T> os) {
            run(spans.rows(0, q, r0, m), spans.rows(1, k, r0, m), spans.rows(2, v, r0, m), spans.rows(3, g, r0, m), os);
        });
    } else {
        run(q, k, v, g, o);
    }
}

}  // namespace detail

/// The gated recurrence token by token (see the top of the file). `log_gates`: N×1 or
/// N×d, ≤ 0 (−∞: a reset). `state`: initial state in (empty = zero), final state out.
template <class DQ, class DK, class DV, class DG, detail::EigenMatrix DO>
void recurrent_gated_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                      const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& log_gates, DO&& O,
                                      const GatedOptions& options = {},
                                      LinearState<arithmetic_t<typename DQ::Scalar>>* state = nullptr) {
    detail::gated_linear_attention<detail::GatedForm::recurrent>("recurrent_gated_linear_attention", Q, K, V,
                                                                 log_gates, std::forward<DO>(O), options, state);
}

/// The same outputs and final state by chunks of options.chunk_size tokens: the pairs
/// of a chunk, the carried state, one product to fold the chunk (see the top of the file).
/// With options.span_tokens, one long sequence runs by spans on `executor`'s threads
/// (float and double inputs; 16-bit inputs run as one span), its outputs the same for
/// any executor.
template <class DQ, class DK, class DV, class DG, detail::EigenMatrix DO>
void chunked_gated_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& log_gates, DO&& O,
                                    const GatedOptions& options = {},
                                    LinearState<arithmetic_t<typename DQ::Scalar>>* state = nullptr,
                                    ExecutorRef executor = {}) {
    detail::gated_linear_attention<detail::GatedForm::chunked>("chunked_gated_linear_attention", Q, K, V, log_gates,
                                                               std::forward<DO>(O), options, state, executor);
}

}  // namespace memattn
