// What each memory remembers: multi-query associative recall (bench/recall_task.hpp) of
// every memory of the library, beside its footprint and its decode step.
//
//   BM_Recall<M>/kib:B/keys:K/n:N              accuracy and cosine of the N exact and the N
//                                              noisy queries; the time: one decode step
//   BM_RecallDistance<M>/kib:B/keys:K/n:4096   the exact queries' figures by distance (the
//                                              buckets of recall_task.hpp)
//
// M names the memory (below), B its byte budget per head in KiB (0: none, see below),
// K = 0 isotropic keys, 1 clustered keys (8 clusters, spread 0.5), N = 64 … 4096 pairs.
// d = dv = 64, float, one head; the noisy queries carry noise of norm 0.3. Fixed seeds:
// every counter but the time is the same on every run of the same binary.
//
// The memories and how they are sized:
//   - Unbounded, the reference (B = 0): KVCache, of float, Eigen::bfloat16 and memattn::Q8
//     pairs. Its footprint grows with N (the counter `bytes`). Beside it SparseKVCache with
//     its defaults (every pair kept, an attend reading the sinks, the window and the 256
//     blocks of 8 with the largest bounds: all of the past up to about 2100 pairs).
//   - Sized to a budget (B = 64 and 1024: footprint() of a full memory = B KiB, at 512
//     bytes a pair 128 and 2048 pairs): SlidingWindowCache of B/512 pairs (Window), and
//     of 4 sinks and B/512 − 4 pairs (WindowSinks); HybridCache of B/1024 raw pairs and
//     B/1024 slots of 4 pairs each (covering 2.5 times its pairs) with each compressor
//     (MeanPool, MaxPool, WeightedPool {.1, .2, .3, .4}); MovingAverageCache, the mean of
//     the last B/512 − 1 pairs (one more for the summary).
//   - Fixed size, reported beside (B = 0, `bytes` their own): the exponential moving
//     average (α = 0.05); LinearAttentionMemory with each feature map (Identity
//     unnormalised, the plain kernel q·k; EluPlusOne, Relu, Taylor2 and FavorPlus with 256
//     features normalised, the library's default); GatedLinearAttentionMemory (scalar
//     gate, fixed decay 0.99); DeltaRuleMemory (β = 1), gated (β = 1, decay 0.99);
//     KdaMemory (β = 1, decay 0.99 in every channel: the gated delta rule again, another
//     code path); Rwkv7Memory as a delta rule with decay (a = −k, b = k, w = 0.99).
// The softmax memories take the logit scale recall::softmax_sharpness (16: q·k of unit
// vectors times 16, sharp enough for the KV cache to retrieve every pair); the linear and
// gated memories read the unit query as it is (the gated ones with scale 1, not 1/√d).
// For unit keys elu + 1 and FAVOR+ weigh every pair nearly alike (φ(q)·φ(k) = d + O(1),
// exp(q·k/8) ∈ [0.88, 1.13]), so their outputs are about the mean value and their
// accuracy is chance: the figures show what each map makes of unit keys, not of a trained
// model's keys.
//
// Counters (all but the time deterministic):
//   accuracy, cosine              exact queries (the stored keys): the fraction retrieved
//                                 (the right value has the largest cosine to the output, of
//                                 all N stored values) and the mean cosine to the right value
//   noisy_accuracy, noisy_cosine  the same for the noisy queries
//   bytes                         footprint() after the stream
//   chance                        1/N, a random guess's accuracy
//   (BM_RecallDistance) acc_leD, cos_leD   accuracy and cosine of the exact queries at
//                                 distances in (D/2, D]
// The time of BM_Recall is one decode step (update + attend) of the memory as it is after
// the N pairs (a cache that keeps every pair is truncated back to N after each step, so
// it stays there). The recall figures are computed once per benchmark (its first run)
// and kept; repetitions only time the step. BM_RecallDistance reads the same figures and
// times nothing. Each benchmark runs for at least 0.1 s (MinTime, which
// --benchmark_min_time does not override): the whole binary takes about a minute.
//
// `scripts/bench --plot` runs this binary and draws memory_recall.png (accuracy against
// N) and memory_recall_distance.png (accuracy against distance at N = 4096).
#include "bench_common.hpp"
#include "recall_task.hpp"

#include <memattn/feature_maps.hpp>
#include <memattn/memory/compressor.hpp>
#include <memattn/memory/gated_memories.hpp>
#include <memattn/memory/hybrid_cache.hpp>
#include <memattn/memory/kv_cache.hpp>
#include <memattn/memory/linear_attention_memory.hpp>
#include <memattn/memory/moving_average_cache.hpp>
#include <memattn/memory/sliding_window_cache.hpp>
#include <memattn/memory/sparse_kv_cache.hpp>
#include <memattn/storage/compact.hpp>

#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace recall = memattn::recall;
using memattn::Index;
using memattn::Matrix;

constexpr Index d = 64;
constexpr Index pair_bytes = 2 * d * static_cast<Index>(sizeof(float));
constexpr Index budgets_kib[] = {64, 1024};
constexpr Index lengths[] = {64, 256, 1024, 4096};
constexpr Index profile_length = 4096;  // BM_RecallDistance's N
constexpr float softmax_scale = recall::softmax_sharpness;
constexpr double decay = 0.99;  // the gated memories' fixed decay per token
constexpr float beta = 1.0f;    // the delta rules' β
constexpr double min_time = 0.1;  // seconds per timed step; repetitions add runs, not recall work

const recall::KeyDistribution distributions[] = {recall::KeyDistribution::isotropic,
                                                 recall::KeyDistribution::clustered};

/// The task of (keys, n), made once.
const recall::Task& task_of(recall::KeyDistribution keys, Index n) {
    static std::map<std::pair<int, Index>, recall::Task> tasks;
    const auto key = std::make_pair(static_cast<int>(keys), n);
    auto it = tasks.find(key);
    if (it == tasks.end())
        it = tasks.emplace(key, recall::make_task({.n = n, .d = d, .keys = keys, .seed = 1})).first;
    return it->second;
}

/// One cell (memory, budget, keys, n): its recall figures and the memory after the
/// stream, each made once and kept for every run of the cell's benchmarks.
template <class M>
struct Cell {
    std::function<M()> make;
    std::function<Matrix<float>(const Matrix<float>&)> key_rows;
    recall::KeyDistribution keys;
    Index n;
    bool grows;  // an unbounded cache: truncated back to n after each timed step

    std::optional<Matrix<float>> rows;
    std::optional<recall::Result> result;
    std::optional<M> filled;

    const recall::Task& task() const { return task_of(keys, n); }
    const Matrix<float>& stream_rows() {
        if (!rows)
            rows = key_rows(task().keys);
        return *rows;
    }
    const recall::Result& figures() {
        if (!result) {
            M memory = make();
            result = recall::run(memory, task(), stream_rows());
        }
        return *result;
    }
    const M& memory_after_stream() {
        if (!filled) {
            filled.emplace(make());
            memattn::extend(*filled, stream_rows(), task().values);
        }
        return *filled;
    }
};

template <class M>
void recall_step(benchmark::State& state, Cell<M>& cell) {
    const recall::Result& r = cell.figures();
    const recall::Task& task = cell.task();
    const Matrix<float>& rows = cell.stream_rows();
    M memory = cell.memory_after_stream();
    memattn::Vector<float> out(task.values.cols());
    Index t = 0;
    for (auto _ : state) {
        const Index i = t++ % cell.n;  // the stream again, from its start
        memory.update(rows.row(i), task.values.row(i));
        memory.attend(task.keys.row(i), out);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
        if constexpr (requires { memory.truncate(cell.n); })
            if (cell.grows)
                memory.truncate(cell.n);
    }
    state.counters["accuracy"] = r.exact.accuracy;
    state.counters["cosine"] = r.exact.cosine;
    state.counters["noisy_accuracy"] = r.noisy.accuracy;
    state.counters["noisy_cosine"] = r.noisy.cosine;
    state.counters["bytes"] = static_cast<double>(r.footprint);
    state.counters["chance"] = r.chance;
}

template <class M>
void recall_by_distance(benchmark::State& state, Cell<M>& cell) {
    const recall::Result& r = cell.figures();
    for (auto _ : state)
        benchmark::DoNotOptimize(r.exact.accuracy);
    char name[32];
    for (const recall::Bucket& b : r.buckets) {
        std::snprintf(name, sizeof name, "acc_le%04lld", static_cast<long long>(b.max_distance));
        state.counters[name] = b.exact.accuracy;
        std::snprintf(name, sizeof name, "cos_le%04lld", static_cast<long long>(b.max_distance));
        state.counters[name] = b.exact.cosine;
    }
}

/// The by-distance benchmarks, registered after every BM_Recall so the two families'
/// lines are not interleaved.
std::vector<std::function<void()>> later;

/// Registers the cells of one memory: `make()` builds it empty, `key_rows(K)` gives its
/// key rows for the keys K (K itself, or with a gated memory's extra columns).
template <class Make, class KeyRows = std::identity>
void add(const std::string& label, Index budget_kib, Make make, KeyRows key_rows = {}, bool grows = false) {
    using M = decltype(make());
    for (const recall::KeyDistribution keys : distributions) {
        for (const Index n : lengths) {
            auto cell = std::make_shared<Cell<M>>(Cell<M>{make, key_rows, keys, n, grows, {}, {}, {}});
            const std::string args = "/kib:" + std::to_string(budget_kib) + "/keys:" +
                                     std::to_string(static_cast<int>(keys)) + "/n:" + std::to_string(n);
            benchmark::RegisterBenchmark(("BM_Recall<" + label + ">" + args).c_str(),
                                         [cell](benchmark::State& state) { recall_step(state, *cell); })
                ->Unit(benchmark::kMicrosecond)
                ->MinTime(min_time);
            if (n == profile_length)
                later.push_back([cell, label, args] {
                    benchmark::RegisterBenchmark(("BM_RecallDistance<" + label + ">" + args).c_str(),
                                                 [cell](benchmark::State& state) { recall_by_distance(state, *cell); })
                        ->Iterations(1);
                });
        }
    }
}

void register_all() {
    using namespace memattn;
    const auto plain = std::identity{};

    // The unbounded reference: every pair, in float and in two compact storages.
    add("KVCache", 0, [] { return KVCache<float>(d, d, softmax_scale); }, plain, true);
    add("KVCache_bf16", 0, [] { return KVCache<float, Eigen::bfloat16>(d, d, softmax_scale); }, plain, true);
    add("KVCache_Q8", 0, [] { return KVCache<float, Q8>(d, d, softmax_scale); }, plain, true);
    // Every pair kept, each attend reading the sinks, the window and the top blocks by their bounds
    // (SparseKVOptions' defaults: blocks of 8, the top 256 of them, a window of 64, 4 sinks).
    add("SparseKVCache", 0, [] { return SparseKVCache<float>(d, d, {}, softmax_scale); }, plain, true);

    // Sized to a byte budget per head.
    for (const Index kib : budgets_kib) {
        const Index pairs = kib * 1024 / pair_bytes;
        add("Window", kib, [pairs] { return SlidingWindowCache<float>(d, d, pairs, 0, softmax_scale); });
        add("WindowSinks", kib, [pairs] { return SlidingWindowCache<float>(d, d, pairs - 4, 4, softmax_scale); });
        const Index half = pairs / 2, rate = 4;
        add("Hybrid_Mean", kib, [=] { return HybridCache<float, MeanPool>(d, d, half, rate, half, softmax_scale); });
        add("Hybrid_Max", kib, [=] { return HybridCache<float, MaxPool>(d, d, half, rate, half, softmax_scale); });
        add("Hybrid_Weighted", kib, [=] {
            return HybridCache<float, WeightedPool>(d, d, half, rate, half, softmax_scale,
                                                    WeightedPool({0.1, 0.2, 0.3, 0.4}));
        });
        add("MovingAverage", kib, [pairs] { return MovingAverageCache<float>(d, d, pairs - 1); });
    }

    // Fixed size: their own footprint.
    add("EMA", 0, [] { return MovingAverageCache<float>::exponential(d, d, 0.05f); });
    add("Linear_Identity", 0,
        [] { return LinearAttentionMemory<float, Identity>(d, d, {}, LinearOptions{.normalize = false}); });
    add("Linear_Elu", 0, [] { return LinearAttentionMemory<float, EluPlusOne>(d, d); });
    add("Linear_Relu", 0, [] { return LinearAttentionMemory<float, Relu>(d, d); });
    add("Linear_Taylor2", 0, [] { return LinearAttentionMemory<float, Taylor2>(d, d); });
    add("Linear_Favor", 0, [] { return LinearAttentionMemory<float, FavorPlus>(d, d, FavorPlus(d, 256, 7)); });
    add("GLA", 0, [] { return GatedLinearAttentionMemory<float>(d, d, GateKind::scalar, GatedOptions{.scale = 1.0}); },
        [](const Matrix<float>& K) { return recall::gated_keys(K, decay); });
    add("DeltaRule", 0, [] { return DeltaRuleMemory<float>(d, d, DeltaOptions{.scale = 1.0}); },
        [](const Matrix<float>& K) { return recall::delta_rule_keys(K, beta); });
    add("GatedDeltaRule", 0, [] { return DeltaRuleMemory<float>(d, d, DeltaOptions{.scale = 1.0}, true); },
        [](const Matrix<float>& K) { return recall::gated_delta_keys(K, beta, decay); });
    add("KDA", 0, [] { return KdaMemory<float>(d, d, DeltaOptions{.scale = 1.0}); },
        [](const Matrix<float>& K) { return recall::gated_delta_keys(K, beta, decay, d); });
    add("RWKV7", 0, [] { return Rwkv7Memory<float>(d, d); },
        [](const Matrix<float>& K) { return recall::rwkv7_delta_keys(K, beta, decay); });

    for (const auto& r : later)
        r();
}

}  // namespace

int main(int argc, char** argv) {
    register_all();
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv))
        return 1;
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
}
