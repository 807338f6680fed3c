#pragma once
// The shape of a multi-head layer and of a batch of variable-length sequences.
//
// Packed row-major buffers, one token per row (docs/design.md, "Multi-head layers"):
//   Q [tokens,   q_heads·head_dim]     K [tokens_k, kv_heads·head_dim]
//   O [tokens,   q_heads·value_dim]    V [tokens_k, kv_heads·value_dim]
// Query head h reads KV head h / (q_heads / kv_heads): q_heads = kv_heads is multi-head
// attention (MHA), kv_heads = 1 multi-query (MQA), anything between grouped-query (GQA).
// The query heads of one KV head are adjacent, so a group's query columns are one block
// of group_size()·head_dim columns. Any outer stride: the column blocks of a fused QKV
// buffer are accepted as they are.
//
// A batch follows FlashAttention's `cu_seqlens`: B + 1 non-decreasing offsets from 0 to
// the number of rows; sequence b owns Q rows [q_offsets[b], q_offsets[b+1]) and K/V rows
// [k_offsets[b], k_offsets[b+1]), its queries bottom-right aligned to its keys (its
// last query is its last key), so Nq_b ≤ Nk_b. Empty spans: one sequence of all rows.

#include "memattn/types.hpp"

#include <cstddef>
#include <span>

namespace memattn {

/// The heads of a layer and their widths, for its packed buffers Q, K, V and O.
struct HeadLayout {
    Index q_heads = 1;    ///< query heads, a multiple of kv_heads
    Index kv_heads = 1;   ///< key/value heads: q_heads (MHA), 1 (MQA) or a divisor between (GQA)
    Index head_dim = 0;   ///< the key/query width d of each head
    Index value_dim = 0;  ///< 0 means head_dim

    /// Query heads per KV head.
    [[nodiscard]] constexpr Index group_size() const noexcept { return kv_heads > 0 ? q_heads / kv_heads : 0; }
    /// value_dim, with 0 resolved to head_dim.
    [[nodiscard]] constexpr Index values() const noexcept { return value_dim == 0 ? head_dim : value_dim; }
    /// The KV head query head h reads.
    [[nodiscard]] constexpr Index kv_head_of(Index h) const noexcept { return h / group_size(); }
};

/// A batch of variable-length sequences packed in the rows (FlashAttention's
/// `cu_seqlens`); both spans empty: one sequence of all rows.
struct VarLen {
    std::span<const Index> q_offsets;  ///< B + 1 offsets of the sequences' Q (and O) rows, 0 first
    std::span<const Index> k_offsets;  ///< B + 1 offsets of the sequences' K/V rows, 0 first
};

namespace detail {

/// Every field of a layout, before anything is sized from it.
inline void check_layout(const char* function, const HeadLayout& layout) {
    require(layout.q_heads >= 1, function, "layout.q_heads", "is ", layout.q_heads, ", expected >= 1");
    require(layout.kv_heads >= 1 && layout.q_heads % layout.kv_heads == 0, function, "layout.kv_heads", "is ",
            layout.kv_heads, ", expected a divisor of q_heads = ", layout.q_heads);
    require(layout.head_dim >= 1, function, "layout.head_dim", "is ", layout.head_dim, ", expected >= 1");
    require(layout.value_dim >= 0, function, "layout.value_dim", "is ", layout.value_dim,
            ", expected >= 0 (0: head_dim)");
    // Every width the packed buffers have: no product may wrap (2^62 + 2 heads of dim 4
    // would otherwise be 8 columns).
    checked_product(function, "layout.q_heads", layout.q_heads, layout.head_dim, "the width of Q, q_heads x head_dim =");
    checked_product(function, "layout.q_heads", layout.q_heads, layout.values(),
                    "the width of O, q_heads x value_dim =");
}

/// Packed buffers against a (checked) layout: widths from the layout, rows from each other.
inline void check_packed(const char* function, const HeadLayout& layout, Shape q, Shape k, Shape v, Shape o) {
    const Index d = layout.head_dim, dv = layout.values();
    require(q.cols == layout.q_heads * d, function, "Q", "has shape ", q, ", expected ", layout.q_heads * d,
            " columns (q_heads ", layout.q_heads, " x head_dim ", d, ")");
    require(k.cols == layout.kv_heads * d, function, "K", "has shape ", k, ", expected ", layout.kv_heads * d,
            " columns (kv_heads ", layout.kv_heads, " x head_dim ", d, ")");
    require(v.rows == k.rows && v.cols == layout.kv_heads * dv, function, "V", "has shape ", v, ", expected ", k.rows,
            'x', layout.kv_heads * dv, " (K's rows, kv_heads ", layout.kv_heads, " x value_dim ", dv, ")");
    require(o.rows == q.rows && o.cols == layout.q_heads * dv, function, "O", "has shape ", o, ", expected ", q.rows,
            'x', layout.q_heads * dv, " (Q's rows, q_heads ", layout.q_heads, " x value_dim ", dv, ")");
}

/// One list of offsets: B + 1 of them, non-decreasing from 0 to `rows`.
inline void check_offsets(const char* function, const char* name, std::span<const Index> offsets, Index rows,
                          const char* matrix) {
    require(!offsets.empty(), function, name, "is empty, expected B + 1 offsets (the other list has some)");
    require(offsets.front() == 0, function, name, "starts at ", offsets.front(), ", expected 0");
    for (std::size_t b = 1; b < offsets.size(); ++b)
        require(offsets[b] >= offsets[b - 1], function, name, "decreases at index ", b, ": ", offsets[b - 1], " then ",
                offsets[b], ", expected non-decreasing offsets");
    require(offsets.back() == rows, function, name, "ends at ", offsets.back(), ", expected ", rows, " (the rows of ",
            matrix, ")");
}

/// The batch: offsets consistent with the buffers, and Nq_b ≤ Nk_b for every sequence.
inline void check_varlen(const char* function, const VarLen& batch, Index q_rows, Index k_rows, bool causal = true) {
    if (batch.q_offsets.empty() && batch.k_offsets.empty()) {
        require(q_rows <= k_rows || !causal, function, "Q", "has ", q_rows, " rows, expected at most ", k_rows,
                " (K's rows): causal queries continue the keys, so Nq <= Nk");
        return;
    }
    check_offsets(function, "varlen.q_offsets", batch.q_offsets, q_rows, "Q");
    check_offsets(function, "varlen.k_offsets", batch.k_offsets, k_rows, "K");
    require(batch.q_offsets.size() == batch.k_offsets.size(), function, "varlen.k_offsets", "has ",
            batch.k_offsets.size(), " offsets, expected ", batch.q_offsets.size(), " as varlen.q_offsets");
    for (std::size_t b = 0; b + 1 < batch.q_offsets.size(); ++b) {
        const Index nq = batch.q_offsets[b + 1] - batch.q_offsets[b], nk = batch.k_offsets[b + 1] - batch.k_offsets[b];
        require(nq <= nk || !causal, function, "varlen", "gives sequence ", b, ' ', nq, " queries and ", nk,
                " keys, expected Nq <= Nk (causal)");
    }
}

/// One sequence of a batch: its first Q row and K row and its lengths.
struct SequenceSpan {
    Index q_begin, q_rows, k_begin, k_rows;
};

/// The sequences of a (checked) batch, in order.
inline std::size_t sequence_count(const VarLen& batch) {
    return batch.q_offsets.empty() ? 1 : batch.q_offsets.size() - 1;
}

inline SequenceSpan sequence_span(const VarLen& batch, std::size_t b, Index q_rows, Index k_rows) {
    if (batch.q_offsets.empty())
        return {0, q_rows, 0, k_rows};
    return {batch.q_offsets[b], batch.q_offsets[b + 1] - batch.q_offsets[b], batch.k_offsets[b],
            batch.k_offsets[b + 1] - batch.k_offsets[b]};
}

}  // namespace detail
}  // namespace memattn
