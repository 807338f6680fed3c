#pragma once
// A register-blocked product for the tiles of the attention kernels:
//
//   C (rows × cols) = α ⊙ C + A (rows × depth) · B (depth × cols)      (α per row, or C = A·B)
//
// A is read one scalar at a time and broadcast, B and C a packet at a time, so the
// operands can keep whatever layout the caller has: A(r, k) = a[r·a_row + k·a_k] (any
// two strides, so Kᵀ-free scores and key-major weights both work), B row-major with row
// stride ldb, C row-major with row stride ldc. Nothing is packed or allocated.
//
// Register blocking: a micro-tile of Rows rows × Packets packets keeps Rows·Packets
// accumulators in registers and, per step k, loads Packets packets of B and broadcasts
// Rows scalars of A: Rows·Packets + Packets + 1 registers. The blocking is a template
// parameter (Blocking), chosen per instruction set at compile time from the register
// count (DefaultBlocking):
//   16 vector registers (SSE, AVX2):  6 × 2 packets, 12 accumulators + 2 + 1 = 15;
//   32 vector registers (AVX-512):    6 × 4 packets, 24 accumulators + 4 + 1 = 29.
// A core with two FMA ports of latency 4 needs 8 independent chains in flight; 12 (24
// with two 512-bit ports) leave slack for the loads and broadcasts. Measured with AVX2
// on an AMD EPYC (Zen 3, two 256-bit FMA ports, peak 94 GFLOP/s on one core), a 128-key
// tile's two products (Sᵀ = K·Qᵀ then acc = α ⊙ acc + P·V, 64 queries, d = dv = 64):
//   4 × 2 (the 0.1 blocking, 8 chains)  46 GFLOP/s     6 × 2   81 GFLOP/s
//   5 × 2                               73             8 × 1   61
//   4 × 3, 3 × 4 (spill past 16)        37–44          2 × 4   46
// A core with one 256-bit FMA port (Zen 1, latency 5) needs only 5 chains; there 4 × 2
// matched Eigen's GEMM, and 6 × 2 keeps more than enough.
// Measured with AVX-512 on an Intel Xeon (family 6 model 207, two 512-bit FMA ports,
// peak 175–182 GFLOP/s on one core), the whole causal kernel (N = 4096 and 16384, d = 64
// and 128, query tiles of 80–512 rows, medians of 3, interleaved): 6 × 4, 5 × 4, 4 × 5,
// 5 × 3, 4 × 4 and 6 × 2 all run at 0.68–0.81 of the peak once the query tile has 160
// rows or more, within the machine's noise of one another; the products take 78% of the
// time there and run at about 0.9 of the peak, so the blocking is no longer what limits
// the kernel. 6 × 4 stays the AVX-512 default (24 chains, the most slack).
// A banded product (Band) computes, for each strip of rows, only a range of columns and
// a range of depth terms: the masked tiles of the softmax kernel skip the pairs that
// cross the diagonal or the window's edge. Columns outside a strip's range (rounded out
// to whole packets) are not written; terms outside its depth range are not added, which
// changes no bit when their A coefficients are zero (x + 0·b is x for every finite b).
// Rows left over below a micro-tile take a micro-tile of exactly that many rows, whole
// packets of columns left over a block of exactly that many packets, and lanes left
// over the same code instantiated with the scalar as its "packet". Every element of
// C is the same sum in the same order (k ascending, one FMA per term) whatever the
// blocking, so the blocking changes no result bit.

#include "memattn/detail/packet.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <utility>

namespace memattn::detail {

/// A micro-tile of Rows rows × Packets SIMD packets of C (see the top of the file).
template <int Rows, int Packets>
struct Blocking {
    static_assert(Rows >= 1 && Packets >= 1);
    static constexpr int rows = Rows;
    static constexpr int packets = Packets;
};

/// Vector registers of the target: Eigen's count for its instruction set (32 with
/// AVX-512 or NEON, 16 with SSE and AVX).
#ifdef EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS
inline constexpr int vector_registers = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS;
#else
inline constexpr int vector_registers = 16;
#endif

/// The blocking for this instruction set (measurements at the top of the file).
using DefaultBlocking = std::conditional_t<(vector_registers >= 32), Blocking<6, 4>, Blocking<6, 2>>;

/// n rounded up to a multiple of m.
constexpr Index round_up(Index n, Index m) { return (n + m - 1) / m * m; }

/// A half-open range [first, end) of columns or depth terms.
struct Range {
    Index first, end;
};

/// The band of a dense product: every strip takes every column and the whole depth.
struct WholeStrip {
    static constexpr Range columns(Index /*row*/, Index /*rows*/, Index cols) { return {0, cols}; }
    static constexpr Range terms(Index /*row*/, Index /*rows*/, Index depth) { return {0, depth}; }
};

/// f.template operator()<n>() for a run-time n in [1, Max]: the leftover rows and packets
/// of a product get a micro-tile of exactly their size.
template <int Max, class F>
inline void dispatch(Index n, F&& f) {
    [&]<int... I>(std::integer_sequence<int, I...>) {
        (void)((n == I + 1 && (f.template operator()<I + 1>(), true)) || ...);
    }(std::make_integer_sequence<int, Max>{});
}

/// One micro-tile: Rows × (Packets · lanes of P) of C. Accumulate: C += A·B when there
/// is no row_scale (else C = A·B).
template <class P, int Rows, int Packets, bool Accumulate, class T>
inline void micro_tile(Index depth, const T* a, Index a_row, Index a_k, const T* b, Index ldb, T* c, Index ldc,
                       const T* row_scale) {
    using namespace Eigen::internal;
    constexpr int lanes = unpacket_traits<P>::size;
    P acc[Rows][Packets];
    for (int r = 0; r < Rows; ++r)
        for (int p = 0; p < Packets; ++p)
            acc[r][p] = row_scale    ? pmul(pset1<P>(row_scale[r]), ploadu<P>(c + r * ldc + p * lanes))  // α ⊙ C
                        : Accumulate ? ploadu<P>(c + r * ldc + p * lanes)
                                     : pset1<P>(T(0));
    for (Index k = 0; k < depth; ++k) {
        P bk[Packets];
        for (int p = 0; p < Packets; ++p)
            bk[p] = ploadu<P>(b + k * ldb + p * lanes);
        for (int r = 0; r < Rows; ++r) {
            const P ark = pset1<P>(a[r * a_row + k * a_k]);
            for (int p = 0; p < Packets; ++p)
                acc[r][p] = pmadd(ark, bk[p], acc[r][p]);  // C(r, :) += A(r, k) · B(k, :)
        }
    }
    for (int r = 0; r < Rows; ++r)
        for (int p = 0; p < Packets; ++p)
            pstoreu(c + r * ldc + p * lanes, acc[r][p]);
}

/// One strip of Rows rows across all columns: Packets-wide blocks, then the whole
/// packets left over as one block of exactly that many, then the lanes left over.
template <int Rows, int Packets, bool Accumulate, class T>
inline void row_strip(Index cols, Index depth, const T* a, Index a_row, Index a_k, const T* b, Index ldb, T* c,
                      Index ldc, const T* row_scale) {
    using P = Packet<T>;
    constexpr Index lanes = packet_lanes<T>;
    constexpr Index block = Packets * lanes;
    Index j = 0;
    for (; j + block <= cols; j += block)
        micro_tile<P, Rows, Packets, Accumulate>(depth, a, a_row, a_k, b + j, ldb, c + j, ldc, row_scale);
    if constexpr (Packets > 1) {
        const Index left = (cols - j) / lanes;
        if (left > 0)
            dispatch<Packets - 1>(left, [&]<int L>() {
                micro_tile<P, Rows, L, Accumulate>(depth, a, a_row, a_k, b + j, ldb, c + j, ldc, row_scale);
            });
        j += left * lanes;
    }
    if constexpr (lanes > 1) {
        for (; j < cols; ++j)
            micro_tile<T, Rows, 1, Accumulate>(depth, a, a_row, a_k, b + j, ldb, c + j, ldc, row_scale);
    }
}

/// C = diag(row_scale)·C + A·B, or C = A·B when row_scale is null, or C += A·B when it
/// is null and Accumulate is set (see the top of the file). The strip of rows [r, r + R)
/// computes only columns band.columns(r, R, cols) and terms band.terms(r, R, depth).
template <class T, class B = DefaultBlocking, bool Accumulate = false, class Band = WholeStrip>
void tile_product(Index rows, Index cols, Index depth, const T* a, Index a_row, Index a_k, const T* b, Index ldb,
                  T* c, Index ldc, const T* row_scale, const Band& band = {}) {
    if (rows == 0 || cols == 0)
        return;
    if (depth == 0) {  // C = α ⊙ C or 0 or unchanged: A and B are not read, and may be empty (null)
        a = b = c;
        a_row = a_k = ldb = 0;
    }
    constexpr Index lanes = packet_lanes<T>;
    const auto strip = [&]<int R>(Index r) {
        const Range columns = band.columns(r, R, cols), terms = band.terms(r, R, depth);
        const Index c0 = columns.first / lanes * lanes, c1 = std::min(cols, round_up(columns.end, lanes));
        if (c0 >= c1)
            return;
        const Index k0 = std::min(terms.first, terms.end);
        row_strip<R, B::packets, Accumulate>(c1 - c0, terms.end - k0, a + r * a_row + k0 * a_k, a_row, a_k,
                                             b + k0 * ldb + c0, ldb, c + r * ldc + c0, ldc,
                                             row_scale ? row_scale + r : nullptr);
    };
    // Row strips outermost: a strip of A (Rows × depth) stays in registers and L1 while
    // it meets every column of B; the callers' B (Qᵀ of a query tile, a V tile) is the
    // operand that fits in L1 and is reused by every strip.
    Index r = 0;
    for (; r + B::rows <= rows; r += B::rows)
        strip.template operator()<B::rows>(r);
    if constexpr (B::rows > 1) {
        if (r < rows)
            dispatch<B::rows - 1>(rows - r, [&]<int L>() { strip.template operator()<L>(r); });
    }
}

/// C += A·B (see tile_product).
template <class T, class B = DefaultBlocking>
void tile_product_add(Index rows, Index cols, Index depth, const T* a, Index a_row, Index a_k, const T* b, Index ldb,
                      T* c, Index ldc) {
    tile_product<T, B, true>(rows, cols, depth, a, a_row, a_k, b, ldb, c, ldc, nullptr);
}

/// Asks for rows [0, rows) of a row-major block (row stride `stride`, `cols` scalars per
/// row) to be brought into L2 while the current tile computes: the next key tile's K and
/// V, which the hardware prefetchers do not foresee (the kernel walks key tiles from the
/// diagonal down).
template <class T>
inline void prefetch_rows([[maybe_unused]] const T* p, Index rows, Index stride, Index cols) {
#if defined(__GNUC__)
    constexpr Index line = 64 / static_cast<Index>(sizeof(T));
    for (Index r = 0; r < rows; ++r)
        for (Index k = 0; k < cols; k += line)
            __builtin_prefetch(p + r * stride + k, 0, 2);
#else
    (void)rows, (void)stride, (void)cols;
#endif
}

}  // namespace memattn::detail
