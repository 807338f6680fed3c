#pragma once
// Shared prefixes read once (cascade attention, as FlashInfer's): in a batched decode
// step of a paged pool, sequences that hold the same first blocks (forks of one prompt)
// attend those blocks together, their queries stacked as one group (as a KV head's query
// heads are), so each shared key and value is read once for up to group_rows queries
// instead of once per sequence. Each query's partial softmax state (max, sum, acc) over
// the shared blocks then merges with its state over its own tokens (softmax_state.hpp:
// partial states over disjoint keys merge exactly), and the sink logit joins once, after.
//
// The rule: the batch's sequences are ordered by their first block; a run of two or more
// with the same first block shares the longest prefix of blocks every one of them holds
// (whole blocks, all of whose tokens each sees), and when that prefix holds at least
// cascade_min_tokens tokens the run is attended in chunks of cascade_rows / g sequences
// per KV head (g query heads each), each shared block folded for the chunk's groups of
// group_rows queries in turn while it is in cache. Without a window and without ALiBi only (the queries of
// a windowed pool see different parts of a shared block; ALiBi's logits depend on each
// query's position): there a step reads every sequence's blocks on its own.
//
// Bits: a cascaded query folds the shared blocks as one group of up to group_rows
// queries, its own tokens as its group of g, and merges the two: equal to the unshared
// step within rounding (one more rescale, other product blocks), not bit for bit.
// The outputs are the same for any thread count and executor (the chunks are fixed by
// the batch, not by the threads).

#include "memattn/kernels/decode_attention.hpp"
#include "memattn/softmax_state.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace memattn::detail {

/// Shared prefixes shorter than this are read per sequence: below it the stacked group's
/// copies and merges cost more than the reads they save.
inline constexpr Index cascade_min_tokens = 256;

/// Queries of one shared item at most: four groups of group_rows, which fold each shared
/// block in turn while it is in cache (16 forks of a 32/8-head layer: one item per KV head).
inline constexpr Index cascade_rows = 4 * group_rows;

/// A run of a step's sequences that share their first `blocks` blocks: rows
/// order[first, first + count) of the batch.
struct SharedRun {
    Index first = 0, count = 0, blocks = 0;
};

/// A decode work item: batch row `row`'s KV head `head` on its own (count 0), or KV head
/// `head` of the sequences order[first, first + count) of a shared run (`run`).
struct CascadeItem {
    Index row = 0, head = 0, run = -1, first = 0, count = 0;
};

/// The scratch of one range of the executor: the stacked queries, their accumulators and
/// the grouped attends that fold them (cascade_rows / group_rows of each).
template <class T>
struct CascadeScratch {
    Matrix<T> queries, acc;
    std::array<std::optional<GroupAttention<T>>, cascade_rows / group_rows> groups;  // made per item
    QueryBuffer<T> rounded;  // FpMath::bf16 without fold_bf16: a sequence's own queries rounded

    CascadeScratch() = default;
    CascadeScratch(const CascadeScratch& other) : queries(other.queries), acc(other.acc) {}
    CascadeScratch(CascadeScratch&& other) noexcept : queries(std::move(other.queries)), acc(std::move(other.acc)) {}
    CascadeScratch& operator=(CascadeScratch other) noexcept {
        queries.swap(other.queries);
        acc.swap(other.acc);
        return *this;
    }
    ~CascadeScratch() = default;
};

/// What a pool keeps between steps for the cascade (allocation-free once it has run).
template <class T>
struct CascadeWork {
    std::vector<Index> order;
    std::vector<SharedRun> runs;
    std::vector<CascadeItem> items;
    std::vector<CascadeScratch<T>> ranges;
};

/// Finds the shared runs of a batch of `rows` sequences: `table(row)` gives a row's block
/// table (a span of block ids, token blocks in order) and `length(row)` its tokens;
/// `block` tokens a block. Fills `order` (the batch's rows by their first block, each run
/// contiguous) and `runs`; returns whether any run qualifies.
template <class Table, class Length>
bool find_shared_runs(Index rows, Index block, const Table& table, const Length& length, std::vector<Index>& order,
                      std::vector<SharedRun>& runs) {
    order.resize(static_cast<std::size_t>(rows));
    runs.clear();
    for (Index r = 0; r < rows; ++r)
        order[static_cast<std::size_t>(r)] = r;
    const auto first_block = [&](Index r) { return table(r).empty() ? Index{-1} : table(r)[0]; };
    std::sort(order.begin(), order.end(), [&](Index a, Index b) {
        return first_block(a) != first_block(b) ? first_block(a) < first_block(b) : a < b;
    });
    for (Index i = 0; i < rows;) {
        Index j = i + 1;
        while (j < rows && first_block(order[static_cast<std::size_t>(j)]) == first_block(order[static_cast<std::size_t>(i)]))
            ++j;
        const auto lead = table(order[static_cast<std::size_t>(i)]);
        Index shared = static_cast<Index>(lead.size());
        for (Index m = i; m < j && shared > 0; ++m) {
            const Index r = order[static_cast<std::size_t>(m)];
            const auto own = table(r);
            Index p = 0;
            const Index most = std::min({shared, static_cast<Index>(own.size()), length(r) / block});
            while (p < most && own[static_cast<std::size_t>(p)] == lead[static_cast<std::size_t>(p)])
                ++p;
            shared = p;
        }
        if (j - i >= 2 && first_block(order[static_cast<std::size_t>(i)]) >= 0 && shared * block >= cascade_min_tokens)
            runs.push_back({i, j - i, shared});
        i = j;
    }
    return !runs.empty();
}

/// The items of a step (see the top of the file): each shared run in chunks of `chunk`
/// sequences per KV head, every other row per KV head.
inline void plan_cascade(Index rows, Index kv_heads, Index chunk, std::span<const Index> order,
                         std::span<const SharedRun> runs, std::vector<CascadeItem>& items) {
    items.clear();
    Index next = 0;  // rows of `order` before it are in runs
    const auto plain = [&](Index end) {
        for (; next < end; ++next)
            for (Index h = 0; h < kv_heads; ++h)
                items.push_back({order[static_cast<std::size_t>(next)], h});
    };
    for (Index u = 0; u < static_cast<Index>(runs.size()); ++u) {
        const SharedRun& run = runs[static_cast<std::size_t>(u)];
        plain(run.first);
        for (Index h = 0; h < kv_heads; ++h)
            for (Index m = 0; m < run.count; m += chunk)
                items.push_back({-1, h, u, run.first + m, std::min(chunk, run.count - m)});
        next = run.first + run.count;
    }
    plain(rows);
}

}  // namespace memattn::detail
