// Must not compile: a column-major matrix (Eigen's default) as an input sequence, which
// memattn would otherwise copy behind the caller's back.
#include <memattn/memattn.hpp>

void column_major_keys(const memattn::Matrix<float>& x, const Eigen::MatrixXf& keys, memattn::Matrix<float>& out) {
    memattn::chunked_linear_attention(x, keys, x, out);
}
