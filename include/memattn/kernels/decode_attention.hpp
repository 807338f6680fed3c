#pragma once
// Decode attention: one query, or a group of queries (the query heads of one KV head),
// against runs of stored (key, value) pairs, in any storage type (storage/compact.hpp).
// Every cache's attend and attend_group and MultiHead's split attend call this header:
//
//   attend_contiguous   one query, pairs stored as T: Eigen's GEMVs while the run fits
//                       in cache, in address order with software prefetch once it does not
//   attend_stored       one query, pairs stored compactly: each row converted in
//                       registers inside its dot product and its value update (or, for
//                       IntegerDot<S>, its logit taken in integers on the rounded query)
//   GroupAttention      g <= 16 queries: each stored row is read (and converted) once for
//                       the whole group; fold() for runs of T, fold_stored() for any storage.
//                       Fewer queries than a packet's lanes (float, AVX2/AVX-512): tiles of
//                       GQ queries × GK keys (logit_tiles, value_tiles), rows converted in
//                       registers; a whole packet of queries: the tiled kernel's products;
//                       IntegerDot<Q8> keys: the logits in integers, sixteen keys at a
//                       time with AVX-512 VNNI, eight with AVX2 (StoredRows<T,
//                       Q8>::integer_logits);
//                       FpMath::bf16 over bfloat16 or FP8 rows with AVX512-BF16: the
//                       stored values multiplied as bfloat16 words by vdpbf16ps
//                       (fold_bf16; an FP8 byte read as its exact word), or in AMX
//                       tiles where the CPU runs them (fold_amx, kernels/group_amx.hpp)
//   MemoryAttention     a group of a memory's queries over its runs, with its options
//   attend_memory_group every query of a memory's attend_group
//
// A run is given as (keys, values, first, n): the rows [first, first + n) of two
// detail::StoredRows. A split attend folds parts of the runs into partial softmax states
// (softmax_state.hpp) and merges them in a fixed order, so its bits do not depend on
// how the parts were spread over threads.
//
// Measured (bench/decode_bench.cpp, AMD EPYC family 25 model 17: Zen 4 class, AVX-512 run
// as two 256-bit halves, 2 cores; docs/performance.md, "Decode at the roofline"): a
// 32/8 × 128 layer's step at 32768 tokens on one thread runs at 0.58–0.62 of its roofline
// for every storage but Q8 (0.43), and on two at 0.66–0.76 (Q8 0.45); bfloat16 and
// float16 step 1.8–2× faster than float. What is left between the fraction and 1:
// - for a group of 4 or 8 the step is as much arithmetic as reading: g·d multiply-adds
//   per key for the logits and as many for the values, at the FMA peak 4.5 ms for this
//   step, against 6 ms to read it in bfloat16. The kernel runs at 0.5–0.6 of the FMA peak
//   in cache: besides the multiply-adds, each packet of a compact row costs its
//   conversion (two instructions for bfloat16, three for Q8: widen, convert, scale), the
//   logits' transpose-and-add network 3 instructions per logit, the online softmax one
//   exponential per logit. On AVX-512 cores that run 512-bit operations in two halves,
//   these share the ports of the multiply-adds;
// - so Q8, with a quarter of float's bytes, is bound by that arithmetic, not by memory:
//   an integer Q·K removes the keys' conversion (IntegerDot<S>: attend_stored for one
//   query, and for a group of Q8 keys GroupAttention::fold_integer with AVX-512 VNNI);
// - float is bound by memory but reaches only ~0.6 of a streaming read on one thread: the
//   reads of the four rows of a tile and of the values interleave with the arithmetic, and
//   the core's line-fill buffers, not the bandwidth, cap what is in flight (the software
//   prefetches stall on them); two threads reach 0.7.
//
// The parts: kernels/query_attention.hpp (one query), kernels/group_attention.hpp (a
// group, GroupAttention), kernels/group_amx.hpp (its FpMath::bf16 products in AMX
// tiles); this header the memories' side (MemoryAttention, attend_memory_group).

#include "memattn/kernels/group_attention.hpp"
#include "memattn/kernels/query_attention.hpp"
#include "memattn/detail/assert.hpp"
#include "memattn/detail/packet.hpp"
#include "memattn/detail/tile_product.hpp"
#include "memattn/kernels/softmax_options.hpp"
#include "memattn/softmax_state.hpp"
#include "memattn/storage/compact.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <limits>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace memattn::detail {

/// A memory with logit options (KVCache, SlidingWindowCache, HybridCache): options()
/// (kernels/softmax_options.hpp) and pair_position(i), the token position ALiBi gives
/// the i-th pair its attend reads (in for_each_stored_run's order).
template <class M>
concept PlacesPairs = requires(const M& m, Index i) {
    { m.options() } -> std::convertible_to<SoftmaxOptions>;
    { m.pair_position(i) } -> std::convertible_to<Index>;
};

/// A memory that may store its keys turned by RoPE (positional/rope.hpp): when
/// turns_queries(), its attend turns the query to query_position(i) for the i-th pair,
/// by turn_query(row, cols, position), in place.
template <class M>
concept TurnsQueries = requires(const M& m, typename M::Scalar* row, Index i) {
    { m.turns_queries() } -> std::convertible_to<bool>;
    { m.query_position(i) } -> std::convertible_to<Index>;
    m.turn_query(row, i, i);
};

/// A grouped attend's queries rewritten for GroupAttention (requery): g × d values on the
/// stack up to group_rows × max_depth, else on the heap (a head wider than max_depth: the
/// one allocation). rounded() gives them rounded to bfloat16 (nearest even, Eigen's
/// cast): FpMath::bf16 where GroupAttention does not round them itself (rounds_queries).
template <class T>
class QueryBuffer {
public:
    QueryBuffer() noexcept {}  // (not value-initialised: the stack's values are written before they are read)

    /// Room for g × d values, row-major (its contents are the last ones written).
    Eigen::Map<Matrix<T>> rows(Index g, Index d) {
        T* rows = stack_;
        if (g * d > stack_values) {
            heap_.resize(static_cast<std::size_t>(g * d));
            rows = heap_.data();
        }
        return {rows, g, d};
    }
    /// `queries` rounded to bfloat16, as float, in the buffer.
    template <class QB>
    Eigen::Map<Matrix<T>> rounded(const QB& queries) {
        Eigen::Map<Matrix<T>> out = rows(queries.rows(), queries.cols());
        out = queries.template cast<Eigen::bfloat16>().template cast<T>();
        return out;
    }

private:
    static constexpr Index stack_values = group_rows * GroupAttention<T>::max_depth;
    alignas(64) T stack_[stack_values];
    std::vector<T> heap_;
};

/// What GroupAttention does with a memory's logit options for its queries from r0 on, at
/// its newest token (none for a memory without them).
template <class M>
DecodeLogits decode_logits(const M& m, Index r0) {
    if constexpr (PlacesPairs<M>)
        return DecodeLogits::of(m.options(), m.length() - 1).from(r0);
    else
        return {};
}

/// g ≤ group_rows queries of one attend of memory m (rows r0 .. r0 + g − 1 of the
/// queries its attend_group takes) over its stored pairs: GroupAttention with the
/// memory's logit options, each fold's keys at their pair_position (ALiBi), and, for a
/// memory that turns queries (RoPE), the queries turned to each run's query_position,
/// in a buffer of its own (on the stack up to group_rows × max_depth values). With
/// FpMath::bf16 the queries are rounded to bfloat16 (after turning): by GroupAttention's
/// fold_bf16 where it runs (rounds_queries), else in that buffer.
template <class T, class M>
class MemoryAttention {
public:
    template <class QB>
    MemoryAttention(const M& m, const QB& queries, Index r0, bool ahead)
        : m_(m), queries_(queries.data(), queries.rows(), queries.cols(), Eigen::OuterStride<>(queries.outerStride())),
          logits_(decode_logits(m, r0)), group_(queries, static_cast<T>(m.scale()), ahead, logits_) {
        if (logits_.bf16_products && !group_.rounds_queries())
            group_.requery(buffer_.rounded(queries_));
    }

    /// Folds the pairs [begin, end) of the ones attend reads (for_each_stored_run's
    /// order) into the states and `acc` (g × dv, zero before the first fold).
    template <class Acc>
    void fold(Index begin, Index end, Acc& acc) {
        Index offset = 0;
        m_.for_each_stored_run([&](const auto& keys, const auto& values, Index first, Index n) {
            const Index b = std::max(begin, offset), e = std::min(end, offset + n);
            if (b < e) {
                if constexpr (TurnsQueries<M>)
                    if (m_.turns_queries())
                        turn_to(m_.query_position(b));
                Index position = 0;
                if constexpr (PlacesPairs<M>)
                    position = logits_.slopes != nullptr ? m_.pair_position(b) : 0;
                group_.fold_stored(keys, values, first + b - offset, e - b, acc, position);
            }
            offset += n;
        });
    }

    /// Query r's state (its sink logit not yet in it: GroupAttention::state).
    [[nodiscard]] SoftmaxState<T> state(Index r) const { return group_.state(r); }
    /// Query r's output (GroupAttention::finish).
    template <class Row>
    void finish(Index r, Row&& acc) const {
        group_.finish(r, acc);
    }

private:
    using QueryMap = Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>>;

    /// The queries turned to position p (from the memory's own, each time anew).
    void turn_to(Index p) {
        if (p == turned_at_)
            return;
        Eigen::Map<Matrix<T>> rows = buffer_.rows(queries_.rows(), queries_.cols());
        rows = queries_;
        m_.turn_query(rows.data(), rows.size(), p);  // one packed row of g heads: the angles once
        if (logits_.bf16_products && !group_.rounds_queries())
            rows = rows.template cast<Eigen::bfloat16>().template cast<T>();
        group_.requery(rows);
        turned_at_ = p;
    }

    const M& m_;
    QueryMap queries_;
    DecodeLogits logits_;
    GroupAttention<T> group_;
    Index turned_at_ = std::numeric_limits<Index>::min();
    QueryBuffer<T> buffer_;  // the queries turned or rounded
};

/// Pairs a memory's attend reads: the sum of its runs.
template <class M>
Index stored_pairs(const M& m) {
    Index n = 0;
    m.for_each_stored_run([&n](const auto&, const auto&, Index, Index count) { n += count; });
    return n;
}

/// out (g×dv) = a memory's grouped attend of the rows of `queries` (g×d) over every pair
/// it reads (MemoryAttention, group_rows queries at a time); rows with no visible pair
/// get zero. Each stored row is read once per group of group_rows queries. Allocates
/// nothing (but for RoPE on heads wider than GroupAttention::max_depth).
template <class T, class M>
void attend_memory_group(const M& m, const ConstMatrixRef<T>& queries, MatrixRef<T>& out) {
    const bool ahead = beyond_l2([&m](const auto& f) { m.for_each_stored_run(f); });
    const Index pairs = stored_pairs(m);
    for (Index r0 = 0; r0 < queries.rows(); r0 += group_rows) {
        const Index g = std::min(group_rows, queries.rows() - r0);
        auto acc = out.middleRows(r0, g);
        acc.setZero();
        MemoryAttention<T, M> attention(m, queries.middleRows(r0, g), r0, ahead);
        attention.fold(0, pairs, acc);
        for (Index r = 0; r < g; ++r)
            attention.finish(r, acc.row(r));
    }
}

/// One query of a memory's attend through attend_memory_group (a 1 × d group): how a
/// memory with logit options or RoPE attends.
template <class T, class M>
void attend_memory_one(const M& m, const ConstRowRef<T>& query, RowRef<T>& out) {
    const Eigen::Map<const Matrix<T>> q(query.data(), 1, query.size());
    Eigen::Map<Matrix<T>> o(out.data(), 1, out.size());
    MatrixRef<T> rows(o);
    attend_memory_group<T>(m, q, rows);
}

}  // namespace memattn::detail
