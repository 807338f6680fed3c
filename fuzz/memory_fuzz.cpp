// Differential fuzzing of the fixed-size memories: MovingAverageCache (windowed,
// cumulative, exponential), HybridCache (mean, max, weighted compressors) and
// SlidingWindowCache with the logit options (softcap, ALiBi, a sink logit) against the
// double references, with decode, prefill and extend-then-decode agreeing. Then a batch
// of copies of the memory, fed from different points, through batched_decode and
// batched_prefill: with a row of Q, V or O missing they must refuse, and through an
// executor that fails part way they must rethrow, every memory as it was (its snapshot);
// through a working one they must equal one step (one prefill) per memory.
#include "fuzz_input.hpp"

#include <memattn/memattn.hpp>

#include <optional>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace memattn;
using fuzz::expect_close;
using reference::MatrixD;
using reference::to_double;

/// A user's executor that runs `runs` items of a parallel_for, then throws.
struct FailingExecutor {
    Index runs = 0;
    [[nodiscard]] int concurrency() const { return 3; }
    template <class F>
    void parallel_for(Index n, F&& f) const {
        for (Index i = 0; i < std::min(n, runs); ++i)
            f(i);
        throw std::runtime_error("the executor failed");
    }
};

template <class M>
std::string snapshot_of(M& mem) {
    std::stringstream stream;
    memattn::save(mem, stream);
    return stream.str();
}

/// The batched calls over copies of `mem` (see the top of the file).
template <class M>
void check_batched(fuzz::FuzzInput& in, M mem, const Matrix<typename M::Scalar>& Q,
                   const Matrix<typename M::Scalar>& K, const Matrix<typename M::Scalar>& V) {
    using T = typename M::Scalar;
    const Index n = K.rows(), batch = std::min<Index>(in.size(1, 4), n);
    if (batch == 0)
        return;
    std::vector<M> memories;
    for (Index i = 0; i < batch; ++i) {
        memories.push_back(mem);
        const Index fed = in.size(0, n - batch);
        extend(memories.back(), K.topRows(fed), V.topRows(fed));
    }
    std::vector<std::string> before;
    for (M& m : memories)
        before.push_back(snapshot_of(m));
    const auto unchanged = [&](const char* what) {
        for (std::size_t i = 0; i < memories.size(); ++i)
            if (snapshot_of(memories[i]) != before[i]) {
                std::fprintf(stderr, "memory_fuzz: %s changed memory %zu\n", what, i);
                std::abort();
            }
    };
    const auto rows = [&](const Matrix<T>& X) { return X.bottomRows(batch); };
    Matrix<T> O(batch, V.cols());
    // A missing row of Q, V or O: refused before any memory moves.
    const Index short_of = in.size(0, 2);
    try {
        if (short_of == 0)
            batched_decode(std::span(memories), rows(Q).topRows(batch - 1), rows(K), rows(V), O);
        else if (short_of == 1)
            batched_decode(std::span(memories), rows(Q), rows(K), rows(V).topRows(batch - 1), O);
        else
            batched_decode(std::span(memories), rows(Q), rows(K), rows(V), O.topRows(batch - 1));
        std::abort();
    } catch (const std::invalid_argument&) {
    }
    unchanged("a batch with a missing row");
    const FailingExecutor failing{in.size(0, 2)};
    const bool decode = in.flag();
    std::vector<Index> offsets{0};
    for (Index i = 0; i < batch; ++i)
        offsets.push_back(offsets.back() + (decode ? 1 : in.size(0, 3)));
    const Index total = std::min(offsets.back(), n);
    for (auto& o : offsets)
        o = std::min(o, total);
    const Matrix<T> Qb = Q.topRows(total), Kb = K.topRows(total), Vb = V.topRows(total);
    Matrix<T> Ob(total, V.cols());
    bool threw = false;
    try {
        if (decode)
            batched_decode(std::span(memories), rows(Q), rows(K), rows(V), O, failing);
        else
            batched_prefill(std::span(memories), offsets, Qb, Kb, Vb, Ob, failing);
    } catch (const std::runtime_error&) {
        threw = true;
    }
    if (!threw && batch > 1 && (decode || total > 0)) {
        std::fprintf(stderr, "memory_fuzz: a batch through a failing executor did not throw\n");
        std::abort();
    }
    if (threw)
        unchanged("a batch whose executor threw");
    else
        return;
    // Through a working executor: one step (or prefill) per memory.
    std::vector<M> separate = memories;
    const SerialExecutor serial;
    const double tol = sizeof(T) == 4 ? 2e-4 : 1e-10;
    if (decode) {
        Matrix<T> expected(batch, V.cols());
        for (Index i = 0; i < batch; ++i) {
            separate[static_cast<std::size_t>(i)].update(rows(K).row(i), rows(V).row(i));
            separate[static_cast<std::size_t>(i)].attend(rows(Q).row(i), expected.row(i));
        }
        batched_decode(std::span(memories), rows(Q), rows(K), rows(V), O, serial);
        expect_close("batched_decode", O, to_double(expected), tol);
    } else {
        Matrix<T> expected(total, V.cols());
        for (Index i = 0; i < batch; ++i) {
            const Index r0 = offsets[static_cast<std::size_t>(i)], m = offsets[static_cast<std::size_t>(i) + 1] - r0;
            if (m > 0)
                prefill(separate[static_cast<std::size_t>(i)], Qb.middleRows(r0, m), Kb.middleRows(r0, m),
                        Vb.middleRows(r0, m), expected.middleRows(r0, m));
        }
        batched_prefill(std::span(memories), offsets, Qb, Kb, Vb, Ob, serial);
        expect_close("batched_prefill", Ob, to_double(expected), tol);
    }
}

/// decode from empty equals the reference; an extend of a prefix followed by prefill
/// (or decode) of the rest gives the same rows; then the batched calls.
template <class M>
void check(fuzz::FuzzInput& in, const char* name, M mem, const Matrix<typename M::Scalar>& Q,
           const Matrix<typename M::Scalar>& K, const Matrix<typename M::Scalar>& V, const MatrixD& expected) {
    using T = typename M::Scalar;
    check_batched(in, mem, Q, K, V);
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
