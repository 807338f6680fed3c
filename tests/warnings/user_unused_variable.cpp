// A user's translation unit with an unused variable of its own, beside memattn's headers,
// Eigen included by a plain -I (not -isystem) for an AVX512-BF16 target. The warning must
// still be reported, and Eigen's own unused variables (its bfloat16 packet code) must not:
// memattn/detail/eigen_core.hpp silences those around its Eigen include only.
#include <memattn/memattn.hpp>

float user_function(const memattn::Matrix<float>& x, memattn::Matrix<float>& out) {
    memattn::KVCache<float, Eigen::bfloat16> cache(x.cols(), x.cols());
    memattn::decode(cache, x, x, x, out);
    const int unused_by_user = 3;  // the user's slip: never read
    return out(0, 0);
}
