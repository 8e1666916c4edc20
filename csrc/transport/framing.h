#pragma once
// Wire formats. Every connection starts with a handshake in which each side proves it knows the
// group secret without sending it (challenge-response, HMAC-SHA-256 over both sides' nonces):
//
//   connector -> acceptor  Hello      magic, version, channel, rank, world size, nonce_c
//   acceptor  -> connector Challenge  magic, rank, nonce_a, HMAC(secret, "accept"  | Hello | magic, rank, nonce_a)
//   connector -> acceptor  Proof      HMAC(secret, "connect" | Hello | magic, rank, nonce_a)
//   acceptor  -> connector HelloAck   magic, rank; or, refusing a proven member, a refusal:
//                                     kRefusalMagic, the reason's length, then the reason
//
// A captured handshake cannot be replayed: the MACs cover the other side's fresh nonce. The two
// MACs carry different labels, so one side's cannot be reflected back as the other's. Then every
// collective message on a connection starts with a CollectiveHeader, every point-to-point message
// with a P2PHeader. Fixed little-endian layouts, decoded field by field, so that garbage is
// rejected instead of reinterpreted.
#include <array>
#include <cstdint>
#include <string>

namespace hetcomm {

constexpr uint32_t kHelloMagic = 0x4d435448;   // "HTCM"
constexpr uint32_t kFrameMagic = 0x4652434d;   // collective frame
constexpr uint32_t kP2PMagic = 0x5032504d;     // point-to-point frame
constexpr uint32_t kChallengeMagic = 0x4348434d;  // handshake challenge
constexpr uint32_t kRefusalMagic = 0x4652434e;    // handshake refused, with a reason
constexpr uint16_t kWireVersion = 2;
constexpr size_t kSecretBytes = 16;
constexpr size_t kNonceBytes = 16;
constexpr size_t kMacBytes = 32;

enum class Channel : uint8_t {
  kCollective = 1,  // one per unordered pair of ranks, opened by the higher rank
  kP2P = 2,         // one per ordered pair, opened by the sender; carries send/recv only
  kProbe = 3,       // "are you alive?": answered with the ack, then closed (no payload)
};

struct Hello {
  static constexpr size_t kBytes = 32;
  uint16_t version = kWireVersion;
  Channel channel = Channel::kCollective;
  int32_t rank = -1;
  int32_t worldSize = 0;
  std::array<uint8_t, kNonceBytes> nonce{};

  std::array<uint8_t, kBytes> encode() const;
  // Returns an empty string when well formed, else what is wrong with it.
  static std::string decode(const uint8_t* bytes, Hello& out);
};

// The acceptor's answer to a Hello: its rank, its nonce and its proof (kBodyBytes of header, then
// the MAC over the Hello and that header).
struct Challenge {
  static constexpr size_t kBodyBytes = 24;
  static constexpr size_t kBytes = kBodyBytes + kMacBytes;
  int32_t rank = -1;
  std::array<uint8_t, kNonceBytes> nonce{};
  std::array<uint8_t, kMacBytes> mac{};

  std::array<uint8_t, kBytes> encode() const;
  static std::string decode(const uint8_t* bytes, Challenge& out);
};

struct HelloAck {
  static constexpr size_t kBytes = 8;
  static constexpr size_t kMaxReasonBytes = 1024;
  int32_t rank = -1;
  // A refusal (decode sets it): `reasonBytes` bytes of reason follow (at most kMaxReasonBytes).
  bool refused = false;
  uint32_t reasonBytes = 0;
  // A refusal's 8 bytes; the reason follows them on the wire.
  static std::array<uint8_t, kBytes> encodeRefusal(size_t reasonBytes);
  std::array<uint8_t, kBytes> encode() const;
  static std::string decode(const uint8_t* bytes, HelloAck& out);
};

// Sent before the data of a collective on every link it uses. A receiver compares it with what it
// expects itself, which is how ranks that disagree about a collective (shapes, dtypes, op, order)
// get an error instead of silently wrong numbers or a hang.
struct CollectiveHeader {
  static constexpr size_t kBytes = 40;
  uint64_t seq = 0;     // collective sequence number in the group
  uint8_t opcode = 0;   // which collective (see backend::CollectiveKind)
  uint8_t dtype = 0;
  uint8_t redop = 0;
  uint8_t algo = 0;
  uint64_t bytes = 0;   // total payload of the collective, as the sender computes it
  uint64_t aux = 0;     // collective-specific: root, plan fingerprint, ...
  uint32_t step = 0;    // which step of the collective this message belongs to

  std::array<uint8_t, kBytes> encode() const;
  static std::string decode(const uint8_t* bytes, CollectiveHeader& out);
  bool operator==(const CollectiveHeader& o) const {
    return seq == o.seq && opcode == o.opcode && dtype == o.dtype && redop == o.redop && algo == o.algo &&
           bytes == o.bytes && aux == o.aux && step == o.step;
  }
};

struct P2PHeader {
  static constexpr size_t kBytes = 24;
  int64_t tag = 0;
  uint64_t bytes = 0;
  std::array<uint8_t, kBytes> encode() const;
  static std::string decode(const uint8_t* bytes, P2PHeader& out);
};

}  // namespace hetcomm
