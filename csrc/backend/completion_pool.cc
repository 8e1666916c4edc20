#include "backend/completion_pool.h"

#include "common/logging.h"

namespace hetcomm {

void CompletionPool::post(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  queue_.push_back(std::move(fn));
  if (idle_ < queue_.size() && threads_.size() < maxThreads_ && !stopping_) {
    threads_.emplace_back([this] { loop(); });
  }
  cv_.notify_one();
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
      t.detach();  // destroyed from inside a callback: cannot join ourselves
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
    try {
      fn();
    } catch (const std::exception& e) {
      HC_LOG(kError, "a future callback threw: ", e.what());
    } catch (...) {
      HC_LOG(kError, "a future callback threw a non-standard exception");
    }
    lock.lock();
  }
}

}  // namespace hetcomm
