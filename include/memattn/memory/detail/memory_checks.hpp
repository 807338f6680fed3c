#pragma once
// The always-on shape checks at the entry points of the fixed-size memories, so every
// memory words its std::invalid_argument the same way: function, argument, shapes.

#include "memattn/softmax_state.hpp"
#include "memattn/types.hpp"

#include <cmath>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>

namespace memattn::detail {

/// A memory holding `length` tokens may take `added` more: no memory counts past
/// memattn::max_length, so no position it derives can overflow. Throws std::length_error.
inline void check_room(std::string_view function, Index length, Index added) {
    if (added > max_length - length) [[unlikely]]
        throw std::length_error("memattn::" + std::string(function) + ": the memory holds " + std::to_string(length) +
                                " tokens and would pass memattn::max_length = 2^62 with " + std::to_string(added) +
                                " more; reset() it");
}

/// What every memory's validate() checks first: keys n × key_dim and values n × value_dim
/// under the names `site` gives, and room for n more tokens after `length`.
inline void check_site_pairs(const PairSite& site, Shape keys, Shape values, Index key_dim, Index value_dim,
                             Index length) {
    require(keys.cols == key_dim, site.function, site.key_name, "has shape ", keys, ", expected ", key_dim,
            " columns (key_dim)");
    require(values.cols == value_dim && values.rows == keys.rows, site.function, site.value_name, "has shape ",
            values, ", expected ", keys.rows, 'x', value_dim, " (", site.key_name, " is ", keys, ")");
    check_room(site.function, length, keys.rows);
}

/// One query 1 × key_dim and its output 1 × value_dim, which must not overlap it.
template <class T>
void check_query(const char* function, const ConstRowRef<T>& query, const RowRef<T>& out, Index key_dim,
                 Index value_dim) {
    require(query.cols() == key_dim, function, "query", "has shape ", shape(query), ", expected 1x", key_dim);
    require(out.cols() == value_dim, function, "out", "has shape ", shape(out), ", expected 1x", value_dim);
    require_disjoint(function, "out", out, "query", query);
}

/// Queries g × key_dim and their outputs g × value_dim (attend_group), not overlapping.
template <class T>
void check_group_query(const char* function, const ConstMatrixRef<T>& queries, const MatrixRef<T>& out,
                       Index key_dim, Index value_dim) {
    require(queries.cols() == key_dim, function, "queries", "has shape ", shape(queries), ", expected ",
            queries.rows(), 'x', key_dim);
    require(out.rows() == queries.rows() && out.cols() == value_dim, function, "out", "has shape ", shape(out),
            ", expected ", queries.rows(), 'x', value_dim, " (queries is ", shape(queries), ")");
    require_disjoint(function, "out", out, "queries", queries);
}

/// A memory's own prefill: queries n × key_dim and out n × value_dim beside keys/values
/// already checked, out overlapping none of them.
template <class T>
void check_prefill(const char* function, const ConstMatrixRef<T>& queries, const ConstMatrixRef<T>& keys,
                   const ConstMatrixRef<T>& values, const MatrixRef<T>& out, Index key_dim, Index value_dim) {
    require(queries.rows() == keys.rows() && queries.cols() == key_dim, function, "queries", "has shape ",
            shape(queries), ", expected ", keys.rows(), 'x', key_dim);
    require(out.rows() == keys.rows() && out.cols() == value_dim, function, "out", "has shape ", shape(out),
            ", expected ", keys.rows(), 'x', value_dim);
    require_disjoint(function, "out", out, "queries", queries);
    require_disjoint(function, "out", out, "keys", keys);
    require_disjoint(function, "out", out, "values", values);
}

/// The offsets of a mixed batch: `batch` + 1 entries, from 0 to `rows`, never
/// decreasing, so sequence i brings rows [offsets[i], offsets[i + 1]).
inline void check_offsets(std::string_view function, std::span<const Index> offsets, Index batch, Index rows) {
    require(static_cast<Index>(offsets.size()) == batch + 1, function, "q_offsets", "has ", offsets.size(),
            " entries, expected ", batch + 1, " (one more than the sequences)");
    require(offsets.front() == 0 && offsets.back() == rows, function, "q_offsets", "runs from ", offsets.front(),
            " to ", offsets.back(), ", expected 0 to ", rows, " (the rows of K)");
    for (std::size_t i = 0; i + 1 < offsets.size(); ++i)
        require(offsets[i] <= offsets[i + 1], function, "q_offsets", "decreases at ", i, ": ", offsets[i], " then ",
                offsets[i + 1]);
}

/// A constructor's integer argument, at least `least`.
inline Index at_least(Index value, Index least, const char* function, const char* argument) {
    require(value >= least, function, argument, "is ", value, ", expected >= ", least);
    return value;
}

/// Whether `rows` (a key or value given to update or extend) share memory with one of a
/// memory's own matrices, which the update writes before it has read them all.
template <class Rows, class... Own>
bool views_own(const Rows& rows, const Own&... own) {
    const Extent e = extent(rows);
    return (overlap<typename Rows::Scalar>(e, extent(own)) || ...);
}

/// A softmax memory's `scale`: finite, and 0 resolved to 1/sqrt(key_dim).
template <class T>
T checked_scale(T scale, Index key_dim, const char* function) {
    require(std::isfinite(scale), function, "scale", "is ", scale, ", expected a finite number (0: 1/sqrt(key_dim))");
    return resolve_scale(scale, key_dim);
}

}  // namespace memattn::detail
