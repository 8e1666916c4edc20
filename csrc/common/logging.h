#pragma once
#include <cstdio>
#include <string>

#include "common/env.h"
#include "common/error.h"

namespace hetcomm {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

inline bool logEnabled(LogLevel level) {
  return static_cast<int>(level) <= paramLogLevel();
}

// One line to stderr, prefixed so that interleaved output of several ranks stays readable.
template <typename... Args>
void logLine(LogLevel level, const Args&... args) {
  if (!logEnabled(level)) return;
  static const char* kNames[] = {"ERROR", "WARN", "INFO", "DEBUG"};
  std::string line = strCat("[hetcomm ", kNames[static_cast<int>(level)], "] ", args..., "\n");
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace hetcomm

#define HC_LOG(level, ...) ::hetcomm::logLine(::hetcomm::LogLevel::level, __VA_ARGS__)
