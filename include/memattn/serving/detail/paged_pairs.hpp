#pragma once
// The keys and values of a PagedKVCache's blocks (serving/paged_kv_cache.hpp) and what
// reads and writes them: the appends (copy-on-write of a shared last block), and the
// attends of one sequence, of a batch, of a decode step whose sequences share their first
// blocks (serving/cascade.hpp) and of a prefill's chunks (serving/paged_prefill.hpp).
// Which blocks a sequence holds is BlockTables' (serving/detail/block_tables.hpp).
//
// A block holds `block_size` tokens of every KV head: for block b, KV head h and slot t,
// the key is row (h·blocks + b)·block_size + t of one detail::StoredRows (in storage S),
// the value the same row of another.

#include "memattn/detail/assert.hpp"
#include "memattn/execution/executor.hpp"
#include "memattn/kernels/decode_attention.hpp"
#include "memattn/kernels/softmax_options.hpp"
#include "memattn/layer/head_layout.hpp"
#include "memattn/execution/parallel.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/serving/cascade.hpp"
#include "memattn/serving/detail/block_tables.hpp"
#include "memattn/serving/paged_prefill.hpp"
#include "memattn/softmax_state.hpp"
#include "memattn/storage/compact.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <cstddef>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace memattn::detail::paged {

/// The pairs of a pool's blocks and their attends; see the top of the file.
template <class T, class S>
class PagedPairs : protected BlockTables {
protected:
    /// Pairs × query heads × (head_dim + value_dim) of one attend below which it runs on
    /// the calling thread (as memattn::MultiHead's).
    static constexpr double parallel_work = 1 << 20;

    /// The blocks of `shape` for `layout`, with the scale and the logit options of
    /// `options` (copied), all checked by the pool (PagedKVCache::checked_shape); the
    /// number of rows is checked here. Allocates the whole pool.
    PagedPairs(const HeadLayout& layout, const PoolShape& shape, const SoftmaxOptions& options)
        : BlockTables(shape),
          layout_(layout),
          scale_(checked_scale(static_cast<T>(options.scale), layout.head_dim, "PagedKVCache")),
          softcap_(options.softcap),
          slopes_(options.alibi_slopes.begin(), options.alibi_slopes.end()),
          sink_logits_(options.sink_logits.begin(), options.sink_logits.end()),
          bf16_(options.fpmath == FpMath::bf16),
          keys_(pool_rows(), layout_.head_dim),
          values_(pool_rows(), layout_.values()) {
        keys_.advise_huge_pages();  // read end to end by every step (detail/huge_pages.hpp)
        values_.advise_huge_pages();
    }

    /// Rows of each of the two stores: blocks × kv_heads × block_size, checked.
    [[nodiscard]] Index pool_rows() const {
        return checked_product("PagedKVCache", "blocks", blocks_,
                                       checked_product("PagedKVCache", "block_size", block_size_,
                                                               layout_.kv_heads, "block_size x kv_heads"),
                                       "blocks x block_size x kv_heads");
    }
    [[nodiscard]] std::size_t block_bytes() const noexcept {
        return static_cast<std::size_t>(block_size_ * layout_.kv_heads) *
               (StoredRows<T, S>::row_bytes(layout_.head_dim) +
                StoredRows<T, S>::row_bytes(layout_.values()));
    }
    /// The first row of KV head h in block b: head-major, so a head's tokens in blocks
    /// b, b + 1, ... (a sequence's blocks, taken in order from a fresh pool) follow each
    /// other in memory and stream as one cache's would.
    [[nodiscard]] Index first_row(Index b, Index h) const noexcept { return (h * blocks_ + b) * block_size_; }

    /// Appends the rows of K/V to s, checked by validate (cannot throw). Returns the
    /// shared block a copy-on-write of its last block replaced (−1: none).
    template <class KRows, class VRows>
    Index append(State& s, const KRows& keys, const VRows& values) noexcept {
        const Index d = layout_.head_dim, dv = layout_.values();
        Index replaced = -1;
        if (keys.rows() > 0)
            s.drafts = 0;  // a pending tree's drafts are plain tokens from now on
        for (Index r = 0; r < keys.rows(); ++r) {
            const Index t = s.length % block_size_;
            if (t == 0) {
                s.table.push_back(take_block());  // within its capacity: every block
            } else if (refs_[static_cast<std::size_t>(s.table.back())] > 1) {  // copy-on-write
                const Index shared = s.table.back(), own = take_block();
                for (Index h = 0; h < layout_.kv_heads; ++h) {
                    keys_.copy_within(first_row(shared, h), first_row(own, h), t);
                    values_.copy_within(first_row(shared, h), first_row(own, h), t);
                }
                release(shared);
                s.table.back() = own;
                replaced = shared;
            }
            const Index b = s.table.back();
            for (Index h = 0; h < layout_.kv_heads; ++h) {
                keys_.put_rows(first_row(b, h) + t, keys.block(r, h * d, 1, d));
                values_.put_rows(first_row(b, h) + t, values.block(r, h * dv, 1, dv));
            }
            ++s.length;
        }
        return replaced;
    }

    /// The rows of the accepted chain `path` of s's pending drafts put in order (accept,
    /// its checks and blocks counted by path_copies): rows from the first that moves on
    /// are copied from their drafts, in every KV head, a block they lie in copied first
    /// when another sequence holds it. The caller truncates the rejected drafts.
    void keep_path(State& s, std::span<const Index> path) noexcept {
        const auto n = static_cast<Index>(path.size());
        const Index base = s.length - s.drafts, k0 = first_moved(path);
        // The blocks rows base + k0 .. base + n − 1 lie in, copied first when shared.
        const Index b0 = (base + k0) / block_size_, b1 = n > k0 ? (base + n - 1) / block_size_ + 1 : b0;
        for (Index b = b0; b < b1; ++b) {  // token blocks (a window's dropped ones lie before them)
            Index& block = s.table[table_index(s, b)];
            if (refs_[static_cast<std::size_t>(block)] == 1)
                continue;
            const Index own = take_block(), used = std::min(block_size_, s.length - b * block_size_);
            for (Index h = 0; h < layout_.kv_heads; ++h) {
                keys_.copy_within(first_row(block, h), first_row(own, h), used);
                values_.copy_within(first_row(block, h), first_row(own, h), used);
            }
            release(block);
            block = own;
        }
        const auto row = [&](Index token, Index h) {
            return first_row(block_of(s, token / block_size_), h) + token % block_size_;
        };
        for (Index k = k0; k < n; ++k)  // source draft path[k] ≥ k: never a row already written
            for (Index h = 0; h < layout_.kv_heads; ++h) {
                keys_.copy_within(row(base + path[static_cast<std::size_t>(k)], h), row(base + k, h), 1);
                values_.copy_within(row(base + path[static_cast<std::size_t>(k)], h), row(base + k, h), 1);
            }
    }

    /// PagedKVCache::read_sequence's checks and reads: a sequence of the payload's tokens
    /// in blocks it takes (PoolExhausted, naming `function`, when they are too few), not
    /// yet anyone's. Throws before it takes a block; cannot throw after.
    State read_state(const char* function, snapshot::Reader& r) {
        r.expect("q_heads", layout_.q_heads);
        r.expect("kv_heads", layout_.kv_heads);
        r.expect("head_dim", layout_.head_dim);
        r.expect("value_dim", layout_.values());
        r.expect("scale", scale_);
        r.expect("window", window_);
        r.expect("sinks", sinks_);
        const std::size_t token = static_cast<std::size_t>(layout_.kv_heads) *
                                  (StoredRows<T, S>::row_bytes(layout_.head_dim) +
                                   StoredRows<T, S>::row_bytes(layout_.values()));
        State loaded;
        loaded.length = r.count("length", 0, max_length);
        // first: the sinks when nothing was freed, else a token no later than the last query's window.
        const Index stored_first = window_ == 0 ? r.count("first", 0, 0)
                                                : r.count("first", sinks_, std::max(sinks_, loaded.length - window_));
        loaded.first = stored_first;
        const std::size_t pairs = static_cast<std::size_t>(held_tokens(loaded));  // capped: no overflow below
        r.expect_remaining(std::min(pairs, r.remaining() / token + 1) * token, "the pairs");
        // What this pool's window keeps of them: the tokens [stored_first, first) are skipped.
        loaded.first = kept_first(loaded.length, stored_first);
        const Index skipped = std::max<Index>(0, std::min(loaded.first, loaded.length) - stored_first);
        const Index sink = sink_blocks(), total = blocks_for(loaded.length);
        loaded.dropped = loaded.first < loaded.length ? std::max<Index>(0, loaded.first / block_size_ - sink) : 0;
        const Index held = total - loaded.dropped;
        require_free(function, held);
        loaded.table.reserve(static_cast<std::size_t>(blocks_));  // may throw: nothing changed yet
        for (Index i = 0; i < held; ++i)
            loaded.table.push_back(take_block());
        for (const bool values : {false, true}) {
            StoredRows<T, S>& rows = values ? values_ : keys_;
            const std::size_t row = StoredRows<T, S>::row_bytes(values ? layout_.values() : layout_.head_dim);
            for (Index h = 0; h < layout_.kv_heads; ++h) {
                for_each_run(loaded, 0, std::min(sinks_, loaded.length), [&](Index block, Index offset, Index count, Index) {
                    rows.read_rows(r, first_row(block, h) + offset, count);
                });
                r.skip(row * static_cast<std::size_t>(skipped), "the pairs the window frees");
                for_each_run(loaded, loaded.first, loaded.length, [&](Index block, Index offset, Index count, Index) {
                    rows.read_rows(r, first_row(block, h) + offset, count);
                });
            }
        }
        return loaded;
    }

    /// The attends of attend(seqs, Q, O, executor), after its checks.
    void attend_batch(std::span<const Index> seqs, ConstMatrixRef<T> queries, MatrixRef<T> out,
                      ExecutorRef executor) const {
        const auto state = [&](Index row) -> const State& {
            return sequences_[static_cast<std::size_t>(seqs[static_cast<std::size_t>(row)])];
        };
        attend_rows(
            queries.rows(), state, [&](Index row) { return state(row).length; }, queries.data(),
            queries.outerStride(), out.data(), out.outerStride(), executor);
    }

    /// The attends of prefill after its appends: every chunk of two rows or more through
    /// the tiled kernel over its blocks (serving/paged_prefill.hpp), a chunk of one row as
    /// a decode step (attend_head), a chunk of none not at all.
    void prefill_chunks(std::span<const Index> seqs, std::span<const Index> q_offsets, ConstMatrixRef<T> queries,
                        MatrixRef<T> out, ExecutorRef executor, std::span<const Index> parents = {}) {
        const Index g = layout_.group_size(), d = layout_.head_dim, dv = layout_.values();
        chunks_.clear();
        double work = 0;
        for (std::size_t i = 0; i < seqs.size(); ++i) {
            const Index rows = q_offsets[i + 1] - q_offsets[i];
            if (rows == 0)
                continue;
            const State& s = sequences_[static_cast<std::size_t>(seqs[i])];
            chunks_.push_back({static_cast<Index>(i), q_offsets[i], rows, s.length,
                               BlockTableView{s.table.data(), sink_blocks(), s.dropped, block_size_, blocks_, 0},
                               parents.empty() ? std::span<const Index>{}
                                               : parents.subspan(static_cast<std::size_t>(q_offsets[i]),
                                                                 static_cast<std::size_t>(rows))});
            work += static_cast<double>(rows) * static_cast<double>(visible_pairs(s.length));
        }
        work *= static_cast<double>(layout_.q_heads) * static_cast<double>(d + dv);
        const PagedOptions options{layout_, static_cast<double>(scale_), window_, sinks_, softcap_, slopes_,
                                   sink_logits_, bf16_};
        const Index ldq = queries.outerStride(), ldo = out.outerStride();
        paged_prefill<T, S>(
            options, keys_, values_, std::span<const PagedChunk>(chunks_), queries.data(), ldq, out.data(),
            ldo, prefill_work_, executor, work < parallel_work, [&](Index c, Index h) {
                const PagedChunk& chunk = chunks_[static_cast<std::size_t>(c)];
                const State& s = sequences_[static_cast<std::size_t>(seqs[static_cast<std::size_t>(chunk.sequence)])];
                attend_head(s, h, queries.data() + chunk.q_begin * ldq + h * g * d,
                            out.data() + chunk.q_begin * ldo + h * g * dv, s.length);
            });
    }

    /// The attends of a decode step (decode_batch): the sequences that share their first
    /// blocks read them once, together (serving/cascade.hpp); every other one as
    /// attend_batch reads it.
    void attend_decode(std::span<const Index> seqs, ConstMatrixRef<T> queries, MatrixRef<T> out,
                       ExecutorRef executor) {
        const Index rows = queries.rows(), g = layout_.group_size(), kv = layout_.kv_heads;
        const Index chunk = cascade_rows / g;
        const auto state = [&](Index r) -> const State& {
            return sequences_[static_cast<std::size_t>(seqs[static_cast<std::size_t>(r)])];
        };
        CascadeWork<T>& work = cascade_;
        if (window_ > 0 || !slopes_.empty() || chunk < 2 || rows < 2 ||
            !find_shared_runs(
                rows, block_size_, [&](Index r) { return std::span<const Index>(state(r).table); },
                [&](Index r) { return state(r).length; }, work.order, work.runs)) {
            attend_batch(seqs, queries, out, executor);
            return;
        }
        plan_cascade(rows, kv, chunk, work.order, work.runs, work.items);
        const auto cost = [&](Index i) {
            const CascadeItem& item = work.items[static_cast<std::size_t>(i)];
            if (item.run < 0)
                return 1.0 + static_cast<double>(state(item.row).length);
            const Index shared = work.runs[static_cast<std::size_t>(item.run)].blocks * block_size_;
            double pairs = 1.0 + static_cast<double>(shared);
            for (Index m = item.first; m < item.first + item.count; ++m)
                pairs += static_cast<double>(state(work.order[static_cast<std::size_t>(m)]).length - shared);
            return pairs;
        };
        double total = 0;
        for (Index r = 0; r < rows; ++r)
            total += static_cast<double>(state(r).length);
        const bool serial = total * static_cast<double>(layout_.q_heads) *
                                static_cast<double>(layout_.head_dim + layout_.values()) <
                            parallel_work;
        const auto n = static_cast<Index>(work.items.size());
        const auto parts = static_cast<std::size_t>(std::min<Index>({serial ? 1 : executor.concurrency(), n,
                                                                     max_ranges}));
        if (work.ranges.size() < parts)
            work.ranges.resize(parts);
        const T* q = queries.data();
        T* o = out.data();
        const Index ldq = queries.outerStride(), ldo = out.outerStride(), d = layout_.head_dim, dv = layout_.values();
        parallel_ranges(
            n, cost,
            [&](Index first, Index last, int range) {
                CascadeScratch<T>& scratch = work.ranges[static_cast<std::size_t>(range)];
                for (Index i = first; i < last; ++i) {
                    const CascadeItem& item = work.items[static_cast<std::size_t>(i)];
                    if (item.run >= 0) {
                        attend_shared(work.runs[static_cast<std::size_t>(item.run)].blocks,
                                      std::span<const Index>(work.order).subspan(static_cast<std::size_t>(item.first),
                                                                                 static_cast<std::size_t>(item.count)),
                                      item.head, seqs, q, ldq, o, ldo, scratch);
                        continue;
                    }
                    const State& s = state(item.row);
                    T* rows_out = o + item.row * ldo + item.head * g * dv;
                    if (s.length == 0)
                        std::fill(rows_out, rows_out + g * dv, T(0));
                    else
                        attend_head(s, item.head, q + item.row * ldq + item.head * g * d, rows_out, s.length);
                }
            },
            serial ? 1 : 0, executor);
    }

    /// KV head h of the batch rows `members` (a chunk of a shared run, at most
    /// cascade_rows / g sequences), whose sequences hold the same first `shared` blocks (no
    /// window, no ALiBi): their g·|members| queries fold the shared blocks block by block,
    /// in groups of group_rows (a block is read from memory once, then from cache for the
    /// next group), each sequence's g queries its own tokens, and the two partial states
    /// merge (the sink logits join after).
    void attend_shared(Index shared, std::span<const Index> members, Index h, std::span<const Index> seqs,
                       const T* q, Index ldq, T* out, Index ldo, CascadeScratch<T>& scratch) const {
        const Index g = layout_.group_size(), d = layout_.head_dim, dv = layout_.values();
        const Index rows = static_cast<Index>(members.size()) * g;
        const Index groups = (rows + group_rows - 1) / group_rows;
        MEMATTN_DASSERT(rows <= cascade_rows);
        if (scratch.queries.rows() < cascade_rows || scratch.queries.cols() != d)
            scratch.queries.resize(cascade_rows, d);
        if (scratch.acc.rows() < cascade_rows || scratch.acc.cols() != dv)
            scratch.acc.resize(cascade_rows, dv);
        using Rows = Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>>;
        using OutRows = Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>>;
        for (std::size_t m = 0; m < members.size(); ++m)
            scratch.queries.middleRows(static_cast<Index>(m) * g, g) =
                Rows(q + members[m] * ldq + h * g * d, g, d, Eigen::OuterStride<>(d));
        scratch.acc.topRows(rows).setZero();
        const std::size_t pair_bytes =
            StoredRows<T, S>::row_bytes(d) + StoredRows<T, S>::row_bytes(dv);
        const bool ahead = static_cast<std::size_t>(shared * block_size_) * pair_bytes >= group_prefetch_bytes;
        const auto group_of = [&](Index c) {
            const Index r0 = c * group_rows;
            return std::pair{r0, std::min(group_rows, rows - r0)};
        };
        for (Index c = 0; c < groups; ++c) {
            const auto [r0, n] = group_of(c);
            GroupAttention<T>& group = scratch.groups[static_cast<std::size_t>(c)].emplace(
                Rows(scratch.queries.data() + r0 * d, n, d, Eigen::OuterStride<>(d)), scale_, ahead,
                DecodeLogits{.softcap = softcap_, .bf16_products = bf16_});
            if (bf16_ && !group.rounds_queries()) {  // rounded here (the scratch's own copy)
                auto rows = scratch.queries.middleRows(r0, n);
                rows = rows.template cast<Eigen::bfloat16>().template cast<T>();
                group.requery(rows);
            }
        }
        const State& lead = sequences_[static_cast<std::size_t>(seqs[static_cast<std::size_t>(members[0])])];
        for (Index j = 0; j < shared; ++j) {  // a table's blocks need not be adjacent: one at a time
            const Index first = first_row(lead.table[static_cast<std::size_t>(j)], h);
            for (Index c = 0; c < groups; ++c) {
                const auto [r0, n] = group_of(c);
                scratch.groups[static_cast<std::size_t>(c)]->fold_stored(keys_, values_, first, block_size_,
                                                                         scratch.acc.middleRows(r0, n), j * block_size_);
            }
        }
        for (std::size_t m = 0; m < members.size(); ++m) {
            const State& s = sequences_[static_cast<std::size_t>(seqs[static_cast<std::size_t>(members[m])])];
            OutRows outputs(out + members[m] * ldo + h * g * dv, g, dv, Eigen::OuterStride<>(dv));
            outputs.setZero();
            const DecodeLogits own{
                .softcap = softcap_,
                .sinks = sink_logits_.empty() ? nullptr : sink_logits_.data() + h * g,
                .position = s.length - 1,
                .bf16_products = bf16_};
            const Index begin = shared * block_size_;
            const Rows queries(q + members[m] * ldq + h * g * d, g, d, Eigen::OuterStride<>(d));
            GroupAttention<T> alone(queries, scale_,
                                    static_cast<std::size_t>(s.length - begin) * pair_bytes >= group_prefetch_bytes,
                                    own);
            if (bf16_ && !alone.rounds_queries())
                alone.requery(scratch.rounded.rounded(queries));
            for_each_run(s, begin, s.length, [&](Index block, Index offset, Index count, Index token) {
                alone.fold_stored(keys_, values_, first_row(block, h) + offset, count, outputs, token);
            });
            for (Index r = 0; r < g; ++r) {
                SoftmaxState<T> state = alone.state(r);
                const Index row = static_cast<Index>(m) * g + r;
                state.merge(scratch.groups[static_cast<std::size_t>(row / group_rows)]->state(
                                row % group_rows),
                            outputs.row(r), scratch.acc.row(row));
                GroupAttention<T>::finish_state(state, own, r, outputs.row(r));
            }
        }
    }

    /// Every attend: for rows r < rows, the query heads of row r of q (stride ldq) over the
    /// first visible(r) tokens of state(r) into row r of out (zero when none), as
    /// (row, KV head) items spread over the executor's threads by their lengths; a step
    /// whose work is below parallel_work stays on the calling thread.
    template <class StateOf, class Visible>
    void attend_rows(Index rows, const StateOf& state, const Visible& visible, const T* q, Index ldq, T* out, Index ldo,
                     ExecutorRef executor) const {
        const Index g = layout_.group_size(), kv = layout_.kv_heads, dv = layout_.values();
        double work = 0;
        for (Index row = 0; row < rows; ++row)
            work += static_cast<double>(visible_pairs(visible(row)));
        work *= static_cast<double>(layout_.q_heads) * static_cast<double>(layout_.head_dim + dv);
        parallel_ranges(
            rows * kv, [&](Index item) { return 1.0 + static_cast<double>(visible_pairs(visible(item / kv))); },
            [&](Index first, Index last) {
                for (Index item = first; item < last; ++item) {
                    const Index row = item / kv, h = item % kv, n = visible(row);
                    T* o = out + row * ldo + h * g * dv;
                    if (n == 0)
                        std::fill(o, o + g * dv, T(0));
                    else
                        attend_head(state(row), h, q + row * ldq + h * g * layout_.head_dim, o, n);
                }
            },
            work < parallel_work ? 1 : 0, executor);
    }

    /// KV head h's group of query heads (g rows of q, g rows of out) over what the query
    /// at position length − 1 of s sees (length ≥ 1): every token, or, past a window,
    /// the sinks and then the window. Without a window, or with one the length has not
    /// passed, what the attend gave when s held only those tokens, bit for bit (the blocks
    /// hold the same rows).
    void attend_head(const State& s, Index h, const T* q, T* out, Index length) const {
        const Index g = layout_.group_size(), d = layout_.head_dim, dv = layout_.values();
        const Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>> queries(q, g, d, Eigen::OuterStride<>(d));
        Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>> outputs(out, g, dv, Eigen::OuterStride<>(dv));
        const bool ahead = static_cast<std::size_t>(visible_pairs(length)) *
                               (StoredRows<T, S>::row_bytes(d) + StoredRows<T, S>::row_bytes(dv)) >=
                           group_prefetch_bytes;
        const Index window_begin = length - window_;
        const bool whole = window_ == 0 || window_begin <= sinks_;
        std::optional<QueryBuffer<T>> rounded;
        for (Index r0 = 0; r0 < g; r0 += group_rows) {
            const Index rows = std::min(group_rows, g - r0);
            auto acc = outputs.middleRows(r0, rows);
            acc.setZero();
            const DecodeLogits logits{
                .softcap = softcap_,
                .slopes = slopes_.empty() ? nullptr : slopes_.data() + h * g + r0,
                .sinks = sink_logits_.empty() ? nullptr : sink_logits_.data() + h * g + r0,
                .position = length - 1,
                .bf16_products = bf16_};
            GroupAttention<T> group(queries.middleRows(r0, rows), scale_, ahead, logits);
            if (bf16_ && !group.rounds_queries())  // FpMath::bf16 without fold_bf16: rounded here, as a cache's
                group.requery((rounded ? *rounded : rounded.emplace()).rounded(queries.middleRows(r0, rows)));
            const auto fold = [&](Index block, Index offset, Index count, Index token) {
                group.fold_stored(keys_, values_, first_row(block, h) + offset, count, acc, token);
            };
            if (whole) {
                for_each_run(s, 0, length, fold);
            } else {
                for_each_run(s, 0, sinks_, fold);
                for_each_run(s, window_begin, length, fold);
            }
            for (Index r = 0; r < rows; ++r)
                group.finish(r, acc.row(r));
        }
    }

    HeadLayout layout_;
    T scale_;
    double softcap_;
    std::vector<double> slopes_, sink_logits_;  // per query head, or none
    bool bf16_;                                 // FpMath::bf16 (bf16_products<T, S>)
    StoredRows<T, S> keys_, values_;
    std::vector<PagedChunk> chunks_;    // prefill's chunks, kept for the next call
    PagedPrefillWork<T> prefill_work_;  // prefill's items and scratch, likewise
    CascadeWork<T> cascade_;            // a decode step's shared runs, items and scratch, likewise
};

}  // namespace memattn::detail::paged
