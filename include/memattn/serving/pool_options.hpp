#pragma once
// What a pool of blocks (PagedKVCache, PagedLatentKVCache) throws when its blocks run
// out, and what it keeps and refuses beyond its attention options.

#include "memattn/types.hpp"

#include <stdexcept>
#include <string>

namespace memattn {

/// A pool had fewer free blocks than a call needed; the pool is unchanged.
class PoolExhausted : public std::runtime_error {
public:
    /// What `function` needed, and what the pool of `blocks` had free.
    PoolExhausted(const std::string& function, Index needed, Index free, Index blocks)
        : std::runtime_error("memattn::" + function + ": needs " + std::to_string(needed) + " free block" +
                             (needed == 1 ? "" : "s") + ", but " + std::to_string(free) + " of the pool's " +
                             std::to_string(blocks) + " are free"),
          needed_(needed),
          free_(free) {}
    /// Blocks the call needed.
    [[nodiscard]] Index needed() const noexcept { return needed_; }
    /// Blocks that were free.
    [[nodiscard]] Index free() const noexcept { return free_; }

private:
    Index needed_, free_;
};

/// What a pool keeps and refuses beyond its attention options (PagedKVCache's last
/// constructor argument).
struct PoolOptions {
    /// A windowed pool keeps the n tokens before every sequence's window too (their blocks
    /// are freed n tokens later), so a truncate of up to n tokens always succeeds
    /// (speculative decoding's rejected drafts): any truncate to at least the longest
    /// length the sequence has had less n (rollbacks add up until it grows past that
    /// length again; a fork, or a sequence loaded from another's snapshot, inherits the
    /// other's room). 0: the window's alone. A sequence then holds at most
    /// ceil(sinks / block) + ceil((window + n) / block) + 1 blocks.
    Index rollback_tokens = 0;
    /// Refuse keys and values that are not finite (±∞, NaN) with std::invalid_argument
    /// naming the call, the argument and the place, the pool unchanged; off: they are
    /// stored as they are and poison the attends that see them.
    bool reject_nonfinite = false;
};

}  // namespace memattn
