#pragma once
// MultiHead<M>: a Memory over a whole layer of heads (docs/design.md, "Multi-head layers").
//
//   HeadLayout layout{.q_heads = 8, .kv_heads = 2, .head_dim = 64};
//   MultiHead<SlidingWindowCache<float>> mem(layout, [](Index) { return SlidingWindowCache<float>(64, 64, 512, 4); });
//   mem.update(k_row, v_row);   // packed rows: kv_heads·head_dim, kv_heads·value_dim
//   mem.attend(q_row, o_row);   // packed rows: q_heads·head_dim, q_heads·value_dim
//   memattn::decode(mem, Q, K, V, O);  memattn::prefill(mem, Q, K, V, O);  // unchanged
//
// It holds one memory per KV head, made by the factory (called with the KV head's index),
// and declares query_dim()/output_dim() so decode and prefill check the wider Q and O.
//
// attend: the query heads of a group are adjacent in the packed row, so a group's queries
// are one g × head_dim block, and each KV head's memory is read once for the whole group
// (its attend_group when it has one, else g attends). For the softmax memories whose
// stored pairs it can see (for_each_stored_run: KVCache, SlidingWindowCache, HybridCache,
// in every storage type, each stored row converted once per group) the keys are cut into
// pieces of `split_keys` pairs (flash-decoding): the pieces of every head are spread over
// the threads of the layer's executor (execution/executor.hpp), each folds its pairs into
// partial softmax states, and the partial states of a head are merged in piece order. The
// pieces depend only on the memory's length, not on the executor or the number of
// threads, so the output is bitwise the same for any of them; a step whose total work is
// below `parallel_work` stays on the calling thread. The split's scratch is sized when
// the heads grow (see size_split_scratch), so after reserve() a step allocates nothing.
//
// prefill: MultiHead<KVCache> appends the prompt to every head's cache and runs the
// multi-head kernel over the caches (every query head, tile by tile, on every thread:
// bitwise each head's KVCache::prefill). Memories with a grouped prefill
// (SlidingWindowCache, LinearAttentionMemory: `prefill_group`, the group's queries against
// the pairs gathered or folded once) run it per KV head, in parallel across KV heads;
// other memories with their own prefill run it per head when every KV head has one query
// head; anything else goes token by token (update, then attend).
//
// A call that throws std::invalid_argument changes nothing; the factory's memories must
// agree with the layout (checked where the memory tells its key_dim and value_dim).

#include "memattn/execution/executor.hpp"
#include "memattn/kernels/decode_attention.hpp"
#include "memattn/layer/head_layout.hpp"
#include "memattn/layer/multi_head_kernels.hpp"
#include "memattn/execution/parallel.hpp"
#include "memattn/memory/concept.hpp"
#include "memattn/memory/detail/low_precision.hpp"
#include "memattn/memory/detail/rollback.hpp"
#include "memattn/memory/kv_cache.hpp"
#include "memattn/memory/sparse_kv_cache.hpp"
#include "memattn/persistence/snapshot.hpp"
#include "memattn/softmax_state.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace memattn {
namespace detail {

/// A softmax memory that shows the runs of pairs its attend reads, and its scale.
template <class M>
concept HasPairRuns = requires(const M& m) {
    m.for_each_stored_run([](const auto&, const auto&, Index, Index) {});
    { m.scale() } -> std::convertible_to<typename M::Scalar>;
};

/// Any KVCache or SparseKVCache, whatever its storage: it allocates as it grows, so a
/// layer of them takes every head back to its length when one throws (std::bad_alloc).
template <class M>
inline constexpr bool is_kv_cache = false;
template <class T, class S>
inline constexpr bool is_kv_cache<KVCache<T, S>> = true;
template <class T, class S>
inline constexpr bool is_kv_cache<SparseKVCache<T, S>> = true;

/// A KVCache of T stored as T: the multi-head kernel reads its pairs in place.
template <class M>
inline constexpr bool is_plain_kv_cache = false;
template <class T>
inline constexpr bool is_plain_kv_cache<KVCache<T>> = true;

/// The most pairs a memory with pair runs can show before it allocates again: its
/// pair_capacity() where it has one (the caches), else the pairs it shows now.
template <class M>
Index pair_capacity(const M& m) {
    if constexpr (requires { { m.pair_capacity() } -> std::convertible_to<Index>; }) {
        return m.pair_capacity();
    } else {
        Index n = 0;
        m.for_each_stored_run([&n](const auto&, const auto&, Index, Index count) { n += count; });
        return n;
    }
}

template <class M>
concept CanReserve = requires(M& m, Index n) { m.reserve(n); };

template <class M>
concept CanTruncate = requires(M& m, const M& cm, Index n) {
    { cm.can_truncate(n) } -> std::convertible_to<bool>;
    m.truncate(n);
};

}  // namespace detail

/// A Memory over a layer of heads: one memory M per KV head, fed and read through packed
/// rows of every head (see the top of the file).
template <Memory M>
class MultiHead : public ExecutorSlot {
    using T = typename M::Scalar;

public:
    using Scalar = T;  ///< the heads' scalar

    /// Pairs per piece of a split attend (see the top of the file).
    static constexpr Index split_keys = 2048;
    /// Pairs × query heads × (head_dim + value_dim) of one step below which it runs on one thread.
    static constexpr double parallel_work = 1 << 20;

    /// One memory per KV head: make(kv) for kv = 0 .. kv_heads − 1.
    template <class Factory>
        requires std::invocable<Factory&, Index> && std::convertible_to<std::invoke_result_t<Factory&, Index>, M>
    MultiHead(const HeadLayout& layout, Factory&& make) : layout_(checked(layout)), key_width_(layout_.head_dim) {
        heads_.reserve(static_cast<std::size_t>(layout_.kv_heads));
        for (Index h = 0; h < layout_.kv_heads; ++h) {
            heads_.push_back(make(h));
            const M& head = heads_.back();
            const std::string name = "make(" + std::to_string(h) + ")";
            if constexpr (detail::KnowsQueryDims<M> && detail::KnowsDims<M>) {
                // Keys wider than queries (a gated memory's extra key columns): the layout
                // gives the query and output widths, the heads the key width.
                detail::require(head.query_dim() == layout_.head_dim, "MultiHead", name.c_str(), "has query_dim ",
                                head.query_dim(), ", expected layout.head_dim ", layout_.head_dim);
                detail::require(head.output_dim() == layout_.values(), "MultiHead", name.c_str(), "has output_dim ",
                                head.output_dim(), ", expected the layout's value_dim ", layout_.values());
                if (h == 0) {
                    key_width_ = head.key_dim();
                    detail::checked_product("MultiHead", "layout.kv_heads", layout_.kv_heads, key_width_,
                                            "the width of the packed keys, kv_heads x make(0).key_dim() =");
                }
                detail::require(head.key_dim() == key_width_, "MultiHead", name.c_str(), "has key_dim ",
                                head.key_dim(), ", expected ", key_width_, " as make(0)");
            } else if constexpr (detail::KnowsDims<M>) {
                detail::require(head.key_dim() == layout_.head_dim, "MultiHead", name.c_str(), "has key_dim ",
                                head.key_dim(), ", expected layout.head_dim ", layout_.head_dim);
            }
            if constexpr (detail::KnowsDims<M>)
                detail::require(head.value_dim() == layout_.values(), "MultiHead", name.c_str(), "has value_dim ",
                                head.value_dim(), ", expected the layout's value_dim ", layout_.values());
            if constexpr (detail::PlacesPairs<M>) {
                // Each KV head's memory holds its group's values: one per query head of the group.
                const SoftmaxOptions options = head.options();
                for (const auto& [values, what] : {std::pair{options.alibi_slopes, "options().alibi_slopes"},
                                                   std::pair{options.sink_logits, "options().sink_logits"}})
                    detail::require(values.empty() || static_cast<Index>(values.size()) == layout_.group_size(),
                                    "MultiHead", name.c_str(), "has ", values.size(), " ", what,
                                    ", expected none or one per query head of its group, ", layout_.group_size());
            }
        }
        size_split_scratch();
    }

    // set_executor(executor), executor(): attend's and prefill's items (ExecutorSlot).

    /// Room for `tokens` in every head that reserves (KVCache), and the split attend's
    /// scratch for them: after it, decode steps up to that length allocate nothing.
    void reserve(Index tokens)
        requires detail::CanReserve<M>
    {
        for (M& head : heads_)
            head.reserve(tokens);
        size_split_scratch();
    }

    /// Feeds one token: `key` is kv_heads·head_dim wide, `value` kv_heads·value_dim.
    void update(ConstRowRef<T> key, ConstRowRef<T> value) {
        validate(key, value, {"MultiHead::update", "key", "value"});
        const Index d = key_width_, dv = layout_.values();
        all_or_nothing(false, [&] {
            for (Index h = 0; h < layout_.kv_heads; ++h)
                heads_[static_cast<std::size_t>(h)].update(key.segment(h * d, d), value.segment(h * dv, dv));
        });
        size_split_scratch();  // allocates only when a head's cache has just grown
    }

    /// update(key, value), then attend(query, out): one decode step, the same numbers, each
    /// head's through its memory's update_attend_group (a recurrent head's state updated and read
    /// for its group's queries in one pass). Only where the heads' memories have it.
    /// (A member template, so that an explicit instantiation of a MultiHead whose memory has
    /// none does not instantiate it: clang before 15 instantiates constrained members.)
    template <std::same_as<M> H = M>
        requires requires(H& m, ConstRowRef<T> row, ConstMatrixRef<T> q, MatrixRef<T> o) {
            m.update_attend_group(row, row, q, o);
        }
    void update_attend(ConstRowRef<T> key, ConstRowRef<T> value, ConstRowRef<T> query, RowRef<T> out) {
        validate(key, value, {"MultiHead::update", "key", "value"});
        detail::check_query("MultiHead::attend", query, out, query_dim(), output_dim());
        detail::require_disjoint("MultiHead::update", "out", out, "key", key);
        detail::require_disjoint("MultiHead::update", "out", out, "value", value);
        update_attend(key, value, query, out, detail::checked);
    }
    /// The same after its checks (a pool or a batch that ran them: detail::check_sequences);
    /// each head's step through its own checked entry where it has one, since every head's
    /// part was checked with the layer's.
    template <std::same_as<M> H = M>
        requires requires(H& m, ConstRowRef<T> row, ConstMatrixRef<T> q, MatrixRef<T> o) {
            m.update_attend_group(row, row, q, o);
        }
    void update_attend(ConstRowRef<T> key, ConstRowRef<T> value, ConstRowRef<T> query, RowRef<T> out,
                       detail::Checked) {
        const Index d = key_width_, dv = layout_.values();
        for (Index h = 0; h < layout_.kv_heads; ++h) {
            GroupOut o = group_outputs(out, h);
            M& head = heads_[static_cast<std::size_t>(h)];
            const auto k = key.segment(h * d, d), v = value.segment(h * dv, dv);
            const GroupMap q = group_queries(query, h);
            if constexpr (requires { head.update_attend_group(k, v, q, o, detail::checked); })
                head.update_attend_group(k, v, q, o, detail::checked);
            else
                head.update_attend_group(k, v, q, o);
        }
    }

    /// `source` (a layer of this one's layout and heads: a copy of the same layer) updated
    /// by one token into this layer, then its attend of `query`: the same numbers as
    /// `*this = source` then update_attend, each head's copy folded into its step where
    /// the head fuses it (RecurrentMemory::assign_update_attend_group). A member template,
    /// as update_attend.
    template <std::same_as<M> H = M>
        requires requires(H& m, const H& src, ConstRowRef<T> row, ConstMatrixRef<T> q, MatrixRef<T> o) {
            m.assign_update_attend_group(src, row, row, q, o, detail::unfenced);
        }
    void assign_update_attend(const MultiHead& source, ConstRowRef<T> key, ConstRowRef<T> value,
                              ConstRowRef<T> query, RowRef<T> out) {
        const detail::StreamFence fence;  // once for every head's streamed state (also when it throws)
        assign_update_attend(source, key, value, query, out, detail::unfenced);
    }
    /// The same, its heads' streamed stores left unfenced (a caller that streams many
    /// states fences once after them: detail::stream_fence).
    template <std::same_as<M> H = M>
        requires requires(H& m, const H& src, ConstRowRef<T> row, ConstMatrixRef<T> q, MatrixRef<T> o) {
            m.assign_update_attend_group(src, row, row, q, o, detail::unfenced);
        }
    void assign_update_attend(const MultiHead& source, ConstRowRef<T> key, ConstRowRef<T> value,
                              ConstRowRef<T> query, RowRef<T> out, detail::Unfenced) {
        if (&source == this) {
            update_attend(key, value, query, out);
            return;
        }
        detail::require(source.layout_.q_heads == layout_.q_heads && source.layout_.kv_heads == layout_.kv_heads &&
                            source.layout_.head_dim == layout_.head_dim && source.key_width_ == key_width_ &&
                            source.layout_.values() == layout_.values(),
                        "MultiHead::update", "source", "is a layer of another layout");
        source.validate(key, value, {"MultiHead::update", "key", "value"});  // source's checks
        detail::check_query("MultiHead::attend", query, out, query_dim(), output_dim());
        detail::require_disjoint("MultiHead::update", "out", out, "key", key);
        detail::require_disjoint("MultiHead::update", "out", out, "value", value);
        const Index d = key_width_, dv = layout_.values();
        for (Index h = 0; h < layout_.kv_heads; ++h) {  // (checked: no head throws)
            GroupOut o = group_outputs(out, h);
            heads_[static_cast<std::size_t>(h)].assign_update_attend_group(
                source.heads_[static_cast<std::size_t>(h)], key.segment(h * d, d), value.segment(h * dv, dv),
                group_queries(query, h), o, detail::unfenced);
        }
    }

    /// Feeds many tokens (packed rows), through each head's own extend where it has one.
    void extend(ConstMatrixRef<T> keys, ConstMatrixRef<T> values) {
        validate(keys, values, {"MultiHead::extend"});
        if (keys.rows() == 0)  // no column block of an empty (possibly null) view
            return;
        const Index d = key_width_, dv = layout_.values();
        all_or_nothing(false, [&] {
            for (Index h = 0; h < layout_.kv_heads; ++h)
                memattn::extend(heads_[static_cast<std::size_t>(h)], keys.middleCols(h * d, d),
                                values.middleCols(h * dv, dv));
        });
        size_split_scratch();
    }

    /// Outputs of every query head for the tokens K/V (see the top of the file), equal
    /// to decode's; `out` must not overlap the inputs.
    void prefill(ConstMatrixRef<T> queries, ConstMatrixRef<T> keys, ConstMatrixRef<T> values, MatrixRef<T> out) {
        constexpr const char* function = "MultiHead::prefill";
        validate(keys, values, {function});  // shapes, then every head's values
        detail::check_prefill(function, queries, keys, values, out, query_dim(), output_dim());
        if (keys.rows() == 0)  // no column block of an empty (possibly null) view
            return;
        if constexpr (detail::is_plain_kv_cache<M>) {
            prefill_caches(queries, keys, values, out);
            size_split_scratch();
        } else if constexpr (detail::HasGroupPrefill<M> || detail::HasBulkPrefill<M>) {
            const Index d = layout_.head_dim, dv = layout_.values(), g = layout_.group_size();
            if (!detail::HasGroupPrefill<M> && g > 1) {
                detail::decode_rows(*this, queries, keys, values, out);
                return;
            }
            // One KV head per work item; its group's queries are g·d adjacent columns. Through
            // an executor that may throw, a memory that cannot be put back runs here.
            const SerialExecutor serial;
            const bool may_throw = !executor_.nothrow();
            const ExecutorRef run_on = may_throw && !detail::Checkpoint<M>::possible ? ExecutorRef(serial) : executor_;
            all_or_nothing(may_throw, [&] {
                detail::parallel_ranges(
                    layout_.kv_heads, [](Index) { return 1.0; },
                    [&](Index first, Index last) {
                        for (Index h = first; h < last; ++h) {
                            M& head = heads_[static_cast<std::size_t>(h)];
                            const auto q = queries.middleCols(h * g * d, g * d);
                            const auto k = keys.middleCols(h * key_width_, key_width_);
                            const auto v = values.middleCols(h * dv, dv);
                            auto o = out.middleCols(h * g * dv, g * dv);
                            if constexpr (detail::HasGroupPrefill<M>)
                                head.prefill_group(q, k, v, o);
                            else
                                head.prefill(q, k, v, o);
                        }
                    },
                    0, run_on);
            });
            size_split_scratch();
        } else {
            detail::decode_rows(*this, queries, keys, values, out);
        }
    }

    /// Throws what update/extend/prefill would throw for these packed rows, changing
    /// nothing: their shapes, then every KV head's part through the head's own validate
    /// (memattn::detail::ValidatesPairs), so a value one head refuses is found before any
    /// head takes the token. The message names the function, the KV head and the column
    /// of the packed row, e.g. "memattn::MultiHead::update: argument 'key' has the finite
    /// value 1e+05 in row 0, column 67 (column 3 of KV head 1), which float16 storage ...".
    void validate(ConstMatrixRef<T> keys, ConstMatrixRef<T> values,
                  const detail::PairSite& site = {"MultiHead::validate"}) const {
        detail::check_site_pairs(site, detail::shape(keys), detail::shape(values), key_dim(), value_dim(), length());
        if constexpr (detail::ValidatesPairs<M>) {
            if (keys.rows() == 0)  // no column block of an empty (possibly null) view
                return;
            const Index d = key_width_, dv = layout_.values();
            for (Index h = 0; h < layout_.kv_heads; ++h)
                heads_[static_cast<std::size_t>(h)].validate(
                    keys.middleCols(h * d, d), values.middleCols(h * dv, dv),
                    {site.function, site.key_name, site.value_name, h, site.key_column + h * d,
                     site.value_column + h * dv, site.first_row});
        }
    }

    /// Every head's truncate(tokens) (KVCache, SlidingWindowCache), all or nothing: throws
    /// std::invalid_argument naming the first head that cannot, every head unchanged.
    void truncate(Index tokens)
        requires detail::CanTruncate<M>
    {
        for (Index h = 0; h < layout_.kv_heads; ++h) {
            const M& head = heads_[static_cast<std::size_t>(h)];
            if (head.can_truncate(tokens))
                continue;
            try {
                heads_[static_cast<std::size_t>(h)].truncate(tokens);  // throws, unchanged, with the reason
            } catch (const std::invalid_argument& e) {
                throw std::invalid_argument("memattn::MultiHead::truncate: KV head " + std::to_string(h) +
                                            " cannot: " + e.what());
            }
        }
        for (M& head : heads_)
            head.truncate(tokens);
    }
    /// Whether truncate(tokens) would succeed on every head.
    [[nodiscard]] bool can_truncate(Index tokens) const noexcept
        requires detail::CanTruncate<M>
    {
        return std::all_of(heads_.begin(), heads_.end(), [tokens](const M& head) { return head.can_truncate(tokens); });
    }

    /// Every query head's output for the packed query row (see the top of the file).
    void attend(ConstRowRef<T> query, RowRef<T> out) const {
        detail::check_query("MultiHead::attend", query, out, query_dim(), output_dim());
        if constexpr (detail::HasPairRuns<M>)
            attend_split(query, out);
        else
            for (Index h = 0; h < layout_.kv_heads; ++h)
                attend_head(h, query, out);
    }

    /// Tokens seen since reset (every head has seen the same).
    [[nodiscard]] Index length() const noexcept { return heads_.front().length(); }
    /// Bytes of state held now, over every head.
    [[nodiscard]] std::size_t footprint() const noexcept {
        std::size_t bytes = 0;
        for (const M& head : heads_)
            bytes += head.footprint();
        return bytes;
    }
    /// Resets every head.
    void reset() {
        for (M& head : heads_)
            head.reset();
    }

    /// Widths of the packed rows: keys, values, queries, outputs.
    /// kv_heads × the heads' key width (head_dim, or a gated memory's wider key rows).
    [[nodiscard]] Index key_dim() const noexcept { return layout_.kv_heads * key_width_; }
    /// kv_heads × value_dim.
    [[nodiscard]] Index value_dim() const noexcept { return layout_.kv_heads * layout_.values(); }
    /// q_heads × head_dim.
    [[nodiscard]] Index query_dim() const noexcept { return layout_.q_heads * layout_.head_dim; }
    /// q_heads × value_dim.
    [[nodiscard]] Index output_dim() const noexcept { return layout_.q_heads * layout_.values(); }

    /// The layout it was built with.
    [[nodiscard]] const HeadLayout& layout() const noexcept { return layout_; }
    /// KV head kv's memory.
    [[nodiscard]] const M& head(Index kv) const { return heads_.at(static_cast<std::size_t>(kv)); }
    /// KV head kv's memory, writable. Both overloads throw std::out_of_range unless 0 ≤ kv < kv_heads.
    [[nodiscard]] M& head(Index kv) { return heads_.at(static_cast<std::size_t>(kv)); }

    /// Snapshots (memattn/persistence/snapshot.hpp), when M has them: the layout (q_heads,
    /// kv_heads, head_dim, value_dim), then each KV head's payload as a part of its own.
    /// Loading reads every head into a copy and swaps the copies in at the end, so a
    /// throw leaves every head as it was (and the layer holds both states meanwhile).
    [[nodiscard]] static std::string snapshot_kind()
        requires Snapshottable<M>
    {
        return "MultiHead/" + std::string(M::snapshot_kind());
    }
    /// Snapshots: writes the payload, the layout and the heads' parts listed at snapshot_kind().
    void write_snapshot(snapshot::Writer& w) const
        requires Snapshottable<M>
    {
        write_layout(w);
        for (const M& head : heads_)
            w.part([&](snapshot::Writer& part) { head.write_snapshot(part); });
    }
    /// Snapshots: reads a payload written by write_snapshot(); throws SnapshotError, every
    /// head unchanged, unless the layout is its own and every head's part loads.
    void read_snapshot(snapshot::Reader& r)
        requires Snapshottable<M>
    {
        r.expect("q_heads", layout_.q_heads);
        r.expect("kv_heads", layout_.kv_heads);
        r.expect("head_dim", layout_.head_dim);
        r.expect("value_dim", layout_.value_dim);
        std::vector<M> loaded = heads_;
        for (Index h = 0; h < layout_.kv_heads; ++h) {
            snapshot::Reader part = r.part("head " + std::to_string(h));
            loaded[static_cast<std::size_t>(h)].read_snapshot(part);
        }
        r.expect_remaining(0, "the end of the layer");
        heads_.swap(loaded);
        size_split_scratch();
    }

private:
    using GroupMap = Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>>;
    using GroupOut = Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>>;

    /// Runs `feed` on every head, after validate() has checked every head's part, and
    /// puts every head back if it throws: KV caches (which allocate as they grow: a
    /// std::bad_alloc, or the executor's own exception) by their length before the call;
    /// when `may_throw` (feed runs on an executor that may throw, ExecutorRef::nothrow)
    /// any other memory by a copy taken first (memory/detail/rollback.hpp). The fixed-size
    /// memories allocate nothing once built. A user's memory that can refuse a pair is
    /// all-or-nothing in a layer when it models detail::ValidatesPairs (a const
    /// validate(K, V, site)).
    template <class Feed>
    void all_or_nothing(bool may_throw, Feed&& feed) {
        if constexpr (detail::is_kv_cache<M>) {  // every head had the same length: no list of them
            const Index before = length();
            std::optional<detail::Checkpoint<M>> copies;  // PerChannelKeys<S>, which cannot always be cut
            if (!detail::truncates_exactly<M> && may_throw)
                copies.emplace(std::span<const M>(heads_), true);
            try {
                feed();
            } catch (...) {
                if (copies)
                    copies->restore(std::span<M>(heads_));
                else  // (a finished group of per-channel keys cannot be cut: such a head stays)
                    for (M& head : heads_)
                        if (head.length() > before && head.can_truncate(before))
                            head.truncate(before);
                throw;
            }
        } else {
            detail::all_or_nothing(std::span<M>(heads_), may_throw, std::forward<Feed>(feed));
        }
    }

    void write_layout(snapshot::Writer& w) const {
        w.index(layout_.q_heads);
        w.index(layout_.kv_heads);
        w.index(layout_.head_dim);
        w.index(layout_.value_dim);
    }

    static HeadLayout checked(const HeadLayout& layout) {
        detail::check_layout("MultiHead", layout);
        return layout;
    }

    /// Group h's queries (g × head_dim) in the packed query row, and its outputs.
    [[nodiscard]] GroupMap group_queries(const ConstRowRef<T>& query, Index h) const {
        const Index g = layout_.group_size(), d = layout_.head_dim;
        return GroupMap(query.data() + h * g * d, g, d, Eigen::OuterStride<>(d));
    }
    [[nodiscard]] GroupOut group_outputs(RowRef<T>& out, Index h) const {
        const Index g = layout_.group_size(), dv = layout_.values();
        return GroupOut(out.data() + h * g * dv, g, dv, Eigen::OuterStride<>(dv));
    }

    /// KV head h's group through its memory's own attend(s).
    void attend_head(Index h, const ConstRowRef<T>& query, RowRef<T>& out) const {
        const M& head = heads_[static_cast<std::size_t>(h)];
        const GroupMap q = group_queries(query, h);
        GroupOut o = group_outputs(out, h);
        if constexpr (detail::HasGroupAttend<M>) {
            head.attend_group(q, o);
        } else {
            for (Index m = 0; m < q.rows(); ++m)
                head.attend(q.row(m), o.row(m));
        }
    }

    /// Pairs head h's attend reads.
    [[nodiscard]] Index pairs(Index h) const {
        Index n = 0;
        heads_[static_cast<std::size_t>(h)].for_each_stored_run(
            [&n](const auto&, const auto&, Index, Index count) { n += count; });
        return n;
    }

    /// One piece of a split attend: pairs [first, last) of head h.
    struct Piece {
        Index head, first, last;
    };

    /// Folds pairs [first, last) of head h into g partial states and accumulator rows.
    void attend_piece(const Piece& piece, const GroupMap& q, SoftmaxState<T>* states, GroupOut& acc) const {
        const M& head = heads_[static_cast<std::size_t>(piece.head)];
        acc.setZero();
        const bool ahead = detail::beyond_l2([&head](const auto& f) { head.for_each_stored_run(f); });
        for (Index r0 = 0; r0 < q.rows(); r0 += detail::group_rows) {
            const Index g = std::min(detail::group_rows, q.rows() - r0);
            auto acc_rows = acc.middleRows(r0, g);
            detail::MemoryAttention<T, M> attention(head, q.middleRows(r0, g), r0, ahead);
            attention.fold(piece.first, piece.last, acc_rows);
            for (Index r = 0; r < g; ++r)
                states[r0 + r] = attention.state(r);
        }
    }

    /// attend for memories with pair runs (see the top of the file).
    void attend_split(const ConstRowRef<T>& query, RowRef<T>& out) const {
        Index total = 0, most = 0;
        for (Index h = 0; h < layout_.kv_heads; ++h) {
            total += pairs(h);
            most = std::max(most, pairs(h));
        }
        const double work = static_cast<double>(total) * static_cast<double>(layout_.group_size()) *
                            static_cast<double>(layout_.head_dim + layout_.values());
        const int threads = work < parallel_work ? 1 : 0;  // one thread: no team to start
        if (most <= split_keys) {  // one piece per head: each head's own grouped attend
            detail::parallel_ranges(
                layout_.kv_heads, [&](Index h) { return static_cast<double>(pairs(h)); },
                [&](Index first, Index last) {
                    for (Index h = first; h < last; ++h)
                        attend_head(h, query, out);
                },
                threads, executor_);
            return;
        }
        // The scratch is sized for the pieces of the heads' capacity (constructor, reserve,
        // extend, prefill, and an update whose cache grew): taken here, nothing allocates.
        // A second attend running at the same time on another thread uses scratch of its own.
        std::unique_lock<std::mutex> lock(split_.mutex, std::try_to_lock);
        const Index pieces = piece_count();
        if (lock.owns_lock() && split_.fits(pieces, layout_)) {
            attend_pieces(query, out, split_, threads);
        } else {
            SplitScratch own;
            own.size_for(pieces, layout_);
            attend_pieces(query, out, own, threads);
        }
    }

    /// Pieces of split_keys pairs (the last one of a head shorter), head by head.
    [[nodiscard]] Index piece_count() const {
        Index pieces = 0;
        for (Index h = 0; h < layout_.kv_heads; ++h)
            pieces += std::max<Index>(1, (pairs(h) + split_keys - 1) / split_keys);
        return pieces;
    }

    /// Scratch of the split attend: the pieces, each head's first piece, a state per
    /// (piece, query of the group) and an accumulator row for each.
    struct SplitScratch {
        std::mutex mutex;
        std::vector<Piece> pieces;
        std::vector<Index> first_piece;
        std::vector<SoftmaxState<T>> states;
        Matrix<T> partial;

        // A copy or a move gets scratch of the same size and a mutex of its own.
        SplitScratch() = default;
        SplitScratch(const SplitScratch& other)
            : first_piece(other.first_piece), states(other.states), partial(other.partial.rows(), other.partial.cols()) {
            pieces.reserve(other.pieces.capacity());
        }
        SplitScratch(SplitScratch&& other) noexcept
            : pieces(std::move(other.pieces)), first_piece(std::move(other.first_piece)),
              states(std::move(other.states)), partial(std::move(other.partial)) {}
        SplitScratch& operator=(SplitScratch other) noexcept {
            pieces.swap(other.pieces);
            first_piece.swap(other.first_piece);
            states.swap(other.states);
            partial.swap(other.partial);
            return *this;
        }
        ~SplitScratch() = default;

        [[nodiscard]] bool fits(Index n, const HeadLayout& layout) const {
            return static_cast<Index>(pieces.capacity()) >= n && partial.rows() >= n * layout.group_size();
        }
        void size_for(Index n, const HeadLayout& layout) {
            const Index g = layout.group_size();
            pieces.reserve(static_cast<std::size_t>(n));
            first_piece.resize(static_cast<std::size_t>(layout.kv_heads) + 1);
            states.resize(static_cast<std::size_t>(n * g));
            if (partial.rows() < n * g)
                partial.resize(n * g, layout.values());
        }
    };

    /// Sizes the split scratch for the pieces the heads can hold now (their capacity),
    /// so that attend allocates nothing. Called where the heads may have grown, after
    /// they have: if the scratch cannot grow (std::bad_alloc), it stays as it was and an
    /// attend that needs more makes its own, so the call that fed the heads still succeeds.
    void size_split_scratch() noexcept {
        if constexpr (detail::HasPairRuns<M>) {
            Index pieces = 0;
            for (const M& head : heads_)
                pieces += std::max<Index>(1, (detail::pair_capacity(head) + split_keys - 1) / split_keys);
            if (split_.fits(pieces, layout_))
                return;
            try {
                split_.size_for(pieces, layout_);
            } catch (const std::bad_alloc&) {
            }
        }
    }

    /// The split attend over `scratch` (sized for the pieces).
    void attend_pieces(const ConstRowRef<T>& query, RowRef<T>& out, SplitScratch& scratch, int threads) const {
        const Index g = layout_.group_size(), dv = layout_.values();
        std::vector<Piece>& pieces = scratch.pieces;
        pieces.clear();
        for (Index h = 0; h < layout_.kv_heads; ++h) {
            scratch.first_piece[static_cast<std::size_t>(h)] = static_cast<Index>(pieces.size());
            const Index n = pairs(h);
            for (Index j = 0; j < std::max<Index>(n, 1); j += split_keys)
                pieces.push_back({h, j, std::min(n, j + split_keys)});  // within the reserved capacity
        }
        scratch.first_piece[static_cast<std::size_t>(layout_.kv_heads)] = static_cast<Index>(pieces.size());
        // Piece 0 of a head accumulates in the output; the others in scratch.
        SoftmaxState<T>* states = scratch.states.data();
        Matrix<T>& partial = scratch.partial;
        const std::vector<Index>& first_piece = scratch.first_piece;
        detail::parallel_ranges(
            static_cast<Index>(pieces.size()),
            [&](Index i) {
                const Piece& p = pieces[static_cast<std::size_t>(i)];
                return static_cast<double>(p.last - p.first + 64);
            },
            [&](Index first, Index last) {
                for (Index i = first; i < last; ++i) {
                    const Piece& p = pieces[static_cast<std::size_t>(i)];
                    GroupOut acc = i == first_piece[static_cast<std::size_t>(p.head)]
                                       ? group_outputs(out, p.head)
                                       : GroupOut(partial.data() + i * g * dv, g, dv, Eigen::OuterStride<>(dv));
                    attend_piece(p, group_queries(query, p.head), states + i * g, acc);
                }
            },
            threads, executor_);
        // Merge each head's pieces in order, then the sink logits join, then normalise.
        for (Index h = 0; h < layout_.kv_heads; ++h) {
            const Index p0 = first_piece[static_cast<std::size_t>(h)];
            GroupOut o = group_outputs(out, h);
            const detail::DecodeLogits logits = detail::decode_logits(heads_[static_cast<std::size_t>(h)], 0);
            for (Index r = 0; r < g; ++r) {
                SoftmaxState<T>& state = states[p0 * g + r];
                for (Index p = p0 + 1; p < first_piece[static_cast<std::size_t>(h) + 1]; ++p)
                    state.merge(states[p * g + r], o.row(r), partial.row(p * g + r));
                detail::GroupAttention<T>::finish_state(state, logits, r, o.row(r));
            }
        }
    }

    /// MultiHead<KVCache>::prefill: append, then the multi-head kernel over the caches;
    /// a throw (no memory) takes every cache back to its length before the call.
    void prefill_caches(const ConstMatrixRef<T>& queries, const ConstMatrixRef<T>& keys,
                        const ConstMatrixRef<T>& values, MatrixRef<T>& out) {
        const Index d = layout_.head_dim, dv = layout_.values(), g = layout_.group_size(), before = length();
        // With RoPE the caches turn the keys they store; the kernel reads the queries turned
        // by their KV head's RoPE to their positions.
        std::optional<Matrix<T>> turned;
        for (Index h = 0; h < layout_.kv_heads; ++h) {
            const M& head = heads_[static_cast<std::size_t>(h)];
            if (!head.turns_queries())
                continue;
            if (!turned)
                turned.emplace(queries);
            for (Index i = 0; i < turned->rows(); ++i)
                head.turn_query(turned->row(i).data() + h * g * d, g * d, before + i);
        }
        const ConstMatrixRef<T> read = turned ? ConstMatrixRef<T>(*turned) : queries;
        all_or_nothing(!executor_.nothrow(), [&] {
            for (Index h = 0; h < layout_.kv_heads; ++h)
                heads_[static_cast<std::size_t>(h)].extend(keys.middleCols(h * d, d), values.middleCols(h * dv, dv));
            detail::multi_head_softmax_run<T>(
                read, out, [](Index, Index, T) {}, layout_, SoftmaxOptions{}, VarLen{}, length(),
                [this](const detail::SequenceSpan&, Index kv) {
                    const M& head = heads_[static_cast<std::size_t>(kv)];
                    return detail::HeadKeys<T>{head.keys(), head.values(), static_cast<double>(head.scale()),
                                               head.options()};
                },
                executor_);
        });
    }

    HeadLayout layout_;
    Index key_width_;  ///< each head's columns of a key row
    std::vector<M> heads_;
    mutable SplitScratch split_;  ///< the split attend's scratch (see size_split_scratch)
};

/// A layer of memories of 16-bit rows (M = KVCache<Eigen::bfloat16>, ...): the layer of
/// their float memories, MultiHead<M::FloatMemory>, behind members that take and give
/// packed rows of E (memory/detail/low_precision.hpp), so the split attend, the threads
/// and the multi-head prefill are the float layer's. The factory may return M (its float
/// memory is kept) or M::FloatMemory; head(kv) is KV head kv's float memory.
template <Memory M>
    requires LowPrecision<typename M::Scalar> && requires { typename M::FloatMemory; }
class MultiHead<M> : public detail::LowPrecisionMemory<MultiHead<typename M::FloatMemory>, typename M::Scalar> {
public:
    using detail::LowPrecisionMemory<MultiHead<typename M::FloatMemory>, typename M::Scalar>::LowPrecisionMemory;
};

namespace detail {
template <class M>
inline constexpr std::string_view memory_name<MultiHead<M>> = "MultiHead";
template <class M>
inline constexpr bool keeps_every_pair<MultiHead<M>> = keeps_every_pair<M>;
template <class M>
inline constexpr bool truncates_exactly<MultiHead<M>> = truncates_exactly<M>;
}  // namespace detail

}  // namespace memattn
