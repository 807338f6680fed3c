#pragma once
// StoredRows<T, S>: rows × cols values of T stored as S, the one interface every format's
// rows offer (put_rows, decode_rows, bytes, raw copies, snapshots), and S = T, the values
// themselves. Each compact format specializes it in a header of its own.

#include "memattn/detail/huge_pages.hpp"
#include "memattn/storage/formats.hpp"

#include <concepts>

namespace memattn::detail {

/// Rows with a numbers route (FP8 E4M3 where fp8_numbers_route, storage/fp8.hpp): while
/// they hold no NaN (numbers_only), number_packet, number_dot and add_number_rows read
/// their values divided by number_factor, a power of two, more cheaply than the exact
/// readers, for a reader that multiplies the other operand of each product by it.
template <class Rows>
concept number_rows = requires(const Rows& rows, const float* q, float* acc) {
    { rows.numbers_only() } -> std::same_as<bool>;
    rows.number_packet(Index(0), Index(0));
    { rows.number_dot(Index(0), q) } -> std::same_as<float>;
    rows.add_number_rows(Index(0), Index(0), q, acc, Index(0), Index(0));
    { Rows::number_factor } -> std::convertible_to<float>;
};

/// A logit tile's requests in a grouped decode (kernels/group_attention.hpp, and the
/// grouped integer logits of Q8 keys): the key rows `ahead` rows past [r0, r1) (below
/// `end`), and the value rows [r0, r1) towards L2, where the value tiles read them next;
/// none when `ahead` is 0. Keys and Values: rows with prefetch_row (StoredRows).
template <class Keys, class Values>
void prefetch_tile(const Keys& keys, const Values& values, Index r0, Index r1, Index ahead, Index end) {
    if (ahead <= 0)
        return;
    for (Index r = r0; r < r1; ++r) {
        if (r + ahead < end)
            keys.prefetch_row(r + ahead);
        values.prefetch_row(r);
    }
}

/// Rows × cols values of T stored as S: a plain row-major matrix when S is T, else the
/// encoded rows. Both sides have one interface: put_rows (encode), decode_rows (into a
/// buffer of T), bytes, raw copies for growth, the snapshot payload, and
/// advise_huge_pages.
template <class T, class S>
class StoredRows;

/// S = T: the values themselves, readable in place.
template <class T>
class StoredRows<T, T> {
public:
    static constexpr bool compact = false;
    StoredRows(Index rows, Index cols) : m_(rows, cols) {}
    /// Asks for transparent huge pages under the stored rows (detail/huge_pages.hpp): for
    /// a store every decode step reads end to end (a pool's when it is built, a cache's as
    /// it grows), before its rows are first written.
    void advise_huge_pages() const noexcept { advise_huge_pages_of(m_); }

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

}  // namespace memattn::detail
