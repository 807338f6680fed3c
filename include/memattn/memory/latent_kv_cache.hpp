#pragma once
// LatentKVCache: the cache of multi-head latent attention (MLA: DeepSeek-V2/V3/R1, Kimi
// K2). A token is one stored row [c | k_rope]: its compressed latent c (latent_dim r,
// DeepSeek-V3's kv_lora_rank 512) and its decoupled RoPE key k_rope (rope_dim d_r, 64,
// turned to the token's position by the caller), shared by every query head. Head h's
// key is [c W_UK_hᵀ | k_rope] and its value c W_UV_hᵀ; in decode the up-projections are
// absorbed into the query and the output (layer/latent_attention.hpp, mla_decode), so
// what the cache attends is an MQA of H absorbed queries over keys [c | k_rope] and
// values c, the first r columns of the same rows:
//
//   s_hj = scale · (q_lat_h · c_j + q_rope_h · kr_j),   o_lat_h = Σ_j softmax_j(s_hj) c_j
//
//   memattn::LatentKVCache<float> cache(512, 64, scale);
//   cache.update(c, k_rope);                    // one token: 1 × 512 and 1 × 64
//   cache.attend(queries, latent_out);          // H × 576 packed [q_lat | q_rope] -> H × 512
//
// Stored once, a token costs (r + d_r) values: 576 against 2 · 128 · 128 for DeepSeek's
// 128 heads as grouped attention; 1,152 bytes in bfloat16. In any storage type whose keys
// and values are plain rows (storage/compact.hpp: T, bfloat16, float16, Q8, Q4, Q4Affine,
// FP8): a quantised format's blocks run along the whole row, the latent's and the RoPE
// key's columns in turn.
//
// attend folds every head into the tiled softmax kernel's register-blocked products
// (kernels/softmax_tiles.hpp, non-causal: each head sees every cached token): the heads
// are the query lanes of one tile, so each key tile is read (and, stored compactly,
// decoded) once per step for all of them, and the same tile gives the values. The cache
// is cut into pieces (flash-decoding): at least `piece_tokens` tokens each, at most
// `max_pieces` of them, so the cut depends only on the length; the pieces run on the
// executor's threads (execution/parallel.hpp), each into a partial output and a
// log-sum-exp per head, merged in piece order, so the output is bitwise the same for any
// executor and thread count. A step whose work is below `parallel_work` stays on the
// calling thread. The scratch (the partial outputs, a kernel scratch per thread) is
// sized by the first attend at a length and kept; after reserve(n) and one attend with
// H heads, steps up to n tokens with at most H heads allocate nothing. A second attend
// running at the same time on another thread uses scratch of its own.
//
// The logit options that apply to MLA: the softcap, and a sink logit per head (or one
// for all). ALiBi, windows, sink tokens and trees are refused, as is causal = false
// (std::invalid_argument). A call that throws changes nothing. With bfloat16 rows and
// float queries, options.fpmath = FpMath::bf16 rounds the queries to bfloat16 and
// multiplies the rows as bfloat16 pairs (AMX tiles where the CPU has them; docs/design.md
// §4.4c); other T or S refuse it.

#include "memattn/execution/executor.hpp"
#include "memattn/execution/parallel.hpp"
#include "memattn/kernels/causal_softmax.hpp"
#include "memattn/kernels/softmax_options.hpp"
#include "memattn/memory/detail/held_logits.hpp"
#include "memattn/memory/detail/latent_attend.hpp"
#include "memattn/memory/detail/memory_checks.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/storage/compact.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace memattn {

/// The cache of multi-head latent attention; see the top of the file.
/// \tparam T float or double: the rows' scalar and the arithmetic's.
/// \tparam S how the rows are stored: T, or a compact type of plain rows (Eigen::bfloat16,
/// Eigen::half, memattn::Q8, Q4, Q4Affine, Fp8E4M3, Fp8E5M2, PerTokenScale<...>); not the
/// rotated, integer-dot or per-channel keys, whose keys are not read as the values are.
template <class T, class S = T>
    requires StorageFor<S, T> && detail::PlainKeys<S>
class LatentKVCache {
public:
    using Scalar = T;       ///< float or double
    using StorageType = S;  ///< how the rows are stored
    /// The storage type code snapshots record for S (docs/snapshot-format.md).
    static constexpr snapshot::TypeCode snapshot_storage = detail::storage_code<T, S>();
    /// The fewest tokens in a piece of a split attend (see the top of the file).
    static constexpr Index piece_tokens = detail::latent_piece_tokens;
    /// The most pieces an attend is cut into: past max_pieces · piece_tokens tokens the
    /// pieces grow instead (rounded up to whole key tiles of the kernel).
    static constexpr Index max_pieces = detail::latent_max_pieces;
    /// Below this many multiply-adds (length · H · (2r + d_r)) an attend stays on the
    /// calling thread.
    static constexpr double parallel_work = detail::latent_parallel_work;
    /// The most heads one tile of the kernel takes as its query lanes; more heads go in
    /// tiles of this many (each reading the keys again).
    static constexpr Index head_tile = detail::latent_head_tile;

    /// `scale` multiplies q·k before the softmax: DeepSeek's 1/sqrt(qk_nope + qk_rope)
    /// times YaRN's mscale² (mla_softmax_scale in layer/latent_attention.hpp). It is
    /// required: the absorbed rows' width r + d_r is not the heads' key width.
    LatentKVCache(Index latent_dim, Index rope_dim, T scale)
        : latent_dim_(detail::at_least(latent_dim, 1, "LatentKVCache", "latent_dim")),
          rope_dim_(detail::at_least(rope_dim, 0, "LatentKVCache", "rope_dim")),
          scale_(checked_scale(scale)),
          rows_(0, latent_dim_ + rope_dim_),
          joined_(join_rows, latent_dim_ + rope_dim_) {}

    /// With the logit options (kernels/softmax_options.hpp) that apply: the softcap, and
    /// sink logits, one for every head or one per head (then attend takes that many).
    /// `options.scale` is not read (the scale is the argument). ALiBi slopes, a window,
    /// sink tokens, a tree or causal = false throw std::invalid_argument; so does
    /// `options.fpmath = FpMath::bf16` unless T is float and S bfloat16 (then the attends
    /// round the queries to bfloat16 and multiply in bfloat16 pairs).
    LatentKVCache(Index latent_dim, Index rope_dim, T scale, const SoftmaxOptions& options)
        : LatentKVCache(latent_dim, rope_dim, scale) {
        detail::require(options.alibi_slopes.empty(), "LatentKVCache", "options.alibi_slopes",
                        "are given, but latent attention places its tokens by RoPE (the rope_dim columns)");
        fpmath_ = detail::checked_latent_fpmath<T, S>("LatentKVCache", options);
        logits_ = detail::HeldLogits("LatentKVCache", detail::without_fpmath(options), std::type_identity<T>{});
    }

    /// Appends one token: its latent (1 × latent_dim) and its RoPE key (1 × rope_dim),
    /// turned to its position. Storage grows geometrically; a throwing update leaves the
    /// cache unchanged. The rows may be views of the cache's own.
    void update(ConstRowRef<T> latent, ConstRowRef<T> rope) {
        validate(latent, rope, "LatentKVCache::update");
        joined_.row(0).head(latent_dim_) = latent;
        joined_.row(0).tail(rope_dim_) = rope;
        append(1, [&](Rows& into, Index at) { into.put_rows(at, joined_.topRows(1)); });
    }

    /// Appends n tokens: latents n × latent_dim, ropes n × rope_dim.
    void extend(ConstMatrixRef<T> latents, ConstMatrixRef<T> ropes) {
        validate(latents, ropes, "LatentKVCache::extend");
        append(latents.rows(), [&](Rows& into, Index at) {
            for (Index i = 0; i < latents.rows(); i += join_rows) {
                const Index m = std::min(join_rows, latents.rows() - i);
                joined_.topLeftCorner(m, latent_dim_) = latents.middleRows(i, m);
                joined_.topRightCorner(m, rope_dim_) = ropes.middleRows(i, m);
                into.put_rows(at + i, joined_.topRows(m));
            }
        });
    }

    /// Throws what extend would throw for these rows, changing nothing: std::invalid_argument
    /// for a shape or a finite value S would not hold (detail::check_storable),
    /// std::length_error past memattn::max_length.
    void validate(ConstMatrixRef<T> latents, ConstMatrixRef<T> ropes,
                  const char* function = "LatentKVCache::validate") const {
        detail::check_site_pairs({function, "latents", "ropes"}, detail::shape(latents), detail::shape(ropes),
                                 latent_dim_, rope_dim_, length_);
        detail::check_storable<T, S>({function, "latents", "ropes"}, latents, false);
        detail::check_storable<T, S>({function, "latents", "ropes"}, ropes, true);
    }

    /// Row h of `out` (H × latent_dim) = o_lat_h = Σ_j softmax_j(scale · q_h·[c_j | kr_j]) c_j
    /// over every cached token, for the H absorbed queries packed [q_lat | q_rope] in the
    /// rows of `queries` (H × (latent_dim + rope_dim)); zero when the cache is empty. On
    /// the executor's threads (see the top of the file); `out` must not overlap `queries`.
    void attend(ConstMatrixRef<T> queries, MatrixRef<T> out, ExecutorRef executor = {}) const {
        constexpr const char* function = "LatentKVCache::attend";
        detail::check_group_query(function, queries, out, width(), latent_dim_);
        if (logits_.queries() > 1)  // one sink logit per head (one for all: any count)
            logits_.check_rows(function, "queries", queries.rows());
        const Index heads = queries.rows();
        if (heads == 0)
            return;
        if (length_ == 0) {
            out.setZero();
            return;
        }
        detail::LatentJob<T, S> job{queries.data(), queries.outerStride(), out.data(), out.outerStride(), heads,
                                    view()};
        const std::span<detail::LatentJob<T, S>> jobs(&job, 1);
        const detail::LatentParams<T> params{latent_dim_, rope_dim_, scale_, logits_.into({}).softcap,
                                             logits_.into({}).sink_logits, fpmath_};
        std::unique_lock<std::mutex> lock(scratch_.mutex, std::try_to_lock);
        if (lock.owns_lock()) {
            reserve_scratch(heads, executor);  // the pieces of the allocated rows: later steps fit
            detail::latent_attend(jobs, params, scratch_, executor);
        } else {
            detail::LatentScratch<T, S> own;
            detail::latent_attend(jobs, params, own, executor);
        }
    }

    /// Tokens held.
    [[nodiscard]] Index length() const noexcept { return length_; }
    /// Tokens it can hold before it allocates again.
    [[nodiscard]] Index token_capacity() const noexcept { return rows_.rows(); }
    /// Bytes of the rows held now, as stored (S).
    [[nodiscard]] std::size_t footprint() const noexcept { return detail::stored_bytes<Rows>(length_, width()); }
    /// Bytes allocated for rows (held and room to grow).
    [[nodiscard]] std::size_t capacity() const noexcept { return detail::stored_bytes<Rows>(rows_.rows(), width()); }
    /// Bytes one token takes as stored (S), for a cache of these dimensions.
    [[nodiscard]] static std::size_t token_bytes(Index latent_dim, Index rope_dim) {
        return detail::stored_bytes<Rows>(1, latent_dim + rope_dim);
    }
    /// Allocates room for `tokens` tokens in all, so updates up to that length do not allocate.
    void reserve(Index tokens) {
        if (tokens > rows_.rows())
            regrow(tokens);
    }
    /// Forgets every token and keeps the allocation.
    void reset() noexcept { length_ = 0; }
    /// Keeps the first `tokens` tokens (0 ≤ tokens ≤ length()), e.g. to undo a speculative
    /// step; keeps the allocation.
    void truncate(Index tokens) {
        detail::require(tokens >= 0 && tokens <= length_, "LatentKVCache::truncate", "tokens", "is ", tokens,
                        ", expected 0 .. length() = ", length_);
        length_ = tokens;
    }

    /// r, the latent's width (and the outputs').
    [[nodiscard]] Index latent_dim() const noexcept { return latent_dim_; }
    /// d_r, the RoPE key's width.
    [[nodiscard]] Index rope_dim() const noexcept { return rope_dim_; }
    /// r + d_r: a query row's width, and a stored row's.
    [[nodiscard]] Index query_dim() const noexcept { return width(); }
    /// The factor of q·k before the softmax.
    [[nodiscard]] T scale() const noexcept { return scale_; }
    /// The options its attends follow: the scale, the softcap, the fpmath and the sink logits (the
    /// span views the cache's own copy, valid while it lives and is not assigned to).
    [[nodiscard]] SoftmaxOptions options() const noexcept {
        return logits_.into({.scale = static_cast<double>(scale_), .fpmath = fpmath_});
    }

    /// Where its tokens are (the stored rows in storage S, one run): how mla_prefill reads
    /// the cache.
    [[nodiscard]] detail::LatentRowsView<T, S> view() const noexcept {
        return {.rows = &rows_, .table = nullptr, .first = 0, .block = 1, .length = length_};
    }

    /// The stored rows [c | k_rope], oldest first, length() × (r + d_r) (stored as T).
    [[nodiscard]] auto rows() const
        requires std::same_as<S, T>
    {
        return rows_.block(0, length_);
    }

    /// Snapshots (persistence/snapshot.hpp), their own kind: latent_dim, rope_dim, scale,
    /// length, then the rows as stored (S), oldest first. The logit options are not
    /// recorded: they change no stored row.
    [[nodiscard]] static std::string snapshot_kind() { return "LatentKVCache"; }
    /// Snapshots: writes the payload, the fields listed at snapshot_kind().
    void write_snapshot(snapshot::Writer& w) const {
        w.index(latent_dim_);
        w.index(rope_dim_);
        w.number(scale_);
        w.index(length_);
        rows_.write_rows(w, 0, length_);
    }
    /// Snapshots: reads a payload written by write_snapshot(); throws SnapshotError, the
    /// cache unchanged, unless latent_dim, rope_dim and scale are its own.
    void read_snapshot(snapshot::Reader& r) {
        r.expect("latent_dim", latent_dim_);
        r.expect("rope_dim", rope_dim_);
        r.expect("scale", scale_);
        const Index length =
            r.count("length", 0, static_cast<Index>(r.remaining() / detail::least_row_bytes<Rows>(width())));
        r.expect_remaining(detail::stored_bytes<Rows>(length, width()), "the rows");
        if (length > rows_.rows()) {
            Rows loaded(length, width());  // may throw: nothing changed
            loaded.read_rows(r, 0, length);
            rows_.swap(loaded);
        } else {
            rows_.read_rows(r, 0, length);
        }
        length_ = length;
    }

private:
    using Rows = detail::StoredRows<T, S>;
    /// Rows extend joins at a time ([c | k_rope] into joined_).
    static constexpr Index join_rows = 16;

    static T checked_scale(T scale) {
        detail::require(std::isfinite(scale) && scale != T(0), "LatentKVCache", "scale", "is ", scale,
                        ", expected a finite nonzero factor of q·k (DeepSeek: mscale² / sqrt(qk_nope_head_dim + "
                        "qk_rope_head_dim), see mla_softmax_scale)");
        return scale;
    }

    [[nodiscard]] Index width() const noexcept { return latent_dim_ + rope_dim_; }

    /// Appends n rows through put(rows, at): into new storage with room to grow, when
    /// needed (the inputs may view the current storage, freed after they are read).
    template <class Put>
    void append(Index n, Put&& put) {
        if (length_ + n > rows_.rows()) {
            const Index needed = length_ + n;
            Rows grown(std::max<Index>({2 * rows_.rows(), needed + needed / 2, 16}), width());  // may throw
            grown.advise_huge_pages();  // read end to end by every attend (detail/huge_pages.hpp)
            grown.copy_rows_from(rows_, length_);
            put(grown, length_);
            rows_.swap(grown);
        } else {
            put(rows_, length_);  // rows past length(): no input can view them
        }
        length_ += n;
    }

    void regrow(Index tokens) {
        Rows grown(tokens, width());  // may throw: nothing changed
        grown.advise_huge_pages();
        grown.copy_rows_from(rows_, length_);
        rows_.swap(grown);
    }

    /// Scratch for the pieces of as many tokens as the allocated rows hold, `heads` heads,
    /// and the executor's threads, so the steps up to them allocate nothing.
    void reserve_scratch(Index heads, ExecutorRef executor) const {
        const Index pieces = detail::latent_piece_count(std::max(length_, rows_.rows()));
        scratch_.size(pieces * heads, latent_dim_, std::min<int>(executor.concurrency(), detail::max_ranges));
    }

    Index latent_dim_;
    Index rope_dim_;
    T scale_;
    detail::HeldLogits logits_;
    FpMath fpmath_ = FpMath::strict;
    Rows rows_;
    Matrix<T> joined_;  ///< rows [c | k_rope] joined before they are stored
    Index length_ = 0;
    mutable detail::LatentScratch<T, S> scratch_;
};

}  // namespace memattn
