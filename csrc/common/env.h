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

// The engine's constants and settings that the planner's cost model needs too: Python reads them
// from hetcomm._C.engine_settings() (the effective values, overrides included), never a copy.
//
// Bytes per pipelined segment of the ring; 0 (default) adapts it to the chunk size, a quarter of
// the largest chunk clamped to [kMinSegmentBytes, kMaxSegmentBytes].
HETCOMM_PARAM(paramSegmentBytes, "HETCOMM_SEGMENT_BYTES", 0)
constexpr int64_t kMinSegmentBytes = 32 * 1024;
constexpr int64_t kMaxSegmentBytes = 1024 * 1024;
// Allreduce of at most this many bytes uses recursive doubling (latency-optimal) instead of the
// ring (bandwidth-optimal).
constexpr int64_t kDefaultSmallAllreduceBytes = 32 * 1024;
HETCOMM_PARAM(paramSmallAllreduceBytes, "HETCOMM_SMALL_ALLREDUCE_BYTES", kDefaultSmallAllreduceBytes)
// Collectives on CPU tensors of at most this many bytes, within one host's shared memory, run on
// the calling thread when nothing else of the group is queued or running (HETCOMM_INLINE_BYTES,
// read at group creation; 0 turns it off).
constexpr int64_t kDefaultInlineBytes = 1024 * 1024;
// ... and only after the program waited for its previous operation within this many
// microseconds of getting it (HETCOMM_INLINE_WINDOW_US, read at group creation).
constexpr int64_t kDefaultInlineWindowUs = 200;
// Socket send/receive buffer sizes requested from the kernel: -1 (default) = 256 KB on loopback
// and the kernel's autotuning elsewhere, 0 = always autotune, N = always N bytes.
HETCOMM_PARAM(paramSocketBufferBytes, "HETCOMM_SOCKET_BUFFER_BYTES", -1)
// Device (CUDA) tensors. An allreduce of at most HETCOMM_DEVICE_HOST_REDUCE_BYTES is copied to
// pinned host memory whole, reduced there exactly as a CPU tensor would be, and copied back: below
// that size the per-segment device operations of the staged pipeline cost more than they overlap.
// Measured on an H100 shared by 2 ranks (benchmarks/results/cuda_staging_sweep_h100.txt), whole
// vs staged: 1 MB 0.56 vs 1.42 ms, 4 MB 1.88 vs 2.07 ms, 16 MB 8.5 vs 8.7 ms, 64 MB 40 vs 27 ms;
// an earlier run gave 0.53 vs 1.34, 2.08 vs 1.71 and 8.8 vs 5.3 ms up to 16 MB: the crossover
// lies between 2 and 16 MB. Larger messages go through the staged pipeline in slots of
// HETCOMM_DEVICE_SLOT_BYTES (rounded up to 16; 256 KB slots were twice as slow, 4 MB ones within
// the noise), whose loop polls the device every HETCOMM_DEVICE_POLL_US microseconds while only
// device work is pending.
HETCOMM_PARAM(paramDeviceHostReduceBytes, "HETCOMM_DEVICE_HOST_REDUCE_BYTES", 2 * 1024 * 1024)
HETCOMM_PARAM(paramDeviceSlotBytes, "HETCOMM_DEVICE_SLOT_BYTES", 1 << 20)
HETCOMM_PARAM(paramDevicePollUs, "HETCOMM_DEVICE_POLL_US", 20)
// Allreduces that take a site or host plan run as consecutive allreduces of pieces of at most
// this many bytes, on every rank alike: a device rank stages one piece at a time through pinned
// memory (bounded by the piece, not by the message), and host ranks cut the same pieces, so the
// two still meet on the wire. Every rank must use the same value.
HETCOMM_PARAM(paramSitePieceBytes, "HETCOMM_SITE_PIECE_BYTES", 32 << 20)
// 1: a CUDA rank registers its host's shared-memory segment with the device (cudaHostRegister), so
// that the one-host path copies between the GPU and the segment asynchronously, from pinned
// memory, instead of synchronously from pageable memory (measured on an H200 without it: that
// path at 0.72-0.81x the staged TCP one). Off by default until it has been measured on a GPU; a
// registration that fails leaves the copies pageable, with a warning.
HETCOMM_PARAM(paramShmPin, "HETCOMM_SHM_PIN", 0)
// Log level: 0 errors, 1 warnings (default), 2 info, 3 debug.
HETCOMM_PARAM(paramLogLevel, "HETCOMM_LOG_LEVEL", 1)

}  // namespace hetcomm
