#include "algorithms/collectives.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "algorithms/device_ops.h"
#include "algorithms/flow_pipeline.h"
#include "algorithms/local_collectives.h"
#include "algorithms/local_group.h"
#include "algorithms/pipeline.h"
#include "algorithms/ring_schedule.h"
#include "common/env.h"
#include "common/error.h"
#include "common/fingerprint.h"
#include "kernels/reduce.h"

namespace hetcomm {

RingPlan RingPlan::uniform(int size) {
  RingPlan p;
  p.order.resize(size);
  std::iota(p.order.begin(), p.order.end(), 0);
  p.shares.assign(size, 1.0 / size);
  return p;
}

void RingPlan::validate(int size) const {
  if (static_cast<int>(order.size()) != size || static_cast<int>(shares.size()) != size) {
    throw CommError(strCat("hetcomm: a plan for ", size, " ranks needs ", size, " ring positions and ", size,
                           " shares, got ", order.size(), " and ", shares.size()));
  }
  std::vector<int> sorted(order);
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < size; ++i) {
    if (sorted[i] != i) throw CommError("hetcomm: plan order must be a permutation of the ranks 0..size-1");
  }
  double sum = 0;
  for (double s : shares) {
    if (!(s >= 0) || s != s || s > 1e300) throw CommError("hetcomm: plan shares must be finite and non-negative");
    sum += s;
  }
  if (!(sum > 0)) throw CommError("hetcomm: plan shares must not all be zero");
  if (sites) sites->validate(size);
}

RingPlan RingPlan::forBytes(size_t bytes) const {
  if (sites && bytes >= sites->minBytes) return *this;
  RingPlan ring = bytes >= minBytes ? *this : uniform(static_cast<int>(order.size()));
  ring.sites = nullptr;
  return ring;
}

uint64_t RingPlan::fingerprint() const {
  Fingerprint f;  // over the order, the settings and the shares' bits
  for (int r : order) f.mix(static_cast<uint64_t>(r));
  f.mix(minBytes);
  f.mix(segmentBytes);
  for (double s : shares) f.mixDouble(s);
  if (sites) f.mix(sites->fingerprint());
  return f.value();
}

AllreduceAlgo chooseAllreduceAlgo(size_t bytes, int size) {
  // Recursive doubling takes log2(P) (+2) latency steps but moves the whole buffer each time;
  // the ring takes 2(P-1) steps and moves 2(P-1)/P of it. Small messages are latency bound.
  return (bytes <= static_cast<size_t>(paramSmallAllreduceBytes()) || size <= 1) ? AllreduceAlgo::kRecursiveDoubling
                                                                                  : AllreduceAlgo::kRing;
}

namespace {

// Every rank of the group is on this host: every collective goes through the host's inner level
// for its memory (null: none takes that memory, the collective goes over TCP).
// A reduction (dtype, op) goes there only if the level reduces it (NCCL has no bitwise ops); the
// answer is the same on every rank, whose level and call are the same.
InnerLevel* allLocal(CollectiveContext& ctx, bool hostMemory = false, const DType* dtype = nullptr,
                     const RedOp* op = nullptr) {
  if (ctx.local == nullptr || ctx.size <= 1 || !ctx.local->coversGroup(ctx.size)) return nullptr;
  InnerLevel* level = ctx.local->levelFor(hostMemory ? nullptr : ctx.device);
  if (level != nullptr && dtype != nullptr && !level->takes(*dtype, *op)) level = nullptr;
  if (level != nullptr) ctx.path = level->path();
  return level;
}

// dst <- src within this rank's own buffers, host or device memory.
void copyLocal(CollectiveContext& ctx, char* dst, const char* src, size_t bytes) {
  if (bytes == 0 || dst == src) return;
  if (ctx.device != nullptr) {
    ctx.device->copyWithinDevice(dst, src, bytes);
  } else {
    std::memmove(dst, src, bytes);
  }
}

// The division of AVG, wherever the data lives.
void divideLocal(CollectiveContext& ctx, char* data, size_t count, DType dtype, double divisor) {
  if (count == 0) return;
  if (ctx.device != nullptr) {
    ctx.device->divide(data, count, dtype, divisor);
  } else {
    divideInPlace(data, count, dtype, divisor);
  }
}

// AVG over the wire is finished in one of two places (avgScalesInputs, kernels/reduce.h): this
// rank's contribution is divided by the group size before the sum (fp16/bf16, whose partial sums
// would overflow), or the sum is divided after it (fp32/fp64). Each collective calls both around
// its sum, so exactly one of them divides. (The shared-memory collectives divide inside reduceMany.)
void averageBeforeSum(CollectiveContext& ctx, char* data, size_t count, DType dtype, RedOp op) {
  if (op == RedOp::kAvg && avgScalesInputs(dtype)) divideLocal(ctx, data, count, dtype, ctx.size);
}
void averageAfterSum(CollectiveContext& ctx, char* data, size_t count, DType dtype, RedOp op) {
  if (op == RedOp::kAvg && !avgScalesInputs(dtype)) divideLocal(ctx, data, count, dtype, ctx.size);
}

int positionOf(const RingPlan& plan, int rank) {
  return static_cast<int>(std::find(plan.order.begin(), plan.order.end(), rank) - plan.order.begin());
}

// Runs one ring schedule over `buf` for this rank. chunkCounts/chunkOffsets are per position.
void runRing(CollectiveContext& ctx, char* buf, const RingPlan& plan, const std::vector<size_t>& countsByPos,
             const std::vector<size_t>& offsetsByPos, size_t es, DType dtype, RedOp op, RingPhases phases) {
  const int P = ctx.size;
  const int pos = positionOf(plan, ctx.rank);
  const size_t maxChunk = *std::max_element(countsByPos.begin(), countsByPos.end()) * es;
  RingSchedule sched = buildRingSchedule(pos, P, offsetsByPos, countsByPos, es, ctx.segmentBytesFor(maxChunk), phases);
  PipelineSpec spec;
  spec.sendPeer = plan.order[(pos + 1) % P];
  spec.recvPeer = plan.order[(pos + P - 1) % P];
  spec.sendLead = sched.sendLead;
  spec.dtype = dtype;
  spec.op = op;
  for (const ByteRange& r : sched.sends) spec.sends.push_back({buf + r.offset, r.bytes, false});
  for (size_t i = 0; i < sched.recvs.size(); ++i) {
    spec.recvs.push_back({buf + sched.recvs[i].offset, sched.recvs[i].bytes, sched.recvReduces[i] != 0});
  }
  runPipeline(ctx, spec);
}

// Elements per piece of a site/host-plan allreduce (paramSitePieceBytes), a whole number of cache
// lines, at least one.
size_t sitePieceCount(DType dtype) {
  const size_t es = elementSize(dtype);
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(4096, paramSitePieceBytes()));
  return std::max<size_t>(1, bytes / 64 * 64 / es);
}

void allreduceRing(CollectiveContext& ctx, char* buf, size_t count, DType dtype, RedOp op, const RingPlan& plan) {
  if (plan.sites) {
    const size_t per = sitePieceCount(dtype), es = elementSize(dtype);
    size_t first = 0;
    do {
      const size_t n = std::min(per, count - first);
      allreduceHierarchical(ctx, buf + first * es, n, dtype, op, *plan.sites);
      first += n;
    } while (first < count);
    return;
  }
  const int P = ctx.size;
  // Shares are per rank; chunks are laid out in ring-position order.
  std::vector<double> sharesByPos(P);
  for (int pos = 0; pos < P; ++pos) sharesByPos[pos] = plan.shares[plan.order[pos]];
  std::vector<size_t> counts = sharesToCounts(count, sharesByPos);
  CollectiveContext planned = ctx.withSegmentCap(plan.segmentBytes);
  runRing(planned, buf, plan, counts, prefixOffsets(counts), elementSize(dtype), dtype, op, RingPhases::kAllReduce);
}

// MPICH-style recursive doubling; with P not a power of two, the first 2*(P - 2^k) ranks fold in
// pairs first and get the result back at the end. Partners combine the same two values in
// opposite argument order, which the kernels make bitwise identical, so all ranks agree exactly.
void allreduceRecursiveDoubling(CollectiveContext& ctx, char* buf, size_t count, DType dtype, RedOp op) {
  const int P = ctx.size, r = ctx.rank;
  const size_t bytes = count * elementSize(dtype);
  int p2 = 1;
  while (p2 * 2 <= P) p2 *= 2;
  const int extra = P - p2;
  std::vector<char> scratch(bytes);
  int vrank;
  if (r < 2 * extra) {
    if (r % 2 == 0) {
      exchange(ctx, r + 1, buf, bytes, -1, nullptr, 0, 0);
      vrank = -1;
    } else {
      exchange(ctx, -1, nullptr, 0, r - 1, scratch.data(), bytes, 0);
      reduceInto(buf, scratch.data(), count, dtype, op);
      vrank = r / 2;
    }
  } else {
    vrank = r - extra;
  }
  if (vrank >= 0) {
    uint32_t step = 1;
    for (int mask = 1; mask < p2; mask <<= 1, ++step) {
      const int vpartner = vrank ^ mask;
      const int partner = vpartner < extra ? vpartner * 2 + 1 : vpartner + extra;
      exchange(ctx, partner, buf, bytes, partner, scratch.data(), bytes, step);
      reduceInto(buf, scratch.data(), count, dtype, op);
    }
  }
  if (r < 2 * extra) {
    if (r % 2 == 1) {
      exchange(ctx, r - 1, buf, bytes, -1, nullptr, 0, 1000);
    } else {
      exchange(ctx, -1, nullptr, 0, r + 1, buf, bytes, 1000);
    }
  }
}

// An allreduce of device memory staged whole: copied to pinned host memory at once, reduced there
// by the host algorithm the header names (exactly as for a CPU tensor, so the bytes on the wire
// are the same either way), and copied back. For small and medium messages this beats the staged
// pipeline: one copy each way instead of a few device operations per segment, and the CPU adds a
// few megabytes faster than the device round trips take (paramDeviceHostReduceBytes).
//
// With a site or host plan the message goes piece by piece (sitePieceCount, as allreduceRing cuts
// it for host memory), so the pinned staging buffer never exceeds a piece: the queue runs in
// order, so the next piece's copy into the buffer comes after the last piece's copy out of it.
void allreduceStagedWhole(CollectiveContext& ctx, char* buf, size_t count, DType dtype, RedOp op,
                          const RingPlan& plan) {
  DeviceOps& dev = *ctx.device;
  const size_t es = elementSize(dtype);
  if (count == 0) return;
  const bool ring = static_cast<AllreduceAlgo>(ctx.header.algo) == AllreduceAlgo::kRing;
  const size_t per = ring && plan.sites ? sitePieceCount(dtype) : count;
  char* host = dev.hostBuffer(std::min(count, per) * es);
  CollectiveContext onHost = ctx;
  onHost.device = nullptr;
  for (size_t first = 0; first < count; first += per) {
    const size_t n = std::min(per, count - first);
    char* piece = buf + first * es;
    dev.copyToHost(host, piece, n * es);
    dev.waitFor(dev.mark());
    averageBeforeSum(onHost, host, n, dtype, op);
    if (ring) {
      allreduceRing(onHost, host, n, dtype, op, plan);
    } else {
      allreduceRecursiveDoubling(onHost, host, n, dtype, op);
    }
    averageAfterSum(onHost, host, n, dtype, op);
    dev.testDelay();
    dev.copyToDevice(piece, host, n * es);
  }
  ctx.path = onHost.path;  // the host algorithm's path (the host level, say) is this collective's
}

}  // namespace

void allreduce(CollectiveContext& ctx, char* buf, size_t count, DType dtype, RedOp op, const RingPlan& plan) {
  SettleOnExit settle(ctx.device);
  if (InnerLevel* level = allLocal(ctx, false, &dtype, &op)) {
    // An AVG over the whole group is divided with the reduction (shm: before rounding).
    level->allreduce(ctx, buf, count, dtype, op, op == RedOp::kAvg ? ctx.size : 0.0);
    return;
  }
  const bool ring = static_cast<AllreduceAlgo>(ctx.header.algo) == AllreduceAlgo::kRing;
  // A host or three-level plan whose host level keeps device memory on the device (NCCL): only
  // each rank's slice of a piece crosses to host memory (allreduceHierarchical). The bytes between
  // the hosts are the same as when the piece is staged whole, so ranks may differ in this choice.
  if (ctx.size > 1 && ctx.device != nullptr && ring && plan.sites &&
      (plan.sites->localInner || !plan.sites->hosts.empty()) && ctx.local != nullptr) {
    InnerLevel* level = ctx.local->levelFor(ctx.device);
    if (level != nullptr && !level->stagesDevice() && level->takes(dtype, op)) {
      averageBeforeSum(ctx, buf, count, dtype, op);
      allreduceRing(ctx, buf, count, dtype, op, plan);
      averageAfterSum(ctx, buf, count, dtype, op);
      return;
    }
  }
  // Otherwise the hierarchical schedule moves host memory: device buffers are staged whole.
  if (ctx.size > 1 && ctx.device != nullptr &&
      (!ring || plan.sites ||
       count * elementSize(dtype) <= static_cast<size_t>(std::max<int64_t>(0, paramDeviceHostReduceBytes())))) {
    allreduceStagedWhole(ctx, buf, count, dtype, op, plan);
    return;  // averaged on the host already
  }
  averageBeforeSum(ctx, buf, count, dtype, op);
  if (ctx.size > 1) {
    if (ring) {
      allreduceRing(ctx, buf, count, dtype, op, plan);
    } else {
      allreduceRecursiveDoubling(ctx, buf, count, dtype, op);
    }
  }
  averageAfterSum(ctx, buf, count, dtype, op);
}

void broadcast(CollectiveContext& ctx, char* buf, size_t bytes, int root) {
  SettleOnExit settle(ctx.device);
  const int P = ctx.size;
  if (P == 1) return;
  if (InnerLevel* level = allLocal(ctx)) return level->broadcast(ctx, buf, bytes, root);
  const int pos = (ctx.rank - root + P) % P;
  RingSchedule sched = buildChainSchedule(pos, P, bytes, ctx.segmentBytesFor(bytes));
  PipelineSpec spec;
  spec.sendPeer = pos == P - 1 ? -1 : (ctx.rank + 1) % P;
  spec.recvPeer = pos == 0 ? -1 : (ctx.rank + P - 1) % P;
  spec.sendLead = sched.sendLead;
  for (const ByteRange& r : sched.sends) spec.sends.push_back({buf + r.offset, r.bytes, false});
  for (const ByteRange& r : sched.recvs) spec.recvs.push_back({buf + r.offset, r.bytes, false});
  runPipeline(ctx, spec);
}

void allgatherv(CollectiveContext& ctx, char* out, const std::vector<size_t>& blockBytes, const RingPlan& plan) {
  SettleOnExit settle(ctx.device);
  const int P = ctx.size;
  if (P == 1) return;
  if (InnerLevel* level = allLocal(ctx)) return level->allgatherv(ctx, out, blockBytes);
  std::vector<size_t> offsets = prefixOffsets(blockBytes);
  std::vector<size_t> countsByPos(P), offsetsByPos(P);
  for (int pos = 0; pos < P; ++pos) {
    countsByPos[pos] = blockBytes[plan.order[pos]];
    offsetsByPos[pos] = offsets[plan.order[pos]];
  }
  runRing(ctx, out, plan, countsByPos, offsetsByPos, 1, DType::kUInt8, RedOp::kSum, RingPhases::kAllGather);
}

void reduceScatterv(CollectiveContext& ctx, char* work, const std::vector<size_t>& counts, DType dtype, RedOp op,
                    const RingPlan& plan) {
  SettleOnExit settle(ctx.device);
  const int P = ctx.size;
  if (InnerLevel* level = allLocal(ctx, false, &dtype, &op)) return level->reduceScatterv(ctx, work, counts, dtype, op, op == RedOp::kAvg ? P : 0.0);
  std::vector<size_t> offsets = prefixOffsets(counts);
  // Every block of work is this rank's contribution to some rank's result.
  averageBeforeSum(ctx, work, offsets[P - 1] + counts[P - 1], dtype, op);
  if (P > 1) {
    std::vector<size_t> countsByPos(P), offsetsByPos(P);
    for (int pos = 0; pos < P; ++pos) {
      countsByPos[pos] = counts[plan.order[pos]];
      offsetsByPos[pos] = offsets[plan.order[pos]];
    }
    runRing(ctx, work, plan, countsByPos, offsetsByPos, elementSize(dtype), dtype, op, RingPhases::kReduceScatter);
  }
  averageAfterSum(ctx, work + offsets[ctx.rank] * elementSize(dtype), counts[ctx.rank], dtype, op);
}

void gather(CollectiveContext& ctx, const char* in, char* out, size_t blockBytes, int root) {
  SettleOnExit settle(ctx.device);
  if (InnerLevel* level = allLocal(ctx)) return level->gather(ctx, in, out, blockBytes, root);
  if (ctx.rank != root) {
    exchange(ctx, root, in, blockBytes, -1, nullptr, 0, 0);
    return;
  }
  copyLocal(ctx, out + root * blockBytes, in, blockBytes);
  for (int peer = 0; peer < ctx.size; ++peer) {
    if (peer != root) exchange(ctx, -1, nullptr, 0, peer, out + peer * blockBytes, blockBytes, 0);
  }
}

void scatter(CollectiveContext& ctx, const char* in, char* out, size_t blockBytes, int root) {
  SettleOnExit settle(ctx.device);
  if (InnerLevel* level = allLocal(ctx)) return level->scatter(ctx, in, out, blockBytes, root);
  if (ctx.rank != root) {
    exchange(ctx, -1, nullptr, 0, root, out, blockBytes, 0);
    return;
  }
  for (int peer = 0; peer < ctx.size; ++peer) {
    if (peer != root) exchange(ctx, peer, in + peer * blockBytes, blockBytes, -1, nullptr, 0, 0);
  }
  copyLocal(ctx, out, in + root * blockBytes, blockBytes);
}

void alltoallv(CollectiveContext& ctx, const char* in, const std::vector<size_t>& sendOffsets,
               const std::vector<size_t>& sendBytes, char* out, const std::vector<size_t>& recvOffsets,
               const std::vector<size_t>& recvBytes) {
  SettleOnExit settle(ctx.device);
  if (InnerLevel* level = allLocal(ctx)) return level->alltoallv(ctx, in, sendOffsets, sendBytes, out, recvOffsets, recvBytes);
  const int P = ctx.size, r = ctx.rank;
  if (recvBytes[r] != sendBytes[r]) {
    throw CommError(strCat(ctx.prefix(), ": sends ", sendBytes[r], " bytes to itself but expects ", recvBytes[r]));
  }
  copyLocal(ctx, out + recvOffsets[r], in + sendOffsets[r], sendBytes[r]);
  if (ctx.device == nullptr) {
    // Host memory: every peer at once, one send and one receive flow each. In P - 1 lockstep
    // steps a step waits for its slowest partner, so a peer that is descheduled for a while
    // (a throttled or busy CPU) delays every later step; with all flows in flight the kernel's
    // socket buffers keep the links busy meanwhile.
    FlowGraph g;
    g.flows.reserve(2 * static_cast<size_t>(P - 1));   // references below stay valid
    for (int s = 1; s < P; ++s) {
      const int to = (r + s) % P, from = (r - s + P) % P;
      Flow& send = g.flow(to, true);
      send.step = s;   // the headers of the lockstep form (device tensors): mixed groups agree
      if (sendBytes[to] > 0) send.items.push_back(g.add(const_cast<char*>(in + sendOffsets[to]), sendBytes[to], false, {}));
      Flow& recv = g.flow(from, false);
      recv.step = s;
      if (recvBytes[from] > 0) recv.items.push_back(g.add(out + recvOffsets[from], recvBytes[from], false, {}));
    }
    runFlows(ctx, g);
    return;
  }
  // Device memory (staged through the pipeline): step s sends to r+s while receiving from r-s;
  // every link is used once in each direction.
  for (int s = 1; s < P; ++s) {
    const int to = (r + s) % P, from = (r - s + P) % P;
    exchange(ctx, to, in + sendOffsets[to], sendBytes[to], from, out + recvOffsets[from], recvBytes[from],
             static_cast<uint32_t>(s));
  }
}

void barrier(CollectiveContext& ctx) {
  if (InnerLevel* level = allLocal(ctx, true)) return level->barrier(ctx);
  uint8_t token = 0;  // host memory, whatever the group's tensors are
  CollectiveContext onHost = ctx;
  onHost.device = nullptr;
  if (ctx.size > 1) allreduceRecursiveDoubling(onHost, reinterpret_cast<char*>(&token), 1, DType::kUInt8, RedOp::kMax);
}

}  // namespace hetcomm
