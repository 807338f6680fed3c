// Regression tests for defects found by adversarial testing, each failing before its fix:
// re-inserting a memory's own pairs, NaN payloads, −∞ logits and weights with a floor,
// the EMA with alpha = 1, extreme option values, options narrowed to float, the aliasing
// rule of every entry point, and messages that round the rejected value. The compile-time
// rules (const and column-major outputs) are checked by tests/compile_fail/.
#include "support.hpp"

#include <memattn/memattn.hpp>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

using namespace memattn;
using memattn::test::HasSubstring;
using memattn::test::expect_poisoned_exactly;
using memattn::test::finite_rows;
using memattn::test::random_matrix;

namespace {

/// Throws E whose message holds every needle.
template <class E>
void expect_thrown(const std::function<void()>& call, const std::vector<std::string>& needles) {
    bool threw = false;
    try {
        call();
    } catch (const E& e) {
        threw = true;
        const std::string message = e.what();
        INFO(message);
        for (const auto& needle : needles)
            CHECK_THAT(message, HasSubstring(needle));
    }
    CHECK(threw);
}

/// Throws std::invalid_argument whose message holds every needle.
void expect_rejected(const std::function<void()>& call, const std::vector<std::string>& needles) {
    expect_thrown<std::invalid_argument>(call, needles);
}

}  // namespace

// -------------------------------------------------------------- 1. re-inserting a memory's own pairs

TEST_CASE("KVCache: update and extend with views of the cache's own pairs, at capacity", "[regression][memory]") {
    KVCache<float> cache(4, 3);
    const Matrix<float> K = random_matrix<float>(16, 4, 1), V = random_matrix<float>(16, 3, 2);
    cache.reserve(16);
    extend(cache, K, V);
    REQUIRE(cache.capacity() == cache.footprint());  // full: the next pair makes it grow
    cache.update(cache.keys().row(0), cache.values().row(0));
    REQUIRE(cache.length() == 17);
    CHECK(cache.keys().row(16) == K.row(0));
    CHECK(cache.values().row(16) == V.row(0));

    KVCache<float> doubled(4, 3);
    doubled.reserve(16);
    extend(doubled, K, V);
    extend(doubled, doubled.keys(), doubled.values());  // std::vector's v.insert(v.end(), v.begin(), v.end())
    REQUIRE(doubled.length() == 32);
    CHECK(doubled.keys().topRows(16) == K);
    CHECK(doubled.keys().bottomRows(16) == K);
    CHECK(doubled.values().bottomRows(16) == V);

    // prefill whose queries, keys and values all view the cache: as decode with copies.
    KVCache<float> viewed(4, 3), copied(4, 3);
    viewed.reserve(16);
    extend(viewed, K, V);
    extend(copied, K, V);
    Matrix<float> O(16, 3), expected(16, 3);
    const Matrix<float> Kc = K, Vc = V;
    prefill(viewed, viewed.keys(), viewed.keys(), viewed.values(), O);
    decode(copied, Kc, Kc, Vc, expected);
    CHECK((O - expected).cwiseAbs().maxCoeff() < 1e-5f);
    CHECK(viewed.keys() == copied.keys());
}

TEST_CASE("LinearAttentionMemory: update and extend with views of its own state", "[regression][memory]") {
    using T = double;
    const LinearOptions options{.decay = 0.9};
    LinearAttentionMemory<T> viewed(3, 3, {}, options);  // d' = d = dv = 3 for elu+1
    extend(viewed, random_matrix<T>(5, 3, 1), random_matrix<T>(5, 3, 2));
    LinearAttentionMemory<T> copied = viewed;

    viewed.update(viewed.state().nu, viewed.state().mu.row(1));  // key from ν, value from a row of μ
    const Vector<T> key = copied.state().nu, value = copied.state().mu.row(1);
    copied.update(key, value);
    CHECK(viewed.state().mu == copied.state().mu);
    CHECK(viewed.state().nu == copied.state().nu);

    extend(viewed, viewed.state().mu, viewed.state().mu);  // d' rows of keys and values, both from μ
    const Matrix<T> mu = copied.state().mu;
    extend(copied, mu, mu);
    CHECK(viewed.state().mu == copied.state().mu);
    CHECK(viewed.length() == copied.length());
}

// -------------------------------------------------------------- 2. NaN payloads

TEMPLATE_TEST_CASE("A NaN with any payload in a key or query poisons exactly the rows that see it",
                   "[regression][nonfinite][softmax]", float, double) {
    using T = TestType;
    using Bits = std::conditional_t<std::is_same_v<T, float>, std::uint32_t, std::uint64_t>;
    std::vector<Bits> payloads;
    if constexpr (std::is_same_v<T, float>)
        payloads = {0x7fc00001u, 0x7fc001ffu, 0xffc00123u, 0x7f800001u, 0x7fbfffffu, 0x7fffffffu};
    else
        payloads = {0x7ff8000000000001ull, 0x7ff80000000001ffull, 0xfff8000000012345ull, 0x7ff0000000000001ull,
                    0x7fffffffffffffffull};
    const Index n = 150, bad = 70;
    for (const Bits bits : payloads) for (const Index window : {Index(0), Index(9)}) {
        const T nan = std::bit_cast<T>(bits);
        REQUIRE(std::isnan(nan));
        INFO("payload bits " << bits << ", window " << window);
        Matrix<T> Q = random_matrix<T>(n, 4, 1), K = random_matrix<T>(n, 4, 2), V = random_matrix<T>(n, 3, 3);
        Matrix<T> O(n, 3);
        K(bad, 1) = nan;
        causal_softmax_attention(Q, K, V, O, {.window = window});
        expect_poisoned_exactly(finite_rows(O), bad, window == 0 ? n - 1 : bad + window - 1);
        K(bad, 1) = 0;
        Q(bad, 2) = nan;
        causal_softmax_attention(Q, K, V, O, {.window = window});
        expect_poisoned_exactly(finite_rows(O), bad, bad);
        // The memories' attend: the same rows.
        Q(bad, 2) = 0;
        K(bad, 1) = nan;
        KVCache<T> cache(4, 3);
        decode(cache, Q, K, V, O);
        expect_poisoned_exactly(finite_rows(O), bad, n - 1);
    }
}

// -------------------------------------------------------------- 3. −∞ logits and tiny weights

TEMPLATE_TEST_CASE("Rows whose visible logits are all −∞ give 0 and lse −∞, as KVCache decode does",
                   "[regression][nonfinite][softmax]", float, double) {
    using T = TestType;
    const Index n = 300;  // several key tiles, so most tiles are unmasked
    Matrix<T> Q = random_matrix<T>(n, 4, 1), K = Matrix<T>::Zero(n, 4);
    Q.col(0).array() = Q.col(0).array().abs() + T(0.5);  // q_0 > 0 ...
    K.col(0).setConstant(-std::numeric_limits<T>::infinity());  // ... and k_0 = −∞: every logit is −∞
    const Matrix<T> V = random_matrix<T>(n, 3, 3);
    Matrix<T> O(n, 3), decoded(n, 3);
    Vector<T> lse(n);
    causal_softmax_attention(Q, K, V, O, lse);
    CHECK(O.isZero(0));
    CHECK((lse.array() == -std::numeric_limits<T>::infinity()).all());
    KVCache<T> cache(4, 3);
    decode(cache, Q, K, V, decoded);
    CHECK(decoded.isZero(0));
    for (const Index window : {Index(7), Index(200)}) {
        causal_softmax_attention(Q, K, V, O, {.window = window, .sink_tokens = 2});
        CHECK(O.isZero(0));
    }
}

TEMPLATE_TEST_CASE("A weight far below the maximum's is 0, not a floor", "[regression][nonfinite][softmax]", float,
                   double) {
    using T = TestType;
    // Two keys: logit 0 (value 0) and logit −g (value 1e36 or 1e300). The exact output is
    // e^−g · value ≈ 1e-51 (float) or 1e-48 (double): zero in T.
    const T gap = std::is_same_v<T, float> ? T(200) : T(800);
    const T big = std::is_same_v<T, float> ? T(1e36) : T(1e300);
    Matrix<T> Q(2, 1), K(2, 1), V(2, 1), O(2, 1), decoded(2, 1);
    Q << 1, 1;
    K << 0, -gap;
    V << 0, big;
    causal_softmax_attention(Q, K, V, O, {.scale = 1});
    CHECK(std::abs(O(1, 0)) < std::numeric_limits<T>::min());
    KVCache<T> cache(1, 1, T(1));
    decode(cache, Q, K, V, decoded);
    CHECK(std::abs(decoded(1, 0)) < std::numeric_limits<T>::min());
}

// -------------------------------------------------------------- 4. EMA with alpha = 1

TEST_CASE("MovingAverageCache::exponential(alpha = 1) recovers at the next finite pair", "[regression][nonfinite]") {
    auto ema = MovingAverageCache<float>::exponential(4, 3, 1.f);
    const Index n = 20, bad = 5;
    Matrix<float> Q = random_matrix<float>(n, 4, 1), K = random_matrix<float>(n, 4, 2), V = random_matrix<float>(n, 3, 3);
    K(bad, 0) = std::numeric_limits<float>::infinity();
    V(bad, 1) = std::numeric_limits<float>::quiet_NaN();
    Matrix<float> O(n, 3);
    decode(ema, Q, K, V, O);
    expect_poisoned_exactly(finite_rows(O), bad, bad);
    CHECK(O.row(n - 1) == V.row(n - 1));  // it keeps the newest pair alone
}

// -------------------------------------------------------------- 5, 6. extreme option values

TEST_CASE("A window or sinks as large as Index allows mean no limit", "[regression][softmax]") {
    const Index n = 150;
    const Matrix<float> Q = random_matrix<float>(n, 8, 1), K = random_matrix<float>(n, 8, 2),
                        V = random_matrix<float>(n, 5, 3);
    Matrix<float> full(n, 5), O(n, 5);
    causal_softmax_attention(Q, K, V, full);
    const Index huge = std::numeric_limits<Index>::max();
    causal_softmax_attention(Q, K, V, O, {.window = huge});
    CHECK(O == full);
    causal_softmax_attention(Q, K, V, O, {.window = huge, .sink_tokens = huge});
    CHECK(O == full);
    causal_softmax_attention(Q, K, V, O, {.window = n});  // window = Nk: the boundary
    CHECK(O == full);
    causal_softmax_attention(Q, K, V, O, {.window = 3, .sink_tokens = huge});  // every token a sink: other tiles
    CHECK((O - full).cwiseAbs().maxCoeff() < 1e-6f);
}

TEST_CASE("HybridCache with a rate near the largest Index has one open slot", "[regression][memory]") {
    const Index n = 40;
    const Matrix<float> Q = random_matrix<float>(n, 4, 1), K = random_matrix<float>(n, 4, 2),
                        V = random_matrix<float>(n, 3, 3);
    Matrix<float> O(n, 3), expected(n, 3);
    for (const Index slots : {Index(1), Index(3)}) {
        HybridCache<float> huge(4, 3, 5, std::numeric_limits<Index>::max(), slots), plain(4, 3, 5, 1000, slots);
        decode(huge, Q, K, V, O);
        decode(plain, Q, K, V, expected);
        CHECK(O == expected);
        CHECK(huge.footprint() == plain.footprint());
        HybridCache<float> bulk(4, 3, 5, std::numeric_limits<Index>::max() - 1, slots);
        extend(bulk, K, V);
        CHECK(bulk.footprint() == plain.footprint());
    }
}

// -------------------------------------------------------------- 7, 10. options in T, exact messages

TEST_CASE("Double-valued options are checked in the scalar the call computes in", "[regression][bad_input]") {
    Matrix<float> Q(4, 3), K(4, 3), V(4, 2), O(4, 2);
    Q.setOnes();
    K.setOnes();
    V.setOnes();
    expect_rejected([&] { causal_softmax_attention(Q, K, V, O, {.scale = 1e39}); },
                    {"memattn::causal_softmax_attention", "options.scale", "1e+39", "float"});
    expect_rejected([&] { chunked_linear_attention(Q, K, V, O, EluPlusOne{}, {.eps = 1e39}); },
                    {"memattn::chunked_linear_attention", "options.eps", "1e+39", "float"});
    expect_rejected([&] { recurrent_linear_attention(Q, K, V, O, EluPlusOne{}, {.decay = 1e-50}); },
                    {"memattn::recurrent_linear_attention", "options.decay", "1e-50", "float"});
    expect_rejected([] { LinearAttentionMemory<float>(3, 2, {}, {.eps = 1e39}); },
                    {"memattn::LinearAttentionMemory", "options.eps", "1e+39"});
    expect_rejected([] { HybridCache<float, WeightedPool>(3, 2, 4, 2, 2, 0.f, WeightedPool({1e39, 0.5})); },
                    {"memattn::HybridCache", "'compressor'", "1e+39"});
    // The same values are fine where the scalar holds them.
    const Matrix<double> Qd = Matrix<double>::Ones(4, 3), Vd = Matrix<double>::Ones(4, 2);
    Matrix<double> Od(4, 2);
    causal_softmax_attention(Qd, Qd, Vd, Od, {.scale = 1e39});
    CHECK(Od.allFinite());
    HybridCache<double, WeightedPool>(3, 2, 4, 2, 2, 0.0, WeightedPool({1e39, 0.5}));
}

TEST_CASE("A rejected floating-point value is printed as given", "[regression][bad_input]") {
    Matrix<float> Q = Matrix<float>::Ones(4, 3), O(4, 3);
    expect_rejected([&] { chunked_linear_attention(Q, Q, Q.eval(), O, EluPlusOne{}, {.decay = 1.0000000001}); },
                    {"options.decay", "is 1.0000000001,"});
    expect_rejected([&] { causal_softmax_attention(Q, Q, Q.eval(), O, {.scale = -1.5e308 * 10}); },
                    {"options.scale", "is -inf,"});
    expect_rejected([] { MovingAverageCache<double>::exponential(2, 2, 1.0000000000000002); },
                    {"'alpha'", "is 1.0000000000000002,"});
}

// -------------------------------------------------------------- 8. the aliasing rule

TEST_CASE("overlap: exact for blocks of one buffer, checked against every address",
          "[regression][aliasing]") {
    Matrix<float> buffer(12, 10);
    const auto addresses = [&](const auto& view) {
        std::set<const float*> set;
        for (Index i = 0; i < view.rows(); ++i)
            for (Index j = 0; j < view.cols(); ++j)
                set.insert(&view.coeffRef(i, j));
        return set;
    };
    std::mt19937_64 gen(5);
    const auto pick = [&](Index bound) { return static_cast<Index>(gen() % static_cast<std::uint64_t>(bound)); };
    for (int trial = 0; trial < 4000; ++trial) {
        const Index r0 = pick(12), c0 = pick(10), r1 = pick(12), c1 = pick(10);
        const Index rows0 = 1 + pick(12 - r0), cols0 = 1 + pick(10 - c0);
        const Index rows1 = 1 + pick(12 - r1), cols1 = 1 + pick(10 - c1);
        const ConstMatrixRef<float> a = buffer.block(r0, c0, rows0, cols0);
        const ConstMatrixRef<float> b = buffer.block(r1, c1, rows1, cols1);
        const auto sa = addresses(a), sb = addresses(b);
        bool shared = false;
        for (const float* p : sa)
            shared = shared || sb.count(p) != 0;
        INFO("a at (" << r0 << ',' << c0 << ") " << rows0 << 'x' << cols0 << ", b at (" << r1 << ',' << c1 << ") "
                      << rows1 << 'x' << cols1);
        REQUIRE(detail::overlap<float>(detail::extent(a), detail::extent(b)) == shared);
        // A whole row of the buffer (1 × 10) and a column (10 strided elements) too.
        const Eigen::Map<const Vector<float>> run(buffer.data() + r0 * 10 + c0, 10 - c0 + (r0 < 11 ? 10 : 0));
        const auto sr = addresses(run);
        bool run_shared = false;
        for (const float* p : sr)
            run_shared = run_shared || sb.count(p) != 0;
        REQUIRE(detail::overlap<float>(detail::extent(run), detail::extent(b)) == run_shared);
        const auto column = buffer.col(c0);
        const auto sc = addresses(column);
        bool column_shared = false;
        for (const float* p : sc)
            column_shared = column_shared || sb.count(p) != 0;
        REQUIRE(detail::overlap<float>(detail::extent(column), detail::extent(b)) == column_shared);
    }
}

namespace {

/// Q, K, V as column blocks of one fused [n, 3d + dv] buffer (a QKV projection), O in
/// the last block: disjoint, so every call must accept it and give the outputs it gives
/// on separate matrices; then O over Q, K or V (each an exact alias) must be rejected.
struct Fused {
    static constexpr Index n = 70, d = 4;
    Matrix<float> buffer = random_matrix<float>(n, 4 * d, 11);
    auto q() { return buffer.middleCols(0, d); }
    auto k() { return buffer.middleCols(d, d); }
    auto v() { return buffer.middleCols(2 * d, d); }
    auto o() { return buffer.middleCols(3 * d, d); }
};

/// call(Q, K, V, O) on the fused buffer equals the call on copies, and is rejected with O
/// over any input; a memory (fresh each time from `make`) is unchanged by a rejected call.
template <class Call>
void check_aliasing_rule(const std::string& function, Call call) {
    Fused fused;
    const Matrix<float> Q = fused.q(), K = fused.k(), V = fused.v();
    Matrix<float> expected(Fused::n, Fused::d);
    call(Q, K, V, expected);
    call(fused.q(), fused.k(), fused.v(), fused.o());
    CHECK(Matrix<float>(fused.o()) == expected);
    for (const char* input : {"Q", "K", "V"}) {
        INFO(function << " with O over " << input);
        Fused again;
        const Matrix<float> before = again.buffer;
        auto out = std::string(input) == "Q" ? again.q() : std::string(input) == "K" ? again.k() : again.v();
        expect_rejected([&] { call(again.q(), again.k(), again.v(), out); },
                        {function, "shares memory with argument", "must not overlap"});
        CHECK(again.buffer == before);  // nothing was written
    }
}

template <class Mem>
void check_memory_aliasing(const std::string& name, const Mem& fresh) {
    check_aliasing_rule("memattn::decode", [&](const auto& Q, const auto& K, const auto& V, auto&& O) {
        Mem mem = fresh;
        decode(mem, Q, K, V, O);
    });
    check_aliasing_rule("memattn::prefill", [&](const auto& Q, const auto& K, const auto& V, auto&& O) {
        Mem mem = fresh;
        prefill(mem, Q, K, V, O);
    });
    // attend(q, q), and a rejected decode leaves the memory as it was.
    Mem mem = fresh;
    Fused fused;
    extend(mem, fused.k(), fused.v());
    const Mem before = mem;
    Vector<float> query = fused.buffer.row(3).head(Fused::d);
    expect_rejected([&] { mem.attend(query, query); }, {name + "::attend", "'out'", "'query'"});
    expect_rejected([&] { decode(mem, fused.q(), fused.k(), fused.v(), fused.k()); }, {"memattn::decode", "'K'"});
    CHECK(mem.length() == before.length());
    Vector<float> a(Fused::d), b(Fused::d);
    mem.attend(query, a);
    before.attend(query, b);
    CHECK(a == b);
}

}  // namespace

TEST_CASE("Aliasing: every kernel accepts disjoint blocks of one buffer and rejects an output over an input",
          "[regression][aliasing]") {
    check_aliasing_rule("memattn::causal_softmax_attention", [](const auto& Q, const auto& K, const auto& V, auto&& O) {
        causal_softmax_attention(Q, K, V, O, {.window = 9, .sink_tokens = 1});
    });
    check_aliasing_rule("memattn::quadratic_linear_attention", [](const auto& Q, const auto& K, const auto& V,
                                                                  auto&& O) { quadratic_linear_attention(Q, K, V, O); });
    check_aliasing_rule("memattn::recurrent_linear_attention", [](const auto& Q, const auto& K, const auto& V,
                                                                  auto&& O) { recurrent_linear_attention(Q, K, V, O); });
    check_aliasing_rule("memattn::chunked_linear_attention", [](const auto& Q, const auto& K, const auto& V,
                                                                auto&& O) { chunked_linear_attention(Q, K, V, O); });
    // lse over an input or over O.
    Fused fused;
    Vector<float> lse(Fused::n);
    causal_softmax_attention(fused.q(), fused.k(), fused.v(), fused.o(), lse);
    expect_rejected([&] { causal_softmax_attention(fused.q(), fused.k(), fused.v(), fused.o(), fused.k().col(1)); },
                    {"'lse'", "'K'"});
    expect_rejected([&] { causal_softmax_attention(fused.q(), fused.k(), fused.v(), fused.o(), fused.o().col(0)); },
                    {"'lse'", "'O'"});
    // A feature map's Y over its X.
    Matrix<float> X = random_matrix<float>(5, 4, 1);
    expect_rejected([&] { EluPlusOne{}(X, X); }, {"EluPlusOne", "'Y'", "'X'"});
    Matrix<float> W = random_matrix<float>(5, 8, 2);
    expect_rejected([&] { Taylor2{}(W.leftCols(2), W.leftCols(6)); }, {"Taylor2", "'Y'", "'X'"});
}

TEST_CASE("Aliasing: every memory's decode, prefill and attend", "[regression][aliasing][memory]") {
    const Index d = Fused::d;
    check_memory_aliasing("KVCache", KVCache<float>(d, d));
    check_memory_aliasing("SlidingWindowCache", SlidingWindowCache<float>(d, d, 6, 2));
    check_memory_aliasing("MovingAverageCache", MovingAverageCache<float>(d, d, 5));
    check_memory_aliasing("HybridCache", HybridCache<float>(d, d, 5, 2, 3));
    check_memory_aliasing("LinearAttentionMemory", LinearAttentionMemory<float>(d, d));
    // A memory's own prefill member, called directly.
    SlidingWindowCache<float> window(d, d, 6, 2);
    Fused fused;
    expect_rejected([&] { window.prefill(fused.q(), fused.k(), fused.v(), fused.v()); },
                    {"memattn::SlidingWindowCache::prefill", "'out'", "'values'"});
    CHECK(window.length() == 0);
}

// -------------------------------------------------------------- single tokens: rows or columns, no copy

TEST_CASE("A single token may be a row or a column vector, viewed without a copy", "[regression][layout]") {
    const Eigen::VectorXf column = Eigen::VectorXf::LinSpaced(4, -1.f, 1.f);
    const ConstRowRef<float> view(column);
    CHECK(view.data() == column.data());
    KVCache<float> by_column(4, 4), by_row(4, 4);
    by_column.update(column, column);
    by_row.update(column.transpose(), column.transpose());
    Eigen::VectorXf out_column(4);
    Vector<float> out_row(4);
    by_column.attend(column, out_column);
    by_row.attend(column.transpose(), out_row);
    CHECK(out_column.transpose() == out_row);
    // A sequence of one column (d = 1) is contiguous either way: accepted as it is.
    const Eigen::VectorXf seq = Eigen::VectorXf::LinSpaced(9, -2.f, 2.f);
    Eigen::VectorXf O(9);
    causal_softmax_attention(seq, seq, seq, O);
    CHECK(O.allFinite());
}

// -------------------------------------------------------------- a layer that half-updates, forged lengths,
// -------------------------------------------------------------- values a compact type cannot hold

namespace layer_defects {

/// The bytes of a memory's snapshot: equal bytes, equal memories.
template <class M>
std::string bytes_of(const M& memory) {
    std::ostringstream out;
    save(memory, out);
    return out.str();
}

/// Throws E whose message holds every needle, and `memory` keeps its bytes.
template <class E = std::invalid_argument, class M, class F>
void expect_unchanged_throw(const M& memory, F&& call, const std::vector<std::string>& needles) {
    const std::string before = bytes_of(memory);
    expect_thrown<E>(call, needles);
    CHECK(bytes_of(memory) == before);
}

const HeadLayout layout{.q_heads = 4, .kv_heads = 2, .head_dim = 4};

}  // namespace layer_defects

TEST_CASE("MultiHead: a value one head refuses leaves every head unchanged", "[regression][layer]") {
    using namespace layer_defects;
    const Matrix<float> Q = random_matrix<float>(6, 16, 1), K = random_matrix<float>(6, 8, 2),
                        V = random_matrix<float>(6, 8, 3);
    Matrix<float> O(6, 16);
    SECTION("float16 caches: a value past float16's range in KV head 1") {
        MultiHead<KVCache<float, Eigen::half>> mem(layout, [](Index) { return KVCache<float, Eigen::half>(4, 4); });
        prefill(mem, Q.topRows(3), K.topRows(3), V.topRows(3), O.topRows(3));
        Matrix<float> bad = K.bottomRows(3);
        bad(2, 6) = 1e5f;  // KV head 1, its column 2
        expect_unchanged_throw(mem, [&] { mem.update(bad.row(2), V.row(5)); },
                               {"memattn::MultiHead::update", "'key'", "column 6 (column 2 of KV head 1)", "float16"});
        expect_unchanged_throw(mem, [&] { mem.extend(bad, V.bottomRows(3)); },
                               {"memattn::MultiHead::extend", "row 2, column 6 (column 2 of KV head 1)"});
        expect_unchanged_throw(mem, [&] { prefill(mem, Q.bottomRows(3), bad, V.bottomRows(3), O.bottomRows(3)); },
                               {"memattn::prefill", "'K'", "column 6 (column 2 of KV head 1)"});
        expect_unchanged_throw(mem, [&] { decode(mem, Q.bottomRows(3), bad, V.bottomRows(3), O.bottomRows(3)); },
                               {"memattn::decode", "row 2"});
        Matrix<float> bad_value = V.bottomRows(3);
        bad_value(1, 5) = -7e4f;  // KV head 1, value column 1
        expect_unchanged_throw(mem, [&] { mem.extend(K.bottomRows(3), bad_value); },
                               {"'values'", "row 1, column 5 (column 1 of KV head 1)"});
        CHECK(mem.head(0).length() == 3);
        CHECK(mem.head(1).length() == 3);
    }
    SECTION("gated memories: a log-gate > 0 in KV head 1") {
        using G = GatedLinearAttentionMemory<float>;
        MultiHead<G> mem(layout, [](Index) { return G(4, 4); });
        Matrix<float> keys(3, 10);  // [k | log g] per head: 5 columns each
        keys << random_matrix<float>(3, 10, 4).array() - 2.0f;
        mem.extend(keys, V.topRows(3));
        keys(1, 9) = 0.25f;  // KV head 1's gate (its column 4)
        expect_unchanged_throw(mem, [&] { mem.extend(keys, V.topRows(3)); },
                               {"memattn::MultiHead::extend", "log-gate 0.25", "column 9 (column 4 of KV head 1)"});
        expect_unchanged_throw(mem, [&] { mem.update(keys.row(1), V.row(1)); }, {"memattn::MultiHead::update"});
        expect_unchanged_throw(mem, [&] { prefill(mem, Q.topRows(3), keys, V.topRows(3), O.topRows(3)); },
                               {"memattn::prefill"});
        CHECK(mem.head(0).length() == 3);
        CHECK(mem.head(1).length() == 3);
    }
    SECTION("delta-rule memories: beta > 1 in KV head 1, in the last row") {
        using D = DeltaRuleMemory<float>;
        MultiHead<D> mem(layout, [](Index) { return D(4, 4); });
        Matrix<float> keys = random_matrix<float>(3, 10, 5);  // [k | beta] per head
        keys.col(4).setConstant(0.5f);
        keys.col(9).setConstant(0.5f);
        mem.update(keys.row(0), V.row(0));
        keys(2, 9) = 1.5f;
        expect_unchanged_throw(mem, [&] { memattn::extend(mem, keys, V.topRows(3)); },
                               {"memattn::extend", "beta 1.5", "column 9 (column 4 of KV head 1)"});
        expect_unchanged_throw(mem, [&] { decode(mem, Q.topRows(3), keys, V.topRows(3), O.topRows(3)); },
                               {"memattn::decode"});
        CHECK(mem.head(1).length() == 1);
    }
    SECTION("a lone memory: decode with a bad last row takes none of the rows") {
        KVCache<float, Eigen::half> cache(8, 8);
        Matrix<float> bad = K;
        bad(5, 0) = 1e6f;
        expect_unchanged_throw(cache, [&] { decode(cache, K, bad, V, O.leftCols(8)); }, {"memattn::decode", "row 5"});
        CHECK(cache.length() == 0);
    }
}

TEST_CASE("MultiHead::truncate: every head or none", "[regression][layer]") {
    using namespace layer_defects;
    // KV head 1 keeps a shorter window: it cannot go back as far as head 0.
    MultiHead<SlidingWindowCache<float>> mem(layout,
                                             [](Index h) { return SlidingWindowCache<float>(4, 4, h == 0 ? 16 : 4); });
    const Matrix<float> K = random_matrix<float>(6, 8, 1), V = random_matrix<float>(6, 8, 2);
    mem.extend(K, V);
    CHECK(mem.can_truncate(6));
    CHECK_FALSE(mem.can_truncate(3));
    expect_unchanged_throw(mem, [&] { mem.truncate(3); }, {"memattn::MultiHead::truncate: KV head 1 cannot"});
    CHECK(mem.head(0).length() == 6);
    MultiHead<KVCache<float>> caches(layout, [](Index) { return KVCache<float>(4, 4); });
    caches.extend(K, V);
    caches.truncate(2);
    CHECK(caches.head(0).length() == 2);
    CHECK(caches.head(1).length() == 2);
    expect_unchanged_throw(caches, [&] { caches.truncate(3); }, {"KV head 0 cannot", "expected 0 .. length() = 2"});
}

namespace layer_defects {

/// The snapshot of `memory` with its length field (the one 8-byte field equal to
/// memory.length(), a value chosen to appear once) replaced by `length`, and the
/// checksum recomputed: a forged but well-formed stream.
template <class M>
std::string forged(const M& memory, std::int64_t length) {
    std::string bytes = bytes_of(memory);
    const std::int64_t real = memory.length();
    std::string needle(8, '\0'), replacement(8, '\0');
    std::memcpy(needle.data(), &real, 8);
    std::memcpy(replacement.data(), &length, 8);
    const std::size_t at = bytes.find(needle, 24);
    REQUIRE(at != std::string::npos);
    REQUIRE(bytes.find(needle, at + 1) == std::string::npos);
    bytes.replace(at, 8, replacement);
    const std::uint32_t crc = detail::Crc32c::update(0, bytes.data(), bytes.size() - 4);
    std::memcpy(bytes.data() + bytes.size() - 4, &crc, 4);
    return bytes;
}

/// `shift` moves the keys into a gated memory's range: [-1, 0) for log-gates, [0, 1) for beta.
template <class M>
void check_forged_lengths(M memory, float shift = 0.0f) {
    const Index real = 77;  // past every window below, and no other field's value
    const Matrix<float> K = (random_matrix<float>(real, memory.key_dim(), 7, shift == 0.0f ? 1.0 : 0.5).array() + shift)
                                .matrix();
    const Matrix<float> V = random_matrix<float>(real, memory.value_dim(), 8);
    memattn::extend(memory, K, V);
    REQUIRE(memory.length() == real);
    {  // the real stream loads
        M copy = memory;
        std::istringstream in(bytes_of(memory));
        load(copy, in);
    }
    for (const std::int64_t length : {std::numeric_limits<std::int64_t>::max(), std::int64_t{max_length} + 1}) {
        INFO("length " << length);
        std::istringstream in(forged(memory, length));
        expect_unchanged_throw<SnapshotError>(memory, [&] { load(memory, in); }, {"length is"});
    }
    // The longest length a memory counts loads; the next update is refused, unchanged.
    std::istringstream in(forged(memory, max_length));
    load(memory, in);
    REQUIRE(memory.length() == max_length);
    expect_unchanged_throw<std::length_error>(memory, [&] { memory.update(K.row(0), V.row(0)); },
                                              {"max_length"});
    expect_unchanged_throw<std::length_error>(memory, [&] { memattn::extend(memory, K, V); }, {"max_length"});
}

}  // namespace layer_defects

TEST_CASE("Snapshots: a forged length no memory can reach is refused; no update overflows", "[regression][snapshot]") {
    using namespace layer_defects;
    check_forged_lengths(SlidingWindowCache<float>(4, 3, 8, 2));
    check_forged_lengths(MovingAverageCache<float>(4, 3, 8));
    check_forged_lengths(MovingAverageCache<float>(4, 3, 0));
    check_forged_lengths(HybridCache<float>(4, 3, 8, 4, 3));
    check_forged_lengths(LinearAttentionMemory<float>(4, 3));
    check_forged_lengths(GatedLinearAttentionMemory<float>(4, 3), -0.5f);
    check_forged_lengths(DeltaRuleMemory<float>(4, 3), 0.5f);
    LinearAttentionMemory<float> linear(4, 3);
    CHECK_THROWS_AS(linear.set_state(linear.state(), max_length + 1), std::invalid_argument);
    linear.set_state(linear.state(), max_length);
    CHECK_THROWS_AS(linear.update(Vector<float>::Ones(4), Vector<float>::Ones(3)), std::length_error);
    CHECK(linear.length() == max_length);
}

TEST_CASE("HeadLayout: widths that overflow are refused, naming the field", "[regression][layer]") {
    const Matrix<float> x(1, 8);
    Matrix<float> o(1, 8);
    const Index huge = Index{1} << 62;
    // 2^62 + 2 heads of dim 4 would wrap to 8 columns and match the buffers.
    const HeadLayout wrapped{.q_heads = huge + 2, .kv_heads = huge + 2, .head_dim = 4};
    expect_rejected([&] { multi_head_chunked_linear_attention(x, x, x, o, wrapped); },
                    {"memattn::multi_head_chunked_linear_attention", "'layout.q_heads'", "overflows"});
    expect_rejected([&] { multi_head_causal_softmax_attention(x, x, x, o, wrapped); }, {"'layout.q_heads'", "overflows"});
    const HeadLayout wide{.q_heads = huge, .kv_heads = 1, .head_dim = 8};
    expect_rejected([&] { multi_head_causal_softmax_attention(x, x, x, o, wide); }, {"'layout.q_heads'", "overflows"});
    const HeadLayout wide_values{.q_heads = 4, .kv_heads = 1, .head_dim = 2, .value_dim = huge};
    expect_rejected([&] { MultiHead<KVCache<float>> mem(wide_values, [](Index) { return KVCache<float>(2, 2); }); },
                    {"memattn::MultiHead", "'layout.q_heads'", "overflows"});
}

TEST_CASE("Linear attention: an output sharing memory with the in/out state is refused", "[regression][linear]") {
    const Index n = 4, d = 3;
    const Matrix<float> Q = random_matrix<float>(n, d, 1), K = random_matrix<float>(n, d, 2),
                        V = random_matrix<float>(n, d, 3);
    LinearState<float> shaped;
    shaped.mu = random_matrix<float>(d, d, 6);
    shaped.nu = random_matrix<float>(1, d, 7);
    Eigen::Map<Matrix<float>> in_mu(shaped.mu.data(), 1, d);  // O is the first row of mu
    const LinearState<float> before = shaped;
    expect_rejected([&] { chunked_linear_attention(Q.topRows(1), K.topRows(1), V.topRows(1), in_mu, Identity{}, {}, &shaped); },
                    {"memattn::chunked_linear_attention", "'O'", "'state->mu'"});
    expect_rejected([&] { recurrent_linear_attention(Q.topRows(1), K.topRows(1), V.topRows(1), in_mu, Identity{}, {}, &shaped); },
                    {"memattn::recurrent_linear_attention", "'state->mu'"});
    Eigen::Map<Matrix<float>> in_nu(shaped.nu.data(), 1, d);
    expect_rejected([&] { quadratic_linear_attention(Q.topRows(1), K.topRows(1), V.topRows(1), in_nu, Identity{}, {}, &shaped); },
                    {"'state->nu'"});
    const Matrix<float> gates = Matrix<float>::Constant(1, 1, -0.5f);
    expect_rejected([&] { chunked_gated_linear_attention(Q.topRows(1), K.topRows(1), V.topRows(1), gates, in_mu, {}, &shaped); },
                    {"memattn::chunked_gated_linear_attention", "'state->mu'"});
    const Matrix<float> beta = Matrix<float>::Constant(1, 1, 0.5f);
    expect_rejected([&] { chunked_delta_rule_attention(Q.topRows(1), K.topRows(1), V.topRows(1), beta, in_mu, {}, &shaped); },
                    {"'state->mu'"});
    CHECK(shaped.mu == before.mu);
    CHECK(shaped.nu == before.nu);
    // The layer: O, or an input, inside one of the states it replaces.
    const HeadLayout heads{.q_heads = 1, .kv_heads = 1, .head_dim = d};
    std::vector<LinearState<float>> states(1);
    states[0].mu = random_matrix<float>(d, d, 8);  // d' = d for Identity
    states[0].nu = random_matrix<float>(1, d, 9);
    Eigen::Map<Matrix<float>> layer_out(states[0].mu.data(), 1, d);
    expect_rejected([&] {
        multi_head_chunked_linear_attention(Q.topRows(1), K.topRows(1), V.topRows(1), layer_out, heads, Identity{}, {},
                                            std::span(states));
    }, {"memattn::multi_head_chunked_linear_attention", "'O'", "'states[0].mu'"});
    Matrix<float> out(1, d);
    const Eigen::Map<const Matrix<float>> layer_in(states[0].nu.data(), 1, d);
    expect_rejected([&] {
        multi_head_chunked_linear_attention(layer_in, K.topRows(1), V.topRows(1), out, heads, Identity{}, {},
                                            std::span(states));
    }, {"'states[0].nu'", "'Q'"});
}

TEST_CASE("Q8: blocks of tiny values quantise without overflow", "[regression][storage]") {
    // 127 / amax overflows float below amax ~ 3.7e-37: the block is scaled in double.
    for (const float amax : {3.0e-37f, 1.0e-38f, 1.0e-40f, 1.0e-44f}) {
        INFO("amax " << amax);
        KVCache<float, Q8> cache(32, 32);
        Vector<float> value(32);
        for (Index c = 0; c < 32; ++c)
            value(c) = amax * static_cast<float>(c - 16) / 16.0f;
        cache.update(Vector<float>::Zero(32), value);
        Vector<float> out(32);
        cache.attend(Vector<float>::Ones(32), out);  // one pair: out = its stored value
        REQUIRE(out.allFinite());
        // Q8's error: half a step of amax / 127, plus the subnormal scale's rounding.
        const double bound = static_cast<double>(amax) / 254.0 * 1.01 + 1.5e-45 * 127;
        CHECK((out - value).cwiseAbs().maxCoeff() <= bound);
    }
}

TEMPLATE_TEST_CASE("Q4: blocks of tiny and of huge values quantise without overflow", "[regression][storage]", Q4,
                   Q4Affine) {
    using S = TestType;
    // The scale's inverse is taken in double: no overflow for subnormal blocks.
    for (const float amax : {3.0e-37f, 1.0e-38f, 1.0e-40f, 1.0e-44f}) {
        INFO("amax " << amax);
        KVCache<float, S> cache(32, 32);
        Vector<float> value(32);
        for (Index c = 0; c < 32; ++c)
            value(c) = amax * static_cast<float>(c - 16) / 16.0f;
        cache.update(Vector<float>::Zero(32), value);
        Vector<float> out(32);
        cache.attend(Vector<float>::Ones(32), out);  // one pair: out = its stored value
        REQUIRE(out.allFinite());
        // Half a step (Q4: amax / 7; Q4Affine: 2 amax / 15), plus the subnormal scale's rounding.
        const double bound = static_cast<double>(amax) / 14.0 * 1.01 + 1.5e-45 * 16;
        CHECK((out - value).cwiseAbs().maxCoeff() <= bound);
    }
    // A block spanning float's whole range (Q4Affine: max − min = 2·FLT_MAX) reads back finite.
    KVCache<float, S> cache(4, 4);
    Vector<float> value(4);
    value << FLT_MAX, -FLT_MAX, 0.0f, FLT_MAX / 2;
    cache.update(Vector<float>::Zero(4), value);
    Vector<float> out(4);
    cache.attend(Vector<float>::Ones(4), out);
    REQUIRE(out.allFinite());
    CHECK(std::abs(out(0) - FLT_MAX) <= FLT_MAX / 14.0f);
    CHECK(std::abs(out(1) + FLT_MAX) <= FLT_MAX / 14.0f);
}

TEMPLATE_TEST_CASE("Compact storage: one policy, a finite value the type would lose is refused", "[regression][storage]",
                   float, double) {
    using T = TestType;
    const auto refused = [](auto cache, T x, const std::string& type) {
        Vector<T> key = Vector<T>::Ones(4), value = Vector<T>::Ones(4);
        value(2) = x;
        expect_rejected([&] { cache.update(key, value); }, {"'value'", "finite value", type, "column 2"});
        CHECK(cache.length() == 0);
        key(1) = -x;
        expect_rejected([&] { memattn::extend(cache, key, Vector<T>::Ones(4)); }, {"'K'", "column 1"});
    };
    const auto kept = [](auto cache, T x) {
        Vector<T> value = Vector<T>::Ones(4);
        value(0) = x;
        cache.update(Vector<T>::Zero(4), value);
        Vector<T> out(4);
        cache.attend(Vector<T>::Ones(4), out);
        CHECK(out.allFinite());
        return out(0);
    };
    // float16: what rounds to 65504 is kept; from 65520 on it would be infinity.
    CHECK(kept(KVCache<T, Eigen::half>(4, 4), T(65519)) == T(65504));
    refused(KVCache<T, Eigen::half>(4, 4), T(65520), "float16");
    refused(SlidingWindowCache<T, Eigen::half>(4, 4, 3), T(1e5), "float16");
    // bfloat16: its largest value, 0x7F7F, and the midpoint above it that rounds up.
    const float bf16_max = std::bit_cast<float>(std::uint32_t{0x7F7F0000});
    const float bf16_edge = std::bit_cast<float>(std::uint32_t{0x7F7F8000});
    REQUIRE(std::isinf(static_cast<float>(Eigen::bfloat16(bf16_edge))));
    REQUIRE(std::isfinite(static_cast<float>(Eigen::bfloat16(std::nextafter(bf16_edge, 0.0f)))));
    CHECK(kept(KVCache<T, Eigen::bfloat16>(4, 4), T(std::nextafter(bf16_edge, 0.0f))) == T(bf16_max));
    refused(KVCache<T, Eigen::bfloat16>(4, 4), T(bf16_edge), "bfloat16");
    refused(KVCache<T, Eigen::bfloat16>(4, 4), T(FLT_MAX), "bfloat16");
    refused(HybridCache<T, MeanPool, Eigen::bfloat16>(4, 4, 2, 2, 2), T(FLT_MAX), "bfloat16");
    // Q8 keeps float's whole range (its scales are float) ...
    CHECK(std::isfinite(kept(KVCache<T, Q8>(4, 4), T(FLT_MAX))));
    if constexpr (std::is_same_v<T, double>) {
        // ... and a double past it would make its block NaN; bfloat16 and float16 would round it to infinity.
        refused(KVCache<T, Q8>(4, 4), T(1e300), "Q8");
        refused(KVCache<T, Eigen::bfloat16>(4, 4), T(1e300), "bfloat16");
        refused(SlidingWindowCache<T, Q8>(4, 4, 2), T(-1e39), "Q8");
        refused(KVCache<T, Q4>(4, 4), T(1e39), "Q4");
        refused(HybridCache<T, MeanPool, Q4Affine>(4, 4, 2, 2, 2), T(-1e300), "Q4Affine");
    }
    CHECK(std::isfinite(kept(KVCache<T, Q4>(4, 4), T(FLT_MAX))));
    CHECK(std::isfinite(kept(KVCache<T, Q4Affine>(4, 4), T(-FLT_MAX))));
    // ±∞ and NaN are stored as they are, in every type: they poison as in T.
    const Vector<T> infinite = Vector<T>::Constant(4, std::numeric_limits<T>::infinity());
    KVCache<T, Eigen::bfloat16> bf16(4, 4);
    KVCache<T, Q8> q8(4, 4);
    SlidingWindowCache<T, Eigen::half> f16(4, 4, 2);
    CHECK_NOTHROW(bf16.update(infinite, infinite));
    CHECK_NOTHROW(q8.update(infinite, infinite));
    CHECK_NOTHROW(f16.update(infinite, infinite));
}
