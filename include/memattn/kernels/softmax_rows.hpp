#pragma once
// Where the tiled softmax kernel (kernels/causal_softmax.hpp) reads its tiles of Q, K and
// V from: rows in place (PlainRows), 16-bit inputs (ConvertedRows), compact storage
// converted tile by tile (DecodedRows), a stored past before given rows (StoredThenGiven).

#include "memattn/detail/bf16_product.hpp"
#include "memattn/storage/compact.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace memattn::detail {

/// K or V read in place: a tile is rows of the matrix itself.
template <class T>
class PlainRows {
public:
    explicit PlainRows(const ConstMatrixRef<T>& m) : m_(m) {}
    [[nodiscard]] Index rows() const noexcept { return m_.rows(); }
    [[nodiscard]] Index cols() const noexcept { return m_.cols(); }
    static constexpr bool pairs = false;
    [[nodiscard]] const T* row(Index j) const noexcept { return m_.data() + j * m_.outerStride(); }
    [[nodiscard]] Index stride() const noexcept { return m_.outerStride(); }
    /// Rows [j0, j0 + n): their first coefficient and the row stride.
    [[nodiscard]] std::pair<const T*, Index> tile(Index j0, Index) const {
        return {m_.data() + j0 * m_.outerStride(), m_.outerStride()};
    }
    /// Rows [j0, j1) towards L2 while the current tile computes.
    void prefetch(Index j0, Index j1) const {
        prefetch_rows(m_.data() + j0 * m_.outerStride(), j1 - j0, m_.outerStride(), m_.cols());
    }

private:
    ConstMatrixRef<T> m_;
};

/// The value tile that the query heads walking the key tiles together share
/// (causal_softmax_heads, a layer item's heads): the first to reach a tile packs it as
/// pairs here, the others read it (PackedValueTile). One slot, the tile [first, first +
/// count): the heads take each tile in turn before the next. Emptied (clear) whenever
/// the values it was packed from may differ: another item.
struct SharedValueTile {
    std::vector<std::uint32_t> words;
    Index first = -1, count = 0;
    std::uint8_t state = 0;  // PackedValueTile's

    void clear() noexcept { first = -1, count = 0, state = 0; }
    /// The slot for tile [j0, j0 + n) of `words_needed` words (emptied if it held another).
    [[nodiscard]] PackedValueTile slot(Index j0, Index n, Index words_needed) {
        if (static_cast<Index>(words.size()) < words_needed)
            words.resize(static_cast<std::size_t>(words_needed));
        if (j0 != first || n != count)
            first = j0, count = n, state = 0;
        return {words.data(), &state};
    }
};

/// Q, K or V of bfloat16 or float16 read in place by a float kernel. With pairs (bfloat16
/// where the target has AVX512-BF16; Pairs, where a kernel chose the bfloat16 products at
/// run time: avx512_bf16_runs()) the kernel multiplies the bits themselves (bits());
/// otherwise, and for the values where a tile holds a value that is not finite, a tile is
/// converted to float into `buffer` (one tile's rows of the scratch, sized on first use:
/// the bfloat16 products may need none), exactly: every bfloat16 and float16 is a float.
template <class E, bool Pairs = bf16_dot && std::is_same_v<E, Eigen::bfloat16>>
class ConvertedRows {
public:
    static_assert(!Pairs || std::is_same_v<E, Eigen::bfloat16>, "ConvertedRows: pairs of bfloat16 only");
    static constexpr bool pairs = Pairs;
    /// `shared`: values whose packed tiles the heads walking together share (none: each
    /// kernel packs its own).
    ConvertedRows(const ConstMatrixRef<E>& m, Index tile_rows, Matrix<float>& buffer, SharedValueTile* shared = nullptr)
        : m_(m), tile_rows_(tile_rows), buffer_(buffer), shared_(shared) {}
    [[nodiscard]] Index rows() const noexcept { return m_.rows(); }
    [[nodiscard]] Index cols() const noexcept { return m_.cols(); }
    [[nodiscard]] const E* row(Index j) const noexcept { return m_.data() + j * m_.outerStride(); }
    [[nodiscard]] Index stride() const noexcept { return m_.outerStride(); }
    /// Row j's bits and the row stride (in elements): rows [j, j + n) at that stride.
    [[nodiscard]] std::pair<const std::uint16_t*, Index> bits(Index j, Index = 1) const noexcept {
        return {reinterpret_cast<const std::uint16_t*>(row(j)), m_.outerStride()};
    }
    /// Rows [j0, j0 + n) as float.
    [[nodiscard]] std::pair<const float*, Index> tile(Index j0, Index n) {
        MEMATTN_DASSERT(n <= tile_rows_);
        if (buffer_.rows() < tile_rows_ || buffer_.cols() != m_.cols())
            buffer_.resize(tile_rows_, m_.cols());
        for (Index r = 0; r < n; ++r)
            decode_span(row(j0 + r), m_.cols(), 1.0f, buffer_.data() + r * buffer_.cols());
        return {buffer_.data(), buffer_.cols()};
    }
    void prefetch(Index j0, Index j1) const { prefetch_rows(row(j0), j1 - j0, m_.outerStride(), m_.cols()); }
    /// Where value tile [j0, j0 + n) is packed as pairs for the heads walking together
    /// (Bf16TileProducts::pack_values), or none.
    [[nodiscard]] PackedValueTile packed_tile(Index j0, Index n) const {
        if (shared_ == nullptr)
            return {};
        return shared_->slot(j0, n, packed_value_words(tile_rows_, m_.cols()));
    }

private:
    ConstMatrixRef<E> m_;
    Index tile_rows_;
    Matrix<float>& buffer_;
    SharedValueTile* shared_;
};

/// K or V in compact storage (storage/compact.hpp): each tile is converted to T into a
/// buffer of one tile's rows when the kernel reaches it, so the kernel never holds more
/// than a tile of T, whatever the length.
template <class T, class S>
class DecodedRows {
public:
    DecodedRows(const StoredRows<T, S>& stored, Index rows, Index tile_rows)
        : stored_(stored), rows_(rows), buffer_(tile_rows, stored.cols()) {}
    static constexpr bool pairs = false;
    [[nodiscard]] Index rows() const noexcept { return rows_; }
    [[nodiscard]] Index cols() const noexcept { return stored_.cols(); }
    [[nodiscard]] std::pair<const T*, Index> tile(Index j0, Index n) {
        MEMATTN_DASSERT(n <= buffer_.rows());
        stored_.decode_rows(j0, n, buffer_.data(), buffer_.cols());
        return {buffer_.data(), buffer_.cols()};
    }
    void prefetch(Index, Index) const {}

private:
    const StoredRows<T, S>& stored_;
    Index rows_;
    Matrix<T> buffer_;
};

/// Keys of a prefill that reads its own keys as given after the first `kept` rows kept in
/// storage S (`PerChannelKeys<S>`: the past as stored, the prompt's keys exact): a tile
/// below `kept` is converted into a buffer of one tile, a tile of given rows is read in
/// place, a tile across the two is put together in the buffer.
template <class T, class S>
class StoredThenGiven {
public:
    StoredThenGiven(const StoredRows<T, S>& stored, Index kept, const ConstMatrixRef<T>& given, Index tile_rows)
        : stored_(stored), kept_(kept), given_(given), buffer_(tile_rows, stored.cols()) {}
    static constexpr bool pairs = false;
    [[nodiscard]] Index rows() const noexcept { return kept_ + given_.rows(); }
    [[nodiscard]] Index cols() const noexcept { return stored_.cols(); }
    [[nodiscard]] std::pair<const T*, Index> tile(Index j0, Index n) {
        if (j0 >= kept_)
            return {given_.data() + (j0 - kept_) * given_.outerStride(), given_.outerStride()};
        MEMATTN_DASSERT(n <= buffer_.rows());
        const Index old = std::min(n, kept_ - j0);
        stored_.decode_rows(j0, old, buffer_.data(), buffer_.cols());
        if (old < n)
            buffer_.middleRows(old, n - old) = given_.topRows(n - old);
        return {buffer_.data(), buffer_.cols()};
    }
    void prefetch(Index, Index) const {}

private:
    const StoredRows<T, S>& stored_;
    Index kept_;
    ConstMatrixRef<T> given_;
    Matrix<T> buffer_;
};

}  // namespace memattn::detail
