#pragma once
// PagedLatentKVCache: one multi-head latent attention layer's cache (memory/
// latent_kv_cache.hpp) for many sequences at once, in a pool of fixed-size blocks, with
// prefixes shared between sequences: what a DeepSeek-V3 / Kimi K2 server batches.
//
//   memattn::PagedLatentKVCache<float, Eigen::bfloat16> pool(512, 64, scale, /*blocks=*/4096);
//   const memattn::Index a = pool.add_sequence();
//   memattn::mla_prefill(pool.sequence(a), q_nope, q_rope, latents, ropes, W_UK, W_UV, out);
//   const memattn::Index b = pool.fork(a);          // shares every block of a
//   pool.update(seqs, latents, ropes);              // one token each (copy-on-write)
//   memattn::mla_decode(pool, seqs, q_nope, q_rope, W_UK, W_UV, out);  // the batch's step
//   pool.truncate(b, 10);                           // rollback: frees what no one else holds
//   pool.remove(a);
//
// A block holds `block_size` tokens: for block b and slot t the token's row [c | k_rope]
// is row b·block_size + t of one detail::StoredRows (in storage S, as LatentKVCache's).
// Which blocks a sequence holds, the reference counts, copy-on-write, the count of
// blocks a call needs before it takes any and the undo of a batch are the KV pool's
// (serving/detail/block_tables.hpp, PagedKVCache): a fork costs one count per block, a
// sequence that writes into a block another holds copies it first, a truncate frees the
// blocks past it that no one else holds.
//
// The attends are LatentKVCache's (memory/detail/latent_attend.hpp) over each sequence's
// blocks: every head a query lane of the kernel's register-blocked tiles, each sequence
// cut into pieces by its length alone (at least 1024 tokens), the pieces of every
// sequence of a batch spread over the executor's threads and merged per sequence in
// order, so a sequence's outputs are bitwise the same for any thread count and whatever
// else shares its batch, and the same as a LatentKVCache holding its rows gives. A tile
// of 128 tokens inside one block is read in place (storage T, block_size a multiple of
// 128: the default), else decoded or copied as a compact cache's tiles are.
//
// Sequences that share a prefix read its blocks once each: the step is bound by
// arithmetic (2·(2r + d_r) FLOPs a head and token, 0.6–0.8 of the FMA peak, docs/
// performance.md), so folding the sharers' queries into one pass over the shared blocks
// (as the KV pool's cascade does for its bandwidth-bound groups) saves bytes the step is
// not waiting for, and no arithmetic.
//
// Capacity is fixed when the pool is built. When a call needs more blocks than are free
// it throws memattn::PoolExhausted and changes nothing; every other bad input (an id that
// is not a live sequence, a shape, a value the storage cannot hold) throws
// std::invalid_argument and changes nothing. After reserve(heads, batch, tokens) a step
// (update, attend, decode) of at most that batch, those heads and that many tokens in all
// allocates nothing.

#include "memattn/execution/executor.hpp"
#include "memattn/kernels/softmax_options.hpp"
#include "memattn/layer/latent_attention.hpp"
#include "memattn/memory/detail/held_logits.hpp"
#include "memattn/memory/detail/latent_attend.hpp"
#include "memattn/memory/detail/memory_checks.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/serving/detail/block_tables.hpp"
#include "memattn/serving/pool_options.hpp"
#include "memattn/storage/compact.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace memattn {

/// One latent attention layer's cache for many sequences in a pool of blocks; see the
/// top of the file.
/// \tparam T float or double: the rows' scalar and the arithmetic's.
/// \tparam S how the rows are stored, as LatentKVCache's.
template <Scalar T, class S = T>
    requires StorageFor<S, T> && detail::PlainKeys<S>
class PagedLatentKVCache : public ExecutorSlot, private detail::paged::BlockTables {
public:
    using Scalar = T;       ///< the rows' scalar and the arithmetic's
    using StorageType = S;  ///< how the rows are stored

    /// Tokens per block unless the constructor is told otherwise.
    static constexpr Index default_block_size = 128;

    class Sequence;

    /// A pool of `blocks` blocks of `block_size` tokens, each token a row [c | k_rope] of
    /// latent_dim + rope_dim values; `scale` multiplies q·k before the softmax (required,
    /// as LatentKVCache's). Allocates the whole pool now.
    PagedLatentKVCache(Index latent_dim, Index rope_dim, T scale, Index blocks, Index block_size = default_block_size)
        : PagedLatentKVCache(latent_dim, rope_dim, scale, blocks, block_size, SoftmaxOptions{}) {}

    /// With the logit options that apply (LatentKVCache's: the softcap, sink logits one
    /// for every head or one per head, FpMath::bf16 over bfloat16 rows; the rest refused) and PoolOptions (reject_nonfinite;
    /// rollback_tokens is a window's and changes nothing here).
    PagedLatentKVCache(Index latent_dim, Index rope_dim, T scale, Index blocks, Index block_size,
                       const SoftmaxOptions& options, const PoolOptions& pool = {})
        : BlockTables(checked_shape(latent_dim, rope_dim, scale, blocks, block_size, options)),
          latent_dim_(latent_dim),
          rope_dim_(rope_dim),
          scale_(scale),
          logits_("PagedLatentKVCache", detail::without_fpmath(options), std::type_identity<T>{}),
          fpmath_(options.fpmath),
          reject_nonfinite_(pool.reject_nonfinite),
          rows_(detail::checked_product("PagedLatentKVCache", "blocks", blocks, block_size, "blocks x block_size"),
                latent_dim + rope_dim),
          joined_(join_rows, latent_dim + rope_dim) {
        rows_.advise_huge_pages();  // read end to end by every step (detail/huge_pages.hpp)
    }

    /// A new, empty sequence; returns its id (the smallest id not in use).
    Index add_sequence() { return new_sequence(); }

    /// A new sequence holding the same tokens as `parent`, sharing every block of it
    /// (copied when either writes into a shared block). Returns its id.
    Index fork(Index parent) {
        check_sequence("PagedLatentKVCache::fork", "parent", parent);
        return fork_sequence(parent);
    }

    /// Keeps the first `tokens` tokens of `seq` (0 ≤ tokens ≤ length: a rollback) and
    /// frees the blocks past them that no other sequence holds.
    void truncate(Index seq, Index tokens) {
        constexpr const char* function = "PagedLatentKVCache::truncate";
        check_sequence(function, "seq", seq);
        State& s = sequences_[static_cast<std::size_t>(seq)];
        detail::require(tokens >= 0 && tokens <= s.length, function, "tokens", "is ", tokens, ", expected 0 to ",
                        s.length, " (the length of sequence ", seq, ")");
        const auto kept = static_cast<std::size_t>(blocks_for(tokens));
        for (std::size_t i = kept; i < s.table.size(); ++i)
            release(s.table[i]);
        s.table.resize(kept);
        s.length = tokens;
    }

    /// Ends `seq`: frees the blocks no other sequence holds; its id may be reused.
    void remove(Index seq) {
        check_sequence("PagedLatentKVCache::remove", "seq", seq);
        remove_sequence(seq);
    }

    /// The free blocks a batch bringing tokens[i] tokens to seqs[i] (distinct live ids)
    /// takes, copies of shared last blocks included: a step whose blocks_needed is at
    /// most free_blocks() cannot throw PoolExhausted.
    [[nodiscard]] Index blocks_needed(std::span<const Index> seqs, std::span<const Index> tokens) const {
        return checked_blocks_needed("PagedLatentKVCache::blocks_needed", seqs, tokens);
    }

    /// True when `seq` is a live sequence of the pool.
    [[nodiscard]] bool contains(Index seq) const noexcept { return live(seq); }
    /// Tokens of `seq`.
    [[nodiscard]] Index length(Index seq) const { return state("PagedLatentKVCache::length", seq).length; }
    /// Blocks held by `seq` (shared ones included).
    [[nodiscard]] Index blocks_of(Index seq) const {
        return static_cast<Index>(state("PagedLatentKVCache::blocks_of", seq).table.size());
    }
    /// Live sequences.
    [[nodiscard]] Index sequences() const noexcept { return live_sequences(); }
    /// Blocks some sequence holds (a shared block once).
    [[nodiscard]] Index blocks_in_use() const noexcept { return blocks_ - free_blocks(); }
    /// Blocks no sequence holds.
    [[nodiscard]] Index free_blocks() const noexcept { return static_cast<Index>(free_.size()); }
    /// Blocks of the pool.
    [[nodiscard]] Index blocks() const noexcept { return blocks_; }
    /// Tokens per block.
    [[nodiscard]] Index block_size() const noexcept { return block_size_; }
    /// Bytes the pool holds: its rows (allocated when it was built), the counts, the
    /// sequences' tables and the attends' scratch.
    [[nodiscard]] std::size_t footprint() const noexcept {
        return rows_.bytes(rows_.rows()) + table_bytes();
    }
    /// Bytes of the blocks `seq` holds, shared ones included.
    [[nodiscard]] std::size_t footprint(Index seq) const {
        return rows_.bytes(block_size_) * static_cast<std::size_t>(blocks_of(seq));
    }
    /// Bytes one token takes as stored (S), as LatentKVCache::token_bytes.
    [[nodiscard]] static std::size_t token_bytes(Index latent_dim, Index rope_dim) {
        return LatentKVCache<T, S>::token_bytes(latent_dim, rope_dim);
    }

    /// r, the latent's width (and the outputs').
    [[nodiscard]] Index latent_dim() const noexcept { return latent_dim_; }
    /// d_r, the RoPE key's width.
    [[nodiscard]] Index rope_dim() const noexcept { return rope_dim_; }
    /// r + d_r: a query row's width, and a stored row's.
    [[nodiscard]] Index query_dim() const noexcept { return width(); }
    /// The factor of q·k before the softmax.
    [[nodiscard]] T scale() const noexcept { return scale_; }
    /// The options its attends follow: the scale, the softcap, the fpmath and the sink
    /// logits (the spans view the pool's own copy).
    [[nodiscard]] SoftmaxOptions options() const noexcept {
        return logits_.into({.scale = static_cast<double>(scale_), .fpmath = fpmath_});
    }
    /// What the pool refuses beyond its attention options.
    [[nodiscard]] PoolOptions pool_options() const noexcept { return {.reject_nonfinite = reject_nonfinite_}; }
    /// Where the tokens of `seq` are (its blocks, in storage S): how mla_prefill reads it.
    [[nodiscard]] detail::LatentRowsView<T, S> view(Index seq) const {
        const State& s = state("PagedLatentKVCache::view", seq);
        return {.rows = &rows_, .table = s.table.data(), .first = 0, .block = block_size_, .length = s.length};
    }

    // set_executor(executor), executor(): where attends and batches run (ExecutorSlot).

    /// Appends one token to `seq`: its latent (1 × latent_dim) and RoPE key (1 × rope_dim).
    /// Takes a free block when the last one is full, and copies the last one first when
    /// another sequence holds it.
    void update(Index seq, ConstRowRef<T> latent, ConstRowRef<T> rope) {
        validate(seq, latent, rope, "PagedLatentKVCache::update");
        append(sequences_[static_cast<std::size_t>(seq)], latent, rope);
    }
    /// Appends n tokens to `seq` (latents n × latent_dim, ropes n × rope_dim); all or nothing.
    void extend(Index seq, ConstMatrixRef<T> latents, ConstMatrixRef<T> ropes) {
        validate(seq, latents, ropes, "PagedLatentKVCache::extend");
        append(sequences_[static_cast<std::size_t>(seq)], latents, ropes);
    }
    /// Throws what extend(seq, ...) would throw for these rows, changing nothing:
    /// std::invalid_argument for an id, a shape or a value S cannot hold (or, with
    /// PoolOptions::reject_nonfinite, one that is not finite), std::length_error past
    /// memattn::max_length, memattn::PoolExhausted when too few blocks are free.
    void validate(Index seq, ConstMatrixRef<T> latents, ConstMatrixRef<T> ropes,
                  const char* function = "PagedLatentKVCache::validate") const {
        const State& s = state(function, seq);
        const detail::PairSite site{function, "latents", "ropes"};
        detail::check_site_pairs(site, detail::shape(latents), detail::shape(ropes), latent_dim_, rope_dim_, s.length);
        check_rows(site, latents, ropes);
        const Index needed = extend_peak(s, latents.rows());
        require_free(function, needed);
    }

    /// One token for each sequence of `seqs` (distinct live ids): row i of latents (B ×
    /// latent_dim) and ropes (B × rope_dim) appended to seqs[i], in batch order, all or
    /// nothing (the blocks counted first, copies of shared blocks included). Allocates
    /// nothing.
    void update(std::span<const Index> seqs, ConstMatrixRef<T> latents, ConstMatrixRef<T> ropes) {
        update_batch("PagedLatentKVCache::update", seqs, latents, ropes);
    }

    /// Rows h of `out` (H × latent_dim) = head h of `queries` (H × (latent_dim + rope_dim),
    /// absorbed, packed [q_lat | q_rope]) over every token of `seq`, as
    /// LatentKVCache::attend; zero for an empty sequence.
    void attend(Index seq, ConstMatrixRef<T> queries, MatrixRef<T> out, ExecutorRef executor) const {
        const Index seqs[1] = {seq};
        attend_checked("PagedLatentKVCache::attend", std::span<const Index>(seqs), queries, out, executor);
    }
    /// The same on the pool's executor.
    void attend(Index seq, ConstMatrixRef<T> queries, MatrixRef<T> out) const { attend(seq, queries, out, executor_); }

    /// A batch's attends: sequence seqs[i] (live ids, repeats allowed) for the H query
    /// rows [i·H, (i + 1)·H) of `queries` ((B·H) × (latent_dim + rope_dim)) into the same
    /// rows of `out` ((B·H) × latent_dim), each bit for bit attend(seqs[i], ...) of its
    /// rows: the pieces of every sequence spread over the executor's threads by their
    /// tokens.
    void attend(std::span<const Index> seqs, ConstMatrixRef<T> queries, MatrixRef<T> out, ExecutorRef executor) const {
        attend_checked("PagedLatentKVCache::attend", seqs, queries, out, executor);
    }
    /// The same on the pool's executor.
    void attend(std::span<const Index> seqs, ConstMatrixRef<T> queries, MatrixRef<T> out) const {
        attend(seqs, queries, out, executor_);
    }

    /// One decode step of a batch: update(seqs, latents, ropes), then attend(seqs,
    /// queries, out, executor). All or nothing: when the attends throw, the tokens are
    /// taken back and every block is as it was.
    void decode(std::span<const Index> seqs, ConstMatrixRef<T> queries, ConstMatrixRef<T> latents,
                ConstMatrixRef<T> ropes, MatrixRef<T> out, ExecutorRef executor) {
        constexpr const char* function = "PagedLatentKVCache::decode";
        for (const Index seq : seqs)
            check_sequence(function, "seqs", seq);
        const Index heads = check_queries(function, seqs, queries, out);
        detail::require_disjoint(function, "out", out, "latents", latents);
        detail::require_disjoint(function, "out", out, "ropes", ropes);
        static_cast<void>(heads);
        update_batch(function, seqs, latents, ropes);
        try {
            attend_jobs(seqs, queries, out, executor);
        } catch (...) {
            undo_batch(seqs);
            throw;
        }
    }
    /// The same on the pool's executor.
    void decode(std::span<const Index> seqs, ConstMatrixRef<T> queries, ConstMatrixRef<T> latents,
                ConstMatrixRef<T> ropes, MatrixRef<T> out) {
        decode(seqs, queries, latents, ropes, out, executor_);
    }

    /// Sizes the attends' scratch for batches of up to `batch` sequences of `heads` heads
    /// holding up to `tokens` tokens in all, on the pool's executor's threads (or as many
    /// as `executor` has), so such steps allocate nothing (else the first step of a size
    /// sizes it, and a step that needs more grows it).
    void reserve(Index heads, Index batch, Index tokens, ExecutorRef executor = {}) {
        constexpr const char* function = "PagedLatentKVCache::reserve";
        detail::at_least(heads, 1, function, "heads");
        detail::at_least(batch, 1, function, "batch");
        detail::at_least(tokens, 0, function, "tokens");
        const std::lock_guard<std::mutex> lock(scratch_.mutex);
        const Index pieces = (tokens + detail::latent_piece_tokens - 1) / detail::latent_piece_tokens + batch;
        const int workers = std::min<int>(std::max(executor.concurrency(), executor_.concurrency()), detail::max_ranges);
        scratch_.size(detail::checked_product(function, "heads", heads, pieces, "heads x pieces"), latent_dim_, workers);
        if (scratch_.jobs.capacity() < static_cast<std::size_t>(batch))
            scratch_.jobs.reserve(static_cast<std::size_t>(batch));
        for (auto& worker : scratch_.workers)  // each thread's kernel scratch and tile, as latent_piece makes them
            detail::latent_worker(worker, heads, latent_dim_, width(), fpmath_);
    }

    /// The storage type code snapshots record for S.
    static constexpr snapshot::TypeCode snapshot_storage = detail::storage_code<T, S>();
    /// Snapshots of one sequence (Sequence::write_snapshot): latent_dim, rope_dim, scale,
    /// length, then its rows as stored (S), oldest first — LatentKVCache's payload, so it
    /// loads into a pool of any block size.
    void write_sequence(Index seq, snapshot::Writer& w) const {
        const State& s = state("PagedLatentKVCache::write_sequence", seq);
        w.index(latent_dim_);
        w.index(rope_dim_);
        w.number(scale_);
        w.index(s.length);
        for_each_run(s, 0, s.length, [&](Index block, Index offset, Index count, Index) {
            rows_.write_rows(w, block * block_size_ + offset, count);
        });
    }
    /// Reads a payload of write_sequence into `seq`, replacing its tokens. Throws
    /// SnapshotError (another latent_dim, rope_dim or scale, a wrong size) or
    /// PoolExhausted (fewer free blocks than its tokens need, its own still held), `seq`
    /// unchanged.
    void read_sequence(Index seq, snapshot::Reader& r) {
        constexpr const char* function = "PagedLatentKVCache::read_sequence";
        check_sequence(function, "seq", seq);
        r.expect("latent_dim", latent_dim_);
        r.expect("rope_dim", rope_dim_);
        r.expect("scale", scale_);
        const std::size_t token = detail::StoredRows<T, S>::row_bytes(width());
        State loaded;
        loaded.length = r.count("length", 0, static_cast<Index>(std::min<std::size_t>(r.remaining() / token,
                                                                                       static_cast<std::size_t>(max_length))));
        r.expect_remaining(static_cast<std::size_t>(loaded.length) * token, "the rows");
        const Index held = blocks_for(loaded.length);
        require_free(function, held);
        loaded.table.reserve(static_cast<std::size_t>(blocks_));  // may throw: nothing changed yet
        for (Index i = 0; i < held; ++i)
            loaded.table.push_back(take_block());
        try {
            for_each_run(loaded, 0, loaded.length, [&](Index block, Index offset, Index count, Index) {
                rows_.read_rows(r, block * block_size_ + offset, count);
            });
        } catch (...) {
            discard(loaded);
            throw;
        }
        install(seq, loaded);
    }

    /// `seq` as a cache of its own (see Sequence).
    [[nodiscard]] Sequence sequence(Index seq) {
        check_sequence("PagedLatentKVCache::sequence", "seq", seq);
        return Sequence(*this, seq);
    }

    /// One sequence of a PagedLatentKVCache with LatentKVCache's calls (update, extend,
    /// attend, truncate, length, view, snapshots), for mla_decode and mla_prefill. A view:
    /// the pool must outlive it, and removing the sequence ends it.
    class Sequence {
    public:
        using Scalar = T;       ///< the pool's scalar
        using StorageType = S;  ///< how the pool stores rows

        /// Appends one token (PagedLatentKVCache::update).
        void update(ConstRowRef<T> latent, ConstRowRef<T> rope) { pool_->update(id_, latent, rope); }
        /// Appends many tokens (PagedLatentKVCache::extend).
        void extend(ConstMatrixRef<T> latents, ConstMatrixRef<T> ropes) { pool_->extend(id_, latents, ropes); }
        /// Throws what extend would throw, changing nothing.
        void validate(ConstMatrixRef<T> latents, ConstMatrixRef<T> ropes,
                      const char* function = "PagedLatentKVCache::Sequence::validate") const {
            pool_->validate(id_, latents, ropes, function);
        }
        /// Its H absorbed queries over its tokens (PagedLatentKVCache::attend).
        void attend(ConstMatrixRef<T> queries, MatrixRef<T> out, ExecutorRef executor) const {
            pool_->attend(id_, queries, out, executor);
        }
        /// The same on the pool's executor.
        void attend(ConstMatrixRef<T> queries, MatrixRef<T> out) const { pool_->attend(id_, queries, out); }
        /// Keeps its first `tokens` tokens.
        void truncate(Index tokens) { pool_->truncate(id_, tokens); }
        /// Truncates it to no tokens.
        void reset() { pool_->truncate(id_, 0); }
        /// Its tokens.
        [[nodiscard]] Index length() const { return pool_->length(id_); }
        /// Bytes of the blocks it holds, shared ones included.
        [[nodiscard]] std::size_t footprint() const { return pool_->footprint(id_); }
        /// Where its tokens are.
        [[nodiscard]] detail::LatentRowsView<T, S> view() const { return pool_->view(id_); }
        /// r, the pool's latent width.
        [[nodiscard]] Index latent_dim() const noexcept { return pool_->latent_dim(); }
        /// d_r, the pool's RoPE key width.
        [[nodiscard]] Index rope_dim() const noexcept { return pool_->rope_dim(); }
        /// r + d_r, a query row's width.
        [[nodiscard]] Index query_dim() const noexcept { return pool_->query_dim(); }
        /// The pool's factor of q·k.
        [[nodiscard]] T scale() const noexcept { return pool_->scale(); }
        /// The pool's options (PagedLatentKVCache::options).
        [[nodiscard]] SoftmaxOptions options() const noexcept { return pool_->options(); }

        /// Snapshots of this sequence alone (PagedLatentKVCache::write_sequence).
        static constexpr snapshot::TypeCode snapshot_storage = detail::storage_code<T, S>();
        /// The kind a snapshot records.
        [[nodiscard]] static std::string snapshot_kind() { return "PagedLatentKVCache::Sequence"; }
        /// Writes its tokens (PagedLatentKVCache::write_sequence).
        void write_snapshot(snapshot::Writer& w) const { pool_->write_sequence(id_, w); }
        /// Reads tokens written by write_snapshot (PagedLatentKVCache::read_sequence).
        void read_snapshot(snapshot::Reader& r) { pool_->read_sequence(id_, r); }

        /// Its id in the pool.
        [[nodiscard]] Index id() const noexcept { return id_; }
        /// The pool it belongs to.
        [[nodiscard]] PagedLatentKVCache& pool() const noexcept { return *pool_; }

    private:
        friend class PagedLatentKVCache;
        Sequence(PagedLatentKVCache& pool, Index id) : pool_(&pool), id_(id) {}
        PagedLatentKVCache* pool_;
        Index id_;
    };

private:
    using Rows = detail::StoredRows<T, S>;
    /// Rows an append joins at a time ([c | k_rope] into joined_).
    static constexpr Index join_rows = 16;

    [[nodiscard]] Index width() const noexcept { return latent_dim_ + rope_dim_; }

    /// Every argument of the constructor checked, in their order, as the shape of its blocks.
    static detail::paged::PoolShape checked_shape(Index latent_dim, Index rope_dim, T scale, Index blocks,
                                                  Index block_size, const SoftmaxOptions& options) {
        constexpr const char* function = "PagedLatentKVCache";
        detail::at_least(latent_dim, 1, function, "latent_dim");
        detail::at_least(rope_dim, 0, function, "rope_dim");
        detail::require(std::isfinite(scale) && scale != T(0), function, "scale", "is ", scale,
                        ", expected a finite nonzero factor of q·k (see mla_softmax_scale)");
        detail::at_least(blocks, 1, function, "blocks");
        detail::at_least(block_size, 1, function, "block_size");
        (void)detail::checked_latent_fpmath<T, S>(function, options);
        detail::require(options.alibi_slopes.empty(), function, "options.alibi_slopes",
                        "are given, but latent attention places its tokens by RoPE (the rope_dim columns)");
        return {.blocks = blocks, .block_size = block_size, .window = 0, .sinks = 0, .rollback = 0};
    }

    const State& state(const char* function, Index seq) const { return checked_state(function, seq); }
    /// Values the storage cannot hold, and (reject_nonfinite) values that are not finite.
    void check_rows(const detail::PairSite& site, const ConstMatrixRef<T>& latents, const ConstMatrixRef<T>& ropes) const {
        detail::check_storable<T, S>(site, latents, false);
        detail::check_storable<T, S>(site, ropes, true);
        if (!reject_nonfinite_)
            return;
        for (const bool second : {false, true}) {
            const ConstMatrixRef<T>& m = second ? ropes : latents;
            if (m.size() == 0 || m.allFinite()) [[likely]]
                continue;
            for (Index r = 0; r < m.rows(); ++r)
                for (Index c = 0; c < m.cols(); ++c)
                    detail::require(std::isfinite(m(r, c)), site.function, second ? site.value_name : site.key_name,
                                    "has the value ", m(r, c), " in row ", r, ", column ", c,
                                    ", and the pool refuses values that are not finite (PoolOptions::reject_nonfinite)");
        }
    }
    /// The queries of a batch of B = |seqs| sequences: (B·H) × (r + d_r), out (B·H) × r,
    /// the sink logits one per head when given so; returns H.
    Index check_queries(const char* function, std::span<const Index> seqs, const ConstMatrixRef<T>& queries,
                        const MatrixRef<T>& out) const {
        const auto batch = static_cast<Index>(seqs.size());
        detail::require(queries.cols() == width() && (batch == 0 ? queries.rows() == 0 : queries.rows() % batch == 0),
                        function, "queries", "has shape ", detail::shape(queries), ", expected B·H rows of ",
                        width(), " for the B = ", batch, " sequences (head h of sequence i in row i·H + h)");
        const Index heads = batch == 0 ? 0 : queries.rows() / batch;
        detail::check_group_query(function, queries, out, width(), latent_dim_);
        if (logits_.queries() > 1)
            logits_.check_rows(function, "queries", heads);
        return heads;
    }

    /// Appends the rows to s, checked by validate (cannot throw). Returns the shared block
    /// a copy-on-write of its last block replaced (−1: none).
    Index append(State& s, const ConstMatrixRef<T>& latents, const ConstMatrixRef<T>& ropes) noexcept {
        Index replaced = -1;
        for (Index r = 0; r < latents.rows();) {
            const Index t = s.length % block_size_;
            if (t == 0) {
                s.table.push_back(take_block());  // within its capacity: every block
            } else if (refs_[static_cast<std::size_t>(s.table.back())] > 1) {  // copy-on-write
                const Index shared = s.table.back(), own = take_block();
                rows_.copy_within(shared * block_size_, own * block_size_, t);
                release(shared);
                s.table.back() = own;
                replaced = shared;
            }
            const Index m = std::min({latents.rows() - r, block_size_ - t, join_rows});
            joined_.topLeftCorner(m, latent_dim_) = latents.middleRows(r, m);
            joined_.topRightCorner(m, rope_dim_) = ropes.middleRows(r, m);
            rows_.put_rows(s.table.back() * block_size_ + t, joined_.topRows(m));
            s.length += m;
            r += m;
        }
        return replaced;
    }

    /// update(seqs, latents, ropes) under the name of `function`, each member's change
    /// noted for undo_batch.
    void update_batch(const char* function, std::span<const Index> seqs, ConstMatrixRef<T> latents,
                      ConstMatrixRef<T> ropes) {
        const detail::PairSite site{function, "latents", "ropes"};
        check_batch(function, seqs, latents.rows(), "latents");
        detail::require(ropes.rows() == latents.rows(), function, "ropes", "has ", ropes.rows(), " rows, expected ",
                        latents.rows(), " (one per sequence)");
        for (std::size_t i = 0; i < seqs.size(); ++i) {
            const Index r = static_cast<Index>(i);
            detail::check_site_pairs(site, detail::shape(latents.row(r)), detail::shape(ropes.row(r)), latent_dim_,
                                     rope_dim_, sequences_[static_cast<std::size_t>(seqs[i])].length);
        }
        check_rows(site, latents, ropes);
        const Index needed = peak_blocks(seqs);
        require_free(function, needed);
        for (std::size_t i = 0; i < seqs.size(); ++i) {
            const Index r = static_cast<Index>(i);
            State& s = sequences_[static_cast<std::size_t>(seqs[i])];
            begin_undo(s);
            s.undo.shared = append(s, latents.middleRows(r, 1), ropes.middleRows(r, 1));
        }
    }

    /// attend(seqs, ...) after the ids' check: the shapes, then the jobs.
    void attend_checked(const char* function, std::span<const Index> seqs, ConstMatrixRef<T> queries,
                        MatrixRef<T> out, ExecutorRef executor) const {
        for (const Index seq : seqs)
            check_sequence(function, "seqs", seq);
        check_queries(function, seqs, queries, out);
        attend_jobs(seqs, queries, out, executor);
    }

    /// One job per sequence, in the pool's scratch (or scratch of its own when another
    /// thread's attend holds it).
    void attend_jobs(std::span<const Index> seqs, const ConstMatrixRef<T>& queries, MatrixRef<T>& out,
                     ExecutorRef executor) const {
        if (seqs.empty() || queries.rows() == 0)
            return;
        std::unique_lock<std::mutex> lock(scratch_.mutex, std::try_to_lock);
        if (lock.owns_lock()) {
            run_jobs(seqs, queries, out, executor, scratch_);
        } else {
            detail::LatentScratch<T, S> own;
            run_jobs(seqs, queries, out, executor, own);
        }
    }
    void run_jobs(std::span<const Index> seqs, const ConstMatrixRef<T>& queries, MatrixRef<T>& out,
                  ExecutorRef executor, detail::LatentScratch<T, S>& scratch) const {
        const Index heads = queries.rows() / static_cast<Index>(seqs.size());
        scratch.jobs.clear();  // keeps its capacity
        for (std::size_t i = 0; i < seqs.size(); ++i) {
            const Index row = static_cast<Index>(i) * heads;
            const State& s = sequences_[static_cast<std::size_t>(seqs[i])];
            scratch.jobs.push_back({queries.data() + row * queries.outerStride(), queries.outerStride(),
                                    out.data() + row * out.outerStride(), out.outerStride(), heads,
                                    {.rows = &rows_, .table = s.table.data(), .first = 0, .block = block_size_,
                                     .length = s.length}});
        }
        const SoftmaxOptions options = this->options();
        const detail::LatentParams<T> params{latent_dim_, rope_dim_, scale_, options.softcap, options.sink_logits,
                                             fpmath_};
        detail::latent_attend(std::span<detail::LatentJob<T, S>>(scratch.jobs), params, scratch, executor);
    }

    Index latent_dim_;
    Index rope_dim_;
    T scale_;
    detail::HeldLogits logits_;
    FpMath fpmath_;
    bool reject_nonfinite_;
    Rows rows_;
    Matrix<T> joined_;  ///< rows [c | k_rope] joined before they are stored
    mutable detail::LatentScratch<T, S> scratch_;
};

/// One absorbed decode step of a batch (mla_decode for each sequence of `seqs`, live ids,
/// at once): head h of sequence i is row i·H + h of q_nope ((B·H) × d_nope), q_rope
/// ((B·H) × d_r) and out ((B·H) × d_v). Each head's absorptions run over the batch's rows
/// together; then the pool's attend of every sequence (PagedLatentKVCache::attend),
/// then the up-projections. The caller appends the step's tokens first (update(seqs,
/// latents, ropes)). Each sequence's outputs are mla_decode's over it, bit for bit (its
/// rows' products are the same), for any thread count; a head's weights are read from
/// memory once for the batch.
template <class T, class S>
void mla_decode(const PagedLatentKVCache<T, S>& pool, std::span<const Index> seqs,
                std::type_identity_t<ConstMatrixRef<T>> q_nope, std::type_identity_t<ConstMatrixRef<T>> q_rope,
                std::type_identity_t<ConstMatrixRef<T>> W_UK, std::type_identity_t<ConstMatrixRef<T>> W_UV,
                std::type_identity_t<MatrixRef<T>> out, ExecutorRef executor = {}) {
    constexpr const char* function = "mla_decode";
    const auto batch = static_cast<Index>(seqs.size());
    const Index r = pool.latent_dim(), dr = pool.rope_dim(), nope = q_nope.cols();
    detail::require(batch > 0 ? q_nope.rows() % batch == 0 : q_nope.rows() == 0, function, "q_nope", "has shape ",
                    detail::shape(q_nope), ", expected B·H rows for the B = ", batch,
                    " sequences (head h of sequence i in row i·H + h)");
    const Index heads = batch > 0 ? q_nope.rows() / batch : 0;
    detail::require(q_rope.rows() == q_nope.rows() && q_rope.cols() == dr, function, "q_rope", "has shape ",
                    detail::shape(q_rope), ", expected ", q_nope.rows(), 'x', dr, " (q_nope is ",
                    detail::shape(q_nope), ", the pool's rope_dim ", dr, ")");
    detail::require(W_UK.cols() == r && W_UK.rows() == detail::checked_product(function, "q_nope", heads, nope,
                                                                               "heads x d_nope"),
                    function, "W_UK", "has shape ", detail::shape(W_UK), ", expected ", heads * nope, 'x', r,
                    " (H · d_nope rows for H = ", heads, "; the pool's latent_dim columns)");
    detail::require(W_UV.cols() == r && (heads == 0 || W_UV.rows() % heads == 0), function, "W_UV", "has shape ",
                    detail::shape(W_UV), ", expected H · d_v rows for H = ", heads, " and the pool's latent_dim ", r,
                    " columns");
    const Index dv = heads > 0 ? W_UV.rows() / heads : 0;
    detail::require(out.rows() == q_nope.rows() && out.cols() == dv, function, "out", "has shape ",
                    detail::shape(out), ", expected ", q_nope.rows(), 'x', dv, " (B·H × d_v)");
    for (const auto& [name, in] : {std::pair<const char*, const ConstMatrixRef<T>*>{"q_nope", &q_nope},
                                   {"q_rope", &q_rope}, {"W_UK", &W_UK}, {"W_UV", &W_UV}})
        detail::require_disjoint(function, "out", out, name, *in);
    for (const Index seq : seqs)
        detail::require(pool.contains(seq), function, "seqs", "names ", seq, ", which is not a live sequence of the pool");
    const SoftmaxOptions options = pool.options();
    detail::require(options.sink_logits.size() <= 1 || static_cast<Index>(options.sink_logits.size()) == heads,
                    function, "q_nope", "holds ", heads, " heads a sequence, but the pool's options give ",
                    options.sink_logits.size(), " sink logits, one per head");
    if (batch == 0)
        return;
    const Index rows = q_nope.rows(), width = r + dr;
    detail::MlaBuffers<T>& buffers = detail::mla_buffers<T>();
    if (buffers.packed.rows() < rows || buffers.packed.cols() != width)
        buffers.packed.resize(rows, width);
    if (buffers.latent.rows() < rows || buffers.latent.cols() != r)
        buffers.latent.resize(rows, r);
    const double work = static_cast<double>(rows) * static_cast<double>(r) * static_cast<double>(nope + dv);
    const int threads = work < detail::latent_parallel_work ? 1 : 0;
    // Head by head, row by row, as mla_decode computes each sequence's: a head's blocks of
    // the weights are read from memory by its first row and from cache by the others.
    detail::parallel_ranges(
        heads, [](Index) { return 1.0; },
        [&](Index first, Index last) {
            for (Index h = first; h < last; ++h)
                for (Index i = 0; i < batch; ++i) {
                    const Index row = i * heads + h;
                    buffers.packed.row(row).head(r).noalias() = q_nope.row(row) * W_UK.middleRows(h * nope, nope);
                    buffers.packed.row(row).tail(dr) = q_rope.row(row);
                }
        },
        threads, executor);
    pool.attend(seqs, ConstMatrixRef<T>(buffers.packed.topRows(rows)), MatrixRef<T>(buffers.latent.topRows(rows)),
                executor);
    detail::parallel_ranges(
        heads, [](Index) { return 1.0; },
        [&](Index first, Index last) {
            for (Index h = first; h < last; ++h)
                for (Index i = 0; i < batch; ++i) {
                    const Index row = i * heads + h;
                    out.row(row).noalias() = buffers.latent.row(row) * W_UV.middleRows(h * dv, dv).transpose();
                }
        },
        threads, executor);
}

}  // namespace memattn
