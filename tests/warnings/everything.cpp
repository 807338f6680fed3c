// A user's translation unit that instantiates every kernel and every memory of memattn:
// the kernels and the plain caches for float and (in the default target's unit) double,
// the rest (the same template code in either scalar) for float. The build compiles it with
// -Wall -Wextra -Wpedantic -Werror at -O3 for the default target and sapphirerapids
// (AVX-512 with BF16 and FP16) and at -O2 for x86-64-v3 (AVX2), Eigen by a plain -I, so a warning that
// memattn's headers (or Eigen's) cause in a user's optimised build on any of them fails
// the build. The layers, the paged pool and the model cache (MEMATTN_WARNINGS_LAYERS)
// compose the kernels and memories, adding no code of an instruction set's own: the
// sapphirerapids unit compiles them, the default and x86-64-v3 units do not
// (tests/CMakeLists.txt); so does multi-head latent attention (float only).
// It is compiled, not run: it needs only to instantiate, so it works on any CPU.
#include <memattn/memattn.hpp>

#include <cstdint>
#include <span>
#include <sstream>
#include <type_traits>
#include <vector>

namespace {

template <class T, class Phi>
void linear_forms(const memattn::Matrix<T>& x, memattn::Matrix<T>& out, const Phi& phi) {
    memattn::LinearState<T> state;
    memattn::quadratic_linear_attention(x, x, x, out, phi, {}, &state);
    memattn::recurrent_linear_attention(x, x, x, out, phi, {.decay = 0.9}, &state);
    memattn::chunked_linear_attention(x, x, x, out, phi, {.normalize = false}, &state);
    memattn::LinearAttentionMemory<T, Phi> memory(x.cols(), x.cols(), phi);
    memattn::prefill(memory, x, x, x, out);
    memattn::decode(memory, x, x, x, out);
    memattn::extend(memory, x, x);
}

template <class M, class T>
void use_memory(M memory, const memattn::Matrix<T>& x, memattn::Matrix<T>& out) {
    memattn::decode(memory, x, x, x, out);
    memattn::extend(memory, x, x);
    memattn::prefill(memory, x, x, x, out);
    memory.attend(x.row(0), out.row(0));
    std::stringstream snapshot;
    memattn::save(memory, snapshot);
    memattn::load(memory, snapshot);
    memory.reset();
}

/// A memory whose key rows are wider than its queries (gate columns).
template <class M, class T, class K>
void use_memory(M memory, const memattn::Matrix<T>& x, const K& keys, memattn::Matrix<T>& out) {
    memattn::decode(memory, x, keys, x, out);
    memattn::prefill(memory, x, keys, x, out);
    std::stringstream snapshot;
    memattn::save(memory, snapshot);
    memattn::load(memory, snapshot);
}

/// A layer's memory: queries (and outputs) twice as wide as the keys (and values).
template <class M, class Q, class K, class T>
void use_memory(M memory, const Q& q_half, const K& k, memattn::Matrix<T>& out) {
    const memattn::Matrix<T> q = memattn::Matrix<T>::Zero(q_half.rows(), 2 * q_half.cols());
    memattn::decode(memory, q, k, k, out);
    memattn::extend(memory, k, k);
    memattn::prefill(memory, q, k, k, out);
    memory.attend(q.row(0), out.row(0));
    memory.reset();
}

/// The layer: both multi-head kernels and MultiHead over each kind of memory.
template <class T>
void layer(const memattn::Matrix<T>& x, memattn::Matrix<T>& out, memattn::Index d) {
    const memattn::HeadLayout layout{2, 1, d / 2};
    const auto k = x.leftCols(d / 2);
    memattn::Matrix<T> lse(x.rows(), 2);
    const std::vector<memattn::Index> offsets{0, x.rows() / 2, x.rows()};
    memattn::multi_head_causal_softmax_attention(x, k, k, out, layout, {.window = 4}, {offsets, offsets});
    memattn::multi_head_causal_softmax_attention(x, k, k, out, lse, layout);
    std::vector<memattn::LinearState<T>> states(2);
    memattn::multi_head_chunked_linear_attention(x, k, k, out, layout, memattn::EluPlusOne{}, {}, std::span(states),
                                                 {offsets, offsets});
    const memattn::Index h = d / 2;
    use_memory(memattn::MultiHead<memattn::KVCache<T>>(layout, [h](memattn::Index) { return memattn::KVCache<T>(h, h); }),
               x.leftCols(h), k, out);
    use_memory(memattn::MultiHead<memattn::SlidingWindowCache<T>>(
                   layout, [h](memattn::Index) { return memattn::SlidingWindowCache<T>(h, h, 4, 1); }),
               x.leftCols(h), k, out);
    use_memory(memattn::MultiHead<memattn::HybridCache<T>>(
                   layout, [h](memattn::Index) { return memattn::HybridCache<T>(h, h, 4, 2, 3); }),
               x.leftCols(h), k, out);
    use_memory(memattn::MultiHead<memattn::SparseKVCache<T>>(
                   layout, [h](memattn::Index) { return memattn::SparseKVCache<T>(h, h, {.block = 2, .top_k_blocks = 1}); }),
               x.leftCols(h), k, out);
    use_memory(memattn::MultiHead<memattn::LinearAttentionMemory<T>>(
                   layout, [h](memattn::Index) { return memattn::LinearAttentionMemory<T>(h, h); }),
               x.leftCols(h), k, out);
    // Compact caches in a layer: the grouped attend that converts each stored row once,
    // and the split over an executor.
    static const memattn::SerialExecutor serial;
    memattn::MultiHead<memattn::KVCache<T, memattn::Q8>> q8(
        layout, [h](memattn::Index) { return memattn::KVCache<T, memattn::Q8>(h, h); });
    q8.set_executor(serial);
    q8.reserve(x.rows());
    use_memory(q8, x.leftCols(h), k, out);
    use_memory(memattn::MultiHead<memattn::KVCache<T, Eigen::bfloat16>>(
                   layout, [h](memattn::Index) { return memattn::KVCache<T, Eigen::bfloat16>(h, h); }),
               x.leftCols(h), k, out);
    use_memory(memattn::MultiHead<memattn::SlidingWindowCache<T, Eigen::half>>(
                   layout, [h](memattn::Index) { return memattn::SlidingWindowCache<T, Eigen::half>(h, h, 4, 1); }),
               x.leftCols(h), k, out);
}

template <class T>
void everything(memattn::Index n, memattn::Index d) {
    const memattn::Matrix<T> x = memattn::Matrix<T>::Random(n, d);
    memattn::Matrix<T> out(n, d);
    memattn::Vector<T> lse(n);
    memattn::causal_softmax_attention(x, x, x, out);
    memattn::causal_softmax_attention(x, x, x, out, lse, {.window = 4, .sink_tokens = 1});
    const double one = 0.5;
    memattn::causal_softmax_attention(x, x, x, out, lse,
                                      {.softcap = 2, .causal = false, .sink_logits = std::span<const double>(&one, 1),
                                       .alibi_slopes = std::span<const double>(&one, 1)});
    const std::vector<memattn::Index> tree(static_cast<std::size_t>(n), -1);
    memattn::causal_softmax_attention(x, x, x, out, {.parents = tree});
    memattn::causal_softmax_attention(x, x, x, out, {}, T(2) * x * x.transpose());  // a bias expression
    const Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> mask =
        Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>::Constant(n, n, true);
    memattn::causal_softmax_attention(x, x, x, out, {.causal = false}, mask);
    if constexpr (std::is_same_v<T, float>) {  // 16-bit inputs (bfloat16 products where the target has them)
        const memattn::Matrix<Eigen::bfloat16> b = x.template cast<Eigen::bfloat16>();
        const memattn::Matrix<Eigen::half> h = x.template cast<Eigen::half>();
        memattn::Matrix<Eigen::bfloat16> out_b(n, d);
        memattn::causal_softmax_attention(b, b, b, out_b, {.window = 4, .sink_tokens = 1});
        memattn::causal_softmax_attention(b, b, b, out, lse, {.softcap = 2});
        memattn::causal_softmax_attention(b, b, b, out, {.causal = false}, mask);
        memattn::causal_softmax_attention(h, h, h, out, {}, T(2) * x * x.transpose());
        memattn::LinearState<float> state;
        memattn::chunked_linear_attention(b, b, b, out_b, memattn::EluPlusOne{}, {}, &state);
        memattn::recurrent_linear_attention(h, h, h, out);
        memattn::quadratic_linear_attention(b, b, b, out);
        const memattn::Matrix<float> gates = memattn::Matrix<float>::Constant(n, 1, -0.5f);
        const memattn::Matrix<Eigen::bfloat16> beta = memattn::Matrix<Eigen::bfloat16>::Constant(n, 1, Eigen::bfloat16(0.5f));
        memattn::chunked_gated_linear_attention(b, b, b, gates, out, {}, &state);
        memattn::recurrent_gated_linear_attention(h, h, h, gates.template cast<Eigen::half>(), out);
        memattn::chunked_delta_rule_attention(b, b, b, beta, out_b);
        memattn::recurrent_delta_rule_attention(b, b, b, beta, gates, out);
        const memattn::Matrix<float> channel_gates = memattn::Matrix<float>::Constant(n, d, -0.5f);
        memattn::chunked_kda_attention(b, b, b, beta, channel_gates, out_b);
        memattn::multi_head_causal_softmax_attention(b, b, b, out_b, memattn::HeadLayout{1, 1, d});
        memattn::multi_head_chunked_linear_attention(h, h, h, out, memattn::HeadLayout{1, 1, d});
    }
    const memattn::Rope rope{.head_dim = d, .scaling = memattn::Rope::Yarn{.factor = 2}};
    std::vector<memattn::Index> positions(static_cast<std::size_t>(n), 3);
    rope.apply(out, positions);
    memattn::RopeTable<T>(rope, n).apply(out, positions);

    linear_forms<T>(x, out, memattn::EluPlusOne{});
    linear_forms<T>(x, out, memattn::FavorPlus(d, 2 * d, 7));  // its own code per scalar
    if constexpr (std::is_same_v<T, float>) {  // the other maps, once: compile time is the cost here
        linear_forms<T>(x, out, memattn::Identity{});
        linear_forms<T>(x, out, memattn::Relu{});
        linear_forms<T>(x, out, memattn::Taylor2{});
    }
    use_memory(memattn::KVCache<T>(d, d), x, out);
    use_memory(memattn::SlidingWindowCache<T>(d, d, 4, 1), x, out);
    use_memory(memattn::SparseKVCache<T>(d, d, {.block = 2, .top_k_blocks = 1, .window = 2, .sinks = 1}), x, out);
#if defined(MEMATTN_WARNINGS_LAYERS)
    // Multi-head latent attention, in float: the cache (compactly too), the absorbed step and
    // both prefills compose the tile kernels and products, adding no code of an instruction
    // set's own (as the layers: the AVX-512 unit).
    if constexpr (std::is_same_v<T, float>) {
        const double sink[1] = {0.5};
        memattn::LatentKVCache<T> latent(d, 2, T(0.1), {.softcap = 3, .sink_logits = sink});
        latent.extend(x, x.leftCols(2));
        latent.update(x.row(0), x.row(0).head(2));
        const memattn::Matrix<T> packed = memattn::Matrix<T>::Zero(4, d + 2), q_nope = memattn::Matrix<T>::Zero(4, 3),
                                 W_UK = memattn::Matrix<T>::Zero(12, d), W_UV = memattn::Matrix<T>::Zero(8, d);
        memattn::Matrix<T> latent_out(4, d), mla_out(4, 2);
        latent.attend(packed, latent_out);
        memattn::mla_decode(latent, q_nope, packed.leftCols(2), W_UK, W_UV, mla_out);
        memattn::mla_prefill(latent, q_nope, packed.leftCols(2), x.topRows(1), x.topRows(1).leftCols(2), W_UK, W_UV,
                             mla_out);
        memattn::mla_prefill(latent, q_nope, packed.leftCols(2), x.topRows(1), x.topRows(1).leftCols(2), W_UK, W_UV,
                             mla_out, {}, memattn::MlaPrefill::expanded);
        std::stringstream snapshot;
        memattn::save(latent, snapshot);
        memattn::load(latent, snapshot);
        latent.truncate(1);
        memattn::LatentKVCache<T, Eigen::bfloat16> bf16_latent(d, 2, T(0.1));
        bf16_latent.extend(x, x.leftCols(2));
        bf16_latent.attend(packed, latent_out);
        memattn::LatentKVCache<T, memattn::Fp8E4M3> fp8_latent(d, 2, T(0.1));
        fp8_latent.extend(x, x.leftCols(2));
        fp8_latent.attend(packed, latent_out);
        // The pool of them: a fork's copy-on-write, a batch's step, the prefill on a sequence.
        memattn::PagedLatentKVCache<T, Eigen::bfloat16> pool(d, 2, T(0.1), 4, 2, {.sink_logits = sink});
        const memattn::Index a = pool.add_sequence();
        pool.extend(a, x, x.leftCols(2));
        const memattn::Index b = pool.fork(a);
        const memattn::Index pair[2] = {a, b};
        memattn::Matrix<T> pool_out(8, 2), pool_latent(8, d);
        pool.decode(pair, memattn::Matrix<T>::Zero(8, d + 2), x.topRows(2), x.topRows(2).leftCols(2), pool_latent);
        memattn::mla_decode(pool, pair, memattn::Matrix<T>::Zero(8, 3), memattn::Matrix<T>::Zero(8, 2), W_UK, W_UV,
                            pool_out);
        memattn::mla_prefill(pool.sequence(b), q_nope, packed.leftCols(2), x.topRows(1), x.topRows(1).leftCols(2), W_UK,
                             W_UV, mla_out);
        memattn::save(pool.sequence(b), snapshot);
        pool.truncate(b, 1);
        pool.remove(a);
        // The recurrent layers' states of many sequences, with checkpoints.
        memattn::StatePool<memattn::GatedLinearAttentionMemory<T>> states(2, memattn::GatedLinearAttentionMemory<T>(d, d),
                                                                          {.checkpoint_tokens = 2});
        const memattn::Index s0 = states.add(), s1 = states.fork(s0);
        const memattn::Index both[2] = {s0, s1};
        memattn::Matrix<T> gated_keys = memattn::Matrix<T>::Zero(2, d + 1), gated_out(2, d);
        states.decode(both, x.topRows(2), gated_keys, x.topRows(2), gated_out);
        states.truncate(s1, states.checkpoint_before(s1, 1));
        memattn::save(states.sequence(s0), snapshot);
    }
#endif
    // The rest is the same template code in double as in float (no double-only packet
    // path): float alone, since compile time is the cost of this unit.
    if constexpr (std::is_same_v<T, float>) {
#if defined(MEMATTN_WARNINGS_LAYERS)
        layer<T>(x, out, d);
#endif
        use_memory(memattn::MovingAverageCache<T>(d, d, 4), x, out);
        use_memory(memattn::MovingAverageCache<T>(d, d, 0), x, out);
        use_memory(memattn::MovingAverageCache<T>::exponential(d, d, T(0.5)), x, out);
        use_memory(memattn::HybridCache<T>(d, d, 4, 2, 3), x, out);
        use_memory(memattn::HybridCache<T, memattn::MaxPool>(d, d, 4, 2, 3), x, out);
        use_memory(memattn::HybridCache<T, memattn::WeightedPool>(d, d, 4, 2, 3, T(0), memattn::WeightedPool({0.5, 0.5})),
                   x, out);
        // The softmax memories with the logit options.
        {
            const double one_value[1] = {0.5};
            const memattn::SoftmaxOptions single{.softcap = 3, .sink_logits = one_value, .alibi_slopes = one_value};
            use_memory(memattn::KVCache<T>(d, d, single), x, out);
            use_memory(memattn::KVCache<T, Eigen::bfloat16>(d, d, single), x, out);
            memattn::SoftmaxOptions windowed = single;
            windowed.window = 4;
            windowed.sink_tokens = 1;
            use_memory(memattn::SlidingWindowCache<T, memattn::Q8>(d, d, windowed), x, out);
            use_memory(memattn::HybridCache<T>(d, d, 4, 2, 0, single), x, out);
            use_memory(memattn::SparseKVCache<T, memattn::Q8>(d, d, {.block = 2, .top_k_blocks = 1}, single), x, out);
        }
#if defined(MEMATTN_WARNINGS_LAYERS)
        // The paged pool with a window and the logit options, in float and compactly; a
        // model cache; a layer of caches with the options.
        {
            const memattn::HeadLayout heads{.q_heads = 2, .kv_heads = 1, .head_dim = d};
            const double values[2] = {0.5, 0.25};
            const memattn::SoftmaxOptions options{.window = 4, .sink_tokens = 1, .softcap = 3,
                                                  .sink_logits = values, .alibi_slopes = values};
            memattn::PagedKVCache<T> pool(heads, 8, 4, options);
            memattn::PagedKVCache<T, memattn::Q8> compact(heads, 8, 4, options);
            const std::vector<memattn::Index> seqs{pool.add_sequence()}, offsets{0, 1};
            compact.add_sequence();
            memattn::Matrix<T> q = memattn::Matrix<T>::Zero(1, 2 * d), o(1, 2 * d);
            memattn::batched_decode(pool, seqs, q, x.topRows(1), x.topRows(1), o);
            memattn::batched_decode(compact, seqs, q, x.topRows(1), x.topRows(1), o);
            memattn::batched_prefill(pool, seqs, offsets, q, x.topRows(1), x.topRows(1), o);
            // A prompt of n rows through the tiled prefill, compactly, and a model cache of both layers.
            const std::vector<memattn::Index> prompt_offsets{0, n};
            const memattn::Matrix<T> prompt_q = memattn::Matrix<T>::Zero(n, 2 * d);
            memattn::Matrix<T> prompt_o(n, 2 * d);
            memattn::batched_prefill(compact, seqs, prompt_offsets, prompt_q, x, x, prompt_o);
            const std::vector<memattn::ModelLayer> model_layers{{.layout = heads, .blocks = 8, .block_size = 4},
                                                                {.layout = heads, .blocks = 8, .block_size = 4, .options = options}};
            memattn::ModelCache<T> model(model_layers);
            const memattn::Index id = model.add_sequence();
            const auto& step = model.plan_decode(std::vector<memattn::Index>{id});
            model.decode(0, step, q, x.topRows(1), x.topRows(1), o);
            model.prefill(1, step, q, x.topRows(1), x.topRows(1), o);
            std::stringstream model_snapshot;
            memattn::save(model.sequence(id), model_snapshot);
            auto resumed = model.sequence(model.add_sequence());
            memattn::load(resumed, model_snapshot);
            // A hybrid model: a recurrent layer's states beside a softmax layer's pool.
            using Gated = memattn::GatedLinearAttentionMemory<T>;
            using Hybrid = memattn::ModelCache<T, T, Gated>;
            const std::vector<typename Hybrid::Layer> hybrid_layers{
                memattn::StateLayer<Gated>{Gated(d, d), {.checkpoint_tokens = 2}}, model_layers[0]};
            Hybrid hybrid(hybrid_layers, 2);
            const memattn::Index h = hybrid.add_sequence();
            const auto& hybrid_step = hybrid.plan_decode(std::vector<memattn::Index>{hybrid.fork(h)});
            const memattn::Matrix<T> gated_q = memattn::Matrix<T>::Zero(1, d), gated_k = memattn::Matrix<T>::Zero(1, d + 1);
            memattn::Matrix<T> gated_o(1, d);
            hybrid.decode(0, hybrid_step, gated_q, gated_k, x.topRows(1), gated_o);
            hybrid.decode(1, hybrid_step, q, x.topRows(1), x.topRows(1), o);
            hybrid.truncate(h, hybrid.checkpoint_before(h, 0));
            memattn::save(hybrid.sequence(h), model_snapshot);
            auto hybrid_resumed = hybrid.sequence(h);
            memattn::load(hybrid_resumed, model_snapshot);
            const memattn::Matrix<T> wide = memattn::Matrix<T>::Zero(n, 2 * d);
            memattn::Matrix<T> wide_out(n, 2 * d);
            memattn::multi_head_causal_softmax_attention(wide, x, x, wide_out, heads, {}, x * x.transpose());
            const auto group = [&](memattn::Index) { return memattn::KVCache<T>(d, d, options); };
            memattn::MultiHead<memattn::KVCache<T>> layer_of(heads, group);
            memattn::prefill(layer_of, wide, x, x, wide_out);
            memattn::decode(layer_of, wide, x, x, wide_out);
        }
#endif
        // Compact K/V storage: every conversion path of the instruction set.
        {
            use_memory(memattn::KVCache<T, Eigen::bfloat16>(d, d), x, out);
            use_memory(memattn::KVCache<T, Eigen::half>(d, d), x, out);
            use_memory(memattn::KVCache<T, memattn::Q8>(d, d), x, out);
            use_memory(memattn::KVCache<T, memattn::Q4>(d, d), x, out);
            use_memory(memattn::KVCache<T, memattn::Fp8E4M3>(d, d), x, out);
            use_memory(memattn::KVCache<T, memattn::Fp8E5M2>(d, d), x, out);
            use_memory(memattn::KVCache<T, memattn::PerTokenScale<memattn::Fp8E4M3>>(d, d), x, out);
            {  // a group's tiles over E4M3 rows (their numbers route)
                memattn::KVCache<T, memattn::Fp8E4M3> grouped(d, d);
                memattn::extend(grouped, x, x);
                grouped.attend_group(x, out);
            }
            use_memory(memattn::SlidingWindowCache<T, memattn::Q4Affine>(d, d, 4, 1), x, out);
            use_memory(memattn::SlidingWindowCache<T, Eigen::half>(d, d, 4, 1), x, out);
            use_memory(memattn::HybridCache<T, memattn::MeanPool, memattn::Q8>(d, d, 4, 2, 3), x, out);
            use_memory(memattn::KVCache<T, memattn::PerChannelKeys<memattn::Q8>>(d, d), x, out);
            use_memory(memattn::KVCache<T, memattn::PerChannelKeys<memattn::Q4Affine>>(d, d), x, out);
            if constexpr (std::is_same_v<T, float>) {  // the integer Q·K: every integer path of the ISA
                use_memory(memattn::KVCache<T, memattn::IntegerDot<memattn::Q8>>(d, d), x, out);
                use_memory(memattn::KVCache<T, memattn::IntegerDot<memattn::Q4>>(d, d), x, out);
                use_memory(memattn::SlidingWindowCache<T, memattn::IntegerDot<memattn::Q4Affine>>(d, d, 4, 1), x, out);
                use_memory(memattn::KVCache<T, memattn::IntegerDot<memattn::Rotated<memattn::Q4>>>(d, d), x, out);
            }
            // The gated and delta-rule recurrences: both forms through their memories' decode
            // (recurrent) and prefill (chunked), keys widened by their gate columns.
            const memattn::Matrix<T> gated_keys = memattn::Matrix<T>::Zero(x.rows(), d + 2);
            use_memory(memattn::DeltaRuleMemory<T>(d, d, {}, true), x, gated_keys, out);
            const memattn::Matrix<T> kda_keys = memattn::Matrix<T>::Zero(x.rows(), 2 * d + 1);
            use_memory(memattn::KdaMemory<T>(d, d), x, kda_keys, out);
            const memattn::Matrix<T> rwkv7_keys = memattn::Matrix<T>::Zero(x.rows(), 4 * d);
            use_memory(memattn::Rwkv7Memory<T>(d, d), x, rwkv7_keys, out);
            const memattn::Matrix<T> log_w = memattn::Matrix<T>::Zero(x.rows(), d);
            memattn::chunked_rwkv7_attention(x, x, x, x, x, log_w, out);
            memattn::recurrent_rwkv7_attention(x, x, x, x, x, log_w, out);
            use_memory(memattn::GatedLinearAttentionMemory<T>(d, d, memattn::GateKind::scalar), x, gated_keys.leftCols(d + 1),
                       out);
        }
        // Memories of 16-bit rows: the float memories behind converting members.
        {
            using bf16 = Eigen::bfloat16;
            const memattn::Matrix<bf16> b = x.template cast<bf16>();
            memattn::Matrix<bf16> out_b(n, d);
            use_memory(memattn::KVCache<bf16>(d, d), b, out_b);
            const memattn::Matrix<Eigen::half> h = x.template cast<Eigen::half>();
            memattn::Matrix<Eigen::half> out_h(n, d);
            use_memory(memattn::KVCache<Eigen::half, memattn::Q4>(d, d), h, out_h);
            use_memory(memattn::SlidingWindowCache<bf16, memattn::Q8>(d, d, 4, 1), b, out_b);
            use_memory(memattn::KVCache<bf16, memattn::IntegerDot<memattn::Q8>>(d, d), b, out_b);
            use_memory(memattn::KVCache<bf16, memattn::PerChannelKeys<memattn::Q4>>(d, d), b, out_b);
            use_memory(memattn::MovingAverageCache<bf16>(d, d, 4), b, out_b);
            use_memory(memattn::HybridCache<bf16>(d, d, 4, 2, 3), b, out_b);
            use_memory(memattn::LinearAttentionMemory<bf16>(d, d), b, out_b);
            const memattn::Matrix<bf16> gated_b = memattn::Matrix<bf16>::Zero(n, d + 2);
            use_memory(memattn::DeltaRuleMemory<bf16>(d, d, {}, true), b, gated_b, out_b);
            use_memory(memattn::GatedLinearAttentionMemory<bf16>(d, d), b, gated_b.leftCols(d + 1).eval(), out_b);
#if defined(MEMATTN_WARNINGS_LAYERS)
            const memattn::HeadLayout pair{2, 1, d / 2};
            const auto k = b.leftCols(d / 2);
            use_memory(memattn::MultiHead<memattn::KVCache<bf16>>(pair, [d](memattn::Index) { return memattn::KVCache<bf16>(d / 2, d / 2); }),
                       k, k, out_b);
            use_memory(memattn::MultiHead<memattn::SlidingWindowCache<bf16>>(
                           pair, [d](memattn::Index) { return memattn::SlidingWindowCache<bf16>(d / 2, d / 2, 4); }),
                       k, k, out_b);
#endif
        }
    }
}

}  // namespace

// An exported function, so an optimising compiler keeps (and warns about) all of it.
void memattn_instantiate_everything(memattn::Index n, memattn::Index d) {
    everything<float>(n, d);
#if defined(MEMATTN_WARNINGS_DOUBLE)  // the default target's unit only (tests/CMakeLists.txt)
    everything<double>(n, d);
#endif
    // AMX tiles on any x86-64 target (inline assembly; the softmax kernel takes them where
    // its inputs are bfloat16 pairs, AVX512-BF16 builds), and the CPU's features.
    std::vector<std::uint16_t> a(static_cast<std::size_t>(2 * n * d));
    std::vector<std::uint32_t> b(static_cast<std::size_t>(n * d));
    std::vector<float> c(static_cast<std::size_t>(n * n));
    memattn::detail::amx_product<memattn::detail::AmxHardware>(n, n, d, a.data(), 2 * d, b.data(), n, c.data(), n,
                                                                memattn::cpu_features().amx_usable());
}
