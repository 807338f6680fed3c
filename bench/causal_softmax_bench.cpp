// causal_softmax_attention against, in the same binary and run: the naive version
// (materialise the scores, mask, softmax, multiply), Eigen's products on the same tiles
// without the softmax (the practical ceiling), the core's FMA peak, and itself with the
// logit options (softcap, ALiBi, sink logits, non-causal: BM_Options). bfloat16 inputs
// (BM_CausalSoftmaxBf16) and float inputs rounded for the products
// (BM_CausalSoftmaxFpMathBf16) run by AMX tiles where the CPU has them, against their
// peak in the same run (BM_AmxPeak; skipped elsewhere), or by vdpbf16ps (BM_Bf16DotPeak).
//
// GFLOPS counts 2·(d + dv) FLOPs per visible (query, key) pair for the kernel and the
// naive version (so their ratio is a ratio of times), and the FLOPs actually executed
// for the tile GEMM and the FMA loop. Float (and double for the kernel), one thread, d = dv.
#include "bench_common.hpp"

#include <memattn/kernels/causal_softmax.hpp>
#include <memattn/memory/kv_cache.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>
#include <type_traits>
#include <span>
#include <vector>

namespace {

using memattn::Index;
using memattn::Matrix;
using memattn::bench::random_matrix;
using memattn::bench::set_gflops;

/// Visible (query, key) pairs of a causal self-attention of n tokens with a window.
double visible_pairs(Index n, Index window) {
    double pairs = 0;
    for (Index p = 0; p < n; ++p)
        pairs += static_cast<double>(window > 0 ? std::min(p + 1, window) : p + 1);
    return pairs;
}

struct Case {
    Index n, d, window;
    explicit Case(const benchmark::State& state)
        : n(state.range(0)), d(state.range(1)), window(state.range(2)) {}
    [[nodiscard]] double useful_flops() const { return 2.0 * static_cast<double>(2 * d) * visible_pairs(n, window); }
};

/// The kernel's error against causal softmax attention in double on the same inputs (a
/// window of w: the keys (p − w, p]): its largest and its rms difference, computed once per
/// case (rows of queries at a time, so nothing of N² is held) and kept for the repetitions;
/// a case is its shape, T and the call's fpmath.
template <class T>
std::pair<double, double> error_against_double(const Matrix<T>& Q, const Matrix<T>& K, const Matrix<T>& V,
                                               const Matrix<T>& O, Index window,
                                               memattn::FpMath fpmath = memattn::FpMath::strict) {
    using MatrixD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    static std::map<std::tuple<Index, Index, Index, std::size_t, memattn::FpMath>, std::pair<double, double>> done;
    const auto key = std::make_tuple(Q.rows(), Q.cols(), window, sizeof(T), fpmath);
    if (const auto it = done.find(key); it != done.end())
        return it->second;
    const MatrixD Qd = Q.template cast<float>().template cast<double>(),
                  Kd = K.template cast<float>().template cast<double>(),
                  Vd = V.template cast<float>().template cast<double>();
    const double scale = 1.0 / std::sqrt(static_cast<double>(Q.cols()));
    const Index n = Q.rows(), rows = 256;
    double largest = 0, squares = 0;
    for (Index i0 = 0; i0 < n; i0 += rows) {
        const Index m = std::min(rows, n - i0), j0 = window > 0 ? std::max<Index>(0, i0 - window + 1) : 0,
                    keys = i0 + m - j0;
        MatrixD s = scale * Qd.middleRows(i0, m) * Kd.middleRows(j0, keys).transpose();
        for (Index i = 0; i < m; ++i) {
            const Index p = i0 + i;
            for (Index jj = 0; jj < keys; ++jj)
                if (j0 + jj > p || (window > 0 && j0 + jj <= p - window))
                    s(i, jj) = -std::numeric_limits<double>::infinity();
            s.row(i) = (s.row(i).array() - s.row(i).maxCoeff()).exp().matrix();
            s.row(i) /= s.row(i).sum();
        }
        const MatrixD expected = s * Vd.middleRows(j0, keys);
        const MatrixD diff = O.middleRows(i0, m).template cast<float>().template cast<double>() - expected;
        largest = std::max(largest, diff.cwiseAbs().maxCoeff());
        squares += diff.squaredNorm();
    }
    return done[key] = {largest, std::sqrt(squares / static_cast<double>(O.size()))};
}

/// The kernel class a call on inputs of T runs (16-bit: Q, K and V through ConvertedRows).
template <class T>
using Kernel = std::conditional_t<memattn::LowPrecision<T>,
                                  memattn::detail::TiledCausalSoftmax<float, memattn::detail::DefaultBlocking,
                                                                      memattn::detail::ConvertedRows<T>,
                                                                      memattn::detail::ConvertedRows<T>,
                                                                      memattn::detail::ConvertedRows<T>>,
                                  memattn::detail::TiledCausalSoftmax<memattn::arithmetic_t<T>>>;

/// T = Eigen::bfloat16: Q, K, V and O in bfloat16 (vdpbf16ps products on AVX512-BF16).
/// Counters: the output's largest and rms error against double on the same inputs
/// (values uniform in [−1, 1]). F = FpMath::bf16 (float inputs, BM_CausalSoftmaxFpMathBf16):
/// rounded to bfloat16 for the products. Where the products are bfloat16 (those, and
/// bfloat16 inputs), `amx` says whether AMX tiles ran them (else vdpbf16ps, or float on the
/// rounded values).
template <class T = float, memattn::FpMath F = memattn::FpMath::strict>
void BM_CausalSoftmax(benchmark::State& state) {
    const Case c(state);
    const Matrix<T> Q = random_matrix<T>(c.n, c.d, 1), K = random_matrix<T>(c.n, c.d, 2),
                    V = random_matrix<T>(c.n, c.d, 3);
    Matrix<T> O(c.n, c.d);
    for (auto _ : state) {
        memattn::causal_softmax_attention(Q, K, V, O, {.scale = 0, .window = c.window, .fpmath = F});
        benchmark::DoNotOptimize(O.data());
        benchmark::ClobberMemory();
    }
    set_gflops(state, c.useful_flops());
    if (memattn::bench::measure_error()) {
        const auto [largest, rms] = error_against_double(Q, K, V, O, c.window, F);
        state.counters["max_error"] = largest;
        state.counters["rms_error"] = rms;
    }
    state.counters["scratch_KiB"] =
        static_cast<double>(Kernel<T>::scratch_bytes(c.d, c.d, memattn::detail::default_tiles(c.window))) / 1024.0;
    if constexpr (std::is_same_v<T, Eigen::bfloat16> || F == memattn::FpMath::bf16)
        state.counters["amx"] = memattn::bf16_products() == memattn::Bf16Products::amx_tiles && c.d % 2 == 0 ? 1 : 0;
}

/// Scores for all N² pairs, masked, softmax by rows, times V.
void BM_Naive(benchmark::State& state) {
    const Case c(state);
    const Matrix<float> Q = random_matrix<float>(c.n, c.d, 1), K = random_matrix<float>(c.n, c.d, 2),
                        V = random_matrix<float>(c.n, c.d, 3);
    Matrix<float> O(c.n, c.d), S(c.n, c.n);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    for (auto _ : state) {
        S.noalias() = scale * (Q * K.transpose());
        for (Index i = 0; i < c.n; ++i) {
            const Index first = c.window > 0 ? std::max<Index>(0, i - c.window + 1) : 0;
            auto row = S.row(i).array();
            row.head(first).setConstant(-std::numeric_limits<float>::infinity());
            row.tail(c.n - i - 1).setConstant(-std::numeric_limits<float>::infinity());
            row = (row - row.maxCoeff()).exp();
            row /= row.sum();
        }
        O.noalias() = S * V;
        benchmark::DoNotOptimize(O.data());
        benchmark::ClobberMemory();
    }
    set_gflops(state, c.useful_flops());
}

/// The kernel's tile loop with Eigen's products and no softmax: S = Q_t K_tᵀ, O_t += S V_t
/// on the same 64 × 64 tiles the kernel visits.
void BM_EigenTileGemm(benchmark::State& state) {
    const Case c(state);
    const Index t = 64, tk = 64;  // the calibration: Eigen's products on 64 × 64 tiles
    const Matrix<float> Q = random_matrix<float>(c.n, c.d, 1), K = random_matrix<float>(c.n, c.d, 2),
                        V = random_matrix<float>(c.n, c.d, 3);
    Matrix<float> O = Matrix<float>::Zero(c.n, c.d), S(t, tk);
    double flops = 0;
    for (auto _ : state) {
        flops = 0;
        for (Index i0 = 0; i0 < c.n; i0 += t) {
            const Index rows = std::min(t, c.n - i0);
            const Index hi = i0 + rows, lo = c.window > 0 ? std::max<Index>(0, i0 - c.window + 1) : 0;
            for (Index j1 = hi; j1 > lo; j1 -= tk) {
                const Index j0 = std::max(lo, j1 - tk), n = j1 - j0;
                S.topLeftCorner(rows, n).noalias() = Q.middleRows(i0, rows) * K.middleRows(j0, n).transpose();
                O.middleRows(i0, rows).noalias() += S.topLeftCorner(rows, n) * V.middleRows(j0, n);
                flops += 2.0 * static_cast<double>(rows * n * 2 * c.d);
            }
        }
        benchmark::DoNotOptimize(O.data());
        benchmark::ClobberMemory();
    }
    set_gflops(state, flops);
}

/// One core's FMA peak (bench_common.hpp).
void BM_FmaPeak(benchmark::State& state) { memattn::bench::fma_peak<float>(state); }
void BM_Bf16DotPeak(benchmark::State& state) { memattn::bench::bf16_dot_peak(state); }

/// tdpbf16ps's rate: four independent 16 × 16 tiles of C, each += a 16 × 32 tile of A
/// times a 32 × 16 of B (16,384 FLOPs an instruction), on tiles loaded once. Skipped
/// where the tiles do not run (memattn::cpu_features()).
void BM_AmxPeak(benchmark::State& state) {
    namespace d = memattn::detail;
    if (!d::AmxTileProducts<d::DefaultBlocking>::runs()) {
        state.SkipWithError(("no AMX tiles here: " + memattn::describe(memattn::cpu_features())).c_str());
        return;
    }
    alignas(64) static std::uint16_t a[2][16 * 32] = {};
    alignas(64) static std::uint32_t b[2][16 * 16] = {};
    alignas(64) static float c[4][16 * 16] = {};
    const int m[2] = {16, 16}, n[2] = {16, 16};
    const Index reps = 1024;
    for (auto _ : state) {
        d::AmxHardware::configure(d::block_config(2, 2, m, n));
        d::AmxHardware::load<4>(a[0], 64);
        d::AmxHardware::load<5>(a[1], 64);
        d::AmxHardware::load<6>(b[0], 64);
        d::AmxHardware::load<7>(b[1], 64);
        for (Index r = 0; r < reps; ++r) {
            d::AmxHardware::dot<0, 4, 6>();
            d::AmxHardware::dot<1, 4, 7>();
            d::AmxHardware::dot<2, 5, 6>();
            d::AmxHardware::dot<3, 5, 7>();
        }
        d::AmxHardware::store<0>(c[0], 64);
        d::AmxHardware::release();
        benchmark::ClobberMemory();
    }
    state.counters["GFLOPS"] = benchmark::Counter(4.0 * 16384.0 * static_cast<double>(reps),
                                                  benchmark::Counter::kIsIterationInvariantRate,
                                                  benchmark::Counter::kIs1000);
}

/// Tile sizes: query tile × key tile at N = 4096 and 16384, full causal and a window of 512
/// (384 cases: run a subset with --benchmark_filter, e.g. BM_TileSweep/N:16384/d:64/qtile:64/).
void BM_TileSweep(benchmark::State& state) {
    const Index n = state.range(0), d = state.range(1), window = state.range(4);
    const memattn::detail::SoftmaxTiles tiles{state.range(2), state.range(3)};
    const Matrix<float> Q = random_matrix<float>(n, d, 1), K = random_matrix<float>(n, d, 2),
                        V = random_matrix<float>(n, d, 3);
    Matrix<float> O(n, d);
    for (auto _ : state) {
        memattn::detail::causal_softmax_views<float>(Q, K, V, O, [](Index, float) {}, {.scale = 0, .window = window},
                                                     tiles);
        benchmark::DoNotOptimize(O.data());
        benchmark::ClobberMemory();
    }
    set_gflops(state, 2.0 * static_cast<double>(2 * d) * visible_pairs(n, window));
}

/// The logit options (SoftmaxOptions) against the plain call in the same run: option 0
/// plain, 1 softcap 30, 2 ALiBi, 3 a sink logit, 4 all three, 5 non-causal (GFLOPS per
/// visible pair: N² for non-causal, so equal rates mean equal cost per pair), 6 a dense
/// additive bias (N × N, causal), 7 a dense boolean mask (the causal one, as a user
/// would give it: every pair read).
void BM_Options(benchmark::State& state) {
    const Index n = state.range(0), d = state.range(1), option = state.range(2);
    const Matrix<float> Q = random_matrix<float>(n, d, 1), K = random_matrix<float>(n, d, 2),
                        V = random_matrix<float>(n, d, 3);
    Matrix<float> O(n, d);
    const double slope = 0.0625, sink = 0.5;
    memattn::SoftmaxOptions options;
    if (option == 1 || option == 4)
        options.softcap = 30;
    if (option == 2 || option == 4)
        options.alibi_slopes = std::span<const double>(&slope, 1);
    if (option == 3 || option == 4)
        options.sink_logits = std::span<const double>(&sink, 1);
    if (option == 5)
        options.causal = false;
    Matrix<float> bias;
    Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> mask;
    if (option == 6)
        bias = random_matrix<float>(n, n, 4);
    if (option == 7) {
        mask.resize(n, n);
        for (Index i = 0; i < n; ++i)
            for (Index j = 0; j < n; ++j)
                mask(i, j) = j <= i;
    }
    for (auto _ : state) {
        if (option == 6)
            memattn::causal_softmax_attention(Q, K, V, O, options, bias);
        else if (option == 7)
            memattn::causal_softmax_attention(Q, K, V, O, options, mask);
        else
            memattn::causal_softmax_attention(Q, K, V, O, options);
        benchmark::DoNotOptimize(O.data());
        benchmark::ClobberMemory();
    }
    const double pairs = option == 5 ? static_cast<double>(n) * static_cast<double>(n) : visible_pairs(n, 0);
    set_gflops(state, 2.0 * static_cast<double>(2 * d) * pairs);
}

/// Speculative decoding's verify step: 64 draft tokens (a binary tree) over a cache of
/// `past` tokens in one call with options.parents (steps = 0), against 64 decode steps
/// (steps = 1): each draft's attend over a KVCache of the cache and its ancestors.
void BM_TreeVerify(benchmark::State& state) {
    const Index past = state.range(0), d = state.range(1), drafts = 64;
    const bool steps = state.range(2) != 0;
    std::vector<Index> parents{-1};
    for (Index i = 1; i < drafts; ++i)
        parents.push_back((i - 1) / 2);
    const Matrix<float> Q = random_matrix<float>(drafts, d, 1), K = random_matrix<float>(past + drafts, d, 2),
                        V = random_matrix<float>(past + drafts, d, 3);
    Matrix<float> O(drafts, d);
    // A step's cache: the past and the draft's ancestors (depth ≤ 6), built once here.
    std::vector<memattn::KVCache<float>> caches;
    if (steps)
        for (Index i = 0; i < drafts; ++i) {
            std::vector<Index> chain;
            for (Index a = i; a >= 0; a = parents[static_cast<std::size_t>(a)])
                chain.insert(chain.begin(), a);
            Matrix<float> k(past + static_cast<Index>(chain.size()), d), v(k.rows(), d);
            k.topRows(past) = K.topRows(past);
            v.topRows(past) = V.topRows(past);
            for (std::size_t c = 0; c < chain.size(); ++c) {
                k.row(past + static_cast<Index>(c)) = K.row(past + chain[c]);
                v.row(past + static_cast<Index>(c)) = V.row(past + chain[c]);
            }
            caches.emplace_back(d, d);
            memattn::extend(caches.back(), k, v);
        }
    const memattn::SoftmaxOptions tree{.parents = parents};
    for (auto _ : state) {
        if (steps)
            for (Index i = 0; i < drafts; ++i)
                caches[static_cast<std::size_t>(i)].attend(Q.row(i), O.row(i));
        else
            memattn::causal_softmax_attention(Q, K, V, O, tree);
        benchmark::DoNotOptimize(O.data());
        benchmark::ClobberMemory();
    }
}

void cases(benchmark::internal::Benchmark* b, Index max_n) {
    b->ArgNames({"N", "d", "window"})->Unit(benchmark::kMillisecond);
    for (const Index n : {1024, 4096, 16384})
        for (const Index d : {64, 128})
            for (const Index window : {0, 512})
                if (n <= max_n)
                    b->Args({n, d, window});
}

/// BM_TileSweep at one N and window: d × query tile × key tile.
void tile_sweep(benchmark::internal::Benchmark* b, Index n, Index window) {
    b->ArgNames({"N", "d", "qtile", "ktile", "window"})
        ->ArgsProduct({{n}, {64, 128}, {32, 48, 64, 96, 128, 192}, {32, 48, 64, 96, 128, 192, 256, 576}, {window}})
        ->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_FmaPeak);
BENCHMARK(BM_Bf16DotPeak);
BENCHMARK(BM_CausalSoftmax<float>)->Name("BM_CausalSoftmax")->Apply([](auto* b) { cases(b, 16384); });
BENCHMARK(BM_CausalSoftmax<Eigen::bfloat16>)->Name("BM_CausalSoftmaxBf16")->Apply([](auto* b) { cases(b, 16384); });
BENCHMARK(BM_CausalSoftmax<float, memattn::FpMath::bf16>)
    ->Name("BM_CausalSoftmaxFpMathBf16")
    ->Apply([](auto* b) { cases(b, 16384); });
BENCHMARK(BM_AmxPeak);
// Double: half the lanes per packet, so half the float rate is the FMA count's limit.
BENCHMARK(BM_CausalSoftmax<double>)->Name("BM_CausalSoftmaxDouble")->Apply([](auto* b) { cases(b, 4096); });
BENCHMARK(BM_EigenTileGemm)->Apply([](auto* b) { cases(b, 16384); });
BENCHMARK(BM_Naive)->Apply([](auto* b) { cases(b, 16384); });
BENCHMARK(BM_CausalSoftmax<float>)->Name("BM_CausalSoftmax_long")->ArgNames({"N", "d", "window"})->Args({131072, 64, 512})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Options)->ArgNames({"N", "d", "option"})->ArgsProduct({{4096}, {64, 128}, {0, 1, 2, 3, 4, 5, 6, 7}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TreeVerify)->ArgNames({"past", "d", "steps"})->ArgsProduct({{4096}, {64, 128}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);
// One family per N and window (Google Benchmark warns above 100 cases in a family).
BENCHMARK(BM_TileSweep)->Apply([](auto* b) { tile_sweep(b, 4096, 0); });
BENCHMARK(BM_TileSweep)->Apply([](auto* b) { tile_sweep(b, 4096, 512); });
BENCHMARK(BM_TileSweep)->Apply([](auto* b) { tile_sweep(b, 16384, 0); });
BENCHMARK(BM_TileSweep)->Apply([](auto* b) { tile_sweep(b, 16384, 512); });

}  // namespace

BENCHMARK_MAIN();
