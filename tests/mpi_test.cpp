// memattn::mpi (memattn/distributed/mpi.hpp) against the single-process kernels and the
// double reference. ctest runs this binary under mpirun with 1, 2, 3 and 4 ranks; every
// rank builds the same whole sequence from the same seeds, takes its own shard, and
// checks its own rows. A failure on any rank fails the run (the exit codes are reduced).
#define CATCH_CONFIG_RUNNER
#include <memattn/distributed/mpi.hpp>

#include "support.hpp"

#include <memattn/kernels/causal_softmax.hpp>
#include <memattn/kernels/delta_rule.hpp>
#include <memattn/kernels/gated_linear_attention.hpp>
#include <memattn/kernels/linear_attention.hpp>
#include <memattn/memory/kv_cache.hpp>

#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace memattn;
using namespace memattn::test;

int rank_of() {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    return rank;
}

int size_of() {
    int size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    return size;
}

/// Uneven shard lengths: rank r gets base + (5r mod 7); with `empty`, rank 1 gets none.
std::vector<Index> shard_lengths(Index base, bool empty) {
    std::vector<Index> lengths;
    for (int r = 0; r < size_of(); ++r)
        lengths.push_back(empty && r == 1 ? 0 : base + (5 * r) % 7);
    return lengths;
}

/// The length of the whole sequence.
Index total(const std::vector<Index>& lengths) {
    Index n = 0;
    for (const Index length : lengths)
        n += length;
    return n;
}

/// The tokens (rows of the whole sequence) rank r holds, in its row order: contiguous,
/// or zigzag (chunk r then chunk 2P−1−r of 2P, rank r's first ⌈n_r/2⌉ rows then the rest).
std::vector<Index> tokens_of(const std::vector<Index>& lengths, int rank, RingLayout layout) {
    const auto p = static_cast<Index>(lengths.size());
    std::vector<std::pair<Index, Index>> runs;  // (first token, count) of each chunk, in sequence order
    std::vector<int> owner;
    if (layout == RingLayout::contiguous) {
        for (Index r = 0; r < p; ++r) {
            owner.push_back(static_cast<int>(r));
            runs.push_back({0, lengths[static_cast<std::size_t>(r)]});
        }
    } else {
        for (Index c = 0; c < 2 * p; ++c) {
            const Index r = c < p ? c : 2 * p - 1 - c, n = lengths[static_cast<std::size_t>(r)];
            owner.push_back(static_cast<int>(r));
            runs.push_back({0, c < p ? (n + 1) / 2 : n - (n + 1) / 2});
        }
    }
    Index start = 0;
    std::vector<Index> tokens;
    for (std::size_t c = 0; c < runs.size(); ++c) {
        if (owner[c] == rank)
            for (Index t = 0; t < runs[c].second; ++t)
                tokens.push_back(start + t);
        start += runs[c].second;
    }
    return tokens;
}

template <class T>
Matrix<T> rows_of(const Matrix<T>& m, const std::vector<Index>& tokens) {
    Matrix<T> out(static_cast<Index>(tokens.size()), m.cols());
    for (std::size_t i = 0; i < tokens.size(); ++i)
        out.row(static_cast<Index>(i)) = m.row(tokens[i]);
    return out;
}

MatrixD rows_of(const MatrixD& m, const std::vector<Index>& tokens) {
    MatrixD out(static_cast<Index>(tokens.size()), m.cols());
    for (std::size_t i = 0; i < tokens.size(); ++i)
        out.row(static_cast<Index>(i)) = m.row(tokens[i]);
    return out;
}

/// Rank 0's string on every rank.
std::string from_rank_0(std::string text) {
    int length = static_cast<int>(text.size());
    MPI_Bcast(&length, 1, MPI_INT, 0, MPI_COMM_WORLD);
    text.resize(static_cast<std::size_t>(length));
    MPI_Bcast(text.data(), length, MPI_CHAR, 0, MPI_COMM_WORLD);
    return text;
}

/// Calls f on every rank; every rank must throw std::invalid_argument with rank 0's
/// message, which names `function`.
template <class F>
void expect_all_throw(const std::string& function, F&& f) {
    std::string message;
    try {
        f();
    } catch (const std::invalid_argument& e) {
        message = e.what();
    }
    CAPTURE(message);
    CHECK(message.find(function) != std::string::npos);
    CHECK(message == from_rank_0(message));
}

}  // namespace

TEMPLATE_TEST_CASE("ring attention equals the single-process kernel", "[mpi][softmax]", float, double) {
    using T = TestType;
    const RingLayout layout = GENERATE(RingLayout::contiguous, RingLayout::zigzag);
    const bool empty = GENERATE(false, true);
    const Index base = GENERATE(Index(1), Index(45), Index(200));
    struct Case {
        Index window, sink_tokens;
    };
    const Case option = GENERATE(Case{0, 0}, Case{37, 0}, Case{37, 3}, Case{1, 2}, Case{100000, 0});
    if (empty && size_of() < 2)
        return;
    const std::vector<Index> lengths = shard_lengths(base, empty);
    const Index n = total(lengths);
    const Index d = 24, dv = 17;
    const Matrix<T> Q = random_matrix<T>(n, d, 1), K = random_matrix<T>(n, d, 2), V = random_matrix<T>(n, dv, 3);
    const std::vector<Index> mine = tokens_of(lengths, rank_of(), layout);
    const SoftmaxOptions options{.scale = 0, .window = option.window, .sink_tokens = option.sink_tokens};
    Matrix<T> O(static_cast<Index>(mine.size()), dv);
    distributed_causal_softmax_attention(MPI_COMM_WORLD, rows_of(Q, mine), rows_of(K, mine), rows_of(V, mine), O,
                                         options, layout);
    const auto expected = reference::softmax_attention(reference::to_double(Q), reference::to_double(K),
                                                       reference::to_double(V), 0, option.window, option.sink_tokens);
    CAPTURE(n, base, empty, option.window, option.sink_tokens, static_cast<int>(layout), rank_of());
    check_close(O, rows_of(expected.out, mine), tolerance<T>());
    // The same rows as one process's kernel, to float rounding.
    Matrix<T> whole(n, dv);
    causal_softmax_attention(Q, K, V, whole, options);
    check_close(O, rows_of(Matrix<T>(whole), mine).template cast<double>(), tolerance<T>());
}

TEMPLATE_TEST_CASE("ring attention over a layer of heads equals each head's reference", "[mpi][softmax][layer]",
                   float, double) {
    using T = TestType;
    const RingLayout layout = GENERATE(RingLayout::contiguous, RingLayout::zigzag);
    const Index window = GENERATE(Index(0), Index(29));
    const std::vector<Index> lengths = shard_lengths(40, false);
    const Index n = total(lengths);
    const HeadLayout heads{4, 2, 8, 6};  // grouped-query: heads 0, 1 read KV head 0
    const Matrix<T> Q = random_matrix<T>(n, 4 * 8, 21), K = random_matrix<T>(n, 2 * 8, 22),
                    V = random_matrix<T>(n, 2 * 6, 23);
    const std::vector<Index> mine = tokens_of(lengths, rank_of(), layout);
    const SoftmaxOptions options{.scale = 0, .window = window, .sink_tokens = 1};
    Matrix<T> O(static_cast<Index>(mine.size()), 4 * 6);
    distributed_causal_softmax_attention(MPI_COMM_WORLD, rows_of(Q, mine), rows_of(K, mine), rows_of(V, mine), O,
                                         heads, options, layout);
    for (Index h = 0; h < 4; ++h) {
        const Index g = h / 2;
        const auto expected = reference::softmax_attention(
            reference::to_double(Q.middleCols(h * 8, 8)), reference::to_double(K.middleCols(g * 8, 8)),
            reference::to_double(V.middleCols(g * 6, 6)), 0, window, 1);
        CAPTURE(h, window, static_cast<int>(layout), rank_of());
        check_close(O.middleCols(h * 6, 6), rows_of(expected.out, mine), tolerance<T>());
    }
}

TEMPLATE_TEST_CASE("ring attention with softcap, ALiBi and sink logits equals each head's reference",
                   "[mpi][softmax][options]", float, double) {
    using T = TestType;
    const RingLayout layout = GENERATE(RingLayout::contiguous, RingLayout::zigzag);
    const Index window = GENERATE(Index(0), Index(23));
    const std::vector<Index> lengths = shard_lengths(45, false);
    const Index n = total(lengths);
    const HeadLayout heads{4, 2, 8, 6};
    const Matrix<T> Q = random_matrix<T>(n, 4 * 8, 31, 2.0), K = random_matrix<T>(n, 2 * 8, 32, 2.0),
                    V = random_matrix<T>(n, 2 * 6, 33);
    const std::vector<double> slopes{0.25, 0.0625, 0.015625, 0.00390625}, sinks{0.5, -1, 2, -30};
    const std::vector<Index> mine = tokens_of(lengths, rank_of(), layout);
    Matrix<T> O(static_cast<Index>(mine.size()), 4 * 6);
    // Causal, then both ways (an encoder over the ring: the window both ways, the sinks
    // past it): every head against the reference.
    for (const bool causal : {true, false}) {
        const SoftmaxOptions options{.window = window, .sink_tokens = 2, .softcap = 3, .causal = causal,
                                     .sink_logits = sinks, .alibi_slopes = slopes};
        distributed_causal_softmax_attention(MPI_COMM_WORLD, rows_of(Q, mine), rows_of(K, mine), rows_of(V, mine), O,
                                             heads, options, layout);
        for (Index h = 0; h < 4; ++h) {
            const Index g = h / 2;
            const auto expected = reference::softmax_attention(
                reference::to_double(Q.middleCols(h * 8, 8)), reference::to_double(K.middleCols(g * 8, 8)),
                reference::to_double(V.middleCols(g * 6, 6)),
                reference::Logits{.window = window, .sink_tokens = 2, .softcap = 3, .causal = causal,
                                  .slope = slopes[static_cast<std::size_t>(h)],
                                  .sink = sinks[static_cast<std::size_t>(h)]});
            CAPTURE(h, window, causal, static_cast<int>(layout), rank_of());
            check_close(O.middleCols(h * 6, 6), rows_of(expected.out, mine), tolerance<T>());
        }
    }
    // Tree calls are refused on every rank, and so are ranks that disagree on causal.
    const std::vector<Index> parents(mine.size(), -1);
    expect_all_throw("distributed_causal_softmax_attention", [&] {
        distributed_causal_softmax_attention(MPI_COMM_WORLD, rows_of(Q, mine), rows_of(K, mine), rows_of(V, mine), O,
                                             heads, SoftmaxOptions{.parents = parents}, layout);
    });
    if (size_of() > 1)
        expect_all_throw("distributed_causal_softmax_attention", [&] {
            distributed_causal_softmax_attention(MPI_COMM_WORLD, rows_of(Q, mine), rows_of(K, mine), rows_of(V, mine),
                                                 O, heads, SoftmaxOptions{.causal = rank_of() % 2 == 0}, layout);
        });
}

TEMPLATE_TEST_CASE("sequence-parallel linear attention equals the chunked form", "[mpi][linear]", float, double) {
    using T = TestType;
    const double decay = GENERATE(1.0, 0.97);
    const bool normalize = GENERATE(true, false), with_state = GENERATE(false, true), empty = GENERATE(false, true);
    const Index base = GENERATE(Index(1), Index(70));
    if (empty && size_of() < 2)
        return;
    const std::vector<Index> lengths = shard_lengths(base, empty);
    const Index n = total(lengths);
    const Index d = 12, dv = 9;
    const Matrix<T> Q = random_matrix<T>(n, d, 4), K = random_matrix<T>(n, d, 5), V = random_matrix<T>(n, dv, 6);
    const LinearOptions options{.chunk_size = 16, .eps = 1e-6, .decay = decay, .normalize = normalize};
    const std::vector<Index> mine = tokens_of(lengths, rank_of(), RingLayout::contiguous);
    const auto run = [&](auto phi) {
        LinearState<T> initial;
        if (with_state) {
            initial.mu = random_matrix<T>(phi.output_dim(d), dv, 7, 0.5).cwiseAbs();
            initial.nu = random_matrix<T>(1, phi.output_dim(d), 8, 0.5).cwiseAbs();
        }
        LinearState<T> state = initial;
        if (rank_of() != 0 && with_state) {  // only rank 0's state is read on the way in
            state.mu.setConstant(T(1e30));
            state.nu.resize(3);
        }
        Matrix<T> O(static_cast<Index>(mine.size()), dv);
        distributed_chunked_linear_attention(MPI_COMM_WORLD, rows_of(Q, mine), rows_of(K, mine), rows_of(V, mine), O,
                                             phi, options, &state);
        // The whole sequence in double through the chunked form, from the same state.
        const Matrix<double> Qd = Q.template cast<double>(), Kd = K.template cast<double>(),
                             Vd = V.template cast<double>();
        LinearState<double> expected_state{initial.mu.template cast<double>(), initial.nu.template cast<double>()};
        Matrix<double> expected(n, dv);
        chunked_linear_attention(Qd, Kd, Vd, expected, phi, options, &expected_state);
        CAPTURE(n, decay, normalize, with_state, empty, rank_of());
        check_close(O, rows_of(MatrixD(expected), mine), tolerance<T>());
        check_close(state.mu, expected_state.mu, tolerance<T>());
        check_close(state.nu, expected_state.nu, tolerance<T>());
    };
    run(EluPlusOne{});
    run(SquarePlusOne{});
}

TEMPLATE_TEST_CASE("sequence-parallel gated linear attention equals the chunked form", "[mpi][gated]", float,
                   double) {
    using T = TestType;
    const Index gate_cols = GENERATE(Index(1), Index(12));
    const bool normalize = GENERATE(false, true), with_state = GENERATE(false, true), empty = GENERATE(false, true);
    const Index base = GENERATE(Index(1), Index(70));
    if (empty && size_of() < 2)
        return;
    const std::vector<Index> lengths = shard_lengths(base, empty);
    const Index n = total(lengths);
    const Index d = 12, dv = 9;
    const Matrix<T> Q = random_matrix<T>(n, d, 4).cwiseAbs(), K = random_matrix<T>(n, d, 5).cwiseAbs(),
                    V = random_matrix<T>(n, dv, 6);
    // Gates down to e^-3 per token, and resets (log-gates of -inf) at a few tokens, some on
    // a shard's first token.
    Matrix<T> G = -random_matrix<T>(n, gate_cols, 7, 0.3).cwiseAbs();
    G.col(0) *= T(10);
    for (const Index r : {Index(0), Index(3), base, 2 * base + 1})
        if (r < n)
            G(r, 0) = -std::numeric_limits<T>::infinity();
    const GatedOptions options{.chunk_size = 16, .normalize = normalize, .qk_l2norm = normalize};
    const std::vector<Index> mine = tokens_of(lengths, rank_of(), RingLayout::contiguous);
    LinearState<T> initial;
    if (with_state) {
        initial.mu = random_matrix<T>(d, dv, 8, 0.5);
        initial.nu = random_matrix<T>(1, d, 9, 0.5).cwiseAbs();
    }
    LinearState<T> state = initial;
    if (rank_of() != 0 && with_state) {  // only rank 0's state is read on the way in
        state.mu.setConstant(T(1e30));
        state.nu.resize(3);
    }
    Matrix<T> O(static_cast<Index>(mine.size()), dv);
    distributed_chunked_gated_linear_attention(MPI_COMM_WORLD, rows_of(Q, mine), rows_of(K, mine), rows_of(V, mine),
                                               rows_of(G, mine), O, options, &state);
    // The whole sequence in double through the chunked form, from the same state.
    LinearState<double> expected_state{initial.mu.template cast<double>(), initial.nu.template cast<double>()};
    Matrix<double> expected(n, dv);
    chunked_gated_linear_attention(Q.template cast<double>().eval(), K.template cast<double>().eval(),
                                   V.template cast<double>().eval(), G.template cast<double>().eval(), expected, options,
                                   &expected_state);
    CAPTURE(n, gate_cols, normalize, with_state, empty, rank_of());
    check_close(O, rows_of(MatrixD(expected), mine), tolerance<T>() * 10);
    check_close(state.mu, expected_state.mu, tolerance<T>() * 10);
    check_close(state.nu, expected_state.nu, tolerance<T>() * 10);
    // A positive log-gate on the last rank: every rank throws.
    Matrix<T> bad = rows_of(G, mine);
    if (rank_of() == size_of() - 1 && bad.rows() > 0)
        bad(0, 0) = T(0.5);
    if (lengths.back() > 0)
        expect_all_throw("distributed_chunked_gated_linear_attention", [&] {
            distributed_chunked_gated_linear_attention(MPI_COMM_WORLD, rows_of(Q, mine), rows_of(K, mine),
                                                       rows_of(V, mine), bad, O, options);
        });
    // The shards are the spans: span_tokens is refused on every rank.
    GatedOptions spans = options;
    spans.span_tokens = 64;
    expect_all_throw("distributed_chunked_gated_linear_attention", [&] {
        distributed_chunked_gated_linear_attention(MPI_COMM_WORLD, rows_of(Q, mine), rows_of(K, mine),
                                                   rows_of(V, mine), rows_of(G, mine), O, spans);
    });
}

TEMPLATE_TEST_CASE("sequence-parallel delta rule, gated delta rule and KDA equal the chunked form",
                   "[mpi][delta]", float, double) {
    using T = TestType;
    // 0: the delta rule, 1: the gated delta rule, 2: KDA.
    const int kind = GENERATE(0, 1, 2);
    const bool l2norm = GENERATE(false, true), with_state = GENERATE(false, true), empty = GENERATE(false, true);
    // Shards of 300 tokens or more: past the first piece of a later rank's run (256
    // tokens), after a reset has made its state map 0.
    const Index base = GENERATE(Index(1), Index(70), Index(300));
    if (empty && size_of() < 2)
        return;
    const std::vector<Index> lengths = shard_lengths(base, empty);
    const Index n = total(lengths);
    const Index d = 12, dv = 9;
    // Keys of norm 0.9 or less (the kernel normalises them again under qk_l2norm), so the
    // transitions contract; β across [0, 2] with the negative eigenvalues allowed.
    Matrix<T> K = random_matrix<T>(n, d, 5);
    for (Index t = 0; t < n; ++t)
        K.row(t) *= T(0.9) / std::max(K.row(t).norm(), T(1));
    const Matrix<T> Q = random_matrix<T>(n, d, 4), V = random_matrix<T>(n, dv, 6);
    const Matrix<T> beta = (random_matrix<T>(n, 1, 7).array() + T(1)).matrix();
    Matrix<T> G = -random_matrix<T>(n, kind == 2 ? d : 1, 8, 0.3).cwiseAbs();
    G.col(0) *= T(10);  // gates down to e^-3 per token
    // Resets, some on a shard's first token.
    for (const Index r : {Index(0), Index(3), base, base + 5, 2 * base + 1})
        if (r < n)
            G(r, 0) = -std::numeric_limits<T>::infinity();
    const DeltaOptions options{.chunk_size = 16, .qk_l2norm = l2norm, .allow_negative_eigenvalues = true};
    const std::vector<Index> mine = tokens_of(lengths, rank_of(), RingLayout::contiguous);
    LinearState<T> initial;
    if (with_state)
        initial.mu = random_matrix<T>(d, dv, 9, 0.5);
    LinearState<T> state = initial;
    if (rank_of() != 0 && with_state)  // only rank 0's state is read on the way in
        state.mu.setConstant(T(1e30));
    Matrix<T> O(static_cast<Index>(mine.size()), dv);
    const Matrix<T> q = rows_of(Q, mine), k = rows_of(K, mine), v = rows_of(V, mine), b = rows_of(beta, mine),
                    g = rows_of(G, mine);
    const char* function =
        kind == 2 ? "distributed_chunked_kda_attention" : "distributed_chunked_delta_rule_attention";
    const auto call = [&](const Matrix<T>& gates, Matrix<T>& out, const DeltaOptions& o, LinearState<T>* s) {
        if (kind == 0)
            distributed_chunked_delta_rule_attention(MPI_COMM_WORLD, q, k, v, b, out, o, s);
        else if (kind == 1)
            distributed_chunked_delta_rule_attention(MPI_COMM_WORLD, q, k, v, b, gates, out, o, s);
        else
            distributed_chunked_kda_attention(MPI_COMM_WORLD, q, k, v, b, gates, out, o, s);
    };
    call(g, O, options, &state);
    // The whole sequence in double through the chunked form, from the same state.
    const MatrixD Qd = Q.template cast<double>(), Kd = K.template cast<double>(), Vd = V.template cast<double>(),
                  Bd = beta.template cast<double>(), Gd = G.template cast<double>();
    LinearState<double> expected_state{initial.mu.template cast<double>(), {}};
    MatrixD expected(n, dv);
    if (kind == 0)
        chunked_delta_rule_attention(Qd, Kd, Vd, Bd, expected, options, &expected_state);
    else
        chunked_delta_rule_attention(Qd, Kd, Vd, Bd, Gd, expected, options, &expected_state);
    CAPTURE(n, kind, l2norm, with_state, empty, rank_of());
    check_close(O, rows_of(expected, mine), tolerance<T>() * 10);
    check_close(state.mu, expected_state.mu, tolerance<T>() * 10);
    // The final state: the same bits on every rank.
    Matrix<T> from_last = state.mu;
    MPI_Bcast(from_last.data(), static_cast<int>(from_last.size()), detail::mpi::datatype<T>(), 0, MPI_COMM_WORLD);
    CHECK(from_last == state.mu);
    // A β of 1.5 on the last rank without options.allow_negative_eigenvalues, and a
    // positive log-gate there: every rank throws, and the state is left as it was.
    const LinearState<T> before = state;
    if (lengths.back() > 0) {
        DeltaOptions unit = options;
        unit.allow_negative_eigenvalues = false;
        Matrix<T> beta_bad = b.cwiseMin(T(1));
        if (rank_of() == size_of() - 1)
            beta_bad(0, 0) = T(1.5);
        expect_all_throw(function, [&] {
            if (kind == 0)
                distributed_chunked_delta_rule_attention(MPI_COMM_WORLD, q, k, v, beta_bad, O, unit, &state);
            else if (kind == 1)
                distributed_chunked_delta_rule_attention(MPI_COMM_WORLD, q, k, v, beta_bad, g, O, unit, &state);
            else
                distributed_chunked_kda_attention(MPI_COMM_WORLD, q, k, v, beta_bad, g, O, unit, &state);
        });
        if (kind > 0) {
            Matrix<T> bad = g;
            if (rank_of() == size_of() - 1)
                bad(0, 0) = T(0.5);
            expect_all_throw(function, [&] { call(bad, O, options, &state); });
        }
        CHECK(state.mu == before.mu);
    }
    // KDA takes a log-gate per key channel: one per token is refused on every rank.
    if (kind == 2) {
        const Matrix<T> per_token = g.leftCols(1);
        expect_all_throw(function, [&] { call(per_token, O, options, nullptr); });
    }
}

TEMPLATE_TEST_CASE("ShardedKVCache decodes as KVCache, the same bits on every rank and run", "[mpi][memory]", float,
                   double) {
    using T = TestType;
    const Index n = GENERATE(Index(1), Index(13), Index(300)), d = 16, dv = 11;
    const Matrix<T> Q = random_matrix<T>(n, d, 9), K = random_matrix<T>(n, d, 10), V = random_matrix<T>(n, dv, 11);
    const auto sharded_decode = [&](bool bulk) {
        ShardedKVCache<T> sharded(MPI_COMM_WORLD, d, dv);
        Matrix<T> O(n, dv);
        if (bulk) {  // extend up to the middle, then token by token
            sharded.extend(K.topRows(n / 2), V.topRows(n / 2));
            for (Index i = n / 2; i < n; ++i) {
                sharded.update(K.row(i), V.row(i));
                sharded.attend(Q.row(i), O.row(i));
            }
            return O.bottomRows(n - n / 2).eval();
        }
        for (Index i = 0; i < n; ++i) {
            sharded.update(K.row(i), V.row(i));
            sharded.attend(Q.row(i), O.row(i));
        }
        CHECK(sharded.length() == n);
        CHECK(sharded.local_length() == (n - rank_of() + size_of() - 1) / size_of());
        return O;
    };
    const Matrix<T> O = sharded_decode(false);
    KVCache<T> cache(d, dv);
    Matrix<T> expected(n, dv);
    decode(cache, Q, K, V, expected);
    check_close(O, expected.template cast<double>(), tolerance<T>());
    CHECK(O == sharded_decode(false));                   // every run
    CHECK(sharded_decode(true) == O.bottomRows(n - n / 2));  // extend equals updates
    Matrix<T> first = O;                                     // every rank: rank 0's bits
    MPI_Bcast(first.data(), static_cast<int>(first.size()), detail::mpi::datatype<T>(), 0, MPI_COMM_WORLD);
    CHECK(O == first);
}

TEST_CASE("a bad argument on one rank, or ranks that disagree, make every rank throw", "[mpi][bad]") {
    const int last = size_of() - 1;
    const Index n = 20, d = 8;
    const Matrix<float> Q = random_matrix<float>(n, d, 1), K = random_matrix<float>(n, d, 2),
                        V = random_matrix<float>(n, d, 3);
    Matrix<float> O(n, d);
    SECTION("ring attention: Q of the wrong width on the last rank") {
        const Matrix<float> bad = random_matrix<float>(n, rank_of() == last ? d + 1 : d, 4);
        expect_all_throw("distributed_causal_softmax_attention",
                         [&] { distributed_causal_softmax_attention(MPI_COMM_WORLD, bad, K, V, O); });
    }
    SECTION("ring attention over heads: a layout whose kv_heads does not divide q_heads on the last rank") {
        const HeadLayout heads{2, rank_of() == last ? 3 : 1, 4, 4};
        const Matrix<float> q = random_matrix<float>(n, 8, 6), kv = random_matrix<float>(n, 4, 7);
        Matrix<float> o(n, 8);
        expect_all_throw("distributed_causal_softmax_attention",
                         [&] { distributed_causal_softmax_attention(MPI_COMM_WORLD, q, kv, kv, o, heads); });
    }
    SECTION("ring attention: the window differs on the last rank") {
        if (size_of() < 2)
            return;
        const SoftmaxOptions options{.scale = 0, .window = rank_of() == last ? 5 : 4, .sink_tokens = 0};
        expect_all_throw("distributed_causal_softmax_attention",
                         [&] { distributed_causal_softmax_attention(MPI_COMM_WORLD, Q, K, V, O, options); });
    }
    SECTION("linear attention: a chunk size of 0 on the last rank, then decays that differ") {
        const LinearOptions bad{.chunk_size = rank_of() == last ? 0 : 16};
        expect_all_throw("distributed_chunked_linear_attention",
                         [&] { distributed_chunked_linear_attention(MPI_COMM_WORLD, Q, K, V, O, EluPlusOne{}, bad); });
        if (size_of() < 2)
            return;
        const LinearOptions other{.decay = rank_of() == last ? 0.5 : 1.0};
        expect_all_throw("distributed_chunked_linear_attention", [&] {
            distributed_chunked_linear_attention(MPI_COMM_WORLD, Q, K, V, O, EluPlusOne{}, other);
        });
    }
    SECTION("ShardedKVCache: dims that differ, then a bad query on the last rank") {
        if (size_of() >= 2)
            expect_all_throw("ShardedKVCache",
                             [&] { ShardedKVCache<float> cache(MPI_COMM_WORLD, rank_of() == last ? 9 : 8, 8); });
        ShardedKVCache<float> cache(MPI_COMM_WORLD, d, d);
        cache.update(K.row(0), V.row(0));
        Vector<float> out(d);
        const Vector<float> query = random_matrix<float>(1, rank_of() == last ? d - 1 : d, 5);
        expect_all_throw("ShardedKVCache::attend", [&] { cache.attend(query, out); });
        // The cache is still usable afterwards, on every rank.
        cache.attend(K.row(1), out);
        CHECK(out.allFinite());
    }
    SECTION("ShardedKVCache: lengths past 2^24 that differ by one token are told apart") {
        if (size_of() < 2)
            return;
        // 2^24 and 2^24 + 1 are the same float: the lengths must travel exactly.
        constexpr Index n = Index{1} << 24;
        ShardedKVCache<float> cache(MPI_COMM_WORLD, 1, 1);
        {
            const Matrix<float> ones = Matrix<float>::Ones(n, 1);
            cache.extend(ones, ones);
        }
        if (rank_of() == last)
            cache.update(Vector<float>::Ones(1), Vector<float>::Ones(1));
        Vector<float> out(1);
        expect_all_throw("ShardedKVCache::attend", [&] { cache.attend(Vector<float>::Ones(1), out); });
        if (rank_of() != last)  // the same length everywhere again: attend works
            cache.update(Vector<float>::Ones(1), Vector<float>::Ones(1));
        cache.attend(Vector<float>::Ones(1), out);
        CHECK(out(0) == 1.0f);
    }
}

namespace {

// The bad-input table of the sequence-parallel recurrent forms (tests/bad_input_test.cpp's
// for one process): the delta rule without gates, with N×1 and with N×d gates, KDA, and,
// for the inputs over the state, linear and gated linear attention.
enum class Form { delta, gated_delta, channel_delta, kda, linear, gated_linear };

const char* function_of(Form form) {
    switch (form) {
    case Form::delta:
    case Form::gated_delta:
    case Form::channel_delta:
        return "memattn::distributed_chunked_delta_rule_attention";
    case Form::kda:
        return "memattn::distributed_chunked_kda_attention";
    case Form::linear:
        return "memattn::distributed_chunked_linear_attention";
    case Form::gated_linear:
        break;
    }
    return "memattn::distributed_chunked_gated_linear_attention";
}

/// An argument that views another's storage: an input over the state, or O over Q or
/// over the state.
enum class View { none, q_mu, k_mu, v_mu, beta_mu, gates_mu, gates_nu, o_q, o_mu };

/// One rank's arguments: n = 3 tokens, d = 4, dv = 3, so that Q, K, V, β, O and the
/// gates each fit in the 4×3 state->mu.
template <class T>
struct Args {
    Form form;
    Matrix<T> q, k, v, beta, g, o;
    DeltaOptions options;
    LinearState<T> state;
    View view = View::none;
};

template <class T>
Args<T> valid_args(Form form) {
    const Index n = 3, d = 4, dv = 3;
    const auto seed = 100 * static_cast<std::uint64_t>(rank_of());
    const bool channels = form == Form::channel_delta || form == Form::kda;
    Args<T> a{form,
              random_matrix<T>(n, d, seed + 1),
              random_matrix<T>(n, d, seed + 2),
              random_matrix<T>(n, dv, seed + 3),
              random_matrix<T>(n, 1, seed + 4).cwiseAbs(),
              -random_matrix<T>(n, channels ? d : 1, seed + 5).cwiseAbs(),
              Matrix<T>::Constant(n, dv, T(7)),
              {},
              {random_matrix<T>(d, dv, seed + 6, 0.5), {}}};
    if (form == Form::linear || form == Form::gated_linear)
        a.state.nu = random_matrix<T>(1, d, seed + 7, 0.5).cwiseAbs();
    return a;
}

/// The form's call on a's arguments, with a.view's argument over the other's storage.
template <class T>
void call(Args<T>& a) {
    using Map = Eigen::Map<const Matrix<T>>;
    const auto input = [&](View view, const Matrix<T>& own) {
        return a.view == view ? ConstMatrixRef<T>(Map(a.state.mu.data(), own.rows(), own.cols()))
                              : ConstMatrixRef<T>(own);
    };
    const ConstMatrixRef<T> q = input(View::q_mu, a.q), k = input(View::k_mu, a.k), v = input(View::v_mu, a.v),
                            beta = input(View::beta_mu, a.beta),
                            g = a.view == View::gates_nu ? ConstMatrixRef<T>(Map(a.state.nu.data(), a.g.rows(), 1))
                                                         : input(View::gates_mu, a.g);
    T* const out = a.view == View::o_mu ? a.state.mu.data() : a.view == View::o_q ? a.q.data() : a.o.data();
    Eigen::Map<Matrix<T>> o(out, a.o.rows(), a.o.cols());
    LinearState<T>* const s = &a.state;
    switch (a.form) {
    case Form::delta:
        distributed_chunked_delta_rule_attention(MPI_COMM_WORLD, q, k, v, beta, o, a.options, s);
        break;
    case Form::gated_delta:
    case Form::channel_delta:
        distributed_chunked_delta_rule_attention(MPI_COMM_WORLD, q, k, v, beta, g, o, a.options, s);
        break;
    case Form::kda:
        distributed_chunked_kda_attention(MPI_COMM_WORLD, q, k, v, beta, g, o, a.options, s);
        break;
    case Form::linear:
        distributed_chunked_linear_attention(MPI_COMM_WORLD, q, k, v, o, EluPlusOne{}, LinearOptions{}, s);
        break;
    case Form::gated_linear:
        distributed_chunked_gated_linear_attention(MPI_COMM_WORLD, q, k, v, g, o, GatedOptions{}, s);
        break;
    }
}

/// The rank(s) given the bad argument: the last, rank 0 (whose state alone is read), each
/// of the two in turn, or the last when it is not rank 0.
enum class Where { last, first, both, later };

template <class T>
struct BadArgs {
    std::string name;
    std::vector<Form> forms;
    std::function<void(Args<T>&)> spoil;  ///< on the bad rank only
    std::vector<std::string> needles;     ///< besides the function; none: the call is accepted
    Where where = Where::last;
    bool allow_negative_eigenvalues = false;  ///< on every rank (the ranks must agree)
};

template <class M>
bool same_bits(const M& a, const M& b) {
    return a.rows() == b.rows() && a.cols() == b.cols() &&
           (a.size() == 0 ||
            std::memcmp(a.data(), b.data(), sizeof(typename M::Scalar) * static_cast<std::size_t>(a.size())) == 0);
}

/// Each case on each of its forms: with needles, every rank throws std::invalid_argument
/// with one message (rank 0's), naming the function, the bad rank and every needle, and
/// no argument has changed (O and the state included); without, every rank runs.
template <class T>
void check_bad_args(const std::vector<BadArgs<T>>& table) {
    const int last = size_of() - 1;
    for (const auto& bad : table) {
        std::vector<int> bad_ranks;
        if (bad.where == Where::first || (bad.where == Where::both && last > 0))
            bad_ranks.push_back(0);
        if (bad.where != Where::first && (bad.where != Where::later || last > 0))
            bad_ranks.push_back(last);
        for (const Form form : bad.forms)
            for (const int bad_rank : bad_ranks) {
                CAPTURE(bad.name, function_of(form), static_cast<int>(form), bad_rank, rank_of());
                Args<T> a = valid_args<T>(form);
                a.options.allow_negative_eigenvalues = bad.allow_negative_eigenvalues;
                if (rank_of() == bad_rank)
                    bad.spoil(a);
                const Args<T> before = a;
                std::string message;
                bool threw = false;
                try {
                    call(a);
                } catch (const std::invalid_argument& e) {
                    threw = true;
                    message = e.what();
                }
                CAPTURE(message);
                if (bad.needles.empty()) {
                    CHECK_FALSE(threw);
                    CHECK(a.o.allFinite());
                    continue;
                }
                CHECK(threw);
                CHECK(message == from_rank_0(message));
                CHECK(message.find(function_of(form)) != std::string::npos);
                CHECK(message.find("(on rank " + std::to_string(bad_rank) + " of ") != std::string::npos);
                for (const auto& needle : bad.needles) {
                    CAPTURE(needle);
                    CHECK(message.find(needle) != std::string::npos);
                }
                CHECK(same_bits(a.state.mu, before.state.mu));
                CHECK(same_bits(a.state.nu, before.state.nu));
                CHECK(same_bits(a.o, before.o));
                CHECK(same_bits(a.q, before.q));
                CHECK(same_bits(a.g, before.g));
            }
    }
}

template <class T>
std::vector<BadArgs<T>> recurrent_bad_args() {
    constexpr T nan = std::numeric_limits<T>::quiet_NaN();
    constexpr T inf = std::numeric_limits<T>::infinity();
    using F = Form;
    const std::vector<Form> delta{F::delta, F::gated_delta, F::channel_delta, F::kda},
        gated{F::gated_delta, F::channel_delta, F::kda, F::gated_linear},
        all{F::delta, F::gated_delta, F::channel_delta, F::kda, F::linear, F::gated_linear};
    std::vector<BadArgs<T>> table = {
        {"valid arguments: accepted", all, [](Args<T>&) {}, {}},
        // KDA checks its gates against K first: they take K's shape, so K alone is wrong.
        {"K of another shape than Q", all,
         [](Args<T>& a) {
             a.k = random_matrix<T>(3, 5, 11);
             if (a.form == F::kda)
                 a.g = -random_matrix<T>(3, 5, 12).cwiseAbs();
         },
         {"'K'", "3x5", "3x4"}},
        {"V with other rows", all, [](Args<T>& a) { a.v = random_matrix<T>(2, 3, 13); }, {"'V'", "2x3", "3x4"}},
        {"O of a wrong shape", all, [](Args<T>& a) { a.o = Matrix<T>::Constant(3, 4, T(7)); },
         {"'O'", "3x4", "3x3"}},
        {"beta with two columns", delta, [](Args<T>& a) { a.beta = Matrix<T>::Zero(3, 2); }, {"'beta'", "3x2", "3x1"}},
        {"beta with other rows", delta, [](Args<T>& a) { a.beta = Matrix<T>::Zero(2, 1); }, {"'beta'", "2x1", "3x1"}},
        {"beta > 1", delta, [](Args<T>& a) { a.beta(1, 0) = T(1.5); }, {"'beta'", "1.5", "at row 1", "[0, 1]"}},
        {"beta < 0", delta, [](Args<T>& a) { a.beta(2, 0) = T(-0.5); }, {"'beta'", "-0.5", "at row 2", "[0, 1]"}},
        {"beta NaN", delta, [](Args<T>& a) { a.beta(0, 0) = nan; }, {"'beta'", "nan", "at row 0"}},
        {"beta 2 with allow_negative_eigenvalues: accepted", delta, [](Args<T>& a) { a.beta(1, 0) = T(2); }, {},
         Where::last, true},
        {"beta 2.5 with allow_negative_eigenvalues", delta, [](Args<T>& a) { a.beta(1, 0) = T(2.5); },
         {"'beta'", "2.5", "[0, 2] (options.allow_negative_eigenvalues)"}, Where::last, true},
        {"a log-gate > 0", gated, [](Args<T>& a) { a.g(1, 0) = T(0.5); }, {"'log_gates'", "0.5", "<= 0"}},
        {"a NaN log-gate", gated, [](Args<T>& a) { a.g(2, 0) = nan; }, {"'log_gates'", "nan", "<= 0"}},
        {"log-gates of a wrong shape", gated, [](Args<T>& a) { a.g = Matrix<T>::Zero(3, 2); }, {"'log_gates'", "3x2"}},
        {"log-gates with other rows", gated, [](Args<T>& a) { a.g = Matrix<T>::Zero(2, a.g.cols()); },
         {"'log_gates'", "2x"}},
        {"KDA with a log-gate per token", {F::kda}, [](Args<T>& a) { a.g = Matrix<T>::Zero(3, 1); },
         {"'log_gates'", "3x1", "expected 3x4 (a log-gate per key channel"}},
        {"chunk_size 0", delta, [](Args<T>& a) { a.options.chunk_size = 0; }, {"options.chunk_size", "is 0"}},
        {"NaN scale", delta, [](Args<T>& a) { a.options.scale = static_cast<double>(nan); }, {"options.scale", "nan"}},
        {"infinite scale", delta, [](Args<T>& a) { a.options.scale = -inf; }, {"options.scale", "-inf"}},
        {"l2norm_eps < 0", delta, [](Args<T>& a) { a.options.l2norm_eps = -1; }, {"options.l2norm_eps", "-1"}},
        {"NaN l2norm_eps", delta, [](Args<T>& a) { a.options.l2norm_eps = nan; }, {"options.l2norm_eps", "nan"}},
        {"state->mu of the wrong shape on rank 0", all, [](Args<T>& a) { a.state.mu = Matrix<T>::Zero(3, 3); },
         {"'state->mu'", "3x3", "4x3"}, Where::first},
        {"state->mu of the wrong shape on a later rank (not read): accepted", all,
         [](Args<T>& a) { a.state.mu = Matrix<T>::Zero(3, 3); }, {}, Where::later},
        {"O overlapping Q", delta, [](Args<T>& a) { a.view = View::o_q; }, {"'O'", "'Q'", "must not overlap"},
         Where::both},
        {"O overlapping the state", all, [](Args<T>& a) { a.view = View::o_mu; }, {"'O'", "'state->mu'"},
         Where::both},
        {"Q viewing state->mu", all, [](Args<T>& a) { a.view = View::q_mu; }, {"'state->mu'", "'Q'"}, Where::both},
        {"K viewing state->mu", all, [](Args<T>& a) { a.view = View::k_mu; }, {"'state->mu'", "'K'"}, Where::both},
        {"V viewing state->mu", all, [](Args<T>& a) { a.view = View::v_mu; }, {"'state->mu'", "'V'"}, Where::both},
        {"beta viewing state->mu (values in [0, 1])", delta,
         [](Args<T>& a) {
             a.state.mu = a.state.mu.cwiseAbs();
             a.view = View::beta_mu;
         },
         {"'state->mu'", "'beta'"}, Where::both},
        {"log_gates viewing state->mu (values <= 0)", gated,
         [](Args<T>& a) {
             a.state.mu = -a.state.mu.cwiseAbs();
             a.view = View::gates_mu;
         },
         {"'state->mu'", "'log_gates'"}, Where::both},
        {"log_gates viewing state->nu (zeros)", {F::gated_linear},
         [](Args<T>& a) {
             a.state.nu.setZero();
             a.view = View::gates_nu;
         },
         {"'state->nu'", "'log_gates'"}, Where::both},
    };
    if constexpr (std::is_same_v<T, float>) {  // finite as double, not as float
        table.push_back({"scale 1e39 (not a float)", delta, [](Args<T>& a) { a.options.scale = 1e39; },
                         {"options.scale", "1e+39", "finite as float"}});
        table.push_back({"l2norm_eps 1e39 (not a float)", delta, [](Args<T>& a) { a.options.l2norm_eps = 1e39; },
                         {"options.l2norm_eps", "1e+39", "finite as float"}});
    }
    return table;
}

}  // namespace

TEMPLATE_TEST_CASE("the sequence-parallel recurrent forms refuse the single-process kernels' bad inputs on every "
                   "rank, an input over the state included, and change nothing",
                   "[mpi][bad][delta][kda]", float, double) {
    check_bad_args(recurrent_bad_args<TestType>());
}

int main(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    Catch::Session session;
    int result = session.run(argc, argv);
    // A failure on any rank fails every rank's exit code, so mpirun reports it.
    int worst = 0;
    MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Finalize();
    return worst;
}
