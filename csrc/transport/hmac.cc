#include "transport/hmac.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>

namespace hetcomm {
namespace {

constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

}  // namespace

Sha256::Sha256()
    : h_{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19} {}

void Sha256::block(const uint8_t* p) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i) {
    w[i] = (uint32_t{p[4 * i]} << 24) | (uint32_t{p[4 * i + 1]} << 16) | (uint32_t{p[4 * i + 2]} << 8) | p[4 * i + 3];
  }
  for (int i = 16; i < 64; ++i) {
    const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
  for (int i = 0; i < 64; ++i) {
    const uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[i] + w[i];
    const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h_[0] += a, h_[1] += b, h_[2] += c, h_[3] += d, h_[4] += e, h_[5] += f, h_[6] += g, h_[7] += h;
}

void Sha256::update(const void* data, size_t len) {
  const auto* p = static_cast<const uint8_t*>(data);
  totalBytes_ += len;
  while (len > 0) {
    const size_t take = std::min(len, buf_.size() - bufLen_);
    std::memcpy(buf_.data() + bufLen_, p, take);
    bufLen_ += take;
    p += take;
    len -= take;
    if (bufLen_ == buf_.size()) {
      block(buf_.data());
      bufLen_ = 0;
    }
  }
}

Sha256Digest Sha256::finish() {
  const uint64_t bits = totalBytes_ * 8;
  const uint8_t one = 0x80, zero = 0;
  update(&one, 1);
  while (bufLen_ != 56) update(&zero, 1);
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
  update(len, 8);
  Sha256Digest out;
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<uint8_t>(h_[i] >> (24 - 8 * j));
  }
  return out;
}

Sha256Digest sha256(const void* data, size_t len) {
  Sha256 s;
  s.update(data, len);
  return s.finish();
}

namespace {

// HMAC's key as one block: hashed when longer, zero-padded.
std::array<uint8_t, 64> blockKey(const void* key, size_t keyLen) {
  std::array<uint8_t, 64> k{};
  if (keyLen > k.size()) {
    const Sha256Digest d = sha256(key, keyLen);
    std::memcpy(k.data(), d.data(), d.size());
  } else if (keyLen > 0) {
    std::memcpy(k.data(), key, keyLen);
  }
  return k;
}

}  // namespace

Sha256Digest hmacSha256(const void* key, size_t keyLen, std::initializer_list<Bytes> message) {
  const std::array<uint8_t, 64> k = blockKey(key, keyLen);
  std::array<uint8_t, 64> pad;
  for (size_t i = 0; i < pad.size(); ++i) pad[i] = k[i] ^ 0x36;
  Sha256 inner;
  inner.update(pad.data(), pad.size());
  for (const Bytes& b : message) inner.update(b.data, b.len);
  const Sha256Digest innerDigest = inner.finish();
  for (size_t i = 0; i < pad.size(); ++i) pad[i] = k[i] ^ 0x5c;
  Sha256 outer;
  outer.update(pad.data(), pad.size());
  outer.update(innerDigest.data(), innerDigest.size());
  return outer.finish();
}

Sha256Digest pbkdf2Sha256(const void* password, size_t passwordLen, const void* salt, size_t saltLen,
                          uint32_t iterations) {
  const std::array<uint8_t, 64> k = blockKey(password, passwordLen);
  // The padded keys' states once, copied for every HMAC of the chain.
  std::array<uint8_t, 64> pad;
  for (size_t i = 0; i < pad.size(); ++i) pad[i] = k[i] ^ 0x36;
  Sha256 innerStart;
  innerStart.update(pad.data(), pad.size());
  for (size_t i = 0; i < pad.size(); ++i) pad[i] = k[i] ^ 0x5c;
  Sha256 outerStart;
  outerStart.update(pad.data(), pad.size());
  auto hmac = [&](const uint8_t* a, size_t aLen, const uint8_t* b, size_t bLen) {
    Sha256 inner = innerStart;
    inner.update(a, aLen);
    if (bLen > 0) inner.update(b, bLen);
    const Sha256Digest d = inner.finish();
    Sha256 outer = outerStart;
    outer.update(d.data(), d.size());
    return outer.finish();
  };
  const uint8_t blockIndex[4] = {0, 0, 0, 1};
  Sha256Digest u = hmac(static_cast<const uint8_t*>(salt), saltLen, blockIndex, 4);
  Sha256Digest out = u;
  for (uint32_t i = 1; i < iterations; ++i) {
    u = hmac(u.data(), u.size(), nullptr, 0);
    for (size_t j = 0; j < out.size(); ++j) out[j] ^= u[j];
  }
  return out;
}

bool constantTimeEqual(const uint8_t* a, const uint8_t* b, size_t len) {
  uint8_t diff = 0;
  for (size_t i = 0; i < len; ++i) diff |= static_cast<uint8_t>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace hetcomm
