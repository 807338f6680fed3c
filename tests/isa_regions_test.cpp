#include "support.hpp"

#include <memattn/cpu_features.hpp>
#include <memattn/detail/isa_regions.hpp>
#include <memattn/detail/packet.hpp>
#include <memattn/kernels/causal_softmax.hpp>
#include <memattn/memory/kv_cache.hpp>
#include <memattn/serving/paged_prefill.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

// Code compiled by target (detail/isa_regions.hpp): in a build that does not target
// AVX512-BF16 — the sanitize preset's, a distribution's -march=x86-64-v3 — the bfloat16
// kernel still takes vdpbf16ps (and AMX) where the CPU has them. These tests run in every
// preset, so on a CPU with AVX512-BF16 they check the products compiled in place (native)
// and by target (sanitize, under ASan and UBSan with Clang), and elsewhere that the
// kernel keeps to the float products.

using namespace memattn;
using memattn::test::random_matrix;

namespace {

/// A well-mixed word from i (splitmix64's finaliser), for bit patterns of every kind.
std::uint64_t isa_random_word(int i) {
    std::uint64_t z = static_cast<std::uint64_t>(i) * 0x9E3779B97F4A7C15ull + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

}  // namespace

TEST_CASE("isa regions: the bfloat16 kernel's arithmetic is what bf16_products() says, wherever the CPU has "
          "AVX512-BF16 and whatever the build targets",
          "[isa_regions]") {
    const CpuFeatures& f = cpu_features();
    const Bf16Products products = bf16_products();
    INFO(describe(f) << "; bf16_products " << static_cast<int>(products));
    CHECK((products != Bf16Products::converted_float) == detail::avx512_bf16_runs());
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(MEMATTN_NO_DISPATCH)
    CHECK(detail::avx512_bf16_code);
    CHECK(detail::avx512_bf16_runs() == f.avx512_bf16_usable());
    CHECK(detail::avx512_runs() == f.avx512_usable());
#endif
    if (detail::avx512_bf16_runs())
        WARN("bfloat16 products here: " << (detail::bf16_dot ? "compiled in place" : "compiled by target"));
    else
        WARN("no AVX512-BF16 here: the bfloat16 kernel converts its tiles to float");
}

TEST_CASE("isa regions: the bfloat16 kernel takes the pairs instantiation exactly where the products run, within "
          "the bound of the double reference",
          "[isa_regions][low_precision]") {
    using E = Eigen::bfloat16;
    struct Shape {
        Index n, d, dv, window, sinks;
    };
    for (const Shape s : {Shape{1, 7, 5, 0, 0}, Shape{70, 64, 33, 0, 0}, Shape{150, 3, 17, 17, 2},
                          Shape{200, 64, 16, 1000, 3}}) {
        INFO("n " << s.n << ", d " << s.d << ", dv " << s.dv << ", window " << s.window << ", sinks " << s.sinks);
        const Matrix<E> Q = random_matrix<float>(s.n, s.d, 11, 2.0).cast<E>(),
                        K = random_matrix<float>(s.n, s.d, 12, 2.0).cast<E>(),
                        V = random_matrix<float>(s.n, s.dv, 13).cast<E>();
        const SoftmaxOptions options{.scale = 0, .window = s.window, .sink_tokens = s.sinks};
        Matrix<float> O(s.n, s.dv);
        causal_softmax_attention(Q, K, V, O, options);
        // Each instantiation run directly, on the call's tiles or on others.
        const detail::SoftmaxTiles tiles = detail::default_tiles(detail::effective_window(s.window, s.n));
        const auto direct = [&]<bool Pairs>(detail::SoftmaxTiles t) {
            using Rows = detail::ConvertedRows<E, Pairs>;
            detail::SoftmaxScratch<float> scratch(s.d, s.dv, t);
            CHECK(scratch.lanes % 16 == 0);
            Matrix<float> out(s.n, s.dv);
            detail::causal_softmax_rows<float>(Rows(Q, t.queries, scratch.converted_q),
                                               Rows(K, t.keys, scratch.converted_k),
                                               Rows(V, t.keys, scratch.converted_v), MatrixRef<float>(out),
                                               [](Index, float) {}, options, scratch, detail::trailing_queries,
                                               detail::TileBias<float>{});
            return out;
        };
        // §4.7c's bound against the double reference on the same inputs.
        const auto expected = reference::softmax_attention(reference::to_double(Q.cast<float>()),
                                                           reference::to_double(K.cast<float>()),
                                                           reference::to_double(V.cast<float>()), 0, s.window, s.sinks);
        const double u = detail::avx512_bf16_runs() ? 0x1p-8 / (1 - 0x1p-8) : 0.0;
        const reference::MatrixD Vd = reference::to_double(V.cast<float>());
        const double scale = std::max(1.0, expected.out.cwiseAbs().maxCoeff());
        const auto outside = [&](const Matrix<float>& out) {
            int count = 0;
            for (Index c = 0; c < s.dv; ++c) {
                const double range = Vd.col(c).maxCoeff() - Vd.col(c).minCoeff();
                for (Index i = 0; i < s.n; ++i)
                    count += std::abs(static_cast<double>(out(i, c)) - expected.out(i, c)) > u * range + 2e-5 * scale;
            }
            return count;
        };
        CHECK(outside(O) == 0);
        const Matrix<float> converted = direct.template operator()<false>(tiles);
        if (!detail::avx512_bf16_runs()) {
            CHECK((O.array() == converted.array()).all());
            continue;
        }
        if constexpr (detail::avx512_bf16_code) {
            CHECK((O.array() == direct.template operator()<true>(tiles).array()).all());
            if (s.n > 1)  // the weights' rounding shows
                CHECK((O.array() != converted.array()).any());
            // Query tiles of 5 rows (a latent decode's tiles are its heads): the bfloat16
            // products load and store 16 lanes whole, past a portable build's packets (4
            // floats on plain x86-64), so the tiles' lanes must be padded to 16 (under
            // ASan: no read past them).
            CHECK(outside(direct.template operator()<true>(detail::SoftmaxTiles{5, 40})) == 0);
        }
    }
}

TEST_CASE("bfloat16 products' packing and rounding: value pairs by AVX-512 where it runs against the scalar loop, "
          "the weights' rounding of a packet against the scalar one",
          "[isa_regions][low_precision]") {
    // A portable build rounds the softmax's weights in integer lanes of its own packets;
    // a build with AVX512-BF16 by vcvtneps2bf16: both are the scalar rounding (nearest
    // even), ties, overflow to infinity and a NaN included.
    using P = detail::Packet<float>;
    constexpr auto width = static_cast<Index>(sizeof(P) / sizeof(float));
    std::vector<std::uint32_t> bits{0x3F808000u, 0x3F818000u, 0x3F807FFFu, 0x7F7FFFFFu, 0x80000000u, 0x00000001u,
                                    0x007FFFFFu, 0x7F800000u, 0xFF800000u, 0x7FC00000u, 0x7FFFFFFFu, 0x3F800000u};
    for (int i = 0; i < 200; ++i)
        bits.push_back(static_cast<std::uint32_t>(isa_random_word(i)));
    while (bits.size() % static_cast<std::size_t>(width) != 0)
        bits.push_back(0x40490FDBu);
    const detail::RoundToBf16 round;
    for (std::size_t i = 0; i < bits.size(); i += static_cast<std::size_t>(width)) {
        alignas(64) float x[64], y[64];
        for (Index l = 0; l < width; ++l)
            x[l] = std::bit_cast<float>(bits[i + static_cast<std::size_t>(l)]);
        if constexpr (width > 1)
            Eigen::internal::pstoreu(y, round(Eigen::internal::ploadu<P>(x)));
        else
            y[0] = round(x[0]);
        for (Index l = 0; l < width; ++l) {
            const float expected = round(x[l]);
            INFO(std::hex << bits[i + static_cast<std::size_t>(l)]);
            if (std::isnan(expected))
                CHECK(std::isnan(y[l]));
            else if (std::fpclassify(x[l]) != FP_SUBNORMAL || !detail::bf16_dot)  // vcvtneps2bf16 flushes them
                CHECK(std::bit_cast<std::uint32_t>(y[l]) == std::bit_cast<std::uint32_t>(expected));
        }
    }
    // Value pairs: the AVX-512 packets (by target in a portable build) and the scalar loop.
    if (!detail::avx512_bf16_runs()) {
        WARN("no AVX512-BF16 here: the value pairs' packets skipped");
        return;
    }
    for (const Index n : {1, 2, 7, 64})
        for (const Index cols : {1, 16, 33, 128}) {
            INFO("n = " << n << ", cols = " << cols);
            const Index ldx = cols + 3, ldo = detail::round_up(cols, 16);
            std::vector<std::uint16_t> x(static_cast<std::size_t>(n * ldx));
            for (std::size_t i = 0; i < x.size(); ++i)
                x[i] = static_cast<std::uint16_t>(isa_random_word(static_cast<int>(i) + 7) & 0xBFFFu);  // finite
            std::vector<std::uint32_t> wide(static_cast<std::size_t>((n + 1) / 2 * ldo), 1u), plain = wide;
            CHECK(detail::pack_row_pairs(x.data(), n, cols, ldx, wide.data(), ldo, true));
            CHECK(detail::pack_row_pairs(x.data(), n, cols, ldx, plain.data(), ldo, false));
            CHECK(wide == plain);
            x[static_cast<std::size_t>((n - 1) * ldx + cols - 1)] = 0x7F80;  // +∞ in the last value
            CHECK_FALSE(detail::pack_row_pairs(x.data(), n, cols, ldx, wide.data(), ldo, true));
            CHECK_FALSE(detail::pack_row_pairs(x.data(), n, cols, ldx, plain.data(), ldo, false));
        }
}

TEMPLATE_TEST_CASE("isa regions: the grouped decode takes its bfloat16 route (fold_bf16) exactly where the products "
                   "run, within the weights' bound of the double reference; a query's output the same in any group",
                   "[isa_regions][decode]", Eigen::bfloat16, Fp8E4M3) {
    // FpMath::bf16 decode over bfloat16 or FP8 rows: vdpbf16ps tiles (compiled by target in
    // a portable build) where the CPU has AVX512-BF16, else the float tiles on the queries
    // rounded to bfloat16, which a strict cache given the rounded queries computes bit for
    // bit. Groups of 1, 5 (tiles of 4 and 1) and 16 (tiles of 4 over bfloat16 rows, of 8
    // over FP8 ones); head dims off 32. A query's output is then the same in a group of 3
    // (the float routes' is not: their tiles follow the group's size).
    using S = TestType;
    const bool runs = detail::avx512_bf16_runs();
    const double bound = std::ldexp(1.0, -8) / (1 - std::ldexp(1.0, -8));
    Index differences = 0;
    for (const auto& [d, dv] : {std::pair<Index, Index>{1, 1}, {31, 40}, {128, 128}, {200, 33}})
        for (const Index n : {1, 37, 300})
            for (const Index g : {1, 5, 16}) {
                INFO("d = " << d << ", dv = " << dv << ", n = " << n << ", g = " << g);
                const Matrix<float> Q = random_matrix<float>(g, d, 61), K = random_matrix<float>(n, d, 62),
                                    V = random_matrix<float>(n, dv, 63);
                KVCache<float, S> cache(d, dv, SoftmaxOptions{.fpmath = FpMath::bf16}), strict(d, dv);
                cache.extend(K, V);
                strict.extend(K, V);
                Matrix<float> out(g, dv), converted(g, dv);
                cache.attend_group(Q, out);
                const Matrix<float> rounded = Q.cast<Eigen::bfloat16>().cast<float>();
                strict.attend_group(rounded, converted);
                const detail::GroupAttention<float> group(Q, 1.0f, false, detail::DecodeLogits{.bf16_products = true});
                CHECK(group.rounds_queries() == runs);
                if (runs)
                    differences += (out.array() != converted.array()).count();
                else
                    CHECK((out.array() == converted.array()).all());
                // The reference: the rounded queries against the stored rows, in double.
                Matrix<float> Ks(n, d), Vs(n, dv);
                detail::round_trip<float, S>(K, Ks.data(), d);
                detail::round_trip<float, S>(V, Vs.data(), dv);
                const reference::MatrixD Kd = Ks.cast<double>(), Vd = Vs.cast<double>();
                for (Index r = 0; r < g; ++r) {
                    const reference::MatrixD qd = rounded.row(r).cast<double>();
                    const reference::MatrixD expected =
                        reference::softmax_attention(qd, Kd, Vd, reference::Logits{.offset = n - 1}).out;
                    for (Index c = 0; c < dv; ++c) {
                        INFO("query " << r << ", column " << c);
                        const double range = Vd.col(c).maxCoeff() - Vd.col(c).minCoeff();
                        CHECK(std::abs(out(r, c) - expected(0, c)) <= bound * range + 2e-5 * (1 + std::abs(expected(0, c))));
                    }
                }
                if (runs && g == 16) {  // fold_bf16: one tiling and one order of terms for any group
                    Matrix<float> three(3, dv);
                    cache.attend_group(Q.middleRows(5, 3), three);
                    CHECK((three.array() == out.middleRows(5, 3).array()).all());
                }
            }
    if (runs)
        CHECK(differences > 0);  // the weights' rounding shows
    else
        WARN("no AVX512-BF16 here: the grouped decode takes the float tiles on the rounded queries");
}

TEMPLATE_TEST_CASE("isa regions: FP8 rows as bfloat16 words, by AVX-512 where it runs, as the table of values",
                   "[isa_regions][low_precision]", Fp8E4M3, Fp8E5M2) {
    using S = TestType;
    std::vector<std::uint8_t> row(300 + 31);
    for (std::size_t i = 0; i < row.size(); ++i)
        row[i] = static_cast<std::uint8_t>(i < 256 ? i : isa_random_word(static_cast<int>(i)));  // every byte
    // Every byte in every lane of the 32 a load converts (the row read from each of the
    // first 32 columns on), whole loads and the masked last ones of every length below 32.
    for (Index start = 0; start < 32; ++start)
        for (const Index cols : {Index(1), Index(31), Index(32), Index(33), 300 - start}) {
            INFO("start = " << start << ", cols = " << cols);
            const std::uint8_t* from = row.data() + start;
            std::vector<std::uint16_t> words(static_cast<std::size_t>(cols) + 1, 0xABCD);
            detail::fp8_words<S>(from, cols, words.data());
            Index wrong = 0;
            for (Index c = 0; c < cols; ++c) {
                const auto expected =
                    static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(detail::fp8_values<S>[from[c]]) >> 16);
                if (words[static_cast<std::size_t>(c)] != expected) {
                    if (wrong++ == 0)
                        FAIL_CHECK("byte " << int(from[c]) << " in column " << c << ": word "
                                           << words[static_cast<std::size_t>(c)] << ", expected " << expected);
                }
            }
            CHECK(wrong == 0);
            CHECK(words.back() == 0xABCD);  // nothing written past the row
        }
}
