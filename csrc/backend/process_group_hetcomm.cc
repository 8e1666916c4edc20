#include "backend/process_group_hetcomm.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

#include <random>

#include "algorithms/emulated_device_ops.h"
#include "backend/cuda_device_ops.h"
#include "backend/device_streams.h"
#include "backend/tensor_checks.h"
#include "common/env.h"
#include "common/logging.h"

namespace hetcomm {
namespace {

constexpr const char* kSecretKey = "hetcomm/secret";
std::string addressKey(int rank) { return strCat("hetcomm/addr/", rank); }
// Where a rank leaves the reason it gave up, for the peers that only see its connection close.
std::string abortKey(int rank) { return strCat("hetcomm/abort/", rank); }
// How long a rank that lost a peer waits for that peer's reason to appear in the store.
constexpr std::chrono::milliseconds kAbortReasonWait{2000};
// The emulated device (HETCOMM_DEBUG_EMULATE_DEVICE): small slots and few of them, so that the
// tests' medium-sized tensors already span several slots and wait for slots to come free, and a
// random pause before each queued operation, so that missing waits show up as wrong bytes.
constexpr size_t kEmulatedSlotBytes = 16 * 1024;
constexpr int kEmulatedSlots = 4;
constexpr int kEmulatedJitterUs = 20;

// The address other ranks can reach us on: HETCOMM_SOCKET_IFNAME's, else the one the kernel
// routes towards the store's host (the host every rank already reaches), else loopback.
std::string chooseListenIp(const c10::intrusive_ptr<c10d::Store>& store) {
  const std::string ifname = envStr("HETCOMM_SOCKET_IFNAME");
  if (!ifname.empty()) return interfaceAddress(ifname);
  c10::intrusive_ptr<c10d::Store> s = store;
  while (auto* prefix = dynamic_cast<c10d::PrefixStore*>(s.get())) s = prefix->getUnderlyingStore();
  std::string host;
  if (auto* tcp = dynamic_cast<c10d::TCPStore*>(s.get())) host = tcp->getHost();
  if (host.empty()) host = envStr("MASTER_ADDR");
  if (host.empty()) return "127.0.0.1";
  return localAddressReaching(host);
}

std::exception_ptr distError(const std::string& message) {
  try {
    C10_THROW_ERROR(DistBackendError, message);
  } catch (...) {
    return std::current_exception();
  }
}

// Point-to-point errors arrive as CommError; torch users expect DistBackendError.
std::exception_ptr asDistError(std::exception_ptr e) {
  if (!e) return nullptr;
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return distError(x.what());
  } catch (...) {
    return distError("hetcomm: unknown error");
  }
}

}  // namespace

ProcessGroupHetcomm::ProcessGroupHetcomm(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                         Options options)
    : c10d::Backend(rank, size),
      store_(store),
      options_(std::move(options)),
      completions_(std::make_shared<CompletionPool>()),
      plan_(RingPlan::uniform(size)) {
  if (envInt("HETCOMM_DEBUG_EMULATE_DEVICE", 0) != 0) {
    emulatedDevice_ = std::make_unique<EmulatedDeviceOps>(kEmulatedSlotBytes, kEmulatedSlots, kEmulatedJitterUs);
  }
  try {
    const std::string ip = options_.listenIp.empty() ? chooseListenIp(store_) : options_.listenIp;
    TcpMesh::Secret secret{};
    if (rank == 0) {
      std::random_device rd;
      for (auto& b : secret) b = static_cast<uint8_t>(rd());
      store_->set(kSecretKey, std::vector<uint8_t>(secret.begin(), secret.end()));
    } else {
      store_->wait({kSecretKey}, options_.timeout);
      std::vector<uint8_t> got = store_->get(kSecretKey);
      TORCH_CHECK(got.size() == secret.size(), "hetcomm: malformed group secret in the store");
      std::copy(got.begin(), got.end(), secret.begin());
    }
    auto store = store_;
    auto lookup = [store](int peer, Deadline deadline) {
      const std::string key = addressKey(peer);
      store->wait({key}, std::chrono::milliseconds(std::max(1, msUntil(deadline))));
      std::vector<uint8_t> v = store->get(key);
      return HostPort::parse(std::string(v.begin(), v.end()));
    };
    mesh_ = std::make_unique<TcpMesh>(rank, size, ip, secret, lookup);
    p2p_ = std::make_unique<P2PEngine>(rank, size, mesh_.get());
    mesh_->setInboundP2PHandler([this](int peer, Socket s) { p2p_->addInbound(peer, std::move(s)); });
    const std::string addr = mesh_->listenAddress().str();
    store_->set(addressKey(rank), std::vector<uint8_t>(addr.begin(), addr.end()));
    HC_LOG(kInfo, "rank ", rank, "/", size, " listening on ", addr);
  } catch (const CommError& e) {
    TORCH_CHECK(false, "hetcomm: cannot create the process group on rank ", rank, ": ", e.what());
  }
  worker_ = std::thread([this] { runWorker(); });
}

ProcessGroupHetcomm::~ProcessGroupHetcomm() { shutdown(); }

uint64_t ProcessGroupHetcomm::getSequenceNumberForGroup() {
  std::lock_guard<std::mutex> lock(mu_);
  return nextSeq_;
}

RingPlan ProcessGroupHetcomm::plan() const {
  std::lock_guard<std::mutex> lock(mu_);
  return plan_;
}

void ProcessGroupHetcomm::setPlan(RingPlan plan) {
  try {
    plan.validate(size_);
  } catch (const CommError& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  std::lock_guard<std::mutex> lock(mu_);
  plan_ = std::move(plan);
}

std::chrono::milliseconds ProcessGroupHetcomm::effectiveTimeout(std::chrono::milliseconds requested) const {
  // Python leaves per-op timeouts unset (-1 ms): the group's timeout applies.
  return requested.count() > 0 ? requested : options_.timeout;
}

c10::Stream ProcessGroupHetcomm::collectiveStream(c10::Device device) {
  std::lock_guard<std::mutex> lock(mu_);
  DeviceState& state = devices_[device.index()];
  if (!state.collectiveStream) state.collectiveStream = poolStream(device);
  return *state.collectiveStream;
}

c10::Stream ProcessGroupHetcomm::p2pStream(c10::Device device) {
  std::lock_guard<std::mutex> lock(mu_);
  DeviceState& state = devices_[device.index()];
  if (!state.p2pStream) state.p2pStream = poolStream(device);
  return *state.p2pStream;
}

DeviceOps* ProcessGroupHetcomm::deviceOps(const c10::Stream& stream) {
  DeviceState* state;
  {
    std::lock_guard<std::mutex> lock(mu_);
    state = &devices_[stream.device_index()];  // std::map: the node stays where it is
  }
  if (!state->ops) {
#ifdef HETCOMM_WITH_CUDA
    state->ops = makeCudaDeviceOps(stream);
#else
    HC_ENFORCE(false, "a device operation in a build without CUDA");
#endif
  }
  return state->ops.get();
}

c10::intrusive_ptr<WorkHetcomm> ProcessGroupHetcomm::enqueue(c10d::OpType type, const char* profilingTitle,
                                                             CollectiveKind kind, std::vector<at::Tensor> inputs,
                                                             std::vector<at::Tensor> outputs, CollectiveHeader header,
                                                             std::chrono::milliseconds timeout, Body body) {
  const c10::Device device = commonDevice(inputs, outputs, collectiveName(static_cast<uint8_t>(kind)));
  std::optional<c10::Stream> stream;
  std::optional<c10::Event> inputsReady;
  if (device.is_cuda()) {
    stream = collectiveStream(device);
    inputsReady.emplace(markCurrentStream(device));
    keepAliveOnStream(inputs, *stream);
    keepAliveOnStream(outputs, *stream);
  }
  std::unique_lock<std::mutex> lock(mu_);
  header.seq = nextSeq_++;
  header.opcode = static_cast<uint8_t>(kind);
  auto work = c10::make_intrusive<WorkHetcomm>(rank_, type, profilingTitle, std::move(outputs), header.seq,
                                               completions_, stream);
  if (stopping_) {
    lock.unlock();
    work->complete(distError(strCat("hetcomm ", collectiveName(header.opcode), ": the process group is shut down")));
    return work;
  }
  queue_.push_back(Pending{work, header, timeout, std::move(body), stream, std::move(inputsReady)});
  cv_.notify_one();
  return work;
}

void ProcessGroupHetcomm::runWorker() {
  // The bodies write into tensors that may require grad (DDP's parameters in a broadcast).
  at::NoGradGuard noGrad;
  while (true) {
    Pending op;
    std::string broken;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      op = std::move(queue_.front());
      queue_.pop_front();
      broken = brokenReason_;
    }
    std::exception_ptr error;
    CollectiveContext ctx;
    ctx.rank = rank_;
    ctx.size = size_;
    ctx.header = op.header;
    if (!broken.empty()) {
      error = distError(strCat(ctx.prefix(), ": the process group is unusable after an earlier failure: ", broken));
    } else {
      ctx.timeoutMs = op.timeout.count();
      ctx.deadline = Clock::now() + op.timeout;
      ctx.segmentBytes = static_cast<size_t>(std::max<int64_t>(0, paramSegmentBytes()));
      ctx.fdOf = [this, &ctx](int peer) { return mesh_->collectiveFd(peer, ctx.deadline); };
      try {
        // A CUDA operation: every device-side step, the body's tensor operations included, goes on
        // the group's stream, after what the caller had queued when it issued the operation.
        std::optional<c10::DeviceGuard> onDevice;
        std::optional<c10::StreamGuard> onStream;
        if (op.stream) {
          onDevice.emplace(op.stream->device());
          onStream.emplace(*op.stream);
          op.inputsReady->block(*op.stream);
          ctx.device = deviceOps(*op.stream);
        } else {
          ctx.device = emulatedDevice_.get();
        }
        op.body(ctx);
      } catch (const PeerClosedError& e) {
        std::string msg = e.what();
        const std::string why = peerAbortReason(e.peer());
        if (!why.empty()) msg = strCat(msg, "; rank ", e.peer(), " reported: ", why);
        failGroup(msg);
        error = distError(msg);
      } catch (const CommError& e) {
        std::string msg = e.what();
        // Errors from below the collective layer (connecting, handshakes) lack the prefix.
        if (msg.rfind("hetcomm ", 0) != 0 || msg.rfind(ctx.prefix(), 0) != 0) msg = strCat(ctx.prefix(), ": ", msg);
        failGroup(msg);
        error = distError(msg);
      } catch (const std::exception& e) {
        std::string msg = strCat(ctx.prefix(), ": ", e.what());
        failGroup(msg);
        error = distError(msg);
      }
    }
    op.work->complete(error);
  }
}

std::string ProcessGroupHetcomm::peerAbortReason(int peer) {
  try {
    const std::string key = abortKey(peer);
    store_->wait({key}, kAbortReasonWait);
    std::vector<uint8_t> v = store_->get(key);
    return std::string(v.begin(), v.end());
  } catch (const std::exception&) {
    return "";  // it left none (killed?), or the store is gone with it
  }
}

void ProcessGroupHetcomm::failGroup(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!brokenReason_.empty()) return;
    brokenReason_ = reason;
  }
  HC_LOG(kError, reason);
  // Leave the reason for the peers before they see our connections close. Detached: a store
  // whose host died must not delay the abort; the store outlives the thread's short work.
  auto store = store_;
  const std::string key = abortKey(rank_);
  std::thread([store, key, reason] {
    try {
      store->set(key, std::vector<uint8_t>(reason.begin(), reason.end()));
    } catch (const std::exception&) {
    }
  }).detach();
  // Wake the peers blocked on us: they fail now instead of at their timeout.
  mesh_->abort();
}

void ProcessGroupHetcomm::abort() {
  failGroup("the process group was aborted");
  shutdown();
}

void ProcessGroupHetcomm::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !worker_.joinable()) return;
    stopping_ = true;
    cv_.notify_all();
  }
  // The worker finishes what was issued (each operation bounded by its timeout), then exits.
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
  if (p2p_) p2p_->stop("the process group was shut down");
  if (mesh_) mesh_->close();
  completions_->stop();
  // Rank 0 cleans the group's keys: it usually hosts the store, which is then alive during its own
  // shutdown, while other ranks may outlive it.
  if (rank_ == 0) {
    try {
      for (int r = 0; r < size_; ++r) {
        store_->deleteKey(addressKey(r));
        store_->deleteKey(abortKey(r));
      }
      store_->deleteKey(kSecretKey);
    } catch (const std::exception&) {
      // The store's host already exited; the keys went with it.
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Collectives: validate here, on the caller's thread; the body runs on the worker.

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::allreduce(std::vector<at::Tensor>& tensors,
                                                              const c10d::AllreduceOptions& opts) {
  checkCount(tensors, 1, "allreduce", "input");
  at::Tensor t = tensors[0];
  checkDense(t, "allreduce");
  const DType dt = toDType(t, "allreduce");
  const RedOp op = toRedOp(opts.reduceOp, "allreduce");
  checkReduce(dt, op, "allreduce");
  const RingPlan plan = this->plan().forBytes(t.nbytes());
  CollectiveHeader h;
  h.dtype = static_cast<uint8_t>(dt);
  h.redop = static_cast<uint8_t>(op);
  h.bytes = t.nbytes();
  h.algo = static_cast<uint8_t>(chooseAllreduceAlgo(t.nbytes(), size_));
  h.aux = h.algo == static_cast<uint8_t>(AllreduceAlgo::kRing) ? plan.fingerprint() : 0;
  return enqueue(c10d::OpType::ALLREDUCE, "hetcomm:all_reduce", CollectiveKind::kAllreduce, {t}, {t}, h,
                 effectiveTimeout(opts.timeout), [t, dt, op, plan](CollectiveContext& ctx) {
                   at::Tensor c = contiguousOf(t);
                   hetcomm::allreduce(ctx, static_cast<char*>(c.data_ptr()), c.numel(), dt, op, plan);
                   copyBackIfNeeded(t, c);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                        const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK_VALUE(!tensors.empty(), "hetcomm allreduce_coalesced: needs at least one tensor");
  checkDense(tensors[0], "allreduce_coalesced");
  checkSame(tensors, tensors[0].scalar_type(), -1, "allreduce_coalesced", "tensors");
  const DType dt = toDType(tensors[0], "allreduce_coalesced");
  const RedOp op = toRedOp(opts.reduceOp, "allreduce_coalesced");
  checkReduce(dt, op, "allreduce_coalesced");
  std::vector<size_t> sizes;
  size_t bytes = 0;
  for (const at::Tensor& t : tensors) {
    sizes.push_back(t.numel());
    bytes += t.nbytes();
  }
  const RingPlan plan = this->plan().forBytes(bytes);
  CollectiveHeader h;
  h.dtype = static_cast<uint8_t>(dt);
  h.redop = static_cast<uint8_t>(op);
  h.bytes = bytes;
  h.algo = static_cast<uint8_t>(chooseAllreduceAlgo(bytes, size_));
  h.aux = fingerprintSizes(sizes) ^ (h.algo == static_cast<uint8_t>(AllreduceAlgo::kRing) ? plan.fingerprint() : 0);
  std::vector<at::Tensor> ts = tensors;
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, "hetcomm:all_reduce_coalesced", CollectiveKind::kAllreduce, ts, ts, h,
                 effectiveTimeout(opts.timeout), [ts, dt, op, plan](CollectiveContext& ctx) {
                   at::Tensor flat = flattenAll(ts);
                   hetcomm::allreduce(ctx, static_cast<char*>(flat.data_ptr()), flat.numel(), dt, op, plan);
                   int64_t off = 0;
                   for (const at::Tensor& t : ts) {
                     const_cast<at::Tensor&>(t).copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
                     off += t.numel();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::reduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::ReduceOptions& opts) {
  checkCount(tensors, 1, "reduce", "input");
  at::Tensor t = tensors[0];
  checkDense(t, "reduce");
  checkRoot(opts.rootRank, size_, "reduce");
  const int root = static_cast<int>(opts.rootRank);
  const DType dt = toDType(t, "reduce");
  const RedOp op = toRedOp(opts.reduceOp, "reduce");
  checkReduce(dt, op, "reduce");
  const RingPlan plan = this->plan().forBytes(t.nbytes());
  CollectiveHeader h;
  h.dtype = static_cast<uint8_t>(dt);
  h.redop = static_cast<uint8_t>(op);
  h.bytes = t.nbytes();
  h.algo = static_cast<uint8_t>(chooseAllreduceAlgo(t.nbytes(), size_));
  h.aux = (h.algo == static_cast<uint8_t>(AllreduceAlgo::kRing) ? plan.fingerprint() : 0) ^ static_cast<uint64_t>(root);
  const int rank = rank_;
  // Reduced as an allreduce on a private copy, so that non-root inputs stay untouched.
  return enqueue(c10d::OpType::REDUCE, "hetcomm:reduce", CollectiveKind::kReduce, {t}, {t}, h,
                 effectiveTimeout(opts.timeout), [t, dt, op, plan, root, rank](CollectiveContext& ctx) {
                   at::Tensor c = rank == root ? contiguousOf(t) : t.contiguous().clone();
                   hetcomm::allreduce(ctx, static_cast<char*>(c.data_ptr()), c.numel(), dt, op, plan);
                   if (rank == root) copyBackIfNeeded(t, c);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::broadcast(std::vector<at::Tensor>& tensors,
                                                              const c10d::BroadcastOptions& opts) {
  checkCount(tensors, 1, "broadcast", "input");
  at::Tensor t = tensors[0];
  checkDense(t, "broadcast");
  TORCH_CHECK_VALUE(opts.rootTensor == 0, "hetcomm broadcast: rootTensor must be 0");
  checkRoot(opts.rootRank, size_, "broadcast");
  const int root = static_cast<int>(opts.rootRank);
  CollectiveHeader h;
  h.dtype = static_cast<uint8_t>(toDType(t, "broadcast"));
  h.bytes = t.nbytes();
  h.aux = static_cast<uint64_t>(root);
  return enqueue(c10d::OpType::BROADCAST, "hetcomm:broadcast", CollectiveKind::kBroadcast, {t}, {t}, h,
                 effectiveTimeout(opts.timeout), [t, root](CollectiveContext& ctx) {
                   at::Tensor c = contiguousOf(t);
                   hetcomm::broadcast(ctx, static_cast<char*>(c.data_ptr()), c.nbytes(), root);
                   copyBackIfNeeded(t, c);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllgatherOptions& opts) {
  checkCount(inputs, 1, "allgather", "input");
  TORCH_CHECK_VALUE(outputs.size() == 1, "hetcomm allgather: expects one output list per process, got ",
                    outputs.size());
  at::Tensor in = inputs[0];
  checkDense(in, "allgather");
  std::vector<at::Tensor> outs = outputs[0];
  checkCount(outs, static_cast<size_t>(size_), "allgather", "output");
  checkSame(outs, in.scalar_type(), -1, "allgather", "output");
  TORCH_CHECK_VALUE(outs[rank_].numel() == in.numel(), "hetcomm allgather: output[", rank_, "] has ",
                    outs[rank_].numel(), " elements but this rank's input has ", in.numel());
  std::vector<size_t> blockBytes;
  size_t total = 0;
  for (const at::Tensor& o : outs) {
    blockBytes.push_back(o.nbytes());
    total += o.nbytes();
  }
  const RingPlan plan = this->plan();
  CollectiveHeader h;
  h.dtype = static_cast<uint8_t>(toDType(in, "allgather"));
  h.bytes = total;
  h.aux = fingerprintSizes(blockBytes) ^ plan.fingerprint();
  const int rank = rank_;
  return enqueue(c10d::OpType::ALLGATHER, "hetcomm:all_gather", CollectiveKind::kAllgather, {in}, outs, h,
                 effectiveTimeout(opts.timeout), [in, outs, blockBytes, total, plan, rank](CollectiveContext& ctx) {
                   at::Tensor flat = at::empty({static_cast<int64_t>(total)}, in.options().dtype(at::kByte));
                   char* base = static_cast<char*>(flat.data_ptr());
                   size_t off = 0;
                   for (int r = 0; r < rank; ++r) off += blockBytes[r];
                   at::Tensor c = contiguousOf(in);
                   if (c.nbytes() > 0) flat.narrow(0, off, c.nbytes()).copy_(asBytes(c));
                   hetcomm::allgatherv(ctx, base, blockBytes, plan);
                   off = 0;
                   for (size_t r = 0; r < outs.size(); ++r) {
                     at::Tensor block = flat.narrow(0, off, blockBytes[r]).view(outs[r].scalar_type());
                     const_cast<at::Tensor&>(outs[r]).copy_(block.view(outs[r].sizes()));
                     off += blockBytes[r];
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                    const c10d::AllgatherOptions& opts) {
  checkDense(input, "allgather_into_tensor");
  checkDense(output, "allgather_into_tensor");
  TORCH_CHECK_TYPE(output.scalar_type() == input.scalar_type(), "hetcomm allgather_into_tensor: output dtype ",
                   output.scalar_type(), " differs from input dtype ", input.scalar_type());
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size_, "hetcomm allgather_into_tensor: output has ",
                    output.numel(), " elements, expected input numel x world size = ", input.numel() * size_);
  const RingPlan plan = this->plan();
  CollectiveHeader h;
  h.dtype = static_cast<uint8_t>(toDType(input, "allgather_into_tensor"));
  h.bytes = output.nbytes();
  h.aux = plan.fingerprint();
  at::Tensor in = input, out = output;
  const int rank = rank_, size = size_;
  return enqueue(c10d::OpType::_ALLGATHER_BASE, "hetcomm:all_gather_into_tensor", CollectiveKind::kAllgather, {in}, {out}, h,
                 effectiveTimeout(opts.timeout), [in, out, plan, rank, size](CollectiveContext& ctx) {
                   at::Tensor o = contiguousOf(out);
                   at::Tensor i = contiguousOf(in);
                   const size_t block = i.nbytes();
                   char* base = static_cast<char*>(o.data_ptr());
                   // FSDP passes an input that is a view of its own slot of the output: nothing to copy.
                   if (block > 0 && base + rank * block != i.data_ptr()) {
                     asBytes(o).narrow(0, rank * block, block).copy_(asBytes(i));
                   }
                   hetcomm::allgatherv(ctx, base, std::vector<size_t>(size, block), plan);
                   copyBackIfNeeded(out, o);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "hetcomm allgather_into_tensor_coalesced: ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  // Gathered as one flat allgather: block r is every input's rank-r share, back to back.
  std::vector<at::Tensor> flatIns;
  for (size_t k = 0; k < inputs.size(); ++k) {
    checkDense(inputs[k], "allgather_into_tensor_coalesced");
    checkDense(outputs[k], "allgather_into_tensor_coalesced");
    TORCH_CHECK_VALUE(outputs[k].numel() == inputs[k].numel() * size_ &&
                          outputs[k].scalar_type() == inputs[k].scalar_type(),
                      "hetcomm allgather_into_tensor_coalesced: output ", k, " must hold world size x input ", k);
  }
  const RingPlan plan = this->plan();
  size_t block = 0;
  for (const at::Tensor& t : inputs) block += t.nbytes();
  CollectiveHeader h;
  h.bytes = block * size_;
  h.aux = plan.fingerprint();
  std::vector<at::Tensor> ins = inputs, outs = outputs;
  const int rank = rank_, size = size_;
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, "hetcomm:all_gather_into_tensor_coalesced",
                 CollectiveKind::kAllgather, ins, outs, h, effectiveTimeout(opts.timeout),
                 [ins, outs, block, plan, rank, size](CollectiveContext& ctx) {
                   at::Tensor flat =
                       at::empty({static_cast<int64_t>(block * size)},
                                 (outs.empty() ? at::TensorOptions() : outs[0].options()).dtype(at::kByte));
                   size_t off = rank * block;
                   for (const at::Tensor& t : ins) {
                     at::Tensor c = contiguousOf(t);
                     if (c.nbytes() > 0) flat.narrow(0, off, c.nbytes()).copy_(asBytes(c));
                     off += c.nbytes();
                   }
                   hetcomm::allgatherv(ctx, static_cast<char*>(flat.data_ptr()), std::vector<size_t>(size, block),
                                       plan);
                   // Block r holds every input's rank-r share: output k takes its piece of each block.
                   const at::Tensor blocks = flat.view({size, static_cast<int64_t>(block)});
                   int64_t inner = 0;
                   for (size_t k = 0; k < ins.size(); ++k) {
                     const int64_t nb = static_cast<int64_t>(ins[k].nbytes());
                     at::Tensor o = contiguousOf(outs[k]);
                     if (nb > 0) asBytes(o).view({size, nb}).copy_(blocks.narrow(1, inner, nb));
                     copyBackIfNeeded(outs[k], o);
                     inner += nb;
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::GatherOptions& opts) {
  checkCount(inputs, 1, "gather", "input");
  at::Tensor in = inputs[0];
  checkDense(in, "gather");
  checkRoot(opts.rootRank, size_, "gather");
  const int root = static_cast<int>(opts.rootRank);
  const std::vector<at::Tensor> outs = rootOnlyList(outputs, rank_ == root, size_, in, "gather", "output");
  CollectiveHeader h;
  h.dtype = static_cast<uint8_t>(toDType(in, "gather"));
  h.bytes = in.nbytes();
  h.aux = static_cast<uint64_t>(root);
  const int rank = rank_, size = size_;
  return enqueue(c10d::OpType::GATHER, "hetcomm:gather", CollectiveKind::kGather, {in}, outs, h,
                 effectiveTimeout(opts.timeout), [in, outs, root, rank, size](CollectiveContext& ctx) {
                   at::Tensor c = contiguousOf(in);
                   const size_t block = c.nbytes();
                   if (rank != root) {
                     hetcomm::gather(ctx, static_cast<const char*>(c.data_ptr()), nullptr, block, root);
                     return;
                   }
                   at::Tensor flat = at::empty({static_cast<int64_t>(block * size)}, c.options().dtype(at::kByte));
                   hetcomm::gather(ctx, static_cast<const char*>(c.data_ptr()), static_cast<char*>(flat.data_ptr()),
                                   block, root);
                   for (int r = 0; r < size; ++r) {
                     at::Tensor piece = flat.narrow(0, r * block, block).view(in.scalar_type()).view(in.sizes());
                     const_cast<at::Tensor&>(outs[r]).copy_(piece.view(outs[r].sizes()));
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::scatter(std::vector<at::Tensor>& outputs,
                                                            std::vector<std::vector<at::Tensor>>& inputs,
                                                            const c10d::ScatterOptions& opts) {
  checkCount(outputs, 1, "scatter", "output");
  at::Tensor out = outputs[0];
  checkDense(out, "scatter");
  checkRoot(opts.rootRank, size_, "scatter");
  const int root = static_cast<int>(opts.rootRank);
  const std::vector<at::Tensor> ins = rootOnlyList(inputs, rank_ == root, size_, out, "scatter", "input");
  CollectiveHeader h;
  h.dtype = static_cast<uint8_t>(toDType(out, "scatter"));
  h.bytes = out.nbytes();
  h.aux = static_cast<uint64_t>(root);
  const int rank = rank_;
  return enqueue(c10d::OpType::SCATTER, "hetcomm:scatter", CollectiveKind::kScatter, ins, {out}, h,
                 effectiveTimeout(opts.timeout), [ins, out, root, rank](CollectiveContext& ctx) {
                   at::Tensor o = contiguousOf(out);
                   at::Tensor flat = rank == root ? flattenAll(ins) : at::Tensor();
                   hetcomm::scatter(ctx, rank == root ? static_cast<const char*>(flat.data_ptr()) : nullptr,
                                    static_cast<char*>(o.data_ptr()), o.nbytes(), root);
                   copyBackIfNeeded(out, o);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                                   const c10d::ReduceScatterOptions& opts) {
  checkCount(outputs, 1, "reduce_scatter", "output");
  TORCH_CHECK_VALUE(inputs.size() == 1, "hetcomm reduce_scatter: expects one input list per process");
  at::Tensor out = outputs[0];
  checkDense(out, "reduce_scatter");
  std::vector<at::Tensor> ins = inputs[0];
  checkCount(ins, static_cast<size_t>(size_), "reduce_scatter", "input");
  checkSame(ins, out.scalar_type(), -1, "reduce_scatter", "input");
  TORCH_CHECK_VALUE(ins[rank_].numel() == out.numel(), "hetcomm reduce_scatter: input[", rank_, "] has ",
                    ins[rank_].numel(), " elements but the output has ", out.numel());
  const DType dt = toDType(out, "reduce_scatter");
  const RedOp op = toRedOp(opts.reduceOp, "reduce_scatter");
  checkReduce(dt, op, "reduce_scatter");
  std::vector<size_t> counts;
  for (const at::Tensor& t : ins) counts.push_back(t.numel());
  const RingPlan plan = this->plan();
  CollectiveHeader h;
  h.dtype = static_cast<uint8_t>(dt);
  h.redop = static_cast<uint8_t>(op);
  h.bytes = 0;
  for (const at::Tensor& t : ins) h.bytes += t.nbytes();
  h.aux = fingerprintSizes(counts) ^ plan.fingerprint();
  const int rank = rank_;
  return enqueue(c10d::OpType::REDUCE_SCATTER, "hetcomm:reduce_scatter", CollectiveKind::kReduceScatter, ins, {out}, h,
                 effectiveTimeout(opts.timeout), [ins, out, counts, dt, op, plan, rank](CollectiveContext& ctx) {
                   at::Tensor work = flattenAll(ins);
                   hetcomm::reduceScatterv(ctx, static_cast<char*>(work.data_ptr()), counts, dt, op, plan);
                   int64_t off = 0;
                   for (int r = 0; r < rank; ++r) off += counts[r];
                   const_cast<at::Tensor&>(out).copy_(work.narrow(0, off, counts[rank]).view(out.sizes()));
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                        const c10d::ReduceScatterOptions& opts) {
  checkDense(input, "reduce_scatter_tensor");
  checkDense(output, "reduce_scatter_tensor");
  TORCH_CHECK_TYPE(output.scalar_type() == input.scalar_type(), "hetcomm reduce_scatter_tensor: output dtype ",
                   output.scalar_type(), " differs from input dtype ", input.scalar_type());
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size_, "hetcomm reduce_scatter_tensor: input has ",
                    input.numel(), " elements, expected output numel x world size = ", output.numel() * size_);
  const DType dt = toDType(input, "reduce_scatter_tensor");
  const RedOp op = toRedOp(opts.reduceOp, "reduce_scatter_tensor");
  checkReduce(dt, op, "reduce_scatter_tensor");
  const RingPlan plan = this->plan();
  CollectiveHeader h;
  h.dtype = static_cast<uint8_t>(dt);
  h.redop = static_cast<uint8_t>(op);
  h.bytes = input.nbytes();
  h.aux = plan.fingerprint();
  at::Tensor in = input, out = output;
  const int rank = rank_, size = size_;
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, "hetcomm:reduce_scatter_tensor", CollectiveKind::kReduceScatter,
                 {in}, {out}, h, effectiveTimeout(opts.timeout), [in, out, dt, op, plan, rank, size](CollectiveContext& ctx) {
                   at::Tensor work = in.contiguous().clone();  // the input stays untouched
                   const size_t n = static_cast<size_t>(out.numel());
                   hetcomm::reduceScatterv(ctx, static_cast<char*>(work.data_ptr()), std::vector<size_t>(size, n), dt,
                                           op, plan);
                   const_cast<at::Tensor&>(out).copy_(work.reshape({-1}).narrow(0, rank * n, n).view(out.sizes()));
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size() && !inputs.empty(),
                    "hetcomm reduce_scatter_tensor_coalesced: needs as many outputs as inputs, and at least one");
  const DType dt = toDType(inputs[0], "reduce_scatter_tensor_coalesced");
  const RedOp op = toRedOp(opts.reduceOp, "reduce_scatter_tensor_coalesced");
  checkReduce(dt, op, "reduce_scatter_tensor_coalesced");
  size_t block = 0;
  for (size_t k = 0; k < inputs.size(); ++k) {
    checkDense(inputs[k], "reduce_scatter_tensor_coalesced");
    checkDense(outputs[k], "reduce_scatter_tensor_coalesced");
    TORCH_CHECK_VALUE(inputs[k].scalar_type() == inputs[0].scalar_type() &&
                          outputs[k].scalar_type() == inputs[0].scalar_type() &&
                          inputs[k].numel() == outputs[k].numel() * size_,
                      "hetcomm reduce_scatter_tensor_coalesced: input ", k,
                      " must hold world size x output ", k, " elements, all of one dtype");
    block += outputs[k].numel();
  }
  const RingPlan plan = this->plan();
  CollectiveHeader h;
  h.dtype = static_cast<uint8_t>(dt);
  h.redop = static_cast<uint8_t>(op);
  h.bytes = block * size_ * elementSize(dt);
  h.aux = plan.fingerprint();
  std::vector<at::Tensor> ins = inputs, outs = outputs;
  const int rank = rank_, size = size_;
  // One reduce-scatter over a buffer whose block r is every input's rank-r slice, back to back.
  // OpType::COALESCED: torch 2.11 has no REDUCE_SCATTER_TENSOR_COALESCED (2.13 added it).
  return enqueue(c10d::OpType::COALESCED, "hetcomm:reduce_scatter_tensor_coalesced",
                 CollectiveKind::kReduceScatter, ins, outs, h, effectiveTimeout(opts.timeout),
                 [ins, outs, block, dt, op, plan, rank, size](CollectiveContext& ctx) {
                   std::vector<at::Tensor> pieces;
                   for (int r = 0; r < size; ++r) {
                     for (size_t k = 0; k < ins.size(); ++k) {
                       const int64_t n = outs[k].numel();
                       pieces.push_back(ins[k].reshape({-1}).narrow(0, r * n, n));
                     }
                   }
                   at::Tensor work = at::cat(pieces);
                   hetcomm::reduceScatterv(ctx, static_cast<char*>(work.data_ptr()), std::vector<size_t>(size, block),
                                           dt, op, plan);
                   int64_t off = static_cast<int64_t>(rank * block);
                   for (const at::Tensor& o : outs) {
                     const_cast<at::Tensor&>(o).copy_(work.narrow(0, off, o.numel()).view(o.sizes()));
                     off += o.numel();
                   }
                 });
}

namespace {

// Byte offsets/sizes of dim-0 splits (empty split list: equal split).
void splitBytes(const at::Tensor& t, const std::vector<int64_t>& splits, int size, const char* which,
                std::vector<size_t>& offsets, std::vector<size_t>& bytes) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const size_t rowBytes = rows == 0 ? 0 : t.nbytes() / rows;
  std::vector<int64_t> s = splits;
  if (s.empty()) {
    TORCH_CHECK_VALUE(rows % size == 0, "hetcomm alltoall: ", which, " dim 0 (", rows,
                      ") is not divisible by the world size ", size, " and no split sizes were given");
    s.assign(size, rows / size);
  }
  TORCH_CHECK_VALUE(static_cast<int>(s.size()) == size, "hetcomm alltoall: ", which, " split sizes have ", s.size(),
                    " entries, expected ", size);
  int64_t sum = 0;
  offsets.clear();
  bytes.clear();
  for (int64_t v : s) {
    TORCH_CHECK_VALUE(v >= 0, "hetcomm alltoall: negative split size");
    offsets.push_back(static_cast<size_t>(sum) * rowBytes);
    bytes.push_back(static_cast<size_t>(v) * rowBytes);
    sum += v;
  }
  TORCH_CHECK_VALUE(sum == rows, "hetcomm alltoall: ", which, " split sizes sum to ", sum, " but dim 0 is ", rows);
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                  std::vector<int64_t>& outputSplitSizes,
                                                                  std::vector<int64_t>& inputSplitSizes,
                                                                  const c10d::AllToAllOptions& opts) {
  checkDense(input, "alltoall");
  checkDense(output, "alltoall");
  TORCH_CHECK_TYPE(output.scalar_type() == input.scalar_type(), "hetcomm alltoall: output dtype ",
                   output.scalar_type(), " differs from input dtype ", input.scalar_type());
  std::vector<size_t> sendOff, sendBytes, recvOff, recvBytes;
  splitBytes(input, inputSplitSizes, size_, "input", sendOff, sendBytes);
  splitBytes(output, outputSplitSizes, size_, "output", recvOff, recvBytes);
  CollectiveHeader h;
  h.dtype = static_cast<uint8_t>(toDType(input, "alltoall"));
  at::Tensor in = input, out = output;
  return enqueue(c10d::OpType::ALLTOALL_BASE, "hetcomm:all_to_all_single", CollectiveKind::kAlltoall, {in}, {out}, h,
                 effectiveTimeout(opts.timeout),
                 [in, out, sendOff, sendBytes, recvOff, recvBytes](CollectiveContext& ctx) {
                   at::Tensor i = contiguousOf(in);
                   at::Tensor o = contiguousOf(out);
                   hetcomm::alltoallv(ctx, static_cast<const char*>(i.data_ptr()), sendOff, sendBytes,
                                      static_cast<char*>(o.data_ptr()), recvOff, recvBytes);
                   copyBackIfNeeded(out, o);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::alltoall(std::vector<at::Tensor>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllToAllOptions& opts) {
  checkCount(inputs, static_cast<size_t>(size_), "alltoall", "input");
  checkCount(outputs, static_cast<size_t>(size_), "alltoall", "output");
  checkDense(inputs[0], "alltoall");
  checkSame(inputs, inputs[0].scalar_type(), -1, "alltoall", "input");
  checkSame(outputs, inputs[0].scalar_type(), -1, "alltoall", "output");
  std::vector<size_t> sendOff, sendBytes, recvOff, recvBytes;
  size_t so = 0, ro = 0;
  for (int r = 0; r < size_; ++r) {
    sendOff.push_back(so);
    sendBytes.push_back(inputs[r].nbytes());
    so += inputs[r].nbytes();
    recvOff.push_back(ro);
    recvBytes.push_back(outputs[r].nbytes());
    ro += outputs[r].nbytes();
  }
  CollectiveHeader h;
  h.dtype = static_cast<uint8_t>(toDType(inputs[0], "alltoall"));
  std::vector<at::Tensor> ins = inputs, outs = outputs;
  return enqueue(c10d::OpType::ALLTOALL, "hetcomm:all_to_all", CollectiveKind::kAlltoall, ins, outs, h,
                 effectiveTimeout(opts.timeout),
                 [ins, outs, sendOff, sendBytes, recvOff, recvBytes, ro](CollectiveContext& ctx) {
                   at::Tensor in = flattenAll(ins);
                   at::Tensor flat = at::empty({static_cast<int64_t>(ro)}, in.options().dtype(at::kByte));
                   hetcomm::alltoallv(ctx, static_cast<const char*>(in.data_ptr()), sendOff, sendBytes,
                                      static_cast<char*>(flat.data_ptr()), recvOff, recvBytes);
                   for (size_t r = 0; r < outs.size(); ++r) {
                     at::Tensor piece = flat.narrow(0, recvOff[r], recvBytes[r]).view(outs[r].scalar_type());
                     const_cast<at::Tensor&>(outs[r]).copy_(piece.view(outs[r].sizes()));
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::barrier(const c10d::BarrierOptions& opts) {
  CollectiveHeader h;
  h.bytes = 1;
  return enqueue(c10d::OpType::BARRIER, "hetcomm:barrier", CollectiveKind::kBarrier, {}, {}, h,
                 effectiveTimeout(opts.timeout), [](CollectiveContext& ctx) { hetcomm::barrier(ctx); });
}

// ---------------------------------------------------------------------------------------------
// Point-to-point

// A CUDA tensor to send is first copied into pinned host memory, on the group's point-to-point
// stream after what the caller had queued, and the calling thread waits for that stream (only)
// before handing the bytes to the engine. Waiting here keeps the messages to one peer in the order
// they were posted, which tag matching relies on; sends are rare in data-parallel training.
at::Tensor ProcessGroupHetcomm::stageForSend(const at::Tensor& data) {
  const c10::Stream stream = p2pStream(data.device());
  markCurrentStream(data.device()).block(stream);
  at::Tensor host = at::empty({static_cast<int64_t>(data.nbytes())}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  if (data.nbytes() > 0) {
    c10::StreamGuard onStream(stream);
    host.copy_(asBytes(data), /*non_blocking=*/true);
  }
  stream.synchronize();
  return host;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  checkCount(tensors, 1, "send", "input");
  checkDense(tensors[0], "send");
  TORCH_CHECK_VALUE(dstRank >= 0 && dstRank < size_ && dstRank != rank_, "hetcomm send: invalid destination rank ",
                    dstRank, " (this is rank ", rank_, " of ", size_, ")");
  at::Tensor data = contiguousOf(tensors[0]);
  if (data.is_cuda()) data = stageForSend(data);
  auto work = c10::make_intrusive<WorkHetcomm>(rank_, c10d::OpType::SEND, "hetcomm:send", std::vector<at::Tensor>{},
                                               0, completions_);
  const auto timeout = options_.timeout;
  // The lambda keeps `data` (and its storage) alive until the bytes are on the wire.
  p2p_->postSend(dstRank, tag, static_cast<const char*>(data.data_ptr()), data.nbytes(), Clock::now() + timeout,
                 timeout.count(), [work, data](std::exception_ptr e) {
                   (void)data;
                   work->complete(asDistError(e));
                 });
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  checkCount(tensors, 1, "recv", "output");
  checkDense(tensors[0], "recv");
  TORCH_CHECK_VALUE(srcRank >= 0 && srcRank < size_ && srcRank != rank_, "hetcomm recv: invalid source rank ", srcRank,
                    " (this is rank ", rank_, " of ", size_, ")");
  at::Tensor target = tensors[0];
  // A CUDA target receives into pinned host memory; the engine's callback then queues the copy
  // into the target on the group's point-to-point stream, after what the caller had queued.
  std::optional<c10::Stream> stream;
  std::shared_ptr<c10::Event> targetReady;
  at::Tensor buffer;
  if (target.is_cuda()) {
    stream = p2pStream(target.device());
    targetReady = std::make_shared<c10::Event>(markCurrentStream(target.device()));
    keepAliveOnStream({target}, *stream);
    buffer = at::empty({static_cast<int64_t>(target.nbytes())},
                       at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  } else {
    buffer = target.is_contiguous() ? target : at::empty_like(target, at::MemoryFormat::Contiguous);
  }
  auto work = c10::make_intrusive<WorkHetcomm>(rank_, c10d::OpType::RECV, "hetcomm:recv",
                                               std::vector<at::Tensor>{target}, 0, completions_, stream);
  const auto timeout = options_.timeout;
  p2p_->postRecv(srcRank, tag, static_cast<char*>(buffer.data_ptr()), buffer.nbytes(), Clock::now() + timeout,
                 timeout.count(), [work, target, buffer, stream, targetReady](std::exception_ptr e) {
                   if (!e) {
                     try {
                       if (stream) {
                         c10::StreamGuard onStream(*stream);
                         targetReady->block(*stream);
                         const_cast<at::Tensor&>(target).copy_(
                             buffer.view(target.scalar_type()).view(target.sizes()), /*non_blocking=*/true);
                       } else if (!target.is_same(buffer)) {
                         const_cast<at::Tensor&>(target).copy_(buffer);
                       }
                     } catch (...) {
                       e = std::current_exception();
                     }
                   }
                   work->complete(asDistError(e));
                 });
  return work;
}

}  // namespace hetcomm
