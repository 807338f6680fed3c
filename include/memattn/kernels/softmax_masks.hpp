#pragma once
// What the tiled softmax kernel (kernels/causal_softmax.hpp) adds to the logits tile by
// tile beyond the options: a dense bias or boolean mask (DenseBias), none (NoBias), and
// the tree of draft tokens of SoftmaxOptions::parents (TreeMask), behind TileBias.

#include "memattn/detail/tile_product.hpp"
#include "memattn/kernels/softmax_options.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace memattn::detail {

/// A bias added to the logits tile by tile (a dense bias or boolean mask, a tree of
/// draft tokens): fill(context, i0, rows, j0, n, out, ld) writes, for the queries
/// [i0, i0 + rows) of the call and the keys [j0, j0 + n), out[i·ld + jj] = the bias of
/// (i0 + i, j0 + jj) in natural units, −∞ where the key is masked (query-major, as the
/// caller's matrix: the kernel transposes it in registers), and says what the tile holds
/// (TileCover): a tile it masks wholly is skipped, one it leaves open (a mask's tile of
/// visible keys, the tree's past) is computed as without a bias; for those two it need
/// write nothing.
enum class TileCover {
    open,    ///< every value 0: nothing to add
    some,    ///< anything else
    closed,  ///< every value −∞: every key masked for every query
};

template <class T>
struct TileBias {
    using Fill = TileCover (*)(const void* context, Index i0, Index rows, Index j0, Index n, T* out, Index ld);
    Fill fill = nullptr;           ///< none: no bias
    const void* context = nullptr;  ///< what fill reads
    /// A bias of T stored row-major: its query 0's row and the row stride, which the
    /// kernel transposes straight into its key-major tile (fill's copy skipped: it was
    /// 13% of a call with a 4096² bias, d = 64); null otherwise.
    const T* rows = nullptr;
    Index stride = 0;
    /// The lowest key past the sinks that any of the call's queries [i0, i0 + rows) can
    /// see, where the bias knows more than the kernel's causal rule and window (a tree's
    /// window counts its own positions): the kernel walks no lower, but for the sinks.
    /// None: the kernel's rule alone.
    using First = Index (*)(const void* context, Index i0, Index rows);
    First first = nullptr;
    explicit operator bool() const noexcept { return fill != nullptr; }
};

/// A dense bias of the scalar type or a bool mask (any Eigen expression), its row
/// `row0` the call's query 0: TileBias's fill reads its blocks in place.
template <class DB>
struct DenseBias {
    const DB* bias;
    Index row0;

    /// The TileBias reading this (which must outlive the call).
    template <class T>
    [[nodiscard]] TileBias<T> tile() const noexcept {
        if constexpr (std::is_same_v<typename DB::Scalar, T> && bool(DB::Flags & Eigen::DirectAccessBit) &&
                      bool(DB::Flags & Eigen::RowMajorBit)) {
            if (bias->innerStride() == 1)  // not a row of a column-major matrix, say
                return {&fill<T>, this, bias->data() + row0 * bias->outerStride(), bias->outerStride()};
        }
        return {&fill<T>, this};
    }

    template <class T>
    static TileCover fill(const void* context, Index i0, Index rows, Index j0, Index n, T* out, Index ld) {
        const DenseBias& self = *static_cast<const DenseBias*>(context);
        const DB& b = *self.bias;
        i0 += self.row0;
        if constexpr (std::is_same_v<typename DB::Scalar, bool>) {
            // A mask's tile is written only when it masks some of its keys and not all:
            // the visible count tells which, from the bools alone.
            bool all = true, none = true;
            bool counted = false;
            if constexpr (bool(DB::Flags & Eigen::DirectAccessBit) && bool(DB::Flags & Eigen::RowMajorBit) &&
                          sizeof(bool) == 1) {
                if (b.innerStride() == 1) {  // not a row of a column-major matrix, say
                    // Rows in place, eight bools a word (a bool is the byte 0 or 1): one
                    // comparison per word instead of a branch per byte.
                    constexpr std::uint64_t ones = 0x0101010101010101u;
                    for (Index i = 0; i < rows; ++i) {
                        const bool* src = b.data() + (i0 + i) * b.outerStride() + j0;
                        // The next key tile's bools of this row, asked for now (the kernel
                        // walks key tiles down from the diagonal): a mask's rows lie a row of
                        // keys apart, too many streams for the hardware's prefetchers
                        // (measured: fill was a third of a masked call, in load stalls).
                        prefetch_rows(src - std::min(j0, n), 1, 0, std::min(j0, n));
                        if (!(all || none))
                            continue;
                        Index jj = 0;
                        for (; jj + 8 <= n; jj += 8) {
                            std::uint64_t word;
                            std::memcpy(&word, src + jj, 8);
                            all &= word == ones;
                            none &= word == 0;
                        }
                        for (; jj < n; ++jj) {
                            all &= src[jj];
                            none &= !src[jj];
                        }
                    }
                    counted = true;
                }
            }
            if (!counted)
                for (Index i = 0; i < rows; ++i)
                    for (Index jj = 0; jj < n; ++jj) {
                        const bool seen = b.coeff(i0 + i, j0 + jj);
                        all &= seen;
                        none &= !seen;
                    }
            if (all)
                return TileCover::open;
            if (none)
                return TileCover::closed;
            constexpr T masked = -std::numeric_limits<T>::infinity();
            for (Index i = 0; i < rows; ++i)
                for (Index jj = 0; jj < n; ++jj)
                    out[i * ld + jj] = b.coeff(i0 + i, j0 + jj) ? T(0) : masked;
            return TileCover::some;
        } else {
            Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>>(out, rows, n, Eigen::OuterStride<>(ld)) =
                b.block(i0, j0, rows, n);
            return TileCover::some;
        }
    }
};

/// No bias: for the calls that take one where they may.
struct NoBias {
    template <class T>
    [[nodiscard]] TileBias<T> tile() const noexcept {
        return {};
    }
    NoBias operator()(Index, Index) const noexcept { return {}; }
};

/// Which of a tree's new tokens each new token sees: its ancestors and itself
/// (SoftmaxOptions::parents), as one bit row per token; and where each sits. New token i
/// sits at position past + depth_i (depth: its ancestors, a root's 0), where decoding
/// its path token by token puts it, and a window, the sinks and ALiBi count those
/// positions (Positions): its row past + i is off_i = i − depth_i further on. The kernel
/// runs without a window for a tree (its rows' distances are larger than the positions'),
/// and the tree's fill masks what the window hides and adds ALiBi's correction for the
/// offsets, slope·(off_i − off_j) (the kernel's ALiBi counts rows), so a chain, whose
/// offsets are 0, is a prompt bit for bit.
class TreeMask {
public:
    /// What counts the tree's positions: the window (0: none), the sink tokens and the
    /// ALiBi slope (0: none) of the call.
    struct Positions {
        Index window = 0, sinks = 0;
        double slope = 0;
    };
    /// parents[i] < i (or −1) for each of the n new tokens; `past` keys come before them.
    TreeMask(std::span<const Index> parents, Index past, Positions positions)
        : n_(static_cast<Index>(parents.size())), words_((n_ + 63) / 64), past_(past), positions_(positions),
          sink_rows_(positions.sinks), bits_(static_cast<std::size_t>(n_ * words_), 0) {
        if (positioned())
            depth_.resize(static_cast<std::size_t>(n_));
        for (Index i = 0; i < n_; ++i) {
            std::uint64_t* row = bits_.data() + i * words_;
            const Index p = parents[static_cast<std::size_t>(i)];
            if (p >= 0)
                std::copy(bits_.data() + p * words_, bits_.data() + (p + 1) * words_, row);
            row[i / 64] |= std::uint64_t{1} << (i % 64);
            if (positioned()) {
                depth_[static_cast<std::size_t>(i)] = p >= 0 ? depth_[static_cast<std::size_t>(p)] + 1 : 0;
                if (past_ + depth(i) < positions_.sinks)  // a sink, in a row past the sinks' rows
                    sink_rows_ = std::max(sink_rows_, past_ + i + 1);
            }
        }
    }
    /// The rows that hold sink tokens: the first `sinks`, and past them the rows of the
    /// drafts whose positions are below the sinks (a tree that starts among them).
    [[nodiscard]] Index sink_rows() const noexcept { return sink_rows_; }
    /// New token i sees new token j.
    [[nodiscard]] bool sees(Index i, Index j) const noexcept {
        return (bits_[static_cast<std::size_t>(i * words_ + j / 64)] >> (j % 64)) & 1u;
    }
    /// Whether a window or ALiBi counts the tree's positions (else rows and positions
    /// differ in nothing the call sees).
    [[nodiscard]] bool positioned() const noexcept { return positions_.window > 0 || positions_.slope != 0; }
    /// The tile bias of the call's queries first, first + 1, ... (new tokens).
    struct View {
        const TreeMask* tree;
        Index first;
    };
    template <class T>
    static TileCover fill(const void* context, Index i0, Index rows, Index j0, Index n, T* out, Index ld) {
        const View& view = *static_cast<const View*>(context);
        const TreeMask& tree = *view.tree;
        const Index past = tree.past_;
        constexpr T masked = -std::numeric_limits<T>::infinity();
        if (!tree.positioned()) {
            if (j0 + n <= past)
                return TileCover::open;  // the cached past: every new token sees it
            for (Index i = 0; i < rows; ++i) {
                T* row = out + i * ld;
                for (Index jj = 0; jj < n; ++jj) {
                    const Index j = j0 + jj - past;
                    row[jj] = j < 0 || tree.sees(view.first + i0 + i, j) ? T(0) : masked;
                }
            }
            return TileCover::some;
        }
        const Positions& at = tree.positions_;
        if (j0 + n <= past) {  // the cached past: open where every query's window holds it, no offset
            bool open = true;
            for (Index i = 0; i < rows && open; ++i) {
                const Index a = view.first + i0 + i, depth = tree.depth(a);
                open = (at.slope == 0 || depth == a) &&
                       (at.window == 0 || j0 + n <= at.sinks || past + depth - j0 < at.window);
            }
            if (open)
                return TileCover::open;
        }
        for (Index i = 0; i < rows; ++i) {
            const Index a = view.first + i0 + i, position = past + tree.depth(a), off = a - tree.depth(a);
            T* row = out + i * ld;
            for (Index jj = 0; jj < n; ++jj) {
                const Index j = j0 + jj, t = j - past;
                const bool drafted = t >= 0;  // key j is new token t
                const Index key = drafted ? past + tree.depth(t) : j;
                const bool seen = !drafted || (t <= a && tree.sees(a, t));
                const bool in_window = at.window == 0 || key < at.sinks || position - key < at.window;
                row[jj] = !(seen && in_window) ? masked
                          : at.slope == 0     ? T(0)
                                              : static_cast<T>(at.slope * static_cast<double>(off - (drafted ? t - tree.depth(t) : 0)));
            }
        }
        return TileCover::some;
    }
    /// TileBias::first: the lowest key past the sink rows (sink_rows) the queries [i0, i0 +
    /// rows) of the call see: their shallowest one's window's first (0 without a window).
    static Index first(const void* context, Index i0, Index rows) {
        const View& view = *static_cast<const View*>(context);
        const TreeMask& tree = *view.tree;
        const Positions& at = tree.positions_;
        if (at.window == 0 || rows <= 0)
            return 0;
        Index shallowest = tree.depth(view.first + i0);
        for (Index i = 1; i < rows; ++i)
            shallowest = std::min(shallowest, tree.depth(view.first + i0 + i));
        return std::max<Index>(0, tree.past_ + shallowest - at.window + 1);
    }
    /// The TileBias of `view` (which must outlive the call).
    template <class T>
    [[nodiscard]] static TileBias<T> tile(const View& view) noexcept {
        TileBias<T> bias{&fill<T>, &view};
        if (view.tree->positioned())
            bias.first = &first;
        return bias;
    }

private:
    /// New token i's depth in the tree (its ancestors), when positioned.
    [[nodiscard]] Index depth(Index i) const noexcept { return depth_[static_cast<std::size_t>(i)]; }

    Index n_, words_, past_;
    Positions positions_;
    Index sink_rows_;
    std::vector<std::uint64_t> bits_;
    std::vector<Index> depth_;  // positioned trees only
};

}  // namespace memattn::detail
