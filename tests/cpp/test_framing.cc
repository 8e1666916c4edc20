// Wire formats (csrc/transport/framing).
#include <cstring>
#include <limits>

#include "check.h"
#include "transport/framing.h"

using namespace hetcomm;

namespace {
template <size_t N>
void putU32(std::array<uint8_t, N>& b, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + i] = static_cast<uint8_t>(v >> (8 * i));
}
}  // namespace

TEST_CASE(hello_round_trip) {
  for (Channel ch : {Channel::kCollective, Channel::kP2P, Channel::kProbe}) {
    for (int32_t rank : {0, 7, std::numeric_limits<int32_t>::max(), -1}) {
      Hello h;
      h.channel = ch;
      h.rank = rank;
      h.worldSize = 1 << 20;
      for (size_t i = 0; i < kSecretBytes; ++i) h.secret[i] = static_cast<uint8_t>(0xa0 + 13 * i);
      const auto bytes = h.encode();
      CHECK_EQ(bytes.size(), Hello::kBytes);
      Hello out;
      CHECK_EQ(Hello::decode(bytes.data(), out), std::string());
      CHECK_EQ(out.version, kWireVersion);
      CHECK(out.channel == ch);
      CHECK_EQ(out.rank, rank);
      CHECK_EQ(out.worldSize, 1 << 20);
      CHECK(out.secret == h.secret);
    }
  }
}

TEST_CASE(hello_layout_is_little_endian) {
  Hello h;
  h.rank = 0x01020304;
  const auto b = h.encode();
  CHECK(std::memcmp(b.data(), "HTCM", 4) == 0);  // kHelloMagic, little-endian
  CHECK_EQ(b[4], kWireVersion & 0xff);
  CHECK_EQ(b[5], kWireVersion >> 8);
  CHECK_EQ(b[6], static_cast<uint8_t>(Channel::kCollective));
  CHECK_EQ(b[8], 0x04);
  CHECK_EQ(b[11], 0x01);
}

TEST_CASE(hello_rejects_garbage) {
  Hello h;
  h.rank = 3;
  h.worldSize = 4;
  Hello out;
  {
    auto b = h.encode();
    putU32(b, 0, kFrameMagic);  // a frame where a hello should be
    CHECK(!Hello::decode(b.data(), out).empty());
    b.fill(0);
    CHECK(!Hello::decode(b.data(), out).empty());
    b.fill(0xff);
    CHECK(!Hello::decode(b.data(), out).empty());
  }
  for (uint16_t version : {uint16_t(0), uint16_t(kWireVersion + 1), uint16_t(0xffff)}) {
    auto b = h.encode();
    b[4] = static_cast<uint8_t>(version);
    b[5] = static_cast<uint8_t>(version >> 8);
    const std::string err = Hello::decode(b.data(), out);
    CHECK_MSG(err.find("version") != std::string::npos, "version ", version, ": '", err, "'");
  }
  for (uint8_t channel : {uint8_t(0), uint8_t(4), uint8_t(255)}) {
    auto b = h.encode();
    b[6] = channel;
    const std::string err = Hello::decode(b.data(), out);
    CHECK_MSG(err.find("channel") != std::string::npos, "channel ", channel, ": '", err, "'");
  }
}

TEST_CASE(hello_ack_round_trip_and_rejects) {
  for (int32_t rank : {0, 5, -1, std::numeric_limits<int32_t>::min()}) {
    HelloAck a;
    a.rank = rank;
    const auto b = a.encode();
    CHECK_EQ(b.size(), HelloAck::kBytes);
    HelloAck out;
    CHECK_EQ(HelloAck::decode(b.data(), out), std::string());
    CHECK_EQ(out.rank, rank);
  }
  HelloAck a;
  auto b = a.encode();
  b[0] ^= 1;
  HelloAck out;
  CHECK(!HelloAck::decode(b.data(), out).empty());
}

TEST_CASE(collective_header_round_trip) {
  CollectiveHeader h;
  h.seq = 0x0123456789abcdefull;
  h.opcode = 0xfe;
  h.dtype = 3;
  h.redop = 7;
  h.algo = 0x80;
  h.bytes = std::numeric_limits<uint64_t>::max();
  h.aux = 1ull << 63;
  h.step = 0xdeadbeef;
  const auto b = h.encode();
  CHECK_EQ(b.size(), CollectiveHeader::kBytes);
  CollectiveHeader out;
  CHECK_EQ(CollectiveHeader::decode(b.data(), out), std::string());
  CHECK(out == h);
  CHECK_EQ(out.seq, h.seq);
  CHECK_EQ(out.bytes, h.bytes);
  CHECK_EQ(out.aux, h.aux);
  CHECK_EQ(out.step, h.step);
  CollectiveHeader zero;
  CHECK_EQ(CollectiveHeader::decode(zero.encode().data(), out), std::string());
  CHECK(out == zero);
  // Every field takes part in ==.
  CollectiveHeader d = h;
  d.step ^= 1;
  CHECK(!(d == h));
  d = h;
  d.aux ^= 1;
  CHECK(!(d == h));
  d = h;
  d.algo ^= 1;
  CHECK(!(d == h));
}

TEST_CASE(collective_header_rejects_bad_magic) {
  CollectiveHeader h;
  CollectiveHeader out;
  auto b = h.encode();
  putU32(b, 0, kP2PMagic);
  CHECK(!CollectiveHeader::decode(b.data(), out).empty());
  putU32(b, 0, kHelloMagic);
  CHECK(!CollectiveHeader::decode(b.data(), out).empty());
  b.fill(0);
  CHECK(!CollectiveHeader::decode(b.data(), out).empty());
}

TEST_CASE(p2p_header_round_trip_and_rejects) {
  for (int64_t tag : {int64_t(0), int64_t(-1), std::numeric_limits<int64_t>::min(), int64_t(123456789012345)}) {
    P2PHeader h;
    h.tag = tag;
    h.bytes = 0xfedcba9876543210ull;
    const auto b = h.encode();
    CHECK_EQ(b.size(), P2PHeader::kBytes);
    P2PHeader out;
    CHECK_EQ(P2PHeader::decode(b.data(), out), std::string());
    CHECK_EQ(out.tag, tag);
    CHECK_EQ(out.bytes, h.bytes);
  }
  P2PHeader h;
  auto b = h.encode();
  putU32(b, 0, kFrameMagic);
  P2PHeader out;
  CHECK(!P2PHeader::decode(b.data(), out).empty());
}
