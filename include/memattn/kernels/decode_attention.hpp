#pragma once
// Decode attention: one query, or a group of queries (the query heads of one KV head),
// against runs of stored (key, value) pairs, in any storage type (storage/compact.hpp).
// Every cache's attend and attend_group and MultiHead's split attend call this header:
//
//   attend_contiguous   one query, pairs stored as T: Eigen's GEMVs while the run fits
//                       in cache, in address order with software prefetch once it does not
//   attend_stored       one query, pairs stored compactly: each row converted in
//                       registers inside its dot product and its value update
//   GroupAttention      g <= 16 queries: each stored row is read (and converted) once for
//                       the whole group; logits and weighted values as register-blocked
//                       tile products; fold() for runs of T, fold_stored() for any storage
//   attend_group_runs   g queries over a memory's for_each_stored_run(f)
//
// A run is given as (keys, values, first, n): the rows [first, first + n) of two
// detail::StoredRows. A split attend folds parts of the runs into partial softmax states
// (softmax_state.hpp) and merges them in a fixed order, so its bits do not depend on
// how the parts were spread over threads.
//
// Measured (bench/decode_bench.cpp, AMD EPYC family 25 model 17, AVX-512; a contended
// run, and one thread again on a quiet machine with the same figures; docs/performance.md,
// "Decode at the roofline"): a 32/8 × 128 layer's step at
// 32768 tokens runs at 0.60 of its roofline (a streaming read of the bytes it reads)
// with float storage and 0.23–0.25 with bfloat16, float16 and Q8; the update costs
// nothing measurable beside the attend. What is left between the fraction and 1:
// - groups smaller than a packet's lanes (g = 4 or 8 under AVX-512's 16) take the dot
//   route, one horizontal reduction per (query, key) pair: the logits take 35% of the
//   time for float, and the route is bound by instructions per pair, not by bytes;
// - compact rows are converted through a buffer in L1 before those products (47–55% of
//   the time with the dot products), not in registers inside them;
// - software prefetch (key and value rows 4 KiB ahead in the dot route, as the
//   single-query path does) gained nothing, measured interleaved on a quiet machine
//   (float 21.5–21.8 against 20.2–21.6 ms): the route waits on instructions, not memory.

#include "memattn/detail/assert.hpp"
#include "memattn/detail/packet.hpp"
#include "memattn/detail/tile_product.hpp"
#include "memattn/softmax_state.hpp"
#include "memattn/storage/compact.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <type_traits>
#include <vector>

namespace memattn::detail {

/// Keys per block of the single-query attend while its run of K and V stays in cache:
/// their logits live on the stack (256 floats = 1 KiB).
inline constexpr Index attend_block = 256;

/// Bytes of K and V from which a single-query attend takes the streaming path. Below,
/// Eigen's GEMVs (8 key rows side by side) are faster; above, the run comes from DRAM,
/// and reading it in address order is what keeps the prefetchers ahead. Measured with
/// bench/memory_bench.cpp (BM_KVCacheAttend against BM_StreamingRead, AMD EPYC Zen 3,
/// AVX2, float, d = dv): at 4 MiB the GEMV blocks read 39–49 GB/s against 35–38 for the
/// streaming path; at 32 and 64 MiB (65536 pairs, d = 64 and 128) the streaming path,
/// with its prefetch, reads 0.75–0.87 of a plain read of the same bytes (0.84–0.96 when
/// the two run alone, interleaved), the GEMV blocks 0.58–0.75.
inline constexpr std::size_t streaming_bytes = std::size_t(16) << 20;

/// Rows of `cols` scalars the streaming path asks for ahead of the row it reads: 4 KiB
/// ahead (measured at 65536 pairs, of a plain read: 4 KiB 0.84–0.96, 2 KiB 0.78–0.85,
/// 8 KiB 0.78–0.91, 16 KiB 0.76–0.87, none 0.63–0.8).
template <class T>
constexpr Index rows_ahead(Index cols) {
    return std::max<Index>(1, Index(4096) / (std::max<Index>(cols, 1) * Index(sizeof(T))));
}

/// q·k over d scalars, read in address order: four packet accumulators, then the tail.
template <class T>
inline T dot_in_order(const T* q, const T* k, Index d) {
    using namespace Eigen::internal;
    using P = Packet<T>;
    constexpr Index lanes = packet_lanes<T>;
    P a0 = pset1<P>(T(0)), a1 = a0, a2 = a0, a3 = a0;
    Index c = 0;
    for (; c + 4 * lanes <= d; c += 4 * lanes) {
        a0 = pmadd(ploadu<P>(q + c), ploadu<P>(k + c), a0);
        a1 = pmadd(ploadu<P>(q + c + lanes), ploadu<P>(k + c + lanes), a1);
        a2 = pmadd(ploadu<P>(q + c + 2 * lanes), ploadu<P>(k + c + 2 * lanes), a2);
        a3 = pmadd(ploadu<P>(q + c + 3 * lanes), ploadu<P>(k + c + 3 * lanes), a3);
    }
    for (; c + lanes <= d; c += lanes)
        a0 = pmadd(ploadu<P>(q + c), ploadu<P>(k + c), a0);
    T dot = predux(padd(padd(a0, a1), padd(a2, a3)));
    for (; c < d; ++c)
        dot += q[c] * k[c];
    return dot;
}

/// acc (dv) = α·acc + Σ_j p_j v_j over n rows v_j = v + j·v_stride, one row after the
/// other in address order (acc stays in L1), rows_ahead rows asked for ahead.
template <class T>
inline void add_values_in_order(const T* p, const T* v, Index v_stride, Index n, Index dv, T alpha, T* acc) {
    using namespace Eigen::internal;
    using P = Packet<T>;
    constexpr Index lanes = packet_lanes<T>;
    const Index packed = dv / lanes * lanes;
    for (Index c = 0; c < packed; c += lanes)
        pstoreu(acc + c, pmul(pset1<P>(alpha), ploadu<P>(acc + c)));
    for (Index c = packed; c < dv; ++c)
        acc[c] *= alpha;
    const Index ahead = rows_ahead<T>(dv);
    for (Index j = 0; j < n; ++j) {
        if (j + ahead < n)
            prefetch_rows(v + (j + ahead) * v_stride, 1, 0, dv);
        const P weight = pset1<P>(p[j]);
        const T* row = v + j * v_stride;
        for (Index c = 0; c < packed; c += lanes)
            pstoreu(acc + c, pmadd(weight, ploadu<P>(row + c), ploadu<P>(acc + c)));
        for (Index c = packed; c < dv; ++c)
            acc[c] += p[j] * row[c];
    }
}

/// One query against contiguous keys K (n×d) and values V (n×dv): folds
/// s_j = scale · q·k_j into `state` and `acc` (1×dv) block by block, each block's K rows
/// then its V rows, by Eigen's GEMVs while the run fits in cache and in address order
/// once it does not (streaming_bytes).
template <class T, class Q, class KBlock, class VBlock, class Acc>
void attend_contiguous(const Q& q, const KBlock& K, const VBlock& V, T scale, SoftmaxState<T>& state, Acc&& acc) {
    MEMATTN_DASSERT(K.rows() == V.rows() && K.cols() == q.cols() && V.cols() == acc.cols());
    alignas(64) T buffer[attend_block];
    const Index d = K.cols(), dv = V.cols();
    const auto bytes = static_cast<std::size_t>(K.rows() * (d + dv)) * sizeof(T);
    if (bytes < streaming_bytes) {
        for (Index j0 = 0; j0 < K.rows(); j0 += attend_block) {
            const Index n = std::min(attend_block, K.rows() - j0);
            Eigen::Map<Vector<T>> s(buffer, n);
            s.noalias() = scale * (q * K.middleRows(j0, n).transpose());
            const T alpha = state.absorb(buffer, n);
            if (alpha != T(1))
                acc *= alpha;
            acc.noalias() += s * V.middleRows(j0, n);
        }
        return;
    }
    MEMATTN_DASSERT(q.innerStride() == 1 && acc.innerStride() == 1);
    for (Index j0 = 0; j0 < K.rows(); j0 += attend_block) {
        const Index n = std::min(attend_block, K.rows() - j0);
        const T* keys = K.data() + j0 * K.outerStride();
        const Index ahead = rows_ahead<T>(d);
        for (Index j = 0; j < n; ++j) {
            if (j + ahead < n)
                prefetch_rows(keys + (j + ahead) * K.outerStride(), 1, 0, d);
            buffer[j] = scale * dot_in_order(q.data(), keys + j * K.outerStride(), d);
        }
        const T alpha = state.absorb(buffer, n);
        add_values_in_order(buffer, V.data() + j0 * V.outerStride(), V.outerStride(), n, dv, alpha, acc.data());
    }
}

/// Values T a single-query attend converts per step on its stack: 32 KiB.
template <class T>
inline constexpr Index stored_buffer = Index(32768 / sizeof(T));

/// One query against the stored pairs [first, first + n) of K and V, as the streaming path
/// of attend_contiguous: per block of attend_block keys, the logits s_j = scale · q·k_j,
/// the online softmax, then acc = α·acc + Σ_j p_j v_j. In float with fused_storage each
/// row is converted in registers inside the dot product and the update; otherwise rows
/// are converted a few at a time into a buffer in L1 (dot_in_order, add_values_in_order),
/// on the stack (stored_buffer values), or from the heap for a row wider than that.
template <class T, class S, class Q, class Acc>
void attend_stored(const Q& q, const StoredRows<T, S>& K, const StoredRows<T, S>& V, Index first, Index n, T scale,
                   SoftmaxState<T>& state, Acc&& acc) {
    MEMATTN_DASSERT(q.innerStride() == 1 && acc.innerStride() == 1);
    if constexpr (fused_storage && std::is_same_v<T, float>) {
        // Conversion in registers: each key row's dot product and each value row's update
        // read the stored bytes once, in address order.
        using namespace Eigen::internal;
        alignas(64) T logits[attend_block];
        const Index dv = V.cols(), packed = dv / packet_lanes<T> * packet_lanes<T>;
        // From DRAM (a run of at least streaming_bytes), rows are asked for 4 KiB ahead on
        // each stream, as on the float path; in cache the prefetches only cost.
        const Index end = first + n;
        const bool streaming = static_cast<std::size_t>(n) * (StoredRows<T, S>::row_bytes(K.cols()) +
                                                              StoredRows<T, S>::row_bytes(dv)) >= streaming_bytes;
        const Index k_ahead = streaming ? std::max<Index>(1, Index(4096 / StoredRows<T, S>::row_bytes(K.cols()))) : n;
        const Index v_ahead = streaming ? std::max<Index>(1, Index(4096 / StoredRows<T, S>::row_bytes(dv))) : n;
        T* out = acc.data();
        for (Index j0 = first; j0 < end; j0 += attend_block) {
            const Index m = std::min(attend_block, end - j0);
            for (Index j = 0; j < m; ++j) {
                if (j0 + j + k_ahead < end)
                    K.prefetch_row(j0 + j + k_ahead);
                logits[j] = scale * K.dot(j0 + j, q.data());
            }
            const T alpha = state.absorb(logits, m);
            if (alpha != T(1)) {
                for (Index c = 0; c < packed; c += packet_lanes<T>)
                    pstoreu(out + c, pmul(pset1<Packet<T>>(alpha), ploadu<Packet<T>>(out + c)));
                for (Index c = packed; c < dv; ++c)
                    out[c] *= alpha;
            }
            V.add_rows(j0, m, logits, out, streaming ? v_ahead : 0, end);
        }
        return;
    }
    const Index d = K.cols(), dv = V.cols(), widest = std::max(d, dv);
    alignas(64) T stack[stored_buffer<T>];
    std::vector<T> heap;
    T* buffer = stack;
    if (widest > stored_buffer<T>) {
        heap.resize(static_cast<std::size_t>(widest));
        buffer = heap.data();
    }
    const Index step = std::max<Index>(1, std::min<Index>(16, stored_buffer<T> / widest));
    alignas(64) T logits[attend_block];
    for (Index j0 = first; j0 < first + n; j0 += attend_block) {
        const Index m = std::min(attend_block, first + n - j0);
        for (Index j = 0; j < m; j += step) {
            const Index rows = std::min(step, m - j);
            K.decode_rows(j0 + j, rows, buffer, d);
            for (Index r = 0; r < rows; ++r)
                logits[j + r] = scale * dot_in_order(q.data(), buffer + r * d, d);
        }
        T alpha = state.absorb(logits, m);
        for (Index j = 0; j < m; j += step) {
            const Index rows = std::min(step, m - j);
            V.decode_rows(j0 + j, rows, buffer, dv);
            add_values_in_order(logits + j, buffer, dv, rows, dv, alpha, acc.data());
            alpha = T(1);
        }
    }
}


/// Grouped attend: at most `group_rows` queries and `group_keys` keys per step.
inline constexpr Index group_rows = 16;
inline constexpr Index group_keys = 128;

/// g ≤ group_rows queries against runs of keys and values, each read once for the whole
/// group (what grouped-query attention saves), per block of ≤ 128 keys, with all scratch
/// on the stack. The logits take one of two routes, by measurement (bench/multi_head_bench.cpp,
/// BM_Decode, and g queries against 4096 keys at d = 128):
/// - g ≥ a packet's lanes and d ≤ max_depth, the tiled kernel's: Sᵀ = K_b · (log2(e)·scale·Q_g)ᵀ
///   (keys × lanes, register-blocked) and the online softmax in base 2 across the lanes
///   (SoftmaxBlockState); at g = 16 twice as fast as the other route;
/// - fewer queries: S = scale · Q_g K_bᵀ as dot products vectorised along the head dim and
///   one SoftmaxState per query, since a key-major product would fill only g of a
///   packet's lanes (g = 4: 1.6× faster than the tiled route with AVX2).
/// Then acc = α ⊙ acc + P · V_b, one register-blocked product with α fused into its load.
/// One query goes through attend_contiguous, which is exactly `attend`.
template <class T>
class GroupAttention {
public:
    static constexpr Index max_depth = 256;

    template <class QB>
    GroupAttention(const QB& queries, T scale)
        : queries_(queries), scale_(scale), g_(queries.rows()), lanes_(round_up(g_, packet_lanes<T>)),
          tiled_(g_ >= packet_lanes<T> && queries.cols() <= max_depth), block_(tiled_ ? lanes_ : 1) {
        MEMATTN_DASSERT(g_ <= group_rows && lanes_ <= group_rows);
        if (!tiled_)
            return;
        const Index d = queries.cols();
        const T factor = scale * T(1.44269504088896340735992468100);  // base-2 logits
        for (Index k = 0; k < d; ++k) {
            for (Index r = 0; r < g_; ++r)
                qt_[k * lanes_ + r] = factor * queries(r, k);
            for (Index r = g_; r < lanes_; ++r)
                qt_[k * lanes_ + r] = T(0);
        }
    }

    /// Folds keys K (n×d) and values V (n×dv), contiguous rows of any stride, into the
    /// states and the rows of `acc` (g×dv, zero before the first fold).
    template <class KBlock, class VBlock, class Acc>
    void fold(const KBlock& K, const VBlock& V, Acc&& acc) {
        MEMATTN_DASSERT(K.rows() == V.rows() && K.cols() == queries_.cols() && V.cols() == acc.cols() &&
                        acc.rows() == g_);
        if (g_ == 1) {
            attend_contiguous(queries_.row(0), K, V, scale_, states_[0], acc.row(0));
            return;
        }
        const auto in_place = [](const auto& X) {
            return [&X](Index j, Index) { return Rows{X.data() + j * X.outerStride(), X.outerStride()}; };
        };
        fold_rows(K.rows(), K.cols(), V.cols(), in_place(K), in_place(V), group_keys, group_keys, acc);
    }

    /// fold() for the rows [first, first + n) of stored keys and values in any storage.
    /// Stored as T they are read in place. Stored compactly, each key and value row is
    /// converted once for the whole group (what a grouped attend saves over one attend per
    /// query head), a few rows at a time into a buffer that stays in L1, and the products
    /// run on the converted rows in the same blocks and the same order of terms as fold():
    /// the result is bitwise fold()'s on the stored values converted to T. One query takes
    /// attend_stored, which is exactly the cache's attend.
    template <class S, class Acc>
    void fold_stored(const StoredRows<T, S>& K, const StoredRows<T, S>& V, Index first, Index n, Acc&& acc) {
        if constexpr (!StoredRows<T, S>::compact) {
            fold(K.block(first, n), V.block(first, n), acc);
        } else {
            MEMATTN_DASSERT(K.cols() == queries_.cols() && V.cols() == acc.cols() && acc.rows() == g_);
            if (g_ == 1) {
                attend_stored(queries_.row(0), K, V, first, n, scale_, states_[0], acc.row(0));
                return;
            }
            const Index d = K.cols(), dv = V.cols(), widest = std::max(d, dv);
            alignas(64) T stack[stored_buffer<T>];
            std::vector<T> heap;  // only for a row wider than the stack buffer
            T* buffer = stack;
            if (widest > stored_buffer<T>) {
                heap.resize(static_cast<std::size_t>(widest));
                buffer = heap.data();
            }
            const Index buffered = std::max<Index>(stored_buffer<T>, widest);
            const auto converted = [&](const StoredRows<T, S>& X) {
                return [&X, first, buffer](Index j, Index m) {
                    X.decode_rows(first + j, m, buffer, X.cols());
                    return Rows{buffer, X.cols()};
                };
            };
            fold_rows(n, d, dv, converted(K), converted(V), std::clamp<Index>(buffered / d, 1, group_keys),
                      std::clamp<Index>(buffered / dv, 1, group_keys), acc);
        }
    }
    /// Query r's state (natural logarithms), to finish or merge its accumulator row.
    [[nodiscard]] SoftmaxState<T> state(Index r) const { return tiled_ ? block_.state(r) : states_[r]; }

private:
    static constexpr Index round_up(Index n, Index m) { return (n + m - 1) / m * m; }

    /// Rows of T: the first one and the distance between rows.
    struct Rows {
        const T* data;
        Index stride;
    };

    /// The one loop of fold and fold_stored over n pairs: per block of group_keys keys,
    /// the logits (from key_rows(j, m), at most key_step rows at a time), the online
    /// softmax, then acc = α ⊙ acc + P·V (from value_rows(j, m), value_step rows at a
    /// time: the first part scales by α, the others accumulate, so the terms are added in
    /// the order one product over the block would add them).
    template <class KeyRows, class ValueRows, class Acc>
    void fold_rows(Index n, Index d, Index dv, const KeyRows& key_rows, const ValueRows& value_rows, Index key_step,
                   Index value_step, Acc& acc) {
        for (Index j0 = 0; j0 < n; j0 += group_keys) {
            const Index block = std::min(group_keys, n - j0);
            const T* alpha = alpha_;
            for (Index j = 0; j < block; j += key_step) {
                const Index m = std::min(key_step, block - j);
                const Rows k = key_rows(j0 + j, m);
                if (tiled_) {  // Sᵀ, keys × lanes, then P read from it with strides (1, lanes)
                    tile_product<T>(m, lanes_, d, k.data, k.stride, 1, qt_, lanes_, s_ + j * lanes_, lanes_, nullptr);
                } else {  // S, g × keys, then P read from it with strides (group_keys, 1)
                    for (Index i = 0; i < m; ++i)
                        for (Index r = 0; r < g_; ++r)
                            s_[r * group_keys + j + i] =
                                scale_ * dot_in_order(queries_.data() + r * queries_.outerStride(), k.data + i * k.stride, d);
                }
            }
            if (tiled_) {
                block_.absorb(s_, block, lanes_, lanes_);
                alpha = block_.alpha();
            } else {
                for (Index r = 0; r < g_; ++r)
                    alpha_[r] = states_[r].absorb(s_ + r * group_keys, block);
            }
            const Index a_row = tiled_ ? 1 : group_keys, a_k = tiled_ ? lanes_ : 1;
            for (Index j = 0; j < block; j += value_step) {
                const Index m = std::min(value_step, block - j);
                const Rows v = value_rows(j0 + j, m);
                if (j == 0)
                    tile_product<T>(g_, dv, m, s_, a_row, a_k, v.data, v.stride, acc.data(), acc.outerStride(), alpha);
                else
                    tile_product<T, DefaultBlocking, true>(g_, dv, m, s_ + j * a_k, a_row, a_k, v.data, v.stride,
                                                           acc.data(), acc.outerStride(), nullptr);
            }
        }
    }

    ConstMatrixRef<T> queries_;
    T scale_;
    Index g_, lanes_;
    bool tiled_;
    SoftmaxBlockState<T, static_cast<int>(group_rows)> block_;  // tiled route
    SoftmaxState<T> states_[group_rows];                        // the other routes
    T alpha_[group_rows];
    alignas(64) T qt_[max_depth * group_rows];  // log2(e)·scale·Q_gᵀ, tiled route
    alignas(64) T s_[group_rows * group_keys];  // logits, then weights
};

/// out (g×dv) = softmax attention of each row of `queries` (g×d) over the pairs a memory
/// reads, given as `for_each_stored_run(f)` calling f(keys, values, first, n) for each
/// contiguous run of stored rows in order; rows with no visible pair get zero. Each
/// stored row is read once per group of group_rows queries. Allocates nothing.
template <class T, class ForEachRun>
void attend_group_runs(const ConstMatrixRef<T>& queries, MatrixRef<T>& out, T scale,
                       const ForEachRun& for_each_stored_run) {
    for (Index r0 = 0; r0 < queries.rows(); r0 += group_rows) {
        const Index g = std::min(group_rows, queries.rows() - r0);
        auto acc = out.middleRows(r0, g);
        acc.setZero();
        GroupAttention<T> group(queries.middleRows(r0, g), scale);
        for_each_stored_run([&](const auto& keys, const auto& values, Index first, Index n) {
            group.fold_stored(keys, values, first, n, acc);
        });
        for (Index r = 0; r < g; ++r)
            group.state(r).finish(acc.row(r));
    }
}

}  // namespace memattn::detail
