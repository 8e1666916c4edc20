// The fp16 / bf16 conversions (csrc/kernels/dtype.h) against references written from the IEEE
// definitions: every 16-bit pattern, ties and neighbours, specials, and random floats.
#include <cfloat>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <random>

#include "check.h"
#include "kernels/dtype.h"
#include "reduce_test_data.h"

using namespace hetcomm;
using namespace hetcomm::test;

namespace {

uint32_t bitsOf(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
// --- independent references for the 16-bit formats ----------------------------------------------

// Value of a non-NaN half, from the IEEE definition. 0x7c00 (inf) maps to 65536 = 2^16, the value
// an exponent one past the largest would have: that is what round-to-nearest compares against.
double halfValue(uint16_t h) {
  const int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  double mag = exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, exp - 25);
  return (h & 0x8000) ? -mag : mag;
}

// Round-to-nearest-even float -> half by searching the (sorted) positive half values.
uint16_t refFloatToHalf(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) return sign | 0x7e00;
  const double a = std::fabs(static_cast<double>(f));
  uint16_t lo = 0, hi = 0x7c00;  // invariant: halfValue(lo) <= a < halfValue(hi), unless a >= 2^16
  if (a >= halfValue(0x7c00)) return sign | 0x7c00;
  while (hi - lo > 1) {
    const uint16_t mid = static_cast<uint16_t>((lo + hi) / 2);
    (halfValue(mid) <= a ? lo : hi) = mid;
  }
  const double dlo = a - halfValue(lo), dhi = halfValue(hi) - a;
  const uint16_t r = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) ? hi : lo);
  return sign | r;
}

double bf16Value(uint16_t b) {  // non-NaN; 0x7f80 (inf) maps to 2^128
  if ((b & 0x7fff) == 0x7f80) return (b & 0x8000) ? -std::ldexp(1.0, 128) : std::ldexp(1.0, 128);
  return static_cast<double>(floatOf(static_cast<uint32_t>(b) << 16));
}

uint16_t refFloatToBf16(float f) {
  if (std::isnan(f)) return 0xffff;  // any NaN; compared with isBf16NaN
  const uint32_t bits = bitsOf(f);
  const uint16_t lo = static_cast<uint16_t>(bits >> 16);  // truncation toward zero
  if ((lo & 0x7fff) == 0x7f80) return lo;                 // +-inf
  const uint16_t hi = static_cast<uint16_t>(lo + 1);
  const double a = std::fabs(static_cast<double>(f));
  const double dlo = a - std::fabs(bf16Value(lo)), dhi = std::fabs(bf16Value(hi)) - a;
  return dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) ? hi : lo);
}

}  // namespace

// ------------------------------------------------------------------------------------ conversions

TEST_CASE(half_to_float_all_patterns) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const float f = halfToFloat(h);
    if (isHalfNaN(h)) {
      CHECK_MSG(std::isnan(f) && std::signbit(f) == ((h & 0x8000) != 0), "h=0x", std::hex, h);
    } else {
      CHECK_MSG(bitsOf(f) == bitsOf(static_cast<float>(halfValue(h))) || (h & 0x7fff) == 0x7c00, "h=0x", std::hex, h,
                " got ", f, " want ", halfValue(h));
      if ((h & 0x7fff) == 0x7c00) CHECK_MSG(std::isinf(f) && std::signbit(f) == ((h & 0x8000) != 0), "h=0x", std::hex, h);
    }
  }
}

TEST_CASE(half_round_trip_all_patterns) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const uint16_t back = floatToHalf(halfToFloat(h));
    if (isHalfNaN(h)) {
      CHECK_MSG(isHalfNaN(back) && (back & 0x8000) == (h & 0x8000), "h=0x", std::hex, h, " back=0x", back);
    } else {
      CHECK_MSG(back == h, "h=0x", std::hex, h, " back=0x", back);
    }
  }
}

// For every pair of adjacent halves: the midpoint rounds to the even one, its float neighbours to
// the nearer one. Covers subnormals, the subnormal/normal boundary and overflow at 65520.
TEST_CASE(float_to_half_ties_and_neighbours) {
  for (uint16_t h = 0; h < 0x7c00; ++h) {
    const uint16_t next = static_cast<uint16_t>(h + 1);
    const float a = static_cast<float>(halfValue(h));
    const float mid = static_cast<float>((halfValue(h) + halfValue(next)) / 2);  // exact in float
    const uint16_t even = (h & 1) ? next : h;
    for (uint16_t sign : {uint16_t(0), uint16_t(0x8000)}) {
      const float s = sign ? -1.0f : 1.0f;
      CHECK_MSG(floatToHalf(s * a) == (sign | h), "value ", s * a);
      CHECK_MSG(floatToHalf(s * mid) == (sign | even), "tie ", s * mid, " got 0x", std::hex, floatToHalf(s * mid));
      CHECK_MSG(floatToHalf(s * std::nextafter(mid, 0.0f)) == (sign | h), "below tie ", s * mid);
      CHECK_MSG(floatToHalf(s * std::nextafter(mid, INFINITY)) == (sign | next), "above tie ", s * mid);
    }
  }
}

TEST_CASE(float_to_half_specials) {
  CHECK_EQ(floatToHalf(0.0f), 0x0000);
  CHECK_EQ(floatToHalf(-0.0f), 0x8000);
  CHECK_EQ(floatToHalf(1.0f), 0x3c00);
  CHECK_EQ(floatToHalf(65504.0f), 0x7bff);
  CHECK_EQ(floatToHalf(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  CHECK_EQ(floatToHalf(65520.0f), 0x7c00);  // tie between 65504 (odd) and 2^16: overflows
  CHECK_EQ(floatToHalf(1e10f), 0x7c00);
  CHECK_EQ(floatToHalf(-1e10f), 0xfc00);
  CHECK_EQ(floatToHalf(FLT_MAX), 0x7c00);
  CHECK_EQ(floatToHalf(INFINITY), 0x7c00);
  CHECK_EQ(floatToHalf(-INFINITY), 0xfc00);
  CHECK(isHalfNaN(floatToHalf(NAN)));
  CHECK(isHalfNaN(floatToHalf(floatOf(0x7f800001u))));  // signalling NaN with a low payload bit
  CHECK(isHalfNaN(floatToHalf(floatOf(0xff800001u))));
  CHECK_EQ(floatToHalf(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  CHECK_EQ(floatToHalf(std::ldexp(1.0f, -25)), 0x0000);  // tie with zero: even
  CHECK_EQ(floatToHalf(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  CHECK_EQ(floatToHalf(std::ldexp(1.5f, -24)), 0x0002);  // tie 1 / 2: even
  CHECK_EQ(floatToHalf(std::ldexp(2.5f, -24)), 0x0002);  // tie 2 / 3: even
  CHECK_EQ(floatToHalf(std::ldexp(1023.0f, -24)), 0x03ff);  // largest subnormal
  CHECK_EQ(floatToHalf(std::ldexp(1023.5f, -24)), 0x0400);  // tie into the smallest normal
  CHECK_EQ(floatToHalf(std::ldexp(1.0f, -14)), 0x0400);
  CHECK_EQ(floatToHalf(std::ldexp(-1.0f, -24)), 0x8001);
  CHECK_EQ(floatToHalf(1e-45f), 0x0000);  // float subnormal
  CHECK_EQ(floatToHalf(-1e-45f), 0x8000);
  CHECK_EQ(floatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie, even below
  CHECK_EQ(floatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie, even above
}

TEST_CASE(float_to_half_random_vs_reference) {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> inRange(-70000.0f, 70000.0f);
  for (int i = 0; i < 1000000; ++i) {
    const float f = (i % 2) ? floatOf(static_cast<uint32_t>(rng())) : inRange(rng) * std::ldexp(1.0f, -(i % 40));
    const uint16_t got = floatToHalf(f), want = refFloatToHalf(f);
    if (std::isnan(f)) {
      CHECK_MSG(isHalfNaN(got), "f bits 0x", std::hex, bitsOf(f));
    } else {
      CHECK_MSG(got == want, "f=", f, " (bits 0x", std::hex, bitsOf(f), ") got 0x", got, " want 0x", want);
    }
  }
}

TEST_CASE(bf16_round_trip_all_patterns) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t b = static_cast<uint16_t>(i);
    const float f = bf16ToFloat(b);
    CHECK_EQ(bitsOf(f), static_cast<uint32_t>(b) << 16);
    const uint16_t back = floatToBf16(f);
    if (isBf16NaN(b)) {
      CHECK_MSG(isBf16NaN(back) && (back & 0x8000) == (b & 0x8000), "b=0x", std::hex, b, " back=0x", back);
    } else {
      CHECK_MSG(back == b, "b=0x", std::hex, b, " back=0x", back);
    }
  }
}

TEST_CASE(float_to_bf16_rounding) {
  CHECK_EQ(floatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie, even below
  CHECK_EQ(floatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie, even above
  CHECK_EQ(floatToBf16(FLT_MAX), 0x7f80);                           // overflows to inf
  CHECK_EQ(floatToBf16(-FLT_MAX), 0xff80);
  CHECK_EQ(floatToBf16(floatOf(0x7f7f7fffu)), 0x7f7f);              // just below the tie with inf
  CHECK_EQ(floatToBf16(floatOf(0x7f7f8000u)), 0x7f80);              // tie, even is inf
  CHECK_EQ(floatToBf16(floatOf(0x00000001u)), 0x0000);              // float subnormals
  CHECK_EQ(floatToBf16(floatOf(0x00008001u)), 0x0001);
  CHECK_EQ(floatToBf16(floatOf(0x80018000u)), 0x8002);
  CHECK(isBf16NaN(floatToBf16(floatOf(0x7f800001u))));  // NaN whose payload lives in the low half
  CHECK(isBf16NaN(floatToBf16(floatOf(0xff800001u))));
  CHECK_EQ(floatToBf16(floatOf(0xff800001u)) & 0x8000, 0x8000);
  std::mt19937 rng(99);
  for (int i = 0; i < 1000000; ++i) {
    const float f = floatOf(static_cast<uint32_t>(rng()));
    const uint16_t got = floatToBf16(f);
    if (std::isnan(f)) {
      CHECK_MSG(isBf16NaN(got), "bits 0x", std::hex, bitsOf(f));
    } else {
      CHECK_MSG(got == refFloatToBf16(f), "bits 0x", std::hex, bitsOf(f), " got 0x", got);
    }
  }
}

