// The multi-head layer (memattn/layer/): the kernels over packed [tokens, heads·dim]
// buffers equal the single-head kernels called head by head and sequence by sequence,
// bit for bit; MultiHead<M> equals one memory per head; grouped attends equal single
// ones; bad layouts and offsets throw and change nothing. Thread counts: thread_test.cpp.
#include "reference/reference.hpp"
#include "support.hpp"

#include <memattn/memattn.hpp>

#include <string>
#include <vector>

using namespace memattn;
using memattn::test::check_close;
using memattn::test::HasSubstring;
using memattn::test::random_matrix;
using memattn::test::tolerance;

namespace {

template <class T>
bool same_bits(const Matrix<T>& a, const Matrix<T>& b) {
    return a.rows() == b.rows() && a.cols() == b.cols() && (a.array() == b.array()).all();
}

/// Offsets 0, n0, n0 + n1, ... for lengths n_b.
std::vector<Index> offsets_of(const std::vector<Index>& lengths) {
    std::vector<Index> offsets{0};
    for (Index n : lengths)
        offsets.push_back(offsets.back() + n);
    return offsets;
}

/// The layer computed the plain way: causal_softmax_attention per sequence and query head
/// (inputs of T, outputs of Out: a 16-bit T may have float outputs; lse in float then).
template <class T, class Out = T>
void per_head_softmax(const Matrix<T>& Q, const Matrix<T>& K, const Matrix<T>& V, Matrix<Out>& O,
                      Matrix<arithmetic_t<T>>& lse,
                      const HeadLayout& layout, const SoftmaxOptions& options, const std::vector<Index>& q_offsets,
                      const std::vector<Index>& k_offsets) {
    const Index d = layout.head_dim, dv = layout.values();
    for (std::size_t b = 0; b + 1 < q_offsets.size(); ++b) {
        const Index q0 = q_offsets[b], nq = q_offsets[b + 1] - q0, k0 = k_offsets[b], nk = k_offsets[b + 1] - k0;
        if (nq == 0)  // nothing to compute, and no block of an empty matrix (a null pointer)
            continue;
        for (Index h = 0; h < layout.q_heads; ++h) {
            const Index kv = layout.kv_head_of(h);
            Vector<arithmetic_t<T>> l(nq);
            causal_softmax_attention(Q.block(q0, h * d, nq, d), K.block(k0, kv * d, nk, d),
                                     V.block(k0, kv * dv, nk, dv), O.block(q0, h * dv, nq, dv), l, options);
            lse.block(q0, h, nq, 1) = l.transpose();
        }
    }
}

template <class T, class Out = T>
void check_softmax_layer(const HeadLayout& layout, const SoftmaxOptions& options, const std::vector<Index>& q_lengths,
                         const std::vector<Index>& k_lengths, std::uint64_t seed) {
    using A = arithmetic_t<T>;
    const std::vector<Index> qo = offsets_of(q_lengths), ko = offsets_of(k_lengths);
    const Index nq = qo.back(), nk = ko.back(), d = layout.head_dim, dv = layout.values();
    const Matrix<T> Q = random_matrix<T>(nq, layout.q_heads * d, seed, 2.0);
    const Matrix<T> K = random_matrix<T>(nk, layout.kv_heads * d, seed + 1, 2.0);
    const Matrix<T> V = random_matrix<T>(nk, layout.kv_heads * dv, seed + 2);
    Matrix<Out> O(nq, layout.q_heads * dv), R(nq, layout.q_heads * dv);
    Matrix<A> lse(nq, layout.q_heads), lse_r(nq, layout.q_heads);
    per_head_softmax(Q, K, V, R, lse_r, layout, options, qo, ko);
    const VarLen batch{qo, ko};
    multi_head_causal_softmax_attention(Q, K, V, O, lse, layout, options, batch);
    CHECK(same_bits(O, R));
    CHECK(same_bits(lse, lse_r));
    Matrix<Out> O2 = Matrix<Out>::Constant(nq, layout.q_heads * dv, Out(7.0f));
    multi_head_causal_softmax_attention(Q, K, V, O2, layout, options, batch);
    CHECK(same_bits(O2, R));
    // And against the double-precision definition, sequence by sequence and head by head
    // (16-bit inputs: the single-head kernel's bound is tested in causal_softmax_test.cpp).
    if constexpr (LowPrecision<T>)
        return;
    for (std::size_t b = 0; b < q_lengths.size(); ++b)
        for (Index h = 0; h < layout.q_heads && q_lengths[b] > 0; ++h) {
            const Index kv = layout.kv_head_of(h);
            const auto expected = reference::softmax_attention(
                reference::to_double(Q.block(qo[b], h * d, q_lengths[b], d)),
                reference::to_double(K.block(ko[b], kv * d, k_lengths[b], d)),
                reference::to_double(V.block(ko[b], kv * dv, k_lengths[b], dv)), options.scale, options.window,
                options.sink_tokens);
            check_close(O.block(qo[b], h * dv, q_lengths[b], dv), expected.out, tolerance<T>());
        }
}

}  // namespace

TEMPLATE_TEST_CASE("multi_head_causal_softmax_attention equals the kernel per head", "[layer][softmax]", float,
                   double) {
    using T = TestType;
    const Index n = 150;  // off every tile: 2 query tiles of 64 and a part, keys 128 and a part
    SECTION("MHA 4/4") { check_softmax_layer<T>({4, 4, 16}, {}, {n}, {n}, 1); }
    SECTION("GQA 8/2, value_dim != head_dim") { check_softmax_layer<T>({8, 2, 16, 8}, {}, {n}, {n}, 2); }
    SECTION("MQA 8/1, window and sinks") {
        check_softmax_layer<T>({8, 1, 8}, {.window = 40, .sink_tokens = 3}, {n}, {n}, 3);
    }
    SECTION("window >= the sequence") { check_softmax_layer<T>({4, 2, 8}, {.window = 1000}, {n}, {n}, 4); }
    SECTION("d = 1, explicit scale, Nq < Nk") { check_softmax_layer<T>({2, 1, 1}, {.scale = 0.5}, {70}, {200}, 5); }
    SECTION("0 and 1 tokens") {
        check_softmax_layer<T>({4, 2, 8}, {}, {0}, {0}, 6);
        check_softmax_layer<T>({4, 2, 8}, {}, {1}, {1}, 7);
        check_softmax_layer<T>({4, 2, 8}, {}, {0}, {5}, 8);
    }
}

TEMPLATE_TEST_CASE("multi_head_causal_softmax_attention on bfloat16 and float16 equals the kernel per head",
                   "[layer][softmax][low_precision]", Eigen::bfloat16, Eigen::half) {
    using E = TestType;
    const Index n = 250;  // off every tile
    SECTION("GQA 8/2, d = 64, outputs of float and of the inputs' type") {
        check_softmax_layer<E, float>({8, 2, 64}, {}, {n}, {n}, 21);
        check_softmax_layer<E, E>({8, 2, 64}, {}, {n}, {n}, 22);
    }
    SECTION("MQA 4/1, odd d, value_dim != head_dim, window and sinks") {
        check_softmax_layer<E, float>({4, 1, 9, 20}, {.window = 40, .sink_tokens = 3}, {n}, {n}, 23);
    }
    SECTION("a varlen batch with empty sequences and Nq_b < Nk_b") {
        const std::vector<Index> q = {5, 0, 64, 1, 200, 0, 33}, k = {5, 0, 100, 7, 260, 3, 33};
        check_softmax_layer<E, E>({4, 2, 16}, {}, q, k, 24);
    }
}

TEMPLATE_TEST_CASE("A varlen batch equals separate calls per sequence", "[layer][softmax][varlen]", float, double) {
    using T = TestType;
    // Empty sequences, Nq_b < Nk_b, lengths off every tile and one sequence past several tiles.
    const std::vector<Index> q = {5, 0, 64, 1, 200, 0, 33}, k = {5, 0, 100, 7, 260, 3, 33};
    check_softmax_layer<T>({4, 2, 16}, {}, q, k, 11);
    check_softmax_layer<T>({6, 3, 8, 4}, {.window = 50, .sink_tokens = 2}, q, k, 12);
}

TEST_CASE("The layer reads column blocks of a fused QKV buffer in place", "[layer][softmax]") {
    const HeadLayout layout{4, 2, 8};
    const Index n = 90, width = (4 + 2 + 2) * 8;
    const Matrix<float> qkv = random_matrix<float>(n, width, 21);
    const auto Q = qkv.leftCols(32), K = qkv.middleCols(32, 16), V = qkv.rightCols(16);
    Matrix<float> out(n, 2 * 32);  // O is the left half of a wider buffer
    out.setZero();
    multi_head_causal_softmax_attention(Q, K, V, out.leftCols(32), layout);
    Matrix<float> expected(n, 32);
    const Matrix<float> q = Q, k = K, v = V;
    multi_head_causal_softmax_attention(q, k, v, expected, layout);
    CHECK(same_bits(Matrix<float>(out.leftCols(32)), expected));
    CHECK(out.rightCols(32).isZero(0));
}

namespace {

template <class T, class Out = T>
void check_linear_layer(const HeadLayout& layout, const LinearOptions& options, const std::vector<Index>& lengths,
                        std::uint64_t seed) {
    using A = arithmetic_t<T>;
    const std::vector<Index> offsets = offsets_of(lengths);
    const Index n = offsets.back(), d = layout.head_dim, dv = layout.values(), g = layout.group_size();
    const Matrix<T> Q = random_matrix<T>(n, layout.q_heads * d, seed);
    const Matrix<T> K = random_matrix<T>(n, layout.kv_heads * d, seed + 1);
    const Matrix<T> V = random_matrix<T>(n, layout.kv_heads * dv, seed + 2);
    const std::size_t B = lengths.size();
    // Initial states: nonzero, from a first call on other tokens, except an empty one.
    std::vector<LinearState<A>> states(B * static_cast<std::size_t>(layout.kv_heads));
    for (std::size_t i = 1; i < states.size(); ++i) {
        Matrix<Out> warm(9, dv);
        chunked_linear_attention(random_matrix<T>(9, d, seed + 10 + i), random_matrix<T>(9, d, seed + 20 + i),
                                 random_matrix<T>(9, dv, seed + 30 + i), warm, EluPlusOne{}, options, &states[i]);
    }
    const std::vector<LinearState<A>> initial = states;
    Matrix<Out> O(n, layout.q_heads * dv), R(n, layout.q_heads * dv);
    std::vector<LinearState<A>> expected_states = initial;
    for (std::size_t b = 0; b < B; ++b)
        for (Index h = 0; h < layout.q_heads; ++h) {
            const Index kv = h / g;
            const std::size_t index = b * static_cast<std::size_t>(layout.kv_heads) + static_cast<std::size_t>(kv);
            LinearState<A> s = initial[index];
            if (lengths[b] == 0) {  // empty matrices, not blocks of an empty one (a null pointer)
                Matrix<Out> none(0, dv);
                chunked_linear_attention(Matrix<T>(0, d), Matrix<T>(0, d), Matrix<T>(0, dv), none, EluPlusOne{},
                                         options, &s);
            } else {
                chunked_linear_attention(Q.block(offsets[b], h * d, lengths[b], d),
                                         K.block(offsets[b], kv * d, lengths[b], d),
                                         V.block(offsets[b], kv * dv, lengths[b], dv),
                                         R.block(offsets[b], h * dv, lengths[b], dv), EluPlusOne{}, options, &s);
            }
            if (h % g == 0)
                expected_states[index] = s;
        }
    multi_head_chunked_linear_attention(Q, K, V, O, layout, EluPlusOne{}, options, std::span(states),
                                        VarLen{offsets, offsets});
    CHECK(same_bits(O, R));
    for (std::size_t i = 0; i < states.size(); ++i) {
        CHECK(same_bits(states[i].mu, expected_states[i].mu));
        CHECK(same_bits(Matrix<A>(states[i].nu), Matrix<A>(expected_states[i].nu)));
    }
    // Without states: the same outputs as starting from zero.
    if (B == 1 && n > 0) {
        Matrix<Out> zero_start(n, layout.q_heads * dv), Z(n, layout.q_heads * dv);
        multi_head_chunked_linear_attention(Q, K, V, zero_start, layout, EluPlusOne{}, options);
        for (Index h = 0; h < layout.q_heads; ++h)
            chunked_linear_attention(Q.middleCols(h * d, d), K.middleCols(h / g * d, d),
                                     V.middleCols(h / g * dv, dv), Z.middleCols(h * dv, dv), EluPlusOne{}, options);
        CHECK(same_bits(zero_start, Z));
    }
}

}  // namespace

TEMPLATE_TEST_CASE("multi_head_chunked_linear_attention equals the chunked form per head", "[layer][linear]", float,
                   double) {
    using T = TestType;
    SECTION("MHA") { check_linear_layer<T>({4, 4, 8}, {}, {70}, 31); }
    SECTION("GQA 8/2, value_dim != head_dim, decay") { check_linear_layer<T>({8, 2, 8, 4}, {.decay = 0.9}, {53}, 32); }
    SECTION("MQA 8/1, unnormalised") { check_linear_layer<T>({8, 1, 4}, {.normalize = false}, {40}, 33); }
    SECTION("varlen with empty and one-token sequences") {
        check_linear_layer<T>({4, 2, 8}, {.chunk_size = 8}, {17, 0, 1, 30}, 34);
    }
    SECTION("d = 1") { check_linear_layer<T>({2, 1, 1}, {}, {20}, 35); }
    SECTION("0 and 1 tokens") {
        check_linear_layer<T>({4, 2, 8}, {}, {0}, 38);
        check_linear_layer<T>({4, 2, 8}, {}, {1}, 39);
    }
    SECTION("past the staging block, a last block shorter than a chunk") {
        check_linear_layer<T>({4, 4, 8}, {.decay = 0.9}, {2 * detail::LinearStage<T>::rows + 5}, 36);
        check_linear_layer<T>({4, 2, 8}, {.chunk_size = 24}, {300, 517}, 37);
    }
}

TEMPLATE_TEST_CASE("multi_head_chunked_linear_attention on bfloat16 and float16 equals the chunked form per head",
                   "[layer][linear][low_precision]", Eigen::bfloat16, Eigen::half) {
    using E = TestType;
    SECTION("GQA 8/2, outputs of float and of the inputs' type") {
        check_linear_layer<E, float>({8, 2, 8, 4}, {.decay = 0.9}, {53}, 41);
        check_linear_layer<E, E>({8, 2, 8, 4}, {}, {53}, 42);
    }
    SECTION("varlen, past the staging block") {
        check_linear_layer<E, float>({4, 2, 8}, {.chunk_size = 24}, {300, 0, 1, 517}, 43);
    }
}

TEST_CASE("The linear layer against the double-precision definition", "[layer][linear]") {
    const HeadLayout layout{4, 2, 6, 5};
    const Index n = 45, d = 6, dv = 5;
    const Matrix<double> Q = random_matrix<double>(n, 24, 41), K = random_matrix<double>(n, 12, 42),
                         V = random_matrix<double>(n, 10, 43);
    Matrix<double> O(n, 20);
    multi_head_chunked_linear_attention(Q, K, V, O, layout, EluPlusOne{}, {.decay = 0.95});
    for (Index h = 0; h < 4; ++h) {
        Matrix<double> qf(n, d), kf(n, d);
        EluPlusOne{}(Q.middleCols(h * d, d), qf);
        EluPlusOne{}(K.middleCols(h / 2 * d, d), kf);
        const auto expected = reference::linear_attention(qf, kf, V.middleCols(h / 2 * dv, dv), 0.95);
        check_close(O.middleCols(h * dv, dv), expected.out, tolerance<double>());
    }
}

// ------------------------------------------------------------------- MultiHead<M>

namespace {

/// MultiHead<M> decode equals one memory per query head fed its KV head's pairs; its
/// prefill (in two prompts) equals its decode.
template <class M, class Make>
void check_multi_head(const HeadLayout& layout, Make make, Index n, double rel) {
    const Index d = layout.head_dim, dv = layout.values(), g = layout.group_size();
    const Matrix<float> Q = random_matrix<float>(n, layout.q_heads * d, 51, 2.0);
    const Matrix<float> K = random_matrix<float>(n, layout.kv_heads * d, 52, 2.0);
    const Matrix<float> V = random_matrix<float>(n, layout.kv_heads * dv, 53);
    Matrix<float> decoded(n, layout.q_heads * dv), prefilled(n, layout.q_heads * dv), expected(n, layout.q_heads * dv);
    MultiHead<M> a(layout, make), b(layout, make);
    static_assert(Memory<MultiHead<M>>);
    decode(a, Q, K, V, decoded);
    const Index split = n / 3;
    Matrix<float> none(0, layout.q_heads * dv);  // an empty prompt changes nothing
    prefill(b, Matrix<float>(0, layout.q_heads * d), Matrix<float>(0, layout.kv_heads * d),
            Matrix<float>(0, layout.kv_heads * dv), none);
    extend(b, Matrix<float>(0, layout.kv_heads * d), Matrix<float>(0, layout.kv_heads * dv));
    CHECK(b.length() == 0);
    prefill(b, Q.topRows(split), K.topRows(split), V.topRows(split), prefilled.topRows(split));
    prefill(b, Q.bottomRows(n - split), K.bottomRows(n - split), V.bottomRows(n - split),
            prefilled.bottomRows(n - split));
    for (Index h = 0; h < layout.q_heads; ++h) {
        M single = make(h / g);
        Matrix<float> o(n, dv);
        decode(single, Q.middleCols(h * d, d), K.middleCols(h / g * d, d), V.middleCols(h / g * dv, dv), o);
        expected.middleCols(h * dv, dv) = o;
    }
    check_close(decoded, reference::to_double(expected), rel);
    check_close(prefilled, reference::to_double(decoded), rel);
    CHECK(a.length() == n);
    CHECK(b.length() == n);
    std::size_t bytes = 0;
    for (Index h = 0; h < layout.kv_heads; ++h)
        bytes += a.head(h).footprint();
    CHECK(a.footprint() == bytes);
    a.reset();
    CHECK(a.length() == 0);
}

}  // namespace

TEST_CASE("MultiHead<M> equals one memory per head, decode equals prefill", "[layer][memory]") {
    const double rel = 1e-5;
    for (const HeadLayout& layout : {HeadLayout{4, 4, 8}, HeadLayout{8, 2, 8, 4}, HeadLayout{8, 1, 4}}) {
        INFO("q_heads " << layout.q_heads << " kv_heads " << layout.kv_heads);
        const Index d = layout.head_dim, dv = layout.values();
        check_multi_head<KVCache<float>>(layout, [=](Index) { return KVCache<float>(d, dv); }, 140, rel);
        check_multi_head<SlidingWindowCache<float>>(
            layout, [=](Index) { return SlidingWindowCache<float>(d, dv, 30, 2); }, 140, rel);
        check_multi_head<HybridCache<float>>(layout, [=](Index) { return HybridCache<float>(d, dv, 20, 4, 8); }, 140,
                                             rel);
        check_multi_head<MovingAverageCache<float>>(layout, [=](Index) { return MovingAverageCache<float>(d, dv, 10); },
                                                    60, rel);
        check_multi_head<LinearAttentionMemory<float>>(
            layout, [=](Index) { return LinearAttentionMemory<float>(d, dv); }, 60, rel);
    }
}

TEST_CASE("MultiHead splits long memories and still equals the per-head attends", "[layer][memory][split]") {
    // Past MultiHead::split_keys pairs: pieces merged in order.
    const HeadLayout layout{4, 2, 8, 8};
    const Index n = 2 * MultiHead<KVCache<float>>::split_keys + 300;
    MultiHead<KVCache<float>> kv(layout, [](Index) { return KVCache<float>(8, 8); });
    MultiHead<SlidingWindowCache<float>> window(layout, [](Index) { return SlidingWindowCache<float>(8, 8, n, 4); });
    const Matrix<float> K = random_matrix<float>(n, 16, 61), V = random_matrix<float>(n, 16, 62);
    extend(kv, K, V);
    extend(window, K, V);
    const Matrix<float> q = random_matrix<float>(1, 32, 63, 3.0);
    Matrix<float> a(1, 32), b(1, 32), expected(1, 32);
    kv.attend(q.row(0), a.row(0));
    window.attend(q.row(0), b.row(0));
    for (Index h = 0; h < 4; ++h)
        kv.head(h / 2).attend(q.row(0).segment(h * 8, 8), expected.row(0).segment(h * 8, 8));
    check_close(a, reference::to_double(expected), 1e-5);
    check_close(b, reference::to_double(expected), 1e-5);
}

TEST_CASE("attend_group equals g single attends", "[layer][memory]") {
    const Index g = 20;  // more than one batch of detail::group_rows
    const Matrix<float> K = random_matrix<float>(700, 8, 71), V = random_matrix<float>(700, 5, 72);
    const Matrix<float> Qg = random_matrix<float>(g, 8, 73, 2.0);
    KVCache<float> kv(8, 5);
    SlidingWindowCache<float> window(8, 5, 300, 3);
    HybridCache<float> hybrid(8, 5, 100, 4, 50);
    extend(kv, K, V);
    extend(window, K, V);
    extend(hybrid, K, V);
    const auto check = [&](const auto& mem) {
        Matrix<float> grouped(g, 5), single(g, 5);
        mem.attend_group(Qg, grouped);
        for (Index r = 0; r < g; ++r)
            mem.attend(Qg.row(r), single.row(r));
        check_close(grouped, reference::to_double(single), 1e-5);
    };
    check(kv);
    check(window);
    check(hybrid);
    // The linear family: the state read once for the group, one product.
    LinearAttentionMemory<float> linear(8, 5);
    LinearAttentionMemory<float, Taylor2> taylor(8, 5);                        // d' = 45
    LinearAttentionMemory<float, Taylor2> wide(130, 5);                         // d' past the stack buffer
    GatedLinearAttentionMemory<float> gated(8, 5, GateKind::channel);
    DeltaRuleMemory<float> delta(8, 5, {.qk_l2norm = true}, true);
    extend(linear, K, V);
    extend(taylor, K, V);
    Matrix<float> gate_keys(700, 16), delta_keys(700, 10);
    gate_keys << K, (random_matrix<float>(700, 8, 74).array() * 0.05f - 0.05f).matrix();
    delta_keys << K, Matrix<float>::Constant(700, 1, 0.3f), Matrix<float>::Constant(700, 1, -0.01f);
    extend(gated, gate_keys, V);
    extend(delta, delta_keys, V);
    extend(wide, random_matrix<float>(50, 130, 75), V.topRows(50));
    check(linear);
    check(taylor);
    check(gated);
    check(delta);
    {
        const Matrix<float> Qw = random_matrix<float>(3, 130, 76, 0.1);
        Matrix<float> grouped(3, 5), single(3, 5);
        wide.attend_group(Qw, grouped);
        for (Index r = 0; r < 3; ++r)
            wide.attend(Qw.row(r), single.row(r));
        CHECK((grouped.array() == single.array()).all());  // one query at a time, as attend
    }
    KVCache<float> empty(8, 5);
    Matrix<float> out = Matrix<float>::Constant(g, 5, 1.0f);
    empty.attend_group(Qg, out);
    CHECK(out.isZero(0));
}

TEST_CASE("prefill_group equals g prefills, bit for bit", "[layer][memory]") {
    const Index g = 3, d = 8, dv = 5, n = 300;
    const Matrix<float> K = random_matrix<float>(n, d, 74), V = random_matrix<float>(n, dv, 75);
    const Matrix<float> Q = random_matrix<float>(n, g * d, 76, 2.0);
    const auto check = [&](auto make) {
        for (const Index before : {Index(0), Index(70)}) {  // a fresh memory and a cached prefix
            auto grouped = make();
            extend(grouped, K.topRows(before), V.topRows(before));
            Matrix<float> out(n - before, g * dv), expected(n - before, g * dv);
            grouped.prefill_group(Q.bottomRows(n - before), K.bottomRows(n - before), V.bottomRows(n - before), out);
            for (Index m = 0; m < g; ++m) {
                auto single = make();
                extend(single, K.topRows(before), V.topRows(before));
                Matrix<float> o(n - before, dv);
                prefill(single, Q.block(before, m * d, n - before, d), K.bottomRows(n - before),
                        V.bottomRows(n - before), o);
                expected.middleCols(m * dv, dv) = o;
            }
            CHECK(same_bits(out, expected));
            CHECK(grouped.length() == n);
        }
    };
    check([&] { return SlidingWindowCache<float>(d, dv, 64, 2); });
    check([&] { return LinearAttentionMemory<float>(d, dv, EluPlusOne{}, {.decay = 0.95}); });
}

// ------------------------------------------------------------------- bad input

TEST_CASE("Bad layouts and offsets throw and write nothing", "[layer][bad_input]") {
    using M = Matrix<float>;
    const std::string f = "memattn::multi_head_causal_softmax_attention";
    const M Q = random_matrix<float>(10, 32, 81), K = random_matrix<float>(10, 16, 82), V = random_matrix<float>(10, 16, 83);
    M O = M::Constant(10, 32, 5.0f);
    const auto expect_throw = [&](auto&& call, std::vector<std::string> needles) {
        bool threw = false;
        try {
            call();
        } catch (const std::invalid_argument& e) {
            threw = true;
            for (const auto& needle : needles)
                CHECK_THAT(std::string(e.what()), HasSubstring(needle));
        }
        CHECK(threw);
        CHECK(O.isConstant(5.0f, 0));
    };
    const auto softmax = [&](HeadLayout layout, VarLen batch = {}) {
        return [&, layout, batch] { multi_head_causal_softmax_attention(Q, K, V, O, layout, {}, batch); };
    };
    expect_throw(softmax({4, 3, 8}), {f, "'layout.kv_heads'", "is 3", "divisor of q_heads = 4"});
    expect_throw(softmax({4, 0, 8}), {f, "'layout.kv_heads'"});
    expect_throw(softmax({0, 1, 8}), {f, "'layout.q_heads'"});
    expect_throw(softmax({4, 2, 0}), {f, "'layout.head_dim'"});
    expect_throw(softmax({4, 2, 4}), {f, "'Q'", "10x32", "16 columns"});
    M wrong_o(10, 30);
    expect_throw([&] { multi_head_causal_softmax_attention(Q, K, V, wrong_o, HeadLayout{4, 2, 8}); },
                 {f, "'O'", "10x30", "expected 10x32"});
    const std::vector<Index> good{0, 4, 10}, decreasing{0, 6, 4, 10}, past{0, 4, 11}, late{1, 4, 10}, four{0, 2, 4, 10};
    const std::vector<Index> more_q{0, 6, 10}, k_first{0, 3, 10};
    expect_throw(softmax({4, 2, 8}, {decreasing, decreasing}), {f, "'varlen.q_offsets'", "decreases at index 2"});
    expect_throw(softmax({4, 2, 8}, {past, past}), {f, "'varlen.q_offsets'", "ends at 11", "expected 10"});
    expect_throw(softmax({4, 2, 8}, {late, late}), {f, "'varlen.q_offsets'", "starts at 1"});
    expect_throw(softmax({4, 2, 8}, {good, four}), {f, "'varlen.k_offsets'", "has 4 offsets", "expected 3"});
    expect_throw(softmax({4, 2, 8}, {good, {}}), {f, "'varlen.k_offsets'", "is empty"});
    expect_throw(softmax({4, 2, 8}, {more_q, k_first}), {f, "'varlen'", "sequence 0", "6 queries and 3 keys"});
    M shared = random_matrix<float>(10, 32, 84);
    const M before = shared;
    expect_throw([&] { multi_head_causal_softmax_attention(shared, K, V, shared, HeadLayout{4, 2, 8}); },
                 {f, "'O'", "shares memory with argument 'Q'"});
    CHECK(same_bits(shared, before));

    const std::string g = "memattn::multi_head_chunked_linear_attention";
    std::vector<LinearState<float>> states(3);
    expect_throw([&] {
        multi_head_chunked_linear_attention(Q, K, V, O, HeadLayout{4, 2, 8}, EluPlusOne{}, {}, std::span(states));
    }, {g, "'states'", "has 3 states", "expected 0 or 2"});
    std::vector<LinearState<float>> wrong(2);
    wrong[1].mu.setZero(8, 7);
    wrong[1].nu.setZero(8);
    expect_throw([&] {
        multi_head_chunked_linear_attention(Q, K, V, O, HeadLayout{4, 2, 8}, EluPlusOne{}, {}, std::span(wrong));
    }, {g, "'states[1].mu'", "8x7", "8x8"});
    const M K12 = random_matrix<float>(12, 16, 85), V12 = random_matrix<float>(12, 16, 86);
    const std::vector<Index> q_split{0, 4, 10}, k_split{0, 5, 12};
    expect_throw([&] {
        multi_head_chunked_linear_attention(Q, K12, V12, O, HeadLayout{4, 2, 8}, EluPlusOne{}, {}, {},
                                            VarLen{q_split, k_split});
    }, {g, "'varlen'", "sequence 0 4 queries and 5 keys", "expected as many keys as queries"});
    expect_throw([&] { multi_head_chunked_linear_attention(Q, K12, V12, O, HeadLayout{4, 2, 8}); },
                 {g, "'K'", "has 12 rows, expected 10"});
}

TEST_CASE("MultiHead: bad rows and bad factories throw, the memory unchanged", "[layer][bad_input][memory]") {
    const HeadLayout layout{4, 2, 8};
    MultiHead<KVCache<float>> mem(layout, [](Index) { return KVCache<float>(8, 8); });
    extend(mem, random_matrix<float>(5, 16, 91), random_matrix<float>(5, 16, 92));
    const Matrix<float> q = random_matrix<float>(1, 32, 93);
    Matrix<float> before(1, 32), after(1, 32);
    mem.attend(q.row(0), before.row(0));
    const auto expect_throw = [](auto&& call, const std::string& needle) {
        bool threw = false;
        try {
            call();
        } catch (const std::invalid_argument& e) {
            threw = true;
            CHECK_THAT(std::string(e.what()), HasSubstring(needle));
        }
        CHECK(threw);
    };
    const Matrix<float> wide = random_matrix<float>(3, 17, 94), right = random_matrix<float>(3, 16, 95);
    expect_throw([&] { mem.update(wide.row(0), right.row(0)); }, "memattn::MultiHead::update: argument 'key'");
    expect_throw([&] { extend(mem, right, wide); }, "'V'");
    Matrix<float> o(3, 32);
    expect_throw([&] { prefill(mem, random_matrix<float>(3, 16, 96), right, right, o); },
                 "expected 32 columns (the memory's query_dim)");
    expect_throw([&] { decode(mem, random_matrix<float>(3, 32, 97), right, right, Matrix<float>(3, 16)); },
                 "(Q's rows x the memory's output_dim)");
    Matrix<float> narrow(1, 16);
    expect_throw([&] { mem.attend(q.row(0), narrow.row(0)); }, "memattn::MultiHead::attend: argument 'out'");
    CHECK(mem.length() == 5);
    mem.attend(q.row(0), after.row(0));
    CHECK(same_bits(before, after));
    expect_throw([] { MultiHead<KVCache<float>>(HeadLayout{4, 2, 8}, [](Index h) { return KVCache<float>(8, h == 1 ? 4 : 8); }); },
                 "memattn::MultiHead: argument 'make(1)' has value_dim 4, expected the layout's value_dim 8");
    expect_throw([] { MultiHead<KVCache<float>>(HeadLayout{3, 2, 8}, [](Index) { return KVCache<float>(8, 8); }); },
                 "'layout.kv_heads'");
}
