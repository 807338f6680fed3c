#include "support.hpp"

#include <memattn/detail/packet.hpp>
#include <memattn/kernels/decode_attention.hpp>
#include <memattn/softmax_state.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <type_traits>
#include <limits>
#include <random>
#include <vector>

using namespace memattn;
using memattn::test::check_close;
using memattn::test::random_matrix;
using memattn::test::tolerance;

namespace {

// One query against keys [begin, end) of K/V through SoftmaxState::absorb.
template <class T>
SoftmaxState<T> partial(const Vector<T>& q, const Matrix<T>& K, const Matrix<T>& V, Index begin, Index end,
                        Vector<T>& acc) {
    SoftmaxState<T> state;
    acc.setZero(V.cols());
    detail::attend_contiguous(q, K.middleRows(begin, end - begin), V.middleRows(begin, end - begin), T(0.5), state,
                              acc);
    return state;
}

}  // namespace

TEMPLATE_TEST_CASE("SoftmaxState: partials over disjoint keys merge to the whole", "[softmax][state]", float,
                   double) {
    using T = TestType;
    const Index n = GENERATE(1, 2, 255, 256, 257, 700);
    const Matrix<T> K = random_matrix<T>(n, 5, 1), V = random_matrix<T>(n, 3, 2);
    const Vector<T> q = random_matrix<T>(1, 5, 3).row(0);
    const auto expected = reference::softmax_attention(reference::to_double(q), reference::to_double(K),
                                                       reference::to_double(V), 0.5, 0, n);  // sinks: all visible
    const Index cut = GENERATE_COPY(Index(0), n / 3, n);
    Vector<T> a, b;
    SoftmaxState<T> sa = partial(q, K, V, 0, cut, a);
    const SoftmaxState<T> sb = partial(q, K, V, cut, n, b);
    sa.merge(sb, a, b);
    REQUIRE_THAT(static_cast<double>(sa.log_sum_exp()),
                 Catch::Matchers::WithinRel(expected.lse[0], 10 * tolerance<T>()));
    sa.finish(a);
    check_close(a, expected.out, tolerance<T>());
}

TEMPLATE_TEST_CASE("SoftmaxState: empty states and fully masked blocks stay finite", "[softmax][state]", float,
                   double) {
    using T = TestType;
    SoftmaxState<T> state;
    CHECK(state.empty());
    std::vector<T> masked(4, -std::numeric_limits<T>::infinity());
    CHECK(state.absorb(masked.data(), 4) == T(1));
    CHECK(state.empty());
    CHECK(masked == std::vector<T>(4, T(0)));
    Vector<T> acc = Vector<T>::Zero(2);
    state.finish(acc);
    CHECK(acc.isZero());
    CHECK(state.log_sum_exp() == -std::numeric_limits<T>::infinity());

    // A NaN logit poisons the state, even beside masked ones: not empty, NaN output.
    SoftmaxState<T> poisoned;
    std::vector<T> with_nan{-std::numeric_limits<T>::infinity(), std::numeric_limits<T>::quiet_NaN()};
    poisoned.absorb(with_nan.data(), 2);
    CHECK_FALSE(poisoned.empty());
    Vector<T> poisoned_acc = Vector<T>::Ones(2);
    poisoned.finish(poisoned_acc);
    CHECK(poisoned_acc.array().isNaN().all());
    CHECK(std::isnan(poisoned.log_sum_exp()));

    // Huge logits: exp is taken relative to the running maximum.
    std::vector<T> big{T(1e4), T(-1e4), T(1e4) - 1};
    state.absorb(big.data(), 3);
    CHECK(std::isfinite(state.sum));
    CHECK_THAT(static_cast<double>(state.log_sum_exp()),
               Catch::Matchers::WithinRel(1e4 + std::log1p(std::exp(-1.0)), 1e-6));
}

namespace {

// Distance in units in the last place between a computed T and the exact value.
template <class T>
double ulps(T computed, long double exact) {
    const long double ulp = std::nextafter(static_cast<T>(exact), std::numeric_limits<T>::infinity()) -
                            static_cast<T>(exact);
    return static_cast<double>(std::fabs(static_cast<long double>(computed) - exact) / ulp);
}

// exp2_nonpositive on one whole packet (the kernels' path) and on one lane (the scalar one).
template <class T>
std::vector<T> exp2_packets(const std::vector<T>& x) {
    using P = detail::Packet<T>;
    constexpr Index lanes = detail::packet_lanes<T>;
    std::vector<T> y(x.size());
    for (std::size_t i = 0; i + lanes <= x.size(); i += lanes)
        Eigen::internal::pstoreu(y.data() + i, detail::exp2_nonpositive(Eigen::internal::ploadu<P>(x.data() + i)));
    return y;
}

}  // namespace

TEST_CASE("SoftmaxState::absorb's round: the weights mapped before they are summed (FpMath::bf16's rounding)",
          "[softmax][state]") {
    std::vector<float> s{0.0f, -0.3f, -1.7f, -0.01f, -9.5f}, plain = s;
    SoftmaxState<float> rounded, exact;
    const auto to_bf16 = [](auto& p) { p = p.template cast<Eigen::bfloat16>().template cast<float>(); };
    CHECK(rounded.absorb(s.data(), 5, to_bf16) == 0.0f);  // α = exp(−∞) on the first block
    exact.absorb(plain.data(), 5);
    float sum = 0;
    for (std::size_t j = 0; j < s.size(); ++j) {
        CHECK(s[j] == static_cast<float>(Eigen::bfloat16(plain[j])));  // each weight rounded once
        sum += s[j];
    }
    CHECK(rounded.sum == Approx(sum).epsilon(1e-6));  // the sum of the rounded weights
    CHECK(rounded.sum != exact.sum);
    CHECK(rounded.max == exact.max);
}

TEMPLATE_TEST_CASE("SoftmaxBlockState::absorb_scaled equals absorb of the tile times the factor, bit for bit",
                   "[softmax][state]", float, double) {
    using T = TestType;
    constexpr T inf = std::numeric_limits<T>::infinity();
    const T nan = std::numeric_limits<T>::quiet_NaN();
    constexpr Index keys = 37, lanes = 40, ld = 48;  // lanes past whole packets: the lone-lane path too
    using Round = std::conditional_t<std::is_same_v<T, float>, detail::RoundToBf16, std::identity>;
    const auto same = [](const T* a, const T* b, Index n) {
        return std::memcmp(a, b, sizeof(T) * static_cast<std::size_t>(n)) == 0;
    };
    std::mt19937 rng(7);
    std::normal_distribution<double> normal(0.0, 4.0);
    for (const T factor : {T(0.1803368801111204), T(1), T(3.5), T(1e-30)}) {
        SoftmaxBlockState<T> scaled(lanes), plain(lanes);
        scaled.reset();
        plain.reset();
        // Three tiles into the same states: random logits with −∞ (masked), +∞, NaN,
        // zeros of both signs and lanes that see nothing; a lane's maximum moves.
        for (int tile = 0; tile < 3; ++tile) {
            std::vector<T> s(static_cast<std::size_t>(keys * ld));
            for (Index j = 0; j < keys; ++j)
                for (Index i = 0; i < ld; ++i) {
                    T x = static_cast<T>(normal(rng) + 2.0 * tile);
                    const auto pick = rng() % 64;
                    if (pick == 0 || i == 5)
                        x = -inf;  // lane 5 sees nothing
                    else if (pick == 1 && i != 7)
                        x = i == 9 ? inf : nan;
                    else if (pick == 2)
                        x = (rng() % 2) ? T(0) : -T(0);
                    s[static_cast<std::size_t>(j * ld + i)] = x;
                }
            std::vector<T> times = s;
            for (T& x : times)
                x = factor * x;
            scaled.absorb_scaled(s.data(), keys, ld, lanes, factor, Round{});
            plain.absorb(times.data(), keys, ld, lanes, Round{});
            INFO("factor " << factor << ", tile " << tile);
            for (Index j = 0; j < keys; ++j)  // the weights, lanes [0, lanes)
                CHECK(same(s.data() + j * ld, times.data() + j * ld, lanes));
            CHECK(same(scaled.alpha(), plain.alpha(), lanes));
            for (Index i = 0; i < lanes; ++i) {
                const SoftmaxState<T> a = scaled.state(i), b = plain.state(i);
                CHECK(same(&a.sum, &b.sum, 1));
                CHECK((a.max == b.max || (std::isnan(a.max) && std::isnan(b.max))));  // a zero's sign may differ
            }
        }
    }
}

TEMPLATE_TEST_CASE("max_or_nan: the largest value, NaN when any is NaN, at every length and position",
                   "[softmax][state]", float, double) {
    using T = TestType;
    const T inf = std::numeric_limits<T>::infinity(), nan = std::numeric_limits<T>::quiet_NaN();
    CHECK(detail::max_or_nan<T>(nullptr, 0) == -inf);
    std::mt19937 rng(7);
    std::normal_distribution<T> normal;
    for (Index n = 1; n <= 70 || n == 128 || n == 129; n = n == 70 ? 128 : n + 1) {
        std::vector<T> x(static_cast<std::size_t>(n));
        for (T& v : x) v = normal(rng);
        for (Index at = 0; at < n; ++at) {  // the largest at every position, among −∞ or random values
            std::vector<T> y = x;
            if (at % 3 == 0) std::fill(y.begin(), y.end(), -inf);
            y[static_cast<std::size_t>(at)] = T(5) + T(at);
            INFO("n = " << n << ", largest at " << at);
            CHECK(detail::max_or_nan(y.data(), n) == T(5) + T(at));
            std::fill(y.begin(), y.end(), -inf);  // all masked: −∞
            CHECK(detail::max_or_nan(y.data(), n) == -inf);
            y[static_cast<std::size_t>(at)] = at % 2 ? nan : -nan;  // one NaN anywhere, of either sign
            CHECK(std::isnan(detail::max_or_nan(y.data(), n)));
            y = x;
            y[static_cast<std::size_t>(at)] = nan;
            CHECK(std::isnan(detail::max_or_nan(y.data(), n)));
        }
        CHECK(detail::max_or_nan(x.data(), n) == *std::max_element(x.begin(), x.end()));
    }
    // Through absorb: a NaN in a whole block of 128 logits poisons the state.
    std::vector<T> block(128, -inf);
    block[77] = nan;
    SoftmaxState<T> state;
    state.absorb(block.data(), 128);
    CHECK(std::isnan(state.max));
    CHECK(!state.empty());
}

TEST_CASE("exp2_nonpositive: AVX-512's 16 lanes (vscalefps) give the bits of the 8-lane exponent addition", "[softmax][exp2]") {
#if defined(EIGEN_VECTORIZE_AVX512) && defined(MEMATTN_AVX512_NATIVE)  // the build's Packet16f takes vscalefps
    using Eigen::internal::Packet16f;
    using Eigen::internal::Packet8f;
    std::vector<float> x;
    for (float v = 0; v >= -130.0f; v -= 0x1.0p-9f)  // every 1/512 down to below exp2_lowest
        x.push_back(v);
    std::mt19937 gen(49);
    std::uniform_real_distribution<float> uniform(-126.0f, 0.0f);
    for (int i = 0; i < (1 << 18); ++i)
        x.push_back(uniform(gen));
    const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
    for (const float v : {-0.0f, -0.5f, -1.5f, -124.5f, -125.0f, -125.5f, std::nextafter(-125.0f, 0.0f),
                          std::nextafter(-125.0f, -inf), std::nextafter(-0.5f, 0.0f), -inf, nan, -nan,
                          -std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::max()})
        x.push_back(v);
    while (x.size() % 16) x.push_back(-inf);
    std::size_t differ = 0;
    for (std::size_t i = 0; i < x.size(); i += 16) {
        alignas(64) float wide[16], narrow[16];
        Eigen::internal::pstore(wide, detail::exp2_nonpositive(Eigen::internal::ploadu<Packet16f>(x.data() + i)));
        Eigen::internal::pstore(narrow, detail::exp2_nonpositive(Eigen::internal::ploadu<Packet8f>(x.data() + i)));
        Eigen::internal::pstore(narrow + 8, detail::exp2_nonpositive(Eigen::internal::ploadu<Packet8f>(x.data() + i + 8)));
        differ += static_cast<std::size_t>(std::memcmp(wide, narrow, sizeof wide) != 0);
    }
    CHECK(differ == 0);
#else
    WARN("no AVX-512 F, BW, DQ and VL in this build: one exp2 path only, nothing to compare");
#endif
}

TEMPLATE_TEST_CASE("exp2_nonpositive: packets and lone lanes within 3.5 (float) and 1.25 (double) ulps of 2^x, exact at integers",
                   "[softmax][exp2]", float, double) {
    using T = TestType;
    constexpr Index lanes = detail::packet_lanes<T>;
    const T lowest = detail::exp2_lowest<T>;
    std::mt19937_64 gen(2026);
    std::vector<T> x;
    for (int i = 0; i < 4096 * int(lanes); ++i) {  // uniform over the whole range, then dense near 0
        const double u = static_cast<double>(gen() >> 11) * 0x1.0p-53;
        x.push_back(static_cast<T>(i % 2 ? u * double(lowest) : -8.0 * u));
    }
    for (T k = 0; k >= lowest; k -= T(1)) x.push_back(k);  // 2^-k exactly
    for (const T half : {T(-0.5), T(-1.5), T(-2.5), std::nextafter(T(-0.5), T(0)), std::nextafter(T(-0.5), T(-1))})
        x.push_back(half);  // the rounding boundaries of n
    while (x.size() % lanes) x.push_back(T(0));
    const std::vector<T> y = exp2_packets(x);
    double worst = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
        const long double exact = std::exp2(static_cast<long double>(x[i]));
        worst = std::max(worst, ulps(y[i], exact));
        worst = std::max(worst, ulps(detail::exp2_nonpositive(x[i]), exact));
        if (x[i] == std::round(x[i])) REQUIRE(y[i] == static_cast<T>(exact));
    }
    INFO("worst error " << worst << " ulps");
    CHECK(worst <= (std::is_same_v<T, float> ? 3.5 : 1.25));  // measured: 3.09; 0.83 with FMA, 1.13 without

    // Below exp2_lowest and at −∞ exactly 0; NaN of any sign stays NaN; 0 gives exactly 1.
    const T inf = std::numeric_limits<T>::infinity();
    const T nan = std::numeric_limits<T>::quiet_NaN();
    std::vector<T> special = {std::nextafter(lowest, -inf), T(-2000), -inf, nan, -nan, T(0), T(-0.0), lowest};
    while (special.size() % lanes) special.push_back(-inf);
    const std::vector<T> s = exp2_packets(special);
    for (int i = 0; i < 3; ++i) CHECK(s[i] == T(0));
    CHECK(std::isnan(s[3]));
    CHECK(std::isnan(s[4]));
    CHECK(s[5] == T(1));
    CHECK(s[6] == T(1));
    CHECK(s[7] == std::exp2(lowest));
    for (std::size_t i = 8; i < special.size(); ++i) CHECK(s[i] == T(0));
}
