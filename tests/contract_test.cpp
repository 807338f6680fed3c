// Regression tests of promises that README.md, docs/design.md or a header state, found
// broken by the adversarial review of the paged pool and its snapshots, the batched
// calls, the logit options, biases and masks, the recurrent kernels and memories, user
// executors and the sparse cache; each fails on the code before its fix.
#include "support.hpp"

#include <memattn/memattn.hpp>

#include <cmath>
#include <functional>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

using namespace memattn;
using memattn::test::HasSubstring;
using memattn::test::random_matrix;

namespace {

/// Throws std::invalid_argument whose message holds every needle.
void expect_refused(const std::function<void()>& call, const std::vector<std::string>& needles) {
    bool threw = false;
    try {
        call();
    } catch (const std::invalid_argument& e) {
        threw = true;
        const std::string message = e.what();
        INFO(message);
        for (const auto& needle : needles)
            CHECK_THAT(message, HasSubstring(needle));
    }
    CHECK(threw);
}

/// A memory's snapshot, to compare its whole state before and after a call.
template <class M>
std::string snapshot_of(M& memory) {
    std::stringstream stream;
    memattn::save(memory, stream);
    return stream.str();
}

/// A user's executor that fails: a parallel_for runs the first `runs` items, then throws,
/// as a pool that cannot start a thread would; every call, or (fail_call ≥ 1) only call
/// number fail_call, the others running every item.
struct FailingExecutor {
    int threads = 4;
    Index runs = 1;
    int fail_call = 0;
    mutable int calls = 0;
    [[nodiscard]] int concurrency() const { return threads; }
    template <class F>
    void parallel_for(Index n, F&& f) const {
        const bool fails = ++calls == fail_call || fail_call == 0;
        for (Index i = 0; i < (fails ? std::min(n, runs) : n); ++i)
            f(i);
        if (fails)
            throw std::runtime_error("the executor failed");
    }
};

/// A user's executor that returns having run only the even items.
struct SkippingExecutor {
    [[nodiscard]] int concurrency() const { return 4; }
    template <class F>
    void parallel_for(Index n, F&& f) const {
        for (Index i = 0; i < n; i += 2)
            f(i);
    }
};

/// A user's executor declared not to throw.
struct QuietExecutor {
    [[nodiscard]] int concurrency() const { return 2; }
    template <class F>
    void parallel_for(Index n, F&& f) const noexcept {
        for (Index i = 0; i < n; ++i)
            f(i);
    }
};

}  // namespace

// ------------------------------------------------------------ 1. a short windowed sequence's snapshot

TEST_CASE("PagedKVCache: a windowed sequence saves and resumes exactly at every length, shorter than its sinks "
          "included",
          "[contract][serving][snapshot]") {
    const HeadLayout layout{2, 1, 4, 0};
    const SoftmaxOptions options{.window = 4, .sink_tokens = 5};
    const Matrix<float> K = random_matrix<float>(24, 4, 1), V = random_matrix<float>(24, 4, 2),
                        Q = random_matrix<float>(24, 8, 3);
    for (Index n = 0; n <= 20; ++n) {
        CAPTURE(n);
        PagedKVCache<float> pool(layout, 8, 8, options);
        const Index a = pool.add_sequence();
        pool.extend(a, K.topRows(n), V.topRows(n));
        auto seq = pool.sequence(a);
        std::stringstream stream;
        memattn::save(seq, stream);
        PagedKVCache<float> other(layout, 8, 8, options);
        const Index b = other.add_sequence();
        auto loaded = other.sequence(b);
        memattn::load(loaded, stream);
        REQUIRE(other.length(b) == n);
        CHECK(other.blocks_of(b) == pool.blocks_of(a));
        // The resumed sequence steps as the original does, bit for bit.
        Matrix<float> expected(1, 8), got(1, 8);
        for (Index t = n; t < n + 4; ++t) {
            pool.update(a, K.row(t), V.row(t));
            other.update(b, K.row(t), V.row(t));
            pool.attend(a, Q.row(t), expected.row(0));
            other.attend(b, Q.row(t), got.row(0));
            CHECK((got.array() == expected.array()).all());
        }
    }
}

// ------------------------------------------------------------ 2. an output over the bias or mask

TEST_CASE("causal_softmax_attention: an output overlapping the bias or mask is refused", "[contract][aliasing]") {
    const Index n = 64, d = 8;
    const Matrix<float> Q = random_matrix<float>(n, d, 4), K = random_matrix<float>(n, d, 5);
    Matrix<float> buffer = random_matrix<float>(n + 1, n, 6);  // rows 0..n-1 the bias, O rows 1..n
    const Matrix<float> V = random_matrix<float>(n, n, 7);
    auto bias = buffer.topRows(n);
    auto O = buffer.middleRows(1, n);
    expect_refused([&] { causal_softmax_attention(Q, K, V, O, {}, bias); },
                   {"memattn::causal_softmax_attention", "'O'", "'bias'"});
    // A mask whose bools lie in O's bytes.
    Matrix<float> out(n, n);
    const Eigen::Map<const Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> mask(
        reinterpret_cast<const bool*>(out.data()), n, n);
    expect_refused([&] { causal_softmax_attention(Q, K, V, out, {}, mask); }, {"'O'", "'bias'"});
    // The layer, with one bias for every head and with one per head.
    const HeadLayout layout{2, 1, d, n};
    const Matrix<float> Q2 = random_matrix<float>(n, 2 * d, 8);
    Matrix<float> wide = random_matrix<float>(2 * n + 1, 2 * n, 9);
    auto per_head = wide.block(0, 0, 2 * n, n);
    auto O2 = wide.block(1, 0, n, 2 * n);
    expect_refused([&] { multi_head_causal_softmax_attention(Q2, K, V, O2, layout, {}, per_head); },
                   {"memattn::multi_head_causal_softmax_attention", "'O'", "'bias'"});
    // A bias beside O in one buffer is fine, and gives the same result as a copy.
    Matrix<float> side = random_matrix<float>(n, 2 * n, 10);
    auto apart = side.leftCols(n);
    auto O3 = side.rightCols(n);
    const Matrix<float> copy = apart;
    Matrix<float> expected(n, n);
    causal_softmax_attention(Q, K, V, O3, {}, apart);
    causal_softmax_attention(Q, K, V, expected, {}, copy);
    CHECK((Matrix<float>(O3).array() == expected.array()).all());
}

// ------------------------------------------------------------ 3. a windowed sequence into smaller blocks

TEST_CASE("PagedKVCache: a windowed snapshot loads into a pool of smaller blocks with only what the window keeps",
          "[contract][serving][snapshot]") {
    const HeadLayout layout{2, 1, 4, 0};
    const SoftmaxOptions options{.window = 6, .sink_tokens = 3};
    const Matrix<float> K = random_matrix<float>(60, 4, 11), V = random_matrix<float>(60, 4, 12),
                        Q = random_matrix<float>(60, 8, 13);
    PagedKVCache<float> pool(layout, 8, 16, options);
    const Index a = pool.add_sequence();
    pool.extend(a, K.topRows(37), V.topRows(37));
    REQUIRE(pool.blocks_of(a) == 3);  // blocks of 16 still hold every token
    auto seq = pool.sequence(a);
    std::stringstream stream;
    memattn::save(seq, stream);
    const std::string bytes = stream.str();
    for (const Index block : {1, 2, 5, 7}) {
        CAPTURE(block);
        const Index bound = (3 + block - 1) / block + (6 + block - 1) / block + 1;
        PagedKVCache<float> small(layout, bound + 2, block, options);  // room for the window, not for 37 tokens
        const Index b = small.add_sequence();
        auto loaded = small.sequence(b);
        std::stringstream in(bytes);
        memattn::load(loaded, in);
        CHECK(small.length(b) == 37);
        CHECK(small.blocks_of(b) <= bound);
        // The same as the sequence stepped in that pool from the start.
        PagedKVCache<float> stepped(layout, bound + 2, block, options);
        const Index c = stepped.add_sequence();
        stepped.extend(c, K.topRows(37), V.topRows(37));
        CHECK(small.blocks_of(b) == stepped.blocks_of(c));
        CHECK(small.blocks_in_use() == stepped.blocks_in_use());
        Matrix<float> expected(1, 8), got(1, 8);
        for (Index t = 37; t < 45; ++t) {
            small.update(b, K.row(t), V.row(t));
            stepped.update(c, K.row(t), V.row(t));
            small.attend(b, Q.row(t), got.row(0));
            stepped.attend(c, Q.row(t), expected.row(0));
            CHECK((got.array() == expected.array()).all());
        }
    }
}

// ------------------------------------------------------------ 4. options finite in the scalar computed in

TEST_CASE("sink_logits and alibi_slopes are checked in the scalar the call computes in", "[contract][bad_input]") {
    const Matrix<float> Q = Matrix<float>::Ones(4, 3), V = Matrix<float>::Ones(4, 2);
    Matrix<float> O(4, 2);
    const std::vector<double> huge{1e300};
    expect_refused([&] { causal_softmax_attention(Q, Q, V, O, {.sink_logits = huge}); },
                   {"memattn::causal_softmax_attention", "options.sink_logits", "1e+300", "float"});
    expect_refused([&] { causal_softmax_attention(Q, Q, V, O, {.alibi_slopes = huge}); },
                   {"options.alibi_slopes", "1e+300", "float"});
    expect_refused([&] { causal_softmax_attention(Q, Q, V, O, {.softcap = 1e300}); }, {"options.softcap", "float"});
    expect_refused([&] { KVCache<float>(3, 2, SoftmaxOptions{.sink_logits = huge}); },
                   {"memattn::KVCache", "options.sink_logits"});
    expect_refused([&] { SlidingWindowCache<float>(3, 2, SoftmaxOptions{.window = 4, .alibi_slopes = huge}); },
                   {"memattn::SlidingWindowCache", "options.alibi_slopes"});
    expect_refused([&] { PagedKVCache<float>({1, 1, 3, 2}, 4, 4, SoftmaxOptions{.sink_logits = huge}); },
                   {"memattn::PagedKVCache", "options.sink_logits"});
    const std::vector<double> huge2{1e300, 0.5};
    expect_refused(
        [&] {
            multi_head_causal_softmax_attention(Matrix<float>::Ones(4, 6), Q, V, Matrix<float>(4, 4), {2, 1, 3, 2},
                                                {.alibi_slopes = huge2});
        },
        {"memattn::multi_head_causal_softmax_attention", "options.alibi_slopes", "head 0"});
    // Finite in double: accepted there, and −∞ (no sink) in float.
    const Matrix<double> Qd = Matrix<double>::Ones(4, 3), Vd = Matrix<double>::Ones(4, 2);
    Matrix<double> Od(4, 2);
    causal_softmax_attention(Qd, Qd, Vd, Od, {.sink_logits = huge});
    CHECK(Od.allFinite());
    const std::vector<double> none{-std::numeric_limits<double>::infinity()};
    causal_softmax_attention(Q, Q, V, O, {.sink_logits = none});
    CHECK(O.allFinite());
}

// ------------------------------------------------------------ 5. inputs over the in/out state

TEMPLATE_TEST_CASE("Every recurrent kernel refuses an input that shares memory with its in/out state",
                   "[contract][aliasing][linear]", float, double) {
    using T = TestType;
    const Index d = 4;  // n = d = dv: any input can be a view of the d × d state
    // A state whose mu is ≤ 0 (sign −1: a valid log-gate) or ≥ 0 (+1: a valid β), |mu| ≤ 0.1.
    const auto make = [&](int sign) {
        LinearState<T> state;
        state.mu = T(sign) * random_matrix<T>(d, d, 14, 0.1).cwiseAbs();
        state.nu = random_matrix<T>(1, d, 15, 0.1).cwiseAbs();
        return state;
    };
    const Matrix<T> Q = random_matrix<T>(d, d, 16), K = random_matrix<T>(d, d, 17), V = random_matrix<T>(d, d, 18);
    const Matrix<T> A = random_matrix<T>(d, d, 19, 0.1), B = random_matrix<T>(d, d, 20, 0.1);
    const Matrix<T> gates = -random_matrix<T>(d, 1, 21).cwiseAbs(), channel = -random_matrix<T>(d, d, 22).cwiseAbs();
    const Matrix<T> beta = random_matrix<T>(d, 1, 23).cwiseAbs();
    Matrix<T> O(d, d);
    // Each call with an input viewing the state: refused, naming both, the state unchanged.
    const auto refused = [&](int sign, const std::vector<std::string>& names, const auto& call) {
        LinearState<T> state = make(sign);
        const LinearState<T> before = state;
        const Eigen::Map<const Matrix<T>> mu(state.mu.data(), d, d), column(state.mu.data(), d, 1);
        const Eigen::Map<const Matrix<T>> nu(state.nu.data(), 1, d);
        expect_refused([&] { call(state, mu, column, nu); }, names);
        CHECK(state.mu == before.mu);
        CHECK(state.nu == before.nu);
    };
    using S = LinearState<T>;
    using M = Eigen::Map<const Matrix<T>>;
    refused(1, {"memattn::recurrent_linear_attention", "'state->mu'", "'Q'"},
            [&](S& s, const M& mu, const M&, const M&) { recurrent_linear_attention(mu, K, V, O, Identity{}, {}, &s); });
    refused(1, {"memattn::chunked_linear_attention", "'state->mu'", "'K'"},
            [&](S& s, const M& mu, const M&, const M&) { chunked_linear_attention(Q, mu, V, O, Identity{}, {}, &s); });
    refused(1, {"memattn::quadratic_linear_attention", "'state->mu'", "'V'"},
            [&](S& s, const M& mu, const M&, const M&) { quadratic_linear_attention(Q, K, mu, O, Identity{}, {}, &s); });
    refused(1, {"'state->nu'", "'Q'"}, [&](S& s, const M&, const M&, const M& nu) {
        chunked_linear_attention(nu, K.topRows(1), V.topRows(1), O.topRows(1), Identity{}, {}, &s);
    });
    refused(1, {"memattn::recurrent_gated_linear_attention", "'state->mu'", "'Q'"},
            [&](S& s, const M& mu, const M&, const M&) { recurrent_gated_linear_attention(mu, K, V, gates, O, {}, &s); });
    refused(-1, {"memattn::chunked_gated_linear_attention", "'state->mu'", "'log_gates'"},
            [&](S& s, const M& mu, const M&, const M&) { chunked_gated_linear_attention(Q, K, V, mu, O, {}, &s); });
    for (const bool chunked : {false, true}) {
        CAPTURE(chunked);
        const auto delta = [&](S& s, const auto& q, const auto& k, const auto& v, const auto& b, const auto* g) {
            if (g != nullptr && chunked)
                chunked_delta_rule_attention(q, k, v, b, *g, O, {}, &s);
            else if (g != nullptr)
                recurrent_delta_rule_attention(q, k, v, b, *g, O, {}, &s);
            else if (chunked)
                chunked_delta_rule_attention(q, k, v, b, O, {}, &s);
            else
                recurrent_delta_rule_attention(q, k, v, b, O, {}, &s);
        };
        const Matrix<T>* none = nullptr;
        refused(1, {"delta_rule_attention", "'state->mu'", "'Q'"},
                [&](S& s, const M& mu, const M&, const M&) { delta(s, mu, K, V, beta, none); });
        refused(1, {"'state->mu'", "'V'"}, [&](S& s, const M& mu, const M&, const M&) { delta(s, Q, K, mu, beta, none); });
        refused(1, {"'state->mu'", "'beta'"},
                [&](S& s, const M&, const M& column, const M&) { delta(s, Q, K, V, column, none); });
        refused(-1, {"'state->mu'", "'log_gates'"},
                [&](S& s, const M&, const M& column, const M&) { delta(s, Q, K, V, beta, &column); });
        refused(1, {"kda_attention", "'state->mu'", "'V'"}, [&](S& s, const M& mu, const M&, const M&) {
            if (chunked)
                chunked_kda_attention(Q, K, mu, beta, channel, O, {}, &s);
            else
                recurrent_kda_attention(Q, K, mu, beta, channel, O, {}, &s);
        });
        refused(1, {"rwkv7_attention", "'state->mu'"}, [&](S& s, const M& mu, const M&, const M&) {
            if (chunked)
                chunked_rwkv7_attention(Q, K, V, A, mu, channel, O, {}, &s);
            else
                recurrent_rwkv7_attention(mu, K, V, A, B, channel, O, {}, &s);
        });
    }
}

// ------------------------------------------------------------ 6. an update with a view of the memory's own state

TEST_CASE("The recurrent memories' update and extend with views of their own state give what copies give",
          "[contract][memory][gated]") {
    using T = double;
    const Index d = 2, dv = 12;  // a state row is wide enough to hold any of their key rows
    // Row 0 of each memory's state is set to a key row it accepts, row 1 to a value.
    const auto run = [&](auto memory, Index key_dim, const Matrix<T>& key_row) {
        CAPTURE(key_dim);
        Matrix<T> S = random_matrix<T>(d, dv, 24, 0.5);
        S.row(0).head(key_dim) = key_row;
        if constexpr (requires { memory.state().mu; }) {
            memory.set_state(LinearState<T>{S, Matrix<T>::Zero(1, d)}, 5);
        } else {
            memory.set_state(S, 5);
        }
        auto copied = memory;
        const auto& own = [&]() -> const Matrix<T>& {
            if constexpr (requires { memory.state().mu; })
                return memory.state().mu;
            else
                return memory.state();
        }();
        memory.update(own.row(0).head(key_dim), own.row(1));
        const Matrix<T> key = S.row(0).head(key_dim), value = S.row(1);
        copied.update(key, value);
        CHECK(snapshot_of(memory) == snapshot_of(copied));
        // extend with both rows of the state as the values.
        const Matrix<T> keys = key_row.replicate(2, 1), values = own;
        memattn::extend(memory, keys, own);
        memattn::extend(copied, keys, values);
        CHECK(snapshot_of(memory) == snapshot_of(copied));
        CHECK(memory.length() == 8);
    };
    Matrix<T> scalar_key(1, d + 1);
    scalar_key << 0.3, -0.2, -0.1;
    run(GatedLinearAttentionMemory<T>(d, dv, GateKind::scalar), d + 1, scalar_key);
    Matrix<T> channel_key(1, 2 * d);
    channel_key << 0.3, -0.2, -0.1, -0.4;
    run(GatedLinearAttentionMemory<T>(d, dv, GateKind::channel), 2 * d, channel_key);
    Matrix<T> delta_key(1, d + 2);
    delta_key << 0.3, -0.2, 0.6, -0.1;
    run(DeltaRuleMemory<T>(d, dv, {}, true), d + 2, delta_key);
    Matrix<T> kda_key(1, 2 * d + 1);
    kda_key << 0.3, -0.2, 0.6, -0.1, -0.3;
    run(KdaMemory<T>(d, dv), 2 * d + 1, kda_key);
    Matrix<T> rwkv_key(1, 4 * d);
    rwkv_key << 0.3, -0.2, 0.1, 0.2, -0.3, 0.1, -0.2, -0.05;
    run(Rwkv7Memory<T>(d, dv), 4 * d, rwkv_key);
}

// ------------------------------------------------------------ 7. an executor that throws changes nothing

TEST_CASE("ExecutorRef tells whether an executor may throw", "[contract][threads]") {
    CHECK(ExecutorRef(SerialExecutor{}).nothrow());
    CHECK(ExecutorRef(OpenMPExecutor{.threads = 2}).nothrow());
    CHECK(ExecutorRef().nothrow());
    CHECK(ExecutorRef(QuietExecutor{}).nothrow());
    CHECK_FALSE(ExecutorRef(FailingExecutor{}).nothrow());
    CHECK_FALSE(ExecutorRef(SkippingExecutor{}).nothrow());
}

TEST_CASE("A layer's prefill through an executor that throws rethrows with every head as it was",
          "[contract][threads][layer]") {
    const HeadLayout layout{8, 4, 8, 0};
    const Matrix<float> Q = random_matrix<float>(40, 64, 25), K = random_matrix<float>(40, 32, 26),
                        V = random_matrix<float>(40, 32, 27);
    Matrix<float> O(40, 64);
    const FailingExecutor failing;
    const auto check = [&](auto layer) {
        const std::string before = snapshot_of(layer);
        layer.set_executor(failing);
        CHECK_THROWS_WITH(memattn::prefill(layer, Q, K, V, O), "the executor failed");
        CHECK(layer.length() == 3);
        CHECK(snapshot_of(layer) == before);
        // And through the layer's own executor again, what a fresh layer gives.
        auto fresh = layer;
        const SerialExecutor serial;
        layer.set_executor(serial);
        fresh.set_executor(serial);
        Matrix<float> expected(40, 64);
        memattn::prefill(layer, Q, K, V, O);
        memattn::decode(fresh, Q, K, V, expected);
        memattn::test::check_close(O, expected.cast<double>(), 2e-5);
    };
    const Matrix<float> K0 = random_matrix<float>(3, 32, 28), V0 = random_matrix<float>(3, 32, 29);
    MultiHead<LinearAttentionMemory<float>> linear(layout, [](Index) { return LinearAttentionMemory<float>(8, 8); });
    memattn::extend(linear, K0, V0);
    check(linear);
    MultiHead<SlidingWindowCache<float>> window(layout, [](Index) { return SlidingWindowCache<float>(8, 8, 16, 2); });
    memattn::extend(window, K0, V0);
    check(window);
    MultiHead<KVCache<float>> caches(layout, [](Index) { return KVCache<float>(8, 8); });
    memattn::extend(caches, K0, V0);
    check(caches);
    // One query head per KV head: each memory's own prefill (the delta rule's chunked kernel).
    const HeadLayout one{4, 4, 8, 0};
    MultiHead<DeltaRuleMemory<float>> delta(one, [](Index) { return DeltaRuleMemory<float>(8, 8); });
    Matrix<float> Kb(40, 36);  // each KV head's [k (8) | β]
    for (Index h = 0; h < 4; ++h) {
        Kb.middleCols(9 * h, 8) = K.middleCols(8 * (h % 4), 8);
        Kb.col(9 * h + 8) = random_matrix<float>(40, 1, 61 + static_cast<std::uint64_t>(h)).cwiseAbs();
    }
    memattn::extend(delta, Kb.topRows(3), V0);
    const std::string before = snapshot_of(delta);
    delta.set_executor(failing);
    CHECK_THROWS_WITH(memattn::prefill(delta, Q.leftCols(32), Kb, V, O.leftCols(32)), "the executor failed");
    CHECK(snapshot_of(delta) == before);
}

TEST_CASE("The pool's prefill and batched decode through an executor that throws change no sequence",
          "[contract][threads][serving]") {
    // Enough work that the attends go through the executor (PagedKVCache::parallel_work).
    const HeadLayout layout{8, 2, 32, 0};
    for (const Index window : {Index{0}, Index{2000}}) {
        CAPTURE(window);
        PagedKVCache<float> pool(layout, 256, 16, SoftmaxOptions{.window = window, .sink_tokens = 4});
        const Matrix<float> K = random_matrix<float>(3100, 64, 30), V = random_matrix<float>(3100, 64, 31),
                            Q = random_matrix<float>(3100, 256, 32);
        const Index a = pool.add_sequence();
        pool.extend(a, K.topRows(3000), V.topRows(3000));
        const Index b = pool.fork(a);  // shares a's last, partly filled block: a batch copies it
        const Index c = pool.add_sequence();
        pool.extend(c, K.topRows(5), V.topRows(5));
        const auto state = [&] {
            std::vector<std::string> s;
            for (const Index seq : {a, b, c}) {
                auto view = pool.sequence(seq);
                s.push_back(snapshot_of(view));
                s.push_back(std::to_string(pool.blocks_of(seq)));
            }
            s.push_back(std::to_string(pool.free_blocks()));
            return s;
        };
        const std::vector<std::string> before = state();
        const FailingExecutor failing;
        const std::vector<Index> seqs{a, b, c}, offsets{0, 32, 33, 40};
        Matrix<float> O(40, 256);
        CHECK_THROWS_WITH(pool.prefill(seqs, offsets, Q.topRows(40), K.middleRows(3000, 40), V.middleRows(3000, 40), O,
                                       failing),
                          "the executor failed");
        CHECK(state() == before);
        Matrix<float> O3(3, 256);
        CHECK_THROWS_WITH(batched_decode(pool, seqs, Q.topRows(3), K.middleRows(3000, 3), V.middleRows(3000, 3), O3,
                                         failing),
                          "the executor failed");
        CHECK(state() == before);
        // A step that goes through: as if the failures never happened.
        PagedKVCache<float> fresh(layout, 256, 16, SoftmaxOptions{.window = window, .sink_tokens = 4});
        const Index fa = fresh.add_sequence();
        fresh.extend(fa, K.topRows(3000), V.topRows(3000));
        const Index fb = fresh.fork(fa);
        const Index fc = fresh.add_sequence();
        fresh.extend(fc, K.topRows(5), V.topRows(5));
        const std::vector<Index> fseqs{fa, fb, fc};
        Matrix<float> expected(40, 256);
        const SerialExecutor serial;
        pool.prefill(seqs, offsets, Q.topRows(40), K.middleRows(3000, 40), V.middleRows(3000, 40), O, serial);
        fresh.prefill(fseqs, offsets, Q.topRows(40), K.middleRows(3000, 40), V.middleRows(3000, 40), expected, serial);
        CHECK((O.array() == expected.array()).all());
        CHECK(pool.free_blocks() == fresh.free_blocks());
        // An executor that skips items: they run on the calling thread, the same bits.
        const SkippingExecutor skipping;
        Matrix<float> skipped(3, 256), serial_out(3, 256);
        batched_decode(pool, seqs, Q.topRows(3), K.middleRows(3040, 3), V.middleRows(3040, 3), skipped, skipping);
        batched_decode(fresh, fseqs, Q.topRows(3), K.middleRows(3040, 3), V.middleRows(3040, 3), serial_out, serial);
        CHECK((skipped.array() == serial_out.array()).all());
    }
}

TEST_CASE("batched_decode and batched_prefill over memories through an executor that throws change none",
          "[contract][threads][batched]") {
    const HeadLayout layout{4, 2, 8, 0};
    const Matrix<float> Q = random_matrix<float>(12, 32, 33), K = random_matrix<float>(12, 16, 34),
                        V = random_matrix<float>(12, 16, 35);
    const FailingExecutor failing;
    const auto check = [&](auto layers) {
        for (std::size_t i = 0; i < layers.size(); ++i)
            memattn::extend(layers[i], random_matrix<float>(static_cast<Index>(3 * i), 16, 36),
                            random_matrix<float>(static_cast<Index>(3 * i), 16, 37));
        std::vector<std::string> before;
        for (auto& layer : layers)
            before.push_back(snapshot_of(layer));
        const auto unchanged = [&] {
            for (std::size_t i = 0; i < layers.size(); ++i)
                CHECK(snapshot_of(layers[i]) == before[i]);
        };
        Matrix<float> O(4, 32);
        CHECK_THROWS_WITH(batched_decode(std::span(layers), Q.topRows(4), K.topRows(4), V.topRows(4), O, failing),
                          "the executor failed");
        unchanged();
        const std::vector<Index> offsets{0, 3, 3, 4, 12};
        Matrix<float> P(12, 32);
        CHECK_THROWS_WITH(batched_prefill(std::span(layers), offsets, Q, K, V, P, failing), "the executor failed");
        unchanged();
        // The same calls on an executor that skips items: what one step per memory gives.
        auto separate = layers;
        Matrix<float> expected(4, 32);
        for (Index i = 0; i < 4; ++i) {
            separate[static_cast<std::size_t>(i)].update(K.row(i), V.row(i));
            separate[static_cast<std::size_t>(i)].attend(Q.row(i), expected.row(i));
        }
        batched_decode(std::span(layers), Q.topRows(4), K.topRows(4), V.topRows(4), O, SkippingExecutor{});
        CHECK((O.array() == expected.array()).all());
    };
    std::vector<MultiHead<KVCache<float>>> caches;
    std::vector<MultiHead<LinearAttentionMemory<float>>> linear;
    std::vector<MultiHead<SlidingWindowCache<float>>> windows;
    std::vector<MultiHead<KVCache<float, PerChannelKeys<Q8>>>> channel;
    for (int i = 0; i < 4; ++i) {
        caches.emplace_back(layout, [](Index) { return KVCache<float>(8, 8); });
        linear.emplace_back(layout, [](Index) { return LinearAttentionMemory<float>(8, 8); });
        windows.emplace_back(layout, [](Index) { return SlidingWindowCache<float>(8, 8, 4, 1); });
        channel.emplace_back(layout, [](Index) { return KVCache<float, PerChannelKeys<Q8>>(8, 8); });
    }
    check(caches);
    check(linear);
    check(windows);
    check(channel);
}

TEST_CASE("The span-parallel kernels through an executor that throws leave the state as it was",
          "[contract][threads][linear]") {
    const Index n = 2048, d = 16, dv = 128;
    const Matrix<float> Q = random_matrix<float>(n, d, 38), K = random_matrix<float>(n, d, 39),
                        V = random_matrix<float>(n, dv, 40);
    const Matrix<float> beta = random_matrix<float>(n, 1, 41).cwiseAbs();
    const Matrix<float> gates = -0.01f * random_matrix<float>(n, 1, 42).cwiseAbs();
    Matrix<float> O(n, dv);
    LinearState<float> state;
    state.mu = random_matrix<float>(d, dv, 43);
    state.nu = random_matrix<float>(1, d, 44).cwiseAbs();
    const LinearState<float> before = state;
    const FailingExecutor failing{.threads = 2, .runs = 1};
    CHECK_THROWS_WITH(chunked_delta_rule_attention(Q, K, V, beta, O, {}, &state, failing), "the executor failed");
    CHECK(state.mu == before.mu);
    CHECK_THROWS_WITH(chunked_kda_attention(Q, K, V, beta, Matrix<float>(gates.replicate(1, d)), O, {}, &state, failing),
                      "the executor failed");
    CHECK(state.mu == before.mu);
    CHECK_THROWS_WITH(chunked_linear_attention(Q, K, V, O, EluPlusOne{}, {.span_tokens = 512}, &state, failing),
                      "the executor failed");
    CHECK(state.mu == before.mu);
    CHECK(state.nu == before.nu);
    CHECK_THROWS_WITH(chunked_gated_linear_attention(Q, K, V, gates, O, {.span_tokens = 512}, &state, failing),
                      "the executor failed");
    CHECK(state.mu == before.mu);
    CHECK(state.nu == before.nu);
    // A second phase that fails (the corrections, after the spans): still nothing.
    const FailingExecutor late{.threads = 2, .runs = 0, .fail_call = 2};
    CHECK_THROWS(chunked_linear_attention(Q, K, V, O, EluPlusOne{}, {.span_tokens = 512}, &state, late));
    CHECK(state.mu == before.mu);
}

// ------------------------------------------------------------ 8. every row of a batch over memories

TEST_CASE("batched_decode and batched_prefill over memories check every argument's rows", "[contract][batched]") {
    std::vector<KVCache<float>> caches(4, KVCache<float>(4, 3));
    const Matrix<float> Q = random_matrix<float>(4, 4, 45), K = random_matrix<float>(6, 4, 46),
                        V = random_matrix<float>(6, 3, 47);
    Matrix<float> O(4, 3), O6(6, 3);
    expect_refused([&] { batched_decode(std::span(caches), Q.topRows(2), K.topRows(4), V.topRows(4), O); },
                   {"memattn::batched_decode", "'Q'", "4 rows"});
    expect_refused([&] { batched_decode(std::span(caches), Q, K.topRows(4), V.topRows(3), O); }, {"'V'"});
    expect_refused([&] { batched_decode(std::span(caches), Q, K.topRows(4), V.topRows(4), O.topRows(1)); }, {"'O'"});
    const std::vector<Index> offsets{0, 1, 2, 4, 6};
    const Matrix<float> Q6 = random_matrix<float>(6, 4, 48);
    expect_refused([&] { batched_prefill(std::span(caches), offsets, Q6, K, V.topRows(3), O6); },
                   {"memattn::batched_prefill", "'V'", "6 rows"});
    for (const KVCache<float>& cache : caches)
        CHECK(cache.length() == 0);
}

// ------------------------------------------------------------ 9. the sparse bound below the normal range

TEMPLATE_TEST_CASE("SparseKVCache: no logit exceeds its block's bound for subnormal queries or keys",
                   "[contract][memory][sparse]", float, double) {
    using T = TestType;
    const Index d = GENERATE(1, 3, 16), n = 256, block = 8;
    const T tiny = std::numeric_limits<T>::min();  // the smallest normal
    const T huge = std::numeric_limits<T>::max() / T(2);
    for (const int kind : {0, 1, 2}) {
        CAPTURE(d, kind);
        // 0: scale·q around a tenth of the smallest normal against keys near the largest;
        // 1: subnormal keys against unit queries; 2: both halves mixed in one cache.
        Matrix<T> K = random_matrix<T>(n, d, 49);
        Matrix<T> Qs = random_matrix<T>(4, d, 50);
        const T scale = T(1) / std::sqrt(static_cast<T>(d));
        if (kind == 0 || kind == 2) {
            K *= huge;
            Qs *= tiny / T(10) / scale;
        }
        if (kind == 1 || kind == 2)
            K.topRows(n / 2) *= tiny / T(64);
        SparseKVCache<T> cache(d, 2, {.block = block, .top_k_blocks = 4, .window = 2, .sinks = 1});
        cache.extend(K, random_matrix<T>(n, 2, 51));
        const Vector<T> bounds = cache.block_bounds(Qs);
        for (Index b = 0; b < n / block; ++b)
            for (Index j = b * block; j < (b + 1) * block; ++j)
                for (Index r = 0; r < Qs.rows(); ++r) {
                    // The logit exactly, and as T computes it from the scaled query.
                    const double exact = static_cast<double>(scale) *
                                         Qs.row(r).template cast<double>().dot(K.row(j).template cast<double>());
                    const Matrix<T> u = scale * Qs.row(r);
                    const double computed = static_cast<double>(u.row(0).dot(K.row(j)));
                    CAPTURE(b, j, r, exact, computed, static_cast<double>(bounds[b]));
                    CHECK(exact <= static_cast<double>(bounds[b]));
                    CHECK(computed <= static_cast<double>(bounds[b]));
                }
    }
}

// ------------------------------------------------------------ 11. the lse the kernel documents

TEST_CASE("causal_softmax_attention's lse includes the sink logit, the softcap and ALiBi", "[contract][softmax]") {
    const Index n = 9, d = 4;
    const Matrix<double> Q = random_matrix<double>(n, d, 52, 2.0), K = random_matrix<double>(n, d, 53, 2.0),
                         V = random_matrix<double>(n, 3, 54);
    const std::vector<double> sink{0.7}, slope{0.25};
    const double softcap = 1.5, scale = 0.5;
    Matrix<double> O(n, 3);
    Vector<double> lse(n);
    causal_softmax_attention(Q, K, V, O, lse,
                             {.scale = scale, .softcap = softcap, .sink_logits = sink, .alibi_slopes = slope});
    for (Index i = 0; i < n; ++i) {
        double sum = std::exp(sink[0]);
        for (Index j = 0; j <= i; ++j)
            sum += std::exp(softcap * std::tanh(scale * Q.row(i).dot(K.row(j)) / softcap) -
                            slope[0] * static_cast<double>(i - j));
        CHECK(lse(i) == Approx(std::log(sum)).epsilon(1e-12));
    }
}

// ------------------------------------------------------------ 13. small things

TEST_CASE("PagedKVCache: a batch that fits one sequence at a time fits as a batch, windows freeing blocks",
          "[contract][serving][window]") {
    const HeadLayout layout{2, 1, 4, 0};
    // A window of 17 over blocks of 8: at every block's first token a sequence takes a
    // block and its window frees one. Two sequences of 40 tokens hold 3 blocks each; with
    // one block free, one update after the other fits, the second taking what the first
    // freed.
    const SoftmaxOptions options{.window = 17};
    const Matrix<float> K = random_matrix<float>(48, 4, 55), V = random_matrix<float>(48, 4, 56),
                        Q = random_matrix<float>(48, 8, 57);
    const auto make = [&](PagedKVCache<float>& pool) {
        const Index a = pool.add_sequence(), b = pool.add_sequence();
        pool.extend(a, K.topRows(40), V.topRows(40));
        pool.extend(b, K.bottomRows(40), V.bottomRows(40));
        return std::vector<Index>{a, b};
    };
    PagedKVCache<float> one_by_one(layout, 7, 8, options), batched(layout, 7, 8, options);
    const std::vector<Index> s1 = make(one_by_one), s2 = make(batched);
    REQUIRE(batched.free_blocks() == 1);
    const Matrix<float> k = random_matrix<float>(2, 4, 58), v = random_matrix<float>(2, 4, 59);
    one_by_one.update(s1[0], k.row(0), v.row(0));
    one_by_one.update(s1[1], k.row(1), v.row(1));
    batched.update(s2, k, v);
    CHECK(batched.free_blocks() == one_by_one.free_blocks());
    Matrix<float> expected(2, 8), got(2, 8);
    one_by_one.attend(s1, Q.topRows(2), expected);
    batched.attend(s2, Q.topRows(2), got);
    CHECK((got.array() == expected.array()).all());
    // In batch order: a new sequence first takes the one free block, and the next member
    // finds none (the peak is 2); last, it takes what the others freed.
    PagedKVCache<float> third(layout, 7, 8, options);
    const std::vector<Index> s3 = make(third);
    const Index c = third.add_sequence();
    const std::vector<Index> late_first{c, s3[0], s3[1]}, late_last{s3[0], s3[1], c};
    const Matrix<float> k3 = random_matrix<float>(3, 4, 60), v3 = random_matrix<float>(3, 4, 61);
    bool threw = false;
    try {
        third.update(late_first, k3, v3);
    } catch (const PoolExhausted& e) {
        threw = true;
        CHECK(e.needed() == 2);
        CHECK(e.free() == 1);
    }
    CHECK(threw);
    CHECK(third.length(s3[0]) == 40);
    CHECK(third.length(c) == 0);
    CHECK(third.free_blocks() == 1);
    third.update(late_last, k3, v3);
    CHECK(third.length(c) == 1);
    CHECK(third.free_blocks() == 0);
    // A long prompt extends a windowed sequence through a pool that holds only its window.
    PagedKVCache<float> small(layout, 4, 8, options);  // ceil(17 / 8) + 1 blocks
    const Index e = small.add_sequence();
    small.extend(e, K, V);
    CHECK(small.length(e) == 48);
    CHECK(small.blocks_of(e) == 3);
}

TEST_CASE("SparseKVCache refuses options that attend nothing past the sinks", "[contract][memory][sparse]") {
    expect_refused([] { SparseKVCache<float>(4, 4, {.top_k_blocks = 0, .window = 0, .sinks = 2}); },
                   {"memattn::SparseKVCache", "sparse.window", "top_k_blocks = 0"});
    SparseKVCache<float> window_only(4, 4, {.top_k_blocks = 0, .window = 1, .sinks = 0});
    SparseKVCache<float> blocks_only(4, 4, {.top_k_blocks = 1, .window = 0, .sinks = 0});
    CHECK(window_only.length() == 0);
    CHECK(blocks_only.length() == 0);
}

TEST_CASE("Rwkv7Memory: a snapshot restores what was saved, a non-finite state too; set_state refuses one",
          "[contract][memory][snapshot]") {
    Rwkv7Memory<float> memory(2, 3);
    Matrix<float> S = random_matrix<float>(2, 3, 60);
    memory.set_state(S, 4);
    Matrix<float> key(1, 8);
    key << std::numeric_limits<float>::max(), 1, 0, 0, 0, 0, 0, 0;  // overflows the state to ±∞ and NaN
    memory.update(key, Matrix<float>::Constant(1, 3, std::numeric_limits<float>::max()));
    memory.update(key, Matrix<float>::Constant(1, 3, -std::numeric_limits<float>::max()));
    REQUIRE_FALSE(memory.state().allFinite());
    std::stringstream stream;
    memattn::save(memory, stream);
    Rwkv7Memory<float> loaded(2, 3);
    memattn::load(loaded, stream);
    CHECK(snapshot_of(loaded) == snapshot_of(memory));  // bit for bit, NaN payloads included
    expect_refused([&] { loaded.set_state(memory.state()); }, {"memattn::Rwkv7Memory::set_state", "finite"});
}
