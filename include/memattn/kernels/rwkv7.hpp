#pragma once
// RWKV-7's generalised delta rule (Peng et al. 2025, "RWKV-7 Goose"): a state with a
// per-channel decay and a rank-one transition of two free vectors. State S (d×dv), row
// vectors, per token a query q_t (RWKV's r), a key k_t, a value v_t, log-decays
// log w_t (1×d, each ≤ 0) and the transition's vectors a_t, b_t (1×d):
//
//   S_t = (Diag(w_t) + b_tᵀ a_t) S_{t−1} + k_tᵀ v_t,     o_t = scale · q_t S_t
//
// (scale: Rwkv7Options::scale, 1 by default as flash-linear-attention's RWKV-7 kernels)
//
// (flash-linear-attention writes the transpose, S_t = S_{t−1}(Diag(w_t) + a_tᵀ b_t) + v_tᵀ k_t
// with S = dv×d and o_t = S_t r_t: its state is this one transposed, its r is q). RWKV-7
// itself takes a = −κ̂ and b = κ̂ ⊙ α (κ̂ the normalised removal key, α the in-context
// learning rate), which a model computes before the call. With a = −β k, b = k, w = 1 and
// v scaled by β it is the delta rule. A log-decay of −∞ zeroes its channel's row of the
// decayed term Diag(w_t) S_{t−1} (a reset of that part; the rank-one term still reads
// S_{t−1}).
//
// Chunked form, a chunk of C tokens from S_0, λ_t = Σ_{s≤t} log w_s per channel (λ_{−1} =
// 0), and the rank-one term's read of the state w̃_t = a_t S_{t−1} (1×dv): S_t =
// Diag(e^{λ_t}) S_0 + Σ_{s≤t} Diag(e^{λ_t − λ_s}) (b_sᵀ w̃_s + k_sᵀ v_s), so
//
//   (I − M_ab) W̃ = (A ⊙ e^{λ_{t−1}}) S_0 + M_ak V,
//       M_xy(t, s) = Σ_r x_tr y_sr e^{λ_{t−1,r} − λ_{s,r}}   (s < t), one unit-lower solve;
//   O = (Q ⊙ e^{λ}) S_0 + P_qb W̃ + P_qk V,   P_xy(t, s) = Σ_r x_tr y_sr e^{λ_tr − λ_sr} (s ≤ t);
//   S_C = Diag(e^{λ_C}) S_0 + (B ⊙ e^{λ_C − λ})ᵀ W̃ + (K ⊙ e^{λ_C − λ})ᵀ V.
//
// Every exponent is ≤ 0, but for the factored pairs: where a chunk's λ spans at most
// rwkv7_pair_range, e^{λ_t − λ_s} = e^{λ_t} e^{−λ_s} and the four pair matrices are
// products of C rows against B ⊙ e^{−λ} and K ⊙ e^{−λ} (e^{−λ_s} ≤ e^{40} in float).
// A chunk ends before a token whose log-decay holds −∞, and that token is taken by the
// recurrence, so no exponent meets −∞ − (−∞).

#include "memattn/kernels/linear_attention.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace memattn {

/// Options of the RWKV-7 kernels.
struct Rwkv7Options {
    Index chunk_size = 16;  ///< tokens per chunk (chunked form)
    double scale = 1;       ///< o = scale · q S (flash-linear-attention's `scale`, 1 for RWKV-7 as there)
};

namespace detail {

/// Every check of the RWKV-7 kernels, before anything is written. T: the scalar the call
/// computes in; E the inputs' (T, or bfloat16 / float16 with T = float).
template <class T, class E>
void check_rwkv7_arguments(const char* function, const ConstMatrixRef<E>& q, const ConstMatrixRef<E>& k,
                           const ConstMatrixRef<E>& v, const ConstMatrixRef<E>& a, const ConstMatrixRef<E>& b,
                           const ConstMatrixRef<E>& log_w, Shape o, const Rwkv7Options& options,
                           const LinearState<T>* state) {
    require(options.chunk_size > 0, function, "options.chunk_size", "is ", options.chunk_size, ", expected > 0");
    require(finite_in<T>(options.scale), function, "options.scale", "is ", options.scale,
            ", expected a number finite as ", scalar_name<T>);
    const auto same_as_q = [&](const ConstMatrixRef<E>& x, const char* name) {
        require(x.rows() == q.rows() && x.cols() == q.cols(), function, name, "has shape ", shape(x),
                ", expected the shape of Q (", shape(q), ")");
    };
    same_as_q(k, "K");
    same_as_q(a, "A");
    same_as_q(b, "B");
    same_as_q(log_w, "log_w");
    require(v.rows() == q.rows(), function, "V", "has shape ", shape(v), ", expected ", q.rows(), " rows as Q (",
            shape(q), ")");
    require(o.rows == q.rows() && o.cols == v.cols(), function, "O", "has shape ", o, ", expected ", q.rows(), 'x',
            v.cols(), " (Q is ", shape(q), ", V is ", shape(v), ")");
    const bool all_good =
        log_w.size() == 0 || log_w.template cast<T>().template maxCoeff<Eigen::PropagateNaN>() <= T(0);
    for (Index i = 0; !all_good && i < log_w.rows(); ++i)
        for (Index c = 0; c < log_w.cols(); ++c) {
            const T x = static_cast<T>(log_w(i, c));
            require(x <= 0, function, "log_w", "has ", x, " at (", i, ", ", c,
                    "), expected a log-decay <= 0 (a decay in [0, 1])");
        }
    if (state != nullptr && state->mu.size() != 0)
        require(state->mu.rows() == q.cols() && state->mu.cols() == v.cols(), function, "state->mu", "has shape ",
                shape(state->mu), ", expected ", q.cols(), 'x', v.cols(), " (key dim x value dim)");
}

/// One token's state update: S ← (Diag(w) + bᵀa) S + kᵀv (a −∞ log-decay zeroes its
/// channel's row of Diag(w) S). `read` holds a S (1×dv). Rwkv7Memory::update's too.
template <class T, class K, class V, class A, class B, class W>
void rwkv7_update(const K& k, const V& v, const A& a, const B& b, const W& log_w, Matrix<T>& S, Vector<T>& read) {
    read.noalias() = a * S;
    for (Index r = 0; r < S.rows(); ++r) {
        const T x = log_w(r);
        if (x == -std::numeric_limits<T>::infinity())
            S.row(r).setZero();
        else if (x != T(0))
            S.row(r) *= std::exp(x);
    }
    S.noalias() += b.transpose() * read;
    S.noalias() += k.transpose() * v;
}

/// One token of the recurrence: the update, then o = scale · q S.
template <class T, class Out>
void rwkv7_step(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                const ConstMatrixRef<T>& A, const ConstMatrixRef<T>& B, const ConstMatrixRef<T>& W, Index i, T scale,
                Matrix<T>& S, Vector<T>& read, Out&& o) {
    rwkv7_update(K.row(i), V.row(i), A.row(i), B.row(i), W.row(i), S, read);
    o.noalias() = Q.row(i) * S;
    if (scale != T(1))
        o *= scale;
}

template <class T>
void rwkv7_recurrent(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                     const ConstMatrixRef<T>& A, const ConstMatrixRef<T>& B, const ConstMatrixRef<T>& W, MatrixRef<T> O,
                     const Rwkv7Options& options, Matrix<T>& S) {
    Vector<T> read(V.cols());
    for (Index i = 0; i < Q.rows(); ++i)
        rwkv7_step(Q, K, V, A, B, W, i, static_cast<T>(options.scale), S, read, O.row(i));
}

/// The largest span of a chunk's λ (in any channel) for which RWKV-7's pairs factor as
/// (x ⊙ e^{λ_t})·(y ⊙ e^{−λ_s}): e^{±40} keeps both factors of a float far from overflow
/// and from the subnormals (e^{±400} for a double).
template <class T>
inline constexpr T rwkv7_pair_range = sizeof(T) == 4 ? T(40) : T(400);

/// The chunked form (see the top of the file), the pair terms by products of C rows
/// against B ⊙ e^{−λ} and K ⊙ e^{−λ} where the chunk's λ spans at most rwkv7_pair_range
/// (as flash-linear-attention factors the decay through a reference row), else by
/// channel_pairs (two per exponential); the products by the register-blocked tile product.
template <class T>
void rwkv7_chunked(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                   const ConstMatrixRef<T>& A, const ConstMatrixRef<T>& B, const ConstMatrixRef<T>& W, MatrixRef<T> O,
                   const Rwkv7Options& options, Matrix<T>& S) {
    const Index n = Q.rows(), d = Q.cols(), dv = V.cols();
    const Index c_max = std::min<Index>(options.chunk_size, std::max<Index>(n, 1));
    // λ with a leading row of zeros: row t + 1 is λ_t, row t is λ_{t−1}.
    // [W̃; V] and [P_qb | P_qk] stacked, so that O's and the fold's two products each are one
    // of depth 2C; the fold's rows [B ⊙ e^{λ_C − λ}; K ⊙ e^{λ_C − λ}] likewise.
    Matrix<T> lambda(c_max + 1, d), scaled(c_max, d), stacked(2 * c_max, dv), m_ab(c_max, c_max),
        m_ak(c_max, c_max), p_q(c_max, 2 * c_max), fold_rows(2 * c_max, d);
    // The factored pairs' operands: A ⊙ e^{λ_{t−1}}, Q ⊙ e^{λ_t}, B ⊙ e^{−λ_s}, K ⊙ e^{−λ_s}
    // (rows), the last two transposed.
    Matrix<T> a_up(c_max, d), q_up(c_max, d), b_down(c_max, d), k_down(c_max, d), b_t(d, c_max), k_t(d, c_max);
    Vector<T> read(dv), last(d);
    const ExpNonpositiveOp<T> exp;
    const T scale = static_cast<T>(options.scale);
    for (Index t0 = 0, c = 0; t0 < n; t0 += c) {
        if ((W.row(t0).array() == -std::numeric_limits<T>::infinity()).any()) {  // a reset: the recurrence takes it
            c = 1;
            rwkv7_step(Q, K, V, A, B, W, t0, scale, S, read, O.row(t0));
            continue;
        }
        c = chunk_before_reset(W, t0, std::min(c_max, n - t0));
        const auto q = Q.middleRows(t0, c), k = K.middleRows(t0, c), v = V.middleRows(t0, c), a = A.middleRows(t0, c),
                   b = B.middleRows(t0, c);
        lambda.row(0).setZero();
        for (Index t = 0; t < c; ++t)
            lambda.row(t + 1) = lambda.row(t) + W.row(t0 + t);
        const auto at = [&](Index row) { return &lambda(row, 0); };
        // The pair terms: M below the diagonal (λ_{t−1} − λ_s), P on and below it (λ_t − λ_s).
        auto mab = m_ab.topLeftCorner(c, c), mak = m_ak.topLeftCorner(c, c), pqb = p_q.block(0, 0, c, c),
             pqk = p_q.block(0, c, c, c);
        // Where λ spans at most rwkv7_pair_range in every channel, e^{λ_t − λ_s} = e^{λ_t}
        // e^{−λ_s} with neither factor out of range: the four pair matrices are products of
        // C rows, C·d exponentials per chunk where the pairs take C²·d.
        const bool factored = -lambda.row(c).minCoeff() <= rwkv7_pair_range<T>;
        if (factored) {
            auto au = a_up.topRows(c), qu = q_up.topRows(c), bd = b_down.topRows(c), kd = k_down.topRows(c);
            last = lambda.row(0).array().unaryExpr(exp);
            for (Index t = 0; t < c; ++t) {  // last: e^{λ_{t−1}}, then e^{λ_t}
                au.row(t) = a.row(t).array() * last.array();
                last = lambda.row(t + 1).array().unaryExpr(exp);
                qu.row(t) = q.row(t).array() * last.array();
                bd.row(t) = b.row(t).array() / last.array();
                kd.row(t) = k.row(t).array() / last.array();
            }
            transpose(bd.data(), c, d, bd.outerStride(), b_t.data(), b_t.outerStride());
            transpose(kd.data(), c, d, kd.outerStride(), k_t.data(), k_t.outerStride());
            tile_product<T>(c, c, d, au.data(), au.outerStride(), 1, b_t.data(), b_t.outerStride(), mab.data(),
                            mab.outerStride(), nullptr, LowerColumns{-1});
            tile_product<T>(c, c, d, au.data(), au.outerStride(), 1, k_t.data(), k_t.outerStride(), mak.data(),
                            mak.outerStride(), nullptr, LowerColumns{-1});
            tile_product<T>(c, c, d, qu.data(), qu.outerStride(), 1, b_t.data(), b_t.outerStride(), pqb.data(),
                            pqb.outerStride(), nullptr, LowerColumns{0});
            tile_product<T>(c, c, d, qu.data(), qu.outerStride(), 1, k_t.data(), k_t.outerStride(), pqk.data(),
                            pqk.outerStride(), nullptr, LowerColumns{0});
            for (Index t = 0; t < c; ++t) {  // M strictly lower, P lower
                mab.row(t).tail(c - t).setZero();
                mak.row(t).tail(c - t).setZero();
                pqb.row(t).tail(c - 1 - t).setZero();
                pqk.row(t).tail(c - 1 - t).setZero();
            }
        } else {
            mab.setZero();
            mak.setZero();
            pqb.setZero();
            pqk.setZero();
            for (Index t = 0; t < c; ++t) {
                const T* at_row = a.row(t).data();
                const T* qt_row = q.row(t).data();
                for (Index s2 = 0; s2 < t; ++s2)
                    channel_pairs(at_row, b.row(s2).data(), at_row, k.row(s2).data(), at(t), at(s2 + 1), d,
                                  mab(t, s2), mak(t, s2));
                for (Index s2 = 0; s2 <= t; ++s2)
                    channel_pairs(qt_row, b.row(s2).data(), qt_row, k.row(s2).data(), at(t + 1), at(s2 + 1), d,
                                  pqb(t, s2), pqk(t, s2));
            }
        }
        // W̃ = (I − M_ab)⁻¹ ((A ⊙ e^{λ_{t−1}}) S_0 + M_ak V).
        auto wr = stacked.topRows(c);
        auto sc = scaled.topRows(c);
        // The rows scaled by their decays: the factored pairs' operands, or made here.
        const auto up = [&](const Matrix<T>& factored_rows, const auto& rows, Index shift) -> const T* {
            if (factored)
                return factored_rows.data();
            for (Index t = 0; t < c; ++t)
                sc.row(t) = rows.row(t).array() * lambda.row(t + shift).array().unaryExpr(exp);
            return sc.data();
        };
        tile_product<T>(c, dv, d, up(a_up, a, 0), d, 1, S.data(), S.outerStride(), wr.data(), wr.outerStride(),
                        nullptr);
        tile_product<T, DefaultBlocking, true>(c, dv, c, mak.data(), mak.outerStride(), 1, v.data(), V.outerStride(),
                                               wr.data(), wr.outerStride(), nullptr);
        forward_substitution<T>(c, dv, mab.data(), mab.outerStride(), wr.data(), wr.outerStride());
        // O = (Q ⊙ e^{λ}) S_0 + [P_qb | P_qk] [W̃; V].
        auto o = O.middleRows(t0, c);
        tile_product<T>(c, dv, d, up(q_up, q, 1), d, 1, S.data(), S.outerStride(), o.data(), o.outerStride(),
                        nullptr);
        stacked.middleRows(c, c) = v;
        tile_product<T, DefaultBlocking, true>(c, dv, 2 * c, p_q.data(), p_q.outerStride(), 1, stacked.data(),
                                               stacked.outerStride(), o.data(), o.outerStride(), nullptr);
        if (scale != T(1))
            o *= scale;
        // S = Diag(e^{λ_C}) S_0 + (B ⊙ e^{λ_C − λ})ᵀ W̃ + (K ⊙ e^{λ_C − λ})ᵀ V: one product of
        // depth 2C over [W̃; V], the decay its row scale.
        last = lambda.row(c).array().unaryExpr(exp);
        for (Index t = 0; t < c; ++t) {
            if (factored) {
                fold_rows.row(t) = b_down.row(t).array() * last.array();
                fold_rows.row(c + t) = k_down.row(t).array() * last.array();
            } else {
                sc.row(t) = (lambda.row(c) - lambda.row(t + 1)).array().unaryExpr(exp);
                fold_rows.row(t) = b.row(t).array() * sc.row(t).array();
                fold_rows.row(c + t) = k.row(t).array() * sc.row(t).array();
            }
        }
        tile_product<T, FoldBlocking>(d, dv, 2 * c, fold_rows.data(), 1, fold_rows.outerStride(), stacked.data(),
                                      stacked.outerStride(), S.data(), S.outerStride(), last.data());
    }
}

enum class Rwkv7Form { recurrent, chunked };

/// Inputs of bfloat16 or float16 (O of that type or float, the state float) run the same
/// form in float, span by span (detail/float_spans.hpp).
template <Rwkv7Form form, class DQ, class DK, class DV, class DA, class DB, class DW, class DO>
void rwkv7_attention(const char* function, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                     const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DA>& A, const Eigen::MatrixBase<DB>& B,
                     const Eigen::MatrixBase<DW>& log_w, DO&& O, const Rwkv7Options& options,
                     LinearState<arithmetic_t<typename DQ::Scalar>>* state) {
    using E = typename DQ::Scalar;
    using T = arithmetic_t<E>;
    using Out = typename std::remove_cvref_t<DO>::Scalar;
    static_assert(Scalar<E> || LowPrecision<E>,
                  "memattn RWKV-7 attention works on float, double, Eigen::bfloat16 or Eigen::half matrices.");
    static_assert(same_scalar<DQ, DK, DV> && same_scalar<DQ, DA, DB> && same_scalar<DQ, DW, DQ>,
                  "memattn RWKV-7 attention: Q, K, V, A, B and log_w must share one scalar type.");
    static_assert(std::is_same_v<Out, E> || std::is_same_v<Out, T>,
                  "memattn RWKV-7 attention: O must have the scalar type of Q (of bfloat16 or half: or float).");
    const ConstMatrixRef<E> q = sequence(Q), k = sequence(K), v = sequence(V), a = sequence(A), b = sequence(B),
                            w = sequence(log_w);
    MatrixRef<Out> o = output(std::forward<DO>(O));
    check_rwkv7_arguments<T>(function, q, k, v, a, b, w, shape(o), options, state);
    require_apart(function, o, state, Named{"Q", q}, Named{"K", k}, Named{"V", v}, Named{"A", a}, Named{"B", b},
                  Named{"log_w", w});
    LinearState<T> local;
    LinearState<T>& s = state != nullptr ? *state : local;
    if (s.mu.size() == 0)
        s.mu.setZero(q.cols(), v.cols());
    const auto run = [&](const ConstMatrixRef<T>& qs, const ConstMatrixRef<T>& ks, const ConstMatrixRef<T>& vs,
                         const ConstMatrixRef<T>& as, const ConstMatrixRef<T>& bs, const ConstMatrixRef<T>& ws,
                         MatrixRef<T> os) {
        if constexpr (form == Rwkv7Form::chunked)
            rwkv7_chunked(qs, ks, vs, as, bs, ws, os, options, s.mu);
        else
            rwkv7_recurrent(qs, ks, vs, as, bs, ws, os, options, s.mu);
    };
    if constexpr (LowPrecision<E>) {
        FloatSpans spans;
        spans.each(q.rows(), options.chunk_size, o, [&](Index r0, Index m, MatrixRef<T> os) {
            run(spans.rows(0, q, r0, m), spans.rows(1, k, r0, m), spans.rows(2, v, r0, m), spans.rows(3, a, r0, m),
                spans.rows(4, b, r0, m), spans.rows(5, w, r0, m), os);
        });
    } else {
        run(q, k, v, a, b, w, o);
    }
}

}  // namespace detail

/// RWKV-7's generalised delta rule token by token (see the top of the file): Q (RWKV's
/// r), K, A, B and log_w N×d, V N×dv, log_w ≤ 0 (−∞ zeroes a channel's decayed term);
/// float, double, or all six of bfloat16 or float16 (then O of that type or float, the
/// state float: the float kernel on the converted inputs, bit for bit).
/// `state`: initial S in state->mu (empty = zero), final S out; nu is not used.
template <class DQ, class DK, class DV, class DA, class DB, class DW, detail::EigenMatrix DO>
void recurrent_rwkv7_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                               const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DA>& A,
                               const Eigen::MatrixBase<DB>& B, const Eigen::MatrixBase<DW>& log_w, DO&& O,
                               const Rwkv7Options& options = {},
                               LinearState<arithmetic_t<typename DQ::Scalar>>* state = nullptr) {
    detail::rwkv7_attention<detail::Rwkv7Form::recurrent>("recurrent_rwkv7_attention", Q, K, V, A, B, log_w,
                                                          std::forward<DO>(O), options, state);
}

/// The same outputs and final state by chunks of options.chunk_size tokens.
template <class DQ, class DK, class DV, class DA, class DB, class DW, detail::EigenMatrix DO>
void chunked_rwkv7_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                             const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DA>& A,
                             const Eigen::MatrixBase<DB>& B, const Eigen::MatrixBase<DW>& log_w, DO&& O,
                             const Rwkv7Options& options = {},
                             LinearState<arithmetic_t<typename DQ::Scalar>>* state = nullptr) {
    detail::rwkv7_attention<detail::Rwkv7Form::chunked>("chunked_rwkv7_attention", Q, K, V, A, B, log_w,
                                                        std::forward<DO>(O), options, state);
}

}  // namespace memattn
