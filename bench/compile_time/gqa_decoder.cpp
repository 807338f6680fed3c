// A toy grouped-query-attention decoder, written as a user would write one against the
// README: the translation unit whose compile time docs/performance.md ("Compile time")
// measures header-only and with memattn::compiled (scripts/compile-time). Three layers
// with different attention memories (a full KV cache, a sliding window, linear
// attention), random weights, a prompt prefilled in one call, then greedy decoding of a
// few tokens, checked against the whole-sequence kernels; a snapshot of the caches
// round-trips through a string stream.
//
// The decoding step calls MultiHead's update and attend, as the README shows; with
// memattn::compiled these inline members still compile here (memattn/compiled.hpp), which
// -DGQA_DECODER_STEP_BY_DECODE avoids by stepping through memattn::decode.
//
//   gqa_decoder [--prompt N] [--steps S]   (prints the last token's logits' checksum)
#include <memattn/memattn.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <variant>
#include <vector>

namespace {

using memattn::Index;
using Mat = memattn::Matrix<float>;
using Row = memattn::Vector<float>;

constexpr Index vocab = 256, model_dim = 256, q_heads = 8, kv_heads = 2, head_dim = 32;
constexpr Index window = 64, sinks = 4;
// Built with -DGQA_DECODER_STEP_BY_DECODE, a decoding step is memattn::decode on one row
// (the same update and attend) instead of the members called directly.
#ifdef GQA_DECODER_STEP_BY_DECODE
constexpr bool step_by_decode = true;
#else
constexpr bool step_by_decode = false;
#endif
constexpr memattn::HeadLayout layout{.q_heads = q_heads, .kv_heads = kv_heads, .head_dim = head_dim};

Mat random_matrix(Index rows, Index cols, std::mt19937& gen, float scale) {
    std::normal_distribution<float> normal(0.f, scale);
    Mat m(rows, cols);
    for (Index i = 0; i < m.size(); ++i)
        m.data()[i] = normal(gen);
    return m;
}

/// x / rms(x), row by row.
void rms_norm(Mat& x) {
    for (Index i = 0; i < x.rows(); ++i) {
        const float rms = std::sqrt(x.row(i).squaredNorm() / static_cast<float>(x.cols()) + 1e-6f);
        x.row(i) /= rms;
    }
}

/// SiLU-gated MLP.
struct Mlp {
    Mat up, gate, down;
    Mlp(std::mt19937& gen)
        : up(random_matrix(model_dim, 2 * model_dim, gen, 0.05f)), gate(random_matrix(model_dim, 2 * model_dim, gen, 0.05f)),
          down(random_matrix(2 * model_dim, model_dim, gen, 0.05f)) {}
    Mat operator()(const Mat& x) const {
        const Mat g = x * gate;
        const Mat silu = (g.array() / (1.f + (-g.array()).exp())).matrix();
        return (silu.array() * (x * up).array()).matrix() * down;
    }
};

using KvLayer = memattn::MultiHead<memattn::KVCache<float>>;
using WindowLayer = memattn::MultiHead<memattn::SlidingWindowCache<float>>;
using LinearLayer = memattn::MultiHead<memattn::LinearAttentionMemory<float>>;

/// One decoder layer: projections, an attention memory per KV head, an MLP.
struct Layer {
    Mat wq, wk, wv, wo;
    Mlp mlp;
    std::variant<KvLayer, WindowLayer, LinearLayer> memory;
    memattn::SoftmaxOptions options;  // what the whole-sequence check uses

    template <class Memory>
    Layer(std::mt19937& gen, Memory m, memattn::SoftmaxOptions opts)
        : wq(random_matrix(model_dim, q_heads * head_dim, gen, 0.05f)),
          wk(random_matrix(model_dim, kv_heads * head_dim, gen, 0.05f)),
          wv(random_matrix(model_dim, kv_heads * head_dim, gen, 0.05f)),
          wo(random_matrix(q_heads * head_dim, model_dim, gen, 0.05f)), mlp(gen), memory(std::move(m)), options(opts) {}

    /// Rows of x are consecutive tokens after those the memory holds.
    Mat forward(const Mat& x, bool first_call) {
        Mat h = x;
        rms_norm(h);
        const Mat q = h * wq, k = h * wk, v = h * wv;
        Mat o(x.rows(), q_heads * head_dim);
        std::visit(
            [&](auto& mem) {
                if (first_call) {
                    memattn::prefill(mem, q, k, v, o);
                } else if (x.rows() == 1 && !step_by_decode) {  // the README's decoding step
                    mem.update(k.row(0), v.row(0));
                    mem.attend(q.row(0), o.row(0));
                } else {
                    memattn::decode(mem, q, k, v, o);
                }
            },
            memory);
        Mat y = x + o * wo;
        Mat z = y;
        rms_norm(z);
        return y + mlp(z);
    }
};

/// The same attention as a layer's memory, recomputed from the whole sequence, head by
/// head, with the whole-sequence kernels.
Mat whole_sequence(const Layer& layer, const Mat& q, const Mat& k, const Mat& v) {
    Mat o(q.rows(), q.cols());
    const Index g = q_heads / kv_heads;
    for (Index h = 0; h < q_heads; ++h) {
        const auto qh = q.middleCols(h * head_dim, head_dim);
        const auto kh = k.middleCols((h / g) * head_dim, head_dim);
        const auto vh = v.middleCols((h / g) * head_dim, head_dim);
        auto oh = o.middleCols(h * head_dim, head_dim);
        if (std::holds_alternative<LinearLayer>(layer.memory))
            memattn::chunked_linear_attention(qh, kh, vh, oh);
        else
            memattn::causal_softmax_attention(qh, kh, vh, oh, layer.options);
    }
    return o;
}

struct Model {
    Mat embedding, unembedding;
    std::vector<Layer> layers;

    explicit Model(std::mt19937& gen)
        : embedding(random_matrix(vocab, model_dim, gen, 1.f)), unembedding(random_matrix(model_dim, vocab, gen, 0.05f)) {
        layers.emplace_back(gen, KvLayer(layout, [](Index) { return memattn::KVCache<float>(head_dim, head_dim); }),
                            memattn::SoftmaxOptions{});
        layers.emplace_back(gen, WindowLayer(layout, [](Index) {
                                return memattn::SlidingWindowCache<float>(head_dim, head_dim, window, sinks);
                            }),
                            memattn::SoftmaxOptions{.window = window, .sink_tokens = sinks});
        layers.emplace_back(gen, LinearLayer(layout, [](Index) {
                                return memattn::LinearAttentionMemory<float>(head_dim, head_dim);
                            }),
                            memattn::SoftmaxOptions{});
    }

    Mat embed(const std::vector<int>& tokens) const {
        Mat x(static_cast<Index>(tokens.size()), model_dim);
        for (std::size_t i = 0; i < tokens.size(); ++i)
            x.row(static_cast<Index>(i)) = embedding.row(tokens[i]);
        return x;
    }

    /// Logits of the last token of `tokens`, which continue what the layers hold.
    Row step(const std::vector<int>& tokens, bool first_call) {
        Mat x = embed(tokens);
        for (Layer& layer : layers)
            x = layer.forward(x, first_call);
        rms_norm(x);
        return x.row(x.rows() - 1) * unembedding;
    }
};

int argmax(const Row& logits) {
    Index best = 0;
    logits.maxCoeff(&best);
    return static_cast<int>(best);
}

}  // namespace

int main(int argc, char** argv) {
    Index prompt = 96, steps = 16;
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string arg = argv[i];
        if (arg == "--prompt")
            prompt = std::atol(argv[i + 1]);
        else if (arg == "--steps")
            steps = std::atol(argv[i + 1]);
    }
    std::mt19937 gen(7);
    Model model(gen);
    std::vector<int> tokens;
    std::uniform_int_distribution<int> token(0, vocab - 1);
    for (Index i = 0; i < prompt; ++i)
        tokens.push_back(token(gen));

    Row logits = model.step(tokens, true);
    for (Index s = 0; s < steps; ++s) {
        tokens.push_back(argmax(logits));
        logits = model.step({tokens.back()}, false);
    }

    // The first layer's attention over the whole sequence, recomputed: the caches' outputs
    // must match the whole-sequence kernel's.
    Layer& first = model.layers.front();
    Mat x = model.embed(tokens);
    rms_norm(x);
    const Mat q = x * first.wq, k = x * first.wk, v = x * first.wv;
    KvLayer fresh(layout, [](Index) { return memattn::KVCache<float>(head_dim, head_dim); });
    Mat o(q.rows(), q.cols());
    memattn::prefill(fresh, q, k, v, o);
    const float error = (o - whole_sequence(first, q, k, v)).cwiseAbs().maxCoeff();

    // Multi-head kernel over the packed buffers, as a batch of one.
    Mat o_layer(q.rows(), q.cols());
    memattn::multi_head_causal_softmax_attention(q, k, v, o_layer, layout);
    const float layer_error = (o_layer - o).cwiseAbs().maxCoeff();

    // Snapshot round trip of the first layer's caches.
    std::stringstream buffer;
    memattn::save(std::get<KvLayer>(first.memory), buffer);
    KvLayer restored(layout, [](Index) { return memattn::KVCache<float>(head_dim, head_dim); });
    memattn::load(restored, buffer);

    std::printf("tokens %zu, cached %ld, logits checksum %.6f, kernel error %.3g, layer error %.3g\n", tokens.size(),
                static_cast<long>(restored.length()), static_cast<double>(logits.sum()), static_cast<double>(error),
                static_cast<double>(layer_error));
    return error < 1e-4f && layer_error < 1e-4f && restored.length() == static_cast<Index>(tokens.size()) ? 0 : 1;
}
