#pragma once
// A product in AMX tiles (Intel Sapphire Rapids and later: AMX-TILE, AMX-BF16), for the
// softmax kernel's two products in bfloat16 (kernels/softmax_products.hpp):
//
//   C (rows × cols, float) = C + A (rows × depth) · B (depth × cols)      (or C = A·B)
//
// with A and B bfloat16 in the pair layouts of detail/bf16_product.hpp: A(r, k) pairs
// along k, a row of A 2·pairs bfloat16 from a + r·lda (a row of K in place, the weights
// packed by pack_weight_rows); B pairs along k, the 32-bit word b[(k/2)·ldb + c] holding
// B(k, c) low and B(k + 1, c) high (pack_row_pairs: the query tile's transpose, a value
// tile). That is AMX's own layout: tdpbf16ps multiplies a tile of A (16 rows × 16 pairs,
// 64 bytes a row) by a tile of B (16 pair rows × 16 words) into a tile of C (16 × 16
// floats). An odd depth is the caller's to pad (a zero term in both).
//
// Blocking: eight tile registers hold 2 × 2 tiles of C (32 × 32 floats), two of A and two
// of B: per 16 pairs of depth, 4 tdpbf16ps on 4 loads, and four independent accumulators
// cover the instruction's latency (its throughput is one per 16 cycles). Rows and columns
// left over take tiles configured with exactly that many rows and bytes (a tile
// configuration per block shape, loaded only when it changes: LDTILECFG zeroes every
// tile); the depth left over below 16 pairs is copied into zero-padded scratch, since a
// tile's width is fixed for a block's whole depth loop. Nothing is allocated.
//
// The arithmetic of tdpbf16ps (Intel's SDM): per element, for each pair in order, the two
// products (exact in float) are added to the float accumulator one after the other,
// rounded to nearest even; bfloat16 denormal inputs are read as 0 and denormal results
// written as 0, whatever MXCSR says. So every element of C is the same sum in the same
// order (pairs ascending, low term first) whatever the blocking: AmxEmulated, which runs
// on any CPU, computes the SDM's pseudo-code (each add an FMA with denormals read and
// written as 0) and checks the SDM's rules on tile shapes, so the tests of the blocking's
// indices run everywhere; where the tiles run, a test compares it with the hardware.
//
// The hardware backend (AmxHardware) is inline assembly, not the compilers' intrinsics:
// it compiles for any x86-64 target with GCC or Clang (their assemblers know AMX), needs
// no target attribute, and tells the compiler that tile stores write memory. It runs
// only where cpu_features().amx_usable(): the CPU has AMX-BF16 and Linux granted the tile
// state (memattn/cpu_features.hpp). A thread's tile configuration is its own: each call
// loads the configuration it needs and releases the tiles (TILERELEASE) when it returns,
// so nothing is left configured between calls.

#include "memattn/detail/assert.hpp"
#include "memattn/detail/isa_regions.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace memattn::detail {

/// A tile configuration (palette 1): each tile register's rows and bytes per row.
struct alignas(64) TileConfig {
    std::uint8_t palette = 1;
    std::uint8_t start_row = 0;
    std::array<std::uint8_t, 14> reserved{};
    std::array<std::uint16_t, 16> bytes{};  ///< bytes per row of each tile (tiles 0-7 used)
    std::array<std::uint8_t, 16> rows{};    ///< rows of each tile

    friend bool operator==(const TileConfig&, const TileConfig&) = default;
};
static_assert(sizeof(TileConfig) == 64 && offsetof(TileConfig, bytes) == 16 && offsetof(TileConfig, rows) == 48,
              "LDTILECFG's 64-byte layout");

/// Tiles of one block: C(i, j) is tile 2i + j (i, j < 2), A(i) tile 4 + i, B(j) tile 6 + j.
/// `m` rows of the block's row tiles, `n` columns (floats, words) of its column tiles.
inline TileConfig block_config(int row_tiles, int col_tiles, const int m[2], const int n[2]) noexcept {
    TileConfig cfg;
    for (int i = 0; i < row_tiles; ++i) {
        cfg.rows[4 + i] = static_cast<std::uint8_t>(m[i]);  // A: m rows × 16 pairs
        cfg.bytes[4 + i] = 64;
        for (int j = 0; j < col_tiles; ++j) {
            cfg.rows[2 * i + j] = static_cast<std::uint8_t>(m[i]);  // C: m × n floats
            cfg.bytes[2 * i + j] = static_cast<std::uint16_t>(4 * n[j]);
        }
    }
    for (int j = 0; j < col_tiles; ++j) {
        cfg.rows[6 + j] = 16;  // B: 16 pair rows × n words
        cfg.bytes[6 + j] = static_cast<std::uint16_t>(4 * n[j]);
    }
    return cfg;
}

/// The AMX instructions themselves (x86-64, GCC or Clang): tiles named by template
/// arguments, strides in bytes. Run only where cpu_features().amx_usable().
struct AmxHardware {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    static constexpr bool available = true;
    // Tile registers are named by immediate operands printed bare (%c): tmm0-tmm7.
    static void configure(const TileConfig& cfg) noexcept { __asm__ volatile("ldtilecfg %0" ::"m"(cfg)); }
    static void release() noexcept { __asm__ volatile("tilerelease" ::); }
    template <int T>
    static void load(const void* p, Index stride) noexcept {
        __asm__ volatile("{tileloadd (%1,%2,1), %%tmm%c0|tileloadd tmm%c0, [%1+%2*1]}" ::"i"(T), "r"(p), "r"(stride)
                         : "memory");
    }
    template <int T>
    static void zero() noexcept {
        __asm__ volatile("{tilezero %%tmm%c0|tilezero tmm%c0}" ::"i"(T));
    }
    template <int T>
    static void store(void* p, Index stride) noexcept {
        __asm__ volatile("{tilestored %%tmm%c0, (%1,%2,1)|tilestored [%1+%2*1], tmm%c0}" ::"i"(T), "r"(p), "r"(stride)
                         : "memory");
    }
    /// C += A·B (tdpbf16ps tmmC, tmmA, tmmB).
    template <int C, int A, int B>
    static void dot() noexcept {
        __asm__ volatile("{tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0|tdpbf16ps tmm%c0, tmm%c1, tmm%c2}" ::"i"(C), "i"(A),
                         "i"(B));
    }
#else
    static constexpr bool available = false;
    static void configure(const TileConfig&) noexcept {}
    static void release() noexcept {}
    template <int T>
    static void load(const void*, Index) noexcept {}
    template <int T>
    static void zero() noexcept {}
    template <int T>
    static void store(void*, Index) noexcept {}
    template <int C, int A, int B>
    static void dot() noexcept {}
#endif
};

/// The same instructions computed in C++ exactly as the SDM defines them (see the top of
/// the file), on any CPU: the tests' stand-in for the hardware. Its tiles are the
/// thread's own.
struct AmxEmulated {
    static constexpr bool available = true;
    struct Tile {
        int rows = 0, bytes = 0;
        alignas(64) std::array<std::uint8_t, 1024> data{};
    };
    struct State {
        std::array<Tile, 8> tiles{};
        bool configured = false;
    };
    static State& state() noexcept {
        thread_local State s;
        return s;
    }
    static void configure(const TileConfig& cfg) noexcept {
        State& s = state();
        for (int t = 0; t < 8; ++t) {
            s.tiles[static_cast<std::size_t>(t)].rows = cfg.rows[static_cast<std::size_t>(t)];
            s.tiles[static_cast<std::size_t>(t)].bytes = cfg.bytes[static_cast<std::size_t>(t)];
            s.tiles[static_cast<std::size_t>(t)].data.fill(0);
        }
        s.configured = true;
    }
    static void release() noexcept { state().configured = false; }
    template <int T>
    static void load(const void* p, Index stride) noexcept {
        Tile& t = tile<T>();
        t.data.fill(0);
        for (int r = 0; r < t.rows; ++r)
            std::memcpy(t.data.data() + 64 * r, static_cast<const std::uint8_t*>(p) + r * stride,
                        static_cast<std::size_t>(t.bytes));
    }
    template <int T>
    static void zero() noexcept {
        tile<T>().data.fill(0);
    }
    template <int T>
    static void store(void* p, Index stride) noexcept {
        const Tile& t = tile<T>();
        for (int r = 0; r < t.rows; ++r)
            std::memcpy(static_cast<std::uint8_t*>(p) + r * stride, t.data.data() + 64 * r,
                        static_cast<std::size_t>(t.bytes));
    }
    template <int C, int A, int B>
    static void dot() noexcept {
        static_assert(C != A && C != B && A != B, "tdpbf16ps: three distinct tiles");
        Tile &c = tile<C>(), &a = tile<A>(), &b = tile<B>();
        // The SDM's #UD conditions on the shapes.
        MEMATTN_DASSERT(c.rows == a.rows && a.bytes / 4 == b.rows && c.bytes == b.bytes);
        MEMATTN_DASSERT(c.rows >= 1 && c.rows <= 16 && a.bytes <= 64 && b.bytes <= 64 && b.rows <= 16);
        for (int m = 0; m < c.rows; ++m)
            for (int k = 0; k < a.bytes / 4; ++k)
                for (int n = 0; n < c.bytes / 4; ++n) {
                    float acc = flush(word<float>(c, m, n));
                    acc = flush(std::fma(widen(half(a, m, 2 * k)), widen(half(b, k, 2 * n)), acc));
                    acc = flush(std::fma(widen(half(a, m, 2 * k + 1)), widen(half(b, k, 2 * n + 1)), acc));
                    std::memcpy(c.data.data() + 64 * m + 4 * n, &acc, 4);
                }
    }

private:
    template <int T>
    static Tile& tile() noexcept {
        static_assert(T >= 0 && T < 8);
        Tile& t = state().tiles[T];
        MEMATTN_DASSERT(state().configured && t.rows >= 1 && t.rows <= 16 && t.bytes >= 4 && t.bytes <= 64 &&
                        t.bytes % 4 == 0);  // a tile configured (else #UD)
        return t;
    }
    template <class W>
    static W word(const Tile& t, int row, int col) noexcept {
        W w;
        std::memcpy(&w, t.data.data() + 64 * row + 4 * col, 4);
        return w;
    }
    static std::uint16_t half(const Tile& t, int row, int index) noexcept {
        std::uint16_t h;
        std::memcpy(&h, t.data.data() + 64 * row + 2 * index, 2);
        return h;
    }
    /// A bfloat16's value, a denormal read as 0.
    static float widen(std::uint16_t h) noexcept {
        if ((h & 0x7F80u) == 0)
            h &= 0x8000u;
        return std::bit_cast<float>(std::uint32_t{h} << 16);
    }
    /// A denormal float written as 0 (of its sign).
    static float flush(float x) noexcept {
        const auto bits = std::bit_cast<std::uint32_t>(x);
        return (bits & 0x7F800000u) == 0 ? std::bit_cast<float>(bits & 0x80000000u) : x;
    }
};

/// One block of RT × CT tiles of C (RT, CT ≤ 2): rows [r0, r0 + 16·RT), columns [c0, c0 +
/// 16·CT), tails as configured by the caller; every pair of depth.
template <class Tiles, int RT, int CT>
inline void amx_block(Index pairs, const std::uint16_t* a, Index lda, const std::uint32_t* b, Index ldb, float* c,
                      Index ldc, bool accumulate, const int m[2], const int n[2]) noexcept {
    const auto c_at = [&](int i, int j) { return c + (16 * i) * ldc + 16 * j; };
    const auto each_c = [&](auto&& f) {
        f(std::integral_constant<int, 0>{}, std::integral_constant<int, 0>{});
        if constexpr (CT > 1)
            f(std::integral_constant<int, 0>{}, std::integral_constant<int, 1>{});
        if constexpr (RT > 1) {
            f(std::integral_constant<int, 1>{}, std::integral_constant<int, 0>{});
            if constexpr (CT > 1)
                f(std::integral_constant<int, 1>{}, std::integral_constant<int, 1>{});
        }
    };
    each_c([&](auto i, auto j) {
        constexpr int I = decltype(i)::value, J = decltype(j)::value;
        if (accumulate)
            Tiles::template load<2 * I + J>(c_at(I, J), 4 * ldc);
        else
            Tiles::template zero<2 * I + J>();
    });
    // The depth left over below 16 pairs, zero-padded: each A row tile's rows, each B column tile's.
    alignas(64) std::uint32_t a_tail[2][16 * 16];
    alignas(64) std::uint32_t b_tail[2][16 * 16];
    for (Index k0 = 0; k0 < pairs; k0 += 16) {
        const Index kp = std::min<Index>(16, pairs - k0);
        const void* a_tile[2];
        const void* b_tile[2];
        Index a_stride = 2 * lda, b_stride = 4 * ldb;
        if (kp == 16) {
            for (int i = 0; i < RT; ++i)
                a_tile[i] = a + (16 * i) * lda + 2 * k0;
            for (int j = 0; j < CT; ++j)
                b_tile[j] = b + k0 * ldb + 16 * j;
        } else {
            for (int i = 0; i < RT; ++i) {
                std::fill(a_tail[i], a_tail[i] + 256, 0u);
                for (int r = 0; r < m[i]; ++r)
                    std::memcpy(a_tail[i] + 16 * r, a + (16 * i + r) * lda + 2 * k0, static_cast<std::size_t>(4 * kp));
                a_tile[i] = a_tail[i];
            }
            for (int j = 0; j < CT; ++j) {
                std::fill(b_tail[j], b_tail[j] + 256, 0u);
                for (Index k = 0; k < kp; ++k)
                    std::memcpy(b_tail[j] + 16 * k, b + (k0 + k) * ldb + 16 * j, static_cast<std::size_t>(4 * n[j]));
                b_tile[j] = b_tail[j];
            }
            a_stride = b_stride = 64;
        }
        // Each load just before the first product that reads it, so that the products
        // start while the other operands load.
        Tiles::template load<4>(a_tile[0], a_stride);
        Tiles::template load<6>(b_tile[0], b_stride);
        Tiles::template dot<0, 4, 6>();
        if constexpr (CT > 1) {
            Tiles::template load<7>(b_tile[1], b_stride);
            Tiles::template dot<1, 4, 7>();
        }
        if constexpr (RT > 1) {
            Tiles::template load<5>(a_tile[1], a_stride);
            Tiles::template dot<2, 5, 6>();
            if constexpr (CT > 1)
                Tiles::template dot<3, 5, 7>();
        }
    }
    each_c([&](auto i, auto j) {
        constexpr int I = decltype(i)::value, J = decltype(j)::value;
        Tiles::template store<2 * I + J>(c_at(I, J), 4 * ldc);
    });
}

/// C = A·B, or C += A·B when `accumulate` (see the top of the file); depth in pairs.
/// A: rows × 2·pairs bfloat16, row stride lda (bfloat16 units); B: pairs × cols words,
/// row stride ldb (words, ≥ cols); C: rows × cols floats, row stride ldc.
template <class Tiles>
void amx_product(Index rows, Index cols, Index pairs, const std::uint16_t* a, Index lda, const std::uint32_t* b,
                 Index ldb, float* c, Index ldc, bool accumulate) noexcept {
    if (rows == 0 || cols == 0)
        return;
    if (pairs == 0) {
        if (!accumulate)
            for (Index r = 0; r < rows; ++r)
                std::fill(c + r * ldc, c + r * ldc + cols, 0.0f);
        return;
    }
    // The loaded configuration is known by its block shape, compared in registers: a
    // comparison of the 64-byte configuration just written to memory waits for the
    // previous block's tile stores to drain (it measured 1.7 times the block's time).
    std::uint32_t loaded = 0;  // no shape has 0 rows
    const auto block = [&](Index r0, Index c0) {
        const int m[2] = {static_cast<int>(std::min<Index>(16, rows - r0)),
                          static_cast<int>(std::clamp<Index>(rows - r0 - 16, 0, 16))};
        const int n[2] = {static_cast<int>(std::min<Index>(16, cols - c0)),
                          static_cast<int>(std::clamp<Index>(cols - c0 - 16, 0, 16))};
        const int rt = m[1] > 0 ? 2 : 1, ct = n[1] > 0 ? 2 : 1;
        const auto shape = static_cast<std::uint32_t>(m[0] | m[1] << 8 | n[0] << 16 | n[1] << 24);
        if (shape != loaded) {
            Tiles::configure(block_config(rt, ct, m, n));
            loaded = shape;
        }
        const std::uint16_t* ab = a + r0 * lda;
        const std::uint32_t* bb = b + c0;
        float* cb = c + r0 * ldc + c0;
        if (rt == 2 && ct == 2)
            amx_block<Tiles, 2, 2>(pairs, ab, lda, bb, ldb, cb, ldc, accumulate, m, n);
        else if (rt == 2)
            amx_block<Tiles, 2, 1>(pairs, ab, lda, bb, ldb, cb, ldc, accumulate, m, n);
        else if (ct == 2)
            amx_block<Tiles, 1, 2>(pairs, ab, lda, bb, ldb, cb, ldc, accumulate, m, n);
        else
            amx_block<Tiles, 1, 1>(pairs, ab, lda, bb, ldb, cb, ldc, accumulate, m, n);
    };
    for (Index r0 = 0; r0 < rows; r0 += 32)
        for (Index c0 = 0; c0 < cols; c0 += 32)
            block(r0, c0);
    Tiles::release();
}

#if defined(MEMATTN_AVX512_CODE)
MEMATTN_AVX512_BEGIN
/// Transposes 16 × 16 32-bit words in place: r[i] lane j becomes r[j] lane i.
inline void transpose_words(__m512i r[16]) noexcept {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {  // pairs of rows: words interleaved
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4)  // quads: 64-bit halves interleaved; r[i + c]: column c of each 128 bits
        for (int h = 0; h < 2; ++h) {
            r[i + 2 * h] = _mm512_unpacklo_epi64(t[i + h], t[i + 2 + h]);
            r[i + 2 * h + 1] = _mm512_unpackhi_epi64(t[i + h], t[i + 2 + h]);
        }
    for (int i = 0; i < 16; i += 8)  // 128-bit lanes of rows four apart
        for (int h = 0; h < 4; ++h) {
            t[i + h] = _mm512_shuffle_i32x4(r[i + h], r[i + 4 + h], 0x88);
            t[i + 4 + h] = _mm512_shuffle_i32x4(r[i + h], r[i + 4 + h], 0xDD);
        }
    for (int h = 0; h < 8; ++h) {  // and eight apart
        r[h] = _mm512_shuffle_i32x4(t[h], t[8 + h], 0x88);
        r[8 + h] = _mm512_shuffle_i32x4(t[h], t[8 + h], 0xDD);
    }
}

/// Sixteen rows of bfloat16 (row r from rows[r]) as pair words along 16 lanes:
/// out[k·ldo + r] holds the row's pair k, for whole blocks of 16 of the `pairs` pairs.
/// The pairs written (a multiple of 16).
inline Index transpose_pairs(const std::uint16_t* const rows[16], Index pairs, std::uint32_t* out, Index ldo) noexcept {
    Index k0 = 0;
    for (; k0 + 16 <= pairs; k0 += 16) {
        __m512i w[16];
        for (Index r = 0; r < 16; ++r)
            w[r] = _mm512_loadu_si512(rows[r] + 2 * k0);
        transpose_words(w);
        for (Index k = 0; k < 16; ++k)
            _mm512_storeu_si512(out + (k0 + k) * ldo, w[k]);
    }
    return k0;
}

/// pack_weight_rows' blocks of 16 lanes: the lanes done (a multiple of 16).
inline Index pack_weight_rows_wide(const float* p, Index n, Index cols, Index lanes, std::uint32_t* out, Index ldo) {
    Index i0 = 0;
    const Index pairs = (n + 1) / 2;
    const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (; i0 + 16 <= cols; i0 += 16)
        for (Index k0 = 0; k0 < pairs; k0 += 16) {
            __m512i w[16];
            for (Index q = 0; q < 16; ++q) {
                const Index j = 2 * (k0 + q);
                const __m512i low = j < n ? _mm512_loadu_si512(p + j * lanes + i0) : _mm512_setzero_si512();
                const __m512i high = j + 1 < n ? _mm512_loadu_si512(p + (j + 1) * lanes + i0) : _mm512_setzero_si512();
                w[q] = _mm512_or_si512(_mm512_srli_epi32(low, 16), _mm512_and_si512(high, high_half));
            }
            transpose_words(w);
            const Index count = std::min<Index>(16, pairs - k0);
            const auto mask = static_cast<__mmask16>((1u << count) - 1u);
            for (Index r = 0; r < 16; ++r)
                _mm512_mask_storeu_epi32(out + (i0 + r) * ldo + k0, mask, w[r]);
        }
    return i0;
}
MEMATTN_AVX512_END
#endif

/// The weights of a tile as A rows for amx_product: out[i·ldo + j/2] holds p(j, i) low
/// and p(j + 1, i) high as bfloat16 (0 past the n keys), for lanes i < cols and keys j <
/// n; p row-major (keys × lanes), row stride `lanes`, already bfloat16 values (the
/// products' Rounding: absorb rounded them), so their high halves are exact, NaN included.
/// Words of a row past (n + 1)/2 are not written. Where `wide` (only where avx512_runs()),
/// 16 lanes × 16 pairs at a time by AVX-512: two key rows' halves merged into words, then
/// the words transposed.
inline void pack_weight_rows(const float* p, Index n, Index cols, Index lanes, std::uint32_t* out, Index ldo,
                             [[maybe_unused]] bool wide) {
    Index i0 = 0;
#if defined(MEMATTN_AVX512_CODE)
    if (wide)
        i0 = pack_weight_rows_wide(p, n, cols, lanes, out, ldo);
#endif
    const auto bits = [](float x) {
        const auto u = std::bit_cast<std::uint32_t>(x);
        MEMATTN_DASSERT((u & 0xFFFFu) == 0);  // a bfloat16 value
        return u >> 16;
    };
    for (Index i = i0; i < cols; ++i) {
        std::uint32_t* row = out + i * ldo;
        for (Index j = 0; j < n; j += 2) {
            const std::uint32_t low = bits(p[j * lanes + i]);
            const std::uint32_t high = j + 1 < n ? bits(p[(j + 1) * lanes + i]) : 0u;
            row[j / 2] = low | (high << 16);
        }
    }
}

}  // namespace memattn::detail
