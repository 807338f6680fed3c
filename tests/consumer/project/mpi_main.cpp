// A user's MPI program, linked to memattn::mpi (find_package(memattn COMPONENTS mpi)):
// ring attention over the ranks of MPI_COMM_WORLD, each rank holding a contiguous shard
// of one sequence, checked against the single-process kernel on the whole sequence.
// Prints "memattn::mpi consumer: ok (<ranks> ranks)" on rank 0.
#include <memattn/distributed/mpi.hpp>
#include <memattn/memattn.hpp>

#include <mpi.h>

#include <cmath>
#include <cstdio>

int main(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    int rank = 0, ranks = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);

    const memattn::Index per_rank = 6, n = per_rank * ranks, d = 4;
    memattn::Matrix<double> Q(n, d), K(n, d), V(n, d), O(n, d);
    for (memattn::Index i = 0; i < n; ++i)
        for (memattn::Index j = 0; j < d; ++j) {
            Q(i, j) = std::sin(double(i + 2 * j));
            K(i, j) = std::cos(double(3 * i + j));
            V(i, j) = double(i - j);
        }
    memattn::causal_softmax_attention(Q, K, V, O);

    const memattn::Index first = rank * per_rank;
    memattn::Matrix<double> shard(per_rank, d);
    memattn::distributed_causal_softmax_attention(MPI_COMM_WORLD, Q.middleRows(first, per_rank),
                                                  K.middleRows(first, per_rank), V.middleRows(first, per_rank),
                                                  shard);
    const double error = (shard - O.middleRows(first, per_rank)).cwiseAbs().maxCoeff();
    int ok = error <= 1e-12 ? 1 : 0, all_ok = 0;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!ok)
        std::printf("rank %d: the distributed output differs from the kernel by %g\n", rank, error);
    if (rank == 0 && all_ok)
        std::printf("memattn::mpi consumer: ok (%d ranks)\n", ranks);
    MPI_Finalize();
    return all_ok ? 0 : 1;
}
