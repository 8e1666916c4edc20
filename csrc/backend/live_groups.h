#pragma once
// The hetcomm process groups alive in this process, so that interpreter exit can shut down every
// one of them, not only those torch registered (a group whose creation failed, one built directly).
//
// Why at exit: a group's threads may hold the last reference to a tensor or a Python callback. If
// one of them drops it after Python began to finalize, it needs the GIL, which a finalizing
// interpreter no longer hands out: the thread is made to exit, unwinding through a destructor, and
// the process dies with std::terminate (SIGABRT) after the program itself succeeded.
#include <c10/util/intrusive_ptr.h>

#include <cstdint>

namespace hetcomm {

class ProcessGroupHetcomm;

// Remembers `group` (weakly) as created by this process. A weak reference defers the object's
// destructor to when the reference goes: ProcessGroupHetcomm shuts down in release_resources(),
// when its last strong reference goes, and forgets itself there (forgetLiveGroup), so that it is
// freed at once.
void registerLiveGroup(const c10::intrusive_ptr<ProcessGroupHetcomm>& group);
void forgetLiveGroup(const ProcessGroupHetcomm* group) noexcept;

// Shuts down every group of this process still alive (the busy ones failed first, as abort()
// does, then all of them shut down), then waits, for what is left of `maxWaitMs`, until no thread
// that runs future callbacks is left. Call it without the GIL, before the interpreter finalizes.
void shutdownLiveGroupsAtExit(int64_t maxWaitMs);

}  // namespace hetcomm
