#include "support.hpp"

#include <memattn/layer/latent_attention.hpp>
#include <memattn/serving/paged_latent_kv_cache.hpp>
#include <memattn/persistence/snapshot.hpp>

#include <cmath>
#include <functional>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
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

TEST_CASE("LatentKVCache: FpMath::bf16 on bfloat16 rows is the float cache of the stored rows with the queries "
          "rounded, within the bound of the weights' rounding; bitwise for any thread count and in a pool",
          "[memory][latent]") {
    // (r, d_r): an odd width past 16 pairs (vdpbf16ps with a zero pair, the query tile's
    // pairs by a block of 16 and a tail; float elsewhere), tiles' edges, DeepSeek's 512 + 64.
    const auto [r, dr] = GENERATE(std::pair<Index, Index>{33, 0}, std::pair<Index, Index>{40, 8},
                                  std::pair<Index, Index>{512, 64});
#if defined(MEMATTN_TEST_MEMORY_ONLY)
    const Index heads = GENERATE(1, 16);
    const Index n = GENERATE(0, 1, 129);
#else
    const Index heads = GENERATE(1, 16, 133);
    const Index n = GENERATE(0, 1, 129, 2100);
#endif
    CAPTURE(r, dr, heads, n);
    const Matrix<float> C = random_matrix<float>(n, r, 31), KR = random_matrix<float>(n, dr, 32);
    const Matrix<float> Q = random_matrix<float>(heads, r + dr, 33);
    const std::vector<double> sinks{0.25};
    const SoftmaxOptions options{.softcap = 4.0, .sink_logits = sinks, .fpmath = FpMath::bf16};
    LatentKVCache<float, Eigen::bfloat16> cache(r, dr, 0.2f, options);
    CHECK(cache.options().fpmath == FpMath::bf16);
    cache.extend(C, KR);
    const Matrix<float> out = latent_attend(cache, Q);
    if (n == 0) {  // (and no blocks of the empty matrices below: Eigen offsets their null data)
        CHECK(out.isZero(0));
        return;
    }
    // The float cache of the stored values, the queries rounded: the same logits up to
    // float's order of sums; the weights rounded to bfloat16 move each column by at most
    // 2⁻⁸/(1 − 2⁻⁸) of the values' range (docs/design.md §4.7c).
    Matrix<float> joined(n, r + dr), held(n, r + dr);
    joined << C, KR;
    detail::round_trip<float, Eigen::bfloat16>(joined, held.data(), r + dr);
    LatentKVCache<float> plain(r, dr, 0.2f, {.softcap = 4.0, .sink_logits = sinks});
    plain.extend(held.leftCols(r), held.rightCols(dr));
    const Matrix<float> rounded = Q.cast<Eigen::bfloat16>().cast<float>();
    const Matrix<float> expected = latent_attend(plain, rounded);
    // The sink's share rests on the rounded weights' sum too (lse within 2⁻⁸/(1 − 2⁻⁸)):
    // the values' range (2) plus their largest magnitude (1).
    const double bound = std::ldexp(1.0, -8) / (1 - std::ldexp(1.0, -8)) * 3.0 + 2e-5;
    CHECK((out - expected).cwiseAbs().maxCoeff() <= bound);
    // Any thread count, bit for bit; a pool's sequence (blocks of 7 and of 128), bit for bit.
    for (const int threads : {1, 2, 3}) {
        CAPTURE(threads);
        CHECK((latent_attend(cache, Q, OpenMPExecutor{.threads = threads}).array() == out.array()).all());
    }
    // Blocks of 7 (every tile gathered), 128 (none) and 200 (some tiles in place, some
    // across two blocks).
    for (const Index block : {Index{7}, Index{128}, Index{200}}) {
        CAPTURE(block);
        PagedLatentKVCache<float, Eigen::bfloat16> pool(r, dr, 0.2f, n / block + 2, block, options);
        CHECK(pool.options().fpmath == FpMath::bf16);
        const Index seq = pool.add_sequence();
        pool.extend(seq, C, KR);
        Matrix<float> paged(heads, r);
        pool.attend(seq, Q, paged);
        CHECK((paged.array() == out.array()).all());
    }
}

TEST_CASE("LatentKVCache: FpMath::bf16 needs float queries and bfloat16 rows", "[memory][latent]") {
    const SoftmaxOptions bf16{.fpmath = FpMath::bf16};
    const auto refused = [&](auto make) {
        try {
            make();
        } catch (const std::invalid_argument& e) {
            return std::string(e.what()).find("options.fpmath") != std::string::npos;
        }
        return false;
    };
    CHECK(refused([&] { LatentKVCache<float> c(8, 2, 0.5f, bf16); }));
    CHECK(refused([&] { LatentKVCache<float, Q8> c(8, 2, 0.5f, bf16); }));
    CHECK(refused([&] { LatentKVCache<double, Eigen::bfloat16> c(8, 2, 0.5, bf16); }));
    CHECK(refused([&] { LatentKVCache<float, Eigen::half> c(8, 2, 0.5f, bf16); }));
    CHECK(refused([&] { PagedLatentKVCache<float> p(8, 2, 0.5f, 4, 16, bf16); }));
    CHECK_NOTHROW(PagedLatentKVCache<float, Eigen::bfloat16>(8, 2, 0.5f, 4, 16, bf16));
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

namespace {

/// The prompt (the last n rows of C and KR, H heads a token) through mla_prefill into a
/// copy of `empty` holding the first P rows, serially; CHECKs that two threads give the
/// same bits, and returns the serial outputs.
template <class Cache>
Matrix<float> latent_prefill_any_threads(const Cache& empty, Index P, Index n, const Matrix<float>& C,
                                         const Matrix<float>& KR, const Matrix<float>& q_nope,
                                         const Matrix<float>& q_rope, const Matrix<float>& W_UK,
                                         const Matrix<float>& W_UV, MlaPrefill mode) {
    const Index dv = W_UV.rows() / (q_nope.rows() / n);
    Matrix<float> serial(q_nope.rows(), dv), threaded(q_nope.rows(), dv);
    Cache a = empty, b = empty;
    a.extend(C.topRows(P), KR.topRows(P));
    b.extend(C.topRows(P), KR.topRows(P));
    mla_prefill(a, q_nope, q_rope, C.bottomRows(n), KR.bottomRows(n), W_UK, W_UV, serial, SerialExecutor{}, mode);
    mla_prefill(b, q_nope, q_rope, C.bottomRows(n), KR.bottomRows(n), W_UK, W_UV, threaded,
                OpenMPExecutor{.threads = 2}, mode);
    CHECK((serial.array() == threaded.array()).all());
    return serial;
}

}  // namespace

TEST_CASE("mla_prefill: bitwise for any thread count, a compact cache's stored rows, bad input changes nothing",
          "[layer][latent]") {
    const Index H = 6, r = 24, dr = 8, nope = 8, dv = 8, P = 300, n = 40;
    const Matrix<float> C = random_matrix<float>(P + n, r, 50), KR = random_matrix<float>(P + n, dr, 51);
    const Matrix<float> q_nope = random_matrix<float>(n * H, nope, 52), q_rope = random_matrix<float>(n * H, dr, 53);
    const Matrix<float> W_UK = random_matrix<float>(H * nope, r, 54, 0.5), W_UV = random_matrix<float>(H * dv, r, 55, 0.5);
    for (const auto mode : {MlaPrefill::absorbed, MlaPrefill::expanded}) {
        latent_prefill_any_threads(LatentKVCache<float>(r, dr, 0.2f), P, n, C, KR, q_nope, q_rope, W_UK, W_UV, mode);

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

TEST_CASE("mla_prefill and mla_decode with FpMath::bf16 over bfloat16 rows: the unabsorbed MLA on the stored rows "
          "within the roundings; bitwise for any thread count; a pool's sequence as the cache",
          "[layer][latent]") {
    struct Shape {
        Index heads, r, dr, nope, dv, past, n;
    };
    // Past a key chunk (detail::mla_key_chunk 4096), no past, one token; an odd r (the
    // expansion's products then float products of the rounded values, not tiles).
#if defined(MEMATTN_TEST_MEMORY_ONLY)
    const Shape shape = GENERATE(Shape{3, 20, 6, 8, 6, 37, 70}, Shape{1, 7, 2, 2, 2, 12, 1});
#else
    const Shape shape = GENERATE(Shape{3, 20, 6, 8, 6, 37, 70}, Shape{2, 10, 4, 4, 4, 4100, 5},
                                 Shape{4, 16, 0, 6, 8, 0, 200}, Shape{1, 6, 2, 2, 2, 12, 1},
                                 Shape{2, 9, 3, 4, 5, 150, 140});
#endif
    const Index H = shape.heads, r = shape.r, dr = shape.dr, nope = shape.nope, dv = shape.dv, P = shape.past,
                n = shape.n;
    CAPTURE(H, r, dr, nope, dv, P, n);
    const double scale = mla_softmax_scale(nope + dr);
    const Matrix<float> C = random_matrix<float>(P + n, r, 90), KR = random_matrix<float>(P + n, dr, 91);
    const Matrix<float> q_nope = random_matrix<float>(n * H, nope, 92), q_rope = random_matrix<float>(n * H, dr, 93);
    const Matrix<float> W_UK = random_matrix<float>(H * nope, r, 94, 0.5), W_UV = random_matrix<float>(H * dv, r, 95, 0.5);
    const std::vector<double> sinks{0.5};
    const SoftmaxOptions options{.softcap = 3.0, .sink_logits = sinks, .fpmath = FpMath::bf16};
    // The rows as stored, in double: what the reference attends.
    Matrix<float> joined(P + n, r + dr), held(P + n, r + dr);
    joined << C, KR;
    detail::round_trip<float, Eigen::bfloat16>(joined, held.data(), r + dr);
    const reference::MatrixD stored = reference::to_double(held);
    reference::Logits logits{.scale = scale, .softcap = 3.0};
    logits.sink = 0.5;
    const reference::MatrixD expected =
        reference::mla_unabsorbed(H, reference::to_double(q_nope), reference::to_double(q_rope),
                                  stored.leftCols(r), stored.rightCols(dr), reference::to_double(W_UK),
                                  reference::to_double(W_UV), logits);
    for (const auto mode : {MlaPrefill::absorbed, MlaPrefill::expanded}) {
        CAPTURE(static_cast<int>(mode));
        const Matrix<float> serial = latent_prefill_any_threads(
            LatentKVCache<float, Eigen::bfloat16>(r, dr, static_cast<float>(scale), options), P, n, C, KR, q_nope,
            q_rope, W_UK, W_UV, mode);
        Matrix<float> paged(n * H, dv);
        // Within the roundings of the queries (and, expanded, of the keys and values) and of
        // the weights: two units of bfloat16's 2⁻⁸ on these unit-range values.
        check_close(serial, expected.bottomRows(n * H), 8e-3);
        PagedLatentKVCache<float, Eigen::bfloat16> pool(r, dr, static_cast<float>(scale), (P + n) / 7 + 2, 7, options);
        const Index seq = pool.add_sequence();
        pool.extend(seq, C.topRows(P), KR.topRows(P));
        mla_prefill(pool.sequence(seq), q_nope, q_rope, C.bottomRows(n), KR.bottomRows(n), W_UK, W_UV, paged, {},
                    mode);
        CHECK((paged.array() == serial.array()).all());
    }
    // A decode step after the prompt: the last token's heads.
    LatentKVCache<float, Eigen::bfloat16> cache(r, dr, static_cast<float>(scale), options);
    cache.extend(C, KR);
    Matrix<float> out(H, dv);
    mla_decode(cache, q_nope.bottomRows(H), q_rope.bottomRows(H), W_UK, W_UV, out);
    check_close(out, expected.bottomRows(H), 8e-3);
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

// ---- PagedLatentKVCache: the latent cache in a pool of blocks -----------------------------

namespace {

/// The H outputs of `pool`'s sequence `seq` for the queries Q.
template <class T, class S>
Matrix<T> paged_latent_attend(const PagedLatentKVCache<T, S>& pool, Index seq, const Matrix<T>& Q,
                              ExecutorRef executor = {}) {
    Matrix<T> out(Q.rows(), pool.latent_dim());
    pool.attend(seq, Q, out, executor);
    return out;
}

/// A LatentKVCache holding rows [first, first + n) of C and KR.
template <class T, class S>
LatentKVCache<T, S> paged_latent_alone(Index r, Index dr, T scale, const Matrix<T>& C, const Matrix<T>& KR, Index n,
                                       const SoftmaxOptions& options = {}) {
    LatentKVCache<T, S> cache(r, dr, scale, options);
    cache.extend(C.topRows(n), KR.topRows(n));
    return cache;
}

}  // namespace

TEMPLATE_TEST_CASE("PagedLatentKVCache: a sequence attends as a LatentKVCache of its rows, bitwise, in any storage",
                   "[serving][latent]", float, Eigen::bfloat16, Q8) {
    using S = TestType;
    const Index r = 24, dr = 8, heads = 12;
    const Matrix<float> C = random_matrix<float>(2300, r, 60), KR = random_matrix<float>(2300, dr, 61);
    const Matrix<float> Q = random_matrix<float>(heads, r + dr, 62);
    const std::vector<double> sinks(static_cast<std::size_t>(heads), 0.5);
    const SoftmaxOptions options{.softcap = 3.0, .sink_logits = sinks};
    for (const Index block : {Index{1}, Index{7}, Index{128}, Index{200}}) {
        CAPTURE(block);
        PagedLatentKVCache<float, S> pool(r, dr, 0.3f, 2300 / block + 8, block, options);
        // Lengths 0, 1, off every tile, three pieces; grown by update and by extend.
        for (const Index n : {Index{0}, Index{1}, Index{129}, Index{2300}}) {
            CAPTURE(n);
            const Index seq = pool.add_sequence();
            if (n > 0)
                pool.update(seq, C.row(0), KR.row(0));
            if (n > 1)
                pool.extend(seq, C.middleRows(1, n - 1), KR.middleRows(1, n - 1));
            REQUIRE(pool.length(seq) == n);
            CHECK(pool.blocks_of(seq) == (n + block - 1) / block);
            const auto alone = paged_latent_alone<float, S>(r, dr, 0.3f, C, KR, n, options);
            const Matrix<float> a = paged_latent_attend(pool, seq, Q), b = latent_attend(alone, Q);
            CHECK((a.array() == b.array()).all());
            if (n > 0 && std::is_same_v<S, float>)
                check_close(a, latent_reference(reference::to_double(Q), latent_rows(Matrix<float>(C.topRows(n)), Matrix<float>(KR.topRows(n))), r,
                                                0.3, 3.0, sinks),
                            tolerance<float>());
            pool.remove(seq);
        }
        CHECK(pool.free_blocks() == pool.blocks());
    }
}

TEST_CASE("PagedLatentKVCache: a batch equals each sequence alone, bitwise, for any thread count", "[serving][latent]") {
    const Index r = 32, dr = 8, heads = 16;
    const std::vector<Index> lengths{3000, 0, 1, 700, 1025};
    const Matrix<float> C = random_matrix<float>(3000, r, 63), KR = random_matrix<float>(3000, dr, 64);
    PagedLatentKVCache<float> pool(r, dr, 0.2f, 64, 128);
    std::vector<Index> seqs;
    for (const Index n : lengths) {
        seqs.push_back(pool.add_sequence());
        if (n > 0)
            pool.extend(seqs.back(), C.topRows(n), KR.topRows(n));
    }
    const auto B = static_cast<Index>(seqs.size());
    const Matrix<float> Q = random_matrix<float>(B * heads, r + dr, 65);
    Matrix<float> serial(B * heads, r);
    pool.attend(seqs, Q, serial, SerialExecutor{});
    for (Index i = 0; i < B; ++i) {
        const Matrix<float> alone = paged_latent_attend(pool, seqs[static_cast<std::size_t>(i)],
                                                        Matrix<float>(Q.middleRows(i * heads, heads)));
        CHECK((serial.middleRows(i * heads, heads).array() == alone.array()).all());
    }
    for (const int threads : {1, 2, 3}) {
        CAPTURE(threads);
        Matrix<float> threaded(B * heads, r);
        pool.attend(seqs, Q, threaded, OpenMPExecutor{.threads = threads});
        CHECK((threaded.array() == serial.array()).all());
    }
    // Repeats are allowed in an attend.
    const std::vector<Index> twice{seqs[0], seqs[0]};
    Matrix<float> both(2 * heads, r);
    pool.attend(twice, Q.topRows(2 * heads), both);
    CHECK((both.topRows(heads).array() == serial.topRows(heads).array()).all());
}

TEST_CASE("PagedLatentKVCache: fork shares blocks, writes copy them, truncate and remove free them",
          "[serving][latent]") {
    const Index r = 16, dr = 4, heads = 5, block = 8;
    const Matrix<float> C = random_matrix<float>(64, r, 66), KR = random_matrix<float>(64, dr, 67);
    const Matrix<float> D = random_matrix<float>(64, r, 68), DR = random_matrix<float>(64, dr, 69);
    const Matrix<float> Q = random_matrix<float>(heads, r + dr, 70);
    PagedLatentKVCache<float, Eigen::bfloat16> pool(r, dr, 0.25f, 12, block);
    const Index a = pool.add_sequence();
    pool.extend(a, C.topRows(20), KR.topRows(20));  // 3 blocks, the last half full
    const Index b = pool.fork(a);
    CHECK(pool.blocks_in_use() == 3);
    CHECK(pool.length(b) == 20);
    // b writes into the shared last block: it copies it (one block more), a is unchanged.
    Matrix<float> joined_a(21, r), joined_ra(21, dr);
    pool.update(b, D.row(0), DR.row(0));
    CHECK(pool.blocks_in_use() == 4);
    const auto expect = [&](Index seq, const Matrix<float>& c, const Matrix<float>& kr) {
        LatentKVCache<float, Eigen::bfloat16> alone(r, dr, 0.25f);
        alone.extend(c, kr);
        CHECK((paged_latent_attend(pool, seq, Q).array() == latent_attend(alone, Q).array()).all());
    };
    Matrix<float> cb(21, r), krb(21, dr);
    cb << C.topRows(20), D.row(0);
    krb << KR.topRows(20), DR.row(0);
    expect(a, C.topRows(20), KR.topRows(20));
    expect(b, cb, krb);
    // a batch where both write: a owns its last block now, no copy.
    const std::vector<Index> both{a, b};
    const Index needed = pool.blocks_needed(both, std::vector<Index>{1, 1});
    CHECK(needed == 0);
    pool.update(both, C.middleRows(20, 2), KR.middleRows(20, 2));
    CHECK(pool.blocks_in_use() == 4);
    // truncate b into the shared part: its own block freed; remove a: the shared blocks stay b's.
    pool.truncate(b, 10);
    CHECK(pool.blocks_in_use() == 3);
    pool.remove(a);
    CHECK(pool.blocks_in_use() == 2);
    expect(b, C.topRows(10), KR.topRows(10));
    // A fork of a fork, then a batch of three writing into one shared block: two copy.
    const Index c = pool.fork(b), d = pool.fork(b);
    const std::vector<Index> three{b, c, d};
    CHECK(pool.blocks_needed(three, std::vector<Index>{1, 1, 1}) == 2);
    pool.update(three, D.middleRows(1, 3), DR.middleRows(1, 3));
    CHECK(pool.blocks_in_use() == 4);
    for (Index i = 0; i < 3; ++i) {
        Matrix<float> cc(11, r), kk(11, dr);
        cc << C.topRows(10), D.row(1 + i);
        kk << KR.topRows(10), DR.row(1 + i);
        expect(three[static_cast<std::size_t>(i)], cc, kk);
    }
}

TEST_CASE("PagedLatentKVCache: a full pool, bad input and a failing attend change nothing", "[serving][latent]") {
    const Index r = 8, dr = 2, heads = 3, block = 4;
    const Matrix<float> C = random_matrix<float>(40, r, 71), KR = random_matrix<float>(40, dr, 72);
    PagedLatentKVCache<float> pool(r, dr, 0.5f, 5, block, {}, {.reject_nonfinite = true});
    const Index a = pool.add_sequence(), b = pool.add_sequence();
    pool.extend(a, C.topRows(14), KR.topRows(14));  // 4 blocks
    const auto same = [&] {
        CHECK(pool.length(a) == 14);
        CHECK(pool.length(b) == 0);
        CHECK(pool.free_blocks() == 1);
    };
    CHECK_THROWS_AS(pool.extend(b, C.topRows(5), KR.topRows(5)), PoolExhausted);
    same();
    CHECK_THROWS_AS(pool.extend(b, C.topRows(3), KR.topRows(3).leftCols(1)), std::invalid_argument);
    Matrix<float> bad = C.topRows(2);
    bad(1, 3) = std::numeric_limits<float>::infinity();
    CHECK_THROWS_WITH(pool.extend(b, bad, KR.topRows(2)), Catch::Contains("reject_nonfinite"));
    CHECK_THROWS_AS(pool.update(7, C.row(0), KR.row(0)), std::invalid_argument);
    const std::vector<Index> dup{a, a};
    CHECK_THROWS_WITH(pool.update(dup, C.topRows(2), KR.topRows(2)), Catch::Contains("twice"));
    const std::vector<Index> ab{a, b};
    // a's 15th token fits its last block, b's first needs the free one: fits; then a full pool.
    CHECK(pool.blocks_needed(ab, std::vector<Index>{1, 1}) == 1);
    Matrix<float> Q = random_matrix<float>(2 * heads, r + dr, 73), out(2 * heads, r), narrow(2 * heads, r - 1);
    CHECK_THROWS_AS(pool.decode(ab, Q, C.topRows(2), KR.topRows(2), narrow), std::invalid_argument);
    CHECK_THROWS_AS(pool.decode(ab, Q.topRows(5), C.topRows(2), KR.topRows(2), out), std::invalid_argument);
    same();
    // The attends fail: the tokens are taken back, every block as it was.
    const auto failing = [&](Index, auto&&) { throw std::runtime_error("the executor failed"); };
    struct Failing {
        [[nodiscard]] int concurrency() const { return 2; }
        void parallel_for(Index, const std::function<void(Index)>&) const { throw std::runtime_error("failed"); }
    };
    static_cast<void>(failing);
    PagedLatentKVCache<float> big(r, dr, 0.5f, 2000, 16);
    const Index x = big.add_sequence(), y = big.add_sequence();
    const Matrix<float> CC = random_matrix<float>(20000, r, 74), KK = random_matrix<float>(20000, dr, 75);
    big.extend(x, CC, KK);
    big.extend(y, CC.topRows(5), KK.topRows(5));
    const Index free = big.free_blocks();
    const std::vector<Index> xy{x, y};
    Matrix<float> Qxy = random_matrix<float>(2 * 64, r + dr, 76), Oxy(2 * 64, r);
    CHECK_THROWS_AS(big.decode(xy, Qxy, C.topRows(2), KR.topRows(2), Oxy, Failing{}), std::runtime_error);
    CHECK(big.length(x) == 20000);
    CHECK(big.length(y) == 5);
    CHECK(big.free_blocks() == free);
    // Constructor arguments by name.
    CHECK_THROWS_WITH((PagedLatentKVCache<float>(r, dr, 0.0f, 4)), Catch::Contains("scale"));
    CHECK_THROWS_WITH((PagedLatentKVCache<float>(r, dr, 0.5f, 0)), Catch::Contains("blocks"));
    const std::vector<double> slopes{0.5};
    CHECK_THROWS_WITH((PagedLatentKVCache<float>(r, dr, 0.5f, 4, 4, {.alibi_slopes = slopes})),
                      Catch::Contains("alibi"));
    CHECK_THROWS_WITH((PagedLatentKVCache<float>(r, dr, 0.5f, 4, 4, {.window = 8})), Catch::Contains("window"));
}

TEST_CASE("PagedLatentKVCache: snapshots of a sequence load into a pool of any block size", "[serving][latent][snapshot]") {
    const Index r = 12, dr = 4, heads = 4;
    const Matrix<float> C = random_matrix<float>(300, r, 77), KR = random_matrix<float>(300, dr, 78);
    const Matrix<float> Q = random_matrix<float>(heads, r + dr, 79);
    PagedLatentKVCache<float, Q8> from(r, dr, 0.4f, 50, 7), into(r, dr, 0.4f, 4, 128);
    const Index a = from.add_sequence();
    from.extend(a, C.topRows(250), KR.topRows(250));
    std::stringstream bytes;
    save(from.sequence(a), bytes);
    const Index b = into.add_sequence();
    auto seq = into.sequence(b);
    load(seq, bytes);
    CHECK(into.length(b) == 250);
    CHECK(into.blocks_of(b) == 2);
    CHECK((paged_latent_attend(into, b, Q).array() == paged_latent_attend(from, a, Q).array()).all());
    // Another scale, or too few blocks: refused, the sequence as it was.
    PagedLatentKVCache<float, Q8> other(r, dr, 0.5f, 4, 128), small(r, dr, 0.4f, 1, 128);
    const Index o = other.add_sequence(), s = small.add_sequence();
    small.extend(s, C.topRows(3), KR.topRows(3));
    std::stringstream again(bytes.str());
    auto os = other.sequence(o);
    CHECK_THROWS_AS(load(os, again), SnapshotError);
    std::stringstream third(bytes.str());
    auto ss = small.sequence(s);
    CHECK_THROWS_AS(load(ss, third), PoolExhausted);
    CHECK(small.length(s) == 3);
    CHECK(small.free_blocks() == 0);
}

TEST_CASE("mla_decode and mla_prefill over a pool: as over a LatentKVCache, and batched", "[layer][serving][latent]") {
    const Index H = 6, r = 24, dr = 8, nope = 8, dv = 8, P = 300, n = 40;
    const Matrix<float> C = random_matrix<float>(P + n, r, 80), KR = random_matrix<float>(P + n, dr, 81);
    const Matrix<float> q_nope = random_matrix<float>(n * H, nope, 82), q_rope = random_matrix<float>(n * H, dr, 83);
    const Matrix<float> W_UK = random_matrix<float>(H * nope, r, 84, 0.5), W_UV = random_matrix<float>(H * dv, r, 85, 0.5);
    PagedLatentKVCache<float> pool(r, dr, 0.2f, 40, 16);
    for (const auto mode : {MlaPrefill::absorbed, MlaPrefill::expanded}) {
        CAPTURE(static_cast<int>(mode));
        LatentKVCache<float> cache(r, dr, 0.2f);
        cache.extend(C.topRows(P), KR.topRows(P));
        const Index seq = pool.add_sequence();
        pool.extend(seq, C.topRows(P), KR.topRows(P));
        Matrix<float> a(n * H, dv), b(n * H, dv);
        mla_prefill(cache, q_nope, q_rope, C.bottomRows(n), KR.bottomRows(n), W_UK, W_UV, a, {}, mode);
        mla_prefill(pool.sequence(seq), q_nope, q_rope, C.bottomRows(n), KR.bottomRows(n), W_UK, W_UV, b, {}, mode);
        CHECK(pool.length(seq) == P + n);
        CHECK((a.array() == b.array()).all());
        pool.remove(seq);
    }
    // A decode step of three sequences at once against each through mla_decode alone.
    std::vector<Index> seqs;
    for (const Index len : {P, Index{1}, Index{77}}) {
        seqs.push_back(pool.add_sequence());
        pool.extend(seqs.back(), C.topRows(len), KR.topRows(len));
    }
    const Index B = 3;
    Matrix<float> batched(B * H, dv);
    mla_decode(pool, seqs, q_nope.topRows(B * H), q_rope.topRows(B * H), W_UK, W_UV, batched);
    for (Index i = 0; i < B; ++i) {
        Matrix<float> alone(H, dv);
        mla_decode(pool.sequence(seqs[static_cast<std::size_t>(i)]), q_nope.middleRows(i * H, H),
                   q_rope.middleRows(i * H, H), W_UK, W_UV, alone);
        CHECK((batched.middleRows(i * H, H).array() == alone.array()).all());
    }
    Matrix<float> threaded(B * H, dv);
    mla_decode(pool, seqs, q_nope.topRows(B * H), q_rope.topRows(B * H), W_UK, W_UV, threaded,
               OpenMPExecutor{.threads = 2});
    CHECK((threaded.array() == batched.array()).all());
    Matrix<float> wrong(B * H, dv + 1);
    CHECK_THROWS_AS(mla_decode(pool, seqs, q_nope.topRows(B * H), q_rope.topRows(B * H), W_UK, W_UV, wrong),
                    std::invalid_argument);
}
