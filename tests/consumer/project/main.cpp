// A user's program: decodes a short sequence with a KV cache and checks one output
// against softmax attention written by hand, runs a grouped-query layer (on every core
// when built with OpenMP) and checks each head against the single-head kernel, and says
// whether it was built with OpenMP: "OpenMP on (<threads> threads)" or "OpenMP off".
#include <memattn/memattn.hpp>

#include <cmath>
#include <cstdio>

#if defined(_OPENMP)
#include <omp.h>
#endif

int main() {
    const memattn::Index n = 5, d = 3;
    memattn::Matrix<float> Q(n, d), K(n, d), V(n, d), O(n, d);
    for (memattn::Index i = 0; i < n; ++i)
        for (memattn::Index j = 0; j < d; ++j) {
            Q(i, j) = std::sin(float(i + 2 * j));
            K(i, j) = std::cos(float(3 * i + j));
            V(i, j) = float(i - j);
        }
    memattn::KVCache<float> cache(d, d);
    memattn::decode(cache, Q, K, V, O);

    // The last token's output, by hand.
    float weights[n], total = 0;
    for (memattn::Index j = 0; j < n; ++j)
        total += weights[j] = std::exp(Q.row(n - 1).dot(K.row(j)) / std::sqrt(float(d)));
    for (memattn::Index c = 0; c < d; ++c) {
        float expected = 0;
        for (memattn::Index j = 0; j < n; ++j)
            expected += weights[j] / total * V(j, c);
        if (std::abs(expected - O(n - 1, c)) > 1e-5f) {
            std::printf("mismatch at column %ld: %g vs %g\n", long(c), double(O(n - 1, c)), double(expected));
            return 1;
        }
    }

    // Four query heads over two KV heads, packed in the columns.
    memattn::HeadLayout layout;
    layout.q_heads = 4;
    layout.kv_heads = 2;
    layout.head_dim = d;
    const memattn::Index rows = 64;
    memattn::Matrix<float> LQ(rows, 4 * d), LK(rows, 2 * d), LV(rows, 2 * d), LO(rows, 4 * d);
    for (memattn::Index i = 0; i < rows; ++i) {
        for (memattn::Index j = 0; j < 4 * d; ++j)
            LQ(i, j) = std::sin(float(i * 7 + j));
        for (memattn::Index j = 0; j < 2 * d; ++j) {
            LK(i, j) = std::cos(float(i * 5 + j));
            LV(i, j) = std::sin(float(i + 3 * j));
        }
    }
    memattn::multi_head_causal_softmax_attention(LQ, LK, LV, LO, layout);
    for (memattn::Index h = 0; h < 4; ++h) {
        const memattn::Index kv = layout.kv_head_of(h);
        const memattn::Matrix<float> q = LQ.middleCols(h * d, d), k = LK.middleCols(kv * d, d),
                                     v = LV.middleCols(kv * d, d);
        memattn::Matrix<float> o(rows, d);
        memattn::causal_softmax_attention(q, k, v, o);
        const float error = (o - LO.middleCols(h * d, d)).cwiseAbs().maxCoeff();
        if (!(error <= 1e-6f)) {
            std::printf("layer head %ld differs from the single-head kernel by %g\n", long(h), double(error));
            return 1;
        }
    }

#if defined(_OPENMP)
#if !defined(EIGEN_DONT_PARALLELIZE)
    std::printf("built with OpenMP but without EIGEN_DONT_PARALLELIZE\n");
    return 1;
#endif
    std::printf("OpenMP on (%d threads)\n", omp_get_max_threads());
#else
    std::printf("OpenMP off\n");
#endif
    std::printf("memattn %d.%d.%d consumer: ok\n", memattn::version_major, memattn::version_minor,
                memattn::version_patch);
    return 0;
}
