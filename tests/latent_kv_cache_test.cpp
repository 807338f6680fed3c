#include "support.hpp"

#include <memattn/layer/latent_attention.hpp>
#include <memattn/persistence/snapshot.hpp>

#include <cmath>
#include <limits>
#include <sstream>
#include <vector>

using namespace memattn;
using memattn::test::check_close;
using memattn::test::random_matrix;
using memattn::test::tolerance;

namespace {

/// The latent cache's attend in double from the formula: each head's query against the
/// rows [c | kr], values c, every row seen, the softcap and the head's sink logit.
reference::MatrixD latent_reference(const reference::MatrixD& Q, const reference::MatrixD& rows, Index r,
                                    double scale, double softcap = 0, const std::vector<double>& sinks = {}) {
    reference::MatrixD out(Q.rows(), r);
    for (Index h = 0; h < Q.rows(); ++h) {
        reference::Logits o{.scale = scale, .softcap = softcap, .causal = false};
        if (!sinks.empty())
            o.sink = sinks[sinks.size() == 1 ? 0 : static_cast<std::size_t>(h)];
        out.row(h) = reference::softmax_attention(Q.row(h), rows, rows.leftCols(r), o).out;
    }
    return out;
}

/// [C | KR] in double.
template <class T>
reference::MatrixD latent_rows(const Matrix<T>& C, const Matrix<T>& KR) {
    reference::MatrixD rows(C.rows(), C.cols() + KR.cols());
    rows << reference::to_double(C), reference::to_double(KR);
    return rows;
}

/// Pairs of a vector turned by RoPE to position p (GPT-NeoX's halves, base 10000): the
/// decoupled RoPE key and query a caller hands to the cache, already turned.
reference::MatrixD latent_turned(const reference::MatrixD& x, Index first_position) {
    reference::MatrixD y = x;
    const Index half = x.cols() / 2;
    for (Index i = 0; i < x.rows(); ++i)
        for (Index c = 0; c < half; ++c) {
            const double angle = static_cast<double>(first_position + i) *
                                 std::pow(10000.0, -2.0 * static_cast<double>(c) / static_cast<double>(x.cols()));
            const double a = x(i, c), b = x(i, c + half);
            y(i, c) = a * std::cos(angle) - b * std::sin(angle);
            y(i, c + half) = a * std::sin(angle) + b * std::cos(angle);
        }
    return y;
}

template <class T, class S>
Matrix<T> latent_attend(const LatentKVCache<T, S>& cache, const Matrix<T>& Q, ExecutorRef executor = {}) {
    Matrix<T> out(Q.rows(), cache.latent_dim());
    cache.attend(Q, out, executor);
    return out;
}

}  // namespace

// The sanitize build (MEMATTN_TEST_MEMORY_ONLY) runs the memory's paths in float: double's
// are the same template code, whose numerics the native build checks.
#if defined(MEMATTN_TEST_MEMORY_ONLY)
#define MEMATTN_LATENT_SCALARS float
#else
#define MEMATTN_LATENT_SCALARS float, double
#endif

TEMPLATE_TEST_CASE("LatentKVCache: attend equals the double reference, sizes around the tiles and pieces",
                   "[memory][latent]", MEMATTN_LATENT_SCALARS) {
    using T = TestType;
    const Index r = GENERATE(1, 17, 64);
    const Index dr = GENERATE(0, 1, 8);
#if defined(MEMATTN_TEST_MEMORY_ONLY)  // -O0 under ASan: the same paths, fewer heads
    const Index heads = GENERATE(1, 16);
#else
    const Index heads = GENERATE(1, 16, 133);
#endif
    const Index n = GENERATE(0, 1, 129, 2100);
    CAPTURE(r, dr, heads, n);
    const double scale = 0.3;
    const Matrix<T> C = random_matrix<T>(n, r, 1), KR = random_matrix<T>(n, dr, 2);
    const Matrix<T> Q = random_matrix<T>(heads, r + dr, 3);
    LatentKVCache<T> cache(r, dr, static_cast<T>(scale));
    cache.extend(C, KR);
    REQUIRE(cache.length() == n);
    CHECK(cache.footprint() == static_cast<std::size_t>(n * (r + dr)) * sizeof(T));
    const Matrix<T> out = latent_attend(cache, Q);
    if (n == 0) {
        CHECK(out.isZero(0));
        return;
    }
    check_close(out, latent_reference(reference::to_double(Q), latent_rows(C, KR), r, scale), tolerance<T>());
}

TEST_CASE("LatentKVCache: update equals extend bitwise; truncate, reset, reserve, capacity", "[memory][latent]") {
    const Index r = 24, dr = 8, n = 70;
    const Matrix<float> C = random_matrix<float>(n, r, 4), KR = random_matrix<float>(n, dr, 5);
    const Matrix<float> Q = random_matrix<float>(7, r + dr, 6);
    LatentKVCache<float> one(r, dr, 0.2f), all(r, dr, 0.2f);
    for (Index t = 0; t < n; ++t)
        one.update(C.row(t), KR.row(t));
    all.extend(C, KR);
    CHECK(one.rows() == all.rows());
    CHECK((latent_attend(one, Q).array() == latent_attend(all, Q).array()).all());

    LatentKVCache<float> short_one(r, dr, 0.2f);
    short_one.extend(C.topRows(31), KR.topRows(31));
    all.truncate(31);
    CHECK(all.length() == 31);
    CHECK((latent_attend(all, Q).array() == latent_attend(short_one, Q).array()).all());
    REQUIRE_THROWS_AS(all.truncate(32), std::invalid_argument);
    REQUIRE_THROWS_AS(all.truncate(-1), std::invalid_argument);
    CHECK(all.length() == 31);

    LatentKVCache<float> reserved(r, dr, 0.2f);
    reserved.reserve(500);
    CHECK(reserved.token_capacity() == 500);
    CHECK(reserved.capacity() == 500 * (r + dr) * sizeof(float));
    reserved.extend(C, KR);
    CHECK(reserved.token_capacity() == 500);
    reserved.reset();
    CHECK(reserved.length() == 0);
    CHECK(reserved.token_capacity() == 500);
    CHECK(LatentKVCache<float, Eigen::bfloat16>::token_bytes(512, 64) == 1152);
    CHECK(LatentKVCache<float>::token_bytes(512, 64) == 2304);

    // Rows that view the cache's own, while it grows.
    LatentKVCache<float> self(r, dr, 0.2f);
    self.extend(C.topRows(16), KR.topRows(16));
    const Matrix<float> first = self.rows().topRows(16);
    self.extend(self.rows().leftCols(r), self.rows().rightCols(dr));
    self.update(self.rows().row(3).head(r), self.rows().row(3).tail(dr));
    REQUIRE(self.length() == 33);
    CHECK(self.rows().middleRows(16, 16) == first);
    CHECK(self.rows().row(32) == first.row(3));
}

TEST_CASE("LatentKVCache: compact storage reads back the float cache of the stored values, bitwise",
          "[memory][latent]") {
    const Index r = 40, dr = 8, heads = 20, n = 1500;
    const Matrix<float> C = random_matrix<float>(n, r, 7), KR = random_matrix<float>(n, dr, 8);
    const Matrix<float> Q = random_matrix<float>(heads, r + dr, 9);
    Matrix<float> joined(n, r + dr);
    joined << C, KR;
    const auto stored_as = [&]<class S>(std::type_identity<S>) {
        LatentKVCache<float, S> compact(r, dr, 0.25f);
        compact.extend(C, KR);
        Matrix<float> held(n, r + dr);
        detail::round_trip<float, S>(joined, held.data(), r + dr);
        LatentKVCache<float> plain(r, dr, 0.25f);
        plain.extend(held.leftCols(r), held.rightCols(dr));
        const Matrix<float> a = latent_attend(compact, Q), b = latent_attend(plain, Q);
        CHECK((a.array() == b.array()).all());
        CHECK(compact.footprint() == static_cast<std::size_t>(n) * LatentKVCache<float, S>::token_bytes(r, dr));
        // and within the format's bound of the exact rows
        check_close(a, latent_reference(reference::to_double(Q), latent_rows(C, KR), r, 0.25), 5e-2);
    };
    stored_as(std::type_identity<Eigen::bfloat16>{});
    stored_as(std::type_identity<Q8>{});
    stored_as(std::type_identity<Fp8E4M3>{});
}

TEST_CASE("LatentKVCache: bitwise the same for any executor and thread count", "[memory][latent]") {
    const Index r = 64, dr = 8, heads = 16, n = 5000;  // 5 pieces, past parallel_work
    const Matrix<float> C = random_matrix<float>(n, r, 10), KR = random_matrix<float>(n, dr, 11);
    const Matrix<float> Q = random_matrix<float>(heads, r + dr, 12);
    LatentKVCache<float> cache(r, dr, 0.125f);
    cache.extend(C, KR);
    const Matrix<float> serial = latent_attend(cache, Q, SerialExecutor{});
    for (const int threads : {1, 2, 3}) {
        CAPTURE(threads);
        const OpenMPExecutor executor{.threads = threads};
        CHECK((latent_attend(cache, Q, executor).array() == serial.array()).all());
    }
    check_close(serial, latent_reference(reference::to_double(Q), latent_rows(C, KR), r, 0.125), tolerance<float>());
}

TEMPLATE_TEST_CASE("LatentKVCache: the softcap and sink logits per head, as the reference", "[memory][latent]",
                   MEMATTN_LATENT_SCALARS) {
    using T = TestType;
    const Index r = 20, dr = 4, heads = 3;
    const Index n = GENERATE(1, 1100);
    const Matrix<T> C = random_matrix<T>(n, r, 13, 3.0), KR = random_matrix<T>(n, dr, 14, 3.0);
    const Matrix<T> Q = random_matrix<T>(heads, r + dr, 15, 3.0);
    const std::vector<double> sinks = {0.5, -std::numeric_limits<double>::infinity(), 4.0};
    LatentKVCache<T> cache(r, dr, T(0.5), SoftmaxOptions{.softcap = 5.0, .sink_logits = sinks});
    cache.extend(C, KR);
    CHECK(cache.options().softcap == 5.0);
    check_close(latent_attend(cache, Q), latent_reference(reference::to_double(Q), latent_rows(C, KR), r, 0.5, 5.0, sinks),
                tolerance<T>());
    // One sink logit for every head.
    const std::vector<double> one = {1.5};
    LatentKVCache<T> shared(r, dr, T(0.5), SoftmaxOptions{.sink_logits = one});
    shared.extend(C, KR);
    check_close(latent_attend(shared, Q), latent_reference(reference::to_double(Q), latent_rows(C, KR), r, 0.5, 0, one),
                tolerance<T>());
    Matrix<T> two(2, r);
    REQUIRE_THROWS_AS(cache.attend(Q.topRows(2), two), std::invalid_argument);
}

TEST_CASE("LatentKVCache: bad input is refused by name and changes nothing", "[memory][latent]") {
    const Index r = 8, dr = 4;
    const auto message = [](auto&& f) {
        try {
            f();
        } catch (const std::invalid_argument& e) {
            return std::string(e.what());
        }
        return std::string("no exception");
    };
    CHECK_THAT(message([] { LatentKVCache<float>(0, 4, 0.5f); }),
               Catch::Matchers::Contains("LatentKVCache") && Catch::Matchers::Contains("latent_dim"));
    CHECK_THAT(message([] { LatentKVCache<float>(8, -1, 0.5f); }), Catch::Matchers::Contains("rope_dim"));
    CHECK_THAT(message([] { LatentKVCache<float>(8, 4, 0.0f); }), Catch::Matchers::Contains("scale"));
    CHECK_THAT(message([] { LatentKVCache<float>(8, 4, std::numeric_limits<float>::infinity()); }),
               Catch::Matchers::Contains("scale"));
    const double slope = 0.5;
    CHECK_THAT(message([&] { LatentKVCache<float>(8, 4, 0.5f, {.alibi_slopes = std::span(&slope, 1)}); }),
               Catch::Matchers::Contains("alibi_slopes"));
    CHECK_THAT(message([] { LatentKVCache<float>(8, 4, 0.5f, {.window = 16}); }),
               Catch::Matchers::Contains("options.window"));
    CHECK_THAT(message([] { LatentKVCache<float>(8, 4, 0.5f, {.causal = false}); }),
               Catch::Matchers::Contains("options.causal"));

    LatentKVCache<float, Eigen::half> cache(r, dr, 0.5f);
    cache.extend(random_matrix<float>(5, r, 16), random_matrix<float>(5, dr, 17));
    const Matrix<float> Q = random_matrix<float>(2, r + dr, 18);
    const Matrix<float> before = latent_attend(cache, Q);
    Matrix<float> huge = random_matrix<float>(3, dr, 19);
    huge(2, 1) = 1e6f;  // past float16's range
    CHECK_THAT(message([&] { cache.extend(random_matrix<float>(3, r, 20), huge); }),
               Catch::Matchers::Contains("LatentKVCache::extend") && Catch::Matchers::Contains("ropes") &&
                   Catch::Matchers::Contains("row 2"));
    CHECK_THAT(message([&] { cache.extend(random_matrix<float>(3, r + 1, 21), random_matrix<float>(3, dr, 22)); }),
               Catch::Matchers::Contains("latents") && Catch::Matchers::Contains("3x9"));
    CHECK_THAT(message([&] { cache.update(random_matrix<float>(1, r, 23).row(0), random_matrix<float>(1, dr + 2, 24).row(0)); }),
               Catch::Matchers::Contains("LatentKVCache::update") && Catch::Matchers::Contains("ropes"));
    Matrix<float> wrong(2, r + 1);
    CHECK_THAT(message([&] { cache.attend(Q, wrong); }),
               Catch::Matchers::Contains("LatentKVCache::attend") && Catch::Matchers::Contains("out"));
    Matrix<float> narrow(2, r);
    CHECK_THAT(message([&] { cache.attend(Q.leftCols(r), narrow); }), Catch::Matchers::Contains("queries"));
    CHECK(cache.length() == 5);
    CHECK((latent_attend(cache, Q).array() == before.array()).all());
}

TEMPLATE_TEST_CASE("LatentKVCache: snapshots of their own kind, all or nothing", "[memory][latent][snapshot]", float,
                   Eigen::bfloat16, Q8) {
    using S = TestType;
    const Index r = 24, dr = 8, n = 1200;
    LatentKVCache<float, S> cache(r, dr, 0.2f);
    cache.extend(random_matrix<float>(n, r, 25), random_matrix<float>(n, dr, 26));
    std::stringstream stream;
    save(cache, stream);
    const std::string bytes = stream.str();
    CHECK(bytes.size() == snapshot_size(cache));

    LatentKVCache<float, S> loaded(r, dr, 0.2f);
    loaded.update(random_matrix<float>(1, r, 27).row(0), random_matrix<float>(1, dr, 28).row(0));
    std::istringstream in(bytes);
    load(loaded, in);
    const Matrix<float> Q = random_matrix<float>(4, r + dr, 29);
    CHECK(loaded.length() == n);
    CHECK((latent_attend(loaded, Q).array() == latent_attend(cache, Q).array()).all());

    // Another width, another scale, a truncated stream: refused, the target unchanged.
    LatentKVCache<float, S> other(r, dr + 1, 0.2f), scaled(r, dr, 0.3f);
    std::istringstream in2(bytes), in3(bytes), in4(bytes.substr(0, bytes.size() - 7));
    REQUIRE_THROWS_AS(load(other, in2), SnapshotError);
    REQUIRE_THROWS_AS(load(scaled, in3), SnapshotError);
    REQUIRE_THROWS_AS(load(loaded, in4), SnapshotError);
    CHECK(loaded.length() == n);
    CHECK(other.length() == 0);
}

TEST_CASE("mla_decode: a DeepSeek-V3-shaped layer equals the unabsorbed MLA in double", "[layer][latent]") {
    // 128 heads, kv_lora_rank 512, RoPE 64, nope 128, v 128, YaRN factor 40 (mscale_all_dim
    // 1): DeepSeek-V3's attention with random weights; then smaller shapes off every tile.
    struct Shape {
        Index heads, r, dr, nope, dv, n;
    };
#if defined(MEMATTN_TEST_MEMORY_ONLY)  // -O0 under ASan: the small shapes
    const Shape shape = GENERATE(Shape{1, 33, 5, 7, 3, 1}, Shape{16, 20, 6, 8, 9, 1030});
#else
    const Shape shape = GENERATE(Shape{128, 512, 64, 128, 128, 20}, Shape{1, 33, 5, 7, 3, 1}, Shape{16, 20, 6, 8, 9, 1030});
#endif
    const Index H = shape.heads, r = shape.r, dr = shape.dr, nope = shape.nope, dv = shape.dv, n = shape.n;
    CAPTURE(H, r, dr, nope, dv, n);
    const double scale = mla_softmax_scale(nope + dr, 40, 1);
    CHECK(scale == Approx((0.1 * std::log(40.0) + 1) * (0.1 * std::log(40.0) + 1) / std::sqrt(double(nope + dr))));
    const reference::MatrixD C = reference::to_double(random_matrix<double>(n, r, 30));
    const reference::MatrixD KR = latent_turned(reference::to_double(random_matrix<double>(n, dr, 31)), 0);
    const reference::MatrixD q_nope = reference::to_double(random_matrix<double>(H, nope, 32));
    reference::MatrixD q_rope = reference::to_double(random_matrix<double>(H, dr, 33));
    for (Index h = 0; h < H; ++h)
        q_rope.row(h) = latent_turned(q_rope.row(h), n - 1);
    const reference::MatrixD W_UK = reference::to_double(random_matrix<double>(H * nope, r, 34, 1 / std::sqrt(double(r))));
    const reference::MatrixD W_UV = reference::to_double(random_matrix<double>(H * dv, r, 35, 1 / std::sqrt(double(r))));
    const reference::MatrixD expected =
        reference::mla_unabsorbed(H, q_nope, q_rope, C, KR, W_UK, W_UV, reference::Logits{.scale = scale});

    LatentKVCache<float> cache(r, dr, static_cast<float>(scale));
    cache.extend(C.cast<float>(), KR.cast<float>());
    Matrix<float> out(H, dv);
    mla_decode(cache, q_nope.cast<float>(), q_rope.cast<float>(), W_UK.cast<float>(), W_UV.cast<float>(), out);
    check_close(out, expected, 1e-4);

#if !defined(MEMATTN_TEST_MEMORY_ONLY)
    LatentKVCache<double> exact(r, dr, scale);
    exact.extend(C, KR);
    Matrix<double> out_d(H, dv);
    mla_decode(exact, q_nope, q_rope, W_UK, W_UV, out_d);
    check_close(out_d, expected, 1e-11);
#endif

    // The shapes are checked.
    Matrix<float> wrong(H, dv + 1);
    REQUIRE_THROWS_AS(mla_decode(cache, q_nope.cast<float>(), q_rope.cast<float>(), W_UK.cast<float>(),
                                 W_UV.cast<float>(), wrong),
                      std::invalid_argument);
    REQUIRE_THROWS_AS(mla_decode(cache, q_nope.cast<float>(), q_rope.cast<float>(), W_UK.topRows(H * nope - 1).cast<float>(),
                                 W_UV.cast<float>(), out),
                      std::invalid_argument);
}

TEMPLATE_TEST_CASE("mla_prefill: absorbed and expanded equal the unabsorbed MLA over the past and the prompt",
                   "[layer][latent]", MEMATTN_LATENT_SCALARS) {
    using T = TestType;
    struct Shape {
        Index heads, r, dr, nope, dv, past, n;
    };
    // One key chunk and past it (detail::mla_key_chunk 4096), no past, one token, RoPE 0.
    const Shape shape = GENERATE(Shape{3, 20, 6, 8, 5, 37, 70}, Shape{2, 9, 4, 4, 3, 4100, 5}, Shape{4, 16, 0, 6, 7, 0, 33},
                                 Shape{1, 5, 3, 2, 2, 12, 1});
    const auto mode = GENERATE(MlaPrefill::absorbed, MlaPrefill::expanded, MlaPrefill::automatic);
    const Index H = shape.heads, r = shape.r, dr = shape.dr, nope = shape.nope, dv = shape.dv, P = shape.past,
                n = shape.n;
    CAPTURE(H, r, dr, nope, dv, P, n, static_cast<int>(mode));
    const double scale = mla_softmax_scale(nope + dr);
    const Matrix<T> C = random_matrix<T>(P + n, r, 40), KR = random_matrix<T>(P + n, dr, 41);
    const Matrix<T> q_nope = random_matrix<T>(n * H, nope, 42), q_rope = random_matrix<T>(n * H, dr, 43);
    const Matrix<T> W_UK = random_matrix<T>(H * nope, r, 44, 0.5), W_UV = random_matrix<T>(H * dv, r, 45, 0.5);
    const std::vector<double> sinks(static_cast<std::size_t>(H), 0.75);
    for (const bool with_options : {false, true}) {
        CAPTURE(with_options);
        LatentKVCache<T> cache = with_options
                                     ? LatentKVCache<T>(r, dr, static_cast<T>(scale), {.softcap = 2.0, .sink_logits = sinks})
                                     : LatentKVCache<T>(r, dr, static_cast<T>(scale));
        cache.extend(C.topRows(P), KR.topRows(P));
        Matrix<T> out(n * H, dv);
        mla_prefill(cache, q_nope, q_rope, C.bottomRows(n), KR.bottomRows(n), W_UK, W_UV, out, {}, mode);
        CHECK(cache.length() == P + n);
        reference::Logits logits{.scale = scale};
        if (with_options) {
            logits.softcap = 2.0;
            logits.sink = 0.75;
        }
        const reference::MatrixD expected =
            reference::mla_unabsorbed(H, reference::to_double(q_nope), reference::to_double(q_rope), reference::to_double(C),
                                      reference::to_double(KR), reference::to_double(W_UK), reference::to_double(W_UV),
                                      logits);
        check_close(out, expected, sizeof(T) == 4 ? 1e-4 : 1e-11);
    }
}

TEST_CASE("mla_prefill: bitwise for any thread count, a compact cache's stored rows, bad input changes nothing",
          "[layer][latent]") {
    const Index H = 6, r = 24, dr = 8, nope = 8, dv = 8, P = 300, n = 40;
    const Matrix<float> C = random_matrix<float>(P + n, r, 50), KR = random_matrix<float>(P + n, dr, 51);
    const Matrix<float> q_nope = random_matrix<float>(n * H, nope, 52), q_rope = random_matrix<float>(n * H, dr, 53);
    const Matrix<float> W_UK = random_matrix<float>(H * nope, r, 54, 0.5), W_UV = random_matrix<float>(H * dv, r, 55, 0.5);
    for (const auto mode : {MlaPrefill::absorbed, MlaPrefill::expanded}) {
        Matrix<float> serial(n * H, dv), threaded(n * H, dv);
        LatentKVCache<float> a(r, dr, 0.2f), b(r, dr, 0.2f);
        a.extend(C.topRows(P), KR.topRows(P));
        b.extend(C.topRows(P), KR.topRows(P));
        mla_prefill(a, q_nope, q_rope, C.bottomRows(n), KR.bottomRows(n), W_UK, W_UV, serial, SerialExecutor{}, mode);
        mla_prefill(b, q_nope, q_rope, C.bottomRows(n), KR.bottomRows(n), W_UK, W_UV, threaded,
                    OpenMPExecutor{.threads = 2}, mode);
        CHECK((serial.array() == threaded.array()).all());

        // A bfloat16 cache: the float cache of the rows it holds, bitwise.
        LatentKVCache<float, Eigen::bfloat16> compact(r, dr, 0.2f);
        compact.extend(C.topRows(P), KR.topRows(P));
        Matrix<float> joined(P + n, r + dr), held(P + n, r + dr);
        joined << C, KR;
        detail::round_trip<float, Eigen::bfloat16>(joined, held.data(), r + dr);
        LatentKVCache<float> plain(r, dr, 0.2f);
        plain.extend(held.topRows(P).leftCols(r), held.topRows(P).rightCols(dr));
        Matrix<float> from_compact(n * H, dv), from_plain(n * H, dv);
        mla_prefill(compact, q_nope, q_rope, C.bottomRows(n), KR.bottomRows(n), W_UK, W_UV, from_compact, {}, mode);
        mla_prefill(plain, q_nope, q_rope, held.bottomRows(n).leftCols(r), held.bottomRows(n).rightCols(dr), W_UK, W_UV,
                    from_plain, {}, mode);
        CHECK((from_compact.array() == from_plain.array()).all());
    }
    LatentKVCache<float> cache(r, dr, 0.2f);
    cache.extend(C.topRows(P), KR.topRows(P));
    Matrix<float> out(n * H, dv), narrow(n * H, dv - 1);
    REQUIRE_THROWS_AS(mla_prefill(cache, q_nope, q_rope, C.bottomRows(n), KR.bottomRows(n), W_UK, W_UV, narrow),
                      std::invalid_argument);
    REQUIRE_THROWS_AS(mla_prefill(cache, q_nope.topRows(n * H - 1), q_rope, C.bottomRows(n), KR.bottomRows(n), W_UK,
                                  W_UV, out),
                      std::invalid_argument);
    REQUIRE_THROWS_AS(mla_prefill(cache, q_nope, q_rope, C.bottomRows(n), KR.bottomRows(n).leftCols(dr - 1), W_UK,
                                  W_UV, out),
                      std::invalid_argument);
    CHECK(cache.length() == P);
}

TEST_CASE("mla_expands: the prefill's automatic choice by the FLOPs of each form", "[layer][latent]") {
    // DeepSeek-V3's shapes: r = 512, d_r = 64, nope 128, v 128 (docs/performance.md).
    CHECK_FALSE(mla_expands(64, 0, 512, 64, 128, 128));     // below mla_expand_tokens
    CHECK(mla_expands(128, 0, 512, 64, 128, 128));          // no past: fewer FLOPs expanded
    CHECK(mla_expands(2048, 0, 512, 64, 128, 128));
    CHECK_FALSE(mla_expands(128, 4096, 512, 64, 128, 128)); // a long past to expand for few queries
    CHECK(mla_expands(256, 4096, 512, 64, 128, 128));
    CHECK_FALSE(mla_expands(200, 100000, 512, 64, 128, 128));
}
