#pragma once
// Multi-query associative recall: how much of a stream of (key, value) pairs a memory can
// give back when asked with the keys. The task of the Zoology paper (Arora et al. 2023,
// "Zoology: Measuring and Improving Recall in Efficient Language Models") and of the
// delta-rule papers (Schlag et al. 2021; Yang et al. 2024), read without a trained model:
//
//   1. n random pairs (k_i, v_i) are fed to a memory (memattn::extend).
//   2. Every stored key is asked for, at distances 1 (the newest pair) to n (the first),
//      twice: the key itself (exact) and the key with noise of norm `noise` added and the
//      sum renormalised (noisy; 0.3 gives a cosine of about 0.96 to the key). Each query
//      is one attend(q, out) on the memory as it is after the stream.
//   3. Two measures per query: whether it was retrieved (of all n stored values, the one
//      with the largest cosine to `out` is the right one, strictly) and the cosine of
//      `out` to the right value.
//
// Keys and values are unit vectors of width d. Values are uniform on the sphere. Keys
// are uniform on the sphere (isotropic), or clustered: `clusters` centres uniform on the
// sphere, each key a centre plus an offset of norm `spread` in a uniform direction,
// renormalised (spread 0.5: two keys of one cluster have a cosine of about 0.8). Many
// similar keys are where a linear state mixes old facts into new ones.
//
// Guessing one stored value at random retrieves with probability 1/n (Result::chance). A
// memory that has lost a pair usually does worse than chance on it: what it returns is
// made of the values it still holds, so one of those wins.
//
// Reproducible bit for bit on one platform: the generator is std::mt19937_64 (whose
// output the standard fixes) and the normal draws are a Box–Muller transform written out
// here (std::normal_distribution's output is not fixed across standard libraries); only
// the C library's log, sin and cos may differ in the last ulp between platforms.
//
//   const recall::Task task = recall::make_task({.n = 1024, .keys = recall::KeyDistribution::clustered});
//   KVCache<float> cache(64, 64, recall::softmax_sharpness);
//   const recall::Result r = recall::run(cache, task);   // r.exact.accuracy, r.buckets[b].noisy.cosine, ...
//
// Shared by bench/memory_recall.cpp and tests/memory_recall_test.cpp.

#include <memattn/memory/concept.hpp>
#include <memattn/types.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string_view>
#include <vector>

namespace memattn::recall {

/// The logit scale of the softmax memories in the task: q·k of unit vectors times 16, so a
/// stored key's own logit (16) stands far above those of the other keys (isotropic keys:
/// 16·q·k has a standard deviation of 16/√d = 2 at d = 64) and a KV cache retrieves every
/// pair. The library's default 1/√d would give logits within ±1/8 of each other: every
/// softmax memory would average its pairs. Linear-attention memories read the unit query
/// as it is (the gated ones with their query scale set to 1).
inline constexpr float softmax_sharpness = 16.0f;

/// How the keys are drawn.
enum class KeyDistribution { isotropic, clustered };

/// "isotropic" or "clustered".
inline std::string_view name(KeyDistribution keys) {
    return keys == KeyDistribution::isotropic ? "isotropic" : "clustered";
}

/// What a task is made from.
struct TaskOptions {
    Index n = 256;                                       ///< pairs in the stream; queries of each kind
    Index d = 64;                                        ///< key and value width (d = dv)
    KeyDistribution keys = KeyDistribution::isotropic;   ///< how the keys are drawn
    double noise = 0.3;                                  ///< norm of the noise on a noisy query, before renormalising
    std::uint64_t seed = 1;                              ///< every draw follows from it
    Index clusters = 8;                                  ///< clustered keys: the number of centres
    double spread = 0.5;                                 ///< clustered keys: the norm of a key's offset from its centre
};

/// A task: the stream and its queries, all rows unit vectors of width d, in float.
struct Task {
    TaskOptions options;
    Matrix<float> keys;           ///< n × d: row i is the i-th pair fed, at distance n − i; its exact query
    Matrix<float> values;         ///< n × d: row i the value stored with key i
    Matrix<float> noisy_queries;  ///< n × d: row i the noisy query for key i
};

/// Normal draws: std::mt19937_64 through Box–Muller, in double, the same on every
/// standard library (see the top of the file).
class NormalSource {
public:
    explicit NormalSource(std::uint64_t seed) : bits_(seed) {}

    /// One draw of N(0, 1).
    double operator()() {
        if (has_spare_) {
            has_spare_ = false;
            return spare_;
        }
        const double u1 = (static_cast<double>(bits_() >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]: log(u1) finite
        const double u2 = static_cast<double>(bits_() >> 11) * 0x1.0p-53;          // [0, 1)
        const double r = std::sqrt(-2.0 * std::log(u1)), angle = 6.283185307179586 * u2;
        spare_ = r * std::sin(angle);
        has_spare_ = true;
        return r * std::cos(angle);
    }

    /// A uniform integer in [0, k) (k small: the modulo's bias is below 2^-58).
    Index below(Index k) { return static_cast<Index>(bits_() % static_cast<std::uint64_t>(k)); }

    /// A vector uniform on the unit sphere of R^d.
    Eigen::RowVectorXd unit(Index d) {
        Eigen::RowVectorXd x(d);
        for (Index i = 0; i < d; ++i)
            x(i) = (*this)();
        return x / x.norm();
    }

private:
    std::mt19937_64 bits_;
    double spare_ = 0;
    bool has_spare_ = false;
};

/// One of several independent streams of a seed (SplitMix64's finaliser of seed and
/// part), so the keys, values and noise of a task are drawn independently of each other:
/// the two key distributions share their values and noise directions.
inline std::uint64_t stream_seed(std::uint64_t seed, std::uint64_t part) {
    std::uint64_t z = seed * 0x9E3779B97F4A7C15ull + part + 1;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/// The task of `options` (see the top of the file).
inline Task make_task(const TaskOptions& options) {
    const Index n = options.n, d = options.d;
    Task task{options, Matrix<float>(n, d), Matrix<float>(n, d), Matrix<float>(n, d)};
    NormalSource key_source(stream_seed(options.seed, 0)), value_source(stream_seed(options.seed, 1)),
        noise_source(stream_seed(options.seed, 2));
    std::vector<Eigen::RowVectorXd> centres;
    if (options.keys == KeyDistribution::clustered)
        for (Index c = 0; c < options.clusters; ++c)
            centres.push_back(key_source.unit(d));
    for (Index i = 0; i < n; ++i) {
        Eigen::RowVectorXd key;
        if (options.keys == KeyDistribution::isotropic) {
            key = key_source.unit(d);
        } else {
            const Index c = key_source.below(options.clusters);
            key = centres[static_cast<std::size_t>(c)] + options.spread * key_source.unit(d);
            key /= key.norm();
        }
        Eigen::RowVectorXd noisy = key + options.noise * noise_source.unit(d);
        noisy /= noisy.norm();
        task.keys.row(i) = key.cast<float>();
        task.values.row(i) = value_source.unit(d).cast<float>();
        task.noisy_queries.row(i) = noisy.cast<float>();
    }
    return task;
}

/// Means over a set of queries.
struct Score {
    double accuracy = 0;  ///< the fraction retrieved (the right value has the largest cosine to the output)
    double cosine = 0;    ///< the mean cosine of the output to the right value (0 for a zero output)
    Index queries = 0;    ///< how many
};

/// The queries for keys at distances in (max_distance / 2, max_distance]: 1, 2, 3–4, 5–8, …
struct Bucket {
    Index max_distance = 1;
    Score exact, noisy;
};

/// What a memory did on a task.
struct Result {
    Score exact, noisy;            ///< over all n queries of each kind
    std::vector<Bucket> buckets;   ///< by distance, nearest first
    std::size_t footprint = 0;     ///< the memory's footprint() after the stream
    double chance = 0;             ///< 1/n: a random guess's accuracy
    /// Per query, indexed by distance − 1: retrieved (0 or 1) and the cosine to the right value.
    std::vector<char> exact_retrieved, noisy_retrieved;
    std::vector<double> exact_cosine, noisy_cosine;
};

/// The bucket of a distance ≥ 1: ⌈log2 distance⌉.
inline std::size_t bucket_of(Index distance) {
    std::size_t b = 0;
    while ((Index{1} << b) < distance)
        ++b;
    return b;
}

namespace detail {

/// Whether each row of O retrieves its own value (row i of V, unit rows), and its cosine
/// to it. Products of blocks of rows against every value (one GEMM each); a zero or
/// non-finite output retrieves nothing.
inline void score_rows(const Matrix<float>& O, const Matrix<float>& V, std::vector<char>& retrieved,
                       std::vector<double>& cosine) {
    constexpr Index block = 256;
    const Index n = O.rows();
    retrieved.assign(static_cast<std::size_t>(n), 0);
    cosine.assign(static_cast<std::size_t>(n), 0.0);
    Matrix<float> dots;
    for (Index r0 = 0; r0 < n; r0 += block) {
        const Index m = std::min(block, n - r0);
        dots.noalias() = O.middleRows(r0, m) * V.transpose();  // |o| cos(o, v_j): the same order as the cosines
        for (Index r = 0; r < m; ++r) {
            const Index i = r0 + r;
            const double norm = O.row(i).cast<double>().norm();
            if (!(norm > 0) || !std::isfinite(norm))
                continue;
            const float own = dots(r, i);
            bool best = true;
            for (Index j = 0; j < n && best; ++j)
                best = j == i || dots(r, j) < own;
            retrieved[static_cast<std::size_t>(i)] = best;
            cosine[static_cast<std::size_t>(i)] =
                O.row(i).cast<double>().dot(V.row(i).cast<double>()) / (norm * V.row(i).cast<double>().norm());
        }
    }
}

inline void add(Score& s, bool retrieved, double cosine) {
    s.accuracy += retrieved ? 1.0 : 0.0;
    s.cosine += cosine;
    ++s.queries;
}

inline void finish(Score& s) {
    if (s.queries > 0) {
        s.accuracy /= static_cast<double>(s.queries);
        s.cosine /= static_cast<double>(s.queries);
    }
}

}  // namespace detail

/// Feeds the task's stream to `memory` (reset first) with the key rows `key_rows` (n ×
/// the memory's key width: the task's keys, or them with the extra columns a gated memory
/// takes, see below), then asks every query of the task and scores the outputs.
template <Memory M>
    requires std::same_as<typename M::Scalar, float>
Result run(M& memory, const Task& task, const Matrix<float>& key_rows) {
    const Index n = task.keys.rows(), dv = task.values.cols();
    memory.reset();
    memattn::extend(memory, key_rows, task.values);
    Result result;
    result.footprint = memory.footprint();
    result.chance = n > 0 ? 1.0 / static_cast<double>(n) : 0.0;
    Matrix<float> exact(n, dv), noisy(n, dv);
    for (Index i = 0; i < n; ++i) {
        memory.attend(task.keys.row(i), exact.row(i));
        memory.attend(task.noisy_queries.row(i), noisy.row(i));
    }
    std::vector<char> exact_hit, noisy_hit;
    std::vector<double> exact_cos, noisy_cos;
    detail::score_rows(exact, task.values, exact_hit, exact_cos);
    detail::score_rows(noisy, task.values, noisy_hit, noisy_cos);
    // Query i asks for the key at distance n − i: reversed, index distance − 1.
    result.exact_retrieved.assign(exact_hit.rbegin(), exact_hit.rend());
    result.noisy_retrieved.assign(noisy_hit.rbegin(), noisy_hit.rend());
    result.exact_cosine.assign(exact_cos.rbegin(), exact_cos.rend());
    result.noisy_cosine.assign(noisy_cos.rbegin(), noisy_cos.rend());
    result.buckets.resize(n > 0 ? bucket_of(n) + 1 : 0);
    for (std::size_t b = 0; b < result.buckets.size(); ++b)
        result.buckets[b].max_distance = Index{1} << b;
    for (Index i = 0; i < n; ++i) {
        const auto q = static_cast<std::size_t>(i);
        Bucket& bucket = result.buckets[bucket_of(n - i)];
        detail::add(result.exact, exact_hit[q], exact_cos[q]);
        detail::add(result.noisy, noisy_hit[q], noisy_cos[q]);
        detail::add(bucket.exact, exact_hit[q], exact_cos[q]);
        detail::add(bucket.noisy, noisy_hit[q], noisy_cos[q]);
    }
    detail::finish(result.exact);
    detail::finish(result.noisy);
    for (Bucket& bucket : result.buckets) {
        detail::finish(bucket.exact);
        detail::finish(bucket.noisy);
    }
    return result;
}

/// run() with the task's own keys as the key rows.
template <Memory M>
    requires std::same_as<typename M::Scalar, float>
Result run(M& memory, const Task& task) {
    return run(memory, task, task.keys);
}

/// The score of the queries at distances first … last (1 ≤ first ≤ last ≤ n), exact or
/// noisy: a range that need not align with the buckets (a window's edge).
inline Score distance_score(const Result& result, Index first, Index last, bool noisy) {
    const auto& hits = noisy ? result.noisy_retrieved : result.exact_retrieved;
    const auto& cosines = noisy ? result.noisy_cosine : result.exact_cosine;
    Score s;
    for (Index distance = first; distance <= last; ++distance) {
        const auto q = static_cast<std::size_t>(distance - 1);
        detail::add(s, hits[q] != 0, cosines[q]);
    }
    detail::finish(s);
    return s;
}

// Key rows of the memories whose update takes more than the key (memory/gated_memories.hpp).

/// `columns` columns of `value` after the rows of `keys`.
inline Matrix<float> with_columns(const Matrix<float>& keys, Index columns, float value) {
    Matrix<float> rows(keys.rows(), keys.cols() + columns);
    rows.leftCols(keys.cols()) = keys;
    rows.rightCols(columns).setConstant(value);
    return rows;
}

/// GatedLinearAttentionMemory(d, dv, GateKind::scalar): [k | log g], one fixed decay g.
inline Matrix<float> gated_keys(const Matrix<float>& keys, double decay) {
    return with_columns(keys, 1, static_cast<float>(std::log(decay)));
}

/// DeltaRuleMemory(d, dv): [k | β].
inline Matrix<float> delta_rule_keys(const Matrix<float>& keys, float beta) {
    return with_columns(keys, 1, beta);
}

/// DeltaRuleMemory(d, dv, {}, /*gated=*/true): [k | β | log g]; with `channels` = d,
/// KdaMemory's [k | β | log α (d)], every channel with the same decay.
inline Matrix<float> gated_delta_keys(const Matrix<float>& keys, float beta, double decay, Index channels = 1) {
    return with_columns(with_columns(keys, 1, beta), channels, static_cast<float>(std::log(decay)));
}

/// Rwkv7Memory(d, dv) as a delta rule with a decay: [k | a | b | log w] with a = −k,
/// b = βk, w = decay in every channel, so S ← w S − β kᵀ(k S) + kᵀ v (for β = 1 and
/// w = 1 the delta rule's S + kᵀ(v − k S)).
inline Matrix<float> rwkv7_delta_keys(const Matrix<float>& keys, float beta, double decay) {
    const Index n = keys.rows(), d = keys.cols();
    Matrix<float> rows(n, 4 * d);
    rows.leftCols(d) = keys;
    rows.middleCols(d, d) = -keys;
    rows.middleCols(2 * d, d) = beta * keys;
    rows.rightCols(d).setConstant(static_cast<float>(std::log(decay)));
    return rows;
}

}  // namespace memattn::recall
