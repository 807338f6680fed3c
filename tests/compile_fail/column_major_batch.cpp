// Must not compile: a column-major matrix as a batched call's queries, which the call
// would otherwise copy behind the caller's back (a Ref to const converts it silently).
#include <memattn/memattn.hpp>

#include <vector>

void column_major_queries(memattn::PagedKVCache<float>& pool, const std::vector<memattn::Index>& seqs,
                          const Eigen::MatrixXf& queries, const memattn::Matrix<float>& keys,
                          memattn::Matrix<float>& out) {
    memattn::batched_decode(pool, seqs, queries, keys, keys, out);
}
