#pragma once
// The one rule for the threads hetcomm starts: every one of them is started with startThread,
// whose guard catches whatever the body throws. An exception that leaves a thread's function calls
// std::terminate and takes the user's process down (a store whose host died throws
// c10::DistNetworkError from deep inside a store call; a bad_alloc can come from anywhere), so the
// guard logs it and hands it to `onError`, which turns it into the failure of whatever the thread
// served (the process group's operations fail with the message) instead.
//
// `onError` runs on the failing thread, must not throw (a throw is logged and dropped) and must
// not join that thread.
//
// One thing passes the guard: the forced unwinding of a thread that is being ended (pthread_exit;
// a finalizing Python interpreter ends so a thread that asks for the GIL). Swallowing it aborts
// the process ("exception not rethrown"), so the guard rethrows it (HETCOMM_RETHROW_FORCED_UNWIND)
// and the thread's function is not noexcept. That alone does not save such a thread: on its way
// out it usually meets a destructor that needs the GIL again (a future's Python callback, a
// tensor) and the process aborts there. What prevents it is that no hetcomm thread runs Python
// once the interpreter finalizes: the exit hook (backend/live_groups.h) waits for them.
#if defined(__GLIBCXX__)
#include <cxxabi.h>
// In a catch sequence before `catch (...)`: lets the forced unwinding of a thread pass (above).
#define HETCOMM_RETHROW_FORCED_UNWIND \
  catch (const abi::__forced_unwind&) { throw; }
#else
#define HETCOMM_RETHROW_FORCED_UNWIND
#endif

#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <utility>

#include "common/logging.h"

namespace hetcomm {

using ThreadErrorHandler = std::function<void(const std::string& what)>;

namespace detail {

inline std::string describeCurrentException() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "a non-standard exception";
  }
}

inline void reportThreadError(const char* name, const ThreadErrorHandler& onError) {
  const std::string what = strCat("hetcomm's ", name, " thread stopped on an unexpected error: ",
                                  describeCurrentException());
  HC_LOG(kError, what);
  if (!onError) return;
  try {
    onError(what);
  } catch (...) {
    HC_LOG(kError, "hetcomm's ", name, " thread: its error handler threw too: ", describeCurrentException());
  }
}

}  // namespace detail

// Runs body() guarded (see above); use it for thread bodies that cannot be started with
// startThread (a pool's worker created by emplace_back, ...).
template <typename Body>
void runGuardedThread(const char* name, Body& body, const ThreadErrorHandler& onError = {}) {
  try {
    body();
  }
  HETCOMM_RETHROW_FORCED_UNWIND
  catch (...) {
    try {
      detail::reportThreadError(name, onError);
    } catch (...) {
      // Out of memory even for the message: nothing more can be said, but the process lives on.
    }
  }
}

template <typename Body>
std::thread startThread(const char* name, Body body, ThreadErrorHandler onError = {}) {
  return std::thread([name, body = std::move(body), onError = std::move(onError)]() mutable {
    runGuardedThread(name, body, onError);
  });
}

}  // namespace hetcomm
