// memattn::Rope and RopeTable: against the rotation written from the formulas of the
// RoFormer, GPT-NeoX / GPT-J layouts, position interpolation, NTK-aware scaling and YaRN
// in long double, at positions up to 2^31; YaRN's fractional range against gpt-oss's
// formula; relative positions; the table bit for bit.

#include "support.hpp"

#include <memattn/memory/kv_cache.hpp>
#include <memattn/persistence/snapshot.hpp>
#include <memattn/positional/rope.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

using namespace memattn;
using namespace memattn::test;

namespace {

using Long = long double;

/// ω_i written from the papers (long double), independently of Rope::frequencies.
std::vector<Long> reference_frequencies(const Rope& rope) {
    const Index r = rope.rotary_dim == 0 ? rope.head_dim : rope.rotary_dim;
    Long base = rope.theta;
    if (const auto* n = std::get_if<Rope::Ntk>(&rope.scaling))  // bloc97: base·α^(d/(d−2))
        base *= std::pow(static_cast<Long>(n->factor), static_cast<Long>(r) / static_cast<Long>(r - 2));
    std::vector<Long> w;
    for (Index i = 0; i < r / 2; ++i)
        w.push_back(std::pow(base, -static_cast<Long>(2 * i) / static_cast<Long>(r)));
    if (const auto* l = std::get_if<Rope::Linear>(&rope.scaling))  // Chen et al.: positions / s
        for (Long& f : w)
            f /= l->factor;
    if (const auto* y = std::get_if<Rope::Yarn>(&rope.scaling)) {  // Peng et al., as Hugging Face computes it
        const auto dim = [&](Long rotations) {
            return r * std::log(y->original_max_positions / (rotations * 2 * std::numbers::pi_v<Long>)) /
                   (2 * std::log(static_cast<Long>(rope.theta)));
        };
        Long low = dim(y->beta_fast), high = dim(y->beta_slow);
        if (y->truncate) {  // find_correction_range's truncate (true unless the config says false)
            low = std::floor(low);
            high = std::ceil(high);
        }
        low = std::max<Long>(low, 0);
        high = std::min<Long>(high, r - 1);
        if (low == high)
            high += 0.001L;
        for (Index i = 0; i < r / 2; ++i) {
            const Long linear = (i - low) / (high - low);
            const Long extrapolation_factor = 1 - std::clamp<Long>(linear, 0, 1);
            const Long extrapolation = w[static_cast<std::size_t>(i)], interpolation = extrapolation / y->factor;
            w[static_cast<std::size_t>(i)] =
                interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
        }
    }
    return w;
}

/// The rotated rows in long double.
Eigen::Matrix<Long, Eigen::Dynamic, Eigen::Dynamic> reference_apply(const Rope& rope, const MatrixD& X,
                                                                     const std::vector<Index>& positions) {
    const Index r = rope.rotary_dim == 0 ? rope.head_dim : rope.rotary_dim, d = rope.head_dim;
    const std::vector<Long> w = reference_frequencies(rope);
    Long a = 1;
    if (const auto* y = std::get_if<Rope::Yarn>(&rope.scaling))
        a = y->mscale > 0 ? static_cast<Long>(y->mscale) : 0.1L * std::log(static_cast<Long>(y->factor)) + 1;
    Eigen::Matrix<Long, Eigen::Dynamic, Eigen::Dynamic> out = X.cast<Long>();
    for (Index row = 0; row < X.rows(); ++row)
        for (Index h = 0; h < X.cols() / d; ++h)
            for (Index i = 0; i < r / 2; ++i) {
                const Index a_col = h * d + (rope.layout == Rope::Layout::half_split ? i : 2 * i);
                const Index b_col = h * d + (rope.layout == Rope::Layout::half_split ? i + r / 2 : 2 * i + 1);
                const Long angle = positions[static_cast<std::size_t>(row)] * w[static_cast<std::size_t>(i)];
                const Long x = X(row, a_col), y = X(row, b_col);
                out(row, a_col) = a * (x * std::cos(angle) - y * std::sin(angle));
                out(row, b_col) = a * (y * std::cos(angle) + x * std::sin(angle));
            }
    return out;
}

template <class T>
void check_against_reference(const Rope& rope, Index heads, const std::vector<Index>& positions, double tolerance) {
    const Index n = static_cast<Index>(positions.size());
    Matrix<T> X = random_matrix<T>(n, heads * rope.head_dim, 7);
    const MatrixD before = X.template cast<double>();
    rope.apply(X, positions);
    const auto expected = reference_apply(rope, before, positions);
    for (Index i = 0; i < n; ++i) {
        // The angle p·ω is a double: its rounding, p·ω·2^−53 with ω ≤ 1, is the error a
        // position past 10⁸ cannot avoid (in float it stays below the rounding of cos/sin
        // until p ≈ 5·10⁸).
        const double p = static_cast<double>(positions[static_cast<std::size_t>(i)]);
        const double bound = tolerance + 4 * rope.attention_factor() * p * 0x1p-53;
        for (Index c = 0; c < X.cols(); ++c) {
            INFO("row " << i << " (position " << positions[static_cast<std::size_t>(i)] << "), column " << c);
            CHECK(static_cast<double>(std::abs(static_cast<Long>(X(i, c)) - expected(i, c))) <= bound);
        }
    }
}

/// gpt-oss's rotary (gpt_oss/torch/model.py, _compute_concentration_and_inv_freq), in
/// double from its formulas: the correction range [low, high] not rounded, a mask of
/// extrapolation from the ramp. ntk_beta is β_fast, ntk_alpha β_slow.
struct GptOssRotary {
    std::vector<double> inv_freq;
    double concentration = 1, low = 0, high = 0;
};

GptOssRotary gpt_oss_rotary(Index head_dim, double base, double factor, double context, double ntk_alpha,
                            double ntk_beta) {
    GptOssRotary g;
    const double d_half = static_cast<double>(head_dim) / 2;
    g.concentration = 0.1 * std::log(factor) + 1.0;
    g.low = d_half * std::log(context / (ntk_beta * 2 * std::numbers::pi)) / std::log(base);
    g.high = d_half * std::log(context / (ntk_alpha * 2 * std::numbers::pi)) / std::log(base);
    for (Index i = 0; 2 * i < head_dim; ++i) {
        const double freq = std::pow(base, static_cast<double>(2 * i) / static_cast<double>(head_dim));
        const double interpolation = 1.0 / (factor * freq), extrapolation = 1.0 / freq;
        const double ramp = (static_cast<double>(i) - g.low) / (g.high - g.low);
        const double mask = 1 - std::clamp(ramp, 0.0, 1.0);
        g.inv_freq.push_back(interpolation * (1 - mask) + extrapolation * mask);
    }
    return g;
}

/// YaRN's ω_i as Rope::frequencies computed them before Yarn::truncate (whole dims), the
/// same operations in double: the default must keep these bits.
std::vector<double> yarn_whole_dims(const Rope& rope, const Rope::Yarn& y) {
    const Index r = rope.rotated();
    const auto dim = [&](double rotations) {
        return static_cast<double>(r) *
               std::log(static_cast<double>(y.original_max_positions) / (rotations * 2 * std::numbers::pi)) /
               (2 * std::log(rope.theta));
    };
    const double lo = std::max(std::floor(dim(y.beta_fast)), 0.0);
    double hi = std::min(std::ceil(dim(y.beta_slow)), static_cast<double>(r - 1));
    if (lo == hi)
        hi += 0.001;
    std::vector<double> w;
    for (Index i = 0; i < r / 2; ++i) {
        const double f = 1.0 / std::pow(rope.theta, static_cast<double>(2 * i) / static_cast<double>(r));
        const double ramp = std::clamp((static_cast<double>(i) - lo) / (hi - lo), 0.0, 1.0);
        w.push_back(f / y.factor * ramp + f * (1 - ramp));
    }
    return w;
}

/// gpt-oss-20b/120b's rotary: d = 64, θ = 150000, YaRN ×32 from 4096, β 32 and 1.
Rope gpt_oss_rope(bool truncate) {
    return Rope{.theta = 150000,
                .head_dim = 64,
                .scaling = Rope::Yarn{.factor = 32, .original_max_positions = 4096, .beta_fast = 32, .beta_slow = 1,
                                      .truncate = truncate}};
}

}  // namespace

TEMPLATE_TEST_CASE("Rope: every layout, partial rotary and scaling equals the formulas, positions up to 2^31",
                   "[rope]", float, double) {
    using T = TestType;
    const double tol = std::is_same_v<T, float> ? 4e-7 : 1e-15;  // per unit of |x| (inputs in [−1, 1])
    const std::vector<Index> positions{0, 1, 2, 17, 4095, 4096, 100000, 1000000, 12345678, (Index{1} << 31) + 5};
    for (const Rope::Layout layout : {Rope::Layout::half_split, Rope::Layout::interleaved})
        for (const Rope::Scaling& scaling :
             {Rope::Scaling{Rope::None{}}, Rope::Scaling{Rope::Linear{4}}, Rope::Scaling{Rope::Ntk{8}},
              Rope::Scaling{Rope::Yarn{.factor = 4, .original_max_positions = 4096}},
              Rope::Scaling{Rope::Yarn{.factor = 32, .original_max_positions = 8192, .beta_fast = 16,
                                       .beta_slow = 2, .mscale = 1.2}},
              Rope::Scaling{Rope::Yarn{.factor = 32, .original_max_positions = 4096, .truncate = false}}})
            for (const auto& [head_dim, rotary_dim] :
                 {std::pair<Index, Index>{64, 0}, {128, 0}, {2, 0}, {80, 40}, {17, 8}, {256, 64}}) {
                if (std::holds_alternative<Rope::Ntk>(scaling) && (rotary_dim == 0 ? head_dim : rotary_dim) <= 2)
                    continue;
                INFO("layout " << static_cast<int>(layout) << ", scaling " << scaling.index() << ", head_dim "
                               << head_dim << ", rotary_dim " << rotary_dim);
                const Rope rope{.theta = head_dim == 128 ? 500000.0 : 10000.0,
                                .head_dim = head_dim,
                                .rotary_dim = rotary_dim,
                                .layout = layout,
                                .scaling = scaling};
                check_against_reference<T>(rope, 3, positions, tol * rope.attention_factor() * 2);
            }
}

TEST_CASE("Rope: YaRN's frequencies and attention factor are Hugging Face's for a Llama-like model", "[rope]") {
    const Rope rope{.theta = 10000, .head_dim = 128, .scaling = Rope::Yarn{.factor = 4, .original_max_positions = 4096}};
    const std::vector<double> w = rope.frequencies();
    // The correction dims: 128·ln(4096/(2π·32))/(2 ln 10⁴) = 20.94 → 20, and for β = 1
    // 45.03 → 46: below 20 the frequencies stay, from 46 on they are divided by 4.
    for (Index i = 0; i < 64; ++i) {
        const double unscaled = std::pow(10000.0, -2.0 * static_cast<double>(i) / 128);
        if (i <= 20)
            CHECK(w[static_cast<std::size_t>(i)] == Approx(unscaled).epsilon(1e-15));
        else if (i >= 46)
            CHECK(w[static_cast<std::size_t>(i)] == Approx(unscaled / 4).epsilon(1e-15));
        else
            CHECK((w[static_cast<std::size_t>(i)] < unscaled && w[static_cast<std::size_t>(i)] > unscaled / 4));
    }
    CHECK(rope.attention_factor() == Approx(0.1 * std::log(4.0) + 1).epsilon(1e-15));
    CHECK(Rope{.head_dim = 8, .scaling = Rope::Yarn{.factor = 1}}.attention_factor() == 1);
    // NTK: θ·s^(r/(r−2)); linear: ω/s.
    const Rope ntk{.theta = 10000, .head_dim = 64, .scaling = Rope::Ntk{8}};
    CHECK(ntk.frequencies()[1] == Approx(std::pow(10000 * std::pow(8.0, 64.0 / 62), -2.0 / 64)).epsilon(1e-14));
    const Rope linear{.theta = 10000, .head_dim = 64, .scaling = Rope::Linear{2}};
    CHECK(linear.frequencies()[5] == Approx(std::pow(10000.0, -10.0 / 64) / 2).epsilon(1e-15));
}

TEST_CASE("Rope: Yarn with truncate = false is gpt-oss's rotary (a fractional correction range)", "[rope]") {
    const GptOssRotary g = gpt_oss_rotary(64, 150000, 32, 4096, 1, 32);
    // 32·ln(4096/(2π·32))/ln(150000) = 8.0928 and 32·ln(4096/2π)/ln(150000) = 17.3980:
    // rounded out, 8 and 18.
    CHECK(g.low == Approx(8.0928).margin(1e-4));
    CHECK(g.high == Approx(17.3980).margin(1e-4));
    const std::vector<double> fractional = gpt_oss_rope(false).frequencies(), whole = gpt_oss_rope(true).frequencies();
    REQUIRE(fractional.size() == 32);
    REQUIRE(whole.size() == 32);
    double most = 0;  // the largest relative difference of the rounded range, ω₉..ω₁₇
    for (std::size_t i = 0; i < 32; ++i) {
        INFO("ω_" << i << ": gpt-oss " << g.inv_freq[i] << ", truncate = false " << fractional[i]
                  << ", truncate = true " << whole[i]);
        CHECK(std::abs(fractional[i] - g.inv_freq[i]) <= 1e-12 * g.inv_freq[i]);
        const double apart = std::abs(whole[i] - g.inv_freq[i]) / g.inv_freq[i];
        if (i >= 9 && i <= 17) {
            CHECK(apart > 1e-3);  // every frequency of the ramp moves
            most = std::max(most, apart);
        } else {
            CHECK(apart <= 1e-12);  // outside the ramp both extrapolate (i ≤ 8) or interpolate (i ≥ 18)
        }
    }
    INFO("largest relative difference of truncate = true in ω₉..ω₁₇: " << most);
    CHECK(most > 0.5);
    CHECK(gpt_oss_rope(false).attention_factor() == Approx(g.concentration).epsilon(1e-15));
    CHECK(Rope::Yarn{}.truncate);  // the default: Hugging Face's
}

TEMPLATE_TEST_CASE("Rope: gpt-oss's rotated rows, Yarn with truncate = false against gpt-oss's formula in double",
                   "[rope]", float, double) {
    using T = TestType;
    const GptOssRotary g = gpt_oss_rotary(64, 150000, 32, 4096, 1, 32);
    const std::vector<Index> positions{0, 1, 2, 9, 100, 4095, 4096, 33333, 131071};
    const Index n = static_cast<Index>(positions.size()), heads = 3;
    const Matrix<T> X = random_matrix<T>(n, heads * 64, 51);
    Matrix<T> fractional = X, whole = X;
    gpt_oss_rope(false).apply(fractional, positions);
    gpt_oss_rope(true).apply(whole, positions);
    // gpt-oss's _apply_rotary_emb: x1, x2 the two halves of a head, cos and sin times the
    // concentration; o1 = x1 cos − x2 sin, o2 = x2 cos + x1 sin.
    MatrixD expected = X.template cast<double>();
    for (Index row = 0; row < n; ++row)
        for (Index h = 0; h < heads; ++h)
            for (Index i = 0; i < 32; ++i) {
                const double angle = static_cast<double>(positions[static_cast<std::size_t>(row)]) *
                                     g.inv_freq[static_cast<std::size_t>(i)];
                const double c = g.concentration * std::cos(angle), s = g.concentration * std::sin(angle);
                const double x1 = static_cast<double>(X(row, h * 64 + i));
                const double x2 = static_cast<double>(X(row, h * 64 + 32 + i));
                expected(row, h * 64 + i) = x1 * c - x2 * s;
                expected(row, h * 64 + 32 + i) = x2 * c + x1 * s;
            }
    // Measured: 0 in double (the frequencies agree to the bit here), 1.4e-7 in float (its
    // rounding of cos·a, sin·a and the turn); truncate = true is 2.8 away.
    const double tolerance = std::is_same_v<T, float> ? 1e-6 : 1e-11;
    const double off = (fractional.template cast<double>() - expected).cwiseAbs().maxCoeff();
    const double apart = (whole.template cast<double>() - expected).cwiseAbs().maxCoeff();
    INFO("truncate = false: " << off << " from gpt-oss's rows; truncate = true: " << apart);
    CHECK(off <= tolerance);
    CHECK(apart > 0.5);
}

TEST_CASE("Rope: Yarn's default (truncate = true) keeps its frequencies bit for bit", "[rope]") {
    for (const Rope& rope :
         {Rope{.theta = 10000, .head_dim = 128, .scaling = Rope::Yarn{.factor = 4, .original_max_positions = 4096}},
          Rope{.theta = 10000,
               .head_dim = 80,
               .rotary_dim = 40,
               .scaling = Rope::Yarn{.factor = 32, .original_max_positions = 8192, .beta_fast = 16, .beta_slow = 2,
                                     .mscale = 1.2}},
          Rope{.theta = 1e6, .head_dim = 128, .scaling = Rope::Yarn{.factor = 4, .original_max_positions = 32768}},
          Rope{.head_dim = 2, .scaling = Rope::Yarn{.factor = 8, .original_max_positions = 2048}},  // lo = hi
          gpt_oss_rope(true)}) {
        const auto& y = std::get<Rope::Yarn>(rope.scaling);
        INFO("theta " << rope.theta << ", r " << rope.rotated() << ", factor " << y.factor);
        CHECK(y.truncate);
        const std::vector<double> w = rope.frequencies(), before = yarn_whole_dims(rope, y);
        REQUIRE(w.size() == before.size());
        for (std::size_t i = 0; i < w.size(); ++i)
            CHECK(std::memcmp(&w[i], &before[i], sizeof(double)) == 0);
    }
}

TEST_CASE("Rope: a memory's snapshot records Yarn::truncate", "[rope][snapshot]") {
    const Index d = 64, n = 20;
    const Matrix<float> K = random_matrix<float>(n, d, 61), V = random_matrix<float>(n, d, 62),
                        q = random_matrix<float>(1, d, 63);
    KVCache<float> fractional(d, d, SoftmaxOptions{}, gpt_oss_rope(false));
    for (Index i = 0; i < n; ++i)
        fractional.update(K.row(i), V.row(i));
    std::stringstream out;
    save(fractional, out);
    const std::string bytes = out.str();
    {
        KVCache<float> same(d, d, SoftmaxOptions{}, gpt_oss_rope(false));
        std::stringstream in(bytes);
        load(same, in);
        Vector<float> a(d), b(d);
        fractional.attend(q.row(0), a);
        same.attend(q.row(0), b);
        CHECK(a == b);
    }
    KVCache<float> whole(d, d, SoftmaxOptions{}, gpt_oss_rope(true));
    std::stringstream in(bytes);
    CHECK_THROWS_WITH(load(whole, in), HasSubstring("truncate"));
    CHECK(whole.length() == 0);
}

TEST_CASE("Rope: q·k after the rotation depends on the positions' difference only", "[rope]") {
    for (const Rope::Layout layout : {Rope::Layout::half_split, Rope::Layout::interleaved}) {
        const Rope rope{.theta = 10000, .head_dim = 64, .rotary_dim = 48, .layout = layout, .scaling = Rope::Linear{2}};
        const MatrixD q0 = random_matrix<double>(1, 64, 11), k0 = random_matrix<double>(1, 64, 12);
        const auto dot = [&](Index p, Index j) {
            MatrixD q = q0, k = k0;
            rope.apply(q, std::vector<Index>{p});
            rope.apply(k, std::vector<Index>{j});
            return q.row(0).dot(k.row(0));
        };
        const double base = dot(30, 7);
        for (const Index shift : {1, 100, 5000, 70000})
            CHECK(dot(30 + shift, 7 + shift) == Approx(base).epsilon(1e-11));
        CHECK(dot(30, 30) == Approx(q0.row(0).dot(k0.row(0))).epsilon(1e-13));  // no difference: no turn
    }
}

TEST_CASE("Rope: the interleaved layout is the half-split one on permuted columns, bit for bit", "[rope]") {
    const Index d = 32, r = 24;
    const Matrix<float> X = random_matrix<float>(5, 2 * d, 21);
    const std::vector<Index> positions{0, 3, 99, 12345, 7000000};
    // Column 2i of a head ↔ column i, 2i + 1 ↔ i + r/2; the rest stay.
    Matrix<float> split = X;
    for (Index h = 0; h < 2; ++h)
        for (Index i = 0; i < r / 2; ++i) {
            split.col(h * d + i) = X.col(h * d + 2 * i);
            split.col(h * d + i + r / 2) = X.col(h * d + 2 * i + 1);
        }
    Matrix<float> interleaved = X;
    Rope{.head_dim = d, .rotary_dim = r, .layout = Rope::Layout::interleaved}.apply(interleaved, positions);
    Rope{.head_dim = d, .rotary_dim = r, .layout = Rope::Layout::half_split}.apply(split, positions);
    for (Index h = 0; h < 2; ++h) {
        for (Index i = 0; i < r / 2; ++i) {
            CHECK((interleaved.col(h * d + 2 * i).array() == split.col(h * d + i).array()).all());
            CHECK((interleaved.col(h * d + 2 * i + 1).array() == split.col(h * d + i + r / 2).array()).all());
        }
        CHECK((interleaved.middleCols(h * d + r, d - r).array() == X.middleCols(h * d + r, d - r).array()).all());
    }
}

TEMPLATE_TEST_CASE("RopeTable: cached cos/sin give Rope::apply's bits, inside the table and past it", "[rope]", float,
                   double) {
    using T = TestType;
    for (const Rope& rope : {Rope{.theta = 1e6, .head_dim = 128},
                             Rope{.head_dim = 64, .rotary_dim = 32, .layout = Rope::Layout::interleaved,
                                  .scaling = Rope::Yarn{.factor = 8, .original_max_positions = 2048}},
                             Rope{.head_dim = 1024, .scaling = Rope::Ntk{4}}}) {  // 512 pairs: past one stack piece
        RopeTable<T> table(rope, 300);
        CHECK(table.length() == 300);
        CHECK(table.footprint() >= sizeof(T) * 300 * static_cast<std::size_t>(rope.rotated()));
        const std::vector<Index> positions{0, 1, 299, 300, 301, 5000, 299, 1 << 20};
        const Matrix<T> X = random_matrix<T>(8, 2 * rope.head_dim, 31);
        Matrix<T> direct = X, cached = X;
        rope.apply(direct, positions);
        table.apply(cached, positions);
        CHECK((direct.array() == cached.array()).all());
        table.reserve(6000);  // now 5000 is in the table too
        Matrix<T> again = X;
        table.apply(again, positions);
        CHECK((again.array() == direct.array()).all());
        // A block of a wider matrix: rows in place, the rest untouched.
        Matrix<T> wide = Matrix<T>::Zero(10, 2 * rope.head_dim + 3);
        wide.block(1, 0, 8, 2 * rope.head_dim) = X;
        table.apply(wide.block(1, 0, 8, 2 * rope.head_dim), positions);
        CHECK((wide.block(1, 0, 8, 2 * rope.head_dim).array() == direct.array()).all());
        CHECK((wide.row(0).array() == 0).all());
        CHECK((wide.rightCols(3).array() == 0).all());
    }
}

TEST_CASE("Rope: bad configurations and shapes throw std::invalid_argument, X unchanged", "[rope][bad_input]") {
    Matrix<float> X = random_matrix<float>(2, 64, 41);
    const Matrix<float> before = X;
    const std::vector<Index> two{0, 1};
    const auto refused = [&](const Rope& rope, const std::vector<Index>& positions, const char* what) {
        INFO(what);
        CHECK_THROWS_AS(rope.apply(X, positions), std::invalid_argument);
        CHECK((X.array() == before.array()).all());
    };
    refused(Rope{.head_dim = 32, .rotary_dim = 7}, two, "odd rotary_dim");
    refused(Rope{.head_dim = 32, .rotary_dim = 34}, two, "rotary_dim past head_dim");
    refused(Rope{.head_dim = 1}, two, "head_dim 1: nothing to pair");
    refused(Rope{.head_dim = 0}, two, "head_dim 0");
    refused(Rope{.head_dim = 48}, two, "64 columns are not whole heads of 48");
    refused(Rope{.head_dim = 32}, std::vector<Index>{0}, "one position for two rows");
    refused(Rope{.head_dim = 32}, std::vector<Index>{0, -1}, "a negative position");
    refused(Rope{.theta = 1, .head_dim = 32}, two, "theta 1");
    refused(Rope{.theta = NAN, .head_dim = 32}, two, "theta NaN");
    refused(Rope{.head_dim = 32, .scaling = Rope::Linear{0.5}}, two, "factor below 1");
    refused(Rope{.head_dim = 32, .scaling = Rope::Yarn{.factor = 2, .beta_fast = 1, .beta_slow = 32}}, two,
            "beta_fast below beta_slow");
    refused(Rope{.head_dim = 32, .scaling = Rope::Yarn{.factor = 2, .original_max_positions = 0}}, two,
            "no original context");
    CHECK_THROWS_AS(RopeTable<float>(Rope{.head_dim = 32, .rotary_dim = 3}), std::invalid_argument);
    CHECK_THROWS_WITH(Rope{.head_dim = 48}.apply(X, two), Catch::Contains("Rope::apply") && Catch::Contains("X"));
    // An empty X with no positions is a no-op.
    Matrix<float> none(0, 64);
    Rope{.head_dim = 32}.apply(none, std::vector<Index>{});
}
