#pragma once
// SlidingWindowCache: the last `window` (key, value) pairs plus the first `sinks`
// ("attention sinks", Xiao et al. 2023, "Efficient Streaming Language Models with
// Attention Sinks"). The query at position p sees the keys j <= p with j < sinks or
// j > p − window (the window counts the current token), so `attend` equals
// causal_softmax_attention with that window and those sinks, at a constant cost and
// footprint per token.
//
//   SlidingWindowCache<float> cache(64, 64, /*window=*/512, /*sinks=*/4);
//   memattn::decode(cache, Q, K, V, O);  // row i of O sees tokens 0..3 and i−511..i
//
// State: the sinks are items 0..sink_tokens−1 of one ring, token j >= sinks is item
// j − sinks of a ring of `window` rows; both are allocated at construction, so
// update/attend never allocate. Everything else derives from length().

#include "memattn/kernels/causal_softmax.hpp"
#include "memattn/kernels/decode_attention.hpp"
#include "memattn/memory/concept.hpp"
#include "memattn/memory/detail/low_precision.hpp"
#include "memattn/memory/detail/held_logits.hpp"
#include "memattn/memory/detail/held_rope.hpp"
#include "memattn/memory/detail/memory_checks.hpp"
#include "memattn/memory/detail/pair_ring.hpp"
#include "memattn/softmax_state.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>

namespace memattn {

/// The last `window` (key, value) pairs plus the first `sinks`: `attend` equals
/// causal_softmax_attention with that window and those sinks; see the top of the file.
/// \tparam S how the pairs are stored, T itself or a compact type (storage/compact.hpp).
template <class T, class S = T>
    requires(StorageFor<S, T> || (LowPrecision<T> && StorageFor<S, float>)) && detail::TokenKeys<S>  // a ring overwrites keys one by one
class SlidingWindowCache {
public:
    using Scalar = T;       ///< float or double: the rows' scalar and the arithmetic's
    using StorageType = S;  ///< how the pairs are stored
    /// The storage type code snapshots record for S (docs/snapshot-format.md).
    static constexpr snapshot::TypeCode snapshot_storage = detail::storage_code<T, S>();

    /// `window` >= 1 counts the current token; `scale` 0 means 1/sqrt(key_dim).
    SlidingWindowCache(Index key_dim, Index value_dim, Index window, Index sinks = 0, T scale = T(0))
        : key_dim_(checked(key_dim, 1, "key_dim")),
          value_dim_(checked(value_dim, 1, "value_dim")),
          window_(checked(window, 1, "window")),
          sinks_(checked(sinks, 0, "sinks")),
          scale_(detail::checked_scale(scale, key_dim, "SlidingWindowCache")),
          sink_pairs_(sinks, key_dim, value_dim),
          window_pairs_(window, key_dim, value_dim) {
        if constexpr (detail::is_rotated<S>) {
            rope_ = detail::HeldRope::rotation(key_dim_);
            turned_.resize(key_dim_);
        }
    }

    /// With the options of causal_softmax_attention: `options.window` >= 1 and
    /// `options.sink_tokens` as `window` and `sinks` above, `options.scale` as `scale`,
    /// and the logit options (softcap; ALiBi slopes and sink logits, one value for attend
    /// and prefill, or one per query head of the group attend_group and prefill_group
    /// take), which the cache copies; see KVCache's constructor. ALiBi counts the
    /// tokens' positions in the sequence (as the kernel does), so a sink token is as far
    /// from the query as its position says.
    SlidingWindowCache(Index key_dim, Index value_dim, const SoftmaxOptions& options)
        : SlidingWindowCache(key_dim, value_dim, options.window, options.sink_tokens, static_cast<T>(options.scale)) {
        logits_ = detail::HeldLogits("SlidingWindowCache", options, std::type_identity<T>{}, true,
                                     detail::bf16_products<T, S>);
    }

    /// With the options and rotary position embeddings (see KVCache's): keys stored
    /// turned, queries turned at each attend. `positions`: where the kept tokens are
    /// (RopePositions): in the sequence, or StreamingLLM's rule, in the cache — the sinks
    /// 0 .. sinks − 1, the window after them, the query last; the window keeps its
    /// distances either way, and the sinks are read with the query turned to its place
    /// in the cache (memory/detail/held_rope.hpp gives the equation).
    SlidingWindowCache(Index key_dim, Index value_dim, const SoftmaxOptions& options, const Rope& rope,
                       RopePositions positions = RopePositions::sequence)
        : SlidingWindowCache(key_dim, value_dim, options) {
        rope_ = detail::HeldRope("SlidingWindowCache", rope, key_dim_, positions, detail::is_rotated<S>);
        turned_.resize(key_dim_);
    }

    /// Stores one pair; the pair `window` positions back (if not a sink) is forgotten.
    void update(ConstRowRef<T> key, ConstRowRef<T> value) {
        validate(key, value, {"SlidingWindowCache::update", "key", "value"});
        put(length_, key, value);
        ++length_;
    }

    /// Stores many pairs; only the ones still visible afterwards are copied.
    void extend(ConstMatrixRef<T> keys, ConstMatrixRef<T> values) {
        validate(keys, values, {"SlidingWindowCache::extend"});
        store(keys, values);
    }

    /// Throws what update/extend would throw for these pairs, changing nothing:
    /// std::invalid_argument for a shape, or for a finite value S would store as ±∞ or
    /// NaN; std::length_error past memattn::max_length. `site` names the caller (a layer's
    /// check of one head's part of its packed rows, see KVCache::validate).
    void validate(ConstMatrixRef<T> keys, ConstMatrixRef<T> values,
                  const detail::PairSite& site = {"SlidingWindowCache::validate"}) const {
        detail::check_site_pairs(site, detail::shape(keys), detail::shape(values), key_dim_, value_dim_, length_);
        detail::check_storable<T, S>(site, keys, false);
        detail::check_storable<T, S>(site, values, true);
        rope_.check_turnable<T, S>(site, keys);
    }

    /// Outputs for the queries at positions length() .. length() + n − 1, equal to
    /// feeding the pairs one by one and attending after each (decode), then stores the
    /// pairs. No query loses a pair that a later one of the same prompt pushed out of
    /// the ring (the bug of writing the prompt into the ring first): the prompt goes
    /// through causal_softmax_attention with this cache's window and sinks, over the
    /// pairs its queries see, read from the cache and the prompt.
    void prefill(ConstMatrixRef<T> queries, ConstMatrixRef<T> keys, ConstMatrixRef<T> values, MatrixRef<T> out) {
        const char* function = "SlidingWindowCache::prefill";
        validate(keys, values, {function});
        detail::check_prefill(function, queries, keys, values, out, key_dim_, value_dim_);
        logits_.check_rows(function, "options", 1);
        prefill_turned(queries, keys, values, out, 1);
        store(keys, values);
    }

    /// prefill for g queries per token against the same pairs (a group of query heads
    /// over this KV head): `queries` is n × g·key_dim and `out` n × g·value_dim, member m
    /// in columns [m·key_dim, (m+1)·key_dim) and [m·value_dim, (m+1)·value_dim). The
    /// pairs are gathered once and stored once; each member's outputs are its prefill's.
    void prefill_group(ConstMatrixRef<T> queries, ConstMatrixRef<T> keys, ConstMatrixRef<T> values,
                       MatrixRef<T> out) {
        const char* function = "SlidingWindowCache::prefill_group";
        validate(keys, values, {function});
        const Index members = queries.cols() / key_dim_;
        detail::require(members >= 1 && queries.cols() == members * key_dim_, function, "queries", "has shape ",
                        detail::shape(queries), ", expected a multiple of key_dim = ", key_dim_, " columns");
        detail::check_prefill(function, queries, keys, values, out, members * key_dim_, members * value_dim_);
        logits_.check_rows(function, "queries' members", members);
        prefill_turned(queries, keys, values, out, members);
        store(keys, values);
    }

    /// out = Σ_{j visible} softmax_j(scale · q·k_j) v_j over the sinks and the window;
    /// zero when empty. With logit options, the query is at position length() − 1.
    void attend(ConstRowRef<T> query, RowRef<T> out) const {
        detail::check_query("SlidingWindowCache::attend", query, out, key_dim_, value_dim_);
        if (logits_.any() || rope_.on()) {
            logits_.check_rows("SlidingWindowCache::attend", "query", 1);
            detail::attend_memory_one<T>(*this, query, out);
            return;
        }
        SoftmaxState<T> state;
        out.setZero();
        sink_pairs_.attend(query, 0, held_sinks(), scale_, state, out);
        window_pairs_.attend(query, first_window_item(), window_items(), scale_, state, out);
        state.finish(out);
    }

    /// Row r of `out` = attend(row r of `queries`), to rounding, for g queries at once:
    /// the pairs are read once for the group (grouped-query attention), the logits and
    /// the weighted values are small GEMMs instead of g GEMVs. Allocates nothing (but with
    /// RoPE for a head dim past 256).
    void attend_group(ConstMatrixRef<T> queries, MatrixRef<T> out) const {
        detail::check_group_query("SlidingWindowCache::attend_group", queries, out, key_dim_, value_dim_);
        logits_.check_rows("SlidingWindowCache::attend_group", "queries", queries.rows());
        detail::attend_memory_group<T>(*this, queries, out);
    }

    /// The token position of the i-th pair attend reads (for_each_stored_run's order: the
    /// held sinks, then the window).
    [[nodiscard]] Index pair_position(Index i) const noexcept {
        return i < held_sinks() ? i : sinks_ + first_window_item() + (i - held_sinks());
    }
    /// Whether the keys are stored turned by RoPE, so attends turn their queries.
    [[nodiscard]] bool turns_queries() const noexcept { return rope_.on(); }
    /// The position an attend turns its query to for the i-th pair: the newest token's,
    /// or, with RopePositions::cache, for a sink its own place in the cache (the last).
    [[nodiscard]] Index query_position(Index i) const noexcept {
        if (rope_.in_cache() && i < held_sinks())
            return held_sinks() + (window_items() - first_window_item()) - 1;
        return length_ - 1;
    }
    /// Turns the heads of a packed query row (`cols`: a multiple of key_dim) to position p
    /// in place, as attend does.
    void turn_query(T* row, Index cols, Index p) const noexcept { rope_.turn(row, cols, p); }
    /// Its RoPE configuration, or nullptr.
    [[nodiscard]] const Rope* rope() const noexcept { return rope_.rope(); }
    /// Where its RoPE places the kept tokens.
    [[nodiscard]] RopePositions rope_positions() const noexcept { return rope_.positions(); }
    /// The options its attends follow: scale, window, sink tokens and the logit options
    /// (the spans view the cache's own copies; see KVCache::options).
    [[nodiscard]] SoftmaxOptions options() const noexcept { return logits_.into(kernel_options()); }

    /// Calls f(keys, values, first, n) for each contiguous run of the stored pairs `attend`
    /// reads, in order (the sinks, then the window), in any storage (see KVCache).
    template <class F>
    void for_each_stored_run(F&& f) const {
        sink_pairs_.for_each_stored(0, held_sinks(), f);
        window_pairs_.for_each_stored(first_window_item(), window_items(), f);
    }

    /// Calls f(keys, values) for each contiguous run of the pairs `attend` reads, in the
    /// order it reads them, as read-only row blocks: how a caller splits one attend
    /// across threads and merges the parts (MultiHead reads for_each_stored_run through
    /// detail::MemoryAttention instead). With logit options or RoPE the parts' logits
    /// are not scale·q·k: use attend_group, or MemoryAttention.
    template <class F>
        requires std::same_as<S, T>
    void for_each_run(F&& f) const {
        sink_pairs_.for_each_block(0, held_sinks(), f);
        window_pairs_.for_each_block(first_window_item(), window_items(), f);
    }

    /// Tokens seen since reset.
    [[nodiscard]] Index length() const noexcept { return length_; }
    /// Bytes of the pairs held now: grows with the first window + sinks tokens, then constant.
    [[nodiscard]] std::size_t footprint() const noexcept {
        return sink_pairs_.bytes(held_sinks()) + window_pairs_.bytes(window_items() - first_window_item());
    }
    /// The most pairs attend reads: window + sinks.
    [[nodiscard]] Index pair_capacity() const noexcept { return sinks_ + window_; }
    /// Bytes allocated at construction: window + sinks pairs.
    [[nodiscard]] std::size_t capacity() const noexcept { return sink_pairs_.bytes(sinks_ + window_); }
    /// Forgets every pair and keeps the allocation.
    void reset() noexcept { length_ = 0; }

    /// Forgets the newest pairs, keeping the first `tokens`, when the cache still holds
    /// every pair a cache that saw only those tokens would hold: before the window has
    /// overwritten any pair (length() ≤ sinks + window), any `tokens` ≤ length(); after,
    /// only tokens == length(). Then length() and every output equal that cache's. Throws
    /// std::invalid_argument, unchanged, otherwise.
    void truncate(Index tokens) {
        constexpr const char* function = "SlidingWindowCache::truncate";
        if (can_truncate(tokens)) [[likely]] {
            length_ = tokens;
            return;
        }
        detail::require(tokens >= 0 && tokens <= length_, function, "tokens", "is ", tokens,
                        ", expected 0 .. length() = ", length_);
        // The oldest window item the shorter cache would hold must not have been overwritten.
        detail::require(first_window_item(tokens) >= first_window_item(), function, "tokens", "is ", tokens, ", but the window of ",
                        window_, " has overwritten the pairs before token ", first_window_item() + sinks_,
                        " (length() = ", length_, ", sinks = ", sinks_,
                        "): a cache truncated to ", tokens, " tokens would need them");
    }
    /// Whether truncate(tokens) would succeed (see truncate).
    [[nodiscard]] bool can_truncate(Index tokens) const noexcept {
        return tokens >= 0 && tokens <= length_ && first_window_item(tokens) >= first_window_item();
    }

    /// The key width d.
    [[nodiscard]] Index key_dim() const noexcept { return key_dim_; }
    /// The value width dv.
    [[nodiscard]] Index value_dim() const noexcept { return value_dim_; }
    /// The latest pairs a query sees, the current token included.
    [[nodiscard]] Index window() const noexcept { return window_; }
    /// The first pairs every query sees (attention sinks).
    [[nodiscard]] Index sinks() const noexcept { return sinks_; }
    /// The factor of q·k before the softmax (1/sqrt(key_dim) when built with 0).
    [[nodiscard]] T scale() const noexcept { return scale_; }

    /// Snapshots (memattn/persistence/snapshot.hpp): key_dim, value_dim, window, sinks,
    /// scale, length, then the held sinks and the held window pairs, oldest first (keys,
    /// then values, of each). Loading writes into the rings allocated at construction.
    /// The logit options are not recorded (see KVCache); a RoPE configuration follows the scale.
    [[nodiscard]] static std::string snapshot_kind() { return "SlidingWindowCache"; }
    /// Snapshots (memattn/persistence/snapshot.hpp): writes the payload, the fields listed at snapshot_kind().
    void write_snapshot(snapshot::Writer& w) const {
        w.index(key_dim_);
        w.index(value_dim_);
        w.index(window_);
        w.index(sinks_);
        w.number(scale_);
        rope_.write(w);
        w.index(length_);
        sink_pairs_.write_items(w, 0, held_sinks());
        window_pairs_.write_items(w, first_window_item(), window_items());
    }
    /// Snapshots: reads a payload written by write_snapshot(); throws SnapshotError, the
    /// cache unchanged, unless key_dim, value_dim, window, sinks and scale are its own.
    void read_snapshot(snapshot::Reader& r) {
        r.expect("key_dim", key_dim_);
        r.expect("value_dim", value_dim_);
        r.expect("window", window_);
        r.expect("sinks", sinks_);
        r.expect("scale", scale_);
        rope_.read(r);
        const Index length = r.count("length", 0, max_length);
        const Index sinks = held_sinks(length), first = first_window_item(length), last = window_items(length);
        r.expect_remaining(sink_pairs_.bytes(sinks + last - first), "the held pairs");
        sink_pairs_.read_items(r, 0, sinks);
        window_pairs_.read_items(r, first, last);
        length_ = length;
    }

private:
    /// Sinks held after `length` tokens: min(length, sinks).
    [[nodiscard]] Index held_sinks(Index length) const noexcept { return std::min(length, sinks_); }
    /// Non-sink tokens among `length` (window items are numbered from the first of them).
    [[nodiscard]] Index window_items(Index length) const noexcept { return std::max<Index>(0, length - sinks_); }
    /// The oldest window item the token at position length − 1 still sees.
    [[nodiscard]] Index first_window_item(Index length) const noexcept {
        return std::max<Index>(0, window_items(length) - window_);
    }
    [[nodiscard]] Index held_sinks() const noexcept { return held_sinks(length_); }
    [[nodiscard]] Index window_items() const noexcept { return window_items(length_); }
    [[nodiscard]] Index first_window_item() const noexcept { return first_window_item(length_); }

    /// Stores the pair of the token at `position`, its key turned with RoPE.
    template <class K, class V>
    void put(Index position, const K& key, const V& value) {
        rope_.with_turned(key, position, turned_, [&](const auto& k) {
            if (position < sinks_)
                sink_pairs_.put(position, k, value);
            else
                window_pairs_.put(position - sinks_, k, value);
        });
    }

    void store(const ConstMatrixRef<T>& keys, const ConstMatrixRef<T>& values) {
        const Index n = keys.rows(), end = length_ + n;
        if (rope_.on()) {  // row by row through the turned row: no allocation
            const Index sink_end = std::min(sinks_, end), first = std::max({length_, sinks_, end - window_});
            for (Index p = length_; p < sink_end; ++p)
                put(p, keys.row(p - length_), values.row(p - length_));
            for (Index p = first; p < end; ++p)
                put(p, keys.row(p - length_), values.row(p - length_));
            length_ = end;
            return;
        }
        // Sinks among the new tokens: positions [length, min(sinks, end)).
        const Index sink_end = std::min(sinks_, end);
        if (length_ < sink_end)
            sink_pairs_.put_rows(length_, keys.topRows(sink_end - length_), values.topRows(sink_end - length_));
        // Window tokens that remain visible after the last one: the last `window` non-sinks.
        const Index first = std::max({length_, sinks_, end - window_});
        if (first < end)
            window_pairs_.put_rows(first - sinks_, keys.middleRows(first - length_, end - first),
                                   values.middleRows(first - length_, end - first));
        length_ = end;
    }

    /// Queries of one kernel call when the prompt continues a cached prefix.
    static constexpr Index prefill_chunk = 256;

    /// The outputs of prefill for `members` queries per token, before the pairs are stored,
    /// from the queries and keys as given: turned first with RoPE; token by token when
    /// RopePositions::cache places a query's sinks elsewhere than the kernel would.
    void prefill_turned(const ConstMatrixRef<T>& queries, const ConstMatrixRef<T>& keys,
                        const ConstMatrixRef<T>& values, MatrixRef<T>& out, Index members) const {
        // Past sinks + window, some query's keys skip positions after the sinks: ALiBi
        // counts them (in the kernel's gathered keys they are missing), and
        // RopePositions::cache places the sinks closer than the kernel would.
        const bool skips = sinks_ > 0 && length_ + queries.rows() > sinks_ + window_;
        const bool gathered = length_ > 0 || detail::StoredRows<T, S>::compact;
        if (skips && (rope_.in_cache() || (logits_.alibi() && gathered))) {
            prefill_by_tokens(queries, keys, values, out, members);
            return;
        }
        if (!rope_.on()) {
            prefill_members(queries, keys, values, out, members);
            return;
        }
        Matrix<T> q = queries, k = keys;
        rope_.turn_rows<T>(q, length_);  // every member's head of a row: one position
        rope_.turn_rows<T>(k, length_);
        prefill_members(q, k, values, out, members);
    }

    /// The outputs of prefill for `members` queries per token, before the pairs are stored.
    void prefill_members(const ConstMatrixRef<T>& queries, const ConstMatrixRef<T>& keys,
                         const ConstMatrixRef<T>& values, MatrixRef<T>& out, Index members) const {
        if (length_ > 0 || detail::StoredRows<T, S>::compact) {  // compact: the kernel reads the pairs as stored
            prefill_after_cache(queries, keys, values, out, members);
            return;
        }
        // The prompt is the whole sequence: the kernel reads it in place.
        if (queries.rows() == 0)
            return;
        detail::SoftmaxScratch<T> scratch(key_dim_, value_dim_, kernel_tiles(keys.rows()));
        for (Index m = 0; m < members; ++m)
            detail::causal_softmax_views<T>(queries.middleCols(m * key_dim_, key_dim_), keys, values,
                                            out.middleCols(m * value_dim_, value_dim_), [](Index, T) {},
                                            logits_.member(kernel_options(), m), scratch);
    }

    /// The outputs of prefill as decode gives them: a copy of the cache takes each token,
    /// then its members attend.
    void prefill_by_tokens(const ConstMatrixRef<T>& queries, const ConstMatrixRef<T>& keys,
                           const ConstMatrixRef<T>& values, MatrixRef<T>& out, Index members) const {
        SlidingWindowCache copy = *this;
        for (Index i = 0; i < keys.rows(); ++i) {
            copy.update(keys.row(i), values.row(i));
            const Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>> q(queries.row(i).data(), members, key_dim_,
                                                                         Eigen::OuterStride<>(key_dim_));
            Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>> o(out.row(i).data(), members, value_dim_,
                                                             Eigen::OuterStride<>(value_dim_));
            copy.attend_group(q, o);
        }
    }

    /// The kernel's tiles for `keys` keys under this cache's window (default_tiles).
    [[nodiscard]] detail::SoftmaxTiles kernel_tiles(Index keys) const {
        return detail::default_tiles(detail::effective_window(window_, keys));
    }

    [[nodiscard]] SoftmaxOptions kernel_options() const {
        return {.scale = static_cast<double>(scale_), .window = window_, .sink_tokens = sinks_};
    }

    /// prefill after a cached prefix, in chunks of max(window, prefill_chunk) queries.
    /// For chunk [a, b) of the prompt (positions P + a .. P + b − 1, P = length()) the
    /// kernel gets the keys [sinks: positions 0 .. sinks − 1] ++ [positions
    /// max(sinks, P + a − window + 1) .. P + b − 1], each read from the cache below P
    /// and from the prompt above. Skipping the positions in between keeps the kernel's
    /// mask right: its window test compares differences of positions, which the skip
    /// does not change, and the sinks are the first `sinks` rows either way.
    /// Scratch: sinks + window − 1 + chunk pairs, allocated once per call.
    void prefill_after_cache(const ConstMatrixRef<T>& queries, const ConstMatrixRef<T>& keys,
                             const ConstMatrixRef<T>& values, MatrixRef<T>& out, Index members) const {
        const Index n = keys.rows(), chunk = std::max(window_, prefill_chunk);
        const Index rows = std::min(sinks_ + window_ - 1 + chunk, length_ + n);
        Matrix<T> chunk_keys(rows, key_dim_), chunk_values(rows, value_dim_);
        // Copies positions [first, last) into the scratch from row `row` on; returns the next row.
        const auto gather = [&](Index first, Index last, Index row) {
            const Index cached_end = std::min(last, length_);
            if (first < cached_end) {
                auto k = chunk_keys.middleRows(row, cached_end - first);
                auto v = chunk_values.middleRows(row, cached_end - first);
                const Index sink_end = std::min(cached_end, sinks_);
                if (first < sink_end)
                    sink_pairs_.copy_out(first, sink_end, k.topRows(sink_end - first), v.topRows(sink_end - first));
                const Index from = std::max(first, sinks_);
                if (from < cached_end)
                    window_pairs_.copy_out(from - sinks_, cached_end - sinks_, k.bottomRows(cached_end - from),
                                           v.bottomRows(cached_end - from));
            }
            const Index prompt_first = std::max(first, length_);
            if (prompt_first < last) {  // as the ring will hold them (rounded to S)
                const Index at = row + prompt_first - first, count = last - prompt_first;
                detail::round_trip<T, S>(keys.middleRows(prompt_first - length_, count),
                                         chunk_keys.data() + at * key_dim_, key_dim_);
                detail::round_trip<T, S>(values.middleRows(prompt_first - length_, count),
                                         chunk_values.data() + at * value_dim_, value_dim_);
            }
            return row + (last - first);
        };
        for (Index a = 0; a < n; a += chunk) {
            const Index b = std::min(n, a + chunk), end = length_ + b;
            const Index sink_end = std::min(sinks_, end);
            const Index window_first = std::max(sink_end, length_ + a - window_ + 1);
            const Index used = gather(window_first, end, gather(0, sink_end, 0));
            for (Index m = 0; m < members; ++m)
                detail::causal_softmax_views<T>(queries.block(a, m * key_dim_, b - a, key_dim_),
                                                chunk_keys.topRows(used), chunk_values.topRows(used),
                                                out.block(a, m * value_dim_, b - a, value_dim_), [](Index, T) {},
                                                logits_.member(kernel_options(), m));
        }
    }

    static Index checked(Index value, Index least, const char* argument) {
        return detail::at_least(value, least, "SlidingWindowCache", argument);
    }


    Index key_dim_;
    Index value_dim_;
    Index window_;
    Index sinks_;
    T scale_;
    detail::HeldLogits logits_;
    detail::HeldRope rope_;
    Vector<T> turned_;  ///< a key on its way to the rings, turned (with RoPE)
    detail::PairRing<T, S> sink_pairs_;    ///< item j: token j < sinks
    detail::PairRing<T, S> window_pairs_;  ///< item j: token sinks + j
    Index length_ = 0;
};

/// SlidingWindowCache of 16-bit rows (E = Eigen::bfloat16 or Eigen::half):
/// SlidingWindowCache<float, S> behind members that take and give rows of E
/// (memory/detail/low_precision.hpp). The constructors are SlidingWindowCache<float, S>'s.
template <LowPrecision E, class S>
    requires StorageFor<S, float> && detail::TokenKeys<S>
class SlidingWindowCache<E, S> : public detail::LowPrecisionMemory<SlidingWindowCache<float, S>, E> {
public:
    using detail::LowPrecisionMemory<SlidingWindowCache<float, S>, E>::LowPrecisionMemory;
};

namespace detail {
template <class S>
inline constexpr std::string_view memory_name<SlidingWindowCache<float, S>> = "SlidingWindowCache";
}  // namespace detail

}  // namespace memattn
