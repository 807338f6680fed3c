// memattn::PagedKVCache: a pool of blocks for many sequences, each a Memory; fork with
// copy-on-write, truncate, remove, exhaustion; against the double reference, a private
// cache per sequence, and a model of the pool (a map of sequences to their tokens).

#include "support.hpp"

#include <memattn/memattn.hpp>
#include <memattn/serving/state_pool.hpp>

#include <cstdint>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

using namespace memattn;
using namespace memattn::test;

static_assert(Memory<PagedKVCache<float>::Sequence>);
static_assert(Memory<PagedKVCache<double, Eigen::bfloat16>::Sequence>);

namespace {

/// The packed rows as storage S gives them back, head by head (a Q8 block ends with its
/// head's row).
template <class T, class S>
Matrix<T> stored_heads(const Matrix<T>& X, Index heads) {
    const Index w = X.cols() / heads;
    Matrix<T> out(X.rows(), X.cols());
    if (X.rows() == 0)  // no column block of an empty (null) matrix
        return out;
    for (Index h = 0; h < heads; ++h) {
        const Matrix<T> part = X.middleCols(h * w, w);
        Matrix<T> back(X.rows(), w);
        detail::round_trip<T, S>(part, back.data(), w);
        out.middleCols(h * w, w) = back;
    }
    return out;
}

/// Every query head of q (one packed row) over the tokens K/V (packed rows, as stored),
/// in double: the reference a paged sequence must match.
MatrixD paged_reference(const HeadLayout& layout, const MatrixD& q, const MatrixD& K, const MatrixD& V,
                        Index window = 0, Index sinks = 0) {
    const Index d = layout.head_dim, dv = layout.values(), g = layout.group_size();
    MatrixD out = MatrixD::Zero(1, layout.q_heads * dv);
    if (K.rows() == 0)
        return out;
    for (Index h = 0; h < layout.q_heads; ++h) {
        const Index kv = h / g;
        out.middleCols(h * dv, dv) = reference::softmax_attention(q.middleCols(h * d, d), K.middleCols(kv * d, d),
                                                                  V.middleCols(kv * dv, dv), 0, window, sinks)
                                         .out;
    }
    return out;
}

/// What a pool's prefill gives a chunk of two rows or more (Q, packed) of a sequence whose
/// pairs, the chunk's last, are K/V (packed, as stored): the multi-head kernel's rows
/// over them, bit for bit (serving/paged_prefill.hpp).
Matrix<float> layer_rows(const HeadLayout& layout, const Matrix<float>& Q, const Matrix<float>& K,
                         const Matrix<float>& V, const SoftmaxOptions& options) {
    Matrix<float> O(Q.rows(), layout.q_heads * layout.values());
    multi_head_causal_softmax_attention(Q, K, V, O, layout, options, {}, SerialExecutor{});
    return O;
}

}  // namespace

TEMPLATE_TEST_CASE("PagedKVCache: a sequence equals the double reference and a private cache, in every storage",
                   "[serving]", float, Eigen::bfloat16, Eigen::half, Q8, Q4, Q4Affine) {
    using S = TestType;
    for (const auto& [layout, block] :
         {std::tuple<HeadLayout, Index>{{4, 2, 16, 0}, 16}, {{8, 1, 17, 9}, 3}, {{2, 2, 1, 0}, 1}, {{32, 8, 32, 0}, 128},
          {{3, 3, 8, 0}, 7}}) {
        for (const Index n : {0, 1, 37, 300}) {
            INFO(detail::storage_name<S> << ", " << layout.q_heads << "/" << layout.kv_heads << " x " << layout.head_dim
                                         << ", block " << block << ", n = " << n);
            const Index kw = layout.kv_heads * layout.head_dim, vw = layout.kv_heads * layout.values();
            const Index per_sequence = (n + block - 1) / block;
            PagedKVCache<float, S> pool(layout, 2 * per_sequence + 1, block);
            const Index a = pool.add_sequence(), b = pool.add_sequence();
            const Matrix<float> K = random_matrix<float>(n, kw, 1), V = random_matrix<float>(n, vw, 2);
            // a through extend, b token by token: the same pairs.
            auto first = pool.sequence(a), second = pool.sequence(b);
            memattn::extend(first, K, V);
            for (Index i = 0; i < n; ++i)
                second.update(K.row(i), V.row(i));
            CHECK(pool.length(a) == n);
            CHECK(pool.blocks_in_use() == 2 * per_sequence);
            const Matrix<float> q = random_matrix<float>(1, pool.query_dim(), 3, 2.0);
            Matrix<float> oa(1, pool.output_dim()), ob(1, pool.output_dim());
            pool.sequence(a).attend(q.row(0), oa.row(0));
            pool.sequence(b).attend(q.row(0), ob.row(0));
            CHECK((oa.array() == ob.array()).all());
            const MatrixD Ks = stored_heads<float, S>(K, layout.kv_heads).template cast<double>();
            const MatrixD Vs = stored_heads<float, S>(V, layout.kv_heads).template cast<double>();
            check_close(oa, paged_reference(layout, q.template cast<double>(), Ks, Vs), 2e-5);  // the stored values exactly
            // A private layer of caches fed the same tokens.
            const Index d = layout.head_dim, dv = layout.values();  // a lambda cannot capture a binding (C++20)
            MultiHead<KVCache<float, S>> layer(layout, [d, dv](Index) { return KVCache<float, S>(d, dv); });
            memattn::extend(layer, K, V);
            Matrix<float> private_out(1, pool.output_dim());
            layer.attend(q.row(0), private_out.row(0));
            check_close(oa, private_out.template cast<double>(), 2e-5);
        }
    }
}

TEST_CASE("PagedKVCache: fork shares every block and copies a shared block before writing into it", "[serving]") {
    const HeadLayout layout{4, 2, 8, 0};
    PagedKVCache<float> pool(layout, 32, 16);
    const Matrix<float> K = random_matrix<float>(40, 16, 11), V = random_matrix<float>(40, 16, 12);
    const Matrix<float> q = random_matrix<float>(1, 32, 13, 2.0);
    const auto attend = [&](Index seq) {
        Matrix<float> o(1, 32);
        pool.attend(seq, q.row(0), o.row(0));
        return o;
    };
    const auto fresh = [&](Index tokens, const Matrix<float>& extra_k, const Matrix<float>& extra_v) {
        const Index id = pool.add_sequence();
        pool.extend(id, K.topRows(tokens), V.topRows(tokens));
        pool.extend(id, extra_k, extra_v);
        const Matrix<float> o = attend(id);
        pool.remove(id);
        return o;
    };
    const Index parent = pool.add_sequence();
    pool.extend(parent, K.topRows(37), V.topRows(37));  // 3 blocks, the last one partly filled
    CHECK(pool.blocks_in_use() == 3);
    const Matrix<float> before = attend(parent);
    const Index child = pool.fork(parent);
    CHECK(pool.length(child) == 37);
    CHECK(pool.blocks_in_use() == 3);  // shared
    CHECK((attend(child).array() == before.array()).all());
    // The child writes into the shared last block: it copies it first.
    pool.update(child, K.row(37), V.row(37));
    CHECK(pool.blocks_in_use() == 4);
    CHECK((attend(parent).array() == before.array()).all());
    CHECK((attend(child).array() == fresh(38, Matrix<float>(0, 16), Matrix<float>(0, 16)).array()).all());
    // The parent writes too: its block is its own again (the count fell to one), no copy.
    const Matrix<float> other_k = random_matrix<float>(1, 16, 14), other_v = random_matrix<float>(1, 16, 15);
    pool.update(parent, other_k.row(0), other_v.row(0));
    CHECK(pool.blocks_in_use() == 4);
    CHECK((attend(parent).array() == fresh(37, other_k, other_v).array()).all());
    CHECK((attend(child).array() == fresh(38, Matrix<float>(0, 16), Matrix<float>(0, 16)).array()).all());
    // A fork at a block edge shares full blocks only: the next token takes a new block.
    const Index edge = pool.add_sequence();
    pool.extend(edge, K.topRows(32), V.topRows(32));
    const Index edge_child = pool.fork(edge);
    const Index in_use = pool.blocks_in_use();
    pool.update(edge_child, K.row(32), V.row(32));
    CHECK(pool.blocks_in_use() == in_use + 1);
    CHECK((attend(edge_child).array() == fresh(33, Matrix<float>(0, 16), Matrix<float>(0, 16)).array()).all());
}

TEST_CASE("PagedKVCache: truncate and remove free the blocks no one else holds", "[serving]") {
    const HeadLayout layout{2, 1, 8, 0};
    PagedKVCache<float, Eigen::half> pool(layout, 16, 8);
    const Matrix<float> K = random_matrix<float>(60, 8, 21), V = random_matrix<float>(60, 8, 22);
    const Matrix<float> q = random_matrix<float>(1, 16, 23);
    const Index a = pool.add_sequence();
    pool.extend(a, K.topRows(50), V.topRows(50));  // 7 blocks
    const Index b = pool.fork(a);
    CHECK(pool.blocks_in_use() == 7);
    pool.truncate(b, 20);  // b holds 3 blocks, all still a's
    CHECK(pool.blocks_in_use() == 7);
    CHECK(pool.blocks_of(b) == 3);
    pool.remove(a);  // a's blocks past b's 3 are freed
    CHECK(pool.blocks_in_use() == 3);
    CHECK(!pool.contains(a));
    CHECK(pool.sequences() == 1);
    // b continues from its 20 tokens exactly as a fresh sequence of them.
    pool.extend(b, K.middleRows(20, 10), V.middleRows(20, 10));
    const Index c = pool.add_sequence();  // reuses a's id
    CHECK(c == a);
    pool.extend(c, K.topRows(30), V.topRows(30));
    Matrix<float> ob(1, 16), oc(1, 16);
    pool.attend(b, q.row(0), ob.row(0));
    pool.attend(c, q.row(0), oc.row(0));
    CHECK((ob.array() == oc.array()).all());
    pool.sequence(b).reset();
    CHECK(pool.length(b) == 0);
    pool.attend(b, q.row(0), ob.row(0));
    CHECK(ob.isZero(0));
    pool.remove(b);
    pool.remove(c);
    CHECK(pool.blocks_in_use() == 0);
    CHECK(pool.free_blocks() == 16);
}

TEST_CASE("PagedKVCache: an exhausted pool or bad input throws and changes nothing", "[serving][bad_input]") {
    const HeadLayout layout{4, 2, 4, 0};
    PagedKVCache<float, Eigen::half> pool(layout, 3, 4);
    const Matrix<float> K = random_matrix<float>(20, 8, 31), V = random_matrix<float>(20, 8, 32);
    const Index a = pool.add_sequence();
    pool.extend(a, K.topRows(10), V.topRows(10));  // 3 blocks, the last half full
    const Index b = pool.fork(a);
    const auto unchanged = [&] {
        CHECK(pool.length(a) == 10);
        CHECK(pool.length(b) == 10);
        CHECK(pool.blocks_in_use() == 3);
    };
    // Copy-on-write needs a block, and none is free.
    try {
        pool.update(b, K.row(10), V.row(10));
        FAIL("no PoolExhausted");
    } catch (const PoolExhausted& e) {
        CHECK(e.needed() == 1);
        CHECK(e.free() == 0);
        CHECK(std::string(e.what()) ==
              "memattn::PagedKVCache::update: needs 1 free block, but 0 of the pool's 3 are free");
    }
    unchanged();
    pool.remove(b);
    // 6 more tokens need 1 block past the 2 free slots: 10 + 6 = 16 tokens is 4 blocks.
    CHECK_THROWS_AS(pool.extend(a, K.middleRows(10, 6), V.middleRows(10, 6)), PoolExhausted);
    CHECK(pool.length(a) == 10);
    CHECK(pool.blocks_in_use() == 3);
    // Bad ids, shapes and values: std::invalid_argument naming the function and argument.
    CHECK_THROWS_WITH(pool.update(7, K.row(0), V.row(0)),
                      Catch::Contains("PagedKVCache::update") && Catch::Contains("'seq'") &&
                          Catch::Contains("not a live sequence"));
    CHECK_THROWS_WITH(pool.update(b, K.row(0), V.row(0)), Catch::Contains("not a live sequence"));  // removed
    CHECK_THROWS_AS(pool.fork(-1), std::invalid_argument);
    CHECK_THROWS_AS(pool.truncate(a, 11), std::invalid_argument);
    CHECK_THROWS_AS(pool.update(a, K.row(0).head(7), V.row(0)), std::invalid_argument);
    Matrix<float> big = K.row(0);
    big(0, 5) = 1e6f;  // float16 would hold it as infinity
    CHECK_THROWS_WITH(pool.update(a, big.row(0), V.row(0)), Catch::Contains("float16"));
    Matrix<float> q = random_matrix<float>(1, 16, 33), o(1, 16), narrow(1, 15);
    CHECK_THROWS_AS(pool.attend(a, q.row(0), narrow.row(0)), std::invalid_argument);
    CHECK(pool.length(a) == 10);
    CHECK(pool.blocks_in_use() == 3);
    CHECK_THROWS_AS(PagedKVCache<float>(layout, 0, 4), std::invalid_argument);
    CHECK_THROWS_AS(PagedKVCache<float>(layout, 4, 0), std::invalid_argument);
    CHECK_THROWS_AS(PagedKVCache<float>(HeadLayout{3, 2, 4, 0}, 4, 4), std::invalid_argument);
}

TEST_CASE("PagedKVCache: thousands of random operations against a model of the pool", "[serving][model]") {
    // The model: each live sequence's tokens (indices into K/V). Checked after every
    // operation: lengths, the pool's counts, and one sequence's attend against the double
    // reference of its tokens; at the end every block is free again.
    const HeadLayout layout{4, 2, 4, 0};
    const Index blocks = 12, block = 4;
    PagedKVCache<float> pool(layout, blocks, block);
    const Matrix<float> K = random_matrix<float>(400, 8, 41), V = random_matrix<float>(400, 8, 42);
    const Matrix<float> q = random_matrix<float>(1, 16, 43, 2.0);
    std::map<Index, std::vector<Index>> model;
    std::mt19937_64 gen(44);
    const auto pick = [&](Index n) { return static_cast<Index>(gen() % static_cast<std::uint64_t>(n)); };
    const auto any_live = [&] {
        auto it = model.begin();
        std::advance(it, pick(static_cast<Index>(model.size())));
        return it->first;
    };
    Index next_token = 0, exhausted = 0;
    for (int step = 0; step < 3000; ++step) {
        const Index op = model.empty() ? 0 : pick(6);
        INFO("step " << step << ", op " << op);
        if (op == 0 && model.size() < 8) {
            model[pool.add_sequence()] = {};
        } else if (op == 1 && model.size() < 8) {
            const Index parent = any_live();
            const Index child = pool.fork(parent);
            model[child] = model[parent];
        } else if (op == 2 || op == 3) {
            const Index seq = any_live(), n = pick(9);
            std::vector<Index> tokens(static_cast<std::size_t>(n));
            Matrix<float> k(n, 8), v(n, 8);
            for (Index i = 0; i < n; ++i) {
                tokens[static_cast<std::size_t>(i)] = next_token % 400;
                k.row(i) = K.row(next_token % 400);
                v.row(i) = V.row(next_token % 400);
                ++next_token;
            }
            const Index in_use = pool.blocks_in_use();
            try {
                pool.extend(seq, k, v);
                model[seq].insert(model[seq].end(), tokens.begin(), tokens.end());
            } catch (const PoolExhausted&) {
                ++exhausted;
                CHECK(pool.blocks_in_use() == in_use);
            }
        } else if (op == 4) {
            const Index seq = any_live();
            const Index n = pick(static_cast<Index>(model[seq].size()) + 1);
            pool.truncate(seq, n);
            model[seq].resize(static_cast<std::size_t>(n));
        } else if (op == 5) {
            const Index seq = any_live();
            pool.remove(seq);
            model.erase(seq);
        }
        REQUIRE(pool.sequences() == static_cast<Index>(model.size()));
        Index held = 0;
        for (const auto& [seq, tokens] : model) {
            REQUIRE(pool.length(seq) == static_cast<Index>(tokens.size()));
            held += pool.blocks_of(seq);
        }
        REQUIRE(pool.blocks_in_use() <= held);
        REQUIRE(pool.blocks_in_use() + pool.free_blocks() == blocks);
        if (!model.empty()) {
            const Index seq = any_live();
            const auto& tokens = model[seq];
            MatrixD k(static_cast<Index>(tokens.size()), 8), v(static_cast<Index>(tokens.size()), 8);
            for (std::size_t i = 0; i < tokens.size(); ++i) {
                k.row(static_cast<Index>(i)) = K.row(tokens[i]).cast<double>();
                v.row(static_cast<Index>(i)) = V.row(tokens[i]).cast<double>();
            }
            Matrix<float> o(1, 16);
            pool.attend(seq, q.row(0), o.row(0));
            check_close(o, paged_reference(layout, q.cast<double>(), k, v), 2e-5);
        }
    }
    CHECK(exhausted > 0);  // the pool ran out now and then
    for (const auto& [seq, tokens] : model)
        pool.remove(seq);
    CHECK(pool.blocks_in_use() == 0);
}

TEST_CASE("PagedKVCache: attend is bitwise the same on every executor and thread count", "[serving][threads]") {
    const HeadLayout layout{32, 8, 32, 0};
    PagedKVCache<float, Eigen::bfloat16> pool(layout, 64, 64);
    const Index seq = pool.add_sequence();
    pool.extend(seq, random_matrix<float>(1000, 256, 51), random_matrix<float>(1000, 256, 52));
    const Matrix<float> q = random_matrix<float>(1, 1024, 53);
    Matrix<float> expected(1, 1024);
    const SerialExecutor serial;
    pool.set_executor(serial);
    pool.attend(seq, q.row(0), expected.row(0));
    for (const int threads : {1, 2, 3, 5}) {
        const OpenMPExecutor executor{.threads = threads};
        pool.set_executor(executor);
        Matrix<float> o(1, 1024);
        pool.attend(seq, q.row(0), o.row(0));
        CHECK((o.array() == expected.array()).all());
    }
}

TEMPLATE_TEST_CASE("PagedKVCache: blocks of a multiple of 128 tokens give a KVCache's grouped attend, bit for bit",
                   "[serving][group]", float, Eigen::bfloat16, Q8, Q4) {
    using S = TestType;
    const HeadLayout layout{8, 2, 24, 0};  // groups of 4
    for (const Index block : {128, 256}) {
        PagedKVCache<float, S> pool(layout, 8, block);
        const Index seq = pool.add_sequence();
        const Matrix<float> K = random_matrix<float>(700, 48, 61), V = random_matrix<float>(700, 48, 62);
        pool.extend(seq, K, V);
        const Matrix<float> q = random_matrix<float>(1, 192, 63, 2.0);
        Matrix<float> o(1, 192);
        pool.attend(seq, q.row(0), o.row(0));
        for (Index kv = 0; kv < 2; ++kv) {
            KVCache<float, S> cache(24, 24);
            memattn::extend(cache, Matrix<float>(K.middleCols(kv * 24, 24)), Matrix<float>(V.middleCols(kv * 24, 24)));
            const Matrix<float> group = Eigen::Map<const Matrix<float>>(q.data() + kv * 96, 4, 24);
            Matrix<float> expected(4, 24);
            cache.attend_group(group, expected);
            const Matrix<float> got = Eigen::Map<const Matrix<float>>(o.data() + kv * 96, 4, 24);
            INFO(detail::storage_name<S> << ", block " << block << ", KV head " << kv);
            CHECK((got.array() == expected.array()).all());
        }
    }
}

TEMPLATE_TEST_CASE("batched_decode over the pool equals one update and attend per sequence, for any order and thread count",
                   "[serving][batched]", float, Eigen::half) {
    using S = TestType;
    const HeadLayout layout{8, 2, 16, 0};
    const Index batch = 6;
    const Matrix<float> K = random_matrix<float>(400, 32, 71), V = random_matrix<float>(400, 32, 72);
    const Matrix<float> Qb = random_matrix<float>(batch, 128, 73), Kb = random_matrix<float>(batch, 32, 74),
                        Vb = random_matrix<float>(batch, 32, 75);
    // Uneven lengths, forks sharing a partly filled block (two of them write into it in
    // the batch, the parent too), an empty sequence.
    const auto build = [&](PagedKVCache<float, S>& pool) {
        std::vector<Index> ids;
        const Index root = pool.add_sequence();
        pool.extend(root, K.topRows(37), V.topRows(37));
        ids.push_back(root);
        ids.push_back(pool.fork(root));
        ids.push_back(pool.fork(root));
        for (const Index n : {0, 1, 300}) {
            ids.push_back(pool.add_sequence());
            pool.extend(ids.back(), K.topRows(n), V.topRows(n));
        }
        return ids;
    };
    PagedKVCache<float, S> one_by_one(layout, 40, 16);
    const std::vector<Index> ids = build(one_by_one);
    Matrix<float> expected(batch, 128);
    for (Index i = 0; i < batch; ++i) {
        one_by_one.update(ids[static_cast<std::size_t>(i)], Kb.row(i), Vb.row(i));
        one_by_one.attend(ids[static_cast<std::size_t>(i)], Qb.row(i), expected.row(i));
    }
    for (const int threads : {1, 2, 3}) {
        for (const bool reversed : {false, true}) {
            INFO(threads << " threads, " << (reversed ? "reversed" : "in order"));
            PagedKVCache<float, S> pool(layout, 40, 16);
            std::vector<Index> seqs = build(pool);
            std::vector<Index> order(batch);
            for (Index i = 0; i < batch; ++i)
                order[static_cast<std::size_t>(i)] = reversed ? batch - 1 - i : i;
            std::vector<Index> batch_ids;
            Matrix<float> Q(batch, 128), Kr(batch, 32), Vr(batch, 32), O(batch, 128);
            for (Index r = 0; r < batch; ++r) {
                const Index i = order[static_cast<std::size_t>(r)];
                batch_ids.push_back(seqs[static_cast<std::size_t>(i)]);
                Q.row(r) = Qb.row(i);
                Kr.row(r) = Kb.row(i);
                Vr.row(r) = Vb.row(i);
            }
            const OpenMPExecutor executor{.threads = threads};
            const Index before = pool.blocks_in_use();
            batched_decode(pool, batch_ids, Q, Kr, Vr, O, executor);
            CHECK(pool.blocks_in_use() == before + 3);  // two of the three holders copy the shared block, the empty one takes one
            for (Index r = 0; r < batch; ++r)
                CHECK((O.row(r).array() == expected.row(order[static_cast<std::size_t>(r)]).array()).all());
        }
    }
}

TEST_CASE("batched_decode: a batch that does not fit, or bad input, changes no sequence", "[serving][batched][bad_input]") {
    const HeadLayout layout{4, 2, 4, 0};
    PagedKVCache<float> pool(layout, 4, 4);
    const Index a = pool.add_sequence(), b = pool.add_sequence();
    pool.extend(a, random_matrix<float>(4, 8, 81), random_matrix<float>(4, 8, 82));  // full block
    pool.extend(b, random_matrix<float>(6, 8, 83), random_matrix<float>(6, 8, 84));  // 2 blocks
    const Index c = pool.fork(b);                                                    // shares b's half block
    // a needs a block, b and c write into their shared block: one copies. 2 needed, 1 free.
    const std::vector<Index> all{a, b, c};
    const Matrix<float> Q = random_matrix<float>(3, 16, 85), K = random_matrix<float>(3, 8, 86),
                        V = random_matrix<float>(3, 8, 87);
    Matrix<float> O(3, 16);
    try {
        batched_decode(pool, all, Q, K, V, O);
        FAIL("no PoolExhausted");
    } catch (const PoolExhausted& e) {
        CHECK(e.needed() == 2);
        CHECK(e.free() == 1);
    }
    CHECK(pool.length(a) == 4);
    CHECK(pool.length(b) == 6);
    CHECK(pool.length(c) == 6);
    CHECK(pool.blocks_in_use() == 3);
    // b and c alone fit (one copy), and do.
    const std::vector<Index> two{b, c};
    Matrix<float> O2(2, 16);
    batched_decode(pool, two, Q.topRows(2), K.topRows(2), V.topRows(2), O2);
    CHECK(pool.length(b) == 7);
    CHECK(pool.blocks_in_use() == 4);
    // Bad input: a repeated id, a removed one, rows that do not match the batch.
    const std::vector<Index> twice{a, a};
    CHECK_THROWS_WITH(batched_decode(pool, twice, Q.topRows(2), K.topRows(2), V.topRows(2), O2),
                      Catch::Contains("twice"));
    pool.remove(c);
    CHECK_THROWS_WITH(batched_decode(pool, two, Q.topRows(2), K.topRows(2), V.topRows(2), O2),
                      Catch::Contains("not a live sequence"));
    const std::vector<Index> one{a};
    CHECK_THROWS_AS(batched_decode(pool, one, Q.topRows(1), K.topRows(2), V.topRows(2), O2.topRows(1)),
                    std::invalid_argument);
    CHECK_THROWS_AS(batched_decode(pool, one, Q.topRows(2), K.topRows(1), V.topRows(1), O2), std::invalid_argument);
    CHECK(pool.length(a) == 4);
    CHECK(pool.length(b) == 7);
}

TEST_CASE("batched_decode over a span of memories equals one decode step per memory", "[serving][batched]") {
    const HeadLayout layout{4, 2, 8, 0};
    const auto make = [&] {
        std::vector<MultiHead<SlidingWindowCache<float>>> layers;
        for (Index i = 0; i < 5; ++i)
            layers.emplace_back(layout, [](Index) { return SlidingWindowCache<float>(8, 8, 64, 2); });
        for (Index i = 0; i < 5; ++i)
            memattn::extend(layers[static_cast<std::size_t>(i)], random_matrix<float>(30 * i, 16, 91),
                            random_matrix<float>(30 * i, 16, 92));
        return layers;
    };
    const Matrix<float> Q = random_matrix<float>(5, 32, 93), K = random_matrix<float>(5, 16, 94),
                        V = random_matrix<float>(5, 16, 95);
    auto separate = make();
    Matrix<float> expected(5, 32);
    for (Index i = 0; i < 5; ++i) {
        separate[static_cast<std::size_t>(i)].update(K.row(i), V.row(i));
        separate[static_cast<std::size_t>(i)].attend(Q.row(i), expected.row(i));
    }
    for (const int threads : {1, 2}) {
        auto layers = make();
        const OpenMPExecutor executor{.threads = threads};
        Matrix<float> O(5, 32);
        batched_decode(std::span(layers), Q, K, V, O, executor);
        CHECK((O.array() == expected.array()).all());
        for (Index i = 0; i < 5; ++i)
            CHECK(layers[static_cast<std::size_t>(i)].length() == 30 * i + 1);
        // A row a memory refuses (wrong width) changes none of them.
        CHECK_THROWS_AS(batched_decode(std::span(layers), Q, K.leftCols(15), V, O), std::invalid_argument);
        for (Index i = 0; i < 5; ++i)
            CHECK(layers[static_cast<std::size_t>(i)].length() == 30 * i + 1);
    }
}

TEMPLATE_TEST_CASE("PagedKVCache: one sequence saves and loads on its own, into a pool of any block size",
                   "[serving][snapshot]", float, Eigen::bfloat16, Q8, Q4Affine) {
    using S = TestType;
    const HeadLayout layout{4, 2, 16, 0};
    PagedKVCache<float, S> pool(layout, 32, 16);
    const Index a = pool.add_sequence(), other = pool.add_sequence();
    const Matrix<float> K = random_matrix<float>(60, 32, 101), V = random_matrix<float>(60, 32, 102);
    pool.extend(a, K.topRows(45), V.topRows(45));
    pool.extend(other, K.topRows(5), V.topRows(5));
    const Index child = pool.fork(a);  // a shares its blocks: the snapshot is its tokens all the same
    std::stringstream stream;
    auto seq = pool.sequence(a);
    memattn::save(seq, stream);
    // Into a pool of blocks of 7, a sequence that held other tokens.
    PagedKVCache<float, S> target(layout, 16, 7);
    const Index b = target.add_sequence();
    target.extend(b, K.topRows(3), V.topRows(3));
    auto loaded = target.sequence(b);
    memattn::load(loaded, stream);
    CHECK(target.length(b) == 45);
    CHECK(target.blocks_in_use() == 7);  // ⌈45 / 7⌉, the 3 tokens' block freed
    const Matrix<float> q = random_matrix<float>(1, 64, 103);
    Matrix<float> expected(1, 64), got(1, 64);
    pool.attend(a, q.row(0), expected.row(0));
    target.attend(b, q.row(0), got.row(0));
    check_close(got, expected.cast<double>(), 2e-5);  // other blocks: other softmax folds
    // Continues as the original does.
    pool.update(a, K.row(45), V.row(45));
    target.update(b, K.row(45), V.row(45));
    pool.attend(a, q.row(0), expected.row(0));
    target.attend(b, q.row(0), got.row(0));
    check_close(got, expected.cast<double>(), 2e-5);
    // Back into a pool of the same block size: bit for bit.
    std::stringstream again;
    memattn::save(seq, again);
    PagedKVCache<float, S> same(layout, 32, 16);
    const Index c = same.add_sequence();
    auto into = same.sequence(c);
    memattn::load(into, again);
    same.attend(c, q.row(0), got.row(0));
    CHECK((got.array() == expected.array()).all());
    // Too few free blocks, another layout, a corrupted stream: SnapshotError or
    // PoolExhausted, the sequence unchanged.
    std::stringstream third;
    memattn::save(seq, third);
    const std::string bytes = third.str();
    PagedKVCache<float, S> small(layout, 3, 16);
    const Index d = small.add_sequence();
    small.extend(d, K.topRows(2), V.topRows(2));
    auto tiny = small.sequence(d);
    std::stringstream copy1(bytes);
    CHECK_THROWS_AS(memattn::load(tiny, copy1), PoolExhausted);
    CHECK(small.length(d) == 2);
    PagedKVCache<float, S> wider(HeadLayout{8, 2, 16, 0}, 32, 16);
    const Index e = wider.add_sequence();
    auto wide = wider.sequence(e);
    std::stringstream copy2(bytes);
    CHECK_THROWS_AS(memattn::load(wide, copy2), SnapshotError);
    std::string corrupt = bytes;
    corrupt[corrupt.size() / 2] = static_cast<char>(corrupt[corrupt.size() / 2] ^ 1);
    std::stringstream copy3(corrupt);
    CHECK_THROWS_AS(memattn::load(into, copy3), SnapshotError);
    CHECK(same.length(c) == 46);
    CHECK(pool.length(child) == 45);
}

TEMPLATE_TEST_CASE("batched_prefill: chunks of prompt equal the multi-head kernel on their sequence's pairs, single "
                   "tokens a decode step, bit for bit",
                   "[serving][batched]", float, Q8) {
    using S = TestType;
    const HeadLayout layout{4, 2, 16, 0};
    const Matrix<float> K0 = random_matrix<float>(100, 32, 111), V0 = random_matrix<float>(100, 32, 112);
    // Sequences: a cached 37 tokens with a forked sibling (sharing a partly filled block),
    // an empty one; chunks of 20, 1, 0 and 9 rows.
    const auto build = [&](PagedKVCache<float, S>& pool) {
        const Index a = pool.add_sequence();
        pool.extend(a, K0.topRows(37), V0.topRows(37));
        const Index b = pool.fork(a);
        const Index c = pool.add_sequence();
        const Index e = pool.add_sequence();
        pool.extend(e, K0.topRows(5), V0.topRows(5));
        return std::vector<Index>{a, b, c, e};
    };
    const std::vector<Index> offsets{0, 20, 21, 21, 30};
    const Matrix<float> Q = random_matrix<float>(30, 64, 113), K = random_matrix<float>(30, 32, 114),
                        V = random_matrix<float>(30, 32, 115);
    // A chunk of rows is the tiled kernel's over the sequence's pairs as stored (so the
    // multi-head kernel's on them, bit for bit); a chunk of one row a decode step.
    PagedKVCache<float, S> one_by_one(layout, 32, 16);
    const std::vector<Index> ids = build(one_by_one);
    const std::vector<Index> cached{37, 37, 0, 5};
    Matrix<float> expected(30, 64);
    for (std::size_t i = 0; i < ids.size(); ++i) {
        const Index r0 = offsets[i], n = offsets[i + 1] - offsets[i];
        if (n == 1) {
            auto seq = one_by_one.sequence(ids[i]);
            auto o = expected.middleRows(r0, n);
            memattn::decode(seq, Q.middleRows(r0, n), K.middleRows(r0, n), V.middleRows(r0, n), o);
        } else if (n > 1) {
            Matrix<float> Ks(cached[i] + n, 32), Vs(cached[i] + n, 32);
            Ks << K0.topRows(cached[i]), K.middleRows(r0, n);
            Vs << V0.topRows(cached[i]), V.middleRows(r0, n);
            multi_head_causal_softmax_attention(Q.middleRows(r0, n), stored_heads<float, S>(Ks, 2),
                                                stored_heads<float, S>(Vs, 2), expected.middleRows(r0, n), layout, {},
                                                {}, SerialExecutor{});
        }
    }
    for (const int threads : {1, 2, 3}) {
        INFO(threads << " threads");
        PagedKVCache<float, S> pool(layout, 32, 16);
        const std::vector<Index> seqs = build(pool);
        const OpenMPExecutor executor{.threads = threads};
        Matrix<float> O(30, 64);
        batched_prefill(pool, seqs, offsets, Q, K, V, O, executor);
        CHECK((O.array() == expected.array()).all());
        CHECK(pool.length(seqs[0]) == 57);
        CHECK(pool.length(seqs[2]) == 0);
        CHECK(pool.length(seqs[3]) == 14);
    }
    // The last sequence's chunk against the double reference: 5 cached tokens, then 9
    // rows each seeing the cache and the rows up to itself (causal, aligned to the end).
    PagedKVCache<float, S> pool(layout, 32, 16);
    const std::vector<Index> seqs = build(pool);
    Matrix<float> O(30, 64);
    batched_prefill(pool, seqs, offsets, Q, K, V, O);
    Matrix<float> Ke(14, 32), Ve(14, 32);
    Ke << K0.topRows(5), K.bottomRows(9);
    Ve << V0.topRows(5), V.bottomRows(9);
    const MatrixD Ks = stored_heads<float, S>(Ke, 2).template cast<double>();
    const MatrixD Vs = stored_heads<float, S>(Ve, 2).template cast<double>();
    for (Index h = 0; h < 4; ++h) {
        const MatrixD exact = reference::softmax_attention(Q.bottomRows(9).middleCols(h * 16, 16).template cast<double>(),
                                                           Ks.middleCols(h / 2 * 16, 16), Vs.middleCols(h / 2 * 16, 16))
                                  .out;
        check_close(O.bottomRows(9).middleCols(h * 16, 16), exact, 2e-5);
    }
    // Bad offsets, and a batch that does not fit: nothing changes.
    const std::vector<Index> short_offsets{0, 20, 30};
    CHECK_THROWS_AS(batched_prefill(pool, seqs, short_offsets, Q, K, V, O), std::invalid_argument);
    // Each error names the function called (not the pool's member behind it).
    CHECK_THROWS_WITH(batched_prefill(pool, seqs, short_offsets, Q, K, V, O), Catch::Contains("memattn::batched_prefill"));
    CHECK_THROWS_WITH(pool.prefill(seqs, short_offsets, Q, K, V, O), Catch::Contains("memattn::PagedKVCache::prefill"));
    CHECK_THROWS_WITH(batched_decode(pool, seqs, Q.topRows(3), K.topRows(4), V.topRows(4), O.topRows(4)),
                      Catch::Contains("memattn::batched_decode"));
    const std::vector<Index> decreasing{0, 20, 10, 21, 30};
    CHECK_THROWS_AS(batched_prefill(pool, seqs, decreasing, Q, K, V, O), std::invalid_argument);
    PagedKVCache<float, S> small(layout, 4, 16);
    const std::vector<Index> few = build(small);  // 3 blocks + 1 for e: all 4 in use
    CHECK_THROWS_AS(batched_prefill(small, few, offsets, Q, K, V, O), PoolExhausted);
    CHECK(small.length(few[0]) == 37);
    CHECK(small.length(few[3]) == 5);
    CHECK(small.blocks_in_use() == 4);
}

TEMPLATE_TEST_CASE("PagedKVCache::prefill: prompts off every tile and block, after cached prefixes, with windows "
                   "and the logit options, equal the multi-head kernel bit for bit on any thread count",
                   "[serving][batched][prefill]", float, Eigen::bfloat16, Q8) {
    using S = TestType;
    const HeadLayout layout{4, 2, 16, 12};  // g = 2, dv ≠ d
    const Index kw = 32, vw = 24;
    const std::vector<double> slopes{0.5, 0.25, 0.125, 0.0625}, sink_logits{0.3, -1.0, 2.0, 0.0};
    struct Case {
        Index block, window, sinks;
        bool logits;
    };
    // Blocks of one token, off every tile and of a whole key tile; windows shorter than a
    // tile, than a block, and longer than the prompt; sinks inside and past a block.
    for (const Case c : {Case{16, 0, 0, false}, Case{1, 0, 0, true}, Case{7, 0, 0, false}, Case{128, 0, 0, true},
                         Case{16, 40, 3, true}, Case{8, 100, 0, false}, Case{32, 200, 17, true}, Case{7, 1, 0, false},
                         Case{5, 1000, 2, false}}) {
        SoftmaxOptions options{.window = c.window, .sink_tokens = c.sinks};
        if (c.logits) {
            options.softcap = 3.0;
            options.alibi_slopes = slopes;
            options.sink_logits = sink_logits;
        }
        // The sanitize build (-O0 under ASan): a prefix within a block and one past three,
        // a prompt of two rows and one past a query tile.
        const std::vector<Index> cached_counts = memattn::test::memory_only
                                                     ? std::vector<Index>{1, 3 * c.block + 2}
                                                     : std::vector<Index>{0, 1, c.block, 3 * c.block + 2};
        const std::vector<Index> row_counts =
            memattn::test::memory_only ? std::vector<Index>{2, 145} : std::vector<Index>{2, 47, 145, 200};
        for (const Index cached : cached_counts) {
            for (const Index rows : row_counts) {
                INFO(detail::storage_name<S> << ": block " << c.block << ", window " << c.window << ", sinks " << c.sinks
                                             << (c.logits ? ", softcap, ALiBi, sink logits" : "") << "; " << cached
                                             << " cached, " << rows << " rows");
                const Index n = cached + rows;
                const auto seed = static_cast<std::uint64_t>(1000 * c.block + 10 * cached + rows);
                const Matrix<float> K = random_matrix<float>(n, kw, seed), V = random_matrix<float>(n, vw, seed + 1),
                                    Q = random_matrix<float>(rows, 64, seed + 2);
                const Matrix<float> Ks = stored_heads<float, S>(K, 2), Vs = stored_heads<float, S>(V, 2);
                Matrix<float> expected(rows, 48);
                multi_head_causal_softmax_attention(Q, Ks, Vs, expected, layout, options, {}, SerialExecutor{});
                std::optional<Matrix<float>> first;
                for (const int threads : {1, 2, 3}) {
                    if (memattn::test::memory_only && threads != 2)  // the sanitize build: one threaded run
                        continue;
                    PagedKVCache<float, S> pool(layout, n / c.block + 4, c.block, options);
                    const Index a = pool.add_sequence();
                    pool.extend(a, K.topRows(cached), V.topRows(cached));
                    Matrix<float> O(rows, 48);
                    const std::vector<Index> seqs{a}, offsets{0, rows};
                    pool.prefill(seqs, offsets, Q, K.bottomRows(rows), V.bottomRows(rows), O,
                                 OpenMPExecutor{.threads = threads});
                    CHECK(pool.length(a) == n);
                    CHECK((O.array() == expected.array()).all());
                    if (first)
                        CHECK((O.array() == first->array()).all());
                    else
                        first = O;
                }
                if (rows != 47)
                    continue;
                // And against the double reference, head by head, from the formulas.
                for (Index h = 0; h < 4; ++h) {
                    reference::Logits logits{.window = c.window, .sink_tokens = c.sinks};
                    if (c.logits) {
                        logits.softcap = 3.0;
                        logits.slope = slopes[static_cast<std::size_t>(h)];
                        logits.sink = sink_logits[static_cast<std::size_t>(h)];
                    }
                    const MatrixD exact =
                        reference::softmax_attention(Q.middleCols(h * 16, 16).template cast<double>(),
                                                     Ks.middleCols(h / 2 * 16, 16).template cast<double>(),
                                                     Vs.middleCols(h / 2 * 12, 12).template cast<double>(), logits)
                            .out;
                    check_close(first->middleCols(h * 12, 12), exact, 2e-5);
                }
            }
        }
    }
}

TEST_CASE("Cascade: the runs of a step that share their first blocks, by the rule of serving/cascade.hpp",
          "[serving][prefix]") {
    // Tables of block ids (blocks of 64 tokens) and lengths: rows 0, 2 and 4 share their
    // first five blocks (320 tokens), rows 1 and 5 their first two (128: too few), row 3
    // alone; row 6 shares row 0's first four blocks only.
    const std::vector<std::vector<Index>> tables{{1, 2, 3, 4, 5, 9},  {7, 8, 20},   {1, 2, 3, 4, 5, 6, 11},
                                                 {30, 31, 32, 33, 34}, {1, 2, 3, 4, 5, 12}, {7, 8, 21},
                                                 {1, 2, 3, 4, 40, 41}};
    const std::vector<Index> lengths{330, 130, 400, 300, 321, 140, 350};
    const auto table = [&](Index r) { return std::span<const Index>(tables[static_cast<std::size_t>(r)]); };
    const auto length = [&](Index r) { return lengths[static_cast<std::size_t>(r)]; };
    std::vector<Index> order;
    std::vector<detail::SharedRun> runs;
    CHECK(detail::find_shared_runs(6, 64, table, length, order, runs));
    REQUIRE(runs.size() == 1);
    CHECK(runs[0].count == 3);
    CHECK(runs[0].blocks == 5);
    std::vector<Index> members(order.begin() + runs[0].first, order.begin() + runs[0].first + runs[0].count);
    CHECK(members == std::vector<Index>{0, 2, 4});
    // With row 6 the run of first block 1 shares four blocks (256 tokens: still enough).
    CHECK(detail::find_shared_runs(7, 64, table, length, order, runs));
    REQUIRE(runs.size() == 1);
    CHECK(runs[0].count == 4);
    CHECK(runs[0].blocks == 4);
    // A block a member does not yet fill is not shared (row 4 holds 321 tokens: 5 blocks).
    const std::vector<Index> short_lengths{330, 130, 400, 300, 300, 140, 350};
    CHECK(detail::find_shared_runs(6, 64, table, [&](Index r) { return short_lengths[static_cast<std::size_t>(r)]; },
                                   order, runs));
    CHECK(runs[0].blocks == 4);
    // Items: each run in chunks of `chunk` sequences per KV head, every other row alone.
    std::vector<detail::CascadeItem> items;
    CHECK(detail::find_shared_runs(6, 64, table, length, order, runs));
    detail::plan_cascade(6, 2, 2, order, runs, items);
    Index shared_items = 0, plain_items = 0;
    for (const auto& item : items)
        (item.run >= 0 ? shared_items : plain_items) += 1;
    CHECK(shared_items == 2 * 2);  // 3 members in chunks of 2, for 2 KV heads
    CHECK(plain_items == 3 * 2);
}

TEMPLATE_TEST_CASE("batched_decode: forks of one prompt attend their shared blocks together and equal unshared "
                   "sequences within rounding, the same bits on any thread count",
                   "[serving][batched][prefix]", float, Eigen::bfloat16, Q8) {
    using S = TestType;
    const std::vector<double> sinks4{0.5, -0.25, 1.0, 0.0}, sinks16(16, 0.75);
    struct Case {
        HeadLayout layout;
        Index block, prompt;
        bool logits;
    };
    for (const Case c : {Case{{8, 2, 16, 0}, 16, 300, false}, Case{{4, 4, 8, 12}, 128, 256, true},
                         Case{{16, 2, 8, 0}, 7, 700, false}, Case{{4, 2, 16, 0}, 64, 1000, true}}) {
        const HeadLayout& layout = c.layout;
        SoftmaxOptions options{};
        if (c.logits) {
            options.softcap = 5.0;
            options.sink_logits = layout.q_heads == 4 ? std::span<const double>(sinks4) : std::span<const double>(sinks16);
        }
        INFO(detail::storage_name<S> << ": " << layout.q_heads << "/" << layout.kv_heads << ", block " << c.block
                                     << ", prompt " << c.prompt);
        const Index kw = layout.kv_heads * layout.head_dim, vw = layout.kv_heads * layout.values();
        const Index forks = 6, steps = 3;
        const Matrix<float> K = random_matrix<float>(c.prompt + 64, kw, 201), V = random_matrix<float>(c.prompt + 64, vw, 202);
        // Each fork's own tokens after the prompt: fork i brings i (0..5) of them; a seventh
        // sequence is unrelated.
        std::vector<Matrix<float>> own_keys, own_values;
        for (Index i = 0; i <= forks; ++i) {
            own_keys.push_back(random_matrix<float>(i, kw, 210 + static_cast<std::uint64_t>(i)));
            own_values.push_back(random_matrix<float>(i, vw, 220 + static_cast<std::uint64_t>(i)));
        }
        const Index blocks = 2 * (forks + 2) * ((c.prompt + 16 + c.block - 1) / c.block + 2);
        PagedKVCache<float, S> shared(layout, blocks, c.block, options), alone(layout, blocks, c.block, options);
        const Index root = shared.add_sequence();
        shared.extend(root, K.topRows(c.prompt), V.topRows(c.prompt));
        std::vector<Index> a, b;  // the batch in the shared pool, and in the pool of separate sequences
        for (Index i = 0; i < forks; ++i) {
            const Index f = shared.fork(root);
            shared.extend(f, own_keys[static_cast<std::size_t>(i)], own_values[static_cast<std::size_t>(i)]);
            a.push_back(f);
            const Index s = alone.add_sequence();
            alone.extend(s, K.topRows(c.prompt), V.topRows(c.prompt));
            alone.extend(s, own_keys[static_cast<std::size_t>(i)], own_values[static_cast<std::size_t>(i)]);
            b.push_back(s);
        }
        const Index other = shared.add_sequence(), other_alone = alone.add_sequence();
        shared.extend(other, K.bottomRows(64), V.bottomRows(64));
        alone.extend(other_alone, K.bottomRows(64), V.bottomRows(64));
        a.insert(a.begin() + 2, other);
        b.insert(b.begin() + 2, other_alone);
        shared.remove(root);
        for (Index t = 0; t < steps; ++t) {
            const Index batch = forks + 1;
            const Matrix<float> Q = random_matrix<float>(batch, shared.query_dim(), 230 + static_cast<std::uint64_t>(t)),
                                Kt = random_matrix<float>(batch, kw, 240 + static_cast<std::uint64_t>(t)),
                                Vt = random_matrix<float>(batch, vw, 250 + static_cast<std::uint64_t>(t));
            Matrix<float> expected(batch, shared.output_dim());
            batched_decode(alone, b, Q, Kt, Vt, expected);
            std::optional<Matrix<float>> first;
            for (const int threads : {1, 2, 3}) {
                PagedKVCache<float, S> pool = shared;  // the same step on a copy, each thread count
                Matrix<float> O(batch, shared.output_dim());
                batched_decode(pool, a, Q, Kt, Vt, O, OpenMPExecutor{.threads = threads});
                check_close(O, expected.template cast<double>(), 2e-5);
                if (first)
                    CHECK((O.array() == first->array()).all());
                else
                    first = O;
                if (threads == 3)
                    shared = pool;
            }
            CHECK(shared.blocks_in_use() < alone.blocks_in_use());
        }
        for (std::size_t i = 0; i < a.size(); ++i)
            CHECK(shared.length(a[i]) == alone.length(b[i]));
    }
}

TEST_CASE("Prefix sharing: 16 sequences forked from one 2048-token prompt hold it once and decode on their own",
          "[serving][prefix]") {
    const HeadLayout layout{4, 2, 8, 0};
    const Index prompt = 2048, forks = 16, steps = 5;
    PagedKVCache<float, Eigen::bfloat16> pool(layout, prompt / 128 + forks + 1);
    const Matrix<float> K = random_matrix<float>(prompt, 16, 121), V = random_matrix<float>(prompt, 16, 122);
    const Index root = pool.add_sequence();
    pool.extend(root, K, V);
    std::vector<Index> seqs;
    for (Index i = 0; i < forks; ++i)
        seqs.push_back(pool.fork(root));
    CHECK(pool.blocks_in_use() == prompt / 128);  // the prompt's blocks, once
    pool.remove(root);
    CHECK(pool.blocks_in_use() == prompt / 128);  // still held by the forks
    // Private caches of the same tokens, one layer per sequence.
    std::vector<MultiHead<KVCache<float, Eigen::bfloat16>>> private_layers;
    for (Index i = 0; i < forks; ++i) {
        private_layers.emplace_back(layout, [](Index) { return KVCache<float, Eigen::bfloat16>(8, 8); });
        memattn::extend(private_layers.back(), K, V);
    }
    for (Index t = 0; t < steps; ++t) {
        const Matrix<float> Q = random_matrix<float>(forks, 32, 130 + static_cast<std::uint64_t>(t)),
                            Kt = random_matrix<float>(forks, 16, 140 + static_cast<std::uint64_t>(t)),
                            Vt = random_matrix<float>(forks, 16, 150 + static_cast<std::uint64_t>(t));
        Matrix<float> O(forks, 32), expected(forks, 32);
        batched_decode(pool, seqs, Q, Kt, Vt, O);
        for (Index i = 0; i < forks; ++i) {
            auto& layer = private_layers[static_cast<std::size_t>(i)];
            layer.update(Kt.row(i), Vt.row(i));
            layer.attend(Q.row(i), expected.row(i));
        }
        check_close(O, expected.cast<double>(), 2e-5);
    }
    CHECK(pool.blocks_in_use() == prompt / 128 + forks);  // each took one block of its own
    std::size_t private_bytes = 0;
    for (const auto& layer : private_layers)
        private_bytes += layer.footprint();
    // The blocks in use (128 tokens × 2 KV heads × K and V × 8 values × 2 bytes each)
    // against 16 private caches of 2053 tokens: under an eighth.
    const std::size_t held = static_cast<std::size_t>(pool.blocks_in_use()) * 128 * 2 * 2 * 8 * 2;
    CHECK(held < private_bytes / 8);
    CHECK(private_bytes >= static_cast<std::size_t>(forks * (prompt + steps)) * 2 * 2 * 8 * 2);
}

namespace {
/// Runs serially and counts the parallel_for calls it is given.
struct CountingExecutor {
    mutable int calls = 0;
    [[nodiscard]] int concurrency() const { return 2; }
    template <class F>
    void parallel_for(Index n, F&& f) const {
        ++calls;
        for (Index i = 0; i < n; ++i)
            f(i);
    }
};
static_assert(Executor<CountingExecutor>);
}  // namespace

TEST_CASE("PagedKVCache: batched calls run on the pool's executor unless given one", "[serving][threads]") {
    const HeadLayout layout{32, 8, 32, 0};
    PagedKVCache<float> pool(layout, 64, 64);
    const Index a = pool.add_sequence(), b = pool.add_sequence();
    pool.extend(a, random_matrix<float>(1000, 256, 161), random_matrix<float>(1000, 256, 162));
    pool.extend(b, random_matrix<float>(900, 256, 163), random_matrix<float>(900, 256, 164));
    const CountingExecutor mine, given;
    pool.set_executor(mine);
    const std::vector<Index> seqs{a, b};
    const Matrix<float> Q = random_matrix<float>(2, 1024, 165), K = random_matrix<float>(2, 256, 166),
                        V = random_matrix<float>(2, 256, 167);
    Matrix<float> O(2, 1024), O2(2, 1024);
    batched_decode(pool, seqs, Q, K, V, O);
    CHECK(mine.calls == 1);
    const std::vector<Index> offsets{0, 1, 2};
    batched_prefill(pool, seqs, offsets, Q, K, V, O2);
    CHECK(mine.calls == 2);
    batched_decode(pool, seqs, Q, K, V, O, given);
    CHECK(mine.calls == 2);
    CHECK(given.calls == 1);
}

TEMPLATE_TEST_CASE("PagedKVCache with a window: each step equals the windowed reference, and the blocks out of the "
                   "window are freed",
                   "[serving][window]", float, Eigen::bfloat16, Q8) {
    using S = TestType;
    const HeadLayout layout{4, 2, 8, 0};
    const Index kw = 16, vw = 16;
    // window below, at and above the block, sinks none, inside one block and past one.
    for (const auto& [window, sinks, block] :
         {std::tuple<Index, Index, Index>{5, 0, 8}, {8, 3, 8}, {20, 2, 8}, {33, 17, 8}, {1, 0, 1}, {7, 9, 4},
          {64, 4, 16}, {300, 2, 16}}) {
        INFO(detail::storage_name<S> << ": window " << window << ", sinks " << sinks << ", block " << block);
        const Index n = 150;
        const Index bound = (sinks + block - 1) / block + (window + block - 1) / block + 1;
        PagedKVCache<float, S> pool(layout, bound + 2, block, SoftmaxOptions{.window = window, .sink_tokens = sinks});
        CHECK(pool.window() == window);
        CHECK(pool.sink_tokens() == sinks);
        const Index seq = pool.add_sequence();
        const Matrix<float> K = random_matrix<float>(n, kw, 21), V = random_matrix<float>(n, vw, 22);
        const Matrix<float> Q = random_matrix<float>(n, pool.query_dim(), 23, 2.0);
        const MatrixD Ks = stored_heads<float, S>(K, 2).template cast<double>();
        const MatrixD Vs = stored_heads<float, S>(V, 2).template cast<double>();
        // A windowed sequence never holds more than its bound, however long (the pool holds
        // bound + 2 blocks: 150 tokens would need far more without the window).
        Matrix<float> o(1, pool.output_dim());
        for (Index t = 0; t < n; ++t) {
            pool.update(seq, K.row(t), V.row(t));
            pool.attend(seq, Q.row(t), o.row(0));
            CHECK(pool.blocks_of(seq) <= bound);
            const Index keep = std::max(sinks, t + 1 - window);  // held: the sinks and the blocks reaching keep
            const Index sink_blocks = (std::min(sinks, t + 1) + block - 1) / block;
            const Index window_blocks = (t + 1 + block - 1) / block - std::max(keep / block, sink_blocks);
            CHECK(pool.blocks_of(seq) == sink_blocks + std::max<Index>(window_blocks, 0));
            check_close(o,
                        paged_reference(layout, Q.row(t).template cast<double>(), Ks.topRows(t + 1), Vs.topRows(t + 1),
                                        window, sinks),
                        2e-5);
        }
        CHECK(pool.blocks_in_use() == pool.blocks_of(seq));
        // The same tokens through a private sliding-window layer.
        const Index w = window, s = sinks;  // a lambda cannot capture a binding (C++20)
        MultiHead<SlidingWindowCache<float, S>> layer(layout,
                                                      [w, s](Index) { return SlidingWindowCache<float, S>(8, 8, w, s); });
        memattn::extend(layer, K, V);
        Matrix<float> expected(1, pool.output_dim());
        layer.attend(Q.row(n - 1), expected.row(0));
        check_close(o, expected.template cast<double>(), 2e-5);
    }
}

TEST_CASE("PagedKVCache with a window: no window passed is the plain pool bit for bit; forks free a block once "
          "every holder's window has left it",
          "[serving][window]") {
    const HeadLayout layout{8, 2, 16, 0};
    const Index n = 100;
    const Matrix<float> K = random_matrix<float>(n + 40, 32, 31), V = random_matrix<float>(n + 40, 32, 32);
    const Matrix<float> Q = random_matrix<float>(n + 40, 128, 33, 2.0);
    PagedKVCache<float> plain(layout, 64, 16), windowed(layout, 64, 16, SoftmaxOptions{.window = 120, .sink_tokens = 4});
    const Index a = plain.add_sequence(), b = windowed.add_sequence();
    Matrix<float> oa(1, 128), ob(1, 128);
    for (Index t = 0; t < n; ++t) {  // length ≤ window + sinks: every token visible
        plain.update(a, K.row(t), V.row(t));
        windowed.update(b, K.row(t), V.row(t));
        plain.attend(a, Q.row(t), oa.row(0));
        windowed.attend(b, Q.row(t), ob.row(0));
        REQUIRE((oa.array() == ob.array()).all());
    }
    // Fork at 100 tokens; the parent runs 40 tokens ahead, the child stays.
    PagedKVCache<float> pool(layout, 64, 16, SoftmaxOptions{.window = 24});
    const Index parent = pool.add_sequence();
    pool.extend(parent, K.topRows(n), V.topRows(n));  // keeps tokens ≥ 76: blocks 4..6
    CHECK(pool.blocks_of(parent) == 3);
    const Index child = pool.fork(parent);
    CHECK(pool.blocks_in_use() == 3);
    pool.extend(parent, K.middleRows(n, 40), V.middleRows(n, 40));  // keeps tokens ≥ 116: blocks 7..8
    CHECK(pool.blocks_of(parent) == 2);
    // The child still holds blocks 4..6 (block 6, partly filled, was copied by the parent).
    CHECK(pool.blocks_of(child) == 3);
    CHECK(pool.blocks_in_use() == 5);
    Matrix<float> o(1, 128);
    pool.attend(child, Q.row(n - 1), o.row(0));
    check_close(o,
                paged_reference(layout, Q.row(n - 1).cast<double>(), K.topRows(n).cast<double>(),
                                V.topRows(n).cast<double>(), 24, 0),
                2e-5);
    pool.remove(child);
    CHECK(pool.blocks_in_use() == 2);
}

TEST_CASE("PagedKVCache with a window: rollback within what is held, refused past it; a mixed batch equals each "
          "sequence's own steps; snapshots",
          "[serving][window]") {
    const HeadLayout layout{4, 2, 8, 0};
    const SoftmaxOptions options{.window = 20, .sink_tokens = 3};
    PagedKVCache<float> pool(layout, 40, 8, options);
    const Matrix<float> K = random_matrix<float>(200, 16, 41), V = random_matrix<float>(200, 16, 42);
    const Matrix<float> Q = random_matrix<float>(200, 32, 43, 2.0);
    const Index seq = pool.add_sequence();
    pool.extend(seq, K.topRows(60), V.topRows(60));  // keeps tokens ≥ 40: the sink block, blocks 5..7
    CHECK(pool.blocks_of(seq) == 4);
    CHECK(pool.can_truncate(seq, 60));
    CHECK_FALSE(pool.can_truncate(seq, 45));  // its last query sees 25..44: freed
    CHECK_FALSE(pool.can_truncate(seq, 59));  // sees 39..58: token 39 was freed
    CHECK_FALSE(pool.can_truncate(seq, 61));
    CHECK_FALSE(pool.can_truncate(seq + 1, 0));
    CHECK(pool.can_truncate(seq, 3));        // the sinks alone
    CHECK(pool.can_truncate(seq, 0));
    CHECK_THROWS_AS(pool.truncate(seq, 59), std::invalid_argument);
    CHECK(pool.length(seq) == 60);
    CHECK(pool.blocks_of(seq) == 4);
    // A rollback of two tokens then the same tokens again: as if it had never happened.
    Matrix<float> before(1, 32), after(1, 32);
    pool.attend(seq, Q.row(59), before.row(0));
    pool.truncate(seq, 60);
    pool.truncate(seq, 60);
    pool.attend(seq, Q.row(59), after.row(0));
    CHECK((before.array() == after.array()).all());
    // Three tokens on, the rollback of three reaches back to token 40 only: allowed.
    pool.extend(seq, K.middleRows(60, 3), V.middleRows(60, 3));
    CHECK(pool.blocks_of(seq) == 4);
    CHECK(pool.can_truncate(seq, 60));
    pool.truncate(seq, 60);
    pool.attend(seq, Q.row(59), after.row(0));
    CHECK((before.array() == after.array()).all());
    // To the sinks alone: the window's blocks go, the sink block stays.
    const Index probe = pool.fork(seq);
    pool.truncate(probe, 2);
    CHECK(pool.blocks_of(probe) == 1);
    CHECK(pool.can_truncate(probe, 2));
    pool.extend(probe, K.middleRows(2, 30), V.middleRows(2, 30));
    Matrix<float> probe_out(1, 32);
    pool.attend(probe, Q.row(31), probe_out.row(0));
    check_close(probe_out,
                paged_reference(layout, Q.row(31).cast<double>(), K.topRows(32).cast<double>(),
                                V.topRows(32).cast<double>(), 20, 3),
                2e-5);
    pool.remove(probe);

    // A mixed batch: chunks beside tokens. A token is bit for bit its own update then
    // attend, a chunk the multi-head kernel on its sequence's pairs (and within rounding
    // its own steps).
    PagedKVCache<float> batch_pool(layout, 80, 8, options), step_pool(layout, 80, 8, options);
    std::vector<Index> seqs;
    for (Index i = 0; i < 4; ++i) {
        seqs.push_back(batch_pool.add_sequence());
        step_pool.add_sequence();
        batch_pool.extend(seqs.back(), K.topRows(10 * i), V.topRows(10 * i));
        step_pool.extend(seqs.back(), K.topRows(10 * i), V.topRows(10 * i));
    }
    const std::vector<Index> offsets{0, 45, 46, 46, 80};  // a long chunk, one token, none, a chunk
    Matrix<float> O(80, 32), expected(80, 32);
    batched_prefill(batch_pool, seqs, offsets, Q.topRows(80), K.middleRows(100, 80), V.middleRows(100, 80), O);
    for (std::size_t i = 0; i < seqs.size(); ++i)
        for (Index r = offsets[i]; r < offsets[i + 1]; ++r) {
            step_pool.update(seqs[i], K.row(100 + r), V.row(100 + r));
            step_pool.attend(seqs[i], Q.row(r), expected.row(r));
        }
    check_close(O, expected.cast<double>(), 2e-5);
    for (std::size_t i = 0; i < seqs.size(); ++i) {
        const Index r0 = offsets[i], rows = offsets[i + 1] - r0, cached = 10 * static_cast<Index>(i);
        if (rows < 2)
            continue;
        Matrix<float> Ks(cached + rows, 16), Vs(cached + rows, 16);
        Ks << K.topRows(cached), K.middleRows(100 + r0, rows);
        Vs << V.topRows(cached), V.middleRows(100 + r0, rows);
        expected.middleRows(r0, rows) = layer_rows(layout, Q.middleRows(r0, rows), Ks, Vs, options);
    }
    CHECK((O.array() == expected.array()).all());
    for (const Index id : seqs) {
        CHECK(batch_pool.length(id) == step_pool.length(id));
        CHECK(batch_pool.blocks_of(id) == step_pool.blocks_of(id));
    }

    // A snapshot holds the sinks and the held tokens; it loads into a pool of another
    // block size with the same window, and both continue alike.
    std::stringstream bytes;
    memattn::save(pool.sequence(seq), bytes);
    PagedKVCache<float> other(layout, 40, 5, options);
    const Index loaded = other.add_sequence();
    auto view = other.sequence(loaded);
    memattn::load(view, bytes);
    CHECK(other.length(loaded) == 60);
    CHECK_FALSE(other.can_truncate(loaded, 59));
    for (Index t = 60; t < 90; ++t) {
        pool.update(seq, K.row(t), V.row(t));
        other.update(loaded, K.row(t), V.row(t));
        Matrix<float> x(1, 32), y(1, 32);
        pool.attend(seq, Q.row(t), x.row(0));
        other.attend(loaded, Q.row(t), y.row(0));
        check_close(x, y.cast<double>(), 1e-6);
    }
    // Another window is another layer: refused.
    std::stringstream again;
    memattn::save(pool.sequence(seq), again);
    PagedKVCache<float> unwindowed(layout, 40, 8);
    const Index target = unwindowed.add_sequence();
    auto target_view = unwindowed.sequence(target);
    CHECK_THROWS_AS(memattn::load(target_view, again), SnapshotError);
    CHECK(unwindowed.length(target) == 0);
}

TEST_CASE("batched_prefill over a span of memories equals each memory's own prefill", "[serving][batched]") {
    const HeadLayout layout{4, 2, 8, 0};
    const auto make = [&] {
        std::vector<MultiHead<SlidingWindowCache<float>>> layers;
        for (Index i = 0; i < 4; ++i)
            layers.emplace_back(layout, [](Index) { return SlidingWindowCache<float>(8, 8, 24, 2); });
        for (Index i = 0; i < 4; ++i)
            memattn::extend(layers[static_cast<std::size_t>(i)], random_matrix<float>(15 * i, 16, 51),
                            random_matrix<float>(15 * i, 16, 52));
        return layers;
    };
    const Matrix<float> Q = random_matrix<float>(70, 32, 53), K = random_matrix<float>(70, 16, 54),
                        V = random_matrix<float>(70, 16, 55);
    const std::vector<Index> offsets{0, 1, 41, 41, 70};
    auto separate = make();
    Matrix<float> expected(70, 32);
    for (std::size_t i = 0; i < 4; ++i) {
        const Index r = offsets[i], c = offsets[i + 1] - offsets[i];
        memattn::prefill(separate[i], Q.middleRows(r, c), K.middleRows(r, c), V.middleRows(r, c),
                         expected.middleRows(r, c));
    }
    for (const int threads : {1, 2}) {
        auto layers = make();
        Matrix<float> O(70, 32);
        batched_prefill(std::span(layers), offsets, Q, K, V, O, OpenMPExecutor{.threads = threads});
        CHECK((O.array() == expected.array()).all());
        // Offsets that do not fit, or a row a memory refuses, change none of them.
        CHECK_THROWS_AS(batched_prefill(std::span(layers), std::vector<Index>{0, 1, 41, 70}, Q, K, V, O),
                        std::invalid_argument);
        CHECK_THROWS_AS(batched_prefill(std::span(layers), std::vector<Index>{0, 1, 42, 41, 70}, Q, K, V, O),
                        std::invalid_argument);
        CHECK_THROWS_AS(batched_prefill(std::span(layers), offsets, Q.topRows(69), K, V, O), std::invalid_argument);
        for (Index i = 0; i < 4; ++i)
            CHECK(layers[static_cast<std::size_t>(i)].length() == 15 * i + offsets[static_cast<std::size_t>(i) + 1] -
                                                                   offsets[static_cast<std::size_t>(i)]);
    }
    // The recurrent layers of a hybrid model batch the same way.
    std::vector<GatedLinearAttentionMemory<double>> gated;
    for (Index i = 0; i < 3; ++i)
        gated.emplace_back(4, 3);
    const MatrixD Qg = random_matrix<double>(9, 4, 56), Vg = random_matrix<double>(9, 3, 58);
    MatrixD Kg = random_matrix<double>(9, 5, 57);
    Kg.col(4) = -0.1 * Kg.col(4).cwiseAbs();  // the log-gate column
    std::vector<GatedLinearAttentionMemory<double>> own = gated;
    const std::vector<Index> go{0, 4, 5, 9};
    MatrixD Og(9, 3), Eg(9, 3);
    batched_prefill(std::span(gated), go, Qg, Kg, Vg, Og);
    for (std::size_t i = 0; i < 3; ++i) {
        const Index r = go[i], c = go[i + 1] - go[i];
        memattn::prefill(own[i], Qg.middleRows(r, c), Kg.middleRows(r, c), Vg.middleRows(r, c), Eg.middleRows(r, c));
    }
    CHECK((Og.array() == Eg.array()).all());
}

TEMPLATE_TEST_CASE("PagedKVCache with softcap, ALiBi and sink logits: each step equals the reference per query "
                   "head, in every route of the grouped attend",
                   "[serving][options]", float, Eigen::bfloat16) {
    using S = TestType;
    // g = 1 (one query), 4 (the tiles route under AVX2/AVX-512), 16 (the tiled route).
    for (const HeadLayout& layout : {HeadLayout{2, 2, 16, 0}, HeadLayout{8, 2, 16, 0}, HeadLayout{32, 2, 16, 0}}) {
        std::vector<double> slopes, sinks;
        for (Index h = 0; h < layout.q_heads; ++h) {
            slopes.push_back(std::pow(2.0, -8.0 * static_cast<double>(h + 1) / static_cast<double>(layout.q_heads)));
            sinks.push_back(0.25 * static_cast<double>(h % 5) - 0.5);
        }
        for (const Index window : {Index{0}, Index{70}}) {
            const SoftmaxOptions options{.window = window, .sink_tokens = window > 0 ? 3 : 0, .softcap = 4,
                                         .sink_logits = sinks, .alibi_slopes = slopes};
            INFO(detail::storage_name<S> << ", " << layout.q_heads << "/" << layout.kv_heads << ", window " << window);
            PagedKVCache<float, S> pool(layout, 40, 16, options);
            CHECK(pool.options().softcap == 4);
            CHECK(pool.options().alibi_slopes.size() == slopes.size());
            const Index n = 260, kw = 32;
            const Matrix<float> K = random_matrix<float>(n, kw, 61, 2.0), V = random_matrix<float>(n, kw, 62);
            const Matrix<float> Q = random_matrix<float>(n, pool.query_dim(), 63, 2.0);
            const MatrixD Ks = stored_heads<float, S>(K, 2).template cast<double>();
            const MatrixD Vs = stored_heads<float, S>(V, 2).template cast<double>();
            const Index seq = pool.add_sequence();
            Matrix<float> o(1, pool.output_dim());
            const Index g = layout.group_size();
            for (Index t = 0; t < n; ++t) {
                pool.update(seq, K.row(t), V.row(t));
                pool.attend(seq, Q.row(t), o.row(0));
                if (t % 37 != 0 && t != n - 1)
                    continue;
                for (Index h = 0; h < layout.q_heads; ++h) {
                    const Index kv = h / g;
                    const reference::SoftmaxResult expected = reference::softmax_attention(
                        Q.block(t, h * 16, 1, 16).template cast<double>(), Ks.block(0, kv * 16, t + 1, 16),
                        Vs.block(0, kv * 16, t + 1, 16),
                        reference::Logits{.window = window, .sink_tokens = options.sink_tokens, .softcap = 4,
                                          .slope = slopes[static_cast<std::size_t>(h)],
                                          .sink = sinks[static_cast<std::size_t>(h)]});
                    INFO("t = " << t << ", head " << h);
                    check_close(o.block(0, h * 16, 1, 16), expected.out, 3e-5);
                }
            }
            // A mixed batch: the token what its own step gave, the chunk the multi-head kernel's
            // rows on the stored pairs (and within rounding its own steps).
            PagedKVCache<float, S> batch_pool(layout, 40, 16, options), step_pool(layout, 40, 16, options);
            const Index a = batch_pool.add_sequence(), b = batch_pool.add_sequence();
            step_pool.add_sequence();
            step_pool.add_sequence();
            const std::vector<Index> seqs{a, b}, offsets{0, 30, 31};
            Matrix<float> O(31, pool.output_dim()), expected(31, pool.output_dim());
            batched_prefill(batch_pool, seqs, offsets, Q.topRows(31), K.topRows(31), V.topRows(31), O);
            for (Index r = 0; r < 31; ++r) {
                const Index id = r < 30 ? a : b;
                step_pool.update(id, K.row(r), V.row(r));
                step_pool.attend(id, Q.row(r), expected.row(r));
            }
            check_close(O, expected.cast<double>(), 3e-5);
            expected.topRows(30) = layer_rows(layout, Q.topRows(30), stored_heads<float, S>(K.topRows(30), 2),
                                              stored_heads<float, S>(V.topRows(30), 2), options);
            CHECK((O.array() == expected.array()).all());
        }
    }
    // Bad options: refused by name.
    const std::vector<double> three{1, 2, 3};
    CHECK_THROWS_WITH((PagedKVCache<float>(HeadLayout{4, 2, 8, 0}, 4, 16, SoftmaxOptions{.sink_logits = three})),
                      Catch::Contains("options.sink_logits"));
    CHECK_THROWS_WITH((PagedKVCache<float>(HeadLayout{4, 2, 8, 0}, 4, 16, SoftmaxOptions{.causal = false})),
                      Catch::Contains("options.causal"));
}

TEST_CASE("ModelCache: one id space over layers of their own, each layer's step bit for bit its own pool's",
          "[serving][model]") {
    const std::vector<ModelLayer> specs{{.layout = {4, 2, 8, 0}, .blocks = 40, .block_size = 16},
                                        {.layout = {8, 2, 8, 0},
                                         .blocks = 40,
                                         .block_size = 8,
                                         .options = {.window = 20, .sink_tokens = 2}},
                                        {.layout = {2, 1, 16, 8}, .blocks = 40, .block_size = 32}};
    ModelCache<float> cache(specs);
    std::vector<PagedKVCache<float>> pools;  // the same calls on independent pools
    for (const ModelLayer& l : specs)
        pools.emplace_back(l.layout, l.blocks, l.block_size, l.options);
    CHECK(cache.layers() == 3);
    const Index a = cache.add_sequence(), b = cache.add_sequence();
    for (auto& p : pools) {
        CHECK(p.add_sequence() == cache.slot_of(a));
        CHECK(p.add_sequence() == cache.slot_of(b));
    }
    // A prompt for a, then a fork of it, then mixed steps.
    const auto run = [&](const std::vector<Index>& ids, const std::vector<Index>& offsets, std::uint64_t seed) {
        const auto& step = cache.plan(ids, offsets);
        const Index rows = offsets.back();
        for (Index l = 0; l < cache.layers(); ++l) {
            PagedKVCache<float>& own = pools[static_cast<std::size_t>(l)];
            const Matrix<float> Q = random_matrix<float>(rows, own.query_dim(), seed + 10 * static_cast<std::uint64_t>(l)),
                                K = random_matrix<float>(rows, own.key_dim(), seed + 10 * static_cast<std::uint64_t>(l) + 1),
                                V = random_matrix<float>(rows, own.value_dim(), seed + 10 * static_cast<std::uint64_t>(l) + 2);
            Matrix<float> O(rows, own.output_dim()), expected(rows, own.output_dim());
            cache.prefill(l, step, Q, K, V, O);
            batched_prefill(own, step.slots(), step.q_offsets(), Q, K, V, expected);
            CHECK((O.array() == expected.array()).all());
        }
    };
    run({a}, {0, 70}, 300);
    const Index c = cache.fork(a);
    for (auto& p : pools)
        CHECK(p.fork(cache.slot_of(a)) == cache.slot_of(c));
    run({a, b, c}, {0, 1, 12, 13}, 310);
    CHECK(cache.length(a) == 71);
    CHECK(cache.length(b) == 11);
    CHECK(cache.length(c) == 71);
    // A decode step through plan_decode and decode.
    {
        const std::vector<Index> ids{c, a};
        const auto& step = cache.plan_decode(ids);
        CHECK(step.decode());
        for (Index l = 0; l < cache.layers(); ++l) {
            PagedKVCache<float>& own = pools[static_cast<std::size_t>(l)];
            const Matrix<float> Q = random_matrix<float>(2, own.query_dim(), 320), K = random_matrix<float>(2, own.key_dim(), 321),
                                V = random_matrix<float>(2, own.value_dim(), 322);
            Matrix<float> O(2, own.output_dim()), expected(2, own.output_dim());
            cache.decode(l, step, Q, K, V, O);
            batched_decode(own, step.slots(), Q, K, V, expected);
            CHECK((O.array() == expected.array()).all());
        }
    }
    // Rollback of a step that reached only the first layer: every layer as before.
    {
        const std::vector<Index> ids{b};
        const auto& step = cache.plan_decode(ids);
        const Matrix<float> Q = random_matrix<float>(1, pools[0].query_dim(), 330),
                            K = random_matrix<float>(1, pools[0].key_dim(), 331),
                            V = random_matrix<float>(1, pools[0].value_dim(), 332);
        Matrix<float> O(1, pools[0].output_dim());
        cache.decode(0, step, Q, K, V, O);
        CHECK(cache.layer(0).length(cache.slot_of(b)) == 12);
        cache.rollback(step);
        for (Index l = 0; l < cache.layers(); ++l)
            CHECK(cache.layer(l).length(cache.slot_of(b)) == 11);
    }
    // truncate: all or nothing across a windowed layer.
    CHECK_FALSE(cache.can_truncate(a, 10));  // the window-20 layer freed what 10 tokens need
    CHECK_THROWS_WITH(cache.truncate(a, 10), Catch::Contains("layer 1"));
    for (Index l = 0; l < cache.layers(); ++l)
        CHECK(cache.layer(l).length(cache.slot_of(a)) == 72);
    cache.truncate(a, 70);
    CHECK(cache.length(a) == 70);
    // Ids never go stale: a removed id is refused, and so is a pool's slot.
    const Index old = b, old_slot = cache.slot_of(b);
    cache.remove(b);
    CHECK_FALSE(cache.contains(old));
    CHECK_THROWS_WITH(cache.length(old), Catch::Contains("was removed"));
    const Index d = cache.add_sequence();
    CHECK(cache.slot_of(d) == old_slot);  // the slot is reused, the id is not
    CHECK(d != old);
    CHECK_THROWS_WITH(cache.fork(old), Catch::Contains("was removed"));
    CHECK_THROWS_WITH(cache.length(old_slot), Catch::Contains("not a ModelCache id"));
    CHECK_THROWS_WITH(cache.remove(d + (Index{5} << 32)), Catch::Contains("never gave"));
    const std::vector<Index> stale{a, old};
    CHECK_THROWS_WITH(cache.plan_decode(stale), Catch::Contains("was removed"));
    const std::vector<Index> twice{a, a};
    CHECK_THROWS_WITH(cache.plan_decode(twice), Catch::Contains("twice"));
}

TEST_CASE("ModelCache: random operations against independent pools; a step the last layer cannot hold is refused "
          "before any layer moves",
          "[serving][model]") {
    // The last layer has the fewest blocks, so it runs out first.
    const std::vector<ModelLayer> specs{{.layout = {2, 1, 4, 0}, .blocks = 60, .block_size = 4},
                                        {.layout = {4, 2, 4, 0},
                                         .blocks = 60,
                                         .block_size = 3,
                                         .options = {.window = 7, .sink_tokens = 1}},
                                        {.layout = {2, 2, 4, 0}, .blocks = 18, .block_size = 5}};
    ModelCache<float> cache(specs);
    std::vector<PagedKVCache<float>> pools;
    for (const ModelLayer& l : specs)
        pools.emplace_back(l.layout, l.blocks, l.block_size, l.options);
    std::vector<Index> live;   // cache ids
    std::vector<Index> dead;   // removed cache ids
    std::mt19937_64 rng(2026);
    const auto pick = [&](Index n) { return static_cast<Index>(rng() % static_cast<std::uint64_t>(n)); };
    Index refused_steps = 0, steps = 0;
    for (Index op = 0; op < 3000; ++op) {
        const Index kind = live.empty() ? 0 : pick(6);
        if (kind == 0 && live.size() < 6) {
            const Index id = cache.add_sequence();
            for (auto& p : pools)
                CHECK(p.add_sequence() == cache.slot_of(id));
            live.push_back(id);
        } else if (kind == 1 && live.size() < 6) {
            const Index parent = live[static_cast<std::size_t>(pick(static_cast<Index>(live.size())))];
            const Index id = cache.fork(parent);
            for (auto& p : pools)
                CHECK(p.fork(cache.slot_of(parent)) == cache.slot_of(id));
            live.push_back(id);
        } else if (kind == 2) {
            const std::size_t i = static_cast<std::size_t>(pick(static_cast<Index>(live.size())));
            const Index slot = cache.slot_of(live[i]);
            cache.remove(live[i]);
            for (auto& p : pools)
                p.remove(slot);
            dead.push_back(live[i]);
            live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
        } else if (kind == 3) {
            const Index id = live[static_cast<std::size_t>(pick(static_cast<Index>(live.size())))];
            const Index tokens = pick(cache.length(id) + 1), slot = cache.slot_of(id);
            bool all = true;
            for (auto& p : pools)
                all = all && p.can_truncate(slot, tokens);
            CHECK(cache.can_truncate(id, tokens) == all);
            if (all) {
                cache.truncate(id, tokens);
                for (auto& p : pools)
                    p.truncate(slot, tokens);
            } else {
                CHECK_THROWS_AS(cache.truncate(id, tokens), std::invalid_argument);
            }
        } else {  // a step of chunks of 0 to 6 rows for some live sequences
            std::vector<Index> ids, offsets{0};
            for (const Index id : live)
                if (rng() % 2 == 0) {
                    ids.push_back(id);
                    offsets.push_back(offsets.back() + pick(7));
                }
            std::vector<Index> before;
            for (const auto& p : pools)
                before.push_back(p.blocks_in_use());
            try {
                const auto& step = cache.plan(ids, offsets);
                for (Index l = 0; l < cache.layers(); ++l) {
                    PagedKVCache<float>& own = pools[static_cast<std::size_t>(l)];
                    const Index rows = offsets.back();
                    const Matrix<float> Q = random_matrix<float>(rows, own.query_dim(), static_cast<std::uint64_t>(op)),
                                        K = random_matrix<float>(rows, own.key_dim(), static_cast<std::uint64_t>(op) + 1),
                                        V = random_matrix<float>(rows, own.value_dim(), static_cast<std::uint64_t>(op) + 2);
                    Matrix<float> O(rows, own.output_dim()), expected(rows, own.output_dim());
                    cache.prefill(l, step, Q, K, V, O);
                    batched_prefill(own, step.slots(), step.q_offsets(), Q, K, V, expected);
                    CHECK((O.array() == expected.array()).all());
                }
                ++steps;
            } catch (const PoolExhausted& e) {
                ++refused_steps;
                CHECK_THAT(std::string(e.what()), Catch::Contains("ModelCache::plan (layer"));
                for (Index l = 0; l < cache.layers(); ++l)
                    CHECK(cache.layer(l).blocks_in_use() == before[static_cast<std::size_t>(l)]);
            }
        }
        // Every layer agrees with its independent pool.
        for (Index l = 0; l < cache.layers(); ++l) {
            const auto& mine = cache.layer(l);
            const auto& own = pools[static_cast<std::size_t>(l)];
            REQUIRE(mine.blocks_in_use() == own.blocks_in_use());
            for (const Index id : live)
                REQUIRE(mine.length(cache.slot_of(id)) == own.length(cache.slot_of(id)));
        }
        for (const Index id : dead)
            REQUIRE_FALSE(cache.contains(id));
    }
    CHECK(steps > 100);
    CHECK(refused_steps > 0);
}

TEMPLATE_TEST_CASE("ModelCache: a sequence's snapshot holds every layer, loads into another cache of other blocks "
                   "bit for bit, and a load that one layer refuses changes none",
                   "[serving][model][snapshot]", float, Eigen::bfloat16, Q8) {
    using S = TestType;
    const auto layers = [](Index small_blocks, Index block) {
        return std::vector<ModelLayer>{{.layout = {4, 2, 8, 0}, .blocks = 40, .block_size = block},
                                       {.layout = {4, 1, 8, 4},
                                        .blocks = 40,
                                        .block_size = block,
                                        .options = {.window = 9, .sink_tokens = 2}},
                                       {.layout = {2, 2, 4, 0}, .blocks = small_blocks, .block_size = block}};
    };
    ModelCache<float, S> cache(layers(40, 4));
    const Index a = cache.add_sequence(), b = cache.add_sequence();
    const auto feed = [&](ModelCache<float, S>& c, const std::vector<Index>& ids, Index tokens, std::uint64_t seed) {
        std::vector<Index> offsets{0};
        for (std::size_t i = 0; i < ids.size(); ++i)
            offsets.push_back(offsets.back() + tokens);
        const auto& step = c.plan(ids, offsets);
        std::vector<Matrix<float>> out;
        for (Index l = 0; l < c.layers(); ++l) {
            const auto& pool = c.layer(l);
            const std::uint64_t at = seed + 10 * static_cast<std::uint64_t>(l);
            const Matrix<float> Q = random_matrix<float>(step.rows(), pool.query_dim(), at),
                                K = random_matrix<float>(step.rows(), pool.key_dim(), at + 1),
                                V = random_matrix<float>(step.rows(), pool.value_dim(), at + 2);
            Matrix<float> O(step.rows(), pool.output_dim());
            c.prefill(l, step, Q, K, V, O);
            out.push_back(O);
        }
        return out;
    };
    feed(cache, {a, b}, 23, 500);
    const Index c = cache.fork(a);
    feed(cache, {c}, 5, 510);

    // Into another cache of other block sizes: its next steps are the first's, bit for bit.
    std::stringstream stream;
    save(cache.sequence(c), stream);
    CHECK(snapshot_size(cache.sequence(c)) == stream.str().size());
    ModelCache<float, S> other(layers(40, 8));
    const Index d = other.add_sequence();
    auto target = other.sequence(d);
    load(target, stream);
    CHECK(other.length(d) == 28);
    for (Index l = 0; l < 3; ++l)
        CHECK(other.layer(l).length(other.slot_of(d)) == 28);
    const auto mine = feed(cache, {c}, 3, 520), theirs = feed(other, {d}, 3, 520);
    for (std::size_t l = 0; l < mine.size(); ++l)
        CHECK((mine[l].array() == theirs[l].array()).all());

    // A buffer, and a load the last layer has too few blocks for: every layer unchanged.
    std::vector<std::byte> buffer(snapshot_size(cache.sequence(a)));
    CHECK(save(cache.sequence(a), buffer) == buffer.size());
    ModelCache<float, S> tight(layers(3, 4));
    const Index e = tight.add_sequence();
    feed(tight, {e}, 2, 530);
    std::vector<Index> in_use;
    for (Index l = 0; l < 3; ++l)
        in_use.push_back(tight.layer(l).blocks_in_use());
    auto small = tight.sequence(e);
    CHECK_THROWS_WITH(load(small, std::span<const std::byte>(buffer)), Catch::Contains("ModelCache::read_sequence"));
    CHECK_THROWS_AS(load(small, std::span<const std::byte>(buffer)), PoolExhausted);
    for (Index l = 0; l < 3; ++l) {
        CHECK(tight.layer(l).blocks_in_use() == in_use[static_cast<std::size_t>(l)]);
        CHECK(tight.layer(l).length(tight.slot_of(e)) == 2);
    }
    // Another layer count or another layer's layout: SnapshotError, nothing changed.
    auto two = layers(40, 4);
    two.pop_back();
    ModelCache<float, S> fewer(two);
    auto f = fewer.sequence(fewer.add_sequence());
    CHECK_THROWS_WITH(load(f, std::span<const std::byte>(buffer)), Catch::Contains("layers"));
    auto changed = layers(40, 4);
    changed[1].options.window = 10;
    ModelCache<float, S> windowed(changed);
    auto w = windowed.sequence(windowed.add_sequence());
    CHECK_THROWS_WITH(load(w, std::span<const std::byte>(buffer)), Catch::Contains("window"));
    CHECK(windowed.layer(0).blocks_in_use() == 0);
    // A pool's sequence snapshot is not a model's.
    std::stringstream one;
    save(cache.layer(0).sequence(cache.slot_of(a)), one);
    CHECK_THROWS_WITH(load(target, one), Catch::Contains("PagedKVCache::Sequence"));
    // Removed ids are refused.
    cache.remove(b);
    CHECK_THROWS_WITH(cache.sequence(b), Catch::Contains("was removed"));
}

TEST_CASE("ModelCache: a planned step holds its blocks against forks and loads, runs once per layer, and a half-run "
          "step refuses new plans and changes to its sequences until it is finished or taken back",
          "[serving][model]") {
    // Blocks of 4 tokens; the last layer has few blocks.
    const std::vector<ModelLayer> specs{{.layout = {2, 1, 4, 0}, .blocks = 30, .block_size = 4},
                                        {.layout = {2, 1, 4, 0}, .blocks = 4, .block_size = 4}};
    ModelCache<float> cache(specs);
    const auto run = [&](Index l, const ModelCache<float>::Step& step) {
        const auto& pool = cache.layer(l);
        const Matrix<float> Q = random_matrix<float>(step.rows(), pool.query_dim(), 600),
                            K = random_matrix<float>(step.rows(), pool.key_dim(), 601),
                            V = random_matrix<float>(step.rows(), pool.value_dim(), 602);
        Matrix<float> O(step.rows(), pool.output_dim());
        cache.prefill(l, step, Q, K, V, O);
    };
    const Index a = cache.add_sequence();
    {
        const auto& step = cache.plan(std::vector<Index>{a}, std::vector<Index>{0, 6});
        CHECK(cache.step_pending());
        run(0, step);
        CHECK_THROWS_WITH(run(0, step), Catch::Contains("has run in layer 0 already"));
        // Half run: no new plan, no fork, truncate or load of its sequence; remove stays allowed.
        CHECK_THROWS_WITH(cache.plan_decode(std::vector<Index>{a}), Catch::Contains("rollback(step) first"));
        CHECK_THROWS_WITH(cache.fork(a), Catch::Contains("run it in every layer"));
        CHECK_FALSE(cache.can_truncate(a, 0));
        CHECK_THROWS_WITH(cache.truncate(a, 0), Catch::Contains("run it in every layer"));
        run(1, step);
        CHECK_FALSE(cache.step_pending());
        CHECK_THROWS_WITH(run(1, step), Catch::Contains("not the latest plan"));
        CHECK(cache.length(a) == 6);
    }
    // a holds 2 blocks of layer 1 (6 tokens, the second half full); a step of 2 tokens
    // fills it, and after a fork of a it must copy that block first: 1 block more.
    const Index b = cache.add_sequence();
    {
        const auto& step = cache.plan(std::vector<Index>{a, b}, std::vector<Index>{0, 2, 8});  // b takes 2 blocks
        CHECK(cache.layer(1).free_blocks() == 2);
        CHECK_THROWS_AS(cache.fork(a), PoolExhausted);  // its copy on write would need a third
        CHECK_THROWS_WITH(cache.fork(a), Catch::Contains("the planned step holds blocks"));
        CHECK(cache.sequences() == 2);
        CHECK(cache.layer(1).sequences() == 2);
        const Index c = cache.fork(b);  // b is empty: nothing to copy
        run(0, step);
        run(1, step);
        CHECK(cache.length(a) == 8);
        CHECK(cache.length(b) == 6);
        cache.remove(c);
    }
    // Before any layer runs a step, a change to one of its sequences ends it.
    {
        const auto& step = cache.plan_decode(std::vector<Index>{b});
        cache.truncate(b, 5);
        CHECK_FALSE(cache.step_pending());
        CHECK_THROWS_WITH(run(0, step), Catch::Contains("plan anew"));
        CHECK_THROWS_WITH(cache.rollback(step), Catch::Contains("not the latest plan"));
    }
    // A rollback ends the step; a decode call refuses a plan of chunks.
    {
        const auto& step = cache.plan(std::vector<Index>{b}, std::vector<Index>{0, 1});
        const Matrix<float> Q = random_matrix<float>(1, 2 * 4, 610), K = random_matrix<float>(1, 4, 611),
                            V = random_matrix<float>(1, 4, 612);
        Matrix<float> O(1, 8);
        CHECK_THROWS_WITH(cache.decode(0, step, Q, K, V, O), Catch::Contains("plan_decode"));
        run(0, step);
        cache.rollback(step);
        CHECK_FALSE(cache.step_pending());
        CHECK(cache.layer(0).length(cache.slot_of(b)) == 5);
        CHECK_THROWS_WITH(run(1, step), Catch::Contains("plan anew"));
    }
    // A load that would take the blocks a planned step holds is refused.
    {
        std::stringstream stream;
        save(cache.sequence(b), stream);  // 5 tokens: 2 blocks in each layer
        cache.remove(b);
        const Index fresh = cache.add_sequence();
        const auto& step = cache.plan(std::vector<Index>{a}, std::vector<Index>{0, 2});  // a: 8 → 10, a block more
        CHECK(cache.layer(1).free_blocks() == 2);
        auto target = cache.sequence(fresh);
        CHECK_THROWS_WITH(load(target, stream), Catch::Contains("the planned step holds blocks"));
        CHECK(cache.length(fresh) == 0);
        CHECK(cache.layer(1).free_blocks() == 2);
        cache.rollback(step);  // no step holds blocks now
        stream.seekg(0);
        load(target, stream);
        CHECK(cache.length(fresh) == 5);
        CHECK(cache.layer(1).free_blocks() == 0);
    }
}

TEMPLATE_TEST_CASE("PagedKVCache with rollback room: every truncate of up to rollback_tokens succeeds, the blocks "
                   "stay bounded, and the attends equal the windowed reference after it",
                   "[serving][window][rollback]", float, Q8) {
    using S = TestType;
    const HeadLayout layout{4, 2, 8, 0};
    for (const auto& [window, sinks, block, room] :
         {std::tuple<Index, Index, Index, Index>{5, 0, 8, 10}, {20, 2, 8, 10}, {7, 9, 4, 1}, {1, 0, 1, 3}, {33, 17, 8, 40},
          {16, 0, 16, 16}}) {
        INFO(detail::storage_name<S> << ": window " << window << ", sinks " << sinks << ", block " << block
                                     << ", rollback " << room);
        const Index n = 120;
        const Index bound = (sinks + block - 1) / block + (window + room + block - 1) / block + 1;
        PagedKVCache<float, S> pool(layout, 2 * bound + 2, block, SoftmaxOptions{.window = window, .sink_tokens = sinks},
                                    PoolOptions{.rollback_tokens = room});
        CHECK(pool.pool_options().rollback_tokens == room);
        const Matrix<float> K = random_matrix<float>(n, 16, 401), V = random_matrix<float>(n, 16, 402),
                            Q = random_matrix<float>(n, 32, 403, 2.0);
        const MatrixD Ks = stored_heads<float, S>(K, 2).template cast<double>(),
                      Vs = stored_heads<float, S>(V, 2).template cast<double>();
        const Index seq = pool.add_sequence();
        Matrix<float> o(1, 32);
        for (Index t = 0; t < n; ++t) {
            pool.update(seq, K.row(t), V.row(t));
            CHECK(pool.blocks_of(seq) <= bound);
            for (Index k = 0; k <= std::min(room, t + 1); ++k)
                CHECK(pool.can_truncate(seq, t + 1 - k));
            if (t % 13 == 12) {  // a speculative step: three drafts (at most the room) rejected
                const Index back = std::min({room, Index{3}, t + 1});
                pool.truncate(seq, t + 1 - back);
                for (Index j = t + 1 - back; j <= t; ++j)
                    pool.update(seq, K.row(j), V.row(j));
            }
            pool.attend(seq, Q.row(t), o.row(0));
            check_close(o, paged_reference(layout, Q.row(t).cast<double>(), Ks.topRows(t + 1), Vs.topRows(t + 1),
                                           window, sinks),
                        2e-5);
        }
        // Past the room the rule of can_truncate holds as without it: exact, refused with nothing changed.
        const Index length = pool.length(seq);
        for (Index tokens = 0; tokens <= length; ++tokens) {
            PagedKVCache<float, S> copy = pool;
            const bool can = copy.can_truncate(seq, tokens);
            if (tokens >= length - room)
                CHECK(can);
            if (can) {
                copy.truncate(seq, tokens);
                CHECK(copy.length(seq) == tokens);
            } else {
                CHECK_THROWS_AS(copy.truncate(seq, tokens), std::invalid_argument);
                CHECK(copy.length(seq) == length);
            }
        }
    }
    // Bad room: refused by name.
    CHECK_THROWS_WITH((PagedKVCache<float, S>(layout, 4, 16, SoftmaxOptions{.window = 4}, PoolOptions{.rollback_tokens = -1})),
                      Catch::Contains("pool.rollback_tokens"));
}

TEST_CASE("PagedKVCache with reject_nonfinite: a key or value that is not finite is refused, the pool unchanged",
          "[serving][bad_input]") {
    const HeadLayout layout{4, 2, 8, 0};
    PagedKVCache<float> strict(layout, 8, 4, SoftmaxOptions{}, PoolOptions{.reject_nonfinite = true}),
        lenient(layout, 8, 4);
    const Index a = strict.add_sequence(), b = strict.add_sequence(), c = lenient.add_sequence();
    Matrix<float> K = random_matrix<float>(6, 16, 411), V = random_matrix<float>(6, 16, 412);
    strict.extend(a, K.topRows(3), V.topRows(3));
    K(4, 9) = std::numeric_limits<float>::quiet_NaN();
    V(5, 2) = std::numeric_limits<float>::infinity();
    const Index used = strict.blocks_in_use();
    CHECK_THROWS_WITH(strict.extend(b, K, V), Catch::Contains("'keys'") && Catch::Contains("row 4, column 9") &&
                                                  Catch::Contains("reject_nonfinite"));
    CHECK_THROWS_WITH(strict.update(b, K.row(5), V.row(5)), Catch::Contains("'value'") && Catch::Contains("inf"));
    const std::vector<Index> both{a, b}, offsets{0, 3, 6};
    Matrix<float> Q = random_matrix<float>(6, 32, 413), O(6, 32);
    CHECK_THROWS_WITH(batched_decode(strict, both, Q.topRows(2), K.middleRows(4, 2), V.middleRows(4, 2), O.topRows(2)),
                      Catch::Contains("memattn::batched_decode") && Catch::Contains("reject_nonfinite"));
    CHECK_THROWS_WITH(batched_prefill(strict, both, offsets, Q, K, V, O),
                      Catch::Contains("memattn::batched_prefill") && Catch::Contains("reject_nonfinite"));
    CHECK(strict.length(a) == 3);
    CHECK(strict.length(b) == 0);
    CHECK(strict.blocks_in_use() == used);
    // Without it the values are stored as they are (and poison what sees them).
    lenient.extend(c, K, V);
    CHECK(lenient.length(c) == 6);
}

// ---- Speculative decoding in the pool: verify a tree of drafts, accept its path ----------

namespace {

/// A draft tree of n tokens: a root chain 0 → 1 → 2 ... with side branches (random
/// parents among the earlier drafts), and the accepted path along the chain of depth
/// `depth` from the root 0.
std::vector<Index> tree_parents(Index n, unsigned seed) {
    std::vector<Index> parents(static_cast<std::size_t>(n));
    std::mt19937 rng(seed);
    for (Index i = 0; i < n; ++i)
        parents[static_cast<std::size_t>(i)] = i == 0 ? -1 : static_cast<Index>(rng() % static_cast<unsigned>(i + 1)) - 1;
    return parents;
}

/// The path from the root to draft `leaf` of the tree.
std::vector<Index> tree_path(const std::vector<Index>& parents, Index leaf) {
    std::vector<Index> path;
    for (Index i = leaf; i >= 0; i = parents[static_cast<std::size_t>(i)])
        path.insert(path.begin(), i);
    return path;
}

}  // namespace

TEMPLATE_TEST_CASE("PagedKVCache: a tree of drafts verified in a batch equals the kernel's tree mask, bit for bit, "
                   "and accept keeps its path as if decoded token by token",
                   "[serving][batched][tree]", float, Eigen::bfloat16, Q8) {
    using S = TestType;
    const HeadLayout layout{4, 2, 16, 0};
    const Index kw = 32, qw = 64, P = 37, n = 21, block = 8;
    const Matrix<float> K0 = random_matrix<float>(P, kw, 120), V0 = random_matrix<float>(P, kw, 121);
    const Matrix<float> Q = random_matrix<float>(n + 1, qw, 122), K = random_matrix<float>(n + 1, kw, 123),
                        V = random_matrix<float>(n + 1, kw, 124);
    const std::vector<Index> parents = tree_parents(n, 7);
    const std::vector<double> sinks{0.5, -1.0, 0.25, 2.0};
    const SoftmaxOptions options{.softcap = 20.0, .sink_logits = sinks};
    // Two sequences in one batch: a tree of n drafts after P tokens, and a one-token tree.
    PagedKVCache<float, S> pool(layout, 64, block, options);
    const Index a = pool.add_sequence(), b = pool.add_sequence();
    pool.extend(a, K0, V0);
    pool.extend(b, K0.topRows(5), V0.topRows(5));
    const Index keep = pool.fork(a);  // shares a's blocks, the partly filled last one too
    const std::vector<Index> seqs{a, b}, offsets{0, n, n + 1};
    std::vector<Index> all(parents);
    all.push_back(-1);
    Matrix<float> O(n + 1, qw);
    for (const int threads : {1, 2}) {
        INFO(threads << " threads");
        if (threads == 2) {
            pool.reject(a);
            pool.reject(b);
        }
        batched_prefill(pool, seqs, offsets, Q, K, V, O, OpenMPExecutor{.threads = threads}, all);
        CHECK(pool.pending_drafts(a) == n);
        CHECK(pool.pending_drafts(b) == 1);
        CHECK(pool.length(a) == P + n);
        // The multi-head kernel with the tree on the sequence's pairs as stored.
        Matrix<float> Ks(P + n, kw), Vs(P + n, kw), expected(n, qw);
        Ks << K0, K.topRows(n);
        Vs << V0, V.topRows(n);
        SoftmaxOptions tree = options;
        tree.parents = parents;
        multi_head_causal_softmax_attention(Q.topRows(n), stored_heads<float, S>(Ks, 2), stored_heads<float, S>(Vs, 2),
                                            expected, layout, tree, {}, SerialExecutor{});
        CHECK((O.topRows(n).array() == expected.array()).all());
    }
    // A fork after the verify shares the drafts' blocks: accept copies what it writes.
    const Index twin = pool.fork(a);
    CHECK(pool.pending_drafts(twin) == n);
    const Index leaf = n - 1;
    const std::vector<Index> path = tree_path(parents, leaf);
    INFO("path of " << path.size());
    pool.accept(a, path);
    CHECK(pool.length(a) == P + static_cast<Index>(path.size()));
    CHECK(pool.pending_drafts(a) == 0);
    pool.accept(b, std::vector<Index>{0});
    CHECK(pool.length(b) == 6);
    // The same tokens decoded one by one, in the fork kept from before the verify.
    for (const Index p : path)
        pool.update(keep, K.row(p), V.row(p));
    const Matrix<float> q = random_matrix<float>(1, qw, 125);
    Matrix<float> oa(1, qw), ok(1, qw), ot(1, qw), ot0(1, qw);
    pool.attend(a, q.row(0), oa.row(0));
    pool.attend(keep, q.row(0), ok.row(0));
    CHECK((oa.array() == ok.array()).all());
    // The twin's drafts are as verified: its own accept of another path, and reject.
    pool.attend(twin, q.row(0), ot0.row(0));
    const std::vector<Index> other = tree_path(parents, 3);
    pool.accept(twin, other);
    CHECK(pool.length(twin) == P + static_cast<Index>(other.size()));
    Matrix<float> Kt(P + static_cast<Index>(other.size()), kw), Vt(Kt.rows(), kw);
    Kt.topRows(P) = K0;
    Vt.topRows(P) = V0;
    for (std::size_t k = 0; k < other.size(); ++k) {
        Kt.row(P + static_cast<Index>(k)) = K.row(other[k]);
        Vt.row(P + static_cast<Index>(k)) = V.row(other[k]);
    }
    pool.attend(twin, q.row(0), ot.row(0));
    check_close(ot,
                paged_reference(layout, q.cast<double>(), stored_heads<float, S>(Kt, 2).template cast<double>(),
                                stored_heads<float, S>(Vt, 2).template cast<double>()),
                1.0);  // the options differ from the plain reference: only finiteness here
    CHECK(ot.allFinite());
    // accept then decoding on: the next step equals the fork's.
    Matrix<float> na(1, qw), nk(1, qw);
    Matrix<float> Kd(2, kw), Vd(2, kw), Qd(2, qw), Od(2, qw);
    Kd << K.row(n), K.row(n);  // the same token for both
    Vd << V.row(n), V.row(n);
    Qd << Q.row(n), Q.row(n);
    batched_decode(pool, std::vector<Index>{a, keep}, Qd, Kd, Vd, Od);
    CHECK((Od.row(0).array() == Od.row(1).array()).all());
    pool.attend(a, q.row(0), na.row(0));
    pool.attend(keep, q.row(0), nk.row(0));
    CHECK((na.array() == nk.array()).all());
}

TEMPLATE_TEST_CASE("PagedKVCache::prefill: a GQA group wider than the heads that walk together (6 heads: items of "
                   "4 and 2) equals the multi-head kernel bit for bit, prompts and trees, with ALiBi and sinks per head",
                   "[serving][batched][prefill][tree]", float, Eigen::bfloat16) {
    using S = TestType;
    const HeadLayout layout{12, 2, 16, 8};  // g = 6 > detail::max_heads_together
    static_assert(detail::max_heads_together == 4);
    const Index kw = 32, vw = 16, qw = 192, ow = 96, P = 150, n = 70, block = 16;
    std::vector<double> slopes, sink_logits;
    for (Index h = 0; h < 12; ++h) {
        slopes.push_back(std::exp2(-0.5 * static_cast<double>(h + 1)));
        sink_logits.push_back(0.25 * static_cast<double>(h) - 1.0);
    }
    const Matrix<float> K = random_matrix<float>(P + n, kw, 130), V = random_matrix<float>(P + n, vw, 131),
                        Q = random_matrix<float>(n, qw, 132, 2.0);
    const Matrix<float> Ks = stored_heads<float, S>(K, 2), Vs = stored_heads<float, S>(V, 2);
    const std::vector<Index> parents = tree_parents(n, 11);
    std::vector<FpMath> modes{FpMath::strict};
    if constexpr (!std::is_same_v<S, float>)
        modes.push_back(FpMath::bf16);
    for (const FpMath mode : modes) {
        for (const bool tree : {false, true}) {
            INFO(detail::storage_name<S> << (mode == FpMath::bf16 ? ", FpMath::bf16" : "")
                                         << (tree ? ", a tree" : ", a prompt"));
            const SoftmaxOptions options{.softcap = 20.0, .sink_logits = sink_logits, .alibi_slopes = slopes,
                                         .fpmath = mode};
            SoftmaxOptions kernel = options;
            if (tree)
                kernel.parents = parents;
            Matrix<float> expected(n, ow);
            multi_head_causal_softmax_attention(Q, Ks, Vs, expected, layout, kernel, {}, SerialExecutor{});
            for (const int threads : {1, 2}) {
                PagedKVCache<float, S> pool(layout, (P + n) / block + 2, block, options);
                const Index a = pool.add_sequence();
                pool.extend(a, K.topRows(P), V.topRows(P));
                Matrix<float> O(n, ow);
                const std::vector<Index> seqs{a}, offsets{0, n};
                const OpenMPExecutor executor{.threads = threads};
                if (tree)
                    pool.prefill(seqs, offsets, Q, K.bottomRows(n), V.bottomRows(n), O, executor, parents);
                else
                    pool.prefill(seqs, offsets, Q, K.bottomRows(n), V.bottomRows(n), O, executor);
                CHECK((O.array() == expected.array()).all());
            }
        }
    }
}

TEST_CASE("PagedKVCache: a verify step's bad trees, paths and pools are refused and change nothing",
          "[serving][tree][bad_input]") {
    const HeadLayout layout{2, 1, 8, 0};
    const Matrix<float> Q = random_matrix<float>(6, 16, 130), K = random_matrix<float>(6, 8, 131),
                        V = random_matrix<float>(6, 8, 132);
    PagedKVCache<float> pool(layout, 8, 4);
    const Index a = pool.add_sequence();
    pool.extend(a, K.topRows(3), V.topRows(3));
    const std::vector<Index> seqs{a}, offsets{0, 5};
    Matrix<float> O(5, 16);
    const auto same = [&] {
        CHECK(pool.length(a) == 3);
        CHECK(pool.pending_drafts(a) == 0);
        CHECK(pool.blocks_in_use() == 1);
    };
    CHECK_THROWS_WITH(pool.accept(a, std::vector<Index>{0}), Catch::Contains("no pending drafts"));
    CHECK_THROWS_WITH(pool.reject(a), Catch::Contains("no pending drafts"));
    const std::vector<Index> later{-1, 0, 2, 1, 1}, short_tree{-1, 0};
    CHECK_THROWS_WITH(pool.prefill(seqs, offsets, Q.topRows(5), K.topRows(5), V.topRows(5), O, {}, later),
                      Catch::Contains("parents") && Catch::Contains("row 2"));
    CHECK_THROWS_WITH(pool.prefill(seqs, offsets, Q.topRows(5), K.topRows(5), V.topRows(5), O, {}, short_tree),
                      Catch::Contains("expected 5"));
    same();
    const std::vector<Index> tree{-1, 0, 0, 1, -1};
    pool.prefill(seqs, offsets, Q.topRows(5), K.topRows(5), V.topRows(5), O, {}, tree);
    CHECK(pool.pending_drafts(a) == 5);
    CHECK_THROWS_WITH(pool.accept(a, std::vector<Index>{1}), Catch::Contains("must be a root"));
    CHECK_THROWS_WITH(pool.accept(a, std::vector<Index>{0, 3}), Catch::Contains("parent is 1"));
    CHECK_THROWS_WITH(pool.accept(a, std::vector<Index>{0, 5}), Catch::Contains("expected a draft"));
    CHECK(pool.length(a) == 8);
    CHECK(pool.pending_drafts(a) == 5);
    // An accept of the root chain's first drafts moves nothing; an update ends a tree.
    pool.accept(a, std::vector<Index>{0, 1, 3});
    CHECK(pool.length(a) == 6);
    pool.prefill(seqs, std::vector<Index>{0, 2}, Q.topRows(2), K.topRows(2), V.topRows(2), O.topRows(2), {},
                 std::vector<Index>{-1, -1});
    pool.update(a, K.row(5), V.row(5));
    CHECK(pool.pending_drafts(a) == 0);
    // A verify batch where a sequence brings no rows leaves its own pending drafts alone.
    const Index other = pool.add_sequence();
    pool.prefill(std::vector<Index>{other}, std::vector<Index>{0, 2}, Q.topRows(2), K.topRows(2), V.topRows(2),
                 O.topRows(2), {}, std::vector<Index>{-1, 0});
    pool.prefill(std::vector<Index>{a, other}, std::vector<Index>{0, 2, 2}, Q.topRows(2), K.topRows(2), V.topRows(2),
                 O.topRows(2), {}, std::vector<Index>{-1, -1});
    CHECK(pool.pending_drafts(other) == 2);
    CHECK(pool.pending_drafts(a) == 2);
    pool.accept(other, std::vector<Index>{0, 1});
    CHECK(pool.length(other) == 2);
    // A windowed pool whose rollback room cannot take the drafts back refuses them.
    PagedKVCache<float> windowed(layout, 8, 4, SoftmaxOptions{.window = 4});
    const Index w = windowed.add_sequence();
    windowed.extend(w, K.topRows(6), V.topRows(6));
    CHECK_THROWS_WITH(windowed.prefill(std::vector<Index>{w}, std::vector<Index>{0, 2}, Q.topRows(2), K.topRows(2),
                                       V.topRows(2), O.topRows(2), {}, std::vector<Index>{-1, 0}),
                      Catch::Contains("rollback") && Catch::Contains("window of 4"));
    CHECK(windowed.length(w) == 6);
    CHECK(windowed.pending_drafts(w) == 0);
    CHECK(windowed.blocks_in_use() == 2);
    // Among the sinks: a sequence of one token, a window of 1 past 1 sink. Without room the
    // drafts are refused (an accept of one would leave 2 tokens, the second freed); with
    // room for them, a path of one is kept.
    for (const Index room : {0, 3}) {
        INFO("room " << room);
        PagedKVCache<float> sinks(layout, 8, 1, SoftmaxOptions{.window = 1, .sink_tokens = 1},
                                  PoolOptions{.rollback_tokens = room});
        const Index x = sinks.add_sequence();
        sinks.extend(x, K.topRows(1), V.topRows(1));
        const auto verify = [&] {
            sinks.prefill(std::vector<Index>{x}, std::vector<Index>{0, 3}, Q.topRows(3), K.topRows(3), V.topRows(3),
                          O.topRows(3), {}, std::vector<Index>{-1, 0, 1});
        };
        if (room == 0) {
            CHECK_THROWS_WITH(verify(), Catch::Contains("rollback"));
            CHECK(sinks.length(x) == 1);
            CHECK(sinks.blocks_in_use() == 1);
        } else {
            verify();
            sinks.accept(x, std::vector<Index>{0});
            CHECK(sinks.length(x) == 2);
        }
    }
    // An accept whose copies on write do not fit the pool: PoolExhausted, nothing changed.
    PagedKVCache<float> tight(layout, 3, 4);
    const Index t = tight.add_sequence();
    Matrix<float> O6(6, 16);
    tight.prefill(std::vector<Index>{t}, std::vector<Index>{0, 6}, Q, K, V, O6, {},
                  std::vector<Index>{-1, 0, 1, 0, 3, 4});
    const Index t2 = tight.fork(t);
    const Index spare = tight.add_sequence();
    tight.extend(spare, K.topRows(1), V.topRows(1));  // the last free block
    CHECK_THROWS_AS(tight.accept(t, std::vector<Index>{0, 3, 4}), PoolExhausted);
    CHECK(tight.length(t) == 6);
    CHECK(tight.pending_drafts(t) == 6);
    tight.remove(spare);
    tight.accept(t, std::vector<Index>{0, 3, 4});
    CHECK(tight.length(t) == 3);
    CHECK(tight.length(t2) == 6);
}

TEMPLATE_TEST_CASE("PagedKVCache: trees in a windowed pool with sinks and ALiBi, each draft at its depth's position: "
                   "its path decoded token by token, and accept or reject within the rollback room",
                   "[serving][batched][tree][window]", float, Eigen::bfloat16, Q8) {
    using S = TestType;
    const HeadLayout layout{4, 2, 16, 0};
    // 100 drafts: two of the windowed kernel's query tiles, the second starting mid-tree.
    const Index kw = 32, qw = 64, W = 10, sinks = 3, P = 70, n = 100, m = 6, block = 8;
    const std::vector<double> slopes{0.25, 0.125, 0.0625, 0.03125};
    const SoftmaxOptions options{.window = W, .sink_tokens = sinks, .softcap = 20.0, .alibi_slopes = slopes};
    const Matrix<float> K0 = random_matrix<float>(P, kw, 140), V0 = random_matrix<float>(P, kw, 141);
    const Matrix<float> Q = random_matrix<float>(n + m, qw, 142), K = random_matrix<float>(n + m, kw, 143),
                        V = random_matrix<float>(n + m, kw, 144);
    std::vector<Index> parents{-1};  // a chain with branches: depths past the window
    for (Index i = 1; i < n; ++i)
        parents.push_back(i % 5 == 0 ? i - 3 : i - 1);
    const std::vector<Index> small{-1, 0, 0, 1, 3, 1};  // a tree among the sinks: 1 cached token
    std::vector<Index> all(parents);
    all.insert(all.end(), small.begin(), small.end());
    PagedKVCache<float, S> pool(layout, 64, block, options, PoolOptions{.rollback_tokens = n});
    const Index a = pool.add_sequence(), b = pool.add_sequence();
    pool.extend(a, K0, V0);
    pool.extend(b, K0.topRows(1), V0.topRows(1));
    const Index keep = pool.fork(a);
    const Index held = pool.blocks_of(a);
    const std::vector<Index> seqs{a, b}, offsets{0, n, n + m};
    Matrix<float> O(n + m, qw);
    for (const int threads : {1, 2}) {
        INFO(threads << " threads");
        if (threads == 2) {
            pool.reject(a);
            pool.reject(b);
            CHECK(pool.length(a) == P);
            CHECK(pool.length(b) == 1);
            CHECK(pool.blocks_of(a) <= held);  // the window has moved on from the drafts' end
            CHECK(pool.blocks_of(a) <= (sinks + block - 1) / block + (W + n + block - 1) / block + 1);
        }
        batched_prefill(pool, seqs, offsets, Q, K, V, O, OpenMPExecutor{.threads = threads}, all);
        CHECK(pool.pending_drafts(a) == n);
        CHECK(pool.pending_drafts(b) == m);
        // The multi-head kernel with the tree on each sequence's pairs as stored, bit for
        // bit; and each draft's output its path's, decoded in double.
        const auto check_chunk = [&](const Matrix<float>& Kc, const Matrix<float>& Vc, Index q0,
                                     const std::vector<Index>& tree) {
            const Index rows = static_cast<Index>(tree.size());
            const Matrix<float> Ks = stored_heads<float, S>(Kc, 2), Vs = stored_heads<float, S>(Vc, 2);
            SoftmaxOptions with_tree = options;
            with_tree.parents = tree;
            const Matrix<float> expected = layer_rows(layout, Q.middleRows(q0, rows), Ks, Vs, with_tree);
            CHECK((O.middleRows(q0, rows).array() == expected.array()).all());
            for (Index h = 0; h < layout.q_heads; ++h) {
                const Index kv = h / layout.group_size();
                const MatrixD reference = reference::tree_path_attention(
                    Q.block(q0, h * 16, rows, 16).cast<double>(), Ks.middleCols(kv * 16, 16).cast<double>(),
                    Vs.middleCols(kv * 16, 16).cast<double>(), tree,
                    {.window = W, .sink_tokens = sinks, .softcap = 20.0, .slope = slopes[static_cast<std::size_t>(h)]});
                check_close(O.block(q0, h * 16, rows, 16), reference, 2e-5);
            }
        };
        Matrix<float> Ka(P + n, kw), Va(P + n, kw), Kb(1 + m, kw), Vb(1 + m, kw);
        Ka << K0, K.topRows(n);
        Va << V0, V.topRows(n);
        Kb << K0.topRows(1), K.bottomRows(m);
        Vb << V0.topRows(1), V.bottomRows(m);
        check_chunk(Ka, Va, 0, parents);
        check_chunk(Kb, Vb, n, small);
    }
    // accept keeps a path as if decoded token by token (the fork decodes it now).
    const std::vector<Index> path = tree_path(parents, n - 1);
    INFO("path of " << path.size());
    pool.accept(a, path);
    CHECK(pool.length(a) == P + static_cast<Index>(path.size()));
    for (const Index p : path)
        pool.update(keep, K.row(p), V.row(p));
    const Matrix<float> q = random_matrix<float>(1, qw, 145);
    Matrix<float> oa(1, qw), ok(1, qw);
    pool.attend(a, q.row(0), oa.row(0));
    pool.attend(keep, q.row(0), ok.row(0));
    CHECK((oa.array() == ok.array()).all());
    // The sinks' tree: a path that leaves the sinks, then a reject of the next tree.
    pool.accept(b, std::vector<Index>{0, 1, 3, 4});
    CHECK(pool.length(b) == 5);
    batched_prefill(pool, std::vector<Index>{a}, std::vector<Index>{0, n}, Q.topRows(n), K.topRows(n), V.topRows(n),
                    O.topRows(n), OpenMPExecutor{.threads = 1}, parents);
    pool.reject(a);
    pool.attend(a, q.row(0), oa.row(0));
    CHECK((oa.array() == ok.array()).all());
    // Decoding on from the accepted path: the same as the fork's.
    Matrix<float> Kd(2, kw), Vd(2, kw), Qd(2, qw), Od(2, qw);
    Kd << K.row(n), K.row(n);
    Vd << V.row(n), V.row(n);
    Qd << Q.row(n), Q.row(n);
    batched_decode(pool, std::vector<Index>{a, keep}, Qd, Kd, Vd, Od);
    CHECK((Od.row(0).array() == Od.row(1).array()).all());
}

TEST_CASE("ModelCache: a verify step in every layer, then accept or reject in all at once", "[serving][model][tree]") {
    static const std::vector<double> slopes{0.5, 0.125};
    const std::vector<ModelLayer> specs{
        {.layout = {4, 2, 8, 0}, .blocks = 20, .block_size = 16},
        {.layout = {2, 1, 16, 8}, .blocks = 20, .block_size = 4},
        {.layout = {2, 1, 8, 0},  // a windowed layer with ALiBi: the drafts in its rollback room
         .blocks = 20,
         .block_size = 4,
         .options = {.window = 6, .sink_tokens = 2, .alibi_slopes = slopes},
         .pool = {.rollback_tokens = 8}}};
    ModelCache<float> cache(specs);
    std::vector<PagedKVCache<float>> pools;  // the same calls on independent pools
    for (const ModelLayer& l : specs)
        pools.emplace_back(l.layout, l.blocks, l.block_size, l.options, l.pool);
    const Index a = cache.add_sequence(), b = cache.add_sequence();
    for (auto& p : pools) {
        p.add_sequence();
        p.add_sequence();
    }
    const std::vector<Index> parents{-1, 0, 0, 1, 2, -1, 4};
    const auto step_all = [&](const std::vector<Index>& ids, const std::vector<Index>& offsets, bool tree,
                              std::uint64_t seed) {
        const auto& step = cache.plan(ids, offsets);
        const Index rows = offsets.back();
        for (Index l = 0; l < cache.layers(); ++l) {
            PagedKVCache<float>& own = pools[static_cast<std::size_t>(l)];
            const auto s = seed + 10 * static_cast<std::uint64_t>(l);
            const Matrix<float> Q = random_matrix<float>(rows, own.query_dim(), s),
                                K = random_matrix<float>(rows, own.key_dim(), s + 1),
                                V = random_matrix<float>(rows, own.value_dim(), s + 2);
            Matrix<float> O(rows, own.output_dim()), expected(rows, own.output_dim());
            if (tree) {
                cache.prefill(l, step, Q, K, V, O, parents);
                batched_prefill(own, step.slots(), step.q_offsets(), Q, K, V, expected, {}, parents);
            } else {
                cache.prefill(l, step, Q, K, V, O);
                batched_prefill(own, step.slots(), step.q_offsets(), Q, K, V, expected);
            }
            CHECK((O.array() == expected.array()).all());
        }
    };
    step_all({a, b}, {0, 30, 33}, false, 400);
    step_all({a}, {0, 7}, true, 410);
    CHECK(cache.pending_drafts(a) == 7);
    const std::vector<Index> path{0, 2, 4, 6};
    cache.accept(a, path);
    for (auto& p : pools)
        p.accept(cache.slot_of(a), path);
    CHECK(cache.length(a) == 34);
    CHECK(cache.pending_drafts(a) == 0);
    for (Index l = 0; l < cache.layers(); ++l) {
        PagedKVCache<float>& own = pools[static_cast<std::size_t>(l)];
        const Matrix<float> q = random_matrix<float>(1, own.query_dim(), 420);
        Matrix<float> x(1, own.output_dim()), y(1, own.output_dim());
        cache.layer(l).attend(cache.slot_of(a), q.row(0), x.row(0));
        own.attend(cache.slot_of(a), q.row(0), y.row(0));
        CHECK((x.array() == y.array()).all());
    }
    // A bad path is refused in every layer before any changes; reject drops the drafts.
    step_all({a}, {0, 7}, true, 430);
    CHECK_THROWS_WITH(cache.accept(a, std::vector<Index>{0, 3}), Catch::Contains("ModelCache::accept"));
    CHECK(cache.length(a) == 41);
    cache.reject(a);
    CHECK(cache.length(a) == 34);
    CHECK_THROWS_WITH(cache.reject(a), Catch::Contains("no pending drafts"));
    CHECK_THROWS_WITH(cache.reject(b), Catch::Contains("no pending drafts"));
    // Drafts in one layer alone (its pool called directly): reject refuses, every layer as it was.
    PagedKVCache<float>& first = cache.layer(0);
    Matrix<float> q2 = random_matrix<float>(2, first.query_dim(), 440), k2 = random_matrix<float>(2, first.key_dim(), 441),
                  v2 = random_matrix<float>(2, first.value_dim(), 442), o2(2, first.output_dim());
    first.prefill(std::vector<Index>{cache.slot_of(b)}, std::vector<Index>{0, 2}, q2, k2, v2, o2, {},
                  std::vector<Index>{-1, 0});
    CHECK_THROWS_WITH(cache.reject(b), Catch::Contains("layer 1"));
    CHECK(first.pending_drafts(cache.slot_of(b)) == 2);
    CHECK(first.length(cache.slot_of(b)) == 5);
    // Drafts past the windowed layer's rollback room (8): refused by the step's first
    // layer, before any layer holds them.
    std::vector<Index> long_tree{-1};
    for (Index i = 1; i < 12; ++i)
        long_tree.push_back(i - 1);
    const auto& step = cache.plan(std::vector<Index>{a}, std::vector<Index>{0, 12});
    const Matrix<float> q12 = random_matrix<float>(12, first.query_dim(), 450),
                        k12 = random_matrix<float>(12, first.key_dim(), 451),
                        v12 = random_matrix<float>(12, first.value_dim(), 452);
    Matrix<float> o12(12, first.output_dim());
    CHECK_THROWS_WITH(cache.prefill(0, step, q12, k12, v12, o12, long_tree),
                      Catch::Contains("layer 2") && Catch::Contains("rollback"));
    CHECK(cache.length(a) == 34);
    CHECK(cache.pending_drafts(a) == 0);
    cache.rollback(step);
}

// ---- StatePool: the recurrent layers' states of many sequences, with checkpoints ----------

namespace {

/// A delta-rule key row [k | β] per token, β in [0, 1].
Matrix<float> delta_keys(Index n, Index d, std::uint64_t seed) {
    Matrix<float> keys(n, d + 1);
    keys.leftCols(d) = random_matrix<float>(n, d, seed);
    keys.rightCols(1) = (random_matrix<float>(n, 1, seed + 1).array() * 0.5f + 0.5f).cwiseMax(0.0f).cwiseMin(1.0f);
    return keys;
}

}  // namespace

TEST_CASE("StatePool: each sequence is its own memory, bit for bit; a batch equals each alone on any thread count",
          "[serving][state_pool]") {
    const Index d = 8, dv = 6;
    const DeltaRuleMemory<float> prototype(d, dv);
    StatePool<DeltaRuleMemory<float>> pool(4, prototype);
    std::vector<DeltaRuleMemory<float>> alone(3, prototype);
    const Index a = pool.add(), b = pool.add(), c = pool.add();
    const std::vector<Index> ids{a, b, c};
    // A prompt for each (chunks of 5, 0 and 17 rows), then decode steps.
    const std::vector<Index> offsets{0, 5, 5, 22};
    const Matrix<float> Q = random_matrix<float>(22, d, 140), K = delta_keys(22, d, 141), V = random_matrix<float>(22, dv, 143);
    Matrix<float> O(22, dv), expected(22, dv);
    pool.prefill(ids, offsets, Q, K, V, O, OpenMPExecutor{.threads = 2});
    for (std::size_t i = 0; i < 3; ++i) {
        const Index r0 = offsets[i], n = offsets[i + 1] - r0;
        auto o = expected.middleRows(r0, n);
        memattn::prefill(alone[i], Q.middleRows(r0, n), K.middleRows(r0, n), V.middleRows(r0, n), o);
    }
    CHECK((O.array() == expected.array()).all());
    for (Index step = 0; step < 3; ++step) {
        const Matrix<float> q = random_matrix<float>(3, d, 150 + 3 * static_cast<std::uint64_t>(step)),
                            k = delta_keys(3, d, 151 + 3 * static_cast<std::uint64_t>(step)),
                            v = random_matrix<float>(3, dv, 152 + 3 * static_cast<std::uint64_t>(step));
        Matrix<float> o(3, dv), e(3, dv);
        pool.decode(ids, q, k, v, o, OpenMPExecutor{.threads = static_cast<int>(step) + 1});
        for (std::size_t i = 0; i < 3; ++i) {
            auto row = e.middleRows(static_cast<Index>(i), 1);
            memattn::decode(alone[i], q.middleRows(static_cast<Index>(i), 1), k.middleRows(static_cast<Index>(i), 1),
                            v.middleRows(static_cast<Index>(i), 1), row);
        }
        CHECK((o.array() == e.array()).all());
    }
    CHECK(pool.length(c) == 20);
    // A fork is a copy; the pool is full at 4, and a removed state is given again.
    const Index f = pool.fork(c);
    CHECK(pool.length(f) == 20);
    CHECK_THROWS_AS(pool.add(), PoolExhausted);
    const Matrix<float> q = random_matrix<float>(1, d, 160);
    Matrix<float> x(1, dv), y(1, dv);
    pool.attend(f, q.row(0), x.row(0));
    alone[2].attend(q.row(0), y.row(0));
    CHECK((x.array() == y.array()).all());
    pool.remove(b);
    CHECK(pool.add() == b);
    CHECK(pool.length(b) == 0);
    // Bad input changes nothing: a β outside [0, 1], a repeated id, a dead id.
    Matrix<float> bad = delta_keys(3, d, 170);
    bad(1, d) = 2.0f;
    Matrix<float> o3(3, dv);
    CHECK_THROWS_AS(pool.decode(ids, Q.topRows(3), bad, V.topRows(3), o3), std::invalid_argument);
    CHECK(pool.length(a) == 8);
    CHECK_THROWS_WITH(pool.decode(std::vector<Index>{a, a}, Q.topRows(2), K.topRows(2), V.topRows(2), o3.topRows(2)),
                      Catch::Contains("twice"));
    CHECK_THROWS_AS(pool.update(9, K.row(0), V.row(0)), std::invalid_argument);
    Matrix<float> O2(2, dv);
    CHECK_THROWS_WITH(pool.prefill(std::vector<Index>{a}, std::vector<Index>{0, 3}, Q.topRows(2), K.topRows(3),
                                   V.topRows(3), O2),
                      Catch::Contains("expected 3 each"));
    CHECK(pool.length(a) == 8);
}

TEST_CASE("StatePool: checkpoints every n tokens restore a state bit for bit; other lengths are refused by name",
          "[serving][state_pool]") {
    const Index d = 4, dv = 4, n = 16;
    const GatedLinearAttentionMemory<float> prototype(d, dv);
    StatePool<GatedLinearAttentionMemory<float>> pool(3, prototype, {.checkpoint_tokens = n, .checkpoints = 2});
    GatedLinearAttentionMemory<float> ref(prototype);
    const Index a = pool.add();
    const auto gated = [&](Index rows, std::uint64_t seed) {
        Matrix<float> keys(rows, d + 1);
        keys.leftCols(d) = random_matrix<float>(rows, d, seed);
        keys.rightCols(1) = -(random_matrix<float>(rows, 1, seed + 1).array().abs() * 0.1f);
        return keys;
    };
    const Matrix<float> K = gated(100, 180), V = random_matrix<float>(100, dv, 182);
    // 40 tokens by extend (cut at 16 and 32), 60 one by one: checkpoints at 80 and 96 remain.
    pool.extend(a, K.topRows(40), V.topRows(40));
    for (Index t = 40; t < 100; ++t)
        pool.update(a, K.row(t), V.row(t));
    CHECK(pool.checkpoint_before(a, 90) == 80);
    CHECK(pool.checkpoint_before(a, 79) == 0);  // 16..64 have left the ring
    CHECK(pool.checkpoint_before(a, 100) == 100);
    CHECK_FALSE(pool.can_truncate(a, 90));
    CHECK_THROWS_WITH(pool.truncate(a, 90), Catch::Contains("nearest below is 80"));
    CHECK(pool.length(a) == 100);
    const Index b = pool.fork(a);
    pool.truncate(b, 80);
    CHECK(pool.length(b) == 80);
    CHECK(pool.length(a) == 100);
    // The reference fed the same pieces: 16, 16, 8, then one by one to 80.
    memattn::extend(ref, K.topRows(16), V.topRows(16));
    memattn::extend(ref, K.middleRows(16, 16), V.middleRows(16, 16));
    memattn::extend(ref, K.middleRows(32, 8), V.middleRows(32, 8));
    for (Index t = 40; t < 80; ++t)
        ref.update(K.row(t), V.row(t));
    const Matrix<float> q = random_matrix<float>(1, d, 183);
    Matrix<float> x(1, dv), y(1, dv);
    pool.attend(b, q.row(0), x.row(0));
    ref.attend(q.row(0), y.row(0));
    CHECK((x.array() == y.array()).all());
    // b replays 80..99 and equals a again; checkpoint 96 is taken anew on the way.
    pool.extend(b, K.middleRows(80, 20), V.middleRows(80, 20));
    Matrix<float> xa(1, dv), xb(1, dv);
    pool.attend(a, q.row(0), xa.row(0));
    pool.attend(b, q.row(0), xb.row(0));
    check_close(xb, xa.cast<double>(), 1e-5);
    CHECK(pool.checkpoint_before(b, 99) == 96);
    CHECK(pool.checkpoint_before(b, 95) == 80);  // the restored checkpoint kept, the new one beside it
    // Back to 0 always; snapshots hold the state alone.
    std::stringstream bytes;
    save(pool.sequence(a), bytes);
    auto sb = pool.sequence(b);
    load(sb, bytes);
    CHECK(pool.length(b) == 100);
    CHECK(pool.checkpoint_before(b, 99) == 0);
    pool.truncate(b, 0);
    CHECK(pool.length(b) == 0);
}

TEST_CASE("StatePool: a batch whose executor fails leaves every state and checkpoint as it was",
          "[serving][state_pool]") {
    struct Failing {
        [[nodiscard]] int concurrency() const { return 3; }
        void parallel_for(Index n, const std::function<void(Index)>& f) const {
            if (n > 0)
                f(0);
            throw std::runtime_error("the executor failed");
        }
    };
    const Index d = 4, dv = 3;
    StatePool<DeltaRuleMemory<float>> pool(3, DeltaRuleMemory<float>(d, dv), {.checkpoint_tokens = 2});
    const Index a = pool.add(), b = pool.add(), c = pool.add();
    const std::vector<Index> ids{a, b, c};
    const Matrix<float> K = delta_keys(9, d, 190), V = random_matrix<float>(9, dv, 192), Q = random_matrix<float>(9, d, 193);
    Matrix<float> O(9, dv);
    pool.prefill(ids, std::vector<Index>{0, 3, 4, 9}, Q, K, V, O);
    const auto snapshot_of = [&](Index id) {
        std::stringstream s;
        save(pool.sequence(id), s);
        return s.str();
    };
    const std::vector<std::string> before{snapshot_of(a), snapshot_of(b), snapshot_of(c)};
    Matrix<float> o(3, dv);
    CHECK_THROWS_AS(pool.decode(ids, Q.topRows(3), K.topRows(3), V.topRows(3), o, Failing{}), std::runtime_error);
    CHECK(snapshot_of(a) == before[0]);
    CHECK(snapshot_of(b) == before[1]);
    CHECK(snapshot_of(c) == before[2]);
    CHECK(pool.checkpoint_before(a, 2) == 2);  // a holds 3 tokens, c 5: checkpoints at 2, and at 2 and 4
    CHECK(pool.checkpoint_before(c, 3) == 2);
    CHECK(pool.checkpoint_before(c, 4) == 4);
}

namespace {

/// One step of a hybrid cache's layers and of the same layers' own pools (mirror_kv
/// beside the state pools mirror_states, in layer order), each layer's outputs checked
/// bit for bit; `layers` runs only that many layers (the rest left for rollback).
template <class Cache>
void hybrid_step(Cache& cache, std::vector<StatePool<DeltaRuleMemory<float>>*> mirror_states,
                 PagedKVCache<float>& mirror_kv, const typename Cache::Step& step, std::uint64_t seed,
                 Index layers = -1) {
    const Index rows = step.rows();
    std::size_t next_state = 0;
    for (Index l = 0; l < (layers < 0 ? cache.layers() : layers); ++l) {
        const std::uint64_t at = seed + 10 * static_cast<std::uint64_t>(l);
        if (cache.recurrent(l)) {
            auto& own = *mirror_states[next_state++];
            const Index d = 8, dv = 6;  // the test's memories
            const Matrix<float> Q = random_matrix<float>(rows, d, at), K = delta_keys(rows, d, at + 1),
                                V = random_matrix<float>(rows, dv, at + 2);
            Matrix<float> O(rows, dv), expected(rows, dv);
            if (step.decode()) {
                cache.decode(l, step, Q, K, V, O);
                own.decode(step.slots(), Q, K, V, expected);
            } else {
                cache.prefill(l, step, Q, K, V, O);
                own.prefill(step.slots(), step.q_offsets(), Q, K, V, expected);
            }
            CHECK((O.array() == expected.array()).all());
        } else {
            const Matrix<float> Q = random_matrix<float>(rows, mirror_kv.query_dim(), at),
                                K = random_matrix<float>(rows, mirror_kv.key_dim(), at + 1),
                                V = random_matrix<float>(rows, mirror_kv.value_dim(), at + 2);
            Matrix<float> O(rows, mirror_kv.output_dim()), expected(rows, mirror_kv.output_dim());
            cache.prefill(l, step, Q, K, V, O);
            batched_prefill(mirror_kv, step.slots(), step.q_offsets(), Q, K, V, expected);
            CHECK((O.array() == expected.array()).all());
        }
    }
}

}  // namespace

TEST_CASE("ModelCache with recurrent layers: one id space over state pools and KV pools, each layer bit for bit its "
          "own pool's; truncate to a length every layer holds, rollback to one, snapshots of every layer",
          "[serving][model][state_pool]") {
    const Index d = 8, dv = 6;
    using Delta = DeltaRuleMemory<float>;
    using Cache = ModelCache<float, float, Delta>;
    const Delta prototype(d, dv);
    const auto specs = [&](Index block, Index dv2) {
        return std::vector<Cache::Layer>{StateLayer<Delta>{prototype, {.checkpoint_tokens = 8, .checkpoints = 2}},
                                         ModelLayer{.layout = {4, 2, 8, 0}, .blocks = 40, .block_size = block},
                                         StateLayer<Delta>{Delta(d, dv2), {.checkpoint_tokens = 4, .checkpoints = 3}}};
    };
    Cache cache(specs(16, dv), 3);
    StatePool<Delta> s0(3, prototype, {.checkpoint_tokens = 8, .checkpoints = 2}),
        s2(3, prototype, {.checkpoint_tokens = 4, .checkpoints = 3});
    PagedKVCache<float> kv({4, 2, 8, 0}, 40, 16);
    const std::vector<StatePool<Delta>*> mirror{&s0, &s2};
    CHECK(cache.layers() == 3);
    CHECK(cache.recurrent(0));
    CHECK_FALSE(cache.recurrent(1));
    CHECK_THROWS_WITH(cache.layer(0), Catch::Contains("a recurrent layer"));
    CHECK_THROWS_WITH(cache.states(1), Catch::Contains("a softmax layer"));
    const Index a = cache.add_sequence(), b = cache.add_sequence();
    for (const Index id : {a, b}) {
        CHECK(s0.add() == cache.slot_of(id));
        CHECK(s2.add() == cache.slot_of(id));
        CHECK(kv.add_sequence() == cache.slot_of(id));
    }
    const auto sa = cache.slot_of(a), sb = cache.slot_of(b);
    hybrid_step(cache, mirror, kv, cache.plan(std::vector<Index>{a}, std::vector<Index>{0, 13}), 400);
    const Index c = cache.fork(a);
    const Index sc = cache.slot_of(c);
    CHECK(s0.fork(sa) == sc);
    CHECK(s2.fork(sa) == sc);
    CHECK(kv.fork(sa) == sc);
    hybrid_step(cache, mirror, kv, cache.plan(std::vector<Index>{a, b, c}, std::vector<Index>{0, 5, 12, 13}), 410);
    hybrid_step(cache, mirror, kv, cache.plan_decode(std::vector<Index>{c, a}), 420);
    CHECK(cache.length(a) == 19);
    CHECK(cache.length(b) == 7);
    CHECK(cache.length(c) == 15);
    // Capacity 3: a fourth sequence is refused in every layer.
    CHECK_THROWS_AS(cache.add_sequence(), PoolExhausted);
    CHECK_THROWS_AS(cache.fork(b), PoolExhausted);
    CHECK(cache.sequences() == 3);
    CHECK(cache.layer(1).sequences() == 3);
    CHECK(cache.states(2).sequences() == 3);

    // Truncate: a's checkpoints are 8 and 16 in layer 0, 8, 12 and 16 in layer 2.
    CHECK(cache.checkpoint_before(a, 19) == 19);
    CHECK(cache.checkpoint_before(a, 18) == 16);
    CHECK(cache.checkpoint_before(a, 15) == 8);
    CHECK(cache.checkpoint_before(c, 13) == 8);  // c's ring from the fork: 8 in layer 0; 8, 12 in layer 2
    CHECK_FALSE(cache.can_truncate(a, 18));
    CHECK_THROWS_WITH(cache.truncate(a, 18), Catch::Contains("recurrent layer 0") && Catch::Contains("is 16"));
    CHECK(cache.length(a) == 19);
    cache.truncate(a, 16);
    s0.truncate(sa, 16);
    s2.truncate(sa, 16);
    kv.truncate(sa, 16);
    CHECK(cache.layer(1).length(sa) == 16);
    hybrid_step(cache, mirror, kv, cache.plan(std::vector<Index>{a}, std::vector<Index>{0, 3}), 430);  // the replay

    // Rollback: exact where every recurrent layer holds the state before the step.
    hybrid_step(cache, mirror, kv, cache.plan_decode(std::vector<Index>{b}), 440);  // b: 8, a checkpoint everywhere
    {
        const auto& step = cache.plan_decode(std::vector<Index>{b});
        hybrid_step(cache, mirror, kv, step, 450, 1);  // layer 0 only: its state past 8
        cache.rollback(step);
        s0.truncate(sb, 8);
        CHECK(cache.length(b) == 8);
        CHECK(cache.states(0).length(sb) == 8);
    }
    hybrid_step(cache, mirror, kv, cache.plan_decode(std::vector<Index>{b}), 460);  // b: 9
    {
        const auto& step = cache.plan_decode(std::vector<Index>{b});
        hybrid_step(cache, mirror, kv, step, 470, 2);  // layers 0 and 1: layer 0 holds no state of 9
        cache.rollback(step);
        for (auto* own : mirror)
            own->truncate(sb, 8);
        kv.truncate(sb, 8);
        CHECK(cache.length(b) == 8);  // back to the checkpoint: replay from there
        for (Index l = 0; l < 3; ++l)
            CHECK((cache.recurrent(l) ? cache.states(l).length(sb) : cache.layer(l).length(sb)) == 8);
    }
    hybrid_step(cache, mirror, kv, cache.plan(std::vector<Index>{b, a}, std::vector<Index>{0, 2, 3}), 480);

    // A verify step of a tree is refused in every layer when a recurrent layer keeps no
    // draft states, nothing run.
    {
        const auto& step = cache.plan(std::vector<Index>{a}, std::vector<Index>{0, 2});
        const std::vector<Index> parents{-1, 0};
        const Matrix<float> Q = random_matrix<float>(2, 32, 1), K = random_matrix<float>(2, 16, 2),
                            V = random_matrix<float>(2, 16, 3);
        Matrix<float> O(2, 32);
        CHECK_THROWS_WITH(cache.prefill(1, step, Q, K, V, O, parents),
                          Catch::Contains("layer 0") && Catch::Contains("draft_states is 0"));
        CHECK(cache.pending_drafts(a) == 0);
        CHECK(cache.step_pending());
        cache.rollback(step);
        CHECK(cache.length(a) == 20);
    }

    // Snapshots: every layer's part; loaded into another cache, the next step is the same
    // bits; a cache whose layer 2 has another shape refuses it, changing nothing.
    std::stringstream stream;
    const auto saved = cache.sequence(a);
    memattn::save(saved, stream);
    Cache other(specs(16, dv), 2);
    const Index x = other.add_sequence();
    auto seq = other.sequence(x);
    memattn::load(seq, stream);
    CHECK(other.length(x) == 20);
    const auto& mine = cache.plan_decode(std::vector<Index>{a});
    const auto& theirs = other.plan_decode(std::vector<Index>{x});
    for (Index l = 0; l < 3; ++l) {
        const bool rec = cache.recurrent(l);
        const Index qd = rec ? d : 32, kd = rec ? d + 1 : 16, vd = rec ? dv : 16, od = rec ? dv : 32;
        const Matrix<float> Q = random_matrix<float>(1, qd, 490 + 3 * static_cast<std::uint64_t>(l)),
                            K = rec ? delta_keys(1, d, 491 + 3 * static_cast<std::uint64_t>(l))
                                    : random_matrix<float>(1, kd, 491 + 3 * static_cast<std::uint64_t>(l)),
                            V = random_matrix<float>(1, vd, 492 + 3 * static_cast<std::uint64_t>(l));
        Matrix<float> O1(1, od), O2(1, od);
        cache.decode(l, mine, Q, K, V, O1);
        other.decode(l, theirs, Q, K, V, O2);
        CHECK((O1.array() == O2.array()).all());
    }
    Cache narrow(specs(16, dv + 1), 2);
    const Index y = narrow.add_sequence();
    std::stringstream again;
    const auto saved_b = cache.sequence(b);
    memattn::save(saved_b, again);
    auto narrow_seq = narrow.sequence(y);
    CHECK_THROWS_AS(memattn::load(narrow_seq, again), SnapshotError);
    CHECK(narrow.length(y) == 0);
    CHECK(narrow.states(0).length(narrow.slot_of(y)) == 0);  // read before the refusal, not installed
    CHECK(narrow.layer(1).free_blocks() == 40);

    // A fork that the planned step's blocks refuse (admit): no layer keeps it.
    {
        Cache tight(std::vector<Cache::Layer>{StateLayer<Delta>{prototype, {}},
                                              ModelLayer{.layout = {4, 2, 8, 0}, .blocks = 4, .block_size = 4}},
                    3);
        const Index t = tight.add_sequence();
        const Index st = tight.slot_of(t);
        StatePool<Delta> own_state(3, prototype);
        PagedKVCache<float> own_kv({4, 2, 8, 0}, 4, 4);
        CHECK(own_state.add() == st);
        CHECK(own_kv.add_sequence() == st);
        std::vector<StatePool<Delta>*> own{&own_state};
        hybrid_step(tight, own, own_kv, tight.plan(std::vector<Index>{t}, std::vector<Index>{0, 5}), 510);
        const auto& step = tight.plan(std::vector<Index>{t}, std::vector<Index>{0, 11});  // the 2 free blocks
        CHECK_THROWS_AS(tight.fork(t), PoolExhausted);  // the fork's copy on write would need a third
        CHECK(tight.sequences() == 1);
        CHECK(tight.states(0).sequences() == 1);
        CHECK(tight.layer(1).sequences() == 1);
        hybrid_step(tight, own, own_kv, step, 520);  // the step still runs
        CHECK(tight.length(t) == 16);
    }
    // Rollback past a windowed layer's held tokens: down to its sinks, in every layer.
    {
        Cache windowed(std::vector<Cache::Layer>{StateLayer<Delta>{prototype, {.checkpoint_tokens = 8, .checkpoints = 1}},
                                                 ModelLayer{.layout = {4, 2, 8, 0},
                                                            .blocks = 16,
                                                            .block_size = 4,
                                                            .options = {.window = 6, .sink_tokens = 1}}},
                       2);
        const Index w = windowed.add_sequence();
        const Matrix<float> Q = random_matrix<float>(21, d, 530), K = delta_keys(21, d, 531),
                            V = random_matrix<float>(21, dv, 532), q = random_matrix<float>(21, 32, 533),
                            kv = random_matrix<float>(21, 16, 534);
        Matrix<float> O(21, dv), o(21, 32);
        const auto& prompt = windowed.plan(std::vector<Index>{w}, std::vector<Index>{0, 21});
        windowed.prefill(0, prompt, Q, K, V, O);
        windowed.prefill(1, prompt, q, kv, kv, o);
        CHECK(windowed.states(0).checkpoint_before(windowed.slot_of(w), 20) == 16);
        CHECK_FALSE(windowed.layer(1).can_truncate(windowed.slot_of(w), 16));  // the window freed tokens 16 needs
        CHECK(windowed.checkpoint_before(w, 20) == 0);  // 16, then the window's sink, 1, then the state's 0
        const auto& step = windowed.plan_decode(std::vector<Index>{w});
        windowed.decode(0, step, Q.topRows(1), K.topRows(1), V.topRows(1), O.topRows(1));
        windowed.rollback(step);  // layer 0 holds no state of 21: 16; layer 1 not the tokens of 16: its sink, 1; then 0
        CHECK(windowed.length(w) == 0);
        CHECK(windowed.states(0).length(windowed.slot_of(w)) == 0);
        CHECK(windowed.layer(1).length(windowed.slot_of(w)) == 0);
    }
    // Capacity binds a hybrid cache of softmax layers alone too, named by the cache's call.
    {
        Cache softmax_only(std::vector<Cache::Layer>{ModelLayer{.layout = {4, 2, 8, 0}, .blocks = 4}}, 1);
        softmax_only.add_sequence();
        CHECK_THROWS_WITH(softmax_only.add_sequence(), Catch::Contains("ModelCache::add_sequence") &&
                                                           Catch::Contains("capacity"));
        CHECK(softmax_only.layer(0).sequences() == 1);
    }
    // A truncate to a sequence's own length still ends its pending drafts.
    {
        ModelCache<float> plain(std::vector<ModelLayer>{{.layout = {4, 2, 8, 0}, .blocks = 8, .block_size = 4}});
        const Index p = plain.add_sequence();
        const auto& verify = plain.plan(std::vector<Index>{p}, std::vector<Index>{0, 3});
        const std::vector<Index> tree{-1, 0, 0};
        const Matrix<float> q = random_matrix<float>(3, 32, 540), kv = random_matrix<float>(3, 16, 541);
        Matrix<float> o(3, 32);
        plain.prefill(0, verify, q, kv, kv, o, tree);
        CHECK(plain.pending_drafts(p) == 3);
        plain.truncate(p, 3);
        CHECK(plain.pending_drafts(p) == 0);
    }

    // A model of recurrent layers alone.
    Cache states_only(std::vector<Cache::Layer>{StateLayer<Delta>{prototype, {}}}, 2);
    const Index z = states_only.add_sequence();
    const auto& step = states_only.plan_decode(std::vector<Index>{z});
    const Matrix<float> q = random_matrix<float>(1, d, 500), k = delta_keys(1, d, 501), v = random_matrix<float>(1, dv, 502);
    Matrix<float> o(1, dv);
    states_only.decode(0, step, q, k, v, o);
    CHECK(states_only.length(z) == 1);
    CHECK(states_only.sequences() == 1);
    CHECK(states_only.pending_drafts(z) == 0);
    CHECK(states_only.checkpoint_before(z, 1) == 1);
    CHECK(states_only.checkpoint_before(z, 0) == 0);
    states_only.truncate(z, 0);
    CHECK(states_only.length(z) == 0);
}

namespace {

/// A gated delta-rule layer's key rows: per KV head [k (d) | β | log g], β in [0, 1], log g ≤ 0.
Matrix<float> gated_delta_keys(Index n, Index kv_heads, Index d, std::uint64_t seed) {
    Matrix<float> keys = random_matrix<float>(n, kv_heads * (d + 2), seed);
    const Matrix<float> u = random_matrix<float>(n, 2 * kv_heads, seed + 1);
    for (Index h = 0; h < kv_heads; ++h) {
        keys.col(h * (d + 2) + d) = (u.col(2 * h).array() * 0.5f + 0.5f).cwiseMax(0.0f).cwiseMin(1.0f);
        keys.col(h * (d + 2) + d + 1) = -(u.col(2 * h + 1).array().abs() * 0.3f);
    }
    return keys;
}

}  // namespace

TEST_CASE("StatePool: a verify step's drafts are their paths decoded token by token, bit for bit, on any thread "
          "count; accept keeps a path with the checkpoints it crosses; reject, and every other change, drops them",
          "[serving][state_pool][tree]") {
    using Gdn = MultiHead<DeltaRuleMemory<float>>;
    const Index d = 8, dv = 6;
    const Gdn prototype({.q_heads = 4, .kv_heads = 2, .head_dim = d, .value_dim = dv},
                        [](Index) { return DeltaRuleMemory<float>(8, 6, {.qk_l2norm = true}, true); });
    const Index qw = prototype.query_dim(), vw = prototype.value_dim(), ow = prototype.output_dim();
    StatePool<Gdn> pool(3, prototype, {.checkpoint_tokens = 4, .checkpoints = 3, .draft_states = 20});
    CHECK(pool.free_draft_states() == 20);
    std::vector<Gdn> alone(2, prototype);  // the same tokens decoded apart
    const Index a = pool.add(), b = pool.add();
    const std::vector<Index> ids{a, b};
    {
        const std::vector<Index> offsets{0, 6, 9};
        const Matrix<float> Q = random_matrix<float>(9, qw, 600), K = gated_delta_keys(9, 2, d, 601),
                            V = random_matrix<float>(9, vw, 603);
        Matrix<float> O(9, ow);
        pool.prefill(ids, offsets, Q, K, V, O);
        for (std::size_t i = 0; i < 2; ++i) {
            Matrix<float> o(offsets[i + 1] - offsets[i], ow);
            memattn::prefill(alone[i], Q.middleRows(offsets[i], o.rows()), K.middleRows(offsets[i], o.rows()),
                             V.middleRows(offsets[i], o.rows()), o);
        }
    }
    // a: a tree of 9 drafts (two roots); b: a chain of 3.
    const std::vector<Index> tree_a{-1, 0, 0, 1, 1, 2, -1, 6, 3}, tree_b{-1, 0, 1};
    std::vector<Index> parents = tree_a;
    parents.insert(parents.end(), tree_b.begin(), tree_b.end());
    const std::vector<Index> offsets{0, 9, 12};
    const Matrix<float> Q = random_matrix<float>(12, qw, 610), K = gated_delta_keys(12, 2, d, 611),
                        V = random_matrix<float>(12, vw, 613);
    Matrix<float> O1(12, ow), O2(12, ow);
    pool.prefill(ids, offsets, Q, K, V, O1, OpenMPExecutor{.threads = 1}, parents);
    CHECK(pool.pending_drafts(a) == 9);
    CHECK(pool.pending_drafts(b) == 3);
    CHECK(pool.free_draft_states() == 8);
    CHECK(pool.length(a) == 6);  // the states as they were
    CHECK(pool.length(b) == 3);
    // Each draft's output is its path decoded token by token from the sequence's state.
    for (std::size_t i = 0; i < 2; ++i) {
        const std::vector<Index>& tree = i == 0 ? tree_a : tree_b;
        for (Index t = 0; t < static_cast<Index>(tree.size()); ++t) {
            Gdn m = alone[i];
            Matrix<float> o(1, ow);
            for (const Index p : tree_path(tree, t)) {
                const Index r = offsets[i] + p;
                memattn::decode(m, Q.middleRows(r, 1), K.middleRows(r, 1), V.middleRows(r, 1), o);
            }
            CHECK((o.array() == O1.row(offsets[i] + t).array()).all());
        }
    }
    // Another verify of both needs 12 more free draft states: refused, nothing changed.
    CHECK_THROWS_AS(pool.prefill(ids, offsets, Q, K, V, O2, OpenMPExecutor{.threads = 2}, parents), PoolExhausted);
    CHECK(pool.pending_drafts(a) == 9);
    CHECK(pool.free_draft_states() == 8);
    // Rejected, then verified again with the batch over two threads: the same bits.
    pool.reject(a);
    pool.reject(b);
    pool.prefill(ids, offsets, Q, K, V, O2, OpenMPExecutor{.threads = 2}, parents);
    CHECK((O2.array() == O1.array()).all());
    // b's verify again on two threads (its earlier drafts released): the same bits.
    pool.prefill(std::vector<Index>{b}, std::vector<Index>{0, 3}, Q.bottomRows(3), K.bottomRows(3), V.bottomRows(3),
                 O2.bottomRows(3), OpenMPExecutor{.threads = 2}, tree_b);
    CHECK((O2.bottomRows(3).array() == O1.bottomRows(3).array()).all());
    CHECK(pool.free_draft_states() == 8);
    // Bad paths and trees are refused by name, nothing changed.
    CHECK_THROWS_WITH(pool.accept(b, std::vector<Index>{1}), Catch::Contains("StatePool::accept") &&
                                                                 Catch::Contains("must be a root"));
    CHECK_THROWS_WITH(pool.accept(a, std::vector<Index>{0, 1, 4, 8}), Catch::Contains("whose parent is 3"));
    CHECK_THROWS_WITH(pool.accept(a, std::vector<Index>{9}), Catch::Contains("expected a draft, 0 to 8"));
    CHECK_THROWS_WITH(pool.prefill(std::vector<Index>{b}, std::vector<Index>{0, 2}, Q.topRows(2), K.topRows(2),
                                   V.topRows(2), O2.topRows(2), std::vector<Index>{0, -1}),
                      Catch::Contains("parents") && Catch::Contains("expected -1 (a root)"));
    CHECK_THROWS_WITH(pool.prefill(std::vector<Index>{b}, std::vector<Index>{0, 2}, Q.topRows(2), K.topRows(2),
                                   V.topRows(2), O2.topRows(2), std::vector<Index>{-1}),
                      Catch::Contains("expected 2 (one per row of K)"));
    CHECK(pool.pending_drafts(b) == 3);
    CHECK(pool.free_draft_states() == 8);

    // Accept a's path 0, 1, 3, 8: tokens 7 to 10, a checkpoint at 8 on the way (draft 1's state).
    const std::vector<Index> path{0, 1, 3, 8};
    Gdn at8 = alone[0];
    {
        Matrix<float> o(1, ow);
        for (std::size_t k = 0; k < path.size(); ++k) {
            const Index r = path[k];
            memattn::decode(alone[0], Q.middleRows(r, 1), K.middleRows(r, 1), V.middleRows(r, 1), o);
            if (k == 1)
                at8 = alone[0];
        }
    }
    pool.accept(a, path);
    CHECK(pool.length(a) == 10);
    CHECK(pool.pending_drafts(a) == 0);
    CHECK(pool.free_draft_states() == 17);
    const auto same_state = [&](Index id, const Gdn& expected, std::uint64_t seed) {
        const Matrix<float> q = random_matrix<float>(3, qw, seed);
        Matrix<float> x(3, ow), y(3, ow);
        for (Index r = 0; r < 3; ++r) {
            pool.attend(id, q.row(r), x.row(r));
            expected.attend(q.row(r), y.row(r));
        }
        return pool.length(id) == expected.length() && (x.array() == y.array()).all();
    };
    CHECK(same_state(a, alone[0], 620));
    CHECK(pool.checkpoint_before(a, 9) == 8);
    const Index f = pool.fork(a);
    pool.truncate(f, 8);
    CHECK(same_state(f, at8, 621));
    pool.remove(f);
    // reject: the state as it was; a second reject is refused; an empty path is a reject.
    pool.reject(b);
    CHECK(pool.pending_drafts(b) == 0);
    CHECK(pool.free_draft_states() == 20);
    CHECK(same_state(b, alone[1], 622));
    CHECK_THROWS_WITH(pool.reject(b), Catch::Contains("no pending drafts"));
    CHECK_THROWS_WITH(pool.accept(b, std::vector<Index>{}), Catch::Contains("no pending drafts"));
    const auto verify_b = [&] {
        pool.prefill(std::vector<Index>{b}, std::vector<Index>{0, 3}, Q.bottomRows(3), K.bottomRows(3),
                     V.bottomRows(3), O2.bottomRows(3), tree_b);
        CHECK(pool.pending_drafts(b) == 3);
    };
    verify_b();
    pool.accept(b, std::vector<Index>{});
    CHECK(pool.pending_drafts(b) == 0);
    CHECK(same_state(b, alone[1], 623));
    // A chunk without rows leaves the sequence's drafts pending; a fork takes none; every
    // other change drops them (update, decode, prefill, truncate, a load, remove).
    verify_b();
    Matrix<float> none(0, ow);
    pool.prefill(std::vector<Index>{b}, std::vector<Index>{0, 0}, Q.topRows(0), K.topRows(0), V.topRows(0), none,
                 std::vector<Index>{});
    CHECK(pool.pending_drafts(b) == 3);
    const Index g = pool.fork(b);
    CHECK(pool.pending_drafts(g) == 0);
    pool.remove(g);
    Matrix<float> o1(1, ow);
    const std::vector<std::function<void()>> changes{
        [&] { pool.update(b, K.row(0), V.row(0)); },
        [&] { pool.decode(std::vector<Index>{b}, Q.topRows(1), K.topRows(1), V.topRows(1), o1); },
        [&] { pool.prefill(std::vector<Index>{b}, std::vector<Index>{0, 1}, Q.topRows(1), K.topRows(1), V.topRows(1), o1); },
        [&] { pool.truncate(b, pool.length(b)); },
        [&] {
            std::stringstream s;
            save(pool.sequence(b), s);
            auto seq = pool.sequence(b);
            load(seq, s);
        },
        [&] {
            pool.remove(b);
            CHECK(pool.add() == b);
        }};
    for (const auto& change : changes) {
        verify_b();
        CHECK(pool.free_draft_states() == 17);
        change();
        CHECK(pool.pending_drafts(b) == 0);
        CHECK(pool.free_draft_states() == 20);
    }
    // An executor that throws: the drafts pending before stay, every state as it was.
    struct Failing {
        [[nodiscard]] int concurrency() const { return 2; }
        void parallel_for(Index n, const std::function<void(Index)>& f) const {
            if (n > 0)
                f(0);
            throw std::runtime_error("the executor failed");
        }
    };
    pool.prefill(std::vector<Index>{a}, std::vector<Index>{0, 9}, Q.topRows(9), K.topRows(9), V.topRows(9),
                 O2.topRows(9), tree_a);
    CHECK_THROWS_AS(pool.prefill(ids, offsets, Q, K, V, O2, Failing{}, parents), PoolExhausted);  // 9 + 12 > 20
    CHECK_THROWS_AS(pool.prefill(std::vector<Index>{b, a}, std::vector<Index>{0, 3, 3}, Q.bottomRows(3),
                                 K.bottomRows(3), V.bottomRows(3), O2.bottomRows(3), Failing{}, tree_b),
                    std::runtime_error);
    CHECK(pool.pending_drafts(a) == 9);
    CHECK(pool.pending_drafts(b) == 0);
    CHECK(pool.free_draft_states() == 11);
    CHECK(same_state(a, alone[0], 624));
    // The draft states given back serve the next verify step: each draft its path's decode.
    pool.prefill(std::vector<Index>{b}, std::vector<Index>{0, 3}, Q.bottomRows(3), K.bottomRows(3), V.bottomRows(3),
                 O2.bottomRows(3), tree_b);
    {
        Gdn m = pool.state(b);
        Matrix<float> o(1, ow);
        for (Index t = 0; t < 3; ++t) {
            memattn::decode(m, Q.middleRows(9 + t, 1), K.middleRows(9 + t, 1), V.middleRows(9 + t, 1), o);
            CHECK((o.array() == O2.row(9 + t).array()).all());
        }
    }
    // A pool without draft states refuses a verify step by name.
    StatePool<Gdn> plain(1, prototype);
    const Index p0 = plain.add();
    CHECK_THROWS_WITH(plain.prefill(std::vector<Index>{p0}, std::vector<Index>{0, 3}, Q.topRows(3), K.topRows(3),
                                    V.topRows(3), O2.topRows(3), tree_b),
                      Catch::Contains("StatePool::prefill") && Catch::Contains("draft_states is 0"));
    CHECK(plain.pending_drafts(p0) == 0);
}

TEST_CASE("ModelCache with recurrent layers: a verify step of draft trees in every layer, accept and reject in all at "
          "once, equal to each layer's own pool; a sequence with pending drafts is accepted before it is planned",
          "[serving][model][state_pool][tree]") {
    const Index d = 8, dv = 6;
    using Delta = DeltaRuleMemory<float>;
    using Cache = ModelCache<float, float, Delta>;
    const Delta prototype(d, dv);
    const StatePoolOptions states_options{.checkpoint_tokens = 4, .checkpoints = 2, .draft_states = 12};
    const ModelLayer softmax{.layout = {4, 2, 8, 0}, .blocks = 40, .block_size = 4};
    Cache cache(std::vector<Cache::Layer>{StateLayer<Delta>{prototype, states_options}, softmax,
                                          StateLayer<Delta>{prototype, states_options}},
                3);
    StatePool<Delta> s0(3, prototype, states_options), s2(3, prototype, states_options);
    PagedKVCache<float> kv(softmax.layout, softmax.blocks, softmax.block_size);
    const Index a = cache.add_sequence(), b = cache.add_sequence();
    for (const Index id : {a, b}) {
        CHECK(s0.add() == cache.slot_of(id));
        CHECK(s2.add() == cache.slot_of(id));
        CHECK(kv.add_sequence() == cache.slot_of(id));
    }
    const std::vector<StatePool<Delta>*> mirror{&s0, &s2};
    hybrid_step(cache, mirror, kv, cache.plan(std::vector<Index>{a, b}, std::vector<Index>{0, 6, 9}), 700);
    // The verify step: a tree of 5 drafts for a, a chain of 2 for b, every layer's outputs
    // the same bits as its own pool's.
    const std::vector<Index> parents{-1, 0, 0, 2, -1, /* b */ -1, 0};
    const auto verify = [&](const std::vector<Index>& ids, const std::vector<Index>& offsets,
                            const std::vector<Index>& tree, std::uint64_t seed, Index layers) {
        const auto& step = cache.plan(ids, offsets);
        const Index rows = step.rows();
        std::size_t next_state = 0;
        for (Index l = 0; l < layers; ++l) {
            const std::uint64_t at = seed + 10 * static_cast<std::uint64_t>(l);
            const bool rec = cache.recurrent(l);
            const Index qd = rec ? d : kv.query_dim(), vd = rec ? dv : kv.value_dim(), od = rec ? dv : kv.output_dim();
            const Matrix<float> Q = random_matrix<float>(rows, qd, at),
                                K = rec ? delta_keys(rows, d, at + 1) : random_matrix<float>(rows, kv.key_dim(), at + 1),
                                V = random_matrix<float>(rows, vd, at + 2);
            Matrix<float> O(rows, od), expected(rows, od);
            cache.prefill(l, step, Q, K, V, O, tree);
            if (rec)
                mirror[next_state++]->prefill(step.slots(), step.q_offsets(), Q, K, V, expected, tree);
            else
                batched_prefill(kv, step.slots(), step.q_offsets(), Q, K, V, expected, {}, tree);
            CHECK((O.array() == expected.array()).all());
        }
        return &step;
    };
    verify({a, b}, {0, 5, 7}, parents, 710, 3);
    CHECK(cache.pending_drafts(a) == 5);
    CHECK(cache.pending_drafts(b) == 2);
    CHECK(cache.length(a) == 11);  // as a softmax layer counts them
    CHECK(cache.states(0).length(cache.slot_of(a)) == 6);
    CHECK(cache.states(2).free_draft_states() == 5);
    // Pending drafts bar a plan, a fork, a save and a truncate past them, by name.
    CHECK_THROWS_WITH(cache.plan_decode(std::vector<Index>{b}), Catch::Contains("ModelCache::plan_decode") &&
                                                                    Catch::Contains("2 pending drafts"));
    CHECK_THROWS_WITH(cache.fork(a), Catch::Contains("before it is forked"));
    {
        std::stringstream s;
        CHECK_THROWS_WITH(save(cache.sequence(a), s), Catch::Contains("before it is saved"));
    }
    CHECK_THROWS_WITH(cache.truncate(a, 7), Catch::Contains("past the 6 tokens"));
    // A path refused in one layer is refused in all; then accept keeps it everywhere: the
    // next step is the same bits as the pools' own after their accepts.
    CHECK_THROWS_WITH(cache.accept(a, std::vector<Index>{0, 3}), Catch::Contains("ModelCache::accept") &&
                                                                     Catch::Contains("layer 0"));
    CHECK(cache.pending_drafts(a) == 5);
    const std::vector<Index> path{0, 2, 3};
    cache.accept(a, path);
    s0.accept(cache.slot_of(a), path);
    s2.accept(cache.slot_of(a), path);
    kv.accept(cache.slot_of(a), path);
    CHECK(cache.length(a) == 9);
    CHECK(cache.states(0).length(cache.slot_of(a)) == 9);
    CHECK(cache.states(0).checkpoint_before(cache.slot_of(a), 8) == 8);  // crossed on the path
    cache.reject(b);
    s0.reject(cache.slot_of(b));
    s2.reject(cache.slot_of(b));
    kv.reject(cache.slot_of(b));
    CHECK(cache.length(b) == 3);
    CHECK(cache.states(2).free_draft_states() == 12);
    hybrid_step(cache, mirror, kv, cache.plan_decode(std::vector<Index>{b, a}), 720);
    // Too many drafts for a recurrent layer's draft states: refused by the step's first
    // layer, naming the layer, before any layer holds drafts.
    {
        std::vector<Index> chain{-1};
        for (Index t = 1; t < 13; ++t)
            chain.push_back(t - 1);
        const auto& step = cache.plan(std::vector<Index>{a}, std::vector<Index>{0, 13});
        const Matrix<float> q = random_matrix<float>(13, kv.query_dim(), 730), k = random_matrix<float>(13, kv.key_dim(), 731);
        Matrix<float> o(13, kv.output_dim());
        CHECK_THROWS_WITH(cache.prefill(1, step, q, k, k, o, chain),
                          Catch::Contains("layer 0's draft states") && Catch::Contains("needs 13"));
        CHECK(cache.pending_drafts(a) == 0);
        cache.rollback(step);
    }
    // A verify step run in one layer, taken back: no layer keeps drafts.
    {
        const auto* step = verify({a}, {0, 3}, {-1, 0, 0}, 740, 1);
        CHECK(cache.states(0).pending_drafts(cache.slot_of(a)) == 3);
        cache.rollback(*step);
        s0.reject(cache.slot_of(a));
        CHECK(cache.states(0).pending_drafts(cache.slot_of(a)) == 0);
        CHECK(cache.states(0).free_draft_states() == 12);
        CHECK(cache.length(a) == 10);
    }
    // A truncate within the length before the drafts drops them in every layer.
    verify({a}, {0, 3}, {-1, 0, 1}, 750, 3);
    cache.truncate(a, 8);
    for (auto* own : mirror)
        own->truncate(cache.slot_of(a), 8);
    kv.truncate(cache.slot_of(a), 8);
    CHECK(cache.pending_drafts(a) == 0);
    CHECK(cache.layer(1).pending_drafts(cache.slot_of(a)) == 0);
    CHECK(cache.states(2).free_draft_states() == 12);
    hybrid_step(cache, mirror, kv, cache.plan_decode(std::vector<Index>{a}), 760);
    const Index sa = cache.slot_of(a), sb = cache.slot_of(b);

    // With drafts pending: truncate's range, can_truncate and checkpoint_before stop at the
    // length before them; a truncate to it exactly drops them in every layer.
    verify({a}, {0, 3}, {-1, 0, 0}, 765, 3);
    CHECK(cache.length(a) == 12);
    CHECK_THROWS_WITH(cache.truncate(a, -1), Catch::Contains("expected 0 to 12"));
    CHECK_FALSE(cache.can_truncate(a, 10));
    CHECK(cache.can_truncate(a, 9));
    CHECK(cache.checkpoint_before(a, 11) == 9);
    cache.truncate(a, 9);
    for (auto* own : mirror)
        own->truncate(sa, 9);
    kv.truncate(sa, 9);
    CHECK(cache.pending_drafts(a) == 0);
    CHECK(cache.layer(1).length(sa) == 9);
    CHECK(cache.states(0).free_draft_states() == 12);

    // Every layer runs a step the same way: a layer without the parents, or with others,
    // is refused; a rollback of a verify step that a recurrent and a softmax layer have
    // run leaves no drafts in any layer.
    {
        const auto* step = verify({a, b}, {0, 2, 3}, {-1, 0, -1}, 780, 2);
        const Matrix<float> Q = random_matrix<float>(3, d, 790), K = delta_keys(3, d, 791),
                            V = random_matrix<float>(3, dv, 792);
        Matrix<float> O(3, dv);
        CHECK_THROWS_WITH(cache.prefill(2, *step, Q, K, V, O), Catch::Contains("as a verify step"));
        CHECK_THROWS_WITH(cache.prefill(2, *step, Q, K, V, O, std::vector<Index>{-1, -1, -1}),
                          Catch::Contains("differ from those"));
        CHECK(cache.states(2).pending_drafts(sa) == 0);
        cache.rollback(*step);
        for (const Index s : {sa, sb}) {
            s0.reject(s);
            kv.reject(s);
            for (Index l = 0; l < 3; ++l)
                CHECK((cache.recurrent(l) ? cache.states(l).pending_drafts(s) : cache.layer(l).pending_drafts(s)) == 0);
        }
        CHECK(cache.length(a) == 9);
        CHECK(cache.layer(1).length(sa) == 9);
        CHECK(cache.states(0).free_draft_states() == 12);
    }
    hybrid_step(cache, mirror, kv, cache.plan_decode(std::vector<Index>{a, b}), 795);  // the mirrors agree

    // A load drops a sequence's pending drafts in every layer, a remove frees its draft states.
    {
        std::stringstream saved;
        save(cache.sequence(b), saved);
        verify({a, b}, {0, 2, 3}, {-1, 0, -1}, 800, 3);
        CHECK(cache.states(2).free_draft_states() == 9);
        auto seq = cache.sequence(b);
        load(seq, saved);
        CHECK(cache.pending_drafts(b) == 0);
        CHECK(cache.layer(1).pending_drafts(sb) == 0);
        CHECK(cache.states(2).free_draft_states() == 10);
        cache.remove(a);
        CHECK(cache.states(0).free_draft_states() == 12);
        CHECK(cache.states(2).free_draft_states() == 12);
    }
    // A remove of a sequence of a step run in some layers leaves the step running for the
    // others (its slot kept until the step ends); removing every one of them ends it.
    {
        const Index c = cache.add_sequence(), sc = cache.slot_of(c), before = cache.length(b);
        const auto& step = cache.plan_decode(std::vector<Index>{b, c});
        const Matrix<float> Q = random_matrix<float>(2, d, 810), K = delta_keys(2, d, 811),
                            V = random_matrix<float>(2, dv, 812), q = random_matrix<float>(2, kv.query_dim(), 813),
                            k = random_matrix<float>(2, kv.key_dim(), 814);
        Matrix<float> O(2, dv), o(2, kv.output_dim());
        cache.decode(0, step, Q, K, V, O);
        cache.remove(c);
        CHECK_FALSE(cache.contains(c));
        CHECK(cache.step_pending());
        CHECK(cache.states(2).contains(sc));  // its slot until the step ends
        cache.decode(1, step, q, k, k, o);
        cache.decode(2, step, Q, K, V, O);
        CHECK_FALSE(cache.step_pending());
        CHECK_FALSE(cache.states(2).contains(sc));
        CHECK_FALSE(cache.layer(1).contains(sc));
        CHECK(cache.length(b) == before + 1);
        for (Index l = 0; l < 3; ++l)
            CHECK((cache.recurrent(l) ? cache.states(l).length(sb) : cache.layer(l).length(sb)) == before + 1);
        // Every sequence of a half-run step removed: the step ends at once.
        const Index e = cache.add_sequence(), se = cache.slot_of(e);
        const auto& lone = cache.plan_decode(std::vector<Index>{e});
        cache.decode(0, lone, Q.topRows(1), K.topRows(1), V.topRows(1), O.topRows(1));
        cache.remove(e);
        CHECK_FALSE(cache.step_pending());
        CHECK_FALSE(cache.states(0).contains(se));
        CHECK(cache.sequences() == 1);
    }
    // A verify step's sequence removed half way: its id is refused at once, its slot
    // counts until the step ends (here taken back), then its draft states and slot come
    // back. A layer must run the step as the layers before it did.
    {
        const Index f = cache.add_sequence(), sf = cache.slot_of(f);
        const auto& step = cache.plan(std::vector<Index>{b, f}, std::vector<Index>{0, 2, 3});
        const std::vector<Index> tree{-1, 0, -1};
        const Matrix<float> Q = random_matrix<float>(3, d, 900), K = delta_keys(3, d, 901),
                            V = random_matrix<float>(3, dv, 902), q = random_matrix<float>(3, kv.query_dim(), 903),
                            k = random_matrix<float>(3, kv.key_dim(), 904);
        Matrix<float> O(3, dv), o(3, kv.output_dim());
        cache.prefill(0, step, Q, K, V, O, tree);
        CHECK(cache.states(0).free_draft_states() == 9);
        CHECK_THROWS_WITH(cache.prefill(1, step, q, k, k, o), Catch::Contains("as a verify step"));
        cache.remove(f);
        CHECK_THROWS_WITH(cache.length(f), Catch::Contains("was removed"));
        CHECK_THROWS_WITH(cache.remove(f), Catch::Contains("was removed"));
        CHECK(cache.sequences() == 2);
        const Index g = cache.add_sequence();  // the third slot: f's is still held
        CHECK(cache.slot_of(g) != sf);
        CHECK_THROWS_AS(cache.add_sequence(), PoolExhausted);
        cache.rollback(step);
        CHECK(cache.states(0).free_draft_states() == 12);
        CHECK(cache.states(0).pending_drafts(sb) == 0);
        CHECK_FALSE(cache.states(0).contains(sf));
        CHECK_FALSE(cache.layer(1).contains(sf));
        CHECK(cache.sequences() == 2);
        const Index h = cache.add_sequence();  // f's slot again, under a new id
        CHECK(cache.slot_of(h) == sf);
        CHECK_FALSE(cache.contains(f));
        cache.remove(g);
        cache.remove(h);
        // A plain first layer, then parents: refused.
        const auto& plain = cache.plan(std::vector<Index>{b}, std::vector<Index>{0, 1});
        cache.prefill(0, plain, Q.topRows(1), K.topRows(1), V.topRows(1), O.topRows(1));
        CHECK_THROWS_WITH(cache.prefill(1, plain, q.topRows(1), k.topRows(1), k.topRows(1), o.topRows(1),
                                        std::vector<Index>{-1}),
                          Catch::Contains("ran it without"));
        cache.rollback(plain);
    }

    // A model of recurrent layers alone: its length counts the drafts, as a softmax layer's.
    Cache states_only(std::vector<Cache::Layer>{StateLayer<Delta>{prototype, states_options}}, 1);
    const Index z = states_only.add_sequence();
    const auto& step = states_only.plan(std::vector<Index>{z}, std::vector<Index>{0, 2});
    const Matrix<float> q = random_matrix<float>(2, d, 770), k = delta_keys(2, d, 771), v = random_matrix<float>(2, dv, 772);
    Matrix<float> o(2, dv);
    states_only.prefill(0, step, q, k, v, o, std::vector<Index>{-1, -1});
    CHECK(states_only.length(z) == 2);
    CHECK(states_only.pending_drafts(z) == 2);
    states_only.accept(z, std::vector<Index>{1});
    CHECK(states_only.length(z) == 1);
    CHECK(states_only.pending_drafts(z) == 0);
}

namespace {

/// A verify step of one tree per sequence (ids[i] takes trees[i]) on `threads` threads,
/// each draft's output checked bit for bit against its path decoded from alone[i] (the
/// sequence's own memory); then accept(ids[i], paths[i]), the same path decoded into
/// alone[i], and the states compared by their attends.
template <class M, class Keys>
void verify_and_accept(StatePool<M>& pool, std::vector<M>& alone, const std::vector<Index>& ids,
                       const std::vector<std::vector<Index>>& trees, const std::vector<std::vector<Index>>& paths,
                       Index qd, Index vd, Keys&& keys, std::uint64_t seed, int threads) {
    using S = typename M::Scalar;
    std::vector<Index> offsets{0}, parents;
    for (const auto& tree : trees) {
        parents.insert(parents.end(), tree.begin(), tree.end());
        offsets.push_back(offsets.back() + static_cast<Index>(tree.size()));
    }
    const Index rows = offsets.back();
    const Matrix<S> Q = random_matrix<float>(rows, qd, seed).template cast<S>(), K = keys(rows, seed + 1),
                    V = random_matrix<float>(rows, vd, seed + 2).template cast<S>();
    Matrix<S> O(rows, vd);
    pool.prefill(ids, offsets, Q, K, V, O, OpenMPExecutor{.threads = threads}, parents);
    for (std::size_t i = 0; i < ids.size(); ++i) {
        CHECK(pool.pending_drafts(ids[i]) == static_cast<Index>(trees[i].size()));
        for (Index t = 0; t < static_cast<Index>(trees[i].size()); ++t) {
            M m = alone[i];
            Matrix<S> o(1, vd);
            for (const Index p : tree_path(trees[i], t)) {
                const Index r = offsets[i] + p;
                memattn::decode(m, Q.middleRows(r, 1), K.middleRows(r, 1), V.middleRows(r, 1), o);
            }
            CHECK((o.array() == O.row(offsets[i] + t).array()).all());
        }
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
        pool.accept(ids[i], paths[i]);
        Matrix<S> o(1, vd);
        for (const Index p : paths[i]) {
            const Index r = offsets[i] + p;
            memattn::decode(alone[i], Q.middleRows(r, 1), K.middleRows(r, 1), V.middleRows(r, 1), o);
        }
        CHECK(pool.length(ids[i]) == alone[i].length());
        CHECK(pool.pending_drafts(ids[i]) == 0);
        const Matrix<S> q = random_matrix<float>(2, qd, seed + 3).template cast<S>();
        Matrix<S> x(2, vd), y(2, vd);
        for (Index r = 0; r < 2; ++r) {
            pool.attend(ids[i], q.row(r), x.row(r));
            alone[i].attend(q.row(r), y.row(r));
        }
        CHECK((x.array() == y.array()).all());
    }
}

}  // namespace

TEST_CASE("StatePool: accept keeps the checkpoints its path crosses (of more than the ring holds, the last), ending on "
          "one or not; linear attention and bfloat16 memories verify and accept bit for bit on 1 and 2 threads",
          "[serving][state_pool][tree]") {
    using Delta = DeltaRuleMemory<float>;
    const Index d = 4, dv = 3;
    const auto keys = [=](Index n, std::uint64_t seed) { return delta_keys(n, d, seed); };
    // Checkpoints every token, a ring of 2: a path of 5 from length 0 crosses 1 to 5 and
    // ends on one; the ring keeps 4 and 5.
    {
        const Delta prototype(d, dv);
        StatePool<Delta> pool(2, prototype, {.checkpoint_tokens = 1, .checkpoints = 2, .draft_states = 8});
        std::vector<Delta> alone{prototype};
        const Index a = pool.add();
        std::vector<Delta> at4{prototype};
        verify_and_accept(pool, at4, {a}, {{-1, 0, 1, 2, 3, 0}}, {{0, 1, 2, 3}}, d, dv, keys, 800, 1);
        pool.truncate(a, 0);
        verify_and_accept(pool, alone, {a}, {{-1, 0, 1, 2, 3, 0}}, {{0, 1, 2, 3, 4}}, d, dv, keys, 800, 1);
        CHECK(pool.length(a) == 5);
        CHECK(pool.checkpoint_before(a, 4) == 4);
        CHECK(pool.checkpoint_before(a, 3) == 0);  // 1 to 3: out of the ring
        CHECK(pool.free_draft_states() == 8);
        pool.truncate(a, 4);
        const Matrix<float> q = random_matrix<float>(1, d, 810);
        Matrix<float> x(1, dv), y(1, dv);
        pool.attend(a, q.row(0), x.row(0));
        at4[0].attend(q.row(0), y.row(0));
        CHECK((x.array() == y.array()).all());
        // The ring goes on from the kept checkpoint: a step puts 5 back, 4 stays.
        Matrix<float> o(1, dv);
        pool.decode(std::vector<Index>{a}, q, delta_keys(1, d, 811), random_matrix<float>(1, dv, 812), o);
        CHECK(pool.checkpoint_before(a, 4) == 4);
        CHECK(pool.checkpoint_before(a, 5) == 5);
    }
    // Every 3 tokens, a ring of 3: from length 1 a path of 4 crosses 3 and ends at 5.
    {
        const Delta prototype(d, dv);
        StatePool<Delta> pool(2, prototype, {.checkpoint_tokens = 3, .checkpoints = 3, .draft_states = 8});
        std::vector<Delta> alone{prototype};
        const Index b = pool.add();
        verify_and_accept(pool, alone, {b}, {{-1}}, {{0}}, d, dv, keys, 820, 1);
        std::vector<Delta> at3 = alone;  // a fork of b taking the path's first two drafts
        const Index c = pool.fork(b);
        verify_and_accept(pool, at3, {c}, {{-1, 0, 1, 2, -1}}, {{0, 1}}, d, dv, keys, 830, 1);
        verify_and_accept(pool, alone, {b}, {{-1, 0, 1, 2, -1}}, {{0, 1, 2, 3}}, d, dv, keys, 830, 2);
        CHECK(pool.length(b) == 5);
        CHECK(pool.checkpoint_before(b, 4) == 3);
        pool.truncate(b, 3);
        const Matrix<float> q = random_matrix<float>(1, d, 840);
        Matrix<float> x(1, dv), y(1, dv);
        pool.attend(b, q.row(0), x.row(0));
        at3[0].attend(q.row(0), y.row(0));
        CHECK((x.array() == y.array()).all());
    }
    // Values 128 wide (whole panels: on AVX-512 the draft states streamed past the cache),
    // two sequences' trees on two threads, each accept then read on this one.
    {
        const Delta prototype(d, 128, {.qk_l2norm = true}, true);
        StatePool<Delta> pool(2, prototype, {.checkpoint_tokens = 3, .draft_states = 16});
        std::vector<Delta> alone(2, prototype);
        const std::vector<Index> ids{pool.add(), pool.add()};
        const auto gated_keys = [=](Index n, std::uint64_t seed) {
            Matrix<float> k(n, d + 2);
            k.leftCols(d + 1) = delta_keys(n, d, seed);
            k.col(d + 1) = -(random_matrix<float>(n, 1, seed + 7).array().abs() * 0.5f);
            return k;
        };
        for (int round = 0; round < 3; ++round)
            verify_and_accept(pool, alone, ids, {{-1, 0, 0, 1, 3, 2, -1}, {-1, 0, 1, 2, 0}}, {{0, 1, 3}, {0, 1, 2}}, d,
                              128, gated_keys, 870 + 10 * static_cast<std::uint64_t>(round), 2);
    }
    // Linear attention (its copy assignment in place) and a bfloat16 delta rule: two
    // sequences' trees over one and two threads.
    {
        const LinearAttentionMemory<float> prototype(d, dv);
        StatePool<LinearAttentionMemory<float>> pool(2, prototype, {.checkpoint_tokens = 2, .draft_states = 12});
        std::vector<LinearAttentionMemory<float>> alone(2, prototype);
        const std::vector<Index> ids{pool.add(), pool.add()};
        const auto plain_keys = [=](Index n, std::uint64_t seed) { return random_matrix<float>(n, d, seed); };
        for (int threads = 1; threads <= 2; ++threads)
            verify_and_accept(pool, alone, ids, {{-1, 0, 0, 1, 3}, {-1, -1, 1}}, {{0, 1, 3}, {1, 2}}, d, dv, plain_keys,
                              850 + static_cast<std::uint64_t>(threads), threads);
    }
    {
        using Bf16 = DeltaRuleMemory<Eigen::bfloat16>;
        const Bf16 prototype(d, dv);
        StatePool<Bf16> pool(2, prototype, {.checkpoint_tokens = 2, .draft_states = 12});
        std::vector<Bf16> alone(2, prototype);
        const std::vector<Index> ids{pool.add(), pool.add()};
        const auto bf16_keys = [=](Index n, std::uint64_t seed) {
            return Matrix<Eigen::bfloat16>(delta_keys(n, d, seed).cast<Eigen::bfloat16>());
        };
        for (int threads = 1; threads <= 2; ++threads)
            verify_and_accept(pool, alone, ids, {{-1, 0, 0, 1, 3}, {-1, -1, 1}}, {{0, 2}, {1, 2}}, d, dv, bf16_keys,
                              860 + static_cast<std::uint64_t>(threads), threads);
    }
}


// ---- FpMath::bf16 in the pool: bfloat16 products over bfloat16 and FP8 blocks ----------

TEMPLATE_TEST_CASE("PagedKVCache with FpMath::bf16: a decode step is a KVCache's grouped attend with the option, a "
                   "prompt or a tree the multi-head kernel's with it, bit for bit on any thread count",
                   "[serving][batched][bf16]", Eigen::bfloat16, Fp8E4M3, Fp8E5M2) {
    using S = TestType;
    using E = Eigen::bfloat16;
    const SoftmaxOptions bf16{.fpmath = FpMath::bf16};
    // Decode over blocks of 128 tokens (GroupAttention's blocks, so a cache's bits); a head
    // of 300 is past fold_bf16's depth: the pool rounds the queries itself, as the cache.
    for (const Index d : {24, 300}) {
        INFO(detail::storage_name<S> << ", d = " << d);
        const HeadLayout layout{4, 2, d, 0};
        PagedKVCache<float, S> pool(layout, 8, 128, bf16), strict(layout, 8, 128);
        CHECK(pool.options().fpmath == FpMath::bf16);
        CHECK(strict.options().fpmath == FpMath::strict);
        const Matrix<float> K = random_matrix<float>(300, 2 * d, 61), V = random_matrix<float>(300, 2 * d, 62);
        const Index seq = pool.add_sequence(), plain = strict.add_sequence();
        pool.extend(seq, K, V);
        strict.extend(plain, K, V);
        const Matrix<float> q = random_matrix<float>(1, 4 * d, 63, 2.0);
        Matrix<float> o(1, 4 * d), unrounded(1, 4 * d);
        pool.attend(seq, q.row(0), o.row(0));
        strict.attend(plain, q.row(0), unrounded.row(0));
        CHECK((o.array() != unrounded.array()).any());  // the option acts
        for (Index kv = 0; kv < 2; ++kv) {
            KVCache<float, S> cache(d, d, bf16);
            memattn::extend(cache, Matrix<float>(K.middleCols(kv * d, d)), Matrix<float>(V.middleCols(kv * d, d)));
            const Matrix<float> group = Eigen::Map<const Matrix<float>>(q.data() + kv * 2 * d, 2, d);
            Matrix<float> expected(2, d);
            cache.attend_group(group, expected);
            const Matrix<float> got = Eigen::Map<const Matrix<float>>(o.data() + kv * 2 * d, 2, d);
            CHECK((got.array() == expected.array()).all());
        }
    }
    // A batch of forks of one prompt (their shared blocks read together: serving/cascade.hpp)
    // and two sequences of their own; with a window, sinks and the logit options too. The
    // same bits on 1–3 threads; each row near the double reference on its rounded query
    // (the weights' rounding, docs/design.md §4.7c).
    const HeadLayout layout{8, 2, 16, 0};
    const std::vector<double> slopes{0.5, 0.25, 0.125, 0.0625, 0.03, 0.02, 0.01, 0.005},
        sink_logits{0.3, -1.0, 2.0, 0.0, 0.5, 1.0, -0.5, 0.25};
    const Matrix<float> K0 = random_matrix<float>(130, 32, 64), V0 = random_matrix<float>(130, 32, 65);
    const Matrix<float> Qb = random_matrix<float>(5, 128, 66, 2.0), Kb = random_matrix<float>(5, 32, 67),
                        Vb = random_matrix<float>(5, 32, 68);
    for (const bool logits : {false, true}) {
        SoftmaxOptions options = bf16;
        if (logits) {
            options.window = 40;
            options.sink_tokens = 3;
            options.softcap = 3.0;
            options.alibi_slopes = slopes;
            options.sink_logits = sink_logits;
        }
        const std::vector<Index> cached{100, 100, 100, 7, 130};
        std::optional<Matrix<float>> first;
        for (const int threads : {1, 2, 3}) {
            INFO(detail::storage_name<S> << (logits ? ", window and logit options" : "") << ", " << threads
                                         << " threads");
            PagedKVCache<float, S> pool(layout, 64, 16, options, PoolOptions{.rollback_tokens = 4});
            std::vector<Index> seqs{pool.add_sequence()};
            pool.extend(seqs[0], K0.topRows(100), V0.topRows(100));
            seqs.push_back(pool.fork(seqs[0]));
            seqs.push_back(pool.fork(seqs[0]));
            for (const Index n : {7, 130}) {
                seqs.push_back(pool.add_sequence());
                pool.extend(seqs.back(), K0.topRows(n), V0.topRows(n));
            }
            Matrix<float> O(5, 128);
            batched_decode(pool, seqs, Qb, Kb, Vb, O, OpenMPExecutor{.threads = threads});
            if (first) {
                CHECK((O.array() == first->array()).all());
                continue;
            }
            first = O;
            for (Index r = 0; r < 5; ++r) {
                const Index n = cached[static_cast<std::size_t>(r)];
                Matrix<float> Ks(n + 1, 32), Vs(n + 1, 32);
                Ks << K0.topRows(n), Kb.row(r);
                Vs << V0.topRows(n), Vb.row(r);
                const MatrixD Kd = stored_heads<float, S>(Ks, 2).template cast<double>(),
                              Vd = stored_heads<float, S>(Vs, 2).template cast<double>();
                const MatrixD q = Qb.row(r).template cast<E>().template cast<double>();
                for (Index h = 0; h < 8; ++h) {
                    reference::Logits rule{.window = options.window, .sink_tokens = options.sink_tokens,
                                           .softcap = options.softcap};
                    if (logits) {
                        rule.slope = slopes[static_cast<std::size_t>(h)];
                        rule.sink = sink_logits[static_cast<std::size_t>(h)];
                    }
                    const MatrixD exact = reference::softmax_attention(q.middleCols(h * 16, 16),
                                                                       Kd.middleCols(h / 4 * 16, 16),
                                                                       Vd.middleCols(h / 4 * 16, 16), rule)
                                              .out;
                    INFO("row " << r << ", head " << h);
                    check_close(O.row(r).middleCols(h * 16, 16), exact, 1e-2);
                }
            }
        }
    }
    // Prompts off every tile and block, after cached prefixes, with windows and the logit
    // options, and a tree of drafts: the multi-head kernel with FpMath::bf16 on the pairs
    // as stored, bit for bit (it rounds the queries as the pool does, and the stored
    // values are bfloat16 ones already).
    const HeadLayout wide{4, 2, 16, 12};  // g = 2, dv ≠ d
    struct Case {
        Index block, window, sinks;
        bool logits, tree;
    };
    for (const Case c : {Case{16, 0, 0, false, false}, Case{1, 0, 0, true, false}, Case{7, 0, 0, false, true},
                         Case{128, 0, 0, true, false}, Case{16, 40, 3, true, false}, Case{5, 1000, 2, false, false}}) {
        SoftmaxOptions options = bf16;
        options.window = c.window;
        options.sink_tokens = c.sinks;
        if (c.logits) {
            options.softcap = 3.0;
            options.alibi_slopes = std::span<const double>(slopes).first(4);
            options.sink_logits = std::span<const double>(sink_logits).first(4);
        }
        const std::vector<Index> cached_counts = memattn::test::memory_only ? std::vector<Index>{3 * c.block + 2}
                                                                            : std::vector<Index>{0, 1, 3 * c.block + 2};
        for (const Index cached : cached_counts) {
            for (const Index rows : memattn::test::memory_only ? std::vector<Index>{47} : std::vector<Index>{2, 47, 145}) {
                INFO(detail::storage_name<S> << ": block " << c.block << ", window " << c.window << ", sinks "
                                             << c.sinks << (c.logits ? ", logit options" : "")
                                             << (c.tree ? ", a tree" : "") << "; " << cached << " cached, " << rows
                                             << " rows");
                const Index n = cached + rows;
                const auto seed = static_cast<std::uint64_t>(2000 * c.block + 10 * cached + rows);
                const Matrix<float> K = random_matrix<float>(n, 32, seed), V = random_matrix<float>(n, 24, seed + 1),
                                    Q = random_matrix<float>(rows, 64, seed + 2, 2.0);
                const std::vector<Index> parents = c.tree ? tree_parents(rows, 9) : std::vector<Index>{};
                SoftmaxOptions kernel = options;
                kernel.parents = parents;
                const Matrix<float> Ks = stored_heads<float, S>(K, 2), Vs = stored_heads<float, S>(V, 2);
                const Matrix<float> expected = layer_rows(wide, Q, Ks, Vs, kernel);
                kernel.fpmath = FpMath::strict;
                if (!c.tree || cached > 0)  // (two roots see themselves alone: their values exactly)
                    CHECK((expected.array() != layer_rows(wide, Q, Ks, Vs, kernel).array()).any());  // the option acts
                for (const int threads : {1, 2}) {
                    PagedKVCache<float, S> pool(wide, n / c.block + 4, c.block, options,
                                                PoolOptions{.rollback_tokens = c.window > 0 ? rows : 0});
                    const Index a = pool.add_sequence();
                    pool.extend(a, K.topRows(cached), V.topRows(cached));
                    Matrix<float> O(rows, 48);
                    const std::vector<Index> seqs{a}, offsets{0, rows};
                    const OpenMPExecutor executor{.threads = threads};
                    if (c.tree)
                        pool.prefill(seqs, offsets, Q, K.bottomRows(rows), V.bottomRows(rows), O, executor, parents);
                    else
                        pool.prefill(seqs, offsets, Q, K.bottomRows(rows), V.bottomRows(rows), O, executor);
                    CHECK((O.array() == expected.array()).all());
                }
            }
        }
    }
    // The query heads of a KV head share the pairs of their value tiles within one walk
    // (serving/paged_prefill.hpp, PackedValueTiles), never across chunks or calls: two
    // sequences of the same length and chunk shape in one call, then one of them in a call
    // whose first chunk has the other's shape, each bit for bit its own pool's. One KV
    // head, so consecutive chunks' walks differ only in their chunk.
    {
        const HeadLayout one{4, 1, 16, 12};
        const Index cached = 300, rows = 47;
        PagedKVCache<float, S> shared(one, 16, 128, bf16);
        const Index a = shared.add_sequence(), b = shared.add_sequence();
        std::vector<PagedKVCache<float, S>> alone;
        std::vector<Index> own;
        std::vector<Matrix<float>> Ks, Vs;
        for (int i = 0; i < 2; ++i) {
            Ks.push_back(random_matrix<float>(cached + 2 * rows, 16, 70 + static_cast<std::uint64_t>(i)));
            Vs.push_back(random_matrix<float>(cached + 2 * rows, 12, 80 + static_cast<std::uint64_t>(i)));
            alone.emplace_back(one, 16, 128, bf16);
            own.push_back(alone.back().add_sequence());
            alone.back().extend(own.back(), Ks.back().topRows(cached), Vs.back().topRows(cached));
        }
        shared.extend(a, Ks[0].topRows(cached), Vs[0].topRows(cached));
        shared.extend(b, Ks[1].topRows(cached), Vs[1].topRows(cached));
        const Matrix<float> Q = random_matrix<float>(2 * rows, 64, 90, 2.0);
        const auto rows_of = [&](const Matrix<float>& m, Index call) {
            return Matrix<float>(m.middleRows(cached + call * rows, rows));
        };
        Matrix<float> both(2 * rows, 48);
        Matrix<float> QQ(2 * rows, 64), KK(2 * rows, 16), VV(2 * rows, 12);
        QQ << Q.topRows(rows), Q.topRows(rows);  // the same queries: only the values differ
        KK << rows_of(Ks[0], 0), rows_of(Ks[1], 0);
        VV << rows_of(Vs[0], 0), rows_of(Vs[1], 0);
        const std::vector<Index> pair{a, b}, pair_offsets{0, rows, 2 * rows};
        const OpenMPExecutor executor{.threads = 1};
        shared.prefill(pair, pair_offsets, QQ, KK, VV, both, executor);
        const std::vector<Index> one_offsets{0, rows};
        for (std::size_t i = 0; i < 2; ++i) {
            Matrix<float> expected(rows, 48);
            const std::vector<Index> seq{own[i]};
            alone[i].prefill(seq, one_offsets, Q.topRows(rows), rows_of(Ks[i], 0), rows_of(Vs[i], 0), expected,
                             executor);
            CHECK((both.middleRows(static_cast<Index>(i) * rows, rows).array() == expected.array()).all());
        }
        CHECK((both.topRows(rows).array() != both.bottomRows(rows).array()).any());  // the values differ
        Matrix<float> next(rows, 48), expected(rows, 48);
        const std::vector<Index> second{b}, second_own{own[1]};
        shared.prefill(second, one_offsets, Q.bottomRows(rows), rows_of(Ks[1], 1), rows_of(Vs[1], 1), next,
                       executor);
        alone[1].prefill(second_own, one_offsets, Q.bottomRows(rows), rows_of(Ks[1], 1), rows_of(Vs[1], 1),
                         expected, executor);
        CHECK((next.array() == expected.array()).all());
    }
    // A model cache's layers take it from their options: a prompt, then a decode step, in
    // a layer with it and one without, each bit for bit its own pool's.
    {
        const std::vector<ModelLayer> specs{{.layout = wide, .blocks = 20, .block_size = 16, .options = bf16},
                                            {.layout = wide, .blocks = 20, .block_size = 16}};
        ModelCache<float, S> cache(specs);
        std::vector<PagedKVCache<float, S>> pools;
        for (const ModelLayer& l : specs)
            pools.emplace_back(l.layout, l.blocks, l.block_size, l.options);
        const Index a = cache.add_sequence();
        for (auto& p : pools)
            CHECK(p.add_sequence() == cache.slot_of(a));
        for (const Index rows : {Index{50}, Index{1}}) {
            const std::vector<Index> ids{a}, offsets{0, rows};
            const auto& step = cache.plan(ids, offsets);
            for (Index l = 0; l < 2; ++l) {
                INFO(detail::storage_name<S> << ": layer " << l << ", " << rows << " rows");
                const auto seed = static_cast<std::uint64_t>(400 + 10 * l + rows);
                const Matrix<float> Q = random_matrix<float>(rows, 64, seed), K = random_matrix<float>(rows, 32, seed + 1),
                                    V = random_matrix<float>(rows, 24, seed + 2);
                Matrix<float> O(rows, 48), expected(rows, 48);
                cache.prefill(l, step, Q, K, V, O);
                batched_prefill(pools[static_cast<std::size_t>(l)], step.slots(), step.q_offsets(), Q, K, V, expected);
                CHECK((O.array() == expected.array()).all());
            }
        }
    }
    // Other rows and scalars refuse it, by name.
    CHECK_THROWS_WITH((PagedKVCache<float, Q8>(wide, 4, 16, bf16)),
                      Catch::Contains("options.fpmath") && Catch::Contains("Q8"));
    CHECK_THROWS_WITH((PagedKVCache<float, PerTokenScale<Fp8E4M3>>(wide, 4, 16, bf16)),
                      Catch::Contains("options.fpmath"));
    CHECK_THROWS_WITH((PagedKVCache<double, S>(wide, 4, 16, bf16)), Catch::Contains("options.fpmath"));
}

namespace {

/// The system's transparent huge page mode ("always", "madvise", "never"), or "" where
/// there is none to read.
std::string huge_page_mode() {
    std::ifstream file("/sys/kernel/mm/transparent_hugepage/enabled");
    std::string line;
    std::getline(file, line);
    const auto open = line.find('['), close = line.find(']');
    return open == std::string::npos || close == std::string::npos ? "" : line.substr(open + 1, close - open - 1);
}

/// This process's anonymous memory in transparent huge pages, in kB (smaps_rollup).
long anon_huge_kb() {
    std::ifstream file("/proc/self/smaps_rollup");
    std::string key;
    long kb = 0;
    while (file >> key) {
        if (key == "AnonHugePages:") {
            file >> kb;
            return kb;
        }
        file.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
    }
    return -1;
}

}  // namespace

TEST_CASE("Huge pages: the whole 2 MiB pages of a range; a pool's stores get them where Linux grants them",
          "[serving][huge_pages]") {
    // The range: whole pages only, none for a short or overflowing range.
    constexpr std::uintptr_t page = detail::huge_page_bytes;
    const auto at = [](std::uintptr_t a) { return reinterpret_cast<const void*>(a); };
    const detail::HugePageRange inside = detail::huge_page_range(at(5 * page + 8), 3 * page);
    CHECK(inside.first == 6 * page);
    CHECK(inside.end == 8 * page);
    const detail::HugePageRange exact = detail::huge_page_range(at(4 * page), 2 * page);
    CHECK((exact.first == 4 * page && exact.end == 6 * page));
    CHECK(detail::huge_page_range(at(4 * page + 1), 2 * page - 2).first == 0);  // no whole page
    CHECK(detail::huge_page_range(at(4 * page), page - 1).end == 0);
    CHECK(detail::huge_page_range(nullptr, 4 * page).end == 0);
    CHECK(detail::huge_page_range(at(UINTPTR_MAX - page), 3 * page).end == 0);
    // The pool: 8 MiB of bfloat16 keys and as many values, written by one long sequence.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    WARN("under a sanitizer the allocator is the sanitizer's: the pool's pages are not checked");
#else
    const std::string mode = huge_page_mode();
    if (test::memory_only || mode.empty() || mode == "never" || !detail::huge_pages_allowed() || anon_huge_kb() < 0) {
        WARN("no transparent huge pages to check here (mode '" << mode << "')");
        return;
    }
    const Index tokens = 32768;
    const Matrix<float> keys = random_matrix<float>(tokens, 128, 91), values = random_matrix<float>(tokens, 128, 92);
    const long before = anon_huge_kb();
    PagedKVCache<float, Eigen::bfloat16> pool(HeadLayout{1, 1, 128, 0}, tokens / 128, 128);
    pool.extend(pool.add_sequence(), keys, values);
    INFO("mode " << mode << ", AnonHugePages " << before << " -> " << anon_huge_kb() << " kB");
    CHECK(anon_huge_kb() - before >= 2 * 2048);  // at least one whole page in each store
#endif
}
