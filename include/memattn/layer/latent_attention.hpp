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

#include "memattn/execution/executor.hpp"
#include "memattn/execution/parallel.hpp"
#include "memattn/memory/latent_kv_cache.hpp"
#include "memattn/types.hpp"

#include <cmath>
#include <type_traits>

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
template <class T, class S>
void mla_decode(const LatentKVCache<T, S>& cache, std::type_identity_t<ConstMatrixRef<T>> q_nope,
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
    const int threads = work < LatentKVCache<T, S>::parallel_work ? 1 : 0;
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

}  // namespace memattn
