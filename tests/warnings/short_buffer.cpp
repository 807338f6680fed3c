// A user's call of SoftmaxState::absorb on a buffer shorter than one packet, its size
// known where the call is inlined: GCC 12 at -O3 warned (-Warray-bounds) that Eigen's
// aligned stores of its assignment loop may pass the end of it, though no such store
// runs, and a user's -Werror build failed (the weights are now computed by
// detail::exp_shifted's unaligned packets). Compiled with -Wall -Wextra -Wpedantic
// -Werror at -O3 for every ISA of MEMATTN_TEST_ISAS, Eigen by a plain -I; a unit of its
// own, as small as a user's, so that the call is inlined (in everything.cpp it is not).
#include <memattn/softmax_state.hpp>

#include <vector>

float memattn_fold_few(float shift) {
    std::vector<float> few{0.0f, -0.3f, -1.7f, -0.01f, -9.5f};
    for (float& x : few)
        x -= shift;
    memattn::SoftmaxState<float> state;
    state.absorb(few.data(), 5);
    return state.sum + few[0];
}
