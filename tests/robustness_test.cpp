// Robustness: what non-finite inputs do to each kernel and memory (the policy the
// README and the headers state), long sequences in float against double, and bitwise
// reproducibility. Concurrent attends: thread_test.cpp.
#include "support.hpp"

#include <memattn/memattn.hpp>

#include <limits>
#include <vector>

using namespace memattn;
using memattn::test::expect_poisoned_exactly;
using memattn::test::finite_rows;
using memattn::test::random_matrix;

namespace {

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();

/// Decodes n tokens with one non-finite key and value at `bad`; returns which output rows are finite.
template <class Mem>
std::vector<bool> decode_with_bad_token(Mem mem, Index n, Index bad, float poison = nan_f) {
    Matrix<float> Q = random_matrix<float>(n, 4, 1), K = random_matrix<float>(n, 4, 2), V = random_matrix<float>(n, 3, 3);
    K(bad, 1) = poison;
    V(bad, 2) = poison;
    Matrix<float> O(n, 3);
    decode(mem, Q, K, V, O);
    return finite_rows(O);
}

}  // namespace

TEST_CASE("Non-finite inputs: the softmax kernel poisons exactly the queries that see the token",
          "[robustness][nonfinite][softmax]") {
    const Index n = 150, bad = 70;  // crosses tiles; the bad key sits inside a tile
    Matrix<float> Q = random_matrix<float>(n, 4, 1), K = random_matrix<float>(n, 4, 2), V = random_matrix<float>(n, 3, 3);
    // NaN in a key or value, or ±∞ in a value. (An infinite key gives logits of ±∞ by
    // the query's sign: −∞ is weight 0, as a masked key, and +∞ poisons the row.)
    const int kind = GENERATE(0, 1, 2, 3);
    const bool in_key = kind == 0;
    const float poison = kind <= 1 ? nan_f : (kind == 2 ? 1.f : -1.f) * std::numeric_limits<float>::infinity();
    (in_key ? K : V)(bad, 1) = poison;
    const Index window = GENERATE(Index(0), Index(9));
    Matrix<float> O(n, 3);
    causal_softmax_attention(Q, K, V, O, SoftmaxOptions{0, window, 0});
    INFO("poison " << poison << (in_key ? " in a key" : " in a value") << ", window " << window);
    expect_poisoned_exactly(finite_rows(O), bad, window == 0 ? n - 1 : bad + window - 1);

    // A non-finite query poisons its own row only.
    Matrix<float> Q2 = random_matrix<float>(n, 4, 1), K2 = random_matrix<float>(n, 4, 2);
    Q2(bad, 0) = poison;
    causal_softmax_attention(Q2, K2, random_matrix<float>(n, 3, 3), O, SoftmaxOptions{0, window, 0});
    expect_poisoned_exactly(finite_rows(O), bad, bad);
}

TEST_CASE("Non-finite inputs: each memory's recovery", "[robustness][nonfinite][memory]") {
    const Index n = 60, bad = 10;
    // Exact caches keep the token: poisoned until reset.
    expect_poisoned_exactly(decode_with_bad_token(KVCache<float>(4, 3), n, bad), bad, n - 1);
    // A sliding window forgets it once it leaves the window (unless it is a sink).
    expect_poisoned_exactly(decode_with_bad_token(SlidingWindowCache<float>(4, 3, 5), n, bad), bad, bad + 4);
    expect_poisoned_exactly(decode_with_bad_token(SlidingWindowCache<float>(4, 3, 5, 2), n, 1), 1, n - 1);
    // A windowed mean: finite again by the first exact re-sum after it leaves (at most 2·window − 1 tokens on).
    const auto mean = decode_with_bad_token(MovingAverageCache<float>(4, 3, 5), n, bad);
    CHECK_FALSE(mean[bad]);
    for (Index i = bad + 2 * 5 - 1; i < n; ++i)
        CHECK(mean[static_cast<std::size_t>(i)]);
    // Cumulative means, exponential averages with alpha < 1 and linear attention states keep it: until reset.
    expect_poisoned_exactly(decode_with_bad_token(MovingAverageCache<float>(4, 3, 0), n, bad), bad, n - 1);
    expect_poisoned_exactly(decode_with_bad_token(MovingAverageCache<float>::exponential(4, 3, 0.5f), n, bad), bad,
                            n - 1);
    expect_poisoned_exactly(decode_with_bad_token(LinearAttentionMemory<float>(4, 3), n, bad), bad, n - 1);
    // A hybrid cache: until the compressed slot that absorbed it is dropped, window + rate·slots tokens on
    // (at most; the slot is dropped when the slot `slots` places newer opens).
    const Index window = 4, rate = 3, slots = 2;
    const auto hybrid = decode_with_bad_token(HybridCache<float>(4, 3, window, rate, slots), n, bad);
    CHECK_FALSE(hybrid[bad]);
    CHECK_FALSE(hybrid[bad + window]);  // just evicted into a slot
    for (Index i = bad + window + rate * (slots + 1); i < n; ++i)
        CHECK(hybrid[static_cast<std::size_t>(i)]);

    // reset() clears every memory.
    LinearAttentionMemory<float> linear(4, 3);
    Matrix<float> K = Matrix<float>::Constant(1, 4, nan_f), V = Matrix<float>::Ones(1, 3);
    extend(linear, K, V);
    Vector<float> out(3);
    linear.attend(Vector<float>::Ones(4), out);
    CHECK_FALSE(out.allFinite());
    linear.reset();
    linear.update(Vector<float>::Ones(4), Vector<float>::Ones(3));
    linear.attend(Vector<float>::Ones(4), out);
    CHECK(out.allFinite());
}

TEST_CASE("Long sequences: 10^6 tokens of normalized elu+1 linear attention in float stay within 1e-3 of double",
          "[robustness][long][linear]") {
    const Index n = memattn::test::memory_only ? 3 * 4096 + 5 : 1000000, d = 4, dv = 4, block = 4096;
    LinearAttentionMemory<float> memory(d, dv);
    LinearState<float> state_f;
    LinearState<double> state_d;
    double worst_memory = 0, worst_chunked = 0;
    Matrix<float> O(block, dv), O_chunked(block, dv);
    Matrix<double> O_ref(block, dv);
    for (Index start = 0; start < n; start += block) {
        const auto seed = static_cast<std::uint64_t>(start);
        const Matrix<float> Q = random_matrix<float>(block, d, seed + 1), K = random_matrix<float>(block, d, seed + 2),
                            V = random_matrix<float>(block, dv, seed + 3);
        chunked_linear_attention(Q.cast<double>(), K.cast<double>(), V.cast<double>(), O_ref, EluPlusOne{},
                                 LinearOptions{}, &state_d);
        chunked_linear_attention(Q, K, V, O_chunked, EluPlusOne{}, LinearOptions{}, &state_f);
        if (start % (16 * block) == 0)
            decode(memory, Q, K, V, O);  // token by token, on every 16th block
        else
            prefill(memory, Q, K, V, O);
        const double magnitude = std::max(1.0, O_ref.cwiseAbs().maxCoeff());
        worst_memory = std::max(worst_memory, (O.cast<double>() - O_ref).cwiseAbs().maxCoeff() / magnitude);
        worst_chunked = std::max(worst_chunked, (O_chunked.cast<double>() - O_ref).cwiseAbs().maxCoeff() / magnitude);
    }
    CAPTURE(worst_memory, worst_chunked);
    CHECK(state_f.nu.allFinite());
    CHECK(memory.state().mu.allFinite());
    CHECK(worst_memory < 1e-3);
    CHECK(worst_chunked < 1e-3);
}

TEST_CASE("Reproducible: the same inputs give bitwise the same outputs", "[robustness][determinism]") {
    const Index n = 200, d = 16;
    const Matrix<float> Q = random_matrix<float>(n, d, 1), K = random_matrix<float>(n, d, 2),
                        V = random_matrix<float>(n, d, 3);
    auto twice = [&](auto&& run) {
        Matrix<float> a = Matrix<float>::Constant(n, d, 7.f), b = Matrix<float>::Constant(n, d, -3.f);
        run(a);
        run(b);
        CHECK(a == b);
    };
    twice([&](Matrix<float>& O) { causal_softmax_attention(Q, K, V, O, SoftmaxOptions{0, 37, 2}); });
    twice([&](Matrix<float>& O) { chunked_linear_attention(Q, K, V, O); });
    twice([&](Matrix<float>& O) { quadratic_linear_attention(Q, K, V, O, Taylor2{}); });
    twice([&](Matrix<float>& O) { recurrent_linear_attention(Q, K, V, O, FavorPlus(d, 32, 5)); });
    twice([&](Matrix<float>& O) { SlidingWindowCache<float> m(d, d, 50, 3); prefill(m, Q, K, V, O); });
    twice([&](Matrix<float>& O) { HybridCache<float, MaxPool> m(d, d, 16, 3, 8); decode(m, Q, K, V, O); });
}
