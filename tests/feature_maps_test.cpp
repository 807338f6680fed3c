#include "support.hpp"

#include <memattn/feature_maps.hpp>

#include <cmath>
#include <limits>
#include <vector>

using namespace memattn;
using memattn::test::random_matrix;
using reference::MatrixD;
using memattn::test::HasSubstring;
using memattn::test::SquarePlusOne;

namespace {

// Only for float: a map may support one scalar.
struct FloatOnly {
    Index output_dim(Index d) const { return d; }
    void operator()(ConstMatrixRef<float> X, MatrixRef<float> Y) const { Y = X; }
};

struct NoOutputDim {
    void operator()(ConstMatrixRef<float> X, MatrixRef<float> Y) const { Y = X; }
};

static_assert(FeatureMap<Identity, float> && FeatureMap<Identity, double>);
static_assert(FeatureMap<EluPlusOne, float> && FeatureMap<EluPlusOne, double>);
static_assert(FeatureMap<Relu, float> && FeatureMap<Relu, double>);
static_assert(FeatureMap<Taylor2, float> && FeatureMap<Taylor2, double>);
static_assert(FeatureMap<FavorPlus, float> && FeatureMap<FavorPlus, double>);
static_assert(FeatureMap<SquarePlusOne, float> && FeatureMap<SquarePlusOne, double>);
static_assert(FeatureMap<FloatOnly, float> && !FeatureMap<FloatOnly, double>);
static_assert(!FeatureMap<NoOutputDim, float>);
static_assert(!FeatureMap<int, float>);
static_assert(!FeatureMap<EluPlusOne, int>);

template <class T, class Phi>
Matrix<T> apply(const Phi& phi, const Matrix<T>& X) {
    Matrix<T> Y(X.rows(), phi.output_dim(X.cols()));
    phi(ConstMatrixRef<T>(X), MatrixRef<T>(Y));
    return Y;
}

}  // namespace

TEMPLATE_TEST_CASE("Elementwise maps: Identity, EluPlusOne, Relu", "[linear][feature_maps]", float, double) {
    using T = TestType;
    Matrix<T> X = random_matrix<T>(7, 5, 1, 3.0);
    X(0, 0) = T(0);
    X(0, 1) = T(200);   // exp would overflow; elu+1 must not
    X(0, 2) = T(-200);  // exp underflows to 0
    const Matrix<T> identity = apply(Identity{}, X), elu = apply(EluPlusOne{}, X), relu = apply(Relu{}, X);
    CHECK(identity == X);
    for (Index i = 0; i < X.rows(); ++i)
        for (Index j = 0; j < X.cols(); ++j) {
            const double x = static_cast<double>(X(i, j));
            const double expected = x > 0 ? x + 1 : std::exp(x);  // e^-200 is 0 in float
            CHECK_THAT(static_cast<double>(elu(i, j)), Catch::Matchers::WithinAbs(expected, 1e-6 * expected + 1e-30));
            CHECK(relu(i, j) == std::max(X(i, j), T(0)));
        }
    CHECK(elu.allFinite());
    CHECK((elu.array() >= T(0)).all());
    CHECK(elu(0, 0) == T(1));
}

TEMPLATE_TEST_CASE("Taylor2: phi(q).phi(k) = 1 + q.k + (q.k)^2/2", "[linear][feature_maps]", float, double) {
    using T = TestType;
    const Index d = GENERATE(1, 2, 5, 16);
    const Taylor2 phi;
    CHECK(phi.output_dim(d) == 1 + d + d * (d + 1) / 2);
    const Matrix<T> Q = random_matrix<T>(9, d, 3, 2.0), K = random_matrix<T>(9, d, 4, 2.0);
    const Matrix<T> Qf = apply(phi, Q), Kf = apply(phi, K);
    for (Index i = 0; i < Q.rows(); ++i)
        for (Index j = 0; j < K.rows(); ++j) {
            const double s = Q.row(i).template cast<double>().dot(K.row(j).template cast<double>());
            const double expected = 1 + s + s * s / 2;
            CHECK_THAT(static_cast<double>(Qf.row(i).dot(Kf.row(j))),
                       Catch::Matchers::WithinAbs(expected, 50 * test::tolerance<T>() * (1 + std::abs(expected))));
            CHECK(expected > 0);
        }
}

TEST_CASE("A user's feature map is a small struct", "[linear][feature_maps]") {
    const Matrix<float> X = random_matrix<float>(3, 4, 5);
    const Matrix<float> Y = apply(SquarePlusOne{}, X);
    CHECK(Y.cols() == 5);
    CHECK(Y.leftCols(4) == Matrix<float>(X.array().square()));
    CHECK(Y.col(4).isOnes());
}

TEST_CASE("Maps check the output shape", "[linear][feature_maps]") {
    const Matrix<double> X = random_matrix<double>(3, 4, 5);
    Matrix<double> Y(3, 5);
    REQUIRE_THROWS_WITH(EluPlusOne{}(X, Y), HasSubstring("EluPlusOne") &&
                                                HasSubstring("'Y'") && HasSubstring("3x5") &&
                                                HasSubstring("3x4"));
    REQUIRE_THROWS_WITH(Taylor2{}(X, Y), HasSubstring("3x15"));
    const FavorPlus favor(4, 8, 1);
    REQUIRE_THROWS_WITH(favor.output_dim(5), HasSubstring("FavorPlus") && HasSubstring("'d'"));
    Matrix<double> Z(3, 8);
    REQUIRE_THROWS_AS(favor(random_matrix<double>(3, 5, 1), Z), std::invalid_argument);
    REQUIRE_THROWS_AS(FavorPlus(0, 8, 1), std::invalid_argument);
    REQUIRE_THROWS_AS(FavorPlus(4, 0, 1), std::invalid_argument);
}

TEST_CASE("FavorPlus: seeded, reproducible, orthogonal blocks", "[linear][feature_maps][favor]") {
    const Index d = 6, m = 15;  // two full blocks and a partial one
    const FavorPlus a(d, m, 42), b(d, m, 42), c(d, m, 43);
    CHECK(a.output_dim(d) == m);
    CHECK(a.projection() == b.projection());
    CHECK(a.projection() != c.projection());
    const MatrixD& w = a.projection();
    for (Index block = 0; block < m; block += d)
        for (Index i = block; i < std::min(block + d, m); ++i)
            for (Index j = block; j < i; ++j)
                CHECK_THAT(w.row(i).dot(w.row(j)), Catch::Matchers::WithinAbs(0.0, 1e-12 * w.row(i).norm() * w.row(j).norm()));
    // Every platform draws the same directions: mt19937_64 and a written-out Box-Muller.
    // (Golden values from this implementation; the C library's log/cos/sin may move the
    // last bits only.)
    CHECK_THAT(w(0, 0), Catch::Matchers::WithinRel(-0.8044266149029663, 1e-12));
    CHECK_THAT(w(14, 5), Catch::Matchers::WithinRel(0.024352091292515223, 1e-12));
    // Features are the formula, in float and double alike.
    const Matrix<double> X = random_matrix<double>(4, d, 7);
    const Matrix<double> Y = apply(a, X);
    const Matrix<float> Yf = apply(a, Matrix<float>(X.cast<float>()));
    for (Index r = 0; r < X.rows(); ++r)
        for (Index i = 0; i < m; ++i) {
            const double x_scale = std::pow(static_cast<double>(d), -0.25);
            const double e = w.row(i).dot(X.row(r)) * x_scale - 0.5 * X.row(r).squaredNorm() * x_scale * x_scale;
            const double expected = std::exp(e) / std::sqrt(static_cast<double>(m));
            CHECK_THAT(Y(r, i), Catch::Matchers::WithinRel(expected, 1e-12));
            CHECK_THAT(static_cast<double>(Yf(r, i)), Catch::Matchers::WithinRel(expected, 1e-5));
        }
}

TEST_CASE("FavorPlus: the max-shift keeps huge inputs finite", "[linear][feature_maps][favor]") {
    const FavorPlus phi(8, 32, 3);
    for (const double scale : {1e2, 1e4, 1e30}) {
        const Matrix<double> X = random_matrix<double>(5, 8, 9, scale);
        const Matrix<float> Yf = apply(phi, Matrix<float>(X.cast<float>()));
        const Matrix<double> Y = apply(phi, X);
        CAPTURE(scale);
        CHECK(Yf.allFinite());
        CHECK(Y.allFinite());
        CHECK((Yf.array() >= 0).all());
        // At most e^L / sqrt(m), L = log(max T)/4.
        CHECK(Yf.maxCoeff() <= std::exp(std::log(std::numeric_limits<float>::max()) / 4) / std::sqrt(32.f) * 1.001f);
    }
}

TEST_CASE("FavorPlus: the estimate of exp(q.k/sqrt d) improves as m grows", "[linear][feature_maps][favor]") {
    // Relative RMS error of φ(q)·φ(k) against exp(q·k/√d) over fixed pairs and seeds. The
    // estimator's variance falls like 1/m, so each 4× in m should about halve the error.
    const Index d = 16, pairs = 64;
    const Matrix<double> Q = random_matrix<double>(pairs, d, 101, 0.8), K = random_matrix<double>(pairs, d, 102, 0.8);
    std::vector<double> errors;
    for (const Index m : {16, 64, 256, 1024}) {
        double squared = 0;
        for (std::uint64_t seed = 1; seed <= 4; ++seed) {
            const FavorPlus phi(d, m, seed);
            const Matrix<double> Qf = apply(phi, Q), Kf = apply(phi, K);
            for (Index i = 0; i < pairs; ++i) {
                const double exact = std::exp(Q.row(i).dot(K.row(i)) / std::sqrt(static_cast<double>(d)));
                const double relative = (Qf.row(i).dot(Kf.row(i)) - exact) / exact;
                squared += relative * relative;
            }
        }
        errors.push_back(std::sqrt(squared / (4.0 * pairs)));
    }
    CAPTURE(errors);
    for (std::size_t i = 1; i < errors.size(); ++i)
        CHECK(errors[i] < 0.75 * errors[i - 1]);
    CHECK(errors.back() < 0.3 * errors.front());
    CHECK(errors.back() < 0.1);
}
