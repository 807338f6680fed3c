#pragma once
// One query against runs of stored pairs (kernels/decode_attention.hpp describes the
// routes and their measurements): attend_contiguous for pairs stored as T (Eigen's GEMVs
// in cache, the streaming path with prefetch beyond it), attend_stored for compact
// storage (rows converted in registers, or IntegerDot's integer logits).

#include "memattn/detail/assert.hpp"
#include "memattn/detail/packet.hpp"
#include "memattn/detail/tile_product.hpp"
#include "memattn/kernels/softmax_options.hpp"
#include "memattn/softmax_state.hpp"
#include "memattn/storage/compact.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <limits>
#include <new>
#include <type_traits>
#include <utility>
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

/// Bytes of K and V from which attend_stored asks for its rows ahead (4 KiB on each
/// stream), or the caller says they come from beyond the L2 (`ask_ahead`): a head's
/// bytes, the grouped attend's rule (group_prefetch_bytes, kernels/group_attention.hpp, and its
/// measurements). Until 2026-12-08 it was streaming_bytes, the float path's choice of
/// its loop, so a head of 1-byte rows (FP8, Q8) at 32,768 tokens × 128 (8 MiB) asked for
/// nothing, nor did a pool's sequence (a run is a block), whatever its length.
inline constexpr std::size_t stored_ahead_bytes = std::size_t(1) << 20;

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

/// attend_stored's loop over the pairs [first, first + n): per block of attend_block keys
/// the logits s_j = logit(j) (nullptr: scale · q·k_j by dot_in_order on decoded rows), the
/// online softmax, then acc = α·acc + Σ_j p_j v_j. In float with fused_storage each row is
/// converted in registers inside its dot product (logit) and its update (add_rows), read
/// in address order, asked for 4 KiB ahead on each stream once the run comes from DRAM
/// (at least stored_ahead_bytes, or `ask_ahead`; in cache the prefetches only cost).
/// Otherwise rows are converted a few at a time into a buffer in L1 (dot_in_order,
/// add_values_in_order), on
/// the stack (stored_buffer values), or from the heap for a row wider than that.
/// NumberValues: V's rows of numbers are added by add_number_rows (number_rows).
template <bool NumberValues = false, class T, class SK, class SV, class Q, class Acc, class Logit>
void attend_stored_rows(const Q& q, const StoredRows<T, SK>& K, const StoredRows<T, SV>& V, Index first, Index n,
                        T scale, SoftmaxState<T>& state, Acc& acc, const Logit& logit, bool ask_ahead) {
    using KRows = StoredRows<T, SK>;
    using VRows = StoredRows<T, SV>;
    constexpr bool in_registers = fused_storage && std::is_same_v<T, float>;
    constexpr bool decode_keys = std::is_same_v<Logit, std::nullptr_t>;
    const Index d = K.cols(), dv = V.cols(), end = first + n;
    const bool streaming =
        ask_ahead || static_cast<std::size_t>(n) * (KRows::row_bytes(d) + VRows::row_bytes(dv)) >= stored_ahead_bytes;
    const Index k_ahead = streaming ? std::max<Index>(1, Index(4096 / KRows::row_bytes(d))) : n;
    const Index v_ahead = streaming ? std::max<Index>(1, Index(4096 / VRows::row_bytes(dv))) : 0;
    // The buffer of the rows converted to T (none when both products read in registers).
    constexpr Index buffered = in_registers && !decode_keys ? 1 : stored_buffer<T>;
    const Index widest = in_registers ? (decode_keys ? d : 1) : std::max(d, dv);
    alignas(64) T stack[buffered];
    std::vector<T> heap;
    T* buffer = stack;
    if (widest > buffered) {
        heap.resize(static_cast<std::size_t>(widest));
        buffer = heap.data();
    }
    const Index step = std::max<Index>(1, std::min<Index>(16, buffered / std::max<Index>(widest, 1)));
    alignas(64) T logits[attend_block];
    T* out = acc.data();
    for (Index j0 = first; j0 < end; j0 += attend_block) {
        const Index m = std::min(attend_block, end - j0);
        if constexpr (decode_keys) {
            for (Index j = 0; j < m; j += step) {
                const Index rows = std::min(step, m - j);
                K.decode_rows(j0 + j, rows, buffer, d);
                for (Index r = 0; r < rows; ++r)
                    logits[j + r] = scale * dot_in_order(q.data(), buffer + r * d, d);
            }
        } else if constexpr (std::is_invocable_v<const Logit&, Index, Index, T*, Index, Index>) {
            logit(j0, m, logits, streaming ? k_ahead : 0, end);  // a block at a time, asking ahead itself
        } else {
            for (Index j = 0; j < m; ++j) {
                if (j0 + j + k_ahead < end)
                    K.prefetch_row(j0 + j + k_ahead);
                logits[j] = logit(j0 + j);
            }
        }
        T alpha = state.absorb(logits, m);
        if constexpr (in_registers) {
            using namespace Eigen::internal;
            const Index packed = dv / packet_lanes<T> * packet_lanes<T>;
            if (alpha != T(1)) {
                for (Index c = 0; c < packed; c += packet_lanes<T>)
                    pstoreu(out + c, pmul(pset1<Packet<T>>(alpha), ploadu<Packet<T>>(out + c)));
                for (Index c = packed; c < dv; ++c)
                    out[c] *= alpha;
            }
            if constexpr (NumberValues)
                V.add_number_rows(j0, m, logits, out, v_ahead, end);
            else
                V.add_rows(j0, m, logits, out, v_ahead, end);
        } else {
            for (Index j = 0; j < m; j += step) {
                const Index rows = std::min(step, m - j);
                V.decode_rows(j0 + j, rows, buffer, dv);
                add_values_in_order(logits + j, buffer, dv, rows, dv, alpha, out);
                alpha = T(1);
            }
        }
    }
}

/// Keys whose logits are taken in integers alone and in a group (GroupAttention::fold_integer):
/// IntegerDot<Q8> and IntegerDot<Rotated<Q8>> in float, on every instruction set (the same
/// bits; sixteen keys per vpdpbusd where the build targets AVX-512 VNNI,
/// integer_group_logits, eight per vpmaddubsw with AVX2 and FMA, key by key elsewhere:
/// integer_group_keys).
template <class SK>
inline constexpr bool integer_group = integer_dot<SK> && std::is_base_of_v<StoredRows<float, Q8>, StoredRows<float, SK>>;

/// Rows asked for nothing (integer_logits' values when the caller asks for them itself).
struct NoRows {
    void prefetch_row(Index) const noexcept {}
};

/// The widest head whose query attend_stored multiplies by a number rows' factor on the
/// stack (wider ones read the rows exactly).
inline constexpr Index number_query_depth = 512;

/// One query against the stored pairs [first, first + n) of K and V, as the streaming path
/// of attend_contiguous (attend_stored_rows): the logits s_j = scale · q·k_j, in float
/// with fused_storage by each row's dot product in registers. With IntegerDot<S> storage
/// they are scale · q̃·k_j for the query rounded to int8 once here (IntegerQuery, on the
/// stack; a head wider than its max_depth takes q·k_j). With PerChannelKeys<S> keys, by
/// the query's products with each group's scales, once per group (ChannelQuery, on the
/// stack; a head wider than its max_depth takes the plain dot).
template <class T, class SK, class SV, class Q, class Acc>
void attend_stored(const Q& q, const StoredRows<T, SK>& K, const StoredRows<T, SV>& V, Index first, Index n, T scale,
                   SoftmaxState<T>& state, Acc&& acc, bool ask_ahead = false) {
    MEMATTN_DASSERT(q.innerStride() == 1 && acc.innerStride() == 1);
    if constexpr (integer_dot<SK>) {
        static_assert(std::is_same_v<T, float>, "memattn: the integer Q·K (IntegerDot<S>) is for caches of float");
        if constexpr (integer_group_logits && integer_group<SK>) {
            // Q8 keys with AVX-512 VNNI: sixteen keys per vpdpbusd, the grouped route's
            // kernel for a group of one (integer_dot's bits).
            if (K.cols() <= IntegerGroup::max_depth) {
                IntegerGroup rounded;
                rounded.round(q.data(), K.cols(), 1, K.cols());
                const auto block = [&](Index j0, Index m, float* logits, Index ahead, Index end) {
                    K.integer_logits(j0, m, rounded, scale, logits, attend_block, NoRows{}, ahead, end);
                };
                attend_stored_rows(q, K, V, first, n, scale, state, acc, block, ask_ahead);
                return;
            }
        }
        if (K.cols() <= IntegerQuery::max_depth) {
            IntegerQuery rounded;  // round() writes every entry that integer_dot reads
            rounded.round(q.data(), K.cols());
            attend_stored_rows(q, K, V, first, n, scale, state, acc,
                               [&](Index row) { return scale * K.integer_dot(row, rounded); }, ask_ahead);
            return;
        }
    }
    if constexpr (per_channel_keys<SK> && fused_storage && std::is_same_v<T, float>) {
        if (K.cols() <= ChannelQuery::max_depth) {
            ChannelQuery channels;  // its group is none: dot fills qs before it reads them
            attend_stored_rows(q, K, V, first, n, scale, state, acc,
                               [&](Index row) { return scale * K.dot(row, q.data(), channels); }, ask_ahead);
            return;
        }
    }
    if constexpr (fused_storage && std::is_same_v<T, float>) {
        if constexpr (number_rows<StoredRows<T, SK>> && number_rows<StoredRows<T, SV>>) {
            // Rows of numbers read divided by their factor, the query and the weights
            // multiplied by it: the same products (number_rows)
            constexpr float factor = StoredRows<T, SK>::number_factor;
            static_assert(StoredRows<T, SV>::number_factor == factor);
            const Index d = K.cols();
            if (K.numbers_only() && V.numbers_only() && d <= number_query_depth) {
                alignas(64) float scaled[number_query_depth];
                bool finite = true;  // no finite q_i overflows times the factor
                for (Index c = 0; c < d; ++c) {
                    scaled[c] = q.data()[c] * factor;
                    finite = finite && !(std::abs(scaled[c]) > std::numeric_limits<float>::max() &&
                                         std::abs(q.data()[c]) <= std::numeric_limits<float>::max());
                }
                if (finite) {
                    attend_stored_rows<true>(q, K, V, first, n, scale, state, acc,
                                             [&](Index row) { return scale * K.number_dot(row, scaled); }, ask_ahead);
                    return;
                }
            }
        }
        attend_stored_rows(q, K, V, first, n, scale, state, acc,
                           [&](Index row) { return scale * K.dot(row, q.data()); }, ask_ahead);
    } else
        attend_stored_rows(q, K, V, first, n, scale, state, acc, nullptr, ask_ahead);
}

}  // namespace memattn::detail
