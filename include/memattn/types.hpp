#pragma once
// Eigen aliases shared by every memattn header, and the one shape check that every
// public entry point uses to report bad input.

#include "memattn/detail/eigen_core.hpp"

#include <charconv>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <type_traits>
#include <utility>

namespace memattn {

/// Sizes, dimensions and positions: Eigen's signed index type.
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
/// The read-only MatrixRef.
template <class T>
using ConstMatrixRef = Eigen::Ref<const Matrix<T>, 0, Eigen::OuterStride<>>;
/// A view of one writable row (a token).
template <class T>
using RowRef = Eigen::Ref<Vector<T>>;
/// A view of one read-only row (a token).
template <class T>
using ConstRowRef = Eigen::Ref<const Vector<T>>;

/// The most tokens a memory counts: 2^62, far past any sequence (a century at a billion
/// tokens a second), and small enough that no sum of positions overflows Index. An update
/// past it throws std::length_error; a snapshot that claims more is a SnapshotError.
inline constexpr Index max_length = Index{1} << 62;

/// The scalars memattn is written for.
template <class T>
concept Scalar = std::same_as<T, float> || std::same_as<T, double>;

/// The 16-bit scalars a kernel takes as inputs and outputs (Eigen::bfloat16,
/// Eigen::half), computing in float: docs/design.md §4.7c.
template <class T>
concept LowPrecision = std::same_as<T, Eigen::bfloat16> || std::same_as<T, Eigen::half>;

/// The scalars of the rows a memory takes and gives: float and double, computed in
/// themselves, and the 16-bit ones, computed in float (KVCache<Eigen::bfloat16>, ...).
template <class T>
concept RowScalar = Scalar<T> || LowPrecision<T>;

/// The scalar a call on inputs of T computes and accumulates in: float for the 16-bit
/// scalars, T itself otherwise.
template <class T>
using arithmetic_t = std::conditional_t<LowPrecision<T>, float, T>;

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

/// Where the value checks of a memory's update report from: the function a message
/// names, and, for a memory inside a layer (memattn::MultiHead), its KV head and the
/// columns of the packed rows where its key and value rows begin, so a message names the
/// column the caller wrote. A memory called alone: head −1, columns from 0.
struct PairSite {
    std::string_view function;
    std::string_view key_name = "keys";      ///< the arguments a message names
    std::string_view value_name = "values";
    Index head = -1;
    Index key_column = 0;
    Index value_column = 0;
    Index first_row = 0;  ///< the caller's row of the pairs' row 0 (a 16-bit memory checks in spans)
};

/// Column `column` of a memory's key (or value) row, as a message names it: the caller's
/// column, and in a layer the head's own.
struct SiteColumn {
    const PairSite& site;
    Index column;
    bool value = false;
    friend std::ostream& operator<<(std::ostream& os, const SiteColumn& c) {
        os << (c.value ? c.site.value_column : c.site.key_column) + c.column;
        if (c.site.head >= 0)
            os << " (column " << c.column << " of KV head " << c.site.head << ")";
        return os;
    }
};

/// Streams one part of a message; a floating-point value in its shortest form that reads
/// back as the same value, so a rejected 1.0000000001 is not shown as 1.
template <class Part>
void put(std::ostream& os, const Part& part) {
    if constexpr (std::is_floating_point_v<Part>) {
        char buffer[64];
        const auto result = std::to_chars(buffer, buffer + sizeof buffer, part);
        os.write(buffer, result.ptr - buffer);
    } else {
        os << part;
    }
}

/// Throws std::invalid_argument("memattn::<function>: argument '<argument>' <parts...>")
/// unless `ok`. The message is built only on failure, so the check costs a branch.
template <class... Parts>
void require(bool ok, std::string_view function, std::string_view argument, const Parts&... parts) {
    if (ok) [[likely]]
        return;
    std::ostringstream os;
    os << "memattn::" << function << ": argument '" << argument << "' ";
    (put(os, parts), ...);
    throw std::invalid_argument(os.str());
}

/// a · b for sizes a, b >= 0, or std::invalid_argument naming the function, the argument
/// and both factors when the product does not fit Index (`what` says what it counts).
inline Index checked_product(std::string_view function, std::string_view argument, Index a, Index b,
                             std::string_view what) {
    Index product = 0;
    require(!__builtin_mul_overflow(a, b, &product), function, argument, "is ", a, ": ", what, ' ', a, " x ", b,
            " overflows a signed 64-bit size");
    return product;
}

/// "float" or "double", for messages.
template <class T>
inline constexpr const char* scalar_name = std::is_same_v<T, float> ? "float" : "double";

/// A double-valued option is finite both as given and in the scalar T the call computes
/// in (1e39 is a finite double and an infinite float).
template <class T>
bool finite_in(double value) {
    return std::isfinite(value) && std::isfinite(static_cast<T>(value));
}

/// D is an Eigen matrix expression (a Matrix, Map, Block, Ref, ...), of any constness.
template <class D>
concept EigenMatrix = std::derived_from<std::remove_cvref_t<D>, Eigen::MatrixBase<std::remove_cvref_t<D>>>;

/// Sequences are row-major, one token per row; a compile-time vector (one row or one
/// column) is contiguous either way.
template <class D>
inline constexpr bool row_major_sequence = bool(D::IsRowMajor) || bool(D::IsVectorAtCompileTime);

/// An output argument can be written through: not const, and an lvalue expression (not a
/// block of a const matrix, a Map of const data, a const Ref, a product...).
template <class D>
inline constexpr bool writable_expression =
    !std::is_const_v<std::remove_reference_t<D>> && (std::remove_cvref_t<D>::Flags & Eigen::LvalueBit) != 0;

/// The view of an input sequence, after the layout check: a column-major matrix is
/// refused at compile time rather than copied behind the caller's back.
template <class D>
ConstMatrixRef<typename D::Scalar> sequence(const Eigen::MatrixBase<D>& x) {
    static_assert(row_major_sequence<D>,
                  "memattn takes row-major sequences: use memattn::Matrix<T> or a row-major Map "
                  "(this argument is column-major, e.g. an Eigen::MatrixXf, and would be copied)");
    return ConstMatrixRef<typename D::Scalar>(x.derived());
}

/// Checks that an output can be written in place: writable, and row-major unless it is a
/// vector (`sequences` false: an lse).
template <class D, bool sequences = true>
constexpr bool check_output() {
    using E = std::remove_cvref_t<D>;
    static_assert(writable_expression<D>,
                  "memattn writes outputs in place: pass a non-const matrix, or a writable block or Map "
                  "(this output is const)");
    static_assert(!sequences || row_major_sequence<E>,
                  "memattn takes row-major sequences: use memattn::Matrix<T> or a row-major Map "
                  "(this output is column-major, e.g. an Eigen::MatrixXf)");
    return writable_expression<D> && (!sequences || row_major_sequence<E>);
}

/// The view of an output sequence, written in place.
template <EigenMatrix D>
MatrixRef<typename std::remove_cvref_t<D>::Scalar> output(D&& out) {
    using T = typename std::remove_cvref_t<D>::Scalar;
    if constexpr (check_output<D>()) {
        return MatrixRef<T>(out);
    } else {  // never runs: the build has failed in check_output; this keeps the error to one
        static Matrix<T> unused;
        return MatrixRef<T>(unused);
    }
}

/// Where a view's elements are: `rows` runs of `cols` contiguous elements, `stride` apart.
struct Extent {
    std::uintptr_t address;
    Index rows, cols, stride;
};

template <class D>
Extent extent(const D& view) {
    const auto address = reinterpret_cast<std::uintptr_t>(view.data());
    const Index rows = view.rows(), cols = view.cols();
    const Index row_step = D::IsRowMajor ? view.outerStride() : view.innerStride();
    const Index col_step = D::IsRowMajor ? view.innerStride() : view.outerStride();
    if (rows == 1 || cols == 1) {  // a vector: one run, or one element per step
        const Index step = rows == 1 ? col_step : row_step, size = rows * cols;
        return step == 1 ? Extent{address, 1, size, size} : Extent{address, size, 1, step};
    }
    if (col_step == 1)
        return {address, rows, cols, row_step};
    if (row_step == 1)  // column-major: the same elements as its transpose
        return {address, cols, rows, col_step};
    const Index span = (rows - 1) * row_step + (cols - 1) * col_step + 1;  // neither: every address in between
    return {address, 1, span, span};
}

/// Whether the run of elements [start, start + length) meets one of the rows of a view
/// whose first element is at 0.
inline bool run_meets_rows(Index start, Index length, const Extent& view) {
    if (view.rows == 1 || view.stride <= 0)
        return start < view.cols && start + length > 0;
    const Index row = start < view.cols ? 0 : (start - view.cols) / view.stride + 1;  // first row ending past start
    return row < view.rows && row * view.stride < start + length;
}

/// Whether two row-major views of T (unit inner stride) share an element. Exact for single
/// rows and for views with the same row stride (blocks of one buffer, such as the column
/// blocks of a fused QKV matrix); other views are taken to overlap when their address
/// ranges meet.
template <class T>
bool overlap(Extent a, Extent b) {
    if (a.rows == 0 || a.cols == 0 || b.rows == 0 || b.cols == 0)
        return false;
    const auto end = [](const Extent& e) {
        return e.address + sizeof(T) * static_cast<std::uintptr_t>((e.rows - 1) * e.stride + e.cols);
    };
    if (end(a) <= b.address || end(b) <= a.address)
        return false;
    if (b.address < a.address)
        std::swap(a, b);
    const std::uintptr_t bytes = b.address - a.address;
    if (bytes % sizeof(T) != 0)
        return true;
    const auto delta = static_cast<Index>(bytes / sizeof(T));  // b's first element, counted from a's
    if (b.rows == 1)
        return run_meets_rows(delta, b.cols, a);
    if (a.rows == 1)
        return run_meets_rows(-delta, a.cols, b);
    if (a.stride != b.stride || a.cols > a.stride || b.cols > b.stride)
        return true;
    // b(j, e) is a's element (q + j)·s + r + e: in a's row q + j, or past its end in the next.
    const Index s = a.stride, q = delta / s, r = delta % s;
    return q < a.rows && (r < a.cols || (r + b.cols > s && q + 1 < a.rows));
}

/// The aliasing rule of every entry point: an output shares no element with an input.
template <class O, class I>
void require_disjoint(std::string_view function, std::string_view output_name, const O& out,
                      std::string_view input_name, const I& in) {
    bool shared;
    if constexpr (std::is_same_v<typename O::Scalar, typename I::Scalar>) {
        shared = overlap<typename O::Scalar>(extent(out), extent(in));
    } else {  // elements of two sizes (a float output of 16-bit inputs): their address ranges meet
        const Extent a = extent(out), b = extent(in);
        const auto end = [](const Extent& e, std::size_t size) {
            return e.address + size * static_cast<std::uintptr_t>((e.rows - 1) * e.stride + e.cols);
        };
        shared = a.rows > 0 && a.cols > 0 && b.rows > 0 && b.cols > 0 &&
                 end(a, sizeof(typename O::Scalar)) > b.address && end(b, sizeof(typename I::Scalar)) > a.address;
    }
    require(!shared, function, output_name, "(", shape(out),
            ") shares memory with argument '", input_name, "' (", shape(in),
            "): an output must not overlap an input; write it to separate storage");
}

/// The tag of the calls whose caller has run their checks (shapes, values, aliasing: a
/// layer for its heads, a pool or a batch for its sequences), so that a decode step
/// checks its inputs once, not once per level: each level's checks were 5% of a
/// recurrent layer's step.
struct Checked {};
/// Checked{}.
inline constexpr Checked checked{};

/// All arguments of a public function share one floating-point scalar.
template <class First, class... Rest>
inline constexpr bool same_scalar = (std::is_same_v<typename First::Scalar, typename Rest::Scalar> && ...);

}  // namespace detail
}  // namespace memattn
