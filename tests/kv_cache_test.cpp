#include "support.hpp"

#include <memattn/memory/kv_cache.hpp>

using namespace memattn;
using memattn::test::check_close;
using memattn::test::random_matrix;
using memattn::test::tolerance;

TEMPLATE_TEST_CASE("KVCache decode equals causal softmax attention", "[memory][kv_cache]", float, double) {
    using T = TestType;
#if defined(MEMATTN_TEST_MEMORY_ONLY)  // -O0 under ASan: the same paths, shorter
    const Index n = GENERATE(0, 1, 2, 255, 256, 257);
#else
    const Index n = GENERATE(0, 1, 2, 255, 256, 257, 1000);
#endif
    const Index d = GENERATE(1, 3, 64);
    const Index dv = GENERATE(1, 5);
    const Matrix<T> Q = random_matrix<T>(n, d, 11), K = random_matrix<T>(n, d, 12), V = random_matrix<T>(n, dv, 13);
    KVCache<T> cache(d, dv);
    Matrix<T> O(n, dv);
    decode(cache, Q, K, V, O);
    CHECK(cache.length() == n);
    CHECK(cache.footprint() == static_cast<std::size_t>(n * (d + dv)) * sizeof(T));
    const auto expected = reference::softmax_attention(reference::to_double(Q), reference::to_double(K),
                                                       reference::to_double(V));
    check_close(O, expected.out, tolerance<T>());
}

TEMPLATE_TEST_CASE("KVCache: an attend past the streaming size equals the reference", "[memory][kv_cache]", float,
                   double) {
    // Runs of at least detail::streaming_bytes of K and V take the in-order path: a few
    // rows past it, with head dims off every packet and a block cut off in the middle.
    using T = TestType;
    const Index d = 67, dv = 61;
    const auto row_bytes = static_cast<Index>((d + dv) * sizeof(T));
    const Index n = static_cast<Index>(detail::streaming_bytes) / row_bytes + 3 + detail::attend_block / 2;
    const Matrix<T> K = random_matrix<T>(n, d, 21), V = random_matrix<T>(n, dv, 22), q = random_matrix<T>(2, d, 23);
    KVCache<T> cache(d, dv);
    cache.extend(K, V);
    REQUIRE(cache.footprint() >= detail::streaming_bytes);
    for (Index r = 0; r < q.rows(); ++r) {
        Vector<T> out(dv);
        cache.attend(q.row(r), out);
        const auto expected = reference::softmax_attention(reference::to_double(q.row(r)), reference::to_double(K),
                                                           reference::to_double(V));
        check_close(out, expected.out, tolerance<T>());
    }
}

TEMPLATE_TEST_CASE("KVCache: extend and prefill equal token-by-token updates", "[memory][kv_cache]", float, double) {
    using T = TestType;
    const Index n = 300, d = 8, dv = 6;
    const Matrix<T> Q = random_matrix<T>(n, d, 1), K = random_matrix<T>(n, d, 2), V = random_matrix<T>(n, dv, 3);
    const Index cut = GENERATE(Index(0), Index(1), Index(150), Index(300));

    KVCache<T> stepped(d, dv), bulk(d, dv);
    Matrix<T> expected(n, dv);
    decode(stepped, Q, K, V, expected);

    extend(bulk, K.topRows(cut), V.topRows(cut));
    Matrix<T> rest(n - cut, dv);
    prefill(bulk, Q.bottomRows(n - cut), K.bottomRows(n - cut), V.bottomRows(n - cut), rest);
    CHECK(bulk.length() == n);
    CHECK(bulk.keys() == K);
    CHECK(bulk.values() == V);
    check_close(rest, reference::to_double(expected.bottomRows(n - cut)), tolerance<T>());
}

TEMPLATE_TEST_CASE("KVCache: huge logits do not overflow", "[memory][kv_cache]", float, double) {
    using T = TestType;
    const Index n = 64, d = 4;
    const Matrix<T> K = random_matrix<T>(n, d, 5, 100.0), V = random_matrix<T>(n, d, 6);
    const Matrix<T> Q = random_matrix<T>(n, d, 7, 100.0);  // |logits| up to ~1e4
    KVCache<T> cache(d, d, T(1));
    Matrix<T> O(n, d);
    decode(cache, Q, K, V, O);
    const auto expected = reference::softmax_attention(reference::to_double(Q), reference::to_double(K),
                                                       reference::to_double(V), 1.0);
    // Near-ties between logits of size 1e4 are decided by the rounding of q·k in T.
    check_close(O, expected.out, sizeof(T) == 4 ? 5e-2 : 1e-9);
}

TEST_CASE("KVCache: storage grows geometrically and reset keeps it", "[memory][kv_cache]") {
    KVCache<float> cache(2, 2);
    const Matrix<float> K = random_matrix<float>(1000, 2, 1);
    std::size_t reallocations = 0, last = cache.capacity();
    for (Index i = 0; i < K.rows(); ++i) {
        cache.update(K.row(i), K.row(i));
        if (cache.capacity() != last) {
            ++reallocations;
            last = cache.capacity();
        }
    }
    CHECK(reallocations <= 8);  // 16, 32, ..., 1024
    cache.reset();
    CHECK(cache.length() == 0);
    CHECK(cache.footprint() == 0);
    CHECK(cache.capacity() == last);
    Vector<float> out(2);
    cache.attend(K.row(0), out);
    CHECK(out.isZero());  // an empty memory attends to nothing
}

TEST_CASE("KVCache: bad input throws and leaves the cache unchanged", "[memory][kv_cache]") {
    KVCache<double> cache(3, 2);
    const Matrix<double> K = random_matrix<double>(4, 3, 1), V = random_matrix<double>(4, 2, 2);
    extend(cache, K, V);
    const Vector<double> k4 = Vector<double>::Ones(4), v2 = Vector<double>::Ones(2);
    CHECK_THROWS_WITH(cache.update(k4, v2), memattn::test::HasSubstring("KVCache::update") &&
                                               memattn::test::HasSubstring("'key'") && memattn::test::HasSubstring("4"));
    const Matrix<double> V3 = random_matrix<double>(4, 3, 3);
    CHECK_THROWS_AS(cache.extend(K, V3), std::invalid_argument);
    CHECK_THROWS_AS(KVCache<double>(0, 2), std::invalid_argument);
    CHECK_THROWS_AS(KVCache<double>(3, 2, std::numeric_limits<double>::quiet_NaN()), std::invalid_argument);
    CHECK(cache.length() == 4);
    CHECK(cache.keys() == K);
    CHECK(cache.values() == V);
}

TEST_CASE("KVCache reads one head's columns of a wider buffer without a copy", "[memory][kv_cache]") {
    const Index n = 40, heads = 3, d = 4;
    const Matrix<float> QKV = random_matrix<float>(n, 3 * heads * d, 9);
    Matrix<float> O = Matrix<float>::Zero(n, heads * d);
    for (Index h = 0; h < heads; ++h) {
        KVCache<float> cache(d, d);
        decode(cache, QKV.middleCols(h * d, d), QKV.middleCols((heads + h) * d, d),
               QKV.middleCols((2 * heads + h) * d, d), O.middleCols(h * d, d));
        const auto expected = reference::softmax_attention(reference::to_double(QKV.middleCols(h * d, d)),
                                                           reference::to_double(QKV.middleCols((heads + h) * d, d)),
                                                           reference::to_double(QKV.middleCols((2 * heads + h) * d, d)));
        check_close(O.middleCols(h * d, d), expected.out, 1e-5);
    }
}
