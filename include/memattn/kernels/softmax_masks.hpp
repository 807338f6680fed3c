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
/// (SoftmaxOptions::parents), as one bit row per token.
class TreeMask {
public:
    /// parents[i] < i (or −1) for each of the n new tokens; `past` keys come before them.
    TreeMask(std::span<const Index> parents, Index past)
        : n_(static_cast<Index>(parents.size())), words_((n_ + 63) / 64), past_(past),
          bits_(static_cast<std::size_t>(n_ * words_), 0) {
        for (Index i = 0; i < n_; ++i) {
            std::uint64_t* row = bits_.data() + i * words_;
            if (const Index p = parents[static_cast<std::size_t>(i)]; p >= 0)
                std::copy(bits_.data() + p * words_, bits_.data() + (p + 1) * words_, row);
            row[i / 64] |= std::uint64_t{1} << (i % 64);
        }
    }
    /// New token i sees new token j.
    [[nodiscard]] bool sees(Index i, Index j) const noexcept {
        return (bits_[static_cast<std::size_t>(i * words_ + j / 64)] >> (j % 64)) & 1u;
    }
    /// The tile bias of the call's queries first, first + 1, ... (new tokens).
    struct View {
        const TreeMask* tree;
        Index first;
    };
    template <class T>
    static TileCover fill(const void* context, Index i0, Index rows, Index j0, Index n, T* out, Index ld) {
        const View& view = *static_cast<const View*>(context);
        const TreeMask& tree = *view.tree;
        if (j0 + n <= tree.past_)
            return TileCover::open;  // the cached past: every new token sees it
        for (Index i = 0; i < rows; ++i) {
            T* row = out + i * ld;
            for (Index jj = 0; jj < n; ++jj) {
                const Index j = j0 + jj - tree.past_;
                row[jj] = j < 0 || tree.sees(view.first + i0 + i, j) ? T(0) : -std::numeric_limits<T>::infinity();
            }
        }
        return TileCover::some;
    }

private:
    Index n_, words_, past_;
    std::vector<std::uint64_t> bits_;
};

}  // namespace memattn::detail
