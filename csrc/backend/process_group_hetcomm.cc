#include "backend/process_group_hetcomm.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <thread>

#include "algorithms/emulated_device_ops.h"
#include "backend/cuda_device_ops.h"
#include "backend/device_streams.h"
#include "backend/live_groups.h"
#include "backend/tensor_checks.h"
#include "common/env.h"
#include "common/logging.h"
#include "common/threads.h"
#include "backend/peer_records.h"
#include "backend/sealed_store.h"

namespace hetcomm {
namespace {

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

// The TCPStore's address, numeric, resolved now (while the group is made, when the store surely
// answers); empty for other stores, or where it cannot be resolved.
HostPort numericStoreAddress(const c10::intrusive_ptr<c10d::Store>& store) {
  c10::intrusive_ptr<c10d::Store> s = store;
  while (auto* prefix = dynamic_cast<c10d::PrefixStore*>(s.get())) s = prefix->getUnderlyingStore();
  auto* tcp = dynamic_cast<c10d::TCPStore*>(s.get());
  if (tcp == nullptr) return {};
  try {
    return {numericAddress(tcp->getHost()), static_cast<uint16_t>(tcp->getPort())};
  } catch (const std::exception&) {
    return {};
  }
}

}  // namespace

ProcessGroupHetcomm::ProcessGroupHetcomm(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                         Options options)
    : c10d::Backend(rank, size),
      options_(std::move(options)),
      completions_(std::make_shared<CompletionPool>()),
      traffic_(std::make_shared<TrafficCounters>(size)),
      plan_(RingPlan::uniform(size)) {
  inlineBytes_ = envInt("HETCOMM_INLINE_BYTES", kDefaultInlineBytes);
  waits_ = std::make_shared<WaitPattern>(
      std::chrono::microseconds(std::max<int64_t>(0, envInt("HETCOMM_INLINE_WINDOW_US", kDefaultInlineWindowUs))));
  if (envInt("HETCOMM_DEBUG_EMULATE_DEVICE", 0) != 0) {
    emulatedDevice_ = std::make_unique<EmulatedDeviceOps>(kEmulatedSlotBytes, kEmulatedSlots, kEmulatedJitterUs);
  }
  try {
    const std::string ip = options_.listenIp.empty() ? chooseListenIp(store) : options_.listenIp;
    storeAddress_ = numericStoreAddress(store);
    // A group made again under the same prefix (after an abort, on the user's own store) must not
    // inherit the last one's failure.
    keys_ = agreeGroupKeys(*store, rank, size, options_.globalRanks, options_.timeout, {kFailedKey}, kept_);
    const GroupKeys& keys = keys_;
    // This incarnation of the group: failure reports carry it, so a late one of an earlier group
    // under the same prefix is ignored.
    incarnation_ = keys.incarnation;
    store_ = c10::make_intrusive<SealedStore>(store, keys.seal);
    auto lookup = [store = store_, rank, incarnation = incarnation_](int peer, Deadline deadline,
                                                                      const Cancelled& cancelled) {
      return HostPort::parse(awaitPeerRecord(*store, addressKey(incarnation, peer), rank, peer, "address",
                                             "(did it create the process group?)", deadline, cancelled));
    };
    // What this rank publishes, and keeps there with an out-of-band secret (restoreKept).
    auto publish = [this](const std::string& key, const std::string& value) {
      const std::vector<uint8_t> bytes(value.begin(), value.end());
      store_->set(key, bytes);
      if (store_->sealing()) kept_.emplace_back(key, store_->sealed(key, bytes));
    };
    mesh_ = std::make_unique<TcpMesh>(rank, size, ip, keys.mesh, lookup);
    const tls::Config tlsConfig = tls::configFromEnv();
    if (tlsConfig.mode != tls::Config::Mode::kOff) {
      // Before the address is published: no peer can connect before the mesh knows its policy.
      mesh_->setTls(tls::Context::create(tlsConfig), tls::modeName(tlsConfig.mode),
                    tlsPolicy(tlsConfig, store_, incarnation_, rank, size, options_.globalRanks, publish));
    }
    p2p_ = std::make_unique<P2PEngine>(rank, size, mesh_.get(), traffic_.get());
    mesh_->setInboundP2PHandler([this](int peer, std::unique_ptr<Link> link) { p2p_->addInbound(peer, std::move(link)); });
    mesh_->setFailureHandler([this](const std::string& what) { failGroup(what); });
    p2p_->setFailureHandler([this](const std::string& what) { failGroup(what); });
    const std::string addr = mesh_->listenAddress().str();
    // Test seam (HETCOMM_TEST_PUBLISH_DELAY_MS): a pause between the records above (the site
    // label) and the address, before which no peer can read them; a test's rogue acts in it.
    if (const int64_t pause = envInt("HETCOMM_TEST_PUBLISH_DELAY_MS", 0); pause > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min<int64_t>(pause, 60000)));
    }
    publish(addressKey(incarnation_, rank), addr);
    HC_LOG(kInfo, "rank ", rank, "/", size, " listening on ", addr);
  } catch (const CommError& e) {
    TORCH_CHECK(false, "hetcomm: cannot create the process group on rank ", rank, ": ", e.what());
  }
  worker_ = startThread("collective worker", [this] { runWorker(); },
                        [this](const std::string& what) { workerDied(what); });
  startFailureWatch();
}

void ProcessGroupHetcomm::workerDied(const std::string& what) {
  failGroup(what);
  std::deque<Pending> orphans;
  {
    std::lock_guard<std::mutex> lock(mu_);
    workerError_ = what;
    orphans.swap(queue_);
    running_ = false;
  }
  for (Pending& op : orphans) op.work->complete(distError(what));
}

ProcessGroupHetcomm::~ProcessGroupHetcomm() { shutdown(); }

void ProcessGroupHetcomm::release_resources() {
  // In a forked child the object stays, unused and never freed: the parent's registry, copied
  // into the child and abandoned there, keeps a weak reference to it (live_groups.cc).
  if (::getpid() != creatorPid_) return;
  shutdown();
  forgetLiveGroup(this);
}

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
    std::shared_ptr<LocalGroup> local;
    if (paramShmPin() != 0) {
      std::lock_guard<std::mutex> lock(mu_);
      local = local_;
    }
    // (a segment attached after this rank's first CUDA collective stays pageable)
    if (local && local->channel) state->ops->registerHostMemory(local->channel->base(), local->channel->bytes());
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
  header.opcode = static_cast<uint8_t>(kind);
  if (::getpid() != creatorPid_) {
    // Before the lock, which the parent's worker may have held when the process forked. The
    // child must not write the parent's shared memory, links or store records.
    auto work = c10::make_intrusive<WorkHetcomm>(rank_, type, profilingTitle, std::move(outputs), 0, completions_,
                                                 stream);
    work->complete(distError(strCat("hetcomm ", collectiveName(header.opcode),
                                    ": a forked child cannot use its parent's process group")));
    return work;
  }
  std::unique_lock<std::mutex> lock(mu_);
  header.seq = nextSeq_++;
  auto work = c10::make_intrusive<WorkHetcomm>(rank_, type, profilingTitle, std::move(outputs), header.seq,
                                               completions_, stream);
  if (stopping_ || !workerError_.empty()) {
    const std::string why = workerError_.empty() ? "the process group is shut down" : workerError_;
    lock.unlock();
    work->complete(distError(strCat("hetcomm ", collectiveName(header.opcode), ": ", why)));
    return work;
  }
  // Every local rank says which operation it has reached, whichever thread will run it.
  const uint32_t issued = static_cast<uint32_t>(header.seq + 1);
  if (local_ && local_->channel) local_->channel->announce(issued);
  Pending op{work, header, timeout, std::move(body), stream, std::move(inputsReady), local_};
  if (!stream && queue_.empty() && !running_ && waits_->prompt.load(std::memory_order_relaxed) &&
      runsInline(op, inputs, outputs)) {
    // Nothing before it: the caller's thread may run it, sparing two thread hand-offs (to the
    // worker and back), which are most of a small collective's cost within a host. Only if the
    // other ranks of the host have issued it too (within the window): the caller must not wait
    // for its peers, which may first wait for something this caller does after issuing.
    running_ = true;
    const std::string broken = brokenReason_;
    lock.unlock();
    if (size_ > 1 && !op.local->channel->othersIssued(issued, waits_->window)) {
      lock.lock();
      work->handedOver(waits_);
      running_ = false;
      cv_.notify_all();
      if (!workerError_.empty()) {
        // The worker stopped meanwhile (workerDied emptied the queue): nothing would run it.
        const std::string why = workerError_;
        lock.unlock();
        work->complete(distError(strCat("hetcomm ", collectiveName(header.opcode), ": ", why)));
        return work;
      }
      queue_.push_front(std::move(op));  // before anything another thread issued meanwhile
      return work;
    }
    std::exception_ptr error;
    {
      // The worker idles again however this ends; it waits for this operation only when another
      // thread issued one meanwhile, or the group is shutting down (a needless wake-up costs a
      // thread switch).
      struct Idle {
        ProcessGroupHetcomm& pg;
        ~Idle() {
          std::lock_guard<std::mutex> lock(pg.mu_);
          pg.running_ = false;
          if (!pg.queue_.empty() || pg.stopping_) pg.cv_.notify_all();
        }
      } idle{*this};
      try {
        // As on the worker: the caller's Python dispatch modes and inference mode do not reach
        // the body's tensor operations, and no gradients are recorded. (Not the worker's whole
        // thread-local state: applying it took about 3 us, most of a small collective.)
        c10::impl::ExcludeDispatchKeyGuard noModes(
            c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
        c10::InferenceMode notInference(false);
        at::NoGradGuard noGrad;
        error = runOperation(op, broken);
      }
      HETCOMM_RETHROW_FORCED_UNWIND
      catch (const std::exception& e) {
        // What would have stopped the worker (runOperation handles the body's errors).
        const std::string why = strCat("hetcomm ", collectiveName(header.opcode), ": ", e.what());
        failGroup(why);
        error = distError(why);
      }
    }
    if (broken.empty()) traffic_->addInline();
    work->complete(error);
    work->handedOver(waits_);
    return work;
  }
  work->handedOver(waits_);  // before the worker can complete it: the caller's clock starts now
  queue_.push_back(std::move(op));
  cv_.notify_one();
  return work;
}

bool ProcessGroupHetcomm::runsInline(const Pending& op, const std::vector<at::Tensor>& inputs,
                                     const std::vector<at::Tensor>& outputs) const {
  // Only within one host through shared memory (or alone), where a small collective takes
  // microseconds: over TCP even a small one may wait a round trip, and an asynchronous caller
  // must not be held for that.
  const bool oneHost = size_ == 1 || (op.local && op.local->channel && op.local->coversGroup(size_));
  if (!oneHost || inlineBytes_ <= 0 || emulatedDevice_) return false;
  const auto bytesOf = [](const std::vector<at::Tensor>& list) {
    int64_t bytes = 0;
    for (const at::Tensor& t : list) bytes += t.numel() * static_cast<int64_t>(t.element_size());
    return bytes;
  };
  return std::max(bytesOf(inputs), bytesOf(outputs)) <= inlineBytes_;
}

void ProcessGroupHetcomm::runWorker() {
  // The bodies write into tensors that may require grad (DDP's parameters in a broadcast).
  at::NoGradGuard noGrad;
  while (true) {
    Pending op;
    std::string broken;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // One operation at a time: one the caller's thread runs (runsInline) ends first.
      cv_.wait(lock, [&] { return (stopping_ || !queue_.empty()) && !running_; });
      if (queue_.empty()) return;
      op = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
      broken = brokenReason_;
    }
    std::exception_ptr error = runOperation(op, broken);
    {
      // Idle before the caller can see the result: a program that exits right after waiting for
      // its last operation must find the group idle (shutdownAtExit would abort it, failing the
      // peers still finishing that operation).
      std::lock_guard<std::mutex> lock(mu_);
      running_ = false;
    }
    op.work->complete(error);
  }
}

std::exception_ptr ProcessGroupHetcomm::runOperation(Pending& op, const std::string& broken) {
  std::exception_ptr error;
  CollectiveContext ctx;
  ctx.rank = rank_;
  ctx.size = size_;
  ctx.header = op.header;
  if (!broken.empty()) {
    return distError(strCat(ctx.prefix(), ": the process group is unusable after an earlier failure: ", broken));
  }
  LocalGroup* local = op.local.get();
  ctx.timeoutMs = op.timeout.count();
  ctx.deadline = Clock::now() + op.timeout;
  ctx.segmentBytes = static_cast<size_t>(std::max<int64_t>(0, paramSegmentBytes()));
  ctx.linkOf = [this, &ctx](int peer) -> Link& { return mesh_->collectiveLink(peer, ctx.deadline); };
  ctx.traffic = traffic_.get();
  ctx.local = local;
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
    // Counts the collective and its time when the body returns or throws (before the
    // handlers below, which may wait for a peer's reason).
    struct TimeCollective {
      TrafficCounters& traffic;
      const Clock::time_point start = Clock::now();
      ~TimeCollective() {
        const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
        traffic.addCollective(static_cast<uint64_t>(std::max<int64_t>(0, ns)));
      }
    } timeCollective{*traffic_};
    op.body(ctx);
    traffic_->addPath(ctx.path);
  } catch (const PeerClosedError& e) {
    std::string msg = e.what();
    const std::string why = peerAbortReason(e.peer());
    if (!why.empty()) msg = strCat(msg, "; rank ", e.peer(), " reported: ", why);
    error = distError(failWith(ctx, msg));
  } catch (const CommError& e) {
    std::string msg = e.what();
    // Errors from below the collective layer (connecting, handshakes) lack the prefix.
    if (msg.rfind("hetcomm ", 0) != 0 || msg.rfind(ctx.prefix(), 0) != 0) msg = strCat(ctx.prefix(), ": ", msg);
    error = distError(failWith(ctx, msg));
  } catch (const std::exception& e) {
    std::string msg = strCat(ctx.prefix(), ": ", e.what());
    error = distError(failWith(ctx, msg));
  }
  return error;
}

// The collectives themselves (validation, wire header, body): collective_ops.cc; how a group fails
// and shuts down: group_teardown.cc.

}  // namespace hetcomm
