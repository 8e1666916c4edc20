#pragma once
// Point-to-point send/recv, progressed by one background thread over the group's links (link.h).
// p2p_engine.cc: posting, connecting, sending, failures and the loop; p2p_receive.cc: reading
// and matching incoming messages.
//
// Sends and receives with different peers, and the two directions with one peer, progress
// independently, so "both ranks isend a large tensor, then irecv" cannot deadlock the way it would
// if sends blocked the collective worker. A receive matches the earliest message from its peer
// (or, for a receive from any source, from any peer) with its tag, whatever the posting order; of
// several matching receives the one posted first wins (as in Gloo and MPI).
//
// Incoming data is read eagerly: a message nobody has asked for yet is kept until a receive
// claims it, so a sender is never stuck behind a tag the receiver posts later, up to a budget of
// HETCOMM_P2P_UNEXPECTED_BYTES per peer. A message that does not fit is left in the socket until
// a receive claims it (the sender then waits, as TCP makes it), and a receive stuck behind it
// times out with a message that says so.
//
// A message whose size differs from the matching receive's fails that receive with a message
// naming both sides, and the stream from that peer is closed (it can no longer be trusted).
//
// Failures come early: connecting happens on helper threads, so a slow or dead peer holds up no
// other peer; an address that refuses connections fails the sends to it at once; a receive from a
// peer that never connected probes the peer (once a second at first, backing off) and fails when
// the peer is gone. Callbacks run on the engine thread and must not throw (a throw is logged).
//
// A failure fails the group: every operation that fails (a timeout, a peer that closed its
// connection with receives pending, garbage, a size mismatch) is reported once to the failure
// handler (the process group, which then fails everything else: setFailureHandler), and fail()
// fails every pending and later operation with the group's first cause, and shuts the engine's
// connections down so that the peers' operations with this rank fail too.
#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/traffic.h"
#include "transport/framing.h"
#include "transport/link.h"
#include "transport/tcp_mesh.h"

namespace hetcomm {

class P2PEngine {
 public:
  // Called once per operation with its error (null on success), the rank the data came from
  // (receives) or went to (sends), and when the engine moved its last byte (read it off the link,
  // or handed it to the link; for a failure, when the callback runs): not when the callback of a
  // success runs, which may be after the engine has moved other peers' bytes in the same pass.
  using Done = std::function<void(std::exception_ptr, int peer, Clock::time_point at)>;
  static constexpr int kAnySource = -1;

  // traffic (may be null) counts the bytes of every message written or read, headers included,
  // and the messages wholly sent and received; it must outlive the engine.
  P2PEngine(int rank, int size, TcpMesh* mesh, TrafficCounters* traffic = nullptr);
  ~P2PEngine();
  P2PEngine(const P2PEngine&) = delete;
  P2PEngine& operator=(const P2PEngine&) = delete;

  void postSend(int peer, int64_t tag, const char* data, size_t bytes, Deadline deadline, int64_t timeoutMs, Done done);
  // peer == kAnySource: the earliest matching message from any peer.
  void postRecv(int peer, int64_t tag, char* data, size_t bytes, Deadline deadline, int64_t timeoutMs, Done done);
  // An accepted sender connection from `peer` (called by the mesh's listener thread).
  void addInbound(int peer, std::unique_ptr<Link> link);
  // Fails everything pending and stops the threads. Idempotent and safe from any thread: a
  // second caller waits for the first to finish; called from the engine thread itself (a
  // callback), it stops the engine without joining that thread.
  void stop(const std::string& reason);
  // The group failed (`cause`: its first cause): fails every pending operation now, and every later
  // one at once, with that cause; shuts every connection down. Does not join anything, so it is
  // safe from any thread, the engine's own (a callback) included. Idempotent: the first cause stays.
  void fail(const std::string& cause);
  // A thread of the engine stopped on an unexpected error: reports it (the group fails), then fail().
  void failFromThread(const std::string& what);
  // Called (outside the engine's lock, at most once) with the message of the first operation that
  // fails for a reason of its own, i.e. not because of fail() or stop(). Set it before posting.
  void setFailureHandler(std::function<void(const std::string&)> handler);
  // True when no operation is pending.
  bool idle();
  // The group ranks that share this host's memory (this rank's own entry ignored): links to them
  // that the engine opens from now on offer a ring in shared memory (shm/ring_link.h) of
  // HETCOMM_P2P_SHM_BYTES (read at construction: a bad value throws CommError there). Offers
  // from other ranks are taken whenever their segment opens here.
  void setSharedMemoryPeers(const std::vector<int>& ranks);
  // Links open now, by kind (Link::Kind: tcp, tls, shm), both directions.
  std::array<int64_t, 3> linkKinds();

 private:
  struct Op {
    char* data = nullptr;
    size_t bytes = 0;
    int64_t tag = 0;
    Deadline deadline;
    int64_t timeoutMs = 0;
    Done done;
    uint64_t posted = 0;  // posting order, across peers (receives from any source compete)
    std::array<uint8_t, P2PHeader::kBytes> header{};
    size_t headerDone = 0;
    size_t dataDone = 0;
    bool attempted = false;  // a send was tried (on TLS, OpenSSL may hold a record of it)
  };
  // The message currently arriving from a peer: its header, then its payload, written either
  // into the matching posted receive or into a buffer of its own (unexpected).
  struct Incoming {
    std::array<uint8_t, P2PHeader::kBytes> header{};
    size_t headerDone = 0;
    P2PHeader parsed;
    uint64_t arrived = 0;  // when its header was read, in the engine's arrival order
    bool matched = false;
    bool waitsForRoom = false;     // unmatched and over the budget: left in the socket for now
    Op op;                         // when matched
    std::vector<char> unexpected;  // when not
    size_t dataDone = 0;
  };
  struct Peer {
    std::unique_ptr<Link> out;
    std::string outError;
    std::deque<Op> sends;
    bool connecting = false;
    std::unique_ptr<Link> in;
    bool inStarted = false;  // a frame came on `in`: a shared-memory offer can only be the first
    std::string inError;
    std::deque<Op> recvs;  // posted, not yet matched, in posting order
    Incoming incoming;
    struct Unclaimed {
      int64_t tag;
      uint64_t arrived;  // arrival order across peers (receives from any source take the earliest)
      std::vector<char> payload;
      Clock::time_point at;  // when its last byte was read
    };
    std::deque<Unclaimed> unexpected;  // arrival order
    size_t unexpectedBytes = 0;
    bool probing = false;
    Deadline nextProbe{};
    std::chrono::milliseconds probeInterval{0};
  };
  struct Finishing {
    Done done;
    std::exception_ptr error;
    int peer;
    Clock::time_point at{};  // when its last byte moved; unset: when the callback runs
  };
  using Finished = std::vector<Finishing>;
  // Connector and prober threads; finished ones are joined by the loop, the rest by stop().
  struct Helper {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> finished;
  };

  void loop();
  void wake();
  void startHelper(std::function<void()> body);
  void joinFinishedHelpers();
  void connectPending();
  void probeSilentPeers(Deadline now, int& pollTimeoutMs);
  void progressSends(int peer, Peer& p, Finished& finished);
  void progressRecvs(int peer, Peer& p, Finished& finished);
  // Finds, removes and returns the earliest-posted receive for a message from `peer` with `tag`
  // (its own or one from any source); false if none.
  bool claimReceive(int peer, int64_t tag, Op& out);
  // The message in `in` has arrived whole: hand it to its receive or keep it as unexpected.
  void deliver(int peer, Peer& p, Finished& finished);
  // The first frame on `in` is a shared-memory offer: take it (a peer of this host) or refuse it.
  void answerOffer(int peer, Peer& p, Finished& finished);
  void breakInbound(int peer, Peer& p, const std::string& why, Finished& finished);
  void timeOut(int peer, Peer& p, Deadline now, Finished& finished, int& pollTimeoutMs);
  void failAll(std::deque<Op>& ops, int peer, const std::string& why, Finished& finished);
  // Runs the callbacks (outside mu_); the first error that is not the engine's own failure goes to
  // the failure handler.
  void runCallbacks(Finished& finished);
  // The error of an operation posted after fail() or stop() ("" when neither happened). Under mu_.
  std::string refusal(const char* kind, int peer) const;
  std::string whyStuck(const Peer& p) const;

  const int rank_;
  const int size_;
  TcpMesh* mesh_;
  TrafficCounters* const traffic_;
  const size_t unexpectedBudget_;
  std::mutex mu_;
  const size_t ringBytes_;          // HETCOMM_P2P_SHM_BYTES (0: no rings)
  std::vector<bool> sharesMemory_;  // by peer rank (setSharedMemoryPeers)
  std::vector<Peer> peers_;
  std::deque<Op> anyRecvs_;  // receives from any source, in posting order
  uint64_t nextPosted_ = 0;
  std::vector<Helper> helpers_;
  int wake_[2] = {-1, -1};
  bool stopping_ = false;
  std::string failure_;  // fail()'s cause: later operations fail with it
  std::function<void(const std::string&)> onFailure_;
  bool failureReported_ = false;  // onFailure_ is called at most once
  uint64_t nextArrival_ = 0;
  int firstPeer_ = 0;  // the loop starts each pass at another peer, so that no peer is always first
  std::atomic<bool> cancelHelpers_{false};
  std::mutex stopMu_;  // serialises stop()
  bool stopped_ = false;
  std::thread thread_;
};

}  // namespace hetcomm
