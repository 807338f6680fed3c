#include "support.hpp"

#include <memattn/layer/multi_head_memory.hpp>
#include <memattn/memory/kv_cache.hpp>
#include <memattn/memory/sliding_window_cache.hpp>
#include <memattn/memory/sparse_kv_cache.hpp>
#include <memattn/persistence/snapshot.hpp>

#include <algorithm>
#include <limits>
#include <set>
#include <sstream>
#include <vector>

using namespace memattn;
using memattn::test::check_close;
using memattn::test::random_matrix;
using memattn::test::tolerance;

namespace {

/// The stored keys of a sparse cache's pairs as double (as its attends read them).
template <class T, class S>
reference::MatrixD sparse_stored_keys(const SparseKVCache<T, S>& cache) {
    reference::MatrixD keys(cache.length(), cache.key_dim());
    cache.pairs().for_each_stored_run([&](const auto& k, const auto&, Index first, Index n) {
        for (Index r = 0; r < n; ++r)
            for (Index c = 0; c < keys.cols(); ++c)
                keys(r, c) = static_cast<double>(k.stored_value(first + r, c));
    });
    return keys;
}

/// The bound of each block, in double from the formula: Σ_i max(u_i·hi_i, u_i·lo_i),
/// u = scale·q, the group's largest (no rounding slack).
reference::MatrixD sparse_naive_bounds(const reference::MatrixD& keys, const reference::MatrixD& queries,
                                       double scale, Index block) {
    const Index blocks = (keys.rows() + block - 1) / block, d = keys.cols();
    reference::MatrixD bounds = reference::MatrixD::Constant(1, blocks, -std::numeric_limits<double>::infinity());
    for (Index b = 0; b < blocks; ++b) {
        const Index first = b * block, n = std::min(block, keys.rows() - first);
        const reference::RowD hi = keys.middleRows(first, n).colwise().maxCoeff();
        const reference::RowD lo = keys.middleRows(first, n).colwise().minCoeff();
        for (Index r = 0; r < queries.rows(); ++r) {
            double sum = 0;
            for (Index c = 0; c < d; ++c)
                sum += std::max(scale * queries(r, c) * hi(c), scale * queries(r, c) * lo(c));
            bounds(0, b) = std::max(bounds(0, b), sum);
        }
    }
    return bounds;
}

/// The tokens an attend of the newest token reads: the sinks, the window and the chosen blocks.
std::vector<Index> sparse_read_tokens(Index n, const SparseKVOptions& o, const std::vector<Index>& blocks) {
    std::set<Index> tokens;
    for (Index j = 0; j < std::min(o.sinks, n); ++j)
        tokens.insert(j);
    for (Index j = std::max<Index>(0, n - o.window); j < n; ++j)
        tokens.insert(j);
    for (const Index b : blocks)
        for (Index j = b * o.block; j < std::min(n, (b + 1) * o.block); ++j)
            tokens.insert(j);
    return {tokens.begin(), tokens.end()};
}

/// Softmax attention of one query (double) over the given tokens of K/V.
reference::RowD sparse_reference_attend(const reference::RowD& q, const reference::MatrixD& K,
                                        const reference::MatrixD& V, const std::vector<Index>& tokens, double scale) {
    reference::RowD out = reference::RowD::Zero(V.cols());
    if (tokens.empty())
        return out;
    double top = -std::numeric_limits<double>::infinity();
    std::vector<double> s;
    for (const Index j : tokens) {
        s.push_back(scale * q.dot(K.row(j)));
        top = std::max(top, s.back());
    }
    double sum = 0;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
        const double p = std::exp(s[i] - top);
        sum += p;
        out += p * V.row(tokens[i]);
    }
    return out / sum;
}

}  // namespace

TEMPLATE_TEST_CASE("SparseKVCache: top_k covering every block is KVCache, bitwise", "[memory][sparse]", float,
                   double) {
    using T = TestType;
    const Index n = GENERATE(0, 1, 2, 17, 300);
    const Index d = GENERATE(1, 5, 64);
    const Index dv = 3;
    const Matrix<T> Q = random_matrix<T>(n, d, 31), K = random_matrix<T>(n, d, 32), V = random_matrix<T>(n, dv, 33);
    SparseKVCache<T> sparse(d, dv, {.block = 16, .top_k_blocks = 1000, .window = 8, .sinks = 2});
    KVCache<T> full(d, dv);
    Matrix<T> O(n, dv), expected(n, dv);
    decode(sparse, Q, K, V, O);
    decode(full, Q, K, V, expected);
    CHECK(O == expected);
    CHECK(sparse.length() == n);
    // The bounds of a block: [hi | lo], bfloat16 for float where rows convert in
    // registers, and its peak in T.
    const std::size_t bound_bytes = std::is_same_v<T, float> && detail::fused_storage ? 2 : sizeof(T);
    CHECK(sparse.footprint() ==
          full.footprint() + static_cast<std::size_t>((n + 15) / 16) * (2 * static_cast<std::size_t>(d) * bound_bytes + sizeof(T)));
    check_close(O, reference::softmax_attention(reference::to_double(Q), reference::to_double(K),
                                                reference::to_double(V))
                       .out,
                tolerance<T>());
    const Matrix<T> G = random_matrix<T>(4, d, 34);
    Matrix<T> group(4, dv), group_full(4, dv);
    sparse.attend_group(G, group);
    full.attend_group(G, group_full);
    CHECK(group == group_full);
}

TEMPLATE_TEST_CASE("SparseKVCache attends the sinks, the window and the chosen blocks exactly", "[memory][sparse]",
                   float, double) {
    using T = TestType;
#if defined(MEMATTN_TEST_MEMORY_ONLY)  // -O0 under ASan: the same paths, shorter
    const Index n = GENERATE(1, 40, 150);
#else
    const Index n = GENERATE(1, 40, 333, 1000);
#endif
    const Index d = GENERATE(1, 8, 67);
    const Index block = GENERATE(1, 7, 16);
    const SparseKVOptions o{.block = block, .top_k_blocks = 3, .window = 5, .sinks = 2};
    const Index dv = 6;
    const Matrix<T> Q = random_matrix<T>(n, d, 41, 2.0), K = random_matrix<T>(n, d, 42),
                    V = random_matrix<T>(n, dv, 43);
    SparseKVCache<T> cache(d, dv, o);
    Matrix<T> O(n, dv);
    decode(cache, Q, K, V, O);
    // Row i read what a cache of its first i + 1 tokens chooses: replay, comparing the
    // choice with a brute-force top-k of the bounds in double.
    SparseKVCache<T> replay(d, dv, o);
    const reference::MatrixD Kd = reference::to_double(K), Vd = reference::to_double(V);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    for (Index i = 0; i < n; ++i) {
        replay.update(K.row(i), V.row(i));
        const Matrix<T> q = Q.row(i);
        const std::vector<Index> chosen = replay.chosen_blocks(q);
        // The candidates: blocks holding a token neither a sink nor in the window.
        const Index begin = std::min(o.sinks, i + 1), end = std::max(begin, i + 1 - std::min(o.window, i + 1));
        std::vector<Index> candidates;
        for (Index b = 0; b * block < end; ++b)
            if ((b + 1) * block > begin && begin < end)
                candidates.push_back(b);
        if (static_cast<Index>(candidates.size()) <= o.top_k_blocks) {
            CHECK(chosen == candidates);
        } else {
            REQUIRE(static_cast<Index>(chosen.size()) == o.top_k_blocks);
            const reference::MatrixD bounds =
                sparse_naive_bounds(Kd.topRows(i + 1), reference::to_double(q), scale, block);
            // No skipped candidate has a bound above a chosen one's, beyond rounding.
            double lowest_chosen = std::numeric_limits<double>::infinity();
            for (const Index b : chosen) {
                CHECK(std::find(candidates.begin(), candidates.end(), b) != candidates.end());
                lowest_chosen = std::min(lowest_chosen, bounds(0, b));
            }
            // Beyond rounding: of the sums in T, and for float of the bounds' storage in
            // bfloat16 (hi up and lo down by at most 2^-8 of themselves).
            const double rounding = (sizeof(T) == 4 ? 0x1p-7 : 1e-12) * scale *
                                    reference::to_double(q).cwiseAbs().sum() * Kd.topRows(i + 1).cwiseAbs().maxCoeff();
            for (const Index b : candidates)
                if (std::find(chosen.begin(), chosen.end(), b) == chosen.end())
                    CHECK(bounds(0, b) <= lowest_chosen + rounding);
        }
        const auto tokens = sparse_read_tokens(i + 1, o, chosen);
        const reference::RowD expected = sparse_reference_attend(reference::to_double(q), Kd, Vd, tokens, scale);
        check_close(O.row(i), expected, tolerance<T>());
    }
}

TEST_CASE("SparseKVCache with softcap, ALiBi, a sink logit and RoPE attends its chosen pairs at their positions",
          "[memory][sparse][options]") {
    const Index n = 260, d = 16, dv = 3;
    const bool with_rope = GENERATE(false, true);
    const SparseKVOptions o{.block = 8, .top_k_blocks = 4, .window = 6, .sinks = 3};
    const std::vector<double> slope{0.05}, sink{0.7};
    const SoftmaxOptions options{.softcap = 5, .sink_logits = sink, .alibi_slopes = slope};
    const Rope rope{.head_dim = d};
    const Matrix<double> Q = random_matrix<double>(n, d, 101, 3.0), K = random_matrix<double>(n, d, 102),
                         V = random_matrix<double>(n, dv, 103);
    SparseKVCache<double> cache = with_rope ? SparseKVCache<double>(d, dv, o, options, rope)
                                            : SparseKVCache<double>(d, dv, o, options);
    // The reference reads turned queries and keys: each key at its position, the query
    // at the newest token's.
    reference::MatrixD Kt = K;
    if (with_rope) {
        std::vector<Index> positions(static_cast<std::size_t>(n));
        for (Index j = 0; j < n; ++j)
            positions[static_cast<std::size_t>(j)] = j;
        rope.apply(Kt, positions);
    }
    Vector<double> out(dv);
    for (Index i = 0; i < n; ++i) {
        cache.update(K.row(i), V.row(i));
        cache.attend(Q.row(i), out);
        const std::vector<Index> chosen = cache.chosen_blocks(Q.row(i));
        const auto tokens = sparse_read_tokens(i + 1, o, chosen);
        reference::MatrixD q = Q.row(i);
        if (with_rope)
            rope.apply(q, std::vector<Index>{i});
        reference::MatrixD mask = reference::MatrixD::Constant(1, i + 1, -std::numeric_limits<double>::infinity());
        for (const Index j : tokens)
            mask(0, j) = 0;
        const reference::Logits logits{.softcap = 5, .slope = 0.05, .sink = 0.7, .bias = &mask};
        const auto expected = reference::softmax_attention(q, Kt.topRows(i + 1), V.topRows(i + 1), logits);
        CAPTURE(i, with_rope);
        check_close(out, expected.out, tolerance<double>());
    }
    // When it reads everything, it is the KV cache with the same options, bitwise.
    KVCache<double> full = with_rope ? KVCache<double>(d, dv, options, rope) : KVCache<double>(d, dv, options);
    SparseKVCache<double> wide = with_rope ? SparseKVCache<double>(d, dv, {.top_k_blocks = 100}, options, rope)
                                           : SparseKVCache<double>(d, dv, {.top_k_blocks = 100}, options);
    Matrix<double> O(n, dv), expected(n, dv);
    decode(full, Q, K, V, expected);
    decode(wide, Q, K, V, O);
    CHECK(O == expected);
}

TEST_CASE("SparseKVCache: no logit exceeds its block's bound, on random and adversarial keys", "[memory][sparse]") {
    const Index d = GENERATE(1, 3, 64), block = GENERATE(1, 5, 16), n = 400;
    const int kind = GENERATE(0, 1, 2);
    Matrix<float> K = random_matrix<float>(n, d, 51);
    if (kind == 1) {  // magnitudes from 1e-30 to 1e30, a few huge keys in blocks of small ones
        for (Index j = 0; j < n; ++j)
            K.row(j) *= std::pow(10.0f, static_cast<float>((j * 7) % 61 - 30));
    } else if (kind == 2) {  // nearly equal keys: the box is thin, the bound must still hold
        const Matrix<float> base = random_matrix<float>(1, d, 52);
        for (Index j = 0; j < n; ++j)
            K.row(j) = base + 1e-7f * random_matrix<float>(1, d, 53 + static_cast<std::uint64_t>(j));
    }
    const Matrix<float> V = random_matrix<float>(n, 2, 54);
    SparseKVCache<float, Eigen::bfloat16> rounded(d, 2, {.block = block, .top_k_blocks = 2, .window = 3, .sinks = 1});
    SparseKVCache<float> exact(d, 2, {.block = block, .top_k_blocks = 2, .window = 3, .sinks = 1});
    rounded.extend(K, V);
    for (Index j = 0; j < n; ++j)
        exact.update(K.row(j), V.row(j));
    const Matrix<float> queries = random_matrix<float>(3, d, 55, 3.0);
    for (const bool compact : {false, true}) {
        const reference::MatrixD keys = compact ? sparse_stored_keys(rounded) : sparse_stored_keys(exact);
        const Vector<float> bounds = compact ? rounded.block_bounds(queries) : exact.block_bounds(queries);
        const std::vector<Index> chosen = compact ? rounded.chosen_blocks(queries) : exact.chosen_blocks(queries);
        const double scale = 1.0 / std::sqrt(static_cast<double>(d));
        double lowest_chosen = std::numeric_limits<double>::infinity();
        for (const Index b : chosen)
            lowest_chosen = std::min(lowest_chosen, static_cast<double>(bounds[b]));
        for (Index b = 0; b * block < n; ++b) {
            double top = -std::numeric_limits<double>::infinity();
            for (Index j = b * block; j < std::min(n, (b + 1) * block); ++j)
                for (Index r = 0; r < queries.rows(); ++r)
                    top = std::max(top, scale * reference::to_double(queries).row(r).dot(keys.row(j)));
            CAPTURE(compact, kind, d, block, b);
            CHECK(top <= static_cast<double>(bounds[b]));
            // A block skipped (not chosen, not the first or the last few tokens) had no
            // logit above the lowest chosen block's bound.
            const bool candidate = (b + 1) * block > 1 && b * block < n - 3;
            if (candidate && std::find(chosen.begin(), chosen.end(), b) == chosen.end())
                CHECK(top <= lowest_chosen);
        }
    }
}

TEMPLATE_TEST_CASE("SparseKVCache with top_k 0 is a sliding window with sinks", "[memory][sparse]", float, double) {
    using T = TestType;
    const Index n = 300, d = 16, dv = 4, window = GENERATE(1, 9, 64, 400), sinks = GENERATE(0, 3);
    const Matrix<T> Q = random_matrix<T>(n, d, 61), K = random_matrix<T>(n, d, 62), V = random_matrix<T>(n, dv, 63);
    SparseKVCache<T> sparse(d, dv, {.block = 8, .top_k_blocks = 0, .window = window, .sinks = sinks});
    SlidingWindowCache<T> ring(d, dv, window, sinks);
    Matrix<T> O(n, dv), expected(n, dv);
    decode(sparse, Q, K, V, O);
    decode(ring, Q, K, V, expected);
    check_close(O, reference::to_double(expected), tolerance<T>());
}

TEST_CASE("SparseKVCache: a group chooses together, and a layer of them decodes", "[memory][sparse][multi_head]") {
    const Index n = 500, d = 32, dv = 8, g = 4;
    const SparseKVOptions o{.block = 16, .top_k_blocks = 4, .window = 16, .sinks = 4};
    const Matrix<float> K = random_matrix<float>(n, d, 71), V = random_matrix<float>(n, dv, 72),
                        G = random_matrix<float>(g, d, 73, 4.0);
    SparseKVCache<float> cache(d, dv, o);
    cache.extend(K, V);
    Matrix<float> out(g, dv);
    cache.attend_group(G, out);
    const std::vector<Index> chosen = cache.chosen_blocks(G);
    REQUIRE(static_cast<Index>(chosen.size()) == o.top_k_blocks);
    const auto tokens = sparse_read_tokens(n, o, chosen);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    for (Index r = 0; r < g; ++r)
        check_close(out.row(r),
                    sparse_reference_attend(reference::to_double(G.row(r)), reference::to_double(K),
                                            reference::to_double(V), tokens, scale),
                    tolerance<float>());

    // Two KV heads of four query heads each: each head's group is its cache's attend_group.
    const HeadLayout layout{.q_heads = 8, .kv_heads = 2, .head_dim = d, .value_dim = dv};
    MultiHead<SparseKVCache<float>> layer(layout, [&](Index) { return SparseKVCache<float>(d, dv, o); });
    const Matrix<float> KL = random_matrix<float>(n, 2 * d, 74), VL = random_matrix<float>(n, 2 * dv, 75),
                        QL = random_matrix<float>(n, 8 * d, 76);
    Matrix<float> OL(n, 8 * dv);
    decode(layer, QL, KL, VL, OL);
    SparseKVCache<float> h0(d, dv, o), h1(d, dv, o);
    h0.extend(KL.leftCols(d), VL.leftCols(dv));
    h1.extend(KL.rightCols(d), VL.rightCols(dv));
    Matrix<float> last(8, dv);
    const Eigen::Map<const Matrix<float>> qs(QL.row(n - 1).data(), 8, d);
    auto top = last.topRows(4);
    auto bottom = last.bottomRows(4);
    h0.attend_group(qs.topRows(4), top);
    h1.attend_group(qs.bottomRows(4), bottom);
    const Eigen::Map<const Matrix<float>> layer_last(OL.row(n - 1).data(), 8, dv);
    CHECK(layer_last == last);
}

TEMPLATE_TEST_CASE("SparseKVCache: snapshots, truncate and the compact storage types", "[memory][sparse]", float,
                   Eigen::bfloat16) {
    using S = TestType;
    const Index n = 700, d = 24, dv = 5;
    const SparseKVOptions o{.block = 16, .top_k_blocks = 5, .window = 32, .sinks = 4};
    const Matrix<float> K = random_matrix<float>(n, d, 81), V = random_matrix<float>(n, dv, 82),
                        q = random_matrix<float>(3, d, 83, 3.0);
    SparseKVCache<float, S> cache(d, dv, o);
    cache.extend(K.topRows(n - 100), V.topRows(n - 100));
    for (Index j = n - 100; j < n; ++j)
        cache.update(K.row(j), V.row(j));
    Matrix<float> before(3, dv), after(3, dv);
    cache.attend_group(q, before);

    std::stringstream stream;
    save(cache, stream);
    SparseKVCache<float, S> loaded(d, dv, o);
    load(loaded, stream);
    CHECK(loaded.length() == n);
    CHECK(loaded.block_bounds(q) == cache.block_bounds(q));
    loaded.attend_group(q, after);
    CHECK(after == before);

    SparseKVCache<float, S> other(d, dv, {.block = 8, .top_k_blocks = 5, .window = 32, .sinks = 4});
    stream.clear();
    stream.seekg(0);
    CHECK_THROWS_AS(load(other, stream), SnapshotError);
    CHECK(other.length() == 0);

    // Cut back to 333 tokens (inside a block): the same as a cache fed only those.
    cache.truncate(333);
    SparseKVCache<float, S> prefix(d, dv, o);
    prefix.extend(K.topRows(333), V.topRows(333));
    CHECK(cache.block_bounds(q) == prefix.block_bounds(q));
    cache.attend_group(q, before);
    prefix.attend_group(q, after);
    CHECK(after == before);
}

TEMPLATE_TEST_CASE("SparseKVCache over rotated and integer-dot storage: bounds of the keys as stored",
                   "[memory][sparse][compact]", Rotated<Q4>, IntegerDot<Q8>, Q4Affine) {
    using S = TestType;
    const Index n = 500, d = 32, dv = 4;
    const SparseKVOptions o{.block = 8, .top_k_blocks = 4, .window = 8, .sinks = 2};
    const Matrix<float> K = random_matrix<float>(n, d, 111), V = random_matrix<float>(n, dv, 112),
                        Q = random_matrix<float>(n, d, 113, 3.0);
    // Every block chosen: the KV cache of the same storage, bitwise.
    SparseKVCache<float, S> wide(d, dv, {.block = 8, .top_k_blocks = 100, .window = 8, .sinks = 2});
    KVCache<float, S> full(d, dv);
    Matrix<float> O(n, dv), expected(n, dv);
    decode(wide, Q, K, V, O);
    decode(full, Q, K, V, expected);
    CHECK(O == expected);
    // Chosen blocks: no logit of a stored key (for the query as the attend turns it)
    // exceeds its block's bound.
    SparseKVCache<float, S> cache(d, dv, o);
    cache.extend(K, V);
    const Matrix<float> q = Q.bottomRows(2);
    const Vector<float> bounds = cache.block_bounds(q);
    Matrix<float> turned = q;
    if (cache.pairs().turns_queries())
        for (Index r = 0; r < turned.rows(); ++r)
            cache.pairs().turn_query(turned.row(r).data(), d, n - 1);
    const reference::MatrixD keys = sparse_stored_keys(cache);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    for (Index b = 0; b * o.block < n; ++b)
        for (Index j = b * o.block; j < std::min(n, (b + 1) * o.block); ++j)
            for (Index r = 0; r < q.rows(); ++r)
                CHECK(scale * reference::to_double(turned).row(r).dot(keys.row(j)) <= static_cast<double>(bounds[b]));
    Matrix<float> out(2, dv);
    cache.attend_group(q, out);
    CHECK(out.allFinite());
    CHECK(static_cast<Index>(cache.chosen_blocks(q).size()) == o.top_k_blocks);
}

TEST_CASE("SparseKVCache: bad input names the argument and changes nothing", "[memory][sparse][bad_input]") {
    CHECK_THROWS_WITH((SparseKVCache<float>(4, 4, {.block = 0})),
                      Catch::Matchers::Contains("SparseKVCache") && Catch::Matchers::Contains("sparse.block"));
    CHECK_THROWS_AS((SparseKVCache<float>(4, 4, {.top_k_blocks = -1})), std::invalid_argument);
    CHECK_THROWS_AS((SparseKVCache<float>(0, 4)), std::invalid_argument);
    SparseKVCache<float> cache(4, 3, {.block = 2, .top_k_blocks = 1, .window = 1, .sinks = 0});
    const Matrix<float> K = random_matrix<float>(9, 4, 91), V = random_matrix<float>(9, 3, 92);
    cache.extend(K, V);
    const Vector<float> q = random_matrix<float>(1, 4, 93);
    const Vector<float> bounds = cache.block_bounds(q);
    CHECK_THROWS_WITH(cache.update(K.row(0), V.row(0).head(2)), Catch::Matchers::Contains("SparseKVCache::update"));
    CHECK_THROWS_AS(cache.extend(K.leftCols(3), V), std::invalid_argument);
    Vector<float> out(2);
    CHECK_THROWS_WITH(cache.attend(q, out), Catch::Matchers::Contains("'out'"));
    CHECK_THROWS_AS(cache.truncate(10), std::invalid_argument);
    CHECK(cache.length() == 9);
    CHECK(cache.block_bounds(q) == bounds);
    SparseKVCache<float, Eigen::half> half(4, 3);
    Matrix<float> huge = K.topRows(1);
    huge(0, 2) = 1e6f;  // finite, but ±∞ as a half
    CHECK_THROWS_AS(half.update(huge.row(0), V.row(0)), std::invalid_argument);
    CHECK(half.length() == 0);
}

TEST_CASE("SparseKVCache of bfloat16 rows is its float cache's", "[memory][sparse][low_precision]") {
    const Index n = 200, d = 16, dv = 4;
    const SparseKVOptions o{.block = 8, .top_k_blocks = 3, .window = 8, .sinks = 2};
    const Matrix<float> K = random_matrix<float>(n, d, 95), V = random_matrix<float>(n, dv, 96),
                        Q = random_matrix<float>(n, d, 97, 3.0);
    const Matrix<Eigen::bfloat16> Kb = K.cast<Eigen::bfloat16>(), Vb = V.cast<Eigen::bfloat16>(),
                                  Qb = Q.cast<Eigen::bfloat16>();
    SparseKVCache<Eigen::bfloat16> rows(d, dv, o);
    SparseKVCache<float, Eigen::bfloat16> floats(d, dv, o);
    Matrix<Eigen::bfloat16> O(n, dv);
    Matrix<float> expected(n, dv);
    decode(rows, Qb, Kb, Vb, O);
    decode(floats, Matrix<float>(Qb.cast<float>()), Matrix<float>(Kb.cast<float>()), Matrix<float>(Vb.cast<float>()),
           expected);
    CHECK(O == expected.cast<Eigen::bfloat16>());
}
