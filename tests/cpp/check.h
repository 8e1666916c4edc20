#pragma once
// A tiny test harness: TEST_CASE registers a function, CHECK* record a failure and go on,
// REQUIRE* stop the current test, SKIP_TEST leaves it as skipped. check_main.cc runs every test (or
// those whose name contains one of the command-line arguments) and exits 1 if any check failed,
// else kSkipExitCode if any test was skipped, else 0.
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace check {

struct TestCase {
  const char* name;
  void (*fn)();
};
std::vector<TestCase>& registry();
struct Registrar {
  Registrar(const char* name, void (*fn)()) { registry().push_back({name, fn}); }
};
struct Abort {};  // thrown by REQUIRE* to leave the current test
struct Skip {     // thrown by SKIP_TEST: the test cannot run on this machine (e.g. it has no GPU)
  std::string reason;
};
// Exit code of a run in which nothing failed but some test was skipped; tests/cpp/CMakeLists.txt
// gives it to ctest as SKIP_RETURN_CODE, so ctest reports such a program as skipped, not passed.
constexpr int kSkipExitCode = 77;

// Records a failure (printing at most a few per test so that a broken loop does not flood).
void fail(const char* file, int line, const std::string& what);

template <typename T>
std::string show(const T& v) {
  std::ostringstream os;
  if constexpr (std::is_same_v<T, bool>) {
    os << (v ? "true" : "false");
  } else if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    os << static_cast<long long>(v);
  } else if constexpr (std::is_integral_v<T>) {
    os << static_cast<unsigned long long>(v) << " (0x" << std::hex << static_cast<unsigned long long>(v) << ")";
  } else {
    os.precision(17);
    os << v;
  }
  return os.str();
}

template <typename A, typename B>
std::string showPair(const char* ea, const char* eb, const A& a, const B& b) {
  return std::string(ea) + " == " + eb + "  [" + show(a) + " vs " + show(b) + "]";
}

}  // namespace check

#define HC_CHECK_CAT2(a, b) a##b
#define HC_CHECK_CAT(a, b) HC_CHECK_CAT2(a, b)
#define TEST_CASE(name)                                                           \
  static void name();                                                             \
  static ::check::Registrar HC_CHECK_CAT(name, _registrar)(#name, &name);         \
  static void name()

// Extra context: CHECK_MSG(cond, a, b, ...) streams the rest into the failure message.
#define CHECK_MSG(cond, ...)                                                                   \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      std::ostringstream hc_os_;                                                               \
      hc_os_ << #cond << "  ";                                                                 \
      ::check::detail_stream(hc_os_, __VA_ARGS__);                                             \
      ::check::fail(__FILE__, __LINE__, hc_os_.str());                                         \
    }                                                                                          \
  } while (0)
#define CHECK(cond) \
  do {              \
    if (!(cond)) ::check::fail(__FILE__, __LINE__, #cond); \
  } while (0)
#define CHECK_EQ(a, b)                                                                            \
  do {                                                                                            \
    const auto& hc_a_ = (a);                                                                      \
    const auto& hc_b_ = (b);                                                                      \
    if (!(hc_a_ == hc_b_)) ::check::fail(__FILE__, __LINE__, ::check::showPair(#a, #b, hc_a_, hc_b_)); \
  } while (0)
#define REQUIRE(cond)                                      \
  do {                                                     \
    if (!(cond)) {                                         \
      ::check::fail(__FILE__, __LINE__, #cond);            \
      throw ::check::Abort{};                              \
    }                                                      \
  } while (0)
// Leaves the current test and reports it skipped, with the reason, instead of passed.
#define SKIP_TEST(reason) throw ::check::Skip{reason}
#define CHECK_THROWS_AS(expr, Exc)                                                           \
  do {                                                                                       \
    bool hc_caught_ = false;                                                                 \
    try {                                                                                    \
      (void)(expr);                                                                          \
    } catch (const Exc&) {                                                                   \
      hc_caught_ = true;                                                                     \
    } catch (...) {                                                                          \
    }                                                                                        \
    if (!hc_caught_) ::check::fail(__FILE__, __LINE__, "expected " #Exc " from " #expr);     \
  } while (0)
#define CHECK_NOTHROW(expr)                                                                           \
  do {                                                                                                \
    try {                                                                                             \
      (void)(expr);                                                                                   \
    } catch (const std::exception& hc_e_) {                                                           \
      ::check::fail(__FILE__, __LINE__, std::string("unexpected exception from " #expr ": ") + hc_e_.what()); \
    }                                                                                                 \
  } while (0)

namespace check {
inline void detail_stream(std::ostringstream&) {}
template <typename T, typename... Rest>
void detail_stream(std::ostringstream& os, const T& first, const Rest&... rest) {
  if constexpr (std::is_same_v<T, int8_t> || std::is_same_v<T, uint8_t> || std::is_same_v<T, char>) {
    os << static_cast<int>(first);
  } else {
    os << first;
  }
  detail_stream(os, rest...);
}
}  // namespace check
