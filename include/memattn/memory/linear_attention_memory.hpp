#pragma once
// LinearAttentionMemory: the state of linear attention, μ (d'×dv) and ν (1×d'), as a
// Memory. Its size is fixed by (d', dv), however many tokens it has seen.
//
//   update(k, v):  μ ← γ μ + φ(k)ᵀ v,   ν ← γ ν + φ(k)         (one rank-1 update)
//   attend(q):     o = φ(q) μ / (φ(q)·ν + eps)   (or φ(q) μ when not normalising)
//
// Its outputs equal recurrent_linear_attention (and the two other forms) on the same
// tokens; `prefill` runs chunked_linear_attention on the memory's own state and leaves
// it ready for decoding. Katharopoulos et al. 2020, "Transformers are RNNs".
//
// No allocation after construction in update/attend: update writes φ(k) into a row
// allocated by the constructor. attend is const and may run on several threads at once,
// so it cannot share that row: φ(q) goes into a stack buffer of 32 KiB (8192 float or
// 4096 double features, enough for Taylor2 up to d = 127 in float / 89 in double and
// for FavorPlus up to m = 8192 / 4096). A larger feature dim uses a row allocated by
// the constructor behind a mutex, so such attends are serialised but still allocate
// nothing.

#include "memattn/feature_maps.hpp"
#include "memattn/kernels/linear_attention.hpp"
#include "memattn/memory/concept.hpp"
#include "memattn/memory/detail/low_precision.hpp"
#include "memattn/memory/detail/memory_checks.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

namespace memattn {

/// The linear-attention state μ, ν under a feature map Phi, as a Memory; see the top of the file.
template <class T, class Phi = EluPlusOne>
    requires FeatureMap<Phi, T> || (LowPrecision<T> && FeatureMap<Phi, float>)
class LinearAttentionMemory {
public:
    using Scalar = T;            ///< float or double: the rows' scalar and the state's
    using FeatureMapType = Phi;  ///< the feature map φ

    /// Features φ(q) attend computes in its stack buffer; beyond, see the header comment.
    static constexpr Index stack_features = Index(32768 / sizeof(T));

    /// Keys of width `key_dim` (d), which `phi` maps to d′ = phi.output_dim(d) features,
    /// values of width `value_dim` (dv); `options` as for the kernels. Allocates the state
    /// and every scratch buffer.
    LinearAttentionMemory(Index key_dim, Index value_dim, Phi phi = {}, LinearOptions options = {})
        : key_dim_(checked_dim(key_dim, "key_dim")),
          value_dim_(checked_dim(value_dim, "value_dim")),
          phi_(std::move(phi)),
          options_(options),
          feature_dim_(checked_features(phi_, key_dim)) {
        // The options as every kernel checks them (no tokens: only chunk_size, eps, decay).
        detail::check_linear_arguments<T>("LinearAttentionMemory", phi_, {0, key_dim}, {0, key_dim}, {0, value_dim},
                                          {0, value_dim}, options_, nullptr);
        detail::require_one_span("LinearAttentionMemory", options_.span_tokens,
                                 "a memory prefills its state as one span (a MultiHead layer spreads its heads)");
        state_.mu.setZero(feature_dim_, value_dim_);
        state_.nu.setZero(feature_dim_);
        extend_rows_ = std::clamp<Index>(extend_scratch_elements / feature_dim_, 1, extend_block);
        key_features_.resize(extend_rows_, feature_dim_);
        powers_ = detail::decay_powers<T>(options_.decay, extend_rows_);
        value_copy_.resize(value_dim_);
        if (feature_dim_ > stack_features)
            wide_ = std::make_unique<WideScratch>(feature_dim_);
    }

    /// A copy of the state, map and options with scratch of its own, so copies attend and
    /// update independently.
    LinearAttentionMemory(const LinearAttentionMemory& other)
        : key_dim_(other.key_dim_),
          value_dim_(other.value_dim_),
          phi_(other.phi_),
          options_(other.options_),
          feature_dim_(other.feature_dim_),
          state_(other.state_),
          length_(other.length_),
          extend_rows_(other.extend_rows_),
          key_features_(other.key_features_),
          powers_(other.powers_),
          value_copy_(other.value_copy_),
          wide_(other.wide_ ? std::make_unique<WideScratch>(feature_dim_) : nullptr) {}
    /// Takes over the state and the scratch.
    LinearAttentionMemory(LinearAttentionMemory&&) noexcept = default;
    /// As the copy constructor: the state, map and options, with scratch of its own;
    /// between memories of the same shapes in place, keeping this one's scratch, so it
    /// allocates nothing (a pool's copies of its states: StatePool).
    LinearAttentionMemory& operator=(const LinearAttentionMemory& other) {
        if (this == &other)
            return *this;
        if (key_dim_ != other.key_dim_ || feature_dim_ != other.feature_dim_ || value_dim_ != other.value_dim_ ||
            extend_rows_ != other.extend_rows_ || static_cast<bool>(wide_) != static_cast<bool>(other.wide_)) {
            LinearAttentionMemory copy(other);
            *this = std::move(copy);
            return *this;
        }
        phi_ = other.phi_;  // first: a map's members of the same key width (no allocation for memattn's maps)
        options_ = other.options_;
        state_.mu = other.state_.mu;  // the same shapes: no allocation
        state_.nu = other.state_.nu;
        length_ = other.length_;
        powers_ = other.powers_;
        return *this;
    }
    /// Takes over the state and the scratch.
    LinearAttentionMemory& operator=(LinearAttentionMemory&&) noexcept = default;
    ~LinearAttentionMemory() = default;

    /// μ ← γ μ + φ(k)ᵀ v,  ν ← γ ν + φ(k). Throws (leaving the memory unchanged) on a
    /// key or value of the wrong size. The key and value may be views of the state itself
    /// (e.g. a row of state().mu): they are read before the state changes.
    void update(ConstRowRef<T> key, ConstRowRef<T> value) {
        validate(key, value, {"LinearAttentionMemory::update", "key", "value"});
        Eigen::Map<const Matrix<T>> k(key.data(), 1, key_dim_);
        auto kf = key_features_.topRows(1);
        phi_(ConstMatrixRef<T>(k), MatrixRef<T>(kf));  // only the scratch row changes before here
        if (views_state(value)) {  // μ is scaled below, and the rank-1 update must not read what it writes
            value_copy_ = value;
            return fold_features(kf, value_copy_);
        }
        fold_features(kf, value);
    }

    /// out = φ(q) μ / (φ(q)·ν + eps), or φ(q) μ; zero before any update. `out` must not
    /// overlap `query`.
    void attend(ConstRowRef<T> query, RowRef<T> out) const {
        detail::check_query("LinearAttentionMemory::attend", query, out, key_dim_, value_dim_);
        if (feature_dim_ <= stack_features) {
            alignas(64) T buffer[stack_features];
            attend_with(query, out, buffer);
        } else {
            const std::lock_guard<std::mutex> lock(wide_->mutex);
            attend_with(query, out, wide_->features.data());
        }
    }

    /// Row r of `out` = attend(row r of `queries`), to rounding, for g queries at once (a
    /// group of query heads over this KV head): μ and ν are read once for the group, the
    /// features of as many queries as fit the stack buffer at a time, one register-blocked
    /// product φ(Q_g) μ. Allocates nothing.
    void attend_group(ConstMatrixRef<T> queries, MatrixRef<T> out) const {
        detail::check_group_query("LinearAttentionMemory::attend_group", queries, out, key_dim_, value_dim_);
        const Index rows = feature_dim_ <= stack_features ? stack_features / feature_dim_ : 0;
        if (rows == 0) {  // d' beyond the stack buffer: one query at a time, as attend
            for (Index r = 0; r < queries.rows(); ++r)
                attend(queries.row(r), out.row(r));
            return;
        }
        alignas(64) T buffer[stack_features];
        for (Index r0 = 0; r0 < queries.rows(); r0 += rows) {
            const Index m = std::min(rows, queries.rows() - r0);
            Eigen::Map<Matrix<T>> qf(buffer, m, feature_dim_);
            phi_(ConstMatrixRef<T>(queries.middleRows(r0, m)), MatrixRef<T>(qf));
            T* o = out.data() + r0 * out.outerStride();
            detail::tile_product<T>(m, value_dim_, feature_dim_, buffer, feature_dim_, 1, state_.mu.data(), value_dim_,
                                    o, out.outerStride(), nullptr);  // q'μ
            if (options_.normalize)
                for (Index r = 0; r < m; ++r)
                    out.row(r0 + r) *= T(1) / (qf.row(r).dot(state_.nu) + static_cast<T>(options_.eps));
        }
    }

    /// Most tokens per block of extend: no queries, so no pairs term to keep small; long
    /// blocks make the fold one large GEMM. The block's φ(K) scratch is allocated by the
    /// constructor with min(256, max(1, 16384 / d')) rows (≤ 64 KiB in float, at least
    /// one row), so extend allocates nothing either.
    static constexpr Index extend_block = 256;
    static constexpr Index extend_scratch_elements = 16384;  ///< features the φ(K) scratch holds, when d′ allows

    /// Feeds many tokens: per block of extend_rows() tokens, φ(K) into the scratch and one
    /// GEMM μ ← γⁿ μ + φ(K)ᵀ diag(γ^{n−1−j}) V. Keys and values that are views of the
    /// state itself are copied first (the one case where extend allocates).
    void extend(ConstMatrixRef<T> keys, ConstMatrixRef<T> values) {
        validate(keys, values, {"LinearAttentionMemory::extend"});
        if (views_state(keys) || views_state(values)) {  // each block's fold changes what later blocks read
            const Matrix<T> own_keys = keys, own_values = values;
            return extend(own_keys, own_values);
        }
        const Index c = extend_rows_;
        for (Index start = 0; start < keys.rows(); start += c) {
            const Index n = std::min(c, keys.rows() - start);
            auto k = key_features_.topRows(n);
            detail::apply_features<T>(phi_, keys.middleRows(start, n), k);
            detail::fold_chunk(k, values.middleRows(start, n), powers_, options_.decay != 1, state_);
        }
        length_ += keys.rows();
    }

    /// The outputs decode would give (row i sees the memory plus tokens 0..i), by
    /// chunked_linear_attention on the memory's state, which is left after the last token.
    /// `out` must not overlap the inputs; the inputs may be views of the state (the kernel
    /// reads the state once, at the start, and writes it back at the end).
    void prefill(ConstMatrixRef<T> queries, ConstMatrixRef<T> keys, ConstMatrixRef<T> values, MatrixRef<T> out) {
        constexpr const char* function = "LinearAttentionMemory::prefill";
        validate(keys, values, {function});
        detail::check_prefill(function, queries, keys, values, out, key_dim_, value_dim_);
        chunked_linear_attention(queries, keys, values, out, phi_, options_, &state_);
        length_ += keys.rows();
    }

    /// prefill for g queries per token against the same keys and values (a group of query
    /// heads over this KV head): `queries` is n × g·key_dim and `out` n × g·value_dim,
    /// member m in columns [m·key_dim, (m+1)·key_dim) and [m·value_dim, (m+1)·value_dim).
    /// The keys are folded into the state once; each member's outputs are bitwise its prefill's.
    void prefill_group(ConstMatrixRef<T> queries, ConstMatrixRef<T> keys, ConstMatrixRef<T> values,
                       MatrixRef<T> out) {
        constexpr const char* function = "LinearAttentionMemory::prefill_group";
        validate(keys, values, {function});
        const Index members = queries.cols() / key_dim_;
        detail::require(members >= 1 && queries.cols() == members * key_dim_, function, "queries", "has shape ",
                        detail::shape(queries), ", expected a multiple of key_dim = ", key_dim_, " columns");
        detail::check_prefill(function, queries, keys, values, out, members * key_dim_, members * value_dim_);
        detail::chunked_form<T>(queries, keys, values, out, phi_, options_, feature_dim_, state_);
        length_ += keys.rows();
    }

    /// Throws what update/extend would throw for these pairs, changing nothing:
    /// std::invalid_argument for a shape, std::length_error past memattn::max_length.
    void validate(ConstMatrixRef<T> keys, ConstMatrixRef<T> values,
                  const detail::PairSite& site = {"LinearAttentionMemory::validate"}) const {
        detail::check_site_pairs(site, detail::shape(keys), detail::shape(values), key_dim_, value_dim_, length_);
    }

    /// Tokens seen since reset (or the length given to set_state).
    [[nodiscard]] Index length() const noexcept { return length_; }
    /// Bytes of the state μ and ν: (d'·dv + d')·sizeof(T), whatever the length.
    [[nodiscard]] std::size_t footprint() const noexcept {
        return static_cast<std::size_t>(feature_dim_ * (value_dim_ + 1)) * sizeof(T);
    }
    /// Bytes allocated: the state plus the scratch for φ(K) in update/extend (and for φ(q)
    /// in attend when d' is beyond the stack buffer).
    [[nodiscard]] std::size_t capacity() const noexcept {
        const Index rows = extend_rows_ + (wide_ ? 1 : 0);
        return footprint() + static_cast<std::size_t>(rows * feature_dim_ + powers_.size()) * sizeof(T);
    }
    /// Tokens per GEMM in extend.
    [[nodiscard]] Index extend_rows() const noexcept { return extend_rows_; }
    /// Forgets every token: μ = 0, ν = 0.
    void reset() noexcept {
        state_.mu.setZero();
        state_.nu.setZero();
        length_ = 0;
    }

    /// The state, to save; set_state(saved, length) resumes from it (copied into the
    /// memory's own storage, no allocation). Throws, changing nothing, on wrong shapes.
    [[nodiscard]] const LinearState<T>& state() const noexcept { return state_; }
    /// Resumes from a saved state(), as after `length` tokens; throws std::invalid_argument,
    /// changing nothing, unless μ is d′ × dv and ν 1 × d′.
    void set_state(const LinearState<T>& state, Index length = 0) {
        detail::require(state.mu.rows() == feature_dim_ && state.mu.cols() == value_dim_,
                        "LinearAttentionMemory::set_state", "state.mu", "has shape ", detail::shape(state.mu),
                        ", expected ", feature_dim_, 'x', value_dim_);
        detail::require(state.nu.cols() == feature_dim_, "LinearAttentionMemory::set_state", "state.nu", "has shape ",
                        detail::shape(state.nu), ", expected 1x", feature_dim_);
        detail::require(length >= 0 && length <= max_length, "LinearAttentionMemory::set_state", "length", "is ",
                        length, ", expected 0 .. memattn::max_length = 2^62");
        state_.mu = state.mu;
        state_.nu = state.nu;
        length_ = length;
    }

    /// The key width d.
    [[nodiscard]] Index key_dim() const noexcept { return key_dim_; }
    /// The value width dv.
    [[nodiscard]] Index value_dim() const noexcept { return value_dim_; }
    /// The feature width d′ = φ's output_dim(d).
    [[nodiscard]] Index feature_dim() const noexcept { return feature_dim_; }
    /// The feature map φ.
    [[nodiscard]] const Phi& feature_map() const noexcept { return phi_; }
    /// The options it was built with.
    [[nodiscard]] const LinearOptions& options() const noexcept { return options_; }

    /// Snapshots (memattn/persistence/snapshot.hpp), for a feature map that names itself
    /// (detail::NamedForSnapshots; the library's do): key_dim, value_dim, feature_dim, the
    /// map's parameters (FavorPlus: its projection ω), the options (chunk_size, eps, decay,
    /// normalize), length, then μ and ν.
    [[nodiscard]] static std::string snapshot_kind()
        requires detail::NamedForSnapshots<Phi>
    {
        return "LinearAttentionMemory/" + std::string(std::string_view(Phi::snapshot_name));
    }
    /// Snapshots (memattn/persistence/snapshot.hpp): writes the payload, the fields listed at snapshot_kind().
    void write_snapshot(snapshot::Writer& w) const
        requires detail::NamedForSnapshots<Phi>
    {
        w.index(key_dim_);
        w.index(value_dim_);
        w.index(feature_dim_);
        if constexpr (HasProjection<Phi>)
            w.matrix(phi_.projection());
        w.index(options_.chunk_size);
        w.number(options_.eps);
        w.number(options_.decay);
        w.flag(options_.normalize);
        w.index(length_);
        w.matrix(state_.mu);
        w.matrix(state_.nu);
    }
    /// Snapshots: reads a payload written by write_snapshot(); throws SnapshotError, the
    /// memory unchanged, unless key_dim, value_dim, feature_dim, the map's parameters and
    /// the options are its own.
    void read_snapshot(snapshot::Reader& r)
        requires detail::NamedForSnapshots<Phi>
    {
        r.expect("key_dim", key_dim_);
        r.expect("value_dim", value_dim_);
        r.expect("feature_dim", feature_dim_);
        if constexpr (HasProjection<Phi>) {
            const Matrix<double>& mine = phi_.projection();
            Matrix<double> stored(mine.rows(), mine.cols());
            r.matrix(stored, "the feature map's projection");
            if (std::memcmp(stored.data(), mine.data(), sizeof(double) * static_cast<std::size_t>(mine.size())) != 0)
                r.mismatch("the feature map's projection", "another", "this memory's");
        }
        r.expect("chunk_size", options_.chunk_size);
        r.expect("eps", options_.eps);
        r.expect("decay", options_.decay);
        r.expect("normalize", options_.normalize);
        const Index length = r.count("length", 0, max_length);
        r.expect_remaining(sizeof(T) * static_cast<std::size_t>(state_.mu.size() + state_.nu.size()), "mu and nu");
        r.matrix(state_.mu, "mu");
        r.matrix(state_.nu, "nu");
        length_ = length;
    }

private:
    template <class F>
    static constexpr bool HasProjection = requires(const F& f) {
        { f.projection() } -> std::convertible_to<const Matrix<double>&>;
    };

    /// The rank-1 update of `update` from the key's features in the scratch row.
    template <class KF, class VR>
    void fold_features(const KF& kf, const VR& value) {
        if (options_.decay != 1) {
            const auto gamma = static_cast<T>(options_.decay);
            state_.mu *= gamma;
            state_.nu *= gamma;
        }
        state_.mu.noalias() += kf.transpose() * value;
        state_.nu += kf;
        ++length_;
    }

    /// Whether a row or rows given to update/extend share memory with μ or ν.
    template <class D>
    [[nodiscard]] bool views_state(const D& input) const {
        const detail::Extent e = detail::extent(input);
        return detail::overlap<T>(e, detail::extent(state_.mu)) || detail::overlap<T>(e, detail::extent(state_.nu));
    }

    struct WideScratch {
        explicit WideScratch(Index features) : features(features) {}
        std::mutex mutex;
        Vector<T> features;
    };

    void attend_with(const ConstRowRef<T>& query, RowRef<T>& out, T* buffer) const {
        Eigen::Map<const Matrix<T>> q(query.data(), 1, key_dim_);
        Eigen::Map<Matrix<T>> qf(buffer, 1, feature_dim_);
        phi_(ConstMatrixRef<T>(q), MatrixRef<T>(qf));
        out.noalias() = qf * state_.mu;  // q'μ
        if (options_.normalize)
            out *= T(1) / (qf.row(0).dot(state_.nu) + static_cast<T>(options_.eps));  // / (q'·ν + eps)
    }

    static Index checked_dim(Index dim, const char* argument) {
        detail::require(dim > 0, "LinearAttentionMemory", argument, "is ", dim, ", expected > 0");
        return dim;
    }

    static Index checked_features(const Phi& phi, Index key_dim) {
        const auto features = static_cast<Index>(phi.output_dim(key_dim));
        detail::require(features > 0, "LinearAttentionMemory", "phi", "has output_dim(", key_dim, ") = ", features,
                        ", expected > 0");
        return features;
    }

    Index key_dim_;
    Index value_dim_;
    Phi phi_;
    LinearOptions options_;
    Index feature_dim_;
    LinearState<T> state_;
    Index length_ = 0;
    Index extend_rows_ = 1;                // rows of key_features_
    Matrix<T> key_features_;               // φ(k) in update (row 0), φ(K) of a block in extend
    detail::ColumnVector<T> powers_;       // γ^k, k = 0..extend_rows_, for extend
    Vector<T> value_copy_;                 // update's value when it is a view of the state
    std::unique_ptr<WideScratch> wide_;    // φ(q) in attend when d' > stack_features
};

/// LinearAttentionMemory of 16-bit rows (E = Eigen::bfloat16 or Eigen::half):
/// LinearAttentionMemory<float, Phi> behind members that take and give rows of E
/// (memory/detail/low_precision.hpp); the state is float. The constructors are
/// LinearAttentionMemory<float, Phi>'s.
template <LowPrecision E, FeatureMap<float> Phi>
class LinearAttentionMemory<E, Phi> : public detail::LowPrecisionMemory<LinearAttentionMemory<float, Phi>, E> {
public:
    using detail::LowPrecisionMemory<LinearAttentionMemory<float, Phi>, E>::LowPrecisionMemory;
};

namespace detail {
template <class Phi>
inline constexpr std::string_view memory_name<LinearAttentionMemory<float, Phi>> = "LinearAttentionMemory";
}  // namespace detail

}  // namespace memattn
