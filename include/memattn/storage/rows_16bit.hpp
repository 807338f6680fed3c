#pragma once
// bfloat16 and half rows: one 2-byte element per value, converted by Eigen's casts and,
// in registers, by storage/simd.hpp.

#include "memattn/storage/simd.hpp"
#include "memattn/storage/stored_rows.hpp"

namespace memattn::detail {

/// bfloat16 or half: one 2-byte element per value; Eigen's vectorised casts convert.
template <class T, class S>
    requires std::same_as<S, Eigen::bfloat16> || std::same_as<S, Eigen::half>
class StoredRows<T, S> {
public:
    static constexpr bool compact = true;
    StoredRows(Index rows, Index cols) : m_(rows, cols) {}
    /// StoredRows<T, T>::advise_huge_pages, over each of the format's buffers.
    void advise_huge_pages() const noexcept { advise_huge_pages_of(m_); }

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

    /// Row r as stored: cols() elements, the next row's right after them.
    [[nodiscard]] const S* stored_row(Index r) const noexcept { return &m_(r, 0); }

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

}  // namespace memattn::detail
