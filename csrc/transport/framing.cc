#include "transport/framing.h"

#include <algorithm>
#include <cstring>

#include "common/error.h"

namespace hetcomm {
namespace {

template <typename T>
void put(uint8_t*& p, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) *p++ = static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i));
}

template <typename T>
T get(const uint8_t*& p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(*p++) << (8 * i);
  return static_cast<T>(v);
}

}  // namespace

std::array<uint8_t, Hello::kBytes> Hello::encode() const {
  std::array<uint8_t, kBytes> out{};
  uint8_t* p = out.data();
  put<uint32_t>(p, kHelloMagic);
  put<uint16_t>(p, version);
  put<uint8_t>(p, static_cast<uint8_t>(channel));
  put<uint8_t>(p, 0);
  put<int32_t>(p, rank);
  put<int32_t>(p, worldSize);
  std::memcpy(p, nonce.data(), kNonceBytes);
  return out;
}

std::string Hello::decode(const uint8_t* bytes, Hello& out) {
  const uint8_t* p = bytes;
  uint32_t magic = get<uint32_t>(p);
  if (magic != kHelloMagic) return strCat("bad magic 0x", std::hex, magic);
  out.version = get<uint16_t>(p);
  if (out.version != kWireVersion) return strCat("unsupported wire version ", out.version);
  uint8_t channel = get<uint8_t>(p);
  if (channel < static_cast<uint8_t>(Channel::kCollective) || channel > static_cast<uint8_t>(Channel::kProbe)) {
    return strCat("unknown channel ", static_cast<int>(channel));
  }
  out.channel = static_cast<Channel>(channel);
  get<uint8_t>(p);
  out.rank = get<int32_t>(p);
  out.worldSize = get<int32_t>(p);
  std::memcpy(out.nonce.data(), p, kNonceBytes);
  return "";
}

std::array<uint8_t, Challenge::kBytes> Challenge::encode() const {
  std::array<uint8_t, kBytes> out{};
  uint8_t* p = out.data();
  put<uint32_t>(p, kChallengeMagic);
  put<int32_t>(p, rank);
  std::memcpy(p, nonce.data(), kNonceBytes);
  p += kNonceBytes;
  std::memcpy(p, mac.data(), kMacBytes);
  return out;
}

std::string Challenge::decode(const uint8_t* bytes, Challenge& out) {
  const uint8_t* p = bytes;
  if (get<uint32_t>(p) != kChallengeMagic) return "bad magic in the handshake's challenge";
  out.rank = get<int32_t>(p);
  std::memcpy(out.nonce.data(), p, kNonceBytes);
  p += kNonceBytes;
  std::memcpy(out.mac.data(), p, kMacBytes);
  return "";
}

std::array<uint8_t, HelloAck::kBytes> HelloAck::encode() const {
  std::array<uint8_t, kBytes> out{};
  uint8_t* p = out.data();
  put<uint32_t>(p, kHelloMagic);
  put<int32_t>(p, rank);
  return out;
}

std::array<uint8_t, HelloAck::kBytes> HelloAck::encodeRefusal(size_t reasonBytes) {
  std::array<uint8_t, kBytes> out{};
  uint8_t* p = out.data();
  put<uint32_t>(p, kRefusalMagic);
  put<uint32_t>(p, static_cast<uint32_t>(std::min(reasonBytes, kMaxReasonBytes)));
  return out;
}

std::string HelloAck::decode(const uint8_t* bytes, HelloAck& out) {
  const uint8_t* p = bytes;
  const uint32_t magic = get<uint32_t>(p);
  if (magic == kRefusalMagic) {
    out.refused = true;
    out.reasonBytes = get<uint32_t>(p);
    if (out.reasonBytes > kMaxReasonBytes) return "oversized refusal in handshake reply";
    return "";
  }
  if (magic != kHelloMagic) return "bad magic in handshake reply";
  out.rank = get<int32_t>(p);
  return "";
}

std::array<uint8_t, CollectiveHeader::kBytes> CollectiveHeader::encode() const {
  std::array<uint8_t, kBytes> out{};
  uint8_t* p = out.data();
  put<uint32_t>(p, kFrameMagic);
  put<uint8_t>(p, opcode);
  put<uint8_t>(p, dtype);
  put<uint8_t>(p, redop);
  put<uint8_t>(p, algo);
  put<uint64_t>(p, seq);
  put<uint64_t>(p, bytes);
  put<uint64_t>(p, aux);
  put<uint32_t>(p, step);
  put<uint32_t>(p, 0);
  return out;
}

std::string CollectiveHeader::decode(const uint8_t* bytes, CollectiveHeader& out) {
  const uint8_t* p = bytes;
  if (get<uint32_t>(p) != kFrameMagic) return "bad frame magic (garbage or a desynchronised stream)";
  out.opcode = get<uint8_t>(p);
  out.dtype = get<uint8_t>(p);
  out.redop = get<uint8_t>(p);
  out.algo = get<uint8_t>(p);
  out.seq = get<uint64_t>(p);
  out.bytes = get<uint64_t>(p);
  out.aux = get<uint64_t>(p);
  out.step = get<uint32_t>(p);
  return "";
}

std::array<uint8_t, P2PHeader::kBytes> P2PHeader::encode() const {
  std::array<uint8_t, kBytes> out{};
  uint8_t* p = out.data();
  put<uint32_t>(p, kP2PMagic);
  put<uint32_t>(p, 0);
  put<int64_t>(p, tag);
  put<uint64_t>(p, bytes);
  return out;
}

std::string P2PHeader::decode(const uint8_t* bytes, P2PHeader& out) {
  const uint8_t* p = bytes;
  if (get<uint32_t>(p) != kP2PMagic) return "bad point-to-point frame magic";
  get<uint32_t>(p);
  out.tag = get<int64_t>(p);
  out.bytes = get<uint64_t>(p);
  return "";
}

}  // namespace hetcomm
