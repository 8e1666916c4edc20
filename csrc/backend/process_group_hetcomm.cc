#include "backend/process_group_hetcomm.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

#include <sys/stat.h>

#include <cstdio>
#include <future>
#include <mutex>
#include <random>
#include <set>

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

// Which ranks of this incarnation have left, one key each: the last to leave removes the group's
// keys (a rank may still look a peer's address up until it leaves itself). Not a counter: the
// store closes the connection of a client that adds to a value a store writer filled with garbage.
std::string leftKey(const std::string& incarnation, int rank) { return strCat("hetcomm/left/", incarnation, "/", rank); }
// How long a failing rank waits for its report to reach the store before it shuts its links.
constexpr std::chrono::milliseconds kReportWait{300};
std::string addressKey(const std::string& incarnation, int rank) { return strCat("hetcomm/addr/", incarnation, "/", rank); }
// Where a rank leaves the reason it gave up, for the peers that only see its connection close.
std::string abortKey(const std::string& incarnation, int rank) {
  return strCat("hetcomm/abort/", incarnation, "/", rank);
}
// How long a rank that lost a peer waits for that peer's reason to appear in the store. A rank
// that fails writes its reason before it closes its links (failGroup), so a short wait suffices;
// a killed one leaves none, and every survivor would wait this long for nothing.
constexpr std::chrono::milliseconds kAbortReasonWait{500};
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

// Whether nothing serves the group's store any more. A TCPStore served by a rank's own process
// (rank 0's, under env:// or a plain torchrun) goes when that rank exits, often before the others
// shut down; the first operation on a client whose server is gone logs a warning with a C++ stack
// trace before it throws, on every rank that tries. A fresh connection to the store's address as
// resolved at creation tells instead, without that client: refused means gone (and the group's
// keys with it). Anything else -- it answers, a timeout, an error of this process -- counts as
// serving, so that the last rank out cleans the keys as before; only a refusal skips that. A
// store found gone stays gone: the next group of this process to shut down does not ask again.
bool storeGone(const HostPort& address) {
  if (address.host.empty()) return false;
  static std::mutex mu;
  static std::set<std::string> gone;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (gone.count(address.str()) != 0) return true;
  }
  try {
    connectTo(address, Clock::now() + std::chrono::seconds(2), /*retryRefused=*/false);
    return false;
  } catch (const ConnectionRefusedError&) {
    std::lock_guard<std::mutex> lock(mu);
    gone.insert(address.str());
    return true;
  } catch (const std::exception&) {
    return false;
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

std::string ProcessGroupHetcomm::failWith(const CollectiveContext& ctx, const std::string& msg) {
  {
    // Failed already (another operation, or a peer through the store) while this one ran: this
    // one's own error is a consequence (connections shut down); name the first cause.
    std::lock_guard<std::mutex> lock(mu_);
    if (!brokenReason_.empty()) {
      return strCat(ctx.prefix(), ": the process group is unusable after an earlier failure: ", brokenReason_);
    }
  }
  failGroup(msg);
  return msg;
}

std::string ProcessGroupHetcomm::peerAbortReason(int peer) {
  try {
    const std::string key = abortKey(incarnation_, peer);
    store_->wait({key}, kAbortReasonWait);
    std::vector<uint8_t> v;
    if (store_->tryGet(key, v) != SealedStore::Read::kValue) return "";
    // Bounded and printable: it ends up in every error message of this rank.
    return excerpt(std::string(v.begin(), v.end()), kMaxAbortReasonBytes);
  } catch (const std::exception&) {
    return "";  // it left none (killed?), or the store is gone with it
  }
}

void ProcessGroupHetcomm::failGroup(const std::string& reason) {
  std::shared_ptr<LocalGroup> local;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!brokenReason_.empty()) return;
    brokenReason_ = reason;
    local = local_;
  }
  HC_LOG(kError, reason);
  if (watch_) watch_->cv.notify_all();  // the failure watcher goes idle
  // The ranks of this host waiting on us in shared memory fail now too.
  if (local) local->abort();
  // Leave the reason for the peers, and the group's first failure for the ranks that share no
  // connection with us, before they see our connections close (so that the first cause, not a
  // consequence, is what they read): waited for briefly. Detached: a store whose host died must
  // not delay the abort any longer; the store outlives the thread's short work.
  auto store = store_;
  const std::string key = abortKey(incarnation_, rank_);
  const std::string first = strCat(incarnation_, "|rank ", rank_, ": ", reason);
  auto reported = std::make_shared<std::promise<void>>();
  std::future<void> done = reported->get_future();
  try {
    startThread("failure report", [store, key, reason, first, reported] {
      try {
        store->compareSet(kFailedKey, std::vector<uint8_t>{}, std::vector<uint8_t>(first.begin(), first.end()));
        store->set(key, std::vector<uint8_t>(reason.begin(), reason.end()));
      } catch (const std::exception&) {
        // The store's host is gone: the links tell what they can.
      }
      reported->set_value();
    }).detach();
    done.wait_for(kReportWait);
  } catch (const std::system_error& e) {
    HC_LOG(kWarn, "rank ", rank_, ": could not report the failure to the other ranks through the store: ", e.what());
  }
  // Every pending and later point-to-point operation fails with this cause, and the peers blocked
  // on us (collective or point-to-point) fail now instead of at their timeout.
  p2p_->fail(reason);
  mesh_->abort();
}

void ProcessGroupHetcomm::abort() {
  failGroup("the process group was aborted");
  shutdown();
}

void ProcessGroupHetcomm::failIfBusyAtExit() {
  bool idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    idle = queue_.empty() && !running_;
  }
  if (!idle) failGroup("the process is exiting with operations of this group still queued or running");
}

void ProcessGroupHetcomm::shutdownAtExit() {
  failIfBusyAtExit();
  shutdown();
}

void ProcessGroupHetcomm::shutdown() {
  // Two threads may get here (a watchdog's abort and the destructor): the second waits for the
  // first, so that nobody joins a thread twice.
  std::lock_guard<std::mutex> once(shutdownMu_);
  if (shutDown_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    cv_.notify_all();
  }
  // The worker finishes what was issued (each operation bounded by its timeout), then exits.
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
  stopFailureWatch();  // after the worker: failures still end its queued operations early
  if (p2p_) p2p_->stop("the process group was shut down");
  if (mesh_) mesh_->close();
  completions_->stop();
  {
    // The staging memory goes with the group (torch's destroy_process_group shuts it down while
    // Python may still hold the group object): nothing runs on it any more. Before the segment
    // is unmapped, which a device may have registered (HETCOMM_SHM_PIN).
    std::vector<std::unique_ptr<DeviceOps>> staging;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& entry : devices_) staging.push_back(std::move(entry.second.ops));
      staging.push_back(std::move(emulatedDevice_));
    }
  }  // destroyed here, outside the lock (a CUDA one waits for its stream)
  {
    std::lock_guard<std::mutex> lock(mu_);
    local_.reset();  // unmaps this rank's view of the host's segment
    pendingLocal_.reset();
  }
  // The last rank to leave cleans the group's keys: before that, a rank still in the group may look
  // a peer's address up (lazily, at its first message to that peer), or still be starting. A rank
  // that crashed never leaves, and its group's keys stay until the store goes. A store that has
  // already gone (its host rank exited first) is left alone, quietly: see storeGone.
  try {
    if (storeGone(storeAddress_)) {
      HC_LOG(kInfo, "hetcomm: rank ", rank_, ": the store at ", storeAddress_.str(),
             " has gone (refused); the group's keys went with it");
    } else {
      std::vector<std::string> left;
      for (int r = 0; r < size_; ++r) left.push_back(leftKey(incarnation_, r));
      store_->set(left[rank_], std::vector<uint8_t>{1});
      // Every rank has left (the last few may all see it: deleting twice is harmless). With an
      // out-of-band secret each mark must open: a store writer must not make a rank remove the keys
      // (the failure record among them) while the others still run.
      auto allLeft = [&] {
        if (!store_->check(left)) return false;
        if (!store_->sealing()) return true;
        std::vector<uint8_t> v;
        for (const std::string& key : left) {
          if (store_->tryGet(key, v) != SealedStore::Read::kValue) return false;
        }
        return true;
      };
      if (allLeft()) {
        for (int r = 0; r < size_; ++r) {
          for (const std::string& key : {addressKey(incarnation_, r), siteKey(incarnation_, r), abortKey(incarnation_, r),
                                         left[r]}) {
            store_->deleteKey(key);
          }
        }
        // The keys every incarnation shares, only while they are still this group's (a group
        // made again under this prefix, by a rank that left first, may have written them).
        std::vector<uint8_t> failed;
        if (store_->tryGet(kFailedKey, failed) == SealedStore::Read::kValue &&
            std::string(failed.begin(), failed.end()).rfind(incarnation_ + "|", 0) == 0) {
          store_->deleteKey(kFailedKey);
        }
        deleteGroupKeyRecords(*store_->inner(), keys_);
      }
    }
  } catch (const std::exception&) {
    // The store's host already exited; the keys went with it.
  }
  shutDown_ = true;
}

// The collectives themselves (validation, wire header, body): collective_ops.cc.

}  // namespace hetcomm
