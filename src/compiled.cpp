// memattn::compiled (memattn/compiled.hpp): the definitions its users' declarations
// name, from the same lists. Everything here is the headers' own templates, compiled
// once with the flags of the build that makes the library.
#define MEMATTN_COMPILED_SOURCE  // the header's templates, not the overloads that call this file
#include <memattn/compiled.hpp>

#define MEMATTN_COMPILED_DEFINE_CLASS(...) template class __VA_ARGS__;
#define MEMATTN_COMPILED_DEFINE_FUNCTION(...) template decltype(__VA_ARGS__) __VA_ARGS__;
#define MEMATTN_COMPILED_DEFINE_SIGNATURE(result, name, parameters) template result name parameters;
namespace memattn {
MEMATTN_COMPILED_INSTANTIATIONS(MEMATTN_COMPILED_DEFINE_CLASS, MEMATTN_COMPILED_DEFINE_FUNCTION,
                                MEMATTN_COMPILED_DEFINE_SIGNATURE)
}  // namespace memattn

namespace memattn::detail::compiled {

#define MEMATTN_COMPILED_DEFINE_ENTRIES(...)                                                               \
    void decode(__VA_ARGS__& mem, ConstMatrixRef<float> Q, ConstMatrixRef<float> K, ConstMatrixRef<float> V, \
                MatrixRef<float> O) {                                                                      \
        memattn::decode(mem, Q, K, V, O);                                                                  \
    }                                                                                                      \
    void prefill(__VA_ARGS__& mem, ConstMatrixRef<float> Q, ConstMatrixRef<float> K, ConstMatrixRef<float> V, \
                 MatrixRef<float> O) {                                                                     \
        memattn::prefill(mem, Q, K, V, O);                                                                 \
    }                                                                                                      \
    void extend(__VA_ARGS__& mem, ConstMatrixRef<float> K, ConstMatrixRef<float> V) { memattn::extend(mem, K, V); }
#define MEMATTN_COMPILED_DEFINE_MEMORY(unused, ...)                                                        \
    MEMATTN_COMPILED_DEFINE_ENTRIES(__VA_ARGS__)                                                           \
    MEMATTN_COMPILED_DEFINE_ENTRIES(MultiHead<__VA_ARGS__>)
MEMATTN_COMPILED_MEMORIES(MEMATTN_COMPILED_DEFINE_MEMORY, )

void causal_softmax_attention(ConstMatrixRef<float> Q, ConstMatrixRef<float> K, ConstMatrixRef<float> V,
                              MatrixRef<float> O, const SoftmaxOptions& options) {
    memattn::causal_softmax_attention(Q, K, V, O, options);
}

}  // namespace memattn::detail::compiled
