#pragma once
// Q8 rows: int8 values with one float scale per block of 32 values of a row
// (llama.cpp's q8_0).

#include "memattn/storage/integer_dot.hpp"
#include "memattn/storage/simd.hpp"
#include "memattn/storage/stored_rows.hpp"

#include <algorithm>

namespace memattn::detail {

/// Q8's rounding of n values that share a scale (a block of a row, or a channel of a
/// group of keys): returns s = max|x_i| / 127 and writes round(x_i / s) to
/// codes[i·stride]; a block holding ±∞ or NaN gets a NaN scale and zero codes.
inline float q8_quantise(const float* x, Index n, std::int8_t* codes, Index stride) {
    float amax = 0;
    bool finite = true;
    for (Index i = 0; i < n; ++i) {
        finite = finite && std::isfinite(x[i]);
        amax = std::max(amax, std::abs(x[i]));
    }
    float s = !finite ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
    if (finite && !std::isfinite(127.0f * s))  // amax near FLT_MAX: s rounded up past it
        s = std::nextafter(s, 0.0f);
    // 127 / amax overflows float for amax below 127 / FLT_MAX (~3.7e-37): such a block is
    // scaled in double, where it cannot, and rounds as float's would.
    const float inverse = finite && amax > 0 ? 127.0f / amax : 0.0f;
    const bool tiny = !std::isfinite(inverse);
    const double tiny_inverse = tiny ? 127.0 / static_cast<double>(amax) : 0.0;
    for (Index i = 0; i < n; ++i) {
        const float scaled = tiny ? static_cast<float>(static_cast<double>(x[i]) * tiny_inverse)
                                  : x[i] * inverse;  // |scaled| ≤ 127
        codes[i * stride] = static_cast<std::int8_t>(finite ? std::nearbyint(scaled) : 0.0f);
    }
    return s;
}

/// Q8: int8 values and one float scale per block of 32 values of a row.
template <class T>
class StoredRows<T, Q8> {
public:
    static constexpr bool compact = true;
    StoredRows(Index rows, Index cols) : q_(rows, cols), scales_(rows, q8_blocks(cols)) {}
    /// StoredRows<T, T>::advise_huge_pages, over each of the format's buffers.
    void advise_huge_pages() const noexcept {
        advise_huge_pages_of(q_);
        advise_huge_pages_of(scales_);
    }

    [[nodiscard]] Index rows() const noexcept { return q_.rows(); }
    [[nodiscard]] Index cols() const noexcept { return q_.cols(); }
    void swap(StoredRows& other) noexcept {
        q_.swap(other.q_);
        scales_.swap(other.scales_);
    }

    template <class D>
    void put_rows(Index first, const D& rows) {
        for (Index r = 0; r < rows.rows(); ++r)
            for (Index b = 0; b < scales_.cols(); ++b) {
                const Index c0 = b * Q8::block, n = std::min(Q8::block, cols() - c0);
                float x[Q8::block];
                for (Index c = 0; c < n; ++c)
                    x[c] = static_cast<float>(rows(r, c0 + c));
                scales_(first + r, b) = q8_quantise(x, n, &q_(first + r, c0), 1);
            }
    }
    void copy_rows_from(const StoredRows& other, Index n) {
        q_.topRows(n) = other.q_.topRows(n);
        scales_.topRows(n) = other.scales_.topRows(n);
    }
    /// Rows [to, to + n) = rows [from, from + n), the two ranges apart.
    void copy_within(Index from, Index to, Index n) {
        q_.middleRows(to, n) = q_.middleRows(from, n);
        scales_.middleRows(to, n) = scales_.middleRows(from, n);
    }
    void decode_rows(Index first, Index n, T* out, Index ld) const {
        for (Index r = 0; r < n; ++r) {
            T* row = out + r * ld;
            for (Index b = 0; b < scales_.cols(); ++b) {
                const Index c0 = b * Q8::block, m = std::min(Q8::block, cols() - c0);
                if constexpr (std::is_same_v<T, float>) {
                    decode_span(&q_(first + r, c0), m, scales_(first + r, b), row + c0);
                } else {
                    alignas(64) float buffer[Q8::block];
                    decode_span(&q_(first + r, c0), m, scales_(first + r, b), buffer);
                    for (Index c = 0; c < m; ++c)
                        row[c0 + c] = static_cast<T>(buffer[c]);
                }
            }
        }
    }

    /// Asks for a row towards the cache ahead of its use.
    void prefetch_row(Index row) const {
        prefetch_rows(&q_(row, 0), 1, 0, cols());
        prefetch_rows(&scales_(row, 0), 1, 0, scales_.cols());
    }

    /// q·row in float: per block of 32, Σ q_i·q8_i in registers, times the block's scale.
    [[nodiscard]] float dot(Index row, const float* q) const {
        using namespace Eigen::internal;
        const std::int8_t* x = &q_(row, 0);
        const float* s = &scales_(row, 0);
        const Index d = cols(), whole = d / Q8::block;
        // Even and odd blocks on two accumulators: the scale FMAs of consecutive blocks
        // do not wait on each other.
        Packet<float> even = pset1<Packet<float>>(0.0f), odd = even;
        Index b = 0;
        for (; b + 1 < whole; b += 2) {
            even = pmadd(pset1<Packet<float>>(s[b]), block_dot(q + b * Q8::block, x + b * Q8::block), even);
            odd = pmadd(pset1<Packet<float>>(s[b + 1]), block_dot(q + (b + 1) * Q8::block, x + (b + 1) * Q8::block),
                        odd);
        }
        if (b < whole)
            even = pmadd(pset1<Packet<float>>(s[b]), block_dot(q + b * Q8::block, x + b * Q8::block), even);
        float sum = predux(padd(even, odd));
        if (whole < scales_.cols()) {  // the last, shorter block
            float tail = 0;
            for (Index c = whole * Q8::block; c < d; ++c)
                tail += q[c] * static_cast<float>(x[c]);
            sum += s[whole] * tail;
        }
        return sum;
    }
    /// q̃·row for the rounded query q̃ (IntegerDot<Q8>): Σ_b (s_k,b·s_q,b)·D_b, D_b the
    /// block's Σ code·k exact in int32 (int8_block_dot), one fused multiply-add per block
    /// in order of b: the bits integer_logits gives a query of a group.
    [[nodiscard]] float integer_dot(Index row, const IntegerQuery& q) const {
        const std::int8_t* x = &q_(row, 0);
        const float* s = &scales_(row, 0);
        const Index d = cols(), whole = d / Q8::block;
        float sum = 0;
        Index b = 0;
        if constexpr (integer_blocks) {
            sum = q8_integer_blocks(x, s, q, whole, sum);
            b = whole;
        }
        for (; b < scales_.cols(); ++b) {  // without AVX2 every block, with it the last, shorter one
            const Index c0 = b * Q8::block, end = std::min(d, c0 + Q8::block);
            std::int32_t dot = 0;
            for (Index c = c0; c < end; ++c)
                dot += std::int32_t{q.code[c]} * std::int32_t{x[c]};
            sum = fused_add(static_cast<float>(dot), s[b] * q.scale[b], sum);
        }
        return sum;
    }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    /// s[r·lds + j] = scale · q̃_r·row(first + j) for the g rounded queries of `q` and
    /// the rows j ∈ [first, first + m) (d ≤ IntegerGroup::max_depth): integer_dot's bits,
    /// sixteen keys at a time. Per block of 32, the sixteen rows' codes transposed into
    /// words of four (transposed_words, once for the group) and their scales by block
    /// (transposed_scales), one vpdpbusd per word and query, D_b in int32 lanes (one per
    /// key), then s += (s_k,b·s_q,b)·D_b in float. Each tile asks for its own value rows
    /// (`values`, towards L2) and for the key rows `ahead` on, below `end`, row by row
    /// (measured on a Zen 5: asking for the tile's lines as two spans, codes and scales,
    /// doubled the step at 32768 tokens). s[r·lds + j] for j in [m, m rounded up to 16)
    /// is written too, with no meaning.
    template <class Values>
    void integer_logits(Index first, Index m, const IntegerGroup& q, float scale, float* s, Index lds,
                        const Values& values, Index ahead, Index end) const {
        const Index d = cols(), blocks = scales_.cols();
        MEMATTN_DASSERT(d <= IntegerGroup::max_depth && first + m <= rows());
        const Index rest = d - (blocks - 1) * Q8::block;  // the last block's values
        const __mmask32 whole = ~__mmask32{0}, last = rest == Q8::block ? whole : (__mmask32{1} << rest) - 1;
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (Index j = 0; j < m; j += 16) {
            const Index n = std::min<Index>(16, m - j);
            const std::int8_t* p[16];
            tile_rows(first + j, n, p, values, ahead, end);
            const float* row_scales = &scales_(first + j, 0);
            __m512 by_block[4] = {};  // the rows' scales of each block (four blocks or fewer)
            if (blocks <= 4)
                transposed_scales(row_scales, n, blocks, by_block);
            // Else gathered per block: lane k at row_scales + min(k, n − 1)·blocks + b.
            const __m512i at = _mm512_mullo_epi32(_mm512_min_epi32(lane, _mm512_set1_epi32(static_cast<int>(n - 1))),
                                                  _mm512_set1_epi32(static_cast<int>(blocks)));
            for (Index b = 0; b < blocks; ++b) {
                __m512i t[8];
                transposed_words(p, b * Q8::block, b + 1 < blocks ? whole : last, t);
                const __m512 sk = blocks <= 4 ? by_block[b] : _mm512_i32gather_ps(at, row_scales + b, 4);
                for (Index r = 0; r < q.queries; ++r) {
                    const Index w = b * (Q8::block / 4);
                    __m512i even = _mm512_set1_epi32(q.offset[r][b]), odd = _mm512_setzero_si512();
                    for (int c = 0; c < 8; c += 2) {
                        even = _mm512_dpbusd_epi32(even, t[c], _mm512_set1_epi32(q.word(r, w + c)));
                        odd = _mm512_dpbusd_epi32(odd, t[c + 1], _mm512_set1_epi32(q.word(r, w + c + 1)));
                    }
                    const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
                    float* out = s + r * lds + j;
                    __m512 sum = b == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out);
                    sum = _mm512_fmadd_ps(dot, _mm512_mul_ps(sk, _mm512_set1_ps(q.scale[r][b])), sum);
                    if (b + 1 == blocks)
                        sum = _mm512_mul_ps(_mm512_set1_ps(scale), sum);
                    _mm512_storeu_ps(out, sum);
                }
            }
        }
    }
#elif defined(__AVX2__) && defined(__FMA__)
    /// The same logits, bit for bit, eight keys at a time (AVX2 without AVX-512 VNNI): per
    /// block of 32, the eight rows' codes transposed into words of four
    /// (transposed_words8, once for the group) and their scales gathered, then per query
    /// and word vpmaddubsw of the query's magnitudes by the keys given the query's signs
    /// (|q|·k·sign(q) = q·k, a pair of products below 2^15: exact) and vpmaddwd, D_b in
    /// int32 lanes (one per key), then s += (s_k,b·s_q,b)·D_b in float. The last block of
    /// a row shorter than 32 is read through a zeroed copy. Prefetches as above. Measured
    /// on AMD EPYC Zen 3 (family 25 model 1), a 32/8 × 128 step over 32768 tokens: 28 →
    /// 12 ms on one thread against key by key (Q8's float tiles: 18 ms).
    /// s[r·lds + j] for j in [m, m rounded up to 8) is written too, with no meaning.
    template <class Values>
    void integer_logits(Index first, Index m, const IntegerGroup& q, float scale, float* s, Index lds,
                        const Values& values, Index ahead, Index end) const {
        const Index d = cols(), blocks = scales_.cols();
        MEMATTN_DASSERT(d <= IntegerGroup::max_depth && first + m <= rows());
        const Index rest = d - (blocks - 1) * Q8::block;  // the last block's values
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), ones = _mm256_set1_epi16(1);
        alignas(32) std::int8_t tail[8][Q8::block];  // a short last block's codes, zero past them
        for (Index j = 0; j < m; j += 8) {
            const Index n = std::min<Index>(8, m - j);
            const std::int8_t* p[8];
            tile_rows(first + j, n, p, values, ahead, end);
            const float* row_scales = &scales_(first + j, 0);
            const __m256i at = _mm256_mullo_epi32(_mm256_min_epi32(lane, _mm256_set1_epi32(static_cast<int>(n - 1))),
                                                  _mm256_set1_epi32(static_cast<int>(blocks)));
            for (Index b = 0; b < blocks; ++b) {
                __m256i t[8];
                if (b + 1 < blocks || rest == Q8::block) {
                    transposed_words8(p, b * Q8::block, t);
                } else {
                    const std::int8_t* short_rows[8];
                    for (int k = 0; k < 8; ++k) {
                        std::fill_n(tail[k], Q8::block, std::int8_t{0});
                        std::copy_n(p[k] + b * Q8::block, rest, tail[k]);
                        short_rows[k] = tail[k];
                    }
                    transposed_words8(short_rows, 0, t);
                }
                const __m256 sk = _mm256_i32gather_ps(row_scales + b, at, 4);
                for (Index r = 0; r < q.queries; ++r) {
                    const Index w = b * (Q8::block / 4);
                    __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
                    for (int c = 0; c < 8; c += 2) {
                        const __m256i e = _mm256_maddubs_epi16(_mm256_set1_epi32(q.magnitude_word(r, w + c)),
                                                               _mm256_sign_epi8(t[c], _mm256_set1_epi32(q.word(r, w + c))));
                        const __m256i o = _mm256_maddubs_epi16(
                            _mm256_set1_epi32(q.magnitude_word(r, w + c + 1)),
                            _mm256_sign_epi8(t[c + 1], _mm256_set1_epi32(q.word(r, w + c + 1))));
                        even = _mm256_add_epi32(even, _mm256_madd_epi16(e, ones));
                        odd = _mm256_add_epi32(odd, _mm256_madd_epi16(o, ones));
                    }
                    const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(even, odd));
                    float* out = s + r * lds + j;
                    __m256 sum = b == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out);
                    sum = _mm256_fmadd_ps(dot, _mm256_mul_ps(sk, _mm256_set1_ps(q.scale[r][b])), sum);
                    if (b + 1 == blocks)
                        sum = _mm256_mul_ps(_mm256_set1_ps(scale), sum);
                    _mm256_storeu_ps(out, sum);
                }
            }
        }
    }
#else
    /// The same logits, bit for bit, key by key (without AVX2 and FMA): for each query
    /// integer_dot's sum.
    template <class Values>
    void integer_logits(Index first, Index m, const IntegerGroup& q, float scale, float* s, Index lds,
                        const Values& values, Index ahead, Index end) const {
        const Index d = cols(), blocks = scales_.cols();
        MEMATTN_DASSERT(d <= IntegerGroup::max_depth && first + m <= rows());
        for (Index j = 0; j < m; ++j) {
            const Index row = first + j;
            if (ahead > 0) {
                if (row + ahead < end)
                    prefetch_row(row + ahead);
                values.prefetch_row(row);
            }
            const std::int8_t* x = &q_(row, 0);
            const float* sk = &scales_(row, 0);
            for (Index r = 0; r < q.queries; ++r) {
                float sum = 0;
                for (Index b = 0; b < blocks; ++b) {
                    const Index c0 = b * Q8::block, n = std::min(Q8::block, d - c0);
                    std::int32_t dot = 0;
                    if constexpr (integer_blocks) {
                        if (n == Q8::block)
                            dot = q8_block_dot(x + c0, q.code[r] + c0);
                    }
                    if (!integer_blocks || n < Q8::block)
                        for (Index c = c0; c < c0 + n; ++c)
                            dot += std::int32_t{q.code[r][c]} * std::int32_t{x[c]};
                    sum = fused_add(static_cast<float>(dot), sk[b] * q.scale[r][b], sum);
                }
                s[r * lds + j] = scale * sum;
            }
        }
    }
#endif
    /// acc += w · row in float, converted in registers.
    void add_scaled(Index row, float w, float* acc) const {
        const std::int8_t* x = &q_(row, 0);
        for (Index b = 0; b < scales_.cols(); ++b) {
            const Index c0 = b * Q8::block, m = std::min(Q8::block, cols() - c0);
            const float ws = w * scales_(row, b);
            for (Index c = add_span(ws, x + c0, m, acc + c0); c < m; ++c)
                acc[c0 + c] += ws * static_cast<float>(x[c0 + c]);
        }
    }
    /// add_scaled for rows [first, first + n) with weights w, acc in registers
    /// (add_rows_in_registers; fused_storage). A packet never straddles two blocks: block
    /// edges are multiples of 32, packets start at multiples of their width.
    void add_rows(Index first, Index n, const float* w, float* acc, Index ahead, Index prefetch_end) const {
        add_rows_in_registers(*this, first, n, w, acc, ahead, prefetch_end);
    }
    [[nodiscard]] Packet<float> packet(Index r, Index c) const { return load_packet(&q_(r, c)); }
    [[nodiscard]] float scalar(Index r, Index c) const { return static_cast<float>(q_(r, c)); }
    [[nodiscard]] float weight(Index r, Index c, float w) const { return w * scales_(r, c / Q8::block); }
    /// The stored values as float, exactly as decode_rows gives them (scale · q_i): a
    /// packet from column c (c + lanes ≤ cols, inside one block; fused_storage), and one value.
    [[nodiscard]] Packet<float> stored_packet(Index r, Index c) const {
        return Eigen::internal::pmul(Eigen::internal::pset1<Packet<float>>(scales_(r, c / Q8::block)),
                                     load_packet(&q_(r, c)));
    }
    [[nodiscard]] float stored_value(Index r, Index c) const {
        return scales_(r, c / Q8::block) * to_float(q_(r, c));
    }

    [[nodiscard]] std::size_t bytes(Index rows) const noexcept { return row_bytes(cols()) * static_cast<std::size_t>(rows); }
    [[nodiscard]] static std::size_t row_bytes(Index cols) noexcept {
        return static_cast<std::size_t>(cols) + sizeof(float) * static_cast<std::size_t>(q8_blocks(cols));
    }

    /// Each row as its scales, then its values.
    void write_rows(snapshot::Writer& w, Index first, Index n) const {
        for (Index r = first; r < first + n; ++r) {
            w.matrix(scales_.row(r));
            w.matrix(q_.row(r));
        }
    }
    void read_rows(snapshot::Reader& rd, Index first, Index n) {
        for (Index r = first; r < first + n; ++r) {
            rd.matrix(scales_.row(r), "rows");
            rd.matrix(q_.row(r), "rows");
        }
    }

private:
    /// A tile of the grouped integer logits (integer_logits): the codes of its n ≤ K rows
    /// from `first` into p (a tile past the end repeats the last key), and its requests:
    /// the key rows `ahead` on (below `end`) and its own value rows (towards L2).
    template <int K, class Values>
    void tile_rows(Index first, Index n, const std::int8_t* (&p)[K], const Values& values, Index ahead,
                   Index end) const {
        for (Index k = 0; k < K; ++k)
            p[k] = &q_(first + std::min<Index>(k, n - 1), 0);
        prefetch_tile(*this, values, first, first + n, ahead, end);
    }

    Eigen::Matrix<std::int8_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> q_;
    Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> scales_;
};

}  // namespace memattn::detail
