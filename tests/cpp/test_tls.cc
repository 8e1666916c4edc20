// The TLS layer over loopback TCP, with throwaway certificates (tls_pki.h): a mutual handshake
// and 64 MB each way at once through TLS links (link.h); certificates of another CA refused
// with a message on each side; a plaintext peer; a deadline and a cancellation during the
// handshake; the hosts a certificate names; bytes left in OpenSSL's buffer reported receivable
// by waitLinks; failures after the handshake (garbage, a closed peer) without SIGPIPE. No
// OpenSSL at all, the HETCOMM_TLS* settings and unusable credentials: test_tls_config.cc.
// Without OpenSSL or the openssl tool the tests that need them are skipped (exit code 77).
#include <errno.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "common/error.h"
#include "tls_helpers.h"
#include "tls_pki.h"
#include "transport/framing.h"
#include "transport/link.h"
#include "transport/socket.h"
#include "transport/tls.h"

using namespace hetcomm;
using tls_pki::Pki;
using namespace tls_helpers;

namespace {

constexpr auto kTestTimeout = std::chrono::seconds(60);

// A connected pair of non-blocking loopback sockets.
struct SocketPair {
  Socket server, client;
};

SocketPair loopbackPair() {
  Socket listener = listenOn("127.0.0.1", 0);
  SocketPair link;
  link.client = connectTo(boundAddress(listener.fd()), Clock::now() + std::chrono::seconds(10));
  pollfd p{listener.fd(), POLLIN, 0};
  REQUIRE(::poll(&p, 1, 10000) == 1);
  link.server = Socket(::accept4(listener.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
  REQUIRE(link.server.valid());
  return link;
}

std::string messageOf(const std::exception_ptr& error) {
  if (!error) return "(no error)";
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(not a std::exception)";
}

template <typename E>
bool isA(const std::exception_ptr& error) {
  if (!error) return false;
  try {
    std::rethrow_exception(error);
  } catch (const E&) {
    return true;
  } catch (...) {
  }
  return false;
}


// Both handshakes at once, the server's on a thread; each side's session or exception.
struct Handshakes {
  std::unique_ptr<tls::Session> server, client;
  std::exception_ptr serverError, clientError;
};

// With closeOnFailure the server closes its socket as soon as its handshake fails, as a real
// acceptor would (unread bytes then make it a reset), rather than after both sides are done.
Handshakes handshakeBoth(const tls::Context& serverContext, const tls::Context& clientContext, SocketPair& link,
                         bool closeOnFailure = false) {
  Handshakes h;
  const Deadline deadline = Clock::now() + std::chrono::seconds(10);
  std::thread server([&] {
    try {
      h.server = tls::Session::handshake(serverContext, link.server.fd(), true, deadline, {}, [] { return std::string("the client"); });
    } catch (...) {
      h.serverError = std::current_exception();
      if (closeOnFailure) link.server.close();
    }
  });
  try {
    h.client = tls::Session::handshake(clientContext, link.client.fd(), false, deadline, {}, [] { return std::string("the server"); });
  } catch (...) {
    h.clientError = std::current_exception();
  }
  server.join();
  return h;
}

// A loopback TLS link after a successful handshake, both ends (and their sessions, which the
// links own, for the tests that look inside).
struct SecureLink {
  std::unique_ptr<Link> server, client;
  tls::Session* serverSession = nullptr;
  tls::Session* clientSession = nullptr;
};

SecureLink secureLink(const tls::Context& serverContext, const tls::Context& clientContext) {
  SocketPair pair = loopbackPair();
  Handshakes h = handshakeBoth(serverContext, clientContext, pair);
  CHECK_MSG(!h.serverError, messageOf(h.serverError));
  CHECK_MSG(!h.clientError, messageOf(h.clientError));
  REQUIRE(h.server && h.client);
  SecureLink s;
  s.serverSession = h.server.get();
  s.clientSession = h.client.get();
  s.server = tlsLink(std::move(pair.server), std::move(h.server));
  s.client = tlsLink(std::move(pair.client), std::move(h.client));
  return s;
}

// Sizes of writes and reads: from 1 byte to 1 MB, log-uniformly, so that records are cut
// anywhere and many calls take less than a record.
size_t randomSize(std::mt19937_64& rng) {
  const int bits = static_cast<int>(rng() % 21);
  return 1 + static_cast<size_t>(rng() % (size_t{1} << bits));
}

// One direction of a transfer through a link, advanced by step() until it would block.
struct Sender {
  Link* link;
  const std::vector<uint8_t>* data;
  std::mt19937_64 rng;
  size_t done = 0;
  size_t offer = 0;  // kept after EAGAIN: the next write must offer at least the same bytes
  bool finished() const { return done == data->size(); }
  void step() {
    while (!finished()) {
      if (offer == 0) offer = std::min(randomSize(rng), data->size() - done);
      const ssize_t n = link->send(data->data() + done, offer);
      if (n < 0 && errno == EAGAIN) return;
      if (n <= 0) throw std::runtime_error(std::string("send failed: ") + std::strerror(errno));
      done += static_cast<size_t>(n);
      offer = 0;
    }
  }
};

struct Receiver {
  Link* link;
  std::vector<uint8_t>* out;
  std::mt19937_64 rng;
  size_t done = 0;
  bool finished() const { return done == out->size(); }
  void step() {
    while (!finished()) {
      const size_t want = std::min(randomSize(rng), out->size() - done);
      const ssize_t n = link->recv(out->data() + done, want);
      if (n < 0 && errno == EAGAIN) return;
      if (n == 0) throw std::runtime_error("recv: the peer closed the connection");
      if (n < 0) throw std::runtime_error(std::string("recv failed: ") + std::strerror(errno));
      done += static_cast<size_t>(n);
    }
  }
};

// Runs the given directions (on one link) to the end, sleeping in waitLinks in between.
void pump(Link& link, Sender* sender, Receiver* receiver, Deadline deadline) {
  while ((sender != nullptr && !sender->finished()) || (receiver != nullptr && !receiver->finished())) {
    if (sender != nullptr) sender->step();
    if (receiver != nullptr) receiver->step();
    LinkWait w{&link, sender != nullptr && !sender->finished(), receiver != nullptr && !receiver->finished()};
    if (!w.send && !w.recv) break;
    if (Clock::now() > deadline) throw std::runtime_error("the transfer did not finish in time");
    if (waitLinks(&w, 1, std::chrono::seconds(1)) < 0) throw std::runtime_error("waitLinks failed");
  }
}

std::vector<uint8_t> randomBytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i + 8 <= n; i += 8) {
    const uint64_t r = rng();
    std::memcpy(v.data() + i, &r, 8);
  }
  for (size_t i = n / 8 * 8; i < n; ++i) v[i] = static_cast<uint8_t>(rng());
  return v;
}

// Runs fn on a thread, catching what it throws.
struct Worker {
  template <typename Fn>
  explicit Worker(Fn fn)
      : thread([this, fn] {
          try {
            fn();
          } catch (...) {
            error = std::current_exception();
          }
        }) {}
  void join() { thread.join(); }
  std::exception_ptr error;
  std::thread thread;
};

}  // namespace

// (a) Mutual handshake, then 64 MB each way at once in random-sized writes and reads. The
// server's side moves both directions on one thread (as a pipeline does on a full-duplex link);
// the client's side reads and writes on two threads (the session serialises them).
TEST_CASE(handshakeAndBidirectionalTransfer) {
  const Pki& pki = requirePki();
  auto serverContext = contextOf(pki, "a", "caA"), clientContext = contextOf(pki, "b", "caA");
  SecureLink s = secureLink(*serverContext, *clientContext);
  Link& server = *s.server;
  Link& client = *s.client;
  CHECK(server.kind() == Link::Kind::kTls && client.kind() == Link::Kind::kTls);

  constexpr size_t kBytes = 64 << 20;
  const std::vector<uint8_t> toClient = randomBytes(kBytes, 1), toServer = randomBytes(kBytes, 2);
  std::vector<uint8_t> atClient(kBytes), atServer(kBytes);
  const Deadline deadline = Clock::now() + kTestTimeout;
  Worker serverSide([&] {
    Sender s{&server, &toClient, std::mt19937_64(11)};
    Receiver r{&server, &atServer, std::mt19937_64(12)};
    pump(server, &s, &r, deadline);
  });
  Worker clientWriter([&] {
    Sender s{&client, &toServer, std::mt19937_64(21)};
    pump(client, &s, nullptr, deadline);
  });
  Worker clientReader([&] {
    Receiver r{&client, &atClient, std::mt19937_64(22)};
    pump(client, nullptr, &r, deadline);
  });
  serverSide.join();
  clientWriter.join();
  clientReader.join();
  CHECK_MSG(!serverSide.error, messageOf(serverSide.error));
  CHECK_MSG(!clientWriter.error, messageOf(clientWriter.error));
  CHECK_MSG(!clientReader.error, messageOf(clientReader.error));
  CHECK(atClient == toClient);
  CHECK(atServer == toServer);

  // A clean close: close_notify reads as 0, and the closing side can write no more.
  s.clientSession->closeNotify();
  char c;
  ssize_t n = -1;
  for (int i = 0; i < 1000 && n < 0; ++i) {
    n = server.recv(&c, 1);
    if (n < 0 && errno == EAGAIN) {
      LinkWait w{&server, false, true};
      waitLinks(&w, 1, std::chrono::milliseconds(10));
    }
  }
  CHECK_EQ(n, 0);
  errno = 0;
  CHECK_EQ(client.send("x", 1), -1);
  CHECK_EQ(errno, EPIPE);
}

// (b) A certificate signed by another CA is refused, and each side says which way round.
TEST_CASE(certificateOfAnotherCaIsRefused) {
  const Pki& pki = requirePki();
  auto trusted = contextOf(pki, "a", "caA");
  for (bool closeOnFailure : {false, true}) {
    // The server refuses the client's certificate.
    auto stranger = contextOf(pki, "c", "caA");
    SocketPair link = loopbackPair();
    Handshakes h = handshakeBoth(*trusted, *stranger, link, closeOnFailure);
    CHECK_MSG(isA<tls::TlsError>(h.serverError), messageOf(h.serverError));
    CHECK_MSG(isA<tls::TlsError>(h.clientError), messageOf(h.clientError));
    const std::string server = messageOf(h.serverError), client = messageOf(h.clientError);
    CHECK_MSG(contains(server, "TLS handshake with the client failed: the peer's certificate was rejected: "), server);
    CHECK_MSG(contains(server, "unable to get local issuer certificate"), server);
    CHECK_MSG(contains(client, "TLS handshake with the server failed: the peer refused our certificate (alert: "), client);
    std::printf("  server: %s\n  client: %s\n", server.c_str(), client.c_str());
  }
  {
    // The client refuses the server's certificate.
    auto stranger = contextOf(pki, "c", "caB");
    SocketPair link = loopbackPair();
    Handshakes h = handshakeBoth(*trusted, *stranger, link);
    const std::string server = messageOf(h.serverError), client = messageOf(h.clientError);
    CHECK_MSG(isA<tls::TlsError>(h.serverError) && contains(server, "the peer refused our certificate"), server);
    CHECK_MSG(isA<tls::TlsError>(h.clientError) && contains(client, "the peer's certificate was rejected"), client);
  }
}

// (c) A peer that speaks plaintext (a hetcomm hello) gets a clear error on the TLS side, at once.
TEST_CASE(plaintextPeerIsReportedNotSpeakingTls) {
  const Pki& pki = requirePki();
  auto context = contextOf(pki, "a", "caA");
  const auto hello = Hello().encode();
  for (bool tlsIsServer : {true, false}) {
    SocketPair link = loopbackPair();
    const int tlsFd = tlsIsServer ? link.server.fd() : link.client.fd();
    const int plainFd = tlsIsServer ? link.client.fd() : link.server.fd();
    // The plaintext side sends its hello and keeps the connection open: no EOF helps the TLS side.
    REQUIRE(::send(plainFd, hello.data(), hello.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(hello.size()));
    const auto start = Clock::now();
    std::exception_ptr error;
    try {
      tls::Session::handshake(*context, tlsFd, tlsIsServer, start + std::chrono::seconds(20), {}, [] { return std::string("rank 1"); });
    } catch (...) {
      error = std::current_exception();
    }
    const std::string message = messageOf(error);
    CHECK_MSG(isA<tls::TlsError>(error), message);
    CHECK_MSG(contains(message, "TLS handshake with rank 1 failed: the peer is not speaking TLS"), message);
    CHECK(Clock::now() - start < std::chrono::seconds(5));
    if (tlsIsServer) std::printf("  %s\n", message.c_str());
  }
}

// (d) A server that never answers: the handshake ends at its deadline, or when cancelled.
TEST_CASE(silentPeerTimesOutOrIsCancelled) {
  const Pki& pki = requirePki();
  auto context = contextOf(pki, "a", "caA");
  SocketPair link = loopbackPair();
  auto what = [] { return std::string("rank 2"); };
  auto start = Clock::now();
  std::exception_ptr error;
  try {
    tls::Session::handshake(*context, link.client.fd(), false, start + std::chrono::milliseconds(300), {}, what);
  } catch (...) {
    error = std::current_exception();
  }
  auto elapsed = Clock::now() - start;
  CHECK_MSG(isA<TimeoutError>(error), messageOf(error));
  CHECK_MSG(contains(messageOf(error), "TLS handshake with rank 2 timed out"), messageOf(error));
  CHECK(elapsed >= std::chrono::milliseconds(290) && elapsed < std::chrono::seconds(5));

  SocketPair other = loopbackPair();
  start = Clock::now();
  error = nullptr;
  Cancelled cancelled = [&] { return Clock::now() - start > std::chrono::milliseconds(100); };
  try {
    tls::Session::handshake(*context, other.server.fd(), true, start + std::chrono::seconds(30), cancelled, what);
  } catch (...) {
    error = std::current_exception();
  }
  elapsed = Clock::now() - start;
  CHECK_MSG(isA<CancelledError>(error), messageOf(error));
  CHECK(elapsed < std::chrono::milliseconds(100 + 5 * kCancelPollMs));
}

// HETCOMM_TLS_VERIFY_NAME=host: which hosts a peer's certificate names, as OpenSSL's rules say
// (hand-made cases: a certificate with a subjectAltName, and one with only a common name).
TEST_CASE(peerCertificateNamesItsHosts) {
  const Pki& pki = requirePki();
  auto a = contextOf(pki, "a", "caA");
  auto d = contextOf(pki, "d", "caA");
  SecureLink s = secureLink(*a, *d);  // a serves, d connects
  // What the server sees of d: the subjectAltName only (its CN is not a name once it has DNS entries).
  for (const char* host : {"node-d.example", "NODE-D.example", "h12.rack7.example", "127.0.0.1", "::1", "0:0::1",
                           "::1%lo"}) {
    CHECK_MSG(s.serverSession->namesHost(host), host);
  }
  for (const char* host : {"rank-d", "node-e.example", "a.b.rack7.example", "rack7.example", "127.0.0.2", "::2",
                           "127.0.0.1.example", ""}) {
    std::string names;
    CHECK_MSG(!s.serverSession->namesHost(host, &names), host);
    CHECK_MSG(contains(names, "CN=rank-d"), names);
  }
  // What the client sees of a: no subjectAltName, so its common name.
  CHECK(s.clientSession->namesHost("rank-a"));
  std::string names;
  CHECK(!s.clientSession->namesHost("rank-b", &names));
  CHECK_MSG(contains(names, "CN=rank-a"), names);
  CHECK(!s.clientSession->namesHost("127.0.0.1"));
}

// (h) Bytes decrypted but not yet read wait in OpenSSL, not in the socket: pending() says so and
// waitLinks reports the link receivable without sleeping.
TEST_CASE(pendingBytesAreReportedReadable) {
  const Pki& pki = requirePki();
  auto context = contextOf(pki, "a", "caA");
  SecureLink s = secureLink(*context, *context);
  Link& client = *s.client;

  constexpr size_t kBytes = 100 * 1024;
  const std::vector<uint8_t> sent = randomBytes(kBytes, 3);
  Sender sender{s.server.get(), &sent, std::mt19937_64(0)};
  sender.offer = kBytes;  // one write of everything (it takes several calls only if the socket is full)
  pump(*s.server, &sender, nullptr, Clock::now() + kTestTimeout);

  // A receiver and, on the same link, a sender with nothing to wait for: the entry that asked to
  // receive is the one reported ready.
  auto waitToReceive = [&](std::chrono::milliseconds timeout) {
    LinkWait w[2] = {{&client, /*send=*/false, /*recv=*/true}, {&client, /*send=*/false, /*recv=*/false}};
    const int rc = waitLinks(w, 2, timeout);
    CHECK(!w[1].ready);
    return rc == 1 && w[0].ready;
  };
  std::vector<uint8_t> got(kBytes);
  REQUIRE(waitToReceive(std::chrono::seconds(10)));
  REQUIRE(client.recv(got.data(), 1) == 1);
  CHECK(s.clientSession->pending());  // the rest of the first record
  CHECK(client.receivable());
  auto start = Clock::now();
  CHECK(waitToReceive(std::chrono::seconds(5)));
  CHECK(Clock::now() - start < std::chrono::milliseconds(100));

  // Read all but the last byte: every record has left the socket, one byte waits in OpenSSL.
  size_t done = 1;
  while (done < kBytes - 1) {
    REQUIRE(waitToReceive(std::chrono::seconds(10)));
    const ssize_t n = client.recv(got.data() + done, kBytes - 1 - done);
    REQUIRE(n > 0 || (n < 0 && errno == EAGAIN));
    if (n > 0) done += static_cast<size_t>(n);
  }
  CHECK(s.clientSession->pending());
  pollfd p{client.pollFd(), POLLIN, 0};
  CHECK_EQ(::poll(&p, 1, 0), 0);  // the socket itself is not readable ...
  start = Clock::now();
  CHECK(waitToReceive(std::chrono::seconds(5)));  // ... but the link is
  CHECK(Clock::now() - start < std::chrono::milliseconds(100));
  CHECK_EQ(client.recv(got.data() + done, kBytes - done), 1);
  CHECK(got == sent);
  CHECK(!s.clientSession->pending());
  CHECK(!client.receivable());
  CHECK(!waitToReceive(std::chrono::milliseconds(20)));
}

// After the handshake: garbage in the stream is a protocol error (EPROTO, lastError says why),
// and writing to a peer that closed gives EPIPE or ECONNRESET, not SIGPIPE.
TEST_CASE(failuresAfterTheHandshake) {
  const Pki& pki = requirePki();
  auto context = contextOf(pki, "a", "caA");
  SecureLink s = secureLink(*context, *context);
  Link& server = *s.server;
  Link& client = *s.client;

  const char garbage[] = "this is not a TLS record, it is plaintext";
  REQUIRE(::send(client.pollFd(), garbage, sizeof(garbage), MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof(garbage)));
  LinkWait w{&server, false, true};
  REQUIRE(waitLinks(&w, 1, std::chrono::seconds(10)) == 1);
  char buf[64];
  errno = 0;
  CHECK_EQ(server.recv(buf, sizeof(buf)), -1);
  CHECK_EQ(errno, EPROTO);
  CHECK_MSG(contains(s.serverSession->lastError(), "TLS receive failed: "), s.serverSession->lastError());
  std::printf("  %s\n", s.serverSession->lastError().c_str());
  errno = 0;
  CHECK_EQ(server.recv(buf, sizeof(buf)), -1);  // sticky
  CHECK_EQ(errno, EPROTO);

  REQUIRE(signal(SIGPIPE, SIG_DFL) != SIG_ERR);  // a SIGPIPE would end the test program
  s.server.reset();  // the session, then the socket
  std::vector<uint8_t> block(1 << 20);
  ssize_t n = 0;
  for (int i = 0; i < 200 && n >= 0; ++i) {
    n = client.send(block.data(), block.size());
    if (n < 0 && errno == EAGAIN) {
      n = 0;
      LinkWait out{&client, true, false};
      waitLinks(&out, 1, std::chrono::milliseconds(10));
    }
  }
  CHECK_EQ(n, -1);
  CHECK_MSG(errno == EPIPE || errno == ECONNRESET, std::strerror(errno));
  CHECK_MSG(contains(s.clientSession->lastError(), "TLS send failed: "), s.clientSession->lastError());
  // A peer that is gone shows as hung up, without a read.
  CHECK(client.hungUp());
}

// A TCP link is the socket itself (no OpenSSL needed): bytes as sent, EAGAIN when there are none,
// readiness from the socket, and a peer that closes shows as hung up.
TEST_CASE(tcpLinksAreThePlainSocket) {
  SocketPair pair = loopbackPair();
  std::unique_ptr<Link> server = tcpLink(std::move(pair.server)), client = tcpLink(std::move(pair.client));
  CHECK(client->kind() == Link::Kind::kTcp);
  CHECK(!server->hungUp());
  LinkWait w{server.get(), false, true};
  CHECK_EQ(waitLinks(&w, 1, std::chrono::milliseconds(20)), 0);
  CHECK(!w.ready);
  CHECK_EQ(client->send("abc", 3), 3);
  CHECK_EQ(waitLinks(&w, 1, std::chrono::seconds(5)), 1);
  CHECK(w.ready);
  char buf[4] = {};
  CHECK_EQ(server->recv(buf, sizeof(buf)), 3);
  CHECK(std::string(buf) == "abc");
  errno = 0;
  CHECK_EQ(server->recv(buf, sizeof(buf)), -1);
  CHECK_EQ(errno, EAGAIN);
  client.reset();
  CHECK_EQ(waitLinks(&w, 1, std::chrono::seconds(5)), 1);  // the close wakes a receiver
  CHECK(server->hungUp());
  CHECK_EQ(server->recv(buf, sizeof(buf)), 0);
}
