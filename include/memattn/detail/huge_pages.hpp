#pragma once
// Transparent huge pages for the large stores read end to end by every decode step (a
// pool's blocks, a cache's rows): with 4 KiB pages such a step misses the TLB once per
// 4 KiB of each row stream it reads (in a virtual machine each miss walks two page
// tables). Linux backs a range by 2 MiB pages where the system's setting is "always", or
// "madvise" and the range was advised (MADV_HUGEPAGE); under "madvise" (a common
// default) only what asks gets them, so the stores ask. Measured on an AMD EPYC Zen 4
// VM, the batched decode step of 32 paged bfloat16 sequences ran 1.2–1.3x faster
// (docs/performance.md, "Where a decode step's time goes from DRAM, and huge pages"). A
// hint: where it is refused, or not Linux, nothing changes. MEMATTN_HUGE_PAGES=0 in the
// environment turns it off.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace memattn::detail {

/// The size of a transparent huge page on x86-64 and most of Linux's other targets.
inline constexpr std::size_t huge_page_bytes = std::size_t(1) << 21;

/// The whole huge pages inside [p, p + bytes): [first, end), empty where there is none.
struct HugePageRange {
    std::uintptr_t first = 0, end = 0;
};
[[nodiscard]] inline HugePageRange huge_page_range(const void* p, std::size_t bytes) noexcept {
    const auto begin = reinterpret_cast<std::uintptr_t>(p);
    if (p == nullptr || bytes < huge_page_bytes || begin > UINTPTR_MAX - bytes)
        return {};
    const std::uintptr_t first = (begin + huge_page_bytes - 1) / huge_page_bytes * huge_page_bytes;
    const std::uintptr_t end = (begin + bytes) / huge_page_bytes * huge_page_bytes;
    return first < end ? HugePageRange{first, end} : HugePageRange{};
}

/// Whether the stores ask for huge pages: not turned off by MEMATTN_HUGE_PAGES=0 (read once).
[[nodiscard]] inline bool huge_pages_allowed() noexcept {
    static const bool allowed = [] {
        const char* flag = std::getenv("MEMATTN_HUGE_PAGES");
        return flag == nullptr || std::strcmp(flag, "0") != 0;
    }();
    return allowed;
}

/// Asks Linux to back the whole huge pages inside [p, p + bytes) by transparent huge
/// pages (MADV_HUGEPAGE; the pages not yet touched get them as they are first written).
/// Returns whether a range was advised: false where none is whole, off, refused (a kernel
/// without transparent huge pages) or not Linux. Nothing else changes either way.
inline bool advise_huge_pages(const void* p, std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const HugePageRange range = huge_page_range(p, bytes);
    if (range.first == range.end || !huge_pages_allowed())
        return false;
    return madvise(reinterpret_cast<void*>(range.first), range.end - range.first, MADV_HUGEPAGE) == 0;
#else
    (void)p, (void)bytes;
    return false;
#endif
}

/// advise_huge_pages over the coefficients of a dense Eigen object (its data(), size()).
template <class M>
bool advise_huge_pages_of(const M& m) noexcept {
    return advise_huge_pages(m.data(), static_cast<std::size_t>(m.size()) * sizeof(typename M::Scalar));
}

}  // namespace memattn::detail
