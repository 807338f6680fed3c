#pragma once
// HybridCache: a local window of the last `window` raw pairs, and up to `slots`
// compressed pairs summarising what fell out of it, in the manner of the Compressive
// Transformer (Rae et al. 2020). A pair evicted from the window is absorbed into the
// newest open compressed slot; a slot closes after `rate` pairs; when a new slot opens
// and `slots` exist already, the oldest is dropped (FIFO). `attend` is one softmax
// over compressed ∪ local, through the shared online-softmax state.
//
//   HybridCache<float> cache(64, 64, /*window=*/512, /*rate=*/4, /*slots=*/256);
//   HybridCache<float, MaxPool> peaks(64, 64, 512, 4, 256);
//   HybridCache<float, WeightedPool> learned(64, 64, 512, 4, 256, 0.f, WeightedPool({.1, .2, .3, .4}));
//
// Laws: slots == 0 is SlidingWindowCache(window); rate == 1 is
// SlidingWindowCache(window + slots) for a compressor that keeps a slot's single row
// as it is (MeanPool, MaxPool; WeightedPool only with w_0 = 1).
//
// State, all derived from length L: the window holds tokens [E, L) with
// E = max(0, L − window) evicted so far; evicted token e went to slot e / rate at
// position e % rate; slots [max(0, S − slots), S) with S = ⌈E / rate⌉ are kept, slot g
// in row g % slots of a ring. Both rings are allocated at construction.

#include "memattn/kernels/decode_attention.hpp"
#include "memattn/memory/compressor.hpp"
#include "memattn/memory/concept.hpp"
#include "memattn/memory/detail/low_precision.hpp"
#include "memattn/memory/detail/held_logits.hpp"
#include "memattn/memory/detail/held_rope.hpp"
#include "memattn/memory/detail/memory_checks.hpp"
#include "memattn/memory/detail/pair_ring.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/softmax_state.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

namespace memattn {

/// A local window of the last `window` raw pairs and up to `slots` compressed pairs
/// summarising what fell out of it, one softmax over both; see the top of the file.
/// \tparam C the compressor that pools `rate` evicted pairs into a slot (memory/compressor.hpp).
/// \tparam S how the window's pairs are stored, T itself or a compact type (storage/compact.hpp);
/// the compressed slots stay in T, since the compressor pools into them in place.
template <class T, class C = MeanPool, class S = T>
    requires(StorageFor<S, T> || (LowPrecision<T> && StorageFor<S, float>)) && detail::PlainKeys<S>  // a slot pools keys (in float); the rotation is the window's
class HybridCache {
    static_assert(Compressor<C, T>,
                  "HybridCache<T, C>: C must be a compressor, a copyable struct with a const member "
                  "absorb(memattn::RowRef<T> slot, memattn::ConstRowRef<T> row, memattn::Index position) that folds "
                  "the row at `position` of a slot into `slot` (setting it from the row alone at position 0); "
                  "see memattn/memory/compressor.hpp.");

public:
    using Scalar = T;          ///< float or double: the rows' scalar and the arithmetic's
    using CompressorType = C;  ///< how evicted pairs are pooled into a slot
    using StorageType = S;     ///< how the window's pairs are stored
    /// The storage type code snapshots record for S (docs/snapshot-format.md).
    static constexpr snapshot::TypeCode snapshot_storage = detail::storage_code<T, S>();

    /// `window` >= 1 raw pairs, `rate` >= 1 pairs per compressed slot, `slots` >= 0
    /// compressed slots; `scale` 0 means 1/sqrt(key_dim).
    HybridCache(Index key_dim, Index value_dim, Index window, Index rate, Index slots, T scale = T(0),
                C compressor = C{})
        : key_dim_(detail::at_least(key_dim, 1, "HybridCache", "key_dim")),
          value_dim_(detail::at_least(value_dim, 1, "HybridCache", "value_dim")),
          window_(detail::at_least(window, 1, "HybridCache", "window")),
          rate_(detail::at_least(rate, 1, "HybridCache", "rate")),
          slots_(detail::at_least(slots, 0, "HybridCache", "slots")),
          scale_(detail::checked_scale(scale, key_dim, "HybridCache")),
          compressor_(std::move(compressor)),
          local_(window, key_dim, value_dim),
          compressed_(slots, key_dim, value_dim),
          key_row_(compact ? key_dim : 0),
          value_row_(compact ? value_dim : 0),
          key_stored_(compact ? 1 : 0, key_dim),
          value_stored_(compact ? 1 : 0, value_dim) {
        if constexpr (detail::LimitsRate<C>)
            detail::require(rate <= compressor_.max_rate(), "HybridCache", "rate", "is ", rate,
                            ", expected <= ", compressor_.max_rate(), " (the compressor's max_rate)");
        if constexpr (detail::HasWeights<C>)
            for (const double weight : compressor_.weights())
                detail::require(detail::finite_in<T>(weight), "HybridCache", "compressor", "has weight ", weight,
                                ", expected weights finite as ", detail::scalar_name<T>);
    }

    /// With the logit options (see KVCache's constructor): `options.scale` as `scale`, the
    /// softcap and the sink logits, copied. ALiBi slopes only without compressed slots
    /// (`slots` = 0): a slot pools many positions, so it has no distance to the query.
    HybridCache(Index key_dim, Index value_dim, Index window, Index rate, Index slots, const SoftmaxOptions& options,
                C compressor = C{})
        : HybridCache(key_dim, value_dim, window, rate, slots, static_cast<T>(options.scale), std::move(compressor)) {
        detail::require(options.alibi_slopes.empty() || slots_ == 0, "HybridCache", "options.alibi_slopes",
                        "is given with slots = ", slots_,
                        ": a compressed slot pools many positions, so ALiBi has no distance for it");
        logits_ = detail::HeldLogits("HybridCache", options, std::type_identity<T>{});
    }

    /// With the options and rotary position embeddings (see KVCache's): the window's keys
    /// stored turned to their positions, queries turned at each attend. `positions`
    /// (RopePositions): in the sequence, a slot pools the keys as the window held them
    /// (each turned to its own position); in the cache (StreamingLLM's rule), the kept
    /// slots are places 0, 1, ... before the window: slot g pools its keys turned to
    /// position g, and attend turns the query for the slots to its own place in the
    /// cache plus the first kept slot's number (memory/detail/held_rope.hpp), so the
    /// slots move with the cache and nothing stored is turned again.
    HybridCache(Index key_dim, Index value_dim, Index window, Index rate, Index slots, const SoftmaxOptions& options,
                const Rope& rope, RopePositions positions = RopePositions::sequence, C compressor = C{})
        : HybridCache(key_dim, value_dim, window, rate, slots, options, std::move(compressor)) {
        rope_ = detail::HeldRope("HybridCache", rope, key_dim_, positions);
        turned_.resize(key_dim_);
        slot_key_.resize(key_dim_);
    }

    /// Stores one pair; the pair it pushes out of the window goes into a compressed slot.
    void update(ConstRowRef<T> key, ConstRowRef<T> value) {
        validate(key, value, {"HybridCache::update", "key", "value"});
        if (length_ >= window_)
            compress_held(length_ - window_);
        put(length_, key, value);
        ++length_;
    }

    /// Stores many pairs: compresses only evicted pairs whose slot survives, copies
    /// only the pairs that end in the window.
    void extend(ConstMatrixRef<T> keys, ConstMatrixRef<T> values) {
        validate(keys, values, {"HybridCache::extend"});
        const Index end = length_ + keys.rows();
        const Index evicted_before = evicted(length_), evicted_after = evicted(end);
        if (slots_ > 0) {
            // (count − slots) · rate ≤ (count − 1) · rate < evicted: no overflow for any rate.
            const Index first_kept = std::max<Index>(0, slot_count(evicted_after) - slots_) * rate_;
            for (Index e = std::max(evicted_before, first_kept); e < evicted_after; ++e) {
                if (e < length_)
                    compress_held(e);
                else
                    compress_input(e, keys.row(e - length_), values.row(e - length_));
            }
        }
        const Index first = std::max(length_, end - window_);
        if (rope_.on()) {  // row by row through the turned row: no allocation
            for (Index p = first; p < end; ++p)
                put(p, keys.row(p - length_), values.row(p - length_));
        } else {
            local_.put_rows(first, keys.middleRows(first - length_, end - first),
                            values.middleRows(first - length_, end - first));
        }
        length_ = end;
    }

    /// Throws what update/extend would throw for these pairs, changing nothing:
    /// std::invalid_argument for a shape, or for a finite value S would store as ±∞ or
    /// NaN; std::length_error past memattn::max_length. `site` names the caller (a layer's
    /// check of one head's part of its packed rows, see KVCache::validate).
    void validate(ConstMatrixRef<T> keys, ConstMatrixRef<T> values,
                  const detail::PairSite& site = {"HybridCache::validate"}) const {
        detail::check_site_pairs(site, detail::shape(keys), detail::shape(values), key_dim_, value_dim_, length_);
        detail::check_storable<T, S>(site, keys, false);
        detail::check_storable<T, S>(site, values, true);
        rope_.check_turnable<T, S>(site, keys);
    }

    /// out = Σ_j softmax_j(scale · q·k_j) v_j over the kept compressed slots and the
    /// window; zero when empty. With logit options, the query is at position length() − 1.
    void attend(ConstRowRef<T> query, RowRef<T> out) const {
        detail::check_query("HybridCache::attend", query, out, key_dim_, value_dim_);
        if (logits_.any() || rope_.on()) {
            logits_.check_rows("HybridCache::attend", "query", 1);
            detail::attend_memory_one<T>(*this, query, out);
            return;
        }
        SoftmaxState<T> state;
        out.setZero();
        const Index e = evicted(length_), s = slot_count(e);
        if (slots_ > 0)
            compressed_.attend(query, first_slot(s), s, scale_, state, out);
        local_.attend(query, e, length_, scale_, state, out);
        state.finish(out);
    }

    /// Row r of `out` = attend(row r of `queries`), to rounding, for g queries at once:
    /// the pairs are read once for the group (grouped-query attention), the logits and
    /// the weighted values are small GEMMs instead of g GEMVs. Allocates nothing (but with
    /// RoPE for a head dim past 256).
    void attend_group(ConstMatrixRef<T> queries, MatrixRef<T> out) const {
        detail::check_group_query("HybridCache::attend_group", queries, out, key_dim_, value_dim_);
        logits_.check_rows("HybridCache::attend_group", "queries", queries.rows());
        detail::attend_memory_group<T>(*this, queries, out);
    }

    /// The token position of the i-th pair attend reads (for_each_stored_run's order):
    /// a kept slot's first token's, then the window's tokens (ALiBi reads it only
    /// without slots).
    [[nodiscard]] Index pair_position(Index i) const noexcept {
        const Index e = evicted(length_), kept = kept_slots();
        return i < kept ? (first_slot(slot_count(e)) + i) * rate_ : e + (i - kept);
    }
    /// Whether the keys are stored turned by RoPE, so attends turn their queries.
    [[nodiscard]] bool turns_queries() const noexcept { return rope_.on(); }
    /// The position an attend turns its query to for the i-th pair: the newest token's,
    /// or, with RopePositions::cache, for a slot S + (window pairs held) − 1, S the slots
    /// opened (see the constructor).
    [[nodiscard]] Index query_position(Index i) const noexcept {
        const Index e = evicted(length_);
        if (rope_.in_cache() && i < kept_slots())
            return slot_count(e) + (length_ - e) - 1;
        return length_ - 1;
    }
    /// Turns the heads of a packed query row (`cols`: a multiple of key_dim) to position p
    /// in place, as attend does.
    void turn_query(T* row, Index cols, Index p) const noexcept { rope_.turn(row, cols, p); }
    /// Its RoPE configuration, or nullptr.
    [[nodiscard]] const Rope* rope() const noexcept { return rope_.rope(); }
    /// Where its RoPE places the kept tokens.
    [[nodiscard]] RopePositions rope_positions() const noexcept { return rope_.positions(); }
    /// The options its attends follow: the scale and the logit options (the spans view
    /// the cache's own copies; see KVCache::options).
    [[nodiscard]] SoftmaxOptions options() const noexcept {
        return logits_.into({.scale = static_cast<double>(scale_)});
    }

    /// Calls f(keys, values, first, n) for each contiguous run of the stored pairs `attend`
    /// reads, in order (the kept compressed slots, in T, then the window, in S).
    template <class F>
    void for_each_stored_run(F&& f) const {
        const Index e = evicted(length_), s = slot_count(e);
        if (slots_ > 0)
            compressed_.for_each_stored(first_slot(s), s, f);
        local_.for_each_stored(e, length_, f);
    }

    /// Calls f(keys, values) for each contiguous run of the pairs `attend` reads, in the
    /// order it reads them, as read-only row blocks: how a caller splits one attend
    /// across threads and merges the parts (MultiHead reads for_each_stored_run through
    /// detail::MemoryAttention instead). With logit options or RoPE the parts' logits
    /// are not scale·q·k: use attend_group, or MemoryAttention.
    template <class F>
        requires std::same_as<S, T>
    void for_each_run(F&& f) const {
        const Index e = evicted(length_), s = slot_count(e);
        if (slots_ > 0)
            compressed_.for_each_block(first_slot(s), s, f);
        local_.for_each_block(e, length_, f);
    }

    /// Tokens seen since reset.
    [[nodiscard]] Index length() const noexcept { return length_; }
    /// The most pairs attend reads: the kept compressed slots and the window.
    [[nodiscard]] Index pair_capacity() const noexcept { return slots_ + window_; }
    /// Bytes of the pairs held now (raw and compressed); constant once both are full.
    [[nodiscard]] std::size_t footprint() const noexcept {
        const Index e = evicted(length_), s = slot_count(e);
        return local_.bytes(length_ - e) + compressed_.bytes(s - first_slot(s));
    }
    /// Bytes allocated at construction: window + slots pairs.
    [[nodiscard]] std::size_t capacity() const noexcept { return local_.bytes(window_) + compressed_.bytes(slots_); }
    /// Forgets every pair and slot and keeps the allocation.
    void reset() noexcept { length_ = 0; }

    /// The key width d.
    [[nodiscard]] Index key_dim() const noexcept { return key_dim_; }
    /// The value width dv.
    [[nodiscard]] Index value_dim() const noexcept { return value_dim_; }
    /// Raw pairs kept in the local window.
    [[nodiscard]] Index window() const noexcept { return window_; }
    /// Evicted pairs pooled into one compressed slot.
    [[nodiscard]] Index rate() const noexcept { return rate_; }
    /// Compressed slots kept at most (the oldest is dropped first).
    [[nodiscard]] Index slots() const noexcept { return slots_; }
    /// The factor of q·k before the softmax (1/sqrt(key_dim) when built with 0).
    [[nodiscard]] T scale() const noexcept { return scale_; }
    /// The compressor that pools the evicted pairs.
    [[nodiscard]] const C& compressor() const noexcept { return compressor_; }

    /// Snapshots (memattn/persistence/snapshot.hpp), for a compressor that names itself
    /// (detail::NamedForSnapshots; the library's do): key_dim, value_dim, window, rate,
    /// slots, scale, the compressor's name and weights, length, then the window's pairs
    /// and the kept slots (an open slot as pooled so far), oldest first. The logit options
    /// are not recorded (see KVCache); a RoPE configuration follows the scale.
    [[nodiscard]] static std::string snapshot_kind()
        requires detail::NamedForSnapshots<C>
    {
        return "HybridCache/" + std::string(std::string_view(C::snapshot_name));
    }
    /// Snapshots (memattn/persistence/snapshot.hpp): writes the payload, the fields listed at snapshot_kind().
    void write_snapshot(snapshot::Writer& w) const
        requires detail::NamedForSnapshots<C>
    {
        w.index(key_dim_);
        w.index(value_dim_);
        w.index(window_);
        w.index(rate_);
        w.index(slots_);
        w.number(scale_);
        rope_.write(w);
        if constexpr (detail::HasWeights<C>) {
            w.index(static_cast<Index>(compressor_.weights().size()));
            for (const double weight : compressor_.weights())
                w.number(weight);
        }
        w.index(length_);
        const Index e = evicted(length_), s = slot_count(e);
        local_.write_items(w, e, length_);
        compressed_.write_items(w, first_slot(s), s);
    }
    /// Snapshots: reads a payload written by write_snapshot(); throws SnapshotError, the
    /// cache unchanged, unless key_dim, value_dim, window, rate, slots, scale and the
    /// compressor's weights are its own.
    void read_snapshot(snapshot::Reader& r)
        requires detail::NamedForSnapshots<C>
    {
        r.expect("key_dim", key_dim_);
        r.expect("value_dim", value_dim_);
        r.expect("window", window_);
        r.expect("rate", rate_);
        r.expect("slots", slots_);
        r.expect("scale", scale_);
        rope_.read(r);
        if constexpr (detail::HasWeights<C>) {
            r.expect("the compressor's weight count", static_cast<Index>(compressor_.weights().size()));
            for (const double weight : compressor_.weights())
                r.expect("a compressor weight", weight);
        }
        const Index length = r.count("length", 0, max_length);
        const Index e = evicted(length), s = slot_count(e);
        r.expect_remaining(local_.bytes(length - e) + compressed_.bytes(s - first_slot(s)), "the held pairs");
        local_.read_items(r, e, length);
        compressed_.read_items(r, first_slot(s), s);
        length_ = length;
    }

private:
    /// Tokens pushed out of the window after `length` tokens.
    [[nodiscard]] Index evicted(Index length) const noexcept { return std::max<Index>(0, length - window_); }
    /// Slots opened by `evicted` tokens: ⌈evicted / rate⌉ (without evicted + rate − 1,
    /// which overflows for a rate near the largest Index).
    [[nodiscard]] Index slot_count(Index evicted) const noexcept {
        return evicted / rate_ + (evicted % rate_ != 0 ? 1 : 0);
    }
    /// The oldest slot kept when `count` have been opened.
    [[nodiscard]] Index first_slot(Index count) const noexcept { return std::max<Index>(0, count - slots_); }
    /// Slots attend reads now (the first pairs of for_each_stored_run).
    [[nodiscard]] Index kept_slots() const noexcept {
        const Index s = slot_count(evicted(length_));
        return slots_ > 0 ? s - first_slot(s) : 0;
    }

    /// Evicted token e joins slot e / rate at position e % rate; position 0 opens the
    /// slot in the ring row of slot e / rate − slots, which is thereby dropped.
    static constexpr bool compact = detail::StoredRows<T, S>::compact;

    /// Compresses window item e (about to be overwritten), as the window holds it.
    void compress_held(Index e) {
        if constexpr (compact) {
            local_.decode(e, key_row_.data(), value_row_.data());
            compress(e, key_row_, value_row_);
        } else {
            compress(e, local_.key(e), local_.value(e));
        }
    }

    /// Compresses an input pair that is evicted before it is stored, as the window would
    /// have held it (rounded to S), so extend equals updates one by one.
    template <class K, class V>
    void compress_input(Index e, const K& key, const V& value) {
        rope_.with_turned(key, e, turned_, [&](const auto& k) {  // turned to e, as the window would hold it
            if constexpr (compact) {
                detail::round_trip(k, key_stored_, key_row_.data(), key_dim_);
                detail::round_trip(value, value_stored_, value_row_.data(), value_dim_);
                compress(e, key_row_, value_row_);
            } else {
                compress(e, k, value);
            }
        });
    }

    /// Stores the pair of the token at `position` in the window, its key turned with RoPE.
    template <class K, class V>
    void put(Index position, const K& key, const V& value) {
        rope_.with_turned(key, position, turned_, [&](const auto& k) { local_.put(position, k, value); });
    }

    template <class K, class V>
    void compress(Index e, const K& key, const V& value) {
        if (slots_ == 0)
            return;
        const Index slot = e / rate_, position = e % rate_;
        if (rope_.in_cache()) {  // the key as turned to e, turned on to the slot's number
            rope_.with_turned(
                key, slot - e, slot_key_,
                [&](const auto& k) { compressor_.absorb(RowRef<T>(compressed_.key(slot)), ConstRowRef<T>(k), position); },
                false);
        } else {
            compressor_.absorb(RowRef<T>(compressed_.key(slot)), ConstRowRef<T>(key), position);
        }
        compressor_.absorb(RowRef<T>(compressed_.value(slot)), ConstRowRef<T>(value), position);
    }


    Index key_dim_;
    Index value_dim_;
    Index window_;
    Index rate_;
    Index slots_;
    T scale_;
    detail::HeldLogits logits_;
    detail::HeldRope rope_;
    Vector<T> turned_;    ///< a key turned to its position on its way to the window or a slot (RoPE)
    Vector<T> slot_key_;  ///< a key turned to its slot's number (RopePositions::cache)
    C compressor_;
    detail::PairRing<T, S> local_;    ///< item j: token j, the last `window` of them
    detail::PairRing<T> compressed_;  ///< item g: compressed slot g, the last `slots` of them
    Vector<T> key_row_;    ///< a window pair as T on its way to a slot (compact storage only)
    Vector<T> value_row_;
    detail::StoredRows<T, S> key_stored_;    ///< one input row as S on that way (compact storage only)
    detail::StoredRows<T, S> value_stored_;
    Index length_ = 0;
};

/// HybridCache of 16-bit rows (E = Eigen::bfloat16 or Eigen::half): HybridCache<float, C, S>
/// behind members that take and give rows of E (memory/detail/low_precision.hpp). The
/// constructors are HybridCache<float, C, S>'s.
template <LowPrecision E, class C, class S>
    requires StorageFor<S, float> && detail::PlainKeys<S>
class HybridCache<E, C, S> : public detail::LowPrecisionMemory<HybridCache<float, C, S>, E> {
public:
    using detail::LowPrecisionMemory<HybridCache<float, C, S>, E>::LowPrecisionMemory;
};

namespace detail {
template <class C, class S>
inline constexpr std::string_view memory_name<HybridCache<float, C, S>> = "HybridCache";
}  // namespace detail

}  // namespace memattn
