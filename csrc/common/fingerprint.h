#pragma once
// FNV-1a over 64-bit words: the fingerprints of plans that every rank must agree on (carried in
// collective headers, so ranks holding different plans fail loudly).
#include <cstdint>
#include <cstring>

namespace hetcomm {

class Fingerprint {
 public:
  void mix(uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h_ ^= (v >> (8 * i)) & 0xff;
      h_ *= 1099511628211ull;
    }
  }
  void mixDouble(double d) {
    uint64_t bits;
    std::memcpy(&bits, &d, sizeof(bits));
    mix(bits);
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 1469598103934665603ull;
};

}  // namespace hetcomm
