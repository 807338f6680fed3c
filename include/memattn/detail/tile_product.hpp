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
// Column panels: when B is larger than panel_bytes (32 KiB), the columns go in panels
// whose rows of B fit in L1, panels outermost, so every strip reads its panel from L1
// instead of L2 (the state S of the linear forms, d' × dv = 64 KiB at d = 128). No result
// changes: each element is still one micro-tile's sum.
// Rows left over below a micro-tile take a micro-tile of exactly that many rows, whole
// packets of columns left over a block of exactly that many packets, and lanes left
// over the same code instantiated with the scalar as its "packet". Every element of
// C is the same sum in the same order (k ascending, one FMA per term) whatever the
// blocking, so the blocking changes no result bit.

#include "memattn/detail/packet.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <array>
#include <utility>

namespace memattn::detail {

/// Asks for rows [0, rows) of a row-major block (row stride `stride`, `cols` scalars per
/// row) to be brought into L2 while the current tile computes: the next key tile's K and
/// V, which the hardware prefetchers do not foresee (the kernel walks key tiles from the
/// diagonal down).
/// Write: the rows will be written (an output's next rows), asked for with write intent.
///
/// The empty volatile asm keeps the requests: GCC counts __builtin_prefetch as free of
/// side effects, so it may infer that a function which only asks for lines (prefetch_tile,
/// or a caller's lambda around it, while still a call of its own) is `const` and delete
/// its calls; the grouped decode's logit tiles (float, vdpbf16ps and AMX) lost every
/// request that way (tests/codegen/prefetch_kept.cpp). A volatile asm is a side effect,
/// so no function that reaches one is `const`; it emits no instruction.
template <class T, bool Write = false>
inline void prefetch_rows([[maybe_unused]] const T* p, Index rows, Index stride, Index cols) {
#if defined(__GNUC__)
    constexpr Index line = 64 / static_cast<Index>(sizeof(T));
    for (Index r = 0; r < rows; ++r)
        for (Index k = 0; k < cols; k += line)
            __builtin_prefetch(p + r * stride + k, Write ? 1 : 0, 2);
    __asm__ __volatile__("");
#else
    (void)rows, (void)stride, (void)cols;
#endif
}

/// Rows of up to four row-major blocks (the next chunk's Q, K, V and O rows of a chunked
/// form) asked for towards L2 a few cache lines at a time: each strip of the products that
/// run meanwhile issues `lines_per_step` of them (tile_product's `ahead`). A burst of a
/// whole chunk's prefetches stalls on the core's line-fill buffers about as long as the
/// demand misses it replaces: measured on an Intel Xeon (AVX-512, chunked delta rule,
/// N = 65536, d = 128), a burst per operand gained 2%, the same lines spread over the
/// strips 10%, within 5% of inputs that sit in cache.
class PrefetchQueue {
public:
    explicit PrefetchQueue(Index lines_per_step) : lines_per_step_(std::max<Index>(lines_per_step, 1)) {}

    /// Starts over with no blocks: the lines not yet issued are dropped.
    void clear() { count_ = block_ = 0, row_ = line_ = 0; }

    /// Appends rows [0, rows) of a block (row stride `stride`, `cols` scalars per row);
    /// Write: they will be written (an output), asked for with write intent.
    template <class T, bool Write = false>
    void add(const T* p, Index rows, Index stride, Index cols) {
        if (rows <= 0 || cols <= 0 || count_ == static_cast<int>(blocks_.size()))
            return;
        const auto size = static_cast<Index>(sizeof(T));
        blocks_[count_++] = {reinterpret_cast<const char*>(p), rows, stride * size, (cols * size + line - 1) / line,
                             Write};
    }

    /// Lines added and not yet issued.
    [[nodiscard]] Index pending() const {
        Index lines = 0;
        for (int i = block_; i < count_; ++i)
            lines += blocks_[i].rows * blocks_[i].lines;
        return lines - (block_ < count_ ? row_ * blocks_[block_].lines + line_ : 0);
    }

    /// Issues the next lines_per_step lines.
    void step() {
        for (Index n = 0; n < lines_per_step_ && block_ < count_; ++n) {
            const Block& b = blocks_[block_];
            [[maybe_unused]] const char* address = b.p + row_ * b.stride + line_ * line;
#if defined(__GNUC__)
            if (b.write)
                __builtin_prefetch(address, 1, 2);
            else
                __builtin_prefetch(address, 0, 2);
#endif
            if (++line_ == b.lines) {
                line_ = 0;
                if (++row_ == b.rows)
                    row_ = 0, ++block_;
            }
        }
    }

private:
    static constexpr Index line = 64;
    struct Block {
        const char* p;
        Index rows, stride, lines;
        bool write;
    };
    std::array<Block, 4> blocks_{};
    int count_ = 0, block_ = 0;
    Index row_ = 0, line_ = 0;
    Index lines_per_step_;
};

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

/// Bytes of B a column panel of tile_product may span: two thirds of a 48 KiB L1 (32 KiB
/// on the smallest current x86 cores: a panel then still mostly fits).
inline constexpr Index panel_bytes = 32 * 1024;

/// The blocking for the folds of the chunked forms, S (d' × dv) += Kᵀ U over the C tokens
/// of a chunk: a depth of 16–32 terms, C read and written back once per micro-tile.
/// Measured alone with AVX-512 (Intel Xeon, family 6 model 207; d' = dv = 64 and 128,
/// C = 16 and 32, medians of 3, interleaved): 8 × 2 153–166 GFLOP/s, 4 × 4 150–161,
/// 5 × 4 144–163, 6 × 4 132–150; in the chunked delta rule (d = 128) 8 × 2 gained 3–4%.
/// With 16 registers 8 × 2 would spill: the default there.
using FoldBlocking = std::conditional_t<(vector_registers >= 32), Blocking<8, 2>, DefaultBlocking>;

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

/// The band of a product whose row t needs only the columns s ≤ t + shift (a lower-
/// triangular C: the intra-chunk pairs of the linear and delta-rule forms). A strip
/// computes the columns its last row needs, rounded out to whole packets.
struct LowerColumns {
    Index shift = 0;
    [[nodiscard]] Range columns(Index row, Index rows, Index cols) const {
        return {0, std::clamp<Index>(row + rows + shift, 0, cols)};
    }
    static constexpr Range terms(Index /*row*/, Index /*rows*/, Index depth) { return {0, depth}; }
};

/// The band of a product whose row t needs only the terms s ≤ t + shift (a lower-triangular
/// A, zero above: the terms skipped add nothing). A strip takes the terms its last row needs.
struct LowerTerms {
    Index shift = 0;
    static constexpr Range columns(Index /*row*/, Index /*rows*/, Index cols) { return {0, cols}; }
    [[nodiscard]] Range terms(Index row, Index rows, Index depth) const {
        return {0, std::clamp<Index>(row + rows + shift, 0, depth)};
    }
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
/// Each strip first steps `ahead` (when given): the caller's next rows towards L2.
template <class T, class B = DefaultBlocking, bool Accumulate = false, class Band = WholeStrip>
void tile_product(Index rows, Index cols, Index depth, const T* a, Index a_row, Index a_k, const T* b, Index ldb,
                  T* c, Index ldc, const T* row_scale, const Band& band = {}, PrefetchQueue* ahead = nullptr) {
    if (rows == 0 || cols == 0)
        return;
    if (depth == 0) {  // C = α ⊙ C or 0 or unchanged: A and B are not read, and may be empty (null)
        a = b = c;
        a_row = a_k = ldb = 0;
    }
    constexpr Index lanes = packet_lanes<T>;
    constexpr Index block = B::packets * lanes;
    // Columns in panels whose rows of B fit in L1 (panel_bytes), panels outermost: every
    // strip of rows then reads B's panel from L1. A B that fits already (the callers'
    // query and value tiles) is one panel, and the order is the row strips'.
    const Index panel = std::max(block, panel_bytes / static_cast<Index>(sizeof(T)) / std::max<Index>(depth, 1) /
                                            block * block);
    for (Index p0 = 0; p0 < cols; p0 += panel) {
        const Index p1 = std::min(cols, p0 + panel);
        const auto strip = [&]<int R>(Index r) {
            const Range columns = band.columns(r, R, cols), terms = band.terms(r, R, depth);
            const Index c0 = std::max(p0, columns.first / lanes * lanes),
                        c1 = std::min(p1, round_up(columns.end, lanes));
            if (c0 >= c1)
                return;
            const Index k0 = std::min(terms.first, terms.end);
            if (ahead != nullptr)
                ahead->step();
            row_strip<R, B::packets, Accumulate>(c1 - c0, terms.end - k0, a + r * a_row + k0 * a_k, a_row, a_k,
                                                 b + k0 * ldb + c0, ldb, c + r * ldc + c0, ldc,
                                                 row_scale ? row_scale + r : nullptr);
        };
        // Row strips inside a panel: a strip of A (Rows × depth) stays in registers and L1
        // while it meets every column of the panel.
        Index r = 0;
        for (; r + B::rows <= rows; r += B::rows)
            strip.template operator()<B::rows>(r);
        if constexpr (B::rows > 1) {
            if (r < rows)
                dispatch<B::rows - 1>(rows - r, [&]<int L>() { strip.template operator()<L>(r); });
        }
    }
}

/// C += A·B (see tile_product).
template <class T, class B = DefaultBlocking>
void tile_product_add(Index rows, Index cols, Index depth, const T* a, Index a_row, Index a_k, const T* b, Index ldb,
                      T* c, Index ldc, PrefetchQueue* ahead = nullptr) {
    tile_product<T, B, true>(rows, cols, depth, a, a_row, a_k, b, ldb, c, ldc, nullptr, WholeStrip{}, ahead);
}

/// Forward substitution in place: rows t = 0, 1, … of U become
///   u_t + Σ_{s<t} M(t, s) u_s      (the new u_s),
/// i.e. U := (I − M)⁻¹ U for M strictly lower-triangular (n × n, row stride ldm; its diagonal
/// and upper part are not read). A block of B::rows rows first takes the finished rows above
/// it in one register-blocked product, then its own rows in order: each u_t adds its terms
/// in ascending s, as the textbook loop does.
template <class T, class B = DefaultBlocking>
void forward_substitution(Index n, Index cols, const T* m, Index ldm, T* u, Index ldu) {
    for (Index r = 0; r < n; r += B::rows) {
        const Index rows = std::min<Index>(B::rows, n - r);
        if (r > 0)
            tile_product_add<T, B>(rows, cols, r, m + r * ldm, ldm, 1, u, ldu, u + r * ldu, ldu);
        for (Index t = r + 1; t < r + rows; ++t)
            tile_product_add<T, B>(1, cols, t - r, m + t * ldm + r, ldm, 1, u + r * ldu, ldu, u + t * ldu, ldu);
    }
}

}  // namespace memattn::detail
