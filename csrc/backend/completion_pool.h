#pragma once
// Threads that complete futures, away from the communication thread.
//
// Future callbacks run inline on the thread that marks the future completed, and some callbacks
// (PowerSGD's) block on further collectives. If the worker ran them, it would wait for work only
// it can do: a deadlock (design.md §5). A callback may even block on a future that is queued
// behind it here, so the pool grows a thread whenever every thread is busy (up to a cap), instead
// of queueing behind a blocked callback.
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace hetcomm {

// Owned through a shared_ptr (its threads hold one: see post).
class CompletionPool : public std::enable_shared_from_this<CompletionPool> {
 public:
  explicit CompletionPool(size_t maxThreads = 64) : maxThreads_(maxThreads) {}
  ~CompletionPool() { stop(); }
  CompletionPool(const CompletionPool&) = delete;
  CompletionPool& operator=(const CompletionPool&) = delete;

  // Runs fn on a pool thread; after stop(), on a thread of its own (so that the future of an
  // operation issued after an abort still completes).
  void post(std::function<void()> fn);
  // Runs what is queued, then joins every thread (idempotent). From a pool thread (a callback
  // that destroys the process group) that thread is left to finish on its own.
  void stop();

  // Waits (up to `limit`) until no thread of any pool, nor any started after a stop(), runs: at
  // interpreter exit, none may still hold Python objects when Python finalizes.
  static void waitForCallbackThreads(std::chrono::milliseconds limit);

 private:
  void loop();

  const size_t maxThreads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::thread> threads_;
  size_t idle_ = 0;
  bool stopping_ = false;
};

}  // namespace hetcomm
