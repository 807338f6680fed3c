// memattn::compiled (memattn/compiled.hpp): one program, built twice, linked with the
// library (MEMATTN_COMPILED) and header-only. Each build checks every result against
// tests/reference and prints every output bit (hex floats); tests/compiled/check.cmake
// requires the two printouts to be identical and looks at the object files: what
// compiled.hpp declares is undefined in the compiled build and defined in the other.
#include <memattn/memattn.hpp>

#include "reference/reference.hpp"

#include <cmath>
#include <cstdio>
#include <random>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>

namespace {

using memattn::Index;
using Mat = memattn::Matrix<float>;
using Vec = memattn::Vector<float>;
namespace ref = memattn::reference;

// Members taken by address, so that each build must refer to an out-of-line definition:
// the library's in the compiled build (undefined here), the header's in the other.
using AttendMember = void (memattn::KVCache<float>::*)(memattn::ConstRowRef<float>, memattn::RowRef<float>) const;
using LayerAttendMember = void (memattn::MultiHead<memattn::KVCache<float>>::*)(memattn::ConstRowRef<float>,
                                                                                memattn::RowRef<float>) const;
volatile AttendMember kv_attend = &memattn::KVCache<float>::attend;
volatile LayerAttendMember layer_attend = &memattn::MultiHead<memattn::KVCache<float>>::attend;
using WindowLayer = memattn::MultiHead<memattn::SlidingWindowCache<float>>;
void (*volatile save_windows)(const WindowLayer&, std::ostream&) = &memattn::save<WindowLayer>;
void (*volatile softmax_with_lse)(const Eigen::MatrixBase<Mat>&, const Eigen::MatrixBase<Mat>&,
                                  const Eigen::MatrixBase<Mat>&, Mat&, Vec&, const memattn::SoftmaxOptions&) =
    &memattn::causal_softmax_attention<Mat, Mat, Mat, Mat&, Vec&>;

int failures = 0;

Mat random_matrix(Index rows, Index cols, std::mt19937& gen) {
    std::normal_distribution<float> normal(0.f, 1.f);
    Mat m(rows, cols);
    for (Index i = 0; i < m.size(); ++i)
        m.data()[i] = normal(gen);
    return m;
}

/// Prints every bit of `m` under `name` and checks it against `expected` (|error| <= tol).
template <class D>
void report(const char* name, const Eigen::MatrixBase<D>& m, const ref::MatrixD& expected, double tol = 2e-5) {
    std::printf("%s", name);
    for (Index i = 0; i < m.rows(); ++i)
        for (Index j = 0; j < m.cols(); ++j)
            std::printf(" %a", static_cast<double>(m(i, j)));
    std::printf("\n");
    const double error = (ref::to_double(m) - expected).cwiseAbs().maxCoeff();
    if (!(error <= tol)) {
        std::printf("FAILED %s: max error %g against the reference\n", name, error);
        ++failures;
    }
}

ref::MatrixD elu_plus_one(const Mat& x) {
    ref::MatrixD f = ref::to_double(x);
    for (Index i = 0; i < f.size(); ++i)
        f.data()[i] = f.data()[i] > 0 ? f.data()[i] + 1 : std::exp(f.data()[i]);
    return f;
}

/// Each query head of a packed [tokens, heads·d] layout against the single-head reference.
ref::MatrixD layer_reference(const Mat& Q, const Mat& K, const Mat& V, const memattn::HeadLayout& layout,
                             Index window = 0, Index sinks = 0) {
    const Index d = layout.head_dim, g = layout.group_size();
    ref::MatrixD out(Q.rows(), Q.cols());
    for (Index h = 0; h < layout.q_heads; ++h)
        out.middleCols(h * d, d) = ref::softmax_attention(ref::to_double(Q.middleCols(h * d, d)),
                                                          ref::to_double(K.middleCols(h / g * d, d)),
                                                          ref::to_double(V.middleCols(h / g * d, d)), 0, window, sinks)
                                       .out;
    return out;
}

}  // namespace

int main() {
#ifdef MEMATTN_COMPILED
    std::printf("# built with memattn::compiled\n");
#else
    std::printf("# built header-only\n");
#endif
    std::mt19937 gen(11);
    const Index n = 40, d = 16;
    const Mat Q = random_matrix(n, d, gen), K = random_matrix(n, d, gen), V = random_matrix(n, d, gen);
    const ref::MatrixD full = ref::softmax_attention(ref::to_double(Q), ref::to_double(K), ref::to_double(V)).out;

    // KVCache<float>: decode, then prefill of a second cache, then one attend by address.
    memattn::KVCache<float> cache(d, d);
    Mat O(n, d);
    memattn::decode(cache, Q, K, V, O);
    report("kv_decode", O, full);
    memattn::KVCache<float> prefilled(d, d);
    memattn::prefill(prefilled, Q, K, V, O);
    report("kv_prefill", O, full);
    Vec last(d);
    (cache.*kv_attend)(Q.row(n - 1), last);
    report("kv_attend", last, full.bottomRows(1));

    // The kernels on blocks of a wider buffer and on matrices, and the lse form.
    Mat wide(n, 3 * d);
    wide << Q, K, V;
    Mat O2(n, 2 * d);
    memattn::causal_softmax_attention(wide.middleCols(0, d), wide.middleCols(d, d), wide.middleCols(2 * d, d),
                                      O2.middleCols(d, d), {.window = 8, .sink_tokens = 2});
    report("softmax_blocks", O2.middleCols(d, d),
           ref::softmax_attention(ref::to_double(Q), ref::to_double(K), ref::to_double(V), 0, 8, 2).out);
    Vec lse(n);
    softmax_with_lse(Q, K, V, O, lse, {});
    report("softmax_lse_out", O, full);
    const ref::SoftmaxResult with_lse = ref::softmax_attention(ref::to_double(Q), ref::to_double(K), ref::to_double(V));
    report("softmax_lse", lse, Eigen::Map<const ref::RowD>(with_lse.lse.data(), n));

    // A grouped-query layer: 4 query heads over 2 KV heads of width 8.
    const memattn::HeadLayout layout{.q_heads = 4, .kv_heads = 2, .head_dim = 8};
    const Mat Qh = random_matrix(n, 32, gen), Kh = random_matrix(n, 16, gen), Vh = random_matrix(n, 16, gen);
    const ref::MatrixD heads = layer_reference(Qh, Kh, Vh, layout);
    Mat Oh(n, 32);
    memattn::multi_head_causal_softmax_attention(Qh, Kh, Vh, Oh, layout);
    report("layer_kernel", Oh, heads);
    memattn::MultiHead<memattn::KVCache<float>> layer(layout, [](Index) { return memattn::KVCache<float>(8, 8); });
    memattn::prefill(layer, Qh.topRows(n - 1), Kh.topRows(n - 1), Vh.topRows(n - 1), Oh.topRows(n - 1));
    layer.update(Kh.row(n - 1), Vh.row(n - 1));
    (layer.*layer_attend)(Qh.row(n - 1), Oh.row(n - 1));
    report("layer_kv_cache", Oh, heads);

    // Sliding windows per KV head; saved and loaded, the copy continues the same.
    WindowLayer windows(
        layout, [](Index) { return memattn::SlidingWindowCache<float>(8, 8, 6, 1); });
    memattn::prefill(windows, Qh.topRows(30), Kh.topRows(30), Vh.topRows(30), Oh.topRows(30));
    std::stringstream saved;
    save_windows(windows, saved);
    WindowLayer loaded(
        layout, [](Index) { return memattn::SlidingWindowCache<float>(8, 8, 6, 1); });
    memattn::load(loaded, saved);
    memattn::decode(loaded, Qh.bottomRows(n - 30), Kh.bottomRows(n - 30), Vh.bottomRows(n - 30), Oh.bottomRows(n - 30));
    report("layer_sliding_window", Oh, layer_reference(Qh, Kh, Vh, layout, 6, 1));

    // Linear attention: a memory fed by extend, then prefill; the chunked kernel.
    memattn::LinearAttentionMemory<float> linear(d, d);
    memattn::extend(linear, K.topRows(10), V.topRows(10));
    memattn::prefill(linear, Q.bottomRows(n - 10), K.bottomRows(n - 10), V.bottomRows(n - 10), O.bottomRows(n - 10));
    const ref::MatrixD linear_ref = ref::linear_attention(elu_plus_one(Q), elu_plus_one(K), ref::to_double(V)).out;
    report("linear_memory", O.bottomRows(n - 10), linear_ref.bottomRows(n - 10), 1e-4);
    memattn::chunked_linear_attention(Q, K, V, O);
    report("linear_kernel", O, linear_ref, 1e-4);

    // The checks run where the code runs: a bad call throws the header's message.
    try {
        memattn::decode(cache, Q, K, V.leftCols(d - 1), O);
        std::printf("FAILED: decode accepted V of the wrong width\n");
        ++failures;
    } catch (const std::invalid_argument& e) {
        std::printf("error %s\n", e.what());
    }
    return failures == 0 ? 0 : 1;
}
