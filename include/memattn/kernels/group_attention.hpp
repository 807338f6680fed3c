#pragma once
// A group of queries (the query heads of one KV head) against runs of stored pairs, each
// row read once for the group (kernels/decode_attention.hpp describes the routes and
// their measurements): the tiles of a few queries (logit_tiles, value_tiles), the logit
// options of a decode step (DecodeLogits), and GroupAttention.

#include "memattn/detail/amx_product.hpp"
#include "memattn/detail/bf16_product.hpp"
#include "memattn/kernels/group_amx.hpp"
#include "memattn/kernels/query_attention.hpp"
#include "memattn/storage/bf16_words.hpp"

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>

namespace memattn::detail {

// The grouped logits of a few queries (fewer than a packet's lanes): tiles of
// GQ queries × GK keys with GQ·GK = lanes, one packet accumulator per (query, key) pair
// summing along the head dim, and then the lanes of all of a tile's accumulators added
// at once by one transpose-and-add network (lanes − 1 additions and twice as many
// shuffles for lanes sums) instead of one horizontal reduction per pair. Every sum has
// the same tree whatever the tile and the lane it lands in: first lanes (e, e + lanes/2),
// then (e, e + lanes/4), ..., so a query's logits do not depend on the group it is in.
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // packets as template arguments (see packet.hpp)
#endif
#if defined(MEMATTN_AVX512_CODE)
MEMATTN_AVX512_BEGIN
/// Lane ℓ of the result is the sum of the lanes of a[tile_slot_16(ℓ)]: the tiles of 16
/// lanes (AVX-512 builds' float tiles, and the bfloat16 tiles in every build that
/// compiles them). Inlined always: a call would take the sixteen accumulators through
/// memory.
[[gnu::always_inline]] inline __m512 sum_lanes_16(const __m512 (&a)[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)  // 256-bit halves: lanes e + e+8 of a[2i], then of a[2i+1]
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i)  // 128-bit quarters: + e+4, one input each
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)  // + e+2, two inputs per quarter
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));  // + e+1
}
MEMATTN_AVX512_END
#endif
/// The accumulator whose sum lands in lane ℓ of sum_lanes_16: lane 4q + m holds a[4m + q].
constexpr int tile_slot_16(int lane) { return lane % 4 * 4 + lane / 4; }

#if defined(EIGEN_VECTORIZE_AVX512) && defined(MEMATTN_AVX512_NATIVE)
/// Lane ℓ of the result is the sum of the lanes of a[tile_slot(ℓ)].
[[gnu::always_inline]] inline Packet<float> sum_lanes(const Packet<float> (&a)[16]) { return sum_lanes_16(a); }
constexpr int tile_slot(int lane) { return tile_slot_16(lane); }
inline constexpr bool decode_tiles = fused_storage;
#elif !defined(EIGEN_VECTORIZE_AVX512) && defined(EIGEN_VECTORIZE_AVX2) && defined(EIGEN_VECTORIZE_FMA)
inline Packet<float> sum_lanes(const Packet<float> (&a)[8]) {
    __m256 b[4], c[2];
    for (int i = 0; i < 4; ++i)  // 128-bit halves: lanes e + e+4 of a[2i], then of a[2i+1]
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    for (int i = 0; i < 2; ++i)  // + e+2
        c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    return _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xDD));  // + e+1
}
/// Lane 4h + m holds a[2m + h].
constexpr int tile_slot(int lane) { return lane % 4 * 2 + lane / 4; }
inline constexpr bool decode_tiles = fused_storage;
#else
/// Elsewhere the same sums one lane at a time (the route is not taken: decode_tiles).
template <class P, int N>
P sum_lanes(const P (&a)[N]) {
    using T = typename Eigen::internal::unpacket_traits<P>::type;
    constexpr int lanes = Eigen::internal::unpacket_traits<P>::size;
    alignas(64) T out[lanes], x[lanes];
    for (int i = 0; i < lanes; ++i) {
        Eigen::internal::pstoreu(x, a[i]);
        for (int w = lanes / 2; w > 0; w /= 2)
            for (int e = 0; e < w; ++e)
                x[e] += x[e + w];
        out[i] = x[0];
    }
    return Eigen::internal::ploadu<P>(out);
}
constexpr int tile_slot(int lane) { return lane; }
inline constexpr bool decode_tiles = false;
#endif
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

/// Rows of float read in place (a run of a cache's own rows), with the interface of
/// StoredRows' stored_packet and stored_value.
struct InPlaceRows {
    const float* data;
    Index stride, cols;
    void prefetch_row(Index r) const { prefetch_rows(data + r * stride, 1, 0, cols); }
    [[nodiscard]] Packet<float> stored_packet(Index r, Index c) const {
        return Eigen::internal::ploadu<Packet<float>>(data + r * stride + c);
    }
    [[nodiscard]] float stored_value(Index r, Index c) const { return data[r * stride + c]; }
};

/// Rows of a numbers route read as their values divided by number_factor (exactly: a power
/// of two, and no stored value is so small that the quotient rounds), for the float
/// tiles: their queries or weights are multiplied by the factor instead, so each product
/// is the same number and rounds the same (GroupAttention::fold_stored).
template <number_rows Rows>
struct NumberRows {
    const Rows& rows;
    void prefetch_row(Index r) const { rows.prefetch_row(r); }
    [[nodiscard]] Packet<float> stored_packet(Index r, Index c) const { return rows.number_packet(r, c); }
    [[nodiscard]] float stored_value(Index r, Index c) const { return rows.stored_value(r, c) / Rows::number_factor; }
};

template <class Rows>
inline constexpr bool number_view = false;
template <class Rows>
inline constexpr bool number_view<NumberRows<Rows>> = true;

/// s (GQ rows, stride lds) = q (GQ rows of d values, stride ldq, zero-padded to whole
/// packets, aligned) · K_jᵀ for the keys j ∈ [first, first + m) of `keys`
/// (stored_packet/stored_value), GK = lanes / GQ keys per tile. Each tile asks for the
/// key rows `ahead` rows on (below `end`) and for its own rows of `values` (towards L2,
/// where value_tiles reads them next).
template <int GQ, class Keys, class Values>
void logit_tiles(const Keys& keys, const Values& values, Index first, Index m, Index d, const float* q, Index ldq,
                 float* s, Index lds, Index ahead, Index end) {
    using namespace Eigen::internal;
    using P = Packet<float>;
    constexpr int lanes = static_cast<int>(packet_lanes<float>), GK = lanes / GQ;
    static_assert(GQ * GK == lanes);
    const Index packed = d / lanes * lanes;
    for (Index j = 0; j < m; j += GK) {
        Index row[GK];  // a tile past the end repeats the last key, and drops its sums
        for (int k = 0; k < GK; ++k)
            row[k] = first + std::min<Index>(j + k, m - 1);
        prefetch_tile(keys, values, first + j, std::min(first + j + GK, first + m), ahead, end);
        P acc[lanes];
        for (int i = 0; i < lanes; ++i)
            acc[i] = pset1<P>(0.0f);
        for (Index c = 0; c < packed; c += lanes) {
            P qp[GQ];
            for (int r = 0; r < GQ; ++r)
                qp[r] = pload<P>(q + r * ldq + c);
            for (int k = 0; k < GK; ++k) {
                const P kp = keys.stored_packet(row[k], c);
                for (int r = 0; r < GQ; ++r)
                    acc[tile_slot(r * GK + k)] = pmadd(qp[r], kp, acc[tile_slot(r * GK + k)]);
            }
        }
        if (packed < d) {  // the last, partial packet: zeros past d on both sides
            for (int k = 0; k < GK; ++k) {
                alignas(64) float tail[lanes] = {};
                for (Index c = packed; c < d; ++c)
                    tail[c - packed] = keys.stored_value(row[k], c);
                const P kp = pload<P>(tail);
                for (int r = 0; r < GQ; ++r)
                    acc[tile_slot(r * GK + k)] = pmadd(pload<P>(q + r * ldq + packed), kp, acc[tile_slot(r * GK + k)]);
            }
        }
#if defined(EIGEN_VECTORIZE_AVX512)
        // Lanes r·GK .. r·GK + n − 1 hold query r's logits: one masked store per query.
        const Packet<float> sums = sum_lanes(acc);
        const auto n = static_cast<int>(std::min<Index>(GK, m - j));
        for (int r = 0; r < GQ; ++r)
            _mm512_mask_storeu_ps(s + r * lds + j - r * GK, static_cast<__mmask16>(((1u << n) - 1) << (r * GK)), sums);
#else
        alignas(64) float sums[lanes];
        pstore(sums, sum_lanes(acc));
        const Index n = std::min<Index>(GK, m - j);
        for (int r = 0; r < GQ; ++r)
            for (Index k = 0; k < n; ++k)
                s[r * lds + j + k] = sums[r * GK + k];
#endif
    }
}

/// out (GQ rows of dv, stride ldo) = α ⊙ out + P·V_j for the values j ∈ [first, first + m)
/// of `values` and the weights P (GQ rows, stride lds): register tiles of GQ rows and up
/// to lanes/GQ packets, every value packet converted once for the GQ rows. Each output
/// element adds its terms in order of j, one fused multiply-add each.
template <int GQ, class Values>
void value_tiles(const Values& values, Index first, Index m, Index dv, const float* p, Index lds, const float* alpha,
                 float* out, Index ldo) {
    using namespace Eigen::internal;
    using P = Packet<float>;
    constexpr Index lanes = packet_lanes<float>;
    constexpr int width = std::clamp(static_cast<int>(lanes) / GQ, 1, 8);
    const Index packed = dv / lanes * lanes;
    for (Index c0 = 0; c0 < packed; c0 += width * lanes) {
        dispatch<width>(std::min<Index>(width, (packed - c0) / lanes), [&]<int Packets>() {
            P acc[GQ][Packets];
            for (int r = 0; r < GQ; ++r)
                for (int k = 0; k < Packets; ++k)
                    acc[r][k] = pmul(pset1<P>(alpha[r]), ploadu<P>(out + r * ldo + c0 + k * lanes));
            for (Index j = 0; j < m; ++j) {
                P v[Packets];
                for (int k = 0; k < Packets; ++k)
                    v[k] = values.stored_packet(first + j, c0 + k * lanes);
                for (int r = 0; r < GQ; ++r) {
                    const P w = pset1<P>(p[r * lds + j]);
                    for (int k = 0; k < Packets; ++k)
                        acc[r][k] = pmadd(w, v[k], acc[r][k]);
                }
            }
            for (int r = 0; r < GQ; ++r)
                for (int k = 0; k < Packets; ++k)
                    pstoreu(out + r * ldo + c0 + k * lanes, acc[r][k]);
        });
    }
    for (Index c = packed; c < dv; ++c)
        for (int r = 0; r < GQ; ++r) {
            float x = alpha[r] * out[r * ldo + c];
            for (Index j = 0; j < m; ++j)
                x = std::fma(p[r * lds + j], values.stored_value(first + j, c), x);
            out[r * ldo + c] = x;
        }
}

#if defined(MEMATTN_GROUP_BF16)
// Loops over a tile's registers unrolled whole: GCC 12 otherwise may keep a tile's
// accumulator arrays in memory, a store per multiply-add (measured: 1.3x the time).
#define MEMATTN_UNROLL _Pragma("GCC unroll 16")
// The same two tiles in bfloat16 arithmetic (FpMath::bf16 over rows stored as bfloat16
// or FP8; detail/bf16_product.hpp has vdpbf16ps's arithmetic): the queries rounded to
// bfloat16 once, the weights rounded before P·V, the stored values multiplied as they
// are (an FP8 value is a bfloat16 one: Bf16Words), two terms per float lane and
// instruction. Tiles of 16 lanes in every build: compiled by target where the build
// does not have AVX512-BF16 (detail/isa_regions.hpp), so nothing here passes a vector
// through a function defined outside the region (no std::bit_cast of one).
MEMATTN_AVX512_BF16_BEGIN

/// out (g rows of `depth` bfloat16 bits, a multiple of 32) = the rows of q (g × d, row
/// stride ldq) rounded to bfloat16 (nearest even), zero from d on.
inline void round_queries_bf16(const float* q, Index ldq, Index g, Index d, Index depth, std::uint16_t* out) noexcept {
    for (Index r = 0; r < g; ++r)
        for (Index k = 0; k < depth; k += 16) {
            const auto mask = static_cast<__mmask16>(k + 16 <= d ? 0xFFFF : k < d ? (1u << (d - k)) - 1 : 0);
            const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, q + r * ldq + k));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * depth + k), (__m256i)b);
        }
}

/// s (GQ rows, stride lds) = scale · (q · K_jᵀ) for the keys j ∈ [first, first + m) of
/// `keys` (bfloat16 or FP8 rows, read by Bf16Words): q is GQ rows of bfloat16 bits
/// (stride ldq words, zero-padded to whole 32-word packets), pairs along the head dim as
/// the rows are stored; the tiles, the lanes' sums and the prefetches are logit_tiles'.
/// A row's values past d are not read (masked loads), so they need not be finite.
template <int GQ, class Keys, class Values>
void logit_tiles_bf16(const Keys& keys, const Values& values, Index first, Index m, Index d, const std::uint16_t* q,
                      Index ldq, float scale, float* s, Index lds, Index ahead, Index end) {
    constexpr int lanes = 16, GK = lanes / GQ;
    static_assert(GQ * GK == lanes);
    const Index whole = d / 32 * 32;
    const auto rest = static_cast<__mmask32>((std::uint64_t(1) << (d - whole)) - 1);
    using Words = Bf16Words<typename stored_format<Keys>::type>;
    for (Index j = 0; j < m; j += GK) {
        const void* row[GK];  // a tile past the end repeats the last key, and drops its sums
        for (int k = 0; k < GK; ++k)
            row[k] = Words::row(keys, first + std::min<Index>(j + k, m - 1));
        prefetch_tile(keys, values, first + j, std::min(first + j + GK, first + m), ahead, end);
        __m512 acc[lanes];
        for (int i = 0; i < lanes; ++i)
            acc[i] = _mm512_setzero_ps();
        for (Index c = 0; c < whole; c += 32)
            for (int k = 0; k < GK; ++k) {
                const auto kp = (__m512bh)Words::load(row[k], c, ~__mmask32(0));
                for (int r = 0; r < GQ; ++r)
                    acc[tile_slot_16(r * GK + k)] = _mm512_dpbf16_ps(
                        acc[tile_slot_16(r * GK + k)], (__m512bh)_mm512_load_si512(q + r * ldq + c), kp);
            }
        if (rest != 0)
            for (int k = 0; k < GK; ++k) {
                const auto kp = (__m512bh)Words::load(row[k], whole, rest);
                for (int r = 0; r < GQ; ++r)
                    acc[tile_slot_16(r * GK + k)] = _mm512_dpbf16_ps(
                        acc[tile_slot_16(r * GK + k)], (__m512bh)_mm512_load_si512(q + r * ldq + whole), kp);
            }
        // Lanes r·GK .. r·GK + n − 1 hold query r's logits: one masked store per query.
        const __m512 sums = _mm512_mul_ps(sum_lanes_16(acc), _mm512_set1_ps(scale));
        const auto n = static_cast<int>(std::min<Index>(GK, m - j));
        for (int r = 0; r < GQ; ++r)
            _mm512_mask_storeu_ps(s + r * lds + j - r * GK, static_cast<__mmask16>(((1u << n) - 1) << (r * GK)), sums);
    }
}

/// x[0, n) rounded to bfloat16 (nearest even, as Eigen's cast) in place, and the same
/// values as bfloat16 into w[0, n): the weights of value_tiles_bf16, summed as rounded.
inline void round_weights_bf16(float* x, Index n, Eigen::bfloat16* w) noexcept {
    Index i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + i), (__m256i)b);
        _mm512_storeu_ps(x + i, _mm512_cvtpbh_ps(b));
    }
    if (i < n) {
        const auto mask = static_cast<__mmask16>((1u << (n - i)) - 1);
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x + i));
        _mm256_mask_storeu_epi16(w + i, mask, (__m256i)b);
        _mm512_mask_storeu_ps(x + i, mask, _mm512_cvtpbh_ps(b));
    }
}

/// out (GQ rows of dv, stride ldo) = α ⊙ out + P·V_j for the values j ∈ [first, first + m)
/// of `values` (bfloat16 or FP8 rows, read by Bf16Words) and the weights in bfloat16 w (GQ rows of m values, stride
/// ldw, even; w[m], past an odd m, is 0): two keys per vdpbf16ps, their rows interleaved
/// into pairs (unpacklo/hi_epi16: the pairs of columns 0–3 and 4–7 of each 128-bit
/// lane), so each accumulator holds a fixed permutation of 16 output columns, undone as
/// the tile is stored. An odd m pairs its last row with zeros; a row's words past dv are
/// not read. Each output element adds its terms two keys at a time, in order of j.
template <int GQ, class Values>
void value_tiles_bf16(const Values& values, Index first, Index m, Index dv, const Eigen::bfloat16* w, Index ldw,
                      const float* alpha, float* out, Index ldo) {
    constexpr int width = GQ >= 8 ? 1 : GQ >= 4 ? 2 : 4;  // 32-column chunks per tile: 2·GQ·width ≤ 16 accumulators
    using Words = Bf16Words<typename stored_format<Values>::type>;
    const Index chunks = (dv + 31) / 32;
    // Lane ℓ of the "lo" accumulator holds column 8⌊ℓ/4⌋ + ℓ mod 4 of the chunk, of "hi" 4 more.
    const __m512i lo_columns = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i hi_columns = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    // Columns 0–15 and 16–31 of the chunk from (lo, hi): index ℓ < 16 reads lo, 16 + ℓ hi.
    const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const auto row_mask = [dv](Index c) {  // the words of columns [c, c + 32) below dv
        return dv - c >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((std::uint64_t(1) << (dv - c)) - 1);
    };
    const auto half_mask = [dv](Index c) {  // the floats of columns [c, c + 16) below dv
        return dv - c >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>(dv > c ? (1u << (dv - c)) - 1 : 0);
    };
    for (Index c0 = 0; c0 < chunks; c0 += width) {
        dispatch<width>(std::min<Index>(width, chunks - c0), [&]<int Chunks>() {
            __m512 lo[GQ][Chunks], hi[GQ][Chunks];
            MEMATTN_UNROLL
            for (int r = 0; r < GQ; ++r) {
                const __m512 a = _mm512_set1_ps(alpha[r]);
                for (int k = 0; k < Chunks; ++k) {
                    const Index c = (c0 + k) * 32;
                    const __m512 x = _mm512_mul_ps(a, _mm512_maskz_loadu_ps(half_mask(c), out + r * ldo + c));
                    const __m512 y = _mm512_mul_ps(a, _mm512_maskz_loadu_ps(half_mask(c + 16), out + r * ldo + c + 16));
                    lo[r][k] = _mm512_permutex2var_ps(x, lo_columns, y);
                    hi[r][k] = _mm512_permutex2var_ps(x, hi_columns, y);
                }
            }
            for (Index j = 0; j < m; j += 2) {
                const void* x = Words::row(values, first + j);
                const void* y = j + 1 < m ? Words::row(values, first + j + 1) : nullptr;
                __m512bh va[Chunks], vb[Chunks];
                MEMATTN_UNROLL
                for (int k = 0; k < Chunks; ++k) {
                    const Index c = (c0 + k) * 32;
                    const __mmask32 mask = row_mask(c);
                    const __m512i a = Words::load(x, c, mask);
                    const __m512i b = y != nullptr ? Words::load(y, c, mask) : _mm512_setzero_si512();
                    va[k] = (__m512bh)_mm512_unpacklo_epi16(a, b);
                    vb[k] = (__m512bh)_mm512_unpackhi_epi16(a, b);
                }
                MEMATTN_UNROLL
                for (int r = 0; r < GQ; ++r) {
                    std::uint32_t pair;
                    std::memcpy(&pair, w + r * ldw + j, sizeof pair);
                    const auto p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
                    MEMATTN_UNROLL
                    for (int k = 0; k < Chunks; ++k) {
                        lo[r][k] = _mm512_dpbf16_ps(lo[r][k], va[k], p);
                        hi[r][k] = _mm512_dpbf16_ps(hi[r][k], vb[k], p);
                    }
                }
            }
            MEMATTN_UNROLL
            for (int r = 0; r < GQ; ++r)
                for (int k = 0; k < Chunks; ++k) {
                    const Index c = (c0 + k) * 32;
                    _mm512_mask_storeu_ps(out + r * ldo + c, half_mask(c),
                                          _mm512_permutex2var_ps(lo[r][k], first_half, hi[r][k]));
                    _mm512_mask_storeu_ps(out + r * ldo + c + 16, half_mask(c + 16),
                                          _mm512_permutex2var_ps(lo[r][k], second_half, hi[r][k]));
                }
        });
    }
}

MEMATTN_AVX512_BF16_END
#undef MEMATTN_UNROLL
#endif

/// f.template operator()<GQ>(r0) over the rows [0, g) in chunks of powers of two below
/// `Lanes` (the float tiles': a packet's; the bfloat16 tiles': 8 or 16, fold_bf16), largest first.
template <int Lanes = packet_lanes<float>, class F>
void for_query_tiles(Index g, F&& f) {
    Index r0 = 0;
    [&]<int... I>(std::integer_sequence<int, I...>) {
        const auto chunks = [&]<int GQ>() {
            if constexpr (GQ < Lanes)
                for (; g - r0 >= GQ; r0 += GQ)
                    f.template operator()<GQ>(r0);
        };
        (chunks.template operator()<(8 >> I)>(), ...);
    }(std::make_integer_sequence<int, 4>{});
}

/// Grouped attend: at most `group_rows` queries and `group_keys` keys per step.
inline constexpr Index group_rows = 16;
inline constexpr Index group_keys = 128;

/// Stored bytes of K and V from which a grouped attend asks for its rows ahead: past the
/// L2, rows come from L3 or DRAM. Measured (bench/decode_bench.cpp, AMD EPYC family 25
/// model 17, a 32/8 × 128 layer, bfloat16 and float): from DRAM, asking for key rows 4 KiB
/// ahead and for a block's value rows while its logits are computed halves the step
/// (bfloat16 at 32768 tokens: 17.5 → 9.8 ms; float at 4096: 3.0 → 1.9 ms); on pairs that
/// sit in L3 it costs 10–12% (8/1 × 128 at 4096 tokens). On an Intel Xeon (family 6
/// model 167): bfloat16 at 32,768 tokens 18.3 → 11.4 ms; in L3 (4,096 tokens, 16 MiB)
/// 5–9%, and 40% in AMX tiles (a pool's sequence of 4,096 tokens). The rule is a head's
/// bytes, not the step's: in a model the other layers' steps evict a layer's pairs before
/// its next step, so they come from DRAM even where one layer's would fit in L3 (as in a
/// benchmark that steps one layer over and over, where the requests then cost).
inline constexpr std::size_t group_prefetch_bytes = std::size_t(1) << 20;

/// True when the runs a memory's for_each_stored_run gives hold at least
/// group_prefetch_bytes of K and V.
template <class ForEachRun>
bool beyond_l2(const ForEachRun& for_each_stored_run) {
    std::size_t bytes = 0;
    for_each_stored_run([&bytes](const auto& keys, const auto& values, Index, Index n) {
        bytes += static_cast<std::size_t>(n) * (keys.row_bytes(keys.cols()) + values.row_bytes(values.cols()));
    });
    return bytes >= group_prefetch_bytes;
}

/// What a decode attend does to a logit beyond scale·q·k (SoftmaxOptions,
/// kernels/softmax_options.hpp), for a group of queries of one token: a softcap, an
/// ALiBi slope and a sink logit per query of the group. Default: nothing.
struct DecodeLogits {
    double softcap = 0;              ///< c > 0: s ← c·tanh(s/c)
    const double* slopes = nullptr;  ///< ALiBi: s ← s − slopes[r]·(position − j), one per query
    const double* sinks = nullptr;   ///< σ_r joins query r's denominator, one per query
    Index position = 0;              ///< the queries' position (the token they belong to)
    /// FpMath::bf16 (a memory of float over rows stored as bfloat16 or FP8): the queries
    /// and the weights rounded to bfloat16 and the products run by vdpbf16ps where the
    /// target has it (bf16_dot_rows; elsewhere the float products on the rounded queries).
    bool bf16_products = false;

    /// Whether the logits change (the sinks act at the end, in finish).
    [[nodiscard]] bool transforms() const noexcept { return softcap > 0 || slopes != nullptr; }

    /// The same for the queries from r0 on (a later group of group_rows of them).
    [[nodiscard]] DecodeLogits from(Index r0) const noexcept {
        DecodeLogits later = *this;
        if (slopes != nullptr)
            later.slopes += r0;
        if (sinks != nullptr)
            later.sinks += r0;
        return later;
    }

    /// The logits of SoftmaxOptions for queries of one token at `position`: their softcap,
    /// and the per-query spans (one value per query, or none).
    [[nodiscard]] static DecodeLogits of(const SoftmaxOptions& options, Index position) noexcept {
        return {.softcap = options.softcap,
                .slopes = options.alibi_slopes.empty() ? nullptr : options.alibi_slopes.data(),
                .sinks = options.sink_logits.empty() ? nullptr : options.sink_logits.data(),
                .position = position,
                .bf16_products = options.fpmath == FpMath::bf16};
    }

    /// Softcap, then ALiBi, on logits s[0, m) of query r at key positions k0, k0 + 1, ...
    /// (every `stride`-th value), in units of `unit` (1: natural; log2(e): base 2).
    template <class T>
    void apply(T* s, Index m, Index stride, Index r, Index k0, T unit) const {
        if (softcap > 0) {
            const T cap = static_cast<T>(unit * softcap), inverse = T(1) / cap;
            if (stride == 1) {
                Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>> row(s, m);
                row = (row * inverse).tanh() * cap;
            } else {
                Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>, 0, Eigen::InnerStride<>> row(s, m,
                                                                                          Eigen::InnerStride<>(stride));
                row = (row * inverse).tanh() * cap;
            }
        }
        if (slopes != nullptr) {
            const T slope = static_cast<T>(unit * slopes[r]);
            for (Index j = 0; j < m; ++j)
                s[j * stride] -= slope * static_cast<T>(position - (k0 + j));
        }
    }
};

/// g ≤ group_rows queries against runs of keys and values, each read once for the whole
/// group (what grouped-query attention saves), per block of ≤ 128 keys, with all scratch
/// on the stack. The logits take one of two routes, by measurement (bench/multi_head_bench.cpp,
/// BM_Decode, and g queries against 4096 keys at d = 128):
/// - g ≥ a packet's lanes and d ≤ max_depth, the tiled kernel's: Sᵀ = K_b · (log2(e)·scale·Q_g)ᵀ
///   (keys × lanes, register-blocked) and the online softmax in base 2 across the lanes
///   (SoftmaxBlockState); at g = 16 twice as fast as the other route;
/// - fewer queries, in float with AVX2 or AVX-512 (decode_tiles) and d ≤ max_depth: the
///   tiles route, S = (scale·Q_g) K_bᵀ by logit_tiles and one SoftmaxState per query, the
///   rows converted in registers (a 32/8 × 128 layer at 32768 tokens, bfloat16: 24.5 →
///   10.5 ms per step on one thread, float 23 → 19 ms);
/// - IntegerDot<Q8> keys (integer_group), any g ≥ 2 or one query with logit options,
///   d ≤ 256: the logits in integers on the queries rounded once (fold_integer; sixteen
///   keys per vpdpbusd with AVX-512 VNNI, eight per vpmaddubsw with AVX2), the bits of
///   the single query's integer_dot, so a query's output is the same in any group; then
///   the tiles route's softmax and value_tiles;
/// - FpMath::bf16 (DecodeLogits::bf16_products) over rows stored as bfloat16 or FP8
///   (bf16_dot_rows) where the CPU has AVX512-BF16 (avx512_bf16_runs: compiled in place,
///   or by target in a portable build), any g, d ≤ max_depth: fold_bf16, the tiles route in
///   bfloat16 arithmetic (logit_tiles_bf16 on the queries rounded once, the weights
///   rounded for value_tiles_bf16), each stored value read as bfloat16 (Bf16Words);
///   where the CPU runs AMX tiles (Tiles: AmxHardware where AmxGroupTiles::runs(), or
///   AmxEmulated, the tests' stand-in), the same route's two products in tiles
///   (fold_amx, kernels/group_amx.hpp);
/// - elsewhere: S = scale · Q_g K_bᵀ as dot products vectorised along the head dim and
///   one SoftmaxState per query, since a key-major product would fill only g of a
///   packet's lanes (g = 4: 1.6× faster than the tiled route with AVX2).
/// Then acc = α ⊙ acc + P · V_b, one register-blocked product with α fused into its load.
/// One query goes through attend_contiguous, which is exactly `attend`.
template <class T, class Tiles = AmxHardware>
class GroupAttention {
public:
    static constexpr Index max_depth = 256;

    /// `ahead`: the pairs come from beyond the L2 (beyond_l2), so rows are asked for ahead.
    /// `logits`: what the options do to the logits and the sums (none by default); the
    /// keys of a fold are at positions key_position, key_position + 1, ...
    template <class QB>
    GroupAttention(const QB& queries, T scale, bool ahead = false, const DecodeLogits& logits = {})
        : queries_(queries.data(), queries.rows(), queries.cols(), Eigen::OuterStride<>(queries.outerStride())),
          scale_(scale), g_(queries.rows()), lanes_(round_up(g_, packet_lanes<T>)), ahead_(ahead), logits_(logits),
          tiled_(g_ >= packet_lanes<T> && queries.cols() <= max_depth),
          tiles_(std::is_same_v<T, float> && decode_tiles && g_ >= 2 && !tiled_ && queries.cols() <= max_depth),
          depth_(round_up(queries.cols(), packet_lanes<T>)), block_(tiled_ ? lanes_ : 1),
          dot_(group_bf16 && std::is_same_v<T, float> && logits.bf16_products && queries.cols() <= max_depth &&
               avx512_bf16_runs()),
          amx_(dot_ && amx_runs()) {
        MEMATTN_DASSERT(g_ <= group_rows && lanes_ <= group_rows);
        load_queries();
    }

    /// Takes other queries (as many, as wide, rows of any stride) for the folds that
    /// follow; the states and the accumulators carry on. How a memory with RoPE reads
    /// pairs it places elsewhere (the sinks of a cache at their positions in the cache)
    /// with its queries turned to another position.
    template <class QB>
    void requery(const QB& queries) {
        MEMATTN_DASSERT(queries.rows() == g_ && queries.cols() == queries_.cols());
        new (&queries_) QueryMap(queries.data(), g_, queries.cols(), Eigen::OuterStride<>(queries.outerStride()));
        load_queries();
        rounded_ = false;
    }

    /// Folds keys K (n×d) and values V (n×dv), contiguous rows of any stride, into the
    /// states and the rows of `acc` (g×dv, zero before the first fold).
    template <class KBlock, class VBlock, class Acc>
    void fold(const KBlock& K, const VBlock& V, Acc&& acc, Index key_position = 0) {
        MEMATTN_DASSERT(!dot_);  // fold_bf16's queries only (load_queries)
        MEMATTN_DASSERT(K.rows() == V.rows() && K.cols() == queries_.cols() && V.cols() == acc.cols() &&
                        acc.rows() == g_);
        key_position_ = key_position;
        if (g_ == 1 && !logits_.transforms()) {
            attend_contiguous(queries_.row(0), K, V, scale_, states_[0], acc.row(0));
            return;
        }
        if constexpr (std::is_same_v<T, float> && decode_tiles) {
            if (tiles_) {
                fold_tiles(InPlaceRows{K.data(), K.outerStride(), K.cols()},
                           InPlaceRows{V.data(), V.outerStride(), V.cols()}, 0, K.rows(), K.cols(), V.cols(),
                           K.cols() * Index(sizeof(float)), K.rows(), acc);
                return;
            }
        }
        const auto in_place = [](const auto& X) {
            return [&X](Index j, Index) { return Rows{X.data() + j * X.outerStride(), X.outerStride()}; };
        };
        fold_rows(K.rows(), K.cols(), V.cols(), in_place(K), in_place(V), group_keys, group_keys, acc);
    }

    /// fold() for the rows [first, first + n) of stored keys and values in any storage.
    /// Stored as T they are read in place. Stored compactly, each key and value row is
    /// converted once per tile of queries in registers (the tiles route) or once for the
    /// whole group into a buffer that stays in L1 (the other routes), and the products
    /// run on the converted rows in the same blocks and the same order of terms as fold():
    /// the result is bitwise fold()'s on the stored values converted to T. One query takes
    /// attend_stored, which is exactly the cache's attend. IntegerDot<Q8> keys take their
    /// logits in integers where integer_group says so (fold_integer).
    template <class SK, class SV, class Acc>
    void fold_stored(const StoredRows<T, SK>& K, const StoredRows<T, SV>& V, Index first, Index n, Acc&& acc,
                     Index key_position = 0) {
        key_position_ = key_position;
        if constexpr (!StoredRows<T, SK>::compact) {
            static_assert(!StoredRows<T, SV>::compact, "memattn: keys stored as T go with values stored as T");
            if constexpr (std::is_same_v<T, float> && decode_tiles) {
                if (tiles_) {  // read in place, asked for ahead past the run
                    fold_tiles(K, V, first, n, K.cols(), V.cols(), K.cols() * Index(sizeof(float)), K.rows(), acc);
                    return;
                }
            }
            fold(K.block(first, n), V.block(first, n), acc, key_position);
        } else {
            MEMATTN_DASSERT(K.cols() == queries_.cols() && V.cols() == acc.cols() && acc.rows() == g_);
            if constexpr (bf16_dot_rows<SK> && bf16_dot_rows<SV>) {
                if (dot_) {
                    fold_bf16(K, V, first, n, acc);
                    return;
                }
            }
            MEMATTN_DASSERT(!dot_);  // the memories take FpMath::bf16 over rows fold_bf16 reads
            if (g_ == 1 && !logits_.transforms()) {
                attend_stored(queries_.row(0), K, V, first, n, scale_, states_[0], acc.row(0), ahead_);
                return;
            }
            if constexpr (std::is_same_v<T, float> && integer_group<SK>) {
                if (K.cols() <= IntegerGroup::max_depth) {
                    fold_integer(K, V, first, n, acc);
                    return;
                }
            }
            if constexpr (std::is_same_v<T, float> && decode_tiles) {
                if (tiles_) {
                    const auto key_bytes = static_cast<Index>(StoredRows<T, SK>::row_bytes(K.cols()));
                    if constexpr (number_rows<StoredRows<T, SK>> && number_rows<StoredRows<T, SV>>) {
                        // Rows of numbers read divided by their factor, the queries and the
                        // weights multiplied by it: the same products (NumberRows)
                        constexpr float kf = StoredRows<T, SK>::number_factor, vf = StoredRows<T, SV>::number_factor;
                        if (K.numbers_only() && V.numbers_only() && query_factor(kf)) {
                            fold_tiles(NumberRows<StoredRows<T, SK>>{K}, NumberRows<StoredRows<T, SV>>{V}, first, n,
                                       K.cols(), V.cols(), key_bytes, K.rows(), acc, vf);
                            return;
                        }
                    }
                    fold_tiles(K, V, first, n, K.cols(), V.cols(), key_bytes, K.rows(), acc);
                    return;
                }
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
            const auto converted = [&](const auto& X) {
                return [&X, first, buffer](Index j, Index m) {
                    X.decode_rows(first + j, m, buffer, X.cols());
                    return Rows{buffer, X.cols()};
                };
            };
            fold_rows(n, d, dv, converted(K), converted(V), std::clamp<Index>(buffered / d, 1, group_keys),
                      std::clamp<Index>(buffered / dv, 1, group_keys), acc);
        }
    }
    /// Whether the folds round the queries to bfloat16 themselves (FpMath::bf16 on rows
    /// fold_bf16 reads, bf16_dot_rows); else a caller that wants them rounded gives them so.
    [[nodiscard]] bool rounds_queries() const noexcept { return dot_; }

    /// Query r's state (natural logarithms), to finish or merge its accumulator row. The
    /// sink logits are not in it (they join once, in finish, after any merge).
    [[nodiscard]] SoftmaxState<T> state(Index r) const { return tiled_ && !states_folds_ ? block_.state(r) : states_[r]; }

    /// Query r's output: its sink logit, if any, joins the denominator, then acc / sum.
    template <class Row>
    void finish(Index r, Row&& acc) const {
        finish_state(state(r), logits_, r, acc);
    }
    /// The same for a state merged from parts (a split attend): the sink joins once here.
    template <class Row>
    static void finish_state(SoftmaxState<T> state, const DecodeLogits& logits, Index r, Row&& acc) {
        if (logits.sinks != nullptr)
            state.add_sink(static_cast<T>(logits.sinks[r]), acc);
        state.finish(acc);
    }

private:
    using QueryMap = Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>>;

    static constexpr Index round_up(Index n, Index m) { return (n + m - 1) / m * m; }

    /// Whether fold_bf16 runs in AMX tiles here (AmxGroupTiles::runs).
    static bool amx_runs() noexcept {
#if defined(MEMATTN_GROUP_BF16)
        return AmxGroupTiles<Tiles>::runs();
#else
        return false;
#endif
    }

    /// The queries as the routes read them: scale·Q_g (tiles route), log2(e)·scale·Q_gᵀ
    /// (tiled route), rows zero-padded to whole packets.
    void load_queries() noexcept {
        const Index d = queries_.cols();
#if defined(MEMATTN_GROUP_BF16)
        if constexpr (std::is_same_v<T, float>) {
            if (dot_) {  // fold_bf16's queries rounded to bfloat16, rows of whole 32-value packets
                const Index depth = round_up(d, 32);
                round_queries_bf16(queries_.data(), queries_.outerStride(), g_, d, depth,
                                   reinterpret_cast<std::uint16_t*>(bf16_.q));
                if (amx_)  // as B pairs for fold_amx's tiles
                    AmxGroupTiles<Tiles>::pack_query_pairs(reinterpret_cast<const std::uint16_t*>(bf16_.q), depth, g_,
                                                           depth, bf16_.pairs);
                return;  // the other routes' layouts are not read
            }
        }
#endif
        if (tiles_) {
            qt_factor_ = T(1);
            largest_query_ = T(0);
            for (Index r = 0; r < g_; ++r) {
                for (Index k = 0; k < d; ++k) {
                    const T x = scale_ * queries_(r, k);
                    qt_[r * depth_ + k] = x;
                    if (std::abs(x) <= Eigen::NumTraits<T>::highest())  // (∞ times a factor is ∞, NaN NaN)
                        largest_query_ = std::max(largest_query_, std::abs(x));
                }
                for (Index k = d; k < depth_; ++k)
                    qt_[r * depth_ + k] = T(0);
            }
            return;
        }
        if (!tiled_)
            return;
        const T factor = scale_ * T(1.44269504088896340735992468100);  // base-2 logits
        for (Index k = 0; k < d; ++k) {
            for (Index r = 0; r < g_; ++r)
                qt_[k * lanes_ + r] = factor * queries_(r, k);
            for (Index r = g_; r < lanes_; ++r)
                qt_[k * lanes_ + r] = T(0);
        }
    }

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
        MEMATTN_DASSERT(!states_folds_);  // one route per GroupAttention: state() reads its states
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
            if (logits_.transforms()) {
                const Index k0 = key_position_ + j0;
                for (Index r = 0; r < g_; ++r) {
                    if (tiled_)
                        logits_.apply(s_ + r, block, lanes_, r, k0, T(1.44269504088896340735992468100));
                    else
                        logits_.apply(s_ + r * group_keys, block, 1, r, k0, T(1));
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

    /// The route of 2 ≤ g < lanes queries in float (decode_tiles): per block of group_keys
    /// keys, the logits by logit_tiles, one SoftmaxState per query, then α ⊙ acc + P·V by
    /// value_tiles; every stored row is converted in registers, once per tile of queries.
    /// Key rows are asked for ahead up to `prefetch_end`: the end of the store, past the
    /// run, since the next run most often follows in memory (a paged sequence's next
    /// block, a split's next piece). Measured on the batched step of 32 paged bfloat16
    /// sequences, one thread: 43–44 ms against 48–56 within blocks only, in two
    /// interleaved runs; later runs moved by as much (docs/performance.md, "Serving").
    /// `weight_factor`: the values are read divided by it (NumberRows), so the weights are
    /// multiplied by it first; the queries (qt_) are read as query_factor left them.
    template <class Keys, class Values, class Acc>
    void fold_tiles(const Keys& keys, const Values& values, Index first, Index n, Index d, Index dv,
                    Index key_row_bytes, Index prefetch_end, Acc& acc, float weight_factor = 1.0f) {
        if constexpr (!number_view<Keys>)
            query_factor(T(1));  // (always possible)
        fold_blocks(
            n, key_row_bytes,
            [&](Index j0, Index block, Index ahead) {
                for_query_tiles(g_, [&]<int GQ>(Index r0) {
                    logit_tiles<GQ>(keys, values, first + j0, block, d, qt_ + r0 * depth_, depth_,
                                    s_ + r0 * group_keys, group_keys, r0 == 0 ? ahead : 0, prefetch_end);
                });
            },
            float_products(values, first, dv, acc, weight_factor));
    }

    /// The tiles route's queries (qt_) times `factor` (1, or a number rows' factor, a power
    /// of two): false, and qt_ unchanged, where a finite query would overflow. Exact both
    /// ways.
    bool query_factor(T factor) noexcept {
        if (factor == qt_factor_)
            return true;
        if (factor > T(1) && !(largest_query_ <= Eigen::NumTraits<T>::highest() / factor))
            return false;
        const T by = factor / qt_factor_;
        for (Index i = 0; i < g_ * depth_; ++i)
            qt_[i] *= by;
        qt_factor_ = factor;
        return true;
    }

    /// The route of IntegerDot<Q8> keys (integer_group): fold_tiles with the logits of
    /// every query taken in integers, integer_group_keys at a time, on the queries rounded
    /// once per attend (StoredRows<float, Q8>::integer_logits: the bits of the single-query
    /// route's integer_dot, so a query's logits do not depend on its group).
    template <class SK, class Values, class Acc>
    void fold_integer(const StoredRows<T, SK>& keys, const Values& values, Index first, Index n, Acc& acc) {
        if constexpr (std::is_same_v<T, float> && integer_group<SK>) {
            if (!rounded_) {
                integer_.round(queries_.data(), queries_.outerStride(), g_, queries_.cols());
                rounded_ = states_folds_ = true;
            }
            fold_blocks(
                n, static_cast<Index>(StoredRows<T, SK>::row_bytes(keys.cols())),
                [&](Index j0, Index block, Index ahead) {
                    keys.integer_logits(first + j0, block, integer_, scale_, s_, group_keys, values, ahead, keys.rows());
                },
                float_products(values, first, values.cols(), acc));
        }
    }

    /// The route of FpMath::bf16 over rows stored as bfloat16 or FP8 (dot_ and
    /// bf16_dot_rows), any g: fold_blocks with the logits of the queries rounded once
    /// (load_queries) by logit_tiles_bf16 and the weights rounded to bfloat16 for
    /// value_tiles_bf16; in AMX tiles instead where they run (fold_amx). A query's logits
    /// and output do not depend on the group it is in (the tiles' sums have one tree, the
    /// value tiles one order).
    template <class SK, class SV, class Acc>
    void fold_bf16(const StoredRows<T, SK>& keys, const StoredRows<T, SV>& values, Index first, Index n, Acc& acc) {
#if defined(MEMATTN_GROUP_BF16)
        if constexpr (std::is_same_v<T, float>) {
            states_folds_ = true;
            if (amx_ && values.cols() <= max_depth) {
                fold_amx(keys, values, first, n, acc);
                return;
            }
            const Index d = keys.cols(), depth = round_up(d, 32), dv = values.cols();
            float* out = acc.data();
            const Index ldo = acc.outerStride();
            // Tiles of at most 4 queries over bfloat16 rows, 8 over FP8 ones (whose words
            // cost a conversion each time a tile reads them). Measured on AMD EPYC Zen 4
            // (family 25 model 17), BM_GroupAttend, 512 keys in L2, one thread: 8 queries
            // as one tile of 8 took 40–43 ns a key, as two tiles of 4 34–36 (the eight
            // queries' 32 packets and sixteen sums do not stay in registers, and a tile of
            // 8 × 2 keys adds its sixteen sums for 2 keys where one of 4 × 4 does it for
            // 4); an 8/1 step over 4,096 FP8 pairs went the other way, 0.17–0.19 → 0.22 ms.
            constexpr int key_lanes = std::is_same_v<SK, Eigen::bfloat16> ? 8 : 16;
            constexpr int value_lanes = std::is_same_v<SV, Eigen::bfloat16> ? 8 : 16;
            fold_blocks<true>(
                n, static_cast<Index>(StoredRows<T, SK>::row_bytes(d)),
                [&](Index j0, Index block, Index ahead) {
                    for_query_tiles<key_lanes>(g_, [&]<int GQ>(Index r0) {
                        logit_tiles_bf16<GQ>(keys, values, first + j0, block, d,
                                             reinterpret_cast<const std::uint16_t*>(bf16_.q + r0 * depth), depth,
                                             scale_, s_ + r0 * group_keys, group_keys, r0 == 0 ? ahead : 0,
                                             keys.rows());
                    });
                },
                [&](Index j0, Index block) {
                    for_query_tiles<value_lanes>(g_, [&]<int GQ>(Index r0) {
                        value_tiles_bf16<GQ>(values, first + j0, block, dv, bf16_.w + r0 * bf16_weights,
                                             bf16_weights, alpha_ + r0, out + r0 * ldo, ldo);
                    });
                });
        }
#else
        (void)keys, (void)values, (void)first, (void)n, (void)acc;
#endif
    }

#if defined(MEMATTN_GROUP_BF16)
    /// fold_bf16's route in AMX tiles (kernels/group_amx.hpp): the logits Sᵀ = K·Qᵀ of 32
    /// keys at a time on the query pairs packed once (load_queries), the same softmax and
    /// rounded weights, then acc = α ⊙ acc + W·V with acc kept for the fold in qt_ (rows
    /// of whole 32-column chunks, zero past dv; qt_ is not read by this route otherwise),
    /// so for dv ≤ max_depth (wider values take vdpbf16ps).
    template <class SK, class SV, class Acc>
    void fold_amx(const StoredRows<T, SK>& keys, const StoredRows<T, SV>& values, Index first, Index n, Acc& acc) {
        const Index d = keys.cols(), dv = values.cols(), ldo = round_up(dv, 32);
        float* o = qt_;
        for (Index r = 0; r < g_; ++r) {
            std::copy_n(acc.data() + r * acc.outerStride(), dv, o + r * ldo);
            std::fill(o + r * ldo + dv, o + (r + 1) * ldo, 0.0f);
        }
        AmxGroupTiles<Tiles> tiles(g_);
        fold_blocks<true>(
            n, static_cast<Index>(StoredRows<T, SK>::row_bytes(d)),
            [&](Index j0, Index block, Index ahead) {
                tiles.logits(keys, first + j0, block, d, bf16_.pairs, scale_, s_, group_keys, [&](Index j, Index m) {
                    prefetch_tile(keys, values, first + j0 + j, first + j0 + j + m, ahead, keys.rows());
                });
            },
            [&](Index j0, Index block) {
                for (Index r = 0; r < g_; ++r)
                    Eigen::Map<Eigen::ArrayXf>(o + r * ldo, ldo) *= alpha_[r];
                tiles.values(values, first + j0, block, dv, reinterpret_cast<const std::uint16_t*>(bf16_.w),
                             bf16_weights, o, ldo);
            });
        for (Index r = 0; r < g_; ++r)
            std::copy_n(o + r * ldo, dv, acc.data() + r * acc.outerStride());
    }
#endif

    /// P·V of the float routes (fold_tiles, fold_integer) for fold_blocks: acc = α ⊙ acc
    /// + P·V by value_tiles, or without AVX2 (fold_integer only) value_tiles' sums, one
    /// value at a time.
    template <class Values, class Acc>
    auto float_products(const Values& values, Index first, Index dv, Acc& acc, float weight_factor = 1.0f) {
        return [this, &values, first, dv, weight_factor, out = acc.data(), ldo = acc.outerStride()](Index j0,
                                                                                                    Index block) {
            if (weight_factor != 1.0f)  // values read divided by it (NumberRows): exact, the weights are at most 1
                for (Index r = 0; r < g_; ++r)
                    for (Index j = 0; j < block; ++j)
                        s_[r * group_keys + j] *= weight_factor;
            if constexpr (decode_tiles) {
                for_query_tiles(g_, [&]<int GQ>(Index r0) {
                    value_tiles<GQ>(values, first + j0, block, dv, s_ + r0 * group_keys, group_keys, alpha_ + r0,
                                    out + r0 * ldo, ldo);
                });
            } else {
                for (Index r = 0; r < g_; ++r)
                    for (Index c = 0; c < dv; ++c) {
                        float x = alpha_[r] * out[r * ldo + c];
                        for (Index j = 0; j < block; ++j)
                            x = fused_add(s_[r * group_keys + j], values.stored_value(first + j0 + j, c), x);
                        out[r * ldo + c] = x;
                    }
            }
        };
    }

    /// The loop of fold_tiles, fold_integer, fold_bf16 and fold_amx: per block of
    /// group_keys keys, the logits (logits(j0, block, ahead): into s_, one row of
    /// group_keys per query), the options, one SoftmaxState per query (Bf16: the weights
    /// rounded to bfloat16 into bf16_.w, summed as rounded, zero from the block's end to
    /// its whole 32), then acc = α ⊙ acc + P·V by products(j0, block).
    template <bool Bf16 = false, class Logits, class Products>
    void fold_blocks(Index n, Index key_row_bytes, const Logits& logits, const Products& products) {
        const Index ahead = ahead_ ? std::max<Index>(1, Index(4096) / std::max<Index>(1, key_row_bytes)) : 0;
        for (Index j0 = 0; j0 < n; j0 += group_keys) {
            const Index block = std::min(group_keys, n - j0);
            logits(j0, block, ahead);
            if (logits_.transforms())
                for (Index r = 0; r < g_; ++r)
                    logits_.apply(s_ + r * group_keys, block, 1, r, key_position_ + j0, 1.0f);
            if constexpr (Bf16) {
#if defined(MEMATTN_GROUP_BF16)
                for (Index r = 0; r < g_; ++r) {
                    Eigen::bfloat16* w = bf16_.w + r * bf16_weights;
                    alpha_[r] = states_[r].absorb(s_ + r * group_keys, block,
                                                  [w](auto& p) { round_weights_bf16(p.data(), p.size(), w); });
                    std::fill(w + block, w + round_up(block, 32), Eigen::bfloat16(0.0f));
                }
#endif
            } else {
                for (Index r = 0; r < g_; ++r)
                    alpha_[r] = states_[r].absorb(s_ + r * group_keys, block);
            }
            products(j0, block);
        }
    }

    QueryMap queries_;
    T scale_;
    Index g_, lanes_;
    bool ahead_;
    DecodeLogits logits_;
    Index key_position_ = 0;  // of the current fold's first key
    bool tiled_, tiles_;
    Index depth_;  // the head dim rounded up to whole packets
    SoftmaxBlockState<T, static_cast<int>(group_rows)> block_;  // tiled route
    SoftmaxState<T> states_[group_rows];                        // the other routes
    T alpha_[group_rows];
    alignas(64) T qt_[max_depth * group_rows];  // log2(e)·scale·Q_gᵀ (tiled route), scale·Q_g (tiles)
    T qt_factor_ = T(1);                        // the tiles' qt_ is scale·Q_g times it (query_factor)
    T largest_query_ = T(0);                    // the largest finite magnitude of scale·Q_g (query_factor)
    alignas(64) T s_[group_rows * group_keys];  // logits, then weights
    struct NoIntegerGroup {};
    std::conditional_t<std::is_same_v<T, float>, IntegerGroup, NoIntegerGroup> integer_;  // the queries rounded (fold_integer)
    bool rounded_ = false;                       // integer_ holds queries_
    bool dot_;                                   // fold_bf16 takes rows stored as bfloat16
    bool amx_;                                   // and runs them in AMX tiles (fold_amx)
    static constexpr Index bf16_weights = group_keys + 2;  // a query's weights in bf16_.w (even)
    struct Bf16Operands {
        alignas(64) Eigen::bfloat16 q[group_rows * max_depth];     // the queries rounded (fold_bf16)
        alignas(64) Eigen::bfloat16 w[group_rows * bf16_weights];  // a block's weights rounded
        alignas(64) std::uint32_t pairs[max_depth / 2 * 16];       // the queries as B pairs (fold_amx)
    };
    struct NoBf16Operands {};
    std::conditional_t<group_bf16 && std::is_same_v<T, float>, Bf16Operands, NoBf16Operands> bf16_;
    bool states_folds_ = false;                   // a fold took fold_integer or fold_bf16: the states are states_
};

}  // namespace memattn::detail
