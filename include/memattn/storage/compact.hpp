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
//   memattn::IntegerDot<S>  stored as S; a query's q·k taken in integers on the
//                    query rounded to int8 per block (StoredRows::integer_dot).
//   memattn::PerChannelKeys<S>  keys quantised as S per channel over groups of 32
//                    tokens (the newest, unfinished group exact), values as S (KIVI).
//   memattn::Fp8E4M3  one byte a value, OCP FP8 E4M3 (storage/fp8.hpp): 3 mantissa
//                    bits (relative rounding 2^-4) over [2^-6, 448], steps of 2^-9
//                    below; finite values from 464 on are refused.
//   memattn::Fp8E5M2  one byte a value, OCP FP8 E5M2 (storage/fp8.hpp): 2 mantissa
//                    bits (relative rounding 2^-3) over [2^-14, 57344], steps of 2^-16
//                    below; finite values from 61440 on are refused.
//   memattn::PerTokenScale<S>  S = Fp8E4M3 or Fp8E5M2 with one float scale per
//                    stored row, max|x| / S's largest: float's range, S's precision
//                    relative to the row's largest magnitude (storage/fp8.hpp).
//
// One policy for every type (check_storable): a finite value that S would store as ±∞
// or NaN (float16 from 65520 on, bfloat16 from ~3.3962e38, a double past float's range)
// throws std::invalid_argument and the cache is unchanged; ±∞ and NaN themselves are
// stored as they are and poison the outputs that see them, as in T.
//
// The attention that reads stored rows lives in kernels/decode_attention.hpp (one query
// or a group, in registers where the instruction set converts) and in the causal softmax
// kernel (a tile at a time); storage/ only stores, converts and describes them, one
// header per format family over two every format shares:
//
//   formats.hpp           the tag types, their traits, names and snapshot codes, and
//                         check_storable (a new format: its tag and a line in each list)
//   stored_rows.hpp       StoredRows<T, S>, the interface of every format's rows, and S = T
//   simd.hpp              stored values to packets of float in registers
//   rows_16bit.hpp        bfloat16 and half
//   q8.hpp, q4.hpp        Q8; Q4 and Q4Affine
//   rotated.hpp           Rotated<S> (the Walsh–Hadamard transform)
//   integer_dot.hpp       IntegerDot<S> (the int8 query, the integer block products)
//   per_channel_keys.hpp  PerChannelKeys<S>
//
// This header includes them all, and the helpers over any S (stored_bytes, round_trip).

// The formats: a new one is a header of its own (storage/formats.hpp, at the top), its
// line here and its tag in stated_formats below.
#include "memattn/storage/formats.hpp"
#include "memattn/storage/fp8.hpp"
#include "memattn/storage/integer_dot.hpp"
#include "memattn/storage/per_channel_keys.hpp"
#include "memattn/storage/q4.hpp"
#include "memattn/storage/q8.hpp"
#include "memattn/storage/rotated.hpp"
#include "memattn/storage/rows_16bit.hpp"
#include "memattn/storage/simd.hpp"
#include "memattn/storage/stored_rows.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>

namespace memattn::detail {

/// The formats of headers of their own (StorageFormat), by their snapshot type codes:
/// a new one adds its tag here.
template <class... S>
struct StatedFormats {
    /// The snapshot type name of `code` among them (nullptr: none of them has it).
    static constexpr const char* code_name(std::uint8_t code) noexcept {
        constexpr std::array<std::pair<std::uint8_t, const char*>, sizeof...(S)> names{
            {{static_cast<std::uint8_t>(StorageFormat<S>::code), StorageFormat<S>::code_name}...}};
        for (const auto& [stated, name] : names)
            if (stated == code)
                return name;
        return nullptr;
    }
};
using stated_formats = StatedFormats<Fp8E4M3, Fp8E5M2, PerTokenScale<Fp8E4M3>, PerTokenScale<Fp8E5M2>>;

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

}  // namespace memattn::detail
