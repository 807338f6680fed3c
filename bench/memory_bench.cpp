// The cost of one decoding step (update + attend) of each memory at a given position.
// Before timing, the memory is filled to the position with its bulk extend; every
// timed iteration then feeds one more token and attends once.
//
// The bar for the fixed-size memories (issue 5): the step at position 1e6 costs within
// 10% of the step at 1e4 (all of them are full by 1e4), and a SlidingWindowCache step
// with window 4096 reads its keys and values at no less than half the bandwidth of
// BM_StreamingRead, a plain read of the same bytes in the same binary (bytes_per_second).
#include "bench_common.hpp"

#include <memattn/memattn.hpp>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using memattn::Index;
using memattn::Matrix;

constexpr Index pool_tokens = 4096;  // synthetic tokens, reused cyclically

/// Returns the footprint after the run (the bytes a step reads, for a cache).
template <class MakeMemory>
std::size_t decode_step(benchmark::State& state, MakeMemory make) {
    const Index position = state.range(0), d = state.range(1);
    const Matrix<float> tokens = memattn::bench::random_matrix<float>(pool_tokens, d, 3);
    auto mem = make(d);
    for (Index filled = 0; filled < position; filled += pool_tokens) {
        const Index n = std::min(pool_tokens, position - filled);
        memattn::extend(mem, tokens.topRows(n), tokens.topRows(n));
    }
    memattn::Vector<float> out(d);
    Index t = position;
    for (auto _ : state) {
        const auto token = tokens.row(t++ % pool_tokens);
        mem.update(token, token);
        mem.attend(token, out);
        benchmark::DoNotOptimize(out.data());
        // A growing cache stays at its position: thousands of timed steps would
        // otherwise measure it thousands of tokens further on.
        if constexpr (std::is_same_v<decltype(mem), memattn::KVCache<float>>)
            mem.truncate(position);
    }
    state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
    state.counters["bytes"] = static_cast<double>(mem.footprint());
    return mem.footprint();
}

// A step reads every pair the cache holds: bytes_per_second is its read bandwidth.
void BM_KVCacheStep(benchmark::State& state) {
    const std::size_t bytes = decode_step(state, [](Index d) { return memattn::KVCache<float>(d, d); });
    state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
}
BENCHMARK(BM_KVCacheStep)
    ->ArgNames({"position", "d"})
    ->ArgsProduct({{1000, 4096, 10000, 65536, 100000, 1000000}, {64, 128}});

// One attend over a KVCache of a fixed length (no update): the step's read of every
// pair, for the ratio to BM_StreamingRead of the same bytes (bytes_per_second).
template <class S = float>
void BM_KVCacheAttend(benchmark::State& state) {
    const Index position = state.range(0), d = state.range(1);
    const Matrix<float> tokens = memattn::bench::random_matrix<float>(pool_tokens, d, 3);
    memattn::KVCache<float, S> cache(d, d);
    for (Index filled = 0; filled < position; filled += pool_tokens) {
        const Index n = std::min(pool_tokens, position - filled);
        cache.extend(tokens.topRows(n), tokens.topRows(n));
    }
    memattn::Vector<float> out(d);
    for (auto _ : state) {
        cache.attend(tokens.row(7), out);
        benchmark::DoNotOptimize(out.data());
    }
    // The bytes read are the stored ones; the footprint against float's (the same pairs),
    // and the output's largest difference from float storage's, over its largest value.
    state.SetBytesProcessed(static_cast<std::int64_t>(cache.footprint()) * state.iterations());
    if constexpr (!std::is_same_v<S, float>) {
        memattn::KVCache<float> plain(d, d);
        for (Index filled = 0; filled < position; filled += pool_tokens) {
            const Index n = std::min(pool_tokens, position - filled);
            plain.extend(tokens.topRows(n), tokens.topRows(n));
        }
        memattn::Vector<float> exact(d);
        plain.attend(tokens.row(7), exact);
        cache.attend(tokens.row(7), out);
        state.counters["error_vs_float"] =
            static_cast<double>((out - exact).cwiseAbs().maxCoeff() / exact.cwiseAbs().maxCoeff());
    }
    state.counters["footprint_vs_float"] =
        static_cast<double>(cache.footprint()) / (2.0 * static_cast<double>(position * d) * sizeof(float));
}
BENCHMARK(BM_KVCacheAttend)->ArgNames({"position", "d"})->ArgsProduct({{512, 4096, 65536}, {64, 128}});
// Compact storage (storage/compact.hpp) at the sizes of the float runs above: the time
// ratio to BM_KVCacheAttend<float> of the same position and d, within one run.
BENCHMARK(BM_KVCacheAttend<Eigen::bfloat16>)->ArgNames({"position", "d"})->ArgsProduct({{4096, 65536}, {128}});
BENCHMARK(BM_KVCacheAttend<Eigen::half>)->ArgNames({"position", "d"})->ArgsProduct({{4096, 65536}, {128}});
BENCHMARK(BM_KVCacheAttend<memattn::Q8>)->ArgNames({"position", "d"})->ArgsProduct({{4096, 65536}, {128}});
BENCHMARK(BM_KVCacheAttend<memattn::Q4>)->ArgNames({"position", "d"})->ArgsProduct({{4096, 65536}, {128}});
BENCHMARK(BM_KVCacheAttend<memattn::Q4Affine>)->ArgNames({"position", "d"})->ArgsProduct({{4096, 65536}, {128}});
// The integer Q·K (IntegerDot<S>: the query rounded to int8, the keys' codes multiplied
// as they are stored) beside the float dot of the same storage above.
BENCHMARK(BM_KVCacheAttend<memattn::IntegerDot<memattn::Q8>>)
    ->Name("BM_KVCacheAttend<IntegerDot<Q8>>")
    ->ArgNames({"position", "d"})
    ->ArgsProduct({{4096, 65536}, {128}});
BENCHMARK(BM_KVCacheAttend<memattn::IntegerDot<memattn::Q4>>)
    ->Name("BM_KVCacheAttend<IntegerDot<Q4>>")
    ->ArgNames({"position", "d"})
    ->ArgsProduct({{4096, 65536}, {128}});
BENCHMARK(BM_KVCacheAttend<memattn::IntegerDot<memattn::Q4Affine>>)
    ->Name("BM_KVCacheAttend<IntegerDot<Q4Affine>>")
    ->ArgNames({"position", "d"})
    ->ArgsProduct({{4096, 65536}, {128}});
// Keys per channel over groups of 32 tokens (KIVI), values per token as S: beside S above.
BENCHMARK(BM_KVCacheAttend<memattn::PerChannelKeys<memattn::Q8>>)
    ->Name("BM_KVCacheAttend<PerChannelKeys<Q8>>")
    ->ArgNames({"position", "d"})
    ->ArgsProduct({{4096, 65536}, {128}});
BENCHMARK(BM_KVCacheAttend<memattn::PerChannelKeys<memattn::Q4>>)
    ->Name("BM_KVCacheAttend<PerChannelKeys<Q4>>")
    ->ArgNames({"position", "d"})
    ->ArgsProduct({{4096, 65536}, {128}});
BENCHMARK(BM_KVCacheAttend<memattn::PerChannelKeys<memattn::Q4Affine>>)
    ->Name("BM_KVCacheAttend<PerChannelKeys<Q4Affine>>")
    ->ArgNames({"position", "d"})
    ->ArgsProduct({{4096, 65536}, {128}});

// The naive decode step the issue compares with: one GEMV for the logits, a softmax,
// one GEMV for the output, on a KVCache's stored pairs (its scratch allocated once).
void BM_NaiveDecodeStep(benchmark::State& state) {
    const Index position = state.range(0), d = state.range(1);
    const Matrix<float> K = memattn::bench::random_matrix<float>(position, d, 1);
    const Matrix<float> V = memattn::bench::random_matrix<float>(position, d, 2);
    const memattn::Vector<float> q = memattn::bench::random_matrix<float>(1, d, 3);
    memattn::Vector<float> s(position), out(d);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (auto _ : state) {
        s.noalias() = scale * (q * K.transpose());
        s = (s.array() - s.maxCoeff()).exp();
        out.noalias() = (s / s.sum()) * V;
        benchmark::DoNotOptimize(out.data());
    }
    state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
    state.SetBytesProcessed(static_cast<std::int64_t>(2 * position * d) * static_cast<std::int64_t>(sizeof(float)) *
                            state.iterations());
}
BENCHMARK(BM_NaiveDecodeStep)->ArgNames({"position", "d"})->ArgsProduct({{512, 4096, 65536}, {64, 128}});

const std::vector<std::int64_t> positions = {1000, 10000, 100000, 1000000};

// A step reads every pair the window holds: bytes_per_second is its read bandwidth.
void BM_SlidingWindowStep(benchmark::State& state) {
    const Index window = state.range(2);
    const std::size_t bytes =
        decode_step(state, [window](Index d) { return memattn::SlidingWindowCache<float>(d, d, window, 4); });
    state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
}
BENCHMARK(BM_SlidingWindowStep)
    ->ArgNames({"position", "d", "window"})
    ->ArgsProduct({positions, {64, 128}, {512, 4096}});

// window 0: the cumulative (Kahan) mean; 512: the windowed mean with its ring.
void BM_MovingAverageStep(benchmark::State& state) {
    const Index window = state.range(2);
    decode_step(state, [window](Index d) { return memattn::MovingAverageCache<float>(d, d, window); });
}
BENCHMARK(BM_MovingAverageStep)->ArgNames({"position", "d", "window"})->ArgsProduct({positions, {64, 128}, {0, 512}});

void BM_ExponentialAverageStep(benchmark::State& state) {
    decode_step(state, [](Index d) { return memattn::MovingAverageCache<float>::exponential(d, d, 0.1f); });
}
BENCHMARK(BM_ExponentialAverageStep)->ArgNames({"position", "d"})->ArgsProduct({positions, {64, 128}});

// Window 512, rate 4, 256 slots: 768 pairs attended per step once full.
void BM_HybridStep(benchmark::State& state) {
    decode_step(state, [](Index d) { return memattn::HybridCache<float>(d, d, 512, 4, 256); });
}
BENCHMARK(BM_HybridStep)->ArgNames({"position", "d"})->ArgsProduct({positions, {64, 128}});

void BM_LinearAttentionStep(benchmark::State& state) {
    decode_step(state, [](Index d) { return memattn::LinearAttentionMemory<float>(d, d); });
}
BENCHMARK(BM_LinearAttentionStep)->ArgNames({"position", "d"})->ArgsProduct({positions, {64, 128}});

// Ceiling for reading a window: one pass over K and V (`rows` × d floats each), summed
// with four independent packet accumulators so the adds never limit the read.
void BM_StreamingRead(benchmark::State& state) {
    using namespace Eigen::internal;
    using Packet = memattn::detail::Packet<float>;
    constexpr Index lanes = memattn::detail::packet_lanes<float>;
    const Index rows = state.range(0), d = state.range(1);
    const Matrix<float> K = memattn::bench::random_matrix<float>(rows, d, 1);
    const Matrix<float> V = memattn::bench::random_matrix<float>(rows, d, 2);
    for (auto _ : state) {
        Packet acc[4] = {pset1<Packet>(0.f), pset1<Packet>(0.f), pset1<Packet>(0.f), pset1<Packet>(0.f)};
        for (const Matrix<float>* m : {&K, &V}) {
            const float* p = m->data();
            for (Index i = 0; i + 4 * lanes <= m->size(); i += 4 * lanes)
                for (Index u = 0; u < 4; ++u)
                    acc[u] = padd(acc[u], ploadu<Packet>(p + i + u * lanes));
        }
        const float sum = predux(padd(padd(acc[0], acc[1]), padd(acc[2], acc[3])));
        benchmark::DoNotOptimize(sum);
    }
    state.SetBytesProcessed(static_cast<std::int64_t>(2 * rows * d) * static_cast<std::int64_t>(sizeof(float)) *
                            state.iterations());
}
BENCHMARK(BM_StreamingRead)->ArgNames({"rows", "d"})->ArgsProduct({{512, 4096, 65536}, {64, 128}});

// Ceiling for a step that reads the whole cache: one GEMV of the same shape.
void BM_EigenGemvBaseline(benchmark::State& state) {
    const Index n = state.range(0), d = state.range(1);
    const Matrix<float> K = memattn::bench::random_matrix<float>(n, d, 1);
    const memattn::Vector<float> q = memattn::bench::random_matrix<float>(1, d, 2);
    memattn::Vector<float> s(n);
    for (auto _ : state) {
        s.noalias() = q * K.transpose();
        benchmark::DoNotOptimize(s.data());
    }
    memattn::bench::set_gflops(state, 2.0 * static_cast<double>(n * d));
}
BENCHMARK(BM_EigenGemvBaseline)->ArgNames({"position", "d"})->ArgsProduct({{1000, 10000, 100000}, {64, 128}});

}  // namespace

BENCHMARK_MAIN();
