#include "support.hpp"

#include <memattn/memattn.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

using namespace memattn;
using memattn::test::check_close;
using memattn::test::long_tokens;
using memattn::test::random_matrix;
using memattn::test::tolerance;
using reference::MatrixD;
using reference::to_double;

namespace {

/// The documented output error on unit-scale inputs (storage/compact.hpp).
template <class S>
constexpr double storage_tolerance() {
    if constexpr (std::is_same_v<S, Eigen::bfloat16>)
        return 1e-2;
    else if constexpr (std::is_same_v<S, Eigen::half>)
        return 2e-3;
    else if constexpr (std::is_same_v<S, Q4>)
        return 1e-1;
    else if constexpr (std::is_same_v<S, Q4Affine>)
        return 1e-1;
    else if constexpr (std::is_same_v<S, Fp8E4M3>)
        return 5e-2;
    else if constexpr (std::is_same_v<S, Fp8E5M2> || std::is_same_v<S, PerTokenScale<Fp8E5M2>>)
        return 1e-1;
    else if constexpr (std::is_same_v<S, PerTokenScale<Fp8E4M3>>)
        return 5e-2;
    else
        return 2e-2;
}

/// What storage S gives back for the rows of X.
template <class T, class S>
Matrix<T> stored(const Matrix<T>& X) {
    Matrix<T> out(X.rows(), X.cols());
    detail::round_trip<T, S>(X, out.data(), X.cols());
    return out;
}

template <class M>
std::string snapshot_of(const M& memory) {
    std::ostringstream out(std::ios::binary);
    save(memory, out);
    return out.str();
}

/// MultiHead over the caches `make` gives, past one split piece of pairs: the same bits on
/// one thread and on two, and each query head's output its KV head's cache's alone.
template <class Make>
void check_layer_against_heads(const HeadLayout& layout, Make make) {
    using Cache = decltype(make());
    const Index d = layout.head_dim, dv = layout.value_dim, g = layout.q_heads / layout.kv_heads;
    const Index n = MultiHead<KVCache<float>>::split_keys + 77;
    const Matrix<float> LK = random_matrix<float>(n, layout.kv_heads * d, 5),
                        LV = random_matrix<float>(n, layout.kv_heads * dv, 6),
                        LQ = random_matrix<float>(2, layout.q_heads * d, 7);
    MultiHead<Cache> layer(layout, [&](Index) { return make(); });
    layer.extend(LK, LV);
    Matrix<float> serial(2, layout.q_heads * dv), threaded(2, layout.q_heads * dv), heads(2, layout.q_heads * dv);
    const SerialExecutor one;
    const OpenMPExecutor two{.threads = 2};
    layer.set_executor(one);
    for (Index i = 0; i < 2; ++i)
        layer.attend(LQ.row(i), serial.row(i));
    layer.set_executor(two);
    for (Index i = 0; i < 2; ++i)
        layer.attend(LQ.row(i), threaded.row(i));
    CHECK(serial.cwiseEqual(threaded).all());
    for (Index h = 0; h < layout.q_heads; ++h) {
        Cache head = make();
        memattn::extend(head, LK.middleCols(h / g * d, d), LV.middleCols(h / g * dv, dv));
        for (Index i = 0; i < 2; ++i)
            head.attend(LQ.row(i).segment(h * d, d), heads.row(i).segment(h * dv, dv));
    }
    check_close(serial, to_double(heads), 1e-5);
}

}  // namespace

// Every format with float, and with double. The sanitize build (MEMATTN_TEST_MEMORY_ONLY)
// keeps every format with float and two with double: what ASan checks of a format (its
// packing, copies and snapshot reads) does not depend on T, and the caches' code for
// double is there with bfloat16 and a scaled FP8 format (the whole list is 16 pairs, the
// heaviest instantiation of that build's longer unity group).
#if defined(MEMATTN_TEST_MEMORY_ONLY)
#define MEMATTN_STORAGE_PAIRS                                                                                  \
    (std::pair<float, Eigen::bfloat16>), (std::pair<float, Eigen::half>), (std::pair<float, Q8>),             \
        (std::pair<float, Q4>), (std::pair<float, Q4Affine>), (std::pair<double, Eigen::bfloat16>),           \
        (std::pair<float, Fp8E4M3>), (std::pair<float, Fp8E5M2>), (std::pair<float, PerTokenScale<Fp8E4M3>>), \
        (std::pair<double, PerTokenScale<Fp8E5M2>>)
#else
#define MEMATTN_STORAGE_PAIRS                                                                                  \
    (std::pair<float, Eigen::bfloat16>), (std::pair<float, Eigen::half>), (std::pair<float, Q8>),             \
        (std::pair<float, Q4>), (std::pair<float, Q4Affine>), (std::pair<double, Eigen::bfloat16>),           \
        (std::pair<double, Eigen::half>), (std::pair<double, Q8>), (std::pair<double, Q4>),                   \
        (std::pair<double, Q4Affine>), (std::pair<float, Fp8E4M3>), (std::pair<double, Fp8E4M3>),              \
        (std::pair<float, Fp8E5M2>), (std::pair<double, Fp8E5M2>), (std::pair<float, PerTokenScale<Fp8E4M3>>), \
        (std::pair<double, PerTokenScale<Fp8E5M2>>)
#endif

TEMPLATE_TEST_CASE("Compact storage: a stored value is within its rounding of the input", "[storage]",
                   MEMATTN_STORAGE_PAIRS) {
    using T = typename TestType::first_type;
    using S = typename TestType::second_type;
    for (const Index cols : {1, 5, 31, 32, 33, 100}) {
        const Matrix<T> X = random_matrix<T>(7, cols, 3, 4.0);
        const Matrix<T> Y = stored<T, S>(X);
        for (Index r = 0; r < X.rows(); ++r)
            for (Index c = 0; c < cols; ++c) {
                const double x = double(X(r, c)), y = double(Y(r, c));
                INFO(detail::storage_name<S> << ", cols " << cols << ", x = " << x << ", stored " << y);
                // A double is rounded to float first: one more rounding of 2^-24 relative.
                const double via_float = std::is_same_v<T, double> ? 0x1p-24 * std::abs(x) : 0.0;
                const Index b0 = c / 32 * 32;
                const auto block = X.row(r).segment(b0, std::min<Index>(32, cols - b0));
                const double amax = double(block.cwiseAbs().maxCoeff());
                if constexpr (std::is_same_v<S, Q8>) {  // ≤ half a step of the block's scale max|x| / 127
                    REQUIRE(std::abs(x - y) <= amax / 254.0 * (1 + 1e-5) + via_float);
                } else if constexpr (std::is_same_v<S, Q4>) {  // ≤ half a step of max|x| / 7
                    REQUIRE(std::abs(x - y) <= amax / 14.0 * (1 + 1e-5) + via_float);
                } else if constexpr (std::is_same_v<S, Q4Affine>) {  // ≤ half a step of (max − min) / 15
                    const double range = double(block.maxCoeff()) - double(block.minCoeff());
                    REQUIRE(std::abs(x - y) <= range / 30.0 * (1 + 1e-5) + 0x1p-23 * amax + via_float);
                } else if constexpr (std::is_same_v<S, Fp8E4M3>) {  // half a step: 2^-4 relative, 2^-10 subnormal
                    REQUIRE(std::abs(x - y) <= 0x1p-4 * std::abs(x) + 0x1p-10 + via_float);
                } else if constexpr (std::is_same_v<S, Fp8E5M2>) {  // half a step: 2^-3 relative, 2^-17 subnormal
                    REQUIRE(std::abs(x - y) <= 0x1p-3 * std::abs(x) + 0x1p-17 + via_float);
                } else if constexpr (std::is_same_v<S, PerTokenScale<Fp8E4M3>> || std::is_same_v<S, PerTokenScale<Fp8E5M2>>) {
                    // PerTokenScale<F>: F's half step at x / s, times s = max|x| / largest, and
                    // float's roundings of x / s and of s · value (2^-24 each).
                    using F = typename S::storage;
                    const bool e4m3 = std::is_same_v<F, Fp8E4M3>;
                    const double s = double(X.row(r).cwiseAbs().maxCoeff()) / (e4m3 ? 448.0 : 57344.0);
                    const double step = e4m3 ? 0x1p-10 : 0x1p-17;  // half the subnormal step, before s
                    REQUIRE(std::abs(x - y) <= (e4m3 ? 0x1p-4 : 0x1p-3) * std::abs(x) * (1 + 0x1p-22) + step * s +
                                                   via_float);
                } else {  // round to nearest: half an ulp of 8 (bfloat16) or 11 (half) significant bits
                    const double half_ulp = std::is_same_v<S, Eigen::half> ? 0x1p-11 : 0x1p-8;
                    REQUIRE(std::abs(x - y) <= half_ulp * std::abs(x) + via_float + 0x1p-25);
                }
            }
    }
    // Values every storage holds exactly come back exactly (Q8: a block with max|x| = 127
    // has scale 1; Q4: max|x| = 7; Q4Affine: min 0, max 15).
    Matrix<T> exact(1, 4);
    if constexpr (std::is_same_v<S, Q4>)
        exact << T(0), T(-7), T(7), T(5);
    else if constexpr (std::is_same_v<S, Q4Affine>)
        exact << T(0), T(15), T(3), T(5);
    else if constexpr (std::is_same_v<S, Fp8E4M3>)
        exact << T(0), T(-448), T(448), T(0.015625);
    else if constexpr (std::is_same_v<S, Fp8E5M2>)
        exact << T(0), T(-57344), T(57344), T(0x1p-16);
    else if constexpr (std::is_same_v<S, PerTokenScale<Fp8E4M3>>)  // s = 1
        exact << T(0), T(-448), T(448), T(0.015625);
    else if constexpr (std::is_same_v<S, PerTokenScale<Fp8E5M2>>)  // s = 1/64: 57344/64 = 896
        exact << T(0), T(-896), T(896), T(0x1p-16);
    else
        exact << T(0), T(-127), T(127), T(5);
    CHECK(stored<T, S>(exact) == exact);
    // Q4 keeps a block's largest magnitude, Q4Affine its smallest value, exactly.
    if constexpr (Q4Storage<S>) {
        const Matrix<T> X = random_matrix<T>(3, 64, 9, 3.0);
        const Matrix<T> Y = stored<T, S>(X);
        for (Index r = 0; r < 3; ++r)
            for (Index b = 0; b < 2; ++b) {
                const auto x = X.row(r).segment(32 * b, 32), y = Y.row(r).segment(32 * b, 32);
                Index at = 0;
                if constexpr (std::is_same_v<S, Q4>)
                    x.cwiseAbs().maxCoeff(&at);
                else
                    x.minCoeff(&at);
                const double scale = std::is_same_v<T, double> ? 0x1p-22 * std::abs(double(x(at))) : 0x1p-23 * std::abs(double(x(at)));
                CHECK(std::abs(double(y(at)) - double(x(at))) <= scale);
            }
    }
}

TEMPLATE_TEST_CASE("Compact storage: every cache equals the plain one fed the stored values, and prefill equals decode",
                   "[storage]", MEMATTN_STORAGE_PAIRS) {
    using T = typename TestType::first_type;
    using S = typename TestType::second_type;
    const double tol = tolerance<T>();
    for (const auto& shape : {std::tuple<Index, Index, Index>{0, 4, 3}, {1, 1, 1}, {37, 5, 7}, {long_tokens, 40, 33}}) {
        const Index n = std::get<0>(shape), d = std::get<1>(shape), dv = std::get<2>(shape);  // lambdas capture these
        INFO(detail::storage_name<S> << ": n = " << n << ", d = " << d << ", dv = " << dv);
        const Matrix<T> Q = random_matrix<T>(n, d, 1), K = random_matrix<T>(n, d, 2), V = random_matrix<T>(n, dv, 3);
        const Matrix<T> Ks = stored<T, S>(K), Vs = stored<T, S>(V);
        const Index cut = n / 3;  // prefill after a cached prefix of `cut` tokens
        // decode through the compact cache = decode through the plain one fed the stored
        // values; an extend of a prefix then prefill of the rest, and a prefill of all, the same.
        const auto check_cache = [&](auto compact, auto plain) {
            Matrix<T> expected(n, dv), decoded(n, dv), rest(n - cut, dv), whole(n, dv);
            auto split = compact, whole_prefill = compact;
            decode(plain, Q, Ks, Vs, expected);
            decode(compact, Q, K, V, decoded);
            check_close(decoded, to_double(expected), tol);
            memattn::extend(split, K.topRows(cut), V.topRows(cut));
            prefill(split, Q.bottomRows(n - cut), K.bottomRows(n - cut), V.bottomRows(n - cut), rest);
            check_close(rest, to_double(expected.bottomRows(n - cut)), tol);
            prefill(whole_prefill, Q, K, V, whole);
            check_close(whole, to_double(expected), tol);
            CHECK(compact.length() == n);
            CHECK(split.length() == n);
        };
        check_cache(KVCache<T, S>(d, dv), KVCache<T>(d, dv));
        check_cache(SlidingWindowCache<T, S>(d, dv, 50, 2), SlidingWindowCache<T>(d, dv, 50, 2));
        check_cache(SlidingWindowCache<T, S>(d, dv, 400), SlidingWindowCache<T>(d, dv, 400));  // window ≥ n
        check_cache(HybridCache<T, MeanPool, S>(d, dv, 20, 3, 5), HybridCache<T>(d, dv, 20, 3, 5));
        check_cache(HybridCache<T, MaxPool, S>(d, dv, 7, 2, 40), HybridCache<T, MaxPool>(d, dv, 7, 2, 40));
    }
}

// A claim about errors, not memory: the native build's (the formats' paths run under ASan
// in the tests around it).
#if !defined(MEMATTN_TEST_MEMORY_ONLY)
TEMPLATE_TEST_CASE("Compact storage: outputs within the documented error of the double reference", "[storage]",
                   MEMATTN_STORAGE_PAIRS) {
    using T = typename TestType::first_type;
    using S = typename TestType::second_type;
    const Index n = 400, d = 64, dv = 64;
    const Matrix<T> Q = random_matrix<T>(n, d, 4), K = random_matrix<T>(n, d, 5), V = random_matrix<T>(n, dv, 6);
    const MatrixD Qd = to_double(Q), Kd = to_double(K), Vd = to_double(V);
    Matrix<T> O(n, dv);
    KVCache<T, S> cache(d, dv);
    prefill(cache, Q, K, V, O);
    check_close(O, reference::softmax_attention(Qd, Kd, Vd).out, storage_tolerance<S>());
    SlidingWindowCache<T, S> window(d, dv, 64, 4);
    decode(window, Q, K, V, O);
    check_close(O, reference::softmax_attention(Qd, Kd, Vd, 0, 64, 4).out, storage_tolerance<S>());
    HybridCache<T, MeanPool, S> hybrid(d, dv, 32, 4, 16);
    decode(hybrid, Q, K, V, O);
    check_close(O, reference::hybrid(Qd, Kd, Vd, 32, 4, 16, 0, reference::mean_pool), storage_tolerance<S>());
}
#endif

TEMPLATE_TEST_CASE("Compact storage: footprint counts the stored bytes", "[storage]", float, double) {
    using T = TestType;
    const Index d = 128, n = 1000;
    const Matrix<T> K = random_matrix<T>(n, d, 1);
    KVCache<T> plain(d, d);
    KVCache<T, Eigen::bfloat16> bf16(d, d);
    KVCache<T, Eigen::half> f16(d, d);
    KVCache<T, Q8> q8(d, d);
    KVCache<T, Q4> q4(d, d);
    KVCache<T, Q4Affine> q4_affine(d, d);
    KVCache<T, Fp8E4M3> fp8(d, d);
    KVCache<T, Fp8E5M2> fp8_e5m2(d, d);
    KVCache<T, PerTokenScale<Fp8E4M3>> fp8_scaled(d, d);
    memattn::extend(fp8, K, K);
    memattn::extend(fp8_e5m2, K, K);
    memattn::extend(fp8_scaled, K, K);
    memattn::extend(plain, K, K);
    memattn::extend(bf16, K, K);
    memattn::extend(f16, K, K);
    memattn::extend(q8, K, K);
    memattn::extend(q4, K, K);
    memattn::extend(q4_affine, K, K);
    const auto pairs = static_cast<std::size_t>(n);
    CHECK(plain.footprint() == pairs * 2 * d * sizeof(T));
    CHECK(bf16.footprint() == pairs * 2 * d * 2);
    CHECK(f16.footprint() == pairs * 2 * d * 2);
    CHECK(q8.footprint() == pairs * 2 * (d + 4 * d / 32));  // 0.28 of float's
    CHECK(q4.footprint() == pairs * 2 * (d / 2 + 4 * d / 32));  // 0.156 of float's
    CHECK(q4_affine.footprint() == pairs * 2 * (d / 2 + 8 * d / 32));  // 0.19 of float's
    CHECK(fp8.footprint() == pairs * 2 * d);  // a byte a value
    CHECK(fp8_e5m2.footprint() == pairs * 2 * d);
    CHECK(fp8_scaled.footprint() == pairs * 2 * (d + 4));  // and a float per row
    SlidingWindowCache<T, Q4Affine> window4(33, 33, 10, 1);  // the short last block takes 16 bytes too
    memattn::extend(window4, random_matrix<T>(20, 33, 2), random_matrix<T>(20, 33, 3));
    CHECK(window4.footprint() == 11u * 2 * (2 * 16 + 2 * 8));
    SlidingWindowCache<T, Q8> window(33, 33, 10, 1);
    memattn::extend(window, random_matrix<T>(20, 33, 2), random_matrix<T>(20, 33, 3));
    CHECK(window.footprint() == 11u * 2 * (33 + 2 * 4));  // 33 values in two blocks
}

TEMPLATE_TEST_CASE("Compact storage: float16 refuses finite values past its range; non-finite values poison",
                   "[storage]", float, double) {
    using T = TestType;
    KVCache<T, Eigen::half> cache(4, 3);
    memattn::extend(cache, random_matrix<T>(5, 4, 1), random_matrix<T>(5, 3, 2));
    const std::string before = snapshot_of(cache);
    Matrix<T> K = random_matrix<T>(3, 4, 3), V = random_matrix<T>(3, 3, 4);
    K(1, 2) = T(70000);
    CHECK_THROWS_WITH(memattn::extend(cache, K, V), Catch::Matchers::Contains("which float16 storage would hold as infinity"));
    CHECK_THROWS_AS(cache.update(K.row(1), V.row(1)), std::invalid_argument);
    Matrix<T> O(3, 3);
    CHECK_THROWS_AS(prefill(cache, K, K, V, O), std::invalid_argument);
    SlidingWindowCache<T, Eigen::half> window(4, 3, 2);
    CHECK_THROWS_AS(window.update(K.row(1), V.row(1)), std::invalid_argument);
    HybridCache<T, MeanPool, Eigen::half> hybrid(4, 3, 2, 2, 2);
    CHECK_THROWS_AS(hybrid.update(K.row(1), V.row(1)), std::invalid_argument);
    CHECK(snapshot_of(cache) == before);
    CHECK(window.length() == 0);
    K(1, 2) = T(65504);  // the largest float16 is accepted, exactly
    memattn::extend(cache, K.topRows(2), V.topRows(2));
    // ±∞ is stored as it is, and the output of a query that sees it is not finite.
    K(0, 0) = std::numeric_limits<T>::infinity();
    cache.update(K.row(0), V.row(0));
    Vector<T> out(3);
    cache.attend(Vector<T>::Ones(4), out);
    CHECK_FALSE(out.allFinite());
}

TEMPLATE_TEST_CASE("Compact storage: a Q8 or Q4 block holding NaN or infinity reads as NaN", "[storage]",
                   (std::pair<float, Q8>), (std::pair<double, Q8>), (std::pair<float, Q4>), (std::pair<double, Q4>),
                   (std::pair<float, Q4Affine>), (std::pair<double, Q4Affine>)) {
    using T = typename TestType::first_type;
    using S = typename TestType::second_type;
    KVCache<T, S> cache(40, 3);
    Matrix<T> K = random_matrix<T>(2, 40, 1), V = random_matrix<T>(2, 3, 2);
    K(1, 35) = std::numeric_limits<T>::quiet_NaN();  // in the second block of the row
    memattn::extend(cache, K.topRows(1), V.topRows(1));
    Vector<T> out(3);
    cache.attend(Vector<T>::Ones(40), out);
    CHECK(out.allFinite());
    cache.update(K.row(1), V.row(1));
    cache.attend(Vector<T>::Ones(40), out);
    CHECK(out.array().isNaN().all());
}

TEMPLATE_TEST_CASE("Compact storage: snapshots resume bitwise and name the storage", "[storage][snapshot]", float,
                   double) {
    using T = TestType;
    const Matrix<T> K = random_matrix<T>(30, 6, 1), V = random_matrix<T>(30, 5, 2), Q = random_matrix<T>(10, 6, 3);
    const auto resume = [&](auto make) {
        auto a = make(), b = make();
        memattn::extend(a, K.topRows(20), V.topRows(20));
        std::istringstream in(snapshot_of(a), std::ios::binary);
        load(b, in);
        Matrix<T> oa(10, 5), ob(10, 5);
        decode(a, Q, K.bottomRows(10), V.bottomRows(10), oa);
        decode(b, Q, K.bottomRows(10), V.bottomRows(10), ob);
        CHECK(oa.cwiseEqual(ob).all());
        CHECK(snapshot_of(a) == snapshot_of(b));
    };
    resume([] { return KVCache<T, Eigen::bfloat16>(6, 5); });
    resume([] { return KVCache<T, Q8>(6, 5); });
    resume([] { return SlidingWindowCache<T, Eigen::half>(6, 5, 7, 2); });
    resume([] { return SlidingWindowCache<T, Q8>(6, 5, 7, 2); });
    resume([] { return HybridCache<T, MeanPool, Eigen::bfloat16>(6, 5, 7, 3, 2); });
    resume([] { return HybridCache<T, WeightedPool, Q8>(6, 5, 7, 2, 2, T(0), WeightedPool({0.5, 0.5})); });
    resume([] { return KVCache<T, Q4>(6, 5); });
    resume([] { return KVCache<T, Q4Affine>(6, 5); });
    resume([] { return SlidingWindowCache<T, Q4>(6, 5, 7, 2); });
    resume([] { return HybridCache<T, MeanPool, Q4Affine>(6, 5, 7, 3, 2); });
    resume([] { return KVCache<T, Fp8E4M3>(6, 5); });
    resume([] { return SlidingWindowCache<T, Fp8E4M3>(6, 5, 7, 2); });
    resume([] { return KVCache<T, Fp8E5M2>(6, 5); });
    resume([] { return HybridCache<T, MeanPool, Fp8E5M2>(6, 5, 7, 3, 2); });
    resume([] { return KVCache<T, PerTokenScale<Fp8E4M3>>(6, 5); });
    resume([] { return SlidingWindowCache<T, PerTokenScale<Fp8E5M2>>(6, 5, 7, 2); });

    KVCache<T, Eigen::bfloat16> bf16(6, 5);
    KVCache<T> plain(6, 5);
    std::istringstream in(snapshot_of(bf16), std::ios::binary);
    const std::string scalar = std::is_same_v<T, float> ? "float32" : "float64";
    CHECK_THROWS_WITH(load(plain, in), Catch::Matchers::Contains("the storage is bfloat16 in the stream, " + scalar +
                                                                 " in the memory"));
    KVCache<T, Q4> q4(6, 5);
    KVCache<T, Q4Affine> q4_affine(6, 5);
    std::istringstream in4(snapshot_of(q4), std::ios::binary);
    CHECK_THROWS_WITH(load(q4_affine, in4), Catch::Matchers::Contains("the storage is q4 in the stream, q4_affine in the memory"));
    KVCache<T, Fp8E4M3> e4m3(6, 5);  // the FP8 formats' names come from their own header
    KVCache<T, Fp8E5M2> e5m2(6, 5);
    std::istringstream in8(snapshot_of(e5m2), std::ios::binary);
    CHECK_THROWS_WITH(load(e4m3, in8), Catch::Matchers::Contains("the storage is fp8_e5m2 in the stream, fp8_e4m3 in the memory"));
    CHECK(snapshot::type_name(17) == "fp8_e5m2_per_token");
    CHECK(snapshot::type_name(18) == "unknown type 18");
}

TEMPLATE_TEST_CASE("Compact storage: truncate rolls a compact cache back", "[storage][truncate]", float, double) {
    using T = TestType;
    const Matrix<T> K = random_matrix<T>(12, 6, 1), V = random_matrix<T>(12, 5, 2);
    KVCache<T, Q8> cache(6, 5), shorter(6, 5);
    memattn::extend(cache, K, V);
    memattn::extend(shorter, K.topRows(7), V.topRows(7));
    cache.truncate(7);
    CHECK(snapshot_of(cache) == snapshot_of(shorter));
    SlidingWindowCache<T, Eigen::bfloat16> window(6, 5, 9, 1), window_shorter(6, 5, 9, 1);
    memattn::extend(window, K.topRows(10), V.topRows(10));
    memattn::extend(window_shorter, K.topRows(4), V.topRows(4));
    window.truncate(4);
    CHECK(snapshot_of(window) == snapshot_of(window_shorter));
}

TEST_CASE("Compact storage: MultiHead over compact caches equals its heads", "[storage][multihead]") {
    const HeadLayout layout{.q_heads = 4, .kv_heads = 2, .head_dim = 8, .value_dim = 6};
    MultiHead<KVCache<float, Q8>> layer(layout, [](Index) { return KVCache<float, Q8>(8, 6); });
    MultiHead<SlidingWindowCache<float, Eigen::half>> windows(
        layout, [](Index) { return SlidingWindowCache<float, Eigen::half>(8, 6, 5, 1); });
    const Matrix<float> Q = random_matrix<float>(20, 32, 1), K = random_matrix<float>(20, 16, 2),
                        V = random_matrix<float>(20, 12, 3);
    Matrix<float> O(20, 24), W(20, 24);
    decode(layer, Q, K, V, O);
    prefill(windows, Q, K, V, W);
    for (Index h = 0; h < 4; ++h) {
        const Index kv = h / 2;
        KVCache<float, Q8> head(8, 6);
        SlidingWindowCache<float, Eigen::half> window(8, 6, 5, 1);
        Matrix<float> expected(20, 6);
        decode(head, Q.middleCols(h * 8, 8), K.middleCols(kv * 8, 8), V.middleCols(kv * 6, 6), expected);
        check_close(O.middleCols(h * 6, 6), to_double(expected), tolerance<float>());
        decode(window, Q.middleCols(h * 8, 8), K.middleCols(kv * 8, 8), V.middleCols(kv * 6, 6), expected);
        check_close(W.middleCols(h * 6, 6), to_double(expected), tolerance<float>());
    }
}

TEMPLATE_TEST_CASE("Compact storage: rows added in registers equal row-by-row adds, bit for bit", "[storage]",
                   Eigen::bfloat16, Eigen::half, Q8, Q4, Q4Affine) {
    if constexpr (detail::fused_storage) {
        using S = TestType;
        for (const Index cols : {1, 15, 16, 33, 100, 130, 200}) {
            const Index n = 37;
            const Matrix<float> X = random_matrix<float>(n, cols, 5, 3.0);
            detail::StoredRows<float, S> rows(n, cols);
            rows.put_rows(0, X);
            const Matrix<float> w = random_matrix<float>(1, n, 6);
            const Matrix<float> start = random_matrix<float>(1, cols, 7);
            Matrix<float> one_by_one = start, in_registers = start;
            for (Index j = 3; j < n; ++j)
                rows.add_scaled(j, w(0, j), one_by_one.data());
            rows.add_rows(3, n - 3, w.data() + 3, in_registers.data(), 4, n);  // with prefetches
            CAPTURE(cols);
            CHECK(in_registers == one_by_one);
        }
    }
}

TEMPLATE_TEST_CASE("Compact storage: the dot product in registers equals the stored values' dot, to float rounding",
                   "[storage]", Eigen::bfloat16, Eigen::half, Q8, Q4, Q4Affine) {
    if constexpr (detail::fused_storage) {
        using S = TestType;
        for (const Index cols : {1, 15, 16, 31, 32, 33, 64, 100, 130, 200}) {
            const Index n = 9;
            const Matrix<float> X = random_matrix<float>(n, cols, 8, 3.0), q = random_matrix<float>(1, cols, 9);
            detail::StoredRows<float, S> rows(n, cols);
            rows.put_rows(0, X);
            for (Index r = 0; r < n; ++r) {
                double exact = 0, q_mass = 0, largest = 0;
                for (Index c = 0; c < cols; ++c) {
                    const double v = rows.stored_value(r, c);
                    exact += static_cast<double>(q(0, c)) * v;
                    q_mass += std::abs(static_cast<double>(q(0, c)));
                    largest = std::max(largest, std::abs(v));
                }
                // Float sums of cols terms; a block's scale, zero point and codes each at
                // most three times the row's largest magnitude.
                const double bound = static_cast<double>(cols + 4) * 0x1p-24 * 3 * largest * q_mass;
                CAPTURE(cols, r);
                CHECK(std::abs(static_cast<double>(rows.dot(r, q.data())) - exact) <= bound);
            }
        }
    }
}

TEMPLATE_TEST_CASE("Compact storage: grouped attend equals the plain cache's fed the stored values, bit for bit",
                   "[storage][group]", MEMATTN_STORAGE_PAIRS) {
    using T = typename TestType::first_type;
    using S = typename TestType::second_type;
    // Off every tile: 300 pairs (group_keys 128, conversion steps of a few rows), d = 40
    // and dv = 33 (off the packets), groups from 1 to 17 (one query, the dot route, the
    // tiled route, more than group_rows).
    const Index n = 300, d = 40, dv = 33;
    const Matrix<T> K = random_matrix<T>(n, d, 2), V = random_matrix<T>(n, dv, 3);
    const Matrix<T> Ks = stored<T, S>(K), Vs = stored<T, S>(V);
    const auto check = [&](auto compact, auto plain) {
        memattn::extend(compact, K, V);
        memattn::extend(plain, Ks, Vs);
        for (const Index g : {1, 2, 4, 5, 8, 16, 17}) {
            INFO(detail::storage_name<S> << ", g = " << g);
            const Matrix<T> Q = random_matrix<T>(g, d, 10 + static_cast<std::uint64_t>(g));
            Matrix<T> grouped(g, dv), expected(g, dv), single(g, dv);
            compact.attend_group(Q, grouped);
            plain.attend_group(Q, expected);
            for (Index r = 0; r < g; ++r)
                compact.attend(Q.row(r), single.row(r));
            // Groups of group_rows queries; a group of one is exactly the cache's attend
            // (in registers: other arithmetic than the plain cache's), the others are
            // bitwise the plain cache's grouped attend.
            for (Index r0 = 0; r0 < g; r0 += detail::group_rows) {
                const Index rows = std::min(detail::group_rows, g - r0);
                const auto& same = rows == 1 ? single : expected;
                CHECK((grouped.middleRows(r0, rows).array() == same.middleRows(r0, rows).array()).all());
            }
            check_close(grouped, to_double(single), tolerance<T>());
        }
    };
    check(KVCache<T, S>(d, dv), KVCache<T>(d, dv));
    check(SlidingWindowCache<T, S>(d, dv, 150, 3), SlidingWindowCache<T>(d, dv, 150, 3));  // sinks + a wrapped ring
    check(HybridCache<T, MeanPool, S>(d, dv, 64, 4, 30), HybridCache<T>(d, dv, 64, 4, 30));
}

TEMPLATE_TEST_CASE("Grouped attend: a query's output is the same bits in every group it is in, for every storage",
                   "[storage][group]", float, Eigen::bfloat16, Eigen::half, Q8, Q4, Q4Affine, Fp8E4M3,
                   Fp8E5M2, PerTokenScale<Fp8E4M3>) {
    using S = TestType;
    // Groups below a packet's lanes take tiles of GQ queries × GK keys (decode_attention.hpp);
    // every logit adds its lanes by the same tree, so query r's output must not depend on
    // the tiles its group is cut into (a group of 7 is tiles of 4, 2 and 1) nor on which
    // lane of a tile it lands in. Lengths off every tile and block (GK up to 16, blocks of
    // 128 keys), head dims off the packets and d = 1, against the double reference too.
    const Index lanes = detail::packet_lanes<float>;
    for (const auto& [n, d, dv] : {std::tuple<Index, Index, Index>{1, 1, 1}, {3, 16, 16}, {130, 40, 33},
                                   {300, 128, 128}, {261, 17, 70}}) {
        const Matrix<float> K = random_matrix<float>(n, d, 20), V = random_matrix<float>(n, dv, 21);
        KVCache<float, S> cache(d, dv);
        memattn::extend(cache, K, V);
        const Index most = std::min<Index>(lanes - 1, detail::group_rows);
        const Matrix<float> Q = random_matrix<float>(most, d, 22, 2.0);
        // Each query alone in a group of two (itself twice): the tile of two.
        Matrix<float> pairs(most, dv);
        for (Index r = 0; r < most; ++r) {
            Matrix<float> twice(2, d), out(2, dv);
            twice << Q.row(r), Q.row(r);
            cache.attend_group(twice, out);
            CHECK((out.row(0).array() == out.row(1).array()).all());
            pairs.row(r) = out.row(0);
        }
        Matrix<double> exact(most, dv);  // each query sees every pair: a one-query call each
        for (Index r = 0; r < most; ++r)
            exact.row(r) = reference::softmax_attention(to_double(Q.row(r)), to_double(stored<float, S>(K)),
                                                        to_double(stored<float, S>(V)))
                               .out;
        for (Index g = 2; g <= most; ++g) {
            INFO(detail::storage_name<S> << ", n = " << n << ", d = " << d << ", dv = " << dv << ", g = " << g);
            Matrix<float> grouped(g, dv);
            cache.attend_group(Q.topRows(g), grouped);
            if constexpr (detail::decode_tiles)
                CHECK((grouped.array() == pairs.topRows(g).array()).all());
            check_close(grouped, exact.topRows(g), tolerance<float>());
        }
    }
}

TEMPLATE_TEST_CASE("Compact storage: MultiHead splits compact caches over threads, the same bits for any executor",
                   "[storage][multihead][split]", Eigen::bfloat16, Eigen::half, Q8, Q4, Q4Affine, Fp8E4M3,
                   Fp8E5M2, PerTokenScale<Fp8E5M2>) {
    using S = TestType;
    const HeadLayout layout{.q_heads = 8, .kv_heads = 2, .head_dim = 16};
    const Index n = 2 * MultiHead<KVCache<float>>::split_keys + 333;  // three pieces per head
    const Matrix<float> K = random_matrix<float>(n, 32, 4), V = random_matrix<float>(n, 32, 5);
    const Matrix<float> Q = random_matrix<float>(3, 128, 6);
    Matrix<float> Ks(n, 32), Vs(n, 32);  // stored head by head: a Q8 block ends with its head's row
    for (Index kv = 0; kv < 2; ++kv) {
        Ks.middleCols(kv * 16, 16) = stored<float, S>(Matrix<float>(K.middleCols(kv * 16, 16)));
        Vs.middleCols(kv * 16, 16) = stored<float, S>(Matrix<float>(V.middleCols(kv * 16, 16)));
    }
    MultiHead<KVCache<float, S>> compact(layout, [](Index) { return KVCache<float, S>(16, 16); });
    MultiHead<KVCache<float>> plain(layout, [](Index) { return KVCache<float>(16, 16); });
    compact.extend(K, V);
    plain.extend(Ks, Vs);
    Matrix<float> expected(3, 128);
    for (Index i = 0; i < 3; ++i)
        plain.attend(Q.row(i), expected.row(i));
    for (const int threads : {1, 2, 3, 5}) {
        INFO(detail::storage_name<S> << ", " << threads << " threads");
        const OpenMPExecutor executor{.threads = threads};
        compact.set_executor(executor);
        Matrix<float> O(3, 128);
        for (Index i = 0; i < 3; ++i)
            compact.attend(Q.row(i), O.row(i));
        CHECK((O.array() == expected.array()).all());
    }
    const SerialExecutor serial;
    compact.set_executor(serial);
    Matrix<float> O(1, 128);
    compact.attend(Q.row(0), O.row(0));
    CHECK((O.array() == expected.row(0).array()).all());
    // Against the double reference within the storage's documented error, one head.
    const Index h = 5, kv = h / 4;
    const auto exact = reference::softmax_attention(to_double(Q.row(0).segment(h * 16, 16)),
                                                    to_double(K.middleCols(kv * 16, 16)),
                                                    to_double(V.middleCols(kv * 16, 16)));
    check_close(O.middleCols(h * 16, 16), exact.out, storage_tolerance<S>());
}

namespace {

/// The layout of an FP8 format, written out: exponent bits, mantissa bits, whether the
/// top exponent holds ±∞ (m = 0) and NaNs (E5M2) or normal numbers but for one NaN (E4M3).
struct Fp8Reference {
    int exponent_bits, mantissa_bits;
    bool ieee;
    double overflow;  // where a finite magnitude is refused: the largest + half a step

    /// The value of a byte from the format's definition, in double.
    [[nodiscard]] double value(int byte) const {
        const int m_bits = mantissa_bits, top = (1 << exponent_bits) - 1, bias = (1 << (exponent_bits - 1)) - 1;
        const int e = (byte >> m_bits) & top, m = byte & ((1 << m_bits) - 1);
        const double sign = (byte & 0x80) != 0 ? -1.0 : 1.0;
        if (ieee && e == top)
            return m == 0 ? sign * std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
        if (!ieee && e == top && m == (1 << m_bits) - 1)
            return std::numeric_limits<double>::quiet_NaN();
        return sign * (e == 0 ? std::ldexp(double(m), 1 - bias - m_bits)
                              : std::ldexp(1.0 + m / double(1 << m_bits), e - bias));
    }

    /// The byte nearest to x (ties to the even mantissa), by search over every finite byte
    /// of x's sign; from `overflow` on, the NaN byte (E4M3) or ±∞ (E5M2) of x's sign.
    [[nodiscard]] int byte(double x) const {
        const int sign = std::signbit(x) ? 0x80 : 0;
        if (!(std::abs(x) < overflow))
            return sign | (ieee ? (std::isnan(x) ? 0x7E : 0x7C) : 0x7F);
        int best = sign;
        for (int magnitude = 1; magnitude < 0x80; ++magnitude) {
            if (!std::isfinite(value(magnitude)))
                continue;
            const double here = std::abs(value(magnitude) - std::abs(x)),
                         there = std::abs(value(best & 0x7F) - std::abs(x));
            if (here < there || (here == there && (magnitude & 1) == 0))
                best = sign | magnitude;
        }
        return best;
    }
};

template <class S>
constexpr Fp8Reference fp8_reference = std::is_same_v<S, Fp8E4M3> ? Fp8Reference{4, 3, false, 464.0}
                                                                   : Fp8Reference{5, 2, true, 61440.0};

}  // namespace

TEMPLATE_TEST_CASE("FP8: the table is the format's definition; a value is stored as the nearest, ties to even; "
                   "packets and rows decode as the table",
                   "[storage][fp8]", Fp8E4M3, Fp8E5M2) {
    using S = TestType;
    const Fp8Reference format = fp8_reference<S>;
    const auto& table = detail::fp8_values<S>;
    int largest = 0;
    for (int byte = 0; byte < 256; ++byte) {
        INFO("byte " << byte);
        const double expected = format.value(byte);
        const float value = table[static_cast<std::size_t>(byte)];
        if (std::isnan(expected)) {
            CHECK(std::isnan(value));
        } else {
            CHECK(double(value) == expected);
            CHECK(std::signbit(value) == ((byte & 0x80) != 0));  // −0 and −∞ too
            CHECK(detail::fp8_encode<S>(value) == byte);         // every value is its own byte
            if (std::isfinite(expected) && expected > format.value(largest))
                largest = byte;
        }
    }
    CHECK(double(table[static_cast<std::size_t>(largest)]) == (std::is_same_v<S, Fp8E4M3> ? 448.0 : 57344.0));
    CHECK(format.overflow == double(detail::StorageFormat<S>::overflow));
    // Every midpoint between neighbours (a tie: to the even one), a value just either side
    // of it, and random values of every magnitude, of both signs.
    std::vector<double> xs;
    for (int magnitude = 0; magnitude < largest; ++magnitude) {
        const double lo = format.value(magnitude), hi = format.value(magnitude + 1), mid = (lo + hi) / 2;
        for (const double x : {mid, std::nextafter(mid, 0.0), std::nextafter(mid, 1e9), lo + (hi - lo) / 3})
            xs.insert(xs.end(), {x, -x});
    }
    std::mt19937 random(5);
    const double top = std::log2(format.overflow) + 0.2;
    std::uniform_real_distribution<double> exponent(-20.0, top);
    for (int i = 0; i < 4000; ++i)
        xs.push_back((i % 2 == 0 ? 1 : -1) * std::exp2(exponent(random)));
    for (const double x : {format.overflow, std::nextafter(format.overflow, 0.0), format.overflow + 1, 1e30,
                           0x1p-11, 0x1p-10, 3 * 0x1p-11, 0x1p-18, 0x1p-17, 3 * 0x1p-18})
        xs.insert(xs.end(), {x, -x});
    for (const double x : xs) {
        const auto xf = static_cast<float>(x);
        INFO("x = " << double(xf));
        CHECK(int(detail::fp8_encode<S>(xf)) == format.byte(double(xf)));
    }
    // The same values, with ±∞, NaN and float's denormals, through a row's encoding
    // (fp8_encode_span: 16 lanes at a time with AVX-512), the rows cut off every packet.
    xs.insert(xs.end(), {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                         std::numeric_limits<double>::quiet_NaN(), 1e-40, -1e-44, 0.0, -0.0});
    for (const Index cols : {Index{5}, Index{16}, Index{37}}) {
        const Index rows = static_cast<Index>(xs.size()) / cols;
        Matrix<float> values(rows, cols);
        for (Index i = 0; i < rows * cols; ++i)
            values(i / cols, i % cols) = static_cast<float>(xs[static_cast<std::size_t>(i)]);
        detail::StoredRows<float, S> stored(rows, cols);
        stored.put_rows(0, values);
        for (Index i = 0; i < rows * cols; ++i) {
            const float x = values(i / cols, i % cols);
            INFO(cols << " columns, x = " << x);
            CHECK(stored.row_data(i / cols)[i % cols] == detail::fp8_encode<S>(x));
        }
    }
    // ±∞ and NaN: E4M3 holds them as NaN, E5M2 as they are; of their sign.
    constexpr float inf = std::numeric_limits<float>::infinity();
    CHECK(detail::fp8_encode<S>(inf) == format.byte(double(inf)));
    CHECK(detail::fp8_encode<S>(-inf) == format.byte(-double(inf)));
    CHECK(std::isnan(table[detail::fp8_encode<S>(std::numeric_limits<float>::quiet_NaN())]));
    // Every byte through the packet decoder (F16C where the target has it) and the rows'
    // decode_rows: the table's value, NaN for NaN.
    const Index lanes = detail::packet_lanes<float>;
    std::vector<std::uint8_t> bytes(256 + 7);
    for (int byte = 0; byte < 256; ++byte)
        bytes[static_cast<std::size_t>(byte)] = static_cast<std::uint8_t>(byte);
    for (Index at = 0; at + lanes <= 256; at += lanes) {
        alignas(64) float out[64];
        Eigen::internal::pstoreu(out, detail::fp8_packet<S>(bytes.data() + at));
        for (Index i = 0; i < lanes; ++i) {
            const float expected = table[static_cast<std::size_t>(at + i)];
            INFO("byte " << at + i);
            CHECK((std::isnan(expected) ? std::isnan(out[i]) : out[i] == expected && std::signbit(out[i]) == std::signbit(expected)));
        }
    }
    for (const Index cols : {1, 7, 8, 16, 17, 37}) {  // rows of all 256 bytes, off every packet
        const Index rows = (256 + cols - 1) / cols;
        detail::StoredRows<float, S> stored(rows, cols);
        detail::StoredRows<double, S> stored_double(rows, cols);
        Matrix<float> values(rows, cols);
        for (Index i = 0; i < rows * cols; ++i)
            values(i / cols, i % cols) = table[static_cast<std::size_t>(i % 256)];
        stored.put_rows(0, values);
        stored_double.put_rows(0, values.cast<double>());
        Matrix<float> decoded(rows, cols + 3);
        Matrix<double> decoded_double(rows, cols);
        stored.decode_rows(0, rows, decoded.data(), decoded.cols());
        stored_double.decode_rows(0, rows, decoded_double.data(), cols);
        for (Index i = 0; i < rows * cols; ++i) {
            const Index r = i / cols, c = i % cols;
            INFO("cols " << cols << ", value " << values(r, c));
            if (std::isnan(values(r, c))) {
                CHECK(std::isnan(decoded(r, c)));
                CHECK(std::isnan(decoded_double(r, c)));
            } else {
                CHECK(decoded(r, c) == values(r, c));
                CHECK(decoded_double(r, c) == double(values(r, c)));
                CHECK(stored.stored_value(r, c) == values(r, c));
            }
        }
    }
}

TEMPLATE_TEST_CASE("FP8: caches and the pool refuse finite values past the format's range, hold non-finite ones "
                   "(as NaN in E4M3), and resume from snapshots",
                   "[storage][fp8]", (std::pair<float, Fp8E4M3>), (std::pair<double, Fp8E4M3>),
                   (std::pair<float, Fp8E5M2>), (std::pair<double, Fp8E5M2>)) {
    using T = typename TestType::first_type;
    using S = typename TestType::second_type;
    const Fp8Reference format = fp8_reference<S>;
    KVCache<T, S> cache(4, 3);
    memattn::extend(cache, random_matrix<T>(5, 4, 1), random_matrix<T>(5, 3, 2));
    const std::string before = snapshot_of(cache);
    Matrix<T> K = random_matrix<T>(3, 4, 3), V = random_matrix<T>(3, 3, 4);
    K(1, 2) = T(format.overflow);
    CHECK_THROWS_WITH(memattn::extend(cache, K, V),
                      Catch::Matchers::Contains(std::string("which ") + detail::storage_name<S> + " storage would hold as " +
                                                (format.ieee ? "infinity" : "NaN")));
    CHECK_THROWS_AS(cache.update(K.row(1), V.row(1)), std::invalid_argument);
    CHECK(snapshot_of(cache) == before);
    K(1, 2) = T(format.overflow - 0.5);  // rounds to the largest, 448 or 57344
    memattn::extend(cache, K.topRows(2), V.topRows(2));
    V(0, 1) = std::numeric_limits<T>::infinity();
    cache.update(K.row(0), V.row(0));
    Vector<T> out(3);
    cache.attend(Vector<T>::Zero(4), out);
    CHECK(!std::isfinite(double(out(1))));  // NaN (E4M3), or ∞ (E5M2)

    // The paged pool of FP8 pairs: each step equals the plain pool's fed the stored pairs;
    // a sequence's snapshot resumes it.
    const HeadLayout heads{.q_heads = 4, .kv_heads = 2, .head_dim = 8};
    PagedKVCache<T, S> pool(heads, 16, 4);
    PagedKVCache<T> plain(heads, 16, 4);
    const Index a = pool.add_sequence(), b = plain.add_sequence();
    const Index n = 13;
    const Matrix<T> PK = random_matrix<T>(n, 16, 5), PV = random_matrix<T>(n, 16, 6), PQ = random_matrix<T>(n, 32, 7);
    const Matrix<T> PKs = stored<T, S>(PK), PVs = stored<T, S>(PV);
    Matrix<T> got(n, 32), expected(n, 32);
    for (Index i = 0; i < n; ++i) {
        pool.update(a, PK.row(i), PV.row(i));
        plain.update(b, PKs.row(i), PVs.row(i));
        pool.attend(a, PQ.row(i), got.row(i));
        plain.attend(b, PQ.row(i), expected.row(i));
    }
    check_close(got, to_double(expected), tolerance<T>());
    PagedKVCache<T, S> other(heads, 8, 4);  // the same blocks: the same folds, bit for bit
    auto resumed = other.sequence(other.add_sequence());
    std::istringstream in(snapshot_of(pool.sequence(a)), std::ios::binary);
    load(resumed, in);
    Vector<T> o1(32), o2(32);
    pool.attend(a, PQ.row(0), o1);
    resumed.attend(PQ.row(0), o2);
    CHECK(o1.cwiseEqual(o2).all());
}

TEST_CASE("FP8 E4M3 rows of numbers: a query and the float tiles read them divided by 2^8 and multiply the "
          "queries and weights by it, the same bits; a NaN held, or a query past 2^120, takes the exact reading",
          "[storage][fp8][group]") {
    using Rows = detail::StoredRows<float, Fp8E4M3>;
    // Which rows hold only numbers: tracked by what writes them.
    {
        Rows rows(4, 20), copy(4, 20), other(4, 20);
        CHECK(rows.numbers_only());
        Matrix<float> values = random_matrix<float>(4, 20, 1, 300.0);
        rows.put_rows(0, values.topRows(2));
        CHECK(rows.numbers_only());
        copy.copy_rows_from(rows, 2);
        CHECK(copy.numbers_only());
        values(3, 17) = std::numeric_limits<float>::infinity();  // held as NaN
        rows.put_rows(2, values.bottomRows(2));
        CHECK_FALSE(rows.numbers_only());
        rows.put_rows(2, values.topRows(2));  // the NaN overwritten: still off (sticky)
        CHECK_FALSE(rows.numbers_only());
        other.copy_rows_from(rows, 2);
        CHECK_FALSE(other.numbers_only());
        copy.swap(other);
        CHECK_FALSE(copy.numbers_only());
        CHECK(other.numbers_only());
        (void)other.row_data_to_write(0);
        CHECK_FALSE(other.numbers_only());
        detail::StoredRows<float, Fp8E5M2> wide(2, 20);  // E5M2's ±∞ too
        wide.put_rows(0, values.topRows(2) / 1000.0f);
        CHECK(wide.numbers_only());
        wide.put_rows(1, values.bottomRows(1));
        CHECK_FALSE(wide.numbers_only());
    }
    // A cache's grouped attend (tiles of 2, 4 and 8 queries, the tails off the packets, a
    // block past 128 keys, E4M3's subnormals, zeros, ±448) equals the plain cache's fed the
    // stored values, bit for bit, with the route taken and with it refused.
    const Index n = 300, d = 40, dv = 33;
    Matrix<float> K = random_matrix<float>(n, d, 2), V = random_matrix<float>(n, dv, 3);
    for (Index i = 0; i < n; i += 7) {
        K(i, i % d) = 0x1p-9f * float(i % 8);  // subnormals and zeros
        V(i, i % dv) = (i % 2 == 0 ? 448.0f : -448.0f);
        K(i, (i + 3) % d) = -0x1p-8f;
    }
    K.col(0).setZero();  // where the large queries below meet only zeros
    const auto stored_of = [](const Matrix<float>& X) { return stored<float, Fp8E4M3>(X); };
    const Matrix<float> Ks = stored_of(K), Vs = stored_of(V);
    const auto bits_equal = [](const Matrix<float>& a, const Matrix<float>& b) {
        bool same = a.rows() == b.rows() && a.cols() == b.cols();
        for (Index i = 0; same && i < a.size(); ++i)
            same = std::bit_cast<std::uint32_t>(a.data()[i]) == std::bit_cast<std::uint32_t>(b.data()[i]) ||
                   (std::isnan(a.data()[i]) && std::isnan(b.data()[i]));
        return same;
    };
    KVCache<float, Fp8E4M3> cache(d, dv);
    KVCache<float> plain(d, dv);
    memattn::extend(cache, K, V);
    memattn::extend(plain, Ks, Vs);
    for (const Index g : {2, 3, 4, 8}) {
        for (const float big : {0.0f, 0x1p119f, 0x1p124f, 0x1p126f}) {
            INFO("g = " << g << ", query coordinate 0 = " << big);
            Matrix<float> Q = random_matrix<float>(g, d, 30 + static_cast<std::uint64_t>(g), 2.0);
            // scale · big meets only zeros: from 2^120 on (big 2^124 and 2^126, d = 40) times
            // 2^8 it would overflow, and ∞ · 0 is NaN, so the route must be refused
            Q(g - 1, 0) = big;
            Matrix<float> got(g, dv), expected(g, dv);
            cache.attend_group(Q, got);
            plain.attend_group(Q, expected);
            CHECK(got.allFinite());
            CHECK(bits_equal(got, expected));
        }
    }
    // One query (a model without GQA: attend) and groups, rows of numbers read divided by
    // 2^8 against the same rows read exactly: a cache that once held a NaN (a row past the
    // others, cut off again) keeps the exact reading, and must give the same bits.
    {
        KVCache<float, Fp8E4M3> exact(d, dv);
        memattn::extend(exact, K, V);
        Matrix<float> nan_row = random_matrix<float>(1, d, 50);
        nan_row(0, 3) = std::numeric_limits<float>::quiet_NaN();
        exact.update(nan_row.row(0), random_matrix<float>(1, dv, 51).row(0));
        exact.truncate(n);
        for (const float big : {0.0f, 0x1p118f, 0x1p124f, std::numeric_limits<float>::infinity()}) {
            INFO("one query, coordinate 0 = " << big);
            Matrix<float> Q = random_matrix<float>(3, d, 52, 3.0);
            Q(2, 0) = big;
            Matrix<float> got(3, dv), expected(3, dv);
            for (Index r = 0; r < 3; ++r) {
                cache.attend(Q.row(r), got.row(r));
                exact.attend(Q.row(r), expected.row(r));
            }
            CHECK(bits_equal(got, expected));
            if (big != std::numeric_limits<float>::infinity())
                CHECK(got.allFinite());
            for (const Index g : {2, 3, 8}) {
                const Matrix<float> G = random_matrix<float>(g, d, 53 + static_cast<std::uint64_t>(g), 3.0);
                Matrix<float> grouped(g, dv), grouped_exact(g, dv);
                cache.attend_group(G, grouped);
                exact.attend_group(G, grouped_exact);
                CHECK(bits_equal(grouped, grouped_exact));
            }
        }
    }
    // A NaN held (an infinite value): the exact reading, poisoned as the plain cache's.
    Matrix<float> bad_k = random_matrix<float>(1, d, 40), bad_v = random_matrix<float>(1, dv, 41);
    bad_v(0, 5) = -std::numeric_limits<float>::infinity();
    cache.update(bad_k.row(0), bad_v.row(0));
    plain.update(stored_of(bad_k).row(0), stored_of(bad_v).row(0));
    const Matrix<float> Q = random_matrix<float>(4, d, 42);
    Matrix<float> got(4, dv), expected(4, dv);
    cache.attend_group(Q, got);
    plain.attend_group(Q, expected);
    CHECK_FALSE(got.allFinite());
    CHECK(bits_equal(got, expected));
}

TEMPLATE_TEST_CASE("FP8 with a scale per token: each row is s * S(x / s) with s = max|x| / largest, a row "
                   "holding a non-finite value reads as NaN, tiny and zero rows keep their values",
                   "[storage][fp8]", Fp8E4M3, Fp8E5M2) {
    using F = TestType;
    using S = PerTokenScale<F>;
    const Fp8Reference format = fp8_reference<F>;
    const double largest = std::is_same_v<F, Fp8E4M3> ? 448.0 : 57344.0;
    // A double model: s in float (max|x| / largest, at least 2^-126), each value x / s
    // in float, its FP8 byte by search, s times its value in float.
    const auto model = [&](const Matrix<float>& row) {
        const float amax = row.cwiseAbs().maxCoeff();
        const float s = std::max(amax / float(largest), std::numeric_limits<float>::min());
        Matrix<float> out(1, row.cols());
        for (Index c = 0; c < row.cols(); ++c)
            out(0, c) = s * float(format.value(format.byte(double(row(0, c) / s))));
        return out;
    };
    for (const double magnitude : {1.0, 1e3, 1e-3, 3e4, 1e-30, 1e-37, 1e-44, 0.0}) {
        for (const Index cols : {1, 7, 8, 16, 33, 128}) {
            const Matrix<float> row = random_matrix<float>(1, cols, 11, magnitude);
            INFO("magnitude " << magnitude << ", cols " << cols);
            detail::StoredRows<float, S> stored(1, cols);
            stored.put_rows(0, row);
            Matrix<float> decoded(1, cols);
            stored.decode_rows(0, 1, decoded.data(), cols);
            const Matrix<float> expected = model(row);
            CHECK(decoded.cwiseEqual(expected).all());
            for (Index c = 0; c < cols; ++c)
                CHECK(stored.stored_value(0, c) == expected(0, c));
            if (magnitude >= 1e-30) {  // F's precision relative to the row's largest magnitude
                const double amax = double(row.cwiseAbs().maxCoeff());
                CHECK((decoded - row).cwiseAbs().maxCoeff() <= (std::is_same_v<F, Fp8E4M3> ? 0x1p-4 : 0x1p-3) * amax);
            }
            // The scale folded into dot and add_scaled: s·(q·x̃) and (w·s)·x̃, within float's
            // rounding of the products of the decoded row.
            const Matrix<float> q = random_matrix<float>(1, cols, 12);
            const double exact_dot = q.cast<double>().row(0).dot(expected.cast<double>().row(0));
            const double terms = q.cast<double>().cwiseAbs().row(0).dot(expected.cast<double>().cwiseAbs().row(0));
            CHECK(std::abs(double(stored.dot(0, q.data())) - exact_dot) <= 1e-6 * terms + 1e-45);
            Matrix<float> acc = Matrix<float>::Zero(1, cols);
            stored.add_scaled(0, 0.5f, acc.data());
            CHECK((acc.cast<double>() - 0.5 * expected.cast<double>()).cwiseAbs().maxCoeff() <=
                  1e-6 * expected.cwiseAbs().cast<double>().maxCoeff() + 1e-45);
        }
    }
    // ±∞ or NaN anywhere in a row: the whole row reads NaN (its scale is NaN), the other rows not.
    for (const float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()}) {
        Matrix<float> rows = random_matrix<float>(2, 9, 13);
        rows(0, 4) = bad;
        detail::StoredRows<float, S> stored(2, 9);
        stored.put_rows(0, rows);
        Matrix<float> decoded(2, 9);
        stored.decode_rows(0, 2, decoded.data(), 9);
        CHECK(decoded.row(0).array().isNaN().all());
        CHECK(decoded.row(1).cwiseEqual(model(rows.row(1))).all());
    }
    // A cache of double refuses only a value past float's range; 1e30 is kept, scaled.
    KVCache<double, S> cache(4, 3);
    Matrix<double> K = random_matrix<double>(2, 4, 14), V = random_matrix<double>(2, 3, 15);
    K(1, 1) = 1e39;
    CHECK_THROWS_AS(memattn::extend(cache, K, V), std::invalid_argument);
    CHECK(cache.length() == 0);
    K(1, 1) = 1e30;
    memattn::extend(cache, K, V);
    CHECK(cache.length() == 2);
    CHECK(cache.footprint() == 2u * ((4 + 4) + (3 + 4)));  // a byte a value and a float scale per row
    Vector<double> out(3);
    cache.attend(Vector<double>::Zero(4), out);
    CHECK(out.allFinite());
}

TEST_CASE("Rotated storage: the Walsh-Hadamard rotation is the orthonormal matrix, and its own inverse",
          "[storage][rotation]") {
    // Sylvester's H_m / sqrt(m) on each power-of-two segment, largest first, in double.
    const auto reference_rotation = [](const MatrixD& x) {
        MatrixD y = x;
        for (Index at = 0; at < x.cols();) {
            Index m = 1;
            while (2 * m <= x.cols() - at)
                m *= 2;
            MatrixD H = MatrixD::Ones(1, 1);
            while (H.rows() < m) {
                MatrixD next(2 * H.rows(), 2 * H.rows());
                next << H, H, H, -H;
                H = next;
            }
            y.middleCols(at, m) = x.middleCols(at, m) * H / std::sqrt(double(m));
            at += m;
        }
        return y;
    };
    for (const Index n : {1, 2, 3, 7, 32, 40, 96, 128, 200}) {
        INFO("n = " << n);
        const Matrix<double> x = random_matrix<double>(3, n, 40 + static_cast<std::uint64_t>(n), 2.0);
        Matrix<double> y = x;
        for (Index r = 0; r < 3; ++r)
            detail::hadamard_rotate(y.row(r).data(), n);
        check_close(y, reference_rotation(x), 1e-14);
        for (Index r = 0; r < 3; ++r)  // twice: the identity
            detail::hadamard_rotate(y.row(r).data(), n);
        check_close(y, x, 1e-14);
        // Dot products are kept, and the growth bound holds.
        Matrix<double> a = x;
        for (Index r = 0; r < 3; ++r)
            detail::hadamard_rotate(a.row(r).data(), n);
        CHECK(std::abs(a.row(0).dot(a.row(1)) - x.row(0).dot(x.row(1))) <= 1e-12 * n);
        CHECK(a.cwiseAbs().maxCoeff() <= detail::hadamard_growth(n) * x.cwiseAbs().maxCoeff() * (1 + 1e-12));
    }
}

TEMPLATE_TEST_CASE("Rotated storage: a rotated cache equals the plain one fed the rotated, stored keys and rotated "
                   "queries; decode, extend and prefill agree",
                   "[storage][rotation]", (std::pair<float, Rotated<Q4>>), (std::pair<float, Rotated<Q4Affine>>),
                   (std::pair<float, Rotated<Q8>>), (std::pair<double, Rotated<Q4>>)) {
    using T = typename TestType::first_type;
    using S = typename TestType::second_type;
    using Inner = typename S::storage;
    const double tol = tolerance<T>();
    for (const auto& shape : {std::tuple<Index, Index, Index>{0, 4, 3}, {1, 1, 1}, {37, 5, 7}, {long_tokens, 40, 33},
                              {130, 128, 64}}) {
        const Index n = std::get<0>(shape), d = std::get<1>(shape), dv = std::get<2>(shape);
        INFO(detail::storage_name<S> << ": n = " << n << ", d = " << d << ", dv = " << dv);
        const Matrix<T> Q = random_matrix<T>(n, d, 1), K = random_matrix<T>(n, d, 2), V = random_matrix<T>(n, dv, 3);
        Matrix<T> HQ = Q, HK = K;
        for (Index r = 0; r < n; ++r) {
            detail::hadamard_rotate(HQ.row(r).data(), d);
            detail::hadamard_rotate(HK.row(r).data(), d);
        }
        const Matrix<T> Ks = stored<T, Inner>(HK), Vs = stored<T, Inner>(V);
        const Index cut = n / 3;
        const auto check_cache = [&](auto rotated, auto plain) {
            Matrix<T> expected(n, dv), decoded(n, dv), rest(n - cut, dv), whole(n, dv);
            auto split = rotated, whole_prefill = rotated;
            decode(plain, HQ, Ks, Vs, expected);
            decode(rotated, Q, K, V, decoded);
            check_close(decoded, to_double(expected), tol);
            memattn::extend(split, K.topRows(cut), V.topRows(cut));
            prefill(split, Q.bottomRows(n - cut), K.bottomRows(n - cut), V.bottomRows(n - cut), rest);
            check_close(rest, to_double(expected.bottomRows(n - cut)), tol);
            prefill(whole_prefill, Q, K, V, whole);
            check_close(whole, to_double(expected), tol);
            // attend_group: the group's queries rotated once, each head of the packed row.
            if (n > 0) {
                Matrix<T> group(3, dv), single(3, dv);
                const Matrix<T> G = random_matrix<T>(3, d, 8);
                Matrix<T> HG = G;
                for (Index r = 0; r < 3; ++r)
                    detail::hadamard_rotate(HG.row(r).data(), d);
                rotated.attend_group(G, group);
                plain.attend_group(HG, single);
                check_close(group, to_double(single), tol);
            }
        };
        check_cache(KVCache<T, S>(d, dv), KVCache<T>(d, dv));
        check_cache(SlidingWindowCache<T, S>(d, dv, 50, 2), SlidingWindowCache<T>(d, dv, 50, 2));
    }
}

// A claim about errors, not memory: the native build's (400 × 400 weights are slow at -O0).
#if !defined(MEMATTN_TEST_MEMORY_ONLY)
TEST_CASE("Rotated storage: outlier channels cost a rotated Q4 cache less than a plain one", "[storage][rotation]") {
    // Keys with three channels 15 times the rest, as real models' keys have: a plain block
    // scale is set by the outliers and rounds the other channels to a few levels; the
    // rotation spreads them over the block. The logits' error (through the attention
    // weights) is what the rotation removes: values are unit scale and stored as float.
    const Index n = 400, d = 64;
    Matrix<float> Q = random_matrix<float>(n, d, 4), K = random_matrix<float>(n, d, 5);
    for (const Index c : {3, 17, 40}) {
        K.col(c) *= 15.0f;
        Q.col(c) *= 0.2f;
    }
    const Matrix<float> V = Matrix<float>::Identity(n, n);  // out = the attention weights
    const MatrixD exact = reference::softmax_attention(to_double(Q), to_double(K), to_double(V)).out;
    const auto error = [&](auto cache) {
        Matrix<float> weights(n, n);
        for (Index t = 0; t < n; ++t) {
            cache.update(K.row(t), V.row(t));
            cache.attend(Q.row(t), weights.row(t));
        }
        return (to_double(weights) - exact).cwiseAbs().rowwise().sum().maxCoeff();  // total variation × 2
    };
    const double plain = error(KVCache<float, Q4>(d, n)), rotated = error(KVCache<float, Rotated<Q4>>(d, n));
    const double affine = error(KVCache<float, Q4Affine>(d, n)),
                 rotated_affine = error(KVCache<float, Rotated<Q4Affine>>(d, n));
    CAPTURE(plain, rotated, affine, rotated_affine);
    CHECK(rotated < 0.5 * plain);  // measured: 0.12 against 0.28
    CHECK(rotated_affine < 0.6 * affine);  // 0.079 against 0.153
    CHECK(affine < 0.6 * plain);  // a zero point halves the step of a block the outliers skew
}
#endif

TEST_CASE("Rotated storage: snapshots, refusals, MultiHead", "[storage][rotation][snapshot]") {
    const Matrix<float> K = random_matrix<float>(30, 16, 1), V = random_matrix<float>(30, 8, 2),
                        Q = random_matrix<float>(10, 16, 3);
    KVCache<float, Rotated<Q4>> a(16, 8), b(16, 8);
    memattn::extend(a, K.topRows(20), V.topRows(20));
    std::istringstream in(snapshot_of(a), std::ios::binary);
    load(b, in);
    Matrix<float> oa(10, 8), ob(10, 8);
    decode(a, Q, K.bottomRows(10), V.bottomRows(10), oa);
    decode(b, Q, K.bottomRows(10), V.bottomRows(10), ob);
    CHECK(oa.cwiseEqual(ob).all());
    // The stored keys are rotated: a snapshot of one loads only into the same storage.
    KVCache<float, Q4> plain(16, 8);
    std::istringstream again(snapshot_of(a), std::ios::binary);
    CHECK_THROWS_WITH(load(plain, again), Catch::Matchers::Contains("the storage is q4_rotated in the stream, q4 in the memory"));
    // A key the rotation could take past float's range is refused, naming it; the cache is unchanged.
    Vector<float> big = K.row(0);
    big(5) = 1e38f;
    CHECK_THROWS_WITH(a.update(big, V.row(0)), Catch::Matchers::Contains("the rotation") && Catch::Matchers::Contains("column 5"));
    CHECK(a.length() == 30);
    KVCache<float, Q4> unrotated(16, 8);
    CHECK_NOTHROW(unrotated.update(big, V.row(0)));
    // RoPE and the rotation together: the plain cache with RoPE fed rotated, stored keys.
    const Rope rope{.theta = 10000, .head_dim = 16};
    KVCache<float, Rotated<Q4>> both(16, 8, SoftmaxOptions{}, rope);
    KVCache<float> turned(16, 8);
    Matrix<float> out(30, 8), expected(30, 8);
    decode(both, K, K, V, out);
    for (Index t = 0; t < 30; ++t) {
        Matrix<float> k = K.row(t), q = K.row(t);
        const Index at[1] = {t};
        rope.apply(k, at);
        rope.apply(q, at);
        detail::hadamard_rotate(k.data(), 16);
        detail::hadamard_rotate(q.data(), 16);
        turned.update(stored<float, Q4>(k).row(0), stored<float, Q4>(Matrix<float>(V.row(t))).row(0));
        turned.attend(q.row(0), expected.row(t));
    }
    check_close(out, to_double(expected), tolerance<float>());
    // MultiHead over rotated caches: the split attend rotates each group's queries.
    check_layer_against_heads({.q_heads = 4, .kv_heads = 2, .head_dim = 16, .value_dim = 8},
                              [] { return KVCache<float, Rotated<Q4>>(16, 8); });
}

namespace {

/// The query an IntegerDot<S> cache multiplies, from the definition (docs/design.md §4.7,
/// IntegerDot): per block of 32 values s = max|q|/127 in float, each value s·round(q/s).
MatrixD int8_rounded(const Matrix<float>& Q) {
    MatrixD out(Q.rows(), Q.cols());
    for (Index r = 0; r < Q.rows(); ++r)
        for (Index c0 = 0; c0 < Q.cols(); c0 += 32) {
            const Index n = std::min<Index>(32, Q.cols() - c0);
            const float amax = Q.row(r).segment(c0, n).cwiseAbs().maxCoeff();
            const float s = amax / 127.0f;
            for (Index c = c0; c < c0 + n; ++c)
                out(r, c) = amax > 0 ? double(s) * std::nearbyint(double(Q(r, c)) * 127.0 / double(amax)) : 0.0;
        }
    return out;
}

/// HybridCache and PagedKVCache take S (neither takes IntegerDot<S>: their slots and pool read keys in float).
template <class S>
concept HybridTakesStorage = requires { typename HybridCache<float, MeanPool, S>; };
template <class S>
concept PoolTakesStorage = requires { typename PagedKVCache<float, S>; };
template <class S>
concept WindowTakesStorage = requires { typename SlidingWindowCache<float, S>; };
static_assert(HybridTakesStorage<Q8> && !HybridTakesStorage<IntegerDot<Q8>>);
static_assert(PoolTakesStorage<Q4> && !PoolTakesStorage<IntegerDot<Q4>>);

}  // namespace

TEMPLATE_TEST_CASE("Integer Q·K: a cache's attend is the double reference of the int8-rounded query over the stored "
                   "pairs; prefill reads the exact query",
                   "[storage][integer]", IntegerDot<Q8>, IntegerDot<Q4>, IntegerDot<Q4Affine>) {
    using S = TestType;
    using Inner = typename S::storage;
    static_assert(detail::storage_code<float, S>() == detail::storage_code<float, Inner>());
    static_assert(!StorageFor<S, double>, "the integer dot is for caches of float");
    for (const auto& shape : {std::tuple<Index, Index, Index>{0, 4, 3}, {1, 1, 1}, {37, 5, 7}, {long_tokens, 40, 33},
                              {130, 128, 64}, {70, 200, 16}, {33, 31, 2}}) {
        const Index n = std::get<0>(shape), d = std::get<1>(shape), dv = std::get<2>(shape);
        INFO(detail::storage_name<S> << ": n = " << n << ", d = " << d << ", dv = " << dv);
        const Matrix<float> Q = random_matrix<float>(n, d, 1), K = random_matrix<float>(n, d, 2),
                            V = random_matrix<float>(n, dv, 3);
        const MatrixD Qr = int8_rounded(Q), Ks = to_double(stored<float, Inner>(K)), Vs = to_double(stored<float, Inner>(V));
        Matrix<float> out(n, dv);
        KVCache<float, S> cache(d, dv);
        decode(cache, Q, K, V, out);
        check_close(out, reference::softmax_attention(Qr, Ks, Vs).out, tolerance<float>());
        SlidingWindowCache<float, S> window(d, dv, 50, 2);
        decode(window, Q, K, V, out);
        check_close(out, reference::softmax_attention(Qr, Ks, Vs, 0, 50, 2).out, tolerance<float>());
        // extend, then one attend per query over all n pairs: the same rounded query.
        KVCache<float, S> whole(d, dv);
        memattn::extend(whole, K, V);
        if (n > 0) {
            Matrix<float> last(1, dv);
            whole.attend(Q.row(n - 1), last.row(0));
            check_close(last, reference::softmax_attention(Qr.bottomRows(1), Ks, Vs).out.bottomRows(1), tolerance<float>());
        }
        // prefill takes the causal softmax kernel on the exact queries (design.md).
        KVCache<float, S> prefilled(d, dv);
        prefill(prefilled, Q, K, V, out);
        check_close(out, reference::softmax_attention(to_double(Q), Ks, Vs).out, tolerance<float>());
    }
}

TEMPLATE_TEST_CASE("Integer Q·K: a logit is q̃·k̃ to float rounding, within the query's rounding of q·k̃",
                   "[storage][integer]", Q8, Q4, Q4Affine) {
    using S = TestType;
    for (const Index cols : {1, 15, 31, 32, 33, 64, 100, 130, 200, 1024}) {
        const Index n = 9;
        Matrix<float> X = random_matrix<float>(n, cols, 8, 3.0), q = random_matrix<float>(1, cols, 9);
        X(2, 0) = 40.0f;   // an outlier channel sets its block's scale
        q(0, cols - 1) = 0.0f;
        detail::StoredRows<float, S> rows(n, cols);
        rows.put_rows(0, X);
        detail::IntegerQuery rounded;
        rounded.round(q.data(), cols);
        const MatrixD qr = int8_rounded(q);
        for (Index r = 0; r < n; ++r) {
            double exact = 0, rounded_exact = 0, q_mass = 0, largest = 0, rounding = 0;
            for (Index c0 = 0; c0 < cols; c0 += 32) {
                const Index m = std::min<Index>(32, cols - c0);
                double block_k = 0;
                for (Index c = c0; c < c0 + m; ++c) {
                    const double v = rows.stored_value(r, c);
                    exact += double(q(0, c)) * v;
                    rounded_exact += qr(0, c) * v;
                    q_mass += std::abs(qr(0, c));
                    largest = std::max(largest, std::abs(v));
                    block_k += std::abs(v);
                }
                rounding += double(q.row(0).segment(c0, m).cwiseAbs().maxCoeff()) / 127.0 / 2.0 * block_k;
            }
            // Float sums of the blocks' terms; a block's scales and codes each at most
            // three times the row's largest magnitude (as the float dot's test).
            const double float_rounding = static_cast<double>(cols + 4) * 0x1p-24 * 3 * largest * q_mass;
            const double logit = rows.integer_dot(r, rounded);
            CAPTURE(cols, r, logit, rounded_exact, exact);
            CHECK(std::abs(logit - rounded_exact) <= float_rounding);
            CHECK(std::abs(logit - exact) <= rounding * (1 + 1e-4) + float_rounding);  // s_q rounded to float
        }
    }
}

TEST_CASE("Integer Q·K: edge cases", "[storage][integer]") {
    const Index d = 64, dv = 8, n = 20;
    const Matrix<float> K = random_matrix<float>(n, d, 4), V = random_matrix<float>(n, dv, 5);
    KVCache<float, IntegerDot<Q4>> cache(d, dv);
    memattn::extend(cache, K, V);
    Matrix<float> out(1, dv);
    // A zero query weighs every pair alike: the mean of the stored values.
    cache.attend(Matrix<float>::Zero(1, d).row(0), out.row(0));
    check_close(out, MatrixD(to_double(stored<float, Q4>(V)).colwise().mean()), tolerance<float>());
    // A non-finite query value makes its output non-finite (a NaN scale), as q·k would.
    for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
        Matrix<float> q = random_matrix<float>(1, d, 6);
        q(0, 40) = bad;
        cache.attend(q.row(0), out.row(0));
        CHECK(!out.allFinite());
    }
    // Values far below 1 keep their relative precision: the scale is the block's own.
    const Matrix<float> q = random_matrix<float>(1, d, 7);
    Matrix<float> tiny_out(1, dv);
    cache.attend(q.row(0), out.row(0));
    cache.attend((q * 1e-30f).row(0), tiny_out.row(0));
    const MatrixD Ks = to_double(stored<float, Q4>(K)), Vs = to_double(stored<float, Q4>(V));
    check_close(out, reference::softmax_attention(int8_rounded(q), Ks, Vs).out.bottomRows(1), tolerance<float>());
    check_close(tiny_out, reference::softmax_attention(int8_rounded(Matrix<float>(q * 1e-30f)), Ks, Vs).out.bottomRows(1),
                tolerance<float>());
    // A head wider than the rounded query holds takes the float dot: S's bits.
    const Index wide = detail::IntegerQuery::max_depth + 1;
    const Matrix<float> WK = random_matrix<float>(5, wide, 8), WV = random_matrix<float>(5, 3, 9),
                        WQ = random_matrix<float>(5, wide, 10);
    KVCache<float, IntegerDot<Q8>> integer(wide, 3);
    KVCache<float, Q8> plain(wide, 3);
    Matrix<float> a(5, 3), b(5, 3);
    decode(integer, WQ, WK, WV, a);
    decode(plain, WQ, WK, WV, b);
    CHECK(a.cwiseEqual(b).all());
}

TEST_CASE("Integer Q·K: snapshots are the storage's; rotated keys; MultiHead's groups of one", "[storage][integer][snapshot]") {
    const Matrix<float> K = random_matrix<float>(30, 16, 1), V = random_matrix<float>(30, 8, 2),
                        Q = random_matrix<float>(10, 16, 3);
    KVCache<float, IntegerDot<Rotated<Q4>>> a(16, 8), b(16, 8);
    KVCache<float, Rotated<Q4>> plain(16, 8);
    memattn::extend(a, K.topRows(20), V.topRows(20));
    // The stored bytes are Rotated<Q4>'s: a snapshot loads into either, and back.
    std::istringstream in(snapshot_of(a), std::ios::binary);
    load(plain, in);
    CHECK(snapshot_of(plain) == snapshot_of(a));
    std::istringstream back(snapshot_of(plain), std::ios::binary);
    load(b, back);
    Matrix<float> oa(10, 8), ob(10, 8);
    decode(a, Q, K.bottomRows(10), V.bottomRows(10), oa);
    decode(b, Q, K.bottomRows(10), V.bottomRows(10), ob);
    CHECK(oa.cwiseEqual(ob).all());
    // Rotated under the integer dot: the rounded query is the rotated one.
    MatrixD HQ = to_double(Q), HK = to_double(K);
    for (Index r = 0; r < 30; ++r) {
        if (r < 10)
            detail::hadamard_rotate(HQ.row(r).data(), 16);
        detail::hadamard_rotate(HK.row(r).data(), 16);
    }
    const MatrixD Ks = to_double(stored<float, Q4>(Matrix<float>(HK.cast<float>()))),
                  Vs = to_double(stored<float, Q4>(V));
    check_close(oa, reference::softmax_attention(int8_rounded(Matrix<float>(HQ.cast<float>())), Ks, Vs).out.bottomRows(10),
                tolerance<float>());
    // MultiHead with a group of one query per KV head: each head's attend, for any executor.
    check_layer_against_heads({.q_heads = 2, .kv_heads = 2, .head_dim = 16, .value_dim = 8},
                              [] { return KVCache<float, IntegerDot<Q8>>(16, 8); });
}

TEST_CASE("Integer Q·K in a group: the grouped logits of Q8 keys are the single query's integer_dot, bit for bit",
          "[storage][integer]") {
    INFO((detail::integer_group_keys == 16  ? "sixteen keys per vpdpbusd (AVX-512 VNNI)"
          : detail::integer_group_keys == 8 ? "eight keys per vpmaddubsw (AVX2)"
                                            : "key by key (no AVX2)"));
    {
        for (const Index cols : {1, 15, 31, 32, 33, 64, 100, 128, 200, 256}) {
            const Index n = 150;
            Matrix<float> X = random_matrix<float>(n, cols, 31, 3.0);
            X(2, 0) = 40.0f;                                     // an outlier sets its block's scale
            X.row(7).setZero();                                  // zero scales
            X(9, cols - 1) = std::numeric_limits<float>::quiet_NaN();  // a NaN scale: its logits NaN
            X.row(11) *= 1e-30f;                                 // tiny scales
            detail::StoredRows<float, Q8> rows(n, cols);
            rows.put_rows(0, X);
            for (const Index g : {1, 2, 3, 4, 7, 16}) {
                Matrix<float> Q = random_matrix<float>(g, cols, 32, 2.0);
                Q(0, 0) = 0.0f;
                if (g > 2)
                    Q.row(2).setZero();
                if (g > 3)
                    Q(3, cols / 2) = std::numeric_limits<float>::infinity();  // its row NaN
                detail::IntegerGroup group;
                group.round(Q.data(), Q.outerStride(), g, cols);
                for (const auto& [first, m] : {std::pair<Index, Index>{0, 1}, {0, 16}, {3, 17}, {5, 128}, {20, 130 - 20}, {149, 1}}) {
                    INFO("cols = " << cols << ", g = " << g << ", first = " << first << ", m = " << m);
                    alignas(64) float s[detail::IntegerGroup::max_queries * 128];
                    const float scale = 0.37f;
                    rows.integer_logits(first, m, group, scale, s, 128, rows, 0, n);
                    for (Index r = 0; r < g; ++r) {
                        detail::IntegerQuery one;
                        one.round(Q.row(r).data(), cols);
                        for (Index j = 0; j < m; ++j) {
                            const float expected = scale * rows.integer_dot(first + j, one), got = s[r * 128 + j];
                            CAPTURE(r, j, expected, got);
                            CHECK((std::bit_cast<std::uint32_t>(expected) == std::bit_cast<std::uint32_t>(got) ||
                                   (std::isnan(expected) && std::isnan(got))));
                        }
                    }
                }
            }
        }
    }
}

TEMPLATE_TEST_CASE("Integer Q·K in a group: attend_group over IntegerDot<Q8> keys is the double reference of the "
                   "int8-rounded queries, with the logit options; a query's output is its own in any group",
                   "[storage][integer]", IntegerDot<Q8>, IntegerDot<Rotated<Q8>>) {
    using S = TestType;
    static_assert(detail::integer_group<S>, "every build takes a group's Q8 logits in integers");
    for (const auto& shape : {std::tuple<Index, Index, Index>{1, 32, 8}, {37, 5, 7}, {long_tokens, 128, 64},
                              {130, 200, 16}, {129, 256, 33}, {20, 33, 1}}) {
        const Index n = std::get<0>(shape), d = std::get<1>(shape), dv = std::get<2>(shape);  // captured below
        const Index most = detail::group_rows;
        const Matrix<float> K = random_matrix<float>(n, d, 41), V = random_matrix<float>(n, dv, 42),
                            Q = random_matrix<float>(most, d, 43, 2.0);
        std::vector<double> slopes(static_cast<std::size_t>(most)), sinks(slopes.size());
        for (std::size_t r = 0; r < slopes.size(); ++r)
            slopes[r] = 0.01 * double(r + 1), sinks[r] = 0.3 * double(r) - 1.0;
        for (const bool options : {false, true}) {
            // A cache whose attend_group takes the queries `rows` (their slopes and sinks).
            const auto cache_for = [&](const std::vector<Index>& rows) {
                std::vector<double> a, b;  // the cache copies the spans
                for (const Index r : rows)
                    a.push_back(slopes[std::size_t(r)]), b.push_back(sinks[std::size_t(r)]);
                SoftmaxOptions o;
                if (options)
                    o.softcap = 3.0, o.alibi_slopes = a, o.sink_logits = b;
                KVCache<float, S> cache(d, dv, o);
                memattn::extend(cache, K, V);
                return cache;
            };
            // The reference reads what the cache multiplies: the rounded (rotated) queries, the stored pairs.
            MatrixD Kd = to_double(K), Qd = to_double(Q);
            if constexpr (detail::is_rotated<S>) {
                for (Index r = 0; r < n; ++r)
                    detail::hadamard_rotate(Kd.row(r).data(), d);
                for (Index r = 0; r < most; ++r)
                    detail::hadamard_rotate(Qd.row(r).data(), d);
            }
            const MatrixD Ks = to_double(stored<float, Q8>(Matrix<float>(Kd.cast<float>()))),
                          Vs = to_double(stored<float, Q8>(V)), Qr = int8_rounded(Matrix<float>(Qd.cast<float>()));
            Matrix<float> pairs(most, dv);  // each query in a group of two (itself twice)
            for (Index r = 0; r < most; ++r) {
                Matrix<float> twice(2, d), out(2, dv);
                twice << Q.row(r), Q.row(r);
                cache_for({r, r}).attend_group(twice, out);
                CHECK((out.row(0).array() == out.row(1).array()).all());
                pairs.row(r) = out.row(0);
            }
            for (const Index g : {2, 3, 4, 8, 13, 16}) {
                INFO(detail::storage_name<S> << ": n = " << n << ", d = " << d << ", dv = " << dv << ", g = " << g
                                             << ", options " << options);
                std::vector<Index> rows(static_cast<std::size_t>(g));
                std::iota(rows.begin(), rows.end(), Index(0));
                Matrix<float> grouped(g, dv);
                cache_for(rows).attend_group(Q.topRows(g), grouped);
                CHECK((grouped.array() == pairs.topRows(g).array()).all());
                MatrixD exact(g, dv);
                for (Index r = 0; r < g; ++r) {
                    reference::Logits l{.softcap = options ? 3.0 : 0.0, .offset = n - 1};
                    if (options)
                        l.slope = slopes[std::size_t(r)], l.sink = sinks[std::size_t(r)];
                    exact.row(r) = reference::softmax_attention(Qr.row(r), Ks, Vs, l).out;
                }
                check_close(grouped, exact, tolerance<float>());
            }
        }
    }
}

TEST_CASE("Integer Q·K in a group: a window's queries turned per run (RoPE, sinks at their places) are rounded "
          "anew; MultiHead's GQA groups over IntegerDot<Q8>",
          "[storage][integer]") {
    const Index d = 64, dv = 16, n = 300;
    const Matrix<float> K = random_matrix<float>(n, d, 51), V = random_matrix<float>(n, dv, 52),
                        Q = random_matrix<float>(6, d, 53, 2.0);
    const Rope rope{.theta = 10000, .head_dim = d};
    SlidingWindowCache<float, IntegerDot<Q8>> window(d, dv, SoftmaxOptions{.window = 64, .sink_tokens = 4}, rope,
                                                      RopePositions::cache);
    memattn::extend(window, K, V);
    for (Index r = 0; r < Q.rows(); ++r) {
        // A group of one query alone takes the single-query route, which rounds the query
        // it is given each time; the group of two rounds once per turn.
        Matrix<float> twice(2, d), pair(2, dv), one(1, dv);
        twice << Q.row(r), Q.row(r);
        window.attend_group(twice, pair);
        window.attend(Q.row(r), one.row(0));
        INFO("query " << r);
        check_close(pair.topRows(1), to_double(one), tolerance<float>());
    }
    check_layer_against_heads({.q_heads = 8, .kv_heads = 2, .head_dim = 128, .value_dim = 16},
                              [] { return KVCache<float, IntegerDot<Q8>>(128, 16); });
}

namespace {

/// The keys a `PerChannelKeys<S>` cache reads, from the definition (storage/compact.hpp,
/// docs/design.md §4.7): the first `finished` rows (whole groups of 32 tokens) per group
/// and per channel with one scale (Q8: s = max|x|/127, codes round(x·(127/max|x|)) in
/// float; Q4: s = max|x|/7, codes round(x/s) ∈ [−7, 7]; Q4Affine: m = min, s = (max −
/// min)/15, codes round((x − m)/s) ∈ [0, 15], the rounding in double; a value is the
/// float nearest to s·code (+ m)), the rest exact.
template <class S, class T>
MatrixD per_channel_keys(const Matrix<T>& K, Index finished) {
    constexpr Index G = PerChannelKeys<S>::group;
    MatrixD out = to_double(K);
    for (Index g0 = 0; g0 + G <= finished; g0 += G)
        for (Index c = 0; c < K.cols(); ++c) {
            std::vector<float> x(G);
            for (Index i = 0; i < G; ++i)
                x[std::size_t(i)] = static_cast<float>(K(g0 + i, c));
            const float lo = *std::min_element(x.begin(), x.end()), hi = *std::max_element(x.begin(), x.end());
            const float amax = std::max(-lo, hi);
            for (Index i = 0; i < G; ++i) {
                const float v = x[std::size_t(i)];
                double value = 0;
                if constexpr (std::is_same_v<S, Q8>) {
                    if (amax > 0)
                        value = double(amax / 127.0f) * double(std::nearbyint(v * (127.0f / amax)));
                } else if constexpr (std::is_same_v<S, Q4>) {
                    const float s = static_cast<float>(double(amax) / 7.0);
                    if (s > 0)
                        value = double(s) * std::clamp(std::nearbyint(double(v) / double(s)), -7.0, 7.0);
                } else {
                    const float s = static_cast<float>((double(hi) - double(lo)) / 15.0);
                    const double u = s > 0 ? std::clamp(std::nearbyint((double(v) - double(lo)) / double(s)), 0.0, 15.0) : 0.0;
                    value = double(lo) + double(s) * u;
                }
                out(g0 + i, c) = double(static_cast<float>(value));  // a stored value is a float
            }
        }
    return out;
}

}  // namespace

#define MEMATTN_PER_CHANNEL_PAIRS                                                                               \
    (std::pair<float, Q8>), (std::pair<float, Q4>), (std::pair<float, Q4Affine>), (std::pair<double, Q8>),    \
        (std::pair<double, Q4>), (std::pair<double, Q4Affine>)

TEMPLATE_TEST_CASE("Per-channel keys: a decode step is the double reference over the keys quantised per finished "
                   "group and channel, its own group exact",
                   "[storage][per-channel]", MEMATTN_PER_CHANNEL_PAIRS) {
    using T = typename TestType::first_type;
    using S = typename TestType::second_type;
    using Cache = KVCache<T, PerChannelKeys<S>>;
    constexpr Index G = PerChannelKeys<S>::group;
    static_assert(std::is_same_v<typename Cache::StorageType, PerChannelKeys<S>>);
    for (const auto& shape : {std::tuple<Index, Index, Index>{0, 4, 3}, {1, 1, 1}, {31, 5, 7}, {32, 33, 2},
                              {33, 16, 16}, {100, 64, 40}, {70, 128, 64}, {65, 200, 9}}) {
        const Index n = std::get<0>(shape), d = std::get<1>(shape), dv = std::get<2>(shape);
        INFO(detail::storage_name<PerChannelKeys<S>> << ": n = " << n << ", d = " << d << ", dv = " << dv);
        const Matrix<T> Q = random_matrix<T>(n, d, 1), K = random_matrix<T>(n, d, 2, 3.0),
                        V = random_matrix<T>(n, dv, 3);
        const MatrixD Vs = to_double(stored<T, S>(V));
        Cache cache(d, dv);
        Matrix<T> out(n, dv);
        MatrixD expected(n, dv);
        for (Index t = 0; t < n; ++t) {
            cache.update(K.row(t), V.row(t));
            cache.attend(Q.row(t), out.row(t));
            const MatrixD Ks = per_channel_keys<S>(Matrix<T>(K.topRows(t + 1)), (t + 1) / G * G);
            expected.row(t) = reference::softmax_attention(to_double(Q.row(t)), Ks, Vs.topRows(t + 1)).out.row(0);
        }
        check_close(out, expected, tolerance<T>());
        // The stored bytes: finished groups' codes and per-channel scales, the rest as T.
        const std::size_t code_bytes = std::is_same_v<S, Q8> ? std::size_t(d) : std::size_t(16 * ((d + 31) / 32));
        const std::size_t scales = sizeof(float) * std::size_t(d) * (std::is_same_v<S, Q4Affine> ? 2 : 1);
        CHECK(cache.footprint() == std::size_t(n / G) * (std::size_t(G) * code_bytes + scales) +
                                       std::size_t(n % G) * sizeof(T) * std::size_t(d) +
                                       std::size_t(n) * detail::StoredRows<T, S>::row_bytes(dv));
        // The allocation: codes and scales for every row it can hold, the G exact rows of
        // the unfinished group whatever the length, the values.
        const auto rows = std::size_t(cache.pair_capacity()), groups = (rows + std::size_t(G) - 1) / std::size_t(G);
        CHECK(cache.capacity() == rows * code_bytes + groups * scales + std::size_t(G) * sizeof(T) * std::size_t(d) +
                                      rows * detail::StoredRows<T, S>::row_bytes(dv));
        CHECK(cache.capacity() >= cache.footprint());
        // A group of queries (GQA) reads the same keys: attend_group = attend per query.
        if (n > 0) {
            const Index g = std::min<Index>(n, 7);
            Matrix<T> group(g, dv), single(g, dv);
            cache.attend_group(Q.topRows(g), group);
            for (Index r = 0; r < g; ++r)
                cache.attend(Q.row(r), single.row(r));
            check_close(group, to_double(single), tolerance<T>());
        }
    }
}

TEMPLATE_TEST_CASE("Per-channel keys: prefill attends its own keys exactly and the past as stored, and stores what "
                   "the updates store",
                   "[storage][per-channel]", MEMATTN_PER_CHANNEL_PAIRS) {
    using T = typename TestType::first_type;
    using S = typename TestType::second_type;
    using Cache = KVCache<T, PerChannelKeys<S>>;
    constexpr Index G = PerChannelKeys<S>::group;
    const Index d = 40, dv = 24, total = 150;
    const Matrix<T> Q = random_matrix<T>(total, d, 4), K = random_matrix<T>(total, d, 5, 2.0),
                    V = random_matrix<T>(total, dv, 6);
    const MatrixD Vs = to_double(stored<T, S>(V));
    for (const auto& cut : {std::pair<Index, Index>{0, 0}, {0, 1}, {0, 70}, {5, 27}, {31, 2}, {32, 64}, {40, 110}}) {
        const Index past = cut.first, n = cut.second;
        INFO(detail::storage_name<PerChannelKeys<S>> << ": " << past << " tokens, then a prefill of " << n);
        Cache prefilled(d, dv), updated(d, dv);
        for (Index t = 0; t < past; ++t) {
            prefilled.update(K.row(t), V.row(t));
            updated.update(K.row(t), V.row(t));
        }
        Matrix<T> out(n, dv);
        prefilled.prefill(Q.middleRows(past, n), K.middleRows(past, n), V.middleRows(past, n), out);
        MatrixD keys = per_channel_keys<S>(Matrix<T>(K.topRows(past)), past / G * G);
        keys.conservativeResize(past + n, d);
        keys.bottomRows(n) = to_double(K.middleRows(past, n));
        check_close(out, reference::softmax_attention(to_double(Q.middleRows(past, n)), keys, Vs.topRows(past + n)).out,
                    tolerance<T>());
        // Afterwards the cache holds what n updates would: the same snapshot bytes, the
        // same steps, bit for bit.
        for (Index t = past; t < past + n; ++t)
            updated.update(K.row(t), V.row(t));
        CHECK(prefilled.length() == past + n);
        CHECK(snapshot_of(prefilled) == snapshot_of(updated));
        Matrix<T> a(total - past - n, dv), b(total - past - n, dv);
        decode(prefilled, Q.bottomRows(total - past - n), K.bottomRows(total - past - n), V.bottomRows(total - past - n), a);
        decode(updated, Q.bottomRows(total - past - n), K.bottomRows(total - past - n), V.bottomRows(total - past - n), b);
        CHECK(a.cwiseEqual(b).all());
    }
}

TEMPLATE_TEST_CASE("Per-channel keys: truncate at group boundaries and inside the unfinished group; snapshots",
                   "[storage][per-channel][truncate][snapshot]", Q8, Q4, Q4Affine) {
    using S = TestType;
    using Cache = KVCache<float, PerChannelKeys<S>>;
    const Index d = 33, dv = 8, n = 90;
    const Matrix<float> Q = random_matrix<float>(n, d, 7), K = random_matrix<float>(n, d, 8),
                        V = random_matrix<float>(n, dv, 9);
    Cache cache(d, dv);
    memattn::extend(cache, K.topRows(80), V.topRows(80));
    // 64 tokens finished (two groups), 16 exact.
    for (const Index t : {0, 32, 64, 65, 79, 80})
        CHECK(cache.can_truncate(t));
    for (const Index t : {-1, 1, 31, 33, 63, 81})
        CHECK_FALSE(cache.can_truncate(t));
    CHECK_THROWS_WITH(cache.truncate(40), Catch::Matchers::Contains("KVCache::truncate") &&
                                              Catch::Matchers::Contains("a multiple of 32"));
    CHECK(cache.length() == 80);
    // Cut and fed again: the same cache as one never cut, bit for bit.
    Cache whole(d, dv);
    memattn::extend(whole, K, V);
    for (const Index t : {70, 64, 32, 0}) {
        Cache cut = cache;
        cut.truncate(t);
        CHECK(cut.length() == t);
        memattn::extend(cut, K.bottomRows(n - t), V.bottomRows(n - t));
        CHECK(snapshot_of(cut) == snapshot_of(whole));
        Matrix<float> a(1, dv), b(1, dv);
        cut.attend(Q.row(0), a.row(0));
        whole.attend(Q.row(0), b.row(0));
        CHECK(a.cwiseEqual(b).all());
    }
    // Snapshots: load into an empty cache and into one with room; the same steps after.
    for (const Index length : {0, 5, 32, 80}) {
        Cache a(d, dv), b(d, dv), roomy(d, dv);
        memattn::extend(a, K.topRows(length), V.topRows(length));
        roomy.reserve(200);
        memattn::extend(roomy, K.bottomRows(3), V.bottomRows(3));
        std::istringstream in(snapshot_of(a), std::ios::binary), again(snapshot_of(a), std::ios::binary);
        load(b, in);
        load(roomy, again);
        CHECK(b.footprint() == a.footprint());
        Matrix<float> oa(n - length, dv), ob(n - length, dv), oroomy(n - length, dv);
        decode(a, Q.bottomRows(n - length), K.bottomRows(n - length), V.bottomRows(n - length), oa);
        decode(b, Q.bottomRows(n - length), K.bottomRows(n - length), V.bottomRows(n - length), ob);
        decode(roomy, Q.bottomRows(n - length), K.bottomRows(n - length), V.bottomRows(n - length), oroomy);
        CHECK(oa.cwiseEqual(ob).all());
        CHECK(oa.cwiseEqual(oroomy).all());
    }
    // The storage is recorded: a per-channel snapshot loads into no other storage.
    KVCache<float, S> token(d, dv);
    std::istringstream in(snapshot_of(cache), std::ios::binary);
    const std::string code = std::is_same_v<S, Q8> ? "q8" : std::is_same_v<S, Q4> ? "q4" : "q4_affine";
    CHECK_THROWS_WITH(load(token, in), Catch::Matchers::Contains("the storage is " + code + "_per_channel_keys in the stream"));
    // A snapshot cut short is refused, the cache unchanged.
    std::string bytes = snapshot_of(cache);
    bytes.resize(bytes.size() - 9);
    Cache c(d, dv);
    std::istringstream short_in(bytes, std::ios::binary);
    CHECK_THROWS(load(c, short_in));
    CHECK(c.length() == 0);
}

TEST_CASE("Per-channel keys: outlier channels cost per-channel Q4 less than per-token Q4; refusals; MultiHead; "
          "RoPE and logit options",
          "[storage][per-channel]") {
    // KIVI's case: a few key channels 15 times the rest set the scale of every per-token
    // block they are in; per channel each keeps its own. The attention weights' error.
    // (The sanitize build, -O0 under ASan: 200 tokens, an eighth of the work: the values
    // are the identity, n wide.)
    const Index n = memattn::test::memory_only ? 200 : 400, d = 64;
    Matrix<float> Q = random_matrix<float>(n, d, 4), K = random_matrix<float>(n, d, 5);
    for (const Index c : {3, 17, 40}) {
        K.col(c) *= 15.0f;
        Q.col(c) *= 0.2f;
    }
    const Matrix<float> V = Matrix<float>::Identity(n, n);
    const MatrixD exact = reference::softmax_attention(to_double(Q), to_double(K), to_double(V)).out;
    const auto error = [&](auto cache) {
        Matrix<float> weights(n, n);
        for (Index t = 0; t < n; ++t) {
            cache.update(K.row(t), V.row(t));
            cache.attend(Q.row(t), weights.row(t));
        }
        return (to_double(weights) - exact).cwiseAbs().rowwise().sum().maxCoeff();
    };
    const double token = error(KVCache<float, Q4Affine>(d, n)),
                 channel = error(KVCache<float, PerChannelKeys<Q4Affine>>(d, n));
    CAPTURE(token, channel);
    CHECK(channel < 0.6 * token);
    // Only KVCache takes per-channel keys: a ring, the slots and the pool store keys one by one.
    static_assert(!HybridTakesStorage<PerChannelKeys<Q4>> && !PoolTakesStorage<PerChannelKeys<Q4>>);
    static_assert(!WindowTakesStorage<PerChannelKeys<Q8>> && WindowTakesStorage<Rotated<Q8>>);
    // Of 16-bit rows: the float cache fed the rows as float, to the bit.
    {
        const Matrix<Eigen::bfloat16> k16 = random_matrix<float>(50, 8, 1).cast<Eigen::bfloat16>(),
                                      v16 = random_matrix<float>(50, 4, 2).cast<Eigen::bfloat16>(),
                                      q16 = random_matrix<float>(50, 8, 3).cast<Eigen::bfloat16>();
        KVCache<Eigen::bfloat16, PerChannelKeys<Q8>> narrow(8, 4);
        KVCache<float, PerChannelKeys<Q8>> plain(8, 4);
        Matrix<Eigen::bfloat16> o16(50, 4);
        Matrix<float> o32(50, 4);
        decode(narrow, q16, k16, v16, o16);
        decode(plain, Matrix<float>(q16.cast<float>()), Matrix<float>(k16.cast<float>()), Matrix<float>(v16.cast<float>()),
               o32);
        CHECK(o16.cwiseEqual(o32.cast<Eigen::bfloat16>()).all());
    }
    // A double past float's range is refused, the cache unchanged.
    KVCache<double, PerChannelKeys<Q4>> wide(4, 2);
    Matrix<double> big = Matrix<double>::Ones(1, 4);
    big(0, 2) = 1e300;
    CHECK_THROWS_WITH(wide.update(big.row(0), Matrix<double>::Ones(1, 2).row(0)),
                      Catch::Matchers::Contains("PerChannelKeys<Q4>") && Catch::Matchers::Contains("column 2"));
    CHECK(wide.length() == 0);
    // A non-finite key poisons its group once it is finished, as a block of Q4 does.
    KVCache<float, PerChannelKeys<Q8>> poisoned(4, 2);
    Matrix<float> keys = random_matrix<float>(40, 4, 1);
    keys(3, 1) = std::numeric_limits<float>::quiet_NaN();
    memattn::extend(poisoned, keys, random_matrix<float>(40, 2, 2));
    Matrix<float> o(1, 2);
    poisoned.attend(random_matrix<float>(1, 4, 3).row(0), o.row(0));
    CHECK(!o.allFinite());
    // A head wider than the single-query route's products with the scales hold takes the
    // plain dot: the same reference.
    {
        const Index wide = detail::ChannelQuery::max_depth + 3, m = 40;
        const Matrix<float> wq = random_matrix<float>(m, wide, 4), wk = random_matrix<float>(m, wide, 5),
                            wv = random_matrix<float>(m, 3, 6);
        KVCache<float, PerChannelKeys<Q4Affine>> cache(wide, 3);
        Matrix<float> out(m, 3);
        decode(cache, wq, wk, wv, out);
        MatrixD expected(m, 3);
        const MatrixD Vs = to_double(stored<float, Q4Affine>(wv));
        for (Index t = 0; t < m; ++t)
            expected.row(t) = reference::softmax_attention(to_double(wq.row(t)),
                                                           per_channel_keys<Q4Affine>(Matrix<float>(wk.topRows(t + 1)), (t + 1) / 32 * 32),
                                                           Vs.topRows(t + 1))
                                  .out.row(0);
        check_close(out, expected, tolerance<float>());
    }
    // MultiHead: the split attend over per-channel caches, any executor.
    check_layer_against_heads({.q_heads = 4, .kv_heads = 2, .head_dim = 48, .value_dim = 16},
                              [] { return KVCache<float, PerChannelKeys<Q4>>(48, 16); });
    // RoPE and ALiBi: the keys are stored turned, then quantised; the cache with
    // per-channel keys against the reference over its keys, turned and quantised.
    const Rope rope{.theta = 10000, .head_dim = 16};
    const std::vector<double> slope = {0.25};
    const SoftmaxOptions options{.alibi_slopes = slope};
    const Index m = 70;
    const Matrix<float> q = random_matrix<float>(m, 16, 11), k = random_matrix<float>(m, 16, 12),
                        v = random_matrix<float>(m, 8, 13);
    KVCache<float, PerChannelKeys<Q8>> turned(16, 8, options, rope);
    Matrix<float> out(m, 8);
    decode(turned, q, k, v, out);
    Matrix<float> tk = k, tq = q;
    for (Index t = 0; t < m; ++t) {
        const Index at[1] = {t};
        Matrix<float> row = tk.row(t), qrow = tq.row(t);
        rope.apply(row, at);
        rope.apply(qrow, at);
        tk.row(t) = row;
        tq.row(t) = qrow;
    }
    const MatrixD Vs = to_double(stored<float, Q8>(v));
    MatrixD expected(m, 8);
    for (Index t = 0; t < m; ++t) {
        const MatrixD Ks = per_channel_keys<Q8>(Matrix<float>(tk.topRows(t + 1)), (t + 1) / 32 * 32);
        reference::Logits logits;
        logits.slope = 0.25;
        expected.row(t) = reference::softmax_attention(to_double(tq.row(t)), Ks, Vs.topRows(t + 1), logits).out.row(0);
    }
    check_close(out, expected, tolerance<float>());
}
