#include "backend/torch_inner.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <numeric>
#include <thread>

#include "algorithms/device_ops.h"
#include "common/error.h"
#include "kernels/reduce.h"

namespace hetcomm {
namespace {

at::ScalarType scalarOf(DType t) {
  switch (t) {
    case DType::kFloat32: return at::kFloat;
    case DType::kFloat64: return at::kDouble;
    case DType::kFloat16: return at::kHalf;
    case DType::kBFloat16: return at::kBFloat16;
    case DType::kInt8: return at::kChar;
    case DType::kUInt8: return at::kByte;
    case DType::kInt32: return at::kInt;
    case DType::kInt64: return at::kLong;
    case DType::kBool: return at::kBool;
  }
  return at::kByte;
}

c10d::ReduceOp reduceOpOf(RedOp op, DType dtype) {
  // Bools are bytes to Gloo and NCCL: SUM would add them (2, 3), not OR them as hetcomm does.
  if (dtype == DType::kBool && (op == RedOp::kSum || op == RedOp::kAvg)) return c10d::ReduceOp(c10d::ReduceOp::MAX);
  if (dtype == DType::kBool && op == RedOp::kProduct) return c10d::ReduceOp(c10d::ReduceOp::MIN);
  switch (op) {
    case RedOp::kSum:
    case RedOp::kAvg: return c10d::ReduceOp(c10d::ReduceOp::SUM);  // divided around it, see avgScalesInputs
    case RedOp::kProduct: return c10d::ReduceOp(c10d::ReduceOp::PRODUCT);
    case RedOp::kMin: return c10d::ReduceOp(c10d::ReduceOp::MIN);
    case RedOp::kMax: return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case RedOp::kBand: return c10d::ReduceOp(c10d::ReduceOp::BAND);
    case RedOp::kBor: return c10d::ReduceOp(c10d::ReduceOp::BOR);
    case RedOp::kBxor: return c10d::ReduceOp(c10d::ReduceOp::BXOR);
  }
  return c10d::ReduceOp(c10d::ReduceOp::SUM);
}

std::vector<size_t> prefix(const std::vector<size_t>& sizes) {
  std::vector<size_t> out(sizes.size(), 0);
  for (size_t i = 1; i < sizes.size(); ++i) out[i] = out[i - 1] + sizes[i - 1];
  return out;
}

}  // namespace

TorchInnerLevel::TorchInnerLevel(c10::intrusive_ptr<c10d::Backend> backend, std::string name)
    : backend_(std::move(backend)), name_(std::move(name)), cuda_(name_ == "nccl") {
  TORCH_CHECK(backend_, "hetcomm: no process group for the inner level ", name_);
  TORCH_CHECK(name_ == "gloo" || name_ == "nccl", "hetcomm: inner level ", name_, ": gloo or nccl");
}

at::Tensor TorchInnerLevel::tensorOver(const CollectiveContext& ctx, const void* data, size_t count,
                                       DType dtype) const {
  auto options = at::TensorOptions().dtype(scalarOf(dtype));
  if (cuda_) {
    const c10::Device current = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice();
    options = options.device(current);
  }
  (void)ctx;
  // Nothing to wrap: an empty tensor's pointer may be null, which from_blob refuses for a CUDA
  // device ("not registered with any CUDA device"), and the level neither reads nor writes it.
  if (count == 0) return at::empty({0}, options);
  return at::from_blob(const_cast<void*>(data), {static_cast<int64_t>(count)}, options);
}

void TorchInnerLevel::settle(const CollectiveContext& ctx) const {
  if (ctx.device != nullptr && ctx.device->hostAddressable()) ctx.device->waitFor(ctx.device->mark());
}

std::chrono::milliseconds TorchInnerLevel::remaining(const CollectiveContext& ctx) const {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(ctx.deadline - Clock::now());
  return std::max(std::chrono::milliseconds(1), left);
}

void TorchInnerLevel::deadPeer(const CollectiveContext& ctx, const char* what, const std::string& why) const {
  const LocalGroup* local = ctx.local;
  if (local == nullptr || !local->peerAlive) return;
  for (int l = 0; l < local->localSize(); ++l) {
    if (l != local->me && !local->peerAlive(l)) {
      throw PeerClosedError(strCat(ctx.prefix(), ": rank ", local->ranks[l], " of this host is gone or gave up (",
                                   "seen in the host's ", name_, " inner level, in its ", what,
                                   why.empty() ? "" : ": ", why, ")"),
                            local->ranks[l]);
    }
  }
}

void TorchInnerLevel::fail(const CollectiveContext& ctx, const char* what, const std::string& why) const {
  // Name a rank of the host whose process is gone, if any: that is what the group fails on. A
  // library's error may come a moment before the liveness connection reports the hang-up.
  for (int i = 0; i < 20; ++i) {
    deadPeer(ctx, what, why);
    if (Clock::now() >= ctx.deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  throw CommError(strCat(ctx.prefix(), ": the host's ", name_, " inner level failed in its ", what, ": ", why));
}

bool TorchInnerLevel::takes(DType dtype, RedOp op) const {
  // NCCL has no bitwise reductions (torch refuses them when the call is made).
  return !(cuda_ && (op == RedOp::kBand || op == RedOp::kBor || op == RedOp::kBxor));
}

void TorchInnerLevel::finish(const CollectiveContext& ctx, const std::function<c10::intrusive_ptr<c10d::Work>()>& issue,
                             const char* what) const {
  c10::intrusive_ptr<c10d::Work> work;
  // Given up on: the library may still write into the collective's memory, which it does not
  // own. Abort it (NCCL) and wait until it lets go (Gloo ends at its own timeout, the group's, or
  // as soon as a dead peer's sockets close), then report.
  auto release = [&] {
    if (!work) return;
    if (cuda_) {
      try {
        backend_->abort();
      } catch (...) {
      }
    }
    try {
      work->wait();
    } catch (...) {
    }
  };
  try {
    work = issue();   // the library may refuse the call itself (arguments, a lazy communicator set-up)
    // Not one long wait: the library notices a peer whose process died (its sockets close) but not
    // a peer that gave up alive, nor this group's abort. Poll, and ask the liveness connections.
    auto pause = std::chrono::microseconds(20);
    auto lastCheck = Clock::now();
    while (!work->isCompleted()) {
      if (aborted_.load()) fail(ctx, what, "the group failed (aborted) while this rank waited in it");
      const auto now = Clock::now();
      if (now >= ctx.deadline) fail(ctx, what, strCat("timed out after ", ctx.timeoutMs, " ms"));
      if (now - lastCheck >= std::chrono::milliseconds(100)) {
        lastCheck = now;
        deadPeer(ctx, what, "");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(2));
    }
    work->wait();     // raises the library's error, if any
  } catch (const CommError&) {
    release();
    throw;
  } catch (const std::exception& e) {
    release();
    fail(ctx, what, e.what());
  }
}

void TorchInnerLevel::allreduce(const CollectiveContext& ctx, char* buf, size_t count, DType dtype, RedOp op,
                                double divisor) {
  if (count == 0) return;
  settle(ctx);
  at::Tensor t = tensorOver(ctx, buf, count, dtype);
  const bool before = divisor > 0 && avgScalesInputs(dtype);
  if (before) t.div_(divisor);
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions o;
  o.reduceOp = reduceOpOf(op, dtype);
  o.timeout = remaining(ctx);
  finish(ctx, [&] { return backend_->allreduce(v, o); }, "allreduce");
  if (divisor > 0 && !before) t.div_(divisor);
}

void TorchInnerLevel::reduceScatterv(const CollectiveContext& ctx, char* work, const std::vector<size_t>& counts,
                                     DType dtype, RedOp op, double divisor) {
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  if (total == 0) return;
  settle(ctx);
  const size_t es = elementSize(dtype);
  const int me = ctx.local->me;
  const std::vector<size_t> at = prefix(counts);
  at::Tensor whole = tensorOver(ctx, work, total, dtype);
  const bool before = divisor > 0 && avgScalesInputs(dtype);
  if (before) whole.div_(divisor);
  at::Tensor mine = tensorOver(ctx, work + at[me] * es, counts[me], dtype);
  c10d::ReduceScatterOptions o;
  o.reduceOp = reduceOpOf(op, dtype);
  o.timeout = remaining(ctx);
  // NCCL, equal blocks: one reduce-scatter of the whole buffer into this rank's block. (Not Gloo:
  // its reduce-scatter work never reports completion to a poll, only to a blocking wait.)
  if (cuda_ && std::all_of(counts.begin(), counts.end(), [&](size_t c) { return c == counts[0]; })) {
    at::Tensor out = mine.clone();
    finish(ctx, [&] { return backend_->_reduce_scatter_base(out, whole, o); }, "reduce-scatter");
    mine.copy_(out);
  } else {
    // One reduce per block, to the block's holder (blocks of no bytes are skipped alike on every
    // rank).
    c10d::ReduceOptions r;
    r.reduceOp = o.reduceOp;
    for (size_t l = 0; l < counts.size(); ++l) {
      if (counts[l] == 0) continue;
      std::vector<at::Tensor> v{tensorOver(ctx, work + at[l] * es, counts[l], dtype)};
      r.rootRank = static_cast<int64_t>(l);
      r.timeout = remaining(ctx);
      finish(ctx, [&] { return backend_->reduce(v, r); }, "reduce-scatter");
    }
  }
  if (divisor > 0 && !before) mine.div_(divisor);
}

void TorchInnerLevel::allgatherv(const CollectiveContext& ctx, char* out, const std::vector<size_t>& blockBytes) {
  settle(ctx);
  const std::vector<size_t> at = prefix(blockBytes);
  const int me = ctx.local->me;
  if (std::all_of(blockBytes.begin(), blockBytes.end(), [&](size_t b) { return b == blockBytes[0]; })) {
    if (blockBytes[0] == 0) return;
    at::Tensor whole = tensorOver(ctx, out, blockBytes[0] * blockBytes.size(), DType::kUInt8);
    at::Tensor mine = tensorOver(ctx, out + at[me], blockBytes[me], DType::kUInt8).clone();
    c10d::AllgatherOptions o;
    o.timeout = remaining(ctx);
    finish(ctx, [&] { return backend_->_allgather_base(whole, mine, o); }, "all-gather");
    return;
  }
  // Unequal blocks (Gloo's all-gather takes equal ones only): one broadcast per block from its holder.
  c10d::BroadcastOptions o;
  for (size_t l = 0; l < blockBytes.size(); ++l) {
    if (blockBytes[l] == 0) continue;
    std::vector<at::Tensor> v{tensorOver(ctx, out + at[l], blockBytes[l], DType::kUInt8)};
    o.rootRank = static_cast<int64_t>(l);
    o.timeout = remaining(ctx);
    finish(ctx, [&] { return backend_->broadcast(v, o); }, "all-gather");
  }
}

void TorchInnerLevel::broadcast(const CollectiveContext& ctx, char* buf, size_t bytes, int root) {
  if (bytes == 0) return;
  settle(ctx);
  std::vector<at::Tensor> v{tensorOver(ctx, buf, bytes, DType::kUInt8)};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  o.timeout = remaining(ctx);
  finish(ctx, [&] { return backend_->broadcast(v, o); }, "broadcast");
}

void TorchInnerLevel::gather(const CollectiveContext& ctx, const char* in, char* out, size_t blockBytes, int root) {
  if (blockBytes == 0) return;
  settle(ctx);
  const int L = ctx.local->localSize();
  std::vector<at::Tensor> input{tensorOver(ctx, in, blockBytes, DType::kUInt8)};
  std::vector<std::vector<at::Tensor>> outputs;
  if (ctx.local->me == root) {
    outputs.emplace_back();
    for (int l = 0; l < L; ++l) outputs[0].push_back(tensorOver(ctx, out + l * blockBytes, blockBytes, DType::kUInt8));
  }
  c10d::GatherOptions o;
  o.rootRank = root;
  o.timeout = remaining(ctx);
  finish(ctx, [&] { return backend_->gather(outputs, input, o); }, "gather");
}

void TorchInnerLevel::scatter(const CollectiveContext& ctx, const char* in, char* out, size_t blockBytes, int root) {
  if (blockBytes == 0) return;
  settle(ctx);
  const int L = ctx.local->localSize();
  std::vector<at::Tensor> output{tensorOver(ctx, out, blockBytes, DType::kUInt8)};
  std::vector<std::vector<at::Tensor>> inputs;
  if (ctx.local->me == root) {
    inputs.emplace_back();
    for (int l = 0; l < L; ++l) inputs[0].push_back(tensorOver(ctx, in + l * blockBytes, blockBytes, DType::kUInt8));
  }
  c10d::ScatterOptions o;
  o.rootRank = root;
  o.timeout = remaining(ctx);
  finish(ctx, [&] { return backend_->scatter(output, inputs, o); }, "scatter");
}

void TorchInnerLevel::alltoallv(const CollectiveContext& ctx, const char* in, const std::vector<size_t>& sendOffsets,
                                const std::vector<size_t>& sendBytes, char* out,
                                const std::vector<size_t>& recvOffsets, const std::vector<size_t>& recvBytes) {
  settle(ctx);
  // One all-to-all of bytes with split sizes (Gloo's list form takes equal blocks only); blocks
  // that do not lie back to back in rank order are packed into, or unpacked from, a copy.
  const size_t sendTotal = std::accumulate(sendBytes.begin(), sendBytes.end(), size_t{0});
  const size_t recvTotal = std::accumulate(recvBytes.begin(), recvBytes.end(), size_t{0});
  const std::vector<size_t> sendAt = prefix(sendBytes), recvAt = prefix(recvBytes);
  const bool packedIn = sendOffsets == sendAt, packedOut = recvOffsets == recvAt;
  at::Tensor input = tensorOver(ctx, in, sendTotal, DType::kUInt8);
  if (!packedIn) {
    input = at::empty({static_cast<int64_t>(sendTotal)}, input.options());
    for (size_t l = 0; l < sendBytes.size(); ++l) {
      input.narrow(0, static_cast<int64_t>(sendAt[l]), static_cast<int64_t>(sendBytes[l]))
          .copy_(tensorOver(ctx, in + sendOffsets[l], sendBytes[l], DType::kUInt8));
    }
  }
  at::Tensor output = packedOut ? tensorOver(ctx, out, recvTotal, DType::kUInt8)
                                : at::empty({static_cast<int64_t>(recvTotal)}, input.options());
  std::vector<int64_t> outSplits(recvBytes.begin(), recvBytes.end()), inSplits(sendBytes.begin(), sendBytes.end());
  c10d::AllToAllOptions o;
  o.timeout = remaining(ctx);
  finish(ctx, [&] { return backend_->alltoall_base(output, input, outSplits, inSplits, o); }, "all-to-all");
  if (!packedOut) {
    for (size_t l = 0; l < recvBytes.size(); ++l) {
      tensorOver(ctx, out + recvOffsets[l], recvBytes[l], DType::kUInt8)
          .copy_(output.narrow(0, static_cast<int64_t>(recvAt[l]), static_cast<int64_t>(recvBytes[l])));
    }
  }
}

void TorchInnerLevel::barrier(const CollectiveContext& ctx) {
  c10d::BarrierOptions o;
  o.timeout = remaining(ctx);
  finish(ctx, [&] { return backend_->barrier(o); }, "barrier");
}

void TorchInnerLevel::abort(int) noexcept {
  aborted_.store(true);
  try {
    backend_->abort();
  } catch (...) {
  }
}

}  // namespace hetcomm
