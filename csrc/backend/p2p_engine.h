#pragma once
// Point-to-point send/recv, progressed by one background thread over non-blocking sockets.
//
// Sends and receives with different peers, and the two directions with one peer, progress
// independently, so "both ranks isend a large tensor, then irecv" cannot deadlock the way it would
// if sends blocked the collective worker. Messages to one peer are matched in posting order; the
// tag and size carried in each message header must equal the posted receive's, or that receive
// fails with a message naming both sides (and the stream from that peer is closed: it can no
// longer be trusted).
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
  struct Peer {
    Socket out;
    std::string outError;
    std::deque<Op> sends;
    Socket in;
    std::string inError;
    std::deque<Op> recvs;
  };
  using Finished = std::vector<std::pair<Done, std::exception_ptr>>;

  void loop();
  void wake();
  void connectPending(Finished& finished);
  void progressSends(int peer, Peer& p, Finished& finished);
  void progressRecvs(int peer, Peer& p, Finished& finished);
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
