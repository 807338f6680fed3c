#pragma once
// Batched decode: one new token for each of many sequences in one call, threaded across
// (sequence, KV head) items (docs/design.md, "Serving").
//
//   std::vector<memattn::Index> seqs{a, b, c};
//   memattn::batched_decode(pool, seqs, Q, K, V, O);        // rows [batch, heads·dim]
//   memattn::batched_decode(std::span(layers), Q, K, V, O);  // one Memory per sequence
//   memattn::batched_prefill(std::span(layers), offsets, Q, K, V, O);  // chunks beside tokens
//
// Row i of K/V is appended to sequence i and row i of Q attends it, so the output is bit
// for bit what one update and one attend per sequence give, for any batch order, thread
// count and executor. Everything is checked before any sequence moves: a call that
// throws (a bad id or shape, a value the storage cannot hold, too few free blocks)
// changes nothing.

#include "memattn/execution/executor.hpp"
#include "memattn/execution/parallel.hpp"
#include "memattn/memory/concept.hpp"
#include "memattn/memory/detail/memory_checks.hpp"
#include "memattn/memory/detail/rollback.hpp"
#include "memattn/serving/paged_kv_cache.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <span>
#include <type_traits>
#include <utility>

namespace memattn {

namespace detail {

/// The arguments of a batched call have the scalar of its pool or memories (T).
template <class T, class... D>
constexpr bool batch_scalars() {
    static_assert((std::is_same_v<typename std::remove_cvref_t<D>::Scalar, T> && ...),
                  "memattn::batched_decode and memattn::batched_prefill: Q, K, V and O must have the scalar type "
                  "of the pool or memories");
    return (std::is_same_v<typename std::remove_cvref_t<D>::Scalar, T> && ...);
}

}  // namespace detail

/// One token for each sequence of `seqs` (distinct live ids of `pool`): row i of K and V
/// appended to seqs[i], then row i of O = row i of Q attending it, on the pool's executor
/// (PagedKVCache::set_executor): PagedKVCache::decode, all or nothing (the tokens taken
/// back when the attends throw). Q, K, V and O are row-major (any Matrix, Map or block of
/// the pool's scalar; a column-major one does not compile). Allocates nothing.
template <Scalar T, class S, class DQ, class DK, class DV, detail::EigenMatrix DO>
void batched_decode(PagedKVCache<T, S>& pool, std::span<const Index> seqs, const Eigen::MatrixBase<DQ>& Q,
                    const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V, DO&& O) {
    batched_decode(pool, seqs, Q, K, V, std::forward<DO>(O), pool.executor());
}
/// The same on `executor` instead of the pool's.
template <Scalar T, class S, class DQ, class DK, class DV, detail::EigenMatrix DO>
void batched_decode(PagedKVCache<T, S>& pool, std::span<const Index> seqs, const Eigen::MatrixBase<DQ>& Q,
                    const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V, DO&& O, ExecutorRef executor) {
    if constexpr (detail::batch_scalars<T, DQ, DK, DV, DO>())
        detail::PagedAccess::decode(pool, "batched_decode", seqs, detail::sequence(Q), detail::sequence(K),
                                    detail::sequence(V), detail::output(std::forward<DO>(O)), executor);
}

/// A mixed batch over the pool (chunked prefill beside decode): sequence seqs[i] brings
/// the rows [q_offsets[i], q_offsets[i + 1]) of Q, K and V (a chunk of prompt, one token,
/// or none) and each row attends the sequence's cached tokens and its new rows up to
/// itself: PagedKVCache::prefill (a chunk through the tiled kernel over its blocks, bit
/// for bit the multi-head kernel on its pairs as stored; a single token a decode step),
/// on the pool's executor. Row-major arguments, as batched_decode's.
template <Scalar T, class S, class DQ, class DK, class DV, detail::EigenMatrix DO>
void batched_prefill(PagedKVCache<T, S>& pool, std::span<const Index> seqs, std::span<const Index> q_offsets,
                     const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                     DO&& O) {
    batched_prefill(pool, seqs, q_offsets, Q, K, V, std::forward<DO>(O), pool.executor());
}
/// The same on `executor` instead of the pool's.
template <Scalar T, class S, class DQ, class DK, class DV, detail::EigenMatrix DO>
void batched_prefill(PagedKVCache<T, S>& pool, std::span<const Index> seqs, std::span<const Index> q_offsets,
                     const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                     DO&& O, ExecutorRef executor) {
    if constexpr (detail::batch_scalars<T, DQ, DK, DV, DO>())
        detail::PagedAccess::prefill(pool, "batched_prefill", seqs, q_offsets, detail::sequence(Q),
                                     detail::sequence(K), detail::sequence(V), detail::output(std::forward<DO>(O)),
                                     executor);
}
/// Speculative decoding's verify step over the pool: the same, each chunk a tree of
/// drafts, parents[r] row r's parent within its chunk (−1: a root), the drafts then
/// waiting for PagedKVCache::accept or reject (PagedKVCache::prefill with parents).
template <Scalar T, class S, class DQ, class DK, class DV, detail::EigenMatrix DO>
void batched_prefill(PagedKVCache<T, S>& pool, std::span<const Index> seqs, std::span<const Index> q_offsets,
                     const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                     DO&& O, ExecutorRef executor, std::span<const Index> parents) {
    if constexpr (detail::batch_scalars<T, DQ, DK, DV, DO>())
        detail::PagedAccess::prefill(pool, "batched_prefill", seqs, q_offsets, detail::sequence(Q),
                                     detail::sequence(K), detail::sequence(V), detail::output(std::forward<DO>(O)),
                                     executor, parents, true);
}

namespace detail {

/// Every row of a batch over memories has its row of Q, K, V and O: `rows` each.
template <class T>
void check_batch_rows(const char* function, const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K,
                      const ConstMatrixRef<T>& V, const MatrixRef<T>& O, Index rows, const char* what) {
    for (const auto& [name, shape] : {std::pair{"Q", detail::shape(Q)}, std::pair{"K", detail::shape(K)},
                                      std::pair{"V", detail::shape(V)}, std::pair{"O", detail::shape(O)}})
        require(shape.rows == rows, function, name, "has shape ", shape, ", expected ", rows, " rows (", what, ")");
}


/// batched_decode over memories (below), on views.
template <Memory M, class T>
void decode_memories(std::span<M> memories, ConstMatrixRef<T> Q, ConstMatrixRef<T> K, ConstMatrixRef<T> V,
                     MatrixRef<T> O, ExecutorRef executor) {
    constexpr const char* function = "batched_decode";
    const Index batch = static_cast<Index>(memories.size());
    detail::check_batch_rows<T>(function, Q, K, V, O, batch, "one per memory");
    for (Index i = 0; i < batch; ++i) {
        const M& mem = memories[static_cast<std::size_t>(i)];
        const ConstMatrixRef<T> q = Q.middleRows(i, 1), k = K.middleRows(i, 1), v = V.middleRows(i, 1);
        const MatrixRef<T> o = O.middleRows(i, 1);
        detail::check_sequences<M, T>(function, mem, q, k, v, o);
        detail::validate_pairs<M, T>(function, mem, k, v);
    }
    detail::require_disjoint(function, "O", O, "Q", Q);
    detail::require_disjoint(function, "O", O, "K", K);
    detail::require_disjoint(function, "O", O, "V", V);
    const auto cost = [&](Index i) { return 1.0 + static_cast<double>(memories[static_cast<std::size_t>(i)].length()); };
    if constexpr (detail::truncates_exactly<M>) {
        // An update copies one row into each cache: here, in order, so a throw knows which to cut.
        for (Index i = 0; i < batch; ++i) {
            try {
                memories[static_cast<std::size_t>(i)].update(K.row(i), V.row(i));
            } catch (...) {
                for (Index j = 0; j < i; ++j)
                    memories[static_cast<std::size_t>(j)].truncate(memories[static_cast<std::size_t>(j)].length() - 1);
                throw;
            }
        }
        try {
            detail::parallel_ranges(
                batch, cost,
                [&](Index first, Index last) {
                    for (Index i = first; i < last; ++i)
                        std::as_const(memories[static_cast<std::size_t>(i)]).attend(Q.row(i), O.row(i));
                },
                0, executor);
        } catch (...) {
            for (M& mem : memories)
                mem.truncate(mem.length() - 1);
            throw;
        }
    } else {
        const SerialExecutor serial;
        const bool may_throw = !executor.nothrow();
        const ExecutorRef run_on = may_throw && !detail::Checkpoint<M>::possible ? ExecutorRef(serial) : executor;
        detail::all_or_nothing(memories, may_throw, [&] {
            detail::parallel_ranges(
                batch, cost,
                [&](Index first, Index last) {
                    for (Index i = first; i < last; ++i)
                        detail::update_attend<M, T>(memories[static_cast<std::size_t>(i)], K.row(i), V.row(i),
                                                    Q.row(i), O.row(i));
                },
                0, run_on);
        });
    }
}

}  // namespace detail

/// One token for each memory of `memories` (one per sequence, any Memory: a
/// MultiHead of caches, the linear or gated memories of a hybrid model's recurrent
/// layers): row i of K/V updates memories[i], then row i of O = its attend of row i of Q;
/// the memories spread over the executor's threads (a memory's own threads then run on
/// the one it is given). Every row is checked first (Q, K, V and O of one row per memory,
/// their widths, and the values through each memory's validate where it has one), so a
/// bad row leaves every memory unchanged; so does a throw once they move (an executor
/// that fails, std::bad_alloc from a growing cache): caches that truncate exactly
/// (KVCache, SparseKVCache, layers of them) take their updates on the calling thread, the
/// attends on the executor, and are truncated back; other memories, through an executor
/// that may throw (ExecutorRef::nothrow), are copied first and put back (a copy per call:
/// give a noexcept parallel_for to spare it), or, when they cannot be copied, run on the
/// calling thread. With memattn's executors a step allocates nothing.
template <Memory M, class DQ, class DK, class DV, detail::EigenMatrix DO>
void batched_decode(std::span<M> memories, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                    const Eigen::MatrixBase<DV>& V, DO&& O, ExecutorRef executor = {}) {
    using T = typename M::Scalar;
    if constexpr (detail::batch_scalars<T, DQ, DK, DV, DO>())
        detail::decode_memories<M, T>(memories, detail::sequence(Q), detail::sequence(K), detail::sequence(V),
                                      detail::output(std::forward<DO>(O)), executor);
}

namespace detail {

/// batched_prefill over memories (below), on views.
template <Memory M, class T>
void prefill_memories(std::span<M> memories, std::span<const Index> q_offsets, ConstMatrixRef<T> Q,
                      ConstMatrixRef<T> K, ConstMatrixRef<T> V, MatrixRef<T> O, ExecutorRef executor) {
    constexpr const char* function = "batched_prefill";
    const Index batch = static_cast<Index>(memories.size());
    detail::check_offsets(function, q_offsets, batch, K.rows());
    const auto first = [&](Index i) { return q_offsets[static_cast<std::size_t>(i)]; };
    const auto rows = [&](Index i) { return first(i + 1) - first(i); };
    detail::check_batch_rows<T>(function, Q, K, V, O, K.rows(), "the rows of K, which q_offsets cut");
    for (Index i = 0; i < batch; ++i)
        detail::check_sequences<M, T>(function, memories[static_cast<std::size_t>(i)], Q.middleRows(first(i), rows(i)),
                                      K.middleRows(first(i), rows(i)), V.middleRows(first(i), rows(i)),
                                      O.middleRows(first(i), rows(i)));
    detail::require_disjoint(function, "O", O, "Q", Q);
    detail::require_disjoint(function, "O", O, "K", K);
    detail::require_disjoint(function, "O", O, "V", V);
    const SerialExecutor serial;
    const bool may_throw = !executor.nothrow();
    const ExecutorRef run_on = may_throw && !detail::Checkpoint<M>::possible ? ExecutorRef(serial) : executor;
    detail::all_or_nothing(memories, may_throw, [&] {
        detail::parallel_ranges(
            batch,
            [&](Index i) {
                const double n = static_cast<double>(rows(i));
                return 1.0 + n * (static_cast<double>(memories[static_cast<std::size_t>(i)].length()) + n);
            },
            [&](Index lo, Index hi) {
                for (Index i = lo; i < hi; ++i)
                    if (rows(i) > 0)
                        memattn::prefill(memories[static_cast<std::size_t>(i)], Q.middleRows(first(i), rows(i)),
                                K.middleRows(first(i), rows(i)), V.middleRows(first(i), rows(i)),
                                O.middleRows(first(i), rows(i)));
            },
            0, run_on);
    });
}

}  // namespace detail

/// A mixed batch over one Memory per sequence (chunked prefill beside decode, for the
/// recurrent layers of a hybrid model as for caches): memories[i] takes the rows
/// [q_offsets[i], q_offsets[i + 1]) of Q, K and V (a chunk, one token or none) through
/// memattn::prefill, its own whole-sequence kernel where it has one, so row r of O is
/// what that memory's prefill gives it, bit for bit; the memories spread over the
/// executor's threads by their work. Every memory's rows are checked first (Q, K, V and
/// O of the offsets' rows, their widths, and the values through its validate where it
/// has one), so a bad row leaves every memory unchanged; so does a throw once they move:
/// caches that truncate exactly are cut back to their lengths, and other memories,
/// through an executor that may throw, are copied first and put back (or, when they
/// cannot be copied, run on the calling thread).
template <Memory M, class DQ, class DK, class DV, detail::EigenMatrix DO>
void batched_prefill(std::span<M> memories, std::span<const Index> q_offsets, const Eigen::MatrixBase<DQ>& Q,
                     const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V, DO&& O,
                     ExecutorRef executor = {}) {
    using T = typename M::Scalar;
    if constexpr (detail::batch_scalars<T, DQ, DK, DV, DO>())
        detail::prefill_memories<M, T>(memories, q_offsets, detail::sequence(Q), detail::sequence(K),
                                       detail::sequence(V), detail::output(std::forward<DO>(O)), executor);
}

}  // namespace memattn
