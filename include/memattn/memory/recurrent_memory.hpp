#pragma once
// RecurrentMemory: what the recurrent-state memories share (memory/gated_memories.hpp:
// GatedLinearAttentionMemory, DeltaRuleMemory, KdaMemory, Rwkv7Memory): the shapes of a
// key row [k (d) | extra columns] and a value row (dv), update and extend (a key or value
// that views the state copied first), validate, attend and attend_group (q S, one
// register-blocked product for a group), prefill on a copy of the state (a throw changes
// nothing), set_state's checks, length, reset and the snapshot payload:
//
//   d, dv, the memory's own fields, length, S (and z)
//
// A memory derives from RecurrentMemory<Memory, T, normaliser> and gives only what is its
// own, as members the base calls (private, with the base a friend):
//
//   void check_extras(const PairSite&, keys) const    its extra columns are valid, or throw
//   void step(key, value)                              the transition of one token (S, z)
//   void step_attend(key, value, Q, out)               optional: step, and out = Q S from the
//                                                      same pass (update_attend_group)
//   void finish(query, out) const                      out = q S → its output
//   void finish_group(queries, out) const              the same for a group's rows
//   void run_prefill(Q, keys, V, O, LinearState&)      the chunked kernel on a state
//   void write_fields(snapshot::Writer&) const         its fields between dv and length
//   void read_fields(snapshot::Reader&)                the same read: expect its own
//
// `normaliser`: whether the state has z (1 × d) besides S (d × dv).

#include "memattn/detail/tile_product.hpp"
#include "memattn/kernels/linear_attention.hpp"
#include "memattn/memory/detail/memory_checks.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/types.hpp"

#include <cmath>
#include <cstddef>

namespace memattn::detail {

/// The names a recurrent memory's messages give, one per member that checks its arguments.
struct RecurrentNames {
    const char* type;          ///< the class
    const char* update;        ///< its update
    const char* extend;        ///< its extend
    const char* validate;      ///< its validate
    const char* attend;        ///< its attend
    const char* attend_group;  ///< its attend_group
    const char* prefill;       ///< its prefill
    const char* set_state;     ///< its set_state
};

/// A state given to set_state: m is rows × cols and finite, or the call throws.
template <class M>
void check_state(const char* function, const char* name, const M& m, Index rows, Index cols) {
    require(m.rows() == rows && m.cols() == cols, function, name, "has shape ", shape(m), ", expected ", rows, 'x',
            cols);
    for (Index r = 0; r < m.rows(); ++r)
        for (Index c = 0; c < m.cols(); ++c)
            require(std::isfinite(m(r, c)), function, name, "has ", m(r, c), " at (", r, ", ", c,
                    "), expected finite values");
}

}  // namespace memattn::detail

namespace memattn {

/// The base of the recurrent-state memories: what they share, each memory giving only its
/// transition (memory/recurrent_memory.hpp, at the top). In namespace memattn, not
/// detail: argument-dependent lookup looks in a base class's namespace, which for a
/// user's unqualified call on a memory must not be detail's.
/// \tparam Memory the memory deriving from it
/// \tparam T its scalar (float or double)
/// \tparam normaliser whether its state has z (1 × d) besides S (d × dv)
template <class Memory, class T, bool normaliser>
class RecurrentMemory {
public:
    using Scalar = T;  ///< float or double: the rows' scalar and the state's

    /// Feeds one (key, value) pair: the memory's transition on S (and z). A key or value
    /// that views the state is copied first (allocates nothing).
    void update(ConstRowRef<T> key, ConstRowRef<T> value) {
        validate(key, value, {names_->update, "key", "value"});
        feed_apart(key, value);
    }

    /// Feeds the rows of K/V in order, all or nothing; rows that view the state are copied
    /// first (the copy allocates).
    void extend(ConstMatrixRef<T> keys, ConstMatrixRef<T> values) {
        validate(keys, values, {names_->extend});
        if (views_state(keys) || views_state(values)) {
            const Matrix<T> own_keys = keys, own_values = values;
            return extend(own_keys, own_values);
        }
        for (Index i = 0; i < keys.rows(); ++i)
            feed(keys.row(i), values.row(i));
    }

    /// Throws what update would throw for these pairs (shapes; a log-gate that is NaN or
    /// above 0; a β out of its range), changing nothing; std::length_error past
    /// memattn::max_length. `site` names the caller (a layer's check of one head's part of
    /// its packed rows).
    void validate(ConstMatrixRef<T> keys, ConstMatrixRef<T> values, const detail::PairSite& site) const {
        detail::check_site_pairs(site, detail::shape(keys), detail::shape(values), key_dim_, dv_, length_);
        memory().check_extras(site, keys);
    }
    /// The same, naming this memory's validate.
    void validate(ConstMatrixRef<T> keys, ConstMatrixRef<T> values) const { validate(keys, values, {names_->validate}); }

    /// out = q̂ S (q̂: the query as the memory's kernels scale it), zero before any update:
    /// attend_group's numbers for a group of one (the register-blocked product).
    void attend(ConstRowRef<T> query, RowRef<T> out) const {
        detail::check_query(names_->attend, query, out, d_, dv_);
        detail::tile_product<T>(1, dv_, d_, query.data(), 0, 1, state_.mu.data(), dv_, out.data(), 0, nullptr);
        memory().finish(query, out);
    }

    /// Row r of `out` = attend(row r of `queries`), to rounding: S read once for the
    /// group, one register-blocked product Q_g S. Allocates nothing.
    void attend_group(ConstMatrixRef<T> queries, MatrixRef<T> out) const {
        detail::check_group_query(names_->attend_group, queries, out, d_, dv_);
        if (queries.rows() == 0)
            return;
        detail::tile_product<T>(queries.rows(), dv_, d_, queries.data(), queries.outerStride(), 1, state_.mu.data(), dv_,
                        out.data(), out.outerStride(), nullptr);
        memory().finish_group(queries, out);
    }

    /// update(key, value), then attend_group(queries, out): a decode step of a GQA
    /// group's queries, the same numbers. A memory whose step can give q S from the pass
    /// that updates S (the delta rule and KDA: detail::delta_token) does both in one pass
    /// over its state. `out` overlaps neither the queries nor the key or value.
    void update_attend_group(ConstRowRef<T> key, ConstRowRef<T> value, ConstMatrixRef<T> queries,
                             MatrixRef<T> out) {
        validate(key, value, {names_->update, "key", "value"});
        detail::check_group_query(names_->attend_group, queries, out, d_, dv_);
        detail::require_disjoint(names_->update, "out", out, "key", key);
        detail::require_disjoint(names_->update, "out", out, "value", value);
        update_attend_group(key, value, queries, out, detail::checked);
    }
    /// The same after its checks (a caller that ran them, as MultiHead for its heads).
    void update_attend_group(ConstRowRef<T> key, ConstRowRef<T> value, ConstMatrixRef<T> queries,
                             MatrixRef<T> out, detail::Checked) {
        if constexpr (fuses_step()) {
            if (!views_state(key) && !views_state(value) && !views_state(queries)) {
                memory_mutable().step_attend(key, value, queries, out);
                ++length_;
                if (queries.rows() > 0)
                    memory().finish_group(queries, out);
                return;
            }
        }
        feed_apart(key, value);  // (checked above)
        attend_group(queries, out);
    }
    /// Whether assign_update_attend_group folds the copy into the step (the delta rule and
    /// KDA: their own step_attend_from and assign_fields) rather than a copy, then the step.
    [[nodiscard]] static constexpr bool folds_copy() noexcept {
        return !normaliser &&
               requires(Memory& m, const Memory& other, const T* p, ConstRowRef<T> row, ConstMatrixRef<T> q,
                        MatrixRef<T> o) {
                   m.step_attend_from(p, row, row, q, o);
                   m.assign_fields(other);
               };
    }
    /// Whether update_attend_group runs the memory's step and q S in one pass (the delta
    /// rule and KDA: their own step_attend) rather than an update, then an attend.
    [[nodiscard]] static constexpr bool fuses_step() noexcept {
        return requires(Memory& m, ConstRowRef<T> row, ConstMatrixRef<T> q, MatrixRef<T> o) {
            m.step_attend(row, row, q, o);
        };
    }

    /// The same for one query: update(key, value), then attend(query, out).
    void update_attend(ConstRowRef<T> key, ConstRowRef<T> value, ConstRowRef<T> query, RowRef<T> out) {
        detail::check_query(names_->attend, query, out, d_, dv_);
        update_attend_group(key, value, group_of(query), group_of(out));
    }
    /// The same after its checks (a pool or a batch that ran them: detail::check_sequences).
    void update_attend(ConstRowRef<T> key, ConstRowRef<T> value, ConstRowRef<T> query, RowRef<T> out,
                       detail::Checked) {
        update_attend_group(key, value, group_of(query), group_of(out), detail::checked);
    }

    /// `source` updated by (key, value) into this memory, then attend_group(queries, out):
    /// the same as `*this = source` then update_attend_group(key, value, queries, out)
    /// (its checks are source's: its length, its values' range). `source` has this
    /// memory's shapes (refused otherwise). Where the memory folds the copy into its step
    /// (folds_copy: the delta rule and KDA) and no argument views either state, S is read
    /// from `source` and its update written here in the same pass, stored past the cache
    /// where the build targets AVX-512 (non-temporal stores of whole aligned lines: a
    /// state read later, not at once, as speculative decoding's draft states); else a
    /// copy, then the step. `out` overlaps neither the queries nor the key or value.
    void assign_update_attend_group(const Memory& source, ConstRowRef<T> key, ConstRowRef<T> value,
                                    ConstMatrixRef<T> queries, MatrixRef<T> out) {
        const detail::StreamFence fence;  // (also when it throws)
        assign_update_attend_group(source, key, value, queries, out, detail::unfenced);
    }
    /// The same without the fence after the streamed stores (a caller that streams many
    /// states, as MultiHead's heads, fences once after them: detail::stream_fence).
    void assign_update_attend_group(const Memory& source, ConstRowRef<T> key, ConstRowRef<T> value,
                                    ConstMatrixRef<T> queries, MatrixRef<T> out, detail::Unfenced) {
        const RecurrentMemory& from = source;
        if (&from == this) {
            update_attend_group(key, value, queries, out);
            return;
        }
        detail::require(from.d_ == d_ && from.dv_ == dv_ && from.key_dim_ == key_dim_, names_->update, "source",
                        "has queries of ", from.d_, ", values of ", from.dv_, " and key rows of ", from.key_dim_,
                        ", expected ", d_, ", ", dv_, " and ", key_dim_);
        from.validate(key, value, {names_->update, "key", "value"});  // source's checks (its length, its β range)
        detail::check_group_query(names_->attend_group, queries, out, d_, dv_);
        detail::require_disjoint(names_->update, "out", out, "key", key);
        detail::require_disjoint(names_->update, "out", out, "value", value);
        if constexpr (folds_copy()) {
            if (!views_state(key) && !views_state(value) && !views_state(queries) && !from.views_state(key) &&
                !from.views_state(value) && !from.views_state(queries) && !from.views_state(out)) {
                memory_mutable().assign_fields(source);  // everything of *this = source but S and the scratch
                names_ = from.names_;
                memory_mutable().step_attend_from(from.state_.mu.data(), key, value, queries, out);
                length_ = from.length_ + 1;
                if (queries.rows() > 0)
                    memory().finish_group(queries, out);
                return;
            }
        }
        memory_mutable() = source;  // same shapes: no allocation
        update_attend_group(key, value, queries, out);
    }
    /// The same for one query: `*this = source`, then update_attend(key, value, query, out).
    void assign_update_attend(const Memory& source, ConstRowRef<T> key, ConstRowRef<T> value, ConstRowRef<T> query,
                              RowRef<T> out) {
        const detail::StreamFence fence;  // (also when it throws)
        assign_update_attend(source, key, value, query, out, detail::unfenced);
    }
    /// The same, the streamed stores left unfenced (the caller fences: detail::stream_fence).
    void assign_update_attend(const Memory& source, ConstRowRef<T> key, ConstRowRef<T> value, ConstRowRef<T> query,
                              RowRef<T> out, detail::Unfenced) {
        detail::check_query(names_->attend, query, out, d_, dv_);
        assign_update_attend_group(source, key, value, group_of(query), group_of(out), detail::unfenced);
    }

    /// The memory's chunked kernel over the keys' columns, from and into its state.
    void prefill(ConstMatrixRef<T> queries, ConstMatrixRef<T> keys, ConstMatrixRef<T> values, MatrixRef<T> out) {
        validate(keys, values, {names_->prefill});  // shapes, gates (and beta)
        detail::check_prefill(names_->prefill, queries, keys, values, out, d_, dv_);
        if (keys.rows() == 0)
            return;
        LinearState<T> state = state_;  // a throw (no memory) leaves the memory as it was
        memory().run_prefill(queries, keys, values, out, state);
        state_.mu.swap(state.mu);
        if constexpr (normaliser)
            state_.nu.swap(state.nu);
        length_ += keys.rows();
    }

    /// Tokens seen since reset.
    [[nodiscard]] Index length() const noexcept { return length_; }
    /// Bytes of state held now: S (and z), whatever the length.
    [[nodiscard]] std::size_t footprint() const noexcept {
        return sizeof(T) * static_cast<std::size_t>(state_.mu.size() + state_.nu.size());
    }
    /// Forgets every token: S = 0 (and z = 0).
    void reset() {
        state_.mu.setZero(d_, dv_);
        if constexpr (normaliser)
            state_.nu.setZero(d_);
        length_ = 0;
    }

    /// The key row's width: d and the memory's extra columns.
    [[nodiscard]] Index key_dim() const noexcept { return key_dim_; }
    /// The value width dv.
    [[nodiscard]] Index value_dim() const noexcept { return dv_; }
    /// The query width d: the key row without its extra columns.
    [[nodiscard]] Index query_dim() const noexcept { return d_; }
    /// The output width dv.
    [[nodiscard]] Index output_dim() const noexcept { return dv_; }

    /// Snapshots (memattn/persistence/snapshot.hpp): writes the payload, the fields listed
    /// at the memory's snapshot_kind().
    void write_snapshot(snapshot::Writer& w) const {
        w.index(d_);
        w.index(dv_);
        memory().write_fields(w);
        w.index(length_);
        w.matrix(state_.mu);
        if constexpr (normaliser)
            w.matrix(state_.nu);
    }
    /// Snapshots: reads a payload written by write_snapshot(); throws SnapshotError, the
    /// memory unchanged, unless d, dv and the memory's fields are its own.
    void read_snapshot(snapshot::Reader& r) {
        r.expect("key_dim", d_);
        r.expect("value_dim", dv_);
        memory_mutable().read_fields(r);
        const Index length = r.count("length", 0, max_length);
        r.expect_remaining(sizeof(T) * static_cast<std::size_t>(state_.mu.size() + state_.nu.size()),
                           normaliser ? "S and z" : "S");
        r.matrix(state_.mu, "S");
        if constexpr (normaliser)
            r.matrix(state_.nu, "z");
        length_ = length;
    }

protected:
    /// k of width `key_dim` (d), then `extra` columns in the key row; values of width `value_dim`.
    RecurrentMemory(const detail::RecurrentNames& names, Index key_dim, Index value_dim, Index extra)
        : d_(detail::at_least(key_dim, 1, names.type, "key_dim")),
          dv_(detail::at_least(value_dim, 1, names.type, "value_dim")),
          key_dim_(d_ + extra),
          names_(&names),
          key_copy_(key_dim_),
          value_copy_(dv_) {
        state_.mu.setZero(d_, dv_);
        if constexpr (normaliser)
            state_.nu.setZero(d_);
    }

    /// set_state's work: S (d × dv) and z (1 × d, or empty for z = 0; normaliser only) as
    /// after `length` tokens, all checked before any is copied.
    void install_state(const Matrix<T>& S, const Vector<T>* z, Index length) {
        const char* function = names_->set_state;
        detail::check_state(function, normaliser ? "state.mu" : "S", S, d_, dv_);
        if (z != nullptr && z->size() != 0)
            detail::check_state(function, "state.nu", *z, 1, d_);
        detail::require(length >= 0 && length <= max_length, function, "length", "is ", length,
                ", expected 0 .. memattn::max_length = 2^62");
        state_.mu = S;
        if constexpr (normaliser) {
            if (z != nullptr && z->size() != 0)
                state_.nu = *z;
            else
                state_.nu.setZero();
        }
        length_ = length;
    }

    Index d_;                      ///< the key width d (and the query's)
    Index dv_;                     ///< the value width dv (and the output's)
    Index key_dim_;                ///< d and the extra columns
    const detail::RecurrentNames* names_;  ///< the names its messages give
    LinearState<T> state_;         ///< S (mu) and, with a normaliser, z (nu; empty without)
    Index length_ = 0;             ///< tokens seen since reset

private:
    [[nodiscard]] const Memory& memory() const noexcept { return static_cast<const Memory&>(*this); }
    [[nodiscard]] Memory& memory_mutable() noexcept { return static_cast<Memory&>(*this); }

    /// One row as a group of one (update_attend's query and output).
    static Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>> group_of(ConstRowRef<T> row) {
        return {row.data(), 1, row.size(), Eigen::OuterStride<>(row.size())};
    }
    static Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>> group_of(RowRef<T> row) {
        return {row.data(), 1, row.size(), Eigen::OuterStride<>(row.size())};
    }

    template <class Rows>
    [[nodiscard]] bool views_state(const Rows& rows) const {
        return detail::views_own(rows, state_.mu, state_.nu);
    }

    /// update after its checks: a key or value that views the state copied first.
    void feed_apart(ConstRowRef<T> key, ConstRowRef<T> value) {
        if (views_state(key) || views_state(value)) {
            key_copy_ = key;
            value_copy_ = value;
            return feed(key_copy_, value_copy_);
        }
        feed(key, value);
    }

    /// update after its checks, on a key and value apart from the state.
    void feed(ConstRowRef<T> key, ConstRowRef<T> value) {
        memory_mutable().step(key, value);
        ++length_;
    }

    Vector<T> key_copy_, value_copy_;  ///< update's key and value when they view the state
};

}  // namespace memattn
