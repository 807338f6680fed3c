// Speed-up of memattn::mpi over one rank, in one mpirun run (MPI needs its own launcher,
// so this is a plain timing program, not Google Benchmark):
//
//   mpirun -np 2 build/bench/bench/distributed_bench [--reps R]
//
// Per repetition, interleaved: rank 0 alone computes the whole sequence with the
// single-process kernel (the others wait), then all ranks run the distributed call.
// Prints min and median seconds of each, their ratio, and the bytes each rank sends
// against the minimum the algorithm needs:
//   ring attention, causal softmax, N = 16384, d = dv = 64, contiguous and zigzag shards;
//   sequence-parallel chunked linear attention, N = 2^20, d = dv = 64;
//   sequence-parallel chunked gated linear attention (scalar gates), N = 2^18, d = dv = 128;
//   sequence-parallel gated delta rule (scalar gates) and KDA, N = 2^16, d = dv = 128, with
//   equal shards and with rank 0 holding twice the tokens of each other rank.
#include <memattn/distributed/mpi.hpp>
#include <memattn/kernels/delta_rule.hpp>
#include <memattn/kernels/causal_softmax.hpp>
#include <memattn/kernels/gated_linear_attention.hpp>
#include <memattn/kernels/linear_attention.hpp>


#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace {

using memattn::Index;
using Mat = memattn::Matrix<float>;

Mat random_matrix(Index rows, Index cols, unsigned seed) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    Mat m(rows, cols);
    for (Index i = 0; i < m.size(); ++i)
        m.data()[i] = u(gen);
    return m;
}

/// Seconds of f() on every rank between two barriers.
double timed(const std::function<void()>& f) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto start = std::chrono::steady_clock::now();
    f();
    MPI_Barrier(MPI_COMM_WORLD);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

struct Stats {
    double min, median;
};

Stats stats(std::vector<double> t) {
    std::sort(t.begin(), t.end());
    return {t.front(), t[t.size() / 2]};
}

std::string cpu_name() {
    std::ifstream in("/proc/cpuinfo");
    for (std::string line; std::getline(in, line);)
        if (line.rfind("model name", 0) == 0)
            return line.substr(line.find(':') + 2);
    return "unknown CPU";
}

/// The rows of the tokens a rank holds: contiguous, or zigzag (chunks r and 2P−1−r of 2P).
std::vector<Index> shard(Index tokens, int rank, int size, bool zigzag) {
    std::vector<Index> rows;
    if (!zigzag) {
        for (Index t = rank * tokens / size; t < (rank + 1) * tokens / size; ++t)
            rows.push_back(t);
        return rows;
    }
    for (Index c = 0; c < 2 * size; ++c)
        if (c == rank || c == 2 * size - 1 - rank)
            for (Index t = c * tokens / (2 * size); t < (c + 1) * tokens / (2 * size); ++t)
                rows.push_back(t);
    return rows;
}

Mat gather_rows(const Mat& m, const std::vector<Index>& rows) {
    Mat out(static_cast<Index>(rows.size()), m.cols());
    for (std::size_t i = 0; i < rows.size(); ++i)
        out.row(static_cast<Index>(i)) = m.row(rows[i]);
    return out;
}

}  // namespace

int main(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    int rank = 0, size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int reps = 5;
    for (int i = 1; i + 1 < argc; i += 2)
        if (std::string(argv[i]) == "--reps")
            reps = std::atoi(argv[i + 1]);
    if (rank == 0)
        std::printf("%s, %d ranks, %d repetitions, float\n", cpu_name().c_str(), size, reps);

    {  // Ring attention.
        const Index n = 16384, d = 64;
        const Mat Q = random_matrix(n, d, 1), K = random_matrix(n, d, 2), V = random_matrix(n, d, 3);
        Mat whole(n, d);
        std::vector<double> one, contiguous, zigzag;
        Mat q[2], k[2], v[2], o[2];
        for (int layout = 0; layout < 2; ++layout) {
            const auto rows = shard(n, rank, size, layout == 1);
            q[layout] = gather_rows(Q, rows), k[layout] = gather_rows(K, rows), v[layout] = gather_rows(V, rows);
            o[layout].resize(static_cast<Index>(rows.size()), d);
        }
        for (int r = 0; r < reps; ++r) {
            one.push_back(timed([&] {
                if (rank == 0)
                    memattn::causal_softmax_attention(Q, K, V, whole);
            }));
            contiguous.push_back(timed([&] {
                memattn::distributed_causal_softmax_attention(MPI_COMM_WORLD, q[0], k[0], v[0], o[0],
                                                              memattn::SoftmaxOptions{},
                                                              memattn::RingLayout::contiguous);
            }));
            zigzag.push_back(timed([&] {
                memattn::distributed_causal_softmax_attention(MPI_COMM_WORLD, q[1], k[1], v[1], o[1],
                                                              memattn::SoftmaxOptions{}, memattn::RingLayout::zigzag);
            }));
        }
        if (rank == 0) {
            const Stats a = stats(one), b = stats(contiguous), c = stats(zigzag);
            std::printf("ring attention N=%ld d=%ld: one rank %.4f s (median %.4f)\n", static_cast<long>(n),
                        static_cast<long>(d), a.min, a.median);
            std::printf("  contiguous: %.4f s (median %.4f), speed-up %.2fx (medians %.2fx)\n", b.min, b.median,
                        a.min / b.min, a.median / b.median);
            std::printf("  zigzag:     %.4f s (median %.4f), speed-up %.2fx (medians %.2fx)\n", c.min, c.median,
                        a.min / c.min, a.median / c.median);
            const double block = static_cast<double>(n) / size * static_cast<double>(2 * d) * sizeof(float);
            std::printf("  bytes sent per rank: %.0f ((P-1) blocks of n/P x (d+dv)); the causal minimum is "
                        "(P-1-r) blocks for rank r, %.0f on average\n",
                        (size - 1) * block, (size - 1) * block / 2);
        }
    }

    {  // Sequence-parallel linear attention.
        const Index n = Index(1) << 20, d = 64;
        const Index first = rank * n / size, last = (rank + 1) * n / size;
        const Mat Q = random_matrix(n, d, 4), K = random_matrix(n, d, 5), V = random_matrix(n, d, 6);
        Mat whole(n, d), o(last - first, d);
        std::vector<double> one, parallel;
        for (int r = 0; r < reps; ++r) {
            one.push_back(timed([&] {
                if (rank == 0)
                    memattn::chunked_linear_attention(Q, K, V, whole);
            }));
            parallel.push_back(timed([&] {
                memattn::distributed_chunked_linear_attention(MPI_COMM_WORLD, Q.middleRows(first, last - first),
                                                              K.middleRows(first, last - first),
                                                              V.middleRows(first, last - first), o);
            }));
        }
        if (rank == 0) {
            const Stats a = stats(one), b = stats(parallel);
            std::printf("linear attention N=%ld d=%ld: one rank %.4f s (median %.4f), %d ranks %.4f s (median %.4f), "
                        "speed-up %.2fx (medians %.2fx)\n",
                        static_cast<long>(n), static_cast<long>(d), a.min, a.median, size, b.min, b.median,
                        a.min / b.min, a.median / b.median);
            std::printf("  bytes sent per rank: one summary of %ld doubles per scan round (%d rounds at most), "
                        "the minimum being one summary\n",
                        static_cast<long>(3 + d + d * d),
                        size > 1 ? 32 - __builtin_clz(static_cast<unsigned>(size - 1)) : 0);
        }
    }
    {  // Sequence-parallel gated linear attention.
        const Index n = Index(1) << 18, d = 128;
        const Index first = rank * n / size, last = (rank + 1) * n / size;
        const Mat Q = random_matrix(n, d, 7), K = random_matrix(n, d, 8), V = random_matrix(n, d, 9);
        const Mat G = -0.05f * random_matrix(n, 1, 10).cwiseAbs();
        Mat whole(n, d), o(last - first, d);
        std::vector<double> one, parallel;
        for (int r = 0; r < reps; ++r) {
            one.push_back(timed([&] {
                if (rank == 0)
                    memattn::chunked_gated_linear_attention(Q, K, V, G, whole);
            }));
            parallel.push_back(timed([&] {
                memattn::distributed_chunked_gated_linear_attention(
                    MPI_COMM_WORLD, Q.middleRows(first, last - first), K.middleRows(first, last - first),
                    V.middleRows(first, last - first), G.middleRows(first, last - first), o);
            }));
        }
        if (rank == 0) {
            const Stats a = stats(one), b = stats(parallel);
            std::printf("gated linear attention N=%ld d=%ld: one rank %.4f s (median %.4f), %d ranks %.4f s (median "
                        "%.4f), speed-up %.2fx (medians %.2fx)\n",
                        static_cast<long>(n), static_cast<long>(d), a.min, a.median, size, b.min, b.median,
                        a.min / b.min, a.median / b.median);
            std::printf("  bytes sent per rank: one summary of %ld doubles per scan round\n",
                        static_cast<long>(3 + 1 + d + d * d));
        }
    }
    // Sequence-parallel gated delta rule (scalar gates) and KDA: equal shards, then rank 0
    // holding twice as many tokens as each other rank (a later rank's pass carries d + dv
    // value columns, about twice the work per token).
    for (const bool kda : {false, true}) {
        const Index n = Index(1) << 16, d = 128;
        Mat K = random_matrix(n, d, 11);
        for (Index t = 0; t < n; ++t)
            K.row(t).normalize();
        const Mat Q = random_matrix(n, d, 12), V = random_matrix(n, d, 13);
        const Mat beta = 0.5f * (random_matrix(n, 1, 14).array() + 1.0f).matrix();
        const Mat G = -0.05f * random_matrix(n, kda ? d : 1, 15).cwiseAbs();
        Mat whole(n, d);
        std::vector<double> one, equal, balanced;
        const auto run = [&](Index first, Index last) {
            const Index m = last - first;
            Mat o(m, d);
            if (kda)
                memattn::distributed_chunked_kda_attention(MPI_COMM_WORLD, Q.middleRows(first, m),
                                                           K.middleRows(first, m), V.middleRows(first, m),
                                                           beta.middleRows(first, m), G.middleRows(first, m), o);
            else
                memattn::distributed_chunked_delta_rule_attention(MPI_COMM_WORLD, Q.middleRows(first, m),
                                                                  K.middleRows(first, m), V.middleRows(first, m),
                                                                  beta.middleRows(first, m), G.middleRows(first, m), o);
        };
        for (int r = 0; r < reps; ++r) {
            one.push_back(timed([&] {
                if (rank == 0) {
                    if (kda)
                        memattn::chunked_kda_attention(Q, K, V, beta, G, whole);
                    else
                        memattn::chunked_delta_rule_attention(Q, K, V, beta, G, whole);
                }
            }));
            equal.push_back(timed([&] { run(rank * n / size, (rank + 1) * n / size); }));
            balanced.push_back(timed([&] {
                run(rank == 0 ? 0 : n * (rank + 1) / (size + 1), n * (rank + 2) / (size + 1));
            }));
        }
        if (rank == 0) {
            const Stats a = stats(one), b = stats(equal), c = stats(balanced);
            std::printf("%s N=%ld d=%ld: one rank %.4f s (median %.4f); %d ranks, equal shards %.4f s (median %.4f), "
                        "speed-up %.2fx (medians %.2fx); rank 0 twice the tokens %.4f s (median %.4f), speed-up "
                        "%.2fx (medians %.2fx)\n",
                        kda ? "KDA" : "gated delta rule", static_cast<long>(n), static_cast<long>(d), a.min,
                        a.median, size, b.min, b.median, a.min / b.min, a.median / b.median, c.min, c.median,
                        a.min / c.min, a.median / c.median);
            std::printf("  bytes sent per rank: one summary of %ld doubles per scan round\n",
                        static_cast<long>(3 + 2 * d * d));
        }
    }
    MPI_Finalize();
    return 0;
}
