// Fuzzing the paged pool: a sequence of pool operations (add, fork, extend, truncate,
// remove, attend, batched decode and prefill) on a small PagedKVCache, with or without
// a sliding window and sinks, beside a model of it (each live sequence's tokens). After every operation the lengths and block counts must
// agree with the model, an operation that throws (PoolExhausted) must change nothing,
// an attend must equal the double reference of the sequence's tokens, a rollback the
// window has made impossible must be refused with nothing changed, and a windowed
// sequence must never hold more blocks than its window needs; at the end every block
// must be free again.
#include "fuzz_input.hpp"

#include <memattn/memattn.hpp>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <vector>

namespace {

using namespace memattn;
using reference::MatrixD;

void fail(const char* what) {
    std::fprintf(stderr, "pool_fuzz: %s\n", what);
    std::abort();
}

/// Every query head of q over the tokens (packed rows) in double.
MatrixD expected_attend(const HeadLayout& layout, const Matrix<float>& q, const std::vector<Matrix<float>>& tokens,
                        const SoftmaxOptions& options) {
    const Index d = layout.head_dim, g = layout.group_size(), n = static_cast<Index>(tokens.size());
    MatrixD out = MatrixD::Zero(1, layout.q_heads * d);
    if (n == 0)
        return out;
    MatrixD K(n, layout.kv_heads * d), V(n, layout.kv_heads * d);
    for (Index i = 0; i < n; ++i) {
        K.row(i) = tokens[static_cast<std::size_t>(i)].row(0).cast<double>();
        V.row(i) = tokens[static_cast<std::size_t>(i)].row(1).cast<double>();
    }
    for (Index h = 0; h < layout.q_heads; ++h)
        out.middleCols(h * d, d) = reference::softmax_attention(q.cast<double>().middleCols(h * d, d),
                                                                K.middleCols(h / g * d, d), V.middleCols(h / g * d, d),
                                                                0, options.window, options.sink_tokens)
                                       .out;
    return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    fuzz::FuzzInput in(data, size);
    const Index kv = in.size(1, 2), g = in.size(1, 3), d = in.size(1, 6);
    const HeadLayout layout{kv * g, kv, d};
    const Index blocks = in.size(1, 12), block = in.size(1, 6);
    const Index window = in.size(0, 9), sinks = in.size(0, 3);  // window 0: none
    PagedKVCache<float> pool(layout, blocks, block, SoftmaxOptions{.window = window, .sink_tokens = sinks});
    const SoftmaxOptions options = pool.options();
    const Index most = window == 0 ? blocks : (sinks + block - 1) / block + (window + block - 1) / block + 1;
    const Index kw = kv * d;
    std::map<Index, std::vector<Matrix<float>>> model;  // each token: row 0 its key, row 1 its value
    const auto pick = [&]() -> Index {
        auto it = model.begin();
        std::advance(it, in.size(0, static_cast<Index>(model.size()) - 1));
        return it->first;
    };
    const Index steps = in.size(0, 48);
    for (Index step = 0; step < steps; ++step) {
        const Index op = model.empty() ? 0 : in.size(0, 6);
        const Index before = pool.blocks_in_use();
        if (op == 0) {
            if (model.size() < 6)
                model[pool.add_sequence()] = {};
        } else if (op == 1) {
            if (model.size() < 6) {
                const Index parent = pick();
                model[pool.fork(parent)] = model[parent];
                if (pool.blocks_in_use() != before)
                    fail("a fork took blocks");
            }
        } else if (op == 2) {
            const Index seq = pick(), n = in.size(0, 7);
            const Matrix<float> K = in.matrix<float>(n, kw, 2.0), V = in.matrix<float>(n, kw, 2.0);
            try {
                pool.extend(seq, K, V);
                for (Index i = 0; i < n; ++i) {
                    Matrix<float> token(2, kw);
                    token << K.row(i), V.row(i);
                    model[seq].push_back(token);
                }
            } catch (const PoolExhausted&) {
                if (pool.blocks_in_use() != before || pool.length(seq) != static_cast<Index>(model[seq].size()))
                    fail("a refused extend changed the pool");
            }
        } else if (op == 3) {
            const Index seq = pick();
            const Index n = in.size(0, static_cast<Index>(model[seq].size()));
            if (pool.can_truncate(seq, n)) {
                pool.truncate(seq, n);
                model[seq].resize(static_cast<std::size_t>(n));
            } else {
                if (window == 0)
                    fail("a rollback refused without a window");
                bool threw = false;
                try {
                    pool.truncate(seq, n);
                } catch (const std::invalid_argument&) {
                    threw = true;
                }
                if (!threw || pool.blocks_in_use() != before || pool.length(seq) != static_cast<Index>(model[seq].size()))
                    fail("a refused rollback changed the pool");
            }
        } else if (op == 4) {
            const Index seq = pick();
            pool.remove(seq);
            model.erase(seq);
        } else if (op == 5) {
            const Index seq = pick();
            const Matrix<float> q = in.matrix<float>(1, pool.query_dim(), 2.0);
            Matrix<float> o(1, pool.output_dim());
            pool.attend(seq, q.row(0), o.row(0));
            fuzz::expect_close("attend", o, expected_attend(layout, q, model[seq], options), 2e-4);
        } else if (in.flag()) {  // a mixed batch: a chunk of 0 to 3 rows for every live sequence
            std::vector<Index> seqs, offsets{0};
            for (const auto& [seq, tokens] : model) {
                seqs.push_back(seq);
                offsets.push_back(offsets.back() + in.size(0, 3));
            }
            const Index rows = offsets.back();
            const Matrix<float> Q = in.matrix<float>(rows, pool.query_dim(), 2.0),
                                K = in.matrix<float>(rows, kw, 2.0), V = in.matrix<float>(rows, kw, 2.0);
            Matrix<float> O(rows, pool.output_dim());
            try {
                batched_prefill(pool, seqs, offsets, Q, K, V, O);
                for (std::size_t i = 0; i < seqs.size(); ++i) {
                    auto& tokens = model[seqs[i]];
                    for (Index r = offsets[i]; r < offsets[i + 1]; ++r) {
                        Matrix<float> token(2, kw);
                        token << K.row(r), V.row(r);
                        tokens.push_back(token);
                        fuzz::expect_close("batched_prefill", O.row(r), expected_attend(layout, Q.row(r), tokens, options),
                                           2e-4);
                    }
                }
            } catch (const PoolExhausted&) {
                if (pool.blocks_in_use() != before)
                    fail("a refused mixed batch changed the pool");
            }
        } else {  // one token for every live sequence at once
            std::vector<Index> seqs;
            for (const auto& [seq, tokens] : model)
                seqs.push_back(seq);
            const Index b = static_cast<Index>(seqs.size());
            const Matrix<float> Q = in.matrix<float>(b, pool.query_dim(), 2.0), K = in.matrix<float>(b, kw, 2.0),
                                V = in.matrix<float>(b, kw, 2.0);
            Matrix<float> O(b, pool.output_dim());
            try {
                batched_decode(pool, seqs, Q, K, V, O);
                for (Index i = 0; i < b; ++i) {
                    Matrix<float> token(2, kw);
                    token << K.row(i), V.row(i);
                    auto& tokens = model[seqs[static_cast<std::size_t>(i)]];
                    tokens.push_back(token);
                    fuzz::expect_close("batched_decode", O.row(i), expected_attend(layout, Q.row(i), tokens, options), 2e-4);
                }
            } catch (const PoolExhausted&) {
                if (pool.blocks_in_use() != before)
                    fail("a refused batch changed the pool");
            }
        }
        if (pool.sequences() != static_cast<Index>(model.size()) || pool.blocks_in_use() + pool.free_blocks() != blocks)
            fail("counts");
        Index held = 0;
        for (const auto& [seq, tokens] : model) {
            if (pool.length(seq) != static_cast<Index>(tokens.size()))
                fail("a length differs from the model's");
            held += pool.blocks_of(seq);
            if (pool.blocks_of(seq) > most)
                fail("a windowed sequence holds blocks its window left");
        }
        if (pool.blocks_in_use() > held)
            fail("blocks in use that no sequence holds");
    }
    for (const auto& [seq, tokens] : model)
        pool.remove(seq);
    if (pool.blocks_in_use() != 0)
        fail("blocks leaked");
    return 0;
}
