#pragma once
// Stored rows read as bfloat16 words, 32 at a time (AVX-512): what the grouped decode's
// bfloat16 routes (kernels/group_attention.hpp: vdpbf16ps; kernels/group_amx.hpp: AMX
// tiles) and the pool's gathered prompt tiles (serving/paged_prefill.hpp) multiply.
// bfloat16 rows are their words; an FP8 byte becomes its bfloat16 word exactly.

#include "memattn/detail/bf16_product.hpp"
#include "memattn/detail/isa_regions.hpp"
#include "memattn/storage/fp8.hpp"
#include "memattn/storage/rows_16bit.hpp"
#include "memattn/storage/stored_rows.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace memattn::detail {

/// The grouped decode's bfloat16 routes (fold_bf16, fold_amx) are compiled: in place
/// where the build targets AVX512-BF16, by target (detail/isa_regions.hpp) where
/// it does not. They run where avx512_bf16_runs().
#if defined(MEMATTN_BF16_DOT) || defined(MEMATTN_BF16_DISPATCH)
#define MEMATTN_GROUP_BF16 1
inline constexpr bool group_bf16 = true;
#else
inline constexpr bool group_bf16 = false;
#endif

/// The format S of StoredRows<T, S>.
template <class Rows>
struct stored_format;
template <class T, class S>
struct stored_format<StoredRows<T, S>> {
    using type = S;
};

#if defined(MEMATTN_GROUP_BF16)
MEMATTN_AVX512_BF16_BEGIN
/// How the bfloat16 tiles read rows of format S: row(rows, r), the first byte of row r,
/// and load(row, c, mask), the values of columns [c, c + 32) as 32 bfloat16 words, the
/// lanes off `mask` zero (their bytes not read). Defined for the formats fold_bf16 takes
/// (bf16_dot_rows<S>).
template <class S>
struct Bf16Words;

/// bfloat16 rows: the words as stored.
template <>
struct Bf16Words<Eigen::bfloat16> {
    template <class Rows>
    static const void* row(const Rows& rows, Index r) noexcept {
        return rows.stored_row(r);
    }
    static __m512i load(const void* row, Index c, __mmask32 mask) noexcept {
        return _mm512_maskz_loadu_epi16(mask, static_cast<const std::uint16_t*>(row) + c);
    }
};

/// FP8 rows: every E4M3 and E5M2 value is a bfloat16 one (3 or 2 bits of mantissa,
/// exponents within bfloat16's; NaN and E5M2's ±∞ as bfloat16's), so a byte becomes its
/// word exactly. A normal number's word is its byte's magnitude bits shifted into
/// bfloat16's exponent and mantissa fields plus the difference of the biases (120 for
/// E4M3, 112 for E5M2: one shift, one and, one add); the bytes of the smallest exponent
/// field (zero and the subnormals) and of the largest where it is not a number's (E4M3's
/// NaN, E5M2's ±∞ and NaNs) take their words from a 32-word table by one masked word
/// permute, indexed by the byte's five low bits (distinct for those bytes); the sign is
/// moved to bit 15 last (vpternlogd). Nine instructions and µops for 32 values: a
/// 128-word table for the magnitude took seven instructions (two vpermt2w and a blend)
/// but eleven µops on Intel cores, where a vpermt2w is three (7.0 against 6.0 cycles per
/// 32 values, and the FP8 decode steps with FpMath::bf16 5–10% faster, on the Xeon of
/// docs/performance.md's "FP8 bytes as bfloat16 words by arithmetic").
template <Fp8Storage S>
struct Bf16Words<S> {
    static constexpr bool e4m3 = std::is_same_v<S, Fp8E4M3>;
    /// The byte's magnitude bits (7) shifted left by `shift` land in bfloat16's exponent
    /// and mantissa fields (`field`); a normal number adds `bias`, the difference of the
    /// exponent biases in the exponent field. At most `smallest` the exponent field is
    /// zero, from `largest` on it is E4M3's NaN or E5M2's ±∞/NaN.
    static constexpr int shift = e4m3 ? 4 : 5;
    static constexpr std::uint16_t field = e4m3 ? 0x07F0 : 0x0FE0, bias = e4m3 ? 120 << 7 : 112 << 7,
                                   smallest = e4m3 ? 0x0070 : 0x0060, largest = e4m3 ? 0x07F0 : 0x0F80;
    /// The words of those bytes by their five low bits: 0–15 the magnitudes 0–15 (the
    /// smallest exponent field's are 0–7 and 0–3), 16–31 the magnitudes 112–127 (the
    /// largest's are 127 and 124–127).
    static constexpr std::array<std::uint16_t, 32> special = [] {
        std::array<std::uint16_t, 32> words{};
        for (std::size_t i = 0; i < words.size(); ++i)
            words[i] = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(fp8_values<S>[i < 16 ? i : 96 + i]) >> 16);
        return words;
    }();
    template <class Rows>
    static const void* row(const Rows& rows, Index r) noexcept {
        return rows.row_data(r);
    }
    static __m512i load(const void* row, Index c, __mmask32 mask) noexcept {
        // 32 bytes, masked only where the row ends: a 64-byte masked load of them made the
        // FP8 steps 1.3–2.1x slower on a Zen 5
        const auto* p = static_cast<const std::uint8_t*>(row) + c;
        const __m512i bytes = _mm512_cvtepi8_epi16(mask == ~__mmask32(0)
                                                       ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                                       : _mm256_maskz_loadu_epi8(mask, p));
        const __m512i magnitude =
            _mm512_and_si512(_mm512_slli_epi16(bytes, shift), _mm512_set1_epi16(static_cast<short>(field)));
        const __mmask32 table_lanes =
            _mm512_cmple_epu16_mask(magnitude, _mm512_set1_epi16(static_cast<short>(smallest))) |
            _mm512_cmpge_epu16_mask(magnitude, _mm512_set1_epi16(static_cast<short>(largest)));
        __m512i words = _mm512_add_epi16(magnitude, _mm512_set1_epi16(static_cast<short>(bias)));
        words = _mm512_mask_permutexvar_epi16(words, table_lanes, bytes, _mm512_loadu_si512(special.data()));
        // words | (bytes & 0x8000): the sign, sign-extended from the byte's bit 7
        return _mm512_ternarylogic_epi32(words, bytes, _mm512_set1_epi16(-0x8000), 0xF8);
    }
    /// Columns [0, cols) of `row` as their bfloat16 words into out[0, cols).
    static void copy(const std::uint8_t* row, Index cols, std::uint16_t* out) noexcept {
        for (Index c = 0; c < cols; c += 32) {
            const Index m = std::min<Index>(32, cols - c);
            const auto mask = static_cast<__mmask32>(m == 32 ? ~std::uint32_t(0) : (std::uint32_t(1) << m) - 1);
            _mm512_mask_storeu_epi16(out + c, mask, load(row, c, mask));
        }
    }
};
MEMATTN_AVX512_BF16_END
#endif

/// S is a format fold_bf16 reads as bfloat16 words (Bf16Words<S>, AVX512-BF16): bfloat16
/// and FP8, where the route is compiled (it runs where avx512_bf16_runs()).
#if defined(MEMATTN_GROUP_BF16)
template <class S>
inline constexpr bool bf16_dot_rows = std::is_same_v<S, Eigen::bfloat16> || Fp8Storage<S>;
#else
template <class S>
inline constexpr bool bf16_dot_rows = false;
#endif

}  // namespace memattn::detail
