// The memories of 16-bit rows (memory/detail/low_precision.hpp): each is its float memory
// behind converting members, so every output is the float memory's on the converted rows,
// rounded to the 16-bit type, bit for bit — decode step by step, prefill span by span,
// extend, snapshots — and KVCache<bfloat16> is within the rounding of its output of the
// double reference.

#include "support.hpp"

#include <memattn/layer/multi_head_memory.hpp>
#include <memattn/memory/gated_memories.hpp>
#include <memattn/memory/hybrid_cache.hpp>
#include <memattn/memory/kv_cache.hpp>
#include <memattn/memory/linear_attention_memory.hpp>
#include <memattn/memory/moving_average_cache.hpp>
#include <memattn/memory/sliding_window_cache.hpp>
#include <memattn/persistence/snapshot.hpp>

#include <sstream>
#include <string>

using namespace memattn;
using memattn::test::random_matrix;
using bf16 = Eigen::bfloat16;
using f16 = Eigen::half;

namespace {

/// Inputs of unit scale, exact in E (so the float twin sees the same numbers).
template <class E>
Matrix<float> exact_in(const Matrix<float>& m) {
    return m.cast<E>().template cast<float>();
}

/// The 16-bit memory M (made by `make`) against its float memory fed the same rows:
/// decode, prefill in the spans the 16-bit memory converts, extend, then a decode step
/// after each; every output the float one's rounded to E, bit for bit. Snapshots round-trip.
template <class Make>
void check_twin(Make make, const Matrix<float>& Q, const Matrix<float>& K, const Matrix<float>& V) {
    using M = std::invoke_result_t<Make&>;
    using E = typename M::Scalar;
    using F = typename M::FloatMemory;
    static_assert(Memory<M> && std::is_same_v<typename F::Scalar, float>);
    const Index n = K.rows(), span = M::span_rows;
    const Matrix<E> Qe = Q.cast<E>(), Ke = K.cast<E>(), Ve = V.cast<E>();
    REQUIRE(Qe.template cast<float>() == Q);  // the inputs are exact in E
    REQUIRE(Ke.template cast<float>() == K);
    const Index dv = V.cols(), od = detail::output_width<F>(make());
    Matrix<E> Oe(n, od);
    Matrix<float> Of(n, od);

    SECTION("decode, step by step") {
        M mem = make();
        F twin = make();
        for (Index i = 0; i < n; ++i) {
            mem.update(Ke.row(i), Ve.row(i));
            mem.attend(Qe.row(i), Oe.row(i));
            twin.update(K.row(i), V.row(i));
            twin.attend(Q.row(i), Of.row(i));
        }
        CHECK(Oe == Of.cast<E>());
        CHECK(mem.length() == twin.length());
        CHECK(mem.footprint() == twin.footprint());
        decode(mem, Qe.topRows(3), Ke.topRows(3), Ve.topRows(3), Oe.topRows(3));  // the generic loop
        decode(twin, Q.topRows(3), K.topRows(3), V.topRows(3), Of.topRows(3));
        CHECK(Oe.topRows(3) == Of.topRows(3).cast<E>());
    }
    SECTION("prefill, the float memory's prefill of each span, then a step") {
        M mem = make();
        F twin = make();
        memattn::prefill(mem, Qe, Ke, Ve, Oe);
        for (Index r0 = 0; r0 < n; r0 += span) {
            const Index m = std::min(span, n - r0);
            memattn::prefill(twin, Q.middleRows(r0, m), K.middleRows(r0, m), V.middleRows(r0, m),
                             Of.middleRows(r0, m));
        }
        CHECK(Oe == Of.cast<E>());
        Vector<E> a(od);
        Vector<float> b(od);
        mem.update(Ke.row(0), Ve.row(0));
        mem.attend(Qe.row(1), a);
        twin.update(K.row(0), V.row(0));
        twin.attend(Q.row(1), b);
        CHECK(a == b.cast<E>());
    }
    SECTION("extend, then a step; snapshots") {
        M mem = make();
        F twin = make();
        memattn::extend(mem, Ke, Ve);
        const Index step = detail::keeps_every_pair<F> ? span : M::step_rows;
        for (Index r0 = 0; r0 < n; r0 += step) {
            const Index m = std::min(step, n - r0);
            memattn::extend(twin, K.middleRows(r0, m), V.middleRows(r0, m));
        }
        Vector<E> a(od);
        Vector<float> b(od);
        mem.attend(Qe.row(2), a);
        twin.attend(Q.row(2), b);
        CHECK(a == b.cast<E>());
        CHECK(mem.length() == twin.length());
        // A snapshot says E and loads into the same type only, exactly.
        std::stringstream stream;
        save(mem, stream);
        M loaded = make();
        load(loaded, stream);
        Vector<E> c(od);
        loaded.attend(Qe.row(2), c);
        CHECK(c == a);
        std::stringstream again;
        save(mem, again);
        F wrong = make();
        try {
            load(wrong, again);
            FAIL("a 16-bit memory's snapshot loaded into its float memory");
        } catch (const SnapshotError& e) {
            CHECK_THAT(e.what(), Catch::Matchers::Contains("the scalar is"));
        }
    }
    (void)dv;
}

/// Log-gates in [-0.5, 0] and β in [0, 1], exact in E.
template <class E>
Matrix<float> gated_keys(const Matrix<float>& K, Index extra, std::uint64_t seed, bool beta) {
    Matrix<float> G = random_matrix<float>(K.rows(), extra, seed).cwiseAbs();
    if (!beta)
        G *= -0.5f;
    Matrix<float> keys(K.rows(), K.cols() + extra);
    keys << K, G;
    return exact_in<E>(keys);
}

}  // namespace

TEMPLATE_TEST_CASE("16-bit memories: bitwise their float memories on the converted rows", "[memory][low-precision]",
                   bf16, f16) {
    using E = TestType;
    const Index n = 600, d = 16, dv = 8;  // three prefill spans, the last one short
    const Matrix<float> Q = exact_in<E>(random_matrix<float>(n, d, 1)), K = exact_in<E>(random_matrix<float>(n, d, 2)),
                        V = exact_in<E>(random_matrix<float>(n, dv, 3));
    SECTION("KVCache, stored as E") { check_twin([] { return KVCache<E>(d, dv); }, Q, K, V); }
    SECTION("KVCache, stored as Q8, with logit options and RoPE") {
        const double slope[1] = {0.25};
        check_twin([&] { return KVCache<E, Q8>(d, dv, SoftmaxOptions{.softcap = 4, .alibi_slopes = slope}, Rope{.head_dim = d}); },
                   Q, K, V);
    }
    SECTION("KVCache, stored as float") { check_twin([] { return KVCache<E, float>(d, dv); }, Q, K, V); }
    SECTION("SlidingWindowCache with sinks") { check_twin([] { return SlidingWindowCache<E>(d, dv, 100, 4); }, Q, K, V); }
    SECTION("SlidingWindowCache, window past the sequence, Q4") {
        check_twin([] { return SlidingWindowCache<E, Q4>(d, dv, 1000); }, Q, K, V);
    }
    SECTION("MovingAverageCache") { check_twin([] { return MovingAverageCache<E>(d, dv, 32); }, Q, K, V); }
    SECTION("MovingAverageCache, exponential") {
        check_twin([] { return MovingAverageCache<E>::exponential(d, dv, 0.2f); }, Q, K, V);
    }
    SECTION("KVCache over a float memory built first, with its pairs") {
        KVCache<float, E> filled(d, dv);
        filled.extend(K.topRows(5), V.topRows(5));
        check_twin([&] { return KVCache<E>(filled); }, Q, K, V);
    }
    SECTION("HybridCache") { check_twin([] { return HybridCache<E>(d, dv, 64, 4, 8); }, Q, K, V); }
    SECTION("LinearAttentionMemory") { check_twin([] { return LinearAttentionMemory<E>(d, dv); }, Q, K, V); }
    SECTION("LinearAttentionMemory, d = 1") {
        check_twin([] { return LinearAttentionMemory<E, Taylor2>(1, 1); }, Q.leftCols(1), K.leftCols(1), V.leftCols(1));
    }
    SECTION("GatedLinearAttentionMemory") {
        const Matrix<float> keys = gated_keys<E>(K.cwiseAbs() * 0.5f, 1, 4, false);
        check_twin([] { return GatedLinearAttentionMemory<E>(d, dv); }, Q.cwiseAbs(), keys, V);
    }
    SECTION("DeltaRuleMemory") {
        const Matrix<float> keys = gated_keys<E>(K, 1, 5, true);
        check_twin([] { return DeltaRuleMemory<E>(d, dv, {.chunk_size = 16, .qk_l2norm = true}); }, Q, keys, V);
    }
    SECTION("MultiHead<KVCache>, groups of two") {
        const HeadLayout layout{.q_heads = 4, .kv_heads = 2, .head_dim = 8};
        check_twin([&] { return MultiHead<KVCache<E>>(layout, [](Index) { return KVCache<E>(8, 8); }); },
                   exact_in<E>(random_matrix<float>(n, 32, 6)), K, K);
    }
    SECTION("MultiHead<SlidingWindowCache>, one query head per KV head") {
        const HeadLayout layout{.q_heads = 2, .kv_heads = 2, .head_dim = 8, .value_dim = 4};
        check_twin([&] { return MultiHead<SlidingWindowCache<E>>(layout, [](Index) { return SlidingWindowCache<E>(8, 4, 50, 2); }); },
                   K, K, V);
    }
}

TEST_CASE("KVCache<bfloat16>: within its output's rounding of the double reference; 0 and 1 tokens",
          "[memory][low-precision]") {
    for (const Index d : {Index{1}, Index{64}}) {
        const Index n = 300, dv = d;
        const Matrix<bf16> Q = random_matrix<float>(n, d, 1).cast<bf16>(), K = random_matrix<float>(n, d, 2).cast<bf16>(),
                           V = random_matrix<float>(n, dv, 3).cast<bf16>();
        const test::MatrixD expected =
            reference::softmax_attention(Q.cast<double>(), K.cast<double>(), V.cast<double>()).out;
        KVCache<bf16> cache(d, dv);
        Vector<bf16> out(dv);
        cache.attend(Q.row(0), out);  // empty: zero
        CHECK(out.cast<float>().isZero(0));
        Matrix<bf16> O(n, dv);
        decode(cache, Q, K, V, O);
        // float arithmetic (≪ 2^-8) plus the rounding to bfloat16: its unit roundoff, 2^-8 relative
        const Eigen::ArrayXXd error = (O.cast<double>() - expected).array().abs();
        const Eigen::ArrayXXd bound = expected.array().abs() * 0x1p-8 + 1e-5;
        CAPTURE(d, (error - bound).maxCoeff());
        CHECK((error <= bound).all());
        CHECK(O.row(0).cast<float>() == V.row(0).cast<float>());  // one token: its value
    }
}

TEST_CASE("16-bit memories: bad input is refused, named as the caller passed it, and changes nothing",
          "[memory][low-precision][bad-input]") {
    const Index n = 600, d = 8, dv = 8;
    Matrix<bf16> Q = random_matrix<float>(n, d, 1).cast<bf16>(), K = random_matrix<float>(n, d, 2).cast<bf16>(),
                 V = random_matrix<float>(n, dv, 3).cast<bf16>(), O(n, dv);
    const auto message = [](auto&& call) {
        try {
            call();
        } catch (const std::invalid_argument& e) {
            return std::string(e.what());
        }
        return std::string("no exception");
    };
    SECTION("a value float16 storage cannot hold, in a late span: its row") {
        KVCache<bf16, f16> cache(d, dv);
        cache.extend(K.topRows(10), V.topRows(10));
        Matrix<bf16> bad = K;
        bad(300, 5) = bf16(1e5f);
        const std::string extend = message([&] { cache.extend(bad, V); });
        CHECK_THAT(extend, Catch::Matchers::Contains("KVCache::extend") && Catch::Matchers::Contains("in row 300, column 5"));
        const std::string prefill = message([&] { cache.prefill(Q, bad, V, O); });
        CHECK_THAT(prefill, Catch::Matchers::Contains("KVCache::prefill") && Catch::Matchers::Contains("in row 300"));
        CHECK(message([&] { memattn::extend(cache, bad, V); }).find("in row 300") != std::string::npos);
        CHECK(cache.length() == 10);
        SlidingWindowCache<bf16, f16> window(d, dv, 64);
        CHECK_THAT(message([&] { window.extend(bad, V); }), Catch::Matchers::Contains("in row 300, column 5"));
        CHECK(window.length() == 0);
        DeltaRuleMemory<bf16> delta(d - 1, dv);  // column d − 1 is β
        Matrix<bf16> betas = K.cwiseAbs();
        betas(41, d - 1) = bf16(1.5f);
        CHECK_THAT(message([&] { memattn::extend(delta, betas, V); }), Catch::Matchers::Contains("row 41 has beta 1.5"));
        CHECK(delta.length() == 0);
    }
    SECTION("shapes: the caller's") {
        KVCache<bf16> cache(d, dv);
        CHECK_THAT(message([&] { cache.extend(K.leftCols(7), V); }), Catch::Matchers::Contains("600x7"));
        CHECK_THAT(message([&] { cache.prefill(Q.topRows(599), K, V, O); }), Catch::Matchers::Contains("599x8"));
        Vector<bf16> out(dv + 1);
        CHECK_THAT(message([&] { cache.attend(Q.row(0), out); }), Catch::Matchers::Contains("KVCache::attend"));
        CHECK(cache.length() == 0);
        MultiHead<LinearAttentionMemory<bf16>> layer(HeadLayout{.q_heads = 2, .kv_heads = 1, .head_dim = 8},
                                                     [](Index) { return LinearAttentionMemory<bf16>(8, 8); });
        CHECK_THAT(message([&] { layer.extend(K, V.leftCols(5)); }), Catch::Matchers::Contains("600x5"));
        CHECK(layer.length() == 0);
    }
    SECTION("room for every row: a memory near max_length takes none of them") {
        LinearAttentionMemory<bf16> mem(d, dv);
        mem.set_state(mem.state(), max_length - 10);
        CHECK_THROWS_AS(mem.extend(K.topRows(20), V.topRows(20)), std::length_error);
        CHECK_THROWS_AS(decode(mem, Q.topRows(20), K.topRows(20), V.topRows(20), O.topRows(20)), std::length_error);
        CHECK(mem.length() == max_length - 10);
    }
    SECTION("the float rows' grouped prefill is not inherited") {
        static_assert(detail::HasGroupPrefill<SlidingWindowCache<float>>);
        static_assert(!detail::HasGroupPrefill<SlidingWindowCache<bf16>>);
        static_assert(!detail::HasGroupPrefill<LinearAttentionMemory<bf16>>);
    }
    SECTION("an output overlapping an input") {
        KVCache<bf16> cache(d, dv);
        cache.update(K.row(0), V.row(0));
        Vector<bf16> row = Q.row(0);
        CHECK_THAT(message([&] { cache.attend(row, row); }), Catch::Matchers::Contains("KVCache::attend") &&
                                                                  Catch::Matchers::Contains("shares memory"));
        Matrix<bf16> group = Q.topRows(2);
        CHECK_THAT(message([&] { cache.attend_group(group, group); }), Catch::Matchers::Contains("shares memory"));
        Matrix<bf16> both(n, 2 * d);
        both << K, V;
        CHECK_THAT(message([&] { cache.prefill(Q, both.leftCols(d), V, both.leftCols(d)); }),
                   Catch::Matchers::Contains("KVCache::prefill") && Catch::Matchers::Contains("shares memory"));
        CHECK(cache.length() == 1);
    }
}
