// TcpMesh's connecting side against scripted peers: a handshake the acceptor gave up on is tried
// again, an address that refuses connections fails at once, a probe tells a gone peer from a live
// one, an abort interrupts a connector still waiting for its peer's address, and a send-rate cap
// (setPacing) reaches the sockets of links that open after it.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <string>
#include <chrono>
#include <thread>

#include "check.h"
#include "common/error.h"
#include "transport/framing.h"
#include "transport/socket.h"
#include "transport/tcp_mesh.h"
#include "transport/tls.h"
#include "tls_pki.h"

using namespace hetcomm;

namespace {

TcpMesh::Secret testSecret() {
  TcpMesh::Secret s{};
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<uint8_t>(3 * i + 1);
  return s;
}

// A blocking listener on loopback that plays rank 1 of a 2-rank group, connection by connection.
class ScriptedPeer {
 public:
  ScriptedPeer() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    ::listen(fd_, 8);
    address_ = boundAddress(fd_);
  }
  ~ScriptedPeer() { ::close(fd_); }
  HostPort address() const { return address_; }
  int accept() { return ::accept(fd_, nullptr, nullptr); }
  // Reads a whole hello from `fd`; false if the connection closed first.
  static bool readHello(int fd, Hello& hello) {
    if (!readAll(fd, lastHello_.data(), lastHello_.size())) return false;
    return Hello::decode(lastHello_.data(), hello).empty();
  }
  // Plays the acceptor's side of the handshake after readHello: the challenge, the connector's
  // proof (checked: true when it verifies), the ack.
  static bool answer(int fd, int32_t rank) {
    Challenge c;
    c.rank = rank;
    c.nonce = freshNonce();
    c.mac = handshakeMac(HandshakeRole::kAcceptor, testSecret(), lastHello_, c);
    const auto bytes = c.encode();
    (void)!::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    std::array<uint8_t, kMacBytes> proof{};
    if (!readAll(fd, proof.data(), proof.size())) return false;
    if (proof != handshakeMac(HandshakeRole::kConnector, testSecret(), lastHello_, c)) return false;
    HelloAck ack;
    ack.rank = rank;
    const auto ackBytes = ack.encode();
    (void)!::send(fd, ackBytes.data(), ackBytes.size(), MSG_NOSIGNAL);
    return true;
  }

 private:
  static bool readAll(int fd, uint8_t* p, size_t len) {
    size_t got = 0;
    while (got < len) {
      ssize_t n = ::recv(fd, p + got, len - got, 0);
      if (n <= 0) return false;
      got += static_cast<size_t>(n);
    }
    return true;
  }
  static inline std::array<uint8_t, Hello::kBytes> lastHello_{};

  int fd_ = -1;
  HostPort address_;
};

// An address nothing listens on (a port bound and released again).
HostPort deadAddress() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  HostPort hp = boundAddress(fd);
  ::close(fd);
  return hp;
}

TcpMesh::PeerLookup fixedLookup(HostPort address) {
  return [address](int, Deadline, const Cancelled&) { return address; };
}

Deadline in(int seconds) { return Clock::now() + std::chrono::seconds(seconds); }

}  // namespace

TEST_CASE(a_handshake_the_acceptor_gave_up_on_is_tried_again) {
  ScriptedPeer peer;
  std::atomic<int> connections{0};
  std::thread script([&] {
    // First connection: close it unanswered, as an acceptor does when the hello came too late.
    int first = peer.accept();
    ++connections;
    ::close(first);
    // Second: a proper answer.
    int second = peer.accept();
    ++connections;
    Hello hello;
    if (ScriptedPeer::readHello(second, hello) && hello.rank == 0 && hello.channel == Channel::kP2P) {
      ScriptedPeer::answer(second, 1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    ::close(second);
  });
  TcpMesh mesh(0, 2, "127.0.0.1", testSecret(), fixedLookup(peer.address()));
  CHECK_NOTHROW(mesh.connectP2P(1, in(20)));
  script.join();
  CHECK_EQ(connections.load(), 2);
}

TEST_CASE(an_address_that_refuses_connections_fails_at_once) {
  TcpMesh mesh(0, 2, "127.0.0.1", testSecret(), fixedLookup(deadAddress()));
  // Not retried until the 60 s deadline: the error names the refusal.
  CHECK_THROWS_AS(mesh.connectP2P(1, in(60)), ConnectionRefusedError);
  try {
    mesh.connectP2P(1, in(60));
  } catch (const ConnectionRefusedError& e) {
    CHECK_MSG(std::string(e.what()).find("rank 1") != std::string::npos, e.what());
    CHECK_MSG(std::string(e.what()).find("no longer listening") != std::string::npos, e.what());
  }
}

TEST_CASE(a_probe_tells_a_gone_peer_from_a_live_one) {
  TcpMesh gone(0, 2, "127.0.0.1", testSecret(), fixedLookup(deadAddress()));
  CHECK(gone.peerGone(1, in(5)));

  ScriptedPeer peer;
  std::thread script([&] {
    int fd = peer.accept();
    Hello hello;
    if (ScriptedPeer::readHello(fd, hello) && hello.channel == Channel::kProbe) ScriptedPeer::answer(fd, 1);
    ::close(fd);
  });
  TcpMesh alive(0, 2, "127.0.0.1", testSecret(), fixedLookup(peer.address()));
  CHECK(!alive.peerGone(1, in(5)));
  script.join();
}

TEST_CASE(abort_interrupts_a_connector_waiting_for_its_peer_address) {
  // The peer never publishes its address: the lookup waits until it is told to give up.
  TcpMesh::PeerLookup waitForever = [](int, Deadline deadline, const Cancelled& cancelled) -> HostPort {
    while (Clock::now() < deadline) {
      if (cancelled && cancelled()) throw CancelledError("lookup cancelled");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    throw TimeoutError("lookup timed out");
  };
  TcpMesh mesh(0, 2, "127.0.0.1", testSecret(), waitForever);
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    mesh.abort();
  });
  // With a 60 s deadline, only the abort can end this early, and it ends as cancelled.
  CHECK_THROWS_AS(mesh.connectP2P(1, in(60)), CancelledError);
  aborter.join();
  // A caller's own cancellation works the same way.
  TcpMesh other(0, 2, "127.0.0.1", testSecret(), waitForever);
  std::atomic<bool> stop{false};
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    stop = true;
  });
  CHECK_THROWS_AS(other.connectP2P(1, in(60), [&] { return stop.load(); }), CancelledError);
  stopper.join();
}

// Addresses come from the store: a port that is no number from 1 to 65535 is a CommError saying
// so (stoi threw std::invalid_argument for "h:x", and "h:70000" became port 4464).
TEST_CASE(a_malformed_port_is_a_comm_error) {
  CHECK_EQ(HostPort::parse("10.0.0.5:4711").port, 4711);
  CHECK(HostPort::parse("[::1]:65535").host == "::1");
  CHECK_EQ(HostPort::parse("[::1]:65535").port, 65535);
  for (const char* bad : {"h:70000", "h:65536", "h:0", "h:x", "h:-1", "h: 80", "h:80x", "h:99999999999999999999", "h:"}) {
    bool threw = false;
    try {
      HostPort::parse(bad);
    } catch (const CommError& e) {
      threw = std::string(e.what()).find("malformed address") != std::string::npos;
    } catch (...) {
    }
    CHECK_MSG(threw, bad);
  }
}

// What the store holds may be anything: an error that quotes it stays printable ASCII (Python reads
// error messages as UTF-8) and short (a 4 MiB value must not become a 4 MiB message).
TEST_CASE(a_malformed_address_is_quoted_printably_and_briefly) {
  const std::string garbage = std::string("\xff\x92" "ab\n", 5) + std::string(1 << 20, 'A');
  std::string what;
  try {
    HostPort::parse(garbage);
  } catch (const CommError& e) {
    what = e.what();
  }
  CHECK(what.find("\\xff\\x92ab\\x0aAAA") != std::string::npos);
  CHECK(what.find("(1048581 bytes)") != std::string::npos);
  CHECK(what.size() < 300);
  for (unsigned char c : what) CHECK(c >= 0x20 && c < 0x7f);
  CHECK_EQ(excerpt("plain text"), std::string("plain text"));
}

// A clear-text greeting on a mesh with TLS: the listener asks the link policy (which may look a
// site up in the store) without waiting, since it progresses every other greeting meanwhile. It
// gave the policy the handshake's deadline (3 s), so anyone with the secret could stall the
// listener that long per connection.
TEST_CASE(the_listener_asks_the_tls_policy_without_waiting) {
  const tls_pki::Pki& pki = tls_pki::Pki::get();
  std::string why;
  if (!tls::available(&why)) SKIP_TEST("OpenSSL cannot be loaded: " + why);
  if (!pki.error().empty()) SKIP_TEST(pki.error());
  tls::Config c;
  c.mode = tls::Config::Mode::kInterSite;
  c.cert = pki.path("a.pem");
  c.key = pki.path("a.key");
  c.ca = pki.path("caA.pem");
  TcpMesh acceptor(0, 2, "127.0.0.1", testSecret(), fixedLookup(deadAddress()));
  std::atomic<int64_t> slackMs{-1000000};
  acceptor.setTls(tls::Context::create(c), "inter-site", [&](int, Deadline deadline, const Cancelled&) {
    slackMs = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    return true;  // this link needs TLS
  });
  TcpMesh connector(1, 2, "127.0.0.1", testSecret(), fixedLookup(acceptor.listenAddress()));
  std::string refused;
  try {
    connector.connectP2P(0, in(20));
  } catch (const CommError& e) {
    refused = e.what();
  }
  CHECK_MSG(refused.find("without TLS") != std::string::npos, refused);
  CHECK_MSG(slackMs.load() <= 0, std::to_string(slackMs.load()) + " ms");
}

// HETCOMM_TLS_VERIFY_NAME=host, acted out by a rogue that holds a certificate the cluster's CA
// signed for another host (tls_pki.h: a names only rank-a; d names 127.0.0.1, where every mesh
// here listens) and does not check names itself. It is refused whether it accepts or connects,
// and says why; honest ranks whose certificates name their address connect; and a rank whose own
// certificate does not name its address is told so before any peer refuses it.
TEST_CASE(certificates_must_name_the_host_of_the_rank_with_verify_name_host) {
  const tls_pki::Pki& pki = tls_pki::Pki::get();
  std::string why;
  if (!tls::available(&why)) SKIP_TEST("OpenSSL cannot be loaded: " + why);
  if (!pki.error().empty()) SKIP_TEST(pki.error());
  auto context = [&](const char* leaf, bool verify) {
    tls::Config c;
    c.mode = tls::Config::Mode::kAll;
    c.cert = pki.path(std::string(leaf) + ".pem");
    c.key = pki.path(std::string(leaf) + ".key");
    c.ca = pki.path("caA.pem");
    c.verifyHost = verify;
    return tls::Context::create(c);
  };
  auto always = [](int, Deadline, const Cancelled&) { return true; };
  // Rank 1 connects to rank 0 with the given certificates; what rank 1 was told ("" if connected).
  // `published`: rank 1's address as rank 0 looks it up (only its host is checked).
  auto connect = [&](const char* leaf0, bool verify0, const char* leaf1, bool verify1,
                     const std::string& published = "127.0.0.1") {
    TcpMesh acceptor(0, 2, "127.0.0.1", testSecret(), fixedLookup(HostPort{published, deadAddress().port}));
    acceptor.setTls(context(leaf0, verify0), "all", always);
    TcpMesh connector(1, 2, "127.0.0.1", testSecret(), fixedLookup(acceptor.listenAddress()));
    connector.setTls(context(leaf1, verify1), "all", always);
    try {
      connector.connectP2P(0, in(20));
    } catch (const CommError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK_EQ(connect("d", true, "d", true), std::string());
  // The published address decides, not where the connection comes from (127.0.0.1 either way).
  std::string told0 = connect("d", true, "d", true, "127.0.0.2");
  CHECK_MSG(told0.find("certificate of rank 1 (/CN=rank-d) does not name 127.0.0.2") != std::string::npos, told0);
  // The rogue connects: the acceptor refuses it and tells it why.
  std::string told = connect("d", true, "a", false);
  CHECK_MSG(told.find("refused the connection") != std::string::npos &&
                told.find("certificate of rank 1 (/CN=rank-a) does not name 127.0.0.1") != std::string::npos &&
                told.find("HETCOMM_TLS_VERIFY_NAME=host on rank 0") != std::string::npos,
            told);
  // The rogue accepts (as a rank whose address a store writer re-pointed would): the connector refuses it.
  told = connect("a", false, "d", true);
  CHECK_MSG(told.find("the address rank 0 published; /CN=rank-a) does not name 127.0.0.1") != std::string::npos &&
                told.find("HETCOMM_TLS_VERIFY_NAME=host on rank 1") != std::string::npos,
            told);
  // Without the check (the default), a certificate of any name from the CA is accepted.
  CHECK_EQ(connect("a", false, "b", false), std::string());
  // A rank's own certificate that does not name its address: told at once.
  TcpMesh misconfigured(0, 2, "127.0.0.1", testSecret(), fixedLookup(deadAddress()));
  std::string own;
  try {
    misconfigured.setTls(context("a", true), "all", always);
  } catch (const tls::TlsError& e) {
    own = e.what();
  }
  CHECK_MSG(own.find("this rank's own certificate (/CN=rank-a) does not name 127.0.0.1") != std::string::npos, own);
}

// A send-rate cap set before a collective link exists reaches its socket once the link opens, on
// the side that connects and on the side that accepts (read back from the kernel), and 0 lifts it.
TEST_CASE(pacing_set_before_a_link_opens_reaches_its_socket_on_both_sides) {
  HostPort addresses[2];
  auto lookup = [&addresses](int rank, Deadline, const Cancelled&) { return addresses[rank]; };
  TcpMesh acceptor(0, 2, "127.0.0.1", testSecret(), lookup);
  TcpMesh connector(1, 2, "127.0.0.1", testSecret(), lookup);
  addresses[0] = acceptor.listenAddress();
  addresses[1] = connector.listenAddress();
  CHECK_EQ(acceptor.setPacing({0, 50000}), 0);
  CHECK_EQ(connector.setPacing({60000, 0}), 0);
  CHECK(acceptor.pacing() == (std::vector<int64_t>{-1, -1}));   // no link yet
  std::thread connecting([&] { connector.collectiveLink(0, in(20)); });
  acceptor.collectiveLink(1, in(20));
  connecting.join();
  CHECK(acceptor.pacing() == (std::vector<int64_t>{-1, 50000}));
  CHECK(connector.pacing() == (std::vector<int64_t>{60000, -1}));
  CHECK_EQ(connector.setPacing({0, 0}), 0);
  CHECK(connector.pacing() == (std::vector<int64_t>{0, -1}));
}
