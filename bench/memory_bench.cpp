// The cost of one decoding step (update + attend) of each memory at a given position.
// Before timing, the memory is filled to the position with its bulk extend; every
// timed iteration then feeds one more token and attends once.
#include "bench_common.hpp"

#include <memattn/memattn.hpp>

namespace {

using memattn::Index;
using memattn::Matrix;

constexpr Index pool_tokens = 4096;  // synthetic tokens, reused cyclically

template <class MakeMemory>
void decode_step(benchmark::State& state, MakeMemory make) {
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
    }
    state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
    state.counters["bytes"] = static_cast<double>(mem.footprint());
}

void BM_KVCacheStep(benchmark::State& state) {
    decode_step(state, [](Index d) { return memattn::KVCache<float>(d, d); });
}
BENCHMARK(BM_KVCacheStep)->ArgNames({"position", "d"})->ArgsProduct({{1000, 10000, 100000}, {64, 128}});

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
