#include "backend/completion_pool.h"

#include <pthread.h>

#include "common/logging.h"
#include "common/threads.h"

namespace hetcomm {
namespace {

// The threads that run future callbacks (the pools' and those started after a stop()): how many
// are running, so that interpreter exit can wait until none can touch Python objects.
struct CallbackThreads {
  std::mutex mu;
  std::condition_variable cv;
  int running = 0;
};

CallbackThreads* callbackThreadsNow = nullptr;

void forgetCallbackThreadsInChild() {
  // A forked child has none of the parent's threads, and may have inherited the mutex locked.
  callbackThreadsNow = new CallbackThreads;  // the parent's copy is left as it is (never freed)
}

CallbackThreads& callbackThreads() {
  static const bool ready = [] {
    callbackThreadsNow = new CallbackThreads;  // never destroyed: threads may outlive static destructors
    ::pthread_atfork(nullptr, nullptr, forgetCallbackThreadsInChild);
    return true;
  }();
  (void)ready;
  return *callbackThreadsNow;
}

// Counts a callback thread from before it starts (countThreadIn) until its last statement (~CountedOut).
void countThreadIn() {
  CallbackThreads& c = callbackThreads();
  std::lock_guard<std::mutex> lock(c.mu);
  ++c.running;
}

struct CountedOut {
  ~CountedOut() {
    CallbackThreads& c = callbackThreads();
    std::lock_guard<std::mutex> lock(c.mu);
    --c.running;
    c.cv.notify_all();
  }
};

void runGuarded(const std::function<void()>& fn) {
  try {
    fn();
  }
  HETCOMM_RETHROW_FORCED_UNWIND
  catch (const std::exception& e) {
    HC_LOG(kError, "a future callback threw: ", e.what());
  } catch (...) {
    HC_LOG(kError, "a future callback threw a non-standard exception");
  }
}

}  // namespace

void CompletionPool::post(std::function<void()> fn) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) {
    // Nothing runs the queue any more (an operation issued after an abort, completed with its
    // error). Running fn here would run the future's callbacks on the caller's thread, which may
    // be one of the backend's own: a thread of its own does it, touching nothing of the pool.
    lock.unlock();
    countThreadIn();
    try {
      startThread("future callback", [fn = std::move(fn)]() mutable {
        CountedOut out;
        {
          std::function<void()> callback = std::move(fn);
          runGuarded(callback);
        }  // what it held is released here, before the thread counts itself out
      }).detach();
    } catch (...) {
      CountedOut notStarted;
      throw;
    }
    return;
  }
  queue_.push_back(std::move(fn));
  if (idle_ < queue_.size() && threads_.size() < maxThreads_) {
    // The thread keeps the pool alive: stop() called from a pool thread leaves that thread
    // running until it returns from its callback, and it must not find the pool freed.
    countThreadIn();
    try {
      threads_.push_back(startThread("completion", [self = shared_from_this()]() mutable {
        CountedOut out;
        self->loop();
        self.reset();  // the pool (what it still holds) goes before the thread counts itself out
      }));
    } catch (...) {
      CountedOut notStarted;
      throw;
    }
  }
  cv_.notify_one();
}

void CompletionPool::waitForCallbackThreads(std::chrono::milliseconds limit) {
  CallbackThreads& c = callbackThreads();
  std::unique_lock<std::mutex> lock(c.mu);
  c.cv.wait_for(lock, limit, [&] { return c.running == 0; });
}

void CompletionPool::stop() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    threads.swap(threads_);
    cv_.notify_all();
  }
  for (std::thread& t : threads) {
    if (t.get_id() == std::this_thread::get_id()) {
      t.detach();  // stopped from inside a callback: cannot join ourselves (see post)
    } else if (t.joinable()) {
      t.join();
    }
  }
}

void CompletionPool::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    ++idle_;
    cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    --idle_;
    if (queue_.empty()) return;  // stopping and drained
    std::function<void()> fn = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    runGuarded(fn);
    lock.lock();
  }
}

}  // namespace hetcomm
