// Linear attention, float, one thread, elu+1, normalised, d = dv: the three forms, in the
// same binary and run as
//   - the core's FMA peak (the chunked form's GFLOPS is counted against it);
//   - a plain Eigen GEMM doing the chunked form's FLOPs (the ceiling: the chunked form at
//     Eigen's GEMM speed), reported as tokens/s so the ratio reads directly;
//   - causal_softmax_attention at the same N (where linear attention starts to win);
//   - the chunked form across chunk sizes at N = 65536 (how the default was chosen).
//
// tokens/s = N / time of one call. The chunked form's FLOPs per token, with d' = d here:
//   2C·d' (QKᵀ inside the chunk) + 2C·dv (AV) + 2d'dv (Qμ) + 2d'dv (KᵀV fold).
#include "bench_common.hpp"

#include <memattn/kernels/causal_softmax.hpp>
#include <memattn/kernels/delta_rule.hpp>
#include <memattn/kernels/gated_linear_attention.hpp>
#include <memattn/kernels/linear_attention.hpp>
#include <memattn/kernels/rwkv7.hpp>

namespace {

using memattn::Index;
using memattn::Matrix;
using memattn::bench::random_matrix;

enum class Form { quadratic, recurrent, chunked };

void set_tokens(benchmark::State& state, Index n) {
    state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(n) * static_cast<double>(state.iterations()),
                                                    benchmark::Counter::kIsRate);
}

double chunked_flops_per_token(Index d, Index dv, Index chunk) {
    return static_cast<double>(2 * chunk * (d + dv) + 4 * d * dv);
}

struct Inputs {
    Matrix<float> Q, K, V, O;
    Inputs(Index n, Index d) : Q(random_matrix<float>(n, d, 1)), K(random_matrix<float>(n, d, 2)),
                               V(random_matrix<float>(n, d, 3)), O(n, d) {}
};

template <Form form>
void BM_Linear(benchmark::State& state) {
    const Index n = state.range(0), d = state.range(1);
    const Index chunk = state.range(2) > 0 ? state.range(2) : memattn::LinearOptions{}.chunk_size;
    Inputs in(n, d);
    const memattn::LinearOptions options{.chunk_size = chunk};
    for (auto _ : state) {
        if constexpr (form == Form::quadratic)
            memattn::quadratic_linear_attention(in.Q, in.K, in.V, in.O, memattn::EluPlusOne{}, options);
        else if constexpr (form == Form::recurrent)
            memattn::recurrent_linear_attention(in.Q, in.K, in.V, in.O, memattn::EluPlusOne{}, options);
        else
            memattn::chunked_linear_attention(in.Q, in.K, in.V, in.O, memattn::EluPlusOne{}, options);
        benchmark::DoNotOptimize(in.O.data());
        benchmark::ClobberMemory();
    }
    set_tokens(state, n);
    if constexpr (form == Form::chunked)
        memattn::bench::set_gflops(state, static_cast<double>(n) * chunked_flops_per_token(d, d, chunk));
}

// chunk 0: the default (LinearOptions{}.chunk_size).
BENCHMARK(BM_Linear<Form::chunked>)
    ->Name("BM_LinearChunked")
    ->ArgNames({"n", "d", "chunk"})
    ->ArgsProduct({{1024, 4096, 65536}, {64, 128}, {0}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Linear<Form::recurrent>)
    ->Name("BM_LinearRecurrent")
    ->ArgNames({"n", "d", "chunk"})
    ->ArgsProduct({{1024, 4096, 65536}, {64, 128}, {0}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Linear<Form::quadratic>)
    ->Name("BM_LinearQuadratic")
    ->ArgNames({"n", "d", "chunk"})
    ->ArgsProduct({{1024, 4096}, {64, 128}, {0}})
    ->Unit(benchmark::kMillisecond);

// How the default chunk size was chosen.
BENCHMARK(BM_Linear<Form::chunked>)
    ->Name("BM_ChunkSize")
    ->ArgNames({"n", "d", "chunk"})
    ->ArgsProduct({{65536}, {64, 128}, {8, 16, 24, 32, 48, 64, 128}})
    ->Unit(benchmark::kMillisecond);

// The core's FMA peak, for the chunked form's fraction of it (GFLOPS / this GFLOPS).
void BM_FmaPeak(benchmark::State& state) { memattn::bench::fma_peak<float>(state); }
BENCHMARK(BM_FmaPeak);

// The ceiling: an Eigen GEMM (n × k) · (k × d) with k chosen so that it does the chunked
// form's FLOPs for n tokens at the default chunk size; its tokens/s is the chunked form's
// if it ran at GEMM speed.
void BM_GemmCeiling(benchmark::State& state) {
    const Index n = state.range(0), d = state.range(1);
    const auto k = static_cast<Index>(chunked_flops_per_token(d, d, memattn::LinearOptions{}.chunk_size) /
                                      (2.0 * static_cast<double>(d)));
    const Matrix<float> A = random_matrix<float>(n, k, 1), B = random_matrix<float>(k, d, 2);
    Matrix<float> C(n, d);
    for (auto _ : state) {
        C.noalias() = A * B;
        benchmark::DoNotOptimize(C.data());
        benchmark::ClobberMemory();
    }
    set_tokens(state, n);
    memattn::bench::set_gflops(state, 2.0 * static_cast<double>(n * k * d));
}
BENCHMARK(BM_GemmCeiling)
    ->ArgNames({"n", "d"})
    ->ArgsProduct({{1024, 4096, 65536}, {64, 128}})
    ->Unit(benchmark::kMillisecond);

// Where linear attention starts to win: causal softmax (FlashAttention-style tiles) and
// the chunked form at the same lengths.
void BM_CausalSoftmax(benchmark::State& state) {
    const Index n = state.range(0), d = state.range(1);
    Inputs in(n, d);
    for (auto _ : state) {
        memattn::causal_softmax_attention(in.Q, in.K, in.V, in.O);
        benchmark::DoNotOptimize(in.O.data());
        benchmark::ClobberMemory();
    }
    set_tokens(state, n);
}
BENCHMARK(BM_CausalSoftmax)
    ->ArgNames({"n", "d"})
    ->ArgsProduct({{128, 192, 256, 384, 512, 1024, 2048, 4096, 65536}, {64, 128}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Linear<Form::chunked>)
    ->Name("BM_CrossoverChunked")
    ->ArgNames({"n", "d", "chunk"})
    ->ArgsProduct({{128, 192, 256, 384, 512, 1024, 2048}, {64, 128}, {0}})
    ->Unit(benchmark::kMillisecond);

// The data-dependent recurrences (kernels/gated_linear_attention.hpp, kernels/delta_rule.hpp)
// beside BM_LinearChunked/BM_LinearRecurrent of the same run: tokens/s of the recurrent
// and chunked forms. Keys are L2-normalised (the delta rule's usual input); gates are
// log g ∈ [−0.1, 0], β ∈ [0, 1]. chunk 0: the default of the options.
enum class Gate { scalar, channel, delta, gated_delta, kda, rwkv7 };

template <Gate gate, bool chunked>
void BM_Gated(benchmark::State& state) {
    const Index n = state.range(0), d = state.range(1);
    Inputs in(n, d);
    in.K.rowwise().normalize();
    const Index gate_cols = gate == Gate::channel || gate == Gate::kda || gate == Gate::rwkv7 ? d : 1;
    const Matrix<float> log_gates = -0.1f * random_matrix<float>(n, gate_cols, 4).cwiseAbs();
    const Matrix<float> beta = random_matrix<float>(n, 1, 5).cwiseAbs();
    memattn::GatedOptions linear{};
    memattn::DeltaOptions delta{};
    memattn::Rwkv7Options rwkv7{};
    // One thread unless the 4th argument asks for more (the value columns over a team).
    const memattn::OpenMPExecutor team{.threads = state.range(3) > 0 ? static_cast<int>(state.range(3)) : 1};
    if (state.range(2) > 0)
        linear.chunk_size = delta.chunk_size = rwkv7.chunk_size = state.range(2);
    // RWKV-7's transition vectors as it builds them: a = −κ̂ (the unit keys), b = κ̂ ⊙ α.
    const Matrix<float> removal = gate == Gate::rwkv7 ? Matrix<float>(-in.K) : Matrix<float>(0, d);
    const Matrix<float> rate =
        gate == Gate::rwkv7 ? Matrix<float>(in.K.cwiseProduct(random_matrix<float>(n, d, 6).cwiseAbs())) : Matrix<float>(0, d);
    for (auto _ : state) {
        if constexpr (gate == Gate::scalar || gate == Gate::channel) {
            if constexpr (chunked)
                memattn::chunked_gated_linear_attention(in.Q, in.K, in.V, log_gates, in.O, linear);
            else
                memattn::recurrent_gated_linear_attention(in.Q, in.K, in.V, log_gates, in.O, linear);
        } else if constexpr (gate == Gate::delta) {
            if constexpr (chunked)
                memattn::chunked_delta_rule_attention(in.Q, in.K, in.V, beta, in.O, delta, nullptr, team);
            else
                memattn::recurrent_delta_rule_attention(in.Q, in.K, in.V, beta, in.O, delta);
        } else if constexpr (gate == Gate::gated_delta) {
            if constexpr (chunked)
                memattn::chunked_delta_rule_attention(in.Q, in.K, in.V, beta, log_gates, in.O, delta, nullptr, team);
            else
                memattn::recurrent_delta_rule_attention(in.Q, in.K, in.V, beta, log_gates, in.O, delta);
        } else if constexpr (gate == Gate::kda) {
            if constexpr (chunked)
                memattn::chunked_kda_attention(in.Q, in.K, in.V, beta, log_gates, in.O, delta, nullptr, team);
            else
                memattn::recurrent_kda_attention(in.Q, in.K, in.V, beta, log_gates, in.O, delta);
        } else {
            if constexpr (chunked)
                memattn::chunked_rwkv7_attention(in.Q, in.K, in.V, removal, rate, log_gates, in.O, rwkv7);
            else
                memattn::recurrent_rwkv7_attention(in.Q, in.K, in.V, removal, rate, log_gates, in.O, rwkv7);
        }
        benchmark::DoNotOptimize(in.O.data());
        benchmark::ClobberMemory();
    }
    set_tokens(state, n);
}

#define MEMATTN_GATED_BENCH(gate, name)                                                                    \
    BENCHMARK(BM_Gated<gate, true>)                                                                       \
        ->Name("BM_" name "Chunked")                                                                      \
        ->ArgNames({"n", "d", "chunk", "threads"})                                                        \
        ->ArgsProduct({{65536}, {64, 128}, {0}, {1}})                                                     \
        ->Unit(benchmark::kMillisecond);                                                                  \
    BENCHMARK(BM_Gated<gate, false>)                                                                      \
        ->Name("BM_" name "Recurrent")                                                                    \
        ->ArgNames({"n", "d", "chunk", "threads"})                                                        \
        ->ArgsProduct({{65536}, {64, 128}, {0}, {1}})                                                     \
        ->Unit(benchmark::kMillisecond)

MEMATTN_GATED_BENCH(Gate::scalar, "GatedScalar");
MEMATTN_GATED_BENCH(Gate::channel, "GatedChannel");
MEMATTN_GATED_BENCH(Gate::delta, "Delta");
MEMATTN_GATED_BENCH(Gate::gated_delta, "GatedDelta");
MEMATTN_GATED_BENCH(Gate::kda, "Kda");
MEMATTN_GATED_BENCH(Gate::rwkv7, "Rwkv7");

// One long sequence on several threads (LinearOptions::span_tokens): the chunked linear
// form by spans against one span (span 0) in the same run, elu+1, on an OpenMP team of
// `threads`. Wall time: the team's.
void BM_LinearSpans(benchmark::State& state) {
    const Index n = state.range(0), d = state.range(1);
    Inputs in(n, d);
    const memattn::OpenMPExecutor team{.threads = static_cast<int>(state.range(3))};
    const memattn::LinearOptions options{.span_tokens = state.range(2)};
    for (auto _ : state) {
        memattn::chunked_linear_attention(in.Q, in.K, in.V, in.O, memattn::EluPlusOne{}, options, nullptr, team);
        benchmark::DoNotOptimize(in.O.data());
        benchmark::ClobberMemory();
    }
    set_tokens(state, n);
}
BENCHMARK(BM_LinearSpans)
    ->ArgNames({"n", "d", "span", "threads"})
    ->ArgsProduct({{65536}, {64, 128}, {0}, {1}})
    ->ArgsProduct({{65536}, {64, 128}, {32768}, {1, 2}})
    ->ArgsProduct({{65536}, {64, 128}, {8192}, {2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// One long sequence on several threads (GatedOptions::span_tokens): the chunked gated
// form by spans against one span (span 0) in the same run, gates per token (channels 0)
// or per channel (1), on an OpenMP team of `threads`. Wall time: the team's.
void BM_GatedSpans(benchmark::State& state) {
    const Index n = state.range(0), d = state.range(1), span = state.range(3);
    const bool channel = state.range(2) != 0;
    Inputs in(n, d);
    in.K.rowwise().normalize();
    const Matrix<float> log_gates = -0.1f * random_matrix<float>(n, channel ? d : 1, 4).cwiseAbs();
    const memattn::OpenMPExecutor team{.threads = static_cast<int>(state.range(4))};
    const memattn::GatedOptions options{.span_tokens = span};
    for (auto _ : state) {
        memattn::chunked_gated_linear_attention(in.Q, in.K, in.V, log_gates, in.O, options, nullptr, team);
        benchmark::DoNotOptimize(in.O.data());
        benchmark::ClobberMemory();
    }
    set_tokens(state, n);
}
BENCHMARK(BM_GatedSpans)
    ->ArgNames({"n", "d", "channel", "span", "threads"})
    ->Args({65536, 64, 0, 0, 1})
    ->Args({65536, 64, 0, 32768, 1})
    ->Args({65536, 64, 0, 32768, 2})
    ->Args({65536, 64, 0, 8192, 2})
    ->Args({65536, 128, 0, 0, 1})
    ->Args({65536, 128, 0, 32768, 1})
    ->Args({65536, 128, 0, 32768, 2})
    ->Args({65536, 128, 0, 8192, 2})
    ->Args({65536, 128, 1, 0, 1})
    ->Args({65536, 128, 1, 32768, 2})
    ->Args({65536, 128, 1, 8192, 2})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// One long sequence of the delta family on two threads: the value columns split over the
// team (detail::ValueColumns; parts of 64 columns, so d = 64 stays on one thread),
// against one thread in the same run. Wall time.
BENCHMARK(BM_Gated<Gate::gated_delta, true>)
    ->Name("BM_GatedDeltaThreads")
    ->ArgNames({"n", "d", "chunk", "threads"})
    ->ArgsProduct({{65536}, {64, 128}, {0}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Gated<Gate::kda, true>)
    ->Name("BM_KdaThreads")
    ->ArgNames({"n", "d", "chunk", "threads"})
    ->ArgsProduct({{65536}, {64, 128}, {0}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// How the chunk sizes of the gated kernels were chosen.
BENCHMARK(BM_Gated<Gate::scalar, true>)
    ->Name("BM_GatedChunkSize")
    ->ArgNames({"n", "d", "chunk", "threads"})
    ->ArgsProduct({{65536}, {128}, {16, 32, 64, 128}, {1}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Gated<Gate::delta, true>)
    ->Name("BM_DeltaChunkSize")
    ->ArgNames({"n", "d", "chunk", "threads"})
    ->ArgsProduct({{65536}, {128}, {16, 32, 64, 128}, {1}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Gated<Gate::kda, true>)
    ->Name("BM_KdaChunkSize")
    ->ArgNames({"n", "d", "chunk", "threads"})
    ->ArgsProduct({{65536}, {128}, {16, 32, 64}, {1}})
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
