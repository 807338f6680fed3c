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
// All or nothing: add_sequence, fork, truncate and remove act on every layer or on none
// (truncate checks can_truncate in every layer first; add and fork take back what an
// allocation that failed part way had made). A step planned by plan() has each layer's
// blocks counted against its free ones (PagedKVCache::blocks_needed), so while no other
// call takes blocks between the plan and the step's last layer, no layer's step throws
// PoolExhausted: a model's step does not stop half way for want of blocks. rollback(step)
// takes a step's tokens back from every layer that took them.

#include "memattn/execution/executor.hpp"
#include "memattn/kernels/softmax_options.hpp"
#include "memattn/layer/head_layout.hpp"
#include "memattn/serving/batched.hpp"
#include "memattn/serving/paged_kv_cache.hpp"
#include "memattn/types.hpp"

#include <cstdint>
#include <span>
#include <string>
#include <utility>
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

/// One PagedKVCache per layer of a model under one id space; see the top of the file.
template <Scalar T, class S = T>
class ModelCache {
public:
    using Pool = PagedKVCache<T, S>;  ///< one layer's pool

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
        bool decode_ = false;
    };

    /// The layers' pools, built now (each allocates its blocks).
    explicit ModelCache(std::span<const ModelLayer> layers) {
        detail::require(!layers.empty(), "ModelCache", "layers", "is empty, expected one layer or more");
        pools_.reserve(layers.size());
        for (const ModelLayer& l : layers)
            pools_.emplace_back(l.layout, l.blocks, l.block_size, l.options, l.pool);
    }

    /// Layers of the model.
    [[nodiscard]] Index layers() const noexcept { return static_cast<Index>(pools_.size()); }
    /// Layer l's pool, for its batched calls (with step.slots()) and its counts.
    [[nodiscard]] Pool& layer(Index l) { return pools_[checked_layer("ModelCache::layer", l)]; }
    /// The same, read only.
    [[nodiscard]] const Pool& layer(Index l) const { return pools_[checked_layer("ModelCache::layer", l)]; }

    /// A new, empty sequence in every layer; returns its id.
    Index add_sequence() {
        return in_every_layer([](Pool& pool) { return pool.add_sequence(); });
    }
    /// A new sequence holding `parent`'s tokens in every layer, sharing its blocks.
    Index fork(Index parent) {
        const Index from = slot_of("ModelCache::fork", "parent", parent);
        return in_every_layer([from](Pool& pool) { return pool.fork(from); });
    }
    /// Keeps the first `tokens` tokens of `id` in every layer (a rollback), or, when a
    /// windowed layer has freed tokens a sequence of that length needs, throws
    /// std::invalid_argument naming the layer with every layer unchanged.
    void truncate(Index id, Index tokens) {
        constexpr const char* function = "ModelCache::truncate";
        const Index slot = slot_of(function, "id", id);
        for (Index l = 0; l < layers(); ++l)
            detail::require(pools_[static_cast<std::size_t>(l)].can_truncate(slot, tokens), function, "tokens", "is ",
                            tokens, ", which layer ", l, " cannot take sequence ", id, " back to (length ",
                            pools_[static_cast<std::size_t>(l)].length(slot),
                            ", its window has freed what that length needs, or more than its length)");
        for (Pool& pool : pools_)
            pool.truncate(slot, tokens);
    }
    /// Whether truncate(id, tokens) would succeed.
    [[nodiscard]] bool can_truncate(Index id, Index tokens) const noexcept {
        if (!contains(id))
            return false;
        for (const Pool& pool : pools_)
            if (!pool.can_truncate(slot(id), tokens))
                return false;
        return true;
    }
    /// Ends `id` in every layer; the id is refused from now on.
    void remove(Index id) {
        const Index slot = slot_of("ModelCache::remove", "id", id);
        for (Pool& pool : pools_)
            pool.remove(slot);
        ++generations_[static_cast<std::size_t>(slot)];
    }

    /// True when `id` names a live sequence.
    [[nodiscard]] bool contains(Index id) const noexcept {
        const Index s = slot(id), g = generation(id);
        return g > 0 && s < static_cast<Index>(generations_.size()) && generations_[static_cast<std::size_t>(s)] == g &&
               pools_.front().contains(s);
    }
    /// Tokens of `id` (the same in every layer).
    [[nodiscard]] Index length(Index id) const { return pools_.front().length(slot_of("ModelCache::length", "id", id)); }
    /// Live sequences.
    [[nodiscard]] Index sequences() const noexcept { return pools_.front().sequences(); }
    /// The id of `id`'s sequence in every layer's pool.
    [[nodiscard]] Index slot_of(Index id) const { return slot_of("ModelCache::slot_of", "id", id); }

    /// Plans a mixed batch: sequence ids[i] brings the rows [q_offsets[i], q_offsets[i +
    /// 1]) of every layer's Q, K and V. Checks that every id is live and distinct and that
    /// every layer has the blocks the batch needs (PoolExhausted naming the layer
    /// otherwise), then returns the step every layer's prefill takes (kept by the cache
    /// until the next plan: a step allocates nothing once one of its size has run).
    const Step& plan(std::span<const Index> ids, std::span<const Index> q_offsets) {
        constexpr const char* function = "ModelCache::plan";
        detail::check_offsets(function, q_offsets, static_cast<Index>(ids.size()),
                              q_offsets.empty() ? 0 : q_offsets.back());
        fill_step(function, ids, false);
        step_.offsets_.assign(q_offsets.begin(), q_offsets.end());
        tokens_.resize(ids.size());
        for (std::size_t i = 0; i < ids.size(); ++i)
            tokens_[i] = q_offsets[i + 1] - q_offsets[i];
        admit(function);
        return step_;
    }
    /// Plans a decode step: one token for each sequence of `ids`.
    const Step& plan_decode(std::span<const Index> ids) {
        constexpr const char* function = "ModelCache::plan_decode";
        fill_step(function, ids, true);
        step_.offsets_.resize(ids.size() + 1);
        tokens_.assign(ids.size(), 1);
        for (std::size_t i = 0; i <= ids.size(); ++i)
            step_.offsets_[i] = static_cast<Index>(i);
        admit(function);
        return step_;
    }

    /// Layer l's decode step of `step` (plan_decode): batched_decode on its pool.
    template <class DQ, class DK, class DV, detail::EigenMatrix DO>
    void decode(Index l, const Step& step, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                const Eigen::MatrixBase<DV>& V, DO&& O) {
        Pool& pool = pools_[checked_layer("ModelCache::decode", l)];
        batched_decode(pool, step.slots(), Q, K, V, std::forward<DO>(O), pool.executor());
    }
    /// Layer l's step of `step` (plan or plan_decode): batched_prefill on its pool.
    template <class DQ, class DK, class DV, detail::EigenMatrix DO>
    void prefill(Index l, const Step& step, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                 const Eigen::MatrixBase<DV>& V, DO&& O) {
        Pool& pool = pools_[checked_layer("ModelCache::prefill", l)];
        batched_prefill(pool, step.slots(), step.q_offsets(), Q, K, V, std::forward<DO>(O), pool.executor());
    }

    /// Takes the tokens of `step` back from every layer that took them (a layer that
    /// threw, or was not reached, has none to give back), all or nothing: where a windowed
    /// layer has already freed what the shorter sequence needs, throws std::invalid_argument
    /// naming the layer and changes nothing.
    void rollback(const Step& step) {
        constexpr const char* function = "ModelCache::rollback";
        const auto slots = step.slots();
        for (Index l = 0; l < layers(); ++l)
            for (std::size_t i = 0; i < slots.size(); ++i) {
                const Pool& pool = pools_[static_cast<std::size_t>(l)];
                detail::require(pool.contains(slots[i]), function, "step", "names slot ", slots[i],
                                ", which is no longer a live sequence");
                const Index before = step.before_[i];
                detail::require(pool.length(slots[i]) == before || pool.can_truncate(slots[i], before), function,
                                "step", "cannot be taken back in layer ", l, ": its window has freed tokens slot ",
                                slots[i], " of length ", before, " needs");
            }
        for (Pool& pool : pools_)
            for (std::size_t i = 0; i < slots.size(); ++i)
                if (pool.length(slots[i]) > step.before_[i])
                    pool.truncate(slots[i], step.before_[i]);
    }

    /// Bytes of every layer's pool.
    [[nodiscard]] std::size_t footprint() const noexcept {
        std::size_t bytes = 0;
        for (const Pool& pool : pools_)
            bytes += pool.footprint();
        return bytes;
    }

private:
    static constexpr int slot_bits = 32;
    static constexpr Index slot_mask = (Index{1} << slot_bits) - 1;

    [[nodiscard]] static Index slot(Index id) noexcept { return id & slot_mask; }
    [[nodiscard]] static Index generation(Index id) noexcept { return id < 0 ? 0 : id >> slot_bits; }

    std::size_t checked_layer(const char* function, Index l) const {
        detail::require(l >= 0 && l < layers(), function, "layer", "is ", l, ", expected 0 to ", layers() - 1);
        return static_cast<std::size_t>(l);
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

    /// Runs `make` (add_sequence or fork) on every layer, all or nothing; the new id.
    template <class Make>
    Index in_every_layer(Make&& make) {
        std::size_t done = 0;
        Index s = -1;
        try {
            for (; done < pools_.size(); ++done) {
                const Index got = make(pools_[done]);
                MEMATTN_DASSERT(done == 0 || got == s);  // every layer took the same calls
                s = got;
            }
            detail::require(s <= slot_mask, "ModelCache", "sequences", "would need slot ", s, ", past ", slot_mask);
            if (s >= static_cast<Index>(generations_.size()))
                generations_.resize(static_cast<std::size_t>(s) + 1, 1);
        } catch (...) {
            for (std::size_t l = 0; l < done; ++l)
                pools_[l].remove(s);
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
            step_.slots_[i] = s;
            step_.before_[i] = pools_.front().length(s);
        }
        step_.decode_ = decode;
    }

    /// Every layer has the free blocks the step's tokens need.
    void admit(const char* function) const {
        for (Index l = 0; l < layers(); ++l) {
            const Pool& pool = pools_[static_cast<std::size_t>(l)];
            const Index needed = pool.blocks_needed(step_.slots_, tokens_);
            if (needed > pool.free_blocks())
                throw PoolExhausted(std::string(function) + " (layer " + std::to_string(l) + ")", needed,
                                    pool.free_blocks(), pool.blocks());
        }
    }

    std::vector<Pool> pools_;
    std::vector<Index> generations_;  // per slot: the generation of its live (or next) sequence
    Step step_;
    std::vector<Index> tokens_;
};

}  // namespace memattn
