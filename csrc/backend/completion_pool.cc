#include "backend/completion_pool.h"

#include <cxxabi.h>

#include "common/logging.h"
#include "common/threads.h"

namespace hetcomm {
namespace {

// The callback threads started after a stop() (detached): how many are running.
struct Detached {
  std::mutex mu;
  std::condition_variable cv;
  int running = 0;
};

Detached& detached() {
  static auto* d = new Detached;  // never destroyed: a detached thread may outlive static destructors
  return *d;
}

void runGuarded(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const abi::__forced_unwind&) {
    throw;  // the thread is being ended (pthread_exit): it must unwind
  } catch (const std::exception& e) {
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
    Detached& d = detached();
    {
      std::lock_guard<std::mutex> count(d.mu);
      ++d.running;
    }
    struct Finished {
      ~Finished() {
        Detached& d = detached();
        std::lock_guard<std::mutex> count(d.mu);
        --d.running;
        d.cv.notify_all();
      }
    };
    try {
      startThread("future callback", [fn = std::move(fn)]() mutable {
        Finished finished;
        {
          std::function<void()> callback = std::move(fn);
          runGuarded(callback);
        }  // what it held is released here, before the thread counts itself out
      }).detach();
    } catch (...) {
      Finished notStarted;
      throw;
    }
    return;
  }
  queue_.push_back(std::move(fn));
  if (idle_ < queue_.size() && threads_.size() < maxThreads_) {
    // The thread keeps the pool alive: stop() called from a pool thread leaves that thread
    // running until it returns from its callback, and it must not find the pool freed.
    threads_.push_back(startThread("completion", [self = shared_from_this()] { self->loop(); }));
  }
  cv_.notify_one();
}

void CompletionPool::waitForDetachedCallbacks(std::chrono::milliseconds limit) {
  Detached& d = detached();
  std::unique_lock<std::mutex> lock(d.mu);
  d.cv.wait_for(lock, limit, [&] { return d.running == 0; });
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
