#pragma once
// HeldRope: a softmax memory's rotary position embedding (positional/rope.hpp), when it
// has one: its configuration, frequencies and attention factor computed once, so a
// decode step turns its query and its new key without allocating; where it places the
// tokens (RopePositions); its checks and its snapshot fields.
//
// Keys are stored turned (the turn, then the rounding to S), queries are turned at each
// attend: for key k_t at position t and query q at position p the logit is
// (R_p q)·(R_t k_t) = q·R_{t−p} k_t, a function of t − p (Su et al. 2021, §3.4.2).
// RopePositions::cache gives each kept token its place c in the cache, the query's
// own token (the newest, kept) the last place, c_q. A cache's window is contiguous in the sequence, so its
// distances are the same either way: its keys stay turned to their positions t and the
// query to p. Only the tokens before the window move (a SlidingWindowCache's sinks, a
// HybridCache's slots); the memory turns the query to c_q − (c − t') for them instead,
// t' being where their keys are turned (the sinks: c = t' = their position; a slot g:
// turned to g, its number, at c = g − F, F the first kept slot, so the query turns to
// c_q + F), which is the re-rotation of
// StreamingLLM done once on the query rather than on every kept key at every step:
// exact in exact arithmetic, and nothing stored changes as the window moves.
//
// A memory whose storage is Rotated<S> (storage/compact.hpp) also rotates: after the
// turn (or alone, without RoPE), each head of a key or query row is rotated by the
// orthonormal Walsh–Hadamard transform H, so (H R_p q)·(H R_t k) = (R_p q)·(R_t k). The
// turn and the rotation are one step of the key's way into storage and of the query's
// into an attend, so every path that turns (update, extend, prefill, the attends, the
// split layer) rotates too.

#include "memattn/detail/assert.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/positional/rope.hpp"
#include "memattn/storage/compact.hpp"
#include "memattn/types.hpp"

#include <cmath>
#include <limits>
#include <numbers>
#include <optional>
#include <utility>
#include <variant>
#include <vector>

namespace memattn::detail {

/// A memory's RoPE, or none; see the top of the file.
class HeldRope {
public:
    HeldRope() = default;

    /// `rope` (checked) for a memory of keys and queries `key_dim` wide: one head, so
    /// rope.head_dim must be key_dim.
    /// `rotate`: the memory's storage is `Rotated<S>`, so a turn also rotates each head.
    HeldRope(const char* memory, const Rope& rope, Index key_dim, RopePositions positions, bool rotate = false)
        : rope_(checked(memory, rope, key_dim)),
          w_(rope.scaled_frequencies()),
          a_(rope.attention_factor()),
          positions_(positions),
          head_(rotate ? key_dim : 0) {}

    /// No RoPE, the Hadamard rotation of `Rotated<S>` storage alone, for heads of key_dim.
    [[nodiscard]] static HeldRope rotation(Index key_dim) {
        HeldRope held;
        held.head_ = key_dim;
        return held;
    }

    /// Whether keys are stored turned or rotated (and queries turned at each attend).
    [[nodiscard]] bool on() const noexcept { return rope_.has_value() || rotates(); }
    /// Whether each head is rotated after its turn (`Rotated<S>` storage).
    [[nodiscard]] bool rotates() const noexcept { return head_ > 0; }
    /// Whether tokens are placed in the cache (RopePositions::cache).
    [[nodiscard]] bool in_cache() const noexcept { return on() && positions_ == RopePositions::cache; }
    /// The configuration, or nullptr.
    [[nodiscard]] const Rope* rope() const noexcept { return rope_ ? &*rope_ : nullptr; }
    /// Where it places the tokens.
    [[nodiscard]] RopePositions positions() const noexcept { return positions_; }

    /// Turns a row of `cols` values, a multiple of key_dim (packed heads, each turned), to
    /// position p (any sign), in place, with the attention factor (`scaled`) or without
    /// it (a turn of a turned key).
    /// Then, with `Rotated<S>` storage, rotates each head (a turn of a turned key too: the
    /// rotation belongs to a memory that does not turn twice, KVCache or
    /// SlidingWindowCache).
    template <class T>
    void turn(T* row, Index cols, Index p, bool scaled = true) const noexcept {
        if (rope_)
            rope_->turn_computed(row, cols, w_, scaled ? a_ : 1.0, p);
        if (rotates())
            for (Index c = 0; c < cols; c += head_)
                hadamard_rotate(row + c, head_);
    }
    /// Calls use(key) with `key` turned to position p through `buffer` (a row of
    /// key_dim, sized by the memory), or as given without RoPE: how a memory stores or
    /// pools one key. `scaled`: as turn().
    template <class T, class K, class Use>
    void with_turned(const K& key, Index p, Vector<T>& buffer, Use&& use, bool scaled = true) const {
        if (!on()) {
            use(key);
            return;
        }
        buffer = key;
        turn(buffer.data(), buffer.cols(), p, scaled);
        use(std::as_const(buffer));
    }

    /// Turns the rows of X to positions first, first + 1, ... in place.
    template <class T>
    void turn_rows(MatrixRef<T> X, Index first) const noexcept {
        for (Index i = 0; i < X.rows(); ++i)
            turn(X.row(i).data(), X.cols(), first + i);
    }
    /// The most a turn multiplies a value by: √2 times the attention factor, so a key
    /// whose values stay under a storage type's limit divided by it is stored finite
    /// however it turns (validate's bound for compact storage).
    /// With the rotation, times √m for the widest power of two m of a head
    /// (hadamard_growth).
    [[nodiscard]] double growth() const noexcept {
        return (rope_ ? std::numbers::sqrt2 * a_ : 1.0) * (rotates() ? hadamard_growth(head_) : 1.0);
    }

    /// Throws std::invalid_argument, as check_storable words it, for a finite key value
    /// that S could hold as ±∞ once turned: from storage_overflow<S> / growth() on (a
    /// compact type with a limit: float16, bfloat16; for the block-scaled types, float's
    /// range, past which a block would be stored as NaN). Nothing without RoPE or rotation.
    template <class T, class S, class D>
    void check_turnable(const PairSite& site, const D& keys) const {
        if constexpr (!std::is_same_v<S, T>) {
            if (!on())
                return;
            const double range = scaled_storage<S> ? static_cast<double>(std::numeric_limits<float>::max())
                                                   : static_cast<double>(storage_overflow<S>);
            const double limit = range / growth();
            for (Index r = 0; r < keys.rows(); ++r)
                for (Index c = 0; c < keys.cols(); ++c) {
                    const double x = static_cast<double>(keys(r, c));
                    require(!(std::isfinite(x) && std::abs(x) >= limit), site.function, site.key_name,
                            "has the finite value ", x, " in row ", site.first_row + r, ", column ", SiteColumn{site, c, false},
                            ", which ", rotates() ? (rope_ ? "RoPE and the rotation" : "the rotation") : "RoPE",
                            " may turn into up to ", growth(), " times as much: ", storage_name<S>, " storage would hold it as ",
                            scaled_storage<S> ? "NaN" : overflow_name<S>, " (magnitudes below ", limit, " are kept)");
                }
        }
    }

    /// Snapshots: the configuration, after the memory's scale, only when there is one (a
    /// memory without RoPE writes nothing, so its snapshots are as before): θ, head_dim,
    /// rotary_dim, layout, the scaling's kind and fields (Yarn's then its truncate flag),
    /// where tokens are placed (docs/snapshot-format.md, "RoPE fields"). The stored keys
    /// are turned, so a snapshot loads only into a memory of the same RoPE (one without
    /// reads θ as its length and refuses it).
    void write(snapshot::Writer& w) const {
        if (!rope_)
            return;
        const Rope& r = *rope_;
        w.number(r.theta);
        w.index(r.head_dim);
        w.index(r.rotary_dim);
        w.index(static_cast<Index>(r.layout));
        w.index(static_cast<Index>(r.scaling.index()));
        for (const double field : scaling_fields(r))
            w.number(field);
        if (const auto* y = std::get_if<Rope::Yarn>(&r.scaling))
            w.flag(y->truncate);
        w.index(static_cast<Index>(positions_));
    }
    /// Snapshots: reads what write() wrote, throwing SnapshotError unless it is this
    /// memory's own configuration.
    void read(snapshot::Reader& r) const {
        if (!rope_)
            return;
        const Rope& own = *rope_;
        r.expect("rope theta", own.theta);
        r.expect("rope head_dim", own.head_dim);
        r.expect("rope rotary_dim", own.rotary_dim);
        r.expect("rope layout", static_cast<Index>(own.layout));
        r.expect("rope scaling", static_cast<Index>(own.scaling.index()));
        for (const double field : scaling_fields(own))
            r.expect("a rope scaling field", field);
        if (const auto* y = std::get_if<Rope::Yarn>(&own.scaling))
            r.expect("rope yarn truncate", y->truncate);
        r.expect("rope positions", static_cast<Index>(positions_));
    }

private:
    static Rope checked(const char* memory, const Rope& rope, Index key_dim) {
        rope.check(memory);
        require(rope.head_dim == key_dim, memory, "rope.head_dim", "is ", rope.head_dim, ", expected key_dim = ",
                key_dim, " (a memory holds one head)");
        return rope;
    }

    static std::vector<double> scaling_fields(const Rope& r) {
        if (const auto* l = std::get_if<Rope::Linear>(&r.scaling))
            return {l->factor};
        if (const auto* n = std::get_if<Rope::Ntk>(&r.scaling))
            return {n->factor};
        if (const auto* y = std::get_if<Rope::Yarn>(&r.scaling))
            return {y->factor, static_cast<double>(y->original_max_positions), y->beta_fast, y->beta_slow, y->mscale};
        return {};
    }

    std::optional<Rope> rope_;
    std::vector<double> w_;
    double a_ = 1;
    RopePositions positions_ = RopePositions::sequence;
    Index head_ = 0;  ///< the rotation's head width (key_dim), 0 without one
};

}  // namespace memattn::detail
