#pragma once
// The one place memattn names OpenMP. A multi-head call is a list of independent work
// items (a sequence, a head, a tile of queries ...), each computed the same way whoever
// runs it; this header cuts the list into one contiguous range per thread, balanced by
// each item's estimated cost, and runs the ranges. Since no item's arithmetic depends
// on the cut, the results are bitwise the same for any number of threads, and the same
// as the serial build's.
//
// - Threads: omp_get_max_threads(), so omp_set_num_threads and OMP_NUM_THREADS apply;
//   never more threads than items.
// - Called from inside an active parallel region (the caller's own threads), it runs
//   serially on the calling thread instead of starting a nested team.
// - Without OpenMP (a translation unit compiled without -fopenmp) nothing here names an
//   omp_* function and every range runs serially, in order.
// - An exception thrown by an item (std::bad_alloc from scratch) is caught on its
//   thread and rethrown to the caller after the region, the one from the first range.

#include "memattn/types.hpp"

#include <algorithm>
#include <exception>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace memattn::detail {

/// Threads a parallel call would use now: 1 without OpenMP or inside a parallel region.
inline int available_threads() noexcept {
#if defined(_OPENMP)
    return omp_in_parallel() ? 1 : std::max(1, omp_get_max_threads());
#else
    return 1;
#endif
}

/// Ends of `parts` contiguous ranges of items 0..n−1 of about equal total cost:
/// range t is [ends[t], ends[t + 1]). `prefix[i]` is the cost of items 0..i−1.
inline std::vector<Index> balanced_ranges(const std::vector<double>& prefix, int parts) {
    const auto n = static_cast<Index>(prefix.size()) - 1;
    std::vector<Index> ends(static_cast<std::size_t>(parts) + 1, n);
    ends[0] = 0;
    const double total = prefix.back();
    for (int t = 1; t < parts; ++t) {
        // The first item whose cost midpoint falls past t/parts of the total.
        const double cut = total * t / parts;
        Index i = ends[static_cast<std::size_t>(t) - 1];
        while (i < n && prefix[static_cast<std::size_t>(i)] + 0.5 * (prefix[static_cast<std::size_t>(i) + 1] -
                                                                      prefix[static_cast<std::size_t>(i)]) < cut)
            ++i;
        ends[static_cast<std::size_t>(t)] = i;
    }
    return ends;
}

/// Runs body(first, last) over contiguous ranges of the items 0..n−1, one range per
/// thread, cut so that each range's Σ cost(i) is about equal (see the top of the file).
/// `body` allocates its scratch once per range. `threads` 0 means available_threads().
template <class Cost, class Body>
void parallel_ranges(Index n, Cost&& cost, Body&& body, int threads = 0) {
    if (n <= 0)
        return;
    const int limit = threads > 0 ? std::min(threads, available_threads()) : available_threads();
    const int parts = static_cast<int>(std::min<Index>(limit, n));
    if (parts <= 1) {
        body(Index{0}, n);
        return;
    }
    std::vector<double> prefix(static_cast<std::size_t>(n) + 1, 0.0);
    for (Index i = 0; i < n; ++i)
        prefix[static_cast<std::size_t>(i) + 1] = prefix[static_cast<std::size_t>(i)] + static_cast<double>(cost(i));
    const std::vector<Index> ends = balanced_ranges(prefix, parts);
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(parts));
#if defined(_OPENMP)
#pragma omp parallel for num_threads(parts) schedule(static, 1)
#endif
    for (int t = 0; t < parts; ++t) {
        try {
            const auto first = ends[static_cast<std::size_t>(t)], last = ends[static_cast<std::size_t>(t) + 1];
            if (first < last)
                body(first, last);
        } catch (...) {
            errors[static_cast<std::size_t>(t)] = std::current_exception();
        }
    }
    for (const std::exception_ptr& error : errors)
        if (error)
            std::rethrow_exception(error);
}

}  // namespace memattn::detail
