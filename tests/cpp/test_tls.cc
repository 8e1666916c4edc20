// The TLS layer over loopback TCP, with throwaway certificates (tls_pki.h): a mutual handshake
// and 64 MB each way at once through sendOn/recvOn/pollOn; certificates of another CA refused
// with a message on each side; a plaintext peer; a deadline and a cancellation during the
// handshake; no OpenSSL at all (in a child process, since the library is loaded once); the
// HETCOMM_TLS* settings; credentials that cannot be used; bytes left in OpenSSL's buffer reported
// readable by pollOn; failures after the handshake (garbage, a closed peer) without SIGPIPE.
// Without OpenSSL or the openssl tool the tests that need them are skipped (exit code 77).
#include <errno.h>
#include <signal.h>
#include <sys/resource.h>
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
#include "tls_pki.h"
#include "transport/framing.h"
#include "transport/socket.h"
#include "transport/tls.h"

using namespace hetcomm;
using tls_pki::Pki;

namespace {

constexpr auto kTestTimeout = std::chrono::seconds(60);

const Pki& requirePki() {
  std::string why;
  if (!tls::available(&why)) SKIP_TEST("OpenSSL cannot be loaded: " + why);
  const Pki& pki = Pki::get();
  if (!pki.error().empty()) SKIP_TEST(pki.error());
  return pki;
}

tls::Config configOf(const Pki& pki, const std::string& leaf, const std::string& ca) {
  tls::Config c;
  c.mode = tls::Config::Mode::kAll;
  c.cert = pki.path(leaf + ".pem");
  c.key = pki.path(leaf + ".key");
  c.ca = pki.path(ca + ".pem");
  return c;
}

std::shared_ptr<tls::Context> contextOf(const Pki& pki, const std::string& leaf, const std::string& ca) {
  return tls::Context::create(configOf(pki, leaf, ca));
}

// A connected pair of non-blocking loopback sockets.
struct Link {
  Socket server, client;
};

Link loopbackLink() {
  Socket listener = listenOn("127.0.0.1", 0);
  Link link;
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

// The message of what fn() throws (a CommError), or "(no error)".
template <typename Fn>
std::string errorOf(Fn fn) {
  try {
    fn();
  } catch (const CommError& e) {
    return e.what();
  }
  return "(no error)";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Both handshakes at once, the server's on a thread; each side's session or exception.
struct Handshakes {
  std::shared_ptr<tls::Session> server, client;
  std::exception_ptr serverError, clientError;
};

// With closeOnFailure the server closes its socket as soon as its handshake fails, as a real
// acceptor would (unread bytes then make it a reset), rather than after both sides are done.
Handshakes handshakeBoth(const tls::Context& serverContext, const tls::Context& clientContext, Link& link,
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

// Detaches on destruction, before the Link's sockets close (the registry's lifetime rule).
struct Attached {
  explicit Attached(const Handshakes& h, const Link& link) : fds{link.server.fd(), link.client.fd()} {
    tls::attach(fds[0], h.server);
    tls::attach(fds[1], h.client);
  }
  ~Attached() {
    for (int fd : fds) tls::detach(fd);
  }
  int fds[2];
};

// A loopback link after a successful handshake, its sessions attached.
struct SecureLink {
  Link link;
  Handshakes h;
  std::unique_ptr<Attached> attached;  // declared last, destroyed first: detaches before the close
  int serverFd() const { return link.server.fd(); }
  int clientFd() const { return link.client.fd(); }
};

SecureLink secureLink(const tls::Context& serverContext, const tls::Context& clientContext) {
  SecureLink s;
  s.link = loopbackLink();
  s.h = handshakeBoth(serverContext, clientContext, s.link);
  CHECK_MSG(!s.h.serverError, messageOf(s.h.serverError));
  CHECK_MSG(!s.h.clientError, messageOf(s.h.clientError));
  REQUIRE(s.h.server && s.h.client);
  s.attached = std::make_unique<Attached>(s.h, s.link);
  return s;
}

// Sizes of writes and reads: from 1 byte to 1 MB, log-uniformly, so that records are cut
// anywhere and many calls take less than a record.
size_t randomSize(std::mt19937_64& rng) {
  const int bits = static_cast<int>(rng() % 21);
  return 1 + static_cast<size_t>(rng() % (size_t{1} << bits));
}

// One direction of a transfer through sendOn/recvOn, advanced by step() until it would block.
struct Sender {
  int fd;
  const std::vector<uint8_t>* data;
  std::mt19937_64 rng;
  size_t done = 0;
  size_t offer = 0;  // kept after EAGAIN: the next write must offer at least the same bytes
  bool finished() const { return done == data->size(); }
  void step() {
    while (!finished()) {
      if (offer == 0) offer = std::min(randomSize(rng), data->size() - done);
      const ssize_t n = tls::sendOn(fd, data->data() + done, offer);
      if (n < 0 && errno == EAGAIN) return;
      if (n <= 0) throw std::runtime_error(std::string("sendOn failed: ") + std::strerror(errno));
      done += static_cast<size_t>(n);
      offer = 0;
    }
  }
};

struct Receiver {
  int fd;
  std::vector<uint8_t>* out;
  std::mt19937_64 rng;
  size_t done = 0;
  bool finished() const { return done == out->size(); }
  void step() {
    while (!finished()) {
      const size_t want = std::min(randomSize(rng), out->size() - done);
      const ssize_t n = tls::recvOn(fd, out->data() + done, want);
      if (n < 0 && errno == EAGAIN) return;
      if (n == 0) throw std::runtime_error("recvOn: the peer closed the connection");
      if (n < 0) throw std::runtime_error(std::string("recvOn failed: ") + std::strerror(errno));
      done += static_cast<size_t>(n);
    }
  }
};

// Runs the given directions (on one fd) to the end, sleeping in pollOn in between.
void pump(int fd, Sender* sender, Receiver* receiver, Deadline deadline) {
  while ((sender != nullptr && !sender->finished()) || (receiver != nullptr && !receiver->finished())) {
    if (sender != nullptr) sender->step();
    if (receiver != nullptr) receiver->step();
    pollfd p{fd, 0, 0};
    if (sender != nullptr && !sender->finished()) p.events |= POLLOUT;
    if (receiver != nullptr && !receiver->finished()) p.events |= POLLIN;
    if (p.events == 0) break;
    if (Clock::now() > deadline) throw std::runtime_error("the transfer did not finish in time");
    if (tls::pollOn(&p, 1, 1000) < 0 && errno != EINTR) throw std::runtime_error("pollOn failed");
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
  const Handshakes& h = s.h;
  const int sfd = s.serverFd(), cfd = s.clientFd();
  CHECK(tls::sessionOf(sfd) == h.server.get());
  CHECK(tls::sessionOf(cfd) == h.client.get());

  constexpr size_t kBytes = 64 << 20;
  const std::vector<uint8_t> toClient = randomBytes(kBytes, 1), toServer = randomBytes(kBytes, 2);
  std::vector<uint8_t> atClient(kBytes), atServer(kBytes);
  const Deadline deadline = Clock::now() + kTestTimeout;
  Worker server([&] {
    Sender s{sfd, &toClient, std::mt19937_64(11)};
    Receiver r{sfd, &atServer, std::mt19937_64(12)};
    pump(sfd, &s, &r, deadline);
  });
  Worker clientWriter([&] {
    Sender s{cfd, &toServer, std::mt19937_64(21)};
    pump(cfd, &s, nullptr, deadline);
  });
  Worker clientReader([&] {
    Receiver r{cfd, &atClient, std::mt19937_64(22)};
    pump(cfd, nullptr, &r, deadline);
  });
  server.join();
  clientWriter.join();
  clientReader.join();
  CHECK_MSG(!server.error, messageOf(server.error));
  CHECK_MSG(!clientWriter.error, messageOf(clientWriter.error));
  CHECK_MSG(!clientReader.error, messageOf(clientReader.error));
  CHECK(atClient == toClient);
  CHECK(atServer == toServer);

  // A clean close: close_notify reads as 0, and the closing side can write no more.
  h.client->closeNotify();
  char c;
  ssize_t n = -1;
  for (int i = 0; i < 1000 && n < 0; ++i) {
    n = tls::recvOn(sfd, &c, 1);
    if (n < 0 && errno == EAGAIN) {
      pollfd p{sfd, POLLIN, 0};
      tls::pollOn(&p, 1, 10);
    }
  }
  CHECK_EQ(n, 0);
  errno = 0;
  CHECK_EQ(tls::sendOn(cfd, "x", 1), -1);
  CHECK_EQ(errno, EPIPE);
}

// (b) A certificate signed by another CA is refused, and each side says which way round.
TEST_CASE(certificateOfAnotherCaIsRefused) {
  const Pki& pki = requirePki();
  auto trusted = contextOf(pki, "a", "caA");
  for (bool closeOnFailure : {false, true}) {
    // The server refuses the client's certificate.
    auto stranger = contextOf(pki, "c", "caA");
    Link link = loopbackLink();
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
    Link link = loopbackLink();
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
    Link link = loopbackLink();
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
  Link link = loopbackLink();
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

  Link other = loopbackLink();
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

// (e), in a child process: what available() and Context::create say without OpenSSL.
// Does nothing in an ordinary run; availabilityWithoutOpenSsl runs it with HETCOMM_TLS_TEST_CHILD.
TEST_CASE(childReportsAvailability) {
  if (std::getenv("HETCOMM_TLS_TEST_CHILD") == nullptr) return;
  std::string why;
  const bool ok = tls::available(&why);
  std::printf("available=%d\nwhy=%s\n", ok ? 1 : 0, why.c_str());
  tls::Config config;
  config.mode = tls::Config::Mode::kAll;
  try {
    tls::Context::create(config);
    std::printf("create=ok\n");
  } catch (const tls::TlsError& e) {
    std::printf("create=%s\n", e.what());
  }
}

TEST_CASE(availabilityWithoutOpenSsl) {
  int out[2];
  REQUIRE(::pipe(out) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::dup2(out[1], STDOUT_FILENO);
    ::close(out[0]);
    ::close(out[1]);
    ::setenv("HETCOMM_TLS_LIBSSL", "/nonexistent/libssl.so.3", 1);
    ::setenv("HETCOMM_TLS_TEST_CHILD", "1", 1);
    const char* argv[] = {"test_tls", "childReportsAvailability", nullptr};
    ::execv("/proc/self/exe", const_cast<char* const*>(argv));
    ::_exit(127);
  }
  ::close(out[1]);
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = ::read(out[0], buf, sizeof(buf))) != 0;) {
    if (n > 0) text.append(buf, static_cast<size_t>(n));
    if (n < 0 && errno != EINTR) break;
  }
  ::close(out[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, text);
  CHECK_MSG(contains(text, "available=0\n"), text);
  CHECK_MSG(contains(text, "why=dlopen(/nonexistent/libssl.so.3): "), text);
  CHECK_MSG(contains(text, "create=hetcomm: TLS requested (HETCOMM_TLS=all) but OpenSSL could not be loaded: dlopen("), text);
}

// (f) The settings: defaults, a bad mode, a missing file variable.
TEST_CASE(configFromEnvironment) {
  const char* vars[] = {"HETCOMM_TLS", "HETCOMM_TLS_CERT", "HETCOMM_TLS_KEY", "HETCOMM_TLS_CA"};
  for (const char* v : vars) ::unsetenv(v);
  CHECK(tls::configFromEnv().mode == tls::Config::Mode::kOff);

  ::setenv("HETCOMM_TLS", "yes", 1);
  std::string message = errorOf(tls::configFromEnv);
  CHECK_MSG(contains(message, "HETCOMM_TLS=yes is not one of all, inter-site, off"), message);

  ::setenv("HETCOMM_TLS", "inter-site", 1);
  ::setenv("HETCOMM_TLS_KEY", "/k.pem", 1);
  ::setenv("HETCOMM_TLS_CA", "/ca.pem", 1);
  message = errorOf(tls::configFromEnv);
  CHECK_MSG(contains(message, "HETCOMM_TLS=inter-site needs HETCOMM_TLS_CERT"), message);

  ::setenv("HETCOMM_TLS_CERT", "/c.pem", 1);
  const tls::Config c = tls::configFromEnv();
  CHECK(c.mode == tls::Config::Mode::kInterSite);
  CHECK(c.cert == "/c.pem" && c.key == "/k.pem" && c.ca == "/ca.pem");
  ::setenv("HETCOMM_TLS", "all", 1);
  CHECK(tls::configFromEnv().mode == tls::Config::Mode::kAll);
  ::setenv("HETCOMM_TLS", "off", 1);
  CHECK(tls::configFromEnv().mode == tls::Config::Mode::kOff);
  for (const char* v : vars) ::unsetenv(v);
}

// (g) Credentials that cannot be used: the message names the files.
TEST_CASE(unusableCredentialsNameTheFiles) {
  const Pki& pki = requirePki();
  auto failure = [](const tls::Config& config) { return errorOf([&] { tls::Context::create(config); }); };
  tls::Config mismatched = configOf(pki, "a", "caA");
  mismatched.key = pki.path("b.key");
  std::string message = failure(mismatched);
  CHECK_MSG(contains(message, "HETCOMM_TLS_KEY=" + pki.path("b.key")), message);
  CHECK_MSG(contains(message, "HETCOMM_TLS_CERT=" + pki.path("a.pem")), message);
  CHECK_MSG(contains(message, "key values mismatch"), message);
  std::printf("  %s\n", message.c_str());

  tls::Config missing = configOf(pki, "a", "caA");
  missing.cert = pki.path("missing.pem");
  message = failure(missing);
  CHECK_MSG(contains(message, "cannot read HETCOMM_TLS_CERT=" + missing.cert + ": No such file or directory"), message);

  tls::Config notPem = configOf(pki, "a", "caA");
  notPem.ca = pki.path("openssl.log");  // a readable file without a certificate in it
  message = failure(notPem);
  CHECK_MSG(contains(message, "cannot load the CA certificates HETCOMM_TLS_CA=" + notPem.ca), message);

  tls::Config keyAsCert = configOf(pki, "a", "caA");
  keyAsCert.cert = pki.path("a.key");
  message = failure(keyAsCert);
  CHECK_MSG(contains(message, "cannot load the certificate chain HETCOMM_TLS_CERT=" + keyAsCert.cert), message);
}

// (h) Bytes decrypted but not yet read wait in OpenSSL, not in the socket: pending() says so and
// pollOn reports the fd readable without sleeping.
TEST_CASE(pendingBytesAreReportedReadable) {
  const Pki& pki = requirePki();
  auto context = contextOf(pki, "a", "caA");
  SecureLink s = secureLink(*context, *context);
  const Handshakes& h = s.h;
  const int sfd = s.serverFd(), cfd = s.clientFd();

  constexpr size_t kBytes = 100 * 1024;
  const std::vector<uint8_t> sent = randomBytes(kBytes, 3);
  Sender sender{sfd, &sent, std::mt19937_64(0)};
  sender.offer = kBytes;  // one write of everything (sendOn takes it in several calls only if the socket is full)
  pump(sfd, &sender, nullptr, Clock::now() + kTestTimeout);

  std::vector<uint8_t> got(kBytes);
  pollfd p{cfd, POLLIN, 0};
  REQUIRE(tls::pollOn(&p, 1, 10000) == 1);
  REQUIRE(tls::recvOn(cfd, got.data(), 1) == 1);
  CHECK(h.client->pending());  // the rest of the first record
  p.revents = 0;
  auto start = Clock::now();
  CHECK_EQ(tls::pollOn(&p, 1, 5000), 1);
  CHECK(p.revents & POLLIN);
  CHECK(Clock::now() - start < std::chrono::milliseconds(100));

  // Read all but the last byte: every record has left the socket, one byte waits in OpenSSL.
  size_t done = 1;
  while (done < kBytes - 1) {
    p = {cfd, POLLIN, 0};
    REQUIRE(tls::pollOn(&p, 1, 10000) == 1);
    const ssize_t n = tls::recvOn(cfd, got.data() + done, kBytes - 1 - done);
    REQUIRE(n > 0 || (n < 0 && errno == EAGAIN));
    if (n > 0) done += static_cast<size_t>(n);
  }
  CHECK(h.client->pending());
  p = {cfd, POLLIN, 0};
  CHECK_EQ(::poll(&p, 1, 0), 0);  // the socket itself is not readable ...
  p = {cfd, POLLIN, 0};
  start = Clock::now();
  CHECK_EQ(tls::pollOn(&p, 1, 5000), 1);  // ... but the session is
  CHECK(Clock::now() - start < std::chrono::milliseconds(100));
  timespec fiveSeconds{5, 0};
  p = {cfd, POLLIN, 0};
  CHECK_EQ(tls::ppollOn(&p, 1, &fiveSeconds), 1);
  CHECK_EQ(tls::recvOn(cfd, got.data() + done, kBytes - done), 1);
  CHECK(got == sent);
  CHECK(!h.client->pending());
  p = {cfd, POLLIN, 0};
  CHECK_EQ(tls::pollOn(&p, 1, 20), 0);
}

// After the handshake: garbage in the stream is a protocol error (EPROTO, lastError says why),
// and writing to a peer that closed gives EPIPE or ECONNRESET, not SIGPIPE.
TEST_CASE(failuresAfterTheHandshake) {
  const Pki& pki = requirePki();
  auto context = contextOf(pki, "a", "caA");
  SecureLink s = secureLink(*context, *context);
  const Handshakes& h = s.h;
  const int sfd = s.serverFd(), cfd = s.clientFd();

  const char garbage[] = "this is not a TLS record, it is plaintext";
  REQUIRE(::send(cfd, garbage, sizeof(garbage), MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof(garbage)));
  pollfd p{sfd, POLLIN, 0};
  REQUIRE(tls::pollOn(&p, 1, 10000) == 1);
  char buf[64];
  errno = 0;
  CHECK_EQ(tls::recvOn(sfd, buf, sizeof(buf)), -1);
  CHECK_EQ(errno, EPROTO);
  CHECK_MSG(contains(h.server->lastError(), "TLS receive failed: "), h.server->lastError());
  std::printf("  %s\n", h.server->lastError().c_str());
  errno = 0;
  CHECK_EQ(tls::recvOn(sfd, buf, sizeof(buf)), -1);  // sticky
  CHECK_EQ(errno, EPROTO);

  REQUIRE(signal(SIGPIPE, SIG_DFL) != SIG_ERR);  // a SIGPIPE would end the test program
  tls::detach(sfd);
  s.link.server.close();
  std::vector<uint8_t> block(1 << 20);
  ssize_t n = 0;
  for (int i = 0; i < 200 && n >= 0; ++i) {
    n = tls::sendOn(cfd, block.data(), block.size());
    if (n < 0 && errno == EAGAIN) {
      n = 0;
      p = {cfd, POLLOUT, 0};
      tls::pollOn(&p, 1, 10);
    }
  }
  CHECK_EQ(n, -1);
  CHECK_MSG(errno == EPIPE || errno == ECONNRESET, std::strerror(errno));
  CHECK_MSG(contains(h.client->lastError(), "TLS send failed: "), h.client->lastError());
}

// Without a session sendOn/recvOn/pollOn are ::send/::recv/::poll (no OpenSSL needed).
TEST_CASE(plainFdsPassThrough) {
  CHECK(tls::sessionOf(-1) == nullptr);
  Link plain = loopbackLink();
  CHECK(tls::sessionOf(plain.client.fd()) == nullptr);
  CHECK_EQ(tls::sendOn(plain.client.fd(), "abc", 3), 3);
  pollfd p{plain.server.fd(), POLLIN, 0};
  CHECK_EQ(tls::pollOn(&p, 1, 5000), 1);
  char buf[4] = {};
  CHECK_EQ(tls::recvOn(plain.server.fd(), buf, sizeof(buf)), 3);
  CHECK(std::string(buf) == "abc");
  errno = 0;
  CHECK_EQ(tls::recvOn(plain.server.fd(), buf, sizeof(buf)), -1);
  CHECK_EQ(errno, EAGAIN);
}

// The registry beyond its table: fds >= 65536 are kept in a map under a mutex. Needs an fd
// limit above 70000; where the hard limit is lower this is said and not checked (not skipped,
// which would mark the whole program skipped).
TEST_CASE(registryAboveTheTable) {
  const Pki& pki = requirePki();
  rlimit limit{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &limit) == 0);
  constexpr int kHighFd = 70000;
  if (limit.rlim_cur <= kHighFd) {
    rlimit raised = limit;
    raised.rlim_cur = std::min<rlim_t>(limit.rlim_max, kHighFd + 1);
    if (raised.rlim_cur <= kHighFd || ::setrlimit(RLIMIT_NOFILE, &raised) != 0) {
      std::printf("  NOT CHECKED here: fd %d is above the hard limit RLIMIT_NOFILE=%llu\n", kHighFd,
                  static_cast<unsigned long long>(limit.rlim_max));
      return;
    }
  }
  auto context = contextOf(pki, "a", "caA");
  Link link = loopbackLink();
  Socket high(::dup2(link.client.fd(), kHighFd));
  REQUIRE(high.fd() == kHighFd);
  Link highLink{std::move(link.server), std::move(high)};
  Handshakes h = handshakeBoth(*context, *context, highLink);
  REQUIRE(h.server && h.client);
  {
    Attached attached(h, highLink);
    CHECK(tls::sessionOf(kHighFd) == h.client.get());
    const std::vector<uint8_t> sent = randomBytes(300000, 4);
    std::vector<uint8_t> got(sent.size());
    Sender s{kHighFd, &sent, std::mt19937_64(5)};
    Receiver r{highLink.server.fd(), &got, std::mt19937_64(6)};
    Worker reader([&] { pump(r.fd, nullptr, &r, Clock::now() + kTestTimeout); });
    pump(kHighFd, &s, nullptr, Clock::now() + kTestTimeout);
    reader.join();
    CHECK_MSG(!reader.error, messageOf(reader.error));
    CHECK(got == sent);
  }
  CHECK(tls::sessionOf(kHighFd) == nullptr);
  highLink.client.close();
  if (limit.rlim_cur <= kHighFd) ::setrlimit(RLIMIT_NOFILE, &limit);
}
