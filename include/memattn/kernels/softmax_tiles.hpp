#pragma once
// The tiled causal softmax kernel itself (TiledCausalSoftmax): its tiles, its scratch,
// the logit rule of one head, and the tile loop. kernels/causal_softmax.hpp describes
// the algorithm and the measurements, and holds the checks and the entry points.

#include "memattn/detail/tile_product.hpp"
#include "memattn/kernels/softmax_masks.hpp"
#include "memattn/kernels/softmax_options.hpp"
#include "memattn/kernels/softmax_products.hpp"
#include "memattn/kernels/softmax_rows.hpp"
#include "memattn/softmax_state.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace memattn::detail {

/// Rows of a query tile under a window. With 16 registers (AVX2, 6 × 2 blocking) 48: a
/// whole number of 6-row strips in P·V and of 2-packet column blocks in Sᵀ, so no
/// product runs a leftover micro-tile. With 32 registers (AVX-512, 6 × 4) 64, one column
/// block of Sᵀ. Full causal calls take three times as many (144 or 192), so that each
/// K/V tile, read from L3 or DRAM once per query tile, serves three times the work. The
/// AVX-512 sizes were measured on an Intel Xeon (see the top of kernels/causal_softmax.hpp).
inline constexpr Index window_query_tile = vector_registers >= 32 ? 64 : 48;

/// Rows of a query tile and of a key tile (measured: see the top of kernels/causal_softmax.hpp).
struct SoftmaxTiles {
    Index queries = 3 * window_query_tile;
    Index keys = 128;
    friend constexpr bool operator==(const SoftmaxTiles&, const SoftmaxTiles&) = default;
};

/// The tiles for a call: under a window, narrower query tiles (a query tile's keys span
/// window + queries − 1 for `window` useful ones) and shorter key tiles (a key tile cut
/// by the window's edge is partly wasted).
constexpr SoftmaxTiles default_tiles(Index window) {
    return window > 0 ? SoftmaxTiles{window_query_tile, 96} : SoftmaxTiles{};
}

/// A window of at least Nk keys limits nothing: 0, so no position arithmetic sees a
/// window near the largest Index.
constexpr Index effective_window(Index window, Index keys) { return window >= keys ? 0 : window; }

/// The query lanes of a tile's buffers are a multiple of this: two of T's packets, and for
/// float at least the 16 lanes the bfloat16 products load and store whole (a portable
/// build's packets are narrower than theirs: 4 floats on plain x86-64).
template <class T>
inline constexpr Index lane_multiple =
    std::is_same_v<T, float> ? std::max<Index>(2 * packet_lanes<T>, 16) : 2 * packet_lanes<T>;

/// The scratch of the tiled kernel (see the top of kernels/causal_softmax.hpp), allocated once and reused
/// by every call on the same d, dv and tiles: a multi-head call keeps one per thread.
template <class T>
struct SoftmaxScratch {
    SoftmaxScratch(Index d, Index dv, SoftmaxTiles tiles)
        : tiles(tiles), lanes(round_up(tiles.queries, lane_multiple<T>)), qt(d, lanes), s(tiles.keys, lanes),
          acc(lanes, dv), state(lanes) {}

    /// Bytes of scratch: all the extra memory a call needs, whatever Nq and Nk.
    static std::size_t bytes(Index d, Index dv, SoftmaxTiles tiles) {
        const Index lanes = round_up(tiles.queries, lane_multiple<T>);
        return sizeof(T) * static_cast<std::size_t>(lanes * (d + tiles.keys + dv + 3));
    }

    SoftmaxTiles tiles;
    Index lanes;
    Matrix<T> qt, s, acc;
    SoftmaxBlockState<T> state;
    Matrix<T> bias, bias_rows;  // a tile of a dense bias, mask or tree: keys × lanes, and as filled
    // bfloat16 products (detail/bf16_product.hpp), sized by the kernel that uses them:
    // the query tile's transpose, the weights and the value tile as pairs of bfloat16.
    std::vector<std::uint32_t> query_pairs, weight_pairs, value_pairs;
    // 16-bit inputs converted to float, a tile of Q, K and V (ConvertedRows), on first use
    Matrix<float> converted_q, converted_k, converted_v;
};

/// What the tiled kernel does to a logit beyond scale·q·k, for one head (SoftmaxOptions,
/// kernels/softmax_options.hpp): the causal rule, a softcap, an ALiBi slope, a sink logit.
struct LogitRule {
    bool causal = true;   ///< keys after a query are masked
    double softcap = 0;   ///< c > 0: s ← c·tanh(s/c); 0: off
    bool alibi = false;   ///< s ← s − slope·|p − j|
    double slope = 0;     ///< ALiBi's slope
    bool sink = false;    ///< a logit σ joins each query's denominator with no value
    double sink_logit = 0;  ///< σ (−∞: none)

    /// The rule of a single head's options (their spans of one value).
    static LogitRule of(const SoftmaxOptions& options) {
        LogitRule rule;
        rule.causal = options.causal;
        rule.softcap = options.softcap;
        rule.alibi = !options.alibi_slopes.empty();
        rule.slope = rule.alibi ? options.alibi_slopes[0] : 0;
        rule.sink = !options.sink_logits.empty() && !std::isinf(options.sink_logits[0]);
        rule.sink_logit = rule.sink ? options.sink_logits[0] : 0;
        return rule;
    }
};

/// The tiled kernel for one call on a scratch: its steps (see the top of kernels/causal_softmax.hpp). The
/// products use the register blocking B (detail/tile_product.hpp), which changes no bit.
/// Q, K and V are read through row sources: PlainRows (in place), DecodedRows (compact
/// storage, converted tile by tile) or ConvertedRows (bfloat16 or float16 inputs). The
/// two products of a tile are the Products' (kernels/softmax_products.hpp): T's FMAs, or,
/// when all three sources hold bfloat16 pairs (ConvertedRows<Eigen::bfloat16> on
/// AVX512-BF16), bfloat16 arithmetic with the softmax in float.
template <class T, class B = DefaultBlocking, class KRows = PlainRows<T>, class VRows = PlainRows<T>,
          class QRows = PlainRows<T>, class Products = TileProductsFor<T, B, QRows, KRows, VRows>>
class TiledCausalSoftmax {
    static_assert(!(QRows::pairs && KRows::pairs && VRows::pairs) || std::is_same_v<T, float>);

public:
    TiledCausalSoftmax(QRows Q, KRows K, VRows V, T scale, Index window, Index sinks, SoftmaxScratch<T>& scratch,
                       const LogitRule& rule = {}, TileBias<T> bias = {})
        : q_(std::move(Q)), k_(std::move(K)), v_(std::move(V)), scale_(scale), window_(window), sinks_(sinks),
          tiles_(scratch.tiles), lanes_(scratch.lanes), s_(scratch.s), acc_(scratch.acc), state_(scratch.state),
          bias_tile_(scratch.bias), bias_rows_(scratch.bias_rows), products_(scratch, k_.cols(), v_.cols()),
          query_offset_(k_.rows() - q_.rows()), rule_(rule), bias_(bias),
          softcap2_(static_cast<T>(rule.softcap * log2e)), slope2_(static_cast<T>(rule.slope * log2e)) {
        MEMATTN_DASSERT(scratch.qt.rows() == k_.cols() && acc_.cols() == v_.cols());
        if (bias_ && (bias_tile_.rows() != tiles_.keys || bias_tile_.cols() != lanes_)) {
            bias_tile_ = Matrix<T>::Zero(tiles_.keys, lanes_);
            bias_rows_.resize(lanes_, tiles_.keys);
        }
    }

    /// Query row i sits at position query_offset + i of the keys (by default Nk − Nq, the
    /// queries continuing the keys). Under the causal rule any offset ≥ 0 works: keys
    /// past a query's position are its future, and an offset past the keys' end makes
    /// every key its past (a block of keys wholly before the queries, as in ring
    /// attention). Without it (cross attention) the offset may be negative.
    void set_query_offset(Index offset) {
        MEMATTN_DASSERT(offset >= 0 || !rule_.causal);
        query_offset_ = offset;
    }

    /// Bytes of scratch one call allocates: all the extra memory it needs, whatever Nq and Nk
    /// (with the Products' own buffers, such as the bfloat16 products' pairs).
    static std::size_t scratch_bytes(Index d, Index dv, SoftmaxTiles tiles) {
        const Index lanes = round_up(tiles.queries, lane_multiple<T>);
        return SoftmaxScratch<T>::bytes(d, dv, tiles) + Products::extra_bytes(d, dv, lanes, tiles.keys);
    }

    /// Writes O (of T, or of the inputs' bfloat16 or float16) and calls lse(i, lse_i) for
    /// every query row i.
    template <class E, class LseSink>
    void run(MatrixRef<E> O, LseSink&& lse) {
        TiledCausalSoftmax* self = this;
        run_together<E>(std::span<TiledCausalSoftmax* const>(&self, 1), [&](std::size_t) { return O; },
                        [&](std::size_t, Index i, T value) { lse(i, value); });
    }

    /// run() for several kernels that read the same keys and values (the query heads of a
    /// GQA group, each with its own queries, outputs, logit rule and scratch) and walk the
    /// same key tiles: the same query rows, window, sinks, offset and tree, so the same
    /// tiles in the same order. Each key tile is folded into every kernel's query tile
    /// before the next, so a K/V tile read from L3 or DRAM serves them all from L1/L2
    /// (kernel by kernel, each head's walk read the head's keys and values again, and a
    /// group's do not fit L2). Each kernel's steps are those of its run() alone, so its
    /// results are too, bit for bit. output(k): kernel k's O (a MatrixRef<E>); lse(k, i,
    /// value): kernel k's row i.
    template <class E, class Output, class LseSink>
    static void run_together(std::span<TiledCausalSoftmax* const> kernels, Output&& output, LseSink&& lse) {
        MEMATTN_DASSERT(!kernels.empty());
        TiledCausalSoftmax& lead = *kernels[0];
        for (Index i0 = 0; i0 < lead.q_.rows(); i0 += lead.tiles_.queries) {
            const Index rows = std::min(lead.tiles_.queries, lead.q_.rows() - i0);
            for (std::size_t k = 0; k < kernels.size(); ++k) {
                MatrixRef<E> O = output(k);
                kernels[k]->start_query_tile(i0, rows, O);
            }
            const Range keys = lead.key_range();
            for ([[maybe_unused]] TiledCausalSoftmax* kernel : kernels)  // the same walk for every kernel
                MEMATTN_DASSERT(kernel->key_range().first == keys.first && kernel->key_range().end == keys.end &&
                                kernel->sinks_ == lead.sinks_ && kernel->k_.rows() == lead.k_.rows());
            const auto attend = [&](Index j0, Index n) {
                for (TiledCausalSoftmax* kernel : kernels)
                    kernel->attend_key_tile(j0, n);
            };
            const Index lo = keys.first, hi = keys.end;
            // Diagonal tile first. Where the walk goes down to key 0 (no window's edge),
            // tiles start at multiples of the tile's length, as many as walked down from
            // hi, so that a source cut into blocks of that length (a pool's, of 128
            // tokens) gives every tile from one block, in place: tiles walked down from
            // hi crossed a block's edge whenever hi was not a multiple, and were copied.
            // Above a window's edge aligned tiles would add one there (and a window's
            // tiles, 96 keys, match no block), so those end at the diagonal.
            for (Index j1 = hi; j1 > lo;) {
                const Index j0 = lo == 0 ? (j1 - 1) / lead.tiles_.keys * lead.tiles_.keys
                                         : std::max(lo, j1 - lead.tiles_.keys);
                lead.prefetch_key_tile(std::max(lo, j0 - lead.tiles_.keys), j0);  // the next one
                attend(j0, j1 - j0);
                j1 = j0;
            }
            const Index sink_end = std::min({lead.sinks_, lo, hi});  // sinks below the window
            for (Index j0 = 0; j0 < sink_end; j0 += lead.tiles_.keys)
                attend(j0, std::min(lead.tiles_.keys, sink_end - j0));
            if (!lead.rule_.causal) {  // and, both ways, sinks past the window's end
                const Index begin = std::max(hi, lo), end = std::min(lead.sinks_, lead.k_.rows());
                for (Index j0 = begin; j0 < end; j0 += lead.tiles_.keys)
                    attend(j0, std::min(lead.tiles_.keys, end - j0));
            }
            for (std::size_t k = 0; k < kernels.size(); ++k) {
                MatrixRef<E> O = output(k);
                kernels[k]->finish_query_tile(O, [&](Index i, T value) { lse(k, i, value); });
            }
        }
    }

private:
    /// Loads log2(e)·scale·Q_tileᵀ (base-2 logits, see SoftmaxBlockState) into the
    /// products and empties the accumulators for queries [i0, i0 + rows).
    /// And asks for the next query tile's rows of Q and O (of `O`) towards L2, a few lines
    /// per strip of this tile's products: with a window, a tile's Q and O are a large
    /// share of what it reads and writes (0.1 read them as they came: 7% of a windowed call).
    template <class E>
    void start_query_tile(Index i0, Index rows, MatrixRef<E>& O) {
        i0_ = i0;
        rows_ = rows;
        cols_ = std::min(lanes_, round_up(rows, std::max(packet_lanes<T>, Products::lane_multiple)));
        p0_ = query_offset_ + i0;
        p1_ = p0_ + rows - 1;
        products_.load_queries(q_, i0, rows, cols_, scale_ * T(log2e));
        acc_.topRows(cols_).setZero();
        state_.reset();
        ahead_.clear();
        if (const Index next = i0 + tiles_.queries, n = std::min(tiles_.queries, q_.rows() - next); n > 0) {
            ahead_.add(q_.row(next), n, q_.stride(), q_.cols());
            ahead_.template add<E, true>(O.data() + next * O.outerStride(), n, O.outerStride(), O.cols());
        }
    }

    /// The current query tile's keys [lo, hi): causal, [0, p1] within the window; else
    /// the window both ways; a tree's window in its positions.
    [[nodiscard]] Range key_range() const {
        const Index hi = rule_.causal  ? std::min(p1_ + 1, k_.rows())
                         : window_ > 0 ? std::clamp<Index>(p1_ + window_, 0, k_.rows())
                                       : k_.rows();
        Index lo = window_ > 0 ? std::clamp<Index>(p0_ - window_ + 1, 0, k_.rows()) : 0;
        if (bias_.first != nullptr)
            lo = std::clamp<Index>(bias_.first(bias_.context, i0_, rows_), lo, k_.rows());
        return {lo, hi};
    }

    /// Keys and values [j0, j1) towards L2 while the current tile computes.
    void prefetch_key_tile(Index j0, Index j1) const {
        k_.prefetch(j0, j1);
        v_.prefetch(j0, j1);
    }

    /// Folds keys [j0, j0 + n) into every query of the tile.
    void attend_key_tile(Index j0, Index n) {
        // Sᵀ = K_tile · (log2(e)·scale·Q_tile)ᵀ, keys × queries.
        // A tile that crosses the diagonal or the window's edge computes, per strip of
        // keys, only the query lanes that see one of them (the rest is masked below).
        biased_ = false;
        if (bias_ && !fill_bias(j0, n))
            return;  // the bias masks every key of the tile for every query
        const bool masked = !fully_visible(j0, n);
        // The AMX tiles leave the logits' factor to the softmax where no logit option
        // reads the scaled logits (a mask's −∞ stays −∞ times a positive factor).
        T left = 0;
        bool scored = false;
        if constexpr (requires { products_.scores_leaving_factor(k_, j0, n, cols_, s_.data(), &ahead_); }) {
            if (rule_.softcap == 0 && !rule_.alibi && !biased_) {
                left = products_.scores_leaving_factor(k_, j0, n, cols_, s_.data(), &ahead_);
                scored = true;
            }
        }
        if (masked) {
            if (!scored)
                products_.scores(k_, j0, n, cols_, s_.data(), LanesSeeingKeys{*this, j0}, &ahead_);
            transform_logits(j0, n);
            mask(j0, n);
        } else {
            if (!scored)
                products_.scores(k_, j0, n, cols_, s_.data(), WholeStrip{}, &ahead_);
            transform_logits(j0, n);
        }
        if constexpr (requires { products_.absorb(state_, s_.data(), n, lanes_, cols_, left); })
            products_.absorb(state_, s_.data(), n, lanes_, cols_, left);  // m, sum, α; Pᵀ where the products keep it
        else if (left > T(0))  // m, sum, α; Sᵀ becomes Pᵀ
            state_.absorb_scaled(s_.data(), n, lanes_, cols_, left, typename Products::Rounding{});
        else
            state_.absorb(s_.data(), n, lanes_, cols_, typename Products::Rounding{});
        // acc = α ⊙ acc + P · V_tile. A masked weight is 0, and 0 · ∞ = NaN: where V_tile is
        // not all finite, a masked or biased tile goes query by query over the keys each
        // one sees (O(n·dv) to check, against O(lanes·n·dv) for the product), so a bad
        // value poisons only the queries that see it.
        const auto careful = [&](const T* values, Index ldv) {
            if (biased_)  // weights the bias made 0 must not meet ∞
                accumulate_weighted_keys(n, values, ldv);
            else if (masked)
                accumulate_visible_keys(j0, n, values, ldv);
            else  // every query sees every key: the plain product, in T
                tile_product<T, B>(cols_, v_.cols(), n, s_.data(), 1, lanes_, values, ldv, acc_.data(), v_.cols(),
                                   state_.alpha(), {}, &ahead_);
        };
        const bool zeros_matter = masked || biased_;
        if (masked)
            products_.accumulate(v_, j0, n, cols_, s_.data(), acc_.data(), state_.alpha(), zeros_matter,
                                 KeysSeenByLanes{*this, j0, n}, &ahead_, careful);
        else
            products_.accumulate(v_, j0, n, cols_, s_.data(), acc_.data(), state_.alpha(), zeros_matter,
                                 WholeStrip{}, &ahead_, careful);
    }

    /// The bias tile of keys [j0, j0 + n) for the query tile (zero in the padding lanes),
    /// biased_ when it adds anything; false when it masks every (query, key) pair of it.
    bool fill_bias(Index j0, Index n) {
        if (bias_.rows != nullptr) {  // in place: transposed from the caller's rows
            const T* src = bias_.rows + i0_ * bias_.stride + j0;
            // The key tile after next asked for now (the walk goes down from the diagonal):
            // a d = 64 call with a 4096² bias costs +23–26% of the plain one so, against
            // +31–33% asking for the next tile only (the loads still stalled on it).
            const Index ahead = std::min(j0, 2 * n);
            prefetch_rows(src - ahead, rows_, bias_.stride, std::min(ahead, n));
            transpose(src, rows_, n, bias_.stride, bias_tile_.data(), lanes_);
            const Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>> tile(bias_tile_.data(), n, rows_,
                                                                            Eigen::OuterStride<>(lanes_));
            if (!(tile.array() != -std::numeric_limits<T>::infinity()).any())
                return false;
            biased_ = true;
            return true;
        }
        const Index ld = bias_rows_.cols();
        const TileCover cover = bias_.fill(bias_.context, i0_, rows_, j0, n, bias_rows_.data(), ld);
        if (cover == TileCover::open)
            return true;
        if (cover == TileCover::closed)
            return false;
        const Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>> filled(bias_rows_.data(), rows_, n,
                                                                          Eigen::OuterStride<>(ld));
        if (!(filled.array() != -std::numeric_limits<T>::infinity()).any())
            return false;
        transpose(bias_rows_.data(), rows_, n, ld, bias_tile_.data(), lanes_);  // key-major, as Sᵀ
        biased_ = true;
        return true;
    }

    /// acc_i = α_i·acc_i + Σ_j p_ji v_j over the keys with a weight p_ji ≠ 0 only: a
    /// value row that is not finite reaches only the queries that see it.
    void accumulate_weighted_keys(Index n, const T* values, Index ldv) {
        const Index dv = v_.cols();
        for (Index i = 0; i < rows_; ++i) {
            Eigen::Map<Vector<T>> acc(acc_.data() + i * dv, dv);
            acc *= state_.alpha()[i];
            for (Index jj = 0; jj < n; ++jj)
                if (const T p = s_(jj, i); p != T(0))
                    acc += p * Eigen::Map<const Vector<T>>(values + jj * ldv, dv);
        }
    }

    /// Softcap, then ALiBi, on the logits Sᵀ of keys [j0, j0 + n) (base 2, as the tile
    /// holds them: c·tanh(s/c) and −slope·|p − j| are scaled by log2(e) like s). Lanes a
    /// masked tile did not compute hold anything; mask() overwrites them after.
    void transform_logits(Index j0, Index n) {
        if (rule_.softcap > 0) {
            const T inverse = T(1) / softcap2_;
            for (Index jj = 0; jj < n; ++jj) {
                Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>> row(s_.data() + jj * lanes_, cols_);
                row = (row * inverse).tanh() * softcap2_;
            }
        }
        if (rule_.alibi) {
            for (Index jj = 0; jj < n; ++jj) {
                T* row = s_.data() + jj * lanes_;
                const Index offset = p0_ - (j0 + jj);  // p − j of lane 0
                for (Index i = 0; i < cols_; ++i)
                    row[i] -= slope2_ * static_cast<T>(offset + i < 0 ? -(offset + i) : offset + i);
            }
        }
        if (biased_) {  // the bias in base 2; −∞ masks the key, whatever its logit (a NaN too)
            const T factor = static_cast<T>(log2e), masked = -std::numeric_limits<T>::infinity();
            for (Index jj = 0; jj < n; ++jj) {
                T* row = s_.data() + jj * lanes_;
                const T* b = bias_tile_.data() + jj * lanes_;
                for (Index i = 0; i < cols_; ++i)
                    row[i] = b[i] == masked ? masked : row[i] + factor * b[i];
            }
        }
    }

    /// Query lanes [first, end) that see key j: j ≤ p0 + i (causal) and, unless j is a
    /// sink, |p0 + i − j| < window.
    [[nodiscard]] Range lanes_seeing(Index j) const {
        const bool anywhere = window_ == 0 || j < sinks_;
        const Index first = rule_.causal ? std::clamp<Index>(j - p0_, 0, cols_)
                            : anywhere   ? 0
                                         : std::clamp<Index>(j - window_ + 1 - p0_, 0, cols_);
        const Index end = anywhere ? cols_ : std::clamp<Index>(j + window_ - p0_, first, cols_);
        return {first, end};
    }

    /// The keys of [j0, j0 + n) that lane i sees lie in [first, end), relative to j0
    /// (empty when it sees none): the sinks below its window, then (p − window, p].
    [[nodiscard]] Range keys_seen(Index i, Index j0, Index n) const {
        Index first = n, end = 0;
        for (const Range& run : visible_runs(p0_ + i)) {
            const Index begin = std::max(run.first, j0), stop = std::min(run.end, j0 + n);
            if (begin < stop) {
                first = std::min(first, begin - j0);
                end = std::max(end, stop - j0);
            }
        }
        return {first, end};
    }

    /// The keys position p sees, as three runs in key order (some empty): the sinks below
    /// its window, the window, and (not causal) the sinks past the window's end.
    [[nodiscard]] std::array<Range, 3> visible_runs(Index p) const {
        const Index nk = k_.rows();
        const Index window_begin = window_ == 0 ? 0 : std::clamp<Index>(p - window_ + 1, 0, nk);
        const Index window_end = rule_.causal ? std::clamp<Index>(p + 1, 0, nk)
                                 : window_ == 0 ? nk
                                                : std::clamp<Index>(p + window_, 0, nk);
        const Index below = std::min(sinks_, std::min(window_begin, window_end));
        const Index past = rule_.causal ? window_end : std::max(window_end, std::min(sinks_, nk));
        return {Range{0, below}, Range{window_begin, window_end}, Range{window_end, past}};
    }

    /// The band of Sᵀ = K_tile · Qᵀ on a masked tile: a strip of keys takes the lanes
    /// that see one of its keys.
    struct LanesSeeingKeys {
        const TiledCausalSoftmax& kernel;
        Index j0;
        [[nodiscard]] Range columns(Index row, Index rows, Index) const {
            Range hull{kernel.cols_, 0};
            for (Index j = j0 + row; j < j0 + row + rows; ++j) {
                const Range r = kernel.lanes_seeing(j);
                if (r.first < r.end)
                    hull = {std::min(hull.first, r.first), std::max(hull.end, r.end)};
            }
            return hull;
        }
        static constexpr Range terms(Index, Index, Index depth) { return {0, depth}; }
    };

    /// The band of acc = α ⊙ acc + P·V_tile on a masked tile: a strip of query lanes
    /// takes the keys one of them sees.
    struct KeysSeenByLanes {
        const TiledCausalSoftmax& kernel;
        Index j0, n;
        static constexpr Range columns(Index, Index, Index cols) { return {0, cols}; }
        [[nodiscard]] Range terms(Index row, Index rows, Index) const {
            Range hull{n, 0};
            for (Index i = row; i < row + rows; ++i) {
                const Range r = kernel.keys_seen(i, j0, n);
                if (r.first < r.end)
                    hull = {std::min(hull.first, r.first), std::max(hull.end, r.end)};
            }
            return hull.first < hull.end ? hull : Range{0, 0};
        }
    };

    /// acc_i = α_i·acc_i + Σ_{j visible to i} p_ji v_j for each query i of the tile, keys
    /// [j0, j0 + n), whose values are the rows at `values`.
    void accumulate_visible_keys(Index j0, Index n, const T* values, Index ldv) {
        const Index dv = v_.cols();
        const T one = 1;
        for (Index i = 0; i < rows_; ++i) {
            const Index p = p0_ + i;
            Eigen::Map<Vector<T>>(acc_.data() + i * dv, dv) *= state_.alpha()[i];
            for (const Range& run : visible_runs(p)) {
                const Index begin = std::max(run.first, j0), end = std::min(run.end, j0 + n);
                if (begin < end)
                    tile_product<T, B>(1, dv, end - begin, s_.data() + (begin - j0) * lanes_ + i, 1, lanes_,
                                       values + (begin - j0) * ldv, ldv, acc_.data() + i * dv, dv, &one);
            }
        }
    }

    /// Every query of the tile sees every key of [j0, j0 + n).
    [[nodiscard]] bool fully_visible(Index j0, Index n) const {
        const Index j_last = j0 + n - 1;
        if (window_ == 0 || j_last < sinks_)
            return !rule_.causal || j_last <= p0_;
        return j0 > p1_ - window_ && (rule_.causal ? j_last <= p0_ : j_last < p0_ + window_);
    }

    /// Sᵀ(j, i) = −∞ where query i does not see key j: a masked key gets weight 0.
    /// Query i (position p0 + i) sees key j iff j ≤ p0 + i (causal) and, unless j is a
    /// sink, |p0 + i − j| < window: for each key a contiguous run of lanes [first, end).
    void mask(Index j0, Index n) {
        constexpr T minus_inf = -std::numeric_limits<T>::infinity();
        for (Index jj = 0; jj < n; ++jj) {
            const Range seen = lanes_seeing(j0 + jj);
            T* row = s_.data() + jj * lanes_;
            std::fill(row, row + seen.first, minus_inf);
            std::fill(row + seen.end, row + cols_, minus_inf);
        }
    }

    /// o_i = acc_i / sum_i, lse_i = m_i + log(sum_i); a query with no visible key gets 0 and −∞.
    /// An output of bfloat16 or float16 is finished in T, then rounded (nearest even).
    template <class E, class LseSink>
    void finish_query_tile(MatrixRef<E>& O, LseSink&& lse) {
        for (Index i = 0; i < rows_; ++i) {
            SoftmaxState<T> state = state_.state(i);
            if constexpr (std::is_same_v<E, T>) {
                O.row(i0_ + i) = acc_.row(i);
                if (rule_.sink)
                    state.add_sink(static_cast<T>(rule_.sink_logit), O.row(i0_ + i));
                state.finish(O.row(i0_ + i));
            } else {
                auto row = acc_.row(i);
                if (rule_.sink)
                    state.add_sink(static_cast<T>(rule_.sink_logit), row);
                state.finish(row);
                O.row(i0_ + i) = row.template cast<E>();
            }
            lse(i0_ + i, state.log_sum_exp());
        }
    }

    QRows q_;
    KRows k_;
    VRows v_;
    T scale_;
    Index window_, sinks_;
    SoftmaxTiles tiles_;
    Index lanes_;
    Matrix<T>& s_;  // scratch, see the top of kernels/causal_softmax.hpp
    Matrix<T>& acc_;
    SoftmaxBlockState<T>& state_;
    Matrix<T>& bias_tile_;  // keys × lanes (padding lanes hold zeros or an earlier tile's values)
    Matrix<T>& bias_rows_;  // lanes × keys, as fill writes it
    Products products_;     // Sᵀ = K·Qᵀ and acc = α ⊙ acc + P·V, in their arithmetic
    Index query_offset_;
    LogitRule rule_;
    TileBias<T> bias_;
    bool biased_ = false;  // the current key tile's bias adds something (TileCover::some)
    T softcap2_, slope2_;  // log2(e)·c and log2(e)·slope: the tile's logits are base 2
    Index i0_ = 0, rows_ = 0, cols_ = 0, p0_ = 0, p1_ = 0;  // the current query tile
    static constexpr double log2e = 1.44269504088896340735992468100;
    PrefetchQueue ahead_{4};                                 // the next query tile's rows
};

}  // namespace memattn::detail
