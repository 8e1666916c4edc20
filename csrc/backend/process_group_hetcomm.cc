#include "backend/process_group_hetcomm.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

#include <sys/stat.h>

#include <array>
#include <cstdio>
#include <future>
#include <limits>
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
// The group's first failure, "rank R: cause", written by the first rank that fails (compare-and-set):
// the ranks that share no connection with it learn it from here (watchFailures).
constexpr const char* kFailedKey = "hetcomm/failed";
// How often a rank with operations pending looks at kFailedKey, and how long one look may take.
HETCOMM_PARAM(paramFailurePollMs, "HETCOMM_FAILURE_POLL_MS", 500)
constexpr std::chrono::milliseconds kWatchStoreTimeout{2000};
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
constexpr size_t kMaxAbortReasonBytes = 2048;
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

void ProcessGroupHetcomm::startFailureWatch() {
  c10::intrusive_ptr<SealedStore> store;
  try {
    store = store_->cloneSealed();
    store->setTimeout(kWatchStoreTimeout);
  } catch (const std::exception& e) {
    // A store that cannot be cloned (a Python store): failures reach the other ranks over the links only.
    HC_LOG(kInfo, "rank ", rank_, ": the store cannot be cloned (", e.what(), "): failures of ranks this one shares "
           "no connection with reach it only at its own timeout");
    return;
  }
  auto watch = std::make_shared<FailureWatch>();
  watch->busy = [this] {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!brokenReason_.empty()) return false;  // failed already: nothing more to learn
      if (!queue_.empty() || running_) return true;
    }
    return !p2p_->idle();
  };
  watch->failed = [this] {
    std::lock_guard<std::mutex> lock(mu_);
    return !brokenReason_.empty();
  };
  watch->fail = [this](const std::string& why) { failGroup(why); };
  watch->kept = kept_;
  try {
    startThread("failure watcher", [watch, store, incarnation = incarnation_, rank = rank_] {
      watchFailures(watch, store, incarnation, rank);
    }).detach();
  } catch (const std::system_error& e) {
    HC_LOG(kWarn, "rank ", rank_, ": no thread to watch for other ranks' failures: ", e.what());
    return;
  }
  watch_ = std::move(watch);
}

void ProcessGroupHetcomm::stopFailureWatch() {
  if (!watch_) return;
  {
    // Waits for a call into this group in progress; the watcher then touches nothing of it.
    std::lock_guard<std::mutex> lock(watch_->mu);
    watch_->stop = true;
    watch_->busy = nullptr;
    watch_->failed = nullptr;
    watch_->fail = nullptr;
  }
  watch_->cv.notify_all();
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

void ProcessGroupHetcomm::restoreKept(FailureWatch& watch, SealedStore& store, int rank) {
  for (const auto& [key, raw] : watch.kept) {
    try {
      if (!putBack(*store.inner(), key, raw)) continue;
    } catch (const std::exception&) {
      return;  // the store is unreachable now
    }
    if (watch.restored.insert(key).second) {
      HC_LOG(kWarn, "hetcomm: rank ", rank, " put its record '", key, "' back in the store: someone replaced or "
             "removed it");
    }
  }
}

// Detached, and holding only `watch` and its own store clone: a store call that outlasts the group
// (a store host that stopped answering) keeps nothing of the group alive or waiting.
void ProcessGroupHetcomm::watchFailures(std::shared_ptr<FailureWatch> watch, c10::intrusive_ptr<SealedStore> store,
                                        std::string incarnation, int rank) {
  {
    const auto poll = std::chrono::milliseconds(std::max<int64_t>(10, paramFailurePollMs()));
    const std::string tag = incarnation + "|";
    while (true) {
      {
        std::unique_lock<std::mutex> lock(watch->mu);
        watch->cv.wait_for(lock, poll, [&] { return watch->stop; });
        if (watch->stop) return;
        // Under the lock: never after shutdown went on to remove the group's keys.
        // Every poll while the group is young (creation, first connections), then every tenth:
        // each look is a store round trip per record, on every rank.
        const bool look = watch->polls < 60 || watch->polls % 10 == 0;
        ++watch->polls;
        if (look && !watch->kept.empty() && !watch->failed()) restoreKept(*watch, *store, rank);
        if (!watch->busy()) continue;  // nothing waits: nothing to fail
      }
      std::string failed;
      try {
        // One that fails its seal (a store writer's) is ignored: only a member can fail the group.
        std::vector<uint8_t> v;
        if (store->tryGet(kFailedKey, v) == SealedStore::Read::kValue) failed.assign(v.begin(), v.end());
      } catch (const std::exception&) {
        continue;  // the store is unreachable now: the links still tell what they know
      }
      if (failed.rfind(tag, 0) != 0) continue;  // none, or an earlier group's
      std::lock_guard<std::mutex> lock(watch->mu);
      if (watch->stop) return;
      watch->fail(strCat("hetcomm: rank ", rank, " stops: the process group failed on ",
                         excerpt(failed.substr(tag.size()), kMaxAbortReasonBytes)));
    }
  }
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    local_.reset();  // unmaps this rank's view of the host's segment
    pendingLocal_.reset();
  }
  completions_->stop();
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
                 timeout.count(), [work, data](std::exception_ptr e, int /*peer*/, Clock::time_point at) {
                   (void)data;
                   work->complete(asDistError(e), at);
                 });
  return work;
}

void ProcessGroupHetcomm::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  const auto timeout = effectiveTimeout(opts.timeout);
  const Deadline deadline = Clock::now() + timeout;
  // A tag no torch call can use (torch's tags are 32-bit ints).
  constexpr int64_t kTag = std::numeric_limits<int64_t>::min() + 1;
  struct Pending {
    std::array<char, 1> byte{};
    std::promise<std::exception_ptr> done;
  };
  auto post = [&](bool send, int peer) {
    auto op = std::make_shared<Pending>();
    auto result = op->done.get_future();
    auto finish = [op](std::exception_ptr e, int, Clock::time_point) { op->done.set_value(e); };
    if (send) {
      p2p_->postSend(peer, kTag, op->byte.data(), 1, deadline, timeout.count(), finish);
    } else {
      p2p_->postRecv(peer, kTag, op->byte.data(), 1, deadline, timeout.count(), finish);
    }
    return result;
  };
  // The engine fails every operation by its deadline; the slack only covers its wake-up.
  auto failed = [&](std::future<std::exception_ptr>& f) {
    if (f.wait_until(deadline + std::chrono::seconds(5)) != std::future_status::ready) return true;
    return f.get() != nullptr;
  };
  auto failure = [&](const std::vector<int>& ranks) {
    std::string who;
    for (int r : ranks) who += strCat(who.empty() ? "" : ", ", r);
    return strCat("hetcomm monitored barrier: ", ranks.size() == 1 ? "rank " : "ranks ", who,
                  " failed to pass the barrier in ", timeout.count(), " ms (rank ", rank_, " waited for them)");
  };
  if (size_ == 1) return;
  if (rank_ != 0) {
    auto checkIn = post(true, 0);
    auto release = post(false, 0);
    if (failed(checkIn) || failed(release)) C10_THROW_ERROR(DistBackendError, failure({0}));
    return;
  }
  std::vector<std::future<std::exception_ptr>> arrivals;
  for (int r = 1; r < size_; ++r) arrivals.push_back(post(false, r));
  std::vector<int> missing;
  for (int r = 1; r < size_; ++r) {
    if (failed(arrivals[r - 1])) {
      missing.push_back(r);
      if (!waitAllRanks) break;
    }
  }
  if (!missing.empty()) C10_THROW_ERROR(DistBackendError, failure(missing));
  std::vector<std::future<std::exception_ptr>> releases;
  for (int r = 1; r < size_; ++r) releases.push_back(post(true, r));
  for (auto& f : releases) failed(f);  // a rank that left after checking in fails on its own side
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  TORCH_CHECK_VALUE(srcRank >= 0 && srcRank < size_ && srcRank != rank_, "hetcomm recv: invalid source rank ", srcRank,
                    " (this is rank ", rank_, " of ", size_, ")");
  return postReceive(tensors, srcRank, tag);
}

// From whichever rank sends a message with this tag first; wait() then sourceRank() says which.
c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  TORCH_CHECK_VALUE(size_ > 1, "hetcomm recv from any source: this rank is alone in its group");
  return postReceive(tensors, P2PEngine::kAnySource, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::postReceive(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  checkCount(tensors, 1, "recv", "output");
  checkDense(tensors[0], "recv");
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
  auto work = c10::make_intrusive<WorkHetcomm>(rank_, srcRank == P2PEngine::kAnySource ? c10d::OpType::RECVANYSOURCE
                                                                                         : c10d::OpType::RECV,
                                               "hetcomm:recv", std::vector<at::Tensor>{target}, 0, completions_, stream);
  const auto timeout = options_.timeout;
  p2p_->postRecv(srcRank, tag, static_cast<char*>(buffer.data_ptr()), buffer.nbytes(), Clock::now() + timeout,
                 timeout.count(), [work, target, buffer, stream, targetReady](std::exception_ptr e, int peer,
                                                                              Clock::time_point at) {
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
                     }
                     HETCOMM_RETHROW_FORCED_UNWIND
                     catch (...) {
                       e = std::current_exception();
                     }
                   }
                   if (!e && peer >= 0) work->setSourceRank(peer);
                   work->complete(asDistError(e), at);
                 });
  return work;
}

}  // namespace hetcomm
