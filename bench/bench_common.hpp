#pragma once
// Shared by the benchmark binaries: inputs, FLOP counters and the plain Eigen GEMM
// that every binary runs beside its kernels as the machine's practical ceiling, so
// ratios are taken within one run on a noisy machine.

#include <benchmark/benchmark.h>
#include <memattn/detail/bf16_product.hpp>
#include <memattn/detail/packet.hpp>
#include <memattn/types.hpp>

#include <bit>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>

namespace memattn::bench {

/// The CPU's model name (/proc/cpuinfo), for the output's context: every figure names
/// the CPU it was measured on.
inline std::string cpu_model() {
    std::ifstream in("/proc/cpuinfo");
    for (std::string line; std::getline(in, line);)
        if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos)
            return line.substr(line.find(':') + 2);
    return "unknown";
}

/// Adds "cpu_model" and the vector ISA memattn was compiled for to the benchmark
/// context (the JSON output's "context" and the console header), before main runs.
inline const bool context_added = [] {
    benchmark::AddCustomContext("cpu_model", cpu_model());
#if defined(EIGEN_VECTORIZE_AVX512)
    benchmark::AddCustomContext("simd", "AVX-512");
#elif defined(EIGEN_VECTORIZE_AVX2)
    benchmark::AddCustomContext("simd", "AVX2");
#else
    benchmark::AddCustomContext("simd", "SSE2 or other");
#endif
    return true;
}();

template <class T>
Matrix<T> random_matrix(Index rows, Index cols, unsigned seed) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    Matrix<T> m(rows, cols);
    for (Index i = 0; i < m.size(); ++i)
        m.data()[i] = static_cast<T>(u(gen));
    return m;
}

/// Sets a GFLOPS counter: `flops` per iteration, averaged over the run.
inline void set_gflops(benchmark::State& state, double flops) {
    state.counters["GFLOPS"] =
        benchmark::Counter(flops * 1e-9 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

/// C (m×n) = A (m×k) · B (k×n) with Eigen, single-threaded; 2·m·n·k FLOPs.
template <class T>
void eigen_gemm(benchmark::State& state, Index m, Index n, Index k) {
    const Matrix<T> A = random_matrix<T>(m, k, 1), B = random_matrix<T>(k, n, 2);
    Matrix<T> C(m, n);
    for (auto _ : state) {
        C.noalias() = A * B;
        benchmark::DoNotOptimize(C.data());
        benchmark::ClobberMemory();
    }
    set_gflops(state, 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k));
}

/// One core's FMA peak for T: 12 independent chains of packet FMAs (2 FLOPs per lane),
/// more than two FMA ports of latency 4 or 5 need, in registers only.
template <class T>
void fma_peak(benchmark::State& state) {
    using P = detail::Packet<T>;
    using namespace Eigen::internal;
    constexpr int chains = 12;
    constexpr Index steps = 1 << 20;
    P acc[chains];
    for (int i = 0; i < chains; ++i)
        acc[i] = pset1<P>(T(0.001) * static_cast<T>(i));
    const P a = pset1<P>(T(0.999999)), b = pset1<P>(T(1e-7));
    for (auto _ : state) {
        for (Index s = 0; s < steps; ++s)
            for (int i = 0; i < chains; ++i)
                acc[i] = pmadd(acc[i], a, b);
        benchmark::DoNotOptimize(acc);
    }
    set_gflops(state, 2.0 * chains * detail::packet_lanes<T> * static_cast<double>(steps));
}

/// MEMATTN_BENCH_ERRORS=1 in the environment: the kernels' benchmarks also measure their
/// error against double (once per case, outside the timed loop; seconds at N = 16384).
inline bool measure_error() {
    const char* flag = std::getenv("MEMATTN_BENCH_ERRORS");
    return flag != nullptr && std::string(flag) == "1";
}

/// One core's bfloat16 dot-product peak: 16 independent chains of vdpbf16ps (4 FLOPs per
/// float lane: two multiply-adds), in registers only; an error where the target lacks
/// AVX512-BF16.
inline void bf16_dot_peak(benchmark::State& state) {
#if defined(MEMATTN_BF16_DOT)
    constexpr int chains = 16;
    constexpr Index steps = 1 << 20;
    __m512 acc[chains];
    for (int i = 0; i < chains; ++i)
        acc[i] = _mm512_set1_ps(0.001f * static_cast<float>(i));
    const __m512bh a = std::bit_cast<__m512bh>(_mm512_set1_epi32(0x3F803F80)),  // the pairs (1, 1)
        b = std::bit_cast<__m512bh>(_mm512_set1_epi32(0x33D633D6));            // (1e-7, 1e-7)
    for (auto _ : state) {
        for (Index s = 0; s < steps; ++s)
            for (int i = 0; i < chains; ++i)
                acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        benchmark::DoNotOptimize(acc);
    }
    set_gflops(state, 4.0 * chains * 16 * static_cast<double>(steps));
#else
    state.SkipWithError("this target has no AVX512-BF16 (vdpbf16ps)");
    for (auto _ : state) {
    }
#endif
}

}  // namespace memattn::bench
