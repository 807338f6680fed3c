#pragma once
// FP8 rows: one byte per value in one of the two OCP 8-bit floating-point formats, the
// FP8 K/V caches of vLLM and TensorRT-LLM without their scale (kv_cache_dtype fp8_e4m3 or
// fp8_e5m2 with k_scale = v_scale = 1). A value x is stored as the number of the format
// nearest to it, ties to the even mantissa.
//
//   Fp8E4M3  ("E4M3FN") 1 sign bit, 4 exponent bits of bias 7, 3 mantissa bits; no
//            infinity, one NaN pattern per sign, S.1111.111. Normal numbers 2^(e−7)·(1 + m/8)
//            for e = 1 … 15 (largest 448 = 2^8·1.75), subnormal ones m·2^−9: 3 bits of
//            mantissa (a relative error of at most 2^−4) over [2^−6, 448], absolute steps
//            of 2^−9 below. A finite value of magnitude 464 or more (past the midpoint
//            between 448 and 480, where the format has its NaN) is refused by
//            check_storable; ±∞ and NaN are stored as NaN (the format has no infinity).
//   Fp8E5M2  1 sign bit, 5 exponent bits of bias 15, 2 mantissa bits: IEEE binary16's
//            upper byte, with its infinities (S.11111.00) and NaNs (S.11111.xx, xx ≠ 0).
//            Normal numbers 2^(e−15)·(1 + m/4) for e = 1 … 30 (largest 57344 = 2^15·1.75),
//            subnormal ones m·2^−16: 2 bits of mantissa (a relative error of at most 2^−3)
//            over [2^−14, 57344], steps of 2^−16 below. A finite value of magnitude 61440
//            or more (the midpoint between 57344 and 2^16, which rounds to ∞) is refused;
//            ±∞ and NaN are stored as they are.
//
// Either poisons the attends that see a non-finite value it holds.
//
// PerTokenScale<S> keeps, beside each stored row x (a token's key or value of one head),
// one float s = max|x| / (S's largest value), and stores S(x / s): four bytes more per
// row, float's whole range, and S's relative precision (2^−4 or 2^−3) measured against
// the row's largest magnitude instead of a fixed range. The scale is multiplied into the
// token's logit and into its weight, never into each value.
//
// The whole family is this file: the tags, what each format declares of itself
// (StorageFormat: its name, its snapshot type code, its overflow), and their rows
// (StoredRows<T, S> for both, and for PerTokenScale<S>); storage/compact.hpp includes it
// and lists the formats (stated_formats).
// A byte is decoded in registers through IEEE binary16 (F16C's vcvtph2ps, on AVX2 and
// AVX-512 targets): an E5M2 byte is a half's upper byte; an E4M3 byte's bits, moved to a
// half's exponent and mantissa fields, are its value times 2^−8 (the biases differ by 8,
// subnormals included), and its NaN pattern is put back by a compare. Elsewhere, a
// 256-entry table. Measured on an AMD EPYC (Zen 2, AVX2 + F16C), a grouped decode step
// (4 queries, 32768 tokens, d = 128, bench/kv_quality_bench.cpp): E4M3 by the table's
// gather 5.9 ms, through binary16 2.8 ms; E5M2 1.4 ms (bfloat16 1.5 ms).

#include "memattn/storage/formats.hpp"
#include "memattn/storage/simd.hpp"
#include "memattn/storage/stored_rows.hpp"

#include <array>
#include <bit>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define MEMATTN_FP8_F16C 1
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace memattn {

/// FP8 K/V storage: one byte per value, the OCP E4M3 format (see the top of
/// storage/fp8.hpp).
struct Fp8E4M3 {};

/// FP8 K/V storage: one byte per value, the OCP E5M2 format (see the top of
/// storage/fp8.hpp).
struct Fp8E5M2 {};

namespace detail {

/// S is one of the FP8 formats.
template <class S>
concept Fp8Storage = std::same_as<S, Fp8E4M3> || std::same_as<S, Fp8E5M2>;

}  // namespace detail

/// FP8 K/V storage with a scale per token: each stored row (one token's key, or value, of
/// one head) is kept as S(x / s) (S = Fp8E4M3 or Fp8E5M2, one byte a value) beside one
/// float s = max|x| / (S's largest value), and read as s · S(x / s) (see the top of
/// storage/fp8.hpp). The scale is folded where it costs least: into the token's logit,
/// s·(q·x̃), and into its weight in the output, (p·s)·x̃, as the scaled FP8 caches of vLLM
/// and SGLang fold theirs (theirs is one per layer).
template <class S>
    requires detail::Fp8Storage<S>
struct PerTokenScale {
    using storage = S;  ///< the format of the scaled values
};

namespace detail {

/// The bit layout of an FP8 format.
template <Fp8Storage S>
struct Fp8Layout {
    static constexpr int exponent_bits = std::same_as<S, Fp8E4M3> ? 4 : 5;
    static constexpr int mantissa_bits = 7 - exponent_bits;
    static constexpr int bias = (1 << (exponent_bits - 1)) - 1;
    static constexpr bool infinities = std::same_as<S, Fp8E5M2>;  ///< IEEE-like: ∞ at the top exponent, m = 0
    static constexpr std::uint8_t nan = infinities ? 0x7E : 0x7F;  ///< the NaN byte of sign +
    static constexpr std::uint8_t infinity = 0x7C;                 ///< E5M2's +∞
    static constexpr float largest = std::same_as<S, Fp8E4M3> ? 448.0f : 57344.0f;
    static constexpr float overflow = std::same_as<S, Fp8E4M3> ? 464.0f : 61440.0f;  ///< largest + half a step
    static constexpr float smallest_normal = std::same_as<S, Fp8E4M3> ? 0x1p-6f : 0x1p-14f;
};

/// The values of an FP8 format, by their byte: (−1)^s · 2^(e − bias) · (1 + m/2^M),
/// subnormal m · 2^(1 − bias − M); NaN (of the byte's sign) and E5M2's ±∞ as the format
/// defines them.
template <Fp8Storage S>
inline constexpr std::array<float, 256> fp8_values = [] {
    using L = Fp8Layout<S>;
    constexpr int M = L::mantissa_bits, top = (1 << L::exponent_bits) - 1;
    std::array<float, 256> values{};
    for (int byte = 0; byte < 256; ++byte) {
        const int e = (byte >> M) & top, m = byte & ((1 << M) - 1);
        float magnitude = 0;
        if (L::infinities && e == top) {
            magnitude = m == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
        } else if (!L::infinities && e == top && m == (1 << M) - 1) {
            magnitude = std::numeric_limits<float>::quiet_NaN();
        } else {
            // e = 0: m · 2^(1 − bias − M); else (2^M + m) · 2^(e − bias − M). Powers of
            // two, so every step is exact.
            magnitude = static_cast<float>(e == 0 ? m : (1 << M) + m);
            for (int k = e == 0 ? 1 : e; k < L::bias + M; ++k)
                magnitude /= 2.0f;
            for (int k = L::bias + M; k < e; ++k)
                magnitude *= 2.0f;
        }
        values[static_cast<std::size_t>(byte)] = (byte & 0x80) != 0 ? -magnitude : magnitude;
    }
    return values;
}();

/// The byte of x in FP8 format S: the nearest value, ties to the even mantissa. Past the
/// format's range (magnitudes from Fp8Layout::overflow on) E4M3 gives NaN and E5M2 ±∞;
/// ±∞ and NaN give E5M2's ±∞ and NaN, and E4M3's NaN; all of the sign of x. By float's
/// bits, no library call (frexp and ldexp cost a third of an FP8 prompt's append).
template <Fp8Storage S>
inline std::uint8_t fp8_encode(float x) noexcept {
    using L = Fp8Layout<S>;
    constexpr int M = L::mantissa_bits, shift = 23 - M;
    const std::uint32_t bits = std::bit_cast<std::uint32_t>(x), magnitude = bits & 0x7FFFFFFFu;
    const auto sign = static_cast<std::uint8_t>((bits >> 24) & 0x80);
    const float a = std::bit_cast<float>(magnitude);
    if (!(a < L::overflow)) {
        if constexpr (L::infinities)
            return static_cast<std::uint8_t>(sign | (std::isnan(x) ? L::nan : L::infinity));
        return static_cast<std::uint8_t>(sign | L::nan);
    }
    if (a < L::smallest_normal) {
        // Subnormal or zero: m · 2^(1 − bias − M), m = 0 … 2^M (2^M: the smallest normal's
        // byte). a · 2^(bias − 1 + M) is exact (a power of two) and below 2^M; added to 2^23,
        // float's own rounding takes it to the nearest integer, ties to even.
        constexpr float scale = static_cast<float>(1 << (L::bias - 1 + M)), magic = 0x1p23f;
        return static_cast<std::uint8_t>(
            sign | (std::bit_cast<std::uint32_t>(a * scale + magic) - std::bit_cast<std::uint32_t>(magic)));
    }
    // Normal: float's exponent and mantissa rounded to M mantissa bits, ties to even (a
    // carry out of the mantissa moves into the exponent, as it should; below overflow it
    // stays within the format), then the exponent rebiased.
    const std::uint32_t rounded = (magnitude + ((1u << (shift - 1)) - 1) + ((magnitude >> shift) & 1u)) >> shift;
    return static_cast<std::uint8_t>(sign | (rounded - (static_cast<std::uint32_t>(127 - L::bias) << M)));
}

#if defined(__AVX512F__)
/// fp8_encode of 16 floats at once, lane by lane the same bytes: the same steps on
/// float's bits, both ways (normal and subnormal) taken and the lane's kept.
template <Fp8Storage S>
inline __m128i fp8_encode16(__m512 x) noexcept {
    using L = Fp8Layout<S>;
    constexpr int M = L::mantissa_bits, shift = 23 - M;
    constexpr float scale = static_cast<float>(1 << (L::bias - 1 + M)), magic = 0x1p23f;
    const auto all = [](int v) { return _mm512_set1_epi32(v); };
    const __m512i bits = _mm512_castps_si512(x), magnitude = _mm512_and_si512(bits, all(0x7FFFFFFF));
    const __m512 a = _mm512_castsi512_ps(magnitude);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(magnitude, shift), all(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(magnitude, all((1 << (shift - 1)) - 1)), lsb), shift);
    __m512i code = _mm512_sub_epi32(rounded, all((127 - L::bias) << M));
    const __m512i small =
        _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_mul_ps(a, _mm512_set1_ps(scale)), _mm512_set1_ps(magic))),
                         all(static_cast<int>(std::bit_cast<std::uint32_t>(magic))));
    code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(L::smallest_normal), _CMP_LT_OQ), small);
    const __mmask16 past = _mm512_cmp_ps_mask(a, _mm512_set1_ps(L::overflow), _CMP_NLT_UQ);  // NaN too
    if constexpr (L::infinities) {
        code = _mm512_mask_mov_epi32(code, past, all(L::infinity));
        code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), all(L::nan));
    } else {
        code = _mm512_mask_mov_epi32(code, past, all(L::nan));
    }
    return _mm512_cvtepi32_epi8(_mm512_or_si512(code, _mm512_and_si512(_mm512_srli_epi32(bits, 24), all(0x80))));
}
#endif

/// The bytes of n values of FP8 format S, value(c) giving the c-th as float: each
/// fp8_encode's, 16 at a time with AVX-512 (fp8_encode16).
template <Fp8Storage S, class Value>
void fp8_encode_span(Index n, const Value& value, std::uint8_t* out) {
    Index c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= n; c += 16) {
        alignas(64) float lanes[16];
        for (Index i = 0; i < 16; ++i)
            lanes[i] = value(c + i);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c), fp8_encode16<S>(_mm512_load_ps(lanes)));
    }
#endif
    for (; c < n; ++c)
        out[c] = fp8_encode<S>(value(c));
}

/// What every FP8 format declares of itself (StorageFormat): compact, unscaled, refusing
/// finite magnitudes from its largest value plus half a step on, held past there as E4M3's
/// NaN or E5M2's ∞.
template <Fp8Storage S>
struct Fp8Declared {
    static constexpr bool compact = true;                          ///< a compact format
    static constexpr bool scaled = false;                          ///< no float scales
    static constexpr float overflow = Fp8Layout<S>::overflow;      ///< refused from here
    static constexpr const char* overflow_to = Fp8Layout<S>::infinities ? "infinity" : "NaN";  ///< held past it as
};

/// FP8 E4M3 as a compact storage format (refused from 464 = 448 + 16).
template <>
struct StorageFormat<Fp8E4M3> : Fp8Declared<Fp8E4M3> {
    static constexpr const char* name = "Fp8E4M3";                      ///< its name in messages
    static constexpr const char* code_name = "fp8_e4m3";                ///< its snapshot type's name
    static constexpr snapshot::TypeCode code = snapshot::TypeCode{14};  ///< its snapshot type code
};

/// FP8 E5M2 as a compact storage format (refused from 61440 = 57344 + 4096).
template <>
struct StorageFormat<Fp8E5M2> : Fp8Declared<Fp8E5M2> {
    static constexpr const char* name = "Fp8E5M2";                      ///< its name in messages
    static constexpr const char* code_name = "fp8_e5m2";                ///< its snapshot type's name
    static constexpr snapshot::TypeCode code = snapshot::TypeCode{15};  ///< its snapshot type code
};

/// FP8 with a scale per token as a compact storage format: a float scale per row, so
/// float's whole range is kept (only a double past it is refused).
template <Fp8Storage S>
struct StorageFormat<PerTokenScale<S>> {
    static constexpr bool compact = true;  ///< a compact format
    static constexpr bool scaled = true;   ///< a float scale per row
    static constexpr bool e4m3 = std::same_as<S, Fp8E4M3>;
    static constexpr const char* name = e4m3 ? "PerTokenScale<Fp8E4M3>" : "PerTokenScale<Fp8E5M2>";  ///< in messages
    static constexpr const char* code_name = e4m3 ? "fp8_e4m3_per_token" : "fp8_e5m2_per_token";  ///< its code's name
    static constexpr snapshot::TypeCode code = snapshot::TypeCode{e4m3 ? 16 : 17};  ///< its snapshot type code
};

#if defined(MEMATTN_FP8_F16C)
/// Bytes of FP8 format S, widened to 16 bits per lane (I: 8 lanes in __m128i or 16 in
/// __m256i), as IEEE binary16 bits. E5M2's byte is the half's upper byte. E4M3's byte,
/// shifted to the upper byte, then arithmetically right by one: its sign stays in bit 15,
/// its exponent and mantissa land in the half's (a value 2^−8 of its own, which
/// fp8_packet multiplies back) and bit 14, a copy of the sign, is cleared; where the byte
/// is E4M3's NaN (S.1111.111) the lane becomes all ones, a half NaN.
template <Fp8Storage S, class I>
inline I fp8_half_bits(I bytes) noexcept {
    constexpr bool wide = sizeof(I) == 32;
    const auto slli = [](I x, int n) {
        if constexpr (wide)
            return _mm256_slli_epi16(x, n);
        else
            return _mm_slli_epi16(x, n);
    };
    if constexpr (std::same_as<S, Fp8E5M2>) {
        return slli(bytes, 8);
    } else if constexpr (wide) {
        const __m256i half = _mm256_and_si256(_mm256_srai_epi16(slli(bytes, 8), 1), _mm256_set1_epi16(-0x4001));
        const __m256i nan = _mm256_cmpeq_epi16(_mm256_or_si256(bytes, _mm256_set1_epi16(0x80)), _mm256_set1_epi16(0xFF));
        return _mm256_or_si256(half, nan);
    } else {
        const __m128i half = _mm_and_si128(_mm_srai_epi16(slli(bytes, 8), 1), _mm_set1_epi16(-0x4001));
        const __m128i nan = _mm_cmpeq_epi16(_mm_or_si128(bytes, _mm_set1_epi16(0x80)), _mm_set1_epi16(0xFF));
        return _mm_or_si128(half, nan);
    }
}
#endif

/// A packet of floats from `packet_lanes<float>` bytes of FP8 format S, each exactly the
/// table's value (NaN for NaN).
template <Fp8Storage S>
inline Packet<float> fp8_packet(const std::uint8_t* p) {
    // E4M3: the half holds the value times 2^−8; times 2^8 back is exact (a power of two,
    // subnormal halves included, and no product past 448).
#if defined(MEMATTN_FP8_F16C) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if constexpr (std::same_as<S, Fp8E4M3>) {
        // Seven instructions where fp8_half_bits takes nine: each byte sign-extended to a
        // word and shifted left by 7 puts its sign in bit 15 and its exponent and mantissa
        // in the half's (bit 14, a copy of the sign, cleared); the NaN bytes (S.1111.111)
        // found by a byte compare into a mask that keeps them out of the rescale, as the
        // NaN fp8_half_bits gives (a half of all ones, to float: 0xFFFFE000).
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        const __m256i half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(raw), 7),
                                              _mm256_set1_epi16(static_cast<short>(~0x4000)));
        const __mmask16 number = _mm_cmpneq_epi8_mask(_mm_or_si128(raw, _mm_set1_epi8(static_cast<char>(0x80))),
                                                      _mm_set1_epi8(static_cast<char>(0xFF)));
        return _mm512_mask_mul_ps(_mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0xFFFFE000u))), number,
                                  _mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
    }
#endif
#if defined(MEMATTN_FP8_F16C) && defined(__AVX512F__)
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512 x = _mm512_cvtph_ps(fp8_half_bits<S>(bytes));
    if constexpr (std::same_as<S, Fp8E5M2>)
        return x;
    else
        return _mm512_mul_ps(x, _mm512_set1_ps(256.0f));
#elif defined(MEMATTN_FP8_F16C)
    const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256 x = _mm256_cvtph_ps(fp8_half_bits<S>(bytes));
    if constexpr (std::same_as<S, Fp8E5M2>)
        return x;
    else
        return _mm256_mul_ps(x, _mm256_set1_ps(256.0f));
#else
    alignas(64) float lanes[packet_lanes<float>];
    for (Index i = 0; i < packet_lanes<float>; ++i)
        lanes[i] = fp8_values<S>[p[i]];
    return Eigen::internal::pload<Packet<float>>(lanes);
#endif
}

/// Whether FP8 rows of format S take the numbers route (StoredRows::numbers_only,
/// fp8_number_packet): E4M3 where its bytes are converted through binary16 (F16C), whose
/// packets then skip the NaN lanes' compare and the rescale by 2^8.
#if defined(MEMATTN_FP8_F16C)
template <Fp8Storage S>
inline constexpr bool fp8_numbers_route = std::same_as<S, Fp8E4M3>;
#else
template <Fp8Storage S>
inline constexpr bool fp8_numbers_route = false;
#endif

/// Whether any of n bytes of FP8 format S is not a number: E4M3's NaN (S.1111.111),
/// E5M2's ±∞ and NaNs (S.11111.xx).
template <Fp8Storage S>
inline bool fp8_holds_non_number(const std::uint8_t* p, Index n) noexcept {
    constexpr std::uint8_t field = std::same_as<S, Fp8E4M3> ? 0x7F : 0x7C;
    bool found = false;
    for (Index i = 0; i < n; ++i)
        found |= (p[i] & field) == field;
    return found;
}

#if defined(MEMATTN_FP8_F16C)
/// fp8_packet of `packet_lanes<float>` bytes of E4M3 none of which is NaN, each value
/// times 2^−8: the binary16 whose bits the byte's are (fp8_half_bits), without the NaN
/// lanes' compare and the rescale (four instructions for 16 values with AVX-512 BW and VL,
/// against seven). The numbers route multiplies the 2^8 into the queries or the weights
/// instead, so each product is the same number, rounded the same.
template <Fp8Storage S>
inline Packet<float> fp8_number_packet(const std::uint8_t* p) {
    static_assert(fp8_numbers_route<S>);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(raw), 7),
                                            _mm256_set1_epi16(static_cast<short>(~0x4000))));
#elif defined(__AVX512F__)
    return _mm512_cvtph_ps(fp8_half_bits<S>(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#else
    return _mm256_cvtph_ps(fp8_half_bits<S>(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#endif
}
#endif

/// A row of `cols` bytes of FP8 format S times s (1 for the unscaled rows, exactly their
/// values) into out, as T: s · value in float, a packet at a time for float, by the table
/// for the columns past the last whole packet and for double.
template <Fp8Storage S, class T>
void fp8_decode_row(const std::uint8_t* x, Index cols, float s, T* out) {
    Index c = 0;
    if constexpr (std::is_same_v<T, float>) {
        using namespace Eigen::internal;
        for (; c + packet_lanes<float> <= cols; c += packet_lanes<float>)
            pstoreu(out + c, pmul(pset1<Packet<float>>(s), fp8_packet<S>(x + c)));
    }
    for (; c < cols; ++c)
        out[c] = static_cast<T>(s * fp8_values<S>[x[c]]);
}

/// fp8_packet as a callable: the loader dot_span and add_span take for FP8 rows.
template <Fp8Storage S>
struct Fp8Packets {
    Packet<float> operator()(const std::uint8_t* p) const { return fp8_packet<S>(p); }
};

#if defined(MEMATTN_FP8_F16C)
/// fp8_number_packet as a callable (dot_span's loader on rows of numbers).
template <Fp8Storage S>
struct Fp8NumberPackets {
    Packet<float> operator()(const std::uint8_t* p) const { return fp8_number_packet<S>(p); }
};
#endif

/// FP8 rows: one byte per value, row-major.
template <class T, Fp8Storage S>
class StoredRows<T, S> {
public:
    static constexpr bool compact = true;
    StoredRows(Index rows, Index cols) : m_(rows, cols), cols_(cols) {}  // Eigen checks rows × cols
    /// StoredRows<T, T>::advise_huge_pages, over each of the format's buffers.
    void advise_huge_pages() const noexcept { advise_huge_pages_of(m_); }

    [[nodiscard]] Index rows() const noexcept { return m_.rows(); }
    [[nodiscard]] Index cols() const noexcept { return cols_; }
    void swap(StoredRows& other) noexcept {
        m_.swap(other.m_);
        std::swap(cols_, other.cols_);
        std::swap(numbers_only_, other.numbers_only_);
    }
    /// No byte written to these rows since they were made was other than a number (E4M3's
    /// NaN, E5M2's ±∞ and NaNs; tracked by put_rows, copy_rows_from and read_rows, and
    /// turned off by row_data_to_write): where fp8_numbers_route<S>, the float tiles and
    /// the single query may then read them by number_packet. It stays off once such a
    /// byte was written, whatever overwrites it.
    [[nodiscard]] bool numbers_only() const noexcept { return numbers_only_; }

    /// Rows [first, first + rows) = the rows, each value rounded to S (double through
    /// float: one rounding to S's precision, as float's would be, since float's
    /// significand is more than twice as long).
    template <class D>
    void put_rows(Index first, const D& rows) {
        for (Index r = 0; r < rows.rows(); ++r) {
            fp8_encode_span<S>(cols_, [&](Index c) { return static_cast<float>(rows(r, c)); }, at(first + r, 0));
            note_bytes(first + r, 1);
        }
    }
    void copy_rows_from(const StoredRows& other, Index n) {
        if (n > 0 && cols_ > 0)
            std::memcpy(at(0, 0), other.at(0, 0), row_bytes(cols_) * static_cast<std::size_t>(n));
        numbers_only_ = numbers_only_ && other.numbers_only_;
    }
    /// Rows [to, to + n) = rows [from, from + n), the two ranges apart.
    void copy_within(Index from, Index to, Index n) {
        if (n > 0 && cols_ > 0)
            std::memcpy(at(to, 0), at(from, 0), row_bytes(cols_) * static_cast<std::size_t>(n));
    }
    /// Rows [first, first + n) in T (fp8_decode_row).
    void decode_rows(Index first, Index n, T* out, Index ld) const {
        for (Index r = 0; r < n; ++r)
            fp8_decode_row<S>(at(first + r, 0), cols_, 1.0f, out + r * ld);
    }

    /// Asks for a row towards the cache ahead of its use.
    void prefetch_row(Index row) const { prefetch_rows(at(row, 0), 1, 0, cols_); }

    /// q·row in float, converted in registers (dot_span with fp8_packet).
    [[nodiscard]] float dot(Index row, const float* q) const { return dot_by(row, q, Fp8Packets<S>{}, 1.0f); }
    /// acc += w · row in float, converted in registers (add_span with fp8_packet).
    void add_scaled(Index row, float w, float* acc) const {
        const std::uint8_t* x = at(row, 0);
        for (Index c = add_span(w, x, cols_, acc, Fp8Packets<S>{}); c < cols_; ++c)
            acc[c] += w * fp8_values<S>[x[c]];
    }
    /// add_scaled for rows [first, first + n) with weights w, acc in registers
    /// (add_rows_in_registers; fused_storage).
    void add_rows(Index first, Index n, const float* w, float* acc, Index ahead, Index prefetch_end) const {
        add_rows_in_registers(*this, first, n, w, acc, ahead, prefetch_end);
    }
    [[nodiscard]] Packet<float> packet(Index r, Index c) const { return fp8_packet<S>(at(r, c)); }
    [[nodiscard]] float scalar(Index r, Index c) const { return fp8_values<S>[*at(r, c)]; }
    [[nodiscard]] static float weight(Index, Index, float w) { return w; }
    /// The stored values as float, exactly as decode_rows gives them: a packet from
    /// column c (c + lanes ≤ cols; fused_storage), and one value.
    [[nodiscard]] Packet<float> stored_packet(Index r, Index c) const { return fp8_packet<S>(at(r, c)); }
    [[nodiscard]] float stored_value(Index r, Index c) const { return fp8_values<S>[*at(r, c)]; }
#if defined(MEMATTN_FP8_F16C)
    /// Where numbers_only() (fp8_numbers_route<S>): stored_packet times 2^−8
    /// (fp8_number_packet), and that factor, which the reader multiplies into the other
    /// operand of each product.
    [[nodiscard]] Packet<float> number_packet(Index r, Index c) const
        requires fp8_numbers_route<S>
    {
        return fp8_number_packet<S>(at(r, c));
    }
    static constexpr float number_factor = 256.0f;
    /// dot on rows of numbers with q times number_factor: the same products, the same sum.
    [[nodiscard]] float number_dot(Index row, const float* q) const
        requires fp8_numbers_route<S>
    {
        return dot_by(row, q, Fp8NumberPackets<S>{}, number_factor);
    }
    /// add_rows on rows of numbers: each weight times number_factor, each value divided by
    /// it (the same products, the same sums).
    void add_number_rows(Index first, Index n, const float* w, float* acc, Index ahead, Index prefetch_end) const
        requires fp8_numbers_route<S>
    {
        struct Numbers {
            const StoredRows& rows;
            [[nodiscard]] Index cols() const noexcept { return rows.cols(); }
            void prefetch_row(Index r) const { rows.prefetch_row(r); }
            [[nodiscard]] Packet<float> packet(Index r, Index c) const { return rows.number_packet(r, c); }
            [[nodiscard]] float scalar(Index r, Index c) const { return rows.scalar(r, c) / number_factor; }
            [[nodiscard]] static float weight(Index, Index, float w) { return w * number_factor; }
        };
        add_rows_in_registers(Numbers{*this}, first, n, w, acc, ahead, prefetch_end);
    }
#endif

    [[nodiscard]] std::size_t bytes(Index rows) const noexcept { return row_bytes(cols_) * static_cast<std::size_t>(rows); }
    [[nodiscard]] static std::size_t row_bytes(Index cols) noexcept { return static_cast<std::size_t>(cols); }

    void write_rows(snapshot::Writer& w, Index first, Index n) const {
        for (Index r = first; r < first + n; ++r)
            for (Index c = 0; c < cols_; ++c)
                w.number(*at(r, c));
    }
    void read_rows(snapshot::Reader& r, Index first, Index n) {
        for (Index i = first; i < first + n; ++i)
            for (Index c = 0; c < cols_; ++c)
                *at(i, c) = r.number<std::uint8_t>("rows");
        note_bytes(first, n);
    }

    /// Row r's bytes.
    [[nodiscard]] const std::uint8_t* row_data(Index r) const noexcept { return at(r, 0); }
    /// Row r's bytes to write (the scaled rows of PerTokenScale<S> write theirs): what the
    /// writer puts there is not looked at, so numbers_only() turns off.
    [[nodiscard]] std::uint8_t* row_data_to_write(Index r) noexcept {
        numbers_only_ = false;
        return at(r, 0);
    }

private:
    [[nodiscard]] std::uint8_t* at(Index r, Index c) noexcept { return m_.data() + r * cols_ + c; }
    /// q·row with the packets `load` gives (dot_span), the columns past them by the table,
    /// each value divided by `divisor` (1, or number_factor for number_dot: exact).
    template <class Load>
    [[nodiscard]] float dot_by(Index row, const float* q, Load load, float divisor) const {
        const std::uint8_t* x = at(row, 0);
        const Index packed = cols_ / packet_lanes<float> * packet_lanes<float>;
        float sum = Eigen::internal::predux(dot_span(q, x, packed, Eigen::internal::pset1<Packet<float>>(0.0f), load));
        for (Index c = packed; c < cols_; ++c)
            sum += q[c] * (fp8_values<S>[x[c]] / divisor);
        return sum;
    }
    /// numbers_only() off if rows [first, first + n) hold a byte that is not a number.
    void note_bytes(Index first, Index n) noexcept {
        if (numbers_only_ && n > 0 && fp8_holds_non_number<S>(at(first, 0), n * cols_))
            numbers_only_ = false;
    }
    [[nodiscard]] const std::uint8_t* at(Index r, Index c) const noexcept { return m_.data() + r * cols_ + c; }

    Eigen::Matrix<std::uint8_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> m_;  ///< the bytes, row-major
    Index cols_;
    bool numbers_only_ = true;
};

/// FP8 rows with a scale per row (PerTokenScale<S>): the bytes of S(x / s) as
/// StoredRows<T, S> keeps them, and the scales s = max|x| / largest beside them. A row's
/// value is s · S(x / s), rounded once in float. A row holding ±∞ or NaN gets a NaN
/// scale, so it reads as NaN throughout (Q8's rule for a block); a row of magnitudes all
/// below largest · 2^−126 takes the scale 2^−126 (float's smallest normal), so zero rows
/// and tiny ones divide by no zero and no subnormal.
template <class T, Fp8Storage S>
class StoredRows<T, PerTokenScale<S>> {
public:
    static constexpr bool compact = true;
    StoredRows(Index rows, Index cols) : codes_(rows, cols), scales_(rows) {}
    /// StoredRows<T, T>::advise_huge_pages, over each of the format's buffers.
    void advise_huge_pages() const noexcept {
        codes_.advise_huge_pages();
        advise_huge_pages_of(scales_);
    }

    [[nodiscard]] Index rows() const noexcept { return codes_.rows(); }
    [[nodiscard]] Index cols() const noexcept { return codes_.cols(); }
    void swap(StoredRows& other) noexcept {
        codes_.swap(other.codes_);
        scales_.swap(other.scales_);
    }

    /// Rows [first, first + rows) = the rows, each with its scale (double through float).
    template <class D>
    void put_rows(Index first, const D& rows) {
        const Index d = cols();
        for (Index r = 0; r < rows.rows(); ++r) {
            float amax = 0;
            bool finite = true;
            for (Index c = 0; c < d; ++c) {
                const auto x = static_cast<float>(rows(r, c));
                finite = finite && std::isfinite(x);
                amax = std::max(amax, std::abs(x));
            }
            const float s = finite ? std::max(amax / Fp8Layout<S>::largest, std::numeric_limits<float>::min())
                                   : std::numeric_limits<float>::quiet_NaN();
            scales_(first + r) = s;
            // |x / s| ≤ largest (to float's rounding): no refusal
            fp8_encode_span<S>(d, [&](Index c) { return static_cast<float>(rows(r, c)) / s; },
                               codes_.row_data_to_write(first + r));
        }
    }
    void copy_rows_from(const StoredRows& other, Index n) {
        codes_.copy_rows_from(other.codes_, n);
        scales_.head(n) = other.scales_.head(n);
    }
    /// Rows [to, to + n) = rows [from, from + n), the two ranges apart.
    void copy_within(Index from, Index to, Index n) {
        codes_.copy_within(from, to, n);
        scales_.segment(to, n) = scales_.segment(from, n);
    }
    /// Rows [first, first + n) in T: s · value in float (fp8_decode_row).
    void decode_rows(Index first, Index n, T* out, Index ld) const {
        for (Index r = 0; r < n; ++r)
            fp8_decode_row<S>(codes_.row_data(first + r), cols(), scales_(first + r), out + r * ld);
    }

    /// Asks for a row and its scale towards the cache ahead of their use.
    void prefetch_row(Index row) const {
        codes_.prefetch_row(row);
        prefetch_rows(scales_.data() + row, 1, 0, 1);
    }

    /// q·row in float: s · (q · S(x / s)), the sum in registers.
    [[nodiscard]] float dot(Index row, const float* q) const { return scales_(row) * codes_.dot(row, q); }
    /// acc += w · row in float: the weight times the scale, then the values in registers.
    void add_scaled(Index row, float w, float* acc) const { codes_.add_scaled(row, w * scales_(row), acc); }
    /// add_scaled for rows [first, first + n) with weights w, acc in registers
    /// (add_rows_in_registers; fused_storage).
    void add_rows(Index first, Index n, const float* w, float* acc, Index ahead, Index prefetch_end) const {
        add_rows_in_registers(*this, first, n, w, acc, ahead, prefetch_end);
    }
    [[nodiscard]] Packet<float> packet(Index r, Index c) const { return fp8_packet<S>(codes_.row_data(r) + c); }
    [[nodiscard]] float scalar(Index r, Index c) const { return fp8_values<S>[codes_.row_data(r)[c]]; }
    [[nodiscard]] float weight(Index r, Index, float w) const { return w * scales_(r); }
    /// The stored values as float, exactly as decode_rows gives them (s · value): a packet
    /// from column c (c + lanes ≤ cols; fused_storage), and one value.
    [[nodiscard]] Packet<float> stored_packet(Index r, Index c) const {
        return Eigen::internal::pmul(Eigen::internal::pset1<Packet<float>>(scales_(r)), packet(r, c));
    }
    [[nodiscard]] float stored_value(Index r, Index c) const { return scales_(r) * scalar(r, c); }

    [[nodiscard]] std::size_t bytes(Index rows) const noexcept { return row_bytes(cols()) * static_cast<std::size_t>(rows); }
    [[nodiscard]] static std::size_t row_bytes(Index cols) noexcept {
        return static_cast<std::size_t>(cols) + sizeof(float);
    }

    /// Each row as its scale, then its bytes.
    void write_rows(snapshot::Writer& w, Index first, Index n) const {
        for (Index r = first; r < first + n; ++r) {
            w.number(scales_(r));
            codes_.write_rows(w, r, 1);
        }
    }
    void read_rows(snapshot::Reader& rd, Index first, Index n) {
        for (Index r = first; r < first + n; ++r) {
            scales_(r) = rd.number<float>("rows");
            codes_.read_rows(rd, r, 1);
        }
    }

private:
    StoredRows<T, S> codes_;                   ///< S(x / s), row by row
    Eigen::Matrix<float, Eigen::Dynamic, 1> scales_;  ///< s, one per row
};

}  // namespace detail
}  // namespace memattn
