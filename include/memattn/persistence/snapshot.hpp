#pragma once
// Snapshots: a memory written to a byte stream and read back, in a file or in another
// process, so a conversation's memory outlives the process that built it.
//
//   std::ofstream file("chat.mem", std::ios::binary);
//   memattn::save(cache, file);
//   ...
//   memattn::SlidingWindowCache<float> resumed(64, 64, 512, 4);   // same options
//   std::ifstream in("chat.mem", std::ios::binary);
//   memattn::load(resumed, in);   // continues bit for bit where `cache` was saved
//
// Or in a buffer of one's own (a server keeping many conversations' states), the same
// bytes, sized first; load returns the bytes it read, where a next snapshot starts:
//
//   std::vector<std::byte> buffer(memattn::snapshot_size(cache));
//   memattn::save(cache, buffer);                     // returns buffer.size()
//   const std::size_t used = memattn::load(resumed, buffer);
//
// The format (docs/snapshot-format.md) is versioned, little-endian and checksummed
// (CRC-32C over every byte). load is all or nothing: a stream that is truncated,
// corrupted anywhere, of a newer format version, or of another kind, scalar, storage,
// dimensions or options than the target throws memattn::SnapshotError, whose message
// says which, and the target is unchanged. Every memory of the library models
// Snapshottable (MultiHead<M> when M does; HybridCache and LinearAttentionMemory when
// their compressor or feature map names itself, as the library's do); so can a user's:
//
//   struct LastValue {   // the Memory of memattn/memory/concept.hpp, plus:
//       static std::string snapshot_kind() { return "LastValue"; }
//       void write_snapshot(memattn::snapshot::Writer& w) const { w.index(n_); w.matrix(v_); }
//       void read_snapshot(memattn::snapshot::Reader& r) {
//           const auto n = r.count("length", 0, std::numeric_limits<memattn::Index>::max());
//           r.expect_remaining(sizeof(float) * 4, "the value");   // all checks first ...
//           r.matrix(v_, "the value");                              // ... then change
//           n_ = n;
//       }
//   };
//
// The contract of read_snapshot: the payload it reads has passed its checksum; it
// checks every dimension and option against its own (Reader::expect) and the size of
// the rest (Reader::expect_remaining) before it changes anything, and then cannot throw
// (or allocates new storage first and swaps it in), so a throwing load leaves the memory
// as it was.

#include "memattn/memory/concept.hpp"
#include "memattn/persistence/stream.hpp"
#include "memattn/storage/compact.hpp"
#include "memattn/types.hpp"

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <istream>
#include <limits>
#include <ostream>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace memattn {

/// What save and load take: a type with a Scalar that names its kind (which, with its
/// scalar and storage type, must match between the stream and the target) and writes
/// and reads its payload (see the top of this header for the contract). Every
/// Snapshottable memory is one; so is a ModelCache's sequence, which is not a Memory.
template <class P>
concept Persistent = requires(const P& cp, P& p, snapshot::Writer& w, snapshot::Reader& r) {
    typename P::Scalar;
    { cp.snapshot_kind() } -> std::convertible_to<std::string>;
    cp.write_snapshot(w);
    p.read_snapshot(r);
};

/// A memory that can be saved and loaded: a Memory that is Persistent.
template <class M>
concept Snapshottable = Memory<M> && Persistent<M>;

namespace snapshot {

/// The first bytes of every snapshot: a byte above 0x7F (so 7-bit channels and text
/// decoders show themselves), then "MEMATTN".
inline constexpr std::array<unsigned char, 8> magic = {0x89, 'M', 'E', 'M', 'A', 'T', 'T', 'N'};
/// The format version this library writes, and the newest it reads.
inline constexpr std::uint32_t format_version = 1;
/// The longest kind name a snapshot may hold.
inline constexpr std::uint32_t max_kind_bytes = 255;

/// A type code's name in messages: float32, float64, bfloat16, float16, q8, q4, q4_affine, one of the three rotated
/// or the three per-channel-keys codes, or a format of a header of its own (the FP8 codes 14–17, by
/// detail::stated_formats).
inline std::string type_name(std::uint8_t code) {
    switch (code) {
        case 1: return "float32";
        case 2: return "float64";
        case 3: return "bfloat16";
        case 4: return "float16";
        case 5: return "q8";
        case 6: return "q4";
        case 7: return "q4_affine";
        case 8: return "q8_rotated";
        case 9: return "q4_rotated";
        case 10: return "q4_affine_rotated";
        case 11: return "q8_per_channel_keys";
        case 12: return "q4_per_channel_keys";
        case 13: return "q4_affine_per_channel_keys";
        default: {
            const char* stated = detail::stated_formats::code_name(code);  // FP8 and any later format
            return stated != nullptr ? std::string(stated) : "unknown type " + std::to_string(code);
        }
    }
}

/// The storage type code of a memory: its snapshot_storage when it declares one (the
/// caches with compact K/V storage), else its arithmetic's (a memory of 16-bit rows keeps
/// a float state).
template <class M>
constexpr TypeCode storage_code() {
    if constexpr (requires { M::snapshot_storage; })
        return M::snapshot_storage;
    else
        return type_code<arithmetic_t<typename M::Scalar>>();
}

}  // namespace snapshot

namespace detail {

/// The bytes of a snapshot before its payload (magic, version, kind, type codes,
/// reserved, payload size), for a kind name of `kind_bytes` bytes.
constexpr std::uint64_t snapshot_header_bytes(std::uint64_t kind_bytes) noexcept {
    return snapshot::magic.size() + 4 + 4 + kind_bytes + 1 + 1 + 2 + 8;
}

/// What writing a memory's snapshot takes, found by a counting pass of its
/// write_snapshot (nothing is allocated for the bytes): its kind and the sizes.
struct SnapshotPlan {
    std::string kind;
    std::uint64_t payload = 0;  // bytes of the payload
    std::uint64_t total = 0;    // bytes of the whole snapshot: header, payload, checksum
};

/// `function` is the caller's name without "memattn::", as for require.
template <Persistent M>
SnapshotPlan plan_snapshot(const M& memory, std::string_view function) {
    snapshot::Writer counter;
    memory.write_snapshot(counter);
    SnapshotPlan plan{memory.snapshot_kind(), counter.size(), 0};
    require(plan.kind.size() <= snapshot::max_kind_bytes, function, "memory.snapshot_kind()", "has ",
            plan.kind.size(), " bytes, expected at most ", snapshot::max_kind_bytes);
    plan.total = snapshot_header_bytes(plan.kind.size()) + plan.payload + 4;
    return plan;
}

/// A snapshot's size as a std::size_t (it always is one where size_t has 64 bits);
/// `function` is named without "memattn::", as for require.
inline std::size_t snapshot_bytes(const SnapshotPlan& plan, std::string_view function) {
    if constexpr (sizeof(std::size_t) < sizeof(std::uint64_t))
        if (plan.total > std::numeric_limits<std::size_t>::max())
            throw std::length_error("memattn::" + std::string(function) + ": the snapshot of " + plan.kind + " has " +
                                    std::to_string(plan.total) + " bytes, more than a std::size_t counts");
    return static_cast<std::size_t>(plan.total);
}

/// The one write path of the format, whatever the sink of `w` (a stream or a buffer):
/// the header, the memory's payload, the checksum.
template <Persistent M>
void write_snapshot_to(const M& memory, const SnapshotPlan& plan, snapshot::Writer& w) {
    w.bytes(snapshot::magic.data(), snapshot::magic.size());
    w.number(snapshot::format_version);
    w.text(plan.kind);
    w.number(static_cast<std::uint8_t>(snapshot::type_code<typename M::Scalar>()));
    w.number(static_cast<std::uint8_t>(snapshot::storage_code<M>()));
    w.number(std::uint16_t{0});
    w.number(plan.payload);
    const std::uint64_t before = w.size();
    memory.write_snapshot(w);
    if (w.size() - before != plan.payload)
        throw SnapshotError("memattn::save: " + plan.kind + " wrote " + std::to_string(w.size() - before) +
                            " payload bytes after counting " + std::to_string(plan.payload));
    w.number(w.crc());
}

/// Where load reads a snapshot from a stream: fill(end) makes the snapshot's bytes
/// [0, end) available at data(), reading only as far as the snapshot goes, in growing
/// pieces so that a corrupted size cannot make load allocate more than the stream holds
/// (plus as much again).
class StreamSource {
public:
    explicit StreamSource(std::istream& in) : in_(in) {}

    void fill(std::uint64_t end, const char* what) {
        while (bytes_.size() < end) {
            const std::uint64_t got = bytes_.size();
            const std::uint64_t piece = std::min<std::uint64_t>(end - got, std::max<std::uint64_t>(got, 1 << 20));
            bytes_.resize(static_cast<std::size_t>(got + piece));
            in_.read(reinterpret_cast<char*>(bytes_.data() + got), static_cast<std::streamsize>(piece));
            if (static_cast<std::uint64_t>(in_.gcount()) != piece)
                throw SnapshotError("memattn::load: the stream ends " +
                                    std::to_string(got + static_cast<std::uint64_t>(in_.gcount())) +
                                    " bytes into the snapshot, inside " + what + " (truncated)");
        }
    }
    [[nodiscard]] const unsigned char* data() const noexcept { return bytes_.data(); }

private:
    std::istream& in_;
    std::vector<unsigned char> bytes_;
};

/// Where load reads a snapshot from a caller's buffer: the bytes are there already, and
/// fill(end) only checks that the buffer holds [0, end).
class SpanSource {
public:
    explicit SpanSource(std::span<const std::byte> in)
        : data_(reinterpret_cast<const unsigned char*>(in.data())), size_(in.size()) {}

    void fill(std::uint64_t end, const char* what) const {
        if (end > size_)
            throw SnapshotError("memattn::load: the buffer ends " + std::to_string(size_) +
                                " bytes into the snapshot, inside " + what + " (truncated)");
    }
    [[nodiscard]] const unsigned char* data() const noexcept { return data_; }

private:
    const unsigned char* data_;
    std::size_t size_;
};

/// The one read path of the format, whatever the source: reads one snapshot into
/// `memory` all or nothing and returns its size in bytes.
template <Persistent M, class Source>
std::uint64_t load_snapshot_from(M& memory, Source& source) {
    using namespace snapshot;
    // Header, up to the kind's length: magic, version, kind bytes.
    constexpr std::uint64_t fixed = magic.size() + 8;
    source.fill(fixed, "the header");
    if (!std::equal(magic.begin(), magic.end(), source.data()))
        throw SnapshotError("memattn::load: not a memattn snapshot (the first 8 bytes are not the magic \\x89MEMATTN)");
    const auto version = from_little_endian<std::uint32_t>(source.data() + 8);
    if (version == 0 || version > format_version)
        throw SnapshotError("memattn::load: format version " + std::to_string(version) +
                            (version == 0 ? " is invalid" : " is newer than this library reads (") +
                            (version == 0 ? "" : std::to_string(format_version) + ")"));
    const auto kind_bytes = from_little_endian<std::uint32_t>(source.data() + 12);
    if (kind_bytes > max_kind_bytes)
        throw SnapshotError("memattn::load: the kind name has " + std::to_string(kind_bytes) +
                            " bytes, at most " + std::to_string(max_kind_bytes) + " are valid (corrupted header)");
    // The rest of the header: kind, two type codes, reserved, payload size.
    const std::uint64_t header = snapshot_header_bytes(kind_bytes);
    source.fill(header, "the header");
    const auto payload_bytes = from_little_endian<std::uint64_t>(source.data() + header - 8);
    if (payload_bytes > std::numeric_limits<std::size_t>::max() - header - 4)
        throw SnapshotError("memattn::load: the header gives a payload of " + std::to_string(payload_bytes) +
                            " bytes, more than this machine addresses (corrupted header)");
    // The payload and the checksum.
    source.fill(header + payload_bytes, "the payload");
    source.fill(header + payload_bytes + 4, "the checksum");
    const unsigned char* bytes = source.data();
    const std::uint32_t crc = Crc32c::update(0, bytes, static_cast<std::size_t>(header + payload_bytes));
    const auto expected_crc = from_little_endian<std::uint32_t>(bytes + header + payload_bytes);
    if (crc != expected_crc) {
        std::ostringstream message;
        message << "memattn::load: checksum mismatch (stored 0x" << std::hex << expected_crc << ", computed 0x" << crc
                << "): the snapshot is corrupted";
        throw SnapshotError(message.str());
    }
    // Sound bytes: now what they say must match the target.
    const std::string kind(reinterpret_cast<const char*>(bytes + fixed), kind_bytes);
    const std::string mine = memory.snapshot_kind();
    if (kind != mine)
        throw SnapshotError("memattn::load: the stream holds a " + kind + ", the memory is a " + mine);
    const unsigned char* after_kind = bytes + fixed + kind_bytes;
    const std::uint8_t scalar = after_kind[0], storage = after_kind[1];
    const auto my_scalar = static_cast<std::uint8_t>(snapshot::type_code<typename M::Scalar>());
    const auto my_storage = static_cast<std::uint8_t>(snapshot::storage_code<M>());
    if (scalar != my_scalar)
        throw SnapshotError("memattn::load: " + mine + ": the scalar is " + type_name(scalar) + " in the stream, " +
                            type_name(my_scalar) + " in the memory");
    if (storage != my_storage)
        throw SnapshotError("memattn::load: " + mine + ": the storage is " + type_name(storage) + " in the stream, " +
                            type_name(my_storage) + " in the memory");
    if (after_kind[2] != 0 || after_kind[3] != 0)
        throw SnapshotError("memattn::load: " + mine + ": the reserved header bytes are not 0");
    Reader reader(std::span<const unsigned char>(bytes + header, static_cast<std::size_t>(payload_bytes)), mine);
    memory.read_snapshot(reader);
    return header + payload_bytes + 4;
}

}  // namespace detail

/// The size in bytes of the snapshot save(memory, ...) writes, exactly: what a buffer for
/// save(memory, span) needs. Runs the memory's write_snapshot counting, which allocates
/// nothing for the bytes and takes a small part of a save's time (no copy, no checksum).
/// The size changes as the memory takes tokens (a KVCache's grows with its length; the
/// fixed-size memories' stays the same from the first token their state holds in full).
template <Persistent M>
[[nodiscard]] std::size_t snapshot_size(const M& memory) {
    return detail::snapshot_bytes(detail::plan_snapshot(memory, "snapshot_size"), "snapshot_size");
}

/// Writes `memory` to `out` as one snapshot (docs/snapshot-format.md): the header, the
/// memory's payload, the checksum. Open files in binary mode. Throws SnapshotError if the
/// stream fails (what reached it is then an incomplete snapshot that load rejects).
template <Persistent M>
void save(const M& memory, std::ostream& out) {
    const detail::SnapshotPlan plan = detail::plan_snapshot(memory, "save");
    snapshot::Writer w(out);
    detail::write_snapshot_to(memory, plan, w);
}

/// Writes `memory` as one snapshot into the first bytes of `out`, the bytes save(memory,
/// stream) writes, and returns how many (snapshot_size(memory)); the rest of `out` is not
/// touched, so snapshots can be written back to back. A buffer smaller than the snapshot
/// throws std::invalid_argument, saying the size needed and the size given, before a byte
/// is written. (Only a memory whose write_snapshot throws, or writes other sizes than it
/// counted, leaves the buffer's first bytes unspecified, with SnapshotError.)
template <Persistent M>
std::size_t save(const M& memory, std::span<std::byte> out) {
    const detail::SnapshotPlan plan = detail::plan_snapshot(memory, "save");
    const std::size_t total = detail::snapshot_bytes(plan, "save");
    detail::require(total <= out.size(), "save", "out", "has ", out.size(), " bytes, the snapshot of the ",
                    plan.kind, " needs ", total, " (memattn::snapshot_size)");
    snapshot::Writer w(out.first(total));
    detail::write_snapshot_to(memory, plan, w);
    return total;
}

/// Reads one snapshot from `in` into `memory`, which must be of the kind, scalar,
/// storage, dimensions and options the snapshot was saved from; leaves `in` just after
/// it. All or nothing: on any fault (see SnapshotError) `memory` is unchanged.
template <Persistent M>
void load(M& memory, std::istream& in) {
    detail::StreamSource source(in);
    detail::load_snapshot_from(memory, source);
}

/// Reads the snapshot at the start of `in` into `memory`, as load(memory, stream) does
/// (the same checks, all or nothing), and returns its size in bytes, where the next
/// snapshot of a buffer holding several back to back starts. Bytes after the snapshot are
/// not read. Reads the payload where it lies in `in`, without copying it.
template <Persistent M>
std::size_t load(M& memory, std::span<const std::byte> in) {
    detail::SpanSource source(in);
    return static_cast<std::size_t>(detail::load_snapshot_from(memory, source));
}

}  // namespace memattn
