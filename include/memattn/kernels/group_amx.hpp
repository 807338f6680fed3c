#pragma once
// The grouped decode's two products in AMX tiles (detail/amx_product.hpp's instructions):
// FpMath::bf16 over rows stored as bfloat16 or FP8, read as bfloat16 words (Bf16Words),
// for the g ≤ 16 queries of one KV head, where the CPU runs tiles. GroupAttention's
// fold_amx takes them; elsewhere its fold_bf16 multiplies with vdpbf16ps
// (kernels/group_attention.hpp). Per 32 keys of a block:
//
//   logits  Sᵀ (keys × g) = K · Qᵀ: A the key rows, pairs along the head dim as stored
//           (bfloat16 rows read in place when the head dim is a multiple of 32; FP8 rows
//           and a head dim's last partial 32 converted into a zero-padded tile); B the
//           queries rounded to bfloat16 as pairs along the head dim, packed once per
//           attend (pack_query_pairs); two tiles of 16 keys over every 16 pairs of depth;
//   values  O (g × dv) += W · V: A the weights rounded to bfloat16, as the softmax keeps
//           them (pairs along the keys: a row of weights is its own A row); B two value
//           rows interleaved per pair row, 32 columns at a time, converted in registers
//           into 2 KiB; O a float buffer of whole 32-column chunks (zero past dv).
//
// One tile configuration serves both products for a whole fold, since their tiles are
// different registers; it is loaded when an AmxGroupTiles is made and released when it
// goes:
//   tmm0, tmm1  Sᵀ of keys 0–15 and 16–31      16 rows × 4g bytes
//   tmm2        K, 16 keys × 16 pairs          16 rows × 64 bytes
//   tmm3        Q pairs, 16 pairs × g          16 rows × 4g bytes
//   tmm4, tmm5  O, 16 columns each             g rows × 64 bytes
//   tmm6        W, g queries × 16 pairs        g rows × 64 bytes
//   tmm7        V pairs, 16 pairs × 16 columns 16 rows × 64 bytes
//
// Every element of Sᵀ and of a block's W·V is tdpbf16ps's sum in its order (pairs
// ascending, low term first; denormal inputs and results read and written as 0) whatever
// g is, so a query's logits and output do not depend on the group it is in, and
// AmxEmulated computes the same on any CPU. They differ from vdpbf16ps's in the last bits
// (its lanes add their two products first, and the logits' lanes in a tree); both keep
// the error bound of docs/design.md §4.7c. Keys and weights past a block's end, up to
// its whole 32, are zero on both sides of their products (0·0 adds nothing).

#include "memattn/cpu_features.hpp"
#include "memattn/detail/amx_product.hpp"
#include "memattn/storage/bf16_words.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace memattn::detail {

#if defined(MEMATTN_GROUP_BF16)
MEMATTN_AVX512_BF16_BEGIN  // its tiles are converted by AVX-512 (Bf16Words)
/// A fold's AMX tiles for g queries (1 ≤ g ≤ 16): the configuration, loaded while the
/// object lives, and the scratch of the tiles converted on the way (6 KiB).
template <class Tiles>
class AmxGroupTiles {
public:
    /// Whether the tiles run here: always emulated; on hardware where the CPU has AMX-BF16
    /// and the operating system granted the tile state (request_amx).
    static bool runs() noexcept {
        if constexpr (std::is_same_v<Tiles, AmxEmulated>)
            return true;
        else
            return Tiles::available && cpu_features().amx_usable() && request_amx();
    }

    /// q (g rows of bfloat16 bits, stride ldq, zero-padded to `depth`, a multiple of 32)
    /// as B pairs: out[k·16 + r] holds q(r, 2k) low and q(r, 2k + 1) high, k < depth/2.
    static void pack_query_pairs(const std::uint16_t* q, Index ldq, Index g, Index depth, std::uint32_t* out) noexcept {
        for (Index k = 0; k < depth / 2; ++k)
            for (Index r = 0; r < g; ++r)
                std::memcpy(out + k * 16 + r, q + r * ldq + 2 * k, sizeof(std::uint32_t));
    }

    explicit AmxGroupTiles(Index g) noexcept : g_(g) {
        MEMATTN_DASSERT(g >= 1 && g <= 16);
        TileConfig cfg;
        const auto set = [&cfg](int tile, Index rows, Index bytes) {
            cfg.rows[static_cast<std::size_t>(tile)] = static_cast<std::uint8_t>(rows);
            cfg.bytes[static_cast<std::size_t>(tile)] = static_cast<std::uint16_t>(bytes);
        };
        set(0, 16, 4 * g);
        set(1, 16, 4 * g);
        set(2, 16, 64);
        set(3, 16, 4 * g);
        set(4, g, 64);
        set(5, g, 64);
        set(6, g, 64);
        set(7, 16, 64);
        Tiles::configure(cfg);
    }
    ~AmxGroupTiles() { Tiles::release(); }
    AmxGroupTiles(const AmxGroupTiles&) = delete;
    AmxGroupTiles& operator=(const AmxGroupTiles&) = delete;

    /// s (g rows, stride lds) = scale · q·K_jᵀ for the keys j ∈ [first, first + m) of
    /// `keys` (m ≤ 128, d ≤ 256), q as pack_query_pairs gave it (depth round_up(d, 32));
    /// prefetch(j, n) is called for every key of [first, first + m) once, a few keys at a
    /// time spread over the tile products of their 32 (the first before any of them is
    /// read): a burst of requests for 32 keys' rows at once waits on the core's line-fill
    /// buffers instead of overlapping the products (docs/performance.md, "The AMX
    /// decode's requests spread").
    template <class Keys, class Prefetch>
    void logits(const Keys& keys, Index first, Index m, Index d, const std::uint32_t* query_pairs, float scale,
                float* s, Index lds, const Prefetch& prefetch) noexcept {
        using S = typename stored_format<Keys>::type;
        using Words = Bf16Words<S>;
        const Index chunks = (d + 31) / 32;
        for (Index j = 0; j < m; j += 32) {
            const Index n = std::min<Index>(32, m - j);
            // One share of the 32 keys' requests before each of the 2·chunks tile products.
            const Index share = (n + 2 * chunks - 1) / (2 * chunks);
            Index asked = 0;
            const auto ask = [&] {
                const Index k = std::min(share, n - asked);
                if (k > 0)
                    prefetch(j + asked, k);
                asked += k;
            };
            Tiles::template zero<0>();
            if (n > 16)
                Tiles::template zero<1>();
            for (Index c = 0; c < chunks; ++c) {
                Tiles::template load<3>(query_pairs + c * 16 * 16, 64);
                const auto key_tile = [&](Index t) -> std::pair<const void*, Index> {
                    const Index rows = std::min<Index>(16, n - 16 * t);
                    if constexpr (std::is_same_v<S, Eigen::bfloat16>)
                        if (rows == 16 && 32 * (c + 1) <= d)  // in place: 16 rows × 64 bytes
                            return {keys.stored_row(first + j + 16 * t) + 32 * c, 2 * d};
                    const auto mask = d - 32 * c >= 32 ? ~__mmask32(0)
                                                       : static_cast<__mmask32>((std::uint64_t(1) << (d - 32 * c)) - 1);
                    std::uint16_t* tile = keys_[t];
                    for (Index r = 0; r < 16; ++r)
                        _mm512_store_si512(tile + 32 * r,
                                           r < rows ? Words::load(Words::row(keys, first + j + 16 * t + r), 32 * c, mask)
                                                    : _mm512_setzero_si512());
                    return {tile, 64};
                };
                ask();
                const auto [k0, ld0] = key_tile(0);
                Tiles::template load<2>(k0, ld0);
                Tiles::template dot<0, 2, 3>();
                ask();
                if (n > 16) {
                    const auto [k1, ld1] = key_tile(1);
                    Tiles::template load<2>(k1, ld1);
                    Tiles::template dot<1, 2, 3>();
                }
            }
            Tiles::template store<0>(logits_, 64);
            if (n > 16)
                Tiles::template store<1>(logits_ + 16 * 16, 64);
            for (Index r = 0; r < g_; ++r)
                for (Index i = 0; i < n; ++i)
                    s[r * lds + j + i] = scale * logits_[i * 16 + r];
        }
    }

    /// o (g rows of whole 32-column chunks covering dv, stride ldo, zero past dv) += W·V_j
    /// for the values j ∈ [first, first + m) of `values` (m ≤ 128): w the weights as
    /// bfloat16 bits, g rows of stride ldw, zero from m to m's whole 32.
    template <class Values>
    void values(const Values& values, Index first, Index m, Index dv, const std::uint16_t* w, Index ldw, float* o,
                Index ldo) noexcept {
        using Words = Bf16Words<typename stored_format<Values>::type>;
        // Word 2i of a pair row is the first row's column i, word 2i + 1 the second's.
        alignas(64) static constexpr std::uint16_t low_columns[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                                      37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                                      11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
        alignas(64) static constexpr std::uint16_t high_columns[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                                       53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                                       27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
        const __m512i low = _mm512_load_si512(low_columns), high = _mm512_load_si512(high_columns);
        for (Index c = 0; c < dv; c += 32) {
            const auto mask = dv - c >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((std::uint64_t(1) << (dv - c)) - 1);
            Tiles::template load<4>(o + c, 4 * ldo);
            Tiles::template load<5>(o + c + 16, 4 * ldo);
            for (Index j = 0; j < m; j += 32) {
                for (Index p = 0; p < 16; ++p) {  // pair row p: values j + 2p and j + 2p + 1, 32 columns
                    const Index a = j + 2 * p;
                    const __m512i x = a < m ? Words::load(Words::row(values, first + a), c, mask) : _mm512_setzero_si512();
                    const __m512i y =
                        a + 1 < m ? Words::load(Words::row(values, first + a + 1), c, mask) : _mm512_setzero_si512();
                    _mm512_store_si512(pairs_ + 32 * p, _mm512_permutex2var_epi16(x, low, y));
                    _mm512_store_si512(pairs_ + 32 * p + 16, _mm512_permutex2var_epi16(x, high, y));
                }
                Tiles::template load<6>(w + j, 2 * ldw);
                Tiles::template load<7>(pairs_, 128);
                Tiles::template dot<4, 6, 7>();
                Tiles::template load<7>(pairs_ + 16, 128);
                Tiles::template dot<5, 6, 7>();
            }
            Tiles::template store<4>(o + c, 4 * ldo);
            Tiles::template store<5>(o + c + 16, 4 * ldo);
        }
    }

private:
    Index g_;
    alignas(64) std::uint16_t keys_[2][16 * 32];  // key tiles converted or zero-padded
    alignas(64) float logits_[32 * 16];           // Sᵀ of 32 keys, rows of 16 lanes
    alignas(64) std::uint32_t pairs_[16 * 32];    // V pairs: 16 pair rows × 32 columns
};
MEMATTN_AVX512_BF16_END
#endif

}  // namespace memattn::detail
