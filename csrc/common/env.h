#pragma once
// Environment parameters, read once per process (NCCL_PARAM style).
#include <cstdint>
#include <cstdlib>
#include <string>

namespace hetcomm {

inline int64_t envInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  long long parsed = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0') return fallback;
  return parsed;
}

inline std::string envStr(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return (v == nullptr || *v == '\0') ? fallback : std::string(v);
}

#define HETCOMM_PARAM(fn, env, def)                  \
  inline int64_t fn() {                              \
    static const int64_t value = envInt(env, (def)); \
    return value;                                    \
  }

// Bytes per pipelined segment of the ring; 0 (default) adapts it to the chunk size.
HETCOMM_PARAM(paramSegmentBytes, "HETCOMM_SEGMENT_BYTES", 0)
// Allreduce of at most this many bytes uses recursive doubling (latency-optimal) instead of the
// ring (bandwidth-optimal).
HETCOMM_PARAM(paramSmallAllreduceBytes, "HETCOMM_SMALL_ALLREDUCE_BYTES", 32 * 1024)
// Socket send/receive buffer sizes requested from the kernel: -1 (default) = 256 KB on loopback
// and the kernel's autotuning elsewhere, 0 = always autotune, N = always N bytes.
HETCOMM_PARAM(paramSocketBufferBytes, "HETCOMM_SOCKET_BUFFER_BYTES", -1)
// Log level: 0 errors, 1 warnings (default), 2 info, 3 debug.
HETCOMM_PARAM(paramLogLevel, "HETCOMM_LOG_LEVEL", 1)

}  // namespace hetcomm
