#pragma once
// A whole attention layer in one call: every query head of every sequence of a batch,
// on every core (docs/design.md, "Multi-head layers").
//
//   multi_head_causal_softmax_attention(Q, K, V, O, layout[, options][, batch])
//   multi_head_causal_softmax_attention(Q, K, V, O, lse, layout[, options][, batch])
//   multi_head_chunked_linear_attention(Q, K, V, O, layout[, phi][, options][, states][, batch])
//
// Buffers and batches: layer/head_layout.hpp. A multi-head call is many single-head
// calls plus a schedule (execution/parallel.hpp):
//
// - Softmax: the work items are (sequence, KV head, tile of queries, up to
//   max_heads_together query heads of the group), in that order. An item's heads walk
//   the key tiles together (detail::causal_softmax_heads: each K/V tile folded into
//   every head's query tile before the next, so it is read into cache once for them),
//   each the single-head kernel on its queries against the keys up to its last query,
//   with the sequence's tiles, so every output is bitwise the one of
//   causal_softmax_attention on that head and sequence.
//   Items cost (queries × keys they see) and are cut into equal-cost ranges per thread.
// - Linear: the state μ/ν depends only on K and V, so it belongs to a (sequence, KV
//   head), and the query heads of a group share it: one pass over K/V per group, the
//   queries of the group against each chunk (detail::chunked_form). When there are
//   fewer (sequence, KV head) pairs than threads a group is split into sub-groups of
//   query heads that each carry the state (the fold is repeated, the outputs are not),
//   so MQA still uses every core. Outputs are bitwise those of chunked_linear_attention
//   per query head whatever the split.
//
// Threads: OpenMP when the translation unit is built with it (the memattn::memattn
// target adds it when CMake finds it), else serial; the same bits either way.

#include "memattn/kernels/causal_softmax.hpp"
#include "memattn/kernels/linear_attention.hpp"
#include "memattn/layer/head_layout.hpp"
#include "memattn/execution/parallel.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <array>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace memattn {
namespace detail {

/// One softmax work item: query rows [q_begin, q_begin + rows) of query heads [head, head
/// + heads) (of one KV head, walking the key tiles together: causal_softmax_heads),
/// sequence `seq`.
struct SoftmaxItem {
    std::size_t seq;
    Index head, q_begin, rows;
    Index heads = 1;
};

/// The items of a softmax call, in schedule order (see the top of the file).
inline std::vector<SoftmaxItem> softmax_items(const HeadLayout& layout, const VarLen& batch, Index q_rows,
                                              Index k_rows, const SoftmaxOptions& options) {
    std::vector<SoftmaxItem> items;
    const Index g = layout.group_size(), together = static_cast<Index>(max_heads_together);
    for (std::size_t b = 0; b < sequence_count(batch); ++b) {
        const SequenceSpan span = sequence_span(batch, b, q_rows, k_rows);
        const Index tile = default_tiles(effective_window(options.window, span.k_rows)).queries;
        for (Index kv = 0; kv < layout.kv_heads; ++kv)
            for (Index i0 = 0; i0 < span.q_rows; i0 += tile)
                for (Index m = 0; m < g; m += together)
                    items.push_back({b, kv * g + m, i0, std::min(tile, span.q_rows - i0), std::min(together, g - m)});
    }
    return items;
}

/// Keys an item's queries see, summed (at its middle query), plus a per-item constant.
inline double softmax_item_cost(const SoftmaxItem& item, const SequenceSpan& span, const SoftmaxOptions& options) {
    const Index window = effective_window(options.window, span.k_rows);
    const Index position = span.k_rows - span.q_rows + item.q_begin + item.rows / 2;
    Index keys = options.causal ? position + 1 : span.k_rows;
    if (window > 0)
        keys = std::min(keys, options.causal ? window : 2 * window - 1) +
               std::min(options.sink_tokens, std::max<Index>(0, position + 1 - window));
    return static_cast<double>(item.rows * item.heads) * static_cast<double>(keys + 64);
}

/// One KV head's keys and values for one sequence, and the scale its heads use.
/// `group`: the logit options of its group of query heads (a memory's: spans of one
/// value per query head of the group, or none), taking the place of the call's softcap,
/// slopes and sink logits; absent: the call's.
template <class T>
struct HeadKeys {
    ConstMatrixRef<T> keys, values;
    double scale;
    std::optional<SoftmaxOptions> group = std::nullopt;
};

/// One KV head's keys and values of one sequence, contiguous. A head's columns of a packed
/// [tokens, kv_heads·d] buffer have rows kv_heads·d apart, so a sequence of 4096 keys
/// spans 8–16 MiB of pages for 1–2 MiB of data, more pages than the TLB maps: every
/// query tile's pass over the keys then misses it. Measured (N = 4096, float, one
/// thread, Zen 1): one head of an 8-head buffer ran at 0.71–0.75× the speed of the same
/// head stored alone, and packing each tile as it is read did not help (its copy touches
/// the same pages). So each thread copies the head it works on once, N·(d + dv) values
/// (1–2% of the head's work), into a buffer it reuses for the next head.
template <class T>
class HeadCopy {
public:
    /// The source's keys and values as contiguous rows: in place when they already are.
    std::pair<ConstMatrixRef<T>, ConstMatrixRef<T>> contiguous(const HeadKeys<T>& source, std::size_t seq, Index kv) {
        const bool strided = source.keys.outerStride() != source.keys.cols() ||
                             source.values.outerStride() != source.values.cols();
        if (!strided || source.keys.rows() <= 1)
            return {source.keys, source.values};
        const Index n = source.keys.rows();
        if (seq != seq_ || kv != kv_) {
            if (keys_.rows() < n || keys_.cols() != source.keys.cols())
                keys_.resize(n, source.keys.cols());
            if (values_.rows() < n || values_.cols() != source.values.cols())
                values_.resize(n, source.values.cols());
            keys_.topRows(n) = source.keys;
            values_.topRows(n) = source.values;
            seq_ = seq;
            kv_ = kv;
        }
        return {keys_.topRows(n), values_.topRows(n)};
    }

private:
    Matrix<T> keys_, values_;
    std::size_t seq_ = static_cast<std::size_t>(-1);
    Index kv_ = -1;
};

/// Whether a call of T rounds its inputs to bfloat16 for the products (FpMath::bf16, float).
template <class T>
[[nodiscard]] constexpr bool rounds_to_bf16(const SoftmaxOptions& options) noexcept {
    return std::is_same_v<T, float> && options.fpmath == FpMath::bf16;
}

/// The softmax layer after the checks, over any source of keys: `head_keys(span, kv)`
/// gives KV head kv's HeadKeys for a sequence; lse(row, head, value) receives each
/// log-sum-exp. `k_rows` is the keys' row count that the batch's offsets index.
/// `bias_at(row0, head)`: a dense bias (DenseBias, whose tile() the kernel reads) with its
/// row row0 query head `head`'s item's query 0; none by default.
/// Q, K and V of bfloat16 or float16 compute in float (causal_softmax_converted), O of
/// that type or float.
template <class T, class HeadKeysOf, class LseSink, class Out = T, class BiasAt = NoBias>
void multi_head_softmax_run(const ConstMatrixRef<T>& Q, MatrixRef<Out>& O, LseSink&& lse, const HeadLayout& layout,
                            const SoftmaxOptions& options, const VarLen& batch, Index k_rows,
                            const HeadKeysOf& head_keys, ExecutorRef executor = {}, const BiasAt& bias_at = {}) {
    using A = arithmetic_t<T>;
    const Index d = layout.head_dim, dv = layout.values();
    const std::vector<SoftmaxItem> items = softmax_items(layout, batch, Q.rows(), k_rows, options);
    const auto span_of = [&](const SoftmaxItem& item) { return sequence_span(batch, item.seq, Q.rows(), k_rows); };
    parallel_ranges(
        static_cast<Index>(items.size()),
        [&](Index i) {
            const SoftmaxItem& item = items[static_cast<std::size_t>(i)];
            return softmax_item_cost(item, span_of(item), options);
        },
        [&](Index first, Index last) {
            // Per tile shape, one per head of an item, made on first use.
            std::array<std::optional<SoftmaxScratch<A>>, max_heads_together> full, windowed;
            HeadCopy<T> copy;
            // FpMath::bf16 (float inputs): the KV head rounded to bfloat16 once per sequence and
            // KV head on this thread (as it is copied), an item's queries per item.
            [[maybe_unused]] std::array<Matrix<Eigen::bfloat16>, max_heads_together> rounded_q;
            [[maybe_unused]] Matrix<Eigen::bfloat16> rounded_k, rounded_v;
            [[maybe_unused]] Index rounded_seq = -1, rounded_kv = -1;
            SharedValueTile value_tile;  // bfloat16 pairs: an item's value tile, packed once for its heads
            for (Index i = first; i < last; ++i) {
                const SoftmaxItem& item = items[static_cast<std::size_t>(i)];
                const SequenceSpan span = span_of(item);
                const SoftmaxTiles tiles = default_tiles(effective_window(options.window, span.k_rows));
                auto& scratch = tiles == SoftmaxTiles{} ? full : windowed;
                const auto heads = static_cast<std::size_t>(item.heads);
                for (std::size_t h = 0; h < heads; ++h)
                    if (!scratch[h])
                        scratch[h].emplace(d, dv, tiles);
                const Index kv = layout.kv_head_of(item.head);
                const HeadKeys<T> source = head_keys(span, kv);
                const auto [keys, values] = copy.contiguous(source, item.seq, kv);
                // Causal: keys up to the item's last query, its queries bottom-right aligned.
                // Both ways: every key, the item's queries at their positions in the sequence.
                // A tree (parents) needs the whole sequence's keys to place its new tokens.
                const Index first = span.k_rows - span.q_rows + item.q_begin;
                const bool trailing = options.causal && options.parents.empty();
                const Index visible = trailing ? first + item.rows : span.k_rows;
                const Index row0 = span.q_begin + item.q_begin, offset = trailing ? trailing_queries : first;
                std::array<SoftmaxOptions, max_heads_together> one;
                using Bias = std::decay_t<decltype(bias_at(row0, item.head))>;
                std::array<std::optional<Bias>, max_heads_together> bias;  // read by the kernel below
                for (std::size_t h = 0; h < heads; ++h) {
                    const Index head = item.head + static_cast<Index>(h);
                    one[h] = head_options(options, head);
                    if (source.group) {
                        const SoftmaxOptions member = head_options(*source.group, head - kv * layout.group_size());
                        one[h].softcap = member.softcap;
                        one[h].alibi_slopes = member.alibi_slopes;
                        one[h].sink_logits = member.sink_logits;
                    }
                    one[h].scale = source.scale;
                    bias[h].emplace(bias_at(row0, head));
                }
                const auto options_of = [&](std::size_t h) -> const SoftmaxOptions& { return one[h]; };
                const auto scratch_of = [&](std::size_t h) -> SoftmaxScratch<A>& { return *scratch[h]; };
                const auto bias_of = [&](std::size_t h) { return bias[h]->template tile<A>(); };
                const auto sink = [&](std::size_t h, Index r, A value) {
                    lse(row0 + r, item.head + static_cast<Index>(h), value);
                };
                const auto output = [&](std::size_t h) {
                    return MatrixRef<Out>(O.block(row0, (item.head + static_cast<Index>(h)) * dv, item.rows, dv));
                };
                const auto query = [&](std::size_t h) {
                    return ConstMatrixRef<T>(Q.block(row0, (item.head + static_cast<Index>(h)) * d, item.rows, d));
                };
                if constexpr (LowPrecision<T>)
                    causal_softmax_converted_heads<T, Out>(heads, query, keys.topRows(visible), values.topRows(visible),
                                                           output, sink, options_of, scratch_of, offset, bias_of,
                                                           value_tile);
                else if (rounds_to_bf16<T>(options)) {
                    if constexpr (std::is_same_v<T, float>) {
                        using E = Eigen::bfloat16;
                        if (rounded_seq != static_cast<Index>(item.seq) || rounded_kv != kv) {
                            rounded_k = keys.template cast<E>();
                            rounded_v = values.template cast<E>();
                            rounded_seq = static_cast<Index>(item.seq);
                            rounded_kv = kv;
                        }
                        for (std::size_t h = 0; h < heads; ++h)
                            if (rounded_q[h].rows() < item.rows || rounded_q[h].cols() != d)
                                rounded_q[h].resize(std::max(item.rows, tiles.queries), d);
                        round_query_heads(Q.data() + row0 * Q.outerStride() + item.head * d, Q.outerStride(),
                                          item.rows, d, heads, rounded_q.data());
                        const auto rounded = [&](std::size_t h) {
                            return ConstMatrixRef<E>(rounded_q[h].topRows(item.rows));
                        };
                        causal_softmax_converted_heads<E, Out>(heads, rounded, rounded_k.topRows(visible),
                                                               rounded_v.topRows(visible), output, sink, options_of,
                                                               scratch_of, offset, bias_of, value_tile);
                    }
                } else {
                    const auto plain = [&](std::size_t h) { return PlainRows<T>(query(h)); };
                    causal_softmax_heads<T, Out>(heads, plain, PlainRows<T>(keys.topRows(visible)),
                                                 PlainRows<T>(values.topRows(visible)), output, sink, options_of,
                                                 scratch_of, offset, bias_of);
                }
            }
        },
        0, executor);
}

/// The softmax layer on packed K/V buffers, after the checks.
template <class T, class Out, class LseSink>
void multi_head_softmax_views(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                              MatrixRef<Out> O, LseSink&& lse, const HeadLayout& layout, const SoftmaxOptions& options,
                              const VarLen& batch, ExecutorRef executor) {
    const Index d = layout.head_dim, dv = layout.values();
    multi_head_softmax_run<T>(
        Q, O, lse, layout, options, batch, K.rows(),
        [&](const SequenceSpan& span, Index kv) {
            return HeadKeys<T>{K.block(span.k_begin, kv * d, span.k_rows, d),
                               V.block(span.k_begin, kv * dv, span.k_rows, dv), options.scale};
        },
        executor);
}

template <class T, class Out>
void check_softmax_layer(const char* function, const HeadLayout& layout, const ConstMatrixRef<T>& q,
                         const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v, const MatrixRef<Out>& o,
                         const SoftmaxOptions& options, const VarLen& batch) {
    check_layout(function, layout);
    check_packed(function, layout, shape(q), shape(k), shape(v), shape(o));
    check_varlen(function, batch, q.rows(), k.rows(), options.causal);
    // The per-head checks on one head's shapes (options; Nq <= Nk was checked per sequence).
    check_softmax_arguments<arithmetic_t<T>>(function, {0, layout.head_dim}, {0, layout.head_dim},
                                             {0, layout.values()}, {0, layout.values()}, options, layout.q_heads);
    if (!options.parents.empty()) {
        require(sequence_count(batch) == 1, function, "options.parents",
                "is given with a varlen batch of ", sequence_count(batch), " sequences: a tree is one sequence's");
        require(static_cast<Index>(options.parents.size()) == q.rows(), function, "options.parents", "has ",
                options.parents.size(), " entries, expected ", q.rows(), " (one per row of Q: the new tokens)");
    }
    check_disjoint(function, "O", o, q, k, v);
}

}  // namespace detail

/// The causal softmax attention of every query head of every sequence (see the top of
/// the file and layer/head_layout.hpp): O[:, h·dv, dv] is causal_softmax_attention of
/// Q's head h over K/V's head h / (q_heads / kv_heads), sequence by sequence. Throws
/// std::invalid_argument, writing nothing, on a bad layout, shapes, options or offsets.
/// The work runs on `executor` (execution/executor.hpp; the default: every core with
/// OpenMP), the same bits on any.
template <class DQ, class DK, class DV, detail::EigenMatrix DO>
void multi_head_causal_softmax_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                         const Eigen::MatrixBase<DV>& V, DO&& O, const HeadLayout& layout,
                                         const SoftmaxOptions& options = {}, const VarLen& batch = {},
                                         ExecutorRef executor = {}) {
    using T = typename DQ::Scalar;
    using A = arithmetic_t<T>;
    using Out = typename std::remove_cvref_t<DO>::Scalar;
    static_assert(Scalar<T> || LowPrecision<T>, "memattn::multi_head_causal_softmax_attention: the scalar type must "
                                                "be float, double, Eigen::bfloat16 or Eigen::half.");
    static_assert(detail::same_scalar<DQ, DK, DV>,
                  "memattn::multi_head_causal_softmax_attention: Q, K and V must have the same scalar type.");
    static_assert(std::is_same_v<Out, T> || std::is_same_v<Out, A>,
                  "memattn::multi_head_causal_softmax_attention: O must have the scalar type of Q (of bfloat16 or "
                  "half: or float).");
    constexpr const char* function = "multi_head_causal_softmax_attention";
    const ConstMatrixRef<T> q = detail::sequence(Q), k = detail::sequence(K), v = detail::sequence(V);
    MatrixRef<Out> o = detail::output(std::forward<DO>(O));
    detail::check_softmax_layer<T>(function, layout, q, k, v, o, options, batch);
    detail::multi_head_softmax_views<T>(q, k, v, o, [](Index, Index, A) {}, layout, options, batch, executor);
}

/// As above with a dense `bias` (any Eigen expression of the scalar type, or of bool as a
/// mask) added to the logits as causal_softmax_attention adds it: Nq × Nk for every head,
/// or q_heads·Nq × Nk for one of its own per query head (head h's in the Nq rows from
/// row h·Nq on: PyTorch's attn_mask of shape (H, L, S), flattened); one sequence, no
/// varlen.
template <class DQ, class DK, class DV, detail::EigenMatrix DO, class DB>
void multi_head_causal_softmax_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                         const Eigen::MatrixBase<DV>& V, DO&& O, const HeadLayout& layout,
                                         const SoftmaxOptions& options, const Eigen::MatrixBase<DB>& bias,
                                         ExecutorRef executor = {}) {
    using T = typename DQ::Scalar;
    using A = arithmetic_t<T>;
    using Out = typename std::remove_cvref_t<DO>::Scalar;
    static_assert(Scalar<T> || LowPrecision<T>, "memattn::multi_head_causal_softmax_attention: the scalar type must "
                                                "be float, double, Eigen::bfloat16 or Eigen::half.");
    static_assert(detail::same_scalar<DQ, DK, DV>,
                  "memattn::multi_head_causal_softmax_attention: Q, K and V must have the same scalar type.");
    static_assert(std::is_same_v<Out, T> || std::is_same_v<Out, A>,
                  "memattn::multi_head_causal_softmax_attention: O must have the scalar type of Q (of bfloat16 or "
                  "half: or float).");
    static_assert(std::is_same_v<typename DB::Scalar, A> || std::is_same_v<typename DB::Scalar, bool>,
                  "memattn::multi_head_causal_softmax_attention: the bias must have Q's scalar type (float for "
                  "bfloat16 or half) or bool.");
    constexpr const char* function = "multi_head_causal_softmax_attention";
    const ConstMatrixRef<T> q = detail::sequence(Q), k = detail::sequence(K), v = detail::sequence(V);
    MatrixRef<Out> o = detail::output(std::forward<DO>(O));
    detail::check_softmax_layer<T>(function, layout, q, k, v, o, options, {});
    const Index per_head_rows =
        detail::checked_product(function, "Q", layout.q_heads, q.rows(), "q_heads x Nq, the rows of a per-head bias,");
    const bool per_head = bias.rows() == per_head_rows && layout.q_heads > 1;
    detail::require((bias.rows() == q.rows() || per_head) && bias.cols() == k.rows(), function, "bias", "has shape ",
                    detail::shape(bias), ", expected ", q.rows(), 'x', k.rows(), " (Nq x Nk, every head) or ",
                    per_head_rows, 'x', k.rows(), " (q_heads·Nq x Nk, one per query head)");
    detail::require(options.parents.empty(), function, "bias",
                    "is given with options.parents: a tree mask and a dense bias do not combine");
    detail::check_bias_disjoint(function, o, bias);
    const Index d = layout.head_dim, dv = layout.values();
    detail::multi_head_softmax_run<T>(
        q, o, [](Index, Index, A) {}, layout, options, {}, k.rows(),
        [&](const detail::SequenceSpan& span, Index kv) {
            return detail::HeadKeys<T>{k.block(span.k_begin, kv * d, span.k_rows, d),
                                       v.block(span.k_begin, kv * dv, span.k_rows, dv), options.scale};
        },
        executor, [&bias, per_head, nq = q.rows()](Index row0, Index head) {
            return detail::DenseBias<DB>{&bias.derived(), per_head ? head * nq + row0 : row0};
        });
}

/// As above, and writes lse(i, h) = log(e^{σ_h} + Σ_{j visible} e^{s_ij}) into `lse`, a
/// tokens × q_heads matrix of the scalar type: s_ij = scale · q_ih·k_j after the softcap
/// and head h's ALiBi slope, σ_h head h's sink logit when given (causal_softmax_attention's
/// lse); −∞ where a row sees no key and has no sink logit.
template <class DQ, class DK, class DV, detail::EigenMatrix DO, detail::EigenMatrix DL>
void multi_head_causal_softmax_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                         const Eigen::MatrixBase<DV>& V, DO&& O, DL&& lse, const HeadLayout& layout,
                                         const SoftmaxOptions& options = {}, const VarLen& batch = {},
                                         ExecutorRef executor = {}) {
    using T = typename DQ::Scalar;
    using A = arithmetic_t<T>;
    using Out = typename std::remove_cvref_t<DO>::Scalar;
    static_assert(Scalar<T> || LowPrecision<T>, "memattn::multi_head_causal_softmax_attention: the scalar type must "
                                                "be float, double, Eigen::bfloat16 or Eigen::half.");
    static_assert(detail::same_scalar<DQ, DK, DV>,
                  "memattn::multi_head_causal_softmax_attention: Q, K and V must have the same scalar type.");
    static_assert(std::is_same_v<Out, T> || std::is_same_v<Out, A>,
                  "memattn::multi_head_causal_softmax_attention: O must have the scalar type of Q (of bfloat16 or "
                  "half: or float).");
    static_assert(std::is_same_v<typename std::remove_cvref_t<DL>::Scalar, A>,
                  "memattn::multi_head_causal_softmax_attention: lse must have Q's scalar type (float for bfloat16 "
                  "or half).");
    constexpr const char* function = "multi_head_causal_softmax_attention";
    const ConstMatrixRef<T> q = detail::sequence(Q), k = detail::sequence(K), v = detail::sequence(V);
    MatrixRef<Out> o = detail::output(std::forward<DO>(O));
    detail::check_softmax_layer<T>(function, layout, q, k, v, o, options, batch);
    detail::require(lse.rows() == Q.rows() && lse.cols() == layout.q_heads, function, "lse", "has shape ",
                    detail::shape(lse), ", expected ", Q.rows(), 'x', layout.q_heads, " (Q's rows x q_heads)");
    if constexpr (detail::check_output<DL, false>()) {
        detail::check_disjoint(function, "lse", lse, q, k, v);
        detail::require_disjoint(function, "lse", lse, "O", o);
        detail::multi_head_softmax_views<T>(
            q, k, v, o, [&lse](Index i, Index h, A value) { lse.coeffRef(i, h) = value; }, layout, options, batch,
            executor);
    }
}

namespace detail {

/// The chunked form over one item, through contiguous copies of its rows when they are
/// strided (a head's columns of a packed buffer), `rows` tokens at a time: rows far apart
/// start a new stream each, which the hardware prefetcher does not follow; a bulk copy
/// keeps many of them in flight. Measured (8 heads, N = 4096, float, one thread, Zen 1):
/// 1.2× faster at d = 64, the same at d = 128. The blocks are whole chunks and the state
/// is carried exactly, so the outputs are bitwise those of one call on the strided views.
/// Inputs of bfloat16 or float16 always go block by block, converted to float on the
/// copy (and the outputs rounded on the way back): bitwise the single-head call on them.
template <class E>
class LinearStage {
    using T = arithmetic_t<E>;

public:
    static constexpr Index rows = 256;

    template <class Out, class Phi>
    void run(const ConstMatrixRef<E>& Q, const ConstMatrixRef<E>& K, const ConstMatrixRef<E>& V, MatrixRef<Out> O,
             const Phi& phi, const LinearOptions& options, Index features, LinearState<T>& state) {
        const bool strided = Q.outerStride() != Q.cols() || K.outerStride() != K.cols() ||
                             V.outerStride() != V.cols() || O.outerStride() != O.cols();
        const Index n = Q.rows();
        if constexpr (std::is_same_v<E, T>) {
            if (!strided || n <= rows) {
                chunked_form<T>(Q, K, V, O, phi, options, features, state);
                return;
            }
        }
        const Index block = std::max<Index>(1, rows / options.chunk_size) * options.chunk_size;
        q_.resize(block, Q.cols());
        k_.resize(block, K.cols());
        v_.resize(block, V.cols());
        o_.resize(block, O.cols());
        for (Index start = 0; start < n; start += block) {
            const Index m = std::min(block, n - start);
            q_.topRows(m) = Q.middleRows(start, m).template cast<T>();
            k_.topRows(m) = K.middleRows(start, m).template cast<T>();
            v_.topRows(m) = V.middleRows(start, m).template cast<T>();
            chunked_form<T>(q_.topRows(m), k_.topRows(m), v_.topRows(m), o_.topRows(m), phi, options, features, state,
                            n);
            O.middleRows(start, m) = o_.topRows(m).template cast<Out>();
        }
    }

private:
    Matrix<T> q_, k_, v_, o_;  // reused by every item of a thread (resize keeps a same-size buffer)
};

/// One linear work item: query heads [first, first + members) of KV head `kv`, sequence `seq`.
struct LinearItem {
    std::size_t seq;
    Index kv, first, members;
};

/// T: the scalar the call computes in, E the inputs', Out the outputs'.
template <class T, class E, class Out, class Phi>
void check_linear_layer(const char* function, const HeadLayout& layout, const Phi& phi, const ConstMatrixRef<E>& q,
                        const ConstMatrixRef<E>& k, const ConstMatrixRef<E>& v, const MatrixRef<Out>& o,
                        const LinearOptions& options, std::span<LinearState<T>> states, const VarLen& batch,
                        Index& features) {
    check_layout(function, layout);
    check_packed(function, layout, shape(q), shape(k), shape(v), shape(o));
    check_varlen(function, batch, q.rows(), k.rows());
    const std::size_t sequences = sequence_count(batch);
    if (batch.q_offsets.empty())
        require(q.rows() == k.rows(), function, "K", "has ", k.rows(), " rows, expected ", q.rows(),
                " as Q (linear attention: one key per query)");
    for (std::size_t b = 0; b < sequences; ++b) {
        const SequenceSpan span = sequence_span(batch, b, q.rows(), k.rows());
        require(span.q_rows == span.k_rows, function, "varlen", "gives sequence ", b, ' ', span.q_rows,
                " queries and ", span.k_rows, " keys, expected as many keys as queries (linear attention)");
    }
    const Index d = layout.head_dim, dv = layout.values();
    features = check_linear_arguments<T>(function, phi, {0, d}, {0, d}, {0, dv}, {0, dv}, options, nullptr);
    require_one_span(function, options.span_tokens, "the layer spreads its (sequence, KV head) pairs over the threads");
    const std::size_t expected = sequences * static_cast<std::size_t>(layout.kv_heads);
    require(states.empty() || states.size() == expected, function, "states", "has ", states.size(),
            " states, expected 0 or ", expected, " (sequences ", sequences, " x kv_heads ", layout.kv_heads, ")");
    for (std::size_t i = 0; i < states.size(); ++i) {
        const LinearState<T>& s = states[i];
        if (s.mu.size() == 0 && s.nu.size() == 0)
            continue;
        const std::string name = "states[" + std::to_string(i) + "]";
        require(s.mu.rows() == features && s.mu.cols() == dv, function, name + ".mu", "has shape ", shape(s.mu),
                ", expected ", features, 'x', dv, " (feature dim x value_dim)");
        require(s.nu.cols() == features, function, name + ".nu", "has shape ", shape(s.nu), ", expected 1x",
                features, " (feature dim)");
    }
    require_disjoint(function, "O", o, "Q", q);
    require_disjoint(function, "O", o, "K", k);
    require_disjoint(function, "O", o, "V", v);
    // The states are in/out: the call replaces each one's storage while other items still
    // read the inputs and write the outputs, so none of them may lie in a state.
    const auto disjoint = [&](const std::string& what, const auto& part) {
        require_disjoint(function, "O", o, what, part);
        require_disjoint(function, what, part, "Q", q);
        require_disjoint(function, what, part, "K", k);
        require_disjoint(function, what, part, "V", v);
    };
    for (std::size_t i = 0; i < states.size(); ++i) {
        const std::string name = "states[" + std::to_string(i) + "]";
        disjoint(name + ".mu", states[i].mu);
        disjoint(name + ".nu", states[i].nu);
    }
}

}  // namespace detail

/// Chunked causal linear attention (kernels/linear_attention.hpp) for every query head
/// of every sequence. `states`: empty, or one LinearState per (sequence b, KV head g) at
/// index b·kv_heads + g, shared by the group's query heads (the state depends only on
/// K and V): each empty or the shape of a state, carried in, the final state out.
/// Sequences need as many keys as queries. Outputs are bitwise chunked_linear_attention
/// per query head; throws std::invalid_argument, changing nothing, on bad input. Q, K and
/// V of bfloat16 or float16 compute in float (O of that type or float, the states float),
/// bitwise chunked_linear_attention on them per query head.
template <class DQ, class DK, class DV, detail::EigenMatrix DO, class Phi = EluPlusOne>
void multi_head_chunked_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                         const Eigen::MatrixBase<DV>& V, DO&& O, const HeadLayout& layout,
                                         const Phi& phi = {}, const LinearOptions& options = {},
                                         std::span<LinearState<arithmetic_t<typename DQ::Scalar>>> states = {},
                                         const VarLen& batch = {}, ExecutorRef executor = {}) {
    using E = typename DQ::Scalar;
    using T = arithmetic_t<E>;
    using Out = typename std::remove_cvref_t<DO>::Scalar;
    static_assert(Scalar<E> || LowPrecision<E>, "memattn::multi_head_chunked_linear_attention: the scalar type must "
                                                "be float, double, Eigen::bfloat16 or Eigen::half.");
    static_assert(detail::same_scalar<DQ, DK, DV>,
                  "memattn::multi_head_chunked_linear_attention: Q, K and V must have the same scalar type.");
    static_assert(std::is_same_v<Out, E> || std::is_same_v<Out, T>,
                  "memattn::multi_head_chunked_linear_attention: O must have the scalar type of Q (of bfloat16 or "
                  "half: or float).");
    static_assert(FeatureMap<Phi, T>, "memattn::multi_head_chunked_linear_attention: phi must be a feature map for "
                                      "this scalar (see memattn/feature_maps.hpp).");
    constexpr const char* function = "multi_head_chunked_linear_attention";
    const ConstMatrixRef<E> q = detail::sequence(Q), k = detail::sequence(K), v = detail::sequence(V);
    MatrixRef<Out> o = detail::output(std::forward<DO>(O));
    Index features = 0;
    detail::check_linear_layer<T>(function, layout, phi, q, k, v, o, options, states, batch, features);

    const Index d = layout.head_dim, dv = layout.values(), g = layout.group_size();
    const std::size_t sequences = detail::sequence_count(batch);
    const auto pairs = static_cast<Index>(sequences) * layout.kv_heads;
    // Sub-groups per group: enough items for every thread (a choice that changes no bit).
    const Index threads = executor.concurrency();
    const Index split = std::min(g, std::max<Index>(1, (threads + pairs - 1) / pairs));
    std::vector<detail::LinearItem> items;
    for (std::size_t b = 0; b < sequences; ++b)
        for (Index kv = 0; kv < layout.kv_heads; ++kv)
            for (Index part = 0; part < split; ++part) {
                const Index first = part * g / split, end = (part + 1) * g / split;
                items.push_back({b, kv, first, end - first});
            }
    // With sub-groups, each starts from a copy of the initial state taken before any
    // sub-group writes its final state back.
    std::vector<LinearState<T>> initial;
    if (split > 1)
        initial.assign(states.begin(), states.end());
    detail::parallel_ranges(
        static_cast<Index>(items.size()),
        [&](Index i) {
            const detail::LinearItem& item = items[static_cast<std::size_t>(i)];
            const auto span = detail::sequence_span(batch, item.seq, q.rows(), k.rows());
            return static_cast<double>(span.q_rows) * static_cast<double>(item.members + 1);
        },
        [&](Index first, Index last) {
            detail::LinearStage<E> stage;
            for (Index i = first; i < last; ++i) {
                const detail::LinearItem& item = items[static_cast<std::size_t>(i)];
                const auto span = detail::sequence_span(batch, item.seq, q.rows(), k.rows());
                const std::size_t index = item.seq * static_cast<std::size_t>(layout.kv_heads) +
                                          static_cast<std::size_t>(item.kv);
                LinearState<T> state;  // a copy: a throw leaves the caller's state as it was
                if (!states.empty())
                    state = split > 1 ? initial[index] : states[index];
                if (state.mu.size() == 0 && state.nu.size() == 0) {
                    state.mu.setZero(features, dv);
                    state.nu.setZero(features);
                }
                const Index head = item.kv * g + item.first;
                if (span.q_rows > 0)  // no block of a possibly empty (null) view
                    stage.template run<Out>(q.block(span.q_begin, head * d, span.q_rows, item.members * d),
                                            k.block(span.k_begin, item.kv * d, span.k_rows, d),
                                            v.block(span.k_begin, item.kv * dv, span.k_rows, dv),
                                            o.block(span.q_begin, head * dv, span.q_rows, item.members * dv), phi,
                                            options, features, state);
                if (!states.empty() && item.first == 0)
                    states[index] = std::move(state);
            }
        },
        static_cast<int>(threads), executor);
}

}  // namespace memattn
