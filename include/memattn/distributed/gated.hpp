#pragma once
// Sequence-parallel gated linear attention (distributed_chunked_gated_linear_attention;
// distributed/mpi.hpp describes it).

#include "memattn/distributed/collectives.hpp"
#include "memattn/kernels/gated_linear_attention.hpp"

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

/// A shard's summary of gated linear attention, as doubles: [d, dv, gate columns g, Λ (g:
/// the shard's log-gates summed, −∞ for a reset), z (d), S (d × dv)]: the shard maps the
/// state before it to diag(e^{Λ}) S + S_shard.
struct GatedSummary {
    static std::size_t doubles(Index d, Index dv, Index gates) {
        return static_cast<std::size_t>(3 + gates + d + d * dv);
    }
};

/// a ∘ b in place of b (a the earlier shards): Λ = Λ_a + Λ_b; row r of S and entry r of
/// z: e^{Λ_b,r} (a's) + b's, a's dropped where e^{Λ_b,r} = 0 (a reset: no 0·∞).
inline void compose_gated_summaries(void* in, void* inout, int* count, MPI_Datatype* type) {
    int bytes = 0;
    MPI_Type_size(*type, &bytes);
    const std::size_t doubles = static_cast<std::size_t>(bytes) / sizeof(double);
    for (int e = 0; e < *count; ++e) {
        const double* a = static_cast<const double*>(in) + doubles * static_cast<std::size_t>(e);
        double* b = static_cast<double*>(inout) + doubles * static_cast<std::size_t>(e);
        const auto d = static_cast<std::size_t>(b[0]), dv = static_cast<std::size_t>(b[1]),
                   gates = static_cast<std::size_t>(b[2]);
        const double* z_a = a + 3 + gates;
        double* z_b = b + 3 + gates;
        for (std::size_t r = 0; r < d; ++r) {
            const double g = std::exp(b[3 + (gates == 1 ? 0 : r)]);
            if (g != 0.0) {
                z_b[r] += g * z_a[r];
                for (std::size_t c = 0; c < dv; ++c)
                    z_b[d + r * dv + c] += g * z_a[d + r * dv + c];
            }
        }
        for (std::size_t i = 0; i < gates; ++i)
            b[3 + i] += a[3 + i];
    }
}

}  // namespace detail::mpi

/// Sequence-parallel gated linear attention (kernels/gated_linear_attention.hpp): the
/// chunked form over the whole sequence, each rank computing its own shard (contiguous,
/// shards of any length, empty ones too). Every rank runs its shard at once, rank 0 from
/// `state` (its input; empty = zero), the others from zero leaving their rows raw; an
/// exclusive scan of the shards' summaries (the state after a shard is
/// diag(e^{Λ}) S_before + S_shard, composed in rank order: compose_gated_summaries) gives
/// each rank the state before its first token; each rank then adds that state's part to
/// its rows (detail::gated_carried_rows) and finishes them. The outputs equal the
/// single-process chunked form to rounding. `state`, if given, receives on every rank the
/// state after the whole sequence. Communication: one summary of 3 + g + d + d·dv doubles
/// per rank and round of the scan, and one broadcast of the final state. Collective.
template <class DQ, class DK, class DV, class DG, detail::EigenMatrix DO>
void distributed_chunked_gated_linear_attention(MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q,
                                                const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                                                const Eigen::MatrixBase<DG>& log_gates, DO&& O,
                                                const GatedOptions& options = {},
                                                LinearState<typename DQ::Scalar>* state = nullptr) {
    using T = typename DQ::Scalar;
    static_assert(Scalar<T>,
                  "memattn::distributed_chunked_gated_linear_attention: the scalar type must be float or double.");
    static_assert(detail::same_scalar<DQ, DK, DV, DG, std::remove_cvref_t<DO>>,
                  "memattn::distributed_chunked_gated_linear_attention: Q, K, V, log_gates and O must share one "
                  "scalar type.");
    constexpr const char* function = "distributed_chunked_gated_linear_attention";
    const ConstMatrixRef<T> q = detail::sequence(Q), k = detail::sequence(K), v = detail::sequence(V),
                            g = detail::sequence(log_gates);
    MatrixRef<T> o = detail::output(std::forward<DO>(O));
    const int rank = detail::mpi::rank_size(comm).first;
    const std::string error = detail::mpi::local_error([&] {
        detail::check_gated_arguments<T>(function, q, k, v, g, detail::shape(o), options,
                                         rank == 0 ? state : nullptr);
        detail::require_one_span(function, options.span_tokens, "the ranks' shards are the spans");
        // Every rank's state is written: O and the inputs stay apart from it on every rank.
        detail::require_apart(function, o, state, detail::Named{"Q", q}, detail::Named{"K", k},
                              detail::Named{"V", v}, detail::Named{"log_gates", g});
    });
    const Index d = q.cols(), dv = v.cols(), gates = g.cols();
    detail::mpi::check_collectively(
        comm, function, error,
        {{"the key dim d", static_cast<double>(d)},
         {"the value dim dv", static_cast<double>(dv)},
         {"the gate columns", static_cast<double>(gates == 1 ? 1 : 0)},
         {"options.chunk_size", static_cast<double>(options.chunk_size)},
         {"options.scale", options.scale ? *options.scale : -1.0},
         {"options.normalize", options.normalize ? 1.0 : 0.0},
         {"options.eps", options.eps},
         {"options.qk_l2norm", options.qk_l2norm ? 1.0 : 0.0},
         {"options.l2norm_eps", options.l2norm_eps},
         {"the scalar size", static_cast<double>(sizeof(T))}});
    const Index tokens = q.rows();

    // 1. This shard at once: rank 0 from the given state, the others from zero, raw.
    LinearState<T> own;
    const bool has_initial = rank == 0 && state != nullptr && (state->mu.size() != 0 || state->nu.size() != 0);
    if (has_initial) {
        own.mu = state->mu;
        own.nu = state->nu;
    } else {
        own.mu.setZero(d, dv);
        own.nu.setZero(d);
    }
    detail::ColumnVector<T> den(options.normalize ? tokens : 0);
    if (tokens > 0)
        detail::gated_chunked<T>(q, k, v, g, o, options, own, rank > 0, options.normalize ? den.data() : nullptr);
    Vector<T> sum = Vector<T>::Zero(gates);
    for (Index t = 0; t < tokens; ++t)
        sum += g.row(t);
    const std::size_t doubles = detail::mpi::GatedSummary::doubles(d, dv, gates);
    std::vector<double> summary(doubles, 0.0), carried(doubles, 0.0);
    summary[0] = static_cast<double>(d);
    summary[1] = static_cast<double>(dv);
    summary[2] = static_cast<double>(gates);
    for (Index i = 0; i < gates; ++i)
        summary[static_cast<std::size_t>(3 + i)] = static_cast<double>(sum(i));
    double* z = summary.data() + 3 + gates;
    for (Index r = 0; r < d; ++r) {
        z[r] = static_cast<double>(own.nu(r));
        for (Index c = 0; c < dv; ++c)
            z[d + r * dv + c] = static_cast<double>(own.mu(r, c));
    }

    // 2. The state before each rank's first token: an exclusive scan in rank order.
    detail::mpi::exscan(comm, summary, carried, &detail::mpi::compose_gated_summaries);

    // 3. Ranks after the first: the carried state's part of each row, then the state
    //    after this shard.
    if (rank > 0) {
        LinearState<T> in;
        in.mu.resize(d, dv);
        in.nu.resize(d);
        const double* zc = carried.data() + 3 + gates;
        for (Index r = 0; r < d; ++r) {
            in.nu(r) = static_cast<T>(zc[r]);
            for (Index c = 0; c < dv; ++c)
                in.mu(r, c) = static_cast<T>(zc[d + r * dv + c]);
        }
        Matrix<T> scratch(detail::SpanPlan::block_rows, d);
        Vector<T> b = Vector<T>::Zero(gates);
        detail::gated_carried_rows<T>(q, g, o, options.normalize ? den.data() : nullptr, in, options, b, scratch);
        detail::carry_over(in, sum, own);
        own.mu.swap(in.mu);
        own.nu.swap(in.nu);
    }

    // 4. The final state, the last rank's, to every rank that asks (all take part).
    detail::mpi::share_final_state(comm, own, d, dv, d, state);
}

}  // namespace memattn
