#pragma once
// Ring attention (distributed_causal_softmax_attention; distributed/mpi.hpp describes
// it): the K/V shards travel round the ring of ranks, each hop overlapping the tiles.

#include "memattn/distributed/collectives.hpp"
#include "memattn/kernels/causal_softmax.hpp"
#include "memattn/layer/head_layout.hpp"
#include "memattn/softmax_state.hpp"

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

}  // namespace detail::mpi

namespace detail::mpi {

/// Ring attention after the local checks: every head of `heads` over the ring (see the
/// top of distributed/mpi.hpp). One pass round the ring carries every KV head's block,
/// [K | V] of kv_heads·(d + dv) scalars per token; each query head h merges the blocks
/// of KV head h / group_size into its columns of O.
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
                    detail::merge_rows(target, &lse(h, qc.row + skip), out, block_lse.data());
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
                detail::merge_rows(target, &lse(h, i), zero, &sigma);
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
        require(options.fpmath == FpMath::strict, function, "options.fpmath",
                "is not FpMath::strict: ring attention's blocks keep their own products");
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

}  // namespace memattn
