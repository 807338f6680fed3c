#pragma once
// PairRing: a fixed number of (key, value) rows addressed by a running item number.
// Item j lives in row j % capacity, so the newest `capacity` items of a stream are
// always held and the oldest one is overwritten in place: no copy, no allocation
// after construction. The sliding-window cache (its window and its sinks), the hybrid
// cache (local window and compressed slots) and the moving average share it.
//
// Layout: keys_ (capacity × d) and values_ (capacity × dv), row-major, so the items
// [first, last) are at most two contiguous runs of rows, which is what
// detail::attend_contiguous, detail::attend_stored and the grouped attend
// (kernels/decode_attention.hpp) want.

#include "memattn/detail/assert.hpp"
#include "memattn/kernels/decode_attention.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/softmax_state.hpp"
#include "memattn/storage/compact.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cstddef>

namespace memattn::detail {

/// S: how the pairs are stored (storage/compact.hpp), T itself by default.
template <class T, class S = T>
class PairRing {
    using Rows = StoredRows<T, S>;

public:
    PairRing(Index capacity, Index key_dim, Index value_dim) : keys_(capacity, key_dim), values_(capacity, value_dim) {}

    [[nodiscard]] Index capacity() const noexcept { return keys_.rows(); }

    /// The row that holds item j.
    [[nodiscard]] Index row_of(Index j) const noexcept {
        MEMATTN_DASSERT(j >= 0 && capacity() > 0);
        return j % capacity();
    }

    auto key(Index j)
        requires std::same_as<S, T>
    {
        return keys_.row(row_of(j));
    }
    auto value(Index j)
        requires std::same_as<S, T>
    {
        return values_.row(row_of(j));
    }
    [[nodiscard]] auto key(Index j) const
        requires std::same_as<S, T>
    {
        return keys_.row(row_of(j));
    }
    [[nodiscard]] auto value(Index j) const
        requires std::same_as<S, T>
    {
        return values_.row(row_of(j));
    }

    /// Item j's key and value as T, into `key` and `value` (1 × d and 1 × dv, contiguous).
    void decode(Index j, T* key, T* value) const {
        keys_.decode_rows(row_of(j), 1, key, keys_.cols());
        values_.decode_rows(row_of(j), 1, value, values_.cols());
    }

    /// Stores item j (overwriting item j − capacity).
    template <class K, class V>
    void put(Index j, const K& key_row, const V& value_row) {
        const Index r = row_of(j);
        keys_.put_rows(r, key_row);
        values_.put_rows(r, value_row);
    }

    /// Stores items first, first+1, ... from the rows of K and V (at most `capacity`
    /// of them), with one block copy per contiguous run.
    template <class K, class V>
    void put_rows(Index first, const K& keys, const V& values) {
        MEMATTN_DASSERT(keys.rows() == values.rows() && keys.rows() <= capacity());
        for_each_run(first, first + keys.rows(), [&](Index row, Index offset, Index n) {
            keys_.put_rows(row, keys.middleRows(offset, n));
            values_.put_rows(row, values.middleRows(offset, n));
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
            if constexpr (Rows::compact)
                attend_stored(query, keys_, values_, row, n, scale, state, acc);
            else
                attend_contiguous(query, keys_.block(row, n), values_.block(row, n), scale, state, acc);
        });
    }

    /// Calls f(keys, values, row, n) for each contiguous run of the items [first, last),
    /// oldest first: rows [row, row + n) of the stored keys and values, in any storage.
    template <class F>
    void for_each_stored(Index first, Index last, F&& f) const {
        for_each_run(first, last, [&](Index row, Index, Index n) { f(keys_, values_, row, n); });
    }

    /// Calls f(keys, values) with the rows of each contiguous run of the items [first, last), oldest first.
    template <class F>
        requires std::same_as<S, T>
    void for_each_block(Index first, Index last, F&& f) const {
        for_each_run(first, last, [&](Index row, Index, Index n) { f(keys_.block(row, n), values_.block(row, n)); });
    }

    /// Copies the items [first, last), oldest first, into the leading rows of K and V.
    template <class K, class V>
    void copy_out(Index first, Index last, K&& keys, V&& values) const {
        for_each_run(first, last, [&](Index row, Index offset, Index n) {
            keys_.decode_rows(row, n, keys.data() + offset * keys.outerStride(), keys.outerStride());
            values_.decode_rows(row, n, values.data() + offset * values.outerStride(), values.outerStride());
        });
    }

    /// Snapshots: the keys of the items [first, last), oldest first, then their values.
    void write_items(snapshot::Writer& w, Index first, Index last) const {
        for_each_run(first, last, [&](Index row, Index, Index n) { keys_.write_rows(w, row, n); });
        for_each_run(first, last, [&](Index row, Index, Index n) { values_.write_rows(w, row, n); });
    }
    /// Reads what write_items wrote into the rows of the items [first, last); the caller
    /// has checked that the reader holds them (Reader::expect_remaining), so nothing throws.
    void read_items(snapshot::Reader& r, Index first, Index last) {
        for_each_run(first, last, [&](Index row, Index, Index n) { keys_.read_rows(r, row, n); });
        for_each_run(first, last, [&](Index row, Index, Index n) { values_.read_rows(r, row, n); });
    }
    [[nodiscard]] const Matrix<T>& keys() const noexcept
        requires std::same_as<S, T>
    {
        return keys_.matrix();
    }
    [[nodiscard]] const Matrix<T>& values() const noexcept
        requires std::same_as<S, T>
    {
        return values_.matrix();
    }

    /// Bytes of `items` pairs, as stored.
    [[nodiscard]] std::size_t bytes(Index items) const noexcept {
        return static_cast<std::size_t>(items) * (Rows::row_bytes(keys_.cols()) + Rows::row_bytes(values_.cols()));
    }

private:
    Rows keys_;
    Rows values_;
};

}  // namespace memattn::detail
