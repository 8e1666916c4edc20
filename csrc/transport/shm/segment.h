#pragma once
// A POSIX shared-memory segment, shared by the ranks of one host (design.md §9).
//
// Life cycle: one rank creates it (shm_open with O_EXCL, ftruncate, then posix_fallocate, so that
// a /dev/shm too small for it fails here with a clear error instead of killing a rank with SIGBUS
// at its first write into a page tmpfs cannot supply), the others open it by name, everyone maps
// it, and the creator unlinks the name as soon as every rank has mapped it. From then on the
// memory lives only in the mappings: the kernel frees it when the last rank unmaps it, however
// the ranks exit (a crash or a kill -9 included), so nothing is left in /dev/shm.
#include <sys/types.h>

#include <cstddef>
#include <string>

#include "common/error.h"

namespace hetcomm {

// The segment cannot be made or reached (no /dev/shm, too small, not shared with the peers):
// the group falls back to TCP between the ranks of a host.
class ShmUnavailableError : public CommError {
 public:
  explicit ShmUnavailableError(const std::string& what) : CommError(what) {}
};

class ShmSegment {
 public:
  ShmSegment() = default;
  ~ShmSegment();
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // name: "/name" as shm_open takes it. Throws ShmUnavailableError.
  static ShmSegment create(const std::string& name, size_t bytes);
  static ShmSegment open(const std::string& name, size_t bytes);
  // Removes the name (the mappings stay valid); a missing name is not an error.
  static void unlink(const std::string& name) noexcept;
  // Removes `name` when this segment is unmapped, or at the latest when the process exits
  // normally (std::exit: Python's own exit included; not os._exit or a kill). For a rank that
  // mapped the segment but cannot know whether it was the last of its host to open it: should the
  // creator die before it removes the name, the name goes with the group anyway.
  void removeNameWhenClosed(const std::string& name);

  char* data() const { return data_; }
  size_t size() const { return size_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  ShmSegment(char* data, size_t size) : data_(data), size_(size) {}
  void release() noexcept;  // unmaps, and removes the name given to removeNameWhenClosed
  char* data_ = nullptr;
  size_t size_ = 0;
  std::string nameToRemove_;
  pid_t nameOwner_ = 0;  // the process that asked to remove it
};

}  // namespace hetcomm
