#pragma once
// TLS 1.3 on hetcomm's TCP links (HETCOMM_TLS=all|inter-site|off), mutually authenticated: every
// rank presents a certificate signed by the cluster's CA (HETCOMM_TLS_CA) and accepts only peers
// that do the same. By default any certificate the CA signed is accepted, whatever it names, so
// the CA should sign the cluster's certificates and nothing else. HETCOMM_TLS_VERIFY_NAME=host
// restricts a certificate to the ranks on the hosts it names: the peer's certificate must name
// the host of the address that the peer's rank published, checked by both ends of every TLS link
// (Session::namesHost; the mesh decides which address, tcp_mesh.cc and tcp_mesh_accept.cc). Ranks publish numeric
// addresses, so in practice the certificate needs an IP entry in its subjectAltName.
//
// OpenSSL is loaded at run time (dlopen of libssl.so.3, else libssl.so, or HETCOMM_TLS_LIBSSL),
// never linked and its headers never included: hetcomm builds and runs without it, and its absence
// is an error only when TLS is asked for. tls_openssl.h declares the few functions it uses from
// OpenSSL 3's ABI, tls.cc the constants.
//
// A link uses it like this (link.h):
//   auto context = Context::create(configFromEnv());             // once per process group
//   ... connect or accept a non-blocking TCP socket ...
//   auto link = tlsLink(std::move(socket), Session::handshake(*context, fd, isServer, deadline, cancelled, what));
// and everything above the link does its I/O through it, never knowing whether it is encrypted.
//
// SIGPIPE: the Session's socket I/O goes through a BIO of our own that calls ::send(MSG_NOSIGNAL)
// and ::recv, so writing to a connection the peer closed returns EPIPE instead of killing the
// process. (OpenSSL's socket BIO calls write(), which raises SIGPIPE; blocking the signal around
// every SSL call instead would cost two syscalls a call and still leave a pending signal behind.)
#include <poll.h>
#include <sys/types.h>
#include <time.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "common/error.h"
#include "transport/socket.h"

// OpenSSL's opaque types (the struct tags of its typedefs SSL_CTX and SSL).
struct ssl_ctx_st;
struct ssl_st;

namespace hetcomm {
namespace tls {

namespace detail {
// What a session's BIO (our socket I/O routines, called by OpenSSL) shares with the session.
struct SocketIo {
  int fd = -1;
  int lastErrno = 0;  // errno of the last failed ::send/::recv (EAGAIN included)
  bool eof = false;   // ::recv returned 0
};
}  // namespace detail

// A TLS failure: OpenSSL missing or unusable, a certificate or key that cannot be loaded, a
// handshake that failed, or a bad HETCOMM_TLS* setting. The message says what happened on this
// side in plain words.
class TlsError : public CommError {
 public:
  explicit TlsError(const std::string& what) : CommError(what) {}
};

// The TCP connection ended (EOF, reset) during a TLS handshake, with no TLS alert or error: the
// other side gave up (its handshake deadline on a slow link, a shortage of descriptors). Unlike
// a refused certificate, worth trying again.
class TlsConnectionLost : public TlsError {
 public:
  explicit TlsConnectionLost(const std::string& what) : TlsError(what) {}
};

// Whether TLS can be used in this process: OpenSSL 3 was loaded and has every function used.
// When not, *why (if given) says why ("dlopen(libssl.so.3): ... No such file or directory").
// The first call loads the library (once per process, thread-safe); later calls only read.
bool available(std::string* why = nullptr);

struct Config {
  // kInterSite: only links between ranks of different sites are encrypted (the caller decides
  // which links those are); kAll: every TCP link.
  enum class Mode { kOff, kInterSite, kAll };
  Mode mode = Mode::kOff;
  // HETCOMM_TLS_VERIFY_NAME=host: a peer's certificate must name its rank's host (above).
  bool verifyHost = false;
  std::string cert;  // PEM certificate chain of this process (leaf first)
  std::string key;   // PEM private key of that certificate
  std::string ca;    // PEM certificates of the CA(s) that sign the peers' certificates
};
// "off", "inter-site" or "all": the spelling of HETCOMM_TLS.
const char* modeName(Config::Mode mode);
// HETCOMM_TLS=all|inter-site|off (default off) and, when not off, the files HETCOMM_TLS_CERT,
// HETCOMM_TLS_KEY and HETCOMM_TLS_CA, which are then required, and HETCOMM_TLS_VERIFY_NAME=host|off
// (default off; host without TLS is an error, not a silent no-op). Throws TlsError naming the
// variable at fault. Files are read by Context::create, not here.
Config configFromEnv();

// The TLS settings and credentials shared by every connection of a process group (an SSL_CTX):
// TLS 1.3 only, mutual authentication against config.ca, no session tickets, no renegotiation.
// Immutable after create(), so that sessions on any thread may use it at once. Sessions hold a
// reference of their own to the SSL_CTX: the Context may go before them.
class Context {
 public:
  // Throws TlsError when OpenSSL cannot be loaded, a file cannot be read or parsed, or the key
  // does not match the certificate (the message names the files and OpenSSL's reason).
  static std::shared_ptr<Context> create(const Config& config);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  // Config::verifyHost: the links check that a peer's certificate names its rank's host.
  bool verifiesHost() const { return verifyHost_; }
  // Whether this process's own certificate names `host` (as Session::namesHost).
  bool namesHost(const std::string& host, std::string* names = nullptr) const;

 private:
  friend class Session;
  Context(ssl_ctx_st* ctx, bool verifyHost) : ctx_(ctx), verifyHost_(verifyHost) {}
  ssl_ctx_st* ctx_;
  bool verifyHost_;
};

// One TLS connection (an SSL) on one connected, non-blocking TCP socket. It uses the fd but does
// not own it: destroy the session before closing the fd, or its I/O could reach
// another connection that reuses the number. Destroying it sends nothing.
//
// read() and write() may be called from two threads at once (a mutex serialises the SSL calls,
// which never block). A session's errors are sticky: after a failure every call fails alike.
class Session {
 public:
  // Runs the TLS handshake as the server (the side that accepted the TCP connection) or the
  // client, waiting in poll() for the socket, until the deadline (TimeoutError) or until
  // cancelled() turns true (CancelledError, asked at least every kCancelPollMs). Both sides must
  // call it: after the TLS handshake proper the server sends one confirmation byte and the client
  // waits for it, because in TLS 1.3 a client finishes its handshake before the server has
  // checked the client's certificate, and would otherwise learn of a refusal only at its first
  // read. `what` names the peer for messages ("rank 3 (10.0.0.5:29500)"). Throws TlsError when
  // the handshake fails, saying why on this side: "the peer's certificate was rejected: <reason>",
  // "the peer refused our certificate (alert: <alert>)", "the peer is not speaking TLS", ...
  static std::unique_ptr<Session> handshake(const Context& context, int fd, bool server, Deadline deadline,
                                            const Cancelled& cancelled, const std::function<std::string()>& what);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  int fd() const { return io_.fd; }

  // ::send semantics: the number of bytes taken (> 0, often fewer than len: OpenSSL takes a record
  // of 16 KB, or a few, a call), or -1 with errno EAGAIN when the socket cannot take more, or EPIPE/ECONNRESET/EPROTO/... on failure (then
  // lastError() says what happened). Never raises SIGPIPE.
  // OpenSSL's retry rule: after -1/EAGAIN, the next write() must offer at least the same bytes
  // again, starting at the same byte (the buffer may move: SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER).
  // OpenSSL has already encrypted and partly sent a record of them, and reports those bytes taken
  // only on that retry. Writers that retry what is left of the same message keep the rule.
  ssize_t write(const void* data, size_t len);
  // ::recv semantics: the number of bytes read (> 0), 0 when the peer closed the connection
  // (close_notify, or a TCP EOF without one: a truncated stream is for the framing above to
  // notice), or -1 with errno EAGAIN when nothing can be read now, or ECONNRESET/EPROTO/... on
  // failure (lastError() says what). Reads until len bytes or until OpenSSL needs more bytes from
  // the socket, so that a short read leaves nothing decrypted behind in OpenSSL.
  ssize_t read(void* data, size_t len);
  // True when the next read() returns at once without the socket becoming readable: decrypted
  // bytes wait in OpenSSL (the caller read fewer than a record holds), or a close or an error
  // met after a read's last byte is still to be reported. A caller must not sleep in poll()
  // while this is true; waitLinks() (link.h) takes care of it.
  bool pending() const;
  // What the failure of read() or write() was ("TLS send failed: Broken pipe", "TLS receive
  // failed: TLS error: decryption failed or bad record mac"); empty if none.
  std::string lastError() const;
  // Whether the peer's certificate names `host`: an IP address (an IPv6 zone, "%eth0", dropped) as
  // an IP entry of its subjectAltName; a DNS name as a DNS entry, wildcards in the leftmost label
  // allowed, or as its common name when it has no DNS entries (OpenSSL's X509_check_ip_asc /
  // X509_check_host). An empty host is named by none. When not named, *names (if given) is the
  // certificate's subject ("/CN=node-3"), for the error message.
  bool namesHost(const std::string& host, std::string* names = nullptr) const;
  // Sends a close_notify alert, best effort and without waiting, so that the peer's read()
  // returns 0 rather than relying on the TCP EOF. Later writes fail with EPIPE.
  void closeNotify();

 private:
  explicit Session(int fd) { io_.fd = fd; }
  // Repeats one handshake call (`step`, returning OpenSSL's 1 for done) until it succeeds,
  // waiting in poll() for what OpenSSL asks; throws the handshake's errors.
  void driveHandshake(const std::function<int()>& step, Deadline deadline, const Cancelled& cancelled,
                      const std::function<std::string()>& what);
  // Why the SSL call that returned SSL_get_error() code `sslError` failed, in plain words, worded
  // for a handshake or for an established connection (drains OpenSSL's error queue).
  std::string describeFailure(int sslError, bool handshaking) const;
  // Records the failure of a read() or write(): sets failedErrno_ and lastError_.
  void recordFailure(int sslError, const char* doing);

  mutable std::mutex mutex_;
  ssl_st* ssl_ = nullptr;
  detail::SocketIo io_;
  bool closed_ = false;    // the peer closed the connection (read() returns 0 from now on)
  int failedErrno_ = 0;    // sticky failure
  bool unreported_ = false;  // closed_ or failedErrno_ met by a read() that returned bytes
  bool writeShut_ = false;   // closeNotify() was called
  std::string lastError_;
};

}  // namespace tls
}  // namespace hetcomm
