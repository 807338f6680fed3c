// Differential fuzzing of the fixed-size memories: MovingAverageCache (windowed,
// cumulative, exponential), HybridCache (mean, max, weighted compressors) and
// SlidingWindowCache with the logit options (softcap, ALiBi, a sink logit) against the
// double references, with decode, prefill and extend-then-decode agreeing.
#include "fuzz_input.hpp"

#include <memattn/memattn.hpp>

#include <optional>
#include <span>
#include <vector>

namespace {

using namespace memattn;
using fuzz::expect_close;
using reference::MatrixD;
using reference::to_double;

/// decode from empty equals the reference; an extend of a prefix followed by prefill
/// (or decode) of the rest gives the same rows.
template <class M>
void check(fuzz::FuzzInput& in, const char* name, M mem, const Matrix<typename M::Scalar>& Q,
           const Matrix<typename M::Scalar>& K, const Matrix<typename M::Scalar>& V, const MatrixD& expected) {
    using T = typename M::Scalar;
    const double tol = sizeof(T) == 4 ? 2e-4 : 1e-10;
    const Index n = K.rows(), cut = in.size(0, n);
    M bulk = mem;
    Matrix<T> O(n, V.cols());
    decode(mem, Q, K, V, O);
    expect_close(name, O, expected, tol);
    extend(bulk, K.topRows(cut), V.topRows(cut));
    Matrix<T> rest(n - cut, V.cols());
    if (in.flag())
        prefill(bulk, Q.bottomRows(n - cut), K.bottomRows(n - cut), V.bottomRows(n - cut), rest);
    else
        decode(bulk, Q.bottomRows(n - cut), K.bottomRows(n - cut), V.bottomRows(n - cut), rest);
    expect_close(name, rest, expected.bottomRows(n - cut), tol);
    if (mem.length() != n || bulk.length() != n || mem.footprint() != bulk.footprint())
        std::abort();
}

template <class T>
void run(fuzz::FuzzInput& in) {
    const Index n = in.size(0, 200), d = in.size(1, 16), dv = in.size(1, 16);
    const Matrix<T> Q = in.matrix<T>(n, d, 1.0), K = in.matrix<T>(n, d, 1.0), V = in.matrix<T>(n, dv, 1.0);
    switch (in.size(0, 3)) {
        case 3: {
            const Index window = in.size(1, 40), sinks = in.size(0, 6);
            const double softcap = in.flag() ? 0.0 : 0.5 + 10 * std::abs(in.value(1.0));
            const double slope = std::abs(in.value(0.5)), sink = in.value(4.0);
            const bool alibi = in.flag(), sinked = in.flag();
            SoftmaxOptions options{.window = window, .sink_tokens = sinks, .softcap = softcap};
            if (alibi)
                options.alibi_slopes = std::span<const double>(&slope, 1);
            if (sinked)
                options.sink_logits = std::span<const double>(&sink, 1);
            check(in, "SlidingWindowCache with logit options", SlidingWindowCache<T>(d, dv, options), Q, K, V,
                  reference::softmax_attention(
                      to_double(Q), to_double(K), to_double(V),
                      reference::Logits{.window = window, .sink_tokens = sinks, .softcap = softcap,
                                        .slope = alibi ? std::optional<double>(slope) : std::nullopt,
                                        .sink = sinked ? std::optional<double>(sink) : std::nullopt})
                      .out);
            return;
        }
        case 0: {
            const Index window = in.size(0, 40);
            check(in, "MovingAverageCache", MovingAverageCache<T>(d, dv, window), Q, K, V,
                  reference::moving_average(to_double(V), window));
            return;
        }
        case 1: {
            const double alpha = 0.01 + 0.99 * std::abs(in.value(1.0));
            check(in, "MovingAverageCache::exponential", MovingAverageCache<T>::exponential(d, dv, T(alpha)), Q, K,
                  V, reference::exponential_average(to_double(V), static_cast<double>(T(alpha))));
            return;
        }
        default: {
            const Index window = in.size(1, 12), rate = in.size(1, 5), slots = in.size(0, 5);
            const double scale = in.flag() ? 0.0 : in.value(2.0);
            const auto compare = [&](auto compressor, const reference::Pool& pool, const char* name) {
                check(in, name, HybridCache<T, decltype(compressor)>(d, dv, window, rate, slots, T(scale), compressor),
                      Q, K, V,
                      reference::hybrid(to_double(Q), to_double(K), to_double(V), window, rate, slots,
                                        static_cast<double>(T(scale)), pool));
            };
            switch (in.size(0, 2)) {
                case 0: return compare(MeanPool{}, reference::mean_pool, "HybridCache<MeanPool>");
                case 1: return compare(MaxPool{}, reference::max_pool, "HybridCache<MaxPool>");
                default: {
                    std::vector<double> weights(static_cast<std::size_t>(rate));
                    for (auto& w : weights)
                        w = static_cast<double>(static_cast<T>(in.value(1.0)));
                    return compare(WeightedPool(weights), reference::weighted_pool(weights), "HybridCache<WeightedPool>");
                }
            }
        }
    }
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
