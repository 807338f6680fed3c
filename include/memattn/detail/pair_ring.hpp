#pragma once
// PairRing: a fixed number of (key, value) rows addressed by a running item number.
// Item j lives in row j % capacity, so the newest `capacity` items of a stream are
// always held and the oldest one is overwritten in place: no copy, no allocation
// after construction. The sliding-window cache (its window and its sinks), the hybrid
// cache (local window and compressed slots) and the moving average share it.
//
// Layout: keys_ (capacity × d) and values_ (capacity × dv), row-major, so the items
// [first, last) are at most two contiguous runs of rows, which is what
// detail::attend_contiguous and Eigen's GEMV want.

#include "memattn/detail/assert.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/softmax_state.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cstddef>

namespace memattn::detail {

template <class T>
class PairRing {
public:
    PairRing(Index capacity, Index key_dim, Index value_dim) : keys_(capacity, key_dim), values_(capacity, value_dim) {}

    [[nodiscard]] Index capacity() const noexcept { return keys_.rows(); }

    /// The row that holds item j.
    [[nodiscard]] Index row_of(Index j) const noexcept {
        MEMATTN_DASSERT(j >= 0 && capacity() > 0);
        return j % capacity();
    }

    auto key(Index j) { return keys_.row(row_of(j)); }
    auto value(Index j) { return values_.row(row_of(j)); }
    [[nodiscard]] auto key(Index j) const { return keys_.row(row_of(j)); }
    [[nodiscard]] auto value(Index j) const { return values_.row(row_of(j)); }

    /// Stores item j (overwriting item j − capacity).
    template <class K, class V>
    void put(Index j, const K& key_row, const V& value_row) {
        const Index r = row_of(j);
        keys_.row(r) = key_row;
        values_.row(r) = value_row;
    }

    /// Stores items first, first+1, ... from the rows of K and V (at most `capacity`
    /// of them), with one block copy per contiguous run.
    template <class K, class V>
    void put_rows(Index first, const K& keys, const V& values) {
        MEMATTN_DASSERT(keys.rows() == values.rows() && keys.rows() <= capacity());
        for_each_run(first, first + keys.rows(), [&](Index row, Index offset, Index n) {
            keys_.middleRows(row, n) = keys.middleRows(offset, n);
            values_.middleRows(row, n) = values.middleRows(offset, n);
        });
    }

    /// Calls f(row, offset, n) for each contiguous run of the items [first, last):
    /// rows [row, row + n) hold items first + offset .. first + offset + n − 1.
    template <class F>
    void for_each_run(Index first, Index last, F&& f) const {
        MEMATTN_DASSERT(first <= last && last - first <= capacity());
        Index offset = 0;
        while (first + offset < last) {
            const Index row = row_of(first + offset);
            const Index n = std::min(last - first - offset, capacity() - row);
            f(row, offset, n);
            offset += n;
        }
    }

    /// Folds the items [first, last) into one query's softmax state and accumulator.
    template <class Q, class Acc>
    void attend(const Q& query, Index first, Index last, T scale, SoftmaxState<T>& state, Acc&& acc) const {
        for_each_run(first, last, [&](Index row, Index, Index n) {
            attend_contiguous(query, keys_.middleRows(row, n), values_.middleRows(row, n), scale, state, acc);
        });
    }

    /// Calls f(keys, values) with the rows of each contiguous run of the items [first, last), oldest first.
    template <class F>
    void for_each_block(Index first, Index last, F&& f) const {
        for_each_run(first, last, [&](Index row, Index, Index n) {
            f(keys_.middleRows(row, n), values_.middleRows(row, n));
        });
    }

    /// Copies the items [first, last), oldest first, into the leading rows of K and V.
    template <class K, class V>
    void copy_out(Index first, Index last, K&& keys, V&& values) const {
        for_each_run(first, last, [&](Index row, Index offset, Index n) {
            keys.middleRows(offset, n) = keys_.middleRows(row, n);
            values.middleRows(offset, n) = values_.middleRows(row, n);
        });
    }

    /// Snapshots: the keys of the items [first, last), oldest first, then their values.
    void write_items(snapshot::Writer& w, Index first, Index last) const {
        for_each_run(first, last, [&](Index row, Index, Index n) { w.matrix(keys_.middleRows(row, n)); });
        for_each_run(first, last, [&](Index row, Index, Index n) { w.matrix(values_.middleRows(row, n)); });
    }
    /// Reads what write_items wrote into the rows of the items [first, last); the caller
    /// has checked that the reader holds them (Reader::expect_remaining), so nothing throws.
    void read_items(snapshot::Reader& r, Index first, Index last) {
        for_each_run(first, last, [&](Index row, Index, Index n) { r.matrix(keys_.middleRows(row, n), "keys"); });
        for_each_run(first, last, [&](Index row, Index, Index n) { r.matrix(values_.middleRows(row, n), "values"); });
    }
    [[nodiscard]] const Matrix<T>& keys() const noexcept { return keys_; }
    [[nodiscard]] const Matrix<T>& values() const noexcept { return values_; }

    /// Bytes of `items` pairs.
    [[nodiscard]] std::size_t bytes(Index items) const noexcept {
        return static_cast<std::size_t>(items) * static_cast<std::size_t>(keys_.cols() + values_.cols()) * sizeof(T);
    }

private:
    Matrix<T> keys_;
    Matrix<T> values_;
};

}  // namespace memattn::detail
