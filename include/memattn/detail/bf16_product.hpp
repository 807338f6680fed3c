#pragma once
// The softmax kernel's two tile products in bfloat16 arithmetic, for CPUs with
// AVX512-BF16 (AMD Zen 4 and 5, Intel Cooper Lake, Sapphire Rapids and later):
//
//   C (rows × cols, float) = α ⊙ C + A (rows × depth) · B (depth × cols)    (α per row)
//   C = post · A · B                                                         (no α)
//
// with A and B bfloat16 and C float. vdpbf16ps multiplies two pairs of bfloat16 per lane
// and adds both products to a float accumulator: per instruction twice the multiply-adds
// of a float FMA on the same register width. So the depth is taken two terms at a time:
//   A(r, k) pairs along k:  the two bfloat16 at a + r·a_row + (k/2)·a_pair (in bfloat16
//                           units) hold terms k and k + 1, lower address first; a row of
//                           K (pairs along the head dimension) and the weights packed by
//                           pack_weight_pairs (pairs along the keys) are both of this form;
//   B pairs along k:        the 32-bit word b[(k/2)·ldb + c] holds B(k, c) in its low half
//                           and B(k + 1, c) in its high half (pack_row_pairs): the query
//                           tile's transpose and each value tile.
// An odd depth ends with one term. Where A's word past it may not be read (a row of K in
// place, whose next element belongs to the next row or lies past the matrix) the last
// term is loaded alone, zero-extended; B's word there holds 0 in its high half.
//
// The arithmetic of vdpbf16ps (Intel's SDM): each product of two bfloat16 is exact in
// float; per lane the two products are added in float, then the accumulator, rounded to
// nearest-even each time; denormal inputs are read as 0 and denormal results written as
// 0 (it does not consult MXCSR). So a dot product of bfloat16 inputs carries float's
// rounding, about one more rounding per two terms than a chain of FMAs: the logits of
// bfloat16 Q and K come out within float's error of the exact dot product. The weights
// P are rounded to bfloat16 before P·V (relative error ≤ 2⁻⁸ each), and the softmax's
// denominator sums the rounded weights (RoundToBf16), so an output is still a convex
// combination of the values: off float's by at most 2⁻⁸/(1 − 2⁻⁸) of the range of the
// values it sees, per column. That is where this arithmetic loses against float
// (docs/design.md §4.7c).
//
// Register blocking, bands, leftover rows and column panels follow tile_product's
// (detail/tile_product.hpp): Rows × Packets accumulators, a micro-tile of exactly the
// rows left over, whole packets left over as one block, the lanes left over as one
// packet under a mask (B's rows are padded to whole packets with zeros, so its loads
// stay whole). A band's depth range is rounded out to whole pairs: the terms it adds
// that way have A = 0 (the weights of keys no query of the strip sees), and x + 0·b is x
// for every finite b.
//
// A build that does not target AVX512-BF16 compiles these products by target
// (detail/isa_regions.hpp: MEMATTN_BF16_DISPATCH) and runs them where the CPU has it
// (avx512_bf16_runs()): a portable build's bfloat16 kernel takes them on Zen 4/5 and on
// Xeons, and converts to float elsewhere.

#include "memattn/detail/isa_regions.hpp"
#include "memattn/detail/tile_product.hpp"
#include "memattn/types.hpp"

#include <bit>
#include <cstdint>
#include <cstring>

namespace memattn::detail {

/// This build targets AVX512-BF16: bfloat16 inputs of the softmax kernel always run its
/// products by vdpbf16ps. Elsewhere they do where avx512_bf16_runs() (the products
/// compiled by target, avx512_bf16_code), and are converted to float tile by tile and run
/// the float products where it does not.
#if defined(MEMATTN_BF16_DOT)
inline constexpr bool bf16_dot = true;
#else
inline constexpr bool bf16_dot = false;
#endif

/// f.template operator()<true>() where the bfloat16 products run here, else
/// f.template operator()<false>(): a kernel's instantiation on bfloat16 pairs is chosen at
/// compile time where the build targets AVX512-BF16 (the other is not compiled), at run
/// time where the products are compiled by target (avx512_bf16_runs()), and never where
/// they are not compiled at all.
template <class F>
decltype(auto) with_bf16_products(F&& f) {
    if constexpr (bf16_dot)
        return f.template operator()<true>();
    else if constexpr (avx512_bf16_code) {
        if (avx512_bf16_runs())
            return f.template operator()<true>();
        return f.template operator()<false>();
    } else
        return f.template operator()<false>();
}

/// The two bfloat16 at p (bits), lower address in the low half: one 32-bit word.
inline std::uint32_t load_pair(const std::uint16_t* p) noexcept {
    std::uint32_t word;
    std::memcpy(&word, p, sizeof word);
    return word;
}

/// Weights rounded to bfloat16 (nearest even) and widened back: SoftmaxBlockState::absorb's
/// `round`, so the denominator sums the weights P·V multiplies. A scalar lane takes
/// Eigen's conversion, also nearest even (no weight is denormal: exp2_nonpositive gives 0
/// below 2⁻¹²⁵); a packet of the build's width vcvtneps2bf16 where the build has it, else
/// the same rounding in integer lanes (the bits plus 0x7FFF plus the lowest kept bit, the
/// low half cleared; a NaN kept as it is), so a portable build's weights are the same.
struct RoundToBf16 {
#if defined(MEMATTN_BF16_DOT)
    __m512 operator()(__m512 x) const noexcept { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(x)); }
#endif
    float operator()(float x) const noexcept { return static_cast<float>(Eigen::bfloat16(x)); }
    template <class P>
        requires(!std::is_same_v<P, float>)
    P operator()(const P& x) const noexcept {
        namespace ei = Eigen::internal;
        using I = typename ei::unpacket_traits<P>::integer_packet;
        const I bits = ei::preinterpret<I>(x);
        const I lowest_kept = ei::pand(ei::plogical_shift_right<16>(bits), ei::pset1<I>(1));
        const I rounded = ei::pand(ei::padd(ei::padd(bits, ei::pset1<I>(0x7FFF)), lowest_kept),
                                   ei::pset1<I>(static_cast<int>(0xFFFF0000u)));
        return ei::pselect(ei::pcmp_eq(x, x), ei::preinterpret<P>(rounded), x);
    }
};

#if defined(MEMATTN_AVX512_BF16_CODE)
MEMATTN_AVX512_BF16_BEGIN

/// Floats per packet of the bfloat16 products (one 512-bit register).
inline constexpr Index bf16_lanes = 16;

/// One micro-tile: Rows × Packets packets of C. `pairs` whole pairs of depth, then, when
/// `single`, one more term read alone from A. Tail: the last packet has `tail` lanes.
template <int Rows, int Packets, bool Tail>
inline void bf16_micro_tile(Index pairs, bool single, const std::uint16_t* a, Index a_row, Index a_pair,
                            const std::uint32_t* b, Index ldb, float* c, Index ldc, const float* row_scale, float post,
                            __mmask16 tail) {
    __m512 acc[Rows][Packets];
    for (int r = 0; r < Rows; ++r)
        for (int p = 0; p < Packets; ++p) {
            const __mmask16 m = Tail && p == Packets - 1 ? tail : __mmask16(0xFFFF);
            acc[r][p] = row_scale ? _mm512_mul_ps(_mm512_set1_ps(row_scale[r]),
                                                  _mm512_maskz_loadu_ps(m, c + r * ldc + p * bf16_lanes))
                                  : _mm512_setzero_ps();
        }
    // No lambda here passes a vector, nor std::bit_cast: where this is compiled by
    // target, a function defined outside the region may not (detail/isa_regions.hpp).
    const auto step = [&](Index k, bool alone) {
        __m512bh bk[Packets];
        for (int p = 0; p < Packets; ++p)
            bk[p] = (__m512bh)_mm512_loadu_si512(b + k * ldb + p * bf16_lanes);
        for (int r = 0; r < Rows; ++r) {
            const std::uint16_t* at = a + r * a_row + k * a_pair;
            const auto word = static_cast<int>(alone ? std::uint32_t{*at} : load_pair(at));
            const __m512bh ark = (__m512bh)_mm512_set1_epi32(word);
            for (int p = 0; p < Packets; ++p)
                acc[r][p] = _mm512_dpbf16_ps(acc[r][p], ark, bk[p]);  // C(r, :) += A(r, k..k+1) · B(k..k+1, :)
        }
    };
    for (Index k = 0; k < pairs; ++k)
        step(k, false);
    if (single)
        step(pairs, true);
    const __m512 scale = _mm512_set1_ps(post);
    for (int r = 0; r < Rows; ++r)
        for (int p = 0; p < Packets; ++p) {
            const __mmask16 m = Tail && p == Packets - 1 ? tail : __mmask16(0xFFFF);
            _mm512_mask_storeu_ps(c + r * ldc + p * bf16_lanes, m, row_scale ? acc[r][p] : _mm512_mul_ps(acc[r][p], scale));
        }
}

/// One strip of Rows rows across `cols` columns: Packets-wide blocks, the whole packets
/// left over as one block, then the lanes left over as one masked packet.
template <int Rows, int Packets>
inline void bf16_row_strip(Index cols, Index pairs, bool single, const std::uint16_t* a, Index a_row, Index a_pair,
                           const std::uint32_t* b, Index ldb, float* c, Index ldc, const float* row_scale, float post) {
    constexpr Index block = Packets * bf16_lanes;
    Index j = 0;
    for (; j + block <= cols; j += block)
        bf16_micro_tile<Rows, Packets, false>(pairs, single, a, a_row, a_pair, b + j, ldb, c + j, ldc, row_scale, post, 0);
    const Index whole = (cols - j) / bf16_lanes, lanes = cols - j - whole * bf16_lanes;
    if (lanes == 0 && whole > 0)
        dispatch<Packets>(whole, [&]<int L>() {
            bf16_micro_tile<Rows, L, false>(pairs, single, a, a_row, a_pair, b + j, ldb, c + j, ldc, row_scale, post, 0);
        });
    else if (lanes > 0)  // the whole packets and the masked one in one block
        dispatch<Packets>(whole + 1, [&]<int L>() {
            bf16_micro_tile<Rows, L, true>(pairs, single, a, a_row, a_pair, b + j, ldb, c + j, ldc, row_scale, post,
                                           static_cast<__mmask16>((1u << lanes) - 1));
        });
}

/// C = diag(row_scale)·C + A·B, or C = post·A·B when row_scale is null (see the top of the
/// file); depth in terms. A_padded: A's word past an odd depth may be read (and its high
/// half is 0). The strip of rows [r, r + R) computes only columns band.columns(r, R, cols)
/// (rounded out to whole packets) and the pairs holding band.terms(r, R, depth). Each
/// strip first steps `ahead` (when given).
template <class B = DefaultBlocking, bool APadded = false, class Band = WholeStrip>
void bf16_product(Index rows, Index cols, Index depth, const std::uint16_t* a, Index a_row, Index a_pair,
                  const std::uint32_t* b, Index ldb, float* c, Index ldc, const float* row_scale, float post,
                  const Band& band = {}, PrefetchQueue* ahead = nullptr) {
    if (rows == 0 || cols == 0)
        return;
    constexpr Index block = B::packets * bf16_lanes;
    const Index all_pairs = (depth + 1) / 2;
    const Index panel =
        std::max(block, panel_bytes / Index{4} / std::max<Index>(all_pairs, 1) / block * block);
    for (Index p0 = 0; p0 < cols; p0 += panel) {
        const Index p1 = std::min(cols, p0 + panel);
        const auto strip = [&]<int R>(Index r) {
            const Range columns = band.columns(r, R, cols), terms = band.terms(r, R, depth);
            const Index c0 = std::max(p0, columns.first / bf16_lanes * bf16_lanes),
                        c1 = std::min(p1, round_up(columns.end, bf16_lanes));
            if (c0 >= c1)
                return;
            Index k0 = std::min(terms.first, terms.end) / 2, k1 = (terms.end + 1) / 2;
            bool single = false;
            if (!APadded && depth % 2 == 1 && k1 == all_pairs && k1 > k0) {
                --k1;  // the last term alone
                single = true;
            }
            if (ahead != nullptr)
                ahead->step();
            bf16_row_strip<R, B::packets>(c1 - c0, k1 - k0, single, a + r * a_row + k0 * a_pair, a_row, a_pair,
                                          b + k0 * ldb + c0, ldb, c + r * ldc + c0, ldc,
                                          row_scale ? row_scale + r : nullptr, post);
        };
        Index r = 0;
        for (; r + B::rows <= rows; r += B::rows)
            strip.template operator()<B::rows>(r);
        if constexpr (B::rows > 1) {
            if (r < rows)
                dispatch<B::rows - 1>(rows - r, [&]<int L>() { strip.template operator()<L>(r); });
        }
    }
}

/// Sixteen floats rounded to bfloat16 (nearest even; vcvtneps2bf16), each in the low half
/// of a 32-bit lane.
inline __m512i bf16_words(__m512 x) noexcept {
    return _mm512_maskz_cvtepu16_epi32(0xFFFF, (__m256i)_mm512_cvtneps_pbh(x));
}

/// The weights of a tile as A pairs along the keys: out[(j/2)·lanes + i] holds
/// bfloat16(p(j, i)) in its low half and bfloat16(p(j + 1, i)) in its high half (0 past
/// the n keys), for keys j < n and lanes i < cols (a multiple of 16); p row-major, row
/// stride `lanes`. Read as A(i, j) with a_row = 2, a_pair = 2·lanes.
inline void pack_weight_pairs(const float* p, Index n, Index cols, Index lanes, std::uint32_t* out) {
    for (Index j = 0; j < n; j += 2) {
        const float* lo = p + j * lanes;
        const float* hi = lo + lanes;
        std::uint32_t* row = out + (j / 2) * lanes;
        for (Index i = 0; i < cols; i += bf16_lanes) {
            const __m512i low = bf16_words(_mm512_loadu_ps(lo + i));
            const __m512i high = j + 1 < n ? bf16_words(_mm512_loadu_ps(hi + i)) : _mm512_setzero_si512();
            _mm512_storeu_si512(row + i, _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
        }
    }
}

/// pack_row_pairs' whole packets of 16 columns of one pair row, from column 0: the columns
/// packed (a multiple of 16); `bad` set where a value is not finite.
inline Index pack_row_pairs_wide(const std::uint16_t* lo, const std::uint16_t* hi, Index cols, std::uint32_t* row,
                                 std::uint32_t& bad) {
    const __m512i exponent = _mm512_set1_epi32(0x7F807F80);
    Index c = 0;
    for (; c + bf16_lanes <= cols; c += bf16_lanes) {
        const __m512i low =
            _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + c)));
        const __m512i high =
            hi ? _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + c)))
               : _mm512_setzero_si512();
        const __m512i word = _mm512_or_si512(low, _mm512_slli_epi32(high, 16));
        bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(word, exponent), exponent) != 0;
        _mm512_storeu_si512(row + c, word);
    }
    return c;
}

MEMATTN_AVX512_BF16_END
#else
// Declared only, for code that names them where the products are not compiled (never
// called).
template <class B = DefaultBlocking, bool APadded = false, class Band = WholeStrip>
void bf16_product(Index rows, Index cols, Index depth, const std::uint16_t* a, Index a_row, Index a_pair,
                  const std::uint32_t* b, Index ldb, float* c, Index ldc, const float* row_scale, float post,
                  const Band& band = {}, PrefetchQueue* ahead = nullptr);
void pack_weight_pairs(const float* p, Index n, Index cols, Index lanes, std::uint32_t* out);
#endif  // MEMATTN_AVX512_BF16_CODE

/// A value tile's pairs kept by a row source for the tiled kernel (PagedPairRows: the
/// query heads of one KV head walk the same value tiles, so the first packs and the
/// others read): `words` where they go (pack_row_pairs' layout), `state` 0 while not yet
/// packed, 1 packed, 2 packed and not all finite. None (`words` null): pack into the
/// kernel's own scratch.
struct PackedValueTile {
    std::uint32_t* words = nullptr;
    std::uint8_t* state = nullptr;
};

/// A packed value row's words (pack_row_pairs' ldo as the tiled kernel packs them: dv
/// rounded up to a 16-lane packet), and the words of a packed tile of `keys` values.
constexpr Index packed_value_stride(Index dv) { return round_up(dv, 16); }
constexpr Index packed_value_words(Index keys, Index dv) { return (keys + 1) / 2 * packed_value_stride(dv); }

/// Rows of bfloat16 bits as B pairs: out[(j/2)·ldo + c] holds x(j, c) in its low half and
/// x(j + 1, c) in its high half, for j < n (0 past n) and c < cols; columns [cols, ldo)
/// are 0. x row-major with row stride ldx. Returns false when a value is not finite (an
/// exponent of all ones): the caller keeps a masked weight of 0 from meeting it. `wide`:
/// whole packets of 16 columns by AVX-512 (only where avx512_bf16_runs()).
inline bool pack_row_pairs(const std::uint16_t* x, Index n, Index cols, Index ldx, std::uint32_t* out, Index ldo,
                           [[maybe_unused]] bool wide) {
    std::uint32_t bad = 0;
    for (Index j = 0; j < n; j += 2) {
        const std::uint16_t* lo = x + j * ldx;
        const std::uint16_t* hi = j + 1 < n ? lo + ldx : nullptr;
        std::uint32_t* row = out + (j / 2) * ldo;
        Index c = 0;
#if defined(MEMATTN_AVX512_BF16_CODE)
        if (wide)
            c = pack_row_pairs_wide(lo, hi, cols, row, bad);
#endif
        for (; c < cols; ++c) {
            const std::uint32_t word = lo[c] | (hi ? std::uint32_t{hi[c]} << 16 : 0u);
            bad |= (word & 0x7F80u) == 0x7F80u || (word & 0x7F800000u) == 0x7F800000u;
            row[c] = word;
        }
        for (; c < ldo; ++c)
            row[c] = 0;
    }
    return bad == 0;
}

}  // namespace memattn::detail
