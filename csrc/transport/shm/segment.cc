#include "transport/shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <utility>

namespace hetcomm {
namespace {

ShmUnavailableError failure(const std::string& what, const std::string& name, int err) {
  return ShmUnavailableError(strCat("hetcomm: shared memory segment ", name, ": ", what, ": ", std::strerror(err)));
}

char* mapShared(int fd, size_t bytes, const std::string& name) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw failure("mmap", name, errno);
  return static_cast<char*>(p);
}

// The names that segments of this process are to remove (removeNameWhenClosed) and have not yet:
// removed at exit should their segments never be destroyed (a group object Python does not free
// before it exits). Never destroyed itself, so a segment destroyed during exit may still use it.
// Each name with the process that registered it: a child forked after that inherits the set,
// and must not remove its parent's names when it exits.
struct NamesToRemove {
  std::mutex mu;
  std::set<std::pair<std::string, pid_t>> names;

  static NamesToRemove& get() {
    static NamesToRemove* const registry = [] {
      auto* r = new NamesToRemove;
      std::atexit([] {
        NamesToRemove& all = get();
        std::lock_guard<std::mutex> lock(all.mu);
        for (const auto& [name, pid] : all.names) {
          if (pid == ::getpid()) ShmSegment::unlink(name);
        }
        all.names.clear();
      });
      return r;
    }();
    return *registry;
  }
};

}  // namespace

void ShmSegment::release() noexcept {
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
  // Not in a child forked since (it holds the mapping, not the group).
  if (!nameToRemove_.empty() && nameOwner_ == ::getpid()) {
    unlink(nameToRemove_);
    NamesToRemove& all = NamesToRemove::get();
    std::lock_guard<std::mutex> lock(all.mu);
    all.names.erase({nameToRemove_, nameOwner_});
  }
  nameToRemove_.clear();
}

ShmSegment::~ShmSegment() { release(); }

ShmSegment::ShmSegment(ShmSegment&& other) noexcept
    : data_(other.data_), size_(other.size_), nameToRemove_(std::move(other.nameToRemove_)), nameOwner_(other.nameOwner_) {
  other.data_ = nullptr;
  other.size_ = 0;
  other.nameToRemove_.clear();
}

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    release();
    data_ = other.data_;
    size_ = other.size_;
    nameToRemove_ = std::move(other.nameToRemove_);
    nameOwner_ = other.nameOwner_;
    other.data_ = nullptr;
    other.size_ = 0;
    other.nameToRemove_.clear();
  }
  return *this;
}

void ShmSegment::removeNameWhenClosed(const std::string& name) {
  HC_ENFORCE(data_ != nullptr && nameToRemove_.empty(), "removeNameWhenClosed: once, on a mapped segment");
  NamesToRemove& all = NamesToRemove::get();
  std::lock_guard<std::mutex> lock(all.mu);
  nameOwner_ = ::getpid();
  all.names.insert({name, nameOwner_});
  nameToRemove_ = name;
}

ShmSegment ShmSegment::create(const std::string& name, size_t bytes) {
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) throw failure("shm_open (create)", name, errno);
  try {
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) throw failure("ftruncate", name, errno);
    // Reserve every page now: tmpfs otherwise hands them out at first touch, and a full /dev/shm
    // then raises SIGBUS in whichever rank writes first.
    const int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (err != 0) {
      throw ShmUnavailableError(strCat("hetcomm: shared memory segment ", name, ": cannot reserve ", bytes,
                                       " bytes in /dev/shm (", std::strerror(err),
                                       "); give the container a larger /dev/shm or set HETCOMM_SHM_BYTES lower"));
    }
    char* data = mapShared(fd, bytes, name);
    ::close(fd);
    return ShmSegment(data, bytes);
  } catch (...) {
    ::close(fd);
    ::shm_unlink(name.c_str());
    throw;
  }
}

ShmSegment ShmSegment::open(const std::string& name, size_t bytes) {
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    if (errno == ENOENT) {
      throw ShmUnavailableError(strCat("hetcomm: shared memory segment ", name, " made by this host's first rank is "
                                       "not visible here (do the ranks of this host share /dev/shm?)"));
    }
    throw failure("shm_open", name, errno);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw failure("fstat", name, err);
  }
  // Only a segment this user made for itself: another local user could otherwise plant a
  // world-writable file of the right size under a name the store points to.
  if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
    ::close(fd);
    throw ShmUnavailableError(strCat("hetcomm: shared memory segment ", name, " is not this user's own private segment "
                                     "(owner ", st.st_uid, ", mode ", std::oct, (st.st_mode & 0777), ")"));
  }
  if (static_cast<size_t>(st.st_size) != bytes) {
    ::close(fd);
    throw ShmUnavailableError(strCat("hetcomm: shared memory segment ", name, " has ", st.st_size, " bytes, expected ",
                                     bytes, " (do the ranks of this host run different settings?)"));
  }
  try {
    char* data = mapShared(fd, bytes, name);
    ::close(fd);
    return ShmSegment(data, bytes);
  } catch (...) {
    ::close(fd);
    throw;
  }
}

void ShmSegment::unlink(const std::string& name) noexcept { ::shm_unlink(name.c_str()); }

}  // namespace hetcomm
