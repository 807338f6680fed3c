// The logit options of SoftmaxOptions (kernels/softmax_options.hpp) in the tiled kernel:
// softcap, ALiBi, learned sink logits, non-causal and cross attention, alone and combined
// with windows and sink tokens, against the double reference that materialises the
// scores; per head in the multi-head layer and varlen; the options that change nothing
// bit for bit the plain kernel; bad options refused.

#include "support.hpp"

#include <memattn/kernels/causal_softmax.hpp>
#include <memattn/layer/multi_head_kernels.hpp>
#include <memattn/layer/multi_head_memory.hpp>
#include <memattn/memory/kv_cache.hpp>
#include <memattn/memory/sliding_window_cache.hpp>
#include <memattn/memory/sparse_kv_cache.hpp>
#include <memattn/serving/paged_kv_cache.hpp>

#include <cmath>
#include <limits>
#include <vector>

using namespace memattn;
using namespace memattn::test;

namespace {

struct Case {
    double softcap = 0;
    std::optional<double> slope = {}, sink = {};
    bool causal = true;
    Index window = 0, sink_tokens = 0;
};

/// One head: the kernel with the case's options against the reference, O and lse.
template <class T>
void check_case(const Case& c, Index nq, Index nk, Index d, double tolerance) {
    const Matrix<T> Q = random_matrix<T>(nq, d, 1, 2.0), K = random_matrix<T>(nk, d, 2, 2.0),
                    V = random_matrix<T>(nk, d + 3, 3);
    const double slope = c.slope.value_or(0), sink = c.sink.value_or(0);
    SoftmaxOptions options{.window = c.window, .sink_tokens = c.sink_tokens, .softcap = c.softcap, .causal = c.causal};
    if (c.slope)
        options.alibi_slopes = std::span<const double>(&slope, 1);
    if (c.sink)
        options.sink_logits = std::span<const double>(&sink, 1);
    Matrix<T> O(nq, d + 3);
    Vector<T> lse(nq);
    causal_softmax_attention(Q, K, V, O, lse, options);
    const reference::SoftmaxResult expected = reference::softmax_attention(
        Q.template cast<double>(), K.template cast<double>(), V.template cast<double>(),
        reference::Logits{.window = c.window, .sink_tokens = c.sink_tokens, .softcap = c.softcap, .causal = c.causal,
                          .slope = c.slope, .sink = c.sink});
    check_close(O, expected.out, tolerance);
    for (Index i = 0; i < nq; ++i) {
        const double want = expected.lse[static_cast<std::size_t>(i)];
        if (std::isinf(want))
            CHECK(std::isinf(static_cast<double>(lse(i))));
        else
            CHECK(static_cast<double>(lse(i)) == Approx(want).epsilon(tolerance).margin(tolerance));
    }
}

}  // namespace

TEMPLATE_TEST_CASE("SoftmaxOptions: softcap, ALiBi, sink logits and non-causal attention equal the materialised "
                   "reference, alone and combined with windows and sink tokens",
                   "[softmax][options]", float, double) {
    using T = TestType;
    const double tolerance = std::is_same_v<T, float> ? 2e-5 : 1e-11;
    const std::vector<Case> cases{
        {.softcap = 5},
        {.softcap = 0.7},
        {.slope = 0.125},
        {.slope = 0.0078125, .window = 40},
        {.sink = 0.5},
        {.sink = 8},  // above every logit: the outputs shrink towards 0
        {.sink = -30},
        {.causal = false},
        {.causal = false, .window = 17},
        {.causal = false, .window = 9, .sink_tokens = 20},  // sinks past some queries' windows, both ways
        {.softcap = 3, .slope = 0.25, .sink = 1, .window = 33, .sink_tokens = 4},
        {.softcap = 2, .slope = 0.03, .sink = -1, .causal = false, .window = 50, .sink_tokens = 3},
        {.window = 25, .sink_tokens = 7},
    };
    for (std::size_t k = 0; k < cases.size(); ++k)
        for (const auto& [nq, nk] : {std::pair<Index, Index>{0, 0}, {1, 1}, {1, 300}, {37, 37}, {200, 250},
                                     {130, 400}, {300, 300}})
            for (const Index d : {1, 16, 64}) {
                INFO("case " << k << ", Nq = " << nq << ", Nk = " << nk << ", d = " << d);
                check_case<T>(cases[k], nq, nk, d, tolerance);
            }
}

TEMPLATE_TEST_CASE("SoftmaxOptions: non-causal cross attention takes any Nq and Nk", "[softmax][options]", float,
                   double) {
    using T = TestType;
    const double tolerance = std::is_same_v<T, float> ? 2e-5 : 1e-11;
    for (const auto& [nq, nk] : {std::pair<Index, Index>{300, 7}, {1, 0}, {5, 1}, {250, 600}, {401, 200}})
        for (const Case& c : {Case{.causal = false}, Case{.softcap = 4, .sink = 0.3, .causal = false},
                              Case{.slope = 0.05, .causal = false, .window = 64, .sink_tokens = 2}}) {
            INFO("Nq = " << nq << ", Nk = " << nk << ", window " << c.window);
            check_case<T>(c, nq, nk, 32, tolerance);
        }
    // Causal queries still continue the keys.
    const Matrix<T> Q = random_matrix<T>(5, 8, 4), K = random_matrix<T>(4, 8, 5);
    Matrix<T> O(5, 8);
    CHECK_THROWS_AS(causal_softmax_attention(Q, K, K, O), std::invalid_argument);
}

TEST_CASE("SoftmaxOptions: options that change nothing give the plain kernel's bits", "[softmax][options]") {
    const Matrix<float> Q = random_matrix<float>(333, 64, 11, 2.0), K = random_matrix<float>(333, 64, 12, 2.0),
                        V = random_matrix<float>(333, 64, 13);
    Matrix<float> plain(333, 64), other(333, 64);
    for (const Index window : {Index{0}, Index{100}}) {
        const SoftmaxOptions base{.window = window, .sink_tokens = 3};
        causal_softmax_attention(Q, K, V, plain, base);
        const double zero = 0, none = -std::numeric_limits<double>::infinity();
        SoftmaxOptions slope_zero = base, no_sink = base;
        slope_zero.alibi_slopes = std::span<const double>(&zero, 1);  // s − 0·|p − j| is s
        no_sink.sink_logits = std::span<const double>(&none, 1);      // e^−∞ adds nothing
        for (const SoftmaxOptions& same : {slope_zero, no_sink}) {
            causal_softmax_attention(Q, K, V, other, same);
            CHECK((plain.array() == other.array()).all());
        }
    }
    // The last query alone sees every key either way: non-causal is causal there.
    Matrix<float> last(1, 64), both(1, 64);
    causal_softmax_attention(Q.bottomRows(1), K, V, last);
    causal_softmax_attention(Q.bottomRows(1), K, V, both, SoftmaxOptions{.causal = false});
    CHECK((last.array() == both.array()).all());
}

TEST_CASE("SoftmaxOptions: learned sink logits follow gpt-oss and ONNX Runtime's head_sink", "[softmax][options]") {
    // o = Σ_j e^{s_j} v_j / (e^σ + Σ_j e^{s_j}): a softmax over the logits and σ whose σ
    // column is dropped. Checked on one query by hand.
    const Matrix<double> q{{1.0, 0.0}}, K{{1.0, 0.0}, {0.0, 1.0}}, V{{2.0}, {4.0}};
    const double sigma = 0.25;
    Matrix<double> o(1, 1);
    Vector<double> lse(1);
    causal_softmax_attention(q, K, V, o, lse,
                             SoftmaxOptions{.scale = 1, .causal = false,
                                            .sink_logits = std::span<const double>(&sigma, 1)});
    const double e0 = std::exp(1.0), e1 = std::exp(0.0), es = std::exp(sigma);
    CHECK(o(0, 0) == Approx((2 * e0 + 4 * e1) / (e0 + e1 + es)).epsilon(1e-15));
    CHECK(lse(0) == Approx(std::log(e0 + e1 + es)).epsilon(1e-15));
    // A query that sees no key (a mask hides both): zero output, log-sum-exp σ.
    const Eigen::Matrix<bool, 1, 2, Eigen::RowMajor> hidden(false, false);
    Matrix<double> none = Matrix<double>::Constant(1, 1, 9);
    causal_softmax_attention(q, K, V, none,
                             SoftmaxOptions{.scale = 1, .causal = false,
                                            .sink_logits = std::span<const double>(&sigma, 1)},
                             hidden);
    CHECK(none(0, 0) == 0);
    // The empty state and a sink: log-sum-exp σ, output 0.
    SoftmaxState<double> state;
    Matrix<double> acc = Matrix<double>::Zero(1, 1);
    state.add_sink(sigma, acc);
    CHECK(state.log_sum_exp() == sigma);
    state.finish(acc);
    CHECK(acc(0, 0) == 0);
}

TEST_CASE("SoftmaxOptions: the multi-head layer gives each query head its own sink logit and slope, varlen and "
          "non-causal included, the same bits on any thread count",
          "[softmax][options][multi_head]") {
    const HeadLayout layout{8, 2, 16, 0};
    const Index q_heads = 8;
    std::vector<double> slopes, sinks;
    for (Index h = 0; h < q_heads; ++h) {
        slopes.push_back(std::pow(2.0, -8.0 * static_cast<double>(h + 1) / static_cast<double>(q_heads)));  // ALiBi's
        sinks.push_back(0.3 * static_cast<double>(h) - 1);
    }
    const Matrix<float> Q = random_matrix<float>(230, 128, 21, 2.0), K = random_matrix<float>(260, 32, 22, 2.0),
                        V = random_matrix<float>(260, 32, 23);
    const std::vector<Index> q_all{0, 100, 100, 230}, k_all{0, 90, 120, 260};  // Nq > Nk in the first: non-causal only
    const std::vector<Index> q_causal{0, 100, 130}, k_causal{0, 120, 260};
    const VarLen batch{q_all, k_all};
    for (const bool causal : {true, false}) {
        const SoftmaxOptions options{.window = 50, .sink_tokens = 2, .softcap = 6, .causal = causal,
                                     .sink_logits = sinks, .alibi_slopes = slopes};
        const VarLen used = causal ? VarLen{q_causal, k_causal} : batch;
        const Index rows = used.q_offsets.back();
        Matrix<float> O(rows, 128), again(rows, 128);
        multi_head_causal_softmax_attention(Q.topRows(rows), K, V, O, layout, options, used, OpenMPExecutor{.threads = 1});
        multi_head_causal_softmax_attention(Q.topRows(rows), K, V, again, layout, options, used,
                                            OpenMPExecutor{.threads = 2});
        CHECK((O.array() == again.array()).all());
        for (std::size_t b = 0; b + 1 < used.q_offsets.size(); ++b) {
            const Index q0 = used.q_offsets[b], nq = used.q_offsets[b + 1] - q0;
            const Index k0 = used.k_offsets[b], nk = used.k_offsets[b + 1] - k0;
            for (Index h = 0; h < q_heads; ++h) {
                INFO("causal " << causal << ", sequence " << b << ", head " << h);
                const Index kv = h / 4;
                // The head alone through the single-head kernel: the same bits.
                Matrix<float> one(nq, 16);
                causal_softmax_attention(Q.block(q0, h * 16, nq, 16), K.block(k0, kv * 16, nk, 16),
                                         V.block(k0, kv * 16, nk, 16), one, detail::head_options(options, h));
                CHECK((one.array() == O.block(q0, h * 16, nq, 16).array()).all());
                const reference::SoftmaxResult expected = reference::softmax_attention(
                    Q.block(q0, h * 16, nq, 16).cast<double>(), K.block(k0, kv * 16, nk, 16).cast<double>(),
                    V.block(k0, kv * 16, nk, 16).cast<double>(),
                    reference::Logits{.window = 50, .sink_tokens = 2, .softcap = 6, .causal = causal,
                                      .slope = slopes[static_cast<std::size_t>(h)],
                                      .sink = sinks[static_cast<std::size_t>(h)]});
                check_close(one, expected.out, 2e-5);
            }
        }
    }
}

TEST_CASE("SoftmaxOptions: bad options throw std::invalid_argument naming them, O unchanged", "[softmax][options][bad_input]") {
    const Matrix<float> Q = random_matrix<float>(4, 8, 31), K = random_matrix<float>(4, 8, 32);
    Matrix<float> O = Matrix<float>::Constant(4, 8, 7);
    const std::vector<double> two{0.1, 0.2}, nan{std::nan("")}, inf{std::numeric_limits<double>::infinity()};
    const auto refused = [&](const SoftmaxOptions& options, const char* name) {
        INFO(name);
        CHECK_THROWS_WITH(causal_softmax_attention(Q, K, K, O, options), Catch::Contains(name));
        CHECK((O.array() == 7).all());
    };
    refused(SoftmaxOptions{.softcap = -1}, "options.softcap");
    refused(SoftmaxOptions{.softcap = std::nan("")}, "options.softcap");
    refused(SoftmaxOptions{.sink_logits = two}, "options.sink_logits");  // two values for one head
    refused(SoftmaxOptions{.sink_logits = nan}, "options.sink_logits");
    refused(SoftmaxOptions{.sink_logits = inf}, "options.sink_logits");  // +∞ would swallow every output
    refused(SoftmaxOptions{.alibi_slopes = two}, "options.alibi_slopes");
    refused(SoftmaxOptions{.alibi_slopes = inf}, "options.alibi_slopes");
    // A layer of 8 query heads wants 8 values.
    const HeadLayout layout{8, 2, 4, 0};
    Matrix<float> Ol = Matrix<float>::Constant(4, 32, 7);
    CHECK_THROWS_WITH(multi_head_causal_softmax_attention(random_matrix<float>(4, 32, 33), K, K, Ol, layout,
                                                          SoftmaxOptions{.alibi_slopes = two}),
                      Catch::Contains("options.alibi_slopes") && Catch::Contains("one per query head"));
    CHECK((Ol.array() == 7).all());
}

TEMPLATE_TEST_CASE("Dense biases and masks: any Eigen expression, against the reference, combined with the other "
                   "options; wholly masked tiles skipped",
                   "[softmax][options][mask]", float, double) {
    using T = TestType;
    const double tolerance = std::is_same_v<T, float> ? 2e-5 : 1e-11;
    for (const auto& [nq, nk] : {std::pair<Index, Index>{1, 1}, {37, 37}, {200, 450}, {300, 300}}) {
        const Matrix<T> Q = random_matrix<T>(nq, 32, 41, 2.0), K = random_matrix<T>(nk, 32, 42, 2.0),
                        V = random_matrix<T>(nk, 24, 43);
        const Matrix<T> B = random_matrix<T>(nq, nk, 44, 3.0);
        // A mask that keeps every fifth key and, for each query, the keys far from it:
        // whole key tiles of it are empty for a query tile.
        Matrix<bool> M(nq, nk);
        for (Index i = 0; i < nq; ++i)
            for (Index j = 0; j < nk; ++j)
                M(i, j) = j % 5 == 0 || (j > 200 && (i + j) % 3 == 0) || j == nk - nq + i;
        const double slope = 0.02;
        for (const SoftmaxOptions& base :
             {SoftmaxOptions{}, SoftmaxOptions{.window = 64, .sink_tokens = 2, .softcap = 5,
                                               .alibi_slopes = std::span<const double>(&slope, 1)},
              SoftmaxOptions{.causal = false}}) {
            INFO("Nq = " << nq << ", Nk = " << nk << ", window " << base.window << ", causal " << base.causal);
            reference::Logits logits{.window = base.window, .sink_tokens = base.sink_tokens, .softcap = base.softcap,
                                     .causal = base.causal};
            if (!base.alibi_slopes.empty())
                logits.slope = slope;
            const MatrixD Qd = Q.template cast<double>(), Kd = K.template cast<double>(), Vd = V.template cast<double>();
            // Additive, as an expression (0.5·B, never copied by the caller).
            Matrix<T> O(nq, 24);
            causal_softmax_attention(Q, K, V, O, base, T(0.5) * B);
            const MatrixD half = 0.5 * B.template cast<double>();
            logits.bias = &half;
            check_close(O, reference::softmax_attention(Qd, Kd, Vd, logits).out, tolerance);
            // Boolean.
            causal_softmax_attention(Q, K, V, O, base, M);
            MatrixD masked = MatrixD::Zero(nq, nk);
            for (Index i = 0; i < nq; ++i)
                for (Index j = 0; j < nk; ++j)
                    if (!M(i, j))
                        masked(i, j) = -std::numeric_limits<double>::infinity();
            logits.bias = &masked;
            check_close(O, reference::softmax_attention(Qd, Kd, Vd, logits).out, tolerance);
            // A bias of −∞ where the mask is false: the same bits as the mask.
            const Matrix<T> as_bias = masked.cast<T>();
            Matrix<T> again(nq, 24);
            causal_softmax_attention(Q, K, V, again, base, as_bias);
            CHECK((again.array() == O.array()).all());
        }
        // An infinite value under the mask reaches no query.
        Matrix<T> Vbad = V;
        Matrix<bool> hide = Matrix<bool>::Constant(nq, nk, true);
        hide.col(0).setConstant(false);
        Vbad(0, 3) = std::numeric_limits<T>::infinity();
        Matrix<T> O(nq, 24);
        causal_softmax_attention(Q, K, Vbad, O, SoftmaxOptions{.causal = false}, hide);
        CHECK(O.allFinite());
        // A key whose logits are NaN under the mask's −∞ is hidden as well.
        Matrix<T> Kbad = K, clean(nq, 24);
        Kbad.row(0).setConstant(std::numeric_limits<T>::quiet_NaN());
        causal_softmax_attention(Q, Kbad, V, O, SoftmaxOptions{.causal = false}, hide);
        causal_softmax_attention(Q, K, V, clean, SoftmaxOptions{.causal = false}, hide);
        CHECK((O.array() == clean.array()).all());
    }
}

TEMPLATE_TEST_CASE("Tree masks: the verify step of speculative decoding equals the dense mask it stands for, bit "
                   "for bit, and the reference",
                   "[softmax][options][tree]", float, double) {
    using T = TestType;
    const double tolerance = std::is_same_v<T, float> ? 2e-5 : 1e-11;
    // Trees of draft tokens: a chain, a star, a binary tree, two roots; 64 drafts over a
    // cache of 4096 and small ones.
    std::vector<std::vector<Index>> trees{{-1}, {-1, 0, 1, 2, 3}, {-1, 0, 0, 0, 0, 0}, {-1, -1, 0, 1, 2, 2}};
    std::vector<Index> binary{-1};
    for (Index i = 1; i < 64; ++i)
        binary.push_back((i - 1) / 2);
    trees.push_back(binary);
    for (const std::vector<Index>& parents : trees)
        for (const Index past : {Index{0}, Index{5}, Index{300}, Index{4096}}) {
            const Index n = static_cast<Index>(parents.size()), nk = past + n;
            INFO(n << " drafts over " << past << " cached tokens");
            const Matrix<T> Q = random_matrix<T>(n, 64, 51, 2.0), K = random_matrix<T>(nk, 64, 52, 2.0),
                            V = random_matrix<T>(nk, 64, 53);
            const double sink = 0.5;
            SoftmaxOptions options{.softcap = 20, .sink_logits = std::span<const double>(&sink, 1), .parents = parents};
            Matrix<T> O(n, 64), dense(n, 64);
            causal_softmax_attention(Q, K, V, O, options);
            const MatrixD bias = reference::tree_bias(parents, nk);
            options.parents = {};
            causal_softmax_attention(Q, K, V, dense, options, bias.template cast<T>());
            CHECK((O.array() == dense.array()).all());
            check_close(O,
                        reference::softmax_attention(Q.template cast<double>(), K.template cast<double>(),
                                                     V.template cast<double>(),
                                                     reference::Logits{.softcap = 20, .sink = sink, .bias = &bias})
                            .out,
                        tolerance);
        }
}

namespace {

/// A tree of n drafts with long chains and branches (depths well past a small window):
/// each draft's parent the one before it, or now and then any earlier draft or none.
std::vector<Index> branchy_tree(Index n, unsigned seed) {
    std::mt19937 rng(seed);
    std::vector<Index> parents(static_cast<std::size_t>(n));
    for (Index i = 0; i < n; ++i) {
        const unsigned roll = rng() % 8;
        parents[static_cast<std::size_t>(i)] =
            i == 0 || roll == 0 ? -1 : roll <= 2 ? static_cast<Index>(rng() % static_cast<unsigned>(i)) : i - 1;
    }
    return parents;
}

}  // namespace

TEMPLATE_TEST_CASE("Tree masks with a window, sinks and ALiBi: each draft at the position its depth gives, as its "
                   "path decoded token by token; a chain is a prompt bit for bit",
                   "[softmax][options][tree]", float, double) {
    using T = TestType;
    const double tolerance = std::is_same_v<T, float> ? 3e-5 : 1e-11;
    std::vector<std::vector<Index>> trees{{-1}, {-1, 0, 0, 0, 0, 0}, {-1, -1, 0, 1, 2, 2}, branchy_tree(150, 5)};
    std::vector<Index> binary{-1};
    for (Index i = 1; i < 64; ++i)
        binary.push_back((i - 1) / 2);
    trees.push_back(binary);
    const double slope = 0.07, sink = 0.5;
    const std::span<const double> one_slope(&slope, 1), one_sink(&sink, 1);
    struct Variant {
        Index window, sinks;
        bool alibi, softcap;
    };
    for (const Variant& v : {Variant{40, 4, false, false}, Variant{7, 0, true, false}, Variant{0, 0, true, true},
                             Variant{100, 2, true, true}, Variant{1, 3, false, false}})
        for (const std::vector<Index>& parents : trees)
            for (const Index past : {Index{0}, Index{2}, Index{300}, Index{1000}}) {
                const Index n = static_cast<Index>(parents.size()), nk = past + n;
                INFO("window " << v.window << ", sinks " << v.sinks << ", ALiBi " << v.alibi << ": " << n
                               << " drafts over " << past << " cached tokens");
                const Matrix<T> Q = random_matrix<T>(n, 32, 71, 2.0), V = random_matrix<T>(nk, 24, 73);
                Matrix<T> K = random_matrix<T>(nk, 32, 72, 2.0);
                SoftmaxOptions options{.window = v.window, .sink_tokens = v.sinks, .softcap = v.softcap ? 20.0 : 0.0,
                                       .sink_logits = one_sink, .parents = parents};
                if (v.alibi)
                    options.alibi_slopes = one_slope;
                // Cached keys no draft sees (outside every window, not sinks) poison nothing,
                // though the kernel's tiles reach some of them: NaN there.
                if (v.window > 0)
                    for (Index j = v.sinks; j < std::max<Index>(v.sinks, past - v.window + 1); ++j)
                        K.row(j).setConstant(std::numeric_limits<T>::quiet_NaN());
                Matrix<T> O(n, 24);
                causal_softmax_attention(Q, K, V, O, options);
                const reference::Logits logits{.window = v.window,
                                               .sink_tokens = v.sinks,
                                               .softcap = v.softcap ? 20.0 : 0.0,
                                               .slope = v.alibi ? std::optional<double>(slope) : std::nullopt,
                                               .sink = sink};
                check_close(O,
                            reference::tree_path_attention(Q.template cast<double>(), K.template cast<double>(),
                                                           V.template cast<double>(), parents, logits),
                            tolerance);
            }
    // A chain is a prompt: the same call without parents, bit for bit.
    for (const Variant& v : {Variant{40, 4, true, true}, Variant{7, 0, true, false}, Variant{0, 0, true, false}})
        for (const Index past : {Index{0}, Index{300}}) {
            const Index n = 200, nk = past + n;
            std::vector<Index> chain(static_cast<std::size_t>(n));
            for (Index i = 0; i < n; ++i)
                chain[static_cast<std::size_t>(i)] = i - 1;
            const Matrix<T> Q = random_matrix<T>(n, 32, 74, 2.0), K = random_matrix<T>(nk, 32, 75, 2.0),
                            V = random_matrix<T>(nk, 24, 76);
            SoftmaxOptions prompt{.window = v.window, .sink_tokens = v.sinks, .softcap = v.softcap ? 20.0 : 0.0};
            if (v.alibi)
                prompt.alibi_slopes = one_slope;
            SoftmaxOptions tree = prompt;
            tree.parents = chain;
            Matrix<T> O(n, 24), expected(n, 24);
            causal_softmax_attention(Q, K, V, O, tree);
            causal_softmax_attention(Q, K, V, expected, prompt);
            INFO("window " << v.window << " past " << past << " diff " << (O - expected).cwiseAbs().maxCoeff());
            CHECK((O.array() == expected.array()).all());
        }
}

namespace {

/// Keys or values read in place, noting every row the kernel asks for (tiles, single
/// rows, prefetches) below `watch_end` and past `watch_begin`: rows it must not read.
struct RowsRead {
    Index watch_begin = 0, watch_end = 0, touched = 0;
    void note(Index j0, Index j1) {
        if (std::max(j0, watch_begin) < std::min(j1, watch_end))
            ++touched;
    }
};
class RecordingRows {
public:
    RecordingRows(const ConstMatrixRef<float>& m, RowsRead& read) : rows_(m), read_(&read) {}
    static constexpr bool pairs = false;
    [[nodiscard]] Index rows() const noexcept { return rows_.rows(); }
    [[nodiscard]] Index cols() const noexcept { return rows_.cols(); }
    [[nodiscard]] const float* row(Index j) const {
        read_->note(j, j + 1);
        return rows_.row(j);
    }
    [[nodiscard]] Index stride() const noexcept { return rows_.stride(); }
    [[nodiscard]] std::pair<const float*, Index> tile(Index j0, Index n) const {
        read_->note(j0, j0 + n);
        return rows_.tile(j0, n);
    }
    void prefetch(Index j0, Index j1) const {
        read_->note(j0, j1);
        rows_.prefetch(j0, j1);
    }

private:
    detail::PlainRows<float> rows_;
    RowsRead* read_;
};

}  // namespace

TEST_CASE("Tree masks with a window: the kernel reads no key below every draft's window but the sinks (a windowed "
          "pool has freed them)",
          "[softmax][options][tree][window]") {
    const Index d = 16;
    for (const Index past : {Index{2}, Index{40}, Index{700}})
        for (const Index window : {Index{1}, Index{7}, Index{100}})
            for (const Index sinks : {Index{0}, Index{4}}) {
                INFO(past << " cached, window " << window << ", sinks " << sinks);
                std::vector<Index> parents{-1};  // 150 drafts, a deep chain with branches
                for (Index i = 1; i < 150; ++i)
                    parents.push_back(i % 11 == 0 ? i / 2 : i - 1);
                const Index n = static_cast<Index>(parents.size()), nk = past + n;
                const Matrix<float> Q = random_matrix<float>(n, d, 81), K = random_matrix<float>(nk, d, 82),
                                    V = random_matrix<float>(nk, d, 83);
                const double slope = 0.1;
                SoftmaxOptions options{.window = window,
                                       .sink_tokens = sinks,
                                       .alibi_slopes = std::span<const double>(&slope, 1),
                                       .parents = parents};
                // Rows past the sinks and below past − window + 1: no draft sees them.
                RowsRead read{.watch_begin = sinks, .watch_end = past - window + 1};
                Matrix<float> O(n, d), expected(n, d);
                detail::SoftmaxScratch<float> scratch(d, d, detail::default_tiles(window));
                detail::causal_softmax_rows<float>(detail::PlainRows<float>(Q), RecordingRows(K, read),
                                                   RecordingRows(V, read), MatrixRef<float>(O), [](Index, float) {},
                                                   options, scratch, detail::trailing_queries,
                                                   detail::TileBias<float>{});
                CHECK(read.touched == 0);
                causal_softmax_attention(Q, K, V, expected, options);
                CHECK((O.array() == expected.array()).all());
            }
}

TEST_CASE("Tree masks in the multi-head layer: each head as its own call, any thread count; bad trees refused",
          "[softmax][options][tree][bad_input]") {
    const HeadLayout layout{8, 2, 16, 0};
    // 150 drafts, deep chains (depth past the window of 30) with branches and new roots:
    // the layer's query tiles start mid-tree.
    const Index n = 150, nk = 600;
    std::vector<Index> parents{-1};
    for (Index i = 1; i < n; ++i)
        parents.push_back(i % 37 == 0 ? -1 : i % 9 == 0 ? i - 5 : i - 1);
    const Matrix<float> Q = random_matrix<float>(n, 128, 61, 2.0), K = random_matrix<float>(nk, 32, 62, 2.0),
                        V = random_matrix<float>(nk, 32, 63);
    const std::vector<double> slopes{0.5, 0.25, 0.125, 0.0625, 0.03, 0.02, 0.01, 0.005};
    for (const SoftmaxOptions& options :
         {SoftmaxOptions{.parents = parents},
          SoftmaxOptions{.window = 30, .sink_tokens = 3, .alibi_slopes = slopes, .parents = parents}}) {
        INFO("window " << options.window);
        Matrix<float> O(n, 128), again(n, 128);
        multi_head_causal_softmax_attention(Q, K, V, O, layout, options, {}, OpenMPExecutor{.threads = 1});
        multi_head_causal_softmax_attention(Q, K, V, again, layout, options, {}, OpenMPExecutor{.threads = 2});
        CHECK((O.array() == again.array()).all());
        for (Index h = 0; h < 8; ++h) {
            Matrix<float> one(n, 16);
            const SoftmaxOptions head = detail::head_options(options, h);
            causal_softmax_attention(Q.middleCols(h * 16, 16), K.middleCols(h / 4 * 16, 16),
                                     V.middleCols(h / 4 * 16, 16), one, head);
            CHECK((one.array() == O.middleCols(h * 16, 16).array()).all());
            reference::Logits logits{.window = options.window, .sink_tokens = options.sink_tokens};
            if (!head.alibi_slopes.empty())
                logits.slope = head.alibi_slopes[0];
            check_close(O.middleCols(h * 16, 16),
                        reference::tree_path_attention(Q.middleCols(h * 16, 16).cast<double>(),
                                                       K.middleCols(h / 4 * 16, 16).cast<double>(),
                                                       V.middleCols(h / 4 * 16, 16).cast<double>(), parents, logits),
                        3e-5);
        }
    }
    // Bad trees and combinations: refused by name, O unchanged.
    Matrix<float> out = Matrix<float>::Constant(3, 16, 7);
    const Matrix<float> q = Q.topRows(3).leftCols(16), k = K.topRows(10).leftCols(16);
    const std::vector<Index> forward{-1, 2, 1}, short_tree{-1, 0}, fine{-1, 0, 0};
    const auto refused = [&](const SoftmaxOptions& bad, const char* what) {
        INFO(what);
        CHECK_THROWS_WITH(causal_softmax_attention(q, k, k, out, bad), Catch::Contains("options.parents"));
        CHECK((out.array() == 7).all());
    };
    refused(SoftmaxOptions{.parents = forward}, "a parent after its child");
    refused(SoftmaxOptions{.parents = short_tree}, "two parents for three queries");
    refused(SoftmaxOptions{.causal = false, .parents = fine}, "non-causal");
    CHECK_THROWS_WITH(causal_softmax_attention(q, k, k, out, SoftmaxOptions{.parents = fine}, Matrix<float>::Zero(3, 10)),
                      Catch::Contains("bias"));
}

TEST_CASE("Dense biases in the multi-head layer: every head adds the same bias, as its own call would",
          "[softmax][options][mask][multi_head]") {
    const HeadLayout layout{8, 2, 16, 0};
    const Matrix<float> Q = random_matrix<float>(230, 128, 71, 2.0), K = random_matrix<float>(260, 32, 72, 2.0),
                        V = random_matrix<float>(260, 32, 73);
    const Matrix<float> B = random_matrix<float>(230, 260, 74, 2.0);
    Matrix<bool> M(230, 260);
    for (Index i = 0; i < 230; ++i)
        for (Index j = 0; j < 260; ++j)
            M(i, j) = (i * 7 + j * 3) % 5 != 0;
    const double sink = 0.3;
    const std::vector<double> sinks(8, sink);
    const SoftmaxOptions options{.window = 90, .sink_tokens = 1, .softcap = 7, .sink_logits = sinks};
    Matrix<float> O(230, 128), with_mask(230, 128), two(230, 128);
    multi_head_causal_softmax_attention(Q, K, V, O, layout, options, B, OpenMPExecutor{.threads = 1});
    multi_head_causal_softmax_attention(Q, K, V, two, layout, options, B, OpenMPExecutor{.threads = 2});
    CHECK((O.array() == two.array()).all());
    multi_head_causal_softmax_attention(Q, K, V, with_mask, layout, options, M);
    for (Index h = 0; h < 8; ++h) {
        INFO("head " << h);
        Matrix<float> one(230, 16);
        causal_softmax_attention(Q.middleCols(h * 16, 16), K.middleCols(h / 4 * 16, 16), V.middleCols(h / 4 * 16, 16),
                                 one, detail::head_options(options, h), B);
        CHECK((one.array() == O.middleCols(h * 16, 16).array()).all());
        causal_softmax_attention(Q.middleCols(h * 16, 16), K.middleCols(h / 4 * 16, 16), V.middleCols(h / 4 * 16, 16),
                                 one, detail::head_options(options, h), M);
        CHECK((one.array() == with_mask.middleCols(h * 16, 16).array()).all());
    }
    Matrix<float> untouched = Matrix<float>::Constant(230, 128, 7);
    CHECK_THROWS_WITH(multi_head_causal_softmax_attention(Q, K, V, untouched, layout, options, B.leftCols(259)),
                      Catch::Contains("bias"));
    CHECK((untouched.array() == 7).all());
}

TEST_CASE("Dense biases in the multi-head layer: one per query head, stacked, each head its own call's bits",
          "[softmax][options][mask][multi_head]") {
    const HeadLayout layout{6, 3, 16, 0};
    const Index nq = 150, nk = 190, heads = layout.q_heads;
    const Matrix<float> Q = random_matrix<float>(nq, heads * 16, 81, 2.0), K = random_matrix<float>(nk, 48, 82, 2.0),
                        V = random_matrix<float>(nk, 48, 83);
    const Matrix<float> B = random_matrix<float>(heads * nq, nk, 84, 2.0);
    Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> M(heads * nq, nk);
    for (Index i = 0; i < heads * nq; ++i)
        for (Index j = 0; j < nk; ++j)
            M(i, j) = (i * 5 + j * 11) % 7 != 0 && !(i / nq == 2 && j < 64);  // head 2 also masks its first 64 keys
    const SoftmaxOptions options{.window = 70, .softcap = 5};
    Matrix<float> O(nq, heads * 16), two(nq, heads * 16), masked(nq, heads * 16);
    multi_head_causal_softmax_attention(Q, K, V, O, layout, options, B, OpenMPExecutor{.threads = 1});
    multi_head_causal_softmax_attention(Q, K, V, two, layout, options, B, OpenMPExecutor{.threads = 2});
    CHECK((O.array() == two.array()).all());
    multi_head_causal_softmax_attention(Q, K, V, masked, layout, options, M);
    for (Index h = 0; h < heads; ++h) {
        INFO("head " << h);
        const Index kv = layout.kv_head_of(h);
        Matrix<float> one(nq, 16);
        causal_softmax_attention(Q.middleCols(h * 16, 16), K.middleCols(kv * 16, 16), V.middleCols(kv * 16, 16), one,
                                 options, B.middleRows(h * nq, nq));
        CHECK((one.array() == O.middleCols(h * 16, 16).array()).all());
        causal_softmax_attention(Q.middleCols(h * 16, 16), K.middleCols(kv * 16, 16), V.middleCols(kv * 16, 16), one,
                                 options, M.middleRows(h * nq, nq));
        CHECK((one.array() == masked.middleCols(h * 16, 16).array()).all());
    }
    Matrix<float> untouched = Matrix<float>::Constant(nq, heads * 16, 7);
    CHECK_THROWS_WITH(multi_head_causal_softmax_attention(Q, K, V, untouched, layout, options, B.topRows(2 * nq)),
                      Catch::Contains("bias") && Catch::Contains("one per query head"));
    CHECK((untouched.array() == 7).all());
}

TEST_CASE("Dense biases: a row of a column-major matrix (strided in place) gives a copy's bits", "[softmax][options][mask]") {
    const Index nk = 300, d = 16;
    const Matrix<float> q = random_matrix<float>(1, d, 91), K = random_matrix<float>(nk, d, 92),
                        V = random_matrix<float>(nk, d, 93);
    const Eigen::MatrixXf column_major = random_matrix<float>(nk + 5, nk, 94);  // rows t .. t + nk read past row t otherwise
    Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic> column_mask(nk, nk);
    for (Index i = 0; i < nk; ++i)
        for (Index j = 0; j < nk; ++j)
            column_mask(i, j) = (i + 3 * j) % 4 != 0;
    Matrix<float> strided(1, d), copied(1, d);
    const SoftmaxOptions options{.causal = false};
    causal_softmax_attention(q, K, V, strided, options, column_major.row(4));
    causal_softmax_attention(q, K, V, copied, options, Matrix<float>(column_major.row(4)));
    CHECK((strided.array() == copied.array()).all());
    causal_softmax_attention(q, K, V, strided, options, column_mask.row(7));
    const Eigen::Matrix<bool, 1, Eigen::Dynamic, Eigen::RowMajor> mask_row = column_mask.row(7);
    causal_softmax_attention(q, K, V, copied, options, mask_row);
    CHECK((strided.array() == copied.array()).all());
}

TEST_CASE("FpMath::bf16: float inputs rounded to bfloat16 for the products, bit for bit the kernel on the rounded "
          "inputs, with every option; near float's; refused for double and by the pool",
          "[softmax][options][fpmath]") {
    using E = Eigen::bfloat16;
    const double one_sink[1] = {0.4}, one_slope[1] = {0.03};
    for (const Index n : {1, 37, 300})
        for (const Index d : {1, 64, 67}) {
            INFO("n = " << n << ", d = " << d);
            const Index dv = 24;
            const Matrix<float> Q = random_matrix<float>(n, d, 61), K = random_matrix<float>(n, d, 62),
                                V = random_matrix<float>(n, dv, 63);
            const Matrix<E> Qb = Q.cast<E>(), Kb = K.cast<E>(), Vb = V.cast<E>();
            std::vector<Index> tree(static_cast<std::size_t>(n));
            for (Index i = 0; i < n; ++i)
                tree[static_cast<std::size_t>(i)] = i == 0 ? -1 : (i - 1) / 2;
            const std::vector<SoftmaxOptions> variants{
                {},
                {.window = 50, .sink_tokens = 2},
                {.softcap = 5, .sink_logits = one_sink, .alibi_slopes = one_slope},
                {.causal = false},
                {.parents = tree}};
            for (std::size_t o = 0; o < variants.size(); ++o) {
                INFO("options " << o);
                SoftmaxOptions rounded = variants[o];
                rounded.fpmath = FpMath::bf16;
                Matrix<float> out(n, dv), expected(n, dv), strict(n, dv);
                causal_softmax_attention(Q, K, V, out, rounded);
                causal_softmax_attention(Qb, Kb, Vb, expected, variants[o]);
                CHECK((out.array() == expected.array()).all());
                causal_softmax_attention(Q, K, V, strict, variants[o]);
                // Unit-normal inputs, scale 1/sqrt(d): the inputs' rounding moves a logit by
                // at most 2^-7·|q|·|k|/sqrt(d) (a few hundredths), so the outputs stay close.
                CHECK((out - strict).cwiseAbs().maxCoeff() < 0.05f);
            }
            // The log-sum-exps, and a dense bias.
            Matrix<float> out(n, dv), expected(n, dv), lse(n, 1), expected_lse(n, 1);
            causal_softmax_attention(Q, K, V, out, lse, SoftmaxOptions{.fpmath = FpMath::bf16});
            causal_softmax_attention(Qb, Kb, Vb, expected, expected_lse);
            CHECK((out.array() == expected.array()).all());
            CHECK((lse.array() == expected_lse.array()).all());
            const Matrix<float> bias = random_matrix<float>(n, n, 68);
            causal_softmax_attention(Q, K, V, out, SoftmaxOptions{.fpmath = FpMath::bf16}, bias);
            causal_softmax_attention(Qb, Kb, Vb, expected, SoftmaxOptions{}, bias);
            CHECK((out.array() == expected.array()).all());
        }
    // The multi-head kernel: each head as the single-head call on the rounded inputs.
    const HeadLayout layout{.q_heads = 4, .kv_heads = 2, .head_dim = 32};
    const Matrix<float> Q = random_matrix<float>(130, 128, 64), K = random_matrix<float>(130, 64, 65),
                        V = random_matrix<float>(130, 64, 66);
    const Matrix<E> Qb = Q.cast<E>(), Kb = K.cast<E>(), Vb = V.cast<E>();
    std::vector<Index> tree(130);
    for (Index i = 0; i < 130; ++i)
        tree[static_cast<std::size_t>(i)] = i == 0 ? -1 : (i - 1) / 3;
    for (const SoftmaxOptions& base : {SoftmaxOptions{}, SoftmaxOptions{.window = 40}, SoftmaxOptions{.parents = tree},
                                       SoftmaxOptions{.causal = false}})
        for (const int threads : {1, 2}) {
            SoftmaxOptions rounded = base;
            rounded.fpmath = FpMath::bf16;
            Matrix<float> out(130, 128), expected(130, 128);
            multi_head_causal_softmax_attention(Q, K, V, out, layout, rounded, VarLen{},
                                                OpenMPExecutor{.threads = threads});
            multi_head_causal_softmax_attention(Qb, Kb, Vb, expected, layout, base);
            CHECK((out.array() == expected.array()).all());
        }
    // The memories of float rows refuse it (they read their pairs as stored), as a pool does.
    CHECK_THROWS_WITH(KVCache<float>(8, 8, SoftmaxOptions{.fpmath = FpMath::bf16}), Catch::Contains("options.fpmath"));
    CHECK_THROWS_WITH((KVCache<float, Eigen::half>(8, 8, SoftmaxOptions{.fpmath = FpMath::bf16})),
                      Catch::Contains("options.fpmath") && Catch::Contains("Eigen::bfloat16"));
    CHECK_THROWS_WITH((KVCache<float, PerTokenScale<Fp8E4M3>>(8, 8, SoftmaxOptions{.fpmath = FpMath::bf16})),
                      Catch::Contains("options.fpmath") && Catch::Contains("Fp8E4M3"));
    CHECK_THROWS_WITH((SparseKVCache<float, Eigen::bfloat16>(8, 8, SparseKVOptions{}, SoftmaxOptions{.fpmath = FpMath::bf16})),
                      Catch::Contains("SparseKVCache") && Catch::Contains("options.fpmath"));
    CHECK_THROWS_WITH(SlidingWindowCache<float>(8, 8, SoftmaxOptions{.window = 4, .fpmath = FpMath::bf16}),
                      Catch::Contains("options.fpmath"));
    // double computes in double; a pool of float rows keeps its own products (a pool of
    // bfloat16 or FP8 rows takes it: tests/serving_test.cpp).
    const Matrix<double> Qd = random_matrix<double>(4, 8, 67);
    Matrix<double> Od(4, 8);
    CHECK_THROWS_WITH(causal_softmax_attention(Qd, Qd, Qd, Od, SoftmaxOptions{.fpmath = FpMath::bf16}),
                      Catch::Contains("options.fpmath") && Catch::Contains("double"));
    CHECK_THROWS_WITH(PagedKVCache<float>(layout, 4, 16, SoftmaxOptions{.fpmath = FpMath::bf16}),
                      Catch::Contains("options.fpmath"));
}

namespace {

/// The bound of FpMath::bf16 over stored rows (docs/design.md §4.7c): each column of `out`
/// (rows: queries) within 2⁻⁸/(1 − 2⁻⁸) of the range of its values (and of 0, the
/// sink's value, when there is a sink) of `expected`, plus float's rounding.
void check_weights_bound(const Matrix<float>& out, const MatrixD& expected, const MatrixD& values, bool sink) {
    const double bound = std::ldexp(1.0, -8) / (1 - std::ldexp(1.0, -8));
    for (Index c = 0; c < out.cols(); ++c) {
        double lo = 0, hi = 0;
        if (values.rows() > 0) {
            lo = sink ? 0.0 : values.col(c).minCoeff();
            hi = sink ? 0.0 : values.col(c).maxCoeff();
            lo = std::min(lo, values.col(c).minCoeff());
            hi = std::max(hi, values.col(c).maxCoeff());
        }
        for (Index r = 0; r < out.rows(); ++r) {
            INFO("query " << r << ", column " << c);
            CHECK(std::abs(out(r, c) - expected(r, c)) <= bound * (hi - lo) + 2e-5 * (1 + std::abs(expected(r, c))));
        }
    }
}

}  // namespace

TEMPLATE_TEST_CASE("FpMath::bf16 in the memories of bfloat16 and FP8 rows: queries and weights rounded to bfloat16, "
                   "within the weights' bound of the double reference on the rounded queries; a query's output the "
                   "same in any group; bitwise for any thread count",
                   "[softmax][options][fpmath][memory]", Eigen::bfloat16, Fp8E4M3, Fp8E5M2) {
    using E = Eigen::bfloat16;
    using S = TestType;
    const auto stored = [](const Matrix<float>& X) {  // as S holds X, in double
        Matrix<float> back(X.rows(), X.cols());
        if (X.rows() > 0)
            detail::round_trip<float, S>(X, back.data(), X.cols());
        return MatrixD(back.cast<double>());
    };
    const double slope = 0.05, sink = 0.5;
    // d = 300: past GroupAttention::max_depth, the float routes on the rounded queries.
    for (const auto& [d, dv] : {std::pair<Index, Index>{1, 1}, {31, 40}, {64, 24}, {128, 128}, {200, 33}, {300, 48}})
        for (const Index n : {0, 1, 2, 37, 129, 300})
            for (const Index g : {4, 7, 16})  // query tiles of 4; 4, 2 and 1; 8 and 8
            for (const int variant : {0, 1}) {
                INFO("d = " << d << ", dv = " << dv << ", n = " << n << ", g = " << g << ", variant " << variant);
                const Matrix<float> Q = random_matrix<float>(g, d, 71), K = random_matrix<float>(n, d, 72),
                                    V = random_matrix<float>(n, dv, 73);
                SoftmaxOptions options{.fpmath = FpMath::bf16};
                std::vector<double> slopes(g, slope), sinks(g, sink);
                if (variant == 1) {  // the logit options, one value per query of the group
                    options.softcap = 6;
                    options.alibi_slopes = slopes;
                    options.sink_logits = sinks;
                }
                KVCache<float, S> cache(d, dv, options);
                if (n > 0)
                    cache.extend(K, V);
                Matrix<float> out(g, dv);
                cache.attend_group(Q, out);
                // The reference: the rounded queries against the stored rows, in double.
                const MatrixD Kd = stored(K), Vd = stored(V);
                const MatrixD Qd = Q.cast<E>().cast<double>();
                MatrixD expected(g, dv);
                for (Index r = 0; r < g; ++r) {
                    reference::Logits logits{.offset = n - 1};
                    if (variant == 1) {
                        logits.softcap = 6;
                        logits.slope = slope;
                        logits.sink = sink;
                    }
                    expected.row(r) = n == 0 ? MatrixD::Zero(1, dv)
                                      : reference::softmax_attention(Qd.row(r), Kd, Vd, logits).out;
                }
                check_weights_bound(out, expected, Vd, variant == 1);
                if (detail::bf16_dot_rows<S> && detail::avx512_bf16_runs() && d <= 256 && g == 16) {  // fold_bf16 runs
                    // One tiling and one order of terms for every group: the same bits for a
                    // query alone (variant 0: attend; with per-query options, a group of 1
                    // is not an attend of this cache) and in a group of 3.
                    Matrix<float> three(3, dv);
                    SoftmaxOptions three_options = options;
                    std::vector<double> three_slopes(3, slope), three_sinks(3, sink);
                    if (variant == 1) {
                        three_options.alibi_slopes = three_slopes;
                        three_options.sink_logits = three_sinks;
                    }
                    KVCache<float, S> small(d, dv, three_options);
                    if (n > 0)
                        small.extend(K, V);
                    small.attend_group(Q.middleRows(5, 3), three);
                    CHECK((three.array() == out.middleRows(5, 3).array()).all());
                    if (variant == 0) {
                        Matrix<float> one(1, dv);
                        cache.attend(Q.row(9), one.row(0));
                        CHECK((one.array() == out.row(9).array()).all());
                    }
                    // The weights' rounding shows against the strict products of the same rows.
                    if (n == 300) {
                        SoftmaxOptions strict = options;
                        strict.fpmath = FpMath::strict;
                        KVCache<float, S> plain(d, dv, strict);
                        plain.extend(K, V);
                        Matrix<float> rounded_queries = Q.cast<E>().cast<float>(), other(g, dv);
                        plain.attend_group(rounded_queries, other);
                        CHECK((other.array() != out.array()).any());
                    }
                }
            }

    // A sliding window (with sink tokens) and RoPE: the window's pairs, the queries turned
    // then rounded.
    {
        const Index d = 16, n = 90;
        const Matrix<float> Q = random_matrix<float>(4, d, 74), K = random_matrix<float>(n, d, 75),
                            V = random_matrix<float>(n, d, 76);
        SlidingWindowCache<float, S> window(d, d, SoftmaxOptions{.window = 20, .sink_tokens = 3, .fpmath = FpMath::bf16});
        for (Index i = 0; i < n; ++i)
            window.update(K.row(i), V.row(i));
        Matrix<float> out(4, d);
        window.attend_group(Q, out);
        MatrixD kept(23, d), kept_values(23, d);
        kept << stored(K.topRows(3)), stored(K.bottomRows(20));
        kept_values << stored(V.topRows(3)), stored(V.bottomRows(20));
        const MatrixD expected =
            reference::softmax_attention(Q.cast<E>().cast<double>(), kept, kept_values, reference::Logits{.causal = false})
                .out;
        check_weights_bound(out, expected, kept_values, false);

        const Rope rope{.head_dim = d};
        KVCache<float, S> turned(d, d, SoftmaxOptions{.fpmath = FpMath::bf16}, rope), strict(d, d, SoftmaxOptions{}, rope);
        turned.extend(K, V);
        strict.extend(K, V);
        Matrix<float> a(4, d), b(4, d);
        turned.attend_group(Q, a);
        strict.attend_group(Q, b);
        // Unit-normal inputs at d = 16: the queries' rounding moves a logit by a few hundredths.
        CHECK((a - b).cwiseAbs().maxCoeff() < 0.05f);
        CHECK((a.array() != b.array()).any());
    }

    // MultiHead over them, its attend split into pieces across threads: the same bits for
    // 1 and 2 threads, and near the caches of each head.
    {
        const HeadLayout layout{.q_heads = 8, .kv_heads = 2, .head_dim = 64};
        const Index n = 2 * MultiHead<KVCache<float, S>>::split_keys + 300;
        const auto make = [](Index) { return KVCache<float, S>(64, 64, SoftmaxOptions{.fpmath = FpMath::bf16}); };
        MultiHead<KVCache<float, S>> heads(layout, make);
        const Matrix<float> K = random_matrix<float>(n, 128, 77), V = random_matrix<float>(n, 128, 78),
                            q = random_matrix<float>(1, 512, 79);
        heads.extend(K, V);
        Matrix<float> one(1, 512), two(1, 512), expected(1, 512);
        const OpenMPExecutor serial{.threads = 1}, threaded{.threads = 2};
        heads.set_executor(serial);
        heads.attend(q.row(0), one.row(0));
        heads.set_executor(threaded);
        heads.attend(q.row(0), two.row(0));
        CHECK((one.array() == two.array()).all());
        for (Index h = 0; h < 2; ++h) {
            Eigen::Map<const Matrix<float>> group(q.data() + h * 256, 4, 64);
            Eigen::Map<Matrix<float>> o(expected.data() + h * 256, 4, 64);
            heads.head(h).attend_group(group, o);
        }
        check_close(one, reference::to_double(expected), 1e-4);
    }
}
