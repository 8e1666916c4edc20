#pragma once
// TcpMesh: the TCP connections of one process group.
//
// * One listening socket per group, on the address published in the store.
// * Collective connections: one per unordered pair of ranks, opened the first time a collective
//   needs it, by the higher rank (the lower one waits for it to be accepted). Full duplex.
// * Point-to-point connections: one per ordered pair, opened by the sender, handed to the
//   point-to-point engine on the receiving side. Keeping them apart from the collective
//   connections means a send/recv can never interleave with a collective's byte stream.
// * A listener thread accepts connections and checks a handshake (magic, version, world size,
//   rank, the group's random secret). Anything else is logged and closed; it disturbs nothing.
#include <array>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/framing.h"
#include "transport/socket.h"

namespace hetcomm {

class TcpMesh {
 public:
  using Secret = std::array<uint8_t, kSecretBytes>;
  // Blocking lookup of a peer's published listening address (the store), bounded by a deadline.
  using PeerLookup = std::function<HostPort(int rank, Deadline deadline)>;
  using InboundP2P = std::function<void(int peer, Socket socket)>;

  TcpMesh(int rank, int size, const std::string& listenIp, const Secret& secret, PeerLookup lookup);
  ~TcpMesh();
  TcpMesh(const TcpMesh&) = delete;
  TcpMesh& operator=(const TcpMesh&) = delete;

  HostPort listenAddress() const { return listenAddress_; }
  void setInboundP2PHandler(InboundP2P handler);

  // The collective connection to `peer`, established on first use. The fd stays owned by the mesh.
  int collectiveFd(int peer, Deadline deadline);
  // A new sender-side point-to-point connection to `peer`.
  Socket connectP2P(int peer, Deadline deadline);

  // Shuts every collective connection down so that peers blocked on us fail fast instead of
  // waiting for their timeout; the mesh is unusable afterwards.
  void abort();
  // Stops the listener and closes everything (idempotent).
  void close();

  int64_t rejectedConnections() const;

 private:
  Socket connectAndGreet(int peer, Channel channel, Deadline deadline);
  // A connection that has not finished its handshake yet.
  struct Greeting {
    Socket socket;
    std::string from;
    std::array<uint8_t, Hello::kBytes> hello{};
    size_t got = 0;
    Deadline deadline;
  };
  void listenLoop();
  // Reads what the greeting sent; true when it is finished (accepted or rejected).
  bool progressGreeting(Greeting& g);
  void acceptGreeting(Greeting& g);
  void reject(const std::string& from, const std::string& why);

  const int rank_;
  const int size_;
  const Secret secret_;
  PeerLookup lookup_;
  InboundP2P inboundP2P_;

  Socket listener_;
  HostPort listenAddress_;
  int wakePipe_[2] = {-1, -1};
  std::thread listenThread_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Socket> collective_;  // by peer rank
  bool aborted_ = false;
  bool closed_ = false;
  int64_t rejected_ = 0;
};

}  // namespace hetcomm
