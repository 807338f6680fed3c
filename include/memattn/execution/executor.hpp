#pragma once
// Executors: how memattn hands the independent work items of one call (a head, a tile
// of queries, a piece of a long cache) to threads. The one place memattn names OpenMP.
//
//   memattn::OpenMPExecutor two{.threads = 2};
//   memattn::multi_head_causal_softmax_attention(Q, K, V, O, layout, {}, {}, two);
//   memattn::MultiHead<memattn::KVCache<float>> mem(layout, make);
//   mem.set_executor(my_pool);   // any type modelling memattn::Executor
//
// An executor has two members:
//   int concurrency() const;             how many items it can run at once (>= 1)
//   void parallel_for(Index n, F f) const;  f(i) once for every i in [0, n), on any
//                                        thread, in any order; returns when all are done
// memattn cuts a call's items into at most concurrency() contiguous ranges of equal
// estimated cost (execution/parallel.hpp) and asks for one parallel_for over the ranges, so
// a pool is entered once per call. No item's arithmetic depends on the cut, so the
// outputs are bitwise the same for every executor and every thread count. memattn's own
// callables catch their exceptions (they are rethrown on the calling thread after
// parallel_for returns), so an executor never sees one. An executor may still fail on
// its own (a pool that cannot start a thread): its exception reaches the caller of the
// memattn call, which first puts back every memory, layer and pool the call had changed,
// so that it changes nothing (docs/design.md §3); it must not return or throw while
// items it started still run. Items it returns without running run on the calling
// thread. A parallel_for declared noexcept for a callable that does not throw (as
// SerialExecutor's and OpenMPExecutor's are) tells memattn that no undo is needed
// (ExecutorRef::nothrow).
//
// - SerialExecutor: every item on the calling thread, in order.
// - OpenMPExecutor: an OpenMP team of min(n, concurrency()) threads; `threads` 0 means
//   omp_get_max_threads() (so omp_set_num_threads and OMP_NUM_THREADS apply). Called
//   from inside an active parallel region it runs on the calling thread. Compiled
//   without -fopenmp it is serial.
// - DefaultExecutor: OpenMPExecutor with OpenMP, else SerialExecutor; what a call uses
//   when it names none.
// - ExecutorRef: a non-owning, non-allocating reference to any executor, which calls
//   and memories hold; the executor must outlive the calls that use it.
//
// OpenMP's idle threads spin (OMP_WAIT_POLICY=active, libgomp's default for a while
// after each region) before they sleep. On a machine whose cores are busy with other
// work, a spinning team member steals the core from the thread that has the work, and
// a threaded step can be many times slower than a serial one (docs/performance.md has
// the figures). memattn does not change the process-wide policy: it keeps small steps on
// the calling thread (MultiHead::parallel_work), and a server that shares its cores
// should run with OMP_WAIT_POLICY=passive or bring its own pool as an executor.

#include "memattn/types.hpp"

#include <algorithm>
#include <concepts>
#include <exception>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace memattn {

namespace detail {

/// The callable an executor is checked with: f(i) for an item index.
struct ItemProbe {
    void operator()(Index) const noexcept {}
};

}  // namespace detail

/// Runs the items of a call (see the top of the file): concurrency() and parallel_for(n, f).
template <class E>
concept Executor = requires(const E& e, Index n, const detail::ItemProbe& f) {
    { e.concurrency() } -> std::convertible_to<int>;
    e.parallel_for(n, f);
};

/// Every item on the calling thread, in order.
struct SerialExecutor {
    /// Always 1.
    [[nodiscard]] int concurrency() const noexcept { return 1; }
    /// f(0), f(1), ..., f(n − 1) on the calling thread.
    template <class F>
    void parallel_for(Index n, F&& f) const noexcept(noexcept(f(Index{}))) {
        for (Index i = 0; i < n; ++i)
            f(i);
    }
};

/// An OpenMP team per call (see the top of the file).
struct OpenMPExecutor {
    int threads = 0;  ///< team size; 0: omp_get_max_threads()

    /// Threads a call may use now: 1 without OpenMP or inside an active parallel region.
    [[nodiscard]] int concurrency() const noexcept {
#if defined(_OPENMP)
        if (omp_in_parallel())
            return 1;
        return threads > 0 ? threads : std::max(1, omp_get_max_threads());
#else
        return 1;
#endif
    }

    /// f(i) for every i in [0, n) on a team of min(n, concurrency()) threads, item i on
    /// thread i mod team; serial for a team of one.
    template <class F>
    void parallel_for(Index n, F&& f) const noexcept(noexcept(f(Index{}))) {
        const auto team = static_cast<int>(std::min<Index>(n, concurrency()));
        if (team <= 1) {
            for (Index i = 0; i < n; ++i)
                f(i);
            return;
        }
#if defined(_OPENMP)
#pragma omp parallel for num_threads(team) schedule(static, 1)
        for (Index i = 0; i < n; ++i)
            f(i);
#endif
    }
};

#if defined(_OPENMP)
using DefaultExecutor = OpenMPExecutor;  ///< what a call uses when it names no executor
#else
using DefaultExecutor = SerialExecutor;  ///< what a call uses when it names no executor
#endif

/// The executor calls and memories use when given none.
inline const DefaultExecutor default_executor{};

/// A reference to any Executor, copied by value, allocating nothing: the executor must
/// outlive every call made through the reference. Default-constructed, it refers to
/// memattn::default_executor.
class ExecutorRef {
public:
    /// memattn::default_executor.
    ExecutorRef() noexcept : ExecutorRef(default_executor) {}

    /// `executor`, which must outlive the reference's uses.
    template <Executor E>
        requires(!std::same_as<std::remove_cvref_t<E>, ExecutorRef>)
    ExecutorRef(const E& executor) noexcept  // implicit: a view, like std::span
        : object_(&executor), concurrency_(&concurrency_of<E>), run_(&run_on<E>), nothrow_(nothrow_executor<E>) {}

    /// The executor's concurrency(), at least 1.
    [[nodiscard]] int concurrency() const { return std::max(1, concurrency_(object_)); }

    /// Whether the executor's parallel_for is declared not to throw (noexcept for a
    /// callable that does not throw, as memattn's own executors are). A call that changes
    /// memories through an executor that may throw first keeps what it needs to undo
    /// them (docs/design.md §3, "Executors"); through one that cannot, nothing.
    [[nodiscard]] bool nothrow() const noexcept { return nothrow_; }

    /// The executor's parallel_for(n, f); `f` must not throw.
    template <class F>
    void parallel_for(Index n, F&& f) const {
        using Fn = std::remove_reference_t<F>;
        run_(object_, n, const_cast<void*>(static_cast<const void*>(&f)),
             [](void* fn, Index i) { (*static_cast<Fn*>(fn))(i); });
    }

private:
    using Call = void (*)(void*, Index);

    template <class E>
    static int concurrency_of(const void* executor) {
        return static_cast<int>(static_cast<const E*>(executor)->concurrency());
    }
    template <class E>
    static void run_on(const void* executor, Index n, void* fn, Call call) {
        static_cast<const E*>(executor)->parallel_for(n, [fn, call](Index i) { call(fn, i); });
    }

    template <class E>
    static constexpr bool nothrow_executor =
        noexcept(std::declval<const E&>().parallel_for(Index{}, std::declval<const detail::ItemProbe&>()));

    const void* object_;
    int (*concurrency_)(const void*);
    void (*run_)(const void*, Index, void*, Call);
    bool nothrow_;
};

namespace detail {

/// body(first, last) over min(n, concurrency()) contiguous ranges of equal count that
/// cover [0, n), on `executor`; an exception a range throws (std::bad_alloc from its
/// scratch) is rethrown here once every range has returned. A range allocates its
/// scratch once; what an item computes must not depend on the cut. An exception the
/// executor throws itself propagates (the caller undoes what the ranges changed); a
/// range the executor returned without running runs here, on the calling thread.
template <class Body>
void run_ranges(ExecutorRef executor, Index n, Body&& body) {
    if (n <= 0)
        return;
    const Index parts = std::min<Index>(n, executor.concurrency());
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(parts));
    std::vector<char> ran(static_cast<std::size_t>(parts), 0);
    const auto range = [&](Index r) {
        ran[static_cast<std::size_t>(r)] = 1;
        try {
            body(n * r / parts, n * (r + 1) / parts);
        } catch (...) {
            errors[static_cast<std::size_t>(r)] = std::current_exception();
        }
    };
    executor.parallel_for(parts, range);
    for (Index r = 0; r < parts; ++r)
        if (ran[static_cast<std::size_t>(r)] == 0)
            range(r);
    for (const std::exception_ptr& e : errors)
        if (e)
            std::rethrow_exception(e);
}

}  // namespace detail

/// The executor an object keeps for its calls (memattn::MultiHead, memattn::PagedKVCache
/// derive from it): a reference, so the executor must outlive the calls that use it.
class ExecutorSlot {
public:
    /// Runs the object's items on `executor`; the outputs are bitwise the same on any.
    void set_executor(ExecutorRef executor) noexcept { executor_ = executor; }
    /// A temporary executor would be gone before the calls that use it: refused at
    /// compile time.
    template <Executor E>
        requires(!std::same_as<E, ExecutorRef>)
    void set_executor(const E&&) {
        static_assert(sizeof(E) == 0, "memattn: set_executor keeps a reference: pass an executor that outlives "
                                      "the calls, not a temporary");
    }
    /// Where the object runs its items (memattn::default_executor unless set).
    [[nodiscard]] ExecutorRef executor() const noexcept { return executor_; }

protected:
    ExecutorRef executor_;  ///< where the object's calls run their items
};

}  // namespace memattn
