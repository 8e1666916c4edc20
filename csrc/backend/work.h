#pragma once
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "transport/socket.h"  // Clock

#include "backend/completion_pool.h"

namespace hetcomm {

// An exception that torch users expect (DistBackendError) with this message.
std::exception_ptr distError(const std::string& message);
// `e` as a DistBackendError with the same message (the core fails with CommError); null stays null.
std::exception_ptr asDistError(std::exception_ptr e);

// How the program waits for a group's operations: whether it waited for the last one right
// after it was issued (within `window`, HETCOMM_INLINE_WINDOW_US), as a synchronous call does.
// Shared by a group and its operations; the group runs a small operation on the caller's thread
// only then, so that a caller that does something between issuing and waiting keeps the overlap
// it asked for.
struct WaitPattern {
  explicit WaitPattern(std::chrono::microseconds w) : window(w) {}
  const std::chrono::microseconds window;
  std::atomic<bool> prompt{false};
};

// A hetcomm operation as seen by torch: wait() (from c10d::Work) blocks until the worker (or the
// caller's thread, for a small one: ProcessGroupHetcomm::enqueue) has finished it and rethrows its
// error; getFuture() completes with the output tensors after wait() would return: on a
// completion-pool thread when it was asked for before, else at once on the asking thread (never
// on a backend thread that runs operations).
//
// An operation on CUDA tensors ran on `stream` (the group's stream for the device). When the
// host side finishes, the device may still be working through what was queued; complete()
// records an event there, and:
//   * wait() / synchronize() make the caller's current stream wait for it (not the host, not
//     the device): kernels the caller queues next see the result;
//   * isCompleted() is true only once the device got there too;
//   * the future is created with the device and marked completed with the group's stream as the
//     current one, so torch's CUDA-aware future makes its callbacks' streams (and value()'s
//     readers after wait()) wait for the data, as DDP requires.
class WorkHetcomm : public c10d::Work {
 public:
  WorkHetcomm(int rank, c10d::OpType type, const char* profilingTitle, std::vector<at::Tensor> outputs, uint64_t seq,
              std::shared_ptr<CompletionPool> pool, std::optional<c10::Stream> stream = std::nullopt);

  // Made on first request: an operation whose future nobody asked for completes without a
  // hand-off to the completion pool.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  bool wait(std::chrono::milliseconds timeout) override;
  // The operation is in the caller's hands from now; its first wait() or getFuture() tells
  // `pattern` how the caller waits.
  void handedOver(std::shared_ptr<WaitPattern> pattern);
  std::vector<at::Tensor> result() override { return outputs_; }
  uint64_t getSequencenumber() const override { return seq_; }
  // A receive: the rank the data came from (known once it completed; for a receive from any
  // source that is what the caller asks).
  int sourceRank() const override;
  void setSourceRank(int rank) { sourceRank_.store(rank); }
  bool isCompleted() override;
  void synchronize() override;

  // Called once, by whoever finished the operation (the worker or the point-to-point engine),
  // after the operation's last device work was enqueued on the stream. `at`: when its data moved
  // (the point-to-point engine says when it read a message's last byte); unset: now.
  void complete(std::exception_ptr error, Clock::time_point at = {});
  // complete()'s `at` in seconds of the monotonic clock (steady_clock is CLOCK_MONOTONIC with
  // libstdc++, the clock of Python's time.perf_counter() on Linux); 0 before. For a receive that is
  // when the engine read the message's last byte off the link, however late the caller looks
  // (the probe times flows with it); for CUDA tensors, before the copy to the device.
  double completedAt() const { return completedAt_.load(std::memory_order_acquire); }

 private:
  std::vector<at::Tensor> outputs_;
  const uint64_t seq_;
  const std::optional<c10::Stream> stream_;
  std::atomic<int> sourceRank_{-1};
  std::atomic<double> completedAt_{0.0};
  std::optional<c10::Event> done_;  // written by complete() before finish(), read after it
  std::mutex futureMu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // null until asked for (CPU) or completed (CUDA)
  bool settled_ = false;                            // complete() ran (under futureMu_)
  std::exception_ptr settledError_;                 // its error (under futureMu_)
  std::shared_ptr<WaitPattern> pattern_;            // set before the caller sees the operation
  Clock::time_point handedOverAt_;
  std::atomic<bool> waitNoted_{false};
  std::shared_ptr<CompletionPool> pool_;
};

}  // namespace hetcomm
