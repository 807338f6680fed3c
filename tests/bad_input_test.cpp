// The bad-input contract, table-driven over every public entry point: each bad call
// throws std::invalid_argument whose message names the function, the argument and the
// shapes or values seen, and a memory compares equal (length, footprint, and the
// outputs of the same continuation, bit for bit) before and after the failed call.
#include "support.hpp"

#include <memattn/memattn.hpp>

#include <functional>
#include <limits>
#include <string>
#include <vector>

using namespace memattn;
using memattn::test::HasSubstring;
using memattn::test::random_matrix;

namespace {

constexpr double nan_value = std::numeric_limits<double>::quiet_NaN();
constexpr double inf_value = std::numeric_limits<double>::infinity();

struct BadCall {
    std::string name;
    std::function<void()> call;
    std::vector<std::string> needles;  ///< the function, the argument, the shapes or value
};

void check_table(const std::vector<BadCall>& table) {
    for (const auto& bad : table) {
        INFO(bad.name);
        bool threw = false;
        try {
            bad.call();
        } catch (const std::invalid_argument& e) {
            threw = true;
            const std::string message = e.what();
            INFO(message);
            for (const auto& needle : bad.needles)
                CHECK_THAT(message, HasSubstring(needle));
        }
        CHECK(threw);
    }
}

using M = Matrix<float>;

// -------------------------------------------------------------- kernels

std::vector<BadCall> softmax_calls() {
    auto run = [](M Q, M K, M V, M O, SoftmaxOptions options = {}) {
        return [=]() mutable { causal_softmax_attention(Q, K, V, O, options); };
    };
    const std::string f = "memattn::causal_softmax_attention";
    return {
        {"K/V rows differ", run(M(4, 3), M(5, 3), M(6, 2), M(4, 2)), {f, "'V'", "6x2", "5x3"}},
        {"Q/K columns differ", run(M(4, 3), M(5, 4), M(5, 2), M(4, 2)), {f, "'Q'", "4x3", "5x4"}},
        {"Nq > Nk", run(M(6, 3), M(5, 3), M(5, 2), M(6, 2)), {f, "'Q'", "6x3", "5x3"}},
        {"O rows", run(M(4, 3), M(5, 3), M(5, 2), M(3, 2)), {f, "'O'", "3x2", "4x2"}},
        {"O columns", run(M(4, 3), M(5, 3), M(5, 2), M(4, 3)), {f, "'O'", "4x3", "4x2"}},
        {"negative window", run(M(4, 3), M(5, 3), M(5, 2), M(4, 2), {0, -1, 0}), {f, "options.window", "-1"}},
        {"negative sinks", run(M(4, 3), M(5, 3), M(5, 2), M(4, 2), {0, 0, -2}), {f, "options.sink_tokens", "-2"}},
        {"NaN scale", run(M(4, 3), M(5, 3), M(5, 2), M(4, 2), {nan_value, 0, 0}), {f, "options.scale", "nan"}},
        {"infinite scale", run(M(4, 3), M(5, 3), M(5, 2), M(4, 2), {inf_value, 0, 0}), {f, "options.scale", "inf"}},
        {"lse size",
         [] {
             M Q(4, 3), K(5, 3), V(5, 2), O(4, 2);
             Vector<float> lse(3);
             causal_softmax_attention(Q, K, V, O, lse);
         },
         {f, "'lse'", "1x3"}},
    };
}

// The three linear forms take the same arguments and make the same checks.
template <class Form>
std::vector<BadCall> linear_calls(const std::string& f, Form form) {
    auto run = [form](M Q, M K, M V, M O, LinearOptions options = {}, LinearState<float> state = {}) {
        return [=]() mutable { form(Q, K, V, O, EluPlusOne{}, options, &state); };
    };
    LinearState<float> wrong_mu{M::Zero(3, 2), Vector<float>::Zero(4)};  // d' = 4 for elu+1 on d = 4
    LinearState<float> wrong_nu{M::Zero(4, 2), Vector<float>::Zero(5)};
    LinearOptions zero_chunk, negative_eps, zero_decay, big_decay, nan_decay;
    zero_chunk.chunk_size = 0;
    negative_eps.eps = -1e-3;
    zero_decay.decay = 0;
    big_decay.decay = 1.5;
    nan_decay.decay = nan_value;
    return {
        {f + ": K rows", run(M(5, 4), M(6, 4), M(5, 2), M(5, 2)), {f, "'K'", "6x4", "5x4"}},
        {f + ": K columns", run(M(5, 4), M(5, 3), M(5, 2), M(5, 2)), {f, "'K'", "5x3", "5x4"}},
        {f + ": V rows", run(M(5, 4), M(5, 4), M(4, 2), M(5, 2)), {f, "'V'", "4x2", "5x4"}},
        {f + ": O shape", run(M(5, 4), M(5, 4), M(5, 2), M(5, 3)), {f, "'O'", "5x3", "5x2"}},
        {f + ": chunk_size 0", run(M(5, 4), M(5, 4), M(5, 2), M(5, 2), zero_chunk), {f, "options.chunk_size", "0"}},
        {f + ": eps < 0", run(M(5, 4), M(5, 4), M(5, 2), M(5, 2), negative_eps), {f, "options.eps", "-0.001"}},
        {f + ": decay 0", run(M(5, 4), M(5, 4), M(5, 2), M(5, 2), zero_decay), {f, "options.decay", "(0, 1]"}},
        {f + ": decay > 1", run(M(5, 4), M(5, 4), M(5, 2), M(5, 2), big_decay), {f, "options.decay", "1.5"}},
        {f + ": decay NaN", run(M(5, 4), M(5, 4), M(5, 2), M(5, 2), nan_decay), {f, "options.decay", "nan"}},
        {f + ": state mu", run(M(5, 4), M(5, 4), M(5, 2), M(5, 2), {}, wrong_mu), {f, "state->mu", "3x2", "4x2"}},
        {f + ": state nu", run(M(5, 4), M(5, 4), M(5, 2), M(5, 2), {}, wrong_nu), {f, "state->nu", "1x5", "1x4"}},
        {f + ": feature map of another dim",
         [form] {
             M Q(5, 4), K(5, 4), V(5, 2), O(5, 2);
             LinearState<float> state{M::Zero(8, 2), Vector<float>::Zero(8)};  // drawn for m = 8 ...
             form(Q, K, V, O, FavorPlus(3, 8, 1), LinearOptions{}, &state);  // ... on inputs of dim 3
         },
         {"FavorPlus", "'d'", "4", "3"}},
    };
}

std::vector<BadCall> feature_map_calls() {
    return {
        {"EluPlusOne: Y shape", [] { M X(3, 4), Y(3, 5); EluPlusOne{}(X, Y); }, {"EluPlusOne", "'Y'", "3x5", "3x4"}},
        {"Taylor2: Y shape", [] { M X(3, 2), Y(3, 5); Taylor2{}(X, Y); }, {"Taylor2", "'Y'", "3x5", "3x6"}},
        {"FavorPlus: X columns", [] { M X(3, 2), Y(3, 8); FavorPlus(4, 8, 7)(X, Y); }, {"FavorPlus", "'X'", "3x2"}},
        {"FavorPlus: m 0", [] { FavorPlus(4, 0, 7); }, {"FavorPlus", "'m'", "0"}},
    };
}

// -------------------------------------------------------------- memories

/// A continuation fed to a memory after a failed call: its outputs must be the same
/// bit for bit as those of a copy taken before the call.
template <class Mem>
Matrix<typename Mem::Scalar> continuation(Mem mem, Index d, Index dv) {
    using T = typename Mem::Scalar;
    const Matrix<T> Q = random_matrix<T>(9, d, 91), K = random_matrix<T>(9, d, 92), V = random_matrix<T>(9, dv, 93);
    Matrix<T> O(9, dv);
    decode(mem, Q, K, V, O);
    return O;
}

/// Every bad operation on a memory holding a few tokens: throws with the needles, and
/// leaves the memory as it was.
template <class Mem>
void check_memory(const std::string& name, Mem mem, Index d, Index dv) {
    using T = typename Mem::Scalar;
    extend(mem, random_matrix<T>(7, d, 1), random_matrix<T>(7, dv, 2));
    const Mem before = mem;
    const Matrix<T> expected = continuation(before, d, dv);
    const Vector<T> k = Vector<T>::Ones(d), v = Vector<T>::Ones(dv), k_long = Vector<T>::Ones(d + 1),
                    v_long = Vector<T>::Ones(dv + 1);
    Vector<T> out(dv), out_long(dv + 1);
    const Matrix<T> K3 = Matrix<T>::Ones(3, d), V3 = Matrix<T>::Ones(3, dv), V2 = Matrix<T>::Ones(2, dv),
                    Kwide = Matrix<T>::Ones(3, d + 1);
    Matrix<T> O3(3, dv), O2(2, dv);
    const std::string f = name;
    const std::string kshape = "1x" + std::to_string(d + 1), vshape = "1x" + std::to_string(dv + 1);
    const std::vector<std::pair<BadCall, bool>> calls = {
        {{name + "::update key", [&] { mem.update(k_long, v); }, {f + "::update", "'key'", std::to_string(d + 1)}},
         true},
        {{name + "::update value", [&] { mem.update(k, v_long); }, {f + "::update", "'value'", std::to_string(dv + 1)}},
         true},
        {{name + "::attend query", [&] { mem.attend(k_long, out); }, {f + "::attend", "'query'", kshape}}, false},
        {{name + "::attend out", [&] { mem.attend(k, out_long); }, {f + "::attend", "'out'", vshape}}, false},
        {{name + ": extend rows", [&] { extend(mem, K3, V2); }, {"memattn::extend", "'V'", "2x", "3x"}}, true},
        {{name + ": extend columns", [&] { extend(mem, Kwide, V3); }, {"memattn::extend", "'K'", "3x"}}, true},
        {{name + ": decode O", [&] { decode(mem, K3, K3, V3, O2); }, {"memattn::decode", "'O'", "2x"}}, true},
        {{name + ": prefill K", [&] { prefill(mem, K3, Kwide, V3, O3); }, {"memattn::prefill", "'K'", "3x"}}, true},
    };
    for (const auto& [bad, changes_state] : calls) {
        INFO(bad.name);
        check_table({bad});
        CHECK(mem.length() == before.length());
        CHECK(mem.footprint() == before.footprint());
        if (changes_state)
            CHECK(continuation(mem, d, dv) == expected);
    }
    // The memory's own members, called directly with mismatched rows.
    if constexpr (detail::HasBulkExtend<Mem>) {
        check_table({{name + "::extend rows", [&] { mem.extend(K3, V2); }, {f + "::extend", "2x"}}});
        CHECK(continuation(mem, d, dv) == expected);
    }
}

}  // namespace

TEST_CASE("Bad input: causal_softmax_attention", "[bad_input][softmax]") { check_table(softmax_calls()); }

TEST_CASE("Bad input: the linear attention forms and feature maps", "[bad_input][linear]") {
    check_table(linear_calls("memattn::quadratic_linear_attention", [](auto&&... a) { quadratic_linear_attention(a...); }));
    check_table(linear_calls("memattn::recurrent_linear_attention", [](auto&&... a) { recurrent_linear_attention(a...); }));
    check_table(linear_calls("memattn::chunked_linear_attention", [](auto&&... a) { chunked_linear_attention(a...); }));
    check_table(feature_map_calls());
}

TEST_CASE("Bad input: memory constructors", "[bad_input][memory]") {
    check_table({
        {"KVCache key_dim 0", [] { KVCache<float>(0, 2); }, {"memattn::KVCache", "'key_dim'", "0"}},
        {"KVCache NaN scale", [] { KVCache<float>(2, 2, NAN); }, {"memattn::KVCache", "'scale'", "nan"}},
        {"SlidingWindowCache window 0", [] { SlidingWindowCache<float>(2, 2, 0); },
         {"memattn::SlidingWindowCache", "'window'", "0"}},
        {"SlidingWindowCache sinks < 0", [] { SlidingWindowCache<float>(2, 2, 4, -1); },
         {"memattn::SlidingWindowCache", "'sinks'", "-1"}},
        {"SlidingWindowCache infinite scale", [] { SlidingWindowCache<float>(2, 2, 4, 0, INFINITY); },
         {"memattn::SlidingWindowCache", "'scale'", "inf"}},
        {"MovingAverageCache window < 0", [] { MovingAverageCache<float>(2, 2, -3); },
         {"memattn::MovingAverageCache", "'window'", "-3"}},
        {"MovingAverageCache alpha 0", [] { MovingAverageCache<float>::exponential(2, 2, 0.f); },
         {"MovingAverageCache", "'alpha'", "0"}},
        {"MovingAverageCache alpha > 1", [] { MovingAverageCache<float>::exponential(2, 2, 2.f); },
         {"MovingAverageCache", "'alpha'", "2"}},
        {"HybridCache window 0", [] { HybridCache<float>(2, 2, 0, 2, 2); }, {"memattn::HybridCache", "'window'", "0"}},
        {"HybridCache rate 0", [] { HybridCache<float>(2, 2, 4, 0, 2); }, {"memattn::HybridCache", "'rate'", "0"}},
        {"HybridCache slots < 0", [] { HybridCache<float>(2, 2, 4, 2, -1); }, {"memattn::HybridCache", "'slots'", "-1"}},
        {"HybridCache weights shorter than rate",
         [] { HybridCache<float, WeightedPool>(2, 2, 4, 3, 2, 0.f, WeightedPool({0.5, 0.5})); },
         {"memattn::HybridCache", "'rate'", "3", "2"}},
        {"LinearAttentionMemory decay", [] { LinearAttentionMemory<float>(2, 2, {}, {64, 1e-6, 2.0, true}); },
         {"memattn::LinearAttentionMemory", "options.decay", "2"}},
        {"LinearAttentionMemory chunk 0", [] { LinearAttentionMemory<float>(2, 2, {}, {0, 1e-6, 1.0, true}); },
         {"memattn::LinearAttentionMemory", "options.chunk_size", "0"}},
        {"LinearAttentionMemory feature map of another dim",
         [] { LinearAttentionMemory<float, FavorPlus>(3, 2, FavorPlus(4, 8, 1)); }, {"FavorPlus", "'d'", "3", "4"}},
    });
}

TEMPLATE_TEST_CASE("Bad input: a memory whose call throws is unchanged", "[bad_input][memory]", float, double) {
    using T = TestType;
    check_memory("KVCache", KVCache<T>(3, 2), 3, 2);
    check_memory("SlidingWindowCache", SlidingWindowCache<T>(3, 2, 4, 1), 3, 2);
    check_memory("MovingAverageCache", MovingAverageCache<T>(3, 2, 4), 3, 2);
    check_memory("MovingAverageCache", MovingAverageCache<T>(3, 2, 0), 3, 2);
    check_memory("MovingAverageCache", MovingAverageCache<T>::exponential(3, 2, T(0.25)), 3, 2);
    check_memory("HybridCache", HybridCache<T>(3, 2, 2, 2, 2), 3, 2);
    check_memory("HybridCache", HybridCache<T, MaxPool>(3, 2, 3, 1, 1), 3, 2);
    check_memory("LinearAttentionMemory", LinearAttentionMemory<T>(3, 2), 3, 2);
    check_memory("LinearAttentionMemory", LinearAttentionMemory<T, Taylor2>(3, 2), 3, 2);

    LinearAttentionMemory<T> mem(3, 2);
    extend(mem, random_matrix<T>(5, 3, 1), random_matrix<T>(5, 2, 2));
    const auto before = mem;
    LinearState<T> wrong{Matrix<T>::Zero(2, 2), Vector<T>::Zero(3)};
    check_table({{"LinearAttentionMemory::set_state", [&] { mem.set_state(wrong); },
                  {"memattn::LinearAttentionMemory::set_state", "state.mu", "2x2", "3x2"}}});
    CHECK(continuation(mem, 3, 2) == continuation(before, 3, 2));
}
