#include "support.hpp"

#include <memattn/kernels/delta_rule.hpp>
#include <memattn/kernels/gated_linear_attention.hpp>
#include <memattn/memattn.hpp>
#include <memattn/memory/gated_memories.hpp>

#include <cmath>
#include <initializer_list>
#include <limits>
#include <optional>
#include <sstream>
#include <string>

using namespace memattn;
using memattn::test::check_close;
using memattn::test::random_matrix;
using memattn::test::tolerance;
using reference::MatrixD;
using reference::to_double;

namespace {

/// The gated recurrence in double, token by token, straight from the formulas.
MatrixD gated_reference(const MatrixD& Q, const MatrixD& K, const MatrixD& V, const MatrixD& G, bool normalize,
                        double eps, MatrixD& S, MatrixD& z) {
    const Index n = Q.rows(), d = Q.cols();
    MatrixD O(n, V.cols());
    for (Index i = 0; i < n; ++i) {
        for (Index r = 0; r < d; ++r) {
            const double a = std::exp(G(i, G.cols() == 1 ? 0 : r));
            S.row(r) = a * S.row(r) + K(i, r) * V.row(i);
            z(0, r) = a * z(0, r) + K(i, r);
        }
        O.row(i) = Q.row(i) * S;
        if (normalize)
            O.row(i) /= (Q.row(i).dot(z.row(0)) + eps);
    }
    return O;
}

/// flash-linear-attention's conventions in double, from the formulas: each row divided by
/// √(Σx² + eps) when l2norm (FLA's l2norm), then multiplied by scale.
MatrixD fla_rows(MatrixD X, bool l2norm, double scale = 1.0, double eps = 1e-6) {
    for (Index i = 0; i < X.rows(); ++i) {
        if (l2norm)
            X.row(i) /= std::sqrt(X.row(i).squaredNorm() + eps);
        X.row(i) *= scale;
    }
    return X;
}

/// The default scale of q for d-wide heads: 1/√d.
double default_scale(Index d) { return 1.0 / std::sqrt(double(d)); }

/// The (gated) delta rule in double: S = g (I − β kᵀk) S + β kᵀ v, o = q S (q and k as
/// given: fla_rows applies the conventions).
MatrixD delta_reference(const MatrixD& Q, const MatrixD& K, const MatrixD& V, const MatrixD& B, const MatrixD* G,
                        MatrixD& S) {
    const Index n = Q.rows(), d = Q.cols();
    MatrixD O(n, V.cols());
    for (Index i = 0; i < n; ++i) {
        const MatrixD k = K.row(i);
        const double g = G != nullptr ? std::exp((*G)(i, 0)) : 1.0;
        const MatrixD I = MatrixD::Identity(d, d);
        S = g * (I - B(i, 0) * k.transpose() * k) * S + B(i, 0) * k.transpose() * V.row(i);
        O.row(i) = Q.row(i) * S;
    }
    return O;
}

template <class T>
Matrix<T> log_gates(Index n, Index cols, std::uint64_t seed, double scale = 0.5) {
    return -random_matrix<T>(n, cols, seed, scale).cwiseAbs();
}

template <class T>
Matrix<T> betas(Index n, std::uint64_t seed) {
    return random_matrix<T>(n, 1, seed).cwiseAbs();
}

template <class T>
Matrix<T> unit_rows(Matrix<T> X) {
    X.rowwise().normalize();
    return X;
}

}  // namespace

TEMPLATE_TEST_CASE("Gated linear attention: recurrent equals the double reference, chunked equals recurrent",
                   "[gated]", float, double) {
    using T = TestType;
    const double tol = tolerance<T>() * 10;
    for (const Index n : {0, 1, 7, 70, 200}) {
        for (const Index gate_cols : {1, 5}) {
            for (const bool normalize : {false, true}) {
              for (const bool l2 : {false, true}) {
                INFO("n = " << n << ", gate columns " << gate_cols << ", normalize " << normalize << ", qk_l2norm "
                            << l2);
                const Index d = 5, dv = 3;
                // Positive features keep the normaliser away from 0, as a model's would.
                const Matrix<T> Q = random_matrix<T>(n, d, 1).cwiseAbs(), K = random_matrix<T>(n, d, 2).cwiseAbs();
                const Matrix<T> V = random_matrix<T>(n, dv, 3), G = log_gates<T>(n, gate_cols, 4);
                MatrixD S = MatrixD::Zero(d, dv), z = MatrixD::Zero(1, d);
                // The defaults: q scaled by 1/√d; qk_l2norm divides q and k by √(Σx² + 1e-6) first.
                const MatrixD expected =
                    gated_reference(fla_rows(to_double(Q), l2, default_scale(d)), fla_rows(to_double(K), l2),
                                    to_double(V), to_double(G), normalize, 1e-6, S, z);
                const GatedOptions base{.normalize = normalize, .qk_l2norm = l2};
                Matrix<T> O(n, dv);
                LinearState<T> state;
                recurrent_gated_linear_attention(Q, K, V, G, O, base, &state);
                check_close(O, expected, tol);
                check_close(state.mu, S, tol);
                for (const Index chunk : {1, 7, 16, 64}) {
                    INFO("chunk " << chunk);
                    GatedOptions options = base;
                    options.chunk_size = chunk;
                    // Any split with the carried state: [0, cut) then [cut, n).
                    const Index cut = n / 3;
                    LinearState<T> carried;
                    Matrix<T> chunked(n, dv);
                    chunked_gated_linear_attention(Q.topRows(cut), K.topRows(cut), V.topRows(cut), G.topRows(cut),
                                                   chunked.topRows(cut), options, &carried);
                    chunked_gated_linear_attention(Q.bottomRows(n - cut), K.bottomRows(n - cut), V.bottomRows(n - cut),
                                                   G.bottomRows(n - cut), chunked.bottomRows(n - cut), options,
                                                   &carried);
                    check_close(chunked, to_double(O), tol);
                    check_close(carried.mu, to_double(state.mu), tol);
                    check_close(carried.nu, to_double(state.nu), tol);
                }
              }
            }
        }
    }
}

TEMPLATE_TEST_CASE("Gated linear attention: gates near 0 forget, gates of exactly 1 are plain linear attention",
                   "[gated]", float, double) {
    using T = TestType;
    const Index n = 40, d = 4, dv = 3;
    const Matrix<T> Q = random_matrix<T>(n, d, 1).cwiseAbs(), K = random_matrix<T>(n, d, 2).cwiseAbs(),
                    V = random_matrix<T>(n, dv, 3);
    Matrix<T> O(n, dv), chunked(n, dv), plain(n, dv);
    // log g = −50: each token sees itself alone, o_i = q_i k_iᵀ v_i (to e^-50).
    const Matrix<T> forget = Matrix<T>::Constant(n, 1, T(-50));
    recurrent_gated_linear_attention(Q, K, V, forget, O, {.scale = 1.0});
    chunked_gated_linear_attention(Q, K, V, forget, chunked, {.chunk_size = 16, .scale = 1.0});
    MatrixD alone(n, dv);
    for (Index i = 0; i < n; ++i)
        alone.row(i) = double(Q.row(i).dot(K.row(i))) * to_double(V.row(i));
    check_close(O, alone, tolerance<T>());
    check_close(chunked, alone, tolerance<T>());
    REQUIRE(chunked.allFinite());
    // log g = 0: the recurrence of linear attention with φ = identity, no decay, its normaliser.
    const Matrix<T> keep = Matrix<T>::Zero(n, d);
    chunked_gated_linear_attention(Q, K, V, keep, O, {.chunk_size = 7, .scale = 1.0, .normalize = true});
    recurrent_linear_attention(Q, K, V, plain, Identity{});
    check_close(O, to_double(plain), tolerance<T>() * 10);
}

TEMPLATE_TEST_CASE("Delta rule: recurrent equals the double reference, chunked equals recurrent", "[delta]", float,
                   double) {
    using T = TestType;
    const double tol = tolerance<T>() * 20;
    for (const Index n : {0, 1, 7, 70, 200}) {
        for (const bool gated : {false, true}) {
            for (const bool l2 : {false, true}) {
                INFO("n = " << n << ", gated " << gated << ", qk_l2norm " << l2);
                const Index d = 6, dv = 4;
                const Matrix<T> Q = random_matrix<T>(n, d, 1), V = random_matrix<T>(n, dv, 3);
                // Unnormalised keys scaled so that β‖k‖² ≤ 2: the recurrence stays bounded.
                const Matrix<T> K = random_matrix<T>(n, d, 2, l2 ? 1.0 : 0.5);
                const Matrix<T> B = betas<T>(n, 4), G = log_gates<T>(n, 1, 5, 0.2);
                MatrixD S = MatrixD::Zero(d, dv);
                const MatrixD Gd = to_double(G);
                const MatrixD expected =
                    delta_reference(fla_rows(to_double(Q), l2, default_scale(d)), fla_rows(to_double(K), l2),
                                    to_double(V), to_double(B), gated ? &Gd : nullptr, S);
                Matrix<T> O(n, dv);
                LinearState<T> state;
                const DeltaOptions base{.qk_l2norm = l2};
                if (gated)
                    recurrent_delta_rule_attention(Q, K, V, B, G, O, base, &state);
                else
                    recurrent_delta_rule_attention(Q, K, V, B, O, base, &state);
                check_close(O, expected, tol);
                check_close(state.mu, S, tol);
                for (const Index chunk : {1, 7, 16, 64}) {
                    INFO("chunk " << chunk);
                    DeltaOptions options = base;
                    options.chunk_size = chunk;
                    const Index cut = (2 * n) / 5;
                    LinearState<T> carried;
                    Matrix<T> chunked(n, dv);
                    const auto run = [&](Index first, Index count) {
                        if (gated)
                            chunked_delta_rule_attention(Q.middleRows(first, count), K.middleRows(first, count),
                                                         V.middleRows(first, count), B.middleRows(first, count),
                                                         G.middleRows(first, count), chunked.middleRows(first, count),
                                                         options, &carried);
                        else
                            chunked_delta_rule_attention(Q.middleRows(first, count), K.middleRows(first, count),
                                                         V.middleRows(first, count), B.middleRows(first, count),
                                                         chunked.middleRows(first, count), options, &carried);
                    };
                    run(0, cut);
                    run(cut, n - cut);
                    check_close(chunked, to_double(O), tol);
                    check_close(carried.mu, to_double(state.mu), tol);
                }
            }
        }
    }
}

TEMPLATE_TEST_CASE("Delta rule: beta 0 leaves the state, beta 1 with unit keys overwrites exactly", "[delta]", float,
                   double) {
    using T = TestType;
    const Index n = 30, d = 8, dv = 5;
    const Matrix<T> Q = random_matrix<T>(n, d, 1), K = random_matrix<T>(n, d, 2), V = random_matrix<T>(n, dv, 3);
    for (const bool chunked : {false, true}) {
        INFO("chunked " << chunked);
        LinearState<T> state;
        Matrix<T> O(n, dv);
        const auto run = [&](const auto& q, const auto& k, const auto& v, const auto& b, auto&& o) {
            // ε = 0: exact unit keys (and queries), so that β = 1 overwrites exactly.
            const DeltaOptions options{.chunk_size = 7, .scale = 1.0, .qk_l2norm = true, .l2norm_eps = 0};
            if (chunked)
                chunked_delta_rule_attention(q, k, v, b, o, options, &state);
            else
                recurrent_delta_rule_attention(q, k, v, b, o, options, &state);
        };
        run(Q, K, V, betas<T>(n, 4), O);
        const Matrix<T> before = state.mu;
        run(Q, K, V, Matrix<T>::Zero(n, 1), O);  // β = 0: nothing is written
        CHECK(state.mu.isApprox(before, T(10) * std::numeric_limits<T>::epsilon()));
        check_close(O, fla_rows(to_double(Q), true, 1.0, 0.0) * to_double(before), tolerance<T>());
        // β = 1: the key now reads back exactly its value, whatever the state held.
        const Matrix<T> k = unit_rows<T>(random_matrix<T>(1, d, 9)), v = random_matrix<T>(1, dv, 10);
        Matrix<T> o(1, dv);
        run(k, k, v, Matrix<T>::Ones(1, 1), o);
        check_close(o, to_double(v), tolerance<T>() * 10);
        check_close(k * state.mu, to_double(v), tolerance<T>() * 10);
    }
}

TEST_CASE("Gated and delta kernels: 10^6 tokens in float stay within 1e-3 of double", "[gated][delta][long]") {
    const Index n = memattn::test::memory_only ? 20000 : 1000000, d = 4, dv = 4;
    const Matrix<float> Q = random_matrix<float>(n, d, 1).cwiseAbs(), K = random_matrix<float>(n, d, 2).cwiseAbs();
    const Matrix<float> V = random_matrix<float>(n, dv, 3), G = log_gates<float>(n, 1, 4, 0.02);
    const Matrix<double> Qd = Q.cast<double>(), Kd = K.cast<double>(), Vd = V.cast<double>(), Gd = G.cast<double>();
    Matrix<float> O(n, dv);
    Matrix<double> Od(n, dv);
    chunked_gated_linear_attention(Q, K, V, G, O, {.chunk_size = 64});
    recurrent_gated_linear_attention(Qd, Kd, Vd, Gd, Od);
    CHECK((O.cast<double>() - Od).cwiseAbs().maxCoeff() <= 1e-3 * std::max(1.0, Od.cwiseAbs().maxCoeff()));
    recurrent_gated_linear_attention(Q, K, V, G, O);
    CHECK((O.cast<double>() - Od).cwiseAbs().maxCoeff() <= 1e-3 * std::max(1.0, Od.cwiseAbs().maxCoeff()));
    const Matrix<float> B = betas<float>(n, 5);
    const Matrix<double> Bd = B.cast<double>();
    recurrent_delta_rule_attention(Qd, Kd, Vd, Bd, Od, {.qk_l2norm = true});
    chunked_delta_rule_attention(Q, K, V, B, O, {.qk_l2norm = true});
    CHECK((O.cast<double>() - Od).cwiseAbs().maxCoeff() <= 1e-3 * std::max(1.0, Od.cwiseAbs().maxCoeff()));
    recurrent_delta_rule_attention(Q, K, V, B, O, {.qk_l2norm = true});
    CHECK((O.cast<double>() - Od).cwiseAbs().maxCoeff() <= 1e-3 * std::max(1.0, Od.cwiseAbs().maxCoeff()));
}

TEMPLATE_TEST_CASE("Gated and delta memories: decode and prefill equal the kernels; bad gates change nothing",
                   "[gated][delta][memory]", float, double) {
    using T = TestType;
    const Index n = 50, d = 6, dv = 4;
    const Matrix<T> Q = random_matrix<T>(n, d, 1).cwiseAbs(), K = random_matrix<T>(n, d, 2).cwiseAbs() * T(0.5);
    const Matrix<T> V = random_matrix<T>(n, dv, 3), B = betas<T>(n, 4), G1 = log_gates<T>(n, 1, 5),
                    Gd = log_gates<T>(n, d, 6);
    const auto check_memory = [&](auto make, const Matrix<T>& keys, const Matrix<T>& expected) {
        auto decoded = make(), prefilled = make(), split = make();
        Matrix<T> O(n, dv);
        decode(decoded, Q, keys, V, O);
        check_close(O, to_double(expected), tolerance<T>() * 10);
        prefill(prefilled, Q, keys, V, O);
        check_close(O, to_double(expected), tolerance<T>() * 10);
        const Index cut = 17;
        memattn::extend(split, keys.topRows(cut), V.topRows(cut));
        prefill(split, Q.bottomRows(n - cut), keys.bottomRows(n - cut), V.bottomRows(n - cut), O.bottomRows(n - cut));
        check_close(O.bottomRows(n - cut), to_double(expected.bottomRows(n - cut)), tolerance<T>() * 10);
        CHECK(split.length() == n);
        // A bad gate (positive log-gate, β outside [0, 1]) throws and changes nothing.
        Matrix<T> bad = keys.topRows(1);
        bad(0, bad.cols() - 1) = T(0.5);
        if (bad.cols() == d + 1 && std::is_same_v<decltype(make()), DeltaRuleMemory<T>>)
            bad(0, d) = T(1.5);
        std::ostringstream before;
        save(decoded, before);
        CHECK_THROWS_AS(decoded.update(bad.row(0), V.row(0)), std::invalid_argument);
        Matrix<T> o1(1, dv);
        CHECK_THROWS_AS(prefill(decoded, Q.topRows(1), bad, V.topRows(1), o1), std::invalid_argument);
        std::ostringstream after;
        save(decoded, after);
        CHECK(before.str() == after.str());
        // and a snapshot resumes it exactly
        auto resumed = make();
        std::istringstream in(before.str());
        load(resumed, in);
        Vector<T> a(dv), b(dv);
        decoded.attend(Q.row(0), a);
        resumed.attend(Q.row(0), b);
        CHECK(a == b);
    };
    Matrix<T> expected(n, dv);
    recurrent_gated_linear_attention(Q, K, V, G1, expected);
    Matrix<T> keys(n, d + 1);
    keys << K, G1;
    check_memory([&] { return GatedLinearAttentionMemory<T>(d, dv); }, keys, expected);
    recurrent_gated_linear_attention(Q, K, V, Gd, expected, {.normalize = false});
    Matrix<T> channel_keys(n, 2 * d);
    channel_keys << K, Gd;
    check_memory([&] { return GatedLinearAttentionMemory<T>(d, dv, GateKind::channel, {.normalize = false}); },
                 channel_keys, expected);
    recurrent_delta_rule_attention(Q, K, V, B, expected, {.chunk_size = 16, .qk_l2norm = true});
    keys << K, B;
    check_memory([&] { return DeltaRuleMemory<T>(d, dv, {.chunk_size = 16, .qk_l2norm = true}); }, keys, expected);
    recurrent_delta_rule_attention(Q, K, V, B, G1, expected);
    Matrix<T> gated_keys(n, d + 2);
    gated_keys << K, B, G1;
    check_memory([&] { return DeltaRuleMemory<T>(d, dv, {.chunk_size = 5}, true); }, gated_keys, expected);
    static_assert(Memory<DeltaRuleMemory<T>> && Snapshottable<GatedLinearAttentionMemory<T>>);
}

TEMPLATE_TEST_CASE("Delta-rule and KDA memories: a decode step in one pass (update_attend) equals update then "
                   "attend, bit for bit, for groups of queries, widths off every packet, resets",
                   "[delta][kda][memory]", float, double) {
    using T = TestType;
    static_assert(DeltaRuleMemory<T>::fuses_step() && KdaMemory<T>::fuses_step());
    static_assert(DeltaRuleMemory<T>::folds_copy() && KdaMemory<T>::folds_copy());
    static_assert(!GatedLinearAttentionMemory<T>::folds_copy() && !Rwkv7Memory<T>::folds_copy());
    static_assert(!GatedLinearAttentionMemory<T>::fuses_step() && !Rwkv7Memory<T>::fuses_step());
    const Index n = 12;
    // dv: one lane, whole panels, and every count of packets left over (1–3) with lanes
    // after them, for packets of 2, 4, 8 and 16 lanes.
    for (const auto& shape : std::vector<std::pair<Index, Index>>{
             {1, 1}, {6, 4}, {16, 37}, {9, 27}, {5, 55}, {67, 67}, {3, 101}, {128, 128}})
        for (const int variant : {0, 1, 2}) {  // the delta rule (qk_l2norm), gated, KDA
            const Index d = shape.first, dv = shape.second;
            INFO("d = " << d << ", dv = " << dv << ", variant " << variant);
            const auto make = [&]() -> DeltaRuleMemory<T> {
                if (variant == 2)
                    return KdaMemory<T>(d, dv);
                return DeltaRuleMemory<T>(d, dv, {.qk_l2norm = variant == 0}, variant == 1);
            };
            DeltaRuleMemory<T> plain = make(), fused = make();
            const Index gates = variant == 0 ? 0 : variant == 1 ? 1 : d;
            Matrix<T> keys(n, d + 1 + gates);
            keys.leftCols(d) = random_matrix<T>(n, d, 21);
            keys.col(d) = betas<T>(n, 22);
            if (gates > 0)
                keys.rightCols(gates) = log_gates<T>(n, gates, 23);
            if (gates > 0)  // resets (KDA: of one row) in fused steps of three queries and of one
                keys(2, d + 1) = keys(6, d + 1) = -std::numeric_limits<T>::infinity();
            const Matrix<T> V = random_matrix<T>(n, dv, 24), Q = random_matrix<T>(6 * n, d, 25);
            for (Index t = 0; t < n; ++t) {
                const Index g = 1 + t % 6;  // 5 and 6: more rows than one pass takes
                const Matrix<T> q = Q.middleRows(6 * t, g);
                Matrix<T> expected(g, dv), out(g, dv);
                plain.update(keys.row(t), V.row(t));
                plain.attend_group(q, expected);
                fused.update_attend_group(keys.row(t), V.row(t), q, out);
                CHECK((out.array() == expected.array()).all());
                CHECK((fused.state().array() == plain.state().array()).all());
                CHECK(fused.length() == plain.length());
                // One query, as attend: a copy steps the next token both ways.
                if (t + 1 < n) {
                    DeltaRuleMemory<T> a = plain, b = plain;
                    Vector<T> one(dv), alone(dv);
                    a.update(keys.row(t + 1), V.row(t + 1));
                    a.attend(q.row(0), alone);
                    b.update_attend(keys.row(t + 1), V.row(t + 1), q.row(0), one);
                    CHECK((one.array() == alone.array()).all());
                    // The copy folded into the step (assign_update_attend_group: S read from
                    // the source, written into another memory): the same bits, the source
                    // untouched.
                    DeltaRuleMemory<T> c = make();
                    Matrix<T> folded(g, dv), stepped(g, dv);
                    const Matrix<T> source_state = plain.state();
                    c.assign_update_attend_group(plain, keys.row(t + 1), V.row(t + 1), q, folded);
                    DeltaRuleMemory<T> e = plain;
                    e.update_attend_group(keys.row(t + 1), V.row(t + 1), q, stepped);
                    CHECK((folded.array() == stepped.array()).all());
                    CHECK((c.state().array() == e.state().array()).all());
                    CHECK(c.length() == e.length());
                    CHECK((plain.state().array() == source_state.array()).all());
                    c.assign_update_attend(plain, keys.row(t + 1), V.row(t + 1), q.row(0), one);
                    CHECK((one.array() == alone.array()).all());
                }
            }
            // No queries: the update alone.
            {
                DeltaRuleMemory<T> a = plain, b = plain;
                Matrix<T> none(0, dv);
                a.update(keys.row(0), V.row(0));
                b.update_attend_group(keys.row(0), V.row(0), Q.topRows(0), none);
                CHECK((a.state().array() == b.state().array()).all());
            }
            // Bad input to the fused step: refused by name, nothing changed.
            Matrix<T> out(1, dv);
            Matrix<T> shared = Matrix<T>::Zero(1, std::max(d, dv));  // out over the query
            CHECK_THROWS_WITH(fused.update_attend_group(keys.row(0), V.row(0), shared.leftCols(d), shared.leftCols(dv)),
                              Catch::Contains("out"));
            Matrix<T> bad = keys.topRows(1);
            bad(0, d) = T(1.5);  // β outside [0, 1]
            const Matrix<T> before = fused.state();
            CHECK_THROWS_AS(fused.update_attend_group(bad.row(0), V.row(0), Q.topRows(1), out), std::invalid_argument);
            CHECK_THROWS_AS(fused.update_attend_group(keys.row(0), V.row(0), Q.topRows(2), out), std::invalid_argument);
            CHECK((fused.state().array() == before.array()).all());
            CHECK(fused.length() == n);
            // ... and to the copy folded into it: a bad value or a source of another shape
            // is refused with the memory unchanged.
            DeltaRuleMemory<T> target = make();
            CHECK_THROWS_AS(target.assign_update_attend_group(fused, bad.row(0), V.row(0), Q.topRows(1), out),
                            std::invalid_argument);
            CHECK(target.length() == 0);
            if (variant == 0) {
                const DeltaRuleMemory<T> other(d + 1, dv);
                CHECK_THROWS_WITH(target.assign_update_attend_group(other, keys.row(0), V.row(0), Q.topRows(1), out),
                                  Catch::Contains("source"));
            }
        }
    // A reset clears a state that is not finite (a value of ∞ fed before), fused or not.
    {
        DeltaRuleMemory<T> plain(4, 3, {}, true), fused(4, 3, {}, true);
        Matrix<T> key = Matrix<T>::Constant(1, 6, T(0.5)), value = Matrix<T>::Constant(1, 3, T(1));
        value(0, 1) = std::numeric_limits<T>::infinity();
        key(0, 5) = T(-0.5);
        plain.update(key.row(0), value.row(0));
        fused.update(key.row(0), value.row(0));
        CHECK(!plain.state().allFinite());
        key(0, 5) = -std::numeric_limits<T>::infinity();
        value(0, 1) = T(2);
        const Matrix<T> q = Matrix<T>::Constant(2, 4, T(0.25));
        Matrix<T> expected(2, 3), out(2, 3);
        plain.update(key.row(0), value.row(0));
        plain.attend_group(q, expected);
        fused.update_attend_group(key.row(0), value.row(0), q, out);
        CHECK(fused.state().allFinite());
        CHECK((fused.state().array() == plain.state().array()).all());
        CHECK((out.array() == expected.array()).all());
    }
    // MultiHead of them: GQA groups of 2, 3 (fused) and 5 (a pass, then the product), KDA
    // heads, and gated linear attention heads (an update, then an attend); through
    // MultiHead::update_attend and memattn::decode, against update then attend.
    const auto check_layer = [&](auto make, const HeadLayout& layout, Index extra) {
        auto plain = make(layout), fused = make(layout), decoded = make(layout);
        Matrix<T> keys(n, plain.key_dim());
        const Index width = plain.key_dim() / layout.kv_heads;
        for (Index h = 0; h < layout.kv_heads; ++h) {
            keys.middleCols(h * width, 16) = random_matrix<T>(n, 16, 31 + static_cast<std::uint64_t>(h));
            if (extra > 0) {  // β, then the log-gates
                keys.col(h * width + 16) = betas<T>(n, 40 + static_cast<std::uint64_t>(h));
                keys.middleCols(h * width + 17, extra - 1) = log_gates<T>(n, extra - 1, 50 + static_cast<std::uint64_t>(h));
            } else {
                keys.middleCols(h * width + 16, width - 16) = log_gates<T>(n, width - 16, 60 + static_cast<std::uint64_t>(h));
            }
        }
        const Matrix<T> V = random_matrix<T>(n, plain.value_dim(), 36), Q = random_matrix<T>(n, plain.query_dim(), 37);
        Matrix<T> expected(n, plain.output_dim()), out(n, plain.output_dim()), through(n, plain.output_dim()),
            folded(1, plain.output_dim());
        auto target = make(layout);
        for (Index t = 0; t < n; ++t) {
            // The step folded with a copy of the layer (MultiHead::assign_update_attend),
            // through the dispatcher StatePool's verify step takes: the same bits.
            detail::assign_update_attend<decltype(target), T>(target, plain, keys.row(t), V.row(t), Q.row(t),
                                                              folded.row(0));
            plain.update(keys.row(t), V.row(t));
            plain.attend(Q.row(t), expected.row(t));
            fused.update_attend(keys.row(t), V.row(t), Q.row(t), out.row(t));
            CHECK((folded.row(0).array() == expected.row(t).array()).all());
            CHECK(target.length() == plain.length());
        }
        decode(decoded, Q, keys, V, through);
        CHECK((out.array() == expected.array()).all());
        CHECK((through.array() == expected.array()).all());
    };
    for (const HeadLayout& layout : {HeadLayout{4, 2, 16, 0}, HeadLayout{6, 2, 16, 0}, HeadLayout{10, 2, 16, 0}}) {
        INFO(layout.q_heads << " query heads over " << layout.kv_heads);
        check_layer([](const HeadLayout& l) {
            return MultiHead<DeltaRuleMemory<T>>(l, [](Index) { return DeltaRuleMemory<T>(16, 16, {.qk_l2norm = true}, true); });
        }, layout, 2);
        check_layer([](const HeadLayout& l) {
            return MultiHead<KdaMemory<T>>(l, [](Index) { return KdaMemory<T>(16, 16); });
        }, layout, 17);
        check_layer([](const HeadLayout& l) {
            return MultiHead<GatedLinearAttentionMemory<T>>(l, [](Index) { return GatedLinearAttentionMemory<T>(16, 16); });
        }, layout, 0);
    }
    // The recurrent kernel is the memory's decode, bit for bit (the same pass, the same factor).
    const Matrix<T> Qk = random_matrix<T>(n, 24, 70), Kk = random_matrix<T>(n, 24, 71), Vk = random_matrix<T>(n, 20, 72),
                    Bk = betas<T>(n, 73), Gk = log_gates<T>(n, 1, 74);
    Matrix<T> kernel(n, 20), memory(n, 20), gated_keys(n, 26);
    gated_keys << Kk, Bk, Gk;
    recurrent_delta_rule_attention(Qk, Kk, Vk, Bk, Gk, kernel);
    DeltaRuleMemory<T> gated(24, 20, {}, true);
    decode(gated, Qk, gated_keys, Vk, memory);
    CHECK((kernel.array() == memory.array()).all());
}

TEST_CASE("Gated and delta kernels: bad input names the function, the argument and the shapes", "[gated][delta]") {
    const Matrix<float> Q = Matrix<float>::Zero(5, 3), V = Matrix<float>::Zero(5, 2);
    Matrix<float> O(5, 2), G = Matrix<float>::Zero(5, 1);
    G(2, 0) = 0.5f;
    CHECK_THROWS_WITH(chunked_gated_linear_attention(Q, Q, V, G, O),
                      Catch::Matchers::Contains("chunked_gated_linear_attention") &&
                          Catch::Matchers::Contains("log_gates") && Catch::Matchers::Contains("0.5"));
    CHECK_THROWS_WITH(recurrent_gated_linear_attention(Q, Q, V, Matrix<float>::Zero(5, 2), O),
                      Catch::Matchers::Contains("expected 5x1 (a gate per token) or 5x3"));
    CHECK_THROWS_WITH(chunked_gated_linear_attention(Q, Q, V, Matrix<float>::Zero(5, 1), O, {.eps = -1}),
                      Catch::Matchers::Contains("options.eps"));
    CHECK_THROWS_WITH(chunked_delta_rule_attention(Q, Q, V, Matrix<float>::Constant(5, 1, 2.f), O),
                      Catch::Matchers::Contains("beta") && Catch::Matchers::Contains("expected a value in [0, 1]"));
    CHECK_THROWS_WITH(recurrent_delta_rule_attention(Q, Q, V, Matrix<float>::Zero(4, 1), O),
                      Catch::Matchers::Contains("expected 5x1"));
    CHECK_THROWS_AS(chunked_delta_rule_attention(Q, Q, V, Matrix<float>::Zero(5, 1), O, {.chunk_size = 0}),
                    std::invalid_argument);
}

TEST_CASE("Gated and delta memories in a MultiHead layer: gates per head", "[gated][delta][multihead]") {
    const Index d = 4, dv = 3, n = 20;
    const HeadLayout layout{.q_heads = 4, .kv_heads = 2, .head_dim = d, .value_dim = dv};
    // Packed key rows: per KV head [k | β | log g].
    const Matrix<float> Q = random_matrix<float>(n, 4 * d, 1);
    Matrix<float> keys(n, 2 * (d + 2));
    for (Index h = 0; h < 2; ++h)
        keys.middleCols(h * (d + 2), d + 2) << random_matrix<float>(n, d, 2 + h), betas<float>(n, 4 + h),
            log_gates<float>(n, 1, 6 + h);
    const Matrix<float> V = random_matrix<float>(n, 2 * dv, 8);
    MultiHead<DeltaRuleMemory<float>> layer(layout, [](Index) {
        return DeltaRuleMemory<float>(d, dv, {.qk_l2norm = true}, true);
    });
    CHECK(layer.key_dim() == 2 * (d + 2));
    Matrix<float> O(n, 4 * dv), by_prefill(n, 4 * dv);
    decode(layer, Q, keys, V, O);
    auto other = MultiHead<DeltaRuleMemory<float>>(layout, [](Index) {
        return DeltaRuleMemory<float>(d, dv, {.qk_l2norm = true}, true);
    });
    prefill(other, Q, keys, V, by_prefill);
    check_close(by_prefill, to_double(O), 1e-5);
    for (Index h = 0; h < 4; ++h) {
        const Index kv = h / 2;
        DeltaRuleMemory<float> head(d, dv, {.qk_l2norm = true}, true);
        Matrix<float> expected(n, dv);
        decode(head, Q.middleCols(h * d, d), keys.middleCols(kv * (d + 2), d + 2), V.middleCols(kv * dv, dv),
               expected);
        check_close(O.middleCols(h * dv, dv), to_double(expected), 1e-5);
    }
    MultiHead<GatedLinearAttentionMemory<float>> gated(
        {.q_heads = 2, .kv_heads = 2, .head_dim = d, .value_dim = dv},
        [](Index) { return GatedLinearAttentionMemory<float>(d, dv, GateKind::channel); });
    CHECK(gated.key_dim() == 2 * 2 * d);
    CHECK_THROWS_WITH((MultiHead<DeltaRuleMemory<float>>(layout, [](Index h) { return DeltaRuleMemory<float>(d, dv, {}, h == 1); })),
                      Catch::Matchers::Contains("has key_dim 6, expected 5 as make(0)"));
}

// ------------------------------------------------ bfloat16 and float16 inputs (§4.7c)

namespace {

template <class T>
bool same_bits(const Eigen::MatrixBase<T>& a, const Eigen::MatrixBase<T>& b) {
    return a.rows() == b.rows() && a.cols() == b.cols() && (a.array() == b.array()).all();
}

}  // namespace

TEMPLATE_TEST_CASE("Gated and delta kernels on bfloat16 and float16 equal the float kernels on the same inputs, bit "
                   "for bit, state carried",
                   "[gated][delta][low_precision]", Eigen::bfloat16, Eigen::half) {
    using E = TestType;
    // Lengths around the spans (256 rows for chunks of 16, 252 for chunks of 7), an
    // initial state, gates and beta of float and of the 16-bit type.
    const Index n = GENERATE(Index(0), Index(1), Index(251), Index(256), Index(257), Index(600));
    const Index chunk = GENERATE(Index(16), Index(7));
    const Index d = 12, dv = 9;
    CAPTURE(n, chunk);
    const Matrix<float> Qf = random_matrix<float>(n, d, 1), Kf = random_matrix<float>(n, d, 2),
                        Vf = random_matrix<float>(n, dv, 3);
    const Matrix<E> Q = Qf.cast<E>(), K = (0.3f * Kf).cast<E>(), V = Vf.cast<E>();
    const Matrix<float> q = Q.template cast<float>(), k = K.template cast<float>(), v = V.template cast<float>();
    Matrix<float> gates = -0.2f * random_matrix<float>(n, d, 4).cwiseAbs(), gate = gates.col(0);
    const Matrix<E> gates16 = gates.cast<E>();
    const Matrix<float> gates_e = gates16.template cast<float>();
    Matrix<float> beta = random_matrix<float>(n, 1, 5).cwiseAbs();
    const Matrix<E> beta16 = beta.cast<E>();
    const Matrix<float> beta_e = beta16.template cast<float>();
    LinearState<float> start;
    start.mu = random_matrix<float>(d, dv, 6);
    start.nu = random_matrix<float>(1, d, 7).cwiseAbs();
    const GatedOptions lo{.chunk_size = chunk, .qk_l2norm = true};
    const DeltaOptions deltas{.chunk_size = chunk, .qk_l2norm = true};

    // Each call: 16-bit inputs with float O, with 16-bit O, against the float twin.
    const auto check = [&](auto low, auto twin) {
        LinearState<float> s16 = start, s32 = start, s16b = start;
        Matrix<float> O16(n, dv), O32(n, dv);
        Matrix<E> Ob(n, dv);
        low(O16, s16);
        low(Ob, s16b);
        twin(O32, s32);
        CHECK(same_bits(O16, O32));
        CHECK(same_bits(Ob, Matrix<E>(O32.cast<E>())));
        CHECK(same_bits(s16.mu, s32.mu));
        CHECK(same_bits(s16.nu, s32.nu));
        CHECK(same_bits(s16b.mu, s32.mu));
    };
    SECTION("gated linear attention, channel gates of the 16-bit type, chunked and recurrent") {
        check([&](auto& O, LinearState<float>& s) { chunked_gated_linear_attention(Q, K, V, gates16, O, lo, &s); },
              [&](auto& O, LinearState<float>& s) { chunked_gated_linear_attention(q, k, v, gates_e, O, lo, &s); });
        check([&](auto& O, LinearState<float>& s) { recurrent_gated_linear_attention(Q, K, V, gates16, O, lo, &s); },
              [&](auto& O, LinearState<float>& s) { recurrent_gated_linear_attention(q, k, v, gates_e, O, lo, &s); });
    }
    SECTION("gated linear attention, scalar gates of float") {
        check([&](auto& O, LinearState<float>& s) { chunked_gated_linear_attention(Q, K, V, gate, O, lo, &s); },
              [&](auto& O, LinearState<float>& s) { chunked_gated_linear_attention(q, k, v, gate, O, lo, &s); });
    }
    SECTION("the delta rule, beta of the 16-bit type; the gated delta rule, beta and gates of float") {
        check([&](auto& O, LinearState<float>& s) { chunked_delta_rule_attention(Q, K, V, beta16, O, deltas, &s); },
              [&](auto& O, LinearState<float>& s) { chunked_delta_rule_attention(q, k, v, beta_e, O, deltas, &s); });
        check([&](auto& O, LinearState<float>& s) { recurrent_delta_rule_attention(Q, K, V, beta16, O, deltas, &s); },
              [&](auto& O, LinearState<float>& s) { recurrent_delta_rule_attention(q, k, v, beta_e, O, deltas, &s); });
        check([&](auto& O, LinearState<float>& s) { chunked_delta_rule_attention(Q, K, V, beta, gate, O, deltas, &s); },
              [&](auto& O, LinearState<float>& s) { chunked_delta_rule_attention(q, k, v, beta, gate, O, deltas, &s); });
    }
    SECTION("RWKV-7, all six inputs of the 16-bit type, chunked and recurrent") {
        const Matrix<E> A = (-0.3f * Kf).cast<E>(), B = (0.2f * Vf.leftCols(1).replicate(1, d)).cast<E>();
        const Matrix<float> a = A.template cast<float>(), b = B.template cast<float>();
        const Rwkv7Options r7{.chunk_size = chunk, .scale = 0.5};
        check([&](auto& O, LinearState<float>& s) { chunked_rwkv7_attention(Q, K, V, A, B, gates16, O, r7, &s); },
              [&](auto& O, LinearState<float>& s) { chunked_rwkv7_attention(q, k, v, a, b, gates_e, O, r7, &s); });
        check([&](auto& O, LinearState<float>& s) { recurrent_rwkv7_attention(Q, K, V, A, B, gates16, O, r7, &s); },
              [&](auto& O, LinearState<float>& s) { recurrent_rwkv7_attention(q, k, v, a, b, gates_e, O, r7, &s); });
    }
}

TEST_CASE("Gated and delta kernels on bfloat16: bad gates and beta throw before anything is written",
          "[gated][delta][low_precision]") {
    const Index n = 300, d = 8;
    const Matrix<Eigen::bfloat16> X = random_matrix<float>(n, d, 1).cast<Eigen::bfloat16>();
    Matrix<Eigen::bfloat16> gates = Matrix<Eigen::bfloat16>::Constant(n, 1, Eigen::bfloat16(-0.5f));
    gates(280, 0) = Eigen::bfloat16(0.25f);  // a positive log-gate, in the second span
    Matrix<float> beta = Matrix<float>::Constant(n, 1, 0.5f);
    Matrix<float> O = Matrix<float>::Constant(n, d, 7.0f);
    LinearState<float> state;
    REQUIRE_THROWS_WITH(chunked_gated_linear_attention(X, X, X, gates, O, {}, &state),
                        Catch::Matchers::Contains("chunked_gated_linear_attention") &&
                            Catch::Matchers::Contains("log_gates") && Catch::Matchers::Contains("(280, 0)"));
    beta(290, 0) = 1.5f;
    REQUIRE_THROWS_WITH(chunked_delta_rule_attention(X, X, X, beta, O, {}, &state),
                        Catch::Matchers::Contains("beta") && Catch::Matchers::Contains("row 290"));
    CHECK((O.array() == 7.0f).all());
    CHECK(state.mu.size() == 0);
}

namespace {

/// Log-gates with −∞ (resets) at the given rows: every channel, or one in two.
template <class T>
Matrix<T> with_resets(Matrix<T> G, std::initializer_list<Index> rows) {
    for (const Index r : rows)
        if (r < G.rows())
            for (Index c = 0; c < G.cols(); c += G.cols() == 1 ? 1 : 2)
                G(r, c) = -std::numeric_limits<T>::infinity();
    return G;
}

}  // namespace

TEMPLATE_TEST_CASE("Gated and delta kernels: a log-gate of -inf resets the state exactly, chunk boundaries anywhere",
                   "[gated][delta][reset]", float, double) {
    using T = TestType;
    const double tol = tolerance<T>() * 20;
    const Index n = 70, d = 5, dv = 3;
    const Matrix<T> Q = random_matrix<T>(n, d, 1).cwiseAbs(), K = random_matrix<T>(n, d, 2).cwiseAbs() * T(0.5),
                    V = random_matrix<T>(n, dv, 3), B = betas<T>(n, 4);
    // Resets on a chunk's first token (0, 16, 64 for chunks of 16), inside chunks, twice in a row, last.
    const std::initializer_list<Index> resets = {0, 5, 16, 17, 40, 64, 69};
    for (const Index gate_cols : {Index(1), d}) {
        const Matrix<T> G = with_resets(log_gates<T>(n, gate_cols, 5, 0.2), resets);
        for (const bool normalize : {false, true}) {
            INFO("gate columns " << gate_cols << ", normalize " << normalize);
            MatrixD S = MatrixD::Zero(d, dv), z = MatrixD::Zero(1, d);
            const MatrixD expected = gated_reference(fla_rows(to_double(Q), false, default_scale(d)), to_double(K),
                                                     to_double(V), to_double(G), normalize, 1e-6, S, z);
            REQUIRE(expected.allFinite());
            Matrix<T> O(n, dv);
            LinearState<T> state;
            recurrent_gated_linear_attention(Q, K, V, G, O, {.normalize = normalize}, &state);
            check_close(O, expected, tol);
            check_close(state.mu, S, tol);
            for (const Index chunk : {1, 7, 16, 64}) {
                INFO("chunk " << chunk);
                LinearState<T> chunked_state;
                Matrix<T> chunked(n, dv);
                chunked_gated_linear_attention(Q, K, V, G, chunked, {.chunk_size = chunk, .normalize = normalize},
                                               &chunked_state);
                check_close(chunked, expected, tol);
                check_close(chunked_state.mu, S, tol);
                check_close(chunked_state.nu, z, tol);
            }
        }
        // A reset forgets even a state that is not finite: 0, not 0·∞ = NaN. From token 40
        // on, a reset first in every channel: the poisoned state's outputs are a fresh one's.
        const Index m = n - 40;
        const Matrix<T> gates = with_resets(Matrix<T>(G.bottomRows(m).leftCols(1).replicate(1, gate_cols)), {0});
        for (const bool chunked : {false, true}) {
            INFO("from a state of infinities, chunked " << chunked);
            LinearState<T> poisoned{Matrix<T>::Constant(d, dv, std::numeric_limits<T>::infinity()),
                                    Vector<T>::Constant(d, std::numeric_limits<T>::infinity())};
            LinearState<T> fresh;
            Matrix<T> a(m, dv), b(m, dv);
            if (chunked) {
                chunked_gated_linear_attention(Q.bottomRows(m), K.bottomRows(m), V.bottomRows(m), gates, a,
                                               {.chunk_size = 16}, &poisoned);
                chunked_gated_linear_attention(Q.bottomRows(m), K.bottomRows(m), V.bottomRows(m), gates, b,
                                               {.chunk_size = 16}, &fresh);
            } else {
                recurrent_gated_linear_attention(Q.bottomRows(m), K.bottomRows(m), V.bottomRows(m), gates, a, {},
                                                 &poisoned);
                recurrent_gated_linear_attention(Q.bottomRows(m), K.bottomRows(m), V.bottomRows(m), gates, b, {},
                                                 &fresh);
            }
            CHECK(a.allFinite());
            CHECK(a.cwiseEqual(b).all());
        }
    }
    // The gated delta rule: the same resets.
    const Matrix<T> G = with_resets(log_gates<T>(n, 1, 6, 0.2), resets);
    MatrixD S = MatrixD::Zero(d, dv);
    const MatrixD Gd = to_double(G);
    const MatrixD expected = delta_reference(fla_rows(to_double(Q), true, default_scale(d)), fla_rows(to_double(K), true),
                                             to_double(V), to_double(B), &Gd, S);
    REQUIRE(expected.allFinite());
    Matrix<T> O(n, dv);
    recurrent_delta_rule_attention(Q, K, V, B, G, O, {.qk_l2norm = true});
    check_close(O, expected, tol);
    for (const Index chunk : {1, 7, 16, 64}) {
        INFO("delta, chunk " << chunk);
        LinearState<T> state{Matrix<T>::Constant(d, dv, std::numeric_limits<T>::infinity()), {}};  // row 0 resets it
        chunked_delta_rule_attention(Q, K, V, B, G, O, {.chunk_size = chunk, .qk_l2norm = true}, &state);
        check_close(O, expected, tol);
        check_close(state.mu, S, tol);
    }
    // NaN and +inf are still refused, naming the place.
    for (const T bad : {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity()}) {
        Matrix<T> wrong = G;
        wrong(3, 0) = bad;
        CHECK_THROWS_WITH(chunked_gated_linear_attention(Q, K, V, wrong, O),
                          Catch::Matchers::Contains("log_gates") && Catch::Matchers::Contains("at (3, 0)"));
        CHECK_THROWS_WITH(recurrent_delta_rule_attention(Q, K, V, B, wrong, O),
                          Catch::Matchers::Contains("log_gates") && Catch::Matchers::Contains("at row 3"));
    }
}

TEMPLATE_TEST_CASE("Delta rule: beta in [0, 2] with allow_negative_eigenvalues", "[delta]", float, double) {
    using T = TestType;
    const double tol = tolerance<T>() * 20;
    const Index n = 60, d = 6, dv = 4;
    const Matrix<T> Q = random_matrix<T>(n, d, 1), K = random_matrix<T>(n, d, 2), V = random_matrix<T>(n, dv, 3);
    const Matrix<T> B = T(2) * betas<T>(n, 4), G = log_gates<T>(n, 1, 5, 0.2);
    for (const bool gated : {false, true}) {
        INFO("gated " << gated);
        MatrixD S = MatrixD::Zero(d, dv);
        const MatrixD Gd = to_double(G);
        const MatrixD expected = delta_reference(fla_rows(to_double(Q), true, default_scale(d)),
                                                 fla_rows(to_double(K), true), to_double(V), to_double(B),
                                                 gated ? &Gd : nullptr, S);
        const DeltaOptions options{.qk_l2norm = true, .allow_negative_eigenvalues = true};
        for (const Index chunk : {1, 7, 16}) {
            DeltaOptions chunked = options;
            chunked.chunk_size = chunk;
            Matrix<T> O(n, dv), R(n, dv);
            if (gated) {
                recurrent_delta_rule_attention(Q, K, V, B, G, R, options);
                chunked_delta_rule_attention(Q, K, V, B, G, O, chunked);
            } else {
                recurrent_delta_rule_attention(Q, K, V, B, R, options);
                chunked_delta_rule_attention(Q, K, V, B, O, chunked);
            }
            check_close(R, expected, tol);
            check_close(O, expected, tol);
        }
    }
    Matrix<T> O(n, dv);
    CHECK_THROWS_WITH(chunked_delta_rule_attention(Q, K, V, B, O, {.qk_l2norm = true}),
                      Catch::Matchers::Contains("expected a value in [0, 1]"));
    Matrix<T> over = B;
    over(7, 0) = T(2.5);
    CHECK_THROWS_WITH(chunked_delta_rule_attention(Q, K, V, over, O, {.allow_negative_eigenvalues = true}),
                      Catch::Matchers::Contains("expected a value in [0, 2] (options.allow_negative_eigenvalues)"));
    // The memory takes β up to 2 with the option, and refuses 2.5, unchanged.
    DeltaRuleMemory<T> memory(d, dv, {.qk_l2norm = true, .allow_negative_eigenvalues = true});
    Matrix<T> keys(n, d + 1);
    keys << K, B;
    Matrix<T> decoded(n, dv);
    decode(memory, Q, keys, V, decoded);
    MatrixD S = MatrixD::Zero(d, dv);
    check_close(decoded,
                delta_reference(fla_rows(to_double(Q), true, default_scale(d)), fla_rows(to_double(K), true),
                                to_double(V), to_double(B), nullptr, S),
                tol);
    Matrix<T> bad = keys.topRows(1);
    bad(0, d) = T(2.5);
    CHECK_THROWS_WITH(memory.update(bad.row(0), V.row(0)), Catch::Matchers::Contains("expected a value in [0, 2]"));
    CHECK(memory.length() == n);
}

TEMPLATE_TEST_CASE("Gated and delta memories: -inf log-gates reset; set_state resumes from a given state",
                   "[gated][delta][memory][reset]", float, double) {
    using T = TestType;
    const Index n = 50, d = 6, dv = 4, cut = 23;
    const Matrix<T> Q = random_matrix<T>(n, d, 1).cwiseAbs(), K = random_matrix<T>(n, d, 2).cwiseAbs() * T(0.5);
    const Matrix<T> V = random_matrix<T>(n, dv, 3), B = betas<T>(n, 4);
    const Matrix<T> G1 = with_resets(log_gates<T>(n, 1, 5), {0, 9, 30}),
                    Gd = with_resets(log_gates<T>(n, d, 6), {3, 16, 31});
    // decode (the memory's own update) = prefill (the chunked kernel) = the recurrent kernel.
    const auto check_memory = [&](auto make, const Matrix<T>& keys, const Matrix<T>& expected) {
        auto decoded = make(), prefilled = make();
        Matrix<T> O(n, dv);
        decode(decoded, Q, keys, V, O);
        check_close(O, to_double(expected), tolerance<T>() * 10);
        prefill(prefilled, Q, keys, V, O);
        check_close(O, to_double(expected), tolerance<T>() * 10);
        // set_state: a memory given the state after `cut` tokens continues as the one that saw them.
        auto first = make(), resumed = make();
        Matrix<T> a(n - cut, dv), b(n - cut, dv), skip(cut, dv);
        decode(first, Q.topRows(cut), keys.topRows(cut), V.topRows(cut), skip);
        resumed.set_state(first.state(), cut);
        CHECK(resumed.length() == cut);
        decode(first, Q.bottomRows(n - cut), keys.bottomRows(n - cut), V.bottomRows(n - cut), a);
        decode(resumed, Q.bottomRows(n - cut), keys.bottomRows(n - cut), V.bottomRows(n - cut), b);
        CHECK(a.cwiseEqual(b).all());
    };
    Matrix<T> expected(n, dv);
    recurrent_gated_linear_attention(Q, K, V, G1, expected);
    Matrix<T> keys(n, d + 1);
    keys << K, G1;
    check_memory([&] { return GatedLinearAttentionMemory<T>(d, dv); }, keys, expected);
    recurrent_gated_linear_attention(Q, K, V, Gd, expected, {.normalize = false});
    Matrix<T> channel_keys(n, 2 * d);
    channel_keys << K, Gd;
    check_memory([&] { return GatedLinearAttentionMemory<T>(d, dv, GateKind::channel, {.normalize = false}); },
                 channel_keys, expected);
    recurrent_delta_rule_attention(Q, K, V, B, G1, expected);
    Matrix<T> gated_keys(n, d + 2);
    gated_keys << K, B, G1;
    check_memory([&] { return DeltaRuleMemory<T>(d, dv, {.chunk_size = 5}, true); }, gated_keys, expected);
    // set_state refuses a wrong shape or a value that is not finite, the memory unchanged.
    GatedLinearAttentionMemory<T> gated(d, dv);
    memattn::extend(gated, keys.topRows(5), V.topRows(5));
    const LinearState<T> kept = gated.state();
    CHECK_THROWS_WITH(gated.set_state({Matrix<T>::Zero(d, dv + 1), {}}),
                      Catch::Matchers::Contains("GatedLinearAttentionMemory::set_state") &&
                          Catch::Matchers::Contains("state.mu") && Catch::Matchers::Contains("expected 6x4"));
    LinearState<T> nan_state{Matrix<T>::Zero(d, dv), Vector<T>::Zero(d)};
    nan_state.nu(2) = std::numeric_limits<T>::quiet_NaN();
    CHECK_THROWS_WITH(gated.set_state(nan_state), Catch::Matchers::Contains("state.nu") && Catch::Matchers::Contains("(0, 2)"));
    CHECK(gated.state().mu == kept.mu);
    CHECK(gated.state().nu == kept.nu);
    CHECK(gated.length() == 5);
    // An empty z is zero (as FLA's initial_state, which has none).
    gated.set_state({Matrix<T>::Ones(d, dv), {}}, 7);
    CHECK(gated.state().nu.isZero());
    CHECK(gated.length() == 7);
    DeltaRuleMemory<T> delta(d, dv);
    CHECK_THROWS_WITH(delta.set_state(Matrix<T>::Zero(dv, d)),
                      Catch::Matchers::Contains("DeltaRuleMemory::set_state") && Catch::Matchers::Contains("expected 6x4"));
    CHECK_THROWS_WITH(delta.set_state(Matrix<T>::Zero(d, dv), -1), Catch::Matchers::Contains("length"));
    // A NaN or positive log-gate is still refused by the memories.
    Matrix<T> bad = keys.topRows(1);
    bad(0, d) = std::numeric_limits<T>::quiet_NaN();
    CHECK_THROWS_AS(gated.update(bad.row(0), V.row(0)), std::invalid_argument);
}

namespace {

/// KDA in double, token by token, from the recurrence (Kimi Team 2025):
/// S = (I − β kᵀk) Diag(α) S + β kᵀ v, o = q S; log α = G (N×d), exp(−∞) = 0.
MatrixD kda_reference(const MatrixD& Q, const MatrixD& K, const MatrixD& V, const MatrixD& B, const MatrixD& G,
                      MatrixD& S) {
    const Index n = Q.rows(), d = Q.cols();
    MatrixD O(n, V.cols());
    for (Index i = 0; i < n; ++i) {
        const MatrixD k = K.row(i);
        MatrixD D = MatrixD::Zero(d, d);
        for (Index r = 0; r < d; ++r)
            D(r, r) = std::exp(G(i, r));
        const MatrixD I = MatrixD::Identity(d, d);
        S = (I - B(i, 0) * k.transpose() * k) * D * S + B(i, 0) * k.transpose() * V.row(i);
        O.row(i) = Q.row(i) * S;
    }
    return O;
}

}  // namespace

TEMPLATE_TEST_CASE("KDA: recurrent equals the double reference, chunked equals recurrent, with strong gates and "
                   "resets",
                   "[delta][kda]", float, double) {
    using T = TestType;
    const double tol = tolerance<T>() * 20;
    // Strong gates: every chunk of 7 or more tokens spans more than kda_pair_range in log,
    // so its pairs take one exponential per channel. Mild ones (down to e^-0.3 a token,
    // one token in 23 at e^-60): most chunks factor their pairs through K ⊙ e^{-b}, some
    // do not.
    for (const bool strong : {true, false}) {
        for (const Index n : {0, 1, 7, 70, 200}) {
            for (const bool l2 : {false, true}) {
                for (const bool negative : {false, true}) {
                    INFO("n = " << n << ", qk_l2norm " << l2 << ", beta in [0, " << (negative ? 2 : 1) << "], strong "
                                << strong);
                    const Index d = 6, dv = 4;
                    const Matrix<T> Q = random_matrix<T>(n, d, 1), V = random_matrix<T>(n, dv, 3);
                    const Matrix<T> K = random_matrix<T>(n, d, 2, l2 ? 1.0 : 0.5);
                    const Matrix<T> B = (negative && l2 ? T(2) : T(1)) * betas<T>(n, 4);
                    // Gates from e^-20 per token (channel 0) to mild, and resets in channels 0, 2, 4.
                    Matrix<T> G = log_gates<T>(n, d, 5, 0.3);
                    if (strong)
                        G.col(0) *= T(60);
                    else
                        for (Index t = 11; t < n; t += 23)
                            G(t, 1) = T(-60);
                    G = with_resets(G, {3, 16, 50, 51});
                    MatrixD S = MatrixD::Zero(d, dv);
                    const MatrixD expected =
                        kda_reference(fla_rows(to_double(Q), l2, default_scale(d)), fla_rows(to_double(K), l2),
                                      to_double(V), to_double(B), to_double(G), S);
                    REQUIRE(expected.allFinite());
                    const DeltaOptions base{.qk_l2norm = l2, .allow_negative_eigenvalues = negative};
                    Matrix<T> O(n, dv);
                    LinearState<T> state;
                    recurrent_kda_attention(Q, K, V, B, G, O, base, &state);
                    check_close(O, expected, tol);
                    check_close(state.mu, S, tol);
                    for (const Index chunk : {1, 7, 16, 64}) {
                        INFO("chunk " << chunk);
                        DeltaOptions options = base;
                        options.chunk_size = chunk;
                        const Index cut = (2 * n) / 5;  // the state carried across two calls
                        LinearState<T> carried;
                        Matrix<T> chunked(n, dv);
                        chunked_kda_attention(Q.topRows(cut), K.topRows(cut), V.topRows(cut), B.topRows(cut),
                                              G.topRows(cut), chunked.topRows(cut), options, &carried);
                        chunked_kda_attention(Q.bottomRows(n - cut), K.bottomRows(n - cut), V.bottomRows(n - cut),
                                              B.bottomRows(n - cut), G.bottomRows(n - cut), chunked.bottomRows(n - cut),
                                              options, &carried);
                        check_close(chunked, expected, tol);
                        check_close(carried.mu, S, tol);
                    }
                }
            }
        }
    }
    // Gates of 1 (log 0) in every channel: the (ungated) delta rule.
    const Index n = 40, d = 5, dv = 3;
    const Matrix<T> Q = random_matrix<T>(n, d, 1), K = random_matrix<T>(n, d, 2), V = random_matrix<T>(n, dv, 3),
                    B = betas<T>(n, 4);
    Matrix<T> O(n, dv), plain(n, dv);
    chunked_kda_attention(Q, K, V, B, Matrix<T>::Zero(n, d), O, {.chunk_size = 7, .qk_l2norm = true});
    chunked_delta_rule_attention(Q, K, V, B, plain, {.chunk_size = 7, .qk_l2norm = true});
    check_close(O, to_double(plain), tol);
    // One log-gate per token is the gated delta rule's, not KDA's: refused by the KDA names.
    CHECK_THROWS_WITH(chunked_kda_attention(Q, K, V, B, Matrix<T>::Zero(n, 1), O),
                      Catch::Matchers::Contains("chunked_kda_attention") &&
                          Catch::Matchers::Contains("expected 40x5 (a log-gate per key channel"));
    Matrix<T> bad = Matrix<T>::Zero(n, d);
    bad(4, 2) = T(0.1);
    CHECK_THROWS_WITH(recurrent_kda_attention(Q, K, V, B, bad, O),
                      Catch::Matchers::Contains("log_gates") && Catch::Matchers::Contains("at (4, 2)"));
}

TEMPLATE_TEST_CASE("KdaMemory: decode, prefill and the kernels agree; snapshots of its own kind; bad gates change "
                   "nothing",
                   "[delta][kda][memory]", float, double) {
    using T = TestType;
    const Index n = 45, d = 6, dv = 4;
    const Matrix<T> Q = random_matrix<T>(n, d, 1), K = random_matrix<T>(n, d, 2), V = random_matrix<T>(n, dv, 3),
                    B = betas<T>(n, 4), G = with_resets(log_gates<T>(n, d, 5), {20});
    Matrix<T> expected(n, dv);
    recurrent_kda_attention(Q, K, V, B, G, expected, {.qk_l2norm = true});
    Matrix<T> keys(n, 2 * d + 1);
    keys << K, B, G;
    KdaMemory<T> decoded(d, dv, {.chunk_size = 8, .qk_l2norm = true}), prefilled = decoded, split = decoded;
    CHECK(decoded.key_dim() == 2 * d + 1);
    CHECK(decoded.query_dim() == d);
    Matrix<T> O(n, dv);
    decode(decoded, Q, keys, V, O);
    check_close(O, to_double(expected), tolerance<T>() * 10);
    prefill(prefilled, Q, keys, V, O);
    check_close(O, to_double(expected), tolerance<T>() * 10);
    memattn::extend(split, keys.topRows(17), V.topRows(17));
    prefill(split, Q.bottomRows(n - 17), keys.bottomRows(n - 17), V.bottomRows(n - 17), O.bottomRows(n - 17));
    check_close(O.bottomRows(n - 17), to_double(expected.bottomRows(n - 17)), tolerance<T>() * 10);
    // A positive log-gate in channel 3 throws, naming the memory, and changes nothing.
    Matrix<T> bad = keys.topRows(1);
    bad(0, d + 1 + 3) = T(0.5);
    std::ostringstream before;
    save(decoded, before);
    CHECK_THROWS_WITH(decoded.update(bad.row(0), V.row(0)),
                      Catch::Matchers::Contains("KdaMemory::update") && Catch::Matchers::Contains("log-gate 0.5"));
    std::ostringstream after;
    save(decoded, after);
    CHECK(before.str() == after.str());
    // Its snapshots load into a KdaMemory, not a DeltaRuleMemory (another kind).
    KdaMemory<T> resumed(d, dv, {.chunk_size = 8, .qk_l2norm = true});
    std::istringstream in(before.str());
    load(resumed, in);
    Vector<T> a(dv), b(dv);
    decoded.attend(Q.row(0), a);
    resumed.attend(Q.row(0), b);
    CHECK(a == b);
    DeltaRuleMemory<T> other(d, dv, {.chunk_size = 8, .qk_l2norm = true}, true);
    std::istringstream again(before.str());
    CHECK_THROWS_AS(load(other, again), SnapshotError);
    static_assert(Memory<KdaMemory<T>> && Snapshottable<KdaMemory<T>>);
    // Of bfloat16 rows: the float memory fed the rows as float, to the bit.
    const Matrix<Eigen::bfloat16> k16 = keys.template cast<float>().template cast<Eigen::bfloat16>(),
                                  v16 = V.template cast<float>().template cast<Eigen::bfloat16>(),
                                  q16 = Q.template cast<float>().template cast<Eigen::bfloat16>();
    KdaMemory<Eigen::bfloat16> narrow(d, dv, {.qk_l2norm = true});
    KdaMemory<float> wide(d, dv, {.qk_l2norm = true});
    Matrix<Eigen::bfloat16> o16(n, dv);
    Matrix<float> o32(n, dv);
    decode(narrow, q16, k16, v16, o16);
    decode(wide, Matrix<float>(q16.template cast<float>()), Matrix<float>(k16.template cast<float>()),
           Matrix<float>(v16.template cast<float>()), o32);
    CHECK(o16.cwiseEqual(o32.template cast<Eigen::bfloat16>()).all());
}

TEST_CASE("Mamba-2's SSD layer is the scalar-gated form: log g = dt*A, k = dt*B, v = x, q = C (docs/design.md)",
          "[gated][mamba2]") {
    // One head of Mamba-2's selective state-space recurrence (Dao & Gu 2024, SSD), written
    // from its definition with state h (N × P): h_t = exp(dt_t·A) h_{t−1} + dt_t B_tᵀ x_t,
    // y_t = C_t h_t + D x_t, A < 0 a scalar per head, dt_t > 0 (after its softplus).
    const Index n = 90, N = 16, P = 8;
    const MatrixD x = to_double(random_matrix<double>(n, P, 1)), B = to_double(random_matrix<double>(n, N, 2)),
                  C = to_double(random_matrix<double>(n, N, 3));
    const MatrixD dt = (to_double(random_matrix<double>(n, 1, 4)).array().abs() * 0.5 + 0.01).matrix();
    const double A = -1.7, D = 0.3;
    MatrixD h = MatrixD::Zero(N, P), y(n, P);
    for (Index t = 0; t < n; ++t) {
        h = std::exp(dt(t, 0) * A) * h + dt(t, 0) * B.row(t).transpose() * x.row(t);
        y.row(t) = C.row(t) * h + D * x.row(t);
    }
    // memattn: q = C, k = dt·B, v = x, log g = dt·A, scale 1 (the default normaliser-free
    // form); D·x added by the caller.
    const Matrix<double> k = B.array().colwise() * dt.col(0).array(), log_g = dt * A;
    Matrix<double> o(n, P);
    for (const Index chunk : {1, 16, 64}) {
        chunked_gated_linear_attention(C, k, x, log_g, o, {.chunk_size = chunk, .scale = 1.0});
        o += D * x;
        check_close(o, y, 1e-12);
    }
    recurrent_gated_linear_attention(C, k, x, log_g, o, {.scale = 1.0});
    o += D * x;
    check_close(o, y, 1e-12);
}

namespace {

/// RWKV-7 in double, in flash-linear-attention's own layout (S: dv × d, S_t = S_{t−1}
/// (Diag(w_t) + a_tᵀ b_t) + v_tᵀ k_t, o_t = S_t r_t), exp(−∞) = 0: memattn's state is its
/// transpose.
MatrixD rwkv7_reference(const MatrixD& R, const MatrixD& K, const MatrixD& V, const MatrixD& A, const MatrixD& B,
                        const MatrixD& W, MatrixD& S) {
    const Index n = R.rows(), d = R.cols();
    MatrixD O(n, V.cols());
    for (Index i = 0; i < n; ++i) {
        MatrixD D = MatrixD::Zero(d, d);
        for (Index r = 0; r < d; ++r)
            D(r, r) = std::exp(W(i, r));
        S = S * (D + A.row(i).transpose() * B.row(i)) + V.row(i).transpose() * K.row(i);
        O.row(i) = (S * R.row(i).transpose()).transpose();
    }
    return O;
}

}  // namespace

TEMPLATE_TEST_CASE("RWKV-7: recurrent equals the double reference in FLA's layout, chunked equals recurrent",
                   "[rwkv7]", float, double) {
    using T = TestType;
    const double tol = tolerance<T>() * 20;
    const Index d = 6, dv = 4;
    // Mild decays: most chunks factor their pairs through B ⊙ e^{-λ} and K ⊙ e^{-λ}; strong
    // ones (channel 1 down to e^-36 a token): a chunk of more than 2 tokens does not.
    for (const bool strong : {false, true}) {
        for (const Index n : {0, 1, 7, 70, 200}) {
            INFO("n = " << n << ", strong " << strong);
            // As RWKV-7 builds them: a = −κ̂, b = κ̂ ⊙ α (κ̂ a unit removal key, α ∈ [0, 1]),
            // log w ∈ [−0.6, 0]; then a few log-decays of −∞ in channels 0, 2, 4.
            const Matrix<T> R = random_matrix<T>(n, d, 1), K = random_matrix<T>(n, d, 2, 0.5),
                            V = random_matrix<T>(n, dv, 3);
            const Matrix<T> kappa = unit_rows<T>(random_matrix<T>(n, d, 4));
            const Matrix<T> alpha = random_matrix<T>(n, d, 5).cwiseAbs();
            const Matrix<T> A = -kappa, B = kappa.cwiseProduct(alpha);
            Matrix<T> W = with_resets(log_gates<T>(n, d, 6, 0.6), {3, 30, 64});
            if (strong && n > 0)  // (a column block of an empty matrix offsets a null pointer)
                W.col(1) *= T(60);
            MatrixD S = MatrixD::Zero(dv, d);
            const MatrixD expected =
                rwkv7_reference(to_double(R), to_double(K), to_double(V), to_double(A), to_double(B), to_double(W), S);
            REQUIRE(expected.allFinite());
            Matrix<T> O(n, dv);
            LinearState<T> state;
            recurrent_rwkv7_attention(R, K, V, A, B, W, O, {}, &state);
            check_close(O, expected, tol);
            check_close(state.mu, MatrixD(S.transpose()), tol);
            for (const Index chunk : {1, 7, 16, 64}) {
                INFO("chunk " << chunk);
                const Index cut = (2 * n) / 5;
                LinearState<T> carried;
                Matrix<T> chunked(n, dv);
                chunked_rwkv7_attention(R.topRows(cut), K.topRows(cut), V.topRows(cut), A.topRows(cut), B.topRows(cut),
                                        W.topRows(cut), chunked.topRows(cut), {.chunk_size = chunk}, &carried);
                chunked_rwkv7_attention(R.bottomRows(n - cut), K.bottomRows(n - cut), V.bottomRows(n - cut),
                                        A.bottomRows(n - cut), B.bottomRows(n - cut), W.bottomRows(n - cut),
                                        chunked.bottomRows(n - cut), {.chunk_size = chunk}, &carried);
                check_close(chunked, expected, tol);
                check_close(carried.mu, MatrixD(S.transpose()), tol);
            }
        }
    }
    // With a = −β k, b = k (unit keys), w = 1 and v scaled by β it is the delta rule.
    const Index n = 50;
    const Matrix<T> Q = random_matrix<T>(n, d, 1), K = unit_rows<T>(random_matrix<T>(n, d, 2)),
                    V = random_matrix<T>(n, dv, 3), beta = betas<T>(n, 4);
    Matrix<T> O(n, dv), delta(n, dv);
    chunked_rwkv7_attention(Q, K, Matrix<T>(V.array().colwise() * beta.col(0).array()),
                            Matrix<T>(-(K.array().colwise() * beta.col(0).array())), K, Matrix<T>::Zero(n, d), O,
                            {.chunk_size = 16});
    chunked_delta_rule_attention(Q, K, V, beta, delta, {.scale = 1.0});  // RWKV-7's scale is 1
    check_close(O, to_double(delta), tol);
    // Bad input names the function, the argument and the place.
    Matrix<T> bad = Matrix<T>::Zero(n, d);
    bad(9, 1) = std::numeric_limits<T>::quiet_NaN();
    CHECK_THROWS_WITH(chunked_rwkv7_attention(Q, K, V, K, K, bad, O),
                      Catch::Matchers::Contains("chunked_rwkv7_attention") && Catch::Matchers::Contains("log_w") &&
                          Catch::Matchers::Contains("at (9, 1)"));
    CHECK_THROWS_WITH(recurrent_rwkv7_attention(Q, K, V, Matrix<T>::Zero(n, d + 1), K, Matrix<T>::Zero(n, d), O),
                      Catch::Matchers::Contains("A") && Catch::Matchers::Contains("expected the shape of Q"));
}

TEMPLATE_TEST_CASE("Rwkv7Memory: decode, prefill and the kernels agree; snapshots; set_state; bad decays change "
                   "nothing",
                   "[rwkv7][memory]", float, double) {
    using T = TestType;
    const Index n = 45, d = 5, dv = 3;
    const Matrix<T> R = random_matrix<T>(n, d, 1), K = random_matrix<T>(n, d, 2, 0.5), V = random_matrix<T>(n, dv, 3);
    const Matrix<T> kappa = unit_rows<T>(random_matrix<T>(n, d, 4)), alpha = random_matrix<T>(n, d, 5).cwiseAbs();
    const Matrix<T> A = -kappa, B = kappa.cwiseProduct(alpha), W = with_resets(log_gates<T>(n, d, 6, 0.6), {20});
    Matrix<T> expected(n, dv);
    recurrent_rwkv7_attention(R, K, V, A, B, W, expected);
    Matrix<T> keys(n, 4 * d);
    keys << K, A, B, W;
    Rwkv7Memory<T> decoded(d, dv, {.chunk_size = 8}), prefilled = decoded, split = decoded;
    CHECK(decoded.key_dim() == 4 * d);
    Matrix<T> O(n, dv);
    decode(decoded, R, keys, V, O);
    check_close(O, to_double(expected), tolerance<T>() * 10);
    prefill(prefilled, R, keys, V, O);
    check_close(O, to_double(expected), tolerance<T>() * 10);
    memattn::extend(split, keys.topRows(17), V.topRows(17));
    prefill(split, R.bottomRows(n - 17), keys.bottomRows(n - 17), V.bottomRows(n - 17), O.bottomRows(n - 17));
    check_close(O.bottomRows(n - 17), to_double(expected.bottomRows(n - 17)), tolerance<T>() * 10);
    // A positive log-decay throws, naming the memory, and changes nothing.
    Matrix<T> bad = keys.topRows(1);
    bad(0, 3 * d + 2) = T(0.5);
    std::ostringstream before;
    save(decoded, before);
    CHECK_THROWS_WITH(decoded.update(bad.row(0), V.row(0)), Catch::Matchers::Contains("Rwkv7Memory::update"));
    Matrix<T> o1(1, dv);
    CHECK_THROWS_AS(prefill(decoded, R.topRows(1), bad, V.topRows(1), o1), std::invalid_argument);
    std::ostringstream after;
    save(decoded, after);
    CHECK(before.str() == after.str());
    // Snapshots and set_state resume it exactly.
    Rwkv7Memory<T> loaded(d, dv, {.chunk_size = 8}), given(d, dv, {.chunk_size = 8});
    std::istringstream in(before.str());
    load(loaded, in);
    given.set_state(decoded.state(), decoded.length());
    Vector<T> a(dv), b(dv), c(dv);
    decoded.attend(R.row(0), a);
    loaded.attend(R.row(0), b);
    given.attend(R.row(0), c);
    CHECK(a == b);
    CHECK(a == c);
    CHECK_THROWS_WITH(given.set_state(Matrix<T>::Zero(dv, d)), Catch::Matchers::Contains("expected 5x3"));
    static_assert(Memory<Rwkv7Memory<T>> && Snapshottable<Rwkv7Memory<T>> && Memory<Rwkv7Memory<Eigen::bfloat16>>);
}

TEST_CASE("KdaMemory and Rwkv7Memory in a MultiHead layer: each query head its KV head's memory", "[kda][rwkv7][multihead]") {
    const Index d = 4, dv = 3, n = 24;
    const HeadLayout layout{.q_heads = 4, .kv_heads = 2, .head_dim = d, .value_dim = dv};
    const Matrix<float> Q = random_matrix<float>(n, 4 * d, 1), V = random_matrix<float>(n, 2 * dv, 8);
    const auto check_layer = [&](auto make, const Matrix<float>& keys) {
        using M = decltype(make());
        const Index width = make().key_dim();
        MultiHead<M> layer(layout, [&](Index) { return make(); }), prefilled(layout, [&](Index) { return make(); });
        CHECK(layer.key_dim() == 2 * width);
        Matrix<float> O(n, 4 * dv), by_prefill(n, 4 * dv);
        decode(layer, Q, keys, V, O);
        prefill(prefilled, Q, keys, V, by_prefill);
        check_close(by_prefill, to_double(O), 1e-5);
        for (Index h = 0; h < 4; ++h) {
            const Index kv = h / 2;
            M head = make();
            Matrix<float> expected(n, dv);
            decode(head, Q.middleCols(h * d, d), keys.middleCols(kv * width, width), V.middleCols(kv * dv, dv),
                   expected);
            check_close(O.middleCols(h * dv, dv), to_double(expected), 1e-5);
        }
    };
    Matrix<float> kda_keys(n, 2 * (2 * d + 1));  // per KV head [k | β | log α]
    for (Index h = 0; h < 2; ++h)
        kda_keys.middleCols(h * (2 * d + 1), 2 * d + 1) << random_matrix<float>(n, d, 2 + h), betas<float>(n, 4 + h),
            log_gates<float>(n, d, 6 + h);
    check_layer([] { return KdaMemory<float>(d, dv, {.qk_l2norm = true}); }, kda_keys);
    Matrix<float> rwkv7_keys(n, 2 * 4 * d);  // per KV head [k | a | b | log w]
    for (Index h = 0; h < 2; ++h) {
        const Matrix<float> kappa = unit_rows<float>(random_matrix<float>(n, d, 10 + h));
        rwkv7_keys.middleCols(h * 4 * d, 4 * d) << random_matrix<float>(n, d, 12 + h, 0.5), -kappa,
            kappa.cwiseProduct(random_matrix<float>(n, d, 14 + h).cwiseAbs()), log_gates<float>(n, d, 16 + h, 0.6);
    }
    check_layer([] { return Rwkv7Memory<float>(d, dv); }, rwkv7_keys);
}

TEMPLATE_TEST_CASE("FLA's conventions: q scaled by 1/sqrt(d) unless given, qk_l2norm with its epsilon, the same in "
                   "every kernel and memory",
                   "[gated][delta][kda][rwkv7][conventions]", float, double) {
    using T = TestType;
    const double tol = tolerance<T>() * 20;
    const Index n = 45, d = 8, dv = 5;
    Matrix<T> Q = random_matrix<T>(n, d, 1), K = random_matrix<T>(n, d, 2, 0.5);
    // A zero query and a zero key: with qk_l2norm they stay zero (√ε in the norm), no NaN.
    Q.row(4).setZero();
    K.row(9).setZero();
    const Matrix<T> V = random_matrix<T>(n, dv, 3), B = betas<T>(n, 4), G1 = log_gates<T>(n, 1, 5, 0.2),
                    Gd = log_gates<T>(n, d, 6, 0.2);
    const MatrixD Qd = to_double(Q), Kd = to_double(K), Vd = to_double(V), Bd = to_double(B), G1d = to_double(G1);
    for (const std::optional<double> scale : {std::optional<double>{}, std::optional<double>{0.37}}) {
        for (const bool l2 : {false, true}) {
            INFO("scale " << (scale ? *scale : -1.0) << " (-1: the default), qk_l2norm " << l2);
            const double s = scale ? *scale : 1 / std::sqrt(double(d));
            const MatrixD q = fla_rows(Qd, l2, s), k = fla_rows(Kd, l2);
            // Gated linear attention, with and without its normaliser (of q̂·z + eps).
            for (const bool normalize : {false, true}) {
                MatrixD S = MatrixD::Zero(d, dv), z = MatrixD::Zero(1, d);
                const MatrixD expected = gated_reference(q, k, Vd, G1d, normalize, 1e-6, S, z);
                const GatedOptions options{.chunk_size = 7, .scale = scale, .normalize = normalize, .qk_l2norm = l2};
                Matrix<T> O(n, dv);
                chunked_gated_linear_attention(Q, K, V, G1, O, options);
                // The normaliser of a zero query is eps alone: only its output row is large.
                if (!normalize)
                    check_close(O, expected, tol);
                else
                    check_close(O.topRows(4), expected.topRows(4), tol);
                recurrent_gated_linear_attention(Q, K, V, G1, O, options);
                if (!normalize)
                    check_close(O, expected, tol);
                REQUIRE(O.allFinite());
                // The memory: decode and prefill.
                GatedLinearAttentionMemory<T> decoded(d, dv, GateKind::scalar, options), prefilled = decoded;
                Matrix<T> keys(n, d + 1);
                keys << K, G1;
                Matrix<T> Om(n, dv);
                decode(decoded, Q, keys, V, Om);
                if (!normalize)
                    check_close(Om, expected, tol);
                else
                    check_close(Om.topRows(4), expected.topRows(4), tol);
                prefill(prefilled, Q, keys, V, Om);
                if (!normalize)
                    check_close(Om, expected, tol);
            }
            // The delta rule, gated, and KDA.
            const DeltaOptions options{.chunk_size = 7, .scale = scale, .qk_l2norm = l2};
            MatrixD S = MatrixD::Zero(d, dv);
            const MatrixD delta = delta_reference(q, k, Vd, Bd, &G1d, S);
            S.setZero();
            const MatrixD kda = kda_reference(q, k, Vd, Bd, to_double(Gd), S);
            Matrix<T> O(n, dv);
            chunked_delta_rule_attention(Q, K, V, B, G1, O, options);
            check_close(O, delta, tol);
            recurrent_delta_rule_attention(Q, K, V, B, G1, O, options);
            check_close(O, delta, tol);
            chunked_kda_attention(Q, K, V, B, Gd, O, options);
            check_close(O, kda, tol);
            recurrent_kda_attention(Q, K, V, B, Gd, O, options);
            check_close(O, kda, tol);
            Matrix<T> delta_keys(n, d + 2), kda_keys(n, 2 * d + 1);
            delta_keys << K, B, G1;
            kda_keys << K, B, Gd;
            DeltaRuleMemory<T> delta_memory(d, dv, options, true);
            KdaMemory<T> kda_memory(d, dv, options);
            decode(delta_memory, Q, delta_keys, V, O);
            check_close(O, delta, tol);
            decode(kda_memory, Q, kda_keys, V, O);
            check_close(O, kda, tol);
            // attend_group applies each query's own factor.
            Matrix<T> group(3, dv), one(1, dv);
            kda_memory.attend_group(Q.middleRows(3, 3), group);
            for (Index r = 0; r < 3; ++r) {
                kda_memory.attend(Q.row(3 + r), one.row(0));
                check_close(group.row(r), to_double(one), tol);
            }
        }
    }
    // RWKV-7: o = scale · q S (scale 1 by default, as FLA's).
    const Matrix<T> kappa = unit_rows<T>(random_matrix<T>(n, d, 7));
    const Matrix<T> A = -kappa, Bt = kappa.cwiseProduct(random_matrix<T>(n, d, 8).cwiseAbs());
    MatrixD S = MatrixD::Zero(dv, d);
    const MatrixD expected = 0.37 * rwkv7_reference(Qd, Kd, Vd, to_double(A), to_double(Bt), to_double(Gd), S);
    Matrix<T> O(n, dv);
    chunked_rwkv7_attention(Q, K, V, A, Bt, Gd, O, {.chunk_size = 7, .scale = 0.37});
    check_close(O, expected, tol);
    recurrent_rwkv7_attention(Q, K, V, A, Bt, Gd, O, {.scale = 0.37});
    check_close(O, expected, tol);
    Rwkv7Memory<T> rwkv(d, dv, {.scale = 0.37});
    Matrix<T> rwkv_keys(n, 4 * d);
    rwkv_keys << K, A, Bt, Gd;
    decode(rwkv, Q, rwkv_keys, V, O);
    check_close(O, expected, tol);

    // Bad options name the function and the option; a snapshot records the resolved scale.
    const T nan = std::numeric_limits<T>::quiet_NaN();
    CHECK_THROWS_WITH(chunked_gated_linear_attention(Q, K, V, G1, O, {.scale = double(nan)}),
                      Catch::Matchers::Contains("chunked_gated_linear_attention") &&
                          Catch::Matchers::Contains("options.scale"));
    CHECK_THROWS_WITH(recurrent_delta_rule_attention(Q, K, V, B, O, {.qk_l2norm = true, .l2norm_eps = -1}),
                      Catch::Matchers::Contains("recurrent_delta_rule_attention") &&
                          Catch::Matchers::Contains("options.l2norm_eps"));
    CHECK_THROWS_WITH(chunked_rwkv7_attention(Q, K, V, A, Bt, Gd, O, {.scale = double(nan)}),
                      Catch::Matchers::Contains("options.scale"));
    CHECK_THROWS_WITH(KdaMemory<T>(d, dv, {.scale = std::numeric_limits<double>::infinity()}),
                      Catch::Matchers::Contains("KdaMemory") && Catch::Matchers::Contains("options.scale"));
    CHECK_THROWS_WITH(GatedLinearAttentionMemory<T>(d, dv, GateKind::scalar, {.l2norm_eps = nan}),
                      Catch::Matchers::Contains("options.l2norm_eps"));
    DeltaRuleMemory<T> plain(d, dv), explicit_default(d, dv, {.scale = 1 / std::sqrt(double(d))}),
        other(d, dv, {.scale = 1.0});
    std::stringstream saved;
    save(plain, saved);
    load(explicit_default, saved);  // the same resolved scale
    std::istringstream again(saved.str());
    CHECK_THROWS_WITH(load(other, again), Catch::Matchers::Contains("scale"));
}

TEMPLATE_TEST_CASE("Gated linear attention by spans: bitwise the same on 1, 2 and 3 threads, one span's outputs to "
                   "rounding",
                   "[gated][spans][threads]", float, double) {
    using T = TestType;
    const double tol = tolerance<T>() * 20;
    const Index d = 6, dv = 5;
    const OpenMPExecutor one{.threads = 1}, two{.threads = 2}, three{.threads = 3};
    // Spans shorter than a chunk (rounded up to one), off the chunks, longer than the
    // sequence (one span); lengths that end a span exactly or leave a short last one;
    // resets on a span's first token and inside spans.
    for (const Index n : {0, 1, 33, 300, 700}) {
        for (const Index gate_cols : {Index(1), d}) {
            for (const Index span : {5, 40, 100, 256, 1000}) {
                for (const bool normalize : {false, true}) {
                    INFO("n = " << n << ", gate columns " << gate_cols << ", span " << span << ", normalize "
                                << normalize);
                    const Matrix<T> Q = random_matrix<T>(n, d, 1).cwiseAbs(), K = random_matrix<T>(n, d, 2).cwiseAbs(),
                                    V = random_matrix<T>(n, dv, 3);
                    const Matrix<T> G = with_resets(log_gates<T>(n, gate_cols, 4, 0.1), {n / 2, 2 * span, 250});
                    const GatedOptions serial{.chunk_size = 8, .normalize = normalize, .qk_l2norm = normalize};
                    GatedOptions options = serial;
                    options.span_tokens = span;
                    LinearState<T> initial{random_matrix<T>(d, dv, 5), random_matrix<T>(1, d, 6).cwiseAbs()};
                    LinearState<T> s1 = initial, s2 = initial, s3 = initial, reference = initial;
                    Matrix<T> O1(n, dv), O2(n, dv), O3(n, dv), expected(n, dv);
                    chunked_gated_linear_attention(Q, K, V, G, expected, serial, &reference);
                    chunked_gated_linear_attention(Q, K, V, G, O1, options, &s1, one);
                    chunked_gated_linear_attention(Q, K, V, G, O2, options, &s2, two);
                    chunked_gated_linear_attention(Q, K, V, G, O3, options, &s3, three);
                    CHECK(O1.cwiseEqual(O2).all());
                    CHECK(O1.cwiseEqual(O3).all());
                    CHECK(s1.mu.cwiseEqual(s2.mu).all());
                    CHECK(s1.mu.cwiseEqual(s3.mu).all());
                    CHECK(s1.nu.cwiseEqual(s3.nu).all());
                    check_close(O1, to_double(expected), tol);
                    check_close(s1.mu, to_double(reference.mu), tol);
                    check_close(s1.nu, to_double(reference.nu), tol);
                    // The double reference, from the given state.
                    MatrixD S = to_double(initial.mu), z = to_double(initial.nu);
                    const double scale = 1 / std::sqrt(double(d));
                    const MatrixD direct = gated_reference(fla_rows(to_double(Q), normalize, scale),
                                                           fla_rows(to_double(K), normalize), to_double(V),
                                                           to_double(G), normalize, 1e-6, S, z);
                    check_close(O2, direct, tol);
                    check_close(s2.mu, S, tol);
                }
            }
        }
    }
    // A state that is not finite runs as one span: a reset still forgets it, bit for bit.
    const Index n = 200;
    const Matrix<T> Q = random_matrix<T>(n, d, 1), K = random_matrix<T>(n, d, 2), V = random_matrix<T>(n, dv, 3);
    const Matrix<T> G = with_resets(log_gates<T>(n, 1, 4, 0.1), {0});
    LinearState<T> poisoned{Matrix<T>::Constant(d, dv, std::numeric_limits<T>::infinity()), Vector<T>::Zero(d)},
        also = poisoned;
    Matrix<T> a(n, dv), b(n, dv);
    chunked_gated_linear_attention(Q, K, V, G, a, {.span_tokens = 64}, &poisoned, two);
    chunked_gated_linear_attention(Q, K, V, G, b, {}, &also);
    CHECK(a.allFinite());
    CHECK(a.cwiseEqual(b).all());
    CHECK_THROWS_WITH(chunked_gated_linear_attention(Q, K, V, G, a, {.span_tokens = -1}),
                      Catch::Matchers::Contains("options.span_tokens"));
    // A memory prefills its own state as one span: the option is refused, not ignored.
    CHECK_THROWS_WITH(GatedLinearAttentionMemory<T>(d, dv, GateKind::scalar, {.span_tokens = 64}),
                      Catch::Matchers::Contains("GatedLinearAttentionMemory") &&
                          Catch::Matchers::Contains("options.span_tokens"));
}

TEMPLATE_TEST_CASE("Delta rule and KDA: the value columns over 2 and 3 threads give one thread's bits",
                   "[delta][kda][threads]", float, double) {
    using T = TestType;
    const OpenMPExecutor one{.threads = 1}, two{.threads = 2}, three{.threads = 3};
    const Index n = 1100, d = 8;  // past ValueColumns::min_rows
    // One part (100 columns), two (128), three of 64, 64 and 77 (205); chunks of 7 and 16.
    // The sanitize build (-O0 under ASan): one and three parts, chunks of 16 alone.
    const std::vector<Index> widths = memattn::test::memory_only ? std::vector<Index>{100, 205}
                                                                 : std::vector<Index>{100, 128, 205};
    const std::vector<Index> chunks = memattn::test::memory_only ? std::vector<Index>{16} : std::vector<Index>{7, 16};
    for (const Index dv : widths) {
        INFO("dv = " << dv);
        const Matrix<T> Q = random_matrix<T>(n, d, 1), K = unit_rows<T>(random_matrix<T>(n, d, 2)),
                        V = random_matrix<T>(n, dv, 3), B = betas<T>(n, 4), G1 = log_gates<T>(n, 1, 5, 0.1),
                        Gd = with_resets(log_gates<T>(n, d, 6, 0.1), {500});
        const LinearState<T> initial{random_matrix<T>(d, dv, 8, 0.3), {}};
        const auto same = [&](auto call) {
            Matrix<T> o1(n, dv), o2(n, dv), o3(n, dv);
            LinearState<T> s1 = initial, s2 = initial, s3 = initial;
            call(o1, s1, one);
            call(o2, s2, two);
            call(o3, s3, three);
            CHECK(o1.allFinite());
            CHECK(o1.cwiseEqual(o2).all());
            CHECK(o1.cwiseEqual(o3).all());
            CHECK(s1.mu.cwiseEqual(s2.mu).all());
            CHECK(s1.mu.cwiseEqual(s3.mu).all());
        };
        for (const Index chunk : chunks) {
            const DeltaOptions options{.chunk_size = chunk, .qk_l2norm = true};
            same([&](Matrix<T>& o, LinearState<T>& s, const OpenMPExecutor& e) {
                chunked_delta_rule_attention(Q, K, V, B, o, options, &s, e);
            });
            same([&](Matrix<T>& o, LinearState<T>& s, const OpenMPExecutor& e) {
                chunked_delta_rule_attention(Q, K, V, B, G1, o, options, &s, e);
            });
            same([&](Matrix<T>& o, LinearState<T>& s, const OpenMPExecutor& e) {
                chunked_kda_attention(Q, K, V, B, Gd, o, options, &s, e);
            });
        }
    }
}

TEMPLATE_TEST_CASE("qk_l2norm's sum of squares: sixteen partial sums within their bound of double; zero rows stay zero",
                   "[gated][delta]", float, double) {
    using T = TestType;
    constexpr double u = std::numeric_limits<T>::epsilon() / 2;
    for (const Index n : {0, 1, 2, 15, 16, 17, 31, 32, 33, 47, 64, 100, 128, 257}) {
        INFO("n = " << n);
        const Matrix<T> x = random_matrix<T>(1, std::max<Index>(n, 1), static_cast<unsigned>(n) + 3);
        double exact = 0, magnitude = 0;
        for (Index i = 0; i < n; ++i) {
            exact += static_cast<double>(x(0, i)) * static_cast<double>(x(0, i));
            magnitude += std::abs(static_cast<double>(x(0, i)) * static_cast<double>(x(0, i)));
        }
        // Each partial sum is a chain of ceil(n / 16) terms, then four levels of pairs.
        const double depth = static_cast<double>((n + 15) / 16 + 5);
        const T sum = detail::sum_of_squares(x.data(), n);
        CHECK(std::abs(static_cast<double>(sum) - exact) <= depth * u * magnitude + 1e-300);
        const T f = detail::l2norm_factor<T>(x.data(), n, T(1e-6));
        CHECK(std::abs(static_cast<double>(f) * std::sqrt(exact + 1e-6) - 1) <= (depth + 4) * u);
        // Each element counted once: doubling one of them adds 3 x_i² to the sum.
        if (n > 0) {
            Matrix<T> y = x;
            const Index i = n - 1;
            y(0, i) *= T(2);
            const double grown = exact + 3 * static_cast<double>(x(0, i)) * static_cast<double>(x(0, i));
            CHECK(std::abs(static_cast<double>(detail::sum_of_squares(y.data(), n)) - grown) <=
                  depth * u * (magnitude + 4 * std::abs(grown - exact)) + 1e-300);
        }
    }
    const Matrix<T> zero = Matrix<T>::Zero(1, 40);
    CHECK(detail::l2norm_factor<T>(zero.data(), 40, T(0)) == T(0));
}
