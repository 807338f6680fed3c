#pragma once
// The tiled prefill of a paged pool (PagedKVCache::prefill, batched_prefill): each
// sequence's new query rows attend its tokens streamed from its blocks through the tiled
// kernel of causal_softmax_attention (kernels/causal_softmax.hpp: FlashAttention's tiles
// and online softmax, the window, the sinks and the logit options), so a prompt in the
// pool runs at the kernel's speed instead of reading its blocks once per query row.
//
// Shapes: a chunk is `rows` new tokens of one sequence, the last of its `length`; its
// rows of Q (q_heads·d) and O (q_heads·dv) are rows [q_begin, q_begin + rows) of the
// batch's. Query row r of the chunk sits at position length − rows + r and sees what
// causal_softmax_attention with the pool's options gives it: j ≤ its position, within
// the window or among the sinks. A chunk that is a tree of drafts (its `parents`, as
// SoftmaxOptions::parents: speculative decoding's verify step) sees the tokens before
// it and, of its own rows, a row's ancestors and itself (the tree's mask on the tiles),
// each draft at position length − rows + its depth for the window, sinks and ALiBi.
//
// Work items: (chunk, query tile of default_tiles(window) rows, up to max_heads_together
// query heads of one KV head), the heads walking the key tiles together
// (causal_softmax_heads: each K/V tile folded into every head's query tile before the
// next, so it is read from L3 or DRAM once for them); an item's queries see keys
// [0, position of its last row], read through PagedRows. Each head walks the same tiles
// as multi_head_causal_softmax_attention on the same pairs (the stored ones, decoded
// exactly), so its outputs are that kernel's bit for bit. A chunk of one row is a decode
// step: the pool's grouped attend (one (chunk, KV head) item, every query head of the
// group in one pass over the blocks), bitwise batched_decode's.
//
// Scratch, kept by the pool (PagedPrefillWork) and reused by every call: the item list,
// and per range of the executor one SoftmaxScratch per tile shape, one tile of keys and
// of values (a tile that crosses a block, or is stored compactly, is put together there)
// and, with bfloat16 products, the current walk's value tiles as pairs for the other
// query heads of its KV head (PackedValueTiles). Once a call of the same shape has run, a
// call allocates nothing.

#include "memattn/execution/executor.hpp"
#include "memattn/kernels/causal_softmax.hpp"
#include "memattn/kernels/group_attention.hpp"
#include "memattn/kernels/softmax_options.hpp"
#include "memattn/layer/head_layout.hpp"
#include "memattn/memory/detail/held_logits.hpp"
#include "memattn/execution/parallel.hpp"
#include "memattn/storage/compact.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace memattn::detail {

/// Where one sequence's tokens of one KV head lie in a pool's stored rows: token j is in
/// token block j / block_size, held in pool block table[j / block_size] below the sink
/// blocks and table[j / block_size − dropped] past them (the blocks a window freed are
/// dropped from the table), at row (head·blocks + that block)·block_size + j % block_size.
struct BlockTableView {
    const Index* table = nullptr;
    Index sink_blocks = 0, dropped = 0, block_size = 1, blocks = 0, head = 0;

    /// The stored row of token j (a held one).
    [[nodiscard]] Index row(Index j) const noexcept {
        const Index jb = j / block_size;
        const Index b = table[jb < sink_blocks ? jb : jb - dropped];
        return (head * blocks + b) * block_size + j % block_size;
    }
    /// Tokens from j to the end of its block: rows contiguous from row(j).
    [[nodiscard]] Index run(Index j) const noexcept { return block_size - j % block_size; }
};

/// Keys or values of one KV head of a paged sequence as the tiled kernel reads them (a
/// row source, as PlainRows and DecodedRows in kernels/causal_softmax.hpp): a tile within
/// one block of rows stored as T is read in place; a tile across blocks, or stored
/// compactly, is put together in `buffer` (one tile's rows), decoded exactly.
template <class T, class S>
class PagedRows {
public:
    static constexpr bool pairs = false;
    PagedRows(const StoredRows<T, S>& stored, BlockTableView table, Index rows, Matrix<T>& buffer)
        : stored_(stored), table_(table), rows_(rows), buffer_(buffer) {}
    [[nodiscard]] Index rows() const noexcept { return rows_; }
    [[nodiscard]] Index cols() const noexcept { return stored_.cols(); }
    /// Rows [j0, j0 + n): their first coefficient and the row stride.
    [[nodiscard]] std::pair<const T*, Index> tile(Index j0, Index n) {
        if constexpr (!StoredRows<T, S>::compact)
            if (table_.run(j0) >= n)
                return {stored_.matrix().data() + table_.row(j0) * cols(), cols()};
        MEMATTN_DASSERT(n <= buffer_.rows() && buffer_.cols() == cols());
        for (Index r = 0; r < n;) {
            const Index m = std::min(n - r, table_.run(j0 + r));
            stored_.decode_rows(table_.row(j0 + r), m, buffer_.data() + r * buffer_.cols(), buffer_.cols());
            r += m;
        }
        return {buffer_.data(), buffer_.cols()};
    }
    /// Rows [j0, j1) towards L2 while the current tile computes (rows stored as T).
    void prefetch(Index j0, Index j1) const {
        if constexpr (!StoredRows<T, S>::compact)
            for (Index j = j0; j < j1;) {
                const Index m = std::min(j1 - j, table_.run(j));
                prefetch_rows(stored_.matrix().data() + table_.row(j) * cols(), m, cols(), cols());
                j += m;
            }
    }

protected:
    const StoredRows<T, S>& stored_;
    BlockTableView table_;
    Index rows_;
    Matrix<T>& buffer_;
};

/// Columns [0, cols) of an FP8 row as their bfloat16 words, exactly (every E4M3 and E5M2
/// value is a bfloat16 one): Bf16Words' 32 at a time where the grouped decode's routes
/// run, else by the table of values.
template <Fp8Storage S>
void fp8_words(const std::uint8_t* row, Index cols, std::uint16_t* out) noexcept {
#if defined(MEMATTN_GROUP_BF16)
    if (avx512_bf16_runs()) {
        Bf16Words<S>::copy(row, cols, out);
        return;
    }
#endif
    for (Index c = 0; c < cols; ++c)
        out[c] = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(fp8_values<S>[row[c]]) >> 16);
}

/// The value tiles one walk of the tiled kernel packed as pairs (PackedValueTile), kept
/// for the other query heads of its KV head: the g heads of a group walk the same value
/// tiles of the same chunk (the same key tiles, down to the same first key), up to
/// max_heads_together of them at once and the rest in the group's next items, so each
/// tile is packed once per group instead of g times. A slot per tile, at j0 / keys (a
/// walk's tiles are `keys` apart, aligned or ending at the diagonal), below max_slots; a
/// slot holding another tile (a sink's below a window) is passed over, and a walk that
/// differs (`owner`) empties them.
struct PackedValueTiles {
    static constexpr Index max_slots = 256;  // 8 MiB at 128 keys and dv = 128: past it, packed each time
    struct Owner {
        Index chunk = -1, head = -1, q_begin = -1, rows = -1;
        friend bool operator==(const Owner&, const Owner&) = default;
    };
    struct Slot {
        Index first = 0, count = 0;  // the tile it holds
        std::uint8_t state = 0;      // PackedValueTile's
    };
    Owner owner;
    Index keys = 0, slot_words = 0;    // a tile's keys, a slot's words
    std::vector<std::uint32_t> words;  // slots × slot_words
    std::vector<Slot> slots;

    /// Starts a walk: `owner`'s tiles of `keys` keys, `count` of them (at most max_slots),
    /// each `slot_words` words; the slots are kept where the walk is the one before. Room
    /// for max_slots of a tile shape is reserved at its first walk (address space: a page
    /// is first touched when a walk reaches it), so a longer walk later allocates nothing.
    void start(const Owner& walk, Index tile_keys, Index count, Index words_per_slot) {
        count = std::min(count, max_slots);
        if (walk == owner && tile_keys == keys && words_per_slot == slot_words)
            return;
        if (words.capacity() < static_cast<std::size_t>(max_slots * words_per_slot))
            words.reserve(static_cast<std::size_t>(max_slots * words_per_slot));
        slots.reserve(static_cast<std::size_t>(max_slots));
        owner = walk;
        keys = tile_keys;
        slot_words = words_per_slot;
        if (static_cast<Index>(words.size()) < count * slot_words)
            words.resize(static_cast<std::size_t>(count * slot_words));  // within the reserved room
        slots.assign(static_cast<std::size_t>(count), Slot{});
    }
    /// Forgets every slot (a new call: the stored rows may have changed).
    void clear() { owner = Owner{}; }

    /// The slot of tile [j0, j0 + n), or none.
    [[nodiscard]] PackedValueTile slot(Index j0, Index n) {
        if (keys == 0 || j0 / keys >= static_cast<Index>(slots.size()))
            return {};
        const auto i = static_cast<std::size_t>(j0 / keys);
        Slot& held = slots[i];
        if (held.state != 0 && (held.first != j0 || held.count != n))
            return {};  // another tile there
        held.first = j0;
        held.count = n;
        return {words.data() + static_cast<Index>(i) * slot_words, &held.state};
    }
};

/// FpMath::bf16 (a pool of float over rows stored as bfloat16 or FP8, bf16_products):
/// keys or values of one KV head as the bfloat16 kernel reads them, with the pairs exactly
/// where ConvertedRows<Eigen::bfloat16> has them (Pairs: chosen by with_bf16_products as
/// the multi-head kernel chooses them), so the pool's tiles are that kernel's on the same
/// values. bits(): a tile within one block of bfloat16
/// rows in place; one across blocks, or of FP8, put together as bfloat16 words in `words`
/// (one tile's rows). tile(): the values as float, as PagedRows gives them (the float
/// products where vdpbf16ps is missing; a value tile that is not all finite).
template <class S, bool Pairs = bf16_dot>
class PagedPairRows : public PagedRows<float, S> {
    using Base = PagedRows<float, S>;

public:
    static constexpr bool pairs = Pairs;
    PagedPairRows(const StoredRows<float, S>& stored, BlockTableView table, Index rows, Matrix<float>& buffer,
                  Matrix<Eigen::bfloat16>& words, PackedValueTiles* packed = nullptr)
        : Base(stored, table, rows, buffer), words_(words), packed_(packed) {}
    /// Value tile [j0, j0 + n) as pairs, where the walk keeps them (PackedValueTiles).
    [[nodiscard]] PackedValueTile packed_tile(Index j0, Index n) {
        return packed_ != nullptr ? packed_->slot(j0, n) : PackedValueTile{};
    }
    /// Rows [j0, j0 + n) as bfloat16 words: their first and the row stride.
    [[nodiscard]] std::pair<const std::uint16_t*, Index> bits(Index j0, Index n) {
        const Index cols = this->cols();
        if constexpr (std::is_same_v<S, Eigen::bfloat16>)
            if (this->table_.run(j0) >= n)
                return {reinterpret_cast<const std::uint16_t*>(this->stored_.stored_row(this->table_.row(j0))), cols};
        MEMATTN_DASSERT(n <= words_.rows() && words_.cols() == cols);
        auto* out = reinterpret_cast<std::uint16_t*>(words_.data());
        for (Index r = 0; r < n;) {
            const Index m = std::min(n - r, this->table_.run(j0 + r)), first = this->table_.row(j0 + r);
            if constexpr (std::is_same_v<S, Eigen::bfloat16>)
                std::memcpy(out + r * cols, this->stored_.stored_row(first),
                            sizeof(std::uint16_t) * static_cast<std::size_t>(m * cols));
            else
                for (Index i = 0; i < m; ++i)
                    fp8_words<S>(this->stored_.row_data(first + i), cols, out + (r + i) * cols);
            r += m;
        }
        return {out, cols};
    }
    /// Rows [j0, j1) towards L2 while the current tile computes.
    void prefetch(Index j0, Index j1) const {
        for (Index j = j0; j < j1;) {
            const Index m = std::min(j1 - j, this->table_.run(j)), row = this->table_.row(j);
            if constexpr (std::is_same_v<S, Eigen::bfloat16>)
                prefetch_rows(this->stored_.stored_row(row), m, this->cols(), this->cols());
            else
                prefetch_rows(this->stored_.row_data(row), m, this->cols(), this->cols());
            j += m;
        }
    }

private:
    Matrix<Eigen::bfloat16>& words_;
    PackedValueTiles* packed_;
};

/// One sequence's chunk of a mixed batch (see the top of the file): `sequence` the
/// caller's index of it, `blocks` its table (head 0: the items set theirs).
struct PagedChunk {
    Index sequence = 0, q_begin = 0, rows = 0, length = 0;
    BlockTableView blocks;
    /// A tree of drafts (SoftmaxOptions::parents of its rows, among them); empty: causal.
    std::span<const Index> parents = {};
};

/// A work item: query rows [q_begin, q_begin + rows) of `chunk` for query heads [head,
/// head + heads) (of one KV head) through the tiled kernel, the heads walking the key
/// tiles together (causal_softmax_heads), or (decode) the chunk's one row for every
/// query head of KV head `head`.
struct PagedItem {
    Index chunk = 0, head = 0, q_begin = 0, rows = 0;
    bool decode = false;
    Index heads = 1;
};

/// The scratch of one range of the executor (see the top of the file).
template <class T>
struct PagedRangeScratch {
    using Heads = std::array<std::optional<SoftmaxScratch<T>>, max_heads_together>;
    Heads full, windowed;    // per tile shape, one per head of an item, made on first use
    Matrix<T> keys, values;  // a tile of each
    std::array<Matrix<Eigen::bfloat16>, max_heads_together> queries;  // FpMath::bf16: each head's tile, as bfloat16
    Matrix<Eigen::bfloat16> key_words, value_words;                    // FpMath::bf16: a tile of each, as bfloat16
    PackedValueTiles value_tiles;  // FpMath::bf16: the current walk's value tiles as pairs
};

/// What the tiled prefill keeps between calls: its items and each range's scratch.
template <class T>
struct PagedPrefillWork {
    std::vector<PagedItem> items;
    std::vector<PagedRangeScratch<T>> ranges;
};

/// The pool's attention options for the tiled prefill: the window, sinks, scale and the
/// logit options (one value per query head, or none).
struct PagedOptions {
    HeadLayout layout;
    double scale = 0;
    Index window = 0, sinks = 0;
    double softcap = 0;
    std::span<const double> slopes, sink_logits;
    bool bf16 = false;  ///< FpMath::bf16: the products in bfloat16 (PagedPairRows)

    /// Query head h's options, as SoftmaxOptions (the pool's queries follow its keys).
    [[nodiscard]] SoftmaxOptions head(Index h) const {
        return head_options(SoftmaxOptions{.scale = scale,
                                           .window = window,
                                           .sink_tokens = sinks,
                                           .softcap = softcap,
                                           .sink_logits = sink_logits,
                                           .alibi_slopes = slopes},
                            h);
    }
};

/// The items of a batch of chunks, in schedule order: a chunk's tiles KV head by KV
/// head, the query heads of a group in items of up to max_heads_together; a chunk of one
/// row, one decode item per KV head.
inline void plan_paged_items(const HeadLayout& layout, Index window, std::span<const PagedChunk> chunks,
                             std::vector<PagedItem>& items) {
    items.clear();
    const Index g = layout.group_size(), together = static_cast<Index>(max_heads_together);
    for (Index c = 0; c < static_cast<Index>(chunks.size()); ++c) {
        const PagedChunk& chunk = chunks[static_cast<std::size_t>(c)];
        if (chunk.rows == 1) {
            for (Index kv = 0; kv < layout.kv_heads; ++kv)
                items.push_back({c, kv, 0, 1, true});
            continue;
        }
        const Index tile = default_tiles(effective_window(window, chunk.length)).queries;
        for (Index kv = 0; kv < layout.kv_heads; ++kv)
            for (Index i0 = 0; i0 < chunk.rows; i0 += tile)
                for (Index m = 0; m < g; m += together)
                    items.push_back({c, kv * g + m, i0, std::min(tile, chunk.rows - i0), false,
                                     std::min(together, g - m)});
    }
}

/// A core's rate of a tile's multiply-adds over its rate of reading a decode item's
/// stored pairs, in FLOPs per byte: a tile multiplies pairs from cache near the FMA peak,
/// a decode item reads each pair once, from memory, for its g queries. Measured on AMD
/// EPYC Zen 2 (AVX2): ~80 GFLOP/s of tiles against ~8 GB/s of decode per core (10); the
/// AVX-512 Xeons' ratio is higher. Only the split of a mixed batch over the threads
/// depends on it, never a result.
inline constexpr double decode_flops_per_byte = 10;

/// What a decode item's key costs, in the units of a tile's (query, key) pair (2(d + dv)
/// FLOPs): its g queries' pairs, or, where more, the time its stored pair's `bytes` take
/// to read (decode_flops_per_byte).
inline double decode_key_cost(Index g, Index d, Index dv, std::size_t bytes) {
    return std::max(static_cast<double>(g),
                    decode_flops_per_byte * static_cast<double>(bytes) / (2.0 * static_cast<double>(d + dv)));
}

/// The keys an item's queries see, summed (at its middle query), plus a per-row constant;
/// a decode item's at decode_key (decode_key_cost) each.
inline double paged_item_cost(const PagedItem& item, const PagedChunk& chunk, Index window, Index sinks,
                              double decode_key) {
    const Index position = chunk.length - chunk.rows + item.q_begin + item.rows / 2;
    Index keys = position + 1;
    if (window > 0 && keys > window)
        keys = window + std::min(sinks, position + 1 - window);
    return (item.decode ? decode_key : static_cast<double>(item.rows * item.heads)) * static_cast<double>(keys + 64);
}

/// `m` with at least `rows` rows of `cols` columns (resized to that when not: a pool's
/// widths never change, so once per tile shape).
template <class E>
void sized(Matrix<E>& m, Index rows, Index cols) {
    if (m.rows() < rows || m.cols() != cols)
        m.resize(rows, cols);
}

/// The tiled prefill of `chunks` (see the top of the file) after the checks, the chunks'
/// tokens stored in K and V: rows of `q` (stride ldq) into rows of `out` (stride ldo).
/// `decode(chunk, kv)` attends a one-row chunk's KV head kv (the pool's grouped attend).
/// `serial`: run on the calling thread (a batch too small to share).
template <class T, class S, class Decode>
void paged_prefill(const PagedOptions& options, const StoredRows<T, S>& K, const StoredRows<T, S>& V,
                   std::span<const PagedChunk> chunks, const T* q, Index ldq, T* out, Index ldo,
                   PagedPrefillWork<T>& work, ExecutorRef executor, bool serial, Decode&& decode) {
    const HeadLayout& layout = options.layout;
    const Index d = layout.head_dim, dv = layout.values(), g = layout.group_size();
    plan_paged_items(layout, options.window, chunks, work.items);
    const Index n = static_cast<Index>(work.items.size());
    const auto parts = static_cast<std::size_t>(std::min<Index>({serial ? 1 : executor.concurrency(), n, max_ranges}));
    if (work.ranges.size() < parts)
        work.ranges.resize(parts);
    const double decode_key = decode_key_cost(g, d, dv, StoredRows<T, S>::row_bytes(d) + StoredRows<T, S>::row_bytes(dv));
    parallel_ranges(
        n,
        [&](Index i) {
            const PagedItem& item = work.items[static_cast<std::size_t>(i)];
            return paged_item_cost(item, chunks[static_cast<std::size_t>(item.chunk)], options.window, options.sinks,
                                   decode_key);
        },
        [&](Index first, Index last, int range) {
            PagedRangeScratch<T>& scratch = work.ranges[static_cast<std::size_t>(range)];
            scratch.value_tiles.clear();  // the stored rows may have changed since the last call
            for (Index i = first; i < last; ++i) {
                const PagedItem& item = work.items[static_cast<std::size_t>(i)];
                const PagedChunk& chunk = chunks[static_cast<std::size_t>(item.chunk)];
                if (item.decode) {
                    decode(item.chunk, item.head);
                    continue;
                }
                const SoftmaxTiles tiles = default_tiles(effective_window(options.window, chunk.length));
                typename PagedRangeScratch<T>::Heads& tiled = tiles == SoftmaxTiles{} ? scratch.full : scratch.windowed;
                const auto heads = static_cast<std::size_t>(item.heads);
                for (std::size_t h = 0; h < heads; ++h)
                    if (!tiled[h])  // a pool's d and dv never change: made once per tile shape
                        tiled[h].emplace(d, dv, tiles);
                sized(scratch.keys, std::max(tiles.keys, SoftmaxTiles{}.keys), d);
                sized(scratch.values, std::max(tiles.keys, SoftmaxTiles{}.keys), dv);
                // Keys up to the item's last query; its queries bottom-right aligned.
                const Index visible = chunk.length - chunk.rows + item.q_begin + item.rows;
                BlockTableView blocks = chunk.blocks;
                blocks.head = item.head / g;
                const Index row0 = chunk.q_begin + item.q_begin;
                const auto queries = [&](std::size_t h) {
                    return Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>>(
                        q + row0 * ldq + (item.head + static_cast<Index>(h)) * d, item.rows, d, Eigen::OuterStride<>(ldq));
                };
                const auto outputs = [&](std::size_t h) {
                    return MatrixRef<T>(Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>>(
                        out + row0 * ldo + (item.head + static_cast<Index>(h)) * dv, item.rows, dv,
                        Eigen::OuterStride<>(ldo)));
                };
                std::array<SoftmaxOptions, max_heads_together> head_options;
                for (std::size_t h = 0; h < heads; ++h) {
                    head_options[h] = options.head(item.head + static_cast<Index>(h));
                    if (!chunk.parents.empty())  // the drafts up to the item's last: their tree's rows
                        head_options[h].parents = chunk.parents.first(static_cast<std::size_t>(item.q_begin + item.rows));
                }
                const auto options_of = [&](std::size_t h) -> const SoftmaxOptions& { return head_options[h]; };
                const auto scratch_of = [&](std::size_t h) -> SoftmaxScratch<T>& { return *tiled[h]; };
                const auto no_lse = [](std::size_t, Index, T) {};
                const auto no_bias = [](std::size_t) { return TileBias<T>{}; };
                if constexpr (bf16_products<T, S>) {
                    if (options.bf16) {  // the queries rounded, the stored rows as bfloat16 words
                        using E = Eigen::bfloat16;
                        const Index most = std::max(tiles.queries, SoftmaxTiles{}.queries);
                        const Index keys = std::max(tiles.keys, SoftmaxTiles{}.keys);
                        for (std::size_t h = 0; h < heads; ++h)
                            sized(scratch.queries[h], most, d);
                        round_query_heads(q + row0 * ldq + item.head * d, ldq, item.rows, d, heads,
                                          scratch.queries.data());
                        with_bf16_products([&]<bool Pairs>() {
                            PackedValueTiles* packed = nullptr;
                            if constexpr (Pairs) {  // else the tiles are read as float only
                                sized(scratch.key_words, keys, d);
                                sized(scratch.value_words, keys, dv);
                                // the group's heads walk the same value tiles
                                scratch.value_tiles.start({item.chunk, blocks.head, item.q_begin, item.rows},
                                                          tiles.keys, (visible + tiles.keys - 1) / tiles.keys,
                                                          packed_value_words(tiles.keys, dv));
                                packed = &scratch.value_tiles;
                            }
                            using Rows = PagedPairRows<S, Pairs>;
                            const auto rounded = [&](std::size_t h) {
                                return ConvertedRows<E, Pairs>(scratch.queries[h].topRows(item.rows), tiles.queries,
                                                               tiled[h]->converted_q);
                            };
                            causal_softmax_heads<T, T>(heads, rounded,
                                                       Rows(K, blocks, visible, scratch.keys, scratch.key_words),
                                                       Rows(V, blocks, visible, scratch.values, scratch.value_words, packed),
                                                       outputs, no_lse, options_of, scratch_of, trailing_queries,
                                                       no_bias);
                        });
                        continue;
                    }
                }
                const auto plain = [&](std::size_t h) { return PlainRows<T>(queries(h)); };
                causal_softmax_heads<T, T>(heads, plain, PagedRows<T, S>(K, blocks, visible, scratch.keys),
                                           PagedRows<T, S>(V, blocks, visible, scratch.values), outputs, no_lse,
                                           options_of, scratch_of, trailing_queries, no_bias);
            }
        },
        serial ? 1 : 0, executor);
}

}  // namespace memattn::detail
