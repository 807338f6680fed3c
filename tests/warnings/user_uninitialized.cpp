// A user's translation unit with a real uninitialised read of its own, beside memattn's
// headers. The warning must still be reported: the workaround in
// memattn/detail/eigen_core.hpp may silence GCC's intrinsics header only, never this.
#include <memattn/memattn.hpp>

int user_function(int n, const memattn::Matrix<float>& x, memattn::Matrix<float>& out) {
    memattn::causal_softmax_attention(x, x, x, out);
    int first;
    if (n > 3)
        first = n;
    return first + 1;  // the user's bug: 'first' is uninitialised when n <= 3
}
