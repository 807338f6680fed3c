#pragma once
// ModelCache: one cache for a whole model, one PagedKVCache per layer (each with its own
// layout, blocks, block size and options: sliding-window layers beside full ones) under
// one id space (docs/design.md, "Serving").
//
//   const std::vector<memattn::ModelLayer> layers(32, {.layout = {32, 8, 128}, .blocks = 4096});
//   memattn::ModelCache<float, Eigen::bfloat16> cache(layers);
//   const memattn::Index a = cache.add_sequence();     // one call for every layer
//   const memattn::Index b = cache.fork(a);
//   const auto& step = cache.plan(ids, q_offsets);    // every id live, every layer's blocks
//   for (memattn::Index l = 0; l < cache.layers(); ++l)
//       cache.prefill(l, step, Q[l], K[l], V[l], O[l]);   // cannot run out of blocks
//   cache.remove(a);                                   // a is refused from now on
//
// Ids: a sequence's id is its slot (the id of its sequence in every layer's pool, which
// are kept equal: every layer takes the same calls in the same order, all or nothing)
// and a generation, id = generation · 2^32 + slot, the generation counting the slot's
// sequences from 1. So an id is never reused: once removed, it is refused for good
// ("sequence ... was removed"), where a slot of the pools would name the next sequence
// given it, and a pool's own id (generation 0) is refused too.
//
// All or nothing: add_sequence, fork, truncate, remove and a sequence's load act on every
// layer or on none (truncate checks can_truncate in every layer first; add and fork take
// back what an allocation that failed part way had made; a load reads every layer before
// it changes one).
//
// A step: plan() (or plan_decode()) checks the ids and counts each layer's blocks against
// its free ones (PagedKVCache::blocks_needed), and from then on holds them: until a
// layer has run the step, the cache's own calls that take blocks (fork, whose copies on
// write a step's sequence may now need, and a sequence's load) are refused with
// PoolExhausted if they would leave that layer short, so no layer's step throws
// PoolExhausted: a model's step does not stop half way for want of blocks. (Calls made
// on a layer's pool directly are the caller's to count.) Each layer runs the latest plan
// once (decode, prefill); rollback(step) takes its tokens back from every layer that took
// them. Between a step's first layer and its last, its sequences' lengths differ between
// layers, so a new plan, and a fork, truncate or load of one of them, are refused until
// the step has run in every layer or is taken back; a remove of one of them is always
// allowed and leaves the step running: the id is refused from then on, but its slot
// stays in the layers (which take its rows, discarded) until the step has run in every
// layer or is taken back (counted among the live sequences until then), so the step's
// other sequences keep their tokens; once every sequence of the step is removed, the
// step ends at once. A step runs the same way in
// every layer: with the same parents in each (a verify step) or with none.
// Before any layer has run it, a truncate, remove or load of one of
// its sequences ends the step (its lengths are stale): plan anew.
//
// Snapshots: sequence(id) is the sequence across every layer, for memattn::save and
// memattn::load (memattn/persistence/snapshot.hpp): one snapshot, every layer's tokens.
//
// Hybrid models (Qwen3-Next, Kimi Linear, Jamba: softmax layers between recurrent ones):
// ModelCache<T, S, M> holds, beside a PagedKVCache per softmax layer (ModelLayer), a
// StatePool<M> per recurrent layer (StateLayer<M>: the memory every sequence starts as,
// and its checkpoints), all under the one id space, `capacity` sequences at most:
//
//   using Gdn = memattn::MultiHead<memattn::DeltaRuleMemory<float>>;  // gated: DeltaRuleMemory(d, dv, {}, true)
//   using Cache = memattn::ModelCache<float, float, Gdn>;
//   const std::vector<Cache::Layer> layers{memattn::StateLayer<Gdn>{gdn, {.checkpoint_tokens = 64}},
//                                          memattn::ModelLayer{.layout = {16, 2, 256}, .blocks = 4096}};
//   Cache cache(layers, /*capacity=*/64);
//   cache.prefill(0, step, Q0, K0, V0, O0);   // layer 0: StatePool::prefill; layer 1: the pool's
//
// add_sequence, fork (the state and its checkpoints copied), remove, snapshots and the
// steps act on every layer, all or nothing, as above. A recurrent state cannot be cut,
// only restored: truncate(id, t) succeeds when every recurrent layer holds the state of
// length t (t the length, 0, or a checkpoint: StatePool::truncate), else it is refused
// naming the layer and checkpoint_before(id, t), the longest length ≤ t every layer can
// go back to; truncate there and replay the tokens after it. rollback(step) takes the
// step back exactly where every recurrent layer that ran it can, else its sequences go
// back to checkpoint_before(id, the length before the step) (length(id) says where to
// replay from). A verify step of draft trees runs in the recurrent layers too: each
// draft's state is its parent's updated by its token (StatePool's draft states:
// StatePoolOptions::draft_states, one per draft), and accept(id, path) makes the path's
// last state the sequence's in every recurrent layer as it keeps the path's K/V rows in
// every softmax layer. A recurrent state cannot take a tree's drafts as tokens, so with
// recurrent layers a sequence's pending drafts are accepted or rejected before it is
// planned, forked or saved, or truncated past the length before them.

#include "memattn/execution/executor.hpp"
#include "memattn/kernels/softmax_options.hpp"
#include "memattn/layer/head_layout.hpp"
#include "memattn/persistence/snapshot.hpp"
#include "memattn/serving/batched.hpp"
#include "memattn/serving/paged_kv_cache.hpp"
#include "memattn/serving/state_pool.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace memattn {

/// One layer of a ModelCache: its pool's layout, blocks, block size and options (a
/// window, sinks, scale and the logit options, as PagedKVCache takes them).
struct ModelLayer {
    HeadLayout layout;             ///< the layer's heads
    Index blocks = 0;              ///< blocks of its pool
    Index block_size = 128;        ///< tokens per block
    SoftmaxOptions options = {};   ///< its window, sinks, scale and logit options (causal)
    PoolOptions pool = {};         ///< its rollback room and refusal of non-finite pairs
};

/// One recurrent layer of a hybrid ModelCache: the memory every sequence's state starts
/// as (copied, reset), the checkpoints its StatePool keeps and its draft states (one per
/// pending draft of a verify step).
template <Memory M>
struct StateLayer {
    M prototype;                    ///< a sequence's memory before its first token
    StatePoolOptions options = {};  ///< checkpoints every n tokens, and how many are kept
};

namespace detail {
/// The recurrent layers' pool of a ModelCache<T, S, M>: none when M is void.
template <class M>
struct StateLayers {
    struct None {};
    using Pool = None;
    using Layer = ModelLayer;
};
template <Memory M>
struct StateLayers<M> {
    using Pool = StatePool<M>;
    using Layer = std::variant<ModelLayer, StateLayer<M>>;
};
}  // namespace detail

/// One PagedKVCache per softmax layer of a model, and with M one StatePool<M> per
/// recurrent layer, under one id space; see the top of the file.
/// \tparam M the recurrent layers' memory (a hybrid model), or void: softmax layers only.
template <Scalar T, class S = T, class M = void>
    requires std::is_void_v<M> || (Memory<M> && std::same_as<typename M::Scalar, T>)
class ModelCache {
public:
    using Pool = PagedKVCache<T, S>;  ///< one softmax layer's pool
    /// One recurrent layer's pool (StatePool<M>; an empty type when M is void).
    using States = typename detail::StateLayers<M>::Pool;
    /// A layer as the constructor takes it: ModelLayer, or, with M, a
    /// std::variant<ModelLayer, StateLayer<M>>.
    using Layer = typename detail::StateLayers<M>::Layer;
    /// Whether the cache can hold recurrent layers.
    static constexpr bool hybrid = !std::is_void_v<M>;

    /// A step of a batch planned once and run by every layer (plan, plan_decode): the
    /// sequences' slots (their ids in every layer's pool), the chunks' offsets and the
    /// lengths before the step.
    class Step {
    public:
        /// The sequences' ids in every layer's pool, in the batch's order.
        [[nodiscard]] std::span<const Index> slots() const noexcept { return slots_; }
        /// The chunks' row offsets (batch + 1 of them), as batched_prefill takes them.
        [[nodiscard]] std::span<const Index> q_offsets() const noexcept { return offsets_; }
        /// The rows of Q, K, V and O a layer's call takes.
        [[nodiscard]] Index rows() const noexcept { return offsets_.empty() ? 0 : offsets_.back(); }
        /// Whether every chunk is one token (a decode step).
        [[nodiscard]] bool decode() const noexcept { return decode_; }

    private:
        friend class ModelCache;
        std::vector<Index> slots_, offsets_, before_;
        std::uint64_t serial_ = 0;  // the plan it is (the cache's count of plans)
        bool decode_ = false;
    };

    /// One sequence across every layer, for snapshots: memattn::save and memattn::load
    /// take it (it is Persistent, not a Memory). A view: the cache must outlive it.
    class Sequence {
    public:
        using Scalar = T;  ///< the cache's scalar
        /// The storage type a snapshot records.
        static constexpr snapshot::TypeCode snapshot_storage = detail::storage_code<T, S>();
        /// The kind a snapshot records.
        [[nodiscard]] static std::string snapshot_kind() { return "ModelCache::Sequence"; }
        /// Writes its tokens in every layer (ModelCache::write_sequence).
        void write_snapshot(snapshot::Writer& w) const { cache_->write_sequence(id_, w); }
        /// Reads them back, every layer or none (ModelCache::read_sequence).
        void read_snapshot(snapshot::Reader& r) { cache_->read_sequence(id_, r); }
        /// Its id.
        [[nodiscard]] Index id() const noexcept { return id_; }
        /// The cache it belongs to.
        [[nodiscard]] ModelCache& cache() const noexcept { return *cache_; }

    private:
        friend class ModelCache;
        Sequence(ModelCache& cache, Index id) : cache_(&cache), id_(id) {}
        ModelCache* cache_;
        Index id_;
    };

    /// The layers' pools, built now (each allocates its blocks).
    explicit ModelCache(std::span<const ModelLayer> layers)
        requires(!hybrid)
    {
        detail::require(!layers.empty(), "ModelCache", "layers", "is empty, expected one layer or more");
        pools_.reserve(layers.size());
        for (const ModelLayer& l : layers) {
            at_.push_back(static_cast<Index>(pools_.size()));
            pools_.emplace_back(l.layout, l.blocks, l.block_size, l.options, l.pool);
        }
        ran_.assign(at_.size(), 0);
    }
    /// A hybrid model's layers, in order: a PagedKVCache for each ModelLayer, a
    /// StatePool<M> of `capacity` sequences for each StateLayer<M> (each allocating its
    /// blocks or states now). `capacity` bounds the live sequences of every layer: an add
    /// or fork past it throws PoolExhausted, nothing changed.
    ModelCache(std::span<const Layer> layers, Index capacity)
        requires hybrid
        : capacity_(capacity)
    {
        detail::require(!layers.empty(), "ModelCache", "layers", "is empty, expected one layer or more");
        detail::at_least(capacity, 1, "ModelCache", "capacity");
        for (const Layer& layer : layers) {
            if (const auto* l = std::get_if<ModelLayer>(&layer)) {
                at_.push_back(static_cast<Index>(pools_.size()));
                pools_.emplace_back(l->layout, l->blocks, l->block_size, l->options, l->pool);
            } else {
                const auto& r = std::get<StateLayer<M>>(layer);
                at_.push_back(-1 - static_cast<Index>(states_.size()));
                states_.emplace_back(capacity, r.prototype, r.options);
            }
        }
        ran_.assign(at_.size(), 0);
    }

    /// Layers of the model.
    [[nodiscard]] Index layers() const noexcept { return static_cast<Index>(at_.size()); }
    /// Whether layer l is a recurrent layer (a StatePool), not a softmax layer's pool.
    [[nodiscard]] bool recurrent(Index l) const { return at_[checked_layer("ModelCache::recurrent", l)] < 0; }
    /// Softmax layer l's pool, for its batched calls (with step.slots()) and its counts.
    [[nodiscard]] Pool& layer(Index l) { return pools_[kv_index("ModelCache::layer", l)]; }
    /// The same, read only.
    [[nodiscard]] const Pool& layer(Index l) const { return pools_[kv_index("ModelCache::layer", l)]; }
    /// Recurrent layer l's pool of states, for its executor and its counts (its
    /// memories, checkpoint_before); change its sequences through the cache.
    [[nodiscard]] States& states(Index l)
        requires hybrid
    {
        return states_[state_index("ModelCache::states", l)];
    }
    /// The same, read only.
    [[nodiscard]] const States& states(Index l) const
        requires hybrid
    {
        return states_[state_index("ModelCache::states", l)];
    }

    /// A new, empty sequence in every layer; returns its id.
    Index add_sequence() {
        return in_every_layer("ModelCache::add_sequence", [](Pool& pool) { return pool.add_sequence(); },
                              [](auto& states) { return states.add(); });
    }
    /// A new sequence holding `parent`'s tokens in every layer, sharing its blocks.
    /// Refused (PoolExhausted, nothing changed) if the copies on write the planned step
    /// would then make leave a layer that has not run it short of blocks.
    Index fork(Index parent) {
        constexpr const char* function = "ModelCache::fork";
        const Index from = slot_of(function, "parent", parent);
        check_not_mid_step(function, "parent", parent, from);
        check_no_drafts(function, "parent", parent, from, "forked");
        const Index child = in_every_layer(function, [from](Pool& pool) { return pool.fork(from); },
                                           [from](auto& states) { return states.fork(from); });
        try {
            admit(function, true);
        } catch (...) {
            remove_slot(slot(child));
            throw;
        }
        return child;
    }
    /// Keeps the first `tokens` tokens of `id` in every layer (a rollback), or, when a
    /// windowed layer has freed tokens a sequence of that length needs, throws
    /// std::invalid_argument naming the layer with every layer unchanged.
    void truncate(Index id, Index tokens) {
        constexpr const char* function = "ModelCache::truncate";
        const Index slot = slot_of(function, "id", id);
        check_not_mid_step(function, "id", id, slot);
        if constexpr (hybrid)
            if (!states_.empty() && states_.front().pending_drafts(slot) > 0) {
                const Index before = states_.front().length(slot), drafts = states_.front().pending_drafts(slot);
                detail::require(tokens >= 0 && tokens <= before + drafts, function, "tokens", "is ", tokens,
                                ", expected 0 to ", before + drafts, " (the length of sequence ", id, ")");
                detail::require(tokens <= before, function, "tokens", "is ", tokens, ", past the ", before,
                                " tokens before sequence ", id, "'s ", drafts,
                                " pending drafts: accept or reject them first (a recurrent layer's state cannot take "
                                "a tree's drafts as tokens)");
            }
        for (Index l = 0; l < layers(); ++l) {
            const Index at = at_[static_cast<std::size_t>(l)];
            if (at >= 0) {
                detail::require(pools_[static_cast<std::size_t>(at)].can_truncate(slot, tokens), function, "tokens",
                                "is ", tokens, ", which layer ", l, " cannot take sequence ", id, " back to (length ",
                                pools_[static_cast<std::size_t>(at)].length(slot),
                                ", its window has freed what that length needs, or more than its length)");
            } else if constexpr (hybrid) {
                if (states_[static_cast<std::size_t>(-1 - at)].can_truncate(slot, tokens)) [[likely]]
                    continue;
                const Index length = front_length(slot);
                detail::require(tokens >= 0 && tokens <= length, function, "tokens", "is ", tokens, ", expected 0 to ",
                                length, " (the length of sequence ", id, ")");
                detail::require(false, function, "tokens", "is ", tokens, ", which recurrent layer ", l,
                                " cannot take sequence ", id, " back to (length ", length,
                                "; it holds no state of that length, and a state cannot be cut): the longest length "
                                "every layer can go back to is ",
                                checkpoint_before(id, tokens), "; truncate to it and replay the tokens after it");
            }
        }
        for (Pool& pool : pools_)  // each, even at its length: a truncate ends pending drafts
            pool.truncate(slot, tokens);
        if constexpr (hybrid)
            for (States& states : states_)
                states.truncate(slot, tokens);
        end_step_of(slot);
    }
    /// Whether truncate(id, tokens) would succeed.
    [[nodiscard]] bool can_truncate(Index id, Index tokens) const noexcept {
        return contains(id) && !(mid_step() && in_step(slot(id))) && restorable(slot(id), tokens);
    }
    /// The longest length ≤ `tokens` that every layer can take `id` back to (truncate):
    /// `tokens` itself when it can, else the latest below that every recurrent layer holds
    /// a state of (a checkpoint, or 0) and every windowed layer still holds the tokens
    /// of. Truncate to it, then replay the tokens after it.
    [[nodiscard]] Index checkpoint_before(Index id, Index tokens) const {
        const Index s = slot_of("ModelCache::checkpoint_before", "id", id);
        Index c = std::clamp<Index>(tokens, 0, front_length(s));
        while (!restorable(s, c)) {
            Index next = c - 1;  // c > 0: every layer can go back to 0
            if constexpr (hybrid)
                for (const States& states : states_)
                    next = std::min(next, states.checkpoint_before(s, next));
            for (const Pool& pool : pools_)  // below a windowed layer's held tokens: only its sinks
                if (!pool.can_truncate(s, next))
                    next = std::min(next, pool.sink_tokens());
            c = next;
        }
        return c;
    }
    /// Ends `id` in every layer; the id is refused from now on. A sequence of a step that
    /// has run in some layers and not in others keeps its slot in every layer until the
    /// step has run in the rest or is taken back (the layers take its rows; its outputs
    /// are discarded), so the step goes on for its other sequences; until then the slot
    /// still counts among the live sequences (sequences(), the capacity) and holds its
    /// blocks and states. When every sequence of the step has been removed, the step ends
    /// and their slots are freed at once.
    void remove(Index id) {
        const Index slot = slot_of("ModelCache::remove", "id", id);
        ++generations_[static_cast<std::size_t>(slot)];
        if (mid_step() && in_step(slot)) {
            removed_.push_back(slot);  // (reserved: the step's size)
            if (removed_.size() < step_.slots_.size())
                return;
            planned_ = false;  // nothing left of the step to run
            free_removed();
            return;
        }
        remove_slot(slot);
        end_step_of(slot);
    }

    /// True when `id` names a live sequence.
    [[nodiscard]] bool contains(Index id) const noexcept {
        const Index s = slot(id), g = generation(id);
        return g > 0 && s < static_cast<Index>(generations_.size()) && generations_[static_cast<std::size_t>(s)] == g &&
               live(s) && !removing(s);
    }
    /// Tokens of `id` (the same in every layer).
    [[nodiscard]] Index length(Index id) const { return front_length(slot_of("ModelCache::length", "id", id)); }
    /// Live sequences.
    [[nodiscard]] Index sequences() const noexcept {
        if constexpr (hybrid)
            if (pools_.empty())
                return states_.front().sequences();
        return pools_.front().sequences();
    }
    /// The id of `id`'s sequence in every layer's pool.
    [[nodiscard]] Index slot_of(Index id) const { return slot_of("ModelCache::slot_of", "id", id); }

    /// `id` across every layer, for memattn::save and memattn::load (see Sequence).
    [[nodiscard]] Sequence sequence(Index id) {
        slot_of("ModelCache::sequence", "id", id);
        return Sequence(*this, id);
    }
    /// Writes `id`'s tokens in every layer: the layer count, then each layer's
    /// PagedKVCache::write_sequence (a recurrent layer's StatePool::write_sequence: its
    /// memory's snapshot) as a part of its own.
    void write_sequence(Index id, snapshot::Writer& w) const {
        const Index s = slot_of("ModelCache::write_sequence", "id", id);
        check_no_drafts("ModelCache::write_sequence", "id", id, s, "saved");
        w.index(layers());
        for (const Index at : at_)
            w.part([&](snapshot::Writer& part) {
                if (at >= 0)
                    pools_[static_cast<std::size_t>(at)].write_sequence(s, part);
                else if constexpr (hybrid)
                    states_[static_cast<std::size_t>(-1 - at)].write_sequence(s, part);
            });
    }
    /// Reads a payload of write_sequence into `id`, replacing its tokens in every layer
    /// (each keeping what its window keeps, as PagedKVCache::read_sequence does), all or
    /// nothing: every layer is read into blocks of its own before any sequence changes.
    /// Throws SnapshotError (another layer count, a layer's layout or options, lengths that
    /// differ between layers) or PoolExhausted (a layer without the blocks, or one that
    /// would leave the planned step short), `id` unchanged.
    void read_sequence(Index id, snapshot::Reader& r) {
        constexpr const char* function = "ModelCache::read_sequence";
        const Index s = slot_of(function, "id", id);
        check_not_mid_step(function, "id", id, s);
        r.expect("layers", layers());
        using Loaded = decltype(detail::PagedAccess::read_state(std::declval<Pool&>(), function, r));
        std::vector<Loaded> loaded;  // the softmax layers', in order
        loaded.reserve(pools_.size());
        std::vector<LoadedState> states;  // the recurrent layers', in order
        states.reserve(states_.size());
        Index tokens = -1;  // layer 0's
        try {
            for (std::size_t l = 0; l < at_.size(); ++l) {
                snapshot::Reader part = r.part("a layer's part");
                const Index at = at_[l];
                Index length = 0;
                if (at >= 0) {
                    Pool& pool = pools_[static_cast<std::size_t>(at)];
                    loaded.push_back(detail::PagedAccess::read_state(pool, function, part));
                    length = loaded.back().length;
                    // The blocks the planned step holds in a layer that has not run it (unless
                    // `id` is in the step, which its load ends), against the free ones and those
                    // `id` alone holds (an upper bound: the blocks `id` frees may also spare the
                    // step a copy on write).
                    if (planned_ && !ran_[l] && !in_step(s)) {
                        const Index needed = pool.blocks_needed(step_.slots_, tokens_),
                                    free = pool.free_blocks() + detail::PagedAccess::sole_blocks(pool, s);
                        if (needed > free)
                            throw PoolExhausted(std::string(function) + " (layer " + std::to_string(l) +
                                                    ": the planned step holds blocks)",
                                                needed, free, pool.blocks());
                    }
                } else if constexpr (hybrid) {
                    states.push_back(detail::StateAccess::read_state(states_[static_cast<std::size_t>(-1 - at)], part));
                    length = states.back().length();
                }
                if (l == 0)
                    tokens = length;
                if (length != tokens)
                    part.fail("layer " + std::to_string(l) + " holds " + std::to_string(length) + " tokens, layer 0 " +
                              std::to_string(tokens));
            }
            r.expect_remaining(0, "the end of the layers");
        } catch (...) {
            for (std::size_t k = loaded.size(); k-- > 0;)
                detail::PagedAccess::discard(pools_[k], loaded[k]);
            throw;
        }
        for (std::size_t k = 0; k < pools_.size(); ++k)
            detail::PagedAccess::install(pools_[k], s, loaded[k]);
        if constexpr (hybrid)
            for (std::size_t k = 0; k < states_.size(); ++k)
                detail::StateAccess::install(states_[k], s, states[k]);
        end_step_of(s);
    }

    /// Plans a mixed batch: sequence ids[i] brings the rows [q_offsets[i], q_offsets[i +
    /// 1]) of every layer's Q, K and V. Checks that every id is live and distinct and that
    /// every layer has the blocks the batch needs (PoolExhausted naming the layer
    /// otherwise), then returns the step every layer's prefill takes (kept by the cache
    /// until the next plan: a step allocates nothing once one of its size has run).
    const Step& plan(std::span<const Index> ids, std::span<const Index> q_offsets) {
        constexpr const char* function = "ModelCache::plan";
        begin_plan(function);
        detail::check_offsets(function, q_offsets, static_cast<Index>(ids.size()),
                              q_offsets.empty() ? 0 : q_offsets.back());
        fill_step(function, ids, false);
        step_.offsets_.assign(q_offsets.begin(), q_offsets.end());
        tokens_.resize(ids.size());
        for (std::size_t i = 0; i < ids.size(); ++i)
            tokens_[i] = q_offsets[i + 1] - q_offsets[i];
        return admit_plan(function);
    }
    /// Plans a decode step: one token for each sequence of `ids`.
    const Step& plan_decode(std::span<const Index> ids) {
        constexpr const char* function = "ModelCache::plan_decode";
        begin_plan(function);
        fill_step(function, ids, true);
        step_.offsets_.resize(ids.size() + 1);
        tokens_.assign(ids.size(), 1);
        for (std::size_t i = 0; i <= ids.size(); ++i)
            step_.offsets_[i] = static_cast<Index>(i);
        return admit_plan(function);
    }

    /// Layer l's decode step of `step` (the latest plan_decode, once per layer):
    /// batched_decode on its pool (a recurrent layer's: StatePool::decode).
    template <class DQ, class DK, class DV, detail::EigenMatrix DO>
    void decode(Index l, const Step& step, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                const Eigen::MatrixBase<DV>& V, DO&& O) {
        constexpr const char* function = "ModelCache::decode";
        const std::size_t layer = runnable(function, l, step);
        detail::require(step.decode(), function, "step", "is a plan of chunks (plan), expected one of plan_decode");
        check_kind(function, false, {});
        const Index at = at_[layer];
        if (at >= 0) {
            Pool& pool = pools_[static_cast<std::size_t>(at)];
            batched_decode(pool, step.slots(), Q, K, V, std::forward<DO>(O), pool.executor());
        } else if constexpr (hybrid) {
            States& states = states_[static_cast<std::size_t>(-1 - at)];
            if constexpr (detail::batch_scalars<T, DQ, DK, DV, DO>())
                states.decode(step.slots(), detail::sequence(Q), detail::sequence(K), detail::sequence(V),
                              detail::output(std::forward<DO>(O)), states.executor());
        }
        ran(layer);
    }
    /// Layer l's step of `step` (the latest plan or plan_decode, once per layer):
    /// batched_prefill on its pool (a recurrent layer's: StatePool::prefill).
    template <class DQ, class DK, class DV, detail::EigenMatrix DO>
    void prefill(Index l, const Step& step, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                 const Eigen::MatrixBase<DV>& V, DO&& O) {
        const std::size_t layer = runnable("ModelCache::prefill", l, step);
        check_kind("ModelCache::prefill", false, {});
        const Index at = at_[layer];
        if (at >= 0) {
            Pool& pool = pools_[static_cast<std::size_t>(at)];
            batched_prefill(pool, step.slots(), step.q_offsets(), Q, K, V, std::forward<DO>(O), pool.executor());
        } else if constexpr (hybrid) {
            States& states = states_[static_cast<std::size_t>(-1 - at)];
            if constexpr (detail::batch_scalars<T, DQ, DK, DV, DO>())
                states.prefill(step.slots(), step.q_offsets(), detail::sequence(Q), detail::sequence(K),
                               detail::sequence(V), detail::output(std::forward<DO>(O)), states.executor());
        }
        ran(layer);
    }
    /// Layer l's verify step of `step` (a plan of chunks, each a tree of drafts):
    /// batched_prefill with `parents` on its pool (PagedKVCache::prefill), the drafts then
    /// pending in that layer; once every layer has run it, accept(id, path) or reject(id).
    /// The first layer to run it checks the trees for every layer first (a windowed
    /// layer's rollback room: PagedKVCache::validate_tree; a recurrent layer's free draft
    /// states: StatePool::validate_tree), so those refusals come before any layer holds
    /// drafts (a value a later layer refuses comes after the earlier ones ran:
    /// rollback(step) takes their drafts back). A recurrent layer runs StatePool's verify
    /// step (prefill with parents). Every layer runs the step with the same parents.
    template <class DQ, class DK, class DV, detail::EigenMatrix DO>
    void prefill(Index l, const Step& step, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                 const Eigen::MatrixBase<DV>& V, DO&& O, std::span<const Index> parents) {
        constexpr const char* function = "ModelCache::prefill";
        const std::size_t layer = runnable(function, l, step);
        check_kind(function, true, parents);
        if (std::find(ran_.begin(), ran_.end(), char{1}) == ran_.end())  // the step's first layer: all of them
            for (Index other = 0; other < layers(); ++other) {
                const Index at = at_[static_cast<std::size_t>(other)];
                try {
                    if (at >= 0) {
                        pools_[static_cast<std::size_t>(at)].validate_tree(step.slots(), step.q_offsets(), parents);
                    } else if constexpr (hybrid) {
                        const States& states = states_[static_cast<std::size_t>(-1 - at)];
                        try {
                            states.validate_tree(step.slots(), step.q_offsets(), parents);
                        } catch (const PoolExhausted& e) {
                            throw PoolExhausted(std::string(function) + " (layer " + std::to_string(other) +
                                                    "'s draft states, StatePoolOptions::draft_states, each counting "
                                                    "as a block)",
                                                e.needed(), e.free(), states.options().draft_states);
                        }
                    }
                } catch (const std::invalid_argument& e) {
                    throw std::invalid_argument(std::string("memattn::ModelCache::prefill: layer ") +
                                                std::to_string(other) + " refuses the verify step's trees (" +
                                                e.what() + ")");
                }
            }
        const Index at = at_[layer];
        if (at >= 0) {
            Pool& pool = pools_[static_cast<std::size_t>(at)];
            batched_prefill(pool, step.slots(), step.q_offsets(), Q, K, V, std::forward<DO>(O), pool.executor(),
                            parents);
        } else if constexpr (hybrid) {
            States& states = states_[static_cast<std::size_t>(-1 - at)];
            if constexpr (detail::batch_scalars<T, DQ, DK, DV, DO>())
                states.prefill(step.slots(), step.q_offsets(), detail::sequence(Q), detail::sequence(K),
                               detail::sequence(V), detail::output(std::forward<DO>(O)), states.executor(), parents);
        }
        ran(layer);
    }

    /// Keeps the accepted path of `id`'s pending drafts in every layer at once
    /// (PagedKVCache::accept; a recurrent layer's StatePool::accept), all or nothing: every
    /// layer's path and copies checked first (std::invalid_argument, PoolExhausted naming
    /// the layer, also when the copies would leave a layer short of the planned step's
    /// blocks). Ends the step `id` is in.
    void accept(Index id, std::span<const Index> path) {
        constexpr const char* function = "ModelCache::accept";
        const Index s = slot_of(function, "id", id);
        check_not_mid_step(function, "id", id, s);
        for (Index l = 0; l < layers(); ++l)  // (then the layers' checks are of the path alone)
            detail::require(layer_drafts(l, s) > 0, function, "id", "is ", id, ", which has no pending drafts in layer ",
                            l, " (accept follows a verify step run in every layer)");
        for (Index l = 0; l < layers(); ++l) {
            const Index at = at_[static_cast<std::size_t>(l)];
            if (at < 0) {
                if constexpr (hybrid) {
                    try {
                        states_[static_cast<std::size_t>(-1 - at)].validate_path(s, path, function);
                    } catch (const std::invalid_argument& e) {
                        throw std::invalid_argument(std::string(e.what()) + " (layer " + std::to_string(l) + ", sequence " +
                                                    std::to_string(id) + ")");
                    }
                }
                continue;
            }
            const Pool& pool = pools_[static_cast<std::size_t>(at)];
            const Index needed = pool.accept_blocks(s, path, function);
            const Index held = planned_ && !in_step(s) ? pool.blocks_needed(step_.slots_, tokens_) : 0;
            if (needed > 0 && needed + held > pool.free_blocks())
                throw PoolExhausted(std::string(function) + " (layer " + std::to_string(l) + ")", needed + held,
                                    pool.free_blocks(), pool.blocks());
        }
        for (Pool& pool : pools_)
            pool.accept(s, path);
        if constexpr (hybrid)
            for (States& states : states_)
                states.accept(s, path);
        end_step_of(s);
    }
    /// Drops `id`'s pending drafts in every layer (PagedKVCache::reject).
    void reject(Index id) {
        constexpr const char* function = "ModelCache::reject";
        const Index s = slot_of(function, "id", id);
        check_not_mid_step(function, "id", id, s);
        for (Index l = 0; l < layers(); ++l)  // every layer first: all or nothing
            detail::require(layer_drafts(l, s) > 0, function, "id", "is ", id, ", which has no pending drafts in layer ",
                            l);
        for (Pool& pool : pools_)
            pool.reject(s);
        if constexpr (hybrid)
            for (States& states : states_)
                states.reject(s);
        end_step_of(s);
    }
    /// The drafts `id`'s last verify step left pending (the same in every layer).
    [[nodiscard]] Index pending_drafts(Index id) const {
        return layer_drafts(0, slot_of("ModelCache::pending_drafts", "id", id));
    }

    /// Whether a step is planned that some layers have not run yet.
    [[nodiscard]] bool step_pending() const noexcept { return planned_; }

    /// Takes the tokens of `step` back from every layer that took them (a layer that
    /// threw, or was not reached, has none to give back), all or nothing: where a windowed
    /// layer has already freed what the shorter sequence needs, throws std::invalid_argument
    /// naming the layer and changes nothing. A recurrent layer that has run the step goes
    /// back exactly only where it holds the state before it (a checkpoint there): else the
    /// sequence goes back in every layer to the latest length that layer holds a state of
    /// (checkpoint_before), and length(id) says where to replay from.
    /// Ends the step: plan anew to run it again.
    void rollback(const Step& step) {
        constexpr const char* function = "ModelCache::rollback";
        detail::require(planned_ && step.serial_ == serial_, function, "step",
                        "is not the latest plan of this cache, or has ended (run in every layer, taken back, or "
                        "ended by a change to one of its sequences)");
        const auto slots = step.slots();
        targets_.resize(slots.size());
        for (std::size_t i = 0; i < slots.size(); ++i) {
            if (removing(slots[i]))  // removed while the step ran: freed below, its tokens no matter
                continue;
            Index& target = targets_[i];
            target = step.before_[i];
            if constexpr (hybrid)  // back to a length every recurrent layer holds a state of, and
                for (bool moved = true; moved;) {  // every windowed layer the tokens of (else its sinks)
                    moved = false;
                    for (const States& states : states_) {
                        const Index c = states.checkpoint_before(slots[i], target);
                        moved = moved || c != target;
                        target = c;
                    }
                    if (states_.empty())
                        break;  // the softmax layers' own checks below, as without recurrent layers
                    for (const Pool& pool : pools_)
                        if (pool.length(slots[i]) != target && !pool.can_truncate(slots[i], target)) {
                            target = std::min(target, pool.sink_tokens());
                            moved = true;
                        }
                }
            for (Index l = 0; l < layers(); ++l) {
                const Index at = at_[static_cast<std::size_t>(l)];
                if (at < 0)
                    continue;
                const Pool& pool = pools_[static_cast<std::size_t>(at)];
                detail::require(pool.length(slots[i]) == target || pool.can_truncate(slots[i], target), function,
                                "step", "cannot be taken back in layer ", l, ": its window has freed tokens slot ",
                                slots[i], " of length ", target, " needs");
            }
        }
        for (std::size_t i = 0; i < slots.size(); ++i)
            if (!removing(slots[i]))
                truncate_slot(slots[i], targets_[i]);
        planned_ = false;
        free_removed();  // the step's sequences removed while it ran
    }

    /// Bytes of every layer's pool.
    [[nodiscard]] std::size_t footprint() const noexcept {
        std::size_t bytes = 0;
        for (const Pool& pool : pools_)
            bytes += pool.footprint();
        if constexpr (hybrid)
            for (const States& states : states_)
                bytes += states.footprint();
        return bytes;
    }

private:
    static constexpr int slot_bits = 32;
    static constexpr Index slot_mask = (Index{1} << slot_bits) - 1;

    [[nodiscard]] static Index slot(Index id) noexcept { return id & slot_mask; }
    [[nodiscard]] static Index generation(Index id) noexcept { return id < 0 ? 0 : id >> slot_bits; }

    /// A recurrent layer's sequence as read from a snapshot, not yet installed.
    using LoadedState = std::conditional_t<hybrid, M, char>;

    std::size_t checked_layer(const char* function, Index l) const {
        detail::require(l >= 0 && l < layers(), function, "layer", "is ", l, ", expected 0 to ", layers() - 1);
        return static_cast<std::size_t>(l);
    }
    /// Softmax layer l's index in pools_.
    std::size_t kv_index(const char* function, Index l) const {
        const Index at = at_[checked_layer(function, l)];
        detail::require(at >= 0, function, "layer", "is ", l, ", a recurrent layer (its pool: states(", l, "))");
        return static_cast<std::size_t>(at);
    }
    /// Recurrent layer l's index in states_.
    std::size_t state_index(const char* function, Index l) const {
        const Index at = at_[checked_layer(function, l)];
        detail::require(at < 0, function, "layer", "is ", l, ", a softmax layer (its pool: layer(", l, "))");
        return static_cast<std::size_t>(-1 - at);
    }
    /// Whether slot s is live (in every layer: they take the same calls).
    [[nodiscard]] bool live(Index s) const noexcept {
        if constexpr (hybrid)
            if (pools_.empty())
                return states_.front().contains(s);
        return pools_.front().contains(s);
    }
    /// The tokens of live slot s (the same in every layer between steps).
    [[nodiscard]] Index front_length(Index s) const {
        if constexpr (hybrid)
            if (pools_.empty())  // the drafts counted, as a softmax layer's pool counts them
                return states_.front().length(s) + states_.front().pending_drafts(s);
        return pools_.front().length(s);
    }
    /// Layer l's pending drafts of live slot s.
    [[nodiscard]] Index layer_drafts(Index l, Index s) const {
        const Index at = at_[static_cast<std::size_t>(l)];
        if (at >= 0)
            return pools_[static_cast<std::size_t>(at)].pending_drafts(s);
        if constexpr (hybrid)
            return states_[static_cast<std::size_t>(-1 - at)].pending_drafts(s);
        return 0;
    }
    /// With recurrent layers, refuses a call on slot s (id `id`) that needs its pending
    /// drafts accepted or rejected first.
    void check_no_drafts(const char* function, const char* argument, Index id, Index s, const char* what) const {
        if constexpr (hybrid)
            if (!states_.empty())
                for (Index l = 0; l < layers(); ++l) {
                    const Index drafts = layer_drafts(l, s);
                    if (drafts > 0) [[unlikely]]
                        detail::require(false, function, argument, "is ", id, ", which has ", drafts,
                                        " pending drafts (layer ", l, "): accept or reject them before it is ", what,
                                        " (a recurrent layer's state cannot take a tree's drafts as tokens)");
                }
    }
    /// Whether every layer can take slot s back to `tokens`.
    [[nodiscard]] bool restorable(Index s, Index tokens) const noexcept {
        for (const Pool& pool : pools_)
            if (!pool.can_truncate(s, tokens))
                return false;
        if constexpr (hybrid)
            for (const States& states : states_)
                if (!states.can_truncate(s, tokens))
                    return false;
        return true;
    }
    /// Every layer of slot s back to `tokens` (rollback's), which each can take (checked).
    void truncate_slot(Index s, Index tokens) {
        for (Pool& pool : pools_)
            if (pool.length(s) != tokens)
                pool.truncate(s, tokens);
        if constexpr (hybrid)
            for (States& states : states_)  // each, even at its length: its pending drafts dropped
                states.truncate(s, tokens);
    }
    /// Slot s removed from every layer.
    void remove_slot(Index s) {
        for (Pool& pool : pools_)
            pool.remove(s);
        if constexpr (hybrid)
            for (States& states : states_)
                states.remove(s);
    }

    /// The slot of a live id, or std::invalid_argument saying why not (removed, never
    /// given, a pool's id).
    Index slot_of(const char* function, const char* argument, Index id) const {
        if (contains(id)) [[likely]]
            return slot(id);
        const Index s = slot(id), g = generation(id);
        if (g == 0)
            detail::require(false, function, argument, "is ", id,
                            ", which is not a ModelCache id (a pool's slot? ModelCache ids come from add_sequence "
                            "and fork)");
        if (s < static_cast<Index>(generations_.size()) && g < generations_[static_cast<std::size_t>(s)])
            detail::require(false, function, argument, "is ", id, ": sequence ", id, " was removed");
        detail::require(false, function, argument, "is ", id, ", which this cache never gave");
        return -1;
    }

    /// Runs `make` (add_sequence or fork) on every softmax layer and `make_state` (add or
    /// fork) on every recurrent one, all or nothing; the new id.
    template <class Make, class MakeState>
    Index in_every_layer(const char* function, Make&& make, MakeState&& make_state) {
        if (sequences() >= capacity_) [[unlikely]]
            throw PoolExhausted(std::string(function) + " (the cache's capacity: every sequence is live; a "
                                                        "sequence counts as one block)",
                                1, 0, capacity_);
        std::size_t done = 0, states_done = 0;
        Index s = -1;
        try {
            if constexpr (hybrid)  // first: a full StatePool refuses before any block is taken
                for (; states_done < states_.size(); ++states_done) {
                    const Index got = make_state(states_[states_done]);
                    MEMATTN_DASSERT(states_done == 0 || got == s);  // every layer took the same calls
                    s = got;
                }
            for (; done < pools_.size(); ++done) {
                const Index got = make(pools_[done]);
                MEMATTN_DASSERT((done == 0 && states_done == 0) || got == s);
                s = got;
            }
            detail::require(s <= slot_mask, "ModelCache", "sequences", "would need slot ", s, ", past ", slot_mask);
            if (s >= static_cast<Index>(generations_.size()))
                generations_.resize(static_cast<std::size_t>(s) + 1, 1);
        } catch (...) {
            for (std::size_t l = 0; l < done; ++l)
                pools_[l].remove(s);
            if constexpr (hybrid)
                for (std::size_t l = 0; l < states_done; ++l)
                    states_[l].remove(s);
            throw;
        }
        return (generations_[static_cast<std::size_t>(s)] << slot_bits) | s;
    }

    /// The step's slots and lengths before it, every id live and distinct.
    void fill_step(const char* function, std::span<const Index> ids, bool decode) {
        step_.slots_.resize(ids.size());
        step_.before_.resize(ids.size());
        for (std::size_t i = 0; i < ids.size(); ++i) {
            const Index s = slot_of(function, "ids", ids[i]);
            for (std::size_t j = 0; j < i; ++j)
                detail::require(step_.slots_[j] != s, function, "ids", "names sequence ", ids[i], " twice (at ", j,
                                " and ", i, ")");
            check_no_drafts(function, "ids", ids[i], s, "planned");
            step_.slots_[i] = s;
            step_.before_[i] = front_length(s);
        }
        step_.decode_ = decode;
    }

    /// Every layer that has not run the planned step has the free blocks its tokens need
    /// (no step planned: nothing to hold); `held`: the call is not the plan, whose blocks
    /// it would take.
    void admit(const char* function, bool held) const {
        if (!planned_)
            return;
        for (std::size_t l = 0; l < at_.size(); ++l) {
            if (ran_[l] || at_[l] < 0)  // a recurrent layer's states take no blocks
                continue;
            const Pool& pool = pools_[static_cast<std::size_t>(at_[l])];
            const Index needed = pool.blocks_needed(step_.slots_, tokens_);
            if (needed > pool.free_blocks())
                throw PoolExhausted(std::string(function) + " (layer " + std::to_string(l) +
                                        (held ? ": the planned step holds blocks)" : ")"),
                                    needed, pool.free_blocks(), pool.blocks());
        }
    }
    /// The step just filled becomes the plan, holding its blocks, or, refused, none is.
    const Step& admit_plan(const char* function) {
        removed_.reserve(step_.slots_.size());  // (before anything changes: it may throw)
        planned_ = true;
        std::fill(ran_.begin(), ran_.end(), char{0});
        try {
            admit(function, false);
        } catch (...) {
            planned_ = false;
            throw;
        }
        step_.serial_ = ++serial_;
        return step_;
    }
    /// Whether slot s is in the planned step.
    [[nodiscard]] bool in_step(Index s) const noexcept {
        return planned_ && std::find(step_.slots_.begin(), step_.slots_.end(), s) != step_.slots_.end();
    }
    /// Whether the planned step has run in some layers and not in others.
    [[nodiscard]] bool mid_step() const noexcept {
        return planned_ && std::find(ran_.begin(), ran_.end(), char{1}) != ran_.end();
    }
    /// Refuses a change to slot s (id `id`) while its step is half run.
    void check_not_mid_step(const char* function, const char* argument, Index id, Index s) const {
        if (mid_step() && in_step(s))
            detail::require(false, function, argument, "is ", id,
                            ", a sequence of the step that has run in some layers and not in others: run it in "
                            "every layer or rollback(step) first");
    }
    /// Refuses a new plan while the last one is half run; else the last plan ends (a
    /// refused plan leaves none).
    void begin_plan(const char* function) {
        if (mid_step())
            detail::require(false, function, "ids", "cannot be planned: the step planned before has run in ",
                            std::count(ran_.begin(), ran_.end(), char{1}), " of ", layers(),
                            " layers; run it in the rest or rollback(step) first");
        planned_ = false;
    }
    /// A change to slot s ends the step it is in.
    void end_step_of(Index s) noexcept {
        if (in_step(s)) {
            planned_ = false;
            free_removed();
        }
    }
    /// Layer l's index, where `step` is the latest plan and l has not run it.
    std::size_t runnable(const char* function, Index l, const Step& step) const {
        const std::size_t at = checked_layer(function, l);
        detail::require(planned_ && step.serial_ == serial_, function, "step",
                        "is not the latest plan of this cache, or has ended (run in every layer, taken back, or "
                        "ended by a change to one of its sequences): plan anew");
        detail::require(!ran_[at], function, "step", "has run in layer ", l, " already");
        return at;
    }
    /// A layer's run of the planned step is of the same kind as the layers' that ran it
    /// (with the same parents, or none); the step's first layer's is kept.
    void check_kind(const char* function, bool verify, std::span<const Index> parents) {
        if (!mid_step()) {
            step_verify_ = verify;
            step_parents_.assign(parents.begin(), parents.end());
            return;
        }
        if (step_verify_ != verify)
            detail::require(false, function, "parents",
                            verify ? "are given, but the step's earlier layers ran it without: a step is a verify step "
                                     "in every layer or in none"
                                   : "are not given, but the step's earlier layers ran it as a verify step: give "
                                     "every layer the same parents");
        detail::require(!verify || std::equal(parents.begin(), parents.end(), step_parents_.begin(),
                                              step_parents_.end()),
                        function, "parents", "differ from those the step's earlier layers ran with (",
                        step_parents_.size(), " entries): every layer verifies the same trees");
    }
    /// Layer `at` has run the step; after the last, the step has ended (the slots of its
    /// sequences removed meanwhile are freed).
    void ran(std::size_t at) noexcept {
        ran_[at] = 1;
        if (std::find(ran_.begin(), ran_.end(), char{0}) == ran_.end()) {
            planned_ = false;
            free_removed();
        }
    }
    /// Whether slot s belongs to a sequence removed while its step ran (its slot kept
    /// until the step ends).
    [[nodiscard]] bool removing(Index s) const noexcept {
        return std::find(removed_.begin(), removed_.end(), s) != removed_.end();
    }
    /// The slots of the step's sequences removed while it ran, freed in every layer.
    void free_removed() noexcept {
        for (const Index s : removed_)
            remove_slot(s);
        removed_.clear();
    }

    std::vector<Pool> pools_;         // the softmax layers', in order
    std::vector<States> states_;      // the recurrent layers', in order
    std::vector<Index> at_;           // per layer: its index in pools_, or −1 − its index in states_
    std::vector<Index> targets_;      // rollback's lengths per member
    std::vector<Index> step_parents_;  // the planned step's parents, as its first layer ran it
    std::vector<Index> removed_;       // slots of the step's sequences removed while it ran
    bool step_verify_ = false;         // whether its first layer ran it as a verify step
    Index capacity_ = max_length;     // live sequences at most (hybrid: the constructor's)
    std::vector<Index> generations_;  // per slot: the generation of its live (or next) sequence
    Step step_;
    std::vector<Index> tokens_;             // the planned step's tokens per sequence
    std::vector<char> ran_;                 // per layer: whether it has run the planned step
    std::uint64_t serial_ = 0;              // plans made
    bool planned_ = false;                  // a step is planned that some layer has not run
};

}  // namespace memattn
