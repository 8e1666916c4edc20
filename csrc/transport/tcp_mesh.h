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
//   rank, and a challenge-response that proves knowledge of the group's random secret without
//   sending it: framing.h). Anything else is logged and closed; it disturbs nothing:
//   at most kMaxPendingGreetings connections wait for their handshake at once (the rest wait in
//   the kernel's backlog), and when the process runs out of descriptors the connection is taken
//   off the queue and closed rather than left to make the listener spin.
// * A connector whose handshake fails (the acceptor gave up on a hello that two retransmissions
//   on a lossy link delayed past its timeout) tries again until its deadline. A published address
//   that refuses connections means the peer is gone: that fails at once.
// * Everything that blocks (store lookups, connects, handshakes) gives up within kCancelPollMs of
//   abort() or close(), or of its caller's own Cancelled.
// * TLS (setTls): a link that needs it (the LinkPolicy says which) runs a TLS 1.3 handshake with
//   mutual certificates right after connecting, and the handshake above inside it. The acceptor
//   tells a TLS connection by its first byte (a TLS handshake record, 0x16; a hello starts with
//   "HTCM") and runs its handshake on a short-lived thread of its own; a cleartext connection on a
//   link that needs TLS is refused, and so is a TLS connection on a rank without TLS. With
//   HETCOMM_TLS_VERIFY_NAME=host (tls.h), the connector checks that the acceptor's certificate
//   names the host it dialled, and the acceptor, once the peer proved its rank, that the peer's
//   certificate names the host that rank published (its address, from the PeerLookup).
#include <array>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/framing.h"
#include "transport/group_secret.h"  // freshNonce
#include "transport/link.h"
#include "transport/socket.h"
#include "transport/tls.h"

namespace hetcomm {

// The two MACs of the handshake (framing.h): the acceptor's proof over the hello and its
// challenge, and the connector's. Exposed for tests that play one side by hand.
enum class HandshakeRole { kAcceptor, kConnector };
std::array<uint8_t, kMacBytes> handshakeMac(HandshakeRole role, const std::array<uint8_t, kSecretBytes>& secret,
                                            const std::array<uint8_t, Hello::kBytes>& hello, const Challenge& challenge);

class TcpMesh {
 public:
  using Secret = std::array<uint8_t, kSecretBytes>;
  // Blocking lookup of a peer's published listening address (the store), bounded by a deadline
  // and giving up when cancelled() turns true.
  using PeerLookup = std::function<HostPort(int rank, Deadline deadline, const Cancelled& cancelled)>;
  static constexpr size_t kMaxPendingGreetings = 64;
  using InboundP2P = std::function<void(int peer, std::unique_ptr<Link> link)>;
  // Whether the link with `peer` must be encrypted (it may look the peer's site up: bounded by
  // the deadline).
  using LinkPolicy = std::function<bool(int peer, Deadline deadline, const Cancelled& cancelled)>;

  TcpMesh(int rank, int size, const std::string& listenIp, const Secret& secret, PeerLookup lookup);
  ~TcpMesh();
  TcpMesh(const TcpMesh&) = delete;
  TcpMesh& operator=(const TcpMesh&) = delete;

  HostPort listenAddress() const { return listenAddress_; }
  void setInboundP2PHandler(InboundP2P handler);
  // TLS for the links `needsTls` names (call before any connection is made). Without it, every
  // link is cleartext and TLS connections are refused. Throws tls::TlsError when the context
  // verifies hosts (HETCOMM_TLS_VERIFY_NAME=host) and its own certificate does not name the
  // address this mesh listens on: its peers would refuse every connection.
  void setTls(std::shared_ptr<tls::Context> context, const char* mode, LinkPolicy needsTls);
  // Called if the listener thread stops on an unexpected error (it then accepts nothing more).
  void setFailureHandler(std::function<void(const std::string&)> handler);

  // The collective link to `peer`, established on first use. It stays owned by the mesh (valid
  // until close()).
  Link& collectiveLink(int peer, Deadline deadline);
  // A new sender-side point-to-point link to `peer`; throws ConnectionRefusedError when
  // the peer is gone, CancelledError when `cancelled` (or the mesh's abort) ends the wait.
  std::unique_ptr<Link> connectP2P(int peer, Deadline deadline, const Cancelled& cancelled = {});
  // True when `peer` has certainly exited: its published address refuses connections. False
  // when it answers, and when that cannot be told before the deadline. Throws
  // StoreUnreachableError when the peer's address cannot be looked up because the store is gone.
  bool peerGone(int peer, Deadline deadline, const Cancelled& cancelled = {});

  // Shuts every collective connection down so that peers blocked on us fail fast instead of
  // waiting for their timeout; the mesh is unusable afterwards.
  void abort();
  // Stops the listener and closes everything (idempotent).
  void close();

  int64_t rejectedConnections() const;
  // Caps this rank's send rate on its collective link to each peer (bytes per second, one entry
  // per rank; 0: no cap), on the links open now and on those opened later (Link::pace). Returns
  // how many open links the kernel refused the cap on.
  int setPacing(const std::vector<uint64_t>& bytesPerSecond);
  // Per peer: the cap the kernel holds on the collective link (0: none), -1 without a link yet.
  std::vector<int64_t> pacing() const;
  // Per peer: -1 no collective connection yet, 0 cleartext, 1 TLS.
  std::vector<int> collectiveLinkSecurity() const;

 private:
  std::unique_ptr<Link> connectAndGreet(int peer, Channel channel, Deadline deadline, const Cancelled& cancelled);
  // A connection that has not finished its handshake yet.
  struct Greeting {
    Socket socket;               // until the first bytes say which link it is (TLS or TCP) ...
    std::unique_ptr<Link> link;  // ... then this
    std::string from;
    std::array<uint8_t, Hello::kBytes> hello{};
    Hello parsed;
    bool challenged = false;  // the hello was read and answered with `challenge`: the proof is next
    Challenge challenge;
    std::array<uint8_t, kMacBytes> proof{};
    size_t got = 0;  // bytes of the current message (hello, then proof)
    Deadline deadline;
  };
  void listenLoop();
  // Reads what the greeting sent; true when it is finished (accepted or rejected).
  bool progressGreeting(Greeting& g);
  // Checks the hello and answers it with this rank's challenge.
  void challenge(Greeting& g);
  // Checks the proof; accepts the connection or throws.
  void acceptGreeting(Greeting& g);
  // Why a certificate with the right DNS name is refused all the same (HETCOMM_TLS_VERIFY_NAME).
  static constexpr char kNamesHint[] =
      " (ranks publish IP addresses: a certificate names them with IP entries in its subjectAltName)";
  // Tells the peer of a proven greeting why it is refused (HelloAck), then throws CommError(why).
  [[noreturn]] void refuse(Greeting& g, const std::string& why);
  // Counts a refused connection and logs it (at most a line a second; only at debug level when quiet).
  void reject(const std::string& from, const std::string& why, bool quiet = false);
  // A connection that starts with a TLS record: its whole greeting on a thread of its own.
  void greetTls(Greeting g);
  // The first byte waiting on a new connection (not consumed), kNoByteYet, or kClosed (the end of
  // the stream or an error: the greeting is then rejected, quietly). 0x16 starts a TLS record.
  static constexpr int kNoByteYet = -1;
  static constexpr int kClosed = -2;
  static int firstByte(const Socket& socket);
  void reapGreeters();
  // Accepts one connection from the listener's queue into `greetings`; never blocks.
  void acceptOne(std::vector<Greeting>& greetings, Socket& spare, Deadline& pausedUntil);

  const int rank_;
  const int size_;
  const Secret secret_;
  PeerLookup lookup_;
  InboundP2P inboundP2P_;
  std::function<void(const std::string&)> onFailure_;  // guarded by mu_
  std::shared_ptr<tls::Context> tls_;  // null: no TLS (set once, before any connection)
  std::string tlsMode_ = "off";
  LinkPolicy needsTls_;
  struct Greeter {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<Greeter> tlsGreeters_;  // guarded by mu_; finished ones joined by the listener, the rest by close()

  Socket listener_;
  HostPort listenAddress_;
  int wakePipe_[2] = {-1, -1};
  std::thread listenThread_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Link>> collective_;  // by peer rank; set once, freed by close()
  std::vector<uint64_t> pacing_;                   // [peer]: setPacing's cap for links opened later (0: none)
  std::vector<bool> connecting_;                   // a thread of ours is opening collective_[peer]
  bool aborted_ = false;
  bool closed_ = false;
  std::atomic<bool> stopConnects_{false};  // abort() or close(): blocked connects give up
  int64_t rejected_ = 0;
  int64_t rejectsNotLogged_ = 0;  // reject() logs at most one line a second
  Deadline nextRejectLog_{};
};

}  // namespace hetcomm
