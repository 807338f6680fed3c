// A user's program: decodes a short sequence with a KV cache and checks one output
// against softmax attention written by hand.
#include <memattn/memattn.hpp>

#include <cmath>
#include <cstdio>

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
    std::printf("memattn %d.%d.%d consumer: ok\n", memattn::version_major, memattn::version_minor,
                memattn::version_patch);
    return 0;
}
