#pragma once
// Which blocks each sequence of a PagedKVCache holds (serving/paged_kv_cache.hpp): the
// sequences' block tables, the blocks' reference counts and the free list; a window's
// eviction; the blocks an append, an extend or a batch takes, counted before it is
// taken; and the undo of a batch that fails. No keys or values: PagedPairs holds those.

#include "memattn/detail/assert.hpp"
#include "memattn/serving/pool_options.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

// A namespace of its own, without functions: PagedKVCache derives from these classes, and
// argument-dependent lookup on a pool looks in its bases' namespaces.
namespace memattn::detail::paged {

/// The pool's shape, every argument checked (PagedKVCache's constructor).
struct PoolShape {
    Index blocks;      ///< blocks of the pool
    Index block_size;  ///< tokens per block
    Index window;      ///< the latest tokens a query sees; 0: every token
    Index sinks;       ///< the first tokens every query sees beside its window (0 without one)
    Index rollback;    ///< tokens kept before the window (PoolOptions::rollback_tokens), 0 without one
};

/// The block tables of a pool's sequences; see the top of the file.
class BlockTables {
protected:
    /// A pool of `shape.blocks` free blocks and no sequence.
    explicit BlockTables(const PoolShape& shape)
        : blocks_(shape.blocks),
          block_size_(shape.block_size),
          window_(shape.window),
          sinks_(shape.sinks),
          rollback_(shape.rollback),
          refs_(static_cast<std::size_t>(blocks_), 0) {
        free_.reserve(static_cast<std::size_t>(blocks_));
        for (Index b = blocks_; b-- > 0;)  // popped from the back: block 0 first
            free_.push_back(b);
    }

    /// A sequence: its tokens [0, min(sinks, length)) and [first, length) are held. Token
    /// block j (tokens j·block … ) is table[j] for j below the sink blocks, table[j −
    /// dropped] past the blocks a window has freed, and not held between.
    struct State {
        std::vector<Index> table;  // the held blocks, in token order; capacity: every block
        Index length = 0;
        Index dropped = 0;  // token blocks freed after the sink blocks
        Index first = 0;    // its first held token past the sinks (≥ sinks)
        bool live = false;
        /// A tree of drafts verified by the last call (its last `drafts` tokens), waiting for
        /// accept or reject: their parents among them (−1: a root). Any other append,
        /// truncate or load ends it (drafts 0).
        Index drafts = 0;
        std::vector<Index> tree;
        /// What a batch call's append (and, in update, eviction) changed, to put it back if
        /// the call fails after it (undo_batch).
        struct Undo {
            Index length = 0;    ///< the length before
            Index table = 0;     ///< the table's size before
            Index dropped = 0;   ///< the blocks the window had dropped before
            Index first = 0;     ///< the first held token past the sinks before
            Index shared = -1;   ///< the shared block a copy-on-write replaced (−1: none)
            Index evicted = -1;  ///< the block the window freed (−1: none)
            Index drafts = 0;    ///< the pending drafts before
        } undo;
        bool copies = false;  // fits_after_eviction's note: whether its member copies its last block
    };

    /// Puts a sequence read by read_state in place of `seq`'s tokens (whose blocks it frees).
    void install(Index seq, State& loaded) noexcept {
        State& s = sequences_[static_cast<std::size_t>(seq)];
        for (const Index b : s.table)
            release(b);
        s.table.swap(loaded.table);
        s.length = loaded.length;
        s.dropped = loaded.dropped;
        s.first = loaded.first;
        s.drafts = 0;
        loaded.table.clear();
    }
    /// Gives back the blocks of a sequence read by read_state and not installed, in the
    /// reverse order of their taking (the free list as it was).
    void discard(State& loaded) noexcept {
        for (auto b = loaded.table.rbegin(); b != loaded.table.rend(); ++b)
            release(*b);
        loaded.table.clear();
    }

    [[nodiscard]] Index blocks_for(Index tokens) const noexcept { return (tokens + block_size_ - 1) / block_size_; }
    /// Blocks of the sinks, never freed by the window.
    [[nodiscard]] Index sink_blocks() const noexcept { return blocks_for(sinks_); }
    /// Token blocks of s, held or freed.
    [[nodiscard]] static Index token_blocks(const State& s) noexcept {
        return static_cast<Index>(s.table.size()) + s.dropped;
    }
    /// Where in s's table token block j (a held one) is: past the sinks, less the dropped.
    [[nodiscard]] std::size_t table_index(const State& s, Index j) const noexcept {
        return static_cast<std::size_t>(j < sink_blocks() ? j : j - s.dropped);
    }
    /// The block holding token block j of s (a held one).
    [[nodiscard]] Index block_of(const State& s, Index j) const noexcept { return s.table[table_index(s, j)]; }
    /// Tokens s holds.
    [[nodiscard]] Index held_tokens(const State& s) const noexcept {
        return std::min(sinks_, s.length) + std::max<Index>(0, s.length - s.first);
    }
    /// f(block, offset, count, token) for the runs of tokens [begin, end) of s, block by
    /// block (`token`: the position of the run's first).
    template <class F>
    void for_each_run(const State& s, Index begin, Index end, F&& f) const {
        if (begin >= end)  // a short sequence's run past the sinks: [sinks, length) is empty
            return;
        for (Index j = begin / block_size_; j * block_size_ < end; ++j) {
            const Index lo = std::max(begin, j * block_size_), hi = std::min(end, (j + 1) * block_size_);
            f(block_of(s, j), lo - j * block_size_, hi - lo, lo);
        }
    }
    /// The same over every held token, in order: the sinks, then [first, length).
    template <class F>
    void for_each_held_run(const State& s, F&& f) const {
        for_each_run(s, 0, std::min(sinks_, s.length), f);
        for_each_run(s, s.first, s.length, f);
    }
    /// Tokens the query at position n − 1 sees.
    [[nodiscard]] Index visible_pairs(Index n) const noexcept {
        return window_ == 0 || n <= sinks_ + window_ ? n : sinks_ + window_;
    }

    /// The first token past the sinks a sequence of `length` tokens must keep: its last
    /// query's window, and the rollback room before it.
    [[nodiscard]] Index keep_from(Index length) const noexcept {
        const Index past = length - window_;  // no overflow: length, window ≥ 0
        return past <= sinks_ ? sinks_ : std::max(sinks_, past - rollback_);
    }
    /// The first token past the sinks that a sequence of `length` tokens, holding them from
    /// `first` on, keeps in this pool once its window has freed what it can (evict).
    [[nodiscard]] Index kept_first(Index length, Index first) const noexcept {
        if (window_ == 0)
            return first;
        const Index keep = keep_from(length);
        const Index dropped = std::max<Index>(0, keep / block_size_ - sink_blocks());
        return dropped == 0 ? first : std::max(first, (sink_blocks() + dropped) * block_size_);
    }
    /// The block s's window frees once one more token is appended (−1: none): at most one,
    /// its first past the sinks, since every call leaves a sequence evicted.
    [[nodiscard]] Index freed_by_next(const State& s) const noexcept {
        if (window_ == 0)
            return -1;
        const Index keep = keep_from(s.length + 1), sink = sink_blocks();
        if ((sink + s.dropped + 1) * block_size_ > keep)
            return -1;
        MEMATTN_DASSERT(static_cast<Index>(s.table.size()) > sink);
        return s.table[static_cast<std::size_t>(sink)];
    }

    /// Frees the window's blocks (past the sink blocks) whose tokens all lie below
    /// length − window, the first token the last query saw past the sinks.
    void evict(State& s) noexcept {
        if (window_ == 0)
            return;
        const Index keep = keep_from(s.length), sink = sink_blocks();
        Index k = 0;
        while ((sink + s.dropped + k + 1) * block_size_ <= keep)
            ++k;
        if (k == 0)
            return;
        const auto from = s.table.begin() + static_cast<std::ptrdiff_t>(sink);
        for (auto it = from; it != from + static_cast<std::ptrdiff_t>(k); ++it)
            release(*it);
        s.table.erase(from, from + static_cast<std::ptrdiff_t>(k));  // within its capacity: no allocation
        s.dropped += k;
        s.first = std::max(s.first, (sink + s.dropped) * block_size_);
    }

    /// The free blocks extending s by n tokens takes at its most (extend: the window frees
    /// its blocks as it passes them, before the next block is taken): over the new blocks,
    /// those taken so far (a copy of a shared last block first) less those freed so far
    /// (the held blocks no other sequence holds, and the ones this extend took).
    [[nodiscard]] Index extend_peak(const State& s, Index n) const noexcept {
        if (n <= 0)
            return 0;
        const Index sink = sink_blocks(), before = token_blocks(s);
        const bool copies = s.length % block_size_ != 0 && refs_[static_cast<std::size_t>(s.table.back())] > 1;
        Index taken = copies ? 1 : 0, freed = 0, peak = taken, dropped = s.dropped;
        for (Index p = blocks_for(s.length) * block_size_; p < s.length + n; p += block_size_) {
            if (window_ > 0)  // what the window frees once the sequence holds p tokens
                for (const Index keep = keep_from(p); (sink + dropped + 1) * block_size_ <= keep;
                     ++dropped) {
                    const Index j = sink + dropped;  // a token block past the sinks, below the window
                    const bool own = j >= before - (copies ? 1 : 0) ||
                                     refs_[static_cast<std::size_t>(s.table[static_cast<std::size_t>(j - s.dropped)])] == 1;
                    freed += own ? 1 : 0;
                }
            ++taken;
            peak = std::max(peak, taken - freed);
        }
        return peak;
    }

    /// The free blocks a batch of one token per sequence of `seqs` takes at its most as
    /// update_batch runs it: member by member, a copy of a shared last block it writes
    /// into and a new block when its last is full, then the block its window frees (free
    /// once no other sequence holds it). Counted on the reference counts as they go, and
    /// put back before it returns.
    [[nodiscard]] Index peak_blocks(std::span<const Index> seqs) noexcept {
        Index net = 0, peak = 0;
        for (const Index seq : seqs) {
            State& s = sequences_[static_cast<std::size_t>(seq)];
            s.copies = s.length % block_size_ != 0 && refs_[static_cast<std::size_t>(s.table.back())] > 1;
            if (s.copies) {  // its copy releases the shared block, which stays held
                --refs_[static_cast<std::size_t>(s.table.back())];
                ++net;
            }
            if (s.length % block_size_ == 0)
                ++net;
            peak = std::max(peak, net);
            const Index freed = freed_by_next(s);
            if (freed >= 0 && --refs_[static_cast<std::size_t>(freed)] == 0)
                --net;
        }
        for (auto it = seqs.rbegin(); it != seqs.rend(); ++it) {  // the counts put back
            State& s = sequences_[static_cast<std::size_t>(*it)];
            const Index freed = freed_by_next(s);
            if (freed >= 0)
                ++refs_[static_cast<std::size_t>(freed)];
            if (s.copies)
                ++refs_[static_cast<std::size_t>(s.table.back())];
        }
        return peak;
    }

    /// Notes what s is before a batch call changes it (State::Undo).
    static void begin_undo(State& s) noexcept {
        s.undo = {s.length, static_cast<Index>(s.table.size()), s.dropped, s.first, -1, -1, s.drafts};
    }
    /// Puts back what the batch's appends and evictions changed, member by member in the
    /// reverse order of the changes, so the free list's pops and pushes unwind as a stack
    /// and every block, count and table is as it was.
    void undo_batch(std::span<const Index> seqs) noexcept {
        const Index sink = sink_blocks();
        for (auto it = seqs.rbegin(); it != seqs.rend(); ++it) {
            State& s = sequences_[static_cast<std::size_t>(*it)];
            const typename State::Undo& u = s.undo;
            if (u.evicted >= 0) {  // held again, in its place after the sink blocks
                if (refs_[static_cast<std::size_t>(u.evicted)] == 0) {
                    MEMATTN_DASSERT(!free_.empty() && free_.back() == u.evicted);
                    free_.pop_back();
                }
                ++refs_[static_cast<std::size_t>(u.evicted)];
                s.table.insert(s.table.begin() + static_cast<std::ptrdiff_t>(sink), u.evicted);  // within capacity
                s.dropped = u.dropped;
                s.first = u.first;
            }
            while (static_cast<Index>(s.table.size()) > u.table) {
                release(s.table.back());
                s.table.pop_back();
            }
            if (u.shared >= 0) {  // the copy-on-write: the shared block back, the copy freed
                const Index own = s.table.back();
                ++refs_[static_cast<std::size_t>(u.shared)];
                s.table.back() = u.shared;
                release(own);
            }
            s.length = u.length;
            s.drafts = u.drafts;
        }
    }

    /// Whether batch member i, writing into its partly filled last block, copies it: of
    /// the k members writing into one block held r times, those before the r-th copy it.
    /// `writes(j)`: member j appends at least one token.
    template <class Writes>
    [[nodiscard]] bool copies_before(std::span<const Index> seqs, std::size_t i, const Writes& writes) const noexcept {
        const State& s = sequences_[static_cast<std::size_t>(seqs[i])];
        const Index block = s.table.back();
        Index earlier = 0;
        for (std::size_t j = 0; j < i; ++j) {
            const State& o = sequences_[static_cast<std::size_t>(seqs[j])];
            earlier += writes(j) && o.length % block_size_ != 0 && o.table.back() == block ? 1 : 0;
        }
        return refs_[static_cast<std::size_t>(block)] - earlier > 1;
    }

    /// A new, empty sequence (PagedKVCache::add_sequence); returns its id.
    Index new_sequence() {
        const Index id = fresh_id();
        State& s = sequences_[static_cast<std::size_t>(id)];
        s.table.reserve(static_cast<std::size_t>(blocks_));  // its steps never allocate
        s.length = 0;
        s.dropped = 0;
        s.first = sinks_;
        s.drafts = 0;
        s.live = true;
        return id;
    }
    /// A new sequence sharing every block of `parent` (checked live by the caller), its
    /// pending drafts included; returns its id.
    Index fork_sequence(Index parent) {
        const Index id = fresh_id();  // may grow sequences_: `from` is read after
        State& child = sequences_[static_cast<std::size_t>(id)];
        const State& from = sequences_[static_cast<std::size_t>(parent)];
        child.tree.assign(from.tree.begin(), from.tree.begin() + from.drafts);  // may throw: the child not live yet
        child.table.reserve(static_cast<std::size_t>(blocks_));
        child.table.assign(from.table.begin(), from.table.end());
        child.length = from.length;
        child.dropped = from.dropped;
        child.first = from.first;
        child.drafts = from.drafts;
        child.live = true;
        for (const Index b : child.table)
            ++refs_[static_cast<std::size_t>(b)];
        return id;
    }
    /// Ends `seq` (checked live by the caller): frees the blocks no other sequence holds.
    void remove_sequence(Index seq) noexcept {
        State& s = sequences_[static_cast<std::size_t>(seq)];
        for (const Index b : s.table)
            release(b);
        s.table.clear();
        s.length = 0;
        s.dropped = 0;
        s.drafts = 0;
        s.live = false;
    }

    /// True when `seq` is a live sequence of the pool.
    [[nodiscard]] bool live(Index seq) const noexcept {
        return seq >= 0 && seq < static_cast<Index>(sequences_.size()) && sequences_[static_cast<std::size_t>(seq)].live;
    }
    /// Live sequences.
    [[nodiscard]] Index live_sequences() const noexcept {
        return static_cast<Index>(std::count_if(sequences_.begin(), sequences_.end(),
                                                [](const State& s) { return s.live; }));
    }
    /// `seq` as a live sequence of the pool, else std::invalid_argument naming `function`
    /// and `argument`.
    void check_sequence(std::string_view function, const char* argument, Index seq) const {
        if (!live(seq)) [[unlikely]]
            require(false, function, argument, "is ", seq, ", which is not a live sequence of the pool (",
                    live_sequences(), " live, ids below ", sequences_.size(), ")");
    }
    /// The live sequence `seq` (check_sequence).
    [[nodiscard]] const State& checked_state(std::string_view function, Index seq) const {
        check_sequence(function, "seq", seq);
        return sequences_[static_cast<std::size_t>(seq)];
    }
    /// The ids of a batch: live and distinct, one per row.
    void check_batch(std::string_view function, std::span<const Index> seqs, Index rows, const char* rows_name) const {
        for (std::size_t i = 0; i < seqs.size(); ++i) {
            check_sequence(function, "seqs", seqs[i]);
            for (std::size_t j = 0; j < i; ++j)
                require(seqs[j] != seqs[i], function, "seqs", "names sequence ", seqs[i], " twice (at ", j, " and ", i,
                        "): a batch appends one token to each of distinct sequences");
        }
        require(rows == static_cast<Index>(seqs.size()), function, rows_name, "has ", rows, " rows, expected ",
                seqs.size(), " (one per sequence)");
    }
    /// The blocks_needed of a pool (PagedKVCache::blocks_needed): its arguments checked.
    [[nodiscard]] Index checked_blocks_needed(std::string_view function, std::span<const Index> seqs,
                                              std::span<const Index> tokens) const {
        check_batch(function, seqs, static_cast<Index>(seqs.size()), "seqs");
        require(tokens.size() == seqs.size(), function, "tokens", "has ", tokens.size(), " counts, expected ",
                seqs.size(), " (one per sequence)");
        for (std::size_t i = 0; i < tokens.size(); ++i)
            require(tokens[i] >= 0 && tokens[i] <= max_length, function, "tokens", "has ", tokens[i], " for sequence ",
                    seqs[i], ", expected 0 to ", max_length);
        return chunk_blocks(seqs, [&](std::size_t i) { return tokens[i]; });
    }
    /// PoolExhausted naming `function` unless `needed` blocks are free.
    void require_free(std::string_view function, Index needed) const {
        if (needed > static_cast<Index>(free_.size())) [[unlikely]]
            throw PoolExhausted(std::string(function), needed, static_cast<Index>(free_.size()), blocks_);
    }

    /// The first step of a path of drafts that is not the draft of its own place (the
    /// first row an accept moves).
    [[nodiscard]] static Index first_moved(std::span<const Index> path) noexcept {
        Index k0 = 0;
        while (k0 < static_cast<Index>(path.size()) && path[static_cast<std::size_t>(k0)] == k0)
            ++k0;
        return k0;
    }
    /// PagedKVCache::accept_blocks: the blocks an accept of `path` copies (the shared ones
    /// it writes into), after its checks (std::invalid_argument naming `function`).
    [[nodiscard]] Index path_copies(std::string_view function, Index seq, std::span<const Index> path) const {
        const State& s = checked_state(function, seq);
        require(s.drafts > 0, function, "seq", "is ", seq, ", which has no pending drafts (accept follows a prefill "
                "with parents, before any other call changes the sequence)");
        const auto n = static_cast<Index>(path.size());
        for (Index k = 0; k < n; ++k) {
            const Index p = path[static_cast<std::size_t>(k)];
            require(p >= 0 && p < s.drafts, function, "path", "has ", p, " at ", k, ", expected a draft, 0 to ",
                    s.drafts - 1);
            const Index parent = s.tree[static_cast<std::size_t>(p)];
            const Index before = k == 0 ? -1 : path[static_cast<std::size_t>(k - 1)];
            require(parent == before, function, "path", "has draft ", p, " at ", k, ", whose parent is ", parent,
                    ", but the path's ", k == 0 ? "first draft must be a root (parent -1)" : "draft before it is ",
                    k == 0 ? std::string() : std::to_string(before));
        }
        const Index base = s.length - s.drafts, k0 = first_moved(path);
        Index shared = 0;
        if (k0 < n)
            for (Index b = (base + k0) / block_size_; b <= (base + n - 1) / block_size_; ++b)
                shared += refs_[static_cast<std::size_t>(block_of(s, b))] > 1 ? 1 : 0;
        return shared;
    }

    /// Bytes of the counts, the free list and the tables.
    [[nodiscard]] std::size_t table_bytes() const noexcept {
        std::size_t bytes = sizeof(Index) * (refs_.capacity() + free_.capacity());
        for (const State& s : sequences_)
            bytes += sizeof(State) + sizeof(Index) * s.table.capacity();
        return bytes;
    }

    /// The smallest id not in use, its state made ready (may allocate: not a step).
    Index fresh_id() {
        for (std::size_t i = 0; i < sequences_.size(); ++i)
            if (!sequences_[i].live)
                return static_cast<Index>(i);
        sequences_.emplace_back();
        return static_cast<Index>(sequences_.size() - 1);
    }

    /// Free blocks that appending chunk(i) tokens to each seqs[i] takes, in order: the new
    /// blocks, and one more for a member that writes into its partly filled last block
    /// while it is shared (copies_before).
    template <class Chunk>
    [[nodiscard]] Index chunk_blocks(std::span<const Index> seqs, const Chunk& chunk) const noexcept {
        Index needed = 0;
        for (std::size_t i = 0; i < seqs.size(); ++i) {
            const State& s = sequences_[static_cast<std::size_t>(seqs[i])];
            if (chunk(i) == 0)
                continue;
            needed += blocks_for(s.length + chunk(i)) - token_blocks(s);
            if (s.length % block_size_ != 0 && copies_before(seqs, i, [&](std::size_t j) { return chunk(j) > 0; }))
                ++needed;
        }
        return needed;
    }

    Index take_block() noexcept {
        MEMATTN_DASSERT(!free_.empty());
        const Index b = free_.back();
        free_.pop_back();
        refs_[static_cast<std::size_t>(b)] = 1;
        return b;
    }
    void release(Index b) noexcept {
        if (--refs_[static_cast<std::size_t>(b)] == 0)
            free_.push_back(b);  // within its capacity: every block
    }

    Index blocks_, block_size_;
    Index window_, sinks_;  // sinks_ is 0 without a window
    Index rollback_;        // tokens kept before the window (PoolOptions::rollback_tokens), 0 without one
    std::vector<Index> refs_;  // sequences holding each block
    std::vector<Index> free_;  // blocks no one holds, taken from the back
    std::vector<State> sequences_;
};

}  // namespace memattn::detail::paged
