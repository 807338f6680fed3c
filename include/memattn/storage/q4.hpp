#pragma once
// Q4 and Q4Affine rows: 4-bit codes in blocks of 32 values of a row, one float scale
// per block and, for Q4Affine, one float zero point (llama.cpp's q4_0 and q4_1).

#include "memattn/storage/integer_dot.hpp"
#include "memattn/storage/simd.hpp"
#include "memattn/storage/stored_rows.hpp"

namespace memattn::detail {

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
    /// StoredRows<T, T>::advise_huge_pages, over each of the format's buffers.
    void advise_huge_pages() const noexcept {
        advise_huge_pages_of(u_);
        advise_huge_pages_of(scales_);
        advise_huge_pages_of(zeros_);
    }

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

}  // namespace memattn::detail
