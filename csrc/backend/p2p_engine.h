#pragma once
// Point-to-point send/recv, progressed by one background thread over non-blocking sockets.
//
// Sends and receives with different peers, and the two directions with one peer, progress
// independently, so "both ranks isend a large tensor, then irecv" cannot deadlock the way it would
// if sends blocked the collective worker. A receive matches the earliest message from its peer
// with its tag (as in Gloo and MPI), whatever the posting order. Incoming data is read eagerly:
// a message nobody has asked for yet is kept until a receive claims it, so a sender is never
// stuck behind a tag the receiver posts later. A message whose size differs from the matching
// receive's fails that receive with a message naming both sides, and the stream from that peer is
// closed (it can no longer be trusted).
#include <array>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/framing.h"
#include "transport/tcp_mesh.h"

namespace hetcomm {

class P2PEngine {
 public:
  using Done = std::function<void(std::exception_ptr)>;

  P2PEngine(int rank, int size, TcpMesh* mesh);
  ~P2PEngine();
  P2PEngine(const P2PEngine&) = delete;
  P2PEngine& operator=(const P2PEngine&) = delete;

  void postSend(int peer, int64_t tag, const char* data, size_t bytes, Deadline deadline, int64_t timeoutMs, Done done);
  void postRecv(int peer, int64_t tag, char* data, size_t bytes, Deadline deadline, int64_t timeoutMs, Done done);
  // An accepted sender connection from `peer` (called by the mesh's listener thread).
  void addInbound(int peer, Socket socket);
  // Fails everything pending and stops the thread (idempotent).
  void stop(const std::string& reason);

 private:
  struct Op {
    char* data = nullptr;
    size_t bytes = 0;
    int64_t tag = 0;
    Deadline deadline;
    int64_t timeoutMs = 0;
    Done done;
    std::array<uint8_t, P2PHeader::kBytes> header{};
    size_t headerDone = 0;
    size_t dataDone = 0;
  };
  // The message currently arriving from a peer: its header, then its payload, written either
  // into the matching posted receive or into a buffer of its own (unexpected).
  struct Incoming {
    std::array<uint8_t, P2PHeader::kBytes> header{};
    size_t headerDone = 0;
    P2PHeader parsed;
    bool matched = false;
    Op op;                        // when matched
    std::vector<char> unexpected; // when not
    size_t dataDone = 0;
  };
  struct Peer {
    Socket out;
    std::string outError;
    std::deque<Op> sends;
    Socket in;
    std::string inError;
    std::deque<Op> recvs;  // posted, not yet matched, in posting order
    Incoming incoming;
    std::deque<std::pair<int64_t, std::vector<char>>> unexpected;  // (tag, payload), arrival order
  };
  using Finished = std::vector<std::pair<Done, std::exception_ptr>>;

  void loop();
  void wake();
  void connectPending(Finished& finished);
  void progressSends(int peer, Peer& p, Finished& finished);
  void progressRecvs(int peer, Peer& p, Finished& finished);
  void breakInbound(int peer, Peer& p, const std::string& why, Finished& finished);
  void timeOut(int peer, Peer& p, Deadline now, Finished& finished, int& pollTimeoutMs);
  void failAll(std::deque<Op>& ops, const std::string& why, Finished& finished);

  const int rank_;
  const int size_;
  TcpMesh* mesh_;
  std::mutex mu_;
  std::vector<Peer> peers_;
  int wake_[2] = {-1, -1};
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace hetcomm
