#pragma once
// IntegerDot<S>: a single query's q·k in integers over keys stored as a block-scaled S,
// the query rounded to int8 per block (IntegerQuery), each block's products exact in
// int32 (vpdpbusd with VNNI, vpmaddubsw + vpmaddwd with AVX2).

#include "memattn/storage/simd.hpp"
#include "memattn/storage/stored_rows.hpp"

namespace memattn::detail {

/// A query rounded for the integer Q·K of `IntegerDot<S>`: per block of 32 values a
/// scale s_q = max|q|/127 and codes round(q/s_q) ∈ [−127, 127] (the query's q̃ = s_q·code
/// is within s_q/2 of q), zero past the last value up to a whole block; per lane of four
/// codes (vpdpbusd's and vpmaddwd's) −8 × their sum, Q4's offset (Σ q·(u − 8) starts
/// from it); per block s_q · Σ codes, Q4Affine's zero point term. A block holding ±∞ or
/// NaN gets a NaN scale, so every logit it meets is NaN, as q·k would be non-finite.
/// Rounded in double (127/max|q| overflows float below 3.7e-37), once per attend.
struct IntegerQuery {
    static constexpr Index block = 32;
    /// The widest query it holds (2.3 KiB on the stack); a wider head takes the float dot.
    static constexpr Index max_depth = 1024;
    alignas(64) std::int8_t code[max_depth];
    alignas(64) std::int32_t q4_offset[max_depth / 4];
    float scale[max_depth / block];
    float code_sum[max_depth / block];

    void round(const float* q, Index d) noexcept {
        MEMATTN_DASSERT(d >= 0 && d <= max_depth);
        for (Index b = 0; b * block < d; ++b) {
            const Index c0 = b * block, n = std::min(block, d - c0);
            float amax = 0;
            bool finite = true;
            for (Index c = c0; c < c0 + n; ++c) {
                finite = finite && std::isfinite(q[c]);
                amax = std::max(amax, std::abs(q[c]));
            }
            const double inverse = finite && amax > 0 ? 127.0 / static_cast<double>(amax) : 0.0;
            int sum = 0;
            for (Index c = c0; c < c0 + block; ++c) {
                const bool inside = c < c0 + n && finite;  // a non-finite block's codes are 0 (its scale is NaN)
                const int x = inside ? static_cast<int>(std::nearbyint(static_cast<double>(q[c]) * inverse)) : 0;
                code[c] = static_cast<std::int8_t>(x);
                sum += x;
            }
            for (Index l = c0 / 4; l < (c0 + block) / 4; ++l)
                q4_offset[l] = -8 * (code[4 * l] + code[4 * l + 1] + code[4 * l + 2] + code[4 * l + 3]);
            scale[b] = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
            code_sum[b] = scale[b] * static_cast<float>(sum);
        }
    }
};

/// The integer products of one block of 32 codes (AVX2 and later), per int32 lane the
/// sum of four products, exact: Σ k·q for int8 keys |k| ≤ 127 (by |k| unsigned times q
/// with k's sign: a pair of products stays below 2^15, so vpmaddubsw cannot saturate), and
/// acc + Σ u·q for 4-bit codes u ∈ [0, 15]. vpdpbusd with AVX512-VNNI (and VL) or
/// AVX-VNNI, vpmaddubsw + vpmaddwd elsewhere.
#if defined(__AVX2__)
inline constexpr bool integer_blocks = true;
inline __m256i dot_u8_s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
inline __m256i int8_block_dot(const std::int8_t* k, const std::int8_t* q) {
    const __m256i kv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k));
    const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    return dot_u8_s8(_mm256_setzero_si256(), _mm256_abs_epi8(kv), _mm256_sign_epi8(qv, kv));
}
/// A 4-bit block's 16 bytes as its 32 codes, in order: the low nibbles, then the high.
inline __m256i nibble_codes(const std::uint8_t* p) {
    const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_and_si256(_mm256_srlv_epi64(bytes, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}
inline float sum_lanes8(__m256 a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
/// Σ_b s[b]·s_q,b·Σ code·k over the first `whole` Q8 blocks of a row (codes x, scales s):
/// even and odd blocks on two accumulators, as the float dot's.
inline float q8_integer_blocks(const std::int8_t* x, const float* s, const IntegerQuery& q, Index whole) {
    constexpr Index block = IntegerQuery::block;
    __m256 even = _mm256_setzero_ps(), odd = even;
    Index b = 0;
    for (; b + 1 < whole; b += 2) {
        const __m256i e = int8_block_dot(x + b * block, q.code + b * block);
        const __m256i o = int8_block_dot(x + (b + 1) * block, q.code + (b + 1) * block);
        even = _mm256_fmadd_ps(_mm256_cvtepi32_ps(e), _mm256_set1_ps(s[b] * q.scale[b]), even);
        odd = _mm256_fmadd_ps(_mm256_cvtepi32_ps(o), _mm256_set1_ps(s[b + 1] * q.scale[b + 1]), odd);
    }
    if (b < whole) {
        const __m256i e = int8_block_dot(x + b * block, q.code + b * block);
        even = _mm256_fmadd_ps(_mm256_cvtepi32_ps(e), _mm256_set1_ps(s[b] * q.scale[b]), even);
    }
    return sum_lanes8(_mm256_add_ps(even, odd));
}
/// Σ_b s[b]·s_q,b·Σ code·(u − 8) (Q4: the lanes start from −8·Σ code) or Σ code·u
/// (ZeroPoint) over `blocks` 4-bit blocks of 16 bytes (x) with scales s.
template <bool ZeroPoint>
float q4_integer_blocks(const std::uint8_t* x, const float* s, const IntegerQuery& q, Index blocks) {
    constexpr Index block = IntegerQuery::block;
    __m256 acc = _mm256_setzero_ps();
    for (Index b = 0; b < blocks; ++b) {
        const __m256i start =
            ZeroPoint ? _mm256_setzero_si256() : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.q4_offset + b * 8));
        const __m256i dot = dot_u8_s8(start, nibble_codes(x + b * (block / 2)),
                                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.code + b * block)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s[b] * q.scale[b]), acc);
    }
    return sum_lanes8(acc);
}
#else
inline constexpr bool integer_blocks = false;
// Declared only, for code that names them where integer_blocks is false (never called).
float q8_integer_blocks(const std::int8_t* x, const float* s, const IntegerQuery& q, Index whole);
template <bool ZeroPoint>
float q4_integer_blocks(const std::uint8_t* x, const float* s, const IntegerQuery& q, Index blocks);
#endif

/// `IntegerDot<S>`: the rows of S, whose integer_dot the single-query attend reads.
template <class T, class S>
class StoredRows<T, IntegerDot<S>> : public StoredRows<T, S> {
public:
    using StoredRows<T, S>::StoredRows;
};

}  // namespace memattn::detail
