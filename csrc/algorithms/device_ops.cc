#include "algorithms/device_ops.h"

#include <atomic>

namespace hetcomm {
namespace {
std::atomic<int64_t> stagingBytes{0};
std::atomic<int64_t> registeredBytes{0};
}  // namespace

int64_t stagingHostBytes() { return stagingBytes.load(std::memory_order_relaxed); }

void countStagingHostBytes(int64_t delta) { stagingBytes.fetch_add(delta, std::memory_order_relaxed); }

int64_t registeredHostBytes() { return registeredBytes.load(std::memory_order_relaxed); }

void countRegisteredHostBytes(int64_t delta) { registeredBytes.fetch_add(delta, std::memory_order_relaxed); }

}  // namespace hetcomm
