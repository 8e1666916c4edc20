// ShmSegment (csrc/transport/shm/segment.h): what open() accepts. A name in the group's store
// could point at any file in /dev/shm; only this user's own private segment of the right size is
// mapped. And ShmChannel (channel.h) reads the shared abort word without trusting it.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <random>
#include <string>

#include "check.h"
#include "transport/shm/channel.h"
#include "transport/shm/segment.h"

using namespace hetcomm;

namespace {

std::string testName() {
  std::random_device rd;
  char buf[64];
  std::snprintf(buf, sizeof(buf), "/hetcomm-segment-test-%08x%08x", rd(), rd());
  return buf;
}

// Makes a segment with plain shm_open (as another program could), with this mode and size.
bool plant(const std::string& name, mode_t mode, size_t bytes) {
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, mode);
  if (fd < 0) return false;
  const bool ok = ::fchmod(fd, mode) == 0 && ::ftruncate(fd, static_cast<off_t>(bytes)) == 0;
  ::close(fd);
  return ok;
}

bool opens(const std::string& name, size_t bytes, std::string* why) {
  try {
    ShmSegment s = ShmSegment::open(name, bytes);
    return static_cast<bool>(s);
  } catch (const ShmUnavailableError& e) {
    *why = e.what();
    return false;
  }
}

}  // namespace

TEST_CASE(a_segment_made_by_create_opens) {
  const std::string name = testName();
  ShmSegment made = ShmSegment::create(name, 8192);
  std::string why;
  CHECK(opens(name, 8192, &why));
  CHECK(!opens(name, 4096, &why));  // another size: refused
  ShmSegment::unlink(name);
}

TEST_CASE(a_world_or_group_accessible_segment_is_refused) {
  for (mode_t mode : {mode_t{0666}, mode_t{0640}, mode_t{0604}}) {
    const std::string name = testName();
    REQUIRE(plant(name, mode, 8192));
    std::string why;
    CHECK(!opens(name, 8192, &why));
    CHECK(why.find("private segment") != std::string::npos);
    ShmSegment::unlink(name);
  }
  const std::string name = testName();
  REQUIRE(plant(name, 0600, 8192));  // the same file, private: accepted
  std::string why;
  CHECK(opens(name, 8192, &why));
  ShmSegment::unlink(name);
}

// A segment of another user, private to it and of the right size, is refused too: a store writer
// who is another local user (or root making one for it) names it, and the follower must not map
// memory someone else controls. Making one needs root (to chown it).
TEST_CASE(a_segment_of_another_user_is_refused) {
  if (::geteuid() != 0) SKIP_TEST("not root: cannot make a segment that belongs to another user");
  const std::string name = testName();
  REQUIRE(plant(name, 0600, 8192));
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  REQUIRE(fd >= 0);
  const bool chowned = ::fchown(fd, 65534, 65534) == 0;  // nobody
  ::close(fd);
  REQUIRE(chowned);
  std::string why;
  CHECK(!opens(name, 8192, &why));
  CHECK(why.find("owner 65534") != std::string::npos);
  ShmSegment::unlink(name);
}

// The abort word is shared memory: a value that names no local rank (written here through
// abort() as garbage in the word would be) still aborts every wait, and abortedBy() never hands
// it out as an index (it did: local_collectives.cc indexed the host's ranks with it).
TEST_CASE(an_abort_word_that_names_no_rank_aborts_without_naming_one) {
  const std::string name = testName();
  constexpr int kLocal = 2;
  constexpr size_t kSlot = 4096;
  ShmChannel ch(ShmSegment::create(name, ShmChannel::segmentBytes(kLocal, kSlot, 1)), 0, kLocal, kSlot, 1, true);
  ShmSegment::unlink(name);
  CHECK(!ch.aborted());
  CHECK_EQ(ch.abortedBy(), -1);
  ch.abort(kLocal + 5);
  CHECK(ch.aborted());
  CHECK_EQ(ch.abortedBy(), -1);
  const auto w = ch.waitFor(1, 1, Clock::now() + std::chrono::seconds(5), {});
  CHECK(w == ShmChannel::Wait::kAborted);
}

// A word of 0x80000000 or more read as a negative rank, that is as "nobody aborted": every wait
// went on until its deadline. Any nonzero word aborts.
TEST_CASE(an_abort_word_above_int_max_still_aborts) {
  const std::string name = testName();
  ShmChannel ch(ShmSegment::create(name, ShmChannel::segmentBytes(2, 4096, 1)), 0, 2, 4096, 1, true);
  ShmSegment::unlink(name);
  ch.abort(-2);  // writes 0xFFFFFFFF
  CHECK(ch.aborted());
  CHECK_EQ(ch.abortedBy(), -1);
  const auto w = ch.waitFor(1, 1, Clock::now() + std::chrono::seconds(5), {});
  CHECK(w == ShmChannel::Wait::kAborted);
}

TEST_CASE(an_abort_by_a_local_rank_names_it) {
  const std::string name = testName();
  ShmChannel ch(ShmSegment::create(name, ShmChannel::segmentBytes(3, 4096, 1)), 2, 3, 4096, 1, true);
  ShmSegment::unlink(name);
  ch.abort(1);
  ch.abort(0);  // the first caller wins
  CHECK(ch.aborted());
  CHECK_EQ(ch.abortedBy(), 1);
}
