#pragma once
// Compact K/V storage: the element types a cache may keep its keys and values in, and
// the one place that converts them (docs/design.md, "Compact K/V storage").
//
//   KVCache<float, Eigen::bfloat16> cache(128, 128);   // half the bytes of KVCache<float>
//   KVCache<float, memattn::Q8> small(128, 128);       // 0.28 of the bytes
//
// Arithmetic stays in the cache's scalar T. A value is rounded once, when it is stored;
// reading converts a row (single-query attend) or a tile (the causal softmax kernel's
// prefill) into T in a buffer of the reader's that stays in L1/L2, never the whole cache.
//
//   Eigen::bfloat16  8-bit exponent, 8-bit mantissa: float's range, relative rounding
//                    2^-9; outputs within 1e-2 of exact on unit-scale inputs.
//   Eigen::half      IEEE binary16: 11-bit mantissa (rounding 2^-12) but a range of
//                    ±65504. Outputs within 2e-3.
//   memattn::Q8      like llama.cpp's q8_0: blocks of 32 values of a row (the last one
//                    shorter when the row is) as int8 q_i with one float scale
//                    s = max|x_i| / 127, value = s·q_i; a row of d values takes
//                    d + 4·⌈d/32⌉ bytes. Rounding ≤ max|x|/254 per block; outputs within
//                    2e-2. A block holding ±∞ or NaN stores a NaN scale: the whole block
//                    reads as NaN.
//   memattn::Q4      like llama.cpp's q4_0: blocks of 32 values of a row as 4-bit
//                    n_i ∈ [−7, 7] with one float scale s = max|x_i| / 7, value = s·n_i
//                    (the largest magnitude is kept exactly); 16 bytes and a scale per
//                    block (0.625 bytes a value). Rounding ≤ max|x| / 14 per block;
//                    outputs within 1e-1 (0.07 measured) on unit-scale inputs.
//   memattn::Q4Affine  like q4_1: 4-bit u_i ∈ [0, 15], a float scale s = (max − min) / 15
//                    and a float zero point m = min per block, value = m + s·u_i
//                    (0.75 bytes a value). Rounding ≤ (max − min) / 30 per block: a block
//                    of one sign, or off-centre, keeps twice the resolution of Q4's.
//                    Outputs within 1e-1 on unit-scale inputs.
//                    For both, a block holding ±∞ or NaN reads as NaN, as Q8's.
//   memattn::Rotated<S>     keys (and queries) Hadamard-rotated, stored as S.
//   memattn::IntegerDot<S>  stored as S; a single query's q·k taken in integers on the
//                    query rounded to int8 per block (StoredRows::integer_dot).
//   memattn::PerChannelKeys<S>  keys quantised as S per channel over groups of 32
//                    tokens (the newest, unfinished group exact), values as S (KIVI).
//
// One policy for every type (check_storable): a finite value that S would store as ±∞
// or NaN (float16 from 65520 on, bfloat16 from ~3.3962e38, a double past float's range)
// throws std::invalid_argument and the cache is unchanged; ±∞ and NaN themselves are
// stored as they are and poison the outputs that see them, as in T.
//
// The attention that reads stored rows lives in kernels/decode_attention.hpp (one query
// or a group, in registers where the instruction set converts) and in the causal softmax
// kernel (a tile at a time); this header only stores, converts and describes them.

#include "memattn/detail/assert.hpp"
#include "memattn/detail/packet.hpp"
#include "memattn/detail/tile_product.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace memattn {

/// 8-bit K/V storage: int8 values with one float scale per block of 32 (see above).
struct Q8 {
    static constexpr Index block = 32;  ///< values of a row that share one float scale
};

/// 4-bit K/V storage, symmetric: 4-bit values n_i ∈ [−7, 7] with one float scale
/// s = max|x_i| / 7 per block of 32 (see above).
struct Q4 {
    static constexpr Index block = 32;         ///< values of a row that share one scale
    static constexpr bool zero_point = false;  ///< value = s·n_i
};

/// 4-bit K/V storage, affine: 4-bit values u_i ∈ [0, 15] with one float scale
/// s = (max − min) / 15 and one float zero point min per block of 32 (see above).
struct Q4Affine {
    static constexpr Index block = 32;        ///< values of a row that share one scale and zero point
    static constexpr bool zero_point = true;  ///< value = min + s·u_i
};

/// The two 4-bit storage types.
template <class S>
concept Q4Storage = std::same_as<S, Q4> || std::same_as<S, Q4Affine>;

/// Keys rotated before they are stored as S (Q8, Q4 or Q4Affine), queries rotated at
/// every attend by the same orthonormal Walsh–Hadamard transform, so q·k is unchanged in
/// exact arithmetic while a key's outlier channels spread over its block and share its
/// scale with the rest (QuaRot, Ashkboos et al. 2024; ik_llama.cpp's K-cache Hadamard).
/// Values are stored as S unrotated. For KVCache and SlidingWindowCache.
template <class S>
struct Rotated {
    using storage = S;                    ///< how the rotated keys, and the values, are stored
    static constexpr Index block = S::block;  ///< S's block
};

/// Keys stored as S (Q8, Q4, Q4Affine, or `Rotated<S>` of one of them) whose
/// single-query attend takes q·k in integers: the query is rounded to int8 once per
/// attend, per block of 32 values with a scale of its own (s_q = max|q|/127), and each
/// block's Σ q_i·k_i over the stored codes is exact in int32 (vpdpbusd where the CPU has
/// VNNI, vpmaddubsw + vpmaddwd with AVX2), so the logit is the dot product of the rounded
/// query with the stored key, q̃·k̃, to float's rounding. What it costs: |q·k̃ − q̃·k̃| ≤
/// Σ_b s_q,b/2 · Σ_{i∈b} |k̃_i| (the query's rounding; docs/design.md §4.7, IntegerDot).
/// What it gives: no conversion of the keys to float (ggml's q8_0 dot, ik_llama.cpp's
/// int8 K·Q). Stored bytes and snapshots are S's, so a snapshot loads into either. The
/// grouped attend of two or more queries, the logit options and prefill read the keys in
/// float as S does. For KVCache and SlidingWindowCache of float (and of 16-bit rows, which
/// compute in float).
template <class S>
struct IntegerDot {
    using storage = S;                        ///< how the keys and values are stored
    static constexpr Index block = S::block;  ///< S's block
};

/// Keys quantised per channel (KIVI: Liu et al. 2024), values as S token by token, for
/// KVCache (S = Q8, Q4 or Q4Affine). The keys of each group of `group` tokens share, per
/// channel, one scale (and for Q4Affine one zero point) computed over the group, so a
/// channel that is large in every token (the outlier channels of real models' keys) gets
/// its own scale instead of setting the scale of the rest of its token's block. The
/// newest tokens, fewer than a group, stay exact (in the cache's scalar) until their group
/// is complete. What changes (docs/design.md §4.7, "Per-channel keys"): prefill attends
/// its own keys exactly and the past as stored, so a decode step after a prefill equals
/// the quantised reference rather than the prefill's rows; truncate cuts at group
/// boundaries or inside the unfinished group only (can_truncate).
template <class S>
struct PerChannelKeys {
    using storage = S;                        ///< how a finished group's keys, and the values, are stored
    static constexpr Index group = 32;        ///< tokens whose keys share a channel's scale
    static constexpr Index block = S::block;  ///< S's block (the values')
};

namespace detail {
template <class S>
inline constexpr bool is_rotated = false;
template <class S>
inline constexpr bool is_rotated<Rotated<S>> = true;
template <class S>
inline constexpr bool is_rotated<IntegerDot<S>> = is_rotated<S>;
/// S multiplies a single query's logits in integers: IntegerDot<S> of a block-scaled S,
/// rotated or not. One boolean, so that the concepts naming it stay one atomic constraint
/// each (clang 14 ran out of memory normalising a nested one beside KVCache's constraints).
template <class S>
inline constexpr bool integer_dot = false;
template <class S>
inline constexpr bool integer_dot<IntegerDot<S>> =
    std::is_same_v<S, Q8> || std::is_same_v<S, Q4> || std::is_same_v<S, Q4Affine> || std::is_same_v<S, Rotated<Q8>> ||
    std::is_same_v<S, Rotated<Q4>> || std::is_same_v<S, Rotated<Q4Affine>>;
/// S can be a cache's storage for scalar T as far as the integer dot goes: the rounded
/// query is float's (one atom, as above).
template <class S, class T>
inline constexpr bool integer_dot_for = !integer_dot<S> || std::is_same_v<T, float>;
/// S stores keys as they come and reads them in float (neither Rotated<...> nor
/// IntegerDot<...>): a concept, so that a constraint that names it in a primary template
/// and in a partial specialization is the same one.
template <class S>
inline constexpr bool per_channel_keys = false;
template <class S>
inline constexpr bool per_channel_keys<PerChannelKeys<S>> =
    std::is_same_v<S, Q8> || std::is_same_v<S, Q4> || std::is_same_v<S, Q4Affine>;
template <class S>
concept PlainKeys = !is_rotated<S> && !integer_dot<S> && !per_channel_keys<S>;
/// S stores each key on its own (not `PerChannelKeys<S>`, whose keys share scales across
/// the tokens of a group): the storage a ring of pairs can overwrite one at a time.
template <class S>
concept TokenKeys = !per_channel_keys<S>;
/// How a cache with storage S stores its values: S, or S's own for `PerChannelKeys<S>`.
template <class S>
struct value_storage {
    using type = S;
};
template <class S>
struct value_storage<PerChannelKeys<S>> {
    using type = S;
};
template <class S>
using value_storage_t = typename value_storage<S>::type;
}  // namespace detail

/// `Rotated<S>` over a block-scaled S.
template <class S>
concept RotatedStorage = detail::is_rotated<S> && (std::same_as<typename S::storage, Q8> || Q4Storage<typename S::storage>);

/// `IntegerDot<S>` over a block-scaled S, rotated or not.
template <class S>
concept IntegerDotStorage = detail::integer_dot<S>;

namespace detail {
template <class S>
inline constexpr bool compact_storage = std::is_same_v<S, Eigen::bfloat16> || std::is_same_v<S, Eigen::half> ||
                                        std::is_same_v<S, Q8> || Q4Storage<S> || RotatedStorage<S> || IntegerDotStorage<S> ||
                                        per_channel_keys<S>;
}  // namespace detail

/// The element types a cache can store keys and values in besides its scalar. One atomic
/// constraint (a boolean), not a disjunction of concepts: the caches' constraints name it
/// in a primary template and a partial specialization, and clang normalises both to check
/// them for ambiguity: for the disjunction, clang 14 took 100–145 s to parse memattn.hpp
/// (4 s now; measured 2026-12-02).
template <class S>
concept CompactStorage = detail::compact_storage<S>;

/// A cache of scalar T can store its pairs as S: T itself or a compact type (the integer
/// dot, `IntegerDot<S>`, for float only: it rounds a query to 8 bits, which a cache of
/// double is not kept for).
template <class S, class T>
concept StorageFor = Scalar<T> && (std::same_as<S, T> || (CompactStorage<S> && detail::integer_dot_for<S, T>));

namespace detail {

template <class S>
inline constexpr const char* storage_name = std::is_same_v<S, Eigen::bfloat16>     ? "bfloat16"
                                            : std::is_same_v<S, Eigen::half>       ? "float16"
                                            : std::is_same_v<S, Q8>                ? "Q8"
                                            : std::is_same_v<S, Q4>                ? "Q4"
                                            : std::is_same_v<S, Q4Affine>          ? "Q4Affine"
                                            : std::is_same_v<S, Rotated<Q8>>       ? "Rotated<Q8>"
                                            : std::is_same_v<S, Rotated<Q4>>       ? "Rotated<Q4>"
                                            : std::is_same_v<S, Rotated<Q4Affine>> ? "Rotated<Q4Affine>"
                                            : std::is_same_v<S, IntegerDot<Q8>>          ? "IntegerDot<Q8>"
                                            : std::is_same_v<S, IntegerDot<Q4>>          ? "IntegerDot<Q4>"
                                            : std::is_same_v<S, IntegerDot<Q4Affine>>    ? "IntegerDot<Q4Affine>"
                                            : std::is_same_v<S, IntegerDot<Rotated<Q8>>> ? "IntegerDot<Rotated<Q8>>"
                                            : std::is_same_v<S, IntegerDot<Rotated<Q4>>> ? "IntegerDot<Rotated<Q4>>"
                                            : std::is_same_v<S, IntegerDot<Rotated<Q4Affine>>> ? "IntegerDot<Rotated<Q4Affine>>"
                                            : std::is_same_v<S, PerChannelKeys<Q8>>       ? "PerChannelKeys<Q8>"
                                            : std::is_same_v<S, PerChannelKeys<Q4>>       ? "PerChannelKeys<Q4>"
                                            : std::is_same_v<S, PerChannelKeys<Q4Affine>> ? "PerChannelKeys<Q4Affine>"
                                            : std::is_same_v<S, float>             ? "float"
                                                                                   : "double";

/// The snapshot type code of storage S for a cache of scalar T (IntegerDot<S>: S's, the
/// bytes are the same).
template <class T, class S>
constexpr snapshot::TypeCode storage_code() {
    if constexpr (integer_dot<S>)
        return storage_code<T, typename S::storage>();
    else if constexpr (std::is_same_v<S, Eigen::bfloat16>)
        return snapshot::TypeCode::bfloat16;
    else if constexpr (std::is_same_v<S, Eigen::half>)
        return snapshot::TypeCode::float16;
    else if constexpr (std::is_same_v<S, Q8>)
        return snapshot::TypeCode::q8;
    else if constexpr (std::is_same_v<S, Q4>)
        return snapshot::TypeCode::q4;
    else if constexpr (std::is_same_v<S, Q4Affine>)
        return snapshot::TypeCode::q4_affine;
    else if constexpr (std::is_same_v<S, Rotated<Q8>>)
        return snapshot::TypeCode::q8_rotated;
    else if constexpr (std::is_same_v<S, Rotated<Q4>>)
        return snapshot::TypeCode::q4_rotated;
    else if constexpr (std::is_same_v<S, Rotated<Q4Affine>>)
        return snapshot::TypeCode::q4_affine_rotated;
    else if constexpr (std::is_same_v<S, PerChannelKeys<Q8>>)
        return snapshot::TypeCode::q8_per_channel_keys;
    else if constexpr (std::is_same_v<S, PerChannelKeys<Q4>>)
        return snapshot::TypeCode::q4_per_channel_keys;
    else if constexpr (std::is_same_v<S, PerChannelKeys<Q4Affine>>)
        return snapshot::TypeCode::q4_affine_per_channel_keys;
    else
        return snapshot::type_code<T>();
}

/// Q8 blocks in a row of `cols` values.
constexpr Index q8_blocks(Index cols) { return (cols + Q8::block - 1) / Q8::block; }

/// Whether S keeps float scales per block (Q8, Q4, Q4Affine): it holds float's whole
/// range, and only a double past it is lost.
template <class S>
inline constexpr bool scaled_storage =
    std::is_same_v<S, Q8> || Q4Storage<S> || RotatedStorage<S> || IntegerDotStorage<S> || per_channel_keys<S>;

/// The rotation of `Rotated<S>` storage on one head's row of n values, in place: the
/// normalised Walsh–Hadamard transform H_m/√m on consecutive segments of m values, each
/// m the largest power of two left (n = 128: one H_128; n = 96: H_64, then H_32; n = 1:
/// nothing). Orthonormal and its own inverse, so (Hq)·(Hk) = q·k in exact arithmetic.
template <class T>
void hadamard_rotate(T* x, Index n) noexcept {
    for (Index at = 0; at < n;) {
        const auto m = static_cast<Index>(std::bit_floor(static_cast<std::size_t>(n - at)));
        T* y = x + at;
        for (Index h = 1; h < m; h *= 2)
            for (Index i = 0; i < m; i += 2 * h)
                for (Index j = i; j < i + h; ++j) {
                    const T a = y[j], b = y[j + h];
                    y[j] = a + b;
                    y[j + h] = a - b;
                }
        if (m > 1) {
            const T norm = T(1) / std::sqrt(static_cast<T>(m));
            for (Index j = 0; j < m; ++j)
                y[j] *= norm;
        }
        at += m;
    }
}

/// The most hadamard_rotate multiplies a row's largest magnitude by: √m for its widest
/// segment m (|(H_m x)_i| / √m ≤ Σ|x_j| / √m ≤ √m · max|x_j|).
inline double hadamard_growth(Index n) noexcept {
    return n > 0 ? std::sqrt(static_cast<double>(std::bit_floor(static_cast<std::size_t>(n)))) : 1.0;
}

/// The smallest magnitude of float that storage S rounds to ±∞ (to nearest, ties to
/// even, as Eigen's scalar and vector conversions do): the midpoint between S's largest
/// finite value and the next power of two. Q8 stores a block as float scales, so only
/// a value past float's own range is lost; for T = S = float nothing is.
template <class S>
inline constexpr float storage_overflow = std::numeric_limits<float>::infinity();
template <>
inline constexpr float storage_overflow<Eigen::half> = 65520.0f;  // 65504 + half an ulp (16)
template <>
inline constexpr float storage_overflow<Eigen::bfloat16> = std::bit_cast<float>(std::uint32_t{0x7F7F8000});

/// The one policy of every storage type: a finite value that S would store as ±∞ or NaN
/// is refused with std::invalid_argument naming the function, the argument, the value
/// and its place; ±∞ and NaN themselves are stored as they are (and poison as in T).
/// A value is converted as put_rows converts it (double → float → S), so a double past
/// float's range is refused for every compact type, and a value that merely rounds to
/// S's largest finite one (float16: below 65520) is kept. Costs one compare per value.
template <class T, class S, class D>
void check_storable([[maybe_unused]] const PairSite& site, [[maybe_unused]] const D& rows,
                    [[maybe_unused]] bool values) {
    if constexpr (!std::is_same_v<S, T> && !(scaled_storage<S> && std::is_same_v<T, float>)) {
        const std::string_view argument = values ? site.value_name : site.key_name;
        const float limit = storage_overflow<S>;
        bool lost = false;
        for (Index r = 0; r < rows.rows(); ++r)
            for (Index c = 0; c < rows.cols(); ++c) {
                const T x = rows(r, c);
                lost |= std::isfinite(x) && !(std::abs(static_cast<float>(x)) < limit);
            }
        if (!lost) [[likely]]
            return;
        for (Index r = 0; r < rows.rows(); ++r)
            for (Index c = 0; c < rows.cols(); ++c) {
                const T x = rows(r, c);
                const bool kept = !(std::isfinite(x) && !(std::abs(static_cast<float>(x)) < limit));
                if constexpr (scaled_storage<S>)
                    require(kept, site.function, argument, "has the finite value ", x, " in row ", site.first_row + r, ", column ",
                            SiteColumn{site, c, values}, ", past float's range (", storage_name<S>,
                            " scales are float: its block would be stored as NaN)");
                else
                    require(kept, site.function, argument, "has the finite value ", x, " in row ", site.first_row + r, ", column ",
                            SiteColumn{site, c, values}, ", which ", storage_name<S>, " storage would hold as ",
                            "infinity (finite magnitudes below ", limit, " are kept, rounded)");
            }
    }
}

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

/// Σ_i q_i·x_i over n stored values, four packet accumulators (fused_storage only).
template <class E>
inline Packet<float> dot_span(const float* q, const E* x, Index n, Packet<float> acc) {
    using namespace Eigen::internal;
    using P = Packet<float>;
    constexpr Index lanes = packet_lanes<float>;
    P a1 = pset1<P>(0.0f), a2 = a1, a3 = a1;
    Index c = 0;
    for (; c + 4 * lanes <= n; c += 4 * lanes) {
        acc = pmadd(ploadu<P>(q + c), load_floats(x + c), acc);
        a1 = pmadd(ploadu<P>(q + c + lanes), load_floats(x + c + lanes), a1);
        a2 = pmadd(ploadu<P>(q + c + 2 * lanes), load_floats(x + c + 2 * lanes), a2);
        a3 = pmadd(ploadu<P>(q + c + 3 * lanes), load_floats(x + c + 3 * lanes), a3);
    }
    for (; c + lanes <= n; c += lanes)
        acc = pmadd(ploadu<P>(q + c), load_floats(x + c), acc);
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

/// acc[0, n) += w · x[0, n) (fused_storage only; the packet part, the tail is the caller's).
template <class E>
inline Index add_span(float w, const E* x, Index n, float* acc) {
    using namespace Eigen::internal;
    using P = Packet<float>;
    constexpr Index lanes = packet_lanes<float>;
    const P weight = pset1<P>(w);
    Index c = 0;
    for (; c + lanes <= n; c += lanes)
        pstoreu(acc + c, pmadd(weight, load_floats(x + c), ploadu<P>(acc + c)));
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

/// Rows × cols values of T stored as S: a plain row-major matrix when S is T, else the
/// encoded rows. Both sides have one interface: put_rows (encode), decode_rows (into a
/// buffer of T), bytes, raw copies for growth, and the snapshot payload.
template <class T, class S>
class StoredRows;

/// S = T: the values themselves, readable in place.
template <class T>
class StoredRows<T, T> {
public:
    static constexpr bool compact = false;
    StoredRows(Index rows, Index cols) : m_(rows, cols) {}

    [[nodiscard]] Index rows() const noexcept { return m_.rows(); }
    [[nodiscard]] Index cols() const noexcept { return m_.cols(); }
    void swap(StoredRows& other) noexcept { m_.swap(other.m_); }

    template <class D>
    void put_rows(Index first, const D& rows) {
        m_.middleRows(first, rows.rows()) = rows;
    }
    void copy_rows_from(const StoredRows& other, Index n) { m_.topRows(n) = other.m_.topRows(n); }
    /// Rows [to, to + n) = rows [from, from + n), the two ranges apart.
    void copy_within(Index from, Index to, Index n) { m_.middleRows(to, n) = m_.middleRows(from, n); }
    void decode_rows(Index first, Index n, T* out, Index ld) const {
        Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>>(out, n, cols(), Eigen::OuterStride<>(ld)) =
            m_.middleRows(first, n);
    }
    [[nodiscard]] auto block(Index first, Index n) const { return m_.middleRows(first, n); }
    [[nodiscard]] const Matrix<T>& matrix() const noexcept { return m_; }
    /// A packet of row r from column c (c + lanes ≤ cols), and one value.
    [[nodiscard]] Packet<T> stored_packet(Index r, Index c) const { return Eigen::internal::ploadu<Packet<T>>(&m_(r, c)); }
    [[nodiscard]] T stored_value(Index r, Index c) const { return m_(r, c); }
    /// Asks for a row towards the cache ahead of its use.
    void prefetch_row(Index row) const { prefetch_rows(&m_(row, 0), 1, 0, cols()); }
    [[nodiscard]] auto row(Index r) { return m_.row(r); }
    [[nodiscard]] auto row(Index r) const { return m_.row(r); }

    [[nodiscard]] std::size_t bytes(Index rows) const noexcept { return row_bytes(cols()) * static_cast<std::size_t>(rows); }
    [[nodiscard]] static std::size_t row_bytes(Index cols) noexcept { return sizeof(T) * static_cast<std::size_t>(cols); }

    void write_rows(snapshot::Writer& w, Index first, Index n) const { w.matrix(m_.middleRows(first, n)); }
    void read_rows(snapshot::Reader& r, Index first, Index n) { r.matrix(m_.middleRows(first, n), "rows"); }

private:
    Matrix<T> m_;
};

/// bfloat16 or half: one 2-byte element per value; Eigen's vectorised casts convert.
template <class T, class S>
    requires std::same_as<S, Eigen::bfloat16> || std::same_as<S, Eigen::half>
class StoredRows<T, S> {
public:
    static constexpr bool compact = true;
    StoredRows(Index rows, Index cols) : m_(rows, cols) {}

    [[nodiscard]] Index rows() const noexcept { return m_.rows(); }
    [[nodiscard]] Index cols() const noexcept { return m_.cols(); }
    void swap(StoredRows& other) noexcept { m_.swap(other.m_); }

    template <class D>
    void put_rows(Index first, const D& rows) {
        if constexpr (std::is_same_v<T, float>)
            m_.middleRows(first, rows.rows()) = rows.template cast<S>();
        else  // double → float → S: one rounding to S's precision, as float's would be
            m_.middleRows(first, rows.rows()) = rows.template cast<float>().template cast<S>();
    }
    void copy_rows_from(const StoredRows& other, Index n) { m_.topRows(n) = other.m_.topRows(n); }
    /// Rows [to, to + n) = rows [from, from + n), the two ranges apart.
    void copy_within(Index from, Index to, Index n) { m_.middleRows(to, n) = m_.middleRows(from, n); }
    void decode_rows(Index first, Index n, T* out, Index ld) const {
        for (Index r = 0; r < n; ++r) {
            if constexpr (std::is_same_v<T, float>) {
                decode_span(&m_(first + r, 0), cols(), 1.0f, out + r * ld);
            } else {
                for (Index c = 0; c < cols(); ++c)
                    out[r * ld + c] = static_cast<double>(to_float(m_(first + r, c)));
            }
        }
    }

    /// Asks for a row towards the cache ahead of its use.
    void prefetch_row(Index row) const { prefetch_rows(&m_(row, 0), 1, 0, cols()); }

    /// q·row in float, converted in registers (fused_storage).
    [[nodiscard]] float dot(Index row, const float* q) const {
        const S* x = &m_(row, 0);
        const Index d = cols(), packed = d / packet_lanes<float> * packet_lanes<float>;
        float sum = Eigen::internal::predux(dot_span(q, x, packed, Eigen::internal::pset1<Packet<float>>(0.0f)));
        for (Index c = packed; c < d; ++c)
            sum += q[c] * to_float(x[c]);
        return sum;
    }
    /// acc += w · row in float, converted in registers (fused_storage).
    void add_scaled(Index row, float w, float* acc) const {
        const S* x = &m_(row, 0);
        for (Index c = add_span(w, x, cols(), acc); c < cols(); ++c)
            acc[c] += w * to_float(x[c]);
    }
    /// add_scaled for rows [first, first + n) with weights w, acc in registers
    /// (add_rows_in_registers; fused_storage).
    void add_rows(Index first, Index n, const float* w, float* acc, Index ahead, Index prefetch_end) const {
        add_rows_in_registers(*this, first, n, w, acc, ahead, prefetch_end);
    }
    [[nodiscard]] Packet<float> packet(Index r, Index c) const { return load_packet(&m_(r, c)); }
    [[nodiscard]] float scalar(Index r, Index c) const { return to_float(m_(r, c)); }
    [[nodiscard]] static float weight(Index, Index, float w) { return w; }
    /// The stored values as float, exactly as decode_rows gives them: a packet from
    /// column c (c + lanes ≤ cols; fused_storage), and one value.
    [[nodiscard]] Packet<float> stored_packet(Index r, Index c) const { return load_packet(&m_(r, c)); }
    [[nodiscard]] float stored_value(Index r, Index c) const { return to_float(m_(r, c)); }

    [[nodiscard]] std::size_t bytes(Index rows) const noexcept { return row_bytes(cols()) * static_cast<std::size_t>(rows); }
    [[nodiscard]] static std::size_t row_bytes(Index cols) noexcept { return 2 * static_cast<std::size_t>(cols); }

    void write_rows(snapshot::Writer& w, Index first, Index n) const {
        for (Index r = first; r < first + n; ++r)
            for (Index c = 0; c < cols(); ++c)
                w.number(std::bit_cast<std::uint16_t>(m_(r, c)));
    }
    void read_rows(snapshot::Reader& r, Index first, Index n) {
        for (Index i = first; i < first + n; ++i)
            for (Index c = 0; c < cols(); ++c)
                m_(i, c) = std::bit_cast<S>(r.number<std::uint16_t>("rows"));
    }

private:
    Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> m_;
};

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
    /// q̃·row for the rounded query q̃ (IntegerDot<Q8>): per block s_k·s_q·Σ code·k, the
    /// sum exact in int32 (int8_block_dot), the blocks added in float.
    [[nodiscard]] float integer_dot(Index row, const IntegerQuery& q) const {
        const std::int8_t* x = &q_(row, 0);
        const float* s = &scales_(row, 0);
        const Index d = cols(), whole = d / Q8::block;
        float sum = 0;
        Index b = 0;
        if constexpr (integer_blocks) {
            sum = q8_integer_blocks(x, s, q, whole);
            b = whole;
        }
        for (; b < scales_.cols(); ++b) {  // without AVX2 every block, with it the last, shorter one
            const Index c0 = b * Q8::block, end = std::min(d, c0 + Q8::block);
            std::int32_t dot = 0;
            for (Index c = c0; c < end; ++c)
                dot += std::int32_t{q.code[c]} * std::int32_t{x[c]};
            sum += s[b] * q.scale[b] * static_cast<float>(dot);
        }
        return sum;
    }
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
    Eigen::Matrix<std::int8_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> q_;
    Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> scales_;
};

/// A 4-bit value as float: the one formula every reader of Q4 and Q4Affine storage
/// uses, packet or scalar, so all give the same bits. Q4: s·(u − 8) (u − 8 is exact);
/// Q4Affine: u·s + m in one rounding where the target has FMA (as Eigen's pmadd); without
/// it, in double and then rounded to float (u·s is exact there, and cannot overflow on
/// its way as float's u·s would for a block spanning more than FLT_MAX).
template <class S>
inline float q4_value(float u, float s, float m) {
    if constexpr (S::zero_point) {
#if defined(__FMA__)
        return std::fma(u, s, m);
#else
        return static_cast<float>(static_cast<double>(u) * static_cast<double>(s) + static_cast<double>(m));
#endif
    } else {
        return s * (u - 8.0f);
    }
}

/// A 4-bit block's scale s and zero point m (0 for Q4).
struct Q4Scale {
    float s, m;
};

/// Q4's or Q4Affine's rounding of n values that share a scale (a block of a row, or a
/// channel of a group of keys): returns s and m (Q4: s = max|x_i| / 7; Q4Affine:
/// s = (max − min) / 15, m = min) and writes the codes u_i ∈ [0, 15] (value = q4_value<S>(u_i))
/// to codes[i·stride], the quantisation in double (no overflow, one rounding). A block
/// holding ±∞ or NaN gets s = m = NaN and zero codes.
template <class S>
inline Q4Scale q4_quantise(const float* x, Index n, std::uint8_t* codes, Index stride) {
    float lo = std::numeric_limits<float>::infinity(), hi = -lo;
    bool finite = true;
    for (Index i = 0; i < n; ++i) {
        finite = finite && std::isfinite(x[i]);
        lo = std::min(lo, x[i]);
        hi = std::max(hi, x[i]);
    }
    Q4Scale q{0, 0};
    double inverse = 0;
    if (!finite) {
        q.s = q.m = std::numeric_limits<float>::quiet_NaN();
    } else if constexpr (S::zero_point) {
        q.m = lo;
        const double range = static_cast<double>(hi) - static_cast<double>(lo);
        q.s = static_cast<float>(range / 15.0);
        // The largest code must read back finite: near FLT_MAX, s may round up past it.
        while (!std::isfinite(q4_value<S>(15.0f, q.s, q.m)))
            q.s = std::nextafter(q.s, 0.0f);
        inverse = q.s > 0 ? 1.0 / static_cast<double>(q.s) : 0.0;
    } else {
        const double amax = std::max(-static_cast<double>(lo), static_cast<double>(hi));
        q.s = static_cast<float>(amax / 7.0);
        inverse = q.s > 0 ? 1.0 / static_cast<double>(q.s) : 0.0;
    }
    for (Index i = 0; i < n; ++i) {
        int u = 0;
        if (finite) {
            const double v = static_cast<double>(x[i]);
            if constexpr (S::zero_point)
                u = std::clamp(static_cast<int>(std::nearbyint((v - static_cast<double>(q.m)) * inverse)), 0, 15);
            else
                u = std::clamp(static_cast<int>(std::nearbyint(v * inverse)), -7, 7) + 8;
        }
        codes[i * stride] = static_cast<std::uint8_t>(u);
    }
    return q;
}

/// Whether the packet paths compute q4_value<S> themselves (pmadd is one rounding, as
/// std::fma): always for Q4, for Q4Affine only with FMA; else they read q4_value lane by lane.
template <class S>
inline constexpr bool q4_packets =
#if defined(__FMA__)
    true;
#else
    !S::zero_point;
#endif

#if defined(__AVX512F__)
template <class S>
inline Packet<float> q4_table(float s, float m) {
    using namespace Eigen::internal;
    if constexpr (q4_packets<S>) {
        const Packet<float> u = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        if constexpr (S::zero_point)
            return pmadd(u, pset1<Packet<float>>(s), pset1<Packet<float>>(m));
        else
            return pmul(pset1<Packet<float>>(s), psub(u, pset1<Packet<float>>(8.0f)));
    } else {
        alignas(64) float table[16];
        for (int u = 0; u < 16; ++u)
            table[u] = q4_value<S>(static_cast<float>(u), s, m);
        return pload<Packet<float>>(table);
    }
}
#endif

/// Q4 and Q4Affine: per row, blocks of 32 values as 16 bytes (value i of a block in the
/// low nibble of byte i for i < 16, in the high nibble of byte i − 16 after: a packet
/// of 8 or 16 values is one load, a shift for the high half, a mask, a widening), one
/// float scale per block and, for Q4Affine, one float zero point. The last block of a
/// row shorter than 32 keeps the same layout, its unused nibbles zero.
template <class T, class S>
    requires Q4Storage<S>
class StoredRows<T, S> {
public:
    static constexpr bool compact = true;
    static constexpr Index block = S::block;
    static constexpr Index block_bytes = block / 2;
    StoredRows(Index rows, Index cols)
        : cols_(cols),
          u_(rows, block_bytes * q8_blocks(cols)),
          scales_(rows, q8_blocks(cols)),
          zeros_(rows, S::zero_point ? q8_blocks(cols) : 0) {}

    [[nodiscard]] Index rows() const noexcept { return u_.rows(); }
    [[nodiscard]] Index cols() const noexcept { return cols_; }
    void swap(StoredRows& other) noexcept {
        std::swap(cols_, other.cols_);
        u_.swap(other.u_);
        scales_.swap(other.scales_);
        zeros_.swap(other.zeros_);
    }

    template <class D>
    void put_rows(Index first, const D& rows) {
        for (Index r = 0; r < rows.rows(); ++r)
            for (Index b = 0; b < scales_.cols(); ++b) {
                const Index c0 = b * block, n = std::min(block, cols_ - c0);
                float x[block];
                std::uint8_t u[block];
                for (Index c = 0; c < n; ++c)
                    x[c] = static_cast<float>(rows(r, c0 + c));
                const Q4Scale q = q4_quantise<S>(x, n, u, 1);
                scales_(first + r, b) = q.s;
                if constexpr (S::zero_point)
                    zeros_(first + r, b) = q.m;
                std::uint8_t* bytes = &u_(first + r, b * block_bytes);
                std::fill(bytes, bytes + block_bytes, std::uint8_t{0});
                for (Index i = 0; i < n; ++i)
                    bytes[i % block_bytes] |= static_cast<std::uint8_t>(u[i] << (i / block_bytes * 4));
            }
    }
    void copy_rows_from(const StoredRows& other, Index n) {
        u_.topRows(n) = other.u_.topRows(n);
        scales_.topRows(n) = other.scales_.topRows(n);
        zeros_.topRows(n) = other.zeros_.topRows(n);
    }
    /// Rows [to, to + n) = rows [from, from + n), the two ranges apart.
    void copy_within(Index from, Index to, Index n) {
        u_.middleRows(to, n) = u_.middleRows(from, n);
        scales_.middleRows(to, n) = scales_.middleRows(from, n);
        zeros_.middleRows(to, n) = zeros_.middleRows(from, n);
    }
    void decode_rows(Index first, Index n, T* out, Index ld) const {
        for (Index r = 0; r < n; ++r) {
            T* row = out + r * ld;
            Index c = 0;
            if constexpr (fused_storage && std::is_same_v<T, float>) {
                for (; c + packet_lanes<float> <= cols_; c += packet_lanes<float>)
                    Eigen::internal::pstoreu(row + c, stored_packet(first + r, c));
            }
            for (; c < cols_; ++c)
                row[c] = static_cast<T>(stored_value(first + r, c));
        }
    }

    /// Asks for a row towards the cache ahead of its use.
    void prefetch_row(Index row) const {
        prefetch_rows(&u_(row, 0), 1, 0, u_.cols());
        prefetch_rows(&scales_(row, 0), 1, 0, scales_.cols());
        if constexpr (S::zero_point)
            prefetch_rows(&zeros_(row, 0), 1, 0, zeros_.cols());
    }

    /// q·row in float, converted in registers (fused_storage): with AVX-512, Σ q_i·v_i of
    /// the values looked up in each block's table; with AVX2, per block (its codes decoded
    /// at once) s·Σ q_i·(u_i − 8) (Q4) or s·Σ q_i·u_i + m·Σ q_i (Q4Affine); elsewhere the
    /// same per packet, Q4 as s·(Σ q_i·u_i − 8·Σ q_i).
    [[nodiscard]] float dot(Index row, const float* q) const {
        using namespace Eigen::internal;
        using P = Packet<float>;
        constexpr Index lanes = packet_lanes<float>;
        static_assert(block % (2 * lanes) == 0, "a Q4 block is a whole number of packet pairs");
        const std::uint8_t* x = &u_(row, 0);
        const float* s = &scales_(row, 0);
        const Index whole = cols_ / block;
        Index whole_blocks = whole;  // those the packet loop below takes
        P qu = pset1<P>(0.0f), qz = qu;
        if constexpr (nibble_tables) {  // a block is two packets: its low nibbles, then its high
            static_assert(block == 2 * lanes);
            for (Index b = 0; b < whole; ++b) {
                const P table = q4_table<S>(s[b], S::zero_point ? zeros_(row, b) : 0.0f);
                const std::uint8_t* xb = x + b * block_bytes;
                qu = pmadd(ploadu<P>(q + b * block), lookup_nibbles(xb, false, table), qu);
                qz = pmadd(ploadu<P>(q + b * block + lanes), lookup_nibbles(xb, true, table), qz);
            }
            whole_blocks = 0;
        }
        if constexpr (nibble_blocks) {  // a block is four packets, decoded at once
            static_assert(block == 4 * lanes);
            for (Index b = 0; b < whole; ++b) {
                const float* qb = q + b * block;
                P u[4];
                load_nibble_block<S::zero_point ? 0 : 8>(x + b * block_bytes, u);
                const P q0 = ploadu<P>(qb), q1 = ploadu<P>(qb + lanes), q2 = ploadu<P>(qb + 2 * lanes),
                        q3 = ploadu<P>(qb + 3 * lanes);
                const P a = padd(pmadd(q2, u[2], pmul(q0, u[0])), pmadd(q3, u[3], pmul(q1, u[1])));
                qu = pmadd(pset1<P>(s[b]), a, qu);  // Q4: s·Σ q_i·(u_i − 8), exact codes
                if constexpr (S::zero_point)
                    qz = pmadd(pset1<P>(zeros_(row, b)), padd(padd(q0, q1), padd(q2, q3)), qz);
            }
            whole_blocks = 0;
        }
        for (Index b = 0; b < whole_blocks; ++b) {
            const float* qb = q + b * block;
            const std::uint8_t* xb = x + b * block_bytes;
            P a = pset1<P>(0.0f), sum = a;
            for (Index c = 0; c < block; c += lanes) {
                const P qp = ploadu<P>(qb + c);
                a = pmadd(qp, load_nibble_packet(xb + c % block_bytes, c >= block_bytes), a);
                sum = padd(sum, qp);
            }
            if constexpr (S::zero_point) {
                qu = pmadd(pset1<P>(s[b]), a, qu);
                qz = pmadd(pset1<P>(zeros_(row, b)), sum, qz);
            } else {  // s·(Σ q_i·u_i − 8·Σ q_i): no −8s to overflow
                qu = pmadd(pset1<P>(s[b]), psub(a, pmul(pset1<P>(8.0f), sum)), qu);
            }
        }
        float total = predux(padd(qu, qz));
        for (Index c = whole * block; c < cols_; ++c)  // the last, shorter block
            total += q[c] * stored_value(row, c);
        return total;
    }
    /// q̃·row for the rounded query q̃ (IntegerDot<S>): per block s_k·s_q·Σ code·(u − 8)
    /// (Q4) or s_k·s_q·Σ code·u + m·s_q·Σ code (Q4Affine), the sums exact in int32
    /// (nibble_codes, dot_u8_s8), the blocks added in float. The last, shorter block reads
    /// as the others: the query's codes past the row are 0.
    [[nodiscard]] float integer_dot(Index row, const IntegerQuery& q) const {
        const float* s = &scales_(row, 0);
        const Index blocks = scales_.cols();
        float zero_term = 0;  // Q4Affine: Σ_b m_b·s_q,b·Σ codes
        if constexpr (S::zero_point)
            for (Index b = 0; b < blocks; ++b)
                zero_term += zeros_(row, b) * q.code_sum[b];
        if constexpr (integer_blocks) {
            return q4_integer_blocks<S::zero_point>(&u_(row, 0), s, q, blocks) + zero_term;
        } else {
            float sum = 0;
            for (Index b = 0; b < blocks; ++b) {
                std::int32_t dot = 0;
                for (Index i = 0; i < block; ++i) {
                    const auto u = static_cast<std::int32_t>(code(row, b * block + i));
                    dot += std::int32_t{q.code[b * block + i]} * (S::zero_point ? u : u - 8);
                }
                sum += s[b] * q.scale[b] * static_cast<float>(dot);
            }
            return sum + zero_term;
        }
    }
    /// acc += w · row in float, converted in registers.
    void add_scaled(Index row, float w, float* acc) const {
        using namespace Eigen::internal;
        using P = Packet<float>;
        constexpr Index lanes = packet_lanes<float>;
        const P weight = pset1<P>(w);
        Index c = 0;
        for (; c + lanes <= cols_; c += lanes)
            pstoreu(acc + c, pmadd(weight, stored_packet(row, c), ploadu<P>(acc + c)));
        for (; c < cols_; ++c)
            acc[c] += w * stored_value(row, c);
    }
    /// add_scaled for rows [first, first + n) with weights w, acc in registers
    /// (add_rows_in_registers; fused_storage). With AVX-512, block by block: a row's
    /// blocks of a tile of up to four (eight packets of acc in registers) each build their
    /// table once and look both halves up in it. Through the generic per-packet loop the
    /// compiler kept Q4Affine's accumulators in memory and recomputed each packet's block
    /// (measured: the single-query attend at 4096 and 65536 pairs, d = 128, took 2.0 and
    /// 1.8× Q4's time). Every element is the same multiply-add chain in row order, so
    /// the bits are the generic loop's. With AVX2, block by block too, two blocks at a
    /// time, each block's 32 codes decoded at once (load_nibble_block; the attend at 65536
    /// pairs took 0.8 of the per-packet loop's time for Q4, 0.6 for Q4Affine, on a Zen 2).
    void add_rows(Index first, Index n, const float* w, float* acc, Index ahead, Index prefetch_end) const {
        if constexpr (nibble_tables) {
            using namespace Eigen::internal;
            using P = Packet<float>;
            constexpr Index lanes = packet_lanes<float>;
            constexpr int tile = 4;  // blocks: 8 packets of acc
            const Index whole = cols_ / block;
            for (Index b0 = 0; b0 < whole; b0 += tile) {
                const bool prefetch = ahead > 0 && b0 == 0;  // the first pass over the rows asks for them
                dispatch<tile>(std::min<Index>(tile, whole - b0), [&]<int Blocks>() {
                    P r[2 * Blocks];
                    for (int p = 0; p < 2 * Blocks; ++p)
                        r[p] = ploadu<P>(acc + b0 * block + p * lanes);
                    for (Index j = 0; j < n; ++j) {
                        const Index row = first + j;
                        if (prefetch && row + ahead < prefetch_end)
                            prefetch_row(row + ahead);
                        const P weight = pset1<P>(w[j]);
                        const std::uint8_t* x = &u_(row, b0 * block_bytes);
                        for (int b = 0; b < Blocks; ++b) {
                            const P table = q4_table<S>(scales_(row, b0 + b), S::zero_point ? zeros_(row, b0 + b) : 0.0f);
                            r[2 * b] = pmadd(weight, lookup_nibbles(x + b * block_bytes, false, table), r[2 * b]);
                            r[2 * b + 1] = pmadd(weight, lookup_nibbles(x + b * block_bytes, true, table), r[2 * b + 1]);
                        }
                    }
                    for (int p = 0; p < 2 * Blocks; ++p)
                        pstoreu(acc + b0 * block + p * lanes, r[p]);
                });
            }
            add_last_block(first, n, w, acc, whole * block);
        } else if constexpr (nibble_blocks) {
            // AVX2, block by block as above, two blocks (eight packets of acc) per pass,
            // each block's codes decoded at once (stored_block): the same bits.
            using namespace Eigen::internal;
            using P = Packet<float>;
            constexpr Index lanes = packet_lanes<float>;
            constexpr int tile = 2;
            const Index whole = cols_ / block;
            for (Index b0 = 0; b0 < whole; b0 += tile) {
                const bool prefetch = ahead > 0 && b0 == 0;
                dispatch<tile>(std::min<Index>(tile, whole - b0), [&]<int Blocks>() {
                    P r[4 * Blocks];
                    for (int p = 0; p < 4 * Blocks; ++p)
                        r[p] = ploadu<P>(acc + b0 * block + p * lanes);
                    for (Index j = 0; j < n; ++j) {
                        const Index row = first + j;
                        if (prefetch && row + ahead < prefetch_end)
                            prefetch_row(row + ahead);
                        const P weight = pset1<P>(w[j]);
                        for (int b = 0; b < Blocks; ++b) {
                            P v[4];
                            stored_block(row, b0 + b, v);
                            for (int k = 0; k < 4; ++k)
                                r[4 * b + k] = pmadd(weight, v[k], r[4 * b + k]);
                        }
                    }
                    for (int p = 0; p < 4 * Blocks; ++p)
                        pstoreu(acc + b0 * block + p * lanes, r[p]);
                });
            }
            add_last_block(first, n, w, acc, whole * block);
        } else {
            add_rows_in_registers(*this, first, n, w, acc, ahead, prefetch_end);
        }
    }
    [[nodiscard]] Packet<float> packet(Index r, Index c) const { return stored_packet(r, c); }
    [[nodiscard]] float scalar(Index r, Index c) const { return stored_value(r, c); }
    [[nodiscard]] static float weight(Index, Index, float w) { return w; }
    /// The 32 stored values of block b of row r as four packets (nibble_blocks: AVX2), the
    /// bits stored_packet gives for columns 32b, 32b + 8, 32b + 16 and 32b + 24.
    void stored_block(Index r, Index b, Packet<float> (&v)[4]) const {
        using namespace Eigen::internal;
        using P = Packet<float>;
        load_nibble_block<S::zero_point ? 0 : 8>(&u_(r, b * block_bytes), v);
        const P scale = pset1<P>(scales_(r, b));
        if constexpr (S::zero_point) {
            const P zero = pset1<P>(zeros_(r, b));
            for (int k = 0; k < 4; ++k)
                v[k] = pmadd(v[k], scale, zero);
        } else {
            for (int k = 0; k < 4; ++k)
                v[k] = pmul(scale, v[k]);
        }
    }
    /// The stored values as float, exactly as decode_rows gives them (q4_value): a packet
    /// from column c (c + lanes ≤ cols, c a multiple of the lanes; fused_storage), and one value.
    [[nodiscard]] Packet<float> stored_packet(Index r, Index c) const {
        using namespace Eigen::internal;
        using P = Packet<float>;
        const Index b = c / block, i = c % block;
        if constexpr (nibble_tables)
            return lookup_nibbles(&u_(r, b * block_bytes + i % block_bytes), i >= block_bytes,
                                  q4_table<S>(scales_(r, b), S::zero_point ? zeros_(r, b) : 0.0f));
        if constexpr (!q4_packets<S>) {
            alignas(64) float v[packet_lanes<float>];
            for (Index l = 0; l < packet_lanes<float>; ++l)
                v[l] = stored_value(r, c + l);
            return pload<P>(v);
        }
        const P u = load_nibble_packet(&u_(r, b * block_bytes + i % block_bytes), i >= block_bytes);
        const P s = pset1<P>(scales_(r, b));
        if constexpr (S::zero_point)
            return pmadd(u, s, pset1<P>(zeros_(r, b)));
        else
            return pmul(s, psub(u, pset1<P>(8.0f)));
    }
    [[nodiscard]] float stored_value(Index r, Index c) const {
        const Index b = c / block;
        return q4_value<S>(static_cast<float>(code(r, c)), scales_(r, b), S::zero_point ? zeros_(r, b) : 0.0f);
    }

    [[nodiscard]] std::size_t bytes(Index rows) const noexcept { return row_bytes(cols()) * static_cast<std::size_t>(rows); }
    [[nodiscard]] static std::size_t row_bytes(Index cols) noexcept {
        const auto blocks = static_cast<std::size_t>(q8_blocks(cols));
        return blocks * (static_cast<std::size_t>(block_bytes) + sizeof(float) * (S::zero_point ? 2 : 1));
    }

    /// Each row as its scales, its zero points (Q4Affine), then its bytes.
    void write_rows(snapshot::Writer& w, Index first, Index n) const {
        for (Index r = first; r < first + n; ++r) {
            w.matrix(scales_.row(r));
            if constexpr (S::zero_point)
                w.matrix(zeros_.row(r));
            w.matrix(u_.row(r));
        }
    }
    void read_rows(snapshot::Reader& rd, Index first, Index n) {
        for (Index r = first; r < first + n; ++r) {
            rd.matrix(scales_.row(r), "rows");
            if constexpr (S::zero_point)
                rd.matrix(zeros_.row(r), "rows");
            rd.matrix(u_.row(r), "rows");
        }
    }

private:
    /// The 4-bit code u of column c of row r (c may run past cols up to its block's end).
    [[nodiscard]] unsigned code(Index r, Index c) const {
        const Index b = c / block, i = c % block;
        return (u_(r, b * block_bytes + i % block_bytes) >> (i / block_bytes * 4)) & 0x0Fu;
    }
    /// add_rows' columns from c (the last, shorter block): its whole packets, then its lanes.
    void add_last_block(Index first, Index n, const float* w, float* acc, Index c) const {
        using namespace Eigen::internal;
        using P = Packet<float>;
        constexpr Index lanes = packet_lanes<float>;
        for (; c + lanes <= cols_; c += lanes) {
            P r = ploadu<P>(acc + c);
            for (Index j = 0; j < n; ++j)
                r = pmadd(pset1<P>(w[j]), stored_packet(first + j, c), r);
            pstoreu(acc + c, r);
        }
        for (; c < cols_; ++c)
            for (Index j = 0; j < n; ++j)
                acc[c] += w[j] * stored_value(first + j, c);
    }

    Index cols_;
    Eigen::Matrix<std::uint8_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> u_;
    Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> scales_;
    Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> zeros_;
};

/// `Rotated<S>`: the rows of S (the memory rotates its keys before it stores them and its
/// queries before it reads them; the stored rows are S's).
template <class T, class S>
class StoredRows<T, Rotated<S>> : public StoredRows<T, S> {
public:
    using StoredRows<T, S>::StoredRows;
};

/// `IntegerDot<S>`: the rows of S, whose integer_dot the single-query attend reads.
template <class T, class S>
class StoredRows<T, IntegerDot<S>> : public StoredRows<T, S> {
public:
    using StoredRows<T, S>::StoredRows;
};

/// A query's products with one group's per-channel scales, for the single-query dot of
/// `PerChannelKeys<S>` keys: qs = q ⊙ s_g and the group's constant term (Q4Affine:
/// Σ_c q_c·m_c; Q4: −8·Σ_c qs_c, so a code's u − 8 needs no subtraction; Q8: 0), taken
/// when the keys reach a new group, so a key's logit is Σ_c qs_c·u_c + constant: one
/// multiply-add per packet of codes instead of a scale and a zero-point packet per packet.
struct ChannelQuery {
    /// The widest query it holds (4 KiB on the stack); a wider head takes the plain dot.
    static constexpr Index max_depth = 1024;
    Index group = -1;  ///< the group qs is of (−1: none yet)
    float constant = 0;
    alignas(64) float qs[max_depth];
};

/// `PerChannelKeys<S>`'s keys (a cache stores its values as S, token by token). Rows come
/// in groups of G = `group` tokens. A finished group's rows are S's codes, row by row
/// (Q8: one int8 per value; Q4, Q4Affine: 4-bit codes laid out in blocks of 32 columns as
/// StoredRows<T, Q4>'s rows), with one scale (and for Q4Affine one zero point) per channel
/// of the group, computed over its G tokens (q8_quantise, q4_quantise on the channel).
/// The rows of the unfinished group, fewer than G, are kept as T, exactly, in a buffer of
/// G rows; put_rows quantises a group when its last row arrives. Rows are appended in
/// order: put_rows at the first row not finished or later in the unfinished group, and
/// keep(rows) (a cache's truncate) cuts at a group boundary or inside the unfinished group.
template <class T, class S>
class StoredRows<T, PerChannelKeys<S>> {
public:
    static constexpr bool compact = true;
    static constexpr Index group = PerChannelKeys<S>::group;
    static constexpr bool nibbles = Q4Storage<S>;
    static constexpr bool zero_point = std::is_same_v<S, Q4Affine>;
    static constexpr Index block = Q8::block;  ///< columns of one block of 4-bit codes (16 bytes)
    static constexpr Index block_bytes = block / 2;
    StoredRows(Index rows, Index cols)
        : cols_(cols),
          codes_(rows, code_bytes(cols)),
          scales_((rows + group - 1) / group, cols),
          zeros_(zero_point ? (rows + group - 1) / group : 0, cols),
          tail_(group, cols) {}

    [[nodiscard]] Index rows() const noexcept { return codes_.rows(); }
    [[nodiscard]] Index cols() const noexcept { return cols_; }
    /// Bytes allocated: the codes, scales and zero points of rows() rows, and the exact
    /// rows of the unfinished group (G rows of T, held whatever the length).
    [[nodiscard]] std::size_t allocated_bytes() const noexcept {
        return static_cast<std::size_t>(codes_.size()) * sizeof(Code) +
               sizeof(float) * static_cast<std::size_t>(scales_.size() + zeros_.size()) +
               sizeof(T) * static_cast<std::size_t>(tail_.size());
    }
    /// Rows quantised: the finished groups' (a multiple of G).
    [[nodiscard]] Index finished() const noexcept { return finished_; }
    void swap(StoredRows& other) noexcept {
        std::swap(cols_, other.cols_);
        std::swap(finished_, other.finished_);
        codes_.swap(other.codes_);
        scales_.swap(other.scales_);
        zeros_.swap(other.zeros_);
        tail_.swap(other.tail_);
    }

    /// Rows [first, first + rows.rows()), first in the unfinished group (finished() ≤
    /// first < finished() + G): each row joins it, and a group whose last row arrives is
    /// quantised.
    template <class D>
    void put_rows(Index first, const D& rows) {
        MEMATTN_DASSERT(first >= finished_ && first - finished_ < group);
        for (Index r = 0; r < rows.rows(); ++r) {
            const Index i = first + r - finished_;
            tail_.row(i) = rows.row(r);
            if (i == group - 1)
                quantise_group();
        }
    }
    /// Whether keep(rows) can keep the first `rows` rows (those stored): a group boundary,
    /// or a row of the unfinished group.
    [[nodiscard]] bool can_keep(Index rows) const noexcept { return rows >= finished_ || rows % group == 0; }
    /// Keeps the first `rows` rows (can_keep(rows)): the rows after them are forgotten.
    void keep(Index rows) noexcept {
        MEMATTN_DASSERT(can_keep(rows));
        finished_ = std::min(finished_, rows);
    }
    /// The first n rows of `other` (n its stored rows: its finished groups and its
    /// unfinished group's rows).
    void copy_rows_from(const StoredRows& other, Index n) {
        MEMATTN_DASSERT(n >= other.finished_ && n - other.finished_ < group);
        const Index f = other.finished_;
        codes_.topRows(f) = other.codes_.topRows(f);
        scales_.topRows(f / group) = other.scales_.topRows(f / group);
        zeros_.topRows(zero_point ? f / group : 0) = other.zeros_.topRows(zero_point ? f / group : 0);
        tail_.topRows(n - f) = other.tail_.topRows(n - f);
        finished_ = f;
    }
    void decode_rows(Index first, Index n, T* out, Index ld) const {
        for (Index r = first; r < first + n; ++r) {
            T* row = out + (r - first) * ld;
            if (r >= finished_) {
                std::copy_n(&tail_(r - finished_, 0), cols_, row);
                continue;
            }
            Index c = 0;
            if constexpr (fused_storage && std::is_same_v<T, float>) {
                for (; c + packet_lanes<float> <= cols_; c += packet_lanes<float>)
                    Eigen::internal::pstoreu(row + c, stored_packet(r, c));
            }
            for (; c < cols_; ++c)
                row[c] = static_cast<T>(stored_value(r, c));
        }
    }

    /// Asks for a row, and its group's scales, towards the cache ahead of its use.
    void prefetch_row(Index row) const {
        if (row >= finished_)
            return;
        prefetch_rows(&codes_(row, 0), 1, 0, codes_.cols());
        if (row % group == 0) {
            prefetch_rows(&scales_(row / group, 0), 1, 0, cols_);
            if constexpr (zero_point)
                prefetch_rows(&zeros_(row / group, 0), 1, 0, cols_);
        }
    }

    /// q·row in float: a finished row converted in registers packet by packet (its codes
    /// times its group's scale packet, plus the zero point packet), two accumulators; a
    /// row of the unfinished group read as it is (fused_storage, float).
    [[nodiscard]] float dot(Index row, const float* q) const {
        using namespace Eigen::internal;
        using P = Packet<float>;
        constexpr Index lanes = packet_lanes<float>;
        if (row >= finished_)
            return dot_in_order_float(q, &tail_(row - finished_, 0));
        P a = pset1<P>(0.0f), b = a;
        Index c = 0;
        for (; c + 2 * lanes <= cols_; c += 2 * lanes) {
            a = pmadd(ploadu<P>(q + c), stored_packet(row, c), a);
            b = pmadd(ploadu<P>(q + c + lanes), stored_packet(row, c + lanes), b);
        }
        for (; c + lanes <= cols_; c += lanes)
            a = pmadd(ploadu<P>(q + c), stored_packet(row, c), a);
        float sum = predux(padd(a, b));
        for (; c < cols_; ++c)
            sum += q[c] * stored_value(row, c);
        return sum;
    }

    /// q·row in float by the group's products with q (ChannelQuery, brought to the row's
    /// group first): Σ_c qs_c·u_c over the codes converted in registers, plus the group's
    /// constant; a row of the unfinished group read as it is (fused_storage, float,
    /// cols ≤ ChannelQuery::max_depth). The same value as dot(row, q) to float rounding.
    [[nodiscard]] float dot(Index row, const float* q, ChannelQuery& cq) const {
        using namespace Eigen::internal;
        using P = Packet<float>;
        constexpr Index lanes = packet_lanes<float>;
        MEMATTN_DASSERT(cols_ <= ChannelQuery::max_depth);
        if (row >= finished_)
            return dot_in_order_float(q, &tail_(row - finished_, 0));
        const Index g = row / group;
        if (cq.group != g) {
            float constant = 0;
            for (Index c = 0; c < cols_; ++c) {
                cq.qs[c] = q[c] * scales_(g, c);
                if constexpr (zero_point)
                    constant += q[c] * zeros_(g, c);
                else if constexpr (nibbles)
                    constant -= 8.0f * cq.qs[c];
            }
            cq.constant = constant;
            cq.group = g;
        }
        P a = pset1<P>(0.0f), b = a;
        Index c = 0;
        for (; c + 2 * lanes <= cols_; c += 2 * lanes) {
            a = pmadd(ploadu<P>(cq.qs + c), codes_packet(row, c), a);
            b = pmadd(ploadu<P>(cq.qs + c + lanes), codes_packet(row, c + lanes), b);
        }
        for (; c + lanes <= cols_; c += lanes)
            a = pmadd(ploadu<P>(cq.qs + c), codes_packet(row, c), a);
        float sum = predux(padd(a, b));
        for (; c < cols_; ++c) {
            if constexpr (nibbles)
                sum += cq.qs[c] * static_cast<float>(code(row, c));
            else
                sum += cq.qs[c] * to_float(codes_(row, c));
        }
        return sum + cq.constant;
    }

    /// The stored values as float, exactly as decode_rows gives them: a packet from column
    /// c (c + lanes ≤ cols, c a multiple of the lanes; fused_storage, float), and one value.
    [[nodiscard]] Packet<float> stored_packet(Index r, Index c) const {
        using namespace Eigen::internal;
        using P = Packet<float>;
        if (r >= finished_)
            return ploadu<P>(&tail_(r - finished_, c));
        const Index g = r / group;
        const P s = ploadu<P>(&scales_(g, c));
        if constexpr (!nibbles) {
            return pmul(s, load_packet(&codes_(r, c)));
        } else {
            if constexpr (!q4_packets<S>) {
                alignas(64) float v[packet_lanes<float>];
                for (Index l = 0; l < packet_lanes<float>; ++l)
                    v[l] = stored_value(r, c + l);
                return pload<P>(v);
            }
            const Index i = c % block;
            const P u = load_nibble_packet(&codes_(r, c / block * block_bytes + i % block_bytes), i >= block_bytes);
            if constexpr (zero_point)
                return pmadd(u, s, ploadu<P>(&zeros_(g, c)));
            else
                return pmul(s, psub(u, pset1<P>(8.0f)));
        }
    }
    [[nodiscard]] float stored_value(Index r, Index c) const {
        if (r >= finished_)
            return static_cast<float>(tail_(r - finished_, c));
        const Index g = r / group;
        if constexpr (!nibbles)
            return scales_(g, c) * to_float(codes_(r, c));
        else
            return q4_value<S>(static_cast<float>(code(r, c)), scales_(g, c), zero_point ? zeros_(g, c) : 0.0f);
    }

    /// Bytes of the first `rows` rows stored: their finished groups' codes and scales (and
    /// zero points), and the unfinished group's rows in T.
    [[nodiscard]] std::size_t bytes(Index rows) const noexcept { return stored_bytes(rows, cols_); }
    [[nodiscard]] static std::size_t stored_bytes(Index rows, Index cols) noexcept {
        const auto c = static_cast<std::size_t>(cols);
        const auto groups = static_cast<std::size_t>(rows / group), rest = static_cast<std::size_t>(rows % group);
        return groups * (static_cast<std::size_t>(group) * static_cast<std::size_t>(code_bytes(cols)) +
                         sizeof(float) * c * (zero_point ? 2 : 1)) +
               rest * sizeof(T) * c;
    }
    /// A finished row's bytes, its share of the group's scales rounded up (what the
    /// decode routes read per key, for their prefetch distances).
    [[nodiscard]] static std::size_t row_bytes(Index cols) noexcept {
        return static_cast<std::size_t>(code_bytes(cols)) +
               (sizeof(float) * static_cast<std::size_t>(cols) * (zero_point ? 2 : 1) + group - 1) / group;
    }
    /// The fewest bytes a stored row takes (its codes): bounds a snapshot's length.
    [[nodiscard]] static std::size_t least_row_bytes(Index cols) noexcept {
        return static_cast<std::size_t>(code_bytes(cols));
    }

    /// The first n rows (first = 0): each finished group as its scales, its zero points
    /// (Q4Affine), then its rows' codes; then the unfinished group's rows as T.
    void write_rows(snapshot::Writer& w, Index first, Index n) const {
        MEMATTN_DASSERT(first == 0 && n / group * group == finished_);
        static_cast<void>(first);
        for (Index g = 0; g < finished_ / group; ++g) {
            w.matrix(scales_.row(g));
            if constexpr (zero_point)
                w.matrix(zeros_.row(g));
            w.matrix(codes_.middleRows(g * group, group));
        }
        w.matrix(tail_.topRows(n - finished_));
    }
    void read_rows(snapshot::Reader& rd, Index first, Index n) {
        MEMATTN_DASSERT(first == 0);
        static_cast<void>(first);
        finished_ = n / group * group;
        for (Index g = 0; g < finished_ / group; ++g) {
            rd.matrix(scales_.row(g), "rows");
            if constexpr (zero_point)
                rd.matrix(zeros_.row(g), "rows");
            rd.matrix(codes_.middleRows(g * group, group), "rows");
        }
        rd.matrix(tail_.topRows(n - finished_), "rows");
    }

private:
    using Code = std::conditional_t<nibbles, std::uint8_t, std::int8_t>;

    /// The codes of finished row r from column c as float, a packet (u for Q4 and Q4Affine,
    /// the signed code for Q8; fused_storage).
    [[nodiscard]] Packet<float> codes_packet(Index r, Index c) const {
        if constexpr (nibbles) {
            const Index i = c % block;
            return load_nibble_packet(&codes_(r, c / block * block_bytes + i % block_bytes), i >= block_bytes);
        } else {
            return load_packet(&codes_(r, c));
        }
    }

    /// Bytes of a row's codes.
    static constexpr Index code_bytes(Index cols) noexcept { return nibbles ? block_bytes * q8_blocks(cols) : cols; }

    /// The 4-bit code of column c of finished row r.
    [[nodiscard]] unsigned code(Index r, Index c) const {
        const Index i = c % block;
        return (static_cast<unsigned>(codes_(r, c / block * block_bytes + i % block_bytes)) >> (i / block_bytes * 4)) &
               0x0Fu;
    }

    /// q·x over the cols values of a row of float (the unfinished group's).
    [[nodiscard]] float dot_in_order_float(const float* q, const T* x) const {
        float sum = 0;
        if constexpr (std::is_same_v<T, float>) {
            using namespace Eigen::internal;
            using P = Packet<float>;
            constexpr Index lanes = packet_lanes<float>;
            P a = pset1<P>(0.0f), b = a;
            Index c = 0;
            for (; c + 2 * lanes <= cols_; c += 2 * lanes) {
                a = pmadd(ploadu<P>(q + c), ploadu<P>(x + c), a);
                b = pmadd(ploadu<P>(q + c + lanes), ploadu<P>(x + c + lanes), b);
            }
            for (; c + lanes <= cols_; c += lanes)
                a = pmadd(ploadu<P>(q + c), ploadu<P>(x + c), a);
            sum = predux(padd(a, b));
            for (; c < cols_; ++c)
                sum += q[c] * x[c];
        }
        return sum;
    }

    /// The G rows of the unfinished group become group finished() / G: per channel, its
    /// G values rounded with one scale (and zero point).
    void quantise_group() {
        const Index g = finished_ / group;
        Code* rows = &codes_(finished_, 0);
        const Index stride = codes_.cols();
        if constexpr (nibbles)
            std::fill(rows, rows + group * stride, Code{0});
        float x[group];
        for (Index c = 0; c < cols_; ++c) {
            for (Index i = 0; i < group; ++i)
                x[i] = static_cast<float>(tail_(i, c));
            if constexpr (!nibbles) {
                scales_(g, c) = q8_quantise(x, group, rows + c, stride);
            } else {
                std::uint8_t u[group];
                const Q4Scale q = q4_quantise<S>(x, group, u, 1);
                scales_(g, c) = q.s;
                if constexpr (zero_point)
                    zeros_(g, c) = q.m;
                const Index i = c % block, byte = c / block * block_bytes + i % block_bytes;
                const int shift = static_cast<int>(i / block_bytes * 4);
                for (Index t = 0; t < group; ++t)
                    rows[t * stride + byte] |= static_cast<std::uint8_t>(u[t] << shift);
            }
        }
        finished_ += group;
    }

    Index cols_;
    Index finished_ = 0;
    Eigen::Matrix<Code, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> codes_;
    Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> scales_;
    Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> zeros_;
    Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> tail_;
};

/// Bytes of the first `rows` rows of `cols` values as Rows stores them, before any is stored.
template <class Rows>
std::size_t stored_bytes(Index rows, Index cols) noexcept {
    if constexpr (requires { Rows::stored_bytes(rows, cols); })
        return Rows::stored_bytes(rows, cols);
    else
        return Rows::row_bytes(cols) * static_cast<std::size_t>(rows);
}

/// The fewest bytes one stored row of `cols` values takes.
template <class Rows>
std::size_t least_row_bytes(Index cols) noexcept {
    if constexpr (requires { Rows::least_row_bytes(cols); })
        return Rows::least_row_bytes(cols);
    else
        return Rows::row_bytes(cols);
}

/// The rows as storage S would give them back: encoded into a scratch of their size, then
/// decoded into `out` (rows × cols, row stride ld). What a prompt's pairs become once
/// stored, for kernels that read the prompt before it is stored.
template <class T, class S, class D>
void round_trip(const D& rows, T* out, Index ld) {
    if constexpr (std::is_same_v<S, T>) {
        Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>>(out, rows.rows(), rows.cols(), Eigen::OuterStride<>(ld)) = rows;
    } else {
        StoredRows<T, S> stored(rows.rows(), rows.cols());
        round_trip(rows, stored, out, ld);
    }
}

/// The same through a caller's scratch of at least as many rows and exactly as many
/// columns (a memory's per-token path keeps one, so it allocates nothing).
template <class T, class S, class D>
void round_trip(const D& rows, StoredRows<T, S>& scratch, T* out, Index ld) {
    MEMATTN_DASSERT(scratch.rows() >= rows.rows() && scratch.cols() == rows.cols());
    scratch.put_rows(0, rows);
    scratch.decode_rows(0, rows.rows(), out, ld);
}

}  // namespace detail
}  // namespace memattn
