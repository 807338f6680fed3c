// attend is const and safe to call from several threads on one memory at once. Its own
// small executable, so that the `tsan` preset (ThreadSanitizer) builds and runs only it.
#include "support.hpp"

#include <memattn/memattn.hpp>

#include <thread>
#include <vector>

using namespace memattn;
using memattn::test::random_matrix;

namespace {

/// Several threads attend to one memory at once; each result equals the serial one bit for bit.
template <class Mem>
void attend_concurrently(Mem mem) {
    const Index d = mem.key_dim(), dv = mem.value_dim(), queries = 64;
    extend(mem, random_matrix<float>(300, d, 1), random_matrix<float>(300, dv, 2));
    const Mem& shared = mem;
    const Matrix<float> Q = random_matrix<float>(queries, d, 3);
    Matrix<float> serial(queries, dv);
    for (Index i = 0; i < queries; ++i)
        shared.attend(Q.row(i), serial.row(i));
    constexpr int threads = 4;
    std::vector<Matrix<float>> results(threads, Matrix<float>(queries, dv));
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
    attend_concurrently(LinearAttentionMemory<float>(8, 6));
    attend_concurrently(LinearAttentionMemory<float, Taylor2>(8, 6));
}
