// Compile-time checks of the Memory concept, and a memory written by a user in about
// twenty lines that works with decode / extend / prefill unchanged.
#include "support.hpp"

#include <memattn/memory/concept.hpp>
#include <memattn/memory/kv_cache.hpp>

using namespace memattn;
using memattn::test::random_matrix;

namespace {

// A user's memory: the running sum of the values, read by every query.
struct SumMemory {
    using Scalar = double;
    explicit SumMemory(Index dv) : sum(Vector<double>::Zero(dv)) {}
    void update(ConstRowRef<double>, ConstRowRef<double> v) {
        sum += v;
        ++seen;
    }
    void attend(ConstRowRef<double>, RowRef<double> out) const { out = sum; }
    Index length() const { return seen; }
    std::size_t footprint() const { return static_cast<std::size_t>(sum.size()) * sizeof(double); }
    void reset() {
        sum.setZero();
        seen = 0;
    }
    Vector<double> sum;
    Index seen = 0;
};

struct NotAMemory {
    using Scalar = float;
    void update(ConstRowRef<float>, ConstRowRef<float>) {}
};

struct AttendNotConst {
    using Scalar = float;
    void update(ConstRowRef<float>, ConstRowRef<float>) {}
    void attend(ConstRowRef<float>, RowRef<float>) {}  // not const: a read must not change the memory
    Index length() const { return 0; }
    std::size_t footprint() const { return 0; }
    void reset() {}
};

static_assert(Memory<SumMemory>);
static_assert(Memory<KVCache<float>>);
static_assert(Memory<KVCache<double>>);
static_assert(!Memory<NotAMemory>);
static_assert(!Memory<AttendNotConst>);
static_assert(!Memory<int>);
static_assert(detail::HasBulkExtend<KVCache<float>>);
static_assert(!detail::HasBulkExtend<SumMemory>);

}  // namespace

TEST_CASE("A user-written memory works with decode, extend and prefill", "[memory][concept]") {
    const Index n = GENERATE(0, 1, 17);
    const Matrix<double> Q = random_matrix<double>(n, 3, 1), K = random_matrix<double>(n, 3, 2),
                         V = random_matrix<double>(n, 2, 3);
    reference::MatrixD expected(n, 2);
    Vector<double> running = Vector<double>::Zero(2);
    for (Index i = 0; i < n; ++i)
        expected.row(i) = running += V.row(i);

    SumMemory mem(2);
    Matrix<double> O(n, 2);
    decode(mem, Q, K, V, O);
    CHECK(mem.length() == n);
    CHECK(O == expected);

    mem.reset();
    Matrix<double> P(n, 2);
    prefill(mem, Q, K, V, P);
    CHECK(P == expected);

    mem.reset();
    extend(mem, K, V);
    CHECK(mem.length() == n);
    CHECK(mem.sum == running);
}

TEST_CASE("decode and extend check shapes before feeding any token", "[memory][concept]") {
    KVCache<float> cache(4, 3);
    const Matrix<float> K = random_matrix<float>(5, 4, 1), V = random_matrix<float>(5, 3, 2);
    const Matrix<float> Q = random_matrix<float>(5, 4, 3);
    Matrix<float> O(5, 3);
    Matrix<float> wrong_o(4, 3);
    Matrix<float> short_v = V.topRows(4);
    Matrix<float> wide_k = random_matrix<float>(5, 5, 4);
    CHECK_THROWS_AS(decode(cache, Q, K, V, wrong_o), std::invalid_argument);
    CHECK_THROWS_AS(decode(cache, Q, K, short_v, O), std::invalid_argument);
    CHECK_THROWS_AS(extend(cache, wide_k, V), std::invalid_argument);
    CHECK_THROWS_WITH(prefill(cache, Q, wide_k, V, O),
                      memattn::test::HasSubstring("memattn::prefill") && memattn::test::HasSubstring("'K'") &&
                          memattn::test::HasSubstring("5x5"));
    CHECK(cache.length() == 0);
}
