#pragma once
// The byte level of snapshots (docs/snapshot-format.md): the exception load throws,
// the CRC-32C checksum, and the Writer and Reader a memory uses to put its options and
// state into a snapshot's payload and take them back out. A leaf: the memories include
// it to implement write_snapshot/read_snapshot; memattn/persistence/snapshot.hpp (the
// header, save and load) sits above the memories.
//
// Every number is little-endian whatever the machine: integers as two's complement,
// floating-point numbers as their IEEE 754 bits. Matrices are written row by row,
// without their shape (the memory writes the shape it needs first).

#include "memattn/types.hpp"

#include <array>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <istream>
#include <limits>
#include <ostream>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

namespace memattn {

/// What memattn::load throws when a stream cannot be loaded into a memory: not a
/// snapshot, a format version newer than this library reads, truncated, corrupted (the
/// checksum differs), or a snapshot of another kind of memory, scalar, storage,
/// dimensions or options than the target's. The message says which, and the target
/// memory is unchanged. A runtime_error, not an invalid_argument: the fault is in data
/// read at run time, not in the program's arguments. memattn::save throws it when the
/// stream fails.
class SnapshotError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

namespace detail {

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial and final XOR
/// 0xFFFFFFFF; the checksum of iSCSI, ext4 and Btrfs). `crc` is the value returned for
/// the bytes before, 0 for none, so a stream can be checksummed piece by piece. With
/// SSE4.2 the CPU's crc32 instruction does it; otherwise eight tables, eight bytes per step.
class Crc32c {
public:
    [[nodiscard]] static std::uint32_t update(std::uint32_t crc, const void* data, std::size_t size) noexcept {
        const auto* p = static_cast<const unsigned char*>(data);
        std::uint32_t c = ~crc;
#if defined(__SSE4_2__)
        std::uint64_t c64 = c;
        for (; size >= 8; size -= 8, p += 8) {
            std::uint64_t word;
            std::memcpy(&word, p, 8);
            c64 = _mm_crc32_u64(c64, word);
        }
        c = static_cast<std::uint32_t>(c64);
        for (; size > 0; --size, ++p)
            c = _mm_crc32_u8(c, *p);
#else
        const auto& t = tables();
        for (; size >= 8; size -= 8, p += 8) {
            const std::uint32_t lo = c ^ (std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 |
                                          std::uint32_t(p[2]) << 16 | std::uint32_t(p[3]) << 24);
            c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
                t[3][p[4]] ^ t[2][p[5]] ^ t[1][p[6]] ^ t[0][p[7]];
        }
        for (; size > 0; --size, ++p)
            c = t[0][(c ^ *p) & 0xFF] ^ (c >> 8);
#endif
        return ~c;
    }

    /// The same checksum one byte at a time from the polynomial alone: the reference the
    /// tests hold both paths to.
    [[nodiscard]] static std::uint32_t bitwise(std::uint32_t crc, const void* data, std::size_t size) noexcept {
        const auto* p = static_cast<const unsigned char*>(data);
        std::uint32_t c = ~crc;
        for (std::size_t i = 0; i < size; ++i) {
            c ^= p[i];
            for (int bit = 0; bit < 8; ++bit)
                c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        }
        return ~c;
    }

private:
    using Tables = std::array<std::array<std::uint32_t, 256>, 8>;

    static constexpr Tables make_tables() {
        Tables t{};
        for (std::uint32_t i = 0; i < 256; ++i) {
            std::uint32_t c = i;
            for (int bit = 0; bit < 8; ++bit)
                c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
            t[0][i] = c;
        }
        for (std::size_t k = 1; k < 8; ++k)
            for (std::size_t i = 0; i < 256; ++i)
                t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
        return t;
    }

    static const Tables& tables() noexcept {
        static constexpr Tables t = make_tables();
        return t;
    }
};

/// A compressor or feature map that names itself in snapshots with a static
/// `snapshot_name`; a memory built on it can then be saved. Its parameters, if any, are
/// its weights() (compressors) or projection() (FavorPlus), which snapshots hold too.
template <class C>
concept NamedForSnapshots = requires {
    { C::snapshot_name } -> std::convertible_to<std::string_view>;
};

/// The bytes of a number, little-endian.
template <class N>
void little_endian(N value, unsigned char* out) noexcept {
    static_assert(std::is_trivially_copyable_v<N>);
    std::memcpy(out, &value, sizeof(N));
    if constexpr (std::endian::native == std::endian::big)
        for (std::size_t i = 0; i < sizeof(N) / 2; ++i)
            std::swap(out[i], out[sizeof(N) - 1 - i]);
}

template <class N>
N from_little_endian(const unsigned char* in) noexcept {
    static_assert(std::is_trivially_copyable_v<N>);
    unsigned char bytes[sizeof(N)];
    std::memcpy(bytes, in, sizeof(N));
    if constexpr (std::endian::native == std::endian::big)
        for (std::size_t i = 0; i < sizeof(N) / 2; ++i)
            std::swap(bytes[i], bytes[sizeof(N) - 1 - i]);
    N value;
    std::memcpy(&value, bytes, sizeof(N));
    return value;
}

}  // namespace detail

namespace snapshot {

/// How the scalars and the stored keys/values are encoded (the header's two type bytes).
enum class TypeCode : std::uint8_t {
    float32 = 1,
    float64 = 2,
    bfloat16 = 3,
    float16 = 4,
    q8 = 5,
    q4 = 6,
    q4_affine = 7,
    q8_rotated = 8,
    q4_rotated = 9,
    q4_affine_rotated = 10,
    q8_per_channel_keys = 11,
    q4_per_channel_keys = 12,
    q4_affine_per_channel_keys = 13,
};

/// The type code of the scalar T: float32 or float64, or for a memory of 16-bit rows
/// (which computes in float and writes float numbers) bfloat16 or float16.
template <class T>
constexpr TypeCode type_code() {
    static_assert(RowScalar<T>, "memattn::snapshot::type_code: float, double, Eigen::bfloat16 or Eigen::half");
    if constexpr (std::is_same_v<T, Eigen::bfloat16>)
        return TypeCode::bfloat16;
    else if constexpr (std::is_same_v<T, Eigen::half>)
        return TypeCode::float16;
    else
        return std::is_same_v<T, float> ? TypeCode::float32 : TypeCode::float64;
}

/// Writes a snapshot's bytes to a stream or into a caller's buffer, or only counts them
/// (no sink): memattn::save runs a memory's write_snapshot once counting, to size the
/// payload for the header (and memattn::snapshot_size stops there), and once writing.
/// Keeps the CRC-32C of everything it has written. The stream and the buffer are the
/// two sinks of one write path: what a memory's write_snapshot writes is the same bytes
/// in either.
class Writer {
public:
    /// Counts bytes and writes nothing.
    Writer() = default;
    /// Writes to `out` (a stream opened in binary mode).
    explicit Writer(std::ostream& out) : out_(&out) {}
    /// Writes into `out` from its first byte; writing past its end throws SnapshotError
    /// (memattn::save sizes the buffer first, so only a memory that writes more than it
    /// counted reaches that).
    explicit Writer(std::span<std::byte> out)
        : buffer_(reinterpret_cast<unsigned char*>(out.data())), capacity_(out.size()), to_buffer_(true) {}

    /// `size` bytes as they are; throws SnapshotError when the stream fails or the
    /// buffer is full.
    void bytes(const void* data, std::size_t size) {
        if (size == 0 || counting()) {
            size_ += size;
            return;
        }
        if (to_buffer_) {
            if (size > capacity_ - size_)
                throw SnapshotError("memattn::save: the snapshot outgrows its buffer of " + std::to_string(capacity_) +
                                    " bytes after " + std::to_string(size_) +
                                    " (the memory wrote more than it counted)");
            std::memcpy(buffer_ + size_, data, size);
        }
        size_ += size;
        crc_ = detail::Crc32c::update(crc_, data, size);
        if (out_ != nullptr) {
            out_->write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
            if (!*out_)
                throw SnapshotError("memattn::save: the stream failed after " + std::to_string(size_) + " bytes");
        }
    }

    /// One number: an integer of any width or a float/double, little-endian.
    template <class N>
        requires std::is_arithmetic_v<N>
    void number(N value) {
        unsigned char b[sizeof(N)];
        detail::little_endian(value, b);
        bytes(b, sizeof(N));
    }

    /// A count, size or dimension: a signed 64-bit integer.
    void index(Index value) { number(static_cast<std::int64_t>(value)); }
    /// A bool as one byte, 0 or 1.
    void flag(bool value) { number(static_cast<std::uint8_t>(value ? 1 : 0)); }
    /// A string: its byte count (u32), then its bytes.
    void text(std::string_view s) {
        number(static_cast<std::uint32_t>(s.size()));
        bytes(s.data(), s.size());
    }

    /// The coefficients of a matrix (any Eigen block with contiguous rows), row by row.
    template <class D>
    void matrix(const Eigen::DenseBase<D>& m) {
        using S = typename D::Scalar;
        static_assert(std::is_arithmetic_v<S>, "snapshot::Writer::matrix: numbers only");
        const auto& e = m.derived();
        for (Index r = 0; r < e.rows(); ++r) {
            if constexpr (std::endian::native == std::endian::little && bool(D::IsRowMajor) &&
                          int(Eigen::internal::traits<D>::Flags & Eigen::DirectAccessBit) != 0) {
                if (e.innerStride() == 1) {
                    bytes(e.data() + r * e.outerStride(), sizeof(S) * static_cast<std::size_t>(e.cols()));
                    continue;
                }
            }
            for (Index c = 0; c < e.cols(); ++c)
                number(static_cast<S>(e.coeff(r, c)));
        }
    }

    /// Runs f(writer) for a nested part, after its byte count (u64): a reader can hand
    /// the part to another reader (Reader::part), e.g. one per head of a layer.
    template <class F>
    void part(F&& f) {
        Writer counter;
        f(counter);
        number(static_cast<std::uint64_t>(counter.size()));
        if (counting()) {  // one pass is enough to count
            size_ += counter.size();
            return;
        }
        const std::uint64_t before = size_;
        f(*this);
        if (size_ - before != counter.size())
            throw SnapshotError("memattn::save: a part wrote " + std::to_string(size_ - before) +
                                " bytes after counting " + std::to_string(counter.size()));
    }

    /// Bytes written (or counted) so far.
    [[nodiscard]] std::uint64_t size() const noexcept { return size_; }
    /// CRC-32C of the bytes written so far (0 when counting).
    [[nodiscard]] std::uint32_t crc() const noexcept { return crc_; }
    /// Whether this writer only counts (it has no stream and no buffer).
    [[nodiscard]] bool counting() const noexcept { return out_ == nullptr && !to_buffer_; }

private:
    std::ostream* out_ = nullptr;
    unsigned char* buffer_ = nullptr;
    std::size_t capacity_ = 0;
    bool to_buffer_ = false;
    std::uint64_t size_ = 0;
    std::uint32_t crc_ = 0;
};

/// Reads a payload that memattn::load has already read whole and checked against its
/// checksum. Every read past its end throws SnapshotError, and so does every check a
/// memory makes through it (expect, count, expect_remaining): the memory reads and
/// checks all it needs before it changes anything.
class Reader {
public:
    /// `bytes` is the payload; `kind` names the memory in messages.
    Reader(std::span<const unsigned char> bytes, std::string kind) : bytes_(bytes), kind_(std::move(kind)) {}

    /// Bytes not read yet.
    [[nodiscard]] std::size_t remaining() const noexcept { return bytes_.size() - at_; }
    /// The memory's name in messages.
    [[nodiscard]] const std::string& kind() const noexcept { return kind_; }

    /// `size` bytes as they are, into `data`; `what` names them in messages.
    void bytes(void* data, std::size_t size, std::string_view what) {
        need(size, what);
        if (size > 0)
            std::memcpy(data, bytes_.data() + at_, size);
        at_ += size;
    }

    /// Skips `size` bytes (of a part of the payload the memory does not keep); `what`
    /// names them in messages.
    void skip(std::size_t size, std::string_view what) {
        need(size, what);
        at_ += size;
    }

    /// One number of type N, little-endian (Writer::number); `what` names it in messages.
    template <class N>
        requires std::is_arithmetic_v<N>
    N number(std::string_view what) {
        need(sizeof(N), what);
        const N value = detail::from_little_endian<N>(bytes_.data() + at_);
        at_ += sizeof(N);
        return value;
    }

    /// A count, size or dimension: a signed 64-bit integer (Writer::index).
    Index index(std::string_view what) { return static_cast<Index>(number<std::int64_t>(what)); }

    /// A bool (Writer::flag); throws unless the byte is 0 or 1.
    bool flag(std::string_view what) {
        const auto b = number<std::uint8_t>(what);
        if (b > 1)
            fail(std::string(what) + " is " + std::to_string(b) + ", expected 0 or 1");
        return b == 1;
    }

    /// A string: its byte count (u32), then its bytes (Writer::text).
    std::string text(std::string_view what) {
        const auto n = number<std::uint32_t>(what);
        need(n, what);
        std::string s(reinterpret_cast<const char*>(bytes_.data() + at_), n);
        at_ += n;
        return s;
    }

    /// Reads a value of the target's type and throws unless it equals the target's (bit
    /// for bit for floating point): the check of every dimension and option.
    template <class N>
        requires std::is_arithmetic_v<N>
    void expect(std::string_view what, N mine) {
        using Stored = std::conditional_t<std::is_floating_point_v<N>, N,
                                          std::conditional_t<std::is_same_v<N, bool>, bool, std::int64_t>>;
        Stored stored;
        if constexpr (std::is_same_v<Stored, bool>)
            stored = flag(what);
        else
            stored = number<Stored>(what);
        const bool same = std::is_floating_point_v<N> ? std::memcmp(&stored, &mine, sizeof(N)) == 0
                                                       : stored == static_cast<Stored>(mine);
        if (!same)
            mismatch(what, describe(stored), describe(static_cast<Stored>(mine)));
    }

    /// Reads a string and throws unless it equals the target's `mine`: expect for text.
    void expect_text(std::string_view what, std::string_view mine) {
        const std::string stored = text(what);
        if (stored != mine)
            mismatch(what, "\"" + stored + "\"", "\"" + std::string(mine) + "\"");
    }

    /// Throws unless the target and the stream hold the same `what`; `stored` and `mine`
    /// describe the two.
    [[noreturn]] void mismatch(std::string_view what, const std::string& stored, const std::string& mine) const {
        throw SnapshotError("memattn::load: " + kind_ + ": " + std::string(what) + " is " + stored +
                            " in the stream, " + mine + " in the memory");
    }

    /// A count (a length, a number of rows) in [least, most].
    Index count(std::string_view what, Index least, Index most) {
        const Index n = index(what);
        if (n < least || n > most)
            fail(std::string(what) + " is " + std::to_string(n) + ", expected " + std::to_string(least) + " .. " +
                 std::to_string(most));
        return n;
    }

    /// Throws unless exactly `bytes` remain: how a memory checks, before it writes a
    /// coefficient, that the rest of the payload is the state its header fields describe.
    void expect_remaining(std::size_t bytes, std::string_view what) const {
        if (remaining() != bytes)
            fail("the payload has " + std::to_string(remaining()) + " bytes left, expected " + std::to_string(bytes) +
                 " for " + std::string(what));
    }

    /// Fills a matrix (any writable Eigen block with contiguous rows) row by row.
    template <class D>
    void matrix(D&& m, std::string_view what) {
        using E = std::remove_cvref_t<D>;
        using S = typename E::Scalar;
        const std::size_t row_bytes = sizeof(S) * static_cast<std::size_t>(m.cols());
        need(row_bytes * static_cast<std::size_t>(m.rows()), what);
        for (Index r = 0; r < m.rows(); ++r) {
            if constexpr (std::endian::native == std::endian::little && bool(E::IsRowMajor) &&
                          int(Eigen::internal::traits<E>::Flags & Eigen::DirectAccessBit) != 0) {
                if (m.innerStride() == 1) {
                    if (row_bytes > 0)
                        std::memcpy(m.data() + r * m.outerStride(), bytes_.data() + at_, row_bytes);
                    at_ += row_bytes;
                    continue;
                }
            }
            for (Index c = 0; c < m.cols(); ++c)
                m.coeffRef(r, c) = number<S>(what);
        }
    }

    /// The next nested part (see Writer::part) as a reader of its own; skips it here.
    Reader part(std::string_view what) {
        const auto n = number<std::uint64_t>(what);
        need(n, what);
        Reader inner(bytes_.subspan(at_, static_cast<std::size_t>(n)), kind_ + " " + std::string(what));
        at_ += static_cast<std::size_t>(n);
        return inner;
    }

    /// Throws SnapshotError, its message naming the memory (kind()) and then `what`.
    [[noreturn]] void fail(const std::string& what) const {
        throw SnapshotError("memattn::load: " + kind_ + ": " + what);
    }

private:
    void need(std::uint64_t size, std::string_view what) const {
        if (size > remaining())
            fail("the payload ends " + std::to_string(remaining()) + " bytes before the end of " + std::string(what) +
                 " (" + std::to_string(size) + " bytes)");
    }

    template <class N>
    static std::string describe(N value) {
        if constexpr (std::is_same_v<N, bool>)
            return value ? "true" : "false";
        else if constexpr (std::is_floating_point_v<N>) {
            std::ostringstream s;
            s.precision(std::numeric_limits<N>::max_digits10);
            s << value;
            return s.str();
        } else {
            return std::to_string(value);
        }
    }

    std::span<const unsigned char> bytes_;
    std::size_t at_ = 0;
    std::string kind_;
};

}  // namespace snapshot
}  // namespace memattn
