#pragma once
// SparseKVCache: every (key, value) pair, as KVCache keeps them, but an attend reads only
// the blocks of keys its query can weigh: query-aware sparsity in the manner of Quest
// (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
// Inference").
//
//   SparseKVCache<float> cache(128, 128, {.block = 8, .top_k_blocks = 256, .window = 64, .sinks = 4});
//   memattn::decode(cache, Q, K, V, O);  // each row reads ≤ 256·8 + 64 + 4 pairs of the past
//
// The pairs are cut into blocks of `block` tokens (token j is in block j / block). For
// each block the cache keeps, per key channel, the largest and the smallest stored key,
// hi and lo, and the largest magnitude of any of them, m. For a query q (its logits
// s_j = scale · q·k_j), with u = scale · q,
//
//   bound_b = Σ_i max(u_i·hi_i, u_i·lo_i) + (γ · ‖u‖₁ + δ) · m_b + δ,
//   γ = (d + 2) · ε,   δ = 2 (d + 2) · η   (η: T's smallest subnormal),
//
// which no logit of a key of block b exceeds: the sum is the largest u·k over the box
// [lo, hi] that holds the block's keys, and the other terms cover its rounding and the
// rounding of the logits themselves: relative (γ) for normal numbers, absolute (δ) where
// u, a key or a product falls below T's normal range, whose rounding error is up to
// η / 2 whatever the value. The query's term γ‖u‖₁ + δ is computed in double and rounded
// up to T (in T, γ‖u‖₁ of a subnormal u would itself lose its digits). The sum is one product: with u⁺ = max(u, 0) and
// u⁻ = min(u, 0) it is [hi | lo] · [u⁺ | u⁻]ᵀ: one pass over the blocks' bounds stored
// side by side (a group of queries: each row read once for four of them).
//
// An attend of the token at position p = length() − 1 reads
//   the sinks        tokens [0, sinks),
//   the window       tokens (p − window, p], the current one among them,
//   the chosen       the top_k_blocks blocks (the parts of them outside the two above)
//                    with the largest bounds among those holding a token of neither,
// exactly, in token order, with the memory's logit options (softcap, ALiBi, sink logits)
// and RoPE, as KVCache's attend does over those pairs. Ties go to the newer block. When
// every candidate block is chosen, the attend is KVCache's over the whole past, bitwise.
// A group of queries (attend_group: the query heads of one KV head) chooses together: a
// block's bound for the group is the largest of its queries' bounds.
//
// A step reads the bounds, 2·key_dim values per block (bfloat16 for float, rounded
// outward: hi up, lo down, so the box still holds the block; T otherwise) and its peak,
// then the chosen pairs, instead of every pair: at 131072 tokens, d = 128, float, blocks
// of 8, 8 MiB and 2 MiB instead of 128 MiB (bench/decode_bench.cpp, BM_SparseDecode:
// 1.05 ms a step against the KV cache's 14.8 ms, Intel Xeon family 6 model 167, one
// thread). What it loses is the weight of the pairs it skips: exact when the skipped
// blocks' softmax weight is nil, and, like every sparse selection, not a drop-in for a
// model that spreads its weight thinly over the whole past (docs/choosing-a-memory.md).
//
// The bounds are of the keys as stored: for a compact storage type, of the rounded keys
// the attend reads (with IntegerDot<S>, whose logits are taken on a
// rounded query, the bound is that of the exact query's logits). Keys quantised per
// channel over groups of tokens (PerChannelKeys<S>) change when their group fills, so
// they are not offered. prefill is decode's: each row chooses its own blocks, so a long
// prompt costs O(n²/block · d) in bounds. To attend a prompt densely (as Quest does),
// `extend` the cache with its pairs and run causal_softmax_attention over the prompt.

#include "memattn/kernels/decode_attention.hpp"
#include "memattn/memory/concept.hpp"
#include "memattn/memory/detail/low_precision.hpp"
#include "memattn/memory/detail/memory_checks.hpp"
#include "memattn/memory/kv_cache.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/softmax_state.hpp"
#include "memattn/storage/compact.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace memattn {

/// Which pairs a SparseKVCache attends (see sparse_kv_cache.hpp). The defaults read
/// 256 blocks of 8 tokens: blocks of 8 by measurement (docs/design.md §4.4b). A bound
/// over 16 keys is much looser than over 8: recalling one of 16384 random unit keys at
/// d = 64 through 2048 chosen pairs, blocks of 4, 8, 16, 32 retrieved 1.00, 0.99, 0.72,
/// 0.40 of them (d = 128: 1.00, 1.00, 0.92); a step at 131072 tokens, d = 128, took
/// 1.05, 0.73, 0.42 ms for blocks of 8, 16, 32, against the KV cache's 14.8 ms.
struct SparseKVOptions {
    Index block = 8;           ///< tokens per block of keys a bound covers (>= 1; see below)
    Index top_k_blocks = 256;  ///< blocks an attend chooses by their bounds (>= 0)
    Index window = 64;         ///< the newest tokens, always attended, the current one among them (>= 0; >= 1 without top_k_blocks)
    Index sinks = 4;           ///< the first tokens, always attended (>= 0)
};

namespace detail {

/// N elements on the stack, or more from the heap: the scratch of one attend.
template <class E, std::size_t N>
class StackOrHeap {
public:
    explicit StackOrHeap(Index n) {
        if (static_cast<std::size_t>(n) > N) {
            heap_.resize(static_cast<std::size_t>(n));
            data_ = heap_.data();
        }
    }
    StackOrHeap(const StackOrHeap&) = delete;
    StackOrHeap& operator=(const StackOrHeap&) = delete;
    [[nodiscard]] E* data() noexcept { return data_; }
    [[nodiscard]] const E* data() const noexcept { return data_; }
    E& operator[](Index i) noexcept { return data_[i]; }
    const E& operator[](Index i) const noexcept { return data_[i]; }

private:
    std::array<E, N> stack_;
    std::vector<E> heap_;
    E* data_ = stack_.data();
};

}  // namespace detail

/// Every (key, value) pair, attended only over the blocks a query can weigh (Quest's
/// bounds), the newest window and the sinks; see the top of the file.
/// \tparam S how the pairs are stored: T or a compact type (storage/compact.hpp), not
/// `PerChannelKeys<S>`.
template <class T, class S = T>
    requires(StorageFor<S, T> || (LowPrecision<T> && StorageFor<S, float>)) && detail::TokenKeys<S>
class SparseKVCache {
    using Inner = KVCache<T, S>;

public:
    using Scalar = T;       ///< float or double: the rows' scalar and the arithmetic's
    using StorageType = S;  ///< how the pairs are stored
    /// The storage type code snapshots record for S (docs/snapshot-format.md).
    static constexpr snapshot::TypeCode snapshot_storage = Inner::snapshot_storage;
    /// Blocks a group's bounds are computed for at a time (on the stack).
    static constexpr Index bound_rows = 64;
    /// Chosen blocks an attend keeps on the stack; beyond, it allocates.
    static constexpr Index stack_blocks = 512;

    /// `scale` multiplies q·k before the softmax; 0 means 1/sqrt(key_dim).
    SparseKVCache(Index key_dim, Index value_dim, const SparseKVOptions& sparse = {}, T scale = T(0))
        : pairs_(key_dim, value_dim, scale), sparse_(checked(sparse)) {
        size_bounds();
    }
    /// With KVCache's logit options (softcap, ALiBi slopes, sink logits; see KVCache);
    /// FpMath::bf16 is refused (its blocks' bounds are of the exact queries).
    SparseKVCache(Index key_dim, Index value_dim, const SparseKVOptions& sparse, const SoftmaxOptions& options)
        : pairs_(key_dim, value_dim, strict(options)), sparse_(checked(sparse)) {
        size_bounds();
    }
    /// With the options and rotary position embeddings (KVCache's: keys stored turned to
    /// their positions, queries turned to the newest token's; the bounds are of the turned
    /// keys, for the turned query).
    SparseKVCache(Index key_dim, Index value_dim, const SparseKVOptions& sparse, const SoftmaxOptions& options,
                  const Rope& rope)
        : pairs_(key_dim, value_dim, strict(options), rope), sparse_(checked(sparse)) {
        size_bounds();
    }

    /// Appends one pair and folds its key, as stored, into its block's bounds. A
    /// throwing update leaves the cache unchanged.
    void update(ConstRowRef<T> key, ConstRowRef<T> value) {
        validate(key, value, {"SparseKVCache::update", "key", "value"});
        reserve_blocks(length() + 1);  // may throw: nothing changed
        pairs_.update(key, value);
        fold_keys(length() - 1, length());
    }

    /// Appends many pairs (they may be views of the cache's own).
    void extend(ConstMatrixRef<T> keys, ConstMatrixRef<T> values) {
        validate(keys, values, {"SparseKVCache::extend"});
        reserve_blocks(length() + keys.rows());
        const Index before = length();
        pairs_.extend(keys, values);
        fold_keys(before, length());
    }

    /// Throws what update/extend would throw for these pairs (KVCache::validate), changing nothing.
    void validate(ConstMatrixRef<T> keys, ConstMatrixRef<T> values,
                  const detail::PairSite& site = {"SparseKVCache::validate"}) const {
        pairs_.validate(keys, values, site);
    }

    /// out = Σ_j softmax_j(s_j) v_j over the sinks, the window and the chosen blocks (see
    /// the top of the file); zero when empty.
    void attend(ConstRowRef<T> query, RowRef<T> out) const {
        detail::check_query("SparseKVCache::attend", query, out, key_dim(), value_dim());
        if (reads_everything()) {
            pairs_.attend(query, out);
            return;
        }
        const Eigen::Map<const Matrix<T>> q(query.data(), 1, query.size());
        Eigen::Map<Matrix<T>> o(out.data(), 1, out.size());
        attend_chosen(q, MatrixRef<T>(o));
    }

    /// Row r of `out` = the attend of row r of `queries` over the pairs the group chooses
    /// together (a block's bound: the largest of the queries' bounds), each pair read
    /// once for the group. Allocates nothing for top_k_blocks ≤ stack_blocks (but with
    /// RoPE for a head dim past 256).
    void attend_group(ConstMatrixRef<T> queries, MatrixRef<T> out) const {
        detail::check_group_query("SparseKVCache::attend_group", queries, out, key_dim(), value_dim());
        if (reads_everything() || queries.rows() == 0) {
            pairs_.attend_group(queries, out);
            return;
        }
        attend_chosen(queries, out);
    }

    /// The blocks an attend_group of `queries` reads besides the sinks and the window, in
    /// order (every candidate block when it reads everything). Allocates: for tests and
    /// for looking, not for a step.
    [[nodiscard]] std::vector<Index> chosen_blocks(ConstMatrixRef<T> queries) const {
        detail::require(queries.cols() == key_dim(), "SparseKVCache::chosen_blocks", "queries", "has shape ",
                        detail::shape(queries), ", expected ", queries.rows(), 'x', key_dim());
        std::vector<Index> blocks;
        const Candidates c = candidates();
        if (c.count() <= sparse_.top_k_blocks) {
            for (Index b = c.first; b < c.last; ++b)
                blocks.push_back(b);
            return blocks;
        }
        detail::StackOrHeap<Chosen, stack_blocks> chosen(sparse_.top_k_blocks);
        const Index k = choose(queries, c, chosen.data());
        for (Index i = 0; i < k; ++i)
            blocks.push_back(chosen[i].block);
        std::sort(blocks.begin(), blocks.end());
        return blocks;
    }

    /// Every block's bound for the group `queries` (the largest of its queries'), in logit
    /// units: no logit of a stored key of block b for any of the queries exceeds entry b.
    /// Allocates: for tests and for looking.
    [[nodiscard]] Vector<T> block_bounds(ConstMatrixRef<T> queries) const {
        detail::require(queries.cols() == key_dim(), "SparseKVCache::block_bounds", "queries", "has shape ",
                        detail::shape(queries), ", expected ", queries.rows(), 'x', key_dim());
        Vector<T> all(blocks());
        if (queries.rows() == 0)
            return all.setConstant(-std::numeric_limits<T>::infinity());
        const GroupBounds group(*this, queries);
        for (Index b0 = 0; b0 < blocks(); b0 += bound_rows) {
            const Index m = std::min(bound_rows, blocks() - b0);
            group.bounds(b0, m, all.data() + b0);
        }
        return all;
    }

    /// Tokens seen since reset: the pairs held.
    [[nodiscard]] Index length() const noexcept { return pairs_.length(); }
    /// Blocks begun: ceil(length() / block).
    [[nodiscard]] Index blocks() const noexcept { return (length() + sparse_.block - 1) / sparse_.block; }
    /// Bytes held now: the pairs as stored (S) and the bounds of the blocks begun.
    [[nodiscard]] std::size_t footprint() const noexcept {
        return pairs_.footprint() + static_cast<std::size_t>(blocks()) * bound_row_bytes();
    }
    /// Bytes allocated: the pairs' room and the bounds'.
    [[nodiscard]] std::size_t capacity() const noexcept {
        return pairs_.capacity() + static_cast<std::size_t>(bounds_.rows()) * bound_row_bytes();
    }
    /// Pairs it can hold before it allocates again.
    [[nodiscard]] Index pair_capacity() const noexcept {
        return std::min(pairs_.pair_capacity(), bounds_.rows() * sparse_.block);
    }
    /// Forgets every pair and keeps the allocation.
    void reset() noexcept { pairs_.reset(); }
    /// Forgets the newest pairs, keeping the first `tokens` (0 ≤ tokens ≤ length()); the
    /// bounds of the block cut through are recomputed from its remaining keys.
    void truncate(Index tokens) {
        detail::require(can_truncate(tokens), "SparseKVCache::truncate", "tokens", "is ", tokens,
                        ", expected 0 .. length() = ", length());
        pairs_.truncate(tokens);
        const Index first = tokens / sparse_.block * sparse_.block;
        fold_keys(first, tokens);
    }
    /// Whether truncate(tokens) would succeed: 0 ≤ tokens ≤ length().
    [[nodiscard]] bool can_truncate(Index tokens) const noexcept { return pairs_.can_truncate(tokens); }
    /// Allocates room for `tokens` pairs in all, so later updates up to that length do not allocate.
    void reserve(Index tokens) {
        reserve_blocks(std::max(tokens, length()));
        pairs_.reserve(tokens);
    }

    /// The key width d.
    [[nodiscard]] Index key_dim() const noexcept { return pairs_.key_dim(); }
    /// The value width dv.
    [[nodiscard]] Index value_dim() const noexcept { return pairs_.value_dim(); }
    /// The factor of q·k before the softmax (1/sqrt(key_dim) when built with 0).
    [[nodiscard]] T scale() const noexcept { return pairs_.scale(); }
    /// Which pairs it attends.
    [[nodiscard]] const SparseKVOptions& sparse_options() const noexcept { return sparse_; }
    /// The options its attends follow (KVCache::options).
    [[nodiscard]] SoftmaxOptions options() const noexcept { return pairs_.options(); }
    /// Its RoPE configuration, or nullptr.
    [[nodiscard]] const Rope* rope() const noexcept { return pairs_.rope(); }
    /// The KV cache of every pair inside it: attending it reads the whole past.
    [[nodiscard]] const KVCache<T, S>& pairs() const noexcept { return pairs_; }

    /// Snapshots (memattn/persistence/snapshot.hpp): block, top_k_blocks, window, sinks,
    /// then KVCache's payload. The bounds are not recorded: loading computes them from the
    /// stored keys. Throws SnapshotError, the cache unchanged, unless the four and
    /// KVCache's own fields are its own.
    [[nodiscard]] static std::string snapshot_kind() { return "SparseKVCache"; }
    /// Snapshots: writes the payload, the fields listed at snapshot_kind().
    void write_snapshot(snapshot::Writer& w) const {
        w.index(sparse_.block);
        w.index(sparse_.top_k_blocks);
        w.index(sparse_.window);
        w.index(sparse_.sinks);
        pairs_.write_snapshot(w);
    }
    /// Snapshots: reads a payload written by write_snapshot() into a cache built alike,
    /// then swaps it in (so a throw, of the stream or of memory, changes nothing).
    void read_snapshot(snapshot::Reader& r) {
        r.expect("block", sparse_.block);
        r.expect("top_k_blocks", sparse_.top_k_blocks);
        r.expect("window", sparse_.window);
        r.expect("sinks", sparse_.sinks);
        SparseKVCache loaded = empty_like();
        loaded.pairs_.read_snapshot(r);
        loaded.reserve_blocks(loaded.length());
        loaded.fold_keys(0, loaded.length());
        *this = std::move(loaded);
    }

private:
    /// The bounds' scalar: bfloat16 for float where rows convert in registers (half the
    /// bytes a step reads for them), else T.
    static constexpr bool compact_bounds = std::is_same_v<T, float> && detail::fused_storage;
    using Bound = std::conditional_t<compact_bounds, Eigen::bfloat16, T>;

    /// The smallest bfloat16 ≥ x, as float (x itself when it is one, ±∞ or NaN).
    static float bf16_up(float x) noexcept {
        auto u = std::bit_cast<std::uint32_t>(x);
        if ((u & 0xFFFFu) == 0 || !std::isfinite(x))
            return x;
        u &= 0xFFFF0000u;  // towards zero: up for a negative x
        if (x > 0)
            u += 0x10000u;  // the next one up (past the largest finite: +∞)
        return std::bit_cast<float>(u);
    }

    /// The chosen blocks' scratch: a block and its bound.
    struct Chosen {
        T bound;
        Index block;
    };
    /// The blocks that hold a token neither a sink nor in the window: [first, last), and
    /// the tokens [begin, end) between the sinks and the window.
    struct Candidates {
        Index begin, end, first, last;
        [[nodiscard]] Index count() const noexcept { return last - first; }
    };

    /// `options`, refused unless FpMath::strict: the bounds that choose the blocks are of
    /// the exact queries, so rounded products could pass over a block they should read.
    static const SoftmaxOptions& strict(const SoftmaxOptions& options) {
        detail::require(options.fpmath == FpMath::strict, "SparseKVCache", "options.fpmath",
                        "is not FpMath::strict: the blocks' bounds are of the exact queries (FpMath::bf16 is taken by "
                        "KVCache and SlidingWindowCache of bfloat16 or FP8 rows)");
        return options;
    }
    static SparseKVOptions checked(const SparseKVOptions& o) {
        detail::at_least(o.block, 1, "SparseKVCache", "sparse.block");
        detail::at_least(o.top_k_blocks, 0, "SparseKVCache", "sparse.top_k_blocks");
        detail::at_least(o.window, 0, "SparseKVCache", "sparse.window");
        detail::at_least(o.sinks, 0, "SparseKVCache", "sparse.sinks");
        detail::require(o.window > 0 || o.top_k_blocks > 0, "SparseKVCache", "sparse.window",
                        "is 0 with sparse.top_k_blocks = 0, which attends no token past the sinks, not even the "
                        "current one: expected a window >= 1 or blocks to choose");
        return o;
    }

    [[nodiscard]] std::size_t bound_row_bytes() const noexcept {
        return sizeof(Bound) * static_cast<std::size_t>(2 * key_dim()) + sizeof(T);
    }

    void size_bounds() {
        bounds_.resize(0, detail::checked_product("SparseKVCache", "key_dim", key_dim(), 2, "bound columns"));
        peaks_.resize(0);
    }

    /// An empty cache with this one's dims, options, RoPE and sparse options.
    [[nodiscard]] SparseKVCache empty_like() const {
        const SoftmaxOptions o = options();
        if (const Rope* r = rope(); r != nullptr)
            return SparseKVCache(key_dim(), value_dim(), sparse_, o, *r);
        return SparseKVCache(key_dim(), value_dim(), sparse_, o);
    }

    [[nodiscard]] Candidates candidates() const noexcept {
        const Index n = length(), B = sparse_.block;
        const Index begin = std::min(sparse_.sinks, n);
        const Index end = std::max(begin, n - std::min(sparse_.window, n));
        if (begin == end)
            return {begin, end, 0, 0};
        return {begin, end, begin / B, (end - 1) / B + 1};
    }

    /// Whether an attend reads every pair: the candidate blocks are at most top_k_blocks.
    [[nodiscard]] bool reads_everything() const noexcept { return candidates().count() <= sparse_.top_k_blocks; }

    /// Room for the bounds of `tokens` tokens, grown geometrically (may throw: the cache
    /// is unchanged, its bounds' room aside).
    void reserve_blocks(Index tokens) {
        const Index need = tokens / sparse_.block + (tokens % sparse_.block != 0 ? 1 : 0);
        if (need <= bounds_.rows())
            return;
        const Index rows = std::max<Index>({need, 2 * bounds_.rows(), 16});
        Matrix<Bound> grown(rows, bounds_.cols());
        Vector<T> peaks(rows);
        const Index used = std::min(blocks(), bounds_.rows());  // a load reserves after reading the pairs
        grown.topRows(used) = bounds_.topRows(used);
        peaks.head(used) = peaks_.head(used);
        bounds_.swap(grown);
        peaks_.swap(peaks);
    }

    /// Folds the stored keys of tokens [first, last) into their blocks' bounds, `first`
    /// at a block's start or inside a block whose bounds cover the tokens before it (room
    /// already reserved; allocates nothing).
    void fold_keys(Index first, Index last) noexcept {
        pairs_.for_each_stored_run([&](const auto& keys, const auto&, Index run_first, Index) {
            for (Index j = first; j < last; ++j)
                fold_key(j, keys, run_first + j);
        });
    }

    /// Token `token`'s key, row `row` of the stored keys, into its block's hi, lo and
    /// peak. Stored as bfloat16, hi is rounded up and lo down, so [lo, hi] still holds
    /// every key of the block; the peak is of the stored hi and lo.
    template <class Rows>
    void fold_key(Index token, const Rows& keys, Index row) noexcept {
        const Index d = key_dim(), b = token / sparse_.block;
        Bound* hi = &bounds_(b, 0);
        Bound* lo = hi + d;
        const bool starts = token % sparse_.block == 0;
        T peak = starts ? T(0) : peaks_[b];
        for (Index c = 0; c < d; ++c) {
            const T x = static_cast<T>(keys.stored_value(row, c));
            T up = starts ? x : std::max(static_cast<T>(hi[c]), x);
            T down = starts ? x : std::min(static_cast<T>(lo[c]), x);
            if constexpr (compact_bounds) {
                up = bf16_up(up);
                down = -bf16_up(-down);
            }
            hi[c] = static_cast<Bound>(up);  // exact: up and down are Bound values
            lo[c] = static_cast<Bound>(down);
            peak = std::max({peak, std::abs(up), std::abs(down)});
        }
        peaks_[b] = peak;
    }

    /// The bounds of a group of queries, turned (RoPE) and scaled: u = scale · q as
    /// [u⁺ | u⁻] per query, and each query's slack γ‖u‖₁ + δ (see the top of the file).
    class GroupBounds {
    public:
        GroupBounds(const SparseKVCache& cache, const ConstMatrixRef<T>& queries)
            : cache_(cache), g_(queries.rows()), d_(cache.key_dim()), split_(g_ * 2 * d_), slack_(g_) {
            Eigen::Map<Matrix<T>> split(split_.data(), g_, 2 * d_);
            const T scale = cache.scale();
            const double gamma = static_cast<double>(d_ + 2) * std::numeric_limits<T>::epsilon();
            absolute_ = static_cast<T>(2 * (d_ + 2)) * std::numeric_limits<T>::denorm_min();
            for (Index r = 0; r < g_; ++r) {
                auto u = split.row(r).head(d_);
                u = scale * queries.row(r);
                if (cache.pairs_.turns_queries())
                    cache.pairs_.turn_query(u.data(), d_, cache.length() - 1);
                slack_[r] = rounded_up(gamma * u.template cast<double>().cwiseAbs().sum() +
                                       static_cast<double>(absolute_));
                split.row(r).tail(d_) = u.cwiseMin(T(0));
                u = u.cwiseMax(T(0));
            }
        }
        /// out[i] = the bound of block b0 + i (i < m ≤ bound_rows): the group's largest.
        void bounds(Index b0, Index m, T* out) const {
            const auto peaks = cache_.peaks_.segment(b0, m);
            if constexpr (compact_bounds) {
                // Each row of bfloat16 bounds converted in registers once per four queries.
                const Index ahead = std::max<Index>(1, 4096 / (4 * d_));  // rows 4 KiB ahead
                for (Index i = 0; i < m; ++i) {
                    const Bound* row = &cache_.bounds_(b0 + i, 0);
                    if (b0 + i + ahead < cache_.bounds_.rows())
                        detail::prefetch_rows(row + ahead * 2 * d_, 1, 0, 2 * d_);
                    T best = -std::numeric_limits<T>::infinity();
                    for (Index r0 = 0; r0 < g_; r0 += 4) {
                        float sums[4];
                        switch (std::min<Index>(4, g_ - r0)) {
                            case 1: row_dots<1>(row, r0, sums); break;
                            case 2: row_dots<2>(row, r0, sums); break;
                            case 3: row_dots<3>(row, r0, sums); break;
                            default: row_dots<4>(row, r0, sums); break;
                        }
                        for (Index r = 0; r < std::min<Index>(4, g_ - r0); ++r)
                            best = std::max(best, sums[r] + slack_[r0 + r] * peaks[i] + absolute_);
                    }
                    out[i] = best;
                }
            } else {
                const Eigen::Map<const Matrix<T>> split(split_.data(), g_, 2 * d_);
                const auto rows = cache_.bounds_.middleRows(b0, m);
                if (g_ == 1) {
                    Eigen::Map<Vector<T>> s(out, m);
                    s.noalias() = split.row(0) * rows.transpose();
                    s += slack_[0] * peaks;
                    s.array() += absolute_;
                    return;
                }
                alignas(64) T buffer[bound_rows * detail::group_rows];
                for (Index i = 0; i < m; ++i)
                    out[i] = -std::numeric_limits<T>::infinity();
                for (Index r0 = 0; r0 < g_; r0 += detail::group_rows) {
                    const Index g = std::min(detail::group_rows, g_ - r0);
                    Eigen::Map<Matrix<T>> s(buffer, m, g);
                    s.noalias() = rows * split.middleRows(r0, g).transpose();
                    for (Index i = 0; i < m; ++i)
                        for (Index r = 0; r < g; ++r)
                            out[i] = std::max(out[i], s(i, r) + slack_[r0 + r] * peaks[i] + absolute_);
                }
            }
        }

    private:
        /// sums[r] = [u⁺ | u⁻] of query r0 + r · a row of bfloat16 bounds, r < G: the row
        /// converted in registers once for the G queries (one query: two accumulators).
        template <int G, class B>
        void row_dots(const B* row, Index r0, float* sums) const {
            using namespace Eigen::internal;
            using P = detail::Packet<float>;
            constexpr Index lanes = detail::packet_lanes<float>;
            const Index n = 2 * d_, packed = n / lanes * lanes;
            const float* u = split_.data() + r0 * n;
            P acc[G], extra = pset1<P>(0.0f);
            for (int r = 0; r < G; ++r)
                acc[r] = pset1<P>(0.0f);
            Index c = 0;
            if constexpr (G == 1) {  // two chains: the latency of one FMA would bind
                for (; c + 2 * lanes <= packed; c += 2 * lanes) {
                    acc[0] = pmadd(ploadu<P>(u + c), detail::load_packet(row + c), acc[0]);
                    extra = pmadd(ploadu<P>(u + c + lanes), detail::load_packet(row + c + lanes), extra);
                }
            }
            for (; c < packed; c += lanes) {
                const P x = detail::load_packet(row + c);
                for (int r = 0; r < G; ++r)
                    acc[r] = pmadd(ploadu<P>(u + r * n + c), x, acc[r]);
            }
            acc[0] = padd(acc[0], extra);
            for (int r = 0; r < G; ++r) {
                sums[r] = predux(acc[r]);
                for (Index t = packed; t < n; ++t)
                    sums[r] += u[r * n + t] * static_cast<float>(row[t]);
            }
        }

        const SparseKVCache& cache_;
        Index g_, d_;
        detail::StackOrHeap<T, 4096> split_;
        detail::StackOrHeap<T, 64> slack_;
        T absolute_;  ///< δ, the absolute part of the slack

        /// x in T, rounded up rather than to nearest.
        static T rounded_up(double x) noexcept {
            const T y = static_cast<T>(x);
            return static_cast<double>(y) < x ? std::nextafter(y, std::numeric_limits<T>::infinity()) : y;
        }
    };

    /// Whether block a (bound x) ranks above block b (bound y): larger bound, then newer.
    static bool better(const Chosen& a, const Chosen& b) noexcept {
        return a.bound > b.bound || (a.bound == b.bound && a.block > b.block);
    }

    /// The top_k_blocks candidates with the largest bounds for `queries` into `chosen`
    /// (a heap, worst first, not in order); returns how many (top_k_blocks, fewer only if
    /// the candidates are fewer). A NaN bound (a NaN query) ranks last.
    Index choose(const ConstMatrixRef<T>& queries, const Candidates& c, Chosen* chosen) const {
        const Index k = std::min(sparse_.top_k_blocks, c.count());
        if (k == 0)
            return 0;
        const GroupBounds group(*this, queries);
        const auto worse_first = [](const Chosen& a, const Chosen& b) { return better(a, b); };
        alignas(64) T bound[bound_rows];
        Index held = 0;
        for (Index b0 = c.first; b0 < c.last; b0 += bound_rows) {
            const Index m = std::min(bound_rows, c.last - b0);
            group.bounds(b0, m, bound);
            for (Index i = 0; i < m; ++i) {
                const Chosen x{std::isnan(bound[i]) ? -std::numeric_limits<T>::infinity() : bound[i], b0 + i};
                if (held < k) {
                    chosen[held++] = x;
                    std::push_heap(chosen, chosen + held, worse_first);
                } else if (better(x, chosen[0])) {
                    std::pop_heap(chosen, chosen + held, worse_first);
                    chosen[held - 1] = x;
                    std::push_heap(chosen, chosen + held, worse_first);
                }
            }
        }
        return held;
    }

    /// The pairs an attend reads, as runs of tokens in order, and the memory's face
    /// (decode_attention.hpp's MemoryAttention) over them.
    struct Run {
        Index first, count, offset;  ///< tokens [first, first + count), the offset-th pair read on
    };
    class Selection {
    public:
        using Scalar = T;
        Selection(const SparseKVCache& cache, const Run* runs, Index count) : cache_(cache), runs_(runs), count_(count) {}
        template <class F>
        void for_each_stored_run(F&& f) const {
            cache_.pairs_.for_each_stored_run([&](const auto& keys, const auto& values, Index first, Index) {
                // The runs lie apart in memory: each is asked for two runs before it is read.
                const auto ask = [&](Index i) {
                    if (i < count_)
                        for (Index j = first + runs_[i].first, end = j + runs_[i].count; j < end; ++j) {
                            keys.prefetch_row(j);
                            values.prefetch_row(j);
                        }
                };
                ask(0);
                ask(1);
                for (Index i = 0; i < count_; ++i) {
                    ask(i + 2);
                    f(keys, values, first + runs_[i].first, runs_[i].count);
                }
            });
        }
        [[nodiscard]] T scale() const noexcept { return cache_.scale(); }
        [[nodiscard]] Index length() const noexcept { return cache_.length(); }
        [[nodiscard]] SoftmaxOptions options() const noexcept { return cache_.options(); }
        /// The token position of the i-th pair read.
        [[nodiscard]] Index pair_position(Index i) const noexcept {
            const Run* run = std::upper_bound(runs_, runs_ + count_, i,
                                              [](Index x, const Run& r) { return x < r.offset; }) - 1;
            return run->first + (i - run->offset);
        }
        [[nodiscard]] bool turns_queries() const noexcept { return cache_.pairs_.turns_queries(); }
        [[nodiscard]] Index query_position(Index i) const noexcept { return cache_.pairs_.query_position(i); }
        void turn_query(T* row, Index cols, Index p) const noexcept { cache_.pairs_.turn_query(row, cols, p); }

    private:
        const SparseKVCache& cache_;
        const Run* runs_;
        Index count_;
    };

    /// The attend of a group over the sinks, the chosen blocks and the window.
    void attend_chosen(const ConstMatrixRef<T>& queries, MatrixRef<T> out) const {
        const Candidates c = candidates();
        detail::StackOrHeap<Chosen, stack_blocks> chosen(sparse_.top_k_blocks);
        const Index k = choose(queries, c, chosen.data());
        std::sort(chosen.data(), chosen.data() + k, [](const Chosen& a, const Chosen& b) { return a.block < b.block; });
        detail::StackOrHeap<Run, stack_blocks + 2> runs(k + 2);
        Index count = 0, offset = 0;
        const auto add = [&](Index first, Index last) {
            if (first >= last)
                return;
            if (count > 0 && runs[count - 1].first + runs[count - 1].count == first) {
                runs[count - 1].count += last - first;
            } else {
                runs[count++] = Run{first, last - first, offset};
            }
            offset += last - first;
        };
        add(0, c.begin);
        for (Index i = 0; i < k; ++i) {
            const Index b = chosen[i].block;
            add(std::max(c.begin, b * sparse_.block), std::min(c.end, (b + 1) * sparse_.block));
        }
        add(c.end, length());
        const Selection selection(*this, runs.data(), count);
        detail::attend_memory_group<T>(selection, queries, out);
    }

    KVCache<T, S> pairs_;
    SparseKVOptions sparse_;
    Matrix<Bound> bounds_;  ///< row b: [hi | lo] of block b's stored keys (bfloat16: rounded outward)
    Vector<T> peaks_;       ///< entry b: the largest |hi|, |lo| of block b
};

/// SparseKVCache of 16-bit rows (E = Eigen::bfloat16 or Eigen::half): SparseKVCache<float, S>
/// behind members that take and give rows of E (memory/detail/low_precision.hpp).
template <LowPrecision E, class S>
    requires StorageFor<S, float> && detail::TokenKeys<S>
class SparseKVCache<E, S> : public detail::LowPrecisionMemory<SparseKVCache<float, S>, E> {
public:
    using detail::LowPrecisionMemory<SparseKVCache<float, S>, E>::LowPrecisionMemory;
};

namespace detail {
template <class S>
inline constexpr std::string_view memory_name<SparseKVCache<float, S>> = "SparseKVCache";
template <class S>
inline constexpr bool keeps_every_pair<SparseKVCache<float, S>> = true;
}  // namespace detail

}  // namespace memattn
