// Traffic counters (csrc/common/traffic.h) and what the collective pipeline adds to them.
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include "algorithms/pipeline.h"
#include "check.h"
#include "common/traffic.h"
#include "transport/framing.h"

using namespace hetcomm;

TEST_CASE(counters_start_at_zero_and_sum_concurrent_adds) {
  TrafficCounters t(3);
  TrafficSnapshot s = t.snapshot();
  CHECK_EQ(s.bytesSent.size(), size_t{3});
  CHECK_EQ(s.bytesReceived.size(), size_t{3});
  for (int i = 0; i < 3; ++i) {
    CHECK_EQ(s.bytesSent[i], uint64_t{0});
    CHECK_EQ(s.bytesReceived[i], uint64_t{0});
  }
  CHECK_EQ(s.collectives, uint64_t{0});

  constexpr int kThreads = 4, kAdds = 100000;
  std::vector<std::thread> threads;
  for (int k = 0; k < kThreads; ++k) {
    threads.emplace_back([&t, k] {
      for (int i = 0; i < kAdds; ++i) {
        t.addSent(k % 3, 3);
        t.addReceived(2, 5);
        if (i % 10 == 0) t.addCollective(7);
        t.addP2PSent();
        if (k == 0) t.addP2PReceived();
      }
    });
  }
  for (auto& th : threads) th.join();
  s = t.snapshot();
  CHECK_EQ(s.bytesSent[0], uint64_t{2} * kAdds * 3);  // threads 0 and 3
  CHECK_EQ(s.bytesSent[1], uint64_t{1} * kAdds * 3);
  CHECK_EQ(s.bytesSent[2], uint64_t{1} * kAdds * 3);
  CHECK_EQ(s.bytesReceived[0], uint64_t{0});
  CHECK_EQ(s.bytesReceived[2], uint64_t{kThreads} * kAdds * 5);
  CHECK_EQ(s.collectives, uint64_t{kThreads} * (kAdds / 10));
  CHECK_EQ(s.collectiveNanos, uint64_t{kThreads} * (kAdds / 10) * 7);
  CHECK_EQ(s.p2pSentMessages, uint64_t{kThreads} * kAdds);
  CHECK_EQ(s.p2pReceivedMessages, uint64_t{kAdds});
}

namespace {

// Ranks 0 and 1 of a two-rank group, joined by a non-blocking socket pair, exchange `bytes` each
// way through the pipeline; returns each rank's counters.
void exchangeOverSocketPair(size_t bytes, bool withCounters, TrafficSnapshot out[2]) {
  int fds[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
  for (int fd : fds) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  std::unique_ptr<Link> links[2] = {tcpLink(Socket(fds[0])), tcpLink(Socket(fds[1]))};  // they close the fds
  TrafficCounters counters[2] = {TrafficCounters(2), TrafficCounters(2)};
  std::exception_ptr errors[2];
  std::vector<char> send[2], recv[2];
  auto run = [&](int rank) {
    try {
      CollectiveContext ctx;
      ctx.rank = rank;
      ctx.size = 2;
      ctx.timeoutMs = 10000;
      ctx.deadline = Clock::now() + std::chrono::milliseconds(ctx.timeoutMs);
      ctx.header.seq = 3;
      ctx.header.bytes = bytes;
      Link* link = links[rank].get();
      ctx.linkOf = [link](int) -> Link& { return *link; };
      if (withCounters) ctx.traffic = &counters[rank];
      send[rank].assign(bytes, static_cast<char>(rank + 1));
      recv[rank].assign(bytes, 0);
      exchange(ctx, 1 - rank, send[rank].data(), bytes, 1 - rank, recv[rank].data(), bytes, 0);
    } catch (...) {
      errors[rank] = std::current_exception();
    }
  };
  std::thread other(run, 1);
  run(0);
  other.join();
  for (int r = 0; r < 2; ++r) {
    if (errors[r]) std::rethrow_exception(errors[r]);
    CHECK(recv[r] == std::vector<char>(bytes, static_cast<char>(2 - r)));
    out[r] = counters[r].snapshot();
  }
}

}  // namespace

TEST_CASE(pipeline_counts_header_and_payload_per_peer) {
  // 1 MiB does not fit the socket buffers: many partial send()/recv() calls, each counted.
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{1000}, size_t{1} << 20}) {
    TrafficSnapshot s[2];
    exchangeOverSocketPair(bytes, true, s);
    for (int r = 0; r < 2; ++r) {
      const int peer = 1 - r;
      CHECK_EQ(s[r].bytesSent[peer], bytes + CollectiveHeader::kBytes);
      CHECK_EQ(s[r].bytesReceived[peer], bytes + CollectiveHeader::kBytes);
      CHECK_EQ(s[r].bytesSent[r], uint64_t{0});
      CHECK_EQ(s[r].bytesReceived[r], uint64_t{0});
      // The worker counts collectives and their time, not the pipeline.
      CHECK_EQ(s[r].collectives, uint64_t{0});
    }
  }
}

TEST_CASE(pipeline_without_counters_still_moves_data) {
  TrafficSnapshot s[2];
  exchangeOverSocketPair(4096, false, s);
  CHECK_EQ(s[0].bytesSent[1], uint64_t{0});
}
