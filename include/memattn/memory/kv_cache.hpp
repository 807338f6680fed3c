#pragma once
// KVCache: every (key, value) pair seen, so `attend` is exact causal softmax attention
// over the whole past. Its cost per token and its footprint grow with the sequence;
// it is the baseline the fixed-size memories are measured against.

#include "memattn/kernels/causal_softmax.hpp"
#include "memattn/kernels/decode_attention.hpp"
#include "memattn/memory/concept.hpp"
#include "memattn/memory/detail/low_precision.hpp"
#include "memattn/memory/detail/held_logits.hpp"
#include "memattn/memory/detail/held_rope.hpp"
#include "memattn/memory/detail/memory_checks.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/softmax_state.hpp"
#include "memattn/storage/compact.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <type_traits>

namespace memattn {

/// Every (key, value) pair seen, so `attend` is exact causal softmax attention over the
/// whole past; see the top of the file.
/// \tparam S how the pairs are stored, T itself or a compact type (storage/compact.hpp:
/// Eigen::bfloat16, Eigen::half, memattn::Q8, memattn::Q4, memattn::Q4Affine, or
/// `memattn::Rotated<S>` of the last three: keys rotated, see there; `memattn::IntegerDot<S>`
/// of those: a query's q·k in integers (a group's too for Q8); `memattn::PerChannelKeys<S>` of Q8, Q4 or
/// Q4Affine: keys quantised per channel over groups of tokens, values as S, see there);
/// arithmetic is in T either way.
template <class T, class S = T>
    requires StorageFor<S, T> || (LowPrecision<T> && StorageFor<S, float>)
class KVCache {
public:
    using Scalar = T;       ///< float or double: the rows' scalar and the arithmetic's
    using StorageType = S;  ///< how the pairs are stored
    /// The storage type code snapshots record for S (docs/snapshot-format.md).
    static constexpr snapshot::TypeCode snapshot_storage = detail::storage_code<T, S>();

    /// `scale` multiplies q·k before the softmax; 0 means 1/sqrt(key_dim).
    KVCache(Index key_dim, Index value_dim, T scale = T(0))
        : key_dim_(detail::at_least(key_dim, 1, "KVCache", "key_dim")),
          value_dim_(detail::at_least(value_dim, 1, "KVCache", "value_dim")),
          scale_(detail::checked_scale(scale, key_dim, "KVCache")),
          keys_(0, key_dim_),
          values_(0, value_dim_) {
        if constexpr (detail::is_rotated<S>) {
            rope_ = detail::HeldRope::rotation(key_dim_);
            turned_.resize(key_dim_);
        }
    }

    /// With the logit options (kernels/softmax_options.hpp): `options.scale` as above, the
    /// softcap, and the ALiBi slopes and sink logits of the queries its attends take
    /// together: one value each for attend and prefill, or one per query head of the
    /// group its attend_group takes (how memattn::MultiHead gives each KV head its group's
    /// values). A window belongs to SlidingWindowCache, and `causal` must be true; both
    /// are refused with std::invalid_argument otherwise. The cache copies the spans.
    KVCache(Index key_dim, Index value_dim, const SoftmaxOptions& options)
        : KVCache(key_dim, value_dim, static_cast<T>(options.scale)) {
        logits_ = detail::HeldLogits("KVCache", options, std::type_identity<T>{}, false, detail::bf16_products<T, S>);
    }

    /// With the options and rotary position embeddings (positional/rope.hpp, for one head:
    /// rope.head_dim = key_dim): each key is stored turned to its position, each query
    /// turned to the newest token's at every attend, so a caller feeds keys and queries
    /// as they come out of the projections (docs/design.md, "RoPE in the memories").
    KVCache(Index key_dim, Index value_dim, const SoftmaxOptions& options, const Rope& rope)
        : KVCache(key_dim, value_dim, options) {
        rope_ = detail::HeldRope("KVCache", rope, key_dim_, RopePositions::sequence, detail::is_rotated<S>);
        turned_.resize(key_dim_);
    }

    /// Appends one pair. Storage grows geometrically (doubling), so n updates cost
    /// O(n) amortised copies; a throwing update leaves the cache unchanged. The pair may
    /// be a view of the cache's own pairs (`update(keys().row(0), values().row(0))`).
    void update(ConstRowRef<T> key, ConstRowRef<T> value) {
        validate(key, value, {"KVCache::update", "key", "value"});
        rope_.with_turned(key, length_, turned_, [&](const auto& k) { append(k, value); });
    }

    /// Appends many pairs with one copy per matrix; they may be views of the cache's own.
    void extend(ConstMatrixRef<T> keys, ConstMatrixRef<T> values) {
        validate(keys, values, {"KVCache::extend"});
        if (rope_.on()) {
            Matrix<T> turned = keys;
            rope_.turn_rows<T>(turned, length_);
            append(turned, values);
            return;
        }
        append(keys, values);
    }

    /// Throws what update/extend would throw for these pairs, changing nothing:
    /// std::invalid_argument for a shape, or for a finite value S would store as ±∞ or
    /// NaN (detail::check_storable); std::length_error past memattn::max_length. A layer
    /// (memattn::MultiHead) checks every head's part of a packed row before any head takes
    /// it; `site` names the caller and where the head's columns begin in its rows.
    void validate(ConstMatrixRef<T> keys, ConstMatrixRef<T> values,
                  const detail::PairSite& site = {"KVCache::validate"}) const {
        detail::check_site_pairs(site, detail::shape(keys), detail::shape(values), key_dim_, value_dim_, length_);
        detail::check_storable<T, S>(site, keys, false);
        detail::check_storable<T, S>(site, values, true);
        rope_.check_turnable<T, S>(site, keys);
    }

    /// Appends the pairs K/V and attends with each row of Q as the token of the same row
    /// of K/V, like `decode`, in one call of the tiled kernel over the whole cache: row
    /// i sees every earlier pair and K/V rows 0..i (causal_softmax_attention, window 0,
    /// with the queries offset to the end of the cache). `out` must not overlap the
    /// inputs; the inputs may be views of the cache's own pairs. Throws, unchanged, on
    /// bad shapes.
    void prefill(ConstMatrixRef<T> queries, ConstMatrixRef<T> keys, ConstMatrixRef<T> values, MatrixRef<T> out) {
        constexpr const char* function = "KVCache::prefill";
        validate(keys, values, {function});
        detail::check_prefill(function, queries, keys, values, out, key_dim_, value_dim_);
        logits_.check_rows(function, "options", 1);
        if (rope_.on()) {  // the kernel reads turned queries and keys
            Matrix<T> q = queries, k = keys;
            rope_.turn_rows<T>(q, length_);
            rope_.turn_rows<T>(k, length_);
            prefill_turned(q, k, values, out);
            return;
        }
        prefill_turned(queries, keys, values, out);
    }

    /// out = Σ_j softmax_j(scale · q·k_j) v_j over every stored pair; zero when empty.
    /// With logit options, the query is the newest token's (position length() − 1).
    void attend(ConstRowRef<T> query, RowRef<T> out) const {
        detail::check_query("KVCache::attend", query, out, key_dim_, value_dim_);
        if (logits_.any() || rope_.on()) {
            logits_.check_rows("KVCache::attend", "query", 1);
            detail::attend_memory_one<T>(*this, query, out);
            return;
        }
        SoftmaxState<T> state;
        out.setZero();
        if constexpr (KeyRows::compact)
            detail::attend_stored(query, keys_, values_, 0, length_, scale_, state, out);
        else
            detail::attend_contiguous(query, keys(), values(), scale_, state, out);
        state.finish(out);
    }

    /// Row r of `out` = attend(row r of `queries`), to rounding, for g queries at once:
    /// the pairs are read (and, stored compactly, converted) once for the group
    /// (grouped-query attention), the logits and the weighted values are small
    /// register-blocked products instead of g passes. Allocates nothing (but with RoPE for
    /// a head dim past 256).
    void attend_group(ConstMatrixRef<T> queries, MatrixRef<T> out) const {
        detail::check_group_query("KVCache::attend_group", queries, out, key_dim_, value_dim_);
        logits_.check_rows("KVCache::attend_group", "queries", queries.rows());
        detail::attend_memory_group<T>(*this, queries, out);
    }

    /// The token position of the i-th pair attend reads (for_each_stored_run's order): i.
    [[nodiscard]] Index pair_position(Index i) const noexcept { return i; }
    /// Whether the keys are stored turned by RoPE or rotated (`Rotated<S>`), so attends turn
    /// their queries.
    [[nodiscard]] bool turns_queries() const noexcept { return rope_.on(); }
    /// The position an attend turns its query to for the i-th pair: the newest token's.
    [[nodiscard]] Index query_position(Index) const noexcept { return length_ - 1; }
    /// Turns the heads of a packed query row (`cols`: a multiple of key_dim) to position p
    /// in place, as attend does.
    void turn_query(T* row, Index cols, Index p) const noexcept { rope_.turn(row, cols, p); }
    /// Its RoPE configuration, or nullptr.
    [[nodiscard]] const Rope* rope() const noexcept { return rope_.rope(); }
    /// The options its attends follow: the scale and the logit options (the spans view
    /// the cache's own copies, valid while it lives and is not assigned to).
    [[nodiscard]] SoftmaxOptions options() const noexcept {
        return logits_.into({.scale = static_cast<double>(scale_)});
    }

    /// Calls f(keys, values, first, n) for each contiguous run of the stored pairs `attend`
    /// reads, in order: rows [first, first + n) of the stored keys and values
    /// (detail::StoredRows, in storage S). How memattn::MultiHead splits one attend across
    /// threads, for every storage type.
    template <class F>
    void for_each_stored_run(F&& f) const {
        if (length_ > 0)
            f(keys_, values_, Index{0}, length_);
    }

    /// Calls f(keys, values) for each contiguous run of the pairs `attend` reads, in the
    /// order it reads them, as read-only row blocks: how a caller splits one attend
    /// across threads and merges the parts (MultiHead reads for_each_stored_run through
    /// detail::MemoryAttention instead). With logit options or RoPE the parts' logits
    /// are not scale·q·k: use attend_group, or MemoryAttention.
    template <class F>
        requires std::same_as<S, T>
    void for_each_run(F&& f) const {
        if (length_ > 0)
            f(keys(), values());
    }

    /// Tokens seen since reset: the pairs held.
    [[nodiscard]] Index length() const noexcept { return length_; }
    /// Bytes of the pairs held now, as stored (S).
    [[nodiscard]] std::size_t footprint() const noexcept { return bytes(length_); }
    /// Pairs it can hold before it allocates again.
    [[nodiscard]] Index pair_capacity() const noexcept { return keys_.rows(); }
    /// Bytes allocated (held pairs plus room to grow; with PerChannelKeys, also the exact
    /// rows kept for the unfinished group of keys and the scales of the last group).
    [[nodiscard]] std::size_t capacity() const noexcept {
        if constexpr (requires { keys_.allocated_bytes(); })
            return keys_.allocated_bytes() + detail::stored_bytes<ValueRows>(values_.rows(), value_dim_);
        else
            return bytes(keys_.rows());
    }
    /// Forgets every pair and keeps the allocation.
    void reset() noexcept { keep(0); }
    /// Forgets the newest pairs, keeping the first `tokens` (at most length()): takes the
    /// cache back to an earlier length, e.g. to undo a speculative step. Keeps the allocation.
    void truncate(Index tokens) {
        if constexpr (per_channel) {
            detail::require(can_truncate(tokens), "KVCache::truncate", "tokens", "is ", tokens,
                            ", expected a multiple of ", KeyRows::group, " (a group of per-channel keys) or ",
                            keys_.finished(), " .. length() = ", length_);
        } else {
            detail::require(can_truncate(tokens), "KVCache::truncate", "tokens", "is ", tokens,
                            ", expected 0 .. length() = ", length_);
        }
        keep(tokens);
    }
    /// Whether truncate(tokens) would succeed: 0 ≤ tokens ≤ length(), and with
    /// `PerChannelKeys<S>` a multiple of its group or past the last finished group (a
    /// finished group's scales depend on all its tokens).
    [[nodiscard]] bool can_truncate(Index tokens) const noexcept {
        if constexpr (per_channel)
            return tokens >= 0 && tokens <= length_ && keys_.can_keep(tokens);
        else
            return tokens >= 0 && tokens <= length_;
    }
    /// Allocates room for `tokens` pairs in all, so later updates up to that length do not allocate.
    void reserve(Index tokens) { reserve_exact(std::max(tokens, length_)); }

    /// The key width d.
    [[nodiscard]] Index key_dim() const noexcept { return key_dim_; }
    /// The value width dv.
    [[nodiscard]] Index value_dim() const noexcept { return value_dim_; }
    /// The factor of q·k before the softmax (1/sqrt(key_dim) when built with 0).
    [[nodiscard]] T scale() const noexcept { return scale_; }

    /// Snapshots (memattn/persistence/snapshot.hpp): key_dim, value_dim, scale, length,
    /// then the keys and the values, oldest first, as stored (S; `PerChannelKeys<S>`: the
    /// finished groups of keys, then the unfinished group's keys as T). Loading keeps the
    /// allocation when the pairs fit in it. The logit options are not recorded: they
    /// change no stored pair (memory/detail/held_logits.hpp). With RoPE, its
    /// configuration follows the scale (memory/detail/held_rope.hpp).
    [[nodiscard]] static std::string snapshot_kind() { return "KVCache"; }
    /// Snapshots (memattn/persistence/snapshot.hpp): writes the payload, the fields listed at snapshot_kind().
    void write_snapshot(snapshot::Writer& w) const {
        w.index(key_dim_);
        w.index(value_dim_);
        w.number(scale_);
        rope_.write(w);
        w.index(length_);
        keys_.write_rows(w, 0, length_);
        values_.write_rows(w, 0, length_);
    }
    /// Snapshots: reads a payload written by write_snapshot(); throws SnapshotError, the
    /// cache unchanged, unless key_dim, value_dim and scale are its own.
    void read_snapshot(snapshot::Reader& r) {
        r.expect("key_dim", key_dim_);
        r.expect("value_dim", value_dim_);
        r.expect("scale", scale_);
        rope_.read(r);
        const std::size_t least =
            detail::least_row_bytes<KeyRows>(key_dim_) + detail::least_row_bytes<ValueRows>(value_dim_);
        const Index length = r.count("length", 0, static_cast<Index>(r.remaining() / least));
        r.expect_remaining(detail::stored_bytes<KeyRows>(length, key_dim_) +
                               detail::stored_bytes<ValueRows>(length, value_dim_),
                           "the pairs");
        if (length > keys_.rows()) {
            Storage loaded{KeyRows(length, key_dim_), ValueRows(length, value_dim_)};  // may throw: nothing changed
            loaded.keys.read_rows(r, 0, length);
            loaded.values.read_rows(r, 0, length);
            keys_.swap(loaded.keys);
            values_.swap(loaded.values);
        } else {
            keys_.read_rows(r, 0, length);
            values_.read_rows(r, 0, length);
        }
        length_ = length;
    }

    /// The stored keys, oldest first, a length() × key_dim() block (when stored as T).
    [[nodiscard]] auto keys() const
        requires std::same_as<S, T>
    {
        return keys_.block(0, length_);
    }
    /// The stored values, oldest first, a length() × value_dim() block (when stored as T).
    [[nodiscard]] auto values() const
        requires std::same_as<S, T>
    {
        return values_.block(0, length_);
    }

private:
    using KeyRows = detail::StoredRows<T, S>;
    using ValueRows = detail::StoredRows<T, detail::value_storage_t<S>>;
    static constexpr bool per_channel = detail::per_channel_keys<S>;

    /// The first `tokens` pairs stay (can_truncate(tokens)).
    void keep(Index tokens) noexcept {
        if constexpr (per_channel)
            keys_.keep(tokens);
        length_ = tokens;
    }

    /// prefill after the checks, with the queries and keys as the kernel reads them
    /// (turned, with RoPE): the pairs appended, then one call of the tiled kernel.
    void prefill_turned(const ConstMatrixRef<T>& queries, const ConstMatrixRef<T>& keys,
                        const ConstMatrixRef<T>& values, MatrixRef<T>& out) {
        const Index n = keys.rows(), length = length_ + n;
        const SoftmaxOptions options = this->options();
        if constexpr (per_channel) {
            // KIVI's prefill: the prompt's keys exact, the past as stored. The room first
            // (may throw: nothing changed), then the values, which the kernel reads as stored
            // (rows past length(): none is read before), the kernel (its scratch may fail to
            // allocate: length_ not yet changed, the keys not yet touched), then the keys.
            if (length > keys_.rows())
                reserve_exact(grown_rows(n));
            values_.put_rows(length_, values);
            detail::causal_softmax_stored<T>(queries, keys_, length_, keys, values_, out, options);
            keys_.put_rows(length_, keys);
            length_ = length;
            return;
        } else if constexpr (KeyRows::compact) {
            // The kernel reads the stored (rounded) pairs, tile by tile, as attend does.
            const Index before = length_;
            append(keys, values);
            try {
                detail::causal_softmax_stored<T, S>(queries, keys_, values_, length, out, options);
            } catch (...) {
                length_ = before;  // the scratch failed to allocate: the pairs were not added
                throw;
            }
            return;
        } else {
            const auto attend_all = [&](const KeyRows& all_keys, const ValueRows& all_values) {
                detail::causal_softmax_views<T>(queries, all_keys.block(0, length), all_values.block(0, length), out,
                                                [](Index, T) {}, options);
            };
            if (length > keys_.rows()) {
                // The queries may be views of the current storage too: it is freed only after
                // the kernel has read them. A throw (no memory) leaves the cache as it was.
                Storage grown = grown_with(keys, values);
                attend_all(grown.keys, grown.values);
                keys_.swap(grown.keys);
                values_.swap(grown.values);
            } else {
                keys_.put_rows(length_, keys);  // rows past length(): no input can view them
                values_.put_rows(length_, values);
                attend_all(keys_, values_);  // its scratch may fail to allocate: length_ not yet changed
            }
            length_ = length;
        }
    }

    struct Storage {
        KeyRows keys;
        ValueRows values;
    };

    /// Rows to grow to for n more pairs: max(2 × capacity, needed + needed / 2, 16).
    [[nodiscard]] Index grown_rows(Index n) const noexcept {
        const Index needed = length_ + n;
        return std::max<Index>({2 * keys_.rows(), needed + needed / 2, 16});
    }

    /// New storage, with room to grow, holding the current pairs and then `keys`/`values`:
    /// capacity max(2 × capacity, needed + needed / 2, 16), so a bulk append (a prefill)
    /// leaves headroom for the decode steps after it as a single update does. The new
    /// pairs may be views of the current storage, which is still alive while they are copied.
    template <class K, class V>
    Storage grown_with(const K& keys, const V& values) const {
        const Index rows = grown_rows(keys.rows());
        Storage grown{KeyRows(rows, key_dim_), ValueRows(rows, value_dim_)};  // may throw: nothing changed yet
        grown.keys.advise_huge_pages();  // read end to end by every attend (detail/huge_pages.hpp)
        grown.values.advise_huge_pages();
        grown.keys.copy_rows_from(keys_, length_);
        grown.values.copy_rows_from(values_, length_);
        grown.keys.put_rows(length_, keys);
        grown.values.put_rows(length_, values);
        return grown;
    }

    template <class K, class V>
    void append(const K& keys, const V& values) {
        const Index n = keys.rows();
        if (length_ + n > keys_.rows()) {
            Storage grown = grown_with(keys, values);
            keys_.swap(grown.keys);
            values_.swap(grown.values);
        } else {
            keys_.put_rows(length_, keys);  // rows past length(): no input can view them
            values_.put_rows(length_, values);
        }
        length_ += n;
    }

    void reserve_exact(Index rows) {
        if (rows <= keys_.rows())
            return;
        KeyRows keys(rows, key_dim_);  // may throw: nothing changed yet
        ValueRows values(rows, value_dim_);
        keys.advise_huge_pages();
        values.advise_huge_pages();
        keys.copy_rows_from(keys_, length_);
        values.copy_rows_from(values_, length_);
        keys_.swap(keys);
        values_.swap(values);
    }

    [[nodiscard]] std::size_t bytes(Index rows) const noexcept {
        return detail::stored_bytes<KeyRows>(rows, key_dim_) + detail::stored_bytes<ValueRows>(rows, value_dim_);
    }

    Index key_dim_;
    Index value_dim_;
    T scale_;
    detail::HeldLogits logits_;
    detail::HeldRope rope_;
    Vector<T> turned_;  ///< update's key, turned (with RoPE)
    KeyRows keys_;
    ValueRows values_;
    Index length_ = 0;
};

/// KVCache of 16-bit rows (E = Eigen::bfloat16 or Eigen::half): KVCache<float, S> behind
/// members that take and give rows of E (memory/detail/low_precision.hpp), so
/// `KVCache<Eigen::bfloat16>` stores bfloat16 pairs and computes in float. The
/// constructors are KVCache<float, S>'s.
template <LowPrecision E, class S>
    requires StorageFor<S, float>
class KVCache<E, S> : public detail::LowPrecisionMemory<KVCache<float, S>, E> {
public:
    using detail::LowPrecisionMemory<KVCache<float, S>, E>::LowPrecisionMemory;
};

namespace detail {
template <class S>
inline constexpr std::string_view memory_name<KVCache<float, S>> = "KVCache";
template <class S>
inline constexpr bool keeps_every_pair<KVCache<float, S>> = true;
}  // namespace detail

}  // namespace memattn
