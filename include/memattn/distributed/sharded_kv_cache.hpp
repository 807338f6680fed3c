#pragma once
// ShardedKVCache: a KVCache whose pairs are spread over the ranks, token t on rank t mod P
// (distributed/mpi.hpp describes it).

#include "memattn/distributed/collectives.hpp"
#include "memattn/kernels/decode_attention.hpp"
#include "memattn/memory/kv_cache.hpp"
#include "memattn/softmax_state.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace memattn {

/// A KVCache whose pairs are spread over the ranks of a communicator: token t lives on
/// rank t mod P. Every rank calls update (or extend) with the same pairs and only the
/// owner stores them; attend merges every rank's partial softmax in rank order, so every
/// rank gets the same output, bit for bit, on every run. A Memory. The constructor and
/// attend are collective over the communicator; update and extend need no communication
/// (a bad shape there throws on the rank that has it, and the next attend, which
/// compares the ranks' lengths, throws on all of them).
template <Scalar T>
class ShardedKVCache {
public:
    using Scalar = T;  ///< float or double: the rows' scalar and the arithmetic's

    /// Collective: every rank passes the same dims and scale (0: 1/sqrt(key_dim)).
    ShardedKVCache(MPI_Comm comm, Index key_dim, Index value_dim, T scale = T(0))
        : comm_(comm), rank_size_(checked(comm, key_dim, value_dim, scale)), local_(key_dim, value_dim, scale),
          partial_(value_dim + header), all_(static_cast<Index>(rank_size_.second) * (value_dim + header)) {}

    /// The key width d.
    [[nodiscard]] Index key_dim() const noexcept { return local_.key_dim(); }
    /// The value width dv.
    [[nodiscard]] Index value_dim() const noexcept { return local_.value_dim(); }
    /// Tokens seen since reset, on every rank.
    [[nodiscard]] Index length() const noexcept { return length_; }
    /// Pairs this rank holds.
    [[nodiscard]] Index local_length() const noexcept { return local_.length(); }
    /// Bytes this rank holds.
    [[nodiscard]] std::size_t footprint() const noexcept { return local_.footprint(); }

    /// Appends token length() to the memory: its owner stores it.
    void update(ConstRowRef<T> key, ConstRowRef<T> value) {
        detail::require(key.cols() == key_dim(), "ShardedKVCache::update", "key", "has shape ", detail::shape(key),
                        ", expected 1x", key_dim());
        detail::require(value.cols() == value_dim(), "ShardedKVCache::update", "value", "has shape ",
                        detail::shape(value), ", expected 1x", value_dim());
        if (owner(length_) == rank())
            local_.update(key, value);
        ++length_;
    }

    /// update for each row of K/V in order.
    void extend(ConstMatrixRef<T> keys, ConstMatrixRef<T> values) {
        detail::check_keys_values("ShardedKVCache::extend", *this, detail::shape(keys), detail::shape(values));
        const int p = rank_size_.second;
        const Index first = (rank() - owner(length_) + p) % p;  // the first row this rank owns
        const Index mine = keys.rows() > first ? (keys.rows() - first + p - 1) / p : 0;
        if (mine > 0) {
            using Rows = Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>>;
            local_.extend(Rows(keys.data() + first * keys.outerStride(), mine, key_dim(),
                               Eigen::OuterStride<>(keys.outerStride() * p)),
                          Rows(values.data() + first * values.outerStride(), mine, value_dim(),
                               Eigen::OuterStride<>(values.outerStride() * p)));
        }
        length_ += keys.rows();
    }

    /// out = Σ_j softmax_j(scale · q·k_j) v_j over every rank's pairs; zero when empty.
    /// Collective: one MPI_Allgather of (max, sum, length, acc) per rank.
    void attend(ConstRowRef<T> query, RowRef<T> out) const {
        const bool good = query.cols() == key_dim() && out.cols() == value_dim() &&
                          !detail::overlap<T>(detail::extent(out), detail::extent(query));
        const Index dv = value_dim();
        SoftmaxState<T> state;
        auto acc = partial_.tail(dv);
        acc.setZero();
        if (good && local_.length() > 0)
            detail::attend_contiguous(query, local_.keys(), local_.values(), local_.scale(), state, acc);
        // The length travels with the partial, bit for bit as an int64 in the first
        // slots (−1 for a bad argument), so one bad rank stops them all with the same
        // message, and lengths that differ in their last bit are told apart (as floats,
        // 16777216 and 16777217 would compare equal).
        const std::int64_t sent = good ? static_cast<std::int64_t>(length_) : std::int64_t{-1};
        std::memcpy(partial_.data(), &sent, sizeof sent);
        partial_(header - 2) = state.max;
        partial_(header - 1) = state.sum;
        const Index width = dv + header;
        MPI_Allgather(partial_.data(), static_cast<int>(width), detail::mpi::datatype<T>(), all_.data(),
                      static_cast<int>(width), detail::mpi::datatype<T>(), comm_);
        const auto length_of = [&](int r) {
            std::int64_t length = 0;
            std::memcpy(&length, all_.data() + r * width, sizeof length);
            return length;
        };
        const std::int64_t first = length_of(0);
        for (int r = 0; r < rank_size_.second; ++r) {
            const std::int64_t length = length_of(r);
            detail::require(length >= 0, "ShardedKVCache::attend", "query", "or 'out' has a bad shape on rank ", r,
                            " (expected 1x", key_dim(), " and 1x", dv, ", not overlapping)");
            detail::require(length == first, "ShardedKVCache::attend", "length", "differs between ranks: ", first,
                            " on rank 0, ", length, " on rank ", r);
        }
        SoftmaxState<T> merged;
        out.setZero();
        for (int r = 0; r < rank_size_.second; ++r) {
            const T* p = all_.data() + r * width;
            merged.merge(SoftmaxState<T>{p[header - 2], p[header - 1]}, out, Eigen::Map<const Vector<T>>(p + header, dv));
        }
        merged.finish(out);
    }

    /// Forgets every pair (no communication).
    void reset() {
        local_.reset();
        length_ = 0;
    }

private:
    /// The collective check of the constructor's arguments; the rank and size.
    static std::pair<int, int> checked(MPI_Comm comm, Index key_dim, Index value_dim, T scale) {
        const std::string error = detail::mpi::local_error([&] { KVCache<T> probe(key_dim, value_dim, scale); });
        detail::mpi::check_collectively(comm, "ShardedKVCache", error,
                                        {{"key_dim", static_cast<double>(key_dim)},
                                         {"value_dim", static_cast<double>(value_dim)},
                                         {"scale", static_cast<double>(scale)},
                                         {"the scalar size", static_cast<double>(sizeof(T))}});
        return detail::mpi::rank_size(comm);
    }

    [[nodiscard]] int rank() const noexcept { return rank_size_.first; }
    [[nodiscard]] int owner(Index token) const noexcept { return static_cast<int>(token % rank_size_.second); }

    MPI_Comm comm_;
    std::pair<int, int> rank_size_;
    KVCache<T> local_;
    Index length_ = 0;
    /// Slots before a partial's accumulator: the length's int64 bits, then max and sum.
    static constexpr Index header = static_cast<Index>((sizeof(std::int64_t) + sizeof(T) - 1) / sizeof(T)) + 2;
    mutable Vector<T> partial_;  // [length bits, max, sum, acc]: this rank's partial, sent by attend
    mutable Vector<T> all_;      // every rank's
};

}  // namespace memattn
