#pragma once
// Causal softmax attention, FlashAttention-style: Dao et al. 2022, "FlashAttention:
// Fast and Memory-Efficient Exact Attention with IO-Awareness", with the online softmax
// of Milakov & Gimelshein 2018 (memattn/softmax_state.hpp).
//
// Shapes: Q (Nq × d), K (Nk × d), V (Nk × dv), O (Nq × dv), optional lse (Nq), Nq ≤ Nk.
// Query row i sits at position p_i = Nk − Nq + i and sees key j iff
//   j ≤ p_i  and  (j < sinks  or  window = 0  or  j > p_i − window),
//   o_i = Σ_{j visible} softmax_j(s_ij) v_j,   lse_i = log(e^{σ} + Σ_{j visible} e^{s_ij}),
// with s_ij = scale · q_i·k_j and the logit options of SoftmaxOptions applied (softcap,
// ALiBi, a bias; kernels/softmax_options.hpp), σ the sink logit (none: no e^{σ} term).
//
// Algorithm. Queries are cut into tiles of `queries` rows and, for each, the visible
// keys into tiles of `keys` rows, walked from the diagonal down to the window's start
// (then the sink tokens below the window). Per (query tile, key tile):
//   Sᵀ = K_tile · (log2(e)·scale·Q_tile)ᵀ              keys × queries, key-major
//   mask the tile with −∞ where it crosses the diagonal or the window's edge
//   per query lane:  m_new = max(m_old, max_j s_j),  α = 2^(m_old − m_new),
//                    p_j = 2^(s_j − m_new),  sum = α·sum + Σ_j p_j
//   (base-2 logits: 2^(log2(e)·x) = e^x, and 2^x is cheaper than e^x, detail/packet.hpp)
//   acc = α ⊙ acc + P · V_tile                          queries × dv (P read from Pᵀ)
// and o_i = acc_i / sum_i, lse_i = m_i + log(sum_i) once all key tiles are done.
// Tiles wholly above the diagonal or outside the window are never visited, so a
// windowed call costs O(Nq · (window + tile)), not O(Nq · Nk).
//
// Why key-major scores: the query tile is transposed once and reused by every key
// tile, K and V are read in place (any row stride, no copies), and the softmax runs
// down the columns with SIMD packets across queries (SoftmaxBlockState), so the row
// bookkeeping costs a few packet operations per key instead of a reduction per row.
// Both products go through one register-blocked micro-kernel (detail/tile_product.hpp);
// the rescale by α is fused into its load of acc.
//
// Scratch, allocated once per call, O(tile), `lanes` = queries rounded up to 2 packets:
//   qt     d × lanes       log2(e)·scale·Q_tileᵀ (zero in lanes past the last query)
//   s      keys × lanes    logits Sᵀ, then the weights Pᵀ in place
//   acc    lanes × dv      unnormalised outputs
//   state  3 × lanes       max, sum, α per query (SoftmaxBlockState)
// For 144 × 128 tiles and d = dv = 64 in float that is 146 KiB (L2), whatever the sequence.
//
// Tile sizes, measured with bench/causal_softmax_bench.cpp (BM_TileSweep and the same
// sweep at N = 16384; float, 1 thread, AMD EPYC Zen 3 with AVX2 + FMA (two 256-bit FMA
// ports, peak 94–97 GFLOP/s measured by BM_FmaPeak), 6 × 2 blocking, GFLOP/s of useful
// work, medians of 3 on a shared machine whose speed varies ±15% between runs):
//
//   query × key tile   N = 4096, full, d=64 / d=128    N = 16384, full, d=64 / d=128
//     48 × 128            54–72 / 46–72                    37–42 / 33–34
//     96 × 128            44–58 / 54–61                    40–46 / 45
//    144 × 128            53     / 62                       52     / 50        <- full calls
//    192 × 128            49     / 50                       51–56 / 53–54
//   Window 512, N = 4096:  48 × 96  65 / 62,  48 × 128  62 / 65,  64 × 128  51 / 55  <- 48 × 96
//
// At N = 16384 every query tile streams K and V (8–16 MiB) from L3, so a query tile of
// 48 spends its time waiting on memory; 144 (three strips of 48) gives each K/V tile
// three times the work. Under a window a query tile's keys span window + queries − 1,
// and adjacent query tiles share most of them in cache, so 48 rows and shorter key
// tiles (a tile cut by the window's edge is partly wasted) win there.
//
// Against the same run's references (N ∈ {4096, 16384}, d ∈ {64, 128}, three runs of
// three repetitions): 49–60 GFLOP/s for full calls, 0.52–0.64 of the FMA peak (the 4 × 2
// blocking of 0.1 measured 0.35–0.39 on this core); 1.2–1.6× Eigen's GEMM on 64 × 64
// tiles without any softmax; 3–5× the naive materialise-mask-softmax-multiply version
// (15–20× under a window of 512); windowed calls (512) within the run-to-run noise
// (±10%) of full ones; double 20–28 GFLOP/s, 0.40–0.48 of float. The products take 83%
// of the time (they run at 81 GFLOP/s on L1-resident tiles, 60 here: the K/V tiles and
// Pᵀ come from L2), the softmax bookkeeping (max pass, 2^x, masks) 14%.

// Measured again with AVX-512 (bench/causal_softmax_bench.cpp; Intel Xeon, family 6 model
// 207, two 512-bit FMA ports, BM_FmaPeak 175–182 GFLOP/s on one core; 6 × 4 blocking,
// medians of 3 interleaved repetitions):
//   query tiles of 192–512 rows × key tiles of 64–256 form one plateau at 0.68–0.75 of
//   the peak (d = 64) and 0.74–0.81 (d = 128); 80 rows 0.59–0.64, 120 rows 0.65–0.72.
//   The full-call default, 192 × 128, sits on it.
//   Window 512: 64 × 96 is the best of query tiles {32, 64, 96, 128, 192} × key tiles
//   {64, 96, 128}; with banded masked tiles (below) windowed calls ran at 0.83–0.93 of
//   full ones, 0.89–0.94 once the query tile's Q is transposed in registers and the next
//   tile's Q and O rows are prefetched a few lines per product strip (run(): they are a
//   large share of a windowed tile's traffic). What is left: a query tile of 64 shares
//   each K/V tile with fewer queries than one of 192, and 11% of its pairs still cross
//   the diagonal or the window's edge. (A second sweep at N = 16384 put 64 × 64 within
//   2% of 64 × 96.)
//   Full calls, N ∈ {4096, 16384}: 0.70–0.72 of the peak at d = 64, 0.74–0.79 at d = 128;
//   1.06–1.30× Eigen's GEMM on 64 × 64 tiles; 3.8–5.1× the naive version at N = 4096
//   (15–20× under a window); double 0.455–0.49 of float (the FMA count allows 0.48–0.49:
//   docs/performance.md). Products 78% of the time, the softmax bookkeeping 17% (d = 64).
//
// Measured on an AMD EPYC, family 25 model 17 (AVX-512, each 512-bit operation executed as
// two 256-bit halves; BM_FmaPeak 116–117 GFLOP/s on one core; 6 × 4 blocking; a shared
// 2-core machine at load 3–6; GFLOP/s per CPU second, medians of 5–9 interleaved
// repetitions, ratios within one process, 7–10 processes):
//   Full calls 87–97 GFLOP/s, 0.74–0.84 of the peak (N ∈ {4096, 16384}, d ∈ {64, 128}).
//   Window 512 at the default 64 × 96 against full calls: N = 16384 0.92–0.94 (d = 64),
//   0.94–0.98 (d = 128); N = 4096 0.92–0.93, 0.91–0.98.
//   Window 512, query tiles {32, 48, 64, 96, 128, 192} × key tiles {32, 48, 64, 96, 128,
//   192, 256} (BM_TileSweep, N = 4096 and 16384; and 576, a query tile's whole span of
//   keys, at N = 16384): 64 query rows are best; 48 rows fill 64 lanes (two packets of
//   16) and run at 0.63–0.75; key tiles of 96 and longer are within 2–4% of one another
//   (128 against 96: −1% to +3%), 32 loses 5–8%. The default stays 64 × 96.
//   What is left: the products execute 3.5% more Sᵀ pairs and 1% more P·V terms than
//   the visible ones (band edges rounded out to whole packets); the softmax bookkeeping
//   runs over whole masked tiles, 575 keys per query for 512 visible; a query row's own
//   work (Q's transpose, O's division) and a key tile's (prefetch, mask, α ⊙ acc) are
//   spread over 512 pairs instead of up to N. The products take 82% of a windowed call's
//   time, 89% of a full one's (perf, N = 16384, d = 64). Where the key tiles are cut
//   matters not: with banded tiles, key tiles aligned on the window's start instead of
//   the diagonal compute the same pairs within 0.2% (counted by replaying the tile walk
//   and the bands) for query and key tiles of 32–128. Skipping, in the bookkeeping, the
//   keys no lane of a packet sees gained 0.6% (within the noise) and is not done.
//
// Banded masked tiles: a tile that crosses the diagonal or the window's edge computes,
// per strip of 6 keys, only the query lanes that see one of them (rounded out to whole
// packets; mask() writes −∞ into the rest), and in P·V, per strip of queries, only the
// keys one of them sees (the weights outside are exactly 0, so no bit changes). On the
// Xeon this made windowed calls 4–7% faster at the default tiles and 12–26% at query
// tiles of 128–192, full ones unchanged within the noise.

// Non-finite input: a NaN logit poisons the queries that see its key (the final
// division is SoftmaxState::finish's, so its policy for a NaN sum applies); a logit of
// −∞ is a masked key. A non-finite value in V poisons exactly the queries that see it:
// a masked tile whose V rows are not all finite is multiplied query by query over the
// visible keys only (the tile product would give the masked ones 0 · ∞ = NaN).

#include "memattn/detail/bf16_product.hpp"
#include "memattn/detail/tile_product.hpp"
#include "memattn/kernels/softmax_options.hpp"
#include "memattn/softmax_state.hpp"
#include "memattn/storage/compact.hpp"
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

namespace memattn {

namespace detail {

/// Rows of a query tile under a window. With 16 registers (AVX2, 6 × 2 blocking) 48: a
/// whole number of 6-row strips in P·V and of 2-packet column blocks in Sᵀ, so no
/// product runs a leftover micro-tile. With 32 registers (AVX-512, 6 × 4) 64, one column
/// block of Sᵀ. Full causal calls take three times as many (144 or 192), so that each
/// K/V tile, read from L3 or DRAM once per query tile, serves three times the work. The
/// AVX-512 sizes were measured on an Intel Xeon (see the top of the file).
inline constexpr Index window_query_tile = vector_registers >= 32 ? 64 : 48;

/// Rows of a query tile and of a key tile (measured: see the top of the file).
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

/// The scratch of the tiled kernel (see the top of the file), allocated once and reused
/// by every call on the same d, dv and tiles: a multi-head call keeps one per thread.
template <class T>
struct SoftmaxScratch {
    SoftmaxScratch(Index d, Index dv, SoftmaxTiles tiles)
        : tiles(tiles), lanes(round_up(tiles.queries, 2 * packet_lanes<T>)), qt(d, lanes), s(tiles.keys, lanes),
          acc(lanes, dv), state(lanes) {}

    /// Bytes of scratch: all the extra memory a call needs, whatever Nq and Nk.
    static std::size_t bytes(Index d, Index dv, SoftmaxTiles tiles) {
        const Index lanes = round_up(tiles.queries, 2 * packet_lanes<T>);
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

/// A bias added to the logits tile by tile (a dense bias or boolean mask, a tree of
/// draft tokens): fill(context, i0, rows, j0, n, out, ld) writes, for the queries
/// [i0, i0 + rows) of the call and the keys [j0, j0 + n), out[i·ld + jj] = the bias of
/// (i0 + i, j0 + jj) in natural units, −∞ where the key is masked (query-major, as the
/// caller's matrix: the kernel transposes it in registers), and says what the tile holds
/// (TileCover): a tile it masks wholly is skipped, one it leaves open (a mask's tile of
/// visible keys, the tree's past) is computed as without a bias; for those two it need
/// write nothing.
enum class TileCover {
    open,    ///< every value 0: nothing to add
    some,    ///< anything else
    closed,  ///< every value −∞: every key masked for every query
};

template <class T>
struct TileBias {
    using Fill = TileCover (*)(const void* context, Index i0, Index rows, Index j0, Index n, T* out, Index ld);
    Fill fill = nullptr;           ///< none: no bias
    const void* context = nullptr;  ///< what fill reads
    /// A bias of T stored row-major: its query 0's row and the row stride, which the
    /// kernel transposes straight into its key-major tile (fill's copy skipped: it was
    /// 13% of a call with a 4096² bias, d = 64); null otherwise.
    const T* rows = nullptr;
    Index stride = 0;
    explicit operator bool() const noexcept { return fill != nullptr; }
};

/// A dense bias of the scalar type or a bool mask (any Eigen expression), its row
/// `row0` the call's query 0: TileBias's fill reads its blocks in place.
template <class DB>
struct DenseBias {
    const DB* bias;
    Index row0;

    /// The TileBias reading this (which must outlive the call).
    template <class T>
    [[nodiscard]] TileBias<T> tile() const noexcept {
        if constexpr (std::is_same_v<typename DB::Scalar, T> && bool(DB::Flags & Eigen::DirectAccessBit) &&
                      bool(DB::Flags & Eigen::RowMajorBit)) {
            if (bias->innerStride() == 1)  // not a row of a column-major matrix, say
                return {&fill<T>, this, bias->data() + row0 * bias->outerStride(), bias->outerStride()};
        }
        return {&fill<T>, this};
    }

    template <class T>
    static TileCover fill(const void* context, Index i0, Index rows, Index j0, Index n, T* out, Index ld) {
        const DenseBias& self = *static_cast<const DenseBias*>(context);
        const DB& b = *self.bias;
        i0 += self.row0;
        if constexpr (std::is_same_v<typename DB::Scalar, bool>) {
            // A mask's tile is written only when it masks some of its keys and not all:
            // the visible count tells which, from the bools alone.
            bool all = true, none = true;
            bool counted = false;
            if constexpr (bool(DB::Flags & Eigen::DirectAccessBit) && bool(DB::Flags & Eigen::RowMajorBit) &&
                          sizeof(bool) == 1) {
                if (b.innerStride() == 1) {  // not a row of a column-major matrix, say
                    // Rows in place, eight bools a word (a bool is the byte 0 or 1): one
                    // comparison per word instead of a branch per byte.
                    constexpr std::uint64_t ones = 0x0101010101010101u;
                    for (Index i = 0; i < rows; ++i) {
                        const bool* src = b.data() + (i0 + i) * b.outerStride() + j0;
                        // The next key tile's bools of this row, asked for now (the kernel
                        // walks key tiles down from the diagonal): a mask's rows lie a row of
                        // keys apart, too many streams for the hardware's prefetchers
                        // (measured: fill was a third of a masked call, in load stalls).
                        prefetch_rows(src - std::min(j0, n), 1, 0, std::min(j0, n));
                        if (!(all || none))
                            continue;
                        Index jj = 0;
                        for (; jj + 8 <= n; jj += 8) {
                            std::uint64_t word;
                            std::memcpy(&word, src + jj, 8);
                            all &= word == ones;
                            none &= word == 0;
                        }
                        for (; jj < n; ++jj) {
                            all &= src[jj];
                            none &= !src[jj];
                        }
                    }
                    counted = true;
                }
            }
            if (!counted)
                for (Index i = 0; i < rows; ++i)
                    for (Index jj = 0; jj < n; ++jj) {
                        const bool seen = b.coeff(i0 + i, j0 + jj);
                        all &= seen;
                        none &= !seen;
                    }
            if (all)
                return TileCover::open;
            if (none)
                return TileCover::closed;
            constexpr T masked = -std::numeric_limits<T>::infinity();
            for (Index i = 0; i < rows; ++i)
                for (Index jj = 0; jj < n; ++jj)
                    out[i * ld + jj] = b.coeff(i0 + i, j0 + jj) ? T(0) : masked;
            return TileCover::some;
        } else {
            Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>>(out, rows, n, Eigen::OuterStride<>(ld)) =
                b.block(i0, j0, rows, n);
            return TileCover::some;
        }
    }
};

/// No bias: for the calls that take one where they may.
struct NoBias {
    template <class T>
    [[nodiscard]] TileBias<T> tile() const noexcept {
        return {};
    }
    NoBias operator()(Index, Index) const noexcept { return {}; }
};

/// Which of a tree's new tokens each new token sees: its ancestors and itself
/// (SoftmaxOptions::parents), as one bit row per token.
class TreeMask {
public:
    /// parents[i] < i (or −1) for each of the n new tokens; `past` keys come before them.
    TreeMask(std::span<const Index> parents, Index past)
        : n_(static_cast<Index>(parents.size())), words_((n_ + 63) / 64), past_(past),
          bits_(static_cast<std::size_t>(n_ * words_), 0) {
        for (Index i = 0; i < n_; ++i) {
            std::uint64_t* row = bits_.data() + i * words_;
            if (const Index p = parents[static_cast<std::size_t>(i)]; p >= 0)
                std::copy(bits_.data() + p * words_, bits_.data() + (p + 1) * words_, row);
            row[i / 64] |= std::uint64_t{1} << (i % 64);
        }
    }
    /// New token i sees new token j.
    [[nodiscard]] bool sees(Index i, Index j) const noexcept {
        return (bits_[static_cast<std::size_t>(i * words_ + j / 64)] >> (j % 64)) & 1u;
    }
    /// The tile bias of the call's queries first, first + 1, ... (new tokens).
    struct View {
        const TreeMask* tree;
        Index first;
    };
    template <class T>
    static TileCover fill(const void* context, Index i0, Index rows, Index j0, Index n, T* out, Index ld) {
        const View& view = *static_cast<const View*>(context);
        const TreeMask& tree = *view.tree;
        if (j0 + n <= tree.past_)
            return TileCover::open;  // the cached past: every new token sees it
        for (Index i = 0; i < rows; ++i) {
            T* row = out + i * ld;
            for (Index jj = 0; jj < n; ++jj) {
                const Index j = j0 + jj - tree.past_;
                row[jj] = j < 0 || tree.sees(view.first + i0 + i, j) ? T(0) : -std::numeric_limits<T>::infinity();
            }
        }
        return TileCover::some;
    }

private:
    Index n_, words_, past_;
    std::vector<std::uint64_t> bits_;
};

/// K or V read in place: a tile is rows of the matrix itself.
template <class T>
class PlainRows {
public:
    explicit PlainRows(const ConstMatrixRef<T>& m) : m_(m) {}
    [[nodiscard]] Index rows() const noexcept { return m_.rows(); }
    [[nodiscard]] Index cols() const noexcept { return m_.cols(); }
    static constexpr bool pairs = false;
    [[nodiscard]] const T* row(Index j) const noexcept { return m_.data() + j * m_.outerStride(); }
    [[nodiscard]] Index stride() const noexcept { return m_.outerStride(); }
    /// Rows [j0, j0 + n): their first coefficient and the row stride.
    [[nodiscard]] std::pair<const T*, Index> tile(Index j0, Index) const {
        return {m_.data() + j0 * m_.outerStride(), m_.outerStride()};
    }
    /// Rows [j0, j1) towards L2 while the current tile computes.
    void prefetch(Index j0, Index j1) const {
        prefetch_rows(m_.data() + j0 * m_.outerStride(), j1 - j0, m_.outerStride(), m_.cols());
    }

private:
    ConstMatrixRef<T> m_;
};

/// Q, K or V of bfloat16 or float16 read in place by a float kernel. With pairs (bfloat16
/// where the target has AVX512-BF16) the kernel multiplies the bits themselves (bits());
/// otherwise, and for the values where a tile holds a value that is not finite, a tile is
/// converted to float into `buffer` (one tile's rows of the scratch, sized on first use:
/// the bfloat16 products may need none), exactly: every bfloat16 and float16 is a float.
template <class E>
class ConvertedRows {
public:
    static constexpr bool pairs = bf16_dot && std::is_same_v<E, Eigen::bfloat16>;
    ConvertedRows(const ConstMatrixRef<E>& m, Index tile_rows, Matrix<float>& buffer)
        : m_(m), tile_rows_(tile_rows), buffer_(buffer) {}
    [[nodiscard]] Index rows() const noexcept { return m_.rows(); }
    [[nodiscard]] Index cols() const noexcept { return m_.cols(); }
    [[nodiscard]] const E* row(Index j) const noexcept { return m_.data() + j * m_.outerStride(); }
    [[nodiscard]] Index stride() const noexcept { return m_.outerStride(); }
    /// Row j's bits and the row stride (in elements).
    [[nodiscard]] std::pair<const std::uint16_t*, Index> bits(Index j) const noexcept {
        return {reinterpret_cast<const std::uint16_t*>(row(j)), m_.outerStride()};
    }
    /// Rows [j0, j0 + n) as float.
    [[nodiscard]] std::pair<const float*, Index> tile(Index j0, Index n) {
        MEMATTN_DASSERT(n <= tile_rows_);
        if (buffer_.rows() < tile_rows_ || buffer_.cols() != m_.cols())
            buffer_.resize(tile_rows_, m_.cols());
        for (Index r = 0; r < n; ++r)
            decode_span(row(j0 + r), m_.cols(), 1.0f, buffer_.data() + r * buffer_.cols());
        return {buffer_.data(), buffer_.cols()};
    }
    void prefetch(Index j0, Index j1) const { prefetch_rows(row(j0), j1 - j0, m_.outerStride(), m_.cols()); }

private:
    ConstMatrixRef<E> m_;
    Index tile_rows_;
    Matrix<float>& buffer_;
};

/// K or V in compact storage (storage/compact.hpp): each tile is converted to T into a
/// buffer of one tile's rows when the kernel reaches it, so the kernel never holds more
/// than a tile of T, whatever the length.
template <class T, class S>
class DecodedRows {
public:
    DecodedRows(const StoredRows<T, S>& stored, Index rows, Index tile_rows)
        : stored_(stored), rows_(rows), buffer_(tile_rows, stored.cols()) {}
    static constexpr bool pairs = false;
    [[nodiscard]] Index rows() const noexcept { return rows_; }
    [[nodiscard]] Index cols() const noexcept { return stored_.cols(); }
    [[nodiscard]] std::pair<const T*, Index> tile(Index j0, Index n) {
        MEMATTN_DASSERT(n <= buffer_.rows());
        stored_.decode_rows(j0, n, buffer_.data(), buffer_.cols());
        return {buffer_.data(), buffer_.cols()};
    }
    void prefetch(Index, Index) const {}

private:
    const StoredRows<T, S>& stored_;
    Index rows_;
    Matrix<T> buffer_;
};

/// Keys of a prefill that reads its own keys as given after the first `kept` rows kept in
/// storage S (`PerChannelKeys<S>`: the past as stored, the prompt's keys exact): a tile
/// below `kept` is converted into a buffer of one tile, a tile of given rows is read in
/// place, a tile across the two is put together in the buffer.
template <class T, class S>
class StoredThenGiven {
public:
    StoredThenGiven(const StoredRows<T, S>& stored, Index kept, const ConstMatrixRef<T>& given, Index tile_rows)
        : stored_(stored), kept_(kept), given_(given), buffer_(tile_rows, stored.cols()) {}
    static constexpr bool pairs = false;
    [[nodiscard]] Index rows() const noexcept { return kept_ + given_.rows(); }
    [[nodiscard]] Index cols() const noexcept { return stored_.cols(); }
    [[nodiscard]] std::pair<const T*, Index> tile(Index j0, Index n) {
        if (j0 >= kept_)
            return {given_.data() + (j0 - kept_) * given_.outerStride(), given_.outerStride()};
        MEMATTN_DASSERT(n <= buffer_.rows());
        const Index old = std::min(n, kept_ - j0);
        stored_.decode_rows(j0, old, buffer_.data(), buffer_.cols());
        if (old < n)
            buffer_.middleRows(old, n - old) = given_.topRows(n - old);
        return {buffer_.data(), buffer_.cols()};
    }
    void prefetch(Index, Index) const {}

private:
    const StoredRows<T, S>& stored_;
    Index kept_;
    ConstMatrixRef<T> given_;
    Matrix<T> buffer_;
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

/// The tiled kernel for one call on a scratch: its steps (see the top of the file). The
/// products use the register blocking B (detail/tile_product.hpp), which changes no bit.
/// Q, K and V are read through row sources: PlainRows (in place), DecodedRows (compact
/// storage, converted tile by tile) or ConvertedRows (bfloat16 or float16 inputs). When
/// all three hold bfloat16 pairs (ConvertedRows<Eigen::bfloat16> on AVX512-BF16) both
/// products run in bfloat16 arithmetic (detail/bf16_product.hpp), the softmax in float.
template <class T, class B = DefaultBlocking, class KRows = PlainRows<T>, class VRows = PlainRows<T>,
          class QRows = PlainRows<T>>
class TiledCausalSoftmax {
    static constexpr bool pairs = QRows::pairs && KRows::pairs && VRows::pairs;
    static_assert(!pairs || std::is_same_v<T, float>);

public:
    TiledCausalSoftmax(QRows Q, KRows K, VRows V, T scale, Index window, Index sinks, SoftmaxScratch<T>& scratch,
                       const LogitRule& rule = {}, TileBias<T> bias = {})
        : q_(std::move(Q)), k_(std::move(K)), v_(std::move(V)), scale_(scale), window_(window), sinks_(sinks),
          tiles_(scratch.tiles), lanes_(scratch.lanes), qt_(scratch.qt), s_(scratch.s), acc_(scratch.acc),
          state_(scratch.state), bias_tile_(scratch.bias), bias_rows_(scratch.bias_rows), query_offset_(k_.rows() - q_.rows()), rule_(rule),
          bias_(bias), softcap2_(static_cast<T>(rule.softcap * log2e)), slope2_(static_cast<T>(rule.slope * log2e)) {
        MEMATTN_DASSERT(qt_.rows() == k_.cols() && acc_.cols() == v_.cols());
        if (bias_ && (bias_tile_.rows() != tiles_.keys || bias_tile_.cols() != lanes_)) {
            bias_tile_ = Matrix<T>::Zero(tiles_.keys, lanes_);
            bias_rows_.resize(lanes_, tiles_.keys);
        }
        if constexpr (pairs) {
            value_stride_ = round_up(v_.cols(), 16);
            resize(scratch.query_pairs, (k_.cols() + 1) / 2 * lanes_, query_pairs_);
            resize(scratch.weight_pairs, (tiles_.keys + 1) / 2 * lanes_, weight_pairs_);
            resize(scratch.value_pairs, (tiles_.keys + 1) / 2 * value_stride_, value_pairs_);
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
    /// (with bfloat16 products, their pair buffers too).
    static std::size_t scratch_bytes(Index d, Index dv, SoftmaxTiles tiles) {
        std::size_t bytes = SoftmaxScratch<T>::bytes(d, dv, tiles);
        if constexpr (pairs) {
            const Index lanes = round_up(tiles.queries, 2 * packet_lanes<T>), half_keys = (tiles.keys + 1) / 2;
            bytes += sizeof(std::uint32_t) *
                     static_cast<std::size_t>((d + 1) / 2 * lanes + half_keys * lanes + half_keys * round_up(dv, 16));
        }
        return bytes;
    }

    /// Writes O (of T, or of the inputs' bfloat16 or float16) and calls lse(i, lse_i) for
    /// every query row i.
    template <class E, class LseSink>
    void run(MatrixRef<E> O, LseSink&& lse) {
        for (Index i0 = 0; i0 < q_.rows(); i0 += tiles_.queries) {
            start_query_tile(i0, std::min(tiles_.queries, q_.rows() - i0));
            // The next query tile's rows of Q and O towards L2, a few lines per strip of
            // this tile's products: with a window, a tile's Q and O are a large share of
            // what it reads and writes (0.1 read them as they came: 7% of a windowed call).
            ahead_.clear();
            if (const Index next = i0 + tiles_.queries, n = std::min(tiles_.queries, q_.rows() - next); n > 0) {
                ahead_.add(q_.row(next), n, q_.stride(), q_.cols());
                ahead_.template add<E, true>(O.data() + next * O.outerStride(), n, O.outerStride(), O.cols());
            }
            // Keys [lo, hi): causal, [0, p1] within the window; else the window both ways.
            const Index hi = rule_.causal  ? std::min(p1_ + 1, k_.rows())
                             : window_ > 0 ? std::clamp<Index>(p1_ + window_, 0, k_.rows())
                                           : k_.rows();
            const Index lo = window_ > 0 ? std::clamp<Index>(p0_ - window_ + 1, 0, k_.rows()) : 0;
            for (Index j1 = hi; j1 > lo; j1 -= tiles_.keys) {             // diagonal tile first
                const Index j0 = std::max(lo, j1 - tiles_.keys);
                prefetch_key_tile(std::max(lo, j0 - tiles_.keys), j0);     // the next one
                attend_key_tile(j0, j1 - j0);
            }
            const Index sink_end = std::min({sinks_, lo, hi});             // sinks below the window
            for (Index j0 = 0; j0 < sink_end; j0 += tiles_.keys)
                attend_key_tile(j0, std::min(tiles_.keys, sink_end - j0));
            if (!rule_.causal) {  // and, both ways, sinks past the window's end
                const Index begin = std::max(hi, lo), end = std::min(sinks_, k_.rows());
                for (Index j0 = begin; j0 < end; j0 += tiles_.keys)
                    attend_key_tile(j0, std::min(tiles_.keys, end - j0));
            }
            finish_query_tile(O, lse);
        }
    }

private:
    /// A scratch vector of at least n words: its data.
    static void resize(std::vector<std::uint32_t>& v, Index n, std::uint32_t*& data) {
        if (static_cast<Index>(v.size()) < n)
            v.resize(static_cast<std::size_t>(n));
        data = v.data();
    }

    /// Loads log2(e)·scale·Q_tileᵀ (base-2 logits, see SoftmaxBlockState) and empties the
    /// accumulators for queries [i0, i0 + rows). bfloat16 pairs: Q_tileᵀ as they are, pairs
    /// along d (the factor multiplies the logits as the product stores them).
    void start_query_tile(Index i0, Index rows) {
        i0_ = i0;
        rows_ = rows;
        cols_ = std::min(lanes_, round_up(rows, 2 * packet_lanes<T>));
        p0_ = query_offset_ + i0;
        p1_ = p0_ + rows - 1;
        if constexpr (pairs) {
            const Index d = q_.cols(), whole = d / 2;
            for (Index i = 0; i < cols_; ++i) {
                if (i >= rows) {
                    for (Index k = 0; k < (d + 1) / 2; ++k)
                        query_pairs_[k * lanes_ + i] = 0;
                    continue;
                }
                const std::uint16_t* row = q_.bits(i0 + i).first;
                for (Index k = 0; k < whole; ++k)
                    query_pairs_[k * lanes_ + i] = load_pair(row + 2 * k);
                if (d % 2 == 1)
                    query_pairs_[whole * lanes_ + i] = row[d - 1];
            }
        } else {
            const auto [q, ldq] = q_.tile(i0, rows);
            transpose(q, rows, q_.cols(), ldq, qt_.data(), lanes_);
            qt_.leftCols(rows) *= scale_ * T(log2e);
            qt_.middleCols(rows, cols_ - rows).setZero();
        }
        acc_.topRows(cols_).setZero();
        state_.reset();
    }

    /// Keys and values [j0, j1) towards L2 while the current tile computes.
    void prefetch_key_tile(Index j0, Index j1) const {
        k_.prefetch(j0, j1);
        v_.prefetch(j0, j1);
    }

    /// Folds keys [j0, j0 + n) into every query of the tile.
    void attend_key_tile(Index j0, Index n) {
        const Index d = k_.cols(), dv = v_.cols();
        // Sᵀ = K_tile · (log2(e)·scale·Q_tile)ᵀ, keys × queries.
        // A tile that crosses the diagonal or the window's edge computes, per strip of
        // keys, only the query lanes that see one of them (the rest is masked below).
        biased_ = false;
        if (bias_ && !fill_bias(j0, n))
            return;  // the bias masks every key of the tile for every query
        const bool masked = !fully_visible(j0, n);
        if constexpr (pairs) {
            attend_key_pairs(j0, n, masked);
            return;
        }
        const auto [keys, ldk] = k_.tile(j0, n);
        if (masked) {
            tile_product<T, B>(n, cols_, d, keys, ldk, 1, qt_.data(), lanes_, s_.data(), lanes_, nullptr,
                               LanesSeeingKeys{*this, j0}, &ahead_);
            transform_logits(j0, n);
            mask(j0, n);
        } else {
            tile_product<T, B>(n, cols_, d, keys, ldk, 1, qt_.data(), lanes_, s_.data(), lanes_, nullptr, {},
                               &ahead_);
            transform_logits(j0, n);
        }
        state_.absorb(s_.data(), n, lanes_, cols_);  // m, sum, α; Sᵀ becomes Pᵀ
        // acc = α ⊙ acc + P · V_tile: A(r, k) = Pᵀ(k, r) is read with strides (1, lanes).
        // A masked weight is 0, and 0 · ∞ = NaN: where V_tile is not all finite, a masked
        // tile goes query by query over the keys each one sees (O(n·dv) to check, against
        // O(lanes·n·dv) for the product), so a bad value poisons only the queries that see it.
        const auto [values, ldv] = v_.tile(j0, n);
        if (biased_ && !finite_values(values, ldv, n)) {  // weights the bias made 0 must not meet ∞
            accumulate_weighted_keys(n, values, ldv);
            return;
        }
        // A masked tile's strips of queries skip the keys none of them sees: their weights
        // are 0, and x + 0·v is x.
        if (!masked)
            tile_product<T, B>(cols_, dv, n, s_.data(), 1, lanes_, values, ldv, acc_.data(), dv, state_.alpha(), {},
                               &ahead_);
        else if (finite_values(values, ldv, n))
            tile_product<T, B>(cols_, dv, n, s_.data(), 1, lanes_, values, ldv, acc_.data(), dv, state_.alpha(),
                               KeysSeenByLanes{*this, j0, n}, &ahead_);
        else
            accumulate_visible_keys(j0, n, values, ldv);
    }

    /// attend_key_tile in bfloat16 arithmetic: both products by vdpbf16ps on the bits of K
    /// and V (banded on masked tiles as the float ones), the softmax in float, the weights
    /// rounded to bfloat16 for P·V. A value tile that is not all finite goes the float way
    /// (converted, query by query where weights are masked), so a masked weight of 0 never
    /// meets ∞.
    void attend_key_pairs(Index j0, Index n, bool masked) {
        const Index d = k_.cols(), dv = v_.cols();
        const auto [keys, ldk] = k_.bits(j0);
        const float post = scale_ * T(log2e);
        if (masked) {
            bf16_product<B>(n, cols_, d, keys, ldk, 2, query_pairs_, lanes_, s_.data(), lanes_, nullptr, post,
                            LanesSeeingKeys{*this, j0}, &ahead_);
            transform_logits(j0, n);
            mask(j0, n);
        } else {
            bf16_product<B>(n, cols_, d, keys, ldk, 2, query_pairs_, lanes_, s_.data(), lanes_, nullptr, post,
                            WholeStrip{}, &ahead_);
            transform_logits(j0, n);
        }
        state_.absorb(s_.data(), n, lanes_, cols_, RoundToBf16{});
        const auto [values, ldv] = v_.bits(j0);
        if (pack_row_pairs(values, n, dv, ldv, value_pairs_, value_stride_)) {
            pack_weight_pairs(s_.data(), n, cols_, lanes_, weight_pairs_);
            const auto* weights = reinterpret_cast<const std::uint16_t*>(weight_pairs_);
            if (masked)
                bf16_product<B, true>(cols_, dv, n, weights, 2, 2 * lanes_, value_pairs_, value_stride_,
                                      acc_.data(), dv, state_.alpha(), 1.0f, KeysSeenByLanes{*this, j0, n},
                                      &ahead_);
            else
                bf16_product<B, true>(cols_, dv, n, weights, 2, 2 * lanes_, value_pairs_, value_stride_,
                                      acc_.data(), dv, state_.alpha(), 1.0f, WholeStrip{}, &ahead_);
            return;
        }
        const auto [converted, ldc] = v_.tile(j0, n);
        if (biased_)
            accumulate_weighted_keys(n, converted, ldc);
        else if (masked)
            accumulate_visible_keys(j0, n, converted, ldc);
        else
            tile_product<T, B>(cols_, dv, n, s_.data(), 1, lanes_, converted, ldc, acc_.data(), dv,
                               state_.alpha(), {}, &ahead_);
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
        if (biased_) {  // the bias in base 2; −∞ stays −∞
            const T factor = static_cast<T>(log2e);
            for (Index jj = 0; jj < n; ++jj) {
                T* row = s_.data() + jj * lanes_;
                const T* b = bias_tile_.data() + jj * lanes_;
                for (Index i = 0; i < cols_; ++i)
                    row[i] += factor * b[i];
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

    /// Every value of the n rows at `values` is finite: 0·x is 0, or NaN for ±∞ and NaN,
    /// and a sum keeps NaN. A vectorised reduction (Eigen's allFinite is a scalar loop here).
    [[nodiscard]] bool finite_values(const T* values, Index ldv, Index n) const {
        const Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>> v(values, n, v_.cols(), Eigen::OuterStride<>(ldv));
        return (v.array() * T(0)).sum() == T(0);
    }

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
    void finish_query_tile(MatrixRef<E>& O, LseSink& lse) {
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
    Matrix<T>& qt_;  // scratch, see the top of the file
    Matrix<T>& s_;
    Matrix<T>& acc_;
    SoftmaxBlockState<T>& state_;
    Matrix<T>& bias_tile_;  // keys × lanes (padding lanes hold zeros or an earlier tile's values)
    Matrix<T>& bias_rows_;  // lanes × keys, as fill writes it
    Index query_offset_;
    LogitRule rule_;
    TileBias<T> bias_;
    bool biased_ = false;  // the current key tile's bias adds something (TileCover::some)
    T softcap2_, slope2_;  // log2(e)·c and log2(e)·slope: the tile's logits are base 2
    Index i0_ = 0, rows_ = 0, cols_ = 0, p0_ = 0, p1_ = 0;  // the current query tile
    static constexpr double log2e = 1.44269504088896340735992468100;
    PrefetchQueue ahead_{4};                                 // the next query tile's rows
    // bfloat16 products: the scratch's pair buffers, the value tile's row stride in words
    std::uint32_t* query_pairs_ = nullptr;
    std::uint32_t* weight_pairs_ = nullptr;
    std::uint32_t* value_pairs_ = nullptr;
    Index value_stride_ = 0;
};

/// The checks every entry point makes, before anything is written.
/// `heads`: the query heads the options' per-head spans cover (1 for a single head).
template <class T>
void check_softmax_arguments(const char* function, Shape q, Shape k, Shape v, Shape o, const SoftmaxOptions& options,
                             Index heads = 1) {
    require(q.cols == k.cols, function, "Q", "has shape ", q, ", expected ", k.cols, " columns as K (", k, ")");
    require(v.rows == k.rows, function, "V", "has shape ", v, ", expected ", k.rows, " rows as K (", k, ")");
    require(q.rows <= k.rows || !options.causal, function, "Q", "has shape ", q, ", expected at most ", k.rows,
            " rows (K is ", k, "): causal queries continue the keys, so Nq <= Nk (options.causal = false: any Nq)");
    require(o.rows == q.rows && o.cols == v.cols, function, "O", "has shape ", o, ", expected ", q.rows, 'x',
            v.cols, " (Q is ", q, ", V is ", v, ")");
    require(finite_in<T>(options.scale), function, "options.scale", "is ", options.scale, ", expected a number finite as ",
            scalar_name<T>, " (0: 1/sqrt(d))");
    check_logit_options<T>(function, options, heads);
    if (!options.parents.empty() && q.rows > 0)  // (a layer checks them per sequence)
        require(static_cast<Index>(options.parents.size()) == q.rows, function, "options.parents", "has ",
                options.parents.size(), " entries, expected ", q.rows, " (one per query: the new tokens)");
}

/// The query offset of a whole call: the queries are the last Nq positions of the keys.
inline constexpr Index trailing_queries = std::numeric_limits<Index>::min();

/// The aliasing rule: the outputs share no element with Q, K or V.
template <class Out, class T = typename Out::Scalar>
void check_disjoint(const char* function, const char* name, const Out& out, const ConstMatrixRef<T>& Q,
                    const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V) {
    require_disjoint(function, name, out, "Q", Q);
    require_disjoint(function, name, out, "K", K);
    require_disjoint(function, name, out, "V", V);
}

/// The aliasing rule for a dense bias or mask: O shares no element with it (the kernel
/// reads the bias tile by tile while it writes O, so a bias in O's rows would be read
/// after an earlier query tile had written over it). A bias with storage of its own (a
/// Matrix, a Map, a block) is checked; an expression without one (a product, a
/// comparison) is evaluated tile by tile as the kernel runs, and its operands must not
/// overlap O: that cannot be checked.
template <class Out, class DB>
void check_bias_disjoint(const char* function, const Out& out, const Eigen::MatrixBase<DB>& bias) {
    if constexpr (bool(DB::Flags & Eigen::DirectAccessBit))
        require_disjoint(function, "O", out, "bias", bias.derived());
}

/// The kernel on views and a scratch, after the checks; `lse(i, value)` receives each
/// row's log-sum-exp. The tiles are the scratch's; B is the register blocking.
/// Query row i sits at position query_offset + i (trailing_queries: Nk − Nq + i).
/// `bias`: a dense bias or mask (the tree of options.parents takes its place).
/// The same on row sources (TiledCausalSoftmax), O of T or of the inputs' 16-bit scalar.
template <class T, class B = DefaultBlocking, class QRows, class KRows, class VRows, class E, class LseSink>
void causal_softmax_rows(QRows Q, KRows K, VRows V, MatrixRef<E> O, LseSink&& lse, const SoftmaxOptions& options,
                         SoftmaxScratch<T>& scratch, Index query_offset, TileBias<T> bias) {
    if (Q.rows() == 0)
        return;
    const T scale = resolve_scale(static_cast<T>(options.scale), K.cols());
    const Index offset = query_offset == trailing_queries ? K.rows() - Q.rows() : query_offset;
    std::optional<TreeMask> tree;  // the draft tokens of a speculative step: the last Nq of the keys
    TreeMask::View tree_view{};
    TileBias<T> tile_bias = bias;
    if (!options.parents.empty()) {
        tree.emplace(options.parents, K.rows() - static_cast<Index>(options.parents.size()));
        tree_view = {&*tree, offset - (K.rows() - static_cast<Index>(options.parents.size()))};
        tile_bias = {&TreeMask::fill<T>, &tree_view};
    }
    // A window past every distance between a query and a key limits nothing (causal: Nk).
    const Index farthest = std::max(offset + Q.rows() - 1, K.rows() - 1 - offset);
    const Index window = options.causal ? effective_window(options.window, K.rows())
                                        : effective_window(options.window, farthest + 1);
    TiledCausalSoftmax<T, B, KRows, VRows, QRows> kernel(std::move(Q), std::move(K), std::move(V), scale, window,
                                                         options.sink_tokens, scratch, LogitRule::of(options),
                                                         tile_bias);
    kernel.set_query_offset(offset);
    kernel.run(O, lse);
}

template <class T, class B = DefaultBlocking, class LseSink>
void causal_softmax_views(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                          MatrixRef<T> O, LseSink&& lse, const SoftmaxOptions& options, SoftmaxScratch<T>& scratch,
                          Index query_offset = trailing_queries, TileBias<T> bias = {}) {
    causal_softmax_rows<T, B>(PlainRows<T>(Q), PlainRows<T>(K), PlainRows<T>(V), O, lse, options, scratch,
                              query_offset, bias);
}

/// The kernel on bfloat16 or float16 views and a scratch, O of E or float, after the
/// checks: Q, K and V read in place through ConvertedRows (bfloat16 products on
/// AVX512-BF16, tiles converted to float elsewhere), the softmax and the accumulators in
/// float. Query row i sits at position query_offset + i (trailing_queries: Nk − Nq + i).
template <LowPrecision E, class Out, class LseSink>
void causal_softmax_converted(const ConstMatrixRef<E>& Q, const ConstMatrixRef<E>& K, const ConstMatrixRef<E>& V,
                              MatrixRef<Out> O, LseSink&& lse, const SoftmaxOptions& options,
                              SoftmaxScratch<float>& scratch, Index query_offset, TileBias<float> bias) {
    causal_softmax_rows<float>(ConvertedRows<E>(Q, scratch.tiles.queries, scratch.converted_q),
                               ConvertedRows<E>(K, scratch.tiles.keys, scratch.converted_k),
                               ConvertedRows<E>(V, scratch.tiles.keys, scratch.converted_v), O, lse, options, scratch,
                               query_offset, bias);
}

/// The same with a scratch of the measured tiles for the call.
template <LowPrecision E, class Out, class LseSink>
void causal_softmax_converted(const ConstMatrixRef<E>& Q, const ConstMatrixRef<E>& K, const ConstMatrixRef<E>& V,
                              MatrixRef<Out> O, LseSink&& lse, const SoftmaxOptions& options,
                              TileBias<float> bias = {}) {
    if (Q.rows() == 0)
        return;
    SoftmaxScratch<float> scratch(K.cols(), V.cols(), default_tiles(effective_window(options.window, K.rows())));
    causal_softmax_converted<E>(Q, K, V, O, lse, options, scratch, trailing_queries, bias);
}

/// The kernel on views, after the checks; `lse(i, value)` receives each row's log-sum-exp.
template <class T, class LseSink>
void causal_softmax_views(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                          MatrixRef<T> O, LseSink&& lse, const SoftmaxOptions& options, SoftmaxTiles tiles,
                          TileBias<T> bias = {}) {
    if (Q.rows() == 0)
        return;
    SoftmaxScratch<T> scratch(K.cols(), V.cols(), tiles);
    causal_softmax_views<T>(Q, K, V, O, lse, options, scratch, trailing_queries, bias);
}

/// The same with the measured tiles for the call (default_tiles).
template <class T, class LseSink>
void causal_softmax_views(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                          MatrixRef<T> O, LseSink&& lse, const SoftmaxOptions& options) {
    causal_softmax_views<T>(Q, K, V, O, lse, options, default_tiles(effective_window(options.window, K.rows())));
}

/// Queries Q at positions query_offset + i against keys K/V at positions 0, 1, ..., with
/// the causal rule (or none), the window and the sinks counted in those positions: one block of a
/// longer sequence (ring attention: Q a shard, K/V another shard's pairs). Writes the
/// block's softmax-weighted outputs into O and each row's log-sum-exp into lse[i]
/// (−∞ and a zero row where a query sees no key of the block), which merge with other
/// blocks' exactly (SoftmaxState). After the checks; query_offset ≥ 0 under the causal
/// rule, any offset without it (rule.causal false: every key of the block both ways).
/// `rule`: the softcap and ALiBi slope of the block's head (a sink logit joins once,
/// after every block is merged, not here).
template <class T>
void causal_softmax_block(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                          Index query_offset, T scale, Index window, Index sinks, MatrixRef<T> O, T* lse,
                          SoftmaxScratch<T>& scratch, const LogitRule& rule = {}) {
    if (Q.rows() == 0)
        return;
    MEMATTN_DASSERT(!rule.sink && (query_offset >= 0 || !rule.causal));
    // A window longer than the farthest distance in the block limits nothing.
    const Index span = rule.causal ? query_offset + Q.rows()
                                   : std::max(query_offset + Q.rows() - 1, K.rows() - 1 - query_offset) + 1;
    TiledCausalSoftmax<T> kernel(PlainRows<T>(Q), PlainRows<T>(K), PlainRows<T>(V), scale, window >= span ? 0 : window,
                                 std::min(sinks, K.rows()), scratch, rule);
    kernel.set_query_offset(query_offset);
    kernel.run(O, [lse](Index i, T value) { lse[i] = value; });
}

/// The kernel over `keys` keys and values read through the row sources make_keys(tile)
/// and make_values(tile) build for the kernel's tile of keys, after the checks.
template <class T, class MakeKeys, class MakeValues>
void causal_softmax_sources(const ConstMatrixRef<T>& Q, Index keys, Index d, Index dv, MatrixRef<T>& O,
                            const SoftmaxOptions& options, const MakeKeys& make_keys, const MakeValues& make_values) {
    if (Q.rows() == 0)
        return;
    const Index window = effective_window(options.window, keys);
    SoftmaxScratch<T> scratch(d, dv, default_tiles(window));
    const T scale = resolve_scale(static_cast<T>(options.scale), d);
    TiledCausalSoftmax<T, DefaultBlocking, decltype(make_keys(Index{})), decltype(make_values(Index{}))> kernel(
        PlainRows<T>(Q), make_keys(scratch.tiles.keys), make_values(scratch.tiles.keys), scale, window,
        options.sink_tokens, scratch, LogitRule::of(options));
    kernel.run(O, [](Index, T) {});
}

/// The kernel over the first `keys` rows of K and V kept in storage S (the prefill of a
/// compact cache), after the checks: each K/V tile is converted to T when a query tile
/// reaches it (DecodedRows), into two buffers of one tile.
template <class T, class S>
void causal_softmax_stored(const ConstMatrixRef<T>& Q, const StoredRows<T, S>& K, const StoredRows<T, S>& V,
                           Index keys, MatrixRef<T> O, const SoftmaxOptions& options) {
    causal_softmax_sources<T>(
        Q, keys, K.cols(), V.cols(), O, options, [&](Index tile) { return DecodedRows<T, S>(K, keys, tile); },
        [&](Index tile) { return DecodedRows<T, S>(V, keys, tile); });
}

/// The same over keys whose first `kept` rows are stored in K and whose last Q.rows() rows
/// are `given` (StoredThenGiven: a prefill of `PerChannelKeys<S>` storage), and the first
/// kept + Q.rows() rows of V.
template <class T, class SK, class SV>
void causal_softmax_stored(const ConstMatrixRef<T>& Q, const StoredRows<T, SK>& K, Index kept,
                           const ConstMatrixRef<T>& given, const StoredRows<T, SV>& V, MatrixRef<T> O,
                           const SoftmaxOptions& options) {
    const Index keys = kept + given.rows();
    causal_softmax_sources<T>(
        Q, keys, K.cols(), V.cols(), O, options,
        [&](Index tile) { return StoredThenGiven<T, SK>(K, kept, given, tile); },
        [&](Index tile) { return DecodedRows<T, SV>(V, keys, tile); });
}

/// A public call after its checks, with the measured tiles: the float or double kernel
/// on views of T, or the converted kernel on 16-bit inputs.
template <class T, class Out, class LseSink>
void causal_softmax_call(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                         MatrixRef<Out> O, LseSink&& lse, const SoftmaxOptions& options,
                         TileBias<arithmetic_t<T>> bias = {}) {
    if constexpr (LowPrecision<T>)
        causal_softmax_converted<T>(Q, K, V, O, lse, options, bias);
    else
        causal_softmax_views<T>(Q, K, V, O, lse, options, default_tiles(effective_window(options.window, K.rows())),
                                bias);
}

}  // namespace detail

/// O = causal softmax attention of Q over K/V (see the top of the file and docs/design.md).
/// Any row-major Eigen expressions of one scalar type, e.g. one head's columns of a wider
/// buffer; O is written in place and must not overlap Q, K or V. Q, K and V of
/// Eigen::bfloat16 or Eigen::half compute in float (bfloat16 products on AVX512-BF16,
/// docs/design.md §4.7c), O of the same 16-bit type or of float.
template <class DQ, class DK, class DV, detail::EigenMatrix DO>
void causal_softmax_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                              const Eigen::MatrixBase<DV>& V, DO&& O, const SoftmaxOptions& options = {}) {
    using T = typename DQ::Scalar;
    using A = arithmetic_t<T>;
    using Out = typename std::remove_cvref_t<DO>::Scalar;
    static_assert(Scalar<T> || LowPrecision<T>, "memattn::causal_softmax_attention: the scalar type must be float, "
                                                "double, Eigen::bfloat16 or Eigen::half.");
    static_assert(detail::same_scalar<DQ, DK, DV>,
                  "memattn::causal_softmax_attention: Q, K and V must have the same scalar type.");
    static_assert(std::is_same_v<Out, T> || std::is_same_v<Out, A>,
                  "memattn::causal_softmax_attention: O must have the scalar type of Q (of bfloat16 or half: or "
                  "float).");
    constexpr const char* function = "causal_softmax_attention";
    const ConstMatrixRef<T> q = detail::sequence(Q), k = detail::sequence(K), v = detail::sequence(V);
    MatrixRef<Out> o = detail::output(std::forward<DO>(O));
    detail::check_softmax_arguments<A>(function, detail::shape(q), detail::shape(k), detail::shape(v),
                                       detail::shape(o), options);
    detail::check_disjoint(function, "O", o, q, k, v);
    detail::causal_softmax_call<T>(q, k, v, o, [](Index, A) {}, options);
}

/// As above with a dense `bias` (Nq × Nk, any Eigen expression, read tile by tile without
/// a copy): of the scalar type (float for bfloat16 or half inputs), added to the logits
/// after the softcap and ALiBi (−∞ masks a key); of bool, a mask (true: visible). It
/// restricts the causal rule and the window further; a key tile it masks wholly is skipped.
template <class DQ, class DK, class DV, detail::EigenMatrix DO, class DB>
void causal_softmax_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                              const Eigen::MatrixBase<DV>& V, DO&& O, const SoftmaxOptions& options,
                              const Eigen::MatrixBase<DB>& bias) {
    using T = typename DQ::Scalar;
    using A = arithmetic_t<T>;
    using Out = typename std::remove_cvref_t<DO>::Scalar;
    using B = typename DB::Scalar;
    static_assert(Scalar<T> || LowPrecision<T>, "memattn::causal_softmax_attention: the scalar type must be float, "
                                                "double, Eigen::bfloat16 or Eigen::half.");
    static_assert(detail::same_scalar<DQ, DK, DV>,
                  "memattn::causal_softmax_attention: Q, K and V must have the same scalar type.");
    static_assert(std::is_same_v<Out, T> || std::is_same_v<Out, A>,
                  "memattn::causal_softmax_attention: O must have the scalar type of Q (of bfloat16 or half: or "
                  "float).");
    static_assert(std::is_same_v<B, A> || std::is_same_v<B, bool>,
                  "memattn::causal_softmax_attention: the bias must have the scalar type of Q (additive; float for "
                  "bfloat16 or half) or bool (a mask).");
    constexpr const char* function = "causal_softmax_attention";
    const ConstMatrixRef<T> q = detail::sequence(Q), k = detail::sequence(K), v = detail::sequence(V);
    MatrixRef<Out> o = detail::output(std::forward<DO>(O));
    detail::check_softmax_arguments<A>(function, detail::shape(q), detail::shape(k), detail::shape(v),
                                       detail::shape(o), options);
    detail::require(bias.rows() == q.rows() && bias.cols() == k.rows(), function, "bias", "has shape ",
                    detail::shape(bias), ", expected ", q.rows(), 'x', k.rows(), " (Nq x Nk)");
    detail::require(options.parents.empty(), function, "bias",
                    "is given with options.parents: a tree mask and a dense bias do not combine (give the tree as "
                    "the mask)");
    detail::check_disjoint(function, "O", o, q, k, v);
    detail::check_bias_disjoint(function, o, bias);
    const detail::DenseBias<DB> dense{&bias.derived(), 0};
    detail::causal_softmax_call<T>(q, k, v, o, [](Index, A) {}, options, dense.template tile<A>());
}

/// As above, and writes lse_i = log(e^{σ} + Σ_{j visible} e^{s_ij}) into the vector
/// `lse` (Nq coefficients of the scalar type, float for bfloat16 or half inputs, row or
/// column, e.g. a memattn::Vector<T>): s_ij is the logit the softmax takes, scale·q_i·k_j
/// after options.softcap and options.alibi_slopes, and σ = options.sink_logits[0] when
/// given (no e^{σ} term otherwise). −∞ for a row that sees no key and has no sink logit.
template <class DQ, class DK, class DV, detail::EigenMatrix DO, detail::EigenMatrix DL>
void causal_softmax_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                              const Eigen::MatrixBase<DV>& V, DO&& O, DL&& lse, const SoftmaxOptions& options = {}) {
    using T = typename DQ::Scalar;
    using A = arithmetic_t<T>;
    using Out = typename std::remove_cvref_t<DO>::Scalar;
    static_assert(Scalar<T> || LowPrecision<T>, "memattn::causal_softmax_attention: the scalar type must be float, "
                                                "double, Eigen::bfloat16 or Eigen::half.");
    static_assert(detail::same_scalar<DQ, DK, DV>,
                  "memattn::causal_softmax_attention: Q, K and V must have the same scalar type.");
    static_assert(std::is_same_v<Out, T> || std::is_same_v<Out, A>,
                  "memattn::causal_softmax_attention: O must have the scalar type of Q (of bfloat16 or half: or "
                  "float).");
    static_assert(std::is_same_v<typename std::remove_cvref_t<DL>::Scalar, A>,
                  "memattn::causal_softmax_attention: lse must have the scalar type of Q (float for bfloat16 or half).");
    constexpr const char* function = "causal_softmax_attention";
    const ConstMatrixRef<T> q = detail::sequence(Q), k = detail::sequence(K), v = detail::sequence(V);
    MatrixRef<Out> o = detail::output(std::forward<DO>(O));
    detail::check_softmax_arguments<A>(function, detail::shape(q), detail::shape(k), detail::shape(v),
                                       detail::shape(o), options);
    detail::require((lse.rows() == 1 || lse.cols() == 1) && lse.size() == Q.rows(), function, "lse", "has shape ",
                    detail::shape(lse), ", expected a vector of ", Q.rows(), " coefficients (Q is ", detail::shape(Q),
                    ")");
    detail::check_disjoint(function, "O", o, q, k, v);
    if constexpr (detail::check_output<DL, false>()) {
        detail::check_disjoint(function, "lse", lse, q, k, v);
        detail::require_disjoint(function, "lse", lse, "O", o);
        detail::causal_softmax_call<T>(q, k, v, o, [&lse](Index i, A value) { lse.coeffRef(i) = value; }, options);
    }
}

}  // namespace memattn
