// The multi-link dataflow loop (csrc/algorithms/flow_pipeline.h): dependencies across flows are
// honoured, data arrives intact, and a schedule that cannot progress or that the peer built
// differently fails with an error instead of hanging.
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "algorithms/flow_pipeline.h"
#include "check.h"
#include "common/error.h"

using namespace hetcomm;

namespace {

// Runs build(rank, graph) then runFlows for ranks 0 and 1 joined by a non-blocking socket pair;
// returns each rank's error message ("" when it completed).
std::vector<std::string> runTwo(const std::function<void(int, FlowGraph&)>& build, int64_t timeoutMs = 10000) {
  int fds[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
  for (int fd : fds) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  std::unique_ptr<Link> links[2] = {tcpLink(Socket(fds[0])), tcpLink(Socket(fds[1]))};  // they close the fds
  std::vector<std::string> errors(2);
  auto run = [&](int rank) {
    try {
      CollectiveContext ctx;
      ctx.rank = rank;
      ctx.size = 2;
      ctx.timeoutMs = timeoutMs;
      ctx.deadline = Clock::now() + std::chrono::milliseconds(timeoutMs);
      ctx.header.seq = 1;
      Link* link = links[rank].get();
      ctx.linkOf = [link](int) -> Link& { return *link; };
      FlowGraph g;
      build(rank, g);
      runFlows(ctx, g);
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  };
  std::thread other(run, 1);
  run(0);
  other.join();
  return errors;
}

}  // namespace

TEST_CASE(flows_honour_dependencies_across_directions) {
  // Rank 0 sends A (ones), then B once it has received X and added it into B; rank 1 receives A,
  // sends it back as X once it has arrived, then receives B. 1 MiB items overflow the socket
  // buffers, so each dependency is really waited for.
  constexpr size_t n = 1 << 18;
  std::vector<float> a0(n, 1.0f), b0(n, 10.0f), a1(n, 0.0f), b1(n, 0.0f);
  auto errors = runTwo([&](int rank, FlowGraph& g) {
    g.dtype = DType::kFloat32;
    if (rank == 0) {
      const uint32_t sendA = g.add(reinterpret_cast<char*>(a0.data()), n * 4, false, {});
      const uint32_t recvX = g.add(reinterpret_cast<char*>(b0.data()), n * 4, true, {sendA});
      const uint32_t sendB = g.add(reinterpret_cast<char*>(b0.data()), n * 4, false, {recvX});
      g.flow(1, true).items = {sendA, sendB};
      g.flow(1, false).items = {recvX};
    } else {
      const uint32_t recvA = g.add(reinterpret_cast<char*>(a1.data()), n * 4, false, {});
      const uint32_t sendX = g.add(reinterpret_cast<char*>(a1.data()), n * 4, false, {recvA});
      const uint32_t recvB = g.add(reinterpret_cast<char*>(b1.data()), n * 4, false, {});
      g.flow(0, false).items = {recvA, recvB};
      g.flow(0, true).items = {sendX};
    }
  });
  CHECK_EQ(errors[0], std::string());
  CHECK_EQ(errors[1], std::string());
  // B = 10 + X = 10 + A = 11, sent only after X was added in.
  CHECK(b1 == std::vector<float>(n, 11.0f));
  CHECK(a1 == std::vector<float>(n, 1.0f));
}

TEST_CASE(a_dependency_cycle_raises_instead_of_hanging) {
  std::vector<char> buf0(100), buf1(100);
  auto errors = runTwo([&](int rank, FlowGraph& g) {
    char* p = rank == 0 ? buf0.data() : buf1.data();
    // Each side sends only after receiving what the other sends only after receiving.
    const uint32_t recv = g.add(p, 50, false, {});
    const uint32_t send = g.add(p + 50, 50, false, {recv});
    g.items[recv].deps = {send};
    g.flow(1 - rank, true).items = {send};
    g.flow(1 - rank, false).items = {recv};
  });
  for (const std::string& e : errors) CHECK_MSG(e.find("stalled") != std::string::npos, e);
}

TEST_CASE(peers_with_different_schedules_disagree_loudly) {
  std::vector<char> buf0(1000), buf1(1000);
  auto errors = runTwo([&](int rank, FlowGraph& g) {
    char* p = rank == 0 ? buf0.data() : buf1.data();
    const size_t bytes = rank == 0 ? 1000 : 600;  // rank 1 expects a shorter flow
    const uint32_t send = g.add(p, bytes, false, {});
    const uint32_t recv = g.add(p, bytes, false, {});
    g.flow(1 - rank, true).items = {send};
    g.flow(1 - rank, false).items = {recv};
  });
  bool anyDisagree = false;
  for (const std::string& e : errors) anyDisagree |= e.find("disagree") != std::string::npos;
  CHECK_MSG(anyDisagree, errors[0] + " | " + errors[1]);
}

TEST_CASE(peers_with_different_steps_disagree_loudly) {
  // The hierarchical schedule puts its segment size in the step: same totals, other segments.
  std::vector<char> buf0(1000), buf1(1000);
  auto errors = runTwo([&](int rank, FlowGraph& g) {
    char* p = rank == 0 ? buf0.data() : buf1.data();
    g.step = rank == 0 ? 65536 : 32768;
    const uint32_t send = g.add(p, 1000, false, {});
    const uint32_t recv = g.add(p, 1000, false, {});
    g.flow(1 - rank, true).items = {send};
    g.flow(1 - rank, false).items = {recv};
  });
  for (const std::string& e : errors) CHECK_MSG(e.find("segment sizes") != std::string::npos, e);
}
