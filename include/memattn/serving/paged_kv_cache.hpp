#pragma once
// PagedKVCache: one layer's K/V for many sequences at once, in a pool of fixed-size
// blocks, with prefixes shared between sequences (docs/design.md, "Serving").
//
//   memattn::PagedKVCache<float, Eigen::bfloat16> pool({.q_heads = 32, .kv_heads = 8, .head_dim = 128},
//                                                      /*blocks=*/4096);
//   const memattn::Index a = pool.add_sequence();
//   auto first = pool.sequence(a);                 // a sequence is a Memory
//   memattn::extend(first, prompt_keys, prompt_values);
//   const memattn::Index b = pool.fork(a);     // shares every block of a
//   pool.sequence(b).update(k_row, v_row);    // copies the shared last block first
//   pool.sequence(b).attend(q_row, o_row);    // packed rows, as memattn::MultiHead's
//   pool.truncate(b, 10);                     // rollback: frees what no one else holds
//   pool.remove(a);
//
// A block holds `block_size` tokens of every KV head: for block b, KV head h and slot t,
// the key is row (h·blocks + b)·block_size + t of one detail::StoredRows (in storage S,
// like KVCache's), the value the same row of another, so a head's tokens in a block are
// one contiguous run of rows (and in consecutive blocks, consecutive runs: from DRAM
// they stream as one cache's do), and the attend reads them through
// kernels/decode_attention.hpp like any cache's. A sequence is its block table (the
// blocks of its tokens, in order) and its length; a block has a reference count, and a
// sequence that writes into a block another sequence holds copies it first into a free
// block (copy-on-write), so a fork costs one count per block.
//
// A pool built with SoftmaxOptions{.window = W, .sink_tokens = s} is one sliding-window
// layer's: the query at position p sees the tokens j ≤ p with j < s or j > p − W (as
// causal_softmax_attention with those options), and after each call a sequence of length
// L frees (unless another sequence holds it) every block past the first ceil(s / block)
// whose tokens all lie below L − W, the first token its last query sees: a windowed
// sequence holds at most ceil(s / block) + ceil(W / block) + 1 blocks, however long it
// grows. Its table keeps the sink blocks, then the held window blocks, and counts the
// blocks dropped between them. PoolOptions{.rollback_tokens = n} keeps n tokens more
// (freed below L − W − n, at most ceil(s / block) + ceil((W + n) / block) + 1 blocks), so
// any truncate of up to n tokens succeeds: the room a speculative step's rejected drafts
// need. (Without it a truncate succeeds only while the window has freed nothing the
// shorter sequence sees: can_truncate says when; or fork a checkpoint before the step and
// remove the fork or the original after it.)
//
// Capacity is fixed when the pool is built: a step (update, attend) allocates nothing.
// When a call needs more blocks than are free it throws memattn::PoolExhausted, naming
// what it asked for and what is free, and changes nothing; every other bad input (an id
// that is not a live sequence, a shape, a value the storage cannot hold) throws
// std::invalid_argument and changes nothing.

#include "memattn/execution/executor.hpp"
#include "memattn/kernels/softmax_options.hpp"
#include "memattn/layer/head_layout.hpp"
#include "memattn/memory/detail/held_logits.hpp"
#include "memattn/memory/detail/memory_checks.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/serving/detail/paged_pairs.hpp"
#include "memattn/serving/pool_options.hpp"
#include "memattn/storage/compact.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace memattn {

namespace detail {
struct PagedAccess;
}  // namespace detail

/// One layer's K/V for many sequences in a pool of blocks; see the top of the file.
/// \tparam S how the pairs are stored, T itself or a compact type (storage/compact.hpp).
template <Scalar T, class S = T>
    requires StorageFor<S, T> && detail::PlainKeys<S>
class PagedKVCache : public ExecutorSlot, private detail::paged::PagedPairs<T, S> {
    using Pairs = detail::paged::PagedPairs<T, S>;

public:
    using Scalar = T;       ///< the rows' scalar and the arithmetic's
    using StorageType = S;  ///< how the pairs are stored

    /// Tokens per block unless the constructor is told otherwise.
    static constexpr Index default_block_size = 128;

    class Sequence;

    /// A pool of `blocks` blocks of `block_size` tokens of every KV head of `layout`;
    /// `scale` multiplies q·k before the softmax, 0 meaning 1/sqrt(head_dim). Allocates
    /// the whole pool now.
    PagedKVCache(const HeadLayout& layout, Index blocks, Index block_size = default_block_size, T scale = T(0))
        : PagedKVCache(layout, blocks, block_size, SoftmaxOptions{.scale = static_cast<double>(scale)}) {}

    /// A pool of a layer with SoftmaxOptions: a sliding window (see the top of the file:
    /// `options.window`, 0: none, and `options.sink_tokens`, which change nothing without
    /// a window), `options.scale` as the scale above, and the logit options (softcap,
    /// alibi_slopes and sink_logits, one per query head, copied) as
    /// causal_softmax_attention takes them. `options.causal` must be true.
    /// `options.fpmath = FpMath::bf16` (T float, S bfloat16, Fp8E4M3 or Fp8E5M2; refused
    /// otherwise): the queries and the weights rounded to bfloat16 and the stored rows
    /// multiplied as bfloat16 words, in decode steps (a KVCache's attend_group with the
    /// option) and in prompts (the multi-head kernel's with it on the pairs as stored),
    /// docs/design.md §4.7c.
    PagedKVCache(const HeadLayout& layout, Index blocks, Index block_size, const SoftmaxOptions& options)
        : PagedKVCache(layout, blocks, block_size, options, PoolOptions{}) {}

    /// The same with PoolOptions: rollback room past a window, the refusal of non-finite
    /// pairs.
    PagedKVCache(const HeadLayout& layout, Index blocks, Index block_size, const SoftmaxOptions& options,
                 const PoolOptions& pool)
        : Pairs(layout, checked_shape(layout, blocks, block_size, options, pool), options),
          reject_nonfinite_(pool.reject_nonfinite) {}

    /// A new, empty sequence; returns its id (the smallest id not in use).
    Index add_sequence() { return Pairs::new_sequence(); }

    /// A new sequence holding the same tokens as `parent`, sharing every block of it
    /// (copied when either writes into a shared block). Returns its id.
    Index fork(Index parent) {
        check_sequence("PagedKVCache::fork", "parent", parent);
        return Pairs::fork_sequence(parent);
    }

    /// Keeps the first `tokens` tokens of `seq` (a rollback) and frees the blocks past
    /// them that no other sequence holds. In a windowed pool the sequence must still hold
    /// what a sequence of `tokens` tokens would (can_truncate): the window's blocks below
    /// the current one are freed as it moves on.
    void truncate(Index seq, Index tokens) {
        constexpr const char* function = "PagedKVCache::truncate";
        check_sequence(function, "seq", seq);
        State& s = sequences_[static_cast<std::size_t>(seq)];
        detail::require(tokens >= 0 && tokens <= s.length, function, "tokens", "is ", tokens, ", expected 0 to ",
                        s.length, " (the length of sequence ", seq, ")");
        detail::require(can_truncate(seq, tokens), function, "tokens", "is ", tokens, ", but the window of ", window_,
                        " has freed the tokens of sequence ", seq, " from ", sinks_, " to ", s.first,
                        ": a sequence of ", tokens, " tokens would need them");
        const Index kept = blocks_for(tokens), sink = sink_blocks();
        const Index held = kept <= sink ? std::min(kept, static_cast<Index>(s.table.size())) : kept - s.dropped;
        for (std::size_t i = static_cast<std::size_t>(held); i < s.table.size(); ++i)
            release(s.table[i]);
        s.table.resize(static_cast<std::size_t>(held));
        if (kept <= sink) {
            s.dropped = 0;
            s.first = sinks_;
        }
        s.length = tokens;
        s.drafts = 0;
    }
    /// Whether truncate(seq, tokens) would succeed: 0 ≤ tokens ≤ length(seq) and, in a
    /// windowed pool, no token a sequence of `tokens` tokens still sees has been freed.
    [[nodiscard]] bool can_truncate(Index seq, Index tokens) const noexcept {
        if (!contains(seq))
            return false;
        const State& s = sequences_[static_cast<std::size_t>(seq)];
        return tokens >= 0 && tokens <= s.length && (tokens <= sinks_ || std::max(sinks_, tokens - window_) >= s.first);
    }

    /// The free blocks a batch that brings tokens[i] tokens to seqs[i] (distinct live ids)
    /// takes: exactly what prefill(seqs, q_offsets, ...) with those chunks needs (copies of
    /// shared last blocks included), and at least what update(seqs, K, V) or a decode step
    /// of one token each needs (whose windows may free blocks as it goes). For admission
    /// before a step: a step whose blocks_needed is at most free_blocks() cannot throw
    /// PoolExhausted.
    [[nodiscard]] Index blocks_needed(std::span<const Index> seqs, std::span<const Index> tokens) const {
        return Pairs::checked_blocks_needed("PagedKVCache::blocks_needed", seqs, tokens);
    }

    /// Ends `seq`: frees the blocks no other sequence holds; its id may be reused.
    void remove(Index seq) {
        check_sequence("PagedKVCache::remove", "seq", seq);
        Pairs::remove_sequence(seq);
    }

    /// True when `seq` is a live sequence of the pool.
    [[nodiscard]] bool contains(Index seq) const noexcept { return Pairs::live(seq); }
    /// Tokens of `seq`.
    [[nodiscard]] Index length(Index seq) const { return checked_state("PagedKVCache::length", seq).length; }
    /// Blocks held by `seq` (shared ones included).
    [[nodiscard]] Index blocks_of(Index seq) const {
        return static_cast<Index>(checked_state("PagedKVCache::blocks_of", seq).table.size());
    }
    /// Live sequences.
    [[nodiscard]] Index sequences() const noexcept { return Pairs::live_sequences(); }
    /// Blocks some sequence holds (a shared block once).
    [[nodiscard]] Index blocks_in_use() const noexcept { return blocks_ - free_blocks(); }
    /// Blocks no sequence holds.
    [[nodiscard]] Index free_blocks() const noexcept { return static_cast<Index>(free_.size()); }
    /// Blocks of the pool.
    [[nodiscard]] Index blocks() const noexcept { return blocks_; }
    /// Tokens per block.
    [[nodiscard]] Index block_size() const noexcept { return block_size_; }
    /// Bytes the pool holds: its blocks (allocated when it was built), their counts and
    /// the sequences' tables.
    [[nodiscard]] std::size_t footprint() const noexcept {
        return keys_.bytes(pool_rows()) + values_.bytes(pool_rows()) + Pairs::table_bytes();
    }
    /// Bytes of the blocks `seq` holds, shared ones included.
    [[nodiscard]] std::size_t footprint(Index seq) const { return block_bytes() * static_cast<std::size_t>(blocks_of(seq)); }

    /// The layer's heads.
    [[nodiscard]] const HeadLayout& layout() const noexcept { return layout_; }
    /// The factor of q·k before the softmax (1/sqrt(head_dim) when built with 0).
    [[nodiscard]] T scale() const noexcept { return scale_; }
    /// The latest tokens a query sees, itself included; 0: every token.
    [[nodiscard]] Index window() const noexcept { return window_; }
    /// The first tokens every query sees beside its window (0 without a window).
    [[nodiscard]] Index sink_tokens() const noexcept { return sinks_; }
    /// What the pool keeps and refuses beyond its attention options (rollback_tokens is 0
    /// without a window).
    [[nodiscard]] PoolOptions pool_options() const noexcept {
        return {.rollback_tokens = rollback_, .reject_nonfinite = reject_nonfinite_};
    }
    /// The options the attends follow (its spans view the pool's own copies).
    [[nodiscard]] SoftmaxOptions options() const noexcept {
        return {.scale = static_cast<double>(scale_),
                .window = window_,
                .sink_tokens = sinks_,
                .softcap = softcap_,
                .sink_logits = sink_logits_,
                .alibi_slopes = slopes_,
                .fpmath = bf16_ ? FpMath::bf16 : FpMath::strict};
    }
    /// Width of a packed key row: kv_heads·head_dim.
    [[nodiscard]] Index key_dim() const noexcept { return layout_.kv_heads * layout_.head_dim; }
    /// Width of a packed value row: kv_heads·value_dim.
    [[nodiscard]] Index value_dim() const noexcept { return layout_.kv_heads * layout_.values(); }
    /// Width of a packed query row: q_heads·head_dim.
    [[nodiscard]] Index query_dim() const noexcept { return layout_.q_heads * layout_.head_dim; }
    /// Width of a packed output row: q_heads·value_dim.
    [[nodiscard]] Index output_dim() const noexcept { return layout_.q_heads * layout_.values(); }

    // set_executor(executor), executor(): where attends and batches run their items (ExecutorSlot).

    /// Appends one token to `seq`: `key` is kv_heads·head_dim wide, `value`
    /// kv_heads·value_dim. Takes a free block when the last one is full, and copies the
    /// last one first when another sequence holds it.
    void update(Index seq, ConstRowRef<T> key, ConstRowRef<T> value) {
        const detail::PairSite site{"PagedKVCache::update", "key", "value"};
        validate(seq, key, value, site);
        State& s = sequences_[static_cast<std::size_t>(seq)];
        append(s, key, value);
        evict(s);
    }

    /// Appends many tokens (packed rows) to `seq`; all or nothing. In a windowed pool the
    /// blocks the window leaves are freed as it goes (block by block, as one update per
    /// token frees them), so a long prompt takes no more blocks than its window holds.
    void extend(Index seq, ConstMatrixRef<T> keys, ConstMatrixRef<T> values) {
        validate(seq, keys, values, {"PagedKVCache::extend"});
        State& s = sequences_[static_cast<std::size_t>(seq)];
        for (Index r = 0; r < keys.rows();) {  // up to the end of the last block, then what the window frees
            const Index m = std::min(keys.rows() - r, block_size_ - s.length % block_size_);
            append(s, keys.middleRows(r, m), values.middleRows(r, m));
            evict(s);
            r += m;
        }
    }

    /// Throws what update/extend of `seq` would throw for these packed rows, changing
    /// nothing: std::invalid_argument for an id, a shape or a value S cannot hold,
    /// std::length_error past memattn::max_length, memattn::PoolExhausted when the pool has
    /// fewer free blocks than they need.
    void validate(Index seq, ConstMatrixRef<T> keys, ConstMatrixRef<T> values,
                  const detail::PairSite& site = {"PagedKVCache::validate"}) const {
        check_sequence(site.function, "seq", seq);
        const State& s = sequences_[static_cast<std::size_t>(seq)];
        detail::check_site_pairs(site, detail::shape(keys), detail::shape(values), key_dim(), value_dim(), s.length);
        detail::check_storable<T, S>(site, keys, false);
        detail::check_storable<T, S>(site, values, true);
        check_finite(site, keys, false);
        check_finite(site, values, true);
        const Index needed = extend_peak(s, keys.rows());
        Pairs::require_free(site.function, needed);
    }

    /// out (q_heads·value_dim) = every query head of `query` (q_heads·head_dim) attending
    /// the tokens of `seq` (zero for an empty sequence); each KV head's blocks are read
    /// once for its group of query heads, the KV heads spread over the executor's threads
    /// (bitwise the same for any of them). Allocates nothing.
    void attend(Index seq, ConstRowRef<T> query, RowRef<T> out) const {
        constexpr const char* function = "PagedKVCache::attend";
        check_sequence(function, "seq", seq);
        detail::check_query(function, query, out, query_dim(), output_dim());
        const State& s = sequences_[static_cast<std::size_t>(seq)];
        attend_rows(
            1, [&](Index) -> const State& { return s; }, [&](Index) { return s.length; }, query.data(), 0,
            out.data(), 0, executor_);
    }

    /// Pairs × query heads × (head_dim + value_dim) of one attend below which it runs on
    /// the calling thread (as memattn::MultiHead's).
    static constexpr double parallel_work = Pairs::parallel_work;

    /// One token for each sequence of `seqs` (distinct live ids): row i of K/V is appended
    /// to seqs[i] (and the blocks its window leaves freed), in batch order, all or
    /// nothing. The free blocks needed are counted exactly as the members take and free
    /// them in that order: copies of a shared block included (of k holders of a block
    /// that all write into it, k − 1 copy it when no one else holds it), and a block an
    /// earlier member's window frees counted free for the later ones, so a batch that
    /// fits, as one update per sequence in that order would, is taken, and one that does
    /// not throws PoolExhausted with every sequence unchanged. Allocates nothing.
    void update(std::span<const Index> seqs, ConstMatrixRef<T> keys, ConstMatrixRef<T> values) {
        update_batch("PagedKVCache::update", seqs, keys, values);
    }

    /// One decode step of a batch: update(seqs, K, V), then row i of O = row i of Q
    /// attending seqs[i] (attend(seqs, Q, O, executor)): what batched_decode runs. All or
    /// nothing: when the attends throw (an executor that fails), the tokens are taken back
    /// and every block is as it was. Allocates nothing.
    void decode(std::span<const Index> seqs, ConstMatrixRef<T> queries, ConstMatrixRef<T> keys,
                ConstMatrixRef<T> values, MatrixRef<T> out, ExecutorRef executor) {
        decode_batch("PagedKVCache::decode", seqs, queries, keys, values, out, executor);
    }
    /// The same on the pool's executor.
    void decode(std::span<const Index> seqs, ConstMatrixRef<T> queries, ConstMatrixRef<T> keys,
                ConstMatrixRef<T> values, MatrixRef<T> out) {
        decode(seqs, queries, keys, values, out, executor_);
    }

    /// Row i of O = row i of Q attending sequence seqs[i] (live ids, repeats allowed), as
    /// attend(seqs[i], Q.row(i), O.row(i)) would give it, bit for bit: the (sequence, KV
    /// head) items spread over the pool's executor's threads (set_executor), by their
    /// lengths. Allocates nothing.
    void attend(std::span<const Index> seqs, ConstMatrixRef<T> queries, MatrixRef<T> out) const {
        attend(seqs, queries, out, executor_);
    }
    /// The same on `executor`.
    void attend(std::span<const Index> seqs, ConstMatrixRef<T> queries, MatrixRef<T> out, ExecutorRef executor) const {
        constexpr const char* function = "PagedKVCache::attend";
        for (const Index seq : seqs)
            check_sequence(function, "seqs", seq);
        detail::check_prefill(function, queries, queries, queries, out, query_dim(), output_dim());
        detail::require(queries.rows() == static_cast<Index>(seqs.size()), function, "Q", "has ", queries.rows(),
                        " rows, expected ", seqs.size(), " (one per sequence)");
        attend_batch(seqs, queries, out, executor);
    }

    /// A mixed batch (chunked prefill beside decode): sequence seqs[i] (distinct live
    /// ids) appends the rows [q_offsets[i], q_offsets[i + 1]) of K/V (a chunk of prompt,
    /// one token, or none), and each of those rows of Q attends the sequence's cached
    /// tokens and its new rows up to itself, causally (within the window or among the
    /// sinks). A chunk of two rows or more runs the tiled kernel over the sequence's blocks
    /// (serving/paged_prefill.hpp): bit for bit multi_head_causal_softmax_attention of its
    /// rows over the sequence's pairs as stored; a chunk of one row is a decode step, bit
    /// for bit update-then-attend. All or nothing: the blocks the batch needs are counted
    /// exactly before any is taken (every member's at once: the windows free theirs only
    /// after every row has attended, since a chunk's first rows read further back than its
    /// last), and when the attends throw (an executor that fails) the rows are taken back,
    /// every block as it was. The (chunk, query tile, query heads) items spread over the
    /// pool's executor's threads (set_executor), the same bits on any. Allocates nothing
    /// once a call has run (the pool keeps the items and each thread's scratch), except
    /// when a batch has more chunks, or a chunk more tiles, than any before.
    void prefill(std::span<const Index> seqs, std::span<const Index> q_offsets, ConstMatrixRef<T> queries,
                 ConstMatrixRef<T> keys, ConstMatrixRef<T> values, MatrixRef<T> out) {
        prefill(seqs, q_offsets, queries, keys, values, out, executor_);
    }
    /// The same on `executor`.
    void prefill(std::span<const Index> seqs, std::span<const Index> q_offsets, ConstMatrixRef<T> queries,
                 ConstMatrixRef<T> keys, ConstMatrixRef<T> values, MatrixRef<T> out, ExecutorRef executor) {
        prefill_batch("PagedKVCache::prefill", seqs, q_offsets, queries, keys, values, out, executor);
    }
    /// Speculative decoding's verify step: the same, each chunk a tree of drafted tokens.
    /// parents[r] (one per row of K) is row r's parent within its chunk (−1: a root, which
    /// follows the sequence's cached tokens), before it: each row attends the sequence's
    /// cached tokens and, of its chunk, its ancestors and itself (SoftmaxOptions::parents;
    /// a chunk that is a chain, parents t − 1, is a prompt). A draft sits at position L +
    /// its depth in the tree, L the sequence's cached tokens, where an accepted path puts
    /// it: the caller turns its key there (RoPE), and the window, the sinks and ALiBi
    /// count that position, so a draft's output is its path's decoded token by token. The
    /// chunks then wait for accept(seq, path) or reject(seq) (pending_drafts). A windowed
    /// pool keeps the drafts in its rollback room (PoolOptions::rollback_tokens at least
    /// the chunk's rows always suffices): a chunk the window would free the sequence's
    /// tokens for is refused (std::invalid_argument, nothing changed).
    void prefill(std::span<const Index> seqs, std::span<const Index> q_offsets, ConstMatrixRef<T> queries,
                 ConstMatrixRef<T> keys, ConstMatrixRef<T> values, MatrixRef<T> out, ExecutorRef executor,
                 std::span<const Index> parents) {
        prefill_batch("PagedKVCache::prefill", seqs, q_offsets, queries, keys, values, out, executor, parents, true);
    }

    /// Throws what a verify step (prefill with parents) of these chunks would throw for
    /// their trees, changing nothing: std::invalid_argument for parents that are not a
    /// tree per chunk, or for drafts a windowed pool's rollback room cannot take back (see
    /// prefill). seqs: distinct live ids; q_offsets: as prefill's.
    void validate_tree(std::span<const Index> seqs, std::span<const Index> q_offsets,
                       std::span<const Index> parents) const {
        constexpr const char* function = "PagedKVCache::validate_tree";
        const auto batch = static_cast<Index>(seqs.size());
        detail::check_offsets(function, q_offsets, batch, q_offsets.empty() ? 0 : q_offsets.back());
        check_batch(function, seqs, batch, "seqs");
        check_tree(function, seqs, parents, q_offsets, q_offsets.back());
    }

    /// The drafts of `seq` the last verify step (prefill with parents) left waiting for
    /// accept or reject; 0 when none (any other call that changes the sequence's tokens
    /// makes them plain tokens).
    [[nodiscard]] Index pending_drafts(Index seq) const {
        check_sequence("PagedKVCache::pending_drafts", "seq", seq);
        return sequences_[static_cast<std::size_t>(seq)].drafts;
    }

    /// Keeps the accepted drafts of `seq`'s pending tree: path[k] (indices among the
    /// drafts, path[0] a root, each the child of the one before) becomes token L + k, L the
    /// length before the drafts, and the other drafts are dropped; then the sequence holds
    /// L + |path| tokens, the same pairs as if the path had been decoded token by token
    /// (with keys turned as the verify step's). Moves only the rows from the first k with
    /// path[k] ≠ k on, in every KV head; a block it writes that another sequence holds is
    /// copied first (PoolExhausted, nothing changed, when too few are free). An empty path
    /// is reject(seq). std::invalid_argument, nothing changed, without pending drafts or
    /// for a path that is not a chain of the tree.
    void accept(Index seq, std::span<const Index> path) {
        constexpr const char* function = "PagedKVCache::accept";
        Pairs::require_free(function, accept_blocks(seq, path, function));
        State& s = sequences_[static_cast<std::size_t>(seq)];
        const Index base = s.length - s.drafts;
        Pairs::keep_path(s, path);
        truncate(seq, base + static_cast<Index>(path.size()));
    }
    /// The free blocks accept(seq, path) takes (the copies of shared blocks it writes into),
    /// after the checks accept makes (std::invalid_argument naming `function`).
    [[nodiscard]] Index accept_blocks(Index seq, std::span<const Index> path,
                                      const char* function = "PagedKVCache::accept_blocks") const {
        return Pairs::path_copies(function, seq, path);
    }

    /// Drops every pending draft of `seq` (its length back to before the verify step).
    void reject(Index seq) {
        check_sequence("PagedKVCache::reject", "seq", seq);
        const State& s = sequences_[static_cast<std::size_t>(seq)];
        detail::require(s.drafts > 0, "PagedKVCache::reject", "seq", "is ", seq, ", which has no pending drafts");
        truncate(seq, s.length - s.drafts);
    }

    /// Snapshots of one sequence (Sequence::write_snapshot): the layout, scale, window,
    /// sinks, length and `first` (its first held token past the sinks: 0 or sinks without
    /// a window freeing any), then every KV head's keys, in token order (the sinks held,
    /// then the tokens from `first` on), then their values, as stored (S) — its tokens,
    /// not the pool's blocks, so it loads into a pool of any block size (which keeps of
    /// them what its own window keeps: read_sequence).
    void write_sequence(Index seq, snapshot::Writer& w) const {
        check_sequence("PagedKVCache::write_sequence", "seq", seq);
        const State& s = sequences_[static_cast<std::size_t>(seq)];
        w.index(layout_.q_heads);
        w.index(layout_.kv_heads);
        w.index(layout_.head_dim);
        w.index(layout_.values());
        w.number(scale_);
        w.index(window_);
        w.index(sinks_);
        w.index(s.length);
        w.index(s.first);
        for (const bool values : {false, true})
            for (Index h = 0; h < layout_.kv_heads; ++h)
                for_each_held_run(s, [&](Index block, Index offset, Index count, Index) {
                    (values ? values_ : keys_).write_rows(w, first_row(block, h) + offset, count);
                });
    }
    /// Reads a payload of write_sequence into `seq`, replacing its tokens. A windowed
    /// sequence keeps what this pool's window keeps, as its own steps would have left it
    /// (of a snapshot from a pool of larger blocks, which held more of the window's past,
    /// the tokens this pool's blocks would have freed are skipped), so it takes at most
    /// ceil(sinks / block) + ceil(window / block) + 1 blocks. Throws SnapshotError
    /// (another layout, scale, window or sinks, a wrong size) or PoolExhausted (fewer free
    /// blocks than the tokens kept need, its own blocks still held), `seq` unchanged.
    void read_sequence(Index seq, snapshot::Reader& r) {
        check_sequence("PagedKVCache::read_sequence", "seq", seq);
        State loaded = read_state("PagedKVCache::read_sequence", r);
        install(seq, loaded);
    }

    /// `seq` as a Memory of packed rows (see Sequence).
    [[nodiscard]] Sequence sequence(Index seq) {
        check_sequence("PagedKVCache::sequence", "seq", seq);
        return Sequence(*this, seq);
    }

    /// One sequence of a PagedKVCache as a memattn::Memory of packed rows (the layer's
    /// width, as memattn::MultiHead's): update/extend append to it, attend reads it,
    /// reset() truncates it to nothing. A view: the pool must outlive it, and removing the
    /// sequence ends it.
    class Sequence {
    public:
        using Scalar = T;  ///< the pool's scalar

        /// Appends one token (PagedKVCache::update).
        void update(ConstRowRef<T> key, ConstRowRef<T> value) { pool_->update(id_, key, value); }
        /// Appends many tokens (PagedKVCache::extend).
        void extend(ConstMatrixRef<T> keys, ConstMatrixRef<T> values) { pool_->extend(id_, keys, values); }
        /// Throws what update/extend would throw, changing nothing (PagedKVCache::validate).
        void validate(ConstMatrixRef<T> keys, ConstMatrixRef<T> values,
                      const detail::PairSite& site = {"PagedKVCache::Sequence::validate"}) const {
            pool_->validate(id_, keys, values, site);
        }
        /// Every query head of `query` over its tokens (PagedKVCache::attend).
        void attend(ConstRowRef<T> query, RowRef<T> out) const { pool_->attend(id_, query, out); }
        /// Its tokens.
        [[nodiscard]] Index length() const { return pool_->length(id_); }
        /// Bytes of the blocks it holds, shared ones included.
        [[nodiscard]] std::size_t footprint() const { return pool_->footprint(id_); }
        /// Truncates it to no tokens (its blocks freed unless shared).
        void reset() { pool_->truncate(id_, 0); }

        /// Width of a packed key row.
        [[nodiscard]] Index key_dim() const noexcept { return pool_->key_dim(); }
        /// Width of a packed value row.
        [[nodiscard]] Index value_dim() const noexcept { return pool_->value_dim(); }
        /// Width of a packed query row.
        [[nodiscard]] Index query_dim() const noexcept { return pool_->query_dim(); }
        /// Width of a packed output row.
        [[nodiscard]] Index output_dim() const noexcept { return pool_->output_dim(); }
        /// Snapshots (memattn/persistence/snapshot.hpp) of this sequence alone: its tokens
        /// (PagedKVCache::write_sequence), loadable into a sequence of any pool of the same
        /// layout, scale and storage.
        static constexpr snapshot::TypeCode snapshot_storage = detail::storage_code<T, S>();
        /// The kind a snapshot records.
        [[nodiscard]] static std::string snapshot_kind() { return "PagedKVCache::Sequence"; }
        /// Writes its tokens (PagedKVCache::write_sequence).
        void write_snapshot(snapshot::Writer& w) const { pool_->write_sequence(id_, w); }
        /// Reads tokens written by write_snapshot (PagedKVCache::read_sequence).
        void read_snapshot(snapshot::Reader& r) { pool_->read_sequence(id_, r); }

        /// Its id in the pool.
        [[nodiscard]] Index id() const noexcept { return id_; }
        /// The pool it belongs to.
        [[nodiscard]] PagedKVCache& pool() const noexcept { return *pool_; }

    private:
        friend class PagedKVCache;
        Sequence(PagedKVCache& pool, Index id) : pool_(&pool), id_(id) {}
        PagedKVCache* pool_;
        Index id_;
    };

private:
    friend struct detail::PagedAccess;
    // The blocks' bookkeeping (serving/detail/block_tables.hpp) and their pairs
    // (serving/detail/paged_pairs.hpp), named here: they are members of a dependent base.
    using typename Pairs::State;
    using Pairs::blocks_;
    using Pairs::block_size_;
    using Pairs::window_;
    using Pairs::sinks_;
    using Pairs::rollback_;
    using Pairs::refs_;
    using Pairs::free_;
    using Pairs::sequences_;
    using Pairs::layout_;
    using Pairs::scale_;
    using Pairs::softcap_;
    using Pairs::slopes_;
    using Pairs::sink_logits_;
    using Pairs::bf16_;
    using Pairs::keys_;
    using Pairs::values_;
    using Pairs::fresh_id;
    using Pairs::take_block;
    using Pairs::release;
    using Pairs::install;
    using Pairs::discard;
    using Pairs::blocks_for;
    using Pairs::sink_blocks;
    using Pairs::held_tokens;
    using Pairs::for_each_run;
    using Pairs::for_each_held_run;
    using Pairs::kept_first;
    using Pairs::freed_by_next;
    using Pairs::evict;
    using Pairs::extend_peak;
    using Pairs::peak_blocks;
    using Pairs::begin_undo;
    using Pairs::undo_batch;
    using Pairs::chunk_blocks;
    using Pairs::pool_rows;
    using Pairs::block_bytes;
    using Pairs::first_row;
    using Pairs::append;
    using Pairs::attend_batch;
    using Pairs::attend_rows;
    using Pairs::attend_decode;
    using Pairs::prefill_chunks;
    using Pairs::check_sequence;
    using Pairs::check_batch;
    using Pairs::checked_state;
    using Pairs::read_state;


    /// Every argument of the constructor checked, in their order (std::invalid_argument
    /// naming the first that is wrong), as the shape of its blocks.
    static detail::paged::PoolShape checked_shape(const HeadLayout& layout, Index blocks, Index block_size,
                                                  const SoftmaxOptions& options, const PoolOptions& pool) {
        constexpr const char* function = "PagedKVCache";
        detail::check_layout(function, layout);
        detail::at_least(blocks, 1, function, "blocks");
        detail::at_least(block_size, 1, function, "block_size");
        detail::require(options.fpmath == FpMath::strict || detail::bf16_products<T, S>, function, "options.fpmath",
                        "is FpMath::bf16, which multiplies the stored rows as bfloat16 words with the queries "
                        "rounded: a pool of float over rows stored as Eigen::bfloat16, Fp8E4M3 or Fp8E5M2 takes it, "
                        "this one stores ", detail::storage_name<S>, " and computes in ", detail::storage_name<T>);
        detail::checked_scale(static_cast<T>(options.scale), layout.head_dim, function);
        detail::check_logit_options<T>(function, options, layout.q_heads);
        detail::require(options.causal, function, "options.causal", "is false, but a pool's queries come after "
                        "its keys (each new token attends its past)");
        const Index window = options.window;
        if (window > 0)
            detail::require(pool.rollback_tokens >= 0 && pool.rollback_tokens <= max_length, function,
                            "pool.rollback_tokens", "is ", pool.rollback_tokens, ", expected 0 to ", max_length);
        return {.blocks = blocks,
                .block_size = block_size,
                .window = window,
                .sinks = window > 0 ? options.sink_tokens : 0,
                .rollback = window > 0 ? pool.rollback_tokens : 0};
    }


    /// With PoolOptions::reject_nonfinite, a key (or value) row that is not all finite is
    /// refused, naming the first value that is not.
    template <class D>
    void check_finite(const detail::PairSite& site, const D& rows, bool values) const {
        if (!reject_nonfinite_ || rows.size() == 0 || rows.allFinite()) [[likely]]
            return;
        for (Index r = 0; r < rows.rows(); ++r)
            for (Index c = 0; c < rows.cols(); ++c)
                detail::require(std::isfinite(rows(r, c)), site.function, values ? site.value_name : site.key_name,
                                "has the value ", rows(r, c), " in row ", site.first_row + r, ", column ", c,
                                ", and the pool refuses values that are not finite (PoolOptions::reject_nonfinite)");
    }

    /// prefill under the name of `function` (PagedKVCache::prefill, batched_prefill).
    void prefill_batch(const char* function, std::span<const Index> seqs, std::span<const Index> q_offsets,
                       ConstMatrixRef<T> queries, ConstMatrixRef<T> keys, ConstMatrixRef<T> values, MatrixRef<T> out,
                       ExecutorRef executor, std::span<const Index> parents = {}, bool tree = false) {
        const detail::PairSite site{function, "K", "V"};
        const Index batch = static_cast<Index>(seqs.size()), rows = keys.rows();
        detail::check_offsets(function, q_offsets, batch, rows);
        check_batch(function, seqs, batch, "seqs");
        detail::check_site_pairs(site, detail::shape(keys), detail::shape(values), key_dim(), value_dim(), 0);
        detail::check_prefill(function, queries, keys, values, out, query_dim(), output_dim());
        const auto chunk = [&](std::size_t i) { return q_offsets[i + 1] - q_offsets[i]; };
        for (std::size_t i = 0; i < seqs.size(); ++i)
            detail::check_room(site.function, sequences_[static_cast<std::size_t>(seqs[i])].length, chunk(i));
        if (tree)
            check_tree(function, seqs, parents, q_offsets, rows);
        const Index needed = chunk_blocks(seqs, chunk);
        detail::check_storable<T, S>(site, keys, false);
        detail::check_storable<T, S>(site, values, true);
        check_finite(site, keys, false);
        check_finite(site, values, true);
        Pairs::require_free(site.function, needed);
        if (tree)  // room for the trees now, while nothing has changed: their assigns below cannot throw
            for (std::size_t i = 0; i < seqs.size(); ++i)
                sequences_[static_cast<std::size_t>(seqs[i])].tree.reserve(static_cast<std::size_t>(chunk(i)));
        for (std::size_t i = 0; i < seqs.size(); ++i) {
            State& s = sequences_[static_cast<std::size_t>(seqs[i])];
            begin_undo(s);
            s.undo.shared = append(s, keys.middleRows(q_offsets[i], chunk(i)), values.middleRows(q_offsets[i], chunk(i)));
        }
        try {
            prefill_chunks(seqs, q_offsets, queries, out, executor, parents);
            if (tree)
                for (std::size_t i = 0; i < seqs.size(); ++i) {
                    if (chunk(i) == 0)  // no rows: its own pending tree, if any, stays
                        continue;
                    State& s = sequences_[static_cast<std::size_t>(seqs[i])];
                    s.tree.assign(parents.begin() + q_offsets[i], parents.begin() + q_offsets[i + 1]);  // reserved
                    s.drafts = chunk(i);
                }
        } catch (...) {
            undo_batch(seqs);
            throw;
        }
        for (const Index seq : seqs)  // after the attends: a chunk's first rows see further back
            evict(sequences_[static_cast<std::size_t>(seq)]);
    }

    /// A verify step's trees: one parent per row, each chunk's within it and before the
    /// row; in a windowed pool, each chunk's drafts within the rollback room: every length
    /// an accept or reject can leave (L, the length before the drafts, to L + the tree's
    /// longest path) stays truncatable once the window has moved on to L + n. A truncate to
    /// the sinks or fewer always succeeds, and past them the shortest is the hardest
    /// (can_truncate), so that one is checked.
    void check_tree(const char* function, std::span<const Index> seqs, std::span<const Index> parents,
                    std::span<const Index> q_offsets, Index rows) const {
        detail::require(static_cast<Index>(parents.size()) == rows, function, "parents", "has ", parents.size(),
                        " entries, expected ", rows, " (one per row of K)");
        for (std::size_t i = 0; i + 1 < q_offsets.size(); ++i) {
            const Index n = q_offsets[i + 1] - q_offsets[i];
            const std::span<const Index> tree = parents.subspan(static_cast<std::size_t>(q_offsets[i]),
                                                                static_cast<std::size_t>(n));
            for (Index t = 0; t < n; ++t) {
                const Index p = tree[static_cast<std::size_t>(t)];
                detail::require(p >= -1 && p < t, function, "parents", "has ", p, " at row ", q_offsets[i] + t,
                                " (draft ", t, " of sequence ", i, " in the batch), expected -1 (a root) or an "
                                "earlier draft of its chunk, 0 to ", t - 1);
            }
            const State& s = sequences_[static_cast<std::size_t>(seqs[i])];
            if (window_ == 0 || n == 0)
                continue;
            Index shortest = s.length;
            if (shortest <= sinks_) {  // among the sinks: past them only if a path reaches that far
                shortest = sinks_ + 1;
                if (s.length + longest_path(tree) < shortest)
                    continue;
            }
            if (shortest >= s.length + n)  // (the sequence's own length: nothing truncated)
                continue;
            const Index first = kept_first(s.length + n, s.first);  // what the window holds after the step
            detail::require(std::max(sinks_, shortest - window_) >= first, function, "parents",
                            "give sequence ", seqs[i], " ", n, " drafts after its ", s.length,
                            " tokens, but its window of ", window_, " would then free tokens up to ", first,
                            " that a sequence of ", shortest, " tokens (a rejected tree or a short path) sees: a "
                            "windowed pool keeps a tree's drafts in its rollback room "
                            "(PoolOptions::rollback_tokens >= ", n, "; this pool's is ", rollback_, ")");
        }
    }
    /// The drafts on a tree's longest path from a root (its depth + 1).
    static Index longest_path(std::span<const Index> tree) noexcept {
        Index longest = 0;
        for (Index t = 0; t < static_cast<Index>(tree.size()); ++t) {
            Index drafts = 0;
            for (Index a = t; a >= 0; a = tree[static_cast<std::size_t>(a)])
                ++drafts;
            longest = std::max(longest, drafts);
        }
        return longest;
    }

    /// update(seqs, K, V) under the name of `function` (PagedKVCache::update, ::decode,
    /// batched_decode), each member's change noted for undo_batch.
    void update_batch(std::string_view function, std::span<const Index> seqs, ConstMatrixRef<T> keys,
                      ConstMatrixRef<T> values) {
        const detail::PairSite site{function, "K", "V"};
        check_batch(site.function, seqs, keys.rows(), "K");
        detail::require(values.rows() == keys.rows(), site.function, "V", "has ", values.rows(), " rows, expected ",
                        keys.rows(), " (one per sequence)");
        for (std::size_t i = 0; i < seqs.size(); ++i) {
            const Index r = static_cast<Index>(i);
            detail::check_site_pairs(site, detail::shape(keys.row(r)), detail::shape(values.row(r)), key_dim(),
                                     value_dim(), sequences_[static_cast<std::size_t>(seqs[i])].length);
        }
        detail::check_storable<T, S>(site, keys, false);
        detail::check_storable<T, S>(site, values, true);
        check_finite(site, keys, false);
        check_finite(site, values, true);
        const Index needed = peak_blocks(seqs);
        Pairs::require_free(site.function, needed);
        for (std::size_t i = 0; i < seqs.size(); ++i) {
            const Index r = static_cast<Index>(i);
            State& s = sequences_[static_cast<std::size_t>(seqs[i])];
            begin_undo(s);
            s.undo.evicted = freed_by_next(s);
            s.undo.shared = append(s, keys.middleRows(r, 1), values.middleRows(r, 1));
            evict(s);
        }
    }

    /// update_batch, then the attends on `executor`, undone when they throw.
    void decode_batch(std::string_view function, std::span<const Index> seqs, ConstMatrixRef<T> queries,
                      ConstMatrixRef<T> keys, ConstMatrixRef<T> values, MatrixRef<T> out, ExecutorRef executor) {
        for (const Index seq : seqs)
            check_sequence(function, "seqs", seq);
        detail::require(queries.rows() == static_cast<Index>(seqs.size()) && queries.cols() == query_dim(), function,
                        "Q", "has shape ", detail::shape(queries), ", expected ", seqs.size(), 'x', query_dim(),
                        " (one row per sequence)");
        detail::require(out.rows() == queries.rows() && out.cols() == output_dim(), function, "O", "has shape ",
                        detail::shape(out), ", expected ", queries.rows(), 'x', output_dim());
        detail::require_disjoint(function, "O", out, "Q", queries);
        detail::require_disjoint(function, "O", out, "K", keys);
        detail::require_disjoint(function, "O", out, "V", values);
        update_batch(function, seqs, keys, values);
        try {
            attend_decode(seqs, queries, out, executor);
        } catch (...) {
            undo_batch(seqs);
            throw;
        }
    }

    bool reject_nonfinite_;
};

namespace detail {
/// The batched calls of serving/batched.hpp over a pool, under their own names.
struct PagedAccess {
    template <class Pool, class... Args>
    static void decode(Pool& pool, std::string_view function, Args&&... args) {
        pool.decode_batch(function, std::forward<Args>(args)...);
    }
    template <class Pool, class... Args>
    static void prefill(Pool& pool, const char* function, Args&&... args) {
        pool.prefill_batch(function, std::forward<Args>(args)...);
    }
    /// A sequence's snapshot read into blocks of the pool, not yet anyone's (ModelCache's
    /// load: every layer read before any is changed).
    template <class Pool>
    static auto read_state(Pool& pool, const char* function, snapshot::Reader& r) {
        return pool.read_state(function, r);
    }
    /// Puts it in place of `seq`'s tokens.
    template <class Pool, class State>
    static void install(Pool& pool, Index seq, State& loaded) noexcept {
        pool.install(seq, loaded);
    }
    /// Gives its blocks back.
    template <class Pool, class State>
    static void discard(Pool& pool, State& loaded) noexcept {
        pool.discard(loaded);
    }
    /// The blocks `seq` alone holds (which its removal frees).
    template <class Pool>
    static Index sole_blocks(const Pool& pool, Index seq) noexcept {
        Index n = 0;
        for (const Index b : pool.sequences_[static_cast<std::size_t>(seq)].table)
            n += pool.refs_[static_cast<std::size_t>(b)] == 1 ? 1 : 0;
        return n;
    }
};
}  // namespace detail

}  // namespace memattn
