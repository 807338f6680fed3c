// Which K/V storage keeps which error: for every storage type of a KVCache, what the
// attention it gives loses against float, beside its bytes and its decode step.
//
//   BM_KvQuality<S>/keys:K    K = 0 Gaussian keys, 1 keys with outlier channels
//
// One head, d = dv = 128, n = 1024 cached tokens, 64 queries each attending over all of
// them. Keys: Gaussian, every channel N(0, 1); or, as real models' keys are (KIVI, Liu et
// al. 2024, §3; QuaRot, Ashkboos et al. 2024), 4 of the 128 channels 15 times the rest
// with a fixed sign and mean: 15·(±1 + 0.5·z). Values and queries N(0, 1). Fixed seeds:
// the counters are the same on every run of the same binary.
//
// Counters (all but step_us deterministic):
//   rel_error         ‖o_S − o‖ / ‖o‖ over the 64 outputs, o the double-precision attention
//                     of the unrounded pairs
//   kl                the mean over queries of KL(p ‖ p_S) in nats, p the attention weights of
//                     KVCache<float>, p_S those of KVCache<float, S> (read through its attend
//                     with one-hot values: value j = e_j, stored exactly by every S)
//   top1              the fraction of queries whose most-attended token is float's
//   bytes_per_token   footprint() / n: one head's key and value rows as stored
//   step_us           the benchmark's time: one attend_group of 4 queries (a 32/8 GQA
//                     group) over 32768 tokens stored as S, one thread, real time (the
//                     grouped attend reads IntegerDot<S> keys in float, as S's: its
//                     single-query attend is timed by memory_bench's BM_KVCacheAttend)
//
// `scripts/plot.py kv-quality kv_quality_bench.json` prints the table of
// docs/performance.md ("K/V storage: error against bytes") and draws kv_quality.png.
#include "bench_common.hpp"

#include <memattn/memory/kv_cache.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace {

using memattn::Index;
using memattn::Matrix;
using MatrixD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

constexpr Index d = 128, tokens = 1024, queries = 64, step_tokens = 32768, group = 4;

/// N(0, 1) rows; with `outliers`, 4 channels 15·(±1 + 0.5·z).
Matrix<float> keys(Index rows, bool outliers, std::uint64_t seed) {
    std::mt19937_64 gen(seed);
    std::normal_distribution<double> z;
    Matrix<float> K(rows, d);
    for (Index r = 0; r < rows; ++r)
        for (Index c = 0; c < d; ++c)
            K(r, c) = static_cast<float>(z(gen));
    if (outliers) {
        const Index channels[4] = {7, 40, 77, 100};
        const double signs[4] = {1, -1, 1, 1};
        for (int i = 0; i < 4; ++i)
            for (Index r = 0; r < rows; ++r)
                K(r, channels[i]) = static_cast<float>(15.0 * (signs[i] + 0.5 * z(gen)));
    }
    return K;
}

Matrix<float> gaussian(Index rows, Index cols, std::uint64_t seed) {
    std::mt19937_64 gen(seed);
    std::normal_distribution<double> z;
    Matrix<float> X(rows, cols);
    for (Index i = 0; i < X.size(); ++i)
        X.data()[i] = static_cast<float>(z(gen));
    return X;
}

/// Row i: the attention weights of query i over every stored pair, read through attend
/// with one-hot values.
template <class S>
Matrix<float> weights(const Matrix<float>& Q, const Matrix<float>& K) {
    memattn::KVCache<float, S> cache(d, tokens);
    const Matrix<float> one_hot = Matrix<float>::Identity(tokens, tokens);
    cache.extend(K, one_hot);
    Matrix<float> P(Q.rows(), tokens);
    for (Index i = 0; i < Q.rows(); ++i)
        cache.attend(Q.row(i), P.row(i));
    return P;
}

template <class S>
void BM_KvQuality(benchmark::State& state) {
    const bool outliers = state.range(0) == 1;
    const Matrix<float> K = keys(tokens, outliers, 1), V = gaussian(tokens, d, 2), Q = gaussian(queries, d, 3);

    // The output against double-precision attention of the unrounded pairs.
    memattn::KVCache<float, S> cache(d, d);
    cache.extend(K, V);
    Matrix<float> O(queries, d);
    for (Index i = 0; i < queries; ++i)
        cache.attend(Q.row(i), O.row(i));
    const MatrixD Kd = K.cast<double>(), Vd = V.cast<double>(), Qd = Q.cast<double>();
    MatrixD logits = Qd * Kd.transpose() / std::sqrt(double(d));
    for (Index i = 0; i < queries; ++i) {
        logits.row(i).array() -= logits.row(i).maxCoeff();
        logits.row(i) = logits.row(i).array().exp().matrix();
        logits.row(i) /= logits.row(i).sum();
    }
    const MatrixD exact = logits * Vd;
    const double rel_error = (O.cast<double>() - exact).norm() / exact.norm();

    // The attention weights against float's.
    const Matrix<float> P = weights<float>(Q, K), PS = weights<S>(Q, K);
    double kl = 0;
    Index same_top = 0;
    for (Index i = 0; i < queries; ++i) {
        for (Index j = 0; j < tokens; ++j) {
            const double p = P(i, j), ps = std::max(static_cast<double>(PS(i, j)), 1e-300);
            if (p > 0)
                kl += p * std::log(p / ps);
        }
        Index a = 0, b = 0;
        P.row(i).maxCoeff(&a);
        PS.row(i).maxCoeff(&b);
        same_top += a == b;
    }

    // The step: one GQA group over step_tokens pairs.
    memattn::KVCache<float, S> long_cache(d, d);
    for (Index t = 0; t < step_tokens; t += tokens)
        long_cache.extend(keys(tokens, outliers, 10 + static_cast<std::uint64_t>(t)), gaussian(tokens, d, 11));
    const Matrix<float> G = gaussian(group, d, 4);
    Matrix<float> out(group, d);
    for (auto _ : state) {
        long_cache.attend_group(G, out);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
    }
    state.counters["rel_error"] = rel_error;
    state.counters["kl"] = kl / queries;
    state.counters["top1"] = static_cast<double>(same_top) / queries;
    state.counters["bytes_per_token"] = static_cast<double>(cache.footprint()) / tokens;
}

void cells(benchmark::internal::Benchmark* b) {
    b->ArgName("keys")->Arg(0)->Arg(1)->UseRealTime()->Unit(benchmark::kMicrosecond);
}

}  // namespace

BENCHMARK(BM_KvQuality<float>)->Name("BM_KvQuality<float>")->Apply(cells);
BENCHMARK(BM_KvQuality<Eigen::bfloat16>)->Name("BM_KvQuality<bfloat16>")->Apply(cells);
BENCHMARK(BM_KvQuality<Eigen::half>)->Name("BM_KvQuality<half>")->Apply(cells);
BENCHMARK(BM_KvQuality<memattn::Q8>)->Name("BM_KvQuality<Q8>")->Apply(cells);
BENCHMARK(BM_KvQuality<memattn::Fp8E4M3>)->Name("BM_KvQuality<Fp8E4M3>")->Apply(cells);
BENCHMARK(BM_KvQuality<memattn::Fp8E5M2>)->Name("BM_KvQuality<Fp8E5M2>")->Apply(cells);
BENCHMARK(BM_KvQuality<memattn::PerTokenScale<memattn::Fp8E4M3>>)
    ->Name("BM_KvQuality<PerTokenScale<Fp8E4M3>>")
    ->Apply(cells);
BENCHMARK(BM_KvQuality<memattn::PerTokenScale<memattn::Fp8E5M2>>)
    ->Name("BM_KvQuality<PerTokenScale<Fp8E5M2>>")
    ->Apply(cells);
BENCHMARK(BM_KvQuality<memattn::Rotated<memattn::Q8>>)->Name("BM_KvQuality<Rotated<Q8>>")->Apply(cells);
BENCHMARK(BM_KvQuality<memattn::Q4>)->Name("BM_KvQuality<Q4>")->Apply(cells);
BENCHMARK(BM_KvQuality<memattn::Rotated<memattn::Q4>>)->Name("BM_KvQuality<Rotated<Q4>>")->Apply(cells);
BENCHMARK(BM_KvQuality<memattn::Q4Affine>)->Name("BM_KvQuality<Q4Affine>")->Apply(cells);
BENCHMARK(BM_KvQuality<memattn::Rotated<memattn::Q4Affine>>)
    ->Name("BM_KvQuality<Rotated<Q4Affine>>")
    ->Apply(cells);
// Keys per channel over groups of 32 tokens (KIVI), values per token as S.
BENCHMARK(BM_KvQuality<memattn::PerChannelKeys<memattn::Q8>>)->Name("BM_KvQuality<PerChannelKeys<Q8>>")->Apply(cells);
BENCHMARK(BM_KvQuality<memattn::PerChannelKeys<memattn::Q4>>)->Name("BM_KvQuality<PerChannelKeys<Q4>>")->Apply(cells);
BENCHMARK(BM_KvQuality<memattn::PerChannelKeys<memattn::Q4Affine>>)
    ->Name("BM_KvQuality<PerChannelKeys<Q4Affine>>")
    ->Apply(cells);
// The integer Q·K: the query rounded to int8 in attend (the errors), the grouped step
// (step_us) in float as its storage's.
BENCHMARK(BM_KvQuality<memattn::IntegerDot<memattn::Q8>>)->Name("BM_KvQuality<IntegerDot<Q8>>")->Apply(cells);
BENCHMARK(BM_KvQuality<memattn::IntegerDot<memattn::Q4>>)->Name("BM_KvQuality<IntegerDot<Q4>>")->Apply(cells);
BENCHMARK(BM_KvQuality<memattn::IntegerDot<memattn::Rotated<memattn::Q4>>>)
    ->Name("BM_KvQuality<IntegerDot<Rotated<Q4>>>")
    ->Apply(cells);

BENCHMARK_MAIN();
