#include "support.hpp"

#include <memattn/cpu_features.hpp>
#include <memattn/detail/bf16_weights.hpp>
#include <memattn/kernels/group_attention.hpp>
#include <memattn/kernels/softmax_products.hpp>
#include <memattn/kernels/softmax_tiles.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

using namespace memattn;
using memattn::test::random_matrix;
using memattn::reference::MatrixD;

namespace {

/// The bits of x rounded to bfloat16 (nearest even).
std::uint16_t amx_bf16_bits(float x) { return std::bit_cast<std::uint16_t>(Eigen::bfloat16(x)); }
float amx_widen(std::uint16_t h) { return std::bit_cast<float>(std::uint32_t{h} << 16); }

/// A row source of bfloat16 rows (the kernel's ConvertedRows<Eigen::bfloat16> where it
/// holds pairs), on any CPU: bits in place, and the rows as floats.
struct AmxTestRows {
    [[maybe_unused]] static constexpr bool pairs = true;  // what the kernel asks of a row source
    explicit AmxTestRows(const Matrix<float>& x) : values(x.rows(), x.cols()), raw(static_cast<std::size_t>(x.size())) {
        for (Index j = 0; j < x.rows(); ++j)
            for (Index c = 0; c < x.cols(); ++c) {
                raw[static_cast<std::size_t>(j * x.cols() + c)] = amx_bf16_bits(x(j, c));
                values(j, c) = amx_widen(raw[static_cast<std::size_t>(j * x.cols() + c)]);
            }
    }
    [[nodiscard]] Index cols() const noexcept { return values.cols(); }
    [[nodiscard]] std::pair<const std::uint16_t*, Index> bits(Index j, Index = 1) const noexcept {
        return {raw.data() + j * cols(), cols()};
    }
    [[nodiscard]] std::pair<const float*, Index> tile(Index j0, Index) const noexcept {
        return {values.data() + j0 * cols(), cols()};
    }
    Matrix<float> values;  // the bfloat16 values, exactly
    std::vector<std::uint16_t> raw;
};

/// Random operands of amx_product: A (rows × lda bfloat16) and B (pairs × ldb words of
/// two bfloat16).
std::pair<std::vector<std::uint16_t>, std::vector<std::uint32_t>> amx_operands(Index rows, Index lda, Index pairs,
                                                                               Index ldb, std::uint64_t& seed) {
    const Matrix<float> av = random_matrix<float>(rows, lda, ++seed), bv = random_matrix<float>(pairs, 2 * ldb, ++seed);
    std::vector<std::uint16_t> a(static_cast<std::size_t>(rows * lda));
    for (Index i = 0; i < av.size(); ++i)
        a[static_cast<std::size_t>(i)] = amx_bf16_bits(av.data()[i]);
    std::vector<std::uint32_t> b(static_cast<std::size_t>(pairs * ldb));
    for (Index i = 0; i < pairs * ldb; ++i)
        b[static_cast<std::size_t>(i)] =
            amx_bf16_bits(bv.data()[2 * i]) | std::uint32_t{amx_bf16_bits(bv.data()[2 * i + 1])} << 16;
    return {std::move(a), std::move(b)};
}

/// C of amx_product written the way the SDM defines tdpbf16ps, one element at a time:
/// pairs ascending, the low term then the high, each added in float (no denormals here).
Matrix<float> amx_reference(const std::vector<std::uint16_t>& a, Index lda, const std::vector<std::uint32_t>& b,
                            Index ldb, Index rows, Index cols, Index pairs, const Matrix<float>* start) {
    Matrix<float> c = start ? *start : Matrix<float>::Zero(rows, cols);
    for (Index r = 0; r < rows; ++r)
        for (Index n = 0; n < cols; ++n) {
            float acc = c(r, n);
            for (Index k = 0; k < pairs; ++k) {
                const std::uint32_t w = b[static_cast<std::size_t>(k * ldb + n)];
                acc = std::fma(amx_widen(a[static_cast<std::size_t>(r * lda + 2 * k)]),
                               amx_widen(static_cast<std::uint16_t>(w)), acc);
                acc = std::fma(amx_widen(a[static_cast<std::size_t>(r * lda + 2 * k + 1)]),
                               amx_widen(static_cast<std::uint16_t>(w >> 16)), acc);
            }
            c(r, n) = acc;
        }
    return c;
}

}  // namespace

TEST_CASE("AMX tile product: every element is tdpbf16ps's sum in its order, for shapes off every tile, emulated",
          "[amx]") {
    std::uint64_t seed = 700;
    for (const Index rows : {1, 15, 16, 17, 32, 33, 50})
        for (const Index cols : {1, 16, 17, 31, 32, 47})
            for (const Index pairs : {1, 15, 16, 17, 40, 64}) {
                INFO(rows << " x " << cols << ", " << pairs << " pairs");
                const Index lda = 2 * pairs + 6, ldb = cols + 3, ldc = cols + 5;  // strides past the rows
                const auto [a, b] = amx_operands(rows, lda, pairs, ldb, seed);
                for (const bool accumulate : {false, true}) {
                    const Matrix<float> start = random_matrix<float>(rows, cols, ++seed);
                    Matrix<float> c = Matrix<float>::Constant(rows, ldc, 7.0f);  // columns past cols stay
                    c.leftCols(cols) = start;
                    detail::amx_product<detail::AmxEmulated>(rows, cols, pairs, a.data(), lda, b.data(), ldb, c.data(),
                                                             ldc, accumulate);
                    const Matrix<float> expected = amx_reference(a, lda, b, ldb, rows, cols, pairs, accumulate ? &start : nullptr);
                    CHECK((c.leftCols(cols).array() == expected.array()).all());
                    CHECK((c.rightCols(ldc - cols).array() == 7.0f).all());
                }
            }
}

TEST_CASE("AMX weight rows: every pair of keys per lane, for keys and lanes off every block, by AVX-512 where it "
          "runs (in a portable build too) and by the scalar loop",
          "[amx]") {
    // The AVX-512 transposes are compiled by target where the build lacks AVX-512, so they
    // run wherever the CPU has it; the scalar loop everywhere.
    const bool wide = GENERATE(false, true);
    if (wide && !detail::avx512_runs()) {
        WARN("no AVX-512 here: the weight rows' transposes skipped");
        return;
    }
    for (const Index n : {1, 2, 31, 32, 33, 64, 97, 128})
        for (const Index cols : {1, 16, 17, 40, 64}) {
            INFO("n = " << n << ", cols = " << cols << ", wide = " << wide);
            const Index lanes = cols + 5, ldo = (n + 1) / 2 + 3;
            Matrix<float> p = random_matrix<float>(n, lanes, 811);
            for (Index i = 0; i < p.size(); ++i)
                p.data()[i] = amx_widen(amx_bf16_bits(p.data()[i]));
            std::vector<std::uint32_t> out(static_cast<std::size_t>(cols * ldo), 0xDEADBEEFu);
            detail::pack_weight_rows(p.data(), n, cols, lanes, out.data(), ldo, wide);
            int wrong = 0;
            for (Index i = 0; i < cols; ++i)
                for (Index w = 0; w < ldo; ++w) {
                    const std::uint32_t low = 2 * w < n ? amx_bf16_bits(p(2 * w, i)) : 0u;
                    const std::uint32_t high = 2 * w + 1 < n ? amx_bf16_bits(p(2 * w + 1, i)) : 0u;
                    const std::uint32_t expected = 2 * w < n ? low | high << 16 : 0xDEADBEEFu;  // past: untouched
                    wrong += out[static_cast<std::size_t>(i * ldo + w)] != expected;
                }
            CHECK(wrong == 0);
        }
}

TEST_CASE("softmax weights packed as they are computed: absorb's m, sum, α and the packed words of its rounded "
          "weights, bit for bit, in both layouts, keys off every block, scaled or not, with −∞ and NaN logits",
          "[amx][softmax]") {
#if !defined(MEMATTN_AVX512_BF16_CODE)
    WARN("no AVX512-BF16 code in this build: the weights are absorbed, then packed (no fused path here)");
#else
    if (!detail::avx512_bf16_runs()) {
        WARN("no AVX512-BF16 here (" << describe(cpu_features()) << "): the fused absorb not run");
        return;
    }
    const auto bits = [](float x) { return std::bit_cast<std::uint32_t>(x); };
    const float inf = std::numeric_limits<float>::infinity();
    for (const Index keys : {1, 2, 3, 15, 16, 17, 31, 32, 33, 64, 95, 128})
        for (const Index cols : {16, 48})
            for (const bool scaled : {false, true})
                for (const bool rows : {false, true}) {
                    INFO("keys = " << keys << ", cols = " << cols << ", scaled = " << scaled << ", rows = " << rows);
                    const Index lanes = cols + 16, pair_rows = (keys + 1) / 2;
                    // Word strides of the packed weights unlike the logits' (lanes), with
                    // room past what is written: its words must stay as they were.
                    const Index ldo = rows ? pair_rows + 3 : lanes + 5;
                    Matrix<float> s = 8.0f * random_matrix<float>(keys, lanes, 821);
                    s(0, 7) = inf * 0.0f;  // a NaN logit, a low half
                    if (keys > 1)
                        s(1, 12) = inf * 0.0f;  // and a high half
                    s(keys - 1, 3) = -inf;  // a masked one
                    s.col(9).setConstant(-inf);  // a lane that sees nothing here
                    // Both states after a first tile, so that α and the sums are not trivial.
                    SoftmaxBlockState<float> plain(lanes), packed(lanes);
                    Matrix<float> before = 8.0f * random_matrix<float>(5, lanes, 822);
                    before(2, 11) = 40.0f;  // a lane whose maximum this tile does not move
                    before.col(9).setConstant(-inf);  // lane 9 sees nothing in either tile
                    Matrix<float> before2 = before;
                    plain.absorb(before.data(), 5, lanes, cols, detail::RoundToBf16{});
                    packed.absorb(before2.data(), 5, lanes, cols, detail::RoundToBf16{});
                    // A NaN maximum is kept (a NaN logit is dropped from the maximum).
                    plain.lane_rows().max[13] = packed.lane_rows().max[13] = inf * 0.0f;
                    const float f = scaled ? 0.75f : 0.0f;
                    Matrix<float> weights = s;
                    if (scaled)
                        plain.absorb_scaled(weights.data(), keys, lanes, cols, f, detail::RoundToBf16{});
                    else
                        plain.absorb(weights.data(), keys, lanes, cols, detail::RoundToBf16{});
                    // The words absorb + the pack give, at the packed weights' stride.
                    const std::size_t words = static_cast<std::size_t>(rows ? lanes * ldo : (pair_rows + 2) * ldo);
                    std::vector<std::uint32_t> expected(words, 0xDEADBEEFu), got(words, 0xDEADBEEFu);
                    Matrix<float> logits = s;
                    if (rows) {
                        detail::pack_weight_rows(weights.data(), keys, cols, lanes, expected.data(), ldo, true);
                        const auto r = packed.lane_rows();
                        detail::absorb_packed<detail::WeightLayout::rows>(logits.data(), keys, lanes, cols, f, r.max,
                                                                          r.sum, r.alpha, got.data(), ldo);
                    } else {
                        std::vector<std::uint32_t> at_lanes(static_cast<std::size_t>(pair_rows * lanes));
                        detail::pack_weight_pairs(weights.data(), keys, cols, lanes, at_lanes.data());
                        for (Index k = 0; k < pair_rows; ++k)
                            for (Index i = 0; i < cols; ++i)
                                expected[static_cast<std::size_t>(k * ldo + i)] =
                                    at_lanes[static_cast<std::size_t>(k * lanes + i)];
                        const auto r = packed.lane_rows();
                        detail::absorb_packed<detail::WeightLayout::pairs>(logits.data(), keys, lanes, cols, f, r.max,
                                                                           r.sum, r.alpha, got.data(), ldo);
                    }
                    int wrong = 0;
                    for (std::size_t w = 0; w < words; ++w)
                        wrong += got[w] != expected[w];
                    CHECK(wrong == 0);
                    CHECK(std::memcmp(logits.data(), s.data(), sizeof(float) * static_cast<std::size_t>(s.size())) ==
                          0);  // the logits left as they were
                    wrong = 0;
                    // (A NaN lane's sum: a NaN either way, its payload RoundToBf16's where that
                    // kept the float NaN, in a build without AVX512-BF16.)
                    const auto same_sum = [&](float x, float y) {  // (and a weight)
                        return std::isnan(x) && std::isnan(y) ? true : bits(x) == bits(y);
                    };
                    for (Index i = 0; i < cols; ++i) {
                        wrong += bits(packed.state(i).max) != bits(plain.state(i).max);
                        wrong += !same_sum(packed.state(i).sum, plain.state(i).sum);
                        wrong += bits(packed.alpha()[i]) != bits(plain.alpha()[i]);
                    }
                    CHECK(wrong == 0);
                    CHECK(std::isnan(packed.state(7).sum));
                    CHECK(std::isnan(packed.state(13).max));
                    CHECK(std::isnan(packed.state(keys > 1 ? 12 : 7).sum));
                    // And back: unpack_weights gives the rounded weights absorb stored.
                    Matrix<float> unpacked = Matrix<float>::Zero(keys, lanes);
                    detail::unpack_weights(rows ? detail::WeightLayout::rows : detail::WeightLayout::pairs,
                                           got.data(), ldo, keys, cols, unpacked.data(), lanes);
                    wrong = 0;
                    for (Index j = 0; j < keys; ++j)
                        for (Index i = 0; i < cols; ++i)
                            wrong += !same_sum(unpacked(j, i), weights(j, i));  // (a NaN: of either payload)
                    CHECK(wrong == 0);
                }
#endif
}

TEST_CASE("AMX tile products of the softmax kernel, emulated: the logits and the weighted values of the float "
          "products on the same bfloat16 values",
          "[amx]") {
    using B = detail::DefaultBlocking;
    for (const Index d : {2, 64, 130})
        for (const Index dv : {1, 16, 40}) {
            INFO("d = " << d << ", dv = " << dv);
            const Index queries = 40, n = 37, j0 = 3;
            const detail::SoftmaxTiles tiles{.queries = 48, .keys = 64};
            detail::SoftmaxScratch<float> amx_scratch(d, dv, tiles), float_scratch(d, dv, tiles);
            const Index lanes = amx_scratch.lanes, cols = lanes;
            AmxTestRows q(random_matrix<float>(queries, d, 801)), k(random_matrix<float>(j0 + n, d, 802)),
                v(random_matrix<float>(j0 + n, dv, 803));
            detail::AmxTileProducts<B, detail::AmxEmulated> amx(amx_scratch, d, dv);
            detail::FloatTileProducts<float, B> plain(float_scratch, d, dv);
            REQUIRE(amx.tiles());
            const float f = 0.125f;
            amx.load_queries(q, 0, queries, cols, f);
            plain.load_queries(q, 0, queries, cols, f);
            Matrix<float> s_amx = Matrix<float>::Zero(n, lanes), s_plain = Matrix<float>::Zero(n, lanes);
            amx.scores(k, j0, n, cols, s_amx.data(), detail::WholeStrip{}, nullptr);
            plain.scores(k, j0, n, cols, s_plain.data(), detail::WholeStrip{}, nullptr);
            const double scale = std::sqrt(static_cast<double>(d)) * 0.125;
            CHECK((s_amx - s_plain).cwiseAbs().maxCoeff() <= 1e-5 * scale);
            CHECK(s_amx.rightCols(lanes - queries).cwiseAbs().maxCoeff() == 0.0f);  // lanes past the queries
            // Weights already bfloat16 (the products' Rounding), so both sum the same terms.
            Matrix<float> p = random_matrix<float>(n, lanes, 804).cwiseAbs();
            for (Index i = 0; i < p.size(); ++i)
                p.data()[i] = amx_widen(amx_bf16_bits(p.data()[i]));
            const Matrix<float> acc0 = random_matrix<float>(lanes, dv, 805);
            const Matrix<float> alpha = random_matrix<float>(1, lanes, 806).cwiseAbs();
            for (const bool scaled : {false, true}) {
                Matrix<float> acc_amx = acc0, acc_plain = acc0;
                const auto never = [](const float*, Index) { FAIL("careful"); };
                amx.accumulate(v, j0, n, cols, p.data(), acc_amx.data(), scaled ? alpha.data() : nullptr, false,
                               detail::WholeStrip{}, nullptr, never);
                plain.accumulate(v, j0, n, cols, p.data(), acc_plain.data(), scaled ? alpha.data() : nullptr, false,
                                 detail::WholeStrip{}, nullptr, never);
                CHECK((acc_amx - acc_plain).cwiseAbs().maxCoeff() <= 2e-5 * static_cast<double>(n));
            }
            // A value that is not finite goes to `careful`, the accumulators untouched.
            AmxTestRows bad(random_matrix<float>(j0 + n, dv, 807));
            bad.raw[static_cast<std::size_t>((j0 + 5) * dv)] = 0x7F80;  // +∞
            Matrix<float> acc = acc0;
            int careful = 0;
            amx.accumulate(bad, j0, n, cols, p.data(), acc.data(), nullptr, true, detail::WholeStrip{}, nullptr,
                           [&](const float*, Index) { ++careful; });
            CHECK(careful == 1);
            CHECK(acc == acc0);
        }
}

TEST_CASE("AMX tile product on the CPU's tiles, where they run: the emulation's sums, from two threads at once",
          "[amx]") {
    if (!cpu_features().amx_usable() || !request_amx()) {
        SUCCEED("no AMX tiles here (" << describe(cpu_features()) << "): the emulated tests stand for them");
        return;
    }
    const auto run = [](std::uint64_t seed, int* bitwise_differences, int* failures) {
        for (const Index rows : {1, 16, 17, 33, 50})
            for (const Index cols : {1, 16, 17, 47})
                for (const Index pairs : {1, 16, 17, 64}) {
                    const Index lda = 2 * pairs + 6, ldb = cols + 3;
                    const auto [a, b] = amx_operands(rows, lda, pairs, ldb, seed);
                    const Matrix<float> start = random_matrix<float>(rows, cols, ++seed);
                    Matrix<float> hw = start, em = start;
                    detail::amx_product<detail::AmxHardware>(rows, cols, pairs, a.data(), lda, b.data(), ldb, hw.data(),
                                                             cols, true);
                    detail::amx_product<detail::AmxEmulated>(rows, cols, pairs, a.data(), lda, b.data(), ldb, em.data(),
                                                             cols, true);
                    const double scale = std::sqrt(2.0 * static_cast<double>(pairs)) + 1;
                    if ((hw - em).cwiseAbs().maxCoeff() > 4e-6 * scale)
                        ++*failures;
                    *bitwise_differences += static_cast<int>((hw.array() != em.array()).count());
                }
    };
    int differences[2] = {0, 0}, failures[2] = {0, 0};
    std::thread other(run, 900, &differences[1], &failures[1]);
    run(900, &differences[0], &failures[0]);
    other.join();
    CHECK(failures[0] == 0);
    CHECK(failures[1] == 0);
    CHECK(differences[0] == differences[1]);  // the same inputs on two threads: the same sums
    if (differences[0] > 0)
        WARN(differences[0] << " elements differ from the emulation in their last bits: the hardware adds in another "
                               "order than the SDM's pseudo-code");
}

namespace {

/// Rows of S holding x, and their values in double.
template <class S>
std::pair<detail::StoredRows<float, S>, MatrixD> amx_stored(const Matrix<float>& x) {
    detail::StoredRows<float, S> rows(x.rows(), x.cols());
    Matrix<float> back(x.rows(), x.cols());
    if (x.rows() > 0) {
        rows.put_rows(0, x);
        rows.decode_rows(0, x.rows(), back.data(), x.cols());
    }
    return {std::move(rows), back.cast<double>()};
}

}  // namespace

TEMPLATE_TEST_CASE("AMX grouped decode tiles, emulated: the logits and the weighted values are tdpbf16ps's sums in "
                   "their order, for keys, head dims and groups off every tile",
                   "[amx][decode]", Eigen::bfloat16, Fp8E4M3, Fp8E5M2) {
#if defined(MEMATTN_GROUP_BF16)
    if (!detail::avx512_bf16_runs()) {
        SUCCEED("no AVX512-BF16 here: the emulated tiles convert their rows by it (Bf16Words)");
        return;
    }
    using S = TestType;
    using Tiles = detail::AmxGroupTiles<detail::AmxEmulated>;
    std::uint64_t seed = 1200;
    for (const Index d : {1, 2, 31, 32, 33, 64, 100, 128, 256})
        for (const Index m : {1, 2, 15, 16, 17, 31, 33, 64, 127, 128})
            for (const Index g : {1, 3, 4, 16}) {
                INFO("d = " << d << ", m = " << m << ", g = " << g);
                const Index first = 5, depth = (d + 31) / 32 * 32;
                const Matrix<float> x = random_matrix<float>(first + m + 3, d, ++seed);
                const auto [keys, kd] = amx_stored<S>(x);
                // The queries rounded to bfloat16, zero-padded to whole 32s, and their pairs.
                const Matrix<float> q = random_matrix<float>(g, d, ++seed);
                std::vector<std::uint16_t> qb(static_cast<std::size_t>(g * depth), 0);
                for (Index r = 0; r < g; ++r)
                    for (Index c = 0; c < d; ++c)
                        qb[static_cast<std::size_t>(r * depth + c)] = amx_bf16_bits(q(r, c));
                std::vector<std::uint32_t> pairs(static_cast<std::size_t>(depth / 2 * 16));
                Tiles::pack_query_pairs(qb.data(), depth, g, depth, pairs.data());
                const float scale = 0.3f;
                std::vector<float> s(static_cast<std::size_t>(g * 130), -7.0f);
                Index asked = 0;
                {
                    Tiles tiles(g);
                    // Every key asked for once, in order, a share of its 32 at a time (one
                    // before each of their 2 · d/32 tile products, not the 32 in one burst).
                    const Index chunks = (d + 31) / 32, share = (32 + 2 * chunks - 1) / (2 * chunks);
                    tiles.logits(keys, first, m, d, pairs.data(), scale, s.data(), 130, [&](Index j, Index n) {
                        CHECK(j == asked);
                        CHECK((n >= 1 && n <= share));
                        asked += n;
                    });
                }
                CHECK(asked == m);
                for (Index r = 0; r < g; ++r) {
                    for (Index j = 0; j < m; ++j) {
                        float acc = 0;  // pairs ascending, the low term first
                        for (Index k = 0; k < d; ++k)
                            acc = std::fma(amx_widen(qb[static_cast<std::size_t>(r * depth + k)]),
                                           static_cast<float>(kd(first + j, k)), acc);
                        CHECK(std::bit_cast<std::uint32_t>(s[static_cast<std::size_t>(r * 130 + j)]) ==
                              std::bit_cast<std::uint32_t>(scale * acc));
                    }
                    CHECK(s[static_cast<std::size_t>(r * 130 + m)] == -7.0f);  // nothing past the keys
                }
                // The values: g × dv from a random start, columns past dv zero.
                const Index dv = d, ldo = depth;
                const auto [values, vd] = amx_stored<S>(random_matrix<float>(first + m + 3, dv, ++seed));
                const Matrix<float> w = random_matrix<float>(g, m, ++seed).cwiseAbs();
                std::vector<std::uint16_t> wb(static_cast<std::size_t>(g * 130), 0);
                for (Index r = 0; r < g; ++r)
                    for (Index j = 0; j < m; ++j)
                        wb[static_cast<std::size_t>(r * 130 + j)] = amx_bf16_bits(w(r, j));
                const Matrix<float> start = random_matrix<float>(g, dv, ++seed);
                std::vector<float> o(static_cast<std::size_t>(g * ldo), 0.0f);
                for (Index r = 0; r < g; ++r)
                    for (Index c = 0; c < dv; ++c)
                        o[static_cast<std::size_t>(r * ldo + c)] = start(r, c);
                {
                    Tiles tiles(g);
                    tiles.values(values, first, m, dv, wb.data(), 130, o.data(), ldo);
                }
                for (Index r = 0; r < g; ++r)
                    for (Index c = 0; c < ldo; ++c) {
                        float acc = c < dv ? start(r, c) : 0.0f;
                        for (Index j = 0; j < m && c < dv; ++j)
                            acc = std::fma(amx_widen(wb[static_cast<std::size_t>(r * 130 + j)]),
                                           static_cast<float>(vd(first + j, c)), acc);
                        CHECK(std::bit_cast<std::uint32_t>(o[static_cast<std::size_t>(r * ldo + c)]) ==
                              std::bit_cast<std::uint32_t>(acc));
                    }
            }
#else
    SUCCEED("the grouped decode's bfloat16 routes are not compiled for this target (no AVX512-BF16)");
#endif
}

namespace {

/// out (g × dv) = the grouped decode of q over the rows [0, n) of keys and values, folded
/// in two runs cut at `cut`, by GroupAttention<float, Tiles> with FpMath::bf16.
template <class Tiles, class Rows, class ValueRows>
Matrix<float> amx_group_decode(const Matrix<float>& q, const Rows& keys, const ValueRows& values, Index n, Index cut,
                               detail::DecodeLogits logits) {
    logits.bf16_products = true;
    detail::GroupAttention<float, Tiles> group(q, 1.0f / std::sqrt(static_cast<float>(q.cols())), false, logits);
    Matrix<float> acc = Matrix<float>::Zero(q.rows(), values.cols());
    group.fold_stored(keys, values, 0, cut, acc, 0);
    group.fold_stored(keys, values, cut, n - cut, acc, cut);
    for (Index r = 0; r < q.rows(); ++r)
        group.finish(r, acc.row(r));
    return acc;
}

}  // namespace

TEMPLATE_TEST_CASE("AMX grouped decode, emulated: FpMath::bf16 over bfloat16 and FP8 rows in tiles, within the "
                   "weights' bound of the double reference on the rounded queries, with the logit options; a "
                   "query's output the same in any group",
                   "[amx][decode]", Eigen::bfloat16, Fp8E4M3, Fp8E5M2) {
#if defined(MEMATTN_GROUP_BF16)
    if (!detail::avx512_bf16_runs()) {
        SUCCEED("no AVX512-BF16 here: the grouped decode takes the float products (isa_regions_test)");
        return;
    }
    using S = TestType;
    using detail::AmxEmulated;
    const double slope = 0.05, sink = 0.5, bound = std::ldexp(1.0, -8) / (1 - std::ldexp(1.0, -8));
    const std::vector<double> slopes(16, slope), sinks(16, sink);
    // dv = 300: past the tiles' output rows (max_depth), the values take vdpbf16ps.
    for (const auto& [d, dv] :
         {std::pair<Index, Index>{1, 1}, {31, 40}, {64, 24}, {128, 128}, {200, 33}, {256, 64}, {64, 300}})
        for (const Index n : {1, 2, 37, 129, 300})
            for (const int variant : {0, 1}) {
                INFO("d = " << d << ", dv = " << dv << ", n = " << n << ", variant " << variant);
                const Matrix<float> Q = random_matrix<float>(16, d, 81);
                const auto [keys, Kd] = amx_stored<S>(random_matrix<float>(n, d, 82));
                const auto [values, Vd] = amx_stored<S>(random_matrix<float>(n, dv, 83));
                detail::DecodeLogits logits{.position = n - 1};
                if (variant == 1)
                    logits = {.softcap = 6, .slopes = slopes.data(), .sinks = sinks.data(), .position = n - 1};
                const Index cut = n / 3;
                const Matrix<float> out = amx_group_decode<AmxEmulated>(Q, keys, values, n,
                                                                        cut, logits);
                // The reference: the rounded queries against the stored rows, in double.
                const MatrixD Qd = Q.cast<Eigen::bfloat16>().cast<double>();
                for (Index r = 0; r < 16; ++r) {
                    reference::Logits o{.offset = n - 1};
                    if (variant == 1) {
                        o.softcap = 6;
                        o.slope = slope;
                        o.sink = sink;
                    }
                    const MatrixD expected = reference::softmax_attention(Qd.row(r), Kd, Vd, o).out;
                    for (Index c = 0; c < dv; ++c) {
                        const double lo = std::min(variant == 1 ? 0.0 : Vd.col(c).minCoeff(), Vd.col(c).minCoeff());
                        const double hi = std::max(variant == 1 ? 0.0 : Vd.col(c).maxCoeff(), Vd.col(c).maxCoeff());
                        INFO("query " << r << ", column " << c);
                        CHECK(std::abs(out(r, c) - expected(0, c)) <=
                              bound * (hi - lo) + 2e-5 * (1 + std::abs(expected(0, c))));
                    }
                }
                // One order of terms for every group: a group of 3 and a query alone.
                const Matrix<float> three =
                    amx_group_decode<AmxEmulated>(Q.middleRows(5, 3), keys, values, n, cut, logits.from(5));
                CHECK((three.array() == out.middleRows(5, 3).array()).all());
                const Matrix<float> one = amx_group_decode<AmxEmulated>(Q.middleRows(9, 1), keys, values, n, cut,
                                                                        logits.from(9));
                CHECK((one.array() == out.middleRows(9, 1).array()).all());
            }
#else
    SUCCEED("the grouped decode's bfloat16 routes are not compiled for this target (no AVX512-BF16)");
#endif
}

TEST_CASE("AMX grouped decode on the CPU's tiles, where they run: the emulation's outputs", "[amx][decode]") {
#if defined(MEMATTN_GROUP_BF16)
    if (!detail::AmxGroupTiles<detail::AmxHardware>::runs()) {
        SUCCEED("no AMX tiles here (" << describe(cpu_features()) << "): the emulated tests stand for them");
        return;
    }
    Index differences = 0;
    for (const auto& [d, dv] : {std::pair<Index, Index>{31, 40}, {128, 128}, {256, 64}})
        for (const Index n : {1, 37, 300})
            for (const Index g : {1, 4, 16}) {
                INFO("d = " << d << ", dv = " << dv << ", n = " << n << ", g = " << g);
                const Matrix<float> Q = random_matrix<float>(g, d, 91);
                const auto [keys, Kd] = amx_stored<Eigen::bfloat16>(random_matrix<float>(n, d, 92));
                const auto [values, Vd] = amx_stored<Fp8E4M3>(random_matrix<float>(n, dv, 93));
                const Matrix<float> hw = amx_group_decode<detail::AmxHardware>(Q, keys, values, n, n / 2, {});
                const Matrix<float> em = amx_group_decode<detail::AmxEmulated>(Q, keys, values, n, n / 2, {});
                // The two add a logit's products in different orders, so a logit may differ
                // in its last bits, and where a weight's rounding to bfloat16 then goes the
                // other way, the weight differs by one bfloat16 ulp (< 2^-7 of it, no more
                // than twice the rounding's own bound). With the largest weight exactly 1,
                // an output moves by less than 2^-7/(1 − 2^-7) of the values' range then:
                // 1.4e-5 was seen on a Xeon at d = 256, where every other case of the
                // loop differed by 5e-8 at most.
                const double flip = std::ldexp(1.0, -7) / (1 - std::ldexp(1.0, -7));
                CHECK((hw - em).cwiseAbs().maxCoeff() <= flip * (Vd.maxCoeff() - Vd.minCoeff()) + 1e-6);
                differences += (hw.array() != em.array()).count();
            }
    if (differences > 0)
        WARN(differences << " outputs differ from the emulation's in their last bits: the hardware adds in another "
                            "order than the SDM's pseudo-code");
#else
    SUCCEED("the grouped decode's bfloat16 routes are not compiled for this target (no AVX512-BF16)");
#endif
}
