#pragma once
// memattn::compiled: the common float instantiations compiled once, in a library,
// instead of in every translation unit that uses them (as {fmt}'s compiled mode does).
// The library stays header-only without it; nothing here changes a result, only where
// the code is compiled.
//
// Linking the CMake target memattn::compiled defines MEMATTN_COMPILED, and
// memattn/memattn.hpp then ends by including this header (include it only that way: it
// declares what the library defines). The lists below (MEMATTN_COMPILED_MEMORIES and
// MEMATTN_COMPILED_INSTANTIATIONS) are expanded here into declarations and in
// src/compiled.cpp into the definitions, so the two cannot drift apart:
//
//   - decode, extend and prefill on every memory of the list and on MultiHead over it,
//     and causal_softmax_attention (without lse), called with float row-major arguments
//     of any expression type (matrices, blocks, Maps, Refs): a more constrained overload
//     below views them (ConstMatrixRef, MatrixRef) and calls a function of the library,
//     which runs the header's template on the views. The views are what the template
//     itself makes first, so the checks, the messages and every bit of the results are
//     the same. Each overload repeats its template's signature: a change to one is a
//     change to the other (tests/compiled/check.cpp calls each, so the build says so).
//   - explicit instantiation declarations (`extern template`) of the memories, of
//     MultiHead's public members over them (the whole class for KVCache), of the inner
//     functions of the linear, gated and delta-rule kernels (over views already), of
//     save/load on streams, and of the lse form of causal_softmax_attention and of the
//     multi-head kernels on Matrix<float> arguments.
//     A compiler may still instantiate an inline member (every member is defined in its
//     class) to inline it, and GCC and Clang do when optimising; what they no longer do
//     is compile their own copy of what they did not inline.
//
// Anything else (double, other memories, a memory's members called directly where not
// declared here) compiles in the user's translation unit as before, with the same code.
//
// The library must be compiled with the same ISA flags (-march) and the same
// MEMATTN_/EIGEN_ definitions as its users: Eigen's vectorised code and memattn's tiles
// differ per ISA, and one program must not hold two different definitions of one
// specialisation (the ODR). memattn::compiled takes the flags of the build that makes
// it, so build it in the consumer's own tree (add_subdirectory or FetchContent).

#include "memattn/memattn.hpp"

#include <concepts>
#include <iosfwd>
#include <type_traits>
#include <utility>

/// The memories memattn::compiled holds, each also as the memory of a MultiHead:
/// X(A, memory type) for each, names relative to namespace memattn; A is passed through.
#define MEMATTN_COMPILED_MEMORIES(X, A)                                                                    \
    X(A, KVCache<float>)                                                                                   \
    X(A, SlidingWindowCache<float>)                                                                        \
    X(A, HybridCache<float>)                                                                               \
    X(A, MovingAverageCache<float>)                                                                        \
    X(A, LinearAttentionMemory<float>)                                                                     \
    X(A, GatedLinearAttentionMemory<float>)                                                                \
    X(A, DeltaRuleMemory<float>)

/// MultiHead<M>'s public members. (The whole class is instantiated for KVCache only: its
/// private members for the other memories' cases do not compile for every memory.)
#define MEMATTN_COMPILED_MULTI_HEAD_MEMBERS(SIGNATURE, ...)                                                \
    SIGNATURE(void, MultiHead<__VA_ARGS__>::update, (ConstRowRef<float>, ConstRowRef<float>))              \
    SIGNATURE(void, MultiHead<__VA_ARGS__>::extend, (ConstMatrixRef<float>, ConstMatrixRef<float>))        \
    SIGNATURE(void, MultiHead<__VA_ARGS__>::prefill,                                                       \
              (ConstMatrixRef<float>, ConstMatrixRef<float>, ConstMatrixRef<float>, MatrixRef<float>))     \
    SIGNATURE(void, MultiHead<__VA_ARGS__>::attend, (ConstRowRef<float>, RowRef<float>) const)             \
    SIGNATURE(void, MultiHead<__VA_ARGS__>::write_snapshot, (snapshot::Writer&) const)                     \
    SIGNATURE(void, MultiHead<__VA_ARGS__>::read_snapshot, (snapshot::Reader&))

/// F(name): one element of a list.
#define MEMATTN_COMPILED_APPLY(F, ...) F(__VA_ARGS__)

/// save/load on streams, of a memory and of MultiHead over it.
#define MEMATTN_COMPILED_SAVE_LOAD_ONE(SIGNATURE, ...)                                                     \
    SIGNATURE(void, save<__VA_ARGS__>, (const __VA_ARGS__&, std::ostream&))                                \
    SIGNATURE(void, load<__VA_ARGS__>, (__VA_ARGS__&, std::istream&))
/// save/load on streams of a memory and of MultiHead over it, both.
#define MEMATTN_COMPILED_SAVE_LOAD(SIGNATURE, ...)                                                         \
    MEMATTN_COMPILED_SAVE_LOAD_ONE(SIGNATURE, __VA_ARGS__)                                                 \
    MEMATTN_COMPILED_SAVE_LOAD_ONE(SIGNATURE, MultiHead<__VA_ARGS__>)

/// A comma inside a macro argument (a template's arguments), expanded after the split.
#define MEMATTN_COMPILED_COMMA ,

/// The explicit instantiations: CLASS(name) for a class template specialisation,
/// FUNCTION(name) for a function template specialisation that its template arguments
/// alone name (one overload), SIGNATURE(result, name, (parameters)) for one that needs
/// its parameters to pick the overload or that is a member. Names are relative to
/// namespace memattn.
#define MEMATTN_COMPILED_INSTANTIATIONS(CLASS, FUNCTION, SIGNATURE)                                        \
    MEMATTN_COMPILED_MEMORIES(MEMATTN_COMPILED_APPLY, CLASS)                                               \
    CLASS(MultiHead<KVCache<float>>)                                                                       \
    MEMATTN_COMPILED_MULTI_HEAD_MEMBERS(SIGNATURE, SlidingWindowCache<float>)                              \
    MEMATTN_COMPILED_MULTI_HEAD_MEMBERS(SIGNATURE, HybridCache<float>)                                     \
    MEMATTN_COMPILED_MULTI_HEAD_MEMBERS(SIGNATURE, MovingAverageCache<float>)                              \
    MEMATTN_COMPILED_MULTI_HEAD_MEMBERS(SIGNATURE, LinearAttentionMemory<float>)                           \
    MEMATTN_COMPILED_MULTI_HEAD_MEMBERS(SIGNATURE, GatedLinearAttentionMemory<float>)                      \
    MEMATTN_COMPILED_MULTI_HEAD_MEMBERS(SIGNATURE, DeltaRuleMemory<float>)                                 \
    MEMATTN_COMPILED_MEMORIES(MEMATTN_COMPILED_SAVE_LOAD, SIGNATURE)                                       \
    /* The kernels' inner functions, over views: every public call of these forms. */                     \
    FUNCTION(detail::chunked_form<float, EluPlusOne>)                                                      \
    FUNCTION(detail::recurrent_form<float, EluPlusOne>)                                                    \
    FUNCTION(detail::quadratic_form<float, EluPlusOne>)                                                    \
    FUNCTION(detail::gated_chunked<float>)                                                                 \
    FUNCTION(detail::gated_recurrent<float>)                                                               \
    FUNCTION(detail::delta_chunked<float>)                                                                 \
    FUNCTION(detail::delta_recurrent<float>)                                                               \
    /* The softmax kernels on matrices: the lse form, and the layer's (whose signature is */              \
    /* still growing: the declaration names only its template arguments). */                              \
    SIGNATURE(void,                                                                                        \
              causal_softmax_attention<detail::compiled::Mat MEMATTN_COMPILED_COMMA detail::compiled::Mat    \
                                           MEMATTN_COMPILED_COMMA detail::compiled::Mat                       \
                                               MEMATTN_COMPILED_COMMA detail::compiled::Mat &                 \
                                                   MEMATTN_COMPILED_COMMA detail::compiled::Vec &>,           \
              (const Eigen::MatrixBase<detail::compiled::Mat>&, const Eigen::MatrixBase<detail::compiled::Mat>&, \
               const Eigen::MatrixBase<detail::compiled::Mat>&, detail::compiled::Mat&, detail::compiled::Vec&, \
               const SoftmaxOptions&))                                                                        \
    FUNCTION(multi_head_causal_softmax_attention<detail::compiled::Mat, detail::compiled::Mat,             \
                                                 detail::compiled::Mat, detail::compiled::Mat&>)           \
    SIGNATURE(void,                                                                                        \
              multi_head_causal_softmax_attention<detail::compiled::Mat MEMATTN_COMPILED_COMMA                \
                                                      detail::compiled::Mat MEMATTN_COMPILED_COMMA            \
                                                          detail::compiled::Mat MEMATTN_COMPILED_COMMA        \
                                                              detail::compiled::Mat & MEMATTN_COMPILED_COMMA  \
                                                                  detail::compiled::Mat &>,                   \
              (const Eigen::MatrixBase<detail::compiled::Mat>&, const Eigen::MatrixBase<detail::compiled::Mat>&, \
               const Eigen::MatrixBase<detail::compiled::Mat>&, detail::compiled::Mat&, detail::compiled::Mat&, \
               const HeadLayout&, const SoftmaxOptions&, const VarLen&, ExecutorRef))                         \
    FUNCTION(multi_head_chunked_linear_attention<detail::compiled::Mat, detail::compiled::Mat,             \
                                                 detail::compiled::Mat, detail::compiled::Mat&>)

namespace memattn::detail::compiled {

using Mat = Matrix<float>;
using Vec = Vector<float>;

/// The memories (and MultiHead over them) whose decode, extend and prefill the library holds.
template <class M>
inline constexpr bool listed = false;

/// An input the library takes as a view: float, row-major (or a vector).
template <class D>
concept Input = std::same_as<typename D::Scalar, float> && row_major_sequence<D>;

/// An output the library takes as a view: float, writable, row-major.
template <class D>
concept Output = std::same_as<typename std::remove_cvref_t<D>::Scalar, float> && writable_expression<D> &&
                 row_major_sequence<std::remove_cvref_t<D>>;

/// \cond
// (The reference shows none of what follows: declarations made by macros undefined after
// use, and the overloads that route a call to the library, described at the top.)
// The library's functions over views: each runs the header's template of the same name.
#define MEMATTN_COMPILED_DECLARE_ENTRIES(...)                                                              \
    template <>                                                                                            \
    inline constexpr bool listed<__VA_ARGS__> = true;                                                      \
    void decode(__VA_ARGS__& mem, ConstMatrixRef<float> Q, ConstMatrixRef<float> K, ConstMatrixRef<float> V, \
                MatrixRef<float> O);                                                                       \
    void prefill(__VA_ARGS__& mem, ConstMatrixRef<float> Q, ConstMatrixRef<float> K, ConstMatrixRef<float> V, \
                 MatrixRef<float> O);                                                                      \
    void extend(__VA_ARGS__& mem, ConstMatrixRef<float> K, ConstMatrixRef<float> V);
#define MEMATTN_COMPILED_DECLARE_MEMORY(unused, ...)                                                       \
    MEMATTN_COMPILED_DECLARE_ENTRIES(__VA_ARGS__)                                                          \
    MEMATTN_COMPILED_DECLARE_ENTRIES(MultiHead<__VA_ARGS__>)
MEMATTN_COMPILED_MEMORIES(MEMATTN_COMPILED_DECLARE_MEMORY, )
#undef MEMATTN_COMPILED_DECLARE_MEMORY
#undef MEMATTN_COMPILED_DECLARE_ENTRIES

void causal_softmax_attention(ConstMatrixRef<float> Q, ConstMatrixRef<float> K, ConstMatrixRef<float> V,
                              MatrixRef<float> O, const SoftmaxOptions& options);

}  // namespace memattn::detail::compiled

#define MEMATTN_COMPILED_DECLARE_CLASS(...) extern template class __VA_ARGS__;
#define MEMATTN_COMPILED_DECLARE_FUNCTION(...) extern template decltype(__VA_ARGS__) __VA_ARGS__;
#define MEMATTN_COMPILED_SIGNATURE(result, name, parameters) extern template result name parameters;
namespace memattn {
MEMATTN_COMPILED_INSTANTIATIONS(MEMATTN_COMPILED_DECLARE_CLASS, MEMATTN_COMPILED_DECLARE_FUNCTION,
                                MEMATTN_COMPILED_SIGNATURE)
}  // namespace memattn
#undef MEMATTN_COMPILED_DECLARE_CLASS
#undef MEMATTN_COMPILED_DECLARE_FUNCTION
#undef MEMATTN_COMPILED_SIGNATURE

// The overloads that send a call to the library: more constrained than the header's
// templates of the same signature, so chosen whenever their constraints hold; for any
// other argument (double, a column-major or const output...) the header's template is
// the one called, with its own diagnostics. src/compiled.cpp, which calls the header's
// templates, does not see them.
#ifndef MEMATTN_COMPILED_SOURCE
namespace memattn {

template <Memory M, class DQ, class DK, class DV, detail::EigenMatrix DO>
    requires detail::compiled::listed<M> && detail::compiled::Input<DQ> && detail::compiled::Input<DK> &&
             detail::compiled::Input<DV> && detail::compiled::Output<DO>
void decode(M& mem, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
            DO&& O) {
    detail::compiled::decode(mem, detail::sequence(Q), detail::sequence(K), detail::sequence(V),
                             detail::output(std::forward<DO>(O)));
}

template <Memory M, class DQ, class DK, class DV, detail::EigenMatrix DO>
    requires detail::compiled::listed<M> && detail::compiled::Input<DQ> && detail::compiled::Input<DK> &&
             detail::compiled::Input<DV> && detail::compiled::Output<DO>
void prefill(M& mem, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
             DO&& O) {
    detail::compiled::prefill(mem, detail::sequence(Q), detail::sequence(K), detail::sequence(V),
                              detail::output(std::forward<DO>(O)));
}

template <Memory M, class DK, class DV>
    requires detail::compiled::listed<M> && detail::compiled::Input<DK> && detail::compiled::Input<DV>
void extend(M& mem, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V) {
    detail::compiled::extend(mem, detail::sequence(K), detail::sequence(V));
}

template <class DQ, class DK, class DV, detail::EigenMatrix DO>
    requires detail::compiled::Input<DQ> && detail::compiled::Input<DK> && detail::compiled::Input<DV> &&
             detail::compiled::Output<DO>
void causal_softmax_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                              const Eigen::MatrixBase<DV>& V, DO&& O, const SoftmaxOptions& options = {}) {
    detail::compiled::causal_softmax_attention(detail::sequence(Q), detail::sequence(K), detail::sequence(V),
                                               detail::output(std::forward<DO>(O)), options);
}

}  // namespace memattn
#endif
/// \endcond
