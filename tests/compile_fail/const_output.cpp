// Must not compile: a const matrix as the output (memattn would have to write through a
// const_cast). The build's first error names the rule.
#include <memattn/memattn.hpp>

void write_into_const(const memattn::Matrix<float>& x) {
    const memattn::Matrix<float> out(x.rows(), x.cols());
    memattn::causal_softmax_attention(x, x, x, out);
}
