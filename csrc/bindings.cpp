// The Python module hetcomm._C: the backend class (a subclass of torch's Backend, so that torch
// treats it like its own) and a few helpers for benchmarks and tests.
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include "backend/cuda_device_ops.h"
#include "common/env.h"
#include "backend/live_groups.h"
#include "backend/process_group_hetcomm.h"
#include "backend/work.h"
#include "backend/tensor_checks.h"
#include "kernels/reduce.h"
#include "transport/group_secret.h"
#include "transport/hmac.h"
#include "transport/tls.h"

namespace py = pybind11;

namespace {

// The holder of the backend's Python object, as torch holds its own backends: when the last
// reference goes from Python, the backend is destroyed with the GIL released. Its destructor
// joins threads that may be waiting for the GIL to finish a Python callback (a future's then(),
// a DDP hook); destroyed with the GIL held, it would wait for them forever. Same layout as
// c10::intrusive_ptr<T>, which torch's casters rely on when they take the object as a Backend.
template <typename T>
class NoGilDestructorPtr {
 public:
  NoGilDestructorPtr() = default;
  NoGilDestructorPtr(const NoGilDestructorPtr&) = default;
  NoGilDestructorPtr(NoGilDestructorPtr&&) noexcept = default;
  NoGilDestructorPtr& operator=(const NoGilDestructorPtr&) = default;
  NoGilDestructorPtr& operator=(NoGilDestructorPtr&&) noexcept = default;
  // pybind11 builds a holder from a raw pointer only for an object it has just created.
  explicit NoGilDestructorPtr(T* fresh) : impl_(c10::intrusive_ptr<T>::unsafe_steal_from_new(fresh)) {}
  explicit NoGilDestructorPtr(c10::intrusive_ptr<T> impl) : impl_(std::move(impl)) {}
  ~NoGilDestructorPtr() {
    if (!impl_) return;
    if (PyGILState_Check()) {
      py::gil_scoped_release release;
      impl_.reset();
    } else {
      impl_.reset();
    }
  }
  T& operator*() const noexcept { return *impl_; }
  T* operator->() const noexcept { return impl_.get(); }
  T* get() const noexcept { return impl_.get(); }

 private:
  c10::intrusive_ptr<T> impl_;
};

}  // namespace

PYBIND11_DECLARE_HOLDER_TYPE(T, NoGilDestructorPtr<T>, true);

namespace {

hetcomm::RedOp parseOp(const std::string& name) {
  static const std::pair<const char*, hetcomm::RedOp> kOps[] = {
      {"sum", hetcomm::RedOp::kSum},   {"avg", hetcomm::RedOp::kAvg},   {"product", hetcomm::RedOp::kProduct},
      {"min", hetcomm::RedOp::kMin},   {"max", hetcomm::RedOp::kMax},   {"band", hetcomm::RedOp::kBand},
      {"bor", hetcomm::RedOp::kBor},   {"bxor", hetcomm::RedOp::kBxor}};
  for (const auto& kv : kOps) {
    if (name == kv.first) return kv.second;
  }
  throw py::value_error("unknown reduce op '" + name + "' (sum, avg, product, min, max, band, bor, bxor)");
}

// dst = op(dst, src) with the backend's own CPU kernel (AVG reduces as on the wire: see reduceInto).
void reduceIntoTensor(at::Tensor& dst, const at::Tensor& src, const std::string& opName) {
  hetcomm::checkDense(dst, "reduce_into");
  hetcomm::checkDense(src, "reduce_into");
  TORCH_CHECK_VALUE(dst.is_cpu() && src.is_cpu(), "reduce_into: CPU tensors only");
  TORCH_CHECK_VALUE(dst.is_contiguous() && src.is_contiguous(), "reduce_into: tensors must be contiguous");
  TORCH_CHECK_VALUE(dst.scalar_type() == src.scalar_type() && dst.numel() == src.numel(),
                    "reduce_into: tensors must have the same dtype and number of elements");
  const hetcomm::DType dt = hetcomm::toDType(dst, "reduce_into");
  const hetcomm::RedOp op = parseOp(opName);
  hetcomm::checkReduce(dt, op, "reduce_into");
  py::gil_scoped_release release;
  hetcomm::reduceInto(dst.data_ptr(), src.data_ptr(), static_cast<size_t>(dst.numel()), dt, op);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hetcomm C++ core";
  py::module::import("torch.distributed");

  py::class_<hetcomm::ProcessGroupHetcomm, c10d::Backend, NoGilDestructorPtr<hetcomm::ProcessGroupHetcomm>>(
      m, "ProcessGroupHetcomm")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, int64_t timeoutMs,
                       const std::string& listenIp, std::vector<int64_t> globalRanks) {
             hetcomm::ProcessGroupHetcomm::Options options;
             options.timeout = std::chrono::milliseconds(timeoutMs);
             options.listenIp = listenIp;
             options.globalRanks = std::move(globalRanks);
             // Creation waits on the store for the other ranks: let other Python threads run.
             py::gil_scoped_release release;
             auto group = c10::make_intrusive<hetcomm::ProcessGroupHetcomm>(store, rank, size, options);
             hetcomm::registerLiveGroup(group);
             return NoGilDestructorPtr<hetcomm::ProcessGroupHetcomm>(std::move(group));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_ms"), py::arg("listen_ip") = "",
           py::arg("global_ranks") = std::vector<int64_t>{})
      .def(
          "timeout_ms", [](const hetcomm::ProcessGroupHetcomm& g) { return static_cast<int64_t>(g.timeout().count()); },
          "The group's operation timeout, in milliseconds (init_process_group's or new_group's timeout).")
      .def("listen_address", &hetcomm::ProcessGroupHetcomm::listenAddress,
           "This rank's listening address, ip:port.")
      .def("link_security", &hetcomm::ProcessGroupHetcomm::collectiveLinkSecurity,
           "Per peer: -1 no collective connection yet, 0 cleartext, 1 TLS (HETCOMM_TLS).")
      .def("set_pacing", &hetcomm::ProcessGroupHetcomm::setPacing, py::arg("bytes_per_second"),
           py::call_guard<py::gil_scoped_release>(),
           "Caps this rank's send rate to each group rank (bytes/s, 0: no cap) on its TCP/TLS links; "
           "returns how many open links the kernel refused it on")
      .def("pacing", &hetcomm::ProcessGroupHetcomm::pacing,
           "Per peer: the send-rate cap the kernel holds on the collective link (bytes/s, 0: none), -1 without "
           "a link yet")
      .def("rejected_connections", &hetcomm::ProcessGroupHetcomm::rejectedConnections,
           "How many incoming connections failed the handshake and were closed.")
      .def(
          "get_plan",
          [](const hetcomm::ProcessGroupHetcomm& pg) {
            hetcomm::RingPlan p = pg.plan();
            return py::make_tuple(p.order, p.shares, p.minBytes, p.segmentBytes);
          },
          "The ring plan as (order, shares, min_bytes, segment_bytes): ring positions' ranks, each rank's "
          "share of an allreduce, the smallest allreduce (bytes) that uses it rather than uniform shares, "
          "and its pipeline segment size (0: adaptive).")
      .def(
          "set_plan",
          [](hetcomm::ProcessGroupHetcomm& pg, std::vector<int> order, std::vector<double> shares,
             uint64_t minBytes, uint64_t segmentBytes) {
            hetcomm::RingPlan p;
            p.order = std::move(order);
            p.shares = std::move(shares);
            p.minBytes = minBytes;
            p.segmentBytes = segmentBytes;
            pg.setPlan(std::move(p));
          },
          py::arg("order"), py::arg("shares"), py::arg("min_bytes") = 0, py::arg("segment_bytes") = 0,
          "Sets the ring plan for operations issued from now on; every rank must set the same plan.")
      .def(
          "get_site_plan",
          [](const hetcomm::ProcessGroupHetcomm& pg) -> py::object {
            hetcomm::RingPlan p = pg.plan();
            if (!p.sites) return py::none();
            const hetcomm::SitePlan& s = *p.sites;
            return py::make_tuple(s.sites, s.blockOwners, s.blockShares, s.siteShares, s.minBytes, s.segmentBytes,
                                  s.localInner, s.hosts, s.holders);
          },
          "The site-aware schedule as (sites, block_owners, block_shares, site_shares, min_bytes, segment_bytes, "
          "local_inner, hosts, holders), "
          "or None when every allreduce uses the ring (see set_site_plan).")
      .def(
          "set_site_plan",
          [](hetcomm::ProcessGroupHetcomm& pg, std::vector<std::vector<int>> sites,
             std::vector<std::vector<int>> blockOwners, std::vector<double> blockShares, std::vector<double> siteShares,
             uint64_t minBytes, uint64_t segmentBytes, bool localInner, std::vector<std::vector<int>> hosts,
             std::vector<std::vector<int>> holders) {
            auto s = std::make_shared<hetcomm::SitePlan>();
            s->sites = std::move(sites);
            s->blockOwners = std::move(blockOwners);
            s->blockShares = std::move(blockShares);
            s->siteShares = std::move(siteShares);
            s->minBytes = minBytes;
            s->segmentBytes = segmentBytes;
            s->localInner = localInner;
            s->hosts = std::move(hosts);
            s->holders = std::move(holders);
            hetcomm::RingPlan p = pg.plan();
            p.sites = std::move(s);
            pg.setPlan(std::move(p));
          },
          py::arg("sites"), py::arg("block_owners"), py::arg("block_shares"), py::arg("site_shares"),
          py::arg("min_bytes") = 0, py::arg("segment_bytes") = 0, py::arg("local_inner") = false,
          py::arg("hosts") = std::vector<std::vector<int>>{}, py::arg("holders") = std::vector<std::vector<int>>{},
          "Adds the site-aware (hierarchical) schedule to the plan: allreduces of at least min_bytes use it. "
          "sites: each site's ranks in ring order; block_owners[b][s]: block b's owner in site s; block_shares: "
          "each block's fraction of the buffer; site_shares: the fraction of every block each site's owner "
          "reduces. local_inner: the sites are the group's hosts, whose ranks share memory, and the steps inside "
          "a host run through it (each host's ranks ascending, each rank's blocks contiguous). hosts and holders: "
          "three levels, hosts inside the sites (each host's ranks ascending) and holders[b][h] the rank of host h "
          "holding block b after the host's reduce-scatter. Every rank must set "
          "the same plan. set_plan() removes it again.")
      .def(
          "attach_local",
          [](hetcomm::ProcessGroupHetcomm& pg, std::vector<int64_t> hostOf, int64_t maxSegmentBytes, int64_t slotBytes) {
            py::gil_scoped_release release;  // waits on the store for the host's other ranks
            return pg.attachLocal(hostOf, maxSegmentBytes, slotBytes);
          },
          py::arg("host_of"), py::arg("max_segment_bytes"), py::arg("slot_bytes"),
          "Shared memory among the ranks of this rank's host (host_of: a host label per group rank). "
          "Collective over each host's ranks; returns '' on success (or when this rank is alone on its "
          "host), else why it cannot be used.")
      .def(
          "attach_inner",
          [](hetcomm::ProcessGroupHetcomm& pg, std::vector<int64_t> hostOf, const c10::intrusive_ptr<c10d::Backend>& backend,
             const std::string& name, bool forDevice) {
            py::gil_scoped_release release;  // opens the liveness connections to the host's ranks
            pg.attachInner(hostOf, backend, name, forDevice);
          },
          py::arg("host_of"), py::arg("backend"), py::arg("name"), py::arg("for_device"),
          "A torch process group over the ranks of this rank's host (gloo or nccl) as the host's inner level: "
          "for host memory (for_device False; instead of shared memory) or for CUDA tensors (True; beside the "
          "host level attached before). Takes effect with enable_local.")
      .def("enable_local", &hetcomm::ProcessGroupHetcomm::enableLocal, py::arg("use"),
           "Use (True) or drop (False) the shared memory attach_local prepared; every rank of the group, "
           "at the same point, once all know whether every host succeeded.")
      .def("forget_wait_pattern", &hetcomm::ProcessGroupHetcomm::forgetWaitPattern,
           "Called when group creation is over: a small operation runs on the caller's thread only after "
           "the program waited for its previous one right away, and creation's own do not count.")
      .def("detach_local", &hetcomm::ProcessGroupHetcomm::detachLocal,
           "Stop using shared memory (every rank of the group, at the same point).")
      .def("shutdown_at_exit", &hetcomm::ProcessGroupHetcomm::shutdownAtExit,
           py::call_guard<py::gil_scoped_release>(),
           "Shut the group down at interpreter exit: gracefully when idle, else as abort() does.")
      .def("inner_levels", &hetcomm::ProcessGroupHetcomm::innerLevels,
           "The inner levels of this rank's host in use: [host memory's] or [host memory's, CUDA tensors'] "
           "(shm, gloo, nccl); [] when the ranks of each host talk over TCP.")
      .def("sealed_store", &hetcomm::ProcessGroupHetcomm::sealedStore,
           "The group's store as hetcomm uses it: with HETCOMM_SECRET(_FILE), one that seals what it "
           "writes and ignores values that fail their MAC (for the rendezvous of torch groups it makes).")
      .def("sealing", &hetcomm::ProcessGroupHetcomm::sealing,
           "True when the group has an out-of-band secret (HETCOMM_SECRET(_FILE)): its store values are sealed.")
      .def("incarnation", &hetcomm::ProcessGroupHetcomm::incarnation,
           "This group's tag (16 hex digits, the same on every rank; from its secret): store keys of this "
           "group carry it.")
      .def("local_ranks", &hetcomm::ProcessGroupHetcomm::localRanks,
           "The group ranks this rank shares memory with (itself included); [] when none.")
      .def(
          "traffic",
          [](const hetcomm::ProcessGroupHetcomm& pg) {
            // A few relaxed atomic loads: no need to release the GIL.
            const hetcomm::TrafficSnapshot t = pg.traffic();
            py::dict d;
            d["bytes_sent"] = t.bytesSent;
            d["bytes_received"] = t.bytesReceived;
            d["collectives"] = t.collectives;
            d["collective_seconds"] = static_cast<double>(t.collectiveNanos) * 1e-9;
            d["p2p_sent_messages"] = t.p2pSentMessages;
            d["p2p_received_messages"] = t.p2pReceivedMessages;
            py::dict paths;
            for (size_t i = 0; i < t.collectivesByPath.size(); ++i) {
              paths[hetcomm::collectivePathName(static_cast<hetcomm::CollectivePath>(i))] = t.collectivesByPath[i];
            }
            d["collectives_by_path"] = paths;
            d["shared_memory_bytes"] = t.sharedMemoryBytes;
            d["collectives_on_caller_thread"] = t.inlineCollectives;
            const auto kinds = pg.p2pLinkKinds();
            py::dict links;
            links["tcp"] = kinds[0];
            links["tls"] = kinds[1];
            links["shm"] = kinds[2];
            d["p2p_links"] = links;
            return d;
          },
          "Cumulative traffic since the group was created: bytes_sent and bytes_received (lists indexed "
          "by the peer's group rank; headers included, connection handshakes not), collectives run, "
          "collective_seconds spent running them, p2p_sent_messages and p2p_received_messages.");

  m.def(
      "engine_settings",
      [] {
        py::dict d;
        d["small_allreduce_bytes"] = hetcomm::paramSmallAllreduceBytes();
        d["segment_bytes"] = std::max<int64_t>(0, hetcomm::paramSegmentBytes());
        d["min_segment_bytes"] = hetcomm::kMinSegmentBytes;
        d["max_segment_bytes"] = hetcomm::kMaxSegmentBytes;
        d["default_small_allreduce_bytes"] = hetcomm::kDefaultSmallAllreduceBytes;
        d["device_host_reduce_bytes"] = hetcomm::paramDeviceHostReduceBytes();
        d["site_piece_bytes"] = hetcomm::paramSitePieceBytes();
        return d;
      },
      "The engine's settings the cost model needs, as this process's engine uses them "
      "(HETCOMM_SMALL_ALLREDUCE_BYTES and HETCOMM_SEGMENT_BYTES applied; segment_bytes 0: adaptive, "
      "a quarter of the largest chunk clamped to [min_segment_bytes, max_segment_bytes]).");
  m.def(
      "built_with_cuda", [] { return hetcomm::kBuiltWithCuda; },
      "True when this build moves CUDA tensors (the backend then registers for 'cuda' too).");
  m.def("shutdown_live_groups_at_exit", &hetcomm::shutdownLiveGroupsAtExit, py::arg("max_wait_ms"),
        py::call_guard<py::gil_scoped_release>(),
        "Shut down every hetcomm group this process created that is still alive, then wait (up to "
        "max_wait_ms) for the callback threads of shut-down groups: call it at exit, before Python "
        "finalizes.");
  m.def(
      "completed_at",
      [](const c10::intrusive_ptr<c10d::Work>& work) {
        const auto* w = dynamic_cast<const hetcomm::WorkHetcomm*>(work.get());
        return w == nullptr ? 0.0 : w->completedAt();
      },
      py::arg("work"),
      "When a hetcomm operation's data moved, in seconds of time.perf_counter()'s clock: for a receive, "
      "when the engine read the message's last byte (however late the caller looks); 0.0 before it "
      "completed, and for an operation of another backend.");
  m.def("tls_available", [] {
        std::string why;
        const bool ok = hetcomm::tls::available(&why);
        return py::make_tuple(ok, why);
      },
      "(True, '') when OpenSSL 3 could be loaded for HETCOMM_TLS, else (False, why not).");
  m.def(
      "store_seal_key",
      [](const std::string& context) -> py::object {
        const auto master = hetcomm::outOfBandSecretFromEnv();
        if (!master) return py::none();
        static const char kLabel[] = "hetcomm python store v1";   // its NUL included: a separator
        // (HETCOMM_JOB_ID, where set, before it: two runs of one job name and secret are told apart)
        const std::string scoped = hetcomm::withJobId(context);
        const auto key = hetcomm::hmacSha256(master->data(), master->size(),
                                             {{kLabel, sizeof(kLabel)}, {scoped.data(), scoped.size()}});
        return py::bytes(reinterpret_cast<const char*>(key.data()), key.size());
      },
      py::arg("context"),
      "The key that seals the store values of `context` (an elastic job's key prefix) with the "
      "out-of-band secret (HETCOMM_SECRET_FILE or HETCOMM_SECRET), derived from it and never stored; "
      "None when neither is set. Raises as group creation does for a secret it refuses.");
  m.def("staging_host_bytes", &hetcomm::stagingHostBytes,
        "Bytes of host staging memory (pinned, in a CUDA build) that this process's groups hold now "
        "for device tensors: their staging slots and whole-message buffers; 0 once every group "
        "that moved device tensors is destroyed.");
  m.def("registered_host_bytes", &hetcomm::registeredHostBytes,
        "Bytes of shared memory this process's groups registered with a GPU (HETCOMM_SHM_PIN=1) now.");
  m.def("reduce_into", &reduceIntoTensor, py::arg("dst"), py::arg("src"), py::arg("op") = "sum",
        "dst = op(dst, src) with hetcomm's CPU reduce kernel (for benchmarks and tests).");
}
