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
// (then the sink tokens below the window); where the walk reaches key 0 (no window's
// edge) they start at multiples of `keys` (the diagonal's may be shorter), else they
// end at the diagonal. Per (query tile, key tile):
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
//
// The parts: kernels/softmax_tiles.hpp (the tiles, the scratch, the tile loop),
// kernels/softmax_masks.hpp (bias, mask, tree) and kernels/softmax_rows.hpp (the row
// sources: in place, 16-bit, compact storage); this header the checks and the calls.

#include "memattn/detail/bf16_product.hpp"
#include "memattn/detail/tile_product.hpp"
#include "memattn/kernels/softmax_options.hpp"
#include "memattn/kernels/softmax_tiles.hpp"
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
#include <type_traits>
#include <utility>
#include <vector>

namespace memattn {

namespace detail {

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

/// What a call's options make of its shapes for the tiled kernel: the scale, the query
/// offset (trailing_queries: Nk − Nq), the window and sinks it runs with, and the tile
/// bias: `dense`, or the tree of options.parents, held here (the bias points at it, so a
/// setup is neither copied nor moved, and outlives its kernel).
template <class T>
struct KernelSetup {
    KernelSetup(const SoftmaxOptions& options, Index nq, Index nk, Index d, Index query_offset, TileBias<T> dense)
        : scale(resolve_scale(static_cast<T>(options.scale), d)),
          offset(query_offset == trailing_queries ? nk - nq : query_offset), bias(dense) {
        // A window past every distance between a query and a key limits nothing (causal: Nk).
        const Index farthest = std::max(offset + nq - 1, nk - 1 - offset);
        window = options.causal ? effective_window(options.window, nk) : effective_window(options.window, farthest + 1);
        sinks = options.sink_tokens;
        if (!options.parents.empty()) {  // the draft tokens of a speculative step: the last Nq of the keys
            const Index past = nk - static_cast<Index>(options.parents.size());
            const double slope = options.alibi_slopes.empty() ? 0.0 : options.alibi_slopes[0];
            tree.emplace(options.parents, past, TreeMask::Positions{window, options.sink_tokens, slope});
            view = {&*tree, offset - past};
            bias = TreeMask::tile<T>(view);
            window = 0;  // the tree's fill counts it in the tree's positions (TreeMask)
            sinks = tree->sink_rows();
        }
    }
    KernelSetup(const KernelSetup&) = delete;
    KernelSetup& operator=(const KernelSetup&) = delete;

    T scale;
    Index offset, window = 0, sinks = 0;
    std::optional<TreeMask> tree;
    TreeMask::View view{};
    TileBias<T> bias;
};

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
    const KernelSetup<T> setup(options, Q.rows(), K.rows(), K.cols(), query_offset, bias);
    TiledCausalSoftmax<T, B, KRows, VRows, QRows> kernel(std::move(Q), std::move(K), std::move(V), setup.scale,
                                                         setup.window, setup.sinks, scratch, LogitRule::of(options),
                                                         setup.bias);
    kernel.set_query_offset(setup.offset);
    kernel.run(O, lse);
}

/// The most query heads causal_softmax_heads takes: their scratches share L2 with the
/// key and value tiles (four heads' take ~0.6 MiB with 64-row query tiles at d = 128,
/// ~1.7 MiB with 192-row ones). Chosen as the common GQA group (32/8, 64/16); 2 and 8
/// were not measured.
inline constexpr std::size_t max_heads_together = 4;

/// causal_softmax_rows for `heads` ≤ max_heads_together query heads that read the same K
/// and V (a GQA group's) with the same query rows, offset, window, sinks and tree (their
/// options differ in the ALiBi slope and the sink logit only): the heads walk the key
/// tiles together (TiledCausalSoftmax::run_together), each with its own scratch. Each
/// head's results are causal_softmax_rows' alone, bit for bit. Head h's queries are
/// query(h) (a row source), its output output(h) (a MatrixRef<E>), its options
/// options(h), its scratch scratch(h), its dense bias bias(h) (a TileBias<T>: empty for
/// none; the tree of options.parents takes its place); lse(h, i, value) receives its row
/// i's.
template <class T, class E, class B = DefaultBlocking, class KRows, class VRows, class Query, class Output,
          class Options, class Scratch, class LseSink, class Bias>
void causal_softmax_heads(std::size_t heads, Query&& query, const KRows& K, const VRows& V, Output&& output,
                          LseSink&& lse, Options&& options, Scratch&& scratch, Index query_offset, Bias&& bias) {
    using QRows = std::decay_t<decltype(query(std::size_t{}))>;
    using Kernel = TiledCausalSoftmax<T, B, KRows, VRows, QRows>;
    MEMATTN_DASSERT(heads <= max_heads_together);
    std::array<std::optional<KernelSetup<T>>, max_heads_together> setups;
    std::array<std::optional<Kernel>, max_heads_together> kernels;
    std::array<Kernel*, max_heads_together> running{};
    for (std::size_t h = 0; h < heads; ++h) {
        QRows Q = query(h);
        if (Q.rows() == 0)
            return;
        const SoftmaxOptions& head = options(h);
        const KernelSetup<T>& setup = setups[h].emplace(head, Q.rows(), K.rows(), K.cols(), query_offset, bias(h));
        running[h] = &kernels[h].emplace(std::move(Q), K, V, setup.scale, setup.window, setup.sinks, scratch(h),
                                         LogitRule::of(head), setup.bias);
        running[h]->set_query_offset(setup.offset);
    }
    if (heads > 0)
        Kernel::template run_together<E>(std::span<Kernel* const>(running.data(), heads), output, lse);
}

template <class T, class B = DefaultBlocking, class LseSink>
void causal_softmax_views(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                          MatrixRef<T> O, LseSink&& lse, const SoftmaxOptions& options, SoftmaxScratch<T>& scratch,
                          Index query_offset = trailing_queries, TileBias<T> bias = {}) {
    causal_softmax_rows<T, B>(PlainRows<T>(Q), PlainRows<T>(K), PlainRows<T>(V), O, lse, options, scratch,
                              query_offset, bias);
}

/// The kernel on bfloat16 or float16 views and a scratch, O of E or float, after the
/// checks: Q, K and V read in place through ConvertedRows (bfloat16 products where the
/// CPU has AVX512-BF16 — in a build that does not target it, compiled by target and chosen
/// here at run time, a second instantiation of the kernel — tiles converted to float
/// elsewhere), the softmax and the accumulators in float. Query row i sits at position
/// query_offset + i (trailing_queries: Nk − Nq + i).
template <LowPrecision E, class Out, class LseSink>
void causal_softmax_converted(const ConstMatrixRef<E>& Q, const ConstMatrixRef<E>& K, const ConstMatrixRef<E>& V,
                              MatrixRef<Out> O, LseSink&& lse, const SoftmaxOptions& options,
                              SoftmaxScratch<float>& scratch, Index query_offset, TileBias<float> bias) {
    const auto run = [&]<bool Pairs>() {
        using Rows = ConvertedRows<E, Pairs>;
        causal_softmax_rows<float>(Rows(Q, scratch.tiles.queries, scratch.converted_q),
                                   Rows(K, scratch.tiles.keys, scratch.converted_k),
                                   Rows(V, scratch.tiles.keys, scratch.converted_v), O, lse, options, scratch,
                                   query_offset, bias);
    };
    if constexpr (std::is_same_v<E, Eigen::bfloat16>)
        with_bf16_products(run);
    else
        run.template operator()<false>();
}

/// Rows [0, rows) of `heads` adjacent query heads of a row-major Q (row stride ldq, head
/// h's d columns from q + h·d), each rounded to bfloat16 (nearest even) into out[h] (at
/// least rows × d): row by row, every head's part of a row at once (adjacent in it),
/// eight rows asked for ahead. A row of a batch's Q holds every head (16 KiB at 32 ×
/// 128), so head by head each head's part of a row sat in a page of its own (Intel Xeon,
/// 4 prompts of 512 tokens into a pool of bfloat16 rows: 68 ms head by head, 59–60 row
/// by row, 54–56 with the requests).
inline void round_query_heads(const float* q, Index ldq, Index rows, Index d, std::size_t heads,
                              Matrix<Eigen::bfloat16>* out) {
    constexpr Index ahead = 8;
    const Index width = static_cast<Index>(heads) * d;
    for (Index r = 0; r < rows; ++r) {
        if (r + ahead < rows)
            prefetch_rows(q + (r + ahead) * ldq, 1, ldq, width);
        for (std::size_t h = 0; h < heads; ++h)
            out[h].row(r) = Eigen::Map<const Vector<float>>(q + r * ldq + static_cast<Index>(h) * d, d)
                                .transpose()
                                .template cast<Eigen::bfloat16>();
    }
}

/// causal_softmax_converted for `heads` query heads that read the same K and V
/// (causal_softmax_heads): head h's queries query(h) (a ConstMatrixRef<E>), its output
/// output(h) (a MatrixRef<Out>), its options, scratch and dense bias options(h),
/// scratch(h), bias(h); lse(h, i, value). K's and V's tiles are converted, where they
/// are, into the first head's scratch (each head's tile in turn); with bfloat16 pairs the
/// value tiles are packed once for the heads, into `shared` (emptied first).
template <LowPrecision E, class Out, class Query, class Output, class LseSink, class Options, class Scratch, class Bias>
void causal_softmax_converted_heads(std::size_t heads, Query&& query, const ConstMatrixRef<E>& K,
                                    const ConstMatrixRef<E>& V, Output&& output, LseSink&& lse, Options&& options,
                                    Scratch&& scratch, Index query_offset, Bias&& bias, SharedValueTile& shared) {
    shared.clear();
    const auto run = [&]<bool Pairs>() {
        using Rows = ConvertedRows<E, Pairs>;
        SoftmaxScratch<float>& lead = scratch(std::size_t{0});
        const auto rows = [&](std::size_t h) {
            SoftmaxScratch<float>& own = scratch(h);
            return Rows(query(h), own.tiles.queries, own.converted_q);
        };
        causal_softmax_heads<float, Out>(heads, rows, Rows(K, lead.tiles.keys, lead.converted_k),
                                         Rows(V, lead.tiles.keys, lead.converted_v, &shared), output, lse, options,
                                         scratch, query_offset, bias);
    };
    if constexpr (std::is_same_v<E, Eigen::bfloat16>)
        with_bf16_products(run);
    else
        run.template operator()<false>();
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

/// FpMath::bf16 on float views (causal_softmax_attention): Q, K and V rounded to bfloat16
/// (nearest even, Eigen's vectorised cast; O(N·d) against the kernel's O(N·W·d)), then
/// the kernel of bfloat16 inputs with O of float: bit for bit the call on the rounded
/// inputs. Only the public calls and the multi-head kernel reach it: the memories' own
/// calls reach causal_softmax_views or causal_softmax_stored, which do not round (a
/// memory of bfloat16 or FP8 rows that takes the option prefills with strict products).
template <class LseSink>
void causal_softmax_rounded(const ConstMatrixRef<float>& Q, const ConstMatrixRef<float>& K,
                            const ConstMatrixRef<float>& V, MatrixRef<float> O, LseSink&& lse,
                            const SoftmaxOptions& options, TileBias<float> bias) {
    if (Q.rows() == 0)
        return;
    using E = Eigen::bfloat16;
    const Matrix<E> q = Q.template cast<E>(), k = K.template cast<E>(), v = V.template cast<E>();
    causal_softmax_converted<E, float>(q, k, v, O, lse, options, bias);
}

/// A public call after its checks, with the measured tiles: the float or double kernel
/// on views of T, or the converted kernel on 16-bit inputs.
template <class T, class Out, class LseSink>
void causal_softmax_call(const ConstMatrixRef<T>& Q, const ConstMatrixRef<T>& K, const ConstMatrixRef<T>& V,
                         MatrixRef<Out> O, LseSink&& lse, const SoftmaxOptions& options,
                         TileBias<arithmetic_t<T>> bias = {}) {
    if constexpr (LowPrecision<T>) {
        causal_softmax_converted<T>(Q, K, V, O, lse, options, bias);
    } else {
        if constexpr (std::is_same_v<T, float>) {
            if (options.fpmath == FpMath::bf16) {
                causal_softmax_rounded(Q, K, V, O, lse, options, bias);
                return;
            }
        }
        causal_softmax_views<T>(Q, K, V, O, lse, options, default_tiles(effective_window(options.window, K.rows())),
                                bias);
    }
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
