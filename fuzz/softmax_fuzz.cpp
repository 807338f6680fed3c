// Differential fuzzing of causal softmax attention: the tiled kernel, the kernel with
// its queries split in two calls, KVCache and SlidingWindowCache decode and prefill,
// all against the double reference; then the input classes adversarial testing found
// missing: windows and sinks as large as Index allows, an output over an input (must
// throw and write nothing), and NaNs of any payload, infinite values and infinite keys
// (the non-finite policy, row by row, and the kernel against KVCache); and the logit
// options (softcap, ALiBi, sink logits, non-causal cross attention).
#include "fuzz_input.hpp"

#include <memattn/memattn.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace {

using namespace memattn;
using fuzz::expect_close;
using reference::to_double;

/// Non-finite values where the reference has none: NaNs of any payload in Q, K or V, ±∞
/// in V, and (when `infinite_keys`) ±∞ in K, whose logits are ±∞ or NaN by the query's
/// signs. A row is non-finite exactly when it sees a poisoned token (a NaN in its query,
/// a NaN key, a non-finite value); its other rows equal the reference on clean inputs.
/// With infinite keys the kernel must agree with KVCache decode, row by row.
template <class T>
void special_values(fuzz::FuzzInput& in, Matrix<T> Q, Matrix<T> K, Matrix<T> V, const SoftmaxOptions& options,
                    const reference::MatrixD& clean, double tol) {
    const Index nq = Q.rows(), nk = K.rows(), offset = nk - nq;
    if (nk == 0)
        return;
    using Bits = std::conditional_t<std::is_same_v<T, float>, std::uint32_t, std::uint64_t>;
    const Bits quiet_nan = std::bit_cast<Bits>(std::numeric_limits<T>::quiet_NaN());
    std::vector<bool> poisoned_token(static_cast<std::size_t>(nk), false), poisoned_query(static_cast<std::size_t>(nq));
    bool infinite_keys = false;
    for (Index count = in.size(1, 3); count > 0; --count) {
        const Index kind = in.size(0, 4), j = in.size(0, nk - 1);
        const T nan = std::bit_cast<T>(static_cast<Bits>(quiet_nan | static_cast<Bits>(in.size(0, 0xffff))));
        const T inf = (in.flag() ? 1 : -1) * std::numeric_limits<T>::infinity();
        if (kind == 0) {
            K(j, in.size(0, K.cols() - 1)) = nan;
            poisoned_token[static_cast<std::size_t>(j)] = true;
        } else if (kind == 1 || kind == 2) {
            V(j, in.size(0, V.cols() - 1)) = kind == 1 ? nan : inf;
            poisoned_token[static_cast<std::size_t>(j)] = true;
        } else if (kind == 3 && nq > 0) {
            const Index i = in.size(0, nq - 1);
            Q(i, in.size(0, Q.cols() - 1)) = nan;
            poisoned_query[static_cast<std::size_t>(i)] = true;
        } else if (kind == 4) {
            K(j, in.size(0, K.cols() - 1)) = inf;
            infinite_keys = true;
        }
    }
    Matrix<T> O(nq, V.cols());
    causal_softmax_attention(Q, K, V, O, options);
    KVCache<T> cache(K.cols(), V.cols(), static_cast<T>(options.scale));
    if (options.window == 0) {  // the memory must agree with the kernel, finiteness and values
        Matrix<T> decoded(nq, V.cols());
        extend(cache, K.topRows(offset), V.topRows(offset));
        decode(cache, Q, K.bottomRows(nq), V.bottomRows(nq), decoded);
        for (Index i = 0; i < nq; ++i) {
            if (O.row(i).allFinite() != decoded.row(i).allFinite())
                std::abort();
            if (O.row(i).allFinite())
                expect_close("special values: kernel against KVCache", O.row(i), to_double(decoded.row(i)), tol);
        }
    }
    if (infinite_keys)
        return;
    for (Index i = 0; i < nq; ++i) {
        const Index p = offset + i;
        bool sees_poison = poisoned_query[static_cast<std::size_t>(i)];
        for (Index j = 0; j <= p; ++j) {
            const bool visible = options.window == 0 || j < options.sink_tokens || j > p - options.window;
            sees_poison = sees_poison || (visible && poisoned_token[static_cast<std::size_t>(j)]);
        }
        if (O.row(i).allFinite() == sees_poison) {
            std::fprintf(stderr, "special values: row %ld is %sfinite\n", static_cast<long>(i),
                         sees_poison ? "" : "not ");
            std::abort();
        }
        if (!sees_poison)
            expect_close("special values: clean row", O.row(i), clean.row(i), tol);
    }
}

template <class T>
void run(fuzz::FuzzInput& in) {
    const Index nk = in.size(0, 160), nq = in.size(0, nk), d = in.size(1, 40), dv = in.size(1, 40);
    const Index window = in.size(0, nk + 2), sinks = in.size(0, 6);
    const double scale = in.flag() ? 0.0 : in.value(2.0);
    const bool large = in.flag();  // logits up to ~1e4: only finiteness is exact in float
    const double range = large ? 30.0 : 1.0;
    const double tol = large ? (sizeof(T) == 4 ? 5e-2 : 1e-8) : (sizeof(T) == 4 ? 2e-4 : 1e-10);
    const Matrix<T> Q = in.matrix<T>(nq, d, range), K = in.matrix<T>(nk, d, range), V = in.matrix<T>(nk, dv, 1.0);
    const SoftmaxOptions options{scale, window, sinks};
    const auto expected = reference::softmax_attention(to_double(Q), to_double(K), to_double(V), scale, window, sinks);

    Matrix<T> O(nq, dv);
    Vector<T> lse(nq);
    causal_softmax_attention(Q, K, V, O, lse, options);
    expect_close("causal_softmax_attention", O, expected.out, tol);

    // The same queries in two calls: the first `cut` queries see a prefix of the keys.
    const Index cut = in.size(0, nq), offset = nk - nq;
    Matrix<T> split(nq, dv);
    causal_softmax_attention(Q.topRows(cut), K.topRows(offset + cut), V.topRows(offset + cut), split.topRows(cut),
                             options);
    causal_softmax_attention(Q.bottomRows(nq - cut), K, V, split.bottomRows(nq - cut), options);
    expect_close("causal_softmax_attention split", split, to_double(O), tol);

    // Memories: the first `offset` tokens are the prompt already in the memory.
    const auto check_memory = [&](auto mem, const char* name) {
        extend(mem, K.topRows(offset), V.topRows(offset));
        auto copy = mem;
        Matrix<T> decoded(nq, dv), prefilled(nq, dv);
        decode(mem, Q, K.bottomRows(nq), V.bottomRows(nq), decoded);
        expect_close(name, decoded, expected.out, tol);
        prefill(copy, Q, K.bottomRows(nq), V.bottomRows(nq), prefilled);
        expect_close(name, prefilled, expected.out, tol);
        if (mem.length() != nk || copy.length() != nk)
            std::abort();
    };
    const T memory_scale = static_cast<T>(scale);
    if (window == 0)
        check_memory(KVCache<T>(d, dv, memory_scale), "KVCache");
    else
        check_memory(SlidingWindowCache<T>(d, dv, window, sinks, memory_scale), "SlidingWindowCache");

    // Extreme options: a window or sinks as large as Index allows is no limit at all.
    if (in.flag()) {
        constexpr Index huge = std::numeric_limits<Index>::max();
        Matrix<T> unlimited(nq, dv);
        causal_softmax_attention(Q, K, V, unlimited, SoftmaxOptions{scale, huge, in.flag() ? huge : sinks});
        Matrix<T> full(nq, dv);
        causal_softmax_attention(Q, K, V, full, SoftmaxOptions{scale, 0, 0});
        if (unlimited != full)
            std::abort();
    }
    // Aliasing: an output over an input is rejected, and nothing is written.
    if (nq == nk && d == dv && nq > 0 && in.flag()) {
        Matrix<T> q = Q, k = K, v = V;
        const int which = static_cast<int>(in.size(0, 2));
        Matrix<T>& over = which == 0 ? q : which == 1 ? k : v;
        const Matrix<T> before = over;
        try {
            causal_softmax_attention(q, k, v, over, options);
            std::abort();  // accepted an output over an input
        } catch (const std::invalid_argument&) {
        }
        if (over != before)
            std::abort();
    }
    // The logit options (softcap, ALiBi, a sink logit, non-causal with any Nq) against
    // the reference that materialises the scores.
    if (in.flag()) {
        const double softcap = in.flag() ? 0.25 + std::abs(in.value(20.0)) : 0;
        const double slope = std::abs(in.value(0.5)), sink = in.value(6.0);
        const bool use_slope = in.flag(), use_sink = in.flag(), causal = in.flag();
        const Matrix<T> Qx = causal ? Q : in.matrix<T>(in.size(0, 40), d, range);
        SoftmaxOptions logit_options{.scale = scale, .window = window, .sink_tokens = sinks, .softcap = softcap,
                                     .causal = causal};
        if (use_slope)
            logit_options.alibi_slopes = std::span<const double>(&slope, 1);
        if (use_sink)
            logit_options.sink_logits = std::span<const double>(&sink, 1);
        Matrix<T> Ox(Qx.rows(), dv);
        causal_softmax_attention(Qx, K, V, Ox, logit_options);
        reference::Logits logits{.scale = scale, .window = window, .sink_tokens = sinks, .softcap = softcap,
                                 .causal = causal};
        if (use_slope)
            logits.slope = slope;
        if (use_sink)
            logits.sink = sink;
        expect_close("logit options", Ox, reference::softmax_attention(to_double(Qx), to_double(K), to_double(V), logits).out,
                     tol);
    }
    if (in.flag())
        special_values(in, Q, K, V, options, expected.out, tol);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    fuzz::FuzzInput in(data, size);
    if (in.flag())
        run<float>(in);
    else
        run<double>(in);
    return 0;
}
