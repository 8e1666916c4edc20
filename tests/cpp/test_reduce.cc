// Reduce kernels (csrc/kernels); the fp16 / bf16 conversions: test_half_formats.cc.
#include <cfloat>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <limits>
#include <random>
#include <vector>

#include "check.h"
#include "common/error.h"
#include "kernels/dtype.h"
#include "kernels/reduce.h"
#include "reduce_test_data.h"

using namespace hetcomm;
using namespace hetcomm::test;

namespace {

const size_t kCounts[] = {0, 1, 7, 1023, 4099};

}  // namespace

// --------------------------------------------------------------------------------- reduce kernels

namespace {

template <typename T>
T loadAs(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename F>
F refFloatOp(F a, F b, RedOp op) {
  switch (op) {
    case RedOp::kSum: case RedOp::kAvg: return a + b;
    case RedOp::kProduct: return a * b;
    case RedOp::kMin: return (std::isnan(a) || std::isnan(b)) ? std::numeric_limits<F>::quiet_NaN() : (b < a ? b : a);
    case RedOp::kMax: return (std::isnan(a) || std::isnan(b)) ? std::numeric_limits<F>::quiet_NaN() : (b > a ? b : a);
    default: return 0;
  }
}

template <typename T>
T refIntOp(T a, T b, RedOp op) {
  using U = std::make_unsigned_t<T>;
  switch (op) {
    case RedOp::kSum: case RedOp::kAvg: return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    case RedOp::kProduct: return static_cast<T>(static_cast<U>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b)));
    case RedOp::kMin: return b < a ? b : a;
    case RedOp::kMax: return b > a ? b : a;
    case RedOp::kBand: return a & b;
    case RedOp::kBor: return a | b;
    case RedOp::kBxor: return a ^ b;
  }
  return 0;
}

// fp16/bf16 combine in fp32; their AVG saturates a finite sum at the format's largest value
// (reduce.h), the rest rounds as SUM does.
float ref16(float a, float b, RedOp op, float maxFinite) {
  const float r = refFloatOp(a, b, op);
  if (op != RedOp::kAvg || std::isnan(r) || std::isinf(r)) return r;
  return std::fmax(-maxFinite, std::fmin(maxFinite, r));
}
const float kHalfMax = 65504.0f;
const float kBf16Max = floatOf(0x7f7f0000u);

// Expected result of op(a, b) for one element; returns a description of the mismatch or "".
std::string checkElement(DType t, RedOp op, const uint8_t* a, const uint8_t* b, const uint8_t* got) {
  auto floatCmp = [&](double want, double g, bool nanWant) -> std::string {
    if (nanWant ? std::isnan(g) : (g == want && std::signbit(g) == std::signbit(want))) return "";
    if (!nanWant && g == want && (op == RedOp::kMin || op == RedOp::kMax) && want == 0) return "";  // +-0: see symmetry test
    return strCat("want ", want, " got ", g);
  };
  switch (t) {
    case DType::kFloat32: {
      const float w = refFloatOp(loadAs<float>(a), loadAs<float>(b), op);
      return floatCmp(w, loadAs<float>(got), std::isnan(w));
    }
    case DType::kFloat64: {
      const double w = refFloatOp(loadAs<double>(a), loadAs<double>(b), op);
      return floatCmp(w, loadAs<double>(got), std::isnan(w));
    }
    case DType::kFloat16: {
      const uint16_t w = floatToHalf(ref16(halfToFloat(loadAs<uint16_t>(a)), halfToFloat(loadAs<uint16_t>(b)), op, kHalfMax));
      return floatCmp(halfToFloat(w), halfToFloat(loadAs<uint16_t>(got)), isHalfNaN(w));
    }
    case DType::kBFloat16: {
      const uint16_t w = floatToBf16(ref16(bf16ToFloat(loadAs<uint16_t>(a)), bf16ToFloat(loadAs<uint16_t>(b)), op, kBf16Max));
      return floatCmp(bf16ToFloat(w), bf16ToFloat(loadAs<uint16_t>(got)), isBf16NaN(w));
    }
    case DType::kBool: {
      const bool x = a[0] != 0, y = b[0] != 0;
      bool w = false;
      if (op == RedOp::kSum || op == RedOp::kMax || op == RedOp::kBor) w = x || y;
      if (op == RedOp::kProduct || op == RedOp::kMin || op == RedOp::kBand) w = x && y;
      if (op == RedOp::kBxor) w = x != y;
      return got[0] == static_cast<uint8_t>(w) ? "" : strCat("want ", int(w), " got ", int(got[0]), " (canonical 0/1)");
    }
#define HC_INT_CASE(D, T)                                                                   \
  case D: {                                                                                 \
    const T w = refIntOp<T>(loadAs<T>(a), loadAs<T>(b), op), g = loadAs<T>(got);           \
    return w == g ? "" : strCat("want ", static_cast<long long>(w), " got ", static_cast<long long>(g)); \
  }
    HC_INT_CASE(DType::kInt8, int8_t)
    HC_INT_CASE(DType::kUInt8, uint8_t)
    HC_INT_CASE(DType::kInt32, int32_t)
    HC_INT_CASE(DType::kInt64, int64_t)
#undef HC_INT_CASE
  }
  return "unknown dtype";
}

}  // namespace

// Every supported dtype x op against a reference, for counts that exercise the vector tails and a
// misaligned start; the bytes around the range must stay untouched.
TEST_CASE(reduce_every_dtype_and_op) {
  std::mt19937_64 rng(7);
  for (DType t : kAllDTypes) {
    const size_t es = elementSize(t);
    for (RedOp op : kAllOps) {
      if (!supported(t, op)) continue;
      for (size_t n : kCounts) {
        for (size_t misalign : {size_t(0), size_t(1)}) {
          const size_t guard = 3;
          std::vector<uint8_t> a = randomData(t, n + 2 * guard, rng), b = randomData(t, n + 2 * guard, rng);
          std::vector<uint8_t> dst = a;
          const size_t start = (guard - misalign) * es;
          reduceInto(dst.data() + start, b.data() + start, n, t, op);
          int reported = 0;
          for (size_t i = 0; i < n + 2 * guard; ++i) {
            const size_t off = i * es;
            const bool inside = off >= start && off < start + n * es;
            std::string err = inside ? checkElement(t, op, &a[off], &b[off], &dst[off])
                                     : (std::memcmp(&a[off], &dst[off], es) == 0 ? "" : "byte outside the range changed");
            if (!err.empty() && reported++ < 3) {
              CHECK_MSG(err.empty(), dtypeName(t), " ", redOpName(op), " n=", n, " misalign=", misalign, " i=", i, ": ", err);
            }
          }
        }
      }
    }
  }
}

TEST_CASE(min_max_propagate_nan) {
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    for (RedOp op : {RedOp::kMin, RedOp::kMax}) {
      // NaN in dst, in src, in both; against small, large, infinite values.
      const float xs[] = {0.0f, -1.0f, 3.0f, INFINITY, -INFINITY};
      for (float x : xs) {
        for (int where = 0; where < 3; ++where) {
          const float a = where != 1 ? NAN : x, b = where != 0 ? NAN : x;
          double got = 0;
          if (t == DType::kFloat32) { float d = a; reduceInto(&d, &b, 1, t, op); got = d; }
          if (t == DType::kFloat64) { double d = a, s = b; reduceInto(&d, &s, 1, t, op); got = d; }
          if (t == DType::kFloat16) {
            uint16_t d = floatToHalf(a), s = floatToHalf(b);
            reduceInto(&d, &s, 1, t, op);
            got = halfToFloat(d);
          }
          if (t == DType::kBFloat16) {
            uint16_t d = floatToBf16(a), s = floatToBf16(b);
            reduceInto(&d, &s, 1, t, op);
            got = bf16ToFloat(d);
          }
          CHECK_MSG(std::isnan(got), dtypeName(t), " ", redOpName(op), "(", a, ", ", b, ") = ", got);
        }
      }
    }
  }
}

TEST_CASE(bool_results_are_canonical) {
  const uint8_t vals[] = {0, 1, 2, 128, 255};
  for (RedOp op : kAllOps) {
    if (op == RedOp::kAvg) continue;
    for (uint8_t a : vals) {
      for (uint8_t b : vals) {
        uint8_t d = a;
        reduceInto(&d, &b, 1, DType::kBool, op);
        const bool x = a != 0, y = b != 0;
        const bool w = (op == RedOp::kSum || op == RedOp::kMax || op == RedOp::kBor) ? (x || y)
                       : (op == RedOp::kBxor)                                      ? (x != y)
                                                                                   : (x && y);
        CHECK_MSG(d == static_cast<uint8_t>(w), redOpName(op), "(", a, ", ", b, ") = ", d);
      }
    }
  }
  uint8_t d = 1, s = 1;
  CHECK_THROWS_AS(reduceInto(&d, &s, 1, DType::kBool, RedOp::kAvg), CommError);
}

TEST_CASE(integer_edge_cases) {
  int8_t a8[] = {127, -128, -128, 127, -1};
  const int8_t b8[] = {1, -1, 127, 127, -1};
  reduceInto(a8, b8, 5, DType::kInt8, RedOp::kSum);
  CHECK_EQ(a8[0], -128);
  CHECK_EQ(a8[1], 127);
  CHECK_EQ(a8[2], -1);
  CHECK_EQ(a8[3], -2);
  CHECK_EQ(a8[4], -2);
  uint8_t u[] = {200, 0, 255};
  const uint8_t v[] = {100, 255, 255};
  reduceInto(u, v, 3, DType::kUInt8, RedOp::kMin);
  CHECK_EQ(u[0], 100);
  CHECK_EQ(u[1], 0);
  CHECK_EQ(u[2], 255);
  int64_t x[] = {std::numeric_limits<int64_t>::min(), 3, -5};
  const int64_t y[] = {std::numeric_limits<int64_t>::max(), -7, 6};
  reduceInto(x, y, 3, DType::kInt64, RedOp::kMax);
  CHECK_EQ(x[0], std::numeric_limits<int64_t>::max());
  CHECK_EQ(x[1], 3);
  CHECK_EQ(x[2], 6);
  int32_t p[] = {65536, -3};
  const int32_t q[] = {65536, 7};
  reduceInto(p, q, 2, DType::kInt32, RedOp::kProduct);  // 2^32 wraps to 0
  CHECK_EQ(p[0], 0);
  CHECK_EQ(p[1], -21);
}

// reduce.h: "The op is symmetric in its arguments, bit for bit".
TEST_CASE(reduce_is_bitwise_symmetric) {
  std::mt19937_64 rng(11);
  for (DType t : kAllDTypes) {
    const size_t es = elementSize(t);
    for (RedOp op : kAllOps) {
      if (!supported(t, op)) continue;
      const size_t n = 1023;
      std::vector<uint8_t> a = poolData(t, n, rng), b = poolData(t, n, rng);
      std::vector<uint8_t> ab = a, ba = b;
      reduceInto(ab.data(), b.data(), n, t, op);
      reduceInto(ba.data(), a.data(), n, t, op);
      int reported = 0;
      for (size_t i = 0; i < n; ++i) {
        if (std::memcmp(&ab[i * es], &ba[i * es], es) != 0 && reported++ < 2) {
          auto hex = [&](const std::vector<uint8_t>& v) {  // the element's bits, most significant first
            std::string s = "0x";
            for (size_t k = es; k-- > 0;) s += strCat(std::hex, std::setw(2), std::setfill('0'), int(v[i * es + k]));
            return s;
          };
          CHECK_MSG(false, dtypeName(t), " ", redOpName(op), ": op(a=", hex(a), ", b=", hex(b), ") = ", hex(ab),
                    " but op(b, a) = ", hex(ba));
        }
      }
    }
  }
}

TEST_CASE(check_reduce_supported) {
  for (DType t : kAllDTypes) {
    for (RedOp op : kAllOps) {
      const bool bitwise = op == RedOp::kBand || op == RedOp::kBor || op == RedOp::kBxor;
      const bool bad = (bitwise && isFloating(t)) || (op == RedOp::kAvg && !isFloating(t));
      if (bad) {
        CHECK_THROWS_AS(checkReduceSupported(t, op), CommError);
        try {
          checkReduceSupported(t, op);
        } catch (const CommError& e) {  // the message names the op and the dtype
          CHECK_MSG(std::string(e.what()).find(redOpName(op)) != std::string::npos &&
                        std::string(e.what()).find(dtypeName(t)) != std::string::npos,
                    e.what());
        }
      } else {
        CHECK_NOTHROW(checkReduceSupported(t, op));
      }
    }
  }
  // The kernels refuse bitwise ops on floats too, rather than reinterpreting bits.
  float f = 1, g = 2;
  CHECK_THROWS_AS(reduceInto(&f, &g, 1, DType::kFloat32, RedOp::kBxor), CommError);
  uint16_t h = 0, k = 0;
  CHECK_THROWS_AS(reduceInto(&h, &k, 1, DType::kFloat16, RedOp::kBand), CommError);
}

TEST_CASE(divide_in_place) {
  float f[] = {3.0f, -8.0f, 1.0f};
  divideInPlace(f, 3, DType::kFloat32, 4.0);
  CHECK_EQ(f[0], 0.75f);
  CHECK_EQ(f[1], -2.0f);
  CHECK_EQ(f[2], 0.25f);
  double d[] = {1.0, 7.0};
  divideInPlace(d, 2, DType::kFloat64, 3.0);
  CHECK_EQ(d[0], 1.0 / 3.0);
  CHECK_EQ(d[1], 7.0 / 3.0);
  uint16_t h[] = {floatToHalf(6.0f), floatToHalf(1.0f)};
  divideInPlace(h, 2, DType::kFloat16, 3.0);
  CHECK_EQ(h[0], floatToHalf(2.0f));
  CHECK_EQ(h[1], floatToHalf(1.0f / 3.0f));
  uint16_t b[] = {floatToBf16(10.0f)};
  divideInPlace(b, 1, DType::kBFloat16, 4.0);
  CHECK_EQ(b[0], floatToBf16(2.5f));
  int32_t i[] = {4};
  CHECK_THROWS_AS(divideInPlace(i, 1, DType::kInt32, 2.0), CommError);
  uint8_t z[] = {1};
  CHECK_THROWS_AS(divideInPlace(z, 1, DType::kBool, 2.0), CommError);
  divideInPlace(nullptr, 0, DType::kFloat32, 2.0);  // empty is fine
}

// --------------------------------------------------------------- AVG of 16-bit floats (issue 22)

namespace {

struct Format16 {
  DType dtype;
  float (*toFloat)(uint16_t);
  uint16_t (*fromFloat)(float);
  float maxFinite;
  std::vector<float> values;  // near the largest finite value, mixed signs, ordinary ones
};

std::vector<Format16> formats16() {
  return {{DType::kFloat16, halfToFloat, floatToHalf, kHalfMax, {40000.0f, 65504.0f, -65504.0f, 60000.0f, -1.0f, 0.0f}},
          {DType::kBFloat16, bf16ToFloat, floatToBf16, kBf16Max, {3e38f, kBf16Max, -kBf16Max, -3e38f, 1e38f, 1.0f}}};
}

// n elements cycling through `values`, rank r's copy with every other element's sign flipped for
// odd ranks from the second element on (so the inputs of a group differ and have mixed signs).
std::vector<uint16_t> rankInput(const Format16& f, size_t n, int r) {
  std::vector<uint16_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    const float v = f.values[i % f.values.size()];
    out[i] = f.fromFloat((r % 2 == 1 && i % 2 == 1) ? -v : v);
  }
  return out;
}

// The average's bound: P roundings of at most half an ulp of the largest input's magnitude.
void checkAverage(const Format16& f, const std::vector<std::vector<uint16_t>>& inputs, const std::vector<uint16_t>& got,
                  const char* what) {
  const int P = static_cast<int>(inputs.size());
  const double u = f.dtype == DType::kFloat16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    double sum = 0, scale = 0;
    for (const auto& x : inputs) {
      sum += f.toFloat(x[i]);
      scale = std::max(scale, std::fabs(static_cast<double>(f.toFloat(x[i]))));
    }
    const double exact = sum / P, g = f.toFloat(got[i]);
    if ((std::isfinite(g) && std::fabs(g - exact) <= P * u * scale) || reported++ >= 3) continue;
    CHECK_MSG(false, what, " ", dtypeName(f.dtype), " P=", P, " element ", i, ": got ", g, " for the average ", exact);
  }
}

}  // namespace

// The ring's AVG of fp16/bf16: every rank divides its contribution by P (divideInPlace), then the
// partial sums travel in the format, combined with reduceInto(kAvg) hop by hop. No partial sum
// may overflow where the average is representable: three fp16 ranks averaging 65504 add 21840
// three times (65520, which rounds to inf unless AVG saturates). Counts cover the F16C lanes and
// the scalar tail.
TEST_CASE(avg_of_prescaled_16_bit_values_does_not_overflow) {
  for (const Format16& f : formats16()) {
    for (int P : {2, 3, 4}) {
      for (size_t n : {size_t(1), size_t(6), size_t(37)}) {
        std::vector<std::vector<uint16_t>> inputs, scaled;
        for (int r = 0; r < P; ++r) {
          inputs.push_back(rankInput(f, n, r));
          scaled.push_back(inputs.back());
          divideInPlace(scaled.back().data(), n, f.dtype, P);
        }
        std::vector<uint16_t> chain = scaled[0];  // a ring's partial sum, hop by hop
        for (int r = 1; r < P; ++r) reduceInto(chain.data(), scaled[r].data(), n, f.dtype, RedOp::kAvg);
        checkAverage(f, inputs, chain, "ring chain");
        if (f.dtype == DType::kFloat16) {  // the example: 40000 averages to 40000 exactly
          for (size_t i = 0; i < n; i += f.values.size()) CHECK_EQ(halfToFloat(chain[i]), 40000.0f);
        }
        std::vector<uint16_t> many(n);  // shared memory: one kernel over every contribution
        std::vector<const void*> srcs;
        for (const auto& x : inputs) srcs.push_back(x.data());
        reduceMany(many.data(), srcs.data(), P, n, f.dtype, RedOp::kAvg, P);
        checkAverage(f, inputs, many, "reduceMany");
        std::vector<const void*> scaledSrcs;  // the host level: pre-scaled inputs summed in fp32
        for (const auto& x : scaled) scaledSrcs.push_back(x.data());
        reduceMany(many.data(), scaledSrcs.data(), P, n, f.dtype, RedOp::kAvg, 0.0);
        checkAverage(f, inputs, many, "reduceMany of pre-scaled inputs");
      }
    }
  }
}

// Only AVG saturates, and only finite sums; SUM overflows to inf as before, inf and NaN pass.
TEST_CASE(avg_saturates_only_finite_16_bit_sums) {
  for (const Format16& f : formats16()) {
    const float top = f.maxFinite;
    const float as[] = {top, -top, top, INFINITY, -INFINITY, NAN, top};
    const float bs[] = {top, -top, 1.0f, 1.0f, top, 1.0f, -top};
    const float avg[] = {top, -top, top, INFINITY, -INFINITY, NAN, 0.0f};
    const float sum[] = {INFINITY, -INFINITY, top, INFINITY, -INFINITY, NAN, 0.0f};
    for (size_t n : {size_t(7), size_t(16)}) {  // scalar, and F16C lanes plus a tail
      std::vector<uint16_t> a(n), b(n), forAvg(n), forSum(n);
      for (size_t i = 0; i < n; ++i) {
        a[i] = f.fromFloat(as[i % 7]);
        b[i] = f.fromFloat(bs[i % 7]);
      }
      forAvg = a;
      forSum = a;
      reduceInto(forAvg.data(), b.data(), n, f.dtype, RedOp::kAvg);
      reduceInto(forSum.data(), b.data(), n, f.dtype, RedOp::kSum);
      for (size_t i = 0; i < n; ++i) {
        const float gotAvg = f.toFloat(forAvg[i]), gotSum = f.toFloat(forSum[i]);
        CHECK_MSG(std::isnan(avg[i % 7]) ? std::isnan(gotAvg) : gotAvg == avg[i % 7], dtypeName(f.dtype), " AVG ",
                  as[i % 7], " + ", bs[i % 7], " = ", gotAvg);
        CHECK_MSG(std::isnan(sum[i % 7]) ? std::isnan(gotSum) : gotSum == sum[i % 7], dtypeName(f.dtype), " SUM ",
                  as[i % 7], " + ", bs[i % 7], " = ", gotSum);
      }
    }
  }
  // fp32 AVG is SUM: the division comes after it, and nothing saturates.
  float x = FLT_MAX, y = FLT_MAX;
  reduceInto(&x, &y, 1, DType::kFloat32, RedOp::kAvg);
  CHECK(std::isinf(x));
}

TEST_CASE(dtype_metadata) {
  CHECK_EQ(elementSize(DType::kFloat32), 4u);
  CHECK_EQ(elementSize(DType::kFloat64), 8u);
  CHECK_EQ(elementSize(DType::kFloat16), 2u);
  CHECK_EQ(elementSize(DType::kBFloat16), 2u);
  CHECK_EQ(elementSize(DType::kInt8), 1u);
  CHECK_EQ(elementSize(DType::kUInt8), 1u);
  CHECK_EQ(elementSize(DType::kInt32), 4u);
  CHECK_EQ(elementSize(DType::kInt64), 8u);
  CHECK_EQ(elementSize(DType::kBool), 1u);
  int floating = 0;
  for (DType t : kAllDTypes) floating += isFloating(t);
  CHECK_EQ(floating, 4);
}
