#pragma once
// Shared test helpers: seeded random inputs and a closeness check whose tolerance
// scales with the magnitude of the expected result.

#include "catch.hpp"
#include "reference/reference.hpp"

#include <memattn/types.hpp>

#include <cstdint>
#include <random>
#include <vector>

namespace memattn::test {

using reference::MatrixD;

/// Uniform in [-scale, scale), from a generator whose output the standard fixes, so
/// every platform sees the same inputs.
template <class T>
Matrix<T> random_matrix(Index rows, Index cols, std::uint64_t seed, double scale = 1.0) {
    std::mt19937_64 gen(seed);
    Matrix<T> m(rows, cols);
    for (Index i = 0; i < rows; ++i)
        for (Index j = 0; j < cols; ++j)
            m(i, j) = static_cast<T>(scale * (2.0 * (static_cast<double>(gen() >> 11) * 0x1.0p-53) - 1.0));
    return m;
}

/// The sanitize build's test binary (MEMATTN_TEST_MEMORY_ONLY): built at -O0 under
/// AddressSanitizer, its long numerical cases run shorter, through the same paths (the
/// native build runs them whole).
#if defined(MEMATTN_TEST_MEMORY_ONLY)
inline constexpr bool memory_only = true;
#else
inline constexpr bool memory_only = false;
#endif

/// The long sequence of the shapes that attend token by token against a reference:
/// 300 tokens (past two blocks of the grouped attend's 128 keys), 150 in the sanitize
/// build (past one; a quarter of the quadratic work).
inline constexpr Index long_tokens = memory_only ? 150 : 300;

/// Relative tolerance for results computed in T from inputs of unit scale.
template <class T>
constexpr double tolerance() {
    return sizeof(T) == 4 ? 2e-5 : 1e-12;
}

/// max |actual − expected| ≤ rel · max(1, max |expected|), shapes equal.
template <class D>
void check_close(const Eigen::MatrixBase<D>& actual, const MatrixD& expected, double rel) {
    REQUIRE(actual.rows() == expected.rows());
    REQUIRE(actual.cols() == expected.cols());
    if (expected.size() == 0)
        return;
    const MatrixD a = actual.template cast<double>();
    REQUIRE(a.allFinite());
    const double magnitude = std::max(1.0, expected.cwiseAbs().maxCoeff());
    const double error = (a - expected).cwiseAbs().maxCoeff();
    CAPTURE(magnitude, rel);
    REQUIRE_THAT(error, Catch::Matchers::WithinAbs(0.0, rel * magnitude));
}

// A user's own feature map, in a few lines: φ(x) = (x², 1), positive, for any scalar.
struct SquarePlusOne {
    Index output_dim(Index d) const { return d + 1; }
    template <class T>
    void operator()(ConstMatrixRef<T> X, MatrixRef<T> Y) const {
        if (X.rows() == 0)  // a column block of an empty view offsets a null pointer (UBSan)
            return;
        Y.leftCols(X.cols()) = X.array().square().matrix();
        Y.col(X.cols()).setOnes();
    }
};

/// Which rows of O are all finite.
template <class D>
std::vector<bool> finite_rows(const Eigen::MatrixBase<D>& O) {
    std::vector<bool> finite;
    for (Index i = 0; i < O.rows(); ++i)
        finite.push_back(O.row(i).allFinite());
    return finite;
}

/// The rows first..last, and no others, are not finite.
inline void expect_poisoned_exactly(const std::vector<bool>& finite, Index first, Index last) {
    for (Index i = 0; i < static_cast<Index>(finite.size()); ++i) {
        INFO("row " << i << " of " << finite.size() << ", expected non-finite rows " << first << ".." << last);
        CHECK(finite[static_cast<std::size_t>(i)] == (i < first || i > last));
    }
}

}  // namespace memattn::test
