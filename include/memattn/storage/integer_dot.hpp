#pragma once
// IntegerDot<S>: a query's q·k in integers over keys stored as a block-scaled S, the
// query rounded to int8 per block (IntegerQuery; a group's queries: IntegerGroup), each
// block's products exact in int32 (vpdpbusd with VNNI, vpmaddubsw + vpmaddwd with AVX2),
// and the helpers of the grouped Q8 logits (transposed_words, transposed_scales).

#include "memattn/storage/simd.hpp"
#include "memattn/storage/stored_rows.hpp"

#include <cstring>

namespace memattn::detail {

/// One block of a query (n ≤ 32 values from q) rounded for the integer Q·K: writes
/// round(q/s_q) ∈ [−127, 127] for s_q = max|q|/127 to code[0, n) and zeros to code[n, 32),
/// and returns s_q; a block holding ±∞ or NaN gets zero codes and a NaN scale, so every
/// logit it meets is NaN, as q·k would be non-finite. Rounded in double (127/max|q|
/// overflows float below 3.7e-37).
inline float round_query_block(const float* q, Index n, std::int8_t* code) noexcept {
    float amax = 0;
    bool finite = true;
    for (Index c = 0; c < n; ++c) {
        finite = finite && std::isfinite(q[c]);
        amax = std::max(amax, std::abs(q[c]));
    }
    const double inverse = finite && amax > 0 ? 127.0 / static_cast<double>(amax) : 0.0;
    for (Index c = 0; c < 32; ++c) {
        const bool inside = c < n && finite;  // a non-finite block's codes are 0 (its scale is NaN)
        code[c] = static_cast<std::int8_t>(inside ? static_cast<int>(std::nearbyint(static_cast<double>(q[c]) * inverse)) : 0);
    }
    return finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
}

/// A query rounded for the integer Q·K of `IntegerDot<S>`: per block of 32 values a
/// scale s_q = max|q|/127 and codes round(q/s_q) ∈ [−127, 127] (the query's q̃ = s_q·code
/// is within s_q/2 of q), zero past the last value up to a whole block
/// (round_query_block); per lane of four codes (vpdpbusd's and vpmaddwd's) −8 × their
/// sum, Q4's offset (Σ q·(u − 8) starts from it); per block s_q · Σ codes, Q4Affine's
/// zero point term. Once per attend.
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
            const Index c0 = b * block;
            scale[b] = round_query_block(q + c0, std::min(block, d - c0), code + c0);
            int sum = 0;
            for (Index c = c0; c < c0 + block; ++c)
                sum += code[c];
            for (Index l = c0 / 4; l < (c0 + block) / 4; ++l)
                q4_offset[l] = -8 * (code[4 * l] + code[4 * l + 1] + code[4 * l + 2] + code[4 * l + 3]);
            code_sum[b] = scale[b] * static_cast<float>(sum);
        }
    }
};

/// Keys a group's Q8 integer logits take at once (StoredRows<T, Q8>::integer_logits):
/// sixteen per vpdpbusd with AVX-512 VNNI, eight per vpmaddubsw with AVX2 and FMA, else
/// one.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline constexpr int integer_group_keys = 16;
#elif defined(__AVX2__) && defined(__FMA__)
inline constexpr int integer_group_keys = 8;
#else
inline constexpr int integer_group_keys = 1;
#endif

/// The queries of a group (g ≤ 16 of them, d ≤ 256), each rounded as IntegerQuery rounds
/// one (the same codes and scales), for the grouped integer logits of Q8 keys
/// (StoredRows<T, Q8>::integer_logits): per query its codes (with AVX-512 VNNI read as
/// words of four, what vpdpbusd broadcasts; with AVX2 their magnitudes too, vpmaddubsw's
/// unsigned operand), per block its scale and −128 · Σ codes (the keys enter vpdpbusd
/// as unsigned bytes k + 128). Once per attend, on the grouped
/// attend's stack.
struct IntegerGroup {
    static constexpr Index block = 32;
    static constexpr Index max_queries = 16, max_depth = 256, max_blocks = max_depth / block;
    alignas(64) std::int8_t code[max_queries][max_depth];
    // |code|, the unsigned operand of the AVX2 products (integer_group_keys = 8 only)
    alignas(64) std::int8_t magnitude[integer_group_keys == 8 ? max_queries : 1][max_depth];
    std::int32_t offset[max_queries][max_blocks];
    float scale[max_queries][max_blocks];
    Index queries = 0;

    /// Rounds the g rows of d values of q (row stride ldq).
    void round(const float* q, Index ldq, Index g, Index d) noexcept {
        MEMATTN_DASSERT(g >= 0 && g <= max_queries && d >= 0 && d <= max_depth);
        queries = g;
        for (Index r = 0; r < g; ++r)
            for (Index b = 0; b * block < d; ++b) {
                const Index c0 = b * block;
                scale[r][b] = round_query_block(q + r * ldq + c0, std::min(block, d - c0), code[r] + c0);
                int sum = 0;
                for (Index c = c0; c < c0 + block; ++c) {
                    sum += code[r][c];
                    if constexpr (integer_group_keys == 8)
                        magnitude[r][c] = static_cast<std::int8_t>(std::abs(code[r][c]));
                }
                offset[r][b] = -128 * sum;
            }
    }
    /// Codes 4c … 4c + 3 of query r as one word (vpdpbusd's broadcast operand).
    [[nodiscard]] std::int32_t word(Index r, Index c) const noexcept {
        std::int32_t w;
        std::memcpy(&w, code[r] + 4 * c, sizeof w);
        return w;
    }
    /// Their magnitudes as one word (integer_group_keys = 8).
    [[nodiscard]] std::int32_t magnitude_word(Index r, Index c) const noexcept {
        std::int32_t w;
        std::memcpy(&w, magnitude[r] + 4 * c, sizeof w);
        return w;
    }
};

/// c + a·b rounded once where the target has fused multiply-adds (the order of the
/// integer logits' block sums, the same in the single-query and the grouped route), and
/// rounded twice elsewhere (no grouped route there to agree with).
inline float fused_add(float a, float b, float c) noexcept {
#if defined(__FMA__)
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
}

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
/// The exact Σ code·k of two whole Q8 blocks (codes x, the query's q), as int32 lanes 0
/// and 1.
inline __m128i q8_two_block_dots(const std::int8_t* x, const std::int8_t* q) {
    const __m256i e = int8_block_dot(x, q), o = int8_block_dot(x + 32, q + 32);
    const __m256i h = _mm256_hadd_epi32(e, o);  // pairs: e e o o | e e o o
    const __m256i hh = _mm256_hadd_epi32(h, h);  // e o e o | e o e o
    return _mm_add_epi32(_mm256_castsi256_si128(hh), _mm256_extracti128_si256(hh, 1));
}
/// The exact Σ code·k of one whole Q8 block.
inline std::int32_t q8_block_dot(const std::int8_t* x, const std::int8_t* q) {
    const __m256i e = int8_block_dot(x, q);
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(e), _mm256_extracti128_si256(e, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1)));
}
/// Eight rows' words (row k's 32 bytes from p[k] + offset) transposed: lane k of t[c] is
/// row k's bytes 4c … 4c + 3. An 8 × 8 transpose of int32: unpacks of words, then of
/// pairs, then one exchange of 128-bit halves per output.
inline void transposed_words8(const std::int8_t* const (&p)[8], Index offset, __m256i (&t)[8]) {
    __m256i z[8], u[8];
    for (int i = 0; i < 8; ++i)
        z[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[i] + offset));
    for (int i = 0; i < 8; i += 2) {  // per half: words (0 1) of rows i, i+1; then (2 3)
        u[i] = _mm256_unpacklo_epi32(z[i], z[i + 1]);
        u[i + 1] = _mm256_unpackhi_epi32(z[i], z[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {  // z[i + c]: word c (low half) and c + 4 (high half) of rows i … i+3
        z[i] = _mm256_unpacklo_epi64(u[i], u[i + 2]);
        z[i + 1] = _mm256_unpackhi_epi64(u[i], u[i + 2]);
        z[i + 2] = _mm256_unpacklo_epi64(u[i + 1], u[i + 3]);
        z[i + 3] = _mm256_unpackhi_epi64(u[i + 1], u[i + 3]);
    }
    for (int c = 0; c < 4; ++c) {
        t[c] = _mm256_permute2x128_si256(z[c], z[c + 4], 0x20);
        t[c + 4] = _mm256_permute2x128_si256(z[c], z[c + 4], 0x31);
    }
}
/// Σ_b (s[b]·s_q,b)·D_b over the first `whole` Q8 blocks of a row (codes x, scales s),
/// D_b the block's exact Σ code·k, one fused multiply-add per block in order of b from
/// `sum`: the order of StoredRows<T, Q8>::integer_logits, whose logits are these bits.
inline float q8_integer_blocks(const std::int8_t* x, const float* s, const IntegerQuery& q, Index whole, float sum) {
    constexpr Index block = IntegerQuery::block;
    Index b = 0;
    for (; b + 1 < whole; b += 2) {
        const __m128i dots = q8_two_block_dots(x + b * block, q.code + b * block);
        sum = fused_add(static_cast<float>(_mm_cvtsi128_si32(dots)), s[b] * q.scale[b], sum);
        sum = fused_add(static_cast<float>(_mm_extract_epi32(dots, 1)), s[b + 1] * q.scale[b + 1], sum);
    }
    if (b < whole)
        sum = fused_add(static_cast<float>(q8_block_dot(x + b * block, q.code + b * block)), s[b] * q.scale[b], sum);
    return sum;
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
std::int32_t q8_block_dot(const std::int8_t* x, const std::int8_t* q);
float q8_integer_blocks(const std::int8_t* x, const float* s, const IntegerQuery& q, Index whole, float sum);
template <bool ZeroPoint>
float q4_integer_blocks(const std::uint8_t* x, const float* s, const IntegerQuery& q, Index blocks);
#endif

/// The grouped integer logits of Q8 keys (StoredRows<T, Q8>::integer_logits): AVX-512
/// with VNNI, BW and VL, where vpdpbusd multiplies sixteen keys' words of four codes by a
/// query's broadcast word in one instruction.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline constexpr bool integer_group_logits = true;
/// Sixteen rows' bytes [offset, offset + 32) (row k from p[k]; the bytes past `mask`'s
/// read as 0) as eight vectors of words: t[c] lane k = row k's bytes 4c … 4c + 3, each
/// + 128 (vpdpbusd's unsigned operand). Rows k and k + 8 share a register, two 8 × 8
/// transposes of words run side by side (unpacks of words, then of pairs), then one
/// permute of quads per output puts the four groups of four rows in order.
inline void transposed_words(const std::int8_t* const (&p)[16], Index offset, __mmask32 mask, __m512i (&t)[8]) {
    __m512i z[8], u[8];
    for (int i = 0; i < 8; ++i)
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi8(mask, p[i] + offset)),
                                  _mm256_maskz_loadu_epi8(mask, p[i + 8] + offset), 1);
    for (int i = 0; i < 8; i += 2) {  // per 128-bit lane: words (0 1) of rows i, i+1; then (2 3)
        u[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
        u[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {  // z[i + c]: word c (lane 0, 2) and c + 4 (lane 1, 3) of rows i … i+3
        z[i] = _mm512_unpacklo_epi64(u[i], u[i + 2]);
        z[i + 1] = _mm512_unpackhi_epi64(u[i], u[i + 2]);
        z[i + 2] = _mm512_unpacklo_epi64(u[i + 1], u[i + 3]);
        z[i + 3] = _mm512_unpackhi_epi64(u[i + 1], u[i + 3]);
    }
    const __m512i low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    const __m512i bias = _mm512_set1_epi8(-128);
    for (int c = 0; c < 4; ++c) {
        t[c] = _mm512_xor_si512(_mm512_permutex2var_epi64(z[c], low, z[c + 4]), bias);
        t[c + 4] = _mm512_xor_si512(_mm512_permutex2var_epi64(z[c], high, z[c + 4]), bias);
    }
}
/// The scales of `blocks` ≤ 4 blocks of `rows` ≤ 16 consecutive rows (rows × blocks floats
/// from s) by block: lane k of sk[b] is row k's scale of block b, 0 past `rows`. Four
/// loads and three permutes per block instead of a gather (one per block, which measured
/// slower on a Zen 5 than the whole block's products for a group of four).
inline void transposed_scales(const float* s, Index rows, Index blocks, __m512 (&sk)[4]) {
    const Index total = rows * blocks;
    const auto part = [&](Index from) {  // the 16 floats from `from`, those below total
        const Index left = std::clamp<Index>(total - from, 0, 16);
        return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << left) - 1), left > 0 ? s + from : s);
    };
    const __m512 a0 = part(0), a1 = part(16), b0 = part(8 * blocks), b1 = part(8 * blocks + 16);
    const __m512i lane = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm512_set1_epi32(static_cast<int>(blocks)));
    for (Index b = 0; b < blocks; ++b) {  // rows 0–7 from (a0, a1), rows 8–15 from (b0, b1)
        const __m512i at = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(b)));
        sk[b] = _mm512_shuffle_f32x4(_mm512_permutex2var_ps(a0, at, a1), _mm512_permutex2var_ps(b0, at, b1), 0x44);
    }
}
#else
inline constexpr bool integer_group_logits = false;
#endif

/// `IntegerDot<S>`: the rows of S, whose integer_dot the single-query attend reads.
template <class T, class S>
class StoredRows<T, IntegerDot<S>> : public StoredRows<T, S> {
public:
    using StoredRows<T, S>::StoredRows;
};

}  // namespace memattn::detail
