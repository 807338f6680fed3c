#include "support.hpp"

#include <memattn/memattn.hpp>
#include <memattn/persistence/snapshot.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

using namespace memattn;
using memattn::test::random_matrix;

namespace {

std::string saved(const auto& memory) {
    std::ostringstream out(std::ios::binary);
    save(memory, out);
    return out.str();
}

template <class M>
void load_from(M& memory, const std::string& bytes) {
    std::istringstream in(bytes, std::ios::binary);
    load(memory, in);
}

/// Rewrites the checksum after an edit, so that the edit reaches the checks behind it.
std::string with_crc(std::string bytes) {
    const std::uint32_t crc = detail::Crc32c::update(0, bytes.data(), bytes.size() - 4);
    detail::little_endian(crc, reinterpret_cast<unsigned char*>(bytes.data() + bytes.size() - 4));
    return bytes;
}

/// Where the payload starts: magic, version, kind (u32 + bytes), two type bytes, reserved, size.
std::size_t payload_offset(const std::string& bytes) {
    const auto kind = detail::from_little_endian<std::uint32_t>(reinterpret_cast<const unsigned char*>(bytes.data() + 12));
    return 16 + kind + 12;
}

std::string load_error(auto& memory, const std::string& bytes) {
    try {
        load_from(memory, bytes);
    } catch (const SnapshotError& e) {
        return e.what();
    }
    return "(no error)";
}

constexpr Index d = 6, dv = 5, window = 7, sinks = 2;

/// Runs check(name, make) with a factory of every memory of the library, small, with
/// options that reach every branch of its state.
template <class T, class Check>
void for_each_memory(Check&& check) {
    check("KVCache", [] { return KVCache<T>(d, dv); });
    check("SlidingWindowCache", [] { return SlidingWindowCache<T>(d, dv, window, sinks); });
    check("SlidingWindowCache without sinks", [] { return SlidingWindowCache<T>(d, dv, window, 0, T(0.3)); });
    check("HybridCache<MeanPool>", [] { return HybridCache<T>(d, dv, window, 3, 4); });
    check("HybridCache<MaxPool>", [] { return HybridCache<T, MaxPool>(d, dv, window, 2, 3); });
    check("HybridCache<WeightedPool>",
          [] { return HybridCache<T, WeightedPool>(d, dv, window, 3, 4, T(0), WeightedPool({0.5, 0.3, 0.2})); });
    check("MovingAverageCache window", [] { return MovingAverageCache<T>(d, dv, window); });
    check("MovingAverageCache cumulative", [] { return MovingAverageCache<T>(d, dv, 0); });
    check("MovingAverageCache exponential", [] { return MovingAverageCache<T>::exponential(d, dv, T(0.25)); });
    check("LinearAttentionMemory", [] { return LinearAttentionMemory<T>(d, dv); });
    check("LinearAttentionMemory decay", [] {
        return LinearAttentionMemory<T, Relu>(d, dv, Relu{}, LinearOptions{.chunk_size = 5, .decay = 0.9});
    });
    check("LinearAttentionMemory FavorPlus", [] { return LinearAttentionMemory<T, FavorPlus>(d, dv, FavorPlus(d, 9, 7)); });
    check("MultiHead<SlidingWindowCache>", [] {
        return MultiHead<SlidingWindowCache<T>>({.q_heads = 4, .kv_heads = 2, .head_dim = d, .value_dim = dv},
                                                [](Index) { return SlidingWindowCache<T>(d, dv, window, 1); });
    });
    check("MultiHead<KVCache>", [] {
        return MultiHead<KVCache<T>>({.q_heads = 2, .kv_heads = 2, .head_dim = d, .value_dim = dv},
                                     [](Index) { return KVCache<T>(d, dv); });
    });
}

template <class M>
Index query_width(const M& m) {
    if constexpr (detail::KnowsQueryDims<M>)
        return m.query_dim();
    else
        return m.key_dim();
}
template <class M>
Index output_width(const M& m) {
    if constexpr (detail::KnowsQueryDims<M>)
        return m.output_dim();
    else
        return m.value_dim();
}

}  // namespace

TEST_CASE("CRC-32C: the standard check value, and the fast path equals the bitwise one", "[snapshot][crc]") {
    const std::string check = "123456789";
    CHECK(detail::Crc32c::update(0, check.data(), check.size()) == 0xE3069283u);
    CHECK(detail::Crc32c::bitwise(0, check.data(), check.size()) == 0xE3069283u);
    CHECK(detail::Crc32c::update(0, nullptr, 0) == 0u);
    std::mt19937_64 gen(5);
    std::vector<unsigned char> bytes(300);
    for (auto& b : bytes) b = static_cast<unsigned char>(gen());
    for (std::size_t n = 0; n < bytes.size(); n += 7)
        for (std::size_t split = 0; split <= n; split += 5) {  // piece by piece equals whole
            const std::uint32_t whole = detail::Crc32c::bitwise(0, bytes.data() + 1, n);
            const std::uint32_t first = detail::Crc32c::update(0, bytes.data() + 1, split);
            REQUIRE(detail::Crc32c::update(first, bytes.data() + 1 + split, n - split) == whole);
        }
}

TEMPLATE_TEST_CASE("Snapshots: resume is bitwise the uninterrupted run, for every memory", "[snapshot]", float,
                   double) {
    using T = TestType;
    constexpr Index after = 12;  // tokens decoded after the resume point
    for_each_memory<T>([&](const char* name, auto make) {
        for (const Index t : {Index(0), Index(1), window - 1, window, window + 1, Index(10000)}) {
            INFO(name << ", saved at token " << t);
            auto uninterrupted = make();
            const Index q = query_width(uninterrupted), o = output_width(uninterrupted);
            const Matrix<T> K = random_matrix<T>(t + after, uninterrupted.key_dim(), 11);
            const Matrix<T> V = random_matrix<T>(t + after, uninterrupted.value_dim(), 12);
            const Matrix<T> Q = random_matrix<T>(after, q, 13);
            Matrix<T> expected(after, o), resumed_out(after, o);
            memattn::extend(uninterrupted, K.topRows(t), V.topRows(t));
            const std::string bytes = saved(uninterrupted);
            decode(uninterrupted, Q, K.bottomRows(after), V.bottomRows(after), expected);

            auto resumed = make();  // fresh, then loaded
            load_from(resumed, bytes);
            REQUIRE(resumed.length() == t);
            CHECK(saved(resumed) == bytes);  // the format is canonical: load then save gives the same bytes
            decode(resumed, Q, K.bottomRows(after), V.bottomRows(after), resumed_out);
            REQUIRE(resumed.length() == t + after);
            CHECK(resumed_out.cwiseEqual(expected).all());
            CHECK(resumed.footprint() == uninterrupted.footprint());

            // Loading over a memory that has seen other tokens replaces its state too.
            auto busy = make();
            memattn::extend(busy, K.bottomRows(3), V.bottomRows(3));
            load_from(busy, bytes);
            Matrix<T> busy_out(after, o);
            decode(busy, Q, K.bottomRows(after), V.bottomRows(after), busy_out);
            CHECK(busy_out.cwiseEqual(expected).all());
        }
    });
}

TEST_CASE("Snapshots: through a file, and two snapshots back to back in one stream", "[snapshot]") {
    KVCache<float> a(4, 3);
    SlidingWindowCache<double> b(4, 3, 5, 1);
    memattn::extend(a, random_matrix<float>(9, 4, 1), random_matrix<float>(9, 3, 2));
    memattn::extend(b, random_matrix<double>(11, 4, 3), random_matrix<double>(11, 3, 4));
    const auto path = std::filesystem::temp_directory_path() / "memattn_snapshot_test.bin";
    {
        std::ofstream out(path, std::ios::binary);
        save(a, out);
        save(b, out);
    }
    KVCache<float> a2(4, 3);
    SlidingWindowCache<double> b2(4, 3, 5, 1);
    {
        std::ifstream in(path, std::ios::binary);
        load(a2, in);
        load(b2, in);
        CHECK(in.peek() == std::char_traits<char>::eof());
    }
    std::filesystem::remove(path);
    CHECK(saved(a2) == saved(a));
    CHECK(saved(b2) == saved(b));
    CHECK(a2.keys().cwiseEqual(a.keys()).all());
}

TEMPLATE_TEST_CASE("Snapshots: every flipped byte and every truncation is rejected, the memory unchanged",
                   "[snapshot]", float, double) {
    using T = TestType;
    for_each_memory<T>([&](const char* name, auto make) {
        INFO(name);
        auto source = make();
        memattn::extend(source, random_matrix<T>(9, source.key_dim(), 1), random_matrix<T>(9, source.value_dim(), 2));
        const std::string bytes = saved(source);
        auto target = make();
        memattn::extend(target, random_matrix<T>(4, target.key_dim(), 3), random_matrix<T>(4, target.value_dim(), 4));
        const std::string before = saved(target);
        for (std::size_t i = 0; i < bytes.size(); ++i) {
            for (const unsigned char flip : {0x01, 0x80, 0xFF}) {
                std::string corrupted = bytes;
                corrupted[i] = static_cast<char>(static_cast<unsigned char>(corrupted[i]) ^ flip);
                INFO("byte " << i << " of " << bytes.size() << " xor " << int(flip));
                REQUIRE_THROWS_AS(load_from(target, corrupted), SnapshotError);
                REQUIRE(target.length() == 4);
            }
        }
        for (std::size_t n = 0; n < bytes.size(); ++n) {
            INFO("truncated to " << n << " of " << bytes.size() << " bytes");
            REQUIRE_THROWS_AS(load_from(target, bytes.substr(0, n)), SnapshotError);
        }
        CHECK(saved(target) == before);
        load_from(target, bytes);
        CHECK(saved(target) == bytes);
    });
}

TEST_CASE("Snapshots: a stream of another kind, scalar, dimension, option or version says so", "[snapshot]") {
    KVCache<float> cache(4, 3);
    memattn::extend(cache, random_matrix<float>(5, 4, 1), random_matrix<float>(5, 3, 2));
    const std::string bytes = saved(cache);

    SlidingWindowCache<float> window(4, 3, 8);
    CHECK_THAT(load_error(window, bytes),
               Catch::Matchers::Contains("the stream holds a KVCache, the memory is a SlidingWindowCache"));
    KVCache<double> wide(4, 3);
    CHECK_THAT(load_error(wide, bytes),
               Catch::Matchers::Contains("the scalar is float32 in the stream, float64 in the memory"));
    KVCache<float> other_dim(8, 3);
    CHECK_THAT(load_error(other_dim, bytes), Catch::Matchers::Contains("KVCache: key_dim is 4 in the stream, 8 in the memory"));
    KVCache<float> other_scale(4, 3, 0.25f);
    CHECK_THAT(load_error(other_scale, bytes), Catch::Matchers::Contains("scale is 0.5 in the stream, 0.25 in the memory"));
    CHECK(other_scale.length() == 0);

    SlidingWindowCache<float> w8(4, 3, 8, 1), w9(4, 3, 9, 1), s2(4, 3, 8, 2);
    const std::string w8_bytes = saved(w8);
    CHECK_THAT(load_error(w9, w8_bytes), Catch::Matchers::Contains("window is 8 in the stream, 9 in the memory"));
    CHECK_THAT(load_error(s2, w8_bytes), Catch::Matchers::Contains("sinks is 1 in the stream, 2 in the memory"));

    HybridCache<float, WeightedPool> h1(4, 3, 4, 2, 2, 0.f, WeightedPool({0.5, 0.5})),
        h2(4, 3, 4, 2, 2, 0.f, WeightedPool({0.25, 0.75}));
    CHECK_THAT(load_error(h2, saved(h1)), Catch::Matchers::Contains("a compressor weight is 0.5"));
    HybridCache<float, MaxPool> max_pool(4, 3, 4, 2, 2);
    CHECK_THAT(load_error(max_pool, saved(HybridCache<float>(4, 3, 4, 2, 2))),
               Catch::Matchers::Contains("the stream holds a HybridCache/MeanPool, the memory is a HybridCache/MaxPool"));

    LinearAttentionMemory<float, FavorPlus> f1(4, 3, FavorPlus(4, 6, 1)), f2(4, 3, FavorPlus(4, 6, 2));
    CHECK_THAT(load_error(f2, saved(f1)), Catch::Matchers::Contains("the feature map's projection"));
    LinearAttentionMemory<float> decayed(4, 3, EluPlusOne{}, {.decay = 0.5});
    CHECK_THAT(load_error(decayed, saved(LinearAttentionMemory<float>(4, 3))),
               Catch::Matchers::Contains("decay is 1 in the stream, 0.5 in the memory"));

    MultiHead<KVCache<float>> two({.q_heads = 2, .kv_heads = 2, .head_dim = 4, .value_dim = 3},
                                  [](Index) { return KVCache<float>(4, 3); });
    MultiHead<KVCache<float>> one({.q_heads = 2, .kv_heads = 1, .head_dim = 4, .value_dim = 3},
                                  [](Index) { return KVCache<float>(4, 3); });
    CHECK_THAT(load_error(one, saved(two)), Catch::Matchers::Contains("kv_heads is 2 in the stream, 1 in the memory"));

    std::string future = bytes;
    future[8] = 2;
    CHECK_THAT(load_error(cache, with_crc(future)), Catch::Matchers::Contains("format version 2 is newer"));
    CHECK_THAT(load_error(cache, future), Catch::Matchers::Contains("format version 2 is newer"));  // before the checksum
    CHECK_THAT(load_error(cache, "not a snapshot at all"), Catch::Matchers::Contains("not a memattn snapshot"));
    CHECK_THAT(load_error(cache, ""), Catch::Matchers::Contains("truncated"));
    std::string flipped = bytes;
    flipped[bytes.size() / 2] ^= 0x10;
    CHECK_THAT(load_error(cache, flipped), Catch::Matchers::Contains("checksum mismatch"));

    // A payload whose fields disagree with its size, behind a valid checksum.
    std::string longer = bytes;
    const std::size_t length_at = payload_offset(bytes) + 8 + 8 + 4;  // after key_dim, value_dim, scale (a float)
    longer[length_at] = static_cast<char>(6);                          // length 5 -> 6, little-endian
    CHECK_THAT(load_error(cache, with_crc(longer)), Catch::Matchers::Contains("length is 6, expected 0 .. 5"));
    CHECK(cache.length() == 5);
}

TEST_CASE("Snapshots: save reports a failing stream; a user's memory models the concept", "[snapshot]") {
    std::ostringstream bad;
    bad.setstate(std::ios::badbit);
    CHECK_THROWS_AS(save(KVCache<float>(2, 2), bad), SnapshotError);

    struct LastValue {
        using Scalar = float;
        Vector<float> v_ = Vector<float>::Zero(4);
        Index n_ = 0;
        void update(ConstRowRef<float>, ConstRowRef<float> v) {
            v_ = v;
            ++n_;
        }
        void attend(ConstRowRef<float>, RowRef<float> out) const { out = v_; }
        Index length() const { return n_; }
        std::size_t footprint() const { return sizeof(float) * 4; }
        void reset() {
            v_.setZero();
            n_ = 0;
        }
        static std::string snapshot_kind() { return "LastValue"; }
        void write_snapshot(snapshot::Writer& w) const {
            w.index(n_);
            w.matrix(v_);
        }
        void read_snapshot(snapshot::Reader& r) {
            const Index n = r.count("length", 0, std::numeric_limits<Index>::max());
            r.expect_remaining(sizeof(float) * 4, "the value");
            r.matrix(v_, "the value");
            n_ = n;
        }
    };
    static_assert(Snapshottable<LastValue>);
    LastValue a, b;
    a.update(Vector<float>::Zero(4), Vector<float>::LinSpaced(4, 1, 4));
    load_from(b, saved(a));
    CHECK(b.n_ == 1);
    CHECK(b.v_ == a.v_);
}

namespace {

/// The bytes of a buffer as a string, to compare with a stream's.
std::string span_text(std::span<const std::byte> bytes) {
    return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

/// A string's bytes in a buffer of exactly their size (so ASan sees a read past its end).
std::vector<std::byte> span_bytes(const std::string& text) {
    std::vector<std::byte> bytes(text.size());
    if (!text.empty())  // an empty vector's data() may be null
        std::memcpy(bytes.data(), text.data(), text.size());
    return bytes;
}

/// What the trailing column of a key row holds: nothing, β (DeltaRuleMemory) or a log-gate
/// (GatedLinearAttentionMemory with a scalar gate).
enum class SpanExtra { none, beta, log_gate };

/// Random keys a memory accepts: the extra column in range.
template <class T>
Matrix<T> span_keys(Index rows, Index key_dim, std::uint64_t seed, SpanExtra extra) {
    Matrix<T> K = random_matrix<T>(rows, key_dim, seed);
    if (rows > 0 && extra == SpanExtra::beta)
        K.col(key_dim - 1) = K.col(key_dim - 1).cwiseAbs();
    if (rows > 0 && extra == SpanExtra::log_gate)
        K.col(key_dim - 1) = -K.col(key_dim - 1).cwiseAbs();
    return K;
}

/// Every memory of for_each_memory, and the compact storages, the gated and delta-rule
/// memories and a MultiHead over a compact cache.
template <class T, class Check>
void for_each_span_memory(Check&& check) {
    for_each_memory<T>([&](const char* name, auto make) { check(name, make, SpanExtra::none); });
    check("KVCache<T, bfloat16>", [] { return KVCache<T, Eigen::bfloat16>(d, dv); }, SpanExtra::none);
    check("SlidingWindowCache<T, half>", [] { return SlidingWindowCache<T, Eigen::half>(d, dv, window, sinks); },
          SpanExtra::none);
    check("HybridCache<T, MeanPool, Q8>", [] { return HybridCache<T, MeanPool, Q8>(d, dv, window, 3, 4); },
          SpanExtra::none);
    check("GatedLinearAttentionMemory", [] { return GatedLinearAttentionMemory<T>(d, dv); }, SpanExtra::log_gate);
    check("DeltaRuleMemory", [] { return DeltaRuleMemory<T>(d, dv); }, SpanExtra::beta);
    check("SlidingWindowCache<T, Q4Affine>", [] { return SlidingWindowCache<T, Q4Affine>(d, dv, window, 2); },
          SpanExtra::none);
    check("KVCache<T, Q4>", [] { return KVCache<T, Q4>(d, dv); }, SpanExtra::none);
    check("MultiHead<KVCache<T, Q8>>", [] {
        return MultiHead<KVCache<T, Q8>>({.q_heads = 4, .kv_heads = 2, .head_dim = d, .value_dim = dv},
                                         [](Index) { return KVCache<T, Q8>(d, dv); });
    }, SpanExtra::none);
}

}  // namespace

TEMPLATE_TEST_CASE("Snapshots in a buffer: the stream's bytes exactly, sized by snapshot_size, and resume bitwise",
                   "[snapshot][span]", float, double) {
    using T = TestType;
    constexpr Index after = 9;
    for_each_span_memory<T>([&](const char* name, auto make, SpanExtra extra) {
        for (const Index t : {Index(0), Index(1), window + 3}) {
            INFO(name << ", saved at token " << t);
            auto uninterrupted = make();
            const Index q = query_width(uninterrupted), o = output_width(uninterrupted);
            const Matrix<T> K = span_keys<T>(t + after, uninterrupted.key_dim(), 21, extra);
            const Matrix<T> V = random_matrix<T>(t + after, uninterrupted.value_dim(), 22);
            const Matrix<T> Q = random_matrix<T>(after, q, 23);
            memattn::extend(uninterrupted, K.topRows(t), V.topRows(t));
            const std::string bytes = saved(uninterrupted);
            const std::size_t size = snapshot_size(uninterrupted);
            CHECK(size == bytes.size());

            std::vector<std::byte> buffer(size + 5, std::byte{0xA5});
            REQUIRE(save(uninterrupted, std::span(buffer)) == size);
            CHECK(span_text(std::span(buffer).first(size)) == bytes);  // byte for byte the stream snapshot
            for (std::size_t i = size; i < buffer.size(); ++i)
                CHECK(buffer[i] == std::byte{0xA5});  // nothing written past the snapshot

            auto resumed = make();  // busy with other tokens, then loaded
            memattn::extend(resumed, K.bottomRows(2), V.bottomRows(2));
            REQUIRE(load(resumed, std::span<const std::byte>(buffer)) == size);  // the trailing bytes are not read
            REQUIRE(resumed.length() == t);
            CHECK(saved(resumed) == bytes);

            Matrix<T> expected(after, o), resumed_out(after, o);
            decode(uninterrupted, Q, K.bottomRows(after), V.bottomRows(after), expected);
            decode(resumed, Q, K.bottomRows(after), V.bottomRows(after), resumed_out);
            CHECK(resumed_out.cwiseEqual(expected).all());
            CHECK(saved(resumed) == saved(uninterrupted));
        }
    });
}

TEST_CASE("Snapshots in a buffer: snapshot_size is the format's size, for a user's memory too", "[snapshot][span]") {
    // docs/snapshot-format.md: 28 + n header bytes (n = 7 for "KVCache"), the payload
    // (key_dim, value_dim, a float scale, length, then the pairs), 4 checksum bytes.
    for (const Index n : {0, 1, 13}) {
        KVCache<float> cache(4, 3);
        cache.reserve(64);  // the capacity is not part of the snapshot
        memattn::extend(cache, random_matrix<float>(n, 4, 1), random_matrix<float>(n, 3, 2));
        const std::size_t payload = 8 + 8 + 4 + 8 + static_cast<std::size_t>(n) * (4 + 3) * sizeof(float);
        CHECK(snapshot_size(cache) == 28 + 7 + payload + 4);
    }

    struct Counter {
        using Scalar = double;
        Index n_ = 0;
        double sum_ = 0;
        void update(ConstRowRef<double>, ConstRowRef<double> v) {
            sum_ += v(0);
            ++n_;
        }
        void attend(ConstRowRef<double>, RowRef<double> out) const { out.setConstant(sum_); }
        Index length() const { return n_; }
        std::size_t footprint() const { return sizeof(double); }
        void reset() { n_ = 0, sum_ = 0; }
        static std::string snapshot_kind() { return "Counter"; }
        void write_snapshot(snapshot::Writer& w) const {
            w.index(n_);
            w.number(sum_);
        }
        void read_snapshot(snapshot::Reader& r) {
            const Index n = r.count("length", 0, std::numeric_limits<Index>::max());
            r.expect_remaining(sizeof(double), "the sum");
            sum_ = r.number<double>("the sum");
            n_ = n;
        }
    };
    static_assert(Snapshottable<Counter>);
    Counter a, b;
    a.update(Vector<double>::Zero(1), Vector<double>::Constant(1, 2.5));
    CHECK(snapshot_size(a) == 28 + 7 + 16 + 4);
    std::vector<std::byte> buffer(snapshot_size(a));
    CHECK(save(a, std::span(buffer)) == buffer.size());
    CHECK(span_text(buffer) == saved(a));
    CHECK(load(b, std::span<const std::byte>(buffer)) == buffer.size());
    CHECK(b.n_ == 1);
    CHECK(b.sum_ == 2.5);

    struct LongName : Counter {
        static std::string snapshot_kind() { return std::string(256, 'x'); }
    };
    CHECK_THROWS_AS(snapshot_size(LongName{}), std::invalid_argument);
    CHECK_THROWS_WITH(snapshot_size(LongName{}),
                      Catch::Matchers::StartsWith("memattn::snapshot_size: argument 'memory.snapshot_kind()' has 256 bytes"));
    CHECK_THROWS_WITH(save(LongName{}, std::span(buffer)),
                      Catch::Matchers::StartsWith("memattn::save: argument 'memory.snapshot_kind()' has 256 bytes"));
}

TEST_CASE("Snapshots in a buffer: a memory that writes more than it counted stops at the snapshot's end",
          "[snapshot][span]") {
    struct Growing {  // writes one more number each time it is asked to
        using Scalar = float;
        mutable Index writes_ = 0;
        void update(ConstRowRef<float>, ConstRowRef<float>) {}
        void attend(ConstRowRef<float>, RowRef<float> out) const { out.setZero(); }
        Index length() const { return 0; }
        std::size_t footprint() const { return 0; }
        void reset() {}
        static std::string snapshot_kind() { return "Growing"; }
        void write_snapshot(snapshot::Writer& w) const {
            ++writes_;
            for (Index i = 0; i < writes_; ++i)
                w.index(i);
        }
        void read_snapshot(snapshot::Reader&) {}
    };
    static_assert(Snapshottable<Growing>);
    Growing g;
    std::vector<std::byte> buffer(200, std::byte{0x33});
    CHECK_THROWS_WITH(save(g, std::span(buffer)), Catch::Matchers::Contains("outgrows its buffer of"));
    const std::size_t counted = 28 + 7 + 8 + 4;  // the first (counting) pass wrote one index
    for (std::size_t i = counted; i < buffer.size(); ++i)
        REQUIRE(buffer[i] == std::byte{0x33});  // nothing past the size it was given
    std::ostringstream out(std::ios::binary);
    CHECK_THROWS_WITH(save(g, out), Catch::Matchers::Contains("payload bytes after counting"));
}

TEST_CASE("Snapshots in a buffer: one too small throws before a byte is written", "[snapshot][span]") {
    MultiHead<SlidingWindowCache<float>> layer({.q_heads = 2, .kv_heads = 2, .head_dim = 4, .value_dim = 3},
                                               [](Index) { return SlidingWindowCache<float>(4, 3, 5, 1); });
    memattn::extend(layer, random_matrix<float>(7, 8, 1), random_matrix<float>(7, 6, 2));
    const std::string before = saved(layer);
    const std::size_t size = snapshot_size(layer);
    REQUIRE(size == before.size());
    for (const std::size_t given : {std::size_t(0), std::size_t(1), size / 2, size - 1}) {
        INFO("a buffer of " << given << " bytes for " << size);
        std::vector<std::byte> buffer(given, std::byte{0x5A});
        CHECK_THROWS_AS(save(layer, std::span(buffer)), std::invalid_argument);
        CHECK_THROWS_WITH(save(layer, std::span(buffer)),
                          Catch::Matchers::StartsWith("memattn::save: argument 'out' has " + std::to_string(given) +
                                                      " bytes") &&
                              Catch::Matchers::Contains("needs " + std::to_string(size)));
        for (const std::byte b : buffer)
            REQUIRE(b == std::byte{0x5A});
        CHECK(saved(layer) == before);
    }
    std::vector<std::byte> exact(size);
    CHECK(save(layer, std::span(exact)) == size);
    CHECK(span_text(exact) == before);
}

TEST_CASE("Snapshots in a buffer: every truncation and flipped byte is rejected, the memory unchanged",
          "[snapshot][span]") {
    for_each_memory<float>([&](const char* name, auto make) {
        INFO(name);
        auto source = make();
        memattn::extend(source, random_matrix<float>(5, source.key_dim(), 1),
                        random_matrix<float>(5, source.value_dim(), 2));
        const std::string bytes = saved(source);
        auto target = make();
        memattn::extend(target, random_matrix<float>(3, target.key_dim(), 3),
                        random_matrix<float>(3, target.value_dim(), 4));
        const std::string before = saved(target);
        for (std::size_t n = 0; n < bytes.size(); ++n) {
            INFO("truncated to " << n << " of " << bytes.size() << " bytes");
            const std::vector<std::byte> prefix = span_bytes(bytes.substr(0, n));
            REQUIRE_THROWS_AS(load(target, std::span<const std::byte>(prefix)), SnapshotError);
            REQUIRE_THROWS_WITH(load(target, std::span<const std::byte>(prefix)),
                                Catch::Matchers::Contains("the buffer ends " + std::to_string(n) +
                                                          " bytes into the snapshot") &&
                                    Catch::Matchers::Contains("(truncated)"));
            REQUIRE(target.length() == 3);
        }
        for (std::size_t i = 0; i < bytes.size(); ++i) {
            INFO("byte " << i << " of " << bytes.size() << " flipped");
            std::string corrupted = bytes;
            corrupted[i] = static_cast<char>(static_cast<unsigned char>(corrupted[i]) ^ 0x01);
            const std::vector<std::byte> buffer = span_bytes(corrupted);
            REQUIRE_THROWS_AS(load(target, std::span<const std::byte>(buffer)), SnapshotError);
            REQUIRE(target.length() == 3);
        }
        CHECK(saved(target) == before);
    });

    // A payload size the header cannot mean: past the end of the buffer, and past any.
    KVCache<float> cache(4, 3);
    memattn::extend(cache, random_matrix<float>(2, 4, 1), random_matrix<float>(2, 3, 2));
    const std::string bytes = saved(cache);
    const std::string before = bytes;
    for (const std::uint64_t forged : {std::uint64_t(1) << 40, std::numeric_limits<std::uint64_t>::max() - 20}) {
        std::string edited = bytes;
        detail::little_endian(forged, reinterpret_cast<unsigned char*>(edited.data() + payload_offset(bytes) - 8));
        const std::vector<std::byte> buffer = span_bytes(edited);
        CHECK_THROWS_AS(load(cache, std::span<const std::byte>(buffer)), SnapshotError);
        CHECK_THROWS_AS(load_from(cache, edited), SnapshotError);
        CHECK(saved(cache) == before);
    }
}

TEST_CASE("Snapshots in a buffer: back to back, loaded one after the other by the returned sizes",
          "[snapshot][span]") {
    KVCache<float> a(4, 3);
    SlidingWindowCache<double, Eigen::bfloat16> b(4, 3, 5, 1);
    MultiHead<LinearAttentionMemory<float>> c({.q_heads = 2, .kv_heads = 1, .head_dim = 4, .value_dim = 3},
                                              [](Index) { return LinearAttentionMemory<float>(4, 3); });
    memattn::extend(a, random_matrix<float>(9, 4, 1), random_matrix<float>(9, 3, 2));
    memattn::extend(b, random_matrix<double>(11, 4, 3), random_matrix<double>(11, 3, 4));
    memattn::extend(c, random_matrix<float>(6, 4, 5), random_matrix<float>(6, 3, 6));
    const std::string stream = saved(a) + saved(b) + saved(c);

    std::vector<std::byte> buffer(snapshot_size(a) + snapshot_size(b) + snapshot_size(c));
    std::size_t at = 0;
    at += save(a, std::span(buffer).subspan(at));
    at += save(b, std::span(buffer).subspan(at));
    at += save(c, std::span(buffer).subspan(at));
    CHECK(at == buffer.size());
    CHECK(span_text(buffer) == stream);  // the three saved to one stream

    KVCache<float> a2(4, 3);
    SlidingWindowCache<double, Eigen::bfloat16> b2(4, 3, 5, 1);
    MultiHead<LinearAttentionMemory<float>> c2({.q_heads = 2, .kv_heads = 1, .head_dim = 4, .value_dim = 3},
                                               [](Index) { return LinearAttentionMemory<float>(4, 3); });
    const std::span<const std::byte> in(buffer);
    at = 0;
    at += load(a2, in.subspan(at));
    CHECK(at == snapshot_size(a));
    at += load(b2, in.subspan(at));
    at += load(c2, in.subspan(at));
    CHECK(at == buffer.size());
    CHECK(saved(a2) == saved(a));
    CHECK(saved(b2) == saved(b));
    CHECK(saved(c2) == saved(c));
    // The second snapshot alone is not the first's kind.
    CHECK_THROWS_WITH(load(a2, in.subspan(snapshot_size(a))),
                      Catch::Matchers::Contains("holds a SlidingWindowCache, the memory is a KVCache"));
    CHECK(saved(a2) == saved(a));

    // A buffer's snapshots read from a stream, one after the other, as well.
    KVCache<float> a3(4, 3);
    SlidingWindowCache<double, Eigen::bfloat16> b3(4, 3, 5, 1);
    std::istringstream from(span_text(buffer), std::ios::binary);
    load(a3, from);
    load(b3, from);
    CHECK(saved(a3) == saved(a));
    CHECK(saved(b3) == saved(b));
}

TEMPLATE_TEST_CASE("Rollback: truncate(n) equals a cache that only saw n tokens", "[snapshot][truncate]", float,
                   double) {
    using T = TestType;
    const Matrix<T> K = random_matrix<T>(20, d, 1), V = random_matrix<T>(20, dv, 2);
    SECTION("KVCache") {
        for (const Index n : {0, 1, 6, 13}) {
            KVCache<T> cache(d, dv), shorter(d, dv);
            memattn::extend(cache, K.topRows(13), V.topRows(13));
            memattn::extend(shorter, K.topRows(n), V.topRows(n));
            cache.truncate(n);
            CHECK(saved(cache) == saved(shorter));
        }
    }
    SECTION("SlidingWindowCache: any n before the window overwrites a pair, none after") {
        const Index full = window + sinks;  // the last length at which nothing was overwritten
        for (const Index length : {full - 1, full}) {
            for (Index n = 0; n <= length; ++n) {
                SlidingWindowCache<T> cache(d, dv, window, sinks), shorter(d, dv, window, sinks);
                memattn::extend(cache, K.topRows(length), V.topRows(length));
                memattn::extend(shorter, K.topRows(n), V.topRows(n));
                cache.truncate(n);
                CHECK(cache.length() == n);
                CHECK(saved(cache) == saved(shorter));
                // and it continues as the shorter one does
                Matrix<T> a(3, dv), b(3, dv);
                decode(cache, K.bottomRows(3), K.bottomRows(3), V.bottomRows(3), a);
                decode(shorter, K.bottomRows(3), K.bottomRows(3), V.bottomRows(3), b);
                CHECK(a.cwiseEqual(b).all());
            }
        }
        SlidingWindowCache<T> cache(d, dv, window, sinks);
        memattn::extend(cache, K.topRows(full + 1), V.topRows(full + 1));
        const std::string before = saved(cache);
        CHECK_THROWS_WITH(cache.truncate(full), Catch::Matchers::Contains("has overwritten the pairs before token"));
        CHECK_THROWS_AS(cache.truncate(full + 2), std::invalid_argument);
        CHECK_THROWS_AS(cache.truncate(-1), std::invalid_argument);
        CHECK(saved(cache) == before);
        cache.truncate(full + 1);  // keeping every token is always possible
        CHECK(saved(cache) == before);
    }
}
