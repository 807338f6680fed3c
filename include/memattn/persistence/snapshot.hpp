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
#include "memattn/types.hpp"

#include <algorithm>
#include <array>
#include <concepts>
#include <cstdint>
#include <istream>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

namespace memattn {

/// A memory that can be saved and loaded: it names its kind (which, with its scalar
/// and storage type, must match between the stream and the target) and writes and
/// reads its payload (see the top of this header for the contract).
template <class M>
concept Snapshottable = Memory<M> && requires(const M& cm, M& m, snapshot::Writer& w, snapshot::Reader& r) {
    { cm.snapshot_kind() } -> std::convertible_to<std::string>;
    cm.write_snapshot(w);
    m.read_snapshot(r);
};

namespace snapshot {

/// The first bytes of every snapshot: a byte above 0x7F (so 7-bit channels and text
/// decoders show themselves), then "MEMATTN".
inline constexpr std::array<unsigned char, 8> magic = {0x89, 'M', 'E', 'M', 'A', 'T', 'T', 'N'};
/// The format version this library writes, and the newest it reads.
inline constexpr std::uint32_t format_version = 1;
/// The longest kind name a snapshot may hold.
inline constexpr std::uint32_t max_kind_bytes = 255;

/// A type code's name in messages: float32, float64, bfloat16, float16 or q8.
inline std::string type_name(std::uint8_t code) {
    switch (code) {
        case 1: return "float32";
        case 2: return "float64";
        case 3: return "bfloat16";
        case 4: return "float16";
        case 5: return "q8";
        default: return "unknown type " + std::to_string(code);
    }
}

/// The storage type code of a memory: its snapshot_storage when it declares one (the
/// caches with compact K/V storage), else its Scalar's.
template <class M>
constexpr TypeCode storage_code() {
    if constexpr (requires { M::snapshot_storage; })
        return M::snapshot_storage;
    else
        return type_code<typename M::Scalar>();
}

}  // namespace snapshot

namespace detail {

inline void read_exactly(std::istream& in, void* data, std::size_t size, const char* what, std::uint64_t offset) {
    if (size == 0)
        return;
    in.read(static_cast<char*>(data), static_cast<std::streamsize>(size));
    if (static_cast<std::size_t>(in.gcount()) != size)
        throw SnapshotError("memattn::load: the stream ends " + std::to_string(offset + std::uint64_t(in.gcount())) +
                            " bytes into the snapshot, inside " + what + " (truncated)");
}

}  // namespace detail

/// Writes `memory` to `out` as one snapshot (docs/snapshot-format.md): the header, the
/// memory's payload, the checksum. Open files in binary mode. Throws SnapshotError if the
/// stream fails (what reached it is then an incomplete snapshot that load rejects).
template <Snapshottable M>
void save(const M& memory, std::ostream& out) {
    snapshot::Writer counter;
    memory.write_snapshot(counter);
    const std::string kind = memory.snapshot_kind();
    detail::require(kind.size() <= snapshot::max_kind_bytes, "memattn::save", "memory.snapshot_kind()", "has ",
                    kind.size(), " bytes, expected at most ", snapshot::max_kind_bytes);
    snapshot::Writer w(out);
    w.bytes(snapshot::magic.data(), snapshot::magic.size());
    w.number(snapshot::format_version);
    w.text(kind);
    w.number(static_cast<std::uint8_t>(snapshot::type_code<typename M::Scalar>()));
    w.number(static_cast<std::uint8_t>(snapshot::storage_code<M>()));
    w.number(std::uint16_t{0});
    w.number(static_cast<std::uint64_t>(counter.size()));
    const std::uint64_t before = w.size();
    memory.write_snapshot(w);
    if (w.size() - before != counter.size())
        throw SnapshotError("memattn::save: " + kind + " wrote " + std::to_string(w.size() - before) +
                            " payload bytes after counting " + std::to_string(counter.size()));
    w.number(w.crc());
}

/// Reads one snapshot from `in` into `memory`, which must be of the kind, scalar,
/// storage, dimensions and options the snapshot was saved from; leaves `in` just after
/// it. All or nothing: on any fault (see SnapshotError) `memory` is unchanged.
template <Snapshottable M>
void load(M& memory, std::istream& in) {
    using namespace snapshot;
    // Header, up to the kind's length: magic, version, kind bytes.
    std::vector<unsigned char> head(magic.size() + 8);
    detail::read_exactly(in, head.data(), head.size(), "the header", 0);
    if (!std::equal(magic.begin(), magic.end(), head.begin()))
        throw SnapshotError("memattn::load: not a memattn snapshot (the first 8 bytes are not the magic \\x89MEMATTN)");
    const auto version = detail::from_little_endian<std::uint32_t>(head.data() + 8);
    if (version == 0 || version > format_version)
        throw SnapshotError("memattn::load: format version " + std::to_string(version) +
                            (version == 0 ? " is invalid" : " is newer than this library reads (") +
                            (version == 0 ? "" : std::to_string(format_version) + ")"));
    const auto kind_bytes = detail::from_little_endian<std::uint32_t>(head.data() + 12);
    if (kind_bytes > max_kind_bytes)
        throw SnapshotError("memattn::load: the kind name has " + std::to_string(kind_bytes) +
                            " bytes, at most " + std::to_string(max_kind_bytes) + " are valid (corrupted header)");
    // The rest of the header: kind, two type codes, reserved, payload size.
    const std::size_t fixed = head.size();
    head.resize(fixed + kind_bytes + 12);
    detail::read_exactly(in, head.data() + fixed, kind_bytes + 12, "the header", fixed);
    const unsigned char* after_kind = head.data() + fixed + kind_bytes;
    const auto payload_bytes = detail::from_little_endian<std::uint64_t>(after_kind + 4);
    // The payload, read in growing pieces so that a corrupted size cannot make load
    // allocate more than the stream holds (plus as much again).
    std::vector<unsigned char> payload;
    std::uint64_t got = 0;
    while (got < payload_bytes) {
        const std::uint64_t piece = std::min<std::uint64_t>(payload_bytes - got, std::max<std::uint64_t>(got, 1 << 20));
        payload.resize(static_cast<std::size_t>(got + piece));
        detail::read_exactly(in, payload.data() + got, static_cast<std::size_t>(piece), "the payload",
                             head.size() + got);
        got += piece;
    }
    unsigned char stored_crc[4];
    detail::read_exactly(in, stored_crc, 4, "the checksum", head.size() + payload_bytes);
    const std::uint32_t crc = detail::Crc32c::update(detail::Crc32c::update(0, head.data(), head.size()),
                                                     payload.data(), payload.size());
    const auto expected_crc = detail::from_little_endian<std::uint32_t>(stored_crc);
    if (crc != expected_crc) {
        std::ostringstream message;
        message << "memattn::load: checksum mismatch (stored 0x" << std::hex << expected_crc << ", computed 0x" << crc
                << "): the snapshot is corrupted";
        throw SnapshotError(message.str());
    }
    // Sound bytes: now what they say must match the target.
    const std::string kind(reinterpret_cast<const char*>(head.data() + fixed), kind_bytes);
    const std::string mine = memory.snapshot_kind();
    if (kind != mine)
        throw SnapshotError("memattn::load: the stream holds a " + kind + ", the memory is a " + mine);
    const std::uint8_t scalar = after_kind[0], storage = after_kind[1];
    const auto my_scalar = static_cast<std::uint8_t>(type_code<typename M::Scalar>());
    const auto my_storage = static_cast<std::uint8_t>(storage_code<M>());
    if (scalar != my_scalar)
        throw SnapshotError("memattn::load: " + mine + ": the scalar is " + type_name(scalar) + " in the stream, " +
                            type_name(my_scalar) + " in the memory");
    if (storage != my_storage)
        throw SnapshotError("memattn::load: " + mine + ": the storage is " + type_name(storage) + " in the stream, " +
                            type_name(my_storage) + " in the memory");
    if (after_kind[2] != 0 || after_kind[3] != 0)
        throw SnapshotError("memattn::load: " + mine + ": the reserved header bytes are not 0");
    Reader reader(payload, mine);
    memory.read_snapshot(reader);
}

}  // namespace memattn
