#pragma once
// Test data for the reduce kernels, shared by the CPU test (test_reduce.cc) and the CUDA test
// (test_reduce_cuda.cu): every dtype and op, and operands with the special values mixed in.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/error.h"
#include "kernels/dtype.h"
#include "kernels/reduce.h"

namespace hetcomm {
namespace test {

inline constexpr DType kAllDTypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16, DType::kInt8,
                                       DType::kUInt8,   DType::kInt32,   DType::kInt64,   DType::kBool};
inline constexpr RedOp kAllOps[] = {RedOp::kSum, RedOp::kAvg,  RedOp::kProduct, RedOp::kMin,
                                    RedOp::kMax, RedOp::kBand, RedOp::kBor,     RedOp::kBxor};

// Bits of 16- and 32-bit floats (test_reduce.cc, test_half_formats.cc).
inline float floatOf(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline bool isHalfNaN(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }
inline bool isBf16NaN(uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0; }

inline bool supported(DType t, RedOp op) {
  try {
    checkReduceSupported(t, op);
    return true;
  } catch (const CommError&) {
    return false;
  }
}

// Random element bit patterns per dtype, with the special values mixed in.
inline std::vector<uint8_t> randomData(DType t, size_t n, std::mt19937_64& rng, bool withNaN = true) {
  const size_t es = elementSize(t);
  std::vector<uint8_t> out(n * es);
  std::uniform_real_distribution<double> val(-100.0, 100.0);
  for (size_t i = 0; i < n; ++i) {
    uint8_t* p = out.data() + i * es;
    const unsigned pick = static_cast<unsigned>(rng() % 16);
    switch (t) {
      case DType::kFloat32: case DType::kFloat64: case DType::kFloat16: case DType::kBFloat16: {
        static const double kSpecial[] = {0.0, -0.0, INFINITY, -INFINITY, 1e-40, -3e-310, 1e300, 65504.0, NAN};
        double v = pick < 9 ? kSpecial[pick] : val(rng);
        if (!withNaN && std::isnan(v)) v = 1.5;
        if (t == DType::kFloat64) std::memcpy(p, &v, 8);
        const float f = static_cast<float>(v);
        if (t == DType::kFloat32) std::memcpy(p, &f, 4);
        if (t == DType::kFloat16) { const uint16_t h = floatToHalf(f); std::memcpy(p, &h, 2); }
        if (t == DType::kBFloat16) { const uint16_t b = floatToBf16(f); std::memcpy(p, &b, 2); }
        break;
      }
      case DType::kBool: {
        static const uint8_t kBool[] = {0, 1, 2, 255};  // non-canonical "true"s too
        p[0] = kBool[pick % 4];
        break;
      }
      default: {  // integers: uniform bits, with extremes and zero mixed in
        uint64_t bits = rng();
        if (pick == 0) bits = 0;
        if (pick == 1) bits = ~uint64_t(0);                // -1 / max unsigned
        if (pick == 2) bits = uint64_t(1) << (8 * es - 1);  // min signed
        if (pick == 3) bits = (uint64_t(1) << (8 * es - 1)) - 1;
        if (pick == 4) bits = 1;
        std::memcpy(p, &bits, es);  // little-endian: low bytes
      }
    }
  }
  return out;
}

// Operands from a pool of interesting values, so that equal-but-different pairs (+0 / -0) occur.
// A single NaN bit pattern: with two different NaN payloads even IEEE addition is not bitwise
// symmetric on common hardware.
inline std::vector<uint8_t> poolData(DType t, size_t n, std::mt19937_64& rng) {
  static const double kPool[] = {0.0, -0.0, 1.0, -1.0, 2.5, -2.5, INFINITY, -INFINITY, 1e-40, NAN};
  const size_t es = elementSize(t);
  if (!isFloating(t)) return randomData(t, n, rng);
  std::vector<uint8_t> out(n * es);
  for (size_t i = 0; i < n; ++i) {
    const double v = kPool[rng() % 10];
    const float f = static_cast<float>(v);
    uint8_t* p = out.data() + i * es;
    if (t == DType::kFloat64) std::memcpy(p, &v, 8);
    if (t == DType::kFloat32) std::memcpy(p, &f, 4);
    if (t == DType::kFloat16) { const uint16_t h = floatToHalf(f); std::memcpy(p, &h, 2); }
    if (t == DType::kBFloat16) { const uint16_t b = floatToBf16(f); std::memcpy(p, &b, 2); }
  }
  return out;
}

}  // namespace test
}  // namespace hetcomm
