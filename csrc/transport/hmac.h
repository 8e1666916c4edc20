#pragma once
// SHA-256 and HMAC-SHA-256 (FIPS 180-4, RFC 2104), self-contained: the connection handshake proves
// knowledge of the group secret with them (tcp_mesh.h), and it must work in a build or on a
// machine without OpenSSL. Not a general-purpose crypto library: only what the handshake needs,
// checked against the standards' test vectors (tests/cpp/test_framing.cc).
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>

namespace hetcomm {

using Sha256Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t len);
  Sha256Digest finish();

 private:
  void block(const uint8_t* p);
  std::array<uint32_t, 8> h_;
  std::array<uint8_t, 64> buf_{};
  size_t bufLen_ = 0;
  uint64_t totalBytes_ = 0;
};

Sha256Digest sha256(const void* data, size_t len);

// HMAC-SHA-256 of the concatenation of the given pieces.
struct Bytes {
  const void* data;
  size_t len;
};
Sha256Digest hmacSha256(const void* key, size_t keyLen, std::initializer_list<Bytes> message);

// PBKDF2-HMAC-SHA-256 (RFC 8018) with one block of output: slows down guessing a weak secret.
Sha256Digest pbkdf2Sha256(const void* password, size_t passwordLen, const void* salt, size_t saltLen,
                          uint32_t iterations);

// Compares in time independent of where the inputs differ.
bool constantTimeEqual(const uint8_t* a, const uint8_t* b, size_t len);

}  // namespace hetcomm
