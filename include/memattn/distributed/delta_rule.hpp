#pragma once
// The sequence-parallel delta rule, gated delta rule and KDA
// (distributed_chunked_delta_rule_attention, distributed_chunked_kda_attention;
// distributed/mpi.hpp describes them): each later rank's map P S + B, composed by an
// exclusive scan.

#include "memattn/distributed/collectives.hpp"
#include "memattn/kernels/delta_rule.hpp"

#if defined(__SSE2__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace memattn {

namespace detail::mpi {

/// A shard's summary of the delta rule or KDA, as doubles: [d, dv, absolute, P (d × d),
/// B (d × dv)], both row-major: the shard maps the state before it to P S + B. An
/// absolute summary (rank 0's, which starts from the caller's state) ignores what came
/// before it: B is the state after it, P is not used.
struct DeltaSummary {
    static std::size_t doubles(Index d, Index dv) { return static_cast<std::size_t>(3 + d * d + d * dv); }
};

/// a ∘ b in place of b (a the earlier shards): P = P_b P_a, B = P_b B_a + B_b; b absolute
/// stays as it is, a absolute makes the result absolute.
inline void compose_delta_summaries(void* in, void* inout, int* count, MPI_Datatype* type) {
    using Rows = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    int bytes = 0;
    MPI_Type_size(*type, &bytes);
    const std::size_t doubles = static_cast<std::size_t>(bytes) / sizeof(double);
    for (int e = 0; e < *count; ++e) {
        const double* a = static_cast<const double*>(in) + doubles * static_cast<std::size_t>(e);
        double* b = static_cast<double*>(inout) + doubles * static_cast<std::size_t>(e);
        if (b[2] != 0.0)
            continue;
        const auto d = static_cast<Index>(b[0]), dv = static_cast<Index>(b[1]);
        const Eigen::Map<const Rows> p_a(a + 3, d, d), b_a(a + 3 + d * d, d, dv);
        Eigen::Map<Rows> p_b(b + 3, d, d), b_b(b + 3 + d * d, d, dv);
        b_b.noalias() += p_b * b_a;
        if (a[2] != 0.0) {
            b[2] = 1.0;
            p_b.setZero();
        } else {
            p_b = (p_b * p_a).eval();
        }
    }
}

}  // namespace detail::mpi

namespace detail::mpi {

/// Tokens per piece of a later rank's extended run (distributed delta rule): its buffers
/// hold this many rows of d + dv columns, and the state map P is tested for 0 after each.
inline constexpr Index delta_span = 256;

/// Flushes subnormal results and operands to zero on this thread while it lives (x86's
/// MXCSR FTZ and DAZ bits), then restores the caller's mode. A delta-rule state map P
/// decays towards 0 through the subnormals, where every operation with one costs about
/// 50 times a normal one (measured: a later rank's run 45× slower without this).
class FlushSubnormals {
public:
#if defined(__SSE2__)
    FlushSubnormals() : mode_(_mm_getcsr()) { _mm_setcsr(mode_ | 0x8040u); }
    ~FlushSubnormals() { _mm_setcsr(mode_); }
#else
    FlushSubnormals() = default;
#endif
    FlushSubnormals(const FlushSubnormals&) = delete;
    FlushSubnormals& operator=(const FlushSubnormals&) = delete;

private:
#if defined(__SSE2__)
    unsigned mode_;
#endif
};

/// The distributed delta rule and KDA after the public functions' static checks.
/// `gates`: none (the delta rule), N×1 (the gated delta rule) or N×d (KDA; `kda` makes
/// N×d required). See distributed_chunked_delta_rule_attention.
template <class T>
void delta_shards(MPI_Comm comm, const char* function, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                  const ConstMatrixRef<T>& v, const ConstMatrixRef<T>& beta, const ConstMatrixRef<T>* gates,
                  MatrixRef<T> o, const DeltaOptions& options, LinearState<T>* state, bool kda) {
    const auto ranks = rank_size(comm);
    const int rank = ranks.first;  // not a binding: clang 14 cannot capture one
    const std::string error = local_error([&] {
        if (kda)
            check_kda_gates(function, q, k, *gates);
        // Only rank 0's state is read; every rank's is written.
        check_delta_call<T>(function, q, k, v, beta, gates, o, options, rank == 0 ? state : nullptr);
        // Every rank's state is written: O and the inputs stay apart from it on every rank.
        require_apart(function, o, state, Named{"Q", q}, Named{"K", k}, Named{"V", v}, Named{"beta", beta});
        if (gates != nullptr)
            require_apart(function, o, state, Named{"log_gates", *gates});
        // A later rank keeps n × d rows of q P.
        (void)checked_product(function, "Q", q.rows(), q.cols(), "rows x d");
    });
    const Index d = q.cols(), dv = v.cols(), tokens = q.rows();
    const double gate_kind = gates == nullptr ? 0.0 : gates->cols() == 1 ? 1.0 : 2.0;
    check_collectively(comm, function, error,
                       {{"the key dim d", static_cast<double>(d)},
                        {"the value dim dv", static_cast<double>(dv)},
                        {"the gates (none, one per token, one per key channel)", gate_kind},
                        {"options.chunk_size", static_cast<double>(options.chunk_size)},
                        {"options.scale", options.scale ? *options.scale : -1.0},
                        {"options.qk_l2norm", options.qk_l2norm ? 1.0 : 0.0},
                        {"options.l2norm_eps", options.l2norm_eps},
                        {"options.allow_negative_eigenvalues", options.allow_negative_eigenvalues ? 1.0 : 0.0},
                        {"the scalar size", static_cast<double>(sizeof(T))}});

    // 1. Rank 0 runs its shard from the caller's state: its summary is absolute. A later
    //    rank runs its shard with d more value columns, zero values and the identity as
    //    their starting state: the columns evolve independently, so the dv columns give
    //    the outputs and state from zero (B), the d columns the state map P and each row's
    //    f_t q_t P_t, which takes the carried state's part later. Once P is exactly 0 (a
    //    reset, or gates and keys that have forgotten the state before the shard), the
    //    rest of the shard runs on the dv columns alone, as one process would.
    const std::size_t doubles = DeltaSummary::doubles(d, dv);
    std::vector<double> summary(doubles, 0.0), carried(doubles, 0.0);
    summary[0] = static_cast<double>(d);
    summary[1] = static_cast<double>(dv);
    using Rows = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    Eigen::Map<Rows> p_sum(summary.data() + 3, d, d), b_sum(summary.data() + 3 + d * d, d, dv);
    const auto slice = [&](const ConstMatrixRef<T>* m, Index r0, Index rows) -> std::optional<ConstMatrixRef<T>> {
        if (m == nullptr)
            return std::nullopt;
        return ConstMatrixRef<T>(m->middleRows(r0, rows));
    };
    LinearState<T> own;
    Matrix<T> query_maps;  // later ranks: row t is f_t q_t P_t, for the rows before P is 0
    Index mapped_rows = 0;
    if (rank == 0) {
        if (state != nullptr && state->mu.size() != 0)
            own.mu = state->mu;
        else
            own.mu.setZero(d, dv);
        if (tokens > 0)
            delta_chunked<T>(q, k, v, beta, gates, o, options, own.mu);
        summary[2] = 1.0;
        b_sum = own.mu.template cast<double>();
    } else {
        const FlushSubnormals flush;
        Matrix<T> s(d, dv + d);
        s.leftCols(dv).setZero();
        s.rightCols(d).setIdentity();
        query_maps.resize(tokens, d);  // its pages are touched only as far as P lives
        // Pieces a whole number of chunks long, so the chunks are those of one run.
        const Index span = std::max<Index>(delta_span / options.chunk_size, 1) * options.chunk_size;
        const Index rows = std::min(span, tokens);
        Matrix<T> values(rows, dv + d), outputs(rows, dv + d);
        values.rightCols(d).setZero();
        bool mapped = true;
        for (Index r0 = 0, m = 0; r0 < tokens; r0 += m) {
            m = std::min(span, tokens - r0);
            const auto g = slice(gates, r0, m);
            if (!mapped) {
                delta_chunked<T>(q.middleRows(r0, m), k.middleRows(r0, m), v.middleRows(r0, m),
                                 beta.middleRows(r0, m), g ? &*g : nullptr, o.middleRows(r0, m), options, own.mu);
                continue;
            }
            values.topLeftCorner(m, dv) = v.middleRows(r0, m);
            delta_chunked<T>(q.middleRows(r0, m), k.middleRows(r0, m), values.topRows(m), beta.middleRows(r0, m),
                             g ? &*g : nullptr, outputs.topRows(m), options, s);
            o.middleRows(r0, m) = outputs.topLeftCorner(m, dv);
            query_maps.middleRows(r0, m) = outputs.block(0, dv, m, d);
            mapped_rows = r0 + m;
            if ((s.rightCols(d).array() == T(0)).all()) {
                mapped = false;
                own.mu = s.leftCols(dv);
            }
        }
        if (mapped) {
            p_sum = s.rightCols(d).template cast<double>();
            b_sum = s.leftCols(dv).template cast<double>();
        } else {
            b_sum = own.mu.template cast<double>();  // P = 0: the summary's zeros stay
        }
    }

    // 2. The state before each rank's first token: an exclusive scan in rank order (every
    //    later rank's result is absolute, rank 0's summary being so).
    exscan(comm, summary, carried, &compose_delta_summaries);

    // 3. Later ranks: o_t += (f_t q_t P_t) S_in, and the state after this shard, P S_in + B.
    if (rank > 0) {
        const Eigen::Map<const Rows> s_in(carried.data() + 3 + d * d, d, dv);
        const Matrix<T> s_in_t = s_in.template cast<T>();
        if (mapped_rows > 0)
            o.topRows(mapped_rows).noalias() += query_maps.topRows(mapped_rows) * s_in_t;
        own.mu = (p_sum * s_in + b_sum).template cast<T>();
    }

    // 4. The final state, the last rank's, to every rank that asks (all take part).
    share_final_state(comm, own, d, dv, 0, state);
}

}  // namespace detail::mpi

/// Sequence-parallel delta rule (kernels/delta_rule.hpp): the chunked form over the whole
/// sequence, each rank computing its own shard (contiguous: rank r's tokens follow rank
/// r − 1's; shards of any length, empty ones too). A shard maps the state before it to
/// P S + B (P d × d: the product of its tokens' (I − β kᵀk) and decays; B the state it
/// builds from zero). Rank 0 runs its shard from `state` (its input; empty = zero); every
/// later rank runs its shard at once with d extra value columns (zero values, the
/// identity as their state), which give P and each row's q_t P_t beside the outputs and B
/// from zero; an exclusive scan of the (P, B) in rank order gives each rank the state
/// S_in before its first token, and the later ranks add (q_t P_t) S_in to their rows. The
/// outputs equal the single-process chunked form to rounding. `state`, if given,
/// receives on every rank the state after the whole sequence (mu; nu is not touched).
///
/// Work: a later rank's run carries d + dv value columns where one process carries dv,
/// about twice the work per token at d = dv, plus one product of its rows' q_t P_t with
/// S_in; rank 0's is one pass. Once P is exactly 0 (a reset, or gates that have forgotten
/// the state before the shard; tested every 256 tokens) the rest of the shard runs on
/// the dv columns alone. Without gates, equal shards on P ranks take about the time of
/// 2n/P tokens on one process: give rank 0 about twice the tokens of each other rank.
/// The extended run flushes subnormals to zero (x86 FTZ/DAZ, restored after): P decays
/// through them, 50× slower each, and the results differ from one process only below
/// the smallest normal. Communication: one summary of 3 + d² + d·dv doubles per rank
/// and round of the scan, one broadcast of the final state. Memory: a later rank holds
/// q_t P_t (d per token) while P lives, and buffers of 256 × (d + dv). Collective.
template <class DQ, class DK, class DV, class DB, detail::EigenMatrix DO>
void distributed_chunked_delta_rule_attention(MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q,
                                              const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                                              const Eigen::MatrixBase<DB>& beta, DO&& O,
                                              const DeltaOptions& options = {},
                                              LinearState<typename DQ::Scalar>* state = nullptr) {
    using T = typename DQ::Scalar;
    static_assert(Scalar<T>,
                  "memattn::distributed_chunked_delta_rule_attention: the scalar type must be float or double.");
    static_assert(detail::same_scalar<DQ, DK, DV, DB, std::remove_cvref_t<DO>>,
                  "memattn::distributed_chunked_delta_rule_attention: Q, K, V, beta and O must share one scalar type.");
    detail::mpi::delta_shards<T>(comm, "distributed_chunked_delta_rule_attention", detail::sequence(Q),
                                 detail::sequence(K), detail::sequence(V), detail::sequence(beta), nullptr,
                                 detail::output(std::forward<DO>(O)), options, state, false);
}

/// The gated delta rule over the ranks: `log_gates` N×1 (Gated DeltaNet) or N×d (KDA), ≤ 0
/// (−∞: a reset). As the ungated form above.
template <class DQ, class DK, class DV, class DB, class DG, detail::EigenMatrix DO>
void distributed_chunked_delta_rule_attention(MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q,
                                              const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                                              const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DG>& log_gates,
                                              DO&& O, const DeltaOptions& options = {},
                                              LinearState<typename DQ::Scalar>* state = nullptr) {
    using T = typename DQ::Scalar;
    static_assert(Scalar<T>,
                  "memattn::distributed_chunked_delta_rule_attention: the scalar type must be float or double.");
    static_assert(detail::same_scalar<DQ, DK, DV, DB, DG, std::remove_cvref_t<DO>>,
                  "memattn::distributed_chunked_delta_rule_attention: Q, K, V, beta, log_gates and O must share one "
                  "scalar type.");
    const ConstMatrixRef<T> g = detail::sequence(log_gates);
    detail::mpi::delta_shards<T>(comm, "distributed_chunked_delta_rule_attention", detail::sequence(Q),
                                 detail::sequence(K), detail::sequence(V), detail::sequence(beta), &g,
                                 detail::output(std::forward<DO>(O)), options, state, false);
}

/// KDA over the ranks (chunked_kda_attention's function: `log_gates` N×d, one per key
/// channel, ≤ 0): as distributed_chunked_delta_rule_attention.
template <class DQ, class DK, class DV, class DB, class DG, detail::EigenMatrix DO>
void distributed_chunked_kda_attention(MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                       const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DB>& beta,
                                       const Eigen::MatrixBase<DG>& log_gates, DO&& O, const DeltaOptions& options = {},
                                       LinearState<typename DQ::Scalar>* state = nullptr) {
    using T = typename DQ::Scalar;
    static_assert(Scalar<T>, "memattn::distributed_chunked_kda_attention: the scalar type must be float or double.");
    static_assert(detail::same_scalar<DQ, DK, DV, DB, DG, std::remove_cvref_t<DO>>,
                  "memattn::distributed_chunked_kda_attention: Q, K, V, beta, log_gates and O must share one scalar "
                  "type.");
    const ConstMatrixRef<T> g = detail::sequence(log_gates);
    detail::mpi::delta_shards<T>(comm, "distributed_chunked_kda_attention", detail::sequence(Q), detail::sequence(K),
                                 detail::sequence(V), detail::sequence(beta), &g, detail::output(std::forward<DO>(O)),
                                 options, state, true);
}

}  // namespace memattn
