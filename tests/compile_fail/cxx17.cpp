// Must not compile: a C++17 translation unit (memattn needs C++20, its concepts first). The
// build's first error is memattn's one line naming C++20, not "'concept' does not name a
// type" from deep inside a header.
#include <memattn/memattn.hpp>

float first_output(const memattn::Matrix<float>& x) {
    memattn::Matrix<float> out(x.rows(), x.cols());
    memattn::causal_softmax_attention(x, x, x, out);
    return out(0, 0);
}
