#pragma once
// What every distributed algorithm of memattn shares (distributed/mpi.hpp describes
// them): <mpi.h> through its C interface, the collective check every call makes first,
// the gathers, the exclusive scan of per-rank summaries and the broadcast of the final
// state.

#include "memattn/kernels/linear_attention.hpp"
#include "memattn/types.hpp"

// memattn uses MPI's C interface only: Open MPI's and MPICH's deprecated C++ bindings
// stay out (they also warn under -Wextra).
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace memattn {

namespace detail::mpi {

/// The MPI type of a memattn scalar.
template <class T>
MPI_Datatype datatype() {
    return std::is_same_v<T, float> ? MPI_FLOAT : MPI_DOUBLE;
}

/// The rank and the number of ranks of `comm`.
inline std::pair<int, int> rank_size(MPI_Comm comm) {
    int rank = 0, size = 1;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    return {rank, size};
}

/// One named value every rank must agree on (a dimension, an option).
struct Agreed {
    const char* name;
    double value;
};

/// The collective check every distributed call makes first. Each rank passes the error
/// its own checks found (empty if none) and the values all ranks must share. If any
/// rank has an error, every rank throws std::invalid_argument with the lowest such
/// rank's message; else if a value differs from rank 0's, every rank throws naming the
/// value and both ranks. One MPI_Allgather of a fixed-size record, so no rank waits.
inline void check_collectively(MPI_Comm comm, const char* function, const std::string& error,
                               const std::vector<Agreed>& agreed) {
    constexpr std::size_t text = 480;
    const auto [rank, size] = rank_size(comm);
    const std::size_t values = agreed.size();
    const std::size_t record = text + sizeof(double) * values;
    std::vector<char> mine(record, 0), all(record * static_cast<std::size_t>(size));
    std::memcpy(mine.data(), error.data(), std::min(error.size(), text - 1));
    for (std::size_t i = 0; i < values; ++i)
        std::memcpy(mine.data() + text + sizeof(double) * i, &agreed[i].value, sizeof(double));
    MPI_Allgather(mine.data(), static_cast<int>(record), MPI_BYTE, all.data(), static_cast<int>(record), MPI_BYTE,
                  comm);
    for (int r = 0; r < size; ++r) {
        const char* message = all.data() + record * static_cast<std::size_t>(r);
        if (message[0] != '\0')
            throw std::invalid_argument(std::string(message) + " (on rank " + std::to_string(r) + " of " +
                                        std::to_string(size) + "; every rank of the call throws this)");
    }
    for (int r = 1; r < size; ++r)
        for (std::size_t i = 0; i < values; ++i) {
            double first = 0, other = 0;
            std::memcpy(&first, all.data() + text + sizeof(double) * i, sizeof(double));
            std::memcpy(&other, all.data() + record * static_cast<std::size_t>(r) + text + sizeof(double) * i,
                        sizeof(double));
            if (std::memcmp(&first, &other, sizeof(double)) != 0) {
                std::ostringstream os;
                os << "memattn::" << function << ": the ranks disagree: " << agreed[i].name << " is ";
                put(os, first);
                os << " on rank 0 and ";
                put(os, other);
                os << " on rank " << r << " (every rank of the call throws this)";
                throw std::invalid_argument(os.str());
            }
        }
    (void)rank;
}

/// Runs the local checks, turning the std::invalid_argument they throw into the error
/// for check_collectively.
template <class Checks>
std::string local_error(Checks&& checks) {
    try {
        checks();
    } catch (const std::invalid_argument& e) {
        return e.what();
    }
    return {};
}

/// A shard's K/V block travels as one message, whose count MPI takes as an int.
inline void check_message_size(const char* function, Index rows, Index width) {
    require(rows <= Index(std::numeric_limits<int>::max()) / std::max<Index>(width, 1), function, "K", "has ", rows,
            " rows of ", width, " K and V values: the shard's block exceeds the ", std::numeric_limits<int>::max(),
            " values of one MPI message; spread the sequence over more ranks");
}

/// Every rank's value of `mine`, in rank order.
inline std::vector<std::int64_t> all_gather(MPI_Comm comm, std::int64_t mine) {
    const int size = rank_size(comm).second;
    std::vector<std::int64_t> all(static_cast<std::size_t>(size));
    MPI_Allgather(&mine, 1, MPI_INT64_T, all.data(), 1, MPI_INT64_T, comm);
    return all;
}


/// The exclusive scan of one summary per rank, in rank order: `carried` receives the
/// composition (by `op`, MPI's user operation: invec the earlier ranks) of every earlier
/// rank's; rank 0's is left as it was. ⌈log₂ P⌉ rounds of one summary each.
inline void exscan(MPI_Comm comm, const std::vector<double>& summary, std::vector<double>& carried,
                   MPI_User_function* op) {
    MPI_Datatype type;
    MPI_Type_contiguous(static_cast<int>(summary.size()), MPI_DOUBLE, &type);
    MPI_Type_commit(&type);
    MPI_Op compose;
    MPI_Op_create(op, /*commute=*/0, &compose);
    MPI_Exscan(summary.data(), carried.data(), 1, type, compose, comm);
    MPI_Op_free(&compose);
    MPI_Type_free(&type);
}

/// The state after the whole sequence, `last`'s on the last rank (rows × cols of mu,
/// `nu` entries of nu), to every rank that passes a `state`; all ranks take part. With
/// nu = 0 the state's nu is left as it is.
template <class T>
void share_final_state(MPI_Comm comm, const LinearState<T>& last, Index rows, Index cols, Index nu,
                       LinearState<T>* state) {
    const auto [rank, size] = rank_size(comm);
    Vector<T> buffer(rows * cols + nu);
    if (rank == size - 1) {
        Eigen::Map<Matrix<T>>(buffer.data(), rows, cols) = last.mu;
        buffer.tail(nu) = last.nu;
    }
    MPI_Bcast(buffer.data(), static_cast<int>(buffer.size()), datatype<T>(), size - 1, comm);
    if (state != nullptr) {
        state->mu = Eigen::Map<const Matrix<T>>(buffer.data(), rows, cols);
        if (nu > 0)
            state->nu = buffer.tail(nu);
    }
}

}  // namespace detail::mpi

}  // namespace memattn
