// Streams a long synthetic sequence token by token through each memory and prints, at
// checkpoints, the time of one decoding step (update + attend) and the bytes the
// memory holds. A full KV cache's step grows with the position; a fixed-size
// memory's stays flat.
//
//   streaming_decode [--tokens N] [--dim D] [--value-dim DV] [--steps S] [--memories a,b,...] [--csv FILE]
//
// Each cell is printed as soon as it is measured. With --csv, every measurement is also
// written to FILE (memory, position, microseconds per token, bytes held) for
// `scripts/demo --plot`.
#include <memattn/memattn.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

using memattn::Index;
using Mat = memattn::Matrix<float>;

/// One memory behind a uniform face, so the table can hold any model of memattn::Memory.
struct Entry {
    std::string name;
    std::function<void(const Mat& K, const Mat& V)> extend;
    std::function<void(const Mat& Q, const Mat& K, const Mat& V, Mat& O)> decode;
    std::function<std::size_t()> footprint;
};

template <memattn::Memory M>
Entry entry(std::string name, M memory) {
    auto mem = std::make_shared<M>(std::move(memory));
    return {std::move(name), [mem](const Mat& K, const Mat& V) { memattn::extend(*mem, K, V); },
            [mem](const Mat& Q, const Mat& K, const Mat& V, Mat& O) { memattn::decode(*mem, Q, K, V, O); },
            [mem] { return mem->footprint(); }};
}

std::vector<Entry> all_memories(Index d, Index dv) {
    std::vector<Entry> list;
    list.push_back(entry("kv_cache", memattn::KVCache<float>(d, dv)));
    list.push_back(entry("linear_attention", memattn::LinearAttentionMemory<float>(d, dv)));
    list.push_back(entry("sliding_window_512+4", memattn::SlidingWindowCache<float>(d, dv, 512, 4)));
    list.push_back(entry("sliding_window_4096", memattn::SlidingWindowCache<float>(d, dv, 4096)));
    list.push_back(entry("moving_average", memattn::MovingAverageCache<float>(d, dv, 0)));
    list.push_back(entry("ema_0.1", memattn::MovingAverageCache<float>::exponential(d, dv, 0.1f)));
    list.push_back(entry("hybrid_512/4/256", memattn::HybridCache<float>(d, dv, 512, 4, 256)));
    return list;
}

struct Options {
    Index tokens = 100000;
    Index d = 64;
    Index dv = 64;
    Index steps = 256;
    std::vector<std::string> memories;
    std::string csv;
};

[[noreturn]] void usage(int code) {
    std::printf(
        "usage: streaming_decode [--tokens N] [--dim D] [--value-dim DV] [--steps S] [--memories a,b,...] "
        "[--csv FILE]\n"
        "  --tokens     length of the stream (default 100000)\n"
        "  --dim        key dim d (default 64); --value-dim: value dim dv (default: d)\n"
        "  --steps      decoding steps timed at each checkpoint (default 256)\n"
        "  --csv        also write every measurement to FILE (memory,position,us_per_token,bytes)\n"
        "  --memories   comma-separated names (default: all):");
    for (const auto& e : all_memories(1, 1))
        std::printf(" %s", e.name.c_str());
    std::printf("\n");
    std::exit(code);
}

Options parse(int argc, char** argv) {
    Options o;
    bool value_dim_given = false;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--help" || arg == "-h")
            usage(0);
        if (i + 1 >= argc)
            usage(2);
        const std::string value = argv[++i];
        if (arg == "--tokens")
            o.tokens = std::stol(value);
        else if (arg == "--dim")
            o.d = std::stol(value);
        else if (arg == "--value-dim")
            o.dv = std::stol(value), value_dim_given = true;
        else if (arg == "--steps")
            o.steps = std::stol(value);
        else if (arg == "--memories") {
            std::stringstream ss(value);
            for (std::string name; std::getline(ss, name, ',');)
                o.memories.push_back(name);
        } else if (arg == "--csv")
            o.csv = value;
        else
            usage(2);
    }
    if (!value_dim_given)
        o.dv = o.d;
    if (o.tokens < 1 || o.d < 1 || o.dv < 1 || o.steps < 1)
        usage(2);
    return o;
}

std::string human_bytes(std::size_t bytes) {
    char buffer[32];
    if (bytes < 10 * 1024)
        std::snprintf(buffer, sizeof buffer, "%zu B", bytes);
    else if (bytes < 10 * 1024 * 1024)
        std::snprintf(buffer, sizeof buffer, "%.0f KiB", static_cast<double>(bytes) / 1024);
    else
        std::snprintf(buffer, sizeof buffer, "%.1f MiB", static_cast<double>(bytes) / (1024 * 1024));
    return buffer;
}

}  // namespace

int main(int argc, char** argv) {
    const Options opt = parse(argc, argv);

    std::vector<Entry> memories;
    for (auto& e : all_memories(opt.d, opt.dv))
        if (opt.memories.empty() || std::find(opt.memories.begin(), opt.memories.end(), e.name) != opt.memories.end())
            memories.push_back(std::move(e));
    if (memories.empty())
        usage(2);

    // A pool of synthetic tokens, streamed cyclically.
    const Index pool = 4096;
    std::mt19937 gen(42);
    std::normal_distribution<float> normal(0.f, 1.f);
    Mat Q(pool, opt.d), K(pool, opt.d), V(pool, opt.dv);
    for (Mat* m : {&Q, &K, &V})
        for (Index i = 0; i < m->size(); ++i)
            m->data()[i] = normal(gen);

    std::vector<Index> checkpoints;
    for (Index c = 1000; c <= opt.tokens; c *= 10) {
        checkpoints.push_back(c);
        if (c * 3 <= opt.tokens)
            checkpoints.push_back(c * 3);
    }
    std::sort(checkpoints.begin(), checkpoints.end());

    std::printf("memattn streaming decode: float, d=%ld, dv=%ld, %ld tokens; one step = update + attend,\n"
                "timed over %ld steps at each position (the stream up to it is fed with extend)\n"
                "CPU: %s\n\n",
                static_cast<long>(opt.d), static_cast<long>(opt.dv), static_cast<long>(opt.tokens),
                static_cast<long>(opt.steps), memattn::describe(memattn::cpu_features()).c_str());
    std::printf("%10s", "position");
    for (const auto& e : memories)
        std::printf(" | %-22s", e.name.c_str());
    std::printf("\n%10s", "");
    for (std::size_t i = 0; i < memories.size(); ++i)
        std::printf(" | %9s %12s", "us/token", "bytes held");
    std::printf("\n");

    std::FILE* csv = nullptr;
    if (!opt.csv.empty()) {
        csv = std::fopen(opt.csv.c_str(), "w");
        if (csv == nullptr) {
            std::fprintf(stderr, "streaming_decode: cannot write %s\n", opt.csv.c_str());
            return 1;
        }
        std::fprintf(csv, "memory,position,us_per_token,bytes\n");
    }
    Mat O(opt.steps, opt.dv), Qs(opt.steps, opt.d), Ks(opt.steps, opt.d), Vs(opt.steps, opt.dv);
    std::vector<Index> fed(memories.size(), 0);
    for (const Index checkpoint : checkpoints) {
        std::printf("%10ld", static_cast<long>(checkpoint));
        std::fflush(stdout);
        for (std::size_t m = 0; m < memories.size(); ++m) {
            auto& e = memories[m];
            while (fed[m] < checkpoint) {  // feed the stream up to the checkpoint
                const Index offset = fed[m] % pool, n = std::min(pool - offset, checkpoint - fed[m]);
                e.extend(K.middleRows(offset, n), V.middleRows(offset, n));
                fed[m] += n;
            }
            for (Index s = 0; s < opt.steps; ++s) {
                const Index row = (fed[m] + s) % pool;
                Qs.row(s) = Q.row(row);
                Ks.row(s) = K.row(row);
                Vs.row(s) = V.row(row);
            }
            const auto start = std::chrono::steady_clock::now();
            e.decode(Qs, Ks, Vs, O);
            const std::chrono::duration<double, std::micro> elapsed = std::chrono::steady_clock::now() - start;
            fed[m] += opt.steps;
            const double per_token = elapsed.count() / static_cast<double>(opt.steps);
            std::printf(" | %9.2f %12s", per_token, human_bytes(e.footprint()).c_str());
            std::fflush(stdout);  // each cell as it is measured: a KV cache's late cells take a while
            if (csv != nullptr)
                std::fprintf(csv, "%s,%ld,%.4f,%zu\n", e.name.c_str(), static_cast<long>(checkpoint), per_token,
                             e.footprint());
        }
        std::printf("\n");
        std::fflush(stdout);
    }
    if (csv != nullptr)
        std::fclose(csv);
    return 0;
}
