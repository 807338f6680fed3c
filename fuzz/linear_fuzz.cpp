// Differential fuzzing of linear attention: the pairs, recurrent and chunked forms, a
// split with the state carried, and LinearAttentionMemory decode and prefill, for every
// feature map, against the double reference.
#include "fuzz_input.hpp"

#include <memattn/memattn.hpp>

namespace {

using namespace memattn;
using fuzz::expect_close;
using reference::MatrixD;
using reference::to_double;

template <class T, class Phi>
void run(fuzz::FuzzInput& in, const Phi& phi, Index n, Index d, Index dv, bool positive) {
    LinearOptions options;
    options.chunk_size = in.size(1, 70);
    options.decay = in.flag() ? 1.0 : 0.05 + 0.95 * std::abs(in.value(1.0));
    options.eps = in.flag() ? 1e-6 : std::abs(in.value(1.0));
    options.normalize = positive && in.flag();  // a sign-indefinite normaliser is ill-conditioned
    const Matrix<T> Q = in.matrix<T>(n, d, 1.0), K = in.matrix<T>(n, d, 1.0), V = in.matrix<T>(n, dv, 1.0);
    const Index f = phi.output_dim(d);
    const MatrixD Qd = to_double(Q), Kd = to_double(K);
    MatrixD Qf(n, f), Kf(n, f);
    phi(Qd, Qf);
    phi(Kd, Kf);
    const auto expected = reference::linear_attention(Qf, Kf, to_double(V), options.decay, options.eps,
                                                      options.normalize);
    // Rounding is relative to the sum of the magnitudes of the terms, not to the result.
    const MatrixD magnitude = reference::linear_attention(Qf.cwiseAbs(), Kf.cwiseAbs(), to_double(V).cwiseAbs(),
                                                          options.decay, options.eps, false)
                                  .out;
    const double scale = options.normalize ? 1.0 : std::max(1.0, magnitude.size() ? magnitude.maxCoeff() : 0.0);
    const double tol = scale * (sizeof(T) == 4 ? 1e-4 : 1e-10);

    Matrix<T> O(n, dv);
    quadratic_linear_attention(Q, K, V, O, phi, options);
    expect_close("quadratic_linear_attention", O, expected.out, tol);
    recurrent_linear_attention(Q, K, V, O, phi, options);
    expect_close("recurrent_linear_attention", O, expected.out, tol);
    LinearState<T> state;
    chunked_linear_attention(Q, K, V, O, phi, options, &state);
    expect_close("chunked_linear_attention", O, expected.out, tol);
    const double state_tol = std::max(1.0, expected.mu.cwiseAbs().maxCoeff()) * (sizeof(T) == 4 ? 1e-4 : 1e-10);
    expect_close("chunked_linear_attention state mu", state.mu, expected.mu, state_tol);

    const Index cut = in.size(0, n);
    LinearState<T> carried;
    Matrix<T> split(n, dv);
    recurrent_linear_attention(Q.topRows(cut), K.topRows(cut), V.topRows(cut), split.topRows(cut), phi, options,
                               &carried);
    chunked_linear_attention(Q.bottomRows(n - cut), K.bottomRows(n - cut), V.bottomRows(n - cut),
                             split.bottomRows(n - cut), phi, options, &carried);
    expect_close("linear attention split", split, expected.out, tol);

    LinearAttentionMemory<T, Phi> stepped(d, dv, phi, options), bulk(d, dv, phi, options);
    Matrix<T> decoded(n, dv), prefilled(n, dv);
    decode(stepped, Q, K, V, decoded);
    expect_close("LinearAttentionMemory decode", decoded, expected.out, tol);
    extend(bulk, K.topRows(cut), V.topRows(cut));
    prefill(bulk, Q.bottomRows(n - cut), K.bottomRows(n - cut), V.bottomRows(n - cut), prefilled.bottomRows(n - cut));
    expect_close("LinearAttentionMemory extend+prefill", prefilled.bottomRows(n - cut),
                 expected.out.bottomRows(n - cut), tol);
}

template <class T>
void pick_map(fuzz::FuzzInput& in) {
    const Index n = in.size(0, 200), d = in.size(1, 12), dv = in.size(1, 12);
    switch (in.size(0, 4)) {
        case 0: return run<T>(in, Identity{}, n, d, dv, false);
        case 1: return run<T>(in, EluPlusOne{}, n, d, dv, true);
        case 2: return run<T>(in, Relu{}, n, d, dv, false);
        case 3: return run<T>(in, Taylor2{}, n, d, dv, true);
        default: {
            const Index m = in.size(1, 32);
            return run<T>(in, FavorPlus(d, m, static_cast<std::uint64_t>(in.size(0, 1000))), n, d, dv, true);
        }
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    fuzz::FuzzInput in(data, size);
    if (in.flag())
        pick_map<float>(in);
    else
        pick_map<double>(in);
    return 0;
}
