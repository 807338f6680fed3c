#pragma once
// Memories for the data-dependent recurrences (kernels/gated_linear_attention.hpp,
// kernels/delta_rule.hpp, kernels/rwkv7.hpp): GatedLinearAttentionMemory, DeltaRuleMemory,
// KdaMemory and Rwkv7Memory.
//
// Their update needs the token's gate or β besides (k, v). They take it as extra
// trailing columns of the key row, so they model memattn::Memory unchanged and
// decode/extend/prefill apply as to any memory:
//
//   GatedLinearAttentionMemory(d, dv, GateKind::scalar)   key row: [k (d) | log g (1)]
//   GatedLinearAttentionMemory(d, dv, GateKind::channel)  key row: [k (d) | log a (d)]
//   DeltaRuleMemory(d, dv)                                key row: [k (d) | β (1)]
//   DeltaRuleMemory(d, dv, {}, /*gated=*/true)            key row: [k (d) | β (1) | log g (1)]
//   KdaMemory(d, dv)                                      key row: [k (d) | β (1) | log α (d)]
//   Rwkv7Memory(d, dv)                                    key row: [k (d) | a (d) | b (d) | log w (d)]
//
// key_dim() is the key row's width; a query is d wide and an output dv wide, which the
// memories declare with query_dim()/output_dim() (as MultiHead does for its wider
// rows), so the generic algorithms check Q and O against those. A log-gate that is NaN
// or above 0, or a β outside [0, 1] ([0, 2] with DeltaOptions::allow_negative_eigenvalues),
// throws std::invalid_argument and changes nothing; a log-gate of −∞ resets the state
// (its channel's part of it). prefill runs the chunked kernel on the memory's own state.
// state() and set_state() take the state out and put one in (a model's initial state, a
// state computed elsewhere). update and extend accept keys and values that view the
// memory's own state (a row of state()): they are copied first, since the update writes
// the state before it has read them (as std::vector::push_back(v[0]) works).
//
//   DeltaRuleMemory<float> memory(64, 64, {.qk_l2norm = true});
//   Matrix<float> keys(n, 65);  keys << K, beta;
//   memattn::prefill(memory, Q, keys, V, O);    // = chunked_delta_rule_attention(Q, K, V, beta, O, ...)

#include "memattn/kernels/delta_rule.hpp"
#include "memattn/kernels/gated_linear_attention.hpp"
#include "memattn/kernels/rwkv7.hpp"
#include "memattn/memory/concept.hpp"
#include "memattn/memory/detail/low_precision.hpp"
#include "memattn/memory/detail/memory_checks.hpp"
#include "memattn/memory/recurrent_memory.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/types.hpp"

#include <cmath>
#include <cstddef>
#include <limits>
#include <string>

namespace memattn {

/// One log-gate per token, or one per key channel.
enum class GateKind { scalar, channel };

namespace detail {

/// The extra columns of a key row hold valid gates (and β ∈ [0, beta_max]), or the call throws.
template <class K>
void check_extras(const PairSite& site, const K& keys, Index d, Index beta_column, Index first_gate,
                  double beta_max = 1) {
    for (Index i = 0; i < keys.rows(); ++i) {
        if (beta_column >= 0) {
            const auto beta = keys(i, beta_column);
            require(beta >= 0 && beta <= beta_max, site.function, site.key_name, "row ", site.first_row + i, " has beta ",
                    beta, " in column ", SiteColumn{site, beta_column}, ", expected a value in [0, ", beta_max, "]");
        }
        for (Index c = first_gate; c < keys.cols(); ++c)
            require(keys(i, c) <= 0, site.function, site.key_name, "row ", site.first_row + i, " has log-gate ",
                    keys(i, c), " in column ", SiteColumn{site, c},
                    ", expected a value <= 0, -inf to reset (the first ", d, " columns are the key)");
    }
}

/// The names of GatedLinearAttentionMemory's messages.
inline constexpr RecurrentNames gated_names{
    "GatedLinearAttentionMemory",         "GatedLinearAttentionMemory::update",
    "GatedLinearAttentionMemory::extend", "GatedLinearAttentionMemory::validate",
    "GatedLinearAttentionMemory::attend", "GatedLinearAttentionMemory::attend_group",
    "GatedLinearAttentionMemory::prefill", "GatedLinearAttentionMemory::set_state"};
/// The names of DeltaRuleMemory's messages.
inline constexpr RecurrentNames delta_names{"DeltaRuleMemory",          "DeltaRuleMemory::update",
                                            "DeltaRuleMemory::extend",  "DeltaRuleMemory::validate",
                                            "DeltaRuleMemory::attend",  "DeltaRuleMemory::attend_group",
                                            "DeltaRuleMemory::prefill", "DeltaRuleMemory::set_state"};
/// The names of KdaMemory's messages.
inline constexpr RecurrentNames kda_names{"KdaMemory",          "KdaMemory::update",       "KdaMemory::extend",
                                          "KdaMemory::validate", "KdaMemory::attend",      "KdaMemory::attend_group",
                                          "KdaMemory::prefill",  "KdaMemory::set_state"};
/// The names of Rwkv7Memory's messages.
inline constexpr RecurrentNames rwkv7_names{"Rwkv7Memory",          "Rwkv7Memory::update",
                                            "Rwkv7Memory::extend",  "Rwkv7Memory::validate",
                                            "Rwkv7Memory::attend",  "Rwkv7Memory::attend_group",
                                            "Rwkv7Memory::prefill", "Rwkv7Memory::set_state"};

}  // namespace detail

/// The gated linear-attention state (S, z) as a Memory; see the top of the file. update:
/// key = [k | log-gate(s)], S ← diag(a) S + kᵀ v, z ← a ⊙ z + k. attend: q̂ S, or
/// q̂ S / (q̂·z + eps) with options.normalize (q̂ = q's scale and norm applied, as the
/// kernels). prefill: chunked_gated_linear_attention over the keys' first d columns and
/// their gates.
template <RowScalar T>
class GatedLinearAttentionMemory
    : public RecurrentMemory<GatedLinearAttentionMemory<T>, T, true> {
    using Base = RecurrentMemory<GatedLinearAttentionMemory<T>, T, true>;
    friend Base;

public:
    /// k of width `key_dim` (d; the key row adds the gate columns), values of width
    /// `value_dim` (dv); `options` as for the gated kernels (q scaled by 1/√d unless
    /// options.scale is given; no normaliser unless options.normalize).
    GatedLinearAttentionMemory(Index key_dim, Index value_dim, GateKind gates = GateKind::scalar,
                               GatedOptions options = {})
        : Base(detail::gated_names, key_dim, value_dim, gates == GateKind::scalar ? 1 : key_dim),
          gates_(gates),
          options_(options),
          a_(gates == GateKind::channel ? d_ : 0),
          k_(d_) {
        const Matrix<T> none(0, d_), values(0, dv_), gate(0, gate_cols());
        detail::check_gated_arguments<T, T, T>("GatedLinearAttentionMemory", none, none, values, gate, {0, dv_}, options_,
                                         nullptr);
        detail::require_one_span("GatedLinearAttentionMemory", options_.span_tokens,
                                 "a memory prefills its state as one span (a MultiHead layer spreads its heads)");
        factor_ = detail::query_factor<T>(options_, d_);
    }

    /// One log-gate per token (scalar) or one per key channel.
    [[nodiscard]] GateKind gates() const noexcept { return gates_; }
    /// The options it was built with.
    [[nodiscard]] const GatedOptions& options() const noexcept { return options_; }
    /// The state: mu = S (d × dv), nu = z (1 × d).
    [[nodiscard]] const LinearState<T>& state() const noexcept { return state_; }
    /// Resumes from a state (a saved state(), or one computed elsewhere: FLA's
    /// `initial_state` is S with z unused, as normalize = false ignores it), as after
    /// `length` tokens. Throws std::invalid_argument, changing nothing, unless mu is d × dv
    /// and nu 1 × d (or empty: z = 0), all finite; copies into the memory's own storage.
    void set_state(const LinearState<T>& state, Index length = 0) { this->install_state(state.mu, &state.nu, length); }

    /// Snapshots: d, dv, the gate kind, the options (chunk_size, the resolved scale,
    /// normalize, eps, qk_l2norm, l2norm_eps), length, S, z.
    [[nodiscard]] static std::string snapshot_kind() { return "GatedLinearAttentionMemory"; }

private:
    using Base::d_;
    using Base::dv_;
    using Base::length_;
    using Base::state_;

    [[nodiscard]] Index gate_cols() const noexcept { return gates_ == GateKind::scalar ? 1 : d_; }

    void check_extras(const detail::PairSite& site, ConstMatrixRef<T> keys) const {
        detail::check_extras(site, keys, d_, -1, d_);
    }

    /// update after its checks, on a key and value apart from the state.
    void step(ConstRowRef<T> key, ConstRowRef<T> value) {
        if (gates_ == GateKind::scalar) {
            if (key(d_) == -std::numeric_limits<T>::infinity()) {  // a reset
                state_.mu.setZero();
                state_.nu.setZero();
            } else {
                const T g = std::exp(key(d_));
                state_.mu *= g;
                state_.nu *= g;
            }
        } else {
            a_ = key.tail(d_).array().exp();
            state_.mu.array().colwise() *= a_.transpose().array();
            state_.nu.array() *= a_.array();
            detail::reset_channels(key.tail(d_), state_);
        }
        k_ = key.head(d_);
        if (options_.qk_l2norm)
            k_ *= detail::l2norm_factor<T>(k_.data(), d_, factor_.eps);
        state_.mu.noalias() += k_.transpose() * value;
        state_.nu += k_;
    }

    /// out (= q S) times the query's factor, divided by q̂·z + eps with options.normalize
    /// (after an update; the kernels' recurrent form, operation for operation).
    template <class Q, class O>
    void finish(const Q& query, O&& out) const {
        const T f = factor_(query.data(), d_);
        if (options_.normalize && length_ > 0)
            out *= f / (f * query.dot(state_.nu) + static_cast<T>(options_.eps));
        else if (factor_.active())
            out *= f;
    }
    void finish_group(ConstMatrixRef<T> queries, MatrixRef<T> out) const {
        for (Index r = 0; r < queries.rows(); ++r)
            finish(queries.row(r), out.row(r));
    }

    void run_prefill(ConstMatrixRef<T> queries, ConstMatrixRef<T> keys, ConstMatrixRef<T> values, MatrixRef<T> out,
                     LinearState<T>& state) const {
        chunked_gated_linear_attention(queries, keys.leftCols(d_), values, keys.rightCols(gate_cols()), out, options_,
                                       &state);
    }

    void write_fields(snapshot::Writer& w) const {
        w.index(static_cast<Index>(gates_));
        w.index(options_.chunk_size);
        w.number(detail::resolved_scale(options_.scale, d_));
        w.flag(options_.normalize);
        w.number(options_.eps);
        w.flag(options_.qk_l2norm);
        w.number(options_.l2norm_eps);
    }
    void read_fields(snapshot::Reader& r) const {
        r.expect("gate kind", static_cast<Index>(gates_));
        r.expect("chunk_size", options_.chunk_size);
        r.expect("scale", detail::resolved_scale(options_.scale, d_));
        r.expect("normalize", options_.normalize);
        r.expect("eps", options_.eps);
        r.expect("qk_l2norm", options_.qk_l2norm);
        r.expect("l2norm_eps", options_.l2norm_eps);
    }

    GateKind gates_;
    GatedOptions options_;
    detail::QueryFactor<T> factor_;  ///< q's scale and norm
    Vector<T> a_;  ///< update's channel gates (allocated once)
    Vector<T> k_;  ///< update's key, normalised (allocated once)
};

/// The (gated) delta-rule state S as a Memory; see the top of the file. update: key =
/// [k | β (| log g | log α)], S ← g S (KDA: Diag(α) S), then S ← S + β kᵀ (v − k S).
/// attend: q̂ S (q̂: q scaled, and normalised with qk_l2norm, as the kernels). prefill:
/// chunked_delta_rule_attention over the keys' columns.
template <RowScalar T>
class DeltaRuleMemory : public RecurrentMemory<DeltaRuleMemory<T>, T, false> {
    using Base = RecurrentMemory<DeltaRuleMemory<T>, T, false>;
    friend Base;

public:
    /// k of width `key_dim` (d; the key row adds β and, when `gated`, a log-gate), values
    /// of width `value_dim` (dv).
    DeltaRuleMemory(Index key_dim, Index value_dim, DeltaOptions options = {}, bool gated = false)
        : DeltaRuleMemory(key_dim, value_dim, options, gated ? 1 : 0, detail::delta_names) {}

    /// Whether the key row carries log-gates (the gated delta rule, KDA).
    [[nodiscard]] bool gated() const noexcept { return gate_cols_ > 0; }
    /// The options it was built with.
    [[nodiscard]] const DeltaOptions& options() const noexcept { return options_; }
    /// The state S (d × dv).
    [[nodiscard]] const Matrix<T>& state() const noexcept { return state_.mu; }
    /// Resumes from a state S (a saved state(), or one computed elsewhere: FLA's
    /// `initial_state`, transposed to d × dv if it is dv × d), as after `length` tokens.
    /// Throws std::invalid_argument, changing nothing, unless S is d × dv and finite;
    /// copies into the memory's own storage.
    void set_state(const Matrix<T>& S, Index length = 0) { this->install_state(S, nullptr, length); }

    /// Snapshots: d, dv, gated, the options (chunk_size, the resolved scale, qk_l2norm,
    /// l2norm_eps; not allow_negative_eigenvalues, which only widens what update
    /// accepts), length, S.
    [[nodiscard]] static std::string snapshot_kind() { return "DeltaRuleMemory"; }

protected:
    /// `gate_cols` log-gates in the key row after β: 0, 1, or −1 for one per key channel (KDA).
    DeltaRuleMemory(Index key_dim, Index value_dim, DeltaOptions options, Index gate_cols,
                    const detail::RecurrentNames& names)
        : Base(names, key_dim, value_dim, 1 + (gate_cols < 0 ? key_dim : gate_cols)),
          options_(options),
          gate_cols_(gate_cols < 0 ? d_ : gate_cols),
          k_(1, d_),
          decay_(gate_cols_ > 0 ? d_ : 0) {
        detail::require(options_.chunk_size > 0, names.type, "options.chunk_size", "is ", options_.chunk_size,
                        ", expected > 0");
        detail::check_query_key_options<T>(names.type, options_.scale, options_.l2norm_eps);
        factor_ = detail::query_factor<T>(options_, d_);
    }

private:
    using Base::d_;
    using Base::dv_;
    using Base::state_;

    void check_extras(const detail::PairSite& site, ConstMatrixRef<T> keys) const {
        detail::check_extras(site, keys, d_, d_, d_ + 1, options_.allow_negative_eigenvalues ? 2.0 : 1.0);
    }

    /// update after its checks, on a key and value apart from the state: one pass over S
    /// (detail::delta_token), the decay folded in.
    void step(ConstRowRef<T> key, ConstRowRef<T> value) {
        k_ = key.head(d_);
        if (options_.qk_l2norm)
            k_ *= detail::l2norm_factor<T>(k_.data(), d_, factor_.eps);
        if (gate_cols_ > 0)  // S ← g S, or KDA's S ← Diag(α) S; −∞ resets
            detail::delta_decay_factors(key.tail(gate_cols_), d_, decay_.data());
        detail::delta_token(state_.mu.data(), d_, dv_, k_.data(), key(d_), value.data(),
                            gate_cols_ > 0 ? decay_.data() : nullptr, static_cast<const T*>(nullptr), 0, 0,
                            static_cast<T*>(nullptr), 0);
    }
    /// step, and out = q S (before finish_group) for each row of `queries`, in the same
    /// pass (update_attend_group, after its checks).
    void step_attend(ConstRowRef<T> key, ConstRowRef<T> value, ConstMatrixRef<T> queries, MatrixRef<T> out) {
        step_attend_from(state_.mu.data(), key, value, queries, out);
    }
    /// Everything of `*this = other` but the state and the scratch (folded copies:
    /// assign_update_attend_group).
    void assign_fields(const DeltaRuleMemory& other) noexcept {
        options_ = other.options_;
        factor_ = other.factor_;
        gate_cols_ = other.gate_cols_;
    }
    /// The same with S read from `src` (another state of S's shape: S becomes its update,
    /// stored past the cache, read later: assign_update_attend_group, after its checks).
    void step_attend_from(const T* src, ConstRowRef<T> key, ConstRowRef<T> value, ConstMatrixRef<T> queries,
                          MatrixRef<T> out) {
        k_ = key.head(d_);
        if (options_.qk_l2norm)
            k_ *= detail::l2norm_factor<T>(k_.data(), d_, factor_.eps);
        if (gate_cols_ > 0)
            detail::delta_decay_factors(key.tail(gate_cols_), d_, decay_.data());
        detail::delta_token_from(state_.mu.data(), src, d_, dv_, k_.data(), key(d_), value.data(),
                                 gate_cols_ > 0 ? decay_.data() : nullptr, queries.data(), queries.outerStride(),
                                 queries.rows(), out.data(), out.outerStride(), src != state_.mu.data());
    }

    template <class Q, class O>
    void finish(const Q& query, O&& out) const {
        if (factor_.active())
            out *= factor_(query.data(), d_);
    }
    void finish_group(ConstMatrixRef<T> queries, MatrixRef<T> out) const {
        detail::scale_by_queries(factor_, queries, out);
    }

    void run_prefill(ConstMatrixRef<T> queries, ConstMatrixRef<T> keys, ConstMatrixRef<T> values, MatrixRef<T> out,
                     LinearState<T>& state) const {
        if (gate_cols_ > 0)  // N×1 (the gated delta rule) or N×d (KDA) log-gates
            chunked_delta_rule_attention(queries, keys.leftCols(d_), values, keys.col(d_), keys.rightCols(gate_cols_),
                                         out, options_, &state);
        else
            chunked_delta_rule_attention(queries, keys.leftCols(d_), values, keys.col(d_), out, options_, &state);
    }

    void write_fields(snapshot::Writer& w) const {
        w.flag(gate_cols_ > 0);
        w.index(options_.chunk_size);
        w.number(detail::resolved_scale(options_.scale, d_));
        w.flag(options_.qk_l2norm);
        w.number(options_.l2norm_eps);
    }
    void read_fields(snapshot::Reader& r) const {
        r.expect("gated", gate_cols_ > 0);
        r.expect("chunk_size", options_.chunk_size);
        r.expect("scale", detail::resolved_scale(options_.scale, d_));
        r.expect("qk_l2norm", options_.qk_l2norm);
        r.expect("l2norm_eps", options_.l2norm_eps);
    }

    DeltaOptions options_;
    detail::QueryFactor<T> factor_;  ///< q's scale and norm
    Index gate_cols_;  ///< log-gates in the key row: 0, 1 or d
    Matrix<T> k_;   ///< update's key, normalised (allocated once)
    Vector<T> decay_;  ///< update's decay factors, gated (allocated once)
};

/// KDA's state S as a Memory (kernels/delta_rule.hpp, recurrent_kda_attention): the delta
/// rule with a log-gate per key channel, key row [k (d) | β (1) | log α (d)], so
/// key_dim() = 2d + 1. DeltaRuleMemory's members, snapshots of its own kind.
template <RowScalar T>
class KdaMemory : public DeltaRuleMemory<T> {
public:
    /// k of width `key_dim` (d; the key row adds β and d log-gates), values of width
    /// `value_dim` (dv).
    KdaMemory(Index key_dim, Index value_dim, DeltaOptions options = {})
        : DeltaRuleMemory<T>(key_dim, value_dim, options, -1, detail::kda_names) {}

    /// Snapshots: DeltaRuleMemory's fields (gated: true), under this kind.
    [[nodiscard]] static std::string snapshot_kind() { return "KdaMemory"; }
};

/// RWKV-7's state S as a Memory (kernels/rwkv7.hpp): key row [k (d) | a (d) | b (d) |
/// log w (d)], so key_dim() = 4d; S ← (Diag(w) + bᵀa) S + kᵀv, out = scale · q S;
/// prefill: chunked_rwkv7_attention over the keys' columns.
template <RowScalar T>
class Rwkv7Memory : public RecurrentMemory<Rwkv7Memory<T>, T, false> {
    using Base = RecurrentMemory<Rwkv7Memory<T>, T, false>;
    friend Base;

public:
    /// k, a, b and log w of width `key_dim` (d) in one key row, values of width `value_dim` (dv).
    Rwkv7Memory(Index key_dim, Index value_dim, Rwkv7Options options = {})
        : Base(detail::rwkv7_names, key_dim, value_dim, 3 * key_dim), options_(options), read_(dv_) {
        detail::require(options_.chunk_size > 0, "Rwkv7Memory", "options.chunk_size", "is ", options_.chunk_size,
                        ", expected > 0");
        detail::require(detail::finite_in<T>(options_.scale), "Rwkv7Memory", "options.scale", "is ", options_.scale,
                        ", expected a number finite as ", detail::scalar_name<T>);
    }

    /// The options it was built with.
    [[nodiscard]] const Rwkv7Options& options() const noexcept { return options_; }
    /// The state S (d × dv: flash-linear-attention's, dv × d, transposed).
    [[nodiscard]] const Matrix<T>& state() const noexcept { return state_.mu; }
    /// Resumes from a state S, as after `length` tokens. Throws std::invalid_argument,
    /// changing nothing, unless S is d × dv and finite. (A snapshot, by contrast, restores
    /// whatever state was saved, non-finite too: docs/snapshot-format.md, "Guarantees".)
    void set_state(const Matrix<T>& S, Index length = 0) { this->install_state(S, nullptr, length); }

    /// Snapshots: d, dv, chunk_size, scale, length, S.
    [[nodiscard]] static std::string snapshot_kind() { return "Rwkv7Memory"; }

private:
    using Base::d_;
    using Base::dv_;
    using Base::state_;

    void check_extras(const detail::PairSite& site, ConstMatrixRef<T> keys) const {
        detail::check_extras(site, keys, d_, -1, 3 * d_);
    }

    /// update after its checks, on a key and value apart from the state.
    void step(ConstRowRef<T> key, ConstRowRef<T> value) {
        detail::rwkv7_update(key.head(d_), value, key.segment(d_, d_), key.segment(2 * d_, d_), key.tail(d_),
                             state_.mu, read_);
    }

    template <class Q, class O>
    void finish(const Q&, O&& out) const {
        if (options_.scale != 1)
            out *= static_cast<T>(options_.scale);
    }
    void finish_group(ConstMatrixRef<T>, MatrixRef<T> out) const {
        if (options_.scale != 1)
            out *= static_cast<T>(options_.scale);
    }

    void run_prefill(ConstMatrixRef<T> queries, ConstMatrixRef<T> keys, ConstMatrixRef<T> values, MatrixRef<T> out,
                     LinearState<T>& state) const {
        chunked_rwkv7_attention(queries, keys.leftCols(d_), values, keys.middleCols(d_, d_), keys.middleCols(2 * d_, d_),
                                keys.rightCols(d_), out, options_, &state);
    }

    void write_fields(snapshot::Writer& w) const {
        w.index(options_.chunk_size);
        w.number(options_.scale);
    }
    void read_fields(snapshot::Reader& r) const {
        r.expect("chunk_size", options_.chunk_size);
        r.expect("scale", options_.scale);
    }

    Rwkv7Options options_;
    Vector<T> read_;  ///< update's a S (allocated once)
};

/// Rwkv7Memory of 16-bit rows: Rwkv7Memory<float> behind members that take and give rows
/// of E, as DeltaRuleMemory's.
template <LowPrecision E>
class Rwkv7Memory<E> : public detail::LowPrecisionMemory<Rwkv7Memory<float>, E> {
public:
    using detail::LowPrecisionMemory<Rwkv7Memory<float>, E>::LowPrecisionMemory;
};

/// GatedLinearAttentionMemory of 16-bit rows (E = Eigen::bfloat16 or Eigen::half): GatedLinearAttentionMemory<float>
/// behind members that take and give rows of E (memory/detail/low_precision.hpp): the
/// gates (and β) in a key row's extra columns are E too; the state is float. The
/// constructors are GatedLinearAttentionMemory<float>'s.
template <LowPrecision E>
class GatedLinearAttentionMemory<E> : public detail::LowPrecisionMemory<GatedLinearAttentionMemory<float>, E> {
public:
    using detail::LowPrecisionMemory<GatedLinearAttentionMemory<float>, E>::LowPrecisionMemory;
};

/// DeltaRuleMemory of 16-bit rows (E = Eigen::bfloat16 or Eigen::half): DeltaRuleMemory<float>
/// behind members that take and give rows of E (memory/detail/low_precision.hpp): the
/// gates (and β) in a key row's extra columns are E too; the state is float. The
/// constructors are DeltaRuleMemory<float>'s.
template <LowPrecision E>
class DeltaRuleMemory<E> : public detail::LowPrecisionMemory<DeltaRuleMemory<float>, E> {
public:
    using detail::LowPrecisionMemory<DeltaRuleMemory<float>, E>::LowPrecisionMemory;
};

/// KdaMemory of 16-bit rows: KdaMemory<float> behind members that take and give rows of
/// E, as DeltaRuleMemory's.
template <LowPrecision E>
class KdaMemory<E> : public detail::LowPrecisionMemory<KdaMemory<float>, E> {
public:
    using detail::LowPrecisionMemory<KdaMemory<float>, E>::LowPrecisionMemory;
};

namespace detail {
template <>
inline constexpr std::string_view memory_name<GatedLinearAttentionMemory<float>> = "GatedLinearAttentionMemory";
template <>
inline constexpr std::string_view memory_name<DeltaRuleMemory<float>> = "DeltaRuleMemory";
template <>
inline constexpr std::string_view memory_name<KdaMemory<float>> = "KdaMemory";
template <>
inline constexpr std::string_view memory_name<Rwkv7Memory<float>> = "Rwkv7Memory";
}  // namespace detail

}  // namespace memattn
