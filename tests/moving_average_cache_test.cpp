#include "support.hpp"

#include <memattn/memory/moving_average_cache.hpp>

#include <random>

using namespace memattn;
using memattn::test::check_close;
using memattn::test::HasSubstring;
using memattn::test::random_matrix;
using memattn::test::tolerance;

static_assert(Memory<MovingAverageCache<float>>);
static_assert(Memory<MovingAverageCache<double>>);
static_assert(detail::HasBulkExtend<MovingAverageCache<double>>);

namespace {

/// Decodes with `mem` and returns, row by row, the output and the summary key.
template <class T>
std::pair<Matrix<T>, Matrix<T>> run(MovingAverageCache<T>& mem, const Matrix<T>& Q, const Matrix<T>& K,
                                    const Matrix<T>& V) {
    Matrix<T> O(K.rows(), V.cols()), keys(K.rows(), K.cols());
    for (Index i = 0; i < K.rows(); ++i) {
        mem.update(K.row(i), V.row(i));
        mem.attend(Q.row(i), O.row(i));
        keys.row(i) = mem.summary_key();
    }
    return {O, keys};
}

}  // namespace

TEMPLATE_TEST_CASE("MovingAverageCache: windowed and cumulative means equal the reference", "[memory][moving_average]",
                   float, double) {
    using T = TestType;
    const Index window = GENERATE(0, 1, 2, 5, 64);
    const Index n = GENERATE(0, 1, 9, 150);
    const Index d = 3, dv = GENERATE(1, 4);
    CAPTURE(window, n, dv);
    const Matrix<T> Q = random_matrix<T>(n, d, 41), K = random_matrix<T>(n, d, 42), V = random_matrix<T>(n, dv, 43);
    MovingAverageCache<T> mem(d, dv, window);
    const auto [O, keys] = run(mem, Q, K, V);
    CHECK(mem.length() == n);
    check_close(O, reference::moving_average(reference::to_double(V), window), tolerance<T>());
    check_close(keys, reference::moving_average(reference::to_double(K), window), tolerance<T>());
}

TEMPLATE_TEST_CASE("MovingAverageCache::exponential equals the reference", "[memory][moving_average]", float, double) {
    using T = TestType;
    const double alpha = GENERATE(1.0, 0.3, 0.01);
    const Index n = GENERATE(0, 1, 100);
    const Matrix<T> Q = random_matrix<T>(n, 2, 1), K = random_matrix<T>(n, 2, 2), V = random_matrix<T>(n, 5, 3);
    auto mem = MovingAverageCache<T>::exponential(2, 5, static_cast<T>(alpha));
    const auto [O, keys] = run(mem, Q, K, V);
    check_close(O, reference::exponential_average(reference::to_double(V), static_cast<T>(alpha)), tolerance<T>());
    check_close(keys, reference::exponential_average(reference::to_double(K), static_cast<T>(alpha)), tolerance<T>());
}

TEMPLATE_TEST_CASE("MovingAverageCache: extend equals the token loop", "[memory][moving_average]", float, double) {
    using T = TestType;
    const Index window = GENERATE(0, 1, 5, 16);
    const bool exponential = GENERATE(false, true);
    const Index before = GENERATE(0, 3, 20), prompt = GENERATE(0, 4, 5, 16, 40);
    const Index n = before + prompt, d = 2, dv = 3;
    CAPTURE(window, exponential, before, prompt);
    const Matrix<T> K = random_matrix<T>(n, d, 51), V = random_matrix<T>(n, dv, 52);
    auto make = [&] {
        return exponential ? MovingAverageCache<T>::exponential(d, dv, T(0.25)) : MovingAverageCache<T>(d, dv, window);
    };
    auto stepped = make(), bulk = make();
    for (Index i = 0; i < n; ++i)
        stepped.update(K.row(i), V.row(i));
    extend(bulk, K.topRows(before), V.topRows(before));
    extend(bulk, K.bottomRows(prompt), V.bottomRows(prompt));
    CHECK(bulk.length() == n);
    check_close(bulk.summary_value(), reference::to_double(stepped.summary_value()), tolerance<T>());
    check_close(bulk.summary_key(), reference::to_double(stepped.summary_key()), tolerance<T>());
    CHECK(bulk.footprint() == stepped.footprint());
}

// Inputs 1000 + 0.01·U(−1, 1) for the first half, then 3.3 + 0.01·U(−1, 1): a plain
// float running sum rounds 3.3 the same way at every step near 3·10^6 (one ulp = 0.25)
// and ends 7e-3 relative off; a running window sum without re-summing keeps the
// rounding residue of the large values after they have left the window, 2e-3 off
// (both measured). The compensated and the re-summed sums must stay within 1e-4.
TEST_CASE("MovingAverageCache: 10^6 float tokens stay within 1e-4 of double", "[memory][moving_average]") {
    const Index tokens = memattn::test::memory_only ? 20'000 : 1'000'000, d = 2, dv = 2;
    const Index window = GENERATE(0, 1000);
    CAPTURE(window);
    MovingAverageCache<float> mem(d, dv, window);
    std::mt19937_64 gen(7);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    std::vector<double> history(static_cast<std::size_t>(tokens) * dv);
    Vector<float> k(d), v(dv);
    for (Index t = 0; t < tokens; ++t) {
        for (Index c = 0; c < dv; ++c) {
            v(c) = static_cast<float>((t < tokens / 2 ? 1000.0 : 3.3) + 0.01 * u(gen));
            history[static_cast<std::size_t>(t * dv + c)] = static_cast<double>(v(c));
        }
        k = v;
        mem.update(k, v);
    }
    // The same mean in double, summed plainly (double's error here is ~1e-10).
    const Index first = window == 0 ? 0 : tokens - window;
    reference::MatrixD expected = reference::MatrixD::Zero(1, dv);
    for (Index t = first; t < tokens; ++t)
        for (Index c = 0; c < dv; ++c)
            expected(0, c) += history[static_cast<std::size_t>(t * dv + c)];
    expected /= static_cast<double>(tokens - first);
    Vector<float> out(dv);
    mem.attend(k, out);
    const double relative = (out.cast<double>() - expected).cwiseAbs().maxCoeff() / expected.cwiseAbs().maxCoeff();
    CAPTURE(relative);
    CHECK(relative < 1e-4);
    check_close(mem.summary_key(), expected, 1e-4);
}

TEST_CASE("MovingAverageCache: footprint is constant once the window is full", "[memory][moving_average]") {
    const Index d = 3, dv = 2, window = 6;
    const std::size_t pair = (d + dv) * sizeof(double);
    MovingAverageCache<double> windowed(d, dv, window), cumulative(d, dv, 0);
    auto ema = MovingAverageCache<double>::exponential(d, dv, 0.5);
    CHECK(windowed.capacity() == (window + 1) * pair);
    CHECK(cumulative.capacity() == 2 * pair);
    CHECK(ema.capacity() == pair);
    const Matrix<double> K = random_matrix<double>(50, d, 1), V = random_matrix<double>(50, dv, 2);
    for (Index i = 0; i < 50; ++i) {
        windowed.update(K.row(i), V.row(i));
        cumulative.update(K.row(i), V.row(i));
        ema.update(K.row(i), V.row(i));
        CHECK(windowed.footprint() == (1 + static_cast<std::size_t>(std::min(i + 1, window))) * pair);
        CHECK(cumulative.footprint() == 2 * pair);
        CHECK(ema.footprint() == pair);
    }
    windowed.reset();
    Vector<double> out(dv);
    windowed.attend(K.row(0), out);
    CHECK(out.isZero());
    CHECK(windowed.length() == 0);
}

TEST_CASE("MovingAverageCache: bad input throws and leaves the memory unchanged", "[memory][moving_average]") {
    MovingAverageCache<float> mem(3, 2, 4);
    const Matrix<float> K = random_matrix<float>(6, 3, 1), V = random_matrix<float>(6, 2, 2);
    extend(mem, K, V);
    const Vector<float> before = mem.summary_value();
    const Vector<float> k2 = Vector<float>::Ones(2), v2 = Vector<float>::Ones(2);
    CHECK_THROWS_WITH(mem.update(k2, v2), HasSubstring("MovingAverageCache::update") && HasSubstring("'key'") &&
                                              HasSubstring("1x2"));
    CHECK_THROWS_WITH(mem.extend(K, K), HasSubstring("MovingAverageCache::extend") && HasSubstring("'values'") &&
                                            HasSubstring("6x3"));
    Vector<float> out(2);
    CHECK_THROWS_WITH(mem.attend(k2, out), HasSubstring("'query'"));
    CHECK(mem.length() == 6);
    CHECK(mem.summary_value() == before);
    CHECK_THROWS_WITH(MovingAverageCache<float>(3, 2, -1), HasSubstring("MovingAverageCache") && HasSubstring("'window'"));
    CHECK_THROWS_WITH(MovingAverageCache<float>::exponential(3, 2, 0.f), HasSubstring("'alpha'"));
    CHECK_THROWS_AS(MovingAverageCache<float>::exponential(3, 2, 1.5f), std::invalid_argument);
    CHECK_THROWS_AS(MovingAverageCache<float>(0, 2, 1), std::invalid_argument);
}
