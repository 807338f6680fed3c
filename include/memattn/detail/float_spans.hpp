#pragma once
// 16-bit inputs of the linear, gated and delta-rule forms (docs/design.md §4.7c): the
// sequence is cut into spans of whole chunks, each span's rows converted to float
// (exactly: every bfloat16 and float16 is a float) into buffers of one span, the float
// form run on it with its state carried from the span before, and its outputs rounded
// to the 16-bit type (a float O is written in place). The spans cut the sequence only at
// chunk boundaries, and the recurrent and chunked forms carry their state exactly across
// calls, so the outputs and the final state are bitwise those of one float call on the
// converted inputs; the scratch is O(span), whatever the length.

#include "memattn/types.hpp"

#include <algorithm>
#include <array>
#include <type_traits>

namespace memattn::detail {

/// Rows per span: 256 rounded to whole chunks (one chunk at least).
constexpr Index span_rows(Index chunk) { return std::max<Index>(1, 256 / std::max<Index>(chunk, 1)) * chunk; }

/// The buffers of one span: up to six inputs and one output, in float.
class FloatSpans {
public:
    /// Rows [r0, r0 + m) of `src` as float: the rows themselves for a float source, else
    /// converted into buffer `slot`.
    template <class S>
    ConstMatrixRef<float> rows(int slot, const ConstMatrixRef<S>& src, Index r0, Index m) {
        if constexpr (std::is_same_v<S, float>) {
            return src.middleRows(r0, m);
        } else {
            Matrix<float>& b = in_[static_cast<std::size_t>(slot)];
            if (b.rows() < m || b.cols() != src.cols())
                b.resize(std::max(m, b.rows()), src.cols());
            b.topRows(m) = src.middleRows(r0, m).template cast<float>();
            return b.topRows(m);
        }
    }

    /// Where the float form writes rows [r0, r0 + m) of O: O's own rows when it is float,
    /// else the output buffer, which store() then rounds into O.
    template <class Out>
    MatrixRef<float> out(MatrixRef<Out>& o, Index r0, Index m) {
        if constexpr (std::is_same_v<Out, float>) {
            return o.middleRows(r0, m);
        } else {
            if (out_.rows() < m || out_.cols() != o.cols())
                out_.resize(std::max(m, out_.rows()), o.cols());
            return out_.topRows(m);
        }
    }

    /// f(r0, m, out) for each span [r0, r0 + m) of n rows (span_rows(chunk) each), `out`
    /// where the float form writes the span's rows of O, which are then stored into O.
    template <class Out, class F>
    void each(Index n, Index chunk, MatrixRef<Out>& o, F&& f) {
        const Index span = span_rows(chunk);
        for (Index r0 = 0; r0 < n; r0 += span) {
            const Index m = std::min(span, n - r0);
            f(r0, m, out(o, r0, m));
            store(o, r0, m);
        }
    }

    /// Rows [r0, r0 + m) of a 16-bit O from the output buffer, rounded to nearest even.
    template <class Out>
    void store(MatrixRef<Out>& o, Index r0, Index m) const {
        if constexpr (!std::is_same_v<Out, float>)
            o.middleRows(r0, m) = out_.topRows(m).template cast<Out>();
    }

private:
    std::array<Matrix<float>, 6> in_;
    Matrix<float> out_;
};

}  // namespace memattn::detail
