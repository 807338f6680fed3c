// Decode at the roofline (issue 25): one decoding step of a layer, beside the least time
// the machine needs for it, measured in the same cell of the same run.
//
//   BM_DecodeStep<S>/q:Q/kv:KV/length:L/t:T    update + attend of one token in
//       MultiHead<KVCache<float, S>> with Q query heads over KV heads of d = dv = 128, a
//       cache of L tokens, OpenMPExecutor{.threads = T} (set_executor); reserve() first,
//       and the cache is taken back to L (truncate) after every step, so every iteration
//       measures the same length and none allocates
//   BM_DecodeAttend<S>/...                     the attend alone, the same cells: what the
//       update costs is the difference
//   BM_DecodeStepBf16Rows/...                  BM_DecodeStep<bfloat16> with rows of
//       bfloat16 in and out (MultiHead<KVCache<Eigen::bfloat16>>, docs/design.md §4.7d)
//   BM_DecodeStepFpMathBf16<S>/...             BM_DecodeStep<S> (S bfloat16, Fp8E4M3 or
//       Fp8E5M2) with FpMath::bf16: the queries and weights rounded to bfloat16, the
//       stored values multiplied as they are (vdpbf16ps on AVX512-BF16, docs/design.md §4.7c)
//
// S is float, bfloat16 (Eigen::bfloat16), half (Eigen::half), Q8, IntegerDot<Q8> (Q8's
// bytes, the logits in integers on the int8-rounded queries), Q4, Q4Affine, Fp8E4M3,
// Fp8E5M2 or PerTokenScale<Fp8E4M3> (one byte a value; PerTokenScale adds a float scale
// per row; the BM_DecodeStep cells only). Every cell also measures, after its timed loop
// and on the same T threads:
//   read_ms    a streaming read of exactly the bytes the step must read (the footprint()
//              of every KV head's stored K and V at length L, in storage S), from one
//              buffer of that size, so a cell that fits in the last-level cache is
//              compared with a read that does too
//   fma_ms     the step's multiply-adds, 2 · Q · L · (d + dv) FLOPs, at the FMA peak of
//              T threads (independent chains of packet FMAs in registers, as BM_FmaPeak)
// and reports, as counters: step_ms (the median of the timed iterations, each timed on
// its own clock, real time; the benchmark's own Time column is their mean), read_ms the
// median of the read's passes, fma_ms at the median FMA pass of the same threads in real
// time (peak_GFLOPS; core_peak_GFLOPS is the cores' own, from each thread's CPU time),
// roofline_ms = max(read_ms, fma_ms), fraction = roofline_ms / step_ms, compute_bound
// (1 when fma_ms is the larger), MiB (the bytes read), read_GBps and step_GBps (the bytes
// over step_ms). Step, read and FMA passes all run in real time on the cell's threads, so
// on a shared machine each gets the same share of the cores. (That a step allocates nothing is tests/allocation_test.cpp's.)
//
//   BM_DecodeLayers<S>/layers:N/length:L/fpmath:F/t:T   the attend of one token in each of
//       N layers in turn (a model's decode step: MultiHead<KVCache<float, S>> 32/8 × 128,
//       L tokens each; F = 1 FpMath::bf16), so each layer's pairs come back from DRAM
//       after the others' evicted them, as in a model; BM_DecodeAttend steps one layer
//       over and over, whose pairs a last-level cache may keep. The roofline's bytes are
//       every layer's footprint
//
//   BM_SparseDecode/length:L/block:B/g:G       one KV head (d = dv = 128, float, G query
//       heads) at L tokens: KVCache (B = 0) against SparseKVCache with blocks of B tokens,
//       top_k_blocks · B = 2048, a window of 64 and 4 sinks; the bytes of its roofline
//       are the bounds of every block and the pairs it attends
//
//   BM_GroupAttend/g:G/length:L/fpmath:F       one KV head's attend_group of G queries
//       (d = dv = 128) over a KVCache<float, bfloat16> of L = 512 tokens (in L2), strict
//       (F = 0) or FpMath::bf16 (F = 1: in AMX tiles where the CPU runs them, else by
//       vdpbf16ps; F = 2: the same route kept off the tiles, by vdpbf16ps wherever it
//       is compiled): the routes' arithmetic; ns_per_key besides the roofline counters
//
//   BM_DecodeVariants/length:L/variant:V      the step of BM_DecodeStep<float> (32/8 × 128,
//       one thread) with the attention variants of the memories: V = 0 plain, 1 the
//       logit options (softcap 30, ALiBi, a sink logit per query head), 2 RoPE (keys
//       stored turned, each step's query and key turned), 3 both; what they cost is
//       the difference to variant 0 in the same run
//
//   BM_LatentDecode<S>/heads:H/length:L/t:T/absorbed:A   multi-head latent attention
//       (DeepSeek-V3's shape: r = 512, d_r = 64) over a LatentKVCache<float, S> of L
//       tokens: A = 0 the attend of H absorbed queries, A = 1 the whole mla_decode step
//       (nope 128, v 128: the two absorptions read 2 · H · 128 · 512 floats of weights);
//       the FLOPs of the roofline are the attend's, 2 · H · L · (2r + d_r), and its bytes
//       the cache's footprint (plus the weights for A = 1)
//   BM_LatentDecodeFpMathBf16/...                         the same over a bfloat16 cache
//       with FpMath::bf16: the queries rounded, the rows multiplied as bfloat16 pairs (AMX
//       tiles where the CPU has them; `amx` says whether they ran)
//
//   BM_LatentPrefill/heads:H/past:P/tokens:N/t:T/mode:M   mla_prefill of N prompt tokens
//       after P cached ones, DeepSeek-V3's shape, mode M = 1 absorbed, 2 expanded
//       (MlaPrefill); its FLOPs the mode's own (absorbed 2·(2r + d_r) a head and pair
//       plus the absorptions, expanded 2·(d_nope + d_r + d_v) a head and pair plus
//       2·r·(d_nope + d_v) a head and key), a pair being a query and a key it sees
//   BM_LatentPrefillFpMathBf16/...                        the same over a bfloat16 cache
//       with FpMath::bf16 (the queries, and expanded the keys and values, rounded; the
//       kernel's products in bfloat16, AMX tiles where the CPU has them)
//
//   BM_PagedLatentDecode<S>/heads:H/batch:B/length:L/t:T/pool:P   one decode step's
//       attend of B sequences of L tokens each (DeepSeek-V3's r = 512, d_r = 64, H
//       absorbed queries a sequence): P = 1 a PagedLatentKVCache<float, S> of blocks of
//       128 attending the batch at once (PagedLatentKVCache::attend over the sequences),
//       P = 0 B LatentKVCaches attended one after the other (what the pool replaces); P = 2
//       the whole absorbed step of the batch, mla_decode(pool, seqs, ...) (nope 128, v
//       128: each head's absorptions one product over the batch), P = 3 B mla_decode
//       steps over the B caches; the roofline's FLOPs 2 · B · H · L · (2r + d_r), its
//       bytes the rows read (and, P ≥ 2, the weights once, or B times for P = 3)
//
//   BM_PoolTreeVerify/past:P/mode:M   speculative decoding in a PagedKVCache<float> (32/8
//       heads of 128, blocks of 128), one sequence of P cached tokens and a binary tree of
//       64 drafts: M = 0 the verify step (prefill with parents, then reject), M = 1 the 64
//       batched_decode steps it replaces (then truncate), M = 2 accept of a path of 5
//       drafts alone (the verify before each untimed), M = 3 one batched_decode step, M = 4
//       the same 64 rows as a causal chunk (prefill without parents, then truncate); M = 5
//       the verify step and M = 6 its 64 decode steps in a sliding-window pool of 1024
//       tokens with ALiBi (rollback room 64: the drafts at their depths' positions)
//   BM_PoolTreeVerifyFpMathBf16<bfloat16>/past:P/mode:M   the same in a pool of bfloat16
//       rows with FpMath::bf16: the verify's products in AMX tiles where the CPU has
//       them (else vdpbf16ps), the steps through the grouped bfloat16 decode
//
//   BM_StatePoolDecode/t:T/mode:M   one decode step of 32 sequences of a hybrid model's
//       recurrent layer, MultiHead<DeltaRuleMemory<float>> of 8 heads, d = dv = 128 (key
//       rows [k | β], qk_l2norm): M = 0 StatePool::decode over the 32, M = 1 batched_decode
//       over 32 separate memories (what the pool replaces); the roofline's bytes the 32
//       states (16 MiB, each read and written once at least), its FLOPs 6·d·dv a head and
//       sequence (k·S, the rank-one update, q·S)
//
//   BM_StateTreeVerify/mode:M   speculative decoding in a hybrid model's recurrent layer:
//       one sequence of a StatePool of the same MultiHead<DeltaRuleMemory<float>> (8 heads,
//       128 × 128: a 512 KiB state) and a binary tree of 64 drafts: M = 0 the verify step
//       (a state per draft, then reject), M = 1 the 64 decode steps it replaces (then a
//       truncate back to the checkpoint before them), M = 2 accept of a path of 5 drafts
//       alone (the verify before each untimed), M = 3 one decode step (a checkpoint
//       copy every 64th)
//
// The figure and the table: scripts/plot.py (decode_roofline.png; `plot.py decode-table
// decode_bench.json` prints the table of docs/performance.md). On a shared machine run
//   decode_bench --benchmark_filter=BM_DecodeStep --benchmark_repetitions=5
//       --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true
// and read the medians; record the load (scripts/lib/measure_load.py).
#include "bench_common.hpp"

#include <memattn/detail/huge_pages.hpp>
#include <memattn/execution/executor.hpp>
#include <memattn/layer/latent_attention.hpp>
#include <memattn/layer/multi_head_memory.hpp>
#include <memattn/memory/kv_cache.hpp>
#include <memattn/memory/sparse_kv_cache.hpp>
#include <memattn/positional/rope.hpp>
#include <memattn/serving/batched.hpp>
#include <memattn/serving/paged_kv_cache.hpp>
#include <memattn/serving/paged_latent_kv_cache.hpp>
#include <memattn/serving/model_cache.hpp>
#include <memattn/serving/state_pool.hpp>
#include <memattn/memory/gated_memories.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <fstream>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

namespace {

using memattn::HeadLayout;
using memattn::Index;
using memattn::Matrix;
using Clock = std::chrono::steady_clock;

constexpr Index head_dim = 128;
constexpr Index pool_tokens = 4096;  // synthetic tokens, reused cyclically to fill a cache

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

/// "family F model M" of /proc/cpuinfo: "AMD EPYC" alone does not say which generation.
std::string cpu_family_model() {
    std::ifstream in("/proc/cpuinfo");
    std::string family, model;
    for (std::string line; std::getline(in, line) && (family.empty() || model.empty());) {
        const auto colon = line.find(':');
        if (colon == std::string::npos || colon + 2 > line.size())
            continue;
        if (line.rfind("cpu family", 0) == 0)
            family = line.substr(colon + 2);
        else if (line.rfind("model", 0) == 0 && line.rfind("model name", 0) != 0)
            model = line.substr(colon + 2);
    }
    return "family " + family + " model " + model;
}

const bool family_added = [] {
    benchmark::AddCustomContext("cpu_family_model", cpu_family_model());
    return true;
}();

/// The buffer the streaming reads run over: one allocation for the process, grown to the
/// largest cell, every page written once. A cell reads its first `bytes`.
const float* stream_buffer(std::size_t bytes) {
    static std::unique_ptr<float[]> buffer;
    static std::size_t size = 0;
    if (bytes > size) {
        buffer.reset();
        const std::size_t floats = bytes / sizeof(float) + 64;
        buffer.reset(new float[floats]);
        // the pages the caches and pools ask for (detail/huge_pages.hpp), so that the read
        // is of the same bytes under the same pages
        memattn::detail::advise_huge_pages(buffer.get(), floats * sizeof(float));
        for (std::size_t i = 0; i < floats; ++i)
            buffer[i] = static_cast<float>(i & 1023) * 1e-3f;
        size = bytes;
    }
    return buffer.get();
}

/// Sum of `count` floats from p, 8 packet accumulators (more than the adds' latency
/// times the loads per cycle, so the adds never limit the read), in address order.
float read_floats(const float* p, std::size_t count) {
    using namespace Eigen::internal;
    using Packet = memattn::detail::Packet<float>;
    constexpr std::size_t lanes = memattn::detail::packet_lanes<float>;
    Packet acc[8];
    for (Packet& a : acc)
        a = pset1<Packet>(0.f);
    std::size_t i = 0;
    for (; i + 8 * lanes <= count; i += 8 * lanes)
        for (std::size_t u = 0; u < 8; ++u)
            acc[u] = padd(acc[u], ploadu<Packet>(p + i + u * lanes));
    float sum = predux(padd(padd(padd(acc[0], acc[1]), padd(acc[2], acc[3])),
                            padd(padd(acc[4], acc[5]), padd(acc[6], acc[7]))));
    for (; i < count; ++i)
        sum += p[i];
    return sum;
}

/// Median of `n` timings (seconds), reordering them.
double median(std::vector<double>& times) {
    const auto middle = times.begin() + static_cast<std::ptrdiff_t>(times.size() / 2);
    std::nth_element(times.begin(), middle, times.end());
    return *middle;
}

/// Seconds per streaming read of `bytes` on the executor's threads (each reads an equal
/// contiguous part): the median of at least 7 passes and 0.1 s, after one untimed pass.
double streaming_read_seconds(std::size_t bytes, const memattn::OpenMPExecutor& executor) {
    const float* data = stream_buffer(bytes);
    const std::size_t count = bytes / sizeof(float);
    const int threads = executor.concurrency();
    std::array<float, 64> sums{};
    const auto pass = [&] {
        executor.parallel_for(threads, [&](Index t) {
            const std::size_t first = count * static_cast<std::size_t>(t) / static_cast<std::size_t>(threads);
            const std::size_t last = count * static_cast<std::size_t>(t + 1) / static_cast<std::size_t>(threads);
            sums[static_cast<std::size_t>(t) % sums.size()] = read_floats(data + first, last - first);
        });
        benchmark::DoNotOptimize(sums);
    };
    pass();
    std::vector<double> times;
    times.reserve(1 << 16);
    const auto start = Clock::now();
    do {
        const auto before = Clock::now();
        pass();
        times.push_back(seconds_since(before));
    } while (times.size() < times.capacity() && (times.size() < 7 || seconds_since(start) < 0.1));
    return median(times);
}

/// CPU seconds the calling thread has run.
double thread_cpu_seconds() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

/// The FMA peak of the executor's threads: 12 independent chains of packet FMAs in
/// registers per thread (bench_common.hpp's fma_peak), 7 passes. Returns the FLOP/s of
/// the median pass in real time (what the cell's threads got of the cores, as the step
/// and the read do) and, beside it, the cores' own peak: each thread's rate over its own
/// CPU time summed over the threads, the best pass (which other processes do not change).
std::pair<double, double> fma_peak_flops(const memattn::OpenMPExecutor& executor) {
    using namespace Eigen::internal;
    using Packet = memattn::detail::Packet<float>;
    constexpr int chains = 12;
    constexpr Index steps = 1 << 18;
    constexpr double flops_per_thread = 2.0 * chains * memattn::detail::packet_lanes<float> * static_cast<double>(steps);
    const int threads = executor.concurrency();
    std::array<float, 64> sums{};
    std::array<double, 64> rates{};
    std::vector<double> times;
    double best = 0;
    for (int pass = 0; pass < 7; ++pass) {
        const auto start = Clock::now();
        executor.parallel_for(threads, [&](Index t) {
            const double cpu_start = thread_cpu_seconds();
            Packet acc[chains];
            for (int i = 0; i < chains; ++i)
                acc[i] = pset1<Packet>(0.001f * static_cast<float>(i + t));
            const Packet a = pset1<Packet>(0.999999f), b = pset1<Packet>(1e-7f);
            for (Index s = 0; s < steps; ++s)
                for (int i = 0; i < chains; ++i)
                    acc[i] = pmadd(acc[i], a, b);
            Packet total = acc[0];
            for (int i = 1; i < chains; ++i)
                total = padd(total, acc[i]);
            sums[static_cast<std::size_t>(t) % sums.size()] = predux(total);
            rates[static_cast<std::size_t>(t) % rates.size()] = flops_per_thread / (thread_cpu_seconds() - cpu_start);
        });
        times.push_back(seconds_since(start));
        benchmark::DoNotOptimize(sums);
        double sum = 0;
        for (int t = 0; t < threads; ++t)
            sum += rates[static_cast<std::size_t>(t)];
        best = std::max(best, sum);
    }
    return {flops_per_thread * threads / median(times), best};
}

/// The cell's counters (see the top of the file): its step time beside a streaming read
/// of `bytes` and `flops` at the FMA peak, measured now on the executor's threads.
void report_roofline(benchmark::State& state, double step_seconds, std::size_t bytes, double flops,
                     const memattn::OpenMPExecutor& executor) {
    const double read_seconds = streaming_read_seconds(bytes, executor);
    const auto [peak, core_peak] = fma_peak_flops(executor);
    const double fma_seconds = flops / peak;
    const double roofline = std::max(read_seconds, fma_seconds);
    state.counters["step_ms"] = step_seconds * 1e3;
    state.counters["read_ms"] = read_seconds * 1e3;
    state.counters["fma_ms"] = fma_seconds * 1e3;
    state.counters["roofline_ms"] = roofline * 1e3;
    state.counters["fraction"] = roofline / step_seconds;
    state.counters["compute_bound"] = fma_seconds > read_seconds ? 1.0 : 0.0;
    state.counters["MiB"] = static_cast<double>(bytes) / (1024.0 * 1024.0);
    state.counters["read_GBps"] = static_cast<double>(bytes) / read_seconds * 1e-9;
    state.counters["step_GBps"] = static_cast<double>(bytes) / step_seconds * 1e-9;
    state.counters["peak_GFLOPS"] = peak * 1e-9;
    state.counters["core_peak_GFLOPS"] = core_peak * 1e-9;
}

/// Each call of `step` timed on its own; the median (see decode_cell).
template <class Step>
double median_step_seconds(benchmark::State& state, const Step& step) {
    step();  // warms the caches and the team
    std::vector<double> times;
    times.reserve(1 << 20);
    for (auto _ : state) {
        const auto before = Clock::now();
        step();
        if (times.size() < times.capacity())
            times.push_back(seconds_since(before));
    }
    return median(times);
}

/// Synthetic packed rows of `cols` floats, one pool per width, made once.
const Matrix<float>& pool(Index cols, unsigned seed) {
    static std::vector<std::pair<std::pair<Index, unsigned>, std::unique_ptr<Matrix<float>>>> pools;
    for (const auto& [key, m] : pools)
        if (key == std::pair{cols, seed})
            return *m;
    pools.emplace_back(std::pair{cols, seed},
                       std::make_unique<Matrix<float>>(memattn::bench::random_matrix<float>(pool_tokens, cols, seed)));
    return *pools.back().second;
}

/// pool(cols, seed) in the scalar R, made once.
template <class R>
const Matrix<R>& pool_as(Index cols, unsigned seed) {
    if constexpr (std::is_same_v<R, float>) {
        return pool(cols, seed);
    } else {
        static std::vector<std::pair<std::pair<Index, unsigned>, std::unique_ptr<Matrix<R>>>> pools;
        for (const auto& [key, m] : pools)
            if (key == std::pair{cols, seed})
                return *m;
        pools.emplace_back(std::pair{cols, seed}, std::make_unique<Matrix<R>>(pool(cols, seed).template cast<R>()));
        return *pools.back().second;
    }
}

/// Whether the cell's `threads` threads can run: a build without OpenMP skips the cells
/// of more than one (SkipWithError).
bool threads_available([[maybe_unused]] benchmark::State& state, [[maybe_unused]] Index threads) {
#if !defined(_OPENMP)
    if (threads > 1) {
        state.SkipWithError("built without OpenMP");
        return false;
    }
#endif
    return true;
}

template <class S, class R = float>
void decode_cell(benchmark::State& state, bool with_update, memattn::FpMath fpmath = memattn::FpMath::strict) {
    const HeadLayout layout{state.range(0), state.range(1), head_dim};
    const Index length = state.range(2);
    const memattn::OpenMPExecutor executor{.threads = static_cast<int>(state.range(3))};
    if (!threads_available(state, state.range(3)))
        return;
    using Cache = memattn::KVCache<R, S>;  // R: the rows' scalar (a 16-bit R converts them)
    using Layer = memattn::MultiHead<Cache>;
    const Index kv_cols = layout.kv_heads * head_dim, q_cols = layout.q_heads * head_dim;
    const Matrix<R>& keys = pool_as<R>(kv_cols, 2);
    const Matrix<R>& values = pool_as<R>(kv_cols, 3);
    // Google Benchmark calls a cell several times while it sizes the iteration count: the
    // layer of the last cell is kept (one at a time) so that it is filled once per cell.
    static std::string kept_name;
    static std::shared_ptr<void> kept;
    const std::string name = std::string(typeid(Cache).name()) + "/" + std::to_string(layout.q_heads) + "/" +
                             std::to_string(layout.kv_heads) + "/" + std::to_string(length) + "/" +
                             std::to_string(static_cast<int>(fpmath));
    if (name != kept_name || !kept) {
        kept.reset();  // at most one filled layer at a time
        kept_name.clear();
        auto made = std::make_shared<Layer>(
            layout, [fpmath](Index) { return Cache(head_dim, head_dim, memattn::SoftmaxOptions{.fpmath = fpmath}); });
        made->reserve(length + 1);
        for (Index filled = 0; filled < length; filled += pool_tokens) {
            const Index n = std::min(pool_tokens, length - filled);
            made->extend(keys.topRows(n), values.topRows(n));
        }
        kept = made;
        kept_name = name;
    }
    Layer& mem = *static_cast<Layer*>(kept.get());
    mem.truncate(length);
    mem.set_executor(executor);
    const std::size_t bytes = mem.footprint();  // every KV head's K and V at `length`, as stored
    const Matrix<R>& queries = pool_as<R>(q_cols, 1);
    Matrix<R> out(1, q_cols);
    Index t = 0;
    const auto step = [&] {
        const Index row = t++ % pool_tokens;
        if (with_update)
            mem.update(keys.row(row), values.row(row));
        mem.attend(queries.row(row), out.row(0));
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
        if (with_update)
            mem.truncate(length);
    };
    // Each iteration timed on its own: the median is what a step costs when no other
    // process takes its core meanwhile (on a shared machine the mean is the scheduler's).
    const double step_seconds = median_step_seconds(state, step);
    const double flops = 2.0 * static_cast<double>(layout.q_heads) * static_cast<double>(length) *
                         static_cast<double>(head_dim + head_dim);
    report_roofline(state, step_seconds, bytes, flops, executor);
}

template <class S>
void BM_DecodeStep(benchmark::State& state) {
    decode_cell<S>(state, true);
}
template <class S>
void BM_DecodeAttend(benchmark::State& state) {
    decode_cell<S>(state, false);
}
/// The step of BM_DecodeStep<bfloat16> through the layer of bfloat16 rows,
/// MultiHead<KVCache<Eigen::bfloat16>>: what converting the rows costs is the difference.
void BM_DecodeStepBf16Rows(benchmark::State& state) {
    decode_cell<Eigen::bfloat16, Eigen::bfloat16>(state, true);
}
/// The step of BM_DecodeStep<S> (S bfloat16, Fp8E4M3 or Fp8E5M2) with FpMath::bf16: the
/// queries and the weights rounded to bfloat16, the stored values multiplied as they are
/// by vdpbf16ps (AVX512-BF16; elsewhere the float products on the rounded queries).
template <class S>
void BM_DecodeStepFpMathBf16(benchmark::State& state) {
    decode_cell<S>(state, true, memattn::FpMath::bf16);
}

/// A model's decode step over N layers (see the top of the file): each layer's attend of
/// one token in turn. The layers are built once per (S, N, L, F) and kept, as
/// decode_cell's one.
template <class S>
void BM_DecodeLayers(benchmark::State& state) {
    const Index layers = state.range(0), length = state.range(1);
    const memattn::FpMath fpmath = state.range(2) == 1 ? memattn::FpMath::bf16 : memattn::FpMath::strict;
    const memattn::OpenMPExecutor executor{.threads = static_cast<int>(state.range(3))};
    if (!threads_available(state, state.range(3)))
        return;
    const HeadLayout layout{32, 8, head_dim};
    using Cache = memattn::KVCache<float, S>;
    using Layer = memattn::MultiHead<Cache>;
    const Index kv_cols = layout.kv_heads * head_dim, q_cols = layout.q_heads * head_dim;
    static std::string kept_name;
    static std::vector<Layer> kept;
    const std::string name = std::string(typeid(Cache).name()) + "/" + std::to_string(layers) + "/" +
                             std::to_string(length) + "/" + std::to_string(static_cast<int>(fpmath));
    if (name != kept_name) {
        kept.clear();  // at most one model at a time
        kept_name.clear();
        for (Index l = 0; l < layers; ++l) {
            Layer& layer = kept.emplace_back(
                layout, [fpmath](Index) { return Cache(head_dim, head_dim, memattn::SoftmaxOptions{.fpmath = fpmath}); });
            layer.reserve(length);
            for (Index filled = 0; filled < length; filled += pool_tokens) {
                const Index n = std::min(pool_tokens, length - filled);
                layer.extend(pool(kv_cols, 2).topRows(n), pool(kv_cols, 3).topRows(n));  // stores of its own
            }
        }
        kept_name = name;
    }
    std::size_t bytes = 0;
    for (Layer& layer : kept) {
        layer.set_executor(executor);
        bytes += layer.footprint();
    }
    const Matrix<float>& queries = pool(q_cols, 1);
    Matrix<float> out(1, q_cols);
    Index t = 0;
    const double step_seconds = median_step_seconds(state, [&] {
        const Index row = t++ % pool_tokens;
        for (Layer& layer : kept)
            layer.attend(queries.row(row), out.row(0));
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
    });
    const double flops = 2.0 * static_cast<double>(layers) * static_cast<double>(layout.q_heads) *
                         static_cast<double>(length) * static_cast<double>(head_dim + head_dim);
    report_roofline(state, step_seconds, bytes, flops, executor);
}

/// One KV head's grouped attend (attend_group of g queries, d = dv = 128) over a
/// KVCache<float, bfloat16> of L tokens, strict (fpmath:0) or FpMath::bf16 (fpmath:1):
/// at L = 512 its 256 KiB of pairs sit in L2, so the cell shows the arithmetic of the
/// two routes (ns_per_key, and the fraction of the roofline, FMA-bound there).
/// The AMX instructions, reported as not there: GroupAttention<float, NoTiles> keeps
/// FpMath::bf16 on vdpbf16ps (BM_GroupAttend's fpmath:2).
struct NoTiles : memattn::detail::AmxHardware {
    static constexpr bool available = false;
};

void BM_GroupAttend(benchmark::State& state) {
    const Index g = state.range(0), length = state.range(1), mode = state.range(2);
    const memattn::FpMath fpmath = mode >= 1 ? memattn::FpMath::bf16 : memattn::FpMath::strict;
    const memattn::OpenMPExecutor executor{.threads = 1};
    memattn::KVCache<float, Eigen::bfloat16> cache(head_dim, head_dim, memattn::SoftmaxOptions{.fpmath = fpmath});
    cache.extend(pool(head_dim, 2).topRows(length), pool(head_dim, 3).topRows(length));
    const Matrix<float> queries = pool(head_dim, 1).topRows(g);
    Matrix<float> out(g, head_dim);
    const auto without_tiles = [&] {  // the cache's attend_group, its group kept off the tiles
        memattn::detail::GroupAttention<float, NoTiles> group(queries, static_cast<float>(cache.scale()), false,
                                                              {.bf16_products = true});
        out.setZero();
        cache.for_each_stored_run([&](const auto& keys, const auto& values, Index first, Index n) {
            group.fold_stored(keys, values, first, n, out);
        });
        for (Index r = 0; r < g; ++r)
            group.finish(r, out.row(r));
    };
    const double step_seconds = median_step_seconds(state, [&] {
        if (mode == 2)
            without_tiles();
        else
            cache.attend_group(queries, out);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
    });
    state.counters["ns_per_key"] = step_seconds * 1e9 / static_cast<double>(length);
    const double flops = 2.0 * static_cast<double>(g) * static_cast<double>(length) * (2.0 * head_dim);
    report_roofline(state, step_seconds, cache.footprint(), flops, executor);
}

void BM_DecodeVariants(benchmark::State& state) {
    const HeadLayout layout{32, 8, head_dim};
    const Index length = state.range(0), variant = state.range(1), g = layout.group_size();
    const memattn::OpenMPExecutor executor{.threads = 1};
    std::vector<double> slopes, sinks;
    for (Index h = 0; h < layout.q_heads; ++h) {
        slopes.push_back(std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(layout.q_heads)));
        sinks.push_back(0.5);
    }
    const memattn::Rope rope{.theta = 500000, .head_dim = head_dim};
    using Cache = memattn::KVCache<float>;
    memattn::MultiHead<Cache> mem(layout, [&](Index kv) {
        memattn::SoftmaxOptions options;
        if (variant == 1 || variant == 3) {
            options.softcap = 30;
            options.alibi_slopes = std::span<const double>(slopes).subspan(static_cast<std::size_t>(kv * g),
                                                                           static_cast<std::size_t>(g));
            options.sink_logits = std::span<const double>(sinks).subspan(static_cast<std::size_t>(kv * g),
                                                                          static_cast<std::size_t>(g));
        }
        return variant >= 2 ? Cache(head_dim, head_dim, options, rope) : Cache(head_dim, head_dim, options);
    });
    const Index kv_cols = layout.kv_heads * head_dim, q_cols = layout.q_heads * head_dim;
    const Matrix<float>& keys = pool(kv_cols, 2);
    const Matrix<float>& values = pool(kv_cols, 3);
    mem.reserve(length + 1);
    for (Index filled = 0; filled < length; filled += pool_tokens) {
        const Index n = std::min(pool_tokens, length - filled);
        mem.extend(keys.topRows(n), values.topRows(n));
    }
    mem.set_executor(executor);
    const std::size_t bytes = mem.footprint();
    const Matrix<float>& queries = pool(q_cols, 1);
    Matrix<float> out(1, q_cols);
    Index t = 0;
    const double step_seconds = median_step_seconds(state, [&] {
        const Index row = t++ % pool_tokens;
        mem.update(keys.row(row), values.row(row));
        mem.attend(queries.row(row), out.row(0));
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
        mem.truncate(length);
    });
    const double flops = 2.0 * static_cast<double>(layout.q_heads) * static_cast<double>(length) *
                         static_cast<double>(head_dim + head_dim);
    report_roofline(state, step_seconds, bytes, flops, executor);
}

/// One KV head of d = dv = 128 in float (a group of `q` query heads) at `length` tokens:
/// KVCache (block 0) or SparseKVCache with top_k_blocks · block = 2048, a window of 64 and
/// 4 sinks. The step is update, attend_group and truncate back, as BM_DecodeStep's; its
/// bytes are what the step must read: every pair for KVCache; for the sparse cache the
/// bounds of every block and the pairs it attends.
void BM_SparseDecode(benchmark::State& state) {
    const Index length = state.range(0), block = state.range(1), g = state.range(2);
    const memattn::OpenMPExecutor executor{.threads = 1};
    const memattn::SparseKVOptions sparse{
        .block = std::max<Index>(block, 1), .top_k_blocks = 2048 / std::max<Index>(block, 1), .window = 64, .sinks = 4};
    const Matrix<float>& keys = pool(head_dim, 2);
    const Matrix<float>& values = pool(head_dim, 3);
    const Matrix<float>& queries = pool(g * head_dim, 1);
    Matrix<float> out(g, head_dim);
    const auto run = [&](auto& mem) {
        mem.reserve(length + 1);
        for (Index filled = 0; filled < length; filled += pool_tokens) {
            const Index n = std::min(pool_tokens, length - filled);
            mem.extend(keys.topRows(n), values.topRows(n));
        }
        Index t = 0;
        return median_step_seconds(state, [&] {
            const Index row = t++ % pool_tokens;
            mem.update(keys.row(row), values.row(row));
            const Eigen::Map<const Matrix<float>> q(queries.row(row).data(), g, head_dim);
            mem.attend_group(q, out);
            benchmark::DoNotOptimize(out.data());
            benchmark::ClobberMemory();
            mem.truncate(length);
        });
    };
    const auto pair_bytes = static_cast<double>(2 * head_dim * sizeof(float));
    double step_seconds = 0, bytes = 0, flops = 0;
    if (block == 0) {
        memattn::KVCache<float> mem(head_dim, head_dim);
        step_seconds = run(mem);
        bytes = static_cast<double>(length + 1) * pair_bytes;
        flops = 2.0 * static_cast<double>(g * (length + 1) * 2 * head_dim);
    } else {
        memattn::SparseKVCache<float> mem(head_dim, head_dim, sparse);
        step_seconds = run(mem);
        const double blocks = static_cast<double>((length + block) / block);
        const double pairs = static_cast<double>(sparse.top_k_blocks * block + sparse.window + sparse.sinks);
        bytes = static_cast<double>(mem.footprint() - mem.pairs().footprint()) + pairs * pair_bytes;  // the bounds
        flops = 2.0 * static_cast<double>(g) * (blocks * 2.0 * head_dim + pairs * 2.0 * head_dim);
    }
    report_roofline(state, step_seconds, static_cast<std::size_t>(bytes), flops, executor);
}

template <class S>
void latent_decode_cell(benchmark::State& state, memattn::FpMath fpmath) {
    constexpr Index r = 512, dr = 64, nope = 128, dv = 128;
    const Index heads = state.range(0), length = state.range(1);
    const bool absorbed = state.range(3) != 0;
    const memattn::OpenMPExecutor executor{.threads = static_cast<int>(state.range(2))};
    if (!threads_available(state, state.range(2)))
        return;
    memattn::LatentKVCache<float, S> cache(r, dr, static_cast<float>(memattn::mla_softmax_scale(nope + dr, 40)),
                                           {.fpmath = fpmath});
    cache.reserve(length);
    const Matrix<float>& rows = pool(r + dr, 2);
    for (Index filled = 0; filled < length; filled += pool_tokens) {
        const Index n = std::min(pool_tokens, length - filled);
        cache.extend(rows.topRows(n).leftCols(r), rows.topRows(n).rightCols(dr));
    }
    const Matrix<float> queries = pool(r + dr, 1).topRows(heads), q_nope = pool(nope, 3).topRows(heads),
                        q_rope = pool(dr, 4).topRows(heads);
    const Matrix<float> W_UK = memattn::bench::random_matrix<float>(heads * nope, r, 5) * 0.05f,
                        W_UV = memattn::bench::random_matrix<float>(heads * dv, r, 6) * 0.05f;
    Matrix<float> latent(heads, r), out(heads, dv);
    const double step_seconds = median_step_seconds(state, [&] {
        if (absorbed)
            memattn::mla_decode(cache, q_nope, q_rope, W_UK, W_UV, out, executor);
        else
            cache.attend(queries, latent, executor);
    });
    std::size_t bytes = cache.footprint();
    if (absorbed)
        bytes += sizeof(float) * static_cast<std::size_t>(W_UK.size() + W_UV.size());
    const double flops = 2.0 * static_cast<double>(heads) * static_cast<double>(length) * (2 * r + dr);
    report_roofline(state, step_seconds, bytes, flops, executor);
    state.counters["GFLOPS"] = flops / step_seconds * 1e-9;
    state.counters["token_bytes"] = static_cast<double>(memattn::LatentKVCache<float, S>::token_bytes(r, dr));
    if (fpmath == memattn::FpMath::bf16)
        state.counters["amx"] =  // the tiles ran: pairs, the CPU's and the OS's consent, an even row
            memattn::bf16_products() == memattn::Bf16Products::amx_tiles && (r + dr) % 2 == 0 ? 1 : 0;
}

template <class S>
void BM_LatentDecode(benchmark::State& state) {
    latent_decode_cell<S>(state, memattn::FpMath::strict);
}

/// The bfloat16 cache with FpMath::bf16: the rows multiplied as bfloat16 pairs (AMX tiles
/// where the CPU has them, else vdpbf16ps, else float products), the queries rounded.
void BM_LatentDecodeFpMathBf16(benchmark::State& state) {
    latent_decode_cell<Eigen::bfloat16>(state, memattn::FpMath::bf16);
}

template <class S>
void BM_PagedLatentDecode(benchmark::State& state) {
    constexpr Index r = 512, dr = 64, nope = 128, dv = 128;
    const Index heads = state.range(0), batch = state.range(1), length = state.range(2), mode = state.range(4);
    const bool paged = mode == 1 || mode == 2, step = mode >= 2;
    const memattn::OpenMPExecutor executor{.threads = static_cast<int>(state.range(3))};
    if (!threads_available(state, state.range(3)))
        return;
    const float scale = static_cast<float>(memattn::mla_softmax_scale(nope + dr, 40));
    const Matrix<float>& rows = pool(r + dr, 2);
    const auto fill = [&](auto&& extend) {
        for (Index filled = 0; filled < length; filled += pool_tokens) {
            const Index n = std::min(pool_tokens, length - filled);
            extend(rows.topRows(n).leftCols(r), rows.topRows(n).rightCols(dr));
        }
    };
    const Index block = 128, blocks = batch * ((length + block - 1) / block);
    memattn::PagedLatentKVCache<float, S> paged_pool(r, dr, scale, paged ? blocks : 1, block);
    std::vector<memattn::LatentKVCache<float, S>> caches;
    std::vector<Index> seqs;
    for (Index i = 0; i < batch; ++i) {
        if (paged) {
            seqs.push_back(paged_pool.add_sequence());
            fill([&](const auto& c, const auto& kr) { paged_pool.extend(seqs.back(), c, kr); });
        } else {
            caches.emplace_back(r, dr, scale);
            caches.back().reserve(length);
            fill([&](const auto& c, const auto& kr) { caches.back().extend(c, kr); });
        }
    }
    Matrix<float> queries(batch * heads, r + dr), latent(batch * heads, r);
    Matrix<float> q_nope(batch * heads, nope), q_rope(batch * heads, dr), out(batch * heads, dv);
    for (Index i = 0; i < batch; ++i) {
        queries.middleRows(i * heads, heads) = pool(r + dr, 1).topRows(heads);
        q_nope.middleRows(i * heads, heads) = pool(nope, 3).topRows(heads);
        q_rope.middleRows(i * heads, heads) = pool(dr, 4).topRows(heads);
    }
    const Matrix<float> W_UK = memattn::bench::random_matrix<float>(heads * nope, r, 5) * 0.05f,
                        W_UV = memattn::bench::random_matrix<float>(heads * dv, r, 6) * 0.05f;
    const double step_seconds = median_step_seconds(state, [&] {
        if (mode == 2) {
            memattn::mla_decode(paged_pool, seqs, q_nope, q_rope, W_UK, W_UV, out, executor);
        } else if (mode == 3) {
            for (Index i = 0; i < batch; ++i)
                memattn::mla_decode(caches[static_cast<std::size_t>(i)], q_nope.middleRows(i * heads, heads),
                                    q_rope.middleRows(i * heads, heads), W_UK, W_UV,
                                    out.middleRows(i * heads, heads), executor);
        } else if (paged) {
            paged_pool.attend(seqs, queries, latent, executor);
        } else {
            for (Index i = 0; i < batch; ++i)
                caches[static_cast<std::size_t>(i)].attend(queries.middleRows(i * heads, heads),
                                                           latent.middleRows(i * heads, heads), executor);
        }
    });
    auto bytes = static_cast<std::size_t>(batch * length) * memattn::LatentKVCache<float, S>::token_bytes(r, dr);
    if (step)
        bytes += sizeof(float) * static_cast<std::size_t>(W_UK.size() + W_UV.size()) *
                 static_cast<std::size_t>(mode == 3 ? batch : 1);
    const double flops = 2.0 * static_cast<double>(batch * heads) * static_cast<double>(length) * (2 * r + dr);
    report_roofline(state, step_seconds, bytes, flops, executor);
    state.counters["GFLOPS"] = flops / step_seconds * 1e-9;
}

void paged_latent_cells(benchmark::internal::Benchmark* b) {
    b->ArgNames({"heads", "batch", "length", "t", "pool"});
    for (Index threads : {1, 2}) {
        for (Index mode : {0, 1, 2, 3})
            b->Args({128, 8, 1024, threads, mode});
        for (Index mode : {0, 1})
            b->Args({16, 8, 4096, threads, mode});
    }
    b->UseRealTime()->Unit(benchmark::kMillisecond);
}

/// The median time of `timed` alone over the benchmark's iterations: `before` runs
/// untimed ahead of each (a verify step ahead of its accept), `after` untimed behind it.
template <class Before, class Timed, class After>
double median_timed_seconds(benchmark::State& state, Before&& before, Timed&& timed, After&& after) {
    std::vector<double> times;
    times.reserve(1 << 16);
    for (auto _ : state) {
        before();
        const auto start = Clock::now();
        timed();
        if (times.size() < times.capacity())
            times.push_back(seconds_since(start));
        after();
    }
    return median(times);
}

template <class S = float, memattn::FpMath Arithmetic = memattn::FpMath::strict>
void BM_PoolTreeVerify(benchmark::State& state) {
    const Index past = state.range(0), mode = state.range(1), drafts = 64;
    const HeadLayout layout{32, 8, head_dim};
    const Index kw = layout.kv_heads * head_dim, qw = layout.q_heads * head_dim;
    const bool windowed = mode >= 5;
    std::vector<double> slopes(static_cast<std::size_t>(layout.q_heads));
    for (std::size_t h = 0; h < slopes.size(); ++h)
        slopes[h] = std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(layout.q_heads));  // ALiBi's
    const memattn::SoftmaxOptions options =
        windowed ? memattn::SoftmaxOptions{.window = 1024, .alibi_slopes = slopes, .fpmath = Arithmetic}
                 : memattn::SoftmaxOptions{.fpmath = Arithmetic};
    memattn::PagedKVCache<float, S> paged(layout, past / 128 + 4, 128, options,
                                          memattn::PoolOptions{.rollback_tokens = windowed ? 64 : 0});
    const Index seq = paged.add_sequence();
    const Matrix<float>& keys = pool(kw, 2);
    const Matrix<float>& values = pool(kw, 3);
    for (Index filled = 0; filled < past; filled += pool_tokens) {
        const Index n = std::min(pool_tokens, past - filled);
        paged.extend(seq, keys.topRows(n), values.topRows(n));
    }
    std::vector<Index> parents{-1};
    for (Index i = 1; i < drafts; ++i)
        parents.push_back((i - 1) / 2);
    const std::vector<Index> path{0, 1, 3, 7, 15};  // a chain of the binary tree
    const Matrix<float> Q = pool(qw, 1).topRows(drafts), K = keys.topRows(drafts), V = values.topRows(drafts);
    Matrix<float> O(drafts, qw);
    const std::vector<Index> seqs{seq}, offsets{0, drafts};
    const auto verify = [&] { paged.prefill(seqs, offsets, Q, K, V, O, memattn::SerialExecutor{}, parents); };
    double seconds = 0;
    if (mode == 2) {
        seconds = median_timed_seconds(state, verify, [&] { paged.accept(seq, path); },
                                       [&] { paged.truncate(seq, past); });
    } else {
        seconds = median_step_seconds(state, [&] {
            if (mode == 0 || mode == 5) {
                verify();
                paged.reject(seq);
            } else if (mode == 4) {
                paged.prefill(seqs, offsets, Q, K, V, O, memattn::SerialExecutor{});
                paged.truncate(seq, past);
            } else {
                for (Index i = 0; i < (mode == 1 || mode == 6 ? drafts : 1); ++i)
                    memattn::batched_decode(paged, seqs, Q.middleRows(i, 1), K.middleRows(i, 1), V.middleRows(i, 1),
                                            O.middleRows(i, 1), memattn::SerialExecutor{});
                paged.truncate(seq, past);
            }
        });
    }
    state.counters["step_us"] = seconds * 1e6;
    benchmark::DoNotOptimize(O.data());
}

void BM_StatePoolDecode(benchmark::State& state) {
    using Recurrent = memattn::MultiHead<memattn::DeltaRuleMemory<float>>;
    constexpr Index heads = 8, sequences = 32;
    const memattn::OpenMPExecutor executor{.threads = static_cast<int>(state.range(0))};
    const Index mode = state.range(1);
    if (!threads_available(state, state.range(0)))
        return;
    const Recurrent prototype({.q_heads = heads, .kv_heads = heads, .head_dim = head_dim}, [](Index) {
        return memattn::DeltaRuleMemory<float>(head_dim, head_dim, {.qk_l2norm = true});
    });
    const Index kw = prototype.key_dim(), qw = prototype.query_dim();
    const Matrix<float> Q = memattn::bench::random_matrix<float>(sequences, qw, 1);
    Matrix<float> K = memattn::bench::random_matrix<float>(sequences, kw, 2);
    const Matrix<float> V = memattn::bench::random_matrix<float>(sequences, prototype.value_dim(), 3);
    for (Index h = 0; h < heads; ++h)
        K.col(h * (head_dim + 1) + head_dim).setConstant(0.5f);  // β
    Matrix<float> O(sequences, prototype.output_dim());
    memattn::StatePool<Recurrent> pool(sequences, prototype);
    std::vector<Recurrent> separate(static_cast<std::size_t>(sequences), prototype);
    std::vector<Index> ids;
    for (Index i = 0; i < sequences; ++i)
        ids.push_back(pool.add());
    const double step_seconds = median_step_seconds(state, [&] {
        if (mode == 0)
            pool.decode(ids, Q, K, V, O, executor);
        else
            memattn::batched_decode(std::span<Recurrent>(separate), Q, K, V, O, executor);
    });
    const std::size_t bytes = static_cast<std::size_t>(sequences) * prototype.footprint();
    const double flops = 6.0 * static_cast<double>(sequences * heads) * head_dim * head_dim;
    report_roofline(state, step_seconds, bytes, flops, executor);
}

void BM_StateTreeVerify(benchmark::State& state) {
    using Recurrent = memattn::MultiHead<memattn::DeltaRuleMemory<float>>;
    constexpr Index heads = 8, drafts = 64;
    const Index mode = state.range(0);
    const Recurrent prototype({.q_heads = heads, .kv_heads = heads, .head_dim = head_dim}, [](Index) {
        return memattn::DeltaRuleMemory<float>(head_dim, head_dim, {.qk_l2norm = true});
    });
    const Index kw = prototype.key_dim(), qw = prototype.query_dim();
    const Matrix<float> Q = memattn::bench::random_matrix<float>(drafts, qw, 1);
    Matrix<float> K = memattn::bench::random_matrix<float>(drafts, kw, 2);
    const Matrix<float> V = memattn::bench::random_matrix<float>(drafts, prototype.value_dim(), 3);
    for (Index h = 0; h < heads; ++h)
        K.col(h * (head_dim + 1) + head_dim).setConstant(0.5f);  // β
    Matrix<float> O(drafts, prototype.output_dim());
    memattn::StatePool<Recurrent> pool(1, prototype, {.checkpoint_tokens = drafts, .draft_states = drafts});
    const Index seq = pool.add();
    const std::vector<Index> seqs{seq}, offsets{0, drafts};
    pool.prefill(seqs, offsets, Q, K, V, O, memattn::SerialExecutor{});  // 64 tokens: a checkpoint there
    std::vector<Index> parents{-1};
    for (Index i = 1; i < drafts; ++i)
        parents.push_back((i - 1) / 2);
    const std::vector<Index> path{0, 1, 3, 7, 15};  // a chain of the binary tree
    const auto verify = [&] { pool.prefill(seqs, offsets, Q, K, V, O, memattn::SerialExecutor{}, parents); };
    double seconds = 0;
    if (mode == 2) {
        seconds = median_timed_seconds(state, verify, [&] { pool.accept(seq, path); },
                                       [&] { pool.truncate(seq, drafts); });
    } else {
        seconds = median_step_seconds(state, [&] {
            if (mode == 0) {
                verify();
                pool.reject(seq);
            } else {
                for (Index i = 0; i < (mode == 1 ? drafts : 1); ++i)
                    pool.decode(seqs, Q.middleRows(i, 1), K.middleRows(i, 1), V.middleRows(i, 1), O.middleRows(i, 1),
                                memattn::SerialExecutor{});
                if (mode == 1)  // (one step alone grows the sequence: a state's cost does not)
                    pool.truncate(seq, drafts);
            }
        });
    }
    state.counters["step_us"] = seconds * 1e6;
    benchmark::DoNotOptimize(O.data());
}

template <class S>
void latent_prefill_cell(benchmark::State& state, memattn::FpMath fpmath) {
    constexpr Index r = 512, dr = 64, nope = 128, dv = 128;
    const Index heads = state.range(0), past = state.range(1), n = state.range(2);
    const auto mode = static_cast<memattn::MlaPrefill>(state.range(4));
    const memattn::OpenMPExecutor executor{.threads = static_cast<int>(state.range(3))};
    if (!threads_available(state, state.range(3)))
        return;
    const Matrix<float> rows = memattn::bench::random_matrix<float>(past + n, r + dr, 2);
    const Matrix<float> q_nope = memattn::bench::random_matrix<float>(n * heads, nope, 3),
                        q_rope = memattn::bench::random_matrix<float>(n * heads, dr, 4);
    const Matrix<float> W_UK = memattn::bench::random_matrix<float>(heads * nope, r, 5) * 0.05f,
                        W_UV = memattn::bench::random_matrix<float>(heads * dv, r, 6) * 0.05f;
    Matrix<float> out(n * heads, dv);
    memattn::LatentKVCache<float, S> cache(r, dr, static_cast<float>(memattn::mla_softmax_scale(nope + dr, 40)),
                                           {.fpmath = fpmath});
    cache.reserve(past + n);
    cache.extend(rows.topRows(past).leftCols(r), rows.topRows(past).rightCols(dr));
    const double step_seconds = median_step_seconds(state, [&] {
        cache.truncate(past);
        memattn::mla_prefill(cache, q_nope, q_rope, rows.bottomRows(n).leftCols(r), rows.bottomRows(n).rightCols(dr),
                             W_UK, W_UV, out, executor, mode);
    });
    const double pairs = static_cast<double>(heads) * static_cast<double>(n) *
                         (static_cast<double>(past) + static_cast<double>(n + 1) / 2);
    const double flops = mode == memattn::MlaPrefill::expanded
                             ? pairs * 2 * (nope + dr + dv) +
                                   static_cast<double>(heads) * static_cast<double>(past + n) * 2 * r * (nope + dv)
                             : pairs * 2 * (2 * r + dr) + static_cast<double>(heads) * static_cast<double>(n) * 2 * r * (nope + dv);
    report_roofline(state, step_seconds, cache.footprint(), flops, executor);
    state.counters["GFLOPS"] = flops / step_seconds * 1e-9;
}

void BM_LatentPrefill(benchmark::State& state) { latent_prefill_cell<float>(state, memattn::FpMath::strict); }

/// The same over a bfloat16 cache with FpMath::bf16 (the kernel's products in bfloat16:
/// AMX tiles where the CPU has them).
void BM_LatentPrefillFpMathBf16(benchmark::State& state) {
    latent_prefill_cell<Eigen::bfloat16>(state, memattn::FpMath::bf16);
}

void latent_prefill_cells(benchmark::internal::Benchmark* b) {
    b->ArgNames({"heads", "past", "tokens", "t", "mode"});
    for (Index threads : {1, 2})
        b->Args({128, 0, 2048, threads, 2});
    for (Index past : {0, 4096})
        for (Index n : {64, 128, 256, 512, 1024})
            for (Index mode : {1, 2})
                b->Args({16, past, n, 1, mode});
    b->UseRealTime()->Unit(benchmark::kMillisecond);
}

void latent_cells(benchmark::internal::Benchmark* b) {
    b->ArgNames({"heads", "length", "t", "absorbed"});
    for (Index length : {8192, 65536})
        for (Index threads : {1, 2})
            b->Args({128, length, threads, 0});
    b->Args({16, 8192, 1, 0});
    b->Args({128, 8192, 1, 1});
    b->UseRealTime()->Unit(benchmark::kMillisecond);
}

void cells(benchmark::internal::Benchmark* b) {
    b->ArgNames({"q", "kv", "length", "t"});
    for (auto [q, kv] : {std::pair<Index, Index>{32, 8}, {8, 1}})
        for (Index length : {4096, 32768, 131072})
            for (Index threads : {1, 2})
                b->Args({q, kv, length, threads});
    b->UseRealTime()->Unit(benchmark::kMillisecond);
}

// Serving (issue 26): 32 sequences of uneven lengths, 512 to 8192 tokens evenly spaced,
// of a 32/8 × 128 layer, one token each per step, the sequences taken back to their
// lengths after every step.
//   BM_BatchedDecode<S>/block:B/t:T    batched_decode over one PagedKVCache<float, S> of
//       blocks of B tokens; counters as above (bytes: the pairs of every sequence, as
//       stored) and wasted_MiB, the bytes of the blocks held past the tokens
//   BM_BatchedDecodeFpMathBf16<S>/...  the same with FpMath::bf16 (S bfloat16 or Fp8E4M3)
//   BM_SeparateDecode<S>/t:T           the same steps as 32 MultiHead<KVCache<float, S>>,
//       one update and attend each
//   BM_PrefixSharing<S>/block:B        16 sequences forked from one 2048-token prompt, one
//       token each per step: held_MiB (the pool's blocks in use) against private_MiB
//       (16 caches of the same tokens)
//   BM_ModelStep/model:M                 a decode step of 16 sequences of 512 tokens through
//       4 layers (8/2 heads × 64, float, blocks of 32, one thread): M = 0 batched_decode on
//       4 PagedKVCache of their own, M = 1 plan_decode and decode on a ModelCache of the
//       same layers; what the model cache adds per step is the difference
//   BM_SharedPrefix<S>/shared:X/t:T    16 sequences of a 4096-token prompt and 64 tokens
//       of their own each, one token each per step (blocks of 128): X = 1 forks of one
//       prompt, whose shared blocks a step reads once (serving/cascade.hpp), X = 0 the
//       same tokens in 16 unshared sequences; step_ms, and MiB (the bytes each reads)
//   BM_MixedBatch/t:T                  a step of a server's mixed batch over one pool of
//       blocks of 128 (32/8 × 128, float): 28 sequences of 512 to 4096 tokens decoding one
//       token each beside 4 prompts of 1024 cached tokens bringing a chunk of 256 rows
//       each. Both ways alternate in each iteration: mixed_ms, the batch as one
//       batched_prefill, against parts_ms, batched_prefill of the 4 chunks then
//       batched_decode of the 28 tokens; parts_over_mixed > 1 when the one call is faster
constexpr Index serving_batch = 32;
const HeadLayout serving_layout{32, 8, head_dim};

Index serving_length(Index i) { return 512 + i * (8192 - 512) / (serving_batch - 1); }

/// The bytes of a token's K and V in every KV head of the serving layout, as S stores them.
template <class S>
std::size_t token_bytes() {
    return static_cast<std::size_t>(serving_layout.kv_heads) *
           2 * memattn::detail::StoredRows<float, S>::row_bytes(head_dim);
}

template <class S, bool bf16 = false>
void BM_BatchedDecode(benchmark::State& state) {
    const Index block = state.range(0);
    const memattn::OpenMPExecutor executor{.threads = static_cast<int>(state.range(1))};
    const Index kv_cols = serving_layout.kv_heads * head_dim, q_cols = serving_layout.q_heads * head_dim;
    const Matrix<float>& keys = pool(kv_cols, 2);
    const Matrix<float>& values = pool(kv_cols, 3);
    Index blocks = 0, tokens = 0;
    for (Index i = 0; i < serving_batch; ++i) {
        blocks += serving_length(i) / block + 1;
        tokens += serving_length(i);
    }
    using Pool = memattn::PagedKVCache<float, S>;
    static std::string kept_name;
    static std::shared_ptr<Pool> kept;
    static std::vector<Index> ids;
    const std::string name = std::string(typeid(S).name()) + "/" + std::to_string(block) + (bf16 ? "/bf16" : "");
    if (name != kept_name || !kept) {
        kept.reset();
        kept_name.clear();
        kept = std::make_shared<Pool>(serving_layout, blocks, block,
                                      memattn::SoftmaxOptions{.fpmath = bf16 ? memattn::FpMath::bf16
                                                                             : memattn::FpMath::strict});
        ids.clear();
        for (Index i = 0; i < serving_batch; ++i) {
            ids.push_back(kept->add_sequence());
            for (Index filled = 0; filled < serving_length(i); filled += pool_tokens) {
                const Index n = std::min(pool_tokens, serving_length(i) - filled);
                kept->extend(ids.back(), keys.topRows(n), values.topRows(n));
            }
        }
        kept_name = name;
    }
    Pool& paged = *kept;
    const Matrix<float> Q = pool(q_cols, 1).topRows(serving_batch), K = keys.topRows(serving_batch),
                        V = values.topRows(serving_batch);
    Matrix<float> O(serving_batch, q_cols);
    const auto step = [&] {
        memattn::batched_decode(paged, ids, Q, K, V, O, executor);
        benchmark::DoNotOptimize(O.data());
        benchmark::ClobberMemory();
        for (Index i = 0; i < serving_batch; ++i)
            paged.truncate(ids[static_cast<std::size_t>(i)], serving_length(i));
    };
    const double step_seconds = median_step_seconds(state, step);
    const std::size_t bytes = static_cast<std::size_t>(tokens) * token_bytes<S>();
    const double flops = 2.0 * static_cast<double>(serving_layout.q_heads) * static_cast<double>(tokens) *
                         static_cast<double>(2 * head_dim);
    report_roofline(state, step_seconds, bytes, flops, executor);
    state.counters["wasted_MiB"] =
        static_cast<double>(static_cast<std::size_t>(paged.blocks_in_use() * block) * token_bytes<S>() - bytes) /
        (1024.0 * 1024.0);
}

template <class S>
void BM_SeparateDecode(benchmark::State& state) {
    const memattn::OpenMPExecutor executor{.threads = static_cast<int>(state.range(0))};
    const Index kv_cols = serving_layout.kv_heads * head_dim, q_cols = serving_layout.q_heads * head_dim;
    const Matrix<float>& keys = pool(kv_cols, 2);
    const Matrix<float>& values = pool(kv_cols, 3);
    using Cache = memattn::KVCache<float, S>;
    using Layer = memattn::MultiHead<Cache>;
    static std::string kept_name;
    static std::shared_ptr<std::vector<Layer>> kept;
    const std::string name = typeid(S).name();
    if (name != kept_name || !kept) {
        kept.reset();
        kept_name.clear();
        kept = std::make_shared<std::vector<Layer>>();
        for (Index i = 0; i < serving_batch; ++i) {
            kept->emplace_back(serving_layout, [](Index) { return Cache(head_dim, head_dim); });
            kept->back().reserve(serving_length(i) + 1);
            for (Index filled = 0; filled < serving_length(i); filled += pool_tokens) {
                const Index n = std::min(pool_tokens, serving_length(i) - filled);
                kept->back().extend(keys.topRows(n), values.topRows(n));
            }
        }
        kept_name = name;
    }
    std::vector<Layer>& layers = *kept;
    Index tokens = 0;
    for (Index i = 0; i < serving_batch; ++i) {
        layers[static_cast<std::size_t>(i)].set_executor(executor);
        tokens += serving_length(i);
    }
    const Matrix<float>& queries = pool(q_cols, 1);
    Matrix<float> out(1, q_cols);
    const auto step = [&] {
        for (Index i = 0; i < serving_batch; ++i) {
            Layer& layer = layers[static_cast<std::size_t>(i)];
            layer.update(keys.row(i), values.row(i));
            layer.attend(queries.row(i), out.row(0));
            benchmark::DoNotOptimize(out.data());
            benchmark::ClobberMemory();
            layer.truncate(serving_length(i));
        }
    };
    const double step_seconds = median_step_seconds(state, step);
    const std::size_t bytes = static_cast<std::size_t>(tokens) * token_bytes<S>();
    const double flops = 2.0 * static_cast<double>(serving_layout.q_heads) * static_cast<double>(tokens) *
                         static_cast<double>(2 * head_dim);
    report_roofline(state, step_seconds, bytes, flops, executor);
}

template <class S>
void BM_PrefixSharing(benchmark::State& state) {
    const Index block = state.range(0), prompt = 2048, forks = 16;
    const memattn::OpenMPExecutor executor{.threads = 1};
    const Index kv_cols = serving_layout.kv_heads * head_dim, q_cols = serving_layout.q_heads * head_dim;
    const Matrix<float>& keys = pool(kv_cols, 2);
    const Matrix<float>& values = pool(kv_cols, 3);
    memattn::PagedKVCache<float, S> paged(serving_layout, prompt / block + 2 * forks + 2, block);
    const Index root = paged.add_sequence();
    paged.extend(root, keys.topRows(prompt), values.topRows(prompt));
    std::vector<Index> ids;
    for (Index i = 0; i < forks; ++i)
        ids.push_back(paged.fork(root));
    const Matrix<float> Q = pool(q_cols, 1).topRows(forks), K = keys.middleRows(prompt, forks),
                        V = values.middleRows(prompt, forks);
    Matrix<float> O(forks, q_cols);
    const auto step = [&] {
        memattn::batched_decode(paged, ids, Q, K, V, O, executor);
        benchmark::DoNotOptimize(O.data());
        benchmark::ClobberMemory();
        for (const Index id : ids)
            paged.truncate(id, prompt + 1);  // each keeps its own first token: a block of its own
    };
    const double step_seconds = median_step_seconds(state, step);
    state.counters["step_ms"] = step_seconds * 1e3;
    state.counters["held_MiB"] =
        static_cast<double>(static_cast<std::size_t>(paged.blocks_in_use() * block) * token_bytes<S>()) /
        (1024.0 * 1024.0);
    state.counters["private_MiB"] =
        static_cast<double>(static_cast<std::size_t>(forks * (prompt + 1)) * token_bytes<S>()) / (1024.0 * 1024.0);
}

template <class S>
void BM_SharedPrefix(benchmark::State& state) {
    const bool shared = state.range(0) != 0;
    const Index prompt = pool_tokens, own = 64, forks = 16, block = 128;
    const memattn::OpenMPExecutor executor{.threads = static_cast<int>(state.range(1))};
    const Index kv_cols = serving_layout.kv_heads * head_dim, q_cols = serving_layout.q_heads * head_dim;
    const Matrix<float>& keys = pool(kv_cols, 2);
    const Matrix<float>& values = pool(kv_cols, 3);
    const Index per_sequence = (prompt + own) / block + 2;
    memattn::PagedKVCache<float, S> paged(serving_layout, forks * per_sequence + prompt / block + 2, block);
    std::vector<Index> ids;
    const Index root = paged.add_sequence();
    if (shared)
        paged.extend(root, keys.topRows(prompt), values.topRows(prompt));
    for (Index i = 0; i < forks; ++i) {
        const Index id = shared ? paged.fork(root) : paged.add_sequence();
        if (!shared)
            paged.extend(id, keys.topRows(prompt), values.topRows(prompt));
        const Index from = (i * own) % (pool_tokens - own);  // the synthetic rows, reused
        paged.extend(id, keys.middleRows(from, own), values.middleRows(from, own));
        ids.push_back(id);
    }
    paged.remove(root);
    const Matrix<float> Q = pool(q_cols, 1).topRows(forks), K = keys.topRows(forks), V = values.topRows(forks);
    Matrix<float> O(forks, q_cols);
    const auto step = [&] {
        memattn::batched_decode(paged, ids, Q, K, V, O, executor);
        benchmark::DoNotOptimize(O.data());
        benchmark::ClobberMemory();
        for (const Index id : ids)
            paged.truncate(id, prompt + own);
    };
    const double step_seconds = median_step_seconds(state, step);
    state.counters["step_ms"] = step_seconds * 1e3;
    state.counters["MiB"] =
        static_cast<double>(static_cast<std::size_t>(paged.blocks_in_use() * block) * token_bytes<S>()) /
        (1024.0 * 1024.0);
}

void BM_MixedBatch(benchmark::State& state) {
    const Index decodes = 28, prompts = 4, cached = 1024, chunk = 256, block = 128;
    const memattn::OpenMPExecutor executor{.threads = static_cast<int>(state.range(0))};
    const Index kv_cols = serving_layout.kv_heads * head_dim, q_cols = serving_layout.q_heads * head_dim;
    const Matrix<float>& keys = pool(kv_cols, 2);
    const Matrix<float>& values = pool(kv_cols, 3);
    std::vector<Index> lengths;
    for (Index i = 0; i < decodes; ++i)
        lengths.push_back(512 + i * (4096 - 512) / (decodes - 1));
    for (Index i = 0; i < prompts; ++i)
        lengths.push_back(cached);
    Index blocks = 0;
    for (const Index n : lengths)
        blocks += (n + chunk) / block + 2;
    memattn::PagedKVCache<float> paged(serving_layout, blocks, block);
    std::vector<Index> all, decoding, prompting, offsets{0}, chunk_offsets{0};
    for (std::size_t i = 0; i < lengths.size(); ++i) {
        all.push_back(paged.add_sequence());
        paged.extend(all.back(), keys.topRows(lengths[i]), values.topRows(lengths[i]));
        const bool prompt = static_cast<Index>(i) >= decodes;
        (prompt ? prompting : decoding).push_back(all.back());
        offsets.push_back(offsets.back() + (prompt ? chunk : 1));
        if (prompt)
            chunk_offsets.push_back(chunk_offsets.back() + chunk);
    }
    const Index rows = offsets.back();
    // The mixed batch's rows: the decodes' first, then the chunks', so the parts take
    // contiguous blocks of the same rows.
    const Matrix<float> Q = pool(q_cols, 1).topRows(rows), K = keys.middleRows(cached, rows),
                        V = values.middleRows(cached, rows);
    Matrix<float> O(rows, q_cols);
    const auto take_back = [&] {
        for (std::size_t i = 0; i < all.size(); ++i)
            paged.truncate(all[i], lengths[i]);
    };
    const auto mixed = [&] {
        memattn::batched_prefill(paged, all, offsets, Q, K, V, O, executor);
        benchmark::DoNotOptimize(O.data());
        benchmark::ClobberMemory();
        take_back();
    };
    const auto parts = [&] {
        memattn::batched_prefill(paged, prompting, chunk_offsets, Q.bottomRows(rows - decodes),
                                 K.bottomRows(rows - decodes), V.bottomRows(rows - decodes),
                                 O.bottomRows(rows - decodes), executor);
        memattn::batched_decode(paged, decoding, Q.topRows(decodes), K.topRows(decodes), V.topRows(decodes),
                                O.topRows(decodes), executor);
        benchmark::DoNotOptimize(O.data());
        benchmark::ClobberMemory();
        take_back();
    };
    mixed();
    parts();
    std::vector<double> mixed_s, parts_s;
    mixed_s.reserve(1 << 16);
    parts_s.reserve(1 << 16);
    for (auto _ : state) {
        auto before = Clock::now();
        mixed();
        const double m = seconds_since(before);
        before = Clock::now();
        parts();
        if (mixed_s.size() < mixed_s.capacity()) {
            mixed_s.push_back(m);
            parts_s.push_back(seconds_since(before));
        }
    }
    const double m = median(mixed_s), p = median(parts_s);
    state.counters["mixed_ms"] = m * 1e3;
    state.counters["parts_ms"] = p * 1e3;
    state.counters["parts_over_mixed"] = p / m;
}

void BM_ModelStep(benchmark::State& state) {
    const bool model = state.range(0) != 0;
    const Index layers = 4, batch = 16, length = 512, block = 32;
    const HeadLayout layout{8, 2, 64};
    const memattn::SerialExecutor serial;
    const std::vector<memattn::ModelLayer> specs(static_cast<std::size_t>(layers),
                                                 memattn::ModelLayer{.layout = layout, .blocks = 2 * batch * (length / block + 2),
                                                                     .block_size = block});
    memattn::ModelCache<float> cache(specs);
    std::vector<memattn::PagedKVCache<float>> pools;
    for (const auto& l : specs)
        pools.emplace_back(l.layout, l.blocks, l.block_size, l.options);
    const Index kv_cols = layout.kv_heads * layout.head_dim, q_cols = layout.q_heads * layout.head_dim;
    const Matrix<float>& keys = pool(kv_cols, 2);
    const Matrix<float>& values = pool(kv_cols, 3);
    std::vector<Index> ids, slots;
    for (Index i = 0; i < batch; ++i) {
        ids.push_back(cache.add_sequence());
        slots.push_back(cache.slot_of(ids.back()));
        for (Index l = 0; l < layers; ++l) {
            cache.layer(l).set_executor(serial);
            cache.layer(l).extend(slots.back(), keys.topRows(length), values.topRows(length));
            pools[static_cast<std::size_t>(l)].set_executor(serial);
            const Index own = pools[static_cast<std::size_t>(l)].add_sequence();
            pools[static_cast<std::size_t>(l)].extend(own, keys.topRows(length), values.topRows(length));
        }
    }
    const Matrix<float> Q = pool(q_cols, 1).topRows(batch), K = keys.topRows(batch), V = values.topRows(batch);
    Matrix<float> O(batch, q_cols);
    const auto step = [&] {
        if (model) {
            const auto& planned = cache.plan_decode(ids);
            for (Index l = 0; l < layers; ++l)
                cache.decode(l, planned, Q, K, V, O);
            for (const Index id : ids)
                cache.truncate(id, length);
        } else {
            for (auto& p : pools)
                memattn::batched_decode(p, slots, Q, K, V, O);
            for (auto& p : pools)
                for (const Index s : slots)
                    p.truncate(s, length);
        }
        benchmark::DoNotOptimize(O.data());
        benchmark::ClobberMemory();
    };
    state.counters["step_ms"] = median_step_seconds(state, step) * 1e3;
}

void serving_cells(benchmark::internal::Benchmark* b) {
    b->ArgNames({"block", "t"});
    for (Index threads : {1, 2})
        b->Args({memattn::PagedKVCache<float>::default_block_size, threads});
    for (Index block : {16, 32, 64, 256})
        b->Args({block, 1});
    b->UseRealTime()->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(BM_DecodeStep<float>)->Name("BM_DecodeStep<float>")->Apply(cells);
BENCHMARK(BM_LatentDecode<float>)->Name("BM_LatentDecode<float>")->Apply(latent_cells);
BENCHMARK(BM_LatentDecode<Eigen::bfloat16>)->Name("BM_LatentDecode<bfloat16>")->Apply(latent_cells);
BENCHMARK(BM_LatentDecodeFpMathBf16)->Apply(latent_cells);
BENCHMARK(BM_LatentPrefill)->Apply(latent_prefill_cells);
BENCHMARK(BM_LatentPrefillFpMathBf16)->Apply(latent_prefill_cells);
BENCHMARK(BM_PoolTreeVerify<>)->Name("BM_PoolTreeVerify")->ArgNames({"past", "mode"})
    ->ArgsProduct({{4096}, {0, 1, 2, 3, 4, 5, 6}})->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_PoolTreeVerify<Eigen::bfloat16, memattn::FpMath::bf16>)->Name("BM_PoolTreeVerifyFpMathBf16<bfloat16>")
    ->ArgNames({"past", "mode"})->ArgsProduct({{4096}, {0, 1, 2, 3, 4, 5, 6}})->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_StatePoolDecode)->ArgNames({"t", "mode"})->ArgsProduct({{1, 2}, {0, 1}})->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_StateTreeVerify)->ArgNames({"mode"})->DenseRange(0, 3)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_PagedLatentDecode<float>)->Name("BM_PagedLatentDecode<float>")->Apply(paged_latent_cells);
BENCHMARK(BM_PagedLatentDecode<Eigen::bfloat16>)->Name("BM_PagedLatentDecode<bfloat16>")->Apply(paged_latent_cells);
BENCHMARK(BM_DecodeStep<Eigen::bfloat16>)->Name("BM_DecodeStep<bfloat16>")->Apply(cells);
BENCHMARK(BM_DecodeStep<Eigen::half>)->Name("BM_DecodeStep<half>")->Apply(cells);
BENCHMARK(BM_DecodeStepBf16Rows)->Apply(cells);
BENCHMARK(BM_DecodeStepFpMathBf16<Eigen::bfloat16>)->Name("BM_DecodeStepFpMathBf16<bfloat16>")->Apply(cells);
BENCHMARK(BM_DecodeStepFpMathBf16<memattn::Fp8E4M3>)->Name("BM_DecodeStepFpMathBf16<Fp8E4M3>")->Apply(cells);
BENCHMARK(BM_DecodeStepFpMathBf16<memattn::Fp8E5M2>)->Name("BM_DecodeStepFpMathBf16<Fp8E5M2>")->Apply(cells);
BENCHMARK(BM_DecodeStep<memattn::Q8>)->Name("BM_DecodeStep<Q8>")->Apply(cells);
BENCHMARK(BM_DecodeStep<memattn::IntegerDot<memattn::Q8>>)->Name("BM_DecodeStep<IntegerDot<Q8>>")->Apply(cells);
BENCHMARK(BM_DecodeStep<memattn::Q4>)->Name("BM_DecodeStep<Q4>")->Apply(cells);
BENCHMARK(BM_DecodeStep<memattn::Q4Affine>)->Name("BM_DecodeStep<Q4Affine>")->Apply(cells);
BENCHMARK(BM_DecodeStep<memattn::Fp8E4M3>)->Name("BM_DecodeStep<Fp8E4M3>")->Apply(cells);
BENCHMARK(BM_DecodeStep<memattn::Fp8E5M2>)->Name("BM_DecodeStep<Fp8E5M2>")->Apply(cells);
BENCHMARK(BM_DecodeStep<memattn::PerTokenScale<memattn::Fp8E4M3>>)
    ->Name("BM_DecodeStep<PerTokenScale<Fp8E4M3>>")
    ->Apply(cells);
BENCHMARK(BM_DecodeLayers<Eigen::bfloat16>)
    ->Name("BM_DecodeLayers<bfloat16>")
    ->ArgNames({"layers", "length", "fpmath", "t"})
    ->ArgsProduct({{16}, {4096}, {0, 1}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DecodeLayers<float>)
    ->Name("BM_DecodeLayers<float>")
    ->ArgNames({"layers", "length", "fpmath", "t"})
    ->ArgsProduct({{16}, {4096}, {0}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DecodeAttend<float>)->Name("BM_DecodeAttend<float>")->Apply(cells);
BENCHMARK(BM_DecodeAttend<Eigen::bfloat16>)->Name("BM_DecodeAttend<bfloat16>")->Apply(cells);
BENCHMARK(BM_DecodeAttend<Eigen::half>)->Name("BM_DecodeAttend<half>")->Apply(cells);
BENCHMARK(BM_DecodeAttend<memattn::Q8>)->Name("BM_DecodeAttend<Q8>")->Apply(cells);
BENCHMARK(BM_DecodeAttend<memattn::IntegerDot<memattn::Q8>>)->Name("BM_DecodeAttend<IntegerDot<Q8>>")->Apply(cells);
BENCHMARK(BM_DecodeAttend<memattn::Q4>)->Name("BM_DecodeAttend<Q4>")->Apply(cells);
BENCHMARK(BM_DecodeAttend<memattn::Q4Affine>)->Name("BM_DecodeAttend<Q4Affine>")->Apply(cells);

// KVCache (block:0) against SparseKVCache with top_k_blocks · block = 2048 pairs.
BENCHMARK(BM_SparseDecode)
    ->ArgNames({"length", "block", "g"})
    ->ArgsProduct({{32768, 131072, 1048576}, {0, 8, 16, 32, 64}, {1, 4}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_GroupAttend)
    ->ArgNames({"g", "length", "fpmath"})
    ->ArgsProduct({{1, 4, 8}, {512}, {0, 1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeVariants)
    ->ArgNames({"length", "variant"})
    ->ArgsProduct({{4096, 32768}, {0, 1, 2, 3}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_BatchedDecode<float>)->Name("BM_BatchedDecode<float>")->Apply(serving_cells);
BENCHMARK(BM_BatchedDecode<Eigen::bfloat16>)->Name("BM_BatchedDecode<bfloat16>")->Apply(serving_cells);
BENCHMARK(BM_BatchedDecode<memattn::Fp8E4M3>)->Name("BM_BatchedDecode<Fp8E4M3>")->Apply(serving_cells);
BENCHMARK(BM_BatchedDecode<Eigen::bfloat16, true>)
    ->Name("BM_BatchedDecodeFpMathBf16<bfloat16>")
    ->Apply(serving_cells);
BENCHMARK(BM_BatchedDecode<memattn::Fp8E4M3, true>)
    ->Name("BM_BatchedDecodeFpMathBf16<Fp8E4M3>")
    ->Apply(serving_cells);
BENCHMARK(BM_SeparateDecode<float>)->Name("BM_SeparateDecode<float>")->ArgName("t")->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SeparateDecode<Eigen::bfloat16>)->Name("BM_SeparateDecode<bfloat16>")->ArgName("t")->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MixedBatch)->ArgName("t")->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ModelStep)->ArgName("model")->Arg(0)->Arg(1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SharedPrefix<float>)
    ->Name("BM_SharedPrefix<float>")
    ->ArgNames({"shared", "t"})
    ->ArgsProduct({{0, 1}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SharedPrefix<Eigen::bfloat16>)
    ->Name("BM_SharedPrefix<bfloat16>")
    ->ArgNames({"shared", "t"})
    ->ArgsProduct({{0, 1}, {1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PrefixSharing<Eigen::bfloat16>)->Name("BM_PrefixSharing<bfloat16>")->ArgName("block")->Arg(16)->Arg(128)->UseRealTime()->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
