#pragma once
// Multi-head latent attention (DeepSeek-V2/V3/R1, Kimi K2) around a LatentKVCache
// (memory/latent_kv_cache.hpp): the absorbed decode step end to end, and the softmax
// scale with YaRN's attention factor.
//
// Head h of H has a query [q_nope_h | q_rope_h] (d_nope + d_r), a key [c_j W_UK_hᵀ | kr_j]
// and a value c_j W_UV_hᵀ (d_v), where c_j (r) and kr_j (d_r) are the cached token's
// latent and RoPE key. W_UK_h (d_nope × r) and W_UV_h (d_v × r) are head h's blocks of
// the up-projection (DeepSeek's kv_b_proj, split per head into its key and value
// halves), stacked head after head: W_UK is (H · d_nope) × r, W_UV (H · d_v) × r. Since
// q_nope_h · (c_j W_UK_hᵀ) = (q_nope_h W_UK_h) · c_j, decode absorbs W_UK into the query
// and W_UV into the output:
//
//   q_lat_h = q_nope_h W_UK_h                          (1 × r)
//   o_lat_h = LatentKVCache::attend([q_lat_h | q_rope_h])   (1 × r)
//   out_h   = o_lat_h W_UV_hᵀ                          (1 × d_v)
//
// which is the unabsorbed attention exactly, to rounding, at 2·(2r + d_r) FLOPs per head
// and cached token instead of expanding every cached token's keys and values per head.
//
// A prompt (mla_prefill) attends causally: token t of n sees the cache's P past tokens
// and the prompt's tokens up to itself. Absorbed, it costs 2·(2r + d_r) per head and
// (query, key) pair; expanded (each head's keys [c W_UK_hᵀ | kr] and values c W_UV_hᵀ
// made once per call, a chunk of keys at a time, then the plain causal kernel on them) it
// costs 2·(d_nope + d_r + d_v) per pair plus 2·r·(d_nope + d_v) per head and key: for
// DeepSeek's shapes 2,176 against 640 per pair plus 262,144 per key (the absorbed form
// pays that per query instead), so expanding pays once the prompt is long beside the
// past (mla_expands, measured), as DeepSeek's and vLLM's prefill expand and their
// decode absorbs.

#include "memattn/execution/executor.hpp"
#include "memattn/execution/parallel.hpp"
#include "memattn/kernels/causal_softmax.hpp"
#include "memattn/memory/latent_kv_cache.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

namespace memattn {

/// YaRN's attention factor as DeepSeek computes it: 0.1 · mscale · ln(factor) + 1 for a
/// context stretched by `factor` > 1, and 1 otherwise.
inline double yarn_mscale(double factor, double mscale = 1) {
    detail::require(std::isfinite(factor) && factor > 0, "yarn_mscale", "factor", "is ", factor,
                    ", expected a positive number");
    return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

/// The softmax scale of a DeepSeek MLA layer: mscale² / sqrt(qk_head_dim), where
/// qk_head_dim = qk_nope_head_dim + qk_rope_head_dim (192 for DeepSeek-V3) and mscale =
/// yarn_mscale(rope_factor, mscale_all_dim) (DeepSeek-V3: factor 40, mscale_all_dim 1);
/// rope_factor 1 (no YaRN) gives 1/sqrt(qk_head_dim).
inline double mla_softmax_scale(Index qk_head_dim, double rope_factor = 1, double mscale_all_dim = 1) {
    detail::require(qk_head_dim >= 1, "mla_softmax_scale", "qk_head_dim", "is ", qk_head_dim, ", expected >= 1");
    const double m = yarn_mscale(rope_factor, mscale_all_dim);
    return m * m / std::sqrt(static_cast<double>(qk_head_dim));
}

/// What mla_decode and mla_prefill take as a cache: a LatentKVCache, or a sequence of a
/// PagedLatentKVCache (serving/paged_latent_kv_cache.hpp).
template <class C>
concept LatentCache = requires(const C& c, ConstMatrixRef<typename C::Scalar> q, MatrixRef<typename C::Scalar> o) {
    { c.latent_dim() } -> std::convertible_to<Index>;
    { c.rope_dim() } -> std::convertible_to<Index>;
    { c.length() } -> std::convertible_to<Index>;
    { c.options() } -> std::convertible_to<SoftmaxOptions>;
    c.view();
    c.attend(q, o, ExecutorRef{});
};

namespace detail {

/// The buffers of an absorbed step on the calling thread: the packed queries and the
/// latent outputs, grown to the largest step seen and kept, so a step allocates nothing
/// after the first of its size.
template <class T>
struct MlaBuffers {
    Matrix<T> packed, latent;
};

template <class T>
MlaBuffers<T>& mla_buffers() {
    thread_local MlaBuffers<T> buffers;
    return buffers;
}

}  // namespace detail

/// One absorbed decode step of multi-head latent attention (see the top of the file):
/// the query heads q_nope (H × d_nope) and q_rope (H × d_r, turned to the newest token's
/// position) against every token of `cache`, through the up-projections W_UK
/// ((H · d_nope) × r) and W_UV ((H · d_v) × r); out is H × d_v. The absorptions are one
/// product per head, spread with the attend over the executor's threads (bitwise the
/// same for any of them). The caller appends the step's own token to the cache first
/// (update), as with any memory's decode. Allocates nothing after the first step of its
/// size on a thread (and the cache's own rule for its attend). Throws
/// std::invalid_argument, changing nothing, on shapes that do not fit.
template <LatentCache Cache, class T = typename Cache::Scalar>
void mla_decode(const Cache& cache, std::type_identity_t<ConstMatrixRef<T>> q_nope,
                std::type_identity_t<ConstMatrixRef<T>> q_rope, std::type_identity_t<ConstMatrixRef<T>> W_UK,
                std::type_identity_t<ConstMatrixRef<T>> W_UV, std::type_identity_t<MatrixRef<T>> out,
                ExecutorRef executor = {}) {
    constexpr const char* function = "mla_decode";
    const Index heads = q_nope.rows(), nope = q_nope.cols(), r = cache.latent_dim(), dr = cache.rope_dim();
    detail::require(q_rope.rows() == heads && q_rope.cols() == dr, function, "q_rope", "has shape ",
                    detail::shape(q_rope), ", expected ", heads, 'x', dr, " (q_nope is ", detail::shape(q_nope),
                    ", the cache's rope_dim ", dr, ")");
    detail::require(W_UK.cols() == r && W_UK.rows() == detail::checked_product(function, "q_nope", heads, nope, "heads x d_nope"), function, "W_UK",
                    "has shape ", detail::shape(W_UK), ", expected ", heads * nope, 'x', r,
                    " (H · d_nope rows, q_nope being ", detail::shape(q_nope), "; the cache's latent_dim columns)");
    detail::require(W_UV.cols() == r && heads > 0 && W_UV.rows() % heads == 0, function, "W_UV", "has shape ",
                    detail::shape(W_UV), ", expected H · d_v rows for the H = ", heads,
                    " heads of q_nope and the cache's latent_dim ", r, " columns");
    const Index dv = heads > 0 ? W_UV.rows() / heads : 0;
    detail::require(out.rows() == heads && out.cols() == dv, function, "out", "has shape ", detail::shape(out),
                    ", expected ", heads, 'x', dv, " (H × d_v, W_UV being ", detail::shape(W_UV), ")");
    detail::require_disjoint(function, "out", out, "q_nope", q_nope);
    detail::require_disjoint(function, "out", out, "q_rope", q_rope);
    detail::require_disjoint(function, "out", out, "W_UK", W_UK);
    detail::require_disjoint(function, "out", out, "W_UV", W_UV);
    const SoftmaxOptions options = cache.options();
    if (!options.sink_logits.empty() && options.sink_logits.size() != 1)
        detail::require(static_cast<Index>(options.sink_logits.size()) == heads, function, "q_nope", "has ", heads,
                        " rows (heads), but the cache's options give ", options.sink_logits.size(),
                        " sink logits, one per head");

    detail::MlaBuffers<T>& buffers = detail::mla_buffers<T>();
    if (buffers.packed.rows() < heads || buffers.packed.cols() != r + dr)
        buffers.packed.resize(heads, r + dr);
    if (buffers.latent.rows() < heads || buffers.latent.cols() != r)
        buffers.latent.resize(heads, r);
    auto packed = buffers.packed.topRows(heads);
    auto latent = buffers.latent.topRows(heads);
    // Head by head: each head's products are the same whoever runs them.
    const double work = static_cast<double>(heads) * static_cast<double>(r) * static_cast<double>(nope + dv);
    const int threads = work < detail::latent_parallel_work ? 1 : 0;
    detail::parallel_ranges(
        heads, [](Index) { return 1.0; },
        [&](Index first, Index last) {
            for (Index h = first; h < last; ++h) {
                packed.row(h).head(r).noalias() = q_nope.row(h) * W_UK.middleRows(h * nope, nope);
                packed.row(h).tail(dr) = q_rope.row(h);
            }
        },
        threads, executor);
    cache.attend(packed, latent, executor);
    detail::parallel_ranges(
        heads, [](Index) { return 1.0; },
        [&](Index first, Index last) {
            for (Index h = first; h < last; ++h)
                out.row(h).noalias() = latent.row(h) * W_UV.middleRows(h * dv, dv).transpose();
        },
        threads, executor);
}

/// How mla_prefill attends a prompt (see the top of the file).
enum class MlaPrefill {
    automatic,  ///< expanded where mla_expands says so, absorbed otherwise
    absorbed,   ///< the queries absorbed, every head over the stored rows
    expanded,   ///< each head's keys and values expanded, a chunk of keys at a time
};

/// The fewest prompt tokens mla_prefill's automatic choice expands.
inline constexpr Index mla_expand_tokens = 128;

/// Whether MlaPrefill::automatic expands a prompt of n tokens after `past` cached ones
/// (d_nope, d_r, d_v the heads' widths, r the latent's): from mla_expand_tokens tokens
/// on, where the expanded form's FLOPs, 2·(d_nope + d_r + d_v) a pair and 2·r·(d_nope +
/// d_v) a key, times 1.25 are at most the absorbed form's, 2·(2r + d_r) a pair and
/// 2·r·(d_nope + d_v) a query. Measured for DeepSeek-V3's shapes (16 heads, one thread,
/// AMD EPYC Zen 2, docs/performance.md), the rule picks the faster form at 64–1024 tokens
/// after 0 and 4096 cached ones: the expansion's products run slower than the kernel's.
inline bool mla_expands(Index n, Index past, Index r, Index dr, Index nope, Index dv) {
    if (n < mla_expand_tokens)
        return false;
    const double pairs = static_cast<double>(n) * (static_cast<double>(past) + static_cast<double>(n + 1) / 2);
    const double project = 2.0 * static_cast<double>(r) * static_cast<double>(nope + dv);
    const double absorbed = pairs * 2.0 * static_cast<double>(2 * r + dr) + static_cast<double>(n) * project;
    const double expanded = pairs * 2.0 * static_cast<double>(nope + dr + dv) + static_cast<double>(past + n) * project;
    return 1.25 * expanded <= absorbed;
}

namespace detail {

/// Keys a chunk of the expanded prefill expands at a time (their keys and values
/// 4096 · (d_nope + d_r + d_v) of T a thread).
inline constexpr Index mla_key_chunk = 4096;
/// Rows of stored latents the expansion's products take at a time (128 × 512 floats:
/// 256 KiB, in L2 beside a panel of the weights).
inline constexpr Index mla_expand_rows = 128;

/// One thread's buffers of a prefill, sized by its first head and reused by the next.
template <class T>
struct MlaPrefillScratch {
    Matrix<T> queries;            ///< n × (r + d_r) absorbed, n × (d_nope + d_r) expanded
    Matrix<T> latent;             ///< n × r: the absorbed path's latent outputs
    Matrix<T> uk_t, uv_t;         ///< W_UK_hᵀ (r × d_nope), W_UV_hᵀ (r × d_v)
    Matrix<T> keys, values;       ///< a chunk's expanded keys and values
    Matrix<T> decoded;            ///< a chunk's stored rows as T (compact storage)
    Matrix<T> part, acc;          ///< a chunk's outputs, the merged outputs (n × d_v)
    std::vector<T> part_lse, lse; ///< theirs log-sum-exps
    std::optional<SoftmaxScratch<T>> softmax;
    /// FpMath::bf16: the queries, a chunk's expanded keys and values rounded to bfloat16,
    /// and a tile of stored rows gathered across a pool's blocks.
    Matrix<Eigen::bfloat16> rounded_queries, rounded_keys, rounded_values, gathered;
    /// FpMath::bf16 in AMX tiles: W_UK_hᵀ and W_UV_hᵀ as B pairs (r/2 × d_nope, r/2 × d_v words).
    std::vector<std::uint32_t> uk_pairs, uv_pairs;

    SoftmaxScratch<T>& kernel_scratch(Index d, Index dv, SoftmaxTiles tiles) {
        if (!softmax || softmax->tiles != tiles || softmax->qt.rows() != d || softmax->acc.cols() != dv)
            softmax.emplace(d, dv, tiles);
        return *softmax;
    }
};

/// A Matrix of at least rows × cols, exactly cols wide, reused when it is.
template <class T>
void size_rows(Matrix<T>& m, Index rows, Index cols) {
    if (m.rows() < rows || m.cols() != cols)
        m.resize(rows, cols);
}

/// What mla_prefill reads of its arguments, for one head h at a time: rows t·H + h of
/// the packed queries and outputs (H heads of n tokens), head h's blocks of the weights.
template <class T>
struct MlaPrompt {
    ConstMatrixRef<T> q_nope, q_rope, W_UK, W_UV;
    T* out;      ///< row t·H + h of the outputs at out + (t·H + h)·ldo
    Index ldo;
    Index heads, tokens, past, r, dr, nope, dv;
    T scale;
    double softcap;
    std::span<const double> sinks;
    FpMath fpmath = FpMath::strict;  ///< bf16: the kernel's products in bfloat16 (latent_bf16_products)

    /// Head h's sink logit (−∞: none).
    [[nodiscard]] T sink(Index h) const {
        if (sinks.empty())
            return -std::numeric_limits<T>::infinity();
        return static_cast<T>(sinks[sinks.size() == 1 ? 0 : static_cast<std::size_t>(h)]);
    }
    /// out_h = latent · W_UV_hᵀ into rows t·H + h of out.
    void project_out(Index h, const Matrix<T>& latent, MlaPrefillScratch<T>& scratch) const {
        scratch.uv_t = W_UV.middleRows(h * dv, dv).transpose();
        tile_product<T>(tokens, dv, r, latent.data(), latent.cols(), 1, scratch.uv_t.data(), dv,
                        out + h * ldo, heads * ldo, nullptr);
    }
};

/// W (depth × cols, bfloat16 values held as T, depth even) as B pairs for amx_product:
/// word k·cols + c holds W(2k, c) low and W(2k + 1, c) high.
template <class T>
void mla_weight_pairs(const Matrix<T>& w, std::vector<std::uint32_t>& pairs) {
    const Index half = w.rows() / 2, cols = w.cols();
    pairs.resize(static_cast<std::size_t>(half * cols));
    const auto bits = [](T x) { return std::uint32_t{std::bit_cast<std::uint16_t>(Eigen::bfloat16(static_cast<float>(x)))}; };
    for (Index k = 0; k < half; ++k)
        for (Index c = 0; c < cols; ++c)
            pairs[static_cast<std::size_t>(k * cols + c)] = bits(w(2 * k, c)) | bits(w(2 * k + 1, c)) << 16;
}

/// The absorbed prefill of head h: [q_nope_h W_UK_h | q_rope_h] against every stored row.
template <class T, class S>
void mla_prefill_absorbed(const MlaPrompt<T>& p, Index h, const LatentRowsView<T, S>& rows,
                          MlaPrefillScratch<T>& scratch) {
    const Index width = p.r + p.dr, keys = p.past + p.tokens;
    size_rows(scratch.queries, p.tokens, width);
    tile_product<T>(p.tokens, p.r, p.nope, p.q_nope.data() + h * p.q_nope.outerStride(),
                    p.heads * p.q_nope.outerStride(), 1, p.W_UK.data() + h * p.nope * p.W_UK.outerStride(),
                    p.W_UK.outerStride(), scratch.queries.data(), width, nullptr);
    for (Index t = 0; t < p.tokens; ++t)
        scratch.queries.row(t).tail(p.dr) = p.q_rope.row(t * p.heads + h);
    size_rows(scratch.latent, p.tokens, p.r);
    const T sink = p.sink(h);
    LogitRule rule{.causal = true, .softcap = p.softcap};
    rule.sink = sink != -std::numeric_limits<T>::infinity();
    rule.sink_logit = rule.sink ? static_cast<double>(sink) : 0;
    SoftmaxScratch<T>& softmax = scratch.kernel_scratch(width, p.r, SoftmaxTiles{});
    const ConstMatrixRef<T> queries = scratch.queries.topRows(p.tokens);
    MatrixRef<T> latent = scratch.latent.topRows(p.tokens);
    const auto no_lse = [](Index, T) {};
    if constexpr (latent_bf16_products<T, S>) {
        if (p.fpmath == FpMath::bf16) {  // the queries rounded, the stored rows as bfloat16 pairs
            using E = Eigen::bfloat16;
            size_rows(scratch.rounded_queries, p.tokens, width);
            scratch.rounded_queries.topRows(p.tokens) = queries.template cast<E>();
            LatentPairTile<S> tile(rows, 0, keys, softmax.tiles.keys, scratch.gathered);
            with_bf16_products([&]<bool Pairs>() {
                using Source = LatentPairColumns<S, Pairs>;
                using Queries = ConvertedRows<E, Pairs>;
                TiledCausalSoftmax<float, DefaultBlocking, Source, Source, Queries> kernel(
                    Queries(scratch.rounded_queries.topRows(p.tokens), softmax.tiles.queries, softmax.converted_q),
                    Source(tile, keys, width, softmax.tiles.keys, softmax.converted_k),
                    Source(tile, keys, p.r, softmax.tiles.keys, softmax.converted_v), p.scale, 0, 0, softmax, rule);
                kernel.run(latent, no_lse);
            });
            p.project_out(h, scratch.latent, scratch);
            return;
        }
    }
    if (std::is_same_v<S, T> && rows.run(0, keys) == keys) {  // one run of rows as T: in place
        const auto all = Eigen::Map<const Matrix<T>>(rows.tile(0, keys, scratch.decoded).first, keys, width);
        TiledCausalSoftmax<T> kernel(PlainRows<T>(queries), PlainRows<T>(all), PlainRows<T>(all.leftCols(p.r)),
                                     p.scale, 0, 0, softmax, rule);
        kernel.run(latent, no_lse);
    } else {
        size_rows(scratch.decoded, softmax.tiles.keys, width);
        LatentTile<T, S> tile(rows, 0, scratch.decoded);
        using Source = LatentColumns<T, S>;
        TiledCausalSoftmax<T, DefaultBlocking, Source, Source> kernel(
            PlainRows<T>(queries), Source(tile, keys, width), Source(tile, keys, p.r), p.scale, 0, 0, softmax, rule);
        kernel.run(latent, no_lse);
    }
    p.project_out(h, scratch.latent, scratch);
}

/// The expanded prefill of head h: its keys [c W_UK_hᵀ | kr] and values c W_UV_hᵀ made a
/// chunk of stored rows at a time, the plain causal kernel on each chunk, the chunks'
/// outputs merged by their log-sum-exps in order, then the head's sink logit.
template <class T, class S>
void mla_prefill_expanded(const MlaPrompt<T>& p, Index h, const LatentRowsView<T, S>& rows,
                          MlaPrefillScratch<T>& scratch) {
    const Index width = p.r + p.dr, qk = p.nope + p.dr, keys = p.past + p.tokens, n = p.tokens;
    size_rows(scratch.queries, n, qk);
    for (Index t = 0; t < n; ++t) {
        scratch.queries.row(t).head(p.nope) = p.q_nope.row(t * p.heads + h);
        scratch.queries.row(t).tail(p.dr) = p.q_rope.row(t * p.heads + h);
    }
    scratch.uk_t = p.W_UK.middleRows(h * p.nope, p.nope).transpose();
    scratch.uv_t = p.W_UV.middleRows(h * p.dv, p.dv).transpose();
    [[maybe_unused]] bool tiles = false;
    if constexpr (latent_bf16_products<T, S>) {
        if (p.fpmath == FpMath::bf16) {
            // The expansion multiplies bfloat16 too: W_UK_hᵀ and W_UV_hᵀ rounded (the stored
            // latents are bfloat16 already), in AMX tiles where they run and r is even (a
            // row's pairs then end before its RoPE key), else as float products of the
            // rounded values: the same exact terms, summed in another order.
            scratch.uk_t = scratch.uk_t.template cast<Eigen::bfloat16>().template cast<T>();
            scratch.uv_t = scratch.uv_t.template cast<Eigen::bfloat16>().template cast<T>();
            tiles = p.r % 2 == 0 && AmxTileProducts<DefaultBlocking>::runs();
            if (tiles) {
                mla_weight_pairs(scratch.uk_t, scratch.uk_pairs);
                mla_weight_pairs(scratch.uv_t, scratch.uv_pairs);
            }
        }
    }
    const Index chunk = std::min(mla_key_chunk, keys);
    size_rows(scratch.keys, chunk, qk);
    size_rows(scratch.values, chunk, p.dv);
    size_rows(scratch.part, n, p.dv);
    size_rows(scratch.acc, n, p.dv);
    scratch.part_lse.resize(static_cast<std::size_t>(n));
    scratch.lse.assign(static_cast<std::size_t>(n), -std::numeric_limits<T>::infinity());
    scratch.acc.topRows(n).setZero();
    SoftmaxScratch<T>& softmax = scratch.kernel_scratch(qk, p.dv, SoftmaxTiles{});
    const LogitRule rule{.causal = true, .softcap = p.softcap};
    for (Index j0 = 0; j0 < keys; j0 += chunk) {
        const Index m = std::min(chunk, keys - j0);
        const T* stored = nullptr;  // in place, or decoded at stride width (the tiles read the rows as stored)
        if (!tiles) {
            if (!std::is_same_v<S, T> || rows.run(j0, m) < m)
                size_rows(scratch.decoded, chunk, width);
            stored = rows.tile(j0, m, scratch.decoded).first;
        }
        // The chunk's keys and values, a block of rows at a time: the block's latents stay
        // in L2 while the panels of W_UK_hᵀ and W_UV_hᵀ pass over them.
        bool expanded = false;
        if constexpr (latent_bf16_products<T, S>) {
            if (tiles) {  // the stored rows' latents as A pairs, in place or gathered per block
                LatentPairTile<S> pairs(rows, j0, m, mla_expand_rows, scratch.gathered);
                for (Index b0 = 0; b0 < m; b0 += mla_expand_rows) {
                    const Index b = std::min(mla_expand_rows, m - b0);
                    const auto [block, ld] = pairs.rows(b0);
                    const auto* a = reinterpret_cast<const std::uint16_t*>(block);
                    amx_product<AmxHardware>(b, p.nope, p.r / 2, a, ld, scratch.uk_pairs.data(), p.nope,
                                             scratch.keys.data() + b0 * qk, qk, false);
                    amx_product<AmxHardware>(b, p.dv, p.r / 2, a, ld, scratch.uv_pairs.data(), p.dv,
                                             scratch.values.data() + b0 * p.dv, p.dv, false);
                    for (Index j = 0; j < b; ++j)  // the RoPE keys, exactly
                        for (Index c = 0; c < p.dr; ++c)
                            scratch.keys(b0 + j, p.nope + c) = static_cast<T>(block[j * ld + p.r + c]);
                }
                expanded = true;
            }
        }
        for (Index b0 = 0; b0 < m && !expanded; b0 += mla_expand_rows) {
            const Index b = std::min(mla_expand_rows, m - b0);
            const T* block = stored + b0 * width;
            tile_product<T>(b, p.nope, p.r, block, width, 1, scratch.uk_t.data(), p.nope,
                            scratch.keys.data() + b0 * qk, qk, nullptr);
            tile_product<T>(b, p.dv, p.r, block, width, 1, scratch.uv_t.data(), p.dv,
                            scratch.values.data() + b0 * p.dv, p.dv, nullptr);
        }
        for (Index j = 0; j < m && !expanded; ++j)
            for (Index c = 0; c < p.dr; ++c)
                scratch.keys(j, p.nope + c) = stored[j * width + p.r + c];
        // The prompt's queries at positions past + t that reach the chunk: t ≥ j0 − past.
        const Index t0 = std::max<Index>(0, j0 - p.past);
        if (t0 >= n)
            break;
        T* part_lse = scratch.part_lse.data();
        const auto lse = [part_lse, t0](Index i, T value) { part_lse[t0 + i] = value; };
        const auto attend = [&](auto&& kernel) {
            kernel.set_query_offset(p.past + t0 - j0);
            kernel.run(MatrixRef<T>(scratch.part.middleRows(t0, n - t0)), lse);
        };
        bool rounded = false;
        if constexpr (latent_bf16_products<T, S>) {
            if (p.fpmath == FpMath::bf16) {  // the queries and the chunk's keys and values rounded
                using E = Eigen::bfloat16;
                if (j0 == 0) {
                    size_rows(scratch.rounded_queries, n, qk);
                    scratch.rounded_queries.topRows(n) = scratch.queries.topRows(n).template cast<E>();
                }
                size_rows(scratch.rounded_keys, chunk, qk);
                size_rows(scratch.rounded_values, chunk, p.dv);
                scratch.rounded_keys.topRows(m) = scratch.keys.topRows(m).template cast<E>();
                scratch.rounded_values.topRows(m) = scratch.values.topRows(m).template cast<E>();
                const SoftmaxTiles kernel_tiles = softmax.tiles;
                with_bf16_products([&]<bool Pairs>() {
                    using C = ConvertedRows<E, Pairs>;
                    attend(TiledCausalSoftmax<float, DefaultBlocking, C, C, C>(
                        C(scratch.rounded_queries.middleRows(t0, n - t0), kernel_tiles.queries, softmax.converted_q),
                        C(scratch.rounded_keys.topRows(m), kernel_tiles.keys, softmax.converted_k),
                        C(scratch.rounded_values.topRows(m), kernel_tiles.keys, softmax.converted_v), p.scale, 0, 0,
                        softmax, rule));
                });
                rounded = true;
            }
        }
        if (!rounded)
            attend(TiledCausalSoftmax<T>(PlainRows<T>(scratch.queries.middleRows(t0, n - t0)),
                                         PlainRows<T>(scratch.keys.topRows(m)),
                                         PlainRows<T>(scratch.values.topRows(m)), p.scale, 0, 0, softmax, rule));
        auto merged = scratch.acc.middleRows(t0, n - t0);
        merge_rows(merged, scratch.lse.data() + t0, scratch.part.middleRows(t0, n - t0),
                   scratch.part_lse.data() + t0);  // the chunk's part, in order
    }
    if (const T sink = p.sink(h); sink != -std::numeric_limits<T>::infinity()) {
        // σ joins each denominator as a block of zero values whose log-sum-exp is σ.
        scratch.part.topRows(n).setZero();
        std::fill_n(scratch.part_lse.begin(), n, sink);
        auto merged = scratch.acc.topRows(n);
        merge_rows(merged, scratch.lse.data(), scratch.part.topRows(n), scratch.part_lse.data());
    }
    for (Index t = 0; t < n; ++t)
        Eigen::Map<Matrix<T>>(p.out + (t * p.heads + h) * p.ldo, 1, p.dv) = scratch.acc.row(t);
}

}  // namespace detail

/// The prompt's n tokens appended to `cache` and attended by multi-head latent attention
/// (see the top of the file), H query heads a token: token t (position P + t, P the
/// cache's length before) sees the P cached tokens and the prompt's tokens 0..t, as
/// stored (compact storage: rounded). Rows are packed token after token: q_nope (n·H) ×
/// d_nope, q_rope (n·H) × d_r and out (n·H) × d_v hold head h of token t in row t·H + h
/// (the same bytes as n × (H·d) packed rows); latents n × r and ropes n × d_r are the
/// tokens' cache rows (RoPE keys turned), W_UK (H·d_nope) × r and W_UV (H·d_v) × r. The
/// heads run on the executor's threads, each the same way whoever runs it. `mode`
/// chooses the absorbed or the expanded form (automatic: mla_expands). Equal
/// to the unabsorbed formula within rounding. A cache of bfloat16 rows with
/// options().fpmath = FpMath::bf16 rounds the queries (absorbed: [q_nope W_UK | q_rope];
/// expanded: those, W_UK and W_UV for the expansion's products, and each chunk's keys and
/// values) to bfloat16 and runs the products in bfloat16 (AMX tiles where the CPU has
/// them). Throws std::invalid_argument, changing
/// nothing, on shapes that do not fit or values the cache's storage cannot hold; if the
/// attention itself throws (std::bad_alloc), the cache is taken back to its length.
template <class Cache, class T = typename std::remove_cvref_t<Cache>::Scalar>
    requires LatentCache<std::remove_cvref_t<Cache>>
void mla_prefill(Cache&& cache, std::type_identity_t<ConstMatrixRef<T>> q_nope,
                 std::type_identity_t<ConstMatrixRef<T>> q_rope, std::type_identity_t<ConstMatrixRef<T>> latents,
                 std::type_identity_t<ConstMatrixRef<T>> ropes, std::type_identity_t<ConstMatrixRef<T>> W_UK,
                 std::type_identity_t<ConstMatrixRef<T>> W_UV, std::type_identity_t<MatrixRef<T>> out,
                 ExecutorRef executor = {}, MlaPrefill mode = MlaPrefill::automatic) {
    constexpr const char* function = "mla_prefill";
    const Index n = latents.rows(), r = cache.latent_dim(), dr = cache.rope_dim();
    cache.validate(latents, ropes, function);
    detail::require(n > 0 ? q_nope.rows() % n == 0 && q_nope.rows() > 0 : q_nope.rows() == 0, function, "q_nope",
                    "has shape ", detail::shape(q_nope), ", expected n·H rows for the n = ", n,
                    " tokens of latents (head h of token t in row t·H + h)");
    const Index heads = n > 0 ? q_nope.rows() / n : 0, nope = q_nope.cols();
    detail::require(q_rope.rows() == q_nope.rows() && q_rope.cols() == dr, function, "q_rope", "has shape ",
                    detail::shape(q_rope), ", expected ", q_nope.rows(), 'x', dr, " (q_nope is ",
                    detail::shape(q_nope), ", the cache's rope_dim ", dr, ")");
    detail::require(W_UK.cols() == r && W_UK.rows() == detail::checked_product(function, "q_nope", heads, nope,
                                                                               "heads x d_nope"),
                    function, "W_UK", "has shape ", detail::shape(W_UK), ", expected ", heads * nope, 'x', r,
                    " (H · d_nope rows for H = ", heads, "; the cache's latent_dim columns)");
    detail::require(W_UV.cols() == r && (heads == 0 || W_UV.rows() % heads == 0), function, "W_UV", "has shape ",
                    detail::shape(W_UV), ", expected H · d_v rows for H = ", heads, " and the cache's latent_dim ", r,
                    " columns");
    const Index dv = heads > 0 ? W_UV.rows() / heads : 0;
    detail::require(out.rows() == q_nope.rows() && out.cols() == dv, function, "out", "has shape ",
                    detail::shape(out), ", expected ", q_nope.rows(), 'x', dv, " (n·H × d_v)");
    for (const auto& [name, in] : {std::pair<const char*, const ConstMatrixRef<T>*>{"q_nope", &q_nope},
                                   {"q_rope", &q_rope}, {"latents", &latents}, {"ropes", &ropes}, {"W_UK", &W_UK},
                                   {"W_UV", &W_UV}})
        detail::require_disjoint(function, "out", out, name, *in);
    const SoftmaxOptions options = cache.options();
    detail::require(options.sink_logits.size() <= 1 || static_cast<Index>(options.sink_logits.size()) == heads,
                    function, "q_nope", "holds ", heads, " heads a token, but the cache's options give ",
                    options.sink_logits.size(), " sink logits, one per head");
    if (n == 0)
        return;
    const Index past = cache.length();
    cache.extend(latents, ropes);  // may throw: nothing changed
    try {
        const detail::MlaPrompt<T> prompt{q_nope, q_rope, W_UK, W_UV, out.data(), out.outerStride(), heads, n, past,
                                          r, dr, nope, dv,
                                          cache.scale(), options.softcap, options.sink_logits, options.fpmath};
        const bool expand = mode == MlaPrefill::expanded ||
                            (mode == MlaPrefill::automatic && mla_expands(n, past, r, dr, nope, dv));
        std::vector<detail::MlaPrefillScratch<T>> scratch(
            static_cast<std::size_t>(std::min<int>(executor.concurrency(), detail::max_ranges)));
        const auto rows = cache.view();
        detail::parallel_ranges(
            heads, [](Index) { return 1.0; },
            [&](Index first, Index last, int range) {
                auto& mine = scratch[static_cast<std::size_t>(range)];
                for (Index h = first; h < last; ++h) {
                    if (expand)
                        detail::mla_prefill_expanded(prompt, h, rows, mine);
                    else
                        detail::mla_prefill_absorbed(prompt, h, rows, mine);
                }
            },
            0, executor);
    } catch (...) {
        cache.truncate(past);
        throw;
    }
}

}  // namespace memattn
