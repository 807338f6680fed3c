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
// Register blocking: a micro-tile of kRows rows × 2 packets keeps 2·kRows accumulators
// in registers and, per step k, loads 2 packets of B and broadcasts kRows scalars of A.
// With AVX2 (16 ymm registers) micro_rows = 4 uses 8 accumulators + 2 B + 1 broadcast;
// Zen 1 issues one 256-bit FMA per cycle with a latency of 5, so 8 independent chains
// hide the latency, and 4 divides every query-tile width (multiples of 2 packets), so
// the product over a tile's queries has no leftover rows. Measured on 64×64×64 tiles:
// 34 GFLOP/s for Sᵀ = K·Qᵀ and 33 for acc += P·V, against 32 and 33 for Eigen's own
// products and an FMA peak of 34–38 on this core.
// Columns left over after the 2-packet blocks take a 1-packet block, then scalar lanes
// (the same code instantiated with the scalar as its "packet").

#include "memattn/detail/packet.hpp"
#include "memattn/types.hpp"

namespace memattn::detail {

/// Rows of one micro-tile.
inline constexpr Index micro_rows = 4;

/// One micro-tile: Rows × (Packets · lanes of P) of C.
template <class P, int Rows, int Packets, class T>
inline void micro_tile(Index depth, const T* a, Index a_row, Index a_k, const T* b, Index ldb, T* c, Index ldc,
                       const T* row_scale) {
    using namespace Eigen::internal;
    constexpr int lanes = unpacket_traits<P>::size;
    P acc[Rows][Packets];
    for (int r = 0; r < Rows; ++r)
        for (int p = 0; p < Packets; ++p)
            acc[r][p] = row_scale ? pmul(pset1<P>(row_scale[r]), ploadu<P>(c + r * ldc + p * lanes))  // α ⊙ C
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

/// Every row of one column block, micro_rows at a time, then the leftover rows singly.
template <class P, int Packets, class T>
inline void column_block(Index rows, Index depth, const T* a, Index a_row, Index a_k, const T* b, Index ldb, T* c,
                         Index ldc, const T* row_scale) {
    constexpr int block = static_cast<int>(micro_rows);
    Index r = 0;
    for (; r + block <= rows; r += block)
        micro_tile<P, block, Packets>(depth, a + r * a_row, a_row, a_k, b, ldb, c + r * ldc, ldc,
                                      row_scale ? row_scale + r : nullptr);
    for (; r < rows; ++r)
        micro_tile<P, 1, Packets>(depth, a + r * a_row, a_row, a_k, b, ldb, c + r * ldc, ldc,
                                  row_scale ? row_scale + r : nullptr);
}

/// C = diag(row_scale)·C + A·B, or C = A·B when row_scale is null (see the top of the file).
template <class T>
void tile_product(Index rows, Index cols, Index depth, const T* a, Index a_row, Index a_k, const T* b, Index ldb,
                  T* c, Index ldc, const T* row_scale) {
    constexpr Index lanes = packet_lanes<T>;
    Index j = 0;
    // Column blocks outermost: a block of B (depth × 2 packets) stays in L1 for all rows.
    for (; j + 2 * lanes <= cols; j += 2 * lanes)
        column_block<Packet<T>, 2>(rows, depth, a, a_row, a_k, b + j, ldb, c + j, ldc, row_scale);
    if constexpr (lanes > 1) {
        if (j + lanes <= cols) {
            column_block<Packet<T>, 1>(rows, depth, a, a_row, a_k, b + j, ldb, c + j, ldc, row_scale);
            j += lanes;
        }
    }
    for (; j < cols; ++j)
        column_block<T, 1>(rows, depth, a, a_row, a_k, b + j, ldb, c + j, ldc, row_scale);
}

}  // namespace memattn::detail
