// Fuzzing the paged pool: a sequence of pool operations (add, fork, extend, truncate,
// remove, attend, batched decode and prefill, a sequence's snapshot saved and loaded into
// a pool of another block size and back into this one) on a small PagedKVCache, with or
// without a sliding window and sinks, with or without ALiBi, beside a model of it (each live sequence's
// tokens). After every operation the lengths and block counts must agree with the model,
// an operation that throws (PoolExhausted) must change nothing, an attend must equal the
// double reference of the sequence's tokens, a rollback the window has made impossible
// must be refused with nothing changed (one within the pool's rollback room never is),
// a verify step's drafts must each equal the reference of the sequence and its ancestors
// (each at its depth's position, windowed: one within the rollback room is never refused),
// and an accept must leave the path's tokens (a fork's copy of the drafts untouched),
// and a windowed sequence must never hold more blocks than its window (and room) needs,
// in either pool; at the end every block must be free
// again. A second mode runs batched prefill and decode on pools long enough that their
// attends go through the executor, one that fails part way: every sequence must be as it
// was (its snapshot, the free blocks), and the same call on a working executor must then
// give what a pool that never saw the failure gives, bit for bit. A third runs a
// ModelCache beside independent pools (model_cache below). A fourth runs a StatePool
// of delta-rule memories with checkpoints and draft states beside memories of its own
// (state_pool below): steps, verify steps of draft trees, accept, reject, truncate to
// checkpoints, bit for bit.
#include "fuzz_input.hpp"

#include <memattn/memattn.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace memattn;
using reference::MatrixD;

void fail(const char* what) {
    std::fprintf(stderr, "pool_fuzz: %s\n", what);
    std::abort();
}

/// Every query head of q over the tokens (packed rows) in double.
MatrixD expected_attend(const HeadLayout& layout, const Matrix<float>& q, const std::vector<Matrix<float>>& tokens,
                        const SoftmaxOptions& options) {
    const Index d = layout.head_dim, g = layout.group_size(), n = static_cast<Index>(tokens.size());
    MatrixD out = MatrixD::Zero(1, layout.q_heads * d);
    if (n == 0)
        return out;
    MatrixD K(n, layout.kv_heads * d), V(n, layout.kv_heads * d);
    for (Index i = 0; i < n; ++i) {
        K.row(i) = tokens[static_cast<std::size_t>(i)].row(0).cast<double>();
        V.row(i) = tokens[static_cast<std::size_t>(i)].row(1).cast<double>();
    }
    for (Index h = 0; h < layout.q_heads; ++h) {
        reference::Logits logits{.window = options.window, .sink_tokens = options.sink_tokens};
        if (!options.alibi_slopes.empty())
            logits.slope = options.alibi_slopes[static_cast<std::size_t>(h)];
        out.middleCols(h * d, d) = reference::softmax_attention(q.cast<double>().middleCols(h * d, d),
                                                                K.middleCols(h / g * d, d), V.middleCols(h / g * d, d),
                                                                logits)
                                       .out;
    }
    return out;
}

/// The blocks a windowed sequence may hold in a pool of blocks of `block` (all without a window).
Index most_blocks(Index window, Index sinks, Index block, Index blocks) {
    return window == 0 ? blocks : (sinks + block - 1) / block + (window + block - 1) / block + 1;
}

/// A user's executor that runs `runs` items of a parallel_for, then throws.
struct FailingExecutor {
    Index runs = 0;
    [[nodiscard]] int concurrency() const { return 4; }
    template <class F>
    void parallel_for(Index n, F&& f) const {
        for (Index i = 0; i < std::min(n, runs); ++i)
            f(i);
        throw std::runtime_error("the executor failed");
    }
};

/// Each sequence's snapshot and the free blocks: what a call that fails must leave.
std::vector<std::string> pool_state(PagedKVCache<float>& pool, const std::vector<Index>& seqs) {
    std::vector<std::string> state;
    for (const Index seq : seqs) {
        auto view = pool.sequence(seq);
        std::stringstream stream;
        memattn::save(view, stream);
        state.push_back(stream.str());
        state.push_back(std::to_string(pool.blocks_of(seq)));
    }
    state.push_back(std::to_string(pool.free_blocks()));
    return state;
}

/// The second mode (see the top of the file): pools whose attends reach the executor.
void failing_executor(fuzz::FuzzInput& in) {
    const HeadLayout layout{8, 2, 16};  // q_heads·(head_dim + value_dim) = 256 per pair
    // A window just shorter than the first sequence, so its attends still pass parallel_work.
    const Index block = in.size(1, 32), window = in.flag() ? 0 : in.size(4097, 4160), sinks = in.size(0, 4);
    const SoftmaxOptions options{.window = window, .sink_tokens = sinks};
    const Index count = in.size(1, 4), kw = layout.kv_heads * layout.head_dim;
    const auto make = [&](PagedKVCache<float>& pool, const Matrix<float>& K, const Matrix<float>& V,
                          const std::vector<Index>& lengths, const std::vector<Index>& parents) {
        std::vector<Index> seqs;
        for (std::size_t i = 0; i < lengths.size(); ++i) {
            const Index seq = parents[i] < 0 ? pool.add_sequence() : pool.fork(seqs[static_cast<std::size_t>(parents[i])]);
            pool.extend(seq, K.topRows(lengths[i]), V.topRows(lengths[i]));
            seqs.push_back(seq);
        }
        return seqs;
    };
    std::vector<Index> lengths, parents;
    for (Index i = 0; i < count; ++i) {
        lengths.push_back(in.size(0, 40));
        parents.push_back(i > 0 && in.flag() ? in.size(0, i - 1) : -1);
    }
    lengths[0] = 4100 + in.size(0, 40);  // its attends alone pass PagedKVCache::parallel_work
    const Index blocks = 8 + 4200 / block * 2;
    const Matrix<float> K = in.matrix<float>(4300, kw, 1.0), V = in.matrix<float>(4300, kw, 1.0);
    PagedKVCache<float> pool(layout, blocks, block, options), fresh(layout, blocks, block, options);
    const std::vector<Index> seqs = make(pool, K, V, lengths, parents), same = make(fresh, K, V, lengths, parents);
    const std::vector<std::string> before = pool_state(pool, seqs);
    const bool decode = in.flag();
    std::vector<Index> offsets{0};
    for (Index i = 0; i < count; ++i)
        offsets.push_back(offsets.back() + (decode ? 1 : in.size(i == 0 ? 1 : 0, 5)));
    const Index rows = offsets.back();
    const Matrix<float> Q = in.matrix<float>(rows, pool.query_dim(), 1.0), Kn = in.matrix<float>(rows, kw, 1.0),
                        Vn = in.matrix<float>(rows, kw, 1.0);
    Matrix<float> O(rows, pool.output_dim()), expected(rows, pool.output_dim());
    const FailingExecutor failing{in.size(0, 3)};
    bool threw = false;
    try {
        if (decode)
            batched_decode(pool, seqs, Q, Kn, Vn, O, failing);
        else
            batched_prefill(pool, seqs, offsets, Q, Kn, Vn, O, failing);
    } catch (const std::runtime_error&) {
        threw = true;
    }
    if (!threw)
        fail("a call through the failing executor did not throw");
    if (pool_state(pool, seqs) != before)
        fail("a call whose executor threw changed the pool");
    const SerialExecutor serial;
    if (decode) {
        batched_decode(pool, seqs, Q, Kn, Vn, O, serial);
        batched_decode(fresh, same, Q, Kn, Vn, expected, serial);
    } else {
        batched_prefill(pool, seqs, offsets, Q, Kn, Vn, O, serial);
        batched_prefill(fresh, same, offsets, Q, Kn, Vn, expected, serial);
    }
    if (!(O.array() == expected.array()).all() || pool.free_blocks() != fresh.free_blocks())
        fail("after a failed call, a call differs from the pool's that never failed");
}

/// The third mode: a ModelCache of one to three layers of their own (layouts, blocks,
/// windows, rollback room) beside independent pools taking the same calls. After every
/// operation each layer must equal its pool (lengths, blocks), a step's outputs its
/// pool's bit for bit, a refused plan or truncate or rollback must change nothing, and a
/// removed id must be refused for good.
void model_cache(fuzz::FuzzInput& in) {
    std::vector<ModelLayer> specs;
    const Index layers = in.size(1, 3);
    for (Index l = 0; l < layers; ++l) {
        const Index kv = in.size(1, 2), window = in.size(0, 9);
        specs.push_back({.layout = {kv * in.size(1, 2), kv, in.size(1, 4)},
                         .blocks = in.size(1, 16),
                         .block_size = in.size(1, 6),
                         .options = {.window = window, .sink_tokens = in.size(0, 3)},
                         .pool = {.rollback_tokens = window > 0 ? in.size(0, 4) : 0}});
    }
    ModelCache<float> cache(specs);
    std::vector<PagedKVCache<float>> pools;
    for (const ModelLayer& l : specs)
        pools.emplace_back(l.layout, l.blocks, l.block_size, l.options, l.pool);
    std::vector<Index> live, dead;
    const auto pick = [&]() { return live[static_cast<std::size_t>(in.size(0, static_cast<Index>(live.size()) - 1))]; };
    const auto agree = [&](const char* what) {
        for (Index l = 0; l < layers; ++l) {
            const auto& mine = cache.layer(l);
            const auto& own = pools[static_cast<std::size_t>(l)];
            if (mine.blocks_in_use() != own.blocks_in_use() || mine.sequences() != own.sequences())
                fail(what);
            for (const Index id : live)
                if (mine.length(cache.slot_of(id)) != own.length(cache.slot_of(id)))
                    fail(what);
        }
        for (const Index id : dead)
            if (cache.contains(id))
                fail("a removed id is live again");
    };
    const Index steps = in.size(0, 40);
    for (Index op = 0; op < steps; ++op) {
        const Index kind = live.empty() ? 0 : in.size(0, 6);
        if (kind == 6) {  // a sequence's snapshot across every layer, loaded into another (or itself)
            const Index from = pick(), to = pick();
            std::vector<std::byte> bytes(snapshot_size(cache.sequence(from)));
            save(cache.sequence(from), bytes);
            std::vector<Index> in_use;
            for (Index l = 0; l < layers; ++l)
                in_use.push_back(cache.layer(l).blocks_in_use());
            const Index before = cache.length(to);
            auto target = cache.sequence(to);
            try {
                load(target, std::span<const std::byte>(bytes));
            } catch (const PoolExhausted&) {
                for (Index l = 0; l < layers; ++l)
                    if (cache.layer(l).blocks_in_use() != in_use[static_cast<std::size_t>(l)])
                        fail("a refused load changed a layer");
                if (cache.length(to) != before)
                    fail("a refused load changed the sequence");
                agree("after a refused load");
                continue;
            }
            for (Index l = 0; l < layers; ++l) {  // every layer could take it: so does each pool
                auto& own = pools[static_cast<std::size_t>(l)];
                std::vector<std::byte> part(snapshot_size(own.sequence(cache.slot_of(from))));
                save(own.sequence(cache.slot_of(from)), part);
                auto mine = own.sequence(cache.slot_of(to));
                load(mine, std::span<const std::byte>(part));
            }
        } else if (kind == 0 && live.size() < 5) {
            const Index id = cache.add_sequence();
            for (auto& p : pools)
                if (p.add_sequence() != cache.slot_of(id))
                    fail("a layer's slot differs from its pool's");
            live.push_back(id);
        } else if (kind == 1 && live.size() < 5) {
            const Index parent = pick(), id = cache.fork(parent);
            for (auto& p : pools)
                if (p.fork(cache.slot_of(parent)) != cache.slot_of(id))
                    fail("a fork's slot differs from its pool's");
            live.push_back(id);
        } else if (kind == 2) {
            const Index id = pick(), slot = cache.slot_of(id);
            cache.remove(id);
            for (auto& p : pools)
                p.remove(slot);
            live.erase(std::find(live.begin(), live.end(), id));
            dead.push_back(id);
            bool refused = false;
            try {
                (void)cache.length(id);
            } catch (const std::invalid_argument&) {
                refused = true;
            }
            if (!refused)
                fail("a removed id was not refused");
        } else if (kind == 3) {
            const Index id = pick(), slot = cache.slot_of(id), tokens = in.size(0, cache.length(id));
            bool all = true;
            for (const auto& p : pools)
                all = all && p.can_truncate(slot, tokens);
            if (cache.can_truncate(id, tokens) != all)
                fail("can_truncate differs from the layers'");
            try {
                cache.truncate(id, tokens);
                for (auto& p : pools)
                    p.truncate(slot, tokens);
            } catch (const std::invalid_argument&) {
                if (all)
                    fail("a truncate every layer could take was refused");
            }
        } else {  // a step: chunks of 0 to 3 rows (or one token each), run by a prefix of the layers or all
            std::vector<Index> ids, offsets{0};
            const bool decode = in.flag();
            for (const Index id : live)
                if (in.flag()) {
                    ids.push_back(id);
                    offsets.push_back(offsets.back() + (decode ? 1 : in.size(0, 3)));
                }
            std::vector<Index> before;
            for (const auto& p : pools)
                before.push_back(p.blocks_in_use());
            const ModelCache<float>::Step* step = nullptr;
            try {
                step = decode ? &cache.plan_decode(ids) : &cache.plan(ids, offsets);
            } catch (const PoolExhausted&) {
                for (Index l = 0; l < layers; ++l)
                    if (cache.layer(l).blocks_in_use() != before[static_cast<std::size_t>(l)])
                        fail("a refused plan changed a layer");
                agree("after a refused plan");
                continue;
            }
            std::vector<Index> lengths;  // before the step
            for (const Index id : ids)
                lengths.push_back(cache.length(id));
            const Index reached = in.flag() ? in.size(0, layers) : layers;
            const auto run_layer = [&](Index l, const char* what) {  // the cache's layer l and its pool, bit for bit
                PagedKVCache<float>& own = pools[static_cast<std::size_t>(l)];
                const Index rows = step->rows();
                const Matrix<float> Q = in.matrix<float>(rows, own.query_dim(), 2.0),
                                    K = in.matrix<float>(rows, own.key_dim(), 2.0),
                                    V = in.matrix<float>(rows, own.value_dim(), 2.0);
                Matrix<float> O(rows, own.output_dim()), expected(rows, own.output_dim());
                if (decode) {
                    cache.decode(l, *step, Q, K, V, O);
                    batched_decode(own, step->slots(), Q, K, V, expected);
                } else {
                    cache.prefill(l, *step, Q, K, V, O);
                    batched_prefill(own, step->slots(), step->q_offsets(), Q, K, V, expected);
                }
                if (!(O.array() == expected.array()).all())
                    fail(what);
            };
            for (Index l = 0; l < reached; ++l)
                run_layer(l, "a layer's step differs from its pool's");
            if (reached < layers) {  // the step stopped part way
                // Maybe one of its sequences is removed now: the step goes on for the others
                // (its slot kept in the cache's layers until the step ends; the same pools
                // drop it then).
                std::vector<bool> gone(ids.size(), false);
                std::vector<Index> gone_slots;
                if (!ids.empty() && in.flag()) {
                    const auto k = static_cast<std::size_t>(in.size(0, static_cast<Index>(ids.size()) - 1));
                    gone[k] = true;
                    gone_slots.push_back(step->slots()[k]);
                    cache.remove(ids[k]);
                    live.erase(std::find(live.begin(), live.end(), ids[k]));
                    dead.push_back(ids[k]);
                    if (cache.contains(ids[k]))
                        fail("a removed id of a running step is live");
                    // (before any layer has run it, a remove ends the step: its lengths are stale)
                    if (cache.step_pending() != (reached > 0 && ids.size() > 1))
                        fail("a step with a sequence left ended, or one without any went on");
                }
                const auto drop_gone = [&] {
                    for (const Index slot : gone_slots)
                        for (auto& p : pools)
                            p.remove(slot);
                };
                if (!cache.step_pending()) {  // its only sequence removed: the step ended
                    drop_gone();
                } else if (!gone_slots.empty() && in.flag()) {  // run it in the rest of the layers
                    for (Index l = reached; l < layers; ++l)
                        run_layer(l, "a layer's step differs from its pool's after a removal");
                    if (cache.step_pending())
                        fail("a step run in every layer is still pending");
                    drop_gone();
                } else {  // take it back
                    bool can = true;
                    for (Index l = 0; l < reached; ++l)
                        for (std::size_t i = 0; i < ids.size(); ++i)
                            can = can && (gone[i] || pools[static_cast<std::size_t>(l)].can_truncate(
                                                         step->slots()[i], lengths[i]));
                    try {
                        cache.rollback(*step);
                        for (Index l = 0; l < reached; ++l)
                            for (std::size_t i = 0; i < ids.size(); ++i)
                                if (!gone[i])
                                    pools[static_cast<std::size_t>(l)].truncate(step->slots()[i], lengths[i]);
                        drop_gone();
                    } catch (const std::invalid_argument&) {
                        if (can)
                            fail("a rollback every layer could take was refused");
                        // Refused, nothing changed: the layers not reached are behind; remove the
                        // step's sequences (the last one removed ends the step, every slot freed).
                        for (std::size_t i = 0; i < ids.size(); ++i) {
                            if (gone[i])
                                continue;
                            const Index slot = cache.slot_of(ids[i]);
                            cache.remove(ids[i]);
                            gone_slots.push_back(slot);
                            live.erase(std::find(live.begin(), live.end(), ids[i]));
                            dead.push_back(ids[i]);
                        }
                        if (cache.step_pending())
                            fail("a step whose sequences were all removed is still pending");
                        drop_gone();
                    }
                }
            }
        }
        agree("a layer differs from its pool");
    }
}

/// The fourth mode: a StatePool<DeltaRuleMemory<float>> (d, dv, gated or not, checkpoints
/// every n tokens in a ring of k, m draft states) beside a model per live sequence: its
/// memory fed the same pieces, every checkpoint it has passed in its current history, and
/// its pending drafts' states (each its parent's decoded by its token). After every
/// operation lengths, pending drafts and free draft states must agree and an attend must
/// equal the model's bit for bit; a verify step's outputs must be the model's path
/// decodes bit for bit, a refused call (a full pool, too few draft states, an executor
/// that fails) must change nothing, and a truncate to checkpoint_before must restore the
/// model's state of that length.
void state_pool(fuzz::FuzzInput& in) {
    using Mem = DeltaRuleMemory<float>;
    const Index d = in.size(1, 5), dv = in.size(1, 5);
    const bool gated = in.flag();
    const Mem prototype(d, dv, {.qk_l2norm = in.flag()}, gated);
    const Index every = in.size(0, 4), ring = in.size(1, 3), drafts = in.size(0, 8), capacity = in.size(1, 4);
    StatePool<Mem> pool(capacity, prototype, {.checkpoint_tokens = every, .checkpoints = ring, .draft_states = drafts});
    const Index kw = prototype.key_dim();
    struct Model {
        Mem state;
        std::map<Index, Mem> saved;   // the checkpoints of its current history
        std::deque<Index> ring;       // the lengths the pool's ring holds, oldest first
        std::vector<Index> parents;   // pending drafts
        std::vector<Mem> draft_states;
    };
    std::map<Index, Model> model;
    const auto keys = [&](Index n) {  // [k | β | log g], β ‖k‖² ≤ 1: the state stays bounded
        Matrix<float> k = in.matrix<float>(n, kw, 2.0);
        k.leftCols(d) *= 0.5f / std::sqrt(static_cast<float>(d));
        for (Index r = 0; r < n; ++r) {
            k(r, d) = std::abs(k(r, d)) / 2.0f;
            if (gated)
                k(r, d + 1) = -std::abs(k(r, d + 1));
        }
        return k;
    };
    const auto keep = [&](Model& m) {
        if (every > 0 && m.state.length() > 0 && m.state.length() % every == 0) {
            m.saved.insert_or_assign(m.state.length(), m.state);
            m.ring.push_back(m.state.length());
            if (static_cast<Index>(m.ring.size()) > ring)
                m.ring.pop_front();
        }
    };
    const auto pending_total = [&] {
        Index total = 0;
        for (const auto& [id, m] : model)
            total += static_cast<Index>(m.parents.size());
        return total;
    };
    const auto check = [&](const char* what) {
        if (pool.sequences() != static_cast<Index>(model.size()) || pool.free_draft_states() != drafts - pending_total())
            fail(what);
        for (const auto& [id, m] : model) {
            if (pool.length(id) != m.state.length() ||
                pool.pending_drafts(id) != static_cast<Index>(m.parents.size()))
                fail(what);
            for (Index t = 0; t < m.state.length(); ++t) {  // the ring: the latest it holds at or below t
                Index expected = 0;
                for (const Index c : m.ring)
                    if (c <= t)
                        expected = std::max(expected, c);
                if (pool.checkpoint_before(id, t) != expected)
                    fail("checkpoint_before differs from the ring's model");
            }
            const Matrix<float> q = in.matrix<float>(1, d, 2.0);
            Matrix<float> x(1, dv), y(1, dv);
            pool.attend(id, q.row(0), x.row(0));
            m.state.attend(q.row(0), y.row(0));
            if (!(x.array() == y.array()).all())
                fail(what);
        }
    };
    const auto pick = [&] {
        auto it = model.begin();
        std::advance(it, in.size(0, static_cast<Index>(model.size()) - 1));
        return it->first;
    };
    const auto batch_of = [&] {  // distinct live ids, in a shuffled order
        std::vector<Index> ids;
        for (const auto& [id, m] : model)
            if (in.flag())
                ids.push_back(id);
        for (std::size_t i = 1; i < ids.size(); ++i)
            std::swap(ids[i], ids[static_cast<std::size_t>(in.size(0, static_cast<Index>(i)))]);
        return ids;
    };
    const Index ops = in.size(1, 40);
    for (Index op_index = 0; op_index < ops; ++op_index) {
        const Index op = model.empty() ? 0 : in.size(0, 7);
        if (op == 0) {  // add, or the full pool refuses
            if (static_cast<Index>(model.size()) == capacity) {
                bool threw = false;
                try {
                    pool.add();
                } catch (const PoolExhausted&) {
                    threw = true;
                }
                if (!threw)
                    fail("add past the capacity");
            } else {
                model.emplace(pool.add(), Model{prototype, {}, {}, {}, {}});
            }
        } else if (op == 1) {  // fork: the state and checkpoints, no drafts
            const Index parent = pick();
            if (static_cast<Index>(model.size()) < capacity) {
                const Index child = pool.fork(parent);
                Model m = model.at(parent);
                m.parents.clear();
                m.draft_states.clear();
                model.emplace(child, std::move(m));
            }
        } else if (op == 2) {  // remove
            const Index id = pick();
            pool.remove(id);
            model.erase(id);
        } else if (op == 3 || op == 4) {  // a decode step, or a prefill of chunks cut at the checkpoints
            const std::vector<Index> ids = batch_of();
            std::vector<Index> offsets{0};
            for (std::size_t i = 0; i < ids.size(); ++i)
                offsets.push_back(offsets.back() + (op == 3 ? 1 : in.size(0, 6)));
            const Index rows = offsets.back();
            const Matrix<float> Q = in.matrix<float>(rows, d, 2.0), K = keys(rows), V = in.matrix<float>(rows, dv, 2.0);
            Matrix<float> O(rows, dv);
            if (op == 3)
                pool.decode(ids, Q, K, V, O);
            else
                pool.prefill(ids, offsets, Q, K, V, O);
            for (std::size_t i = 0; i < ids.size(); ++i) {
                Model& m = model.at(ids[i]);
                m.parents.clear();
                m.draft_states.clear();
                for (Index r = offsets[i]; r < offsets[i + 1];) {
                    const Index length = m.state.length();
                    const Index n = every > 0 ? std::min(offsets[i + 1] - r, every - length % every) : offsets[i + 1] - r;
                    Matrix<float> o(n, dv);
                    if (op == 3)
                        memattn::decode(m.state, Q.middleRows(r, n), K.middleRows(r, n), V.middleRows(r, n), o);
                    else
                        memattn::prefill(m.state, Q.middleRows(r, n), K.middleRows(r, n), V.middleRows(r, n), o);
                    if (!(o.array() == O.middleRows(r, n).array()).all())
                        fail("a step's outputs");
                    keep(m);
                    r += n;
                }
            }
        } else if (op == 5) {  // a verify step of trees
            const std::vector<Index> ids = batch_of();
            std::vector<Index> offsets{0}, parents;
            for (std::size_t i = 0; i < ids.size(); ++i) {
                const Index n = in.size(0, 5);
                for (Index t = 0; t < n; ++t)
                    parents.push_back(in.size(-1, t - 1));
                offsets.push_back(offsets.back() + n);
            }
            const Index rows = offsets.back();
            const Matrix<float> Q = in.matrix<float>(rows, d, 2.0), K = keys(rows), V = in.matrix<float>(rows, dv, 2.0);
            Matrix<float> O(rows, dv);
            const bool failing = in.flag();
            const Index free_before = pool.free_draft_states();
            bool threw = false;
            try {
                if (failing)
                    pool.prefill(ids, offsets, Q, K, V, O, FailingExecutor{in.size(0, 2)}, parents);
                else
                    pool.prefill(ids, offsets, Q, K, V, O, parents);
            } catch (const PoolExhausted&) {
                threw = true;
                if (rows <= free_before)
                    fail("a verify step refused with the draft states free");
            } catch (const std::invalid_argument&) {
                threw = true;
                if (drafts > 0 || rows == 0)
                    fail("a verify step refused by a pool with draft states");
            } catch (const std::runtime_error&) {
                threw = true;
                if (!failing)
                    fail("a verify step threw");
            }
            if (!threw) {
                if (rows > free_before)
                    fail("a verify step ran past its draft states");
                for (std::size_t i = 0; i < ids.size(); ++i) {
                    const Index r0 = offsets[i], n = offsets[i + 1] - r0;
                    if (n == 0)
                        continue;
                    Model& m = model.at(ids[i]);
                    m.parents.assign(parents.begin() + r0, parents.begin() + r0 + n);
                    m.draft_states.clear();
                    for (Index t = 0; t < n; ++t) {
                        const Index p = m.parents[static_cast<std::size_t>(t)];
                        Mem s = p < 0 ? m.state : m.draft_states[static_cast<std::size_t>(p)];
                        Matrix<float> o(1, dv);
                        memattn::decode(s, Q.middleRows(r0 + t, 1), K.middleRows(r0 + t, 1), V.middleRows(r0 + t, 1), o);
                        if (!(o.array() == O.middleRows(r0 + t, 1).array()).all())
                            fail("a draft's output is not its path's decode");
                        m.draft_states.push_back(std::move(s));
                    }
                }
            }
        } else if (op == 6) {  // accept a path (or a bad one: refused), or reject
            const Index id = pick();
            Model& m = model.at(id);
            const auto n = static_cast<Index>(m.parents.size());
            std::vector<Index> path;
            if (n > 0 && in.flag()) {  // from a draft up to its root, cut short
                for (Index t = in.size(0, n - 1); t >= 0; t = m.parents[static_cast<std::size_t>(t)])
                    path.insert(path.begin(), t);
                path.resize(static_cast<std::size_t>(in.size(0, static_cast<Index>(path.size()))));
            }
            const bool bad = n > 0 && in.flag();
            if (bad)
                path.push_back(in.size(-1, n));
            bool valid = n > 0;
            for (std::size_t k = 0; valid && k < path.size(); ++k)
                valid = path[k] >= 0 && path[k] < n &&
                        m.parents[static_cast<std::size_t>(path[k])] == (k == 0 ? -1 : path[k - 1]);
            const bool rejecting = !bad && in.flag();
            if (rejecting)
                path.clear();
            bool threw = false;
            try {
                if (rejecting)
                    pool.reject(id);
                else
                    pool.accept(id, path);
            } catch (const std::invalid_argument&) {
                threw = true;
            }
            if (threw == valid)
                fail("accept refused a path of the tree, or took one that is not");
            if (!threw) {
                for (const Index t : path) {
                    m.state = m.draft_states[static_cast<std::size_t>(t)];
                    keep(m);
                }
                m.parents.clear();
                m.draft_states.clear();
            }
        } else {  // truncate back to a checkpoint the pool names, or refused elsewhere
            const Index id = pick();
            Model& m = model.at(id);
            const Index t = in.size(0, m.state.length());
            const Index c = pool.checkpoint_before(id, t);
            if (c > t || (c != t && pool.can_truncate(id, t)))
                fail("checkpoint_before");
            if (c != t) {
                bool threw = false;
                try {
                    pool.truncate(id, t);
                } catch (const std::invalid_argument&) {
                    threw = true;
                }
                if (!threw)
                    fail("a truncate to a length without a checkpoint");
            }
            pool.truncate(id, c);
            if (c == 0) {
                m.state = prototype;
                m.saved.clear();
                m.ring.clear();
            } else if (c != m.state.length()) {
                const auto it = m.saved.find(c);
                if (it == m.saved.end())
                    fail("a checkpoint the model never passed");
                m.state = it->second;
            }
            m.saved.erase(m.saved.upper_bound(c), m.saved.end());
            std::erase_if(m.ring, [c](Index l) { return l > c; });
            m.parents.clear();
            m.draft_states.clear();
        }
        check("after an operation");
    }
    for (const auto& [id, m] : model)
        pool.remove(id);
    if (pool.free_draft_states() != drafts || pool.sequences() != 0)
        fail("draft states or sequences left at the end");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    fuzz::FuzzInput in(data, size);
    const Index mode = in.size(0, 7);
    if (mode == 0) {
        failing_executor(in);
        return 0;
    }
    if (mode == 1) {
        model_cache(in);
        return 0;
    }
    if (mode == 7) {
        state_pool(in);
        return 0;
    }
    const Index kv = in.size(1, 2), g = in.size(1, 3), d = in.size(1, 6);
    const HeadLayout layout{kv * g, kv, d};
    const Index blocks = in.size(1, 12), block = in.size(1, 6);
    const Index window = in.size(0, 9), sinks = in.size(0, 3);  // window 0: none
    const Index room = window > 0 ? in.size(0, 5) : 0;             // rollback tokens past the window
    std::vector<double> slopes;  // ALiBi, or none
    if (in.flag())
        for (Index h = 0; h < layout.q_heads; ++h)
            slopes.push_back(0.25 / static_cast<double>(h + 1));
    PagedKVCache<float> pool(layout, blocks, block,
                             SoftmaxOptions{.window = window, .sink_tokens = sinks, .alibi_slopes = slopes},
                             PoolOptions{.rollback_tokens = room});
    const SoftmaxOptions options = pool.options();
    const Index most = window == 0 ? blocks : most_blocks(window + room, sinks, block, blocks);
    const Index kw = kv * d;
    std::map<Index, std::vector<Matrix<float>>> model;  // each token: row 0 its key, row 1 its value
    std::map<Index, Index> peak;  // the longest each sequence has been: a truncate to peak − room or more succeeds
    const auto pick = [&]() -> Index {
        auto it = model.begin();
        std::advance(it, in.size(0, static_cast<Index>(model.size()) - 1));
        return it->first;
    };
    const Index steps = in.size(0, 48);
    for (Index step = 0; step < steps; ++step) {
        for (const auto& [id, tokens] : model)
            peak[id] = std::max(peak[id], static_cast<Index>(tokens.size()));
        const Index op = model.empty() ? 0 : in.size(0, 7);
        const Index before = pool.blocks_in_use();
        if (op == 0) {
            if (model.size() < 6)
                model[pool.add_sequence()] = {};
        } else if (op == 1) {
            if (model.size() < 6) {
                const Index parent = pick();
                const Index child = pool.fork(parent);
                model[child] = model[parent];
                peak[child] = peak[parent];
                if (pool.blocks_in_use() != before)
                    fail("a fork took blocks");
            }
        } else if (op == 2) {
            const Index seq = pick(), n = in.size(0, 7);
            const Matrix<float> K = in.matrix<float>(n, kw, 2.0), V = in.matrix<float>(n, kw, 2.0);
            try {
                pool.extend(seq, K, V);
                for (Index i = 0; i < n; ++i) {
                    Matrix<float> token(2, kw);
                    token << K.row(i), V.row(i);
                    model[seq].push_back(token);
                }
            } catch (const PoolExhausted&) {
                if (pool.blocks_in_use() != before || pool.length(seq) != static_cast<Index>(model[seq].size()))
                    fail("a refused extend changed the pool");
            }
        } else if (op == 3) {
            const Index seq = pick();
            const Index n = in.size(0, static_cast<Index>(model[seq].size()));
            if (pool.can_truncate(seq, n)) {
                pool.truncate(seq, n);
                model[seq].resize(static_cast<std::size_t>(n));
            } else {
                if (window == 0)
                    fail("a rollback refused without a window");
                if (n >= peak[seq] - room)
                    fail("a rollback within the rollback room refused");
                bool threw = false;
                try {
                    pool.truncate(seq, n);
                } catch (const std::invalid_argument&) {
                    threw = true;
                }
                if (!threw || pool.blocks_in_use() != before || pool.length(seq) != static_cast<Index>(model[seq].size()))
                    fail("a refused rollback changed the pool");
            }
        } else if (op == 4) {
            const Index seq = pick();
            pool.remove(seq);
            model.erase(seq);
            peak.erase(seq);
        } else if (op == 5) {
            const Index seq = pick();
            const Matrix<float> q = in.matrix<float>(1, pool.query_dim(), 2.0);
            Matrix<float> o(1, pool.output_dim());
            pool.attend(seq, q.row(0), o.row(0));
            fuzz::expect_close("attend", o, expected_attend(layout, q, model[seq], options), 2e-4);
        } else if (op == 7) {  // a snapshot into a pool of another block size, and back into this one
            const Index seq = pick();
            auto view = pool.sequence(seq);
            std::stringstream stream;
            memattn::save(view, stream);
            const std::string bytes = stream.str();
            const Index other_block = in.size(1, 9), other_blocks = in.size(1, 12);
            PagedKVCache<float> other(layout, other_blocks, other_block, options);
            const Index into = other.add_sequence();
            auto loaded = other.sequence(into);
            std::stringstream copy(bytes);
            try {
                memattn::load(loaded, copy);
                if (other.length(into) != static_cast<Index>(model[seq].size()))
                    fail("a loaded sequence's length differs");
                if (other.blocks_of(into) > most_blocks(window, sinks, other_block, other_blocks))
                    fail("a loaded windowed sequence holds blocks its window left");
                const Matrix<float> q = in.matrix<float>(1, pool.query_dim(), 2.0);
                Matrix<float> o(1, pool.output_dim());
                other.attend(into, q.row(0), o.row(0));
                fuzz::expect_close("attend after load", o, expected_attend(layout, q, model[seq], options), 2e-4);
            } catch (const PoolExhausted&) {
                if (other.length(into) != 0 || other.blocks_in_use() != 0)
                    fail("a refused load changed the other pool");
            }
            if (model.size() < 6) {
                const Index back = pool.add_sequence();
                auto again = pool.sequence(back);
                std::stringstream copy2(bytes);
                try {
                    memattn::load(again, copy2);
                    model[back] = model[seq];
                    peak[back] = peak[seq];  // it holds what seq held: its room is seq's
                } catch (const PoolExhausted&) {
                    if (pool.length(back) != 0 || pool.blocks_in_use() != before)
                        fail("a refused load changed the pool");
                    pool.remove(back);
                }
            }
        } else if (op == 6 && in.flag()) {  // a verify step of a tree of drafts, then accept or reject
            const Index seq = pick(), n = in.size(1, 5), length = pool.length(seq);
            std::vector<Index> parents;
            for (Index t = 0; t < n; ++t)
                parents.push_back(in.size(0, t) - 1);
            const Matrix<float> Q = in.matrix<float>(n, pool.query_dim(), 2.0), K = in.matrix<float>(n, kw, 2.0),
                                V = in.matrix<float>(n, kw, 2.0);
            Matrix<float> O(n, pool.output_dim());
            const std::vector<Index> seqs{seq}, offsets{0, n};
            try {
                pool.prefill(seqs, offsets, Q, K, V, O, {}, parents);
            } catch (const PoolExhausted&) {
                if (pool.blocks_in_use() != before || pool.length(seq) != static_cast<Index>(model[seq].size()))
                    fail("a refused verify step changed the pool");
                continue;
            } catch (const std::invalid_argument& e) {  // a windowed pool's drafts past its rollback room
                if (window == 0 || n <= room || std::string(e.what()).find("rollback room") == std::string::npos)
                    fail("a verify step within the rollback room refused");
                if (pool.blocks_in_use() != before || pool.length(seq) != length || pool.pending_drafts(seq) != 0)
                    fail("a refused verify step changed the pool");
                continue;
            }
            peak[seq] = std::max(peak[seq], length + n);  // the window's room counts from the drafts' end
            const auto chain = [&](Index leaf) {  // the drafts from a root to `leaf`
                std::vector<Index> path;
                for (Index i = leaf; i >= 0; i = parents[static_cast<std::size_t>(i)])
                    path.insert(path.begin(), i);
                return path;
            };
            const auto with = [&](const std::vector<Index>& path) {  // the model's tokens and the path's
                std::vector<Matrix<float>> tokens = model[seq];
                for (const Index i : path) {
                    Matrix<float> token(2, kw);
                    token << K.row(i), V.row(i);
                    tokens.push_back(token);
                }
                return tokens;
            };
            for (Index t = 0; t < n; ++t)
                fuzz::expect_close("a draft's attend", O.row(t), expected_attend(layout, Q.row(t), with(chain(t)), options),
                                   2e-4);
            if (pool.pending_drafts(seq) != n)
                fail("the drafts are not pending");
            // A fork now shares the drafts' blocks: accept copies what it writes.
            Index twin = -1;
            if (model.size() < 6 && in.flag()) {
                twin = pool.fork(seq);
                model[twin] = model[seq];
                peak[twin] = peak[seq];
            }
            const Index in_use = pool.blocks_in_use();
            if (in.flag()) {
                const std::vector<Index> path = chain(in.size(0, n - 1));
                try {
                    pool.accept(seq, path);
                    model[seq] = with(path);
                } catch (const PoolExhausted&) {
                    if (pool.blocks_in_use() != in_use || pool.pending_drafts(seq) != n)
                        fail("a refused accept changed the pool");
                    pool.reject(seq);
                }
            } else {
                pool.reject(seq);
            }
            if (twin >= 0) {
                if (pool.pending_drafts(twin) != n)
                    fail("a fork lost the pending drafts");
                pool.reject(twin);
            }
        } else if (in.flag()) {  // a mixed batch: a chunk of 0 to 3 rows for every live sequence
            std::vector<Index> seqs, offsets{0};
            for (const auto& [seq, tokens] : model) {
                seqs.push_back(seq);
                offsets.push_back(offsets.back() + in.size(0, 3));
            }
            const Index rows = offsets.back();
            const Matrix<float> Q = in.matrix<float>(rows, pool.query_dim(), 2.0),
                                K = in.matrix<float>(rows, kw, 2.0), V = in.matrix<float>(rows, kw, 2.0);
            Matrix<float> O(rows, pool.output_dim());
            try {
                batched_prefill(pool, seqs, offsets, Q, K, V, O);
                for (std::size_t i = 0; i < seqs.size(); ++i) {
                    auto& tokens = model[seqs[i]];
                    for (Index r = offsets[i]; r < offsets[i + 1]; ++r) {
                        Matrix<float> token(2, kw);
                        token << K.row(r), V.row(r);
                        tokens.push_back(token);
                        fuzz::expect_close("batched_prefill", O.row(r), expected_attend(layout, Q.row(r), tokens, options),
                                           2e-4);
                    }
                }
            } catch (const PoolExhausted&) {
                if (pool.blocks_in_use() != before)
                    fail("a refused mixed batch changed the pool");
            }
        } else {  // one token for every live sequence at once
            std::vector<Index> seqs;
            for (const auto& [seq, tokens] : model)
                seqs.push_back(seq);
            const Index b = static_cast<Index>(seqs.size());
            const Matrix<float> Q = in.matrix<float>(b, pool.query_dim(), 2.0), K = in.matrix<float>(b, kw, 2.0),
                                V = in.matrix<float>(b, kw, 2.0);
            Matrix<float> O(b, pool.output_dim());
            try {
                batched_decode(pool, seqs, Q, K, V, O);
                for (Index i = 0; i < b; ++i) {
                    Matrix<float> token(2, kw);
                    token << K.row(i), V.row(i);
                    auto& tokens = model[seqs[static_cast<std::size_t>(i)]];
                    tokens.push_back(token);
                    fuzz::expect_close("batched_decode", O.row(i), expected_attend(layout, Q.row(i), tokens, options), 2e-4);
                }
            } catch (const PoolExhausted&) {
                if (pool.blocks_in_use() != before)
                    fail("a refused batch changed the pool");
            }
        }
        if (pool.sequences() != static_cast<Index>(model.size()) || pool.blocks_in_use() + pool.free_blocks() != blocks)
            fail("counts");
        Index held = 0;
        for (const auto& [seq, tokens] : model) {
            if (pool.length(seq) != static_cast<Index>(tokens.size()))
                fail("a length differs from the model's");
            held += pool.blocks_of(seq);
            if (pool.blocks_of(seq) > most)
                fail("a windowed sequence holds blocks its window left");
        }
        if (pool.blocks_in_use() > held)
            fail("blocks in use that no sequence holds");
    }
    for (const auto& [seq, tokens] : model)
        pool.remove(seq);
    if (pool.blocks_in_use() != 0)
        fail("blocks leaked");
    return 0;
}
