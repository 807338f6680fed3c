#pragma once
// StatePool: the recurrent layers' memories (gated linear attention, the delta rule, KDA,
// RWKV-7, linear attention: any copyable memattn::Memory, one per sequence, usually a
// MultiHead of them) for many sequences beside a paged pool, with checkpoints of the
// state every n tokens, so a fork from a shared prefix or the rollback of rejected drafts
// resumes from a checkpoint (hybrid models' servers: Qwen3-Next, Kimi Linear, Jamba).
//
//   memattn::StatePool<memattn::MultiHead<memattn::DeltaRuleMemory<float>>> states(
//       /*capacity=*/64, prototype, {.checkpoint_tokens = 64, .checkpoints = 2});
//   const memattn::Index a = states.add();
//   states.prefill(ids, q_offsets, Q, K, V, O);   // chunks beside tokens, threaded over sequences
//   const memattn::Index b = states.fork(a);      // the state (and its checkpoints) copied
//   states.truncate(b, states.checkpoint_before(b, t));  // back to the last checkpoint ≤ t:
//                                                        // replay the tokens after it
//
// Capacity is fixed when the pool is built: every sequence's memory and checkpoint ring
// are copies of the prototype made then, so add, fork (a copy into an existing slot),
// remove, a step and a checkpoint allocate nothing (for a memory whose copy assignment
// between equal shapes allocates nothing: every memattn memory). Checkpoints: with checkpoint_tokens = n, the
// state is kept each time a sequence's length reaches a multiple of n (a chunk is split
// at those lengths), in a ring of the last `checkpoints` of them; truncate(id, t) goes
// back to a length t the sequence can be restored to exactly (its length, 0, or a
// checkpoint held; checkpoint_before says which is nearest below), else refuses with
// std::invalid_argument naming the nearest: a recurrent state cannot be cut, only
// restored and replayed. Snapshots of a sequence are its memory's (the checkpoints are
// not recorded: a loaded sequence has none).
//
// Speculative decoding (hybrid models' draft trees): with draft_states = m the pool keeps
// m more states for pending drafts. prefill with parents is a verify step: each draft's
// state is its parent's (the sequence's for a root) updated by its token, its output
// that state's attend, so a draft's output is its path's decoded token by token; the
// sequence's own state stays as it was until accept(id, path), which makes it the state
// of the path's last draft (the checkpoints its lengths cross kept on the way; states
// are exchanged, not copied, but for a path that ends on a checkpoint: that state is
// copied into the ring, as a decode step's is), or reject(id). Any other change to the
// sequence drops its pending drafts (a recurrent state cannot take a tree's drafts as
// tokens).
//
// All or nothing: a call that throws (a bad id or shape, a value the memory refuses, a
// full pool: PoolExhausted, a state counting as one block) changes nothing; a batch
// validates every row first, and, run on an executor that may throw
// (ExecutorRef::nothrow), copies its members' states first into scratch kept by the pool
// (sized by the first such call) to put them back.

#include "memattn/execution/executor.hpp"
#include "memattn/execution/parallel.hpp"
#include "memattn/memory/concept.hpp"
#include "memattn/memory/detail/memory_checks.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/serving/pool_options.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace memattn {

namespace detail {
struct StateAccess;
}  // namespace detail

/// What a StatePool keeps besides each sequence's state.
struct StatePoolOptions {
    /// Keep the state each time a sequence's length reaches a multiple of n; 0: none.
    Index checkpoint_tokens = 0;
    /// How many of its latest checkpoints a sequence keeps (a ring), when checkpoint_tokens > 0.
    Index checkpoints = 2;
    /// States for pending drafts, across the pool: a verify step (prefill with parents)
    /// holds one per draft until accept or reject. 0: verify steps are refused.
    Index draft_states = 0;
};

/// The recurrent memories of many sequences; see the top of the file.
template <Memory M>
    requires std::copyable<M>
class StatePool : public ExecutorSlot {
public:
    using Scalar = typename M::Scalar;  ///< the memories' scalar
    using MemoryType = M;               ///< one sequence's memory
    class Sequence;

    /// A pool of `capacity` sequences, each a copy of `prototype` (reset), and, with
    /// checkpoints, `options.checkpoints` more copies each for its ring, and
    /// `options.draft_states` more for pending drafts. Allocates them now.
    StatePool(Index capacity, const M& prototype, const StatePoolOptions& options = {})
        : capacity_(detail::at_least(capacity, 1, "StatePool", "capacity")),
          every_(detail::at_least(options.checkpoint_tokens, 0, "StatePool", "options.checkpoint_tokens")),
          ring_(every_ > 0 ? detail::at_least(options.checkpoints, 1, "StatePool", "options.checkpoints") : 0),
          draft_states_(detail::at_least(options.draft_states, 0, "StatePool", "options.draft_states")),
          options_(options),
          prototype_(prototype) {
        prototype_.reset();
        const auto n = static_cast<std::size_t>(capacity_);
        states_.assign(n, prototype_);
        live_.assign(n, false);
        if (ring_ > 0) {
            const auto slots = static_cast<std::size_t>(
                detail::checked_product("StatePool", "capacity", capacity_, ring_, "capacity x checkpoints"));
            saved_.assign(slots, prototype_);
            saved_length_.assign(slots, -1);
            next_.assign(n, 0);
        }
        if (draft_states_ > 0) {
            drafts_.assign(static_cast<std::size_t>(draft_states_), prototype_);
            free_drafts_.resize(static_cast<std::size_t>(draft_states_));
            for (Index i = 0; i < draft_states_; ++i)
                free_drafts_[static_cast<std::size_t>(i)] = draft_states_ - 1 - i;
            free_count_ = draft_states_;
            claimed_.resize(static_cast<std::size_t>(draft_states_));
        }
        pending_.resize(n);
    }

    /// A new sequence, its state the prototype's (empty); returns its id (the smallest
    /// free). PoolExhausted when every one of the capacity's states is live.
    Index add() {
        const Index id = free_slot("StatePool::add");
        M& s = states_[static_cast<std::size_t>(id)];
        s.reset();
        forget_checkpoints(id);
        live_[static_cast<std::size_t>(id)] = true;
        return id;
    }
    /// A new sequence with `parent`'s state and checkpoints (copied); returns its id.
    Index fork(Index parent) {
        constexpr const char* function = "StatePool::fork";
        check(function, "parent", parent);
        const Index id = free_slot(function);
        states_[static_cast<std::size_t>(id)] = states_[static_cast<std::size_t>(parent)];  // same shapes: no allocation
        for (Index r = 0; r < ring_; ++r) {
            saved_[at(id, r)] = saved_[at(parent, r)];
            saved_length_[at(id, r)] = saved_length_[at(parent, r)];
        }
        if (ring_ > 0)
            next_[static_cast<std::size_t>(id)] = next_[static_cast<std::size_t>(parent)];
        live_[static_cast<std::size_t>(id)] = true;
        return id;
    }
    /// Ends `id`; its state may be given to the next add or fork.
    void remove(Index id) {
        check("StatePool::remove", "id", id);
        drop_drafts(id);
        live_[static_cast<std::size_t>(id)] = false;
    }

    /// True when `id` is a live sequence.
    [[nodiscard]] bool contains(Index id) const noexcept {
        return id >= 0 && id < capacity_ && live_[static_cast<std::size_t>(id)];
    }
    /// Tokens `id`'s state has seen.
    [[nodiscard]] Index length(Index id) const { return state(id).length(); }
    /// Live sequences.
    [[nodiscard]] Index sequences() const noexcept {
        return static_cast<Index>(std::count(live_.begin(), live_.end(), true));
    }
    /// Sequences the pool can hold.
    [[nodiscard]] Index capacity() const noexcept { return capacity_; }
    /// The tokens between checkpoints (0: none) and the checkpoints a sequence keeps.
    [[nodiscard]] StatePoolOptions options() const noexcept { return options_; }
    /// `id`'s memory, read only (its attend, state(), snapshots): every change goes
    /// through the pool, which keeps the checkpoints.
    [[nodiscard]] const M& state(Index id) const {
        check("StatePool::state", "id", id);
        return states_[static_cast<std::size_t>(id)];
    }
    /// Bytes of every state, checkpoint and draft state held (allocated when the pool was
    /// built).
    [[nodiscard]] std::size_t footprint() const noexcept {
        std::size_t bytes = 0;
        for (const M& m : states_)
            bytes += m.footprint();
        for (const M& m : saved_)
            bytes += m.footprint();
        for (const M& m : drafts_)
            bytes += m.footprint();
        return bytes;
    }

    // set_executor(executor), executor(): where batches run their sequences (ExecutorSlot).

    /// Appends one token to `id` (the memory's update), keeping a checkpoint when its
    /// length reaches a multiple of checkpoint_tokens.
    void update(Index id, ConstRowRef<Scalar> key, ConstRowRef<Scalar> value) {
        constexpr const char* function = "StatePool::update";
        check(function, "id", id);
        M& m = states_[static_cast<std::size_t>(id)];
        detail::check_keys_values(function, m, detail::shape(key), detail::shape(value));
        detail::validate_pairs<M, Scalar>(function, m, key, value);
        m.update(key, value);
        keep_checkpoint(id);
        drop_drafts(id);
    }
    /// Appends many tokens to `id` (split where its length reaches a multiple of
    /// checkpoint_tokens, a checkpoint kept at each); all or nothing.
    void extend(Index id, ConstMatrixRef<Scalar> keys, ConstMatrixRef<Scalar> values) {
        constexpr const char* function = "StatePool::extend";
        check(function, "id", id);
        M& m = states_[static_cast<std::size_t>(id)];
        detail::check_keys_values(function, m, detail::shape(keys), detail::shape(values));
        detail::validate_pairs<M, Scalar>(function, m, keys, values);
        for_each_piece(id, keys.rows(), [&](Index r, Index n) {
            memattn::extend(m, keys.middleRows(r, n), values.middleRows(r, n));
        });
        drop_drafts(id);
    }
    /// `id`'s attend of one query.
    void attend(Index id, ConstRowRef<Scalar> query, RowRef<Scalar> out) const { state(id).attend(query, out); }

    /// One token for each sequence of `ids` (distinct live ids): row i of K and V updates
    /// ids[i], then row i of O is its attend of row i of Q; the sequences spread over the
    /// executor's threads, checkpoints kept as by update. All or nothing.
    void decode(std::span<const Index> ids, ConstMatrixRef<Scalar> queries, ConstMatrixRef<Scalar> keys,
                ConstMatrixRef<Scalar> values, MatrixRef<Scalar> out, ExecutorRef executor) {
        constexpr const char* function = "StatePool::decode";
        check_batch(function, ids);
        const auto batch = static_cast<Index>(ids.size());
        detail::require(queries.rows() == batch && keys.rows() == batch && values.rows() == batch &&
                            out.rows() == batch,
                        function, "Q, K, V, O", "have ", queries.rows(), ", ", keys.rows(), ", ", values.rows(), " and ",
                        out.rows(), " rows, expected ", batch, " each (one per sequence)");
        for (Index i = 0; i < batch; ++i)
            detail::check_sequences<M, Scalar>(function, states_[static_cast<std::size_t>(ids[static_cast<std::size_t>(i)])],
                                               queries.middleRows(i, 1), keys.middleRows(i, 1), values.middleRows(i, 1),
                                               out.middleRows(i, 1));
        run_batch(ids, executor, [&](Index i) {
            const Index id = ids[static_cast<std::size_t>(i)];
            // The update and the attend in one pass where the memory can (update_attend);
            // the checkpoint is the state after the update either way.
            detail::update_attend<M, Scalar>(states_[static_cast<std::size_t>(id)], keys.row(i), values.row(i),
                                             queries.row(i), out.row(i));
            keep_checkpoint(id);
        });
        for (const Index id : ids)
            drop_drafts(id);
    }
    /// The same on the pool's executor.
    void decode(std::span<const Index> ids, ConstMatrixRef<Scalar> queries, ConstMatrixRef<Scalar> keys,
                ConstMatrixRef<Scalar> values, MatrixRef<Scalar> out) {
        decode(ids, queries, keys, values, out, executor_);
    }

    /// A mixed batch: ids[i] (distinct live ids) takes the rows [q_offsets[i], q_offsets[i
    /// + 1]) of K and V through its memory's prefill (memattn::prefill: the chunked kernel
    /// for the recurrent memories), the rows of O its outputs, split where its length
    /// reaches a multiple of checkpoint_tokens; the sequences spread over the executor's
    /// threads. All or nothing.
    void prefill(std::span<const Index> ids, std::span<const Index> q_offsets, ConstMatrixRef<Scalar> queries,
                 ConstMatrixRef<Scalar> keys, ConstMatrixRef<Scalar> values, MatrixRef<Scalar> out,
                 ExecutorRef executor) {
        constexpr const char* function = "StatePool::prefill";
        check_chunks(function, ids, q_offsets, queries, keys, values, out);
        run_batch(ids, executor, [&](Index i) {
            const Index id = ids[static_cast<std::size_t>(i)], r0 = q_offsets[static_cast<std::size_t>(i)];
            M& m = states_[static_cast<std::size_t>(id)];
            for_each_piece(id, q_offsets[static_cast<std::size_t>(i) + 1] - r0, [&](Index r, Index n) {
                auto o = out.middleRows(r0 + r, n);
                memattn::prefill(m, queries.middleRows(r0 + r, n), keys.middleRows(r0 + r, n),
                                 values.middleRows(r0 + r, n), o);
            });
        });
        for (const Index id : ids)
            drop_drafts(id);
    }
    /// The same on the pool's executor.
    void prefill(std::span<const Index> ids, std::span<const Index> q_offsets, ConstMatrixRef<Scalar> queries,
                 ConstMatrixRef<Scalar> keys, ConstMatrixRef<Scalar> values, MatrixRef<Scalar> out) {
        prefill(ids, q_offsets, queries, keys, values, out, executor_);
    }

    /// Speculative decoding's verify step: the same batch, each chunk a tree of drafted
    /// tokens. parents[r] (one per row of K) is row r's parent within its chunk (−1: a
    /// root, which follows the sequence's state), before it. Each draft's state is its
    /// parent's updated by its key and value, and row r of O is that state's attend of row
    /// r of Q, so a draft's output is its path's decoded token by token (bit for bit:
    /// decode's update_attend). The sequences' states do not change: each draft's state
    /// is kept (one of StatePoolOptions::draft_states) until accept(id, path) or
    /// reject(id) (pending_drafts); a chunk with rows replaces its sequence's pending
    /// drafts, one without leaves them. The sequences spread over the executor's threads.
    /// Refused, nothing changed: bad shapes or values, parents that are not a tree per
    /// chunk, a pool without draft states (std::invalid_argument), fewer free draft states
    /// than rows (PoolExhausted: the states a sequence's pending drafts hold are released
    /// only once the step has run, so a step that fails leaves them as they were); an
    /// executor that throws leaves every sequence as it was.
    void prefill(std::span<const Index> ids, std::span<const Index> q_offsets, ConstMatrixRef<Scalar> queries,
                 ConstMatrixRef<Scalar> keys, ConstMatrixRef<Scalar> values, MatrixRef<Scalar> out,
                 ExecutorRef executor, std::span<const Index> parents) {
        constexpr const char* function = "StatePool::prefill";
        check_chunks(function, ids, q_offsets, queries, keys, values, out);
        const auto batch = static_cast<Index>(ids.size());
        check_tree(function, q_offsets, parents);
        for (Index i = 0; i < batch; ++i) {  // room for the trees now (the first of its size allocates)
            Pending& p = pending_[static_cast<std::size_t>(ids[static_cast<std::size_t>(i)])];
            const auto n = static_cast<std::size_t>(q_offsets[static_cast<std::size_t>(i) + 1] -
                                                    q_offsets[static_cast<std::size_t>(i)]);
            p.parents.reserve(n);
            p.held.reserve(n);
        }
        // Row r's draft state claimed_[r], taken from the free ones (rows ≤ free_count_:
        // checked); given back if the step fails.
        const Index rows = keys.rows();
        for (Index r = 0; r < rows; ++r)
            claimed_[static_cast<std::size_t>(r)] = free_drafts_[static_cast<std::size_t>(--free_count_)];
        const auto range = [&](Index first, Index last) {
            // The draft states streamed past the cache, ordered before any other thread
            // reads them: one fence for the range's (also when it throws).
            const detail::StreamFence fence;
            for (Index i = first; i < last; ++i) {
                const Index id = ids[static_cast<std::size_t>(i)], r0 = q_offsets[static_cast<std::size_t>(i)],
                            n = q_offsets[static_cast<std::size_t>(i) + 1] - r0;
                for (Index t = 0; t < n; ++t) {
                    const Index r = r0 + t, parent = parents[static_cast<std::size_t>(r)];
                    M& draft = drafts_[static_cast<std::size_t>(claimed_[static_cast<std::size_t>(r)])];
                    const M& from = parent < 0 ? states_[static_cast<std::size_t>(id)]
                                               : drafts_[static_cast<std::size_t>(
                                                     claimed_[static_cast<std::size_t>(r0 + parent)])];
                    // draft = from, then its update_attend: one pass where the memory folds
                    // the copy into its step (a delta-rule or KDA state), else a copy (same
                    // shapes: no allocation) and the step.
                    detail::assign_update_attend<M, Scalar>(draft, from, keys.row(r), values.row(r), queries.row(r),
                                                           out.row(r));
                }
            }
        };
        try {
            detail::parallel_ranges(batch, [&](Index i) {
                return static_cast<double>(1 + q_offsets[static_cast<std::size_t>(i) + 1] - q_offsets[static_cast<std::size_t>(i)]);
            }, range, 0, executor);
        } catch (...) {
            for (Index r = rows; r-- > 0;)
                free_drafts_[static_cast<std::size_t>(free_count_++)] = claimed_[static_cast<std::size_t>(r)];
            throw;
        }
        for (Index i = 0; i < batch; ++i) {
            const Index id = ids[static_cast<std::size_t>(i)], r0 = q_offsets[static_cast<std::size_t>(i)],
                        r1 = q_offsets[static_cast<std::size_t>(i) + 1];
            if (r1 == r0)  // no rows: its own pending drafts, if any, stay
                continue;
            drop_drafts(id);
            Pending& p = pending_[static_cast<std::size_t>(id)];  // reserved above: no allocation
            p.parents.assign(parents.begin() + r0, parents.begin() + r1);
            p.held.assign(claimed_.begin() + r0, claimed_.begin() + r1);
        }
    }
    /// The same on the pool's executor.
    void prefill(std::span<const Index> ids, std::span<const Index> q_offsets, ConstMatrixRef<Scalar> queries,
                 ConstMatrixRef<Scalar> keys, ConstMatrixRef<Scalar> values, MatrixRef<Scalar> out,
                 std::span<const Index> parents) {
        prefill(ids, q_offsets, queries, keys, values, out, executor_, parents);
    }
    /// Throws what a verify step (prefill with parents) of these chunks would throw for
    /// their trees and the draft states they take, changing nothing: std::invalid_argument
    /// (ids not distinct live ones, offsets, parents that are not a tree per chunk, a pool
    /// without draft states), PoolExhausted (fewer free draft states than drafts).
    void validate_tree(std::span<const Index> ids, std::span<const Index> q_offsets,
                       std::span<const Index> parents) const {
        constexpr const char* function = "StatePool::validate_tree";
        check_batch(function, ids);
        detail::check_offsets(function, q_offsets, static_cast<Index>(ids.size()),
                              q_offsets.empty() ? 0 : q_offsets.back());
        check_tree(function, q_offsets, parents);
    }
    /// The drafts of `id` the last verify step left waiting for accept or reject; 0 when
    /// none.
    [[nodiscard]] Index pending_drafts(Index id) const {
        check("StatePool::pending_drafts", "id", id);
        return static_cast<Index>(pending_[static_cast<std::size_t>(id)].parents.size());
    }
    /// Draft states no pending draft holds.
    [[nodiscard]] Index free_draft_states() const noexcept { return free_count_; }
    /// Keeps the accepted path of `id`'s pending drafts: path[k] (indices among the drafts,
    /// path[0] a root, each the child of the one before) is token L + k, L its length
    /// before them; its state becomes the last draft's, bit for bit the path decoded
    /// token by token, with the checkpoints the lengths L + 1 to L + |path| cross (their
    /// drafts' states), and every pending draft is released. The states are exchanged
    /// with the draft states, not copied, but for a path that ends on a checkpoint (that
    /// state is copied into the ring, as a decode step's is): otherwise no pass over a
    /// state, and nothing allocated. An empty path is reject(id). std::invalid_argument,
    /// nothing changed, without pending drafts or for a path that is not a chain of the
    /// tree.
    void accept(Index id, std::span<const Index> path) {
        static_assert(std::is_nothrow_swappable_v<M>, "StatePool::accept exchanges states: M must swap without throwing");
        constexpr const char* function = "StatePool::accept";
        check_path(function, id, path);
        if (path.empty()) {
            drop_drafts(id);
            return;
        }
        const Pending& p = pending_[static_cast<std::size_t>(id)];
        const auto n = static_cast<Index>(path.size());
        const auto draft = [&](Index k) -> M& {
            return drafts_[static_cast<std::size_t>(p.held[static_cast<std::size_t>(path[static_cast<std::size_t>(k)])])];
        };
        // The checkpoints the path's lengths cross go into the ring in order, each into
        // the next place: of c crossed, the last min(c, ring) stay. Where the path ends on
        // one, its state is both the sequence's and the ring's: that one is copied, first
        // (the only step that may throw: a memory whose copy allocates), then the others
        // are exchanged.
        Index crossed = 0;
        if (every_ > 0)
            for (Index k = 0; k < n; ++k)
                crossed += draft(k).length() % every_ == 0 ? 1 : 0;
        const Index first_kept = std::max<Index>(0, crossed - ring_);
        const Index start = crossed > 0 ? next_[static_cast<std::size_t>(id)] : 0;
        if (crossed > 0 && draft(n - 1).length() % every_ == 0) {
            const std::size_t place = at(id, (start + crossed - 1) % ring_);
            saved_[place] = draft(n - 1);  // same shapes: no allocation for memattn memories
            saved_length_[place] = saved_[place].length();
        }
        using std::swap;
        for (Index k = 0, j = 0; k + 1 < n; ++k) {
            if (every_ == 0 || draft(k).length() % every_ != 0)
                continue;
            if (j >= first_kept) {
                const std::size_t place = at(id, (start + j) % ring_);
                swap(saved_[place], draft(k));  // the draft state takes the ring's old one
                saved_length_[place] = saved_[place].length();
            }
            ++j;
        }
        if (crossed > 0)
            next_[static_cast<std::size_t>(id)] = (start + crossed) % ring_;
        swap(states_[static_cast<std::size_t>(id)], draft(n - 1));
        drop_drafts(id);
    }
    /// Checks accept(id, path) makes (std::invalid_argument naming `function`), changing
    /// nothing.
    void validate_path(Index id, std::span<const Index> path, const char* function = "StatePool::validate_path") const {
        check_path(function, id, path);
    }
    /// Drops every pending draft of `id` (its state is as before the verify step).
    void reject(Index id) {
        constexpr const char* function = "StatePool::reject";
        check(function, "id", id);
        detail::require(!pending_[static_cast<std::size_t>(id)].parents.empty(), function, "id", "is ", id,
                        ", which has no pending drafts");
        drop_drafts(id);
    }

    /// The longest length ≤ `tokens` that `id` can be restored to exactly: `tokens` itself
    /// when it is its length, a checkpoint it holds, or 0. Replay the tokens after it.
    [[nodiscard]] Index checkpoint_before(Index id, Index tokens) const {
        const M& m = state(id);
        if (tokens >= m.length())
            return m.length();
        Index best = 0;
        for (Index r = 0; r < ring_; ++r) {
            const Index l = saved_length_[at(id, r)];
            if (l <= tokens && l > best)
                best = l;
        }
        return best;
    }
    /// Whether truncate(id, tokens) would succeed.
    [[nodiscard]] bool can_truncate(Index id, Index tokens) const noexcept {
        return contains(id) && tokens >= 0 && tokens <= length(id) && checkpoint_before(id, tokens) == tokens;
    }
    /// Restores `id` to its state after `tokens` tokens: its length, 0 (the prototype's
    /// state) or a checkpoint it holds (the checkpoints past it are dropped). Any other
    /// length throws std::invalid_argument naming the nearest below, nothing changed.
    void truncate(Index id, Index tokens) {
        constexpr const char* function = "StatePool::truncate";
        const M& m = state(id);
        detail::require(tokens >= 0 && tokens <= m.length(), function, "tokens", "is ", tokens, ", expected 0 to ",
                        m.length(), " (the length of sequence ", id, ")");
        const Index nearest = checkpoint_before(id, tokens);
        detail::require(nearest == tokens, function, "tokens", "is ", tokens, ", which sequence ", id,
                        " holds no checkpoint at (a recurrent state cannot be cut): the nearest below is ", nearest,
                        "; truncate to it and replay the ", tokens - nearest, " tokens after it");
        drop_drafts(id);  // even at its length, as a PagedKVCache's truncate
        if (tokens == m.length())
            return;
        M& s = states_[static_cast<std::size_t>(id)];
        if (tokens == 0) {
            s.reset();
            forget_checkpoints(id);
            return;
        }
        for (Index r = 0; r < ring_; ++r)
            if (saved_length_[at(id, r)] == tokens) {
                s = saved_[at(id, r)];  // same shapes: no allocation
                next_[static_cast<std::size_t>(id)] = (r + 1) % ring_;  // the next checkpoint after the kept one
                break;
            }
        for (Index r = 0; r < ring_; ++r)
            if (saved_length_[at(id, r)] > tokens)
                saved_length_[at(id, r)] = -1;
    }

    /// Snapshots of one sequence: its memory's (the checkpoints are not recorded).
    void write_sequence(Index id, snapshot::Writer& w) const { state(id).write_snapshot(w); }
    /// Reads a payload of write_sequence into `id` (its memory's read_snapshot: a throw
    /// changes nothing); its checkpoints are dropped.
    void read_sequence(Index id, snapshot::Reader& r) {
        check("StatePool::read_sequence", "id", id);
        states_[static_cast<std::size_t>(id)].read_snapshot(r);
        forget_checkpoints(id);
        drop_drafts(id);
    }

    /// `id` as a Memory whose changes go through the pool (see Sequence).
    [[nodiscard]] Sequence sequence(Index id) {
        check("StatePool::sequence", "id", id);
        return Sequence(*this, id);
    }

    /// One sequence of a StatePool as a memattn::Memory (update, attend, extend, length,
    /// footprint, reset = truncate to 0) and, when M is, Snapshottable. A view: the pool
    /// must outlive it.
    class Sequence {
    public:
        using Scalar = typename M::Scalar;  ///< the memories' scalar
        /// Appends one token (StatePool::update).
        void update(ConstRowRef<Scalar> key, ConstRowRef<Scalar> value) { pool_->update(id_, key, value); }
        /// Appends many tokens (StatePool::extend).
        void extend(ConstMatrixRef<Scalar> keys, ConstMatrixRef<Scalar> values) { pool_->extend(id_, keys, values); }
        /// Its memory's attend.
        void attend(ConstRowRef<Scalar> query, RowRef<Scalar> out) const { pool_->attend(id_, query, out); }
        /// Tokens its state has seen.
        [[nodiscard]] Index length() const { return pool_->length(id_); }
        /// Bytes of its state.
        [[nodiscard]] std::size_t footprint() const { return pool_->state(id_).footprint(); }
        /// Back to the empty state (truncate to 0).
        void reset() { pool_->truncate(id_, 0); }
        /// The kind a snapshot records: its memory's, in a pool.
        [[nodiscard]] static std::string snapshot_kind() { return "StatePool::Sequence/" + M::snapshot_kind(); }
        /// Writes its state (StatePool::write_sequence).
        void write_snapshot(snapshot::Writer& w) const { pool_->write_sequence(id_, w); }
        /// Reads a state written by write_snapshot (StatePool::read_sequence).
        void read_snapshot(snapshot::Reader& r) { pool_->read_sequence(id_, r); }
        /// Its id in the pool.
        [[nodiscard]] Index id() const noexcept { return id_; }

    private:
        friend class StatePool;
        Sequence(StatePool& pool, Index id) : pool_(&pool), id_(id) {}
        StatePool* pool_;
        Index id_;
    };

private:
    friend struct detail::StateAccess;

    [[nodiscard]] std::size_t at(Index id, Index r) const noexcept { return static_cast<std::size_t>(id * ring_ + r); }

    void check(const char* function, const char* argument, Index id) const {
        if (!contains(id)) [[unlikely]]
            detail::require(false, function, argument, "is ", id, ", which is not a live sequence of the pool (",
                            sequences(), " live of ", capacity_, ")");
    }
    void check_batch(const char* function, std::span<const Index> ids) const {
        for (std::size_t i = 0; i < ids.size(); ++i) {
            check(function, "ids", ids[i]);
            for (std::size_t j = 0; j < i; ++j)
                detail::require(ids[j] != ids[i], function, "ids", "names sequence ", ids[i], " twice (at ", j, " and ",
                                i, ")");
        }
    }
    /// prefill's checks of a batch: distinct live ids, offsets, rows, then each chunk's
    /// shapes and values against its sequence's memory.
    void check_chunks(const char* function, std::span<const Index> ids, std::span<const Index> q_offsets,
                      const ConstMatrixRef<Scalar>& queries, const ConstMatrixRef<Scalar>& keys,
                      const ConstMatrixRef<Scalar>& values, MatrixRef<Scalar> out) const {
        check_batch(function, ids);
        const auto batch = static_cast<Index>(ids.size());
        detail::check_offsets(function, q_offsets, batch, keys.rows());
        detail::require(queries.rows() == keys.rows() && values.rows() == keys.rows() && out.rows() == keys.rows(),
                        function, "Q, V, O", "have ", queries.rows(), ", ", values.rows(), " and ", out.rows(),
                        " rows, expected ", keys.rows(), " each (K's)");
        for (Index i = 0; i < batch; ++i) {
            const Index r0 = q_offsets[static_cast<std::size_t>(i)], n = q_offsets[static_cast<std::size_t>(i) + 1] - r0;
            detail::check_sequences<M, Scalar>(function, states_[static_cast<std::size_t>(ids[static_cast<std::size_t>(i)])],
                                               queries.middleRows(r0, n), keys.middleRows(r0, n),
                                               values.middleRows(r0, n), out.middleRows(r0, n));
        }
    }
    /// A verify step's trees: one parent per row, each chunk's within it and before the
    /// row; draft states for every row.
    void check_tree(const char* function, std::span<const Index> q_offsets, std::span<const Index> parents) const {
        const Index rows = q_offsets.empty() ? 0 : q_offsets.back();
        detail::require(static_cast<Index>(parents.size()) == rows, function, "parents", "has ", parents.size(),
                        " entries, expected ", rows, " (one per row of K)");
        for (std::size_t i = 0; i + 1 < q_offsets.size(); ++i)
            for (Index t = 0; t < q_offsets[i + 1] - q_offsets[i]; ++t) {
                const Index p = parents[static_cast<std::size_t>(q_offsets[i] + t)];
                detail::require(p >= -1 && p < t, function, "parents", "has ", p, " at row ", q_offsets[i] + t,
                                " (draft ", t, " of sequence ", i, " in the batch), expected -1 (a root) or an "
                                "earlier draft of its chunk, 0 to ", t - 1);
            }
        detail::require(rows == 0 || draft_states_ > 0, function, "parents",
                        "give a verify step to a pool that keeps no draft states (StatePoolOptions::draft_states is "
                        "0): give it one per draft the steps hold at once");
        if (rows > free_draft_states()) [[unlikely]]
            throw PoolExhausted(std::string(function) + " (draft states, StatePoolOptions::draft_states, each "
                                "counting as a block)", rows,
                                free_draft_states(), draft_states_);
    }
    /// accept's checks: pending drafts, and a path that is a chain of their tree from a root.
    void check_path(const char* function, Index id, std::span<const Index> path) const {
        check(function, "id", id);
        const Pending& p = pending_[static_cast<std::size_t>(id)];
        const auto drafts = static_cast<Index>(p.parents.size());
        detail::require(drafts > 0, function, "id", "is ", id, ", which has no pending drafts (accept follows a "
                        "prefill with parents, before any other call changes the sequence)");
        for (std::size_t k = 0; k < path.size(); ++k) {
            const Index t = path[k];
            detail::require(t >= 0 && t < drafts, function, "path", "has ", t, " at ", k, ", expected a draft, 0 to ",
                            drafts - 1);
            const Index parent = p.parents[static_cast<std::size_t>(t)];
            const Index before = k == 0 ? -1 : path[k - 1];
            detail::require(parent == before, function, "path", "has draft ", t, " at ", k, ", whose parent is ",
                            parent, ", but the path's ",
                            k == 0 ? "first draft must be a root (parent -1)" : "draft before it is ",
                            k == 0 ? std::string() : std::to_string(before));
        }
    }
    /// `id`'s pending drafts released (their states free again).
    void drop_drafts(Index id) noexcept {
        Pending& p = pending_[static_cast<std::size_t>(id)];
        for (const Index d : p.held)
            free_drafts_[static_cast<std::size_t>(free_count_++)] = d;
        p.held.clear();
        p.parents.clear();
    }
    Index free_slot(const char* function) const {
        for (Index i = 0; i < capacity_; ++i)
            if (!live_[static_cast<std::size_t>(i)])
                return i;
        throw PoolExhausted(function, 1, 0, capacity_);
    }
    void forget_checkpoints(Index id) noexcept {
        for (Index r = 0; r < ring_; ++r)
            saved_length_[at(id, r)] = -1;
        if (ring_ > 0)
            next_[static_cast<std::size_t>(id)] = 0;
    }
    /// After a change that left `id` at a multiple of checkpoint_tokens: its state into
    /// the ring, over the oldest.
    void keep_checkpoint(Index id) {
        const M& m = states_[static_cast<std::size_t>(id)];
        if (every_ == 0 || m.length() == 0 || m.length() % every_ != 0)
            return;
        Index& next = next_[static_cast<std::size_t>(id)];
        saved_[at(id, next)] = m;  // same shapes: no allocation
        saved_length_[at(id, next)] = m.length();
        next = (next + 1) % ring_;
    }
    /// f(first, count) over [0, n) cut where `id`'s length reaches a multiple of
    /// checkpoint_tokens, a checkpoint kept after each piece.
    template <class F>
    void for_each_piece(Index id, Index n, F&& f) {
        for (Index r = 0; r < n;) {
            const Index length = states_[static_cast<std::size_t>(id)].length();
            const Index m = every_ > 0 ? std::min(n - r, every_ - length % every_) : n - r;
            f(r, m);
            keep_checkpoint(id);
            r += m;
        }
    }
    /// body(i) for each member of a batch over the executor's threads, its members' states
    /// (and rings) put back when the executor throws.
    template <class Body>
    void run_batch(std::span<const Index> ids, ExecutorRef executor, Body&& body) {
        const auto batch = static_cast<Index>(ids.size());
        const auto range = [&](Index first, Index last) {
            for (Index i = first; i < last; ++i)
                body(i);
        };
        if (executor.nothrow()) {
            detail::parallel_ranges(batch, [](Index) { return 1.0; }, range, 0, executor);
            return;
        }
        const std::size_t per = 1 + static_cast<std::size_t>(ring_);
        if (undo_.size() < ids.size() * per)
            undo_.resize(ids.size() * per, prototype_);  // the first such call of its size allocates
        undo_length_.resize(ids.size() * per);
        undo_next_.resize(ids.size());
        for (std::size_t i = 0; i < ids.size(); ++i) {
            undo_[i * per] = states_[static_cast<std::size_t>(ids[i])];
            for (Index r = 0; r < ring_; ++r) {
                undo_[i * per + 1 + static_cast<std::size_t>(r)] = saved_[at(ids[i], r)];
                undo_length_[i * per + 1 + static_cast<std::size_t>(r)] = saved_length_[at(ids[i], r)];
            }
            if (ring_ > 0)
                undo_next_[i] = next_[static_cast<std::size_t>(ids[i])];
        }
        try {
            detail::parallel_ranges(batch, [](Index) { return 1.0; }, range, 0, executor);
        } catch (...) {
            for (std::size_t i = 0; i < ids.size(); ++i) {
                states_[static_cast<std::size_t>(ids[i])] = undo_[i * per];
                for (Index r = 0; r < ring_; ++r) {
                    saved_[at(ids[i], r)] = undo_[i * per + 1 + static_cast<std::size_t>(r)];
                    saved_length_[at(ids[i], r)] = undo_length_[i * per + 1 + static_cast<std::size_t>(r)];
                }
                if (ring_ > 0)
                    next_[static_cast<std::size_t>(ids[i])] = undo_next_[i];
            }
            throw;
        }
    }

    /// A sequence's pending drafts: their parents within the tree and their draft states.
    struct Pending {
        std::vector<Index> parents, held;
    };

    Index capacity_, every_, ring_, draft_states_;
    StatePoolOptions options_;
    M prototype_;
    std::vector<M> states_;            // one per slot
    std::vector<bool> live_;
    std::vector<M> saved_;             // slot id's ring: [id · ring, (id + 1) · ring)
    std::vector<Index> saved_length_;  // their lengths (−1: empty)
    std::vector<Index> next_;          // each ring's next place
    std::vector<M> undo_;              // a batch's states before it, for an executor that may throw
    std::vector<Index> undo_length_, undo_next_;
    std::vector<M> drafts_;             // draft_states states for pending drafts
    std::vector<Index> free_drafts_;    // [0, free_count_): those no pending draft holds (a stack)
    Index free_count_ = 0;
    std::vector<Index> claimed_;        // a verify step's draft state per row (draft_states of them)
    std::vector<Pending> pending_;      // per slot
};

namespace detail {
/// A sequence's snapshot read apart from a StatePool, then put in place (ModelCache's
/// load: every layer read before any is changed).
struct StateAccess {
    /// A memory of the pool's shape with the state the payload holds (allocates: a load).
    template <class Pool>
    static auto read_state(const Pool& pool, snapshot::Reader& r) {
        auto loaded = pool.prototype_;
        loaded.read_snapshot(r);
        return loaded;
    }
    /// Puts it in place of `id`'s state (read_state's, of the same shapes), its
    /// checkpoints dropped.
    template <class Pool, class M>
    static void install(Pool& pool, Index id, M& loaded) noexcept {
        pool.states_[static_cast<std::size_t>(id)] = std::move(loaded);
        pool.forget_checkpoints(id);
        pool.drop_drafts(id);
    }
};
}  // namespace detail

}  // namespace memattn
