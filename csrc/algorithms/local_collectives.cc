#include "algorithms/local_collectives.h"

#include <algorithm>
#include <cstring>

#include "algorithms/device_ops.h"
#include "algorithms/local_group.h"
#include "algorithms/pipeline_io.h"
#include "common/env.h"
#include "common/error.h"
#include "kernels/reduce.h"

namespace hetcomm {
namespace local {

HETCOMM_PARAM(paramShmSmallAllreduceBytes, "HETCOMM_SHM_SMALL_ALLREDUCE_BYTES", 16 * 1024)

size_t smallAllreduceBytes() { return static_cast<size_t>(std::max<int64_t>(0, paramShmSmallAllreduceBytes())); }

namespace {

constexpr uint32_t kNoTag = 0;

size_t ceilDiv(size_t a, size_t b) { return (a + b - 1) / b; }
size_t roundUp(size_t v, size_t a) { return ceilDiv(v, a) * a; }

// Elements per cache line: slices and pieces start on cache lines, so that two ranks never write
// into the same line.
size_t lineElems(size_t es) { return std::max<size_t>(1, ShmChannel::kAlignBytes / es); }

// One chunk of a local collective (the protocol of channel.h).
class Chunk {
 public:
  // index/count: this chunk's position in the collective (carried in the header).
  Chunk(const CollectiveContext& ctx, uint32_t index, uint32_t count)
      : ctx_(ctx), group_(*ctx.local), ch_(*ctx.local->channel), g_(ch_.takeChunk()), index_(index), count_(count) {}

  int me() const { return ch_.localRank(); }
  int size() const { return ch_.localSize(); }
  char* slotOf(int l) const { return ch_.slot(l, g_); }
  char* mine() const { return slotOf(me()); }

  // Waits until every local rank has finished with the chunk that used this slot buffer last.
  void acquire() {
    const uint64_t depth = static_cast<uint64_t>(ch_.depth());
    if (g_ >= depth) waitAll(base(g_ - depth) + 3, "to release its slot");
  }
  // This rank's part is in its slot.
  void post() {
    writeHeader();
    ch_.publish(base(g_) + 1);
  }
  void awaitPosted() {
    waitAll(base(g_) + 1, "to write its part");
    checkHeaders();
  }
  void postMiddle() { ch_.publish(base(g_) + 2); }
  void awaitMiddle() { waitAll(base(g_) + 2, "to reduce its slice"); }
  void finish() { ch_.publish(base(g_) + 3); }

 private:
  static uint32_t base(uint64_t g) { return static_cast<uint32_t>(3 * g); }

  CollectiveHeader headerOfThisRank() const {
    CollectiveHeader h = ctx_.header;
    h.step = index_;
    return h;
  }

  void writeHeader() {
    uint8_t* at = ch_.header(me(), g_);
    const auto enc = headerOfThisRank().encode();
    std::memcpy(at, enc.data(), enc.size());
    std::memcpy(at + enc.size(), &count_, sizeof(count_));
  }

  void checkHeaders() const {
    const CollectiveHeader want = headerOfThisRank();
    for (int l = 0; l < size(); ++l) {
      if (l == me()) continue;
      const uint8_t* at = ch_.header(l, g_);
      CollectiveHeader got;
      const std::string err = CollectiveHeader::decode(at, got);
      uint32_t count;
      std::memcpy(&count, at + CollectiveHeader::kBytes, sizeof(count));
      if (!err.empty()) {
        throw CommError(strCat(ctx_.prefix(), ": garbage in the shared memory of rank ", group_.ranks[l], ": ", err));
      }
      if (!(got == want) || count != count_) {
        std::string d = pipeline_io::describeMismatch(want, got);
        if (count != count_) d += strCat(d.empty() ? "" : ", ", count, " chunks vs ", count_);
        throw CommError(strCat(ctx_.prefix(), " and rank ", group_.ranks[l],
                               " disagree about the collective (tensor shapes, dtypes, ops or call order differ "
                               "across ranks): ",
                               d));
      }
    }
  }

  void waitAll(uint32_t target, const char* what) const {
    for (int l = 0; l < size(); ++l) {
      if (l == me()) continue;
      const ShmChannel::Wait w = ch_.waitFor(l, target, ctx_.deadline, group_.peerAlive);
      if (w != ShmChannel::Wait::kReached) fail(w, l, what);
    }
  }

  [[noreturn]] void fail(ShmChannel::Wait w, int l, const char* what) const {
    const int peer = group_.ranks[l];
    const std::string where = strCat(" (shared memory, chunk ", index_ + 1, " of ", count_, ")");
    switch (w) {
      case ShmChannel::Wait::kTimedOut:
        throw TimeoutError(strCat(ctx_.prefix(), " timed out after ", ctx_.timeoutMs, " ms waiting for rank ", peer,
                                  " ", what, where, ": is it alive and in the same collective?"));
      case ShmChannel::Wait::kPeerGone:
        throw PeerClosedError(strCat(ctx_.prefix(), " lost rank ", peer, " on this host while waiting for it ", what,
                                     where, ": its process exited or closed its connections"),
                              peer);
      default: {
        const int by = ch_.abortedBy();
        if (by >= 0 && by != me()) {
          throw PeerClosedError(strCat(ctx_.prefix(), ": rank ", group_.ranks[by],
                                       " on this host gave up while this rank waited for rank ", peer, " ", what, where),
                                group_.ranks[by]);
        }
        throw CommError(strCat(ctx_.prefix(), ": the group was aborted while this rank waited for rank ", peer, " ",
                               what, where));
      }
    }
  }

  const CollectiveContext& ctx_;
  const LocalGroup& group_;
  ShmChannel& ch_;
  const uint64_t g_;
  const uint32_t index_;
  const uint32_t count_;
};

// Copies between this rank's buffers (host or device memory) and the slots (host memory).
void copyIn(const CollectiveContext& ctx, char* slot, const char* src, size_t bytes) {
  if (bytes == 0) return;
  if (ctx.traffic != nullptr) ctx.traffic->addSharedMemory(bytes);
  if (ctx.device != nullptr) {
    ctx.device->copyToHost(slot, src, bytes);
  } else {
    std::memcpy(slot, src, bytes);
  }
}
void copyOut(const CollectiveContext& ctx, char* dst, const char* slot, size_t bytes) {
  if (bytes == 0) return;
  if (ctx.device != nullptr) {
    ctx.device->copyToDevice(dst, slot, bytes);
  } else {
    std::memcpy(dst, slot, bytes);
  }
}
// Device copies are queued: before a slot is shown to the others (after copyIn) or handed back
// (after copyOut), wait until the queue is done with it.
void settle(const CollectiveContext& ctx) {
  if (ctx.device != nullptr) ctx.device->waitFor(ctx.device->mark());
}

uint32_t chunkCount(size_t n) { return static_cast<uint32_t>(std::max<size_t>(1, n)); }

// The slices of n elements among L ranks: equal, each starting on a cache line.
struct Slices {
  size_t per;
  size_t n;
  size_t begin(int k) const { return std::min(n, per * static_cast<size_t>(k)); }
  size_t length(int k) const { return std::min(n, per * static_cast<size_t>(k + 1)) - begin(k); }
};
Slices slicesOf(size_t n, int L, size_t es) { return {roundUp(ceilDiv(n, static_cast<size_t>(L)), lineElems(es)), n}; }

}  // namespace

void allreduce(const CollectiveContext& ctx, char* buf, size_t count, DType dtype, RedOp op, double divisor) {
  ShmChannel& ch = *ctx.local->channel;
  const int L = ch.localSize(), me = ch.localRank();
  const size_t es = elementSize(dtype);
  std::vector<const void*> srcs(L);
  if (count * es <= std::min(smallAllreduceBytes(), ch.slotBytes())) {
    // Small: every rank reduces the whole message from every slot, in local-rank order. Chosen
    // by size alone, so that ranks with host and device tensors take the same path (the chunk
    // headers of the two paths look alike). Device buffers: reduced in host memory, copied back.
    Chunk c(ctx, 0, 1);
    c.acquire();
    copyIn(ctx, c.mine(), buf, count * es);
    settle(ctx);
    c.post();
    c.awaitPosted();
    for (int l = 0; l < L; ++l) srcs[l] = c.slotOf(l);
    if (count > 0) {
      if (ctx.device == nullptr) {
        reduceMany(buf, srcs.data(), L, count, dtype, op, divisor);
      } else {
        thread_local std::vector<char> host;
        host.resize(count * es);
        reduceMany(host.data(), srcs.data(), L, count, dtype, op, divisor);
        copyOut(ctx, buf, host.data(), count * es);
        settle(ctx);
      }
    }
    c.finish();
    return;
  }
  const size_t perChunk = ch.slotBytes() / es;
  const uint32_t chunks = chunkCount(ceilDiv(count, perChunk));
  for (uint32_t k = 0; k < chunks; ++k) {
    const size_t first = std::min(count, static_cast<size_t>(k) * perChunk);
    const size_t n = std::min(count - first, perChunk);
    char* data = buf + first * es;
    const Slices s = slicesOf(n, L, es);
    Chunk c(ctx, k, chunks);
    c.acquire();
    copyIn(ctx, c.mine(), data, n * es);
    settle(ctx);
    c.post();
    c.awaitPosted();
    // Reduce this rank's slice from every slot into its own slot (in place: nobody else reads
    // this rank's slice of its own slot before the middle step is over).
    const size_t off = s.begin(me) * es;
    for (int l = 0; l < L; ++l) srcs[l] = c.slotOf(l) + off;
    if (s.length(me) > 0) reduceMany(c.mine() + off, srcs.data(), L, s.length(me), dtype, op, divisor);
    c.postMiddle();
    c.awaitMiddle();
    for (int l = 0; l < L; ++l) copyOut(ctx, data + s.begin(l) * es, c.slotOf(l) + s.begin(l) * es, s.length(l) * es);
    settle(ctx);
    c.finish();
  }
}

void reduceScatterv(const CollectiveContext& ctx, char* work, const std::vector<size_t>& counts, DType dtype,
                    RedOp op, double divisor) {
  ShmChannel& ch = *ctx.local->channel;
  const int L = ch.localSize(), me = ch.localRank();
  HC_ENFORCE(static_cast<int>(counts.size()) == L, "one count per local rank");
  const size_t es = elementSize(dtype);
  const size_t line = lineElems(es);
  const size_t capacity = ch.slotBytes() / es;
  HC_ENFORCE(capacity >= static_cast<size_t>(L) * line, "slots too small for ", L, " ranks");
  size_t total = 0;
  for (size_t n : counts) total += n;
  // Chunk k carries piece k of every block; pieces are a block's elements cut into `chunks`
  // equal parts, each padded to a cache line in the slot. The fewest chunks whose pieces fit.
  uint32_t chunks = chunkCount(ceilDiv(total, capacity));
  auto fits = [&](size_t n) {
    size_t need = 0;
    for (size_t c : counts) need += roundUp(ceilDiv(c, n), line);
    return need <= capacity;
  };
  while (!fits(chunks)) ++chunks;
  std::vector<size_t> piece(L), slotOff(L), blockOff(L);
  size_t at = 0, block = 0;
  for (int l = 0; l < L; ++l) {
    piece[l] = ceilDiv(counts[l], chunks);
    slotOff[l] = at;
    at += roundUp(piece[l], line);
    blockOff[l] = block;
    block += counts[l];
  }
  std::vector<const void*> srcs(L);
  for (uint32_t k = 0; k < chunks; ++k) {
    auto pieceLength = [&](int l) {
      const size_t first = std::min(counts[l], piece[l] * k);
      return std::min(counts[l] - first, piece[l]);
    };
    auto pieceData = [&](int l) { return work + (blockOff[l] + std::min(counts[l], piece[l] * k)) * es; };
    Chunk c(ctx, k, chunks);
    c.acquire();
    for (int l = 0; l < L; ++l) copyIn(ctx, c.mine() + slotOff[l] * es, pieceData(l), pieceLength(l) * es);
    settle(ctx);
    c.post();
    c.awaitPosted();
    const size_t n = pieceLength(me);
    if (n > 0) {
      for (int l = 0; l < L; ++l) srcs[l] = c.slotOf(l) + slotOff[me] * es;
      char* result = c.mine() + slotOff[me] * es;  // nobody else reads this rank's own piece
      reduceMany(result, srcs.data(), L, n, dtype, op, divisor);
      copyOut(ctx, pieceData(me), result, n * es);
      settle(ctx);
    }
    c.finish();
  }
}

void allgatherv(const CollectiveContext& ctx, char* out, const std::vector<size_t>& blockBytes) {
  ShmChannel& ch = *ctx.local->channel;
  const int L = ch.localSize(), me = ch.localRank();
  HC_ENFORCE(static_cast<int>(blockBytes.size()) == L, "one block per local rank");
  const size_t S = ch.slotBytes();
  size_t largest = 0;
  std::vector<size_t> offset(L);
  size_t at = 0;
  for (int l = 0; l < L; ++l) {
    largest = std::max(largest, blockBytes[l]);
    offset[l] = at;
    at += blockBytes[l];
  }
  const uint32_t chunks = chunkCount(ceilDiv(largest, S));
  for (uint32_t k = 0; k < chunks; ++k) {
    auto length = [&](int l) { return std::min(blockBytes[l] - std::min(blockBytes[l], S * k), S); };
    Chunk c(ctx, k, chunks);
    c.acquire();
    copyIn(ctx, c.mine(), out + offset[me] + S * k, length(me));
    settle(ctx);
    c.post();
    c.awaitPosted();
    for (int l = 0; l < L; ++l) {
      if (l != me) copyOut(ctx, out + offset[l] + S * k, c.slotOf(l), length(l));
    }
    settle(ctx);
    c.finish();
  }
}

void broadcast(const CollectiveContext& ctx, char* buf, size_t bytes, int root) {
  ShmChannel& ch = *ctx.local->channel;
  const size_t S = ch.slotBytes();
  const bool isRoot = ch.localRank() == root;
  const uint32_t chunks = chunkCount(ceilDiv(bytes, S));
  for (uint32_t k = 0; k < chunks; ++k) {
    const size_t first = std::min(bytes, S * k), n = std::min(bytes - first, S);
    Chunk c(ctx, k, chunks);
    c.acquire();
    if (isRoot) copyIn(ctx, c.mine(), buf + first, n);
    settle(ctx);
    c.post();
    c.awaitPosted();
    if (!isRoot) copyOut(ctx, buf + first, c.slotOf(root), n);
    settle(ctx);
    c.finish();
  }
}

void gather(const CollectiveContext& ctx, const char* in, char* out, size_t blockBytes, int root) {
  ShmChannel& ch = *ctx.local->channel;
  const int L = ch.localSize(), me = ch.localRank();
  const size_t S = ch.slotBytes();
  const uint32_t chunks = chunkCount(ceilDiv(blockBytes, S));
  for (uint32_t k = 0; k < chunks; ++k) {
    const size_t first = std::min(blockBytes, S * k), n = std::min(blockBytes - first, S);
    Chunk c(ctx, k, chunks);
    c.acquire();
    if (me != root) copyIn(ctx, c.mine(), in + first, n);
    settle(ctx);
    c.post();
    c.awaitPosted();
    if (me == root) {
      for (int l = 0; l < L; ++l) {
        if (l != me) copyOut(ctx, out + l * blockBytes + first, c.slotOf(l), n);
      }
    }
    settle(ctx);
    c.finish();
  }
  if (me == root && blockBytes > 0 && out + root * blockBytes != in) {
    if (ctx.device != nullptr) {
      ctx.device->copyWithinDevice(out + root * blockBytes, in, blockBytes);
    } else {
      std::memmove(out + root * blockBytes, in, blockBytes);
    }
  }
}

void scatter(const CollectiveContext& ctx, const char* in, char* out, size_t blockBytes, int root) {
  ShmChannel& ch = *ctx.local->channel;
  const int L = ch.localSize(), me = ch.localRank();
  // The root's slot holds one piece per rank.
  const size_t piece = std::max<size_t>(ShmChannel::kAlignBytes, ch.slotBytes() / L / ShmChannel::kAlignBytes *
                                                                     ShmChannel::kAlignBytes);
  HC_ENFORCE(piece * L <= ch.slotBytes(), "slots too small for ", L, " ranks");
  const uint32_t chunks = chunkCount(ceilDiv(blockBytes, piece));
  for (uint32_t k = 0; k < chunks; ++k) {
    const size_t first = std::min(blockBytes, piece * k), n = std::min(blockBytes - first, piece);
    Chunk c(ctx, k, chunks);
    c.acquire();
    if (me == root) {
      for (int l = 0; l < L; ++l) {
        if (l != me) copyIn(ctx, c.mine() + l * piece, in + l * blockBytes + first, n);
      }
    }
    settle(ctx);
    c.post();
    c.awaitPosted();
    if (me != root) copyOut(ctx, out + first, c.slotOf(root) + me * piece, n);
    settle(ctx);
    c.finish();
  }
  if (me == root && blockBytes > 0 && in + root * blockBytes != out) {
    if (ctx.device != nullptr) {
      ctx.device->copyWithinDevice(out, in + root * blockBytes, blockBytes);
    } else {
      std::memmove(out, in + root * blockBytes, blockBytes);
    }
  }
}

void alltoallv(const CollectiveContext& ctx, const char* in, const std::vector<size_t>& sendOffsets,
               const std::vector<size_t>& sendBytes, char* out, const std::vector<size_t>& recvOffsets,
               const std::vector<size_t>& recvBytes) {
  ShmChannel& ch = *ctx.local->channel;
  const int L = ch.localSize(), me = ch.localRank();
  const std::vector<int>& ranks = ctx.local->ranks;
  HC_ENFORCE(ch.slotBytes() >= static_cast<size_t>(L) * sizeof(uint64_t) && L * ShmChannel::kAlignBytes <= ch.slotBytes());
  // Round 0: every rank shows what it sends to whom; each checks what it will receive, and all
  // agree on the number of chunks from the largest message of any pair.
  size_t largest = 0;
  {
    Chunk c(ctx, 0, 0);
    c.acquire();
    for (int l = 0; l < L; ++l) {
      const uint64_t v = sendBytes[l];
      std::memcpy(c.mine() + l * sizeof(uint64_t), &v, sizeof(v));
    }
    c.post();
    c.awaitPosted();
    for (int l = 0; l < L; ++l) {
      for (int t = 0; t < L; ++t) {
        uint64_t v;
        std::memcpy(&v, c.slotOf(l) + t * sizeof(uint64_t), sizeof(v));
        largest = std::max<size_t>(largest, v);
        if (t == me && v != recvBytes[l]) {
          throw CommError(strCat(ctx.prefix(), ": rank ", ranks[l], " sends ", v, " bytes to this rank, which expects ",
                                 recvBytes[l], " (split sizes differ across ranks)"));
        }
      }
    }
    c.finish();
  }
  const size_t piece = ch.slotBytes() / L / ShmChannel::kAlignBytes * ShmChannel::kAlignBytes;
  const uint32_t chunks = chunkCount(ceilDiv(largest, piece));
  for (uint32_t k = 0; k < chunks; ++k) {
    auto part = [&](size_t total) { return std::min(total - std::min(total, piece * k), piece); };
    Chunk c(ctx, k + 1, chunks);
    c.acquire();
    for (int l = 0; l < L; ++l) copyIn(ctx, c.mine() + l * piece, in + sendOffsets[l] + piece * k, part(sendBytes[l]));
    settle(ctx);
    c.post();
    c.awaitPosted();
    for (int l = 0; l < L; ++l) {
      copyOut(ctx, out + recvOffsets[l] + piece * k, c.slotOf(l) + me * piece, part(recvBytes[l]));
    }
    settle(ctx);
    c.finish();
  }
}

void barrier(const CollectiveContext& ctx) {
  Chunk c(ctx, 0, 1);
  c.acquire();
  c.post();
  c.awaitPosted();
  c.finish();
}

}  // namespace local
}  // namespace hetcomm
