#include "support.hpp"

#include <memattn/kernels/causal_softmax.hpp>
#include <memattn/memory/kv_cache.hpp>

#include <limits>
#include <vector>

using namespace memattn;
using memattn::test::check_close;
using memattn::test::random_matrix;
using memattn::test::tolerance;

namespace {

// Sizes are swept around the query tiles (144 full and 48 windowed with AVX2, 192 and
// 64 with AVX-512) and the key tiles (128 full, 96 windowed).
constexpr Index tile = detail::SoftmaxTiles{}.queries;
constexpr Index key_tile = detail::SoftmaxTiles{}.keys;
constexpr Index window_tile = detail::default_tiles(1).queries;
constexpr Index window_key_tile = detail::default_tiles(1).keys;
static_assert(window_tile < window_key_tile && window_key_tile < key_tile && key_tile < tile,
              "the sweep below puts sizes around these tile sizes");

/// Runs the kernel with lse and checks both against the double reference.
template <class T>
void check_against_reference(const Matrix<T>& Q, const Matrix<T>& K, const Matrix<T>& V, SoftmaxOptions options,
                             double rel = tolerance<T>()) {
    Matrix<T> O(Q.rows(), V.cols());
    Vector<T> lse(Q.rows());
    causal_softmax_attention(Q, K, V, O, lse, options);
    const auto expected = reference::softmax_attention(reference::to_double(Q), reference::to_double(K),
                                                       reference::to_double(V), options.scale, options.window,
                                                       options.sink_tokens);
    check_close(O, expected.out, rel);
    for (Index i = 0; i < Q.rows(); ++i) {
        const double e = expected.lse[static_cast<std::size_t>(i)];
        CAPTURE(i);
        REQUIRE_THAT(static_cast<double>(lse(i)), Catch::Matchers::WithinAbs(e, rel * std::max(1.0, std::abs(e))));
    }
}

}  // namespace

TEMPLATE_TEST_CASE("causal softmax: sizes around the tile, windows and sinks", "[softmax][kernel]", float, double) {
    using T = TestType;
    const Index n = GENERATE(Index(0), Index(1), Index(2), window_tile - 1, window_tile + 1, window_key_tile - 1,
                             window_key_tile + 1, key_tile - 1, key_tile, key_tile + 1, tile - 1, tile, tile + 1,
                             3 * key_tile + 2);
    const Index window = GENERATE(Index(0), Index(1), Index(2), Index(17), window_tile, Index(1001));
    const Index sinks = GENERATE(Index(0), Index(1), Index(4));
    CAPTURE(n, window, sinks);
    const Index d = 3, dv = 5;
    check_against_reference(random_matrix<T>(n, d, 1), random_matrix<T>(n, d, 2), random_matrix<T>(n, dv, 3),
                            {.scale = 0, .window = window, .sink_tokens = sinks});
}

TEMPLATE_TEST_CASE("causal softmax: a thousand tokens", "[softmax][kernel]", float, double) {
    using T = TestType;
    const Index n = 1000;
    const auto [window, sinks] = GENERATE(table<Index, Index>({{0, 0}, {17, 4}, {1000, 0}}));
    CAPTURE(window, sinks);
    check_against_reference(random_matrix<T>(n, 3, 1), random_matrix<T>(n, 3, 2), random_matrix<T>(n, 5, 3),
                            {.scale = 0, .window = window, .sink_tokens = sinks});
}

TEMPLATE_TEST_CASE("causal softmax: key and value dims", "[softmax][kernel]", float, double) {
    using T = TestType;
    // Every dim of the issue (1, 3, 64, 128, 130) as d and as dv, each packet-tail case paired.
    const auto [d, dv] = GENERATE(table<Index, Index>({{1, 1}, {1, 130}, {130, 1}, {3, 64}, {64, 3}, {64, 64},
                                                      {64, 128}, {128, 64}, {128, 130}, {130, 130}}));
    const Index window = GENERATE(0, 17);
    CAPTURE(d, dv, window);
    const Index n = 2 * tile + 3;
    check_against_reference(random_matrix<T>(n, d, 4), random_matrix<T>(n, d, 5), random_matrix<T>(n, dv, 6),
                            {.scale = 0, .window = window, .sink_tokens = window ? 2 : 0});
}

TEMPLATE_TEST_CASE("causal softmax: queries continuing a prefix (Nq < Nk)", "[softmax][kernel]", float, double) {
    using T = TestType;
    const Index nk = 300;
    const Index nq = GENERATE(Index(1), tile - 1, tile, tile + 1, Index(299), Index(300));
    const Index window = GENERATE(0, 17, 100);
    const Index sinks = GENERATE(0, 4);
    CAPTURE(nq, window, sinks);
    check_against_reference(random_matrix<T>(nq, 7, 7), random_matrix<T>(nk, 7, 8), random_matrix<T>(nk, 9, 9),
                            {.scale = 0.3, .window = window, .sink_tokens = sinks});
}

TEMPLATE_TEST_CASE("causal softmax: splitting the queries gives the same rows", "[softmax][kernel]", float, double) {
    using T = TestType;
    const Index n = 333, d = 16, dv = 8;
    const Matrix<T> Q = random_matrix<T>(n, d, 10), K = random_matrix<T>(n, d, 11), V = random_matrix<T>(n, dv, 12);
    const SoftmaxOptions options{.scale = 0, .window = GENERATE(Index(0), Index(70)), .sink_tokens = 3};
    Matrix<T> whole(n, dv);
    causal_softmax_attention(Q, K, V, whole, options);

    const Index cut = GENERATE(Index(0), Index(1), tile, Index(200), Index(332), Index(333));
    CAPTURE(cut, options.window);
    Matrix<T> pieces(n, dv);
    // The first rows see the prefix K[0, cut) only; the rest continue it.
    causal_softmax_attention(Q.topRows(cut), K.topRows(cut), V.topRows(cut), pieces.topRows(cut), options);
    causal_softmax_attention(Q.bottomRows(n - cut), K, V, pieces.bottomRows(n - cut), options);
    check_close(pieces, reference::to_double(whole), tolerance<T>());
}

TEMPLATE_TEST_CASE("causal softmax: logits of 1e4 do not overflow", "[softmax][kernel]", float, double) {
    using T = TestType;
    const Index n = 2 * tile + 5, d = 4;
    // |scale · q·k| up to ~4e4: exp is only ever taken of differences to the running max.
    const Matrix<T> Q = random_matrix<T>(n, d, 13, 100.0), K = random_matrix<T>(n, d, 14, 100.0);
    const Matrix<T> V = random_matrix<T>(n, d, 15);
    // Near-ties between logits of size 1e4 are decided by the rounding of q·k in T.
    check_against_reference(Q, K, V, {.scale = 1, .window = GENERATE(0, 9), .sink_tokens = 0},
                            sizeof(T) == 4 ? 5e-2 : 1e-9);

    // Key 0 has logit 1e4 for every query and wins outright (the others have −1e4): o = v_0, lse = 1e4.
    Matrix<T> q = Matrix<T>::Constant(n, 1, T(100)), k = Matrix<T>::Constant(n, 1, T(-100));
    k(0, 0) = T(100);
    const Matrix<T> v = random_matrix<T>(n, 2, 16);
    Matrix<T> O(n, 2);
    Vector<T> lse(n);
    causal_softmax_attention(q, k, v, O, lse, {.scale = 1});
    check_close(O, reference::to_double(v.row(0).replicate(n, 1)), tolerance<T>());
    for (Index i = 0; i < n; ++i)
        REQUIRE_THAT(static_cast<double>(lse(i)), Catch::Matchers::WithinRel(1e4, tolerance<T>()));
}

TEMPLATE_TEST_CASE("causal softmax: a non-finite value poisons only the queries that see it", "[softmax][kernel]",
                   float, double) {
    using T = TestType;
    const Index n = 150, bad = GENERATE(Index(1), Index(70));
    const T poison = GENERATE(std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity());
    const SoftmaxOptions options{.scale = 0, .window = GENERATE(Index(0), Index(9)), .sink_tokens = GENERATE(0, 2)};
    CAPTURE(bad, poison, options.window, options.sink_tokens);
    const Matrix<T> Q = random_matrix<T>(n, 4, 22), K = random_matrix<T>(n, 4, 23);
    Matrix<T> V = random_matrix<T>(n, 3, 24);
    V(bad, 1) = poison;
    Matrix<T> O(n, 3);
    causal_softmax_attention(Q, K, V, O, options);
    const auto expected = reference::softmax_attention(reference::to_double(Q), reference::to_double(K),
                                                       reference::to_double(V), 0, options.window, options.sink_tokens);
    for (Index i = 0; i < n; ++i) {
        CAPTURE(i);
        if (reference::visible(bad, i, options.window, options.sink_tokens)) {
            CHECK_FALSE(O.row(i).allFinite());
        } else {
            REQUIRE(O.row(i).allFinite());
            check_close(O.row(i), expected.out.row(i), tolerance<T>());
        }
    }
}

TEMPLATE_TEST_CASE("causal softmax: views with a row stride, lse in a column", "[softmax][kernel]", float, double) {
    using T = TestType;
    const Index n = 150, heads = 3, d = 8, dv = 5;
    const Matrix<T> QKV = random_matrix<T>(n, heads * (2 * d + dv), 17);
    Matrix<T> O = Matrix<T>::Zero(n, heads * dv);
    Matrix<T> lse = Matrix<T>::Zero(n, heads);
    for (Index h = 0; h < heads; ++h) {
        const auto Q = QKV.middleCols(h * d, d), K = QKV.middleCols((heads + h) * d, d);
        const auto V = QKV.middleCols(2 * heads * d + h * dv, dv);
        causal_softmax_attention(Q, K, V, O.middleCols(h * dv, dv), lse.col(h), {.scale = 0, .window = 40});
        const auto expected = reference::softmax_attention(reference::to_double(Q), reference::to_double(K),
                                                           reference::to_double(V), 0, 40);
        check_close(O.middleCols(h * dv, dv), expected.out, tolerance<T>());
        CHECK_THAT(static_cast<double>(lse(n - 1, h)),
                   Catch::Matchers::WithinRel(expected.lse.back(), 10 * tolerance<T>()));
    }
}

/// C = diag(α)·C + A·B through tile_product with blocking B, A(r, k) = a[r·a_row + k·a_k].
template <class T, class B>
Matrix<T> blocked_product(const Matrix<T>& A, bool transposed_a, const Matrix<T>& Bm, const Matrix<T>& C0,
                          const std::vector<T>* alpha) {
    const Matrix<T> At = A.transpose();  // A stored key-major, as the kernel reads Pᵀ
    const T* a = transposed_a ? At.data() : A.data();
    const Index a_row = transposed_a ? 1 : A.cols(), a_k = transposed_a ? A.rows() : 1;
    Matrix<T> C = C0;
    detail::tile_product<T, B>(A.rows(), Bm.cols(), A.cols(), a, a_row, a_k, Bm.data(), Bm.cols(), C.data(), C.cols(),
                               alpha ? alpha->data() : nullptr);
    return C;
}

TEMPLATE_TEST_CASE("tile_product: every blocking gives the plain product, bit for bit the same", "[softmax][tile]",
                   float, double) {
    using T = TestType;
    constexpr Index lanes = detail::packet_lanes<T>;
    const Index rows = GENERATE(Index(0), Index(1), Index(5), Index(6), Index(7), Index(13), Index(64));
    const Index cols = GENERATE_COPY(Index(1), lanes - 1, lanes, 2 * lanes + 3, 4 * lanes, 5 * lanes + 1, 8 * lanes);
    // 300: B spans several column panels (detail::panel_bytes) once cols reach 4 lanes.
    const Index depth = GENERATE(Index(0), Index(1), Index(9), Index(64), Index(300));
    const bool transposed_a = GENERATE(false, true), scaled = GENERATE(false, true);
    if (cols <= 0)
        return;
    const Matrix<T> A = random_matrix<T>(rows, depth, 1), Bm = random_matrix<T>(depth, cols, 2);
    const Matrix<T> C0 = random_matrix<T>(rows, cols, 3);
    std::vector<T> alpha(static_cast<std::size_t>(rows));
    for (Index r = 0; r < rows; ++r)
        alpha[static_cast<std::size_t>(r)] = T(0.5) + T(r % 3);
    const std::vector<T>* scale = scaled ? &alpha : nullptr;

    // The default blocking, the AVX-512 one (with this machine's packets), 0.1's and the degenerate ones.
    const Matrix<T> C = blocked_product<T, detail::DefaultBlocking>(A, transposed_a, Bm, C0, scale);
    Eigen::MatrixXd expected = reference::to_double(A) * reference::to_double(Bm);
    if (scaled)
        for (Index r = 0; r < rows; ++r)
            expected.row(r) += static_cast<double>(alpha[static_cast<std::size_t>(r)]) * C0.row(r).template cast<double>();
    check_close(C, expected, tolerance<T>());
    CHECK(C == (blocked_product<T, detail::Blocking<6, 4>>(A, transposed_a, Bm, C0, scale)));
    CHECK(C == (blocked_product<T, detail::Blocking<6, 2>>(A, transposed_a, Bm, C0, scale)));
    CHECK(C == (blocked_product<T, detail::Blocking<4, 2>>(A, transposed_a, Bm, C0, scale)));
    CHECK(C == (blocked_product<T, detail::Blocking<8, 3>>(A, transposed_a, Bm, C0, scale)));
    CHECK(C == (blocked_product<T, detail::Blocking<1, 1>>(A, transposed_a, Bm, C0, scale)));
}

TEMPLATE_TEST_CASE("transpose: register blocks and edges equal Eigen's transpose", "[tile]", float, double) {
    using T = TestType;
    constexpr Index lanes = detail::packet_lanes<T>;
    const Index rows = GENERATE_COPY(Index(0), Index(1), lanes - 1, lanes, 2 * lanes + 3);
    const Index cols = GENERATE_COPY(Index(1), lanes, 3 * lanes + 1);
    if (rows < 0)
        return;
    const Matrix<T> src = random_matrix<T>(rows, cols + 2, 11);  // row stride cols + 2
    Matrix<T> dst = Matrix<T>::Constant(cols, rows + 1, T(7));   // row stride rows + 1
    detail::transpose(src.data(), rows, cols, src.cols(), dst.data(), dst.cols());
    CHECK(dst.leftCols(rows) == src.leftCols(cols).transpose());
    CHECK((dst.col(rows).array() == T(7)).all());
}

/// Rows r of a band: terms [r − 9, r + 3) of the depth and columns [r, r + 2·lanes),
/// clipped, the shape of the masked tiles' diagonals.
struct TestBand {
    Index depth, cols, lanes;
    [[nodiscard]] detail::Range terms_of(Index r) const {
        return {std::clamp<Index>(r - 9, 0, depth), std::clamp<Index>(r + 3, 0, depth)};
    }
    [[nodiscard]] detail::Range columns_of(Index r) const { return {std::min(r, cols), std::min(r + 2 * lanes, cols)}; }
    [[nodiscard]] detail::Range terms(Index row, Index rows, Index) const {
        return {terms_of(row).first, terms_of(row + rows - 1).end};
    }
    [[nodiscard]] detail::Range columns(Index row, Index rows, Index) const {
        return {columns_of(row).first, columns_of(row + rows - 1).end};
    }
};

TEMPLATE_TEST_CASE("tile_product: a banded product skips only zero terms and the columns outside its band",
                   "[softmax][tile]", float, double) {
    using T = TestType;
    constexpr Index lanes = detail::packet_lanes<T>;
    const Index rows = GENERATE(Index(1), Index(7), Index(40)), depth = GENERATE(Index(0), Index(5), Index(33));
    const Index cols = GENERATE_COPY(Index(1), 3 * lanes + 1, 6 * lanes);
    const TestBand band{depth, cols, lanes};
    Matrix<T> A = random_matrix<T>(rows, depth, 7);
    for (Index r = 0; r < rows; ++r)  // A is zero outside each row's terms
        for (Index k = 0; k < depth; ++k)
            if (k < band.terms_of(r).first || k >= band.terms_of(r).end)
                A(r, k) = T(0);
    const Matrix<T> Bm = random_matrix<T>(depth, cols, 8), C0 = random_matrix<T>(rows, cols, 9);
    std::vector<T> alpha(static_cast<std::size_t>(rows), T(0.75));
    Matrix<T> dense = C0, banded = C0;
    detail::tile_product<T>(rows, cols, depth, A.data(), depth, 1, Bm.data(), cols, dense.data(), cols, alpha.data());
    detail::tile_product<T>(rows, cols, depth, A.data(), depth, 1, Bm.data(), cols, banded.data(), cols, alpha.data(),
                            band);
    constexpr Index strip = detail::DefaultBlocking::rows;
    for (Index r = 0; r < rows; ++r) {
        // Row r's band holds the product; a strip writes the hull of its rows' bands
        // rounded out to whole packets, and no other column.
        const auto [first, end] = band.columns_of(r);
        const Index s0 = r / strip * strip, s1 = std::min(s0 + strip, rows);
        const detail::Range written = band.columns(s0, s1 - s0, cols);
        for (Index j = 0; j < cols; ++j) {
            if (j >= first && j < end)
                CHECK(banded(r, j) == dense(r, j));
            else if (j < written.first / lanes * lanes || j >= detail::round_up(written.end, lanes))
                CHECK(banded(r, j) == C0(r, j));
        }
    }
}

TEMPLATE_TEST_CASE("tile_product: lower-triangular bands compute the lower part, the same bits as dense",
                   "[tile]", float, double) {
    using T = TestType;
    constexpr Index lanes = detail::packet_lanes<T>;
    const Index n = GENERATE_COPY(Index(1), Index(5), Index(7), Index(16), 2 * lanes + 3, Index(600));
    const Index depth = GENERATE(Index(1), Index(64));
    const Index shift = GENERATE(Index(-1), Index(0), Index(2));
    CAPTURE(n, depth, shift);
    // LowerColumns: C = A Bᵀ-shaped (n × n); row t holds columns s ≤ t + shift at least,
    // and a column a strip does not write keeps its value.
    const Matrix<T> A = random_matrix<T>(n, depth, 21), Bm = random_matrix<T>(depth, n, 22);
    const Matrix<T> C0 = Matrix<T>::Constant(n, n, T(-7));
    Matrix<T> dense = C0, lower = C0;
    detail::tile_product<T>(n, n, depth, A.data(), depth, 1, Bm.data(), n, dense.data(), n, nullptr);
    detail::tile_product<T>(n, n, depth, A.data(), depth, 1, Bm.data(), n, lower.data(), n, nullptr,
                            detail::LowerColumns{shift});
    for (Index t = 0; t < n; ++t)
        for (Index s2 = 0; s2 < n; ++s2) {
            if (s2 <= t + shift)
                REQUIRE(lower(t, s2) == dense(t, s2));
            else if (lower(t, s2) != dense(t, s2))
                REQUIRE(lower(t, s2) == T(-7));
        }
    // LowerTerms: A lower-triangular (zero for s > t + shift − 1): the skipped terms add nothing.
    Matrix<T> L = random_matrix<T>(n, n, 23);
    for (Index t = 0; t < n; ++t)
        for (Index s2 = std::max<Index>(t + shift, 0); s2 < n; ++s2)
            L(t, s2) = T(0);
    const Matrix<T> U = random_matrix<T>(n, depth, 24);
    Matrix<T> full = random_matrix<T>(n, depth, 25), banded = full;
    detail::tile_product<T, detail::DefaultBlocking, true>(n, depth, n, L.data(), n, 1, U.data(), depth, full.data(),
                                                           depth, nullptr);
    detail::tile_product<T, detail::DefaultBlocking, true>(n, depth, n, L.data(), n, 1, U.data(), depth,
                                                           banded.data(), depth, nullptr, detail::LowerTerms{shift});
    REQUIRE(banded == full);
}

TEMPLATE_TEST_CASE("forward_substitution: (I − M)⁻¹ U, equal to the double solve, the same bits for every blocking",
                   "[tile]", float, double) {
    using T = TestType;
    constexpr Index lanes = detail::packet_lanes<T>;
    const Index n = GENERATE(Index(0), Index(1), Index(5), Index(6), Index(7), Index(13), Index(40));
    const Index cols = GENERATE_COPY(Index(1), lanes + 1, 4 * lanes, 9 * lanes + 3);
    CAPTURE(n, cols);
    // M strictly lower with small entries (a well-conditioned I − M); garbage above.
    Matrix<T> M = T(0.2) * random_matrix<T>(n, n, 31);
    for (Index t = 0; t < n; ++t)
        M(t, t) = T(1e30);  // the diagonal and above are not read
    const Matrix<T> U = random_matrix<T>(n, cols, 32);
    const auto solve = [&]<class B>() {
        Matrix<T> X = U;
        detail::forward_substitution<T, B>(n, cols, M.data(), n, X.data(), cols);
        return X;
    };
    const Matrix<T> X = solve.template operator()<detail::DefaultBlocking>();
    Eigen::MatrixXd lower = -reference::to_double(M).template triangularView<Eigen::StrictlyLower>().toDenseMatrix();
    lower.diagonal().setOnes();
    const Eigen::MatrixXd expected = lower.template triangularView<Eigen::UnitLower>().solve(reference::to_double(U));
    check_close(X, expected, tolerance<T>());
    CHECK(X == solve.template operator()<detail::Blocking<1, 1>>());
    CHECK(X == solve.template operator()<detail::Blocking<4, 2>>());
    CHECK(X == solve.template operator()<detail::Blocking<8, 3>>());
}

TEST_CASE("PrefetchQueue: issues every line of its blocks once, and a product with it keeps its bits", "[tile]") {
    using T = float;
    detail::PrefetchQueue queue(5);
    CHECK(queue.pending() == 0);
    const Matrix<T> A = random_matrix<T>(40, 70, 41), Bm = random_matrix<T>(70, 33, 42);
    queue.add(A.data(), 3, A.cols(), 70);        // 280 bytes a row: 5 lines each
    queue.add(Bm.data(), 2, Bm.cols(), 1);       // 1 line each
    queue.add<T, true>(A.data(), 0, 70, 70);     // empty: ignored
    CHECK(queue.pending() == 3 * 5 + 2);
    Index steps = 0;
    for (; queue.pending() > 0; ++steps)
        queue.step();
    CHECK(steps == 4);  // ⌈17 / 5⌉
    queue.step();       // nothing left: a no-op
    CHECK(queue.pending() == 0);
    queue.clear();
    for (int i = 0; i < 6; ++i)  // more than four blocks: the fifth on are dropped
        queue.add(A.data(), 1, A.cols(), 16);
    CHECK(queue.pending() == 4);

    queue.clear();
    queue.add(A.data(), 40, A.cols(), 70);
    Matrix<T> with(40, 33), without(40, 33);
    detail::tile_product<T>(40, 33, 70, A.data(), 70, 1, Bm.data(), 33, with.data(), 33, nullptr, {}, &queue);
    detail::tile_product<T>(40, 33, 70, A.data(), 70, 1, Bm.data(), 33, without.data(), 33, nullptr);
    CHECK(with == without);
    CHECK(queue.pending() < 40 * 5);
}

/// The kernel with blocking B on views and the default tiles.
template <class T, class B>
Matrix<T> kernel_with_blocking(const Matrix<T>& Q, const Matrix<T>& K, const Matrix<T>& V, SoftmaxOptions options,
                               Vector<T>& lse) {
    Matrix<T> O(Q.rows(), V.cols());
    lse.resize(Q.rows());
    detail::SoftmaxScratch<T> scratch(K.cols(), V.cols(), detail::default_tiles(options.window));
    detail::causal_softmax_views<T, B>(Q, K, V, O, [&lse](Index i, T value) { lse(i) = value; }, options, scratch);
    return O;
}

TEMPLATE_TEST_CASE("causal softmax: the AVX-512 and AVX2 blockings give the same bits", "[softmax][kernel][tile]",
                   float, double) {
    using T = TestType;
    const Index n = GENERATE(Index(1), Index(45), Index(300)), d = GENERATE(Index(1), Index(24), Index(64));
    const Index window = GENERATE(Index(0), Index(37));
    const Matrix<T> Q = random_matrix<T>(n, d, 4), K = random_matrix<T>(n, d, 5), V = random_matrix<T>(n, d + 3, 6);
    const SoftmaxOptions options{.scale = 0, .window = window, .sink_tokens = 2};
    Vector<T> lse, lse_other;
    const Matrix<T> O = kernel_with_blocking<T, detail::DefaultBlocking>(Q, K, V, options, lse);
    const auto expected = reference::softmax_attention(reference::to_double(Q), reference::to_double(K),
                                                       reference::to_double(V), 0, window, 2);
    check_close(O, expected.out, tolerance<T>());
    CHECK(O == (kernel_with_blocking<T, detail::Blocking<6, 4>>(Q, K, V, options, lse_other)));
    CHECK(lse == lse_other);
    CHECK(O == (kernel_with_blocking<T, detail::Blocking<4, 2>>(Q, K, V, options, lse_other)));
    CHECK(lse == lse_other);
}

TEMPLATE_TEST_CASE("SoftmaxBlockState lanes equal SoftmaxState, masked lanes stay empty", "[softmax][state]", float,
                   double) {
    using T = TestType;
    constexpr T minus_inf = -std::numeric_limits<T>::infinity();
    const Index lanes = 11, keys = 6;  // not a multiple of any packet width
    Matrix<T> logits = random_matrix<T>(keys, lanes, 18, 5.0);
    logits.col(0).setConstant(minus_inf);  // a lane that sees nothing
    logits(2, 1) = minus_inf;              // a masked key
    Matrix<T> s = logits * T(1.44269504088896340736);  // the block state takes base-2 logits
    SoftmaxBlockState<T> block(lanes);
    block.absorb(s.data(), keys, lanes, lanes);
    for (Index i = 0; i < lanes; ++i) {
        std::vector<T> column(static_cast<std::size_t>(keys));
        for (Index j = 0; j < keys; ++j)
            column[static_cast<std::size_t>(j)] = logits(j, i);
        SoftmaxState<T> scalar;
        scalar.absorb(column.data(), keys);
        const SoftmaxState<T> lane = block.state(i);
        CAPTURE(i);
        CHECK(lane.empty() == scalar.empty());
        if (scalar.empty()) {
            CHECK(lane.max == minus_inf);
            continue;
        }
        CHECK_THAT(static_cast<double>(lane.max),
                   Catch::Matchers::WithinRel(static_cast<double>(scalar.max), tolerance<T>()));
        CHECK_THAT(static_cast<double>(lane.sum),
                   Catch::Matchers::WithinRel(static_cast<double>(scalar.sum), tolerance<T>()));
        for (Index j = 0; j < keys; ++j)
            CHECK_THAT(static_cast<double>(s(j, i)),
                       Catch::Matchers::WithinAbs(static_cast<double>(column[static_cast<std::size_t>(j)]),
                                                  tolerance<T>()));
    }
    CHECK(block.alpha()[3] == T(0));  // first keys of a lane: α = 0 (nothing to rescale)
    CHECK(block.state(0).empty());
    CHECK(block.state(0).log_sum_exp() == minus_inf);
    CHECK(s(2, 1) == T(0));
    CHECK(s.col(0).isZero());
    CHECK(s.allFinite());

    // A second tile with a larger maximum rescales: α = exp(m_old − m_new) < 1.
    Matrix<T> more = Matrix<T>::Constant(1, lanes, T(40));
    block.absorb(more.data(), 1, lanes, lanes);
    CHECK(block.alpha()[5] > T(0));
    CHECK(block.alpha()[5] < T(1e-6));
    CHECK(block.alpha()[0] == T(0));
    CHECK_THAT(static_cast<double>(block.state(0).log_sum_exp()), Catch::Matchers::WithinRel(40.0 / 1.4426950408889634, tolerance<T>()));
}

TEMPLATE_TEST_CASE("KVCache prefill equals decode equals the kernel", "[softmax][kernel][kv_cache]", float, double) {
    using T = TestType;
    const Index n = 3 * tile + 2, d = 12, dv = 7;
    const Matrix<T> Q = random_matrix<T>(n, d, 19), K = random_matrix<T>(n, d, 20), V = random_matrix<T>(n, dv, 21);
    Matrix<T> kernel(n, dv), decoded(n, dv), prefilled(n, dv);
    causal_softmax_attention(Q, K, V, kernel);
    KVCache<T> stepped(d, dv), bulk(d, dv);
    decode(stepped, Q, K, V, decoded);
    const Index cut = GENERATE_COPY(Index(0), Index(1), tile + 3, n);
    CAPTURE(cut);
    prefill(bulk, Q.topRows(cut), K.topRows(cut), V.topRows(cut), prefilled.topRows(cut));
    prefill(bulk, Q.bottomRows(n - cut), K.bottomRows(n - cut), V.bottomRows(n - cut), prefilled.bottomRows(n - cut));
    CHECK(bulk.length() == n);
    check_close(decoded, reference::to_double(kernel), tolerance<T>());
    check_close(prefilled, reference::to_double(kernel), tolerance<T>());
}

TEST_CASE("causal softmax: bad input throws naming function, argument and shapes", "[softmax][kernel]") {
    using memattn::test::HasSubstring;
    const Matrix<float> Q = random_matrix<float>(4, 3, 1), K = random_matrix<float>(5, 3, 2);
    const Matrix<float> V = random_matrix<float>(5, 2, 3);
    Matrix<float> O(4, 2);
    const Matrix<float> Qd = random_matrix<float>(4, 2, 4);
    CHECK_THROWS_WITH(causal_softmax_attention(Qd, K, V, O),
                      HasSubstring("causal_softmax_attention") && HasSubstring("'Q'") && HasSubstring("4x2") && HasSubstring("5x3"));
    CHECK_THROWS_WITH(causal_softmax_attention(Q, K, V.topRows(4), O), HasSubstring("'V'") && HasSubstring("4x2"));
    const Matrix<float> Qlong = random_matrix<float>(6, 3, 5);
    Matrix<float> Olong(6, 2);
    CHECK_THROWS_WITH(causal_softmax_attention(Qlong, K, V, Olong), HasSubstring("'Q'") && HasSubstring("6x3"));
    Matrix<float> Obad(4, 3);
    CHECK_THROWS_WITH(causal_softmax_attention(Q, K, V, Obad), HasSubstring("'O'") && HasSubstring("4x3") && HasSubstring("4x2"));
    Vector<float> lse(3);
    CHECK_THROWS_WITH(causal_softmax_attention(Q, K, V, O, lse), HasSubstring("'lse'") && HasSubstring("1x3"));
    CHECK_THROWS_WITH(causal_softmax_attention(Q, K, V, O, {.scale = 0, .window = -1}),
                      HasSubstring("'options.window'"));
    CHECK_THROWS_WITH(causal_softmax_attention(Q, K, V, O, {.scale = 0, .window = 0, .sink_tokens = -2}),
                      HasSubstring("'options.sink_tokens'"));
    CHECK_THROWS_AS(causal_softmax_attention(Q, K, V, O, {.scale = std::numeric_limits<double>::infinity()}),
                    std::invalid_argument);

    // A KVCache whose prefill is given bad shapes is unchanged.
    KVCache<float> cache(3, 2);
    extend(cache, K, V);
    CHECK_THROWS_AS(prefill(cache, Q, K.topRows(4), V.topRows(4), Obad), std::invalid_argument);
    CHECK_THROWS_AS(cache.prefill(Q, K.topRows(4), V.topRows(3), O), std::invalid_argument);
    CHECK(cache.length() == 5);
}

// ------------------------------------------------ bfloat16 and float16 inputs (§4.7c)

namespace {

/// The bound of docs/design.md §4.7c for an output of the kernel on 16-bit inputs against
/// the double reference on the same (exactly converted) inputs, per element: bfloat16
/// arithmetic rounds the weights (2⁻⁸/(1 − 2⁻⁸) of the range of the values, per column),
/// float arithmetic (float16 inputs, or bfloat16 where the target lacks AVX512-BF16) only
/// float's error; an output of 16 bits adds its own rounding.
template <class E, class Out>
void check_low_precision(const Matrix<E>& Q, const Matrix<E>& K, const Matrix<E>& V, const SoftmaxOptions& options,
                         const reference::MatrixD& expected) {
    Matrix<Out> O(Q.rows(), V.cols());
    causal_softmax_attention(Q, K, V, O, options);
    const reference::MatrixD Vd = reference::to_double(V.template cast<float>());
    const double u = std::is_same_v<E, Eigen::bfloat16> && detail::avx512_bf16_runs() ? 0x1p-8 / (1 - 0x1p-8) : 0.0;
    const double out_u = std::is_same_v<Out, float> ? 0.0 : std::is_same_v<Out, Eigen::half> ? 0x1p-11 : 0x1p-8;
    const double scale = expected.size() > 0 ? std::max(1.0, expected.cwiseAbs().maxCoeff()) : 1.0;
    for (Index c = 0; c < V.cols(); ++c) {
        const double range = V.rows() > 0 ? Vd.col(c).maxCoeff() - Vd.col(c).minCoeff() : 0.0;
        for (Index i = 0; i < Q.rows(); ++i) {
            const double e = expected(i, c), a = static_cast<double>(static_cast<float>(O(i, c)));
            CAPTURE(i, c, e, a, range);
            REQUIRE(std::abs(a - e) <= u * range + out_u * std::abs(e) + 2e-5 * scale);
        }
    }
}

template <class E>
Matrix<E> random_low(Index rows, Index cols, std::uint64_t seed, double scale = 1.0) {
    return random_matrix<float>(rows, cols, seed, scale).cast<E>();
}

}  // namespace

TEMPLATE_TEST_CASE("causal softmax on bfloat16 and float16: within the bound of the double reference, sizes around "
                   "the tiles, windows and sinks",
                   "[softmax][kernel][low_precision]", Eigen::bfloat16, Eigen::half) {
    using E = TestType;
    const Index n = GENERATE(Index(0), Index(1), Index(2), window_tile + 1, key_tile - 1, key_tile + 1, tile + 1,
                             3 * key_tile + 2);
    // Each head width and each value width against the others (not all nine pairs), and
    // sink tokens only where there is a window for them to stay outside of: the double
    // reference of every combination took 40 s per type under the sanitizers.
    const auto [d, dv] = GENERATE(table<Index, Index>({{1, 5}, {1, 64}, {3, 17}, {64, 5}, {64, 64}}));
    const auto [window, sinks] = GENERATE(table<Index, Index>({{0, 0}, {17, 0}, {17, 4}, {1001, 0}, {1001, 4}}));
    CAPTURE(n, d, dv, window, sinks);
    const Matrix<E> Q = random_low<E>(n, d, 1, 2.0), K = random_low<E>(n, d, 2, 2.0), V = random_low<E>(n, dv, 3);
    const SoftmaxOptions options{.scale = 0, .window = window, .sink_tokens = sinks};
    const auto expected = reference::softmax_attention(reference::to_double(Q.template cast<float>()),
                                                       reference::to_double(K.template cast<float>()),
                                                       reference::to_double(V.template cast<float>()), 0, window, sinks);
    check_low_precision<E, float>(Q, K, V, options, expected.out);
    check_low_precision<E, E>(Q, K, V, options, expected.out);
    // lse in float: the logits are float's dot products of the exact inputs; the sum of
    // weights rounded to bfloat16 is off by a factor within 1 ± 2⁻⁸, its log by 2⁻⁸/(1 − 2⁻⁸).
    Matrix<float> O(n, dv);
    Vector<float> lse(n);
    causal_softmax_attention(Q, K, V, O, lse, options);
    const double u = std::is_same_v<E, Eigen::bfloat16> && detail::avx512_bf16_runs() ? 0x1p-8 / (1 - 0x1p-8) : 0.0;
    for (Index i = 0; i < n; ++i) {
        const double e = expected.lse[static_cast<std::size_t>(i)];
        CAPTURE(i);
        REQUIRE_THAT(static_cast<double>(lse(i)),
                     Catch::Matchers::WithinAbs(e, u + 2e-5 * std::max(1.0, std::abs(e))));
    }
}

TEMPLATE_TEST_CASE("causal softmax on bfloat16 and float16: the logit options, non-causal, a dense bias and a mask",
                   "[softmax][kernel][low_precision]", Eigen::bfloat16, Eigen::half) {
    using E = TestType;
    const Index n = 300, d = 64, dv = 48;
    const Matrix<E> Q = random_low<E>(n, d, 4, 2.0), K = random_low<E>(n, d, 5, 2.0), V = random_low<E>(n, dv, 6, 3.0);
    const std::vector<double> slope{0.05}, sink{0.5};
    const int option = GENERATE(0, 1, 2, 3);
    CAPTURE(option);
    SoftmaxOptions options{.scale = 0.2, .window = 100, .sink_tokens = 2};
    reference::Logits logits{.scale = 0.2, .window = 100, .sink_tokens = 2};
    if (option == 0) {
        options.softcap = logits.softcap = 1.5;
    } else if (option == 1) {
        options.alibi_slopes = slope;
        logits.slope = 0.05;
        options.sink_logits = sink;
        logits.sink = 0.5;
    } else if (option == 2) {
        options.causal = logits.causal = false;
    }
    const reference::MatrixD Qd = reference::to_double(Q.template cast<float>()),
                             Kd = reference::to_double(K.template cast<float>()),
                             Vd = reference::to_double(V.template cast<float>());
    if (option < 3) {
        check_low_precision<E, float>(Q, K, V, options, reference::softmax_attention(Qd, Kd, Vd, logits).out);
        return;
    }
    // option 3: an additive float bias and a bool mask (a third of the pairs hidden)
    const Matrix<float> bias = random_matrix<float>(n, n, 7);
    Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> mask(n, n);
    reference::MatrixD masked(n, n);
    for (Index i = 0; i < n; ++i)
        for (Index j = 0; j < n; ++j) {
            mask(i, j) = (i * 7 + j * 3) % 3 != 0;
            masked(i, j) = mask(i, j) ? 0.0 : -std::numeric_limits<double>::infinity();
        }
    const reference::MatrixD bias_d = bias.cast<double>();
    Matrix<float> O(n, dv);
    causal_softmax_attention(Q, K, V, O, options, bias);
    logits.bias = &bias_d;
    const reference::MatrixD with_bias = reference::softmax_attention(Qd, Kd, Vd, logits).out;
    const double u = std::is_same_v<E, Eigen::bfloat16> && detail::avx512_bf16_runs() ? 0x1p-8 / (1 - 0x1p-8) : 0.0;
    const double range = Vd.maxCoeff() - Vd.minCoeff();
    REQUIRE((O.cast<double>() - with_bias).cwiseAbs().maxCoeff() <= u * range + 1e-4);
    causal_softmax_attention(Q, K, V, O, options, mask);
    logits.bias = &masked;
    const reference::MatrixD with_mask = reference::softmax_attention(Qd, Kd, Vd, logits).out;
    REQUIRE((O.cast<double>() - with_mask).cwiseAbs().maxCoeff() <= u * range + 1e-4);
}

TEST_CASE("causal softmax on bfloat16: the output stays a convex combination (equal values come back)",
          "[softmax][kernel][low_precision]") {
    // The denominator sums the weights as P·V multiplies them (rounded to bfloat16): with
    // every value row equal, the output is that row to float's rounding, not to 2⁻⁸.
    const Index n = 777, d = 128, dv = 40;
    const Matrix<Eigen::bfloat16> Q = random_low<Eigen::bfloat16>(n, d, 8, 3.0),
                                  K = random_low<Eigen::bfloat16>(n, d, 9, 3.0);
    const Vector<float> row = random_matrix<float>(1, dv, 10, 5.0);
    const Matrix<Eigen::bfloat16> V = row.cast<Eigen::bfloat16>().replicate(n, 1);
    const Vector<float> exact = row.cast<Eigen::bfloat16>().cast<float>();
    Matrix<float> O(n, dv);
    causal_softmax_attention(Q, K, V, O, {.scale = 0, .window = GENERATE(Index(0), Index(300))});
    for (Index i = 0; i < n; ++i) {
        CAPTURE(i);
        REQUIRE((O.row(i) - exact).cwiseAbs().maxCoeff() <= 1e-5 * exact.cwiseAbs().maxCoeff());
    }
}

TEST_CASE("causal softmax on bfloat16: a long sequence against the float kernel on the same inputs, d = 128",
          "[softmax][kernel][low_precision]") {
    const Index n = 1200, d = 128;
    const Matrix<Eigen::bfloat16> Q = random_low<Eigen::bfloat16>(n, d, 11, 2.0),
                                  K = random_low<Eigen::bfloat16>(n, d, 12, 2.0),
                                  V = random_low<Eigen::bfloat16>(n, d, 13);
    const Matrix<float> Qf = Q.cast<float>(), Kf = K.cast<float>(), Vf = V.cast<float>();
    const SoftmaxOptions options{.scale = 0, .window = GENERATE(Index(0), Index(512)), .sink_tokens = 3};
    Matrix<float> twin(n, d), O(n, d);
    causal_softmax_attention(Qf, Kf, Vf, twin, options);
    causal_softmax_attention(Q, K, V, O, options);
    const double u = detail::avx512_bf16_runs() ? 0x1p-8 / (1 - 0x1p-8) : 0.0;
    const double range = static_cast<double>(Vf.maxCoeff() - Vf.minCoeff());
    REQUIRE((O - twin).cwiseAbs().maxCoeff() <= u * range + 1e-5);
    // Measured, not bounded: the weights' rounding errors average out over many keys.
    const double rms = std::sqrt((O - twin).squaredNorm() / static_cast<double>(O.size()));
    CHECK(rms <= 0.05 * u * range + 1e-6);
}

TEST_CASE("causal softmax on bfloat16: a non-finite value poisons only the queries that see it",
          "[softmax][kernel][low_precision]") {
    const Index n = 150, bad = GENERATE(Index(1), Index(70));
    const float poison = GENERATE(std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity());
    const SoftmaxOptions options{.scale = 0, .window = GENERATE(Index(0), Index(9)), .sink_tokens = GENERATE(0, 2)};
    CAPTURE(bad, poison, options.window, options.sink_tokens);
    const Matrix<Eigen::bfloat16> Q = random_low<Eigen::bfloat16>(n, 4, 22), K = random_low<Eigen::bfloat16>(n, 4, 23);
    Matrix<Eigen::bfloat16> V = random_low<Eigen::bfloat16>(n, 3, 24);
    const Matrix<Eigen::bfloat16> clean = V;
    V(bad, 1) = Eigen::bfloat16(poison);
    Matrix<float> O(n, 3), O_clean(n, 3);
    causal_softmax_attention(Q, K, V, O, options);
    causal_softmax_attention(Q, K, clean, O_clean, options);
    for (Index i = 0; i < n; ++i) {
        CAPTURE(i);
        const bool sees = reference::visible(bad, i, options.window, options.sink_tokens);
        CHECK(O.row(i).allFinite() == !sees);
        // A query that does not see it keeps its output: where its tile took the careful
        // path (the tile's values in float against the same weights: where the products
        // kept the weights packed, unpacked first), within float's rounding of the sums.
        if (!sees)
            CHECK((O.row(i) - O_clean.row(i)).cwiseAbs().maxCoeff() <= 1e-5f);
    }
}

#if defined(MEMATTN_BF16_DOT)
TEST_CASE("bf16_product: every leftover of rows, packets, lanes and depth, banded, against the double product",
          "[softmax][tile][low_precision]") {
    // A (rows × depth) in place with row stride depth (an odd depth's last term is read
    // alone), B packed in pairs; C = α ⊙ C + A·B and C = post·A·B. The products of two
    // bfloat16 are exact in float, so the double product bounds the float sums' rounding.
    const Index rows = GENERATE(Index(1), Index(5), Index(6), Index(13)), depth = GENERATE(Index(1), Index(2), Index(7), Index(64));
    const Index cols = GENERATE(Index(1), Index(15), Index(16), Index(47), Index(64), Index(100));
    CAPTURE(rows, depth, cols);
    const Matrix<Eigen::bfloat16> A = random_low<Eigen::bfloat16>(rows, depth, 30),
                                  Bm = random_low<Eigen::bfloat16>(depth, cols, 31);
    const Index ldb = detail::round_up(cols, 16);
    std::vector<std::uint32_t> packed(static_cast<std::size_t>((depth + 1) / 2 * ldb));
    REQUIRE(detail::pack_row_pairs(reinterpret_cast<const std::uint16_t*>(Bm.data()), depth, cols, cols, packed.data(),
                                   ldb, detail::bf16_dot));
    const reference::MatrixD exact = A.cast<double>() * Bm.cast<double>();
    const reference::MatrixD magnitude = A.cast<double>().cwiseAbs() * Bm.cast<double>().cwiseAbs();
    const Matrix<float> C0 = random_matrix<float>(rows, cols, 32);
    std::vector<float> alpha(static_cast<std::size_t>(rows));
    for (Index r = 0; r < rows; ++r)
        alpha[static_cast<std::size_t>(r)] = 0.5f + 0.125f * static_cast<float>(r % 4);
    Matrix<float> scaled = C0, plain = C0;
    const auto* a = reinterpret_cast<const std::uint16_t*>(A.data());
    detail::bf16_product(rows, cols, depth, a, depth, 2, packed.data(), ldb, scaled.data(), cols, alpha.data(), 1.0f);
    detail::bf16_product(rows, cols, depth, a, depth, 2, packed.data(), ldb, plain.data(), cols, nullptr, 0.25f);
    for (Index r = 0; r < rows; ++r)
        for (Index c = 0; c < cols; ++c) {
            CAPTURE(r, c);
            const double tol = 1e-6 * (magnitude(r, c) + std::abs(C0(r, c))) + 1e-30;
            REQUIRE(std::abs(scaled(r, c) - (alpha[static_cast<std::size_t>(r)] * C0(r, c) + exact(r, c))) <= tol);
            REQUIRE(std::abs(plain(r, c) - 0.25 * exact(r, c)) <= tol);
        }
    // A band: a strip computes its hull of columns, rounded out to whole packets, over the
    // pairs holding its hull of terms (A is zero outside a row's terms), and leaves every
    // other column as it was.
    const TestBand band{depth, cols, 16};
    Matrix<Eigen::bfloat16> Ab = A;
    for (Index r = 0; r < rows; ++r)
        for (Index k = 0; k < depth; ++k)
            if (k < band.terms_of(r).first || k >= band.terms_of(r).end)
                Ab(r, k) = Eigen::bfloat16(0.0f);
    const reference::MatrixD exact_band = Ab.cast<double>() * Bm.cast<double>();
    Matrix<float> banded = C0;
    detail::bf16_product(rows, cols, depth, reinterpret_cast<const std::uint16_t*>(Ab.data()), depth, 2,
                         packed.data(), ldb, banded.data(), cols, nullptr, 1.0f, band);
    constexpr Index strip = detail::DefaultBlocking::rows;
    for (Index r = 0; r < rows; ++r) {
        const Index s0 = r / strip * strip, s1 = std::min(s0 + strip, rows);
        const detail::Range written = band.columns(s0, s1 - s0, cols);
        for (Index c = 0; c < cols; ++c) {
            CAPTURE(r, c);
            if (c >= written.first / 16 * 16 && c < detail::round_up(written.end, 16))
                REQUIRE(std::abs(banded(r, c) - exact_band(r, c)) <= 1e-6 * magnitude(r, c) + 1e-30);
            else
                REQUIRE(banded(r, c) == C0(r, c));
        }
    }
}
#endif

namespace {

/// bfloat16 rows that never take the bfloat16 products: the kernel on them is the float
/// path the vdpbf16ps path replaces (tiles converted to float), on any CPU.
using ConvertedOnly = detail::ConvertedRows<Eigen::bfloat16, false>;

}  // namespace

TEST_CASE("causal softmax on bfloat16: the bfloat16 products against the converted float path they replace",
          "[softmax][kernel][low_precision]") {
    // Both through the same kernel and the same inputs; with AVX512-BF16 the first takes
    // vdpbf16ps, the second converts each tile to float. They agree within the bound of
    // §4.7c (the weights' rounding), the lse within 2⁻⁸/(1 − 2⁻⁸).
    const Index n = GENERATE(Index(1), key_tile + 3, 2 * tile + 5), d = GENERATE(Index(7), Index(64));
    const Index window = GENERATE(Index(0), Index(50));
    CAPTURE(n, d, window);
    const Matrix<Eigen::bfloat16> Q = random_low<Eigen::bfloat16>(n, d, 40, 2.0),
                                  K = random_low<Eigen::bfloat16>(n, d, 41, 2.0),
                                  V = random_low<Eigen::bfloat16>(n, 33, 42);
    const SoftmaxOptions options{.scale = 0, .window = window, .sink_tokens = 2};
    const detail::SoftmaxTiles tiles = detail::default_tiles(detail::effective_window(window, n));
    Matrix<float> fast(n, 33), plain(n, 33);
    Vector<float> fast_lse(n), plain_lse(n);
    {
        detail::SoftmaxScratch<float> scratch(d, 33, tiles);
        detail::causal_softmax_converted<Eigen::bfloat16, float>(
            Q, K, V, fast, [&](Index i, float x) { fast_lse(i) = x; }, options, scratch, detail::trailing_queries, {});
    }
    {
        detail::SoftmaxScratch<float> scratch(d, 33, tiles);
        detail::causal_softmax_rows<float>(
            ConvertedOnly(Q, tiles.queries, scratch.converted_q), ConvertedOnly(K, tiles.keys, scratch.converted_k),
            ConvertedOnly(V, tiles.keys, scratch.converted_v), MatrixRef<float>(plain),
            [&](Index i, float x) { plain_lse(i) = x; }, options, scratch, detail::trailing_queries,
            detail::TileBias<float>{});
    }
    const double u = detail::avx512_bf16_runs() ? 0x1p-8 / (1 - 0x1p-8) : 0.0;
    const Matrix<float> Vf = V.cast<float>();
    const double range = static_cast<double>(Vf.maxCoeff() - Vf.minCoeff());
    CHECK((fast - plain).cwiseAbs().maxCoeff() <= u * range + 1e-5);
    CHECK((fast_lse - plain_lse).cwiseAbs().maxCoeff() <= u + 1e-5);
    if (!detail::avx512_bf16_runs()) {  // the same path: the same bits (the other: isa_regions_test)
        CHECK((fast.array() == plain.array()).all());
    }
}

namespace {

/// Rows in place, as PlainRows, that record each key tile the kernel reads: (j0, n).
struct RecordingRows : detail::PlainRows<float> {
    RecordingRows(const ConstMatrixRef<float>& m, std::vector<std::pair<Index, Index>>& tiles)
        : detail::PlainRows<float>(m), read(&tiles) {}
    [[nodiscard]] std::pair<const float*, Index> tile(Index j0, Index n) const {
        read->emplace_back(j0, n);
        return detail::PlainRows<float>::tile(j0, n);
    }
    std::vector<std::pair<Index, Index>>* read;
};

}  // namespace

TEST_CASE("causal softmax: where the walk reaches key 0, each key tile lies within one aligned run of the tile's "
          "length (a pool's block), and the tiles cover each query tile's keys once",
          "[softmax][kernel]") {
    // Keys n ≥ queries (a chunk after a past); a window of 50 (its edge: tiles end at the
    // diagonal, no alignment asked) checks only the coverage. The outputs are the plain
    // call's bit for bit: recording changes nothing.
    const Index past = GENERATE(Index(0), Index(1), Index(64), Index(127), Index(200));
    const Index rows = GENERATE(Index(1), Index(5), Index(130), Index(260));
    const Index window = GENERATE(Index(0), Index(50));
    const Index n = past + rows, d = 8;
    CAPTURE(past, rows, window);
    const Matrix<float> Q = random_matrix<float>(rows, d, 61), K = random_matrix<float>(n, d, 62),
                        V = random_matrix<float>(n, d, 63);
    const detail::SoftmaxTiles tiles = detail::default_tiles(detail::effective_window(window, n));
    const SoftmaxOptions options{.window = window};
    std::vector<std::pair<Index, Index>> read;
    Matrix<float> recorded(rows, d), plain(rows, d);
    {
        detail::SoftmaxScratch<float> scratch(d, d, tiles);
        detail::causal_softmax_rows<float>(detail::PlainRows<float>(Q), RecordingRows(K, read),
                                           detail::PlainRows<float>(V), MatrixRef<float>(recorded), [](Index, float) {},
                                           options, scratch, detail::trailing_queries, detail::TileBias<float>{});
    }
    {
        detail::SoftmaxScratch<float> scratch(d, d, tiles);
        detail::causal_softmax_views<float>(Q, K, V, plain, [](Index, float) {}, options, scratch);
    }
    CHECK((recorded.array() == plain.array()).all());
    REQUIRE(!read.empty());
    // Per query tile, the tiles walk down from its last key without gap or overlap.
    Index walked = 0, query_tiles = 0, expected_end = -1;
    for (const auto& [j0, m] : read) {
        REQUIRE(m >= 1);
        REQUIRE(m <= tiles.keys);
        if (expected_end < 0 || j0 + m != expected_end)  // a new query tile's diagonal tile
            ++query_tiles;
        expected_end = j0;
        walked += m;
        if (window == 0 || n <= window) {
            INFO("tile [" << j0 << ", " << j0 + m << ")");
            CHECK(j0 / tiles.keys == (j0 + m - 1) / tiles.keys);
        }
    }
    CHECK(query_tiles == (rows + tiles.queries - 1) / tiles.queries);
    if (window == 0) {  // every query tile's keys: [0, its last position]
        Index keys = 0;
        for (Index i0 = 0; i0 < rows; i0 += tiles.queries)
            keys += past + std::min(rows, i0 + tiles.queries);
        CHECK(walked == keys);
    }
}
