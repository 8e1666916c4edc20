#include <cstdio>
#include <cstring>
#include <exception>

#include "check.h"

namespace check {

std::vector<TestCase>& registry() {
  static std::vector<TestCase> tests;
  return tests;
}

static int gFailuresInTest = 0;
static const int kMaxPrinted = 10;

void fail(const char* file, int line, const std::string& what) {
  if (++gFailuresInTest <= kMaxPrinted) std::printf("  %s:%d: FAILED: %s\n", file, line, what.c_str());
  if (gFailuresInTest == kMaxPrinted + 1) std::printf("  (further failures in this test not printed)\n");
}

}  // namespace check

int main(int argc, char** argv) {
  int run = 0, failed = 0, skipped = 0;
  for (const check::TestCase& t : check::registry()) {
    bool selected = argc < 2;
    for (int i = 1; i < argc; ++i) selected |= std::strstr(t.name, argv[i]) != nullptr;
    if (!selected) continue;
    ++run;
    check::gFailuresInTest = 0;
    std::printf("[ RUN  ] %s\n", t.name);
    std::fflush(stdout);
    try {
      t.fn();
    } catch (const check::Abort&) {
    } catch (const check::Skip& skip) {
      if (check::gFailuresInTest == 0) {
        ++skipped;
        std::printf("[ SKIP ] %s: %s\n", t.name, skip.reason.c_str());
        std::fflush(stdout);
        continue;
      }
    } catch (const std::exception& e) {
      check::fail(__FILE__, __LINE__, std::string("uncaught exception: ") + e.what());
    }
    if (check::gFailuresInTest > 0) {
      ++failed;
      std::printf("[ FAIL ] %s (%d failed checks)\n", t.name, check::gFailuresInTest);
    } else {
      std::printf("[  OK  ] %s\n", t.name);
    }
    std::fflush(stdout);
  }
  std::printf("%d test(s) run, %d failed", run, failed);
  if (skipped > 0) std::printf(", %d skipped", skipped);
  std::printf("\n");
  if (failed > 0 || run == 0) return 1;
  return skipped > 0 ? check::kSkipExitCode : 0;
}
