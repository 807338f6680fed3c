#pragma once
// A multi-head call is a list of independent work items (a sequence, a head, a tile of
// queries, a piece of a long cache), each computed the same way whoever runs it; this
// header cuts the list into one contiguous range per thread, balanced by each item's
// estimated cost, and runs the ranges through an executor
// (memattn/execution/executor.hpp). Since no item's arithmetic depends on the cut, the
// results are bitwise the same for any executor and any number of threads, and the same
// as the serial build's.
//
// - Threads: the executor's concurrency() (OpenMP: omp_get_max_threads(), so
//   omp_set_num_threads and OMP_NUM_THREADS apply), at most `threads` when given; never
//   more ranges than items, nor more than max_ranges.
// - Inside an active OpenMP region the default executor runs serially on the calling
//   thread instead of starting a nested team.
// - An exception thrown by an item (std::bad_alloc from scratch) is caught on its
//   thread and rethrown to the caller after the run, the one from the first range.
//   One the executor throws itself propagates as it is (the caller undoes what the
//   ranges changed); a range the executor returned without running runs on the
//   calling thread.
// - Nothing here allocates: a decode step may go through it.

#include "memattn/execution/executor.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <array>
#include <exception>
#include <type_traits>

namespace memattn::detail {

/// Threads the default executor would use now: 1 without OpenMP or inside a parallel region.
inline int available_threads() noexcept { return default_executor.concurrency(); }

/// The most ranges one call is cut into (the scratch for their ends and exceptions
/// lives on the stack).
inline constexpr int max_ranges = 256;

/// Runs body(first, last) over contiguous ranges of the items 0..n−1, one range per
/// thread, cut so that each range's Σ cost(i) is about equal (see the top of the file):
/// range t ends at the first item whose cost midpoint falls past t/parts of the total.
/// `body` allocates its scratch once per range, or, called as body(first, last, range),
/// uses the scratch of range `range` (below the executor's concurrency() and max_ranges)
/// that its caller keeps. `threads` 0 means the executor's concurrency().
template <class Cost, class Body>
void parallel_ranges(Index n, Cost&& cost, Body&& body, int threads = 0, ExecutorRef executor = {}) {
    if (n <= 0)
        return;
    const int limit = threads > 0 ? std::min(threads, executor.concurrency()) : executor.concurrency();
    const int parts = static_cast<int>(std::min<Index>({limit, n, max_ranges}));
    const auto run = [&](Index first, Index last, int r) {
        if constexpr (std::is_invocable_v<Body&, Index, Index, int>)
            body(first, last, r);
        else
            body(first, last);
    };
    if (parts <= 1) {
        run(Index{0}, n, 0);
        return;
    }
    double total = 0;
    for (Index i = 0; i < n; ++i)
        total += static_cast<double>(cost(i));
    std::array<Index, max_ranges + 1> ends;
    ends[0] = 0;
    int t = 1;
    double prefix = 0;
    for (Index i = 0; i < n && t < parts; ++i) {
        const auto c = static_cast<double>(cost(i));
        while (t < parts && prefix + 0.5 * c >= total * t / parts)
            ends[static_cast<std::size_t>(t++)] = i;
        prefix += c;
    }
    for (; t <= parts; ++t)
        ends[static_cast<std::size_t>(t)] = n;
    std::array<std::exception_ptr, max_ranges> errors;
    std::array<bool, max_ranges> ran{};
    const auto range = [&](Index r) {
        ran[static_cast<std::size_t>(r)] = true;
        try {
            const Index first = ends[static_cast<std::size_t>(r)], last = ends[static_cast<std::size_t>(r) + 1];
            if (first < last)
                run(first, last, static_cast<int>(r));
        } catch (...) {
            errors[static_cast<std::size_t>(r)] = std::current_exception();
        }
    };
    executor.parallel_for(parts, range);  // its own exception propagates: the caller undoes what changed
    for (int r = 0; r < parts; ++r)       // ranges the executor returned without running
        if (!ran[static_cast<std::size_t>(r)])
            range(r);
    for (int r = 0; r < parts; ++r)
        if (errors[static_cast<std::size_t>(r)])
            std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
}

}  // namespace memattn::detail
