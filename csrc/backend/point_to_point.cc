// The group's point-to-point operations (send, recv, recv from any source) and the monitored
// barrier built on them: what torch hands to P2PEngine, CUDA tensors staged through pinned host
// memory on the group's point-to-point stream.
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

#include <array>
#include <future>
#include <limits>

#include "backend/device_streams.h"
#include "backend/process_group_hetcomm.h"
#include "backend/tensor_checks.h"
#include "common/threads.h"

namespace hetcomm {

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
