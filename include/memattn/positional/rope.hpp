#pragma once
// Rotary position embeddings (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary
// Position Embedding"), applied in place to packed heads, with the scalings of long-context
// models (docs/design.md, "Rotary position embeddings").
//
//   const memattn::Rope rope{.theta = 500000, .head_dim = 128,
//                            .scaling = memattn::Rope::Yarn{.factor = 4, .original_max_positions = 8192}};
//   rope.apply(Q, positions);                    // each row's heads, at positions[row]
//   memattn::RopeTable<float> table(rope, 4096);  // cos/sin of positions 0..4095, cached
//   table.apply(K, positions);                    // the same bits as rope.apply
//
// Of a head's first r = rotary_dim columns (the rest pass unchanged: partial rotary, as
// GPT-NeoX's rotary_pct), pair i < r/2 turns by the angle p·ω_i at position p:
//
//   (x, y) ← (x cos(p·ω_i) − y sin(p·ω_i),  y cos(p·ω_i) + x sin(p·ω_i)) · a,
//
// the pair being columns (i, i + r/2) in the half-split layout (GPT-NeoX, Llama in
// Hugging Face's rotate_half) and (2i, 2i + 1) interleaved (GPT-J, the RoFormer paper,
// Meta's original Llama). The frequencies, ω_i = θ^(−2i/r) unscaled, and the attention
// factor a (1 except under YaRN):
//
//   Linear{s}   position interpolation (Chen et al. 2023): ω_i / s;
//   Ntk{s}      "NTK-aware" scaling (bloc97 2023): θ replaced by θ·s^(r/(r−2));
//   Yarn{s, L, β_fast, β_slow, mscale, truncate}  (Peng et al. 2023, "YaRN"): with the
//               correction dims c(β) = r·ln(L / (2πβ)) / (2 ln θ), lo = max(⌊c(β_fast)⌋, 0),
//               hi = min(⌈c(β_slow)⌉, r − 1) (truncate, the default; without it
//               lo = max(c(β_fast), 0), hi = min(c(β_slow), r − 1), fractional, as gpt-oss),
//               hi += 0.001 when equal, the ramp γ_i = clamp((i − lo)/(hi − lo), 0, 1) and
//               ω_i = θ^(−2i/r): ω'_i = ω_i/s · γ_i + ω_i · (1 − γ_i), and a = mscale, 0
//               meaning 0.1·ln(s) + 1 (1 for s ≤ 1) — Hugging Face's _compute_yarn_parameters
//               with its truncate, and attention_factor = mscale (docs/design.md gives the
//               mapping).
//
// Angles are computed in double (p·ω_i, then cos and sin, times a) and rounded to T once,
// then the pair turns in T: so a float row at position 10⁷ is as exact as at 10, and
// RopeTable's cached cos/sin give exactly the bits Rope::apply computes.

#include "memattn/detail/assert.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numbers>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace memattn {

/// Where a softmax memory with RoPE places the tokens it keeps (docs/design.md, "RoPE in
/// the memories"): at their positions in the sequence, or, StreamingLLM's rule (Xiao et
/// al. 2023, §3.2), at their positions in the cache — the kept tokens numbered
/// 0, 1, 2, ... in the order attend reads them, the query at the last (its own token's).
enum class RopePositions {
    sequence,  ///< each key turned to its token's position; the query to its own
    cache,     ///< each kept token at its place in the cache (SlidingWindowCache with sinks, HybridCache)
};

/// Rotary position embeddings: the configuration, and apply() in place; see the top of
/// the file. An aggregate: `Rope{.theta = 1e6, .head_dim = 128}`.
struct Rope {
    /// Which columns of a head make a pair.
    enum class Layout {
        half_split,   ///< (i, i + r/2): GPT-NeoX, Hugging Face's rotate_half
        interleaved,  ///< (2i, 2i + 1): GPT-J, RoFormer
    };
    /// No scaling: ω_i = θ^(−2i/r).
    struct None {};
    /// Position interpolation: every frequency divided by `factor`.
    struct Linear {
        double factor = 1;  ///< s ≥ 1 (1: no scaling)
    };
    /// NTK-aware scaling: θ replaced by θ·factor^(r/(r−2)).
    struct Ntk {
        double factor = 1;  ///< s ≥ 1 (1: no scaling)
    };
    /// YaRN: frequencies interpolated by a ramp between the correction dims, and an
    /// attention factor.
    struct Yarn {
        double factor = 1;                     ///< s ≥ 1: the context's extension
        Index original_max_positions = 4096;   ///< L: the context the model was trained on
        double beta_fast = 32;                 ///< rotations where interpolation stops
        double beta_slow = 1;                  ///< rotations where extrapolation stops
        double mscale = 0;                     ///< the attention factor a; 0: 0.1·ln(s) + 1
        /// Whether the correction range [lo, hi] is rounded out to whole dims (⌊lo⌋, ⌈hi⌉):
        /// true, Hugging Face's default (`truncate` absent or true in `rope_scaling`);
        /// false, the fractional range of gpt-oss (its config's `truncate: false`). Either
        /// way lo and hi are then clamped to [0, r − 1], as Hugging Face does.
        bool truncate = true;
    };
    /// One of the scalings.
    using Scaling = std::variant<None, Linear, Ntk, Yarn>;

    double theta = 10000;  ///< the base θ > 1
    Index head_dim = 0;    ///< columns of one head in a packed row (≥ 1)
    Index rotary_dim = 0;  ///< r: the first r columns of a head turn (even, ≤ head_dim); 0: all of them
    Layout layout = Layout::half_split;  ///< which columns make a pair
    Scaling scaling = None{};            ///< how the frequencies are scaled

    /// r: rotary_dim, or head_dim when 0.
    [[nodiscard]] Index rotated() const noexcept { return rotary_dim == 0 ? head_dim : rotary_dim; }

    /// Throws std::invalid_argument, naming `function` and the field, unless the
    /// configuration is valid.
    void check(std::string_view function = "Rope") const {
        detail::require(std::isfinite(theta) && theta > 1, function, "theta", "is ", theta, ", expected a number > 1");
        detail::require(head_dim >= 1, function, "head_dim", "is ", head_dim, ", expected >= 1");
        const Index r = rotated();
        detail::require(r >= 2 && r % 2 == 0 && r <= head_dim, function, "rotary_dim", "is ", rotary_dim,
                        ", expected an even number from 2 to head_dim = ", head_dim, " (0: head_dim)");
        const auto factor = [&](double s, const char* name) {
            detail::require(std::isfinite(s) && s >= 1, function, name, "is ", s, ", expected a number >= 1");
        };
        if (const auto* l = std::get_if<Linear>(&scaling))
            factor(l->factor, "scaling (Linear).factor");
        if (const auto* n = std::get_if<Ntk>(&scaling)) {
            factor(n->factor, "scaling (Ntk).factor");
            detail::require(r > 2, function, "rotary_dim", "is ", r, ", expected more than 2 for Ntk (θ·s^(r/(r−2)))");
        }
        if (const auto* y = std::get_if<Yarn>(&scaling)) {
            factor(y->factor, "scaling (Yarn).factor");
            detail::require(y->original_max_positions >= 1, function, "scaling (Yarn).original_max_positions", "is ",
                            y->original_max_positions, ", expected >= 1");
            detail::require(std::isfinite(y->beta_fast) && std::isfinite(y->beta_slow) && y->beta_slow > 0 &&
                                y->beta_fast > y->beta_slow,
                            function, "scaling (Yarn).beta_fast", "is ", y->beta_fast, " with beta_slow ",
                            y->beta_slow, ", expected beta_fast > beta_slow > 0");
            detail::require(std::isfinite(y->mscale) && y->mscale >= 0, function, "scaling (Yarn).mscale", "is ",
                            y->mscale, ", expected >= 0 (0: 0.1·ln(factor) + 1)");
        }
    }

    /// ω_i for i < r/2, after the scaling (checks the configuration).
    [[nodiscard]] std::vector<double> frequencies() const {
        check("Rope::frequencies");
        return scaled_frequencies();
    }

    /// frequencies() of a checked configuration.
    [[nodiscard]] std::vector<double> scaled_frequencies() const {
        const Index r = rotated(), half = r / 2;
        std::vector<double> w(static_cast<std::size_t>(half));
        double base = theta;
        if (const auto* n = std::get_if<Ntk>(&scaling))
            base = theta * std::pow(n->factor, static_cast<double>(r) / static_cast<double>(r - 2));
        for (Index i = 0; i < half; ++i)
            w[static_cast<std::size_t>(i)] = 1.0 / std::pow(base, static_cast<double>(2 * i) / static_cast<double>(r));
        if (const auto* l = std::get_if<Linear>(&scaling))
            for (double& f : w)
                f /= l->factor;
        if (const auto* y = std::get_if<Yarn>(&scaling)) {
            const auto correction = [&](double rotations) {
                return static_cast<double>(r) *
                       std::log(static_cast<double>(y->original_max_positions) / (rotations * 2 * std::numbers::pi)) /
                       (2 * std::log(theta));
            };
            double lo = correction(y->beta_fast), hi = correction(y->beta_slow);
            if (y->truncate) {
                lo = std::floor(lo);
                hi = std::ceil(hi);
            }
            lo = std::max(lo, 0.0);
            hi = std::min(hi, static_cast<double>(r - 1));
            if (lo == hi)
                hi += 0.001;
            for (Index i = 0; i < half; ++i) {
                const double ramp = std::clamp((static_cast<double>(i) - lo) / (hi - lo), 0.0, 1.0);
                double& f = w[static_cast<std::size_t>(i)];
                f = f / y->factor * ramp + f * (1 - ramp);
            }
        }
        return w;
    }

    /// a: the factor on cos and sin (YaRN's attention factor; 1 otherwise).
    [[nodiscard]] double attention_factor() const noexcept {
        const auto* y = std::get_if<Yarn>(&scaling);
        if (y == nullptr)
            return 1;
        if (y->mscale > 0)
            return y->mscale;
        return y->factor <= 1 ? 1.0 : 0.1 * std::log(y->factor) + 1.0;
    }

    /// Turns every head of row i of X (packed rows: X.cols() a multiple of head_dim) to
    /// position positions[i] (≥ 0), in place. Computes cos and sin as it goes (a
    /// RopeTable caches them); allocates only the r/2 frequencies.
    template <detail::EigenMatrix DX>
    void apply(DX&& X, std::span<const Index> positions) const {
        using T = typename std::remove_cvref_t<DX>::Scalar;
        static_assert(Scalar<T>, "memattn::Rope::apply: X must be float or double");
        MatrixRef<T> x = detail::output(std::forward<DX>(X));
        check_apply("Rope::apply", x.rows(), x.cols(), positions);
        const std::vector<double> w = scaled_frequencies();
        for (Index row = 0; row < x.rows(); ++row)
            turn_computed(x.row(row).data(), x.cols(), w, attention_factor(), positions[static_cast<std::size_t>(row)]);
    }

    /// cos and sin of p·ω_i, times a, rounded to T, for the pairs [i0, i0 + n): what
    /// apply multiplies by.
    template <class T>
    static void angles(const std::vector<double>& w, double a, Index p, std::size_t i0, std::size_t n, T* cs,
                       T* sn) noexcept {
        for (std::size_t i = 0; i < n; ++i) {
            const double angle = static_cast<double>(p) * w[i0 + i];
            cs[i] = static_cast<T>(a * std::cos(angle));
            sn[i] = static_cast<T>(a * std::sin(angle));
        }
    }

    /// Turns the pairs [i0, i0 + n) of every head of one packed row of `cols` columns by
    /// their cos/sin (cs[i − i0], sn[i − i0]).
    template <class T>
    void turn(T* row, Index cols, Index i0, Index n, const T* cs, const T* sn) const noexcept {
        const Index half = rotated() / 2;
        const bool split = layout == Layout::half_split;
        for (Index h = 0; h < cols; h += head_dim) {
            T* x = row + h;
            for (Index j = 0; j < n; ++j) {
                const Index i = i0 + j;
                T& u = x[split ? i : 2 * i];
                T& v = x[split ? i + half : 2 * i + 1];
                const T cu = u, cv = v;
                u = cu * cs[j] - cv * sn[j];
                v = cv * cs[j] + cu * sn[j];
            }
        }
    }

    /// Turns one packed row to position p, its cos/sin computed in pieces on the stack
    /// (no allocation), bit for bit as from a table.
    template <class T>
    void turn_computed(T* row, Index cols, const std::vector<double>& w, double a, Index p) const noexcept {
        constexpr std::size_t piece = 64;
        T cs[piece], sn[piece];
        for (std::size_t i0 = 0; i0 < w.size(); i0 += piece) {
            const std::size_t n = std::min(piece, w.size() - i0);
            angles(w, a, p, i0, n, cs, sn);
            turn(row, cols, static_cast<Index>(i0), static_cast<Index>(n), cs, sn);
        }
    }

    /// The checks of apply: a valid configuration, whole heads, a position ≥ 0 per row.
    void check_apply(std::string_view function, Index rows, Index cols, std::span<const Index> positions) const {
        check(function);
        detail::require(cols % head_dim == 0, function, "X", "has ", cols, " columns, expected a multiple of head_dim = ",
                        head_dim, " (packed heads)");
        detail::require(static_cast<Index>(positions.size()) == rows, function, "positions", "has ", positions.size(),
                        " entries, expected ", rows, " (one per row of X)");
        for (std::size_t i = 0; i < positions.size(); ++i)
            detail::require(positions[i] >= 0, function, "positions", "has ", positions[i], " at ", i,
                            ", expected positions >= 0");
    }
};

/// A Rope with the cos/sin of positions [0, length) cached (length·r values of T,
/// allocated when it is built or reserved): apply() reads them, and computes a position
/// past them as Rope::apply does, so the bits are Rope::apply's either way and a decode
/// step past the table allocates nothing.
template <Scalar T>
class RopeTable {
public:
    /// The table of `rope` (checked) for positions [0, length).
    explicit RopeTable(const Rope& rope, Index length = 0) : rope_(checked(rope)), w_(rope_.scaled_frequencies()) {
        reserve(length);
    }

    /// Caches positions [0, length) (allocates when it grows; never shrinks).
    void reserve(Index length) {
        detail::require(length >= 0, "RopeTable::reserve", "length", "is ", length, ", expected >= 0");
        if (length <= length_)
            return;
        const std::size_t half = w_.size();
        const std::size_t size = static_cast<std::size_t>(detail::checked_product(
            "RopeTable::reserve", "length", length, static_cast<Index>(half), "length x rotary_dim/2"));
        std::vector<T> cs(size), sn(size);
        const double a = rope_.attention_factor();
        for (Index p = 0; p < length; ++p)
            Rope::angles(w_, a, p, 0, half, cs.data() + static_cast<std::size_t>(p) * half,
                         sn.data() + static_cast<std::size_t>(p) * half);
        cos_.swap(cs);
        sin_.swap(sn);
        length_ = length;
    }

    /// Rope::apply(X, positions), bit for bit, with the cached cos/sin.
    template <detail::EigenMatrix DX>
    void apply(DX&& X, std::span<const Index> positions) const {
        static_assert(std::is_same_v<typename std::remove_cvref_t<DX>::Scalar, T>,
                      "memattn::RopeTable::apply: X must have the table's scalar type");
        MatrixRef<T> x = detail::output(std::forward<DX>(X));
        rope_.check_apply("RopeTable::apply", x.rows(), x.cols(), positions);
        const std::size_t half = w_.size();
        const double a = rope_.attention_factor();
        for (Index row = 0; row < x.rows(); ++row) {
            const Index p = positions[static_cast<std::size_t>(row)];
            if (p < length_) {
                const std::size_t at = static_cast<std::size_t>(p) * half;
                rope_.turn(x.row(row).data(), x.cols(), 0, static_cast<Index>(half), cos_.data() + at,
                           sin_.data() + at);
            } else {
                rope_.turn_computed(x.row(row).data(), x.cols(), w_, a, p);
            }
        }
    }

    /// Positions cached.
    [[nodiscard]] Index length() const noexcept { return length_; }
    /// The configuration.
    [[nodiscard]] const Rope& rope() const noexcept { return rope_; }
    /// Bytes of the cached cos/sin.
    [[nodiscard]] std::size_t footprint() const noexcept { return sizeof(T) * (cos_.capacity() + sin_.capacity()); }

private:
    static Rope checked(const Rope& rope) {
        rope.check("RopeTable");
        return rope;
    }

    Rope rope_;
    std::vector<double> w_;
    std::vector<T> cos_, sin_;
    Index length_ = 0;
};

}  // namespace memattn
