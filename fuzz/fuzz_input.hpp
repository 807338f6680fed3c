#pragma once
// Turns a libFuzzer byte string into shapes, options and values. Every read is
// total: past the end of the data it yields the smallest choice, so each input maps
// to exactly one well-formed case.

#include "reference/reference.hpp"

#include <memattn/types.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace memattn::fuzz {

class FuzzInput {
public:
    FuzzInput(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}

    /// An integer in [lo, hi].
    Index size(Index lo, Index hi) {
        const std::uint32_t raw = byte() | (static_cast<std::uint32_t>(byte()) << 8);
        return lo + static_cast<Index>(raw % static_cast<std::uint32_t>(hi - lo + 1));
    }
    bool flag() { return byte() & 1u; }
    /// A value in [−range, range] on a grid of 2^16 steps, so inputs are exact in float.
    double value(double range) {
        const std::uint32_t raw = byte() | (static_cast<std::uint32_t>(byte()) << 8);
        return range * (static_cast<double>(raw) / 32768.0 - 1.0);
    }
    template <class T>
    Matrix<T> matrix(Index rows, Index cols, double range) {
        Matrix<T> m(rows, cols);
        for (Index i = 0; i < m.size(); ++i)
            m.data()[i] = static_cast<T>(value(range));
        return m;
    }

private:
    std::uint32_t byte() { return pos_ < size_ ? data_[pos_++] : 0u; }

    const std::uint8_t* data_;
    std::size_t size_;
    std::size_t pos_ = 0;
};

/// Aborts (a finding for libFuzzer) unless max |actual − expected| ≤ rel·max(1, max|expected|).
template <class D>
void expect_close(const char* what, const Eigen::MatrixBase<D>& actual, const reference::MatrixD& expected,
                  double rel) {
    if (actual.rows() != expected.rows() || actual.cols() != expected.cols()) {
        std::fprintf(stderr, "%s: shape %ldx%ld, expected %ldx%ld\n", what, static_cast<long>(actual.rows()),
                     static_cast<long>(actual.cols()), static_cast<long>(expected.rows()),
                     static_cast<long>(expected.cols()));
        std::abort();
    }
    if (expected.size() == 0)
        return;
    const reference::MatrixD a = actual.template cast<double>();
    const double magnitude = std::max(1.0, expected.cwiseAbs().maxCoeff());
    const double error = (a - expected).cwiseAbs().maxCoeff();
    if (!(error <= rel * magnitude)) {  // also catches NaN
        std::fprintf(stderr, "%s: error %g exceeds %g (magnitude %g)\n", what, error, rel * magnitude, magnitude);
        std::abort();
    }
}

}  // namespace memattn::fuzz
