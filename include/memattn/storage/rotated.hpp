#pragma once
// Rotated<S>: keys (and queries) turned by one orthonormal Walsh–Hadamard transform
// before the keys are stored as S, so an outlier channel shares its block's scale.

#include "memattn/storage/stored_rows.hpp"

namespace memattn::detail {

/// The rotation of `Rotated<S>` storage on one head's row of n values, in place: the
/// normalised Walsh–Hadamard transform H_m/√m on consecutive segments of m values, each
/// m the largest power of two left (n = 128: one H_128; n = 96: H_64, then H_32; n = 1:
/// nothing). Orthonormal and its own inverse, so (Hq)·(Hk) = q·k in exact arithmetic.
template <class T>
void hadamard_rotate(T* x, Index n) noexcept {
    for (Index at = 0; at < n;) {
        const auto m = static_cast<Index>(std::bit_floor(static_cast<std::size_t>(n - at)));
        T* y = x + at;
        for (Index h = 1; h < m; h *= 2)
            for (Index i = 0; i < m; i += 2 * h)
                for (Index j = i; j < i + h; ++j) {
                    const T a = y[j], b = y[j + h];
                    y[j] = a + b;
                    y[j + h] = a - b;
                }
        if (m > 1) {
            const T norm = T(1) / std::sqrt(static_cast<T>(m));
            for (Index j = 0; j < m; ++j)
                y[j] *= norm;
        }
        at += m;
    }
}

/// The most hadamard_rotate multiplies a row's largest magnitude by: √m for its widest
/// segment m (|(H_m x)_i| / √m ≤ Σ|x_j| / √m ≤ √m · max|x_j|).
inline double hadamard_growth(Index n) noexcept {
    return n > 0 ? std::sqrt(static_cast<double>(std::bit_floor(static_cast<std::size_t>(n)))) : 1.0;
}

/// `Rotated<S>`: the rows of S (the memory rotates its keys before it stores them and its
/// queries before it reads them; the stored rows are S's).
template <class T, class S>
class StoredRows<T, Rotated<S>> : public StoredRows<T, S> {
public:
    using StoredRows<T, S>::StoredRows;
};

}  // namespace memattn::detail
