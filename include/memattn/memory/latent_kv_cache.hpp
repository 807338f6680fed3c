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
// (std::invalid_argument). A call that throws changes nothing.

#include "memattn/execution/executor.hpp"
#include "memattn/execution/parallel.hpp"
#include "memattn/kernels/causal_softmax.hpp"
#include "memattn/kernels/softmax_options.hpp"
#include "memattn/memory/detail/held_logits.hpp"
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

namespace detail {

/// One tile of a latent cache's stored rows decoded to T, shared by the kernel's key
/// source (the whole row) and value source (its first r columns): the tile the keys
/// decoded is the tile the values read, so each is decoded once.
template <class T, class S>
class LatentTile {
public:
    LatentTile(const StoredRows<T, S>& stored, Index first, Matrix<T>& buffer)
        : stored_(stored), first_(first), buffer_(buffer) {}
    /// Rows [j0, j0 + n) of the piece as T, and the row stride.
    std::pair<const T*, Index> rows(Index j0, Index n) {
        if (j0 != j0_ || n != n_) {
            stored_.decode_rows(first_ + j0, n, buffer_.data(), buffer_.cols());
            j0_ = j0;
            n_ = n;
        }
        return {buffer_.data(), buffer_.cols()};
    }

private:
    const StoredRows<T, S>& stored_;
    Index first_;
    Matrix<T>& buffer_;
    Index j0_ = -1, n_ = 0;
};

/// A row source of the tiled kernel (kernels/softmax_rows.hpp) over a LatentTile: `cols`
/// columns of each row, the whole row for the keys, the latent for the values.
template <class T, class S>
class LatentColumns {
public:
    LatentColumns(LatentTile<T, S>& tile, Index rows, Index cols) : tile_(&tile), rows_(rows), cols_(cols) {}
    static constexpr bool pairs = false;
    [[nodiscard]] Index rows() const noexcept { return rows_; }
    [[nodiscard]] Index cols() const noexcept { return cols_; }
    [[nodiscard]] std::pair<const T*, Index> tile(Index j0, Index n) { return tile_->rows(j0, n); }
    void prefetch(Index, Index) const {}

private:
    LatentTile<T, S>* tile_;
    Index rows_, cols_;
};

/// The scratch of a latent cache's attend: the pieces' partial outputs and log-sum-exps,
/// and one kernel scratch (and decoded tile) per thread. A copy or a move gets scratch of
/// its own, empty, and a mutex of its own.
template <class T>
struct LatentScratch {
    struct Worker {
        std::optional<SoftmaxScratch<T>> softmax;
        Matrix<T> decoded;
    };
    std::mutex mutex;
    Matrix<T> partial;  ///< pieces · H rows of r: piece p's head h at row p · H + h
    std::vector<T> lse;
    std::vector<Worker> workers;

    LatentScratch() = default;
    LatentScratch(const LatentScratch&) {}
    LatentScratch(LatentScratch&&) noexcept {}
    LatentScratch& operator=(const LatentScratch&) { return *this; }
    LatentScratch& operator=(LatentScratch&&) noexcept { return *this; }
    ~LatentScratch() = default;
};

}  // namespace detail

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
    static constexpr Index piece_tokens = 1024;
    /// The most pieces an attend is cut into: past max_pieces · piece_tokens tokens the
    /// pieces grow instead (rounded up to whole key tiles of the kernel).
    static constexpr Index max_pieces = 64;
    /// Below this many multiply-adds (length · H · (2r + d_r)) an attend stays on the
    /// calling thread.
    static constexpr double parallel_work = 1 << 22;
    /// The most heads one tile of the kernel takes as its query lanes; more heads go in
    /// tiles of this many (each reading the keys again).
    static constexpr Index head_tile = 128;

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
    /// sink tokens, a tree or causal = false throw std::invalid_argument.
    LatentKVCache(Index latent_dim, Index rope_dim, T scale, const SoftmaxOptions& options)
        : LatentKVCache(latent_dim, rope_dim, scale) {
        detail::require(options.alibi_slopes.empty(), "LatentKVCache", "options.alibi_slopes",
                        "are given, but latent attention places its tokens by RoPE (the rope_dim columns)");
        logits_ = detail::HeldLogits("LatentKVCache", options, std::type_identity<T>{});
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
        std::unique_lock<std::mutex> lock(scratch_.mutex, std::try_to_lock);
        if (lock.owns_lock()) {
            attend_pieces(queries, out, executor, scratch_);
        } else {
            detail::LatentScratch<T> own;
            attend_pieces(queries, out, executor, own);
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
    /// The options its attends follow: the scale, the softcap and the sink logits (the
    /// span views the cache's own copy, valid while it lives and is not assigned to).
    [[nodiscard]] SoftmaxOptions options() const noexcept {
        return logits_.into({.scale = static_cast<double>(scale_)});
    }

    /// Calls f(rows, first, n) with the stored rows (detail::StoredRows, in storage S) and
    /// the run [first, first + n) of them attend reads: how mla_prefill reads the cache.
    template <class F>
    void for_each_stored_run(F&& f) const {
        if (length_ > 0)
            f(rows_, Index{0}, length_);
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
        grown.copy_rows_from(rows_, length_);
        rows_.swap(grown);
    }

    /// Tokens per piece of an attend over `tokens` tokens (see the top of the file).
    [[nodiscard]] static Index piece_length(Index tokens) noexcept {
        return std::max(piece_tokens, detail::round_up((tokens + max_pieces - 1) / max_pieces, 128));
    }
    /// Pieces of an attend over `tokens` tokens: at most max_pieces, and never more for
    /// fewer tokens.
    [[nodiscard]] static Index piece_count(Index tokens) noexcept {
        const Index per = piece_length(tokens);
        return (tokens + per - 1) / per;
    }

    /// The attend after its checks, in `scratch`: each piece into its partial rows, then
    /// the merge.
    void attend_pieces(const ConstMatrixRef<T>& queries, MatrixRef<T>& out, ExecutorRef executor,
                       detail::LatentScratch<T>& scratch) const {
        const Index heads = queries.rows(), per = piece_length(length_), pieces = piece_count(length_);
        const double work = static_cast<double>(length_) * static_cast<double>(heads) *
                            static_cast<double>(2 * latent_dim_ + rope_dim_);
        const int threads = work < parallel_work ? 1 : 0;
        const int workers = threads == 1 ? 1 : std::min<int>(executor.concurrency(), detail::max_ranges);
        size_scratch(scratch, heads, workers);  // may throw std::bad_alloc: nothing changed
        detail::parallel_ranges(
            pieces, [](Index) { return 1.0; },
            [&](Index first, Index last, int worker) {
                for (Index p = first; p < last; ++p) {
                    const Index j0 = p * per, n = std::min(per, length_ - j0);
                    attend_piece(queries, j0, n, scratch.partial.middleRows(p * heads, heads),
                                 scratch.lse.data() + p * heads, scratch.workers[static_cast<std::size_t>(worker)]);
                }
            },
            threads, executor);
        merge(pieces, heads, scratch, out);
    }

    /// Room for the partial rows of `heads` heads over as many pieces as the allocated
    /// rows can make (so the steps up to it do not allocate), and `workers` kernel
    /// scratches; kept when they fit.
    void size_scratch(detail::LatentScratch<T>& scratch, Index heads, int workers) const {
        const Index rows = piece_count(std::max(length_, rows_.rows())) * heads;
        if (scratch.partial.rows() < rows || scratch.partial.cols() != latent_dim_) {
            scratch.partial.resize(rows, latent_dim_);
            scratch.lse.resize(static_cast<std::size_t>(rows));
        }
        if (static_cast<int>(scratch.workers.size()) < workers)
            scratch.workers.resize(static_cast<std::size_t>(workers));
    }

    /// Piece [j0, j0 + n) for every head: its softmax-weighted latents into `partial`
    /// (H × r), its log-sum-exps into lse[0, H).
    template <class Partial>
    void attend_piece(const ConstMatrixRef<T>& queries, Index j0, Index n, Partial&& partial, T* lse,
                      typename detail::LatentScratch<T>::Worker& worker) const {
        const Index heads = queries.rows();
        const detail::SoftmaxTiles tiles{std::min(heads, head_tile), 128};
        if (!worker.softmax || worker.softmax->tiles != tiles)
            worker.softmax.emplace(width(), latent_dim_, tiles);
        const detail::LogitRule rule{.causal = false, .softcap = options().softcap};
        const auto sink = [lse](Index i, T value) { lse[i] = value; };
        MatrixRef<T> o(partial);
        if constexpr (std::is_same_v<S, T>) {
            const auto piece = rows_.block(j0, n);
            detail::TiledCausalSoftmax<T> kernel(detail::PlainRows<T>(queries), detail::PlainRows<T>(piece),
                                                 detail::PlainRows<T>(piece.leftCols(latent_dim_)), scale_, 0, 0,
                                                 *worker.softmax, rule);
            kernel.run(o, sink);
        } else {
            if (worker.decoded.rows() < tiles.keys || worker.decoded.cols() != width())
                worker.decoded.resize(tiles.keys, width());
            detail::LatentTile<T, S> tile(rows_, j0, worker.decoded);
            using Source = detail::LatentColumns<T, S>;
            detail::TiledCausalSoftmax<T, detail::DefaultBlocking, Source, Source> kernel(
                detail::PlainRows<T>(queries), Source(tile, n, width()), Source(tile, n, latent_dim_), scale_, 0, 0,
                *worker.softmax, rule);
            kernel.run(o, sink);
        }
    }

    /// out_h = Σ_p w_p · partial_p,h with w_p = e^{lse_p,h − m} / (Σ_p e^{lse_p,h − m} + e^{σ_h − m}),
    /// m the largest of them, in piece order; σ_h the head's sink logit, if any.
    void merge(Index pieces, Index heads, const detail::LatentScratch<T>& scratch, MatrixRef<T>& out) const {
        const SoftmaxOptions options = this->options();
        constexpr T minus_inf = -std::numeric_limits<T>::infinity();
        for (Index h = 0; h < heads; ++h) {
            T sink = minus_inf;
            if (!options.sink_logits.empty())
                sink = static_cast<T>(options.sink_logits[options.sink_logits.size() == 1 ? 0 : static_cast<std::size_t>(h)]);
            T m = sink;
            bool nan = false;
            for (Index p = 0; p < pieces; ++p) {
                const T l = scratch.lse[static_cast<std::size_t>(p * heads + h)];
                nan |= std::isnan(l);
                m = std::max(m, l);
            }
            auto row = out.row(h);
            if (nan) {
                row.setConstant(std::numeric_limits<T>::quiet_NaN());
                continue;
            }
            if (m == minus_inf) {  // no key seen (every logit −∞): nothing to weigh
                row.setZero();
                continue;
            }
            T total = sink == minus_inf ? T(0) : std::exp(sink - m);
            for (Index p = 0; p < pieces; ++p)
                total += std::exp(scratch.lse[static_cast<std::size_t>(p * heads + h)] - m);
            row.setZero();
            for (Index p = 0; p < pieces; ++p) {
                const T w = std::exp(scratch.lse[static_cast<std::size_t>(p * heads + h)] - m) / total;
                row += w * scratch.partial.row(p * heads + h);
            }
        }
    }

    Index latent_dim_;
    Index rope_dim_;
    T scale_;
    detail::HeldLogits logits_;
    Rows rows_;
    Matrix<T> joined_;  ///< rows [c | k_rope] joined before they are stored
    Index length_ = 0;
    mutable detail::LatentScratch<T> scratch_;
};

}  // namespace memattn
