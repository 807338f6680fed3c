#pragma once
// The Memory concept and the algorithms that work on any model of it.
//
// An attention memory is a state updated by one rule, Mem_i = f((k_i, v_i), Mem_{i-1}),
// and read by one query at a time, o_i = Att(q_i, Mem_i). A minimal model is a struct
// of about twenty lines (see tests/memory_concept_test.cpp):
//
//   struct LastValue {
//       using Scalar = float;
//       memattn::Vector<float> v_ = memattn::Vector<float>::Zero(4);
//       memattn::Index n_ = 0;
//       void update(memattn::ConstRowRef<float>, memattn::ConstRowRef<float> v) { v_ = v; ++n_; }
//       void attend(memattn::ConstRowRef<float>, memattn::RowRef<float> out) const { out = v_; }
//       memattn::Index length() const { return n_; }
//       std::size_t footprint() const { return sizeof(float) * 4; }
//       void reset() { v_.setZero(); n_ = 0; }
//   };

#include "memattn/detail/packet.hpp"
#include "memattn/types.hpp"

#include <concepts>
#include <cstddef>
#include <string_view>
#include <utility>

namespace memattn {

/// An attention memory (see the top of the file): update(k, v) folds one token into the
/// state, attend(q, out) reads it for one query, length() and footprint() report it and
/// reset() empties it.
template <class M>
concept Memory = requires { typename M::Scalar; } &&
    requires(M& m, const M& cm, ConstRowRef<typename M::Scalar> k, ConstRowRef<typename M::Scalar> v,
             ConstRowRef<typename M::Scalar> q, RowRef<typename M::Scalar> out) {
        m.update(k, v);  // Mem = f((k, v), Mem_pre)
        cm.attend(q, out);  // out = Att(q, Mem); const, so safe from several threads at once
        { cm.length() } -> std::same_as<Index>;  // tokens seen since reset
        { cm.footprint() } -> std::same_as<std::size_t>;  // bytes of state held now
        m.reset();
    };

namespace detail {

template <class M>
concept HasBulkExtend = requires(M& m, ConstMatrixRef<typename M::Scalar> K, ConstMatrixRef<typename M::Scalar> V) {
    m.extend(K, V);
};

template <class M>
concept HasBulkPrefill = requires(M& m, ConstMatrixRef<typename M::Scalar> Q, ConstMatrixRef<typename M::Scalar> K,
                                  ConstMatrixRef<typename M::Scalar> V, MatrixRef<typename M::Scalar> O) {
    m.prefill(Q, K, V, O);
};

template <class M>
concept KnowsDims = requires(const M& m) {
    { m.key_dim() } -> std::convertible_to<Index>;
    { m.value_dim() } -> std::convertible_to<Index>;
};

/// A memory whose queries and outputs are wider than its keys and values (a layer of
/// heads, memattn::MultiHead) says so; otherwise a query has a key's width and an output
/// a value's.
template <class M>
concept KnowsQueryDims = requires(const M& m) {
    { m.query_dim() } -> std::convertible_to<Index>;
    { m.output_dim() } -> std::convertible_to<Index>;
};

/// prefill for g query heads over one KV head: `prefill_group(Q, K, V, O)` with Q
/// n × g·key_dim and O n × g·value_dim.
template <class M>
concept HasGroupPrefill = requires(M& m, ConstMatrixRef<typename M::Scalar> Q, ConstMatrixRef<typename M::Scalar> K,
                                   ConstMatrixRef<typename M::Scalar> V, MatrixRef<typename M::Scalar> O) {
    m.prefill_group(Q, K, V, O);
};

/// g queries at once against one pass over the state: `attend_group(Qg, Og)`.
template <class M>
concept HasGroupAttend = requires(const M& m, ConstMatrixRef<typename M::Scalar> Q, MatrixRef<typename M::Scalar> O) {
    m.attend_group(Q, O);
};

/// A memory that can say, before anything changes, whether it would take these pairs:
/// `validate(K, V, site)` throws what update/extend would throw (a value its storage
/// cannot hold, a gate out of range, no room left) and changes nothing. memattn's memories
/// and MultiHead have it; decode, extend and prefill call it first, so a bad row late in
/// a sequence leaves the memory as it was, and a layer checks every head before any moves.
template <class M>
concept ValidatesPairs = requires(const M& m, ConstMatrixRef<typename M::Scalar> K,
                                  ConstMatrixRef<typename M::Scalar> V, const PairSite& site) {
    m.validate(K, V, site);
};

/// The memory's own check of the values of K/V, where it has one (ValidatesPairs).
template <class M, class T = typename M::Scalar>
void validate_pairs([[maybe_unused]] std::string_view function, [[maybe_unused]] const M& mem,
                    [[maybe_unused]] const ConstMatrixRef<T>& k, [[maybe_unused]] const ConstMatrixRef<T>& v) {
    if constexpr (ValidatesPairs<M>)
        mem.validate(k, v, PairSite{function, "K", "V"});
}

/// Checks K/V (and Q/O when given) against each other and, where the memory tells its
/// dims, against the memory, before any token is fed: a bad call changes nothing.
template <class M>
void check_keys_values(const char* function, const M& mem, Shape k, Shape v) {
    require(k.rows == v.rows, function, "V", "has shape ", v, ", expected ", k.rows, " rows as K (", k, ")");
    if constexpr (KnowsDims<M>) {
        require(k.cols == mem.key_dim(), function, "K", "has shape ", k, ", expected ", mem.key_dim(),
                " columns (the memory's key_dim)");
        require(v.cols == mem.value_dim(), function, "V", "has shape ", v, ", expected ", mem.value_dim(),
                " columns (the memory's value_dim)");
    }
}

template <class M>
void check_queries(const char* function, const M& mem, Shape q, Shape k, Shape v, Shape o) {
    require(q.rows == k.rows, function, "Q", "has shape ", q, ", expected ", k.rows, " rows as K (", k, ")");
    if constexpr (KnowsQueryDims<M>) {
        require(q.cols == mem.query_dim(), function, "Q", "has shape ", q, ", expected ", mem.query_dim(),
                " columns (the memory's query_dim)");
        require(o.rows == q.rows && o.cols == mem.output_dim(), function, "O", "has shape ", o, ", expected ", q.rows,
                'x', mem.output_dim(), " (Q's rows x the memory's output_dim)");
        return;
    } else if constexpr (KnowsDims<M>) {
        require(q.cols == mem.key_dim(), function, "Q", "has shape ", q, ", expected ", mem.key_dim(),
                " columns (the memory's key_dim)");
    } else {
        require(q.cols == k.cols, function, "Q", "has shape ", q, ", expected ", k.cols, " columns as K (", k, ")");
    }
    require(o.rows == q.rows && o.cols == v.cols, function, "O", "has shape ", o, ", expected ", q.rows, 'x',
            v.cols, " (Q is ", q, ", V is ", v, ")");
}

/// Every check of decode and prefill, before any token is fed: shapes, then the aliasing rule.
template <class M, class T = typename M::Scalar>
void check_sequences(const char* function, const M& mem, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                     const ConstMatrixRef<T>& v, const MatrixRef<T>& o) {
    check_keys_values(function, mem, shape(k), shape(v));
    check_queries(function, mem, shape(q), shape(k), shape(v), shape(o));
    require_disjoint(function, "O", o, "Q", q);
    require_disjoint(function, "O", o, "K", k);
    require_disjoint(function, "O", o, "V", v);
    validate_pairs(function, mem, k, v);
}

/// mem.update(key, value), then mem.attend(query, out): through mem.update_attend where
/// it has one (a recurrent memory's state updated and read in one pass), the same numbers.
/// After the caller's checks (check_sequences and validate_pairs): through the memory's
/// checked entry where it has one.
template <class M, class T = typename M::Scalar>
void update_attend(M& mem, ConstRowRef<T> key, ConstRowRef<T> value, ConstRowRef<T> query, RowRef<T> out) {
    if constexpr (requires { mem.update_attend(key, value, query, out, checked); }) {
        mem.update_attend(key, value, query, out, checked);
    } else if constexpr (requires { mem.update_attend(key, value, query, out); }) {
        mem.update_attend(key, value, query, out);
    } else {
        mem.update(key, value);
        mem.attend(query, out);
    }
}

/// mem = source, then update_attend(mem, key, value, query, out): through
/// mem.assign_update_attend where it has one (the copy folded into a recurrent memory's
/// fused step: the state read from source, written to mem), the same numbers.
/// Stores it streamed past the cache are left unfenced: the caller fences once after a
/// batch of them (stream_fence) before another thread reads those states.
template <class M, class T = typename M::Scalar>
void assign_update_attend(M& mem, const M& source, ConstRowRef<T> key, ConstRowRef<T> value, ConstRowRef<T> query,
                          RowRef<T> out) {
    if constexpr (requires { mem.assign_update_attend(source, key, value, query, out, unfenced); }) {
        mem.assign_update_attend(source, key, value, query, out, unfenced);
    } else if constexpr (requires { mem.assign_update_attend(source, key, value, query, out); }) {
        mem.assign_update_attend(source, key, value, query, out);
    } else {
        mem = source;
        update_attend<M, T>(mem, key, value, query, out);
    }
}

/// decode's loop, after the checks.
template <class M, class T = typename M::Scalar>
void decode_rows(M& mem, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                 MatrixRef<T> o) {
    for (Index i = 0; i < k.rows(); ++i)
        update_attend<M, T>(mem, k.row(i), v.row(i), q.row(i), o.row(i));
}

}  // namespace detail

/// Feeds the rows of K/V one by one and, after each, attends with the same row of Q,
/// so row i of O sees tokens 0..i (and whatever the memory held before). O must not
/// overlap Q, K or V.
template <Memory M, class DQ, class DK, class DV, detail::EigenMatrix DO>
void decode(M& mem, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
            DO&& O) {
    using T = typename M::Scalar;
    static_assert(detail::same_scalar<M, DQ, DK, DV, std::remove_cvref_t<DO>>,
                  "memattn::decode: Q, K, V and O must have the memory's Scalar type.");
    const ConstMatrixRef<T> q = detail::sequence(Q), k = detail::sequence(K), v = detail::sequence(V);
    MatrixRef<T> o = detail::output(std::forward<DO>(O));
    detail::check_sequences("decode", mem, q, k, v, o);
    detail::decode_rows(mem, q, k, v, o);
}

/// Feeds many tokens; uses the memory's own bulk `extend(K, V)` when it has one.
template <Memory M, class DK, class DV>
void extend(M& mem, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V) {
    using T = typename M::Scalar;
    static_assert(detail::same_scalar<M, DK, DV>, "memattn::extend: K and V must have the memory's Scalar type.");
    const ConstMatrixRef<T> k = detail::sequence(K), v = detail::sequence(V);
    detail::check_keys_values("extend", mem, detail::shape(k), detail::shape(v));
    detail::validate_pairs("extend", mem, k, v);
    if constexpr (detail::HasBulkExtend<M>) {
        mem.extend(k, v);
    } else {
        for (Index i = 0; i < k.rows(); ++i)
            mem.update(k.row(i), v.row(i));
    }
}

/// Same outputs as `decode`, through the memory's whole-sequence kernel where it has
/// one (`prefill(Q, K, V, O)`), else token by token. O must not overlap Q, K or V.
template <Memory M, class DQ, class DK, class DV, detail::EigenMatrix DO>
void prefill(M& mem, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
             DO&& O) {
    using T = typename M::Scalar;
    static_assert(detail::same_scalar<M, DQ, DK, DV, std::remove_cvref_t<DO>>,
                  "memattn::prefill: Q, K, V and O must have the memory's Scalar type.");
    const ConstMatrixRef<T> q = detail::sequence(Q), k = detail::sequence(K), v = detail::sequence(V);
    MatrixRef<T> o = detail::output(std::forward<DO>(O));
    detail::check_sequences("prefill", mem, q, k, v, o);
    if constexpr (detail::HasBulkPrefill<M>)
        mem.prefill(q, k, v, o);
    else
        detail::decode_rows(mem, q, k, v, o);
}

}  // namespace memattn
