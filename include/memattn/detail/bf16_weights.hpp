#pragma once
// The online softmax of a tile for the bfloat16 products, its weights rounded and packed
// as they are computed (absorb_packed), instead of stored back into the logits' tile as
// floats and packed from there by a second pass:
//
//   WeightLayout::pairs  word (j/2)·ldo + i holds lane i's weights of keys j and j + 1
//                        (pack_weight_pairs' layout: vdpbf16ps's A, detail/bf16_product.hpp)
//   WeightLayout::rows   word i·ldo + j/2 holds them (pack_weight_rows' layout: AMX's A
//                        rows, detail/amx_product.hpp)
//
// low half key j, high half key j + 1 (0 past the tile's keys). It is
// SoftmaxBlockState::absorb (softmax_state.hpp) with RoundToBf16, written again in
// AVX-512 so that it compiles by target (detail/isa_regions.hpp): a portable build
// (x86-64-v3, say) runs it where the CPU has AVX512-BF16, as a native one does. The same
// arithmetic, lane by lane, as absorb's packets of any width: the maximum in four chains
// (a NaN logit dropped, a NaN maximum kept: vmaxps' operand order as Eigen's pmax), the
// shift (0 where the maximum is −∞), α and each weight by exp2_nonpositive_avx512
// (detail/packet.hpp: the polynomial's multiply-adds fused where the build's packets fuse
// them, as Eigen's pmadd, and kept apart from their adds where they have no FMA, whatever
// -ffp-contract allows; build_mul and build_madd there), the sum of the
// rounded weights key after key, then sum = α·sum + Σ. Per two keys: one vcvtne2ps2bf16
// rounds both weights (to nearest even, as RoundToBf16), one word permute interleaves
// them into pair words, and the rounded weights, read back from the words by a shift and
// a mask, join the sum. For rows, sixteen pair words (32 keys) are transposed in
// registers before they are stored.
// So the same m, sum, α and packed weights as absorb followed by the pack, bit for bit
// (a NaN lane's sum a NaN of another payload where RoundToBf16 kept the float NaN),
// without the weights' float stores and their second read: a bfloat16 call in AMX tiles
// at N = 4,096, d = 128 packed for 9% of its time, and rounded and stored its weights
// for most of the softmax's pass after the exp (docs/performance.md).

#include "memattn/detail/amx_product.hpp"
#include "memattn/detail/assert.hpp"
#include "memattn/detail/isa_regions.hpp"
#include "memattn/detail/packet.hpp"
#include "memattn/types.hpp"

#include <bit>
#include <cstdint>
#include <limits>

namespace memattn::detail {

/// Where packed weights go (see the top of the file).
enum class WeightLayout { pairs, rows };

#if defined(MEMATTN_AVX512_BF16_CODE)
MEMATTN_AVX512_BF16_BEGIN

/// Eigen's pmax(a, x) of 16 floats: a where either is NaN (vmaxps returns its second
/// operand then).
inline __m512 weights_keep(__m512 a, __m512 x) noexcept {
    return _mm512_max_ps(x, a);
}

/// The weight of key j of the 16 lanes at `lane`: 2^(f·s − shift) (Scaled), else 2^(s − shift).
template <bool Scaled>
inline __m512 weights_of(const float* lane, Index j, Index ld, __m512 f, __m512 shift) noexcept {
    __m512 x = _mm512_loadu_ps(lane + j * ld);
    if constexpr (Scaled)
        x = build_mul(f, x);
    return exp2_nonpositive_avx512(_mm512_sub_ps(x, shift));
}

/// absorb_packed for the 16 lanes from `first`. (No lambda takes or returns a vector
/// here: see detail/isa_regions.hpp.)
template <WeightLayout Layout, bool Scaled>
inline void absorb_packed_lanes(const float* s, Index keys, Index ld, Index first, float factor, float* max,
                                float* sum, float* alpha, std::uint32_t* out, Index ldo) {
    const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __m512 f = _mm512_set1_ps(factor);
    const float* lane = s + first;
    const __m512 m_old = _mm512_loadu_ps(max + first);
    // The maximum in four chains, as absorb's.
    const __m512 start = Scaled ? minus_inf : m_old;
    __m512 m0 = start, m1 = start, m2 = start, m3 = start;
    Index j = 0;
    for (; j + 4 <= keys; j += 4) {
        m0 = weights_keep(m0, _mm512_loadu_ps(lane + j * ld));
        m1 = weights_keep(m1, _mm512_loadu_ps(lane + (j + 1) * ld));
        m2 = weights_keep(m2, _mm512_loadu_ps(lane + (j + 2) * ld));
        m3 = weights_keep(m3, _mm512_loadu_ps(lane + (j + 3) * ld));
    }
    for (; j < keys; ++j)
        m0 = weights_keep(m0, _mm512_loadu_ps(lane + j * ld));
    const __m512 m_tile = weights_keep(weights_keep(m0, m1), weights_keep(m2, m3));
    const __m512 m_new = Scaled ? weights_keep(m_old, build_mul(f, m_tile)) : m_tile;
    const __m512 shift =
        _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, minus_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
    const __m512 a = exp2_nonpositive_avx512(_mm512_sub_ps(m_old, shift));
    // Word 2i of the permute's result is word i of its source (key j's rounded weights,
    // the low half of vcvtne2ps2bf16's result), word 2i + 1 word 16 + i.
    alignas(64) static constexpr std::uint16_t interleave[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                                 21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                                 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i order = _mm512_load_si512(interleave);
    const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    __m512 block_sum = _mm512_setzero_ps();
    __m512i block[16] = {};  // rows: 16 pair rows of words, transposed when full
    const Index pairs = (keys + 1) / 2;
    for (Index k = 0; k < pairs; ++k) {
        const bool second = 2 * k + 1 < keys;
        const __m512 low = weights_of<Scaled>(lane, 2 * k, ld, f, shift);
        const __m512 high = second ? weights_of<Scaled>(lane, 2 * k + 1, ld, f, shift) : _mm512_setzero_ps();
        const __m512i words = _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(high, low));
        block_sum = _mm512_add_ps(block_sum, _mm512_castsi512_ps(_mm512_slli_epi32(words, 16)));
        if (second)
            block_sum = _mm512_add_ps(block_sum, _mm512_castsi512_ps(_mm512_and_si512(words, high_half)));
        if constexpr (Layout == WeightLayout::pairs) {
            _mm512_storeu_si512(out + k * ldo + first, words);
        } else {
            const Index slot = k % 16;
            block[slot] = words;
            if (slot == 15 || k + 1 == pairs) {  // 16 pair rows (or the last few) to lane rows
                for (Index r = slot + 1; r < 16; ++r)
                    block[r] = _mm512_setzero_si512();
                transpose_words(block);
                const auto mask = static_cast<__mmask16>((1u << (slot + 1)) - 1u);
                for (Index r = 0; r < 16; ++r)
                    _mm512_mask_storeu_epi32(out + (first + r) * ldo + (k - slot), mask, block[r]);
            }
        }
    }
    _mm512_storeu_ps(max + first, m_new);
    _mm512_storeu_ps(sum + first, build_madd(a, _mm512_loadu_ps(sum + first), block_sum));
    _mm512_storeu_ps(alpha + first, a);
}

/// SoftmaxBlockState::absorb (factor 0) or absorb_scaled (factor > 0) with RoundToBf16 of
/// the tile of logits s (keys × n lanes, row stride ld; n a multiple of 16), the state's
/// lane_rows() as max, sum and alpha, its weights packed into out (row stride ldo, words)
/// in Layout and not stored into s, which stays as it was. Only where avx512_bf16_runs().
template <WeightLayout Layout>
inline void absorb_packed(const float* s, Index keys, Index ld, Index n, float factor, float* max, float* sum,
                          float* alpha, std::uint32_t* out, Index ldo) {
    MEMATTN_DASSERT(n % 16 == 0 && ld >= n && factor >= 0.0f);
    for (Index i = 0; i < n; i += 16)
        if (factor > 0.0f)
            absorb_packed_lanes<Layout, true>(s, keys, ld, i, factor, max, sum, alpha, out, ldo);
        else
            absorb_packed_lanes<Layout, false>(s, keys, ld, i, 1.0f, max, sum, alpha, out, ldo);
}

MEMATTN_AVX512_BF16_END
#endif

/// The weights of n keys × cols lanes packed in `layout` (word stride ldw) back as floats
/// into s (keys × lanes, row stride ld): for the rare path that multiplies them in float
/// (a value tile that is not all finite).
inline void unpack_weights(WeightLayout layout, const std::uint32_t* w, Index ldw, Index n, Index cols, float* s,
                           Index ld) {
    for (Index j = 0; j < n; ++j)
        for (Index i = 0; i < cols; ++i) {
            const std::uint32_t word = layout == WeightLayout::pairs ? w[(j / 2) * ldw + i] : w[i * ldw + j / 2];
            const std::uint32_t half = j % 2 == 0 ? word & 0xFFFFu : word >> 16;
            s[j * ld + i] = std::bit_cast<float>(half << 16);
        }
}

}  // namespace memattn::detail
