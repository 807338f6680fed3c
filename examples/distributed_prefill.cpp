// Prefills one long sequence across the ranks of MPI_COMM_WORLD, exactly (ring attention,
// zigzag layout) and with linear attention (sequence-parallel chunked form), then checks
// every rank's rows against one process computing the whole sequence and prints the
// times. Run it with, for example,
//
//   mpirun -np 4 --oversubscribe build/release/examples/distributed_prefill [--tokens N] [--dim D]
//
// (as root Open MPI also wants --allow-run-as-root).
#include <memattn/distributed/mpi.hpp>
#include <memattn/kernels/causal_softmax.hpp>
#include <memattn/kernels/linear_attention.hpp>


#include <chrono>
#include <cstdio>
#include <cstdlib>
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

double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// The largest |a − b| over rows, on rank 0 (the others send theirs).
double worst_over_ranks(double mine) {
    double worst = 0;
    MPI_Reduce(&mine, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    return worst;
}

}  // namespace

int main(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    int rank = 0, size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    Index tokens = 16384, d = 64;
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string flag = argv[i];
        if (flag == "--tokens")
            tokens = std::atol(argv[i + 1]);
        else if (flag == "--dim")
            d = std::atol(argv[i + 1]);
    }
    // Every rank builds the same sequence and keeps its shard: in a real run each rank
    // would hold only its own tokens.
    const Mat Q = random_matrix(tokens, d, 1), K = random_matrix(tokens, d, 2), V = random_matrix(tokens, d, 3);

    // Zigzag shards: 2P chunks of about equal length; rank r holds chunks r and 2P−1−r.
    std::vector<Index> mine;
    for (Index c = 0; c < 2 * size; ++c)
        if (c == rank || c == 2 * size - 1 - rank)
            for (Index t = c * tokens / (2 * size); t < (c + 1) * tokens / (2 * size); ++t)
                mine.push_back(t);
    const auto n = static_cast<Index>(mine.size());
    Mat q(n, d), k(n, d), v(n, d), o(n, d);
    for (Index i = 0; i < n; ++i) {
        q.row(i) = Q.row(mine[static_cast<std::size_t>(i)]);
        k.row(i) = K.row(mine[static_cast<std::size_t>(i)]);
        v.row(i) = V.row(mine[static_cast<std::size_t>(i)]);
    }
    if (rank == 0)
        std::printf("%ld tokens, d = %ld, %d ranks (each rank checks its rows against one process)\n",
                    static_cast<long>(tokens), static_cast<long>(d), size);

    MPI_Barrier(MPI_COMM_WORLD);
    auto start = std::chrono::steady_clock::now();
    memattn::distributed_causal_softmax_attention(MPI_COMM_WORLD, q, k, v, o, memattn::SoftmaxOptions{},
                                                  memattn::RingLayout::zigzag);
    MPI_Barrier(MPI_COMM_WORLD);
    const double ring_seconds = seconds_since(start);
    Mat whole(tokens, d);
    start = std::chrono::steady_clock::now();
    memattn::causal_softmax_attention(Q, K, V, whole);
    const double one_seconds = seconds_since(start);
    double error = 0;
    for (Index i = 0; i < n; ++i)
        error = std::max(error, static_cast<double>((o.row(i) - whole.row(mine[static_cast<std::size_t>(i)]))
                                                        .cwiseAbs()
                                                        .maxCoeff()));
    const double ring_error = worst_over_ranks(error);
    if (rank == 0)
        std::printf("ring attention (zigzag): %.3f s on %d ranks, %.3f s in one process, largest difference %.2g\n",
                    ring_seconds, size, one_seconds, ring_error);

    // Linear attention: contiguous shards of about equal length.
    const Index first = rank * tokens / size, last = (rank + 1) * tokens / size;
    Mat ol(last - first, d);
    MPI_Barrier(MPI_COMM_WORLD);
    start = std::chrono::steady_clock::now();
    memattn::distributed_chunked_linear_attention(MPI_COMM_WORLD, Q.middleRows(first, last - first),
                                                  K.middleRows(first, last - first), V.middleRows(first, last - first),
                                                  ol);
    MPI_Barrier(MPI_COMM_WORLD);
    const double lasp_seconds = seconds_since(start);
    start = std::chrono::steady_clock::now();
    memattn::chunked_linear_attention(Q, K, V, whole);
    const double linear_seconds = seconds_since(start);
    const double linear_error =
        worst_over_ranks(static_cast<double>((ol - whole.middleRows(first, last - first)).cwiseAbs().maxCoeff()));
    if (rank == 0)
        std::printf("linear attention: %.3f s on %d ranks, %.3f s in one process, largest difference %.2g\n",
                    lasp_seconds, size, linear_seconds, linear_error);
    const bool ok = ring_error < 1e-4 && linear_error < 1e-4;
    MPI_Finalize();
    return ok ? 0 : 1;
}
