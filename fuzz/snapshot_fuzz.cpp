// Fuzzing memattn::load: bytes in, never a crash, never a partial state.
//
// Input: one selector byte, then the stream. The selector's low bits pick the target
// memory (a small one that has seen a few tokens); its top bit makes the harness write a
// correct checksum over the stream first, so that mutated payloads reach the memories'
// own checks instead of stopping at the checksum. Then:
//   - load throws SnapshotError: the target's own snapshot is byte for byte what it was;
//   - load returns: saving the target gives exactly the bytes load consumed (the format
//     is canonical), and the loaded memory decodes a token (a latent cache: two heads
//     attend it), or, holding max_length tokens already, refuses it with
//     std::length_error and stays as it was;
//   - loading the same bytes from a buffer (load(memory, span)) has the same outcome, and
//     returns the size the stream load consumed, which is snapshot_size of the result.
// Seeds (fuzz/corpus/snapshot) are valid snapshots of every target, written by this file
// built with -DMEMATTN_SNAPSHOT_FUZZ_WRITE_SEEDS as an ordinary program and run with the
// directory as its argument.
#include <memattn/memattn.hpp>
#include <memattn/persistence/snapshot.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace memattn;

constexpr Index d = 3, dv = 2;

template <class M>
std::string saved(const M& memory) {
    std::ostringstream out(std::ios::binary);
    save(memory, out);
    return out.str();
}

/// A latent attention cache (not a Memory: its attend takes every head at once).
template <class M>
concept Latent = requires(const M& m) { m.latent_dim(); };

/// A memory that has seen `tokens` tokens of a fixed sequence (a latent cache: latents
/// and RoPE keys).
template <class M>
M fed(M memory, Index tokens) {
    using T = typename M::Scalar;
    Index kd = 0, vd = 0;
    if constexpr (Latent<M>) {
        kd = memory.latent_dim();
        vd = memory.rope_dim();
    } else {
        kd = memory.key_dim();
        vd = memory.value_dim();
    }
    Matrix<T> K(tokens, kd), V(tokens, vd);
    for (Index i = 0; i < K.size(); ++i)
        K.data()[i] = static_cast<T>((i * 37 % 11) - 5) / T(4);
    for (Index i = 0; i < V.size(); ++i)
        V.data()[i] = static_cast<T>((i * 13 % 7) - 3) / T(2);
    if constexpr (Latent<M>)
        memory.extend(K, V);
    else
        memattn::extend(memory, K, V);
    return memory;
}

/// Calls f(memory) with target number `which` (the seeds use every one).
template <class F>
void with_target(unsigned which, F&& f) {
    switch (which % 21) {
        case 0: return f(fed(KVCache<float>(d, dv), 3));
        case 1: return f(fed(KVCache<double>(d, dv), 0));
        case 2: return f(fed(SlidingWindowCache<float>(d, dv, 4, 1), 7));
        case 3: return f(fed(SlidingWindowCache<double>(d, dv, 3), 2));
        case 4: return f(fed(HybridCache<float>(d, dv, 3, 2, 2), 9));
        case 5: return f(fed(HybridCache<double, WeightedPool>(d, dv, 2, 2, 3, 0.0, WeightedPool({0.5, 0.5})), 6));
        case 6: return f(fed(MovingAverageCache<float>(d, dv, 3), 5));
        case 7: return f(fed(MovingAverageCache<double>(d, dv, 0), 4));
        case 8: return f(fed(LinearAttentionMemory<float>(d, dv), 5));
        case 9: return f(fed(LinearAttentionMemory<double, FavorPlus>(d, dv, FavorPlus(d, 4, 1)), 3));
        case 12: return f(fed(KVCache<float, Q8>(d, dv), 4));
        case 13: return f(fed(SlidingWindowCache<double, Eigen::bfloat16>(d, dv, 3, 1), 6));
        case 14: return f(fed(KVCache<float, Q4>(d, dv), 5));
        case 15: return f(fed(SlidingWindowCache<float, Q4Affine>(d, dv, 4, 1), 7));
        case 16: return f(fed(KVCache<double, Fp8E4M3>(d, dv), 5));
        case 17: return f(fed(KVCache<float, Fp8E5M2>(d, dv), 4));
        case 18: return f(fed(SlidingWindowCache<double, PerTokenScale<Fp8E4M3>>(d, dv, 3, 1), 6));
        case 19: return f(fed(LatentKVCache<float>(d, dv, 0.5f), 5));
        case 20: return f(fed(LatentKVCache<double, Q8>(d + 1, dv, 0.25), 3));
        case 10:
            return f(fed(MultiHead<KVCache<float>>({.q_heads = 2, .kv_heads = 2, .head_dim = d, .value_dim = dv},
                                                    [](Index) { return KVCache<float>(d, dv); }),
                         2));
        default:
            return f(fed(MultiHead<SlidingWindowCache<double>>(
                             {.q_heads = 2, .kv_heads = 1, .head_dim = d, .value_dim = dv},
                             [](Index) { return SlidingWindowCache<double>(d, dv, 2, 1); }),
                         4));
    }
}

/// The same bytes loaded from a buffer (exactly their size): SIZE_MAX when load threw,
/// else the size it returned. The memory is unchanged when it threw.
template <class M>
std::size_t span_load(M target, const std::string& stream, const std::string& before) {
    std::vector<std::byte> buffer(stream.size());
    if (!stream.empty())  // an empty vector's data() may be null
        std::memcpy(buffer.data(), stream.data(), stream.size());
    try {
        const std::size_t consumed = load(target, std::span<const std::byte>(buffer));
        if (snapshot_size(target) != consumed || saved(target) != stream.substr(0, consumed))
            std::abort();  // the size or the bytes differ from what was loaded
        return consumed;
    } catch (const SnapshotError&) {
        if (saved(target) != before)
            std::abort();  // a throwing load changed the memory
        return SIZE_MAX;
    }
}

/// What loaded answers: a memory decodes a token, a latent cache attends two heads.
template <class M>
void use_loaded(M& target) {
    using T = typename M::Scalar;
    if constexpr (Latent<M>) {
        const Matrix<T> q = Matrix<T>::Ones(2, target.query_dim());
        Matrix<T> o(2, target.latent_dim());
        target.attend(q, o);
    } else {
        Index qd = target.key_dim(), od = target.value_dim();
        if constexpr (detail::KnowsQueryDims<M>) {
            qd = target.query_dim();
            od = target.output_dim();
        }
        const Matrix<T> q = Matrix<T>::Ones(1, qd), k = Matrix<T>::Ones(1, target.key_dim()),
                        v = Matrix<T>::Ones(1, target.value_dim());
        Matrix<T> o(1, od);
        if (target.length() > max_length - 1) {  // full (a stream may say max_length): the step refused, unchanged
            const std::string before = saved(target);
            try {
                decode(target, q, k, v, o);
            } catch (const std::length_error&) {
                if (saved(target) != before)
                    std::abort();  // a refused step changed the memory
                return;
            }
            std::abort();  // a step past max_length was taken
        }
        decode(target, q, k, v, o);
    }
}

template <class M>
void fuzz_load(M target, std::string stream) {
    const std::string before = saved(target);
    const std::size_t from_span = span_load(target, stream, before);
    std::istringstream in(stream, std::ios::binary);
    try {
        load(target, in);
    } catch (const SnapshotError&) {
        if (saved(target) != before)
            std::abort();  // a throwing load changed the memory
        if (from_span != SIZE_MAX)
            std::abort();  // the buffer loaded what the stream refused
        return;
    }
    const std::streamoff at = in.tellg();
    const std::size_t consumed = at < 0 ? stream.size() : static_cast<std::size_t>(at);
    if (saved(target) != stream.substr(0, consumed))
        std::abort();  // what loaded does not save back to the same bytes
    if (from_span != consumed)
        std::abort();  // the buffer and the stream disagree
    use_loaded(target);
}

}  // namespace

#ifndef MEMATTN_SNAPSHOT_FUZZ_WRITE_SEEDS

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    if (size == 0)
        return 0;
    const unsigned selector = data[0];
    std::string stream(reinterpret_cast<const char*>(data + 1), size - 1);
    if ((selector & 0x80) != 0 && stream.size() >= 4) {
        const std::uint32_t crc = detail::Crc32c::update(0, stream.data(), stream.size() - 4);
        detail::little_endian(crc, reinterpret_cast<unsigned char*>(stream.data() + stream.size() - 4));
    }
    with_target(selector & 0x7F, [&](auto target) { fuzz_load(std::move(target), stream); });
    return 0;
}

#else

#include <fstream>

int main(int argc, char** argv) {
    if (argc != 2)
        return 2;
    for (unsigned which = 0; which < 21; ++which)
        with_target(which, [&](const auto& memory) {
            std::ofstream out(std::string(argv[1]) + "/seed-" + std::to_string(which), std::ios::binary);
            out.put(static_cast<char>(which | 0x80));  // a fixed checksum: mutations reach the payload checks
            save(memory, out);
        });
}

#endif
