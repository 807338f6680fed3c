#include "support.hpp"

#include <memattn/feature_maps.hpp>
#include <memattn/kernels/linear_attention.hpp>
#include <memattn/memory/concept.hpp>
#include <memattn/memory/linear_attention_memory.hpp>

#include <cstdint>
#include <limits>
#include <thread>
#include <vector>

using namespace memattn;
using memattn::test::check_close;
using memattn::test::random_matrix;
using memattn::test::tolerance;
using reference::MatrixD;
using reference::RowD;
using memattn::test::HasSubstring;
using memattn::test::SquarePlusOne;

namespace {

static_assert(Memory<LinearAttentionMemory<float>>);
static_assert(Memory<LinearAttentionMemory<double, Taylor2>>);
static_assert(Memory<LinearAttentionMemory<float, SquarePlusOne>>);
static_assert(detail::HasBulkExtend<LinearAttentionMemory<float>>);
static_assert(detail::HasBulkPrefill<LinearAttentionMemory<float>>);

/// φ(X) in double, for the reference.
template <class Phi>
MatrixD features(const Phi& phi, const MatrixD& X) {
    MatrixD Y(X.rows(), phi.output_dim(X.cols()));
    phi(ConstMatrixRef<double>(X), MatrixRef<double>(Y));
    return Y;
}

enum class Form { quadratic, recurrent, chunked };
constexpr Form all_forms[] = {Form::quadratic, Form::recurrent, Form::chunked};

const char* name(Form f) {
    return f == Form::quadratic ? "quadratic" : f == Form::recurrent ? "recurrent" : "chunked";
}

template <class T, class Phi>
void run(Form form, const Matrix<T>& Q, const Matrix<T>& K, const Matrix<T>& V, Matrix<T>& O, const Phi& phi,
         const LinearOptions& options, LinearState<T>* state) {
    switch (form) {
    case Form::quadratic:
        quadratic_linear_attention(Q, K, V, O, phi, options, state);
        break;
    case Form::recurrent:
        recurrent_linear_attention(Q, K, V, O, phi, options, state);
        break;
    case Form::chunked:
        chunked_linear_attention(Q, K, V, O, phi, options, state);
        break;
    }
}

/// Identity gives sign-indefinite q·k, so a normalised output would divide by numbers
/// near 0: it is checked on non-negative inputs.
template <class T>
Matrix<T> inputs(Index n, Index d, std::uint64_t seed, bool non_negative) {
    Matrix<T> m = random_matrix<T>(n, d, seed);
    if (non_negative)
        m = m.cwiseAbs();
    return m;
}

/// Float sums of a few hundred terms of products of features lose more digits than one
/// operation; the tolerance is relative to the largest expected value.
template <class T>
double linear_tolerance() {
    return sizeof(T) == 4 ? 1e-4 : 1e-11;
}

/// Every form, with an initial state or without, against the reference on φ in double.
template <class T, class Phi>
void check_forms(const Phi& phi, Index n, Index d, Index dv, const LinearOptions& options, bool non_negative,
                 bool with_initial) {
    const Matrix<T> Q = inputs<T>(n, d, 1, non_negative), K = inputs<T>(n, d, 2, non_negative);
    const Matrix<T> V = random_matrix<T>(n, dv, 3);
    const Index f = phi.output_dim(d);
    LinearState<T> initial;
    if (with_initial) {  // a state as if from earlier positive-feature tokens
        initial.mu = random_matrix<T>(f, dv, 4);
        initial.nu = random_matrix<T>(1, f, 5).cwiseAbs();
    }
    const MatrixD Qf = features(phi, reference::to_double(Q)), Kf = features(phi, reference::to_double(K));
    const auto expected = reference::linear_attention(Qf, Kf, reference::to_double(V), options.decay, options.eps,
                                                      options.normalize, reference::to_double(initial.mu),
                                                      reference::to_double(initial.nu));
    for (const Form form : all_forms) {
        CAPTURE(name(form));
        Matrix<T> O(n, dv);
        LinearState<T> state = initial;
        run(form, Q, K, V, O, phi, options, &state);
        check_close(O, expected.out, linear_tolerance<T>());
        check_close(state.mu, expected.mu, linear_tolerance<T>());
        check_close(state.nu, expected.nu, linear_tolerance<T>());
        Matrix<T> without_state(n, dv);
        if (!with_initial) {  // state = nullptr: the same outputs
            run<T>(form, Q, K, V, without_state, phi, options, nullptr);
            CHECK(without_state == O);
        }
    }
}

template <class T>
void check_map(int map, Index n, Index d, Index dv, const LinearOptions& options, bool with_initial = false) {
    switch (map) {
    case 0: {
        CAPTURE("Identity");
        check_forms<T>(Identity{}, n, d, dv, options, true, with_initial);
        break;
    }
    case 1: {
        CAPTURE("EluPlusOne");
        check_forms<T>(EluPlusOne{}, n, d, dv, options, false, with_initial);
        break;
    }
    case 2: {
        CAPTURE("Relu");
        check_forms<T>(Relu{}, n, d, dv, options, false, with_initial);
        break;
    }
    case 3: {
        CAPTURE("FavorPlus");
        check_forms<T>(FavorPlus(d, 12, 7), n, d, dv, options, false, with_initial);
        break;
    }
    case 4: {
        CAPTURE("Taylor2");
        check_forms<T>(Taylor2{}, n, d, dv, options, false, with_initial);
        break;
    }
    default: {
        CAPTURE("SquarePlusOne");
        check_forms<T>(SquarePlusOne{}, n, d, dv, options, false, with_initial);
        break;
    }
    }
}

}  // namespace

TEMPLATE_TEST_CASE("Linear attention: the three forms equal the reference", "[linear]", float, double) {
    using T = TestType;
    const Index chunk = GENERATE(1, 7, 64);
    const Index n = GENERATE_COPY(Index(0), Index(1), chunk - 1, chunk, chunk + 1, 5 * chunk + 3);
    const int map = GENERATE(range(0, 6));
    const double decay = GENERATE(1.0, 0.9, 0.5);
    const bool normalize = GENERATE(true, false);
    CAPTURE(chunk, n, map, decay, normalize);
    check_map<T>(map, n, 5, 3, LinearOptions{.chunk_size = chunk, .eps = 1e-6, .decay = decay, .normalize = normalize});
}

TEMPLATE_TEST_CASE("Linear attention: initial state, d = 1, wide values", "[linear]", float, double) {
    using T = TestType;
    const int map = GENERATE(range(0, 6));
    const Index d = GENERATE(1, 4);
    const Index dv = GENERATE(1, 9);
    const double decay = GENERATE(1.0, 0.8);
    CAPTURE(map, d, dv, decay);
    check_map<T>(map, 45, d, dv, LinearOptions{.chunk_size = 16, .decay = decay}, true);
    check_map<T>(map, 45, d, dv, LinearOptions{.chunk_size = 16, .decay = decay, .normalize = false}, true);
}

TEMPLATE_TEST_CASE("Linear attention: decay near 0 and long chunks stay finite", "[linear]", float, double) {
    using T = TestType;
    // γ^{chunk} underflows in T: the forms must give the exact tiny-weight result, no NaN/inf.
    const double decay = GENERATE(1e-3, 1e-30, 0.1);
    const Index n = 700, chunk = 300;
    const Matrix<T> Q = random_matrix<T>(n, 4, 1), K = random_matrix<T>(n, 4, 2), V = random_matrix<T>(n, 3, 3);
    const MatrixD Qf = features(EluPlusOne{}, reference::to_double(Q)), Kf = features(EluPlusOne{}, reference::to_double(K));
    for (const bool normalize : {true, false}) {
        const LinearOptions options{.chunk_size = chunk, .decay = decay, .normalize = normalize};
        const auto expected = reference::linear_attention(Qf, Kf, reference::to_double(V), decay, options.eps, normalize);
        for (const Form form : all_forms) {
            CAPTURE(decay, normalize, name(form));
            Matrix<T> O(n, 3);
            LinearState<T> state;
            run(form, Q, K, V, O, EluPlusOne{}, options, &state);
            check_close(O, expected.out, linear_tolerance<T>());
            check_close(state.mu, expected.mu, linear_tolerance<T>());
        }
    }
}

TEMPLATE_TEST_CASE("Linear attention: a sequence split anywhere, state carried, equals the whole",
                   "[linear][split]", float, double) {
    using T = TestType;
    const Index n = 150, d = 6, dv = 5;
    const Matrix<T> Q = random_matrix<T>(n, d, 11), K = random_matrix<T>(n, d, 12), V = random_matrix<T>(n, dv, 13);
    const double decay = GENERATE(1.0, 0.95);
    const LinearOptions options{.chunk_size = 16, .decay = decay};
    Matrix<T> whole(n, dv);
    LinearState<T> whole_state;
    chunked_linear_attention(Q, K, V, whole, EluPlusOne{}, options, &whole_state);
    const Index cut = GENERATE(Index(0), Index(1), Index(15), Index(16), Index(17), Index(75), Index(149), Index(150));
    for (const Form first : all_forms)
        for (const Form second : all_forms) {
            CAPTURE(decay, cut, name(first), name(second));
            LinearState<T> state;
            Matrix<T> head(cut, dv), tail(n - cut, dv);
            run<T>(first, Q.topRows(cut), K.topRows(cut), V.topRows(cut), head, EluPlusOne{}, options, &state);
            run<T>(second, Q.bottomRows(n - cut), K.bottomRows(n - cut), V.bottomRows(n - cut), tail, EluPlusOne{},
                   options, &state);
            check_close(head, reference::to_double(whole.topRows(cut)), tolerance<T>());
            check_close(tail, reference::to_double(whole.bottomRows(n - cut)), tolerance<T>());
            check_close(state.mu, reference::to_double(whole_state.mu), tolerance<T>());
            check_close(state.nu, reference::to_double(whole_state.nu), tolerance<T>());
        }
}

TEMPLATE_TEST_CASE("Linear attention: a non-finite key reaches no earlier query of its chunk", "[linear]", float,
                   double) {
    using T = TestType;
    const Index n = 40, d = 8, dv = 5, bad = 21;  // row 21 sits inside the chunk [16, 32)
    const T value = GENERATE(std::numeric_limits<T>::infinity(), std::numeric_limits<T>::quiet_NaN());
    const double decay = GENERATE(1.0, 0.9);
    const Matrix<T> Q = random_matrix<T>(n, d, 31), V = random_matrix<T>(n, dv, 33);
    Matrix<T> K = random_matrix<T>(n, d, 32);
    Matrix<T> clean(n, dv), poisoned(n, dv);
    const LinearOptions options{.chunk_size = 16, .decay = decay, .normalize = false};
    chunked_linear_attention(Q, K, V, clean, Identity{}, options);
    K(bad, 3) = value;
    chunked_linear_attention(Q, K, V, poisoned, Identity{}, options);
    CAPTURE(value, decay);
    CHECK(poisoned.topRows(bad) == clean.topRows(bad));  // queries before the key: untouched
    CHECK_FALSE(poisoned.bottomRows(n - bad).allFinite());
}

TEST_CASE("Linear attention takes blocks of wider buffers without copies", "[linear]") {
    // Two heads side by side in [tokens, heads*dim] arrays; head 1 alone equals its copy.
    const Index n = 40, d = 4, dv = 3;
    const Matrix<float> Q = random_matrix<float>(n, 2 * d, 1), K = random_matrix<float>(n, 2 * d, 2);
    const Matrix<float> V = random_matrix<float>(n, 2 * dv, 3);
    Matrix<float> O = Matrix<float>::Zero(n, 2 * dv), expected(n, dv);
    chunked_linear_attention(Q.rightCols(d), K.rightCols(d), V.rightCols(dv), O.rightCols(dv));
    const Matrix<float> q = Q.rightCols(d), k = K.rightCols(d), v = V.rightCols(dv);
    chunked_linear_attention(q, k, v, expected);
    CHECK(O.rightCols(dv) == expected);
    CHECK(O.leftCols(dv).isZero());
}

TEST_CASE("Linear attention: bad input throws, naming function, argument and shapes", "[linear][errors]") {
    using memattn::test::HasSubstring;
    const Matrix<float> Q = random_matrix<float>(10, 4, 1), K = random_matrix<float>(10, 4, 2),
                        V = random_matrix<float>(10, 3, 3);
    Matrix<float> O(10, 3);
    REQUIRE_THROWS_WITH(chunked_linear_attention(Q, K, V, O, EluPlusOne{}, {.chunk_size = 0}),
                        HasSubstring("chunked_linear_attention") && HasSubstring("options.chunk_size"));
    REQUIRE_THROWS_WITH(recurrent_linear_attention(Q, K, V, O, EluPlusOne{}, {.decay = 0}),
                        HasSubstring("recurrent_linear_attention") && HasSubstring("options.decay") && HasSubstring("(0, 1]"));
    REQUIRE_THROWS_WITH(quadratic_linear_attention(Q, K, V, O, EluPlusOne{}, {.decay = 1.5}), HasSubstring("options.decay"));
    REQUIRE_THROWS_WITH(chunked_linear_attention(Q, K, V, O, EluPlusOne{}, {.decay = std::nan("")}),
                        HasSubstring("options.decay"));
    REQUIRE_THROWS_WITH(chunked_linear_attention(Q, K, V, O, EluPlusOne{}, {.eps = -1}), HasSubstring("options.eps"));
    REQUIRE_THROWS_WITH(chunked_linear_attention(Q, K.leftCols(3), V, O), HasSubstring("'K'") && HasSubstring("10x3") && HasSubstring("10x4"));
    REQUIRE_THROWS_WITH(chunked_linear_attention(Q, K, V.topRows(9), O), HasSubstring("'V'") && HasSubstring("9x3"));
    Matrix<float> wrong(10, 4);
    REQUIRE_THROWS_WITH(chunked_linear_attention(Q, K, V, wrong), HasSubstring("'O'") && HasSubstring("10x4") && HasSubstring("10x3"));
    // A state whose feature dim does not fit phi (Taylor2: d' = 15 for d = 4).
    LinearState<float> state;
    Matrix<float> out(10, 3);
    chunked_linear_attention(Q, K, V, out, EluPlusOne{}, {}, &state);
    const LinearState<float> saved = state;
    REQUIRE_THROWS_WITH(chunked_linear_attention(Q, K, V, out, Taylor2{}, {}, &state),
                        HasSubstring("state->mu") && HasSubstring("4x3") && HasSubstring("15x3"));
    CHECK(state.mu == saved.mu);  // nothing changed
    state.nu.resize(5);
    REQUIRE_THROWS_WITH(chunked_linear_attention(Q, K, V, out, EluPlusOne{}, {}, &state),
                        HasSubstring("state->nu") && HasSubstring("1x5"));
    // FavorPlus drawn for another input dim.
    REQUIRE_THROWS_WITH(chunked_linear_attention(Q, K, V, out, FavorPlus(5, 8, 1)), HasSubstring("FavorPlus"));
}

// ------------------------------------------------------------------- the memory

TEMPLATE_TEST_CASE("LinearAttentionMemory: decode and prefill equal the kernels", "[linear][memory]", float, double) {
    using T = TestType;
    const Index n = 200, d = 5, dv = 7;
    const double decay = GENERATE(1.0, 0.9);
    const bool normalize = GENERATE(true, false);
    const LinearOptions options{.chunk_size = 32, .decay = decay, .normalize = normalize};
    const Matrix<T> Q = random_matrix<T>(n, d, 21), K = random_matrix<T>(n, d, 22), V = random_matrix<T>(n, dv, 23);
    Matrix<T> expected(n, dv);
    LinearState<T> expected_state;
    recurrent_linear_attention(Q, K, V, expected, Taylor2{}, options, &expected_state);

    LinearAttentionMemory<T, Taylor2> decoded(d, dv, {}, options);
    const std::size_t footprint = decoded.footprint();
    CHECK(footprint == static_cast<std::size_t>(21 * (dv + 1)) * sizeof(T));
    Matrix<T> O(n, dv);
    decode(decoded, Q, K, V, O);
    check_close(O, reference::to_double(expected), tolerance<T>());
    CHECK(decoded.length() == n);
    CHECK(decoded.footprint() == footprint);  // constant however long
    check_close(decoded.state().mu, reference::to_double(expected_state.mu), tolerance<T>());

    // extend a prefix, prefill the middle, decode the rest: the same outputs.
    const Index cut = GENERATE(Index(0), Index(1), Index(33), Index(100));
    LinearAttentionMemory<T, Taylor2> mixed(d, dv, {}, options);
    extend(mixed, K.topRows(cut), V.topRows(cut));
    const Index mid = (n - cut) / 2;
    Matrix<T> O_mid(mid, dv), O_rest(n - cut - mid, dv);
    prefill(mixed, Q.middleRows(cut, mid), K.middleRows(cut, mid), V.middleRows(cut, mid), O_mid);
    decode(mixed, Q.bottomRows(n - cut - mid), K.bottomRows(n - cut - mid), V.bottomRows(n - cut - mid), O_rest);
    CHECK(mixed.length() == n);
    check_close(O_mid, reference::to_double(expected.middleRows(cut, mid)), tolerance<T>());
    check_close(O_rest, reference::to_double(expected.bottomRows(n - cut - mid)), tolerance<T>());
    check_close(mixed.state().mu, reference::to_double(expected_state.mu), tolerance<T>());
    check_close(mixed.state().nu, reference::to_double(expected_state.nu), tolerance<T>());
}

TEST_CASE("LinearAttentionMemory: save, reset and resume the state", "[linear][memory]") {
    const Index n = 60, d = 4, dv = 3;
    const Matrix<double> Q = random_matrix<double>(n, d, 1), K = random_matrix<double>(n, d, 2),
                         V = random_matrix<double>(n, dv, 3);
    LinearAttentionMemory<double> memory(d, dv);
    Matrix<double> whole(n, dv), head(30, dv), tail(30, dv);
    decode(memory, Q, K, V, whole);
    memory.reset();
    CHECK(memory.length() == 0);
    CHECK(memory.state().mu.isZero());
    Vector<double> out(dv);
    memory.attend(Q.row(0), out);
    CHECK(out.isZero());  // an empty memory attends to nothing

    decode(memory, Q.topRows(30), K.topRows(30), V.topRows(30), head);
    const LinearState<double> saved = memory.state();
    LinearAttentionMemory<double> resumed(d, dv);
    resumed.set_state(saved, 30);
    decode(resumed, Q.bottomRows(30), K.bottomRows(30), V.bottomRows(30), tail);
    CHECK(resumed.length() == n);
    check_close(tail, reference::to_double(whole.bottomRows(30)), 1e-13);

    LinearState<double> wrong{Matrix<double>::Zero(3, dv), Vector<double>::Zero(3)};
    REQUIRE_THROWS_WITH(resumed.set_state(wrong), HasSubstring("set_state") &&
                                                     HasSubstring("3x3") && HasSubstring("4x3"));
    CHECK(resumed.length() == n);
}

TEST_CASE("LinearAttentionMemory: a throwing update leaves the memory unchanged", "[linear][memory][errors]") {
    LinearAttentionMemory<float> memory(4, 3);
    const Matrix<float> K = random_matrix<float>(5, 4, 1), V = random_matrix<float>(5, 3, 2);
    extend(memory, K, V);
    const LinearState<float> before = memory.state();
    const Vector<float> long_key = Vector<float>::Ones(5), short_value = Vector<float>::Ones(2);
    REQUIRE_THROWS_WITH(memory.update(long_key, V.row(0)),
                        HasSubstring("LinearAttentionMemory::update") && HasSubstring("'key'"));
    REQUIRE_THROWS_WITH(memory.update(K.row(0), short_value), HasSubstring("'value'"));
    REQUIRE_THROWS_AS(extend(memory, K, V.topRows(4)), std::invalid_argument);
    Vector<float> out(2);
    REQUIRE_THROWS_WITH(memory.attend(K.row(0), out), HasSubstring("'out'"));
    CHECK(memory.length() == 5);
    CHECK(memory.state().mu == before.mu);
    CHECK(memory.state().nu == before.nu);
    REQUIRE_THROWS_AS(LinearAttentionMemory<float>(0, 3), std::invalid_argument);
    REQUIRE_THROWS_WITH(LinearAttentionMemory<float>(4, 3, {}, {.decay = 2}), HasSubstring("options.decay"));
    REQUIRE_THROWS_WITH(LinearAttentionMemory<float>(4, 3, {}, {.chunk_size = 0}),
                        HasSubstring("options.chunk_size"));
    REQUIRE_THROWS_AS((LinearAttentionMemory<float, FavorPlus>(4, 3, FavorPlus(5, 8, 1))), std::invalid_argument);
}

TEST_CASE("LinearAttentionMemory: concurrent attends, wide feature maps, copies", "[linear][memory]") {
    // d = 130: Taylor2 has 8646 features, beyond attend's stack buffer for float.
    const Index d = 130, dv = 4, n = 20;
    const Matrix<float> Q = random_matrix<float>(n, d, 1, 0.1), K = random_matrix<float>(n, d, 2, 0.1),
                        V = random_matrix<float>(n, dv, 3);
    LinearAttentionMemory<float, Taylor2> wide(d, dv);
    REQUIRE(wide.feature_dim() > LinearAttentionMemory<float, Taylor2>::stack_features);
    Matrix<float> O(n, dv), expected(n, dv);
    decode(wide, Q, K, V, O);
    recurrent_linear_attention(Q, K, V, expected, Taylor2{});
    check_close(O, reference::to_double(expected), tolerance<float>());

    LinearAttentionMemory<float, Taylor2> copy = wide;  // a copy has its own scratch
    LinearAttentionMemory<float> narrow(d, dv);
    extend(narrow, K, V);
    Vector<float> wide_once(dv), narrow_once(dv);
    wide.attend(Q.row(0), wide_once);
    narrow.attend(Q.row(0), narrow_once);
    std::vector<int> mismatches(4, 0);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t)
        threads.emplace_back([&, t] {
            Vector<float> a(dv), b(dv);
            for (int i = 0; i < 50; ++i) {
                (t % 2 ? copy : wide).attend(Q.row(0), a);
                narrow.attend(Q.row(0), b);
                mismatches[static_cast<std::size_t>(t)] += (a != wide_once) + (b != narrow_once);
            }
        });
    for (auto& thread : threads)
        thread.join();
    CHECK(mismatches == std::vector<int>(4, 0));
}

TEMPLATE_TEST_CASE("LinearAttentionMemory: bulk extend over several blocks equals updates", "[linear][memory]", float,
                   double) {
    using T = TestType;
    const Index n = 2 * LinearAttentionMemory<T>::extend_block + 37, d = 3, dv = 2;
    const double decay = GENERATE(1.0, 0.99, 0.3);
    const LinearOptions options{.decay = decay};
    const Matrix<T> K = random_matrix<T>(n, d, 31), V = random_matrix<T>(n, dv, 32);
    LinearAttentionMemory<T, Relu> bulk(d, dv, {}, options), stepped(d, dv, {}, options);
    extend(bulk, K, V);
    for (Index i = 0; i < n; ++i)
        stepped.update(K.row(i), V.row(i));
    CHECK(bulk.length() == n);
    const MatrixD Kf = features(Relu{}, reference::to_double(K));
    const auto expected = reference::linear_attention(Kf, Kf, reference::to_double(V), decay);
    check_close(bulk.state().mu, expected.mu, linear_tolerance<T>());
    check_close(bulk.state().nu, expected.nu, linear_tolerance<T>());
    check_close(stepped.state().mu, expected.mu, linear_tolerance<T>());
}

TEMPLATE_TEST_CASE("Linear attention on bfloat16 and float16 equals the float forms on the same inputs, state carried",
                   "[linear][low_precision]", Eigen::bfloat16, Eigen::half) {
    using E = TestType;
    const Index n = GENERATE(Index(0), Index(1), Index(255), Index(256), Index(257), Index(700));
    const Index chunk = GENERATE(Index(16), Index(5));
    const Index d = 10, dv = 6;
    CAPTURE(n, chunk);
    const Matrix<E> Q = random_matrix<float>(n, d, 1).cast<E>(), K = random_matrix<float>(n, d, 2).cast<E>(),
                    V = random_matrix<float>(n, dv, 3).cast<E>();
    const Matrix<float> q = Q.template cast<float>(), k = K.template cast<float>(), v = V.template cast<float>();
    const LinearOptions options{.chunk_size = chunk, .decay = 0.97};
    const auto same = [](const auto& a, const auto& b) {
        return a.rows() == b.rows() && a.cols() == b.cols() && (a.array() == b.array()).all();
    };
    Matrix<float> O16(n, dv), O32(n, dv);
    Matrix<E> Ob(n, dv);
    // Chunked and recurrent: bit for bit (the spans cut only between chunks).
    LinearState<float> s16, s32;
    chunked_linear_attention(Q, K, V, O16, EluPlusOne{}, options, &s16);
    chunked_linear_attention(q, k, v, O32, EluPlusOne{}, options, &s32);
    CHECK(same(O16, O32));
    CHECK(same(s16.mu, s32.mu));
    CHECK(same(s16.nu, s32.nu));
    chunked_linear_attention(Q, K, V, Ob, EluPlusOne{}, options);
    CHECK(same(Ob, Matrix<E>(O32.cast<E>())));
    recurrent_linear_attention(Q, K, V, O16, Relu{}, options, &s16);
    recurrent_linear_attention(q, k, v, O32, Relu{}, options, &s32);
    CHECK(same(O16, O32));
    CHECK(same(s16.mu, s32.mu));
    // Quadratic: the past of each span through the state, within float's tolerance.
    LinearState<float> a, b;
    quadratic_linear_attention(Q, K, V, O16, EluPlusOne{}, options, &a);
    quadratic_linear_attention(q, k, v, O32, EluPlusOne{}, options, &b);
    check_close(O16, O32.cast<double>(), tolerance<float>());
    if (n > 0)
        check_close(a.mu, b.mu.cast<double>(), tolerance<float>());
}

TEMPLATE_TEST_CASE("Linear attention by spans: bitwise the same on 1, 2 and 3 threads, one span's outputs to "
                   "rounding, the double reference",
                   "[linear][spans][threads]", float, double) {
    using T = TestType;
    const double tol = tolerance<T>() * 20;
    const Index d = 6, dv = 5;
    const OpenMPExecutor one{.threads = 1}, two{.threads = 2}, three{.threads = 3};
    for (const Index n : {0, 1, 33, 300, 700}) {
        for (const Index span : {5, 40, 100, 256, 1000}) {
            for (const double decay : {1.0, 0.97}) {
                for (const bool normalize : {false, true}) {
                    INFO("n = " << n << ", span " << span << ", decay " << decay << ", normalize " << normalize);
                    const Matrix<T> Q = random_matrix<T>(n, d, 1), K = random_matrix<T>(n, d, 2),
                                    V = random_matrix<T>(n, dv, 3);
                    const LinearOptions serial{.chunk_size = 8, .decay = decay, .normalize = normalize};
                    LinearOptions options = serial;
                    options.span_tokens = span;
                    const LinearState<T> initial{random_matrix<T>(d, dv, 5), random_matrix<T>(1, d, 6).cwiseAbs()};
                    LinearState<T> s1 = initial, s2 = initial, s3 = initial, whole = initial;
                    Matrix<T> O1(n, dv), O2(n, dv), O3(n, dv), expected(n, dv);
                    chunked_linear_attention(Q, K, V, expected, EluPlusOne{}, serial, &whole);
                    chunked_linear_attention(Q, K, V, O1, EluPlusOne{}, options, &s1, one);
                    chunked_linear_attention(Q, K, V, O2, EluPlusOne{}, options, &s2, two);
                    chunked_linear_attention(Q, K, V, O3, EluPlusOne{}, options, &s3, three);
                    CHECK(O1.cwiseEqual(O2).all());
                    CHECK(O1.cwiseEqual(O3).all());
                    CHECK(s1.mu.cwiseEqual(s2.mu).all());
                    CHECK(s1.nu.cwiseEqual(s3.nu).all());
                    check_close(O1, reference::to_double(expected), tol);
                    check_close(s1.mu, reference::to_double(whole.mu), tol);
                    check_close(s1.nu, reference::to_double(whole.nu), tol);
                    const auto direct = reference::linear_attention(
                        features(EluPlusOne{}, reference::to_double(Q)), features(EluPlusOne{}, reference::to_double(K)),
                        reference::to_double(V), decay, 1e-6, normalize, reference::to_double(initial.mu),
                        reference::to_double(initial.nu));
                    check_close(O3, direct.out, tol);
                    check_close(s3.mu, direct.mu, tol);
                }
            }
        }
    }
    const Matrix<float> Q = random_matrix<float>(10, d, 1), V = random_matrix<float>(10, dv, 3);
    Matrix<float> O(10, dv);
    CHECK_THROWS_WITH(chunked_linear_attention(Q, Q, V, O, EluPlusOne{}, {.span_tokens = -3}),
                      Catch::Matchers::Contains("chunked_linear_attention") &&
                          Catch::Matchers::Contains("options.span_tokens"));
    // A memory prefills its own state as one span: the option is refused, not ignored.
    CHECK_THROWS_WITH(LinearAttentionMemory<float>(d, dv, EluPlusOne{}, {.span_tokens = 64}),
                      Catch::Matchers::Contains("LinearAttentionMemory") &&
                          Catch::Matchers::Contains("options.span_tokens"));
}
