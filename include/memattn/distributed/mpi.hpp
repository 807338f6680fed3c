#pragma once
// Past one machine: sequence parallelism over MPI. The one memattn header that includes
// <mpi.h>; link the CMake target memattn::mpi (built when CMake finds MPI).
//
// Each of P ranks of a communicator holds a shard of one sequence: its queries, keys and
// values (rows of Q, K, V), its outputs. Two algebraic facts make the split exact:
//   - softmax partials over disjoint key sets merge through (max, sum, acc), i.e. through
//     each block's normalised output and log-sum-exp (SoftmaxState);
//   - linear-attention states compose associatively: the state after shards a then b is
//     (γ^{n_b} μ_a + μ_b, γ^{n_b} ν_a + ν_b), with γ^{n_a + n_b} for the pair.
//
// distributed_causal_softmax_attention — ring attention (Liu et al. 2023, "Ring Attention
//   with Blockwise Transformers"). The K/V shards travel around the ring of ranks, each
//   hop a non-blocking send and receive posted before the rank works on the block it
//   holds, so the transfer overlaps the tile work. Every (query chunk, key chunk) pair
//   wholly in the causal future, or wholly before every query's window (and holding no
//   sink), is skipped. The softcap and ALiBi apply per block (a block's positions keep
//   the distances); each head's sink logit joins once, after the last block (a block of
//   value 0 and log-sum-exp σ). Non-causal calls (options.causal = false) fold every
//   block both ways, skipping only blocks outside every query's window; tree calls
//   are refused. Layouts:
//     contiguous  rank r holds tokens [o_r, o_r + n_r): rank P−1 does the most work (its
//                 queries see every earlier shard), rank 0 the least;
//     zigzag      the sequence is cut into 2P chunks and rank r holds chunks r and
//                 2P−1−r (its first ⌈n_r/2⌉ rows, then the rest), so every rank gets one
//                 early and one late chunk and the causal triangle splits evenly.
//   Communication: every rank sends every K/V block except the last it receives once
//   around the ring, (P−1)·n·(d+dv) scalars per rank for shards of n tokens; the
//   minimum for exact attention with the causal rule, sending each block only to the
//   ranks whose queries see it, is (P−1−r)·n·(d+dv) for rank r (on average half).
//
// distributed_chunked_linear_attention — sequence-parallel linear attention (the idea of
//   LASP, Sun et al. 2024, "Linear Attention Sequence Parallelism"): every rank but the
//   last folds its shard into a summary (μ_r, ν_r, γ^{n_r}) from a zero state (one GEMM
//   per chunk, the third of the chunked form's three); an exclusive scan with the
//   composition above (MPI_Exscan with a user operation, log₂P rounds) gives each rank
//   the state before its first token; each rank then runs the chunked form on its shard
//   from that state. The outputs equal the single-process chunked form to rounding.
//   Communication: one summary of d'·dv + d' + 1 doubles per rank and round of the scan,
//   and one broadcast of the final state when a rank asks for it: independent of n.
//
// distributed_chunked_gated_linear_attention — the same for gated linear attention: a
//   shard maps the state before it to diag(e^{Λ}) S + S_shard; every rank runs its shard
//   at once and the later ones add their carried state's part to their rows.
//
// distributed_chunked_delta_rule_attention, distributed_chunked_kda_attention — the delta
//   rule (ungated, gated, KDA): a shard maps the state before it to P S + B with P a
//   dense d × d matrix. A later rank runs its shard once with d extra value columns
//   (zero values, the identity as their state), which give P and each row's q_t P_t;
//   an exclusive scan of the (P, B) gives each rank its starting state, whose part the
//   later ranks add to their rows. About two passes' work per token on a later rank.
//
// ShardedKVCache — a KVCache whose pairs are spread over the ranks (token t on rank
//   t mod P): every rank calls update with the same pair and only its owner stores it;
//   attend computes each rank's partial (max, sum, acc) over its pairs and merges the P
//   partials in rank order after one MPI_Allgather, so every rank gets the same bits, on
//   every run, and a step reads P machines' memory at once.
//
// Every function is collective over its communicator: all ranks call it, in the same
// order. Shapes and options are checked on every rank first and compared across ranks:
// if one rank has a bad argument, or the ranks disagree (d, dv, options), every rank
// throws the same std::invalid_argument, so none is left waiting in a collective. A rank
// that dies is out of scope: MPI itself then aborts or hangs the job, and memattn adds
// no fault tolerance of its own. MPI errors are MPI's (by default they abort the job).
// Threads: the calls go to MPI from the calling thread; attend from several threads at
// once needs MPI_THREAD_MULTIPLE and separate communicators.

#include "memattn/feature_maps.hpp"
#include "memattn/kernels/causal_softmax.hpp"
#include "memattn/kernels/decode_attention.hpp"
#include "memattn/kernels/delta_rule.hpp"
#include "memattn/kernels/gated_linear_attention.hpp"
#include "memattn/kernels/linear_attention.hpp"
#include "memattn/layer/head_layout.hpp"
#include "memattn/memory/kv_cache.hpp"
#include "memattn/softmax_state.hpp"
#include "memattn/types.hpp"

// memattn uses MPI's C interface only: Open MPI's and MPICH's deprecated C++ bindings
// stay out (they also warn under -Wextra).
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

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

/// How the shards of distributed_causal_softmax_attention sit in the sequence.
enum class RingLayout {
    contiguous,  ///< rank r holds one run of tokens, after rank r − 1's
    zigzag       ///< rank r holds chunks r and 2P−1−r of 2P (its first ⌈n_r/2⌉ rows, then the rest)
};

namespace detail::mpi {

/// The MPI type of a memattn scalar.
template <class T>
MPI_Datatype datatype() {
    return std::is_same_v<T, float> ? MPI_FLOAT : MPI_DOUBLE;
}

/// The rank and the number of ranks of `comm`.
inline std::pair<int, int> rank_size(MPI_Comm comm) {
    int rank = 0, size = 1;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    return {rank, size};
}

/// One named value every rank must agree on (a dimension, an option).
struct Agreed {
    const char* name;
    double value;
};

/// The collective check every distributed call makes first. Each rank passes the error
/// its own checks found (empty if none) and the values all ranks must share. If any
/// rank has an error, every rank throws std::invalid_argument with the lowest such
/// rank's message; else if a value differs from rank 0's, every rank throws naming the
/// value and both ranks. One MPI_Allgather of a fixed-size record, so no rank waits.
inline void check_collectively(MPI_Comm comm, const char* function, const std::string& error,
                               const std::vector<Agreed>& agreed) {
    constexpr std::size_t text = 480;
    const auto [rank, size] = rank_size(comm);
    const std::size_t values = agreed.size();
    const std::size_t record = text + sizeof(double) * values;
    std::vector<char> mine(record, 0), all(record * static_cast<std::size_t>(size));
    std::memcpy(mine.data(), error.data(), std::min(error.size(), text - 1));
    for (std::size_t i = 0; i < values; ++i)
        std::memcpy(mine.data() + text + sizeof(double) * i, &agreed[i].value, sizeof(double));
    MPI_Allgather(mine.data(), static_cast<int>(record), MPI_BYTE, all.data(), static_cast<int>(record), MPI_BYTE,
                  comm);
    for (int r = 0; r < size; ++r) {
        const char* message = all.data() + record * static_cast<std::size_t>(r);
        if (message[0] != '\0')
            throw std::invalid_argument(std::string(message) + " (on rank " + std::to_string(r) + " of " +
                                        std::to_string(size) + "; every rank of the call throws this)");
    }
    for (int r = 1; r < size; ++r)
        for (std::size_t i = 0; i < values; ++i) {
            double first = 0, other = 0;
            std::memcpy(&first, all.data() + text + sizeof(double) * i, sizeof(double));
            std::memcpy(&other, all.data() + record * static_cast<std::size_t>(r) + text + sizeof(double) * i,
                        sizeof(double));
            if (std::memcmp(&first, &other, sizeof(double)) != 0) {
                std::ostringstream os;
                os << "memattn::" << function << ": the ranks disagree: " << agreed[i].name << " is ";
                put(os, first);
                os << " on rank 0 and ";
                put(os, other);
                os << " on rank " << r << " (every rank of the call throws this)";
                throw std::invalid_argument(os.str());
            }
        }
    (void)rank;
}

/// Runs the local checks, turning the std::invalid_argument they throw into the error
/// for check_collectively.
template <class Checks>
std::string local_error(Checks&& checks) {
    try {
        checks();
    } catch (const std::invalid_argument& e) {
        return e.what();
    }
    return {};
}

/// A shard's K/V block travels as one message, whose count MPI takes as an int.
inline void check_message_size(const char* function, Index rows, Index width) {
    require(rows <= Index(std::numeric_limits<int>::max()) / std::max<Index>(width, 1), function, "K", "has ", rows,
            " rows of ", width, " K and V values: the shard's block exceeds the ", std::numeric_limits<int>::max(),
            " values of one MPI message; spread the sequence over more ranks");
}

/// Every rank's value of `mine`, in rank order.
inline std::vector<std::int64_t> all_gather(MPI_Comm comm, std::int64_t mine) {
    const int size = rank_size(comm).second;
    std::vector<std::int64_t> all(static_cast<std::size_t>(size));
    MPI_Allgather(&mine, 1, MPI_INT64_T, all.data(), 1, MPI_INT64_T, comm);
    return all;
}

/// One run of a rank's rows in the sequence: rows [row, row + rows) of the shard are
/// tokens [start, start + rows).
struct Chunk {
    Index row, rows, start;
};

/// The chunks of every rank's shard for a layout, from every rank's shard length.
inline std::vector<std::vector<Chunk>> chunks_of(const std::vector<std::int64_t>& lengths, RingLayout layout) {
    const auto size = static_cast<Index>(lengths.size());
    std::vector<std::vector<Chunk>> chunks(lengths.size());
    if (layout == RingLayout::contiguous) {
        Index start = 0;
        for (Index r = 0; r < size; ++r) {
            const auto n = static_cast<Index>(lengths[static_cast<std::size_t>(r)]);
            chunks[static_cast<std::size_t>(r)].push_back({0, n, start});
            start += n;
        }
        return chunks;
    }
    // Zigzag: chunk c < P is rank c's first part, chunk c ≥ P rank 2P−1−c's second part.
    Index start = 0;
    for (Index c = 0; c < 2 * size; ++c) {
        const Index r = c < size ? c : 2 * size - 1 - c;
        const auto n = static_cast<Index>(lengths[static_cast<std::size_t>(r)]);
        const Index first = (n + 1) / 2;
        const Chunk chunk = c < size ? Chunk{0, first, start} : Chunk{first, n - first, start};
        chunks[static_cast<std::size_t>(r)].push_back(chunk);
        start += chunk.rows;
    }
    return chunks;
}

/// Merges a block's normalised outputs and log-sum-exps into the running ones, row by
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

/// The exclusive scan of one summary per rank, in rank order: `carried` receives the
/// composition (by `op`, MPI's user operation: invec the earlier ranks) of every earlier
/// rank's; rank 0's is left as it was. ⌈log₂ P⌉ rounds of one summary each.
inline void exscan(MPI_Comm comm, const std::vector<double>& summary, std::vector<double>& carried,
                   MPI_User_function* op) {
    MPI_Datatype type;
    MPI_Type_contiguous(static_cast<int>(summary.size()), MPI_DOUBLE, &type);
    MPI_Type_commit(&type);
    MPI_Op compose;
    MPI_Op_create(op, /*commute=*/0, &compose);
    MPI_Exscan(summary.data(), carried.data(), 1, type, compose, comm);
    MPI_Op_free(&compose);
    MPI_Type_free(&type);
}

/// The state after the whole sequence, `last`'s on the last rank (rows × cols of mu,
/// `nu` entries of nu), to every rank that passes a `state`; all ranks take part. With
/// nu = 0 the state's nu is left as it is.
template <class T>
void share_final_state(MPI_Comm comm, const LinearState<T>& last, Index rows, Index cols, Index nu,
                       LinearState<T>* state) {
    const auto [rank, size] = rank_size(comm);
    Vector<T> buffer(rows * cols + nu);
    if (rank == size - 1) {
        Eigen::Map<Matrix<T>>(buffer.data(), rows, cols) = last.mu;
        buffer.tail(nu) = last.nu;
    }
    MPI_Bcast(buffer.data(), static_cast<int>(buffer.size()), datatype<T>(), size - 1, comm);
    if (state != nullptr) {
        state->mu = Eigen::Map<const Matrix<T>>(buffer.data(), rows, cols);
        if (nu > 0)
            state->nu = buffer.tail(nu);
    }
}

}  // namespace detail::mpi

namespace detail::mpi {

/// Ring attention after the local checks: every head of `heads` over the ring (see the
/// top of the file). One pass round the ring carries every KV head's block, [K | V] of
/// kv_heads·(d + dv) scalars per token; each query head h merges the blocks of KV head
/// h / group_size into its columns of O.
template <class T>
void ring_attention(MPI_Comm comm, const char* function, const std::string& error, const ConstMatrixRef<T>& q,
                    const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v, MatrixRef<T> o, const HeadLayout& heads,
                    const SoftmaxOptions& options, RingLayout layout) {
    const Index d = heads.head_dim, dv = heads.values(), kv = heads.kv_heads, group = heads.group_size();
    check_collectively(comm, function, error,
                       {{"layout.q_heads", static_cast<double>(heads.q_heads)},
                        {"layout.kv_heads", static_cast<double>(kv)},
                        {"the key dim d", static_cast<double>(d)},
                        {"the value dim dv", static_cast<double>(dv)},
                        {"options.scale", options.scale},
                        {"options.window", static_cast<double>(options.window)},
                        {"options.sink_tokens", static_cast<double>(options.sink_tokens)},
                        {"options.softcap", options.softcap},
                        {"options.causal", options.causal ? 1.0 : 0.0},
                        {"options.alibi_slopes' count", static_cast<double>(options.alibi_slopes.size())},
                        {"options.sink_logits' count", static_cast<double>(options.sink_logits.size())},
                        {"the ring layout", static_cast<double>(layout)},
                        {"the scalar size", static_cast<double>(sizeof(T))}});
    const auto [rank, size] = rank_size(comm);
    const std::vector<std::int64_t> lengths = all_gather(comm, q.rows());
    const auto chunks = chunks_of(lengths, layout);
    const auto& mine = chunks[static_cast<std::size_t>(rank)];
    const Index longest = *std::max_element(lengths.begin(), lengths.end());
    const Index width = kv * (d + dv);

    // The block this rank holds and the one arriving: [K | V] rows, packed once.
    Matrix<T> held(std::max<Index>(longest, 1), width), arriving(std::max<Index>(longest, 1), width);
    held.topLeftCorner(q.rows(), kv * d) = k;
    held.block(0, kv * d, q.rows(), kv * dv) = v;
    o.setZero();
    Matrix<T> lse = Matrix<T>::Constant(heads.q_heads, q.rows(), -std::numeric_limits<T>::infinity());  // head-major
    Index block_rows = 1;
    for (const auto& chunk : mine)
        block_rows = std::max(block_rows, chunk.rows);
    Matrix<T> block_out(block_rows, dv);
    Vector<T> block_lse(block_rows);
    SoftmaxScratch<T> scratch(d, dv, default_tiles(options.window));
    const T scale = resolve_scale(static_cast<T>(options.scale), d);
    const int next = (rank + 1) % size, previous = (rank + size - 1) % size;

    for (int step = 0; step < size; ++step) {
        const int origin = (rank + size - step) % size;  // whose pairs this rank holds now
        const auto origin_rows = static_cast<Index>(lengths[static_cast<std::size_t>(origin)]);
        std::array<MPI_Request, 2> requests{MPI_REQUEST_NULL, MPI_REQUEST_NULL};
        if (step + 1 < size) {  // pass the block on while working on it
            const int incoming = (rank + size - step - 1) % size;
            const auto incoming_rows = static_cast<Index>(lengths[static_cast<std::size_t>(incoming)]);
            MPI_Irecv(arriving.data(), static_cast<int>(incoming_rows * width), datatype<T>(), previous, step, comm,
                      &requests[0]);
            MPI_Isend(held.data(), static_cast<int>(origin_rows * width), datatype<T>(), next, step, comm,
                      &requests[1]);
        }
        for (const auto& qc : mine) {
            for (const auto& kc : chunks[static_cast<std::size_t>(origin)]) {
                const Index offset = qc.start - kc.start;  // query 0's position among the chunk's keys
                if (qc.rows == 0 || kc.rows == 0 || (options.causal && offset + qc.rows - 1 < 0))
                    continue;  // wholly in the causal future
                const Index sinks = std::max<Index>(0, options.sink_tokens - kc.start);
                if (options.window > 0 && sinks == 0 &&
                    (kc.rows - 1 <= offset - options.window ||
                     (!options.causal && offset + qc.rows - 1 <= -options.window)))
                    continue;  // wholly before (or, both ways, after) every query's window
                // Causal: a chunk of keys after the first query (offset < 0) starts at the
                // query that sits on its first key; the queries before it see none of it.
                const Index skip = options.causal ? std::max<Index>(0, -offset) : 0;
                const Index rows = qc.rows - skip;
                auto out = block_out.topRows(rows);
                for (Index h = 0; h < heads.q_heads; ++h) {
                    const Index g = h / group;
                    LogitRule rule = LogitRule::of(head_options(options, h));
                    rule.sink = false;  // joins once, below, after every block
                    causal_softmax_block<T>(q.block(qc.row + skip, h * d, rows, d),
                                            held.block(kc.row, g * d, kc.rows, d),
                                            held.block(kc.row, kv * d + g * dv, kc.rows, dv), offset + skip, scale,
                                            options.window, sinks, out, block_lse.data(), scratch, rule);
                    auto target = o.block(qc.row + skip, h * dv, rows, dv);
                    merge_rows(target, &lse(h, qc.row + skip), out, block_lse.data());
                }
            }
        }
        MPI_Waitall(2, requests.data(), MPI_STATUSES_IGNORE);
        held.swap(arriving);
    }
    // Learned sink logits: e^σ joins each row's denominator once (a block of value 0).
    if (!options.sink_logits.empty()) {
        const Matrix<T> zero = Matrix<T>::Zero(1, dv);
        for (Index h = 0; h < heads.q_heads; ++h) {
            const T sigma = static_cast<T>(options.sink_logits[static_cast<std::size_t>(h)]);
            if (sigma == -std::numeric_limits<T>::infinity())
                continue;
            for (Index i = 0; i < q.rows(); ++i) {
                auto target = o.block(i, h * dv, 1, dv);
                merge_rows(target, &lse(h, i), zero, &sigma);
            }
        }
    }
}

}  // namespace detail::mpi

namespace detail::mpi {

/// Both public overloads of ring attention: the views, every local check (of a layer's
/// packed buffers when `heads` is given, else of one head), then ring_attention.
template <class DQ, class DK, class DV, class DO>
void ring_attention_call(MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                         const Eigen::MatrixBase<DV>& V, DO&& O, const HeadLayout* heads,
                         const SoftmaxOptions& options, RingLayout layout) {
    using T = typename DQ::Scalar;
    static_assert(Scalar<T>, "memattn::distributed_causal_softmax_attention: the scalar type must be float or double.");
    static_assert(same_scalar<DQ, DK, DV, std::remove_cvref_t<DO>>,
                  "memattn::distributed_causal_softmax_attention: Q, K, V and O must have the same scalar type.");
    constexpr const char* function = "distributed_causal_softmax_attention";
    const ConstMatrixRef<T> q = sequence(Q), k = sequence(K), v = sequence(V);
    MatrixRef<T> o = output(std::forward<DO>(O));
    const std::string error = local_error([&] {
        if (heads != nullptr) {
            check_layout(function, *heads);
            check_packed(function, *heads, shape(q), shape(k), shape(v), shape(o));
            check_softmax_arguments<T>(function, {q.rows(), heads->head_dim}, {k.rows(), heads->head_dim},
                                       {v.rows(), heads->values()}, {o.rows(), heads->values()}, options,
                                       heads->q_heads);
        } else {
            check_softmax_arguments<T>(function, shape(q), shape(k), shape(v), shape(o), options);
        }
        // A tree's rows are not the ring's positions.
        require(options.parents.empty(), function, "options.parents",
                "is given: a tree of draft tokens belongs to one rank's call, not to ring attention");
        require(q.rows() == k.rows(), function, "Q", "has shape ", shape(q), ", expected ", k.rows(), " rows as K (",
                shape(k), "): each rank holds the queries of its own tokens");
        check_message_size(function, k.rows(), k.cols() + v.cols());
        check_disjoint(function, "O", o, q, k, v);
    });
    // A bad layout on one rank must not size anything before the collective check.
    const HeadLayout used = heads == nullptr ? HeadLayout{1, 1, k.cols(), v.cols()}
                            : error.empty()  ? *heads
                                             : HeadLayout{1, 1, 1, 1};
    ring_attention<T>(comm, function, error, q, k, v, o, used, options, layout);
}

}  // namespace detail::mpi

/// Ring attention: O = causal softmax attention of this rank's queries over the keys and
/// values of every rank, the shards laid out in the sequence by `layout` (see the top of
/// the file). Q, K, V, O are this rank's shard (n_r rows each, n_r may differ between
/// ranks and may be 0); window and sinks count positions in the whole sequence. Equals
/// causal_softmax_attention on the whole sequence to rounding. Collective over `comm`.
/// (With options given as `{}`, write `SoftmaxOptions{}`: `{}` could also be a HeadLayout.)
template <class DQ, class DK, class DV, detail::EigenMatrix DO>
void distributed_causal_softmax_attention(MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q,
                                          const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V, DO&& O,
                                          const SoftmaxOptions& options = {},
                                          RingLayout layout = RingLayout::contiguous) {
    detail::mpi::ring_attention_call(comm, Q, K, V, std::forward<DO>(O), nullptr, options, layout);
}

/// The same for a layer of heads in packed buffers (layer/head_layout.hpp: Q n × q_heads·d,
/// K n × kv_heads·d, V n × kv_heads·dv, O n × q_heads·dv; grouped-query heads share their
/// KV head's block): one pass round the ring carries every KV head. Equals
/// multi_head_causal_softmax_attention on the whole sequence to rounding.
template <class DQ, class DK, class DV, detail::EigenMatrix DO>
void distributed_causal_softmax_attention(MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q,
                                          const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V, DO&& O,
                                          const HeadLayout& heads, const SoftmaxOptions& options = {},
                                          RingLayout layout = RingLayout::contiguous) {
    detail::mpi::ring_attention_call(comm, Q, K, V, std::forward<DO>(O), &heads, options, layout);
}

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

/// A KVCache whose pairs are spread over the ranks of a communicator: token t lives on
/// rank t mod P. Every rank calls update (or extend) with the same pairs and only the
/// owner stores them; attend merges every rank's partial softmax in rank order, so every
/// rank gets the same output, bit for bit, on every run. A Memory. The constructor and
/// attend are collective over the communicator; update and extend need no communication
/// (a bad shape there throws on the rank that has it, and the next attend, which
/// compares the ranks' lengths, throws on all of them).
template <Scalar T>
class ShardedKVCache {
public:
    using Scalar = T;  ///< float or double: the rows' scalar and the arithmetic's

    /// Collective: every rank passes the same dims and scale (0: 1/sqrt(key_dim)).
    ShardedKVCache(MPI_Comm comm, Index key_dim, Index value_dim, T scale = T(0))
        : comm_(comm), rank_size_(checked(comm, key_dim, value_dim, scale)), local_(key_dim, value_dim, scale),
          partial_(value_dim + header), all_(static_cast<Index>(rank_size_.second) * (value_dim + header)) {}

    /// The key width d.
    [[nodiscard]] Index key_dim() const noexcept { return local_.key_dim(); }
    /// The value width dv.
    [[nodiscard]] Index value_dim() const noexcept { return local_.value_dim(); }
    /// Tokens seen since reset, on every rank.
    [[nodiscard]] Index length() const noexcept { return length_; }
    /// Pairs this rank holds.
    [[nodiscard]] Index local_length() const noexcept { return local_.length(); }
    /// Bytes this rank holds.
    [[nodiscard]] std::size_t footprint() const noexcept { return local_.footprint(); }

    /// Appends token length() to the memory: its owner stores it.
    void update(ConstRowRef<T> key, ConstRowRef<T> value) {
        detail::require(key.cols() == key_dim(), "ShardedKVCache::update", "key", "has shape ", detail::shape(key),
                        ", expected 1x", key_dim());
        detail::require(value.cols() == value_dim(), "ShardedKVCache::update", "value", "has shape ",
                        detail::shape(value), ", expected 1x", value_dim());
        if (owner(length_) == rank())
            local_.update(key, value);
        ++length_;
    }

    /// update for each row of K/V in order.
    void extend(ConstMatrixRef<T> keys, ConstMatrixRef<T> values) {
        detail::check_keys_values("ShardedKVCache::extend", *this, detail::shape(keys), detail::shape(values));
        const int p = rank_size_.second;
        const Index first = (rank() - owner(length_) + p) % p;  // the first row this rank owns
        const Index mine = keys.rows() > first ? (keys.rows() - first + p - 1) / p : 0;
        if (mine > 0) {
            using Rows = Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>>;
            local_.extend(Rows(keys.data() + first * keys.outerStride(), mine, key_dim(),
                               Eigen::OuterStride<>(keys.outerStride() * p)),
                          Rows(values.data() + first * values.outerStride(), mine, value_dim(),
                               Eigen::OuterStride<>(values.outerStride() * p)));
        }
        length_ += keys.rows();
    }

    /// out = Σ_j softmax_j(scale · q·k_j) v_j over every rank's pairs; zero when empty.
    /// Collective: one MPI_Allgather of (max, sum, length, acc) per rank.
    void attend(ConstRowRef<T> query, RowRef<T> out) const {
        const bool good = query.cols() == key_dim() && out.cols() == value_dim() &&
                          !detail::overlap<T>(detail::extent(out), detail::extent(query));
        const Index dv = value_dim();
        SoftmaxState<T> state;
        auto acc = partial_.tail(dv);
        acc.setZero();
        if (good && local_.length() > 0)
            detail::attend_contiguous(query, local_.keys(), local_.values(), local_.scale(), state, acc);
        // The length travels with the partial, bit for bit as an int64 in the first
        // slots (−1 for a bad argument), so one bad rank stops them all with the same
        // message, and lengths that differ in their last bit are told apart (as floats,
        // 16777216 and 16777217 would compare equal).
        const std::int64_t sent = good ? static_cast<std::int64_t>(length_) : std::int64_t{-1};
        std::memcpy(partial_.data(), &sent, sizeof sent);
        partial_(header - 2) = state.max;
        partial_(header - 1) = state.sum;
        const Index width = dv + header;
        MPI_Allgather(partial_.data(), static_cast<int>(width), detail::mpi::datatype<T>(), all_.data(),
                      static_cast<int>(width), detail::mpi::datatype<T>(), comm_);
        const auto length_of = [&](int r) {
            std::int64_t length = 0;
            std::memcpy(&length, all_.data() + r * width, sizeof length);
            return length;
        };
        const std::int64_t first = length_of(0);
        for (int r = 0; r < rank_size_.second; ++r) {
            const std::int64_t length = length_of(r);
            detail::require(length >= 0, "ShardedKVCache::attend", "query", "or 'out' has a bad shape on rank ", r,
                            " (expected 1x", key_dim(), " and 1x", dv, ", not overlapping)");
            detail::require(length == first, "ShardedKVCache::attend", "length", "differs between ranks: ", first,
                            " on rank 0, ", length, " on rank ", r);
        }
        SoftmaxState<T> merged;
        out.setZero();
        for (int r = 0; r < rank_size_.second; ++r) {
            const T* p = all_.data() + r * width;
            merged.merge(SoftmaxState<T>{p[header - 2], p[header - 1]}, out, Eigen::Map<const Vector<T>>(p + header, dv));
        }
        merged.finish(out);
    }

    /// Forgets every pair (no communication).
    void reset() {
        local_.reset();
        length_ = 0;
    }

private:
    /// The collective check of the constructor's arguments; the rank and size.
    static std::pair<int, int> checked(MPI_Comm comm, Index key_dim, Index value_dim, T scale) {
        const std::string error = detail::mpi::local_error([&] { KVCache<T> probe(key_dim, value_dim, scale); });
        detail::mpi::check_collectively(comm, "ShardedKVCache", error,
                                        {{"key_dim", static_cast<double>(key_dim)},
                                         {"value_dim", static_cast<double>(value_dim)},
                                         {"scale", static_cast<double>(scale)},
                                         {"the scalar size", static_cast<double>(sizeof(T))}});
        return detail::mpi::rank_size(comm);
    }

    [[nodiscard]] int rank() const noexcept { return rank_size_.first; }
    [[nodiscard]] int owner(Index token) const noexcept { return static_cast<int>(token % rank_size_.second); }

    MPI_Comm comm_;
    std::pair<int, int> rank_size_;
    KVCache<T> local_;
    Index length_ = 0;
    /// Slots before a partial's accumulator: the length's int64 bits, then max and sum.
    static constexpr Index header = static_cast<Index>((sizeof(std::int64_t) + sizeof(T) - 1) / sizeof(T)) + 2;
    mutable Vector<T> partial_;  // [length bits, max, sum, acc]: this rank's partial, sent by attend
    mutable Vector<T> all_;      // every rank's
};

}  // namespace memattn
