#pragma once
// Element types and reduction ops the core understands, independent of torch headers so that the
// kernels, the ring schedule and their C++ tests build without Python.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace hetcomm {

enum class DType : uint8_t { kFloat32, kFloat64, kFloat16, kBFloat16, kInt8, kUInt8, kInt32, kInt64, kBool };
// kAvg is carried on the wire as a SUM, with a division by the world size before it (fp16/bf16)
// or after it (avgScalesInputs in reduce.h).
enum class RedOp : uint8_t { kSum, kAvg, kProduct, kMin, kMax, kBand, kBor, kBxor };

size_t elementSize(DType t);
const char* dtypeName(DType t);
const char* redOpName(RedOp op);
bool isFloating(DType t);

// fp16 / bf16 <-> fp32, round to nearest even (NaN stays NaN).
float halfToFloat(uint16_t h);
uint16_t floatToHalf(float f);
inline float bf16ToFloat(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline uint16_t floatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace hetcomm
