// The multi-head layer (memattn/layer/) against, in the same binary and run: the
// single-head kernel it is built from (the layer must add no overhead on one thread),
// itself on 1 and 2 threads, and, for decoding, a step whose KV heads are not shared.
//
//   BM_SoftmaxLayer/threads/q_heads/kv_heads/d     N = 4096, GFLOPS of useful work
//   BM_SoftmaxLayerBf16/...                       the same in bfloat16 (Q, K, V and O),
//                                                 beside the float layer at 32/8
//   BM_SoftmaxHead/d                              one head of the same, single-head kernel
//   BM_SoftmaxHeadPerThread/d/threads:t           t independent single-head kernels at once,
//                                                 one per thread: the machine's own scaling
//   BM_LinearLayer/threads/q_heads/kv_heads/d     chunked linear attention, N = 4096
//   BM_LinearHead/d                               one head, chunked_linear_attention
//   BM_Decode/threads/q_heads/kv_heads/position   one MultiHead<KVCache> attend, d = 128
//   BM_Varlen/threads/batched                     16 sequences of 64..4096 tokens (batched
//                                                 = 1) or one sequence of the same work
//   BM_PromptLayer/threads/n/bf16                 4 prompts of n tokens, 32/8 heads × 128: the
//                                                 multi-head kernel on them as a varlen batch
//                                                 (bf16 = 1: with FpMath::bf16)
//   BM_PoolPrefill/threads/n/rows                 the same prompts through batched_prefill into
//                                                 an empty PagedKVCache (blocks of 128): rows 0
//                                                 float, 1 bfloat16 rows, 2 bfloat16 rows with
//                                                 FpMath::bf16, 3 Fp8E4M3 rows with it; the
//                                                 ratio to BM_PromptLayer (of the same
//                                                 arithmetic) is the pool's cost
//
// GFLOPS counts 2·(d + dv) per visible (query, key) pair per query head for softmax,
// 4·d·dv per token per query head for linear attention, and 2·(d + dv) per stored pair
// per query head for decoding. Float, d = dv. Real time (the layer runs threads).
// Run with --benchmark_repetitions=10 --benchmark_enable_random_interleaving=true.
#include "bench_common.hpp"

#include <memattn/layer/multi_head_kernels.hpp>
#include <memattn/layer/multi_head_memory.hpp>
#include <memattn/serving/batched.hpp>

#include <cmath>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using memattn::HeadLayout;
using memattn::Index;
using memattn::Matrix;
using memattn::bench::random_matrix;
using memattn::bench::set_gflops;

constexpr Index tokens = 4096;

void use_threads(benchmark::State& state, Index threads) {
#if defined(_OPENMP)
    omp_set_num_threads(static_cast<int>(threads));
#else
    if (threads > 1)
        state.SkipWithError("built without OpenMP");
#endif
    state.counters["threads"] = static_cast<double>(threads);
}

double causal_pairs(Index n) { return 0.5 * static_cast<double>(n) * static_cast<double>(n + 1); }

HeadLayout layout_of(const benchmark::State& state) {
    return {state.range(1), state.range(2), state.range(3)};
}

/// Times call(Q, K, V, O) on random packed inputs of `n` tokens for `layout` and sets
/// GFLOPS from `flops` per call. `seed` gives each benchmark thread its own inputs.
template <class T = float, class Call>
void time_layer(benchmark::State& state, const HeadLayout& layout, double flops, Call&& call, Index n = tokens,
                unsigned seed = 0) {
    const Index d = layout.head_dim;
    const Matrix<T> Q = random_matrix<T>(n, layout.q_heads * d, 1 + seed),
                    K = random_matrix<T>(n, layout.kv_heads * d, 2 + seed),
                    V = random_matrix<T>(n, layout.kv_heads * d, 3 + seed);
    Matrix<T> O = Matrix<T>::Zero(n, layout.q_heads * d);  // its pages touched before the timing
    for (auto _ : state) {
        call(Q, K, V, O);
        benchmark::DoNotOptimize(O.data());
        benchmark::ClobberMemory();
    }
    set_gflops(state, flops);
}

/// Useful FLOPs of causal softmax over `heads` query heads, and of linear attention.
double softmax_flops(Index heads, Index d) {
    return static_cast<double>(heads) * 4.0 * static_cast<double>(d) * causal_pairs(tokens);
}
double linear_flops(Index heads, Index d) {
    return static_cast<double>(heads) * 4.0 * static_cast<double>(d * d) * static_cast<double>(tokens);
}

template <class T = float>
void BM_SoftmaxLayer(benchmark::State& state) {
    use_threads(state, state.range(0));
    const HeadLayout layout = layout_of(state);
    time_layer<T>(state, layout, softmax_flops(layout.q_heads, layout.head_dim),
                  [&](auto& Q, auto& K, auto& V, auto& O) {
                      memattn::multi_head_causal_softmax_attention(Q, K, V, O, layout);
                  });
}

void BM_SoftmaxHead(benchmark::State& state) {
    const Index d = state.range(0);
    time_layer(state, {1, 1, d}, softmax_flops(1, d),
               [](auto& Q, auto& K, auto& V, auto& O) { memattn::causal_softmax_attention(Q, K, V, O); });
}

/// The machine's own two-core scaling: one single-head kernel per benchmark thread, each
/// on its own inputs, no memattn threading; GFLOPS summed over the threads.
void BM_SoftmaxHeadPerThread(benchmark::State& state) {
    const Index d = state.range(0);
    time_layer(
        state, {1, 1, d}, softmax_flops(1, d),
        [](auto& Q, auto& K, auto& V, auto& O) { memattn::causal_softmax_attention(Q, K, V, O); }, tokens,
        static_cast<unsigned>(state.thread_index()));
}

void BM_LinearLayer(benchmark::State& state) {
    use_threads(state, state.range(0));
    const HeadLayout layout = layout_of(state);
    time_layer(state, layout, linear_flops(layout.q_heads, layout.head_dim), [&](auto& Q, auto& K, auto& V, auto& O) {
        memattn::multi_head_chunked_linear_attention(Q, K, V, O, layout);
    });
}

void BM_LinearHead(benchmark::State& state) {
    const Index d = state.range(0);
    time_layer(state, {1, 1, d}, linear_flops(1, d),
               [](auto& Q, auto& K, auto& V, auto& O) { memattn::chunked_linear_attention(Q, K, V, O); });
}

void BM_Decode(benchmark::State& state) {
    use_threads(state, state.range(0));
    const HeadLayout layout{state.range(1), state.range(2), 128};
    const Index position = state.range(3), d = layout.head_dim;
    memattn::MultiHead<memattn::KVCache<float>> mem(layout, [d](Index) { return memattn::KVCache<float>(d, d); });
    memattn::extend(mem, random_matrix<float>(position, layout.kv_heads * d, 2),
                    random_matrix<float>(position, layout.kv_heads * d, 3));
    const Matrix<float> q = random_matrix<float>(1, layout.q_heads * d, 1);
    Matrix<float> o(1, layout.q_heads * d);
    for (auto _ : state) {
        mem.attend(q.row(0), o.row(0));
        benchmark::DoNotOptimize(o.data());
        benchmark::ClobberMemory();
    }
    set_gflops(state, static_cast<double>(layout.q_heads) * 4.0 * static_cast<double>(d * position));
    state.counters["KV_MiB"] = static_cast<double>(mem.footprint()) / (1024.0 * 1024.0);
}

/// 16 lengths spread geometrically over 64..4096, and the one length of equal causal work.
std::vector<Index> varlen_lengths() {
    std::vector<Index> lengths;
    for (int b = 0; b < 16; ++b)
        lengths.push_back(static_cast<Index>(std::lround(64.0 * std::pow(64.0, b / 15.0))));
    return lengths;
}

void BM_Varlen(benchmark::State& state) {
    use_threads(state, state.range(0));
    const bool batched = state.range(1) != 0;
    const HeadLayout layout{8, 2, 64};
    const Index d = layout.head_dim;
    std::vector<Index> lengths = varlen_lengths();
    double pairs = 0;
    for (Index n : lengths)
        pairs += causal_pairs(n);
    if (!batched)  // one sequence of (about) the same number of visible pairs
        lengths = {static_cast<Index>(std::lround(std::sqrt(2.0 * pairs)))};
    std::vector<Index> offsets{0};
    for (Index n : lengths)
        offsets.push_back(offsets.back() + n);
    const memattn::VarLen batch{offsets, offsets};
    double visible = 0;
    for (Index length : lengths)
        visible += causal_pairs(length);
    time_layer(
        state, layout, static_cast<double>(layout.q_heads) * 4.0 * static_cast<double>(d) * visible,
        [&](auto& Q, auto& K, auto& V, auto& O) {
            memattn::multi_head_causal_softmax_attention(Q, K, V, O, layout, {}, batch);
        },
        offsets.back());
}

/// The prompts of BM_PromptLayer and BM_PoolPrefill: 4 of n tokens, 32/8 heads × 128.
struct Prompts {
    static constexpr Index count = 4;
    HeadLayout layout{32, 8, 128};
    Index n;
    std::vector<Index> offsets;
    Matrix<float> Q, K, V, O;

    explicit Prompts(Index tokens)
        : n(tokens), Q(random_matrix<float>(count * n, 32 * 128, 11)), K(random_matrix<float>(count * n, 8 * 128, 12)),
          V(random_matrix<float>(count * n, 8 * 128, 13)), O(count * n, 32 * 128) {
        for (Index i = 0; i <= count; ++i)
            offsets.push_back(i * n);
    }
    [[nodiscard]] double flops() const {
        return static_cast<double>(count * layout.q_heads) * 4.0 * static_cast<double>(layout.head_dim) *
               causal_pairs(n);
    }
};

void BM_PromptLayer(benchmark::State& state) {
    const Index threads = state.range(0);
    use_threads(state, threads);
    Prompts p(state.range(1));
    const memattn::VarLen batch{p.offsets, p.offsets};
    const memattn::OpenMPExecutor executor{.threads = static_cast<int>(threads)};
    const memattn::SoftmaxOptions options{.fpmath = state.range(2) == 1 ? memattn::FpMath::bf16
                                                                        : memattn::FpMath::strict};
    // One call untimed: O's pages touched first (~10 µs each here, 8 to 130 ms of them;
    // a cell of this size runs one iteration per repetition).
    memattn::multi_head_causal_softmax_attention(p.Q, p.K, p.V, p.O, p.layout, options, batch, executor);
    for (auto _ : state) {
        memattn::multi_head_causal_softmax_attention(p.Q, p.K, p.V, p.O, p.layout, options, batch, executor);
        benchmark::DoNotOptimize(p.O.data());
        benchmark::ClobberMemory();
    }
    set_gflops(state, p.flops());
}

template <class S>
void pool_prefill(benchmark::State& state, Prompts& p, const memattn::SoftmaxOptions& options) {
    const Index block = memattn::PagedKVCache<float>::default_block_size;
    memattn::PagedKVCache<float, S> pool(p.layout, Prompts::count * ((p.n + block - 1) / block), block, options);
    std::vector<Index> seqs;
    for (Index i = 0; i < Prompts::count; ++i)
        seqs.push_back(pool.add_sequence());
    const memattn::OpenMPExecutor executor{.threads = static_cast<int>(state.range(0))};
    // One call untimed, as BM_PromptLayer's: O's pages and the pool's blocks touched first.
    memattn::batched_prefill(pool, seqs, p.offsets, p.Q, p.K, p.V, p.O, executor);
    for (auto _ : state) {
        for (const Index seq : seqs)  // empty again: a few counts, no data touched
            pool.truncate(seq, 0);
        memattn::batched_prefill(pool, seqs, p.offsets, p.Q, p.K, p.V, p.O, executor);
        benchmark::DoNotOptimize(p.O.data());
        benchmark::ClobberMemory();
    }
}

void BM_PoolPrefill(benchmark::State& state) {
    use_threads(state, state.range(0));
    Prompts p(state.range(1));
    const memattn::SoftmaxOptions bf16{.fpmath = memattn::FpMath::bf16};
    switch (state.range(2)) {
    case 0: pool_prefill<float>(state, p, {}); break;
    case 1: pool_prefill<Eigen::bfloat16>(state, p, {}); break;
    case 2: pool_prefill<Eigen::bfloat16>(state, p, bf16); break;
    default: pool_prefill<memattn::Fp8E4M3>(state, p, bf16); break;
    }
    set_gflops(state, p.flops());
}

void layer_args(benchmark::internal::Benchmark* b) {
    for (Index d : {64, 128})
        for (Index threads : {1, 2})
            for (auto [q, kv] : {std::pair<Index, Index>{8, 8}, {8, 2}})
                b->Args({threads, q, kv, d});
}

}  // namespace

BENCHMARK(BM_SoftmaxLayer<float>)->Name("BM_SoftmaxLayer")->Apply(layer_args)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SoftmaxLayer<float>)
    ->Name("BM_SoftmaxLayer")
    ->ArgsProduct({{1, 2}, {32}, {8}, {64, 128}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SoftmaxLayer<Eigen::bfloat16>)
    ->Name("BM_SoftmaxLayerBf16")
    ->ArgsProduct({{1, 2}, {32}, {8}, {64, 128}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SoftmaxHead)->Arg(64)->Arg(128)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SoftmaxHeadPerThread)->Arg(64)->Arg(128)->Threads(1)->Threads(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LinearLayer)->Apply(layer_args)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LinearHead)->Arg(64)->Arg(128)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Decode)
    ->ArgsProduct({{1, 2}, {8}, {8, 2}, {4096, 65536}})
    ->Args({1, 2, 2, 4096})
    ->Args({1, 2, 2, 65536})
    ->Args({2, 2, 2, 65536})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Varlen)->ArgsProduct({{1, 2}, {0, 1}})->UseRealTime()->Unit(benchmark::kMillisecond);

BENCHMARK(BM_PromptLayer)->ArgsProduct({{1, 2}, {512, 2048}, {0, 1}})->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PoolPrefill)->ArgsProduct({{1, 2}, {512, 2048}, {0, 1, 2, 3}})->UseRealTime()->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
