// Wire formats (csrc/transport/framing).
#include <algorithm>
#include <cstring>
#include <limits>

#include "check.h"
#include "transport/framing.h"
#include "transport/hmac.h"
#include "transport/tcp_mesh.h"

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
      for (size_t i = 0; i < kNonceBytes; ++i) h.nonce[i] = static_cast<uint8_t>(0xa0 + 13 * i);
      const auto bytes = h.encode();
      CHECK_EQ(bytes.size(), Hello::kBytes);
      Hello out;
      CHECK_EQ(Hello::decode(bytes.data(), out), std::string());
      CHECK_EQ(out.version, kWireVersion);
      CHECK(out.channel == ch);
      CHECK_EQ(out.rank, rank);
      CHECK_EQ(out.worldSize, 1 << 20);
      CHECK(out.nonce == h.nonce);
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

namespace {
std::string hex(const Sha256Digest& d) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  for (uint8_t b : d) {
    out += kDigits[b >> 4];
    out += kDigits[b & 15];
  }
  return out;
}
}  // namespace

TEST_CASE(sha256_matches_the_standard_vectors) {
  CHECK_EQ(hex(sha256("", 0)), std::string("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"));
  CHECK_EQ(hex(sha256("abc", 3)), std::string("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"));
  const std::string two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";  // 448 bits: padding spills over
  CHECK_EQ(hex(sha256(two.data(), two.size())),
           std::string("248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"));
  const std::string million(1000000, 'a');
  Sha256 pieces;  // fed in odd pieces: the block buffer must carry over
  for (size_t at = 0; at < million.size(); at += 997) pieces.update(million.data() + at, std::min<size_t>(997, million.size() - at));
  CHECK_EQ(hex(pieces.finish()), std::string("cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"));
}

TEST_CASE(hmac_sha256_matches_rfc_4231) {
  // Test case 1: a 20-byte key of 0x0b, "Hi There".
  const std::string key1(20, '\x0b');
  CHECK_EQ(hex(hmacSha256(key1.data(), key1.size(), {{"Hi There", 8}})),
           std::string("b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"));
  // Test case 2: key "Jefe", the message in two pieces.
  CHECK_EQ(hex(hmacSha256("Jefe", 4, {{"what do ya want ", 16}, {"for nothing?", 12}})),
           std::string("5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"));
  // Test case 6: a 131-byte key (longer than a block: hashed first).
  const std::string key6(131, '\xaa');
  const std::string msg6 = "Test Using Larger Than Block-Size Key - Hash Key First";
  CHECK_EQ(hex(hmacSha256(key6.data(), key6.size(), {{msg6.data(), msg6.size()}})),
           std::string("60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"));
}

TEST_CASE(challenge_round_trip_and_rejects_garbage) {
  Challenge c;
  c.rank = 9;
  c.nonce = freshNonce();
  for (size_t i = 0; i < kMacBytes; ++i) c.mac[i] = static_cast<uint8_t>(i * 7);
  const auto b = c.encode();
  Challenge out;
  CHECK_EQ(Challenge::decode(b.data(), out), std::string());
  CHECK_EQ(out.rank, 9);
  CHECK(out.nonce == c.nonce);
  CHECK(out.mac == c.mac);
  auto bad = b;
  putU32(bad, 0, kHelloMagic);
  CHECK(!Challenge::decode(bad.data(), out).empty());
}

TEST_CASE(handshake_macs_bind_the_secret_both_nonces_and_the_role) {
  std::array<uint8_t, kSecretBytes> secret{}, other{};
  for (size_t i = 0; i < secret.size(); ++i) {
    secret[i] = static_cast<uint8_t>(i);
    other[i] = static_cast<uint8_t>(i + (i == 5));
  }
  Hello h;
  h.rank = 1;
  h.worldSize = 2;
  h.nonce = freshNonce();
  const auto hello = h.encode();
  Challenge c;
  c.rank = 0;
  c.nonce = freshNonce();
  const auto accept = handshakeMac(HandshakeRole::kAcceptor, secret, hello, c);
  const auto connect = handshakeMac(HandshakeRole::kConnector, secret, hello, c);
  CHECK(accept != connect);  // one side's proof cannot be reflected as the other's
  CHECK(connect != handshakeMac(HandshakeRole::kConnector, other, hello, c));  // one bit of the secret
  Challenge fresh = c;
  fresh.nonce = freshNonce();  // a replayed proof meets a new challenge
  CHECK(fresh.nonce != c.nonce);
  CHECK(connect != handshakeMac(HandshakeRole::kConnector, secret, hello, fresh));
  Hello h2 = h;
  h2.nonce = freshNonce();
  CHECK(accept != handshakeMac(HandshakeRole::kAcceptor, secret, h2.encode(), c));
  // The claimed rank (and world size) are bound: a proof made for rank 1 is no proof for rank 0,
  // and the acceptor's proof names the rank it answers as.
  Hello claimed = h;
  claimed.rank = 0;
  CHECK(connect != handshakeMac(HandshakeRole::kConnector, secret, claimed.encode(), c));
  Hello wider = h;
  wider.worldSize = 3;
  CHECK(connect != handshakeMac(HandshakeRole::kConnector, secret, wider.encode(), c));
  Challenge asOther = c;
  asOther.rank = 2;
  CHECK(accept != handshakeMac(HandshakeRole::kAcceptor, secret, hello, asOther));
  // The secret itself never appears in what goes on the wire.
  const auto wire = c.encode();
  CHECK(std::search(hello.begin(), hello.end(), secret.begin(), secret.end()) == hello.end());
  CHECK(std::search(wire.begin(), wire.end(), secret.begin(), secret.end()) == wire.end());
}
