// Must not compile: a block of a const matrix as the output of a memory's decode.
#include <memattn/memattn.hpp>

void decode_into_const_block(const memattn::Matrix<float>& x, const memattn::Matrix<float>& out) {
    memattn::KVCache<float> cache(x.cols(), x.cols());
    memattn::decode(cache, x, x, x, out.leftCols(x.cols()));
}
