#pragma once
// Checkpoint: what a call that changes several memories (a layer's heads, a batch of
// sequences) keeps to put them back when it fails part way, its executor having thrown
// (docs/design.md §3, "Executors"). A memory that truncates back to any length it had,
// exactly, is put back by its length (KVCache and SparseKVCache in any storage but
// PerChannelKeys<S>, and layers of them: truncates_exactly); any other by a copy taken
// before the call, and only when the executor may throw (ExecutorRef::nothrow: memattn's
// own executors cannot, so with them nothing is copied).

#include "memattn/memory/kv_cache.hpp"
#include "memattn/memory/sparse_kv_cache.hpp"
#include "memattn/types.hpp"

#include <cstddef>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

namespace memattn::detail {

/// M can be taken back to any length it had, bit for bit, by truncate: its length is all
/// a checkpoint needs.
template <class M>
inline constexpr bool truncates_exactly = false;
template <class T, class S>
inline constexpr bool truncates_exactly<KVCache<T, S>> = !per_channel_keys<S>;
template <class T, class S>
inline constexpr bool truncates_exactly<SparseKVCache<T, S>> = true;

/// The memories of a span as a call that changes them began (see the top of the file).
template <class M>
class Checkpoint {
public:
    /// Whether a memory can be put back at all: by its length, or by a copy.
    static constexpr bool possible = truncates_exactly<M> || std::is_copy_constructible_v<M>;

    /// Notes `memories`: their lengths, or, for memories that do not truncate exactly and
    /// when `may_throw` (else nothing can fail part way), copies of them.
    Checkpoint(std::span<const M> memories, bool may_throw) {
        if constexpr (truncates_exactly<M>) {
            lengths_.reserve(memories.size());
            for (const M& m : memories)
                lengths_.push_back(m.length());
        } else if constexpr (std::is_copy_constructible_v<M>) {
            if (may_throw)
                copies_.assign(memories.begin(), memories.end());
        }
    }

    /// Puts every memory back as it was noted (those the call has not changed stay).
    void restore(std::span<M> memories) noexcept {
        if constexpr (truncates_exactly<M>) {
            for (std::size_t i = 0; i < lengths_.size(); ++i)
                if (memories[i].length() > lengths_[i])
                    memories[i].truncate(lengths_[i]);
        } else if constexpr (std::is_copy_constructible_v<M>) {
            for (std::size_t i = 0; i < copies_.size(); ++i) {
                using std::swap;
                swap(memories[i], copies_[i]);
            }
        }
    }

private:
    std::vector<Index> lengths_;
    std::vector<M> copies_;
};

/// Runs `change` on memories, putting them back as they were if it throws: the undo of
/// Checkpoint, noted first (which may throw std::bad_alloc: nothing has changed yet).
template <class M, class Change>
void all_or_nothing(std::span<M> memories, bool may_throw, Change&& change) {
    Checkpoint<M> before(std::span<const M>(memories.data(), memories.size()), may_throw);
    try {
        change();
    } catch (...) {
        before.restore(memories);
        throw;
    }
}

}  // namespace memattn::detail
