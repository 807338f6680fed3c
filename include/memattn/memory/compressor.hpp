#pragma once
// Compressors for HybridCache: how the `rate` consecutive pairs evicted from the local
// window pool into one compressed (key, value) slot. A compressor is incremental: it
// absorbs one row at a time, at its position in the slot (0 first), into the slot
// row, so a slot is usable while it is still open and nothing is buffered. Keys and
// values are pooled separately by the same compressor. A user's compressor is a small
// struct, e.g. "keep the last row":
//
//   struct LastPool {
//       template <class T>
//       void absorb(memattn::RowRef<T> slot, memattn::ConstRowRef<T> row, memattn::Index) const { slot = row; }
//   };
//   memattn::HybridCache<float, LastPool> cache(64, 64, 512, 4, 256);

#include "memattn/detail/assert.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <concepts>
#include <utility>
#include <vector>

namespace memattn {

/// C pools rows of T: `c.absorb(slot, row, position)` folds the row at `position` of a
/// slot into `slot`; at position 0 it sets the slot from the row alone.
template <class C, class T>
concept Compressor = std::copy_constructible<C> &&
    requires(const C& c, RowRef<T> slot, ConstRowRef<T> row, Index position) {
        c.absorb(slot, row, position);
    };

/// The mean of the rows: m_0 = x_0, m_p = m_{p−1} + (x_p − m_{p−1}) / (p + 1).
struct MeanPool {
    static constexpr const char* snapshot_name = "MeanPool";  ///< its name in snapshots
    /// Folds `row`, the slot's row number `position`, into the running mean `slot`.
    template <class T>
    void absorb(RowRef<T> slot, ConstRowRef<T> row, Index position) const {
        if (position == 0)
            slot = row;
        else
            slot += (row - slot) * (T(1) / static_cast<T>(position + 1));
    }
};

/// The element-wise maximum of the rows; a NaN in any of them stays in the slot.
struct MaxPool {
    static constexpr const char* snapshot_name = "MaxPool";  ///< its name in snapshots
    /// Folds `row`, the slot's row number `position`, into the running maximum `slot`.
    template <class T>
    void absorb(RowRef<T> slot, ConstRowRef<T> row, Index position) const {
        if (position == 0)
            slot = row;
        else
            slot = slot.binaryExpr(row, [](T a, T b) { return std::isnan(b) ? b : std::max(a, b); });  // NaN in a stays too
    }
};

/// Σ_p w_p · x_p with a weight per position in the slot, as a 1-D convolution with
/// kernel size and stride `rate` (a learned compression, Rae et al. 2020,
/// "Compressive Transformers") gives. A slot still open holds the partial sum.
class WeightedPool {
public:
    static constexpr const char* snapshot_name = "WeightedPool";  ///< its name in snapshots
    /// w_p for the positions p = 0 .. weights.size() − 1 of a slot.
    explicit WeightedPool(std::vector<double> weights) : weights_(std::move(weights)) {}

    /// Adds w_position · `row` to the partial sum `slot` (sets it at position 0).
    template <class T>
    void absorb(RowRef<T> slot, ConstRowRef<T> row, Index position) const {
        MEMATTN_DASSERT(position >= 0 && position < max_rate());
        const T w = static_cast<T>(weights_[static_cast<std::size_t>(position)]);
        if (position == 0)
            slot = w * row;
        else
            slot += w * row;
    }

    /// The longest slot it can pool: one weight per position. HybridCache checks its
    /// `rate` against this when a compressor provides it.
    [[nodiscard]] Index max_rate() const noexcept { return static_cast<Index>(weights_.size()); }
    /// The weights, w_0 first; snapshots hold them.
    [[nodiscard]] const std::vector<double>& weights() const noexcept { return weights_; }

private:
    std::vector<double> weights_;
};

namespace detail {

/// A compressor that can pool only slots up to some length says so.
template <class C>
concept LimitsRate = requires(const C& c) {
    { c.max_rate() } -> std::convertible_to<Index>;
};

/// A compressor with weights given as doubles (WeightedPool), checked in the cache's scalar.
template <class C>
concept HasWeights = requires(const C& c) {
    { c.weights() } -> std::convertible_to<const std::vector<double>&>;
};

}  // namespace detail
}  // namespace memattn
