#include "support.hpp"

#include <memattn/kernels/causal_softmax.hpp>
#include <memattn/memory/sliding_window_cache.hpp>

using namespace memattn;
using memattn::test::check_close;
using memattn::test::HasSubstring;
using memattn::test::random_matrix;
using memattn::test::tolerance;

static_assert(Memory<SlidingWindowCache<float>>);
static_assert(Memory<SlidingWindowCache<double>>);
static_assert(detail::HasBulkExtend<SlidingWindowCache<float>>);
static_assert(detail::HasBulkPrefill<SlidingWindowCache<float>>);

TEMPLATE_TEST_CASE("SlidingWindowCache decode equals windowed causal softmax with sinks", "[memory][sliding_window]",
                   float, double) {
    using T = TestType;
    const Index window = GENERATE(1, 2, 5, 64);
    const Index sinks = GENERATE(0, 1, 4);
    const Index n = GENERATE(0, 1, 9, 150);
    const Index d = GENERATE(1, 16);
    const Index dv = 5;
    CAPTURE(window, sinks, n, d);
    const Matrix<T> Q = random_matrix<T>(n, d, 21), K = random_matrix<T>(n, d, 22), V = random_matrix<T>(n, dv, 23);
    SlidingWindowCache<T> cache(d, dv, window, sinks);
    Matrix<T> O(n, dv);
    decode(cache, Q, K, V, O);
    CHECK(cache.length() == n);
    const auto expected = reference::softmax_attention(reference::to_double(Q), reference::to_double(K),
                                                       reference::to_double(V), 0.0, window, sinks);
    check_close(O, expected.out, tolerance<T>());
    // DESIGN invariant 2: decode and the whole-sequence kernel agree.
    Matrix<T> kernel(n, dv);
    causal_softmax_attention(Q, K, V, kernel, SoftmaxOptions{.window = window, .sink_tokens = sinks});
    check_close(O, reference::to_double(kernel), tolerance<T>());
}

TEMPLATE_TEST_CASE("SlidingWindowCache: a window at least the sequence is full attention", "[memory][sliding_window]",
                   float, double) {
    using T = TestType;
    const Index n = 40, d = 6, dv = 3;
    const Matrix<T> Q = random_matrix<T>(n, d, 1), K = random_matrix<T>(n, d, 2), V = random_matrix<T>(n, dv, 3);
    const Index window = GENERATE(40, 41, 1000);
    SlidingWindowCache<T> cache(d, dv, window, 0, T(0.7));
    Matrix<T> O(n, dv);
    decode(cache, Q, K, V, O);
    const auto expected = reference::softmax_attention(reference::to_double(Q), reference::to_double(K),
                                                       reference::to_double(V), 0.7);
    check_close(O, expected.out, tolerance<T>());
}

TEMPLATE_TEST_CASE("SlidingWindowCache: prefill and extend equal the token loop", "[memory][sliding_window]", float,
                   double) {
    using T = TestType;
    const Index window = GENERATE(5, 300), d = 4, dv = 3;
    const Index sinks = GENERATE(0, 2);
    const Index before = GENERATE(0, 1, 3, 20);     // tokens already in the cache
    // Shorter than, equal to, longer than the window; 600 takes several kernel calls.
    const Index prompt = GENERATE(3, 5, 6, 17, 600);
    const Index after = 7;                          // decoding continues from the state left behind
    const Index n = before + prompt + after;
    CAPTURE(window, sinks, before, prompt);
    const Matrix<T> Q = random_matrix<T>(n, d, 31), K = random_matrix<T>(n, d, 32), V = random_matrix<T>(n, dv, 33);

    SlidingWindowCache<T> stepped(d, dv, window, sinks);
    Matrix<T> expected(n, dv);
    decode(stepped, Q, K, V, expected);

    SECTION("prefill") {
        SlidingWindowCache<T> bulk(d, dv, window, sinks);
        extend(bulk, K.topRows(before), V.topRows(before));
        Matrix<T> O(prompt + after, dv);
        prefill(bulk, Q.middleRows(before, prompt), K.middleRows(before, prompt), V.middleRows(before, prompt),
                O.topRows(prompt));
        CHECK(bulk.length() == before + prompt);
        decode(bulk, Q.bottomRows(after), K.bottomRows(after), V.bottomRows(after), O.bottomRows(after));
        check_close(O, reference::to_double(expected.bottomRows(prompt + after)), tolerance<T>());
        CHECK(bulk.footprint() == stepped.footprint());
    }
    SECTION("extend in pieces") {
        SlidingWindowCache<T> bulk(d, dv, window, sinks);
        extend(bulk, K.topRows(before), V.topRows(before));
        extend(bulk, K.middleRows(before, prompt), V.middleRows(before, prompt));
        Matrix<T> O(after, dv);
        decode(bulk, Q.bottomRows(after), K.bottomRows(after), V.bottomRows(after), O);
        // Same pairs, same order of summation: bit-identical.
        CHECK(O == expected.bottomRows(after));
    }
}

TEST_CASE("SlidingWindowCache: footprint grows to window + sinks pairs, then stays", "[memory][sliding_window]") {
    const Index d = 3, dv = 2, window = 8, sinks = 2;
    SlidingWindowCache<float> cache(d, dv, window, sinks);
    const std::size_t pair = (d + dv) * sizeof(float);
    CHECK(cache.capacity() == (window + sinks) * pair);
    CHECK(cache.footprint() == 0);
    const Matrix<float> K = random_matrix<float>(100, d, 1), V = random_matrix<float>(100, dv, 2);
    for (Index i = 0; i < 100; ++i) {
        cache.update(K.row(i), V.row(i));
        CHECK(cache.footprint() == static_cast<std::size_t>(std::min<Index>(i + 1, window + sinks)) * pair);
    }
    CHECK(cache.capacity() == (window + sinks) * pair);
    cache.reset();
    CHECK(cache.length() == 0);
    CHECK(cache.footprint() == 0);
    Vector<float> out(dv);
    cache.attend(K.row(0), out);
    CHECK(out.isZero());
}

TEST_CASE("SlidingWindowCache: bad input throws and leaves the cache unchanged", "[memory][sliding_window]") {
    SlidingWindowCache<double> cache(3, 2, 4, 1);
    const Matrix<double> K = random_matrix<double>(6, 3, 1), V = random_matrix<double>(6, 2, 2);
    const Matrix<double> Q = random_matrix<double>(1, 3, 3);
    extend(cache, K, V);
    Vector<double> before(2), after(2);
    cache.attend(Q.row(0), before);

    const Vector<double> k4 = Vector<double>::Ones(4), v2 = Vector<double>::Ones(2), v3 = Vector<double>::Ones(3);
    CHECK_THROWS_WITH(cache.update(k4, v2), HasSubstring("SlidingWindowCache::update") && HasSubstring("'key'") &&
                                                HasSubstring("1x4"));
    CHECK_THROWS_WITH(cache.update(K.row(0), v3), HasSubstring("'value'") && HasSubstring("1x3"));
    CHECK_THROWS_WITH(cache.extend(K, V.topRows(5)), HasSubstring("SlidingWindowCache::extend") && HasSubstring("5x2"));
    Matrix<double> O(6, 2), wrong(5, 2);
    CHECK_THROWS_WITH(cache.prefill(K, K, V, wrong), HasSubstring("SlidingWindowCache::prefill") && HasSubstring("'out'"));
    CHECK_THROWS_AS(cache.prefill(V, K, V, O), std::invalid_argument);
    CHECK_THROWS_WITH(cache.attend(k4, after), HasSubstring("SlidingWindowCache::attend") && HasSubstring("'query'"));
    CHECK(cache.length() == 6);
    cache.attend(Q.row(0), after);
    CHECK(after == before);

    CHECK_THROWS_WITH(SlidingWindowCache<double>(3, 2, 0), HasSubstring("SlidingWindowCache") && HasSubstring("'window'"));
    CHECK_THROWS_WITH(SlidingWindowCache<double>(3, 2, 4, -1), HasSubstring("'sinks'"));
    CHECK_THROWS_WITH(SlidingWindowCache<double>(0, 2, 4), HasSubstring("'key_dim'"));
    CHECK_THROWS_AS(SlidingWindowCache<double>(3, 0, 4), std::invalid_argument);
    CHECK_THROWS_AS(SlidingWindowCache<double>(3, 2, 4, 0, std::numeric_limits<double>::infinity()),
                    std::invalid_argument);
}

TEST_CASE("SlidingWindowCache: huge logits do not overflow", "[memory][sliding_window]") {
    const Index n = 50, d = 4;
    const Matrix<float> K = random_matrix<float>(n, d, 5, 100.0), V = random_matrix<float>(n, d, 6);
    const Matrix<float> Q = random_matrix<float>(n, d, 7, 100.0);
    SlidingWindowCache<float> cache(d, d, 7, 2, 1.f);
    Matrix<float> O(n, d);
    decode(cache, Q, K, V, O);
    const auto expected = reference::softmax_attention(reference::to_double(Q), reference::to_double(K),
                                                       reference::to_double(V), 1.0, 7, 2);
    check_close(O, expected.out, 5e-2);  // near-ties of logits ~1e4 are decided by float rounding
}
