// The fixed-size memories allocate everything at construction: once built (and once
// full), update, attend and extend never touch the heap. Two counters prove it:
//  - a replaced global operator new (std::vector, std::string, ... and any `new`);
//  - Eigen's own allocator, which calls malloc directly and so bypasses operator new:
//    with EIGEN_RUNTIME_NO_MALLOC, Eigen checks every heap allocation (matrices and
//    the temporaries of products) with eigen_assert, which this file redefines to
//    count those instead of aborting.
// Both replacements must not reach the main test binary, hence this executable.

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>

namespace alloc_test {

std::atomic<long> operator_news{0};
std::atomic<long> eigen_mallocs{0};

/// eigen_assert's failure path: an Eigen heap allocation while forbidden is counted;
/// any other failed Eigen assertion aborts, as it would normally.
inline void eigen_assertion_failed(const char* condition) {
    if (std::strstr(condition, "heap allocation is forbidden") != nullptr) {
        eigen_mallocs.fetch_add(1);
        return;
    }
    std::abort();
}

}  // namespace alloc_test

#define EIGEN_RUNTIME_NO_MALLOC
#define eigen_assert(x) ((x) ? static_cast<void>(0) : ::alloc_test::eigen_assertion_failed(#x))

#include "support.hpp"

#include <memattn/layer/latent_attention.hpp>
#include <memattn/serving/paged_latent_kv_cache.hpp>
#include <memattn/serving/state_pool.hpp>
#include <memattn/memory/gated_memories.hpp>
#include <memattn/layer/multi_head_memory.hpp>
#include <memattn/memory/hybrid_cache.hpp>
#include <memattn/memory/sparse_kv_cache.hpp>
#include <memattn/memory/kv_cache.hpp>
#include <memattn/memory/linear_attention_memory.hpp>
#include <memattn/memory/moving_average_cache.hpp>
#include <memattn/memory/sliding_window_cache.hpp>
#include <memattn/serving/batched.hpp>
#include <memattn/serving/model_cache.hpp>
#include <memattn/serving/paged_kv_cache.hpp>

#include <vector>

// ---------------------------------------------------------------- replaced operator new

namespace {

void* counted_allocation(std::size_t size, std::size_t alignment) {
    alloc_test::operator_news.fetch_add(1);
    if (size == 0)
        size = 1;
    void* p = alignment <= alignof(std::max_align_t) ? std::malloc(size)
                                                      : std::aligned_alloc(alignment, (size + alignment - 1) / alignment * alignment);
    return p;
}

// Not inlined into operator delete: otherwise g++ pairs `delete` with `free` at the
// call site and warns (-Wmismatched-new-delete), although both ends are replaced here.
[[gnu::noinline]] void release(void* p) noexcept { std::free(p); }

}  // namespace

void* operator new(std::size_t size) {
    if (void* p = counted_allocation(size, 0))
        return p;
    throw std::bad_alloc();
}
void* operator new[](std::size_t size) {
    if (void* p = counted_allocation(size, 0))
        return p;
    throw std::bad_alloc();
}
void* operator new(std::size_t size, std::align_val_t alignment) {
    if (void* p = counted_allocation(size, static_cast<std::size_t>(alignment)))
        return p;
    throw std::bad_alloc();
}
void* operator new[](std::size_t size, std::align_val_t alignment) {
    if (void* p = counted_allocation(size, static_cast<std::size_t>(alignment)))
        return p;
    throw std::bad_alloc();
}
void* operator new(std::size_t size, const std::nothrow_t&) noexcept { return counted_allocation(size, 0); }
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept { return counted_allocation(size, 0); }
void operator delete(void* p) noexcept { release(p); }
void operator delete[](void* p) noexcept { release(p); }
void operator delete(void* p, std::size_t) noexcept { release(p); }
void operator delete[](void* p, std::size_t) noexcept { release(p); }
void operator delete(void* p, std::align_val_t) noexcept { release(p); }
void operator delete[](void* p, std::align_val_t) noexcept { release(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { release(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { release(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { release(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { release(p); }

// ---------------------------------------------------------------- tests

using namespace memattn;
using memattn::test::random_matrix;

namespace {

/// Counts heap allocations from construction to `stop()`.
class HeapWatch {
public:
    HeapWatch() : news_(alloc_test::operator_news.load()), eigen_(alloc_test::eigen_mallocs.load()) {
        Eigen::internal::set_is_malloc_allowed(false);
    }
    ~HeapWatch() { Eigen::internal::set_is_malloc_allowed(true); }
    HeapWatch(const HeapWatch&) = delete;
    HeapWatch& operator=(const HeapWatch&) = delete;

    struct Counts {
        long operator_news;
        long eigen_mallocs;
    };
    Counts stop() const {
        Eigen::internal::set_is_malloc_allowed(true);
        return {alloc_test::operator_news.load() - news_, alloc_test::eigen_mallocs.load() - eigen_};
    }

private:
    long news_;
    long eigen_;
};

/// Fills `mem` past its capacity, then streams tokens through update + attend and
/// extend while watching the heap.
template <class M>
void check_no_allocation(M mem) {
    using T = typename M::Scalar;
    const Index d = mem.key_dim(), dv = mem.value_dim(), n = 300;
    Index qd = d, od = dv;  // a layer's queries and outputs are wider than its keys and values
    if constexpr (requires { mem.query_dim(); }) {
        qd = mem.query_dim();
        od = mem.output_dim();
    }
    const Matrix<T> Q = random_matrix<T>(n, qd, 1), K = random_matrix<T>(n, d, 2), V = random_matrix<T>(n, dv, 3);
    Vector<T> out(od);
    mem.extend(K.topRows(5), V.topRows(5));  // a partly filled memory too
    HeapWatch watch;
    for (Index i = 0; i < n; ++i) {
        mem.update(K.row(i), V.row(i));
        mem.attend(Q.row(i), out);
    }
    mem.extend(K, V);
    mem.extend(K.topRows(7), V.topRows(7));
    mem.attend(Q.row(0), out);
    mem.reset();
    mem.update(K.row(0), V.row(0));
    mem.attend(Q.row(0), out);
    const auto counts = watch.stop();
    CHECK(counts.operator_news == 0);
    CHECK(counts.eigen_mallocs == 0);
    CHECK(out.allFinite());
}

}  // namespace

TEST_CASE("The heap watch sees operator new and Eigen's malloc", "[memory][allocation]") {
    HeapWatch watch;
    void* raw = ::operator new(16);  // a call, not a new-expression, which a compiler may elide
    Matrix<float> m(8, 8);
    m.setZero();
    const auto counts = watch.stop();
    ::operator delete(raw);
    CHECK(counts.operator_news == 1);
    CHECK(counts.eigen_mallocs >= 1);
}

TEMPLATE_TEST_CASE("Fixed-size memories never allocate in update, attend or extend", "[memory][allocation]", float,
                   double) {
    using T = TestType;
    SECTION("SlidingWindowCache") { check_no_allocation(SlidingWindowCache<T>(16, 8, 64, 4)); }
    SECTION("SlidingWindowCache, window 1, no sinks") { check_no_allocation(SlidingWindowCache<T>(3, 5, 1)); }
    SECTION("SlidingWindowCache, window > attend block") { check_no_allocation(SlidingWindowCache<T>(8, 8, 600, 2)); }
    SECTION("MovingAverageCache, windowed") { check_no_allocation(MovingAverageCache<T>(16, 8, 32)); }
    SECTION("MovingAverageCache, cumulative") { check_no_allocation(MovingAverageCache<T>(16, 8, 0)); }
    SECTION("MovingAverageCache, exponential") {
        check_no_allocation(MovingAverageCache<T>::exponential(16, 8, T(0.2)));
    }
    SECTION("HybridCache, mean") { check_no_allocation(HybridCache<T>(16, 8, 32, 4, 8)); }
    SECTION("HybridCache, max") { check_no_allocation(HybridCache<T, MaxPool>(16, 8, 32, 3, 5)); }
    SECTION("HybridCache, weighted") {
        check_no_allocation(HybridCache<T, WeightedPool>(16, 8, 32, 2, 8, T(0), WeightedPool({0.5, 0.5})));
    }
    SECTION("HybridCache, no slots") { check_no_allocation(HybridCache<T>(16, 8, 32, 2, 0)); }
    SECTION("HybridCache, bfloat16 and Q8 window") {
        check_no_allocation(HybridCache<T, MeanPool, Eigen::bfloat16>(16, 8, 32, 4, 8));
        check_no_allocation(HybridCache<T, MeanPool, Q8>(16, 8, 32, 4, 8));
    }
    SECTION("SlidingWindowCache, float16 and Q8") {
        check_no_allocation(SlidingWindowCache<T, Eigen::half>(16, 8, 64, 4));
        check_no_allocation(SlidingWindowCache<T, Q8>(16, 8, 64, 4));
    }
    SECTION("HybridCache and SlidingWindowCache, Q4 and Q4Affine") {
        check_no_allocation(HybridCache<T, MeanPool, Q4>(16, 8, 32, 4, 8));
        check_no_allocation(SlidingWindowCache<T, Q4Affine>(16, 8, 64, 4));
    }
    SECTION("SlidingWindowCache, the integer Q·K (its rounded query on the stack)") {
        if constexpr (std::is_same_v<T, float>) {
            check_no_allocation(SlidingWindowCache<T, IntegerDot<Q8>>(16, 8, 64, 4));
            check_no_allocation(SlidingWindowCache<T, IntegerDot<Q4Affine>>(40, 8, 64, 4));
        }
    }
    SECTION("LinearAttentionMemory") { check_no_allocation(LinearAttentionMemory<T>(16, 8)); }
    SECTION("LinearAttentionMemory, decay, Taylor2") {
        check_no_allocation(LinearAttentionMemory<T, Taylor2>(16, 8, {}, {.decay = 0.9}));
    }
    SECTION("LinearAttentionMemory, FavorPlus, unnormalised") {
        check_no_allocation(LinearAttentionMemory<T, FavorPlus>(16, 8, FavorPlus(16, 64, 1), {.normalize = false}));
    }
    SECTION("LinearAttentionMemory, features beyond attend's stack buffer") {
        check_no_allocation(LinearAttentionMemory<T, Taylor2>(130, 4));
    }
    SECTION("MultiHead<SlidingWindowCache>, two heads: a short step stays on this thread") {
        check_no_allocation(
            MultiHead<SlidingWindowCache<T>>(HeadLayout{2, 2, 8, 4}, [](Index) { return SlidingWindowCache<T>(8, 4, 32, 2); }));
    }
    SECTION("MultiHead<LinearAttentionMemory>, groups of two: the grouped attend") {
        check_no_allocation(MultiHead<LinearAttentionMemory<T>>(
            HeadLayout{4, 2, 8, 4}, [](Index) { return LinearAttentionMemory<T>(8, 4); }));
    }
    SECTION("MultiHead<SlidingWindowCache<T, Q8>>, groups of four: the compact grouped attend") {
        check_no_allocation(MultiHead<SlidingWindowCache<T, Q8>>(
            HeadLayout{8, 2, 8, 4}, [](Index) { return SlidingWindowCache<T, Q8>(8, 4, 32, 2); }));
    }
    SECTION("Logit options and RoPE, the window's sinks and the hybrid's slots in the cache") {
        const double value[1] = {0.5}, values[4] = {0.5, -0.25, 1, 0};
        const Rope rope{.head_dim = 16};
        check_no_allocation(SlidingWindowCache<T>(
            16, 8, SoftmaxOptions{.window = 64, .sink_tokens = 4, .softcap = 5, .sink_logits = value, .alibi_slopes = value},
            rope, RopePositions::cache));
        check_no_allocation(SlidingWindowCache<T, Eigen::bfloat16>(
            16, 8, SoftmaxOptions{.window = 8, .sink_tokens = 2, .sink_logits = value}, rope, RopePositions::cache));
        check_no_allocation(HybridCache<T>(16, 8, 32, 4, 8, SoftmaxOptions{.softcap = 3, .sink_logits = value}, rope,
                                           RopePositions::cache));
        check_no_allocation(MultiHead<SlidingWindowCache<T>>(HeadLayout{8, 2, 16, 4}, [&](Index kv) {
            return SlidingWindowCache<T>(16, 4, SoftmaxOptions{.window = 32, .sink_tokens = 2, .softcap = 4,
                                                               .sink_logits = std::span(values).subspan(0, 4),
                                                               .alibi_slopes = std::span(values).subspan(0, 4)},
                                         Rope{.head_dim = 16, .rotary_dim = kv == 0 ? 16 : 8}, RopePositions::cache);
        }));
    }
    SECTION("MultiHead<HybridCache>, two heads") {
        check_no_allocation(
            MultiHead<HybridCache<T>>(HeadLayout{2, 2, 8, 4}, [](Index) { return HybridCache<T>(8, 4, 16, 4, 8); }));
    }
}

TEST_CASE("16-bit memories allocate nothing where their float memories allocate nothing", "[memory][allocation]") {
    using bf16 = Eigen::bfloat16;
    using f16 = Eigen::half;
    SECTION("SlidingWindowCache") { check_no_allocation(SlidingWindowCache<bf16>(16, 8, 64, 4)); }
    SECTION("SlidingWindowCache, Q8") { check_no_allocation(SlidingWindowCache<f16, Q8>(16, 8, 64, 4)); }
    SECTION("MovingAverageCache") { check_no_allocation(MovingAverageCache<f16>(16, 8, 32)); }
    SECTION("HybridCache") { check_no_allocation(HybridCache<bf16>(16, 8, 32, 4, 8)); }
    SECTION("LinearAttentionMemory") { check_no_allocation(LinearAttentionMemory<bf16>(16, 8)); }
    SECTION("MultiHead<SlidingWindowCache>, groups of four") {
        check_no_allocation(MultiHead<SlidingWindowCache<bf16>>(HeadLayout{8, 2, 8, 4},
                                                                [](Index) { return SlidingWindowCache<bf16>(8, 4, 32, 2); }));
    }
    SECTION("MultiHead<LinearAttentionMemory>, groups of two") {
        check_no_allocation(MultiHead<LinearAttentionMemory<f16>>(
            HeadLayout{4, 2, 8, 4}, [](Index) { return LinearAttentionMemory<f16>(8, 4); }));
    }
    SECTION("KVCache and MultiHead<KVCache>, reserved, with the generic decode of one row") {
        const Index n = 600, d = 16, steps = 50;
        const Matrix<bf16> K = random_matrix<float>(n + steps, 32, 2).cast<bf16>(),
                           V = random_matrix<float>(n + steps, 32, 3).cast<bf16>(),
                           Q = random_matrix<float>(steps, 64, 1).cast<bf16>();
        KVCache<bf16> cache(d, d);
        MultiHead<KVCache<bf16>> layer(HeadLayout{.q_heads = 4, .kv_heads = 2, .head_dim = d},
                                       [](Index) { return KVCache<bf16>(16, 16); });
        cache.reserve(n + steps);
        layer.reserve(n + steps);
        memattn::extend(cache, K.topRows(n).leftCols(d), V.topRows(n).leftCols(d));
        memattn::extend(layer, K.topRows(n), V.topRows(n));
        Vector<bf16> out(d);
        Matrix<bf16> O(1, 64), group(4, d);
        HeapWatch watch;
        for (Index i = 0; i < steps; ++i) {
            cache.update(K.row(n + i).head(d), V.row(n + i).head(d));
            cache.attend(Q.row(i).head(d), out);
            cache.attend_group(Eigen::Map<const Matrix<bf16>>(Q.row(i).data(), 4, d), group);  // four query heads
            decode(layer, Q.row(i), K.row(n + i), V.row(n + i), O);
        }
        const auto counts = watch.stop();
        CHECK(counts.operator_news == 0);
        CHECK(counts.eigen_mallocs == 0);
        CHECK(cache.length() == n + steps);
        CHECK(O.allFinite());
    }
}

TEMPLATE_TEST_CASE("KVCache: the decode steps after a prefill or a bulk extend do not reallocate", "[memory][allocation]",
                   float, double) {
    using T = TestType;
    const Index n = 2000, d = 16, dv = 8, steps = 200;
    const Matrix<T> Q = random_matrix<T>(n, d, 1), K = random_matrix<T>(n, d, 2), V = random_matrix<T>(n, dv, 3);
    Matrix<T> O(n, dv);
    Vector<T> out(dv);
    for (const bool bulk_prefill : {true, false}) {
        KVCache<T> cache(d, dv);
        if (bulk_prefill)
            prefill(cache, Q, K, V, O);
        else
            extend(cache, K, V);
        INFO((bulk_prefill ? "after prefill" : "after extend") << " of " << n << " pairs, capacity "
                                                               << cache.capacity() << " bytes");
        HeapWatch watch;
        for (Index i = 0; i < steps; ++i) {
            cache.update(K.row(i), V.row(i));
            cache.attend(Q.row(i), out);
        }
        const auto counts = watch.stop();
        CHECK(counts.operator_news == 0);
        CHECK(counts.eigen_mallocs == 0);
        CHECK(cache.length() == n + steps);
    }
}

TEMPLATE_TEST_CASE("KVCache with per-channel keys: decode steps, grouped attends and truncates allocate nothing",
                   "[memory][allocation][per-channel]", Q8, Q4Affine) {
    using S = PerChannelKeys<TestType>;
    const Index n = 700, d = 40, dv = 8, steps = 100;
    const Matrix<float> Q = random_matrix<float>(n, d, 1), K = random_matrix<float>(n, d, 2),
                        V = random_matrix<float>(n, dv, 3);
    Matrix<float> O(n, dv), group(4, dv);
    Vector<float> out(dv);
    KVCache<float, S> cache(d, dv);
    prefill(cache, Q, K, V, O);  // leaves room to grow
    HeapWatch watch;
    for (Index i = 0; i < steps; ++i) {  // three groups finish on the way
        cache.update(K.row(i), V.row(i));
        cache.attend(Q.row(i), out);
        cache.attend_group(Q.middleRows(i, 4), group);
    }
    cache.truncate(704);  // a group boundary
    cache.update(K.row(0), V.row(0));
    cache.attend(Q.row(0), out);
    const auto counts = watch.stop();
    CHECK(counts.operator_news == 0);
    CHECK(counts.eigen_mallocs == 0);
    CHECK(cache.length() == 705);
    CHECK(out.allFinite());
}

TEMPLATE_TEST_CASE("SparseKVCache: reserved decode steps, grouped attends and truncates allocate nothing",
                   "[memory][allocation][sparse]", float, Eigen::bfloat16) {
    using S = TestType;
    const Index n = 900, d = 40, dv = 8, steps = 100;
    const Matrix<float> Q = random_matrix<float>(n, d, 1), K = random_matrix<float>(n, d, 2),
                        V = random_matrix<float>(n, dv, 3);
    Matrix<float> group(4, dv);
    Vector<float> out(dv);
    SparseKVCache<float, S> cache(d, dv, {.block = 8, .top_k_blocks = 6, .window = 16, .sinks = 2});
    cache.reserve(n);
    cache.extend(K.topRows(n - steps), V.topRows(n - steps));
    HeapWatch watch;
    for (Index i = n - steps; i < n; ++i) {  // new blocks begin on the way
        cache.update(K.row(i), V.row(i));
        cache.attend(Q.row(i), out);
        cache.attend_group(Q.middleRows(i - 4, 4), group);
    }
    cache.truncate(n - 13);  // inside a block: its bounds recomputed
    cache.update(K.row(0), V.row(0));
    cache.attend(Q.row(0), out);
    const auto counts = watch.stop();
    CHECK(counts.operator_news == 0);
    CHECK(counts.eigen_mallocs == 0);
    CHECK(cache.length() == n - 12);
    CHECK(out.allFinite());
}

/// MultiHead of 8 query heads over 2 KV heads of d = 16, each made by make(h), with 9000
/// pairs (five pieces a head at split_keys 2048, and work enough to be spread over the
/// threads), reserved: 20 decode steps on `threads` threads allocate nothing.
template <class T, class Make>
void check_split_steps(const Make& make, int threads) {
    using M = std::invoke_result_t<const Make&, Index>;
    const HeadLayout layout{.q_heads = 8, .kv_heads = 2, .head_dim = 16};
    const Index n = 9000, steps = 20;
    const Matrix<T> K = random_matrix<T>(n + steps, 32, 2), V = random_matrix<T>(n + steps, 32, 3),
                    Q = random_matrix<T>(steps, 128, 1);
    MultiHead<M> mem(layout, make);
    mem.reserve(n + steps);
    mem.extend(K.topRows(n), V.topRows(n));
    const OpenMPExecutor executor{.threads = threads};
    mem.set_executor(executor);
    Vector<T> out(128);
    HeapWatch watch;
    for (Index i = 0; i < steps; ++i) {
        mem.update(K.row(n + i), V.row(n + i));
        mem.attend(Q.row(i), out);
    }
    const auto counts = watch.stop();
    CHECK(counts.operator_news == 0);
    CHECK(counts.eigen_mallocs == 0);
    CHECK(out.allFinite());
}

TEMPLATE_TEST_CASE("MultiHead<KVCache>: split decode steps allocate nothing once reserved, at 1 and 2 threads",
                   "[memory][allocation][layer]", float, double) {
    using T = TestType;
    const double values[4] = {0.5, -0.25, 1, 0};
    const SoftmaxOptions options{.softcap = 4, .sink_logits = values, .alibi_slopes = values};
    for (const auto& [threads, logits] : {std::pair{1, false}, {2, false}, {1, true}, {2, true}}) {
        INFO(threads << " threads" << (logits ? ", with logit options and RoPE" : ""));
        const bool with = logits;  // for the lambda (clang 14 cannot capture a binding)
        check_split_steps<T>(
            [&](Index) { return with ? KVCache<T>(16, 16, options, Rope{.head_dim = 16}) : KVCache<T>(16, 16); },
            threads);
    }
}

TEMPLATE_TEST_CASE("MultiHead<KVCache<float, S>> with FpMath::bf16 (bfloat16 and FP8 rows): split decode steps "
                   "allocate nothing once reserved, at 1 and 2 threads",
                   "[memory][allocation][layer]", Eigen::bfloat16, Fp8E4M3) {
    using S = TestType;
    const SoftmaxOptions options{.fpmath = FpMath::bf16};
    for (const bool rope : {false, true})
        for (const int threads : {1, 2}) {
            INFO(threads << " threads" << (rope ? ", RoPE" : ""));
            check_split_steps<float>(
                [&](Index) {
                    return rope ? KVCache<float, S>(16, 16, options, Rope{.head_dim = 16})
                                : KVCache<float, S>(16, 16, options);
                },
                threads);
        }
}

TEMPLATE_TEST_CASE("PagedKVCache: steps allocate nothing, through new blocks, copy-on-write and truncate",
                   "[serving][allocation]", float, Eigen::bfloat16, Q8, Q4) {
    using S = TestType;
    const HeadLayout layout{.q_heads = 8, .kv_heads = 2, .head_dim = 64};
    const Index n = 3000, steps = 40;
    const Matrix<float> K = random_matrix<float>(n + steps, 128, 2), V = random_matrix<float>(n + steps, 128, 3),
                        Q = random_matrix<float>(steps, 512, 1);
    for (const int threads : {1, 2}) {
        INFO(threads << " threads");
        PagedKVCache<float, S> pool(layout, 64, 100);
        const OpenMPExecutor executor{.threads = threads};
        pool.set_executor(executor);
        const Index a = pool.add_sequence();
        pool.extend(a, K.topRows(n - 50), V.topRows(n - 50));  // the last block half full
        const Index b = pool.fork(a);                          // shares it
        Vector<float> out(512);
        HeapWatch watch;
        for (Index i = 0; i < steps; ++i) {  // b copies the shared block, then both take new ones
            pool.update(a, K.row(n + i), V.row(n + i));
            pool.update(b, K.row(n - 50 + i), V.row(n - 50 + i));
            pool.attend(a, Q.row(i), out);
            pool.attend(b, Q.row(i), out);
        }
        pool.truncate(b, 10);
        pool.extend(b, K.topRows(7), V.topRows(7));
        pool.attend(b, Q.row(0), out);
        pool.remove(a);
        const auto counts = watch.stop();
        CHECK(counts.operator_news == 0);
        CHECK(counts.eigen_mallocs == 0);
        CHECK(out.allFinite());
    }
}

TEMPLATE_TEST_CASE("PagedKVCache::prefill: chunks of a prompt beside decodes allocate nothing once a call has run",
                   "[serving][allocation][prefill]", float, Q8, Eigen::bfloat16) {
    using S = TestType;
    // bfloat16 rows also with FpMath::bf16: the value tiles' pairs a walk keeps for the
    // other heads of its group (PackedValueTiles), for a prompt longer at every call.
    const FpMath fpmath =
        std::is_same_v<S, Eigen::bfloat16> ? GENERATE(FpMath::strict, FpMath::bf16) : FpMath::strict;
    CAPTURE(static_cast<int>(fpmath));
    const HeadLayout layout{.q_heads = 8, .kv_heads = 2, .head_dim = 64};
    const Index chunk = 100, calls = 4, rows = calls * (chunk + 1);
    const Matrix<float> K = random_matrix<float>(500 + rows, 128, 7), V = random_matrix<float>(500 + rows, 128, 8),
                        Q = random_matrix<float>(rows, 512, 9);
    for (const Index window : {0, 300}) {
        for (const int threads : {1, 2}) {
            INFO("window " << window << ", " << threads << " threads");
            PagedKVCache<float, S> pool(layout, 80, 32,
                                        SoftmaxOptions{.window = window, .sink_tokens = 4, .fpmath = fpmath});
            const OpenMPExecutor executor{.threads = threads};
            pool.set_executor(executor);
            const Index a = pool.add_sequence(), b = pool.add_sequence();
            pool.extend(a, K.topRows(400), V.topRows(400));  // past the window: its tiles from the first call on
            pool.extend(b, K.topRows(50), V.topRows(50));
            const std::vector<Index> seqs{a, b}, offsets{0, chunk, chunk + 1};
            Matrix<float> O(chunk + 1, 512);
            const auto step = [&](Index i) {
                const Index r = i * (chunk + 1);
                pool.prefill(seqs, offsets, Q.middleRows(r, chunk + 1), K.middleRows(500 + r, chunk + 1),
                             V.middleRows(500 + r, chunk + 1), O);
            };
            step(0);
            HeapWatch watch;
            for (Index i = 1; i < calls; ++i)
                step(i);
            const auto counts = watch.stop();
            CHECK(counts.operator_news == 0);
            CHECK(counts.eigen_mallocs == 0);
            CHECK(O.allFinite());
        }
    }
}

TEST_CASE("PagedKVCache: decode steps of forks that read their shared prompt together allocate nothing",
          "[serving][allocation][prefix]") {
    const HeadLayout layout{.q_heads = 8, .kv_heads = 2, .head_dim = 64};
    const Index prompt = 600, forks = 6, steps = 8;
    const Matrix<float> K = random_matrix<float>(prompt + steps, 128, 10),
                        V = random_matrix<float>(prompt + steps, 128, 11), Q = random_matrix<float>(forks, 512, 12);
    for (const int threads : {1, 2}) {
        INFO(threads << " threads");
        PagedKVCache<float> pool(layout, 64, 32);
        const OpenMPExecutor executor{.threads = threads};
        pool.set_executor(executor);
        const Index root = pool.add_sequence();
        pool.extend(root, K.topRows(prompt), V.topRows(prompt));
        std::vector<Index> seqs;
        for (Index i = 0; i < forks; ++i)
            seqs.push_back(pool.fork(root));
        Matrix<float> O(forks, 512);
        const Matrix<float> Kt = K.middleRows(prompt, forks), Vt = V.middleRows(prompt, forks);
        batched_decode(pool, seqs, Q, Kt, Vt, O);  // the first step sizes the cascade's scratch
        HeapWatch watch;
        for (Index t = 1; t < steps; ++t)
            batched_decode(pool, seqs, Q, Kt, Vt, O);
        const auto counts = watch.stop();
        CHECK(counts.operator_news == 0);
        CHECK(counts.eigen_mallocs == 0);
        CHECK(O.allFinite());
    }
}

TEST_CASE("PagedKVCache with a window: steps that free the blocks the window leaves allocate nothing",
          "[serving][allocation][window]") {
    const HeadLayout layout{.q_heads = 8, .kv_heads = 2, .head_dim = 64};
    const Index steps = 700;
    const Matrix<float> K = random_matrix<float>(steps, 128, 4), V = random_matrix<float>(steps, 128, 5),
                        Q = random_matrix<float>(steps, 512, 6);
    // 700 tokens, two sequences, a pool of 14 blocks of 32: the window of 100 and 4 sinks
    // free the blocks as it moves (each holds the shared sink block and at most 5 more).
    PagedKVCache<float> pool(layout, 14, 32, SoftmaxOptions{.window = 100, .sink_tokens = 4});
    const Index a = pool.add_sequence();
    pool.extend(a, K.topRows(40), V.topRows(40));
    const Index b = pool.fork(a);
    Vector<float> out(512);
    const std::vector<Index> both{a, b};
    Matrix<float> O(2, 512);
    HeapWatch watch;
    for (Index i = 40; i + 1 < steps; i += 2) {
        pool.update(a, K.row(i), V.row(i));
        pool.attend(a, Q.row(i), out);
        batched_decode(pool, both, Q.middleRows(i, 2), K.middleRows(i, 2), V.middleRows(i, 2), O);
    }
    const auto counts = watch.stop();
    CHECK(counts.operator_news == 0);
    CHECK(counts.eigen_mallocs == 0);
    CHECK(pool.length(a) > pool.blocks() * pool.block_size());
    CHECK(O.allFinite());
}

TEMPLATE_TEST_CASE("LatentKVCache and mla_decode: reserved decode steps allocate nothing, at 1 and 2 threads",
                   "[memory][allocation][latent]", float, Eigen::bfloat16) {
    using S = TestType;
    // 32 heads, r = 64, d_r = 16 over 4000 tokens: 4 pieces, enough work per step for the
    // threads; the absorbed step's buffers sized by its first call on each thread.
    const Index heads = 32, r = 64, dr = 16, nope = 8, dv = 8, n = 4000, steps = 12;
    const Matrix<float> C = random_matrix<float>(n + steps, r, 4), KR = random_matrix<float>(n + steps, dr, 5);
    const Matrix<float> Q = random_matrix<float>(heads, r + dr, 6), q_nope = random_matrix<float>(heads, nope, 7),
                        q_rope = random_matrix<float>(heads, dr, 8), W_UK = random_matrix<float>(heads * nope, r, 9),
                        W_UV = random_matrix<float>(heads * dv, r, 10);
    const double sinks[1] = {0.5};
    // bfloat16 rows also with FpMath::bf16 (the rounded queries, the pairs' buffers).
    const FpMath fpmath = std::is_same_v<S, float> ? FpMath::strict : GENERATE(FpMath::strict, FpMath::bf16);
    CAPTURE(static_cast<int>(fpmath));
    for (const int threads : {1, 2}) {
        INFO(threads << " threads");
        LatentKVCache<float, S> cache(r, dr, 0.125f,
                                      SoftmaxOptions{.softcap = 8, .sink_logits = sinks, .fpmath = fpmath});
        cache.reserve(n + steps);
        cache.extend(C.topRows(n), KR.topRows(n));
        const OpenMPExecutor executor{.threads = threads};
        Matrix<float> latent(heads, r), out(heads, dv);
        cache.attend(Q, latent, executor);  // the first attend sizes the scratch
        mla_decode(cache, q_nope, q_rope, W_UK, W_UV, out, executor);
        HeapWatch watch;
        for (Index i = 0; i < steps; ++i) {
            cache.update(C.row(n + i), KR.row(n + i));
            cache.attend(Q, latent, executor);
            mla_decode(cache, q_nope, q_rope, W_UK, W_UV, out, executor);
        }
        cache.truncate(n);
        cache.attend(Q, latent, executor);
        const auto counts = watch.stop();
        CHECK(counts.operator_news == 0);
        CHECK(counts.eigen_mallocs == 0);
        CHECK(latent.allFinite());
        CHECK(out.allFinite());
    }
}

TEMPLATE_TEST_CASE("PagedLatentKVCache: reserved batched decode steps allocate nothing, at 1 and 2 threads",
                   "[serving][allocation][latent]", float, Eigen::bfloat16) {
    using S = TestType;
    // Three sequences (two sharing a prefix by fork) of 32 heads over up to 2500 tokens,
    // crossing piece and block edges during the steps; the decode of the pool and the
    // batched absorbed step, each sized by a first call.
    const Index heads = 32, r = 64, dr = 16, nope = 8, dv = 8, n = 2040, steps = 12, B = 3;
    const Matrix<float> C = random_matrix<float>(n + steps + B, r, 11), KR = random_matrix<float>(n + steps + B, dr, 12);
    const Matrix<float> Q = random_matrix<float>(B * heads, r + dr, 13), q_nope = random_matrix<float>(B * heads, nope, 14),
                        q_rope = random_matrix<float>(B * heads, dr, 15), W_UK = random_matrix<float>(heads * nope, r, 16),
                        W_UV = random_matrix<float>(heads * dv, r, 17);
    // bfloat16 rows also with FpMath::bf16: blocks of 64, so every tile is gathered, by a
    // buffer reserve() sizes.
    const FpMath fpmath = std::is_same_v<S, float> ? FpMath::strict : GENERATE(FpMath::strict, FpMath::bf16);
    CAPTURE(static_cast<int>(fpmath));
    for (const int threads : {1, 2}) {
        INFO(threads << " threads");
        const OpenMPExecutor executor{.threads = threads};
        PagedLatentKVCache<float, S> pool(r, dr, 0.125f, 64, 64, SoftmaxOptions{.fpmath = fpmath});
        pool.set_executor(executor);
        const Index a = pool.add_sequence();
        pool.extend(a, C.topRows(n), KR.topRows(n));
        const Index b = pool.fork(a), c = pool.add_sequence();
        pool.extend(c, C.topRows(100), KR.topRows(100));
        const std::vector<Index> seqs{a, b, c};
        pool.reserve(heads, B, 3 * (n + steps + 2));
        Matrix<float> latent(B * heads, r), out(B * heads, dv);
        HeapWatch first;  // after reserve, the pool's own steps allocate nothing from the start
        pool.decode(seqs, Q, C.middleRows(n, B), KR.middleRows(n, B), latent);
        pool.decode(seqs, Q, C.middleRows(n + 1, B), KR.middleRows(n + 1, B), latent);
        const auto reserved = first.stop();
        CHECK(reserved.operator_news == 0);
        CHECK(reserved.eigen_mallocs == 0);
        mla_decode(pool, seqs, q_nope, q_rope, W_UK, W_UV, out, executor);  // sizes the thread's step buffers
        HeapWatch watch;
        for (Index i = 2; i < steps; ++i) {
            pool.decode(seqs, Q, C.middleRows(n + i, B), KR.middleRows(n + i, B), latent);
            mla_decode(pool, seqs, q_nope, q_rope, W_UK, W_UV, out, executor);
        }
        pool.truncate(b, n);
        const auto counts = watch.stop();
        CHECK(counts.operator_news == 0);
        CHECK(counts.eigen_mallocs == 0);
        CHECK(pool.length(a) == n + steps);
        CHECK(latent.allFinite());
        CHECK(out.allFinite());
    }
}

TEST_CASE("StatePool: add, fork, remove, decode steps and their checkpoints, verify steps, accept and reject allocate "
          "nothing (a verify step once one of its size has run), at 1 and 2 threads",
          "[serving][allocation][state_pool]") {
    const Index d = 16, dv = 16, heads = 4;
    const HeadLayout layout{heads, heads, d};
    using Layer = MultiHead<DeltaRuleMemory<float>>;
    const Layer prototype(layout, [d, dv](Index) { return DeltaRuleMemory<float>(d, dv); });
    const Index kw = prototype.key_dim(), steps = 20;
    Matrix<float> K = random_matrix<float>(3 * steps, kw, 20);
    for (Index h = 0; h < heads; ++h)  // β in [0, 1]
        K.col(h * (d + 1) + d) = K.col(h * (d + 1) + d).cwiseAbs().cwiseMin(1.0f);
    const Matrix<float> Q = random_matrix<float>(3 * steps, prototype.query_dim(), 21),
                        V = random_matrix<float>(3 * steps, prototype.value_dim(), 22);
    for (const int threads : {1, 2}) {
        INFO(threads << " threads");
        const OpenMPExecutor executor{.threads = threads};
        StatePool<Layer> pool(4, prototype, {.checkpoint_tokens = 4, .checkpoints = 2, .draft_states = 8});
        pool.set_executor(executor);
        Matrix<float> O(3, prototype.output_dim()), drafts(7, prototype.output_dim());
        const Index a = pool.add(), b = pool.add();
        const std::vector<Index> ids{a, b, pool.fork(a)};
        pool.decode(ids, Q.topRows(3), K.topRows(3), V.topRows(3), O);  // a first step
        // A verify step of a tree of 5 drafts for a and a chain of 2 for b: the first of
        // its size sizes the trees' lists.
        const std::vector<Index> two{a, b}, offsets{0, 5, 7}, parents{-1, 0, 0, 2, 3, -1, 0}, path{0, 2, 3, 4};
        const auto verify = [&] {
            pool.prefill(two, offsets, Q.topRows(7), K.topRows(7), V.topRows(7), drafts, parents);
        };
        verify();
        pool.reject(a);
        pool.reject(b);
        HeapWatch watch;
        for (Index i = 1; i < steps; ++i)
            pool.decode(ids, Q.middleRows(3 * i, 3), K.middleRows(3 * i, 3), V.middleRows(3 * i, 3), O);
        const Index f = pool.fork(b);
        pool.truncate(f, 16);
        pool.remove(f);
        verify();
        pool.accept(a, path);  // lengths 21 to 24: it ends on a checkpoint (a copy in place)
        pool.reject(b);
        const auto counts = watch.stop();
        CHECK(pool.length(a) == steps + 4);
        CHECK(pool.checkpoint_before(a, 24) == 24);
        CHECK(pool.checkpoint_before(a, 23) == 20);
        CHECK(drafts.allFinite());
        pool.truncate(a, steps);
        CHECK(counts.operator_news == 0);
        CHECK(counts.eigen_mallocs == 0);
        CHECK(pool.length(a) == steps);
        CHECK(O.allFinite());
    }
}

namespace {

/// A StatePool of `prototype` (keys from `keys`): forks, decode steps with checkpoints, a
/// verify step and an accept ending on a checkpoint (its state copied into the ring)
/// allocate nothing once the first verify step of the size has run.
template <class M, class Keys>
void state_pool_allocates_nothing(const M& prototype, Index qd, Index vd, Keys&& keys) {
    using S = typename M::Scalar;
    StatePool<M> pool(3, prototype, {.checkpoint_tokens = 2, .checkpoints = 2, .draft_states = 4});
    const Matrix<S> Q = random_matrix<float>(4, qd, 40).template cast<S>(), K = keys(4),
                    V = random_matrix<float>(4, vd, 42).template cast<S>();
    Matrix<S> O(4, vd);
    const Index a = pool.add();
    const std::vector<Index> ids{a}, offsets{0, 4}, parents{-1, 0, 1, 0}, path{0, 1};
    pool.prefill(ids, offsets, Q, K, V, O, parents);
    pool.reject(a);
    HeapWatch watch;
    const Index b = pool.fork(a);
    pool.decode(ids, Q.topRows(1), K.topRows(1), V.topRows(1), O.topRows(1));
    pool.decode(ids, Q.topRows(1), K.topRows(1), V.topRows(1), O.topRows(1));  // a checkpoint at 2
    pool.prefill(ids, offsets, Q, K, V, O, parents);
    pool.accept(a, path);  // 3, then 4 on a checkpoint: its state copied into the ring
    pool.remove(b);
    const auto counts = watch.stop();
    CHECK(counts.operator_news == 0);
    CHECK(counts.eigen_mallocs == 0);
    CHECK(pool.length(a) == 4);
    CHECK(pool.checkpoint_before(a, 3) == 2);  // the ring: 2 and 4
}

}  // namespace

TEST_CASE("StatePool of linear attention and bfloat16 memories: forks, checkpoints, verify steps and accept copy in "
          "place, allocating nothing", "[serving][allocation][state_pool]") {
    const Index d = 8, dv = 4;
    state_pool_allocates_nothing(LinearAttentionMemory<float>(d, dv), d, dv,
                                 [&](Index n) { return random_matrix<float>(n, d, 41); });
    Matrix<float> beta_keys = random_matrix<float>(4, d + 1, 41);
    beta_keys.col(d) = beta_keys.col(d).cwiseAbs().cwiseMin(1.0f);
    state_pool_allocates_nothing(DeltaRuleMemory<Eigen::bfloat16>(d, dv), d, dv,
                                 [&](Index) { return Matrix<Eigen::bfloat16>(beta_keys.cast<Eigen::bfloat16>()); });
}

TEST_CASE("ModelCache of a hybrid model: a decode step of its recurrent and softmax layers allocates nothing once one "
          "of its size has run, at 1 and 2 threads",
          "[serving][allocation][state_pool][model]") {
    const Index d = 16, heads = 4;
    using Layer = MultiHead<DeltaRuleMemory<float>>;
    using Cache = ModelCache<float, Eigen::bfloat16, Layer>;
    const Layer prototype(HeadLayout{heads, heads, d}, [d](Index) { return DeltaRuleMemory<float>(d, d); });
    const HeadLayout softmax{.q_heads = 8, .kv_heads = 2, .head_dim = d};
    const std::vector<Cache::Layer> layers{StateLayer<Layer>{prototype, {.checkpoint_tokens = 4}},
                                           ModelLayer{.layout = softmax, .blocks = 64, .block_size = 8},
                                           StateLayer<Layer>{prototype, {}}};
    const Index steps = 20, batch = 3;
    Matrix<float> K = random_matrix<float>(batch * steps, prototype.key_dim(), 30);
    for (Index h = 0; h < heads; ++h)  // β in [0, 1]
        K.col(h * (d + 1) + d) = K.col(h * (d + 1) + d).cwiseAbs().cwiseMin(1.0f);
    const Matrix<float> Q = random_matrix<float>(batch * steps, prototype.query_dim(), 31),
                        V = random_matrix<float>(batch * steps, prototype.value_dim(), 32),
                        q = random_matrix<float>(batch * steps, 8 * d, 33),
                        kv = random_matrix<float>(batch * steps, 2 * d, 34);
    for (const int threads : {1, 2}) {
        INFO(threads << " threads");
        const OpenMPExecutor executor{.threads = threads};
        Cache cache(layers, 4);
        cache.states(0).set_executor(executor);
        cache.layer(1).set_executor(executor);
        cache.states(2).set_executor(executor);
        const Index a = cache.add_sequence(), b = cache.add_sequence();
        const std::vector<Index> ids{a, b, cache.fork(a)};
        Matrix<float> O(batch, prototype.output_dim()), o(batch, 8 * d);
        const auto step = [&](Index i) {
            const auto& plan = cache.plan_decode(ids);
            for (Index l = 0; l < cache.layers(); ++l) {
                if (cache.recurrent(l))
                    cache.decode(l, plan, Q.middleRows(batch * i, batch), K.middleRows(batch * i, batch),
                                 V.middleRows(batch * i, batch), O);
                else
                    cache.decode(l, plan, q.middleRows(batch * i, batch), kv.middleRows(batch * i, batch),
                                 kv.middleRows(batch * i, batch), o);
            }
        };
        step(0);  // the first step of its size
        HeapWatch watch;
        for (Index i = 1; i < steps; ++i)
            step(i);
        const auto counts = watch.stop();
        CHECK(counts.operator_news == 0);
        CHECK(counts.eigen_mallocs == 0);
        CHECK(cache.length(a) == steps);
        CHECK(O.allFinite());
        CHECK(o.allFinite());
    }
}
