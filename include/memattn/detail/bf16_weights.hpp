#pragma once
// The online softmax's weights for the bfloat16 products, rounded and packed as they are
// computed (SoftmaxBlockState::absorb_weighed), instead of stored back into the logits'
// tile as floats and packed from there by a second pass:
//
//   WeightLayout::pairs  word (j/2)·ldo + i holds lane i's weights of keys j and j + 1
//                        (pack_weight_pairs' layout: vdpbf16ps's A, detail/bf16_product.hpp)
//   WeightLayout::rows   word i·ldo + j/2 holds them (pack_weight_rows' layout: AMX's A
//                        rows, detail/amx_product.hpp)
//
// low half key j, high half key j + 1 (0 past the tile's keys). Per two keys of 16 lanes:
// both weights in float as absorb computes them, one vcvtne2ps2bf16 rounds both (to
// nearest even, as RoundToBf16), one word permute interleaves them into pair words, and
// the rounded weights, read back from the words by a shift and a mask, join the lanes'
// sums one key after the other, as absorb sums them. For rows, sixteen pair words (32
// keys) are transposed in registers before they are stored. So the same weights, m, sum
// and α as absorb with RoundToBf16 followed by the pack, bit for bit, without the
// weights' float stores and their second read (a bfloat16 call in AMX tiles at N =
// 4,096, d = 128: the packing was 9% of it, the weights' rounding and store most of
// the softmax's pass after the exp). Compiled where the build targets AVX512-BF16
// (MEMATTN_BF16_DOT, AVX-512 F, BW, DQ and VL: MEMATTN_PACKED_WEIGHTS); elsewhere the
// products absorb and pack as before.

#include "memattn/detail/amx_product.hpp"
#include "memattn/detail/isa_regions.hpp"
#include "memattn/detail/packet.hpp"
#include "memattn/types.hpp"

#include <bit>
#include <cstdint>
#include <type_traits>

namespace memattn::detail {

/// Where packed weights go (see the top of the file).
enum class WeightLayout { pairs, rows };

#if defined(MEMATTN_BF16_DOT) && defined(MEMATTN_AVX512_NATIVE) && defined(EIGEN_VECTORIZE_AVX512)
#define MEMATTN_PACKED_WEIGHTS 1
#endif

#if defined(MEMATTN_PACKED_WEIGHTS)
/// SoftmaxBlockState::absorb_weighed's weigh: the weights of the 16 lanes of the tile of
/// logits at `lane` (keys rows, row stride ld) from lane `first`, packed into out (row
/// stride ldo, words) in Layout.
template <WeightLayout Layout>
struct PackedWeights {
    std::uint32_t* out;
    Index ldo;

    template <bool Scaled>
    __m512 operator()(const float* lane, Index keys, Index ld, Index first, const __m512& shift, const __m512& f,
                      std::bool_constant<Scaled>) const {
        // Word 2i of the permute's result is word i of its source (key j's rounded
        // weights, the low half of vcvtne2ps2bf16's result), word 2i + 1 word 16 + i.
        alignas(64) static constexpr std::uint16_t interleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                                     21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                                     11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
        const __m512i order = _mm512_load_si512(interleave);
        const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
        const auto weight = [&](Index j) {
            __m512 x = _mm512_loadu_ps(lane + j * ld);
            if constexpr (Scaled)
                x = _mm512_mul_ps(f, x);
            return exp2_nonpositive_16(_mm512_sub_ps(x, shift));
        };
        __m512 sum = _mm512_setzero_ps();
        __m512i block[16] = {};  // (rows: 16 pair rows of words, transposed when full)
        const Index pairs = (keys + 1) / 2;
        for (Index k = 0; k < pairs; ++k) {
            const bool second = 2 * k + 1 < keys;
            const __m512 low = weight(2 * k);
            const __m512 high = second ? weight(2 * k + 1) : _mm512_setzero_ps();
            const __m512i words = _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(high, low));
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(words, 16)));
            if (second)
                sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_and_si512(words, high_half)));
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
        return sum;
    }
};
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
