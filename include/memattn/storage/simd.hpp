#pragma once
// Stored values to packets of float in registers, where the instruction set converts
// them (bfloat16, half, int8, 4-bit codes), and the span loops on them: the decoders
// every compact format's rows and the decode kernels read through.

#include "memattn/detail/packet.hpp"
#include "memattn/detail/tile_product.hpp"
#include "memattn/storage/formats.hpp"

namespace memattn::detail {

/// Conversion in registers: one packet of float (Eigen's Packet<float>: 8 lanes with
/// AVX2, 16 with AVX-512) from as many stored values, where the instruction set has the
/// conversion (bfloat16: a 16-bit shift; half: F16C's vcvtph2ps; int8: a sign extension
/// and an integer conversion). Elsewhere `fused` is false and rows are converted
/// element by element.
#if defined(__AVX512F__)
inline constexpr bool fused_storage = true;
inline Packet<float> load_floats(const Eigen::bfloat16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline Packet<float> load_floats(const Eigen::half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Packet<float> load_floats(const std::int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
/// A packet of 4-bit values as float: the low (high = false) or high nibbles of as many
/// bytes.
inline Packet<float> load_nibbles(const std::uint8_t* p, bool high) {
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if (high)
        b = _mm_srli_epi16(b, 4);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0x0F))));
}
#elif defined(__AVX2__) && defined(__F16C__)
inline constexpr bool fused_storage = true;
inline Packet<float> load_floats(const Eigen::bfloat16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline Packet<float> load_floats(const Eigen::half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Packet<float> load_floats(const std::int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Packet<float> load_nibbles(const std::uint8_t* p, bool high) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    if (high)
        b = _mm_srli_epi16(b, 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0x0F))));
}
/// AVX2: the 32 codes of a 4-bit block (its 16 bytes, laid out as StoredRows<T, Q4>
/// describes) as four packets of float, values 0–7, 8–15, 16–23, 24–31, each minus
/// Offset (8 for Q4, whose u − 8 is then exact in the bytes): one load and two masks for
/// the block where load_nibbles takes a load, a shift and a mask per packet.
inline constexpr bool nibble_blocks = true;
template <int Offset>
inline void load_nibble_block(const std::uint8_t* p, Packet<float> (&u)[4]) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    if constexpr (Offset != 0) {
        lo = _mm_sub_epi8(lo, _mm_set1_epi8(static_cast<char>(Offset)));
        hi = _mm_sub_epi8(hi, _mm_set1_epi8(static_cast<char>(Offset)));
    }
    u[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    u[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)));
    u[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    u[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)));
}
#else
inline constexpr bool fused_storage = false;
#endif
#if !defined(__AVX2__) || !defined(__F16C__) || defined(__AVX512F__)
inline constexpr bool nibble_blocks = false;
// Declared only, for code that names it where nibble_blocks is false (never called).
template <int Offset>
void load_nibble_block(const std::uint8_t* p, Packet<float> (&u)[4]);
#endif

/// load_floats through a template: code that names it still compiles where
/// fused_storage is false (and load_floats does not exist), since it is never called there.
template <class E>
Packet<float> load_packet(const E* p) {
    return load_floats(p);
}
template <class E>
Packet<float> load_nibble_packet(const E* p, bool high) {
    return load_nibbles(p, high);
}

/// AVX-512: a 4-bit block decodes by table. Its 16 possible values, q4_value(u) for
/// u = 0 … 15, fill one packet (one multiply-add per block), and a packet of codes is
/// looked up in it by one permute (vpermps reads only an index's low 4 bits, so a code
/// needs no mask): the conversion leaves the floating-point ports to the products, which
/// share them with it on AVX-512 cores (the integer convert and the scale multiply-add it
/// replaces both ran there). The table's lanes are computed by the same pmadd, pmul and
/// psub as the packet path's, so both give q4_value's bits.
#if defined(__AVX512F__)
inline constexpr bool nibble_tables = true;
template <class S>
inline Packet<float> q4_table(float s, float m);
/// The values of the low (high = false) or high nibbles of 16 bytes, looked up in `table`.
inline Packet<float> lookup_nibbles(const std::uint8_t* p, bool high, Packet<float> table) {
    __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    if (high)
        code = _mm512_srli_epi32(code, 4);
    return _mm512_permutexvar_ps(code, table);
}
#else
inline constexpr bool nibble_tables = false;
// Declared only, for code that names them where nibble_tables is false (never called).
template <class S>
Packet<float> q4_table(float s, float m);
Packet<float> lookup_nibbles(const std::uint8_t* p, bool high, Packet<float> table);
#endif

/// One stored value as float.
inline float to_float(Eigen::bfloat16 x) { return static_cast<float>(x); }
inline float to_float(Eigen::half x) { return static_cast<float>(x); }
inline float to_float(std::int8_t x) { return static_cast<float>(x); }

/// out[0, n) = s · x[0, n) in float (s = 1 for bfloat16 and half), packet by packet where
/// fused_storage, then the tail.
template <class E>
void decode_span(const E* x, Index n, float s, float* out) {
    Index i = 0;
    if constexpr (fused_storage) {
        using namespace Eigen::internal;
        constexpr Index lanes = packet_lanes<float>;
        const Packet<float> scale = pset1<Packet<float>>(s);
        for (; i + lanes <= n; i += lanes) {
            if constexpr (std::is_same_v<E, std::int8_t>)
                pstoreu(out + i, pmul(scale, load_floats(x + i)));
            else
                pstoreu(out + i, load_floats(x + i));
        }
    }
    for (; i < n; ++i)
        out[i] = std::is_same_v<E, std::int8_t> ? s * to_float(x[i]) : to_float(x[i]);
}

/// load_floats as a callable: how dot_span and add_span read a packet of stored values
/// unless told otherwise (a format of its own header passes its own: storage/fp8.hpp).
struct LoadFloats {
    template <class E>
    Packet<float> operator()(const E* p) const {
        return load_floats(p);
    }
};

/// Σ_i q_i·x_i over n stored values, four packet accumulators (fused_storage only, or
/// with a `load` of the format's own).
template <class E, class Load = LoadFloats>
inline Packet<float> dot_span(const float* q, const E* x, Index n, Packet<float> acc, Load load = {}) {
    using namespace Eigen::internal;
    using P = Packet<float>;
    constexpr Index lanes = packet_lanes<float>;
    P a1 = pset1<P>(0.0f), a2 = a1, a3 = a1;
    Index c = 0;
    for (; c + 4 * lanes <= n; c += 4 * lanes) {
        acc = pmadd(ploadu<P>(q + c), load(x + c), acc);
        a1 = pmadd(ploadu<P>(q + c + lanes), load(x + c + lanes), a1);
        a2 = pmadd(ploadu<P>(q + c + 2 * lanes), load(x + c + 2 * lanes), a2);
        a3 = pmadd(ploadu<P>(q + c + 3 * lanes), load(x + c + 3 * lanes), a3);
    }
    for (; c + lanes <= n; c += lanes)
        acc = pmadd(ploadu<P>(q + c), load(x + c), acc);
    return padd(padd(acc, a1), padd(a2, a3));
}

/// Σ_i q_i·x_i over one whole Q8 block as a packet of partial sums (fused_storage only):
/// two independent chains, so a block's products overlap instead of queueing behind one
/// accumulator (with 16 lanes a block is just two packets).
template <class E>
inline Packet<float> block_dot(const float* q, const E* x) {
    using namespace Eigen::internal;
    using P = Packet<float>;
    constexpr Index lanes = packet_lanes<float>;
    static_assert(Q8::block % (2 * lanes) == 0, "a Q8 block is a whole number of packet pairs");
    P a = pmul(ploadu<P>(q), load_floats(x)), b = pmul(ploadu<P>(q + lanes), load_floats(x + lanes));
    for (Index c = 2 * lanes; c < Q8::block; c += 2 * lanes) {
        a = pmadd(ploadu<P>(q + c), load_floats(x + c), a);
        b = pmadd(ploadu<P>(q + c + lanes), load_floats(x + c + lanes), b);
    }
    return padd(a, b);
}

/// acc[0, n) += w · x[0, n) (fused_storage only, or with a `load` of the format's own; the
/// packet part, the tail is the caller's).
template <class E, class Load = LoadFloats>
inline Index add_span(float w, const E* x, Index n, float* acc, Load load = {}) {
    using namespace Eigen::internal;
    using P = Packet<float>;
    constexpr Index lanes = packet_lanes<float>;
    const P weight = pset1<P>(w);
    Index c = 0;
    for (; c + lanes <= n; c += lanes)
        pstoreu(acc + c, pmadd(weight, load(x + c), ploadu<P>(acc + c)));
    return c;
}

/// acc[0, cols) += Σ_j w[j] · rows(first + j) over j ∈ [0, n), one row after the other
/// (fused_storage only): every acc[c] gets the same FMAs, in the same order, as n calls of
/// add_scaled, but up to 8 packets of acc stay in registers across the rows instead of
/// going through memory after every row (a store-to-load chain per row). Rows asked for
/// `ahead` rows in advance while i + ahead < prefetch_end (ahead 0: none). `rows` gives
/// packet(r, c) (lanes stored values from column c, a multiple of the packet width, as
/// float), scalar(r, c) and weight(r, c, w) (w times the scale of the block holding c).
template <class Rows>
void add_rows_in_registers(const Rows& rows, Index first, Index n, const float* w, float* acc, Index ahead,
                           Index prefetch_end) {
    using namespace Eigen::internal;
    using P = Packet<float>;
    constexpr Index lanes = packet_lanes<float>;
    constexpr int tile = 8;
    const Index cols = rows.cols(), packed = cols / lanes * lanes;
    for (Index c0 = 0; c0 < packed; c0 += tile * lanes) {
        const bool prefetch = ahead > 0 && c0 == 0;  // the first pass over the rows asks for them
        dispatch<tile>(std::min<Index>(tile, (packed - c0) / lanes), [&]<int Packets>() {
            P r[Packets];
            for (int p = 0; p < Packets; ++p)
                r[p] = ploadu<P>(acc + c0 + p * lanes);
            for (Index j = 0; j < n; ++j) {
                if (prefetch && first + j + ahead < prefetch_end)
                    rows.prefetch_row(first + j + ahead);
                for (int p = 0; p < Packets; ++p) {
                    const Index c = c0 + p * lanes;
                    r[p] = pmadd(pset1<P>(rows.weight(first + j, c, w[j])), rows.packet(first + j, c), r[p]);
                }
            }
            for (int p = 0; p < Packets; ++p)
                pstoreu(acc + c0 + p * lanes, r[p]);
        });
    }
    for (Index c = packed; c < cols; ++c)
        for (Index j = 0; j < n; ++j)
            acc[c] += rows.weight(first + j, c, w[j]) * rows.scalar(first + j, c);
}

}  // namespace memattn::detail
