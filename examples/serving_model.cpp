// A server's loop over a two-layer model with one ModelCache: a window-128 layer with
// sink logits beside a full layer, 12 requests sharing a 300-token system prompt, each
// prefilled in chunks beside the others' decode steps, then decoding until it ends.
// Prints what it did and how many memattn calls it took: one plan and one call per layer
// a step, one call per request to fork and to remove, whatever the number of layers.
//
//   serving_model [--requests N] [--steps S]
#include <memattn/memattn.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

using memattn::Index;
using Mat = memattn::Matrix<float>;

Mat random_rows(Index rows, Index cols, std::mt19937& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    Mat m(rows, cols);
    for (Index i = 0; i < m.size(); ++i)
        m.data()[i] = normal(rng);
    return m;
}

}  // namespace

int main(int argc, char** argv) {
    Index requests = 12, steps = 40;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (std::strcmp(argv[i], "--requests") == 0)
            requests = std::atoi(argv[i + 1]);
        else if (std::strcmp(argv[i], "--steps") == 0)
            steps = std::atoi(argv[i + 1]);
    }
    const memattn::HeadLayout layout{8, 2, 32};
    const std::vector<double> sinks(8, 0.5);
    const std::vector<memattn::ModelLayer> layers{
        {.layout = layout, .blocks = 512, .block_size = 16, .options = {.window = 128, .sink_logits = sinks}},
        {.layout = layout, .blocks = 512, .block_size = 16}};
    memattn::ModelCache<float> cache(layers);
    std::mt19937 rng(7);
    long calls = 0;
    // The system prompt, once, then one fork per request.
    const Index system = cache.add_sequence();
    ++calls;
    const auto run = [&](const memattn::ModelCache<float>::Step& step) {
        for (Index l = 0; l < cache.layers(); ++l) {
            const auto& pool = cache.layer(l);
            const Mat Q = random_rows(step.rows(), pool.query_dim(), rng), K = random_rows(step.rows(), pool.key_dim(), rng),
                      V = random_rows(step.rows(), pool.value_dim(), rng);
            Mat O(step.rows(), pool.output_dim());
            cache.prefill(l, step, Q, K, V, O);
            ++calls;
        }
    };
    run(cache.plan(std::vector<Index>{system}, std::vector<Index>{0, 300}));
    ++calls;
    std::vector<Index> live;
    for (Index r = 0; r < requests; ++r) {
        live.push_back(cache.fork(system));
        ++calls;
    }
    // Steps: each request's own prompt of 40 tokens in chunks of 20, then one token a step.
    std::vector<Index> fed(static_cast<std::size_t>(requests), 0);
    Index ended = 0;
    for (Index s = 0; s < steps && !live.empty(); ++s) {
        std::vector<Index> offsets{0};
        for (std::size_t i = 0; i < live.size(); ++i) {
            const Index chunk = fed[i] < 40 ? 20 : 1;
            fed[i] += chunk;
            offsets.push_back(offsets.back() + chunk);
        }
        run(cache.plan(live, offsets));
        ++calls;
        if (s % 10 == 9) {  // a request ends
            cache.remove(live.back());
            ++calls;
            live.pop_back();
            fed.pop_back();
            ++ended;
        }
    }
    Index tokens = 0;
    for (const Index id : live)
        tokens += cache.length(id);
    std::printf("%ld requests, %ld steps, %ld ended; %ld tokens held by the live ones\n", static_cast<long>(requests),
                static_cast<long>(steps), static_cast<long>(ended), static_cast<long>(tokens));
    std::printf("memattn calls: %ld (a step: 1 plan + %ld layers)\n", calls, static_cast<long>(cache.layers()));
    std::printf("blocks in use: window layer %ld, full layer %ld\n", static_cast<long>(cache.layer(0).blocks_in_use()),
                static_cast<long>(cache.layer(1).blocks_in_use()));
    return live.size() == static_cast<std::size_t>(requests - ended) ? 0 : 1;
}
