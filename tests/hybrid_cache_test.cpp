#include "support.hpp"

#include <memattn/memory/hybrid_cache.hpp>
#include <memattn/memory/sliding_window_cache.hpp>

#include <string>

using namespace memattn;
using memattn::test::check_close;
using memattn::test::HasSubstring;
using memattn::test::random_matrix;
using memattn::test::tolerance;

namespace {

// A user's compressor in three lines: a slot keeps its newest row.
struct LastPool {
    template <class T>
    void absorb(RowRef<T> slot, ConstRowRef<T> row, Index) const {
        slot = row;
    }
};

struct NotACompressor {
    void absorb(int) const {}
};

static_assert(Compressor<MeanPool, float> && Compressor<MaxPool, double> && Compressor<WeightedPool, float>);
static_assert(Compressor<LastPool, float>);
static_assert(!Compressor<NotACompressor, float>);
static_assert(Memory<HybridCache<float>>);
static_assert(Memory<HybridCache<double, MaxPool>>);
static_assert(Memory<HybridCache<float, LastPool>>);
static_assert(detail::HasBulkExtend<HybridCache<float, WeightedPool>>);

const std::vector<double> weights = {0.5, -0.25, 1.5};

template <class T, class C>
Matrix<T> decode_with(HybridCache<T, C> cache, const Matrix<T>& Q, const Matrix<T>& K, const Matrix<T>& V) {
    Matrix<T> O(K.rows(), V.cols());
    decode(cache, Q, K, V, O);
    return O;
}

/// Decodes with HybridCache<T, pool> and returns its output beside the reference's.
template <class T>
std::pair<Matrix<T>, reference::MatrixD> hybrid_and_reference(const std::string& pool, Index window, Index rate,
                                                              Index slots, const Matrix<T>& Q, const Matrix<T>& K,
                                                              const Matrix<T>& V) {
    const Index d = K.cols(), dv = V.cols();
    const auto q = reference::to_double(Q), k = reference::to_double(K), v = reference::to_double(V);
    if (pool == "mean")
        return {decode_with(HybridCache<T>(d, dv, window, rate, slots), Q, K, V),
                reference::hybrid(q, k, v, window, rate, slots, 0.0, reference::mean_pool)};
    if (pool == "max")
        return {decode_with(HybridCache<T, MaxPool>(d, dv, window, rate, slots), Q, K, V),
                reference::hybrid(q, k, v, window, rate, slots, 0.0, reference::max_pool)};
    return {decode_with(HybridCache<T, WeightedPool>(d, dv, window, rate, slots, T(0), WeightedPool(weights)), Q, K, V),
            reference::hybrid(q, k, v, window, rate, slots, 0.0, reference::weighted_pool(weights))};
}

}  // namespace

TEMPLATE_TEST_CASE("HybridCache decode equals the reference", "[memory][hybrid]", float, double) {
    using T = TestType;
    const Index window = GENERATE(1, 2, 5, 64);
    const Index rate = GENERATE(1, 2, 3);
    const Index slots = GENERATE(0, 1, 3);
    const std::string pool = GENERATE("mean", "max", "weighted");
    const Index n = GENERATE(1, 100);
    const Index d = 4, dv = 3;
    CAPTURE(window, rate, slots, pool, n);
    const Matrix<T> Q = random_matrix<T>(n, d, 61), K = random_matrix<T>(n, d, 62), V = random_matrix<T>(n, dv, 63);
    const auto [O, expected] = hybrid_and_reference(pool, window, rate, slots, Q, K, V);
    check_close(O, expected, tolerance<T>());
}

TEMPLATE_TEST_CASE("HybridCache: a user's compressor works and an empty stream attends to nothing", "[memory][hybrid]",
                   float, double) {
    using T = TestType;
    const Index n = 60, d = 5, dv = 2;
    const Matrix<T> Q = random_matrix<T>(n, d, 1), K = random_matrix<T>(n, d, 2), V = random_matrix<T>(n, dv, 3);
    HybridCache<T, LastPool> cache(d, dv, 4, 3, 2);
    Matrix<T> O(n, dv);
    Vector<T> empty(dv);
    cache.attend(Q.row(0), empty);
    CHECK(empty.isZero());
    decode(cache, Q, K, V, O);
    const auto last = [](const reference::MatrixD& rows) -> reference::RowD { return rows.row(rows.rows() - 1); };
    check_close(O,
                reference::hybrid(reference::to_double(Q), reference::to_double(K), reference::to_double(V), 4, 3, 2,
                                  0.0, last),
                tolerance<T>());
}

TEMPLATE_TEST_CASE("HybridCache laws: slots 0 is a window, rate 1 is a longer window", "[memory][hybrid]", float,
                   double) {
    using T = TestType;
    const Index window = GENERATE(1, 5, 16), slots = GENERATE(1, 3, 8);
    const Index n = 80, d = 6, dv = 4;
    CAPTURE(window, slots);
    const Matrix<T> Q = random_matrix<T>(n, d, 71), K = random_matrix<T>(n, d, 72), V = random_matrix<T>(n, dv, 73);
    const T scale = T(0.6);
    const Matrix<T> plain = decode_with(HybridCache<T>(d, dv, window, 3, 0, scale), Q, K, V);
    const Matrix<T> longer_mean = decode_with(HybridCache<T>(d, dv, window, 1, slots, scale), Q, K, V);
    const Matrix<T> longer_max = decode_with(HybridCache<T, MaxPool>(d, dv, window, 1, slots, scale), Q, K, V);

    SlidingWindowCache<T> short_window(d, dv, window, 0, scale), long_window(d, dv, window + slots, 0, scale);
    Matrix<T> expected_short(n, dv), expected_long(n, dv);
    decode(short_window, Q, K, V, expected_short);
    decode(long_window, Q, K, V, expected_long);
    check_close(plain, reference::to_double(expected_short), tolerance<T>());
    check_close(longer_mean, reference::to_double(expected_long), tolerance<T>());
    check_close(longer_max, reference::to_double(expected_long), tolerance<T>());
}

TEMPLATE_TEST_CASE("HybridCache: extend equals the token loop", "[memory][hybrid]", float, double) {
    using T = TestType;
    const Index window = 5, d = 3, dv = 2;
    const Index rate = GENERATE(1, 3), slots = GENERATE(0, 2, 4);
    const Index before = GENERATE(0, 2, 11), prompt = GENERATE(0, 3, 5, 6, 40);
    const Index after = 9, n = before + prompt + after;
    CAPTURE(rate, slots, before, prompt);
    const Matrix<T> Q = random_matrix<T>(n, d, 81), K = random_matrix<T>(n, d, 82), V = random_matrix<T>(n, dv, 83);
    HybridCache<T, WeightedPool> stepped(d, dv, window, rate, slots, T(0), WeightedPool(weights)), bulk = stepped;
    Matrix<T> expected(n, dv);
    decode(stepped, Q, K, V, expected);

    extend(bulk, K.topRows(before), V.topRows(before));
    extend(bulk, K.middleRows(before, prompt), V.middleRows(before, prompt));
    CHECK(bulk.length() == before + prompt);
    Matrix<T> O(after, dv);
    decode(bulk, Q.bottomRows(after), K.bottomRows(after), V.bottomRows(after), O);
    // Same absorbs in the same order and the same pairs attended: bit-identical.
    CHECK(O == expected.bottomRows(after));
    CHECK(bulk.footprint() == stepped.footprint());

    HybridCache<T, WeightedPool> prefilled(d, dv, window, rate, slots, T(0), WeightedPool(weights));
    Matrix<T> P(n, dv);
    prefill(prefilled, Q, K, V, P);
    CHECK(P == expected);
}

TEST_CASE("HybridCache: footprint is constant once window and slots are full", "[memory][hybrid]") {
    const Index d = 4, dv = 2, window = 6, rate = 2, slots = 3;
    const std::size_t pair = (d + dv) * sizeof(float);
    HybridCache<float> cache(d, dv, window, rate, slots);
    CHECK(cache.capacity() == (window + slots) * pair);
    const Matrix<float> K = random_matrix<float>(100, d, 1), V = random_matrix<float>(100, dv, 2);
    for (Index i = 0; i < 100; ++i) {
        cache.update(K.row(i), V.row(i));
        const Index local = std::min<Index>(i + 1, window);
        const Index compressed = std::min<Index>((std::max<Index>(0, i + 1 - window) + rate - 1) / rate, slots);
        CHECK(cache.footprint() == static_cast<std::size_t>(local + compressed) * pair);
    }
    CHECK(cache.footprint() == cache.capacity());
    cache.reset();
    CHECK(cache.footprint() == 0);
}

TEST_CASE("HybridCache: bad input throws and leaves the cache unchanged", "[memory][hybrid]") {
    HybridCache<double, MaxPool> cache(3, 2, 2, 2, 2);
    const Matrix<double> K = random_matrix<double>(7, 3, 1), V = random_matrix<double>(7, 2, 2);
    extend(cache, K, V);
    Vector<double> before(2), after(2);
    cache.attend(K.row(0), before);
    const Vector<double> k1 = Vector<double>::Ones(1), v2 = Vector<double>::Ones(2);
    CHECK_THROWS_WITH(cache.update(k1, v2), HasSubstring("HybridCache::update") && HasSubstring("'key'") && HasSubstring("1x1"));
    CHECK_THROWS_WITH(cache.extend(K, K), HasSubstring("HybridCache::extend") && HasSubstring("'values'") && HasSubstring("7x3"));
    CHECK_THROWS_WITH(cache.attend(k1, after), HasSubstring("HybridCache::attend") && HasSubstring("'query'"));
    CHECK(cache.length() == 7);
    cache.attend(K.row(0), after);
    CHECK(after == before);

    CHECK_THROWS_WITH(HybridCache<double>(3, 2, 0, 2, 2), HasSubstring("HybridCache") && HasSubstring("'window'"));
    CHECK_THROWS_WITH(HybridCache<double>(3, 2, 4, 0, 2), HasSubstring("'rate'") && HasSubstring("is 0"));
    CHECK_THROWS_WITH(HybridCache<double>(3, 2, 4, 2, -1), HasSubstring("'slots'"));
    CHECK_THROWS_WITH((HybridCache<double, WeightedPool>(3, 2, 4, 4, 2, 0.0, WeightedPool(weights))),
                      HasSubstring("'rate'") && HasSubstring("max_rate"));
}
