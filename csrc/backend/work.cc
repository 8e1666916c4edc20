#include "backend/work.h"

#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace hetcomm {

std::exception_ptr distError(const std::string& message) {
  try {
    C10_THROW_ERROR(DistBackendError, message);
  } catch (...) {
    return std::current_exception();
  }
}

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
namespace {

std::vector<c10::Device> devicesOf(const std::optional<c10::Stream>& stream) {
  if (!stream) return {};
  return {stream->device()};
}

}  // namespace

WorkHetcomm::WorkHetcomm(int rank, c10d::OpType type, const char* profilingTitle, std::vector<at::Tensor> outputs,
                         uint64_t seq, std::shared_ptr<CompletionPool> pool, std::optional<c10::Stream> stream)
    : c10d::Work(rank, type, profilingTitle),
      outputs_(std::move(outputs)),
      seq_(seq),
      stream_(stream),
      pool_(std::move(pool)) {}

namespace {

void settle(const c10::intrusive_ptr<c10::ivalue::Future>& future, const std::vector<at::Tensor>& outputs,
            const std::exception_ptr& error, const std::optional<c10::Stream>& stream) {
  if (error) {
    future->setError(error);
    return;
  }
  // The future records its own events on the current stream of its device: make that ours.
  c10::OptionalStreamGuard guard(stream);
  future->markCompleted(c10::IValue(outputs));
}

}  // namespace

void WorkHetcomm::handedOver(std::shared_ptr<WaitPattern> pattern) {
  pattern_ = std::move(pattern);
  handedOverAt_ = Clock::now();
}

bool WorkHetcomm::wait(std::chrono::milliseconds timeout) {
  if (pattern_ && !waitNoted_.exchange(true)) {
    pattern_->prompt.store(Clock::now() - handedOverAt_ <= pattern_->window, std::memory_order_relaxed);
  }
  return c10d::Work::wait(timeout);
}

c10::intrusive_ptr<c10::ivalue::Future> WorkHetcomm::getFuture() {
  // A caller that takes the future (DDP, comm hooks) waits through callbacks: asynchronously.
  if (pattern_ && !waitNoted_.exchange(true)) pattern_->prompt.store(false, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(futureMu_);
  if (!future_) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       devicesOf(stream_));
    // Completed already: settled here, before anyone could add a callback, so none runs.
    if (settled_) settle(future_, outputs_, settledError_, stream_);
  }
  return future_;
}

int WorkHetcomm::sourceRank() const {
  const int rank = sourceRank_.load();
  TORCH_CHECK(rank >= 0, "hetcomm: sourceRank() is known only for a receive that has completed");
  return rank;
}

bool WorkHetcomm::isCompleted() {
  if (!c10d::Work::isCompleted()) return false;
  return !done_ || done_->query();
}

void WorkHetcomm::synchronize() {
  if (done_) done_->block(c10::impl::VirtualGuardImpl(stream_->device_type()).getStream(stream_->device()));
}

void WorkHetcomm::complete(std::exception_ptr error, Clock::time_point at) {
  if (at == Clock::time_point{}) at = Clock::now();
  completedAt_.store(std::chrono::duration<double>(at.time_since_epoch()).count(), std::memory_order_release);
  if (stream_ && !error) {
    done_.emplace(stream_->device_type());
    done_->record(*stream_);
  }
  finish(error);  // wakes wait(); never runs user callbacks
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    // After finish(): a future asked for from here on is settled at once, and wait() already
    // returns by then. A CUDA operation's future is made now, as before, so that its events are
    // recorded on the group's stream at completion, not behind later work.
    std::lock_guard<std::mutex> lock(futureMu_);
    settled_ = true;
    settledError_ = error;
    if (!future_ && stream_) {
      future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                         devicesOf(stream_));
    }
    future = future_;
  }
  if (!future) return;  // getFuture() settles it when asked
  // Its callbacks run on a pool thread, never on the thread that finished the operation.
  pool_->post([future, outputs = outputs_, error, stream = stream_]() { settle(future, outputs, error, stream); });
}

}  // namespace hetcomm
