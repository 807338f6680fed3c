#pragma once
// Sequence-parallel linear attention (distributed_chunked_linear_attention, LASP;
// distributed/mpi.hpp describes it): summaries of the shards composed by an exclusive scan.

#include "memattn/distributed/collectives.hpp"
#include "memattn/feature_maps.hpp"
#include "memattn/kernels/linear_attention.hpp"

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

/// Tokens per GEMM when a shard is folded into its summary.
inline constexpr Index fold_chunk = 256;

/// (μ, ν, γ^n) of a run of tokens in double, laid out for MPI as one record:
/// [γ^n, d', dv, ν (d'), μ (d'×dv, row-major)].
struct Summary {
    static std::size_t doubles(Index features, Index dv) {
        return static_cast<std::size_t>(3 + features + features * dv);
    }
};

/// a ∘ b in place of b (a the earlier run): γ = γ_a γ_b, ν = γ_b ν_a + ν_b, μ = γ_b μ_a + μ_b.
/// The user operation of MPI_Exscan (invec from the lower ranks, so earlier).
inline void compose_summaries(void* in, void* inout, int* count, MPI_Datatype* type) {
    int bytes = 0;
    MPI_Type_size(*type, &bytes);
    const std::size_t doubles = static_cast<std::size_t>(bytes) / sizeof(double);
    for (int e = 0; e < *count; ++e) {
        const double* a = static_cast<const double*>(in) + doubles * static_cast<std::size_t>(e);
        double* b = static_cast<double*>(inout) + doubles * static_cast<std::size_t>(e);
        const double gamma_b = b[0];
        b[0] = a[0] * gamma_b;
        for (std::size_t i = 3; i < doubles; ++i)
            b[i] = gamma_b * a[i] + b[i];
    }
}

}  // namespace detail::mpi

/// Sequence-parallel linear attention: the chunked form over the whole sequence, each
/// rank computing its own shard (contiguous: rank r's tokens follow rank r − 1's; shards
/// may differ in length and be empty). `state`, if given: on rank 0 the state before the
/// sequence (empty = zero; the other ranks' inputs are not read), and on return, on every
/// rank that passes one, the state after the whole sequence. Collective over `comm`.
template <class DQ, class DK, class DV, detail::EigenMatrix DO, class Phi = EluPlusOne>
void distributed_chunked_linear_attention(MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q,
                                          const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V, DO&& O,
                                          const Phi& phi = {}, const LinearOptions& options = {},
                                          LinearState<typename DQ::Scalar>* state = nullptr) {
    using T = typename DQ::Scalar;
    static_assert(Scalar<T>, "memattn::distributed_chunked_linear_attention: the scalar type must be float or double.");
    static_assert(detail::same_scalar<DQ, DK, DV, std::remove_cvref_t<DO>>,
                  "memattn::distributed_chunked_linear_attention: Q, K, V and O must share one scalar type.");
    static_assert(FeatureMap<Phi, T>, "memattn::distributed_chunked_linear_attention: phi must be a feature map "
                                      "for this scalar (see memattn/feature_maps.hpp).");
    constexpr const char* function = "distributed_chunked_linear_attention";
    const ConstMatrixRef<T> q = detail::sequence(Q), k = detail::sequence(K), v = detail::sequence(V);
    MatrixRef<T> o = detail::output(std::forward<DO>(O));
    const auto ranks = detail::mpi::rank_size(comm);
    const int rank = ranks.first, size = ranks.second;  // not a binding: clang 14 cannot capture one
    Index features = 0;
    const std::string error = detail::mpi::local_error([&] {
        // Only rank 0's state is read: the others' shapes do not matter on the way in.
        features = detail::check_linear_arguments<T>(function, phi, detail::shape(q), detail::shape(k),
                                                     detail::shape(v), detail::shape(o), options,
                                                     rank == 0 ? state : nullptr);
        detail::require_one_span(function, options.span_tokens, "the ranks' shards are the spans");
        // Every rank's state is written: O and the inputs stay apart from it on every rank.
        detail::require_apart(function, o, state, detail::Named{"Q", q}, detail::Named{"K", k},
                              detail::Named{"V", v});
    });
    const Index dv = v.cols();
    detail::mpi::check_collectively(comm, function, error,
                                    {{"the key dim d", static_cast<double>(k.cols())},
                                     {"the value dim dv", static_cast<double>(dv)},
                                     {"the feature dim phi.output_dim(d)", static_cast<double>(features)},
                                     {"options.chunk_size", static_cast<double>(options.chunk_size)},
                                     {"options.eps", options.eps},
                                     {"options.decay", options.decay},
                                     {"options.normalize", options.normalize ? 1.0 : 0.0},
                                     {"the scalar size", static_cast<double>(sizeof(T))}});
    const Index tokens = q.rows();

    // 1. This shard's summary from a zero state: the chunked form's fold, chunk by chunk.
    //    The last rank's is no one's input, and it skips it.
    const std::size_t doubles = detail::mpi::Summary::doubles(features, dv);
    std::vector<double> summary(doubles, 0.0), carried(doubles, 0.0);
    LinearState<T> local;
    local.mu.setZero(features, dv);
    local.nu.setZero(features);
    if (rank + 1 < size) {
        // Long chunks: the fold is one GEMM per chunk, and a depth of 256 keeps μ in
        // registers for longer than the chunked form's 16 (the chunk changes rounding only).
        const Index c =
            std::min(std::max<Index>(options.chunk_size, detail::mpi::fold_chunk), std::max<Index>(tokens, 1));
        const detail::ColumnVector<T> powers = detail::decay_powers<T>(options.decay, c);
        Matrix<T> kf(c, features);
        for (Index j0 = 0; j0 < tokens; j0 += c) {
            const Index m = std::min(c, tokens - j0);
            auto kc = kf.topRows(m);
            detail::apply_features<T>(phi, k.middleRows(j0, m), kc);
            detail::fold_chunk(kc, v.middleRows(j0, m), powers, options.decay != 1, local);
        }
    }
    summary[0] = std::pow(options.decay, static_cast<double>(tokens));
    summary[1] = static_cast<double>(features);
    summary[2] = static_cast<double>(dv);
    for (Index f = 0; f < features; ++f)
        summary[static_cast<std::size_t>(3 + f)] = static_cast<double>(local.nu(f));
    for (Index f = 0; f < features; ++f)
        for (Index c = 0; c < dv; ++c)
            summary[static_cast<std::size_t>(3 + features + f * dv + c)] = static_cast<double>(local.mu(f, c));
    // Rank 0's run starts from the caller's state: fold it in front of its summary.
    const bool has_initial = rank == 0 && state != nullptr && (state->mu.size() != 0 || state->nu.size() != 0);
    if (has_initial) {
        std::vector<double> initial(doubles, 0.0);
        initial[0] = 1.0;
        for (Index f = 0; f < features; ++f)
            initial[static_cast<std::size_t>(3 + f)] = static_cast<double>(state->nu(f));
        for (Index f = 0; f < features; ++f)
            for (Index c = 0; c < dv; ++c)
                initial[static_cast<std::size_t>(3 + features + f * dv + c)] = static_cast<double>(state->mu(f, c));
        int count = 1;
        MPI_Datatype type;
        MPI_Type_contiguous(static_cast<int>(doubles), MPI_DOUBLE, &type);
        MPI_Type_commit(&type);
        detail::mpi::compose_summaries(initial.data(), summary.data(), &count, &type);
        MPI_Type_free(&type);
    }

    // 2. The state before each rank's first token: an exclusive scan of the summaries.
    detail::mpi::exscan(comm, summary, carried, &detail::mpi::compose_summaries);

    // 3. The chunked form on this shard from that state.
    LinearState<T> s;
    s.mu.setZero(features, dv);
    s.nu.setZero(features);
    if (rank == 0) {
        if (has_initial) {
            s.mu = state->mu;
            s.nu = state->nu;
        }
    } else {
        for (Index f = 0; f < features; ++f)
            s.nu(f) = static_cast<T>(carried[static_cast<std::size_t>(3 + f)]);
        for (Index f = 0; f < features; ++f)
            for (Index c = 0; c < dv; ++c)
                s.mu(f, c) = static_cast<T>(carried[static_cast<std::size_t>(3 + features + f * dv + c)]);
    }
    detail::chunked_form(q, k, v, o, phi, options, features, s);

    // 4. The final state, the last rank's, to every rank that asks (all take part).
    detail::mpi::share_final_state(comm, s, features, dv, features, state);
}

}  // namespace memattn
