// Differential fuzzing of causal softmax attention: the tiled kernel, the kernel with
// its queries split in two calls, KVCache and SlidingWindowCache decode and prefill,
// all against the double reference.
#include "fuzz_input.hpp"

#include <memattn/memattn.hpp>

namespace {

using namespace memattn;
using fuzz::expect_close;
using reference::to_double;

template <class T>
void run(fuzz::FuzzInput& in) {
    const Index nk = in.size(0, 160), nq = in.size(0, nk), d = in.size(1, 40), dv = in.size(1, 40);
    const Index window = in.size(0, nk + 2), sinks = in.size(0, 6);
    const double scale = in.flag() ? 0.0 : in.value(2.0);
    const bool large = in.flag();  // logits up to ~1e4: only finiteness is exact in float
    const double range = large ? 30.0 : 1.0;
    const double tol = large ? (sizeof(T) == 4 ? 5e-2 : 1e-8) : (sizeof(T) == 4 ? 2e-4 : 1e-10);
    const Matrix<T> Q = in.matrix<T>(nq, d, range), K = in.matrix<T>(nk, d, range), V = in.matrix<T>(nk, dv, 1.0);
    const SoftmaxOptions options{scale, window, sinks};
    const auto expected = reference::softmax_attention(to_double(Q), to_double(K), to_double(V), scale, window, sinks);

    Matrix<T> O(nq, dv);
    Vector<T> lse(nq);
    causal_softmax_attention(Q, K, V, O, lse, options);
    expect_close("causal_softmax_attention", O, expected.out, tol);

    // The same queries in two calls: the first `cut` queries see a prefix of the keys.
    const Index cut = in.size(0, nq), offset = nk - nq;
    Matrix<T> split(nq, dv);
    causal_softmax_attention(Q.topRows(cut), K.topRows(offset + cut), V.topRows(offset + cut), split.topRows(cut),
                             options);
    causal_softmax_attention(Q.bottomRows(nq - cut), K, V, split.bottomRows(nq - cut), options);
    expect_close("causal_softmax_attention split", split, to_double(O), tol);

    // Memories: the first `offset` tokens are the prompt already in the memory.
    const auto check_memory = [&](auto mem, const char* name) {
        extend(mem, K.topRows(offset), V.topRows(offset));
        auto copy = mem;
        Matrix<T> decoded(nq, dv), prefilled(nq, dv);
        decode(mem, Q, K.bottomRows(nq), V.bottomRows(nq), decoded);
        expect_close(name, decoded, expected.out, tol);
        prefill(copy, Q, K.bottomRows(nq), V.bottomRows(nq), prefilled);
        expect_close(name, prefilled, expected.out, tol);
        if (mem.length() != nk || copy.length() != nk)
            std::abort();
    };
    const T memory_scale = static_cast<T>(scale);
    if (window == 0)
        check_memory(KVCache<T>(d, dv, memory_scale), "KVCache");
    else
        check_memory(SlidingWindowCache<T>(d, dv, window, sinks, memory_scale), "SlidingWindowCache");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    fuzz::FuzzInput in(data, size);
    if (in.flag())
        run<float>(in);
    else
        run<double>(in);
    return 0;
}
