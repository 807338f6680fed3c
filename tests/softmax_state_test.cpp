#include "support.hpp"

#include <memattn/softmax_state.hpp>

#include <vector>

using namespace memattn;
using memattn::test::check_close;
using memattn::test::random_matrix;
using memattn::test::tolerance;

namespace {

// One query against keys [begin, end) of K/V through SoftmaxState::absorb.
template <class T>
SoftmaxState<T> partial(const Vector<T>& q, const Matrix<T>& K, const Matrix<T>& V, Index begin, Index end,
                        Vector<T>& acc) {
    SoftmaxState<T> state;
    acc.setZero(V.cols());
    detail::attend_contiguous(q, K.middleRows(begin, end - begin), V.middleRows(begin, end - begin), T(0.5), state,
                              acc);
    return state;
}

}  // namespace

TEMPLATE_TEST_CASE("SoftmaxState: partials over disjoint keys merge to the whole", "[softmax][state]", float,
                   double) {
    using T = TestType;
    const Index n = GENERATE(1, 2, 255, 256, 257, 700);
    const Matrix<T> K = random_matrix<T>(n, 5, 1), V = random_matrix<T>(n, 3, 2);
    const Vector<T> q = random_matrix<T>(1, 5, 3).row(0);
    const auto expected = reference::softmax_attention(reference::to_double(q), reference::to_double(K),
                                                       reference::to_double(V), 0.5, 0, n);  // sinks: all visible
    const Index cut = GENERATE_COPY(Index(0), n / 3, n);
    Vector<T> a, b;
    SoftmaxState<T> sa = partial(q, K, V, 0, cut, a);
    const SoftmaxState<T> sb = partial(q, K, V, cut, n, b);
    sa.merge(sb, a, b);
    REQUIRE_THAT(static_cast<double>(sa.log_sum_exp()),
                 Catch::Matchers::WithinRel(expected.lse[0], 10 * tolerance<T>()));
    sa.finish(a);
    check_close(a, expected.out, tolerance<T>());
}

TEMPLATE_TEST_CASE("SoftmaxState: empty states and fully masked blocks stay finite", "[softmax][state]", float,
                   double) {
    using T = TestType;
    SoftmaxState<T> state;
    CHECK(state.empty());
    std::vector<T> masked(4, -std::numeric_limits<T>::infinity());
    CHECK(state.absorb(masked.data(), 4) == T(1));
    CHECK(state.empty());
    CHECK(masked == std::vector<T>(4, T(0)));
    Vector<T> acc = Vector<T>::Zero(2);
    state.finish(acc);
    CHECK(acc.isZero());
    CHECK(state.log_sum_exp() == -std::numeric_limits<T>::infinity());

    // A NaN logit poisons the state, even beside masked ones: not empty, NaN output.
    SoftmaxState<T> poisoned;
    std::vector<T> with_nan{-std::numeric_limits<T>::infinity(), std::numeric_limits<T>::quiet_NaN()};
    poisoned.absorb(with_nan.data(), 2);
    CHECK_FALSE(poisoned.empty());
    Vector<T> poisoned_acc = Vector<T>::Ones(2);
    poisoned.finish(poisoned_acc);
    CHECK(poisoned_acc.array().isNaN().all());
    CHECK(std::isnan(poisoned.log_sum_exp()));

    // Huge logits: exp is taken relative to the running maximum.
    std::vector<T> big{T(1e4), T(-1e4), T(1e4) - 1};
    state.absorb(big.data(), 3);
    CHECK(std::isfinite(state.sum));
    CHECK_THAT(static_cast<double>(state.log_sum_exp()),
               Catch::Matchers::WithinRel(1e4 + std::log1p(std::exp(-1.0)), 1e-6));
}
