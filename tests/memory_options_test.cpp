// The logit options of SoftmaxOptions on the softmax memories (KVCache,
// SlidingWindowCache, HybridCache): softcap, ALiBi slopes and learned sink logits in
// attend, attend_group and prefill, in every storage type, against the double reference
// that materialises the scores; per query head of a group in memattn::MultiHead, through
// its split attend (sinks joining after the merge) and its prefill, at any thread count;
// bad options refused, naming them.

#include "support.hpp"

#include <memattn/kernels/causal_softmax.hpp>
#include <memattn/layer/multi_head_kernels.hpp>
#include <memattn/layer/multi_head_memory.hpp>
#include <memattn/memory/hybrid_cache.hpp>
#include <memattn/memory/kv_cache.hpp>
#include <memattn/memory/sliding_window_cache.hpp>
#include <memattn/persistence/snapshot.hpp>
#include <memattn/positional/rope.hpp>
#include <memattn/storage/compact.hpp>

#include <optional>
#include <sstream>
#include <tuple>
#include <span>
#include <vector>

using namespace memattn;
using namespace memattn::test;

namespace {

struct LogitCase {
    double softcap = 0;
    std::optional<double> slope = {}, sink = {};
};

const std::vector<LogitCase> logit_cases{
    {.softcap = 4},
    {.slope = 0.0625},
    {.sink = 0.75},
    {.sink = 6},  // above the logits: the outputs shrink
    {.softcap = 2.5, .slope = 0.2, .sink = -0.5},
};

/// The options of one case for a memory (spans viewing `slope` and `sink`).
SoftmaxOptions with_case(SoftmaxOptions options, const LogitCase& c, const double& slope, const double& sink) {
    options.softcap = c.softcap;
    if (c.slope)
        options.alibi_slopes = std::span<const double>(&slope, 1);
    if (c.sink)
        options.sink_logits = std::span<const double>(&sink, 1);
    return options;
}

/// K rounded as S stores it, in double.
template <class T, class S>
MatrixD stored_in_double(const Matrix<T>& X) {
    Matrix<T> back(X.rows(), X.cols());
    if (X.rows() > 0)
        detail::round_trip<T, S>(X, back.data(), X.cols());
    return back.template cast<double>();
}

/// The memory made by `make(d, options)`: decode (one token at a time), and a prefill of
/// the first `split` tokens then of the rest, both against the reference with the
/// window and sink tokens `window`/`sink_tokens` (the memory's, 0: none).
template <class T, class S, class Make>
void check_memory(const Make& make, Index window, Index sink_tokens, double tolerance) {
    for (const Index d : {1, 16}) {
        const Index n = 70;
        const Matrix<T> Q = random_matrix<T>(n, d, 11, 2.0), K = random_matrix<T>(n, d, 12, 2.0),
                        V = random_matrix<T>(n, d + 2, 13);
        for (std::size_t k = 0; k < logit_cases.size(); ++k) {
            const LogitCase& c = logit_cases[k];
            const double slope = c.slope.value_or(0), sink = c.sink.value_or(0);
            const SoftmaxOptions options = with_case({}, c, slope, sink);
            INFO("d = " << d << ", case " << k);
            const reference::SoftmaxResult expected = reference::softmax_attention(
                Q.template cast<double>(), stored_in_double<T, S>(K), stored_in_double<T, S>(V),
                reference::Logits{.window = window, .sink_tokens = sink_tokens, .softcap = c.softcap, .slope = c.slope,
                                  .sink = c.sink});
            auto one = make(d, options);
            Matrix<T> O(n, d + 2);
            decode(one, Q, K, V, O);
            check_close(O, expected.out, tolerance);
            for (const Index split : {Index{0}, Index{1}, Index{25}}) {
                INFO("prefill after " << split << " tokens");
                auto two = make(d, options);
                Matrix<T> P = Matrix<T>::Constant(n, d + 2, T(7));
                if (split > 0)
                    prefill(two, Q.topRows(split), K.topRows(split), V.topRows(split), P.topRows(split));
                prefill(two, Q.bottomRows(n - split), K.bottomRows(n - split), V.bottomRows(n - split),
                        P.bottomRows(n - split));
                check_close(P, expected.out, tolerance);
            }
        }
    }
}

/// Every softmax memory over storage S with the case's options.
template <class T, class S>
void check_memories(double tolerance) {
    {
        INFO("KVCache");
        check_memory<T, S>([](Index d, const SoftmaxOptions& o) { return KVCache<T, S>(d, d + 2, o); }, 0, 0,
                           tolerance);
    }
    for (const auto& shape : {std::pair<Index, Index>{13, 0}, {13, 3}, {30, 1}, {200, 2}}) {
        const Index window = shape.first, sinks = shape.second;  // locals: clang 14 captures no binding
        INFO("SlidingWindowCache, window " << window << ", sinks " << sinks);
        check_memory<T, S>(
            [window, sinks](Index d, SoftmaxOptions o) {
                o.window = window;
                o.sink_tokens = sinks;
                return SlidingWindowCache<T, S>(d, d + 2, o);
            },
            window, sinks, tolerance);
    }
    {
        INFO("HybridCache without slots: its window");
        check_memory<T, S>(
            [](Index d, const SoftmaxOptions& o) { return HybridCache<T, MeanPool, S>(d, d + 2, 9, 2, 0, o); }, 9, 0,
            tolerance);
    }
}

}  // namespace

TEMPLATE_TEST_CASE("Memory options: KVCache, SlidingWindowCache and HybridCache take softcap, ALiBi and sink logits "
                   "in decode and prefill, against the reference",
                   "[memory][options]", float, double) {
    using T = TestType;
    const double tolerance = std::is_same_v<T, float> ? 3e-5 : 1e-11;
    check_memories<T, T>(tolerance);
}

TEMPLATE_TEST_CASE("Memory options: compact storage attends the stored pairs with the options", "[memory][options]",
                   Eigen::bfloat16, Eigen::half, Q8) {
    check_memories<float, TestType>(3e-5);
}

TEST_CASE("Memory options: a HybridCache's compressed slots take the softcap and the sink logit", "[memory][options]") {
    // The reference: one softmax over the pairs the cache reads (its slots and window).
    const Index d = 8, n = 90;
    const Matrix<double> Q = random_matrix<double>(n, d, 21, 2.0), K = random_matrix<double>(n, d, 22, 2.0),
                         V = random_matrix<double>(n, d, 23);
    const double sink = 0.4;
    HybridCache<double> cache(d, d, 7, 3, 5, SoftmaxOptions{.softcap = 3, .sink_logits = std::span(&sink, 1)});
    for (Index i = 0; i < n; ++i) {
        cache.update(K.row(i), V.row(i));
        std::vector<Vector<double>> keys, values;
        cache.for_each_run([&](const auto& k, const auto& v) {
            for (Index r = 0; r < k.rows(); ++r) {
                keys.emplace_back(k.row(r));
                values.emplace_back(v.row(r));
            }
        });
        MatrixD Kh(static_cast<Index>(keys.size()), d), Vh(static_cast<Index>(keys.size()), d);
        for (std::size_t r = 0; r < keys.size(); ++r) {
            Kh.row(static_cast<Index>(r)) = keys[r];
            Vh.row(static_cast<Index>(r)) = values[r];
        }
        const reference::SoftmaxResult expected = reference::softmax_attention(
            Q.row(i), Kh, Vh, reference::Logits{.softcap = 3, .causal = false, .sink = sink});
        Vector<double> out(d);
        cache.attend(Q.row(i), out);
        check_close(out, expected.out, 1e-12);
    }
    const double slope = 0.1;
    CHECK_THROWS_WITH(HybridCache<float>(d, d, 7, 3, 5, SoftmaxOptions{.alibi_slopes = std::span(&slope, 1)}),
                      Catch::Contains("HybridCache") && Catch::Contains("options.alibi_slopes") &&
                          Catch::Contains("slots = 5"));
}

TEMPLATE_TEST_CASE("Memory options: attend_group gives each query of a group its own slope and sink logit",
                   "[memory][options]", float, double) {
    using T = TestType;
    const double tolerance = std::is_same_v<T, float> ? 3e-5 : 1e-11;
    const Index d = 16, n = 300;
    for (const Index g : {2, 5, 17}) {  // 17: past a group of group_rows
        std::vector<double> slopes, sinks;
        for (Index r = 0; r < g; ++r) {
            slopes.push_back(0.01 * static_cast<double>(r + 1));
            sinks.push_back(r % 3 == 0 ? -1.0 : 0.25 * static_cast<double>(r));
        }
        const SoftmaxOptions options{.window = 120, .sink_tokens = 4, .softcap = 6, .sink_logits = sinks,
                                     .alibi_slopes = slopes};
        const Matrix<T> Q = random_matrix<T>(g, d, 31, 2.0), K = random_matrix<T>(n, d, 32, 2.0),
                        V = random_matrix<T>(n, d, 33);
        SlidingWindowCache<T> window(d, d, options);
        KVCache<T> cache(d, d, SoftmaxOptions{.softcap = 6, .sink_logits = sinks, .alibi_slopes = slopes});
        window.extend(K, V);
        cache.extend(K, V);
        Matrix<T> O(g, d), P(g, d);
        window.attend_group(Q, O);
        cache.attend_group(Q, P);
        for (Index r = 0; r < g; ++r) {
            INFO("g = " << g << ", query " << r);
            reference::Logits logits{.window = 120, .sink_tokens = 4, .softcap = 6,
                                     .slope = slopes[static_cast<std::size_t>(r)],
                                     .sink = sinks[static_cast<std::size_t>(r)], .offset = n - 1};
            check_close(O.row(r), reference::softmax_attention(Q.row(r).template cast<double>(), K.template cast<double>(),
                                                               V.template cast<double>(), logits)
                                      .out,
                        tolerance);
            logits.window = 0;
            logits.sink_tokens = 0;
            check_close(P.row(r), reference::softmax_attention(Q.row(r).template cast<double>(), K.template cast<double>(),
                                                               V.template cast<double>(), logits)
                                      .out,
                        tolerance);
        }
        // A group's values do not fit one query, nor another group size.
        Vector<T> o(d);
        CHECK_THROWS_WITH(cache.attend(Q.row(0), o), Catch::Contains("KVCache::attend") && Catch::Contains("query"));
        Matrix<T> fewer(g - 1, d);
        CHECK_THROWS_WITH(window.attend_group(Q.topRows(g - 1), fewer),
                          Catch::Contains("SlidingWindowCache::attend_group") && Catch::Contains("queries"));
    }
}

TEST_CASE("Memory options: options that change nothing give the plain memory's bits; bad options are refused",
          "[memory][options][bad_input]") {
    const Index d = 16, n = 80;
    const Matrix<float> Q = random_matrix<float>(n, d, 41), K = random_matrix<float>(n, d, 42),
                        V = random_matrix<float>(n, d, 43);
    Matrix<float> O(n, d), P(n, d);
    KVCache<float> plain(d, d), options(d, d, SoftmaxOptions{});
    decode(plain, Q, K, V, O);
    decode(options, Q, K, V, P);
    CHECK(O == P);
    SlidingWindowCache<float> plain_window(d, d, 17, 2), options_window(d, d, SoftmaxOptions{.window = 17, .sink_tokens = 2});
    prefill(plain_window, Q, K, V, O);
    prefill(options_window, Q, K, V, P);
    CHECK(O == P);

    const double one = 1, nan = std::numeric_limits<double>::quiet_NaN();
    const std::vector<double> two{1, 2}, three{1, 2, 3};
    const std::vector<Index> parents{-1, 0};
    CHECK_THROWS_WITH(KVCache<float>(d, d, SoftmaxOptions{.window = 4}),
                      Catch::Contains("KVCache") && Catch::Contains("options.window") &&
                          Catch::Contains("SlidingWindowCache"));
    CHECK_THROWS_WITH(KVCache<float>(d, d, SoftmaxOptions{.sink_tokens = 4}), Catch::Contains("options.sink_tokens"));
    CHECK_THROWS_WITH(KVCache<float>(d, d, SoftmaxOptions{.causal = false}), Catch::Contains("options.causal"));
    CHECK_THROWS_WITH(SlidingWindowCache<float>(d, d, SoftmaxOptions{.window = 4, .parents = parents}),
                      Catch::Contains("options.parents"));
    CHECK_THROWS_WITH(SlidingWindowCache<float>(d, d, SoftmaxOptions{}), Catch::Contains("window"));
    CHECK_THROWS_WITH(HybridCache<float>(d, d, 4, 2, 0, SoftmaxOptions{.softcap = -1}),
                      Catch::Contains("options.softcap"));
    CHECK_THROWS_WITH(KVCache<float>(d, d, SoftmaxOptions{.sink_logits = two, .alibi_slopes = three}),
                      Catch::Contains("options.sink_logits") || Catch::Contains("options.alibi_slopes"));
    CHECK_THROWS_WITH(KVCache<float>(d, d, SoftmaxOptions{.alibi_slopes = std::span(&nan, 1)}),
                      Catch::Contains("options.alibi_slopes"));
    // A memory of a group's values refuses a single-head prefill, unchanged.
    KVCache<float> group(d, d, SoftmaxOptions{.sink_logits = two});
    CHECK_THROWS_WITH(prefill(group, Q, K, V, O), Catch::Contains("KVCache::prefill") && Catch::Contains("options"));
    CHECK(group.length() == 0);
    SlidingWindowCache<float> group_window(d, d, SoftmaxOptions{.window = 8, .sink_logits = std::span(&one, 1)});
    const Matrix<float> Q3 = random_matrix<float>(n, 3 * d, 44);
    Matrix<float> O3(n, 3 * d);
    CHECK_THROWS_WITH(group_window.prefill_group(Q3, K, V, O3),
                      Catch::Contains("SlidingWindowCache::prefill_group") && Catch::Contains("members"));
    CHECK(group_window.length() == 0);
}

TEST_CASE("Memory options: MultiHead gives each query head its own values, through the split attend and prefill, at "
          "any thread count",
          "[memory][options][multi_head]") {
    const HeadLayout layout{.q_heads = 6, .kv_heads = 2, .head_dim = 16};
    const Index g = layout.group_size(), d = layout.head_dim, n = 2300, last = 24;  // past split_keys: pieces
    std::vector<double> slopes, sinks;
    for (Index h = 0; h < layout.q_heads; ++h) {
        slopes.push_back(std::exp2(-0.5 * static_cast<double>(h + 1)) * 0.05);
        sinks.push_back(0.3 * static_cast<double>(h) - 0.6);
    }
    const SoftmaxOptions all{.softcap = 8, .sink_logits = sinks, .alibi_slopes = slopes};
    const auto group_options = [&](SoftmaxOptions base, Index kv) {
        base.softcap = 8;
        base.sink_logits = std::span<const double>(sinks).subspan(static_cast<std::size_t>(kv * g), static_cast<std::size_t>(g));
        base.alibi_slopes = std::span<const double>(slopes).subspan(static_cast<std::size_t>(kv * g), static_cast<std::size_t>(g));
        return base;
    };
    const Matrix<float> Q = random_matrix<float>(n, layout.q_heads * d, 51, 2.0),
                        K = random_matrix<float>(n, layout.kv_heads * d, 52, 2.0),
                        V = random_matrix<float>(n, layout.kv_heads * d, 53);
    // The reference: every query head over its KV head, the last `last` tokens.
    const auto check_heads = [&](const Matrix<float>& O, Index window, Index sink_tokens) {
        for (Index h = 0; h < layout.q_heads; ++h) {
            INFO("query head " << h);
            const Index kv = h / g;
            const reference::SoftmaxResult expected = reference::softmax_attention(
                Q.block(n - last, h * d, last, d).cast<double>(), K.middleCols(kv * d, d).cast<double>(),
                V.middleCols(kv * d, d).cast<double>(),
                reference::Logits{.window = window, .sink_tokens = sink_tokens, .softcap = 8,
                                  .slope = slopes[static_cast<std::size_t>(h)],
                                  .sink = sinks[static_cast<std::size_t>(h)]});
            check_close(O.block(n - last, h * d, last, d), expected.out, 5e-5);
        }
    };
    SECTION("KVCache: decode through the split attend, prefill through the multi-head kernel") {
        const auto make = [&](Index kv) { return KVCache<float>(d, d, group_options({}, kv)); };
        Matrix<float> reference_out(n, layout.q_heads * d);
        if (!memattn::test::memory_only)  // the sanitize build: the split attend alone (the kernel's
            multi_head_causal_softmax_attention(Q, K, V, reference_out, layout, all);  // 2300² pairs twice at -O0)
        for (const int threads : {1, 2}) {
            if (memattn::test::memory_only && threads == 1)  // the sanitize build: the threaded path alone
                continue;
            const OpenMPExecutor executor{.threads = threads};
            Matrix<float> O(n, layout.q_heads * d);
            if (!memattn::test::memory_only) {
                MultiHead<KVCache<float>> mem(layout, make);
                mem.set_executor(executor);
                prefill(mem, Q, K, V, O);
                CHECK(O == reference_out);  // the same kernel with each head's values
            }
            MultiHead<KVCache<float>> steps(layout, make);
            steps.set_executor(executor);
            steps.extend(K.topRows(n - last), V.topRows(n - last));
            decode(steps, Q.bottomRows(last), K.bottomRows(last), V.bottomRows(last), O.bottomRows(last));
            check_heads(O, 0, 0);
            static Matrix<float> first;
            if (threads == 1)
                first = O.bottomRows(last);
            else if (!memattn::test::memory_only)
                CHECK(O.bottomRows(last) == first);  // bitwise at any thread count
        }
    }
    SECTION("SlidingWindowCache with sink tokens: split attend, grouped prefill") {
        const SoftmaxOptions base{.window = 2200, .sink_tokens = 3};
        const auto make = [&](Index kv) { return SlidingWindowCache<float>(d, d, group_options(base, kv)); };
        for (const int threads : {1, 2}) {
            if (memattn::test::memory_only && threads == 1)
                continue;
            MultiHead<SlidingWindowCache<float>> mem(layout, make);
            const OpenMPExecutor executor{.threads = threads};
            mem.set_executor(executor);
            Matrix<float> O(n, layout.q_heads * d);
            mem.extend(K.topRows(n - last), V.topRows(n - last));
            decode(mem, Q.bottomRows(last), K.bottomRows(last), V.bottomRows(last), O.bottomRows(last));
            check_heads(O, 2200, 3);
            MultiHead<SlidingWindowCache<float>> prompt(layout, make);
            prompt.set_executor(executor);
            // The sanitize build: the prompt's last 256 tokens after the rest extended (the
            // windowed kernel over 2300² pairs takes 12 s at -O0 under ASan).
            const Index cached = memattn::test::memory_only ? n - 256 : 0;
            prompt.extend(K.topRows(cached), V.topRows(cached));
            prefill(prompt, Q.bottomRows(n - cached), K.bottomRows(n - cached), V.bottomRows(n - cached),
                    O.bottomRows(n - cached));
            check_heads(O, 2200, 3);
        }
    }
    SECTION("HybridCache: decode of the split attend") {
        const auto make = [&](Index kv) {
            SoftmaxOptions o = group_options({}, kv);
            o.alibi_slopes = {};  // not with slots
            return HybridCache<float>(d, d, 2100, 4, 64, o);
        };
        MultiHead<HybridCache<float>> mem(layout, make);
        mem.extend(K.topRows(n - last), V.topRows(n - last));
        Matrix<float> O(last, layout.q_heads * d);
        decode(mem, Q.bottomRows(last), K.bottomRows(last), V.bottomRows(last), O);
        // Each head against the same cache's grouped attend of its own, one KV head at a time.
        for (Index kv = 0; kv < layout.kv_heads; ++kv) {
            HybridCache<float> head = make(kv);
            head.extend(K.topRows(n - 1).middleCols(kv * d, d), V.topRows(n - 1).middleCols(kv * d, d));
            head.update(K.row(n - 1).segment(kv * d, d), V.row(n - 1).segment(kv * d, d));
            Matrix<float> o(g, d);
            head.attend_group(Q.row(n - 1).segment(kv * g * d, g * d).reshaped<Eigen::RowMajor>(g, d), o);
            CHECK((O.row(last - 1).segment(kv * g * d, g * d).reshaped<Eigen::RowMajor>(g, d) - o)
                      .cwiseAbs()
                      .maxCoeff() < 1e-5f);
        }
    }
    SECTION("A factory's memory with values for another group size is refused") {
        const std::vector<double> two{1, 2};
        CHECK_THROWS_WITH(MultiHead<KVCache<float>>(layout, [&](Index) {
                              return KVCache<float>(d, d, SoftmaxOptions{.sink_logits = two});
                          }),
                          Catch::Contains("MultiHead") && Catch::Contains("make(0)") &&
                              Catch::Contains("sink_logits"));
    }
}

namespace {

/// Row x turned by RoPE to position p, in double.
MatrixD turned(const Rope& rope, const MatrixD& x, Index p) {
    MatrixD y = x;
    const Index position[1] = {p};
    rope.apply(y, position);
    return y;
}

/// One softmax of query q over keys (rows) and values, scale 1/√d.
MatrixD softmax_row(const MatrixD& q, const MatrixD& keys, const MatrixD& values) {
    return reference::softmax_attention(q, keys, values, reference::Logits{.causal = false}).out;
}

/// What a memory with RoPE gives at the token at position i (i + 1 seen), written from
/// the definition: the kept tokens, in attend's order, each turned to its place — its
/// position in the sequence, or (cache) its index among the kept tokens, the query after
/// the last. `slots` > 0: a HybridCache of `window`, `rate`, `slots` (MeanPool: a slot is
/// the mean of its tokens' keys, turned, and values); else a window with `sinks`
/// (window 0: every token).
MatrixD rope_reference(const Rope& rope, RopePositions where, const MatrixD& Q, const MatrixD& K, const MatrixD& V,
                       Index i, Index window, Index sinks, Index rate = 1, Index slots = 0) {
    const Index d = K.cols(), length = i + 1;
    std::vector<std::vector<Index>> kept;  // each kept pair: the tokens it pools
    if (slots > 0) {
        const Index e = std::max<Index>(0, length - window), s = (e + rate - 1) / rate;
        for (Index g = std::max<Index>(0, s - slots); g < s; ++g) {
            kept.emplace_back();
            for (Index t = g * rate; t < std::min((g + 1) * rate, e); ++t)
                kept.back().push_back(t);
        }
        for (Index t = e; t < length; ++t)
            kept.push_back({t});
    } else {
        for (Index t = 0; t < length; ++t)
            if (window == 0 || t < sinks || i - t < window)
                kept.push_back({t});
    }
    const Index n = static_cast<Index>(kept.size());
    MatrixD keys(n, d), values(n, V.cols());
    for (Index c = 0; c < n; ++c) {
        const std::vector<Index>& tokens = kept[static_cast<std::size_t>(c)];
        keys.row(c).setZero();
        values.row(c).setZero();
        for (const Index t : tokens) {
            keys.row(c) += turned(rope, K.row(t), where == RopePositions::cache ? c : t) /
                           static_cast<double>(tokens.size());
            values.row(c) += V.row(t) / static_cast<double>(tokens.size());
        }
    }
    return softmax_row(turned(rope, Q.row(i), where == RopePositions::cache ? n - 1 : i), keys, values);
}

/// decode and a prefill in two pieces of the memory make(), against rope_reference.
template <class T, class S, class Make, class Expected>
void check_rope_memory(const Make& make, const Expected& expected, Index n, Index d, double tolerance) {
    const Matrix<T> Q = random_matrix<T>(n, d, 61, 2.0), K = random_matrix<T>(n, d, 62, 2.0),
                    V = random_matrix<T>(n, d, 63);
    const MatrixD Qd = Q.template cast<double>(), Kd = K.template cast<double>(), Vd = stored_in_double<T, S>(V);
    auto one = make();
    Matrix<T> O(n, d);
    decode(one, Q, K, V, O);
    for (const Index split : {Index{0}, Index{17}}) {
        auto two = make();
        Matrix<T> P(n, d);
        if (split > 0)
            prefill(two, Q.topRows(split), K.topRows(split), V.topRows(split), P.topRows(split));
        prefill(two, Q.bottomRows(n - split), K.bottomRows(n - split), V.bottomRows(n - split),
                P.bottomRows(n - split));
        for (Index i = 0; i < n; ++i) {
            INFO("token " << i << ", prefill after " << split);
            const MatrixD want = expected(Qd, Kd, Vd, i);
            check_close(O.row(i), want, tolerance);
            check_close(P.row(i), want, tolerance);
        }
    }
}

template <class T, class S>
void check_rope_memories(double tolerance) {
    const Index d = 16, n = 75;
    for (const Rope& rope :
         {Rope{.theta = 10000, .head_dim = d},
          Rope{.theta = 500, .head_dim = d, .rotary_dim = 8, .layout = Rope::Layout::interleaved},
          Rope{.theta = 10000, .head_dim = d, .scaling = Rope::Yarn{.factor = 4, .original_max_positions = 16}}}) {
        INFO("rotary_dim " << rope.rotary_dim << ", layout " << static_cast<int>(rope.layout));
        // Keys may be stored rounded (S): the reference sees the keys as given, so
        // compact storage is checked to its own rounding.
        const double tol = std::is_same_v<S, T> ? tolerance : 2e-2;
        {
            INFO("KVCache");
            check_rope_memory<T, S>([&] { return KVCache<T, S>(d, d, SoftmaxOptions{}, rope); },
                                    [&](const MatrixD& Q, const MatrixD& K, const MatrixD& V, Index i) {
                                        return rope_reference(rope, RopePositions::sequence, Q, K, V, i, 0, 0);
                                    },
                                    n, d, tol);
        }
        for (const RopePositions where : {RopePositions::sequence, RopePositions::cache}) {
            INFO("positions " << static_cast<int>(where));
            for (const auto& shape : {std::pair<Index, Index>{12, 0}, {12, 3}, {100, 2}}) {
                const Index window = shape.first, sinks = shape.second;
                INFO("SlidingWindowCache, window " << window << ", sinks " << sinks);
                check_rope_memory<T, S>(
                    [&] {
                        return SlidingWindowCache<T, S>(d, d, SoftmaxOptions{.window = window, .sink_tokens = sinks},
                                                        rope, where);
                    },
                    [&](const MatrixD& Q, const MatrixD& K, const MatrixD& V, Index i) {
                        return rope_reference(rope, where, Q, K, V, i, window, sinks);
                    },
                    n, d, tol);
            }
            for (const auto& shape : {std::tuple<Index, Index, Index>{9, 3, 4}, {9, 1, 6}, {20, 4, 50}}) {
                const auto [w, r, k] = shape;
                const Index window = w, rate = r, slots = k;
                INFO("HybridCache, window " << window << ", rate " << rate << ", slots " << slots);
                check_rope_memory<T, S>(
                    [&] { return HybridCache<T, MeanPool, S>(d, d, window, rate, slots, SoftmaxOptions{}, rope, where); },
                    [&](const MatrixD& Q, const MatrixD& K, const MatrixD& V, Index i) {
                        return rope_reference(rope, where, Q, K, V, i, window, 0, rate, slots);
                    },
                    n, d, tol);
            }
        }
    }
}

}  // namespace

TEMPLATE_TEST_CASE("RoPE in the memories: keys stored turned, queries turned at each attend, at positions in the "
                   "sequence or in the cache (StreamingLLM), against the definition",
                   "[memory][rope]", float, double) {
    check_rope_memories<TestType, TestType>(std::is_same_v<TestType, float> ? 3e-5 : 1e-11);
}

TEST_CASE("RoPE in the memories: compact storage", "[memory][rope]") {
    check_rope_memories<float, Eigen::bfloat16>(0);
}

TEST_CASE("RoPE in the memories: in the cache, a window past position 10^6 attends as one at the start",
          "[memory][rope]") {
    // With RopePositions::cache the outputs depend on the kept tokens only: a cache past
    // token 2·10^6 (its window turned far out, angles computed in double) and one that
    // holds the same sinks and window at the start give the same outputs, to rounding.
    const Index d = 32, window = 16, sinks = 2, n = 40;
    const Rope rope{.theta = 500000, .head_dim = d};
    const SoftmaxOptions options{.window = window, .sink_tokens = sinks};
    const Matrix<float> Q = random_matrix<float>(n, d, 71), K = random_matrix<float>(n + sinks + window, d, 72),
                        V = random_matrix<float>(n + sinks + window, d, 73), filler = random_matrix<float>(1000, d, 74);
    SlidingWindowCache<float> near(d, d, options, rope, RopePositions::cache), far = near;
    near.extend(K.topRows(sinks + window), V.topRows(sinks + window));
    far.extend(K.topRows(sinks), V.topRows(sinks));
    while (far.length() < 2'000'000)
        far.extend(filler, filler);
    far.extend(K.middleRows(sinks, window), V.middleRows(sinks, window));
    Matrix<float> O(n, d), P(n, d);
    decode(near, Q, K.bottomRows(n), V.bottomRows(n), O);
    decode(far, Q, K.bottomRows(n), V.bottomRows(n), P);
    CHECK(far.length() > 2'000'000);
    CHECK((O - P).cwiseAbs().maxCoeff() < 2e-5f);
    CHECK((O - P).cwiseAbs().maxCoeff() > 0.0f);  // the turns did differ: not one code path
}

TEST_CASE("RoPE in the memories: snapshots carry the configuration; bad configurations are refused",
          "[memory][rope][bad_input]") {
    const Index d = 16, n = 30;
    const Rope rope{.theta = 10000, .head_dim = d}, other{.theta = 20000, .head_dim = d};
    const Matrix<float> Q = random_matrix<float>(n, d, 81), K = random_matrix<float>(n, d, 82),
                        V = random_matrix<float>(n, d, 83);
    SlidingWindowCache<float> cache(d, d, SoftmaxOptions{.window = 8, .sink_tokens = 2}, rope, RopePositions::cache);
    Matrix<float> O(n, d);
    decode(cache, Q, K, V, O);
    std::stringstream snapshot;
    save(cache, snapshot);
    const std::string bytes = snapshot.str();
    SlidingWindowCache<float> same(d, d, SoftmaxOptions{.window = 8, .sink_tokens = 2}, rope, RopePositions::cache);
    std::stringstream in(bytes);
    load(same, in);
    Vector<float> a(d), b(d);
    cache.attend(Q.row(0), a);
    same.attend(Q.row(0), b);
    CHECK(a == b);
    const auto refused = [&](auto memory) {
        std::stringstream copy(bytes);
        CHECK_THROWS_AS(load(memory, copy), SnapshotError);
        CHECK(memory.length() == 0);
    };
    refused(SlidingWindowCache<float>(d, d, 8, 2));  // no RoPE: the keys are turned
    refused(SlidingWindowCache<float>(d, d, SoftmaxOptions{.window = 8, .sink_tokens = 2}, other, RopePositions::cache));
    refused(SlidingWindowCache<float>(d, d, SoftmaxOptions{.window = 8, .sink_tokens = 2}, rope));  // other positions
    {  // and a RoPE memory refuses a snapshot without
        SlidingWindowCache<float> plain(d, d, 8, 2);
        decode(plain, Q, K, V, O);
        std::stringstream out;
        save(plain, out);
        SlidingWindowCache<float> with(d, d, SoftmaxOptions{.window = 8, .sink_tokens = 2}, rope);
        CHECK_THROWS_AS(load(with, out), SnapshotError);
    }
    CHECK_THROWS_WITH(KVCache<float>(d, d, SoftmaxOptions{}, Rope{.head_dim = 8}),
                      Catch::Contains("KVCache") && Catch::Contains("rope.head_dim"));
    CHECK_THROWS_WITH(KVCache<float>(d, d, SoftmaxOptions{}, Rope{.theta = 1, .head_dim = d}),
                      Catch::Contains("KVCache") && Catch::Contains("theta"));
    // float16 storage keeps a key of 50000, but not once RoPE may turn it past 65504.
    Matrix<float> big = K.topRows(1);
    big(0, 3) = 50000;
    KVCache<float, Eigen::half> half_plain(d, d), half_rope(d, d, SoftmaxOptions{}, rope);
    half_plain.update(big.row(0), V.row(0));
    CHECK_THROWS_WITH(half_rope.update(big.row(0), V.row(0)),
                      Catch::Contains("KVCache::update") && Catch::Contains("RoPE") && Catch::Contains("column 3"));
    CHECK(half_rope.length() == 0);
}

TEST_CASE("RoPE in the memories: MultiHead turns each group's queries, in the split attend and the prefill",
          "[memory][rope][multi_head]") {
    const HeadLayout layout{.q_heads = 4, .kv_heads = 2, .head_dim = 16};
    const Index g = layout.group_size(), d = layout.head_dim, n = 2200, last = 8;
    const Rope rope{.theta = 10000, .head_dim = d};
    const Matrix<float> Q = random_matrix<float>(n, layout.q_heads * d, 91, 2.0),
                        K = random_matrix<float>(n, layout.kv_heads * d, 92, 2.0),
                        V = random_matrix<float>(n, layout.kv_heads * d, 93);
    // Each KV head's memory alone, its group through attend_group: what the layer must give.
    const auto per_head = [&](const auto& make, Matrix<float>& O) {
        for (Index kv = 0; kv < layout.kv_heads; ++kv) {
            auto head = make(kv);
            head.extend(K.topRows(n - last).middleCols(kv * d, d), V.topRows(n - last).middleCols(kv * d, d));
            for (Index i = n - last; i < n; ++i) {
                head.update(K.row(i).segment(kv * d, d), V.row(i).segment(kv * d, d));
                const Eigen::Map<const Matrix<float>> q(Q.row(i).data() + kv * g * d, g, d);
                Eigen::Map<Matrix<float>> o(O.row(i - (n - last)).data() + kv * g * d, g, d);
                head.attend_group(q, o);
            }
        }
    };
    SECTION("SlidingWindowCache in the cache, split in pieces") {
        const auto make = [&](Index) {
            return SlidingWindowCache<float>(d, d, SoftmaxOptions{.window = 2150, .sink_tokens = 4}, rope,
                                             RopePositions::cache);
        };
        Matrix<float> expected(last, layout.q_heads * d), first;
        per_head(make, expected);
        for (const int threads : {1, 2}) {
            MultiHead<SlidingWindowCache<float>> mem(layout, make);
            const OpenMPExecutor executor{.threads = threads};
            mem.set_executor(executor);
            mem.extend(K.topRows(n - last), V.topRows(n - last));
            Matrix<float> O(last, layout.q_heads * d);
            decode(mem, Q.bottomRows(last), K.bottomRows(last), V.bottomRows(last), O);
            CHECK((O - expected).cwiseAbs().maxCoeff() < 1e-5f);
            if (threads == 1)
                first = O;
            else
                CHECK(O == first);
        }
    }
    SECTION("KVCache: the layer's prefill turns the queries as its decode does") {
        const auto make = [&](Index) { return KVCache<float>(d, d, SoftmaxOptions{}, rope); };
        MultiHead<KVCache<float>> prompt(layout, make), steps(layout, make);
        Matrix<float> O(n, layout.q_heads * d), P(n, layout.q_heads * d);
        prefill(prompt, Q.topRows(300), K.topRows(300), V.topRows(300), O.topRows(300));
        prefill(prompt, Q.middleRows(300, 40), K.middleRows(300, 40), V.middleRows(300, 40), O.middleRows(300, 40));
        decode(steps, Q.topRows(340), K.topRows(340), V.topRows(340), P.topRows(340));
        CHECK((O.topRows(340) - P.topRows(340)).cwiseAbs().maxCoeff() < 1e-5f);
    }
}
