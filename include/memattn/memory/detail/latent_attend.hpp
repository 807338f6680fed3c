#pragma once
// The attend of multi-head latent attention's caches (memory/latent_kv_cache.hpp and
// the pool's, serving/paged_latent_kv_cache.hpp), over wherever their tokens are: H
// absorbed queries [q_lat | q_rope] against stored rows [c | k_rope], the values being
// the first r columns of the same rows.
//
// A job is one sequence's attend: its queries, its outputs and a view of its tokens (one
// run of stored rows, or the blocks of a pool's table). Each job is cut into pieces of
// at least latent_piece_tokens tokens (at most latent_max_pieces of them), by its length
// only; the pieces of every job of a call are the work items spread over the executor's
// threads (execution/parallel.hpp), each into a partial output and a log-sum-exp per
// head, and each job's pieces merge by log-sum-exp in piece order with its sink logits,
// so the outputs are bitwise the same for any executor and thread count, and a job's the
// same whatever other jobs share its call.

#include "memattn/execution/executor.hpp"
#include "memattn/execution/parallel.hpp"
#include "memattn/kernels/causal_softmax.hpp"
#include "memattn/storage/compact.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

namespace memattn::detail {

/// The fewest tokens in a piece of a split attend.
inline constexpr Index latent_piece_tokens = 1024;
/// The most pieces one attend is cut into: past latent_max_pieces · latent_piece_tokens
/// tokens the pieces grow instead (rounded up to whole key tiles of the kernel).
inline constexpr Index latent_max_pieces = 64;
/// The most heads one tile of the kernel takes as its query lanes; more heads go in
/// tiles of this many (each reading the keys again).
inline constexpr Index latent_head_tile = 128;

/// Below this many multiply-adds (tokens · H · (2r + d_r) over a call's jobs) an attend
/// stays on the calling thread.
inline constexpr double latent_parallel_work = 1 << 22;

/// Tokens per piece of an attend over `tokens` tokens.
[[nodiscard]] constexpr Index latent_piece_length(Index tokens) noexcept {
    return std::max(latent_piece_tokens, round_up((tokens + latent_max_pieces - 1) / latent_max_pieces, 128));
}
/// Pieces of an attend over `tokens` tokens: at most latent_max_pieces, never more for
/// fewer tokens, none for none.
[[nodiscard]] constexpr Index latent_piece_count(Index tokens) noexcept {
    const Index per = latent_piece_length(tokens);
    return (tokens + per - 1) / per;
}

/// Where a latent cache's tokens are: token j is row first + j of `rows`, or, in a pool
/// (table given), row table[j / block]·block + j % block.
template <class T, class S>
struct LatentRowsView {
    const StoredRows<T, S>* rows = nullptr;
    const Index* table = nullptr;  ///< a pool's blocks in token order; null: one run
    Index first = 0;               ///< one run's first row
    Index block = 1;               ///< a pool's tokens per block
    Index length = 0;              ///< tokens

    /// The stored row of token j.
    [[nodiscard]] Index row(Index j) const noexcept {
        return table == nullptr ? first + j : table[j / block] * block + j % block;
    }
    /// How many of the n tokens from j lie in consecutive rows (the rest of j's block).
    [[nodiscard]] Index run(Index j, Index n) const noexcept {
        return table == nullptr ? n : std::min(n, block - j % block);
    }
    /// f(row, count, token) for the runs of consecutive rows of tokens [j, j + n).
    template <class F>
    void for_each_run(Index j, Index n, F&& f) const {
        for (Index end = j + n; j < end;) {
            const Index m = run(j, end - j);
            f(row(j), m, j);
            j += m;
        }
    }
    /// Tokens [j, j + n) as T into `out` (row stride ld), decoded from S.
    void decode(Index j, Index n, T* out, Index ld) const {
        for_each_run(j, n, [&](Index r, Index m, Index token) { rows->decode_rows(r, m, out + (token - j) * ld, ld); });
    }
    /// Tokens [j, j + n) as T: in place when S is T and they are one run, else decoded
    /// into `buffer` (at least n rows of the rows' width). Returns the rows and their stride.
    [[nodiscard]] std::pair<const T*, Index> tile(Index j, Index n, Matrix<T>& buffer) const {
        if constexpr (std::is_same_v<S, T>) {
            if (run(j, n) == n)
                return {rows->block(row(j), n).data(), rows->cols()};
        }
        decode(j, n, buffer.data(), buffer.cols());
        return {buffer.data(), buffer.cols()};
    }
};

/// One tile of a view's tokens as T, shared by the kernel's key source (the whole row)
/// and value source (its first r columns): the tile the keys read is the tile the values
/// read, so each is decoded once. Tokens are counted from `first`.
template <class T, class S>
class LatentTile {
public:
    LatentTile(const LatentRowsView<T, S>& view, Index first, Matrix<T>& buffer)
        : view_(view), first_(first), buffer_(buffer) {}
    /// Rows [j0, j0 + n) as T, and the row stride.
    std::pair<const T*, Index> rows(Index j0, Index n) {
        if (j0 != j0_ || n != n_) {
            tile_ = view_.tile(first_ + j0, n, buffer_);
            j0_ = j0;
            n_ = n;
        }
        return tile_;
    }

private:
    const LatentRowsView<T, S>& view_;
    Index first_;
    Matrix<T>& buffer_;
    Index j0_ = -1, n_ = 0;
    std::pair<const T*, Index> tile_{nullptr, 0};
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

/// The bfloat16 rows of one tile of a view's tokens for the FpMath::bf16 attend, shared
/// by the key source (the whole row) and the value source (its first r columns): a tile
/// within one run of stored rows is read in place, one across a pool's blocks is gathered
/// into `gathered` (a tile's rows, sized on first use). Tokens are counted from `first`;
/// a tile is [j, j + tile_rows) cut at `length`, for any j the kernel starts one at.
template <class S>
class LatentPairTile {
public:
    LatentPairTile(const LatentRowsView<float, S>& view, Index first, Index length, Index tile_rows,
                   Matrix<S>& gathered)
        : view_(view), first_(first), length_(length), tile_rows_(tile_rows), gathered_(gathered) {}
    /// The rows of the tile from token j: j's stored row and the row stride, with the
    /// next min(tile_rows, length − j) rows at that stride (loaded unless j starts the
    /// current tile: the kernel's tiles need not start at multiples of tile_rows).
    std::pair<const S*, Index> rows(Index j) {
        if (j != j0_ || data_ == nullptr)
            load(j);
        return {data_, stride_};
    }

private:
    void load(Index j) {
        const Index cols = view_.rows->cols(), token = first_ + j;
        j0_ = j;
        n_ = std::min(tile_rows_, length_ - j);
        stride_ = cols;
        if (view_.run(token, n_) == n_) {
            data_ = view_.rows->stored_row(view_.row(token));
            return;
        }
        if (gathered_.rows() < tile_rows_ || gathered_.cols() != cols)
            gathered_.resize(tile_rows_, cols);
        view_.for_each_run(token, n_, [&](Index row, Index m, Index t) {
            std::memcpy(gathered_.data() + (t - token) * cols, view_.rows->stored_row(row),
                        sizeof(S) * static_cast<std::size_t>(m * cols));
        });
        data_ = gathered_.data();
    }

    const LatentRowsView<float, S>& view_;
    Index first_, length_, tile_rows_;
    Matrix<S>& gathered_;
    Index j0_ = 0, n_ = 0, stride_ = 0;
    const S* data_ = nullptr;
};

/// A row source of the tiled kernel over a LatentPairTile: `cols` columns of each row as
/// bfloat16 pairs in place where the kernel multiplies them (Pairs: with_bf16_products'
/// choice; bits()), and as float
/// (tile(): the float products elsewhere, and a value tile that is not all finite).
template <class S, bool Pairs = bf16_dot>
class LatentPairColumns {
public:
    static constexpr bool pairs = Pairs;
    LatentPairColumns(LatentPairTile<S>& tile, Index rows, Index cols, Index tile_rows, Matrix<float>& converted)
        : tile_(&tile), rows_(rows), cols_(cols), tile_rows_(tile_rows), converted_(&converted) {}
    [[nodiscard]] Index rows() const noexcept { return rows_; }
    [[nodiscard]] Index cols() const noexcept { return cols_; }
    [[nodiscard]] std::pair<const std::uint16_t*, Index> bits(Index j, Index = 1) {
        const auto [row, ld] = tile_->rows(j);
        return {reinterpret_cast<const std::uint16_t*>(row), ld};
    }
    /// Rows [j0, j0 + n) as float (n at most a tile's rows).
    [[nodiscard]] std::pair<const float*, Index> tile(Index j0, Index n) {
        MEMATTN_DASSERT(n <= tile_rows_);
        const auto [row, ld] = tile_->rows(j0);
        if (converted_->rows() < tile_rows_ || converted_->cols() != cols_)
            converted_->resize(tile_rows_, cols_);
        for (Index r = 0; r < n; ++r)
            decode_span(row + r * ld, cols_, 1.0f, converted_->data() + r * cols_);
        return {converted_->data(), cols_};
    }
    void prefetch(Index, Index) const {}

private:
    LatentPairTile<S>* tile_;
    Index rows_, cols_, tile_rows_;
    Matrix<float>* converted_;
};

/// One sequence's attend: rows [0, heads) of q (stride ldq) over the tokens of `view`
/// into rows of out (stride ldo).
template <class T, class S>
struct LatentJob {
    const T* q;
    Index ldq;
    T* out;
    Index ldo;
    Index heads;
    LatentRowsView<T, S> view;
    Index row0 = 0;  ///< its first partial row: piece p's head h at row0 + p · heads + h
};

/// What every job of a call shares: the widths, the scale, the logit options and the
/// arithmetic of the products.
template <class T>
struct LatentParams {
    Index latent_dim, rope_dim;
    T scale;
    double softcap;
    std::span<const double> sinks;  ///< none, one for every head, or one per head
    FpMath fpmath = FpMath::strict;  ///< bf16: latent_bf16_products (checked_latent_fpmath)
};

/// Whether a latent cache of T stored as S can take FpMath::bf16: float queries against
/// bfloat16 rows, multiplied as bfloat16 pairs (AMX tiles or vdpbf16ps where the CPU has
/// them) with the queries rounded to bfloat16 once per attend.
template <class T, class S>
inline constexpr bool latent_bf16_products = std::is_same_v<T, float> && std::is_same_v<S, Eigen::bfloat16>;

/// options.fpmath for a latent cache of T stored as S, checked for `function`.
template <class T, class S>
[[nodiscard]] FpMath checked_latent_fpmath(const char* function, const SoftmaxOptions& options) {
    require(options.fpmath == FpMath::strict || latent_bf16_products<T, S>, function, "options.fpmath",
            "is FpMath::bf16, which multiplies the stored rows as bfloat16 pairs with the queries rounded to "
            "bfloat16: it needs float queries and bfloat16 storage (T = float, S = Eigen::bfloat16)");
    return options.fpmath;
}

/// `options` with fpmath strict: what the memories' logit checks (HeldLogits) take once a
/// latent cache has taken the fpmath itself.
[[nodiscard]] inline SoftmaxOptions without_fpmath(SoftmaxOptions options) noexcept {
    options.fpmath = FpMath::strict;
    return options;
}

/// The scratch of latent attends: every piece's partial outputs and log-sum-exps, one
/// kernel scratch (and decoded tile) per thread, a call's jobs. A copy or a move gets
/// scratch of its own, empty, and a mutex of its own.
template <class T, class S>
struct LatentScratch {
    struct Worker {
        std::optional<SoftmaxScratch<T>> softmax;
        Matrix<T> decoded;
        Matrix<Eigen::bfloat16> rounded;   ///< FpMath::bf16: the queries rounded
        Matrix<Eigen::bfloat16> gathered;  ///< FpMath::bf16: a tile's rows across a pool's blocks
    };
    std::mutex mutex;
    Matrix<T> partial;  ///< the pieces' partial outputs (LatentJob::row0)
    std::vector<T> lse;
    std::vector<Worker> workers;
    std::vector<LatentJob<T, S>> jobs;

    LatentScratch() = default;
    LatentScratch(const LatentScratch&) {}
    LatentScratch(LatentScratch&&) noexcept {}
    LatentScratch& operator=(const LatentScratch&) { return *this; }
    LatentScratch& operator=(LatentScratch&&) noexcept { return *this; }
    ~LatentScratch() = default;

    /// Room for `rows` partial rows of width r and `workers` kernel scratches; kept when
    /// they fit. May throw std::bad_alloc (nothing computed yet).
    void size(Index rows, Index r, int workers_needed) {
        if (partial.rows() < rows || partial.cols() != r) {
            partial.resize(rows, r);
            lse.resize(static_cast<std::size_t>(rows));
        }
        if (static_cast<int>(workers.size()) < workers_needed)
            workers.resize(static_cast<std::size_t>(workers_needed));
    }
};

/// A thread's kernel scratch and tile buffers for attends of `heads` heads (made when
/// missing or of another shape, else kept); returns the kernel's tiles. Strict: the
/// decoded tile. FpMath::bf16 (float workers only): the rounded queries, a gathered tile,
/// the bfloat16 products' packed operands (or, without AVX512-BF16, the tiles converted
/// to float) and the values' float tile of the careful path, so that a reserved pool's
/// steps allocate nothing whichever tiles straddle its blocks.
template <class Worker>
SoftmaxTiles latent_worker(Worker& worker, Index heads, Index r, Index width, FpMath fpmath = FpMath::strict) {
    const SoftmaxTiles tiles{std::min(heads, latent_head_tile), 128};
    if (!worker.softmax || worker.softmax->tiles != tiles || worker.softmax->qt.rows() != width ||
        worker.softmax->acc.cols() != r)
        worker.softmax.emplace(width, r, tiles);
    const auto size = [](auto& m, Index rows, Index cols) {
        if (m.rows() < rows || m.cols() != cols)
            m.resize(rows, cols);
    };
    if (fpmath == FpMath::strict) {
        size(worker.decoded, tiles.keys, width);
        return tiles;
    }
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(*worker.softmax)>, SoftmaxScratch<float>>) {
        SoftmaxScratch<float>& scratch = *worker.softmax;
        size(worker.rounded, heads, width);
        size(worker.gathered, tiles.keys, width);
        size(scratch.converted_v, tiles.keys, r);
        if (avx512_bf16_runs()) {  // the kernel takes the pairs (with_bf16_products)
            [[maybe_unused]] const Bf16TileProducts<DefaultBlocking> sizing(scratch, width, r);  // sizes its operands
        } else {
            size(scratch.converted_q, tiles.queries, width);
            size(scratch.converted_k, tiles.keys, width);
        }
    }
    return tiles;
}

/// Piece [j0, j0 + n) of `job` for every head: its softmax-weighted latents into
/// `partial` (H × r), its log-sum-exps into lse[0, H).
template <class T, class S>
void latent_piece(const LatentJob<T, S>& job, const LatentParams<T>& params, Index j0, Index n, MatrixRef<T> partial,
                  T* lse, typename LatentScratch<T, S>::Worker& worker) {
    const Index width = params.latent_dim + params.rope_dim;
    latent_worker(worker, job.heads, params.latent_dim, width, params.fpmath);
    const LogitRule rule{.causal = false, .softcap = params.softcap};
    const auto sink = [lse](Index i, T value) { lse[i] = value; };
    using Map = Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>>;
    const Map queries(job.q, job.heads, width, Eigen::OuterStride<>(job.ldq));
    if constexpr (latent_bf16_products<T, S>) {
        if (params.fpmath == FpMath::bf16) {  // the queries rounded once, the rows as bfloat16 pairs
            using E = Eigen::bfloat16;
            const SoftmaxTiles tiles = worker.softmax->tiles;
            SoftmaxScratch<float>& scratch = *worker.softmax;
            worker.rounded.topRows(job.heads) = queries.template cast<E>();  // sized by latent_worker
            LatentPairTile<S> tile(job.view, j0, n, tiles.keys, worker.gathered);
            with_bf16_products([&]<bool Pairs>() {
                using Source = LatentPairColumns<S, Pairs>;
                using Queries = ConvertedRows<E, Pairs>;
                TiledCausalSoftmax<float, DefaultBlocking, Source, Source, Queries> kernel(
                    Queries(worker.rounded.topRows(job.heads), tiles.queries, scratch.converted_q),
                    Source(tile, n, width, tiles.keys, scratch.converted_k),
                    Source(tile, n, params.latent_dim, tiles.keys, scratch.converted_v), params.scale, 0, 0, scratch,
                    rule);
                kernel.run(partial, sink);
            });
            return;
        }
    }
    if constexpr (std::is_same_v<S, T>) {
        if (job.view.run(j0, n) == n) {  // one run: the rows in place
            const auto piece = job.view.rows->block(job.view.row(j0), n);
            TiledCausalSoftmax<T> kernel(PlainRows<T>(queries), PlainRows<T>(piece),
                                         PlainRows<T>(piece.leftCols(params.latent_dim)), params.scale, 0, 0,
                                         *worker.softmax, rule);
            kernel.run(partial, sink);
            return;
        }
    }
    LatentTile<T, S> tile(job.view, j0, worker.decoded);
    using Source = LatentColumns<T, S>;
    TiledCausalSoftmax<T, DefaultBlocking, Source, Source> kernel(PlainRows<T>(queries), Source(tile, n, width),
                                                                  Source(tile, n, params.latent_dim), params.scale, 0,
                                                                  0, *worker.softmax, rule);
    kernel.run(partial, sink);
}

/// out_h = Σ_p w_p · partial_p,h with w_p = e^{lse_p,h − m} / (Σ_p e^{lse_p,h − m} + e^{σ_h − m}),
/// m the largest of them, in piece order; σ_h the head's sink logit, if any. Zero for an
/// empty job.
template <class T, class S>
void latent_merge(const LatentJob<T, S>& job, const LatentParams<T>& params, const LatentScratch<T, S>& scratch) {
    constexpr T minus_inf = -std::numeric_limits<T>::infinity();
    const Index pieces = latent_piece_count(job.view.length), r = params.latent_dim;
    for (Index h = 0; h < job.heads; ++h) {
        Eigen::Map<Matrix<T>> row(job.out + h * job.ldo, 1, r);
        if (pieces == 0) {
            row.setZero();
            continue;
        }
        T sink = minus_inf;
        if (!params.sinks.empty())
            sink = static_cast<T>(params.sinks[params.sinks.size() == 1 ? 0 : static_cast<std::size_t>(h)]);
        const auto lse = [&](Index p) { return scratch.lse[static_cast<std::size_t>(job.row0 + p * job.heads + h)]; };
        T m = sink;
        bool nan = false;
        for (Index p = 0; p < pieces; ++p) {
            nan |= std::isnan(lse(p));
            m = std::max(m, lse(p));
        }
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
            total += std::exp(lse(p) - m);
        row.setZero();
        for (Index p = 0; p < pieces; ++p)
            row += (std::exp(lse(p) - m) / total) * scratch.partial.row(job.row0 + p * job.heads + h);
    }
}

/// Gives each job its first partial row (job after job) and returns the rows they need:
/// Σ pieces · heads.
template <class T, class S>
[[nodiscard]] Index latent_number_pieces(std::span<LatentJob<T, S>> jobs) noexcept {
    Index rows = 0;
    for (LatentJob<T, S>& job : jobs) {
        job.row0 = rows;
        rows += latent_piece_count(job.view.length) * job.heads;
    }
    return rows;
}

/// Walks the items of a call (piece p of job k, job after job) in increasing order,
/// from any item: what parallel_ranges' cost and ranges ask for, without a table.
template <class T, class S>
class LatentItems {
public:
    explicit LatentItems(std::span<const LatentJob<T, S>> jobs) : jobs_(jobs) {}
    /// Moves to item i (forward by steps when i is ahead, else from the start).
    void seek(Index i) {
        if (i < item_) {
            item_ = 0;
            k_ = 0;
            p_ = 0;
        }
        p_ += i - item_;
        item_ = i;
        while (k_ < jobs_.size() && p_ >= latent_piece_count(jobs_[k_].view.length)) {
            p_ -= latent_piece_count(jobs_[k_].view.length);
            ++k_;
        }
    }
    [[nodiscard]] const LatentJob<T, S>& job() const noexcept { return jobs_[k_]; }
    [[nodiscard]] Index piece() const noexcept { return p_; }
    /// The current piece's first token and tokens.
    [[nodiscard]] std::pair<Index, Index> tokens() const noexcept {
        const Index length = job().view.length, per = latent_piece_length(length);
        return {p_ * per, std::min(per, length - p_ * per)};
    }

private:
    std::span<const LatentJob<T, S>> jobs_;
    Index item_ = 0;
    std::size_t k_ = 0;
    Index p_ = 0;
};

/// Every job's attend (see the top of the file), in `scratch`. Jobs of differing head
/// counts may share a call. Below latent_parallel_work multiply-adds in all it stays on
/// the calling thread. May throw std::bad_alloc before any output is written; a job's
/// outputs are written by its merge only.
template <class T, class S>
void latent_attend(std::span<LatentJob<T, S>> jobs, const LatentParams<T>& params, LatentScratch<T, S>& scratch,
                   ExecutorRef executor) {
    const Index rows = latent_number_pieces(jobs);
    double work = 0;
    Index items = 0;
    for (const LatentJob<T, S>& job : jobs) {
        work += static_cast<double>(job.view.length) * static_cast<double>(job.heads);
        items += latent_piece_count(job.view.length);
    }
    work *= static_cast<double>(2 * params.latent_dim + params.rope_dim);
    const int threads = work < latent_parallel_work ? 1 : 0;
    const int workers = threads == 1 ? 1 : std::min<int>(executor.concurrency(), max_ranges);
    scratch.size(rows, params.latent_dim, workers);  // may throw: nothing written
    const std::span<const LatentJob<T, S>> all(jobs.data(), jobs.size());
    LatentItems<T, S> costs(all);
    parallel_ranges(
        items,
        [&](Index i) {
            costs.seek(i);
            return 64.0 + static_cast<double>(costs.tokens().second) * static_cast<double>(costs.job().heads);
        },
        [&](Index first, Index last, int worker) {
            LatentItems<T, S> walk(all);
            for (Index i = first; i < last; ++i) {
                walk.seek(i);
                const LatentJob<T, S>& job = walk.job();
                const auto [j0, n] = walk.tokens();
                const Index row = job.row0 + walk.piece() * job.heads;
                latent_piece(job, params, j0, n, MatrixRef<T>(scratch.partial.middleRows(row, job.heads)),
                             scratch.lse.data() + row, scratch.workers[static_cast<std::size_t>(worker)]);
            }
        },
        threads, executor);
    parallel_ranges(
        static_cast<Index>(jobs.size()), [&](Index k) { return 1.0 + static_cast<double>(jobs[static_cast<std::size_t>(k)].heads); },
        [&](Index first, Index last) {
            for (Index k = first; k < last; ++k)
                latent_merge(jobs[static_cast<std::size_t>(k)], params, scratch);
        },
        threads, executor);
}

}  // namespace memattn::detail
