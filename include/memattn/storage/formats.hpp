#pragma once
// The storage formats a cache may keep its keys and values in (storage/compact.hpp
// describes each): their tag types, the traits and names the caches and snapshots read,
// and the one policy every format checks a value against (check_storable).
//
// A new format is one header of its own and a line in storage/compact.hpp's list: the
// header declares its tag, specializes detail::StorageFormat for it (its name, snapshot
// type code, whether it keeps float scales, its overflow) and detail::StoredRows (its
// rows); the traits below read StorageFormat. storage/fp8.hpp is one such. The formats
// of the first releases are declared here, in the chains below, as they were.

#include "memattn/detail/assert.hpp"
#include "memattn/detail/packet.hpp"
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
/// grouped attend (a GQA group's queries, each rounded as alone, with or without the logit
/// options) takes the same integer logits, bit for bit, for S = Q8 and Rotated<Q8> on
/// every build (sixteen keys per vpdpbusd where the build targets AVX-512 VNNI, eight per
/// vpmaddubsw with AVX2); for the
/// 4-bit S, and in prefill, the keys are read in float as S does. For
/// KVCache and SlidingWindowCache of float (and of 16-bit rows, which compute in float).
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

/// What a storage format declared in a header of its own says of itself, by
/// specializing this for its tag (storage/fp8.hpp):
///
///     static constexpr bool compact = true;
///     static constexpr const char* name = "...";          // in messages
///     static constexpr snapshot::TypeCode code = ...;     // in snapshots (docs/snapshot-format.md)
///     static constexpr const char* code_name = "...";     // that code's name (snapshot::type_name)
///     static constexpr bool scaled = ...;                 // keeps float scales: float's whole range
///     static constexpr float overflow = ...;              // unscaled: the smallest magnitude refused
///     static constexpr const char* overflow_to = "...";   // unscaled: what it would hold it as
///
/// The primary template is no format.
template <class S>
struct StorageFormat {
    static constexpr bool compact = false;  ///< not a format of its own header
};

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
                                        per_channel_keys<S> || StorageFormat<S>::compact;
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

/// The name a format of its own header gives itself (none for any other type).
template <class S>
inline constexpr const char* stated_name = nullptr;
template <class S>
    requires(StorageFormat<S>::compact)
inline constexpr const char* stated_name<S> = StorageFormat<S>::name;

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
                                            : std::is_same_v<S, double>            ? "double"
                                                                                   : stated_name<S>;

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
    else if constexpr (StorageFormat<S>::compact)
        return StorageFormat<S>::code;
    else
        return snapshot::type_code<T>();
}

/// Q8 blocks in a row of `cols` values.
constexpr Index q8_blocks(Index cols) { return (cols + Q8::block - 1) / Q8::block; }

/// A format of its own header that says it keeps float scales.
template <class S>
inline constexpr bool stated_scaled = false;
template <class S>
    requires(StorageFormat<S>::compact)
inline constexpr bool stated_scaled<S> = StorageFormat<S>::scaled;

/// Whether S keeps float scales per block (Q8, Q4, Q4Affine): it holds float's whole
/// range, and only a double past it is lost.
template <class S>
inline constexpr bool scaled_storage = std::is_same_v<S, Q8> || Q4Storage<S> || RotatedStorage<S> ||
                                       IntegerDotStorage<S> || per_channel_keys<S> || stated_scaled<S>;



/// The smallest magnitude of float that storage S rounds to ±∞ (to nearest, ties to
/// even, as Eigen's scalar and vector conversions do): the midpoint between S's largest
/// finite value and the next power of two. Q8 stores a block as float scales, so only
/// a value past float's own range is lost; for T = S = float nothing is.
template <class S>
inline constexpr float storage_overflow = std::numeric_limits<float>::infinity();
template <class S>
    requires(StorageFormat<S>::compact && !StorageFormat<S>::scaled)
inline constexpr float storage_overflow<S> = StorageFormat<S>::overflow;
/// What an unscaled S would hold a value past storage_overflow<S> as, in messages.
template <class S>
inline constexpr const char* overflow_name = "infinity";
template <class S>
    requires(StorageFormat<S>::compact && !StorageFormat<S>::scaled)
inline constexpr const char* overflow_name<S> = StorageFormat<S>::overflow_to;
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
        if constexpr (std::is_same_v<T, float> && bool(D::IsRowMajor) && requires { rows.data(), rows.outerStride(); }) {
            // On the bits, so that it vectorizes (the scalar test was 8% of a prompt into a
            // pool of bfloat16 rows): a finite |x| ≥ limit is a magnitude's bits in
            // [bits(limit), bits(∞)); NaN's and ∞'s are not below bits(∞).
            const auto from = std::bit_cast<std::uint32_t>(limit);
            constexpr std::uint32_t infinity = 0x7F800000u;
            std::uint32_t any = 0;
            for (Index r = 0; r < rows.rows(); ++r) {
                const float* row = rows.data() + r * rows.outerStride();
                for (Index c = 0; c < rows.cols(); ++c) {
                    const std::uint32_t magnitude = std::bit_cast<std::uint32_t>(row[c]) & 0x7FFFFFFFu;
                    any |= static_cast<std::uint32_t>(magnitude >= from) & static_cast<std::uint32_t>(magnitude < infinity);
                }
            }
            lost = any != 0;
        } else {
            for (Index r = 0; r < rows.rows(); ++r)
                for (Index c = 0; c < rows.cols(); ++c) {
                    const T x = rows(r, c);
                    lost |= std::isfinite(x) && !(std::abs(static_cast<float>(x)) < limit);
                }
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
                            overflow_name<S>, " (finite magnitudes below ", limit, " are kept, rounded)");
            }
    }
}

}  // namespace detail
}  // namespace memattn
