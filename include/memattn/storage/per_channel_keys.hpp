#pragma once
// PerChannelKeys<S>: keys quantised as S per channel over groups of tokens (KIVI), the
// unfinished group exact.

#include "memattn/storage/q4.hpp"
#include "memattn/storage/q8.hpp"
#include "memattn/storage/stored_rows.hpp"

namespace memattn::detail {

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
    /// StoredRows<T, T>::advise_huge_pages, over each of the format's buffers.
    void advise_huge_pages() const noexcept {
        advise_huge_pages_of(codes_);
        advise_huge_pages_of(scales_);
        advise_huge_pages_of(zeros_);
    }

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

}  // namespace memattn::detail
