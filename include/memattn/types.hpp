#pragma once
// Eigen aliases shared by every memattn header, and the one shape check that every
// public entry point uses to report bad input.

#include <Eigen/Core>

#include <concepts>
#include <cstddef>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <type_traits>

namespace memattn {

using Index = Eigen::Index;

/// A sequence: one token per row, row-major.
template <class T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
/// One token (a row vector).
template <class T>
using Vector = Eigen::Matrix<T, 1, Eigen::Dynamic, Eigen::RowMajor>;

/// Views used inside the library: any row-major storage with unit inner stride, e.g.
/// a `Matrix<T>`, a `Map`, or one head's columns of a `[tokens, heads*dim]` buffer.
template <class T>
using MatrixRef = Eigen::Ref<Matrix<T>, 0, Eigen::OuterStride<>>;
template <class T>
using ConstMatrixRef = Eigen::Ref<const Matrix<T>, 0, Eigen::OuterStride<>>;
template <class T>
using RowRef = Eigen::Ref<Vector<T>>;
template <class T>
using ConstRowRef = Eigen::Ref<const Vector<T>>;

/// The scalars memattn is written for.
template <class T>
concept Scalar = std::same_as<T, float> || std::same_as<T, double>;

namespace detail {

/// "RxC" for a message.
struct Shape {
    Index rows;
    Index cols;
    friend std::ostream& operator<<(std::ostream& os, Shape s) { return os << s.rows << 'x' << s.cols; }
};

template <class D>
Shape shape(const Eigen::EigenBase<D>& m) {
    return {m.rows(), m.cols()};
}

/// Throws std::invalid_argument("memattn::<function>: argument '<argument>' <parts...>")
/// unless `ok`. The message is built only on failure, so the check costs a branch.
template <class... Parts>
void require(bool ok, std::string_view function, std::string_view argument, const Parts&... parts) {
    if (ok) [[likely]]
        return;
    std::ostringstream os;
    os << "memattn::" << function << ": argument '" << argument << "' ";
    (os << ... << parts);
    throw std::invalid_argument(os.str());
}

/// The output argument of a public function: Eigen's documented idiom for writable
/// temporaries such as `O.middleCols(h * dv, dv)` is to take them by const reference
/// and cast the constness away ("Writing Functions Taking Eigen Types").
template <class D>
MatrixRef<typename D::Scalar> writable(const Eigen::MatrixBase<D>& out) {
    static_assert(static_cast<bool>(D::IsRowMajor) || D::ColsAtCompileTime == 1 || D::RowsAtCompileTime == 1,
                  "memattn writes outputs in place into row-major storage: pass a row-major Matrix, Map or "
                  "block (memattn::Matrix<T> is row-major).");
    return MatrixRef<typename D::Scalar>(const_cast<Eigen::MatrixBase<D>&>(out).derived());
}

template <class D>
RowRef<typename D::Scalar> writable_row(const Eigen::MatrixBase<D>& out) {
    return RowRef<typename D::Scalar>(const_cast<Eigen::MatrixBase<D>&>(out).derived());
}

/// All arguments of a public function share one floating-point scalar.
template <class First, class... Rest>
inline constexpr bool same_scalar = (std::is_same_v<typename First::Scalar, typename Rest::Scalar> && ...);

}  // namespace detail
}  // namespace memattn
