#pragma once
// MovingAverageCache: one summary (key, value) pair. Softmax over a single slot gives
// it weight 1, so `attend` returns the summary value whatever the query: the cheapest
// memory, a baseline for what attention adds over averaging.
//
//   MovingAverageCache<float> last(64, 64, 128);   // mean of the last 128 pairs
//   MovingAverageCache<float> all(64, 64, 0);      // mean of every pair so far
//   auto ema = MovingAverageCache<float>::exponential(64, 64, 0.1f);
//       // s_1 = x_1,  s_t = α x_t + (1 − α) s_{t−1}
//
// Float error: the windowed mean keeps running sums (add the new pair, subtract the
// evicted one) and re-sums the ring every `window` updates, so rounding error cannot
// accumulate beyond one window. The cumulative mean uses compensated (Kahan 1965)
// summation: after 10^6 tokens of float the mean agrees with double to ~1e-7
// relative, where a plain float sum would have lost ~1e-2 (tests hold this).

#include "memattn/memory/concept.hpp"
#include "memattn/memory/detail/low_precision.hpp"
#include "memattn/memory/detail/memory_checks.hpp"
#include "memattn/memory/detail/pair_ring.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>

namespace memattn {

/// One summary (key, value) pair, the mean of the last `window` pairs, of every pair, or
/// their exponential moving average; `attend` returns the summary value. See the top of
/// the file.
template <RowScalar T>
class MovingAverageCache {
public:
    using Scalar = T;  ///< float or double: the rows' scalar and the summary's

    /// The mean of the last `window` pairs; `window` 0: of every pair since reset.
    MovingAverageCache(Index key_dim, Index value_dim, Index window)
        : MovingAverageCache(key_dim, value_dim, checked_window(window), T(0)) {}

    /// The exponential moving average with weight `alpha` in (0, 1] on the newest pair.
    static MovingAverageCache exponential(Index key_dim, Index value_dim, T alpha) {
        detail::require(alpha > T(0) && alpha <= T(1), "MovingAverageCache::exponential", "alpha", "is ", alpha,
                        ", expected 0 < alpha <= 1");
        return MovingAverageCache(key_dim, value_dim, 0, alpha);
    }

    /// Folds one pair into the summary.
    void update(ConstRowRef<T> key, ConstRowRef<T> value) {
        validate(key, value, {"MovingAverageCache::update", "key", "value"});
        fold(key, value);
    }

    /// Folds many pairs; a windowed mean copies only the last `window` of them.
    void extend(ConstMatrixRef<T> keys, ConstMatrixRef<T> values) {
        validate(keys, values, {"MovingAverageCache::extend"});
        const Index n = keys.rows();
        if (window_ > 0 && n >= window_) {
            ring_.put_rows(length_ + n - window_, keys.bottomRows(window_), values.bottomRows(window_));
            length_ += n;
            resum();
            return;
        }
        for (Index i = 0; i < n; ++i)
            fold(keys.row(i), values.row(i));
    }

    /// Throws what update/extend would throw for these pairs, changing nothing:
    /// std::invalid_argument for a shape, std::length_error past memattn::max_length.
    void validate(ConstMatrixRef<T> keys, ConstMatrixRef<T> values,
                  const detail::PairSite& site = {"MovingAverageCache::validate"}) const {
        detail::check_site_pairs(site, detail::shape(keys), detail::shape(values), key_dim_, value_dim_, length_);
    }

    /// out = the summary value (softmax over the one summary slot); zero when empty.
    void attend(ConstRowRef<T> query, RowRef<T> out) const {
        detail::check_query("MovingAverageCache::attend", query, out, key_dim_, value_dim_);
        if (length_ == 0)
            out.setZero();
        else if (alpha_ > T(0))
            out = value_;
        else
            out = value_ * (T(1) / static_cast<T>(averaged()));
    }

    /// The summary pair now (allocates the returned rows; attend does not).
    [[nodiscard]] Vector<T> summary_key() const { return summary(key_); }
    /// The summary value now, what attend returns (allocates the returned row).
    [[nodiscard]] Vector<T> summary_value() const { return summary(value_); }

    /// Tokens seen since reset.
    [[nodiscard]] Index length() const noexcept { return length_; }
    /// Bytes of state held now: the summary pair, its compensation (cumulative mean)
    /// or the pairs of the window held (windowed mean). Constant once the window is full.
    [[nodiscard]] std::size_t footprint() const noexcept {
        const std::size_t pair = ring_.bytes(1);
        if (alpha_ > T(0))
            return pair;
        if (window_ == 0)
            return 2 * pair;
        return pair + ring_.bytes(std::min(length_, window_));
    }
    /// Bytes allocated at construction.
    [[nodiscard]] std::size_t capacity() const noexcept {
        return ring_.bytes(ring_.capacity()) +
               sizeof(T) * static_cast<std::size_t>(key_.size() + value_.size() + key_carry_.size() +
                                                    value_carry_.size());
    }
    /// Forgets every pair (the summary is zero again) and keeps the allocation.
    void reset() noexcept {
        length_ = 0;
        since_resum_ = 0;
        key_.setZero();
        value_.setZero();
        key_carry_.setZero();
        value_carry_.setZero();
    }

    /// The key width d.
    [[nodiscard]] Index key_dim() const noexcept { return key_dim_; }
    /// The value width dv.
    [[nodiscard]] Index value_dim() const noexcept { return value_dim_; }
    /// The window (0: cumulative, or exponential).
    [[nodiscard]] Index window() const noexcept { return window_; }
    /// The EMA weight; 0 for the (windowed or cumulative) mean.
    [[nodiscard]] T alpha() const noexcept { return alpha_; }

    /// Snapshots (memattn/persistence/snapshot.hpp): key_dim, value_dim, window, alpha,
    /// length, the steps since the last re-sum, the running key and value (sums or
    /// averages), their Kahan carries (cumulative mean only), then the ring's pairs
    /// (windowed mean only), oldest first.
    [[nodiscard]] static std::string snapshot_kind() { return "MovingAverageCache"; }
    /// Snapshots (memattn/persistence/snapshot.hpp): writes the payload, the fields listed at snapshot_kind().
    void write_snapshot(snapshot::Writer& w) const {
        w.index(key_dim_);
        w.index(value_dim_);
        w.index(window_);
        w.number(alpha_);
        w.index(length_);
        w.index(since_resum_);
        w.matrix(key_);
        w.matrix(value_);
        w.matrix(key_carry_);
        w.matrix(value_carry_);
        if (window_ > 0)
            ring_.write_items(w, length_ - averaged(), length_);
    }
    /// Snapshots: reads a payload written by write_snapshot(); throws SnapshotError, the
    /// cache unchanged, unless key_dim, value_dim, window and alpha are its own.
    void read_snapshot(snapshot::Reader& r) {
        r.expect("key_dim", key_dim_);
        r.expect("value_dim", value_dim_);
        r.expect("window", window_);
        r.expect("alpha", alpha_);
        const Index length = r.count("length", 0, max_length);
        const Index since_resum = r.count("steps since the re-sum", 0, window_ > 0 ? window_ - 1 : 0);
        const Index held = window_ > 0 ? std::min(length, window_) : 0;
        const std::size_t vectors =
            sizeof(T) * static_cast<std::size_t>(key_.size() + value_.size() + key_carry_.size() + value_carry_.size());
        r.expect_remaining(vectors + ring_.bytes(held), "the running sums and the held pairs");
        r.matrix(key_, "the running key");
        r.matrix(value_, "the running value");
        r.matrix(key_carry_, "the key's carry");
        r.matrix(value_carry_, "the value's carry");
        if (window_ > 0)
            ring_.read_items(r, length - held, length);
        length_ = length;
        since_resum_ = since_resum;
    }

private:
    MovingAverageCache(Index key_dim, Index value_dim, Index window, T alpha)
        : key_dim_(checked_dim(key_dim, "key_dim")),
          value_dim_(checked_dim(value_dim, "value_dim")),
          window_(window),
          alpha_(alpha),
          ring_(window, key_dim, value_dim),
          key_(Vector<T>::Zero(key_dim)),
          value_(Vector<T>::Zero(value_dim)),
          key_carry_(Vector<T>::Zero(window == 0 && alpha == T(0) ? key_dim : 0)),
          value_carry_(Vector<T>::Zero(window == 0 && alpha == T(0) ? value_dim : 0)) {}

    /// Pairs in the mean now.
    [[nodiscard]] Index averaged() const noexcept { return window_ > 0 ? std::min(length_, window_) : length_; }

    template <class K, class V>
    void fold(const K& key, const V& value) {
        if (alpha_ > T(0)) {
            // s_1 = x_1,  s_t = α x_t + (1 − α) s_{t−1}; α = 1 keeps x_t alone (not 0 · s_{t−1},
            // which is NaN after a non-finite pair and would never recover).
            if (length_ == 0 || alpha_ == T(1)) {
                key_ = key;
                value_ = value;
            } else {
                key_ = alpha_ * key + (T(1) - alpha_) * key_;
                value_ = alpha_ * value + (T(1) - alpha_) * value_;
            }
        } else if (window_ == 0) {
            kahan_add(key_, key_carry_, key);
            kahan_add(value_, value_carry_, value);
        } else {
            // S_t = S_{t−1} + x_t − x_{t−w}; exact re-sum every w steps bounds the drift.
            if (length_ >= window_) {
                key_ -= ring_.key(length_ - window_);
                value_ -= ring_.value(length_ - window_);
            }
            ring_.put(length_, key, value);
            key_ += key;
            value_ += value;
            if (++since_resum_ == window_) {
                ++length_;
                resum();
                return;
            }
        }
        ++length_;
    }

    /// S = Σ of the pairs held, from scratch.
    void resum() {
        key_.setZero();
        value_.setZero();
        ring_.for_each_run(length_ - averaged(), length_, [&](Index row, Index, Index n) {
            key_.noalias() += ring_.keys().middleRows(row, n).colwise().sum();
            value_.noalias() += ring_.values().middleRows(row, n).colwise().sum();
        });
        since_resum_ = 0;
    }

    /// Compensated summation, per component: y = x − c, t = s + y, c = (t − s) − y, s = t.
    /// (No products, so FMA contraction cannot undo the compensation.)
    template <class X>
    static void kahan_add(Vector<T>& sum, Vector<T>& carry, const X& x) {
        for (Index c = 0; c < sum.cols(); ++c) {
            const T y = x(c) - carry(c);
            const T t = sum(c) + y;
            carry(c) = (t - sum(c)) - y;
            sum(c) = t;
        }
    }

    [[nodiscard]] Vector<T> summary(const Vector<T>& state) const {
        if (length_ == 0)
            return Vector<T>::Zero(state.cols());
        if (alpha_ > T(0))
            return state;
        return state / static_cast<T>(averaged());
    }

    static Index checked_dim(Index dim, const char* argument) {
        return detail::at_least(dim, 1, "MovingAverageCache", argument);
    }

    static Index checked_window(Index window) {
        detail::require(window >= 0, "MovingAverageCache", "window", "is ", window,
                        ", expected >= 0 (0: the mean of every pair)");
        return window;
    }

    Index key_dim_;
    Index value_dim_;
    Index window_;  ///< 0: cumulative (or exponential when alpha_ > 0)
    T alpha_;       ///< > 0: exponential moving average
    detail::PairRing<T> ring_;  ///< the last `window` pairs (windowed mean only)
    Vector<T> key_;    ///< Σ keys (mean), or the EMA key
    Vector<T> value_;  ///< Σ values (mean), or the EMA value
    Vector<T> key_carry_;    ///< Kahan compensation (cumulative mean only)
    Vector<T> value_carry_;
    Index length_ = 0;
    Index since_resum_ = 0;
};

/// MovingAverageCache of 16-bit rows (E = Eigen::bfloat16 or Eigen::half):
/// MovingAverageCache<float> behind members that take and give rows of E
/// (memory/detail/low_precision.hpp). The constructors are MovingAverageCache<float>'s.
template <LowPrecision E>
class MovingAverageCache<E> : public detail::LowPrecisionMemory<MovingAverageCache<float>, E> {
public:
    using detail::LowPrecisionMemory<MovingAverageCache<float>, E>::LowPrecisionMemory;
    /// MovingAverageCache<float>::exponential, of 16-bit rows.
    static MovingAverageCache exponential(Index key_dim, Index value_dim, float alpha) {
        return MovingAverageCache(MovingAverageCache<float>::exponential(key_dim, value_dim, alpha));
    }
};

namespace detail {
template <>
inline constexpr std::string_view memory_name<MovingAverageCache<float>> = "MovingAverageCache";
}  // namespace detail

}  // namespace memattn
