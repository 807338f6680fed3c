#pragma once
// FP8 rows: one byte per value in the OCP 8-bit floating-point format E4M3 ("E4M3FN":
// 1 sign bit, 4 exponent bits of bias 7, 3 mantissa bits; no infinity, one NaN pattern
// per sign, S.1111.111), the FP8 K/V cache of vLLM and TensorRT-LLM without their scale
// (kv_cache_dtype fp8_e4m3 with k_scale = v_scale = 1). A value x is stored as the E4M3
// number nearest to it, ties to the even mantissa: normal numbers 2^(e−7)·(1 + m/8) for
// e = 1 … 15 (largest 448 = 2^8·1.75), subnormal ones m·2^−9, so it keeps 3 bits of
// mantissa (a relative error of at most 2^−4) over [2^−6, 448] and absolute steps of 2^−9
// below. A finite value of magnitude 464 or more (past the midpoint between 448 and 480,
// where the format has its NaN) is refused by check_storable; ±∞ and NaN are stored as
// NaN (the format has no infinity), and poison the attends that see them.
//
// The whole format is this file: the tag, what the format declares of itself
// (StorageFormat: its name, its snapshot type code, its overflow), and its rows
// (StoredRows<T, Fp8E4M3>); storage/compact.hpp includes it and lists it among the
// formats. A value is decoded by a 256-entry table: in registers by a gather where the
// instruction set has one (AVX2, AVX-512), so the attends read rows of FP8 as they read
// rows of bfloat16, converted in registers.

#include "memattn/storage/formats.hpp"
#include "memattn/storage/simd.hpp"
#include "memattn/storage/stored_rows.hpp"

#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace memattn {

/// FP8 K/V storage: one byte per value, the OCP E4M3 format (see the top of
/// storage/fp8.hpp).
struct Fp8E4M3 {};

namespace detail {

/// FP8 E4M3's values, by their byte: (−1)^s · 2^(e−7) · (1 + m/8), subnormal m · 2^−9,
/// NaN for S.1111.111.
inline constexpr std::array<float, 256> fp8_e4m3_values = [] {
    std::array<float, 256> values{};
    for (int byte = 0; byte < 256; ++byte) {
        const int e = (byte >> 3) & 0xF, m = byte & 0x7;
        float magnitude = 0;
        if (e == 15 && m == 7) {
            magnitude = std::numeric_limits<float>::quiet_NaN();
        } else if (e == 0) {
            magnitude = static_cast<float>(m) / 512.0f;  // m · 2^−9, exact
        } else {
            magnitude = 1.0f + static_cast<float>(m) / 8.0f;
            for (int k = e; k < 7; ++k)  // times 2^(e − 7), exactly: powers of two
                magnitude /= 2.0f;
            for (int k = 7; k < e; ++k)
                magnitude *= 2.0f;
        }
        values[static_cast<std::size_t>(byte)] = (byte & 0x80) != 0 ? -magnitude : magnitude;
    }
    return values;
}();

/// The E4M3 byte of x: the nearest value, ties to the even mantissa; NaN (S.1111.111)
/// for ±∞, NaN and magnitudes of 464 and more.
inline std::uint8_t fp8_e4m3_encode(float x) noexcept {
    const auto sign = static_cast<std::uint8_t>((std::bit_cast<std::uint32_t>(x) >> 24) & 0x80);
    const float a = std::abs(x);
    if (!(a < 464.0f))
        return static_cast<std::uint8_t>(sign | 0x7F);
    if (a < 0x1p-6f)  // subnormal or zero: m · 2^−9, m = 0 … 8 (8: the smallest normal, 2^−6)
        return static_cast<std::uint8_t>(sign | static_cast<int>(std::nearbyint(a * 0x1p9f)));
    int e = 0;
    static_cast<void>(std::frexp(a, &e));  // a ∈ [2^(e−1), 2^e)
    int exponent = e - 1;
    int q = static_cast<int>(std::nearbyint(std::ldexp(a, 3 - exponent)));  // 8 … 16, exact scaling
    if (q == 16) {
        q = 8;
        ++exponent;
    }
    return static_cast<std::uint8_t>(sign | ((exponent + 7) << 3) | (q - 8));
}

/// FP8 E4M3 as a compact storage format.
template <>
struct StorageFormat<Fp8E4M3> {
    static constexpr bool compact = true;                                 ///< a compact format
    static constexpr const char* name = "Fp8E4M3";                        ///< its name in messages
    static constexpr snapshot::TypeCode code = snapshot::TypeCode{14};    ///< its snapshot type code
    static constexpr bool scaled = false;                                 ///< no float scales
    static constexpr float overflow = 464.0f;  ///< 448 + half a step (32): finite values from here are refused
    static constexpr const char* overflow_to = "NaN";  ///< what it would hold them as (it has no infinity)
};

/// A packet of floats from `packet_lanes<float>` bytes of FP8, decoded by the table.
inline Packet<float> fp8_packet(const std::uint8_t* p) {
#if defined(__AVX512F__)
    return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                               fp8_e4m3_values.data(), 4);
#elif defined(__AVX2__)
    return _mm256_i32gather_ps(fp8_e4m3_values.data(),
                               _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 4);
#else
    alignas(64) float lanes[packet_lanes<float>];
    for (Index i = 0; i < packet_lanes<float>; ++i)
        lanes[i] = fp8_e4m3_values[p[i]];
    return Eigen::internal::pload<Packet<float>>(lanes);
#endif
}

/// fp8_packet as a callable: the loader dot_span and add_span take for FP8 rows.
struct Fp8Packets {
    Packet<float> operator()(const std::uint8_t* p) const { return fp8_packet(p); }
};

/// FP8 E4M3 rows: one byte per value, row-major.
template <class T>
class StoredRows<T, Fp8E4M3> {
public:
    static constexpr bool compact = true;
    StoredRows(Index rows, Index cols) : m_(rows, cols), cols_(cols) {}  // Eigen checks rows × cols

    [[nodiscard]] Index rows() const noexcept { return m_.rows(); }
    [[nodiscard]] Index cols() const noexcept { return cols_; }
    void swap(StoredRows& other) noexcept {
        m_.swap(other.m_);
        std::swap(cols_, other.cols_);
    }

    /// Rows [first, first + rows) = the rows, each value rounded to E4M3 (double through
    /// float: one rounding to E4M3's precision, as float's would be).
    template <class D>
    void put_rows(Index first, const D& rows) {
        for (Index r = 0; r < rows.rows(); ++r) {
            std::uint8_t* out = at(first + r, 0);
            for (Index c = 0; c < cols_; ++c)
                out[c] = fp8_e4m3_encode(static_cast<float>(rows(r, c)));
        }
    }
    void copy_rows_from(const StoredRows& other, Index n) {
        if (n > 0 && cols_ > 0)
            std::memcpy(at(0, 0), other.at(0, 0), row_bytes(cols_) * static_cast<std::size_t>(n));
    }
    /// Rows [to, to + n) = rows [from, from + n), the two ranges apart.
    void copy_within(Index from, Index to, Index n) {
        if (n > 0 && cols_ > 0)
            std::memcpy(at(to, 0), at(from, 0), row_bytes(cols_) * static_cast<std::size_t>(n));
    }
    void decode_rows(Index first, Index n, T* out, Index ld) const {
        for (Index r = 0; r < n; ++r) {
            const std::uint8_t* x = at(first + r, 0);
            for (Index c = 0; c < cols_; ++c)
                out[r * ld + c] = static_cast<T>(fp8_e4m3_values[x[c]]);
        }
    }

    /// Asks for a row towards the cache ahead of its use.
    void prefetch_row(Index row) const { prefetch_rows(at(row, 0), 1, 0, cols_); }

    /// q·row in float, converted in registers (dot_span with the table's gather).
    [[nodiscard]] float dot(Index row, const float* q) const {
        const std::uint8_t* x = at(row, 0);
        const Index packed = cols_ / packet_lanes<float> * packet_lanes<float>;
        float sum = Eigen::internal::predux(
            dot_span(q, x, packed, Eigen::internal::pset1<Packet<float>>(0.0f), Fp8Packets{}));
        for (Index c = packed; c < cols_; ++c)
            sum += q[c] * fp8_e4m3_values[x[c]];
        return sum;
    }
    /// acc += w · row in float, converted in registers (add_span with the table's gather).
    void add_scaled(Index row, float w, float* acc) const {
        const std::uint8_t* x = at(row, 0);
        for (Index c = add_span(w, x, cols_, acc, Fp8Packets{}); c < cols_; ++c)
            acc[c] += w * fp8_e4m3_values[x[c]];
    }
    /// add_scaled for rows [first, first + n) with weights w, acc in registers
    /// (add_rows_in_registers; fused_storage).
    void add_rows(Index first, Index n, const float* w, float* acc, Index ahead, Index prefetch_end) const {
        add_rows_in_registers(*this, first, n, w, acc, ahead, prefetch_end);
    }
    [[nodiscard]] Packet<float> packet(Index r, Index c) const { return fp8_packet(at(r, c)); }
    [[nodiscard]] float scalar(Index r, Index c) const { return fp8_e4m3_values[*at(r, c)]; }
    [[nodiscard]] static float weight(Index, Index, float w) { return w; }
    /// The stored values as float, exactly as decode_rows gives them: a packet from
    /// column c (c + lanes ≤ cols; fused_storage), and one value.
    [[nodiscard]] Packet<float> stored_packet(Index r, Index c) const { return fp8_packet(at(r, c)); }
    [[nodiscard]] float stored_value(Index r, Index c) const { return fp8_e4m3_values[*at(r, c)]; }

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
    }

private:
    [[nodiscard]] std::uint8_t* at(Index r, Index c) noexcept { return m_.data() + r * cols_ + c; }
    [[nodiscard]] const std::uint8_t* at(Index r, Index c) const noexcept { return m_.data() + r * cols_ + c; }

    Eigen::Matrix<std::uint8_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> m_;  ///< the bytes, row-major
    Index cols_;
};

}  // namespace detail
}  // namespace memattn
