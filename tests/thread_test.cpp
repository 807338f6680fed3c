// attend is const and safe to call from several threads on one memory at once, and the
// multi-head layer's threaded paths give the same bits for any thread count. Its own
// small executable, so that the `tsan` preset (ThreadSanitizer) builds and runs only it.
#include "support.hpp"

#include <memattn/memattn.hpp>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

using namespace memattn;
using memattn::test::random_matrix;

namespace {

/// Several threads attend to one memory at once; each result equals the serial one bit for bit.
template <class Mem>
void attend_concurrently(Mem mem) {
    using T = typename Mem::Scalar;
    const Index d = mem.key_dim(), dv = mem.value_dim(), queries = 64;
    const Matrix<T> K = random_matrix<float>(300, d, 1).cast<T>(), V = random_matrix<float>(300, dv, 2).cast<T>();
    extend(mem, K, V);
    const Mem& shared = mem;
    const Matrix<T> Q = random_matrix<float>(queries, d, 3).cast<T>();
    Matrix<T> serial(queries, dv);
    for (Index i = 0; i < queries; ++i)
        shared.attend(Q.row(i), serial.row(i));
    constexpr int threads = 4;
    std::vector<Matrix<T>> results(threads, Matrix<T>(queries, dv));
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
            for (int repeat = 0; repeat < 20; ++repeat)
                for (Index i = 0; i < queries; ++i)
                    shared.attend(Q.row((i + t) % queries), results[static_cast<std::size_t>(t)].row((i + t) % queries));
        });
    for (auto& thread : pool)
        thread.join();
    for (const auto& r : results)
        CHECK(r == serial);
}

}  // namespace

TEST_CASE("threads: attend is const and safe from several threads on one memory", "[robustness][threads]") {
    attend_concurrently(KVCache<float>(8, 6));
    attend_concurrently(SlidingWindowCache<float>(8, 6, 64, 4));
    attend_concurrently(MovingAverageCache<float>(8, 6, 16));
    attend_concurrently(HybridCache<float>(8, 6, 32, 4, 16));
    attend_concurrently(SparseKVCache<float>(8, 6, {.block = 8, .top_k_blocks = 5, .window = 16, .sinks = 2}));
    attend_concurrently(LinearAttentionMemory<float>(8, 6));
    attend_concurrently(LinearAttentionMemory<float, Taylor2>(8, 6));
    // 16-bit rows: one attend takes the memory's conversion buffers, the others their own
    attend_concurrently(KVCache<Eigen::bfloat16>(8, 6));
    attend_concurrently(SlidingWindowCache<Eigen::half, Q8>(8, 6, 64, 4));
    attend_concurrently(LinearAttentionMemory<Eigen::bfloat16>(8, 6));
}

namespace {

/// Runs f() with 1, 2, 3 and 4 threads (without OpenMP, once per count on the one
/// thread) and checks every result bitwise equal to the first.
template <class F>
void same_bits_for_any_thread_count(F&& f) {
#if defined(_OPENMP)
    const int saved = omp_get_max_threads();
#endif
    Matrix<float> first;
    for (int threads = 1; threads <= 4; ++threads) {
#if defined(_OPENMP)
        omp_set_num_threads(threads);
#endif
        const Matrix<float> result = f();
        if (threads == 1)
            first = result;
        INFO("threads " << threads);
        CHECK(result.rows() == first.rows());
        CHECK((result.array() == first.array()).all());
    }
#if defined(_OPENMP)
    omp_set_num_threads(saved);
#endif
}

}  // namespace

TEST_CASE("threads: the multi-head kernels give the same bits for 1 to 4 threads", "[layer][threads]") {
    const HeadLayout layout{8, 2, 16};
    const std::vector<Index> offsets{0, 100, 100, 260, 333};
    const Matrix<float> Q = random_matrix<float>(333, 128, 1), K = random_matrix<float>(333, 32, 2),
                        V = random_matrix<float>(333, 32, 3);
    same_bits_for_any_thread_count([&] {
        Matrix<float> O(333, 128), lse(333, 8);
        multi_head_causal_softmax_attention(Q, K, V, O, lse, layout, {.window = 70, .sink_tokens = 2},
                                            VarLen{offsets, offsets});
        Matrix<float> both(333, 136);
        both << O, lse;
        return both;
    });
    same_bits_for_any_thread_count([&] {  // bfloat16 in, float out (bfloat16 products on AVX512-BF16)
        const Matrix<Eigen::bfloat16> Qb = Q.cast<Eigen::bfloat16>(), Kb = K.cast<Eigen::bfloat16>(),
                                      Vb = V.cast<Eigen::bfloat16>();
        Matrix<float> O(333, 128);
        multi_head_causal_softmax_attention(Qb, Kb, Vb, O, layout, {.window = 70, .sink_tokens = 2},
                                            VarLen{offsets, offsets});
        return O;
    });
    same_bits_for_any_thread_count([&] {
        Matrix<float> O(333, 128);
        std::vector<LinearState<float>> states(4 * 2);
        multi_head_chunked_linear_attention(Q, K, V, O, layout, EluPlusOne{}, {}, std::span(states),
                                            VarLen{offsets, offsets});
        return O;
    });
    same_bits_for_any_thread_count([&] {  // MQA: one KV head, its group split across threads
        Matrix<float> O(333, 128);
        multi_head_chunked_linear_attention(Q, K.leftCols(16), V.leftCols(16), O, HeadLayout{8, 1, 16});
        return O;
    });
}

TEST_CASE("threads: MultiHead decode and prefill give the same bits for 1 to 4 threads", "[layer][threads]") {
    const HeadLayout layout{4, 1, 8};
    const Index n = 2 * MultiHead<KVCache<float>>::split_keys + 100;  // split into 3 pieces
    const Matrix<float> K = random_matrix<float>(n, 8, 4), V = random_matrix<float>(n, 8, 5);
    const Matrix<float> Q = random_matrix<float>(3, 32, 6);
    same_bits_for_any_thread_count([&] {
        MultiHead<KVCache<float>> mem(layout, [](Index) { return KVCache<float>(8, 8); });
        Matrix<float> prompt(n - 3, 32), O(3, 32);
        prefill(mem, random_matrix<float>(n - 3, 32, 7), K.topRows(n - 3), V.topRows(n - 3), prompt);
        decode(mem, Q, K.bottomRows(3), V.bottomRows(3), O);
        Matrix<float> both(n, 32);
        both << prompt, O;
        return both;
    });
}

TEST_CASE("threads: inside the caller's parallel region the layer runs serially", "[layer][threads]") {
    const HeadLayout layout{4, 2, 8};
    const Matrix<float> Q = random_matrix<float>(90, 32, 8), K = random_matrix<float>(90, 16, 9),
                        V = random_matrix<float>(90, 16, 10);
    Matrix<float> expected(90, 32);
    multi_head_causal_softmax_attention(Q, K, V, expected, layout);
    std::vector<Matrix<float>> results(2, Matrix<float>(90, 32));
    std::vector<int> threads_seen(2, 0);
#if defined(_OPENMP)
#pragma omp parallel for num_threads(2)
#endif
    for (int t = 0; t < 2; ++t) {
        threads_seen[static_cast<std::size_t>(t)] = detail::available_threads();
        multi_head_causal_softmax_attention(Q, K, V, results[static_cast<std::size_t>(t)], layout);
    }
    for (int t = 0; t < 2; ++t) {
        CHECK((results[static_cast<std::size_t>(t)].array() == expected.array()).all());
#if defined(_OPENMP)
        CHECK(threads_seen[static_cast<std::size_t>(t)] == 1);
#endif
    }
}

namespace {

/// A user's own pool of std::threads as a memattn::Executor, as a server would bring
/// one: parallel_for hands items to the workers and the calling thread, and waits.
class ThreadPool {
public:
    explicit ThreadPool(int workers) {
        for (int w = 0; w < workers; ++w)
            threads_.emplace_back([this] { work(); });
    }
    ~ThreadPool() {
        {
            const std::lock_guard<std::mutex> lock(mutex_);
            stop_ = true;
        }
        wake_.notify_all();
        for (auto& thread : threads_)
            thread.join();
    }
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    [[nodiscard]] int concurrency() const noexcept { return static_cast<int>(threads_.size()) + 1; }

    template <class F>
    void parallel_for(Index n, F&& f) const {
        std::unique_lock<std::mutex> lock(mutex_);
        job_ = [&f](Index i) { f(i); };
        next_ = 0;
        items_ = n;
        done_ = 0;
        ++generation_;
        calls_.fetch_add(1);
        lock.unlock();
        wake_.notify_all();
        run_items();  // the calling thread works too
        lock.lock();
        finished_.wait(lock, [this] { return done_ == items_; });
        job_ = nullptr;
    }

    [[nodiscard]] long calls() const noexcept { return calls_.load(); }

private:
    void run_items() const {
        for (;;) {
            std::unique_lock<std::mutex> lock(mutex_);
            if (!job_ || next_ >= items_)
                return;
            const Index i = next_++;
            const auto job = job_;
            lock.unlock();
            job(i);
            lock.lock();
            if (++done_ == items_)
                finished_.notify_all();
        }
    }
    void work() const {
        long seen = 0;
        for (;;) {
            {
                std::unique_lock<std::mutex> lock(mutex_);
                wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
                if (stop_)
                    return;
                seen = generation_;
            }
            run_items();
        }
    }

    std::vector<std::thread> threads_;
    mutable std::mutex mutex_;
    mutable std::condition_variable wake_, finished_;
    mutable std::function<void(Index)> job_;
    mutable Index next_ = 0, items_ = 0, done_ = 0;
    mutable long generation_ = 0;
    mutable std::atomic<long> calls_{0};
    bool stop_ = false;
};

static_assert(Executor<ThreadPool> && Executor<SerialExecutor> && Executor<OpenMPExecutor>);

}  // namespace

TEST_CASE("threads: every executor, a user's std::thread pool included, gives the same bits", "[layer][threads]") {
    const HeadLayout layout{8, 2, 16};
    const Index n = 2 * MultiHead<KVCache<float>>::split_keys + 300;  // three pieces per head
    const Matrix<float> Q = random_matrix<float>(n, 128, 1), K = random_matrix<float>(n, 32, 2),
                        V = random_matrix<float>(n, 32, 3);
    const auto run = [&](ExecutorRef executor) {
        Matrix<float> O(n, 128);
        multi_head_causal_softmax_attention(Q, K, V, O, layout, {.window = 700}, {}, executor);
        Matrix<float> linear(n, 128);
        multi_head_chunked_linear_attention(Q, K, V, linear, layout, EluPlusOne{}, {}, {}, {}, executor);
        MultiHead<KVCache<float>> mem(layout, [](Index) { return KVCache<float>(16, 16); });
        mem.set_executor(executor);
        Matrix<float> prompt(n - 4, 128), steps(4, 128);
        prefill(mem, Q.topRows(n - 4), K.topRows(n - 4), V.topRows(n - 4), prompt);
        decode(mem, Q.bottomRows(4), K.bottomRows(4), V.bottomRows(4), steps);  // the split attend
        Matrix<float> all(n, 3 * 128);
        all << O, linear, (Matrix<float>(n, 128) << prompt, steps).finished();
        return all;
    };
    const Matrix<float> serial = run(SerialExecutor{});
    for (const int threads : {1, 2, 3, 5}) {
        INFO("OpenMP, " << threads << " threads");
        CHECK((run(OpenMPExecutor{.threads = threads}).array() == serial.array()).all());
    }
    for (const int workers : {1, 2, 4}) {
        INFO("a pool of " << workers + 1 << " threads");
        ThreadPool pool(workers);
        CHECK((run(pool).array() == serial.array()).all());
        CHECK(pool.calls() > 0);
    }
    CHECK((run(ExecutorRef{}).array() == serial.array()).all());  // the default executor
}
