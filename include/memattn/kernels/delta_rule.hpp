#pragma once
// The delta rule (DeltaNet) and the gated delta rule (Gated DeltaNet): a key overwrites
// what the state already stores for it instead of only adding to it. State S (d×dv),
// row vectors, β_i ∈ [0, 1] (or [0, 2]: DeltaOptions::allow_negative_eigenvalues),
// optional log-gates log g_i ≤ 0:
//
//   S_i = g_i (I − β_i k_iᵀ k_i) S_{i−1} + β_i k_iᵀ v_i
//       = g_i S_{i−1} + k_iᵀ u_i,   u_i = β_i (v_i − g_i k_i S_{i−1})
//   o_i = q_i S_i
//
// (g_i = 1 without gates.) With log-gates per key channel (N×d: KDA, Kimi Delta
// Attention, Kimi Team 2025) the decay is Diag(α_i) in place of g_i:
//
//   S_i = (I − β_i k_iᵀ k_i) Diag(α_i) S_{i−1} + β_i k_iᵀ v_i
//
// (recurrent_kda_attention / chunked_kda_attention; kda_chunked below for its chunks).
// With unit keys and β_i = 1, k_i S_i = v_i exactly: the key reads back its value. A
// log-gate of −∞ (g_i = 0) resets: S becomes exactly 0 before the token's update,
// whatever it held; the chunked form starts a chunk at each one.
//
// The query is scaled as flash-linear-attention's: o_i = scale · q_i S_i, scale 1/√d
// unless DeltaOptions::scale gives one; DeltaOptions::qk_l2norm divides q and k by
// √(Σx² + l2norm_eps) first (a zero key stays zero; detail/query_key_norm.hpp: the
// query's factor multiplies the output row, the keys are normalised a chunk at a
// time). LinearState carries S in mu; nu is not used (left empty).
//
// Chunked form (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta
// Rule over Sequence Length": the WY / UT representation), a chunk of C tokens from
// state S_0, b_t = Σ_{s≤t} log g_s inside the chunk, γ_t = e^{b_t}:
//   u_t = β_t (v_t − γ_t k_t S_0 − Σ_{s<t} e^{b_t − b_s} (k_t·k_s) u_s)
//       i.e. (I + L) U = diag(β)(V − diag(γ) K S_0),  L_ts = β_t e^{b_t − b_s} k_t·k_s (s < t),
//       one unit-lower-triangular solve;
//   o_t = γ_t q_t S_0 + Σ_{s≤t} e^{b_t − b_s} (q_t·k_s) u_s
//   S_C = γ_C S_0 + Σ_s e^{b_C − b_s} k_sᵀ u_s
// Every exponent is ≤ 0. The per-token rank-1 updates and GEMVs of the recurrence become
// products of C rows through the register-blocked tile product (detail/tile_product.hpp):
// K S_0 and Q S_0 (straight into O), K Kᵀ and Q Kᵀ (only their packets on and below the
// diagonal), A U (only the terms s ≤ t) and Kᵀ U (Kᵀ read in place, γ_C as the row scale
// of S_0). The solve is a forward substitution whose row blocks take the finished rows
// above them in one tile product (detail::forward_substitution; −L is stored, so it adds).
// Keys and queries are read in place unless keys are normalised or decayed, and the next
// chunk's rows of Q, K, V and O are prefetched a few lines per strip of these products
// (detail::PrefetchQueue).
//
// Per token the chunked form does 6·d·dv FLOPs for the state, as many as the recurrence
// (K S_0, Q S_0, Kᵀ U against k S, q S, kᵀ u), plus about C·(d + dv) for the triangles:
// it wins because products of C rows run near the FMA peak where the recurrence's
// chains of FMAs stream S (64 KiB at d = 128) once per token (detail::delta_token: by
// panels of columns, k S from memory, then the update and q S from L1; the figures below
// are of the three GEMVs it replaced, which read S from L2 three times per token).
//
// Measured (bench/linear_attention_bench.cpp, N = 65536, d = dv = 128, float, one thread of
// an Intel Xeon with AVX-512, FMA peak 180 GFLOP/s, medians of 5, interleaved):
//
//                                  chunked (tokens/s)   recurrent   ratio
//   Eigen GEMM products, C = 32      654k                318k        1.97×
//   tile products, C = 32            709k                318k        2.2×
//   + bands, substitution, in-place
//     Q/K, spread prefetch, C = 16   1060k               347k        3.05× (3.12× by BM_DeltaChunkSize)
//   gated, the same                  981k                225k        4.4×  (3.1× before)
//
// Chunk sizes at d = 128 (BM_DeltaChunkSize): 16: 1083k, 32: 1015k, 64: 986k, 128: 754k
// tokens/s; at d = 64 C = 16 also beats 32 (3.47M against 3.17M), so 16 is the default.
// The spread prefetch alone was worth 10% at N = 65536 (the inputs, 128 MiB, leave the
// cache): one burst per operand gained 2%, about what its stalls on the line-fill
// buffers cost.

#include "memattn/detail/query_key_norm.hpp"
#include "memattn/kernels/linear_attention.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>

namespace memattn {

/// Options of the (gated) delta rule and KDA kernels and of DeltaRuleMemory and KdaMemory
/// (flash-linear-attention's conventions by default: q scaled by 1/√d).
struct DeltaOptions {
    Index chunk_size = 16;        ///< tokens per chunk (chunked form; bench/linear_attention_bench.cpp)
    std::optional<double> scale = std::nullopt;  ///< q's scale (FLA's `scale`); unset: 1/√d
    /// Divide q and k by √(Σx² + l2norm_eps) first (FLA's `use_qk_l2norm_in_kernel`; a
    /// zero key stays zero).
    bool qk_l2norm = false;
    double l2norm_eps = 1e-6;  ///< ε of qk_l2norm
    /// β ∈ [0, 2] instead of [0, 1] (flash-linear-attention's `allow_neg_eigval`, Grazzi et
    /// al. 2025): for a unit key, I − β kᵀk then has the eigenvalue 1 − β down to −1.
    bool allow_negative_eigenvalues = false;
};

namespace detail {

/// T: the scalar the call computes in; E the inputs', B beta's and G the log-gates' (E or T).
template <class T, class E, class B, class G>
void check_delta_arguments(const char* function, const ConstMatrixRef<E>& q, const ConstMatrixRef<E>& k,
                           const ConstMatrixRef<E>& v, const ConstMatrixRef<B>& beta, const ConstMatrixRef<G>* gates,
                           Shape o, const DeltaOptions& options, const LinearState<T>* state) {
    require(options.chunk_size > 0, function, "options.chunk_size", "is ", options.chunk_size, ", expected > 0");
    check_query_key_options<T>(function, options.scale, options.l2norm_eps);
    require(k.rows() == q.rows() && k.cols() == q.cols(), function, "K", "has shape ", shape(k),
            ", expected the shape of Q (", shape(q), ")");
    require(v.rows() == q.rows(), function, "V", "has shape ", shape(v), ", expected ", q.rows(), " rows as Q (",
            shape(q), ")");
    require(o.rows == q.rows() && o.cols == v.cols(), function, "O", "has shape ", o, ", expected ", q.rows(), 'x',
            v.cols(), " (Q is ", shape(q), ", V is ", shape(v), ")");
    require(beta.rows() == q.rows() && beta.cols() == 1, function, "beta", "has shape ", shape(beta), ", expected ",
            q.rows(), "x1");
    const T beta_max = options.allow_negative_eigenvalues ? T(2) : T(1);
    const auto betas = beta.template cast<T>().array();
    const bool betas_good = beta.size() == 0 || ((betas >= T(0)).all() && (betas <= beta_max).all());
    for (Index i = 0; !betas_good && i < beta.rows(); ++i) {
        const T x = static_cast<T>(beta(i, 0));
        require(x >= 0 && x <= beta_max, function, "beta", "has ", x, " at row ", i, ", expected a value in [0, ",
                beta_max, options.allow_negative_eigenvalues ? "] (options.allow_negative_eigenvalues)" : "]");
    }
    if (gates != nullptr) {
        require(gates->rows() == q.rows() && (gates->cols() == 1 || gates->cols() == q.cols()), function,
                "log_gates", "has shape ", shape(*gates), ", expected ", q.rows(), "x1 (a gate per token) or ",
                q.rows(), 'x', q.cols(), " (a gate per key channel: KDA)");
        // A vectorised test first (no NaN, none above 0); the element by element search
        // for the message only if it fails.
        const bool all_good =
            gates->size() == 0 || gates->template cast<T>().template maxCoeff<Eigen::PropagateNaN>() <= T(0);
        for (Index i = 0; !all_good && i < gates->rows(); ++i)
            for (Index c = 0; c < gates->cols(); ++c) {
                const T x = static_cast<T>((*gates)(i, c));
                if (gates->cols() == 1)
                    require(x <= 0, function, "log_gates", "has ", x, " at row ", i,
                            ", expected a log-gate <= 0 (a gate in [0, 1]; -inf resets the state)");
                else
                    require(x <= 0, function, "log_gates", "has ", x, " at (", i, ", ", c,
                            "), expected a log-gate <= 0 (a gate in [0, 1]; -inf resets the channel)");
            }
    }
    if (state != nullptr && state->mu.size() != 0)
        require(state->mu.rows() == q.cols() && state->mu.cols() == v.cols(), function, "state->mu", "has shape ",
                shape(state->mu), ", expected ", q.cols(), 'x', v.cols(), " (key dim x value dim)");
}

/// Every check of a delta-rule or KDA call on its views: the arguments, then O and the
/// state apart from every input, and O from the state (require_apart).
template <class T, class E, class B, class G, class Out>
void check_delta_call(const char* function, const ConstMatrixRef<E>& q, const ConstMatrixRef<E>& k,
                      const ConstMatrixRef<E>& v, const ConstMatrixRef<B>& beta, const ConstMatrixRef<G>* gates,
                      const MatrixRef<Out>& o, const DeltaOptions& options, const LinearState<T>* state) {
    check_delta_arguments<T>(function, q, k, v, beta, gates, shape(o), options, state);
    require_apart(function, o, state, Named{"Q", q}, Named{"K", k}, Named{"V", v}, Named{"beta", beta});
    if (gates != nullptr)
        require_apart(function, o, state, Named{"log_gates", *gates});
}

/// The query factor of a delta-rule or KDA call in T over d-wide queries.
template <class T>
QueryFactor<T> query_factor(const DeltaOptions& options, Index d) {
    return {static_cast<T>(resolved_scale(options.scale, d)), options.qk_l2norm, static_cast<T>(options.l2norm_eps)};
}

/// Keys [t0, t0 + c), L2-normalised with qk_l2norm, into `out`.
template <class T, class Out>
void delta_keys(const ConstMatrixRef<T>& K, Index t0, Index c, const DeltaOptions& options, Out& out) {
    out = K.middleRows(t0, c);
    if (options.qk_l2norm)
        l2_normalise_rows(out, static_cast<T>(options.l2norm_eps));
}

/// Query rows a delta_token step reads in its pass (more: a tile product after it).
inline constexpr Index delta_token_queries = 4;

/// A decay factor that resets its row of S to exactly +0 (a log-gate of −∞), whatever
/// the row holds: −0, which no e^x is (an e^x that underflows to +0 multiplies, as the
/// chunked form's does).
template <class T>
[[nodiscard]] inline bool delta_reset(T factor) noexcept {
    return factor == T(0) && std::signbit(factor);
}

/// A packet of S's update stored: Stream, past the cache where the packet is a whole
/// aligned 64-byte line of floats or doubles (AVX-512 builds: a 32-byte AVX packet is
/// half a line, whose streaming costs partial writes) — a state written now and read
/// later, as a speculative step's draft states (its lines not read for ownership, the
/// cache's not evicted); else an ordinary store.
template <bool Stream, class P, class T>
inline void delta_store(T* to, const P& s) {
    if constexpr (Stream && !std::is_same_v<P, T>) {
        [[maybe_unused]] constexpr int lanes = Eigen::internal::unpacket_traits<P>::size;
        [[maybe_unused]] constexpr bool is_float = std::is_same_v<T, float>;
        [[maybe_unused]] constexpr bool is_double = std::is_same_v<T, double>;
        [[maybe_unused]] const auto aligned = [to](std::uintptr_t bytes) {
            return (reinterpret_cast<std::uintptr_t>(to) & (bytes - 1)) == 0;
        };
#if defined(__AVX512F__)
        if constexpr (is_float && lanes == 16) {
            if (aligned(64))
                return _mm512_stream_ps(to, s);
        } else if constexpr (is_double && lanes == 8) {
            if (aligned(64))
                return _mm512_stream_pd(to, s);
        }
#endif
    }
    Eigen::internal::pstoreu(to, s);
}

/// One panel of delta_token: the columns of S (read from src: S itself, or another state
/// of its shape), v and out from their pointers on, Packets packets of P wide; G queries;
/// Decayed: decay given; Stream: S stored past the cache (delta_store). Each row's factor, key and query
/// coefficients are read once, before its packets (S's stores could alias them, and
/// reading them per packet cost 10–15% of a step).
template <class P, int Packets, int G, bool Decayed, bool Stream, class T>
inline void delta_panel(T* S, const T* src, Index d, Index dv, const T* k, T beta, const T* v, const T* decay,
                        const T* q, Index ldq, T* out, Index ldo) {
    using namespace Eigen::internal;
    constexpr int lanes = unpacket_traits<P>::size;
    const auto row = [&](Index i, int p, T factor) -> P {  // row i of Diag(decay) src, packet p
        const P s = ploadu<P>(src + i * dv + p * lanes);
        if constexpr (Decayed) {
            if (factor != T(1))
                return delta_reset(factor) ? pset1<P>(T(0)) : pmul(pset1<P>(factor), s);
        }
        return s;
    };
    P acc[Packets];
    for (int p = 0; p < Packets; ++p)
        acc[p] = pset1<P>(T(0));
    for (Index i = 0; i < d; ++i) {  // k S: the panel's rows, from memory
        const T factor = Decayed ? decay[i] : T(1);
        const P ki = pset1<P>(k[i]);
        for (int p = 0; p < Packets; ++p)
            acc[p] = pmadd(ki, row(i, p, factor), acc[p]);
    }
    P u[Packets];
    for (int p = 0; p < Packets; ++p)
        u[p] = pmul(pset1<P>(beta), psub(ploadu<P>(v + p * lanes), acc[p]));
    P o[G > 0 ? G : 1][Packets];
    for (int m = 0; m < G; ++m)
        for (int p = 0; p < Packets; ++p)
            o[m][p] = pset1<P>(T(0));
    for (Index i = 0; i < d; ++i) {  // S ← S + kᵀ u and q S: the panel again, from the cache
        const T factor = Decayed ? decay[i] : T(1);
        const P ki = pset1<P>(k[i]);
        P qi[G > 0 ? G : 1];
        for (int m = 0; m < G; ++m)
            qi[m] = pset1<P>(q[m * ldq + i]);
        for (int p = 0; p < Packets; ++p) {
            const P s = pmadd(ki, u[p], row(i, p, factor));
            delta_store<Stream>(S + i * dv + p * lanes, s);
            for (int m = 0; m < G; ++m)
                o[m][p] = pmadd(qi[m], s, o[m][p]);
        }
    }
    for (int m = 0; m < G; ++m)
        for (int p = 0; p < Packets; ++p)
            pstoreu(out + m * ldo + p * lanes, o[m][p]);
}

/// One token of the delta rule on S (d × dv, row-major), in one pass over S's memory:
///   S ← Diag(decay) S   (decay: d factors, delta_reset's −0 a reset of the row; null: none)
///   u = β (v − k S),  S ← S + kᵀ u,
///   out_m = q_m S       for the g query rows q_m (stride ldq) into the rows of out
///                       (stride ldo), from the updated S.
/// By panels of columns (d rows of four packets: 32 KiB at d = 128 in AVX-512 floats,
/// in L1 where it has 48 KiB, else in L2): each column's k S down the panel's rows from
/// memory, then its update and q S from the cache. Every column's k S and q S is a chain
/// of FMAs down the rows, as the register-blocked tile product's
/// (detail/tile_product.hpp), so out is attend_group's on the updated S, bit for bit: a
/// decode step fused or as an update then an attend gives the same numbers. More than
/// delta_token_queries queries: the update, then their tile product (the same bits).
/// src: the state before the token, read (S itself, or another d × dv state that S does
/// not overlap: S is then src's update, in the same pass, the same numbers). stream: S
/// stored past the cache where it can (delta_store: a state read later, not at once; not
/// with more queries than one pass takes, whose product reads S back at once); the
/// caller fences them (stream_fence) before another thread reads S.
template <class T>
void delta_token_from(T* S, const T* src, Index d, Index dv, const T* k, T beta, const T* v, const T* decay,
                      const T* q, Index ldq, Index g, T* out, Index ldo, bool stream = false) {
    MEMATTN_DASSERT(g >= 0);
    if (g > delta_token_queries) {
        delta_token_from(S, src, d, dv, k, beta, v, decay, q, ldq, 0, out, ldo, false);  // (read back at once)
        tile_product<T>(g, dv, d, q, ldq, 1, S, dv, out, ldo, nullptr);
        return;
    }
    using P = Packet<T>;
    constexpr Index lanes = packet_lanes<T>;
    constexpr int packets = 4;
    const auto columns = [&]<int G, bool Decayed>() {
        const auto output = [&](Index j) { return G > 0 ? out + j : out; };  // (none without queries)
        Index j = 0;
        for (; j + packets * lanes <= dv; j += packets * lanes)
            if (stream)  // (the whole panels: the few columns after them stored as usual)
                delta_panel<P, packets, G, Decayed, true>(S + j, src + j, d, dv, k, beta, v + j, decay, q, ldq,
                                                          output(j), ldo);
            else
                delta_panel<P, packets, G, Decayed, false>(S + j, src + j, d, dv, k, beta, v + j, decay, q, ldq,
                                                           output(j), ldo);
        if (const Index left = (dv - j) / lanes; left > 0) {
            dispatch<packets - 1>(left, [&]<int L>() {
                delta_panel<P, L, G, Decayed, false>(S + j, src + j, d, dv, k, beta, v + j, decay, q, ldq, output(j),
                                                     ldo);
            });
            j += left * lanes;
        }
        if constexpr (lanes > 1)
            for (; j < dv; ++j)
                delta_panel<T, 1, G, Decayed, false>(S + j, src + j, d, dv, k, beta, v + j, decay, q, ldq, output(j),
                                                     ldo);
    };
    const auto queries = [&]<bool Decayed>() {
        if (g == 0)
            columns.template operator()<0, Decayed>();
        else
            dispatch<delta_token_queries>(g, [&]<int G>() { columns.template operator()<G, Decayed>(); });
    };
    if (decay != nullptr)
        queries.template operator()<true>();
    else
        queries.template operator()<false>();
}

/// delta_token_from on S in place.
template <class T>
void delta_token(T* S, Index d, Index dv, const T* k, T beta, const T* v, const T* decay, const T* q, Index ldq,
                 Index g, T* out, Index ldo) {
    delta_token_from(S, static_cast<const T*>(S), d, dv, k, beta, v, decay, q, ldq, g, out, ldo);
}

/// The decay factors of a token's log-gates for delta_token: one log-gate for every row
/// (the gated delta rule) or one per row (KDA); e^x, −0 for −∞ (a reset: delta_reset), 1
/// for 0.
template <class T, class Gates>
void delta_decay_factors(const Gates& log_gates, Index d, T* factors) {
    const auto factor = [](T x) {
        return x == -std::numeric_limits<T>::infinity() ? -T(0) : x == T(0) ? T(1) : static_cast<T>(std::exp(x));
    };
    if (log_gates.size() > 1) {
        for (Index r = 0; r < d; ++r)
            factors[r] = factor(log_gates(r));
    } else {
        std::fill(factors, factors + d, factor(log_gates(0)));
    }
}

template <class T>
void delta_recurrent(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                     const ConstMatrixRef<T>& beta, const ConstMatrixRef<T>* gates, MatrixRef<T> O,
                     const DeltaOptions& options, Matrix<T>& S) {
    const QueryFactor<T> factor = query_factor<T>(options, Q.cols());
    const Index d = S.rows(), dv = S.cols();
    Matrix<T> k(1, K.cols());
    Vector<T> decay(gates != nullptr ? d : 0);
    for (Index i = 0; i < Q.rows(); ++i) {
        delta_keys(K, i, 1, options, k);
        if (gates != nullptr)  // S ← g S, or KDA's S ← Diag(α) S; −∞ resets
            delta_decay_factors(gates->row(i), d, decay.data());
        delta_token(S.data(), d, dv, k.data(), beta(i, 0), V.row(i).data(), gates != nullptr ? decay.data() : nullptr,
                    Q.row(i).data(), 0, 1, O.row(i).data(), 0);
        if (factor.active())
            O.row(i) *= factor(Q.row(i).data(), Q.cols());
    }
}

/// The largest span of a chunk's summed log-gates (in any channel) for which KDA's pairs
/// factor as (x ⊙ e^{b_t})·(k ⊙ e^{−b_s}): e^{±40} keeps both factors of a float far
/// from overflow and from the subnormals (e^{±400} for a double).
template <class T>
inline constexpr T kda_pair_range = sizeof(T) == 4 ? T(40) : T(400);

/// KDA by chunks (the gated delta rule with a log-gate per key channel; see the top of
/// the file): per chunk, b_t = Σ_{s≤t} log α_s per channel,
///   (I + L) U = diag(β)(V − (K ⊙ e^{b}) S_0),  L_ts = β_t Σ_r k_tr k_sr e^{b_tr − b_sr} (s < t),
///   O = (Q ⊙ e^{b}) S_0 + A U,  A_ts = Σ_r q_tr k_sr e^{b_tr − b_sr} (s ≤ t),
///   S_C = diag(e^{b_C}) S_0 + (K ⊙ e^{b_C − b})ᵀ U,
/// the pairs by channel_pair (C²·d exponentials per chunk, as channel-gated linear
/// attention) where the chunk's gates span more than kda_pair_range<T> in log, else by
/// two products against K ⊙ e^{−b} (as flash-linear-attention's chunk_kda factors the
/// decay through a reference row); the products by the register-blocked tile product.
template <class T>
void kda_chunked(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                 const ConstMatrixRef<T>& beta, const ConstMatrixRef<T>& G, MatrixRef<T> O, const DeltaOptions& options,
                 Matrix<T>& S) {
    const Index n = Q.rows(), d = Q.cols(), dv = V.cols();
    const Index c_max = std::min<Index>(options.chunk_size, std::max<Index>(n, 1));
    const QueryFactor<T> factor = query_factor<T>(options, d);
    Matrix<T> keys(c_max, d), b(c_max, d), qg(c_max, d), kg(c_max, d), kinv(c_max, d), kt(d, c_max),
        uc_all(c_max, dv), l_all(c_max, c_max), a_all(c_max, c_max);
    Vector<T> last(d);
    const ExpNonpositiveOp<T> exp;
    constexpr T minus_infinity = -std::numeric_limits<T>::infinity();
    for (Index t0 = 0, c = 0; t0 < n; t0 += c) {
        c = chunk_before_reset(G, t0, std::min(c_max, n - t0));  // a reset starts the next chunk
        auto kc = keys.topRows(c);
        delta_keys(K, t0, c, options, kc);
        const auto q = Q.middleRows(t0, c);
        auto bc = b.topRows(c);
        bc.row(0) = G.row(t0);
        for (Index r = 0; r < d; ++r)
            if (bc(0, r) == minus_infinity) {  // a reset at the chunk's first token: its row of S is 0, its gate 1
                S.row(r).setZero();
                bc(0, r) = T(0);
            }
        for (Index t = 1; t < c; ++t)
            bc.row(t) = bc.row(t - 1) + G.row(t0 + t);
        // Where the chunk's gates span at most kda_pair_range (every channel), e^{b_t − b_s}
        // = e^{b_t} e^{−b_s} with neither factor out of range: the pairs are then products
        // of C rows against K ⊙ e^{−b}, and the fold's K ⊙ e^{b_C − b} is that times e^{b_C},
        // so the chunk takes C·d exponentials where the pairs alone took C²·d/2.
        const bool factored = -bc.row(c - 1).minCoeff() <= kda_pair_range<T>;
        auto qc = qg.topRows(c), kd = kg.topRows(c), ki = kinv.topRows(c);
        for (Index t = 0; t < c; ++t) {  // row by row, so that Eigen vectorises the exponentials
            last = bc.row(t).array().unaryExpr(exp);  // e^{b_t}, for both
            qc.row(t) = q.row(t).array() * last.array();
            kd.row(t) = kc.row(t).array() * last.array();
            if (factored)
                ki.row(t) = kc.row(t).array() / last.array();
        }
        // RHS = diag(β)(V − (K ⊙ e^b) S_0) and O = (Q ⊙ e^b) S_0.
        auto uc = uc_all.topRows(c);
        auto o = O.middleRows(t0, c);
        tile_product<T>(c, dv, d, kd.data(), kd.outerStride(), 1, S.data(), S.outerStride(), uc.data(),
                        uc.outerStride(), nullptr);
        tile_product<T>(c, dv, d, qc.data(), qc.outerStride(), 1, S.data(), S.outerStride(), o.data(), o.outerStride(),
                        nullptr);
        uc = (V.middleRows(t0, c) - uc).array().colwise() * beta.middleRows(t0, c).col(0).array();
        // −L (the substitution adds) and A, zero above their triangles.
        auto l = l_all.topLeftCorner(c, c);
        auto a = a_all.topLeftCorner(c, c);
        if (factored) {  // L = (K ⊙ e^{b})(K ⊙ e^{−b})ᵀ, A = (Q ⊙ e^{b})(K ⊙ e^{−b})ᵀ
            transpose(ki.data(), c, d, ki.outerStride(), kt.data(), kt.outerStride());
            tile_product<T>(c, c, d, kd.data(), kd.outerStride(), 1, kt.data(), kt.outerStride(), l.data(),
                            l.outerStride(), nullptr, LowerColumns{-1});
            tile_product<T>(c, c, d, qc.data(), qc.outerStride(), 1, kt.data(), kt.outerStride(), a.data(),
                            a.outerStride(), nullptr, LowerColumns{0});
            for (Index t = 0; t < c; ++t) {
                l.row(t).head(t) *= -beta(t0 + t, 0);
                a.row(t).tail(c - 1 - t).setZero();
            }
        } else {
            for (Index t = 0; t < c; ++t) {
                const T minus_beta = -beta(t0 + t, 0);
                for (Index s2 = 0; s2 < t; ++s2) {  // one exponential per channel for both
                    T lk, qk;
                    channel_pairs(kc.row(t).data(), kc.row(s2).data(), q.row(t).data(), kc.row(s2).data(),
                                  &bc(t, 0), &bc(s2, 0), d, lk, qk);
                    l(t, s2) = minus_beta * lk;
                    a(t, s2) = qk;
                }
                a(t, t) = q.row(t).dot(kc.row(t));  // e^{b_t − b_t} = 1
                a.row(t).tail(c - 1 - t).setZero();
            }
        }
        forward_substitution<T>(c, dv, l.data(), l.outerStride(), uc.data(), uc.outerStride());  // U = (I + L)⁻¹ RHS
        tile_product<T, DefaultBlocking, true>(c, dv, c, a.data(), a.outerStride(), 1, uc.data(), uc.outerStride(),
                                               o.data(), o.outerStride(), nullptr, LowerTerms{0});
        // S = diag(e^{b_C}) S_0 + (K ⊙ e^{b_C − b})ᵀ U, the decay as the product's row scale.
        last = bc.row(c - 1).array().unaryExpr(exp);
        for (Index t = 0; t < c; ++t)
            if (factored)
                kd.row(t) = ki.row(t).array() * last.array();
            else
                kd.row(t) = kc.row(t).array() * (bc.row(c - 1) - bc.row(t)).array().unaryExpr(exp);
        tile_product<T, FoldBlocking>(d, dv, c, kd.data(), 1, kd.outerStride(), uc.data(), uc.outerStride(), S.data(),
                                      S.outerStride(), last.data());
        scale_by_queries(factor, q, o);
    }
}

template <class T>
void delta_chunked(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                   const ConstMatrixRef<T>& beta, const ConstMatrixRef<T>* gates, MatrixRef<T> O,
                   const DeltaOptions& options, Matrix<T>& S) {
    if (gates != nullptr && gates->cols() > 1) {
        kda_chunked(Q, K, V, beta, *gates, O, options, S);
        return;
    }
    const Index n = Q.rows(), d = Q.cols(), dv = V.cols();
    const Index c_max = std::min<Index>(options.chunk_size, std::max<Index>(n, 1));
    // Keys are read in place unless they are normalised or decayed (a copy in `keys`);
    // queries always are (their factor multiplies the outputs).
    const QueryFactor<T> factor = query_factor<T>(options, d);
    const bool copy_keys = options.qk_l2norm || gates != nullptr;
    Matrix<T> keys(copy_keys ? c_max : 0, d), ks(c_max, dv), kk(c_max, c_max), qk(c_max, c_max), kt(d, c_max);
    // The next chunk's lines spread over this chunk's strips: those of K S_0 and Q S_0 (in
    // column panels), of Kᵀ U and of the three C-row products.
    const Index rows = DefaultBlocking::rows, strips_c = (c_max + rows - 1) / rows;
    const Index panels = (d * dv * static_cast<Index>(sizeof(T)) + panel_bytes - 1) / panel_bytes;
    const Index lines = c_max * (2 * d + 2 * dv) * static_cast<Index>(sizeof(T)) / 64;
    PrefetchQueue ahead(lines / (2 * strips_c * std::max<Index>(panels, 1) + (d + rows - 1) / rows + 3 * strips_c) + 1);
    ColumnVector<T> b(c_max), decays(gates != nullptr ? c_max : 0), state_decay(gates != nullptr ? d : 0);
    for (Index t0 = 0, c = 0; t0 < n; t0 += c) {
        c = std::min(c_max, n - t0);
        if (gates != nullptr)
            c = chunk_before_reset(*gates, t0, c);  // a reset starts the next chunk
        queue_next_chunk(ahead, t0 + c, std::min(c_max, n - t0 - c), Q, K, V, O);
        const T* kc = K.data() + t0 * K.outerStride();
        Index ldk = K.outerStride();
        if (copy_keys) {
            auto kn = keys.topRows(c);
            delta_keys(K, t0, c, options, kn);
            kc = keys.data();
            ldk = keys.outerStride();
        }
        const T* q = Q.data() + t0 * Q.outerStride();
        const Index ldq = Q.outerStride();
        auto bc = b.head(c);  // b_t, the log-decay since the chunk's start (gated only)
        if (gates != nullptr) {
            bc(0) = (*gates)(t0, 0);
            if (bc(0) == -std::numeric_limits<T>::infinity()) {  // a reset at the chunk's first token
                S.setZero();
                bc(0) = T(0);
            }
            for (Index t = 1; t < c; ++t)
                bc(t) = bc(t - 1) + (*gates)(t0 + t, 0);
        }
        // K S_0 and Q S_0 (straight into O); RHS = diag(β)(V − diag(γ) K S_0), then
        // (I + L) U = RHS. The three d·dv-sized products go through the register-blocked
        // tile product (Eigen's GEMM packs its operands first, which costs more than it
        // saves here).
        auto uc = ks.topRows(c);
        auto o = O.middleRows(t0, c);
        tile_product<T>(c, dv, d, kc, ldk, 1, S.data(), S.outerStride(), uc.data(), uc.outerStride(), nullptr, {},
                        &ahead);
        tile_product<T>(c, dv, d, q, ldq, 1, S.data(), S.outerStride(), o.data(), o.outerStride(), nullptr, {},
                        &ahead);
        if (gates != nullptr) {
            auto gamma = decays.head(c);  // γ_t
            gamma = bc.array().exp();
            uc = (V.middleRows(t0, c).array() - uc.array().colwise() * gamma.array()).colwise() *
                 beta.middleRows(t0, c).col(0).array();
        } else {
            uc = (V.middleRows(t0, c) - uc).array().colwise() * beta.middleRows(t0, c).col(0).array();
        }
        // K Kᵀ (strictly below the diagonal) and Q Kᵀ (on and below it) against Kᵀ
        // transposed once (the right operand, row-major); the strips skip the packets of
        // columns wholly above their rows.
        transpose(kc, c, d, ldk, kt.data(), c_max);
        auto l = kk.topLeftCorner(c, c);
        tile_product<T>(c, c, d, kc, ldk, 1, kt.data(), c_max, l.data(), l.outerStride(), nullptr,
                        LowerColumns{-1}, &ahead);
        auto a = qk.topLeftCorner(c, c);
        tile_product<T>(c, c, d, q, ldq, 1, kt.data(), c_max, a.data(), a.outerStride(), nullptr,
                        LowerColumns{0}, &ahead);
        // −L (the substitution adds) and A, decayed; A is zero above the diagonal.
        for (Index t = 0; t < c; ++t) {
            const T minus_beta = -beta(t0 + t, 0);
            if (gates != nullptr) {
                for (Index s2 = 0; s2 < t; ++s2) {
                    const T decay = std::exp(bc(t) - bc(s2));
                    l(t, s2) *= minus_beta * decay;
                    a(t, s2) *= decay;
                }
            } else {
                for (Index s2 = 0; s2 < t; ++s2)
                    l(t, s2) *= minus_beta;
            }
            a.row(t).tail(c - 1 - t).setZero();
        }
        forward_substitution<T>(c, dv, l.data(), l.outerStride(), uc.data(), uc.outerStride());  // U = (I + L)⁻¹ RHS
        // O = diag(γ) Q S_0 + A U;  S = γ_C S_0 + (K ⊙ e^{b_C − b})ᵀ U: the decays of Q S_0
        // and S_0 are the products' row scales. A is lower-triangular: row t adds the terms
        // s ≤ t only. Kᵀ is read in place: A(r, s) = kc(s, r), strides (1, ldk).
        if (gates != nullptr) {
            tile_product<T>(c, dv, c, a.data(), a.outerStride(), 1, uc.data(), uc.outerStride(), o.data(),
                            o.outerStride(), decays.data(), LowerTerms{0}, &ahead);
            auto kn = keys.topRows(c);
            kn = kn.array().colwise() * (bc(c - 1) - bc.array()).exp();
            state_decay.setConstant(std::exp(bc(c - 1)));
            tile_product<T, FoldBlocking>(d, dv, c, kc, 1, ldk, uc.data(), uc.outerStride(), S.data(),
                                          S.outerStride(), state_decay.data(), {}, &ahead);
        } else {
            tile_product<T, DefaultBlocking, true>(c, dv, c, a.data(), a.outerStride(), 1, uc.data(),
                                                   uc.outerStride(), o.data(), o.outerStride(), nullptr,
                                                   LowerTerms{0}, &ahead);
            tile_product_add<T, FoldBlocking>(d, dv, c, kc, 1, ldk, uc.data(), uc.outerStride(), S.data(),
                                              S.outerStride(), &ahead);
        }
        scale_by_queries(factor, Q.middleRows(t0, c), o);
    }
}

enum class DeltaForm { recurrent, chunked };

/// Q, K and V of bfloat16 or float16 (beta and log_gates of that type or float, O of that
/// type or float, the state float) run the same form in float, span by span
/// (detail/float_spans.hpp).
template <DeltaForm form, class DQ, class DK, class DV, class DB, class G, class DO>
void delta_rule_attention(const char* function, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                          const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DB>& beta,
                          const ConstMatrixRef<G>* gates, DO&& O, const DeltaOptions& options,
                          LinearState<arithmetic_t<typename DQ::Scalar>>* state, ExecutorRef executor = {}) {
    using E = typename DQ::Scalar;
    using T = arithmetic_t<E>;
    using Bt = typename DB::Scalar;
    using Out = typename std::remove_cvref_t<DO>::Scalar;
    static_assert(Scalar<E> || LowPrecision<E>,
                  "memattn delta rule attention works on float, double, Eigen::bfloat16 or Eigen::half matrices.");
    static_assert(same_scalar<DQ, DK, DV>, "memattn delta rule attention: Q, K and V must share one scalar type.");
    static_assert((std::is_same_v<Bt, E> || std::is_same_v<Bt, T>) && (std::is_same_v<G, E> || std::is_same_v<G, T>),
                  "memattn delta rule attention: beta and log_gates must have the scalar type of Q (of bfloat16 or "
                  "half: or float).");
    static_assert(std::is_same_v<Out, E> || std::is_same_v<Out, T>,
                  "memattn delta rule attention: O must have the scalar type of Q (of bfloat16 or half: or float).");
    const ConstMatrixRef<E> q = sequence(Q), k = sequence(K), v = sequence(V);
    const ConstMatrixRef<Bt> b = sequence(beta);
    MatrixRef<Out> o = output(std::forward<DO>(O));
    check_delta_call<T>(function, q, k, v, b, gates, o, options, state);
    LinearState<T> local;
    LinearState<T>& s = state != nullptr ? *state : local;
    if (s.mu.size() == 0)
        s.mu.setZero(q.cols(), v.cols());
    const auto run = [&](const ConstMatrixRef<T>& qs, const ConstMatrixRef<T>& ks, const ConstMatrixRef<T>& vs,
                         const ConstMatrixRef<T>& bs, const ConstMatrixRef<T>* gs, MatrixRef<T> os) {
        if constexpr (form == DeltaForm::chunked && !LowPrecision<E>)  // the value columns over the threads
            by_value_columns<T>(vs, os, s.mu, executor,
                                [&](const ConstMatrixRef<T>& vc, MatrixRef<T> oc, Matrix<T>& sc) {
                                    delta_chunked(qs, ks, vc, bs, gs, oc, options, sc);
                                });
        else if constexpr (form == DeltaForm::chunked)
            delta_chunked(qs, ks, vs, bs, gs, os, options, s.mu);
        else
            delta_recurrent(qs, ks, vs, bs, gs, os, options, s.mu);
    };
    if constexpr (LowPrecision<E>) {
        FloatSpans spans;
        spans.each(q.rows(), options.chunk_size, o, [&](Index r0, Index m, MatrixRef<T> os) {
            std::optional<ConstMatrixRef<T>> gs;
            if (gates != nullptr)
                gs.emplace(spans.rows(4, *gates, r0, m));
            run(spans.rows(0, q, r0, m), spans.rows(1, k, r0, m), spans.rows(2, v, r0, m), spans.rows(3, b, r0, m),
                gs ? &*gs : nullptr, os);
        });
    } else {
        run(q, k, v, b, gates, o);
    }
}

}  // namespace detail

/// The delta rule token by token (see the top of the file). `beta`: N×1 in [0, 1] ([0, 2] with options.allow_negative_eigenvalues).
/// `state`: initial S in state->mu (empty = zero), final S out.
template <class DQ, class DK, class DV, class DB, detail::EigenMatrix DO>
void recurrent_delta_rule_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DB>& beta, DO&& O,
                                    const DeltaOptions& options = {},
                                    LinearState<arithmetic_t<typename DQ::Scalar>>* state = nullptr) {
    detail::delta_rule_attention<detail::DeltaForm::recurrent>(
        "recurrent_delta_rule_attention", Q, K, V, beta,
        static_cast<const ConstMatrixRef<arithmetic_t<typename DQ::Scalar>>*>(nullptr), std::forward<DO>(O), options,
        state);
}

/// The gated delta rule token by token: `log_gates` N×1 (Gated DeltaNet) or N×d (a gate
/// per key channel: KDA), ≤ 0 (−∞: a reset).
template <class DQ, class DK, class DV, class DB, class DG, detail::EigenMatrix DO>
void recurrent_delta_rule_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DB>& beta,
                                    const Eigen::MatrixBase<DG>& log_gates, DO&& O, const DeltaOptions& options = {},
                                    LinearState<arithmetic_t<typename DQ::Scalar>>* state = nullptr) {
    using G = typename DG::Scalar;
    static_assert(std::is_same_v<G, typename DQ::Scalar> || std::is_same_v<G, arithmetic_t<typename DQ::Scalar>>,
                  "memattn: log_gates must have the scalar type of Q (of bfloat16 or half: or float).");
    const ConstMatrixRef<G> g = detail::sequence(log_gates);
    detail::delta_rule_attention<detail::DeltaForm::recurrent>("recurrent_delta_rule_attention", Q, K, V, beta, &g,
                                                               std::forward<DO>(O), options, state);
}

/// The same outputs and final state by chunks of options.chunk_size tokens (WY form).
/// From 1024 tokens on, the value columns go in parts over `executor`'s threads, each
/// part the whole sequence (detail::ValueColumns): bitwise the same outputs and state
/// for any thread count (float and double inputs; 16-bit ones run on one thread).
template <class DQ, class DK, class DV, class DB, detail::EigenMatrix DO>
void chunked_delta_rule_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                  const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DB>& beta, DO&& O,
                                  const DeltaOptions& options = {},
                                  LinearState<arithmetic_t<typename DQ::Scalar>>* state = nullptr,
                                  ExecutorRef executor = {}) {
    detail::delta_rule_attention<detail::DeltaForm::chunked>(
        "chunked_delta_rule_attention", Q, K, V, beta,
        static_cast<const ConstMatrixRef<arithmetic_t<typename DQ::Scalar>>*>(nullptr), std::forward<DO>(O), options,
        state, executor);
}

/// The gated delta rule by chunks: `log_gates` N×1 or N×d (KDA), ≤ 0 (−∞: a reset).
template <class DQ, class DK, class DV, class DB, class DG, detail::EigenMatrix DO>
void chunked_delta_rule_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                  const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DB>& beta,
                                  const Eigen::MatrixBase<DG>& log_gates, DO&& O, const DeltaOptions& options = {},
                                  LinearState<arithmetic_t<typename DQ::Scalar>>* state = nullptr,
                                  ExecutorRef executor = {}) {
    using G = typename DG::Scalar;
    static_assert(std::is_same_v<G, typename DQ::Scalar> || std::is_same_v<G, arithmetic_t<typename DQ::Scalar>>,
                  "memattn: log_gates must have the scalar type of Q (of bfloat16 or half: or float).");
    const ConstMatrixRef<G> g = detail::sequence(log_gates);
    detail::delta_rule_attention<detail::DeltaForm::chunked>("chunked_delta_rule_attention", Q, K, V, beta, &g,
                                                             std::forward<DO>(O), options, state, executor);
}

namespace detail {
/// KDA's log-gates are one per key channel (K's shape checked against Q's first, so a
/// wrong K is named as such).
template <class DQ, class DK, class DG>
void check_kda_gates(const char* function, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                     const Eigen::MatrixBase<DG>& log_gates) {
    require(K.rows() == Q.rows() && K.cols() == Q.cols(), function, "K", "has shape ", shape(K),
            ", expected the shape of Q (", shape(Q), ")");
    require(log_gates.rows() == K.rows() && log_gates.cols() == K.cols(), function, "log_gates", "has shape ",
            shape(log_gates), ", expected ", K.rows(), 'x', K.cols(), " (a log-gate per key channel; the gated delta ",
            "rule's chunked_delta_rule_attention takes one per token)");
}
}  // namespace detail

/// KDA (Kimi Delta Attention; Kimi Team 2025) token by token: the delta rule with a gate
/// per key channel, S_t = (I − β_t k_tᵀ k_t) Diag(α_t) S_{t−1} + β_t k_tᵀ v_t, o_t = q_t S_t,
/// `log_gates` = log α: N×d, ≤ 0 (−∞ resets the channel's row of S). The gated delta
/// rule's overload with N×d log-gates, by this name (docs/design.md §4.2b).
template <class DQ, class DK, class DV, class DB, class DG, detail::EigenMatrix DO>
void recurrent_kda_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                             const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DB>& beta,
                             const Eigen::MatrixBase<DG>& log_gates, DO&& O, const DeltaOptions& options = {},
                             LinearState<arithmetic_t<typename DQ::Scalar>>* state = nullptr) {
    using G = typename DG::Scalar;
    static_assert(std::is_same_v<G, typename DQ::Scalar> || std::is_same_v<G, arithmetic_t<typename DQ::Scalar>>,
                  "memattn: log_gates must have the scalar type of Q (of bfloat16 or half: or float).");
    detail::check_kda_gates("recurrent_kda_attention", Q, K, log_gates);
    const ConstMatrixRef<G> g = detail::sequence(log_gates);
    detail::delta_rule_attention<detail::DeltaForm::recurrent>("recurrent_kda_attention", Q, K, V, beta, &g,
                                                               std::forward<DO>(O), options, state);
}

/// KDA by chunks of options.chunk_size tokens (the WY form with channel decays,
/// detail::kda_chunked): the outputs and final state of recurrent_kda_attention; the
/// value columns over `executor`'s threads as chunked_delta_rule_attention's.
template <class DQ, class DK, class DV, class DB, class DG, detail::EigenMatrix DO>
void chunked_kda_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                           const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DB>& beta,
                           const Eigen::MatrixBase<DG>& log_gates, DO&& O, const DeltaOptions& options = {},
                           LinearState<arithmetic_t<typename DQ::Scalar>>* state = nullptr,
                           ExecutorRef executor = {}) {
    using G = typename DG::Scalar;
    static_assert(std::is_same_v<G, typename DQ::Scalar> || std::is_same_v<G, arithmetic_t<typename DQ::Scalar>>,
                  "memattn: log_gates must have the scalar type of Q (of bfloat16 or half: or float).");
    detail::check_kda_gates("chunked_kda_attention", Q, K, log_gates);
    const ConstMatrixRef<G> g = detail::sequence(log_gates);
    detail::delta_rule_attention<detail::DeltaForm::chunked>("chunked_kda_attention", Q, K, V, beta, &g,
                                                             std::forward<DO>(O), options, state, executor);
}

}  // namespace memattn
