#pragma once
// The memories of 16-bit rows (docs/design.md §4.7d): KVCache<Eigen::bfloat16> and the
// rest take and give rows of E = Eigen::bfloat16 or Eigen::half and compute in float.
// Each is its float memory (`FloatMemory`, e.g. KVCache<float, Eigen::bfloat16>) behind
// members that convert: every E is a float, so a row converted in is exact, and an output
// is the float memory's rounded to nearest even in E. A step (update, attend, an
// attend_group or a validate of at most `step_rows` rows) converts into buffers the
// memory keeps, sized when it is built, so it allocates nothing;
// a second attend running at the same time on another thread converts through buffers of
// its own. A bulk call converts a span of rows at a time, so its scratch is O(span)
// whatever the length, and is bitwise the float memory's call on each span of the
// converted rows in turn: prefill `span_rows` rows, extend `span_rows` for a KVCache and
// `step_rows` through the kept buffers for the fixed-size memories (which, as their float
// memories, then allocate nothing in extend). Every row is checked before any is fed, so
// a call that throws leaves the memory as it was (a prefill past one span of a memory
// that does not keep every pair copies its state first, to restore it on std::bad_alloc:
// that copy is the one scratch of O(state)).

#include "memattn/memory/concept.hpp"
#include "memattn/memory/detail/memory_checks.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <optional>
#include <string_view>
#include <type_traits>
#include <utility>

namespace memattn::detail {

/// The name a memory's messages start with ("KVCache"), for the checks its 16-bit front
/// makes itself (outputs overlapping inputs); each memory's header names its own.
template <class M>
inline constexpr std::string_view memory_name = "memory";

/// A memory that keeps every pair it is fed and can be cut back to any earlier length
/// (KVCache, a layer of them): a bulk call that fails midway truncates it back instead
/// of restoring a copy taken before.
template <class M>
inline constexpr bool keeps_every_pair = false;

/// Two float buffers a memory keeps for converting one step's rows, taken by one call at
/// a time (an atomic flag); a call that finds them taken converts through buffers of its
/// own. A copy gets buffers of the size they were built with (read from plain members,
/// not from buffers another thread's call may be growing) and a flag of its own.
class ConversionScratch {
public:
    ConversionScratch(Index rows, Index a_cols, Index b_cols)
        : rows_(rows), a_cols_(a_cols), b_cols_(b_cols), a_(rows, a_cols), b_(rows, b_cols) {}
    ConversionScratch(const ConversionScratch& other) : ConversionScratch(other.rows_, other.a_cols_, other.b_cols_) {}
    ConversionScratch(ConversionScratch&& other) noexcept
        : rows_(other.rows_), a_cols_(other.a_cols_), b_cols_(other.b_cols_), a_(std::move(other.a_)),
          b_(std::move(other.b_)) {}
    ConversionScratch& operator=(const ConversionScratch& other) {
        if (this != &other && (rows_ != other.rows_ || a_cols_ != other.a_cols_ || b_cols_ != other.b_cols_)) {
            // (the same shapes: this one's buffers kept, nothing to copy from a scratch)
            ConversionScratch copy(other);
            swap(copy);
        }
        return *this;
    }
    ConversionScratch& operator=(ConversionScratch&& other) noexcept {
        swap(other);
        return *this;
    }
    ~ConversionScratch() = default;

    /// f(a, b) with a an a_rows × a_cols and b a b_rows × b_cols float buffer: the kept
    /// ones when free (grown if too small), else new ones.
    template <class F>
    void with(Index a_rows, Index a_cols, Index b_rows, Index b_cols, F&& f) const {
        if (!busy_.test_and_set(std::memory_order_acquire)) {
            struct Release {
                std::atomic_flag& flag;
                ~Release() { flag.clear(std::memory_order_release); }
            } release{busy_};
            fit(a_, a_rows, a_cols);
            fit(b_, b_rows, b_cols);
            f(MatrixRef<float>(a_.topLeftCorner(a_rows, a_cols)), MatrixRef<float>(b_.topLeftCorner(b_rows, b_cols)));
        } else {
            Matrix<float> a(a_rows, a_cols), b(b_rows, b_cols);
            f(MatrixRef<float>(a), MatrixRef<float>(b));
        }
    }

private:
    void swap(ConversionScratch& other) noexcept {
        std::swap(rows_, other.rows_);
        std::swap(a_cols_, other.a_cols_);
        std::swap(b_cols_, other.b_cols_);
        a_.swap(other.a_);
        b_.swap(other.b_);
    }
    static void fit(Matrix<float>& m, Index rows, Index cols) {
        if (m.rows() < rows || m.cols() < cols)
            m.resize(std::max(m.rows(), rows), std::max(m.cols(), cols));
    }

    Index rows_, a_cols_, b_cols_;  // as built
    mutable Matrix<float> a_, b_;
    mutable std::atomic_flag busy_;
};

/// The widths of the rows a memory's update takes, 0 where it does not tell them.
template <class M>
Index key_width(const M& m) {
    if constexpr (KnowsDims<M>)
        return m.key_dim();
    else
        return 0;
}
template <class M>
Index value_width(const M& m) {
    if constexpr (KnowsDims<M>)
        return m.value_dim();
    else
        return 0;
}

/// The widths of the rows a memory's attend takes and gives: its query and output
/// widths where it tells them (a layer), else its key and value widths.
template <class M>
Index query_width(const M& m) {
    if constexpr (KnowsQueryDims<M>)
        return m.query_dim();
    else if constexpr (KnowsDims<M>)
        return m.key_dim();
    else
        return 0;
}
template <class M>
Index output_width(const M& m) {
    if constexpr (KnowsQueryDims<M>)
        return m.output_dim();
    else if constexpr (KnowsDims<M>)
        return m.value_dim();
    else
        return 0;
}

/// The memory of rows of E over the float memory Inner (see the top of the file): every
/// member of Inner, with the ones that take or give rows taking and giving E.
template <class Inner, LowPrecision E>
class LowPrecisionMemory : public Inner {
public:
    using Scalar = E;             ///< the rows' scalar (the arithmetic is float)
    using FloatMemory = Inner;    ///< the float memory inside, which every member not taking rows is
    /// Rows a bulk call (extend, prefill, validate) converts and runs at a time.
    static constexpr Index span_rows = 256;
    /// Rows of a validate that convert into the kept buffers (a step's, a small batch's),
    /// and rows a fixed-size memory's extend converts at a time.
    static constexpr Index step_rows = 8;

    using Inner::Inner;
    /// The memory of E rows over a float memory (its state kept).
    explicit LowPrecisionMemory(const Inner& memory) : Inner(memory) {}
    /// The same, the float memory moved in.
    explicit LowPrecisionMemory(Inner&& memory) : Inner(std::move(memory)) {}

    /// The float memory's grouped prefill (a layer's) takes float rows: not here.
    template <class... Args>
    void prefill_group(Args&&...) = delete;

    /// The float memory inside: its rows in float, the same state.
    [[nodiscard]] const Inner& float_memory() const noexcept { return *this; }

    /// Inner::update on the pair converted to float.
    void update(ConstRowRef<E> key, ConstRowRef<E> value) {
        scratch_.with(1, key.cols(), 1, value.cols(), [&](MatrixRef<float> k, MatrixRef<float> v) {
            k.row(0) = key.template cast<float>();
            v.row(0) = value.template cast<float>();
            Inner::update(k.row(0), v.row(0));
        });
    }

    /// Inner::attend on the query converted to float, the output rounded to E (unchanged
    /// when it throws).
    void attend(ConstRowRef<E> query, RowRef<E> out) const {
        if (overlap<E>(extent(out), extent(query))) [[unlikely]]
            require_disjoint(name("::attend"), "out", out, "query", query);
        scratch_.with(1, query.cols(), 1, out.cols(), [&](MatrixRef<float> q, MatrixRef<float> o) {
            q.row(0) = query.template cast<float>();
            Inner::attend(q.row(0), o.row(0));
            out = o.row(0).template cast<E>();
        });
    }

    /// Inner::attend_group on the queries converted to float, the outputs rounded to E.
    void attend_group(ConstMatrixRef<E> queries, MatrixRef<E> out) const
        requires HasGroupAttend<Inner>
    {
        if (overlap<E>(extent(out), extent(queries))) [[unlikely]]
            require_disjoint(name("::attend_group"), "out", out, "queries", queries);
        scratch_.with(queries.rows(), queries.cols(), out.rows(), out.cols(), [&](MatrixRef<float> q, MatrixRef<float> o) {
            q = queries.template cast<float>();
            Inner::attend_group(q, o);
            out = o.template cast<E>();
        });
    }

    /// Inner::validate on the pairs converted to float, a span at a time; a message names
    /// the row of `keys`/`values` the caller passed. A fixed-size memory's, and any of a
    /// step's few rows, convert step_rows at a time into the kept buffers: decode's and
    /// extend's checks allocate nothing.
    void validate(ConstMatrixRef<E> keys, ConstMatrixRef<E> values, const PairSite& site) const
        requires ValidatesPairs<Inner>
    {
        const Index n = keys.rows();
        if (!fits(keys, values)) {  // the shape message names the caller's shapes
            const Matrix<float> k = keys.template cast<float>(), v = values.template cast<float>();
            Inner::validate(k, v, site);
            return;
        }
        check_room(site.function, this->length(), n);  // for all n rows: the spans see only their own
        const auto check = [&](const ConstMatrixRef<float>& k, const ConstMatrixRef<float>& v, Index r0) {
            PairSite part = site;
            part.first_row += r0;
            Inner::validate(k, v, part);
        };
        if (!keeps_every_pair<Inner> || n <= step_rows) {
            const Index rows = std::min(n, step_rows);
            scratch_.with(rows, keys.cols(), rows, values.cols(), [&](MatrixRef<float> k, MatrixRef<float> v) {
                for (Index r0 = 0; r0 < n; r0 += step_rows) {
                    const Index m = std::min(step_rows, n - r0);
                    k.topRows(m) = keys.middleRows(r0, m).template cast<float>();
                    v.topRows(m) = values.middleRows(r0, m).template cast<float>();
                    check(k.topRows(m), v.topRows(m), r0);
                }
            });
            return;
        }
        Matrix<float> k, v;
        for (Index r0 = 0; r0 < n; r0 += span_rows) {
            const Index m = std::min(span_rows, n - r0);
            k = keys.middleRows(r0, m).template cast<float>();
            v = values.middleRows(r0, m).template cast<float>();
            check(k, v, r0);
        }
    }
    /// The same, the messages naming the memory's validate.
    void validate(ConstMatrixRef<E> keys, ConstMatrixRef<E> values) const
        requires ValidatesPairs<Inner>
    {
        const FunctionName function = name("::validate");
        validate(keys, values, PairSite{std::string_view(function)});
    }

    /// Inner::extend on the pairs converted to float, every row checked before any is
    /// fed, so a throw leaves the memory as it was. A memory that keeps every pair
    /// (KVCache) takes them span by span through buffers of the call; a fixed-size one
    /// step_rows at a time through the kept buffers, so, as its float memory, it
    /// allocates nothing.
    void extend(ConstMatrixRef<E> keys, ConstMatrixRef<E> values)
        requires HasBulkExtend<Inner>
    {
        const Index n = keys.rows();
        if (!fits(keys, values)) {  // Inner checks the shapes and throws, unchanged
            const Matrix<float> k = keys.template cast<float>(), v = values.template cast<float>();
            Inner::extend(k, v);
            return;
        }
        if constexpr (keeps_every_pair<Inner>) {
            if (n <= span_rows) {
                const Matrix<float> k = keys.template cast<float>(), v = values.template cast<float>();
                Inner::extend(k, v);
                return;
            }
            validate_spans(name("::extend"), keys, values);
            all_or_nothing([&] {
                Matrix<float> k, v;
                for (Index r0 = 0; r0 < n; r0 += span_rows) {
                    const Index m = std::min(span_rows, n - r0);
                    k = keys.middleRows(r0, m).template cast<float>();
                    v = values.middleRows(r0, m).template cast<float>();
                    Inner::extend(k, v);
                }
            });
        } else {
            if (n > step_rows)  // each step's rows are checked as Inner::extend takes them
                validate_spans(name("::extend"), keys, values);
            scratch_.with(step_rows, keys.cols(), step_rows, values.cols(), [&](MatrixRef<float> k, MatrixRef<float> v) {
                for (Index r0 = 0; r0 < n; r0 += step_rows) {
                    const Index m = std::min(step_rows, n - r0);
                    k.topRows(m) = keys.middleRows(r0, m).template cast<float>();
                    v.topRows(m) = values.middleRows(r0, m).template cast<float>();
                    Inner::extend(k.topRows(m), v.topRows(m));
                }
            });
        }
    }

    /// Inner::prefill on the rows converted to float, span by span (bitwise the float
    /// memory's prefill of each span in turn), the outputs rounded to E; `out` must not
    /// overlap the inputs. A throw leaves the memory as it was.
    void prefill(ConstMatrixRef<E> queries, ConstMatrixRef<E> keys, ConstMatrixRef<E> values, MatrixRef<E> out)
        requires HasBulkPrefill<Inner>
    {
        const Index n = keys.rows();
        if (overlap<E>(extent(out), extent(queries)) || overlap<E>(extent(out), extent(keys)) ||
            overlap<E>(extent(out), extent(values))) {
            const FunctionName function = name("::prefill");
            require_disjoint(function, "out", out, "queries", queries);
            require_disjoint(function, "out", out, "keys", keys);
            require_disjoint(function, "out", out, "values", values);
        }
        if (n <= span_rows || !fits(keys, values) || !fits_queries(queries, out, n)) {
            const Matrix<float> q = queries.template cast<float>(), k = keys.template cast<float>(),
                                v = values.template cast<float>();
            Matrix<float> o(out.rows(), out.cols());
            Inner::prefill(q, k, v, o);  // checks first, and throws with the caller's shapes
            out = o.template cast<E>();
            return;
        }
        validate_spans(name("::prefill"), keys, values);
        all_or_nothing([&] {
            Matrix<float> q, k, v, o(span_rows, out.cols());
            for (Index r0 = 0; r0 < n; r0 += span_rows) {
                const Index m = std::min(span_rows, n - r0);
                q = queries.middleRows(r0, m).template cast<float>();
                k = keys.middleRows(r0, m).template cast<float>();
                v = values.middleRows(r0, m).template cast<float>();
                MatrixRef<float> o_rows = o.topRows(m);
                Inner::prefill(q, k, v, o_rows);
                out.middleRows(r0, m) = o_rows.template cast<E>();
            }
        });
    }

private:
    /// "KVCache::extend", in a buffer of its own (no allocation).
    struct FunctionName {
        std::array<char, 96> text{};
        std::size_t size = 0;
        operator std::string_view() const noexcept { return {text.data(), size}; }
    };
    static FunctionName name(std::string_view member) noexcept {
        FunctionName f;
        for (const std::string_view part : {memory_name<Inner>, member})
            for (const char c : part)
                if (f.size < f.text.size())
                    f.text[f.size++] = c;
        return f;
    }

    /// K/V of the memory's widths and the same rows.
    bool fits(const ConstMatrixRef<E>& keys, const ConstMatrixRef<E>& values) const {
        if constexpr (KnowsDims<Inner>)
            return keys.rows() == values.rows() && keys.cols() == this->key_dim() && values.cols() == this->value_dim();
        else
            return false;
    }
    bool fits_queries(const ConstMatrixRef<E>& queries, const MatrixRef<E>& out, Index n) const {
        return queries.rows() == n && out.rows() == n && queries.cols() == query_width<Inner>(*this) &&
               out.cols() == output_width<Inner>(*this) && queries.cols() > 0;
    }

    /// The values of every span, before any span is fed (the shapes fit: see fits).
    void validate_spans(std::string_view function, const ConstMatrixRef<E>& keys, const ConstMatrixRef<E>& values) const {
        if constexpr (ValidatesPairs<Inner>)
            validate(keys, values, PairSite{std::string_view(function)});
    }

    /// Runs `feed`; if it throws (std::bad_alloc after the first span), the memory goes
    /// back to what it was: truncated for a memory that keeps every pair, else restored
    /// from a copy taken before.
    template <class Feed>
    void all_or_nothing(Feed&& feed) {
        if constexpr (keeps_every_pair<Inner>) {
            const Index before = this->length();
            try {
                feed();
            } catch (...) {
                Inner::truncate(before);
                throw;
            }
        } else {
            std::optional<Inner> before(std::in_place, static_cast<const Inner&>(*this));
            try {
                feed();
            } catch (...) {
                static_cast<Inner&>(*this) = std::move(*before);
                throw;
            }
        }
    }

    ConversionScratch scratch_{step_rows,
                               std::max(key_width<Inner>(*this), query_width<Inner>(*this)),
                               std::max(value_width<Inner>(*this), output_width<Inner>(*this))};
};

}  // namespace memattn::detail
