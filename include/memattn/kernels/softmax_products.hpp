#pragma once
// The two products of the tiled softmax kernel (kernels/softmax_tiles.hpp), one class per
// arithmetic, behind one interface:
//
//   Sᵀ = K_tile · (f·Q_tile)ᵀ          keys × query lanes, f = scale·log2(e) (base-2 logits)
//   acc = α ⊙ acc + P · V_tile          query lanes × dv, α per lane (SoftmaxBlockState)
//
// The kernel owns the tile loop, the logit options, the masks and the softmax; a product
// class owns how Q, K and V are laid out for its arithmetic and how the two products run:
//
//   FloatTileProducts<T, B>   T = float or double: tile_product's FMAs on Q_tileᵀ
//                             (transposed and scaled once per query tile) and on K and V
//                             rows as their source gives them (detail/tile_product.hpp);
//   Bf16TileProducts<B>       bfloat16 Q, K and V on AVX512-BF16: vdpbf16ps on the bits
//                             of K in place, Q_tileᵀ and each V tile packed as pairs along
//                             the depth, the weights rounded to bfloat16
//                             (detail/bf16_product.hpp; in a build without AVX512-BF16,
//                             compiled by target and run where the CPU has it);
//   AmxTileProducts<B>        the same layouts in AMX tiles where the CPU runs them.
//
// A product class P for the kernel's scalar T and register blocking B offers
//
//   P(scratch, d, dv)                    binds the buffers it keeps in the kernel's
//                                        SoftmaxScratch (sized on first use, reused)
//   P::extra_bytes(d, dv, lanes, keys)   the bytes of those buffers past SoftmaxScratch's
//   P::lane_multiple                     the query lanes it computes (cols below) are a
//                                        multiple of this (and of one of T's packets)
//   P::Rounding                          what SoftmaxBlockState::absorb does to a weight
//                                        before it sums it: the weights P·V multiplies
//   load_queries(Q, i0, rows, cols, f)   query rows [i0, i0 + rows), times f; lanes
//                                        [rows, cols) zero (cols: rows rounded up)
//   scores(K, j0, n, cols, s, band, ahead)
//                                        Sᵀ of keys [j0, j0 + n) into s (row stride: the
//                                        scratch's lanes); a band (LanesSeeingKeys) may
//                                        leave lanes outside it unwritten
//   accumulate(V, j0, n, cols, p, acc, α, zeros_matter, band, ahead, careful)
//                                        acc = α ⊙ acc + Pᵀ·V of keys [j0, j0 + n), p the
//                                        weights as Sᵀ; or, where a value is not finite
//                                        and a weight of 0 must stay 0 (zeros_matter: a
//                                        mask or a bias made some), nothing but
//                                        careful(values, ldv) on the tile's values in T
//
// and may offer
//
//   absorb(state, s, n, ld, cols, factor)
//                                        the tile's softmax in place of the kernel's
//                                        state.absorb(_scaled) (factor > 0: of factor·s):
//                                        its weights kept for the next accumulate, which
//                                        then takes p = s and reads them from there
//                                        (careful still finds the weights in s)
//
// Q, K and V are row sources (kernels/softmax_rows.hpp): tile(j0, n) gives rows of T, and
// sources whose `pairs` is true also give their bfloat16 bits (bits(j0, n): rows [j0, j0 + n)
// at the stride it returns, in place or put together by the source).
// TileProductsFor picks the class from the sources. A new arithmetic (AMX tiles) is a
// new class here, or in a file of its own that this one includes, plus its line in
// TileProductsFor: the tile loop does not change.

#include "memattn/cpu_features.hpp"
#include "memattn/detail/amx_product.hpp"
#include "memattn/detail/bf16_product.hpp"
#include "memattn/detail/bf16_weights.hpp"
#include "memattn/detail/packet.hpp"
#include "memattn/detail/tile_product.hpp"
#include "memattn/types.hpp"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

namespace memattn::detail {

/// Every value of the n rows at `values` (cols each, row stride ld) is finite: 0·x is 0,
/// or NaN for ±∞ and NaN, and a sum keeps NaN. A vectorised reduction (Eigen's allFinite
/// is a scalar loop here).
template <class T>
[[nodiscard]] bool finite_rows(const T* values, Index n, Index cols, Index ld) {
    const Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>> v(values, n, cols, Eigen::OuterStride<>(ld));
    return (v.array() * T(0)).sum() == T(0);
}

/// The products in T by tile_product (FMA), register blocking B.
template <class T, class B>
class FloatTileProducts {
public:
    using Rounding = std::identity;
    static constexpr Index lane_multiple = 1;

    template <class Scratch>
    FloatTileProducts(Scratch& scratch, Index, Index) : qt_(scratch.qt), lanes_(scratch.lanes) {}

    static constexpr std::size_t extra_bytes(Index, Index, Index, Index) { return 0; }

    /// f·Q_tileᵀ into the scratch's d × lanes block, zero past `rows` up to `cols`.
    template <class QRows>
    void load_queries(QRows& q, Index i0, Index rows, Index cols, T factor) {
        const auto [data, ldq] = q.tile(i0, rows);
        transpose(data, rows, q.cols(), ldq, qt_.data(), lanes_);
        qt_.leftCols(rows) *= factor;
        qt_.middleCols(rows, cols - rows).setZero();
    }

    template <class KRows, class Band>
    void scores(KRows& k, Index j0, Index n, Index cols, T* s, const Band& band, PrefetchQueue* ahead) {
        const auto [keys, ldk] = k.tile(j0, n);
        tile_product<T, B>(n, cols, k.cols(), keys, ldk, 1, qt_.data(), lanes_, s, lanes_, nullptr, band, ahead);
    }

    /// A(r, k) = Pᵀ(k, r) is read with strides (1, lanes). A masked tile's strips of
    /// queries skip (by the band) the keys none of them sees: their weights are 0, and
    /// x + 0·v is x for a finite v; 0·∞ is NaN, hence `careful` where a value is not.
    template <class VRows, class Band, class Careful>
    void accumulate(VRows& v, Index j0, Index n, Index cols, const T* p, T* acc, const T* alpha, bool zeros_matter,
                    const Band& band, PrefetchQueue* ahead, Careful&& careful) {
        const auto [values, ldv] = v.tile(j0, n);
        if (zeros_matter && !finite_rows(values, n, v.cols(), ldv))
            careful(values, ldv);
        else
            tile_product<T, B>(cols, v.cols(), n, p, 1, lanes_, values, ldv, acc, v.cols(), alpha, band, ahead);
    }

private:
    Matrix<T>& qt_;  // f·Q_tileᵀ, d × lanes
    Index lanes_;
};

/// The products in bfloat16 arithmetic by vdpbf16ps (AVX512-BF16), the accumulators in
/// float: K read in place as pairs along d, Q_tileᵀ and each V tile packed as pairs along
/// their depth, the weights rounded to bfloat16 and packed as pairs along the keys. A
/// value tile that is not all finite goes to `careful` converted to float, so a weight of
/// 0 never meets ∞ (the float arithmetic's behaviour exactly).
template <class B>
class Bf16TileProducts {
public:
    using Rounding = RoundToBf16;
    /// vdpbf16ps's packets are 16 lanes, loaded and stored whole along a lane row (the
    /// query pairs, the weights): wider than a portable build's float packets.
    static constexpr Index lane_multiple = 16;

    template <class Scratch>
    Bf16TileProducts(Scratch& scratch, Index d, Index dv)
        : lanes_(scratch.lanes), value_stride_(packed_value_stride(dv)), avx512_(avx512_runs()),
          bf16_(avx512_bf16_runs()) {
        const Index half_keys = (scratch.tiles.keys + 1) / 2;
        query_pairs_ = sized(scratch.query_pairs, (d + 1) / 2 * lanes_);
        weight_pairs_ = sized(scratch.weight_pairs, half_keys * lanes_);
        value_pairs_ = sized(scratch.value_pairs, packed_value_words(scratch.tiles.keys, dv));
    }

    static std::size_t extra_bytes(Index d, Index dv, Index lanes, Index keys) {
        const Index half_keys = (keys + 1) / 2;
        return sizeof(std::uint32_t) *
               static_cast<std::size_t>((d + 1) / 2 * lanes + half_keys * lanes + packed_value_words(keys, dv));
    }

    /// Q_tileᵀ as pairs along d, as the rows hold them; f multiplies the logits as the
    /// product stores them.
    template <class QRows>
    void load_queries(QRows& q, Index i0, Index rows, Index cols, float factor) {
        factor_ = factor;
        const Index d = q.cols(), whole = d / 2;
        Index first = 0;  // lanes below it written by whole blocks of 16
#if defined(MEMATTN_AVX512_CODE)
        // 16 queries × 16 pairs at a time, the words transposed in registers (the scalar
        // loop's stores, a lane apart, were 8% of a latent attend of 128 heads).
        for (; avx512_ && first + 16 <= rows; first += 16) {
            const std::uint16_t* from[16];
            for (Index r = 0; r < 16; ++r)
                from[r] = q.bits(i0 + first + r).first;
            const Index k0 = transpose_pairs(from, whole, query_pairs_ + first, lanes_);
            for (Index i = first; i < first + 16; ++i) {
                const std::uint16_t* row = q.bits(i0 + i).first;
                for (Index k = k0; k < whole; ++k)
                    query_pairs_[k * lanes_ + i] = load_pair(row + 2 * k);
                if (d % 2 == 1)
                    query_pairs_[whole * lanes_ + i] = row[d - 1];
            }
        }
#endif
        for (Index i = first; i < cols; ++i) {
            if (i >= rows) {
                for (Index k = 0; k < (d + 1) / 2; ++k)
                    query_pairs_[k * lanes_ + i] = 0;
                continue;
            }
            const std::uint16_t* row = q.bits(i0 + i).first;
            for (Index k = 0; k < whole; ++k)
                query_pairs_[k * lanes_ + i] = load_pair(row + 2 * k);
            if (d % 2 == 1)
                query_pairs_[whole * lanes_ + i] = row[d - 1];
        }
    }

    template <class KRows, class Band>
    void scores(KRows& k, Index j0, Index n, Index cols, float* s, const Band& band, PrefetchQueue* ahead) {
        const auto [keys, ldk] = k.bits(j0, n);
        bf16_product<B>(n, cols, k.cols(), keys, ldk, 2, query_pairs_, lanes_, s, lanes_, nullptr, factor_, band,
                        ahead);
    }

    /// The softmax of a tile of logits s (n keys × cols lanes, row stride ld; factor > 0:
    /// of factor·s, absorb_scaled): its weights rounded and packed as pairs along the keys
    /// as they are computed (detail/bf16_weights.hpp: absorb_packed, compiled by target in
    /// a portable build) where the CPU has AVX512-BF16, s left as it is; else absorbed
    /// into s, for accumulate to pack.
    template <class State>
    void absorb(State& state, float* s, Index n, Index ld, Index cols, float factor) {
        absorb_as<WeightLayout::pairs>(state, s, n, ld, cols, factor, lanes_);
    }

    template <class VRows, class Band, class Careful>
    void accumulate(VRows& v, Index j0, Index n, Index cols, const float* p, float* acc, const float* alpha, bool,
                    const Band& band, PrefetchQueue* ahead, Careful&& careful) {
        const Index dv = v.cols();
        const std::uint32_t* pairs = pack_values(v, j0, n);
        if (pairs == nullptr) {
            unpack_packed(WeightLayout::pairs, weight_pairs_, lanes_, n, cols);
            const auto [converted, ldc] = v.tile(j0, n);
            careful(converted, ldc);
            return;
        }
        MEMATTN_DASSERT(packed_in_ == nullptr || packed_in_ == p);  // the tile absorb packed
        if (packed_in_ == nullptr)
            pack_weight_pairs(p, n, cols, lanes_, weight_pairs_);
        const auto* weights = reinterpret_cast<const std::uint16_t*>(weight_pairs_);
        bf16_product<B, true>(cols, dv, n, weights, 2, 2 * lanes_, pairs, value_stride_, acc, dv, alpha, 1.0f, band,
                              ahead);
    }

protected:
    /// Value tile [j0, j0 + n) as pairs along the keys: those the row source keeps
    /// (packed_tile: packed by the first product that asks), else packed into the scratch;
    /// null where a value is not finite.
    template <class VRows>
    const std::uint32_t* pack_values(VRows& v, Index j0, Index n) {
        std::uint32_t* out = value_pairs_;
        std::uint8_t* state = nullptr;
        if constexpr (requires { v.packed_tile(j0, n); }) {
            const PackedValueTile kept = v.packed_tile(j0, n);
            if (kept.words != nullptr) {
                if (*kept.state != 0)
                    return *kept.state == 1 ? kept.words : nullptr;
                out = kept.words;
                state = kept.state;
            }
        }
        const auto [values, ldv] = v.bits(j0, n);
        const bool finite = pack_row_pairs(values, n, v.cols(), ldv, out, value_stride_, bf16_);
        if (state != nullptr)
            *state = finite ? 1 : 2;
        return finite ? out : nullptr;
    }

    /// absorb with the weights packed in Layout at word stride ldw where the CPU has
    /// AVX512-BF16 (absorb_packed), else absorbed into s.
    template <WeightLayout Layout, class State>
    void absorb_as(State& state, float* s, Index n, Index ld, Index cols, float factor, [[maybe_unused]] Index ldw) {
        packed_in_ = nullptr;
#if defined(MEMATTN_AVX512_BF16_CODE)
        if (bf16_) {
            const auto rows = state.lane_rows();
            absorb_packed<Layout>(s, n, ld, cols, factor, rows.max, rows.sum, rows.alpha, weight_pairs_, ldw);
            packed_in_ = s;
            return;
        }
#endif
        if (factor > 0.0f)
            state.absorb_scaled(s, n, ld, cols, factor, RoundToBf16{});
        else
            state.absorb(s, n, ld, cols, RoundToBf16{});
    }

    /// Weights that absorb packed, back as floats into their tile of logits (for careful).
    void unpack_packed(WeightLayout layout, const std::uint32_t* words, Index ldw, Index n, Index cols) {
        if (packed_in_ != nullptr)
            unpack_weights(layout, words, ldw, n, cols, packed_in_, lanes_);
    }

    /// A scratch vector of at least n words: its data.
    static std::uint32_t* sized(std::vector<std::uint32_t>& v, Index n) {
        if (static_cast<Index>(v.size()) < n)
            v.resize(static_cast<std::size_t>(n));
        return v.data();
    }

    Index lanes_, value_stride_;  // value_stride_: a packed value row, in words
    float factor_ = 1;
    std::uint32_t* query_pairs_ = nullptr;
    std::uint32_t* weight_pairs_ = nullptr;
    std::uint32_t* value_pairs_ = nullptr;
    bool avx512_, bf16_;  // avx512_runs(), avx512_bf16_runs()
    float* packed_in_ = nullptr;  // the tile whose weights absorb packed, not stored into it
};

/// The products in AMX tiles (tdpbf16ps, detail/amx_product.hpp) where they run, else
/// Bf16TileProducts' vdpbf16ps: the same packing of Q_tileᵀ and each value tile as pairs
/// along their depth, K read in place as A rows (an even d: an odd one takes vdpbf16ps),
/// the weights rounded to bfloat16 as Bf16TileProducts rounds them and packed as A rows of
/// pairs per query lane (by absorb as they are computed, detail/bf16_weights.hpp, where
/// the CPU has AVX512-BF16; else by pack_weight_rows). Per product: Sᵀ =
/// K·(Q_tileᵀ pairs) into the logits, then times f; acc = α ⊙ acc (rows scaled first) +
/// weights·value pairs. The tiles run where cpu_features().amx_usable() (Tiles =
/// AmxHardware), or always (Tiles = AmxEmulated: the tests' stand-in on any CPU).
template <class B, class Tiles = AmxHardware>
class AmxTileProducts : public Bf16TileProducts<B> {
    using Base = Bf16TileProducts<B>;

public:
    using Rounding = RoundToBf16;

    template <class Scratch>
    AmxTileProducts(Scratch& scratch, Index d, Index dv) : Base(scratch, d, dv), tiles_(d % 2 == 0 && runs()) {
        half_keys_ = (scratch.tiles.keys + 1) / 2;
    }

    /// Whether the tiles run here: always emulated; on hardware where the CPU and OS allow.
    static bool runs() noexcept {
        if constexpr (std::is_same_v<Tiles, AmxEmulated>)
            return true;
        else
            return Tiles::available && cpu_features().amx_usable() && request_amx();
    }
    /// Whether this product's calls run in tiles (else vdpbf16ps).
    [[nodiscard]] bool tiles() const noexcept { return tiles_; }

    template <class KRows, class Band>
    void scores(KRows& k, Index j0, Index n, Index cols, float* s, const Band& band, PrefetchQueue* ahead) {
        if (!tiles_) {
            fallback_scores(k, j0, n, cols, s, band, ahead);
            return;
        }
        const auto [keys, ldk] = k.bits(j0, n);
        amx_product<Tiles>(n, cols, k.cols() / 2, keys, ldk, this->query_pairs_, this->lanes_, s, this->lanes_, false);
        Eigen::Map<Matrix<float>, 0, Eigen::OuterStride<>>(s, n, cols, Eigen::OuterStride<>(this->lanes_)) *=
            this->factor_;
        issue(ahead);
    }

    /// scores() over the whole tile, leaving the factor f to the softmax where the tiles
    /// run and f > 0 (SoftmaxBlockState::absorb_scaled: the same bits without a pass of
    /// vector loads over the tile the tiles just stored): f, or 0 where it was applied.
    template <class KRows>
    float scores_leaving_factor(KRows& k, Index j0, Index n, Index cols, float* s, PrefetchQueue* ahead) {
        if (!tiles_ || !(this->factor_ > 0.0f)) {
            scores(k, j0, n, cols, s, WholeStrip{}, ahead);
            return 0.0f;
        }
        const auto [keys, ldk] = k.bits(j0, n);
        amx_product<Tiles>(n, cols, k.cols() / 2, keys, ldk, this->query_pairs_, this->lanes_, s, this->lanes_, false);
        issue(ahead);
        return this->factor_;
    }

    /// Bf16TileProducts::absorb, the weights packed as A rows where the tiles run (where
    /// the CPU has AVX512-BF16 too, as every CPU with AMX-BF16 so far; else absorbed into
    /// s, for accumulate to pack).
    template <class State>
    void absorb(State& state, float* s, Index n, Index ld, Index cols, float factor) {
        if (tiles_)
            this->template absorb_as<WeightLayout::rows>(state, s, n, ld, cols, factor, half_keys_);
        else
            Base::absorb(state, s, n, ld, cols, factor);
    }

    template <class VRows, class Band, class Careful>
    void accumulate(VRows& v, Index j0, Index n, Index cols, const float* p, float* acc, const float* alpha,
                    bool zeros_matter, const Band& band, PrefetchQueue* ahead, Careful&& careful) {
        if (!tiles_) {
            fallback_accumulate(v, j0, n, cols, p, acc, alpha, zeros_matter, band, ahead, careful);
            return;
        }
        const Index dv = v.cols();
        const std::uint32_t* pairs = this->pack_values(v, j0, n);
        if (pairs == nullptr) {
            this->unpack_packed(WeightLayout::rows, this->weight_pairs_, half_keys_, n, cols);
            const auto [converted, ldc] = v.tile(j0, n);
            careful(converted, ldc);
            return;
        }
        MEMATTN_DASSERT(this->packed_in_ == nullptr || this->packed_in_ == p);  // the tile absorb packed
        if (this->packed_in_ == nullptr)
            pack_weight_rows(p, n, cols, this->lanes_, this->weight_pairs_, half_keys_, this->avx512_);
        if (alpha != nullptr)  // a lane whose maximum stayed (α = 1, most of them past the first tiles) as it is
            for (Index i = 0; i < cols; ++i)
                if (alpha[i] != 1.0f)
                    Eigen::Map<Eigen::ArrayXf>(acc + i * dv, dv) *= alpha[i];
        amx_product<Tiles>(cols, dv, (n + 1) / 2, reinterpret_cast<const std::uint16_t*>(this->weight_pairs_),
                           2 * half_keys_, pairs, this->value_stride_, acc, dv, alpha != nullptr);
        issue(ahead);
    }

private:
    /// The next tile's rows asked for after the product (the strips of the FMA products
    /// spread them; a tile product has no strips).
    static void issue(PrefetchQueue* ahead) {
        if (ahead != nullptr)
            while (ahead->pending() > 0)
                ahead->step();
    }
    template <class... Args>
    void fallback_scores(Args&&... args) {
        if constexpr (avx512_bf16_code)
            Base::scores(std::forward<Args>(args)...);
        else
            MEMATTN_DASSERT(false);  // tiles_ is true wherever vdpbf16ps is missing and this runs
    }
    template <class... Args>
    void fallback_accumulate(Args&&... args) {
        if constexpr (avx512_bf16_code)
            Base::accumulate(std::forward<Args>(args)...);
        else
            MEMATTN_DASSERT(false);
    }

    bool tiles_;
    Index half_keys_ = 0;  // a packed weight row, in words
};

/// The products for sources Q, K, V of T: bfloat16 arithmetic where all three give
/// bfloat16 pairs (ConvertedRows<Eigen::bfloat16> on AVX512-BF16), in AMX tiles where the
/// CPU runs them, else by vdpbf16ps; T's otherwise.
template <class T, class B, class QRows, class KRows, class VRows>
using TileProductsFor = std::conditional_t<QRows::pairs && KRows::pairs && VRows::pairs, AmxTileProducts<B>,
                                           FloatTileProducts<T, B>>;

}  // namespace memattn::detail
