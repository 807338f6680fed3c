// Must not compile: a column-major matrix as the output.
#include <memattn/memattn.hpp>

void column_major_out(const memattn::Matrix<float>& x, Eigen::MatrixXf& out) {
    memattn::causal_softmax_attention(x, x, x, out);
}
